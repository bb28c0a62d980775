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
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from agent.clock import SystemClock
from agent.errors import ConfigError
from agent.probes.protocol import read_probe_key
from aggregator import eventloop
from aggregator.config import Config
from aggregator.configload import load_config
from aggregator.heap import (
    collections_timed,
    freeze_startup_heap,
    freeze_when_warm,
    malloc_trim,
    trim_periodically,
)
from aggregator.rules import default_rules_dir, load_rules
from aggregator.rules.model import Rule

if TYPE_CHECKING:
    from aggregator.kube.api import KubeApi


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
        eventloop.run(_serve(args, config, rules, (host, port), admin_tokens), config.server.event_loop)
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
    from prometheus_client import ProcessCollector  # noqa: PLC0415 - the service's imports, only here
    from prometheus_client.registry import CollectorRegistry  # noqa: PLC0415

    from aggregator.app import build_aggregator  # noqa: PLC0415

    if args.auth == "static" and args.token_file is None:
        raise ConfigError("--auth static needs --token-file")

    async def kube() -> KubeApi:
        from aggregator.kube.client import KubeClient  # noqa: PLC0415 - only with remediation on

        return await KubeClient.from_environment(kubeconfig=args.kubeconfig)

    # The process's own CPU, memory and file descriptors (process_*), as every Prometheus client
    # exports them on its default registry; the runbooks read them.
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    aggregator = await build_aggregator(
        config,
        rules,
        registry=registry,
        auth=args.token_file if args.auth == "static" else "tokenreview",
        clock=SystemClock(),
        decisions=args.decisions,
        audit=args.audit or args.decisions.with_suffix(".audit.jsonl"),
        kube=kube,
        identity=args.identity or os.environ.get("POD_NAME") or socket.gethostname(),
        admin_tokens=admin_tokens,
        probe_key=read_probe_key(args.probe_key_file) if args.probe_key_file is not None else None,
    )
    # Every collection from here on is timed, the start-up heap's full one first.
    with collections_timed(aggregator.metrics):
        freeze_startup_heap()
        warm = asyncio.create_task(
            freeze_when_warm(lambda: len(aggregator.pipeline.fleet), config.fleet.interval_seconds),
            name="gpuwarden-freeze-when-warm",
        )
        trim = asyncio.create_task(
            trim_periodically(aggregator.metrics, trim=malloc_trim()), name="gpuwarden-heap-trim"
        )
        host, port = address
        try:
            await aggregator.serve(host, port)
        finally:
            warm.cancel()
            trim.cancel()
