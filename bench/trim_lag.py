"""The event loop's lag while freed memory is handed back to the system (aggregator/heap.py).

glibc's ``malloc_trim(0)`` holds each malloc arena's lock while it walks that arena's free chunks
and releases their pages. The service calls it once a minute in a worker thread, off the event
loop; but the loop's own thread allocates from the same arena at every report (a report's body,
its GPU structs and NIC counter dicts are larger than CPython's small-object allocator takes), so
it may wait for that lock, holding the interpreter lock meanwhile, for as long as the trim walks.

This bench measures it on the pipeline's own heap. ``--nodes`` simulated HGX H100 nodes x
``--rounds`` reports go through the pipeline the server builds (``build_pipeline`` with the
default config and rules; each report encoded and decoded first, as memory.py does), which leaves
the heap as a running aggregator has it. Then an event loop keeps ingesting the following rounds
(compact bodies made ahead, decoded at ingest as the server does), a few reports per turn, with a
lag probe (a 2 ms sleep, its overshoot), for ``--seconds``, while the heap is trimmed as
``--trim`` says:

- ``thread``: the service's own ``trim_periodically`` every ``--every`` seconds (``malloc_trim(0)``
  in a worker thread);
- ``none``: never.

``--young-every S`` adds an experiment the service does not make: a collection of the youngest
generation every S seconds on the loop (CPython's own still run), to see what slicing them buys.

Printed: the allocator (glibc, or jemalloc when preloaded with ``LD_PRELOAD``), RSS per node
before and after, each trim's time and what it released, and the loop's worst lag while a trim
ran and while none did.

    nice -n 5 .venv/bin/python bench/trim_lag.py --nodes 2000 --rounds 60 --trim thread
    nice -n 5 .venv/bin/python bench/trim_lag.py --nodes 2000 --rounds 60 --trim none
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memory import SimulatedFleet

from agent.wire import decode_compact, encode_compact
from aggregator.heap import allocator, malloc_trim, resident_bytes, trim_periodically

PROBE_S = 0.002
BATCH = 4  # reports ingested per turn of the loop


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=60, help="reports per node before the loop starts")
    ap.add_argument("--seconds", type=float, default=30.0, help="how long the loop runs")
    ap.add_argument("--trim", choices=("thread", "none"), default="thread")
    ap.add_argument("--every", type=float, default=5.0, help="seconds between trims")
    ap.add_argument(
        "--collections",
        action="store_true",
        help="also time every garbage collection during the loop, by generation, with how many objects "
        "the youngest held when one began (counting them costs a little)",
    )
    ap.add_argument(
        "--young-every",
        type=float,
        default=0.0,
        help="an experiment the service does not make: collect the youngest generation every this "
        "many seconds on the loop, besides CPython's own collections (0: CPython's alone)",
    )
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)

    fleet = SimulatedFleet(args.nodes)
    pipeline = fleet.pipeline
    rss0 = resident_bytes() or 0
    t0 = time.perf_counter()
    for r in range(args.rounds):
        fleet.feed(r)
    built_s = time.perf_counter() - t0
    rss_built = (resident_bytes() or 0) - rss0
    # The loop's reports, made ahead so that the loop spends its time as the server does: enough
    # to keep it ingesting for the whole run (it takes well under 2,500 reports a second here).
    loop_rounds = math.ceil(args.seconds * 2500 / args.nodes) + 1
    bodies = [
        encode_compact(fleet.report(i, r))
        for r in range(args.rounds, args.rounds + loop_rounds)
        for i in fleet.order
    ]
    print(
        f"{args.nodes} nodes x {args.rounds} rounds in {built_s:.0f} s; allocator {allocator()}; "
        f"RSS {rss_built / args.nodes / 1024:.0f} KB a node",
        file=sys.stderr,
    )
    # In the service the fleet detectors run on their own tick, their pool computes in a worker
    # thread (aggregator/service.py), not on every report: off here, the lag is the ingest's.
    pipeline.advance_on_ingest = False
    # And the service freezes the warm fleet's heap (aggregator/heap.py), so that a full collection
    # walks only what is newer: so here, or the collector's pauses would hide the trim's.
    gc.collect()
    gc.freeze()
    result = asyncio.run(_loop(pipeline, bodies, args))
    result.update(
        nodes=args.nodes,
        rounds=args.rounds,
        trim=args.trim,
        young_every_s=args.young_every,
        every_s=args.every,
        allocator=allocator(),
        rss_kb_per_node_before=round(rss_built / args.nodes / 1024, 1),
        rss_kb_per_node_after=round(((resident_bytes() or 0) - rss0) / args.nodes / 1024, 1),
    )
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


async def _loop(pipeline: Any, bodies: list[bytes], args: argparse.Namespace) -> dict[str, Any]:
    trim = malloc_trim() if args.trim == "thread" else None
    trims: list[tuple[float, float, int]] = []  # (start, end, bytes released)
    lags: list[tuple[float, float]] = []  # (when the probe woke, its overshoot)
    stop = time.perf_counter() + args.seconds
    ingested = 0

    async def feed() -> None:
        nonlocal ingested
        while time.perf_counter() < stop and ingested < len(bodies):
            for body in bodies[ingested : ingested + BATCH]:
                report = decode_compact(body)
                pipeline.ingest(report, report.time)
            ingested += BATCH
            await asyncio.sleep(0)

    async def probe() -> None:
        while time.perf_counter() < stop:
            asked = time.perf_counter()
            await asyncio.sleep(PROBE_S)
            woke = time.perf_counter()
            lags.append((woke, woke - asked - PROBE_S))

    class Trims:
        """What ``trim_periodically`` reports of each trim, dated: it reports as the trim ends."""

        def heap_trim(self, seconds: float, released_bytes: int) -> None:
            end = time.perf_counter()
            trims.append((end - seconds, end, released_bytes))

    async def collect_young(every: float) -> None:
        while True:
            await asyncio.sleep(every)
            gc.collect(0)

    async def measured() -> None:
        # The service's trimming, stopped with the feed and the probe.
        background = [asyncio.create_task(trim_periodically(Trims(), trim=trim, interval_s=args.every))]
        if args.young_every > 0:
            background.append(asyncio.create_task(collect_young(args.young_every)))
        try:
            await asyncio.gather(feed(), probe())
        finally:
            for task in background:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    collections: list[tuple[int, float, int]] = []  # (generation, ms, objects in generation 0)
    began: list[float] = [0.0]
    young: list[int] = [0]

    def on_collection(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            young[0] = len(gc.get_objects(0)) if info["generation"] == 0 else -1
            began[0] = time.perf_counter()
        else:
            collections.append((info["generation"], (time.perf_counter() - began[0]) * 1000, young[0]))

    if args.collections:
        gc.callbacks.append(on_collection)
    try:
        await measured()
    finally:
        if args.collections:
            gc.callbacks.remove(on_collection)

    def during(t: float) -> bool:
        # A lag is the trim's when the probe woke during it or within its overshoot after it.
        return any(a <= t <= b + 0.05 for a, b, _ in trims)

    in_trim = [lag for t, lag in lags if during(t)]
    outside = [lag for t, lag in lags if not during(t)]
    ms = [round(lag * 1000, 1) for lag in sorted(outside)]
    by_generation: dict[str, Any] = {}
    for g in (0, 1, 2):
        times = sorted(t for gen, t, _ in collections if gen == g)
        if times:
            by_generation[str(g)] = {
                "count": len(times),
                "over_5_ms": sum(t > 5 for t in times),
                "worst_ms": round(times[-1], 2),
                "median_ms": round(statistics.median(times), 2),
                "total_ms": round(sum(times), 1),
            }
    slow_young = [n for gen, t, n in collections if gen == 0 and t > 5]
    return {
        "collections": by_generation if args.collections else None,
        "young_objects_at_slow_gen0": sorted(slow_young)[-5:] if args.collections else None,
        "reports_ingested": min(ingested, len(bodies)),
        "reports_left": max(0, len(bodies) - ingested),  # 0: the loop ran out before the end
        "trims_ms": [round((b - a) * 1000, 1) for a, b, _ in trims],
        "trims_released_mb": [round(r / 2**20, 1) for _, _, r in trims],
        "lag_worst_during_trim_ms": round(max(in_trim) * 1000, 1) if in_trim else None,
        "lag_worst_outside_trim_ms": ms[-1] if ms else None,
        "lag_p99_outside_trim_ms": ms[int(len(ms) * 0.99)] if ms else None,
        "lag_median_ms": round(statistics.median(lag for _, lag in lags) * 1000, 2) if lags else None,
    }


if __name__ == "__main__":
    sys.exit(main())
