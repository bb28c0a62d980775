"""The aggregator's one detection pipeline, shared by the live service and by replay.

    ingest(report, received)   fleet history -> rule engine -> health machine -> decision log
    advance(now)               silence and systemic events, time-driven transitions (probation)

Everything is driven by the ``received``/``now`` times passed in: the live service passes its
clock, replay passes the reports' own times. Given the same reports in the same order with the
same times, the decisions are the same, which is what makes replay a faithful test of history.
"""

from __future__ import annotations

import logging
import math
import time as _time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from agent.report import Report
from aggregator.config import Config
from aggregator.decisions import Decision, DecisionLog
from aggregator.detect import DETECTORS
from aggregator.detect.links import LinkLocalizer, SwitchAlert
from aggregator.fleet.frame import FleetFrames
from aggregator.fleet.history import Fleet
from aggregator.fleet.pools import Placement, placement_of
from aggregator.health import HealthMachine
from aggregator.links import LinkHealth
from aggregator.model import Finding, IngestOutcome
from aggregator.rules.engine import RuleEngine
from aggregator.rules.model import Rule
from aggregator.silence import SilenceDetector, SystemicEvent

log = logging.getLogger(__name__)

TICK_SECONDS = 1.0  # time-driven work runs at most once per tick of the aggregator's clock
_HISTORY_KEEP = 60  # recent report summaries per node for the API


@dataclass
class _NodeRecord:
    placement: Placement
    last_received: float
    last_report_time: float
    seen: deque[tuple[str, int, float]] = field(default_factory=deque)
    seen_set: set[tuple[str, int, float]] = field(default_factory=set)
    recent: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=_HISTORY_KEEP))


