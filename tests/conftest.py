"""Shared test fixtures: where the repository and its recorded data are."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

from agent.logs import KeyValueFormatter

REPO = Path(__file__).resolve().parents[1]


def ci() -> bool:
    """The run requires the tools scripts/setup installs, and compares rather than rewrites: CI,
    and scripts/test (which sets CI=true unless it is set)."""
    return os.environ.get("CI", "").lower() in ("true", "1")


def missing_tool(name: str, package: str) -> NoReturn:
    """A test's outside tool is not installed: it fails where the run requires the tools
    (``ci()``), and skips elsewhere."""
    if ci():
        pytest.fail(f"{name} is not installed, and this run requires it (scripts/setup installs {package})")
    pytest.skip(f"{name} is not installed (apt-get install {package})")


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


@pytest.fixture
def warning_state_untouched(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """For code that runs in the service's worker thread (an ``Offload``'s compute): it must neither
    enter ``warnings.catch_warnings`` (which swaps process-wide state and is not thread-safe: a
    compute doing it can leave the event loop's filters wrong) nor leave a RuntimeWarning that would
    need one (numpy's all-NaN-lane warnings: ``aggregator.detect.nanstats`` avoids them)."""
    real = warnings.catch_warnings
    callers: list[str] = []

    def recorded(*args: Any, **kwargs: Any) -> warnings.catch_warnings[Any]:
        # pytest enters it around every test phase, and scikit-learn inside every forest fit and
        # predict (sklearn.utils.parallel, .validation: not ours to change, and harmless while
        # nothing on the loop changes the filters after startup): only our own packages count.
        callers.append(str(sys._getframe(1).f_globals.get("__name__", "")))
        return real(*args, **kwargs)

    with real(), monkeypatch.context() as patch:
        warnings.simplefilter("error", RuntimeWarning)
        patch.setattr(warnings, "catch_warnings", recorded)
        yield
    ours = [c for c in callers if c.split(".")[0] in ("aggregator", "agent", "gpuwarden", "sim")]
    assert not ours, f"warnings.catch_warnings entered by {sorted(set(ours))}: not thread-safe"
