"""The robustness knobs of both generators reach the traces (sim.scenario.vary, othergen.Knobs).

Each knob is checked on what a detector would see: the spread of healthy loaded GPUs' SM clocks
and power, job durations, the busy share, the share of reports delivered, fault onsets in the
truth, and the low-end magnitudes in the readings. Small fleets and short traces keep it fast.
"""

from __future__ import annotations

import itertools
import math
import statistics
from typing import Any

import msgspec
import othergen  # bench/othergen.py
import pytest

from agent.errors import ConfigError
from sim import fleet as sim_fleet
from sim import scenario as sc
from sim.profiles import H100_SXM_80GB, IB_BER_BUDGET, REASON_GPU_IDLE, symbol_errors_per_s
from sim.truth import build as build_truth

_OG = {"nodes": 32, "minutes": 12, "interval_s": 30.0}


def _sim(**kw: Any) -> sc.Scenario:
    base = sc.Scenario(
        seed=2, duration_s=900.0, interval_s=10.0, pools=(sc.Pool("h100", H100_SXM_80GB, 12),), faults=()
    )
    return sc.vary(base, **kw)


def _sim_reports(s: sc.Scenario) -> list[dict[str, Any]]:
    return [msgspec.to_builtins(d.report) for d in sim_fleet.simulate(s)]


def _loaded_spread(reports: list[dict[str, Any]]) -> tuple[float, float]:
    """Standard deviations of SM clock / max and power / limit over healthy loaded GPUs."""
    clocks, powers = [], []
    for r in reports:
        for g in r["gpus"]:
            if g["utilization_ratio"] >= 0.5 and not g["clock_event_reasons"] & REASON_GPU_IDLE:
                clocks.append(g["sm_clock_hz"] / g["sm_clock_max_hz"])
                powers.append(g["power_watts"] / g["power_limit_watts"])
    assert len(clocks) > 200
    return statistics.pstdev(clocks), statistics.pstdev(powers)


def test_sim_noise_widens_the_loaded_clock_and_power_spread() -> None:
    spreads = [_loaded_spread(_sim_reports(_sim(noise=k, busy_share=0.9))) for k in (1.0, 2.0, 3.0)]
    for (c1, p1), (c2, p2) in itertools.pairwise(spreads):
        assert c2 > c1 * 1.3 and p2 > p1 * 1.3, spreads


def test_othergen_noise_widens_the_loaded_clock_and_power_spread() -> None:
    spreads = []
    for k in (1.0, 2.0, 3.0):
        reports, _ = othergen.generate(3, **_OG, knobs=othergen.Knobs(noise=k, healthy=True, busy_share=0.9))
        spreads.append(_loaded_spread(reports))
    for (c1, p1), (c2, p2) in itertools.pairwise(spreads):
        assert c2 > c1 * 1.3 and p2 > p1 * 1.3, spreads


def _busy_stretches(s: sc.Scenario) -> list[float]:
    out = []
    for tl in sim_fleet._timelines(s).values():
        edges = [s.start, *tl.switches]
        busy = tl.first_busy
        for a, b in itertools.pairwise(edges):
            if busy:
                out.append(b - a)
            busy = not busy
    return out


def test_sim_turnover_and_busy_share_set_the_timelines() -> None:
    s = _sim().with_overrides(seed=None, nodes=400, minutes=None)
    for median in (300.0, 1800.0):
        got = statistics.median(_busy_stretches(sc.vary(s, job_median_s=median)))
        assert got == pytest.approx(median, rel=0.15)
    for share in (0.3, 0.95):
        v = sc.vary(s, busy_share=share)
        tls = sim_fleet._timelines(v).values()
        times = [v.start + i * 30.0 for i in range(30)]
        busy = sum(tl.busy(t) for tl in tls for t in times) / (len(tls) * len(times))
        assert busy == pytest.approx(share, abs=0.06)


def test_othergen_turnover_and_busy_share_set_the_schedule() -> None:
    fleet = othergen._build_fleet(1, 64)
    t0, t1 = othergen.START, othergen.START + 1800.0
    for median in (300.0, 1800.0):
        _, sched, _ = othergen._plan(1, fleet, t0, t1, othergen.Knobs(job_median_s=median))
        assert statistics.median(j.duration for j in sched.jobs) == pytest.approx(median, rel=0.15)
    for share in (0.3, 0.6):
        _, sched, _ = othergen._plan(1, fleet, t0, t1, othergen.Knobs(busy_share=share))
        assert othergen.busy_share(sched, t0, t1) == pytest.approx(share, abs=0.05)
    _, sched, _ = othergen._plan(1, fleet, t0, t1, othergen.Knobs(busy_share=0.95))
    assert othergen.busy_share(sched, t0, t1) > 0.85


