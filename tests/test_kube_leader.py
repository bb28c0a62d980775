"""Leader election (aggregator.kube.leader) through the real KubeClient, over HTTP, against the
API-server double.

Time is virtual: every replica has its own FakeClock (with its own wall-clock skew) and an
injected sleep that parks until the test advances the clocks. ``Cluster.advance`` moves all
clocks in small steps and, after each, lets every replica run until it is parked again, so a
schedule is deterministic and a minute of election takes well under a second. After every step
the harness asserts that no two replicas consider themselves leader.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from agent.clock import FakeClock
from agent.errors import ConfigError
from aggregator.config import LeaderConfig
from aggregator.kube.client import KubeClient
from aggregator.kube.leader import LeaderElector, format_micro_time
from aggregator.kube.objects import KubeConflict, KubeUnavailable, Lease
from tests.kube_double import KubeApiDouble

NS = "gpuwarden"
NAME = "gpuwarden-aggregator"
LEASE_PATH = rf"/namespaces/{NS}/leases/{NAME}$"
CONFIG = LeaderConfig(namespace=NS, lease_name=NAME)  # client-go's 15 s / 10 s / 2 s
STEP = 0.25
WALL = 1_764_441_600.0


class NoJitter(random.Random):
    """Retry exactly every retry period, so a test can bound when a follower acts."""

    def random(self) -> float:
        return 0.0


class Replica:
    def __init__(
        self, name: str, api: KubeClient, clock: FakeClock, rng: random.Random | None, config: LeaderConfig
    ) -> None:
        self.name = name
        self.clock = clock
        self.started = 0
        self.stopped = 0
        self.holder_when_stopped: object = "never stopped"
        self.frozen = False  # a paused process (GC, SIGSTOP, partition): its sleeps do not end
        self.task: asyncio.Task[None] | None = None
        self.double: KubeApiDouble | None = None
        self._wake_at = math.inf
        self._parked: asyncio.Future[None] | None = None
        self.elector = LeaderElector(
            api,
            config,
            identity=name,
            clock=clock,
            on_started=self._on_started,
            on_stopped=self._on_stopped,
            sleep=self._sleep,
            rng=rng,
        )

    def _on_started(self) -> None:
        self.started += 1

    def _on_stopped(self) -> None:
        self.stopped += 1
        assert self.double is not None
        self.holder_when_stopped = lease_spec(self.double).get("holderIdentity")

    async def _sleep(self, seconds: float) -> None:
        self._wake_at = self.clock.monotonic() + seconds
        parked: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._parked = parked
        try:
            await parked
        finally:
            self._parked = None

    @property
    def idle(self) -> bool:
        if self.task is None or self.task.done():
            return True
        return self._parked is not None and not self._parked.done()

    def wake_if_due(self) -> bool:
        parked = self._parked
        if self.frozen or parked is None or parked.done():
            return False
        if self.clock.monotonic() < self._wake_at:
            return False
        parked.set_result(None)
        return True


class Cluster:
    def __init__(self, double: KubeApiDouble, kubeconfig: Path) -> None:
        self.double = double
        self.kubeconfig = kubeconfig
        self.replicas: list[Replica] = []
        self.clients: list[KubeClient] = []
        self.elapsed = 0.0

    async def client(self) -> KubeClient:
        client = await KubeClient.from_kubeconfig(self.kubeconfig)
        self.clients.append(client)
        return client

    async def add(
        self,
        name: str,
        *,
        skew: float = 0.0,
        rng: random.Random | None = None,
        config: LeaderConfig = CONFIG,
    ) -> Replica:
        replica = Replica(name, await self.client(), FakeClock(start=WALL + skew), rng, config)
        replica.double = self.double
        self.replicas.append(replica)
        return replica

    async def start(self, replica: Replica) -> None:
        replica.task = asyncio.create_task(replica.elector.run())
        await self.settle()

    def leaders(self) -> list[str]:
        return [r.name for r in self.replicas if r.elector.is_leader]

    def check(self) -> None:
        leaders = self.leaders()
        assert len(leaders) <= 1, f"two leaders at t={self.elapsed}: {leaders}"

    async def settle(self) -> None:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + 10.0
        while True:
            for replica in self.replicas:
                task = replica.task
                if task is not None and task.done() and not task.cancelled():
                    error = task.exception()
                    assert error is None, f"{replica.name}'s election loop died: {error!r}"
            woke = [r.wake_if_due() for r in self.replicas]
            if not any(woke) and all(r.idle for r in self.replicas):
                break
            assert loop.time() < give_up, "replicas never parked again"
            await asyncio.sleep(0.001)
        self.check()

    def tick(self) -> None:
        """One step of every clock, with no replica running yet."""
        for replica in self.replicas:
            replica.clock.advance(STEP)
        self.elapsed += STEP
        # is_leader must already be right before any replica has run again.
        self.check()

    async def advance(self, seconds: float, *, until: Callable[[], bool] | None = None) -> None:
        for _ in range(round(seconds / STEP)):
            self.tick()
            await self.settle()
            if until is not None and until():
                return

    async def close(self) -> None:
        for replica in self.replicas:
            replica.frozen = False
            if replica.task is not None:
                replica.task.cancel()
        await asyncio.gather(*(r.task for r in self.replicas if r.task is not None), return_exceptions=True)
        for client in self.clients:
            await client.close()


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with KubeApiDouble() as double:
        cluster = Cluster(double, double.write_kubeconfig(tmp_path / "kubeconfig"))
        try:
            yield cluster
        finally:
            await cluster.close()


def lease_spec(double: KubeApiDouble) -> dict[str, Any]:
    lease = double.lease(NS, NAME)
    assert lease is not None, "no lease"
    spec: dict[str, Any] = lease["spec"]
    return spec


def parse_micro_time(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%f%z").timestamp()


def last_renewal(cluster: Cluster, replica: Replica) -> float:
    """The harness time of the holder's last successful renewal, from the renewTime it wrote."""
    renewed = parse_micro_time(lease_spec(cluster.double)["renewTime"])
    return cluster.elapsed - (replica.clock.time() - renewed)


