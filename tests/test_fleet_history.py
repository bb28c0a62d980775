"""Per-node history: reset-safe rates, ordering, duplicates, the window, and what a view shows."""

from __future__ import annotations

import gc
import itertools
import math
import random
from typing import Any

import msgspec
import numpy as np
import pytest

from agent.errors import ConfigError, ReportError
from agent.report import Gpu, Nic, NvLink, Report
from aggregator.config import FleetConfig
from aggregator.fleet.history import (
    _MAX_BOOT_CODES,
    _MAX_PLAN_COLUMNS,
    _PLANS,
    GPU_COUNTER_FIELDS,
    GPU_FLAG_FIELDS,
    GPU_GAUGE_FIELDS,
    Fleet,
    NodeHistory,
)
from aggregator.fleet.view import RateAsks

ECC = "ecc_sbe_volatile_total"


def gpu(index: int = 0, **fields: Any) -> Gpu:
    return Gpu(index=index, uuid=f"GPU-{index:04d}", model="NVIDIA H100 80GB HBM3", **fields)


def report(
    t: float,
    *,
    node: str = "gpu-0001",
    seq: int | None = None,
    boot: str = "boot-a",
    gpus: list[Gpu] | None = None,
    nics: list[Nic] | None = None,
) -> Report:
    return Report(
        schema="gpuwarden/report/v1",
        node=node,
        time=t,
        seq=int(t) if seq is None else seq,
        boot_id=boot,
        gpus=gpus if gpus is not None else [],
        nics=nics if nics is not None else [],
    )


def ecc_report(t: float, value: int | None, **kw: Any) -> Report:
    return report(t, gpus=[gpu(0, ecc_sbe_volatile_total=value, temperature_celsius=40.0 + t / 10)], **kw)


def feed(fleet: Fleet, reports: list[Report]) -> None:
    """Add reports the way the pipeline does: the rule engine asks the same things after each one."""
    for r in reports:
        view = fleet.add(r)
        view.gpu_rate(0, ECC, 60.0)
        view.gpu_samples(0, "temperature_celsius", 60.0)


def rate(fleet: Fleet, window_s: float, node: str = "gpu-0001") -> float | None:
    view = fleet.view(node)
    assert view is not None
    return view.gpu_rate(0, ECC, window_s)


def test_steady_counter_rate_is_delta_over_elapsed_time() -> None:
    fleet = Fleet()
    feed(fleet, [ecc_report(t, int(t) * 2) for t in range(0, 70, 10)])
    assert rate(fleet, 60.0) == pytest.approx(2.0)
    # A shorter window only sees its own samples: [40, 60].
    assert rate(fleet, 20.0) == pytest.approx(2.0)


def test_counter_going_down_within_a_boot_counts_from_zero_never_negative() -> None:
    fleet = Fleet()
    # +10, then a reset to 5 (5 counted since the reset), then +10.
    feed(fleet, [ecc_report(0, 100), ecc_report(10, 110), ecc_report(20, 5), ecc_report(30, 15)])
    assert rate(fleet, 60.0) == pytest.approx(25 / 30)
    # Just the reset interval: 5 over 10 s, not (5 - 110) / 10.
    view = fleet.view("gpu-0001")
    assert view is not None
    fleet2 = Fleet()
    feed(fleet2, [ecc_report(10, 110), ecc_report(20, 5)])
    assert rate(fleet2, 60.0) == pytest.approx(0.5)


def test_boot_change_starts_over() -> None:
    fleet = Fleet()
    feed(fleet, [ecc_report(0, 0, boot="a"), ecc_report(10, 100, boot="a")])
    view = fleet.add(ecc_report(20, 1000, boot="b"))
    assert view.rebooted is True
    assert view.previous is None
    # One sample of the new boot: no rate yet, and nothing of boot "a" leaks in.
    assert view.gpu_rate(0, ECC, 60.0) is None
    view = fleet.add(ecc_report(30, 1003, boot="b"))
    assert view.rebooted is False
    assert view.previous is not None and view.previous.time == 20
    assert view.gpu_rate(0, ECC, 60.0) == pytest.approx(0.3)
    # A counter that restarted lower after the reboot is a baseline, not a reset or a negative rate.
    fleet.add(ecc_report(40, 1, boot="c"))
    assert fleet.add(ecc_report(50, 4, boot="c")).gpu_rate(0, ECC, 600.0) == pytest.approx(0.3)


def test_gap_spreads_the_delta_over_the_real_elapsed_time() -> None:
    fleet = Fleet()
    # Reports 20..50 were lost: the 50 errors between 10 and 60 spread over 50 s.
    feed(fleet, [ecc_report(0, 0), ecc_report(10, 10), ecc_report(60, 60)])
    assert rate(fleet, 600.0) == pytest.approx(1.0)
    assert rate(fleet, 55.0) == pytest.approx(1.0)
    # The window [30, 60] holds only the sample at 60: too few samples, no guess.
    assert rate(fleet, 30.0) is None


def test_null_values_are_skipped_and_too_few_samples_give_none() -> None:
    fleet = Fleet()
    view = fleet.add(ecc_report(0, 0))
    assert view.gpu_rate(0, ECC, 60.0) is None  # one sample
    feed(fleet, [ecc_report(10, None), ecc_report(20, 20)])
    assert rate(fleet, 60.0) == pytest.approx(1.0)
    fleet = Fleet()
    feed(fleet, [ecc_report(t, None) for t in (0, 10, 20)])
    assert rate(fleet, 60.0) is None


