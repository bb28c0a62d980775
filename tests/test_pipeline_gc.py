"""What a node leaves for the cycle collector: a few objects, whatever its history holds.

A full collection walks every tracked object while the event loop waits; at 7,500 nodes 27
objects a node made collections of 200-240 ms (docs/performance.md). This counts what the real
pipeline keeps tracked per node once its reports are in (decoded from the wire, as served), so
a container added to per-node state shows up here before it shows up as loop lag.
"""

from __future__ import annotations

import gc

import msgspec

from agent.report import Report, decode, encode
from aggregator.configload import load_config
from aggregator.decisions import DecisionLog
from aggregator.pipeline import Pipeline
from aggregator.rules import default_rules_dir, load_rules
from tests.test_service import NOW, make_report

NODES = 40
REPORTS = 30
# Measured: about 12 a node (the node record, history, health and rule state, the seq tracker and
# its stream map, the recent-report ring, the history's three arrays and its boots, a local probe
# ring). The bound leaves room for a few more, not for a per-node list or set per detector.
PER_NODE_BOUND = 16


def _healthy(name: str, seq: int, at: float) -> Report:
    """An H100 node's report as served: decoded from the wire, nothing wrong with it (most of a
    fleet: no XID, no collector error)."""
    report = msgspec.structs.replace(make_report(node=name, seq=seq, time_=at), events=(), errors=())
    return decode(encode(report))


def test_a_node_is_a_few_tracked_objects_for_the_cycle_collector() -> None:
    pipeline = Pipeline(load_config(None), load_rules([default_rules_dir()]), DecisionLog(None))
    names = [f"gpu-{i:04d}" for i in range(NODES)]
    # A first report of every node, so what is made once per pool or fleet is not counted.
    for name in names[:2]:
        report = _healthy(name, 0, NOW)
        pipeline.ingest(report, NOW)
    gc.collect()
    before = len(gc.get_objects())
    for k in range(REPORTS):
        at = NOW + 10.0 * k
        for name in names[2:] if k == 0 else names:
            report = _healthy(name, k, at)
            pipeline.ingest(report, at + 0.5)
    gc.collect()
    per_node = (len(gc.get_objects()) - before) / (NODES - 2)
    assert 5 < per_node <= PER_NODE_BOUND, per_node