async def end_outage(cluster: Cluster) -> None:
    """Uses up the injected lease faults with requests of our own, changing nothing."""
    client = await cluster.client()
    while True:
        try:
            await client.get_lease(NS, NAME)
            break
        except KubeUnavailable:
            continue
    stale = Lease(NAME, NS, "1", None, None, None, None)
    while True:
        try:
            await client.replace_lease(stale)
        except KubeUnavailable:
            continue
        except KubeConflict:
            break


async def test_first_replica_creates_the_absent_lease_and_keeps_renewing_it(cluster: Cluster) -> None:
    a = await cluster.add("a", rng=NoJitter())
    assert cluster.double.lease(NS, NAME) is None
    await cluster.start(a)

    assert a.elector.is_leader and a.elector.leader == "a" and a.started == 1
    assert ("POST", f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases") in [
        (method, path) for method, path, _ in cluster.double.requests
    ]
    spec = lease_spec(cluster.double)
    assert spec["holderIdentity"] == "a"
    assert spec["leaseDurationSeconds"] == 15
    assert spec.get("leaseTransitions", 0) == 0
    # MicroTime as the API server writes it, from the injected clock.
    assert spec["acquireTime"] == spec["renewTime"] == format_micro_time(a.clock.time())
    assert spec["renewTime"].endswith("Z") and len(spec["renewTime"].split(".")[1]) == 7
    acquired = spec["acquireTime"]

    await cluster.advance(30)

    spec = lease_spec(cluster.double)
    assert a.elector.is_leader and a.started == 1 and a.stopped == 0
    assert spec["acquireTime"] == acquired and spec.get("leaseTransitions", 0) == 0
    assert a.clock.time() - parse_micro_time(spec["renewTime"]) <= CONFIG.retry_period_seconds


async def test_follower_does_not_acquire_while_the_leader_renews(cluster: Cluster) -> None:
    a = await cluster.add("a")
    b = await cluster.add("b", skew=-3600.0)  # an hour behind: the leader's renewTime looks future
    await cluster.start(a)
    await cluster.start(b)

    await cluster.advance(60)

    assert a.elector.is_leader and a.started == 1 and a.stopped == 0
    assert not b.elector.is_leader and b.started == 0
    assert b.elector.leader == "a"
    spec = lease_spec(cluster.double)
    assert spec["holderIdentity"] == "a" and spec.get("leaseTransitions", 0) == 0


