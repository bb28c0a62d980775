"""The trend detector: each GPU and NIC port against its own recent past."""

from __future__ import annotations

import numpy as np
import pytest

from aggregator.detect.nanstats import nanmedian
from aggregator.detect.trend import TrendConfig, TrendDetector
from aggregator.fleet.frame import GPU_COLUMN, GPU_FIELDS, NIC_COLUMN, NIC_FIELDS, PoolFrame
from aggregator.model import Finding

# Every run here is also a compute the service runs in its worker thread (conftest: why).
pytestmark = pytest.mark.usefixtures("warning_state_untouched")

INTERVAL = 10.0
GPUS = 8
PORTS = [("mlx5_0", 1), ("mlx5_1", 1), ("mlx5_2", 1), ("mlx5_3", 1)]


class SmallPool:
    """Three nodes (too few for peers), each with 8 loaded GPUs and 4 InfiniBand ports."""

    def __init__(self, seed: int, nodes: int = 3) -> None:
        self.rng = np.random.default_rng(seed)
        self.frame = PoolFrame("small", interval_s=INTERVAL, slots=60, gpus=GPUS)
        self.names = [f"n{i}" for i in range(nodes)]
        for name in self.names:
            self.frame.assign_nics(name, list(PORTS), 16)
        self.temp_offset = self.rng.normal(0, 3.0, (nodes, GPUS))
        self.t = 0.0

    def step(
        self,
        *,
        symbol: dict[tuple[int, int], float] | None = None,
        heat: dict[tuple[int, int], float] | None = None,
        power: dict[tuple[int, int], float] | None = None,
        ambient: float = 0.0,
        idle: frozenset[tuple[int, int]] = frozenset(),
        errors: dict[tuple[str, int, int], float] | None = None,
        lost: frozenset[int] = frozenset(),
    ) -> None:
        """One report per node; ``errors`` adds a rate per second to (column, node, GPU)."""
        rng = self.rng
        for i, name in enumerate(self.names):
            gpu = np.full((GPUS, len(GPU_FIELDS)), np.nan, np.float32)
            gpu[:, GPU_COLUMN["utilization_ratio"]] = rng.uniform(0.85, 1.0, GPUS)
            for g in range(GPUS):
                if (i, g) in idle:
                    gpu[g, GPU_COLUMN["utilization_ratio"]] = 0.0
            temp = 65 + ambient + self.temp_offset[i] + rng.normal(0, 1.0, GPUS)
            watts = 600 + rng.normal(0, 40.0, GPUS)
            for g in range(GPUS):
                temp[g] += (heat or {}).get((i, g), 0.0)
                watts[g] *= (power or {}).get((i, g), 1.0)
            gpu[:, GPU_COLUMN["temperature_celsius"]] = np.round(temp)
            gpu[:, GPU_COLUMN["memory_temperature_celsius"]] = np.round(temp + 5)
            gpu[:, GPU_COLUMN["power_watts"]] = watts
            # A healthy GPU or port sees an odd error now and then: one count in a 10-s interval.
            for col in (
                "pcie_replay_per_second",
                "nvlink_crc_per_second",
                "nvlink_replay_per_second",
                "ecc_sbe_per_second",
            ):
                gpu[:, GPU_COLUMN[col]] = (rng.random(GPUS) < 0.01) / INTERVAL
            for (col, node, g), rate in (errors or {}).items():
                if node == i:
                    gpu[g, GPU_COLUMN[col]] += rate
            nic = np.full((len(PORTS), len(NIC_FIELDS)), np.nan, np.float32)
            for col in (
                "symbol_error_per_second",
                "port_rcv_errors_per_second",
                "link_error_recovery_per_second",
            ):
                nic[:, NIC_COLUMN[col]] = (rng.random(len(PORTS)) < 0.01) / INTERVAL
            for p in range(len(PORTS)):
                nic[p, NIC_COLUMN["symbol_error_per_second"]] += (symbol or {}).get((i, p), 0.0)
            at = self.t + rng.uniform(0, INTERVAL - 0.01)
            if i not in lost:  # a lost report: the node's slot stays empty
                self.frame.write(name, at, gpu, list(PORTS), nic)
        self.t += INTERVAL


