"""``gpuwarden aggregator``: the fleet service's command line.

gpuwarden aggregator --listen HOST:PORT --token-file FILE --decisions FILE [--config FILE] [--dry-run]
gpuwarden aggregator --listen HOST:PORT --auth tokenreview --decisions FILE ...
gpuwarden aggregator ... --remediation enforce [--kubeconfig FILE] [--admin-token-file FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
from prometheus_client import CollectorRegistry

from agent.clock import SystemClock
from agent.errors import ConfigError
from agent.probes.protocol import read_probe_key
from aggregator.audit import AuditLog
from aggregator.auth import Authenticator, StaticTokens, TokenReviewAuthenticator
from aggregator.config import Config
from aggregator.configload import load_config
from aggregator.decisions import Decision, DecisionLog
from aggregator.metrics import Metrics
from aggregator.notify import make_dispatcher
from aggregator.rules import default_rules_dir, load_rules
from aggregator.rules.model import Rule
from aggregator.service import create_app, serve

if TYPE_CHECKING:
    from aggregator.pipeline import Pipeline
    from aggregator.remediate.runtime import Remediation


def read_admin_tokens(path: Path) -> list[str]:
    from aggregator.remediate.runtime import read_admin_tokens as read  # noqa: PLC0415

    return read(path)


log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default="127.0.0.1:8080", metavar="HOST:PORT", help="address to serve on")
    p.add_argument(
        "--auth",
        choices=["static", "tokenreview"],
        default="static",
        help="static: tokens from --token-file; tokenreview: Kubernetes TokenReview of projected tokens "
        "(audience and agent service account from the config's auth section)",
    )
    p.add_argument("--token-file", type=Path, help="static tokens: one 'node-name token' pair per line")
    p.add_argument("--decisions", type=Path, required=True, help="append-only decision log (JSONL)")
    p.add_argument("--config", type=Path, help="configuration YAML (defaults for every key)")
    p.add_argument("--rules", type=Path, action="append", help="rules file or directory (repeatable)")
    p.add_argument(
        "--remediation",
        choices=["off", "dry-run", "enforce"],
        help="override the config's remediation.mode: off (no Kubernetes), dry-run (read the "
        "cluster, elect a leader, log every write it would make), enforce (taint, untaint, ...)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="decide and log, write nothing to nodes (the same as --remediation dry-run unless off)",
    )
    p.add_argument("--kubeconfig", type=Path, help="kubeconfig file (default: in-cluster, $KUBECONFIG)")
    p.add_argument(
        "--admin-token-file",
        type=Path,
        help="bearer tokens (one per line) allowed to reset the safety breaker",
    )
    p.add_argument(
        "--probe-key-file",
        type=Path,
        help="the key that signs probe assignments, shared with the agents (probes are off without it)",
    )
    p.add_argument("--audit", type=Path, help="operator audit log (default: next to --decisions)")
    p.add_argument(
        "--identity",
        help="this replica's name in leader election (default: $POD_NAME, else the hostname)",
    )


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"--listen {text!r}: expected HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


def load_all(config_path: Path | None, rule_paths: list[Path] | None) -> tuple[Config, list[Rule]]:
    config = load_config(config_path)
    default = Path(config.rules_dir) if config.rules_dir else default_rules_dir()
    return config, load_rules(rule_paths or [default])


def remediation_mode(config: Config, args: argparse.Namespace) -> str:
    mode: str = args.remediation or config.remediation.mode
    if args.dry_run and mode == "enforce":
        mode = "dry-run"
    return mode


def run(args: argparse.Namespace) -> int:
    host, port = parse_listen(args.listen)
    config, rules = load_all(args.config, args.rules)
    mode = remediation_mode(config, args)
    config = msgspec.structs.replace(
        config, remediation=msgspec.structs.replace(config.remediation, mode=mode)
    )
    admin_tokens = read_admin_tokens(args.admin_token_file) if args.admin_token_file else None
    try:
        asyncio.run(_serve(args, config, rules, (host, port), admin_tokens))
    except OSError as exc:  # the address is taken or cannot be bound
        raise ConfigError(f"cannot serve on {args.listen}: {exc}") from exc
    return 0


async def _serve(
    args: argparse.Namespace,
    config: Config,
    rules: list[Rule],
    address: tuple[str, int],
    admin_tokens: list[str] | None,
) -> None:
    # Imported here, not at the top: the pipeline loads numpy and scikit-learn (seconds), which
    # `--help` and a bad --listen must not wait for.
    from aggregator.pipeline import Pipeline  # noqa: PLC0415

    host, port = address
    clock = SystemClock()
    registry = CollectorRegistry()
    metrics = Metrics(registry)

    authenticator: Authenticator
    if args.auth == "static":
        if args.token_file is None:
            raise ConfigError("--auth static needs --token-file")
        authenticator = StaticTokens(args.token_file)
    else:
        authenticator = TokenReviewAuthenticator.in_cluster(
            audience=config.auth.audience,
            agent_namespace=config.auth.agent_namespace,
            agent_service_account=config.auth.agent_service_account,
            clock=clock,
            metrics=metrics,
            cache_seconds=config.auth.cache_seconds,
        )

    decisions = DecisionLog(args.decisions)
    audit = AuditLog(args.audit or args.decisions.with_suffix(".audit.jsonl"))
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

    def k8s_labels(node: str) -> Mapping[str, str]:
        return remediation.k8s_labels(node) if remediation is not None else {}

    pipeline = Pipeline(
        config,
        rules,
        decisions,
        k8s_labels=k8s_labels,
        on_decision=on_decision,
        on_systemic=notify.on_systemic,
    )
    mode = config.remediation.mode
    if mode != "off":
        from aggregator.kube.client import KubeClient  # noqa: PLC0415 - only with remediation on
        from aggregator.remediate.runtime import Remediation as _Remediation  # noqa: PLC0415

        api = await KubeClient.from_environment(kubeconfig=args.kubeconfig)
        remediation = _Remediation(
            pipeline,
            config.remediation,
            api=api,
            identity=args.identity or os.environ.get("POD_NAME") or socket.gethostname(),
            clock=clock,
            registry=registry,
            audit=audit,
            admin_tokens=admin_tokens,
        )
    scheduler = None
    if args.probe_key_file is not None and config.probes.enabled:
        from aggregator.probes.metrics import ProbeMetrics  # noqa: PLC0415
        from aggregator.probes.scheduler import ProbeScheduler  # noqa: PLC0415

        scheduler = ProbeScheduler(
            config.probes,
            read_probe_key(args.probe_key_file),
            report_interval_seconds=config.fleet.interval_seconds,
        )
        pipeline.probes = scheduler
        ProbeMetrics(registry, scheduler, clock.time)
    if remediation is not None:
        pipeline.has_preflight_taint = remediation.has_preflight_taint
        remediation.on_leadership(notify.resend_now)
    log.info(
        "aggregator starting",
        extra={
            "rules": len(rules),
            "decisions": str(args.decisions),
            "remediation": mode,
            "probes": scheduler is not None,
        },
    )

    def readiness() -> list[str]:
        return [] if decisions.writable else [f"decision log {args.decisions} is not writable"]

    app = create_app(pipeline, authenticator, config, clock, registry, metrics=metrics, readiness=readiness)
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
    try:
        await serve(app, host, port)
    finally:
        decisions.close()
        audit.close()
