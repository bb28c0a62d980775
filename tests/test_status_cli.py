"""``gpuwarden status`` and ``gpuwarden explain`` against a running aggregator (the status fleet of
tests/statusfleet.py served on 127.0.0.1), and ``gpuwarden --version``."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest

from gpuwarden.cli import main
from gpuwarden.status import colour_on
from tests.statusfleet import QUARANTINED, SILENT_RACK, Served, serving, status_fleet


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serving(status_fleet()) as s:
        yield s


def test_status_prints_the_fleet_summary(served: Served, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--aggregator", served.base]) == 0
    out = capsys.readouterr().out
    assert "32 nodes" in out and "1 quarantined" in out and "8 silent" in out
    assert f"systemic: rack {SILENT_RACK}" in out
    assert "\x1b[" not in out  # not a terminal: no colour


def test_explain_says_why_what_next_and_the_runbook(
    served: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["explain", QUARANTINED, "--aggregator", served.base]) == 0
    out = capsys.readouterr().out
    assert f"{QUARANTINED}: quarantined since 20" in out
    assert "XID 79" in out and "fell off the bus" in out
    assert "next  probation starts once the evidence has been gone" in out
    assert "by hand  removing the gpuwarden.io/unhealthy taint by hand is an override" in out
    assert "runbook  http" in out


def test_explain_of_an_unknown_node_is_an_error(served: Served, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "no-such-node", "--aggregator", served.base]) == 2
    assert "HTTP 404" in capsys.readouterr().err


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_colour_only_on_a_terminal_and_never_with_no_color() -> None:
    assert colour_on(_Tty(), {"TERM": "xterm-256color"})
    assert not colour_on(_Tty(), {"TERM": "xterm", "NO_COLOR": ""})
    assert not colour_on(_Tty(), {"TERM": "dumb"})
    assert not colour_on(io.StringIO(), {"TERM": "xterm"})


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("gpuwarden ")