def findings(out: dict[str, list[Finding]]) -> list[tuple[str, Finding]]:
    return [(node, f) for node, fs in out.items() for f in fs]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_healthy_small_pool_with_stray_errors_and_a_warming_room_stays_quiet(seed: int) -> None:
    pool = SmallPool(seed)
    detector = TrendDetector()
    seen = []
    for k in range(180):  # 30 min; the room warms 12 C over it
        pool.step(ambient=k * 12 / 180)
        if k % 3 == 2:
            seen += findings(detector.run_pool(pool.frame, pool.t))
    assert seen == []


@pytest.mark.parametrize("rate", [0.5, 5.0])
def test_symbol_error_burst_on_one_port_is_an_alert_at_once(rate: float) -> None:
    pool = SmallPool(7)
    detector = TrendDetector()
    for _ in range(50):
        pool.step()
    assert findings(detector.run_pool(pool.frame, pool.t)) == []
    for _ in range(3):
        pool.step(symbol={(1, 2): rate})
    hits = findings(detector.run_pool(pool.frame, pool.t))
    assert [(node, f.key, f.action) for node, f in hits] == [("n1", "trend-symbol-error:mlx5_2:1", "alert")]
    f = hits[0][1]
    assert f.detector == "trend" and not f.hard
    assert f.evidence["rate_per_second"] >= rate and f.evidence["baseline_per_second"] == 0.0
    assert f.summary.startswith("mlx5_2:1 symbol errors ")


def test_persistent_heavy_burst_is_quarantine_evidence_and_a_single_blip_is_nothing() -> None:
    pool = SmallPool(8)
    detector = TrendDetector()
    for _ in range(40):
        pool.step()
    pool.step(symbol={(0, 0): 50.0})  # one bad interval: a cable bumped, not a failing link
    for _ in range(2):
        pool.step()
    assert findings(detector.run_pool(pool.frame, pool.t)) == []
    for _ in range(18):
        pool.step(symbol={(0, 0): 5.0})
    hits = findings(detector.run_pool(pool.frame, pool.t))
    assert [(node, f.key, f.action, f.severity) for node, f in hits] == [
        ("n0", "trend-symbol-error:mlx5_0:1", "quarantine", "critical")
    ]
    # Stopped: the burst window is clean again, nothing is reported.
    for _ in range(3):
        pool.step()
    assert findings(detector.run_pool(pool.frame, pool.t)) == []


def test_gpu_temperature_drifting_up_at_the_same_power_is_an_alert() -> None:
    pool = SmallPool(9)
    detector = TrendDetector()
    for _ in range(40):
        pool.step(ambient=0.0)
    for _ in range(12):  # the room warms 3 C for everyone; GPU 6 of n2 warms 15 C on top
        pool.step(ambient=3.0, heat={(2, 6): 15.0})
    hits = findings(detector.run_pool(pool.frame, pool.t))
    keys = {(node, f.key, f.action) for node, f in hits}
    assert keys == {
        ("n2", "trend-temperature:gpu6", "alert"),
        ("n2", "trend-memory-temperature:gpu6", "alert"),
    }
    f = next(f for _, f in hits if f.key == "trend-temperature:gpu6")
    assert f.evidence["excess_celsius"] == pytest.approx(15.0, abs=2.5)
    assert f.evidence["pool_change_celsius"] == pytest.approx(3.0, abs=1.0)


def test_hotter_because_it_works_harder_is_not_drift() -> None:
    pool = SmallPool(10)
    detector = TrendDetector()
    for _ in range(40):
        pool.step()
    for _ in range(12):
        pool.step(heat={(0, 3): 15.0}, power={(0, 3): 1.3})
    assert findings(detector.run_pool(pool.frame, pool.t)) == []


