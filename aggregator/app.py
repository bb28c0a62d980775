"""The composition root: the one place that builds an aggregator from its configuration.

``build_pipeline`` makes the detection pipeline alone (replay, benchmarks, tests of the pipeline);
``build_aggregator`` makes the whole service around it, wired the same way for ``gpuwarden
aggregator``, the demos and the end-to-end tests:

    Metrics, authenticator          on the registry given (static tokens or TokenReview)
    notifiers (Dispatcher)          pool_of reads the pipeline; sends only on the leader
    probe scheduler                 with a probe key and probes enabled; its metrics and routes
    pipeline                        cluster view, scheduler, detectors and callbacks given at build
    remediation runtime             with remediation on: its own Kubernetes client (``kube``)
    web application                 ingest + read API, notifier, remediation and probe lifecycles
    sharding                        with ``sharding.shards`` > 1 only (aggregator/shard/): the
                                    shard's Lease and hourly share, redirects, fleet-wide views

The pipeline and the remediation runtime need each other: the runtime reads and restores the
pipeline's intents, the pipeline reads node labels, taints and pool sizes from the runtime's node
cache. The pipeline is built first, with a ``ClusterView`` that this module binds to the runtime
right after building it (``_LateCluster``); until then it answers as a cluster without nodes would.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry

from agent.clock import Clock
from agent.errors import ConfigError
from aggregator.audit import AuditLog
from aggregator.auth import Authenticator, StaticTokens, TokenReviewAuthenticator
from aggregator.config import Config
from aggregator.decisions import Decision, DecisionLog, read_decisions
from aggregator.detect import DETECTORS, DetectorSpec
from aggregator.metrics import Metrics
from aggregator.notify import make_dispatcher
from aggregator.notify.base import Dispatcher
from aggregator.pipeline import NO_CLUSTER, ClusterView, Pipeline
from aggregator.remediate.limits import shard_limits
from aggregator.rules.model import Rule
from aggregator.service import Route, create_app, serve
from aggregator.shard.fanout import FleetViews
from aggregator.shard.map import ShardMap
from aggregator.shard.owned import OwnedIntents
from aggregator.shard.router import ShardRouter
from aggregator.silence import SystemicEvent

if TYPE_CHECKING:
    from collections.abc import Mapping

    from aggregator.kube.api import KubeApi
    from aggregator.probes.scheduler import ProbeScheduler
    from aggregator.remediate.runtime import Remediation

log = logging.getLogger(__name__)

# How agents are authenticated: static tokens from this file, or Kubernetes TokenReview of their
# projected service-account tokens (the config's ``auth`` section).
Auth = Path | Literal["tokenreview"]
KubeFactory = Callable[[], Awaitable["KubeApi"]]


def build_pipeline(
    config: Config,
    rules: list[Rule],
    decisions: DecisionLog | None = None,
    *,
    cluster: ClusterView = NO_CLUSTER,
    probes: ProbeScheduler | None = None,
    detectors: Sequence[DetectorSpec[Any]] = DETECTORS,
    on_decision: Callable[[Decision], None] | None = None,
    on_systemic: Callable[[SystemicEvent], None] | None = None,
) -> Pipeline:
    """The detection pipeline; ``decisions`` defaults to an in-memory log."""
    return Pipeline(
        config,
        rules,
        decisions if decisions is not None else DecisionLog(None),
        cluster=cluster,
        probes=probes,
        detectors=detectors,
        on_decision=on_decision,
        on_systemic=on_systemic,
    )


class _LateCluster:
    """The pipeline's ``ClusterView``, bound to the remediation runtime's node cache once that
    exists (the runtime is built on the pipeline); before that, and with remediation off, a
    cluster without nodes."""

    def __init__(self) -> None:
        self._view: ClusterView = NO_CLUSTER

    def bind(self, view: ClusterView) -> None:
        self._view = view

    def labels(self, node: str) -> Mapping[str, str]:
        return self._view.labels(node)

    def has_preflight_taint(self, node: str) -> bool:
        return self._view.has_preflight_taint(node)

    def pool_size(self, pool: str) -> int:
        return self._view.pool_size(pool)


@dataclass
class Aggregator:
    """A built aggregator: serve ``app`` (``serve()``), or drive ``pipeline`` directly."""

    config: Config
    clock: Clock
    registry: CollectorRegistry
    metrics: Metrics
    authenticator: Authenticator
    decisions: DecisionLog
    audit: AuditLog
    notify: Dispatcher
    pipeline: Pipeline
    scheduler: ProbeScheduler | None
    remediation: Remediation | None
    app: web.Application

    async def serve(
        self,
        host: str,
        port: int,
        *,
        stop: asyncio.Event | None = None,
        on_started: Callable[[str, int], None] | None = None,
        shutdown_timeout_s: float = 10.0,
    ) -> None:
        """Serve until ``stop`` (an ``asyncio.Event``; default: SIGINT or SIGTERM), then close."""
        try:
            await serve(
                self.app, host, port, stop=stop, on_started=on_started, shutdown_timeout_s=shutdown_timeout_s
            )
        finally:
            self.close()

    def close(self) -> None:
        self.decisions.close()
        self.audit.close()


def _carry_over(pipeline: Pipeline, decisions: Path, clock: Clock) -> None:
    """Without Nodes to keep our state on (remediation off or dry-run), the decision log is the
    aggregator's memory: the quarantines it leaves open survive the restart, probation clocks
    included. (In ``enforce`` the cluster holds it, on every node: aggregator.remediate.)"""
    if not decisions.exists():
        return
    try:
        carried = pipeline.restore_decisions(read_decisions(decisions), clock.time())
    except (ConfigError, OSError) as exc:
        # Starting without the carried state beats not starting: detection goes on, and the
        # log line says which quarantines may have been forgotten.
        log.error("decision log unreadable: quarantines not carried over", extra={"error": str(exc)})
        return
    log.info(
        "quarantines carried over from the decision log", extra={"path": str(decisions), "nodes": carried}
    )


def _authenticator(auth: Auth, config: Config, clock: Clock, metrics: Metrics) -> Authenticator:
    if auth == "tokenreview":
        return TokenReviewAuthenticator.in_cluster(
            audience=config.auth.audience,
            agent_namespace=config.auth.agent_namespace,
            agent_service_account=config.auth.agent_service_account,
            clock=clock,
            metrics=metrics,
            cache_seconds=config.auth.cache_seconds,
            viewer_service_accounts=config.auth.viewer_service_accounts,
            viewer_groups=config.auth.viewer_groups,
        )
    return StaticTokens(auth)


async def _kube_from_environment() -> KubeApi:
    from aggregator.kube.client import KubeClient  # noqa: PLC0415 - only with remediation on

    return await KubeClient.from_environment()


def _sharded(config: Config, shards: ShardMap) -> Config:
    """What one shard runs: its own Lease (its pair of replicas elects on it, and its breaker
    lives there) and its share of the hourly limit (aggregator/remediate/limits.py)."""
    rem = config.remediation
    leader = msgspec.structs.replace(rem.leader, lease_name=shards.lease_name(rem.leader.lease_name))
    limits = shard_limits(rem.limits, shards.shards)
    return msgspec.structs.replace(
        config, remediation=msgspec.structs.replace(rem, leader=leader, limits=limits)
    )


def _router(
    shards: ShardMap,
    cluster: _LateCluster,
    registry: CollectorRegistry,
    config: Config,
    *,
    remediation: Remediation | None,
    owned: OwnedIntents | None,
) -> Route:
    ready = (lambda: remediation.ready) if remediation is not None else (lambda: True)
    return ShardRouter(
        shards,
        cluster.labels,
        registry,
        ready=ready,
        retry_after_s=config.server.retry_after_seconds,
        arrived=owned.arrived if owned is not None else None,
        left=owned.left if owned is not None else None,
    ).route


async def build_aggregator(
    config: Config,
    rules: list[Rule],
    *,
    auth: Auth,
    clock: Clock,
    decisions: Path | None = None,
    audit: Path | None = None,
    registry: CollectorRegistry | None = None,
    kube: KubeFactory = _kube_from_environment,
    identity: str = "gpuwarden-aggregator",
    admin_tokens: list[str] | None = None,
    probe_key: bytes | None = None,
    detectors: Sequence[DetectorSpec[Any]] = DETECTORS,
    advance_interval_s: float | None = 1.0,
) -> Aggregator:
    """The aggregator ``config`` describes (``config.remediation.mode`` as it will run).

    ``auth``: a static token file, or "tokenreview". ``decisions``, ``audit``: the logs' files
    (None: kept in memory). ``kube``: makes the Kubernetes client, called only with remediation
    on (default: in-cluster or ``$KUBECONFIG``). ``identity``: this replica in leader election.
    ``admin_tokens``: who may reset the breaker. ``probe_key``: probes are off without it.
    ``advance_interval_s``: the periodic detection cycle (None: the caller drives ``advance``).
    """
    shards = ShardMap.of(config.sharding) if config.sharding.shards > 1 else None
    base_lease = config.remediation.leader.lease_name  # each shard's Lease adds its suffix
    if shards is not None:
        config = _sharded(config, shards)
    registry = registry if registry is not None else CollectorRegistry()
    metrics = Metrics(registry)
    shard, count = (shards.index, shards.shards) if shards is not None else (0, 1)
    metrics.shard(shard, count)
    authenticator = _authenticator(auth, config, clock, metrics)
    decision_log = DecisionLog(decisions)
    audit_log = AuditLog(audit)
    pipeline: Pipeline | None = None
    remediation: Remediation | None = None
    notify = make_dispatcher(
        config.notify,
        registry,
        clock=clock,
        pool_of=lambda node: pipeline.pool_of(node) if pipeline is not None else None,
        sending=lambda: remediation is None or remediation.elector.is_leader,
    )

    def on_decision(d: Decision) -> None:
        metrics.decision(d.reasons[0].detector if d.reasons else "none", d.state)
        notify.on_decision(d)  # only queues: delivery never blocks detection
        if remediation is not None:
            remediation.on_decision(d)  # only queues too

    scheduler: ProbeScheduler | None = None
    if probe_key is not None and config.probes.enabled:
        from aggregator.probes.metrics import ProbeMetrics  # noqa: PLC0415 - only with probes on
        from aggregator.probes.scheduler import ProbeScheduler  # noqa: PLC0415

        scheduler = ProbeScheduler(
            config.probes, probe_key, report_interval_seconds=config.fleet.interval_seconds
        )
        ProbeMetrics(registry, scheduler, clock.time)

    cluster = _LateCluster()
    pipeline = build_pipeline(
        config,
        rules,
        decision_log,
        cluster=cluster,
        probes=scheduler,
        detectors=detectors,
        on_decision=on_decision,
        on_systemic=notify.on_systemic,
    )
    metrics.watch_detectors(pipeline.detector_stats)
    metrics.watch_jobs(pipeline.job_tables)
    if decisions is not None and config.remediation.mode != "enforce":
        _carry_over(pipeline, decisions, clock)
    owned: OwnedIntents | None = None
    if config.remediation.mode != "off":
        from aggregator.remediate.runtime import Remediation as _Remediation  # noqa: PLC0415

        if shards is not None:
            owned = OwnedIntents(pipeline, shards, cluster.labels, clock=clock, registry=registry)
        remediation = _Remediation(
            pipeline,
            config.remediation,
            api=await kube(),
            identity=identity,
            clock=clock,
            registry=registry,
            audit=audit_log,
            admin_tokens=admin_tokens,
            intents=owned,
            shards=count,
            base_lease=base_lease,
        )
        if owned is not None:
            owned.bind(remediation.actuator.restore_into, remediation.actuator.settled)
        cluster.bind(remediation)
        remediation.on_leadership(notify.resend_now)

    def readiness() -> list[str]:
        return [] if decision_log.writable else [f"decision log {decisions} is not writable"]

    views = (
        FleetViews(
            shards,
            timeout_s=config.sharding.fanout_timeout_seconds,
            concurrency=config.sharding.fanout_concurrency,
            monotonic=clock.monotonic,
        )
        if shards is not None
        else None
    )
    app = create_app(
        pipeline,
        authenticator,
        config,
        clock,
        registry,
        metrics=metrics,
        readiness=readiness,
        advance_interval_s=advance_interval_s,
        admin_tokens=admin_tokens or (),
        decisions=decision_log,
        route=(
            _router(shards, cluster, registry, config, remediation=remediation, owned=owned)
            if shards is not None
            else None
        ),
        banner=f"shard {shards.index} of {shards.shards}" if shards is not None else None,
        others=views,
        leading=(lambda: remediation.elector.is_leader) if remediation is not None else None,
    )
    if views is not None:
        app.middlewares.append(views.middleware)  # after the read guard: reads are checked first
        app.cleanup_ctx.append(views.lifecycle)
    app.cleanup_ctx.append(notify.lifecycle)
    if scheduler is not None:
        from aggregator.probes.api import probe_routes  # noqa: PLC0415

        leader = remediation.elector if remediation is not None else None
        app.router.add_routes(
            probe_routes(
                scheduler,
                authenticator,
                clock,
                # One scheduler plans at a time: the leader's (every replica, without remediation).
                is_leader=(lambda: leader.is_leader) if leader is not None else (lambda: True),
            )
        )
    if remediation is not None:
        app.router.add_routes(remediation.routes())
        app.cleanup_ctx.append(remediation.lifecycle)
    log.info(
        "aggregator starting",
        extra={
            "rules": len(rules),
            "decisions": str(decisions),
            "remediation": config.remediation.mode,
            "probes": scheduler is not None,
            "shard": shards.header if shards is not None else None,
        },
    )
    return Aggregator(
        config=config,
        clock=clock,
        registry=registry,
        metrics=metrics,
        authenticator=authenticator,
        decisions=decision_log,
        audit=audit_log,
        notify=notify,
        pipeline=pipeline,
        scheduler=scheduler,
        remediation=remediation,
        app=app,
    )


def build_read_only_app(
    pipeline: Pipeline, config: Config, clock: Clock, *, banner: str | None = None
) -> web.Application:
    """The read-only views over a pipeline already driven to its state (``gpuwarden replay
    --serve``): the status page and the JSON read API, no ingest route, and no periodic
    ``advance`` (``clock`` is typically frozen at the end of a trace, so time does not move)."""
    registry = CollectorRegistry()
    return create_app(
        pipeline,
        None,
        config,
        clock,
        registry,
        metrics=Metrics(registry),
        advance_interval_s=None,
        banner=banner,
    )
