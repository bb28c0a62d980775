"""The shard fence (aggregator/shard/fence.py): while replicas of another count of shards are live
(a roll that changes N), a shard's leader does not write to Nodes. Through the real client,
against the API-server double; time is a FakeClock advanced by hand."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from agent.clock import FakeClock
from aggregator.config import LeaderConfig
from aggregator.kube.client import KubeClient
from aggregator.kube.leader import format_micro_time
from aggregator.kube.objects import KubeNotFound, KubeUnavailable, Lease
from aggregator.shard.fence import SHARDS_ANNOTATION, ShardFence
from tests.background import background
from tests.kube_double import KubeApiDouble

NS = "gpuwarden"
BASE = "gpuwarden-aggregator"
LEADER = LeaderConfig(namespace=NS, lease_name=f"{BASE}-shard-0")  # 15 s lease, 10 s deadline, 2 s retry


class World:
    def __init__(self, double: KubeApiDouble, client: KubeClient) -> None:
        self.double = double
        self.client = client
        self.clock = FakeClock()
        self.changes = 0

    def fence(self, shards: int) -> ShardFence:
        def changed() -> None:
            self.changes += 1

        return ShardFence(self.client, LEADER, base=BASE, shards=shards, clock=self.clock, on_change=changed)

    async def hold(self, name: str, holder: str | None, *, shards: int | None = None) -> None:
        """``holder`` writes (or renews) Lease ``name`` now, stamped with ``shards`` if given."""
        now = format_micro_time(self.clock.time())
        stamp = {SHARDS_ANNOTATION: str(shards)} if shards is not None else {}
        try:
            current = await self.client.get_lease(NS, name)
        except KubeNotFound:
            await self.client.create_lease(Lease(name, NS, "", holder, 15, now, now, 0, stamp))
            return
        await self.client.replace_lease(
            Lease(name, NS, current.resource_version, holder, 15, now, now, current.transitions, stamp)
        )


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    async with KubeApiDouble() as double:
        client = await KubeClient.from_kubeconfig(double.write_kubeconfig(tmp_path / "kubeconfig"))
        try:
            yield World(double, client)
        finally:
            await client.close()


async def test_a_new_count_holds_back_while_the_old_renews_and_acts_once_it_released(world: World) -> None:
    # Rolling from 2 shards to 3: shard 1 of the old count still leads (stamped 2), and renews.
    await world.hold(f"{BASE}-shard-1", "old-b-1", shards=2)
    await world.hold(f"{BASE}-shard-0", "new-a-0", shards=3)
    fence = world.fence(3)
    assert not fence.clear  # nothing is known before the first check
    assert not await fence.check()
    assert fence.others == (f"{BASE}-shard-1",)
    for _ in range(10):  # a minute of renewals by the old leader
        world.clock.advance(6.0)
        await world.hold(f"{BASE}-shard-1", "old-b-1", shards=2)
        assert not await fence.check()
    # The old replica stops cleanly: it releases its Lease (no holder); the new count acts.
    await world.hold(f"{BASE}-shard-1", None, shards=2)
    assert await fence.check()
    assert fence.others == () and world.changes == 1
    assert fence.time_left() == math.inf  # until a check says otherwise


async def test_the_old_count_holds_back_once_it_sees_the_new(world: World) -> None:
    await world.hold(f"{BASE}-shard-0", "old-a-0", shards=2)
    old = world.fence(2)
    assert await old.check()
    await world.hold(f"{BASE}-shard-2", "new-a-2", shards=3)  # a Lease no count of 2 has
    world.clock.advance(LEADER.retry_period_seconds)
    assert not await old.check()
    assert old.others == (f"{BASE}-shard-2",) and world.changes == 2


async def test_an_unsharded_aggregator_still_leading_fences_the_shards(world: World) -> None:
    # Going from one aggregator to shards: the unsharded one leads on the base Lease, unstamped.
    await world.hold(BASE, "gpuwarden-aggregator-0")
    fence = world.fence(4)
    assert not await fence.check()
    assert fence.others == (BASE,)


async def test_an_unsharded_aggregator_holds_back_while_shards_are_live(world: World) -> None:
    # Going from shards back to one: the unsharded leader (base Lease, a count of one) sees the
    # old shards' Leases, stamped or not (a -shard- Lease is never an unsharded one's).
    await world.hold(BASE, "gpuwarden-aggregator-0")
    await world.hold(f"{BASE}-shard-1", "old-b-1", shards=2)
    await world.hold(f"{BASE}-shard-0", "old-a-0")
    fence = world.fence(1)
    assert fence.count_of(Lease(f"{BASE}-shard-0", NS, "1", "x", 15, None, None)) == 2
    assert not await fence.check()
    assert fence.others == (f"{BASE}-shard-0", f"{BASE}-shard-1")
    await world.hold(f"{BASE}-shard-0", None)
    await world.hold(f"{BASE}-shard-1", None, shards=2)
    assert await fence.check()
    assert fence.enforced


async def test_an_unsharded_aggregator_refused_list_writes_as_before_a_shard_does_not(world: World) -> None:
    # A Role from before the fence has no list on Leases. Unsharded, that must not stop every
    # write for good: the fence says it is not enforced and the leader writes as it did.
    # Two refusals each (a retry period apart), then RBAC granted: the checks succeed again.
    world.double.fail_next("GET", rf"/namespaces/{NS}/leases$", 403, count=4)
    single, sharded = world.fence(1), world.fence(2)
    async with background(single.run(), sharded.run()):
        await until(lambda: not single.enforced)
        assert single.clear and single.time_left() > LEADER.renew_deadline_seconds
        single.elected()
        assert single.clear  # nothing to wait for: no check can succeed
        assert sharded.enforced and not sharded.clear
        await until(lambda: single.enforced and sharded.clear, timeout=15.0)
        assert single.clear


async def test_an_unsharded_fence_keeps_its_last_check_through_failures(world: World) -> None:
    # Unsharded, a failing check changes nothing: closed stays closed, a refusal included (only a
    # Role that never allowed list turns the fence off), and clear stays clear past the renew
    # deadline (the shards' own fences hold them back while its Lease is held).
    leases = rf"/namespaces/{NS}/leases$"
    await world.hold(f"{BASE}-shard-0", "old-a-0", shards=2)
    closed = world.fence(1)
    async with background(closed.run()):
        await until(lambda: closed.others == (f"{BASE}-shard-0",))
        world.double.fail_next("GET", leases, 403, count=1000)
        closed.elected()  # wakes the loop: a check now, refused
        await asyncio.sleep(0.2)
        assert closed.enforced and not closed.clear
    world.double.clear_faults()

    await world.hold(f"{BASE}-shard-0", None, shards=2)
    clear = world.fence(1)
    assert await clear.check()
    world.double.fail_next("GET", leases, 503, count=1000)
    world.clock.advance(LEADER.renew_deadline_seconds * 3)
    with pytest.raises(KubeUnavailable):
        await clear.check()
    assert clear.clear and clear.time_left() == math.inf


async def test_a_dead_holders_lease_fences_for_a_lease_duration_from_first_sight(world: World) -> None:
    # Its renewTime says nothing (another clock): the term runs from when this replica saw it.
    await world.hold(f"{BASE}-shard-5", "old-f-5", shards=6)
    fence = world.fence(3)
    await fenced_for_a_lease_duration(world, fence)


async def test_a_lease_deleted_under_its_holder_fences_for_a_lease_duration(world: World) -> None:
    await world.hold(f"{BASE}-shard-4", "old-e-4", shards=5)
    fence = world.fence(3)
    assert not await fence.check()
    world.clock.advance(10.0)
    world.double.delete_lease(NS, f"{BASE}-shard-4")
    # Its holder may still act: the deletion is a change seen now, and its term runs from it.
    await fenced_for_a_lease_duration(world, fence)


async def test_the_same_count_and_other_leases_do_not_fence(world: World) -> None:
    await world.hold(f"{BASE}-shard-0", "a-0", shards=3)
    await world.hold(f"{BASE}-shard-2", "a-2", shards=3)
    await world.hold(f"{BASE}-shard-1", "a-1")  # unstamped (an older replica): a count above 1
    await world.hold(f"{BASE}-canary", "someone-else")
    await world.hold("kube-scheduler", "master-1")
    fence = world.fence(3)
    assert await fence.check()
    assert fence.count_of(Lease(f"{BASE}-shard-7", NS, "1", "x", 15, None, None)) == 8


@pytest.mark.parametrize("live_other", [False, True])
async def test_a_fence_that_cannot_read_the_leases_keeps_its_last_answer(
    world: World, live_other: bool
) -> None:
    # Of two leaders of different counts, the later one's first check saw the earlier one's
    # Lease held: that answer holds as long as it leads, whether later reads succeed or not. A
    # control plane too busy to answer LISTs must not stop every quarantine (nor start any).
    if live_other:
        await world.hold(f"{BASE}-shard-2", "new-a-2", shards=3)
    fence = world.fence(2)
    assert await fence.check() is not live_other
    world.double.fail_next("GET", rf"/namespaces/{NS}/leases$", 503, count=100)
    for _ in range(30):  # a minute of failed checks
        world.clock.advance(LEADER.retry_period_seconds)
        with pytest.raises(KubeUnavailable):
            await fence.check()
        assert fence.clear is not live_other
    assert fence.time_left() == (0.0 if live_other else math.inf)


async def test_a_lease_renewed_while_the_list_was_on_its_way_counts_from_its_answer(world: World) -> None:
    # The other count's leader renews just after the LIST was sent, then stops: it may write
    # until its renew deadline from that renewal, so its term runs from when the answer came
    # (client-go's observedTime), not from when the LIST was sent.
    await world.hold(f"{BASE}-shard-2", "new-a-2", shards=3)
    fence = world.fence(2)
    inner = world.client

    class SlowList:
        async def list_leases(self, namespace: str) -> list[Lease]:
            world.clock.advance(0.1)
            await world.hold(f"{BASE}-shard-2", "new-a-2", shards=3)  # renewed meanwhile
            leases = await inner.list_leases(namespace)
            world.clock.advance(8.0)  # a LIST slowed by a busy control plane
            return leases

    fence._api = SlowList()  # type: ignore[assignment]  # the one call the check makes
    assert not await fence.check()
    fence._api = inner
    # 15 s of term from the answer: still held back 14.5 s after it (22.5 s after the LIST was sent).
    world.clock.advance(14.5)
    assert not await fence.check()
    world.clock.advance(1.0)
    assert await fence.check()


async def test_a_lease_list_slower_than_a_request_timeout_is_waited_for(tmp_path: Path) -> None:
    # A LIST of Leases may be queued by API Priority and Fairness for seconds: it has the LIST
    # timeout, as the Node LISTs do, not the single-object one.
    async with KubeApiDouble() as double:
        client = await KubeClient.from_kubeconfig(double.write_kubeconfig(tmp_path / "kubeconfig"))
        client._timeout = 0.2  # the per-request timeout, shortened for the test
        try:
            double.set_latency("list", 0.5, path_regex="/leases$")
            started = asyncio.get_running_loop().time()
            assert await client.list_leases(NS) == []
            assert asyncio.get_running_loop().time() - started >= 0.5  # past the request timeout
        finally:
            await client.close()


async def test_only_a_check_made_after_the_lease_was_taken_lets_the_leader_write(world: World) -> None:
    # A standby's fence checks too. Its last check may have seen the other count's Leases
    # released just before one of that count's replicas took one: once this replica takes its
    # own Lease, that check says nothing, and neither does one still under way.
    fence = world.fence(3)
    assert await fence.check()
    assert world.changes == 1
    fence.elected()
    assert not fence.clear
    inner = world.client

    class TakenMeanwhile:
        async def list_leases(self, namespace: str) -> list[Lease]:
            leases = await inner.list_leases(namespace)
            fence.elected()  # the Lease is taken while this check's answer is on its way
            return leases

    fence._api = TakenMeanwhile()  # type: ignore[assignment]  # the one call the check makes
    assert not await fence.check()
    fence._api = inner
    assert await fence.check()
    assert world.changes == 2  # told again: the actuator resyncs when its leader may write


async def test_a_new_leader_whose_checks_fail_never_writes_and_is_told_when_one_succeeds(
    world: World,
) -> None:
    # The actuator resyncs every node when writing becomes allowed: it must hear of it.
    leader = LeaderConfig(
        namespace=NS,
        lease_name=f"{BASE}-shard-0",
        lease_duration_seconds=3.0,
        renew_deadline_seconds=2.0,
        retry_period_seconds=0.05,
    )
    seen: list[bool] = []
    fence = ShardFence(
        world.client,
        leader,
        base=BASE,
        shards=2,
        clock=world.clock,
        on_change=lambda: seen.append(fence.clear),
    )
    async with background(fence.run()):
        await until(lambda: seen == [True])
        world.double.fail_next("GET", rf"/namespaces/{NS}/leases$", 403, count=5)
        fence.elected()  # taken again: only a check from now may let it write, and every one fails
        seen.append(fence.clear)
        await until(lambda: len(seen) >= 3)
        assert seen == [True, False, True]  # the failures used up: a check clears it


async def fenced_for_a_lease_duration(world: World, fence: ShardFence) -> None:
    """From now, ``fence`` holds back for the 15 s lease of what it saw change, and no longer."""
    assert not await fence.check()
    world.clock.advance(14.0)
    assert not await fence.check()
    world.clock.advance(2.0)
    assert await fence.check()


async def until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_an_unsharded_fence_whose_role_loses_list_writes_as_a_fresh_start_would(world: World) -> None:
    # The Role reverted to one without list while the pod runs: the fence, whose last check found
    # no other count, turns off as it would in a process started with that Role, instead of
    # leaving a standby that takes over unable to write.
    fence = world.fence(1)
    async with background(fence.run()):
        await until(lambda: fence.clear)
        world.double.fail_next("GET", rf"/namespaces/{NS}/leases$", 403, count=1000)
        fence.elected()  # a take-over: only a later check may clear it, and none can succeed
        await until(lambda: not fence.enforced)
        assert fence.clear
