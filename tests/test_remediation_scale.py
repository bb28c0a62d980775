"""Remediation throughput properties at a small fleet's scale: a storm of hard faults is tainted,
paced by the token bucket, one write of each kind per node and decision.

The aggregator is built by the composition root (``aggregator.app.build_aggregator``, remediation
``enforce``, its own ``KubeClient`` over HTTP) against the API-server double, which logs when each
request arrived. 500 nodes in 5 pools of 100 (the pool-share limit of 0.1 allows 10 a pool),
25 of them report XID 79 (fell off the bus) at once. Reports go straight into the pipeline: this
is about the writes, not the ingest. Timing figures are bench/remediation_scale.py's; what is
asserted here does not depend on the machine's speed, only that the storm ends within the bound.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import msgspec

from agent.clock import SystemClock
from aggregator.app import build_aggregator
from aggregator.config import Config, LeaderConfig, LimitsConfig, RemediationConfig
from aggregator.kube.api import KubeApi
from aggregator.kube.client import KubeClient
from aggregator.rules import default_rules_dir, load_rules
from tests.kube_double import Intercepted, KubeApiDouble
from tests.rulekit import report, xid

POOLS = 5
PER_POOL = 100
FAULTS_PER_POOL = 5
QPS = 40.0
BURST = 10
OURS = "gpuwarden.io/unhealthy"
WAIT_S = 25.0


class Calls(Intercepted):
    """The aggregator's client, noting when each node call was made (right after the actuator
    took its token: nothing awaits in between). The double's arrival times would not do: the
    aggregator and the double share a loop here, and a stall delivers spaced calls together."""

    def __init__(self, inner: KubeClient) -> None:
        super().__init__(inner)
        self.made: list[tuple[float, str]] = []

    def before(self, op: str) -> None:
        if op in ("get", "patch", "condition", "event"):  # the bucket's; not the Lease's, not the informer's
            self.made.append((time.monotonic(), op))


def name(pool: int, i: int) -> str:
    return f"gpu-p{pool}-{i:03d}"


async def test_a_storm_of_hard_faults_is_tainted_once_each_within_the_bucket(tmp_path: Path) -> None:
    calls: Calls | None = None
    async with KubeApiDouble() as double:
        for p in range(POOLS):
            for i in range(PER_POOL):
                double.add_node(name(p, i), labels={"gpuwarden.io/pool": f"pool-{p}"})
        # Writes answered 20 ms after they are applied: every write's watch event overtakes its
        # answer, as it may on a real API server, which orders neither before the other.
        double.set_latency("patch", 0.02, path_regex=r"^/api/v1/nodes/")
        # And a slow LIST of Leases (the fence's): leading comes before being let write.
        double.set_latency("list", 1.0, path_regex=r"/leases$")
        (tmp_path / "tokens").write_text("gpu-p0-000 token-for-the-scale-test-0123456789\n")
        config = Config(
            remediation=RemediationConfig(
                mode="enforce",
                qps=QPS,
                burst=BURST,
                limits=LimitsConfig(max_pool_share=0.1, max_per_hour=100),
                leader=LeaderConfig(namespace="gpuwarden"),
            )
        )

        async def connect() -> KubeApi:
            nonlocal calls
            calls = Calls(await KubeClient.from_kubeconfig(double.write_kubeconfig(tmp_path / "kubeconfig")))
            return calls

        agg = await build_aggregator(
            config,
            load_rules([default_rules_dir()]),
            auth=tmp_path / "tokens",
            clock=SystemClock(),
            kube=connect,
            identity="scale-0",
            detectors=(),
        )
        remediation = agg.remediation
        assert remediation is not None
        stop = asyncio.Event()
        server = asyncio.create_task(agg.serve("127.0.0.1", 0, stop=stop, shutdown_timeout_s=1.0))
        try:
            deadline = time.monotonic() + WAIT_S
            # Acting, not only leading: the fence's first check (a LIST of Leases) lets it write,
            # and the resync that follows it must not land in the healthy round below.
            while not (remediation.ready and remediation.acting):
                assert time.monotonic() < deadline, "never synced and led"
                await asyncio.sleep(0.02)
            # Every pool's size comes from the informer cache: 100 each, so 10 may be out.
            assert all(remediation.pool_size(f"pool-{p}") == PER_POOL for p in range(POOLS))

            now = time.time()
            nodes = [name(p, i) for p in range(POOLS) for i in range(PER_POOL)]
            for n in nodes:
                agg.pipeline.ingest(report(now, node=n, seq=1), now)
            await asyncio.sleep(0.5)  # the healthy round's echoes (none: nothing to write)
            assert [r for r in double.writes() if "/nodes" in r[1] or "/events" in r[1]] == []

            faulty = [name(p, i) for p in range(POOLS) for i in range(FAULTS_PER_POOL)]
            assert calls is not None
            first, first_made = len(double.requests), len(calls.made)
            now = time.time()
            for n in faulty:
                rep = msgspec.structs.replace(report(now, node=n, seq=2), events=[xid(79, gpu=3, at=now)])
                agg.pipeline.ingest(rep, now)

            def tainted(n: str) -> bool:
                taints = double.node(n)["spec"].get("taints") or []
                return any(t["key"] == OURS for t in taints)

            while not all(tainted(n) for n in faulty):
                assert time.monotonic() < deadline + WAIT_S, "the storm was not tainted in time"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # anything that would follow (a second write) has its chance
        finally:
            stop.set()
            await asyncio.wait_for(server, WAIT_S)

    assert calls is not None
    storm = [r for r in double.requests[first:] if "/leases" not in r[1]]
    # One decision each: one taint patch, one condition, one event per faulty node, no other node
    # written.
    spec_patches = Counter(p.rsplit("/", 1)[1] for m, p, _ in storm if m == "PATCH" and "/status" not in p)
    status_patches = Counter(p.split("/")[4] for m, p, _ in storm if m == "PATCH" and p.endswith("/status"))
    assert spec_patches == Counter(faulty)
    assert status_patches == Counter(faulty)
    events = Counter(e["involvedObject"]["name"] for e in double.events)
    assert events == Counter(faulty)
    # One read each too: the early echoes are judged from the informer's copy, not read again.
    reads = Counter(p.rsplit("/", 1)[1] for m, p, _ in storm if m == "GET" and p.startswith("/api/v1/nodes/"))
    assert reads == Counter(faulty)
    # The bucket: within any span of t seconds, at most burst + qps * t calls (one more for the
    # token the first call of the span may have found left over at its start).
    starts = [t for t, _ in calls.made[first_made:]]
    for i in range(len(starts)):
        for j in range(i + 1, len(starts)):
            assert j - i + 1 <= BURST + QPS * (starts[j] - starts[i]) + 1, (i, j)
    # And the calls were all made: no node was tainted without its fresh read or its condition.
    made = len(starts)
    assert made >= 3 * len(faulty)
    assert starts[-1] - starts[0] >= (made - BURST - 1) / QPS
