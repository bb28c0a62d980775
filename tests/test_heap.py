"""The service's heap freezes: once built, and once more when the fleet has stopped growing."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator

import pytest

from aggregator.heap import freeze_when_warm


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """Give back to the collector whatever a test froze: the test process is not the service."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_the_heap_is_frozen_once_no_node_joined_for_an_interval(unfrozen: None) -> None:
    seen: list[int] = []
    counts = iter([0, 0, 3, 7, 7, 9])

    def nodes() -> int:
        seen.append(next(counts))
        return seen[-1]

    assert gc.get_freeze_count() == 0
    known = asyncio.run(freeze_when_warm(nodes, 0.001))
    # Not on an empty fleet (0, 0), not while it grows (3, 7): at the first repeat of a count.
    assert (known, seen) == (7, [0, 0, 3, 7, 7])
    assert gc.get_freeze_count() > 0


def test_a_service_that_stops_before_the_fleet_is_warm_freezes_nothing(unfrozen: None) -> None:
    async def main() -> None:
        growing = iter(range(1, 10**6))
        task = asyncio.create_task(freeze_when_warm(lambda: next(growing), 0.001))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert gc.get_freeze_count() == 0
