"""The per-second tick finds silent and long-gone nodes without looking at the fleet every second.

The pipeline keeps a floor under every node's last receive time and passes over the fleet only
once the floor could be silent (aggregator/pipeline.py, ``advance_steps``). These are the cases
where a floor kept carelessly would hide a node: one that joins with an older receive time than
everyone (replay takes reports slightly out of order across nodes), the clock stepping back, and a
node silent long enough to be forgotten while the rest of the fleet reports.
"""

from __future__ import annotations

import random

import msgspec

from aggregator.config import Config, FleetConfig, SilenceConfig
from aggregator.decisions import DecisionLog
from aggregator.pipeline import Pipeline
from aggregator.rules import default_rules_dir, load_rules
from tests.rulekit import report

T0 = 1_800_000_000.0
SILENT_AFTER = 30.0
FORGET_AFTER = 120.0


def _pipeline() -> Pipeline:
    config = msgspec.structs.replace(
        Config(), silence=SilenceConfig(silent_after_seconds=SILENT_AFTER, forget_after_seconds=FORGET_AFTER)
    )
    return Pipeline(config, load_rules([default_rules_dir()]), DecisionLog(None))


# Nodes that report throughout; enough that one silent node is under the pool share that would
# make it one systemic event instead (silence.pool_share, 0.2).
STEADY = {f"a{i}": (T0 - 1001.0, T0 + 1000.0) for i in range(6)}  # at 9, 19, ... s past T0
_SEQS: dict[int, dict[str, int]] = {}  # each pipeline's nodes' last seq: a node's seq only grows


def _run(
    p: Pipeline,
    nodes: dict[str, tuple[float, float]],
    start: float,
    end: float,
    *,
    skew: float = 0.0,
    watch: tuple[str, ...] = (),
) -> dict[str, float]:
    """Each node reports every 10 s within its [from, to) of the aggregator's clock, which ticks
    every second; its reports are stamped ``skew`` later by its own clock. The time each node was
    first seen suspect."""
    suspect: dict[str, float] = {}
    seqs = _SEQS.setdefault(id(p), {})
    t = start
    while t < end:
        for name, (since, until) in nodes.items():
            if since <= t < until and (t - since) % 10.0 == 0.0:
                seqs[name] = seqs.get(name, -1) + 1
                p.ingest(report(t + skew, node=name, seq=seqs[name]), t)
        p.advance(t)
        for name in (*nodes, *watch):
            h = p.health.get(name)
            if h is not None and h.state == "suspect" and name not in suspect:
                suspect[name] = t
        t += 1.0
    return suspect


def test_a_node_that_joins_with_the_oldest_receive_time_is_still_found_silent() -> None:
    p = _pipeline()
    _run(p, STEADY, T0, T0 + 70.0)  # the steady nodes' last reports: at T0 + 69
    # "b" arrives with a receive time older than theirs (as replay may see it), then stops.
    late = T0 + 68.5
    p.ingest(report(late, node="b", seq=0), late)
    suspect = _run(p, STEADY, T0 + 70.0, T0 + 110.0, watch=("b",))
    assert "b" in suspect and late + SILENT_AFTER < suspect["b"] <= late + SILENT_AFTER + 2.0
    assert suspect.keys() == {"b"}


def test_after_the_clock_steps_back_a_node_that_stops_is_found_silent() -> None:
    p = _pipeline()
    _run(p, STEADY | {"b": (T0 - 1001.0, T0 + 1000.0)}, T0, T0 + 60.0)
    # NTP or a VM restore: the aggregator's clock is ten minutes earlier now (the agents' are not).
    back = T0 - 600.0
    suspect = _run(p, STEADY | {"b": (back - 1.0, back + 20.0)}, back, back + 80.0, skew=660.0)
    # b's last report was received at back + 19: silent once 30 s have passed since.
    assert "b" in suspect and back + 19.0 + SILENT_AFTER < suspect["b"] <= back + 19.0 + SILENT_AFTER + 2.0
    assert suspect.keys() == {"b"}


def test_a_node_silent_past_the_forget_horizon_is_forgotten_while_the_rest_report() -> None:
    p = _pipeline()
    suspect = _run(p, STEADY | {"b": (T0 - 1001.0, T0 + 20.0)}, T0, T0 + 100.0)
    assert "b" in suspect and p.node("b") is not None
    _run(p, STEADY, T0 + 100.0, T0 + 19.0 + FORGET_AFTER + 3.0)  # b's last: T0 + 19
    assert p.node("b") is None  # forgotten: no longer listed
    assert all(p.node(n) is not None for n in STEADY)


def test_silence_follows_the_report_interval_unless_configured() -> None:
    # A fleet reporting every minute: a fixed 60 s would call every node silent just before each
    # of its reports. By default silence waits six intervals, whatever the interval.
    config = Config(fleet=FleetConfig(interval_seconds=60.0))
    assert config.silence.after(60.0) == 360.0 and Config().silence.after(10.0) == 60.0
    assert SilenceConfig(silent_after_seconds=90.0).after(60.0) == 90.0  # a set value wins
    p = Pipeline(config, load_rules([default_rules_dir()]), DecisionLog(None))
    rng = random.Random(7)
    nodes = [f"m{i}" for i in range(8)]
    stop_at = T0 + 1200.0  # m0 stops reporting
    last: dict[str, float] = {}
    suspect: dict[str, float] = {}
    due = {n: T0 + rng.uniform(0.0, 60.0) for n in nodes}
    seqs = dict.fromkeys(nodes, 0)
    t = T0
    while t < T0 + 1800.0:
        for n in nodes:
            if due[n] <= t and not (n == "m0" and t > stop_at):
                p.ingest(report(t, node=n, seq=seqs[n]), t)
                seqs[n] += 1
                last[n] = t
                # 60 s apart, up to 20 s late or early: a busy network, a slow collection
                due[n] = t + 60.0 + rng.uniform(-20.0, 20.0)
        p.advance(t)
        for n in nodes:
            h = p.health.get(n)
            if h is not None and h.state == "suspect":
                suspect.setdefault(n, t)
        t += 1.0
    assert suspect.keys() == {"m0"}
    assert last["m0"] + 360.0 < suspect["m0"] <= last["m0"] + 362.0
