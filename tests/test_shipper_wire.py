"""The shipper's kept-alive connection and its choice of encoding, against real servers on
127.0.0.1: the aggregator's own service, and HTTP/1.1 doubles that close, refuse or never offer."""

from __future__ import annotations

import asyncio
import gzip
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from agent import wire
from agent.clock import FakeClock
from agent.report import Report, decode
from agent.shipper import COMPACT_HOLD_OFF_S, Shipper, offers_compact
from aggregator.auth import StaticTokens
from aggregator.config import Config
from aggregator.service import create_app, server_kwargs
from tests import tls
from tests.test_service import NOW, TOKENS, FakePipeline, make_report
from tests.test_shipper import wait_until

FAST: dict[str, Any] = {"backoff_base_s": 0.01, "backoff_max_s": 0.05, "timeout_s": 5.0}
NODE = "gpu-0001"


def reports(n: int) -> list[Report]:
    return [make_report(NODE, seq) for seq in range(1, n + 1)]


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKENS[NODE] + "\n")
    return path


@pytest.fixture
def shippers() -> Iterator[list[Shipper]]:
    made: list[Shipper] = []
    yield made
    for s in made:
        s.close(timeout_s=0.5)


@pytest.fixture
def make_shipper(shippers: list[Shipper], token_file: Path) -> Callable[..., Shipper]:
    def make(url: str, **kwargs: Any) -> Shipper:
        s = Shipper(url, token_file, FakeClock(NOW), **{**FAST, **kwargs})
        shippers.append(s)
        return s

    return make


# -- the aggregator's own service, in a thread of its own ------------------------------------------


class LiveAggregator:
    """``create_app`` served as ``serve()`` serves it (its keep-alive settings), recording the
    client port and Content-Type of every request: distinct ports are connections."""

    def __init__(self, tmp_path: Path) -> None:
        self.pipeline = FakePipeline()
        self.seen: list[tuple[int, str]] = []
        tokens = tmp_path / "tokens"
        tokens.write_text("".join(f"{node} {token}\n" for node, token in TOKENS.items()))
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self.port = 0
        self._config = Config()
        self._auth = StaticTokens(tokens, recheck_seconds=0.0)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "the aggregator did not start"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        clock = FakeClock(NOW)
        app = create_app(
            self.pipeline, self._auth, self._config, clock, CollectorRegistry(), advance_interval_s=None
        )

        async def record(request: web.Request, response: web.StreamResponse) -> None:
            peer = request.transport.get_extra_info("peername") if request.transport else None
            self.seen.append((peer[1] if peer else -1, request.content_type))

        app.on_response_prepare.append(record)
        runner = web.AppRunner(app, access_log=None, **server_kwargs(self._config.server))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = runner.addresses[0][1]
        self._stop = asyncio.Event()
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()

    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


@pytest.fixture(scope="module")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveAggregator]:
    # One for the module: building the app takes seconds (its status page and detectors).
    agg = LiveAggregator(tmp_path_factory.mktemp("live"))
    yield agg
    agg.stop()


@pytest.fixture
def live(live_server: LiveAggregator) -> LiveAggregator:
    live_server.seen.clear()
    live_server.pipeline.ingested.clear()
    live_server.pipeline.seen.clear()
    return live_server


def test_many_reports_share_one_connection_and_go_compact_once_offered(
    live: LiveAggregator, make_shipper: Callable[..., Shipper]
) -> None:
    shipper = make_shipper(live.url())
    sent = reports(20)
    shipper.submit(sent[0])
    assert shipper.flush(10.0)
    for report in sent[1:]:
        shipper.submit(report)
    assert shipper.flush(10.0)
    assert [wire.as_v1(r) for r, _ in live.pipeline.ingested] == sent
    # One handshake for twenty reports; the server saw them all from one client port.
    assert shipper.connections_opened() == 1
    assert len({port for port, _ in live.seen}) == 1
    # JSON until the first answer offered the compact form, compact from then on.
    types = [ctype for _, ctype in live.seen]
    assert types == ["application/json"] + [wire.COMPACT_MEDIA_TYPE] * 19
    assert shipper.sends_compact()
    assert shipper.stats().failed_attempts_total == 0


