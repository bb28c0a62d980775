"""bench/healthy.py's bookkeeping over several sittings: what --resume keeps, runs and writes."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest


@pytest.fixture
def healthy(monkeypatch: pytest.MonkeyPatch) -> tuple[ModuleType, list[Any]]:
    import healthy as module  # bench/healthy.py: bench/ is on pytest's pythonpath (pyproject.toml)

    ran: list[Any] = []

    def run(
        chunks: Sequence[Any],
        workers: int,
        max_s: float = math.inf,
        on_result: Callable[[dict[str, Any]], None] | None = None,
    ) -> list[dict[str, Any]]:
        # The chunks in order, without generating or replaying anything; a chunk's outcome as
        # run_chunk returns it.
        out = []
        for c in chunks:
            ran.append(c)
            r = {
                "generator": c.generator,
                "seed": c.seed,
                "nodes": c.nodes,
                "hours": c.hours,
                "node_hours": c.nodes * c.hours,
                "reports": 10,
                "cpu_generate_s": 0.1,
                "cpu_replay_s": 0.1,
                "wall_s": 0.2,
                "quarantines": [],
                "links_degraded": 0,
                "flagged": {},
            }
            out.append(r)
            if on_result is not None:
                on_result(r)
        return out

    monkeypatch.setattr(module, "run", run)
    return module, ran


def test_resume_keeps_what_is_done_and_runs_only_the_rest(
    tmp_path: Path, healthy: tuple[ModuleType, list[Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    module, ran = healthy
    out = tmp_path / "healthy.json"
    args = ["--node-hours", "256", "--nodes", "32", "--chunk-hours", "2", "--json", str(out)]
    assert module.main(args) == 0
    first = json.loads(out.read_text())
    assert len(first["chunks"]) == len(ran) == 4  # 256 node-hours in chunks of 64, both generators
    assert all(c["commit"] for c in first["chunks"])

    # A larger total, resumed: the four done are kept, not run again; the file holds all eight.
    capsys.readouterr()
    ran.clear()
    assert module.main(["--node-hours", "512", *args[2:], "--resume"]) == 0
    assert len(ran) == 4
    assert {(c.generator, c.seed) for c in ran}.isdisjoint(
        (c["generator"], c["seed"]) for c in first["chunks"]
    )
    second = json.loads(out.read_text())
    assert len(second["chunks"]) == 8
    assert second["chunks"][:4] == first["chunks"]
    assert len(second["commands"]) == 2 and second["command"] == first["command"]
    # The table says every sitting's command, and covers every chunk kept or run.
    table = capsys.readouterr().out
    assert "--node-hours 256" in table.splitlines()[0] and "--node-hours 512" in table.splitlines()[0]
    assert "| sim | 4 x 32 nodes x 2 h | 256 |" in table

    # Chunks of another size are other runs: none is kept.
    ran.clear()
    assert module.main(["--node-hours", "512", "--nodes", "16", *args[4:], "--resume"]) == 0
    assert len(ran) == 16
    assert len(json.loads(out.read_text())["chunks"]) == 16


def test_resume_without_a_file_to_keep_is_refused(healthy: tuple[ModuleType, list[Any]]) -> None:
    module, _ = healthy
    with pytest.raises(SystemExit):
        module.main(["--resume"])
