"""The aggregator's one detection pipeline, shared by the live service and by replay.

    ingest(report, received)   fleet history -> detectors' observe -> rule engine -> health
                               machine -> decision log
    advance(now)               silence and systemic events, the detectors' runs, time-driven
                               transitions (probation)
    advance_steps(now)         the same, one step at a time (the service yields to the event loop
                               between steps, so a slow detector run does not hold up every POST);
                               a step may be an ``OffloadStep``, whose costly, pure part the service
                               runs in a worker thread (the forest's, peer and trend detectors' pool runs)

By default ``ingest`` ends with ``advance(received)``, so a caller that only ingests (replay,
benchmarks, tests) sees time-driven work happen. The service turns that off
(``advance_on_ingest = False``) and runs ``advance_steps`` from its periodic task instead: a POST
then does rules and bookkeeping only, never a fleet detector's run.

Everything is driven by the ``received``/``now`` times passed in: the live service passes its
clock, replay passes the reports' own times. Given the same reports in the same order with the
same times, the decisions are the same, which is what makes replay a faithful test of history.

What the pipeline needs from outside, it is given when it is built (``aggregator.app`` builds it):
the cluster's view of the nodes (``ClusterView``: node labels, the preflight taint, pool sizes; the
remediation runtime's node cache, or ``NO_CLUSTER``), the active probe scheduler (or None), the
detectors (``aggregator.detect.DETECTORS``) and the callbacks for decisions and systemic events.

A detector that raises is isolated: the exception is logged (once per ``_ERROR_LOG_EVERY_S`` per
detector) and counted, its earlier findings stay as they were, and everything else goes on: the
report is still ingested, the health machine still ticks.
"""

from __future__ import annotations

import logging
import math
import time as _time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, ParamSpec, Protocol, TypeVar

import msgspec

from agent.attribution import gpu_holders
from agent.report import GpuAllocation, Report
from aggregator.config import Config
from aggregator.decisions import AWAITING_CLUSTER, Decision, DecisionLog, PodOnNode, Reason
from aggregator.detect import BUILTIN_SOURCES, DETECTORS, Detector, DetectorSpec
from aggregator.detect.base import MeasuresPairs, Offload, OffloadingPoolDetector, PoolDetector, SwitchAlert
from aggregator.fleet.frame import FleetFrames
from aggregator.fleet.history import Fleet
from aggregator.fleet.pools import UNKNOWN_POOL, Placement, gpu_model_pool, place
from aggregator.fleet.recent import RecentReports
from aggregator.fleet.sendtime import SendTime
from aggregator.health import HealthMachine, NodeHealth, about_replaced_gpu, carried_over, finding_of_snapshot
from aggregator.links import LinkHealth
from aggregator.metrics import DetectorStats, JobTable, ReportsJobs
from aggregator.model import Finding, IngestOutcome
from aggregator.ordering import SeqTracker
from aggregator.probes.scheduler import ProbeScheduler, report_is_idle
from aggregator.remediate.limits import BreakerState, SafetyLimits
from aggregator.remediate.model import HealthSnapshot, NodeIntent, SnapshotFinding
from aggregator.rules.engine import RuleEngine
from aggregator.rules.model import Rule
from aggregator.silence import SilenceDetector, SystemicEvent
from aggregator.story import runbook_url

log = logging.getLogger(__name__)

TICK_SECONDS = 1.0  # time-driven work runs at most once per tick of the aggregator's clock
_HISTORY_KEEP = 60  # recent report summaries per node for the API
# A failing detector fails on every report or every run: one log line (with the trace) per this
# many seconds per detector says so; the count of failures is in its metrics.
_ERROR_LOG_EVERY_S: Final = 60.0


class ClusterView(Protocol):
    """What the cluster says about nodes (the remediation runtime's node cache)."""

    def labels(self, node: str) -> Mapping[str, str]:
        """The node's Kubernetes labels (pools may come from them); empty when unknown."""
        ...

    def has_preflight_taint(self, node: str) -> bool:
        """Whether the node carries the preflight taint now."""
        ...

    def pool_size(self, pool: str) -> int:
        """How many nodes the cluster has in ``pool``, reporting or not (0 when unknown)."""
        ...


class _NoCluster:
    """No Kubernetes (remediation off, replay): no labels, no taints, no pool sizes."""

    def labels(self, node: str) -> Mapping[str, str]:
        return {}

    def has_preflight_taint(self, node: str) -> bool:
        return False

    def pool_size(self, pool: str) -> int:
        return 0


NO_CLUSTER: Final[ClusterView] = _NoCluster()


class OffloadStep:
    """A step of ``advance_steps`` whose work may run in another thread: an ``Offload.compute``.

    Whoever drives the steps may call ``run()`` (once, from any thread) and must let it return
    before resuming the generator; the service does so in a one-thread executor, so the event loop
    goes on answering reports meanwhile. A driver that does not (``advance``, replay, tests) leaves
    it to the pipeline, which runs it inline when resumed: the same computation on the same copied
    input, so the same decisions. Because the generator waits for it, a run is never started twice
    nor overtaken by the detector's next one.
    """

    __slots__ = ("_compute", "_done", "_error", "_value", "seconds")

    def __init__(self, compute: Callable[[], object]) -> None:
        self._compute = compute
        self._done = False
        self._value: object = None
        self._error: Exception | None = None
        self.seconds = 0.0  # how long compute took, wherever it ran

    def run(self) -> None:
        """Compute, once; an exception is kept for ``result`` to raise on the pipeline's thread."""
        if self._done:
            return
        started = _time.perf_counter()
        try:
            self._value = self._compute()
        except Exception as e:  # re-raised by result(), where the detector's failure is counted
            self._error = e
        finally:
            self.seconds = _time.perf_counter() - started
            self._done = True

    @property
    def done(self) -> bool:
        return self._done

    def result(self) -> object:
        """The compute's value (computed here if no driver ran it), or what it raised."""
        self.run()
        if self._error is not None:
            raise self._error
        return self._value


_T = TypeVar("_T")
_P = ParamSpec("_P")


class _Failed:
    """What ``_Running.attempt`` returns for a hook that raised (its earlier findings stand)."""


