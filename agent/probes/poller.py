"""The agent's probe loop: fetch assignments, check them, run them one at a time, keep the results.

One poll thread per aggregator replica asks ``GET /v1/probes/assignments`` every
``AssignmentList.poll_seconds`` (only the leader answers with assignments; the others answer an
empty list, and a replica that is down delays nobody else). Every assignment is checked before it is
queued: the signature under the probe key, ``node`` is this node, the deadline has not passed, the
kind is one this agent knows. Anything else is refused with a log line and never run.

One executor thread runs the queue in ``not_before`` order, so this node runs one probe at a time.
At its start time a probe is skipped if its kind is not supported here (logged once per kind, never
reported: a node without NCCL is not a failing node), or reported ``ok=false`` with an error
starting ``skipped:`` when the GPUs are busy or the deadline passed while it waited. While it runs
the idle guard watches (about once a second) and cancels it if a job starts: ``stepped aside: a
job started``. The server half of a ``tcp_pair`` needs no run here: ``TcpProbeServer`` serves it
when the client connects, and its result lands in the same ``ProbeResults``.

``ProbeResults`` holds results until the next report takes them: at most 256 per report (the
schema's bound), the oldest dropped first and counted, so a long outage cannot grow memory.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from agent.clock import Clock
from agent.probes.base import STEPPED_ASIDE, Cancel, ProbeFailure, ProbeKindRunner, check_assignment, failed
from agent.probes.client import AggregatorClient
from agent.probes.idle import IdleGuard
from agent.probes.protocol import Assignment
from agent.probes.tcp import TcpProbeServer
from agent.report import Probe

log = logging.getLogger(__name__)

MAX_PROBES_PER_REPORT: Final = 256
MAX_PENDING: Final = 1024
DEFAULT_POLL_S: Final = 30.0
MIN_POLL_S: Final = 1.0
MAX_POLL_S: Final = 600.0
_SEEN_MAX: Final = 4096


class ProbeResults:
    """Finished probes waiting for a report. Thread-safe; bounded."""

    def __init__(self, max_pending: int = MAX_PENDING) -> None:
        self._items: deque[Probe] = deque()
        self._max = max_pending
        self._dropped = 0
        self._lock = threading.Lock()

    def add(self, probe: Probe) -> None:
        with self._lock:
            self._items.append(probe)
            while len(self._items) > self._max:
                self._items.popleft()
                self._dropped += 1

    def drain(self, limit: int = MAX_PROBES_PER_REPORT) -> tuple[list[Probe], int]:
        """Up to ``limit`` results, newest kept, and how many older ones were dropped since last time."""
        with self._lock:
            items = list(self._items)
            self._items.clear()
            dropped = self._dropped + max(0, len(items) - limit)
            self._dropped = 0
        return items[-limit:] if items else [], dropped

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


@dataclass(order=True)
class _Queued:
    not_before: float
    seq: int
    assignment: Assignment = field(compare=False)
    source: AggregatorClient | None = field(compare=False)


class ProbePoller:
    def __init__(
        self,
        *,
        node: str,
        key: bytes,
        clock: Clock,
        runners: Sequence[ProbeKindRunner],
        guard: IdleGuard,
        results: ProbeResults,
        clients: Sequence[AggregatorClient] = (),
        advertise: str | None = None,
        server: TcpProbeServer | None = None,
        watch_interval_s: float = 1.0,
    ) -> None:
        self.node = node
        self._key = key
        self._clock = clock
        self._runners = {r.kind: r for r in runners}
        self._guard = guard
        self.results = results
        self._clients = list(clients)
        self._advertise = advertise
        self._server = server
        self._watch_interval = watch_interval_s
        self._cond = threading.Condition()
        self._queue: list[_Queued] = []
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._seq = itertools.count()
        self._stop = threading.Event()
        self._current: Cancel | None = None
        self._threads: list[threading.Thread] = []
        self._unsupported_logged: set[str] = set()

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        if self._server is not None:
            self._server.start()
        for client in self._clients:
            t = threading.Thread(
                target=self._poll_loop, args=(client,), name="gpuwarden-probe-poll", daemon=True
            )
            self._threads.append(t)
        self._threads.append(threading.Thread(target=self._run_loop, name="gpuwarden-probe-run", daemon=True))
        for t in self._threads:
            t.start()
        log.info(
            "probes on",
            extra={
                "kinds": sorted(self._runners),
                "aggregators": [c.url for c in self._clients],
                "advertise": self._advertise,
            },
        )

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            if self._current is not None:
                self._current.set("agent stopping")
            self._cond.notify_all()
        for t in self._threads:
            t.join(5.0)
        if self._server is not None:
            self._server.close()

    # -- assignments ------------------------------------------------------------------------------

    def offer(self, assignment: Assignment, source: AggregatorClient | None = None) -> str | None:
        """Check an assignment and queue it; returns why it was refused (and logs it), or None."""
        reason = check_assignment(assignment, key=self._key, node=self.node, now=self._clock.time())
        if reason is None and assignment.kind not in self._runners:
            reason = f"unknown probe kind {assignment.kind!r}"
        if reason is not None:
            log.warning(
                "probe assignment refused",
                extra={
                    "assignment": assignment.id,
                    "kind": assignment.kind,
                    "for_node": assignment.node,
                    "reason": reason,
                },
            )
            return reason
        with self._cond:
            if assignment.id in self._seen:
                return None  # polled again before it ran, or from a second replica: once is enough
            self._seen[assignment.id] = None
            while len(self._seen) > _SEEN_MAX:
                self._seen.popitem(last=False)
            if assignment.kind == "tcp_pair" and assignment.role == "server":
                return None  # served by TcpProbeServer when the client connects
            heapq.heappush(self._queue, _Queued(assignment.not_before, next(self._seq), assignment, source))
            self._cond.notify_all()
        return None

    def poll_once(self, client: AggregatorClient) -> float:
        """Fetch and offer this replica's assignments; returns the seconds until the next poll."""
        answer = client.assignments(self.node, self._advertise)
        if answer.node != self.node:
            raise ProbeFailure(f"aggregator answered for node {answer.node!r}")
        for assignment in answer.assignments:
            self.offer(assignment, client)
        return min(max(answer.poll_seconds, MIN_POLL_S), MAX_POLL_S)

    def _poll_loop(self, client: AggregatorClient) -> None:
        failing = False
        while not self._stop.is_set():
            try:
                interval = self.poll_once(client)
                if failing:
                    log.info("probe assignments reachable again", extra={"aggregator": client.url})
                failing = False
            except Exception as exc:  # the poll thread must outlive any aggregator answer
                interval = DEFAULT_POLL_S
                if not failing:
                    log.warning(
                        "cannot fetch probe assignments", extra={"aggregator": client.url, "error": str(exc)}
                    )
                failing = True
            self._stop.wait(interval)

    # -- running ----------------------------------------------------------------------------------

    def _run_loop(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                if not self._queue:
                    self._cond.wait(1.0)
                    continue
                wait = self._queue[0].not_before - self._clock.time()
                if wait > 0:
                    self._cond.wait(min(wait, 1.0))
                    continue
                item = heapq.heappop(self._queue)
            try:
                self.run_now(item.assignment, item.source)
            except Exception:
                log.exception("probe crashed", extra={"assignment": item.assignment.id})

    def pending(self) -> int:
        with self._cond:
            return len(self._queue)

    def run_due(self) -> int:
        """Run every queued assignment whose start time has come, now, in order (tests, ``--once``)."""
        ran = 0
        while True:
            with self._cond:
                if not self._queue or self._queue[0].not_before > self._clock.time():
                    return ran
                item = heapq.heappop(self._queue)
            self.run_now(item.assignment, item.source)
            ran += 1

    def run_now(self, assignment: Assignment, source: AggregatorClient | None = None) -> Probe | None:
        """Run one checked assignment here and now; its result (if any) goes to ``results``."""
        runner = self._runners[assignment.kind]
        support = runner.supported()
        if not support.supported:
            if assignment.kind not in self._unsupported_logged:
                self._unsupported_logged.add(assignment.kind)
                log.info(
                    "probe kind not supported here", extra={"kind": assignment.kind, "reason": support.reason}
                )
            return None
        now = self._clock.time()
        if assignment.deadline <= now:
            probe = failed(
                assignment.kind, now, "skipped: deadline passed before it could start", peer=assignment.peer
            )
            self.results.add(probe)
            return probe
        busy = self._guard.busy()
        if busy is not None:
            probe = failed(assignment.kind, now, f"skipped: GPUs busy: {busy}", peer=assignment.peer)
            self.results.add(probe)
            return probe
        cancel = Cancel()
        with self._cond:
            self._current = cancel
        try:
            with self._guard.watch(cancel, interval_s=self._watch_interval, exclude=runner.child_pids):
                probe = runner.run(assignment, cancel, source)
        finally:
            with self._cond:
                self._current = None
        if cancel.reason == STEPPED_ASIDE:
            # A job that starts mid-probe shares the GPUs and links: whatever was measured is not the node's.
            probe = failed(
                assignment.kind, probe.time, STEPPED_ASIDE, peer=assignment.peer, size=assignment.size_bytes
            )
        log.info(
            "probe finished",
            extra={
                "assignment": assignment.id,
                "kind": assignment.kind,
                "peer": assignment.peer,
                "ok": probe.ok,
                "busbw_bytes_per_second": probe.busbw_bytes_per_second,
                "error": probe.error,
            },
        )
        self.results.add(probe)
        return probe
