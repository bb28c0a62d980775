"""What one agent collection cycle and one ``/metrics`` scrape cost, next to node_exporter's.

Run from the repository root (about 1.5 minutes; loopback only; every process it starts is stopped,
also on failure)::

    .venv/bin/python bench/agent_cycle.py [--json out.json] [--profile]

It measures, on 8 fake GPUs (``--gpu-backend fake:...``, which stands in for the NVML driver) and
a recorded sysfs tree with 8 InfiniBand ports and their netdevs:

1. In this process, ``Agent.cycle()`` built as ``agent/cli.py`` builds it: CPU per cycle (this
   thread's CPU clock; median and percentiles), each collector's CPU (the same clock around its
   ``collect()``), and the CPU spent inside the NVML API calls themselves (one cycle's calls
   recorded, then replayed against the backend), so that the cost *outside the driver* can be
   given. Also the CPU of rendering
   ``/metrics`` from the registry, once right after a new cycle ("fresh", what a Prometheus
   scraping slower than the agent cycles sees) and again on the same snapshot ("cached").
2. A real ``gpuwarden agent`` process (``--interval 0.05 --print --listen``): CPU per cycle over
   all its threads (``/proc/PID/stat`` utime+stime between two points, divided by the reports it
   printed in between) and its peak RSS (``VmHWM``).
3. Two more agent processes for ``/metrics``: at ``--interval 0.25``, one scrape right after each
   cycle ("fresh"); at ``--interval 2``, scrapes back to back ("cached"). The exporter's CPU per
   scrape is the process's CPU over the scrapes less the share of the cycles that ran meanwhile.
4. ``prometheus-node-exporter --path.sysfs=<same tree>``, once with only the collectors that read
   the same files (infiniband, netclass) and once with its defaults, scraped the same way: its CPU
   per scrape (node_exporter collects on every scrape), latency, response size and peak RSS.

Everything measured follows a short sleep, as in the agent (see ``paced``). Scrapes ask like
Prometheus's text fallback does (``Accept: text/plain;version=0.0.4``,
``Accept-Encoding: gzip``), each on a new connection. Ratios are gpuwarden / node_exporter.
Markdown goes to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import cProfile
import gzip
import http.client
import io
import json
import logging
import os
import platform
import pstats
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import IO, Any, cast

import msgspec
from _common import cpuinfo_model, free_port, interpolated_percentile, proc_cpu_seconds
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import CollectorRegistry

from agent.clock import SystemClock
from agent.collectors import build_collectors
from agent.collectors.base import Collected, Collector, CollectorContext, Paths, Support, XidEventSource
from agent.errors import GpuwardenError
from agent.gpu import open_backend
from agent.gpu.api import NvmlApi
from agent.gpu.events import NvmlXidSource
from agent.gpu.session import NvmlSession
from agent.metrics import AgentMetrics, AgentSnapshot, make_registry
from agent.runner import Agent, read_boot_id
from agent.state import CycleResult

log = logging.getLogger("bench.agent_cycle")

REPO = Path(__file__).resolve().parent.parent
CPU_TARGET_MS = 5.0  # per cycle, outside the NVML driver
RSS_TARGET_MB = 60.0
NVML_COLLECTOR = "nvml"
NIC_COLLECTORS = ("infiniband", "netdev")
FRESH_INTERVAL = 0.25  # agent interval while measuring fresh scrapes
CACHED_INTERVAL = 5.0  # agent interval while measuring cached scrapes
BASELINE = "infiniband+netclass"  # the node_exporter run that reads what the agent's NIC collectors read
SCRAPE_HEADERS = {"Accept": "text/plain;version=0.0.4", "Accept-Encoding": "gzip"}
_MB = 1024.0 * 1024.0


class BenchError(RuntimeError):
    """A measurement could not be made (a process did not start, too few cycles, ...)."""


# ---- small statistics ---------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks."""
    if not values:
        raise BenchError("percentile of no values")
    return interpolated_percentile(values, q)


@dataclass(frozen=True)
class Dist:
    """A distribution summarised, in milliseconds."""

    n: int
    median_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> Dist:
        ms = [v * 1000.0 for v in values]
        return cls(
            n=len(ms),
            median_ms=statistics.median(ms),
            p90_ms=percentile(ms, 90),
            p99_ms=percentile(ms, 99),
            mean_ms=statistics.fmean(ms),
        )


@dataclass(frozen=True)
class Setup:
    """What the agent is pointed at: the same in process, in the agent process and for node_exporter."""

    gpu_backend: str
    sysfs_root: Path
    kmsg: Path


