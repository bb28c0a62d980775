"""The status page's routes without a browser: escaping, the security headers, filters and
pages, the node's story, and a read source that has only the read API's three calls."""

from __future__ import annotations

import re
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient

from agent.clock import FakeClock
from aggregator.config import Config
from aggregator.configload import parse_config
from aggregator.web.status import CONTENT_SECURITY_POLICY, fleet_summary, status_routes

NOW = 1_764_441_600.0
HOSTILE = '<script>alert("x")</script>'


def node(i: int, state: str = "healthy", **kw: Any) -> dict[str, Any]:
    return {
        "node": f"gpu-{i:04d}",
        "state": state,
        "since": NOW - 600,
        "lemon": False,
        "pool": "h100",
        "rack": f"rack-{i // 8:02d}",
        "leaf": None,
        "last_received": NOW - 5,
        "reasons": [],
        "held": False,
        "silent": False,
        **kw,
    }


class Source:
    """Only what the JSON read API has (``PipelineLike``'s read calls)."""

    def __init__(self, nodes: list[dict[str, Any]]) -> None:
        self._nodes = nodes

    def nodes(self) -> list[dict[str, Any]]:
        return self._nodes

    def node(self, name: str) -> dict[str, Any] | None:
        found = next((n for n in self._nodes if n["node"] == name), None)
        if found is None:
            return None
        reasons = [
            {
                "detector": "rule",
                "rule": "xid-79",
                "severity": "critical",
                "summary": r,
                "evidence": {"msg": HOSTILE},
            }
            for r in found["reasons"]
        ]
        history = [
            {"received": NOW - 10 * k, "temp_max_c": 60.0 + k, "gpus": 8, "errors": []}
            for k in range(20, 0, -1)
        ]
        return {**found, "placement": {"pool": "h100", "rack": found["rack"]}, "reasons": reasons,
                "history": history, "decisions": []}  # fmt: skip

    def decisions_since(self, since: float, limit: int) -> list[dict[str, Any]]:
        return [
            {"time": NOW - 100 + k, "subject": "node", "node": f"gpu-{k:04d}", "state": "suspect",
             "previous": "healthy", "action": "none", "reasons": [{"summary": HOSTILE}]}
            for k in range(min(limit, 30))
        ]  # fmt: skip


def fleet() -> list[dict[str, Any]]:
    out = [node(i) for i in range(250)]
    out[3] = node(3, "quarantined", reasons=[f"XID 79 {HOSTILE}"])
    out[9] = node(9, "suspect", silent=True, reasons=["no report for 61 s"])
    out[12] = node(12, "quarantined", held=True, reasons=["DBE"])
    return out


async def client(
    aiohttp_client: Any, config: Config | None = None
) -> TestClient[web.Request, web.Application]:
    app = web.Application()
    app.router.add_routes(status_routes(Source(fleet()), config=config or Config(), clock=FakeClock(NOW)))
    c: TestClient[web.Request, web.Application] = await aiohttp_client(app)
    return c


async def test_every_page_is_escaped_and_forbids_other_hosts(aiohttp_client: Any) -> None:
    c = await client(aiohttp_client)
    for path in ("/", "/nodes", "/nodes/gpu-0003", "/decisions", "/systemic", "/links", "/probes"):
        resp = await c.get(path)
        assert resp.status == 200, path
        assert resp.headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
        assert resp.headers["Content-Type"].startswith("text/html")
        body = await resp.text()
        assert "<script" not in body, path
        assert not re.search(
            r'(src|href)="(https?:)?//', body.replace('href="https://github.com/gpuwarden', "")
        )
    assert "&lt;script&gt;" in await (await c.get("/nodes/gpu-0003")).text()


async def test_the_assets_are_served_and_nothing_else(aiohttp_client: Any) -> None:
    c = await client(aiohttp_client)
    css = await c.get("/static/status.css")
    assert css.status == 200 and css.headers["Content-Type"].startswith("text/css")
    assert (await c.get("/static/../service.py")).status == 404
    assert (await c.get("/static/nothing.js")).status == 404


