"""Decision records (shared/spec section 2) and the append-only JSONL audit log.

One record is written whenever the health state of a node or a link changes. The log is the
audit trail: lines are only ever appended, each is flushed as it is written so a crash loses at
most the line being written, and a half-written last line (power loss) is skipped when read back.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any, Literal

import msgspec

from agent.errors import ConfigError

log = logging.getLogger(__name__)


class Reason(msgspec.Struct, kw_only=True, frozen=True):
    detector: str
    severity: str
    summary: str
    rule: str | None = None
    evidence: dict[str, Any] = msgspec.field(default_factory=dict)


class Decision(msgspec.Struct, kw_only=True, frozen=True):
    time: float
    subject: Literal["node", "link"]
    node: str
    state: str
    previous: str
    action: Literal["taint", "untaint", "none", "held"]
    reasons: list[Reason]
    peer: str | None = None


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(Decision)


def encode_decision(decision: Decision) -> bytes:
    return _ENCODER.encode(decision)


def read_decisions(path: Path) -> Iterator[Decision]:
    """Every complete record in a decision log, in order; a torn last line is skipped."""
    with path.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield _DECODER.decode(line)
            except msgspec.DecodeError:
                if not line.endswith(b"\n"):
                    log.warning("skipping torn last line", extra={"path": str(path), "line": lineno})
                    return
                raise ConfigError(f"{path}:{lineno}: not a decision record") from None


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
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                self._file = path.open("wb" if truncate else "ab")
            except OSError as exc:
                raise ConfigError(f"cannot open decision log {path}: {exc}") from exc

    @property
    def writable(self) -> bool:
        """False while records are waiting because the file could not be written."""
        if self.path is None:
            return True
        return self._file is not None and not self._file.closed and not self._pending

    def append(self, decision: Decision) -> None:
        """Record a decision. A write failure is logged and retried with the next append; it
        never loses the decision or raises into the pipeline (``writable`` says so)."""
        with self._lock:
            self._recent.append(decision)
            if self._file is None:
                return
            self._pending.append(_ENCODER.encode(decision) + b"\n")
            try:
                while self._pending:
                    self._file.write(self._pending[0])
                    self._file.flush()
                    self._pending.pop(0)
            except OSError as exc:
                log.error(
                    "decision log write failed; kept in memory",
                    extra={"path": str(self.path), "error": str(exc), "pending": len(self._pending)},
                )

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
        with self._lock:
            if self._file is not None:
                self._file.close()
