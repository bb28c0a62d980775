"""Decision records (docs/spec.md section 2) and the append-only JSONL audit log.

One record is written whenever the health state of a node or a link changes. The log is the
audit trail: lines are only ever appended. Durability, from a crash to a power loss:

- ``append`` writes the record to the operating system before it returns, so a process crash
  (kill -9) loses nothing that was appended.
- A background thread fsyncs with GROUP COMMIT: whatever was appended while the previous fsync
  ran is made durable by the next one, so one fsync covers every record of an event-loop turn
  and the cost per decision falls as the rate rises. ``await log.synced(seq)`` (``seq`` from
  ``appended``) returns once those records are on disk; the service answers a report that caused
  decisions only then. A power loss therefore loses at most the records appended since the last
  completed fsync (one fsync latency's worth) and never one whose report was answered 200.
- Opening the live log repairs a torn last line left by a power loss: the fragment is cut off and
  kept in a side file ``<log>.torn-<unix time>`` so the next record starts on a line of its own.
- ``read_decisions`` skips and reports torn lines (``TornLine``): a torn tail, and a fragment glued
  to the record that followed it (what logs written before the repair on open contain); the
  glued record itself is recovered. Anything else that is not a record is an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any, Final, Literal

import msgspec

from agent.errors import ConfigError, GpuwardenError

log = logging.getLogger(__name__)

# The syncer's longest sleep: how soon records a full disk refused are written again (every
# append retries them too) and the most a record can wait for its fsync in a lull.
_SYNCER_WAKE_S: Final = 1.0
# How many bytes of a log's end are read to find its last line on open; a decision record is a
# few hundred bytes, a torn one is shorter than a whole one.
_TAIL_PROBE_BYTES: Final = 1 << 20
# Every record starts with its first field: where a glued record begins inside a torn line.
_RECORD_START: Final = b'{"time":'


class Reason(msgspec.Struct, kw_only=True, frozen=True):
    detector: str
    severity: str
    summary: str
    rule: str | None = None
    evidence: dict[str, Any] = msgspec.field(default_factory=dict)


# The rule of the reason a decision carries when it was made before the cluster view was whole
# after a start: recorded at once with action ``none``; a second record gives the action.
AWAITING_CLUSTER: Final = "awaiting-cluster"


class PodOnNode(msgspec.Struct, kw_only=True, frozen=True):
    """A container that held GPUs on a decision's node, from the node's last GPU-to-pod attribution
    (the agent's report ``pods``, from the kubelet's PodResources API)."""

    namespace: str
    pod: str
    container: str
    gpus: list[int]  # GPU indexes; empty where the device IDs name no GPU the node reports (DRA)
    # The fault hurts it: it holds a GPU a reason names, or no reason names a GPU (a node fault).
    hit: bool


class Decision(msgspec.Struct, kw_only=True, frozen=True):
    time: float
    subject: Literal["node", "link"]
    node: str
    state: str
    previous: str
    action: Literal["taint", "untaint", "none", "held"]
    reasons: list[Reason]
    peer: str | None = None
    # Node decisions to quarantine: the pods it hurts. Absent (not null) where the node's agent
    # has no attribution, so every other record is byte for byte what it was before.
    pods: list[PodOnNode] | msgspec.UnsetType = msgspec.UNSET


class TornLine(msgspec.Struct, frozen=True):
    """Bytes of a decision log that are the remains of an interrupted write, not a record."""

    line: int  # 1-based line number in the log
    fragment: bytes
    glued: bool  # a whole record followed the fragment on the same line (and was read)


class DecisionLogClosed(GpuwardenError):
    """The log was closed before the records waited for reached the disk."""


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(Decision)


def encode_decision(decision: Decision) -> bytes:
    return _ENCODER.encode(decision)


def _decode(data: bytes) -> Decision | None:
    try:
        return _DECODER.decode(data)
    except msgspec.DecodeError:
        return None


def _unglue(line: bytes) -> tuple[bytes, Decision] | None:
    """(fragment, record) if ``line`` is a torn write with a whole record appended after it."""
    start = line.rfind(_RECORD_START)
    while start > 0:
        record = _decode(line[start:])
        if record is not None:
            return line[:start], record
        start = line.rfind(_RECORD_START, 0, start)
    return None


def read_decisions(path: Path, *, torn: list[TornLine] | None = None) -> Iterator[Decision]:
    """Every record in a decision log, in order. Torn lines (a torn tail, a fragment glued to
    the next record) are skipped, logged and, given ``torn``, appended to it; a line that is no
    record at all is a ``ConfigError`` naming it."""

    def skipped(entry: TornLine) -> None:
        log.warning(
            "skipping a torn line of the decision log",
            extra={"path": str(path), "line": entry.line, "bytes": len(entry.fragment), "glued": entry.glued},
        )
        if torn is not None:
            torn.append(entry)

    with path.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = _decode(line)
            if record is not None:
                yield record
                continue
            if not line.endswith(b"\n"):
                skipped(TornLine(lineno, line, glued=False))
                return
            unglued = _unglue(line)
            if unglued is None:
                raise ConfigError(f"{path}:{lineno}: not a decision record")
            skipped(TornLine(lineno, unglued[0], glued=True))
            yield unglued[1]


def _repair_tail(path: Path) -> None:
    """Cut a torn last line off the live log (kept in a side file) so appends start clean."""
    try:
        f = path.open("r+b")
    except FileNotFoundError:
        return
    with f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return
        probe = min(size, _TAIL_PROBE_BYTES)
        f.seek(size - probe)
        tail = f.read(probe)
        body = tail[:-1] if tail.endswith(b"\n") else tail
        cut = body.rfind(b"\n") + 1  # start of the last line within ``tail``
        if cut == 0 and probe < size:
            raise ConfigError(f"{path}: the last line is over {_TAIL_PROBE_BYTES} bytes: not a decision log")
        last = tail[cut:]
        if not last.strip() or _decode(last) is not None:
            if last.strip() and not last.endswith(b"\n"):
                # The record is whole, only its newline was lost: complete it, keep it.
                f.write(b"\n")
                f.flush()
                os.fsync(f.fileno())
            return
        side = path.with_name(f"{path.name}.torn-{int(time.time())}")
        side.write_bytes(last)
        f.truncate(size - len(last))
        f.flush()
        os.fsync(f.fileno())
    log.warning(
        "cut a torn last line off the decision log",
        extra={"path": str(path), "bytes": len(last), "kept_in": str(side), "offset": size - len(last)},
    )


class DecisionLog:
    """Appends decisions to a JSONL file (or nowhere) and keeps the recent ones for the API."""

    def __init__(self, path: Path | None, *, keep: int = 10_000, truncate: bool = False) -> None:
        """``truncate``: start the file empty (replay's output); the live log only ever appends."""
        self.path = path
        self._recent: deque[Decision] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self._file: IO[bytes] | None = None
        # Records that could not be written (disk full, I/O error): kept in order and written
        # before the next one, so the log stays complete and ordered once the disk recovers.
        self._pending: list[bytes] = []
        # Sequence numbers: records appended, written to the OS, and fsync'd (counts since open).
        self._appended = 0
        self._written = 0
        self._synced = 0
        self._closed = False
        self._wake = threading.Condition(self._lock)
        self._waiters: list[tuple[int, asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._syncer: threading.Thread | None = None
        self._kick_scheduled = False
        self.fsyncs = 0  # how many fsyncs ran: the group commit's batching is appended / fsyncs
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                if not truncate:
                    _repair_tail(path)
                self._file = path.open("wb" if truncate else "ab")
            except OSError as exc:
                raise ConfigError(f"cannot open decision log {path}: {exc}") from exc

    @property
    def writable(self) -> bool:
        """False while records are waiting because the file could not be written."""
        if self.path is None:
            return True
        return self._file is not None and not self._file.closed and not self._pending

    @property
    def appended(self) -> int:
        """The sequence number of the last record appended (0: none yet); see ``synced``."""
        return self._appended

    @property
    def durable_seq(self) -> int:
        """The sequence number up to which every record is on disk."""
        return self._synced if self._file is not None else self._appended

    def append(self, decision: Decision) -> None:
        """Record a decision. A write failure is logged and retried with the next append; it
        never loses the decision or raises into the pipeline (``writable`` says so)."""
        with self._lock:
            self._recent.append(decision)
            self._appended += 1
            if self._file is None:
                return
            self._pending.append(_ENCODER.encode(decision) + b"\n")
            self._write_pending()
            if self._syncer is None:
                self._syncer = threading.Thread(
                    target=self._sync_loop, name="decision-log-fsync", daemon=True
                )
                self._syncer.start()
            self._kick_syncer()

    def _kick_syncer(self) -> None:
        """Under the lock: have the syncer fsync what was written. On an event loop that waits for
        the end of the loop's turn, so every record appended in that turn shares one fsync."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._wake.notify()
            return
        if not self._kick_scheduled:
            self._kick_scheduled = True
            loop.call_soon(self._kicked)

    def _kicked(self) -> None:
        with self._lock:
            self._kick_scheduled = False
            self._wake.notify()

    def _write_pending(self) -> None:
        """Under the lock: write what is pending, in order, as far as the disk lets us."""
        assert self._file is not None
        try:
            while self._pending:
                self._file.write(self._pending[0])
                self._file.flush()
                self._pending.pop(0)
                self._written += 1
        except OSError as exc:
            log.error(
                "decision log write failed; kept in memory",
                extra={"path": str(self.path), "error": str(exc), "pending": len(self._pending)},
            )

    def _sync_loop(self) -> None:
        """The group commit: one fsync covers everything written since the previous one."""
        assert self._file is not None
        fd = self._file.fileno()
        while True:
            with self._lock:
                while not self._closed and self._written == self._synced:
                    # Also wakes by itself: to write what a full disk refused, and to sync records
                    # whose kick never came (their event loop stopped first).
                    self._wake.wait(_SYNCER_WAKE_S)
                    if self._pending:
                        self._write_pending()
                if self._closed and self._written == self._synced:
                    return
                target = self._written
            try:
                os.fsync(fd)  # outside the lock: appends go on while the disk works
            except OSError as exc:
                log.error("decision log fsync failed", extra={"path": str(self.path), "error": str(exc)})
                with self._lock:
                    if self._closed:
                        return
                    self._wake.wait(_SYNCER_WAKE_S)
                continue
            with self._lock:
                self.fsyncs += 1
                self._synced = target
                self._release(target, None)

    def _release(self, upto: int | None, error: BaseException | None) -> None:
        """Under the lock: wake the waiters for records up to ``upto`` (None: all), with ``error``."""
        keep = []
        for seq, loop, fut in self._waiters:
            if upto is not None and seq > upto:
                keep.append((seq, loop, fut))
                continue
            with contextlib.suppress(RuntimeError):  # its event loop is closed: nobody waits
                loop.call_soon_threadsafe(_settle, fut, error)
        self._waiters = keep

    async def synced(self, seq: int | None = None) -> None:
        """Return once every record up to ``seq`` (default: all appended so far) is on disk.
        Raises ``DecisionLogClosed`` if the log is closed first with them still unsynced."""
        with self._lock:
            seq = self._appended if seq is None else seq
            if self._file is None or seq <= self._synced:
                return
            if self._closed:
                raise DecisionLogClosed(f"decision log {self.path} closed before record {seq} was synced")
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[None] = loop.create_future()
            self._waiters.append((seq, loop, fut))
        await fut

    def extend(self, decisions: Iterable[Decision]) -> None:
        for d in decisions:
            self.append(d)

    def since(self, since: float, limit: int = 1000) -> list[Decision]:
        with self._lock:
            return [d for d in self._recent if d.time >= since][:limit]

    def recent(self) -> list[Decision]:
        with self._lock:
            return list(self._recent)

    def close(self) -> None:
        """Sync what was written and close; waiters for records still pending are failed."""
        with self._lock:
            if self._file is None or self._closed:
                return
            if self._pending:
                self._write_pending()  # the disk may have room again: the last chance to keep them
            self._closed = True
            self._wake.notify()
            syncer = self._syncer
        if syncer is not None:
            syncer.join()
        with self._lock:
            self._release(
                None,
                DecisionLogClosed(
                    f"decision log {self.path} closed with {len(self._pending)} records unwritten"
                ),
            )
            self._file.close()


def _settle(fut: asyncio.Future[None], error: BaseException | None) -> None:
    if fut.done():  # the waiter was cancelled (its client went away)
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)
