"""The aggregator's common currency: a Finding is one piece of evidence about one node (or link).

Its sources (the rule engine, the silence detector and the detectors of ``aggregator.detect``,
listed in ``aggregator.detect.SOURCES``) produce findings; the health state machine
(``aggregator.health``) turns the set of active findings per node into state changes and decision
records. Nothing else decides.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Severity = Literal["info", "warning", "critical"]
# What the evidence warrants on its own. "quarantine": take the node out (at once when ``hard``,
# else once it has persisted); "alert": tell on-call, leave the node in (the node becomes
# ``suspect``); "none": record only.
Action = Literal["quarantine", "alert", "none"]
# How a finding goes away: "condition" when the detector stops seeing it; "reboot" when the node
# reports a new boot_id (an XID 79 stays true until the GPU was reset, whatever later reports say).
Clears = Literal["condition", "reboot"]
NodeState = Literal["healthy", "suspect", "quarantined", "probation"]
LinkState = Literal["healthy", "suspect", "degraded"]
RemediationAction = Literal["taint", "untaint", "none", "held"]


@dataclass(frozen=True)
class Finding:
    detector: str  # its source, one of aggregator.detect.SOURCES ("rule", "peer", ...)
    key: str  # stable identity of the problem on its node, e.g. "xid-79:gpu3"; same key, same problem
    severity: Severity
    action: Action
    summary: str  # what a human reads first: "GPU 3 (GPU-ab12...) XID 79 at 12:01:03: fell off the bus"
    since: float  # report time when this evidence first held
    rule: str | None = None  # the rule's name, for detector "rule"
    hard: bool = False  # quarantine from the first report that shows it, no persistence needed
    # Soft quarantine evidence that a sequential test decided (its statistic crossed the threshold
    # whose false-alarm rate is stated for deciding at the crossing): the accumulated evidence is
    # the persistence, so the health machine quarantines at once instead of waiting
    # ``suspect_for_seconds`` on top. Set only by sources whose quarantine is such a crossing.
    decided: bool = False
    clears: Clears = "condition"
    evidence: Mapping[str, Any] = field(default_factory=dict)
    runbook_url: str | None = None
    peer: str | None = None  # the other end, for a link finding
    shadow: bool = False  # from a rule on trial: shown and counted, never changes the node's state
    taint_effect: Literal["NoSchedule", "NoExecute"] = "NoSchedule"


class IngestOutcome(enum.Enum):
    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"  # same node, boot_id and seq already ingested: idempotent
