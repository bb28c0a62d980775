"""The InfiniBand/RoCE collector against recorded sysfs trees and the project's own trees.

Expected values are computed from the fixture files by this module's own small readers (the rules
the collector documents, written again independently), plus literal spot checks, so a wrong
expectation cannot hide behind a copied number.

Unreadable files: the tests run as root, where ``chmod 000`` does not stop a read, so permission
denied and EIO are simulated by patching ``os.open`` for one path, and "a directory where a counter
should be" by making one.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import shutil
from pathlib import Path
from typing import Any

import msgspec
import pytest

from agent import sysfs
from agent.collectors.base import CollectorContext, Paths
from agent.collectors.infiniband import InfinibandCollector, parse_rate, parse_state
from agent.errors import CollectorFailure
from agent.report import Nic
from tests.sysfs_trees import (
    TREE_SCRIPT,
    TREES,
    assert_open_file_budget,
    assert_steady_cycle_lists_one_directory,
    count,
    open_files,
    text,
    validate,
)

# ---------------------------------------------------------------- independent readers of the files


def expected_counters(port_dir: Path) -> dict[str, int]:
    """counters/, then counters_ext/, then hw_counters/ (a later one wins), without lifespan."""
    values: dict[str, int] = {}
    for sub in ("counters", "counters_ext", "hw_counters"):
        directory = port_dir / sub
        if not directory.is_dir():
            continue
        for path in sorted(directory.iterdir()):
            if path.name == "lifespan":
                continue
            values.pop(path.name, None)
            value = count(path)
            if value is not None:
                values[path.name] = value
    return values


def expected_port(port_dir: Path) -> dict[str, Any]:
    values = expected_counters(port_dir)

    def data(direction: str) -> int | None:
        words = values.get(f"port_{direction}_data_64", values.get(f"port_{direction}_data"))
        return None if words is None else words * 4

    def packets(direction: str) -> int | None:
        for name in (f"port_{direction}_packets_64", f"port_{direction}_packets"):
            if name in values:
                return values[name]
        for prefix in ("port_", ""):
            unicast, multicast = (
                f"{prefix}unicast_{direction}_packets",
                f"{prefix}multicast_{direction}_packets",
            )
            if unicast in values and multicast in values:
                return values[unicast] + values[multicast]
        return None

    rate_text = text(port_dir / "rate")
    link_layer = text(port_dir / "link_layer")
    return {
        "device": port_dir.parent.parent.name,
        "port": int(port_dir.name),
        "link_layer": "Ethernet" if link_layer == "Ethernet" else "InfiniBand",
        "state": text(port_dir / "state").split(":", 1)[1].strip(),
        "phys_state": text(port_dir / "phys_state").split(":", 1)[1].strip(),
        "rate_bytes_per_second": float(rate_text.split()[0]) * 1e9 / 8 if "Gb/sec" in rate_text else None,
        "rx_bytes_total": data("rcv"),
        "tx_bytes_total": data("xmit"),
        "rx_packets_total": packets("rcv"),
        "tx_packets_total": packets("xmit"),
        "counters": values or msgspec.UNSET,
    }


def port_dirs(sys_root: Path) -> list[Path]:
    return list((sys_root / "class" / "infiniband").glob("*/ports/*"))


def as_dict(nic: Nic) -> dict[str, Any]:
    return {f: getattr(nic, f) for f in nic.__struct_fields__ if f != "netdev"}


def collector(sys_root: Path, **kwargs: Any) -> InfinibandCollector:
    return InfinibandCollector(CollectorContext(paths=Paths(sysfs=sys_root)), **kwargs)


def nics_by_port(nics: tuple[Nic, ...]) -> dict[tuple[str, int | None], Nic]:
    return {(n.device, n.port): n for n in nics}


def copy_devices(tmp_path: Path, *names: str, tree: str = "h100") -> Path:
    """A changeable copy of some RDMA devices of one of this project's trees."""
    return TREE_SCRIPT.copy_entries(TREES / tree / "sys", tmp_path / "sys", "infiniband", names)


# ---------------------------------------------------------------- recorded trees


@pytest.fixture(params=["node_exporter", "procfs"])
def recorded(request: pytest.FixtureRequest, recorded_sysfs: Path) -> Path:
    return recorded_sysfs / request.param / "sys"


