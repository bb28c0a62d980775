"""The forest's pool run inline (on the event loop) against offloaded (prepare on the loop, compute
in a worker thread), and the loop's lag while the compute runs beside it.

Run from the repository root::

    nice -n 10 .venv/bin/python bench/forest_offload.py [--nodes 1000]

Builds one pool frame of ``--nodes`` H100 nodes (8 GPUs, 10 minutes of 10-s slots, loaded, with
healthy noise) directly, then prints: the CPU time of the inline ``run_pool`` (what the loop was
held for before the split), of ``prepare_pool`` (what it is held for now), and, with an asyncio
loop whose only other task is a 10-ms sleep probe, the compute's wall time in a one-thread
executor and the probe's lag over it (p50, p99, worst). Best of ``--repeat`` for the CPU times.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np

from aggregator.detect.forest import ForestDetector
from aggregator.fleet.frame import GPU_COLUMN as C
from aggregator.fleet.frame import GPU_FIELDS, PoolFrame

T = TypeVar("T")
NOW = 600.0


def build(nodes: int) -> PoolFrame:
    rng = np.random.default_rng(0)
    frame = PoolFrame("big", interval_s=10.0, slots=60, gpus=8, initial_rows=nodes)
    base = np.full((nodes, 8, len(GPU_FIELDS)), np.nan, np.float32)
    base[..., C["utilization_ratio"]] = 0.95
    base[..., C["power_limit_watts"]] = 700.0
    base[..., C["pcie_link_width_ratio"]] = 1.0
    for col in ("hw_slowdown", "hw_thermal", "power_brake", "sw_thermal"):
        base[..., C[col]] = 0.0
    empty = np.zeros((0, 0), np.float32)
    for t in np.arange(0.0, NOW, 10.0):
        block = base.copy()
        block[..., C["sm_clock_ratio"]] = 0.95 + rng.normal(0, 0.01, (nodes, 8))
        block[..., C["temperature_celsius"]] = np.round(65 + rng.normal(0, 3, (nodes, 8)))
        block[..., C["memory_temperature_celsius"]] = np.round(70 + rng.normal(0, 3, (nodes, 8)))
        block[..., C["power_watts"]] = 600 + rng.normal(0, 40, (nodes, 8))
        for i in range(nodes):
            frame.write(f"n{i:05d}", float(t), block[i], [], empty)
    return frame


def cpu_ms(f: Callable[[], T], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.thread_time()
        f()
        best = min(best, time.thread_time() - t0)
    return best * 1e3


async def offloaded(frame: PoolFrame, detector: ForestDetector) -> str:
    loop = asyncio.get_running_loop()
    lags: list[float] = []
    running = True

    async def probe() -> None:
        while running:
            asked = loop.time() + 0.01
            await asyncio.sleep(0.01)
            lags.append(loop.time() - asked)

    task = asyncio.create_task(probe())
    await asyncio.sleep(0.2)
    lags.clear()
    with ThreadPoolExecutor(max_workers=1) as executor:
        work = detector.prepare_pool(frame, NOW)
        t0 = time.perf_counter()
        result = await loop.run_in_executor(executor, work.compute)
        wall = time.perf_counter() - t0
        work.finish(result)
    running = False
    await task
    lags.sort()
    return (
        f"compute in the worker thread {wall * 1e3:.0f} ms wall; the loop's lag meanwhile "
        f"p50 {lags[len(lags) // 2] * 1e3:.1f} ms, p99 {lags[int(len(lags) * 0.99)] * 1e3:.1f} ms, "
        f"worst {lags[-1] * 1e3:.1f} ms ({len(lags)} samples of a 10-ms sleep)"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    frame = build(args.nodes)
    detector = ForestDetector()
    inline = cpu_ms(lambda: detector.run_pool(frame, NOW), args.repeat)
    prepare = cpu_ms(lambda: detector.prepare_pool(frame, NOW), args.repeat)
    head = f"{args.nodes} nodes, one pool: inline run_pool {inline:.0f} ms CPU;"
    print(f"{head} prepare_pool {prepare:.1f} ms CPU")
    print(asyncio.run(offloaded(frame, detector)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
