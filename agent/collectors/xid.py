"""XID and SXID events: NVML's event API first, the kernel log as fallback and for NVSwitches.

Two sources see the same GPU XID: NVML delivers it to a background thread within milliseconds,
and the driver prints it to the kernel log (``NVRM: Xid (PCI:0000:3b:00): 79, ...``). NVSwitch
errors (``SXid``) are only in the kernel log. Each XID is reported once:

* The kernel log is read before NVML is drained, so a line logged just before its NVML event
  is usually waiting when the event arrives; the two become one event with NVML's time and GPU
  and the kernel's text.
* A kernel XID nobody has matched yet is held until at least one later round has drained NVML
  and ``window_seconds`` have passed, then reported alone (NVML misses some, e.g. a GPU that
  fell off the bus). When NVML events are unsupported there is nothing to wait for: kernel XIDs
  go out at once.
* An NVML XID goes out at once and is remembered for as long, so that a kernel line read in a
  later round is recognised as its twin and dropped.

Twins have the same GPU and code, and NVML's time falls inside the span in which the kernel
must have logged the line (between the previous read of the log and the read that found it),
give or take ``window_seconds``. The kernel's own timestamps are not trusted for this: they are
on the printk clock, which NTP does not discipline and which can drift minutes away from the
wall clock over months of uptime. They are used for the reported time, clamped into that span.

At start the kernel log still holds the whole boot's history, which an earlier agent on this
node has already reported. Records from that backlog are reported only when their timestamp is
within ``lookback_seconds`` of now, so an event just before the agent (re)started is not lost,
and a restart re-reports at most that window. After the backlog, every new record counts,
whatever its timestamp says. Only records the kernel wrote count: lines written into /dev/kmsg
from userspace carry a non-kernel facility, which the kernel enforces.
"""

from __future__ import annotations

import logging
import math
import re
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final, Literal

from agent.collectors.base import (
    Collected,
    CollectorContext,
    RawXid,
    Support,
    XidEventSource,
    normalize_pci_bus_id,
)
from agent.kmsg import KernelLogError, KmsgBatch, KmsgReader, read_boot_time
from agent.report import Event

log = logging.getLogger(__name__)

MAX_EVENTS: Final = 1024  # the schema's bound on events per report
MAX_MESSAGE: Final = 2048  # the schema's bound on an event's message
LOOKBACK_SECONDS: Final = 300.0
WINDOW_SECONDS: Final = 5.0

_PCI = r"(?P<pci>(?:PCI:)?[0-9A-Fa-f]+(?::[0-9A-Fa-f]+)+(?:\.[0-7])?)"
# Anchored at the start of the record: "NVRM: Xid" quoted inside another message (a process
# name in an OOM report, a tool's log line) is not an XID. On a GPU in MIG mode the driver names
# the GPU instance, and the compute instance where it knows it, after the bus id
# ("PCI:0000:01:00 GPU-I:05 GPU-CI:02"): the XID is still the GPU's, found by its bus id.
_MIG = r"(?: GPU-I:[0-9A-Fa-f]+(?: GPU-CI:[0-9A-Fa-f]+)?)?"
_XID_RE = re.compile(rf"^NVRM: Xid \({_PCI}{_MIG}\): (?P<code>\d+)(?:,|$)")
_SXID_RE = re.compile(
    rf"^(?P<device>nvidia-nvswitch\d*): SXid \({_PCI}\): (?P<code>\d+), (?P<rest>.*)$", re.DOTALL
)
# An SXid's first line names its severity; the lines that follow with the same code carry raw
# register data for it ("Severity 0 Engine instance ...", "Data {...}").
_SXID_SEVERITY_RE = re.compile(r"(?:non-)?fatal\b", re.IGNORECASE)


@dataclass(frozen=True)
class KernelXid:
    """One XID or SXID line from the kernel log."""

    kind: Literal["xid", "sxid"]
    code: int
    pci_bus_id: str | None  # normalized (see normalize_pci_bus_id); None if unrecognisable
    text: str  # the whole line, bus id included
    device: str = ""  # the NVSwitch ("nvidia-nvswitch3") for an SXid
    detail: str | None = None  # set on an SXid's follow-up line: its text after the code


def parse_kernel_line(message: str) -> KernelXid | None:
    """The XID or SXID in one kernel log message, or None for any other line."""
    m = _XID_RE.match(message)
    if m is not None:
        return KernelXid("xid", int(m.group("code")), normalize_pci_bus_id(m.group("pci")), message)
    m = _SXID_RE.match(message)
    if m is not None:
        rest = m.group("rest")
        return KernelXid(
            "sxid",
            int(m.group("code")),
            normalize_pci_bus_id(m.group("pci")),
            message,
            device=m.group("device"),
            detail=None if _SXID_SEVERITY_RE.match(rest) else rest,
        )
    return None


