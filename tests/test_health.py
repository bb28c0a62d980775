"""The health state machine: hysteresis, probation, lemons, and what never quarantines."""

from __future__ import annotations

import dataclasses
from typing import Any

from aggregator.config import HealthConfig
from aggregator.health import HealthMachine
from aggregator.model import Finding

CFG = HealthConfig(
    suspect_for_seconds=120,
    clear_for_seconds=60,
    probation_seconds=600,
    lemon_count=3,
    lemon_window_seconds=86400,
)


def finding(key: str, rule: str, severity: str, action: str, summary: str, **more: Any) -> Finding:
    """A rule's finding, first seen at time 0."""
    return Finding(
        detector="rule",
        key=key,
        rule=rule,
        severity=severity,
        action=action,
        summary=summary,
        since=0.0,
        **more,
    )


def hard(key: str = "xid-79:gpu3") -> Finding:
    return finding(
        key,
        "xid-79",
        "critical",
        "quarantine",
        "GPU 3 fell off the bus (XID 79)",
        hard=True,
        clears="reboot",
        evidence={"gpu": 3, "xid": 79},
    )


def soft(key: str = "pcie-width:gpu1") -> Finding:
    return finding(key, "pcie-width", "warning", "quarantine", "GPU 1 PCIe x8 of x16")


def alert(key: str = "remap-pending:gpu0") -> Finding:
    return finding(key, "remap-pending", "warning", "alert", "GPU 0 row remap pending")


def test_hard_fault_quarantines_at_once_with_its_reason() -> None:
    m = HealthMachine(CFG)
    assert m.update("n1", "rule", [], 0.0) is None
    d = m.update("n1", "rule", [hard()], 10.0)
    assert d is not None
    assert (d.state, d.previous, d.action, d.time) == ("quarantined", "healthy", "taint", 10.0)
    assert d.reasons[0].rule == "xid-79" and d.reasons[0].evidence["xid"] == 79


