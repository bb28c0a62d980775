"""Shared test fixtures: where the repository and the shared recorded data are."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# shared/ (the contracts and recorded real hardware data) sits beside the repository, in CI too.
SHARED = REPO.parent / "shared"
FIXTURES = REPO / "tests" / "fixtures"


@pytest.fixture
def shared_fixtures() -> Path:
    path = SHARED / "fixtures"
    assert path.is_dir(), f"shared fixtures missing at {path}"
    return path


@pytest.fixture
def repo_root() -> Path:
    return REPO
