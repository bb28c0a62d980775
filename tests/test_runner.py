"""The agent's cycle: a collector that keeps failing is in every report, and in the log once."""

from __future__ import annotations

import logging

import pytest

from agent.clock import FakeClock
from agent.collectors.base import Collected, Support
from agent.errors import CollectorFailure
from agent.runner import Agent


class Flaky:
    name = "flaky"

    def __init__(self) -> None:
        self.failure: str | None = "no such device"

    def supported(self) -> Support:
        return Support(True)

    def collect(self) -> Collected:
        if self.failure is not None:
            raise CollectorFailure(self.failure)
        return Collected()

    def close(self) -> None:
        pass


def _failed(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [str(getattr(r, "error", "")) for r in caplog.records if r.getMessage() == "collector failed"]


def test_a_repeated_failure_is_logged_once_and_reported_every_cycle(caplog: pytest.LogCaptureFixture) -> None:
    flaky = Flaky()
    agent = Agent(node="node-a", collectors=[flaky], clock=FakeClock(), boot_id="b")
    caplog.set_level(logging.INFO, logger="agent.runner")

    reports = [agent.cycle().report for _ in range(3)]
    assert [[e.message for e in r.errors or ()] for r in reports] == [
        ["CollectorFailure: no such device"]
    ] * 3
    assert _failed(caplog) == ["CollectorFailure: no such device"]

    flaky.failure = "permission denied"  # a different failure is news
    agent.cycle()
    agent.cycle()
    assert _failed(caplog)[1:] == ["CollectorFailure: permission denied"]

    flaky.failure = None
    assert not agent.cycle().report.errors
    assert [r.getMessage() for r in caplog.records][-1] == "collector recovered"
    flaky.failure = "permission denied"  # failing again after recovering is news again
    agent.cycle()
    assert len(_failed(caplog)) == 3
