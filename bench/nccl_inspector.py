"""What reading NCCL Inspector output costs the agent: CPU per 1,000 records.

Run from the repository root (about 30 seconds; writes only in a temporary directory)::

    .venv/bin/python bench/nccl_inspector.py [--records 20000] [--runs 15] [--json out.json]

Records are built like the Inspector's own (field names and order of its JSON writer): 8 ranks of
one process each, 4 communicators (tensor-parallel inside the node, data-parallel across 4 nodes,
two pipeline pairs), AllReduce, AllGather, ReduceScatter and Send/Recv over 5 message sizes, with
execution times and bandwidths that vary from record to record. Three formats:

- ``v4.0``: self-contained lines (header, metadata and ``coll_perf`` on every line, ~390 bytes);
- ``v4.0 verbose``: the same with ``NCCL_INSPECTOR_DUMP_VERBOSE=1`` event traces (4 channels);
- ``v4.3``: ``dump_stats`` markers and bare records (a marker per 64 records).

For each it measures this thread's CPU time (``time.thread_time``) of

1. ``parse+summarize``: ``Stream.feed_chunk`` on 1 MiB chunks of whole lines, as the collector
   feeds them, then ``Summarizer.take()``;
2. ``bare decode``: one msgspec call that decodes the same bytes into typed structs of the
   fields used (str-typed), nothing else: the reference each figure is read against, as a ratio
   measured in the same run; and ``fast-path decode``, the parser's own Literal-typed decode,
   the part of its cost no Python-side change can remove; and ``numbers-only decode``, which
   keeps only each ``coll_perf``'s size, time and bandwidth and skips the header, the metadata
   and every string: a floor under any JSON parser that must find those three numbers;
3. ``collector cycle``: ``NcclInspectorCollector.collect()`` on 8 files holding the records (the
   directory listing, the ``stat`` and ``pread`` calls, the line splitting, the parse, the summary
   and building the report section), the files written before the cycle and not counted.

Each figure is the median of ``--runs`` runs, per 1,000 records. The target (from the issue) is
under 1 ms of CPU per 1,000 records. So that a figure from a shared or slow machine can be read,
the script also times a fixed pure-Python loop (``sum(range(1000))``, best of 5 x 5,000) and
prints it with the load average: the per-record cost is almost all interpreter work and scales
with it. Markdown goes to stdout, progress to stderr.

``--breakdown``: where the parser's time goes, stage by stage. ``--against OLD.py``: another
version of agent/inspector.py (``git show REV:agent/inspector.py > OLD.py``) against this one,
interleaved in one process so both see the same machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from agent import inspector
from agent.clock import SystemClock
from agent.collectors.base import CollectorContext
from agent.collectors.nccl_inspector import InspectorOptions, NcclInspectorCollector
from agent.inspector import Stream, Summarizer

TARGET_MS_PER_1000: float = 1.0
COMMS = (
    ("0x7f8c496ae9f661", 8, 1),
    ("0x9e7a479f95a66c", 32, 4),
    ("0xe62dedaa97644a", 2, 2),
    ("0xad56c683b0c4ef", 2, 2),
)
KINDS = ("AllReduce", "AllGather", "ReduceScatter")
SIZES = (1 << 16, 1 << 20, 3 << 20, 1 << 26, 1 << 30)


def _perf(rng: random.Random, sn: int, kind: str, size: int, verbose: bool) -> str:
    exec_us = 50 + size / 2e5 * rng.uniform(0.9, 1.3)
    busbw = size / exec_us / 1e3 * 1.75
    coll = (
        f'"coll":"{kind}","coll_sn":{sn},"coll_msg_size_bytes":{size},"coll_exec_time_us":{int(exec_us)},'
        f'"coll_timing_source":"kernel_gpu","coll_algobw_gbs":{busbw / 1.75:.6f},"coll_busbw_gbs":{busbw:.6f}'
    )
    if verbose:
        ts = 1752867229235059 + sn * 100
        sn_events = ",".join(
            f'{{"channel_id":{c},"kernel_start_sn":{3 + c},"kernel_stop_sn":{48 + c},'
            f'"kernel_record_sn":{47 + c}}}'
            for c in range(4)
        )
        ts_events = ",".join(
            f'{{"channel_id":{c},"kernel_start_ts":{ts + 100},"kernel_stop_ts":{ts + 4000},'
            f'"kernel_record_ts":{ts + 4000}}}'
            for c in range(4)
        )
        coll += (
            f',"event_trace_sn":{{"coll_start_sn":1,"coll_stop_sn":2,"kernel_events":[{sn_events}]}}'
            f',"event_trace_ts":{{"coll_start_ts":{ts},"coll_stop_ts":{ts + 5},'
            f'"kernel_events":[{ts_events}]}}'
        )
    return coll


def _header(comm: str, rank: int, n_ranks: int, nnodes: int, *, version: str, pid: int) -> str:
    return (
        f'"header":{{"id":"{comm}","rank":{rank % n_ranks},"n_ranks":{n_ranks},"nnodes":{nnodes}}},'
        f'"metadata":{{"inspector_output_format_version":"{version}","git_rev":"9019a1912",'
        f'"rec_mechanism":"nccl_profiler_interface","dump_timestamp_us":1752867229276385,'
        f'"hostname":"trainer-{rank}","pid":{pid}}}'
    )


def make_lines(fmt: str, n: int, rank: int, seed: int = 1) -> list[bytes]:
    """``n`` records of one rank's process in format ``fmt``, as lines without newlines."""
    rng = random.Random(seed * 1000 + rank)
    out: list[bytes] = []
    i = 0
    while i < n:
        comm, n_ranks, nnodes = COMMS[i // 64 % len(COMMS)]
        batch = min(64, n - i)
        if fmt == "v4.3":
            out.append(
                (
                    "{"
                    + _header(comm, rank, n_ranks, nnodes, version="v4.3", pid=100 + rank)
                    + f',"dump_stats":{{"coll_records":{batch},"coll_dropped_total":0,'
                    f'"coll_dropped_since_last_dump":0,"p2p_records":0,"p2p_dropped_total":0,'
                    f'"p2p_dropped_since_last_dump":0}}}}'
                ).encode()
            )
        for j in range(batch):
            kind = KINDS[(i + j) % len(KINDS)]
            size = SIZES[(i + j) // 3 % len(SIZES)]
            perf = _perf(rng, i + j, kind, size, fmt == "v4.0 verbose")
            if fmt == "v4.3":
                # v4.3 writes the algorithm and protocol after the collective's name.
                algo = f'"coll":"{kind}","coll_algo":"RING","coll_proto":"SIMPLE",'
                perf = perf.replace(f'"coll":"{kind}",', algo, 1)
                out.append(f'{{"coll_perf":{{{perf}}}}}'.encode())
            else:
                head = _header(comm, rank, n_ranks, nnodes, version="v4.0", pid=100 + rank)
                out.append(("{" + head + f',"coll_perf":{{{perf}}}}}').encode())
        i += batch
    return out


def _cpu(fn: Callable[[], object]) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def bench_parse(lines: list[bytes]) -> float:
    """CPU seconds to feed ``lines`` (as 1 MiB chunks of whole lines) and take the summary."""
    pieces: list[bytes] = []
    piece: list[bytes] = []
    size = 0
    for ln in lines:
        piece.append(ln)
        size += len(ln) + 1
        if size >= 1 << 20:
            pieces.append(b"\n".join(piece) + b"\n")
            piece, size = [], 0
    if piece:
        pieces.append(b"\n".join(piece) + b"\n")
    expected = sum(1 for ln in lines if b"coll_perf" in ln)
    out: list[Any] = []

    def run() -> None:
        summ = Summarizer()
        stream = Stream()
        for p in pieces:
            out.extend(stream.feed_chunk(p, summ))
        out.append(summ.take())

    cpu = _cpu(run)
    *errors, jobs = out
    assert not errors and jobs.records == expected, (errors[:1], jobs.records)
    return cpu


def bench_decode(lines: list[bytes]) -> float:
    """CPU seconds of a bare msgspec decode of the same bytes into typed structs of the fields
    used (the parser's general decoder, str-typed, one call for all lines): the reference every
    figure is also given as a ratio to, measured in the same run, since a shared machine's speed
    moves from run to run."""
    blob = b"".join((b"[", b",".join(lines), b",null]"))
    return _cpu(lambda: inspector._BATCH.decode(blob))


def bench_fast_decode(lines: list[bytes]) -> float:
    """CPU seconds of the fast path's own decode (Literal-typed structs): its floor."""
    blob = b"".join((b"[", b",".join(lines), b"]"))
    return _cpu(lambda: inspector._FAST.decode(blob))


class _PerfOnly(msgspec.Struct, gc=False):
    """The numbers a summary row needs from one record, nothing else."""

    coll_msg_size_bytes: int
    coll_exec_time_us: float
    coll_busbw_gbs: float


class _PerfOnlyLine(msgspec.Struct, gc=False):
    coll_perf: _PerfOnly | None = None


_PERF_ONLY = msgspec.json.Decoder(list[_PerfOnlyLine])


def bench_perf_only_decode(lines: list[bytes]) -> float:
    """CPU seconds of a msgspec decode that keeps only three numbers of each ``coll_perf`` and
    skips the header, the metadata and every string: what reading the JSON at all costs, a floor
    under any parser that must find each record's size, time and bandwidth in the text."""
    blob = b"".join((b"[", b",".join(lines), b"]"))
    return _cpu(lambda: _PERF_ONLY.decode(blob))


def _chunks(lines: list[bytes]) -> list[bytes]:
    """The lines as the collector hands them over: 1 MiB chunks of whole lines."""
    data = b"\n".join(lines) + b"\n"
    out: list[bytes] = []
    i = 0
    while i < len(data):
        j = data.rfind(b"\n", i, i + (1 << 20)) + 1
        out.append(data[i:j])
        i = j
    return out


def breakdown(lines: list[bytes], runs: int) -> dict[str, float]:
    """Where parse+summarize spends its time, per stage, ms per 1,000 records (medians): the fast
    path's decode, its columns (grouping the records in C), dealing them to their rows, and
    ``take()``; and the whole, which also pays the newline handling and the garbage collector."""
    chunks = _chunks(lines)
    blobs = [b"".join((b"[", memoryview(c.replace(b"\n", b","))[:-1], b"]")) for c in chunks]
    decoded = [inspector._FAST.decode(b) for b in blobs]
    # One stream along the chunks, as the collector reads a file: a v4.3 batch spans chunks.
    stream = Stream()
    cols = [c for c in (stream._columns(d) for d in decoded) if c is not None]
    assert len(cols) == len(chunks), "a chunk took the exact path"
    full = Summarizer()

    def add() -> None:
        for c in cols:
            full.add_columns(c.keys, c.groups, c.busbw, c.exec_us)

    def whole() -> None:
        summ, stream = Summarizer(), Stream()
        for c in chunks:
            stream.feed_chunk(c, summ)
        summ.take()

    stages: dict[str, Callable[[], object]] = {
        "decode": lambda: [inspector._FAST.decode(b) for b in blobs],
        "columns": lambda: [s._columns(d) for s in (Stream(),) for d in decoded],
        "rows": add,
        "take": lambda: full.take(),  # noqa: PLW0108 - the Summarizer ``full`` is at the time
        "whole": whole,
    }
    out: dict[str, list[float]] = {k: [] for k in stages}
    for _ in range(runs):
        for name, fn in stages.items():
            if name == "take":
                full = Summarizer()
                add()
            out[name].append(_cpu(fn) / len(lines) * 1e6)
    return {k: statistics.median(v) for k, v in out.items()}


def against(path: Path, lines: list[bytes], runs: int) -> tuple[float, float, float]:
    """Another version of agent/inspector.py (e.g. ``git show REV:agent/inspector.py``) and this
    one on the same chunks, interleaved run by run so both see the same machine: medians of the
    other's and this one's parse+summarize, and of the bare decode (ms per 1,000 records)."""
    spec = importlib.util.spec_from_file_location("inspector_other", path)
    assert spec is not None and spec.loader is not None
    other = importlib.util.module_from_spec(spec)
    sys.modules["inspector_other"] = other  # msgspec resolves the structs' annotations there
    spec.loader.exec_module(other)
    chunks = _chunks(lines)
    blob = b"".join((b"[", b",".join(lines), b",null]"))

    def parse(mod: Any) -> Any:
        summ, stream = mod.Summarizer(), mod.Stream()
        for c in chunks:
            assert not stream.feed_chunk(c, summ)
        return summ.take()

    assert parse(other) == parse(inspector), "the two versions summarize differently"
    times: dict[str, list[float]] = {"other": [], "bare": [], "this": []}
    for _ in range(runs):
        times["other"].append(_cpu(lambda: parse(other)))
        times["bare"].append(_cpu(lambda: inspector._BATCH.decode(blob)))
        times["this"].append(_cpu(lambda: parse(inspector)))
    o, b, t = (statistics.median(times[k]) / len(lines) * 1e6 for k in ("other", "bare", "this"))
    return o, t, b


def _load() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


def bench_cycle(fmt: str, records: int, root: Path, run: int) -> tuple[float, int]:
    """CPU seconds of one collector cycle over 8 files of ``records / 8`` records each."""
    for old in root.iterdir():
        old.unlink()
    opts = InspectorOptions(directory=root, max_bytes=1 << 30, max_records=10**7, max_backlog_bytes=1 << 30)
    c = NcclInspectorCollector(CollectorContext(clock=SystemClock(), nccl_inspector=opts))
    c.collect()  # the first scan: an empty directory
    for rank in range(8):
        data = b"\n".join(make_lines(fmt, records // 8, rank, seed=run)) + b"\n"
        (root / f"trainer-{rank}-pid{100 + rank}.log").write_bytes(data)
    out: list[Any] = []
    cpu = _cpu(lambda: out.append(c.collect()))
    jobs = out[0].jobs
    assert jobs is not None and not out[0].errors, out[0].errors[:1]
    return cpu, jobs.records


def reference_us() -> float:
    """Best of 5 x 5,000 runs of ``sum(range(1000))``, in microseconds: how fast this CPU runs Python."""
    best = float("inf")
    for _ in range(5):
        start = time.thread_time()
        for _ in range(5_000):
            sum(range(1000))
        best = min(best, (time.thread_time() - start) / 5_000 * 1e6)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=20_000, help="records per run (default 20000)")
    ap.add_argument("--runs", type=int, default=15, help="runs per figure; the median is quoted (default 15)")
    ap.add_argument("--json", type=Path, help="write every figure here")
    ap.add_argument("--breakdown", action="store_true", help="only the parser's stages, per format")
    ap.add_argument(
        "--against",
        type=Path,
        metavar="INSPECTOR_PY",
        help="only: another agent/inspector.py against this one",
    )
    args = ap.parse_args()
    if args.breakdown or args.against is not None:
        print(f"ms of CPU per 1,000 records, median of {args.runs} runs; load average {_load()} before")
        for fmt in ("v4.0", "v4.0 verbose", "v4.3"):
            lines = make_lines(fmt, args.records, rank=0)
            if args.against is not None:
                o, t, b = against(args.against, lines, args.runs)
                print(
                    f"{fmt}: other {o:.3f} ({o / b:.2f} x bare), this {t:.3f} ({t / b:.2f} x bare), "
                    f"bare decode {b:.3f}: {o / t:.2f} x faster"
                )
            else:
                parts = breakdown(lines, args.runs)
                print(f"{fmt}: " + ", ".join(f"{k} {v:.3f}" for k, v in parts.items()))
        print(f"load average {_load()} after")
        return 0
    results: dict[str, Any] = {"records": args.records, "runs": args.runs, "formats": {}}
    rows = []
    refs: list[float] = []
    loads = [_load()]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for fmt in ("v4.0", "v4.0 verbose", "v4.3"):
            lines = make_lines(fmt, args.records, rank=0)
            avg_bytes = sum(map(len, lines)) / len(lines) + 1
            parse: list[float] = []
            cycle: list[float] = []
            floor: list[float] = []
            fast: list[float] = []
            perf_only: list[float] = []
            for run in range(args.runs):
                print(f"{fmt}: run {run + 1}/{args.runs}", file=sys.stderr)
                refs.append(reference_us())
                parse.append(bench_parse(lines) / args.records * 1e6)
                floor.append(bench_decode(lines) / args.records * 1e6)
                fast.append(bench_fast_decode(lines) / args.records * 1e6)
                perf_only.append(bench_perf_only_decode(lines) / args.records * 1e6)
                cpu, n = bench_cycle(fmt, args.records, root, run)
                cycle.append(cpu / n * 1e6)
            p, cy, fl = statistics.median(parse), statistics.median(cycle), statistics.median(floor)
            fd = statistics.median(fast)
            po = statistics.median(perf_only)
            results["formats"][fmt] = {
                "bytes_per_line": avg_bytes,
                "parse_ms_per_1000": parse,
                "cycle_ms_per_1000": cycle,
                "decode_only_ms_per_1000": floor,
                "parse_median": p,
                "cycle_median": cy,
                "decode_only_median": fl,
                "fast_decode_ms_per_1000": fast,
                "fast_decode_median": fd,
                "perf_only_decode_ms_per_1000": perf_only,
                "perf_only_decode_median": po,
            }
            rows.append((fmt, avg_bytes, fl, fd, po, p, min(parse), cy, min(cycle)))
    ref = statistics.median(refs)
    results["reference_sum_range_1000_us"] = refs
    results["loadavg"] = loads[0], _load()
    print(f"CPU per 1,000 records, median of {args.runs} runs of {args.records} records (min in brackets).")
    print(
        f"This machine: {os.cpu_count()} CPUs; sum(range(1000)) took {ref:.1f} us (median over the runs, "
        f"{min(refs):.1f}-{max(refs):.1f}); load average {loads[0]} before, {_load()} after.\n"
    )
    print(
        "| format | bytes/line | bare decode | fast-path decode | numbers-only decode | parse+summarize "
        "| collector cycle | cycle / bare decode | target < 1 ms |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for fmt, avg, fl, fd, po, p, pmin, cy, cmin in rows:
        verdict = "met" if cy < TARGET_MS_PER_1000 else "**missed**"
        cells = [
            fmt,
            f"{avg:.0f}",
            f"{fl:.3f} ms",
            f"{fd:.3f} ms",
            f"{po:.3f} ms",
            f"{p:.3f} ms ({pmin:.3f})",
            f"{cy:.3f} ms ({cmin:.3f})",
            f"{cy / fl:.2f}",
        ]
        print("| " + " | ".join([*cells, verdict]) + " |")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
