"""Log lines on per-request paths, at most one per kind every few seconds, with a count of the rest.

Anything a sender can trigger once per request (a refusal, a report over a cap, a new boot dated
in the past) must not let it write the log at its request rate: 96,480 warning lines in five
minutes bury what matters and cost the disk. ``RateLimitedLog.warning(kind, ...)`` logs the first
of a kind, then at most one every ``every_s`` seconds, each saying how many went unlogged since;
``counts`` has every occurrence of every kind. Kinds are a small fixed vocabulary chosen by the
code (never a node name or anything from the request), so the state is bounded by the code.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Final

__all__ = ["DEFAULT_EVERY_S", "RateLimitedLog"]

DEFAULT_EVERY_S: Final = 10.0


class RateLimitedLog:
    def __init__(
        self,
        logger: logging.Logger,
        *,
        every_s: float = DEFAULT_EVERY_S,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self._every = every_s
        self._monotonic = monotonic
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._counts: dict[str, int] = {}

    @property
    def counts(self) -> Mapping[str, int]:
        """Occurrences of every kind so far, logged or not."""
        return self._counts

    def warning(
        self,
        kind: str,
        message: str,
        *args: object,
        extra: Mapping[str, object] | None = None,
        exc_info: bool = False,
    ) -> bool:
        """Log ``message % args`` unless a line of ``kind`` went out less than ``every_s`` ago;
        True when it was logged."""
        self._counts[kind] = self._counts.get(kind, 0) + 1
        now = self._monotonic()
        last = self._last.get(kind)
        if last is not None and 0 <= now - last < self._every:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return False
        self._last[kind] = now
        suppressed = self._suppressed.pop(kind, 0)
        self._log.warning(
            message,
            *args,
            extra={"kind": kind, "suppressed_since_last": suppressed, **(extra or {})},
            exc_info=exc_info,
        )
        return True
