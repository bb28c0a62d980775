"""What one Node should look like: the remediation decision as a pure function.

``plan`` takes the node as last read (its taints, conditions, annotations and labels, plain
values), the pipeline's ``NodeIntent``, the configuration, the clock's values and the little state
the actuator keeps between reconciles (when we added NoExecute taints, when the preflight taint was
first seen and whether its timeout was announced), and returns a ``Plan``: the whole wanted
``spec.taints``, the annotations to write or remove, the condition, the events, and when to look
again. It reads no clock, sends nothing and logs nothing (what deserves a log line comes back in
``Plan.warnings``), so every safety rule below is tested as a table (tests/test_planner.py) and the
actuator only applies plans.

The rules it encodes (docs/remediation.md):

- only a taint we recorded applying is ours (the snapshot's ``tainted``, or ``<prefix>taint`` for a
  suspect's PreferNoSchedule, which the snapshot must not call "out" lest a restarted pipeline
  restore it as a quarantine); every other taint, a human's with our key included, is kept
  exactly as read;
- a human who removed our taint overrides that evidence for ``override_cooldown_seconds``
  (annotation ``<prefix>override``, so a restart honours it); different evidence taints again;
- NoExecute needs ``allow_no_execute`` and at most ``max_no_execute_per_hour`` new ones; past that
  the node gets NoSchedule, upgraded by a later plan once the hour allows it;
- the preflight taint goes once the node passed, or turns into ours on failure, in one patch;
  held and pending nodes keep it, and a pending one is announced once after the timeout;
- our taint stays on a node that is still out (quarantined or probation) whatever else the intent
  says: a held verdict stops a new quarantine, it never undoes one; only a release (or a human)
  removes it;
- a node labelled ``<managed_label>=false`` gets nothing; a node that already looks like its
  intent gets an empty plan (no write at all), including a snapshot another replica timed by its
  own clock for the same decision.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Final, Literal

import msgspec

from aggregator.config import RemediationConfig
from aggregator.kube.objects import Condition, ConditionStatus, EventType, Node, Taint, TaintEffect
from aggregator.remediate.model import HealthSnapshot, NodeIntent, decode_snapshot, encode_snapshot
from aggregator.story import iso, next_step, override_note

__all__ = [
    "NO_EXECUTE_WINDOW_S",
    "WRITE_KINDS",
    "AnnotationKeys",
    "Plan",
    "PlanEvent",
    "PlanWarning",
    "Recorded",
    "WriteKind",
    "label_value",
    "parse_rfc3339",
    "plan",
    "recorded",
    "rfc3339",
]

WriteKind = Literal["taint", "untaint", "preflight_release", "condition", "event", "annotation"]
WRITE_KINDS: Final[tuple[WriteKind, ...]] = (
    "taint",
    "untaint",
    "preflight_release",
    "condition",
    "event",
    "annotation",
)
NO_EXECUTE_WINDOW_S: Final = 3600.0
# Replicas time the same report by their own receive clocks; a report reaches them all within this.
SAME_EPISODE_S: Final = 60.0

_CONDITION_REASONS: Final[Mapping[str, str]] = {
    "healthy": "Healthy",
    "suspect": "Suspect",
    "quarantined": "Quarantined",
    "probation": "Probation",
}
_LABEL_INVALID = re.compile(r"[^A-Za-z0-9._-]+")


# -- values ---------------------------------------------------------------------------------------


def label_value(text: str) -> str:
    """``text`` as a valid label (and taint) value: at most 63 characters of ``[A-Za-z0-9._-]``
    that begin and end alphanumeric. Never empty, so the taint always says something."""
    cleaned = _LABEL_INVALID.sub("-", text)[:63].strip("._-")
    return cleaned or "unhealthy"


def rfc3339(unix: float) -> str:
    """Seconds precision, UTC, as Kubernetes' metav1.Time serialises."""
    return iso(unix)


