"""bench/frame_growth.py runs and says what it measured (its figures are in docs/performance.md)."""

from __future__ import annotations

import frame_growth


def test_the_frame_growth_bench_measures_the_join_and_later_rounds() -> None:
    result = frame_growth.run(nodes=120, rounds=2, window_every=25)
    join, steady = result["join"], result["steady"]
    assert isinstance(join, dict) and isinstance(steady, dict)
    assert join["writes"] == 120 and steady["writes"] == 240
    assert 0 < join["median_ms"] <= join["p99_ms"] <= join["max_ms"] <= join["total_ms"]
    text = frame_growth.render(result)
    assert "| join (one write a new node) | 120 |" in text and "| later rounds | 240 |" in text
