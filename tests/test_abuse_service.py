"""Parse failures of every kind answer 4xx, never a 500 (issue 16: deep nesting gave "Server got
itself in trouble"), through the real server on 127.0.0.1."""

from __future__ import annotations

import gzip
from pathlib import Path

import aiohttp
import pytest

from aggregator.service import REPORTS_PATH
from tests.test_service import TOKENS
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
