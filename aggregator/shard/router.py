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

Until the replica knows the nodes' labels (the remediation runtime's first Node list), a pool
named only by a label would be misjudged, and the report ingested by a shard that is not its
owner, which would then see the node fall silent once it is routed right. So until then the
answer is 503 with Retry-After: the agent keeps the report and sends it again in a few seconds.
An unsharded aggregator ingests at once, as it always has.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final

import msgspec
from aiohttp import web
from msgspec import UNSET
from prometheus_client import Counter
from prometheus_client.registry import CollectorRegistry

from agent.report import Report
from aggregator.fleet.pools import gpu_model_pool, place
from aggregator.shard.map import SHARD_HEADER, ShardMap, shard_header

REPORTS_PATH: Final = "/v1/reports"  # the agents' endpoint (aggregator/service.py)
_MODEL_POOLS_MAX: Final = 1024  # distinct GPU line-ups; a fleet has a handful
_UNKNOWN: Final = "\x00"  # not a label-safe pool name, so never a cached answer


class ShardRouter:
    """``route(report)``: None when this shard owns the report's pool, else the redirect."""

    def __init__(
        self,
        shards: ShardMap,
        labels: Callable[[str], Mapping[str, str]],
        registry: CollectorRegistry,
        *,
        ready: Callable[[], bool] = lambda: True,
        retry_after_s: int = 5,
        arrived: Callable[[str, str], None] | None = None,
        left: Callable[[str, int], None] | None = None,
    ) -> None:
        """``arrived(node, pool)``: a report of ``node`` is to be ingested here; ``left(node,
        owner)``: one was redirected to shard ``owner`` (aggregator/shard/owned.py moves the
        node's state on both)."""
        self._map = shards
        self._arrived = arrived
        self._left = left
        self._labels = labels
        self._model_pools: dict[tuple[str | None, ...], str | None] = {}
        self._ready = ready
        self._retry_after = str(retry_after_s)
        self._redirects = Counter(
            "gpuwarden_shard_redirects_total",
            "Reports answered with a redirect to the shard that owns their pool, by that shard",
            ["shard"],
            registry=registry,
        )

    def pool(self, report: Report) -> str:
        """``placement_of(report, labels).pool``, with the GPU-model pool remembered by the
        models the report names: it is most of the cost, the same for every report of a node,
        and the pipeline works it out again for the reports this shard keeps."""
        own = report.labels if report.labels is not UNSET else {}
        models = tuple(g.model for g in report.gpus)
        model_pool = self._model_pools.get(models, _UNKNOWN)
        if model_pool is _UNKNOWN:
            if len(self._model_pools) >= _MODEL_POOLS_MAX:
                self._model_pools.clear()
            model_pool = self._model_pools[models] = gpu_model_pool(report)
        return place(own, model_pool, self._labels(report.node)).pool

    def route(self, report: Report) -> web.Response | None:
        if not self._ready():
            resp = web.Response(
                status=503,
                body=msgspec.json.encode(
                    {
                        "error": "not_ready",
                        "message": "the node labels are not read yet: which shard owns "
                        "the pool is not known; retry later",
                    }
                ),
                content_type="application/json",
            )
            resp.headers["Retry-After"] = self._retry_after
            return resp
        pool = self.pool(report)
        owner = self._map.owner(pool)
        if owner == self._map.index:
            if self._arrived is not None:
                self._arrived(report.node, pool)
            return None
        if self._left is not None:
            self._left(report.node, owner)
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
