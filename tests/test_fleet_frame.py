"""Pool placement and the columnar pool frames peer detectors read."""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import pytest

from agent.report import Gpu, Nic, NvLink, Report
from aggregator.config import FleetConfig
from aggregator.detect.forest import ForestConfig, window_slots
from aggregator.detect.peers import PeerConfig
from aggregator.detect.trend import TrendConfig
from aggregator.fleet.frame import GPU_COLUMN, GPU_FIELDS, NIC_COLUMN, NIC_FIELDS, FleetFrames, PoolFrame
from aggregator.fleet.history import Fleet
from aggregator.fleet.pools import Placement, gpu_model_pool, label_safe, placement_of
from aggregator.fleet.view import RateAsks

H100 = "NVIDIA H100 80GB HBM3"
TEMP = GPU_COLUMN["temperature_celsius"]


def gpu(index: int, model: str | None = H100, **fields: Any) -> Gpu:
    return Gpu(index=index, uuid=f"GPU-{index:04d}", model=model, **fields)


def report(
    t: float,
    node: str = "gpu-0001",
    *,
    gpus: list[Gpu] | None = None,
    nics: list[Nic] | None = None,
    labels: dict[str, str] | None = None,
    boot: str = "boot-a",
) -> Report:
    extra: dict[str, Any] = {"labels": labels} if labels is not None else {}
    return Report(
        schema="gpuwarden/report/v1",
        node=node,
        time=t,
        seq=int(t),
        boot_id=boot,
        gpus=gpus if gpus is not None else [gpu(i) for i in range(8)],
        nics=nics if nics is not None else [],
        **extra,
    )


def hot(t: float, node: str, temp: float, n_gpus: int = 8) -> Report:
    return report(t, node, gpus=[gpu(i, temperature_celsius=temp + i) for i in range(n_gpus)])


POOL = Placement("p")


def frames_for(frame_seconds: float = 60.0) -> tuple[Fleet, FleetFrames]:
    config = FleetConfig(window_seconds=1800.0, interval_seconds=10.0)
    return Fleet(config), FleetFrames(config, frame_seconds=frame_seconds)


# -- placement ---------------------------------------------------------------------------------


def test_pool_from_report_label_then_k8s_label_then_gpu_model_then_unknown() -> None:
    gpus = [gpu(0), gpu(1)]
    k8s = {"gpuwarden.io/pool": "training-a", "node.kubernetes.io/instance-type": "p5.48xlarge"}
    assert placement_of(report(0, gpus=gpus, labels={"pool": "mine"}), k8s).pool == "mine"
    assert placement_of(report(0, gpus=gpus), k8s).pool == "training-a"
    assert placement_of(report(0, gpus=gpus), {"node.kubernetes.io/instance-type": "p5.48xlarge"}).pool == (
        "p5.48xlarge"
    )
    assert placement_of(report(0, gpus=gpus)).pool == "nvidia-h100-80gb-hbm3"
    assert placement_of(report(0, gpus=[gpu(0, model=None)])).pool == "unknown"
    assert placement_of(report(0, gpus=[])).pool == "unknown"
    # An empty label is no label.
    assert placement_of(report(0, gpus=gpus, labels={"pool": ""})).pool == "nvidia-h100-80gb-hbm3"


def test_gpu_model_pool_is_the_most_common_model_whatever_the_order() -> None:
    a100 = "NVIDIA A100-SXM4-80GB"
    mixed = [gpu(0, model=a100), gpu(1), gpu(2), gpu(3, model=None)]
    assert gpu_model_pool(report(0, gpus=mixed)) == "nvidia-h100-80gb-hbm3"
    tie = [gpu(0), gpu(1, model=a100)]
    assert (
        gpu_model_pool(report(0, gpus=tie))
        == gpu_model_pool(report(0, gpus=tie[::-1]))
        == "nvidia-a100-sxm4-80gb"
    )
    assert label_safe("  NVIDIA  GeForce RTX 4090 (rev. a1)!") == "nvidia-geforce-rtx-4090-rev-a1"
    assert len(label_safe("x" * 100)) == 63


def test_failure_domains_from_report_labels_then_k8s() -> None:
    labels = {"pool": "p", "rack": "r12", "leaf": "leaf-3"}
    k8s = {"topology.kubernetes.io/zone": "us-east-1a", "gpuwarden.io/rack": "from-k8s"}
    assert placement_of(report(0, labels=labels), k8s) == Placement("p", "r12", "leaf-3", "us-east-1a")
    assert placement_of(report(0, labels={"zone": "z9"}), k8s).zone == "z9"
    assert placement_of(report(0), k8s).rack == "from-k8s"
    assert placement_of(report(0)) == Placement("nvidia-h100-80gb-hbm3", None, None, None)


# -- frames ------------------------------------------------------------------------------------


