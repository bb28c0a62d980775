"""Replay throughput: ``gpuwarden replay`` over a 64-node, 30-minute trace, next to its decode ceiling.

Run from the repository root (about 2 minutes on 2 cores; no network; every process it starts
is waited for, and the trace lives in a temporary directory unless ``--keep``)::

    .venv/bin/python bench/replay.py [--runs 3] [--nodes 64] [--minutes 30] [--json FILE] [--profile]

What it does:

1. Writes a trace of ``--nodes`` nodes reporting every 10 s for ``--minutes`` (64 x 180 = 11,520
   reports, less the ones a silent node does not send) with ``bench/_reports.py``: 8 H100 GPUs
   with 18 NVLinks and 8 NDR InfiniBand ports with 52 counters per report, as JSONL and as
   JSONL.gz. Five nodes have a fault, so the pipeline does real work (rules fire, the health
   machine moves, decisions are written): a GPU falls off the bus (XID 79, then one GPU fewer),
   NVLink CRC errors, a flapping IB port, a node silent for 5 minutes, a GPU running hot.
2. ``--runs`` times for each file: ``gpuwarden replay TRACE --out DECISIONS`` as a subprocess
   pinned to one core, its wall time and CPU (user + sys from ``wait4``), and, for comparison,
   ``gpuwarden replay`` of a one-report trace (the fixed start-up: interpreter, imports, rules).
3. In this process, on the same core: the decode-only ceiling (reading the same file and decoding
   every line into a ``Report`` in a tight loop) and ``aggregator.replay.replay()`` itself
   (decode + reorder + pipeline, without start-up).

The target (from the issue) is a 64-node, 30-minute trace in under 30 s. Markdown goes to
stdout, progress to stderr. ``--profile`` prints the in-process replay's top costs.
"""

from __future__ import annotations

import argparse
import cProfile
import gzip
import io
import json
import logging
import os
import platform
import pstats
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from _common import cpu_model
from _reports import GPUS, IB_COUNTERS, NICS, NVLINKS, Fault, FaultKind, fleet_reports, node_name

from agent.report import decode, encode
from aggregator.configload import load_config
from aggregator.replay import replay
from aggregator.rules.model import default_rules_dir, load_rules

log = logging.getLogger("bench.replay")

REPO = Path(__file__).resolve().parent.parent
GPUWARDEN = REPO / ".venv" / "bin" / "gpuwarden"
INTERVAL_S = 10.0
TARGET_S = 30.0  # the bound for 64 nodes x 30 minutes
SUBPROCESS_TIMEOUT_S = 120.0


class BenchError(RuntimeError):
    """A measurement could not be made (replay failed, ...)."""


def default_faults(nodes: int, rounds: int) -> list[Fault]:
    """Five incidents spread over the trace (scaled to its length), on nodes spread over the fleet."""

    def at(share: float) -> int:
        return int(rounds * share)

    def node(share: float) -> int:
        return min(nodes - 1, int(nodes * share))

    return [
        Fault(node(0.08), FaultKind.XID_79, start=at(1 / 3)),
        Fault(node(0.27), FaultKind.NVLINK_CRC, start=at(0.22), end=at(2 / 3)),
        Fault(node(0.45), FaultKind.IB_FLAPPING, start=at(0.5)),
        Fault(node(0.64), FaultKind.SILENT, start=at(0.55), end=at(0.55) + 30),
        Fault(node(0.83), FaultKind.HOT_GPU, start=at(1 / 6)),
    ]


@dataclass(frozen=True)
class Trace:
    plain: Path
    gz: Path
    one: Path  # a single report: start-up cost
    reports: int
    nodes: int
    minutes: float
    plain_bytes: int
    gz_bytes: int
    faults: list[Fault]


