"""The forest detector: a GPU whose features together are unlike its pool's, explained by its z-scores."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import pytest

from aggregator.config import FleetConfig
from aggregator.detect.forest import (
    ForestConfig,
    ForestDetector,
    distance_gate,
    pool_vectors,
    robust_distance,
    window_slots,
)
from aggregator.fleet.frame import GPU_COLUMN, GPU_FIELDS, FleetFrames, PoolFrame
from aggregator.model import Finding

# Every run here is also a compute the service runs in its worker thread (conftest: why).
pytestmark = pytest.mark.usefixtures("warning_state_untouched")

INTERVAL = 10.0
SLOTS = 60
GPUS = 8
MAX_HZ = 1_980e6
STEP_HZ = 15e6  # NVML clock granularity
LIMIT_W = 700.0
C = GPU_COLUMN
NOW = 600.0  # runs look at the complete slots of [300, 590)


@dataclass
class Odd:
    """A GPU a little off in several ways at once, from where a typical GPU of the pool sits."""

    node: int
    gpu: int
    clock: float = 0.0  # ratio of max
    temp: float = 0.0  # C, memory temperature follows
    power: float = 0.0  # W
    slowdown: float = 0.0  # probability of a slowdown bit per loaded slot


@dataclass
class Pool:
    """H100 nodes under realistic noise: persistent per-node and per-GPU offsets (inlet air, chassis
    position, silicon), per-sample noise, step-phase power swings, hotter GPUs leaking more power,
    nodes idle between jobs, NVML clock steps, integer temperatures and stray slowdown bits."""

    nodes: int
    seed: int
    odd: list[Odd] = field(default_factory=list)
    prefix: str = "node"
    late: tuple[int, ...] = ()  # nodes whose job starts at ``late_start``, heating up from cold
    late_start: float = 500.0
    interval: float = INTERVAL

    def frame(self, until: float = NOW) -> PoolFrame:
        rng = np.random.default_rng(self.seed)
        shape = (self.nodes, GPUS)
        position = np.array([0.0, 1.5, 3.0, 4.5, 4.5, 3.0, 1.5, 0.0])
        temp_off = rng.normal(0, 2.0, (self.nodes, 1)) + position + rng.normal(0, 1.5, shape)
        mem_off = rng.normal(5.0, 1.5, shape)
        clock_off = rng.normal(0, 0.01, shape)
        power_off = rng.normal(0, 30.0, (self.nodes, 1)) + rng.normal(0, 15.0, shape) + 3.0 * temp_off
        slow_p = np.full(shape, 0.002)
        for o in self.odd:
            # From the typical GPU (middle position, typical node), not on top of this GPU's own
            # random offsets, so that every seed gets the same deviation.
            clock_off[o.node, o.gpu] = o.clock
            temp_off[o.node, o.gpu] = 2.25 + o.temp
            mem_off[o.node, o.gpu] = 5.0
            power_off[o.node, o.gpu] = 3.0 * temp_off[o.node, o.gpu] + o.power
            slow_p[o.node, o.gpu] = o.slowdown
        # A tenth of the nodes sit idle for a while inside the window: fewer loaded slots, no vector.
        idle_from = np.where(rng.random(self.nodes) < 0.1, rng.uniform(300, 560, self.nodes), np.inf)
        frame = PoolFrame("h100", interval_s=self.interval, slots=SLOTS, gpus=GPUS)
        names = [f"{self.prefix}-{i:03d}" for i in range(self.nodes)]
        empty = np.zeros((0, 0), np.float32)
        t = 0.0
        while t < until:
            waiting = np.zeros(self.nodes, bool)
            waiting[list(self.late)] = t < self.late_start
            busy = np.broadcast_to(((t < idle_from) & ~waiting)[:, None], shape)
            phase = rng.normal(0, 40.0)
            clock = np.where(busy, 0.95 + clock_off + rng.normal(0, 0.01, shape), 0.175)
            temp = np.where(busy, 65 + temp_off + rng.normal(0, 1.0, shape), 35.0)
            if self.late and t >= self.late_start:
                # Heat sinks take minutes: a GPU that just started is still far from its load
                # temperature (first-order lag, 90 s time constant).
                heat = 1.0 - np.exp(-(t - self.late_start) / 90.0)
                rows = list(self.late)
                temp[rows] = 35.0 + (temp[rows] - 35.0) * heat
            power = np.where(busy, 600 + phase + power_off + rng.normal(0, 40.0, shape), 70.0)
            block = np.full((self.nodes, GPUS, len(GPU_FIELDS)), np.nan, np.float32)
            block[..., C["utilization_ratio"]] = np.where(busy, rng.uniform(0.85, 1.0, shape), 0.02)
            block[..., C["sm_clock_ratio"]] = (
                np.minimum(np.round(clock * MAX_HZ / STEP_HZ) * STEP_HZ, MAX_HZ) / MAX_HZ
            )
            block[..., C["temperature_celsius"]] = np.round(temp)
            block[..., C["memory_temperature_celsius"]] = np.round(temp + mem_off)
            block[..., C["power_watts"]] = np.minimum(power, LIMIT_W)
            block[..., C["power_limit_watts"]] = LIMIT_W
            block[..., C["pcie_link_width_ratio"]] = 1.0
            block[..., C["hw_slowdown"]] = 0.0
            block[..., C["power_brake"]] = 0.0
            thermal = (rng.random(shape) < slow_p) & busy
            block[..., C["hw_thermal"]] = thermal
            block[..., C["sw_thermal"]] = thermal
            block[..., C["pcie_replay_per_second"]] = np.where(rng.random(shape) < 0.002, 0.1, 0.0)
            for i, name in enumerate(names):
                frame.write(name, t + float(rng.uniform(0, self.interval - 0.01)), block[i], [], empty)
            t += self.interval
        return frame


def findings(out: dict[str, list[Finding]]) -> list[tuple[str, Finding]]:
    return [(node, f) for node, fs in out.items() for f in fs]


# A GPU 2.6 % slower than a typical one, 8 C hotter, 110 W short and throttled one slot in 8:
# each of these alone stays within ~3 MADs of a pool with this much healthy spread.
MILD = Odd(node=11, gpu=3, clock=-0.026, temp=8.0, power=-110.0, slowdown=0.13)


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_healthy_noisy_pool_stays_quiet(seed: int) -> None:
    out = ForestDetector().run_pool(Pool(nodes=64, seed=seed).frame(), NOW)
    assert findings(out) == []
    assert len(out) == 64  # every node looked at is answered for, so old findings clear


@pytest.mark.parametrize("seed", [21, 22, 23])
def test_gpu_mildly_off_in_several_features_is_flagged_with_the_right_features(seed: int) -> None:
    frame = Pool(nodes=64, seed=seed, odd=[MILD]).frame()
    z = pool_vectors(frame, NOW, ForestConfig()).z
    out = ForestDetector().run_pool(frame, NOW)
    hits = findings(out)
    assert [(node, f.key) for node, f in hits] == [("node-011", "forest:gpu3")]
    f = hits[0][1]
    mads = f.evidence["all_mads"]
    # No single feature is far off: the peer detector's one-at-a-time view would not call it.
    assert max(abs(m) for m in mads.values()) < 3.5
    assert np.abs(z).max(axis=1).max() > 3.5  # ... while some healthy GPU strays further on one
    top = [d["feature"] for d in f.evidence["features"]]
    assert len(top) == 3
    assert set(top) <= {"sm-clock", "temperature", "memory-temperature", "power", "slowdown"}
    signs = {d["feature"]: d["direction"] for d in f.evidence["features"]}
    expected = {
        "sm-clock": "low",
        "temperature": "high",
        "memory-temperature": "high",
        "power": "low",
        "slowdown": "high",
    }
    assert all(signs[k] == expected[k] for k in top)
    assert [abs(d["mads"]) for d in f.evidence["features"]] == sorted(
        (abs(d["mads"]) for d in f.evidence["features"]), reverse=True
    )
    assert f.summary.startswith("GPU 3 unlike the ")
    assert "isolation score" in f.summary and "MADs, pool" in f.summary


@pytest.mark.parametrize("seed", [21, 22, 23])
def test_a_pool_reporting_every_minute_is_modelled(seed: int) -> None:
    # At a 60 s interval the default 300 s window is 5 slots, fewer than the 6 loaded ones a GPU
    # needs for a vector: the window is never narrower than that (window_slots), or a fleet
    # reporting every minute would never be modelled at all.
    config = ForestConfig()
    assert window_slots(config, 60.0) == config.min_loaded_slots == 6
    assert window_slots(config, INTERVAL) == 30
    now = 1800.0
    healthy = Pool(nodes=64, seed=seed, interval=60.0).frame(until=now)
    assert len(pool_vectors(healthy, now, config).rows) > 0.8 * 64 * GPUS
    assert findings(ForestDetector().run_pool(healthy, now)) == []
    # Six slots say less than thirty: a GPU twice as far off as MILD, in the same features.
    odd = Odd(node=11, gpu=3, clock=-0.05, temp=16.0, power=-220.0, slowdown=0.26)
    frame = Pool(nodes=64, seed=seed, odd=[odd], interval=60.0).frame(until=now)
    out = ForestDetector().run_pool(frame, now)
    assert [(node, f.key) for node, f in findings(out)] == [("node-011", "forest:gpu3")]


def test_findings_are_alerts_from_forest_with_evidence() -> None:
    out = ForestDetector().run_pool(Pool(nodes=64, seed=21, odd=[MILD]).frame(), NOW)
    ((node, f),) = findings(out)
    assert node == "node-011"
    assert f.detector == "forest" and f.action == "alert" and not f.hard
    assert f.severity == "warning"
    ev = f.evidence
    assert ev["gpu"] == 3 and ev["pool"] == "h100" and ev["peer_nodes"] >= 50
    assert ev["score"] >= ev["threshold"]
    assert ev["distance"] >= ev["distance_line"] >= ForestConfig().min_distance
    for d in ev["features"]:
        assert set(d) == {"feature", "value", "pool_median", "mads", "direction"}
    assert f.since == pytest.approx(300.0)


@pytest.mark.parametrize(("nodes", "seed"), [(256, 1), (256, 2), (1000, 1)])
def test_large_healthy_pool_stays_quiet_because_the_distance_line_grows(nodes: int, seed: int) -> None:
    # A fixed distance line of 5 that is quiet at 500 GPUs is crossed by healthy GPUs at 8,000
    # (the largest of n healthy distances grows with n): the line must grow with the pool.
    frame = Pool(nodes=nodes, seed=seed).frame()
    out = ForestDetector().run_pool(frame, NOW)
    assert findings(out) == []
    assert len(out) == nodes
    distance = robust_distance(pool_vectors(frame, NOW, ForestConfig()).z)
    line = distance_gate(distance, ForestConfig().healthy_exceedances, ForestConfig().min_distance)
    assert distance.max() < line  # quiet on distance alone, not only thanks to the score gate
    if nodes == 1000:
        assert distance.max() > ForestConfig().min_distance  # the old fixed line would not hold


def test_distance_line_is_calibrated_on_chi_distances() -> None:
    # Healthy distances are roughly scaled chi with some degrees of freedom: whatever the scale
    # and degrees, about `exceedances` GPUs per pool end up past the line, at any pool size.
    rng = np.random.default_rng(3)
    for features, scale in ((4, 1.0), (6, 0.7), (10, 1.6)):
        for n, pools in ((500, 400), (8000, 50)):
            past = 0
            for _ in range(pools):
                d = scale * np.sqrt((rng.normal(size=(n, features)) ** 2).sum(axis=1))
                past += int((d >= distance_gate(d, 0.5, 0.0)).sum())
            # Expected 0.5 per pool: 200 or 25 in all. Poisson spread, and Wilson-Hilferty's small
            # bias in the far tail, stay well inside a factor of 2.
            assert 0.25 * pools <= past <= 1.0 * pools, (features, n, past)
    # A handful of outliers do not drag the line up with them.
    d = np.sqrt((rng.normal(size=(500, 6)) ** 2).sum(axis=1))
    line = distance_gate(d, 0.05, 0.0)
    d[:5] = 50.0
    assert distance_gate(d, 0.05, 0.0) == pytest.approx(line, rel=0.03)
    assert distance_gate(d[:1], 0.05, 4.0) == 4.0  # one GPU has no pool to be compared with


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_gpus_still_heating_up_after_a_job_start_are_not_outliers(seed: int) -> None:
    # Three nodes start a job 90 s before the window ends: 9 busy slots, far colder than settled
    # peers. They are not loaded yet by the detector's measure (busy for settle_seconds first).
    late = (4, 17, 30)
    frame = Pool(64, seed, late=late).frame()
    assert findings(ForestDetector().run_pool(frame, NOW)) == []
    # Counting their busy slots at once, as before, calls some of them outliers.
    unsettled = ForestDetector(ForestConfig(settle_seconds=0.0)).run_pool(frame, NOW)
    flagged = {node for node, _ in findings(unsettled)}
    assert flagged and flagged <= {f"node-{i:03d}" for i in late}


def test_same_input_gives_the_same_output() -> None:
    frame = Pool(nodes=48, seed=7, odd=[MILD]).frame()
    a = ForestDetector().run_pool(frame, NOW)
    b = ForestDetector().run_pool(frame, NOW)
    assert a == b
    assert findings(a)
    # A rebuilt identical frame, too: nothing depends on state or on an unseeded generator.
    c = ForestDetector().run_pool(Pool(nodes=48, seed=7, odd=[MILD]).frame(), NOW)
    assert c == a


def test_too_small_a_pool_says_nothing_but_answers_for_its_nodes() -> None:
    # 3 nodes x 8 GPUs is 24 GPUs but fewer than 4 nodes; a GPU far off would still not be modelled.
    strong = Odd(node=1, gpu=2, clock=-0.1, temp=15.0, power=-150.0, slowdown=0.5)
    out = ForestDetector().run_pool(Pool(nodes=3, seed=1, odd=[strong]).frame(), NOW)
    assert out == {"node-000": [], "node-001": [], "node-002": []}
    # Enough nodes but too few loaded GPUs: a pool of 4 nodes, GPUs counted need >= 32 here.
    cfg = ForestConfig(min_gpus=33)
    out = ForestDetector(cfg).run_pool(Pool(nodes=4, seed=1, odd=[strong]).frame(), NOW)
    assert findings(out) == []


def test_a_gpu_far_off_is_found_in_a_pool_just_big_enough() -> None:
    strong = Odd(node=1, gpu=2, clock=-0.1, temp=15.0, power=-150.0, slowdown=0.5)
    pool = Pool(nodes=6, seed=1, odd=[strong])
    frame = pool.frame()
    out = ForestDetector().run_pool(frame, NOW)
    assert [(node, f.key) for node, f in findings(out)] == [("node-001", "forest:gpu2")]


def test_idle_pool_and_unknown_features_say_nothing() -> None:
    frame = PoolFrame("idle", interval_s=INTERVAL, slots=SLOTS, gpus=GPUS)
    block = np.full((GPUS, len(GPU_FIELDS)), np.nan, np.float32)
    block[:, C["utilization_ratio"]] = 0.0
    for t in np.arange(0.0, NOW, INTERVAL):
        for i in range(20):
            frame.write(f"n{i}", float(t), block, [], np.zeros((0, 0), np.float32))
    assert findings(ForestDetector().run_pool(frame, NOW)) == []


def test_run_covers_every_pool_of_the_fleet() -> None:
    frames = FleetFrames(FleetConfig())
    frames._frames["h100"] = Pool(nodes=64, seed=21, odd=[MILD]).frame()
    frames._frames["tiny"] = Pool(nodes=2, seed=2, prefix="tiny").frame()
    out = ForestDetector().run(frames, NOW).nodes
    assert len(out) == 66
    assert [(node, f.key) for node, fs in out.items() for f in fs] == [("node-011", "forest:gpu3")]


def test_bad_config_is_refused() -> None:
    with pytest.raises(ValueError, match="forest detector"):
        ForestDetector(ForestConfig(min_gpus=1))
    with pytest.raises(ValueError, match="forest detector"):
        ForestDetector(ForestConfig(every_seconds=0))
    with pytest.raises(ValueError, match="forest detector"):
        ForestDetector(ForestConfig(healthy_exceedances=0))


def test_pool_of_8000_gpus_scores_well_under_a_second() -> None:
    # 1,000 nodes x 8 GPUs: a pool of a 7,500-node fleet. Built directly (writing 30 slots of
    # 1,000 nodes through the simulator takes longer than the detector).
    rng = np.random.default_rng(0)
    nodes = 1000
    frame = PoolFrame("big", interval_s=INTERVAL, slots=SLOTS, gpus=GPUS, initial_rows=nodes)
    base = np.full((nodes, GPUS, len(GPU_FIELDS)), np.nan, np.float32)
    base[..., C["utilization_ratio"]] = 0.95
    base[..., C["power_limit_watts"]] = LIMIT_W
    base[..., C["pcie_link_width_ratio"]] = 1.0
    for col in ("hw_slowdown", "hw_thermal", "power_brake", "sw_thermal"):
        base[..., C[col]] = 0.0
    clock = 0.95 + rng.normal(0, 0.01, (nodes, GPUS))
    temp = 65 + rng.normal(0, 3, (nodes, GPUS))
    empty = np.zeros((0, 0), np.float32)
    for t in np.arange(0.0, NOW, INTERVAL):
        block = base.copy()
        block[..., C["sm_clock_ratio"]] = clock + rng.normal(0, 0.01, clock.shape)
        block[..., C["temperature_celsius"]] = np.round(temp + rng.normal(0, 1, temp.shape))
        block[..., C["memory_temperature_celsius"]] = np.round(temp + 5 + rng.normal(0, 1, temp.shape))
        block[..., C["power_watts"]] = 600 + rng.normal(0, 40, temp.shape)
        for i in range(nodes):
            frame.write(f"n{i:04d}", float(t), block[i], [], empty)
    detector = ForestDetector()
    detector.run_pool(frame, NOW)  # warm imports and caches
    start = time.process_time()
    out = detector.run_pool(frame, NOW)
    elapsed = time.process_time() - start
    assert len(out) == nodes
    assert elapsed < 1.0, f"{elapsed:.2f} s of CPU for one 8,000-GPU pool"


def test_a_split_run_judges_the_window_as_it_was_when_prepared() -> None:
    # The service computes the forest in a worker thread while the loop goes on writing the frame
    # and forgetting nodes (rows move: swap-remove). What the compute sees must be the copy.
    frame = Pool(nodes=64, seed=21, odd=[MILD]).frame()
    whole = ForestDetector().run_pool(Pool(nodes=64, seed=21, odd=[MILD]).frame(), NOW)
    work = ForestDetector().prepare_pool(frame, NOW)
    frame.release("node-000")  # node-063's row moves into row 0
    frame.release("node-011")  # the odd node is gone from the live frame
    nan = np.full((GPUS, len(GPU_FIELDS)), np.nan, np.float32)
    for t in np.arange(NOW - 300, NOW, INTERVAL):
        frame.write("node-063", float(t), nan, [], np.zeros((0, 0), np.float32))
    split = work.finish(work.compute())
    assert [(n, f.key) for n, f in findings(split)] == [("node-011", "forest:gpu3")]
    assert split == whole


@pytest.mark.parametrize("behind", [30.0, 120.0, 240.0])
def test_a_pool_judged_behind_a_backlog_is_judged_as_when_its_data_were_new(behind: float) -> None:
    # Behind a backlog the newest slot written is minutes old when the forest runs (reports are
    # slotted when they were measured: aggregator/fleet/sendtime.py), it is the one still filling,
    # and the slots after it hold nothing yet. The run must score what an on-time run scored as
    # that slot filled: a window that ended at the clock would be partly empty slots, leave every
    # GPU fewer loaded ones, and score other vectors.
    frame = Pool(nodes=64, seed=21, odd=[MILD]).frame()
    filling = NOW - INTERVAL  # the frame's newest slot, [590, 600), as it filled
    on_time = ForestDetector().run_pool(frame, filling)
    assert [(node, f.key) for node, f in findings(on_time)] == [("node-011", "forest:gpu3")]
    assert ForestDetector().run_pool(frame, NOW + behind) == on_time
    z = pool_vectors(frame, NOW + behind, ForestConfig()).z
    assert np.array_equal(z, pool_vectors(frame, filling, ForestConfig()).z)
