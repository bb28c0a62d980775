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

The service calls these (aggregator/cli.py), never a test that builds aggregators in-process.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


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
