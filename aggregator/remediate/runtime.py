"""Remediation in a running aggregator: the Kubernetes client, leader election, the actuator, the
breaker shared through the Lease, and the operator endpoints.

Every replica runs all of this: it ingests every report (agents send to every replica), decides,
keeps its node cache (the informer) and follows the Lease; only the leader writes to Nodes. So a
fail-over loses nothing: the new leader already holds the same decisions, and its first act is a
full resync of what the nodes should look like.

The breaker (aggregator.remediate.limits) must not close by itself, so its state lives in an
annotation on the Lease (``gpuwarden.io/breaker``): a replica that opens it writes it there,
every replica adopts what it finds there, and a reset on any replica closes it everywhere.

Operator endpoints (bearer token from ``--admin-token-file``):

- ``GET /api/v1/remediation``: mode, leader, breaker state, held nodes;
- ``POST /api/v1/breaker/reset`` with ``{"by": "<name>", "reason": "<why>"}``: audited.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any, Final

import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge

from agent.clock import Clock
from agent.errors import ConfigError
from aggregator.audit import AuditLog, AuditRecord
from aggregator.auth import AuthError, authorization, bearer_token
from aggregator.config import RemediationConfig
from aggregator.decisions import Decision
from aggregator.kube.api import KubeApi
from aggregator.kube.leader import LeaderElector
from aggregator.kube.objects import KubeError
from aggregator.pipeline import Pipeline
from aggregator.remediate.actuator import Actuator, ActuatorMetrics
from aggregator.remediate.limits import BreakerState, decode_breaker, encode_breaker
from aggregator.remediate.model import IntentSource
from aggregator.shard.fence import SHARDS_ANNOTATION, ShardFence

log = logging.getLogger(__name__)

BREAKER_ANNOTATION: Final = "gpuwarden.io/breaker"
REMEDIATION_PATH: Final = "/api/v1/remediation"
BREAKER_RESET_PATH: Final = "/api/v1/breaker/reset"
LEASE_POLL_S: Final = 0.05  # how often a starting replica looks whether the Lease has been read
# At shutdown, how long the writes under way may take to be answered before the Lease is
# released anyway. The pod's grace period (30 s in daemonset/base) holds the HTTP server's own
# drain (10 s), this, and the release (within the renew deadline, 10 s by default).
DRAIN_TIMEOUT_S: Final = 5.0


class _ResetBody(msgspec.Struct, forbid_unknown_fields=True):
    by: str
    reason: str = ""


def read_admin_tokens(path: Path) -> list[str]:
    """One token per line (``#`` comments); the people (or tools) allowed to reset the breaker."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read admin token file {path}: {exc}") from exc
    tokens = [t.strip() for t in lines if t.strip() and not t.lstrip().startswith("#")]
    if not tokens:
        raise ConfigError(f"admin token file {path} holds no token")
    return tokens


def _supersedes(mine: BreakerState, stored: BreakerState) -> bool:
    """Whether our breaker says something the Lease does not know yet. Every replica opens the
    breaker on the same decision, each at its own receive time: once the Lease says open, another
    open state is the same news, and writing it would have the replicas overwrite each other (and
    audit a new opening) every retry period for as long as the breaker stays open."""
    if mine.open and stored.open:
        return False
    if mine.open:  # the Lease says closed: ours opened after the last reset it knows of
        return stored.reset_at is None or (mine.since is not None and mine.since > stored.reset_at)
    if stored.open:  # ours was reset after the Lease's opening
        return mine.reset_at is not None and (stored.since is None or mine.reset_at >= stored.since)
    return (mine.reset_at or 0.0) > (stored.reset_at or 0.0)


class Remediation:
    def __init__(
        self,
        pipeline: Pipeline,
        config: RemediationConfig,
        *,
        api: KubeApi,
        identity: str,
        clock: Clock,
        registry: CollectorRegistry,
        audit: AuditLog,
        admin_tokens: list[str] | None = None,
        sleep: Callable[[float], Any] = asyncio.sleep,
        intents: IntentSource | None = None,
        shards: int = 1,
        base_lease: str | None = None,
    ) -> None:
        """``intents``: what the actuator restores and reconciles (default: the pipeline; with
        sharding, the nodes of the shard's pools: aggregator/shard/owned.py). ``shards`` above 1:
        this is one of that many shards, whose Leases are ``base_lease`` with the shard suffix.
        Either way its leader writes only while no other count of shards is live
        (aggregator/shard/fence.py)."""
        self.pipeline = pipeline
        self.config = config
        self.api = api
        self.clock = clock
        self.audit = audit
        self._admin = [t.encode() for t in admin_tokens or []]
        self._sleep = sleep
        self.elector = LeaderElector(
            api,
            config.leader,
            identity=identity,
            clock=clock,
            on_started=self._elected,
            on_stopped=self._leadership_changed,
            stamp={SHARDS_ANNOTATION: str(shards)} if shards > 1 else None,
        )
        self.fence = ShardFence(
            api,
            config.leader,
            base=base_lease if base_lease is not None else config.leader.lease_name,
            shards=shards,
            clock=clock,
            on_change=self._leadership_changed,
        )
        # State first, decisions second: until the cluster view is rebuilt (``_rebuild``), no
        # limit is judged and nothing is written to a Node.
        self._ready = asyncio.Event()
        pipeline.await_cluster()
        self.actuator = Actuator(
            api,
            config,
            intents if intents is not None else pipeline,
            clock=clock,
            is_leader=lambda: self.acting,
            leadership_left=self._time_left,
            metrics=ActuatorMetrics(registry),
            ready=self._ready.wait,
        )
        # Labelled with the Lease, so that the alerts count leaders per Lease: sharded, each shard
        # has its own (and its own leader), and one sum over a job would be N.
        self._leader_gauge = Gauge(
            "gpuwarden_remediation_leader",
            "1 on the replica that holds the Lease and writes to nodes",
            ["lease"],
            registry=registry,
        ).labels(config.leader.lease_name)
        self._breaker_gauge = Gauge(
            "gpuwarden_remediation_breaker_open",
            "1 while the safety breaker is open: new quarantines are held until a human resets it",
            registry=registry,
        )
        self._held_gauge = Gauge(
            "gpuwarden_remediation_held_nodes",
            "Nodes quarantined whose taint a safety limit held",
            registry=registry,
        )
        self._held_gauge.set_function(lambda: sum(1 for h in self.pipeline.health.nodes().values() if h.held))
        self._breaker_gauge.set_function(lambda: 1.0 if self.pipeline.limits.open else 0.0)
        self._leader_gauge.set_function(lambda: 1.0 if self.acting else 0.0)
        self._written: BreakerState | None = None  # the breaker as we last wrote or adopted it
        self._wake = asyncio.Event()
        self._leadership_hooks: list[Callable[[], None]] = []

    # -- the pipeline's side: its ClusterView (aggregator.pipeline), from the node cache ---------

    def labels(self, node: str) -> Mapping[str, str]:
        """Pools come from node labels too (K8S_POOL_LABELS)."""
        cached = self.actuator.cached(node)
        return cached.labels if cached is not None else {}

    def has_preflight_taint(self, node: str) -> bool:
        cached = self.actuator.cached(node)
        key = self.config.preflight.taint_key
        return cached is not None and any(t.key == key for t in cached.taints)

    def on_decision(self, decision: Decision) -> None:
        if decision.subject == "node":
            self.actuator.submit(decision.node)
        if self.pipeline.limits.state != self._written:
            self._wake.set()

    def pool_size(self, pool: str) -> int:
        """Every node the cluster has in the pool, reporting or not (the pool-share limit): the
        informer cache's count by pool label, the same label precedence as placement_of."""
        return self.actuator.pool_size(pool)

    def on_leadership(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` whenever this replica gains the lead (e.g. re-send the firing alerts)."""
        self._leadership_hooks.append(hook)

    @property
    def acting(self) -> bool:
        """This replica writes to Nodes: it leads, and no other count of shards is live."""
        return self.elector.is_leader and self.fence.clear

    def _time_left(self) -> float:
        left = self.elector.time_left()
        return min(left, self.fence.time_left())

    def _elected(self) -> None:
        self.fence.elected()  # only a check from now on may let it write
        self._leadership_changed()

    def _leadership_changed(self) -> None:
        leading = self.acting
        log.info("leadership changed", extra={"leader": leading})
        if leading and self._ready.is_set():
            # The Lease was just read to acquire it: its breaker is the newest there is, and the
            # resync that follows must be judged by it, not by what we adopted a period ago.
            self._adopt_breaker()
        self.actuator.leadership_changed()
        if leading:
            for hook in self._leadership_hooks:
                hook()

    # -- breaker through the Lease --------------------------------------------------------------

    async def _breaker_loop(self) -> None:
        period = self.config.leader.retry_period_seconds
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=period)
            self._wake.clear()
            await self.sync_breaker()

    async def sync_breaker(self) -> None:
        """Adopt what the Lease says, then write ours if it changed here."""
        if not self.elector.lease_read:
            # The Lease may hold an open breaker we have not seen yet: never write blind, or a
            # starting replica would close it by itself.
            return
        stored = self._adopt_breaker()
        mine = self.pipeline.limits.state
        if mine != self._written and (stored is None or _supersedes(mine, stored)):
            try:
                await self.elector.update_annotations({BREAKER_ANNOTATION: encode_breaker(mine)})
            except KubeError as exc:
                log.warning("could not store the breaker in the Lease", extra={"error": str(exc)})
                return
            self._written = mine
            if mine.open:
                self.audit.append(
                    AuditRecord(
                        time=self.clock.time(),
                        action="breaker_open",
                        by="gpuwarden",
                        detail={"limit": mine.limit, "reason": mine.reason},
                    )
                )

    def _adopt_breaker(self) -> BreakerState | None:
        """Take the breaker the Lease holds (as last read); returns it (None: none stored)."""
        text = self.elector.annotations.get(BREAKER_ANNOTATION)
        stored = decode_breaker(text) if text else None
        if stored is not None and stored != self._written:
            self.pipeline.adopt_breaker(stored, self.clock.time())
            self._written = stored
        return stored

    async def _rebuild(self) -> None:
        """State first, decisions second: wait for the first Node list (our taints, snapshots
        and annotations restored into the pipeline) and the first read of the Lease (the
        breaker), then let the pipeline judge what it queued meanwhile, then let the actuator
        write."""
        await self.actuator.synced()
        while not self.elector.lease_read:
            await self._sleep(LEASE_POLL_S)
        self._adopt_breaker()
        self.pipeline.cluster_synced(self.clock.time())
        self._ready.set()
        log.info(
            "remediation state rebuilt from the cluster",
            extra={
                "nodes": len(self.actuator.cached_nodes()),
                "breaker_open": self.pipeline.limits.open,
                "held": sum(1 for h in self.pipeline.health.nodes().values() if h.held),
            },
        )

    @property
    def ready(self) -> bool:
        """Whether the cluster view is rebuilt (decisions act, the leader writes)."""
        return self._ready.is_set()

    # -- operator API ---------------------------------------------------------------------------

    def _authorized(self, request: web.Request) -> bool:
        try:
            given = bearer_token(authorization(request.headers)).encode()
        except AuthError:
            return False
        return any(hmac.compare_digest(given, t) for t in self._admin)

    def status(self) -> dict[str, Any]:
        held = sorted(n for n, h in self.pipeline.health.nodes().items() if h.held)
        return {
            "mode": self.config.mode,
            "identity": self.elector.identity,
            "leader": self.elector.leader,
            "is_leader": self.elector.is_leader,
            "acting": self.acting,
            "fenced_by": list(self.fence.others),
            "fence_enforced": self.fence.enforced,
            "ready": self.ready,
            "breaker": {"open": self.pipeline.limits.open, **msgspec.to_builtins(self.pipeline.limits.state)},
            "held_nodes": held,
        }

    def routes(self) -> list[web.RouteDef]:
        async def get_status(_request: web.Request) -> web.Response:
            return web.json_response(self.status())

        async def reset(request: web.Request) -> web.Response:
            if not self._admin:
                return web.json_response(
                    {"error": "forbidden", "message": "no --admin-token-file configured"}, status=403
                )
            if not self._authorized(request):
                return web.json_response(
                    {"error": "bad_token", "message": "an admin bearer token is required"}, status=401
                )
            try:
                body = msgspec.json.decode(await request.read(), type=_ResetBody)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                return web.json_response({"error": "bad_json", "message": str(exc)}, status=400)
            if not body.by.strip():
                return web.json_response(
                    {"error": "bad_json", "message": "'by' must name who resets the breaker"}, status=400
                )
            now = self.clock.time()
            was = self.pipeline.limits.state
            state = self.pipeline.reset_breaker(body.by, now)
            self.audit.append(
                AuditRecord(
                    time=now,
                    action="breaker_reset",
                    by=body.by,
                    detail={"reason": body.reason, "was": msgspec.to_builtins(was)},
                )
            )
            await self.sync_breaker()
            # Whether the Lease holds it yet: until it does, another replica (or this one after a
            # restart) still reads the open breaker there. The write is retried every retry
            # period; the answer says so rather than claim a reset that may not last.
            stored = self._written == self.pipeline.limits.state
            return web.json_response({**self.status(), "reset": msgspec.to_builtins(state), "stored": stored})

        return [web.get(REMEDIATION_PATH, get_status), web.post(BREAKER_RESET_PATH, reset)]

    # -- lifecycle ------------------------------------------------------------------------------

    async def lifecycle(self, _app: object = None) -> AsyncIterator[None]:
        """An aiohttp ``cleanup_ctx`` entry: start everything, then stop it at shutdown (the
        elector releases the Lease, so the other replica takes over at once)."""
        tasks = [
            asyncio.create_task(self._rebuild(), name="remediation-rebuild"),
            asyncio.create_task(self.actuator.run(), name="remediation-actuator"),
            asyncio.create_task(self.elector.run(), name="remediation-leader"),
            asyncio.create_task(self._breaker_loop(), name="remediation-breaker"),
            asyncio.create_task(self.fence.run(), name="remediation-shard-fence"),
        ]
        try:
            yield
        finally:
            # Our writes under way are answered while the Lease is still ours; only then does the
            # elector release it (its cancellation), so no write of ours lands after the next
            # leader took over.
            await self.actuator.drain(DRAIN_TIMEOUT_S)
            for t in reversed(tasks):
                t.cancel()
            for t in reversed(tasks):
                with contextlib.suppress(asyncio.CancelledError):
                    await t
            await self.api.close()