# ---- the NVML driver's share --------------------------------------------------------------------


@dataclass(frozen=True)
class NvmlCall:
    name: str
    args: tuple[Any, ...]


class RecordingNvml:
    """Passes every call through to an ``NvmlApi`` and, while ``recording``, notes it.

    Only calls from the thread that runs the cycles are noted: the XID event source waits inside
    ``nvmlEventSetWait_v2`` on a thread of its own, which is not what a cycle pays.
    """

    def __init__(self, inner: NvmlApi) -> None:
        self._inner = inner
        self.recording = False
        self.owner = threading.get_ident()
        self.calls: list[NvmlCall] = []

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._inner, name)
        if not callable(target):
            return target

        def call(*args: Any) -> Any:
            if self.recording and threading.get_ident() == self.owner:
                self.calls.append(NvmlCall(name, args))
            return target(*args)

        return call


def replay_seconds(api: NvmlApi, calls: Sequence[NvmlCall], repeat: int, pace: float) -> list[float]:
    """This thread's CPU for making ``calls`` against ``api`` directly, once per repeat.

    This is what one cycle spends inside the NVML API, measured without a timer around each of the
    hundreds of calls (a thread CPU clock read costs about as much as a fake call).
    """
    bound = [(getattr(api, c.name), c.args) for c in calls]
    out: list[float] = []
    for _ in range(repeat):
        paced(pace)
        t0 = time.thread_time()
        for fn, args in bound:
            try:
                fn(*args)
            except Exception:  # the same errors the collector met (unsupported, ...)
                continue
        out.append(time.thread_time() - t0)
    return out


class CpuTimedCollector:
    """A collector whose ``collect()`` CPU time (this thread's) is noted after each call."""

    def __init__(self, inner: Collector) -> None:
        self._inner = inner
        self.name = inner.name
        self.last_cpu = 0.0

    def supported(self) -> Support:
        return self._inner.supported()

    def collect(self) -> Collected:
        t0 = time.thread_time()
        try:
            return self._inner.collect()
        finally:
            self.last_cpu = time.thread_time() - t0

    def close(self) -> None:
        self._inner.close()


# ---- 1. in-process cycles -----------------------------------------------------------------------


@dataclass(frozen=True)
class InProcess:
    cycles: int
    pace_s: float
    cpu: Dist  # this thread's CPU per cycle, all collectors
    driver: Dist  # CPU inside the NVML API calls of one cycle (replayed)
    driver_calls_per_cycle: int
    cpu_outside_driver: Dist  # cycle CPU less the median driver CPU
    cpu_outside_nvml_collector: Dist  # cycle CPU less the whole NVML collector's CPU
    collectors: dict[str, Dist]  # CPU per collector
    nic_collectors: Dist  # infiniband + netdev together, per cycle
    render_fresh: Dist  # CPU of rendering /metrics right after a new cycle
    render_cached: Dist  # CPU of rendering /metrics of an unchanged snapshot
    render_nics: Dist  # fresh render of a snapshot without its GPUs (what node_exporter exposes)
    render_bytes: int
    render_samples: int
    render_nics_samples: int
    report_gpus: int
    report_nics: int


@contextmanager
def built_agent(
    setup: Setup, *, record: bool
) -> Iterator[tuple[Agent, NvmlSession | None, RecordingNvml | None]]:
    """The agent as ``agent/cli.py`` builds it; with ``record`` its NVML calls can be recorded."""
    clock = SystemClock()
    paths = Paths(sysfs=setup.sysfs_root, procfs=Path("/proc"), kmsg=setup.kmsg)
    session = open_backend(setup.gpu_backend, clock)
    recorder: RecordingNvml | None = None
    if session is not None and record:
        recorder = RecordingNvml(session.api)
        session = NvmlSession(cast(NvmlApi, recorder), clock, source=session.source)
    xid_source: XidEventSource | None = None
    if session is not None:
        xid_source = NvmlXidSource(session, clock)
    ctx = CollectorContext(paths=paths, clock=clock, nvml=session, xid_source=xid_source)
    agent = Agent(
        node="bench-node",
        collectors=build_collectors(ctx),
        clock=clock,
        boot_id=read_boot_id(paths.procfs),
        interval_seconds=10.0,
    )
    try:
        yield agent, session, recorder
    finally:
        agent.close()
        if session is not None:
            session.close()


