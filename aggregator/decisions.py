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
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                self._file = path.open("wb" if truncate else "ab")
            except OSError as exc:
                raise ConfigError(f"cannot open decision log {path}: {exc}") from exc

    @property
    def writable(self) -> bool:
        return self.path is None or (self._file is not None and not self._file.closed)

    def append(self, decision: Decision) -> None:
        with self._lock:
            self._recent.append(decision)
            if self._file is not None:
                self._file.write(_ENCODER.encode(decision) + b"\n")
                self._file.flush()

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
