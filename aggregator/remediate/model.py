"""What the pipeline wants a node to look like (``NodeIntent``), and the snapshot of its health
that we keep on the Node itself (``HealthSnapshot``) so that a restarted or newly elected
aggregator rebuilds its state from the cluster: no quarantined node forgotten, none tainted twice,
probation clocks resumed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Final, Literal, Protocol

import msgspec

from aggregator.kube.objects import TaintEffect

SNAPSHOT_VERSION: Final = 1
MAX_SNAPSHOT_FINDINGS: Final = 12  # the annotation stays far below Kubernetes' 256 KiB limit


class SnapshotFinding(msgspec.Struct, kw_only=True, frozen=True):
    detector: str
    key: str
    severity: str
    action: str
    summary: str
    since: float
    rule: str | None = None
    hard: bool = False
    clears: Literal["condition", "reboot"] = "condition"
    evidence: dict[str, object] = msgspec.field(default_factory=dict)


class HealthSnapshot(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """One node's health as the aggregator last decided it; the value of annotation
    ``<prefix>health`` (compact JSON)."""

    v: int = SNAPSHOT_VERSION
    state: Literal["healthy", "suspect", "quarantined", "probation"]
    since: float  # when the state began (aggregator time)
    tainted: bool = False  # the decision took the node out (not held)
    held: bool = False  # the decision stands but a safety limit stopped the taint
    lemon: bool = False
    quarantines: list[float] = msgspec.field(default_factory=list)  # times, for the lemon count
    boot_id: str | None = None  # the boot the findings were seen in (reboot-cleared ones end with it)
    reason_code: str | None = None
    message: str | None = None  # the decision's reasons in one line (condition, annotation)
    pool: str | None = None  # placement, for the safety limits before the node reports again
    rack: str | None = None
    leaf: str | None = None
    findings: list[SnapshotFinding] = msgspec.field(default_factory=list)


_ENC = msgspec.json.Encoder()
_DEC = msgspec.json.Decoder(HealthSnapshot)


def encode_snapshot(snapshot: HealthSnapshot) -> str:
    return _ENC.encode(snapshot).decode()


def decode_snapshot(text: str) -> HealthSnapshot | None:
    """None for an annotation we cannot read (another version, hand-edited): the node is then
    rebuilt from its taint alone."""
    try:
        snap = _DEC.decode(text)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return snap if snap.v == SNAPSHOT_VERSION else None


class NodeIntent(msgspec.Struct, kw_only=True, frozen=True):
    """What remediation should make of one node, derived from its health (``Pipeline.intent``).

    ``effect`` None means: no taint of ours (healthy, held, or suspect without ``suspect_effect``).
    ``evidence_key`` names the evidence behind a taint (the sorted keys of the quarantine
    findings): a human who removes our taint overrides that evidence, not later different evidence.
    """

    node: str
    state: Literal["healthy", "suspect", "quarantined", "probation"]
    since: float
    effect: TaintEffect | None
    reason_code: str  # the taint's value and the condition's reason, e.g. "xid-79"
    message: str  # one line for the condition, the event and kubectl describe
    evidence_key: str
    held: bool
    snapshot: HealthSnapshot
    preflight: Literal["pending", "passed", "failed"] = "pending"
    # What the node's condition and events tell a reader (aggregator/story.py): its runbook ("" for
    # none) and the health timings that say when it can come back.
    runbook_url: str = ""
    probation_seconds: float = 1800.0
    clear_for_seconds: float = 120.0


# ``IntentSource.restore`` as a value: (node, snapshot, our taint's value, now).
Restore = Callable[[str, HealthSnapshot | None, str | None, float], None]


class IntentSource(Protocol):
    """The pipeline, as the actuator sees it (implemented by ``aggregator.pipeline.Pipeline``)."""

    def intent(self, node: str) -> NodeIntent | None:
        """None: the pipeline knows nothing of this node (never reported since we started, and
        nothing restored): the actuator leaves it exactly as it is."""
        ...

    def intent_nodes(self) -> Iterable[str]:
        """Every node ``intent`` has an answer for."""
        ...

    def restore(
        self, node: str, snapshot: HealthSnapshot | None, taint_value: str | None, now: float
    ) -> None:
        """Rebuild a node's health from what we left on it (its snapshot annotation, and our
        taint's value when there is one). Called for every node carrying either, when the
        actuator first lists the cluster; a node the pipeline already knows is not changed."""
        ...
