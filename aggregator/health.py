"""The health state machine: findings in, state changes and decision records out.

Per node: ``healthy -> suspect -> quarantined -> probation -> healthy``.

- A hard finding (XID 79, DBE, remap failure, ...) quarantines from the report that shows it.
- Soft quarantine evidence makes the node ``suspect`` first, and quarantines it only once the same
  finding (same key) has persisted for ``suspect_for_seconds``. Evidence that comes and goes
  starts over, so noise never quarantines.
- Soft quarantine evidence that a sequential test decided (``Finding.decided``: the peer CUSUM's
  crossing, a ``test: sequential`` rule, the probe localizers' likelihood ratios) quarantines
  from the report that carries it: the test already accumulated its evidence over time, and its
  stated false-alarm rate is the one of deciding at the crossing, so waiting again would count
  the persistence twice. Its decision says so (evidence ``decided``). Everything else (peer
  alerts escalated by persistence, the window rules, the other detectors) still persists. A
  decided finding that goes away and comes back is decided again by its test, from scratch.
- ``alert`` findings (and silence) make a node ``suspect`` and never quarantine it on their own.
- A quarantined node whose quarantine evidence is gone enters ``probation``; it stays tainted and
  returns to ``healthy`` only after ``probation_seconds`` without any quarantine evidence. Evidence
  during probation quarantines it again at once.
- A node quarantined ``lemon_count`` times within ``lemon_window_seconds`` is a lemon: it stays
  quarantined whatever later reports say, and the decision says a human must look at it.

- Before a decision adds our taint, the ``gate`` (the safety limits, aggregator.remediate.limits)
  may refuse: the node is quarantined all the same, but the decision's action is ``held``, the
  node is not counted as tainted, and a later relapse or a breaker reset tries again.
- ``snapshot`` and ``restore`` carry a node's health across an aggregator restart (through an
  annotation on the Node): state, probation clock, lemon count, and the evidence behind it. The
  ``decided`` flag is not carried: a restored finding persists like any soft one (it only holds
  a state already decided; the live detectors' own findings, decided again, take over).
- Until the caller has rebuilt its view of the cluster (``gate_ready`` False: right after a start,
  before the first Node list and the breaker are read), the gate is not asked: a new quarantine is
  ``pending``, neither tainted nor held, and ``judge_pending`` asks the gate once the view is whole.
  Judging a limit on half a view (no restored taints counted, the breaker not yet adopted) is how a
  restart exceeds a pool limit.
- A restored finding about a GPU the node no longer has (its UUID changed: the GPU was replaced)
  is dropped at the first report that says so (``replaced_gpus``): the old GPU's evidence must
  not keep the new one out.

Timing uses the aggregator's own time (receive time live, trace time in replay), never the
node's report clock, so a node with a skewed clock is judged like any other. Each finding's
persistence is measured from when this machine first saw its key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from aggregator.config import HealthConfig
from aggregator.decisions import AWAITING_CLUSTER, Decision, Reason
from aggregator.links import DECIDED
from aggregator.model import Finding, NodeState, RemediationAction
from aggregator.remediate.model import MAX_SNAPSHOT_FINDINGS, HealthSnapshot, SnapshotFinding

RESTORED: Final = "restored"  # the findings group rebuilt from a snapshot after a restart


@dataclass
class _Tracked:
    finding: Finding
    first_seen: float  # aggregator time when this key was first active (continuously since)


@dataclass
class NodeHealth:
    node: str
    state: NodeState = "healthy"
    since: float = 0.0  # when the current state began
    groups: dict[str, dict[str, _Tracked]] = field(default_factory=dict)  # source -> key -> finding
    clear_since: float | None = None  # suspect: when the last evidence disappeared
    # When it was quarantined, within the lemon window. A tuple, rebuilt on the rare change: a
    # tuple of numbers is not an object the cycle collector tracks, an (empty) deque a node was.
    quarantines: tuple[float, ...] = ()
    lemon: bool = False
    tainted: bool = False  # remediation has taken (or in dry-run would have taken) the node out
    held: bool = False  # quarantined, but a safety limit kept the taint off
    pending: bool = False  # out, but the gate has not judged it yet (the cluster view not rebuilt)
    restored_until: float | None = None  # the restored findings give way to live ones then
    # Why it is in its current state; always replaced whole, never changed in place, so a
    # healthy node shares the empty tuple rather than holding an empty list of its own.
    reasons: Sequence[Reason] = ()

    def active(self) -> list[_Tracked]:
        return [t for group in self.groups.values() for t in group.values()]


def _reason(f: Finding, *, persisted_s: float | None = None) -> Reason:
    evidence: dict[str, Any] = dict(f.evidence)
    if persisted_s is not None and not f.hard:
        evidence.setdefault("persisted_seconds", round(persisted_s, 1))
    if f.decided and not f.hard and f.action == "quarantine":
        # Why no persistence was waited: a sequential test decided it (module doc).
        evidence[DECIDED] = True
    if f.runbook_url:
        evidence.setdefault("runbook_url", f.runbook_url)
    return Reason(detector=f.detector, rule=f.rule, severity=f.severity, summary=f.summary, evidence=evidence)


def _action(h: NodeHealth, state: NodeState) -> RemediationAction:
    """What remediation does on entering ``state``: quarantined and probation keep the node out,
    healthy and suspect let it back (whichever way it left probation). A held quarantine whose
    evidence went away moves on to probation without ever being tainted."""
    out = state in ("quarantined", "probation")
    if out and not h.tainted:
        return "none" if state == "probation" and h.held else "taint"
    if h.tainted and not out:
        return "untaint"
    return "none"


# The gate: None lets the taint through; otherwise why it is held (one line).
Gate = Callable[[NodeHealth, float], str | None]


class HealthMachine:
    """Holds every node's health; ``update`` and ``tick`` return the decisions they caused."""

    def __init__(self, config: HealthConfig, *, gate: Gate | None = None) -> None:
        self.config = config
        self.gate = gate
        # False while the caller's view of the cluster is incomplete: the gate is not asked then.
        self.gate_ready = True
        self._nodes: dict[str, NodeHealth] = {}

    def get(self, node: str) -> NodeHealth | None:
        return self._nodes.get(node)

    def nodes(self) -> Mapping[str, NodeHealth]:
        return self._nodes

    def forget(self, node: str) -> None:
        self._nodes.pop(node, None)

    def update(self, node: str, source: str, findings: Iterable[Finding], now: float) -> Decision | None:
        """Replace the findings ``source`` (a detector or rule engine) has on ``node``, then decide."""
        h = self._nodes.get(node)
        if h is None:
            h = self._nodes[node] = NodeHealth(node=node, since=now)
        old = h.groups.get(source, {})
        new: dict[str, _Tracked] = {}
        for f in findings:
            prev = old.get(f.key)
            new[f.key] = _Tracked(f, prev.first_seen if prev is not None else now)
        if new:
            h.groups[source] = new
        else:
            h.groups.pop(source, None)
        return self._evaluate(h, now)

    def tick(self, now: float) -> list[Decision]:
        """Time-driven transitions (persistence reached, probation over) for every node."""
        out = []
        for h in self._nodes.values():
            if h.state == "healthy" and not h.groups:
                continue  # nothing can change for it until a finding arrives
            d = self._evaluate(h, now)
            if d is not None:
                out.append(d)
        return out

    def _evaluate(self, h: NodeHealth, now: float) -> Decision | None:
        cfg = self.config
        active = h.active()
        quarantine = [t for t in active if t.finding.action == "quarantine"]
        ready = [
            t
            for t in quarantine
            if t.finding.hard or t.finding.decided or now - t.first_seen >= cfg.suspect_for_seconds
        ]
        alerting = [t for t in active if t.finding.action in ("quarantine", "alert")]

        def reasons(ts: list[_Tracked]) -> list[Reason]:
            ordered = sorted(
                ts, key=lambda t: (t.finding.severity != "critical", t.first_seen, t.finding.key)
            )
            return [_reason(t.finding, persisted_s=now - t.first_seen) for t in ordered]

        state = h.state
        if state == "quarantined":
            if h.lemon or quarantine:
                h.clear_since = None
                return None
            # The evidence must stay gone a while before probation starts: a flapping port or a
            # finding that misses one report is still the same episode, not a recovery.
            if h.clear_since is None:
                h.clear_since = now
            if now - h.clear_since < cfg.clear_for_seconds:
                return None
            return self._move(
                h,
                "probation",
                now,
                [
                    Reason(
                        detector=h.reasons[0].detector if h.reasons else "rule",
                        rule=h.reasons[0].rule if h.reasons else None,
                        severity="info",
                        summary=f"quarantine evidence gone; on probation for {cfg.probation_seconds:.0f} s",
                        evidence={"probation_seconds": cfg.probation_seconds},
                    )
                ],
            )
        if state == "probation":
            if quarantine:
                return self._quarantine(h, now, reasons(quarantine))
            if now - h.since >= cfg.probation_seconds:
                if alerting:
                    return self._move(h, "suspect", now, reasons(alerting))
                return self._release(
                    h, now, f"no quarantine evidence for {now - h.since:.0f} s of probation: released"
                )
            return None
        # healthy or suspect
        if ready:
            return self._quarantine(h, now, reasons(ready))
        if alerting:
            h.clear_since = None
            if state == "healthy":
                return self._move(h, "suspect", now, reasons(alerting))
            # Stay suspect, but keep the reasons current for the API.
            h.reasons = reasons(alerting)
            return None
        if state == "suspect":
            if h.clear_since is None:
                h.clear_since = now
            if now - h.clear_since >= cfg.clear_for_seconds:
                return self._release(h, now, f"no evidence for {now - h.clear_since:.0f} s: healthy")
        return None

    def _release(self, h: NodeHealth, now: float, summary: str) -> Decision:
        """Back to healthy after a quiet spell; ``summary`` says how long it was quiet."""
        return self._move(h, "healthy", now, [Reason(detector="rule", severity="info", summary=summary)])

    def _quarantine(self, h: NodeHealth, now: float, why: list[Reason]) -> Decision:
        cfg = self.config
        if h.state != "probation":
            # A relapse during probation is the same episode; a lemon keeps coming back from
            # healthy (or suspect) after being released.
            h.quarantines = (*h.quarantines, now)
        gone = 0
        while gone < len(h.quarantines) and now - h.quarantines[gone] > cfg.lemon_window_seconds:
            gone += 1
        if gone:
            h.quarantines = h.quarantines[gone:]
        if len(h.quarantines) >= cfg.lemon_count and not h.lemon:
            h.lemon = True
            why = [
                *why,
                Reason(
                    detector=why[0].detector if why else "rule",
                    rule="lemon",
                    severity="critical",
                    summary=(
                        f"quarantined {len(h.quarantines)} times in "
                        f"{cfg.lemon_window_seconds / 86400:.0f} days: a lemon, "
                        "stays out until a human releases it"
                    ),
                    evidence={"quarantines": len(h.quarantines), "lemon": True},
                ),
            ]
        return self._move(h, "quarantined", now, why)

    def _move(self, h: NodeHealth, state: NodeState, now: float, why: list[Reason]) -> Decision:
        previous = h.state
        action = _action(h, state)
        out = state in ("quarantined", "probation")
        if action == "taint" and self.gate is not None and not self.gate_ready:
            # Not judged on half a view: neither tainted nor held until ``judge_pending``.
            h.pending = out
            h.tainted = h.held = False
        else:
            h.pending = False
            if action == "taint" and self.gate is not None:
                hold = self.gate(h, now)
                if hold is not None:
                    action = "held"
                    why = [
                        *why,
                        Reason(
                            detector=why[0].detector if why else "rule",
                            rule="safety-limit",
                            severity="critical",
                            summary=f"not tainted: {hold}",
                            evidence={"held": True},
                        ),
                    ]
            h.tainted = action == "taint" or (h.tainted and out)
            h.held = out and (action == "held" or (h.held and action == "none"))
        h.state, h.since, h.clear_since, h.reasons = state, now, None, why
        return Decision(
            time=now,
            subject="node",
            node=h.node,
            state=state,
            previous=previous,
            action=action,
            reasons=why,
        )

    def judge_pending(self, node: str, now: float) -> tuple[str, str | None] | None:
        """Ask the gate about a quarantine decided before the cluster view was whole: the action
        its decision takes (``taint`` or ``held``) and the hold's reason; None when the node is
        not pending (already out on the cluster, or back in since)."""
        h = self._nodes.get(node)
        if h is None or not h.pending:
            return None
        h.pending = False
        hold = self.gate(h, now) if self.gate is not None else None
        if hold is None:
            h.tainted = True
            return "taint", None
        h.held = True
        h.reasons = [
            *h.reasons,
            Reason(
                detector=h.reasons[0].detector if h.reasons else "rule",
                rule="safety-limit",
                severity="critical",
                summary=f"not tainted: {hold}",
                evidence={"held": True},
            ),
        ]
        return "held", hold

    def adopt_taint(self, node: str) -> bool:
        """The cluster shows our taint on a node quarantined since we started (its report came
        before the first list): it is out already, and stays out without a new gate verdict.
        Returns whether the node was taken as out."""
        h = self._nodes.get(node)
        if h is None or h.state not in ("quarantined", "probation") or h.tainted:
            return False
        h.pending = h.held = False
        h.tainted = True
        return True

    def continue_episode(self, node: str, snap: HealthSnapshot) -> bool:
        """A node decided out since we started, whose snapshot says the same state: the same
        episode, told as it began. Its start, quarantine count, lemon and words are the
        snapshot's (so a restart rewrites nothing and a probation clock is not reset); the live
        findings stay. Returns whether it was the same episode."""
        h = self._nodes.get(node)
        if h is None or h.state != snap.state or h.state not in ("quarantined", "probation"):
            return False
        h.since = snap.since
        h.quarantines = tuple(snap.quarantines)
        h.lemon = h.lemon or snap.lemon
        if snap.message is not None:
            h.reasons = _restored_reasons(snap)
        return True

    def replaced_gpus(self, node: str, uuids: Mapping[int, str], now: float) -> Decision | None:
        """Drop the restored findings about GPUs whose UUID is not the one the node reports now
        at that index (the GPU was replaced), then decide. Live findings are the detectors' own."""
        h = self._nodes.get(node)
        group = h.groups.get(RESTORED) if h is not None else None
        if group is None:
            return None
        keep = [t.finding for t in group.values() if not about_replaced_gpu(t.finding.evidence, uuids)]
        if len(keep) == len(group):
            return None
        return self.update(node, RESTORED, keep, now)

    def retry_held(self, node: str, now: float) -> Decision | None:
        """Try the taint of a held quarantine again (after a breaker reset): a decision with
        action ``taint`` (state unchanged) if the gate lets it through now, else None."""
        h = self._nodes.get(node)
        if h is None or not h.held or h.state != "quarantined":
            return None
        hold = self.gate(h, now) if self.gate is not None else None
        if hold is not None:
            return None
        h.held = False
        h.tainted = True
        why = [r for r in h.reasons if r.rule != "safety-limit"]
        h.reasons = why
        return Decision(
            time=now,
            subject="node",
            node=h.node,
            state=h.state,
            previous=h.state,
            action="taint",
            reasons=[
                *why,
                Reason(
                    detector=why[0].detector if why else "rule",
                    rule="safety-limit",
                    severity="info",
                    summary="safety breaker reset: the held quarantine is applied now",
                ),
            ],
        )

    # -- restart ------------------------------------------------------------------------------

    def snapshot(self, node: str, boot_id: str | None) -> HealthSnapshot | None:
        h = self._nodes.get(node)
        if h is None:
            return None
        # One finding per key: after a restart the restored evidence and the live finding it
        # gave way to say the same thing; the one first seen is kept, so the snapshot is the one
        # already on the node and a restart rewrites nothing.
        first: dict[str, _Tracked] = {}
        for t in h.active():
            kept = first.get(t.finding.key)
            if kept is None or t.finding.since < kept.finding.since:
                first[t.finding.key] = t
        order = lambda t: (t.finding.action != "quarantine", not t.finding.hard, t.finding.key)  # noqa: E731
        tracked = sorted(first.values(), key=order)
        return HealthSnapshot(
            state=h.state,
            since=h.since,
            tainted=h.tainted,
            held=h.held,
            lemon=h.lemon,
            quarantines=list(h.quarantines),
            boot_id=boot_id,
            findings=[
                SnapshotFinding(
                    detector=t.finding.detector,
                    key=t.finding.key,
                    severity=t.finding.severity,
                    action=t.finding.action,
                    summary=t.finding.summary,
                    since=t.finding.since,
                    rule=t.finding.rule,
                    hard=t.finding.hard,
                    clears=t.finding.clears,
                    evidence={k: v for k, v in t.finding.evidence.items() if _small(v)},
                )
                for t in tracked[:MAX_SNAPSHOT_FINDINGS]
            ],
        )

    def restore(self, node: str, snap: HealthSnapshot, now: float, *, grace_seconds: float) -> bool:
        """Rebuild a node from its snapshot, unless we already know it (False). Its findings
        come back as one ``restored`` group that holds the state for ``grace_seconds`` while the
        detectors warm up again; reboot-cleared ones are re-latched by the rule engine instead
        (the caller does that), so they stay until the node reboots."""
        existing = self._nodes.get(node)
        if existing is not None and (
            existing.state in ("quarantined", "probation") or existing.tainted or existing.held
        ):
            return False
        h = self._nodes[node] = NodeHealth(node=node, state=snap.state, since=snap.since)
        if existing is not None:
            h.groups.update(existing.groups)  # what live reports said since we started
        h.tainted = snap.tainted
        h.held = snap.held
        h.lemon = snap.lemon
        h.quarantines = tuple(snap.quarantines)
        findings = [finding_of_snapshot(f) for f in snap.findings if f.clears != "reboot"]
        if findings:
            h.groups[RESTORED] = {f.key: _Tracked(f, min(f.since, now)) for f in findings}
            h.restored_until = now + grace_seconds
        if snap.message is not None:
            h.reasons = _restored_reasons(snap)
        else:
            h.reasons = [_reason(f) for f in findings] or [
                Reason(detector="rule", severity="info", summary=f"restored from the cluster: {snap.state}")
            ]
        return True

    def expire_restored(self, now: float) -> list[Decision]:
        """Drop restored findings past their grace time; live detectors have taken over."""
        out = []
        for h in self._nodes.values():
            if h.restored_until is not None and now >= h.restored_until:
                h.restored_until = None
                d = self.update(h.node, RESTORED, (), now)
                if d is not None:
                    out.append(d)
        return out

    def release_lemon(self, node: str, now: float) -> Decision | None:
        """A human cleared a lemon: it may go through probation like any other node."""
        h = self._nodes.get(node)
        if h is None or not h.lemon:
            return None
        h.lemon = False
        h.quarantines = ()
        return self._evaluate(h, now)


