"""Shared test fixtures: where the repository and its recorded data are."""

from __future__ import annotations

from pathlib import Path

import pytest

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