def test_recorded_tree_reports_every_port_as_its_files_say(recorded: Path) -> None:
    out = collector(recorded).collect()

    assert out.errors == ()
    assert [(n.device, n.port) for n in out.nics] == sorted(
        (p.parent.parent.name, int(p.name)) for p in port_dirs(recorded)
    )
    for nic in out.nics:
        port_dir = recorded / "class" / "infiniband" / nic.device / "ports" / str(nic.port)
        assert as_dict(nic) == expected_port(port_dir), port_dir
        # Neither recording kept the device links a netdev is found through.
        assert nic.netdev is None
    validate(list(out.nics))


def test_recorded_spot_checks(recorded_sysfs: Path) -> None:
    procfs = nics_by_port(collector(recorded_sysfs / "procfs" / "sys").collect().nics)
    mlx5 = procfs[("mlx5_0", 1)]
    assert mlx5.rate_bytes_per_second == 3.125e9  # 25 Gb/sec (1X EDR)
    assert mlx5.tx_bytes_total == 2880761508848 * 4
    assert mlx5.rx_packets_total == 541889824
    assert mlx5.counters
    assert mlx5.counters["rx_write_requests"] == 742114  # from hw_counters/
    assert mlx5.counters["port_xmit_data"] == 2880761508848  # raw words
    assert "lifespan" not in mlx5.counters
    assert procfs[("hfi1_0", 1)].rate_bytes_per_second == 1.25e10  # 100 Gb/sec (4X EDR)

    node_exporter = nics_by_port(collector(recorded_sysfs / "node_exporter" / "sys").collect().nics)
    iwarp = node_exporter[("i40iw0", 1)]
    # Every counter of the iWARP port reads "N/A (no PMA)": unsupported, not zero, not an error.
    assert iwarp.counters is msgspec.UNSET
    assert (iwarp.rx_bytes_total, iwarp.tx_packets_total) == (None, None)
    assert (iwarp.state, iwarp.phys_state, iwarp.rate_bytes_per_second) == ("ACTIVE", "LinkUp", 1.25e9)
    mlx4 = node_exporter[("mlx4_0", 1)]
    assert mlx4.rx_bytes_total == 4631917 * 4  # counters_ext/port_rcv_data_64
    assert mlx4.counters
    assert mlx4.counters["port_xmit_wait"] == 4294967295  # saturated, reported raw


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("400 Gb/sec (4X NDR)", 5.0e10),
        ("800 Gb/sec (4X XDR)", 1.0e11),
        ("100 Gb/sec (4X EDR)", 1.25e10),
        ("56 Gb/sec (4X FDR)", 7.0e9),
        ("25 Gb/sec (1X EDR)", 3.125e9),
        ("10 Gb/sec (4X)", 1.25e9),
        ("2.5 Gb/sec (1X SDR)", 3.125e8),
        ("unknown", None),
        ("", None),
        ("Gb/sec", None),
        (None, None),
    ],
)
def test_parse_rate(text: str | None, expected: float | None) -> None:
    assert parse_rate(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4: ACTIVE", "ACTIVE"),
        ("1: DOWN", "DOWN"),
        ("5: LinkUp", "LinkUp"),
        ("4: PortConfigurationTraining", "PortConfigurationTraining"),
        ("ACTIVE", "ACTIVE"),
        ("4:", None),
        ("", None),
        ("7: " + "x" * 40, None),
        (None, None),
    ],
)
def test_parse_state(text: str | None, expected: str | None) -> None:
    assert parse_state(text) == expected


# ---------------------------------------------------------------- the H100 node


def test_h100_node_reports_eight_ndr_ports_with_their_ipoib_netdevs() -> None:
    root = TREES / "h100" / "sys"
    out = collector(root).collect()

    assert out.errors == ()
    assert [n.device for n in out.nics] == [f"mlx5_{i}" for i in range(8)]
    for nic in out.nics:
        port_dir = root / "class" / "infiniband" / nic.device / "ports" / "1"
        assert as_dict(nic) == expected_port(port_dir)
        assert (nic.state, nic.phys_state, nic.rate_bytes_per_second) == ("ACTIVE", "LinkUp", 5.0e10)
        # The netdev is the interface under the HCA's PCI function.
        pci_net = root / "class" / "infiniband" / nic.device / "device" / "net"
        assert [nic.netdev] == [p.name for p in pci_net.iterdir()]
        assert nic.counters
        files = {p.name for sub in ("counters", "hw_counters") for p in (port_dir / sub).iterdir()}
        assert set(nic.counters) == files - {"lifespan"}
    assert out.nics[0].netdev == "ibp24s0"
    marginal = out.nics[3].counters
    assert marginal
    assert (marginal["symbol_error"], marginal["link_error_recovery"]) == (1843, 2)
    validate(list(out.nics))


