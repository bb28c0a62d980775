"""The actuator's pacing: client-go's workqueue and rate limiters, in asyncio.

- ``TokenBucket``: ``burst`` tokens refilled at ``qps``; every API call of every worker takes one,
  so a fleet-wide decision cannot flood the API server;
- ``WorkQueue``: one entry per key however often it is added, never the same key in two workers
  at once (an add while it is processed runs it again afterwards), bounded (an add past the limit
  is refused and the caller's periodic resync catches up);
- ``ItemBackoff``: the per-key retry delay after failures, 1 s doubling to 5 min (client-go's
  ItemExponentialFailureRateLimiter);
- ``DelayedAdds``: one timer per key, the earliest wins (client-go's AddAfter).

Time comes from an injected ``Clock`` and ``sleep``, so tests run without waiting.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Final

from agent.clock import Clock

__all__ = ["RETRY_BASE_S", "RETRY_MAX_S", "DelayedAdds", "ItemBackoff", "TokenBucket", "WorkQueue"]

Sleep = Callable[[float], Awaitable[None]]

RETRY_BASE_S: Final = 1.0
RETRY_MAX_S: Final = 300.0


class TokenBucket:
    """``burst`` tokens, refilled at ``qps``; ``acquire`` waits for one. Waiters queue behind one
    lock, so they are served in order and the bucket's arithmetic never races."""

    def __init__(self, qps: float, burst: int, clock: Clock, sleep: Sleep) -> None:
        self._qps = qps
        self._burst = float(burst)
        self._tokens = float(burst)
        self._clock = clock
        self._sleep = sleep
        self._last = clock.monotonic()
        self._lock = asyncio.Lock()

    def _refill(self) -> None:
        now = self._clock.monotonic()
        self._tokens = min(self._burst, self._tokens + (now - self._last) * self._qps)
        self._last = now

    async def acquire(self) -> None:
        async with self._lock:
            self._refill()
            # The epsilon absorbs float rounding: a wait shorter than the clock's resolution would
            # otherwise never add the last sliver of a token.
            while self._tokens < 1.0 - 1e-9:
                await self._sleep((1.0 - self._tokens) / self._qps)
                self._refill()
            self._tokens -= 1.0


class WorkQueue:
    """client-go's workqueue: deduplicated, and a key being processed is not handed to a second
    worker; an add during processing runs it again after ``done``. ``len`` counts the keys
    waiting (the depth operators see)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._queue: deque[str] = deque()
        self._dirty: set[str] = set()
        self._processing: set[str] = set()
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._dirty)

    def __contains__(self, key: str) -> bool:
        return key in self._dirty

    def add(self, key: str) -> bool:
        """False: the queue is full and the key was not added."""
        if key in self._dirty:
            return True
        if len(self._dirty) >= self._limit:
            return False
        self._dirty.add(key)
        if key not in self._processing:
            self._queue.append(key)
            self._ready.set()
        return True

    async def get(self) -> str:
        """The next key, now being processed until ``done``."""
        while not self._queue:
            self._ready.clear()
            await self._ready.wait()
        key = self._queue.popleft()
        self._dirty.discard(key)
        self._processing.add(key)
        return key

    def done(self, key: str) -> None:
        self._processing.discard(key)
        if key in self._dirty:
            self._queue.append(key)
            self._ready.set()


class ItemBackoff:
    """Consecutive failures per key, and the delay before the next try: ``base`` doubling, capped
    at ``cap``. A success (``forget``) starts the key over."""

    def __init__(self, base: float = RETRY_BASE_S, cap: float = RETRY_MAX_S) -> None:
        self._base = base
        self._cap = cap
        self._failures: dict[str, int] = {}

    def failed(self, key: str) -> float:
        """Count one more failure of ``key``; the delay before trying it again."""
        failures = self._failures.get(key, 0)
        self._failures[key] = failures + 1
        # The exponent stops growing long after the cap is reached: 2.0**1024 would overflow, and a
        # node that fails for days must keep its 5-minute retry, not crash the worker.
        return min(self._base * 2.0 ** min(failures, 64), self._cap)

    def failures(self, key: str) -> int:
        return self._failures.get(key, 0)

    def forget(self, key: str) -> None:
        self._failures.pop(key, None)


class DelayedAdds:
    """``fire(key)`` after a delay, one timer per key: an earlier deadline replaces a later one, a
    later one is dropped (whoever is called then re-arms what it still needs)."""

    def __init__(self, clock: Clock, sleep: Sleep, fire: Callable[[str], None]) -> None:
        self._clock = clock
        self._sleep = sleep
        self._fire = fire
        self._timers: dict[str, tuple[float, asyncio.Task[None]]] = {}  # key -> (due, timer)

    def __contains__(self, key: str) -> bool:
        return key in self._timers

    def due(self, key: str) -> float | None:
        """When ``key``'s timer fires (monotonic), None when it has none."""
        timer = self._timers.get(key)
        return None if timer is None else timer[0]

    def after(self, key: str, delay: float) -> None:
        due = self._clock.monotonic() + delay
        current = self._timers.get(key)
        if current is not None:
            if current[0] <= due and not current[1].done():
                return
            current[1].cancel()

        async def fire() -> None:
            await self._sleep(delay)
            self._timers.pop(key, None)
            self._fire(key)

        self._timers[key] = (due, asyncio.get_running_loop().create_task(fire()))

    def cancel(self, key: str) -> None:
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer[1].cancel()

    def cancel_all(self) -> None:
        for _, task in self._timers.values():
            task.cancel()
        self._timers.clear()
