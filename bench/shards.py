"""A sharded fleet on one machine: 100,000 nodes over 4 shards at a 60 s interval, hard faults decided.

Run from the repository root (loopback only; about 10 minutes and 18 GB of memory at the
defaults; every process it starts is stopped, also on failure)::

    .venv/bin/python bench/shards.py [--nodes 100000] [--shards 4] [--interval 60]
        [--paced-rounds 4] [--json FILE]

What it does:

1. Generates every report ahead (``bench/_reports.py``: HGX H100 nodes, 8 GPUs x 18 NVLinks, 8
   NDR ports x 52 counters; the compact encoding agents send), in pools of ``--pool-nodes``: one
   warm-up round and ``--paced-rounds`` rounds, each node's reports ``--interval`` apart at its
   own phase, spread evenly over the interval (agents are not synchronized). One node on each
   shard reports XID 79 (a GPU fallen off the bus: quarantined at once by a rule) from the second
   paced round on.
2. Starts ``--shards`` ``gpuwarden aggregator`` processes on 127.0.0.1 (default rules, static
   tokens, no Kubernetes), each with ``sharding.shards``/``shard``/``peers`` set and the fleet's
   interval in ``fleet.interval_seconds`` (silence follows it: six intervals; ``shard_config`` says
   which two limits differ from the defaults, and why), not pinned: the shards and this process
   share the machine's cores.
3. The warm-up round, as fast as the shards take it: each node's first report goes to shard
   ``node % shards``, as an agent configured with any one shard's URL would send it; a 307 is
   followed to its ``Location`` and the node remembers its owner there (agent/shardroute.py).
   The script checks each learned owner is ``owner_of(pool, shards)``.
4. The paced rounds, open loop: node i's report of round r is due at ``T0 + r x interval +
   phase(i)`` and goes to its owner on one of ``--connections`` keep-alive connections a shard;
   its latency counts from when it was due (a late send is the system's delay too). A 503 is sent
   again after its ``Retry-After``, as the agent's spool does; the retries are counted.
5. A hard fault is *decided* when the owner's decision log holds it: the service answers a report
   whose decisions it wrote only once they are on disk (aggregator/service.py), so the time from
   the faulty report being due to its 200 bounds its report-to-decision time. The script checks
   each faulty node's record (state ``quarantined``, reason ``xid-79``) is in its owner's log and
   in no other's.
6. Per shard over the paced phase: its CPU (all threads, and the event loop's thread), its
   resident memory at the end over its nodes, its event loop's lag (the histogram's p99 bucket
   over the phase, and the worst of the last 60 s just after it), the decisions it logged; then
   the fleet-wide node list asked of shard 0 (``GET /api/v1/nodes``, which fans out) and one node
   asked of a shard that does not own it.

Markdown goes to stdout, progress to stderr, the figures to ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from _common import cpu_model, free_port, interpolated_percentile, proc_cpu_seconds, thread_cpu_seconds
from _reports import Fault, FaultKind, NodeSim, node_name, phase_offset, token_file_text, token_of
from ingest import GPUWARDEN, REPO, BenchError, _stop, _tail, pool_of, proc_status_kb
from prometheus_client.parser import text_string_to_metric_families

from agent.shipper import encode_body
from agent.wire import COMPACT_MEDIA_TYPE
from aggregator.service import REPORTS_PATH
from aggregator.shard.map import owner_of

log = logging.getLogger("bench.shards")

VIEWER = "bench-viewer-token-0123456789abcdef"
LAG = "gpuwarden_aggregator_event_loop_lag_seconds"
FAULT_ROUND = 2  # round 0 is the warm-up; the fault shows from the second paced round
# Under this share of the asked rate the shards are falling behind: the backlog, and with it the
# time to decide a fault, grows with the run's length, so a decision within the bound is luck.
KEPT_UP = 0.97
MAX_ATTEMPTS = 30  # tries of one report that found no shard listening (a second apart)
TARGET_DECIDED_S = 30.0  # the bound on a hard fault's report-to-decision at 100,000 nodes


# ---- the workload -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    nodes: int
    shards: int
    interval: float
    pool_nodes: int
    rounds: int  # warm-up + paced
    seed: int
    faulty: tuple[int, ...]  # one node a shard


def faulty_nodes(nodes: int, shards: int, pool_nodes: int) -> tuple[int, ...]:
    """One node a shard, in the middle of the first pool that shard owns."""
    picked: dict[int, int] = {}
    for first in range(0, nodes, pool_nodes):
        owner = owner_of(pool_of(first, pool_nodes), shards)
        if owner not in picked:
            picked[owner] = min(first + pool_nodes // 2, nodes - 1)
    return tuple(picked[s] for s in sorted(picked))


def phase(i: int, plan: Plan) -> float:
    return phase_offset(i, seed=plan.seed, jitter=plan.interval)


def _encode(args: tuple[Plan, int, int, float]) -> list[list[bytes]]:
    """Every round's body of nodes ``first..last-1`` (a worker process's share)."""
    plan, first, last, start = args
    out = []
    for i in range(first, last):
        sim = NodeSim(i, seed=plan.seed, interval=plan.interval, pool=pool_of(i, plan.pool_nodes))
        faults = [Fault(i, FaultKind.XID_79, FAULT_ROUND)] if i in plan.faulty else []
        off = phase(i, plan)
        out.append(
            [
                encode_body(sim.report(start + r * plan.interval + off, r, faults), compact=True)
                for r in range(plan.rounds)
            ]
        )
    return out


def generate(plan: Plan, workers: int) -> list[list[bytes]]:
    """bodies[node][round]. The newest round is about now: the server refuses reports far off its clock."""
    start = time.time() - plan.rounds * plan.interval
    step = math.ceil(plan.nodes / (workers * 8))
    chunks = [(plan, a, min(a + step, plan.nodes), start) for a in range(0, plan.nodes, step)]
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        parts = pool.map(_encode, chunks)
    return [bodies for part in parts for bodies in part]


# ---- a lean HTTP/1.1 client ---------------------------------------------------------------------
# aiohttp's client costs a few hundred microseconds a request; at 1,700 reports/s that is a core's
# share the shards need. The bodies and header lines are built ahead; this only writes and parses.


class Closed(Exception):
    """The server closed the connection (after an answer with ``Connection: close``, or mid-way)."""


@dataclass
class Answer:
    status: int
    location: str | None = None
    retry_after: float | None = None
    body: bytes = b""


class Conn:
    def __init__(self, port: int) -> None:
        self.port = port
        self._r: asyncio.StreamReader | None = None
        self._w: asyncio.StreamWriter | None = None

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._r is None or self._w is None:
            self._r, self._w = await asyncio.open_connection("127.0.0.1", self.port)
        return self._r, self._w

    def close(self) -> None:
        if self._w is not None:
            self._w.close()
        self._r = self._w = None

    async def post(self, head: bytes, body: bytes) -> Answer:
        for attempt in range(2):  # a keep-alive connection the server closed meanwhile: once more
            try:
                return await self._post(head, body)
            except (Closed, ConnectionError, asyncio.IncompleteReadError):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    async def _post(self, head: bytes, body: bytes) -> Answer:
        r, w = await self._open()
        w.writelines((head, b"Host: 127.0.0.1\r\nContent-Length: %d\r\n\r\n" % len(body), body))
        line = await r.readline()
        if not line:
            raise Closed
        ans = Answer(int(line.split(b" ", 2)[1]))
        length, close = 0, False
        while (h := await r.readline()) not in (b"\r\n", b""):
            k, _, v = h.partition(b":")
            k = k.strip().lower()
            if k == b"content-length":
                length = int(v)
            elif k == b"connection":
                close = v.strip().lower() == b"close"
            elif k == b"location":
                ans.location = v.strip().decode()
            elif k == b"retry-after":
                ans.retry_after = float(v)
        if length:
            ans.body = await r.readexactly(length)
        if close:
            self.close()
        return ans


def port_of(location: str) -> int:
    return int(location.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])


# ---- the load -----------------------------------------------------------------------------------


@dataclass
class Phase:
    sent: int = 0
    accepted: int = 0
    retries: int = 0
    redirects: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    latencies_ms: list[float] = field(default_factory=list)
    rounds_ms: dict[int, list[float]] = field(default_factory=dict)  # the same, by round
    wall_s: float = 0.0
    client_cpu_s: float = 0.0


@dataclass
class FaultTiming:
    node: str
    shard: int
    due_to_answer_s: float
    attempts: int


class Load:
    def __init__(self, plan: Plan, bodies: list[list[bytes]], ports: list[int], connections: int) -> None:
        self.plan, self.bodies, self.ports, self.connections = plan, bodies, ports, connections
        self.owner: dict[int, int] = {}  # node -> shard, learned from redirects
        self.faults: list[FaultTiming] = []
        start = f"POST {REPORTS_PATH} HTTP/1.1\r\nContent-Type: {COMPACT_MEDIA_TYPE}\r\n"
        self._heads = [f"{start}Authorization: Bearer {token_of(i)}\r\n".encode() for i in range(plan.nodes)]

    async def _send(
        self, conns: dict[int, Conn], item: tuple[int, int, int, float], res: Phase, errors: Counter[str]
    ) -> None:
        node, rnd, shard, due = item
        head, body = self._heads[node], self.bodies[node][rnd]
        attempts = 0
        while True:
            attempts += 1
            port = self.ports[shard]
            conn = conns.setdefault(port, Conn(port))
            try:
                ans = await conn.post(head, body)
            except (OSError, Closed, asyncio.IncompleteReadError) as exc:
                errors[type(exc).__name__] += 1
                if attempts >= MAX_ATTEMPTS:  # a shard that died: fail the run, do not hang it
                    raise BenchError(f"shard {shard} refused {attempts} tries: {exc!r}") from exc
                await asyncio.sleep(1.0)
                continue
            if ans.status == 307 and ans.location:
                res.redirects += 1
                shard = self.ports.index(port_of(ans.location))
                continue
            if ans.status == 503:  # shed or not ready: the agent's spool sends it again
                res.retries += 1
                await asyncio.sleep(ans.retry_after or 1.0)
                continue
            break
        res.sent += 1
        ms = (time.perf_counter() - due) * 1000.0
        res.latencies_ms.append(ms)
        res.rounds_ms.setdefault(rnd, []).append(ms)
        if ans.status == 200:
            res.accepted += 1
            self.owner[node] = shard
        else:
            errors[f"HTTP {ans.status} {ans.body[:60].decode(errors='replace')}"] += 1
        if node in self.plan.faulty and rnd == FAULT_ROUND:
            self.faults.append(FaultTiming(node_name(node), shard, time.perf_counter() - due, attempts))

    async def _run(self, items: Iterator[tuple[int, int, int, float]], senders: int, paced: bool) -> Phase:
        res, errors = Phase(), Counter[str]()
        wall0, cpu0 = time.perf_counter(), time.process_time()

        async def sender() -> None:
            conns: dict[int, Conn] = {}
            try:
                for node, rnd, shard, due in items:
                    if not paced:
                        await self._send(conns, (node, rnd, shard, time.perf_counter()), res, errors)
                        continue
                    if (wait := due - time.perf_counter()) > 0:
                        await asyncio.sleep(wait)
                    await self._send(conns, (node, rnd, shard, due), res, errors)
            finally:
                for c in conns.values():
                    c.close()

        await asyncio.gather(*(sender() for _ in range(senders)))
        res.wall_s = time.perf_counter() - wall0
        res.client_cpu_s = time.process_time() - cpu0
        res.errors = dict(errors)
        return res

    async def warmup(self) -> Phase:
        nodes = sorted(range(self.plan.nodes), key=lambda i: phase(i, self.plan))
        items = iter([(i, 0, i % self.plan.shards, 0.0) for i in nodes])
        return await self._run(items, self.connections * self.plan.shards, paced=False)

    async def paced(self, t0: float) -> Phase:
        """Every shard's items in due order, each shard on its own ``connections`` senders."""
        per_shard: list[list[tuple[int, int, int, float]]] = [[] for _ in self.ports]
        for i in range(self.plan.nodes):
            shard = self.owner.get(i, owner_of(pool_of(i, self.plan.pool_nodes), self.plan.shards))
            off = phase(i, self.plan)
            for r in range(1, self.plan.rounds):
                per_shard[shard].append((i, r, shard, t0 + (r - 1) * self.plan.interval + off))
        for items in per_shard:
            items.sort(key=lambda x: x[3])
        phases = await asyncio.gather(
            *(self._run(iter(items), self.connections, paced=True) for items in per_shard)
        )
        total = Phase()
        for p in phases:
            total.sent += p.sent
            total.accepted += p.accepted
            total.retries += p.retries
            total.redirects += p.redirects
            total.latencies_ms += p.latencies_ms
            for r, ms in p.rounds_ms.items():
                total.rounds_ms.setdefault(r, []).extend(ms)
            for k, n in p.errors.items():
                total.errors[k] = total.errors.get(k, 0) + n
        total.wall_s = max(p.wall_s for p in phases)
        total.client_cpu_s = max(p.client_cpu_s for p in phases)  # one process: each saw all of it
        return total