def test_committed_trees_are_what_the_script_writes() -> None:
    for name, build in (("h100", TREE_SCRIPT.build_h100), ("edge", TREE_SCRIPT.build_edge)):
        tree = build()
        built = {p: ("file", t) for p, t in tree.files.items()} | {
            p: ("link", t) for p, t in tree.links.items()
        }
        assert built == tree_listing(TREES / name), name


def tree_listing(root: Path) -> dict[str, tuple[str, str]]:
    listing: dict[str, tuple[str, str]] = {}
    for directory, dirs, files in os.walk(root):
        for entry in [*dirs, *files]:
            path = Path(directory, entry)
            key = str(path.relative_to(root))
            if path.is_symlink():
                listing[key] = ("link", os.readlink(path))
            elif path.is_file():
                listing[key] = ("file", path.read_text())
    return listing


# ---------------------------------------------------------------- edge cases


@pytest.fixture
def edge() -> Path:
    return TREES / "edge" / "sys"


def test_edge_ports_sorted_by_device_then_port_numerically(edge: Path) -> None:
    out = collector(edge).collect()
    assert [(n.device, n.port) for n in out.nics] == [
        ("iwarp0", 1),
        ("mlx4_0", 1),
        ("mlx5_0", 1),
        ("mlx5_1", 1),
        ("mlx5_2", 1),
        ("mlx5_10", 1),
        ("mlx5_10", 2),
    ]
    for nic in out.nics:
        assert as_dict(nic) == expected_port(
            edge / "class" / "infiniband" / nic.device / "ports" / str(nic.port)
        )
    validate(list(out.nics))


def test_edge_values(edge: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="agent.collectors.infiniband"):
        out = collector(edge).collect()
    nics = nics_by_port(out.nics)

    down = nics[("mlx5_0", 1)]
    assert (down.state, down.phys_state) == ("DOWN", "Disabled")
    assert down.counters
    assert down.counters["link_downed"] == 7
    assert set(down.counters) == {
        p.name for p in (edge / "class/infiniband/mlx5_0/ports/1/counters").iterdir()
    }

    bad = nics[("mlx5_1", 1)]
    assert bad.rate_bytes_per_second is None  # "unknown"
    assert bad.counters
    for name in (
        "symbol_error",
        "port_rcv_errors",
        "VL15_dropped",
        "link_downed",
        "local_link_integrity_errors",
    ):
        assert name not in bad.counters, name
    assert bad.counters["port_xmit_discards"] == 5_000_000_000  # hw_counters/ wins over counters/
    assert "lifespan" not in bad.counters
    assert (bad.rx_packets_total, bad.tx_packets_total) == (1024, 2048)  # unicast + multicast
    assert bad.rx_bytes_total == 123456789 * 4
    # Garbage is an error naming each file; "N/A (no PMA)" is not.
    [message] = out.errors
    assert message.startswith("mlx5_1 port 1: ")
    for name in ("port_rcv_errors", "VL15_dropped", "link_downed", "local_link_integrity_errors"):
        assert name in message
    assert "symbol_error" not in message

    roce = nics[("mlx5_2", 1)]
    assert (roce.link_layer, roce.netdev, roce.rate_bytes_per_second) == ("Ethernet", "ens1f0np0", 2.5e10)
    assert roce.counters
    assert roce.counters["np_cnp_sent"] == count(
        edge / "class/infiniband/mlx5_2/ports/1/hw_counters/np_cnp_sent"
    )

    assert (nics[("mlx5_10", 1)].netdev, nics[("mlx5_10", 2)].netdev) == ("ib0", "ib1")  # by dev_port
    assert nics[("mlx5_10", 1)].state == "INIT"
    assert nics[("mlx5_10", 1)].rate_bytes_per_second == 3.125e8

    legacy = nics[("mlx4_0", 1)]
    # The 32-bit counters are stuck at 2^32-1; the 64-bit ones in counters_ext are the truth.
    assert legacy.rx_bytes_total == 81604378625 * 4
    assert legacy.tx_bytes_total == 90194313219 * 4
    assert (legacy.rx_packets_total, legacy.tx_packets_total) == (79691776, 88080384)

    unknown = nics[("iwarp0", 1)]
    assert unknown.link_layer == "InfiniBand"
    assert unknown.counters is msgspec.UNSET
    assert unknown.rate_bytes_per_second == 1.0e11
    assert any("unknown link layer" in r.getMessage() for r in caplog.records)


