"""Who may look at the status page: a viewer's token (as a bearer token, or as the HTTP Basic
password a browser is asked for), or anyone where the operator opened the pages
(``server.status_page_public``); the JSON read API needs a token either way."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp.test_utils import TestClient
from prometheus_client import CollectorRegistry

from aggregator.auth import StaticTokens
from aggregator.config import Config, ServerConfig
from aggregator.service import create_app
from tests.statusfleet import QUARANTINED, StatusFleet, status_fleet

VIEWER = "c2f0a9d4e7b1835f6a0d2c4e"
NODE = "7d1e3a5c9b0f2468ace13579"


@pytest.fixture(scope="module")
def fleet() -> StatusFleet:
    return status_fleet(32, minutes=6.0)


async def client(
    aiohttp_client: Any, fleet: StatusFleet, tmp_path: Path, *, public: bool
) -> TestClient[Any, Any]:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{QUARANTINED} {NODE}\nviewer:oncall {VIEWER}\n")
    config = msgspec.structs.replace(fleet.config, server=ServerConfig(status_page_public=public))
    assert isinstance(config, Config)
    app = create_app(
        fleet.pipeline,
        StaticTokens(tokens),
        config,
        fleet.clock,
        CollectorRegistry(),
        advance_interval_s=None,
    )
    c: TestClient[Any, Any] = await aiohttp_client(app)
    return c


def basic(token: str, user: str = "anyone") -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{token}".encode()).decode()}


async def test_a_browser_is_asked_for_the_viewer_token_and_gets_in_with_it(
    aiohttp_client: Any, fleet: StatusFleet, tmp_path: Path
) -> None:
    c = await client(aiohttp_client, fleet, tmp_path, public=False)
    for path in ("/", f"/nodes/{QUARANTINED}", "/static/status.css"):
        refused = await c.get(path)
        assert refused.status == 401, path
        assert refused.headers["WWW-Authenticate"].startswith('Basic realm="gpuwarden"'), path
    page = await c.get(f"/nodes/{QUARANTINED}", headers=basic(VIEWER))
    assert page.status == 200 and "XID 79" in await page.text()
    bearer = await c.get("/", headers={"Authorization": f"Bearer {VIEWER}"})
    assert bearer.status == 200
    # A node's token is not a viewer's, however it is sent; a wrong token is refused.
    assert (await c.get("/", headers=basic(NODE))).status == 403
    assert (await c.get("/", headers=basic("not-a-token-at-all"))).status == 401
    assert (await c.get("/", headers={"Authorization": "Basic %%%"})).status == 401
    # The JSON API tells programs to send a bearer token.
    api = await c.get("/api/v1/nodes")
    assert api.status == 401 and api.headers["WWW-Authenticate"].startswith("Bearer ")


async def test_pages_the_operator_opened_need_no_token_but_the_api_still_does(
    aiohttp_client: Any, fleet: StatusFleet, tmp_path: Path
) -> None:
    c = await client(aiohttp_client, fleet, tmp_path, public=True)
    for path in ("/", "/nodes", f"/nodes/{QUARANTINED}", "/decisions", "/static/status.css"):
        assert (await c.get(path)).status == 200, path
    for path in ("/api/v1/nodes", "/api/v1/decisions", "/api/v1/summary"):
        assert (await c.get(path)).status == 401, path
    assert (await c.get("/api/v1/summary", headers={"Authorization": f"Bearer {VIEWER}"})).status == 200