# ---- the shards ---------------------------------------------------------------------------------


@dataclass
class Shard:
    index: int
    port: int
    decisions: Path
    logfile: Path
    proc: Any = None


def shard_config(index: int, ports: Sequence[int], interval: float) -> str:
    """The defaults, but for the fleet's interval and two limits this one machine needs: the four
    shards and the load share two cores, so a shard's turn can wait a few of the others' time
    slices (a report shed after 1 s of waiting, not the default 0.25 s), and a shard's 25,000
    rows of the fleet-wide node list take seconds to write there (60 s for an answer, not 5)."""
    peers = ", ".join(f'"http://127.0.0.1:{p}"' for p in ports)
    return (
        f"fleet:\n  interval_seconds: {interval}\n"
        "server:\n  max_wait_seconds: 1.0\n"
        f"sharding:\n  shards: {len(ports)}\n  shard: {index}\n  peers: [[{peers}]]\n"
        "  fanout_timeout_seconds: 60\n"
    )


def start_shards(tmp: Path, plan: Plan) -> list[Shard]:
    tokens = tmp / "tokens"
    tokens.write_text(token_file_text(plan.nodes) + f"viewer:bench {VIEWER}\n", encoding="utf-8")
    ports = [free_port() for _ in range(plan.shards)]
    shards = []
    for i, port in enumerate(ports):
        cfg = tmp / f"shard-{i}.yaml"
        cfg.write_text(shard_config(i, ports, plan.interval), encoding="utf-8")
        s = Shard(i, port, tmp / f"decisions-{i}.jsonl", tmp / f"shard-{i}.log")
        cmd = [str(GPUWARDEN), "--log-level", "WARNING", "aggregator", "--listen", f"127.0.0.1:{port}"]
        cmd += ["--token-file", str(tokens), "--decisions", str(s.decisions), "--config", str(cfg)]
        with s.logfile.open("wb") as logf:
            s.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, cwd=REPO)
        shards.append(s)
    return shards