def test_out_of_order_reports_are_ordered_by_report_time() -> None:
    in_order, shuffled = Fleet(), Fleet()
    times = [0, 10, 20, 30, 40]
    feed(in_order, [ecc_report(t, int(t) * 3) for t in times])
    feed(shuffled, [ecc_report(t, int(t) * 3) for t in (0, 20, 10, 40, 30)])
    view = shuffled.view("gpu-0001")
    assert view is not None
    assert view.report.time == 40
    samples = view.gpu_samples(0, "temperature_celsius", 600.0)
    assert [s[0] for s in samples] == [0, 10, 20, 30, 40]
    assert [s[1] for s in samples] == [40.0, 41.0, 42.0, 43.0, 44.0]
    assert rate(shuffled, 600.0) == pytest.approx(rate(in_order, 600.0))
    assert rate(shuffled, 600.0) == pytest.approx(3.0)


def test_late_report_view_is_the_latest_with_the_late_one_as_added() -> None:
    fleet = Fleet()
    feed(fleet, [ecc_report(0, 0), ecc_report(20, 20)])
    late = ecc_report(10, 10)
    view = fleet.add(late)
    assert view.outcome == "late"
    assert view.report.time == 20
    assert view.added is late
    # The late report is now the latest's previous report of the same boot.
    assert view.previous is late
    assert view.rebooted is False


def test_duplicates_do_not_double_count() -> None:
    once, twice = Fleet(), Fleet()
    reports = [ecc_report(0, 0), ecc_report(10, 10), ecc_report(20, 30)]
    feed(once, reports)
    for r in reports:
        assert twice.add(r).outcome == "latest"
        assert twice.add(r).outcome == "duplicate"
        feed(twice, [r])
    # A late duplicate of an older report too.
    assert twice.add(reports[1]).outcome == "duplicate"
    assert rate(twice, 60.0) == pytest.approx(rate(once, 60.0))
    view = twice.view("gpu-0001")
    assert view is not None
    assert [s[0] for s in view.gpu_samples(0, "temperature_celsius", 60.0)] == [0, 10, 20]


def test_window_evicts_old_samples_and_drops_reports_older_than_it() -> None:
    fleet = Fleet(FleetConfig(window_seconds=100.0, interval_seconds=10.0), coarse_seconds=0.0)
    feed(fleet, [ecc_report(t, int(t)) for t in range(0, 310, 10)])
    history = fleet.history("gpu-0001")
    assert history is not None
    assert history.times() == [float(t) for t in range(200, 310, 10)]
    # A rate asking for more than the window gets the window.
    assert rate(fleet, 10_000.0) == pytest.approx(1.0)
    view = fleet.add(ecc_report(150, 150))
    assert view.outcome == "expired"
    assert history.times()[0] == 200.0


