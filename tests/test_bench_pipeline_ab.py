"""bench/pipeline_ab.py runs both sides, each on its own code, and says what it measured."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "pipeline_ab.py"


def test_the_two_sides_import_their_own_checkout(tmp_path: Path) -> None:
    """The other side is a copy of this checkout's code: each run must have imported its own
    (the script refuses to go on otherwise), and both give a CPU figure for the same reports."""
    other = tmp_path / "other"
    for part in ("agent", "aggregator", "rules", "sim"):
        shutil.copytree(REPO / part, other / part, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "ab.json"
    args = ["--against", str(other), "--pairs", "1", "--nodes", "8", "--warmup", "1", "--rounds", "1"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["measured_reports"] == 8
    assert len(result["this_us"]) == len(result["other_us"]) == 1
    assert result["this_us"][0] > 0 and result["other_us"][0] > 0
    assert result["median_ratio"] == pytest.approx(result["this_us"][0] / result["other_us"][0], rel=0.01)
    assert "pair 1: other" in done.stderr and "pair 1: this" in done.stderr


def test_a_folder_that_is_no_checkout_is_refused(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--against", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
        timeout=60,
    )
    assert done.returncode == 2 and "is no gpuwarden checkout" in done.stderr
