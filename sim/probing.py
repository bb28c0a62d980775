"""Pair probes as the real probe scheduler plans them (``aggregator/probes/scheduler.py``).

The simulator does not model the scheduler: it runs it. Before any report is made, this module
replays the fleet's report and poll cycle against a ``ProbeScheduler`` (each node at its own
report phase, as the aggregator hears it): every cycle the node is observed (idle or busy, from
its job timeline), the results it has to report are handed in, and it polls for assignments. An
assignment runs when both ends are free at its start (``not_before`` plus a few seconds of setup);
its measurement comes from ``measure`` (the fault model, ``sim.fleet``) and goes into both ends'
next reports and back into the scheduler, which decides confirm re-probes and the pool's expected
bandwidth from it exactly as in production.

What is simplified, and why it does not flatter the detectors:

- A node that is down or silent (a reboot, a silent rack) is neither observed nor polled: the
  aggregator does not hear it, so the scheduler gives it nothing.
- A probe with an end that turned busy before it started gives no result: the agent's idle guard
  skips it (``skipped: GPUs busy``), which the scheduler and the localizer both ignore, so leaving
  it out changes no decision. The scheduler frees the pair at its deadline.
- The scheduler sees every report; the 1 % the network loses later only delays what it learns
  (the other end's copy of a result still arrives).
- Local probes keep the node's own cadence (``probes.local_every_s``): they need no partner.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Final

from agent.report import Probe
from aggregator.config import ProbesConfig
from aggregator.fleet.pools import Placement
from aggregator.probes.scheduler import ProbeScheduler
from sim.scenario import Scenario

__all__ = ["PairProbe", "plan_pair_probes", "scheduler_config"]

# From the start an assignment names to the end of the timed loop: NCCL setup, warm-up, the timed
# iterations of a 1 GiB all-reduce (the agent's nccl-tests run, docs/probes.md).
SETUP_SECONDS: Final = 5.0
# Signs the simulated assignments; never checked (no agent verifies them here).
_SIM_KEY: Final = b"gpuwarden-sim"


@dataclass(frozen=True)
class PairProbe:
    """One pair measurement: when it ran (true time), its ends, and each end's copy."""

    true_time: float
    a: str
    b: str
    probe_a: Probe  # as ``a`` reports it (``peer = b``, ``a``'s clock)
    probe_b: Probe
    shows: frozenset[int]  # the faults (scenario indices) this measurement makes visible
    reason: str = "rotation"


def scheduler_config(s: Scenario) -> ProbesConfig:
    """The production defaults, with the scenario's round length, probe size and poll period."""
    return ProbesConfig(
        round_seconds=s.pair_every_s,
        pair_size_bytes=s.probe_size_bytes,
        local_kind=None,  # local probes keep the node's own cadence
        poll_seconds=s.interval_s,
    )


def plan_pair_probes(
    s: Scenario,
    *,
    phases: Mapping[str, float],
    placements: Mapping[str, Placement],
    heard: Callable[[str, float], bool],
    free: Callable[[str, float], bool],
    measure: Callable[[str, str, float], PairProbe],
    config: ProbesConfig | None = None,
) -> dict[str, list[PairProbe]]:
    """Every pair probe the scheduler plans and the fleet runs, per node, in time order.

    ``phases`` gives each node's report phase (its reports at ``start + phase + k * interval``),
    ``heard(node, t)`` whether the aggregator hears it then (up, not silenced), ``free(node, t)``
    whether its GPUs are idle, and ``measure(a, b, t)`` the measurement of a probe run at ``t``.
    """
    sched = ProbeScheduler(config or scheduler_config(s), _SIM_KEY, report_interval_seconds=s.interval_s)
    end = s.start + s.duration_s
    ticks: list[tuple[float, str]] = [(round(s.start + phases[n], 3), n) for n in sorted(phases)]
    heapq.heapify(ticks)
    to_report: dict[str, list[tuple[float, int, Probe]]] = {n: [] for n in phases}
    started: set[str] = set()
    plans: dict[str, list[PairProbe]] = {}
    order = 0
    while ticks:
        t, name = heapq.heappop(ticks)
        if t + s.interval_s <= end:
            heapq.heappush(ticks, (round(t + s.interval_s, 3), name))
        if not heard(name, t):
            continue
        placement = placements[name]
        sched.observe(name, placement, idle=free(name, t), now=t)
        due = to_report[name]
        while due and due[0][0] <= t:
            _, _, probe = heapq.heappop(due)
            sched.result(name, probe, placement, t)
        for assignment in sched.assignments_for(name, t):
            peer = assignment.peer
            if peer is None or assignment.id in started:
                continue  # a local assignment (not planned here), or the peer already took it
            started.add(assignment.id)
            run = assignment.not_before + SETUP_SECONDS
            if run > end or run > assignment.deadline or not _both(free, heard, name, peer, run):
                continue
            a, b = sorted((name, peer))
            plan = replace(measure(a, b, round(run, 3)), reason=_reason(sched, assignment.id))
            for node, copy in ((a, plan.probe_a), (b, plan.probe_b)):
                heapq.heappush(to_report[node], (plan.true_time, order, copy))
                order += 1
                plans.setdefault(node, []).append(plan)
    for lst in plans.values():
        lst.sort(key=lambda p: p.true_time)
    return plans


def _both(
    free: Callable[[str, float], bool], heard: Callable[[str, float], bool], a: str, b: str, t: float
) -> bool:
    return all(free(n, t) and heard(n, t) for n in (a, b))


def _reason(sched: ProbeScheduler, probe_id: str) -> str:
    view = sched.probe(probe_id)
    return view.reason if view is not None else "rotation"