def test_field_lists_are_named_columns() -> None:
    assert len(GPU_FIELDS) == len(GPU_COLUMN) == len(set(GPU_FIELDS))
    assert len(NIC_FIELDS) == len(NIC_COLUMN) == len(set(NIC_FIELDS))
    for name in ("utilization_ratio", "sm_clock_ratio", "hw_slowdown", "power_brake", "ecc_sbe_per_second"):
        assert GPU_FIELDS[GPU_COLUMN[name]] == name


def test_snapshot_shape_and_nan_for_what_is_missing() -> None:
    fleet, frames = frames_for()
    for t in (100, 110, 120):
        frames.record(fleet.add(hot(t, "a", 50.0)), POOL)
    # Node b: 4 GPUs only, and silent at 110.
    for t in (100, 120):
        frames.record(fleet.add(hot(t, "b", 70.0, n_gpus=4)), POOL)
    names, values = frames.snapshot("p", 100, 125)
    assert names == ["a", "b"]
    assert values.shape == (3, 2, 8, len(GPU_FIELDS))
    assert values.dtype == np.float32
    a, b = names.index("a"), names.index("b")
    assert values[:, a, 3, TEMP].tolist() == [53.0, 53.0, 53.0]
    assert values[0, b, 0, TEMP] == 70.0
    assert np.isnan(values[1, b]).all()  # b did not report in the slot of 110
    assert np.isnan(values[:, b, 4:]).all()  # b has no GPUs 4-7
    assert np.isnan(values[:, a, :, GPU_COLUMN["power_watts"]]).all()  # null in the report
    assert frames.frame("p") is not None
    assert frames.frame("p").slot_starts(100, 125).tolist() == [100.0, 110.0, 120.0]  # type: ignore[union-attr]


def test_gauge_columns_and_rates_from_the_view() -> None:
    fleet, frames = frames_for()

    def r(t: float, ecc: int, crc: tuple[int, int], reasons: int) -> Report:
        links = [NvLink(link=0, crc_flit_errors_total=crc[0]), NvLink(link=1, crc_data_errors_total=crc[1])]
        g = gpu(
            0,
            sm_clock_hz=990e6,
            sm_clock_max_hz=1980e6,
            pcie_link_width=8,
            pcie_link_width_max=16,
            clock_event_reasons=reasons,
            ecc_sbe_volatile_total=ecc,
            nvlink=links,
        )
        return report(t, "a", gpus=[g])

    frames.record(fleet.add(r(100, 5, (0, 0), 0)), POOL)
    frames.record(fleet.add(r(110, 25, (10, 3), 0x8 | 0x80)), POOL)
    _, values = frames.snapshot("p", 100, 110)
    first, second = values[0, 0, 0], values[1, 0, 0]
    assert np.isnan(first[GPU_COLUMN["ecc_sbe_per_second"]])  # first report: no interval yet
    assert second[GPU_COLUMN["ecc_sbe_per_second"]] == pytest.approx(2.0)
    assert second[GPU_COLUMN["nvlink_crc_per_second"]] == pytest.approx(1.3)
    assert second[GPU_COLUMN["sm_clock_ratio"]] == pytest.approx(0.5)
    assert second[GPU_COLUMN["pcie_link_width_ratio"]] == pytest.approx(0.5)
    flags = {
        name: second[GPU_COLUMN[name]] for name in ("hw_slowdown", "power_brake", "hw_thermal", "sw_thermal")
    }
    assert flags == {"hw_slowdown": 1.0, "power_brake": 1.0, "hw_thermal": 0.0, "sw_thermal": 0.0}
    assert first[GPU_COLUMN["hw_slowdown"]] == 0.0


def test_gauges_of_several_gpus_at_once_with_nulls_zero_denominators_and_unknown_reasons() -> None:
    """The gauge columns are computed for all of a node's GPUs together: each GPU's own values
    land in its own row, a null is NaN, a share over a zero or null denominator is NaN, unknown
    clock event reasons are NaN flags, and a GPU the report lacks is NaN throughout."""
    fleet, frames = frames_for()
    gpus = [
        gpu(0, temperature_celsius=None, sm_clock_hz=1e9, sm_clock_max_hz=0, clock_event_reasons=None),
        gpu(3, temperature_celsius=71.5, sm_clock_hz=1e9, sm_clock_max_hz=None, clock_event_reasons=0x40),
        gpu(1, temperature_celsius=40.0, sm_clock_hz=None, sm_clock_max_hz=2e9, power_watts=700.25),
    ]
    frames.record(fleet.add(report(100, "a", gpus=gpus)), POOL)
    _, values = frames.snapshot("p", 100, 100)
    g0, g1, g2, g3 = (values[0, 0, i] for i in range(4))
    col = GPU_COLUMN
    assert np.isnan(g0[col["temperature_celsius"]]) and g3[col["temperature_celsius"]] == 71.5
    assert g1[col["temperature_celsius"]] == 40.0 and g1[col["power_watts"]] == 700.25
    assert np.isnan([g0[col["sm_clock_ratio"]], g3[col["sm_clock_ratio"]], g1[col["sm_clock_ratio"]]]).all()
    assert np.isnan(g0[col["hw_thermal"]]) and np.isnan(g0[col["sw_power_cap"]])
    assert (g3[col["hw_thermal"]], g3[col["hw_slowdown"]]) == (1.0, 0.0)
    assert np.isnan(g2).all()  # no GPU 2 in the report