def test_loss_knob_drops_that_share_of_reports() -> None:
    s = _sim()
    made = s.node_count * (s.duration_s // s.interval_s)
    for loss in (0.01, 0.10):
        delivered = sum(1 for _ in sim_fleet.simulate(sc.vary(s, lost_fraction=loss)))
        assert delivered / made == pytest.approx(1 - loss + s.duplicate_fraction, abs=0.03)
    counts: dict[float, int] = {}
    for loss in (0.01, 0.10):
        reports, _ = othergen.generate(4, **_OG, knobs=othergen.Knobs(loss=loss))
        counts[loss] = len({(r["node"], r["boot_id"], r["seq"]) for r in reports})
    assert counts[0.10] / counts[0.01] == pytest.approx(0.90 / 0.99, abs=0.03)


def test_faults_at_start_and_low_magnitudes_reach_truth_and_readings() -> None:
    s = sc.load("scenarios/fleet64.yaml").with_overrides(seed=1, nodes=None, minutes=12)
    v = sc.vary(s, faults_at_start=True, low_magnitudes=True)
    for f in v.faults:
        if f.fault_class in ("hard", "soft", "link"):
            assert f.at_s == 0.0
        elif f.kind != "clock_skew":  # the skew is at 0 in the file already
            assert f.at_s > 0.0
    params = {f.kind: f for f in v.faults}
    assert params["slow_gpu"].param("ratio") == 0.90
    assert params["slow_nic"].param("ratio") == 0.75
    # gpu-0029 is an H100 node: 400 Gb/s, budget 0.4 errors/s, twice that.
    assert params["symbol_storm"].param("rate_per_s") == pytest.approx(2 * IB_BER_BUDGET * 4e11)
    deliveries = list(sim_fleet.simulate(v))
    for f in build_truth(sim_fleet.place(v), {}).faults:
        if f.fault_class in ("hard", "soft", "link"):
            assert f.start == v.start, f
    slow = params["slow_gpu"]
    clocks = [
        d.report.gpus[slow.gpu or 0].sm_clock_hz / H100_SXM_80GB.sm_clock_max_hz
        for d in deliveries
        if d.report.node == slow.node and d.report.gpus[slow.gpu or 0].utilization_ratio > 0.5
    ]
    assert clocks and statistics.median(clocks) == pytest.approx(0.90, abs=0.01)

    reports, truth_og = othergen.generate(
        6, **_OG, knobs=othergen.Knobs(faults_at_start=True, low_magnitudes=True)
    )
    for f in truth_og.faults:
        if f.fault_class in ("hard", "soft", "link"):
            assert f.start == truth_og.start, f
    storm = next(f for f in truth_og.faults if f.kind == "symbol_storm")
    port = f"mlx5_{storm.port}"
    mine = sorted(
        (r["time"], n["counters"]["symbol_error"])
        for r in reports
        if r["node"] == storm.node
        for n in r["nics"]
        if n["device"] == port
    )
    (ta, ca), (tb, cb) = mine[1], mine[-1]
    rate = next(n["rate_bytes_per_second"] for r in reports if r["node"] == storm.node for n in r["nics"])
    assert (cb - ca) / (tb - ta) == pytest.approx(symbol_errors_per_s(2.0, rate), rel=0.2)
    slow_og = next(f for f in truth_og.faults if f.kind == "slow_gpu")
    ratios = [
        g["sm_clock_hz"] / g["sm_clock_max_hz"]
        for r in reports
        if r["node"] == slow_og.node
        for g in r["gpus"]
        if g["index"] == slow_og.gpu and g["utilization_ratio"] > 0.5
    ]
    if ratios:  # a node whose only load is start-up and checkpoints never shows the clock
        assert max(ratios) <= 0.90 + 1e-9


def test_healthy_knob_leaves_only_lookalikes_and_silences() -> None:
    s = sc.vary(sc.load("scenarios/fleet64.yaml"), healthy=True)
    assert {f.fault_class for f in s.faults} <= {"lookalike", "silent"}
    _, truth = othergen.generate(7, **_OG, knobs=othergen.Knobs(healthy=True))
    assert {f.fault_class for f in truth.faults} <= {"lookalike", "silent"}


def test_bad_knobs_are_refused() -> None:
    with pytest.raises(ConfigError):
        _sim(busy_share=1.0)
    with pytest.raises(ConfigError):
        _sim(noise=0.0)
    with pytest.raises(ValueError, match="busy_share"):
        othergen.generate(1, **_OG, knobs=othergen.Knobs(busy_share=0.0))
    assert math.isclose(othergen.Knobs().loss, othergen.LOSS_P)
