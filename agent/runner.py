"""The agent's cycle: run every collector, assemble one report, hand it to the shipper.

A collector that raises loses only its own part of the report: the failure goes into the
report's ``errors`` and into the collector's status (exported as ``gpuwarden_collector_success``),
and the other collectors' data still goes out.

Finished active probes (``agent.probes``) ride along: each cycle takes what the probe loop has
finished since the last one, at most 256 (the schema's bound); older ones beyond that are dropped
and counted in ``errors`` (collector ``probes``).
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Final, Protocol

from msgspec import UNSET

from agent import __version__
from agent.attribution import PodAttributor, attribute_collectives
from agent.clock import Clock
from agent.collectors.base import Collector, Problem
from agent.report import SCHEMA_ID, CollectorError, Event, Gpu, GpuAllocation, Jobs, Nic, Probe, Report
from agent.state import CollectorStatus, CycleResult

log = logging.getLogger(__name__)

MAX_EVENTS: Final = 1024  # the schema's bound on events per report
MAX_ERRORS: Final = 64  # the schema's bound on errors per report
MAX_MESSAGE: Final = 1024
MAX_PROBES: Final = 256  # the schema's bound on probes per report


def _collector_error(collector: str, error: str | Problem) -> CollectorError:
    if isinstance(error, str):
        return CollectorError(collector=collector, message=error[:MAX_MESSAGE])
    return CollectorError(
        collector=collector,
        message=error.message[:MAX_MESSAGE],
        code=error.code,
        gpu=UNSET if error.gpu is None else error.gpu,
    )


class ReportSink(Protocol):
    def submit(self, report: Report) -> None: ...


class ProbeSource(Protocol):
    def drain(self, limit: int) -> tuple[list[Probe], int]:
        """Up to ``limit`` finished probes, and how many older ones were dropped."""
        ...


def read_boot_id(procfs: Path) -> str:
    """The kernel's boot id: a change tells the aggregator that every counter restarted.

    Without it (a recorded tree, a sandbox) the agent makes one up per process. That makes an
    agent restart look like a reboot, which costs the aggregator one interval of rates and never
    produces a negative rate; a missing id must not stop the report.
    """
    path = procfs / "sys" / "kernel" / "random" / "boot_id"
    try:
        text = path.read_text().strip()
    except OSError as exc:
        made_up = f"agent-{uuid.uuid4()}"
        log.warning(
            "boot_id unreadable; using a per-process id",
            extra={"path": str(path), "error": str(exc), "boot_id": made_up},
        )
        return made_up
    return text[:64] or f"agent-{uuid.uuid4()}"


class Agent:
    """Builds reports from collectors. Thread-safe to read ``last_cycle`` from other threads."""

    def __init__(
        self,
        *,
        node: str,
        collectors: Sequence[Collector],
        clock: Clock,
        boot_id: str,
        interval_seconds: float = 10.0,
        labels: Mapping[str, str] | None = None,
        probes: ProbeSource | None = None,
        pods: PodAttributor | None = None,
    ) -> None:
        self.node = node
        self.probes = probes
        self.pods = pods
        self.collectors = list(collectors)
        self.clock = clock
        self.boot_id = boot_id
        self.interval_seconds = interval_seconds
        self.labels = dict(labels or {})
        self._seq = 0
        # seq restarts with this process; the run id tells the aggregator it is a new count.
        self.run_id = uuid.uuid4().hex
        self._last: CycleResult | None = None
        # collector name -> the failure last logged for it: a failure that repeats every cycle
        # (a wrong --sysfs-root, a missing driver) is logged once, and again when it changes.
        self._failing: dict[str, str] = {}

    @property
    def last_cycle(self) -> CycleResult | None:
        return self._last

    def cycle(self) -> CycleResult:
        gpus: list[Gpu] = []
        nics: list[Nic] = []
        events: list[Event] = []
        errors: list[CollectorError] = []
        statuses: list[CollectorStatus] = []
        jobs: Jobs | None = None
        for collector in self.collectors:
            start = time.perf_counter()
            support = collector.supported()
            if not support.supported:
                statuses.append(CollectorStatus(collector.name, False, support.reason, False, 0.0))
                continue
            try:
                out = collector.collect()
            except Exception as exc:  # a collector bug must not cost the other collectors' data
                message = f"{type(exc).__name__}: {exc}"
                if self._failing.get(collector.name) != message:
                    self._failing[collector.name] = message
                    log.warning("collector failed", extra={"collector": collector.name, "error": message})
                errors.append(CollectorError(collector=collector.name, message=message[:MAX_MESSAGE]))
                statuses.append(
                    CollectorStatus(collector.name, True, message, False, time.perf_counter() - start)
                )
                continue
            if self._failing.pop(collector.name, None) is not None:
                log.info("collector recovered", extra={"collector": collector.name})
            gpus.extend(out.gpus)
            nics.extend(out.nics)
            events.extend(out.events)
            if out.jobs is not None:
                jobs = out.jobs
            errors.extend(_collector_error(collector.name, e) for e in out.errors)
            statuses.append(CollectorStatus(collector.name, True, "", True, time.perf_counter() - start))

        pods: list[GpuAllocation] | None = None
        if self.pods is not None:
            # After the collectors: attribution ties the kubelet's device IDs to these GPUs.
            try:
                attribution = self.pods.collect(gpus)
            except Exception as exc:  # like a collector's: a bug here must not cost the report
                message = f"{type(exc).__name__}: {exc}"
                log.warning("pod attribution failed", extra={"error": message})
                errors.append(CollectorError(collector=self.pods.name, message=message[:MAX_MESSAGE]))
                statuses.append(CollectorStatus(self.pods.name, True, message, False, 0.0))
            else:
                pods = attribution.pods
                statuses.append(attribution.status)
                errors.extend(_collector_error(self.pods.name, e) for e in attribution.errors)

        if jobs is not None and pods:
            # The Inspector rows of a pod holding one GPU ran on that GPU.
            jobs = attribute_collectives(jobs, pods, {g.index: g.uuid for g in gpus})

        if len(events) > MAX_EVENTS:
            # Collectors bound their own queues; this only guards the schema if several fill up.
            dropped = len(events) - MAX_EVENTS
            events = sorted(events, key=lambda e: e.time)[-MAX_EVENTS:]
            errors.append(CollectorError(collector="agent", message=f"{dropped} oldest events dropped"))
        probes: list[Probe] = []
        if self.probes is not None:
            probes, dropped_probes = self.probes.drain(MAX_PROBES)
            if dropped_probes:
                errors.append(
                    CollectorError(
                        collector="probes", message=f"{dropped_probes} oldest probe results dropped"
                    )
                )
        if len(errors) > MAX_ERRORS:
            extra = len(errors) - (MAX_ERRORS - 1)
            errors = [
                *errors[: MAX_ERRORS - 1],
                CollectorError(collector="agent", message=f"{extra} more errors not shown"),
            ]

        report = Report(
            schema=SCHEMA_ID,
            node=self.node,
            time=self.clock.time(),
            seq=self._seq,
            boot_id=self.boot_id,
            run=self.run_id,
            agent_version=__version__,
            interval_seconds=self.interval_seconds,
            gpus=tuple(sorted(gpus, key=lambda g: g.index)),
            nics=tuple(nics),
            labels=dict(self.labels) if self.labels else UNSET,
            events=tuple(events) if events else UNSET,
            probes=tuple(probes) if probes else UNSET,
            errors=tuple(errors) if errors else UNSET,
            jobs=jobs if jobs is not None else UNSET,
            pods=tuple(pods) if pods is not None else UNSET,
        )
        self._seq += 1
        result = CycleResult(report=report, statuses=tuple(statuses))
        self._last = result
        return result

    def run(
        self,
        sink: ReportSink | None,
        stop: threading.Event,
        *,
        rng: random.Random | None = None,
        on_cycle: Callable[[CycleResult], None] | None = None,
    ) -> None:
        """Collect every interval until ``stop`` is set.

        The first cycle waits a random share of one interval so that 7,500 agents started by one
        DaemonSet rollout do not report in lockstep. Later cycles keep a fixed schedule on the
        monotonic clock; a cycle that overruns skips the slots it missed instead of bunching up.
        """
        rng = rng or random.Random()
        jitter = rng.uniform(0.0, self.interval_seconds)
        log.info("agent starting", extra={"node": self.node, "first_cycle_in_s": round(jitter, 3)})
        if stop.wait(jitter):
            return
        next_at = self.clock.monotonic()
        while not stop.is_set():
            try:
                result = self.cycle()
            except Exception:  # keep the node reporting whatever happens in one cycle
                log.exception("cycle failed", extra={"node": self.node})
            else:
                if sink is not None:
                    sink.submit(result.report)
                if on_cycle is not None:
                    on_cycle(result)
            now = self.clock.monotonic()
            next_at += self.interval_seconds
            if next_at <= now:
                skipped = int((now - next_at) // self.interval_seconds) + 1
                next_at += skipped * self.interval_seconds
                log.warning("cycle overran its interval", extra={"skipped_slots": skipped})
            stop.wait(next_at - now)

    def close(self) -> None:
        if self.pods is not None:
            self.pods.close()
        for collector in self.collectors:
            try:
                collector.close()
            except Exception:
                log.exception("collector close failed", extra={"collector": collector.name})