# Each gauge column from the field's meaning, written out here rather than taken from the frame's
# tables: a value as reported, a share of two (NaN unless the second is positive), a clock event
# reason's bit (NVML's nvmlClocksEventReason* values).
_SHARES = {
    "sm_clock_ratio": ("sm_clock_hz", "sm_clock_max_hz"),
    "pcie_link_width_ratio": ("pcie_link_width", "pcie_link_width_max"),
    "pcie_link_gen_ratio": ("pcie_link_gen", "pcie_link_gen_max"),
}
_VALUES = (
    "utilization_ratio",
    "temperature_celsius",
    "memory_temperature_celsius",
    "power_watts",
    "power_limit_watts",
)
_BITS = {"sw_power_cap": 0x4, "hw_slowdown": 0x8, "sw_thermal": 0x20, "hw_thermal": 0x40, "power_brake": 0x80}


@pytest.mark.parametrize("seed", range(20))
def test_gauge_columns_are_each_gpus_own_fields(seed: int) -> None:
    """Every gauge column of every GPU, with nulls, zero and negative denominators, bitmasks past
    2**53 (not exact as floats), GPUs out of order, a GPU named twice (the last one counts) and
    indices past the frame's height (left out)."""
    rng = random.Random(seed)
    fleet, frames = frames_for()

    def maybe(value: float) -> float | None:
        return None if rng.random() < 0.2 else value

    t = 100.0
    for _ in range(5):
        t += 10.0
        gpus = []
        for index in rng.sample(range(10), rng.randint(1, 9)) + (
            [rng.randrange(8)] if rng.random() < 0.3 else []
        ):
            fields: dict[str, Any] = {
                name: maybe(rng.choice((0.0, 0.5, 1.0, rng.uniform(0, 1)))) for name in _VALUES
            }
            fields["temperature_celsius"] = maybe(rng.uniform(20, 95))
            fields["power_watts"] = maybe(rng.uniform(50, 700))
            for num, den in _SHARES.values():
                fields[num] = maybe(rng.choice((1, 8, 16, 1.5e9)))
                fields[den] = maybe(rng.choice((0, 4, 16, 1.98e9)))
            fields["clock_event_reasons"] = maybe(
                rng.choice((0, 0x1, 0x8 | 0x80, 0xFF, 2**63 + 0x41, 2**64 - 1 - 0x20, rng.getrandbits(64)))
            )
            gpus.append(gpu(index, **fields))
        frames.record(fleet.add(report(t, "a", gpus=gpus)), POOL)
        _, values = frames.snapshot("p", t, t)
        last = {g.index: g for g in gpus}
        for index in range(8):
            row = values[0, 0, index]
            g = last.get(index)
            want: dict[str, float] = {}
            for name in _VALUES:
                v = None if g is None else getattr(g, name)
                want[name] = np.nan if v is None else v
            for column, (num, den) in _SHARES.items():
                n, d = (None, None) if g is None else (getattr(g, num), getattr(g, den))
                want[column] = n / d if n is not None and d is not None and d > 0 else np.nan
            for column, bit in _BITS.items():
                r = None if g is None else g.clock_event_reasons
                want[column] = np.nan if r is None else float(r & bit != 0)
            for column, value in want.items():
                assert np.array_equal(row[GPU_COLUMN[column]], np.float32(value), equal_nan=True), (
                    t,
                    index,
                    column,
                )
        fleet.settle("a")


def test_rate_after_a_gap_spreads_over_the_real_interval() -> None:
    fleet, frames = frames_for(frame_seconds=300.0)
    frames.record(fleet.add(report(100, "a", gpus=[gpu(0, pcie_replay_total=0)])), POOL)
    frames.record(fleet.add(report(160, "a", gpus=[gpu(0, pcie_replay_total=30)])), POOL)
    _, values = frames.snapshot("p", 160, 160)
    assert values[0, 0, 0, GPU_COLUMN["pcie_replay_per_second"]] == pytest.approx(0.5)


