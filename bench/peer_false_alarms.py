"""Healthy-only check of the peer detector's false-alarm claim: many node-hours, no faults.

Run from the repository root (no network)::

    .venv/bin/python bench/peer_false_alarms.py [--nodes 128] [--hours 20] [--seeds 4]

Every seed writes a healthy pool of ``--nodes`` H100 nodes slot by slot (10 s) for ``--hours`` with
the noise of ``sim/pool.py``'s ``PoolSim`` (per-node and per-GPU persistent offsets,
per-sample noise, NVML clock steps, integer temperatures, stray slowdown bits) and jobs that differ
the way a busy cluster's do: 10-minute jobs, ~60 % of nodes busy, half the jobs heavy and held at
the power limit with clocks 1 - 0.03 |t(2)| of the usual (a tail with no variance). The detector
runs every 30 s as the pipeline runs it. Prints node-hours observed, alert and quarantine episodes
(a finding key's first appearance on a node) per 10,000 node-hours. Not a test: it takes minutes.
"""

from __future__ import annotations

import argparse
import sys
import time

from aggregator.detect.peers import PeerDetector
from sim.pool import INTERVAL, PoolSim


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=128)
    parser.add_argument("--hours", type=float, default=20.0)
    parser.add_argument("--seeds", type=int, default=4)
    args = parser.parse_args()
    alerts: set[tuple[int, str, str]] = set()
    quarantines: set[tuple[int, str, str]] = set()
    started = time.monotonic()
    for seed in range(1, args.seeds + 1):
        sim = PoolSim(
            nodes=args.nodes, seed=1000 + seed, job_spread=0.03, job_s=(600.0, 600.0), idle_s=(400.0, 400.0)
        )
        detector = PeerDetector()
        t, next_run = 0.0, 30.0
        while t < args.hours * 3600:
            sim.step(t)
            t += INTERVAL
            if t >= next_run:
                next_run += 30.0
                for node, findings in detector.run_pool(sim.frame, t).items():
                    for f in findings:
                        (quarantines if f.action == "quarantine" else alerts).add((seed, node, f.key))
                        if f.action == "quarantine":
                            print(f"seed {seed} t={t:.0f} {node} {f.summary}", file=sys.stderr)
        print(f"seed {seed} done, {time.monotonic() - started:.0f} s", file=sys.stderr)
    node_hours = args.nodes * args.hours * args.seeds
    per = 10_000 / node_hours
    print(f"node-hours: {node_hours:.0f}")
    print(f"alert episodes: {len(alerts)} ({len(alerts) * per:.2f} per 10,000 node-hours)")
    print(f"quarantine episodes: {len(quarantines)} ({len(quarantines) * per:.2f} per 10,000 node-hours)")


if __name__ == "__main__":
    main()
