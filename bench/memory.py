"""Memory per node of the detection pipeline: RSS growth, Python objects, and who holds what.

Feeds ``--nodes`` simulated HGX H100 nodes (bench/_reports.py) x ``--rounds`` reports,
``--interval`` apart (10 s), through the pipeline the server builds
(``aggregator.app.build_pipeline`` with the default config and rules, at that interval). Each
report goes through the wire format first (``encode`` then ``decode``), as the server receives
it: a decoded report owns its strings, a simulated one shares them with the simulator.

Reported, per node, between a baseline taken before the first report (the simulators and the
pipeline's fixed state exist by then) and the end:

- RSS growth (/proc/self/status VmRSS), the figure docs/performance.md quotes, and the same once
  glibc's ``malloc_trim`` has handed the heap's free memory back, as the service does every
  minute (aggregator/heap.py);
- growth of ``gc.get_objects()`` (objects the cyclic collector tracks: what a full collection
  walks, so what GC pauses scale with);
- with ``--holders``, the memory each part of the pipeline holds at the end (a walk of its object
  graph with ``sys.getsizeof``; an object reachable from two parts counts for the first listed);
- with ``--tracemalloc``, the allocation sites (file:line) still holding the most memory;
- with ``--tracked N``, the tracked objects grown per node and the references a full collection
  visits from them, with the N types that visit most (what to make untracked, or an array, to
  shorten a full collection);
- with ``--time-rounds M``, M more rounds with the CPU of ``Pipeline.ingest`` timed (the reports of
  each round built first, then ingested under ``time.process_time``): median per report; with
  ``--split`` also the time inside each part of the per-report path (a ``perf_counter`` around
  the node history's ``add``, the pool frames' ``record``, the rule engine's ``evaluate`` and the
  pool lookup from GPU models), median per report over the rounds: the parts' shares move much
  less with this VM's load than the totals.

The default (100 nodes x 185 rounds: the 1,800-s history window full) runs in about a minute
on a laptop core.

    nice -n 10 .venv/bin/python bench/memory.py --holders
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
import tracemalloc
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from types import FunctionType, MethodType, ModuleType
from typing import Any

import msgspec
import numpy as np
from _reports import NodeSim, phase_offset, sending_order

import aggregator.pipeline as pipeline_module
from agent.report import Report, decode, encode
from aggregator.app import build_pipeline
from aggregator.config import FleetConfig
from aggregator.configload import load_config
from aggregator.heap import malloc_trim
from aggregator.pipeline import Pipeline
from aggregator.rules import default_rules_dir, load_rules

INTERVAL = 10.0
START = 1_800_000_000.0


def rss_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


_SKIP = (type, ModuleType, FunctionType, MethodType)


def deep_size(roots: Iterable[object], seen: set[int]) -> int:
    """Bytes of everything reachable from ``roots`` not in ``seen`` (which it extends)."""
    total = 0
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _SKIP):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        if isinstance(obj, msgspec.Struct):
            # The report types are gc=False structs: the collector cannot see into them.
            stack.extend(getattr(obj, f) for f in obj.__struct_fields__)
        elif isinstance(obj, np.ndarray):
            # A view's size leaves out its data, which its base owns (the pool frames' slots).
            if obj.base is not None:
                stack.append(obj.base)
        else:
            stack.extend(gc.get_referents(obj))
    return total


class SimulatedFleet:
    """``nodes`` simulated H100 nodes and the pipeline the server builds (default config and
    rules); each report goes through the wire format first, as the server receives it."""

    def __init__(self, nodes: int, interval: float = INTERVAL) -> None:
        # The defaults, at the fleet's interval (the frames' slot; silence follows it).
        config = msgspec.structs.replace(load_config(None), fleet=FleetConfig(interval_seconds=interval))
        self.pipeline = build_pipeline(config, load_rules([default_rules_dir()]))
        self.interval = interval
        self.sims = [NodeSim(i, interval=interval) for i in range(nodes)]
        self.offsets = [phase_offset(i) for i in range(nodes)]
        self.order = sending_order(nodes)

    def report(self, i: int, r: int) -> Report:
        """Node ``i``'s report of round ``r``, as the simulator makes it."""
        return self.sims[i].report(START + r * self.interval + self.offsets[i], r)

    def round(self, r: int) -> list[Report]:
        """Round ``r``'s reports in sending order, decoded from the wire."""
        return [decode(encode(self.report(i, r))) for i in self.order]

    def feed(self, r: int) -> None:
        """Ingest round ``r``, one report at a time as they are made."""
        for i in self.order:
            report = decode(encode(self.report(i, r)))
            self.pipeline.ingest(report, report.time)