async def get(port: int, path: str, timeout: float = 120.0) -> tuple[int, bytes, float]:
    t0 = time.perf_counter()
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        auth = f"Authorization: Bearer {VIEWER}\r\n"
        w.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Connection: close\r\n\r\n".encode())
        raw = await asyncio.wait_for(r.read(), timeout)
    finally:
        w.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        body = dechunk(body)
    return int(head.split(b" ", 2)[1]), body, time.perf_counter() - t0


def dechunk(data: bytes) -> bytes:
    out, pos = [], 0
    while True:
        end = data.index(b"\r\n", pos)
        size = int(data[pos:end].split(b";")[0], 16)
        if size == 0:
            return b"".join(out)
        out.append(data[end + 2 : end + 2 + size])
        pos = end + 2 + size + 2


async def wait_ready(shards: list[Shard], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    for s in shards:
        while True:
            if s.proc.poll() is not None:
                raise BenchError(f"shard {s.index} exited with {s.proc.returncode}:\n{_tail(s.logfile)}")
            try:
                if (await get(s.port, "/readyz", timeout=2.0))[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise BenchError(f"shard {s.index} not ready in {timeout:.0f} s:\n{_tail(s.logfile)}")
            await asyncio.sleep(0.2)


async def lag(port: int) -> tuple[dict[float, float], float | None]:
    status, body, _ = await get(port, "/metrics")
    if status != 200:
        raise BenchError(f"/metrics answered {status}")
    buckets: dict[float, float] = {}
    worst = None
    for fam in text_string_to_metric_families(body.decode()):
        for sample in fam.samples:
            if sample.name == f"{LAG}_bucket":
                buckets[float(sample.labels["le"])] = sample.value
            elif sample.name == "gpuwarden_aggregator_event_loop_lag_max_seconds":
                worst = sample.value
    return buckets, worst


def bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float | None:
    counts = sorted((le, n - before.get(le, 0.0)) for le, n in after.items())
    if not counts or counts[-1][1] <= 0:
        return None
    return next(le for le, n in counts if n >= q * counts[-1][1])


def read_decisions(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


# ---- the run ------------------------------------------------------------------------------------


async def run(plan: Plan, shards: list[Shard], bodies: list[list[bytes]], connections: int) -> dict[str, Any]:
    await wait_ready(shards)
    nodes_of = Counter(owner_of(pool_of(i, plan.pool_nodes), plan.shards) for i in range(plan.nodes))
    rss_ready = [proc_status_kb(s.proc.pid, "VmRSS") or 0 for s in shards]
    load = Load(plan, bodies, [s.port for s in shards], connections)
    log.info("warm-up: %d reports, closed loop", plan.nodes)
    warm = await load.warmup()
    log.info("warm-up took %.0f s (%d redirects, %d retries)", warm.wall_s, warm.redirects, warm.retries)
    wrong = [i for i, s in load.owner.items() if s != owner_of(pool_of(i, plan.pool_nodes), plan.shards)]
    if wrong or len(load.owner) != plan.nodes:
        raise BenchError(f"{len(wrong)} nodes learned the wrong owner, {plan.nodes - len(load.owner)} none")
    lag_before = [await lag(s.port) for s in shards]
    cpu0 = [(proc_cpu_seconds(s.proc.pid), thread_cpu_seconds(s.proc.pid, s.proc.pid)) for s in shards]
    t0 = time.perf_counter() + 2.0
    log.info(
        "paced: %d rounds at a %.0f s interval (%.0f reports/s)",
        plan.rounds - 1,
        plan.interval,
        plan.nodes / plan.interval,
    )
    paced = await load.paced(t0)
    wall = time.perf_counter() - t0
    cpu1 = [(proc_cpu_seconds(s.proc.pid), thread_cpu_seconds(s.proc.pid, s.proc.pid)) for s in shards]
    lag_after = [await lag(s.port) for s in shards]
    per_shard = []
    faulty_names = {node_name(i) for i in plan.faulty}
    for k, s in enumerate(shards):
        if s.proc.poll() is not None:
            raise BenchError(f"shard {k} died:\n{_tail(s.logfile)}")
        rss = proc_status_kb(s.proc.pid, "VmRSS") or 0
        decided = read_decisions(s.decisions)
        per_shard.append(
            {
                "shard": k,
                "nodes": nodes_of[k],
                "cpu_share": (cpu1[k][0] - cpu0[k][0]) / wall,
                "loop_cpu_share": (cpu1[k][1] - cpu0[k][1]) / wall,
                "rss_mb": rss / 1024.0,
                "rss_kb_per_node": (rss - rss_ready[k]) / max(nodes_of[k], 1),
                "lag_p99_ms": 1000.0 * (bucket_quantile(lag_before[k][0], lag_after[k][0], 0.99) or math.nan),
                "lag_worst_60s_ms": 1000.0 * (lag_after[k][1] or math.nan),
                "decisions": dict(Counter(f"{d['subject']} {d['state']}" for d in decided)),
                # What else it decided on a healthy fleet: false alarms, with who raised them.
                "others": [
                    {
                        "node": d["node"],
                        "state": d["state"],
                        "why": sorted({r.get("rule") or r["detector"] for r in d["reasons"]}),
                    }
                    for d in decided
                    if d["node"] not in faulty_names
                ][:20],
            }
        )
    # Each faulty node's quarantine is in its owner's log, and in no other's.
    checks = []
    for f in load.faults:
        where = [
            k
            for k, s in enumerate(shards)
            if any(
                d["node"] == f.node
                and d["state"] == "quarantined"
                and any(r.get("rule") == "xid-79" for r in d["reasons"])
                for d in read_decisions(s.decisions)
            )
        ]
        checks.append(
            {
                "node": f.node,
                "owner": f.shard,
                "logged_on": where,
                "due_to_decided_s": f.due_to_answer_s,
                "attempts": f.attempts,
            }
        )
    status, body, took = await get(shards[0].port, "/api/v1/nodes")
    fleet = json.loads(body) if status == 200 else {}
    other = (load.faults[0].shard + 1) % plan.shards if load.faults else 0
    n_status, n_body, n_took = (
        await get(shards[other].port, f"/api/v1/nodes/{load.faults[0].node}")
        if load.faults
        else (0, b"", 0.0)
    )
    return {
        "warmup": {k: v for k, v in asdict(warm).items() if k not in {"latencies_ms", "rounds_ms"}}
        | {"p50_ms": _pct(warm.latencies_ms, 50), "p99_ms": _pct(warm.latencies_ms, 99)},
        "paced": {k: v for k, v in asdict(paced).items() if k not in {"latencies_ms", "rounds_ms"}}
        | {
            "rate": plan.nodes / plan.interval,
            "achieved_per_s": paced.sent / wall,
            "p50_ms": _pct(paced.latencies_ms, 50),
            "p99_ms": _pct(paced.latencies_ms, 99),
            "max_ms": max(paced.latencies_ms, default=math.nan),
            # A backlog shows as a median that grows from round to round.
            "rounds": [
                {"round": r, "p50_ms": _pct(ms, 50), "max_ms": max(ms)}
                for r, ms in sorted(paced.rounds_ms.items())
            ],
        },
        "shards": per_shard,
        "faults": checks,
        "fleet_view": {
            "status": status,
            "nodes": len(fleet.get("nodes", [])),
            "partial": fleet.get("partial"),
            "seconds": took,
            "one_node_status": n_status,
            "one_node_shard": json.loads(n_body).get("shard") if n_status == 200 else None,
            "one_node_seconds": n_took,
        },
    }


def _pct(values: Sequence[float], q: float) -> float:
    return interpolated_percentile(values, q) if values else math.nan


def render(plan: Plan, out: dict[str, Any]) -> str:
    p, w = out["paced"], out["warmup"]
    client = p["client_cpu_s"] / max(p["wall_s"], 1e-9)
    lines = [
        f"{plan.nodes:,} nodes over {plan.shards} shards, {plan.interval:.0f} s interval, "
        f"pools of {plan.pool_nodes:,} ({os.cpu_count()} CPUs, {cpu_model()})",
        "",
        f"- warm-up round (closed loop): {w['sent']:,} reports in {w['wall_s']:.0f} s, "
        f"{w['redirects']:,} redirects followed, {w['retries']:,} 503s sent again",
        f"- paced: {p['sent']:,} reports at {p['achieved_per_s']:,.0f}/s (asked {p['rate']:,.0f}/s), "
        f"due-to-answer p50 {p['p50_ms']:.0f} ms, p99 {p['p99_ms']:.0f} ms, max {p['max_ms']:.0f} ms; "
        f"{p['retries']:,} 503s sent again; errors {p['errors'] or 'none'}; "
        f"load process {client:.0%} of a core",
        "",
        "| shard | nodes | CPU (all threads) | event loop | RSS | RSS a node | loop lag p99 | worst (60 s) "
        "| decisions |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for s in out["shards"]:
        lines.append(
            f"| {s['shard']} | {s['nodes']:,} | {s['cpu_share']:.0%} | {s['loop_cpu_share']:.0%} "
            f"| {s['rss_mb']:,.0f} MB | {s['rss_kb_per_node']:.0f} KB | {s['lag_p99_ms']:.0f} ms "
            f"| {s['lag_worst_60s_ms']:.0f} ms "
            f"| {', '.join(f'{k}: {n}' for k, n in sorted(s['decisions'].items())) or 'none'} |"
        )
    lines += [
        "",
        "| faulty node | owner | quarantine logged on | report due to decided | attempts |",
        "|---|---:|---|---:|---:|",
    ]
    for f in out["faults"]:
        lines.append(
            f"| {f['node']} | {f['owner']} | {f['logged_on']} | {f['due_to_decided_s']:.2f} s "
            f"| {f['attempts']} |"
        )
    fv = out["fleet_view"]
    lines += [
        "",
        f"- fleet-wide node list from shard 0: HTTP {fv['status']}, {fv['nodes']:,} nodes, "
        f"partial {fv['partial']}, {fv['seconds']:.1f} s; one faulty node asked of another shard: "
        f"HTTP {fv['one_node_status']} "
        f"(shard {fv['one_node_shard']}), {fv['one_node_seconds']:.2f} s",
        "- paced rounds, due to answered p50 / max: "
        + "; ".join(f"{r['p50_ms']:,.0f} / {r['max_ms']:,.0f} ms" for r in p["rounds"]),
    ]
    others = [o for s in out["shards"] for o in s["others"]]
    if others:
        lines.append(
            "- other decisions on the healthy nodes: "
            + "; ".join(f"{o['node']} {o['state']} ({', '.join(o['why'])})" for o in others)
        )
    return "\n".join(lines)


def passed(plan: Plan, out: dict[str, Any]) -> list[str]:
    problems = []
    for f in out["faults"]:
        if f["logged_on"] != [f["owner"]]:
            problems.append(f"{f['node']}: quarantine logged on {f['logged_on']}, owner {f['owner']}")
        if f["due_to_decided_s"] > TARGET_DECIDED_S:
            problems.append(f"{f['node']}: decided {f['due_to_decided_s']:.1f} s after its report")
    if len(out["faults"]) != len(plan.faulty):
        problems.append(f"{len(out['faults'])} of {len(plan.faulty)} faulty reports answered")
    p = out["paced"]
    if p["achieved_per_s"] < KEPT_UP * p["rate"]:
        problems.append(
            f"the shards fell behind: {p['achieved_per_s']:,.0f} reports/s of {p['rate']:,.0f} "
            f"(median wait {p['rounds'][0]['p50_ms']:,.0f} ms in the first paced round, "
            f"{p['rounds'][-1]['p50_ms']:,.0f} ms in the last): a longer run decides later"
        )
    if out["paced"]["errors"]:
        problems.append(f"errors: {out['paced']['errors']}")
    if out["fleet_view"]["nodes"] != plan.nodes:
        problems.append(f"the fleet view listed {out['fleet_view']['nodes']} of {plan.nodes} nodes")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--nodes", type=int, default=100_000)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--interval", type=float, default=60.0, help="seconds between a node's reports")
    ap.add_argument("--pool-nodes", type=int, default=2000)
    ap.add_argument("--paced-rounds", type=int, default=4)
    ap.add_argument("--connections", type=int, default=8, help="keep-alive connections a shard")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes generating reports")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")
    if args.paced_rounds < FAULT_ROUND:
        ap.error(f"--paced-rounds must be at least {FAULT_ROUND}: the faults show in round {FAULT_ROUND}")
    plan = Plan(
        nodes=args.nodes,
        shards=args.shards,
        interval=args.interval,
        pool_nodes=args.pool_nodes,
        rounds=1 + args.paced_rounds,
        seed=args.seed,
        faulty=faulty_nodes(args.nodes, args.shards, args.pool_nodes),
    )
    t = time.perf_counter()
    bodies = generate(plan, args.workers)
    log.info("generated %d reports in %.0f s", plan.nodes * plan.rounds, time.perf_counter() - t)
    started = datetime.now(UTC)
    with tempfile.TemporaryDirectory(prefix="gpuwarden-shards-") as d:
        shards = start_shards(Path(d), plan)
        try:
            out = asyncio.run(run(plan, shards, bodies, args.connections))
        finally:
            for s in shards:
                _stop(s.proc)
    out["plan"] = asdict(plan)
    out["machine"] = {"cpus": os.cpu_count(), "cpu": cpu_model(), "python": platform.python_version()}
    out["started"] = started.isoformat(timespec="seconds")
    out["body_bytes_mean"] = statistics.fmean(len(b[1]) for b in bodies[:1000])
    problems = passed(plan, out)
    out["problems"] = problems
    print(render(plan, out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    for p in problems:
        print(f"FAILED: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
