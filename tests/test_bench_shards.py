"""bench/shards.py end to end at a small size: real ``gpuwarden aggregator`` processes, one a shard,
agents' first reports sent to the wrong shard and redirected, a hard fault on every shard decided
by its owner alone, and the fleet-wide node list answered across shards."""

from __future__ import annotations

import json
from pathlib import Path


def test_each_shard_decides_its_own_fault_and_the_fleet_view_lists_every_node(tmp_path: Path) -> None:
    import shards  # bench/ is on pytest's pythonpath (pyproject.toml)

    out = tmp_path / "shards.json"
    argv = ["--nodes", "240", "--shards", "3", "--pool-nodes", "40", "--interval", "4"]
    rc = shards.main(
        [*argv, "--paced-rounds", "2", "--connections", "2", "--workers", "1", "--json", str(out)]
    )
    result = json.loads(out.read_text())
    assert rc == 0, result["problems"]
    # Most first reports went to a shard that does not own their pool and were redirected.
    assert result["warmup"]["redirects"] > 0
    assert result["warmup"]["accepted"] == 240
    faults = result["faults"]
    assert sorted(f["owner"] for f in faults) == [0, 1, 2]  # one a shard
    assert all(f["logged_on"] == [f["owner"]] for f in faults)
    assert result["fleet_view"]["nodes"] == 240 and result["fleet_view"]["partial"] is False
    assert result["fleet_view"]["one_node_status"] == 200
    assert sum(s["nodes"] for s in result["shards"]) == 240


def test_the_faulty_nodes_are_one_on_each_shard_that_owns_a_pool() -> None:
    from ingest import pool_of
    from shards import faulty_nodes

    from aggregator.shard.map import owner_of

    picked = faulty_nodes(100_000, 4, 2000)
    assert sorted(owner_of(pool_of(i, 2000), 4) for i in picked) == [0, 1, 2, 3]