async def test_dead_leader_is_replaced_only_after_lease_duration_on_the_followers_clock(
    cluster: Cluster,
) -> None:
    a = await cluster.add("a", rng=NoJitter())
    b = await cluster.add("b", skew=7200.0, rng=NoJitter())  # two hours ahead: must not matter
    await cluster.start(a)
    await cluster.start(b)
    await cluster.advance(10)

    a.frozen = True
    renewed = last_renewal(cluster, a)
    await cluster.advance(40, until=lambda: b.elector.is_leader)

    assert b.elector.is_leader and b.started == 1
    took = cluster.elapsed - renewed
    # b first sees a's last renewal on its next poll (<= 2 s), waits 15 s from then, and takes
    # the lease on the poll after that.
    assert CONFIG.lease_duration_seconds <= took <= CONFIG.lease_duration_seconds + 4 + STEP
    spec = lease_spec(cluster.double)
    assert spec["holderIdentity"] == "b" and spec["leaseTransitions"] == 1
    assert spec["acquireTime"] == spec["renewTime"] == format_micro_time(b.clock.time())
    # The paused leader's own clock has already ended its leadership.
    assert not a.elector.is_leader

    a.frozen = False
    await cluster.advance(20)
    assert a.stopped == 1 and a.started == 1 and a.holder_when_stopped == "b"
    assert a.elector.leader == "b" and b.elector.is_leader
    assert lease_spec(cluster.double)["leaseTransitions"] == 1


@pytest.mark.parametrize("renew_deadline", [10.0, 9.0])
async def test_leader_whose_renewals_fail_steps_down_at_the_renew_deadline(
    cluster: Cluster, renew_deadline: float
) -> None:
    config = LeaderConfig(namespace=NS, lease_name=NAME, renew_deadline_seconds=renew_deadline)
    a = await cluster.add("a", rng=NoJitter(), config=config)
    b = await cluster.add("b", rng=NoJitter(), config=config)
    await cluster.start(a)
    await cluster.start(b)
    await cluster.advance(4)
    renewed = last_renewal(cluster, a)
    cluster.double.fail_next("PUT", LEASE_PATH, 503, count=100)
    cluster.double.fail_next("GET", LEASE_PATH, 503, count=100)

    while cluster.elapsed - renewed < renew_deadline - STEP:
        await cluster.advance(STEP)
        assert a.elector.is_leader and a.stopped == 0

    cluster.tick()
    # Leadership ends by the clock, before the election loop has had a chance to run...
    assert not a.elector.is_leader and a.stopped == 0
    await cluster.settle()
    # ...and the loop wakes at the deadline itself (not at its next retry) to call on_stopped.
    assert a.stopped == 1

    await cluster.advance(8)
    assert cluster.leaders() == [] and a.stopped == 1 and b.started == 0
    assert a.task is not None and not a.task.done()  # errors are retried, never fatal

    await end_outage(cluster)
    await cluster.advance(30, until=lambda: bool(cluster.leaders()))
    (leader,) = cluster.leaders()
    spec = lease_spec(cluster.double)
    assert spec["holderIdentity"] == leader
    # Re-acquiring its own, unchanged record is no transition; taking a's is one.
    assert spec.get("leaseTransitions", 0) == (0 if leader == "a" else 1)
    assert a.started - a.stopped == (1 if leader == "a" else 0)


