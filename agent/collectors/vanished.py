"""Devices that were there and are gone: named in the report's errors, every cycle, by name.

A port that reports DOWN is a finding in seconds; one whose device vanished from sysfs (a card
that fell off the bus, a driver that unbound it) would otherwise just be absent from the report,
and absence says nothing. ``Vanished`` remembers what a collector has reported in this agent
process and, each cycle, names what is missing as a ``vanished: ...`` error, for as long as it
stays missing (the ``*-vanished`` rules in rules/ turn that into a finding). Bounded: at most
``limit`` names are remembered (the schema's 256 NICs a report).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

__all__ = ["PREFIX", "Vanished"]

PREFIX: Final = "vanished: "


class Vanished:
    def __init__(self, what: str, *, limit: int = 256) -> None:
        self._what = what
        self._limit = limit
        self._seen: dict[tuple[str, int | None], None] = {}

    def check(self, present: Iterable[tuple[str, int | None]]) -> list[str]:
        """The errors for what was seen before and is not in ``present``; learns what is new."""
        now = dict.fromkeys(present)
        for key in now:
            if key not in self._seen and len(self._seen) < self._limit:
                self._seen[key] = None
        return [
            f"{PREFIX}{self._what} {device}{'' if port is None else f' port {port}'} was present "
            "earlier in this agent's run and is gone"
            for device, port in self._seen
            if (device, port) not in now
        ]
