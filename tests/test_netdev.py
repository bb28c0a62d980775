"""The netdev collector against recorded sysfs trees and the project's own trees.

Expected values are computed from the fixture files by this module's own readers plus literal
spot checks. Unreadable files are simulated by patching ``os.open`` (the tests run as root, where
``chmod 000`` does not stop a read).
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

import msgspec
import pytest

from agent.collectors.base import CollectorContext, Paths
from agent.collectors.infiniband import InfinibandCollector
from agent.collectors.netdev import NetdevCollector
from agent.errors import CollectorFailure
from agent.report import Nic
from tests.sysfs_trees import (
    TREE_SCRIPT,
    TREES,
    assert_open_file_budget,
    assert_steady_cycle_lists_one_directory,
    count,
    text,
    validate,
)

CARRIER = ("carrier_changes", "carrier_up_count", "carrier_down_count")


def expected_netdev(net_dir: Path) -> dict[str, Any]:
    """An interface as its files describe it: statistics/* and carrier_* raw, speed in Mb/s."""
    files = sorted((net_dir / "statistics").iterdir()) if (net_dir / "statistics").is_dir() else []
    files += [net_dir / name for name in CARRIER if (net_dir / name).exists()]
    values = {p.name: v for p in files if (v := count(p)) is not None}
    speed = int(text(net_dir / "speed")) if (net_dir / "speed").exists() else -1
    arp_type = text(net_dir / "type") if (net_dir / "type").exists() else "1"
    return {
        "device": net_dir.name,
        "link_layer": "InfiniBand" if arp_type == "32" else "Ethernet",
        "port": None,
        "netdev": net_dir.name,
        "state": text(net_dir / "operstate"),
        "phys_state": None,
        "rate_bytes_per_second": speed * 1e6 / 8 if speed > 0 else None,
        "rx_bytes_total": values.get("rx_bytes"),
        "tx_bytes_total": values.get("tx_bytes"),
        "rx_packets_total": values.get("rx_packets"),
        "tx_packets_total": values.get("tx_packets"),
        "counters": values or msgspec.UNSET,
    }


def as_dict(nic: Nic) -> dict[str, Any]:
    return {f: getattr(nic, f) for f in nic.__struct_fields__}


def collector(sys_root: Path, include: tuple[str, ...] = (), **kwargs: Any) -> NetdevCollector:
    return NetdevCollector(CollectorContext(paths=Paths(sysfs=sys_root), netdev_include=include), **kwargs)


def by_name(nics: tuple[Nic, ...]) -> dict[str, Nic]:
    return {n.device: n for n in nics}


def copy_netdevs(tmp_path: Path, *names: str, tree: str = "h100") -> Path:
    """A changeable copy of some interfaces of one of this project's trees."""
    return TREE_SCRIPT.copy_entries(TREES / tree / "sys", tmp_path / "sys", "net", names)


# ---------------------------------------------------------------- recorded trees


def test_procfs_recording_reports_eth0_from_its_files(recorded_sysfs: Path) -> None:
    root = recorded_sysfs / "procfs" / "sys"
    out = collector(root).collect()

    assert out.errors == ()
    [eth0] = out.nics
    assert as_dict(eth0) == expected_netdev(root / "class" / "net" / "eth0")
    # Spot checks: this recording has no statistics/, only the carrier counters.
    assert (eth0.state, eth0.rate_bytes_per_second) == ("up", 1.25e8)
    assert eth0.counters == {"carrier_changes": 2, "carrier_up_count": 1, "carrier_down_count": 1}
    assert eth0.rx_bytes_total is None
    validate([eth0])


def test_node_exporter_recording_has_only_bonds_and_a_flattened_link(recorded_sysfs: Path) -> None:
    # bond0, dmz and int are bonds (bonding/); eth0 was recorded as a plain file holding its link
    # target, which is not an interface directory; bonding_masters is a file.
    root = recorded_sysfs / "node_exporter" / "sys"
    out = collector(root).collect()
    assert out == type(out)()

    included = collector(root, include=("bond0", "dmz", "int")).collect()
    assert [n.device for n in included.nics] == ["bond0", "dmz", "int"]
    for nic in included.nics:
        assert as_dict(nic) == expected_netdev(root / "class" / "net" / nic.device)
    assert by_name(included.nics)["bond0"].rate_bytes_per_second is None  # speed -1
    assert by_name(included.nics)["dmz"].rate_bytes_per_second == 1.25e8
    validate(list(included.nics))


def test_node_exporter_eth0_with_its_link_restored_is_physical(recorded_sysfs: Path, tmp_path: Path) -> None:
    # As on the machine it was recorded from: class/net/eth0 -> ../../devices/pci.../net/eth0.
    # That recording kept no `device` link; resolving into devices/ outside devices/virtual/ is
    # the same fact seen from the other side.
    root = tmp_path / "sys"
    shutil.copytree(recorded_sysfs / "node_exporter" / "sys" / "class" / "net", root / "class" / "net")
    shutil.copytree(recorded_sysfs / "node_exporter" / "sys" / "devices", root / "devices")
    os.chmod(root / "class" / "net", 0o755)  # in case the checkout is read-only
    entry = root / "class" / "net" / "eth0"
    target = entry.read_text().rstrip("/")
    entry.unlink()
    entry.symlink_to(target)

    [eth0] = collector(root).collect().nics

    assert as_dict(eth0) == expected_netdev(entry.resolve())
    assert (eth0.state, eth0.rate_bytes_per_second) == ("up", 1.25e8)


# ---------------------------------------------------------------- the H100 node


def test_h100_node_reports_physical_interfaces_only() -> None:
    root = TREES / "h100" / "sys"
    out = collector(root).collect()

    assert out.errors == ()
    names = [n.device for n in out.nics]
    assert names == ["eth0", *(f"ibp{bus}s0" for bus in (24, 64, 79, 94, 154, 192, 206, 220))]
    for nic in out.nics:
        assert as_dict(nic) == expected_netdev(root / "class" / "net" / nic.device)
    nics = by_name(out.nics)
    assert nics["eth0"].link_layer == "Ethernet"
    assert nics["eth0"].rate_bytes_per_second == 1.25e9  # 10000 Mb/s
    assert nics["ibp24s0"].link_layer == "InfiniBand"  # IPoIB, type 32
    assert nics["ibp24s0"].counters
    assert len(nics["ibp24s0"].counters) == 24 + 3
    validate(list(out.nics))


def test_virtual_interfaces_are_reported_when_included() -> None:
    root = TREES / "h100" / "sys"
    out = collector(root, include=("docker0", "lo", "absent0")).collect()
    nics = by_name(out.nics)
    assert {"docker0", "lo"} <= nics.keys()
    assert "veth1f3a9c2" not in nics
    assert "absent0" not in nics
    assert as_dict(nics["docker0"]) == expected_netdev(root / "class" / "net" / "docker0")
    assert nics["lo"].rate_bytes_per_second is None  # no speed file


def test_roce_netdev_is_reported_by_both_collectors() -> None:
    # The documented choice: the RDMA port entry links to its netdev, which is also reported here.
    root = TREES / "edge" / "sys"
    ctx = CollectorContext(paths=Paths(sysfs=root))
    roce = {(n.device, n.port): n for n in InfinibandCollector(ctx).collect().nics}[("mlx5_2", 1)]
    netdevs = by_name(NetdevCollector(ctx).collect().nics)
    assert roce.netdev == "ens1f0np0"
    assert netdevs["ens1f0np0"].link_layer == "Ethernet"
    assert netdevs["ens1f0np0"].rate_bytes_per_second == roce.rate_bytes_per_second == 2.5e10


# ---------------------------------------------------------------- edge cases


def test_edge_interfaces() -> None:
    root = TREES / "edge" / "sys"
    out = collector(root).collect()

    assert [n.device for n in out.nics] == ["ens1f0np0", "eth1", "ib0", "ib1"]  # no bond0, lo
    eth1 = by_name(out.nics)["eth1"]
    assert (eth1.state, eth1.rate_bytes_per_second) == ("down", None)  # speed -1
    assert eth1.counters
    assert "rx_crc_errors" not in eth1.counters
    assert eth1.counters["carrier_down_count"] == 3
    assert out.errors == ("eth1: rx_crc_errors (not a count: b'lots\\n')",)
    for nic in out.nics:
        assert as_dict(nic) == expected_netdev(root / "class" / "net" / nic.device)
    validate(list(out.nics))


@pytest.mark.parametrize(
    ("code", "reported"), [(errno.EACCES, "EACCES"), (errno.EIO, "EIO"), (errno.EINVAL, None)]
)
def test_unreadable_statistic(monkeypatch: pytest.MonkeyPatch, code: int, reported: str | None) -> None:
    root = TREES / "h100" / "sys"
    target = os.fspath(root / "class/net/eth0/statistics/rx_dropped")
    real_open = os.open

    def fake_open(path: Any, flags: int, mode: int = 0o777, **kwargs: Any) -> int:
        if os.fspath(path) == target:
            raise OSError(code, os.strerror(code), target)
        return real_open(path, flags, mode, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)
    out = collector(root).collect()

    eth0 = by_name(out.nics)["eth0"]
    assert eth0.counters
    assert "rx_dropped" not in eth0.counters
    assert eth0.rx_bytes_total == count(root / "class/net/eth0/statistics/rx_bytes")
    assert out.errors == (() if reported is None else (f"eth0: rx_dropped ({reported})",))


def test_speed_that_is_not_a_number(tmp_path: Path) -> None:
    root = copy_netdevs(tmp_path, "eth0")
    (root / "class/net/eth0/speed").write_text("fast\n")
    out = collector(root).collect()
    assert by_name(out.nics)["eth0"].rate_bytes_per_second is None
    assert out.errors == ("eth0: speed (not a number: 'fast')",)


# ---------------------------------------------------------------- layout changes and cost


def test_interfaces_coming_and_going(tmp_path: Path) -> None:
    root = copy_netdevs(tmp_path, "eth0", "veth1f3a9c2")
    c = collector(root, rescan_every=1000)
    c.collect()
    net = root / "class" / "net"

    # A pod's veth appears: virtual, so still not reported.
    veth_dir = root / "devices/virtual/net/veth9"
    shutil.copytree(root / "devices/virtual/net/veth1f3a9c2", veth_dir)
    (net / "veth9").symlink_to("../../devices/virtual/net/veth9")
    assert "veth9" not in by_name(c.collect().nics)

    # eth0 renamed to eno1 (udev): the old name goes, the new one comes, same counters.
    eth0 = by_name(c.collect().nics)["eth0"]
    target = os.readlink(net / "eth0")
    (net / "eth0").unlink()
    (net / "eno1").symlink_to(target)
    nics = by_name(c.collect().nics)
    assert "eth0" not in nics
    assert nics["eno1"].counters == eth0.counters


def test_a_file_vanishing_rediscovers_in_the_same_cycle(tmp_path: Path) -> None:
    root = copy_netdevs(tmp_path, "eth0")
    c = collector(root, rescan_every=1000, max_open_files=0)
    c.collect()
    (root / "class/net/eth0/statistics/tx_window_errors").unlink()

    out = c.collect()

    assert out.errors == ()
    counters = by_name(out.nics)["eth0"].counters
    assert counters
    assert "tx_window_errors" not in counters
    assert "tx_errors" in counters


def test_a_steady_cycle_lists_one_directory_and_opens_no_file(monkeypatch: pytest.MonkeyPatch) -> None:
    c = collector(TREES / "h100" / "sys")
    assert_steady_cycle_lists_one_directory(c.collect, monkeypatch)
    c.close()


def test_over_the_open_file_budget_files_are_read_by_path() -> None:
    assert_open_file_budget(collector, 50)


# ---------------------------------------------------------------- no interfaces here


def test_unsupported_without_the_class_directory(tmp_path: Path) -> None:
    # A tree with only class/infiniband (a recording of the RDMA side): no interfaces, no error.
    (tmp_path / "class" / "infiniband").mkdir(parents=True)
    support = collector(tmp_path).supported()
    assert not support.supported
    assert support.reason == f"no {tmp_path}/class/net: no network interfaces"


@pytest.mark.parametrize("root", ["missing", "empty"])
def test_a_root_that_is_no_sysfs_is_a_failure_not_one_without_interfaces(tmp_path: Path, root: str) -> None:
    path = tmp_path / root
    if root == "empty":
        path.mkdir()
    c = collector(path)
    assert c.supported().supported
    expected = "neither class/net nor class/infiniband" if root == "empty" else "does not exist"
    with pytest.raises(CollectorFailure, match=f"sysfs root {path} .*{expected}"):
        c.collect()


def test_class_directory_vanishing_is_a_collector_failure(tmp_path: Path) -> None:
    root = copy_netdevs(tmp_path, "eth1", tree="edge")
    (root / "class" / "infiniband").mkdir(exist_ok=True)  # the rest of the tree stays
    c = collector(root)
    c.collect()
    shutil.rmtree(root / "class" / "net")
    with pytest.raises(CollectorFailure, match="cannot list"):
        c.collect()
