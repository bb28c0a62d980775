"""What the demos print: "would taint" without a cluster, and a silent rack as one systemic event."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpuwarden.narrate import SILENCE_HOLD_S, Narrator, action_words

T0 = 1_764_441_600.0
RACK = [f"gpu-{i:04d}" for i in range(8, 12)]


def silent(node: str, at: float, *, systemic: bool) -> dict[str, Any]:
    summary = "no report for 61 s" + ("; part of a systemic outage of rack rack-002" if systemic else "")
    return {
        "time": at,
        "subject": "node",
        "node": node,
        "previous": "healthy",
        "state": "suspect",
        "action": "none",
        "reasons": [{"detector": "silence", "severity": "warning", "summary": summary, "evidence": {}}],
    }


def back(node: str, at: float) -> dict[str, Any]:
    return {"time": at, "subject": "node", "node": node, "previous": "suspect", "state": "healthy",
            "action": "none", "reasons": []}  # fmt: skip


EVENT = {
    "time": T0 + 3,
    "state": "started",
    "domain_kind": "rack",
    "domain": "rack-002",
    "silent_nodes": RACK,
    "total_nodes": 4,
    "summary": "rack rack-002: 4 of 4 nodes stopped reporting together",
}


def narrator() -> Narrator:
    def describe(d: Mapping[str, Any]) -> str:
        return f"{d['node']} {d['previous']} -> {d['state']} ({action_words(d['action'], cluster=False)})"

    return Narrator(stamp=lambda t: f"t+{t - T0:.0f}", describe=describe)


def test_without_a_cluster_the_action_is_what_would_happen() -> None:
    assert action_words("taint", cluster=False) == "would taint"
    assert action_words("untaint", cluster=False) == "would untaint"
    assert action_words("taint", cluster=True) == "tainted"
    assert action_words("none", cluster=False) == "no action"


def test_a_silent_rack_prints_once_naming_its_rack_and_nodes() -> None:
    n = narrator()
    lines = n.decisions(
        [silent(RACK[0], T0, systemic=False), silent(RACK[1], T0 + 1, systemic=False)], T0 + 1
    )
    assert lines == []  # held: the event that explains them may be about to start
    lines = n.systemic([EVENT], T0 + 3)
    lines += n.decisions([silent(x, T0 + 3, systemic=True) for x in RACK[2:]], T0 + 3)
    assert lines == [
        "[t+3] systemic event: rack rack-002: 4 of 4 nodes stopped reporting together "
        f"(nodes {', '.join(RACK)}; each suspect, none quarantined)"
    ]
    assert n.flush(T0 + 3 + 2 * SILENCE_HOLD_S) == []  # the held ones were part of it
    assert n.systemic([EVENT], T0 + 60) == []  # still going on: not printed again
    over = n.systemic([], T0 + 120)
    assert over == ["[t+120] systemic event over: rack rack-002 (4 nodes)"]
    assert n.decisions([back(x, T0 + 121) for x in RACK], T0 + 121) == []  # coming back: part of it


def test_a_lone_silent_node_still_prints_after_the_hold() -> None:
    n = narrator()
    assert n.decisions([silent("gpu-0001", T0, systemic=False)], T0) == []
    assert n.flush(T0 + SILENCE_HOLD_S) == ["gpu-0001 healthy -> suspect (no action)"]


def test_other_decisions_print_at_once() -> None:
    d = {"time": T0, "subject": "node", "node": "gpu-0003", "previous": "healthy", "state": "quarantined",
         "action": "taint", "reasons": [{"detector": "rule", "summary": "XID 79"}]}  # fmt: skip
    assert narrator().decisions([d], T0) == ["gpu-0003 healthy -> quarantined (would taint)"]
