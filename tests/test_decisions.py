"""The decision log is append-only JSONL in the docs/spec.md format, robust to a torn last line,
and durable: what ``synced`` acknowledged survives a kill -9 (and, fsync'd, a power loss)."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import IO, Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from agent.clock import FakeClock
from agent.errors import ConfigError
from agent.report import Report, encode
from aggregator.auth import StaticTokens
from aggregator.config import Config
from aggregator.decisions import Decision, DecisionLog, Reason, TornLine, encode_decision, read_decisions
from aggregator.model import IngestOutcome
from aggregator.service import REPORTS_PATH, SERVER_KWARGS, create_app
from tests.test_service import NOW, TOKENS, FakePipeline, make_report

ROOT = Path(__file__).resolve().parent.parent


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


def test_torn_last_line_is_skipped_and_reported_but_corruption_inside_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    log = DecisionLog(path)
    log.append(_d(1.0))
    log.close()
    with path.open("ab") as f:
        f.write(b'{"time": 2.0, "subj')
    torn: list[TornLine] = []
    assert [d.time for d in read_decisions(path, torn=torn)] == [1.0]
    assert torn == [TornLine(2, b'{"time": 2.0, "subj', glued=False)]
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


def test_opening_the_live_log_cuts_a_torn_tail_into_a_side_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "d.jsonl"
    whole = encode_decision(_d(1.0)) + b"\n"
    fragment = encode_decision(_d(2.0))[:37]
    path.write_bytes(whole + fragment)
    with caplog.at_level(logging.WARNING, logger="aggregator.decisions"):
        log = DecisionLog(path)
    log.append(_d(3.0))
    log.close()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "torn" in warnings[0].getMessage()
    (side,) = tmp_path.glob("d.jsonl.torn-*")
    assert side.read_bytes() == fragment
    assert str(side) == warnings[0].__dict__["kept_in"]
    torn: list[TornLine] = []
    assert [d.time for d in read_decisions(path, torn=torn)] == [1.0, 3.0]
    assert torn == []
    assert path.read_bytes() == whole + encode_decision(_d(3.0)) + b"\n"


def test_a_whole_last_record_without_its_newline_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(encode_decision(_d(1.0)))
    log = DecisionLog(path)
    log.append(_d(2.0))
    log.close()
    assert [d.time for d in read_decisions(path)] == [1.0, 2.0]
    assert not list(tmp_path.glob("*.torn-*"))


def test_a_zero_filled_tail_is_cut_too(tmp_path: Path) -> None:
    # ext4 and XFS can leave a power-lost append as a run of NUL bytes at the end of the file.
    path = tmp_path / "d.jsonl"
    path.write_bytes(encode_decision(_d(1.0)) + b"\n" + b"\0" * 300)
    DecisionLog(path).close()
    assert [d.time for d in read_decisions(path)] == [1.0]
    assert path.read_bytes().endswith(b"}\n")


def test_a_log_with_a_fragment_glued_to_the_next_record_reads_back_with_the_fragment_reported(
    tmp_path: Path,
) -> None:
    # What a power loss followed by a restart left before the tail was repaired on open: the
    # next record was appended right after the fragment, on the same line.
    path = tmp_path / "d.jsonl"
    fragment = encode_decision(_d(2.0))[:51]
    path.write_bytes(
        encode_decision(_d(1.0))
        + b"\n"
        + fragment
        + encode_decision(_d(3.0))
        + b"\n"
        + encode_decision(_d(4.0))
        + b"\n"
    )
    torn: list[TornLine] = []
    assert [d.time for d in read_decisions(path, torn=torn)] == [1.0, 3.0, 4.0]
    assert torn == [TornLine(2, fragment, glued=True)]


async def test_synced_waits_for_the_fsync_and_one_fsync_covers_a_burst(tmp_path: Path) -> None:
    log = DecisionLog(tmp_path / "d.jsonl")
    await log.synced()  # nothing appended: nothing to wait for
    for t in range(200):
        log.append(_d(float(t)))
    assert log.appended == 200
    await log.synced(log.appended)
    assert log.durable_seq == 200
    # One event-loop turn's appends share a few fsyncs, not one each. How few depends on how
    # fast this disk syncs while the appends go on (a cached virtual disk syncs in 0.06 ms, and
    # the syncer then runs several times in one turn: 8 were seen), so the bound is a tenth.
    assert 1 <= log.fsyncs <= 20
    log.close()


async def test_without_a_file_everything_is_durable_at_once() -> None:
    log = DecisionLog(None)
    log.append(_d(1.0))
    await asyncio.wait_for(log.synced(), 1.0)
    assert log.durable_seq == log.appended == 1


class _FullDisk:
    """A file whose writes fail with ENOSPC while ``full``; everything else goes to ``inner``."""

    def __init__(self, inner: IO[bytes]) -> None:
        self.inner = inner
        self.full = True

    def write(self, data: bytes) -> int:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.inner.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_a_full_disk_keeps_records_pending_and_in_order_and_holds_their_waiters(
    tmp_path: Path,
) -> None:
    path = tmp_path / "d.jsonl"
    log = DecisionLog(path)
    log.append(_d(1.0))
    await log.synced()
    disk = _FullDisk(log._file)  # type: ignore[arg-type]
    log._file = disk  # type: ignore[assignment]
    log.append(_d(2.0))
    log.append(_d(3.0))
    assert not log.writable
    waiter = asyncio.create_task(log.synced())
    await asyncio.sleep(0.2)
    assert not waiter.done()  # not on disk: a report that caused them is not answered yet
    disk.full = False
    # Written by the syncer's retry, without waiting for another decision to come.
    await asyncio.wait_for(waiter, 5.0)
    assert (log.writable, log.durable_seq) == (True, 3)
    log.close()
    assert [d.time for d in read_decisions(path)] == [1.0, 2.0, 3.0]


_CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from aggregator.decisions import Decision, DecisionLog

    async def main(path: Path, first: int) -> None:
        log = DecisionLog(path)
        n = first
        while True:
            for _ in range(n % 7 + 1):  # bursts of 1 to 7 decisions, as one report can cause
                log.append(Decision(time=float(n), subject="node", node=f"n{n % 40}", state="quarantined",
                                    previous="healthy", action="taint", reasons=[]))
                n += 1
            await log.synced(log.appended)
            print(f"durable {n - 1}", flush=True)  # what the service's 200 stands for
            await asyncio.sleep(0)

    asyncio.run(main(Path(sys.argv[1]), int(sys.argv[2])))
    """
)


