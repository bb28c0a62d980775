"""Fleet-wide views over shards: the node list, one node and the decisions answer from any
replica; a shard that does not answer is named, and the answer says it is partial."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from agent.clock import SystemClock
from agent.report import Report
from aggregator.app import Aggregator, build_aggregator
from aggregator.config import Config, ShardingConfig
from aggregator.rules import default_rules_dir, load_rules
from aggregator.shard.map import owner_of
from tests.ports import free_port
from tests.rulekit import T0, report, xid

RULES = load_rules([default_rules_dir()])
ADMIN = "admin-token-for-the-fanout-0123456789"
POOLS = [f"pool-{i:03d}" for i in range(100)]
ON = {s: [p for p in POOLS if owner_of(p, 2) == s][:2] for s in (0, 1)}


@asynccontextmanager
async def two_shards(
    tmp_path: Path,
) -> AsyncIterator[tuple[list[Aggregator], list[int], list[asyncio.Event]]]:
    (tmp_path / "tokens").write_text("nobody token-of-nobody-0123456789abcdef\n")
    ports = [free_port(), free_port()]
    aggs: list[Aggregator] = []
    stops: list[asyncio.Event] = []
    tasks: list[asyncio.Task[None]] = []
    for i in range(2):
        cfg = Config(
            sharding=ShardingConfig(
                shards=2,
                shard=i,
                peers=[[f"http://127.0.0.1:{p}" for p in ports]],
                fanout_timeout_seconds=2.0,
            )
        )
        agg = await build_aggregator(
            cfg,
            RULES,
            auth=tmp_path / "tokens",
            clock=SystemClock(),
            admin_tokens=[ADMIN],
            advance_interval_s=None,
        )
        started = asyncio.get_running_loop().create_future()
        stop = asyncio.Event()
        tasks.append(
            asyncio.create_task(
                agg.serve(
                    "127.0.0.1", ports[i], stop=stop, on_started=lambda h, p, f=started: f.set_result(p)
                )
            )
        )
        await asyncio.wait_for(started, 10.0)
        aggs.append(agg)
        stops.append(stop)
    try:
        yield aggs, ports, stops
    finally:
        for stop in stops:
            stop.set()
        await asyncio.gather(*tasks)


def labelled(node: str, pool: str, t: float, *, fault: bool = False) -> Report:
    events = [xid(79, gpu=3, at=t)] if fault else ()
    return msgspec.structs.replace(
        report(t, node=node, seq=int(t - T0), events=events), labels={"pool": pool}
    )


async def page(port: int, path: str) -> tuple[int, str]:
    """GET ``path`` as an operator: the status and the body."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}{path}", headers={"Authorization": f"Bearer {ADMIN}"}) as r,
    ):
        return r.status, await r.text()


async def get(port: int, path: str) -> tuple[int, dict[str, Any]]:
    status, text = await page(port, path)
    return status, json.loads(text)


async def test_decisions_and_nodes_answer_across_shards(tmp_path: Path) -> None:
    async with two_shards(tmp_path) as (aggs, ports, stops):
        # Faults on both shards, interleaved in time: n0 (shard 0) first, then n1, n2, n3.
        for k, (shard, pool) in enumerate([(0, ON[0][0]), (1, ON[1][0]), (0, ON[0][1]), (1, ON[1][1])]):
            t = T0 + 10 * k
            node = f"n{k}"
            aggs[shard].pipeline.ingest(labelled(node, pool, t), t)
            aggs[shard].pipeline.ingest(labelled(node, pool, t + 1, fault=True), t + 1)

        status, body = await get(ports[1], "/api/v1/decisions?limit=3")
        assert status == 200 and body["partial"] is False
        rows = body["decisions"]
        assert [(d["node"], d["shard"]) for d in rows] == [
            ("n0", 0),
            ("n1", 1),
            ("n2", 0),
        ]  # the fleet's first 3
        assert [d["time"] for d in rows] == sorted(d["time"] for d in rows)

        status, body = await get(ports[0], "/api/v1/nodes")
        assert sorted((n["node"], n["shard"]) for n in body["nodes"]) == [
            ("n0", 0),
            ("n1", 1),
            ("n2", 0),
            ("n3", 1),
        ]

        status, body = await get(ports[0], "/api/v1/nodes/n3")  # on the other shard
        assert (status, body["node"], body["shard"]) == (200, "n3", 1)
        status, body = await get(ports[0], "/api/v1/nodes/nowhere")
        assert status == 404 and body["error"] == "unknown_node" and body["shards"]["answered"] == [0, 1]

        status, body = await get(ports[0], "/api/v1/nodes?scope=shard")  # this shard alone: no fan-out
        assert sorted(n["node"] for n in body["nodes"]) == ["n0", "n2"] and "partial" not in body

        status, body = await get(ports[0], "/api/v1/decisions?limit=0")  # a bad query stays a 400
        assert status == 400

        stops[1].set()
        await asyncio.sleep(0.2)
        status, body = await get(ports[0], "/api/v1/decisions")
        assert status == 200 and body["partial"] is True
        assert [m["shard"] for m in body["shards"]["missing"]] == [1]
        assert {d["shard"] for d in body["decisions"]} == {0}


