"""``gpuwarden aggregator``: the fleet service's command line.

gpuwarden aggregator --listen HOST:PORT --token-file FILE --decisions FILE [--config FILE] [--dry-run]
gpuwarden aggregator --listen HOST:PORT --auth tokenreview --decisions FILE ...
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

from prometheus_client import CollectorRegistry

from agent.clock import SystemClock
from agent.errors import ConfigError
from aggregator.auth import Authenticator, StaticTokens, TokenReviewAuthenticator
from aggregator.config import Config
from aggregator.configload import load_config
from aggregator.decisions import Decision, DecisionLog
from aggregator.metrics import Metrics
from aggregator.notify import make_dispatcher
from aggregator.pipeline import Pipeline
from aggregator.rules import default_rules_dir, load_rules
from aggregator.rules.model import Rule
from aggregator.service import create_app, serve

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
        "--dry-run",
        action="store_true",
        help="decide and log, touch nothing in the cluster (remediation is not built yet: always so)",
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


def run(args: argparse.Namespace) -> int:
    host, port = parse_listen(args.listen)
    config, rules = load_all(args.config, args.rules)
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
    pipeline: Pipeline | None = None
    notify = make_dispatcher(
        config.notify,
        registry,
        clock=clock,
        pool_of=lambda node: pipeline.pool_of(node) if pipeline is not None else None,
    )

    def on_decision(d: Decision) -> None:
        metrics.decision(d.reasons[0].detector if d.reasons else "none", d.state)
        notify.on_decision(d)  # only queues: delivery never blocks detection

    pipeline = Pipeline(config, rules, decisions, on_decision=on_decision, on_systemic=notify.on_systemic)
    log.info(
        "aggregator starting",
        extra={"rules": len(rules), "decisions": str(args.decisions), "dry_run": True},
    )

    def readiness() -> list[str]:
        return [] if decisions.writable else [f"decision log {args.decisions} is not writable"]

    app = create_app(pipeline, authenticator, config, clock, registry, metrics=metrics, readiness=readiness)
    app.cleanup_ctx.append(notify.lifecycle)
    try:
        asyncio.run(serve(app, host, port))
    except OSError as exc:  # the address is taken or cannot be bound
        raise ConfigError(f"cannot serve on {args.listen}: {exc}") from exc
    finally:
        decisions.close()
    return 0
