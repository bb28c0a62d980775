"""Regression tests from the remediation safety review: each was a way to take nodes out past
the limits, release one that must stay out, write without the Lease, or churn the API server.

They run the real pipeline, the real actuator and the real client against the API-server double
(fixtures from test_actuator.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from aggregator.app import build_aggregator
from aggregator.config import RemediationConfig
from aggregator.kube.api import KubeApi
from aggregator.kube.client import KubeClient
from aggregator.kube.leader import LeaderElector
from aggregator.remediate.limits import BreakerState, decode_breaker, encode_breaker
from aggregator.remediate.runtime import BREAKER_ANNOTATION
from tests.rulekit import gpu, report
from tests.test_actuator import OURS, World, intent, make_world, node_writes, ours, taints, until
from tests.test_remediation_pipeline import T0, Fleet, config


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    """test_actuator's world, on the remediation pipeline tests' clock."""
    async with make_world(tmp_path, T0) as w:
        yield w


async def test_a_report_before_the_first_cluster_list_does_not_undo_a_quarantine(world: World) -> None:
    cfg = config(max_per_domain=10)  # 20 nodes, 10 %: two may be out
    a = Fleet(cfg)
    for n in a.names:
        world.api.add_node(n)
    a.round(T0)
    a.round(T0 + 10, {"n00": [79], "n05": [79]})
    act_a = world.actuator(a.pipeline)
    for n in ("n00", "n05"):
        await act_a.reconcile(n)
    assert ours(world.api, "n00") and ours(world.api, "n05")

    # A restart: the agents' spools deliver a round before the new actuator has listed the
    # cluster (ingestion starts at once). An XID 79 shows only once, so these reports look clean.
    b = Fleet(cfg)
    b.round(T0 + 20)
    act_b = world.actuator(b.pipeline)
    async with world.running(act_b):
        await act_b.synced()
        b.round(T0 + 30, {"n10": [79]})
        # Two nodes are still out: the third quarantine is held, not tainted.
        assert b.decisions("n10")[-1].action == "held"
        for n in ("n00", "n05"):
            await act_b.reconcile(n)
    assert ours(world.api, "n00") and ours(world.api, "n05")
    for n in ("n00", "n05"):
        h = b.pipeline.health.get(n)
        assert h is not None and h.state == "quarantined" and h.tainted
    # Same boot, for half an hour: they stay out (the XID 79 lasts until a reboot).
    for i in range(4, 184):
        b.round(T0 + 10 * i)
    assert all(b.pipeline.health.get(n).state == "quarantined" for n in ("n00", "n05"))  # type: ignore[union-attr]


async def test_a_humans_taint_with_our_key_stays_theirs(world: World) -> None:
    human = {"key": OURS, "value": "bad-fan", "effect": "NoSchedule"}
    b = Fleet(config(max_per_domain=10))
    for n in b.names:
        world.api.add_node(n, taints=[human] if n == "n01" else None)
    act = world.actuator(b.pipeline)
    async with world.running(act):
        await until(lambda: world.reconciles() >= 20, "first resync")
    assert taints(world.api, "n01") == [human]
    base = world.clock.time()
    for i in range(1, 300):  # long past restore grace, clear time and probation
        b.round(base + 10 * i)
    await act.reconcile("n01")
    assert taints(world.api, "n01") == [human]


async def test_our_quarantine_beside_a_humans_taint_with_our_key_leaves_theirs(world: World) -> None:
    human = {"key": OURS, "value": "maintenance", "effect": "NoExecute"}
    world.api.add_node("n1", taints=[human])
    act = world.actuator()
    world.intents.by_node["n1"] = intent("n1")
    await act.reconcile("n1")
    assert human in taints(world.api, "n1")
    assert {"key": OURS, "value": "xid-79", "effect": "NoSchedule"} in taints(world.api, "n1")
    world.intents.by_node["n1"] = intent("n1", "healthy", effect=None, message="released")
    await act.reconcile("n1")
    assert taints(world.api, "n1") == [human]


async def test_a_starting_replica_never_closes_an_open_breaker(world: World, tmp_path: Path) -> None:
    client = await KubeClient.from_kubeconfig(world.api.write_kubeconfig(tmp_path / "kc"))
    rcfg = RemediationConfig(mode="enforce")
    other = LeaderElector(client, rcfg.leader, identity="agg-0", clock=world.clock)
    opened = BreakerState(open=True, since=T0, reason="pool h100", limit="pool_share")
    await other.update_annotations({BREAKER_ANNOTATION: encode_breaker(opened)})
    (tmp_path / "tokens").write_text("n00 token-of-n00\n")

    async def connect() -> KubeApi:
        return client

    agg = await build_aggregator(
        msgspec.structs.replace(config(), remediation=rcfg),
        [],
        auth=tmp_path / "tokens",
        clock=world.clock,
        kube=connect,
        identity="agg-1",
    )
    rem = agg.remediation
    assert rem is not None
    await rem.sync_breaker()  # before its elector has read the Lease: it must not write
    lease = world.api.lease(rcfg.leader.namespace, rcfg.leader.lease_name)
    assert lease is not None
    stored = decode_breaker(lease["metadata"]["annotations"][BREAKER_ANNOTATION])
    assert stored is not None and stored.open
    await rem.elector._attempt()  # one election round reads the Lease
    await rem.sync_breaker()
    assert agg.pipeline.limits.open
    await client.close()


async def test_no_write_once_the_lease_is_lost_mid_reconcile(world: World) -> None:
    world.api.add_node("n1")
    world.intents.by_node["n1"] = intent("n1")
    act = world.actuator()

    def lose(_name: str) -> None:
        world.leader = False  # the renew deadline passed while we were reading the node

    world.kube.after_get = lose
    await act.reconcile("n1")
    assert ours(world.api, "n1") == [] and node_writes(world.api) == []


async def test_a_resync_of_a_suspect_node_with_changing_readings_writes_nothing(world: World) -> None:
    f = Fleet(config())
    world.api.add_node("n00")
    seq = 0

    def send(t: float, temp: float) -> None:
        nonlocal seq
        seq += 1
        r = report(
            t,
            node="n00",
            seq=seq,
            boot_id="boot-1",
            gpus=[gpu(i, temperature_celsius=temp if i == 3 else 60.0) for i in range(8)],
        )
        f.pipeline.ingest(msgspec.structs.replace(r, labels={"pool": "h100", "rack": "r0"}), t)

    for i in range(40):
        send(T0 + 10 * i, 86.0 + (i % 3))
    assert f.pipeline.health.get("n00").state == "suspect"  # type: ignore[union-attr]
    act = world.actuator(f.pipeline)
    async with world.running(act):
        await until(lambda: world.reconciles() >= 1, "first reconcile")
    base = len(node_writes(world.api))
    for k in range(3):  # three resyncs, 5 minutes apart; the node stays suspect, at 86-88 C
        for i in range(30):
            send(T0 + 400 + 300 * k + 10 * i, 86.0 + ((i + k) % 3))
        await act.reconcile("n00", from_cache=True)
    assert f.pipeline.health.get("n00").state == "suspect"  # type: ignore[union-attr]
    assert node_writes(world.api)[base:] == []
