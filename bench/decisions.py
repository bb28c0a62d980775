"""What a decision costs on this disk, with group commit and with one fsync per decision.

Run from the repository root (about half a minute; writes only under ``--dir``)::

    .venv/bin/python bench/decisions.py [--dir DIR] [--json out.json]

It measures, on a file in ``--dir`` (default: a temporary directory under the repository, so on
the disk the aggregator's log would be on; ``/tmp`` may be tmpfs, where fsync costs nothing):

1. Raw ``os.fsync`` latency after appending one record's bytes (median, p99, max).
2. One fsync per decision: append one decision, ``await log.synced()``, repeat: what a log that
   syncs every record costs, and the ceiling on a single agent's decisions/s.
3. Group commit as the service runs it: ``--reports`` concurrent report handlers, each appending
   1 to 3 decisions in one event-loop turn and then awaiting ``synced`` before answering, as
   ``POST /v1/reports`` does; decisions/s, fsyncs per decision and the answer latency.

The unsynced window is what a power loss can take: at most the records appended since the last
completed fsync, none that was answered. Markdown goes to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from aggregator.decisions import Decision, DecisionLog, Reason, encode_decision

ROOT = Path(__file__).resolve().parent.parent


def _decision(n: int) -> Decision:
    return Decision(
        time=1764441630.0 + n,
        subject="node",
        node=f"h100-r{n % 40}-n{n % 20:02d}",
        state="quarantined",
        previous="healthy",
        action="taint",
        reasons=[
            Reason(
                detector="rule",
                rule="xid-79",
                severity="critical",
                summary="GPU 3 fell off the bus (XID 79)",
                evidence={"gpu": 3, "xid": 79},
            )
        ],
    )


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def raw_fsync(path: Path, count: int) -> dict[str, float]:
    record = encode_decision(_decision(0)) + b"\n"
    lat = []
    with path.open("ab") as f:
        for _ in range(count):
            f.write(record)
            f.flush()
            t0 = time.perf_counter()
            os.fsync(f.fileno())
            lat.append(time.perf_counter() - t0)
    return {
        "median_ms": statistics.median(lat) * 1e3,
        "p99_ms": _pct(lat, 0.99) * 1e3,
        "max_ms": max(lat) * 1e3,
    }


async def one_fsync_each(path: Path, count: int) -> dict[str, float]:
    log = DecisionLog(path)
    t0 = time.perf_counter()
    for n in range(count):
        log.append(_decision(n))
        await log.synced()
    elapsed = time.perf_counter() - t0
    fsyncs = log.fsyncs
    log.close()
    return {"decisions_per_s": count / elapsed, "fsyncs_per_decision": fsyncs / count}


async def group_commit(path: Path, reports: int, seconds: float) -> dict[str, float]:
    log = DecisionLog(path)
    latencies: list[float] = []
    stop = time.perf_counter() + seconds
    counter = 0
    unsynced_max = 0  # records appended but not yet on disk: what a power loss could take

    async def handler(k: int) -> None:
        nonlocal counter, unsynced_max
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            for _ in range(1 + k % 3):
                log.append(_decision(counter))
                counter += 1
            unsynced_max = max(unsynced_max, log.appended - log.durable_seq)
            await log.synced(log.appended)
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(handler(k) for k in range(reports)))
    elapsed = time.perf_counter() - t0
    fsyncs = log.fsyncs
    log.close()
    return {
        "decisions_per_s": counter / elapsed,
        "fsyncs_per_decision": fsyncs / counter,
        "decisions_per_fsync": counter / fsyncs,
        "answer_median_ms": statistics.median(latencies) * 1e3,
        "answer_p99_ms": _pct(latencies, 0.99) * 1e3,
        "unsynced_max": unsynced_max,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--dir", type=Path, default=None, help="where the scratch log goes (default: under the repo)"
    )
    p.add_argument("--fsyncs", type=int, default=300)
    p.add_argument("--reports", type=int, default=64, help="concurrent report handlers")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir or ROOT, prefix=".bench-decisions-") as tmp:
        work = Path(tmp)
        print("raw fsync ...", file=sys.stderr)
        raw = raw_fsync(work / "raw.jsonl", args.fsyncs)
        print("one fsync per decision ...", file=sys.stderr)
        each = asyncio.run(one_fsync_each(work / "each.jsonl", args.fsyncs))
        print("group commit ...", file=sys.stderr)
        group = asyncio.run(group_commit(work / "group.jsonl", args.reports, args.seconds))
    results: dict[str, Any] = {"raw_fsync": raw, "one_fsync_each": each, "group_commit": group}
    print("| | figure |\n|---|---|")
    print(
        "| fsync latency | "
        + f"median {raw['median_ms']:.2f} ms, p99 {raw['p99_ms']:.2f} ms, max {raw['max_ms']:.2f} ms |"
    )
    print(f"| one fsync per decision | {each['decisions_per_s']:.0f} decisions/s |")
    print(
        f"| group commit, {args.reports} concurrent reports | {group['decisions_per_s']:.0f} decisions/s, "
        f"{group['decisions_per_fsync']:.1f} decisions per fsync, answer median "
        f"{group['answer_median_ms']:.2f} ms, p99 {group['answer_p99_ms']:.2f} ms, at most "
        f"{group['unsynced_max']:.0f} decisions unsynced at once |"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
