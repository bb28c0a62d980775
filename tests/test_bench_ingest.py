"""bench/ingest.py's reading of the server's collection histogram over a phase."""

from __future__ import annotations

import ingest


def test_collections_are_summed_up_per_generation_from_bucket_differences() -> None:
    # Cumulative bucket counts, as a phase's difference of two scrapes leaves them.
    young = {"0.001": 90.0, "0.01": 98.0, "0.025": 100.0, "0.05": 100.0, "1.0": 100.0, "+Inf": 100.0}
    full = {"0.001": 0.0, "0.01": 0.0, "0.025": 0.0, "0.05": 1.0, "0.25": 3.0, "1.0": 3.0, "+Inf": 3.0}
    none = {"0.001": 0.0, "0.05": 0.0, "+Inf": 0.0}
    summary = ingest.collections_summary({"2": full, "0": young, "1": none})
    assert list(summary) == ["0", "1", "2"]
    assert summary["0"] == {"count": 100.0, "over_10_ms": 2.0, "over_50_ms": 0.0, "slowest_le_ms": 25.0}
    assert summary["2"] == {"count": 3.0, "over_10_ms": 3.0, "over_50_ms": 2.0, "slowest_le_ms": 250.0}
    assert summary["1"] == {"count": 0.0, "over_10_ms": 0.0, "over_50_ms": 0.0, "slowest_le_ms": None}
