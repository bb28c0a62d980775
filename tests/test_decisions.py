"""The decision log is append-only JSONL in the docs/spec.md format, robust to a torn last line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.errors import ConfigError
from aggregator.decisions import Decision, DecisionLog, Reason, read_decisions


def _d(t: float, state: str = "quarantined") -> Decision:
    return Decision(
        time=t,
        subject="node",
        node="gpu-0042",
        state=state,
        previous="healthy",
        action="taint",
        reasons=[
            Reason(
                detector="rule",
                rule="xid-79",
                severity="critical",
                summary="GPU 3 fell off the bus (XID 79)",
                evidence={"gpu": 3, "xid": 79},
            )
        ],
    )


def test_records_match_the_spec_example_and_append(tmp_path: Path) -> None:
    path = tmp_path / "decisions.jsonl"
    log = DecisionLog(path)
    log.append(_d(1764441630.0))
    log.close()
    log = DecisionLog(path)  # reopening appends, never truncates
    log.append(_d(1764441640.0, "probation"))
    log.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    rec = json.loads(lines[0])
    assert rec == {
        "time": 1764441630.0,
        "subject": "node",
        "node": "gpu-0042",
        "peer": None,
        "state": "quarantined",
        "previous": "healthy",
        "action": "taint",
        "reasons": [
            {
                "detector": "rule",
                "rule": "xid-79",
                "severity": "critical",
                "summary": "GPU 3 fell off the bus (XID 79)",
                "evidence": {"gpu": 3, "xid": 79},
            }
        ],
    }
    assert [d.state for d in read_decisions(path)] == ["quarantined", "probation"]


def test_torn_last_line_is_skipped_but_corruption_inside_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    log = DecisionLog(path)
    log.append(_d(1.0))
    log.close()
    with path.open("ab") as f:
        f.write(b'{"time": 2.0, "subj')
    assert [d.time for d in read_decisions(path)] == [1.0]
    path.write_text("garbage\n" + path.read_text())
    with pytest.raises(ConfigError, match=":1: not a decision record"):
        list(read_decisions(path))


def test_since_and_limit() -> None:
    log = DecisionLog(None)
    for t in range(10):
        log.append(_d(float(t)))
    assert [d.time for d in log.since(5.0, limit=3)] == [5.0, 6.0, 7.0]


def test_replay_output_starts_empty_but_the_live_log_appends(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    for _ in range(2):
        log = DecisionLog(path)
        log.append(_d(1.0))
        log.close()
    assert len(path.read_text().splitlines()) == 2
    log = DecisionLog(path, truncate=True)
    log.append(_d(2.0))
    log.close()
    assert [d.time for d in read_decisions(path)] == [2.0]