def test_json_only_keeps_sending_json_over_one_connection(
    live: LiveAggregator, make_shipper: Callable[..., Shipper]
) -> None:
    shipper = make_shipper(live.url(), wire="json")
    for report in reports(5):
        shipper.submit(report)
    assert shipper.flush(10.0)
    assert {ctype for _, ctype in live.seen} == {"application/json"}
    assert shipper.connections_opened() == 1


# -- doubles: HTTP/1.1 servers that behave as told ---------------------------------------------------


@dataclass
class Double:
    """An HTTP/1.1 aggregator double. ``accept_post``: the header it answers with (None: an
    aggregator from before the compact encoding). ``refuse_compact``: 415 to msgpack bodies.
    ``close``: "header" answers Connection: close, "silent" hangs up after each answer without
    saying so (as an idle timeout firing just then looks to the client)."""

    accept_post: str | None = None
    refuse_compact: bool = False
    close: str = ""
    connections: int = 0
    requests: list[tuple[str, bytes]] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, ssl_context: ssl.SSLContext | None = None) -> None:
        double = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                with double.lock:
                    double.connections += 1

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                ctype = self.headers.get("Content-Type", "")
                with double.lock:
                    double.requests.append((ctype, body))
                compact = ctype == wire.COMPACT_MEDIA_TYPE
                status = 415 if compact and double.refuse_compact else 200
                if status == 200:
                    raw = gzip.decompress(body) if body[:2] == b"\x1f\x8b" else body
                    seq = (wire.decode_compact(raw) if compact else decode(raw)).seq
                    with double.lock:
                        double.accepted.append(seq)
                answer = b'{"status": "accepted"}' if status == 200 else b'{"error": "unsupported"}'
                self.send_response(status)
                if double.accept_post is not None:
                    self.send_header("Accept-Post", double.accept_post)
                if double.close == "header":
                    self.send_header("Connection", "close")
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)
                if double.close:
                    self.close_connection = True

            def log_message(self, format: str, *args: object) -> None:
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: object, client_address: object) -> None:
                pass

        self.server = Server(("127.0.0.1", 0), Handler)
        if ssl_context is not None:
            self.server.socket = ssl_context.wrap_socket(self.server.socket, server_side=True)
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.01,), daemon=True)
        self.thread.start()

    def url(self, scheme: str = "http") -> str:
        return f"{scheme}://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


OFFER = f"application/json, application/msgpack; layout={wire.LAYOUT}"


@pytest.fixture
def doubles() -> Iterator[list[Double]]:
    made: list[Double] = []
    yield made
    for d in made:
        d.stop()


def double(doubles: list[Double], ssl_context: ssl.SSLContext | None = None, **kw: Any) -> Double:
    d = Double(**kw)
    d.start(ssl_context)
    doubles.append(d)
    return d


def send_all(shipper: Shipper, n: int) -> list[int]:
    sent = reports(n)
    for report in sent:
        shipper.submit(report)
    assert shipper.flush(10.0)
    return [r.seq for r in sent]


def test_an_aggregator_from_before_the_compact_encoding_only_ever_gets_json(
    doubles: list[Double], make_shipper: Callable[..., Shipper]
) -> None:
    old = double(doubles)
    shipper = make_shipper(old.url())
    assert old.accepted == [] and send_all(shipper, 6) == old.accepted
    assert {ctype for ctype, _ in old.requests} == {"application/json"}
    assert old.connections == 1 and not shipper.sends_compact()


