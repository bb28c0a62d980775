"""bench/slope.py's own logic: both wire formats decode to the same report, and a size that would
not fit in memory is skipped with its reason rather than run out of memory."""

from __future__ import annotations

import argparse

import pytest


def test_both_wire_formats_decode_to_the_same_report() -> None:
    from _reports import NodeSim  # bench/ is on pytest's pythonpath (pyproject.toml)
    from ingest import decode_body

    from agent.shipper import encode_body
    from agent.wire import as_v1

    report = NodeSim(3).report(1_800_000_000.0, 0)
    limit = 64 * 2**20
    compact = decode_body(encode_body(report, compact=True), limit)
    json = decode_body(encode_body(report), limit)
    assert as_v1(compact) == json == report  # compact rows are their own struct types


def test_a_size_that_would_not_fit_is_skipped_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    import slope

    monkeypatch.setattr(slope, "mem_available_mb", lambda: 4096.0)
    args = argparse.Namespace(
        pool_nodes=2000, warmup_rounds=3, reports=6000, paced_cap=400.0, paced_seconds=60.0, seed=1
    )
    res = slope.run_size(100_000, args, None, server_core=0, load_core=1, kb_per_node=200.0)  # type: ignore[arg-type]
    assert res.skipped is not None and "GB available" in res.skipped
    assert res.per_core is None
    table = slope.render({"cpu": "x", "nproc": 2, "python": "3.11", "mem_total_gb": 4.0}, args, [res])
    assert "| 100,000 | 50 | skipped: needs about" in table
