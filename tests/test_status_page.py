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


async def test_a_page_with_a_form_never_reloads_and_the_others_say_how_to_stop(aiohttp_client: Any) -> None:
    # On-call types a search into the node list: a reload would wipe it (and take the focus).
    # The pages that do refresh say so and link to the same page with ?refresh=off (WCAG 2.2.1).
    c = await client(aiohttp_client)
    for path in ("/nodes?q=gpu-00", "/decisions", "/links"):
        body = await (await c.get(path)).text()
        assert 'http-equiv="refresh"' not in body, path
    body = await (await c.get("/nodes/gpu-0003")).text()
    assert '<meta http-equiv="refresh" content="10">' in body
    assert 'href="/nodes/gpu-0003?refresh=off">Stop refreshing</a>' in body
    body = await (await c.get("/nodes/gpu-0003?refresh=off")).text()
    assert 'http-equiv="refresh"' not in body
    assert 'href="/nodes/gpu-0003">Refresh every 10 s</a>' in body
    body = await (await c.get("/?refresh=off")).text()
    assert 'http-equiv="refresh"' not in body


async def test_bidirectional_controls_from_an_agent_cannot_reverse_the_page(aiohttp_client: Any) -> None:
    # U+202E (right-to-left override) in a rack label would show the rest of the line, the time
    # of the last report included, backwards. Shown as its code point instead.
    nodes = [node(i) for i in range(3)]
    nodes[1] = node(1, rack="r0001\u202e", reasons=["x\u2067y"])
    app = web.Application()
    app.router.add_routes(status_routes(Source(nodes), config=Config(), clock=FakeClock(NOW)))
    c: TestClient[web.Request, web.Application] = await aiohttp_client(app)
    for path in ("/nodes", "/nodes/gpu-0001"):
        body = await (await c.get(path)).text()
        assert "\u202e" not in body and "\u2067" not in body, path
        assert "r0001[U+202E]" in body, path


async def test_a_fleet_that_has_not_reported_is_not_called_healthy(aiohttp_client: Any) -> None:
    app = web.Application()
    app.router.add_routes(status_routes(Source([]), config=Config(), clock=FakeClock(NOW)))
    c: TestClient[web.Request, web.Application] = await aiohttp_client(app)
    body = await (await c.get("/")).text()
    assert "No node has reported yet" in body
    assert "Every rack is healthy" not in body and "No node is quarantined" not in body
    links = await (await c.get("/links")).text()
    assert "Every probed link is healthy" not in links and "No link has been probed" in links


async def test_the_fleet_page_lists_ten_systemic_events_and_links_the_rest(aiohttp_client: Any) -> None:
    class Silent(Source):
        def systemic_events(self) -> list[dict[str, Any]]:
            return [
                {"time": NOW - 60, "state": "active", "kind": "leaf", "domain": f"leaf-{k:02d}",
                 "summary": f"leaf leaf-{k:02d}: 8 of 8 nodes stopped reporting", "nodes": []}
                for k in range(30)
            ]  # fmt: skip

    app = web.Application()
    app.router.add_routes(status_routes(Silent(fleet()), config=Config(), clock=FakeClock(NOW)))
    c: TestClient[web.Request, web.Application] = await aiohttp_client(app)
    body = await (await c.get("/")).text()
    events = body[body.index("<h2>Systemic events now") : body.index("<h2>Quarantined now")]
    assert events.count("stopped reporting") == 10
    assert "and 20 more" in events and 'href="/systemic"' in events


async def test_with_remediation_off_the_page_says_no_taint_was_applied(aiohttp_client: Any) -> None:
    class Tainted(Source):
        def decisions_since(self, since: float, limit: int) -> list[dict[str, Any]]:
            return [{"time": NOW - 10, "subject": "node", "node": "gpu-0003", "state": "quarantined",
                     "previous": "suspect", "action": "taint", "reasons": [{"summary": "XID"}]}]  # fmt: skip

    for mode, said in (("off", True), ("dry-run", True), ("enforce", False)):
        app = web.Application()
        config = parse_config(f"remediation: {{mode: '{mode}'}}", "t")
        app.router.add_routes(status_routes(Tainted(fleet()), config=config, clock=FakeClock(NOW)))
        c: TestClient[web.Request, web.Application] = await aiohttp_client(app)
        feed = await (await c.get("/decisions")).text()
        assert (f"taint (remediation {mode} now: not applied)" in feed) is said, mode
        page = await (await c.get("/nodes/gpu-0003")).text()
        assert ("this aggregator writes no taint" in page) is said, mode


async def test_the_runbook_is_for_nodes_out_of_service_and_the_internal_copy_is_always_there(
    aiohttp_client: Any,
) -> None:
    # A rule's own reference (NVIDIA's XID page) is shown beside the runbook under
    # notify.runbook_base_url, not instead of it: an air-gapped cluster reads its own copy.
    class WithReference(Source):
        def node(self, name: str) -> dict[str, Any] | None:
            found = super().node(name)
            if found is not None:
                for r in found["reasons"]:
                    r["evidence"]["runbook_url"] = "https://docs.nvidia.com/deploy/xid-errors/index.html"
            return found

    app = web.Application()
    config = parse_config("notify: {runbook_base_url: 'https://wiki.local/rb'}", "t")
    app.router.add_routes(status_routes(WithReference(fleet()), config=config, clock=FakeClock(NOW)))
    c: TestClient[web.Request, web.Application] = await aiohttp_client(app)
    page = await (await c.get("/nodes/gpu-0003")).text()
    assert 'href="https://wiki.local/rb/GpuwardenNodeQuarantined.md"' in page
    assert 'href="https://docs.nvidia.com/deploy/xid-errors/index.html"' in page
    healthy = await (await c.get("/nodes/gpu-0001")).text()
    assert "Runbook:" not in healthy


async def test_every_page_says_whether_this_replica_leads(aiohttp_client: Any) -> None:
    # In a fail-over on-call must know whether the page they look at is the replica that writes
    # the taints; without an election (remediation off) nothing is said.
    leads = {"now": True}
    app = web.Application()
    app.router.add_routes(
        status_routes(Source(fleet()), config=Config(), clock=FakeClock(NOW), leading=lambda: leads["now"])
    )
    c: TestClient[web.Request, web.Application] = await aiohttp_client(app)
    assert "this replica leads" in await (await c.get("/")).text()
    leads["now"] = False
    assert "this replica is a standby" in await (await c.get("/nodes")).text()
    plain = await client(aiohttp_client)
    body = await (await plain.get("/")).text()
    assert "this replica" not in body