async def test_never_two_leaders_under_pauses_and_api_faults(cluster: Cluster) -> None:
    chaos = random.Random(20251130)
    replicas = [
        await cluster.add("a"),
        await cluster.add("b", skew=-5000.0),
        await cluster.add("c", skew=3000.0),
    ]
    for replica in replicas:
        await cluster.start(replica)
    thaw_at: dict[str, float] = {}
    for _ in range(60):
        roll = chaos.random()
        leaders = [r for r in replicas if r.elector.is_leader]
        if roll < 0.2 and leaders and leaders[0].name not in thaw_at:
            leaders[0].frozen = True
            thaw_at[leaders[0].name] = cluster.elapsed + chaos.uniform(4.0, 25.0)
        elif roll < 0.35:
            method = chaos.choice(["GET", "PUT"])
            status = chaos.choice([409, 429, 500, 503])
            cluster.double.fail_next(method, LEASE_PATH, status, count=chaos.randint(1, 6))
        await cluster.advance(4)  # asserts at most one leader after every step
        for replica in replicas:
            if replica.name in thaw_at and cluster.elapsed >= thaw_at[replica.name]:
                replica.frozen = False
                del thaw_at[replica.name]

    for replica in replicas:
        replica.frozen = False
    await end_outage(cluster)
    await cluster.advance(40)

    (leader,) = cluster.leaders()
    spec = lease_spec(cluster.double)
    assert spec["holderIdentity"] == leader
    assert spec["leaseTransitions"] >= 2, "the schedule never moved leadership"
    for replica in replicas:
        assert replica.elector.leader == leader
        assert replica.started - replica.stopped == (1 if replica.name == leader else 0)


async def leader_and_follower(
    cluster: Cluster, *, steady: bool = False, settle_s: float = 6.0
) -> tuple[Replica, Replica]:
    """``a`` leading for a few renewals (``settle_s``), ``b`` (no jitter: it polls every retry
    period) following; ``steady``: ``a`` renews without jitter too."""
    a = await cluster.add("a", rng=NoJitter() if steady else None)
    b = await cluster.add("b", rng=NoJitter())
    await cluster.start(a)
    await cluster.start(b)
    await cluster.advance(settle_s)
    return a, b


@pytest.mark.parametrize("offset_steps", range(8))
async def test_a_lease_deleted_under_its_leader_never_gives_two_leaders(
    cluster: Cluster, offset_steps: int
) -> None:
    # ``kubectl delete lease`` while a leads, at every phase of its renewals. The follower that
    # finds no Lease must not create one and lead while a still acts: a recreates it on its next
    # renewal and goes on. (The harness asserts at most one leader after every step.)
    a = await cluster.add("a", rng=NoJitter())
    b = await cluster.add("b", rng=NoJitter())
    await cluster.start(a)
    await cluster.advance(1.0)  # b polls half-way between a's renewals
    await cluster.start(b)
    await cluster.advance(6.0 + offset_steps * STEP)
    assert a.elector.is_leader
    cluster.double.delete_lease(NS, NAME)
    await cluster.advance(30.0)
    assert cluster.leaders() == ["a"] and a.stopped == 0 and b.started == 0
    assert lease_spec(cluster.double)["holderIdentity"] == "a"


async def test_a_lease_deleted_under_a_paused_leader_is_taken_after_a_lease_duration(
    cluster: Cluster,
) -> None:
    # The leader is paused (a long GC, SIGSTOP) and its Lease deleted: the follower treats the
    # deletion as a change of the record and waits a lease duration from when it saw it, by
    # which time the paused leader has stopped acting by its own deadline.
    a, b = await leader_and_follower(cluster, steady=True)
    a.frozen = True
    cluster.double.delete_lease(NS, NAME)
    deleted = cluster.elapsed
    await cluster.advance(40.0, until=lambda: b.elector.is_leader)
    assert b.elector.is_leader
    waited = cluster.elapsed - deleted
    lease_s, retry_s = CONFIG.lease_duration_seconds, CONFIG.retry_period_seconds
    assert lease_s <= waited <= lease_s + 2 * retry_s
    assert lease_spec(cluster.double)["holderIdentity"] == "b"


async def test_annotations_do_not_recreate_a_lease_deleted_under_a_holder(cluster: Cluster) -> None:
    # A holderless Lease reads as released, and whoever saw it would lead at once: so an
    # annotation write (the breaker) never creates one while a holder may be acting. The
    # election recreates the Lease; the write then goes through.
    _, b = await leader_and_follower(cluster, steady=True)
    cluster.double.delete_lease(NS, NAME)
    with pytest.raises(KubeUnavailable):
        await b.elector.update_annotations({"gpuwarden.io/breaker": "open"})
    assert cluster.double.lease(NS, NAME) is None
    await cluster.advance(4.0)
    await b.elector.update_annotations({"gpuwarden.io/breaker": "open"})
    lease = cluster.double.lease(NS, NAME)
    assert lease is not None and lease["spec"]["holderIdentity"] == "a"
    assert lease["metadata"]["annotations"] == {"gpuwarden.io/breaker": "open"}
    assert cluster.leaders() == ["a"]


