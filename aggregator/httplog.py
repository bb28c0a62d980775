"""aiohttp's own log line for a request its HTTP parser refused, at most one every few seconds.

aiohttp answers a request it cannot parse (a request line of 8 KB, control bytes in a header, two
Content-Length headers, a missing Host) with a 400 before any handler runs, and logs it through
``aiohttp.server`` at ERROR with a traceback that quotes the offending bytes: 16-32 KB of log a
request that anyone who can reach the port, token or not, can send as fast as the connection
goes. The filter here turns those records into one short warning (the error's type and the peer)
at most every ``every_s`` seconds, saying how many went unlogged, as ``RateLimitedLog`` does for
the service's own refusals (aggregator/ratelog.py). Anything else on that logger, a handler that
raised (a 500, a bug), passes as it is, traceback included.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final

from aiohttp.http_exceptions import HttpProcessingError

from aggregator.ratelog import DEFAULT_EVERY_S

__all__ = ["ParserErrorFilter", "install"]

SERVER_LOGGER: Final = "aiohttp.server"


class ParserErrorFilter(logging.Filter):
    def __init__(
        self, every_s: float = DEFAULT_EVERY_S, monotonic: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self._every = every_s
        self._monotonic = monotonic
        self._last: float | None = None
        self._suppressed = 0
        self.refused = 0  # every request the parser refused, logged or not

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        self.refused += 1
        now = self._monotonic()
        if self._last is not None and 0 <= now - self._last < self._every:
            self._suppressed += 1
            return False
        self._last = now
        peer = record.args[0] if isinstance(record.args, tuple) and record.args else None
        record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        record.msg, record.args = "refused a request the HTTP parser could not read (400)", ()
        record.exc_info = record.exc_text = None
        record.__dict__.update(
            error=type(exc).__name__,
            status=getattr(exc, "code", 400),
            peer=str(peer)[:64],
            suppressed_since_last=self._suppressed,
        )
        self._suppressed = 0
        return True


def install(logger: logging.Logger | None = None) -> ParserErrorFilter:
    """Put the filter on ``aiohttp.server`` (once: a second call returns the one there)."""
    target = logger if logger is not None else logging.getLogger(SERVER_LOGGER)
    for existing in target.filters:
        if isinstance(existing, ParserErrorFilter):
            return existing
    installed = ParserErrorFilter()
    target.addFilter(installed)
    return installed