@dataclass
class _KernelLine:
    xid: KernelXid
    time: float  # best estimate, unix seconds
    lo: float  # the span in which the kernel logged it
    hi: float
    details: list[str] = field(default_factory=list)

    def message(self) -> str:
        return " | ".join([self.xid.text, *self.details])[:MAX_MESSAGE]

    def event(self, gpu: int | None) -> Event:
        return Event(kind=self.xid.kind, time=self.time, gpu=gpu, code=self.xid.code, message=self.message())

    def spans(self, when: float, slack: float) -> bool:
        return self.lo - slack <= when <= self.hi + slack


@dataclass(frozen=True)
class _Held:
    """A kernel XID waiting for its NVML twin."""

    line: _KernelLine
    gpu: int | None
    round: int
    deadline: float  # monotonic


@dataclass(frozen=True)
class _Sent:
    """An NVML XID already reported, waiting to absorb its kernel twin."""

    time: float
    round: int
    deadline: float  # monotonic


# Twins share GPU and code; waiting events are queued under that key, oldest first, so a storm
# of one code pairs up in order instead of every event scanning every other.
_Key = tuple[int | None, int | None]


class XidCollector:
    """Collector "xid": XID events (kind "xid") and NVSwitch SXID events (kind "sxid").

    Owns ``ctx.xid_source``: starts it here when it is supported, closes it in ``close``. A
    source unsupported for now (``Support.transient``: NVML not initialized yet, as when the
    driver is loaded after the agent started) is asked again every cycle until it starts.
    """

    name = "xid"

    def __init__(
        self,
        ctx: CollectorContext,
        *,
        lookback_seconds: float = LOOKBACK_SECONDS,
        window_seconds: float = WINDOW_SECONDS,
        max_events: int = MAX_EVENTS,
        reader: KmsgReader | None = None,
    ) -> None:
        self._ctx = ctx
        self._clock = ctx.clock
        self._lookback = lookback_seconds
        self._window = window_seconds
        self._max_events = max_events
        self._round = 0
        self._held: dict[_Key, deque[_Held]] = {}
        self._sent: dict[_Key, deque[_Sent]] = {}
        self._pending_errors: list[str] = []
        self._caught_up_wall: float | None = None  # wall time the kernel log was last read to its end

        # The backlog is read before NVML starts listening: nothing in it can come from NVML too.
        self._kmsg: KmsgReader | None = reader or KmsgReader(ctx.paths.kmsg)
        self._kmsg_reason = ""
        self._carry: list[_KernelLine] = []
        try:
            self._kmsg.open()
        except KernelLogError as exc:
            self._kmsg_reason = str(exc)
            self._kmsg = None
        else:
            self._carry = self._read_kernel(self._pending_errors)

        self._source: XidEventSource | None = ctx.xid_source
        self._nvml: XidEventSource | None = None
        self._nvml_reason = "no NVML event source"
        self._nvml_retry = False  # the source is not started, but may start later: ask each cycle
        started = self._start_nvml()
        log.info(
            "xid sources",
            extra={
                "kmsg": "ok" if self._kmsg is not None else self._kmsg_reason,
                "nvml_events": "ok" if started else self._nvml_reason,
            },
        )
        if self._kmsg is None and started:
            log.warning(
                "kernel log unreadable: NVSwitch SXid errors will not be reported",
                extra={"reason": self._kmsg_reason},
            )

    def _start_nvml(self) -> bool:
        """Start the NVML event source if it says it can run; sets ``_support``. Whether it runs."""
        source = self._source
        self._nvml_retry = False
        if source is not None:
            support = source.supported()
            if not support.supported:
                self._nvml_reason = support.reason or "unsupported"
                self._nvml_retry = support.transient
            else:
                try:
                    source.start()
                except Exception as exc:  # a broken event thread must leave the kernel log usable
                    self._nvml_reason = f"start failed: {type(exc).__name__}: {exc}"
                else:
                    self._nvml = source
        if self._kmsg is None and self._nvml is None:
            self._support = Support(
                False,
                f"no kernel log ({self._kmsg_reason}) and NVML events unsupported ({self._nvml_reason})",
                transient=self._nvml_retry,
            )
        else:
            self._support = Support(True)
        return self._nvml is not None

    def _retry_nvml(self) -> None:
        """NVML events could not start because NVML was not initialized (a driver loaded after the
        agent started): try again. Cheap to ask every cycle: the shared NVML session, not this
        collector, paces nvmlInit (once a minute while it fails, as for the NVML collector), and
        the events start on the first cycle after it succeeds."""
        if self._nvml is not None or not self._nvml_retry:
            return
        if self._start_nvml():
            log.info("NVML XID events started after NVML came up")

    def supported(self) -> Support:
        # Asked every cycle by the runner before ``collect``, also while unsupported: where NVML
        # events are all this collector has (no kernel log), this is where they get their chance
        # to start; and the one place they are retried.
        self._retry_nvml()
        return self._support

    def collect(self) -> Collected:
        self._round += 1
        now = self._clock.monotonic()
        errors, self._pending_errors = self._pending_errors, []
        ready: list[Event] = []

        # Kernel log first: see the module docstring for why the order matters.
        lines, self._carry = self._carry, []
        if self._kmsg is not None:
            lines.extend(self._read_kernel(errors))
        bus_ids = self._bus_ids(errors) if any(ln.xid.kind == "xid" for ln in lines) else {}
        for line in lines:
            if line.xid.kind == "sxid":
                ready.append(line.event(None))  # an NVSwitch, not a GPU
                continue
            gpu = bus_ids.get(line.xid.pci_bus_id) if line.xid.pci_bus_id else None
            if self._take_sent(line, gpu):
                continue
            if self._nvml is None:
                ready.append(line.event(gpu))
            else:
                hold = _Held(line, gpu, self._round, now + self._window)
                self._held.setdefault((gpu, line.xid.code), deque()).append(hold)

        for raw in self._drain(errors):
            gpu, code, when = _clean(raw, self._clock.time())
            held = self._take_held((gpu, code), when)
            message = held.line.message() if held is not None else raw.message
            ready.append(
                Event(
                    kind="xid",
                    time=when,
                    gpu=gpu,
                    code=code,
                    message=message[:MAX_MESSAGE] if message is not None else None,
                )
            )
            if held is None and self._kmsg is not None:
                sent = _Sent(when, self._round, now + self._window)
                self._sent.setdefault((gpu, code), deque()).append(sent)

        for key, waiting in list(self._held.items()):
            # Queued in round order, so the expired ones are at the front.
            while waiting and self._expired(waiting[0].round, waiting[0].deadline, now):
                h = waiting.popleft()
                ready.append(h.line.event(h.gpu))
            if not waiting:
                del self._held[key]
        for key, recent in list(self._sent.items()):
            while recent and self._expired(recent[0].round, recent[0].deadline, now):
                recent.popleft()
            if not recent:
                del self._sent[key]

        events, dropped = _bound(ready, self._max_events)
        if dropped:
            errors.append(dropped)
        return Collected(events=tuple(events), errors=tuple(errors))

    def close(self) -> None:
        if self._kmsg is not None:
            self._kmsg.close()
        self._nvml = None
        self._nvml_retry = False
        if self._source is not None:
            source, self._source = self._source, None
            source.close()

    def _expired(self, round_: int, deadline: float, now: float) -> bool:
        # Both: a later round must have looked at the other source, and the window must be over
        # (rounds can be much shorter than the window, or much longer).
        return self._round > round_ and now >= deadline

    def _read_kernel(self, errors: list[str]) -> list[_KernelLine]:
        """New XID/SXID lines from the kernel log, with their times and spans."""
        assert self._kmsg is not None
        try:
            batch = self._kmsg.read()
        except KernelLogError as exc:  # reopening after a failed read
            errors.append(f"kernel log: {exc}")
            return []
        read_wall = self._clock.time()
        # Everything logged before the last time the reader reached the end was read then, so a
        # record read now was logged after that moment.
        lo = self._caught_up_wall
        if batch.caught_up:
            self._caught_up_wall = read_wall
        _note_batch(batch, errors)
        parsed = [
            (rec.usec, xid)
            for rec in batch.records
            if rec.from_kernel and (xid := parse_kernel_line(rec.message)) is not None
        ]
        if not parsed:
            return []
        try:
            btime: float | None = read_boot_time(self._ctx.paths.procfs)
        except KernelLogError as exc:
            btime = None
            consequence = (
                f"{len(parsed)} XID/SXID lines from before the agent started not reported (age unknown)"
                if batch.backlog
                else "event times are when the agent read them"
            )
            errors.append(f"kernel log: {exc}; {consequence}")

        out: list[_KernelLine] = []
        open_sxids: dict[tuple[str, str | None, int], _KernelLine] = {}
        for usec, xid in parsed:
            if btime is None:
                if batch.backlog:
                    continue
                when, span_lo, span_hi = read_wall, read_wall, read_wall
            else:
                stamp = btime + usec / 1e6
                if batch.backlog:
                    if stamp < read_wall - self._lookback:
                        continue
                    when = min(stamp, read_wall)
                    span_lo = span_hi = when
                else:
                    span_lo = lo if lo is not None else stamp
                    span_hi = read_wall
                    when = min(max(stamp, span_lo), span_hi)
            key = (xid.device, xid.pci_bus_id, xid.code)
            if xid.detail is not None and (primary := open_sxids.get(key)) is not None:
                primary.details.append(xid.detail)
                continue
            # A follow-up without its first line (read in an earlier round, or a first line in a
            # format not known here) still goes out: counting an SXid twice beats missing it.
            line = _KernelLine(xid, when, span_lo, span_hi)
            if xid.kind == "sxid":
                open_sxids[key] = line
            out.append(line)
        return out

    def _bus_ids(self, errors: list[str]) -> Mapping[str, int]:
        if self._source is None:
            return {}
        try:
            raw = self._source.pci_bus_ids()
        except Exception as exc:  # without the map, XIDs still go out with the bus id in the text
            errors.append(f"PCI bus id to GPU index map unavailable: {type(exc).__name__}: {exc}")
            return {}
        return {normalize_pci_bus_id(k) or k: v for k, v in raw.items()}

    def _drain(self, errors: list[str]) -> list[RawXid]:
        if self._nvml is None:
            return []
        try:
            return self._nvml.drain()
        except Exception as exc:  # the kernel log's events still go out this round
            errors.append(f"NVML XID events: {type(exc).__name__}: {exc}")
            return []

    def _take_held(self, key: _Key, when: float) -> _Held | None:
        waiting = self._held.get(key)
        if not waiting:
            return None
        for i, h in enumerate(waiting):
            if h.line.spans(when, self._window):
                del waiting[i]
                return h
        return None

    def _take_sent(self, line: _KernelLine, gpu: int | None) -> bool:
        recent = self._sent.get((gpu, line.xid.code))
        if not recent:
            return False
        for i, s in enumerate(recent):
            if line.spans(s.time, self._window):
                del recent[i]
                return True
        return False


