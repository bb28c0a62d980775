"""The service's heap: frozen once built and once more when the fleet has stopped growing, and its
free memory handed back to the system every minute."""

from __future__ import annotations

import asyncio
import ctypes.util
import gc
import logging
import os
import platform
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from aggregator import heap
from aggregator.heap import freeze_when_warm, malloc_trim, resident_bytes, trim_periodically
from aggregator.metrics import Metrics


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


# -- handing freed memory back -------------------------------------------------------------------


def test_malloc_trim_gives_freed_memory_in_the_middle_of_the_heap_back() -> None:
    trim = malloc_trim()
    if platform.libc_ver()[0] != "glibc":
        # Not supported there: the service trims nothing and says so (the test below).
        assert trim is None
        return
    # The image and CI are Debian (glibc): the trim must be found there, or nothing is handed back.
    assert trim is not None
    # 4 KiB blocks come from malloc's heap, not from mmap; keeping one in ten pins the heap's top,
    # so freeing the others gives nothing back by itself: what the aggregator's reports do.
    blocks = [bytes(4096) for _ in range(50_000)]
    kept = blocks[::10]
    del blocks
    before = resident_bytes()
    trim()
    after = resident_bytes()
    assert before is not None and after is not None
    assert before - after > 80 * 2**20, (before, after)  # of the ~180 MiB freed
    assert len(kept) == 5_000


def test_the_allocator_is_told_apart_and_only_glibcs_is_trimmed(monkeypatch: pytest.MonkeyPatch) -> None:
    # This process runs on the C library's malloc (no allocator preloaded in the tests).
    assert heap.allocator() == ("glibc" if platform.libc_ver()[0] == "glibc" else "other")
    jemalloc = ctypes.util.find_library("jemalloc")  # Debian's libjemalloc2, where installed
    if jemalloc is not None:
        preloaded = subprocess.run(
            [sys.executable, "-c", "from aggregator.heap import allocator; print(allocator())"],
            env={**os.environ, "LD_PRELOAD": jemalloc},
            capture_output=True,
            text=True,
            check=True,
        )
        assert preloaded.stdout.strip() == "jemalloc"
    # A preloaded jemalloc returns freed pages itself: glibc's trim would walk empty arenas.
    monkeypatch.setattr(heap, "allocator", lambda: "jemalloc")
    assert heap.malloc_trim() is None


class _TrimMetrics:
    def __init__(self) -> None:
        self.trims: list[tuple[float, int]] = []

    def heap_trim(self, seconds: float, released_bytes: int) -> None:
        self.trims.append((seconds, released_bytes))


def test_the_heap_is_trimmed_off_the_event_loop_every_interval() -> None:
    threads: list[int] = []
    metrics = _TrimMetrics()

    async def main() -> int:
        task = asyncio.create_task(
            trim_periodically(metrics, trim=lambda: threads.append(threading.get_ident()), interval_s=0.01)
        )
        while len(metrics.trims) < 3:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    assert len(threads) >= 3 and loop_thread not in threads
    assert all(seconds >= 0 and released >= 0 for seconds, released in metrics.trims)


def test_without_malloc_trim_nothing_is_trimmed_and_it_says_so(caplog: pytest.LogCaptureFixture) -> None:
    metrics = _TrimMetrics()
    with caplog.at_level(logging.INFO, logger="aggregator.heap"):
        asyncio.run(asyncio.wait_for(trim_periodically(metrics, trim=None, interval_s=0.001), 1.0))
    assert metrics.trims == []
    assert "no malloc_trim" in caplog.text


def test_trims_are_exported() -> None:
    registry = CollectorRegistry()
    Metrics(registry).heap_trim(0.003, 5 * 2**20)
    assert registry.get_sample_value("gpuwarden_aggregator_heap_trim_seconds_count") == 1
    assert registry.get_sample_value("gpuwarden_aggregator_heap_trim_released_bytes_total") == 5 * 2**20


# -- collections timed ------------------------------------------------------------------------------


class _CollectionMetrics:
    def __init__(self) -> None:
        self.collections: list[tuple[int, float]] = []

    def collection(self, generation: int, seconds: float) -> None:
        self.collections.append((generation, seconds))


@pytest.fixture
def no_automatic_collections() -> Iterator[None]:
    """Only the test's own collections: CPython's automatic ones would be timed too."""
    enabled = gc.isenabled()
    gc.disable()
    yield
    if enabled:
        gc.enable()


def test_collections_are_timed_by_generation_within_the_block_only(no_automatic_collections: None) -> None:
    metrics = _CollectionMetrics()
    with heap.collections_timed(metrics):
        gc.collect(0)
        gc.collect(2)
    gc.collect(1)
    assert [g for g, _ in metrics.collections] == [0, 2]
    assert all(seconds >= 0 for _, seconds in metrics.collections)

    registry = CollectorRegistry()
    exported = Metrics(registry)
    with heap.collections_timed(exported):
        gc.collect(1)
    count = "gpuwarden_aggregator_gc_collection_seconds_count"
    assert registry.get_sample_value(count, {"generation": "1"}) == 1
    assert registry.get_sample_value(count, {"generation": "2"}) == 0
