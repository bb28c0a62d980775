"""The operator audit log: what humans did to the aggregator (breaker resets, overrides seen).

Decisions (docs/spec.md section 2) record what the aggregator decided; this log records what
people did about it, one JSON object per line, appended and flushed like the decision log:
``{"time": ..., "action": "breaker_reset", "by": "alice", "detail": {...}}``.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import IO, Any

import msgspec

from agent.errors import ConfigError

log = logging.getLogger(__name__)


class AuditRecord(msgspec.Struct, kw_only=True, frozen=True):
    time: float
    action: str  # breaker_reset | breaker_open | taint_removed_by_hand | ...
    by: str  # a person, or "gpuwarden" for what the aggregator noticed
    detail: dict[str, Any] = msgspec.field(default_factory=dict)


_ENC = msgspec.json.Encoder()


class AuditLog:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._file: IO[bytes] | None = None
        self.recent: list[AuditRecord] = []
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                self._file = path.open("ab")
            except OSError as exc:
                raise ConfigError(f"cannot open audit log {path}: {exc}") from exc

    def append(self, record: AuditRecord) -> None:
        with self._lock:
            self.recent = [*self.recent[-999:], record]
            log.warning("audit", extra={"action": record.action, "by": record.by, "detail": record.detail})
            if self._file is None:
                return
            try:
                self._file.write(_ENC.encode(record) + b"\n")
                self._file.flush()
            except OSError as exc:
                log.error("audit log write failed", extra={"path": str(self.path), "error": str(exc)})

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
