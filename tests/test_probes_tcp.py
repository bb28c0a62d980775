"""tcp_pair on loopback, for real: two agents' worth of client and server in this process."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator

import msgspec
import pytest

from agent.clock import SystemClock
from agent.probes.base import Cancel
from agent.probes.protocol import Assignment, sign
from agent.probes.tcp import TcpPairProbe, TcpProbeServer
from agent.report import Probe

KEY = b"probe-key-for-tests-0123456789"
MIB = 1 << 20


def assignment(
    *,
    peer_address: str,
    id: str = "p-1",
    client: str = "node-a",
    server: str = "node-b",
    size: int = 8 * MIB,
    deadline_in: float = 10.0,
    not_before_in: float = 0.0,
    key: bytes = KEY,
) -> Assignment:
    now = time.time()
    return sign(
        Assignment(
            id=id,
            kind="tcp_pair",
            node=client,
            role="client",
            not_before=now + not_before_in,
            deadline=now + deadline_in,
            size_bytes=size,
            peer=server,
            peer_address=peer_address,
        ),
        key,
    )


class Rate:
    """Makes the server read at most ``bytes_per_second`` (an upper bound: sleeping never speeds up)."""

    def __init__(self, bytes_per_second: float) -> None:
        self.rate = bytes_per_second

    def __call__(self, n: int) -> None:
        time.sleep(n / self.rate)


@pytest.fixture
def serve() -> Iterator[Callable[..., tuple[TcpProbeServer, list[Probe]]]]:
    servers: list[TcpProbeServer] = []

    def make(
        node: str = "node-b",
        on_read: Callable[[int], None] | None = None,
        busy: Callable[[], str | None] | None = None,
    ) -> tuple[TcpProbeServer, list[Probe]]:
        results: list[Probe] = []
        server = TcpProbeServer(
            node=node,
            key=KEY,
            clock=SystemClock(),
            host="127.0.0.1",
            port=0,
            on_result=results.append,
            on_read=on_read,
            busy=busy,
        )
        server.start()
        servers.append(server)
        return server, results

    yield make
    for server in servers:
        server.close()


def address(server: TcpProbeServer) -> str:
    host, port = server.address
    return f"{host}:{port}"


def wait_for(results: list[Probe], count: int = 1) -> None:
    deadline = time.monotonic() + 10
    while len(results) < count:
        assert time.monotonic() < deadline, "server recorded no result"
        time.sleep(0.01)


def raw_handshake(server: TcpProbeServer, line: bytes) -> str:
    with socket.create_connection(server.address, timeout=5) as sock:
        sock.sendall(line + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
        return data.decode().strip()


def test_transfer_is_timed_at_both_ends(serve: Callable[..., tuple[TcpProbeServer, list[Probe]]]) -> None:
    server, server_results = serve()
    client = TcpPairProbe(node="node-a", clock=SystemClock())
    probe = client.run(assignment(peer_address=address(server)), Cancel())
    assert probe.ok, probe.error
    assert probe.kind == "tcp_pair" and probe.peer == "node-b" and probe.size_bytes == 8 * MIB
    assert probe.busbw_bytes_per_second is not None and probe.busbw_bytes_per_second > 50e6
    assert probe.duration_seconds is not None and probe.duration_seconds > 0
    wait_for(server_results)
    (mine,) = server_results
    assert mine.ok and mine.peer == "node-a" and mine.size_bytes == 8 * MIB
    assert mine.busbw_bytes_per_second is not None and mine.busbw_bytes_per_second > 50e6
    # The results go into reports as they are: they must be valid report probes.
    for p in (probe, mine):
        assert msgspec.json.decode(msgspec.json.encode(p), type=Probe) == p


def test_a_slow_server_gives_a_lower_throughput(
    serve: Callable[..., tuple[TcpProbeServer, list[Probe]]],
) -> None:
    fast, _ = serve()
    slow, slow_results = serve(on_read=Rate(16 * MIB))
    client = TcpPairProbe(node="node-a", clock=SystemClock())
    quick = client.run(assignment(id="fast", peer_address=address(fast), size=4 * MIB), Cancel())
    throttled = client.run(assignment(id="slow", peer_address=address(slow), size=4 * MIB), Cancel())
    assert quick.ok and throttled.ok, (quick.error, throttled.error)
    assert quick.busbw_bytes_per_second is not None and throttled.busbw_bytes_per_second is not None
    assert throttled.busbw_bytes_per_second < 16 * MIB * 1.05
    assert quick.busbw_bytes_per_second > 3 * throttled.busbw_bytes_per_second
    wait_for(slow_results)
    assert slow_results[0].busbw_bytes_per_second is not None
    assert slow_results[0].busbw_bytes_per_second < 16 * MIB * 1.05


def test_deadline_ends_the_probe_with_an_error(
    serve: Callable[..., tuple[TcpProbeServer, list[Probe]]],
) -> None:
    server, server_results = serve(on_read=Rate(2 * MIB))
    client = TcpPairProbe(node="node-a", clock=SystemClock())
    started = time.monotonic()
    probe = client.run(assignment(peer_address=address(server), size=64 * MIB, deadline_in=0.6), Cancel())
    assert time.monotonic() - started < 3.0
    assert not probe.ok
    assert probe.error == "deadline exceeded"
    assert probe.busbw_bytes_per_second is None and probe.peer == "node-b"
    wait_for(server_results)
    assert not server_results[0].ok


def test_unreachable_peer_is_a_failed_result() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the block ends: nobody listens there
    probe = TcpPairProbe(node="node-a", clock=SystemClock()).run(
        assignment(peer_address=f"127.0.0.1:{port}"), Cancel()
    )
    assert not probe.ok and probe.error is not None and "cannot connect" in probe.error


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda addr: assignment(peer_address=addr, key=b"another-key-of-enough-length"), "bad signature"),
        (lambda addr: assignment(peer_address=addr, server="node-c"), "names peer 'node-c'"),
        (lambda addr: assignment(peer_address=addr, deadline_in=-1.0), "deadline passed"),
        (lambda addr: assignment(peer_address=addr, not_before_in=60.0), "too early"),
    ],
    ids=["wrong-signature", "another-node", "expired", "early"],
)
def test_server_refuses(
    serve: Callable[..., tuple[TcpProbeServer, list[Probe]]], make: Callable[[str], Assignment], reason: str
) -> None:
    server, results = serve()
    answer = raw_handshake(server, msgspec.json.encode(make(address(server))))
    assert answer.startswith("ERR ") and reason in answer
    assert results == []  # a refusal is not a measurement


def test_client_reports_the_refusal(serve: Callable[..., tuple[TcpProbeServer, list[Probe]]]) -> None:
    server, _ = serve(node="node-x")
    probe = TcpPairProbe(node="node-a", clock=SystemClock()).run(
        assignment(peer_address=address(server)), Cancel()
    )
    assert not probe.ok and probe.error is not None and probe.error.startswith("peer refused:")


def test_an_assignment_serves_once(serve: Callable[..., tuple[TcpProbeServer, list[Probe]]]) -> None:
    server, _ = serve()
    a = assignment(peer_address=address(server), size=MIB)
    client = TcpPairProbe(node="node-a", clock=SystemClock())
    assert client.run(a, Cancel()).ok
    replay = client.run(a, Cancel())
    assert not replay.ok and replay.error is not None and "already used" in replay.error


def test_garbage_and_server_assignments_are_refused(
    serve: Callable[..., tuple[TcpProbeServer, list[Probe]]],
) -> None:
    server, _ = serve()
    assert raw_handshake(server, b"hello").startswith("ERR bad assignment")
    server_side = json.loads(msgspec.json.encode(assignment(peer_address=address(server))))
    server_side["role"] = "server"
    assert "bad signature" in raw_handshake(server, json.dumps(server_side).encode())


def test_a_busy_server_refuses(serve: Callable[..., tuple[TcpProbeServer, list[Probe]]]) -> None:
    server, results = serve(busy=lambda: "GPU 0 runs compute process(es) 77")
    probe = TcpPairProbe(node="node-a", clock=SystemClock()).run(
        assignment(peer_address=address(server)), Cancel()
    )
    assert not probe.ok and probe.error is not None and "busy: GPU 0" in probe.error
    assert results == []


def test_cancel_stops_the_client(serve: Callable[..., tuple[TcpProbeServer, list[Probe]]]) -> None:
    server, _ = serve(on_read=Rate(4 * MIB))
    cancel = Cancel()
    cancel.set("stepped aside: a job started")
    probe = TcpPairProbe(node="node-a", clock=SystemClock()).run(
        assignment(peer_address=address(server)), cancel
    )
    assert not probe.ok and probe.error == "stepped aside: a job started"