def _restored_reasons(snap: HealthSnapshot) -> list[Reason]:
    """The decision's own words and reason code, as the snapshot kept them: the taint's value,
    the condition and the reason annotation stay exactly as they are, so a restart rewrites
    nothing."""
    lead = snap.findings[0] if snap.findings else None
    if snap.state == "healthy" and lead is None:
        return []
    return [
        Reason(
            detector=lead.detector if lead is not None else "rule",
            rule=snap.reason_code,
            severity=lead.severity if lead is not None else "info",
            summary=snap.message or snap.state,
        )
    ]


def about_replaced_gpu(evidence: Mapping[str, object], uuids: Mapping[int, str]) -> bool:
    """A finding's ``evidence`` names a GPU (its index and UUID) and the node reports another GPU
    at that index now (``uuids``: index -> UUID of its latest report). An empty UUID is one the
    agent could not read then: no evidence of a swap."""
    uuid, index = evidence.get("uuid"), evidence.get("gpu")
    if not isinstance(uuid, str) or not uuid or not isinstance(index, int) or isinstance(index, bool):
        return False
    now_there = uuids.get(index)
    return now_there is not None and now_there != uuid


def _small(value: Any) -> bool:
    return (
        value is None
        or isinstance(value, bool | int | float)
        or (isinstance(value, str) and len(value) <= 256)
    )