def test_an_oddity_is_logged_once_not_at_every_rescan(edge: Path, caplog: pytest.LogCaptureFixture) -> None:
    c = collector(edge, rescan_every=1)
    with caplog.at_level(logging.WARNING, logger="agent.collectors.infiniband"):
        for _ in range(3):
            c.collect()
    assert [r.getMessage() for r in caplog.records] == [
        "RDMA port with an unknown link layer, reporting it as InfiniBand"
    ]
    assert caplog.records[0].__dict__["device"] == "iwarp0"


def patch_os_open(monkeypatch: pytest.MonkeyPatch, failing: dict[str, int]) -> None:
    """Makes ``os.open`` fail with the given errno for the given paths (real ones otherwise)."""
    real_open = os.open

    def fake_open(path: Any, flags: int, mode: int = 0o777, **kwargs: Any) -> int:
        if os.fspath(path) in failing:
            code = failing[os.fspath(path)]
            raise OSError(code, os.strerror(code), os.fspath(path))
        return real_open(path, flags, mode, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)


@pytest.mark.parametrize(
    ("code", "reported"),
    [(errno.EACCES, "EACCES"), (errno.EIO, "EIO"), (errno.EINVAL, None), (errno.EOPNOTSUPP, None)],
)
def test_unreadable_counter_is_left_out_and_named_unless_unsupported(
    monkeypatch: pytest.MonkeyPatch, code: int, reported: str | None
) -> None:
    root = TREES / "h100" / "sys"
    target = str(root / "class/infiniband/mlx5_5/ports/1/hw_counters/out_of_buffer")
    patch_os_open(monkeypatch, {target: code})

    out = collector(root).collect()

    nics = nics_by_port(out.nics)
    assert nics[("mlx5_5", 1)].counters
    assert "out_of_buffer" not in nics[("mlx5_5", 1)].counters
    assert "rx_read_requests" in nics[("mlx5_5", 1)].counters  # the rest of the port still read
    assert nics[("mlx5_4", 1)].counters
    assert "out_of_buffer" in nics[("mlx5_4", 1)].counters
    if reported is None:
        assert out.errors == ()
    else:
        assert out.errors == (f"mlx5_5 port 1: out_of_buffer ({reported})",)


def test_directory_where_a_counter_should_be(tmp_path: Path) -> None:
    root = copy_devices(tmp_path, "mlx5_1", "mlx5_2")
    path = root / "class/infiniband/mlx5_2/ports/1/counters/port_xmit_discards"
    path.unlink()
    path.mkdir()

    out = collector(root).collect()

    nic = nics_by_port(out.nics)[("mlx5_2", 1)]
    assert nic.counters
    assert "port_xmit_discards" not in nic.counters
    assert nic.tx_bytes_total is not None
    assert out.errors == ("mlx5_2 port 1: port_xmit_discards (EISDIR)",)


def test_too_many_counters_keeps_the_standard_ones(tmp_path: Path) -> None:
    root = copy_devices(tmp_path, "mlx5_0")
    hw = root / "class/infiniband/mlx5_0/ports/1/hw_counters"
    for i in range(300):
        (hw / f"aaa_extra_{i:03}").write_text("1\n")

    nic = collector(root).collect().nics[0]

    assert nic.counters
    assert len(nic.counters) == 256
    standard = {p.name for p in (hw.parent / "counters").iterdir()}
    assert standard <= set(nic.counters)
    validate([nic])


# ---------------------------------------------------------------- layout changes and cost


def test_devices_coming_and_going_are_seen_next_cycle(tmp_path: Path) -> None:
    root = copy_devices(tmp_path, "mlx5_0", "mlx5_1", "mlx5_2")
    c = collector(root, rescan_every=1000)
    assert len(c.collect().nics) == 3

    link = root / "class/infiniband/mlx5_1"
    target = os.readlink(link)
    link.unlink()
    out = c.collect()
    assert [n.device for n in out.nics] == ["mlx5_0", "mlx5_2"]
    assert out.errors == ()

    link.symlink_to(target)
    assert [n.device for n in c.collect().nics] == ["mlx5_0", "mlx5_1", "mlx5_2"]