def test_a_415_to_a_compact_report_resends_it_as_json_at_once_and_is_remembered(
    doubles: list[Double], token_file: Path, shippers: list[Shipper]
) -> None:
    # It offers the compact form but refuses it: a replica of another build behind one Service.
    odd = double(doubles, accept_post=OFFER, refuse_compact=True)
    clock = FakeClock(NOW)
    shipper = Shipper(odd.url(), token_file, clock, **FAST)
    shippers.append(shipper)
    shipper.submit(make_report(NODE, 1))
    assert shipper.flush(10.0)
    assert shipper.sends_compact()  # the answer offered it
    shipper.submit(make_report(NODE, 2))
    assert shipper.flush(10.0)
    # Refused, sent again as JSON at once; then JSON, though every answer still offers it.
    for seq in range(3, 7):
        shipper.submit(make_report(NODE, seq))
        assert shipper.flush(10.0)
    types = [ctype for ctype, _ in odd.requests]
    assert types == ["application/json", wire.COMPACT_MEDIA_TYPE] + ["application/json"] * 5
    assert odd.accepted == [1, 2, 3, 4, 5, 6]  # nothing lost, nothing out of order
    stats = shipper.stats()
    assert (stats.rejected_total, stats.failed_attempts_total) == (0, 0)
    # Past the hold-off the offer is believed again (and refused again, once).
    clock.advance(COMPACT_HOLD_OFF_S)
    for seq in (7, 8, 9):
        shipper.submit(make_report(NODE, seq))
        assert shipper.flush(10.0)
    assert [ctype for ctype, _ in odd.requests][7:] == [
        "application/json",
        wire.COMPACT_MEDIA_TYPE,
        "application/json",
        "application/json",
    ]
    assert odd.accepted[-3:] == [7, 8, 9]


def test_an_offer_of_another_layout_is_not_taken(
    doubles: list[Double], make_shipper: Callable[..., Shipper]
) -> None:
    other = double(doubles, accept_post="application/json, application/msgpack; layout=0123456789abcdef")
    shipper = make_shipper(other.url())
    send_all(shipper, 4)
    assert {ctype for ctype, _ in other.requests} == {"application/json"}


def test_connection_close_is_honoured(doubles: list[Double], make_shipper: Callable[..., Shipper]) -> None:
    closing = double(doubles, accept_post=OFFER, close="header")
    shipper = make_shipper(closing.url())
    assert send_all(shipper, 5) == closing.accepted
    assert closing.connections == shipper.connections_opened() == 5
    assert shipper.stats().failed_attempts_total == 0


def test_a_connection_closed_while_idle_is_retried_at_once_on_a_fresh_one(
    doubles: list[Double], make_shipper: Callable[..., Shipper]
) -> None:
    silent = double(doubles, close="silent")
    waits: list[float] = []
    shipper = make_shipper(silent.url(), backoff_wait=waits.append)
    for report in reports(4):
        shipper.submit(report)
        assert shipper.flush(10.0)
    assert silent.accepted == [1, 2, 3, 4]
    # The dead connection cost a reconnect, never a failed attempt or a backoff.
    assert shipper.stats().failed_attempts_total == 0 and waits == []
    assert shipper.connections_opened() == 4


def test_a_refused_connection_is_still_a_failed_attempt(make_shipper: Callable[..., Shipper]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    shipper = make_shipper(f"http://127.0.0.1:{port}")
    shipper.start()
    shipper.submit(make_report(NODE, 1))
    wait_until(lambda: shipper.stats().failed_attempts_total >= 2)


def test_tls_sessions_are_resumed_on_reconnect(
    tmp_path: Path, doubles: list[Double], make_shipper: Callable[..., Shipper]
) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    tls.self_signed(cert, key)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    closing = double(doubles, ssl_context=ctx, close="header")
    shipper = make_shipper(closing.url("https"), ca_file=cert)
    for report in reports(3):
        shipper.submit(report)
        assert shipper.flush(10.0)
    assert closing.accepted == [1, 2, 3]
    assert shipper.connections_opened() == 3
    assert shipper.tls_sessions_resumed() == 2


@pytest.mark.parametrize(
    ("header", "offered"),
    [
        (None, False),
        ("", False),
        ("application/json", False),
        (OFFER, True),
        (f'application/msgpack;layout="{wire.LAYOUT}"', True),
        (f"APPLICATION/MSGPACK; Layout={wire.LAYOUT}", True),
        ("application/msgpack", False),  # no layout: cannot know its columns
        (f"application/x-msgpack; layout={wire.LAYOUT}", False),
    ],
)
def test_what_counts_as_an_offer(header: str | None, offered: bool) -> None:
    assert offers_compact(header) is offered


def test_the_service_keeps_an_idle_connection_longer_than_an_agents_default_interval() -> None:
    # The agent reports every 10 s by default (agent/cli.py): a keep-alive timeout below that
    # would close every connection between two reports and bring a handshake per report back.
    assert server_kwargs(Config().server)["keepalive_timeout"] > 10.0
