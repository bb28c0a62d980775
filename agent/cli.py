"""``gpuwarden agent``: the node agent's command line.

gpuwarden agent --once --print [--gpu-backend nvml|fake:FILE|none] [--sysfs-root DIR] [--node NAME]
gpuwarden agent --listen HOST:PORT --aggregator URL [--aggregator URL2 ...] --token-file FILE
    [--probes auto --probe-listen HOST:PORT --probe-key-file FILE]

``--aggregator`` repeats for aggregator replicas: every report goes to every one of them (one spool
each), and probe assignments are polled from all (only the leader hands any out).
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
from typing import TYPE_CHECKING

from agent.clock import SystemClock
from agent.collectors import build_collectors
from agent.collectors.base import CollectorContext, Paths, XidEventSource
from agent.collectors.nccl_inspector import InspectorOptions
from agent.errors import ConfigError
from agent.report import encode
from agent.runner import Agent, read_boot_id
from agent.state import CycleResult

if TYPE_CHECKING:
    from agent.gpu.session import NvmlSession
    from agent.probes.poller import ProbePoller
    from agent.shipper import Shipper, ShipperFanout

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
    p.add_argument(
        "--aggregator",
        action=_AppendAggregator,
        metavar="URL",
        help="aggregator base URL (reports go to URL/v1/reports); repeat for every replica",
    )
    p.add_argument("--token-file", type=Path, help="bearer token file (a projected service-account token)")
    p.add_argument(
        "--ca-file", type=Path, help="CA bundle to verify an https aggregator (default: system CAs)"
    )
    p.add_argument("--spool-max-reports", type=int, default=360, help="reports kept while undeliverable")
    p.add_argument(
        "--probes",
        choices=("off", "auto"),
        default="off",
        help="active probes: off, or auto (run the assigned kinds this node supports; docs/probes.md)",
    )
    p.add_argument("--probe-listen", metavar="HOST:PORT", help="serve the tcp_pair probe endpoint here")
    p.add_argument(
        "--probe-advertise",
        metavar="HOST:PORT",
        help="the probe address peers connect to (default: the listen address, or $POD_IP:PORT)",
    )
    p.add_argument("--probe-key-file", type=Path, help="the probe signing key shared with the aggregator")
    p.add_argument("--nccl-tests-path", type=Path, help="nccl-tests' all_reduce_perf (default: from PATH)")
    p.add_argument(
        "--nccl-inspector-dir",
        type=Path,
        help="read the jobs' NCCL Inspector files here (their NCCL_INSPECTOR_DUMP_DIR; docs/jobs.md)",
    )
    p.add_argument(
        "--nccl-inspector-max-bytes",
        type=int,
        default=InspectorOptions.max_bytes,
        help="Inspector bytes read per cycle, all files together (default %(default)s)",
    )
    p.add_argument(
        "--nccl-inspector-max-records",
        type=int,
        default=InspectorOptions.max_records,
        help="Inspector lines read per cycle (default %(default)s)",
    )
    p.add_argument(
        "--nccl-inspector-max-files",
        type=int,
        default=InspectorOptions.max_files,
        help="Inspector files followed at once, the most recently written (default %(default)s)",
    )


class _AppendAggregator(argparse.Action):
    """``--aggregator`` may repeat: ``aggregators`` gets every URL; ``aggregator`` stays the first."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        urls = [*(getattr(namespace, "aggregators", None) or []), str(values)]
        namespace.aggregators = urls
        namespace.aggregator = urls[0]


def aggregator_urls(args: argparse.Namespace) -> list[str]:
    urls: list[str] = list(getattr(args, "aggregators", None) or [])
    if not urls and args.aggregator:
        urls = [args.aggregator]
    if len(set(urls)) != len(urls):
        raise ConfigError("the same --aggregator URL is given twice")
    return urls


def probe_advertise(explicit: str | None, listen: tuple[str, int]) -> str:
    """Where peers reach this node's probe endpoint: explicit, the listen address, or $POD_IP."""
    if explicit:
        host, port = parse_listen(explicit)
        if host in ("0.0.0.0", "::") or port == 0:
            raise ConfigError(f"--probe-advertise {explicit!r}: peers need a concrete address and port")
        return explicit
    host, port = listen
    if host not in ("0.0.0.0", "::", ""):
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    pod_ip = os.environ.get("POD_IP", "").strip()
    if not pod_ip:
        raise ConfigError("--probe-listen is a wildcard address: give --probe-advertise or set $POD_IP")
    return f"[{pod_ip}]:{port}" if ":" in pod_ip else f"{pod_ip}:{port}"


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


