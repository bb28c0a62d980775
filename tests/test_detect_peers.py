"""The peer detector: a GPU against every loaded GPU of its pool, at the same moments."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest

from agent.report import Gpu, Report
from aggregator.config import Config, FleetConfig, HealthConfig
from aggregator.decisions import Reason
from aggregator.detect import DETECTORS, PeerDetector
from aggregator.detect.cusum import cusum
from aggregator.detect.peers import APP_CLOCKS_COLUMN, FEATURES, PeerConfig, complete_slots, thresholds
from aggregator.fleet.frame import GPU_COLUMN, FleetFrames, FloatArray, NicKey
from aggregator.fleet.history import Fleet
from aggregator.fleet.pools import Placement
from aggregator.health import HealthMachine
from aggregator.links import DECIDED
from aggregator.model import Finding
from sim.pool import GPUS, INTERVAL, MAX_HZ, Fault, PoolSim

# Every run here is also a compute the service runs in its worker thread (conftest: why).
pytestmark = pytest.mark.usefixtures("warning_state_untouched")
C = GPU_COLUMN


def _rewrite(sim: PoolSim, change: Callable[[str, float, FloatArray], None]) -> None:
    """Edit what the simulated pool writes: ``change(node, t, block)`` edits each node's GPU block
    ``(gpus, GPU_FIELDS)`` in place before it lands in the frame. For what ``PoolSim`` does not
    model: several pods on one node, racks with their own inlet air, reason bits of its own."""
    write = sim.frame.write

    def edited(node: str, t: float, gpu: FloatArray, nics: Sequence[NicKey], nic: FloatArray) -> bool:
        block = gpu.copy()
        change(node, t, block)
        return write(node, t, block, nics, nic)

    sim.frame.write = edited  # type: ignore[method-assign]


def simulate(
    sim: PoolSim, minutes: float, every: float = 30.0, config: PeerConfig | None = None
) -> list[tuple[float, dict[str, list[Finding]]]]:
    """Write the pool slot by slot and run the detector every ``every`` seconds, as the pipeline does."""
    detector = PeerDetector(config)
    runs = []
    t = 0.0
    next_run = every
    while t < minutes * 60:
        sim.step(t)
        t += INTERVAL
        if t >= next_run:
            runs.append((t, detector.run_pool(sim.frame, t)))
            next_run += every
    return runs


def found(runs: list[tuple[float, dict[str, list[Finding]]]]) -> list[tuple[float, str, Finding]]:
    return [(t, node, f) for t, out in runs for node, fs in out.items() for f in fs]


def quarantines(runs: list[tuple[float, dict[str, list[Finding]]]]) -> list[tuple[float, str, Reason]]:
    """The detector's runs through the health machine at its defaults, as the aggregator feeds it
    (source ``peer``, then the time-driven tick): each quarantine decision's time, node and lead
    reason."""
    health = HealthMachine(HealthConfig())
    out = []
    for t, per_node in runs:
        decisions = [health.update(node, "peer", fs, t) for node, fs in per_node.items()]
        for d in [*decisions, *health.tick(t)]:
            if d is not None and d.state == "quarantined" and d.previous != "quarantined":
                out.append((t, d.node, d.reasons[0]))
    return out


def first(runs: list[tuple[float, dict[str, list[Finding]]]], node: str, key: str) -> tuple[float, Finding]:
    for t, out in runs:
        for f in out.get(node, []):
            if f.key == key:
                return t, f
    raise AssertionError(f"{key} on {node} never found")


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_healthy_noisy_pool_of_64_nodes_stays_quiet_for_30_minutes(seed: int) -> None:
    runs = simulate(PoolSim(nodes=64, seed=seed), minutes=30)
    assert found(runs) == []
    assert quarantines(runs) == []
    # It did look: every node is answered for (with nothing) once the frame has data.
    assert len(runs[-1][1]) == 64


@pytest.mark.parametrize("seed", [11, 12])
@pytest.mark.parametrize("slow", [0.08, 0.12, 0.20])
def test_slow_gpu_is_found_within_minutes_with_its_evidence(seed: int, slow: float) -> None:
    sim = PoolSim(nodes=64, seed=seed, faults=[Fault(node=7, gpu=5, start=300.0, slow=slow)])
    sim.busy_until[7] = 1e9
    runs = simulate(sim, minutes=15)
    hits = found(runs)
    # Only the bad GPU, never a neighbour or another node: against its node-mates and, as these
    # pools run one kind of work, against the pool too.
    assert {(node, f.key) for _, node, f in hits if f.key.startswith("peer-sm-clock")} <= {
        ("node-007", "peer-sm-clock:gpu5"),
        ("node-007", "peer-sm-clock-pool:gpu5"),
    }
    assert all(node == "node-007" for _, node, _ in hits)
    t, f = first(runs, "node-007", "peer-sm-clock:gpu5")
    assert t - 300.0 <= (90.0 if slow >= 0.12 else 180.0)
    assert f.detector == "peer" and not f.hard
    assert f.evidence["gpu"] == 5 and f.evidence["feature"] == "sm-clock"
    assert f.evidence["relative_to"] == "node" and f.evidence["explanation"] is None
    assert f.evidence["pool_median"] == pytest.approx(1.0, abs=0.01)
    mates = np.delete(sim.clock_offset[7], 5)
    healthy = (0.95 + float(sim.clock_offset[7, 5])) / (0.95 + float(np.median(mates)))
    assert f.evidence["value"] == pytest.approx(healthy * (1 - slow), abs=0.015)
    assert f.summary.startswith("GPU 5 SM clock 0.")
    assert "of its node's median under load, pool median 1.00" in f.summary and "MADs low for" in f.summary
    # A clear, persistent deviation becomes quarantine evidence within minutes of its start.
    tq, fq = next((t, f) for t, node, f in hits if f.action == "quarantine")
    assert tq - 300.0 <= (120.0 if slow >= 0.12 else 240.0)
    assert fq.severity == "critical" and fq.evidence["cusum"] >= fq.evidence["threshold"]


def test_deviation_within_the_allowance_never_accumulates() -> None:
    # 3 % slow is two sigmas of this pool's spread: a healthy part could sit there for good.
    sim = PoolSim(nodes=64, seed=5, faults=[Fault(node=3, gpu=2, start=0.0, slow=0.03)])
    assert found(simulate(sim, minutes=12)) == []


@pytest.mark.parametrize("seed", [21, 22])
def test_thermally_throttling_gpu_is_found(seed: int) -> None:
    sim = PoolSim(nodes=64, seed=seed, faults=[Fault(node=40, gpu=1, start=120.0, throttle=True)])
    runs = simulate(sim, minutes=10)
    hits = found(runs)
    assert {node for _, node, _ in hits} == {"node-040"}
    keys = {f.key for _, _, f in hits}
    assert {"peer-temperature:gpu1", "peer-slowdown:gpu1", "peer-sm-clock:gpu1"} <= keys
    t, f = first(runs, "node-040", "peer-temperature:gpu1")
    assert t - 120.0 <= 180.0
    assert f.evidence["value"] >= 85.0 and f.evidence["direction"] == "high"
    assert any(f.action == "quarantine" for _, _, f in hits)


# Air-cooled H100/A100 at load: the die runs ~0.06-0.09 C hotter per watt (thermal resistance);
# light jobs at 65 % of the pool's power, a heavy one at the 700 W limit: 0.07 x 300 W = 21 C hotter
# on every GPU of the heavy node, several MADs over the pool's raw median.
HEAVY_POOL = {i: 0.65 for i in range(64) if i not in (10, 20)}


@pytest.mark.parametrize("seed", [61, 62])
def test_a_heavy_job_runs_its_node_hotter_and_is_work_not_a_fault(seed: int) -> None:
    sim = PoolSim(nodes=64, seed=seed, c_per_w=0.07, job_power=HEAVY_POOL)
    sim.busy_until[[10, 20]] = 1e9  # the heavy job runs all along
    runs = simulate(sim, minutes=15)
    assert found(runs) == []


@pytest.mark.parametrize("seed", [63, 64])
def test_a_gpu_hotter_than_its_pool_at_the_same_power_is_found_and_stays_an_alert(seed: int) -> None:
    # A cooling fault short of throttling: no slowdown bit, clocks and power as its node-mates', 20 C
    # hotter than a GPU at its power runs, on a light node (cooler than the heavy nodes in raw terms).
    # Found, and an alert: no thermal slowdown reason, so the clocks are not held back (yet).
    sim = PoolSim(
        nodes=64,
        seed=seed,
        c_per_w=0.07,
        job_power=HEAVY_POOL,
        faults=[Fault(node=30, gpu=3, start=120.0, hot=20.0)],
    )
    sim.busy_until[[10, 20, 30]] = 1e9
    runs = simulate(sim, minutes=12)
    hits = found(runs)
    assert {node for _, node, _ in hits} == {"node-030"}
    assert {f.key for _, _, f in hits} <= {"peer-temperature:gpu3", "peer-memory-temperature:gpu3"}
    t, f = first(runs, "node-030", "peer-temperature:gpu3")
    assert t - 120.0 <= 240.0
    assert f.evidence["given"] == "power_watts" and f.evidence["slope"] == pytest.approx(0.07, abs=0.02)
    # Read in degrees: the GPU's temperature against what its pool runs at at its power.
    assert f.evidence["value"] - f.evidence["pool_median"] >= 15.0
    assert "under load, its pool at its power" in f.summary
    assert {f.action for _, _, f in hits} == {"alert"}  # 10 minutes: past the escalation too
    assert "no thermal slowdown" in str(hits[-1][2].evidence["explanation"])
    assert quarantines(runs) == []


def test_a_light_job_on_a_few_nodes_is_work_not_a_fault() -> None:
    # Three nodes run a job that draws 55 % of the pool's usual power at full clocks (inference,
    # a small model): against the pool they are many MADs low, against their node-mates nothing.
    sim = PoolSim(nodes=64, seed=41, job_power={3: 0.55, 17: 0.55, 30: 0.6})
    sim.busy_until[[3, 17, 30]] = 1e9  # the light job runs all along
    assert found(simulate(sim, minutes=20)) == []


@pytest.mark.parametrize("seed", [42, 43])
@pytest.mark.parametrize("why", ["clock", "power_brake"])
def test_gpu_held_back_and_drawing_less_than_its_node_mates_is_found_by_power(seed: int, why: str) -> None:
    # Held back at the same work: a clock 6 % under its node-mates' (within the clock's own
    # allowance, so only the power shows it) or NVML's power brake reason; either way 40 % less power.
    slow = 0.06 if why == "clock" else 0.0
    sim = PoolSim(nodes=64, seed=seed, faults=[Fault(node=9, gpu=6, start=120.0, power=0.4, slow=slow)])
    sim.busy_until[9] = 1e9
    if why == "power_brake":

        def brake(node: str, t: float, block: FloatArray) -> None:
            if node == "node-009" and t >= 120.0:
                block[6, C["power_brake"]] = 1.0

        _rewrite(sim, brake)
    runs = simulate(sim, minutes=12)
    keys = {(node, f.key) for _, node, f in found(runs)}
    assert ("node-009", "peer-power:gpu6") in keys and {node for node, _ in keys} == {"node-009"}
    t, f = first(runs, "node-009", "peer-power:gpu6")
    assert t - 120.0 <= 240.0
    assert f.evidence["value"] == pytest.approx(0.6, abs=0.08)
    assert f.summary.startswith("GPU 6 power 0.") and "of its node's median under load" in f.summary
    assert any(f.key == "peer-power:gpu6" and f.action == "quarantine" for _, _, f in found(runs))


@pytest.mark.parametrize("seed", [42, 43])
def test_gpu_drawing_less_than_its_node_mates_at_their_clock_is_work_not_a_fault(seed: int) -> None:
    # 40 % less power at its node-mates' clock with no clock event reason: a lighter pod on a GPU
    # Kubernetes gave it, or a pipeline stage with less to do. Nothing holds it back.
    sim = PoolSim(nodes=64, seed=seed, faults=[Fault(node=9, gpu=6, start=120.0, power=0.4)])
    sim.busy_until[9] = 1e9
    runs = simulate(sim, minutes=12)
    assert not [f for _, _, f in found(runs) if f.key.startswith("peer-power")]
    assert quarantines(runs) == []


@pytest.mark.parametrize("ratio", [0.8, 0.75])  # Gen4 of Gen5, Gen3 of Gen4
def test_pcie_link_a_generation_low_under_load_is_found(ratio: float) -> None:
    # Width intact, so the width rule cannot see it; every healthy GPU drops to Gen1 at idle.
    sim = PoolSim(nodes=64, seed=44, faults=[Fault(node=12, gpu=3, start=60.0, pcie_gen=ratio)])
    sim.busy_until[12] = 1e9
    runs = simulate(sim, minutes=10)
    assert {(node, f.key) for _, node, f in found(runs)} == {("node-012", "peer-pcie-gen:gpu3")}
    t, f = first(runs, "node-012", "peer-pcie-gen:gpu3")
    assert t - 60.0 <= 120.0
    assert f.evidence["value"] == pytest.approx(ratio) and f.evidence["pool_median"] == pytest.approx(1.0)
    assert any(f.action == "quarantine" for _, _, f in found(runs))


def test_whole_pool_warming_together_produces_nothing() -> None:
    # 2 C a minute for 30 minutes: 60 C of drift, far more than any GPU's deviation that is caught.
    runs = simulate(PoolSim(nodes=64, seed=31, ambient_c_per_min=2.0), minutes=30)
    assert found(runs) == []


def test_idle_pool_produces_nothing() -> None:
    runs = simulate(PoolSim(nodes=64, seed=41, idle=True), minutes=15)
    assert found(runs) == []


def test_small_pool_is_skipped_even_with_a_broken_gpu() -> None:
    sim = PoolSim(nodes=3, seed=51, faults=[Fault(node=1, gpu=0, start=0.0, slow=0.3)])
    # 24 loaded GPUs on 3 nodes would be enough peers; the detector needs 3 nodes *and* 8 GPUs, so
    # one node idle leaves two nodes: nothing is said about them.
    sim.idle_until[:] = 0
    sim.busy_until[:] = 1e9
    detector = PeerDetector()
    t = 0.0
    for _ in range(40):
        sim.step(t)
        t += INTERVAL
    # With three loaded nodes it is a pool and the 30 % slow GPU shows.
    assert any(f.key == "peer-sm-clock:gpu0" for f in detector.run_pool(sim.frame, t)["node-001"])
    two = PoolSim(nodes=2, seed=52, faults=[Fault(node=1, gpu=0, start=0.0, slow=0.3)])
    two.busy_until[:] = 1e9
    t = 0.0
    for _ in range(40):
        two.step(t)
        t += INTERVAL
    assert detector.run_pool(two.frame, t) == {"node-000": [], "node-001": []}


def test_finding_clears_once_the_gpu_recovers() -> None:
    sim = PoolSim(nodes=32, seed=61, faults=[Fault(node=2, gpu=3, start=0.0, slow=0.2)])
    detector = PeerDetector()
    t = 0.0
    for _ in range(40):
        sim.step(t)
        t += INTERVAL
    assert detector.run_pool(sim.frame, t)["node-002"]
    sim.faults.clear()
    for _ in range(6):
        sim.step(t)
        t += INTERVAL
    # The statistic has not drained yet, but the GPU has been in line for a minute: nothing to say.
    assert detector.run_pool(sim.frame, t)["node-002"] == []


def test_cusum_accumulates_only_beyond_the_allowance_and_holds_on_missing_slots() -> None:
    z = np.array([[1.0], [5.0], [np.nan], [5.0], [0.0], [0.0], [0.0]])
    r = cusum(z, 2.0)
    # 0, 3, (held) 3, 6, 4, 2, 0
    assert r.statistic.tolist() == [0.0] and r.run_start.tolist() == [-1]
    r = cusum(z[:5], 2.0)
    assert r.statistic.tolist() == [4.0]
    assert r.run_start.tolist() == [1] and r.calm.tolist() == [1] and r.scored.tolist() == [3]


def _report(node: str, t: float, clock: float, seq: int) -> Report:
    gpus = [
        Gpu(
            index=i,
            uuid=f"GPU-{node}-{i}",
            model="NVIDIA H100 80GB HBM3",
            utilization_ratio=0.97,
            sm_clock_hz=int(clock if (node, i) == ("n05", 4) else MAX_HZ * 0.95),
            sm_clock_max_hz=int(MAX_HZ),
            temperature_celsius=65.0 + i % 3,
            memory_temperature_celsius=70.0,
            power_watts=600.0 + 10 * (i % 2),
            power_limit_watts=700.0,
            clock_event_reasons=0,
        )
        for i in range(GPUS)
    ]
    return Report(schema="gpuwarden/report/v1", node=node, time=t, seq=seq, boot_id="b", gpus=gpus, nics=[])


def test_end_to_end_from_reports_through_the_fleet_frames() -> None:
    config = FleetConfig(window_seconds=1800.0, interval_seconds=INTERVAL)
    fleet, frames = Fleet(config), FleetFrames(config, frame_seconds=600.0)
    placement = Placement("h100")
    assert [spec.name for spec in DETECTORS] == ["peer", "trend", "forest", "link", "probe", "jobs", "ports"]
    detector = next(spec for spec in DETECTORS if spec.name == "peer").build(Config().detectors)
    out: dict[str, list[Finding]] = {}
    for k in range(30):
        t = 1_000_000.0 + k * INTERVAL
        for j in range(10):
            view = fleet.add(_report(f"n{j:02d}", t + j * 0.5, MAX_HZ * 0.80, k))
            frames.record(view, placement, at=t + j * 0.5)
        out = dict(detector.run(frames, t + INTERVAL).nodes)
    assert set(out) == {f"n{j:02d}" for j in range(10)}
    assert sorted(f.key for f in out["n05"]) == ["peer-sm-clock-pool:gpu4", "peer-sm-clock:gpu4"]
    assert all(out[n] == [] for n in out if n != "n05")


def _independent_pool(seed: int, faults: list[Fault] | None = None) -> PoolSim:
    """Jobs that differ a lot and turn over every 10 minutes, about 60 % of the nodes busy."""
    return PoolSim(
        nodes=64,
        seed=seed,
        faults=faults or [],
        job_spread=0.03,
        job_s=(600.0, 600.0),
        idle_s=(400.0, 400.0),
    )


@pytest.mark.parametrize("seed", [71, 72])
def test_healthy_pool_with_heavy_tailed_job_differences_never_quarantines(seed: int) -> None:
    # 64 nodes for 2 hours (128 node-hours, 23,000 slots of every test on every loaded GPU): jobs
    # hold their nodes' clocks up to 50 % low, with the SW power cap bit, against the pool.
    sim = _independent_pool(seed)
    runs = simulate(sim, minutes=120)
    assert sim.lowest_job_clock < 0.85  # some jobs did sit far out
    assert [(t, node, f.key) for t, node, f in found(runs) if f.action == "quarantine"] == []
    assert quarantines(runs) == []  # and so no node is quarantined, decided or not


@pytest.mark.parametrize("seed", [73, 74, 75])
@pytest.mark.parametrize(("slow", "within"), [(0.10, 600.0), (0.30, 120.0)])
def test_slow_gpu_from_the_first_report_is_decided_within_minutes_of_load(
    seed: int, slow: float, within: float
) -> None:
    # Bad from the first report, no clean history: its node-mates show it as soon as it works.
    sim = _independent_pool(seed, [Fault(node=5, gpu=3, start=0.0, slow=slow)])
    sim.idle_until[5], sim.busy_until[5] = 60.0, 660.0  # its first job starts a minute in
    runs = simulate(sim, minutes=12)
    hits = found(runs)
    t, f = next((t, f) for t, node, f in hits if node == "node-005" and f.action == "quarantine")
    assert f.key in ("peer-sm-clock:gpu3", "peer-sm-clock-pool:gpu3")
    assert t - 60.0 <= within
    assert not [(node, g.key) for _, node, g in hits if node != "node-005" and g.action == "quarantine"]
    # Through the health machine: the CUSUM's crossing is decided evidence, so the node is
    # quarantined at that run, not 120 s of persistence later (2 minutes after load at 30 %).
    decided = quarantines(runs)
    assert [node for _, node, _ in decided] == ["node-005"]
    tq, _, lead = decided[0]
    assert tq == t and tq - 60.0 <= within
    assert lead.evidence[DECIDED] is True and lead.evidence["escalated"] is False


def test_a_whole_slow_node_is_found_against_the_pool() -> None:
    # All 8 GPUs 15 % slow (a node-level cause): nothing against node-mates, plain against the pool.
    sim = PoolSim(
        nodes=64, seed=81, faults=[Fault(node=20, gpu=g, start=0.0, slow=0.15) for g in range(GPUS)]
    )
    sim.idle_until[20], sim.busy_until[20] = 0.0, 1e9
    hits = found(simulate(sim, minutes=6))
    keys = {f.key for _, node, f in hits if node == "node-020" and f.action == "quarantine"}
    assert {f"peer-sm-clock-pool:gpu{g}" for g in range(GPUS)} <= keys
    assert not any(f.key.startswith("peer-sm-clock:") for _, _, f in hits)
    assert all(node == "node-020" for _, node, _ in hits)


def _escalating_config() -> PeerConfig:
    # The quarantine threshold out of reach within a frame: only escalation can quarantine.
    return PeerConfig(min_quarantine_slots=1000)


def test_alert_that_keeps_accumulating_escalates_to_quarantine() -> None:
    sim = PoolSim(nodes=64, seed=91, faults=[Fault(node=8, gpu=6, start=0.0, slow=0.10)])
    sim.idle_until[8], sim.busy_until[8] = 0.0, 1e9
    config = _escalating_config()
    runs = simulate(sim, minutes=9, config=config)
    mine = [(t, f) for t, node, f in found(runs) if node == "node-008" and f.key == "peer-sm-clock:gpu6"]
    alert_t = min(t for t, f in mine if f.action == "alert")
    quarantine_t, fq = min(((t, f) for t, f in mine if f.action == "quarantine"), key=lambda p: p[0])
    assert quarantine_t - alert_t >= config.escalate_after_seconds - 60.0
    assert fq.evidence["escalated"] is True and fq.evidence["explanation"] is None
    assert "unexplained for over 5 min" in fq.summary


def test_alert_explained_by_the_power_limit_stays_an_alert_and_says_why() -> None:
    # Held at its power limit while its node-mates are not: lower clocks by design, named.
    sim = PoolSim(nodes=64, seed=92, faults=[Fault(node=8, gpu=6, start=0.0, slow=0.10, capped=True)])
    sim.idle_until[8], sim.busy_until[8] = 0.0, 1e9
    runs = simulate(sim, minutes=9, config=_escalating_config())
    mine = [f for _, node, f in found(runs) if node == "node-008" and f.key == "peer-sm-clock:gpu6"]
    assert mine and {f.action for f in mine} == {"alert"}
    assert "SW power cap" in str(mine[-1].evidence["explanation"]) and "explained:" in mine[-1].summary
    # The default thresholds do not quarantine it either: the power limit explains it.
    default = simulate(PoolSim(nodes=64, seed=92, faults=sim.faults), minutes=6)
    assert not [f for _, node, f in found(default) if node == "node-008" and f.action == "quarantine"]


def test_thresholds_follow_from_the_arl_targets_and_the_slot_bound() -> None:
    config = PeerConfig()
    for feature in FEATURES:
        th = thresholds(feature, config)
        # At least the stated in-control run lengths, and at least min slots of the largest excess.
        assert th.arl0_alert >= config.arl0_alert_slots * 0.999
        assert th.arl0_quarantine >= config.arl0_quarantine_slots * 0.999
        assert th.h_quarantine >= config.min_quarantine_slots * config.max_excess
        assert th.h_alert <= th.h_quarantine


def test_one_heavy_job_among_light_ones_is_judged_on_its_own_capped_spread() -> None:
    """At the power limit each GPU's clock is what its own efficiency allows, so one node's
    capped GPUs spread by a few percent; with no other capped node in the pool to say so, the
    node's own capped GPUs give the scale, not the uncapped pool's tight one. Its least efficient
    GPU, 6 % under its node-mates, is no fault."""
    sim = PoolSim(nodes=40, seed=81)
    sim.busy_until[:] = 1e9  # every node keeps its job: the light ones and the one heavy one
    sim.job_clock[5] = 0.93
    sim.cap_offset[5] = np.array([0.03, -0.02, 0.01, 0.025, -0.01, 0.0, 0.02, -0.06])
    runs = simulate(sim, minutes=30)
    assert [(t, f.key) for t, node, f in found(runs) if node == "node-005" and f.action == "quarantine"] == []


def test_a_run_prepared_before_the_frame_moves_on_judges_what_was_prepared() -> None:
    """The service runs the judgement in a worker thread while reports keep landing and silent
    nodes are forgotten (rows move): the findings are those of the frame as it was prepared."""

    def sim() -> PoolSim:
        return PoolSim(nodes=16, seed=71, faults=[Fault(node=2, gpu=3, start=0.0, slow=0.2)])

    live, still = sim(), sim()
    t = 0.0
    for _ in range(40):
        live.step(t)
        still.step(t)
        t += INTERVAL
    detector = PeerDetector()
    work = detector.prepare_pool(live.frame, t)
    # Meanwhile: the faulty GPU recovers for a minute of new slots and node-000 is forgotten
    # (the last row, node-015, moves into its place).
    live.faults.clear()
    for k in range(6):
        live.step(t + k * INTERVAL)
    assert live.frame.release("node-000")
    found = work.finish(work.compute())
    expected = detector.run_pool(still.frame, t)
    assert found == expected
    assert any(f.key == "peer-sm-clock:gpu3" for f in found["node-002"])


@pytest.mark.parametrize("seed", [11, 12])
def test_slots_never_written_change_no_judgement(seed: int) -> None:
    """A run skips the complete slots before the pool's first written one (all NaN: a pool's first
    frame-length): at every run the findings, evidence and all, are those of the whole range."""
    sim = PoolSim(nodes=32, seed=seed, faults=[Fault(node=7, gpu=5, start=120.0, slow=0.12)])
    sim.busy_until[7] = 1e9
    detector = PeerDetector()
    t, trimmed_runs, findings = 0.0, 0, 0
    while t < 720.0:
        sim.step(t)
        t += INTERVAL
        if t % 30.0:
            continue
        t0, t1 = complete_slots(sim.frame, t)
        start = sim.frame.written_since(t0)
        whole = detector.judge(sim.frame.window(t0, t1), t)
        assert detector.judge(sim.frame.window(start, t1), t) == whole
        assert detector.run_pool(sim.frame, t) == whole
        trimmed_runs += start > t0
        findings += sum(len(fs) for fs in whole.values())
    assert trimmed_runs >= 18  # the first 600 s of runs skipped slots ...
    assert findings > 0  # ... and the slow GPU's findings were among those compared


@pytest.mark.parametrize("stop", [150.0, 270.0, 300.0, 450.0])
def test_a_pool_judged_behind_a_backlog_is_judged_as_when_its_data_were_new(stop: float) -> None:
    # Behind a backlog the newest slots are minutes old when the detector runs (reports are
    # slotted when they were measured: aggregator/fleet/sendtime.py). The run must judge what an
    # on-time run judged of the same slots: the newest slot written is still filling, so it is
    # left out, the frame's older slots stay in, and a run's "how long" is read against the data,
    # or a slow GPU's alert would escalate to quarantine on minutes no slot showed.
    sim = PoolSim(nodes=64, seed=91, faults=[Fault(node=8, gpu=6, start=0.0, slow=0.10)])
    sim.idle_until[8], sim.busy_until[8] = 0.0, 1e9
    config = _escalating_config()
    t = 0.0
    while t < stop:
        sim.step(t)
        t += INTERVAL
    on_time = PeerDetector(config).run_pool(sim.frame, t - INTERVAL)  # as the last slot filled
    behind = PeerDetector(config).run_pool(sim.frame, t + 240.0)  # four minutes later, no newer data
    assert on_time["node-008"]  # the slow GPU, alert or escalated
    assert behind == on_time
    head = sim.frame.head
    assert head is not None
    assert complete_slots(sim.frame, t + 240.0)[1] == (head - 1) * INTERVAL


@pytest.mark.parametrize("seed", [45, 46])
@pytest.mark.parametrize("light", [(6, 7), (4, 5, 6, 7)])
def test_an_inference_pod_beside_a_training_job_is_work_not_a_fault(
    seed: int, light: tuple[int, ...]
) -> None:
    # Kubernetes allocates GPUs one by one: a training job holds some GPUs of node-009, an inference
    # pod the others, 60-85 % busy at ~330 W (about 0.55 of its node-mates), at its full boost clock
    # with no clock event reason, 12 C cooler. Nothing holds those GPUs back: less work, not a fault.
    sim = PoolSim(nodes=64, seed=seed)
    sim.busy_until[9] = 1e9
    rng = np.random.default_rng(seed)
    pod = list(light)

    def inference(node: str, t: float, block: FloatArray) -> None:
        if node != "node-009" or block[0, C["utilization_ratio"]] < 0.5:
            return
        n = len(pod)
        block[pod, C["utilization_ratio"]] = rng.uniform(0.6, 0.85, n)
        block[pod, C["power_watts"]] = rng.normal(330.0, 25.0, n)
        block[pod, C["sm_clock_ratio"]] = 1.0
        block[pod, C["temperature_celsius"]] -= 12.0
        block[pod, C["memory_temperature_celsius"]] -= 12.0

    _rewrite(sim, inference)
    runs = simulate(sim, minutes=15)
    assert not [(node, f.key) for _, node, f in found(runs) if f.key.startswith("peer-power")]
    assert quarantines(runs) == []


@pytest.mark.parametrize("seed", [47, 48])
def test_a_node_in_a_warmer_rack_is_an_alert_not_a_quarantine(seed: int) -> None:
    # Inlet air differs by rack and height (ASHRAE's recommended 18-27 C): node-008 breathes air 9 C
    # warmer, every GPU and its HBM 9 C over the pool at the same power, under the slowdown
    # temperature (no thermal reason). Worth an alert on the cooling; the clocks are untouched.
    sim = PoolSim(nodes=64, seed=seed)
    sim.temp_offset = np.random.default_rng(seed).normal(0.0, 0.5, sim.temp_offset.shape)
    sim.temp_offset[8] += 9.0
    sim.busy_until[8] = 1e9
    runs = simulate(sim, minutes=15)
    hits = found(runs)
    mine = [f for _, node, f in hits if node == "node-008"]
    assert mine and {f.key.split(":")[0] for f in mine} <= {"peer-temperature", "peer-memory-temperature"}
    assert {f.action for _, _, f in hits} == {"alert"}  # 15 minutes: never escalated either
    assert all("no thermal slowdown" in str(f.evidence["explanation"]) for f in mine)
    assert quarantines(runs) == []


def test_a_slow_gpu_in_a_pool_whose_clocks_are_all_locked_is_still_found() -> None:
    # Some fleets lock every GPU's clocks (``nvidia-smi -lgc``) for run-to-run determinism: the
    # pool runs at one setting, so a GPU slow under it is still a GPU slower than its peers.
    sim = PoolSim(nodes=64, seed=11, faults=[Fault(node=7, gpu=5, start=300.0, slow=0.12)])
    sim.busy_until[7] = 1e9

    def lock(node: str, t: float, block: FloatArray) -> None:
        block[:, C[APP_CLOCKS_COLUMN]] = 1.0

    _rewrite(sim, lock)
    hits = found(simulate(sim, minutes=15))
    assert any(node == "node-007" and f.action == "quarantine" for _, node, f in hits)
    assert all(node == "node-007" for _, node, _ in hits)


@pytest.mark.parametrize("locked", [tuple(range(GPUS)), (0, 1, 2, 3)])
def test_clocks_locked_by_the_admin_are_policy_not_a_fault(locked: tuple[int, ...]) -> None:
    # ``nvidia-smi -lgc 1755`` (or ``-ac``) on node-008: SM clocks held at 1755 of 1980 MHz, power
    # 15 % lower, with NVML's applications-clocks reason (0x2, the frame's APP_CLOCKS_COLUMN).
    def judged(reason_set: bool) -> dict[str, list[Finding]]:
        sim = PoolSim(nodes=64, seed=93)
        sim.busy_until[8] = 1e9
        gpus = list(locked)

        def lock(node: str, t: float, block: FloatArray) -> None:
            if node == "node-008" and block[0, C["utilization_ratio"]] >= 0.5:
                block[gpus, C["sm_clock_ratio"]] = 1755e6 / MAX_HZ
                block[gpus, C["power_watts"]] *= 0.85
                block[gpus, C[APP_CLOCKS_COLUMN]] = 1.0 if reason_set else 0.0

        _rewrite(sim, lock)
        t = 0.0
        while t < 600.0:
            sim.step(t)
            t += INTERVAL
        return PeerDetector().judge(sim.frame.window(*complete_slots(sim.frame, t)), t)

    # Without the reason the lock looks like a slow node: found against the pool (or node-mates).
    assert any(f.action == "quarantine" for f in judged(False)["node-008"])
    with_reason = judged(True)
    assert with_reason["node-008"] == []
    assert not any(with_reason.values())
