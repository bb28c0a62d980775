"""Parse failures of every kind answer 4xx, never a 500 (issue 16: deep nesting gave "Server got
itself in trouble"), through the real server on 127.0.0.1."""

from __future__ import annotations

import gzip
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from agent.clock import FakeClock
from agent.report import encode
from aggregator.auth import StaticTokens
from aggregator.config import Config
from aggregator.service import REPORTS_PATH, create_app
from tests.test_service import NOW, TOKENS, FakePipeline, make_report
from tests.test_service_server import post_valid, start

DEPTH = 200_000
_DEEP_ARRAY = b"[" * DEPTH + b"]" * DEPTH
_DEEP_OBJECT = b'{"a":' * DEPTH + b"1" + b"}" * DEPTH

BODIES = {
    "a deep array at the top": _DEEP_ARRAY,
    "a deep unknown field": b'{"x":' + _DEEP_ARRAY + b"}",
    "a deep schema field": b'{"schema":' + _DEEP_OBJECT + b"}",
    "a deep label": b'{"labels":{"a":' + _DEEP_ARRAY + b"}}",
    "a deep field after a valid start": b'{"schema":"gpuwarden/report/v1","node":"gpu-0001","extra":'
    + _DEEP_OBJECT
    + b"}",
    "not UTF-8": b'{"node":"\xff\xfe"}',
    "a lone surrogate": b'{"node":"\\ud800"}',
    "a huge number": b'{"seq":' + b"9" * 100_000 + b"}",
    "empty": b"",
}


@pytest.mark.parametrize("name", sorted(BODIES))
async def test_every_parse_failure_is_a_4xx(tmp_path: Path, name: str) -> None:
    server = await start(tmp_path)
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                server.url + REPORTS_PATH,
                data=gzip.compress(BODIES[name]),
                headers={
                    "Authorization": f"Bearer {TOKENS['gpu-0001']}",
                    "Content-Type": "application/json",
                    "Content-Encoding": "gzip",
                },
            ) as resp,
        ):
            body = await resp.json()
            assert 400 <= resp.status < 500, (resp.status, body)
            assert body["error"] in ("bad_json", "schema_violation", "wrong_schema_version")
        # And the server is none the worse for it.
        assert await post_valid(server, 1) == 200
    finally:
        server.stop.set()
        await server.task


VIEWER_TOKEN = "tok-viewer-0123456789abcdef"


@pytest.mark.parametrize("path", ["/api/v1/nodes", "/api/v1/nodes/gpu-0001", "/api/v1/decisions"])
async def test_reads_need_a_viewer_token(tmp_path: Path, path: str) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("".join(f"{n} {t}\n" for n, t in TOKENS.items()) + f"viewer:grafana {VIEWER_TOKEN}\n")
    app = create_app(FakePipeline(), StaticTokens(tokens), Config(), FakeClock(NOW), CollectorRegistry())
    client = TestClient(TestServer(app))
    await client.start_server()
    try:

        async def status(token: str | None, where: str = path) -> int:
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            resp = await client.get(where, headers=headers)
            await resp.read()
            return resp.status

        assert await status(None) == 401
        assert await status("not-a-token-at-all-0000") == 401
        assert await status(TOKENS["gpu-0001"]) == 403  # a node may not read the fleet
        assert await status(VIEWER_TOKEN) in (200, 404)  # 404: no such node
        for open_path in ("/healthz", "/readyz", "/metrics"):
            assert await status(None, open_path) == 200, open_path
        # A viewer sends no reports.
        resp = await client.post(
            REPORTS_PATH,
            data=encode(make_report()),
            headers={"Authorization": f"Bearer {VIEWER_TOKEN}", "Content-Type": "application/json"},
        )
        assert resp.status == 403
    finally:
        await client.close()
