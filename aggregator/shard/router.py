"""Reports to the shard that owns their pool: a report POSTed to another shard is answered
``307 Temporary Redirect`` to its owner and is not ingested.

Why a redirect and not "accept and forward": a 200 promises that the report's decisions are on
disk (aggregator/service.py), and only the owner can keep that promise; a forwarding replica
would have to hold the report, retry its delivery and answer for it, doing the agent's spool's
job a second time with none of its guarantees across a restart. A redirect costs one extra
round trip on the first report after the agent's shard changed (it then remembers the owner,
agent/shardroute.py), keeps the report in the agent's spool until the owner answers 2xx, and
lets every replica stay as it is today: it ingests what it owns, all of it. 307 and not 308:
ownership changes with the number of shards, so the answer must not be cached as permanent;
both keep the method and the body.

The pool is the pipeline's own (``placement_of`` with the node's Kubernetes labels, the order
aggregator/fleet/pools.py documents), so a report is routed by the placement the owner will
give it. The check runs after authentication and decoding (the pool is in the report), before
anything reaches the pipeline.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Final

import msgspec
from aiohttp import web
from prometheus_client import Counter, Gauge
from prometheus_client.registry import CollectorRegistry

from agent.report import Report
from aggregator.fleet.pools import placement_of
from aggregator.shard.map import SHARD_HEADER, ShardMap, shard_header

log = logging.getLogger(__name__)

REPORTS_PATH: Final = "/v1/reports"  # the agents' endpoint (aggregator/service.py)


class ShardRouter:
    """``route(report)``: None when this shard owns the report's pool, else the redirect."""

    def __init__(
        self, shards: ShardMap, labels: Callable[[str], Mapping[str, str]], registry: CollectorRegistry
    ) -> None:
        self._map = shards
        self._labels = labels
        self._redirects = Counter(
            "gpuwarden_shard_redirects_total",
            "Reports answered with a redirect to the shard that owns their pool, by that shard",
            ["shard"],
            registry=registry,
        )
        info = Gauge(
            "gpuwarden_shard_info",
            "1, labelled with this replica's shard and the number of shards",
            ["shard", "shards"],
            registry=registry,
        )
        info.labels(str(shards.index), str(shards.shards)).set(1)

    def pool(self, report: Report) -> str:
        return placement_of(report, self._labels(report.node)).pool

    def route(self, report: Report) -> web.Response | None:
        pool = self.pool(report)
        owner = self._map.owner(pool)
        if owner == self._map.index:
            return None
        self._redirects.labels(str(owner)).inc()
        location = self._map.url(owner) + REPORTS_PATH
        resp = web.Response(
            status=307,
            body=msgspec.json.encode(
                {
                    "error": "wrong_shard",
                    "message": f"pool {pool} is on shard {owner} of {self._map.shards}; send to {location}",
                }
            ),
            content_type="application/json",
        )
        resp.headers["Location"] = location
        resp.headers[SHARD_HEADER] = shard_header(owner, self._map.shards)
        return resp