def write_trace(directory: Path, nodes: int, minutes: float, seed: int) -> Trace:
    rounds = round(minutes * 60.0 / INTERVAL_S)
    faults = default_faults(nodes, rounds)
    start = time.time() - rounds * INTERVAL_S
    plain = directory / "trace.jsonl"
    gz = directory / "trace.jsonl.gz"
    one = directory / "one.jsonl"
    n = 0
    with plain.open("wb") as f:
        for report in fleet_reports(
            nodes, rounds, start=start, interval=INTERVAL_S, seed=seed, faults=faults
        ):
            f.write(encode(report) + b"\n")
            n += 1
    with plain.open("rb") as src, gzip.open(gz, "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    with plain.open("rb") as src:
        one.write_bytes(src.readline())
    return Trace(plain, gz, one, n, nodes, minutes, plain.stat().st_size, gz.stat().st_size, faults)


# ---- measurements -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timed:
    wall_s: float
    cpu_s: float
    peak_rss_mb: float | None = None


def timed_replay(trace: Path, out: Path, core: int) -> tuple[Timed, str]:
    """``gpuwarden replay`` as a subprocess pinned to ``core``: its wall, CPU (user + sys) and peak
    RSS, and the summary it prints."""
    cmd = [str(GPUWARDEN), "--log-level", "WARNING", "replay", str(trace), "--out", str(out)]
    taskset = shutil.which("taskset")
    if taskset:
        cmd = [taskset, "-c", str(core), *cmd]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    try:
        if not taskset:
            os.sched_setaffinity(proc.pid, {core})
        _, stderr = proc.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the reaped child is in here now
    if proc.returncode != 0:
        raise BenchError(
            f"gpuwarden replay {trace.name} exited {proc.returncode}:\n{stderr.decode()[-3000:]}"
        )
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    # ru_maxrss of children is the largest of any child so far: an upper bound for this one.
    return Timed(wall, cpu, after.ru_maxrss / 1024.0), stderr.decode()


def decode_ceiling(trace: Path) -> Timed:
    """Reading and decoding every line of the trace, nothing else: what replay cannot beat."""
    t0, c0 = time.perf_counter(), time.process_time()
    with gzip.open(trace, "rb") if trace.suffix == ".gz" else trace.open("rb") as f:
        for line in f:
            if line.strip():
                decode(line)
    return Timed(time.perf_counter() - t0, time.process_time() - c0)


def in_process_replay(trace: Path, out: Path, profile: bool) -> tuple[Timed, dict[str, int]]:
    config = load_config(None)
    rules = load_rules([Path(config.rules_dir) if config.rules_dir else default_rules_dir()])
    prof = cProfile.Profile() if profile else None
    t0, c0 = time.perf_counter(), time.process_time()
    if prof is not None:
        prof.enable()
    decisions, _ = replay(trace, out, config, rules)
    if prof is not None:
        prof.disable()
    timed = Timed(time.perf_counter() - t0, time.process_time() - c0)
    if prof is not None:
        buf = io.StringIO()
        stats = pstats.Stats(prof, stream=buf).strip_dirs()
        for key in ("tottime", "cumulative"):
            buf.write(f"\n### in-process replay of {trace.name}: top 30 by {key}\n")
            stats.sort_stats(key).print_stats(30)
        print(buf.getvalue(), file=sys.stderr)
    by_node = Counter(d.node for d in decisions)
    return timed, dict(sorted(by_node.items()))


def _median(values: Sequence[float]) -> float:
    return statistics.median(values)


def _row(what: str, trace: Path, runs: Sequence[Timed], *, per_report: bool = True) -> dict[str, Any]:
    """One row of the results: the median wall and CPU time of ``runs`` of one measurement."""
    return {
        "what": what,
        "trace": trace.name,
        "wall_s": _median([r.wall_s for r in runs]),
        "cpu_s": _median([r.cpu_s for r in runs]),
        "per_report": per_report,
    }


def render(result: dict[str, Any]) -> str:
    m, t = result["machine"], result["trace"]
    lines = [
        "## Replay",
        "",
        f"Machine: {m['cpu']}, {m['nproc']} cores ({m['python']}); everything pinned to core {m['core']}. "
        f"Trace: {t['nodes']} nodes x {t['minutes']:g} min at 10 s = {t['reports']:,} reports "
        f"({GPUS} GPUs x {NVLINKS} NVLinks, {NICS} IB ports x {len(IB_COUNTERS)} counters each; "
        f"{t['plain_mb']:.0f} MB JSONL, {t['gz_mb']:.1f} MB gzip), {len(t['faults'])} faulty nodes. "
        f"Median of {result['runs']} runs.",
        "",
        "| measurement | trace | wall | CPU | reports/s (CPU) |",
        "|---|---|---:|---:|---:|",
    ]
    n = t["reports"]
    for row in result["rows"]:
        per_s = f"{n / row['cpu_s']:,.0f}" if row["per_report"] else "-"
        lines.append(
            f"| {row['what']} | {row['trace']} | {row['wall_s']:.2f} s | {row['cpu_s']:.2f} s | {per_s} |"
        )
    per_node = ", ".join(f"{k} {v}" for k, v in result["decisions"].items()) or "none"
    faulty = ", ".join(f"{node_name(f['node'])} {f['kind']}" for f in t["faults"])
    lines += [
        "",
        f"Target: under {TARGET_S:.0f} s wall for 64 nodes x 30 minutes. Decisions written: "
        f"{result['decisions_total']} ({per_node}); faulty nodes: {faulty}.",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--nodes", type=int, default=64)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--runs", type=int, default=3, help="subprocess runs per trace file; the median is shown")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", type=Path, help="write the results here too")
    p.add_argument("--keep", type=Path, help="write the traces into this directory and keep them")
    p.add_argument("--profile", action="store_true", help="profile the in-process replay")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("aggregator").setLevel(logging.WARNING)  # decisions are counted, not logged

    core = sorted(os.sched_getaffinity(0))[0]
    before = os.sched_getaffinity(0)
    with tempfile.TemporaryDirectory(prefix="gpuwarden-bench-replay-") as tmpname:
        tmp = Path(tmpname)
        where = args.keep if args.keep else tmp
        where.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        trace = write_trace(where, args.nodes, args.minutes, args.seed)
        log.info(
            "wrote %d reports in %.1f s: %s (%d bytes), %s (%d bytes)",
            trace.reports,
            time.perf_counter() - t0,
            trace.plain,
            trace.plain_bytes,
            trace.gz,
            trace.gz_bytes,
        )
        rows: list[dict[str, Any]] = []
        os.sched_setaffinity(0, {core})
        try:
            startup = [timed_replay(trace.one, tmp / "one-out.jsonl", core)[0] for _ in range(args.runs)]
            what = "`gpuwarden replay` of a 1-report trace (start-up only)"
            rows.append(_row(what, trace.one, startup, per_report=False))
            decided: dict[str, int] = {}
            for path in (trace.plain, trace.gz):
                ceiling = [decode_ceiling(path) for _ in range(args.runs)]
                rows.append(_row("decode only (read + decode every line), in process", path, ceiling))
                inproc, decided = in_process_replay(path, tmp / "inproc.jsonl", args.profile)
                rows.append(_row("`aggregator.replay.replay()`, in process (no start-up)", path, [inproc]))
                runs: list[Timed] = []
                summary = ""
                for i in range(args.runs):
                    out = tmp / f"decisions-{path.name}-{i}.jsonl"
                    timed, summary = timed_replay(path, out, core)
                    runs.append(timed)
                    log.info(
                        "replay %s run %d: %.2f s wall, %.2f s CPU",
                        path.name,
                        i + 1,
                        timed.wall_s,
                        timed.cpu_s,
                    )
                log.info("gpuwarden replay said: %s", summary.strip().replace("\n", " | "))
                rows.append(
                    {
                        **_row("**`gpuwarden replay TRACE --out D`** (subprocess)", path, runs),
                        "summary": summary.strip(),
                        "peak_rss_mb": max(r.peak_rss_mb or 0.0 for r in runs),
                    }
                )
        finally:
            os.sched_setaffinity(0, before)

    result: dict[str, Any] = {
        "machine": {
            "cpu": cpu_model(),
            "nproc": os.cpu_count(),
            "python": platform.python_version(),
            "kernel": platform.release(),
            "date": datetime.now(UTC).strftime("%Y-%m-%d"),
            "core": core,
        },
        "trace": {
            "nodes": trace.nodes,
            "minutes": trace.minutes,
            "reports": trace.reports,
            "plain_mb": trace.plain_bytes / 1e6,
            "gz_mb": trace.gz_bytes / 1e6,
            "faults": [{**asdict(f), "kind": f.kind.value} for f in trace.faults],
        },
        "runs": args.runs,
        "rows": rows,
        "decisions": decided,
        "decisions_total": sum(decided.values()),
    }
    print(render(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    slowest = max(r["wall_s"] for r in rows if r["what"].startswith("**"))
    if slowest >= TARGET_S:
        print(f"\nMISSED: replay took {slowest:.1f} s (target {TARGET_S:.0f} s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