class Pipeline:
    def __init__(
        self,
        config: Config,
        rules: list[Rule],
        decisions: DecisionLog,
        *,
        k8s_labels: Callable[[str], Mapping[str, str]] | None = None,
        on_decision: Callable[[Decision], None] | None = None,
        on_systemic: Callable[[SystemicEvent], None] | None = None,
    ) -> None:
        self.config = config
        self.fleet = Fleet(config.fleet)
        # 8 RDMA ports, their 8 IPoIB netdevs and a few Ethernet ports fit with room to spare.
        self.frames = FleetFrames(config.fleet, max_nics=32)
        self.engine = RuleEngine(rules)
        # Every node keeps the series the rules read from its first report on, so a rule that
        # looks at a field only now and then still has a full window when it does.
        series = self.engine.series
        self.fleet.registry.track_gpu_counters(*sorted(series.gpu_counters))
        self.fleet.registry.track_nvlink_counters(*sorted(series.nvlink_counters))
        self.fleet.registry.track_nic_counters(*sorted(series.nic_counters))
        self.fleet.registry.track_gpu_gauges(*sorted(series.gpu_gauges))
        self.health = HealthMachine(config.health)
        self.silence = SilenceDetector(config.silence)
        # Fleet-wide detectors (peers, trend) run on the pool frames every few seconds.
        self.detectors = [make() for make in DETECTORS]
        self._detector_due: dict[str, float] = {d.name: -math.inf for d in self.detectors}
        self.decisions = decisions
        # Pair probes: a slow node, a degraded link, or a shared switch (aggregator/detect/links.py).
        self.links = LinkLocalizer()
        self.link_health = LinkHealth(
            suspect_for_seconds=config.health.suspect_for_seconds,
            clear_for_seconds=config.health.clear_for_seconds * 7.5,
        )
        self._links_due = -math.inf
        self.switches: list[SwitchAlert] = []  # shared-switch problems the probes point at now
        self._k8s_labels = k8s_labels or (lambda _node: {})
        self._on_decision = on_decision
        self._on_systemic = on_systemic
        self._nodes: dict[str, _NodeRecord] = {}
        self._next_tick = -math.inf
        self._silent: set[str] = set()  # nodes with a silence finding now
        self.systemic_log: deque[SystemicEvent] = deque(maxlen=1000)

    # -- ingest ---------------------------------------------------------------------------------

    def ingest(self, report: Report, received: float) -> IngestOutcome:
        rec = self._nodes.get(report.node)
        # seq restarts with the agent process under the same boot, so the report time is part of
        # the key: a redelivery repeats all three, a restarted agent does not.
        key = (report.boot_id, report.seq, report.time)
        if rec is not None and key in rec.seen_set:
            return IngestOutcome.DUPLICATE
        placement = placement_of(report, self._k8s_labels(report.node))
        if rec is None:
            rec = self._nodes[report.node] = _NodeRecord(placement, received, report.time)
        rec.placement = placement
        rec.seen.append(key)
        rec.seen_set.add(key)
        if len(rec.seen) > self.config.ingest.duplicate_window:
            rec.seen_set.discard(rec.seen.popleft())
        rec.last_received = max(rec.last_received, received)
        rec.last_report_time = max(rec.last_report_time, report.time)
        rec.recent.append(_summary(report, received))

        try:
            view = self.fleet.add(report)
            # The aggregator's clock places the sample: a node whose clock runs ahead must not move
            # its pool's newest slot forward and clear everyone's data.
            self.frames.record(view, placement, at=received)
            if report.probes:
                self.links.observe(report, placement, received)
            findings = self.engine.evaluate(view)
            if report.node in self._silent:
                # The node is talking again: whatever silence said is over.
                self._silent.discard(report.node)
                self._emit(self.health.update(report.node, "silence", (), received))
            self._emit(self.health.update(report.node, "rule", findings, received))
            self.advance(received)
        except BaseException:
            # Not processed: a redelivery of this report must be processed, not called a duplicate.
            rec.seen_set.discard(key)
            raise
        return IngestOutcome.ACCEPTED

    # -- time-driven ------------------------------------------------------------------------------

    def advance(self, now: float) -> None:
        if now < self._next_tick - 2 * TICK_SECONDS:
            # The aggregator's clock stepped back (NTP, a VM restore). Without this, silence,
            # probation and the detectors would wait until the clock caught up again.
            log.warning("clock stepped back", extra={"now": now, "expected_at_least": self._next_tick})
            self._next_tick = -math.inf
            for rec in self._nodes.values():
                rec.last_received = min(rec.last_received, now)
        if now < self._next_tick:
            return
        tick = math.floor(now / TICK_SECONDS) * TICK_SECONDS
        self._next_tick = tick + TICK_SECONDS
        # Runs every second over the whole fleet: the common case (nobody silent) is one pass over
        # the receive times and nothing else.
        last = {n: r.last_received for n, r in self._nodes.items()}
        quiet_after = tick - self.config.silence.silent_after_seconds
        per_node: dict[str, list[Finding]] = {}
        events: list[SystemicEvent] = []
        if self._silent or self.silence.active_events() or any(t < quiet_after for t in last.values()):
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
        for det in self.detectors:
            if tick >= self._detector_due[det.name]:
                self._detector_due[det.name] = tick + det.every_seconds
                for node, found in det.run(self.frames, tick).items():
                    self._emit(self.health.update(node, det.name, found, tick))
        if tick >= self._links_due:
            self._links_due = tick + self.links.every_seconds
            verdict = self.links.run(tick)
            for node, found in verdict.nodes.items():
                self._emit(self.health.update(node, "link", found, tick))
            for d in self.link_health.update(verdict.links, tick):
                self._emit(d)
            self.switches = list(verdict.switches)
        for d in self.health.tick(tick):
            self._emit(d)

    def _forget_long_gone(self, now: float) -> None:
        """Drop nodes silent for ``silence.forget_after_seconds`` (decommissioned, renamed), so
        state does not grow forever and a dead node does not count in every later outage. A node
        still taken out (quarantined, probation) is kept: forgetting it would release it."""
        limit = self.config.silence.forget_after_seconds
        gone = [
            n
            for n, r in self._nodes.items()
            if now - r.last_received > limit
            and (h := self.health.get(n)) is not None
            and h.state in ("healthy", "suspect")
        ]
        for node in gone:
            log.info("forgetting a long-silent node", extra={"node": node, "silent_for_s": limit})
            del self._nodes[node]
            self._silent.discard(node)
            self.health.forget(node)
            self.engine.forget(node)
            self.fleet.forget(node)
            self.frames.forget(node)

    def set_findings(self, node: str, source: str, findings: list[Finding], now: float) -> None:
        """For detectors outside the per-report path (peers, trend, links): replace their findings."""
        self._emit(self.health.update(node, source, findings, now))

    def _emit(self, decision: Decision | None) -> None:
        if decision is None:
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
            "placement": msgspec.to_builtins(rec.placement.__dict__),
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
            "history": list(rec.recent),
            "decisions": [msgspec.to_builtins(d) for d in self.decisions.recent() if d.node == name][-50:],
        }

    def decisions_since(self, since: float, limit: int) -> list[dict[str, Any]]:
        return [msgspec.to_builtins(d) for d in self.decisions.since(since, limit)]

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


def _summary(report: Report, received: float) -> dict[str, Any]:
    return {
        "time": report.time,
        "received": received,
        "seq": report.seq,
        "boot_id": report.boot_id,
        "gpus": len(report.gpus),
        "nics": len(report.nics),
        "events": len(report.events) if isinstance(report.events, list) else 0,
        "errors": [e.message for e in report.errors] if isinstance(report.errors, list) else [],
        "received_at": _time.strftime("%Y-%m-%dT%H:%M:%SZ", _time.gmtime(received)),
    }
