"""The actuator's pacing on a fake clock: the token bucket, the work queue, the per-node retry
backoff and the delayed adds. No test waits on the wall clock."""

from __future__ import annotations

import asyncio

import pytest

from agent.clock import FakeClock
from aggregator.remediate.workqueue import DelayedAdds, ItemBackoff, TokenBucket, WorkQueue
from tests.test_actuator import Timers


class Sleeps:
    """An injected sleep that advances the fake clock at once and records every wait."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.waits: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.clock.advance(seconds)
        await asyncio.sleep(0)


# -- token bucket ---------------------------------------------------------------------------------


async def test_bucket_lets_a_burst_through_then_paces_at_qps() -> None:
    clock = FakeClock()
    sleeps = Sleeps(clock)
    bucket = TokenBucket(qps=4.0, burst=3, clock=clock, sleep=sleeps)
    start = clock.monotonic()
    for _ in range(3):
        await bucket.acquire()
    assert sleeps.waits == []  # the burst costs no wait
    for _ in range(4):
        await bucket.acquire()
    assert sleeps.waits == pytest.approx([0.25] * 4)
    assert clock.monotonic() - start == pytest.approx(1.0)


async def test_bucket_refills_while_idle_but_never_past_the_burst() -> None:
    clock = FakeClock()
    sleeps = Sleeps(clock)
    bucket = TokenBucket(qps=10.0, burst=2, clock=clock, sleep=sleeps)
    await bucket.acquire()
    await bucket.acquire()
    clock.advance(0.1)  # one token back
    await bucket.acquire()
    assert sleeps.waits == []
    clock.advance(3600)  # an idle hour refills to the burst, not to 36,000
    for _ in range(2):
        await bucket.acquire()
    assert sleeps.waits == []
    await bucket.acquire()
    assert sleeps.waits == pytest.approx([0.1])


async def test_bucket_serves_concurrent_callers_in_order_within_the_rate() -> None:
    clock = FakeClock()
    sleeps = Sleeps(clock)
    bucket = TokenBucket(qps=2.0, burst=1, clock=clock, sleep=sleeps)
    served: list[tuple[int, float]] = []

    async def caller(i: int) -> None:
        await bucket.acquire()
        served.append((i, clock.monotonic()))

    start = clock.monotonic()
    await asyncio.gather(*(caller(i) for i in range(5)))
    assert [i for i, _ in served] == [0, 1, 2, 3, 4]
    assert [t - start for _, t in served] == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0])


# -- work queue -----------------------------------------------------------------------------------


async def test_queue_holds_one_entry_per_key_in_order() -> None:
    q = WorkQueue(limit=10)
    for key in ("a", "b", "a", "c", "b"):
        assert q.add(key)
    assert len(q) == 3 and "a" in q and "z" not in q
    got = [await q.get() for _ in range(3)]
    assert got == ["a", "b", "c"]
    assert len(q) == 0


async def test_queue_never_hands_a_key_to_two_workers_and_reruns_it_after() -> None:
    q = WorkQueue(limit=10)
    q.add("a")
    assert await q.get() == "a"
    q.add("a")  # submitted again while a worker holds it
    q.add("b")
    assert await q.get() == "b"  # not "a": it is still being processed
    assert len(q) == 1  # "a" waits, counted
    second = asyncio.create_task(q.get())
    await asyncio.sleep(0)
    assert not second.done()
    q.done("a")
    assert await asyncio.wait_for(second, 1) == "a"
    q.done("a")
    q.done("b")
    assert len(q) == 0


async def test_full_queue_refuses_new_keys_but_not_queued_ones() -> None:
    q = WorkQueue(limit=2)
    assert q.add("a") and q.add("b")
    assert not q.add("c")
    assert q.add("a")  # already queued: nothing to refuse
    assert len(q) == 2 and "c" not in q
    await q.get()
    assert q.add("c")  # room again


async def test_get_waits_for_an_add() -> None:
    q = WorkQueue(limit=2)
    waiting = asyncio.create_task(q.get())
    await asyncio.sleep(0)
    assert not waiting.done()
    q.add("a")
    assert await asyncio.wait_for(waiting, 1) == "a"


# -- retry backoff --------------------------------------------------------------------------------


def test_backoff_doubles_from_one_second_to_five_minutes_and_forgets_on_success() -> None:
    b = ItemBackoff()
    delays = [b.failed("a") for _ in range(12)]
    assert delays == [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300, 300]
    assert b.failures("a") == 12
    assert b.failed("b") == 1  # per key
    b.forget("a")
    assert b.failures("a") == 0 and b.failed("a") == 1


def test_backoff_of_a_node_failing_for_days_stays_at_the_cap() -> None:
    b = ItemBackoff()
    for _ in range(2000):  # 2**1024 would overflow a float
        delay = b.failed("a")
    assert delay == 300


# -- delayed adds ---------------------------------------------------------------------------------


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_delayed_add_fires_once_its_delay_has_passed() -> None:
    clock = FakeClock()
    timers = Timers(clock, auto_s=0.0)  # every wait parks until the test moves time on
    fired: list[str] = []
    later = DelayedAdds(clock, timers, fired.append)
    later.after("a", 10.0)
    assert "a" in later and later.due("a") == clock.monotonic() + 10.0
    await settle()
    timers.advance(9.0)
    await settle()
    assert fired == []
    timers.advance(1.0)
    await settle()
    assert fired == ["a"]
    assert "a" not in later and later.due("a") is None


async def test_the_earliest_deadline_wins() -> None:
    clock = FakeClock()
    timers = Timers(clock, auto_s=0.0)
    fired: list[str] = []
    later = DelayedAdds(clock, timers, fired.append)
    later.after("a", 10.0)
    later.after("a", 30.0)  # later than the armed one: dropped
    assert later.due("a") == clock.monotonic() + 10.0
    later.after("b", 10.0)
    later.after("b", 5.0)  # earlier: replaces it
    assert later.due("b") == clock.monotonic() + 5.0
    await settle()
    timers.advance(5.0)
    await settle()
    assert fired == ["b"]
    timers.advance(5.0)
    await settle()
    assert fired == ["b", "a"]
    timers.advance(60.0)
    await settle()
    assert fired == ["b", "a"]  # the dropped and the replaced timers never fire


async def test_cancelled_timers_never_fire() -> None:
    clock = FakeClock()
    timers = Timers(clock, auto_s=0.0)
    fired: list[str] = []
    later = DelayedAdds(clock, timers, fired.append)
    later.after("a", 1.0)
    later.after("b", 1.0)
    later.after("c", 1.0)
    later.cancel("a")
    later.cancel("nothing")  # no timer: no error
    await settle()
    timers.advance(2.0)
    await settle()
    assert sorted(fired) == ["b", "c"]
    later.after("d", 1.0)
    later.cancel_all()
    await settle()
    timers.advance(2.0)
    await settle()
    assert sorted(fired) == ["b", "c"]