def record_driver_calls(setup: Setup) -> list[NvmlCall]:
    """The NVML calls of one steady-state cycle (after the first cycles cached what is static)."""
    with built_agent(setup, record=True) as (agent, _, recorder):
        if recorder is None:
            return []
        for _ in range(5):
            agent.cycle()
        recorder.recording = True
        agent.cycle()
        recorder.recording = False
        return list(recorder.calls)


def paced(pace: float) -> None:
    """Sleep as the agent does between cycles.

    Code that runs after a sleep finds cold caches (and, on a VM, maybe a slower core): on the
    2-core VM this was written on, a cycle costs about 1.5-2 ms more CPU 45 ms after the last one
    than back to back. The agent's cycles are seconds apart, so back to back would flatter it.
    """
    if pace > 0:
        time.sleep(pace)


def measure_in_process(setup: Setup, *, cycles: int, renders: int, pace: float, profile: bool) -> InProcess:
    calls = record_driver_calls(setup)
    with built_agent(setup, record=False) as (agent, session, _):
        timed = [CpuTimedCollector(c) for c in agent.collectors]
        agent.collectors = list(timed)
        for _ in range(5):  # the first cycles discover devices and read the kernel log's backlog
            agent.cycle()
        cpu: list[float] = []
        outside_nvml: list[float] = []
        per_collector: dict[str, list[float]] = {c.name: [] for c in timed}
        nic: list[float] = []
        for _ in range(cycles):
            paced(pace)
            t0 = time.thread_time()
            agent.cycle()
            spent = time.thread_time() - t0
            cpu.append(spent)
            for c in timed:
                per_collector[c.name].append(c.last_cpu)
            nvml_cpu = sum(c.last_cpu for c in timed if c.name == NVML_COLLECTOR)
            outside_nvml.append(spent - nvml_cpu)
            nic.append(sum(c.last_cpu for c in timed if c.name in NIC_COLLECTORS))
        driver = (
            replay_seconds(session.api, calls, min(cycles, 100), pace)
            if session is not None and calls
            else [0.0]
        )
        driver_median = statistics.median(driver)
        last = agent.last_cycle
        if last is None:
            raise BenchError("the agent produced no cycle")

        snapshot: list[CycleResult] = [last]
        registry = make_registry(AgentMetrics(lambda: AgentSnapshot(cycle=snapshot[0])))
        fresh: list[float] = []
        cached: list[float] = []
        nics_only: list[float] = []
        body = nics_body = b""
        for _ in range(renders):
            snapshot[0] = agent.cycle()
            paced(pace)
            t0 = time.thread_time()
            body = generate_latest(registry)
            fresh.append(time.thread_time() - t0)
            paced(pace)
            t0 = time.thread_time()
            generate_latest(registry)
            cached.append(time.thread_time() - t0)
            # A new snapshot object makes the families be built again, as after a cycle.
            snapshot[0] = CycleResult(
                report=msgspec.structs.replace(snapshot[0].report, gpus=[]),
                statuses=tuple(s for s in snapshot[0].statuses if s.name in NIC_COLLECTORS),
            )
            paced(pace)
            t0 = time.thread_time()
            nics_body = generate_latest(registry)
            nics_only.append(time.thread_time() - t0)

        if profile:
            print_profile("agent.cycle()", agent.cycle, 100)
            snapshot[0] = agent.cycle()
            print_profile("fresh /metrics render", lambda: fresh_render(agent, registry, snapshot), 50)

        return InProcess(
            cycles=cycles,
            pace_s=pace,
            cpu=Dist.of_seconds(cpu),
            driver=Dist.of_seconds(driver),
            driver_calls_per_cycle=len(calls),
            cpu_outside_driver=Dist.of_seconds([max(c - driver_median, 0.0) for c in cpu]),
            cpu_outside_nvml_collector=Dist.of_seconds(outside_nvml),
            collectors={name: Dist.of_seconds(v) for name, v in per_collector.items()},
            nic_collectors=Dist.of_seconds(nic),
            render_fresh=Dist.of_seconds(fresh),
            render_cached=Dist.of_seconds(cached),
            render_nics=Dist.of_seconds(nics_only),
            render_bytes=len(body),
            render_samples=samples(body),
            render_nics_samples=samples(nics_body),
            report_gpus=len(last.report.gpus),
            report_nics=len(last.report.nics),
        )


def fresh_render(agent: Agent, registry: CollectorRegistry, snapshot: list[CycleResult]) -> None:
    snapshot[0] = agent.cycle()
    generate_latest(registry)


