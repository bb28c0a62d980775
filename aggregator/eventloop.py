"""The event loop the aggregator serves on: uvloop where it is installed, else asyncio's own.

uvloop runs asyncio's API on libuv, with sockets, transports and the loop's scheduling in C. For
this service every report is one HTTP request, so the cost of a request's trip through the loop
is paid 750 times a second at 7,500 nodes: measured with ``bench/ingest.py --event-loop``, the two
loops interleaved, aiohttp around a no-op pipeline (auth, limits, decode, plausibility) took 25 %
less CPU a report on uvloop (docs/performance.md, "The event loop"). Nothing in the service
depends on which loop runs it: both implement the same ``asyncio.AbstractEventLoop`` (servers on
a socket we bind, signal handlers, thread-safe callbacks, executors, TLS).

``server.event_loop`` in the configuration chooses: ``auto`` (the default: uvloop if it can be
imported, else asyncio's), ``uvloop`` (refuse to start without it) or ``asyncio``. This is the
one module of the service that imports uvloop (bench/stalls.py and the tests name it too).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Final, Literal, TypeVar

from agent.errors import ConfigError

EventLoopKind = Literal["auto", "uvloop", "asyncio"]
EVENT_LOOPS: Final[tuple[EventLoopKind, ...]] = ("auto", "uvloop", "asyncio")

T = TypeVar("T")


def loop_factory(kind: EventLoopKind) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """What makes the loop ``kind`` asks for; None for asyncio's default loop."""
    if kind == "asyncio":
        return None
    try:
        import uvloop  # noqa: PLC0415 - optional at run time, and only the service needs it
    except ImportError as exc:
        if kind == "uvloop":
            raise ConfigError(f"server.event_loop is uvloop, but uvloop cannot be imported: {exc}") from exc
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run(main: Coroutine[Any, Any, T], kind: EventLoopKind) -> T:
    """``asyncio.run(main)`` on the loop ``kind`` asks for."""
    try:
        factory = loop_factory(kind)
    except ConfigError:
        main.close()  # never awaited: say nothing of it
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    """``uvloop`` or ``asyncio``: which implementation ``loop`` is (for the start-up log line)."""
    return "uvloop" if type(loop).__module__.partition(".")[0] == "uvloop" else "asyncio"