_FAILED: Final = _Failed()


def _finish(work: Offload[Any], step: OffloadStep) -> dict[str, list[Finding]]:
    """An offloaded pool run's last part, on the caller's thread: its compute's result handed
    to ``finish`` (the compute runs here first if the driver did not run it)."""
    return work.finish(step.result())


@dataclass
class _Running:
    """One detector in the pipeline: when it runs next, its own link state machine, its counts."""

    name: str
    detector: Detector
    links: LinkHealth
    every: float  # seconds from one run to the next (``Pipeline.__init__`` says how it is chosen)
    due: float = -math.inf
    switches: list[SwitchAlert] = field(default_factory=list)
    runs: int = 0
    errors: int = 0
    seconds: float = 0.0
    logged_at: float = -math.inf
    unlogged: int = 0  # failures since the last one logged

    def attempt(
        self, now: float, call: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs
    ) -> _T | _Failed:
        """``call(*args, **kwargs)``, timed into ``seconds``, or ``_FAILED`` if it raised: counted
        and logged by ``failed``, never raised further."""
        started = _time.perf_counter()
        try:
            return call(*args, **kwargs)
        except Exception:
            self.failed("run", now)
            return _FAILED
        finally:
            self.seconds += _time.perf_counter() - started

    def failed(self, hook: str, now: float) -> None:
        """One of its hooks raised (call from the ``except``): counted, and logged with the trace
        unless it was logged less than ``_ERROR_LOG_EVERY_S`` ago; never raised further."""
        self.errors += 1
        if now - self.logged_at >= _ERROR_LOG_EVERY_S or now < self.logged_at:
            log.exception(
                "detector failed",
                extra={"detector": self.name, "hook": hook, "failures_unlogged": self.unlogged},
            )
            self.logged_at, self.unlogged = now, 0
        else:
            self.unlogged += 1


@dataclass
class _NodeRecord:
    placement: Placement
    last_received: float
    last_report_time: float
    seen: SeqTracker = field(default_factory=SeqTracker)
    recent: RecentReports = field(default_factory=lambda: RecentReports(_HISTORY_KEEP))
    first_received: float = 0.0
    boot_id: str | None = None
    # What placement reads of the report, so the node is placed again when the cluster's labels
    # arrive (the first Node list), without keeping the report.
    own_labels: Mapping[str, str] = field(default_factory=dict)
    model_pool: str | None = None
    gpu_uuids: dict[int, str] = field(default_factory=dict)  # GPU index -> UUID, last report
    clean_reports: int = 0  # reports in a row with the node healthy and no finding at all
    clean_since: float | None = None
    preflight_passed: bool = False
    # The last GPU-to-pod attribution the node sent (reports without one keep it: a kubelet that
    # did not answer once says nothing about who holds the GPUs), and when it was received.
    pods: tuple[GpuAllocation, ...] | None = None
    pods_received: float | None = None
    # When its reports were measured on our clock (the frames' slot time); new with each boot.
    sent: SendTime = field(default_factory=SendTime)