def finding_of_snapshot(f: SnapshotFinding) -> Finding:
    """A finding as a snapshot kept it (restore after a restart)."""
    return Finding(
        detector=f.detector,
        key=f.key,
        severity=f.severity,  # type: ignore[arg-type]
        action=f.action,  # type: ignore[arg-type]
        summary=f.summary,
        since=f.since,
        rule=f.rule,
        hard=f.hard,
        clears=f.clears,
        evidence=dict(f.evidence),
    )


# Reasons that explain a decision, not findings about the node.
_NOT_EVIDENCE: Final = frozenset({"safety-limit", "lemon", AWAITING_CLUSTER})


def carried_over(decisions: Iterable[Decision]) -> dict[str, HealthSnapshot]:
    """The nodes a decision log leaves out of service, as snapshots ``restore`` takes: the fold
    of every node decision, following ``_move``'s own rules for ``tainted`` and ``held``. The
    log does not name the boot a finding was seen in, so reboot-cleared evidence comes back as
    evidence that holds for the restore grace time (then the node goes through probation)."""
    last: dict[str, HealthSnapshot] = {}
    for d in decisions:
        if d.subject != "node":
            continue
        prev = last.get(d.node)
        out = d.state in ("quarantined", "probation")
        state_changed = prev is None or d.previous != d.state
        quarantines = list(prev.quarantines) if prev is not None else []
        if d.state == "quarantined" and d.previous not in ("quarantined", "probation"):
            quarantines.append(d.time)
        findings = [
            SnapshotFinding(
                detector=r.detector,
                key=_restored_key(r),
                severity=r.severity,
                action="quarantine",
                summary=r.summary,
                since=d.time,
                rule=r.rule,
                hard=True,
                evidence={k: v for k, v in r.evidence.items() if _small(v)},
            )
            for r in d.reasons
            if d.state == "quarantined" and r.severity != "info" and r.rule not in _NOT_EVIDENCE
        ]
        if not state_changed and prev is not None and not findings:
            findings = list(prev.findings)
        first = d.reasons[0] if d.reasons else None
        lead = next((r for r in d.reasons if r.rule not in _NOT_EVIDENCE), first)
        last[d.node] = HealthSnapshot(
            state=d.state,  # type: ignore[arg-type]
            since=d.time if state_changed or prev is None else prev.since,
            tainted=d.action == "taint" or (prev is not None and prev.tainted and out),
            held=out and (d.action == "held" or (prev is not None and prev.held and d.action == "none")),
            lemon=out and (any(r.rule == "lemon" for r in d.reasons) or (prev is not None and prev.lemon)),
            quarantines=quarantines,
            reason_code=(lead.rule or lead.detector) if lead is not None else None,
            message=lead.summary if lead is not None else None,
            findings=findings[:MAX_SNAPSHOT_FINDINGS],
        )
    return {n: s for n, s in last.items() if s.state in ("quarantined", "probation")}


def _restored_key(r: Reason) -> str:
    """The key the live finding has (``<rule>:gpu<i>``), so fresh evidence takes its place."""
    gpu = r.evidence.get("gpu")
    subject = f"gpu{gpu}" if isinstance(gpu, int) and not isinstance(gpu, bool) else "node"
    return f"{r.rule or r.detector}:{subject}"
