"""bench/memory.py runs at any report interval and fills the history window by default (its
figures are in docs/performance.md and docs/sharding.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import memory

BENCH = Path(memory.__file__)


def test_at_a_60_s_interval_the_default_rounds_fill_the_history_window(tmp_path: Path) -> None:
    out = tmp_path / "memory.json"
    done = subprocess.run(
        [sys.executable, str(BENCH), "--nodes", "6", "--interval", "60", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    figures = json.loads(out.read_text())
    assert figures["interval_s"] == 60.0
    assert figures["rounds"] == 35  # 1,800 s of history at 60 s, and 5 more
    assert figures["after_rounds"]["35"]["rss_kb_per_node"] is not None
    assert "rounds 60 s apart" in done.stdout
