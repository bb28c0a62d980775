"""The remediation planner as a table: one node as read, one intent, the state the actuator keeps,
and the exact plan that must come out (taints, annotations, condition, events, waits).

Every row states the whole plan: a field a row leaves at its default is asserted to be that
default (no taint change, no annotation, no condition, no event, no wait), so a row that starts
writing something new fails. How plans reach the cluster (the double, conflicts, leadership) is
tests/test_actuator.py's business.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec
import pytest

from aggregator.config import PreflightConfig, RemediationConfig
from aggregator.kube.objects import Condition, Node, Taint
from aggregator.remediate.model import NodeIntent, encode_snapshot
from aggregator.remediate.planner import Plan, WriteKind, label_value, plan, recorded, rfc3339
from tests.test_actuator import OURS, PREFLIGHT, T0, healthy, intent

HEALTH = "gpuwarden.io/health"
REASON = "gpuwarden.io/reason"
DECIDED = "gpuwarden.io/decided-at"
OVERRIDE = "gpuwarden.io/override"
TAINT = "gpuwarden.io/taint"
RUNBOOK = "gpuwarden.io/runbook"
RB = "https://runbooks.example/GpuwardenNodeQuarantined.md"
MONO = 5000.0  # the monotonic clock's value in every row

FOREIGN = Taint("other.io/maintenance", "NoExecute", "drain", time_added="2025-01-02T03:04:05Z")
FOREIGN2 = Taint("nvidia.com/gpu", "PreferNoSchedule", "present")
XID79 = Taint(OURS, "NoSchedule", "xid-79")
HUMAN = Taint(OURS, "NoSchedule", "bad-fan")  # our key, but nobody recorded applying it
PREFLIGHT_TAINT = Taint(PREFLIGHT, "NoSchedule")
XID = "XID 79: GPU fell off the bus"

ENFORCE = RemediationConfig(mode="enforce")


def cfg(**kw: Any) -> RemediationConfig:
    return msgspec.structs.replace(ENFORCE, **kw)


def bare(*taints: Taint, labels: Mapping[str, str] | None = None) -> Node:
    return Node(name="n1", resource_version="1", labels=dict(labels or {}), taints=taints)


def applied(node: Node, p: Plan) -> Node:
    """The node after ``p`` was written (what the API server would return)."""
    annotations = dict(node.annotations)
    for k, v in p.annotations.items():
        if v is None:
            annotations.pop(k, None)
        else:
            annotations[k] = v
    conditions = node.conditions
    if p.condition is not None:
        conditions = (*(c for c in conditions if c.type != p.condition.type), p.condition)
    return replace(node, taints=p.taints, annotations=annotations, conditions=conditions)


def after(node: Node, *intents: NodeIntent, config: RemediationConfig = ENFORCE, now: float = T0) -> Node:
    """``node`` once each intent's plan was applied in turn."""
    for i in intents:
        node = applied(node, plan(node, i, config, now=now, monotonic=MONO))
    return node


def without(node: Node, *gone: Taint) -> Node:
    return replace(node, taints=tuple(t for t in node.taints if t not in gone))


def with_taints(node: Node, *taints: Taint) -> Node:
    return replace(node, taints=taints)


def annotated(node: Node, **annotations: str) -> Node:
    extra = {f"gpuwarden.io/{k.replace('_', '-')}": v for k, v in annotations.items()}
    return replace(node, annotations={**node.annotations, **extra})


def snap(i: NodeIntent, *, tainted: bool | None = None) -> str:
    """The health annotation a plan for ``i`` writes (``tainted`` overridden when we hold back)."""
    s = i.snapshot if tainted is None else msgspec.structs.replace(i.snapshot, tainted=tainted)
    return encode_snapshot(s)


def override_json(evidence_key: str, *, at: float, until: float) -> str:
    return json.dumps(
        {"evidence_key": evidence_key, "until": rfc3339(until), "at": rfc3339(at)}, separators=(",", ":")
    )


