"""End to end: a storm, a restart racing a slow API server, and nothing undone.

40 nodes in two pools of 20, the aggregator in ``enforce`` (two replicas built by the composition
root, against the API-server double through the real client), another controller writing its own
taints and labels on every node all the time and slipping a write between our read and our patch,
every kubelet posting its status, and API Priority and Fairness answering a share of every request
with 429 throughout. Five hard faults (uncorrectable ECC errors: in every report from then on),
then 12 of the 20 nodes of one pool at once: the pool limit (20 %, four nodes) holds, the rest are
held and the breaker opens. Then both replicas stop (SIGTERM: the Lease is released) and two start
again with their Node LISTs answered only after 0, 3 or 30 s while every agent's reports arrive
(the faulty nodes' with their errors). The upstream SLO allows 30 s at p99 for a cluster-wide LIST.

An observer watches every change the API server makes to any Node from the start, so "no flap"
(never an untaint of a faulty node) and "the pool limit held" are checked at every state the
cluster was ever in, not only at the end. Time: the replicas' Lease and the LIST latency run on a
``SteppedClock`` that the test advances, so a 30 s LIST takes a fraction of that in real time.
"""

from __future__ import annotations

import asyncio
import gzip
import itertools
import time
from collections.abc import Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from aggregator.app import build_aggregator
from aggregator.config import (
    Config,
    HealthConfig,
    LeaderConfig,
    LimitsConfig,
    RemediationConfig,
    ServerConfig,
)
from aggregator.kube.api import KubeApi
from aggregator.kube.client import KubeClient
from aggregator.kube.objects import KubeGone, KubeUnavailable, NodeList
from aggregator.service import REPORTS_PATH
from tests.background import background
from tests.kube_double import KubeApiDouble
from tests.rulekit import gpu, report
from tests.test_remediation_e2e import (
    ADMIN_TOKEN,
    LEASE,
    NS,
    OURS,
    POOL_LABEL,
    RULES,
    Replica,
    Severable,
    SteppedClock,
    gpu_condition,
    node_writes,
    ours,
)

POOLS = {"pool-a": [f"a{i:02d}" for i in range(20)], "pool-b": [f"b{i:02d}" for i in range(20)]}
NODES = [n for names in POOLS.values() for n in names]
POOL_OF = {n: pool for pool, names in POOLS.items() for n in names}
LIMIT = 4  # 20 % of 20
FIRST_FAULTS = ["a00", "a01", "b00", "b01", "b02"]  # five hard faults, all within the limit
STORM = [f"a{i:02d}" for i in range(2, 14)]  # then 12 of pool-a at once: two fit, ten are held
FOREIGN_KEY = "other.io/flap"
FOREIGN_LABEL = "other.io/generation"
WAIT_S = 90.0
REPORT_EVERY_S = 1.0  # real seconds between two reports of every agent while a test waits
RESYNC = "gpuwarden_remediation_last_resync_timestamp_seconds"


def config() -> Config:
    return Config(
        # Long probation: a quarantine here ends only by a release, and none is due in the test.
        health=HealthConfig(probation_seconds=3600.0),
        remediation=RemediationConfig(
            mode="enforce",
            resync_seconds=2.0,
            limits=LimitsConfig(max_pool_share=0.2, max_per_hour=100),
            # A Lease far longer than the test's steps of the clock, so the LIST's latency (on
            # the same clock) never costs the leader its lease.
            leader=LeaderConfig(
                namespace=NS,
                lease_name=LEASE,
                lease_duration_seconds=120.0,
                renew_deadline_seconds=90.0,
                retry_period_seconds=0.5,
            ),
        ),
        # Four replicas, the double and the foreign controller share one event loop here, so the
        # loop runs behind now and then: the reports must all be taken (this test is about what
        # remediation does with them), not shed as a loaded aggregator rightly sheds them.
        server=ServerConfig(max_wait_seconds=60.0, max_in_flight=4096, max_in_flight_per_token=64),
    )


class SlowLists(Severable):
    """The replica's client with Node LISTs answered ``latency`` seconds (on the stepped clock)
    after they were asked, as a busy control plane answers them (the double's own
    ``set_latency`` does the same in real time)."""

    def __init__(self, inner: KubeClient, clock: SteppedClock, latency: float) -> None:
        super().__init__(inner)
        self.clock = clock
        self.latency = latency
        self.lists_answered = 0

    async def list_nodes(self, *, label_selector: str | None = None) -> NodeList:
        # As the API server: the work is done when the request arrives, only the answer waits,
        # so the list shows the cluster as of its start (a watch from it sees the rest).
        listed = await super().list_nodes(label_selector=label_selector)
        due = self.clock.monotonic() + self.latency
        while self.clock.monotonic() < due:
            await asyncio.sleep(0.01)
        self.lists_answered += 1
        return listed


