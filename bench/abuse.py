"""What one node token can make the aggregator hold: a good node against a hostile one.

Run from the repository root (about a minute on 2 cores; in-process, nothing on the network)::

    .venv/bin/python bench/abuse.py [--reports 540] [--json FILE]

Both feed ``--reports`` reports (10 s apart; 540 is three history windows of 1,800 s) of one
node into a fresh ``Pipeline`` with the shipped rules and the default config, measuring with
tracemalloc what the pipeline holds after each window. The good node is ``bench/_reports.py``'s
realistic H100 node. The hostile one sends the same node with 8 NIC names never seen before in
every report and 16 pair-probe results naming made-up peers (what issue 16 grew to 1.85 GB with):
the caps (``ingest.max_*``), the history's bounded NIC keys and the probe filter must keep it flat.
Prints MB held after each window and the growth over the last one; ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import tracemalloc
from pathlib import Path

import msgspec
from _reports import NodeSim

from agent.report import Probe, Report
from aggregator.configload import load_config
from aggregator.decisions import DecisionLog
from aggregator.pipeline import Pipeline
from aggregator.rules import default_rules_dir, load_rules

T0 = 1_764_441_600.0
INTERVAL = 10.0


def _hostile(report: Report, seq: int) -> Report:
    nics = [msgspec.structs.replace(n, device=f"evil{seq}_{i}") for i, n in enumerate(report.nics[:8])]
    probes = [
        Probe(
            kind="nccl_allreduce_pair",
            time=report.time - 1.0,
            ok=True,
            peer=f"ghost-{seq}-{i}",
            size_bytes=1 << 30,
            busbw_bytes_per_second=4e10,
            duration_seconds=1.0,
        )
        for i in range(16)
    ]
    return msgspec.structs.replace(report, nics=nics, probes=probes)


def measure(hostile: bool, reports: int) -> list[float]:
    """MB held by the pipeline after each 180-report window."""
    config = load_config(None)
    pipeline = Pipeline(config, load_rules([default_rules_dir()]), DecisionLog(None))
    node = NodeSim(0)
    window = int(config.fleet.window_seconds / INTERVAL)
    held: list[float] = []
    tracemalloc.start()
    try:
        gc.collect()
        base = tracemalloc.get_traced_memory()[0]
        for seq in range(reports):
            t = T0 + INTERVAL * seq
            report = node.report(t, seq)
            pipeline.ingest(_hostile(report, seq) if hostile else report, t)
            if (seq + 1) % window == 0:
                gc.collect()
                held.append((tracemalloc.get_traced_memory()[0] - base) / 1e6)
    finally:
        tracemalloc.stop()
    return held


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reports", type=int, default=540)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = {}
    for name in ("good", "hostile"):
        started = time.perf_counter()
        held = measure(name == "hostile", args.reports)
        growth = held[-1] - held[-2] if len(held) > 1 else float("nan")
        results[name] = {
            "held_mb_per_window": [round(h, 3) for h in held],
            "last_window_growth_mb": round(growth, 3),
        }
        print(
            f"{name:8s} held after each window: {', '.join(f'{h:.2f}' for h in held)} MB; "
            f"last window +{growth:.3f} MB ({time.perf_counter() - started:.0f} s)"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