def wrote(i: NodeIntent, *, tainted: bool | None = None, taint: str | None = None) -> dict[str, str | None]:
    """The annotations a first plan for ``i`` writes on a node that has none of ours."""
    ann: dict[str, str | None] = {
        HEALTH: snap(i, tainted=tainted),
        REASON: i.message,
        DECIDED: rfc3339(i.since),
    }
    if taint is not None:
        ann[TAINT] = taint
    return ann


@dataclass(frozen=True)
class Expect:
    taints: tuple[Taint, ...] | None = None  # None: exactly the node's, unchanged
    kind: WriteKind = "annotation"
    annotations: Mapping[str, str | None] = field(default_factory=dict)
    condition: tuple[str, str] | None = None  # (status, reason)
    events: tuple[tuple[str, str], ...] = ()  # (type, reason)
    says: tuple[str, ...] = ()  # each in some event's message
    dry_run: bool = False
    new_no_execute: bool = False
    override_recorded: bool = False
    preflight_timeout: bool = False
    recheck_after: float | None = None
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class Row:
    node: Node
    intent: NodeIntent
    expect: Expect
    config: RemediationConfig = ENFORCE
    now: float = T0
    no_execute_added: Sequence[float] = ()
    preflight_since: float | None = None
    preflight_warned: bool = False


Q = intent("n1", message=XID)
Q_LATER = intent("n1", since=T0 + 100, message=XID)
H = healthy("n1", since=T0 + 3600)
QUARANTINED = after(bare(FOREIGN), Q)  # as our quarantine left it: FOREIGN, then ours
DBE = intent("n1", since=T0 + 200, reason_code="dbe", evidence_key="dbe:gpu3", message="DBE on GPU 3")
Q_RB = msgspec.structs.replace(Q, runbook_url=RB)
PROBATION = intent("n1", "probation", since=T0 + 900, message="clean since the reboot")
NOEX = intent("n1", effect="NoExecute", message=XID)
NOEX_ON = cfg(allow_no_execute=True, max_no_execute_per_hour=1)
SUSPECT_P = intent("n1", "suspect", effect="PreferNoSchedule", reason_code="ecc-rate", message="ECC rate")
HUMAN_REMOVED = without(QUARANTINED, XID79)
OVERRIDDEN = after(HUMAN_REMOVED, Q_LATER, now=T0 + 100)  # the override recorded at T0+100
COOLDOWN = ENFORCE.override_cooldown_seconds
PENDING = healthy("n1", message="preflight: 1 of 3 clean reports")
PF = PreflightConfig(timeout_seconds=600)

