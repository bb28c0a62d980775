"""Which aggregator shard the shipper sends to: the configured URL, until a replica of another
shard redirects the agent to the one that owns its node's pool (aggregator/shard/router.py).

A ``307`` (or ``308``) with a ``Location`` ending in ``/v1/reports`` is the aggregator saying
"your pool is on that shard": the shipper sends the same report there at once and every later
report too, so the detour costs one round trip per change of shard, not one per report. A
network error or a 5xx from the learned shard falls back to the configured URL (any replica
redirects again to whoever owns the pool now: after a change of the number of shards, the
owner may be another one). The report stays in the spool throughout and leaves it only on a
2xx, so a move loses nothing.

Only a redirect to the configured URL's scheme is followed: an ``https`` aggregator never sends
the agent's token over plain HTTP, and the certificate of the new host is checked as the first
one's was. A redirect that points where we already send (a loop) or elsewhere than the reports
endpoint is not followed; the answer then counts as a 3xx: kept, retried with backoff.
"""

from __future__ import annotations

import logging
import threading
import urllib.parse
from dataclasses import dataclass
from typing import Final

log = logging.getLogger(__name__)

REDIRECTS: Final = frozenset({307, 308})
SHARD_HEADER: Final = "X-Gpuwarden-Shard"


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int | None
    path: str


class ShardRoute:
    """One shipper's route. ``learned`` is None while reports go to the configured URL."""

    def __init__(self, scheme: str, reports_path: str) -> None:
        self._scheme = scheme
        self._reports_path = reports_path
        self._lock = threading.Lock()
        self.learned: Endpoint | None = None
        self._moved = False

    def saw(self, status: int, location: str | None, shard: str | None = None) -> None:
        """An answer arrived from where the report was sent: remember a shard's redirect, or
        forget the learned shard when it failed (5xx)."""
        with self._lock:
            if status in REDIRECTS and location:
                target = self._endpoint(location)
                if target is not None and target != self.learned:
                    log.info(
                        "aggregator shard redirect followed",
                        extra={"location": location[:256], "shard": (shard or "")[:16]},
                    )
                    self.learned = target
                    self._moved = True
            elif status >= 500 and self.learned is not None:
                self._fall_back(f"HTTP {status}")

    def failed(self, error: str) -> None:
        """The report could not be sent (connection refused, timeout, reset)."""
        with self._lock:
            if self.learned is not None:
                self._fall_back(error)

    def redirected(self) -> bool:
        """True once after ``saw`` took a new redirect: send the report again, now, to it."""
        with self._lock:
            moved, self._moved = self._moved, False
            return moved

    def _fall_back(self, error: str) -> None:
        log.warning(
            "aggregator shard unreachable, back to the configured URL",
            extra={"host": self.learned.host if self.learned else "", "error": error[:256]},
        )
        self.learned = None
        self._moved = False

    def _endpoint(self, location: str) -> Endpoint | None:
        try:
            parts = urllib.parse.urlsplit(location)
            port = parts.port
        except ValueError:
            return None
        if (
            parts.scheme != self._scheme
            or not parts.hostname
            or parts.username is not None
            or parts.password is not None
            or parts.query
            or parts.fragment
            or not parts.path.endswith(self._reports_path)
        ):
            return None
        return Endpoint(parts.hostname, port, parts.path)
