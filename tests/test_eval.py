"""The evaluator: every metric on hand-built truth and decisions, and the static baseline on a trace."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agent.errors import ConfigError
from sim import scenario as scenario_mod
from sim.cli import write_trace
from sim.eval import baseline, evaluate, load_decisions, markdown, score
from sim.truth import load as load_truth
from tests.conftest import REPO

T0 = 1_764_000_000.0


def _f(i: int, kind: str, cls: str, node: str, at: tuple[float, float | None], **kw: Any) -> dict[str, Any]:
    return {
        "id": i,
        "kind": kind,
        "class": cls,
        "node": node,
        "start": T0 + at[0],
        "first_seen": None if at[1] is None else T0 + at[1],
        "end": None,
        **kw,
    }


TRUTH = {
    "version": 1,
    "seed": 1,
    "start": T0,
    "end": T0 + 3600,
    "nodes": [f"gpu-{i:04d}" for i in range(12)],
    "faults": [
        _f(0, "xid79", "hard", "gpu-0001", (100, 110)),
        _f(1, "dbe", "hard", "gpu-0002", (200, 230)),
        _f(2, "slow_gpu", "soft", "gpu-0003", (300, 400)),
        _f(3, "thermal", "soft", "gpu-0004", (300, 350)),
        _f(4, "degraded_link", "link", "gpu-0005", (100, 700), peer="gpu-0006"),
        _f(5, "degraded_link", "link", "gpu-0007", (100, 900), peer="gpu-0008"),
        _f(6, "silent_rack", "silent", "gpu-0009", (1000, 1000), rack="rack-002"),
        _f(7, "silent_rack", "silent", "gpu-0010", (1000, 1000), rack="rack-002"),
        _f(8, "app_xid", "lookalike", "gpu-0011", (500, 510)),
    ],
}


def _d(t: float, node: str, state: str, *, peer: str | None = None, detector: str = "rule") -> dict[str, Any]:
    return {
        "time": T0 + t,
        "subject": "link" if peer else "node",
        "node": node,
        "peer": peer,
        "state": state,
        "previous": "healthy",
        "action": "none",
        "reasons": [{"detector": detector}],
    }


DECISIONS = [
    _d(50, "gpu-0001", "quarantined"),  # before its fault: false, before_fault
    _d(140, "gpu-0001", "quarantined"),  # caught, 30 s after first seen
    _d(240, "gpu-0002", "suspect"),  # not a quarantine: not caught by this
    _d(460, "gpu-0003", "quarantined"),  # caught, 60 s
    _d(760, "gpu-0006", "degraded", peer="gpu-0005"),  # either order; link caught, 60 s
    _d(950, "gpu-0007", "degraded", peer="gpu-0008"),  # caught, 50 s
    _d(960, "gpu-0007", "quarantined"),  # an end blamed: attribution fails for link 5
    _d(1030, "gpu-0009", "suspect", detector="silence"),  # silent caught, 30 s
    _d(1100, "gpu-0010", "quarantined", detector="silence"),  # caught, and a false quarantine
    _d(600, "gpu-0011", "quarantined"),  # look-alike quarantined
    _d(700, "gpu-0000", "quarantined"),  # a node with nothing
    _d(800, "gpu-0000", "degraded", peer="gpu-0011"),  # a link that was fine
]


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    truth = tmp_path / "truth.json"
    truth.write_text(json.dumps(TRUTH))
    decisions = tmp_path / "decisions.jsonl"
    decisions.write_text("".join(json.dumps(d) + "\n" for d in DECISIONS))
    return truth, decisions


def test_every_metric_on_hand_built_files(files: tuple[Path, Path]) -> None:
    truth, decisions = files
    r = score(load_truth(truth), load_decisions(decisions))
    c = r["classes"]
    assert (c["hard"]["faults"], c["hard"]["caught"], c["hard"]["recall"]) == (2, 1, 0.5)
    assert c["hard"]["time_to_detect"] == {"median_s": 30.0, "p90_s": 30.0, "max_s": 30.0}
    assert (c["soft"]["caught"], c["soft"]["recall"]) == (1, 0.5)
    assert c["soft"]["time_to_detect"]["median_s"] == 60.0
    assert (c["link"]["caught"], c["link"]["recall"]) == (2, 1.0)
    assert c["link"]["time_to_detect"] == {"median_s": 55.0, "p90_s": 60.0, "max_s": 60.0}
    assert (c["silent"]["caught"], c["silent"]["time_to_detect"]["max_s"]) == (2, 100.0)
    q = r["quarantines"]
    assert (q["total"], q["true"], q["false"]) == (7, 2, 5)
    assert q["precision"] == pytest.approx(2 / 7)
    assert q["false_by_cause"] == {
        "no_fault": 1,
        "lookalike": 1,
        "silent_rack": 1,
        "link_end": 1,
        "before_fault": 1,
    }
    assert r["links"] == {
        "degraded": 3,
        "true": 2,
        "precision": pytest.approx(2 / 3),
        "attributed": 1,
        "faults": 2,
    }


def test_markdown_and_json_output(files: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    truth, decisions = files
    results = evaluate(truth, decisions, None)
    table = markdown(results)
    assert "| recall hard | 1/2 (50%), TTD median 30 s, p90 30 s |" in table
    assert "| false: lookalike | 1 |" in table
    assert "| link attribution (link, no end blamed) | 1/2 |" in table
    # The evaluator's own CLI entry, called as gpuwarden's dispatcher calls it.
    import argparse

    from gpuwarden.cli import SUBCOMMANDS
    from sim import eval as eval_mod

    p = argparse.ArgumentParser()
    eval_mod.add_arguments(p)
    args = p.parse_args([str(truth), str(decisions), "--json"])
    assert eval_mod.run(args) == 0
    assert isinstance(SUBCOMMANDS, dict)


def test_bad_inputs_name_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "d.jsonl"
    bad.write_text(json.dumps(_d(1, "gpu-0001", "quarantined")) + "\n{not json\n")
    with pytest.raises(ConfigError, match=r"d.jsonl:2: not valid JSON"):
        load_decisions(bad)
    bad.write_text(json.dumps({"time": 1.0, "subject": "link", "node": "a", "state": "degraded"}) + "\n")
    with pytest.raises(ConfigError, match="needs a peer"):
        load_decisions(bad)
    truth = tmp_path / "t.json"
    truth.write_text(json.dumps({"faults": [{"kind": "x", "class": "weird", "node": "a", "start": 1}]}))
    with pytest.raises(ConfigError, match="class: expected one of"):
        load_truth(truth)


def test_baseline_catches_hard_faults_only(tmp_path: Path) -> None:
    s = scenario_mod.parse(
        {
            "seed": 5,
            "minutes": 20,
            "interval_s": 30,
            "pools": [{"name": "h100", "profile": "h100-sxm-80gb", "nodes": 8}],
            "delivery": {"lost_fraction": 0, "duplicate_fraction": 0},
            "faults": [
                {"kind": "xid79", "node": "gpu-0001", "gpu": 0, "at_s": 300},
                {"kind": "ib_port_down", "node": "gpu-0002", "port": 1, "at_s": 400},
                {"kind": "slow_gpu", "node": "gpu-0003", "gpu": 1, "at_s": 0},
                {"kind": "app_xid", "node": "gpu-0004", "gpu": 1, "at_s": 100, "code": 31},
                {"kind": "power_brake", "node": "gpu-0005", "at_s": 100},
            ],
        }
    )
    trace = tmp_path / "t.jsonl"
    _, truth = write_trace(s, trace)
    decisions = baseline(trace)
    assert sorted((d.node, next(iter(d.detectors))) for d in decisions) == [
        ("gpu-0001", "baseline:xid-79"),
        ("gpu-0002", "baseline:ib-port-down"),
    ]
    r = score(truth, decisions)
    assert r["classes"]["hard"]["recall"] == 1.0 and r["classes"]["soft"]["recall"] == 0.0
    assert r["quarantines"]["precision"] == 1.0
    # A GPU at 85 C trips the temperature rule: the soft thermal fault stays below it on purpose.
    line = trace.read_text().splitlines()[0]
    hot = json.loads(line)
    hot["gpus"][0]["temperature_celsius"] = 85.0
    trace.write_text(json.dumps(hot) + "\n")
    assert [next(iter(d.detectors)) for d in baseline(trace)] == ["baseline:temperature"]


def test_a_node_whose_clock_runs_a_little_behind_is_caught_from_its_first_showing_report(
    tmp_path: Path,
) -> None:
    # gpu-0001's clock is 6 s behind, too little for replay to correct: the report that shows its
    # XID 79 reads 4 s before the fault's true start, and so does the quarantine made on it. It is
    # the fault's quarantine, not a false one; one made before that report is still false.
    truth = {**TRUTH, "faults": [_f(0, "xid79", "hard", "gpu-0001", (100, 96))]}
    (tmp_path / "truth.json").write_text(json.dumps(truth))
    for decisions, caught, false in (
        ([_d(96, "gpu-0001", "quarantined")], 1, 0),
        ([_d(90, "gpu-0001", "quarantined")], 0, 1),
    ):
        (tmp_path / "d.jsonl").write_text("".join(json.dumps(d) + "\n" for d in decisions))
        r = score(load_truth(tmp_path / "truth.json"), load_decisions(tmp_path / "d.jsonl"))
        assert (r["classes"]["hard"]["caught"], r["quarantines"]["false"]) == (caught, false)
        if caught:
            assert r["classes"]["hard"]["time_to_detect"]["median_s"] == 0.0


# -- inputs that do not belong together ---------------------------------------------------------


SMALL = {
    "minutes": 20,
    "interval_s": 30,
    "pools": [{"name": "h100", "profile": "h100-sxm-80gb", "nodes": 8}],
    "faults": [
        {"kind": "xid79", "node": "gpu-0001", "gpu": 0, "at_s": 300},
        {"kind": "ib_port_down", "node": "gpu-0002", "port": 1, "at_s": 400},
        {"kind": "dbe", "node": "gpu-0003", "gpu": 2, "at_s": 500},
    ],
}


def _simulated(tmp_path: Path, name: str, seed: int) -> tuple[Path, Path, Path]:
    """A trace, its truth, and (as the decision log) what the baseline decides on it."""
    trace = tmp_path / f"{name}.jsonl"
    _, truth = write_trace(scenario_mod.parse({**SMALL, "seed": seed}), trace)
    truth_path = tmp_path / f"{name}.truth.json"
    truth_path.write_text(json.dumps(truth.to_json()))
    decisions = tmp_path / f"{name}.decisions.jsonl"
    decisions.write_text(
        "".join(json.dumps(_d(d.time - T0, d.node, d.state)) + "\n" for d in baseline(trace))
    )
    return trace, truth_path, decisions


def _eval_cli(*args: Path | str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuwarden", "eval", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )


def test_inputs_of_one_trace_are_scored(tmp_path: Path) -> None:
    trace, truth, decisions = _simulated(tmp_path, "a", seed=5)
    results = evaluate(truth, decisions, trace)
    assert results["gpuwarden"]["classes"]["hard"]["recall"] == 1.0


def test_a_truth_of_another_seed_is_refused_with_the_trace(tmp_path: Path) -> None:
    # Same fleet, same start, same faults: only the trace can tell that the truth is another's.
    trace_a, truth_a, decisions_a = _simulated(tmp_path, "a", seed=5)
    _, truth_b, _ = _simulated(tmp_path, "b", seed=6)
    proc = _eval_cli(truth_b, decisions_a, "--trace", trace_a)
    assert proc.returncode == 2
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"gpuwarden eval: error: {trace_a} is not {truth_b}'s trace: only 0 of the 3")
    assert proc.stdout == ""
    assert _eval_cli(truth_a, decisions_a, "--trace", trace_a).returncode == 0


def test_a_trace_with_other_nodes_is_refused(tmp_path: Path) -> None:
    trace, truth, decisions = _simulated(tmp_path, "a", seed=5)
    other = tmp_path / "other.jsonl"
    other.write_text(trace.read_text().replace('"gpu-0007"', '"node-x007"'))
    with pytest.raises(
        ConfigError, match=r"other.jsonl is not .*a.truth.json's trace: it has 1 node\(s\) .*node-x007"
    ):
        evaluate(truth, decisions, other)


def test_decisions_about_another_fleet_are_refused(files: tuple[Path, Path], tmp_path: Path) -> None:
    truth, _ = files
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps(_d(140, "gpu-0042", "quarantined")) + "\n")
    proc = _eval_cli(truth, other)
    assert proc.returncode == 2
    (line,) = proc.stderr.splitlines()
    assert "does not belong to" in line and "1 node(s) the truth's fleet does not have (gpu-0042)" in line


def test_decisions_outside_the_truths_time_span_are_refused(files: tuple[Path, Path], tmp_path: Path) -> None:
    truth, _ = files
    later = tmp_path / "later.jsonl"
    # A day later: a replay of another run of the same fleet (negative or absurd times to detect).
    later.write_text(
        "".join(json.dumps(_d(86_400 + d["time"] - T0, d["node"], d["state"])) + "\n" for d in DECISIONS[:3])
    )
    with pytest.raises(ConfigError, match=r"3 decision\(s\) fall outside the truth's time span"):
        evaluate(truth, later, None)
    # Minutes past the end are still the same run (decisions carry their reports' clocks).
    near = tmp_path / "near.jsonl"
    near.write_text(json.dumps(_d(3600 + 120, "gpu-0001", "quarantined")) + "\n")
    evaluate(truth, near, None)