def test_soft_evidence_must_persist_and_flapping_never_quarantines() -> None:
    m = HealthMachine(CFG)
    d = m.update("n1", "rule", [soft()], 0.0)
    assert d is not None and d.state == "suspect" and d.action == "none"
    # Comes and goes every 60 s: never 120 s continuously.
    for t in range(10, 1000, 10):
        present = (t // 60) % 2 == 0
        d = m.update("n1", "rule", [soft()] if present else [], float(t))
        assert d is None or d.state != "quarantined"
    m2 = HealthMachine(CFG)
    m2.update("n1", "rule", [soft()], 0.0)
    assert m2.update("n1", "rule", [soft()], 110.0) is None
    d = m2.update("n1", "rule", [soft()], 120.0)
    assert d is not None and d.state == "quarantined"
    assert d.reasons[0].evidence["persisted_seconds"] == 120.0


def test_alert_findings_make_suspect_but_never_quarantine() -> None:
    m = HealthMachine(CFG)
    d = m.update("n1", "rule", [alert()], 0.0)
    assert d is not None and d.state == "suspect"
    for t in range(10, 5000, 10):
        assert m.update("n1", "rule", [alert()], float(t)) is None
    assert m.get("n1").state == "suspect"  # type: ignore[union-attr]


def test_suspect_clears_after_evidence_gone_long_enough() -> None:
    m = HealthMachine(CFG)
    m.update("n1", "rule", [alert()], 0.0)
    assert m.update("n1", "rule", [], 10.0) is None
    assert m.tick(60.0) == []
    [d] = m.tick(70.0)
    assert (d.state, d.previous) == ("healthy", "suspect")


def test_probation_then_release_and_relapse_during_probation() -> None:
    m = HealthMachine(CFG)
    m.update("n1", "rule", [hard()], 0.0)
    # The evidence must stay gone for clear_for_seconds (60) before probation starts.
    assert m.update("n1", "rule", [], 100.0) is None
    assert m.tick(150.0) == []
    [d] = m.tick(160.0)
    assert (d.state, d.action) == ("probation", "none")  # still tainted
    assert m.tick(700.0) == []
    [d] = m.tick(760.0)
    assert (d.state, d.previous, d.action) == ("healthy", "probation", "untaint")

    m.update("n2", "rule", [hard()], 0.0)
    m.update("n2", "rule", [], 100.0)
    m.tick(160.0)
    d = m.update("n2", "rule", [soft()], 200.0)  # any quarantine evidence in probation
    assert d is not None and (d.state, d.action) == ("quarantined", "none")  # still tainted


def test_evidence_missing_from_one_report_does_not_start_probation() -> None:
    m = HealthMachine(CFG)
    m.update("n1", "rule", [soft()], 0.0)
    d = m.update("n1", "rule", [soft()], 120.0)
    assert d is not None and d.state == "quarantined"
    for t in range(130, 2000, 10):  # a flapping finding: present every other report
        d = m.update("n1", "rule", [soft()] if t % 20 else [], float(t))
        assert d is None
    h = m.get("n1")
    assert h is not None and h.state == "quarantined" and not h.lemon


def test_probation_ending_through_suspect_releases_the_taint() -> None:
    m = HealthMachine(CFG)
    m.update("n1", "rule", [hard()], 0.0)
    m.update("n1", "rule", [], 10.0)
    [d] = m.tick(70.0)
    assert d.state == "probation"
    m.update("n1", "silence", [alert("silence")], 600.0)  # e.g. the agent restarts meanwhile
    [d] = m.tick(670.0)
    assert (d.state, d.action) == ("suspect", "untaint")
    m.update("n1", "silence", [], 680.0)
    [d] = m.tick(740.0)
    assert (d.state, d.action) == ("healthy", "none")  # released once, not twice


def test_lemon_stays_out() -> None:
    m = HealthMachine(CFG)
    t = 0.0
    for _ in range(3):  # quarantined, released, and back: three times
        m.update("n1", "rule", [hard()], t)
        m.update("n1", "rule", [], t + 10)
        m.tick(t + 100)  # probation
        m.tick(t + 800)  # healthy again
        t += 1000
    h = m.get("n1")
    assert h is not None and h.lemon and h.state == "quarantined"
    assert any(r.rule == "lemon" for r in h.reasons)
    assert m.update("n1", "rule", [], t + 10) is None
    assert m.tick(t + 10_000) == []
    assert m.release_lemon("n1", t + 10_001) is None  # evidence gone, the clear timer starts
    [d] = m.tick(t + 10_100)
    assert d.state == "probation"


def test_sources_are_independent() -> None:
    m = HealthMachine(CFG)
    m.update("n1", "rule", [alert()], 0.0)
    m.update("n1", "silence", [alert("silence")], 5.0)
    m.update("n1", "rule", [], 10.0)  # the rule evidence went away; silence still holds
    assert m.tick(1000.0) == []
    assert m.get("n1").state == "suspect"  # type: ignore[union-attr]


def decided(key: str = "peer-sm-clock:gpu3", **more: Any) -> Finding:
    """A sequential test's crossing (the peer CUSUM's): soft, but its evidence already accumulated."""
    return Finding(
        detector="peer",
        key=key,
        severity="critical",
        action="quarantine",
        summary="GPU 3 SM clock 0.70 of its node's median under load",
        since=0.0,
        decided=True,
        evidence={"gpu": 3, "cusum": 19.5, "threshold": 18.0},
        **more,
    )


def test_a_decided_sequential_finding_quarantines_at_once_and_says_why() -> None:
    m = HealthMachine(CFG)
    d = m.update("n1", "peer", [decided()], 30.0)
    assert d is not None
    assert (d.state, d.previous, d.action, d.time) == ("quarantined", "healthy", "taint", 30.0)
    # The decision record says no persistence was waited and why: a sequential test decided it.
    assert d.reasons[0].evidence["decided"] is True
    assert d.reasons[0].evidence["persisted_seconds"] == 0.0
    # An undecided one from another source on the same node still wants its 120 s.
    m2 = HealthMachine(CFG)
    d = m2.update("n1", "rule", [soft()], 30.0)
    assert d is not None and d.state == "suspect" and "decided" not in d.reasons[0].evidence


def test_an_alert_that_turns_into_a_decision_quarantines_at_the_crossing() -> None:
    # The peer detector reports the alert first under the same key; the crossing decides it.
    m = HealthMachine(CFG)
    warn = Finding(
        detector="peer", key="peer-sm-clock:gpu3", severity="warning", action="alert", summary="s", since=0.0
    )
    assert m.update("n1", "peer", [warn], 0.0) is not None
    assert m.update("n1", "peer", [warn], 30.0) is None
    d = m.update("n1", "peer", [decided()], 60.0)
    assert d is not None and d.state == "quarantined"


def test_escalation_by_persistence_is_not_a_decision_and_still_persists() -> None:
    # A peer alert escalated after 5 minutes is quarantine evidence by time, not by a test's
    # crossing: the detector leaves it undecided and the health machine wants it to persist.
    escalated = dataclasses.replace(decided(), decided=False, evidence={"escalated": True})
    m = HealthMachine(CFG)
    d = m.update("n1", "peer", [escalated], 0.0)
    assert d is not None and d.state == "suspect"
    assert m.update("n1", "peer", [escalated], 110.0) is None
    d = m.update("n1", "peer", [escalated], 120.0)
    assert d is not None and d.state == "quarantined" and "decided" not in d.reasons[0].evidence


def test_a_decided_finding_that_flaps_is_one_episode_then_probation_as_before() -> None:
    m = HealthMachine(CFG)
    assert m.update("n1", "peer", [decided()], 0.0).state == "quarantined"  # type: ignore[union-attr]
    # Missing from one run is the same episode; gone for clear_for_seconds starts probation.
    assert m.update("n1", "peer", [], 30.0) is None
    assert m.update("n1", "peer", [decided()], 60.0) is None
    assert m.update("n1", "peer", [], 90.0) is None
    d = m.update("n1", "peer", [], 150.0)
    assert d is not None and d.state == "probation"
    # Decided again during probation: back at once, one quarantine counted (a relapse).
    d = m.update("n1", "peer", [decided()], 200.0)
    assert d is not None and d.state == "quarantined"
    assert len(m.get("n1").quarantines) == 1  # type: ignore[union-attr]


def test_the_decided_flag_is_not_carried_across_a_restart() -> None:
    # The snapshot keeps the evidence, not the flag: a restored finding holds the decided state
    # and, were its node not out, would have to persist like any soft finding (never faster).
    m = HealthMachine(CFG)
    m.update("n1", "peer", [decided()], 0.0)
    snap = m.snapshot("n1", "boot-1")
    assert snap is not None and snap.state == "quarantined"
    fresh = HealthMachine(CFG)
    assert fresh.restore("n1", snap, 10.0, grace_seconds=300.0)
    restored = fresh.get("n1")
    assert restored is not None and restored.state == "quarantined" and restored.tainted
    assert [t.finding.decided for t in restored.active()] == [False]
    assert fresh.tick(100.0) == []  # the restored evidence holds the state through the grace