def print_profile(title: str, fn: Callable[[], object], repeat: int) -> None:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(repeat):
        fn()
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(20)
    print(f"\n==== cProfile: {title} x{repeat}, by own time ====", file=sys.stderr)
    print(out.getvalue(), file=sys.stderr)


# ---- processes ----------------------------------------------------------------------------------


def peak_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise BenchError(f"no VmHWM in /proc/{pid}/status")


class Process:
    """A child process that is always stopped: SIGTERM, then SIGKILL after a grace period."""

    def __init__(self, argv: list[str], stderr_path: Path, *, stdout_pipe: bool = False) -> None:
        self.argv = argv
        self.stderr_path = stderr_path
        self._stderr: IO[bytes] = open(stderr_path, "wb")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if stdout_pipe else subprocess.DEVNULL,
            stderr=self._stderr,
            cwd=REPO,
        )
        self.pid = self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stderr_tail(self, lines: int = 15) -> str:
        try:
            text = self.stderr_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=8.0)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=5.0)
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        self._stderr.close()


class LineCounter:
    """Counts the agent's ``--print`` lines (one per cycle) on a reader thread."""

    def __init__(self, stream: IO[bytes]) -> None:
        self._cond = threading.Condition()
        self.count = 0
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[bytes]) -> None:
        try:
            for _ in iter(stream.readline, b""):
                with self._cond:
                    self.count += 1
                    self._cond.notify_all()
        except ValueError:  # the pipe was closed under us at shutdown
            return

    def value(self) -> int:
        with self._cond:
            return self.count

    def wait_beyond(self, seen: int, timeout: float) -> int:
        """Wait until more than ``seen`` lines were read; the new count."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.count <= seen:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BenchError(f"no new cycle within {timeout:.1f} s (still {seen})")
                self._cond.wait(left)
            return self.count


@dataclass(frozen=True)
class ScrapeResult:
    latency_s: float
    wire_bytes: int
    body: bytes


def scrape(port: int, timeout: float = 10.0) -> ScrapeResult:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        start = time.perf_counter()
        conn.request("GET", "/metrics", headers=SCRAPE_HEADERS)
        resp = conn.getresponse()
        data = resp.read()
        latency = time.perf_counter() - start
        if resp.status != 200:
            raise BenchError(f"GET /metrics on port {port}: HTTP {resp.status}")
        encoding = resp.getheader("Content-Encoding", "")
    finally:
        conn.close()
    body = gzip.decompress(data) if encoding == "gzip" else data
    return ScrapeResult(latency, len(data), body)


def wait_ready(proc: Process, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if not proc.alive():
            raise BenchError(f"{proc.argv[0]} exited with {proc.popen.returncode}:\n{proc.stderr_tail()}")
        try:
            scrape(port, timeout=2.0)
            return
        except (OSError, http.client.HTTPException, BenchError) as exc:
            if time.monotonic() > deadline:
                raise BenchError(f"port {port} not serving /metrics after {timeout} s: {exc}") from exc
            time.sleep(0.05)


def samples(body: bytes) -> int:
    return sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))


@dataclass(frozen=True)
class Scrapes:
    """``n`` scrapes of one exporter: latency, size, and the exporter's CPU per scrape."""

    n: int
    latency: Dist
    cpu_per_scrape_ms: float
    body_bytes: int
    wire_bytes: int
    samples: int
    peak_rss_mb: float


def run_scrapes(port: int, n: int, pace: float) -> list[ScrapeResult]:
    """``n`` scrapes, each after ``pace`` seconds of sleep (see ``paced``)."""
    results: list[ScrapeResult] = []
    for _ in range(n):
        paced(pace)
        results.append(scrape(port))
    return results


def summarize(results: list[ScrapeResult], cpu_per_scrape_s: float, rss: int) -> Scrapes:
    last = results[-1]
    return Scrapes(
        n=len(results),
        latency=Dist.of_seconds([r.latency_s for r in results]),
        cpu_per_scrape_ms=cpu_per_scrape_s * 1000.0,
        body_bytes=len(last.body),
        wire_bytes=last.wire_bytes,
        samples=samples(last.body),
        peak_rss_mb=rss / _MB,
    )


# ---- 2 and 3. the agent process -----------------------------------------------------------------


@dataclass(frozen=True)
class AgentProcess:
    command: str
    interval_s: float
    cycles: int
    seconds: float
    cpu_per_cycle_ms: float
    fresh: Scrapes  # one scrape right after each new cycle
    cached: Scrapes  # back-to-back scrapes of an unchanged snapshot (second process)
    peak_rss_mb: float  # the larger of the two processes' VmHWM


