"""A node's recent report summaries, as the API's node page shows them (``"history"``).

One summary per report, the newest ``keep`` of them. Each is kept as a tuple of plain values and
turned into its dict only when the API asks: a dict per summary cost about 800 bytes and two
objects the garbage collector walks (the dict and its ``errors`` list) for every one of a node's
60 summaries, 48 KB a node; a tuple of numbers and shared strings costs about 250 bytes and is
not tracked by the collector at all (CPython untracks a tuple that holds no container).
"""

from __future__ import annotations

import time as _time
from collections import deque
from typing import Any, Final

from msgspec import UnsetType

from agent.report import Report

# The summary's keys, in tuple order; "received_at" is derived from "received" when read.
_KEYS: Final = (
    "time",
    "received",
    "seq",
    "boot_id",
    "gpus",
    "nics",
    "events",
    "errors",
    "temp_max_c",
    "power_w",
    "ecc_dbe",
)
_RECEIVED: Final = _KEYS.index("received")
_BOOT: Final = _KEYS.index("boot_id")
_ERRORS: Final = _KEYS.index("errors")

Summary = tuple[Any, ...]


def summary(report: Report, received: float, boot_id: str | None = None) -> Summary:
    """The summary of one report; ``boot_id``, when equal to the report's, is stored instead
    (the previous summary's string: one copy per boot rather than per report)."""
    return (
        report.time,
        received,
        report.seq,
        boot_id if boot_id == report.boot_id else report.boot_id,
        len(report.gpus),
        len(report.nics),
        0 if isinstance(report.events, UnsetType) else len(report.events),
        () if isinstance(report.errors, UnsetType) else tuple(e.message for e in report.errors),
        # The status page's sparklines: the hottest GPU, the node's power, its uncorrectable errors.
        max((g.temperature_celsius or 0.0 for g in report.gpus), default=None),
        sum(g.power_watts or 0.0 for g in report.gpus),
        sum(g.ecc_dbe_volatile_total or 0 for g in report.gpus),
    )


def as_dict(s: Summary) -> dict[str, Any]:
    """The summary as the API shows it."""
    out = dict(zip(_KEYS, s, strict=True))
    out["errors"] = list(s[_ERRORS])
    out["received_at"] = _time.strftime("%Y-%m-%dT%H:%M:%SZ", _time.gmtime(s[_RECEIVED]))
    return out


class RecentReports(deque[Summary]):
    """The newest ``keep`` summaries of one node's reports, oldest first.

    The ring itself rather than a holder of one: a node keeps one object here for the cycle
    collector to track, not two."""

    __slots__ = ()

    def __init__(self, keep: int) -> None:
        super().__init__(maxlen=keep)

    def add(self, report: Report, received: float) -> None:
        self.append(summary(report, received, self[-1][_BOOT] if self else None))

    def dicts(self) -> list[dict[str, Any]]:
        return [as_dict(s) for s in self]
