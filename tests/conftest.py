"""Shared test fixtures: where the repository and its recorded data are."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.logs import KeyValueFormatter

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
# Trees recorded from real machines (tests/fixtures/sysfs/recorded/README.md: sources, licence).
# Everything the tests read lives inside the repository, so a fresh clone passes on its own.
RECORDED_SYSFS = FIXTURES / "sysfs" / "recorded"


@pytest.fixture
def recorded_sysfs() -> Path:
    return RECORDED_SYSFS


@pytest.fixture
def repo_root() -> Path:
    return REPO


@pytest.fixture(autouse=True)
def _logging_left_as_found() -> Iterator[None]:
    """A test that runs a command in-process (``gpuwarden ... main()``) has its logging set up:
    a handler on the root logger writing to that test's captured stderr, closed when the test
    ends. Left there, every later log line from any thread (a shipper still retrying in another
    test) fails with "I/O operation on closed file". Such handlers go when the test does."""
    root = logging.getLogger()
    before, level = set(root.handlers), root.level
    yield
    for handler in root.handlers[:]:
        if handler not in before and isinstance(handler.formatter, KeyValueFormatter):
            root.removeHandler(handler)
    root.setLevel(level)
