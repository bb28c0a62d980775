"""Silent nodes become suspect; a silent rack is one systemic event, not many node problems."""

from __future__ import annotations

import random

from aggregator.config import SilenceConfig
from aggregator.fleet.pools import Placement
from aggregator.silence import _WIDTH, SilenceDetector, _holders, _within_wider

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
    findings, events = SilenceDetector(CFG, 10.0).check(last, placements, 1000.0)
    assert events == []
    [f] = findings["n0-3"]
    assert (f.detector, f.action) == ("silence", "alert")
    assert "no report for 100 s" in f.summary and "systemic" not in f.evidence
    assert set(findings) == {"n0-3"}  # nodes that report have no entry


def test_silent_rack_is_one_systemic_event_that_ends() -> None:
    placements = _fleet()
    det = SilenceDetector(CFG, 10.0)
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
    _, events = SilenceDetector(CFG, 10.0).check(last, placements, 1000.0)
    assert events == []


def test_dead_leaf_switch_is_one_event_for_the_leaf() -> None:
    placements = _fleet()
    last = dict.fromkeys(placements, 1000.0)
    for r in (2, 3):  # leaf1 holds racks 2 and 3
        for i in range(8):
            last[f"n{r}-{i}"] = 900.0
    _, events = SilenceDetector(CFG, 10.0).check(last, placements, 1000.0)
    assert [(e.domain_kind, e.domain, len(e.silent_nodes)) for e in events] == [("leaf", "leaf1", 16)]


def test_silence_spread_over_the_pool_is_one_pool_event() -> None:
    placements = _fleet()
    last = dict.fromkeys(placements, 1000.0)
    for r in range(4):
        for i in range(3):  # 3 of 8 in every rack: no rack is mostly silent
            last[f"n{r}-{i}"] = 900.0
    _, events = SilenceDetector(CFG, 10.0).check(last, placements, 1000.0)
    assert [(e.domain_kind, e.domain, len(e.silent_nodes)) for e in events] == [("pool", "h100", 12)]


def _brute_within_wider(
    key: tuple[str, str], down: frozenset[str], candidates: dict[tuple[str, str], frozenset[str]]
) -> bool:
    """The rule as first written: a look at every other candidate."""
    return any(other != key and down < wider for other, wider in candidates.items()) or any(
        _WIDTH[other[0]] > _WIDTH[key[0]] and down == wider for other, wider in candidates.items()
    )


def test_a_domain_within_a_wider_one_is_found_as_by_looking_at_every_pair() -> None:
    rng = random.Random(7)
    for _ in range(300):
        nodes = [f"n{i}" for i in range(rng.randint(4, 40))]
        # Racks, leaves and zones drawn independently: nested or not, as real labels may be.
        kinds = {
            k: [f"{k}{rng.randint(0, rng.randint(1, 6))}" for _ in nodes] for k in ("rack", "leaf", "zone")
        }
        members: dict[tuple[str, str], set[str]] = {}
        for kind, names in kinds.items():
            for node, name in zip(nodes, names, strict=True):
                members.setdefault((kind, name), set()).add(node)
        silent = {n for n in nodes if rng.random() < 0.6}
        candidates = {
            key: frozenset(m & silent)
            for key, m in members.items()
            if len(m & silent) >= 2 and rng.random() < 0.9
        }
        holders = _holders(candidates)
        for key, down in candidates.items():
            assert _within_wider(key, down, candidates, holders) == _brute_within_wider(key, down, candidates)


def test_a_mass_outage_is_one_event_per_dead_leaf() -> None:
    # 8,000 nodes, 4 to a rack and 32 to a leaf; every node of 60 leaves silent (1,920 nodes, 480
    # racks): one event per leaf, none for the racks inside them.
    placements = {
        f"n{i}": Placement(pool="h100", rack=f"r{i // 4}", leaf=f"leaf{i // 32}", zone=None)
        for i in range(8000)
    }
    last = dict.fromkeys(placements, 1000.0)
    for i in range(60 * 32):
        last[f"n{i}"] = 900.0
    findings, events = SilenceDetector(CFG, 10.0).check(last, placements, 1000.0)
    assert sorted((e.domain_kind, e.domain) for e in events) == sorted(
        ("leaf", f"leaf{k}") for k in range(60)
    )
    assert all(len(e.silent_nodes) == 32 for e in events)
    assert len(findings) == 1920 and findings["n0"][0].evidence["systemic"] == "leaf leaf0"
