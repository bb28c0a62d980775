"""Replay reads compact traces (agent/wire.py) as it reads JSON Lines: the same decisions from
the same reports, gzip'd or not, a damaged record skipped and a broken stream refused."""

from __future__ import annotations

import gzip
from pathlib import Path

import msgspec
import pytest

from agent import wire
from agent.report import decode
from aggregator.configload import parse_config
from aggregator.replay import TraceError, replay
from aggregator.rules import default_rules_dir, load_rules
from sim.cli import write_trace as write_json_trace
from tests.simfleet import fault, fleet

CONFIG = parse_config(
    "health: {suspect_for_seconds: 30, clear_for_seconds: 30, probation_seconds: 60}\n"
    "silence: {silent_after_seconds: 30}\n",
    "test_wire_replay",
)
RULES = load_rules([default_rules_dir()])
SCENARIO = fleet(
    6,
    duration_s=180.0,
    seed=11,
    jitter_s=2.0,
    faults=(
        fault("xid79", 40.0, node="gpu-0002", gpu=1),
        fault("ib_port_down", 60.0, node="gpu-0004", port=2),
    ),
)


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("wire-replay")
    jsonl = work / "trace.jsonl"
    write_json_trace(SCENARIO, jsonl)
    reports = [decode(line) for line in jsonl.read_bytes().splitlines() if line.strip()]
    compact = work / "trace.msgpack"
    with compact.open("wb") as f:
        assert wire.write_trace(f, reports) == len(reports)
    compact_gz = work / "trace.msgpack.gz"
    compact_gz.write_bytes(gzip.compress(compact.read_bytes(), mtime=0))
    return {"json": jsonl, "compact": compact, "compact.gz": compact_gz}


def decisions_of(trace: Path, out: Path) -> tuple[list[bytes], dict[str, int]]:
    produced, summary = replay(trace, out, CONFIG, RULES)
    assert produced, "the faults should have made decisions"
    counts = {"read": summary.reports_read, "replayed": summary.reports_replayed}
    return [msgspec.json.encode(d) for d in produced], counts


def test_compact_traces_replay_to_the_same_decisions_as_json(traces: dict[str, Path], tmp_path: Path) -> None:
    expected = decisions_of(traces["json"], tmp_path / "json.jsonl")
    for name in ("compact", "compact.gz"):
        assert decisions_of(traces[name], tmp_path / f"{name}.jsonl") == expected, name
    assert (tmp_path / "compact.jsonl").read_bytes() == (tmp_path / "json.jsonl").read_bytes()


def test_a_damaged_record_is_counted_and_skipped(traces: dict[str, Path], tmp_path: Path) -> None:
    records = list(wire.read_frames(traces["compact"].open("rb")))
    middle = len(records) // 2
    damaged = tmp_path / "damaged.msgpack"
    damaged.write_bytes(
        b"".join(
            wire.frame(r)
            for r in [*records[:middle], b"\xc1 not msgpack", records[middle][:-3], *records[middle:]]
        )
    )
    produced, summary = replay(damaged, tmp_path / "out.jsonl", CONFIG, RULES)
    assert summary.reports_read == len(records) + 2
    assert sum(summary.rejected.values()) == 2
    expected, _ = replay(traces["compact"], tmp_path / "clean.jsonl", CONFIG, RULES)
    assert [msgspec.json.encode(d) for d in produced] == [msgspec.json.encode(d) for d in expected]


def test_a_truncated_compact_trace_is_refused_saying_where(traces: dict[str, Path], tmp_path: Path) -> None:
    data = traces["compact"].read_bytes()
    cut = tmp_path / "cut.msgpack"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError, match="inside a record"):
        replay(cut, tmp_path / "out.jsonl", CONFIG, RULES)