async def test_the_status_page_shows_every_shards_nodes_and_says_when_one_is_missing(tmp_path: Path) -> None:
    async with two_shards(tmp_path) as (aggs, ports, stops):
        # n0 quarantined on shard 0; n1 quarantined and n3 healthy on shard 1.
        for node, shard, fault in (("n0", 0, True), ("n1", 1, True), ("n3", 1, False)):
            pool = ON[shard][0]
            aggs[shard].pipeline.ingest(labelled(node, pool, T0), T0)
            aggs[shard].pipeline.ingest(labelled(node, pool, T0 + 1, fault=fault), T0 + 1)

        status, summary = await get(ports[0], "/api/v1/summary")
        assert status == 200
        assert (summary["totals"]["nodes"], summary["totals"]["quarantined"]) == (3, 2)
        assert summary["shards"] == {"this": 0, "answered": [0, 1], "missing": []}

        status, glance = await page(ports[0], "/")
        assert status == 200
        assert "shard 0 of 2; nodes of shards 0, 1" in glance
        # The quarantined node of the other shard is listed, linked to its page on its own shard.
        assert f'href="http://127.0.0.1:{ports[1]}/nodes/n1"' in glance and "(shard 1)" in glance
        assert 'href="/nodes/n0"' in glance

        status, listing = await page(ports[0], "/nodes")
        assert status == 200 and "1-3 of 3 nodes" in listing and "n3" in listing

        status, there = await page(ports[0], "/nodes/n1")  # not this shard's: where it is
        assert status == 200 and "n1 is on shard 1" in there
        assert f'href="http://127.0.0.1:{ports[1]}/nodes/n1"' in there
        status, _ = await page(ports[0], "/nodes/nowhere")
        assert status == 404

        stops[1].set()
        await asyncio.sleep(2.2)  # past the page's 2 s cache of the other shards' nodes
        status, glance = await page(ports[0], "/")
        assert status == 200
        assert "shard 1 did not answer" in glance and "its nodes are missing here" in glance
        status, summary = await get(ports[0], "/api/v1/summary")
        assert summary["totals"]["nodes"] == 1
        assert [m["shard"] for m in summary["shards"]["missing"]] == [1]


async def test_a_node_two_shards_hold_at_once_is_listed_once_in_its_worst_state(tmp_path: Path) -> None:
    """A node moving between shards: the old owner still holds its quarantine (not yet on the
    Node), the new owner already takes its reports. Every fleet view lists it once, quarantined."""
    async with two_shards(tmp_path) as (aggs, ports, _stops):
        aggs[0].pipeline.ingest(labelled("mv", ON[0][0], T0), T0)
        aggs[0].pipeline.ingest(labelled("mv", ON[0][0], T0 + 1, fault=True), T0 + 1)
        aggs[1].pipeline.ingest(labelled("mv", ON[1][0], T0 + 20), T0 + 20)  # newer, healthy
        aggs[1].pipeline.ingest(labelled("ok", ON[1][0], T0 + 20), T0 + 20)

        for port in ports:
            status, body = await get(port, "/api/v1/nodes")
            assert status == 200
            rows = {n["node"]: n for n in body["nodes"]}
            assert len(body["nodes"]) == 2
            mv = rows["mv"]
            assert (mv["state"], mv["shard"], mv["also_on"]) == ("quarantined", 0, [1])
            status, summary = await get(port, "/api/v1/summary")
            assert (summary["totals"]["nodes"], summary["totals"]["quarantined"]) == (2, 1)
        status, listing = await page(ports[1], "/nodes")
        assert status == 200 and "1-2 of 2 nodes" in listing
        assert "(shard 0; moving, also on shard 1)" in listing
        status, listing = await page(ports[0], "/nodes")
        assert "(moving, also on shard 1)" in listing


def test_one_row_per_node_keeps_the_decision_then_the_newest() -> None:
    from aggregator.web.status import one_row_per_node

    rows = [
        {"node": "a", "state": "healthy", "last_received": 30.0, "shard": 0},
        {"node": "b", "state": "suspect", "last_received": 10.0, "shard": 0},
        {"node": "a", "state": "healthy", "last_received": 50.0, "shard": 1},
        {"node": "a", "state": "healthy", "last_received": 40.0, "shard": 2},
        {"node": "b", "state": "probation", "last_received": 5.0, "shard": 1},
        # The old owner, no longer sent the node's reports, calls it silent and suspect.
        {"node": "c", "state": "suspect", "silent": True, "last_received": 10.0, "shard": 0},
        {"node": "c", "state": "healthy", "last_received": 60.0, "shard": 1},
    ]
    got = {r["node"]: r for r in one_row_per_node(rows)}
    assert (got["c"]["state"], got["c"]["shard"], got["c"]["also_on"]) == ("healthy", 1, [0])
    assert (got["a"]["shard"], got["a"]["also_on"]) == (1, [0, 2])  # equal trouble: the newest report
    assert (got["b"]["state"], got["b"]["shard"], got["b"]["also_on"]) == ("probation", 1, [0])
    assert "also_on" not in one_row_per_node([rows[0]])[0]