def test_older_samples_are_thinned_but_counter_rates_stay_exact() -> None:
    fleet = Fleet(
        FleetConfig(window_seconds=600.0, interval_seconds=10.0), fine_seconds=60.0, coarse_seconds=30.0
    )
    # Irregular increments so that a wrong thinning would show in the rate.
    values = [t * t for t in range(61)]
    feed(fleet, [ecc_report(10 * i, v) for i, v in enumerate(values)])
    history = fleet.history("gpu-0001")
    assert history is not None
    times = history.times()
    latest = times[-1]
    # Older than the fine part (and than the few samples waiting for the next kept one to go).
    old = [t for t in times if t < latest - 60 - 30]
    recent = [t for t in times if t >= latest - 60]
    assert old[0] == 0.0
    assert all(b - a >= 30 for a, b in itertools.pairwise(old))
    assert recent == [float(t) for t in range(540, 610, 10)]
    assert len(times) < 61
    first = times[0]
    expected = (values[-1] - values[int(first) // 10]) / (latest - first)
    assert rate(fleet, 600.0) == pytest.approx(expected)
    # A window inside the fine part is exact to the sample.
    assert rate(fleet, 60.0) == pytest.approx((values[60] - values[54]) / 60)


def test_nvlink_rate_sums_links_each_reset_safe() -> None:
    def nv(t: float, a: int, b: int | None) -> Report:
        links = [NvLink(link=0, crc_flit_errors_total=a), NvLink(link=1, crc_flit_errors_total=b)]
        return report(t, gpus=[gpu(0, nvlink=links)])

    fleet = Fleet()
    for r in (nv(0, 100, 0), nv(10, 110, 5), nv(20, 3, 10)):  # link 0 resets to 3
        fleet.add(r).nvlink_rate(0, "crc_flit_errors_total", 60.0)
    view = fleet.add(nv(30, 3, None))  # link 1 unsupported now: link 0 alone
    assert view.nvlink_rate(0, "crc_flit_errors_total", 60.0) == pytest.approx((15 + 8 + 0) / 30)
    assert view.nvlink_rate(1, "crc_flit_errors_total", 60.0) is None  # no such GPU


def test_nic_rate_of_typed_and_driver_counters() -> None:
    def ib(t: float, rx: int, sym: int) -> Report:
        nic = Nic(
            device="mlx5_0",
            link_layer="InfiniBand",
            port=1,
            rx_bytes_total=rx,
            counters={"symbol_error": sym},
        )
        return report(t, nics=[nic])

    fleet = Fleet()
    for r in (ib(0, 0, 0), ib(10, 1000, 2)):
        view = fleet.add(r)
        view.nic_rate("mlx5_0", 1, "rx_bytes_total", 60.0)
        view.nic_rate("mlx5_0", 1, "symbol_error", 60.0)
    view = fleet.add(ib(20, 3000, 1))  # symbol_error went down: a reset, 1 since
    assert view.nic_rate("mlx5_0", 1, "rx_bytes_total", 60.0) == pytest.approx(150.0)
    assert view.nic_rate("mlx5_0", 1, "symbol_error", 60.0) == pytest.approx(3 / 20)
    assert view.nic_rate("mlx5_0", 1, "port_rcv_errors", 60.0) is None
    assert view.nic_rate("mlx5_9", 1, "symbol_error", 60.0) is None


def test_a_field_asked_on_one_node_is_kept_by_all_from_their_next_report() -> None:
    fleet = Fleet()
    fleet.add(ecc_report(0, 0, node="a")).gpu_rate(0, ECC, 60.0)
    # Node b's series exists from its first report although nobody asked b yet.
    for t, v in ((0, 0), (10, 5), (20, 30)):
        fleet.add(ecc_report(t, v, node="b"))
    assert rate(fleet, 60.0, node="b") == pytest.approx(1.5)


def test_first_ask_seeds_from_the_reports_kept_and_never_inflates_a_rate() -> None:
    fleet = Fleet()
    fleet.add(ecc_report(0, 0))
    view = fleet.add(ecc_report(10, 7))
    # Asked for the first time at the second report: seeded from the previous one and the latest.
    assert view.gpu_rate(0, ECC, 60.0) == pytest.approx(0.7)

    late = Fleet()
    for t in (0, 10, 20):
        view = late.add(ecc_report(t, 0))
    view = late.add(ecc_report(30, 9))
    # First asked at the fourth report: the series starts at 20, so it cannot say what happened
    # over [0, 30]; spreading the 9 over 10 s and calling that the 30 s rate would triple it.
    assert view.gpu_rate(0, ECC, 30.0) is None
    assert view.gpu_rate(0, ECC, 10.0) == pytest.approx(0.9)
    view = late.add(ecc_report(40, 9))
    assert view.gpu_rate(0, ECC, 20.0) == pytest.approx(0.45)
    assert view.gpu_rate(0, ECC, 40.0) is None
    # Registered up front, the series covers everything from the node's first report.
    tracked = Fleet()
    tracked.registry.track_gpu_counters(ECC)
    for t, v in ((0, 0), (10, 0), (20, 0), (30, 9)):
        view = tracked.add(ecc_report(t, v))
    assert view.gpu_rate(0, ECC, 30.0) == pytest.approx(0.3)


def test_unknown_fields_and_bad_windows_are_refused() -> None:
    view = Fleet().add(ecc_report(0, 0))
    with pytest.raises(ConfigError, match="temprature"):
        view.gpu_samples(0, "temprature", 60.0)
    with pytest.raises(ConfigError, match="unknown GPU counter field 'temperature_celsius'"):
        view.gpu_rate(0, "temperature_celsius", 60.0)
    with pytest.raises(ConfigError, match="NVLink"):
        view.nvlink_rate(0, ECC, 60.0)
    with pytest.raises(ConfigError, match="positive"):
        view.gpu_rate(0, ECC, 0.0)
    with pytest.raises(ConfigError, match="positive"):
        view.gpu_rate(0, ECC, math.nan)


def test_gpu_samples_give_flags_as_numbers_and_nulls_as_none() -> None:
    fleet = Fleet()
    fleet.registry.track_gpu_gauges("remapped_rows_pending", "power_watts")
    fleet.add(report(0, gpus=[gpu(0, remapped_rows_pending=False, power_watts=300.0)]))
    fleet.add(report(10, gpus=[gpu(0, remapped_rows_pending=True, power_watts=None)]))
    view = fleet.add(report(20, gpus=[]))  # GPU 0 fell off: its past stays readable
    assert view.gpu_samples(0, "remapped_rows_pending", 60.0) == [(0.0, 0.0), (10.0, 1.0), (20.0, None)]
    assert view.gpu_samples(0, "power_watts", 60.0) == [(0.0, 300.0), (10.0, None), (20.0, None)]
    assert view.gpu_samples(0, "power_watts", 15.0) == [(10.0, None), (20.0, None)]
    # Never kept for a GPU this node never had.
    assert view.gpu_samples(3, "power_watts", 60.0) == []


def test_clock_stepping_back_past_the_window_starts_the_history_over() -> None:
    fleet = Fleet(FleetConfig(window_seconds=100.0))
    feed(fleet, [ecc_report(1000, 0, seq=1), ecc_report(1010, 10, seq=2)])
    # Same boot, later seq, but 500 s earlier: the node's clock was wrong before, or is now.
    view = fleet.add(ecc_report(510, 10, seq=3))
    assert view.outcome == "latest"
    assert view.report.time == 510
    assert view.previous is None
    assert fleet.last_report_time("gpu-0001") == 510
    # An old report of an earlier seq is just too old.
    assert fleet.add(ecc_report(100, 0, seq=0)).outcome == "expired"


def test_a_view_answers_for_its_own_time_and_boot() -> None:
    fleet = Fleet()
    feed(fleet, [ecc_report(0, 0), ecc_report(10, 10)])
    old = fleet.add(ecc_report(20, 20))
    fleet.add(ecc_report(30, 1000)).gpu_rate(0, ECC, 60.0)
    assert old.gpu_rate(0, ECC, 60.0) == pytest.approx(1.0)
    fleet.add(ecc_report(40, 0, boot="new"))
    assert old.gpu_rate(0, ECC, 60.0) is None


def test_fast_reporter_is_capped_instead_of_growing() -> None:
    fleet = Fleet(FleetConfig(window_seconds=100.0, interval_seconds=10.0), coarse_seconds=0.0)
    feed(fleet, [ecc_report(t / 10, int(t), seq=t) for t in range(1000)])  # every 0.1 s
    history = fleet.history("gpu-0001")
    assert history is not None
    assert len(history) == history.max_samples
    assert rate(fleet, 5.0) == pytest.approx(10.0)


def test_fleet_bookkeeping() -> None:
    fleet = Fleet()
    fleet.add(ecc_report(5, 0, node="a"))
    fleet.add(ecc_report(7, 0, node="b"))
    assert fleet.nodes() == ["a", "b"]
    assert "a" in fleet and len(fleet) == 2
    assert fleet.last_report_time("b") == 7
    assert fleet.last_report_time("zz") is None
    assert fleet.forget("a") is True
    assert fleet.forget("a") is False
    assert fleet.nodes() == ["b"]
    assert fleet.view("a") is None
    with pytest.raises(ReportError, match="gpu-0009"):
        NodeHistory("gpu-0001").add(ecc_report(0, 0, node="gpu-0009"))


def test_field_lists_cover_every_numeric_gpu_field() -> None:
    numeric = {
        f.name
        for f in msgspec.structs.fields(Gpu)
        if f.name not in {"index", "uuid", "model", "pci_bus_id", "driver_version", "nvlink"}
    }
    assert numeric == GPU_COUNTER_FIELDS | GPU_GAUGE_FIELDS | GPU_FLAG_FIELDS
    assert not (GPU_COUNTER_FIELDS & GPU_GAUGE_FIELDS)


def test_unchanged_counters_across_a_reboot_start_the_new_boot_from_them() -> None:
    # The same raw values before and after a reboot: the new boot's first sample is its baseline,
    # and what it counts next is a rate of the new boot (an implementation that skips counters
    # that did not move must do so within one boot only).
    def nv(t: float, boot: str, value: int) -> Report:
        links = [NvLink(link=k, crc_flit_errors_total=value) for k in range(2)]
        return report(t, boot=boot, gpus=[gpu(0, ecc_sbe_volatile_total=value, nvlink=links)])

    fleet = Fleet()
    fleet.registry.track_gpu_counters(ECC)
    fleet.registry.track_nvlink_counters("crc_flit_errors_total")
    for r in (nv(0, "a", 5), nv(10, "a", 5), nv(20, "b", 5), nv(30, "b", 5)):
        fleet.add(r)
    view = fleet.add(nv(40, "b", 8))
    assert view.gpu_rate(0, ECC, 60.0) == pytest.approx(3 / 20)
    assert view.nvlink_rate(0, "crc_flit_errors_total", 60.0) == pytest.approx(6 / 20)


def test_driver_counters_unchanged_missing_or_across_a_reboot() -> None:
    def ib(t: float, boot: str, counters: dict[str, int]) -> Report:
        nic = Nic(device="mlx5_0", link_layer="InfiniBand", port=1, rx_bytes_total=int(t), counters=counters)
        return report(t, boot=boot, nics=[nic])

    fleet = Fleet()
    fleet.registry.track_nic_counters("symbol_error", "link_downed", "rx_bytes_total")
    steps = [
        ("a", {"symbol_error": 4, "link_downed": 1}),
        ("a", {"symbol_error": 4, "link_downed": 1}),
        ("b", {"symbol_error": 4, "link_downed": 1}),  # a reboot with the same values: a baseline
        ("b", {"symbol_error": 4}),  # link_downed missing: no value, not a reset
        ("b", {"symbol_error": 6, "link_downed": 3}),
    ]
    for i, (boot, counters) in enumerate(steps):
        view = fleet.add(ib(10.0 * i, boot, counters))
    assert view.nic_rate("mlx5_0", 1, "symbol_error", 60.0) == pytest.approx(2 / 20)
    assert view.nic_rate("mlx5_0", 1, "link_downed", 60.0) == pytest.approx(2 / 20)
    assert view.nic_rate("mlx5_0", 1, "rx_bytes_total", 60.0) == pytest.approx(1.0)


def test_a_nic_gone_for_the_window_loses_its_series_and_the_rest_keep_their_rates() -> None:
    """Dropping a gone NIC's columns renumbers the others: their rates must not move."""

    def ib(t: float, devices: list[str]) -> Report:
        nics = [
            Nic(device=d, link_layer="InfiniBand", port=1, rx_bytes_total=int(t) * (i + 1), counters={})
            for i, d in enumerate(devices)
        ]
        gpus = [gpu(0, ecc_sbe_volatile_total=int(t), temperature_celsius=40.0)]
        return report(t, gpus=gpus, nics=nics)

    fleet = Fleet(FleetConfig(window_seconds=120.0))
    fleet.registry.track_nic_counters("rx_bytes_total")
    fleet.registry.track_gpu_counters(ECC)
    fleet.registry.track_gpu_gauges("temperature_celsius")
    for t in range(0, 60, 10):
        fleet.add(ib(t, ["mlx5_0", "mlx5_1", "mlx5_2"]))
    for t in range(60, 300, 10):  # mlx5_0 is gone, for longer than the 120-s window
        fleet.add(ib(t, ["mlx5_1", "mlx5_2"]))
    for t in range(300, 360, 10):  # a new NIC: the node's NICs are looked at again
        view = fleet.add(ib(t, ["mlx5_1", "mlx5_2", "mlx5_3"]))
    history = fleet.history("gpu-0001")
    assert history is not None
    assert history.nic_keys() == [("mlx5_1", 1), ("mlx5_2", 1), ("mlx5_3", 1)]
    # Renumbered, each remaining NIC still reads its own counter (index 0 and 1 of the report).
    assert view.nic_rate("mlx5_1", 1, "rx_bytes_total", 60.0) == pytest.approx(1.0)
    assert view.nic_rate("mlx5_2", 1, "rx_bytes_total", 60.0) == pytest.approx(2.0)
    assert view.gpu_rate(0, ECC, 60.0) == pytest.approx(1.0)
    assert [v for _, v in view.gpu_samples(0, "temperature_celsius", 30.0)] == [40.0] * 4


def test_a_boot_id_new_every_report_neither_grows_the_node_nor_loses_a_reset() -> None:
    # An agent (or a forger with its token) that changes the boot id on every report: each boot
    # starts the counter over, and the node's map of boots stays bounded by its window.
    fleet = Fleet()
    fleet.registry.track_gpu_counters(ECC)
    for k in range(400):
        view = fleet.add(ecc_report(10.0 * k, 5 + k % 3, boot=f"boot-{k}"))
    history = fleet.history("gpu-0001")
    assert history is not None
    assert len(history._boot_codes) <= max(_MAX_BOOT_CODES, len(set(history._boots)) + 1)
    # Every report is the first of its boot: no rate across boots, however the values moved.
    assert view.gpu_rate(0, ECC, 600.0) is None
    # The same boot again counts as one boot: 5 -> 7 is two errors.
    fleet.add(ecc_report(4000.0, 5, boot="boot-x"))
    view = fleet.add(ecc_report(4010.0, 7, boot="boot-x"))
    assert view.gpu_rate(0, ECC, 10.0) == pytest.approx(0.2)


def test_a_nodes_series_are_a_few_objects_for_the_garbage_collector() -> None:
    """A full collection walks every tracked object: at 7,500 nodes one object per series (144 a
    node) made pauses of about a second. The numbers are one array whatever the series count."""
    links = [NvLink(link=i, crc_flit_errors_total=0, replay_errors_total=0) for i in range(18)]
    gpus = [gpu(i, ecc_sbe_volatile_total=0, temperature_celsius=40.0, nvlink=links) for i in range(8)]
    nics = [
        Nic(device=f"mlx5_{i}", link_layer="InfiniBand", port=1, rx_bytes_total=0, counters={})
        for i in range(8)
    ]
    fleet = Fleet()
    fleet.registry.track_gpu_counters(ECC)
    fleet.registry.track_nvlink_counters("crc_flit_errors_total", "replay_errors_total")
    fleet.registry.track_nic_counters("symbol_error", "rx_bytes_total")
    fleet.registry.track_gpu_gauges("temperature_celsius")
    for t in range(0, 200, 10):
        fleet.add(report(t, gpus=gpus, nics=nics))
    history = fleet.history("gpu-0001")
    assert history is not None
    for t in range(0, 30, 10):
        fleet.add(report(t, node="gpu-0002", gpus=gpus, nics=nics))
    other = fleet.history("gpu-0002")
    assert other is not None and other._plan is history._plan is not None
    gc.collect()  # tuples of numbers are untracked at a collection
    seen: set[int] = set()
    tracked = visits = 0
    # The reports, the fleet's registry, and the row plan every node with these columns shares.
    shared = ("_latest", "_previous", "registry", "_plan")
    stack: list[object] = [getattr(history, k) for k in type(history).__slots__ if k not in shared]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (Report, type)):  # a type: shared, not the node's
            continue
        seen.add(id(obj))
        if gc.is_tracked(obj):
            tracked += 1
            referents = gc.get_referents(obj)
            visits += len(referents)
            stack.extend(referents)
    series = 8 * (1 + 2 + 1) + 8 * 2
    assert series == 48
    assert tracked < 30, tracked
    # And what a collection visits from them: every item of a list (a float included), nothing
    # inside an array. Per-series state in lists made this grow with the series (7 x 48 here).
    assert visits < 3 * series, visits


def _random_stream(seed: int) -> list[Report]:
    """Reports with counters that creep, reset and go null, a reboot or two, GPUs and NICs that
    come and go, late and duplicate deliveries."""
    rng = random.Random(seed)
    counts: dict[tuple[object, ...], int] = {}

    def value(key: tuple[object, ...]) -> int | None:
        if rng.random() < 0.08:
            return None
        counts[key] = 0 if rng.random() < 0.03 else counts.get(key, 0) + rng.choice((0, 0, 1, 7))
        return counts[key]

    out: list[Report] = []
    t, boot = 0.0, "boot-a"
    for _ in range(rng.randint(30, 80)):
        t += rng.choice((10.0, 10.0, 10.0, 25.0))
        if rng.random() < 0.04:
            boot = f"boot-{rng.randrange(10**6)}"
        gpus = [
            gpu(
                i,
                ecc_sbe_volatile_total=value((i, "ecc")),
                pcie_replay_total=value((i, "pcie")),
                nvlink=[
                    NvLink(
                        link=k, crc_flit_errors_total=value((i, k, "crc")), replay_errors_total=value((i, k))
                    )
                    for k in range(rng.choice((0, 2, 2, 3)))
                ],
            )
            for i in range(rng.choice((1, 2, 2)))
        ]
        nics = [
            Nic(
                device=f"mlx5_{i}",
                link_layer="InfiniBand",
                port=1,
                rx_bytes_total=value(("rx", i)),
                counters={"symbol_error": c} if (c := value(("se", i))) is not None else {},
            )
            for i in range(rng.choice((1, 2, 2)))
        ]
        out.append(report(t, boot=boot, gpus=gpus, nics=nics))
    for k in range(len(out) - 1):  # a few late reports, and a duplicate
        if rng.random() < 0.08:
            out[k], out[k + 1] = out[k + 1], out[k]
    return [*out, out[len(out) // 2]]


@pytest.mark.parametrize("seed", range(40))
def test_many_rates_at_once_are_each_what_its_single_rate_answers(seed: int) -> None:
    """The pool frames ask a hundred rates a report in one ``rates`` call; each answer must be what
    the single-rate method gives (NaN for None), including series not created yet, windows with
    no value at an end, reboots and late reports."""
    asks = RateAsks(
        gpu=tuple((i, f) for i in range(3) for f in (ECC, "pcie_replay_total")),
        nvlink=tuple((i, f) for i in range(3) for f in ("crc_flit_errors_total", "replay_errors_total")),
        nic=tuple((f"mlx5_{i}", 1, c) for i in range(3) for c in ("symbol_error", "rx_bytes_total")),
    )
    batched, single = Fleet(), Fleet()
    for r in _random_stream(seed):
        a, b = batched.add(r), single.add(r)
        for window in (10.001, 60.0):
            got = a.rates(asks, window)
            want = [b.gpu_rate(i, f, window) for i, f in asks.gpu]
            want += [b.nvlink_rate(i, f, window) for i, f in asks.nvlink]
            want += [b.nic_rate(d, p, c, window) for d, p, c in asks.nic]
            assert [None if math.isnan(x) else x for x in got.tolist()] == want, (r.time, window)


@pytest.mark.parametrize("seed", range(20))
def test_a_settled_history_answers_as_one_that_keeps_the_previous_report(seed: int) -> None:
    """``settle`` lets the previous report go between reports; what a view says of the report
    just added (its rates, previous, rebooted) must not change for it, late reports included."""
    asks = RateAsks(
        gpu=tuple((i, f) for i in range(3) for f in (ECC, "pcie_replay_total")),
        nvlink=tuple((i, "crc_flit_errors_total") for i in range(3)),
        nic=tuple((f"mlx5_{i}", 1, c) for i in range(3) for c in ("symbol_error", "rx_bytes_total")),
    )
    settled, kept = Fleet(), Fleet()
    for fleet in (settled, kept):  # asked for up front, as the rule engine does on a first report
        fleet.registry.track_gpu_counters(ECC, "pcie_replay_total")
        fleet.registry.track_nvlink_counters("crc_flit_errors_total")
        fleet.registry.track_nic_counters("symbol_error", "rx_bytes_total")
    for r in _random_stream(seed):
        a, b = settled.add(r), kept.add(r)
        assert (a.outcome, a.report, a.rebooted) == (b.outcome, b.report, b.rebooted)
        if a.outcome == "latest":
            assert a.previous is b.previous
        elif a.outcome == "late":
            # Whether the late report became the latest's previous is decided the same way
            # with the previous report let go of as with it kept.
            assert (a.previous is a.added) == (b.previous is a.added)
        if a.outcome == "latest" and a.previous is not None:
            # The rates over the last interval, what the pool frames ask: the same, always.
            window = a.report.time - a.previous.time + 0.001
            assert np.array_equal(a.rates(asks, window), b.rates(asks, window), equal_nan=True)
        for window in (60.0, 600.0):
            # A GPU or NIC new to the history starts its series from the latest report alone, one
            # report later than from both: where the settled one answers, it answers the same.
            got, want = a.rates(asks, window), b.rates(asks, window)
            known = ~np.isnan(got)
            assert np.array_equal(got[known], want[known])
        settled.settle(r.node)
        history = settled.history(r.node)
        assert history is not None and history.view() is not None
        assert history.view().previous is None  # type: ignore[union-attr]


@pytest.mark.parametrize("seed", range(30))
def test_rates_over_the_last_interval_are_the_rates_since_the_previous_report(seed: int) -> None:
    """``last_rates`` (what the pool frames ask each report) answers from the rates it computed once
    for every column between the two newest rows; each answer must be ``rates`` over the window
    that reaches back to the previous report, with late reports landing between the two, reboots,
    series created by the asking itself, views asked again after the next report, and the history
    settled between reports."""
    asks = RateAsks(
        gpu=tuple((i, f) for i in range(3) for f in (ECC, "pcie_replay_total")),
        nvlink=tuple((i, f) for i in range(3) for f in ("crc_flit_errors_total", "replay_errors_total")),
        nic=tuple((f"mlx5_{i}", 1, c) for i in range(3) for c in ("symbol_error", "rx_bytes_total")),
    )
    other = RateAsks(gpu=((0, ECC),), nic=(("mlx5_1", 1, "rx_bytes_total"),))
    fleet = Fleet()
    stream = _random_stream(seed) if seed % 2 else _repeating_stream(seed)
    before: list[tuple[Any, float]] = []  # views of earlier reports, asked again later
    fast = 0
    for r in stream:
        view = fleet.add(r)
        history = fleet.history(r.node)
        assert history is not None
        if view.previous is None:
            assert np.isnan(view.last_rates(asks)).all()
        else:
            window = view.report.time - view.previous.time + 0.001
            fast += history._appended == history._rows_version
            for a in (asks, other, asks):  # the second time from the resolved columns
                got = view.last_rates(a)
                assert np.array_equal(got, view.rates(a, window), equal_nan=True), (r.time, a)
            before.append((view, window))
        for old, window in before[-3:-1]:
            assert np.array_equal(old.last_rates(asks), old.rates(asks, window), equal_nan=True)
        if seed % 3:
            fleet.settle(r.node)
    assert fast > len(stream) // 2  # most answers came the fast way


def test_a_late_report_dated_as_the_previous_one_leaves_the_last_interval_as_it_was() -> None:
    """A late report dated as the previous one (another seq) lands in the row just before the
    latest and becomes its previous, with no counter values (see the module docstring): the rate
    since then is still counted from the row of the same time that has them, as ``rates`` does."""
    fleet = Fleet()
    fleet.registry.track_gpu_counters(ECC)
    asks = RateAsks(gpu=((0, ECC),))
    fleet.add(report(10.0, gpus=[gpu(0, ecc_sbe_volatile_total=0)]))
    fleet.add(report(20.0, gpus=[gpu(0, ecc_sbe_volatile_total=50)]))
    late = msgspec.structs.replace(report(10.0, gpus=[gpu(0, ecc_sbe_volatile_total=0)]), seq=999)
    view = fleet.add(late)
    assert view.outcome == "late" and view.previous is not None and view.previous.time == 10.0
    assert view.last_rates(asks).tolist() == [5.0]


def _repeating_stream(seed: int) -> list[Report]:
    """In-order reports whose counters creep, reset, go null and repeat exactly (a GPU's links
    unchanged from one report to the next is what a healthy node sends most of the time), with
    GPUs, links and NICs that come and go and a reboot now and then."""
    rng = random.Random(seed)
    counts: dict[tuple[object, ...], int] = {}

    def value(key: tuple[object, ...], still: bool) -> int | None:
        if rng.random() < 0.06:
            return None
        if not still:
            counts[key] = 0 if rng.random() < 0.04 else counts.get(key, 0) + rng.choice((0, 1, 7))
        return counts.get(key, 0)

    out: list[Report] = []
    t, boot = 0.0, "boot-a"
    last_gpus: dict[int, Gpu] = {}
    for _ in range(rng.randint(30, 70)):
        t += rng.choice((10.0, 10.0, 25.0))
        if rng.random() < 0.05:
            boot = f"boot-{rng.randrange(10**6)}"
        gpus = []
        for i in range(rng.choice((1, 2, 2, 2))):
            if i in last_gpus and rng.random() < 0.6:
                gpus.append(last_gpus[i])  # the very same GPU: nothing counted
                continue
            still = rng.random() < 0.5  # links equal to the last report's, the struct new
            links = [
                NvLink(
                    link=k,
                    crc_flit_errors_total=value((i, k, "crc"), still),
                    replay_errors_total=value((i, k, "replay"), still),
                )
                for k in range(rng.choice((0, 2, 3, 3)))
            ]
            gpus.append(
                gpu(
                    i, ecc_sbe_volatile_total=value((i, "ecc"), False), temperature_celsius=40.0, nvlink=links
                )
            )
        last_gpus = {g.index: g for g in gpus}
        nics = [
            Nic(
                device=f"mlx5_{i}",
                link_layer="InfiniBand",
                port=1,
                rx_bytes_total=value(("rx", i), False),
                counters={"symbol_error": c} if (c := value(("se", i), False)) is not None else {},
            )
            for i in range(rng.choice((1, 2, 2)))
        ]
        out.append(report(t, boot=boot, gpus=gpus, nics=nics))
    return out


class _ReferenceSeries:
    """One series as the report contract defines it, from first principles: per row, the
    cumulative reset-safe increase this boot (NaN: no value), the NVLink sums link by link."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, str, float]] = []  # (time, boot, cumulative or NaN)
        # A series starts when its GPU or NIC first appears, from the report before (the one the
        # history still holds in full), and answers only for windows it covers.
        self.since: float | None = None
        self.before: float | None = None
        self.cum = 0.0
        self.boot: str | None = None
        self.raw: float | None = None
        self.links: dict[int, int | None] = {}  # link -> last value this boot (NVLink sums)

    def _start(self, t: float, present: bool) -> None:
        if present and self.since is None:
            self.since = t if self.before is None else self.before
        self.before = t

    def counter(self, t: float, boot: str, v: int | None, present: bool) -> None:
        self._start(t, present)
        if v is None:
            self.rows.append((t, boot, math.nan))
            return
        if boot == self.boot and self.raw is not None:
            d = v - self.raw
            self.cum += d if d >= 0 else v
        self.raw, self.boot = v, boot
        self.rows.append((t, boot, self.cum))

    def links_sum(self, t: float, boot: str, links: dict[int, int | None] | None) -> None:
        self._start(t, links is not None)
        before = self.links if boot == self.boot else {}
        self.links = {}
        valid = False
        for k, v in (links or {}).items():
            p = before.get(k)
            if v is None:
                self.links[k] = p
                continue
            valid = True
            if p is not None:
                self.cum += v - p if v >= p else v
            self.links[k] = v
        if valid:
            self.boot = boot
        elif boot != self.boot:
            self.links = {}
        self.rows.append((t, boot, self.cum if valid else math.nan))

    def rate(self, now: float, window_s: float) -> float | None:
        rows = self.rows
        if self.since is None or not rows:
            return None
        boot = rows[-1][1]
        start = len(rows) - 1
        while start > 0 and rows[start - 1][1] == boot:
            start -= 1
        inside = [i for i in range(start, len(rows)) if now - window_s <= rows[i][0] <= now]
        if not inside or self.since > rows[inside[0]][0]:
            return None
        known = [i for i in inside if not math.isnan(rows[i][2])]
        if len(known) < 2:
            return None
        lo, hi = known[0], known[-1]
        return (rows[hi][2] - rows[lo][2]) / (rows[hi][0] - rows[lo][0])


@pytest.mark.parametrize("seed", range(30))
def test_rates_are_what_the_contract_says_from_first_principles(seed: int) -> None:
    """Every rate the history answers, for counters that creep, reset, go null, repeat exactly,
    reboot, and GPUs, links and NICs that come and go, equals the rate computed from the reports
    alone by the contract's definition (the row is built for all series at once, not one by one)."""
    fleet = Fleet()
    fleet.registry.track_gpu_counters(ECC)
    fleet.registry.track_nvlink_counters("crc_flit_errors_total", "replay_errors_total")
    fleet.registry.track_nic_counters("symbol_error", "rx_bytes_total")
    ref: dict[tuple[object, ...], _ReferenceSeries] = {}
    stream = _repeating_stream(seed)
    gpus_seen = sorted({g.index for r in stream for g in r.gpus})
    nics_seen = sorted({n.device for r in stream for n in r.nics})
    for r in stream:
        view = fleet.add(r)
        assert view.outcome == "latest"
        fleet.settle(r.node)
        gpus = {g.index: g for g in r.gpus}
        nics = {n.device: n for n in r.nics}
        for i in gpus_seen:
            g = gpus.get(i)
            ref.setdefault(("ecc", i), _ReferenceSeries()).counter(
                r.time, r.boot_id, None if g is None else g.ecc_sbe_volatile_total, g is not None
            )
            for name in ("crc_flit_errors_total", "replay_errors_total"):
                links = None if g is None else {link.link: getattr(link, name) for link in g.nvlink or ()}
                ref.setdefault((name, i), _ReferenceSeries()).links_sum(r.time, r.boot_id, links)
        for d in nics_seen:
            n = nics.get(d)
            se = None if n is None or not isinstance(n.counters, dict) else n.counters.get("symbol_error")
            ref.setdefault(("se", d), _ReferenceSeries()).counter(r.time, r.boot_id, se, n is not None)
            rx = None if n is None else n.rx_bytes_total
            ref.setdefault(("rx", d), _ReferenceSeries()).counter(r.time, r.boot_id, rx, n is not None)
        for window in (10.001, 60.0, 200.0):
            for (kind, key), series in ref.items():
                if kind == "ecc":
                    got = view.gpu_rate(int(key), ECC, window)  # type: ignore[call-overload]
                elif kind in ("se", "rx"):
                    counter = "symbol_error" if kind == "se" else "rx_bytes_total"
                    got = view.nic_rate(str(key), 1, counter, window)
                else:
                    got = view.nvlink_rate(int(key), str(kind), window)  # type: ignore[call-overload]
                want = series.rate(r.time, window)
                assert got == pytest.approx(want), (r.time, window, kind, key)


def test_nodes_with_different_columns_share_no_plan_and_the_shared_ones_stay_bounded() -> None:
    """Row plans are shared by the nodes whose columns are the same; a fleet (or one sender) with
    ever new NIC names cannot grow the shared plans past their bound."""
    fleet = Fleet()
    fleet.registry.track_nic_counters("symbol_error", "rx_bytes_total")
    for k in range(300):
        nics = [
            Nic(device=f"odd{k}_{i}", link_layer="InfiniBand", port=1, rx_bytes_total=k)
            for i in range(k % 7 + 1)
        ]
        fleet.add(report(10.0, node=f"gpu-{k:04d}", nics=nics))
        fleet.add(report(20.0, node=f"gpu-{k:04d}", nics=nics))
    a, b = fleet.history("gpu-0001"), fleet.history("gpu-0002")
    assert a is not None and b is not None and a._plan is not None and a._plan is not b._plan
    assert sum(p.width for p in _PLANS.values()) <= _MAX_PLAN_COLUMNS
