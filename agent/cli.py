"""``gpuwarden agent``: the node agent's command line.

gpuwarden agent --once --print [--gpu-backend nvml|fake:FILE|none] [--sysfs-root DIR] [--node NAME]
gpuwarden agent --listen HOST:PORT --aggregator URL --token-file FILE
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import resource
import signal
import socket
import sys
import threading
from pathlib import Path
from types import FrameType

from agent.clock import SystemClock
from agent.collectors import build_collectors
from agent.collectors.base import CollectorContext, Paths, XidEventSource
from agent.errors import ConfigError
from agent.report import encode
from agent.runner import Agent, read_boot_id
from agent.state import CycleResult

log = logging.getLogger(__name__)

_NODE_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--once", action="store_true", help="collect one report and exit")
    p.add_argument("--print", action="store_true", help="print each report as JSON on stdout")
    p.add_argument(
        "--gpu-backend",
        default="nvml",
        metavar="nvml|fake:FILE|none",
        help="where GPU data comes from: the real NVML, a fake described by a JSON file, or none",
    )
    p.add_argument("--sysfs-root", type=Path, default=Path("/sys"), help="sysfs mount (default /sys)")
    p.add_argument("--procfs-root", type=Path, default=Path("/proc"), help="procfs mount (default /proc)")
    p.add_argument("--kmsg-path", type=Path, default=Path("/dev/kmsg"), help="kernel log device")
    p.add_argument("--node", help="node name (default: $NODE_NAME, else the hostname)")
    p.add_argument(
        "--label",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="placement hint sent with each report (pool, rack, leaf, zone); repeatable",
    )
    p.add_argument(
        "--netdev-include",
        action="append",
        default=[],
        metavar="NAME",
        help="report this netdev even though it looks virtual (bond0, ...); repeatable",
    )
    p.add_argument("--interval", type=float, default=10.0, help="seconds between reports (default 10)")
    p.add_argument("--listen", metavar="HOST:PORT", help="serve Prometheus /metrics on this address")
    p.add_argument("--aggregator", metavar="URL", help="aggregator base URL (reports go to URL/v1/reports)")
    p.add_argument("--token-file", type=Path, help="bearer token file (a projected service-account token)")
    p.add_argument(
        "--ca-file", type=Path, help="CA bundle to verify an https aggregator (default: system CAs)"
    )
    p.add_argument("--spool-max-reports", type=int, default=360, help="reports kept while undeliverable")


def node_name(explicit: str | None) -> str:
    name = explicit or os.environ.get("NODE_NAME") or socket.gethostname().lower()
    if not _NODE_RE.match(name) or len(name) > 253:
        raise ConfigError(
            f"node name {name!r} is not a Kubernetes node name (lowercase letters, digits, '-' and '.')"
        )
    return name


def parse_labels(items: list[str]) -> dict[str, str]:
    labels: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--label {item!r}: expected KEY=VALUE")
        if len(value) > 128:
            raise ConfigError(f"--label {key}: value longer than 128 characters")
        labels[key] = value
    if len(labels) > 16:
        raise ConfigError("at most 16 --label values")
    return labels


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"--listen {text!r}: expected HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


def raise_open_file_limit() -> None:
    """Use the hard limit on open files, as Go programs do at start.

    The NIC collectors keep sysfs counter files open and re-read them with pread (8x cheaper than
    open/read/close per cycle); with the usual soft limit of 1024 they fall back to reopening.
    """
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY:
            hard = 1 << 20
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        log.warning("could not raise the open file limit", extra={"error": str(exc)})


def run(args: argparse.Namespace) -> int:
    from agent.gpu import open_backend  # noqa: PLC0415 - pynvml is loaded only when asked for

    if not (math.isfinite(args.interval) and args.interval > 0):
        raise ConfigError(f"--interval must be a positive number of seconds, got {args.interval}")
    if args.aggregator and not args.token_file:
        raise ConfigError("--aggregator needs --token-file")
    raise_open_file_limit()
    clock = SystemClock()
    node = node_name(args.node)
    labels = parse_labels(args.label)
    paths = Paths(sysfs=args.sysfs_root, procfs=args.procfs_root, kmsg=args.kmsg_path)
    session = open_backend(args.gpu_backend, clock)
    xid_source: XidEventSource | None = None
    if session is not None:
        from agent.gpu.events import NvmlXidSource  # noqa: PLC0415

        # The XID collector owns the source: it starts it after its first kernel-log read (so no
        # event is counted from both) and closes it.
        xid_source = NvmlXidSource(session, clock)
    ctx = CollectorContext(
        paths=paths,
        clock=clock,
        nvml=session,
        xid_source=xid_source,
        netdev_include=tuple(args.netdev_include),
    )
    agent = Agent(
        node=node,
        collectors=build_collectors(ctx),
        clock=clock,
        boot_id=read_boot_id(paths.procfs),
        interval_seconds=args.interval,
        labels=labels,
    )

    shipper = None
    if args.aggregator:
        from agent.shipper import Shipper  # noqa: PLC0415

        shipper = Shipper(
            args.aggregator,
            args.token_file,
            clock,
            max_spool_reports=args.spool_max_reports,
            ca_file=args.ca_file,
        )
        shipper.start()

    server = None
    metrics = None
    if args.listen:
        from agent.metrics import AgentMetrics, AgentSnapshot, make_registry, serve  # noqa: PLC0415

        host, port = parse_listen(args.listen)
        metrics = AgentMetrics(
            lambda: AgentSnapshot(
                cycle=agent.last_cycle, shipper=shipper.stats() if shipper is not None else None
            )
        )
        server = serve(host, port, make_registry(metrics))
        log.info("serving metrics", extra={"listen": f"{host}:{port}"})

    try:
        if args.once:
            result = agent.cycle()
            if args.print:
                sys.stdout.buffer.write(encode(result.report) + b"\n")
                sys.stdout.flush()
            if shipper is not None:
                shipper.submit(result.report)
                if not shipper.flush(timeout_s=30.0):
                    log.error("report not delivered", extra={"aggregator": args.aggregator})
                    return 1
            return 0

        stop = threading.Event()

        def _stop(signum: int, _frame: FrameType | None) -> None:
            log.info("stopping", extra={"signal": signum})
            stop.set()

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)

        def _on_cycle(result: CycleResult) -> None:
            if metrics is not None:
                metrics.record_cycle(result)  # counts every cycle's events, scraped or not
            if args.print:
                sys.stdout.buffer.write(encode(result.report) + b"\n")
                sys.stdout.flush()

        agent.run(shipper, stop, on_cycle=_on_cycle)
        return 0
    finally:
        if shipper is not None:
            shipper.close(timeout_s=5.0)
        if server is not None:
            server.shutdown()
        agent.close()
        if session is not None:
            session.close()