async def test_the_node_list_filters_searches_and_pages(aiohttp_client: Any) -> None:
    c = await client(aiohttp_client)

    async def names(query: str) -> list[str]:
        body = await (await c.get("/nodes" + query)).text()
        return re.findall(r'<td><a href="/nodes/([^"]+)">', body)

    first = await names("")
    assert len(first) == 100 and first[:3] == ["gpu-0003", "gpu-0012", "gpu-0009"]  # trouble first
    assert len(await names("?page=3")) == 50
    assert await names("?state=quarantined") == ["gpu-0003", "gpu-0012"]
    assert await names("?state=held") == ["gpu-0012"]
    assert await names("?state=silent") == ["gpu-0009"]
    assert await names("?q=xid%2079") == ["gpu-0003"]  # a reason, any case
    assert await names("?rack=rack-01&state=quarantined") == ["gpu-0012"]
    assert await names("?page=banana") == first  # a bad number is the default, not an error


async def test_the_fleet_page_names_every_quarantined_node_whatever_the_latest_decisions(
    aiohttp_client: Any,
) -> None:
    # The latest decisions are 30 others' (Source.decisions_since): the quarantined nodes are still
    # on the page, linked, newest first, with their reason.
    c = await client(aiohttp_client)
    body = await (await c.get("/")).text()
    out = body[body.index("<h2>Quarantined now") : body.index("<h2>Pools")]
    assert re.findall(r'<td><a href="/nodes/([^"]+)">', out) == ["gpu-0003", "gpu-0012"]
    assert "XID 79" in out and "DBE" in out
    assert 'href="/nodes?state=quarantined"' in out

    # Many out at once: the first 20 by name, and how many more, one click from the list.
    many = [node(i, "quarantined", since=NOW - i) for i in range(25)]
    app = web.Application()
    app.router.add_routes(status_routes(Source(many), config=Config(), clock=FakeClock(NOW)))
    c2: TestClient[web.Request, web.Application] = await aiohttp_client(app)
    body = await (await c2.get("/")).text()
    out = body[body.index("<h2>Quarantined now") : body.index("<h2>Pools")]
    assert re.findall(r'<td><a href="/nodes/([^"]+)">', out) == [f"gpu-{i:04d}" for i in range(20)]
    assert "and 5 more" in out

    app = web.Application()
    app.router.add_routes(status_routes(Source([node(1)]), config=Config(), clock=FakeClock(NOW)))
    c3: TestClient[web.Request, web.Application] = await aiohttp_client(app)
    assert "No node is quarantined." in await (await c3.get("/")).text()


async def test_the_story_says_what_next_and_the_runbook(aiohttp_client: Any) -> None:
    config = parse_config(
        "remediation: {mode: enforce}\nnotify: {runbook_base_url: 'https://wiki.local/rb'}", "t"
    )
    c = await client(aiohttp_client, config)
    story = await (await c.get("/api/v1/nodes/gpu-0003/story")).json()
    assert story["state"] == "quarantined" and story["since_iso"] == "2025-11-29T18:30:00Z"
    assert story["next"].startswith("probation starts once the evidence has been gone 2 min")
    assert "override" in story["override"] and "1 day" in story["override"]
    assert story["runbook_url"] == "https://wiki.local/rb/GpuwardenNodeQuarantined.md"
    held = await (await c.get("/api/v1/nodes/gpu-0012/story")).json()
    assert held["runbook_url"].endswith("/GpuwardenRemediationHeld.md") and "breaker" in held["next"]
    assert (await c.get("/api/v1/nodes/nope/story")).status == 404
    assert (await c.get("/nodes/nope")).status == 404


async def test_the_summary_counts_pools_racks_and_overlays(aiohttp_client: Any) -> None:
    c = await client(aiohttp_client)
    s = await (await c.get("/api/v1/summary")).json()
    assert s["totals"] == {"nodes": 250, "healthy": 247, "suspect": 1, "quarantined": 2, "probation": 0,
                           "silent": 1, "held": 1}  # fmt: skip
    assert [r["rack"] for r in s["racks"][:2]] == ["rack-01", "rack-00"]  # most trouble first
    assert s["breaker"] is None  # the read API's source has no breaker: the page says so


def test_fleet_summary_of_no_nodes() -> None:
    assert fleet_summary([])["totals"]["nodes"] == 0
