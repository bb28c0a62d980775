"""A real aggregator server on 127.0.0.1: the agent's own shipper delivers to it, hostile clients
cannot break it, and it stops cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import logging
import os
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import msgspec
import pytest
from aiohttp.http_exceptions import BadStatusLine
from prometheus_client import CollectorRegistry

from agent.clock import FakeClock
from agent.report import encode
from agent.shipper import Shipper
from aggregator import httplog
from aggregator.auth import StaticTokens
from aggregator.config import Config, ServerConfig
from aggregator.service import REPORTS_PATH, create_app, serve
from tests.test_service import NOW, TOKENS, FakePipeline, make_report


@dataclass
class Running:
    url: str
    host: str
    port: int
    pipeline: FakePipeline
    registry: CollectorRegistry
    stop: asyncio.Event
    task: asyncio.Task[None]


async def start(
    tmp_path: Path, *, handle_signals: bool = False, advance_s: float = 0.02, config: Config | None = None
) -> Running:
    token_file = tmp_path / "tokens"
    token_file.write_text("".join(f"{node} {token}\n" for node, token in TOKENS.items()))
    pipeline = FakePipeline()
    registry = CollectorRegistry()
    app = create_app(
        pipeline,
        StaticTokens(token_file),
        config or Config(),
        FakeClock(NOW),
        registry,
        advance_interval_s=advance_s,
    )
    bound: asyncio.Future[tuple[str, int]] = asyncio.get_running_loop().create_future()
    stop_event = asyncio.Event()
    task = asyncio.create_task(
        serve(
            app,
            "127.0.0.1",
            0,
            stop=None if handle_signals else stop_event,
            on_started=lambda host, port: bound.set_result((host, port)),
            shutdown_timeout_s=1.0,
        )
    )
    host, port = await asyncio.wait_for(bound, 5.0)
    return Running(f"http://{host}:{port}", host, port, pipeline, registry, stop_event, task)


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Running]:
    running = await start(tmp_path)
    yield running
    running.stop.set()
    await asyncio.wait_for(running.task, 5.0)


async def post_valid(running: Running, seq: int) -> int:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            running.url + REPORTS_PATH,
            data=gzip.compress(encode(make_report(seq=seq))),
            headers={
                "Authorization": f"Bearer {TOKENS['gpu-0001']}",
                "Content-Type": "application/json",
                "Content-Encoding": "gzip",
            },
        ) as resp,
    ):
        return resp.status


async def test_the_agents_shipper_delivers_to_the_aggregator(server: Running, tmp_path: Path) -> None:
    agent_token = tmp_path / "agent-token"
    agent_token.write_text(TOKENS["gpu-0002"] + "\n")
    shipper = Shipper(server.url, agent_token, FakeClock(NOW), timeout_s=5.0)
    try:
        for seq in range(1, 21):
            shipper.submit(make_report("gpu-0002", seq))
        shipper.submit(make_report("gpu-0002", 20))  # delivered twice: at-least-once delivery
        assert await asyncio.to_thread(shipper.flush, 10.0)
    finally:
        await asyncio.to_thread(shipper.close, 1.0)
    stats = shipper.stats()
    assert (stats.sent_total, stats.rejected_total) == (21, 0)
    assert [r.seq for r, _ in server.pipeline.ingested] == list(range(1, 21))
    assert server.registry.get_sample_value("gpuwarden_aggregator_reports_duplicate_total") == 1


async def test_the_shipper_drops_what_the_aggregator_refuses_for_good(
    server: Running, tmp_path: Path
) -> None:
    # A report the aggregator can never accept (900 degrees): refused once, not retried forever.
    agent_token = tmp_path / "agent-token"
    agent_token.write_text(TOKENS["gpu-0001"] + "\n")
    report = make_report(seq=5)
    gpus = [msgspec.structs.replace(report.gpus[0], temperature_celsius=900.0), *report.gpus[1:]]
    shipper = Shipper(server.url, agent_token, FakeClock(NOW), timeout_s=5.0)
    try:
        shipper.submit(msgspec.structs.replace(report, gpus=gpus))
        shipper.submit(make_report(seq=6))
        assert await asyncio.to_thread(shipper.flush, 10.0)
    finally:
        await asyncio.to_thread(shipper.close, 1.0)
    assert (shipper.stats().sent_total, shipper.stats().rejected_total) == (1, 1)
    assert [r.seq for r, _ in server.pipeline.ingested] == [6]


async def raw_exchange(running: Running, data: bytes, *, half_close: bool = True) -> bytes:
    """Send raw bytes on a fresh connection; whatever the server answers before closing."""
    reader, writer = await asyncio.open_connection(running.host, running.port)
    try:
        writer.write(data)
        await writer.drain()
        if half_close:
            writer.write_eof()
        return await asyncio.wait_for(reader.read(65536), 5.0)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def request_head(length: int | str, *, encoding: str = "gzip") -> bytes:
    return (
        f"POST {REPORTS_PATH} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKENS['gpu-0001']}\r\n"
        f"Content-Type: application/json\r\nContent-Encoding: {encoding}\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


async def test_hostile_clients_do_not_break_the_server(server: Running) -> None:
    bomb = gzip.compress(b"\0" * (10 << 20), compresslevel=9)
    hostile = [
        # Announces a gigabyte: refused from the headers, before a byte of body is sent.
        (request_head(10**9), False, b"413"),
        # A gzip bomb over the wire.
        (request_head(len(bomb)) + bomb, False, b"413"),
        # Promises 900 kB, sends 10 bytes and hangs up: nobody to answer.
        (request_head(900_000) + b"\x1f\x8b" + b"x" * 8, True, b""),
        # Not HTTP at all.
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + os.urandom(64), False, b"400"),
        # Headers that never end.
        (b"POST /v1/reports HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 20_000, False, b"400"),
        # A negative Content-Length.
        (request_head("-5"), False, b"400"),
    ]
    seq = 0
    for data, half_close, status in hostile:
        answer = await raw_exchange(server, data, half_close=half_close)
        assert answer.split(b"\r\n", 1)[0].split(b" ")[1:2] == ([status] if status else [])
        seq += 1
        assert await post_valid(server, seq) == 200
    assert [r.seq for r, _ in server.pipeline.ingested] == list(range(1, seq + 1))
    for reason in ("body_too_large", "decompressed_too_large", "incomplete_body"):
        count = server.registry.get_sample_value(
            "gpuwarden_aggregator_reports_rejected_total", {"reason": reason}
        )
        assert count == 1, reason


async def test_many_concurrent_reports(tmp_path: Path) -> None:
    # Within the configured limits every one is taken (beyond them: tests/test_abuse_server.py).
    limits = ServerConfig(max_in_flight=256, max_in_flight_per_token=256, max_wait_seconds=30.0)
    server = await start(tmp_path, config=Config(server=limits))
    try:
        statuses = await asyncio.gather(*(post_valid(server, seq) for seq in range(1, 201)))
        assert statuses == [200] * 200
        assert sorted(r.seq for r, _ in server.pipeline.ingested) == list(range(1, 201))
    finally:
        server.stop.set()
        await server.task


async def test_concurrent_reports_beyond_the_limit_are_shed_with_retry_after(tmp_path: Path) -> None:
    # Only the in-flight limit sheds here: on a loaded machine a loop turn can take longer than
    # the default max_wait_seconds, which would shed every report (CI saw all 40 answered 503).
    limits = ServerConfig(max_in_flight=8, max_in_flight_per_token=64, max_wait_seconds=30.0)
    server = await start(tmp_path, config=Config(server=limits))
    try:
        async with aiohttp.ClientSession() as session:

            async def post(seq: int) -> tuple[int, str | None]:
                body = gzip.compress(encode(make_report(seq=seq, time_=NOW - 1.0)))
                async with session.post(
                    server.url + REPORTS_PATH,
                    data=body,
                    headers={
                        "Authorization": f"Bearer {TOKENS['gpu-0001']}",
                        "Content-Type": "application/json",
                        "Content-Encoding": "gzip",
                    },
                ) as resp:
                    await resp.read()
                    return resp.status, resp.headers.get("Retry-After")

            answers = await asyncio.gather(*(post(seq) for seq in range(1, 41)))
        assert {status for status, _ in answers} == {200, 503}
        assert all(after == "5" for status, after in answers if status == 503)
        assert len(server.pipeline.ingested) == sum(1 for status, _ in answers if status == 200)
    finally:
        server.stop.set()
        await server.task


async def test_stop_shuts_the_server_and_the_periodic_task(tmp_path: Path) -> None:
    running = await start(tmp_path)
    for _ in range(200):
        if running.pipeline.advanced:
            break
        await asyncio.sleep(0.01)
    assert running.pipeline.advanced
    running.stop.set()
    await asyncio.wait_for(running.task, 5.0)
    calls = len(running.pipeline.advanced)
    await asyncio.sleep(0.1)
    assert len(running.pipeline.advanced) == calls
    with pytest.raises(OSError):
        await asyncio.open_connection(running.host, running.port)


async def test_sigterm_stops_serve(tmp_path: Path) -> None:
    running = await start(tmp_path, handle_signals=True)
    # serve() installed its handler; without it SIGTERM would end the test run itself.
    assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.wait_for(running.task, 5.0)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


async def raw_request(running: Running, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(running.host, running.port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(200), 5.0)
    finally:
        writer.close()


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /" + b"A" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",  # a request line over the limit
        b"GET /" + b"A" * 8000 + b" HTTP/1.9\r\nHost: x\r\n\r\n",  # no such version
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nX: " + b"\x01" * 8000 + b"\r\n\r\n",  # control bytes
        b"POST /v1/reports HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
    ],
)
async def test_requests_the_parser_refuses_are_logged_once_in_a_while_without_their_bytes(
    server: Running, caplog: pytest.LogCaptureFixture, request_bytes: bytes
) -> None:
    # Anyone who can reach the port can send these, token or not: aiohttp logs each at ERROR with
    # a traceback quoting the bytes (16-32 KB a request). One short warning every few seconds.
    refused = httplog.install()  # the one serve() put there
    before = refused.refused
    with caplog.at_level(logging.DEBUG):
        for _ in range(30):
            assert (
                (await raw_request(server, request_bytes)).split(b"\r\n", 1)[0].endswith(b" 400 Bad Request")
            )
    assert not [r for r in caplog.records if r.name == "aiohttp.server"]  # aiohttp's own: dropped
    lines = [r for r in caplog.records if r.name == "aggregator.httplog"]
    assert refused.refused - before == 30  # each counted; at most one line every 10 s logged
    assert len(lines) <= 2
    assert all(r.levelno == logging.WARNING and not r.exc_info for r in lines)
    assert all(len(r.getMessage()) < 100 and "AAAA" not in str(r.__dict__) for r in lines)


def test_the_parser_filter_logs_one_line_every_ten_seconds_with_a_count_of_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock(NOW)
    refused = httplog.ParserErrorFilter(monotonic=clock.monotonic)

    def record() -> logging.LogRecord:
        exc = BadStatusLine("A" * 8000)
        return logging.LogRecord(
            "aiohttp.server",
            logging.ERROR,
            __file__,
            1,
            "Error handling request from %s",
            ("10.0.0.9",),
            (type(exc), exc, None),
        )

    with caplog.at_level(logging.DEBUG, logger="aggregator.httplog"):
        for _ in range(3):
            for _ in range(10):
                assert not refused.filter(record())  # aiohttp's own record never goes out
            clock.advance(10.0)
    kept = [r for r in caplog.records if r.name == "aggregator.httplog"]
    assert [r.__dict__["suppressed_since_last"] for r in kept] == [0, 9, 9]
    for r in kept:
        assert r.levelno == logging.WARNING, r.levelno
        assert not r.exc_info, r.exc_info
        assert "AAA" not in r.getMessage()
    assert kept[0].__dict__["error"] == "BadStatusLine" and kept[0].__dict__["peer"] == "10.0.0.9"
    assert refused.refused == 30


async def test_a_handler_that_raises_keeps_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    # The filter is for the parser's refusals only: a bug is still an error with its traceback.
    log = logging.getLogger("aiohttp.server")
    httplog.install(log)
    with caplog.at_level(logging.ERROR, logger="aiohttp.server"):
        try:
            raise RuntimeError("a bug")
        except RuntimeError:
            log.exception("Error handling request from %s", "127.0.0.1")
    (record,) = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert record.levelno == logging.ERROR and record.exc_info is not None


@pytest.mark.parametrize(
    ("auth", "length", "status"),
    [
        (None, 100, b"401"),  # no token: refused before a byte of the body is asked for
        ("gpu-0001", 10**9, b"413"),  # a declared length over the limit
        ("gpu-0001", None, b"100"),  # fine so far: the body is asked for
    ],
)
async def test_expect_100_continue_gets_its_refusal_before_the_body(
    server: Running, auth: str | None, length: int | None, status: bytes
) -> None:
    body = gzip.compress(encode(make_report()))
    head = [
        b"POST /v1/reports HTTP/1.1",
        b"Host: x",
        b"Content-Type: application/json",
        b"Content-Encoding: gzip",
        b"Expect: 100-continue",
        b"Content-Length: %d" % (len(body) if length is None else length),
    ]
    if auth is not None:
        head.append(b"Authorization: Bearer " + TOKENS[auth].encode())
    reader, writer = await asyncio.open_connection(server.host, server.port)
    try:
        writer.write(b"\r\n".join(head) + b"\r\n\r\n")
        await writer.drain()
        first = await asyncio.wait_for(reader.readline(), 5.0)
        assert first.split()[1] == status
        if status != b"100":
            # Refused: the connection closes, so no next request is read as the announced body.
            rest = await asyncio.wait_for(reader.read(), 5.0)
            assert b"Connection: close" in rest
        else:
            await asyncio.wait_for(reader.readline(), 5.0)  # the blank line after the 100
            writer.write(body)
            await writer.drain()
            assert (await asyncio.wait_for(reader.readline(), 5.0)).split()[1] == b"200"
    finally:
        writer.close()
    assert len(server.pipeline.ingested) == (1 if status == b"100" else 0)
