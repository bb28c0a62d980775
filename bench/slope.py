"""Ingest as the fleet grows: CPU per report, memory per node and event-loop lag at 1k to 100k nodes.

Run from the repository root (loopback only; every process it starts is stopped, also on
failure; about 10 minutes for the default sizes on 2 cores)::

    nice -n 10 .venv/bin/python bench/slope.py [--sizes 1000,7500,25000,100000] [--json FILE]

For each fleet size, one after another, with what ``bench/ingest.py`` does for one size:

1. The reports are generated ahead (``bench/_reports.py``: HGX H100 nodes, 8 GPUs x 18 NVLinks,
   8 NDR ports x 52 counters) in the compact encoding agents send (msgpack, no gzip), in pools of
   ``--pool-nodes`` nodes: ``--warmup-rounds`` rounds (3) that are not measured, ``--reports``
   measured reports (whole rounds, at least one), and ``--paced-seconds`` of paced rounds. The
   warm-up is rounds, not reports, because a node's first reports cost more than the later ones
   (its history's series are created then): with one warm-up round the measured reports of a
   large fleet would be its nodes' second, those of a small one their tenth.
2. In this process, on the core the server will use, the decode ceilings of both wire formats in
   the same minutes: one round of ``--decode-sample`` nodes as compact bodies and as gzip'd JSON,
   each decoded as the server does (bounded gunzip, then ``decode`` / ``decode_compact``).
3. ``gpuwarden aggregator`` (default config and rules, static tokens) pinned to one core, the
   load from another process on the other core over 127.0.0.1: the warm-up round, the measured
   rounds closed loop (the server's CPU per report, all its threads: reports/s per core; and
   split, from /proc/PID/task: its event-loop thread's CPU per report, and its other threads'
   per second, mostly the fleet detectors' pool computes, which run on the clock whatever the
   rate of reports), then
   the paced rounds open loop at the fleet's own rate at a 10 s interval, capped at
   ``--paced-cap`` reports/s (what this machine's one core can keep up with; the interval that
   rate means is printed). Its event-loop lag over the paced phase comes from its own metrics.
4. *A core at 10 s*: the share of one core this fleet would take reporting every 10 s, estimated
   as nodes / 10 s x the loop thread's CPU per report + the other threads' share (the target is
   a fleet of 25,000 nodes in half a core). In the closed loop a large fleet's rounds take longer
   than their 10 s, so the detector work per second is spread over fewer reports there: that is
   why the all-thread CPU per report grows with the fleet, and why the split is given.
5. Memory per node: the server's resident memory at the end less that when it was ready (before
   the first report), over the nodes. A node has sent only a few reports by then, so its history
   is far from full: ``bench/memory.py`` gives the full-history figure.

A size whose server and reports would not fit in this machine's available memory (estimated from
the previous size's memory per node) is skipped, and the table says why. Sizes run in the order
given; the ratio columns (CPU per report over the decode of the same format in the same run) are
what compares across machines.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from _common import cpu_model
from _reports import NodeSim, phase_offset
from ingest import (
    INTERVAL_S,
    WIRES,
    BenchError,
    HttpRun,
    build_workload,
    decode_body,
    http_run,
    load_server_setup,
    pinned,
    pool_of,
    server_and_load_cores,
)

from agent.shipper import encode_body

log = logging.getLogger("bench.slope")

DEFAULT_SIZES = (1000, 7500, 25000, 100000)
# Before any size has run, a node is taken to need this much server memory (bench/memory.py's
# figure after a few reports, rounded up), plus the process's own.
FIRST_GUESS_KB_PER_NODE = 300.0
SERVER_BASE_MB = 300.0
HEADROOM = 0.85  # of MemAvailable that a size may plan to use
BODY_KB = 5.0  # a compact H100 report on the wire: 4.9 KB (docs/performance.md, "Wire format")


@dataclass
class SizeResult:
    nodes: int
    pools: int
    skipped: str | None = None
    measured_reports: int = 0
    reports_per_node: int = 0  # reports a node had sent by the end (warm-up, measured, paced)
    compact_decode_us: float | None = None
    json_decode_us: float | None = None
    server_cpu_us_per_report: float | None = None
    per_core: float | None = None
    in_decodes: float | None = None  # server CPU per report over the compact decode's
    loop_cpu_us_per_report: float | None = None  # the event-loop thread's share of it
    threads_cpu_share: float | None = None  # the other threads' CPU (detector computes), of a core
    core_at_10s: float | None = None  # estimated share of a core this fleet takes at a 10 s interval
    rss_ready_mb: float | None = None
    rss_end_mb: float | None = None
    kb_per_node: float | None = None
    paced_rate: float | None = None
    paced_interval_s: float | None = None
    paced_p99_ms: float | None = None
    lag_p99_ms: float | None = None
    lag_worst_ms: float | None = None
    wall_s: float | None = None
    refused: dict[str, int] | None = None


def mem_available_mb() -> float:
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024.0
    raise BenchError("no MemAvailable in /proc/meminfo")


def decode_ceilings(nodes: int, *, seed: int, pool_nodes: int, runs: int = 5) -> dict[str, float]:
    """CPU per report of decoding one round of ``nodes`` nodes, each wire format (median of runs)."""
    config, _ = load_server_setup()
    limit = config.ingest.max_decompressed_bytes
    start = time.time()
    reports = [
        NodeSim(i, seed=seed, interval=INTERVAL_S, pool=pool_of(i, pool_nodes)).report(
            start + phase_offset(i, seed=seed), 0
        )
        for i in range(nodes)
    ]
    out: dict[str, float] = {}
    for wire in WIRES:
        bodies = [encode_body(r, compact=wire == "compact") for r in reports]
        spent = []
        for _ in range(runs):
            t0 = time.process_time()
            for b in bodies:
                decode_body(b, limit)
            spent.append((time.process_time() - t0) / len(bodies) * 1e6)
        out[wire] = statistics.median(spent)
    return out


def run_size(
    nodes: int, args: argparse.Namespace, tmp: Path, *, server_core: int, load_core: int, kb_per_node: float
) -> SizeResult:
    pools = 1 if args.pool_nodes <= 0 else math.ceil(nodes / args.pool_nodes)
    res = SizeResult(nodes=nodes, pools=pools)
    measured_rounds = max(1, math.ceil(args.reports / nodes))
    paced_rate = min(nodes / INTERVAL_S, args.paced_cap)
    paced_rounds = math.ceil(paced_rate * args.paced_seconds / nodes) if args.paced_seconds > 0 else 0
    rounds = args.warmup_rounds + measured_rounds + paced_rounds
    # The bodies live in this process and in the load process (forked: shared until touched).
    need_mb = SERVER_BASE_MB + nodes * kb_per_node / 1024.0 + 2 * nodes * rounds * BODY_KB / 1024.0
    have_mb = mem_available_mb()
    if need_mb > HEADROOM * have_mb:
        res.skipped = (
            f"needs about {need_mb / 1024:.1f} GB at {kb_per_node:.0f} KB a node; "
            f"{have_mb / 1024:.1f} GB available"
        )
        log.warning("%d nodes skipped: %s", nodes, res.skipped)
        return res
    t0 = time.perf_counter()
    work = build_workload(
        nodes,
        args.warmup_rounds,
        measured_rounds,
        paced_rounds,
        seed=args.seed,
        workers=2,
        wire="compact",
        pool_nodes=args.pool_nodes,
    )
    log.info("%d nodes: %d reports built in %.0f s", nodes, rounds * nodes, time.perf_counter() - t0)
    with pinned(server_core):
        ceilings = decode_ceilings(min(nodes, args.decode_sample), seed=args.seed, pool_nodes=args.pool_nodes)
    res.compact_decode_us, res.json_decode_us = ceilings["compact"], ceilings["json"]
    wall_bound = (len(work.warmup) + len(work.measured)) / 200.0 + args.paced_seconds * 1.5 + 120.0
    t0 = time.perf_counter()
    run: HttpRun = http_run(
        work,
        tmp,
        server_core=server_core,
        load_core=load_core,
        concurrency=args.concurrency,
        max_seconds=wall_bound,
        paced_rate=paced_rate if paced_rounds else 0.0,
        profile_out=None,
        stalls_out=args.stalls / f"slope-{nodes}.jsonl" if args.stalls else None,
    )
    res.wall_s = time.perf_counter() - t0
    res.measured_reports = run.reports
    res.reports_per_node = rounds
    res.server_cpu_us_per_report = run.server_cpu_us_per_report
    res.per_core = run.per_core
    res.in_decodes = run.server_cpu_us_per_report / res.compact_decode_us
    res.loop_cpu_us_per_report = run.server_loop_cpu_us_per_report
    res.threads_cpu_share = run.server_threads_cpu_share
    if res.loop_cpu_us_per_report is not None and res.threads_cpu_share is not None:
        # The loop's work per report at the fleet's 10 s rate, plus what the other threads did
        # per second: the fleet detectors run on the clock, whatever the rate of reports.
        res.core_at_10s = nodes / INTERVAL_S * res.loop_cpu_us_per_report * 1e-6 + res.threads_cpu_share
    res.rss_ready_mb, res.rss_end_mb = run.server_rss_ready_mb, run.server_rss_end_mb
    if res.rss_ready_mb is not None and res.rss_end_mb is not None:
        res.kb_per_node = (res.rss_end_mb - res.rss_ready_mb) * 1024.0 / nodes
    if paced_rounds:
        res.paced_rate = run.paced_reports_per_s
        res.paced_interval_s = nodes / paced_rate
        res.paced_p99_ms = run.paced_p99_ms
        res.lag_p99_ms = run.paced_lag_p99_ms
        res.lag_worst_ms = run.paced_lag_worst_ms
    res.refused = run.refused
    log.info("%d nodes: %s", nodes, {k: v for k, v in asdict(res).items() if v is not None})
    return res


def _f(value: float | None, spec: str, unit: str = "") -> str:
    return "-" if value is None or math.isnan(value) else format(value, spec) + unit


def render(machine: dict[str, Any], args: argparse.Namespace, results: list[SizeResult]) -> str:
    lines = [
        "## Ingest as the fleet grows",
        "",
        f"Machine: {machine['cpu']}, {machine['nproc']} cores ({machine['python']}), "
        f"{machine['mem_total_gb']:.0f} GB; server pinned to one core, load on the other. Compact "
        f"reports (msgpack, no gzip), pools of {args.pool_nodes or 'all the'} nodes, {args.reports:,} "
        "measured reports a size (whole rounds), paced phase "
        f"{args.paced_seconds:.0f} s at the fleet's 10 s rate, capped at {args.paced_cap:.0f}/s.",
        "",
        "| nodes | pools | measured | server CPU/report | per core | compact decode | gzip'd JSON decode "
        "| in decodes | loop thread CPU/report | other threads, of a core | a core at 10 s "
        "| RSS/node (reports a node) | paced rate (interval) | paced p99 | loop lag p99 "
        "| loop lag worst | refused |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        if r.skipped:
            lines.append(f"| {r.nodes:,} | {r.pools} | skipped: {r.skipped} |" + " |" * 14)
            continue
        lines.append(
            f"| {r.nodes:,} | {r.pools} | {r.measured_reports:,} "
            f"| {_f(r.server_cpu_us_per_report, '.0f', ' us')} "
            f"| {_f(r.per_core, ',.0f')}/s | {_f(r.compact_decode_us, '.0f', ' us')} "
            f"| {_f(r.json_decode_us, '.0f', ' us')} | {_f(r.in_decodes, '.1f')} "
            f"| {_f(r.loop_cpu_us_per_report, '.0f', ' us')} | {_f(r.threads_cpu_share, '.0%')} "
            f"| {_f(r.core_at_10s, '.0%')} "
            f"| {_f(r.kb_per_node, '.0f', ' KB')} ({r.reports_per_node}) "
            f"| {_f(r.paced_rate, ',.0f')}/s ({_f(r.paced_interval_s, '.0f', ' s')}) "
            f"| {_f(r.paced_p99_ms, '.0f', ' ms')} | <= {_f(r.lag_p99_ms, '.0f', ' ms')} "
            f"| {_f(r.lag_worst_ms, '.0f', ' ms')} | {r.refused or 'none'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="fleet sizes, comma-separated")
    p.add_argument("--pool-nodes", type=int, default=2000, help="nodes a pool (0: one pool)")
    p.add_argument(
        "--warmup-rounds", type=int, default=3, help="rounds sent before the measured ones (not counted)"
    )
    p.add_argument("--reports", type=int, default=6000, help="measured reports a size (whole rounds)")
    p.add_argument("--paced-seconds", type=float, default=60.0)
    p.add_argument("--paced-cap", type=float, default=400.0, help="most reports/s of a paced phase")
    p.add_argument("--decode-sample", type=int, default=1000, help="nodes whose reports time the decodes")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", type=Path, help="write the results here too")
    p.add_argument(
        "--stalls",
        type=Path,
        help="run the server under bench/stalls.py: a JSON line per loop hold, a file a size in this folder",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    if args.stalls:
        args.stalls.mkdir(parents=True, exist_ok=True)
    sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    server_core, load_core = server_and_load_cores()
    with open("/proc/meminfo", encoding="ascii") as f:
        mem_total_gb = int(f.readline().split()[1]) / 2**20
    machine = {
        "cpu": cpu_model(),
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "mem_total_gb": mem_total_gb,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }
    results: list[SizeResult] = []
    kb_per_node = FIRST_GUESS_KB_PER_NODE
    with tempfile.TemporaryDirectory(prefix="gpuwarden-bench-slope-") as tmpname:
        for n in sizes:
            res = run_size(
                n, args, Path(tmpname), server_core=server_core, load_core=load_core, kb_per_node=kb_per_node
            )
            results.append(res)
            if res.kb_per_node is not None:
                kb_per_node = max(kb_per_node * 0.5, res.kb_per_node)
    print(render(machine, args, results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "machine": machine,
            "params": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "sizes": [asdict(r) for r in results],
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    bad = sum(sum((r.refused or {}).values()) for r in results)
    if bad:
        print(f"\nFAILED: {bad} reports were not accepted", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