def parse_rfc3339(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


@dataclass(frozen=True, slots=True)
class AnnotationKeys:
    """The annotations we keep on a node, named from ``annotation_prefix``."""

    health: str
    reason: str
    decided: str
    override: str
    taint: str
    runbook: str

    @classmethod
    def of(cls, prefix: str) -> AnnotationKeys:
        return cls(
            health=f"{prefix}health",
            reason=f"{prefix}reason",
            decided=f"{prefix}decided-at",
            override=f"{prefix}override",
            taint=f"{prefix}taint",
            runbook=f"{prefix}runbook",
        )


@dataclass(frozen=True, slots=True)
class Recorded:
    """What we left on a node: the snapshot annotation, and the taints with our key we applied."""

    snapshot_text: str | None
    snapshot: HealthSnapshot | None  # None also when the text is unreadable
    applied: bool  # our record says we put a taint on this node
    taints: tuple[Taint, ...]  # the taints with our key we applied (empty: a human removed ours)


def recorded(node: Node, config: RemediationConfig) -> Recorded:
    """Ours is the taint we recorded applying: the one ``<prefix>taint`` names, or, on a node
    written before that annotation existed, any with our key if the snapshot says tainted. The
    snapshot's ``tainted`` is the pipeline's (the decision took the node out); a suspect's
    PreferNoSchedule is ours without it, so ``<prefix>taint`` records whatever taint we applied.
    An unreadable snapshot (hand-edited, another version) is still ours, and so is its taint. A
    taint with our key that a human put there is theirs: never taken over, never removed."""
    keys = AnnotationKeys.of(config.annotation_prefix)
    text = node.annotations.get(keys.health)
    snapshot = decode_snapshot(text) if text is not None else None
    we_applied = (
        (snapshot is not None and snapshot.tainted)
        or keys.taint in node.annotations
        or (text is not None and snapshot is None)
    )
    if not we_applied:
        return Recorded(text, snapshot, applied=False, taints=())
    mark = node.annotations.get(keys.taint)
    ours = tuple(
        t
        for t in node.taints
        if t.key == config.taint_key and (mark is None or mark == f"{t.value or ''}:{t.effect}")
    )
    return Recorded(text, snapshot, applied=True, taints=ours)


class _Override(msgspec.Struct, frozen=True):
    """The ``<prefix>override`` annotation: a human removed our taint for this evidence."""

    evidence_key: str
    until: str  # RFC 3339
    at: str  # RFC 3339

    def active(self, evidence_key: str, now: float) -> bool:
        return self.evidence_key == evidence_key and now < parse_rfc3339(self.until)


# -- the plan -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PlanEvent:
    type: EventType
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class PlanWarning:
    """Something an operator should read in the log (the planner itself logs nothing)."""

    message: str
    extra: Mapping[str, object]


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything one reconcile would write, computed from one read of the node."""

    node: str
    taints_before: tuple[Taint, ...]  # spec.taints as read
    taints: tuple[Taint, ...]  # the whole wanted spec.taints (the list is replaced whole)
    annotations: Mapping[str, str | None] = field(default_factory=dict)  # changed keys; None removes
    patch_kind: WriteKind = "annotation"  # what the node patch is, for metrics and logs
    condition: Condition | None = None  # None: the node's already says the same
    events: tuple[PlanEvent, ...] = ()
    dry_run: bool = False  # computed and logged, never sent (``mode`` is not ``enforce``)
    new_no_execute: bool = False  # this patch adds a NoExecute taint (counts toward the hour)
    override_recorded: bool = False  # this patch records a new human override
    preflight_timeout: bool = False  # this plan announces the preflight timeout (once per node)
    recheck_after: float | None = None  # seconds: plan again then (a preflight deadline)
    warnings: tuple[PlanWarning, ...] = ()

    @property
    def taints_changed(self) -> bool:
        return self.taints != self.taints_before

    @property
    def added_taints(self) -> tuple[Taint, ...]:
        return tuple(t for t in self.taints if t not in self.taints_before)

    @property
    def removed_taints(self) -> tuple[Taint, ...]:
        return tuple(t for t in self.taints_before if t not in self.taints)

    @property
    def needs_patch(self) -> bool:
        return self.taints_changed or bool(self.annotations)

    @property
    def empty(self) -> bool:
        """Nothing to write at all (a wait may still be asked for)."""
        return not self.needs_patch and self.condition is None and not self.events

    def signature(self) -> tuple[object, ...]:
        """What makes two plans the same news (dry-run logs each distinct plan once)."""
        cond = None if self.condition is None else (self.condition.status, self.condition.reason)
        return (
            self.taints if self.taints_changed else None,
            tuple(sorted(self.annotations.items(), key=lambda kv: kv[0])),
            cond,
            tuple((e.reason, e.message) for e in self.events),
        )


def plan(
    node: Node,
    intent: NodeIntent,
    config: RemediationConfig,
    *,
    now: float,
    monotonic: float,
    no_execute_added: Sequence[float] = (),
    preflight_since: float | None = None,
    preflight_warned: bool = False,
) -> Plan:
    """The plan that makes ``node`` look like ``intent``.

    ``now``: unix time (overrides, the NoExecute hour); ``monotonic``: the clock preflight waits
    are measured on. ``no_execute_added``: unix times of the NoExecute taints we added, fleet-wide
    (older than an hour do not count). ``preflight_since``: monotonic time the node's preflight
    taint was first seen (None: now); ``preflight_warned``: its timeout was already announced.
    """
    dry_run = config.mode != "enforce"
    if node.labels.get(config.managed_label) == "false":
        return Plan(node=node.name, taints_before=node.taints, taints=node.taints, dry_run=dry_run)
    keys = AnnotationKeys.of(config.annotation_prefix)
    mine = recorded(node, config)
    old, ours = mine.snapshot, mine.taints
    warnings: list[PlanWarning] = []
    override = _read_override(node.name, node.annotations.get(keys.override), warnings)
    value = label_value(intent.reason_code)
    events: list[PlanEvent] = []

    want, new_no_execute = _effect(
        intent, ours, config, now=now, no_execute_added=no_execute_added, warnings=warnings
    )
    want, new_override, override_event = _override(
        intent, want, override, value=value, removed_by_hand=not ours and mine.applied, config=config, now=now
    )
    if override_event is not None:
        events.append(override_event)
    if intent.state == "healthy":
        new_override = None
    if want is None and ours and intent.state in ("quarantined", "probation"):
        # Our quarantine taint is on a node that is still out: only a release decision (or a
        # human) takes it off. A held verdict (a limit, the breaker) stops new quarantines; it
        # never undoes one, and the node says what it shows: tainted, not held.
        want, value = ours[0].effect, ours[0].value or value
        intent = msgspec.structs.replace(
            intent, held=False, snapshot=msgspec.structs.replace(intent.snapshot, tainted=True, held=False)
        )
        warnings.append(
            PlanWarning(
                "quarantine held by a safety limit, but our taint is on the node: it stays",
                {"node": intent.node, "state": intent.state, "taint": f"{value}:{want}"},
            )
        )

    # Preflight: the preflight taint goes once the node passed, or turns into ours on failure;
    # held and pending nodes keep it (they are out either way).
    pf_key = config.preflight.taint_key
    has_preflight = config.preflight.enabled and any(t.key == pf_key for t in node.taints)
    drop_preflight = has_preflight and not intent.held and (want is not None or intent.preflight == "passed")
    preflight_timeout = False
    recheck_after: float | None = None
    if has_preflight and not drop_preflight and not intent.held:
        waited = monotonic - (monotonic if preflight_since is None else preflight_since)
        timeout = config.preflight.timeout_seconds
        if waited <= timeout:
            recheck_after = timeout - waited + 1.0
        elif not preflight_warned:
            preflight_timeout = True
            events.append(
                PlanEvent(
                    "Warning",
                    "GpuwardenPreflightTimeout",
                    f"no preflight verdict after {waited:.0f}s (timeout {timeout:.0f}s); "
                    f"{pf_key} stays: {intent.message}",
                )
            )

    new_taints, want = _taints(node.taints, ours, want, value, config, now=now, drop_preflight=drop_preflight)

    # Not tainted when we hold back (a respected override): a restarted pipeline must not
    # believe the node is out. Otherwise the pipeline's own reading stands, so a suspect
    # node's PreferNoSchedule is never restored as a quarantine.
    snapshot = msgspec.structs.replace(intent.snapshot, tainted=intent.snapshot.tainted and want is not None)
    if old is not None and _same_episode(old, snapshot):
        # Written by another replica (before a fail-over or a restart) about the same decision:
        # every replica times it by its own receive clock. Keep what the node says, so that a
        # new leader neither patches every node nor announces every quarantine again.
        snapshot = old
        # The runbook too: restored evidence may no longer name its rule's own.
        intent = msgspec.structs.replace(
            intent,
            since=old.since,
            message=node.annotations.get(keys.reason, intent.message),
            runbook_url=node.annotations.get(keys.runbook, intent.runbook_url),
        )
    wanted_ann: dict[str, str | None] = {
        keys.health: encode_snapshot(snapshot),
        keys.reason: intent.message,
        keys.decided: rfc3339(intent.since),
        keys.override: None if new_override is None else msgspec.json.encode(new_override).decode(),
        keys.taint: None if want is None else f"{value}:{want}",
        keys.runbook: intent.runbook_url if intent.runbook_url and _troubled(intent) else None,
    }
    story = _story(intent, config)

    state_event_done = override_event is not None
    if drop_preflight:
        if want is not None:
            events.append(
                PlanEvent(
                    "Warning",
                    "GpuwardenPreflightFailed",
                    f"preflight failed, {pf_key} replaced by {config.taint_key}={value}:{want}: {story}",
                )
            )
            state_event_done = True
        else:
            events.append(
                PlanEvent("Normal", "GpuwardenPreflightPassed", f"preflight passed, {pf_key} removed")
            )
    if not state_event_done:
        ev = _state_event(old, intent, want, value, config.taint_key, story=story)
        if ev is not None:
            events.append(ev)

    return Plan(
        node=node.name,
        taints_before=node.taints,
        taints=new_taints,
        annotations={k: v for k, v in wanted_ann.items() if node.annotations.get(k) != v},
        patch_kind=_patch_kind(node.taints, new_taints, ours, want, config.taint_key),
        condition=_condition(node, intent, config.condition_type, story),
        events=tuple(events),
        dry_run=dry_run,
        new_no_execute=new_no_execute and want == "NoExecute",
        override_recorded=new_override is not None and new_override != override,
        preflight_timeout=preflight_timeout,
        recheck_after=recheck_after,
        warnings=tuple(warnings),
    )


# -- the parts ------------------------------------------------------------------------------------


def _read_override(node: str, text: str | None, warnings: list[PlanWarning]) -> _Override | None:
    if text is None:
        return None
    try:
        ov = msgspec.json.decode(text, type=_Override)
        parse_rfc3339(ov.until)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
        # Hand-edited into something we cannot read: ignoring it is the only reading that does
        # not invent an override nobody asked for; the next human removal records a fresh one.
        warnings.append(PlanWarning("unreadable override annotation ignored", {"node": node, "value": text}))
        return None
    return ov


def _effect(
    intent: NodeIntent,
    ours: Sequence[Taint],
    config: RemediationConfig,
    *,
    now: float,
    no_execute_added: Sequence[float],
    warnings: list[PlanWarning],
) -> tuple[TaintEffect | None, bool]:
    """The effect we apply, and whether it is a NoExecute new to this node."""
    effect = intent.effect
    if effect != "NoExecute":
        return effect, False
    if not config.allow_no_execute:
        return "NoSchedule", False
    if any(t.effect == "NoExecute" for t in ours):
        return "NoExecute", False  # keeping one is not a new eviction
    spent = sum(1 for at in no_execute_added if now - at < NO_EXECUTE_WINDOW_S)
    if spent >= config.max_no_execute_per_hour:
        warnings.append(
            PlanWarning(
                "NoExecute budget spent for this hour, tainting NoSchedule instead",
                {"node": intent.node, "max_no_execute_per_hour": config.max_no_execute_per_hour},
            )
        )
        return "NoSchedule", False
    return "NoExecute", True


def _override(
    intent: NodeIntent,
    want: TaintEffect | None,
    override: _Override | None,
    *,
    value: str,
    removed_by_hand: bool,
    config: RemediationConfig,
    now: float,
) -> tuple[TaintEffect | None, _Override | None, PlanEvent | None]:
    """A human's removal of our taint against the taint we want: the effect still wanted, the
    override to record (None: none), and the event that says what happened."""
    if want is None:
        return None, override, None
    if override is not None and override.active(intent.evidence_key, now):
        return None, override, None
    if removed_by_hand:
        # Our record says the taint is ours and on, yet the node has none: a human took it off.
        # That overrides this evidence for the cooldown; new evidence does not.
        until = now + config.override_cooldown_seconds
        recorded_now = _Override(evidence_key=intent.evidence_key, until=rfc3339(until), at=rfc3339(now))
        return (
            None,
            recorded_now,
            PlanEvent(
                "Warning",
                "GpuwardenOverrideRespected",
                f"{config.taint_key} was removed by hand; not re-tainting for the same evidence "
                f"({intent.evidence_key}) until {rfc3339(until)}: {intent.message}",
            ),
        )
    if override is None:
        return want, None, None
    why = (
        "manual override expired"
        if override.evidence_key == intent.evidence_key
        else f"new evidence ({intent.evidence_key}) since the manual override of {override.at}"
    )
    return (
        want,
        None,
        PlanEvent(
            "Warning",
            "GpuwardenQuarantined" if intent.state != "suspect" else "GpuwardenSuspect",
            f"{why}; tainted {config.taint_key}={value}:{want}: {intent.message}",
        ),
    )


def _taints(
    current: tuple[Taint, ...],
    ours: tuple[Taint, ...],
    want: TaintEffect | None,
    value: str,
    config: RemediationConfig,
    *,
    now: float,
    drop_preflight: bool,
) -> tuple[tuple[Taint, ...], TaintEffect | None]:
    """The whole wanted ``spec.taints``: every taint that is not ours as read and where it was,
    ours replaced in place (or added last), the preflight taint dropped when it goes. Also the
    effect that ends up ours: None when a human's taint with our key and that effect is there.

    A NoExecute taint carries ``timeAdded``, as the node lifecycle controller and ``kubectl
    taint`` write it (the API server does not fill it in): the taint eviction controller reads
    it, and so does the hour's eviction budget after a restart or a fail-over (``Actuator``). A
    NoExecute taint that only changes its value keeps its time: it evicts nothing new."""

    def ours_as(effect: TaintEffect, before: Taint | None) -> Taint:
        added = None
        if effect == "NoExecute":
            kept = before is not None and before.effect == "NoExecute" and before.time_added is not None
            added = before.time_added if kept and before is not None else rfc3339(now)
        return Taint(key=config.taint_key, effect=effect, value=value, time_added=added)

    taints: list[Taint] = []
    placed = False
    for t in current:
        if t in ours:
            if want is not None and not placed:
                same = t.effect == want and t.value == value
                taints.append(t if same else ours_as(want, t))
                placed = True
            # else: ours and no longer wanted (or a duplicate of ours): removed
        elif drop_preflight and t.key == config.preflight.taint_key:
            continue
        else:
            taints.append(t)  # another controller's, or a human's with our key
    if want is not None and not placed:
        if any(t.key == config.taint_key and t.effect == want for t in taints):
            # A human's taint with our key and this effect already keeps the node out; taints
            # are unique by key and effect, so ours cannot be added, and theirs stays theirs.
            return tuple(taints), None
        taints.append(ours_as(want, None))
    return tuple(taints), want


def _patch_kind(
    before: tuple[Taint, ...],
    after: tuple[Taint, ...],
    ours: tuple[Taint, ...],
    want: TaintEffect | None,
    key: str,
) -> WriteKind:
    if after == before:
        return "annotation"
    if want is not None and tuple(t for t in after if t.key == key) != ours:
        return "taint"
    if ours and not any(t.key == key for t in after):
        return "untaint"
    return "preflight_release"


def _untimed(snapshot: HealthSnapshot) -> HealthSnapshot:
    """The snapshot without what describes rather than decides: times, and the findings' words
    and measured values (a suspect GPU's temperature changes with every report)."""
    return msgspec.structs.replace(
        snapshot,
        since=0.0,
        quarantines=[],
        message=None,
        findings=[msgspec.structs.replace(f, since=0.0, summary="", evidence={}) for f in snapshot.findings],
    )


def _same_episode(a: HealthSnapshot, b: HealthSnapshot) -> bool:
    """The same decision: timed by two replicas (within ``SAME_EPISODE_S``), or described again
    with newer measurements. Equal state, taint, evidence keys and lemon count; a new quarantine
    adds to ``quarantines``, so it is never the same episode. Keeping what the node already says
    then costs no write: a resync of an unchanged fleet sends nothing."""
    return (
        abs(a.since - b.since) <= SAME_EPISODE_S
        and len(a.quarantines) == len(b.quarantines)
        and _untimed(a) == _untimed(b)
    )


def _troubled(intent: NodeIntent) -> bool:
    return intent.held or intent.state != "healthy"


def _story(intent: NodeIntent, config: RemediationConfig) -> str:
    """The decision's one line with what a reader of ``kubectl describe`` needs next: what happens
    and when (the probation clock), what removing our taint by hand means, and the runbook.
    Absolute times only, so the same decision always reads the same (no rewrite per reconcile)."""
    parts = [intent.message]
    if _troubled(intent):
        step = next_step(
            intent.state,
            intent.since,
            held=intent.held,
            lemon=intent.snapshot.lemon,
            probation_seconds=intent.probation_seconds,
            clear_for_seconds=intent.clear_for_seconds,
        )
        parts.append(f"next: {step}")
    if intent.effect is not None and not intent.held and intent.state in ("quarantined", "probation"):
        parts.append(override_note(config.taint_key, config.override_cooldown_seconds))
    if intent.runbook_url and _troubled(intent):
        parts.append(f"runbook: {intent.runbook_url}")
    return "; ".join(parts)


def _state_event(
    old: HealthSnapshot | None,
    intent: NodeIntent,
    want: TaintEffect | None,
    value: str,
    key: str,
    *,
    story: str,
) -> PlanEvent | None:
    if old is None:
        if intent.state == "healthy" and not intent.held:
            return None  # a node we meet healthy has no change to announce
    elif (old.state, old.since, old.held) == (intent.state, intent.since, intent.held):
        return None
    taint = f"tainted {key}={value}:{want}" if want is not None else "not tainted"
    if intent.held:
        return PlanEvent(
            "Warning", "GpuwardenHeld", f"quarantine held by a safety limit, not tainted: {story}"
        )
    if intent.state == "quarantined":
        relapse = old is not None and old.state == "probation"
        what = "relapsed during probation, quarantined" if relapse else "quarantined"
        return PlanEvent("Warning", "GpuwardenQuarantined", f"{what}, {taint}: {story}")
    if intent.state == "probation":
        return PlanEvent("Normal", "GpuwardenProbation", f"on probation, {taint}: {story}")
    if intent.state == "suspect":
        return PlanEvent("Warning", "GpuwardenSuspect", f"suspect, {taint}: {story}")
    if old is not None and (old.tainted or old.state in ("quarantined", "probation")):
        return PlanEvent("Normal", "GpuwardenReleased", f"released, {key} removed: {intent.message}")
    return PlanEvent("Normal", "GpuwardenHealthy", f"healthy: {intent.message}")


def _condition(node: Node, intent: NodeIntent, condition_type: str, message: str) -> Condition | None:
    """The condition to write, or None when the node's already says the same."""
    out = intent.held or intent.state in ("quarantined", "probation")
    status: ConditionStatus = "False" if out else "True"
    reason = "QuarantineHeld" if intent.held else _CONDITION_REASONS[intent.state]
    current = next((c for c in node.conditions if c.type == condition_type), None)
    if current is not None and (current.status, current.reason, current.message) == (
        status,
        reason,
        message,
    ):
        return None
    return Condition(
        type=condition_type,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=rfc3339(intent.since),
    )
