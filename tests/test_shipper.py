"""The shipper against a real HTTP server on 127.0.0.1 that can be told to fail, hang or refuse."""

from __future__ import annotations

import email.utils
import gzip
import itertools
import logging
import os
import random
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from agent.clock import FakeClock
from agent.errors import ConfigError
from agent.report import Report, decode
from agent.shipper import RETRY_AFTER_MAX_S, Shipper, encode_body, parse_retry_after
from tests import tls
from tests.ports import free_port

FAST = {"backoff_base_s": 0.01, "backoff_max_s": 0.05, "timeout_s": 2.0}


def make_report(seq: int, node: str = "node-1") -> Report:
    return Report(
        schema="gpuwarden/report/v1",
        node=node,
        time=1_764_441_600.0 + seq,
        seq=seq,
        boot_id="b",
        gpus=(),
        nics=(),
    )


@dataclass(frozen=True)
class Request:
    path: str
    headers: dict[str, str]
    body: bytes

    @property
    def token(self) -> str | None:
        auth = self.headers.get("authorization")
        return auth.removeprefix("Bearer ") if auth else None

    @property
    def seq(self) -> int:
        return decode(gzip.decompress(self.body)).seq


@dataclass(frozen=True)
class Reply:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    hang_s: float = 0.0  # hold the request this long, then close without answering