async def test_renewals_annotations_and_release_keep_what_others_put_on_the_lease(cluster: Cluster) -> None:
    # A Lease made by the chart, with labels, a finalizer, an owner and spec fields newer than this
    # code (coordination.k8s.io/v1 preferredHolder and strategy, Kubernetes 1.31+). Every write of
    # ours is a PUT of the whole object: it must change only the election fields and annotations.
    others_meta = {
        "labels": {"app.kubernetes.io/name": "gpuwarden"},
        "finalizers": ["example.com/keep"],
        "ownerReferences": [
            {"apiVersion": "apps/v1", "kind": "Deployment", "name": "gpuwarden", "uid": "u-1"}
        ],
    }
    others_spec = {"preferredHolder": "a", "strategy": "OldestEmulationVersion"}
    cluster.double.seed_lease(
        {"metadata": {"name": NAME, "namespace": NS, **others_meta}, "spec": others_spec}
    )
    a, b = await leader_and_follower(cluster, steady=True)
    assert a.elector.is_leader
    await b.elector.update_annotations({"gpuwarden.io/breaker": "open"})
    await cluster.advance(6.0)
    assert a.task is not None
    a.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await a.task
    await cluster.advance(4.0, until=lambda: b.elector.is_leader)
    assert b.elector.is_leader
    lease = cluster.double.lease(NS, NAME)
    assert lease is not None
    for key, value in others_meta.items():
        assert lease["metadata"][key] == value, key
    assert {k: lease["spec"][k] for k in others_spec} == others_spec
    assert lease["metadata"]["annotations"] == {"gpuwarden.io/breaker": "open"}
    assert lease["spec"]["holderIdentity"] == "b"


async def test_graceful_shutdown_releases_so_the_follower_takes_over_at_once(cluster: Cluster) -> None:
    a, b = await leader_and_follower(cluster)

    assert a.task is not None
    a.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await a.task

    assert a.stopped == 1 and not a.elector.is_leader and a.elector.leader is None
    assert a.holder_when_stopped == "a"  # it stopped acting before it let go of the lease
    spec = lease_spec(cluster.double)
    assert spec.get("holderIdentity") is None and spec["leaseDurationSeconds"] == 1
    released = cluster.elapsed

    await cluster.advance(20, until=lambda: b.elector.is_leader)
    assert b.elector.is_leader
    assert cluster.elapsed - released <= CONFIG.retry_period_seconds  # its next poll, no expiry wait
    spec = lease_spec(cluster.double)
    assert spec["holderIdentity"] == "b" and spec["leaseTransitions"] == 1


async def cancel_and_run_out(cluster: Cluster, replica: Replica) -> None:
    """Cancel the replica's election loop and advance the clocks while it releases (its
    back-off sleeps on its own clock), until the loop has ended."""
    assert replica.task is not None
    replica.task.cancel()
    for _ in range(round(30 / STEP)):
        await cluster.advance(STEP)
        if replica.task.done():
            break
    with pytest.raises(asyncio.CancelledError):
        await replica.task


@pytest.mark.parametrize("status", [429, 503])
async def test_a_release_refused_for_now_is_retried_so_the_follower_still_takes_over_at_once(
    cluster: Cluster, status: int
) -> None:
    # API Priority and Fairness sheds the shutdown's release (429, Retry-After: 1), or the API
    # server is restarting (503): tried once, as client-go does, the lease would stay ours for a
    # lease duration with nobody leading.
    a, b = await leader_and_follower(cluster)
    assert cluster.leaders() == ["a"]
    cluster.double.fail_next("PUT", LEASE_PATH, status, count=2)

    await cancel_and_run_out(cluster, a)
    assert a.stopped == 1 and a.holder_when_stopped == "a"
    spec = lease_spec(cluster.double)
    assert spec.get("holderIdentity") in (None, "b")  # released (b may have taken it already)
    await cluster.advance(2 * CONFIG.retry_period_seconds, until=lambda: b.elector.is_leader)
    assert b.elector.is_leader
    assert lease_spec(cluster.double)["holderIdentity"] == "b"


