"""What every probe kind shares: the context it runs in, its interface, and assignment checks.

A probe kind is a class with a ``kind`` (one of the report's probe kinds), ``supported()`` (can this
node run it at all: a state, not an error) and ``run(assignment, cancel)``, which always returns a
report ``Probe``: a failure is a result with ``ok=False`` and the reason, never an exception, so the
aggregator hears about a broken link as surely as about a good one.

``cancel`` is set when the probe must stop early (a job started on the GPUs, the agent is shutting
down); ``cancel.reason`` says why and becomes the result's error.

Results whose error starts with ``skipped:`` or ``stepped aside:`` say the node was busy, not that
anything is broken; the aggregator must not count them as evidence against the node or the link.
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from dataclasses import dataclass
from typing import Final, Protocol

from agent.clock import Clock
from agent.errors import GpuwardenError
from agent.probes.protocol import Assignment, ProbeKind, verify
from agent.report import Probe

MAX_ERROR: Final = 1024  # the schema's bound on a probe's error text
# How early an assignment may start, and how far the aggregator's clock may be ahead of ours.
NOT_BEFORE_SLACK_S: Final = 5.0
STEPPED_ASIDE: Final = "stepped aside: a job started"


class ProbeFailure(GpuwardenError):
    """A probe could not measure; the message becomes the result's ``error``."""


@dataclass(frozen=True)
class Support:
    supported: bool
    reason: str = ""


class Cancel:
    """A ``threading.Event`` with a reason: who stopped the probe, and why."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._reason = ""
        self._lock = threading.Lock()

    def set(self, reason: str) -> None:
        with self._lock:
            if not self._event.is_set():
                self._reason = reason
                self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float) -> bool:
        return self._event.wait(max(0.0, timeout))

    @property
    def reason(self) -> str:
        with self._lock:
            return self._reason


class Rendezvous(Protocol):
    """Where the two ends of an NCCL pair probe swap the NCCL unique id (the aggregator, RENDEZVOUS_PATH)."""

    def publish_unique_id(self, assignment_id: str, node: str, unique_id: str) -> None: ...
    def fetch_unique_id(self, assignment_id: str, node: str) -> str | None: ...


class ProbeKindRunner(Protocol):
    @property
    def kind(self) -> ProbeKind: ...

    def supported(self) -> Support: ...

    def run(self, assignment: Assignment, cancel: Cancel, rendezvous: Rendezvous | None) -> Probe: ...

    def child_pids(self) -> Collection[int]:
        """PIDs of processes the running probe started (the idle guard must not mistake them for a job)."""
        ...


def failed(
    kind: ProbeKind, time: float, error: str, *, peer: str | None = None, size: int | None = None
) -> Probe:
    return Probe(kind=kind, time=time, ok=False, peer=peer, size_bytes=size, error=error[:MAX_ERROR])


def passed(
    kind: ProbeKind, time: float, *, peer: str | None, size: int, busbw: float | None, duration: float
) -> Probe:
    """A probe that completed: its bus bandwidth (None where it measures none) and what it took."""
    return Probe(
        kind=kind,
        time=time,
        ok=True,
        peer=peer,
        size_bytes=size,
        busbw_bytes_per_second=busbw,
        duration_seconds=duration,
    )


def mono_deadline(assignment: Assignment, clock: Clock) -> float:
    """The assignment's wall-clock deadline on our monotonic clock (wall time may be stepped)."""
    return clock.monotonic() + (assignment.deadline - clock.time())


def check_assignment(
    assignment: Assignment,
    *,
    key: bytes,
    node: str,
    now: float,
    kind: ProbeKind | None = None,
    role: str | None = None,
) -> str | None:
    """Why this node must refuse the assignment, or None when it is ours to run.

    The signature comes first: nothing an unsigned message says is worth a reason of its own.
    """
    if not verify(assignment, key):
        return "bad signature"
    if assignment.node != node:
        return f"assignment is for node {assignment.node!r}, not {node!r}"
    if kind is not None and assignment.kind != kind:
        return f"assignment kind {assignment.kind!r}, expected {kind!r}"
    if role is not None and assignment.role != role:
        return f"assignment role {assignment.role!r}, expected {role!r}"
    if assignment.deadline <= now:
        return f"deadline passed {now - assignment.deadline:.1f} s ago"
    if assignment.size_bytes <= 0:
        return f"size_bytes {assignment.size_bytes} is not positive"
    return None
