"""Aggregator ingest throughput: reports per second on one core, over real HTTP.

Run from the repository root (about 1.5 minutes on 2 cores; loopback only; every process it
starts is stopped, also on failure)::

    .venv/bin/python bench/ingest.py [--runs 3] [--nodes 2000] [--rounds 5] [--json FILE] [--profile]

What it does:

1. Builds ``--nodes`` realistic node reports per round (``bench/_reports.py``: 8 H100 GPUs with
   18 NVLinks each, 8 NDR InfiniBand ports with 52 counters each; about 39 KB of JSON, 3.8 KB
   gzipped), for one warm-up round, ``--rounds`` measured rounds and a few paced rounds, each
   node's time and seq advancing by one 10 s interval per round, and encodes them as an agent
   does (``agent.shipper.encode_body``): gzip'd JSON, as agents sent before, or with ``--wire
   compact`` the compact msgpack they send now. ``--pool-nodes`` splits the fleet into pools of
   that many nodes (default: one pool). Nothing is a duplicate: the pipeline does its full work.
2. In this process, on the core the server will use: the decode-only ceiling (the same bodies
   gunzipped with the server's bounded inflater and decoded into ``Report``, in a tight loop),
   the same plus the server's plausibility check, and the pipeline alone (``Pipeline.ingest`` on
   the decoded reports, after a warm-up round), each as CPU per report.
3. ``--runs`` times: starts ``gpuwarden aggregator`` (a fresh one each run, static tokens for every
   node, default config and rules) pinned to one core, and a load process pinned to another that
   POSTs the bodies to ``/v1/reports`` with ``--concurrency`` keep-alive connections
   (aiohttp, gzip, bearer tokens). The warm-up round is sent first and not counted, so every
   node is known and its history allocated. Then the measured rounds, closed loop (as fast as the
   server answers): reports/s, the server's CPU per report (``/proc/PID/stat`` utime+stime over
   the phase, all its threads), latency. Then the paced rounds at ``--paced-rate`` reports/s (the
   issue's per-core load: 7,500 nodes every 10 s need 750/s), open loop: latency at that load,
   counted from when each report was due, the server's CPU share, and its event-loop lag over
   the phase (``/metrics`` scraped before and after: the lag histogram's p99 as a bucket bound,
   and the worst lag of the last 60 s, which covers only the paced phase when it lasts 60 s or
   more: ``--paced-seconds 60``). Every answer must be
   200 ``accepted``; anything else is counted and fails the run.

Reports/s per core = 1 / server CPU per report: what one core sustains when it does nothing else.
The table gives the median of the runs. ``--profile`` runs the server (one run) and the pipeline
under cProfile and prints the top costs. Markdown goes to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import http.client
import io
import json
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import platform
import pstats
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import stalls
from _common import cpu_model, free_port, interpolated_percentile, proc_cpu_seconds, thread_cpu_seconds
from _reports import (
    GPUS,
    IB_COUNTERS,
    NICS,
    NVLINKS,
    NodeSim,
    phase_offset,
    sending_order,
    token_file_text,
    token_of,
)
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from agent.clock import SystemClock
from agent.report import Report, decode
from agent.shipper import encode_body
from agent.wire import COMPACT_MEDIA_TYPE, decode_compact
from aggregator import eventloop
from aggregator.app import build_pipeline
from aggregator.auth import StaticTokens
from aggregator.config import Config
from aggregator.configload import load_config
from aggregator.decisions import DecisionLog
from aggregator.eventloop import EVENT_LOOPS
from aggregator.metrics import Metrics
from aggregator.model import IngestOutcome
from aggregator.rules.model import Rule, default_rules_dir, load_rules
from aggregator.service import REPORTS_PATH, create_app, gunzip_bounded, plausibility_errors, serve

log = logging.getLogger("bench.ingest")

REPO = Path(__file__).resolve().parent.parent
GPUWARDEN = REPO / ".venv" / "bin" / "gpuwarden"
NOOP_SERVER = "_noop-server"  # argv[1] that makes this script the no-op pipeline's server
TARGET_PER_CORE = 1000.0  # reports/s per core, from the issue
NEEDED_PER_CORE = 750.0  # 7,500 nodes at a 10 s interval
INTERVAL_S = 10.0
STALL_THRESHOLD_MS = 20.0  # --stalls: a loop not turned for this long is sampled
ACCEPTED = b'{"status":"accepted"}'


class BenchError(RuntimeError):
    """A measurement could not be made, or the server did not accept every report."""


# ---- the workload -------------------------------------------------------------------------------


WIRES = ("json", "compact")
_WIRE_NAMES = {"json": "gzip'd JSON, what agents sent before", "compact": "compact msgpack, what agents send"}


@dataclass
class Workload:
    nodes: int
    warmup: list[tuple[int, bytes]]  # (node index, body as the agent sends it), in sending order
    measured: list[tuple[int, bytes]]
    paced: list[tuple[int, bytes]]
    json_bytes: int  # mean uncompressed size
    wire: str = "json"

    @property
    def gzip_bytes(self) -> float:
        """Mean body size on the wire (gzip'd JSON, or compact msgpack without gzip)."""
        return statistics.fmean(len(b) for _, b in self.measured)

    @property
    def headers(self) -> dict[str, str]:
        if self.wire == "compact":
            return {"Content-Type": COMPACT_MEDIA_TYPE}
        return {"Content-Type": "application/json", "Content-Encoding": "gzip"}


def decode_body(body: bytes, limit: int) -> Report:
    """What the server does with a body before the pipeline: gunzip (bounded) and decode."""
    if body[:2] == b"\x1f\x8b":
        body = gunzip_bounded(body, limit)
    return decode(body) if body[:1] == b"{" else decode_compact(body)


def pool_of(index: int, pool_nodes: int) -> str:
    """Node ``index``'s pool: one pool for the fleet (``pool_nodes`` 0), else pools of that many."""
    return "h100-a" if pool_nodes <= 0 else f"h100-{index // pool_nodes:03d}"


def _encode_nodes(args: tuple[int, int, int, float, int, str, int]) -> list[tuple[list[bytes], int]]:
    """Every round's body of nodes ``first..last-1`` (a worker process's share)."""
    first, last, rounds, start, seed, wire, pool_nodes = args
    out = []
    for i in range(first, last):
        sim = NodeSim(i, seed=seed, interval=INTERVAL_S, pool=pool_of(i, pool_nodes))
        offset = phase_offset(i, seed=seed)
        bodies = []
        json_bytes = 0
        for r in range(rounds):
            report = sim.report(start + r * INTERVAL_S + offset, r)
            if r == 0:
                from agent.report import encode  # noqa: PLC0415 (only for the size figure)

                json_bytes = len(encode(report))
            bodies.append(encode_body(report, compact=wire == "compact"))
        out.append((bodies, json_bytes))
    return out


def build_workload(
    nodes: int,
    warmup: int,
    measured: int,
    paced: int,
    *,
    seed: int,
    workers: int,
    wire: str = "json",
    pool_nodes: int = 0,
) -> Workload:
    rounds = warmup + measured + paced
    # The newest round is about now: the server refuses reports more than a day off its clock.
    start = time.time() - rounds * INTERVAL_S
    step = math.ceil(nodes / workers)
    chunks = [(a, min(a + step, nodes), rounds, start, seed, wire, pool_nodes) for a in range(0, nodes, step)]
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        parts = pool.map(_encode_nodes, chunks)
    per_node = [bodies for part in parts for bodies, _ in part]
    json_bytes = statistics.fmean(size for part in parts for _, size in part)
    # Time order: each node's reports are a whole round apart, so they never overtake each other.
    order = sending_order(nodes, seed=seed)
    sending = [[(i, per_node[i][r]) for i in order] for r in range(rounds)]

    def flat(rs: Sequence[list[tuple[int, bytes]]]) -> list[tuple[int, bytes]]:
        return [item for r in rs for item in r]

    return Workload(
        nodes=nodes,
        warmup=flat(sending[:warmup]),
        measured=flat(sending[warmup : warmup + measured]),
        paced=flat(sending[warmup + measured :]),
        json_bytes=round(json_bytes),
        wire=wire,
    )


# ---- small helpers ------------------------------------------------------------------------------


def server_and_load_cores() -> tuple[int, int]:
    """The core the server is pinned to and the one the load process is (the same on one core)."""
    cores = sorted(os.sched_getaffinity(0))
    server_core, load_core = cores[0], cores[1] if len(cores) > 1 else cores[0]
    if load_core == server_core:
        log.warning("one core only: the server and the load share it, reports/s (wall) is meaningless")
    return server_core, load_core


def percentile(values: Sequence[float], q: float) -> float:
    return interpolated_percentile(values, q) if values else math.nan


def proc_status_kb(pid: int, key: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


@contextmanager
def pinned(core: int) -> Iterator[None]:
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


# ---- in-process ceilings ------------------------------------------------------------------------


@dataclass(frozen=True)
class InProcess:
    what: str
    reports: int
    cpu_us_per_report: float

    @property
    def per_core(self) -> float:
        return 1e6 / self.cpu_us_per_report


def _cpu_loop(what: str, n: int, body: Callable[[], None]) -> InProcess:
    t0 = time.process_time()
    body()
    return InProcess(what, n, (time.process_time() - t0) / n * 1e6)


def load_server_setup() -> tuple[Config, list[Rule]]:
    """What ``gpuwarden aggregator`` loads with no --config and no --rules."""
    config = load_config(None)
    return config, load_rules([Path(config.rules_dir) if config.rules_dir else default_rules_dir()])


def measure_in_process(work: Workload, tmp: Path, profile: bool) -> list[InProcess]:
    config, rules = load_server_setup()
    limit = config.ingest.max_decompressed_bytes
    bodies = [b for _, b in work.measured]
    now = time.time()

    def decode_all() -> None:
        for b in bodies:
            decode_body(b, limit)

    def decode_check_all() -> None:
        for b in bodies:
            if plausibility_errors(decode_body(b, limit), now=now):
                raise BenchError("a generated report is implausible")

    what = "gunzip + decode" if work.wire == "json" else "compact decode"
    out = [
        _cpu_loop(f"decode only ({what})", len(bodies), decode_all),
        _cpu_loop("decode + plausibility check", len(bodies), decode_check_all),
    ]
    warm = [decode_body(b, limit) for _, b in work.warmup]
    reports = [decode_body(b, limit) for b in bodies]
    decisions = DecisionLog(tmp / "pipeline-decisions.jsonl")
    try:
        pipeline = build_pipeline(config, rules, decisions)
        for r in warm:
            pipeline.ingest(r, r.time)

        def ingest_all(rs: list[Report]) -> None:
            for r in rs:
                pipeline.ingest(r, r.time)

        half = len(reports) // 2 if profile else len(reports)
        out.append(_cpu_loop("pipeline only (Pipeline.ingest)", half, lambda: ingest_all(reports[:half])))
        if profile:
            prof = cProfile.Profile()
            prof.runcall(ingest_all, reports[half:])
            print_profile(prof, f"Pipeline.ingest, {len(reports) - half} reports, in process")
    finally:
        decisions.close()
    return out


def print_profile(prof: cProfile.Profile | pstats.Stats, title: str, top: int = 30) -> None:
    buf = io.StringIO()
    stats = prof if isinstance(prof, pstats.Stats) else pstats.Stats(prof, stream=buf)
    stats.stream = buf  # type: ignore[attr-defined]
    stats.strip_dirs()
    for key in ("tottime", "cumulative"):
        buf.write(f"\n### {title}: top {top} by {key}\n")
        stats.sort_stats(key).print_stats(top)
    print(buf.getvalue(), file=sys.stderr)


# ---- the load process ---------------------------------------------------------------------------


@dataclass
class PhaseResult:
    sent: int = 0
    accepted: int = 0
    refused: dict[str, int] = field(default_factory=dict)  # "HTTP 422", "duplicate", "ClientOSError"
    wall_s: float = 0.0
    server_cpu_s: float = 0.0
    server_loop_cpu_s: float = 0.0  # its main thread's: the event loop, where every request runs
    client_cpu_s: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    truncated: bool = False  # the deadline stopped it before every report was sent
    # The server's event-loop lag over the phase: histogram bucket counts (upper bound -> count,
    # the difference between a scrape before and one after) and its worst-of-the-last-60-s gauge.
    lag_buckets: dict[str, float] = field(default_factory=dict)
    lag_worst_s: float | None = None
    # Its cycle collections over the phase, by generation: bucket bound -> count, the same way.
    collection_buckets: dict[str, dict[str, float]] = field(default_factory=dict)


async def _post(
    session: aiohttp.ClientSession, url: str, node: int, body: bytes, headers: dict[int, dict[str, str]]
) -> str | None:
    """None when accepted, else what went wrong."""
    try:
        async with session.post(url, data=body, headers=headers[node]) as resp:
            payload = await resp.read()
            if resp.status != 200:
                return f"HTTP {resp.status}"
            return None if payload == ACCEPTED else f"200 {payload[:40].decode(errors='replace')}"
    except aiohttp.ClientError as exc:
        return type(exc).__name__


async def _phase(
    session: aiohttp.ClientSession,
    url: str,
    items: list[tuple[int, bytes]],
    headers: dict[int, dict[str, str]],
    *,
    concurrency: int,
    server_pid: int,
    deadline: float,
    rate: float | None,
) -> PhaseResult:
    """Send ``items`` in order: closed loop with ``concurrency`` senders, or, with ``rate``, open
    loop: item k is due at start + k / rate, and its latency counts from then (a late send is the
    server's delay too), still on at most ``concurrency`` connections."""
    res = PhaseResult()
    refused: Counter[str] = Counter()
    it = iter(enumerate(items))
    cpu0, wall0, client0 = proc_cpu_seconds(server_pid), time.perf_counter(), time.process_time()
    loop0 = thread_cpu_seconds(server_pid, server_pid)

    async def sender() -> None:
        for k, (node, body) in it:
            if time.monotonic() > deadline:
                res.truncated = True
                return
            due = time.perf_counter()
            if rate is not None:
                due = wall0 + k / rate
                if due > time.perf_counter():
                    await asyncio.sleep(due - time.perf_counter())
            problem = await _post(session, url, node, body, headers)
            res.latencies_ms.append((time.perf_counter() - due) * 1000.0)
            res.sent += 1
            if problem is None:
                res.accepted += 1
            else:
                refused[problem] += 1

    await asyncio.gather(*(sender() for _ in range(concurrency)))
    res.wall_s = time.perf_counter() - wall0
    res.server_cpu_s = proc_cpu_seconds(server_pid) - cpu0
    res.server_loop_cpu_s = thread_cpu_seconds(server_pid, server_pid) - loop0
    res.client_cpu_s = time.process_time() - client0
    res.refused = dict(refused)
    return res


_LAG = "gpuwarden_aggregator_event_loop_lag_seconds"


_COLLECTION = "gpuwarden_aggregator_gc_collection_seconds"


async def _scrape_loop(
    session: aiohttp.ClientSession, port: int
) -> tuple[dict[str, float], float | None, dict[str, dict[str, float]]]:
    """The server's event-loop lag histogram (cumulative bucket counts by ``le``), its worst-lag
    gauge, and its cycle collections' histograms by generation (the same, by ``le``)."""
    async with session.get(
        f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {_VIEWER}"}
    ) as resp:
        text = await resp.text()
    buckets: dict[str, float] = {}
    worst: float | None = None
    collections: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{_LAG}_bucket":
                buckets[sample.labels["le"]] = sample.value
            elif sample.name == "gpuwarden_aggregator_event_loop_lag_max_seconds":
                worst = sample.value
            elif sample.name == f"{_COLLECTION}_bucket":
                collections.setdefault(sample.labels["generation"], {})[sample.labels["le"]] = sample.value
    return buckets, worst, collections


def _since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """A histogram's cumulative bucket counts over a phase: the scrape after less the one before."""
    return {le: n - before.get(le, 0.0) for le, n in after.items()}


def collections_summary(by_generation: dict[str, dict[str, float]]) -> dict[str, dict[str, float | None]]:
    """Per generation, how many collections a phase held, how many took over 10 and over 50 ms,
    and the bucket bound of its slowest (ms; None for none, inf past the last bound)."""
    out: dict[str, dict[str, float | None]] = {}
    for generation, buckets in sorted(by_generation.items()):
        bounds = sorted((float(le), n) for le, n in buckets.items())
        total = bounds[-1][1] if bounds else 0.0
        slowest = next((le for le, n in bounds if n >= total), None) if total > 0 else None
        within = dict(bounds)
        out[generation] = {
            "count": total,
            "over_10_ms": total - within.get(0.01, total),
            "over_50_ms": total - within.get(0.05, total),
            "slowest_le_ms": None if slowest is None else slowest * 1000,
        }
    return out


def lag_quantile(buckets: dict[str, float], q: float) -> float | None:
    """The upper bound of the bucket holding quantile ``q`` of the lag samples (None: no samples)."""
    bounds = sorted(((float(le), n) for le, n in buckets.items()), key=lambda b: b[0])
    if not bounds or bounds[-1][1] <= 0:
        return None
    total = bounds[-1][1]
    return next(le for le, n in bounds if n >= q * total)


async def _load_main(
    port: int, work: Workload, *, concurrency: int, server_pid: int, deadline: float, paced_rate: float
) -> dict[str, PhaseResult]:
    url = f"http://127.0.0.1:{port}{REPORTS_PATH}"
    headers = {i: {"Authorization": f"Bearer {token_of(i)}", **work.headers} for i in range(work.nodes)}
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency)
    timeout = aiohttp.ClientTimeout(total=30.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        common: dict[str, Any] = {"concurrency": concurrency, "server_pid": server_pid, "deadline": deadline}
        out = {"warmup": await _phase(session, url, work.warmup, headers, rate=None, **common)}
        out["measured"] = await _phase(session, url, work.measured, headers, rate=None, **common)
        if work.paced and paced_rate > 0:
            before, _, collected_before = await _scrape_loop(session, port)
            paced = await _phase(session, url, work.paced, headers, rate=paced_rate, **common)
            after, paced.lag_worst_s, collected = await _scrape_loop(session, port)
            paced.lag_buckets = _since(before, after)
            paced.collection_buckets = {
                g: _since(collected_before.get(g, {}), b) for g, b in collected.items()
            }
            out["paced"] = paced
    return out


def _load_process(  # noqa: PLR0917 (multiprocessing passes positional arguments)
    conn: multiprocessing.connection.Connection,
    core: int,
    port: int,
    work: Workload,
    concurrency: int,
    server_pid: int,
    max_seconds: float,
    paced_rate: float,
) -> None:
    os.sched_setaffinity(0, {core})
    try:
        deadline = time.monotonic() + max_seconds
        result = asyncio.run(
            _load_main(
                port,
                work,
                concurrency=concurrency,
                server_pid=server_pid,
                deadline=deadline,
                paced_rate=paced_rate,
            )
        )
        conn.send({k: asdict(v) for k, v in result.items()})
    except BaseException as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
        raise
    finally:
        conn.close()


# ---- the service around a pipeline that does nothing --------------------------------------------


class NoopPipeline:
    """Accepts every report and keeps nothing: what is left is the HTTP service's own cost
    (aiohttp, token check, gunzip, decode, plausibility, metrics)."""

    def ingest(self, report: Report, received: float) -> IngestOutcome:
        return IngestOutcome.ACCEPTED

    def advance(self, now: float) -> None:
        return None

    def nodes(self) -> list[dict[str, Any]]:
        return []

    def node(self, name: str) -> dict[str, Any] | None:
        return None

    def decisions_since(self, since: float, limit: int) -> list[dict[str, Any]]:
        return []

    def node_states(self) -> dict[str, int]:
        return {}


def serve_noop(port: int, tokens: Path, config_file: Path) -> int:
    """``gpuwarden aggregator``'s service, as aggregator/cli.py builds it, around ``NoopPipeline``."""
    config = load_config(config_file)
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    app = create_app(NoopPipeline(), StaticTokens(tokens), config, SystemClock(), registry, metrics=metrics)
    # On the loop the service would choose (aggregator/eventloop.py), so that the two compare.
    eventloop.run(serve(app, "127.0.0.1", port), config.server.event_loop)
    return 0


# ---- one run against a real server --------------------------------------------------------------


@dataclass(frozen=True)
class HttpRun:
    reports: int
    wall_s: float
    reports_per_s: float
    server_cpu_us_per_report: float
    server_cpu_share: float  # of its one core, while loaded
    client_cpu_share: float
    p50_ms: float
    p99_ms: float
    paced_rate: float | None
    paced_reports_per_s: float | None
    paced_p50_ms: float | None
    paced_p99_ms: float | None
    paced_server_cpu_share: float | None
    paced_lag_p99_ms: float | None  # the server's event-loop lag during the paced phase (bucket bound)
    paced_lag_worst_ms: float | None  # its worst lag in the last 60 s, read just after the phase
    server_rss_mb: float | None  # its peak (VmHWM)
    nodes_known: int
    decisions: int
    refused: dict[str, int]
    # Its resident memory when ready (before the first report) and at the end (VmRSS).
    server_rss_ready_mb: float | None = None
    server_rss_end_mb: float | None = None
    # The measured phase's server CPU split: its event-loop thread's per report, and its other
    # threads' (the detectors' pool computes, the decision log's fsyncs) per second of wall time.
    server_loop_cpu_us_per_report: float | None = None
    server_threads_cpu_share: float | None = None
    # The server's cycle collections during the paced phase, by generation (collections_summary).
    paced_collections: dict[str, dict[str, float | None]] | None = None

    @property
    def per_core(self) -> float:
        return 1e6 / self.server_cpu_us_per_report


_VIEWER = "bench-viewer-token-0123456789abcdef"  # reads need a viewer token (aggregator/service.py)


def _get(port: int, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {_VIEWER}"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _wait_ready(proc: subprocess.Popen[bytes], port: int, logfile: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"the aggregator exited with {proc.returncode}:\n{_tail(logfile)}")
        try:
            if _get(port, "/readyz", timeout=1.0)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise BenchError(f"the aggregator did not become ready in {timeout:.0f} s:\n{_tail(logfile)}")


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5.0)


def server_command(
    port: int,
    tokens: Path,
    decisions: Path,
    core: int,
    profile_out: Path | None,
    *,
    noop: bool = False,
    stalls_out: Path | None = None,
    config: Path,
) -> list[str]:
    if noop:
        script = str(Path(__file__).resolve())
        cmd = [sys.executable, script, NOOP_SERVER, str(port), str(tokens), str(config)]
    else:
        cmd = [
            str(GPUWARDEN),
            "--log-level",
            "WARNING",
            "aggregator",
            "--listen",
            f"127.0.0.1:{port}",
            "--token-file",
            str(tokens),
            "--decisions",
            str(decisions),
            "--config",
            str(config),
        ]
    if profile_out is not None:
        cmd = [sys.executable, "-m", "cProfile", "-o", str(profile_out), *cmd]
    elif stalls_out is not None:
        cmd = [*stalls.wrapped(stalls_out, STALL_THRESHOLD_MS), *cmd]
    # taskset pins before the interpreter starts, so every thread the server ever makes is pinned.
    taskset = shutil.which("taskset")
    return [taskset, "-c", str(core), *cmd] if taskset else cmd


def http_run(
    work: Workload,
    tmp: Path,
    *,
    server_core: int,
    load_core: int,
    concurrency: int,
    max_seconds: float,
    paced_rate: float,
    profile_out: Path | None,
    noop: bool = False,
    stalls_out: Path | None = None,
    event_loop: str = "auto",
) -> HttpRun:
    tokens = tmp / "tokens"
    config = tmp / "server.yaml"
    config.write_text(f"server: {{event_loop: {event_loop}}}\n", encoding="utf-8")
    tokens.write_text(token_file_text(work.nodes) + f"viewer:bench {_VIEWER}\n", encoding="utf-8")
    decisions = tmp / f"decisions-{time.monotonic_ns()}.jsonl"
    logfile = tmp / "aggregator.log"
    port = free_port()
    ctx = multiprocessing.get_context("fork")
    with logfile.open("wb") as logf:
        proc = subprocess.Popen(
            server_command(
                port,
                tokens,
                decisions,
                server_core,
                profile_out,
                noop=noop,
                stalls_out=stalls_out,
                config=config,
            ),
            stdout=logf,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
    loader: multiprocessing.process.BaseProcess | None = None
    try:
        if not shutil.which("taskset"):
            os.sched_setaffinity(proc.pid, {server_core})
        _wait_ready(proc, port, logfile)
        rss_ready = proc_status_kb(proc.pid, "VmRSS")
        parent_end, child_end = ctx.Pipe(duplex=False)
        loader = ctx.Process(
            target=_load_process,
            args=(child_end, load_core, port, work, concurrency, proc.pid, max_seconds, paced_rate),
            daemon=True,
        )
        loader.start()
        child_end.close()
        if not parent_end.poll(max_seconds + 60.0):
            raise BenchError("the load process did not report back")
        raw = parent_end.recv()
        loader.join(timeout=10.0)
        if "error" in raw:
            raise BenchError(f"the load process failed: {raw['error']}")
        phases = {k: PhaseResult(**v) for k, v in raw.items()}
        rss = proc_status_kb(proc.pid, "VmHWM")
        rss_end = proc_status_kb(proc.pid, "VmRSS")
        status, nodes_body = _get(port, "/api/v1/nodes", timeout=30.0)
        nodes_known = len(json.loads(nodes_body)["nodes"]) if status == 200 else -1
        if proc.poll() is not None:
            raise BenchError(f"the aggregator died during the run:\n{_tail(logfile)}")
    finally:
        if loader is not None and loader.is_alive():
            loader.terminate()
            loader.join(timeout=5.0)
        _stop(proc)

    refused: Counter[str] = Counter()
    for ph in phases.values():
        refused.update(ph.refused)
    m = phases["measured"]
    if m.truncated or m.sent == 0:
        raise BenchError(f"--max-seconds {max_seconds} ran out before the measured rounds were sent")
    paced = phases.get("paced")
    decided = (
        sum(1 for line in decisions.read_bytes().splitlines() if line.strip()) if decisions.exists() else 0
    )
    return HttpRun(
        reports=m.sent,
        wall_s=m.wall_s,
        reports_per_s=m.sent / m.wall_s,
        server_cpu_us_per_report=m.server_cpu_s / m.sent * 1e6,
        server_cpu_share=m.server_cpu_s / m.wall_s,
        client_cpu_share=m.client_cpu_s / m.wall_s,
        p50_ms=percentile(m.latencies_ms, 50),
        p99_ms=percentile(m.latencies_ms, 99),
        paced_rate=paced_rate if paced else None,
        paced_reports_per_s=paced.sent / paced.wall_s if paced and paced.sent else None,
        paced_p50_ms=percentile(paced.latencies_ms, 50) if paced else None,
        paced_p99_ms=percentile(paced.latencies_ms, 99) if paced else None,
        paced_server_cpu_share=paced.server_cpu_s / paced.wall_s if paced and paced.wall_s else None,
        paced_lag_p99_ms=_ms(lag_quantile(paced.lag_buckets, 0.99)) if paced else None,
        paced_lag_worst_ms=_ms(paced.lag_worst_s) if paced else None,
        server_rss_mb=rss / 1024.0 if rss is not None else None,
        nodes_known=nodes_known,
        decisions=decided,
        refused=dict(refused),
        server_loop_cpu_us_per_report=m.server_loop_cpu_s / m.sent * 1e6,
        server_threads_cpu_share=(m.server_cpu_s - m.server_loop_cpu_s) / m.wall_s,
        server_rss_ready_mb=rss_ready / 1024.0 if rss_ready is not None else None,
        server_rss_end_mb=rss_end / 1024.0 if rss_end is not None else None,
        paced_collections=collections_summary(paced.collection_buckets) if paced else None,
    )


# ---- reporting ----------------------------------------------------------------------------------


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None or math.isinf(seconds) else seconds * 1000.0


def _median(runs: Sequence[HttpRun], key: str) -> float | None:
    values = [getattr(r, key) for r in runs if getattr(r, key) is not None]
    return statistics.median(values) if values else None


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or math.isnan(value) else format(value, spec)


def render(
    machine: dict[str, Any],
    params: dict[str, Any],
    inproc: list[InProcess],
    runs: list[HttpRun],
    noop: HttpRun | None,
) -> str:
    lines = [
        "## Aggregator ingest",
        "",
        f"Machine: {machine['cpu']}, {machine['nproc']} cores ({machine['python']}); server pinned to "
        f"core {params['server_core']}, load to core {params['load_core']}. Reports: {GPUS} GPUs x "
        f"{NVLINKS} NVLinks, {NICS} IB ports x {len(IB_COUNTERS)} counters, {params['json_bytes']} B JSON, "
        f"{params['gzip_bytes']:.0f} B on the wire ({_WIRE_NAMES[params['wire']]}). "
        f"{params['nodes']} nodes, {params['measured_reports']} measured "
        f"reports per run after a warm-up round, {params['concurrency']} keep-alive connections; "
        f"server.event_loop {params['event_loop']}.",
        "",
        "| measurement | CPU per report | reports/s per core |",
        "|---|---:|---:|",
    ]
    for ip in inproc:
        lines.append(f"| {ip.what}, in process | {ip.cpu_us_per_report:.0f} us | {ip.per_core:,.0f} |")
    if noop is not None:
        lines.append(
            "| HTTP service around a no-op pipeline (server process) | "
            f"{noop.server_cpu_us_per_report:.0f} us | {noop.per_core:,.0f} |"
        )
    med_cpu = _median(runs, "server_cpu_us_per_report")
    if med_cpu is not None:
        lines.append(
            f"| **full ingest over HTTP** (server process, median of {len(runs)}) | {med_cpu:.0f} us | "
            f"**{1e6 / med_cpu:,.0f}** |"
        )
    lines += [
        "",
        f"Target: {TARGET_PER_CORE:,.0f} reports/s per core ({NEEDED_PER_CORE:,.0f} needed for 7,500 nodes "
        "at 10 s).",
        "",
        "| run | reports/s (wall) | server CPU/report | per core | server CPU | load CPU | p50 | p99 | "
        "paced rate | paced p50 | paced p99 | paced server CPU | paced loop lag p99 | loop lag worst | RSS | "
        "nodes | decisions |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, r in enumerate(runs, 1):
        lines.append(
            f"| {i} | {r.reports_per_s:,.0f} | {r.server_cpu_us_per_report:.0f} us | {r.per_core:,.0f} | "
            f"{r.server_cpu_share:.0%} | {r.client_cpu_share:.0%} | {r.p50_ms:.1f} ms | {r.p99_ms:.1f} ms | "
            f"{_fmt(r.paced_reports_per_s, ',.0f')}/s | {_fmt(r.paced_p50_ms, '.1f')} ms | "
            f"{_fmt(r.paced_p99_ms, '.1f')} ms | {_fmt(r.paced_server_cpu_share, '.0%')} | "
            f"<= {_fmt(r.paced_lag_p99_ms, '.0f')} ms | {_fmt(r.paced_lag_worst_ms, '.0f')} ms | "
            f"{_fmt(r.server_rss_mb, '.0f')} MB | {r.nodes_known} | {r.decisions} |"
        )
    if runs:

        def med(key: str, spec: str) -> str:
            return _fmt(_median(runs, key), spec)

        lines.append(
            f"| median | {med('reports_per_s', ',.0f')} | {_fmt(med_cpu, '.0f')} us | "
            f"{_fmt(1e6 / med_cpu if med_cpu else None, ',.0f')} | {med('server_cpu_share', '.0%')} | "
            f"{med('client_cpu_share', '.0%')} | {med('p50_ms', '.1f')} ms | {med('p99_ms', '.1f')} ms | "
            f"{med('paced_reports_per_s', ',.0f')}/s | {med('paced_p50_ms', '.1f')} ms | "
            f"{med('paced_p99_ms', '.1f')} ms | {med('paced_server_cpu_share', '.0%')} | "
            f"<= {med('paced_lag_p99_ms', '.0f')} ms | {med('paced_lag_worst_ms', '.0f')} ms | "
            f"{med('server_rss_mb', '.0f')} MB | | |"
        )
    return "\n".join(lines)


# ---- main ---------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [NOOP_SERVER]:
        logging.basicConfig(level=logging.WARNING)
        return serve_noop(int(argv[1]), Path(argv[2]), Path(argv[3]))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--nodes", type=int, default=2000, help="simulated nodes (each has its own token)")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds (one report per node each)")
    p.add_argument("--runs", type=int, default=3, help="server runs; the table gives their median")
    p.add_argument("--concurrency", type=int, default=32, help="keep-alive connections of the load process")
    p.add_argument("--paced-rate", type=float, default=NEEDED_PER_CORE, help="reports/s of the paced phase")
    p.add_argument("--paced-seconds", type=float, default=4.0, help="length of the paced phase (0: none)")
    p.add_argument("--max-seconds", type=float, default=40.0, help="bound on one run's load")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--wire", choices=WIRES, default="json", help="gzip'd JSON, or the compact msgpack agents send now"
    )
    p.add_argument("--pool-nodes", type=int, default=0, help="nodes a pool (0: the whole fleet in one)")
    p.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        default="auto",
        help="the servers' server.event_loop (aggregator/eventloop.py): both the real and the no-op one",
    )
    p.add_argument("--json", type=Path, help="write the results here too")
    p.add_argument("--profile", action="store_true", help="one run, server and pipeline under cProfile")
    p.add_argument(
        "--stalls",
        type=Path,
        help="run the server under bench/stalls.py: one JSON line per loop hold over "
        f"{STALL_THRESHOLD_MS:.0f} ms, a file a run in this folder",
    )
    args = p.parse_args(argv)
    if args.stalls:
        args.stalls.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)

    server_core, load_core = server_and_load_cores()
    cores = sorted(os.sched_getaffinity(0))
    runs = 1 if args.profile else args.runs
    paced_rounds = (
        math.ceil(args.paced_rate * args.paced_seconds / args.nodes) if args.paced_seconds > 0 else 0
    )

    t0 = time.perf_counter()
    work = build_workload(
        args.nodes,
        1,
        args.rounds,
        paced_rounds,
        seed=args.seed,
        workers=len(cores),
        wire=args.wire,
        pool_nodes=args.pool_nodes,
    )
    log.info(
        "built %d reports in %.1f s (%d B JSON, %.0f B on the wire each)",
        len(work.warmup) + len(work.measured) + len(work.paced),
        time.perf_counter() - t0,
        work.json_bytes,
        work.gzip_bytes,
    )
    machine = {
        "cpu": cpu_model(),
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
    }
    params = {
        "nodes": args.nodes,
        "measured_reports": len(work.measured),
        "paced_reports": len(work.paced),
        "concurrency": args.concurrency,
        "paced_rate": args.paced_rate,
        "server_core": server_core,
        "load_core": load_core,
        "json_bytes": work.json_bytes,
        "gzip_bytes": work.gzip_bytes,
        "wire": work.wire,
        "event_loop": args.event_loop,
    }
    with tempfile.TemporaryDirectory(prefix="gpuwarden-bench-ingest-") as tmpname:
        tmp = Path(tmpname)
        with pinned(server_core):
            inproc = measure_in_process(work, tmp, args.profile)
        for ip in inproc:
            log.info(
                "%s: %.0f us per report, %.0f reports/s per core", ip.what, ip.cpu_us_per_report, ip.per_core
            )
        # Every HTTP run, the no-op pipeline's too, sends the same workload between the same cores.
        run_http = functools.partial(
            http_run,
            work,
            tmp,
            server_core=server_core,
            load_core=load_core,
            concurrency=args.concurrency,
            max_seconds=args.max_seconds,
            event_loop=args.event_loop,
        )
        results: list[HttpRun] = []
        for i in range(runs):
            prof_out = tmp / "server.prof" if args.profile else None
            stalls_out = args.stalls / f"ingest-{args.nodes}-run{i + 1}.jsonl" if args.stalls else None
            run = run_http(paced_rate=args.paced_rate, profile_out=prof_out, stalls_out=stalls_out)
            log.info(
                "run %d: %.0f reports/s wall, %.0f us server CPU per report (%.0f/s per core), "
                "server CPU %.0f%%, p50 %.1f ms, p99 %.1f ms, refused %s",
                i + 1,
                run.reports_per_s,
                run.server_cpu_us_per_report,
                run.per_core,
                run.server_cpu_share * 100,
                run.p50_ms,
                run.p99_ms,
                run.refused or "none",
            )
            results.append(run)
            if stalls_out is not None and stalls_out.exists():
                log.info("loop holds of run %d (%s):\n%s", i + 1, stalls_out, stalls.summarize(stalls_out))
            if prof_out is not None and prof_out.exists():
                print_profile(pstats.Stats(str(prof_out)), "aggregator server process (whole run)")
        noop = None
        if not args.profile:
            noop = run_http(paced_rate=0.0, profile_out=None, noop=True)
            log.info(
                "no-op pipeline: %.0f us server CPU per report (%.0f/s per core), %.0f reports/s wall",
                noop.server_cpu_us_per_report,
                noop.per_core,
                noop.reports_per_s,
            )
    print(render(machine, params, inproc, results, noop))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "machine": machine,
            "params": params,
            "in_process": [{**asdict(ip), "per_core": ip.per_core} for ip in inproc],
            "http_runs": [{**asdict(r), "per_core": r.per_core} for r in results],
            "http_noop_pipeline": {**asdict(noop), "per_core": noop.per_core} if noop else None,
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    every = [*results, *([noop] if noop else [])]
    bad = sum(sum(r.refused.values()) for r in every)
    if bad:
        print(f"\nFAILED: {bad} reports were not accepted: {[r.refused for r in every]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
