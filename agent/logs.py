"""Log lines with their structured fields: ``msg key=value key=value`` (logfmt-like).

Modules log with ``extra={...}``; the standard formatter drops those fields, this one prints them.
"""

from __future__ import annotations

import logging

_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}


def _quote(value: object) -> str:
    text = str(value)
    if not text or any(c in text for c in ' "=\n'):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        fields = [f"{k}={_quote(v)}" for k, v in record.__dict__.items() if k not in _STANDARD]
        return f"{base} {' '.join(fields)}" if fields else base


def configure(level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(KeyValueFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