def test_ring_reuse_clears_the_old_time() -> None:
    fleet, frames = frames_for(frame_seconds=60.0)  # 6 slots
    frames.record(fleet.add(hot(0, "a", 50.0)), POOL)
    frames.record(fleet.add(hot(10, "b", 60.0)), POOL)
    # Slot 6 (t=60) reuses the position of slot 0: a's value from t=0 must not show up at t=60.
    frames.record(fleet.add(hot(60, "b", 61.0)), POOL)
    names, values = frames.snapshot("p", 0, 60)
    assert values.shape[0] == 6  # slots 1..6: slot 0 is gone
    assert np.isnan(values[:, names.index("a")]).all()
    assert values[0, names.index("b"), 0, TEMP] == 60.0
    assert values[-1, names.index("b"), 0, TEMP] == 61.0
    # A jump past the whole ring clears everything, and a write for a time gone is refused.
    frames.record(fleet.add(hot(500, "b", 62.0)), POOL)
    _, values = frames.snapshot("p", 0, 500)
    assert values.shape[0] == 6
    assert np.isnan(values[:-1]).all()
    frame = frames.frame("p")
    assert frame is not None
    assert frame.write("a", 100, values[0, 0], [], np.zeros((0, len(NIC_FIELDS)), np.float32)) is False


def test_snapshot_is_a_read_only_copy_in_slot_order() -> None:
    fleet, frames = frames_for(frame_seconds=60.0)
    for t in range(0, 90, 10):  # slots 0..8 in 6 positions: the ring has wrapped
        frames.record(fleet.add(hot(t, "a", float(t))), POOL)
    frame = frames.frame("p")
    assert frame is not None
    _, inside = frames.snapshot("p", 60, 80)  # positions 0..2: contiguous
    assert inside[:, 0, 0, TEMP].tolist() == [60.0, 70.0, 80.0]
    assert not inside.flags.writeable and not np.shares_memory(inside, frame.gpu)
    _, wrapped = frames.snapshot("p", 30, 80)  # positions 3..5 then 0..2
    assert wrapped[:, 0, 0, TEMP].tolist() == [30.0, 40.0, 50.0, 60.0, 70.0, 80.0]
    assert not wrapped.flags.writeable
    _, none = frames.snapshot("p", 200, 300)
    assert none.shape == (0, 1, 8, len(GPU_FIELDS))


def test_window_taken_then_read_after_the_frame_moved_on_reads_what_it_was_taken_on() -> None:
    """A window copies nothing when taken (on the event loop); the frame copies a slot before
    changing it under a live window. Read only after every kind of change, it must still show
    the frame as it was."""
    fleet, frames = frames_for(frame_seconds=60.0)
    for t in range(0, 60, 10):
        for node, base in (("a", 0.0), ("b", 1000.0), ("c", 2000.0)):
            frames.record(fleet.add(hot(t, node, base + t)), POOL)
    frame = frames.frame("p")
    assert frame is not None
    _, expected = frame.snapshot(0, 50)
    window = frame.window(0, 50, nic=True)
    expected_nic = frame.nic_snapshot(0, 50)[1]
    frames.record(fleet.add(hot(55, "a", -1.0)), POOL)  # a write into a slot the window holds
    frames.forget("a")  # swap-remove: c's row moves into a's in every slot
    for t in range(60, 90, 10):  # new slots clear the oldest positions
        frames.record(fleet.add(hot(t, "b", 5000.0 + t)), POOL)
    for i in range(12):  # the rows grow: new arrays for every position
        frames.record(fleet.add(hot(90, f"n{i}", 7.0)), POOL)
    assert window.nodes == ("a", "b", "c")
    np.testing.assert_array_equal(window.gpu, expected)
    np.testing.assert_array_equal(window.nic, expected_nic)
    assert window.gpu[:, 0, 0, TEMP].tolist() == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0]
    assert not (window.gpu.flags.writeable or window.nic.flags.writeable)
    # And the frame itself went on as if no window had been taken.
    _, now = frame.snapshot(40, 50)  # slots 4..9 held now
    assert frame.nodes[:2] == ["c", "b"]
    assert now[:, 0, 0, TEMP].tolist() == [2040.0, 2050.0]


def test_a_window_nobody_holds_costs_the_frame_no_copy() -> None:
    fleet, frames = frames_for(frame_seconds=60.0)
    for t in range(0, 60, 10):
        frames.record(fleet.add(hot(t, "a", float(t))), POOL)
    frame = frames.frame("p")
    assert frame is not None
    arrays = list(frame._gpu)
    window = frame.window(0, 50)
    del window
    frames.record(fleet.add(hot(55, "a", 1.0)), POOL)  # slot 5, written in place again
    frames.record(fleet.add(hot(60, "a", 1.0)), POOL)  # slot 6 clears position 0 in place
    assert all(a is b for a, b in zip(frame._gpu, arrays, strict=True))