async def test_a_release_waits_as_long_as_the_api_server_asks(cluster: Cluster) -> None:
    a, _ = await leader_and_follower(cluster)
    cluster.double.throttle(burst=1, retry_after=4, verbs=("update",), path_regex=LEASE_PATH)
    assert a.task is not None
    a.task.cancel()
    await cluster.advance(2.5)  # past our own 1 s, short of the server's 4 s: not tried again yet
    assert cluster.double.throttled == 1
    assert lease_spec(cluster.double)["holderIdentity"] == "a"
    await cluster.advance(2.5)
    with pytest.raises(asyncio.CancelledError):
        await a.task
    assert lease_spec(cluster.double).get("holderIdentity") in (None, "b")  # released on the retry


async def test_a_release_the_api_never_answers_gives_up_and_the_lease_expires(cluster: Cluster) -> None:
    a, b = await leader_and_follower(cluster)
    cluster.double.fail_next("PUT", LEASE_PATH, 503, count=1000)
    cluster.double.fail_next("GET", LEASE_PATH, 503, count=1000)

    await cancel_and_run_out(cluster, a)  # shutdown ends: the retries are bounded
    gave_up = cluster.elapsed
    assert lease_spec(cluster.double)["holderIdentity"] == "a"
    await end_outage(cluster)
    await cluster.advance(30, until=lambda: b.elector.is_leader)
    # b honours a's lease for a full duration from when it first sees its last renewal (at the
    # latest just after the outage), then takes it on its next try.
    assert b.elector.is_leader
    assert cluster.elapsed - gave_up <= CONFIG.lease_duration_seconds + CONFIG.retry_period_seconds + STEP


async def test_annotations_written_by_a_follower_survive_the_leaders_renewals(cluster: Cluster) -> None:
    a = await cluster.add("a")
    b = await cluster.add("b")
    await cluster.start(a)
    await cluster.start(b)
    await cluster.advance(3)
    election = dict(lease_spec(cluster.double))

    await b.elector.update_annotations({"gpuwarden.io/breaker": "open", "gpuwarden.io/scratch": "1"})

    lease = cluster.double.lease(NS, NAME)
    assert lease is not None
    assert lease["metadata"]["annotations"] == {"gpuwarden.io/breaker": "open", "gpuwarden.io/scratch": "1"}
    assert lease["spec"] == election  # holder and renew fields kept as read
    assert b.elector.annotations["gpuwarden.io/breaker"] == "open"

    await cluster.advance(4)

    lease = cluster.double.lease(NS, NAME)
    assert lease is not None
    assert lease["spec"]["renewTime"] != election["renewTime"], "the leader did not renew"
    assert lease["metadata"]["annotations"] == {"gpuwarden.io/breaker": "open", "gpuwarden.io/scratch": "1"}
    assert dict(a.elector.annotations) == lease["metadata"]["annotations"]
    assert a.elector.is_leader and a.stopped == 0 and b.started == 0

    await a.elector.update_annotations({"gpuwarden.io/scratch": None})
    await cluster.advance(4)
    lease = cluster.double.lease(NS, NAME)
    assert lease is not None
    assert lease["metadata"]["annotations"] == {"gpuwarden.io/breaker": "open"}
    assert dict(b.elector.annotations) == {"gpuwarden.io/breaker": "open"}


async def test_annotation_writes_do_not_look_like_renewals(cluster: Cluster) -> None:
    a, b = await leader_and_follower(cluster, steady=True, settle_s=4)
    a.frozen = True
    renewed = last_renewal(cluster, a)

    writes = 0
    while not b.elector.is_leader and cluster.elapsed - renewed < 40:
        writes += 1
        await b.elector.update_annotations({"gpuwarden.io/breaker": str(writes)})
        await cluster.advance(1)

    assert b.elector.is_leader
    assert cluster.elapsed - renewed <= CONFIG.lease_duration_seconds + 4 + STEP
    assert lease_spec(cluster.double)["holderIdentity"] == "b"
    assert b.elector.annotations["gpuwarden.io/breaker"] == str(writes)


