"""The real aggregator program on 127.0.0.1 under the connection attacks of issue 16.

Each test starts ``gpuwarden aggregator`` in its own process (a file limit of its own where the
attack is about file descriptors) and measures a good node's reports while the attack runs:
1,100 idle sockets at a 1,024 file limit, slow header and slow body senders, 2,000 reports at
once. Every loop is bounded; nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import gzip
import http.client
import os
import selectors
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import yaml

from agent.report import encode
from tests.ports import free_port
from tests.test_service import make_report

REPO = Path(__file__).resolve().parents[1]
GOOD = "gpu-0001"


@dataclass
class Server:
    port: int
    proc: subprocess.Popen[bytes]
    log: Path
    tokens: dict[str, str]


def _token(node: str) -> str:
    return f"tok-{node}-0123456789abcdef"


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    started: list[Server] = []

    def run(
        *,
        nodes: int = 2,
        fd_limit: int | None = None,
        config: str = "",
        scheme: str = "http",
        event_loop: str = "auto",
    ) -> Server:
        names = [f"gpu-{i + 1:04d}" for i in range(nodes)]
        tokens = {n: _token(n) for n in names}
        (tmp_path / "tokens").write_text("".join(f"{n} {t}\n" for n, t in tokens.items()))
        settings = yaml.safe_load(config) or {}
        settings.setdefault("server", {})["event_loop"] = event_loop
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(settings))
        port = free_port()
        log = tmp_path / "aggregator.log"

        # The file limit is set inside the child before gpuwarden starts (no preexec_fn: the test
        # process may have threads).
        limit = (
            f"resource.setrlimit(resource.RLIMIT_NOFILE, ({fd_limit}, {fd_limit}))" if fd_limit else "pass"
        )
        launcher = (
            f"import resource, runpy, sys; {limit}; sys.argv[0] = 'gpuwarden'; "
            "runpy.run_module('gpuwarden', run_name='__main__')"
        )
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    launcher,
                    "aggregator",
                    "--listen",
                    f"127.0.0.1:{port}",
                    "--token-file",
                    str(tmp_path / "tokens"),
                    "--decisions",
                    str(tmp_path / "decisions.jsonl"),
                    "--config",
                    str(tmp_path / "config.yaml"),
                ],
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        server = Server(port, proc, log, tokens)
        started.append(server)
        deadline = time.monotonic() + 30
        while True:
            try:
                conn: http.client.HTTPConnection = (
                    http.client.HTTPSConnection(
                        "127.0.0.1", port, timeout=1, context=ssl._create_unverified_context()
                    )
                    if scheme == "https"
                    else http.client.HTTPConnection("127.0.0.1", port, timeout=1)
                )
                conn.request("GET", "/healthz")
                if conn.getresponse().status == 200:
                    conn.close()
                    break
            except OSError:
                pass
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the aggregator did not start"
            time.sleep(0.2)
        if event_loop != "auto":
            assert f"event_loop={event_loop}" in log.read_text()
        return server

    yield run
    for server in started:
        server.proc.terminate()
        try:
            server.proc.wait(10)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()


def _body(node: str, seq: int) -> bytes:
    report = make_report(node, seq, boot_id="boot-a", time_=time.time() - 1.0)
    return gzip.compress(encode(msgspec.structs.replace(report, run="run-1")), mtime=0)


def _request(server: Server, node: str, body: bytes) -> bytes:
    head = (
        f"POST /v1/reports HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {server.tokens[node]}\r\n"
        f"Content-Type: application/json\r\nContent-Encoding: gzip\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


def _good_reports(
    server: Server, count: int, first_seq: int = 0, between: Callable[[], None] | None = None
) -> list[float]:
    """Latencies of ``count`` reports of the good node, each on a fresh connection (the worst case)."""
    latencies = []
    for i in range(count):
        body = _body(GOOD, first_seq + i)
        t0 = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request(
            "POST",
            "/v1/reports",
            body=body,
            headers={
                "Authorization": f"Bearer {server.tokens[GOOD]}",
                "Content-Type": "application/json",
                "Content-Encoding": "gzip",
            },
        )
        resp = conn.getresponse()
        resp.read()
        latencies.append(time.perf_counter() - t0)
        conn.close()
        assert resp.status == 200, resp.status
        if between is not None:
            between()
    return latencies


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def _peek(sock: socket.socket) -> bytes:
    try:
        return sock.recv(300)
    except OSError as exc:
        return str(exc).encode()


def _closed_by_peer(sock: socket.socket) -> bool:
    """True when the server closed ``sock`` (after whatever answer it sent first)."""
    sock.setblocking(False)
    for _ in range(1000):
        try:
            if sock.recv(65536) == b"":
                return True
        except BlockingIOError:
            return False
        except OSError:
            return True
    return False


# The loops the service can run on (aggregator/eventloop.py): where the connection cap's accept
# path and TLS meet the loop's own transports, each is tried on both.
LOOPS = ("uvloop", "asyncio")


@pytest.mark.parametrize("event_loop", LOOPS)
def test_1100_idle_sockets_at_a_1024_file_limit_lock_no_good_node_out(
    start: Callable[..., Server], event_loop: str
) -> None:
    server = start(fd_limit=1024, config="server: {idle_timeout_seconds: 30}\n", event_loop=event_loop)
    idle: list[socket.socket] = []
    try:
        for _ in range(1100):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            idle.append(s)
        time.sleep(0.5)  # let the server accept what it will
        _good_reports(server, 1)  # a node's first report sets up its history: not what is measured
        latencies = _good_reports(server, 40, 1)
        assert _p99(latencies) < 0.1, sorted(latencies)[-5:]
    finally:
        for s in idle:
            s.close()
    log = server.log.read_text()
    assert "Too many open files" not in log
    assert len(log) < 100_000


def test_idle_slow_header_and_slow_body_clients_are_cut_off_and_good_nodes_stay_fast(
    start: Callable[..., Server],
) -> None:
    server = start(config="server: {idle_timeout_seconds: 2, body_timeout_seconds: 2}\n")
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(200)]
    slow_header = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(100)]
    slow_body = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(20)]
    header = b"POST /v1/reports HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 10_000
    body_head = (
        f"POST /v1/reports HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.tokens['gpu-0002']}\r\n"
        "Content-Type: application/json\r\nContent-Length: 900000\r\n\r\n{"
    ).encode()
    for s in slow_body:
        s.sendall(body_head)
    sent = [0]

    def dribble() -> None:
        # One byte more from every slow sender between two good reports.
        i = sent[0]
        sent[0] += 1
        for s in slow_header:
            with contextlib.suppress(OSError):
                s.send(header[i : i + 1])
        for s in slow_body:
            with contextlib.suppress(OSError):
                s.send(b" ")
        time.sleep(0.05)

    _good_reports(server, 1)  # a node's first report sets up its history: not what is measured
    try:
        latencies = _good_reports(server, 80, 1, between=dribble)  # about 4 s of attack
        assert _p99(latencies) < 0.1, sorted(latencies)[-5:]
        assert all(_closed_by_peer(s) for s in idle), "idle sockets were not closed"
        assert all(_closed_by_peer(s) for s in slow_header), "slow header senders were not cut off"
        assert all(_closed_by_peer(s) for s in slow_body), [_peek(s) for s in slow_body]
    finally:
        for s in idle + slow_header + slow_body:
            s.close()


@pytest.mark.parametrize("event_loop", LOOPS)
def test_2000_reports_at_once_are_answered_within_2s_or_shed(
    start: Callable[..., Server], event_loop: str
) -> None:
    server = start(nodes=2000, event_loop=event_loop)
    sel = selectors.DefaultSelector()
    socks = []
    for _ in range(2000):
        s = socket.create_connection(("127.0.0.1", server.port))
        socks.append(s)
    payloads = [_request(server, f"gpu-{i + 1:04d}", _body(f"gpu-{i + 1:04d}", 0)) for i in range(2000)]
    sent_at: dict[int, float] = {}
    got: dict[int, bytes] = {}
    answered: dict[int, float] = {}
    for i, (s, p) in enumerate(zip(socks, payloads, strict=True)):
        s.sendall(p)
        sent_at[i] = time.perf_counter()
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, i)
        got[i] = b""
    deadline = time.monotonic() + 60
    while len(answered) < 2000 and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=1.0):
            i = key.data
            try:
                chunk = key.fileobj.recv(65536)  # type: ignore[union-attr]
            except OSError:
                chunk = b""
            got[i] += chunk
            if not chunk or b"\r\n\r\n" in got[i]:
                answered[i] = time.perf_counter() - sent_at[i]
                sel.unregister(key.fileobj)
    for s in socks:
        s.close()
    statuses = [got[i].split(b" ", 2)[1] if got[i] else b"closed" for i in range(2000)]
    assert len(answered) == 2000
    assert set(statuses) <= {b"200", b"503"}, set(statuses)
    assert statuses.count(b"200") > 0
    times = {
        status: sorted(answered[i] for i in range(2000) if statuses[i] == status) for status in set(statuses)
    }
    summary = {
        status.decode(): (len(t), round(t[len(t) // 2], 3), round(t[-1], 3)) for status, t in times.items()
    }
    # Every report is answered: taken within 2 s (p99), or shed with 503 and Retry-After; none
    # waits the 15 s of the whole burst.
    assert _p99(times[b"200"]) < 2.0, summary
    assert max(answered.values()) < 5.0, summary


@pytest.mark.parametrize("event_loop", LOOPS)
def test_tls_from_a_cert_and_key_file_reloaded_when_they_change(
    start: Callable[..., Server], tmp_path: Path, event_loop: str
) -> None:
    def make_cert(name: str) -> None:
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "1",
                "-subj",
                f"/CN={name}",
                "-addext",
                "subjectAltName=IP:127.0.0.1",
                "-keyout",
                str(tmp_path / "tls.key"),
                "-out",
                str(tmp_path / "tls.crt"),
            ],
            check=True,
            capture_output=True,
        )

    def serves_the_file() -> bool:
        """Whether the server's certificate is the one in tls.crt now (checked byte for byte)."""
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        with socket.create_connection(("127.0.0.1", server.port)) as raw, ctx.wrap_socket(raw) as tls:
            served = tls.getpeercert(binary_form=True)
        return served == ssl.PEM_cert_to_DER_cert((tmp_path / "tls.crt").read_text())

    make_cert("first")
    server = start(
        config=f"server: {{tls_cert_file: {tmp_path / 'tls.crt'}, tls_key_file: {tmp_path / 'tls.key'}, "
        "tls_reload_seconds: 0.2}\n",
        scheme="https",
        event_loop=event_loop,
    )
    assert serves_the_file()
    time.sleep(1.1)  # a new mtime even on coarse clocks
    make_cert("second")
    deadline = time.monotonic() + 10
    while not serves_the_file():
        assert time.monotonic() < deadline, "the new certificate was not served"
        time.sleep(0.2)
    # Plain HTTP on the TLS port gets nothing useful.
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw:
        raw.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200 OK" not in raw.recv(4096)
