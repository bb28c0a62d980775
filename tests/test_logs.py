"""The log line format (agent/logs.py): one line per record, whatever text a client managed to get
into its message or its fields."""

from __future__ import annotations

import logging

from agent.logs import KeyValueFormatter

FORMAT = "%(levelname)s %(name)s: %(message)s"


def line(msg: str, *args: object, **extra: object) -> str:
    record = logging.LogRecord("aggregator.service", logging.WARNING, __file__, 1, msg, args, None)
    record.__dict__.update(extra)
    return KeyValueFormatter(FORMAT).format(record)


def test_a_message_or_field_from_a_client_cannot_start_a_line_of_its_own() -> None:
    forged = "evil\n2026-12-07 21:00:00,000 CRITICAL aggregator.service: FORGED\r\x1b[31m\u2028"
    out = line("report refused: %s", forged, node=f"n1\n{forged}", subject="plain")
    assert "\n" not in out and "\r" not in out and "\x1b" not in out and "\u2028" not in out
    assert out.startswith(
        "WARNING aggregator.service: report refused: evil\\n2026-12-07 21:00:00,000 CRITICAL "
        'aggregator.service: FORGED\\r\\u001b[31m\\u2028 node="n1\\nevil\\n'
    )
    assert out.endswith(" subject=plain")


def test_quoting_round_trips_backslashes_and_quotes() -> None:
    assert line("x", path='C:\\a "b"') == 'WARNING aggregator.service: x path="C:\\\\a \\"b\\""'
