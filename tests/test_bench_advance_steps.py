"""bench/advance_steps.py runs and says what each detector costs while the service runs (its
figures are in docs/performance.md and docs/sharding.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import advance_steps
import pytest

BENCH = Path(advance_steps.__file__)


def test_steady_shares_add_a_detectors_steps_over_its_period() -> None:
    steps = {
        "peer pool a (10 nodes): compute (worker thread)": [0.3, 0.1],  # mean 0.2 s
        "peer pool a (10 nodes): prepare, and the previous step's finish": [0.01, 0.01],
        "peer pool b (10 nodes): compute (worker thread)": [0.2, 0.2],
        "link": [0.06, 0.06],
        "silence": [0.5, 0.5],  # not a detector: the tick's own step
    }
    shares = advance_steps.steady_shares(steps, {"peer": 60.0, "link": 60.0, "forest": 300.0})
    assert list(shares) == ["peer", "link"]  # the costliest first; a detector that never ran is absent
    assert shares["peer"]["cpu_s_per_cycle"] == pytest.approx(0.41)
    assert shares["peer"]["share"] == pytest.approx(0.41 / 60.0)
    assert shares["link"]["share"] == pytest.approx(0.001)


def test_the_bench_fills_the_frames_and_gives_each_detectors_share(tmp_path: Path) -> None:
    out = tmp_path / "steps.json"
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--nodes",
            "24",
            "--pool-nodes",
            "12",
            "--interval",
            "60",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    result = json.loads(out.read_text())
    assert result["interval_s"] == 60.0
    assert result["rounds"] == 32  # 30 slots at 60 s (the 1,800 s history window) and two more
    # The pool detectors run at most once an interval; the others at their own period.
    periods = {name: d["every_s"] for name, d in result["steady"].items()}
    assert periods["peer"] == periods["trend"] == 60.0 and periods["forest"] == 300.0
    assert all(d["share"] >= 0 for d in result["steady"].values())
    assert "| peer |" in done.stdout and "of a core per 1,000 nodes" in done.stdout
