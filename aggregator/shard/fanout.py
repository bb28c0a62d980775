"""Fleet-wide read views over N shards: the replica asked answers for the whole fleet by asking
one replica of every other shard, and says which shards did not answer.

Served as a middleware in front of the read API (aggregator/service.py), after the read guard:
``GET /api/v1/nodes``, ``GET /api/v1/nodes/{node}`` and ``GET /api/v1/decisions`` answer
across shards; ``?scope=shard`` is this shard alone, which is what the fan-out asks its peers
for (so a peer never fans out again). The caller's ``Authorization`` goes with each request:
the viewer token that may read here may read on every shard (TokenReview, or the same admin
tokens everywhere).

Bounded: at most ``sharding.fanout_concurrency`` shards are asked at once, each within
``sharding.fanout_timeout_seconds`` (its URLs in the order ``sharding.peers`` gives, the standby
side after the first); a shard that does not answer in time, or answers anything but 200, is
listed under ``shards.missing`` with the reason and ``partial`` is true. The answer is 200 with
what the other shards gave: a fleet view missing one shard is still what on-call needs most.

Merging: nodes are concatenated, each with its ``shard``, and a node two shards list at once (it is
moving between them) is listed once (``one_row_per_node``: the row with a quarantine or probation,
else the newest, naming the other shard in ``also_on``); decisions (oldest first from each shard, at
most ``limit`` each) are merged by time and cut at ``limit``, which is exactly the first ``limit``
of the fleet since every shard gave its first ``limit``. One node: this shard's,
else the first shard that knows it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final

import aiohttp
import msgspec
from aiohttp import web

from aggregator.ratelog import RateLimitedLog
from aggregator.shard.map import SHARD_HEADER, ShardMap
from aggregator.web.status import ShardNodes, one_row_per_node

log = logging.getLogger(__name__)

SCOPE_PARAM: Final = "scope"
SHARD_SCOPE: Final = "shard"
_NODES: Final = "/api/v1/nodes"
_NODE_PREFIX: Final = "/api/v1/nodes/"
_DECISIONS: Final = "/api/v1/decisions"
_ERROR_MAX: Final = 200

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _Answer(msgspec.Struct):
    shard: int
    status: int  # 0: no answer
    body: Any = None
    error: str | None = None


class FleetViews:
    """The middleware (``middleware``) and its HTTP client's lifecycle (``lifecycle``)."""

    def __init__(
        self, shards: ShardMap, *, timeout_s: float, concurrency: int, monotonic: Callable[[], float]
    ) -> None:
        self._map = shards
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._limit = asyncio.Semaphore(concurrency)
        self._session: aiohttp.ClientSession | None = None
        self._log = RateLimitedLog(log, monotonic=monotonic)

    async def lifecycle(self, _app: web.Application) -> AsyncIterator[None]:
        self._session = aiohttp.ClientSession(timeout=self._timeout)
        try:
            yield
        finally:
            await self._session.close()
            self._session = None

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if (
            request.method != "GET"
            or request.query.get(SCOPE_PARAM) == SHARD_SCOPE
            or not (path in (_NODES, _DECISIONS) or path.startswith(_NODE_PREFIX))
        ):
            return await handler(request)
        local = await handler(request)
        if not isinstance(local, web.Response):
            return local
        if path.startswith(_NODE_PREFIX):
            return await self._one_node(request, local)
        if local.status != 200:  # a bad query: every shard would say the same
            return local
        answers = await self._ask_peers(request)
        key = "nodes" if path == _NODES else "decisions"
        mine = _body(local)
        merged: list[dict[str, Any]] = [{**row, "shard": self._map.index} for row in mine.get(key, [])]
        for a in answers:
            if a.status == 200 and isinstance(a.body, dict):
                merged.extend({**row, "shard": a.shard} for row in a.body.get(key, []))
        if key == "nodes":
            merged = one_row_per_node(merged)
            merged.sort(key=lambda row: str(row.get("node", "")))
        else:
            merged.sort(key=lambda row: float(row.get("time", 0.0)))
            merged = merged[: int(request.query.get("limit", len(merged) or 1))]
        return self._respond(200, {key: merged}, answers)

    # -- the status page's view of the other shards (aggregator/web/status.py, OtherShards) -----

    @property
    def shard(self) -> int:
        return self._map.index

    def page_url(self, shard: int) -> str:
        return self._map.url(shard)

    async def other_nodes(self, authorization: str | None) -> ShardNodes:
        """Every other shard's ``/api/v1/nodes?scope=shard``, with ``authorization``."""
        headers = {"Authorization": authorization} if authorization is not None else {}
        query = {SCOPE_PARAM: SHARD_SCOPE}
        peers = [i for i in range(self._map.shards) if i != self._map.index]
        answers = await asyncio.gather(*(self._ask(i, _NODES, query, headers) for i in peers))
        rows: list[dict[str, Any]] = []
        answered: list[int] = []
        missing: list[tuple[int, str]] = []
        for a in answers:
            if a.status == 200 and isinstance(a.body, dict):
                answered.append(a.shard)
                rows.extend(
                    {**row, "shard": a.shard} for row in a.body.get("nodes", []) if isinstance(row, dict)
                )
            else:
                missing.append((a.shard, a.error or f"HTTP {a.status}"))
        return ShardNodes(rows, answered, missing)

    async def _one_node(self, request: web.Request, local: web.Response) -> web.Response:
        if local.status != 404:
            local.headers[SHARD_HEADER] = self._map.header
            return local
        answers = await self._ask_peers(request)
        for a in sorted(answers, key=lambda a: a.shard):
            if a.status == 200 and isinstance(a.body, dict):
                return self._respond(200, {**a.body, "shard": a.shard}, answers)
        return self._respond(404, _body(local), answers)

    def _respond(self, status: int, payload: dict[str, Any], answers: list[_Answer]) -> web.Response:
        missing = [
            {"shard": a.shard, "error": a.error or f"HTTP {a.status}"}
            for a in answers
            if a.status not in (200, 404)
        ]
        answered = sorted([self._map.index] + [a.shard for a in answers if a.status in (200, 404)])
        payload = {
            **payload,
            "shards": {"total": self._map.shards, "answered": answered, "missing": missing},
            "partial": bool(missing),
        }
        resp = web.Response(status=status, body=msgspec.json.encode(payload), content_type="application/json")
        resp.headers[SHARD_HEADER] = self._map.header
        return resp

    async def _ask_peers(self, request: web.Request) -> list[_Answer]:
        query = {**request.query, SCOPE_PARAM: SHARD_SCOPE}
        headers = {}
        if (auth := request.headers.get("Authorization")) is not None:
            headers["Authorization"] = auth
        peers = [i for i in range(self._map.shards) if i != self._map.index]
        return list(await asyncio.gather(*(self._ask(i, request.path, query, headers) for i in peers)))

    async def _ask(self, shard: int, path: str, query: dict[str, str], headers: dict[str, str]) -> _Answer:
        assert self._session is not None, "FleetViews.lifecycle must run with the app"
        answer = _Answer(shard, 0, error="not asked")
        async with self._limit:
            for base in self._map.urls(shard):
                try:
                    async with self._session.get(base + path, params=query, headers=headers) as resp:
                        body = await resp.read()
                        if resp.status in (200, 404):
                            return _Answer(shard, resp.status, msgspec.json.decode(body))
                        said = body[:_ERROR_MAX].decode("utf-8", "replace")
                        answer = _Answer(shard, resp.status, error=said)
                except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError) as exc:
                    answer = _Answer(shard, 0, error=f"{type(exc).__name__}: {exc}"[:_ERROR_MAX])
        self._log.warning(
            f"shard_unanswered_{shard}",
            "a shard did not answer a fleet-wide view",
            extra={"shard": shard, "path": path, "error": answer.error, "http_status": answer.status},
        )
        return answer


def _body(resp: web.Response) -> dict[str, Any]:
    raw = resp.body
    if not isinstance(raw, bytes | bytearray):
        return {}
    with contextlib.suppress(msgspec.DecodeError):
        decoded = msgspec.json.decode(raw)
        if isinstance(decoded, dict):
            return decoded
    return {}