def agent_argv(setup: Setup, interval: float, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "gpuwarden",
        "--log-level",
        "WARNING",
        "agent",
        "--node",
        "bench-node",
        "--gpu-backend",
        setup.gpu_backend,
        "--sysfs-root",
        str(setup.sysfs_root),
        "--kmsg-path",
        str(setup.kmsg),
        "--interval",
        str(interval),
        "--listen",
        f"127.0.0.1:{port}",
        "--print",
    ]


def start_agent(argv: list[str], port: int, tmp: Path, tag: str) -> tuple[Process, LineCounter]:
    proc = Process(argv, tmp / f"agent-{tag}.stderr", stdout_pipe=True)
    assert proc.popen.stdout is not None
    try:
        lines = LineCounter(proc.popen.stdout)
        wait_ready(proc, port, timeout=20.0)
    except BaseException:
        proc.stop()
        raise
    return proc, lines


def measure_agent_process(
    setup: Setup, *, interval: float, seconds: float, fresh_n: int, scrapes_n: int, pace: float, tmp: Path
) -> AgentProcess:
    # Cycles: a short interval and no scrapes.
    port = free_port()
    argv = agent_argv(setup, interval, port)
    proc, lines = start_agent(argv, port, tmp, "cycles")
    try:
        lines.wait_beyond(5, timeout=20.0)  # past discovery and the kernel log's backlog
        n0, c0, t0 = lines.value(), proc_cpu_seconds(proc.pid), time.monotonic()
        time.sleep(seconds)
        n1, c1, t1 = lines.value(), proc_cpu_seconds(proc.pid), time.monotonic()
        cycles = n1 - n0
        if cycles < 20:
            raise BenchError(f"only {cycles} cycles in {seconds} s:\n{proc.stderr_tail()}")
        per_cycle = (c1 - c0) / cycles
        rss = [peak_rss_bytes(proc.pid)]
    finally:
        proc.stop()

    # Fresh: one scrape right after each cycle, so the agent builds its metric families anew; the
    # interval leaves room for the scrape, which would otherwise share the GIL with the next cycle.
    port = free_port()
    proc, lines = start_agent(agent_argv(setup, FRESH_INTERVAL, port), port, tmp, "fresh")
    try:
        seen = lines.wait_beyond(2, timeout=20.0)
        results: list[ScrapeResult] = []
        n2, c2 = seen, proc_cpu_seconds(proc.pid)
        for _ in range(fresh_n):
            seen = lines.wait_beyond(seen, timeout=10.0)
            results.append(scrape(port))
        # The window ends at a cycle's end, so that every cycle in it is counted whole.
        n3 = lines.wait_beyond(lines.value(), timeout=10.0)
        c3 = proc_cpu_seconds(proc.pid)
        rss.append(peak_rss_bytes(proc.pid))
        fresh = summarize(results, ((c3 - c2) - (n3 - n2) * per_cycle) / fresh_n, rss[-1])
    finally:
        proc.stop()

    # Cached: a slow interval, so that back-to-back scrapes see one snapshot.
    port = free_port()
    proc, lines = start_agent(agent_argv(setup, CACHED_INTERVAL, port), port, tmp, "cached")
    try:
        lines.wait_beyond(0, timeout=CACHED_INTERVAL + 10.0)
        run_scrapes(port, 5, 0.0)  # builds the families of this snapshot
        n0, c0 = lines.value(), proc_cpu_seconds(proc.pid)
        results = run_scrapes(port, scrapes_n, pace)
        n1, c1 = lines.value(), proc_cpu_seconds(proc.pid)
        rss.append(peak_rss_bytes(proc.pid))
        cached = summarize(results, ((c1 - c0) - (n1 - n0) * per_cycle) / scrapes_n, rss[-1])
    finally:
        proc.stop()

    shown = ["gpuwarden", *argv[argv.index("agent") :]]
    shown[shown.index("--listen") + 1] = "127.0.0.1:PORT"
    return AgentProcess(
        command=" ".join(shown),
        interval_s=interval,
        cycles=cycles,
        seconds=t1 - t0,
        cpu_per_cycle_ms=per_cycle * 1000.0,
        fresh=fresh,
        cached=cached,
        peak_rss_mb=max(rss) / _MB,
    )


# ---- 4. node_exporter ---------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeExporter:
    label: str
    command: str
    scrapes: Scrapes


def node_exporter_version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10, check=False)
    text = (out.stdout or out.stderr).strip()
    return text.splitlines()[0] if text else "unknown"