def test_window_is_an_owned_read_only_copy_that_outlives_writes_and_forgets() -> None:
    fleet, frames = frames_for(frame_seconds=60.0)
    for t in range(0, 90, 10):  # the ring has wrapped, as in the test above
        for node, base in (("a", 0.0), ("b", 1000.0)):
            frames.record(fleet.add(hot(t, node, base + t)), POOL)
    frame = frames.frame("p")
    assert frame is not None
    for t0 in (60, 30):  # a contiguous range, then one that wraps around the ring
        names, expected = frame.snapshot(t0, 80)
        window = frame.window(t0, 80)
        assert window.nodes == tuple(names) and window.pool == "p" and window.interval_s == 10.0
        assert window.starts.tolist() == frame.slot_starts(t0, 80).tolist()
        np.testing.assert_array_equal(window.gpu, expected)
        assert not np.shares_memory(window.gpu, frame.gpu)
        assert not (window.gpu.flags.writeable or window.starts.flags.writeable)
        assert window.nic.shape[0] == 0 and window.nic_keys == ()  # no NICs unless asked for
    # The frame moves on (a new slot clears the oldest position, a forgotten node's row is
    # refilled by the last one); the window still reads what it copied.
    frames.record(fleet.add(hot(90, "b", 2000.0)), POOL)
    frames.forget("a")
    assert window.nodes == ("a", "b")
    assert window.gpu[:, 0, 0, TEMP].tolist() == [30.0, 40.0, 50.0, 60.0, 70.0, 80.0]
    assert window.gpu[:, 1, 0, TEMP].tolist() == [1030.0, 1040.0, 1050.0, 1060.0, 1070.0, 1080.0]


def test_window_with_nics_copies_each_nodes_nic_columns() -> None:
    fleet, frames = frames_for()
    eth = Nic(device="eth0", link_layer="Ethernet", state="up")
    ib = Nic(device="mlx5_0", link_layer="InfiniBand", port=1, state="ACTIVE")
    frames.record(fleet.add(report(100, "a", gpus=[], nics=[ib, eth])), POOL)
    frames.record(fleet.add(report(100, "b", gpus=[], nics=[eth])), POOL)
    frame = frames.frame("p")
    assert frame is not None
    window = frame.window(100, 100, nic=True)
    assert window.nic_keys == ((("eth0", None), ("mlx5_0", 1)), (("eth0", None),))
    _, expected = frame.nic_snapshot(100, 100)
    np.testing.assert_array_equal(window.nic, expected)
    assert not np.shares_memory(window.nic, frame.nic) and not window.nic.flags.writeable


def test_rows_grow_and_released_rows_are_reused_with_data_kept() -> None:
    fleet, frames = frames_for()
    nodes = [f"n{i:02d}" for i in range(20)]  # beyond the initial 8 rows
    for i, node in enumerate(nodes):
        frames.record(fleet.add(hot(100, node, float(i))), POOL)
    names, values = frames.snapshot("p", 100, 100)
    assert names == nodes
    assert values[0, :, 0, TEMP].tolist() == [float(i) for i in range(20)]
    assert frames.forget("n05") is True
    assert frames.forget("n05") is False
    names, values = frames.snapshot("p", 100, 100)
    assert len(names) == 19 and "n05" not in names
    # Every remaining node still has its own values, wherever its row is now.
    assert {n: values[0, i, 0, TEMP] for i, n in enumerate(names)} == {
        n: float(i) for i, n in enumerate(nodes) if n != "n05"
    }
    frame = frames.frame("p")
    assert frame is not None
    assert np.isnan(frame.gpu[:, 19:]).all()  # the freed row holds nothing
    for node in names:
        frames.forget(node)
    assert frames.frame("p") is None  # an empty pool's frame is dropped


def test_node_changing_pool_leaves_the_old_frame() -> None:
    fleet, frames = frames_for()
    frames.record(fleet.add(hot(100, "a", 50.0)), Placement("old"))
    frames.record(fleet.add(hot(100, "b", 50.0)), Placement("old"))
    frames.record(fleet.add(hot(110, "a", 51.0)), Placement("new"))
    assert frames.pool_of("a") == "new"
    assert frames.snapshot("old", 100, 110)[0] == ["b"]
    names, values = frames.snapshot("new", 100, 110)
    assert names == ["a"]
    assert np.isnan(values[0]).all() and values[1, 0, 0, TEMP] == 51.0


def test_late_and_duplicate_views_write_nothing() -> None:
    fleet, frames = frames_for()
    frames.record(fleet.add(hot(100, "a", 50.0)), POOL)
    frames.record(fleet.add(hot(120, "a", 52.0)), POOL)
    assert frames.record(fleet.add(hot(110, "a", 51.0)), POOL) is False
    assert frames.record(fleet.add(hot(120, "a", 52.0)), POOL) is False
    _, values = frames.snapshot("p", 100, 120)
    assert np.isnan(values[1]).all()


