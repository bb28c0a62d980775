"""Sharded aggregators end to end: real agents' shippers, replicas built by the composition root,
the API-server double through the real client.

Two shards, then three: the agents are all configured with shard 1's URL and find their owners
by redirect; a hard fault on a node of a pool on shard 0 is quarantined there; then every
replica stops and three start (a change of N rolls the StatefulSet), the pool moves to the new
shard 2 (rendezvous hashing moves only pools to the new shard), which restores the quarantine
from the cluster while shard 0 leaves the node alone; the taint is never lifted, and every
report the agents made, including those made while no aggregator ran, is delivered. The
fleet-wide node list answers from any replica, and says which shard did not answer once one
is down.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from agent.clock import SystemClock
from agent.shipper import Shipper
from aggregator.app import Aggregator, build_aggregator
from aggregator.config import (
    Config,
    HealthConfig,
    LeaderConfig,
    LimitsConfig,
    RemediationConfig,
    ServerConfig,
    ShardingConfig,
)
from aggregator.kube.api import KubeApi
from aggregator.kube.client import KubeClient
from aggregator.remediate.model import decode_snapshot
from aggregator.shard.map import owner_of
from tests.kube_double import KubeApiDouble
from tests.ports import free_port
from tests.rulekit import report, xid
from tests.test_remediation_e2e import ADMIN_TOKEN, LEASE, NS, POOL_LABEL, RULES, eventually, ours

WAIT_S = 30.0
CANDIDATES = [f"pool-{i:03d}" for i in range(200)]
# A pool on shard 0 of two that moves to shard 2 of three, and one that stays on shard 1.
MOVING = next(p for p in CANDIDATES if owner_of(p, 2) == 0 and owner_of(p, 3) == 2)
STAYING = next(p for p in CANDIDATES if owner_of(p, 2) == 1 and owner_of(p, 3) == 1)
NODES = {f"m{i}": MOVING for i in range(3)} | {f"s{i}": STAYING for i in range(3)}
FAULTY = "m0"


def config(shard: int, ports: Sequence[int]) -> Config:
    return Config(
        health=HealthConfig(probation_seconds=3600.0),
        remediation=RemediationConfig(
            mode="enforce",
            resync_seconds=1.0,
            limits=LimitsConfig(max_pool_share=1.0, max_per_hour=30),
            leader=LeaderConfig(
                namespace=NS,
                lease_name=LEASE,
                lease_duration_seconds=120.0,
                renew_deadline_seconds=90.0,
                retry_period_seconds=0.5,
            ),
        ),
        server=ServerConfig(max_wait_seconds=60.0),
        sharding=ShardingConfig(
            shards=len(ports), shard=shard, peers=[[f"http://127.0.0.1:{p}" for p in ports]]
        ),
    )


@dataclass
class Replica:
    shard: int
    agg: Aggregator
    stop: asyncio.Event
    task: asyncio.Task[None]

    def knows(self, node: str) -> bool:
        return self.agg.pipeline.node(node) is not None

    def state(self, node: str) -> str | None:
        h = self.agg.pipeline.health.get(node)
        return h.state if h is not None else None

    async def shutdown(self) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, WAIT_S)


async def start(double: KubeApiDouble, tmp_path: Path, shard: int, ports: Sequence[int]) -> Replica:
    async def connect() -> KubeApi:
        return await KubeClient.from_kubeconfig(
            double.write_kubeconfig(tmp_path / f"shard-{shard}.kubeconfig")
        )

    agg = await build_aggregator(
        config(shard, ports),
        RULES,
        auth=tmp_path / "tokens",
        clock=SystemClock(),
        kube=connect,
        identity=f"gpuwarden-a-{shard}",
        admin_tokens=[ADMIN_TOKEN],
    )
    assert agg.remediation is not None
    stop = asyncio.Event()
    bound = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        agg.serve(
            "127.0.0.1",
            ports[shard],
            stop=stop,
            on_started=lambda h, p: bound.set_result(p),
            shutdown_timeout_s=1.0,
        )
    )
    await asyncio.wait_for(bound, WAIT_S)
    await asyncio.wait_for(agg.remediation.actuator.synced(), WAIT_S)
    await eventually(
        lambda: agg.remediation is not None and agg.remediation.elector.is_leader, "the shard's lease"
    )
    return Replica(shard, agg, stop, task)


@asynccontextmanager
async def shards(double: KubeApiDouble, tmp_path: Path, ports: Sequence[int]) -> AsyncIterator[list[Replica]]:
    started: list[Replica] = []
    try:
        for i in range(len(ports)):
            started.append(await start(double, tmp_path, i, ports))
        yield started
    finally:
        for r in started:
            if not r.task.done():
                await r.shutdown()


class Agents:
    """One real shipper per node, every one configured with the same aggregator URL."""

    def __init__(self, tmp_path: Path, url: str) -> None:
        self.shippers: dict[str, Shipper] = {}
        self.made: dict[str, int] = {}
        for node in NODES:
            token = tmp_path / f"{node}.token"
            token.write_text(f"token-{node}-{'x' * 20}\n")
            s = Shipper(url, token, SystemClock(), timeout_s=2.0, backoff_base_s=0.05, backoff_max_s=0.3)
            s.start()
            self.shippers[node] = s
            self.made[node] = 0
        (tmp_path / "tokens").write_text("".join(f"{n} token-{n}-{'x' * 20}\n" for n in NODES))

    def report(self, node: str, *, fault: bool = False) -> None:
        self.made[node] += 1
        events = [xid(79, gpu=3, at=time.time())] if fault else ()
        self.shippers[node].submit(report(time.time(), node=node, seq=self.made[node], events=events))

    def round(self) -> None:
        for node in NODES:
            self.report(node)

    async def delivered(self) -> None:
        for node, s in self.shippers.items():
            assert await asyncio.to_thread(s.flush, WAIT_S), f"{node}'s reports not delivered"

    def close(self) -> None:
        for s in self.shippers.values():
            s.close(timeout_s=1.0)


async def fleet_nodes(replica_port: int) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(
            f"http://127.0.0.1:{replica_port}/api/v1/nodes",
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        ) as resp,
    ):
        assert resp.status == 200
        body: dict[str, Any] = await resp.json()
        return body


@asynccontextmanager
async def watching_taint(double: KubeApiDouble, node: str) -> AsyncIterator[list[bool]]:
    """Samples whether ``node`` carries our taint every 10 ms while the block runs."""
    seen: list[bool] = []

    async def sample() -> None:
        while True:
            seen.append(bool(ours(double, node)))
            await asyncio.sleep(0.01)

    task = asyncio.create_task(sample())
    try:
        yield seen
    finally:
        task.cancel()


@asynccontextmanager
async def a_fleet(tmp_path: Path, agents_port: int) -> AsyncIterator[tuple[KubeApiDouble, Agents]]:
    """The API-server double with every node of ``NODES``, and their agents, all sending to
    ``agents_port``."""
    async with KubeApiDouble() as double:
        for node, pool in NODES.items():
            double.add_node(node, labels={POOL_LABEL: pool})
        agents = Agents(tmp_path, f"http://127.0.0.1:{agents_port}")
        try:
            yield double, agents
        finally:
            agents.close()


async def quarantine_on_shard_0(double: KubeApiDouble, agents: Agents, s0: Replica) -> None:
    """A round of every node and a hard fault on ``FAULTY``, delivered, tainted by shard 0."""
    agents.round()
    agents.report(FAULTY, fault=True)
    await agents.delivered()
    await eventually(lambda: bool(ours(double, FAULTY)), "the taint from shard 0", timeout=WAIT_S)
    assert s0.state(FAULTY) == "quarantined"


def every_report_delivered(agents: Agents) -> None:
    """Every report each agent made was delivered: none dropped, none refused."""
    for node, s in agents.shippers.items():
        stats = s.stats()
        sent = (stats.sent_total, stats.dropped_total, stats.rejected_total)
        assert sent == (agents.made[node], 0, 0), node


async def test_a_quarantine_survives_its_pool_moving_to_a_new_shard(tmp_path: Path) -> None:
    two = [free_port(), free_port()]
    three = [*two, free_port()]
    async with a_fleet(tmp_path, two[1]) as (double, agents):
        async with shards(double, tmp_path, two) as (s0, s1):
            await quarantine_on_shard_0(double, agents, s0)
            # Each report went to the shard of its pool, and only there.
            assert all(s0.knows(n) == (NODES[n] == MOVING) for n in NODES)
            assert all(s1.knows(n) == (NODES[n] == STAYING) for n in NODES)
            # Any replica answers for the fleet.
            view = await fleet_nodes(two[1])
            assert sorted((n["node"], n["shard"]) for n in view["nodes"]) == sorted(
                (n, owner_of(p, 2)) for n, p in NODES.items()
            )
            assert (view["partial"], view["shards"]["answered"]) == (False, [0, 1])
            for i in range(2):  # one Lease per shard, each held by that shard's replica
                lease = double.lease(NS, f"{LEASE}-shard-{i}")
                assert lease is not None and lease["spec"]["holderIdentity"] == f"gpuwarden-a-{i}"
            assert double.lease(NS, LEASE) is None

        # No aggregator runs: what the agents report now waits in their spools.
        agents.round()
        async with (
            watching_taint(double, FAULTY) as taint,
            shards(double, tmp_path, three) as (s0, s1, s2),
        ):
            agents.round()
            await agents.delivered()
            # The moving pool is on shard 2 now: restored from the cluster, the quarantine stands.
            assert s2.state(FAULTY) == "quarantined"
            assert all(s2.knows(n) == (NODES[n] == MOVING) for n in NODES)
            assert not any(s0.knows(n) for n in NODES)  # the old owner has nothing of it
            assert s0.agg.remediation is not None
            assert s0.agg.pipeline.health.get(FAULTY) is None
            await asyncio.sleep(2.5)  # two resyncs of every shard's actuator
            assert taint and all(taint), "the taint was lifted when the pool moved"
            view = await fleet_nodes(three[0])
            assert sorted((n["node"], n["shard"]) for n in view["nodes"]) == sorted(
                (n, owner_of(p, 3)) for n, p in NODES.items()
            )
            await s2.shutdown()
            view = await fleet_nodes(three[0])
            assert view["partial"] is True
            assert [m["shard"] for m in view["shards"]["missing"]] == [2]
            assert {n["shard"] for n in view["nodes"]} == {1}
        every_report_delivered(agents)


async def test_a_quarantined_node_relabelled_into_another_shards_pool_stays_out(tmp_path: Path) -> None:
    # An operator relabels a quarantined node's pool while both shards run: shard 0 hands it
    # over, shard 1 restores it from the cluster before its first report there, the taint is
    # never lifted, and no report is lost on the way.
    two = [free_port(), free_port()]
    relabel = {POOL_LABEL: STAYING}
    async with a_fleet(tmp_path, two[1]) as (double, agents), shards(double, tmp_path, two) as (s0, s1):
        await quarantine_on_shard_0(double, agents, s0)
        async with watching_taint(double, FAULTY) as taint:
            double.update_node(FAULTY, lambda n: n["metadata"]["labels"].update(relabel))
            await eventually(
                lambda: s0.agg.pipeline.health.get(FAULTY) is None, "shard 0 handing it over", timeout=WAIT_S
            )
            agents.round()
            await agents.delivered()
            assert s1.state(FAULTY) == "quarantined"  # restored from the cluster, not started afresh
            assert not s0.knows(FAULTY)
            await asyncio.sleep(2.5)  # two resyncs of each shard's actuator
            agents.round()
            await agents.delivered()
            assert s1.state(FAULTY) == "quarantined" and not s0.knows(FAULTY)
        assert taint and all(taint), "the taint was lifted when the node moved"
        # Shard 1's leader now speaks for the node: its snapshot names the new pool.
        snapshot = decode_snapshot(double.node(FAULTY)["metadata"]["annotations"]["gpuwarden.io/health"])
        assert snapshot is not None and snapshot.pool == STAYING
        moves = {
            (r.shard, d): r.agg.registry.get_sample_value(
                "gpuwarden_shard_node_moves_total", {"direction": d}
            )
            for r in (s0, s1)
            for d in ("in", "out")
        }
        assert moves == {(0, "in"): 0.0, (0, "out"): 1.0, (1, "in"): 1.0, (1, "out"): 0.0}
        view = await fleet_nodes(two[0])
        assert {n["node"]: n["shard"] for n in view["nodes"]}[FAULTY] == 1
        every_report_delivered(agents)


async def two_shards_replaced(
    tmp_path: Path, shard: int, ports: Sequence[int], check: Callable[[KubeApiDouble, Replica], None]
) -> None:
    """Two shards run, shard 0 holding a quarantine; replica ``shard`` of the new count (``ports``:
    one per shard, one port for a single aggregator) starts beside them. Both counts hold back
    while both are live; once the old replicas are gone the new one acts, and the quarantine it
    restored from the cluster stands throughout. ``check`` runs once the new one acts."""
    two = [free_port(), free_port()]
    async with a_fleet(tmp_path, two[1]) as (double, agents), shards(double, tmp_path, two) as (s0, s1):
        await quarantine_on_shard_0(double, agents, s0)
        old = s0.agg.remediation
        assert old is not None and old.acting
        new = await start(double, tmp_path, shard, ports)
        try:
            assert new.agg.remediation is not None
            fenced = new.agg.remediation
            await eventually(lambda: not old.acting, "the old count holding back")
            assert not fenced.acting and fenced.elector.is_leader
            assert fenced.status()["fenced_by"] == [f"{LEASE}-shard-0", f"{LEASE}-shard-1"]
            assert fenced.status()["fence_enforced"] is True
            async with watching_taint(double, FAULTY) as taint:
                await s0.shutdown()
                await s1.shutdown()
                await eventually(lambda: fenced.acting, "the new count acting once the old is gone")
                await asyncio.sleep(2.5)  # resyncs of its actuator
                assert new.state(FAULTY) == "quarantined"
            assert taint and all(taint), "the taint was lifted during the change"
            check(double, new)
        finally:
            await new.shutdown()


async def test_while_two_counts_of_shards_run_neither_writes_until_the_old_is_gone(tmp_path: Path) -> None:
    # A roll from two shards to three, the old replicas still running when the new one starts:
    # the moved pool would have two leaders, old shard 0 and new shard 2 (aggregator/shard/fence.py).
    def stamped(double: KubeApiDouble, _new: Replica) -> None:
        lease = double.lease(NS, f"{LEASE}-shard-2")
        assert lease is not None and lease["metadata"]["annotations"]["gpuwarden.io/shards"] == "3"

    await two_shards_replaced(tmp_path, 2, [free_port(), free_port(), free_port()], stamped)


async def test_from_shards_back_to_one_aggregator_neither_side_writes_while_both_run(tmp_path: Path) -> None:
    # The other way: the single aggregator the shards are replaced by elects on the base Lease, a
    # count of one. It holds back for the shards' Leases and the shards for its Lease.
    def on_the_base_lease(double: KubeApiDouble, new: Replica) -> None:
        lease = double.lease(NS, LEASE)
        assert new.agg.remediation is not None and lease is not None
        assert lease["spec"]["holderIdentity"] == new.agg.remediation.elector.identity

    await two_shards_replaced(tmp_path, 0, [free_port()], on_the_base_lease)
