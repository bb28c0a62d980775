"""The status page's render cost at fleet scale: every page for a fleet of 7,500 nodes.

Run from the repository root (about 2 minutes on 2 shared cores; nothing leaves the process)::

    .venv/bin/python bench/status_page.py [--nodes 7500] [--rounds 3] [--repeat 15] [--json FILE]

What it does:

1. Builds ``--rounds`` realistic reports of each of ``--nodes`` nodes (``bench/_reports.py``: 8
   H100 GPUs, 8 NDR ports; a GPU falling off the bus, hot GPUs, a silent stretch of nodes) and
   ingests them into the real pipeline, default config and rules. Then adds 10,000 decisions
   (the decision log's in-memory window, what the feed reads) and pair probe results for 400 pairs
   of the first pool, so every page has its full load.
2. Renders each page ``--repeat`` times in process (``aggregator.web.status.StatusView``, exactly
   what the route handlers call; no HTTP, so the figure is the page's own CPU) and reports the
   median and the slowest render, and the HTML size. Each render reads the fleet afresh (the
   first browser in ``NODES_TTL_S``); the last rows are the renders that find it read already.

Markdown goes to stdout, progress to stderr; ``--json FILE`` writes every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.chdir(Path(__file__).resolve().parents[1])

import msgspec  # noqa: E402
from _reports import Fault, FaultKind, fleet_reports, node_name  # noqa: E402

from agent.clock import FakeClock  # noqa: E402
from agent.report import Probe, Report  # noqa: E402
from aggregator.config import Config  # noqa: E402
from aggregator.decisions import Decision, DecisionLog, Reason  # noqa: E402
from aggregator.pipeline import Pipeline  # noqa: E402
from aggregator.rules import default_rules_dir, load_rules  # noqa: E402
from aggregator.web.status import StatusView  # noqa: E402

START = 1_764_441_600.0


def build(nodes: int, rounds: int) -> tuple[Pipeline, FakeClock]:
    config = Config()
    decisions = DecisionLog(None)
    pipeline = Pipeline(config, load_rules([default_rules_dir()]), decisions)
    faults = [Fault(3, FaultKind.XID_79, 1), Fault(10, FaultKind.HOT_GPU, 0)]
    faults += [Fault(i, FaultKind.SILENT, 1) for i in range(40, 48)]
    last = START
    t0 = time.perf_counter()
    sample: Report | None = None
    for i, report in enumerate(fleet_reports(nodes, rounds, start=START, interval=30.0, faults=faults)):
        pipeline.ingest(report, report.time)
        last = max(last, report.time)
        sample = sample or report
        if i % 5000 == 0:
            print(f"  ingested {i} reports ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    # Reports 30 s apart, so that three rounds make the silent nodes (quiet from the second)
    # silent for longer than silence.silent_after_seconds while everyone else is fresh.
    now = last + 5.0
    pipeline.advance(now)
    for k in range(10_000):
        node = node_name(k % nodes)
        pipeline.decisions.append(
            Decision(
                time=now - 10_000 + k,
                subject="node",
                node=node,
                state="suspect" if k % 2 else "healthy",
                previous="healthy" if k % 2 else "suspect",
                action="none",
                reasons=[Reason(detector="rule", severity="warning", summary=f"bench decision {k} on {node}")]
                if k % 2
                else [],
            )
        )
    # Pair probe results as the nodes report them: 400 pairs among 80 nodes, one of them slow.
    assert sample is not None
    for k in range(400):
        a, b = node_name(k % 80), node_name((k * 7 + 1) % 80)
        if a == b:
            continue
        probe = Probe(
            kind="nccl_allreduce_pair",
            time=now - 400 + k,
            ok=True,
            peer=b,
            size_bytes=1 << 30,
            busbw_bytes_per_second=3.5e11 * (0.5 if k == 7 else 1.0),
        )
        report = msgspec.structs.replace(sample, node=a, probes=[probe])
        placement = pipeline.placement(a)
        assert placement is not None
        pipeline.links.observe(report, placement, now - 400 + k)
    return pipeline, FakeClock(now)


def measure(render: Callable[[], object], repeat: int) -> dict[str, float]:
    times = []
    size = 0
    for _ in range(repeat):
        t = time.perf_counter()
        out = render()
        times.append((time.perf_counter() - t) * 1000)
        size = len(out) if isinstance(out, str) else len(json.dumps(out))
    return {"median_ms": statistics.median(times), "max_ms": max(times), "bytes": size}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=7500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    print(f"building a fleet of {args.nodes} nodes, {args.rounds} reports each", file=sys.stderr)
    pipeline, clock = build(args.nodes, args.rounds)
    # No cache: every render reads the whole fleet, the cost of the first browser in 2 s.
    view = StatusView(pipeline, pipeline.config, clock, nodes_ttl_s=0.0)
    cached = StatusView(pipeline, pipeline.config, clock)
    last_page = str((args.nodes + 99) // 100)
    pages: dict[str, Callable[[], object]] = {
        "GET / (the fleet at a glance)": view.glance,
        "GET /nodes (page 1 of 100)": lambda: view.node_list({}),
        f"GET /nodes?page={last_page}": lambda: view.node_list({"page": last_page}),
        "GET /nodes?q=gpu-0004 (search)": lambda: view.node_list({"q": "gpu-0004"}),
        "GET /nodes?state=quarantined": lambda: view.node_list({"state": "quarantined"}),
        "GET /nodes/gpu-00003 (a quarantined node)": lambda: view.node_page("gpu-00003"),
        "GET /decisions (10,000 in the window)": lambda: view.decision_feed({}),
        "GET /systemic": view.systemic_page,
        "GET /links (400 pairs)": lambda: view.links_page({}),
        "GET /probes": view.probes_page,
        "GET /api/v1/summary (JSON)": view.summary,
        "pipeline.nodes() alone": pipeline.nodes,
        "GET / again within 2 s (nodes read once)": cached.glance,
        "GET /nodes?page=2 within 2 s": lambda: cached.node_list({"page": "2"}),
    }
    results = {}
    for name, render in pages.items():
        print(f"  {name}", file=sys.stderr)
        results[name] = measure(render, args.repeat)
    print(f"\nStatus page render cost, {args.nodes} nodes, {args.repeat} renders each, in process:\n")
    print("| page | median ms | slowest ms | HTML bytes |")
    print("|---|---:|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r['median_ms']:.1f} | {r['max_ms']:.1f} | {r['bytes']:,} |")
    if args.json is not None:
        args.json.write_text(
            json.dumps({"nodes": args.nodes, "repeat": args.repeat, "pages": results}, indent=2)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