class Pipeline:
    def __init__(
        self,
        config: Config,
        rules: list[Rule],
        decisions: DecisionLog,
        *,
        cluster: ClusterView = NO_CLUSTER,
        probes: ProbeScheduler | None = None,
        detectors: Sequence[DetectorSpec[Any]] = DETECTORS,
        on_decision: Callable[[Decision], None] | None = None,
        on_systemic: Callable[[SystemicEvent], None] | None = None,
    ) -> None:
        self.config = config
        self.fleet = Fleet(config.fleet, max_nic_keys=2 * config.ingest.max_nics)
        # As many NICs as a node may report (ingest.max_nics).
        self.frames = FleetFrames(config.fleet, max_nics=config.ingest.max_nics)
        self.engine = RuleEngine(rules)
        # Every node keeps the series the rules read from its first report on, so a rule that
        # looks at a field only now and then still has a full window when it does.
        series = self.engine.series
        self.fleet.registry.track_gpu_counters(*sorted(series.gpu_counters))
        self.fleet.registry.track_nvlink_counters(*sorted(series.nvlink_counters))
        self.fleet.registry.track_nic_counters(*sorted(series.nic_counters))
        self.fleet.registry.track_gpu_gauges(*sorted(series.gpu_gauges))
        self.limits = SafetyLimits(config.remediation.limits)
        # The safety limits decide "held" only where remediation would act (dry-run shows what it
        # would do); with remediation off, decisions say what detection found, nothing more.
        self.health = HealthMachine(
            config.health, gate=self._gate if config.remediation.mode != "off" else None
        )
        # Nodes known only from the cluster (restored after a restart, not yet reporting).
        self._restored_placement: dict[str, Placement] = {}
        # Their boot, as the snapshot said: reboot-cleared evidence ends only with another boot,
        # so a snapshot rewritten before the node reports again must still name it.
        self._restored_boot: dict[str, str] = {}
        self.shadow_findings: dict[str, list[Finding]] = {}  # node -> findings of rules on trial
        self._cluster = cluster
        # Active probes (aggregator/probes): given when probes are on, never in replay.
        self.probes = probes
        self.silence = SilenceDetector(config.silence, config.fleet.interval_seconds)
        self.decisions = decisions
        names = [spec.name for spec in detectors]
        if len(set(names)) != len(names) or set(names) & set(BUILTIN_SOURCES):
            raise ValueError(f"detector names must be unique and not {BUILTIN_SOURCES}: {names}")
        # Each detector has its own link state machine: one that judges links confirms a slow link
        # over two of its own runs (the state machine stays empty for the others).
        self._detectors: list[_Running] = []
        for spec in detectors:
            det = spec.build(config.detectors)
            every = det.every_seconds
            if isinstance(det, PoolDetector):
                # A pool detector judges complete slots, and one completes an interval: run more
                # often, it judges the same slots again (every other run of a 30 s detector at a
                # 60 s interval, half its CPU).
                every = max(every, config.fleet.interval_seconds)
            links = LinkHealth(
                suspect_for_seconds=config.health.suspect_for_seconds,
                clear_for_seconds=config.links.link_clear_for_seconds,
                confirm_for_seconds=every,  # two of its own runs
            )
            self._detectors.append(_Running(spec.name, det, links, every))
        self._on_decision = on_decision
        self._on_systemic = on_systemic
        self._nodes: dict[str, _NodeRecord] = {}
        self._next_tick = -math.inf
        # At most every node's last_received (they only grow; a new node lowers it): until it is
        # silent_after_seconds old nobody can be silent, so the per-second tick need not look at
        # the fleet. Recomputed by each pass over it; -inf forces one.
        self._received_floor = math.inf
        self._silent: set[str] = set()  # nodes with a silence finding now
        self.systemic_log: deque[SystemicEvent] = deque(maxlen=1000)
        # State first, decisions second: until the cluster view is rebuilt (``cluster_synced``),
        # quarantines are not judged against the limits, and their decisions wait here, in order.
        self._cluster_ready = True
        self._deferred: list[Decision] = []
        self._deferred_nodes: set[str] = set()
        # Whether ``ingest`` runs the time-driven work itself (see the module docstring).
        self.advance_on_ingest = True

    # -- ingest ---------------------------------------------------------------------------------

    def ingest(self, report: Report, received: float) -> IngestOutcome:
        rec = self._nodes.get(report.node)
        # New means a new (boot_id, run, seq) for the node, whatever its clock says
        # (aggregator/ordering.py): a replayed old report is a duplicate and not liveness.
        if rec is not None and not rec.seen.is_new(report):
            return IngestOutcome.DUPLICATE
        own = dict(report.labels) if report.labels is not msgspec.UNSET else {}
        model_pool = gpu_model_pool(report)
        placement = place(own, model_pool, self._cluster.labels(report.node))
        if rec is None:
            ingest = self.config.ingest
            rec = self._nodes[report.node] = _NodeRecord(
                placement,
                received,
                report.time,
                seen=SeqTracker(window=ingest.duplicate_window, streams=ingest.streams_per_node),
                first_received=received,
            )
            self._received_floor = min(self._received_floor, received)
        rec.placement = placement
        rec.own_labels, rec.model_pool = own, model_pool
        rec.last_received = max(rec.last_received, received)
        rec.last_report_time = max(rec.last_report_time, report.time)
        rec.recent.add(report, received)
        if rec.boot_id != report.boot_id:
            rec.sent = SendTime()  # a reboot may have set the clock
        rec.boot_id = report.boot_id
        rec.gpu_uuids = {g.index: g.uuid for g in report.gpus if g.uuid}
        if report.pods is not msgspec.UNSET:
            rec.pods, rec.pods_received = tuple(report.pods), received
        self._restored_placement.pop(report.node, None)
        self._restored_boot.pop(report.node, None)

        view = self.fleet.add(report)
        # When it was measured, on the aggregator's clock, rather than when it was taken off the
        # queue (aggregator/fleet/sendtime.py): a node whose clock runs ahead must not move its
        # pool's newest slot forward, and a backlog must not shift the slots, nor date the probe
        # results and job samples the detectors keep.
        measured = rec.sent.place(report.time, received)
        self.frames.record(view, placement, at=measured)
        if self.probes is not None:
            self.probes.observe(
                report.node,
                placement,
                idle=report_is_idle(report, self.config.probes),
                now=received,
                preflight=self._cluster.has_preflight_taint(report.node),
            )
            kept = [p for p in report.probes or () if self.probes.result(report.node, p, placement, received)]
            self._preflight_probes(report.node, received)
        else:
            # No scheduler (replay, probes off): a pair result counts when its peer is a node.
            kept = [p for p in report.probes or () if p.peer is None or p.peer in self._nodes]
        # The detectors see only the probe results that count: a peer that is no node of the
        # fleet (or a probe nobody assigned) would be state one token makes up at will.
        observed = report
        if report.probes and len(kept) != len(report.probes):
            observed = msgspec.structs.replace(report, probes=tuple(kept) if kept else msgspec.UNSET)
        for run in self._detectors:
            try:
                run.detector.observe_report(observed, placement, measured)
            except Exception:
                run.failed("observe_report", received)
        findings = self.engine.evaluate(view)
        # Nothing reads the view after this: the previous report it held can go (half of what a
        # node's history holds in full between reports).
        self.fleet.settle(report.node)
        if report.node in self._silent:
            # The node is talking again: whatever silence said is over.
            self._silent.discard(report.node)
            self._emit(self.health.update(report.node, "silence", (), received))
        if any(f.shadow for f in findings):
            self.shadow_findings[report.node] = [f for f in findings if f.shadow]
            findings = [f for f in findings if not f.shadow]
        else:
            self.shadow_findings.pop(report.node, None)
        # Restored evidence about a GPU the node no longer has (replaced: another UUID) ends.
        self._emit(self.health.replaced_gpus(report.node, rec.gpu_uuids, received))
        self._emit(self.health.update(report.node, "rule", findings, received))
        self._note_clean(report.node, rec, received)
        if self.advance_on_ingest:
            self.advance(received)
        # Taken in only once processed: after a failure a redelivery must be processed, not
        # called a duplicate.
        rec.seen.record(report)
        return IngestOutcome.ACCEPTED

    # -- time-driven ------------------------------------------------------------------------------

    def advance(self, now: float) -> None:
        for _ in self.advance_steps(now):
            pass

    def advance_steps(self, now: float) -> Iterator[OffloadStep | None]:
        """``advance(now)`` as a generator that yields after silence and after each detector's
        run (a pool detector's, after each pool): whoever drives it may let other work (reports)
        in between. Reports ingested between two steps are seen by the detectors that run after
        them, which is what a live fleet would see a moment later anyway. An offloading pool
        detector's pool yields an ``OffloadStep`` instead: its compute, which the driver may run
        in a worker thread before resuming (see ``OffloadStep``)."""
        if now < self._next_tick - 2 * TICK_SECONDS:
            # The aggregator's clock stepped back (NTP, a VM restore). Without this, silence,
            # probation and the detectors would wait until the clock caught up again.
            log.warning("clock stepped back", extra={"now": now, "expected_at_least": self._next_tick})
            self._next_tick = -math.inf
            for rec in self._nodes.values():
                rec.last_received = min(rec.last_received, now)
            self._received_floor = -math.inf
        if now < self._next_tick:
            return
        tick = math.floor(now / TICK_SECONDS) * TICK_SECONDS
        self._next_tick = tick + TICK_SECONDS
        # Runs every second. In the common case (nobody silent, nobody near it) it does not look at
        # the fleet at all: one pass over 25,000 nodes' receive times every second was a few
        # percent of a shard's core. Once the floor could be quiet, one pass finds the true
        # oldest, and the silence check runs only if that one is.
        quiet_after = tick - self.silence.silent_after_seconds
        per_node: dict[str, list[Finding]] = {}
        events: list[SystemicEvent] = []
        busy = bool(self._silent) or bool(self.silence.active_events())
        if busy or self._received_floor < quiet_after:
            last = {n: r.last_received for n, r in self._nodes.items()}
            self._received_floor = min(last.values(), default=math.inf)
            if busy or self._received_floor < quiet_after:
                placements = {n: r.placement for n, r in self._nodes.items()}
                per_node, events = self.silence.check(last, placements, tick)
        for ev in events:
            self.systemic_log.append(ev)
            log.warning(
                "systemic event",
                extra={"state": ev.state, "domain": f"{ev.domain_kind} {ev.domain}", "summary": ev.summary},
            )
            if self._on_systemic is not None:
                self._on_systemic(ev)
        for node, findings in per_node.items():
            self._emit(self.health.update(node, "silence", findings, tick))
        for node in self._silent - per_node.keys():
            self._emit(self.health.update(node, "silence", (), tick))
        self._silent = set(per_node)
        self._forget_long_gone(tick)
        yield None
        for run in self._detectors:
            if tick < run.due:
                continue
            if isinstance(run.detector, PoolDetector):
                yield from self._run_by_pool(run, run.detector, tick)
            else:
                self._run_detector(run, tick)
                yield None
        if self.probes is not None:
            self.probes.tick(tick)
        for d in self.health.expire_restored(tick):
            self._emit(d)
        for d in self.health.tick(tick):
            self._emit(d)

    def _run_by_pool(
        self, run: _Running, detector: PoolDetector, tick: float
    ) -> Iterator[OffloadStep | None]:
        """A pool detector's run, one pool a step: a pool judged is a pool whose findings are
        applied, and the one after it may wait for the reports that came in meanwhile. A pool
        whose run raises keeps what it had; the other pools are judged all the same. An
        offloading detector's pool is prepared, its compute yielded as the step, and finished
        (findings applied) when the generator is resumed."""
        run.due = tick + run.every
        run.runs += 1
        for pool in list(self.frames.pools()):
            frame = self.frames.frame(pool)
            if frame is None:
                continue
            found: dict[str, list[Finding]] | _Failed
            if isinstance(detector, OffloadingPoolDetector):
                work: Offload[Any] | _Failed = run.attempt(tick, detector.prepare_pool, frame, tick)
                if isinstance(work, _Failed):
                    continue
                step = OffloadStep(work.compute)
                yield step
                if step.done:  # the driver ran it (a worker thread) and timed it; else finish runs it
                    run.seconds += step.seconds
                found = run.attempt(tick, _finish, work, step)
            else:
                found = run.attempt(tick, detector.run_pool, frame, tick)
            if isinstance(found, _Failed):
                continue  # its earlier findings stand; the other pools are judged all the same
            for node, findings in found.items():
                self._emit(self.health.update(node, run.name, findings, tick))
            if not isinstance(detector, OffloadingPoolDetector):
                yield None

    def _run_detector(self, run: _Running, tick: float) -> None:
        run.due = tick + run.every
        run.runs += 1
        verdict = run.attempt(tick, run.detector.run, self.frames, tick)
        if isinstance(verdict, _Failed):
            return  # what it found before stands until a run succeeds
        for node, found in verdict.nodes.items():
            self._emit(self.health.update(node, run.name, found, tick))
        if verdict.links is not None:
            for d in run.links.update(verdict.links, tick):
                self._emit(d)
        run.switches = list(verdict.switches)

    @property
    def switches(self) -> list[SwitchAlert]:
        """The shared-switch problems the detectors point at now."""
        return [sw for run in self._detectors for sw in run.switches]

    def detector_stats(self) -> tuple[DetectorStats, ...]:
        """Each detector's runs, their time and its failures so far (for its metrics)."""
        return tuple(DetectorStats(r.name, r.runs, r.seconds, r.errors) for r in self._detectors)

    def job_tables(self) -> tuple[JobTable, ...]:
        """What the job-data detectors' last runs saw (their top-N metrics)."""
        return tuple(r.detector.job_table() for r in self._detectors if isinstance(r.detector, ReportsJobs))

    def _forget_long_gone(self, now: float) -> None:
        """Drop nodes silent for ``silence.forget_after_seconds`` (decommissioned, renamed), so
        state does not grow forever and a dead node does not count in every later outage. A node
        still taken out (quarantined, probation) is kept: forgetting it would release it."""
        limit = self.config.silence.forget_after_seconds
        if now - self._received_floor <= limit:
            return  # nobody is that old (the floor is at most everyone's last report)
        gone = [
            n
            for n, r in self._nodes.items()
            if now - r.last_received > limit
            and (h := self.health.get(n)) is not None
            and h.state in ("healthy", "suspect")
        ]
        for node in gone:
            log.info("forgetting a long-silent node", extra={"node": node, "silent_for_s": limit})
            self._drop(node, now)

    def _drop(self, node: str, now: float) -> None:
        self._nodes.pop(node, None)
        self._restored_placement.pop(node, None)
        self._silent.discard(node)
        self.health.forget(node)
        self.engine.forget(node)
        self.fleet.forget(node)
        self.frames.forget(node)
        for run in self._detectors:
            try:
                run.detector.forget(node)
            except Exception:
                run.failed("forget", now)

    def hand_over(self, node: str, now: float) -> bool:
        """Forget ``node`` whatever its state: its pool moved to another shard, whose replicas
        restore it from the cluster (aggregator/shard/owned.py). Unlike a node forgotten after
        a long silence, a quarantined node is dropped too: from now on this replica gives no
        intent for it, so it leaves the node as it is, and its new owner decides. True if known."""
        if self.placement(node) is None and self.health.get(node) is None:
            return False
        self._drop(node, now)
        return True

    def pool_now(self, node: str) -> str | None:
        """The pool ``node`` would be placed in now: as at its last report, with the Kubernetes
        labels as they are now (a relabelled node moves before it reports again); None when
        the node is not known."""
        rec = self._nodes.get(node)
        if rec is not None:
            labels = self._cluster.labels(node)
            # No labels at all: the cluster does not know the node now (deleted, not registered
            # yet), which says nothing of its pool; every Node has some labels.
            return place(rec.own_labels, rec.model_pool, labels).pool if labels else rec.placement.pool
        restored = self._restored_placement.get(node)
        return restored.pool if restored is not None else None

    # -- remediation ------------------------------------------------------------------------------

    def placement(self, node: str) -> Placement | None:
        rec = self._nodes.get(node)
        return rec.placement if rec is not None else self._restored_placement.get(node)

    def _gate(self, h: NodeHealth, now: float) -> str | None:
        placement = self.placement(h.node) or Placement(UNKNOWN_POOL)
        out = [
            p
            for n, other in self.health.nodes().items()
            if other.tainted and n != h.node and (p := self.placement(n)) is not None
        ]
        known = sum(1 for r in self._nodes.values() if r.placement.pool == placement.pool) + sum(
            1 for p in self._restored_placement.values() if p.pool == placement.pool
        )
        # The cluster's count includes nodes that are down or not reporting yet, as the pool-share
        # limit must after a restart.
        pool_size = max(known, self._cluster.pool_size(placement.pool))
        hold = self.limits.check(h.node, placement, out, pool_size, now)
        return hold.reason if hold is not None else None

    @property
    def cluster_ready(self) -> bool:
        """Whether the limits are judged: the cluster view is whole (always, without a cluster)."""
        return self._cluster_ready

    def await_cluster(self) -> None:
        """From now until ``cluster_synced``, quarantines are decided but not judged against the
        limits, and their decisions are queued (the remediation runtime calls this when it is
        built, before anything is ingested)."""
        self._cluster_ready = False
        self.health.gate_ready = False

    def cluster_synced(self, now: float) -> None:
        """The cluster view is rebuilt: every node carrying our taint or snapshot restored, the
        breaker adopted from the Lease, the node labels cached. Nodes are placed again from the
        labels (so no snapshot is written with a pool it will not keep), then the quarantines
        decided meanwhile are judged, oldest first, and their decisions recorded."""
        if self._cluster_ready:
            return
        for name, rec in self._nodes.items():
            rec.placement = place(rec.own_labels, rec.model_pool, self._cluster.labels(name))
        for name in self.health.nodes():
            # Carried over from the decision log (no snapshot named its pool): from the labels.
            if name not in self._nodes and name not in self._restored_placement:
                labels = self._cluster.labels(name)
                if labels:
                    self._restored_placement[name] = place({}, None, labels)
        self._cluster_ready = True
        self.health.gate_ready = True
        verdicts: dict[str, tuple[str, str | None] | None] = {}
        for d in self._deferred:  # oldest first
            if d.node not in verdicts:
                verdicts[d.node] = self.health.judge_pending(d.node, now)
        deferred, self._deferred = self._deferred, []
        self._deferred_nodes.clear()
        for queued in deferred:
            # Each was recorded when it was decided (``_emit``); what is new now is the action.
            verdict = verdicts.get(queued.node)
            if queued.action == "taint" and verdict is not None:
                acted = msgspec.structs.replace(queued, time=now, previous=queued.state)
                self._emit(_judged(acted, verdict))
            elif self._on_decision is not None:
                self._on_decision(queued)
        log.info(
            "cluster view rebuilt: decisions act from now on",
            extra={"judged": sum(1 for v in verdicts.values() if v is not None), "queued": len(deferred)},
        )

    def reset_breaker(self, by: str, now: float) -> BreakerState:
        """A human closed the safety breaker: held quarantines are tried again, oldest first."""
        state = self.limits.reset(by, now)
        self._retry_held(now)
        return state

    def adopt_breaker(self, state: BreakerState, now: float) -> None:
        """The breaker as another replica (or our previous life) left it in the Lease."""
        was_open = self.limits.open
        if self.limits.adopt(state) and was_open:
            self._retry_held(now)

    def _retry_held(self, now: float) -> None:
        if not self._cluster_ready:
            return  # judged with the rest once the view is whole
        held = sorted((h.since, n) for n, h in self.health.nodes().items() if h.held)
        for _since, node in held:
            if self.limits.open:
                break  # the backlog itself is past a limit: the rest stay held
            self._emit(self.health.retry_held(node, now))

    def _preflight_probes(self, node: str, now: float) -> None:
        """A node in preflight whose probes failed is quarantined with the probes' evidence
        (``remediation.preflight.require_probes``). The finding lasts until the node reboots
        (repaired), then the usual probation follows."""
        h = self.health.get(node)
        rec = self._nodes.get(node)
        if h is not None and "preflight" in h.groups and rec is not None:
            first = next(iter(h.groups["preflight"].values())).finding
            if first.evidence.get("boot_id") != rec.boot_id:
                self._emit(self.health.update(node, "preflight", (), now))
            return
        if (
            self.probes is None
            or not self.config.remediation.preflight.require_probes
            or not self._cluster.has_preflight_taint(node)
        ):
            return
        verdict, evidence = self.probes.preflight_status(node)
        if verdict != "failed":
            return
        finding = Finding(
            detector="probe",
            key="preflight-probes",
            severity="critical",
            action="quarantine",
            summary=f"failed its preflight probes: {evidence.get('note') or evidence}",
            since=now,
            rule="preflight",
            hard=True,
            clears="reboot",  # restored after a restart until the node reboots (repaired)
            evidence={
                **{k: v for k, v in evidence.items() if k != "note"},
                "boot_id": rec.boot_id if rec else None,
            },
        )
        self._emit(self.health.update(node, "preflight", [finding], now))

    def _note_clean(self, node: str, rec: _NodeRecord, received: float) -> None:
        """Count the clean reports in a row that preflight wants to see."""
        h = self.health.get(node)
        if h is None or (h.state == "healthy" and not h.groups):
            rec.clean_reports += 1
            if rec.clean_since is None:
                rec.clean_since = received
        else:
            rec.clean_reports = 0
            rec.clean_since = None

    def intent_nodes(self) -> list[str]:
        return sorted(self.health.nodes().keys() | self._nodes.keys())

    def intent(self, node: str) -> NodeIntent | None:
        h = self.health.get(node)
        rec = self._nodes.get(node)
        if h is None and rec is None:
            return None
        cfg = self.config.remediation
        state = h.state if h is not None else "healthy"
        active = h.active() if h is not None else []
        if state == "suspect" and active and all(t.finding.detector == "silence" for t in active):
            # We cannot hear it: leave the node as it is. When the aggregator loses the network,
            # every node is silent, and writing a condition and an event to each would flood the
            # API server with news about our own outage.
            return None
        quarantine = sorted(
            (t for t in active if t.finding.action == "quarantine"),
            key=lambda t: (not t.finding.hard, t.first_seen, t.finding.key),
        )
        effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
        if h is not None and h.tainted:
            effect = (
                "NoExecute"
                if any(t.finding.taint_effect == "NoExecute" for t in quarantine)
                else "NoSchedule"
            )
        elif state == "suspect" and cfg.suspect_effect is not None:
            effect = cfg.suspect_effect
        reasons = h.reasons if h is not None else []
        lead = quarantine[0].finding if quarantine else None
        if lead is not None:
            code = lead.rule or lead.key.partition(":")[0] or lead.detector
        elif reasons and reasons[0].rule:
            code = reasons[0].rule
        else:
            code = reasons[0].detector if reasons else state
        message = reasons[0].summary if reasons else state
        if len(reasons) > 1:
            message += f" (+{len(reasons) - 1} more)"
        placement = self.placement(node)
        boot_id = rec.boot_id if rec is not None else self._restored_boot.get(node)
        snap = self.health.snapshot(node, boot_id)
        if snap is None:
            snap = HealthSnapshot(state="healthy", since=0.0)
        snap = msgspec.structs.replace(
            snap,
            reason_code=code,
            message=message[:1024],
            pool=placement.pool if placement else None,
            rack=placement.rack if placement else None,
            leaf=placement.leaf if placement else None,
        )
        return NodeIntent(
            node=node,
            state=state,
            since=h.since if h is not None else (rec.first_received if rec is not None else 0.0),
            effect=effect,
            reason_code=code,
            message=message[:1024],
            evidence_key=",".join(sorted(t.finding.key for t in quarantine)) or code,
            held=h.held if h is not None else False,
            snapshot=snap,
            preflight=self._preflight(node, h, rec),
            runbook_url=runbook_url(
                self.config.notify.runbook_base_url,
                held=snap.held,
                lemon=snap.lemon,
                evidence=(r.evidence for r in reasons),
            ),
            probation_seconds=self.config.health.probation_seconds,
            clear_for_seconds=self.config.health.clear_for_seconds,
        )

    def _preflight(
        self, node: str, h: NodeHealth | None, rec: _NodeRecord | None
    ) -> Literal["pending", "passed", "failed"]:
        if h is not None and h.state == "quarantined":
            return "failed"
        if rec is None:
            return "pending"
        if rec.preflight_passed:
            return "passed"
        cfg = self.config.remediation.preflight
        if rec.clean_reports < cfg.healthy_reports or rec.clean_since is None:
            return "pending"
        if rec.last_received - rec.clean_since < cfg.min_seconds:
            return "pending"
        if cfg.require_probes and self.probes is not None:
            verdict, _evidence = self.probes.preflight_status(node)
            if verdict != "passed":
                return verdict
        rec.preflight_passed = True
        return "passed"

    def restore(
        self, node: str, snapshot: HealthSnapshot | None, taint_value: str | None, now: float
    ) -> None:
        """Rebuild a node from what we left on it in the cluster (IntentSource.restore). A node
        that reported before the cluster was first listed (ingestion starts at once) is merged:
        a quarantine is never undone by a report that arrived first, since an XID 79 shows once,
        and a node quarantined afresh meanwhile that the cluster shows under our taint stays
        tainted (it is out already: no gate verdict, held or not, takes the taint off)."""
        known = self.health.get(node)
        if known is not None and (known.state in ("quarantined", "probation") or known.tainted or known.held):
            episode = snapshot is not None and self.health.continue_episode(node, snapshot)
            if taint_value is not None and self.health.adopt_taint(node):
                if snapshot is not None and snapshot.tainted and snapshot.quarantines:
                    self.limits.remember_taint(max(snapshot.quarantines), now)
                if episode:
                    # What the queued decisions said, the node shows already: nothing to record.
                    self._deferred = [d for d in self._deferred if d.node != node]
                log.info(
                    "quarantine decided before the first list: our taint is on the node and stays",
                    extra={"node": node, "state": known.state, "taint": taint_value},
                )
            return  # decided since we started: that decision stands
        self._restore(node, snapshot, taint_value, now, source="cluster")

    def restore_decisions(self, decisions: Iterable[Decision], now: float) -> int:
        """Without a cluster to read (remediation off or dry-run), carry the quarantines over from
        the decision log: every node the log leaves out (quarantined, probation, or held) is
        restored with its state, the time it began (a probation clock resumes) and the evidence
        its decision gave. Returns how many were carried over."""
        carried = carried_over(decisions)
        for node, snap in carried.items():
            self._restore(node, snap, None, now, source="decision log")
        return len(carried)

    def _restore(
        self, node: str, snapshot: HealthSnapshot | None, taint_value: str | None, now: float, *, source: str
    ) -> None:
        if snapshot is None:
            if taint_value is None:
                return
            # Our taint without a readable snapshot (hand-edited, another version): it stays out,
            # and the live detectors decide from here on, through probation as usual.
            snapshot = HealthSnapshot(
                state="quarantined",
                since=now,
                tainted=True,
                reason_code=taint_value,
                findings=[
                    SnapshotFinding(
                        detector="rule",
                        key=f"restored:{taint_value}",
                        severity="critical",
                        action="quarantine",
                        summary=f"tainted {taint_value} before the aggregator restarted",
                        since=now,
                        rule=taint_value,
                    )
                ],
            )
        elif taint_value is None and snapshot.tainted:
            # Our taint is gone but the snapshot says we applied it: a human removed it while we
            # were down. Restore the evidence; the actuator sees the override and respects it.
            pass
        if not self.health.restore(
            node, snapshot, now, grace_seconds=self.config.remediation.restore_grace_seconds
        ):
            return
        if snapshot.tainted and snapshot.quarantines:
            self.limits.remember_taint(max(snapshot.quarantines), now)
        if snapshot.pool is not None and node not in self._nodes:
            self._restored_placement[node] = Placement(snapshot.pool, rack=snapshot.rack, leaf=snapshot.leaf)
        if snapshot.boot_id is not None and node not in self._nodes:
            self._restored_boot[node] = snapshot.boot_id
        latched = [f for f in snapshot.findings if f.clears == "reboot"]
        rec = self._nodes.get(node)
        if rec is not None and rec.boot_id != snapshot.boot_id:
            latched = []  # it rebooted since the snapshot: reboot-cleared evidence is over
        if rec is not None:
            latched = [f for f in latched if not about_replaced_gpu(f.evidence, rec.gpu_uuids)]
        if latched and snapshot.boot_id is not None:
            self.engine.restore_latched(
                node, snapshot.boot_id, [finding_of_snapshot(f) for f in latched], now
            )
            # Held by the engine until the node reboots; on the node at once.
            self._emit(self.health.update(node, "rule", [finding_of_snapshot(f) for f in latched], now))
        if snapshot.boot_id is not None:
            # Rate findings on counters that stop at their maximum: held again while they read it
            # (the engine keeps only those of the node's boot now).
            self.engine.restore_saturated(
                node, snapshot.boot_id, [finding_of_snapshot(f) for f in snapshot.findings], now
            )
        log.info(
            "quarantine carried over across the restart"
            if snapshot.state in ("quarantined", "probation")
            else "node restored across the restart",
            extra={
                "node": node,
                "source": source,
                "state": snapshot.state,
                "since": snapshot.since,
                "tainted": snapshot.tainted,
                "held": snapshot.held,
                "findings": len(snapshot.findings),
            },
        )

    def _emit(self, decision: Decision | None) -> None:
        if decision is None:
            return
        if decision.subject == "node" and decision.state == "quarantined" and decision.pods is msgspec.UNSET:
            decision = self._with_pods(decision)
        if not self._cluster_ready and decision.subject == "node":
            h = self.health.get(decision.node)
            if decision.node in self._deferred_nodes or (h is not None and h.pending):
                # Queued, in order, until the view is whole: then judged and acted on. The state
                # change is recorded now, without an action: the report that caused it is answered
                # 200 once this record is on disk, so a kill -9 before the first Node LIST loses
                # nothing that was answered. The action follows as a second record.
                self._deferred.append(decision)
                self._deferred_nodes.add(decision.node)
                self.decisions.append(_awaiting(decision))
                return
        self.decisions.append(decision)
        log.info(
            "decision",
            extra={
                "node": decision.node,
                "state": decision.state,
                "previous": decision.previous,
                "action": decision.action,
                "reason": decision.reasons[0].summary if decision.reasons else "",
            },
        )
        if self._on_decision is not None:
            self._on_decision(decision)

    def _with_pods(self, decision: Decision) -> Decision:
        """The decision naming the pods that held GPUs on its node (the decision is unchanged
        otherwise: state, action and reasons are the health machine's)."""
        rec = self._nodes.get(decision.node)
        if rec is None or rec.pods is None:
            return decision
        named = {r.evidence["gpu"] for r in decision.reasons if isinstance(r.evidence.get("gpu"), int)}
        holders = gpu_holders(rec.pods, rec.gpu_uuids)
        pods = []
        for alloc in rec.pods:
            gpus = sorted(i for i, allocs in holders.items() if alloc in allocs)
            hit = not named or bool(named.intersection(gpus))
            pods.append(
                PodOnNode(
                    namespace=alloc.namespace, pod=alloc.pod, container=alloc.container, gpus=gpus, hit=hit
                )
            )
        return msgspec.structs.replace(decision, pods=_merge_containers(pods))

    def pods_on(self, node: str) -> dict[str, Any] | None:
        """Who holds each GPU of ``node``, from its last attribution; None when it never sent one."""
        rec = self._nodes.get(node)
        if rec is None or rec.pods is None:
            return None
        holders = gpu_holders(rec.pods, rec.gpu_uuids)
        mapped = {id(a) for allocs in holders.values() for a in allocs}
        return {
            "received": rec.pods_received,
            "gpus": [
                {
                    "gpu": index,
                    "uuid": rec.gpu_uuids[index],
                    "holders": [
                        {
                            "namespace": a.namespace,
                            "pod": a.pod,
                            "container": a.container,
                            "resource": a.resource,
                        }
                        for a in holders.get(index, [])
                    ],
                }
                for index in sorted(rec.gpu_uuids)
            ],
            # Allocations whose devices name no GPU the node reports (DRA device names, MIG UUIDs).
            "unmapped": [msgspec.to_builtins(a) for a in rec.pods if id(a) not in mapped],
        }

    # -- read API -------------------------------------------------------------------------------

    def pool_of(self, node: str) -> str | None:
        rec = self._nodes.get(node)
        return rec.placement.pool if rec is not None else None

    def node_states(self) -> dict[str, int]:
        counts = {"healthy": 0, "suspect": 0, "quarantined": 0, "probation": 0}
        for h in self.health.nodes().values():
            counts[h.state] += 1
        return counts

    def nodes(self) -> list[dict[str, Any]]:
        out = []
        for name in sorted(self._nodes):
            rec = self._nodes[name]
            h = self.health.get(name)
            out.append(
                {
                    "node": name,
                    "state": h.state if h else "healthy",
                    "since": h.since if h else None,
                    "lemon": h.lemon if h else False,
                    "pool": rec.placement.pool,
                    "rack": rec.placement.rack,
                    "leaf": rec.placement.leaf,
                    "last_received": rec.last_received,
                    "reasons": [r.summary for r in h.reasons] if h else [],
                    "held": h.held if h else False,
                    "silent": name in self._silent,
                }
            )
        return out

    def node(self, name: str) -> dict[str, Any] | None:
        rec = self._nodes.get(name)
        if rec is None:
            return None
        h = self.health.get(name)
        return {
            "node": name,
            "state": h.state if h else "healthy",
            "since": h.since if h else None,
            "lemon": h.lemon if h else False,
            "held": h.held if h else False,
            "tainted": h.tainted if h else False,
            "silent": name in self._silent,
            "placement": msgspec.to_builtins(rec.placement),
            "last_received": rec.last_received,
            "last_report_time": rec.last_report_time,
            "reasons": [msgspec.to_builtins(r) for r in h.reasons] if h else [],
            "active_findings": [
                {
                    "detector": t.finding.detector,
                    "key": t.finding.key,
                    "severity": t.finding.severity,
                    "action": t.finding.action,
                    "summary": t.finding.summary,
                    "first_seen": t.first_seen,
                    "evidence": dict(t.finding.evidence),
                }
                for t in (h.active() if h else [])
            ],
            "history": rec.recent.dicts(),
            "pods": self.pods_on(name),
            "decisions": [msgspec.to_builtins(d) for d in self.decisions.recent() if d.node == name][-50:],
        }

    def decisions_since(self, since: float, limit: int) -> list[dict[str, Any]]:
        return [msgspec.to_builtins(d) for d in self.decisions.since(since, limit)]

    def recent_decisions(self, limit: int, node: str | None = None) -> list[dict[str, Any]]:
        """The newest ``limit`` decisions (about ``node`` or its links), newest first: the status
        page's feed converts only what it shows."""
        out = []
        for d in reversed(self.decisions.recent()):
            if node is None or node in (d.node, d.peer):
                out.append(msgspec.to_builtins(d))
                if len(out) >= limit:
                    break
        return out

    def breaker(self) -> dict[str, Any]:
        """The safety breaker: open or not, and its state (the status page, ``gpuwarden status``)."""
        state: dict[str, Any] = msgspec.to_builtins(self.limits.state)
        return state | {"open": self.limits.open}

    def link_matrix(self) -> list[dict[str, Any]]:
        """Every probed pair's latest bandwidth and its link state (the status page's heat map)."""
        out = []
        for run in self._detectors:
            # Only detectors that measure pairs (the link localizer) have bandwidth to show.
            if not isinstance(run.detector, MeasuresPairs):
                continue
            for ((a, b), kind), (at, bw) in sorted(run.detector.bandwidth().items()):
                st = run.links.get(a, b)
                row = {"a": a, "b": b, "kind": kind, "time": at, "busbw_bytes_per_second": bw}
                out.append(row | {"state": st.state if st is not None else "healthy"})
        return out

    def probe_coverage(self, now: float) -> dict[str, Any] | None:
        """Active-probe coverage (None when probes are off): per group, pairs tested in the bound."""
        if self.probes is None:
            return None
        cov = self.probes.coverage(now)
        return {
            "bound_seconds": cov.bound_seconds,
            "nodes_overdue": cov.nodes_overdue,
            "pool_ratios": cov.pool_ratios(),
            "groups": [msgspec.to_builtins(g) for g in cov.groups.values()],
            "overdue": sorted(
                ((n, s) for n, s in cov.node_untested_seconds.items() if s > cov.bound_seconds),
                key=lambda ns: -ns[1],
            )[:100],
        }

    def systemic_events(self) -> list[dict[str, Any]]:
        return [
            {
                "time": e.time,
                "state": e.state,
                "domain_kind": e.domain_kind,
                "domain": e.domain,
                "silent_nodes": list(e.silent_nodes),
                "total_nodes": e.total_nodes,
                "summary": e.summary,
            }
            for e in self.systemic_log
        ] + [
            {
                "time": None,
                "state": "active",
                "domain_kind": f"{sw.domain_kind} switch",
                "domain": sw.domain,
                "silent_nodes": [],
                "nodes": list(sw.nodes),
                "total_nodes": len(sw.nodes),
                "summary": sw.summary,
            }
            for sw in self.switches
        ]


