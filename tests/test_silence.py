"""Silent nodes become suspect; a silent rack is one systemic event, not many node problems."""

from __future__ import annotations

from aggregator.config import SilenceConfig
from aggregator.fleet.pools import Placement
from aggregator.silence import SilenceDetector

CFG = SilenceConfig(silent_after_seconds=60, domain_min_nodes=3, pool_share=0.2)


def _fleet(n_racks: int = 4, per_rack: int = 8) -> dict[str, Placement]:
    return {
        f"n{r}-{i}": Placement(pool="h100", rack=f"r{r}", leaf=f"leaf{r // 2}", zone=None)
        for r in range(n_racks)
        for i in range(per_rack)
    }


def test_one_silent_node_is_suspect_evidence_without_systemic_event() -> None:
    placements = _fleet()
    last = dict.fromkeys(placements, 1000.0)
    last["n0-3"] = 900.0
    findings, events = SilenceDetector(CFG).check(last, placements, 1000.0)
    assert events == []
    [f] = findings["n0-3"]
    assert (f.detector, f.action) == ("silence", "alert")
    assert "no report for 100 s" in f.summary and "systemic" not in f.evidence
    assert set(findings) == {"n0-3"}  # nodes that report have no entry


def test_silent_rack_is_one_systemic_event_that_ends() -> None:
    placements = _fleet()
    det = SilenceDetector(CFG)
    last = dict.fromkeys(placements, 1000.0)
    for i in range(8):
        last[f"n2-{i}"] = 900.0
    findings, events = det.check(last, placements, 1000.0)
    [ev] = [e for e in events if e.domain_kind == "rack"]
    assert (ev.state, ev.domain, len(ev.silent_nodes), ev.total_nodes) == ("started", "r2", 8, 8)
    assert all(findings[f"n2-{i}"][0].evidence["systemic"] == "rack r2" for i in range(8))
    # Still silent: no second event for the same outage.
    _, again = det.check(last, placements, 1010.0)
    assert again == []
    for i in range(8):
        last[f"n2-{i}"] = 1015.0
    _, ended = det.check(last, placements, 1020.0)
    assert {(e.state, e.domain) for e in ended} >= {("ended", "r2")}


def test_two_silent_nodes_in_a_rack_are_not_systemic() -> None:
    placements = _fleet()
    last = dict.fromkeys(placements, 1000.0)
    last["n1-0"] = last["n1-1"] = 800.0
    _, events = SilenceDetector(CFG).check(last, placements, 1000.0)
    assert events == []


def test_dead_leaf_switch_is_one_event_for_the_leaf() -> None:
    placements = _fleet()
    last = dict.fromkeys(placements, 1000.0)
    for r in (2, 3):  # leaf1 holds racks 2 and 3
        for i in range(8):
            last[f"n{r}-{i}"] = 900.0
    _, events = SilenceDetector(CFG).check(last, placements, 1000.0)
    assert [(e.domain_kind, e.domain, len(e.silent_nodes)) for e in events] == [("leaf", "leaf1", 16)]


def test_silence_spread_over_the_pool_is_one_pool_event() -> None:
    placements = _fleet()
    last = dict.fromkeys(placements, 1000.0)
    for r in range(4):
        for i in range(3):  # 3 of 8 in every rack: no rack is mostly silent
            last[f"n{r}-{i}"] = 900.0
    _, events = SilenceDetector(CFG).check(last, placements, 1000.0)
    assert [(e.domain_kind, e.domain, len(e.silent_nodes)) for e in events] == [("pool", "h100", 12)]