ROWS: dict[str, Row] = {
    # -- quarantine and release -------------------------------------------------------------------
    "new quarantine": Row(
        bare(FOREIGN, FOREIGN2),
        Q,
        Expect(
            taints=(FOREIGN, FOREIGN2, XID79),
            kind="taint",
            annotations=wrote(Q, taint="xid-79:NoSchedule"),
            condition=("False", "Quarantined"),
            events=(("Warning", "GpuwardenQuarantined"),),
            says=(
                f"{OURS}=xid-79:NoSchedule",
                XID,
                "next: probation starts once the evidence has been gone 2 min, release 30 min after that",
                f"removing the {OURS} taint by hand is an override: the same evidence does not taint the "
                "node again for 1 day; new evidence does",
            ),
        ),
    ),
    "a quarantine names its runbook in the event, the condition and an annotation": Row(
        bare(),
        Q_RB,
        Expect(
            taints=(XID79,),
            kind="taint",
            annotations={**wrote(Q_RB, taint="xid-79:NoSchedule"), RUNBOOK: RB},
            condition=("False", "Quarantined"),
            events=(("Warning", "GpuwardenQuarantined"),),
            says=(f"runbook: {RB}",),
        ),
    ),
    "release removes the runbook annotation": Row(
        after(bare(), Q_RB),
        H,
        Expect(
            taints=(),
            kind="untaint",
            annotations={
                HEALTH: snap(H),
                REASON: "no findings",
                DECIDED: rfc3339(T0 + 3600),
                TAINT: None,
                RUNBOOK: None,
            },
            condition=("True", "Healthy"),
            events=(("Normal", "GpuwardenReleased"),),
            says=(f"released, {OURS} removed",),
        ),
    ),
    "release removes only our taint": Row(
        QUARANTINED,
        H,
        Expect(
            taints=(FOREIGN,),
            kind="untaint",
            annotations={HEALTH: snap(H), REASON: "no findings", DECIDED: rfc3339(T0 + 3600), TAINT: None},
            condition=("True", "Healthy"),
            events=(("Normal", "GpuwardenReleased"),),
            says=(f"released, {OURS} removed",),
        ),
    ),
    "stale taint and override annotations removed on release": Row(
        annotated(
            with_taints(QUARANTINED, XID79, FOREIGN),
            override=override_json("xid:48:gpu1", at=T0 - 90000, until=T0 - 3600),
        ),
        H,
        Expect(
            taints=(FOREIGN,),
            kind="untaint",
            annotations={
                HEALTH: snap(H),
                REASON: "no findings",
                DECIDED: rfc3339(T0 + 3600),
                TAINT: None,
                OVERRIDE: None,
            },
            condition=("True", "Healthy"),
            events=(("Normal", "GpuwardenReleased"),),
        ),
    ),
    "a suspect's PreferNoSchedule is ours but the snapshot never calls it out": Row(
        bare(FOREIGN),
        SUSPECT_P,
        Expect(
            taints=(FOREIGN, Taint(OURS, "PreferNoSchedule", "ecc-rate")),
            kind="taint",
            annotations=wrote(SUSPECT_P, tainted=False, taint="ecc-rate:PreferNoSchedule"),
            condition=("True", "Suspect"),
            events=(("Warning", "GpuwardenSuspect"),),
        ),
        config=cfg(suspect_effect="PreferNoSchedule"),
    ),
    "the suspect's PreferNoSchedule goes on release, with its record": Row(
        after(bare(FOREIGN), SUSPECT_P),
        healthy("n1", since=T0 + 60),
        Expect(
            taints=(FOREIGN,),
            kind="untaint",
            annotations={
                HEALTH: snap(healthy("n1", since=T0 + 60)),
                REASON: "no findings",
                DECIDED: rfc3339(T0 + 60),
                TAINT: None,
            },
            condition=("True", "Healthy"),
            events=(("Normal", "GpuwardenHealthy"),),
        ),
    ),
    "probation keeps our taint": Row(
        QUARANTINED,
        PROBATION,
        Expect(
            annotations={
                HEALTH: snap(PROBATION),
                REASON: "clean since the reboot",
                DECIDED: rfc3339(T0 + 900),
            },
            condition=("False", "Probation"),
            events=(("Normal", "GpuwardenProbation"),),
            says=(
                f"on probation, tainted {OURS}=xid-79:NoSchedule",
                # When probation can release it: date and zone, from the state's start.
                f"next: released at {rfc3339(T0 + 900 + 1800)} if no quarantine evidence returns",
            ),
        ),
    ),
    "a relapse during probation says so": Row(
        after(QUARANTINED, PROBATION),
        intent("n1", since=T0 + 1000, message=XID),
        Expect(
            annotations={
                HEALTH: snap(intent("n1", since=T0 + 1000, message=XID)),
                REASON: XID,
                DECIDED: rfc3339(T0 + 1000),
            },
            condition=("False", "Quarantined"),
            events=(("Warning", "GpuwardenQuarantined"),),
            says=("relapsed during probation, quarantined",),
        ),
    ),
    "held: a condition and a warning, no taint": Row(
        bare(),
        intent("n1", effect=None, held=True, message="pool limit reached"),
        Expect(
            annotations=wrote(intent("n1", effect=None, held=True, message="pool limit reached")),
            condition=("False", "QuarantineHeld"),
            events=(("Warning", "GpuwardenHeld"),),
            says=(
                "quarantine held by a safety limit, not tainted: pool limit reached",
                "no taint is applied until a human resets the breaker",
            ),
        ),
    ),
    "the taint value is a valid label value": Row(
        bare(),
        intent("n1", reason_code="row remap failure: GPU#3 (pending) " * 4, message=XID),
        Expect(
            taints=(Taint(OURS, "NoSchedule", label_value("row remap failure: GPU#3 (pending) " * 4)),),
            kind="taint",
            annotations=wrote(
                intent("n1", reason_code="row remap failure: GPU#3 (pending) " * 4, message=XID),
                taint=label_value("row remap failure: GPU#3 (pending) " * 4) + ":NoSchedule",
            ),
            condition=("False", "Quarantined"),
            events=(("Warning", "GpuwardenQuarantined"),),
        ),
    ),
    # -- foreign taints ---------------------------------------------------------------------------
    "new evidence replaces our taint in place, foreign taints around it untouched": Row(
        with_taints(QUARANTINED, FOREIGN, XID79, FOREIGN2),
        DBE,
        Expect(
            taints=(FOREIGN, Taint(OURS, "NoSchedule", "dbe"), FOREIGN2),
            kind="taint",
            annotations={
                HEALTH: snap(DBE),
                REASON: "DBE on GPU 3",
                DECIDED: rfc3339(T0 + 200),
                TAINT: "dbe:NoSchedule",
            },
            condition=("False", "Quarantined"),
            events=(("Warning", "GpuwardenQuarantined"),),
        ),
    ),
    "a foreign taint added beside ours: nothing to write": Row(
        with_taints(QUARANTINED, FOREIGN, XID79, FOREIGN2),
        Q,
        Expect(),
    ),
    "a human's taint with our key stays on release": Row(
        bare(HUMAN),
        healthy("n1"),
        Expect(annotations=wrote(healthy("n1")), condition=("True", "Healthy")),
    ),
    "a human's taint with our key and effect: ours cannot go beside it, theirs stays theirs": Row(
        bare(HUMAN),
        Q,
        Expect(
            annotations=wrote(Q, tainted=False),
            condition=("False", "Quarantined"),
            events=(("Warning", "GpuwardenQuarantined"),),
            says=("quarantined, not tainted",),
        ),
    ),
    "a human's taint with our key and another effect: ours goes beside it": Row(
        bare(Taint(OURS, "PreferNoSchedule", "watch-me")),
        Q,
        Expect(
            taints=(Taint(OURS, "PreferNoSchedule", "watch-me"), XID79),
            kind="taint",
            annotations=wrote(Q, taint="xid-79:NoSchedule"),
            condition=("False", "Quarantined"),
            events=(("Warning", "GpuwardenQuarantined"),),
        ),
    ),
    "an unreadable snapshot is still ours, and so is its taint": Row(
        annotated(bare(FOREIGN, XID79), health="{not json"),
        H,
        Expect(
            taints=(FOREIGN,),
            kind="untaint",
            annotations={HEALTH: snap(H), REASON: "no findings", DECIDED: rfc3339(T0 + 3600)},
            condition=("True", "Healthy"),  # no event: without a readable snapshot, no change to tell
        ),
    ),
    # -- a human removed our taint ----------------------------------------------------------------
    "a human removed our taint: the override is recorded, not re-tainted": Row(
        HUMAN_REMOVED,
        Q_LATER,
        Expect(
            annotations={
                HEALTH: snap(Q_LATER, tainted=False),
                DECIDED: rfc3339(T0 + 100),
                OVERRIDE: override_json("xid:79:gpu0", at=T0 + 100, until=T0 + 100 + COOLDOWN),
                TAINT: None,
            },
            events=(("Warning", "GpuwardenOverrideRespected"),),
            says=(rfc3339(T0 + 100 + COOLDOWN), "xid:79:gpu0"),
            override_recorded=True,
        ),
        now=T0 + 100,
    ),
    "a human removed the suspect's PreferNoSchedule: respected too": Row(
        without(after(bare(FOREIGN), SUSPECT_P), Taint(OURS, "PreferNoSchedule", "ecc-rate")),
        SUSPECT_P,
        Expect(
            annotations={
                OVERRIDE: override_json("xid:79:gpu0", at=T0 + 100, until=T0 + 100 + COOLDOWN),
                TAINT: None,
            },
            events=(("Warning", "GpuwardenOverrideRespected"),),
            override_recorded=True,
        ),
        config=cfg(suspect_effect="PreferNoSchedule"),
        now=T0 + 100,
    ),
    "inside the override window: nothing to write": Row(
        OVERRIDDEN, Q_LATER, Expect(), now=T0 + 100 + COOLDOWN - 1
    ),
    "the override expired: tainted again": Row(
        OVERRIDDEN,
        Q_LATER,
        Expect(
            taints=(FOREIGN, XID79),
            kind="taint",
            annotations={HEALTH: snap(Q_LATER), OVERRIDE: None, TAINT: "xid-79:NoSchedule"},
            events=(("Warning", "GpuwardenQuarantined"),),
            says=("manual override expired; tainted",),
        ),
        now=T0 + 100 + COOLDOWN,
    ),
    "new evidence during the override window: tainted again": Row(
        OVERRIDDEN,
        DBE,
        Expect(
            taints=(FOREIGN, Taint(OURS, "NoSchedule", "dbe")),
            kind="taint",
            annotations={
                HEALTH: snap(DBE),
                REASON: "DBE on GPU 3",
                DECIDED: rfc3339(T0 + 200),
                OVERRIDE: None,
                TAINT: "dbe:NoSchedule",
            },
            condition=("False", "Quarantined"),  # in new words
            events=(("Warning", "GpuwardenQuarantined"),),
            says=(f"new evidence (dbe:gpu3) since the manual override of {rfc3339(T0 + 100)}",),
        ),
        now=T0 + 200,
    ),
    "healthy drops the override": Row(
        OVERRIDDEN,
        H,
        Expect(
            annotations={HEALTH: snap(H), REASON: "no findings", DECIDED: rfc3339(T0 + 3600), OVERRIDE: None},
            condition=("True", "Healthy"),
            events=(("Normal", "GpuwardenReleased"),),
        ),
        now=T0 + 3600,
    ),
    "an unreadable override is ignored, with a warning": Row(
        annotated(HUMAN_REMOVED, override="{hand-edited"),
        Q_LATER,
        Expect(
            annotations={
                HEALTH: snap(Q_LATER, tainted=False),
                DECIDED: rfc3339(T0 + 100),
                OVERRIDE: override_json("xid:79:gpu0", at=T0 + 100, until=T0 + 100 + COOLDOWN),
                TAINT: None,
            },
            events=(("Warning", "GpuwardenOverrideRespected"),),
            override_recorded=True,
            warnings=("unreadable override annotation ignored",),
        ),
        now=T0 + 100,
    ),
    # -- NoExecute --------------------------------------------------------------------------------
    "NoExecute without allow_no_execute is NoSchedule": Row(
        bare(),
        NOEX,
        Expect(
            taints=(XID79,),
            kind="taint",
            annotations=wrote(NOEX, taint="xid-79:NoSchedule"),
            condition=("False", "Quarantined"),
            events=(("Warning", "GpuwardenQuarantined"),),
        ),
    ),
    "NoExecute within the hour's budget": Row(
        bare(),
        NOEX,
        Expect(
            # With its timeAdded, as the taint eviction controller and the budget read it.
            taints=(Taint(OURS, "NoExecute", "xid-79", time_added=rfc3339(T0)),),
            kind="taint",
            annotations=wrote(NOEX, taint="xid-79:NoExecute"),
            condition=("False", "Quarantined"),
            events=(("Warning", "GpuwardenQuarantined"),),
            new_no_execute=True,
        ),
        config=NOEX_ON,
        no_execute_added=(T0 - 3600,),  # an hour ago: no longer counts
    ),
    "NoExecute budget exhausted: NoSchedule, with a warning": Row(
        bare(),
        NOEX,
        Expect(
            taints=(XID79,),
            kind="taint",
            annotations=wrote(NOEX, taint="xid-79:NoSchedule"),
            condition=("False", "Quarantined"),
            events=(("Warning", "GpuwardenQuarantined"),),
            warnings=("NoExecute budget spent for this hour, tainting NoSchedule instead",),
        ),
        config=NOEX_ON,
        no_execute_added=(T0 - 3599,),
    ),
    "budget back: NoSchedule upgraded to NoExecute": Row(
        after(bare(), NOEX),
        NOEX,
        Expect(
            taints=(Taint(OURS, "NoExecute", "xid-79", time_added=rfc3339(T0 + 3601)),),
            kind="taint",
            annotations={TAINT: "xid-79:NoExecute"},
            new_no_execute=True,
        ),
        config=NOEX_ON,
        now=T0 + 3601,
        no_execute_added=(T0,),
    ),
    "keeping our NoExecute is not a new one, budget or not": Row(
        after(bare(), NOEX, config=NOEX_ON),
        NOEX,
        Expect(),
        config=NOEX_ON,
        no_execute_added=(T0,),
    ),
    # -- preflight --------------------------------------------------------------------------------
    "preflight pending: the taint stays, wake at the deadline": Row(
        bare(PREFLIGHT_TAINT),
        PENDING,
        Expect(annotations=wrote(PENDING), condition=("True", "Healthy"), recheck_after=600 - 100 + 1.0),
        config=cfg(preflight=PF),
        preflight_since=MONO - 100,
    ),
    "preflight pending, first seen now": Row(
        after(bare(PREFLIGHT_TAINT), PENDING),
        PENDING,
        Expect(recheck_after=601.0),
        config=cfg(preflight=PF),
    ),
    "preflight at its timeout, not past it: no warning yet": Row(
        after(bare(PREFLIGHT_TAINT), PENDING),
        PENDING,
        Expect(recheck_after=1.0),
        config=cfg(preflight=PF),
        preflight_since=MONO - 600,
    ),
    "preflight past its timeout: one warning": Row(
        after(bare(PREFLIGHT_TAINT), PENDING),
        PENDING,
        Expect(
            events=(("Warning", "GpuwardenPreflightTimeout"),),
            says=(f"no preflight verdict after 601s (timeout 600s); {PREFLIGHT} stays",),
            preflight_timeout=True,
        ),
        config=cfg(preflight=PF),
        preflight_since=MONO - 601,
    ),
    "preflight timeout already announced: nothing": Row(
        after(bare(PREFLIGHT_TAINT), PENDING),
        PENDING,
        Expect(),
        config=cfg(preflight=PF),
        preflight_since=MONO - 601,
        preflight_warned=True,
    ),
    "preflight passed: its taint goes, foreign ones stay": Row(
        after(bare(FOREIGN, PREFLIGHT_TAINT), PENDING),
        healthy("n1", message="preflight: 1 of 3 clean reports", preflight="passed"),
        Expect(
            taints=(FOREIGN,),
            kind="preflight_release",
            events=(("Normal", "GpuwardenPreflightPassed"),),
        ),
    ),
    "preflight failed: its taint turns into ours in one patch": Row(
        bare(PREFLIGHT_TAINT, FOREIGN),
        intent("n1", preflight="failed", message="DBE during burn-in"),
        Expect(
            taints=(FOREIGN, XID79),
            kind="taint",
            annotations=wrote(
                intent("n1", preflight="failed", message="DBE during burn-in"), taint="xid-79:NoSchedule"
            ),
            condition=("False", "Quarantined"),
            events=(("Warning", "GpuwardenPreflightFailed"),),
            says=(f"{PREFLIGHT} replaced by {OURS}=xid-79:NoSchedule: DBE during burn-in",),
        ),
    ),
    "held during preflight: the preflight taint stays": Row(
        bare(PREFLIGHT_TAINT),
        intent("n1", effect=None, held=True, preflight="failed"),
        Expect(
            annotations=wrote(intent("n1", effect=None, held=True, preflight="failed")),
            condition=("False", "QuarantineHeld"),
            events=(("Warning", "GpuwardenHeld"),),
        ),
    ),
    "held keeps the preflight taint whatever the verdict": Row(
        bare(PREFLIGHT_TAINT),
        intent("n1", effect=None, held=True, preflight="passed"),
        Expect(
            annotations=wrote(intent("n1", effect=None, held=True, preflight="passed")),
            condition=("False", "QuarantineHeld"),
            events=(("Warning", "GpuwardenHeld"),),
        ),
    ),
    "preflight disabled: its taint is left alone": Row(
        bare(PREFLIGHT_TAINT),
        healthy("n1", preflight="passed"),
        Expect(annotations=wrote(healthy("n1")), condition=("True", "Healthy")),
        config=cfg(preflight=PreflightConfig(enabled=False)),
    ),
    # -- dry-run, unmanaged, nothing to do --------------------------------------------------------
    "dry-run plans exactly what enforce would, marked not to send": Row(
        bare(FOREIGN),
        Q,
        Expect(
            taints=(FOREIGN, XID79),
            kind="taint",
            annotations=wrote(Q, taint="xid-79:NoSchedule"),
            condition=("False", "Quarantined"),
            events=(("Warning", "GpuwardenQuarantined"),),
            dry_run=True,
        ),
        config=cfg(mode="dry-run"),
    ),
    "unmanaged: nothing at all": Row(bare(FOREIGN, labels={"gpuwarden.io/managed": "false"}), Q, Expect()),
    "nothing changed: an empty plan": Row(QUARANTINED, Q, Expect()),
    "the same decision timed by another replica (within a minute): an empty plan": Row(
        QUARANTINED, intent("n1", since=T0 + 40, message=XID), Expect()
    ),
    "the same decision in newer words: an empty plan": Row(
        QUARANTINED, intent("n1", since=T0 + 10, message="XID 79 again"), Expect()
    ),
    "the same state re-entered later: annotations, no new condition or event": Row(
        QUARANTINED,
        intent("n1", since=T0 + 300, message=XID),
        Expect(
            annotations={HEALTH: snap(intent("n1", since=T0 + 300, message=XID)), DECIDED: rfc3339(T0 + 300)},
            events=(("Warning", "GpuwardenQuarantined"),),
        ),
    ),
}