@dataclass
class World:
    double: KubeApiDouble
    tmp_path: Path
    session: aiohttp.ClientSession
    clock: SteppedClock
    seq: dict[str, int] = field(default_factory=dict)
    faulty: set[str] = field(default_factory=set)

    def token(self, node: str) -> str:
        return f"token-{node}-{'x' * 16}"

    async def send(self, node: str, replicas: Sequence[Replica]) -> None:
        self.seq[node] = self.seq.get(node, 0) + 1
        gpus = [gpu(i, ecc_dbe_volatile_total=2 if node in self.faulty and i == 3 else 0) for i in range(8)]
        body = gzip.compress(
            msgspec.json.encode(
                report(time.time(), node=node, boot_id="boot-a", seq=self.seq[node], gpus=gpus)
            )
        )
        headers = {
            "Authorization": f"Bearer {self.token(node)}",
            "Content-Type": "application/json",
            "Content-Encoding": "gzip",
        }
        for replica in replicas:
            async with self.session.post(replica.url + REPORTS_PATH, data=body, headers=headers) as resp:
                assert resp.status == 200, f"{replica.name} refused a report: {await resp.text()}"

    async def round(self, replicas: Sequence[Replica], step: float = 0.2) -> None:
        """Every agent reports once; then the stepped clock moves on by ``step``."""
        await asyncio.gather(*(self.send(n, replicas) for n in NODES))
        await asyncio.sleep(0.05)
        self.clock.advance(step)

    async def until(self, replicas: Sequence[Replica], check: Any, what: str, step: float = 0.2) -> None:
        """Agents report every ``REPORT_EVERY_S`` (real time) while ``check`` is polled."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT_S
        reported = -REPORT_EVERY_S
        while not check():
            assert loop.time() < deadline, f"timed out waiting for {what}"
            if loop.time() - reported >= REPORT_EVERY_S:
                reported = loop.time()
                await self.round(replicas, step)
            else:
                await asyncio.sleep(0.05)
                self.clock.advance(step / 4)


class Foreign:
    """Another controller: writes its own taint (on and off) and label on every node, round
    after round, and right after each of our node reads on a node it is racing; before each
    write it checks that what it wrote last is still there."""

    def __init__(self, double: KubeApiDouble) -> None:
        self.double = double
        self.on: dict[str, bool] = dict.fromkeys(NODES, False)
        self.lost: list[tuple[str, list[dict[str, Any]]]] = []
        self.writes = 0
        self._raced: dict[str, float] = {}
        self.races = 0

    def write(self, name: str) -> None:
        def mutate(n: dict[str, Any]) -> None:
            mine = [t for t in n["spec"].get("taints") or [] if t["key"] == FOREIGN_KEY]
            expected = [{"key": FOREIGN_KEY, "value": "x", "effect": "NoSchedule"}] if self.on[name] else []
            if [{k: v for k, v in t.items() if k != "timeAdded"} for t in mine] != expected:
                self.lost.append((name, mine))
            taints = n["spec"].setdefault("taints", [])
            if self.on[name]:
                taints[:] = [t for t in taints if t["key"] != FOREIGN_KEY]
            else:
                taints.append({"key": FOREIGN_KEY, "value": "x", "effect": "NoSchedule"})
            self.on[name] = not self.on[name]
            n["metadata"].setdefault("labels", {})[FOREIGN_LABEL] = str(self.writes)

        self.writes += 1
        self.double.update_node(name, mutate)

    def between_read_and_patch(self, name: str) -> None:
        # A write lands between our read and our patch: the patch conflicts and is retried on a
        # fresh read. Not on every read (our re-read after its write would race again, and the
        # echo of each race queues another read: a cascade no real controller makes), but on
        # the first read after a quiet half second, which every write of ours starts with.
        now = time.monotonic()
        if now - self._raced.get(name, -1.0) >= 0.5:
            self._raced[name] = now
            self.races += 1
            self.write(name)

    async def run(self) -> None:
        for name in itertools.cycle(NODES):
            self.write(name)
            await asyncio.sleep(0.25)


class Observer:
    """Every state of every Node the API server ever held, through a watch from the start."""

    def __init__(self) -> None:
        self.tainted: dict[str, bool] = dict.fromkeys(NODES, False)
        self.ever_tainted: set[str] = set()
        self.untainted_after: list[str] = []  # a node that had our taint lost it: a flap
        self.peak: dict[str, int] = dict.fromkeys(POOLS, 0)
        self.changes = 0

    def seen(self, name: str, has_ours: bool) -> None:
        self.changes += 1
        if self.tainted.get(name) and not has_ours:
            self.untainted_after.append(name)
        self.tainted[name] = has_ours
        if has_ours:
            self.ever_tainted.add(name)
        for pool, names in POOLS.items():
            self.peak[pool] = max(self.peak[pool], sum(self.tainted[n] for n in names))

    async def run(self, client: KubeClient) -> None:
        listed = await self._list(client)
        for n in listed.items:
            self.seen(n.name, any(t.key == OURS for t in n.taints))
        rv = listed.resource_version
        while True:
            try:
                async with aclosing(client.watch_nodes(resource_version=rv)) as events:
                    async for event in events:
                        rv = event.node.resource_version
                        self.seen(event.node.name, any(t.key == OURS for t in event.node.taints))
            except KubeGone:  # a forced watch restart compacted the history: list again
                listed = await self._list(client)
                for n in listed.items:
                    self.seen(n.name, any(t.key == OURS for t in n.taints))
                rv = listed.resource_version
            except KubeUnavailable:  # throttled (429): resume from where the watch ended
                await asyncio.sleep(0.05)

    @staticmethod
    async def _list(client: KubeClient) -> NodeList:
        while True:
            try:
                return await client.list_nodes()
            except KubeUnavailable:
                await asyncio.sleep(0.05)


class Kubelet:
    """Every node's kubelet posting its status: the Ready condition's heartbeat, a Node write
    (and a watch event for every informer) per node every few seconds, racing our writes."""

    def __init__(self, double: KubeApiDouble) -> None:
        self.double = double
        self.beats = 0

    def beat(self, name: str) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()) + f"#{self.beats}"

        def mutate(n: dict[str, Any]) -> None:
            for c in n["status"].setdefault("conditions", []):
                if c["type"] == "Ready":
                    c["lastHeartbeatTime"] = stamp

        self.beats += 1
        self.double.update_node(name, mutate)

    async def run(self) -> None:
        for name in itertools.cycle(NODES):
            self.beat(name)
            await asyncio.sleep(0.1)  # every node every 4 s


async def start(
    world: World, name: str, foreign: Foreign, *, latency: float = 0.0
) -> tuple[Replica, SlowLists]:
    """A replica as ``gpuwarden aggregator --remediation enforce`` builds one, returned as soon as
    it serves (its first LIST may not be answered yet)."""
    kube: SlowLists | None = None

    async def connect() -> KubeApi:
        nonlocal kube
        client = await KubeClient.from_kubeconfig(
            world.double.write_kubeconfig(world.tmp_path / f"{name}.kubeconfig")
        )
        kube = SlowLists(client, world.clock, latency)
        kube.after_get = foreign.between_read_and_patch
        return kube

    agg = await build_aggregator(
        config(),
        RULES,
        auth=world.tmp_path / "tokens",
        clock=world.clock,
        kube=connect,
        identity=name,
        admin_tokens=[ADMIN_TOKEN],
    )
    assert agg.remediation is not None and kube is not None
    stop = asyncio.Event()
    bound: asyncio.Future[tuple[str, int]] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        agg.serve(
            "127.0.0.1",
            0,
            stop=stop,
            on_started=lambda host, port: bound.set_result((host, port)),
            shutdown_timeout_s=1.0,
        ),
        name=f"replica-{name}",
    )
    host, port = await asyncio.wait_for(bound, 15)
    replica = Replica(
        name,
        f"http://{host}:{port}",
        agg.pipeline,
        agg.remediation,
        agg.registry,
        kube,
        agg.audit,
        stop,
        task,
    )
    return replica, kube


def held_nodes(double: KubeApiDouble) -> list[str]:
    return sorted(
        n for n in NODES if (c := gpu_condition(double, n)) is not None and c["reason"] == "QuarantineHeld"
    )


def tainted_nodes(double: KubeApiDouble) -> list[str]:
    return sorted(n for n in NODES if ours(double, n))


@pytest.mark.parametrize(
    ("list_latency_s", "late_by"),
    [(0.0, "stepped clock"), (3.0, "the double, in real time"), (30.0, "stepped clock")],
)
async def test_a_storm_then_a_restart_racing_a_slow_list_undoes_nothing(
    tmp_path: Path, list_latency_s: float, late_by: str
) -> None:
    clock = SteppedClock()
    async with KubeApiDouble() as double, aiohttp.ClientSession() as session:
        world = World(double, tmp_path, session, clock)
        for n in NODES:
            double.add_node(n, labels={POOL_LABEL: POOL_OF[n]})
        (tmp_path / "tokens").write_text("".join(f"{n} {world.token(n)}\n" for n in NODES))
        foreign = Foreign(double)
        kubelet = Kubelet(double)
        observer = Observer()
        # API Priority and Fairness sheds a share of every request of ours (and the observer's)
        # with 429 all through: list, watch, get, patch, the Lease and the events.
        double.throttle(share=0.03, retry_after=1)
        watcher = await KubeClient.from_kubeconfig(double.write_kubeconfig(tmp_path / "observer.kubeconfig"))
        expect_tainted = sorted(FIRST_FAULTS + STORM[:2])
        expect_held = sorted(STORM[2:])
        try:
            async with background(observer.run(watcher), foreign.run(), kubelet.run()):
                # -- the first life: five hard faults, then the storm -----------------------------
                first = [await start(world, f"agg-{i}", foreign) for i in range(2)]
                replicas = [r for r, _ in first]
                await world.until(replicas, lambda: all(r.remediation.ready for r in replicas), "both ready")
                await world.until(replicas, lambda: sum(r.is_leader for r in replicas) == 1, "a leader")
                world.faulty.update(FIRST_FAULTS)
                await world.until(
                    replicas, lambda: tainted_nodes(double) == sorted(FIRST_FAULTS), "the first five taints"
                )
                world.faulty.update(STORM)
                await world.until(
                    replicas,
                    lambda: tainted_nodes(double) == expect_tainted and held_nodes(double) == expect_held,
                    "the storm's taints and holds",
                )
                assert all(r.pipeline.limits.open for r in replicas)

                def every_node_written() -> bool:
                    reasons = {
                        n: (c or {}).get("reason") for n in NODES if (c := gpu_condition(double, n)) or True
                    }
                    want = {
                        n: "Quarantined"
                        if n in expect_tainted
                        else "QuarantineHeld"
                        if n in expect_held
                        else "Healthy"
                        for n in NODES
                    }
                    return reasons == want  # the condition is the last write of a reconcile

                await world.until(replicas, every_node_written, "every node's condition")
                for r in replicas:  # SIGTERM: each stops cleanly and releases the Lease
                    await r.shutdown()
                assert observer.peak == {"pool-a": LIMIT, "pool-b": 3}

                # -- the restart: reports race a LIST answered after list_latency_s ---------------
                mark = len(double.requests)
                if late_by == "stepped clock":
                    second = [await start(world, f"agg-{i}", foreign, latency=list_latency_s) for i in (2, 3)]
                    step = max(0.2, list_latency_s / 10)
                else:
                    double.set_latency("list", list_latency_s, path_regex="^/api/v1/nodes$")
                    second = [await start(world, f"agg-{i}", foreign) for i in (2, 3)]
                    step = 0.2
                replicas = [r for r, _ in second]
                try:
                    while not all(k.lists_answered for _, k in second):
                        await world.round(replicas, step)  # every report arrives before the LIST
                    await world.until(replicas, lambda: all(r.remediation.ready for r in replicas), "ready")
                    await world.until(replicas, lambda: sum(r.is_leader for r in replicas) == 1, "a leader")
                    leader = next(r for r in replicas if r.is_leader)
                    resyncs: set[float] = set()

                    def two_periodic_resyncs() -> bool:
                        resyncs.add(leader.registry.get_sample_value(RESYNC) or 0.0)
                        return len(resyncs) >= 3

                    await world.until(replicas, two_periodic_resyncs, "two periodic resyncs", step=1.0)
                    # The API server restarts its watches and compacts its history: an informer
                    # behind the compaction point lists again; either way nothing is written.
                    double.set_latency("list", 0)
                    double.restart_watches(expire=True)
                    resyncs.clear()
                    await world.until(replicas, two_periodic_resyncs, "two more resyncs", step=1.0)
                    for r in replicas:
                        assert (
                            sorted(n for n, h in r.pipeline.health.nodes().items() if h.tainted)
                            == expect_tainted
                        )
                        assert (
                            sorted(n for n, h in r.pipeline.health.nodes().items() if h.held) == expect_held
                        )
                        assert r.pipeline.limits.open
                        assert r.writes("untaint") == 0 and r.writes("taint") == 0
                    # No stampede: the restart changed nothing, so it wrote nothing.
                    assert node_writes(double, mark) == []
                finally:
                    for r in replicas:
                        if not r.task.done():
                            await r.shutdown()
        finally:
            await watcher.close()

        assert tainted_nodes(double) == expect_tainted
        assert held_nodes(double) == expect_held
        assert observer.untainted_after == []  # no flap, at any state the cluster was in
        assert observer.ever_tainted == set(expect_tainted)
        assert observer.peak == {"pool-a": LIMIT, "pool-b": 3}  # before and after the restart
        assert foreign.lost == [] and foreign.races > len(expect_tainted)  # no foreign taint lost
        assert double.throttled > 0 and kubelet.beats > len(NODES)
        for n in NODES:  # and the foreign controller's last word is on every node
            labels = double.node(n)["metadata"]["labels"]
            assert FOREIGN_LABEL in labels and labels[POOL_LABEL] == POOL_OF[n]
