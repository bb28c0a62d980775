"""A node's recent report summaries, as the API's node page shows them (``"history"``).

One summary per report, the newest ``keep`` of them, turned into its dict only when the API asks.
A node keeps them for as long as it reports, so how they are held is memory a node: a dict per
summary cost about 800 bytes and two objects the garbage collector walks, a tuple about 270
bytes (16 KB a node for 60). Here the numbers of every summary are packed in one ``bytearray``
(72 bytes a summary, not an object the collector walks) and only the two references that are not
numbers, the boot id (one string per boot, shared by its summaries) and the collector errors
(the shared empty tuple on nearly every report), sit in the object itself, a list: about 5 KB a
node for 60, and one object the collector tracks, as before.
"""

from __future__ import annotations

import math
import struct
import time as _time
from collections.abc import Iterator
from typing import Any, Final

from msgspec import UnsetType

from agent.report import Report

# The summary's keys, in the order the API shows them; "received_at" is derived from "received".
KEYS: Final = (
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
# A summary's numbers, packed: its floats (temp_max_c NaN for None), then its unsigned 64-bit ints.
_NUMBERS: Final = ("time", "received", "temp_max_c", "power_w", "seq", "gpus", "nics", "events", "ecc_dbe")
_PACKED: Final = struct.Struct("<4d5Q")
_REFS: Final = ("boot_id", "errors")  # held in the list itself
_U64_MAX: Final = 2**64 - 1
if sorted(_NUMBERS + _REFS) != sorted(KEYS) or len(_NUMBERS) != len(_PACKED.unpack(bytes(_PACKED.size))):
    raise TypeError("every summary key is held in exactly one column")


class RecentReports(list[Any]):
    """The newest ``keep`` summaries of one node's reports, oldest first.

    The list holds each summary's boot id and errors in turn, ``_numbers`` its numbers packed
    (``_PACKED``) in the same order: a ``bytearray``, which the collector does not track (an
    ``array`` it does)."""

    __slots__ = ("_keep", "_numbers")

    def __init__(self, keep: int) -> None:
        super().__init__()
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self._keep = keep
        self._numbers = bytearray()

    def __len__(self) -> int:
        return list.__len__(self) // len(_REFS)

    def add(self, report: Report, received: float) -> None:
        gpus = report.gpus
        boot_id = report.boot_id
        if list.__len__(self) and self[-len(_REFS)] == boot_id:
            boot_id = self[-len(_REFS)]  # one string per boot, not one per report
        # The status page's sparklines: the hottest GPU, the node's power, its uncorrectable errors.
        temps = [g.temperature_celsius or 0.0 for g in gpus]
        # A sum of 64-bit counters passes 2**64 only for a sender that lies: shown as the most the
        # column holds rather than refused (each counter was valid).
        ecc = min(sum(g.ecc_dbe_volatile_total or 0 for g in gpus), _U64_MAX)
        self.extend(
            (boot_id, () if isinstance(report.errors, UnsetType) else tuple(e.message for e in report.errors))
        )
        self._numbers += _PACKED.pack(
            report.time,
            received,
            max(temps) if temps else math.nan,
            sum(g.power_watts or 0.0 for g in gpus),
            report.seq,
            len(gpus),
            len(report.nics),
            0 if isinstance(report.events, UnsetType) else len(report.events),
            ecc,
        )
        if len(self) > self._keep:
            del self[: len(_REFS)]
            del self._numbers[: _PACKED.size]

    def __iter__(self) -> Iterator[Any]:
        raise TypeError("iterate over RecentReports.dicts()")

    def dicts(self) -> list[dict[str, Any]]:
        """Every summary as the API shows it, oldest first: new dicts and lists each call."""
        out: list[dict[str, Any]] = []
        refs = list.__iter__(self)
        for numbers in _PACKED.iter_unpack(self._numbers):
            s: dict[str, Any] = dict(zip(_NUMBERS, numbers, strict=True))
            s.update(zip(_REFS, (next(refs) for _ in _REFS), strict=True))
            if math.isnan(s["temp_max_c"]):
                s["temp_max_c"] = None
            row = {k: s[k] for k in KEYS}
            row["errors"] = list(s["errors"])
            row["received_at"] = _time.strftime("%Y-%m-%dT%H:%M:%SZ", _time.gmtime(s["received"]))
            out.append(row)
        return out