async def test_annotations_before_any_leader_create_the_lease_and_are_kept_on_acquire(
    cluster: Cluster,
) -> None:
    a = await cluster.add("a")
    await a.elector.update_annotations({"gpuwarden.io/breaker": "open", "gpuwarden.io/gone": None})
    lease = cluster.double.lease(NS, NAME)
    assert lease is not None
    assert lease["metadata"]["annotations"] == {"gpuwarden.io/breaker": "open"}
    assert lease["spec"].get("holderIdentity") is None
    assert not a.elector.is_leader

    await cluster.start(a)
    assert cluster.leaders() == ["a"]
    lease = cluster.double.lease(NS, NAME)
    assert lease is not None
    assert lease["metadata"]["annotations"] == {"gpuwarden.io/breaker": "open"}
    assert lease["spec"]["holderIdentity"] == "a"


async def test_annotation_update_retries_conflicts_then_gives_up(cluster: Cluster) -> None:
    a = await cluster.add("a")
    await cluster.start(a)

    cluster.double.fail_next("PUT", LEASE_PATH, 409, count=2)
    await a.elector.update_annotations({"gpuwarden.io/breaker": "open"})
    lease = cluster.double.lease(NS, NAME)
    assert lease is not None and lease["metadata"]["annotations"] == {"gpuwarden.io/breaker": "open"}

    cluster.double.fail_next("PUT", LEASE_PATH, 409, count=50)
    with pytest.raises(KubeConflict):
        await a.elector.update_annotations({"gpuwarden.io/breaker": "closed"})
    lease = cluster.double.lease(NS, NAME)
    assert lease is not None and lease["metadata"]["annotations"] == {"gpuwarden.io/breaker": "open"}


@pytest.mark.parametrize("renew_time", ["2020-01-01T00:00:00.000000Z", "2035-06-01T00:00:00.000000Z"])
async def test_lease_of_an_unknown_holder_is_honoured_for_a_lease_duration_from_first_sight(
    cluster: Cluster, renew_time: str
) -> None:
    seeder = await cluster.client()
    await seeder.create_lease(
        Lease(
            NAME,
            NS,
            "",
            holder="aggregator-7f9c-gone",
            lease_duration_seconds=15,
            acquire_time=renew_time,
            renew_time=renew_time,
            transitions=3,
        )
    )
    a = await cluster.add("a", rng=NoJitter())
    await cluster.start(a)
    first_seen = cluster.elapsed
    assert not a.elector.is_leader and a.elector.leader == "aggregator-7f9c-gone"

    await cluster.advance(40, until=lambda: a.elector.is_leader)

    took = cluster.elapsed - first_seen
    assert CONFIG.lease_duration_seconds <= took <= CONFIG.lease_duration_seconds + 2
    spec = lease_spec(cluster.double)
    assert spec["holderIdentity"] == "a" and spec["leaseTransitions"] == 4


@pytest.mark.parametrize(
    ("lease", "renew", "retry"),
    [(10.0, 10.0, 2.0), (15.0, 2.0, 2.0)],
)
def test_timings_client_go_refuses_are_refused(lease: float, renew: float, retry: float) -> None:
    config = LeaderConfig(
        lease_duration_seconds=lease, renew_deadline_seconds=renew, retry_period_seconds=retry
    )
    with pytest.raises(ConfigError, match="must be greater than"):
        LeaderElector(object(), config, identity="a", clock=FakeClock())  # type: ignore[arg-type]


async def test_time_left_is_what_remains_of_the_renew_deadline_and_zero_off_it(cluster: Cluster) -> None:
    a, b = await leader_and_follower(cluster, steady=True, settle_s=4)
    assert cluster.leaders() == ["a"]
    since = cluster.elapsed - last_renewal(cluster, a)
    assert a.elector.time_left() == pytest.approx(CONFIG.renew_deadline_seconds - since)
    assert 0 < a.elector.time_left() <= CONFIG.renew_deadline_seconds
    assert b.elector.time_left() == 0.0