def measure_node_exporter(
    binary: str, sysfs_root: Path, *, flags: list[str], label: str, scrapes_n: int, pace: float, tmp: Path
) -> NodeExporter:
    port = free_port()
    argv = [binary, f"--path.sysfs={sysfs_root}", f"--web.listen-address=127.0.0.1:{port}", *flags]
    proc = Process(argv, tmp / f"node-exporter-{label}.stderr")
    try:
        wait_ready(proc, port, timeout=20.0)
        run_scrapes(port, 5, 0.0)
        c0 = proc_cpu_seconds(proc.pid)
        results = run_scrapes(port, scrapes_n, pace)
        c1 = proc_cpu_seconds(proc.pid)
        summary = summarize(results, (c1 - c0) / scrapes_n, peak_rss_bytes(proc.pid))
    finally:
        proc.stop()
    shown = [Path(binary).name, *argv[1:]]
    shown[2] = "--web.listen-address=127.0.0.1:PORT"
    return NodeExporter(label=label, command=" ".join(shown), scrapes=summary)


# ---- the run and its report ---------------------------------------------------------------------


@dataclass
class Results:
    date: str
    machine: dict[str, str]
    command: str
    in_process: InProcess
    agent: AgentProcess
    node_exporter: list[NodeExporter] = field(default_factory=list)
    node_exporter_version: str = ""