def test_nic_frame_rates_gauges_and_netdev_names() -> None:
    fleet, frames = frames_for()

    def r(t: float, c: int) -> Report:
        ib = Nic(
            device="mlx5_1",
            link_layer="InfiniBand",
            port=1,
            state="ACTIVE",
            rate_bytes_per_second=5e10,
            rx_bytes_total=c * 1000,
            counters={"symbol_error": c, "port_rcv_errors": 0},
        )
        ib0 = Nic(device="mlx5_0", link_layer="InfiniBand", port=1, state="DOWN")
        eth = Nic(device="eth0", link_layer="Ethernet", state="up", counters={"rx_errors": 2 * c})
        return report(t, "a", gpus=[], nics=[ib, eth, ib0])

    frames.record(fleet.add(r(100, 0)), POOL)
    frames.record(fleet.add(r(110, 10)), POOL)
    frame = frames.frame("p")
    assert frame is not None
    assert frame.nic_keys("a") == [("eth0", None), ("mlx5_0", 1), ("mlx5_1", 1)]
    names, values = frames.nic_snapshot("p", 110, 110)
    assert names == ["a"]
    eth, ib0, ib = values[0, 0, 0], values[0, 0, 1], values[0, 0, 2]
    assert ib[NIC_COLUMN["symbol_error_per_second"]] == pytest.approx(1.0)
    assert ib[NIC_COLUMN["rx_bytes_per_second"]] == pytest.approx(1000.0)
    assert ib[NIC_COLUMN["port_rcv_errors_per_second"]] == 0.0
    assert ib[NIC_COLUMN["link_rate_bytes_per_second"]] == pytest.approx(5e10)
    assert ib[NIC_COLUMN["link_up"]] == 1.0 and ib0[NIC_COLUMN["link_up"]] == 0.0
    # The netdev's rx_errors fills the same column as InfiniBand's port_rcv_errors.
    assert eth[NIC_COLUMN["port_rcv_errors_per_second"]] == pytest.approx(2.0)
    assert np.isnan(eth[NIC_COLUMN["symbol_error_per_second"]])
    assert np.isnan(ib0[NIC_COLUMN["symbol_error_per_second"]])


# Each NIC rate column's counters in order of preference, written out from the field's meaning
# (InfiniBand's PMA counter first, then the netdev one), not taken from the frame's own table.
_NIC_RATE_SOURCES: dict[str, tuple[str, ...]] = {
    "symbol_error_per_second": ("symbol_error",),
    "link_downed_per_second": ("link_downed", "carrier_down_count"),
    "port_rcv_errors_per_second": ("port_rcv_errors", "rx_errors"),
    "port_xmit_discards_per_second": ("port_xmit_discards", "tx_dropped"),
    "link_error_recovery_per_second": ("link_error_recovery",),
    "rx_bytes_per_second": ("rx_bytes_total",),
    "tx_bytes_per_second": ("tx_bytes_total",),
}


@pytest.mark.parametrize("seed", range(25))
def test_nic_rate_columns_read_the_first_counter_each_nic_has_now(seed: int) -> None:
    """Each NIC rate column is the rate, since the previous report, of the first of its counters
    the NIC has in the latest report (the frame caches its asks by which counters each NIC has):
    with counters that come and go between reports, NICs that do too, counter dicts left out,
    and reboots. Checked against the history's own single rates."""
    rng = random.Random(seed)
    fleet, frames = frames_for()
    names = sorted(
        {c for sources in _NIC_RATE_SOURCES.values() for c in sources} - {"rx_bytes_total", "tx_bytes_total"}
    )
    keys = [("mlx5_0", 1), ("mlx5_1", 1), ("eth0", None)]
    value: dict[tuple[str, str], int] = {}

    def count(device: str, name: str) -> int:
        value[(device, name)] = value.get((device, name), 0) + rng.choice((0, 1, 5))
        return value[(device, name)]

    t, boot = 100.0, "boot-a"
    checked = 0
    for _ in range(40):
        t += rng.choice((10.0, 10.0, 20.0))
        if rng.random() < 0.05:
            boot = f"boot-{rng.randrange(10**6)}"
        nics = []
        for device, port in keys:
            if rng.random() < 0.1:
                continue  # this NIC left out of the report

            counters = {c: count(device, c) for c in names if rng.random() < 0.6}
            nics.append(
                Nic(
                    device=device,
                    link_layer="InfiniBand" if port is not None else "Ethernet",
                    port=port,
                    rx_bytes_total=count(device, "rx") if rng.random() < 0.8 else None,
                    tx_bytes_total=count(device, "tx") if rng.random() < 0.8 else None,
                    **({"counters": counters} if rng.random() < 0.9 else {}),
                )
            )
        view = fleet.add(report(t, "a", gpus=[], nics=nics, boot=boot))
        frames.record(view, POOL)
        frame = frames.frame("p")
        assert frame is not None
        got_keys, values = frame.nic_keys("a"), frames.nic_snapshot("p", t, t)[1][0, 0]
        by_key = {(n.device, n.port): n for n in view.report.nics}
        for i, key in enumerate(got_keys):
            n = by_key.get(key)
            for column, sources in _NIC_RATE_SOURCES.items():
                want = np.nan
                present = [
                    s
                    for s in sources
                    if n is not None
                    and (
                        getattr(n, s, None) is not None or (isinstance(n.counters, dict) and s in n.counters)
                    )
                ]
                if present and view.previous is not None:
                    window = view.report.time - view.previous.time + 0.001
                    (want,) = view.rates(RateAsks(nic=((key[0], key[1], present[0]),)), window).tolist()
                got = values[i, NIC_COLUMN[column]]
                assert np.array_equal(np.float32(want), got, equal_nan=True), (t, key, column)
                checked += not np.isnan(want)
        fleet.settle("a")
    assert checked > 100


