"""``gpuwarden replay TRACE --out FILE --serve HOST:PORT``: the replay's final state served
read-only, as a user runs it (a subprocess), looked at with the status page and with
``gpuwarden status`` / ``gpuwarden explain``."""

from __future__ import annotations

import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from aggregator.story import iso
from gpuwarden.cli import main
from sim.cli import write_trace
from tests.simfleet import fault, fleet

REPO = Path(__file__).resolve().parent.parent
QUARANTINED = "gpu-0002"
SCENARIO = fleet(8, seed=11, duration_s=240.0, faults=(fault("xid79", 60.0, node=QUARANTINED, gpu=1),))
START_TIMEOUT_S = 180.0  # the replay itself runs first (imports, the pipeline) on a loaded machine
STOP_TIMEOUT_S = 10.0


@dataclass
class Served:
    proc: subprocess.Popen[str]
    base: str
    trace: Path
    out: Path


def _lines(stream: object, into: queue.Queue[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        into.put(line)


@contextmanager
def serving(work: Path) -> Iterator[Served]:
    """Replay the scenario's trace with ``--serve 127.0.0.1:0`` until the URL is printed."""
    trace, out = work / "trace.jsonl", work / "decisions.jsonl"
    if not trace.exists():
        write_trace(SCENARIO, trace)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuwarden", "replay", trace, "--out", out, "--serve", "127.0.0.1:0"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True).start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        base = None
        while base is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                line = lines.get(timeout=1.0)
            except queue.Empty:
                continue
            found = re.search(r"on (http://127\.0\.0\.1:\d+)/", line)
            base = found.group(1) if found else None
        assert base is not None, f"no URL printed (exit {proc.poll()})"
        yield Served(proc, base, trace, out)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=STOP_TIMEOUT_S)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("replay-serve")


@pytest.fixture(scope="module")
def served(work: Path) -> Iterator[Served]:
    with serving(work) as s:
        yield s


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def last_report_time(trace: Path) -> float:
    with trace.open() as f:
        return max(json.loads(line)["time"] for line in f if line.strip())


def test_the_page_says_it_is_a_replay_as_of_the_traces_end(served: Served) -> None:
    status, page = get(served.base + "/")
    assert status == 200
    as_of = iso(last_report_time(served.trace))
    assert f"Replay of {served.trace}, as of {as_of}" in page
    assert f'<span class="now">{as_of}</span>' in page  # the clock is frozen at the trace's end
    assert served.out.exists()  # the decision log is written before serving


def test_a_quarantined_nodes_page_and_story_give_its_reason(served: Served) -> None:
    status, page = get(f"{served.base}/nodes/{QUARANTINED}")
    assert status == 200
    assert "quarantined" in page and "XID 79" in page
    status, body = get(f"{served.base}/api/v1/nodes/{QUARANTINED}/story")
    assert status == 200 and json.loads(body)["state"] == "quarantined"


def test_gpuwarden_status_and_explain_read_the_replay(
    served: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["status", "--aggregator", served.base]) == 0
    out = capsys.readouterr().out
    assert "8 nodes" in out and "1 quarantined" in out
    assert main(["explain", QUARANTINED, "--aggregator", served.base]) == 0
    out = capsys.readouterr().out
    assert f"{QUARANTINED}: quarantined since 20" in out and "XID 79" in out


def test_there_is_no_ingest(served: Served) -> None:
    req = urllib.request.Request(
        served.base + "/v1/reports", data=b"{}", method="POST", headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=10)
    assert refused.value.code in (404, 405)


def test_sigterm_stops_the_server_within_seconds(work: Path) -> None:
    with serving(work) as own:  # its own server: the others share theirs
        assert get(own.base + "/healthz")[0] == 200
        own.proc.send_signal(signal.SIGTERM)
        assert own.proc.wait(timeout=STOP_TIMEOUT_S) == 0