def _clean(raw: RawXid, now: float) -> tuple[int | None, int | None, float]:
    """NVML's values, made fit for the schema (an index or code below 0, a time that is not finite)."""
    gpu = raw.gpu if raw.gpu is not None and raw.gpu >= 0 else None
    code = raw.code if raw.code >= 0 else None
    when = raw.time if math.isfinite(raw.time) else now
    if gpu != raw.gpu or code != raw.code or when != raw.time:
        log.warning("odd NVML XID event", extra={"gpu": raw.gpu, "code": raw.code, "time": raw.time})
    return gpu, code, when


def _note_batch(batch: KmsgBatch, errors: list[str]) -> None:
    if batch.overwritten:
        errors.append(
            f"kernel log: {batch.overwritten} records were overwritten before they could be read; "
            "XIDs among them are lost"
        )
    if batch.malformed:
        errors.append(f"kernel log: {batch.malformed} malformed records skipped")
    if batch.error is not None:
        errors.append(f"kernel log: {batch.error}; reopened next round")


def _bound(events: list[Event], limit: int) -> tuple[list[Event], str | None]:
    """At most ``limit`` events, in time order; the message for the report if some were dropped.

    A storm is one code repeating (thousands of XID 13 from one bad job); what must survive it is
    anything else, above all a rare critical code arriving in the middle of it. So the first
    event of every (kind, GPU, code) is kept, then the earliest of the rest.
    """
    ordered = sorted(events, key=lambda e: e.time)
    if len(ordered) <= limit:
        return ordered, None
    keep: set[int] = set()
    seen: set[tuple[str, int | None, int | None]] = set()
    for i, e in enumerate(ordered):
        key = (e.kind, e.gpu, e.code)
        if key not in seen and len(keep) < limit:
            seen.add(key)
            keep.add(i)
    for i in range(len(ordered)):
        if len(keep) >= limit:
            break
        keep.add(i)
    dropped = Counter((e.kind, e.gpu, e.code) for i, e in enumerate(ordered) if i not in keep).most_common()
    total = sum(n for _, n in dropped)
    shown = ", ".join(
        f"{kind} {code}" + (f" gpu {gpu}" if gpu is not None else "") + f" x{n}"
        for (kind, gpu, code), n in dropped[:5]
    )
    more = f", {len(dropped) - 5} more kinds" if len(dropped) > 5 else ""
    message = (
        f"{total} events dropped over the bound of {limit} per report "
        f"(the first of each kind, GPU and code kept): {shown}{more}"
    )
    log.warning("xid events dropped", extra={"dropped": total, "limit": limit})
    return [e for i, e in enumerate(ordered) if i in keep], message
