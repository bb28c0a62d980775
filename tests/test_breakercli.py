"""``gpuwarden breaker`` against aggregators that cannot answer it: remediation off, or no aggregator."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.ports import free_port

GPWD = [sys.executable, "-m", "gpuwarden"]


def _breaker(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*GPWD, "breaker", *args], cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )


@pytest.fixture(scope="module")
def aggregator_without_remediation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("breaker")
    (tmp / "tokens").write_text("node-1 3b8f0c2e9d7a4f61a5c0e2d4\n")
    port = free_port()
    server = subprocess.Popen(
        [
            *GPWD,
            "aggregator",
            "--listen",
            f"127.0.0.1:{port}",
            "--token-file",
            str(tmp / "tokens"),
            "--decisions",
            str(tmp / "decisions.jsonl"),
            "--remediation",
            "off",
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{base}/readyz", timeout=1):
                    break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "no aggregator"
                time.sleep(0.2)
        yield base
    finally:
        server.terminate()
        server.wait(timeout=15)


def test_status_says_remediation_is_off(aggregator_without_remediation: str) -> None:
    out = _breaker("status", "--aggregator", aggregator_without_remediation)
    assert out.returncode == 2
    (line,) = out.stderr.splitlines()
    assert line.startswith(
        f"gpuwarden breaker: error: remediation is off on the aggregator at {aggregator_without_remediation}:"
    )
    # The raw HTTP status is not what an operator needs; the URL is taken out
    # first because a random port may itself contain "404".
    assert "404" not in line.replace(aggregator_without_remediation, "<url>")


def test_reset_says_remediation_is_off(aggregator_without_remediation: str, tmp_path: Path) -> None:
    (tmp_path / "admin.token").write_text("admin-token-0123456789abcdef\n")
    out = _breaker(
        "reset",
        "--aggregator",
        aggregator_without_remediation,
        "--token-file",
        str(tmp_path / "admin.token"),
        "--by",
        "alice",
    )
    assert out.returncode == 2
    assert "remediation is off on the aggregator" in out.stderr


def test_a_server_that_is_no_aggregator_keeps_its_404() -> None:
    class NotFound(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(404)
            self.send_header("Content-Length", "9")
            self.end_headers()
            self.wfile.write(b"not here\n")

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        out = _breaker("status", "--aggregator", url)
    finally:
        server.shutdown()
        server.server_close()
    assert out.returncode == 2
    assert out.stderr.strip() == f"gpuwarden breaker: error: {url}/api/v1/remediation: HTTP 404: not here"


def test_a_reset_not_yet_stored_in_the_lease_says_so_and_exits_3(tmp_path: Path) -> None:
    # The replica reset its breaker, but the Lease write was refused (429): the other replica
    # still reads the open breaker there, so the operator must not be told it is done.
    class NotStored(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            body = b'{"breaker": {"open": false, "reset_by": "alice"}, "reset": {}, "stored": false}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    (tmp_path / "token").write_text("admin-token-0123456789\n")
    server = ThreadingHTTPServer(("127.0.0.1", 0), NotStored)
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        out = _breaker("reset", "--aggregator", url, "--token-file", str(tmp_path / "token"), "--by", "alice")
    finally:
        server.shutdown()
        server.server_close()
    assert out.returncode == 3
    assert '"stored": false' in out.stdout
    assert "not yet stored in the Lease" in out.stderr