def holders(pipeline: Pipeline) -> list[tuple[str, int]]:
    """What each part of the pipeline holds, most specific first (see the module docstring)."""
    seen: set[int] = set()
    # Shared, fixed state is not per node: the config, the rules, interned names.
    deep_size([pipeline.config, pipeline.engine.rules], seen)
    parts: list[tuple[str, list[object]]] = []
    fleet = pipeline.fleet
    hists = [fleet.history(n) for n in fleet.nodes()]
    parts.append(("history: latest report", [h.latest for h in hists if h is not None]))
    parts.append(("history: previous report", [h._previous for h in hists if h is not None]))
    parts.append(("history: series and rows", [h for h in hists if h is not None]))
    frames = pipeline.frames
    parts.append(("frames (pool columns)", [frames]))
    parts.append(("node records", [pipeline._nodes]))
    parts.append(("rule engine state", [pipeline.engine]))
    parts.append(("health machine", [pipeline.health]))
    for run in pipeline._detectors:
        parts.append((f"detector {run.name}", [run]))
    parts.append(("silence detector", [pipeline.silence]))
    parts.append(("rest of the pipeline", [pipeline.__dict__]))
    return [(name, deep_size(roots, seen)) for name, roots in parts]


def tracked_types() -> tuple[Counter[str], Counter[str]]:
    """Objects the cyclic collector tracks, by type (module-qualified), and the references a
    collection visits from them (every item of a list or dict, none inside an array)."""
    count: Counter[str] = Counter()
    visits: Counter[str] = Counter()
    for o in gc.get_objects():
        t = f"{type(o).__module__}.{type(o).__qualname__}"
        count[t] += 1
        visits[t] += len(gc.get_referents(o))
    return count, visits