def test_a_file_vanishing_mid_layout_rediscovers_in_the_same_cycle(tmp_path: Path) -> None:
    root = copy_devices(tmp_path, "mlx5_1")
    c = collector(root, rescan_every=1000, max_open_files=0)  # read by path: a removed file is ENOENT
    c.collect()
    (root / "class/infiniband/mlx5_1/ports/1/hw_counters/np_cnp_sent").unlink()

    out = c.collect()

    assert out.errors == ()
    counters = nics_by_port(out.nics)[("mlx5_1", 1)].counters
    assert counters
    assert "np_cnp_sent" not in counters
    assert "rp_cnp_handled" in counters


def test_a_removed_device_on_held_files_rediscovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    c = collector(copy_devices(tmp_path, "mlx5_0", "mlx5_1"))
    first = c.collect()
    real_pread = os.pread
    failures = iter([True])

    def pread(fd: int, n: int, offset: int) -> bytes:
        # sysfs answers ENODEV on a descriptor whose device was unregistered.
        if next(failures, False):
            raise OSError(errno.ENODEV, "No such device")
        return real_pread(fd, n, offset)

    monkeypatch.setattr(os, "pread", pread)
    with caplog.at_level(logging.INFO, logger="agent.collectors.infiniband"):
        second = c.collect()

    assert second == first
    assert any("rediscovering" in r.getMessage() for r in caplog.records)


def test_new_counter_files_appear_after_rescan(tmp_path: Path) -> None:
    root = copy_devices(tmp_path, "mlx5_0")
    c = collector(root, rescan_every=3)
    c.collect()
    (root / "class/infiniband/mlx5_0/ports/1/hw_counters/rx_icrc_new").write_text("9\n")
    seen = []
    for _ in range(3):
        counters = c.collect().nics[0].counters
        assert counters
        seen.append("rx_icrc_new" in counters)
    assert seen == [False, False, True]


def test_a_steady_cycle_lists_one_directory_and_opens_no_file(monkeypatch: pytest.MonkeyPatch) -> None:
    c = collector(TREES / "h100" / "sys")
    assert_steady_cycle_lists_one_directory(c.collect, monkeypatch)


def test_over_the_open_file_budget_files_are_read_by_path() -> None:
    assert_open_file_budget(collector, 100)


def test_default_open_file_budget_is_a_share_of_the_soft_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 524288))
    assert sysfs.fd_budget() == 128
    monkeypatch.setattr(resource, "getrlimit", lambda _: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert sysfs.fd_budget() == 4096

    monkeypatch.setattr(resource, "getrlimit", lambda _: (80, 80))
    c = collector(TREES / "h100" / "sys")
    before = open_files()
    c.collect()
    assert open_files() - before == 10
    c.close()


def test_close_releases_files_and_collect_starts_over() -> None:
    c = collector(TREES / "h100" / "sys")
    first = c.collect()
    before = open_files()
    c.close()
    assert before - open_files() >= 8 * 50
    assert c.collect() == first
    c.close()


# ---------------------------------------------------------------- no RDMA here


def test_unsupported_without_the_class_directory(tmp_path: Path) -> None:
    # A real sysfs (it has class/net) on a node without RDMA devices: nothing to report, no error.
    (tmp_path / "class" / "net").mkdir(parents=True)
    support = collector(tmp_path).supported()
    assert not support.supported
    assert support.reason == f"no {tmp_path}/class/infiniband: no RDMA devices"


@pytest.mark.parametrize("root", ["missing", "empty", "a-file"])
def test_a_root_that_is_no_sysfs_is_a_failure_not_a_node_without_rdma(tmp_path: Path, root: str) -> None:
    path = tmp_path / root
    if root == "empty":
        path.mkdir()
    elif root == "a-file":
        path.write_text("")
    c = collector(path)
    assert c.supported().supported  # so the runner collects, and reports the failure
    expected = "neither class/net nor class/infiniband" if root == "empty" else "does not exist"
    with pytest.raises(CollectorFailure, match=f"sysfs root {path} .*{expected}"):
        c.collect()


def test_class_directory_vanishing_is_a_collector_failure(tmp_path: Path) -> None:
    root = copy_devices(tmp_path, "mlx5_0", tree="edge")
    (root / "class" / "net").mkdir(exist_ok=True)  # the rest of a real sysfs stays
    c = collector(root)
    assert c.supported().supported
    c.collect()
    shutil.rmtree(root / "class" / "infiniband")
    with pytest.raises(CollectorFailure, match="cannot list"):
        c.collect()
    assert not c.supported().supported