def run(row: Row) -> Plan:
    return plan(
        row.node,
        row.intent,
        row.config,
        now=row.now,
        monotonic=MONO,
        no_execute_added=row.no_execute_added,
        preflight_since=row.preflight_since,
        preflight_warned=row.preflight_warned,
    )


@pytest.mark.parametrize("name", list(ROWS))
def test_plan(name: str) -> None:
    row = ROWS[name]
    want = row.expect
    got = run(row)
    assert got.taints == (row.node.taints if want.taints is None else want.taints)
    assert got.patch_kind == want.kind
    assert dict(got.annotations) == dict(want.annotations)
    cond = None if got.condition is None else (got.condition.status, got.condition.reason)
    assert cond == want.condition
    if got.condition is not None:
        assert got.condition.type == "GPUHealthy"
        # The decision's line first, then what the reader of kubectl describe needs next.
        assert got.condition.message.startswith(row.intent.message)
        assert all(s in got.condition.message for s in want.says if s.startswith(("next:", "runbook:")))
        assert got.condition.last_transition_time == rfc3339(row.intent.since)
    for t in got.added_taints:  # a taint value the API server would reject fails the whole patch
        assert t.value is not None and len(t.value) <= 63
        assert re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?", t.value)
    assert [(e.type, e.reason) for e in got.events] == list(want.events)
    for text in want.says:
        assert any(text in e.message for e in got.events), text
    assert all("\n" not in e.message for e in got.events)
    assert got.dry_run == want.dry_run
    assert got.new_no_execute == want.new_no_execute
    assert got.override_recorded == want.override_recorded
    assert got.preflight_timeout == want.preflight_timeout
    assert got.recheck_after == want.recheck_after
    assert [w.message for w in got.warnings] == list(want.warnings)
    writes = want.taints is not None or want.annotations or want.condition is not None or want.events
    assert got.empty == (not writes)