def _time_parts(pipeline: Pipeline) -> dict[str, float]:
    """Wrap the parts of the per-report path in timers; the seconds each spent, updated as they run."""
    spent: dict[str, float] = {}

    def timed(name: str, fn: Any) -> Any:
        spent[name] = 0.0

        def run(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t

        return run

    pipeline.fleet.add = timed("node history (Fleet.add)", pipeline.fleet.add)  # type: ignore[method-assign]
    pipeline.frames.record = timed("pool frames (FleetFrames.record)", pipeline.frames.record)  # type: ignore[method-assign]
    pipeline.engine.evaluate = timed("rule engine (RuleEngine.evaluate)", pipeline.engine.evaluate)  # type: ignore[method-assign]
    # The pool lookup is called through the pipeline module's namespace.
    pipeline_module.gpu_model_pool = timed("pool from GPU models", pipeline_module.gpu_model_pool)
    return spent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument(
        "--interval", type=float, default=INTERVAL, help="the fleet's report interval, s (default 10)"
    )
    ap.add_argument(
        "--rounds",
        type=int,
        help="reports per node, --interval apart (default: the history window full, and 5 more: 185 at 10 s)",
    )
    ap.add_argument("--holders", action="store_true", help="walk the pipeline: who holds what")
    ap.add_argument("--tracemalloc", type=int, default=0, metavar="N", help="top N allocation sites")
    ap.add_argument("--tracked", type=int, default=0, metavar="N", help="top N tracked types grown")
    ap.add_argument(
        "--time-rounds",
        type=int,
        default=0,
        metavar="M",
        help="then M more rounds, CPU per Pipeline.ingest timed (median over rounds)",
    )
    ap.add_argument("--split", action="store_true", help="with --time-rounds: time each part too")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    if args.rounds is None:
        args.rounds = math.ceil(FleetConfig().window_seconds / args.interval) + 5

    fleet = SimulatedFleet(args.nodes, args.interval)
    pipeline, feed = fleet.pipeline, fleet.feed

    t0 = time.perf_counter()
    if args.tracemalloc:
        tracemalloc.start()
    gc.collect()
    rss0, objs0 = rss_bytes(), len(gc.get_objects())
    types0, visits0 = tracked_types() if args.tracked else (Counter[str](), Counter[str]())
    checkpoints: dict[int, tuple[int, int]] = {}
    for r in range(args.rounds):
        feed(r)
        if r in {4, args.rounds - 1}:
            gc.collect()
            checkpoints[r + 1] = (rss_bytes() - rss0, len(gc.get_objects()) - objs0)
    elapsed = time.perf_counter() - t0
    # What the service hands back to the system every minute (aggregator/heap.py): freed memory
    # that malloc keeps in the middle of its heap.
    trim = malloc_trim()
    trimmed = None
    if trim is not None:
        trim()
        trimmed = rss_bytes() - rss0
    n = args.nodes
    out: dict[str, Any] = {
        "nodes": n,
        "interval_s": args.interval,
        "rounds": args.rounds,
        "seconds": round(elapsed, 1),
        "tracemalloc": bool(args.tracemalloc),
        "after_rounds": {
            str(k): {"rss_kb_per_node": round(v[0] / n / 1024, 1), "gc_objects_per_node": round(v[1] / n)}
            for k, v in checkpoints.items()
        },
        "rss_kb_per_node_trimmed": round(trimmed / n / 1024, 1) if trimmed is not None else None,
    }
    print(
        f"{n} nodes x {args.rounds} rounds {args.interval:g} s apart in {elapsed:.1f} s "
        "(growth from before the first report)"
    )
    for k, (rss, objs) in checkpoints.items():
        print(
            f"  after {k:4d} reports/node: RSS {rss / n / 1024:8.1f} KB/node"
            f"   gc objects {objs / n:8.0f}/node"
        )
    if trimmed is not None:
        print(f"  then malloc_trim (the service's, every minute): RSS {trimmed / n / 1024:8.1f} KB/node")
    if args.tracemalloc:
        snap = tracemalloc.take_snapshot()
        tracemalloc.stop()
        stats = snap.statistics("lineno")
        total = sum(s.size for s in stats)
        print(f"tracemalloc: {total / n / 1024:.1f} KB/node still held")
        for s in stats[: args.tracemalloc]:
            frame = s.traceback[0]
            where = f"{Path(frame.filename).name}:{frame.lineno}"
            print(f"  {s.size / n / 1024:8.1f} KB/node  {s.count / n:7.0f} blocks/node  {where}")
    if args.tracked:
        types1, visits1 = tracked_types()
        grown, visited = types1 - types0, visits1 - visits0
        out["tracked_per_node"] = {t: round(c / n, 1) for t, c in grown.most_common(args.tracked)}
        out["visits_per_node"] = round(sum(visited.values()) / n)
        print(
            f"tracked objects grown, per node: {sum(grown.values()) / n:.1f}, visiting "
            f"{sum(visited.values()) / n:.0f} references (top {args.tracked} types by visits):"
        )
        for t, v in visited.most_common(args.tracked):
            print(f"  {v / n:8.1f} visits  {grown[t] / n:6.1f} objects  {t}")
    if args.holders:
        out["holders_kb_per_node"] = {}
        print("held at the end (object-graph walk), per node:")
        for name, size in holders(pipeline):
            out["holders_kb_per_node"][name] = round(size / n / 1024, 1)
            print(f"  {size / n / 1024:8.1f} KB  {name}")
        total = sum(out["holders_kb_per_node"].values())
        out["holders_kb_per_node"]["total"] = round(total, 1)
        print(f"  {total:8.1f} KB  total")
    if args.time_rounds:
        per_report: list[float] = []
        parts: dict[str, list[float]] = {}
        spent = _time_parts(pipeline) if args.split else {}
        for r in range(args.rounds, args.rounds + args.time_rounds):
            reports = fleet.round(r)
            gc.collect()
            for k in spent:
                spent[k] = 0.0
            started = time.process_time()
            for report in reports:
                pipeline.ingest(report, report.time)
            per_report.append((time.process_time() - started) / len(reports) * 1e6)
            for k, v in spent.items():
                parts.setdefault(k, []).append(v / len(reports) * 1e6)
        out["ingest_us_per_report_median"] = round(statistics.median(per_report))
        print(
            f"Pipeline.ingest: median {statistics.median(per_report):.0f} us/report CPU over "
            f"{args.time_rounds} rounds after {args.rounds}"
        )
        if parts:
            out["parts_us_per_report_median"] = {k: round(statistics.median(v), 1) for k, v in parts.items()}
            for k, v in parts.items():
                print(f"  {statistics.median(v):7.1f} us/report  {k}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
