"""The probe loop end to end on loopback: assignments over HTTP, checks, idle guard, reports, replicas."""

from __future__ import annotations

import argparse
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import msgspec
import pytest

from agent.cli import add_arguments, aggregator_urls, probe_advertise, run
from agent.clock import FakeClock, SystemClock
from agent.errors import ConfigError
from agent.gpu.fake import FakeNvml
from agent.gpu.session import NvmlSession
from agent.probes import ProbeContext, build_probes
from agent.probes.base import STEPPED_ASIDE, Cancel, Rendezvous, Support
from agent.probes.client import AggregatorClient
from agent.probes.idle import IdleGuard
from agent.probes.poller import ProbePoller, ProbeResults
from agent.probes.protocol import PROTOCOL, Assignment, AssignmentList, ProbeKind, sign
from agent.probes.tcp import TcpProbeServer
from agent.report import Probe, decode, encode
from agent.runner import Agent
from agent.shipper import Shipper, ShipperFanout

KEY = b"probe-key-for-tests-0123456789"


class Aggregator:
    """A replica's probe and report endpoints on loopback, with canned assignments."""

    def __init__(self, assignments: list[Assignment] | None = None) -> None:
        self.assignments = assignments or []
        self.queries: list[str] = []
        self.auth: list[str | None] = []
        self.reports: list[bytes] = []
        self.rendezvous: dict[str, str] = {}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, status: int, body: bytes = b"{}") -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                outer.queries.append(self.path)
                outer.auth.append(self.headers.get("Authorization"))
                if self.path.startswith("/v1/probes/assignments"):
                    node = self.path.split("node=")[1].split("&")[0]
                    answer = AssignmentList(
                        protocol=PROTOCOL, node=node, assignments=outer.assignments, poll_seconds=1
                    )
                    self._send(200, msgspec.json.encode(answer))
                elif self.path.startswith("/v1/probes/rendezvous/"):
                    key = self.path.split("/")[-1].split("?")[0]
                    if key in outer.rendezvous:
                        self._send(200, json.dumps({"unique_id": outer.rendezvous[key]}).encode())
                    else:
                        self._send(404)
                else:
                    self._send(404)

            def do_PUT(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.rendezvous[self.path.split("/")[-1]] = body["unique_id"]
                self._send(204, b"")

            def do_POST(self) -> None:
                outer.reports.append(self.rfile.read(int(self.headers["Content-Length"])))
                self._send(202)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def aggregators() -> Iterator[list[Aggregator]]:
    made: list[Aggregator] = []
    yield made
    for a in made:
        a.close()


def tcp(
    node: str, peer: str, address: str, *, id: str = "t-1", key: bytes = KEY, deadline_in: float = 20.0
) -> Assignment:
    now = time.time()
    return sign(
        Assignment(
            id=id,
            kind="tcp_pair",
            node=node,
            role="client",
            not_before=now - 1,
            deadline=now + deadline_in,
            size_bytes=1 << 20,
            peer=peer,
            peer_address=address,
        ),
        key,
    )


def token(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text("agent-token\n")
    return path


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def poller_for(
    node: str,
    clients: list[AggregatorClient],
    results: ProbeResults | None = None,
    guard: IdleGuard | None = None,
) -> ProbePoller:
    guard = guard or IdleGuard(None)
    ctx = ProbeContext(node=node, clock=SystemClock(), guard=guard, nccl_tests=None, cupy=None)
    return ProbePoller(
        node=node,
        key=KEY,
        clock=SystemClock(),
        runners=build_probes(ctx),
        guard=guard,
        results=results or ProbeResults(),
        clients=clients,
        advertise="127.0.0.1:7000",
    )


def test_assignments_from_the_leader_run_and_land_in_the_next_report(
    tmp_path: Path, aggregators: list[Aggregator], caplog: pytest.LogCaptureFixture
) -> None:
    server_results = ProbeResults()
    server = TcpProbeServer(
        node="node-b", key=KEY, clock=SystemClock(), host="127.0.0.1", port=0, on_result=server_results.add
    )
    server.start()
    try:
        addr = f"127.0.0.1:{server.address[1]}"
        now = time.time()
        leader = Aggregator(
            [
                tcp("node-a", "node-b", addr),
                tcp("node-a", "node-b", addr, key=b"a-stolen-or-wrong-probe-key"),
                tcp("node-c", "node-b", addr, id="t-2"),
                tcp("node-a", "node-b", addr, id="t-3", deadline_in=-5),
                # The server half of a pair: served by the endpoint, nothing to run here.
                sign(
                    Assignment(
                        id="t-4",
                        kind="tcp_pair",
                        node="node-a",
                        role="server",
                        not_before=now,
                        deadline=now + 9,
                        size_bytes=1,
                        peer="node-z",
                    ),
                    KEY,
                ),
            ]
        )
        follower = Aggregator()
        aggregators += [leader, follower]
        clients = [AggregatorClient(a.url, token(tmp_path)) for a in (leader, follower)]
        clients.append(AggregatorClient(f"http://127.0.0.1:{closed_port()}", token(tmp_path)))
        poller = poller_for("node-a", clients)
        with caplog.at_level(logging.WARNING, logger="agent.probes.poller"):
            assert poller.poll_once(clients[0]) == 1.0
            assert poller.poll_once(clients[1]) == 1.0
            with pytest.raises(Exception, match="ConnectionRefusedError"):
                poller.poll_once(clients[2])
        refused = [
            r.__dict__["reason"] for r in caplog.records if r.getMessage() == "probe assignment refused"
        ]
        assert refused == [
            "bad signature",
            "assignment is for node 'node-c', not 'node-a'",
            refused[2],
        ] and refused[2].startswith("deadline passed")
        assert leader.queries[0] == "/v1/probes/assignments?node=node-a&address=127.0.0.1%3A7000"
        assert leader.auth[0] == "Bearer agent-token"
        # Polling again (or hearing it from another replica) does not queue it twice.
        poller.poll_once(clients[0])
        assert poller.pending() == 1
        assert poller.run_due() == 1

        agent = Agent(node="node-a", collectors=[], clock=FakeClock(), boot_id="b", probes=poller.results)
        report = decode(encode(agent.cycle().report))
        assert report.probes is not msgspec.UNSET
        (probe,) = report.probes
        assert probe.ok and probe.kind == "tcp_pair" and probe.peer == "node-b"
        assert agent.cycle().report.probes is msgspec.UNSET  # taken once
        deadline = time.monotonic() + 5
        while not len(server_results):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        (theirs,), _ = server_results.drain()
        assert theirs.ok and theirs.peer == "node-a"
    finally:
        server.close()


def test_report_carries_at_most_256_probes_and_counts_the_dropped() -> None:
    results = ProbeResults(max_pending=1000)
    for i in range(300):
        results.add(Probe(kind="tcp_pair", time=float(i), ok=True))
    agent = Agent(node="node-a", collectors=[], clock=FakeClock(), boot_id="b", probes=results)
    report = decode(encode(agent.cycle().report))
    assert isinstance(report.probes, tuple) and len(report.probes) == 256
    assert report.probes[0].time == 44.0  # the oldest 44 gave way
    assert isinstance(report.errors, tuple)
    assert [(e.collector, e.message) for e in report.errors] == [
        ("probes", "44 oldest probe results dropped")
    ]
    pending = ProbeResults(max_pending=10)
    for i in range(15):
        pending.add(Probe(kind="tcp_pair", time=float(i), ok=True))
    items, dropped = pending.drain()
    assert [p.time for p in items] == [float(i) for i in range(5, 15)] and dropped == 5


class Waiter:
    """A probe kind that runs until cancelled (or 5 s): stands for a long all-reduce."""

    kind: ProbeKind = "nccl_allreduce_local"

    def supported(self) -> Support:
        return Support(True)

    def child_pids(self) -> tuple[int, ...]:
        return ()

    def run(self, assignment: Assignment, cancel: Cancel, rendezvous: Rendezvous | None = None) -> Probe:
        cancel.wait(5.0)
        return Probe(kind=self.kind, time=time.time(), ok=True, busbw_bytes_per_second=1.0)


def local_assignment() -> Assignment:
    now = time.time()
    return sign(
        Assignment(
            id="l-9",
            kind="nccl_allreduce_local",
            node="node-a",
            role="local",
            not_before=now,
            deadline=now + 30,
            size_bytes=1 << 30,
        ),
        KEY,
    )


def test_idle_guard_reads_processes_and_utilization() -> None:
    fake = FakeNvml({"count": 4})
    guard = IdleGuard(NvmlSession(fake), own_pids=lambda: (111,))
    assert guard.busy() is None
    fake.update(2, {"utilization_gpu": 40})
    assert guard.busy() == "GPU 2 is 40% utilized"
    assert guard.busy(during_probe=True) is None  # the probe itself is the load
    fake.update(2, {"utilization_gpu": 0, "processes": [{"pid": 111, "used_memory": 1 << 30}]})
    assert guard.busy() is None  # our own process
    fake.update(3, {"processes": [{"pid": 4242}, {"pid": 17}]})
    assert guard.busy() == "GPU 3 runs compute process(es) 17, 4242"
    assert guard.busy(exclude=(17, 4242)) is None
    fake.update(1, {"lost": True})
    assert guard.busy() is not None and "GPU 1 state unreadable" in (guard.busy() or "")
    assert IdleGuard(None).busy() is None  # no NVML: nothing to be busy


def test_a_job_starting_mid_probe_makes_it_step_aside() -> None:
    fake = FakeNvml({"count": 2})
    guard = IdleGuard(NvmlSession(fake))
    poller = ProbePoller(
        node="node-a",
        key=KEY,
        clock=SystemClock(),
        runners=[Waiter()],
        guard=guard,
        results=ProbeResults(),
        watch_interval_s=0.05,
    )
    threading.Timer(0.2, fake.update, args=(1, {"processes": [{"pid": 999999}]})).start()
    started = time.monotonic()
    probe = poller.run_now(local_assignment())
    assert time.monotonic() - started < 3
    assert probe is not None and not probe.ok and probe.error == STEPPED_ASIDE
    assert probe.busbw_bytes_per_second is None
    # Busy before it starts: skipped, said so, and never run.
    probe = poller.run_now(local_assignment())
    assert probe is not None and probe.error == "skipped: GPUs busy: GPU 1 runs compute process(es) 999999"


def test_unsupported_kind_is_a_state_said_once_not_a_failure(caplog: pytest.LogCaptureFixture) -> None:
    guard = IdleGuard(NvmlSession(FakeNvml({"count": 8})))
    poller = poller_for("node-a", [], guard=guard)
    with caplog.at_level(logging.INFO, logger="agent.probes.poller"):
        assert poller.run_now(local_assignment()) is None
        assert poller.run_now(local_assignment()) is None
    said = [r for r in caplog.records if r.getMessage() == "probe kind not supported here"]
    assert len(said) == 1 and said[0].__dict__["kind"] == "nccl_allreduce_local"
    assert len(poller.results) == 0


def test_rendezvous_over_http(aggregators: list[Aggregator], tmp_path: Path) -> None:
    agg = Aggregator()
    aggregators.append(agg)
    client = AggregatorClient(agg.url, token(tmp_path))
    assert client.fetch_unique_id("pair-1", "node-b") is None
    client.publish_unique_id("pair-1", "node-a", "ab" * 128)
    assert client.fetch_unique_id("pair-1", "node-b") == "ab" * 128


def test_every_report_goes_to_every_replica_and_a_dead_one_delays_nobody(
    aggregators: list[Aggregator],
) -> None:
    up = Aggregator()
    aggregators.append(up)
    down_url = f"http://127.0.0.1:{closed_port()}"
    clock = SystemClock()
    fanout = ShipperFanout(
        [Shipper(up.url, None, clock), Shipper(down_url, None, clock, backoff_base_s=5, backoff_max_s=5)]
    )
    fanout.start()
    try:
        agent = Agent(node="node-a", collectors=[], clock=FakeClock(), boot_id="b")
        for _ in range(3):
            fanout.submit(agent.cycle().report)
        assert fanout.shippers[0].flush(5.0)
        assert len(up.reports) == 3
        stats = fanout.stats()
        assert stats.sent_total == 3 and stats.spool_depth >= 2
        assert stats.last_success_time is None  # one replica has never taken a report
    finally:
        fanout.close(timeout_s=0.5)


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_cli_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = parse("--aggregator", "http://a:8080", "--aggregator", "http://b:8080")
    assert aggregator_urls(args) == ["http://a:8080", "http://b:8080"]
    assert args.aggregator == "http://a:8080"  # single-URL callers keep working
    assert parse().probes == "off"
    with pytest.raises(ConfigError, match="twice"):
        aggregator_urls(parse("--aggregator", "http://a:1", "--aggregator", "http://a:1"))
    monkeypatch.delenv("POD_IP", raising=False)
    assert probe_advertise(None, ("10.0.0.5", 7000)) == "10.0.0.5:7000"
    with pytest.raises(ConfigError, match="POD_IP"):
        probe_advertise(None, ("0.0.0.0", 7000))
    monkeypatch.setenv("POD_IP", "10.1.2.3")
    assert probe_advertise(None, ("0.0.0.0", 7000)) == "10.1.2.3:7000"
    assert probe_advertise("node-a.example:7100", ("0.0.0.0", 7000)) == "node-a.example:7100"
    base = [
        "--gpu-backend",
        "none",
        "--aggregator",
        "http://127.0.0.1:1",
        "--token-file",
        str(token(tmp_path)),
    ]
    with pytest.raises(ConfigError, match="--probe-key-file"):
        run(parse(*base, "--probes", "auto", "--probe-listen", "127.0.0.1:0"))
    short = tmp_path / "key"
    short.write_text("short")
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        run(parse(*base, "--probes", "auto", "--probe-listen", "127.0.0.1:0", "--probe-key-file", str(short)))
    with pytest.raises(ConfigError, match="needs --aggregator"):
        run(parse("--gpu-backend", "none", "--probes", "auto"))
