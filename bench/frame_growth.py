"""A pool frame as its nodes join: what one write holds the event loop for when the rows grow.

When the aggregator starts (or restarts) every node of a pool joins its frame within one
interval, and the frame's row capacity grows by a quarter each time it is full. This bench writes
``--nodes`` new nodes into one ``PoolFrame`` (60 slots of 10 s, 8 GPUs, 8 NICs a node, the
service's defaults), one write a node as their first reports would, then ``--rounds`` more rounds
of every node in later slots, and gives for each phase the slowest write, the 99th percentile,
the total, and the process's peak RSS. Reads in between (``--window-every``) take and read a
window of the complete slots, as the peer detectors do, so the frame's copy-on-write and any
padding are in the figures.

    nice -n 5 .venv/bin/python bench/frame_growth.py --nodes 2000
    nice -n 5 .venv/bin/python bench/frame_growth.py --nodes 7500 --json bench/results/frame_growth.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from _common import cpu_model

from aggregator.fleet.frame import GPU_FIELDS, NIC_FIELDS, FrameWindow, PoolFrame

SLOTS = 60
INTERVAL_S = 10.0
GPUS = 8
NICS = 8


def machine_line() -> str:
    return f"Machine: {cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def _peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text(encoding="utf-8").splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


def _summary(times: Sequence[float]) -> dict[str, float]:
    a = np.sort(np.asarray(times)) * 1000.0
    return {
        "writes": float(a.size),
        "max_ms": float(a[-1]),
        "p99_ms": float(a[min(a.size - 1, int(0.99 * a.size))]),
        "median_ms": float(np.median(a)),
        "total_ms": float(a.sum()),
    }


def run(nodes: int, rounds: int, window_every: int) -> dict[str, object]:
    frame = PoolFrame("bench", interval_s=INTERVAL_S, slots=SLOTS, gpus=GPUS)
    rng = np.random.default_rng(1)
    gpu = rng.random((GPUS, len(GPU_FIELDS)), dtype=np.float32)
    nic = rng.random((NICS, len(NIC_FIELDS)), dtype=np.float32)
    keys = [(f"mlx5_{i}", 1) for i in range(NICS)]
    names = [f"node-{i:06d}" for i in range(nodes)]
    t = 1_800_000_000.0
    held: list[FrameWindow] = []

    def one_round(at: float) -> list[float]:
        took = []
        for i, name in enumerate(names):
            started = time.perf_counter()
            frame.assign_nics(name, keys, NICS)
            frame.write(name, at, gpu, keys, nic)
            took.append(time.perf_counter() - started)
            if window_every and i % window_every == window_every - 1:
                window = frame.window(at - SLOTS * INTERVAL_S, at - INTERVAL_S, nic=True)
                _ = window.gpu.shape, window.nic.shape  # read as a detector would (on this thread)
                held[:] = [window]  # one window alive at a time, as one offloaded run holds one
        return took

    rss_before = _peak_rss_mb()
    joined = _summary(one_round(t))
    rss_joined = _peak_rss_mb()
    steady: list[float] = []
    for r in range(1, rounds + 1):
        steady.extend(one_round(t + r * INTERVAL_S))
    return {
        "nodes": nodes,
        "slots": SLOTS,
        "frame_mb": (SLOTS * frame._capacity * (GPUS * len(GPU_FIELDS) + NICS * len(NIC_FIELDS)) * 4) / 2**20,
        "join": joined,
        "steady": _summary(steady) if steady else None,
        "peak_rss_mb_before": rss_before,
        "peak_rss_mb_after_join": rss_joined,
        "peak_rss_mb_end": _peak_rss_mb(),
    }


def render(result: dict[str, object]) -> str:
    join = result["join"]
    steady = result["steady"]
    assert isinstance(join, dict)
    lines = [
        f"{result['nodes']:,} nodes joining one pool frame ({SLOTS} slots, {GPUS} GPUs and {NICS} NICs "
        f"a node; {result['frame_mb']:.0f} MB of frame at the end)",
        "",
        "| phase | writes | slowest write | p99 | median | total | peak RSS after |",
        "|---|---:|---:|---:|---:|---:|---:|",
        f"| join (one write a new node) | {join['writes']:,.0f} | {join['max_ms']:.1f} ms "
        f"| {join['p99_ms']:.2f} ms | {join['median_ms']:.3f} ms | {join['total_ms']:,.0f} ms "
        f"| {result['peak_rss_mb_after_join']:,.0f} MB |",
    ]
    if isinstance(steady, dict):
        lines.append(
            f"| later rounds | {steady['writes']:,.0f} | {steady['max_ms']:.1f} ms "
            f"| {steady['p99_ms']:.2f} ms | {steady['median_ms']:.3f} ms | {steady['total_ms']:,.0f} ms "
            f"| {result['peak_rss_mb_end']:,.0f} MB |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3, help="rounds of every node after the join")
    p.add_argument(
        "--window-every", type=int, default=500, help="take and read a window every N writes (0: never)"
    )
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    result = run(args.nodes, args.rounds, args.window_every)
    print(machine_line())
    print()
    print(render(result))
    if args.json is not None:
        args.json.write_text(
            json.dumps({"machine": machine_line(), **result}, indent=2) + "\n", encoding="utf-8"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
