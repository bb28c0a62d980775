"""The aggregator's long-lived heap and the cycle collector: what is frozen, and when.

A full collection walks every object the collector tracks and holds the event loop meanwhile.
Most of what a running aggregator tracks lives as long as the process: the imported libraries
(numpy, scikit-learn, aiohttp: about 159,000 objects before the first report) and, once the fleet
has reported, each node's state (about 13 objects a node: its record, history, health and rule
state; 100,000 at 7,500 nodes). None of that can become garbage while the node is known, yet a
full collection walks it all, for 100-150 ms at 7,500 nodes. ``gc.freeze`` moves what exists into
the collector's permanent generation, which no collection walks; later collections walk what is
newer.

The price: an object frozen and later part of cyclic garbage is never freed (garbage without
cycles is freed by reference counting as always). So the heap is frozen twice and only twice,
each time right after a full collection, so that nothing then garbage is frozen: once when the
service is built (``freeze_startup_heap``), and once when the fleet has stopped growing
(``freeze_when_warm``). What could leak is the handful of objects in flight at that moment (a few
requests), once. Nodes that join later, and state a node makes anew, stay in the walked
generations.

Freed memory is the other half. CPython's objects of more than 512 bytes, numpy's arrays and a
node history's rows come from glibc's malloc, which gives memory back to the system only from
the top of its heap; what is freed below a live block stays in the process. The aggregator frees
a node's reports an interval after they came, among the blocks of nodes that stay, so that free
memory builds up in the middle of the heap: with every node's history full it was about a third
of the pipeline's resident memory (``bench/memory.py``). ``trim_periodically`` hands it back with
glibc's ``malloc_trim(0)`` once a minute, in a worker thread: the call releases the GIL, and
holds only malloc's own lock, arena by arena, while it runs (a few ms at 1,000 nodes). The loop's
thread waits for that lock whenever it allocates meanwhile, but on the pipeline's own heap that
held the loop for at most 17 ms while trims under load took up to 630 ms (``bench/trim_lag.py``,
docs/performance.md). Where the C library has no ``malloc_trim`` (musl, macOS), or another
allocator serves ``malloc`` (a preloaded jemalloc returns freed pages itself), there is nothing to
trim: said once.

Young collections walk what is newer than the freeze, and they hold the loop too. CPython collects
the youngest generation when its count of allocations less deallocations passes 700; each report
leaves about a dozen tuples behind (the rows msgspec decodes, the history's row and key tuples),
but the report an interval older leaves the history at the same time, and its freed tuples count
against the new ones. Without other churn the count barely moves and a young collection waits for
thousands of reports' survivors: 37,000 objects and 61 ms in ``bench/trim_lag.py``, in process. In
the service the HTTP layer's own allocations keep the count moving: at 7,500 nodes no young
collection took over 25 ms, nor over 50 ms while the machine ran at half speed.
``collections_timed`` times every collection into the metrics by generation
(``gpuwarden_aggregator_gc_collection_seconds``), so that a pause is seen, not guessed.

The service calls these (aggregator/cli.py), never a test that builds aggregators in-process.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import gc
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Protocol

log = logging.getLogger(__name__)

# How often free memory is handed back. A minute lets a minute's freed reports pile up (about
# 10 KB a node at a 10 s interval, measured) against a few ms of malloc's lock per call.
TRIM_INTERVAL_S = 60.0

Trim = Callable[[], object]


class HeapTrimMetrics(Protocol):
    def heap_trim(self, seconds: float, released_bytes: int) -> None: ...


class CollectionMetrics(Protocol):
    def collection(self, generation: int, seconds: float) -> None: ...


def freeze_startup_heap() -> None:
    """Collect, then freeze what exists once the service is built (see the module docstring)."""
    gc.collect()
    gc.freeze()
    log.info("startup heap frozen", extra={"objects": gc.get_freeze_count()})


async def freeze_when_warm(nodes: Callable[[], int], interval_s: float) -> int:
    """Once the fleet has stopped growing, collect and freeze the heap again; the nodes then known.

    Checked once a report interval: the fleet is warm when it knows nodes and no node joined since
    the last check, which is one interval after the last first report (a fleet reports within an
    interval). That collection walks everything once, a pause like any full collection's; the
    ones after it walk only what is newer than the freeze."""
    previous = -1
    while True:
        await asyncio.sleep(interval_s)
        known = nodes()
        if known > 0 and known == previous:
            break
        previous = known
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    log.info(
        "fleet heap frozen",
        extra={
            "nodes": known,
            "objects": gc.get_freeze_count(),
            "pause_ms": round((time.perf_counter() - started) * 1000, 1),
        },
    )
    return known


def malloc_trim() -> Trim | None:
    """glibc's ``malloc_trim(0)``: give every free page of every malloc arena back to the system;
    None where the C library has none, or where another allocator serves ``malloc`` (a preloaded
    jemalloc returns freed pages itself; glibc's arenas would be empty)."""
    if allocator() != "glibc":
        return None
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    # ctypes drops the GIL around a foreign call: the event loop runs while this one does.
    return lambda: trim(0)


def allocator() -> str:
    """The malloc this process runs on: ``jemalloc`` (preloaded with ``LD_PRELOAD``), ``glibc``, or
    ``other``. jemalloc is asked first: a preloaded allocator leaves glibc's functions in place."""
    try:
        process = ctypes.CDLL(None)
    except OSError:
        return "other"
    if getattr(process, "mallctl", None) is not None:
        return "jemalloc"
    if getattr(process, "gnu_get_libc_version", None) is not None:
        return "glibc"
    return "other"


def resident_bytes() -> int | None:
    """The process's resident set (``/proc/self/statm``), None where there is no procfs."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


async def trim_periodically(
    metrics: HeapTrimMetrics, *, trim: Trim | None, interval_s: float = TRIM_INTERVAL_S
) -> None:
    """Every ``interval_s``, hand the heap's free memory back (see the module docstring), off the
    event loop; its time and the resident memory it released go to ``metrics``."""
    if trim is None:
        log.info(
            "no malloc_trim here: freed memory is the allocator's to return", extra={"allocator": allocator()}
        )
        return
    while True:
        await asyncio.sleep(interval_s)
        before = resident_bytes()
        started = time.perf_counter()
        await asyncio.to_thread(trim)
        seconds = time.perf_counter() - started
        after = resident_bytes()
        released = max(0, before - after) if before is not None and after is not None else 0
        metrics.heap_trim(seconds, released)
        log.debug("heap trimmed", extra={"ms": round(seconds * 1000, 1), "released_bytes": released})


@contextlib.contextmanager
def collections_timed(metrics: CollectionMetrics) -> Iterator[None]:
    """Within the block, every collection is timed into ``metrics`` by generation, whichever thread
    made it: the event loop's thread waits each one out (a collection holds the interpreter lock)."""
    began = 0.0

    def timed(phase: str, info: dict[str, int]) -> None:
        nonlocal began
        if phase == "start":
            began = time.perf_counter()
        else:
            metrics.collection(info["generation"], time.perf_counter() - began)

    gc.callbacks.append(timed)
    try:
        yield
    finally:
        gc.callbacks.remove(timed)