def test_not_enough_past_means_no_judgement() -> None:
    pool = SmallPool(11)
    detector = TrendDetector()
    for _ in range(20):  # 200 s: less than a baseline plus the persistence window
        pool.step(symbol={(0, 0): 5.0}, heat={(1, 1): 20.0})
    out = detector.run_pool(pool.frame, pool.t)
    assert out == {"n0": [], "n1": [], "n2": []}


def test_nanmedian_matches_numpy_and_gives_nan_for_empty_lanes() -> None:
    rng = np.random.default_rng(0)
    a = rng.normal(size=(7, 9, 5))
    a[rng.random(a.shape) < 0.4] = np.nan
    a[2, :, 1] = np.nan
    with np.errstate(all="ignore"), pytest.warns(RuntimeWarning):
        expected = [np.nanmedian(a, axis=ax) for ax in (0, 1, 2)]
    for ax in (0, 1, 2):
        np.testing.assert_allclose(nanmedian(a, ax), expected[ax], equal_nan=True)
    assert np.isnan(nanmedian(a, 1)[2, 1])


def test_a_gpu_heating_up_after_its_job_started_is_not_drift() -> None:
    # GPU 2 of n1 idles at 35 C, then starts a job: its temperature climbs towards its loaded
    # level with the heat sink's time constant (90 s), at constant power. The minutes right after
    # the start are cooler than the minutes after them; that is settling, not worse cooling.
    pool = SmallPool(12)
    detector = TrendDetector()
    for _ in range(30):
        pool.step(idle=frozenset({(1, 2)}), heat={(1, 2): -30.0}, power={(1, 2): 0.15})
    for k in range(22):
        pool.step(heat={(1, 2): -30.0 * float(np.exp(-k * INTERVAL / 90.0))})
    assert findings(detector.run_pool(pool.frame, pool.t)) == []
    # The same trace judged without waiting for settling calls it a drift: the check matters.
    eager = TrendDetector(TrendConfig(settle_seconds=0.0))
    assert {f.key for _, f in findings(eager.run_pool(pool.frame, pool.t))} >= {"trend-temperature:gpu2"}


REPLAY, CRC = "nvlink_replay_per_second", "nvlink_crc_per_second"


def test_a_lasting_nvlink_replay_stream_quarantines_where_a_crc_trickle_only_alerts() -> None:
    # DCGM fails a GPU on any NVLink replay; we wait for a stream (nearly every report for 3
    # minutes) but not for a large one: two replays a report is a link resending flits all along.
    pool = SmallPool(11)
    detector = TrendDetector()
    rng = np.random.default_rng(5)
    for _ in range(30):
        pool.step()
    for _ in range(19):
        pool.step(errors={(REPLAY, 1, 3): 0.2, (CRC, 2, 6): rng.poisson(5) / INTERVAL})
    hits = {(node, f.key): f for node, f in findings(detector.run_pool(pool.frame, pool.t))}
    replay = hits.pop(("n1", "trend-nvlink-replay:gpu3"))
    assert replay.action == "quarantine" and replay.severity == "critical"
    assert "NVLink replays 0.20/s" in replay.summary and "above it for 180 s" in replay.summary
    # CRC errors alone at 0.5/s: the link corrects them, and DCGM's CRC limit is 100/s.
    crc = hits.pop(("n2", "trend-nvlink-crc:gpu6"))
    assert crc.action == "alert"
    assert hits == {}


@pytest.mark.parametrize("col", [CRC, "ecc_sbe_per_second"])
def test_lasting_crc_or_corrected_ecc_streams_alert_but_never_quarantine(col: str) -> None:
    # Three a second for ten minutes, 30x the floor: a trend quarantine for any other counter.
    # NVLink CRC errors are retried (NVIDIA fails a link at 100/s, which rules/nvlink.yaml
    # applies) and corrected ECC errors were corrected (the GPU remaps their rows; rules/gpu.yaml
    # quarantines a failed remap): on-call hears of it, the node stays in.
    pool = SmallPool(12)
    detector = TrendDetector()
    for _ in range(30):
        pool.step()
    actions = set()
    for k in range(60):
        pool.step(errors={(col, 0, 5): 3.0})
        if k % 3 == 2:
            for node, f in findings(detector.run_pool(pool.frame, pool.t)):
                assert (node, f.key.split(":")[1]) == ("n0", "gpu5")
                actions.add((f.action, f.severity))
    assert actions == {("alert", "warning")}


