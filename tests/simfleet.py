"""Small simulated fleets for the end-to-end tests: ``sim/`` with the settings they were written for.

A pool of HGX H100 nodes reporting every 10 s, 8 nodes per rack and 2 racks per leaf, jobs of 20
minutes with 5-minute idle gaps, and a clean network unless a test asks for loss, duplicates or
jitter. ``fault`` builds one ``FaultSpec`` (kinds and parameters: docs/simulator.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from agent.report import Report
from sim.fleet import simulate
from sim.profiles import H100_SXM_80GB
from sim.scenario import FaultSpec, Pool, Scenario

POOL = "h100-sxm"


def fleet(
    nodes: int,
    *,
    seed: int,
    duration_s: float,
    faults: Sequence[FaultSpec] = (),
    lost_fraction: float = 0.0,
    duplicate_fraction: float = 0.0,
    jitter_s: float = 0.5,
) -> Scenario:
    scenario = Scenario(
        seed=seed,
        duration_s=duration_s,
        interval_s=10.0,
        pools=(Pool(POOL, H100_SXM_80GB, nodes),),
        nodes_per_rack=8,
        racks_per_leaf=2,
        busy_mean_s=1200.0,
        idle_mean_s=300.0,
        lost_fraction=lost_fraction,
        duplicate_fraction=duplicate_fraction,
        jitter_s=jitter_s,
        faults=tuple(faults),
    )
    scenario.validate()
    return scenario


def fault(
    kind: str,
    at_s: float,
    *,
    node: str | None = None,
    gpu: int | None = None,
    port: int | None = None,
    rack: str | None = None,
    until_s: float | None = None,
    **params: float,
) -> FaultSpec:
    """``fault("xid79", 100.0, node="gpu-0001", gpu=3)``; a kind's parameters are keywords too
    (``fault("reboot", 400.0, node="gpu-0006", down_s=30.0)``)."""
    return FaultSpec(
        kind=kind, at_s=at_s, node=node, gpu=gpu, port=port, rack=rack, until_s=until_s, params=params
    )


def generate(scenario: Scenario) -> Iterator[tuple[float, Report]]:
    """``(receive_time, report)`` for the whole fleet, in receive order."""
    for delivery in simulate(scenario):
        yield delivery.receive_time, delivery.report


def rack_members(scenario: Scenario, rack: str) -> list[str]:
    return [n for i, n in enumerate(scenario.node_names()) if scenario.rack_of(i) == rack]