@pytest.mark.parametrize("name", list(ROWS))
def test_foreign_taints_are_never_touched(name: str) -> None:
    """Every taint that is neither ours nor the preflight taint comes out exactly as read, in the
    order read: ``spec.taints`` is replaced whole, so a lost one would be lost for good."""
    row = ROWS[name]
    ours = {OURS, PREFLIGHT}
    before = [t for t in row.node.taints if t.key not in ours]
    assert [t for t in run(row).taints if t.key not in ours] == before


@pytest.mark.parametrize("name", list(ROWS))
def test_a_plan_applied_is_the_node_s_intent(name: str) -> None:
    """Planning again on the node as the plan left it writes nothing: reconciles converge in one
    step, so a resync of an unchanged fleet costs no write."""
    row = ROWS[name]
    first = run(row)
    again = replace(
        row, node=applied(row.node, first), preflight_warned=row.preflight_warned or first.preflight_timeout
    )
    assert run(again).empty


def test_added_and_removed_taints_name_the_difference() -> None:
    p = run(ROWS["new evidence replaces our taint in place, foreign taints around it untouched"])
    assert p.added_taints == (Taint(OURS, "NoSchedule", "dbe"),)
    assert p.removed_taints == (XID79,)
    p = run(ROWS["nothing changed: an empty plan"])
    assert p.added_taints == p.removed_taints == () and not p.taints_changed