class FakeAggregator:
    """Records every POST; ``respond`` decides each answer (default 200)."""

    def __init__(self, port: int = 0, ssl_context: ssl.SSLContext | None = None) -> None:
        self.requests: list[Request] = []
        self.accepted: list[Request] = []
        self.respond: Callable[[Request], Reply] = lambda _req: Reply()
        self.release = threading.Event()
        self._lock = threading.Lock()
        agg = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                req = Request(self.path, {k.lower(): v for k, v in self.headers.items()}, body)
                reply = agg.respond(req)
                with agg._lock:
                    agg.requests.append(req)
                if reply.hang_s:
                    agg.release.wait(reply.hang_s)
                    self.close_connection = True
                    return
                if 200 <= reply.status < 300:
                    with agg._lock:
                        agg.accepted.append(req)
                self.send_response(reply.status)
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(reply.body)))
                self.end_headers()
                self.wfile.write(reply.body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: object, client_address: object) -> None:
                # A client that timed out and hung up is the point of some tests, not a failure.
                pass

        self.server = Server(("127.0.0.1", port), Handler)
        if ssl_context is not None:
            self.server.socket = ssl_context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.01,), daemon=True)
        self.thread.start()

    def url(self, scheme: str = "http") -> str:
        return f"{scheme}://127.0.0.1:{self.port}"

    def accepted_seqs(self) -> list[int]:
        with self._lock:
            return [r.seq for r in self.accepted]

    def seqs_tried(self) -> list[int]:
        with self._lock:
            return [r.seq for r in self.requests]

    def stop(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def wait_until(pred: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


class TopOfRange(random.Random):
    """Full jitter always picking the cap, so the backoff schedule itself is visible."""

    def random(self) -> float:
        return 1.0


@pytest.fixture
def aggregator() -> Iterator[FakeAggregator]:
    agg = FakeAggregator()
    yield agg
    agg.stop()


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text("token-one\n")
    return path


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def shippers() -> Iterator[list[Shipper]]:
    made: list[Shipper] = []
    yield made
    for s in made:
        s.close(timeout_s=0.2)


@pytest.fixture
def make_shipper(shippers: list[Shipper], token_file: Path, clock: FakeClock) -> Callable[..., Shipper]:
    def make(url: str, **kwargs: object) -> Shipper:
        options: dict[str, object] = {**FAST, **kwargs}
        s = Shipper(url, options.pop("token_file", token_file), clock, **options)  # type: ignore[arg-type]
        shippers.append(s)
        return s

    return make


def rotate(path: Path, token: str) -> None:
    """Replace the token the way the kubelet does: a new file swapped in atomically."""
    new = path.with_name(path.name + ".new")
    new.write_text(token)
    os.replace(new, path)


# -- (1) the happy path -------------------------------------------------------------------------


def test_delivers_gzip_json_with_bearer_token(
    aggregator: FakeAggregator, make_shipper: Callable[..., Shipper], clock: FakeClock
) -> None:
    shipper = make_shipper(aggregator.url())
    shipper.start()
    report = make_report(7)
    shipper.submit(report)
    assert shipper.flush(timeout_s=3.0)

    [req] = aggregator.requests
    assert req.path == "/v1/reports"
    assert req.headers["content-type"] == "application/json"
    assert req.headers["content-encoding"] == "gzip"
    assert req.body[:2] == b"\x1f\x8b"
    assert decode(gzip.decompress(req.body)) == report
    assert req.token == "token-one"
    stats = shipper.stats()
    assert (stats.sent_total, stats.spooled_total, stats.spool_depth) == (1, 1, 0)
    assert (stats.failed_attempts_total, stats.rejected_total, stats.dropped_total) == (0, 0, 0)
    assert stats.last_success_time == clock.time()


def test_base_url_path_is_kept(aggregator: FakeAggregator, make_shipper: Callable[..., Shipper]) -> None:
    shipper = make_shipper(aggregator.url() + "/gpuwarden/")
    shipper.submit(make_report(0))
    assert shipper.flush(timeout_s=3.0)
    assert [r.path for r in aggregator.requests] == ["/gpuwarden/v1/reports"]


def test_rotated_token_is_picked_up_and_a_missing_file_keeps_the_last_one(
    aggregator: FakeAggregator, make_shipper: Callable[..., Shipper], token_file: Path
) -> None:
    shipper = make_shipper(aggregator.url())
    shipper.start()
    shipper.submit(make_report(0))
    assert shipper.flush(timeout_s=3.0)

    rotate(token_file, "token-two")
    shipper.submit(make_report(1))
    assert shipper.flush(timeout_s=3.0)

    # Mid-rotation the file can be briefly gone or empty: delivery goes on with the last token.
    token_file.unlink()
    shipper.submit(make_report(2))
    assert shipper.flush(timeout_s=3.0)
    token_file.write_text("")
    shipper.submit(make_report(3))
    assert shipper.flush(timeout_s=3.0)

    rotate(token_file, "token-three")
    shipper.submit(make_report(4))
    assert shipper.flush(timeout_s=3.0)

    assert [r.token for r in aggregator.accepted] == [
        "token-one",
        "token-two",
        "token-two",
        "token-two",
        "token-three",
    ]
    assert shipper.stats().sent_total == 5


def test_401_keeps_the_report_and_rereads_the_token(
    aggregator: FakeAggregator, make_shipper: Callable[..., Shipper], token_file: Path
) -> None:
    aggregator.respond = lambda req: Reply() if req.token == "token-new" else Reply(401)
    before = os.stat(token_file)
    shipper = make_shipper(aggregator.url())
    shipper.start()
    shipper.submit(make_report(0))
    wait_until(lambda: shipper.stats().failed_attempts_total >= 2)

    # Same inode, same size, same mtime: only the 401 can tell the shipper to look again.
    token_file.write_text("token-new\n")
    os.utime(token_file, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(token_file)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino,
        before.st_size,
        before.st_mtime_ns,
    )

    assert shipper.flush(timeout_s=3.0)
    assert aggregator.accepted_seqs() == [0]
    assert aggregator.accepted[0].token == "token-new"
    stats = shipper.stats()
    assert stats.rejected_total == 0
    assert stats.sent_total == 1


@pytest.mark.parametrize("status", [401, 403])
def test_a_one_shot_run_takes_a_refused_token_as_final(
    aggregator: FakeAggregator, make_shipper: Callable[..., Shipper], status: int
) -> None:
    body = b'{"error": "bad_token", "message": "unknown bearer token"}'
    aggregator.respond = lambda _req: Reply(status, body=body)
    shipper = make_shipper(aggregator.url(), credentials_final=True, backoff_base_s=5.0, backoff_max_s=5.0)
    shipper.submit(make_report(0))
    started = time.monotonic()
    assert shipper.flush(timeout_s=10.0)  # settled: nothing left to retry
    assert time.monotonic() - started < 4.0  # never waited out a backoff
    assert aggregator.seqs_tried() == [0]  # asked once, not again
    refusal = shipper.refusal()
    assert refusal is not None and (refusal.status, refusal.url) == (status, aggregator.url())
    assert str(refusal) == (
        f"aggregator {aggregator.url()} refused the agent's token: "
        f"HTTP {status}: unknown bearer token (bad_token)"
    )
    assert shipper.stats().rejected_total == 1


def test_a_long_running_agent_never_takes_a_refused_token_as_final(
    aggregator: FakeAggregator, make_shipper: Callable[..., Shipper]
) -> None:
    answers = iter([401, 200])
    aggregator.respond = lambda _req: Reply(next(answers))
    shipper = make_shipper(aggregator.url())
    shipper.submit(make_report(0))
    assert shipper.flush(timeout_s=3.0)
    assert shipper.refusal() is None and aggregator.accepted_seqs() == [0]


# -- (2) outages --------------------------------------------------------------------------------


def test_503_outage_loses_nothing_and_keeps_order(
    aggregator: FakeAggregator, make_shipper: Callable[..., Shipper]
) -> None:
    up = threading.Event()
    aggregator.respond = lambda _req: Reply() if up.is_set() else Reply(503, body=b"overloaded")
    shipper = make_shipper(aggregator.url())
    shipper.start()
    for seq in range(6):
        shipper.submit(make_report(seq))
        time.sleep(0.01)
    wait_until(lambda: shipper.stats().failed_attempts_total >= 3)
    assert aggregator.accepted_seqs() == []
    assert shipper.stats().spool_depth == 6

    up.set()
    assert shipper.flush(timeout_s=3.0)
    assert aggregator.accepted_seqs() == list(range(6))
    stats = shipper.stats()
    assert (stats.sent_total, stats.dropped_total, stats.rejected_total, stats.spool_depth) == (6, 0, 0, 0)
    assert stats.failed_attempts_total >= 3


def test_aggregator_down_then_back_delivers_everything_in_order(
    make_shipper: Callable[..., Shipper],
) -> None:
    port = free_port()
    shipper = make_shipper(f"http://127.0.0.1:{port}")
    shipper.start()
    for seq in range(4):
        shipper.submit(make_report(seq))
    wait_until(lambda: shipper.stats().failed_attempts_total >= 3)
    assert not shipper.flush(timeout_s=0.05)

    agg = FakeAggregator(port=port)
    try:
        assert shipper.flush(timeout_s=3.0)
        assert agg.accepted_seqs() == [0, 1, 2, 3]
        assert shipper.stats().sent_total == 4
    finally:
        agg.stop()


# -- (3) the spool bound ------------------------------------------------------------------------


def test_spool_count_bound_drops_the_oldest(
    aggregator: FakeAggregator, make_shipper: Callable[..., Shipper]
) -> None:
    up = threading.Event()
    aggregator.respond = lambda _req: Reply() if up.is_set() else Reply(503)
    shipper = make_shipper(aggregator.url(), max_spool_reports=3)
    shipper.start()
    for seq in range(10):
        shipper.submit(make_report(seq))
    # The report on the wire when the spool overflowed is dropped once that attempt fails.
    wait_until(lambda: shipper.stats().dropped_total == 7)
    assert shipper.stats().spool_depth == 3

    up.set()
    assert shipper.flush(timeout_s=3.0)
    assert aggregator.accepted_seqs() == [7, 8, 9]
    stats = shipper.stats()
    assert (stats.spooled_total, stats.dropped_total, stats.sent_total) == (10, 7, 3)


def test_spool_byte_bound_drops_the_oldest(
    aggregator: FakeAggregator, make_shipper: Callable[..., Shipper]
) -> None:
    sizes = [len(encode_body(make_report(seq))) for seq in range(6)]
    # Room for the last two reports, not for a third.
    up = threading.Event()
    aggregator.respond = lambda _req: Reply() if up.is_set() else Reply(503)
    shipper = make_shipper(aggregator.url(), max_spool_bytes=sizes[4] + sizes[5] + min(sizes) // 2)
    shipper.start()
    for seq in range(6):
        shipper.submit(make_report(seq))
    wait_until(lambda: shipper.stats().dropped_total == 4)

    up.set()
    assert shipper.flush(timeout_s=3.0)
    assert aggregator.accepted_seqs() == [4, 5]


# -- (4) backoff --------------------------------------------------------------------------------


def test_backoff_grows_exponentially_is_capped_and_resets_after_success(
    aggregator: FakeAggregator, make_shipper: Callable[..., Shipper]
) -> None:
    # 503 three times, accept, then 503 twice, accept.
    answers = iter([503, 503, 503, 200, 503, 503, 200])
    aggregator.respond = lambda _req: Reply(next(answers))
    delays: list[float] = []
    shipper = make_shipper(
        aggregator.url(),
        backoff_base_s=0.1,
        backoff_max_s=0.3,
        rng=TopOfRange(),
        backoff_wait=delays.append,
    )
    shipper.start()
    shipper.submit(make_report(0))
    assert shipper.flush(timeout_s=3.0)
    shipper.submit(make_report(1))
    assert shipper.flush(timeout_s=3.0)

    assert delays == pytest.approx([0.1, 0.2, 0.3, 0.1, 0.2])
    assert aggregator.seqs_tried() == [0, 0, 0, 0, 1, 1, 1]
    assert shipper.stats().failed_attempts_total == 5


def test_backoff_is_fully_jittered_under_the_cap(
    aggregator: FakeAggregator, make_shipper: Callable[..., Shipper]
) -> None:
    aggregator.respond = lambda _req: Reply(503)
    delays: list[float] = []
    shipper = make_shipper(
        aggregator.url(),
        backoff_base_s=0.1,
        backoff_max_s=1.0,
        rng=random.Random(7),
        backoff_wait=delays.append,
    )
    shipper.start()
    shipper.submit(make_report(0))
    wait_until(lambda: len(delays) >= 12)
    caps = [min(1.0, 0.1 * 2**n) for n in range(12)]
    assert all(0.0 <= d <= cap for d, cap in zip(delays, caps, strict=False))
    assert any(d < cap * 0.9 for d, cap in zip(delays, caps, strict=False))
    assert len(set(delays[5:12])) == 7  # past the cap the delays still differ


def test_real_waits_between_attempts_grow(
    aggregator: FakeAggregator, make_shipper: Callable[..., Shipper]
) -> None:
    aggregator.respond = lambda _req: Reply(503)
    seen: list[float] = []
    respond = aggregator.respond

    def timed(req: Request) -> Reply:
        seen.append(time.monotonic())
        return respond(req)

    aggregator.respond = timed
    shipper = make_shipper(aggregator.url(), backoff_base_s=0.02, backoff_max_s=0.16, rng=TopOfRange())
    shipper.start()
    shipper.submit(make_report(0))
    wait_until(lambda: len(seen) >= 5)
    gaps = [b - a for a, b in itertools.pairwise(seen)][:4]
    for gap, expected in zip(gaps, [0.02, 0.04, 0.08, 0.16], strict=True):
        assert gap >= expected * 0.9


# -- (5) permanent refusals ---------------------------------------------------------------------


@pytest.mark.parametrize("status", [400, 413, 422])
def test_4xx_is_not_retried_and_counted_as_rejected(
    aggregator: FakeAggregator,
    make_shipper: Callable[..., Shipper],
    caplog: pytest.LogCaptureFixture,
    status: int,
) -> None:
    aggregator.respond = lambda req: (
        Reply(status, body=b"report does not match: $.gpus[0].index") if req.seq == 0 else Reply()
    )
    shipper = make_shipper(aggregator.url())
    shipper.start()
    with caplog.at_level(logging.ERROR, logger="agent.shipper"):
        shipper.submit(make_report(0))
        shipper.submit(make_report(1))
        assert shipper.flush(timeout_s=3.0)

    assert aggregator.seqs_tried() == [0, 1]
    assert aggregator.accepted_seqs() == [1]
    stats = shipper.stats()
    assert (stats.rejected_total, stats.sent_total, stats.failed_attempts_total) == (1, 1, 0)
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert record.__dict__["http_status"] == status
    assert "$.gpus[0].index" in record.__dict__["server_reason"]
    assert record.__dict__["report_seq"] == 0


@pytest.mark.parametrize("status", [408, 500, 502, 403, 307])
def test_other_failures_are_retried(
    aggregator: FakeAggregator, make_shipper: Callable[..., Shipper], status: int
) -> None:
    answers = iter([status, 200])
    aggregator.respond = lambda _req: Reply(next(answers))
    shipper = make_shipper(aggregator.url())
    shipper.submit(make_report(0))
    assert shipper.flush(timeout_s=3.0)
    assert aggregator.seqs_tried() == [0, 0]
    stats = shipper.stats()
    assert (stats.sent_total, stats.failed_attempts_total, stats.rejected_total) == (1, 1, 0)


# -- (6) Retry-After ----------------------------------------------------------------------------


def test_429_retry_after_seconds_is_honoured(
    aggregator: FakeAggregator, make_shipper: Callable[..., Shipper]
) -> None:
    answers = iter([Reply(429, {"Retry-After": "7"}), Reply()])
    aggregator.respond = lambda _req: next(answers)
    delays: list[float] = []
    shipper = make_shipper(aggregator.url(), backoff_wait=delays.append)
    shipper.submit(make_report(0))
    assert shipper.flush(timeout_s=3.0)
    assert delays == [7.0]
    assert aggregator.accepted_seqs() == [0]


def test_503_retry_after_date_is_honoured_and_huge_values_capped(
    aggregator: FakeAggregator, make_shipper: Callable[..., Shipper], clock: FakeClock
) -> None:
    when = email.utils.formatdate(clock.time() + 30, usegmt=True)
    answers = iter([Reply(503, {"Retry-After": when}), Reply(503, {"Retry-After": "86400"}), Reply()])
    aggregator.respond = lambda _req: next(answers)
    delays: list[float] = []
    shipper = make_shipper(aggregator.url(), backoff_wait=delays.append)
    shipper.submit(make_report(0))
    assert shipper.flush(timeout_s=3.0)
    assert delays == pytest.approx([30.0, RETRY_AFTER_MAX_S])


def test_parse_retry_after() -> None:
    now = 1_764_441_600.0
    assert parse_retry_after("120", now) == 120.0
    assert parse_retry_after(" 3 ", now) == 3.0
    assert parse_retry_after(email.utils.formatdate(now + 90, usegmt=True), now) == 90.0
    assert parse_retry_after(email.utils.formatdate(now - 90, usegmt=True), now) == 0.0
    assert parse_retry_after("-5", now) == 0.0
    for junk in (None, "", "soon", "nan", "inf"):
        assert parse_retry_after(junk, now) is None


# -- (7) timeouts -------------------------------------------------------------------------------


def test_hanging_server_times_out_and_the_report_is_retried(
    aggregator: FakeAggregator, make_shipper: Callable[..., Shipper]
) -> None:
    answers = iter([Reply(hang_s=5.0), Reply()])
    aggregator.respond = lambda _req: next(answers)
    shipper = make_shipper(aggregator.url(), timeout_s=0.2)
    shipper.submit(make_report(0))
    started = time.monotonic()
    assert shipper.flush(timeout_s=3.0)
    assert time.monotonic() - started < 2.0
    assert aggregator.seqs_tried() == [0, 0]
    assert aggregator.accepted_seqs() == [0]
    stats = shipper.stats()
    assert (stats.failed_attempts_total, stats.sent_total) == (1, 1)


# -- start and close ----------------------------------------------------------------------------


def test_close_flushes_the_spool_without_waiting_out_a_long_backoff(
    aggregator: FakeAggregator, make_shipper: Callable[..., Shipper]
) -> None:
    answers = iter([Reply(503), Reply(), Reply(), Reply()])
    aggregator.respond = lambda _req: next(answers)
    shipper = make_shipper(aggregator.url(), backoff_base_s=30.0, backoff_max_s=30.0, rng=TopOfRange())
    shipper.start()
    for seq in range(3):
        shipper.submit(make_report(seq))
    wait_until(lambda: shipper.stats().failed_attempts_total == 1)

    started = time.monotonic()
    shipper.close(timeout_s=3.0)
    assert time.monotonic() - started < 1.0
    assert aggregator.accepted_seqs() == [0, 1, 2]

    shipper.submit(make_report(3))
    stats = shipper.stats()
    assert (stats.dropped_total, stats.spool_depth) == (1, 0)
    assert aggregator.accepted_seqs() == [0, 1, 2]


def test_close_gives_up_after_its_timeout_when_the_aggregator_stays_down(
    aggregator: FakeAggregator, make_shipper: Callable[..., Shipper]
) -> None:
    aggregator.respond = lambda _req: Reply(503)
    shipper = make_shipper(aggregator.url(), backoff_base_s=30.0, backoff_max_s=30.0, rng=TopOfRange())
    shipper.start()
    shipper.submit(make_report(0))
    wait_until(lambda: shipper.stats().failed_attempts_total == 1)
    started = time.monotonic()
    shipper.close(timeout_s=0.3)
    assert time.monotonic() - started < 1.5
    assert shipper.stats().spool_depth == 1


def test_flush_starts_the_sender_for_one_shot_use(
    aggregator: FakeAggregator, make_shipper: Callable[..., Shipper]
) -> None:
    shipper = make_shipper(aggregator.url())
    shipper.submit(make_report(0))
    assert shipper.flush(timeout_s=3.0)
    assert aggregator.accepted_seqs() == [0]


def test_no_token_file_sends_no_authorization(
    aggregator: FakeAggregator, make_shipper: Callable[..., Shipper]
) -> None:
    shipper = make_shipper(aggregator.url(), token_file=None)
    shipper.submit(make_report(0))
    assert shipper.flush(timeout_s=3.0)
    assert "authorization" not in aggregator.requests[0].headers


@pytest.mark.parametrize("content", [None, "", "  \n", "two\nlines"])
def test_unusable_token_file_is_a_config_error_at_start(
    tmp_path: Path, clock: FakeClock, content: str | None
) -> None:
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    shipper = Shipper("http://127.0.0.1:9", path, clock)
    with pytest.raises(ConfigError, match="token file"):
        shipper.start()


@pytest.mark.parametrize(
    "url",
    [
        "ftp://aggregator/",
        "aggregator:8080",
        "/v1/reports",
        "http://",
        "http://aggregator:notaport",
        "http://user:secret@aggregator",
        "http://aggregator/?x=1",
        "http://aggregator/#frag",
    ],
)
def test_bad_url_is_a_config_error(url: str, clock: FakeClock) -> None:
    with pytest.raises(ConfigError, match="aggregator URL"):
        Shipper(url, None, clock)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"timeout_s": 0},
        {"max_spool_reports": 0},
        {"max_spool_bytes": 0},
        {"backoff_base_s": 0},
        {"backoff_base_s": 5.0, "backoff_max_s": 1.0},
        {"ca_file": Path("/nonexistent/ca.pem")},
    ],
)
def test_bad_settings_are_config_errors(kwargs: dict[str, object], clock: FakeClock) -> None:
    url = "https://aggregator" if "ca_file" in kwargs else "http://aggregator"
    with pytest.raises(ConfigError):
        Shipper(url, None, clock, **kwargs)  # type: ignore[arg-type]


# -- https --------------------------------------------------------------------------------------


@pytest.fixture
def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    tls.self_signed(cert, key)
    return cert, key


def test_https_with_ca_file(self_signed: tuple[Path, Path], make_shipper: Callable[..., Shipper]) -> None:
    cert, key = self_signed
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    agg = FakeAggregator(ssl_context=ctx)
    try:
        untrusted = make_shipper(agg.url("https"))
        untrusted.start()
        untrusted.submit(make_report(0))
        wait_until(lambda: untrusted.stats().failed_attempts_total >= 1)
        untrusted.close(timeout_s=0.0)
        assert agg.accepted_seqs() == []

        trusted = make_shipper(agg.url("https"), ca_file=cert)
        trusted.submit(make_report(1))
        assert trusted.flush(timeout_s=3.0)
        assert agg.accepted_seqs() == [1]
    finally:
        agg.stop()
