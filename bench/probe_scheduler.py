"""The probe scheduler's cost at fleet scale: every agent observed and polling, rounds planned.

Run from the repository root (about a minute per run at 7,500 nodes; no network)::

    .venv/bin/python bench/probe_scheduler.py [--nodes 7500] [--leaf 16] [--minutes 25] \
        [--repeat 3] [--json FILE]

Through the scheduler's public API only (``observe``, ``assignments_for``, ``result``,
``coverage``), on a simulated clock: ``--nodes`` idle nodes in leaves of ``--leaf`` (one pool);
every poll period (``probes.poll_seconds``, 10 s) each node is observed (its report) and polls
(``assignments_for``: plans a round when one is due, dispatches what the caps allow, signs the
node's assignments); every dispatched pair probe is answered ok by both ends. ``--minutes`` of
fleet time covers the start and at least two 10-minute rounds. Reported: the CPU of one poll
period's calls (all agents), the slowest period (a round starts in it), per-call times, and one
``coverage`` pass (what a Prometheus scrape of the probe metrics costs). Medians of ``--repeat``
runs; these machines are noisy.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from agent.report import Probe
from aggregator.config import ProbesConfig
from aggregator.fleet.pools import Placement
from aggregator.probes.scheduler import ProbeScheduler

T0 = 1_764_441_600.0


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_once(nodes: int, leaf: int, minutes: float) -> dict[str, float]:
    cfg = ProbesConfig(pair_kind="tcp_pair", local_kind=None)
    sched = ProbeScheduler(cfg, b"bench-probe-key-0123456789", report_interval_seconds=10.0)
    names = [f"gpu-{i:05d}" for i in range(nodes)]
    place = {n: Placement("h100", rack=f"r{i // leaf}", leaf=f"l{i // leaf}") for i, n in enumerate(names)}
    addr = {n: f"10.{i // 65536}.{(i // 256) % 256}.{i % 256}:9402" for i, n in enumerate(names)}
    answered: set[str] = set()
    calls: list[float] = []  # every observe + poll, as one agent's report and poll cost
    periods: list[float] = []  # all agents' polls of one poll period
    t = T0
    end = T0 + minutes * 60.0
    while t < end:
        period_start = time.perf_counter()
        for n in names:
            c0 = time.perf_counter()
            sched.observe(n, place[n], idle=True, now=t, address=addr[n])
            sched.assignments_for(n, t, address=addr[n])
            calls.append(time.perf_counter() - c0)
        periods.append(time.perf_counter() - period_start)
        # Every probe in flight answers ok once it has run (a second after its not_before), from
        # both ends, as the agents' next reports would carry it.
        for view in sched.in_flight():
            if view.id in answered or len(view.nodes) != 2 or t < view.not_before + 1:
                continue
            answered.add(view.id)
            a, b = view.nodes
            for end_node, peer in ((a, b), (b, a)):
                probe = Probe(
                    kind="tcp_pair",
                    time=view.not_before + 1,
                    ok=True,
                    peer=peer,
                    size_bytes=view.size_bytes,
                    busbw_bytes_per_second=12e9,
                    duration_seconds=0.5,
                )
                sched.result(end_node, probe, place[end_node], t)
        t += cfg.poll_seconds
    cov = _timed(lambda: sched.coverage(t))
    coverage = sched.coverage(t)
    calls.sort()
    return {
        "poll_period_ms": statistics.median(periods) * 1e3,
        "poll_period_max_ms": max(periods) * 1e3,
        "call_median_us": statistics.median(calls) * 1e6,
        "call_max_ms": calls[-1] * 1e3,
        "coverage_ms": cov * 1e3,
        "probes_answered": float(len(answered)),
        "nodes_tested": float(sum(1 for s in coverage.node_untested_seconds.values() if s < minutes * 60)),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=7500)
    p.add_argument("--leaf", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--minutes", type=float, default=25.0, help="simulated fleet time per run")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    runs = [run_once(args.nodes, args.leaf, args.minutes) for _ in range(args.repeat)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    out = {
        "nodes": args.nodes,
        "leaf": args.leaf,
        "repeat": args.repeat,
        "median": med,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "date": time.strftime("%Y-%m-%d"),
    }
    print(
        f"probe scheduler, {args.nodes} nodes in leaves of {args.leaf}, {args.minutes:g} simulated "
        f"minutes, median of {args.repeat} runs"
    )
    print("| measure | median |\n|---|---|")
    print(f"| every agent's observe + poll in one poll period | {med['poll_period_ms']:.0f} ms |")
    print(f"| the slowest poll period (a round starts in it) | {med['poll_period_max_ms']:.0f} ms |")
    print(f"| one agent's observe + poll, median | {med['call_median_us']:.0f} us |")
    print(f"| the slowest single call (plans a round) | {med['call_max_ms']:.1f} ms |")
    print(f"| coverage (a scrape of the probe metrics) | {med['coverage_ms']:.1f} ms |")
    print(f"| pair probes dispatched and answered | {med['probes_answered']:.0f} |")
    print(f"| nodes tested at least once | {med['nodes_tested']:.0f} of {args.nodes} |")
    if args.json is not None:
        args.json.write_bytes(msgspec.json.format(msgspec.json.encode(out), indent=2) + b"\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