def test_more_nics_than_the_frame_keeps_are_ignored_not_an_error(caplog: pytest.LogCaptureFixture) -> None:
    config = FleetConfig()
    fleet, frames = Fleet(config), FleetFrames(config, max_nics=2)
    nics = [Nic(device=f"mlx5_{i}", link_layer="InfiniBand", port=1, state="ACTIVE") for i in range(4)]
    with caplog.at_level(logging.WARNING, logger="aggregator.fleet.frame"):
        frames.record(fleet.add(report(100, "a", gpus=[], nics=nics)), POOL)
        frames.record(fleet.add(report(110, "a", gpus=[], nics=nics)), POOL)
    assert len(caplog.records) == 1  # rate-limited and counted, not once per NIC or per report
    frame = frames.frame("p")
    assert frame is not None
    assert frame.nic_keys("a") == [("mlx5_0", 1), ("mlx5_1", 1)]
    _, values = frames.nic_snapshot("p", 110, 110)
    assert values.shape[2] >= 2
    assert values[0, 0, :2, NIC_COLUMN["link_up"]].tolist() == [1.0, 1.0]


def test_unknown_pool_snapshot_is_empty() -> None:
    frames = FleetFrames()
    names, values = frames.snapshot("nope", 0, 100)
    assert names == [] and values.shape == (0, 0, FleetConfig().max_gpus, len(GPU_FIELDS))
    names, values = frames.nic_snapshot("nope", 0, 100)
    assert names == [] and values.shape[0] == 0


class _ModelFrame:
    """What a pool frame should hold, kept the plain way: per slot number and node, the GPU block
    and the NIC columns written, and the ring's newest slot number."""

    def __init__(self, interval_s: float, slots: int) -> None:
        self.interval_s, self.slots = interval_s, slots
        self.head: int | None = None
        self.gpu: dict[tuple[int, str], np.ndarray] = {}
        self.nic: dict[tuple[int, str], dict[int, np.ndarray]] = {}

    def write(self, node: str, t: float, gpu: np.ndarray, nic: np.ndarray) -> bool:
        k = int(np.floor(t / self.interval_s))
        if self.head is not None and k <= self.head - self.slots:
            return False
        if self.head is None or k > self.head:
            self.head = k
        self.gpu[(k, node)] = gpu.copy()
        cols = self.nic.setdefault((k, node), {})
        for i in range(nic.shape[0]):
            cols[i] = nic[i].copy()
        return True

    def release(self, node: str) -> None:
        for store in (self.gpu, self.nic):
            for key in [key for key in store if key[1] == node]:
                del store[key]

    def expected(self, nodes: list[str], t0: float, t1: float, gpus: int, width: int) -> tuple[Any, Any]:
        if self.head is None:
            return np.empty((0, len(nodes), gpus, len(GPU_FIELDS))), np.empty((0, len(nodes), width, 0))
        k0 = max(int(np.floor(t0 / self.interval_s)), self.head - self.slots + 1)
        k1 = min(int(np.floor(t1 / self.interval_s)), self.head)
        ks = list(range(k0, k1 + 1))
        g = np.full((len(ks), len(nodes), gpus, len(GPU_FIELDS)), np.nan, np.float32)
        n = np.full((len(ks), len(nodes), width, len(NIC_FIELDS)), np.nan, np.float32)
        for i, k in enumerate(ks):
            for j, node in enumerate(nodes):
                if (k, node) in self.gpu:
                    g[i, j] = self.gpu[(k, node)]
                for c, row in self.nic.get((k, node), {}).items():
                    if c < width:
                        n[i, j, c] = row
        return g, n


