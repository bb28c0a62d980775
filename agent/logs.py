"""Log lines with their structured fields: ``msg key=value key=value`` (logfmt-like).

Modules log with ``extra={...}``; the standard formatter drops those fields, this one prints them.
"""

from __future__ import annotations

import logging
import re
from typing import Final

_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}


# Control characters (C0, DEL, C1) and Unicode's line and paragraph separators: a value from the
# network that holds one could end the line and forge the next (CWE-117). Written as escapes.
_CONTROL: Final = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED: Final = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_control(text: str) -> str:
    return _CONTROL.sub(lambda m: _NAMED.get(m[0]) or f"\\u{ord(m[0]):04x}", text)


def _quote(value: object) -> str:
    text = str(value)
    if not text or any(c in text for c in ' "=\\') or _CONTROL.search(text):
        return '"' + _escape_control(text.replace("\\", "\\\\").replace('"', '\\"')) + '"'
    return text


class KeyValueFormatter(logging.Formatter):
    """``%(message)s`` and every field on one line: their control characters escaped, so whatever
    text a client sent that ends up in a message (a decoder's error quoting a field name) cannot
    start a line of its own. A traceback (``exc_info``) keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = _escape_control(record.message)
        return super().formatMessage(record)

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