def _awaiting(d: Decision) -> Decision:
    """A decision made before the cluster view was whole, as recorded at once: its state, no action
    yet (``_judged`` gives the action once the view is rebuilt)."""
    wait = Reason(
        detector=d.reasons[0].detector if d.reasons else "rule",
        rule=AWAITING_CLUSTER,
        severity="info",
        summary="no action yet: judged against the safety limits once the cluster view is rebuilt",
        evidence={"intended": d.action},
    )
    return msgspec.structs.replace(d, action="none", reasons=[*d.reasons, wait])


def _merge_containers(pods: list[PodOnNode]) -> list[PodOnNode]:
    """One entry per container (a container may hold GPUs through two resources)."""
    merged: dict[tuple[str, str, str], PodOnNode] = {}
    for p in pods:
        key = (p.namespace, p.pod, p.container)
        held = merged.get(key)
        if held is None:
            merged[key] = p
        else:
            gpus = sorted({*held.gpus, *p.gpus})
            merged[key] = msgspec.structs.replace(held, gpus=gpus, hit=held.hit or p.hit)
    return list(merged.values())


def _judged(d: Decision, verdict: tuple[str, str | None] | None) -> Decision:
    """A queued quarantine decision with the action the gate gave it once the view was whole;
    ``none`` when no verdict was needed (our taint was on the cluster already, or it is back in)."""
    if verdict is None:
        return msgspec.structs.replace(d, action="none")
    if verdict[0] == "taint":
        return d
    hold = Reason(
        detector=d.reasons[0].detector if d.reasons else "rule",
        rule="safety-limit",
        severity="critical",
        summary=f"not tainted: {verdict[1]}",
        evidence={"held": True},
    )
    return msgspec.structs.replace(d, action="held", reasons=[*d.reasons, hold])