@pytest.mark.parametrize("seed", range(40))
def test_frame_growing_shrinking_and_held_by_windows_reads_as_the_plain_model(seed: int) -> None:
    # Rows grow by a quarter (and shrink) many times from 8, NIC columns widen, nodes leave and
    # come back, slots are skipped and the ring is lapped, late reports land in older slots, and
    # windows are held across all of it: every read must equal the plain model, and a window
    # must still read what the frame held when it was taken.
    from aggregator.fleet.frame import PoolFrame

    rng = np.random.default_rng(seed)
    interval, slots, gpus, max_nics = 10.0, 6, 2, 5
    frame = PoolFrame("p", interval_s=interval, slots=slots, gpus=gpus, initial_rows=8, initial_nics=2)
    model = _ModelFrame(interval, slots)
    names = [f"n{i:02d}" for i in range(60)]
    live: set[str] = set()
    nic_names = [(f"mlx5_{i}", 1) for i in range(7)]
    held: list[tuple[Any, Any, Any]] = []
    t = 1_000.0
    for _ in range(400):
        op = rng.random()
        if op < 0.05:
            t += interval * float(rng.integers(slots, 2 * slots))  # lapped: the ring starts over
        elif op < 0.35:
            t += interval * float(rng.random() * 1.5)
        if op > 0.9 and live:
            node = str(rng.choice(sorted(live)))
            frame.release(node)
            model.release(node)
            live.discard(node)
            continue
        # Mostly nodes joining, as after a restart; a few late writes into an older slot.
        node = str(rng.choice(names[: int(rng.integers(10, 61))]))
        at = t - interval * float(rng.integers(0, slots + 2)) if rng.random() < 0.1 else t
        keys = frame.assign_nics(
            node, [nic_names[int(i)] for i in rng.choice(7, int(rng.integers(1, 5)), replace=False)], max_nics
        )
        gpu = rng.random((gpus, len(GPU_FIELDS))).astype(np.float32)
        nic = rng.random((len(keys), len(NIC_FIELDS))).astype(np.float32)
        written = frame.write(node, at, gpu, keys, nic)
        assert written == model.write(node, at, gpu, nic)
        if written:
            live.add(node)
        if rng.random() < 0.15:
            t0, t1 = t - interval * slots, t
            window = frame.window(t0, t1, nic=True)
            held.append((window, *model.expected(list(window.nodes), t0, t1, gpus, window.nic_width)))
            if len(held) > 3:
                held.pop(int(rng.integers(0, len(held))))
        if rng.random() < 0.2:
            t0, t1 = t - interval * slots, t
            nodes, got = frame.snapshot(t0, t1)
            _, got_nic = frame.nic_snapshot(t0, t1)
            want, want_nic = model.expected(nodes, t0, t1, gpus, got_nic.shape[2])
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(got_nic, want_nic)
            assert sorted(nodes) == sorted(live)
    for window, want, want_nic in held:
        np.testing.assert_array_equal(window.gpu, want)
        np.testing.assert_array_equal(window.nic, want_nic)
    # Every position lives on the frame's current arrays a lap of writes after the last growth.
    for _ in range(slots):
        node = sorted(live)[0] if live else names[0]
        frame.write(node, t, np.zeros((gpus, len(GPU_FIELDS)), np.float32), (), np.zeros((0, 0), np.float32))
        live.add(node)
    assert all(g.shape[0] == frame.gpu.shape[1] for g in frame._gpu)


@pytest.mark.parametrize(("interval", "slots"), [(5.0, 120), (10.0, 60), (30.0, 60), (60.0, 30), (120.0, 15)])
def test_frames_keep_600_s_or_60_slots_within_the_history_window(interval: float, slots: int) -> None:
    assert FleetFrames(FleetConfig(interval_seconds=interval)).slots == slots


@pytest.mark.parametrize("interval", [5.0, 10.0, 15.0, 30.0, 60.0])
def test_frames_hold_what_the_slot_counting_detectors_need(interval: float) -> None:
    # The trend detector judges a port against its own baseline (the slots older than its
    # persistence window), the forest needs its window and the settling before it, the peer
    # detector its quarantine's slots of evidence: at a 60 s interval a 600 s frame (10 slots)
    # left the trend detector nothing to judge. Complete slots are the frame's less the one filling.
    complete = FleetFrames(FleetConfig(interval_seconds=interval)).slots - 1
    trend, forest, peer = TrendConfig(), ForestConfig(), PeerConfig()
    assert complete >= trend.long_slots + trend.min_baseline_slots
    assert complete >= window_slots(forest, interval) + round(forest.settle_seconds / interval)
    assert complete >= peer.min_quarantine_slots


def test_written_since_skips_the_slots_never_written() -> None:
    frame = PoolFrame("p", interval_s=10.0, slots=6, gpus=1)
    block, empty = np.zeros((1, len(GPU_FIELDS)), np.float32), np.zeros((0, 0), np.float32)
    assert frame.written_since(0.0) == 0.0  # nothing written: nothing to say
    frame.write("a", 125.0, block, [], empty)  # slot 12
    assert frame.written_since(70.0) == 120.0 and frame.written_since(130.0) == 130.0
    frame.write("a", 135.0, block, [], empty)
    frame.write("b", 101.0, block, [], empty)  # late, for slot 10, still in the ring
    assert frame.written_since(70.0) == 100.0
    frame.write("a", 300.0, block, [], empty)  # a gap longer than the ring: it starts over
    assert frame.written_since(250.0) == 300.0