@pytest.mark.parametrize("per_report", [1, 2])
def test_replays_that_come_and_go_or_stay_at_one_a_report_are_never_a_quarantine(per_report: int) -> None:
    # Two reports of three with replays (an alert at times), for ten minutes: not the nine tenths
    # a quarantine wants. And one replay in every report is not above the one-a-report line.
    pool = SmallPool(12)
    detector = TrendDetector()
    seen: set[str] = set()
    for k in range(90):
        on = k >= 30
        rate = (0.3 if k % 3 != 2 else 0.0) if per_report == 2 else 0.1
        rate = rate if on else 0.0
        pool.step(errors={(REPLAY, 0, 0): rate})
        if k >= 30 and k % 3 == 2:
            seen |= {f.action for node, f in findings(detector.run_pool(pool.frame, pool.t)) if node == "n0"}
    assert "quarantine" not in seen
    assert ("alert" in seen) == (per_report == 2)


def test_lost_reports_neither_hide_a_persistent_burst_nor_make_one() -> None:
    # One report in six lost for the whole window (the rate after a gap spans both intervals, as
    # the frame computes it): the burst is as persistent as before and still quarantines.
    pool = SmallPool(13)
    detector = TrendDetector()
    for _ in range(40):
        pool.step()
    for k in range(18):
        pool.step(symbol={(0, 0): 5.0}, lost=frozenset({0}) if k % 6 == 3 else frozenset())
    hits = [(node, f.key, f.action) for node, f in findings(detector.run_pool(pool.frame, pool.t))]
    assert hits == [("n0", "trend-symbol-error:mlx5_0:1", "quarantine")]
    # Most of the window lost: too little seen to call it lasting, an alert at most.
    pool = SmallPool(14)
    for _ in range(40):
        pool.step()
    for k in range(18):
        pool.step(symbol={(0, 0): 5.0}, lost=frozenset({0}) if k % 2 == 0 and k < 16 else frozenset())
    assert all(f.action == "alert" for _, f in findings(detector.run_pool(pool.frame, pool.t)))


def test_a_link_that_replays_from_the_first_report_is_judged_against_its_pool() -> None:
    """No clean history needed: a GPU replaying NVLink flits since before the aggregator first saw
    it has its stream as its own past; the pool's other GPUs say what a healthy link runs at."""
    pool = SmallPool(13)
    detector = TrendDetector()
    seen: dict[tuple[str, str], Finding] = {}
    for k in range(60):
        pool.step(errors={(REPLAY, 1, 3): 0.2})
        if k % 3 == 2:
            seen |= {(node, f.key): f for node, f in findings(detector.run_pool(pool.frame, pool.t))}
    replay = seen.pop(("n1", "trend-nvlink-replay:gpu3"))
    assert replay.action == "quarantine"
    assert replay.evidence["baseline_from"] == "pool" and "its pool's devices 0.00/s" in replay.summary
    assert seen == {}


def test_a_port_with_steady_symbol_errors_from_the_first_report_keeps_its_own_past() -> None:
    """A port that runs at a steady rate within its bit error budget is healthy whatever its
    neighbours run at: levels of NIC counters are the sequential budget rule's, not this one's."""
    pool = SmallPool(14)
    detector = TrendDetector()
    seen = []
    for k in range(60):
        pool.step(symbol={(0, 1): 0.3})  # 0.3/s: under an NDR port's 0.4/s budget
        if k % 3 == 2:
            seen += findings(detector.run_pool(pool.frame, pool.t))
    assert seen == []
