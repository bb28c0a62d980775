"""aiohttp's own log line for a request its HTTP parser refused, at most one every few seconds.

aiohttp answers a request it cannot parse (a request line of 8 KB, control bytes in a header, two
Content-Length headers, a missing Host) with a 400 before any handler runs, and logs it through
``aiohttp.server`` at ERROR with a traceback that quotes the offending bytes: 16-32 KB of log a
request that anyone who can reach the port, token or not, can send as fast as the connection
goes. The filter here drops those records and logs one short warning instead (the error's type
and the peer) through the ``RateLimitedLog`` the service's own refusals use (aggregator/ratelog.py):
at most one every ``every_s`` seconds, saying how many went unlogged. Anything else on that
logger, a handler that raised (a 500, a bug), passes as it is, traceback included.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final

from aiohttp.http_exceptions import HttpProcessingError

from aggregator.ratelog import DEFAULT_EVERY_S, RateLimitedLog

__all__ = ["ParserErrorFilter", "install"]

SERVER_LOGGER: Final = "aiohttp.server"
log = logging.getLogger(__name__)


class ParserErrorFilter(logging.Filter):
    """Drops aiohttp's record of a request its parser refused and says so through
    ``RateLimitedLog`` instead (kind ``http_parser_refused``, on this module's logger)."""

    def __init__(
        self, every_s: float = DEFAULT_EVERY_S, monotonic: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self._log = RateLimitedLog(log, every_s=every_s, monotonic=monotonic)

    @property
    def refused(self) -> int:
        """Every request the parser refused, logged or not."""
        return self._log.counts.get("http_parser_refused", 0)

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        peer = record.args[0] if isinstance(record.args, tuple) and record.args else None
        self._log.warning(
            "http_parser_refused",
            "refused a request the HTTP parser could not read (400)",
            extra={"error": type(exc).__name__, "status": getattr(exc, "code", 400), "peer": str(peer)[:64]},
        )
        return False


def install(logger: logging.Logger | None = None) -> ParserErrorFilter:
    """Put the filter on ``aiohttp.server`` (once: a second call returns the one there)."""
    target = logger if logger is not None else logging.getLogger(SERVER_LOGGER)
    for existing in target.filters:
        if isinstance(existing, ParserErrorFilter):
            return existing
    installed = ParserErrorFilter()
    target.addFilter(installed)
    return installed