def inspector_options(args: argparse.Namespace) -> InspectorOptions | None:
    """The NCCL Inspector collector's settings, or None where --nccl-inspector-dir is not given."""
    if args.nccl_inspector_dir is None:
        return None
    try:
        return InspectorOptions(
            directory=args.nccl_inspector_dir,
            max_bytes=args.nccl_inspector_max_bytes,
            max_records=args.nccl_inspector_max_records,
            max_files=args.nccl_inspector_max_files,
            # Stay about four cycles behind at most, whatever the per-cycle cap.
            max_backlog_bytes=max(4 * args.nccl_inspector_max_bytes, InspectorOptions.max_backlog_bytes),
            # One report: of what the directory holds now, not of what a next cycle would add.
            read_existing=args.once,
        )
    except ValueError as exc:
        raise ConfigError(f"--nccl-inspector-*: {exc}") from exc


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


def _build_poller(
    args: argparse.Namespace,
    *,
    clock: SystemClock,
    node: str,
    session: NvmlSession | None,
    key: bytes,
    urls: list[str],
) -> ProbePoller:
    from agent.probes import ProbeContext, build_probes, find_backends  # noqa: PLC0415
    from agent.probes.client import AggregatorClient  # noqa: PLC0415
    from agent.probes.idle import IdleGuard  # noqa: PLC0415
    from agent.probes.poller import ProbePoller, ProbeResults  # noqa: PLC0415
    from agent.probes.tcp import TcpProbeServer  # noqa: PLC0415

    listen = parse_listen(args.probe_listen)
    advertise = probe_advertise(args.probe_advertise, listen)
    guard = IdleGuard(session)
    nccl_tests, cupy = find_backends(clock, args.nccl_tests_path)
    if args.nccl_tests_path is not None and nccl_tests is None:
        raise ConfigError(f"--nccl-tests-path {args.nccl_tests_path}: not an executable file")
    results = ProbeResults()
    try:
        server = TcpProbeServer(
            node=node,
            key=key,
            clock=clock,
            host=listen[0],
            port=listen[1],
            on_result=results.add,
            busy=guard.busy,
        )
    except OSError as exc:
        raise ConfigError(f"--probe-listen {args.probe_listen}: {exc.strerror or exc}") from exc
    ctx = ProbeContext(node=node, clock=clock, guard=guard, nccl_tests=nccl_tests, cupy=cupy)
    return ProbePoller(
        node=node,
        key=key,
        clock=clock,
        runners=build_probes(ctx),
        guard=guard,
        results=results,
        clients=[AggregatorClient(url, args.token_file, ca_file=args.ca_file) for url in urls],
        advertise=advertise,
        server=server,
    )


def run(args: argparse.Namespace) -> int:
    from agent.gpu import open_backend  # noqa: PLC0415 - pynvml is loaded only when asked for

    if not (math.isfinite(args.interval) and args.interval > 0):
        raise ConfigError(f"--interval must be a positive number of seconds, got {args.interval}")
    urls = aggregator_urls(args)
    if urls and not args.token_file:
        raise ConfigError("--aggregator needs --token-file")
    probes_on = args.probes == "auto" and not args.once
    if args.probes == "auto":
        if not urls:
            raise ConfigError("--probes auto needs --aggregator (assignments come from it)")
        if args.probe_key_file is None:
            raise ConfigError("--probes auto needs --probe-key-file")
        if not args.probe_listen:
            raise ConfigError("--probes auto needs --probe-listen")
    from agent.probes.protocol import read_probe_key  # noqa: PLC0415

    probe_key = read_probe_key(args.probe_key_file) if args.probes == "auto" else b""
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
        nccl_inspector=inspector_options(args),
    )
    poller = None
    if probes_on:
        poller = _build_poller(args, clock=clock, node=node, session=session, key=probe_key, urls=urls)
    agent = Agent(
        node=node,
        collectors=build_collectors(ctx),
        clock=clock,
        boot_id=read_boot_id(paths.procfs),
        interval_seconds=args.interval,
        labels=labels,
        probes=poller.results if poller is not None else None,
    )

    shipper: Shipper | ShipperFanout | None = None
    if urls:
        from agent.shipper import Shipper, ShipperFanout  # noqa: PLC0415

        shippers = [
            Shipper(
                url,
                args.token_file,
                clock,
                max_spool_reports=args.spool_max_reports,
                ca_file=args.ca_file,
                # One report, no later: a refused token cannot get better by waiting.
                credentials_final=args.once,
            )
            for url in urls
        ]
        # One replica keeps exactly the single-aggregator shipper; several get one spool each.
        shipper = shippers[0] if len(shippers) == 1 else ShipperFanout(shippers)
        shipper.start()
    if poller is not None:
        poller.start()

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
                delivered = shipper.flush(timeout_s=30.0)
                refusal = shipper.refusal()
                if refusal is not None:
                    raise ConfigError(str(refusal))
                if not delivered:
                    log.error("report not delivered", extra={"aggregator": urls})
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
        if poller is not None:
            poller.close()
        if shipper is not None:
            shipper.close(timeout_s=5.0)
        if server is not None:
            server.shutdown()
        agent.close()
        if session is not None:
            session.close()
