"""bench/trim_lag.py trims the pipeline's heap while the loop ingests, and says what it measured."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import trim_lag

from aggregator.heap import allocator


@pytest.mark.skipif(allocator() != "glibc", reason="the trim is glibc's malloc_trim")
def test_trims_run_while_the_loop_ingests_and_the_lags_are_split_by_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "trim.json"
    args = ["--nodes", "10", "--rounds", "3", "--seconds", "1.2", "--every", "0.3", "--trim", "thread"]
    assert trim_lag.main([*args, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["allocator"] == "glibc" and result["trim"] == "thread"
    assert len(result["trims_ms"]) >= 2 and all(ms >= 0 for ms in result["trims_ms"])
    assert result["reports_ingested"] > 0
    assert result["lag_worst_outside_trim_ms"] is not None
    assert json.loads(capsys.readouterr().out) == result


def test_collections_are_timed_by_generation_when_asked(tmp_path: Path) -> None:
    out = tmp_path / "gc.json"
    args = ["--nodes", "10", "--rounds", "3", "--seconds", "0.5", "--trim", "none", "--collections"]
    thresholds = gc.get_threshold()
    gc.set_threshold(50)  # young collections for sure within half a second (700 may take longer)
    try:
        assert trim_lag.main([*args, "--json", str(out)]) == 0
    finally:
        gc.set_threshold(*thresholds)
    result = json.loads(out.read_text())
    young = result["collections"]["0"]
    assert young["count"] >= 1 and young["worst_ms"] >= young["median_ms"] >= 0
    assert isinstance(result["young_objects_at_slow_gen0"], list)


def test_without_trims_no_lag_is_counted_as_a_trims(tmp_path: Path) -> None:
    out = tmp_path / "none.json"
    assert (
        trim_lag.main(
            ["--nodes", "10", "--rounds", "3", "--seconds", "0.5", "--trim", "none", "--json", str(out)]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert result["trims_ms"] == [] and result["lag_worst_during_trim_ms"] is None


def test_young_collections_can_be_sliced_as_an_experiment(tmp_path: Path) -> None:
    out = tmp_path / "sliced.json"
    args = ["--nodes", "10", "--rounds", "3", "--seconds", "0.6", "--trim", "none", "--collections"]
    assert trim_lag.main([*args, "--young-every", "0.1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["young_every_s"] == 0.1
    # One every 0.1 s, whatever CPython's threshold would have made of so few reports.
    assert result["collections"]["0"]["count"] >= 4
