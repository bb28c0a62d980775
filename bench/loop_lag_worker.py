"""Does the worker thread's pool compute stretch the event loop's lag? GIL contention, measured.

Run from the repository root (about 3 minutes at the defaults on 2 cores)::

    nice -n 5 .venv/bin/python bench/loop_lag_worker.py [--nodes 3000] [--rounds 26] [--seconds 40]
        [--runs 3] [--json FILE]

The service runs the peer, trend and forest detectors' pool computes in a one-thread executor
while the event loop answers reports; both threads share one interpreter lock. numpy's whole-array
operations release it, but the compute's Python steps between them hold it, and the loop may
wait for it after every system call (a socket read or write, epoll). This measures that wait:

1. ``--nodes`` simulated H100 nodes in one pool (``bench/_reports.py``) go through
   ``Pipeline.ingest`` for ``--rounds`` 10-s rounds on simulated time, then one cycle at which
   every detector is due: its offloaded computes (what the service's worker thread runs) are kept.
   Then a full collection and ``gc.freeze()``, as the service freezes its warm heap
   (``aggregator/heap.py``).
2. An event loop in this thread carries a load like ingest: every 20 ms, seven callbacks of 1 ms
   of Python each with two socket writes and reads on a socketpair (about 350 a second, a third of
   a core), and the service's lag probe (a 0.1 s sleep: how late it wakes).
3. Each run is ``--seconds`` long; the first without the worker thread, then ``--runs`` with it
   running the kept computes back to back the whole time (far more often than the service's
   cycle asks: the worst case). Full collections over 20 ms in either thread are listed
   (``gc.callbacks``), since one holds both threads.

Prints a table: median, p99 and worst lag of each run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _reports import NodeSim, phase_offset

from aggregator.app import build_pipeline
from aggregator.configload import load_config
from aggregator.decisions import DecisionLog
from aggregator.pipeline import OffloadStep
from aggregator.rules.model import default_rules_dir, load_rules
from aggregator.service import LOOP_LAG_PROBE_SECONDS

INTERVAL_S = 10.0
GC_REPORTED_S = 0.02


def kept_computes(nodes: int, rounds: int, tmp: Path) -> tuple[object, list[Callable[[], object]]]:
    """The warmed pipeline (kept alive, as the service's is) and its last cycle's computes."""
    config = load_config(None)
    pipeline = build_pipeline(config, load_rules([default_rules_dir()]), DecisionLog(tmp / "decisions.jsonl"))
    pipeline.advance_on_ingest = False
    sims = [NodeSim(i, seed=0, pool="h100-00") for i in range(nodes)]
    offsets = [phase_offset(i, seed=0) for i in range(nodes)]
    start = math.floor(time.time() / 300) * 300 - (rounds + 1) * INTERVAL_S
    kept: list[Callable[[], object]] = []
    for r in range(rounds + 1):
        t = start + r * INTERVAL_S
        for i, sim in enumerate(sims):
            pipeline.ingest(sim.report(t + offsets[i], round_no=r), t + offsets[i])
        last = r == rounds
        if last:
            for run in pipeline._detectors:
                run.due = -math.inf
        for step in pipeline.advance_steps(t + INTERVAL_S - 0.5):
            if isinstance(step, OffloadStep):
                if last:
                    kept.append(step._compute)
                step.run()
        print(f"round {r + 1}/{rounds + 1}", file=sys.stderr, flush=True)
    return pipeline, kept


class GcProbe:
    def __init__(self) -> None:
        self.long: list[tuple[float, int, str]] = []
        self._started: dict[int, float] = {}
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        key = threading.get_ident()
        if phase == "start":
            self._started[key] = time.perf_counter()
            return
        took = time.perf_counter() - self._started.pop(key, time.perf_counter())
        if took > GC_REPORTED_S:
            self.long.append((took, int(info["generation"]), threading.current_thread().name))


def _busy(seconds: float) -> None:
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


async def one_run(seconds: float, computes: list[Callable[[], object]] | None) -> list[float]:
    stop = threading.Event()

    def worker() -> None:
        while not stop.is_set():
            for compute in computes or ():
                compute()

    thread = threading.Thread(target=worker, name="worker", daemon=True)
    if computes:
        thread.start()
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    lags: list[float] = []

    async def probe() -> None:
        while loop.time() < end:
            asked = loop.time() + LOOP_LAG_PROBE_SECONDS
            await asyncio.sleep(LOOP_LAG_PROBE_SECONDS)
            lags.append(max(0.0, loop.time() - asked))

    async def load() -> None:
        while loop.time() < end:
            for _ in range(7):
                _busy(0.001)
                for _ in range(2):
                    a.send(b"x" * 64)
                    b.recv(64)
            await asyncio.sleep(0.02)

    try:
        await asyncio.gather(probe(), load())
    finally:
        stop.set()
        if computes:
            thread.join()
        a.close()
        b.close()
    return sorted(lags)


async def measure(args: argparse.Namespace, computes: list[Callable[[], object]]) -> list[dict[str, Any]]:
    probe = GcProbe()
    rows = []
    for i in range(args.runs + 1):
        with_worker = i > 0
        lags = await one_run(args.seconds, computes if with_worker else None)
        rows.append(
            {
                "worker_thread": with_worker,
                "samples": len(lags),
                "median_ms": round(statistics.median(lags) * 1e3, 1),
                "p99_ms": round(lags[min(len(lags) - 1, int(len(lags) * 0.99))] * 1e3, 1),
                "worst_ms": round(lags[-1] * 1e3, 1),
                "collections_over_20ms": [
                    {"ms": round(s * 1e3), "generation": g, "thread": t} for s, g, t in probe.long
                ],
            }
        )
        probe.long.clear()
        print(f"run {i + 1}/{args.runs + 1} done", file=sys.stderr, flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=3000, help="nodes in the one pool")
    p.add_argument("--rounds", type=int, default=26, help="10-s rounds before the computes are taken")
    p.add_argument("--seconds", type=float, default=40.0, help="length of each run")
    p.add_argument("--runs", type=int, default=3, help="runs with the worker thread")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        _pipeline, computes = kept_computes(args.nodes, args.rounds, Path(tmp))
        cpu = []
        for compute in computes:
            t0 = time.thread_time()
            compute()
            cpu.append(round(time.thread_time() - t0, 3))
        gc.collect()
        gc.freeze()
        rows = asyncio.run(measure(args, computes))
    print(f"{args.nodes} nodes in one pool; the worker's computes take {cpu} s of CPU each")
    print("| run | lag median | p99 | worst | full collections over 20 ms |")
    print("|---|---:|---:|---:|---|")
    for row in rows:
        long = row["collections_over_20ms"]
        gcs = ", ".join(f"{c['ms']} ms (gen {c['generation']}, {c['thread']})" for c in long) or "none"
        name = "worker thread busy" if row["worker_thread"] else "no worker thread"
        print(f"| {name} | {row['median_ms']} ms | {row['p99_ms']} ms | {row['worst_ms']} ms | {gcs} |")
    if args.json:
        result = {"nodes": args.nodes, "compute_cpu_s": cpu, "runs": rows}
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
