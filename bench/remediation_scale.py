"""Remediation throughput at fleet scale: a hard-fault storm on 7,500 nodes, against the API-server
double in another process.

Run from the repository root (about 1.5 minutes; loopback only; the double's process is stopped
also on failure)::

    .venv/bin/python bench/remediation_scale.py [--nodes 7500] [--pools 75] [--faults 375]
        [--later 20] [--qps Q] [--burst B] [--workers W] [--throttle-share S] [--json FILE]

What it does:

1. Starts ``tests/kube_double.py``'s API-server double in a child process on 127.0.0.1 (so its
   own CPU is not the aggregator's), with ``--nodes`` Nodes in ``--pools`` pools (the
   ``gpuwarden.io/pool`` label) and API-server-like latencies: GET, PATCH, POST and PUT answered
   after 5-20 ms, the LIST of all Nodes after 1-3 s, a watch's stream starting after 50-200 ms.
   The child logs every request (start, end, verb, path, status) and hands the log back at the end.
   ``--throttle-share S`` has it answer that share of Node and Event calls 429 with ``Retry-After:
   --throttle-retry-after`` (1 s), as API Priority and Fairness sheds a busy flow.
2. In this process: the aggregator as ``gpuwarden aggregator --remediation enforce`` builds it
   (``aggregator.app.build_aggregator``, its own ``KubeClient`` from a kubeconfig, one replica so it
   leads), limits set so the storm is allowed: ``max_pool_share`` 0.1 of 100-node pools is 10 a
   pool, ``max_per_hour`` 400. Fleet detectors are off (the hard fault is a rule; their cost is
   measured by bench/detection.py).
3. The fleet reports at its 10 s pace (every node once per ``--interval``, spread evenly: 750
   reports/s at 7,500 nodes), fed straight into ``Pipeline.ingest`` (the HTTP decode's cost is
   bench/ingest.py's subject; here it would only compete for the same core).
4. After one full round, ``--faults`` nodes (the same share of every pool) report XID 79 (GPU
   fallen off the bus: out at once) in one burst. Timing: from their reports to the last node's
   taint (the double's answer to its PATCH), writes/s and API requests/s by verb over that
   window, 429s, the most requests in any 1 s (the token bucket's bound is ``burst + qps``).
5. Then ``--later`` single faults, one a second, while the fleet keeps reporting: report-to-taint
   p50 and p99 for one fault on a busy aggregator.

Markdown goes to stdout, progress to stderr, the figures to ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.clock import SystemClock
from agent.report import Report
from aggregator.app import build_aggregator
from aggregator.config import Config, LeaderConfig, LimitsConfig, RemediationConfig
from aggregator.kube.api import KubeApi
from aggregator.kube.client import KubeClient
from aggregator.rules import default_rules_dir, load_rules
from bench._common import interpolated_percentile, proc_cpu_seconds
from tests.kube_double import KubeApiDouble, _verb
from tests.rulekit import report, xid

POOL_LABEL = "gpuwarden.io/pool"
TAINT_KEY = "gpuwarden.io/unhealthy"
NODE_WRITE_VERBS = frozenset({"patch", "create", "update"})

# -- the double's process -------------------------------------------------------------------------


class _TimedDouble(KubeApiDouble):
    """The double, logging every request with when it came, when it was answered and how."""

    def __init__(self) -> None:
        super().__init__(seed=1)
        self.log: list[tuple[float, float, str, str, int]] = []

    @web.middleware
    async def _record(self, request: web.Request, handler: Any) -> web.StreamResponse:
        start = time.time()
        response = await super()._record(request, handler)
        self.log.append((start, time.time(), _verb(request), request.path, response.status))
        return response


def node_name(pool: int, index: int) -> str:
    return f"gpu-p{pool:03d}-{index:03d}"


async def serve_double(args: argparse.Namespace) -> None:
    double = _TimedDouble()
    await double.start()
    double.set_latency("get", (0.005, 0.02))
    double.set_latency("patch", (0.005, 0.02))
    double.set_latency("create", (0.005, 0.02))
    double.set_latency("update", (0.005, 0.02))
    double.set_latency("list", (1.0, 3.0), path_regex=r"^/api/v1/nodes$")
    double.set_latency("watch", (0.05, 0.2))
    if args.throttle_share > 0:
        # API Priority and Fairness shedding the workload's own flow: Node and Event calls. The
        # Lease renewals go through the leader-election priority level, which this leaves alone.
        double.throttle(
            share=args.throttle_share,
            retry_after=args.throttle_retry_after,
            path_regex=r"^/api/v1/(nodes|namespaces/[^/]+/events)",
        )
    per_pool = args.nodes // args.pools
    for p in range(args.pools):
        for i in range(per_pool):
            double.add_node(node_name(p, i), labels={POOL_LABEL: f"pool-{p:03d}"})
    double.write_kubeconfig(Path(args.kubeconfig))
    print(json.dumps({"ready": True, "url": double.url}), flush=True)
    while True:
        line = (await asyncio.to_thread(sys.stdin.readline)).strip()
        if line.startswith("dump "):
            Path(line[5:]).write_text(json.dumps({"log": double.log, "throttled": double.throttled}))
            print(json.dumps({"dumped": len(double.log)}), flush=True)
        elif not line or line == "quit":
            break
    await double.close()


# -- the aggregator's side ------------------------------------------------------------------------


class Fleet:
    """One report per node, refreshed (time, seq) each time it is sent; straight into the pipeline."""

    def __init__(self, names: list[str], ingest: Any) -> None:
        now = time.time()
        self.names = names
        self.base = {n: report(now, node=n, boot_id="boot-a", seq=0) for n in names}
        self.seq = dict.fromkeys(names, 0)
        self._ingest = ingest
        self.fed = 0

    def send(self, node: str, *, fault: bool = False) -> float:
        self.seq[node] += 1
        now = time.time()
        events = [xid(79, gpu=3, at=now)] if fault else msgspec.UNSET
        rep: Report = msgspec.structs.replace(self.base[node], time=now, seq=self.seq[node], events=events)
        self._ingest(rep, now)
        self.fed += 1
        return now

    async def keep_reporting(self, interval: float, stop: asyncio.Event, lag: list[float]) -> None:
        """Every node once per ``interval``, in slices every 0.1 s; ``lag``: how late each slice ran."""
        tick = 0.1
        per_tick = max(1, round(len(self.names) * tick / interval))
        i = 0
        due = time.monotonic()
        while not stop.is_set():
            lag.append(max(0.0, time.monotonic() - due))
            for _ in range(per_tick):
                self.send(self.names[i % len(self.names)])
                i += 1
            due += tick
            await asyncio.sleep(max(0.0, due - time.monotonic()))


def _pct(values: list[float], q: float) -> float | None:
    return round(interpolated_percentile(values, q), 3) if values else None


async def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="remscale-"))
    kubeconfig = tmp / "kubeconfig"
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--serve-double",
        "--nodes",
        str(args.nodes),
        "--pools",
        str(args.pools),
        "--kubeconfig",
        str(kubeconfig),
        "--throttle-share",
        str(args.throttle_share),
        "--throttle-retry-after",
        str(args.throttle_retry_after),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        ready = json.loads(await asyncio.wait_for(child.stdout.readline(), 120))
        assert ready.get("ready"), ready
        return await _measure(args, tmp, kubeconfig, child)
    finally:
        with contextlib.suppress(Exception):
            child.stdin.write(b"quit\n")
            await child.stdin.drain()
            await asyncio.wait_for(child.wait(), 10)
        if child.returncode is None:
            child.kill()
            await child.wait()


async def _measure(
    args: argparse.Namespace, tmp: Path, kubeconfig: Path, child: asyncio.subprocess.Process
) -> dict[str, Any]:
    assert child.stdin is not None and child.stdout is not None
    per_pool = args.nodes // args.pools
    names = [node_name(p, i) for p in range(args.pools) for i in range(per_pool)]
    (tmp / "tokens").write_text("gpu-p000-000 token-for-the-bench-0123456789\n")
    rc = RemediationConfig(
        mode="enforce",
        limits=LimitsConfig(max_pool_share=0.1, max_per_hour=400),
        leader=LeaderConfig(namespace="gpuwarden"),
    )
    overrides = {k: v for k, v in (("qps", args.qps), ("burst", args.burst), ("workers", args.workers)) if v}
    rc = msgspec.structs.replace(rc, **overrides)
    config = Config(remediation=rc)

    async def connect() -> KubeApi:
        return await KubeClient.from_kubeconfig(kubeconfig)

    agg = await build_aggregator(
        config,
        load_rules([default_rules_dir()]),
        auth=tmp / "tokens",
        clock=SystemClock(),
        kube=connect,
        identity="bench-0",
        detectors=(),
    )
    remediation = agg.remediation
    assert remediation is not None
    stop_serving = asyncio.Event()
    server = asyncio.create_task(agg.serve("127.0.0.1", 0, stop=stop_serving, shutdown_timeout_s=1.0))
    started = time.monotonic()
    while not (remediation.ready and remediation.acting):  # leading, and the fence lets it write
        await asyncio.sleep(0.05)
        assert time.monotonic() - started < 120, "the aggregator never synced and led"
    print(f"synced and leading after {time.monotonic() - started:.1f} s", file=sys.stderr)

    fleet = Fleet(names, agg.pipeline.ingest)
    stop = asyncio.Event()
    lag: list[float] = []
    feeder = asyncio.create_task(fleet.keep_reporting(args.interval, stop, lag))
    while fleet.fed < len(names):  # one paced round, so every node is known, before the storm
        await asyncio.sleep(0.1)
    print(f"one round fed, {args.interval:g} s pace", file=sys.stderr)

    def tainted(node: str) -> bool:
        cached = remediation.actuator.cached(node)
        return cached is not None and any(t.key == TAINT_KEY for t in cached.taints)

    share = args.faults // args.pools
    storm = [node_name(p, i) for p in range(args.pools) for i in range(share)]
    later = [node_name(p % args.pools, share + p // args.pools) for p in range(args.later)]
    await asyncio.sleep(2.0)
    fault_at: dict[str, float] = {}
    cpu0 = (proc_cpu_seconds(os.getpid()), proc_cpu_seconds(child.pid), time.time())
    for n in storm:
        fault_at[n] = fleet.send(n, fault=True)
    print(f"{len(storm)} faults reported", file=sys.stderr)
    while not all(tainted(n) for n in storm):
        await asyncio.sleep(0.05)
        assert time.time() - cpu0[2] < 300, "the storm was not tainted within 300 s"
    cpu1 = (proc_cpu_seconds(os.getpid()), proc_cpu_seconds(child.pid), time.time())
    load_storm = os.getloadavg()[0]
    print(f"storm tainted after {cpu1[2] - cpu0[2]:.1f} s", file=sys.stderr)
    await asyncio.sleep(2.0)
    for n in later:
        fault_at[n] = fleet.send(n, fault=True)
        await asyncio.sleep(1.0)
    while not all(tainted(n) for n in later):
        await asyncio.sleep(0.05)
        assert time.time() - fault_at[later[-1]] < 120, "a later fault was not tainted within 120 s"
    load_later = os.getloadavg()[0]
    stop.set()
    await feeder

    dump = tmp / "requests.json"
    child.stdin.write(f"dump {dump}\n".encode())
    await child.stdin.drain()
    await asyncio.wait_for(child.stdout.readline(), 60)
    log: list[list[Any]] = json.loads(dump.read_text())["log"]
    stop_serving.set()
    await server
    return analyse(args, log, fault_at, storm, later, cpu0, cpu1, lag, load_storm, load_later, fleet.fed)


def analyse(  # noqa: PLR0917 - one call site, every figure it reports
    args: argparse.Namespace,
    log: list[list[Any]],
    fault_at: dict[str, float],
    storm: list[str],
    later: list[str],
    cpu0: tuple[float, float, float],
    cpu1: tuple[float, float, float],
    lag: list[float],
    load_storm: float,
    load_later: float,
    fed: int,
) -> dict[str, Any]:
    taint_at: dict[str, float] = {}
    patches: Counter[str] = Counter()
    for start, end, verb, path, status in log:
        if verb == "patch" and path.startswith("/api/v1/nodes/") and not path.endswith("/status"):
            node = path.rsplit("/", 1)[1]
            if status == 200 and node in fault_at and start >= fault_at[node] and node not in taint_at:
                taint_at[node] = end
            if status == 200:
                patches[node] += 1
    t0 = min(fault_at[n] for n in storm)
    t_end = max(taint_at[n] for n in storm)
    window = [e for e in log if t0 <= e[0] <= t_end]
    span = t_end - t0
    by_verb = Counter(e[2] for e in window)
    writes = sum(1 for e in window if e[2] in NODE_WRITE_VERBS and e[4] < 300)
    # The Lease's renewals are the elector's, outside the bucket; everything else passes it.
    starts = sorted(e[0] for e in log if e[2] != "watch" and "/leases" not in e[3] and e[0] >= t0)
    peak, j = 0, 0
    for i, s in enumerate(starts):  # the most requests started within any 1 s
        while starts[j] < s - 1.0:
            j += 1
        peak = max(peak, i - j + 1)
    storm_lat = [taint_at[n] - fault_at[n] for n in storm]
    later_lat = [taint_at[n] - fault_at[n] for n in later]
    rc = RemediationConfig()
    return {
        "nodes": args.nodes,
        "pools": args.pools,
        "faults": len(storm),
        "qps": args.qps or rc.qps,
        "burst": args.burst or rc.burst,
        "workers": args.workers or rc.workers,
        "interval_s": args.interval,
        "reports_fed": fed,
        "storm_all_tainted_s": round(span, 2),
        "storm_nodes_per_s": round(len(storm) / span, 1),
        "storm_report_to_taint_p50_s": _pct(storm_lat, 50),
        "storm_report_to_taint_p99_s": _pct(storm_lat, 99),
        "writes_per_s": round(writes / span, 1),
        "requests_per_s_by_verb": {v: round(c / span, 1) for v, c in sorted(by_verb.items())},
        "http_429": sum(1 for e in log if e[4] == 429),
        "peak_requests_in_1s": peak,
        "nodes_patched_more_than_once": sum(1 for n in storm + later if patches[n] > 1),
        "later_faults": len(later),
        "later_report_to_taint_p50_s": _pct(later_lat, 50),
        "later_report_to_taint_p99_s": _pct(later_lat, 99),
        "later_report_to_taint_max_s": round(max(later_lat), 3) if later_lat else None,
        "later_report_to_taint_s": [round(v, 3) for v in later_lat],
        "aggregator_cpu_share_storm": round((cpu1[0] - cpu0[0]) / span, 2),
        "double_cpu_share_storm": round((cpu1[1] - cpu0[1]) / span, 2),
        "feeder_lag_p99_s": _pct(lag, 99),
        "feeder_lag_median_s": round(statistics.median(lag), 3) if lag else None,
        "loadavg_1m_storm": round(load_storm, 2),
        "loadavg_1m_later": round(load_later, 2),
        "cpus": os.cpu_count(),
    }


def markdown(r: dict[str, Any]) -> str:
    verbs = ", ".join(f"{v} {c}" for v, c in r["requests_per_s_by_verb"].items())
    rows = [
        ("nodes / pools / simultaneous hard faults", f"{r['nodes']} / {r['pools']} / {r['faults']}"),
        ("client QPS / burst / workers", f"{r['qps']:g} / {r['burst']} / {r['workers']}"),
        ("all faults tainted after", f"{r['storm_all_tainted_s']} s ({r['storm_nodes_per_s']} nodes/s)"),
        (
            "storm report-to-taint p50 / p99",
            f"{r['storm_report_to_taint_p50_s']} s / {r['storm_report_to_taint_p99_s']} s",
        ),
        ("writes/s during the storm", f"{r['writes_per_s']}"),
        ("API requests/s by verb during the storm", verbs),
        (
            "most requests started in any 1 s",
            f"{r['peak_requests_in_1s']} (bucket bound {r['burst'] + r['qps']:g})",
        ),
        ("429s", f"{r['http_429']}"),
        ("faulted nodes patched more than once", f"{r['nodes_patched_more_than_once']}"),
        (
            f"one later fault ({r['later_faults']}, fleet reporting): report-to-taint p50 / p99 / max",
            f"{r['later_report_to_taint_p50_s']} s / {r['later_report_to_taint_p99_s']} s / "
            f"{r['later_report_to_taint_max_s']} s",
        ),
        (
            "CPU share during the storm: aggregator / double",
            f"{r['aggregator_cpu_share_storm']} / {r['double_cpu_share_storm']}",
        ),
        ("fleet feed lag median / p99", f"{r['feeder_lag_median_s']} s / {r['feeder_lag_p99_s']} s"),
        (
            "load average (1 min) at storm end / at the end",
            f"{r['loadavg_1m_storm']} / {r['loadavg_1m_later']}",
        ),
    ]
    out = ["| measure | value |", "| --- | --- |"]
    out += [f"| {a} | {b} |" for a, b in rows]
    return "\n".join(out)


_STANDARD = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class _ExtraFormatter(logging.Formatter):
    """The message and its structured fields (``extra``)."""

    def format(self, record: logging.LogRecord) -> str:
        extra = {k: v for k, v in vars(record).items() if k not in _STANDARD}
        return f"{super().format(record)} {extra}" if extra else super().format(record)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=7500)
    parser.add_argument("--pools", type=int, default=75)
    parser.add_argument("--faults", type=int, default=375)
    parser.add_argument("--later", type=int, default=20)
    parser.add_argument("--interval", type=float, default=10.0, help="each node reports this often (s)")
    parser.add_argument("--qps", type=float, default=0.0, help="client QPS (0: the config's default)")
    parser.add_argument("--burst", type=int, default=0, help="client burst (0: the config's default)")
    parser.add_argument("--workers", type=int, default=0, help="reconcile workers (0: the default)")
    parser.add_argument(
        "--throttle-share", type=float, default=0.0, help="share of Node and Event calls answered 429"
    )
    parser.add_argument("--throttle-retry-after", type=int, default=1, help="the 429s' Retry-After (s)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--verbose", action="store_true", help="the aggregator's warnings and more to stderr")
    parser.add_argument("--serve-double", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kubeconfig", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_double:
        asyncio.run(serve_double(args))
        return
    if args.verbose:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_ExtraFormatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
        logging.basicConfig(level=logging.INFO, handlers=[handler])
    result = asyncio.run(run(args))
    print(markdown(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
