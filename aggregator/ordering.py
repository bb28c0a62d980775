"""Which reports of a node are new: by ``(boot_id, run, seq)``, never by the node's clock.

An agent numbers its reports with ``seq``, one up per report, from 0 when its process starts;
``run`` (random per process start) says which count a seq belongs to, and ``boot_id`` which boot.
A *stream* is one ``(boot_id, run)``. Per stream the node keeps a high-water mark of seq and the
seqs seen in the ``window`` just below it (bits of one number), so a report delivered out of
order (a retry racing the next report) is still taken once, and one older than the window (a
report captured minutes ago and sent again) is a duplicate: it changes nothing and is not
liveness. The report's ``time`` plays no part: a node whose clock ran a day ahead cannot make
its next boot's reports look old.

Bounded by construction: at most ``streams`` streams a node, each with at most ``window`` seqs;
the least recently used go first, and the hashes of the last ``RETIRED`` streams left behind are
kept (8 bytes each, not the 128 of the key), so a replay of a boot or run already over stays a
duplicate: about 2 KB a node.

Agents older than ``run`` send none. For them a seq far below the mark under the same boot is
either an agent restart or a replay, and only the clock can tell: it is a restart when its time
is later than the stream's latest report, and a report dated before the restarted count began
belongs to the count before. That is the one place time counts, and only for reports without
``run``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Final

import msgspec

from agent.report import Report

__all__ = ["DEFAULT_STREAMS", "DEFAULT_WINDOW", "RETIRED", "SeqTracker"]

DEFAULT_WINDOW: Final = 64
DEFAULT_STREAMS: Final = 4
RETIRED: Final = 64  # streams left behind that stay closed: weeks of reboots and agent restarts

Stream = tuple[str, str]


class _Stream(msgspec.Struct, gc=False):
    """One count's state: numbers only, so neither it nor its seen seqs are objects the cycle
    collector walks (a set of 64 seqs was 64 references visited per node per full collection)."""

    high: int
    latest_time: float
    since: float  # time of the report that began this count (only read without run ids)
    # Seqs in (high - window, high] taken in, as bits: bit k is seq high - k.
    seen: int = 0


class SeqTracker:
    """One node's streams: ``is_new`` answers, ``record`` takes a report in once it is processed."""

    __slots__ = ("_retired", "_streams", "streams", "window")

    def __init__(self, *, window: int = DEFAULT_WINDOW, streams: int = DEFAULT_STREAMS) -> None:
        if window < 1 or streams < 1:
            raise ValueError(f"window and streams must be at least 1, got {window} and {streams}")
        self.window = window
        self.streams = streams
        self._streams: OrderedDict[Stream, _Stream] = OrderedDict()
        # Made when a first stream is left behind: most nodes never leave one, and an empty
        # OrderedDict is one more object a node for the cycle collector to track.
        self._retired: OrderedDict[int, None] | None = None

    @staticmethod
    def stream_of(report: Report) -> Stream:
        run = report.run
        return (report.boot_id, run if isinstance(run, str) else "")

    def _legacy_restart(self, report: Report, st: _Stream) -> bool:
        return not isinstance(report.run, str) and report.time > st.latest_time

    def is_new(self, report: Report) -> bool:
        key = self.stream_of(report)
        st = self._streams.get(key)
        if st is None:
            return self._retired is None or hash(key) not in self._retired
        seq = report.seq
        legacy = not isinstance(report.run, str)
        if legacy and report.time < st.since:
            return False
        if seq > st.high:
            return True
        if seq <= st.high - self.window:
            return self._legacy_restart(report, st)
        return not (st.seen >> (st.high - seq)) & 1

    def record(self, report: Report) -> None:
        """Take ``report`` in (call after ``is_new`` said True and it was processed)."""
        key = self.stream_of(report)
        seq = report.seq
        st = self._streams.get(key)
        if st is None or (seq <= st.high - self.window and self._legacy_restart(report, st)):
            st = self._streams[key] = _Stream(seq, report.time, report.time)
        self._streams.move_to_end(key)
        if seq > st.high:
            # Shifted up to the new mark; bits past the window fall off. A jump past the whole
            # window clears it (shifted, a seq a trillion up would make a trillion-bit number).
            jump = seq - st.high
            st.seen = (st.seen << jump) & ((1 << self.window) - 1) if jump < self.window else 0
            st.high = seq
        if st.high - seq < self.window:
            st.seen |= 1 << (st.high - seq)
        st.latest_time = max(st.latest_time, report.time)
        while len(self._streams) > self.streams:
            old, _ = self._streams.popitem(last=False)
            if self._retired is None:
                self._retired = OrderedDict()
            self._retired[hash(old)] = None
            while len(self._retired) > RETIRED:
                self._retired.popitem(last=False)

    def size(self) -> int:
        """Seqs and stream keys held (for the memory bound's tests)."""
        seqs = sum(s.seen.bit_count() for s in self._streams.values())
        return seqs + len(self._streams) + len(self._retired or ())
