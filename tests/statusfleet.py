"""A fleet for the status page's tests, screenshots and benchmark: a simulated pool run through the
real pipeline, left with a node of every kind on show.

At the end of the run: one node quarantined (XID 79), one suspect (too hot), a rack silent (a
systemic event), a degraded link between two nodes, decisions in the feed and pair probes in the
link matrix. ``clock`` stands at the last delivery, so "ago" and the decision window read as they
would live.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.clock import FakeClock
from aggregator.config import Config
from aggregator.configload import parse_config
from aggregator.decisions import DecisionLog
from aggregator.pipeline import Pipeline
from aggregator.rules import default_rules_dir, load_rules
from tests.simfleet import fault, fleet, generate

QUARANTINED = "gpu-0003"
SUSPECT = "gpu-0010"
SILENT_RACK = "rack-004"

CONFIG_TEXT = """
remediation: {mode: dry-run}
health: {suspect_for_seconds: 600}
"""


@dataclass
class StatusFleet:
    pipeline: Pipeline
    clock: FakeClock
    config: Config
    nodes: int


def status_fleet(nodes: int = 32, *, minutes: float = 20.0, seed: int = 19) -> StatusFleet:
    """``nodes`` H100 nodes (8 per rack) for ``minutes``; the faults land in the second half."""
    end = minutes * 60.0
    faults = [
        fault("xid79", end * 0.5, node=QUARANTINED, gpu=3),
        fault("thermal", end * 0.8, node=SUSPECT, gpu=2),
        fault("silent_rack", end - 150.0, rack=SILENT_RACK),
    ]
    if nodes >= 16:
        faults.append(fault("degraded_link", end * 0.3, node="gpu-0016", peer="gpu-0017", ratio=0.5))
    scenario = fleet(nodes, seed=seed, duration_s=end, faults=faults)
    config = parse_config(CONFIG_TEXT, "status fleet")
    pipeline = Pipeline(config, load_rules([default_rules_dir()]), DecisionLog(None))
    last = 0.0
    for received, report in generate(scenario):
        pipeline.ingest(report, received)
        last = received
    clock = FakeClock(last)
    pipeline.advance(last)
    return StatusFleet(pipeline, clock, config, nodes)