def machine() -> dict[str, str]:
    model = cpuinfo_model()
    return {
        "cpus": str(os.cpu_count() or 0),
        "cpu_model": model if model is not None else "unknown",
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else "n/a"


def verdict(value: float, target: float) -> str:
    return "met" if value < target else "**missed**"


def render(res: Results) -> str:
    ip, ag = res.in_process, res.agent
    m = res.machine
    out: list[str] = []
    w = out.append
    driver_ms = ip.driver.median_ms
    process_outside = ag.cpu_per_cycle_ms - driver_ms
    w(f"Run {res.date} on {m['cpus']} CPUs ({m['cpu_model']}), Linux {m['kernel']}, Python {m['python']}.")
    w("")
    w(f"- bench: `{res.command}`")
    w(f"- agent: `{ag.command}`")
    for ne in res.node_exporter:
        w(f"- node_exporter, {ne.label}: `{ne.command}`")
    if res.node_exporter_version:
        w(f"- {res.node_exporter_version}")
    w("")
    w("#### Targets")
    w("")
    w("| | value | target | |")
    w("|---|---:|---:|---|")
    w(
        f"| CPU per cycle outside the NVML driver, agent process (all threads) | {process_outside:.2f} ms | "
        f"< {CPU_TARGET_MS:.0f} ms | {verdict(process_outside, CPU_TARGET_MS)} |"
    )
    w(
        f"| the same, in process, median (p90) | {ip.cpu_outside_driver.median_ms:.2f} "
        f"({ip.cpu_outside_driver.p90_ms:.2f}) ms | < {CPU_TARGET_MS:.0f} ms | "
        f"{verdict(ip.cpu_outside_driver.median_ms, CPU_TARGET_MS)} |"
    )
    w(
        f"| peak RSS of the agent process (VmHWM) | {ag.peak_rss_mb:.1f} MB | < {RSS_TARGET_MB:.0f} MB | "
        f"{verdict(ag.peak_rss_mb, RSS_TARGET_MB)} |"
    )
    w("")
    w(
        f"#### One collection cycle, in process ({ip.cycles} cycles, each after {ip.pace_s * 1000:.0f} ms of "
        f"sleep; the report has {ip.report_gpus} GPUs and {ip.report_nics} NICs)"
    )
    w("")
    w("| CPU per cycle (ms) | median | p90 | p99 | mean |")
    w("|---|---:|---:|---:|---:|")
    for name, d in (
        ("whole cycle", ip.cpu),
        (f"inside the NVML API ({ip.driver_calls_per_cycle} calls to the fake, replayed)", ip.driver),
        ("whole cycle less the NVML API (median)", ip.cpu_outside_driver),
        ("whole cycle less the whole NVML collector", ip.cpu_outside_nvml_collector),
    ):
        w(f"| {name} | {d.median_ms:.2f} | {d.p90_ms:.2f} | {d.p99_ms:.2f} | {d.mean_ms:.2f} |")
    for name, d in (*ip.collectors.items(), ("infiniband + netdev", ip.nic_collectors)):
        w(f"| collector {name} | {d.median_ms:.2f} | {d.p90_ms:.2f} | {d.p99_ms:.2f} | {d.mean_ms:.2f} |")
    w("")
    w("| Render /metrics in process, CPU (ms) | median | p90 | samples | bytes |")
    w("|---|---:|---:|---:|---:|")
    w(
        f"| fresh (first scrape after a cycle) | {ip.render_fresh.median_ms:.2f} | "
        f"{ip.render_fresh.p90_ms:.2f} | {ip.render_samples} | {ip.render_bytes} |"
    )
    w(
        f"| cached (same snapshot again) | {ip.render_cached.median_ms:.2f} | "
        f"{ip.render_cached.p90_ms:.2f} | {ip.render_samples} | {ip.render_bytes} |"
    )
    w(
        f"| fresh, NICs only (the report without its GPUs) | {ip.render_nics.median_ms:.2f} | "
        f"{ip.render_nics.p90_ms:.2f} | {ip.render_nics_samples} | |"
    )
    w("")
    w(f"#### The agent process, `--interval {ag.interval_s}`")
    w("")
    w(
        f"{ag.cycles} cycles in {ag.seconds:.1f} s: {ag.cpu_per_cycle_ms:.2f} ms CPU per cycle over all "
        f"threads (reading the kernel log, the XID event thread, printing each report as JSON), "
        f"{process_outside:.2f} ms of it outside the NVML API; peak RSS {ag.peak_rss_mb:.1f} MB."
    )
    w("")
    w("#### One /metrics scrape, side by side")
    w("")
    w(
        f"Each scrape on a new connection, `Accept-Encoding: gzip`; the cached and node_exporter scrapes "
        f"each follow {ip.pace_s * 1000:.0f} ms of sleep. node_exporter reads the tree on every scrape."
    )
    w("")
    w(
        "| | latency median (ms) | latency p90 (ms) | exporter CPU per scrape (ms) | samples "
        "| CPU per 1000 samples (ms) | bytes | gzip bytes | peak RSS (MB) |"
    )
    w("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows: list[tuple[str, Scrapes]] = [
        (f"gpuwarden, fresh ({ag.fresh.n}, one after each cycle, `--interval {FRESH_INTERVAL:g}`)", ag.fresh),
        (f"gpuwarden, cached ({ag.cached.n} of one snapshot, `--interval {CACHED_INTERVAL:g}`)", ag.cached),
    ]
    rows += [(f"node_exporter, {ne.label} ({ne.scrapes.n})", ne.scrapes) for ne in res.node_exporter]
    for name, s in rows:
        per_k = s.cpu_per_scrape_ms * 1000.0 / s.samples if s.samples else 0.0
        w(
            f"| {name} | {s.latency.median_ms:.2f} | {s.latency.p90_ms:.2f} | {s.cpu_per_scrape_ms:.2f} | "
            f"{s.samples} | {per_k:.2f} | {s.body_bytes} | {s.wire_bytes} | {s.peak_rss_mb:.1f} |"
        )
    base = next((ne for ne in res.node_exporter if ne.label == BASELINE), None)
    if base is None:
        return "\n".join(out) + "\n"
    b = base.scrapes
    per_scrape_total = ag.cpu_per_cycle_ms + ag.fresh.cpu_per_scrape_ms
    nic_total = ip.nic_collectors.median_ms + ip.render_nics.median_ms
    w("")
    w(f"Ratios, gpuwarden / node_exporter ({BASELINE}), same run:")
    w("")
    w("| | gpuwarden | node_exporter | ratio |")
    w("|---|---:|---:|---:|")
    for name, a, c, unit in (
        ("scrape latency, median (fresh)", ag.fresh.latency.median_ms, b.latency.median_ms, " ms"),
        ("exporter CPU per scrape (fresh)", ag.fresh.cpu_per_scrape_ms, b.cpu_per_scrape_ms, " ms"),
        (
            "collect + expose: one agent cycle + one fresh scrape (node_exporter collects on scrape)",
            per_scrape_total,
            b.cpu_per_scrape_ms,
            " ms",
        ),
        (
            "NICs only: infiniband + netdev collectors + NIC-only render (in process, medians; "
            "no HTTP, no gzip)",
            nic_total,
            b.cpu_per_scrape_ms,
            " ms",
        ),
        ("samples per scrape", float(ag.fresh.samples), float(b.samples), ""),
        ("response bytes, uncompressed", float(ag.fresh.body_bytes), float(b.body_bytes), ""),
        ("peak RSS", ag.peak_rss_mb, b.peak_rss_mb, " MB"),
    ):
        fmt = ".0f" if not unit else ".2f" if unit == " ms" else ".1f"
        w(f"| {name} | {a:{fmt}}{unit} | {c:{fmt}}{unit} | {ratio(a, c)} |")
    return "\n".join(out) + "\n"


def to_json(res: Results) -> dict[str, Any]:
    return asdict(res)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--gpu-backend", default="fake:tests/fixtures/gpus/h100x8.json")
    p.add_argument("--sysfs-root", type=Path, default=Path("tests/fixtures/sysfs/h100/sys"))
    p.add_argument(
        "--kmsg-path",
        type=Path,
        default=Path("/dev/kmsg"),
        help="kernel log the XID collector reads (default /dev/kmsg, as the agent does)",
    )
    p.add_argument("--cycles", type=int, default=200, help="in-process cycles measured (default 200)")
    p.add_argument(
        "--pace",
        type=float,
        default=0.045,
        help="seconds of sleep before each measured in-process cycle, replay and render, and before each "
        "back-to-back scrape (default 0.045)",
    )
    p.add_argument("--renders", type=int, default=60, help="in-process /metrics renders (default 60)")
    p.add_argument("--interval", type=float, default=0.05, help="agent process interval (default 0.05)")
    p.add_argument("--seconds", type=float, default=10.0, help="agent process cycling time (default 10)")
    p.add_argument("--scrapes", type=int, default=200, help="scrapes per exporter (default 200)")
    p.add_argument(
        "--fresh-scrapes",
        type=int,
        default=60,
        help=f"agent scrapes one after each cycle, at --interval {FRESH_INTERVAL} (default 60)",
    )
    p.add_argument("--node-exporter", default="/usr/bin/prometheus-node-exporter", help="its binary")
    p.add_argument("--json", type=Path, help="also write the results as JSON to this file")
    p.add_argument("--profile", action="store_true", help="print cProfile tables to stderr")
    return p


def _terminate(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    # SIGTERM unwinds like Ctrl-C, so that the finally blocks stop the processes this run started.
    signal.signal(signal.SIGTERM, _terminate)
    if args.cycles < 10 or args.scrapes < 20 or args.renders < 10 or args.fresh_scrapes < 10:
        print(
            "agent_cycle: need --cycles >= 10, --renders >= 10, --scrapes >= 20 and --fresh-scrapes >= 10",
            file=sys.stderr,
        )
        return 2
    os.chdir(REPO)
    # Paths stay as given (relative to the repository root by default) so the quoted commands are short.
    setup = Setup(gpu_backend=args.gpu_backend, sysfs_root=args.sysfs_root, kmsg=args.kmsg_path)
    if not (setup.sysfs_root / "class" / "infiniband").is_dir():
        print(f"agent_cycle: {setup.sysfs_root} has no class/infiniband", file=sys.stderr)
        return 2
    ne_binary = shutil.which(args.node_exporter)
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpuwarden-bench-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        print("in-process cycles ...", file=sys.stderr)
        in_process = measure_in_process(
            setup, cycles=args.cycles, renders=args.renders, pace=args.pace, profile=args.profile
        )
        print("agent process ...", file=sys.stderr)
        agent = measure_agent_process(
            setup,
            interval=args.interval,
            seconds=args.seconds,
            fresh_n=args.fresh_scrapes,
            scrapes_n=args.scrapes,
            pace=args.pace,
            tmp=tmp,
        )
        res = Results(
            date=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            machine=machine(),
            command=" ".join(
                [".venv/bin/python", "bench/agent_cycle.py", *(sys.argv[1:] if argv is None else argv)]
            ),
            in_process=in_process,
            agent=agent,
        )
        if ne_binary is None:
            print(f"agent_cycle: {args.node_exporter} not found; no comparison", file=sys.stderr)
        else:
            res.node_exporter_version = node_exporter_version(ne_binary)
            for label, flags in (
                (
                    BASELINE,
                    ["--collector.disable-defaults", "--collector.infiniband", "--collector.netclass"],
                ),
                ("defaults", []),
            ):
                print(f"node_exporter {label} ...", file=sys.stderr)
                res.node_exporter.append(
                    measure_node_exporter(
                        ne_binary,
                        setup.sysfs_root,
                        flags=flags,
                        label=label,
                        scrapes_n=args.scrapes,
                        pace=args.pace,
                        tmp=tmp,
                    )
                )
    except (BenchError, GpuwardenError, OSError) as exc:
        print(f"agent_cycle: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    sys.stdout.write(render(res))
    if args.json is not None:
        args.json.write_text(json.dumps(to_json(res), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