def test_the_dry_run_plan_is_the_enforce_plan() -> None:
    row = ROWS["dry-run plans exactly what enforce would, marked not to send"]
    assert replace(run(row), dry_run=False) == run(replace(row, config=ENFORCE))


def test_signature_ignores_unchanged_taints_and_tells_plans_apart() -> None:
    a = run(ROWS["new quarantine"])
    assert a.signature() == run(ROWS["new quarantine"]).signature()
    assert a.signature() != run(ROWS["release removes only our taint"]).signature()
    empty = run(ROWS["nothing changed: an empty plan"])
    assert empty.signature() == (None, (), None, ())


def test_recorded_names_only_the_taint_we_applied() -> None:
    assert recorded(QUARANTINED, ENFORCE).taints == (XID79,)
    assert recorded(bare(HUMAN), ENFORCE).taints == ()
    # <prefix>taint names which of two taints with our key is ours.
    both = with_taints(QUARANTINED, HUMAN, XID79)
    assert recorded(both, ENFORCE).taints == (XID79,)
    unreadable = annotated(bare(XID79), health="{not json")
    r = recorded(unreadable, ENFORCE)
    assert (r.snapshot_text, r.snapshot, r.taints) == ("{not json", None, (XID79,))


def test_the_condition_keeps_the_kubelet_s_conditions_out_of_it() -> None:
    ready = Condition(type="Ready", status="True", reason="KubeletReady", message="kubelet is posting")
    node = replace(bare(), conditions=(ready,))
    p = plan(node, Q, ENFORCE, now=T0, monotonic=MONO)
    assert p.condition is not None and p.condition.type == "GPUHealthy"


@pytest.mark.parametrize(
    ("code", "want"),
    [
        ("xid-79", "xid-79"),
        ("XID 79 / GPU 0000:3b:00.0", "XID-79-GPU-0000-3b-00.0"),
        ("-._leading and trailing_.-", "leading-and-trailing"),
        ("ü€!", "unhealthy"),
        ("a" * 80 + "-b", "a" * 63),
        ("a" * 62 + "-b", "a" * 62),
    ],
)
def test_label_value_is_a_valid_label_value(code: str, want: str) -> None:
    got = label_value(code)
    assert got == want
    assert len(got) <= 63 and re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?", got)


def test_the_docs_table_of_events_is_every_event_the_planner_writes(repo_root: Path) -> None:
    source = (repo_root / "aggregator" / "remediate" / "planner.py").read_text()
    written = set(re.findall(r'"(Gpuwarden[A-Za-z]+)"', source))
    docs = (repo_root / "docs" / "remediation.md").read_text()
    listed = set(re.findall(r"^\| `(Gpuwarden[A-Za-z]+)` \| (?:Warning|Normal) \|", docs, re.MULTILINE))
    assert written == listed
