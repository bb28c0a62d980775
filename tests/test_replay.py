"""``gpuwarden replay TRACE --out DECISIONS`` on generated traces, as a user runs it (a subprocess).

It writes the decision log and a summary, is deterministic, refuses unusable input with exit 2 and
a one-line reason, skips a bad line in the middle, orders slightly out-of-order reports, and (the
property replay exists for) gives the same decisions as the live aggregator fed the same reports
over HTTP.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import random
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from agent.clock import SettableClock
from agent.report import encode
from aggregator.app import build_pipeline
from aggregator.auth import StaticTokens
from aggregator.configload import parse_config
from aggregator.decisions import Decision, DecisionLog, read_decisions
from aggregator.replay import replay
from aggregator.replay import replayed as replayed_state
from aggregator.rules import default_rules_dir, load_rules
from aggregator.service import REPORTS_PATH, SERVER_KWARGS, create_app
from sim.cli import write_trace
from tests.conftest import REPO
from tests.rulekit import report as healthy_report
from tests.simfleet import fault, fleet, generate

CONFIG_YAML = """
health: {suspect_for_seconds: 30, clear_for_seconds: 30, probation_seconds: 60}
silence: {silent_after_seconds: 30}
"""
CONFIG = parse_config(CONFIG_YAML, "test_replay")
RULES = load_rules([default_rules_dir()])

# Zero skew and zero receive jitter: the live service's clock (receive time) and replay's clock
# (the report's own time) are then the same clock, so the two must decide the same.
SCENARIO = fleet(
    16,
    duration_s=360.0,
    seed=5,
    jitter_s=0.0,
    lost_fraction=0.01,
    duplicate_fraction=0.02,
    faults=(
        fault("xid79", 60.0, node="gpu-0002", gpu=1),
        fault("reboot", 150.0, node="gpu-0002", down_s=20.0),
        fault("ib_port_down", 90.0, node="gpu-0006", port=4),
        fault("dbe", 100.0, node="gpu-0008", gpu=0),
        fault("app_xid", 100.0, node="gpu-0004", gpu=2, code=13),
        fault("silent_node", 120.0, node="gpu-0010", until_s=200.0),
    ),
)
# The same fleet as agents really deliver it: receive times jittered, so not in time order.
JITTERED = dataclasses.replace(SCENARIO, jitter_s=2.0)


def gpuwarden(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuwarden", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def run_replay(trace: Path, out: Path, config: Path) -> subprocess.CompletedProcess[str]:
    return gpuwarden("replay", trace, "--out", out, "--config", config)


def own_lines(stderr: str, prefix: str) -> list[str]:
    """stderr lines the command printed itself (log lines start with a timestamp)."""
    return [line for line in stderr.splitlines() if line.startswith(prefix)]


def summary_of(stderr: str) -> dict[str, Any]:
    """The replay summary on stderr: counts, rejections by reason, decisions by state."""
    (head,) = own_lines(stderr, "reports read: ")
    counts = dict(part.split(": ") for part in head.split(", "))
    rejected = {
        line.split("(")[1].split(")")[0]: int(line.split("): ", 1)[1].split()[0])
        for line in own_lines(stderr, "  rejected (")
    }
    (tail,) = own_lines(stderr, "decisions: ")
    states = tail.removeprefix("decisions: ")
    by_state = {} if states == "none" else {s.split()[0]: int(s.split()[1]) for s in states.split(", ")}
    return {"counts": {k: int(v) for k, v in counts.items()}, "rejected": rejected, "decisions": by_state}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("replay")
    (path / "config.yaml").write_text(CONFIG_YAML)
    return path


@pytest.fixture(scope="module")
def trace(work: Path) -> Path:
    path = work / "trace.jsonl"
    write_trace(JITTERED, path)
    return path


@pytest.fixture(scope="module")
def replayed(work: Path, trace: Path) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = work / "decisions.jsonl"
    return out, run_replay(trace, out, work / "config.yaml")


# -- a normal replay --------------------------------------------------------------------------------


def test_replay_writes_the_decision_log_and_a_summary(
    replayed: tuple[Path, subprocess.CompletedProcess[str]], trace: Path
) -> None:
    out, proc = replayed
    assert proc.returncode == 0, proc.stderr
    decisions = list(read_decisions(out))
    lines = trace.read_bytes().splitlines()
    summary = summary_of(proc.stderr)
    duplicates = len(lines) - len(set(lines))
    assert duplicates > 0
    assert summary["counts"] == {
        "reports read": len(lines),
        "replayed": len(lines) - duplicates,
        "duplicates": duplicates,
        "rejected": 0,
    }
    assert summary["rejected"] == {}
    assert summary["decisions"] == dict(Counter(d.state for d in decisions))

    # What the scenario holds: three hard faults, a silent node, a reboot that clears one fault.
    by_node = {
        n: [(d.state, [r.rule for r in d.reasons]) for d in decisions if d.node == n]
        for n in SCENARIO.node_names()
    }
    assert by_node["gpu-0002"][0] == ("quarantined", ["xid-79"])
    assert [s for s, _ in by_node["gpu-0002"]][-2:] == ["probation", "healthy"]
    assert ("quarantined", ["ib-port-down"]) in by_node["gpu-0006"]
    # XID 48 and the uncorrectable-error counter it comes with, in the same report.
    assert by_node["gpu-0008"] == [("quarantined", ["gpu-ecc-uncorrectable", "xid-48"])]
    assert [s for s, _ in by_node["gpu-0010"]] == ["suspect", "healthy"]
    assert by_node["gpu-0004"] == []  # an application XID
    assert {n for n, ds in by_node.items() if ds} == {"gpu-0002", "gpu-0006", "gpu-0008", "gpu-0010"}


def test_replay_reads_gzip_traces_and_is_deterministic(
    replayed: tuple[Path, subprocess.CompletedProcess[str]], work: Path, trace: Path
) -> None:
    first, _ = replayed
    gz = work / "trace.jsonl.gz"
    write_trace(JITTERED, gz)
    written = gz.read_bytes()
    write_trace(JITTERED, gz)
    assert gz.read_bytes() == written  # the generator is deterministic, gzip header included
    assert gzip.decompress(written) == trace.read_bytes()
    again, from_gz = work / "again.jsonl", work / "from-gz.jsonl"
    for source, out in ((trace, again), (gz, from_gz)):
        proc = run_replay(source, out, work / "config.yaml")
        assert proc.returncode == 0, proc.stderr
    assert first.read_bytes() == again.read_bytes() == from_gz.read_bytes()
    assert first.stat().st_size > 0


# -- unusable and bad input -------------------------------------------------------------------------


def _not_json(work: Path) -> Path:
    path = work / "not-json.jsonl"
    path.write_text("this is not a trace\n")
    return path


def _missing(work: Path) -> Path:
    return work / "no-such-trace.jsonl"


def _empty(work: Path) -> Path:
    path = work / "empty.jsonl"
    path.write_text("")
    return path


def _truncated_gzip(work: Path) -> Path:
    data = gzip.compress((work / "trace.jsonl").read_bytes(), mtime=0)
    path = work / "truncated.jsonl.gz"
    path.write_bytes(data[: len(data) // 2])
    return path


def _corrupt_gzip(work: Path) -> Path:
    """Bytes damaged in the middle of the compressed stream: it still inflates, to garbage, and
    only the CRC at the end says so."""
    data = bytearray(gzip.compress((work / "trace.jsonl").read_bytes(), mtime=0))
    middle = len(data) // 3
    data[middle : middle + 64] = bytes(b ^ 0x55 for b in data[middle : middle + 64])
    path = work / "corrupt.jsonl.gz"
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize(
    ("make", "says"),
    [
        pytest.param(_not_json, [":1: not a gpuwarden report"], id="not-json"),
        pytest.param(_missing, ["cannot open trace", "No such file"], id="missing"),
        pytest.param(_truncated_gzip, ["unreadable trace after line "], id="truncated-gzip"),
        pytest.param(
            _corrupt_gzip, ["unreadable trace after line ", "damaged lines skipped"], id="corrupt-gzip"
        ),
        pytest.param(_empty, ["no reports in the trace"], id="empty"),
    ],
)
def test_unusable_input_exits_2_with_a_one_line_reason(
    work: Path, trace: Path, make: Callable[[Path], Path], says: list[str]
) -> None:
    path = make(work)
    out_dir = work / f"{path.name}.out.d"
    out_dir.mkdir()
    out = out_dir / "decisions.jsonl"
    proc = run_replay(path, out, work / "config.yaml")
    assert proc.returncode == 2
    # One line, and nothing else: no warning per damaged line, no summary of a replay that did
    # not happen.
    (reason,) = proc.stderr.splitlines()
    assert reason.startswith("gpuwarden replay: ")
    assert str(path) in reason
    for text in says:
        assert text in reason
    # No partial decision log, and no temporary file left behind.
    assert list(out_dir.iterdir()) == []


def test_a_failed_replay_keeps_the_previous_decision_log(work: Path) -> None:
    out = work / "kept-decisions.jsonl"
    out.write_bytes(b"the previous replay's decisions\n")
    proc = run_replay(_truncated_gzip(work), out, work / "config.yaml")
    assert proc.returncode == 2
    assert out.read_bytes() == b"the previous replay's decisions\n"
    assert sorted(p.name for p in work.glob(".kept-decisions*")) == []


def test_the_summary_comes_last_and_decisions_are_logged_only_with_verbose(
    replayed: tuple[Path, subprocess.CompletedProcess[str]], work: Path, trace: Path
) -> None:
    out, quiet = replayed
    assert quiet.returncode == 0, quiet.stderr
    decisions = list(read_decisions(out))
    assert decisions
    # Not a terminal: no progress line, no log line; the summary is all there is.
    assert quiet.stderr.splitlines()[0].startswith("reports read: ")
    assert quiet.stderr.splitlines()[-1].startswith("decisions: ")
    assert "\r" not in quiet.stderr and " INFO " not in quiet.stderr

    verbose = gpuwarden(
        "replay", trace, "--out", work / "verbose.jsonl", "--config", work / "config.yaml", "-v"
    )
    assert verbose.returncode == 0, verbose.stderr
    logged = [line for line in verbose.stderr.splitlines() if " INFO aggregator.pipeline: decision " in line]
    assert len(logged) == len(decisions)
    assert verbose.stderr.splitlines()[-1].startswith("decisions: ")
    assert (work / "verbose.jsonl").read_bytes() == out.read_bytes()


def test_a_terminal_gets_a_progress_line_cleared_before_the_summary(work: Path, trace: Path) -> None:
    import os
    import pty

    primary, secondary = pty.openpty()
    try:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpuwarden",
                "replay",
                str(trace),
                "--out",
                str(work / "tty.jsonl"),
                "--config",
                str(work / "config.yaml"),
            ],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=secondary,
        )
        os.close(secondary)
        seen = b""
        while True:
            try:
                chunk = os.read(primary, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            seen += chunk
        assert proc.wait(timeout=60) == 0
    finally:
        os.close(primary)
    text = seen.decode().replace("\r\n", "\n")
    assert "\rreplay: " in text and "reports" in text
    # The progress line is erased before the summary, which comes last.
    assert text.index("\r\033[K") < text.index("reports read: ")
    assert text.rstrip("\n").splitlines()[-1].startswith("decisions: ")


def test_a_bad_line_in_the_middle_is_counted_and_skipped(
    replayed: tuple[Path, subprocess.CompletedProcess[str]], work: Path, trace: Path
) -> None:
    clean, _ = replayed
    lines = trace.read_bytes().splitlines(keepends=True)
    middle = len(lines) // 2
    not_json = b'{"schema": "gpuwarden/report/v1", "node": \n'
    wrong_schema = json.dumps({**json.loads(lines[middle]), "seq": -1}).encode() + b"\n"
    hot = json.loads(lines[middle])
    hot["gpus"][0]["temperature_celsius"] = 900.0  # valid JSON and schema; live refuses it (422)
    implausible = json.dumps(hot).encode() + b"\n"
    damaged = work / "damaged.jsonl"
    damaged.write_bytes(b"".join([*lines[:middle], not_json, wrong_schema, implausible, *lines[middle:]]))
    out = work / "damaged-decisions.jsonl"
    proc = run_replay(damaged, out, work / "config.yaml")
    assert proc.returncode == 0, proc.stderr
    summary = summary_of(proc.stderr)
    assert summary["counts"]["reports read"] == len(lines) + 3
    assert summary["counts"]["rejected"] == 3
    assert summary["rejected"] == {"json": 1, "schema": 1, "implausible": 1}
    assert out.read_bytes() == clean.read_bytes()


def test_reports_out_of_order_across_nodes_give_the_same_decisions(
    replayed: tuple[Path, subprocess.CompletedProcess[str]], work: Path, trace: Path
) -> None:
    clean, _ = replayed
    lines = trace.read_bytes().splitlines(keepends=True)
    windows: dict[int, list[bytes]] = {}
    for line in lines:
        windows.setdefault(int((json.loads(line)["time"] - SCENARIO.start) // 10.0), []).append(line)
    rng = random.Random(11)
    shuffled: list[bytes] = []
    for key in sorted(windows):
        rng.shuffle(windows[key])
        shuffled.extend(windows[key])
    assert shuffled != lines
    path = work / "shuffled.jsonl"
    path.write_bytes(b"".join(shuffled))
    out = work / "shuffled-decisions.jsonl"
    proc = run_replay(path, out, work / "config.yaml")
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == clean.read_bytes()


# -- replay is live ingestion -----------------------------------------------------------------------


async def test_replay_gives_the_same_decisions_as_live_ingestion(aiohttp_client: Any, tmp_path: Path) -> None:
    """Post every report of the trace to the real aggregator app over HTTP (gzip, bearer token),
    in receive order with the clock at each receive time, then replay the same trace.

    The trace has zero clock skew and zero receive jitter: live ingestion judges by receive time and
    replay by the reports' own time, and only then are those the same clock.
    """
    tokens = {node: f"token-{node}-0123456789abcdef" for node in SCENARIO.node_names()}
    token_file = tmp_path / "tokens"
    token_file.write_text("".join(f"{node} {token}\n" for node, token in tokens.items()))
    live_log = tmp_path / "live.jsonl"
    decisions = DecisionLog(live_log)
    pipeline = build_pipeline(CONFIG, RULES, decisions)
    clock = SettableClock(SCENARIO.start)
    app = create_app(
        pipeline, StaticTokens(token_file), CONFIG, clock, CollectorRegistry(), advance_interval_s=None
    )
    server = TestServer(app)
    await server.start_server(**SERVER_KWARGS)
    client = await aiohttp_client(server)
    answers: Counter[tuple[int, str]] = Counter()
    next_tick: float | None = None
    try:
        for received, report in generate(SCENARIO):
            # The live service's periodic task: pipeline.advance once a second between reports.
            if next_tick is None:
                next_tick = float(int(received)) + 1.0
            while next_tick < received:
                pipeline.advance(next_tick)
                next_tick += 1.0
            clock.now = received
            resp = await client.post(
                REPORTS_PATH,
                data=gzip.compress(encode(report)),
                headers={
                    "Authorization": f"Bearer {tokens[report.node]}",
                    "Content-Type": "application/json",
                    "Content-Encoding": "gzip",
                },
            )
            answers[(resp.status, (await resp.json())["status"])] += 1
    finally:
        decisions.close()
    assert set(answers) == {(200, "accepted"), (200, "duplicate")}

    trace = tmp_path / "trace.jsonl.gz"
    write_trace(SCENARIO, trace)
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG_YAML)
    replay_log = tmp_path / "replay.jsonl"
    proc = run_replay(trace, replay_log, config)
    assert proc.returncode == 0, proc.stderr
    assert summary_of(proc.stderr)["counts"]["duplicates"] == answers[(200, "duplicate")]

    live = list(read_decisions(live_log))
    replayed = list(read_decisions(replay_log))
    assert {d.state for d in live} == {"suspect", "quarantined", "probation", "healthy"}
    assert _comparable(replayed) == _comparable(live)
    assert replay_log.read_bytes() == live_log.read_bytes()


def _comparable(decisions: list[Decision]) -> list[tuple[Any, ...]]:
    return [
        (
            d.time,
            d.node,
            d.previous,
            d.state,
            d.action,
            [(r.detector, r.rule, r.summary, r.evidence) for r in d.reasons],
        )
        for d in decisions
    ]


# -- clock skew -------------------------------------------------------------------------------------


def test_a_node_with_a_skewed_clock_makes_no_decision_in_replay(tmp_path: Path) -> None:
    scenario = fleet(
        16,
        duration_s=300.0,
        seed=6,
        faults=(
            fault("clock_skew", 0.0, node="gpu-0003", seconds=3600.0),
            fault("clock_skew", 0.0, node="gpu-0011", seconds=-3600.0),
        ),
    )
    trace = tmp_path / "skewed.jsonl"
    write_trace(scenario, trace)
    decisions, summary = replay(trace, None, CONFIG, RULES)
    assert summary.reports_replayed == summary.reports_read > 0
    assert decisions == []


def test_out_that_is_the_trace_itself_is_refused_and_the_trace_kept(work: Path, trace: Path) -> None:
    before = trace.read_bytes()
    proc = run_replay(trace, trace, work / "config.yaml")
    assert proc.returncode == 2
    assert "--out is the trace itself" in proc.stderr
    assert trace.read_bytes() == before


# -- the report interval --------------------------------------------------------------------------


def test_replay_judges_a_trace_at_the_interval_its_reports_declare(tmp_path: Path) -> None:
    # Recorded every 30 s: judged as a 10 s fleet, two frame slots in three would be empty and a
    # node silent after two missed reports. With no --config, the trace's interval is used.
    scenario = dataclasses.replace(fleet(8, duration_s=600.0, seed=8, jitter_s=0.0), interval_s=30.0)
    trace = tmp_path / "every-30s.jsonl"
    write_trace(scenario, trace)
    proc = gpuwarden("replay", trace, "--out", tmp_path / "d.jsonl")
    assert proc.returncode == 0, proc.stderr
    [line] = own_lines(proc.stderr, "report interval: ")
    assert line == "report interval: 30 s, as the trace's reports declare"
    config = parse_config("", "empty")
    _, _, final = replayed_state(trace, tmp_path / "d2.jsonl", config, RULES, trace_interval=True)
    assert final.config.fleet.interval_seconds == 30.0
    assert final.pipeline.frames.config.interval_seconds == 30.0
    assert final.pipeline.silence.silent_after_seconds == 180.0


def test_a_configured_interval_wins_and_the_summary_says_the_trace_disagrees(tmp_path: Path) -> None:
    scenario = dataclasses.replace(fleet(4, duration_s=300.0, seed=9, jitter_s=0.0), interval_s=30.0)
    trace = tmp_path / "every-30s.jsonl"
    write_trace(scenario, trace)
    config = tmp_path / "config.yaml"
    config.write_text("fleet: {interval_seconds: 10}\n")
    proc = run_replay(trace, tmp_path / "d.jsonl", config)
    assert proc.returncode == 0, proc.stderr
    [line] = own_lines(proc.stderr, "report interval: ")
    assert line.startswith("report interval: 10 s as configured (fleet.interval_seconds)")
    assert "declare 30 s" in line


def test_a_spool_flushed_after_an_outage_leaves_the_rest_of_the_fleet_reporting(tmp_path: Path) -> None:
    # Live, a node back from an outage sends its spooled reports at once: received now, measured
    # minutes ago. The trace holds them where they were received; replay must not take their old
    # times as its clock (which stepped the pipeline's clock back and made every node silent).
    t0 = 1_800_000_000.0
    lines: list[bytes] = []
    spool: list[bytes] = []
    for k in range(60):  # 10 minutes at 10 s
        for i in range(8):
            rep = encode(healthy_report(t0 + k * 10.0 + i, node=f"n{i}", seq=k))
            if i == 7 and 20 <= k < 40:
                spool.append(rep)  # n7 cannot reach the aggregator from 200 s to 400 s
                continue
            if i == 7 and k == 40:
                lines += spool  # back: the spool first, then this report
            lines.append(rep)
    trace = tmp_path / "flush.jsonl"
    trace.write_bytes(b"\n".join(lines) + b"\n")
    decisions, summary = replay(trace, None, CONFIG, RULES)
    assert summary.reports_replayed == 480
    suspects = {d.node for d in decisions if d.state == "suspect"}
    assert suspects == {"n7"}  # silent for 200 s, over silence.silent_after_seconds (30 s here)
    assert [d.state for d in decisions if d.node == "n7"][-1] in ("healthy", "probation")