def _lose_power(path: Path, durable: int, rng: random.Random) -> None:
    """What a power loss may do: drop any part of what was written after the last fsync."""
    data = path.read_bytes()
    end = 0
    for line in data.splitlines(keepends=True):
        end += len(line)
        if json.loads(line)["time"] == durable:
            break
    with path.open("r+b") as f:
        f.truncate(rng.randint(end, len(data)))


def test_kill_9_and_power_loss_at_random_points_lose_no_acknowledged_decision(
    tmp_path: Path,
) -> None:
    path = tmp_path / "d.jsonl"
    rng = random.Random(15)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    acknowledged = -1
    for _kill in range(20):
        present = [int(d.time) for d in read_decisions(path)] if path.exists() else []
        first = present[-1] + 1 if present else 0
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(path), str(first)],
            stdout=subprocess.PIPE,
            env=env,
            cwd=ROOT,
        )
        assert child.stdout is not None
        for _ in range(rng.randint(1, 30)):
            line = child.stdout.readline()
            assert line.startswith(b"durable "), line
            acknowledged = int(line.split()[1])
        child.send_signal(signal.SIGKILL)  # mid-burst or mid-fsync: wherever it happens to be
        child.wait()
        child.stdout.close()
        if _kill % 2:
            _lose_power(path, acknowledged, rng)
    torn: list[TornLine] = []
    times = [int(d.time) for d in read_decisions(path, torn=torn)]
    assert all(not t.glued for t in torn)  # at most the last power loss's torn tail
    assert times == list(range(len(times)))  # in order, none lost in between, none twice
    assert acknowledged >= 0 and times[-1] >= acknowledged


class _DecidingPipeline(FakePipeline):
    """A pipeline whose odd-numbered reports each cause a decision, written to its log."""

    def __init__(self, decisions: DecisionLog) -> None:
        super().__init__()
        self.decisions = decisions

    def ingest(self, report: Report, received: float) -> IngestOutcome:
        outcome = super().ingest(report, received)
        if report.seq % 2:
            self.decisions.append(_d(received))
        return outcome


async def test_a_report_is_answered_only_once_the_decisions_it_caused_are_on_disk(
    tmp_path: Path, aiohttp_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = DecisionLog(tmp_path / "d.jsonl")
    disk = threading.Event()  # the disk holds every fsync until set
    real_fsync = os.fsync

    def slow_fsync(fd: int) -> None:
        disk.wait(10.0)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    tokens = tmp_path / "tokens"
    tokens.write_text("".join(f"{node} {token}\n" for node, token in TOKENS.items()))
    app = create_app(
        _DecidingPipeline(log),
        StaticTokens(tokens),
        Config(),
        FakeClock(start=NOW),
        CollectorRegistry(),
        advance_interval_s=None,
        decisions=log,
    )
    server = TestServer(app)
    await server.start_server(**SERVER_KWARGS)
    client: TestClient[Any, Any] = await aiohttp_client(server)
    hdrs = {"Content-Type": "application/json", "Authorization": f"Bearer {TOKENS['gpu-0001']}"}

    deciding = asyncio.create_task(client.post(REPORTS_PATH, data=encode(make_report(seq=1)), headers=hdrs))
    await asyncio.sleep(0.3)
    assert not deciding.done()  # its decision is written, not yet durable: no 200 yet
    quiet = await client.post(REPORTS_PATH, data=encode(make_report(seq=2)), headers=hdrs)
    assert quiet.status == 200  # a report that decided nothing does not wait for the disk
    disk.set()
    answer = await asyncio.wait_for(deciding, 5.0)
    assert answer.status == 200
    assert log.durable_seq == log.appended == 1
    log.close()
