"""When a node's report was measured, on the aggregator's clock: the time its pool frame slot is.

A report carries its own ``time`` (the node's clock) and is received at the aggregator's.
Neither alone is right for the frames, which compare a pool's nodes at the same moments:

- The node's clock may be off (minutes, or hours on a node whose NTP never ran), and a node far
  ahead would move its pool's newest slot forward and clear everyone's data.
- The receive time is late whenever the aggregator is: a shard that falls behind, or a restart
  that meets a queue of reports, takes each report a minute or two after it was measured, by
  more for each report than the one before. Slotted by receipt, a node's values land in the
  slot of another moment (two reports in one slot, none in the next), and a node that changed
  jobs is compared with peers from another minute: the peer detector made healthy nodes suspect
  that way in a backlogged 4-shard run (docs/performance.md).

So a report's slot time is its own time plus the node's clock offset, ``received - time``,
taken as the least seen over the last ``MEMORY_SECONDS`` to ``2 * MEMORY_SECONDS``: the least
is the offset plus the shortest delivery, which a backlog only adds to (NTP's minimum filter, in
two blocks so it needs three numbers). The result is never after the receipt. A report that this
would place more than ``MEMORY_SECONDS`` before its receipt (an agent's spool flushed after a
long outage, or a clock stepped back, which one report cannot tell apart) is slotted at its
receipt; once the old deliveries have left the filter, a stepped clock's reports are placed by
its new offset.

Replay passes a clock-corrected report time as the receipt, so the offset is constant and the slot
time is exactly what it passed; a report later than its reorder buffer holds (a flushed spool) is
received at the replay's clock, as live, and slotted here like a live one.
"""

from __future__ import annotations

import math
from typing import Final

import msgspec

__all__ = ["MEMORY_SECONDS", "ON_TIME_SECONDS", "SendTime"]

# How long the least delay is remembered (from this to twice this): a backlog shorter than that
# leaves the slots right; a clock stepped back is followed again after it.
MEMORY_SECONDS: Final = 300.0
# A report delivered within this of the node's fastest is on time: its receipt is its slot time,
# exactly (time + offset would differ from it in the last bits of a float, and replay, which
# passes corrected report times as receipts, must slot each report where it always did).
ON_TIME_SECONDS: Final = 1e-3


class SendTime(msgspec.Struct, gc=False):
    """One node's clock offset estimate (numbers only, so the cycle collector never tracks it)."""

    current: float = math.inf  # least received - time in the block that started at ``since``
    previous: float = math.inf  # least in the block before
    since: float = -math.inf

    def place(self, time: float, received: float) -> float:
        """The aggregator-clock time the report sent at ``time`` (node clock) and received at
        ``received`` was measured: its frame slot time. Call once per new report, in receipt order."""
        delay = received - time
        if received - self.since >= MEMORY_SECONDS:
            self.previous, self.current, self.since = self.current, delay, received
        elif delay < self.current:
            self.current = delay
        offset = min(self.current, self.previous)
        if delay - offset > MEMORY_SECONDS or delay - offset <= ON_TIME_SECONDS:
            return received  # too late to trust the estimate, or on time
        return time + offset
