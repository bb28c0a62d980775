"""LinkLocalizer: slow pair probes put on a node, a link, or the switch they share."""

from __future__ import annotations

import itertools
import math
import os
import random
from collections.abc import Callable

import pytest

from agent.report import SCHEMA_ID, Probe, Report
from aggregator.config import FleetConfig
from aggregator.detect import Verdict
from aggregator.detect.links import LinkConfig, LinkLocalizer
from aggregator.fleet.frame import FleetFrames
from aggregator.fleet.pools import Placement

T0 = 1_764_000_000.0
FRAMES = FleetFrames(FleetConfig())  # the localizer reads probes, not the pool frames
BW = 380e9
NODES = [f"gpu-{i:04d}" for i in range(16)]
# 16 nodes, racks of 4, leaves of 8 (two racks each): the small scenario's topology.
PLACE = {n: Placement("h100", rack=f"rack-{i // 4}", leaf=f"leaf-{i // 8}") for i, n in enumerate(NODES)}

Factor = Callable[[str, str, float], float]


def healthy(_a: str, _b: str, _t: float) -> float:
    return 1.0


def report(node: str, t: float, probes: list[Probe], *, skew: float = 0.0) -> Report:
    return Report(
        schema=SCHEMA_ID, node=node, time=t + skew, seq=int(t), boot_id="b", gpus=[], nics=[], probes=probes
    )


def feed(
    loc: LinkLocalizer,
    factor: Factor,
    *,
    rounds: int = 4,
    start: float = T0,
    every: float = 600.0,
    seed: int = 0,
    nodes: list[str] = NODES,
    noise: float = 0.015,
) -> float:
    """Every pair within a leaf probed once a round, reported by both ends; returns the last time."""
    rng = random.Random(seed)
    t = start
    for k in range(rounds):
        t = start + k * every
        for a, b in itertools.combinations(nodes, 2):
            if PLACE[a].leaf != PLACE[b].leaf:
                continue
            bw = BW * factor(a, b, t) * rng.gauss(1.0, noise)
            pt = t + rng.uniform(0, 60)
            for me, peer in ((a, b), (b, a)):
                p = Probe(kind="nccl_allreduce_pair", time=pt, ok=True, peer=peer, busbw_bytes_per_second=bw)
                loc.observe(report(me, pt + 5, [p]), PLACE[me], measured=pt + 5 + rng.uniform(0, 2))
    return t + 120


def quarantined(v: Verdict) -> set[str]:
    return {n for n, fs in v.nodes.items() if any(f.action == "quarantine" for f in fs)}


@pytest.mark.parametrize("seed", range(5))
def test_healthy_fleet_with_noise_blames_nothing(seed: int) -> None:
    loc = LinkLocalizer()
    now = feed(loc, healthy, seed=seed, noise=0.03)
    v = loc.run(FRAMES, now)
    assert set(v.nodes) == set(NODES)
    assert all(fs == [] for fs in v.nodes.values())
    assert v.links == {} and v.switches == []


def test_slow_node_is_the_node_not_its_links() -> None:
    bad = "gpu-0005"
    loc = LinkLocalizer()
    now = feed(loc, lambda a, b, _t: 0.7 if bad in (a, b) else 1.0)
    v = loc.run(FRAMES, now)
    assert quarantined(v) == {bad}
    (f,) = v.nodes[bad]
    assert f.detector == "link" and not f.hard
    assert f.evidence["effect_ratio"] == pytest.approx(0.7, abs=0.03)
    assert f.evidence["partners"] == 7
    assert len(f.evidence["pairs"]) == 7
    assert v.links == {}
    assert v.switches == []


def test_degraded_pair_between_good_nodes_is_a_link() -> None:
    loc = LinkLocalizer()
    slow = {"gpu-0002", "gpu-0006"}
    now = feed(loc, lambda a, b, _t: 0.65 if {a, b} == slow else 1.0)
    v = loc.run(FRAMES, now)
    assert quarantined(v) == set()
    assert all(fs == [] for fs in v.nodes.values())
    assert list(v.links) == [("gpu-0002", "gpu-0006")]
    f = v.links[("gpu-0002", "gpu-0006")]
    assert f.peer == "gpu-0006" and f.action == "none"
    assert f.evidence["residual_ratio"] == pytest.approx(0.65, abs=0.03)


def test_slow_pairs_through_one_leaf_are_one_switch_alert() -> None:
    # Cross-rack pairs of leaf-1 (racks 2 and 3): no rack holds any of them alone.
    slow = [{"gpu-0008", "gpu-0012"}, {"gpu-0009", "gpu-0013"}, {"gpu-0010", "gpu-0014"}]
    loc = LinkLocalizer()
    now = feed(loc, lambda a, b, _t: 0.6 if {a, b} in slow else 1.0)
    v = loc.run(FRAMES, now)
    assert quarantined(v) == set()
    assert v.links == {}
    (alert,) = v.switches
    assert (alert.domain_kind, alert.domain) == ("leaf", "leaf-1")
    assert set(alert.nodes) == set().union(*slow)
    for n in alert.nodes:
        (f,) = v.nodes[n]
        assert f.action == "alert" and f.key == "link-switch:leaf:leaf-1"
    assert all(v.nodes[n] == [] for n in NODES if n not in alert.nodes)


def test_one_partner_never_decides_two_do() -> None:
    # A node slow with its one partner: a slow node and a slow link look the same. With a second
    # slow partner, each normal with the third node, "the node" is one fault and "two slow links
    # at once, both at this node" two: the node.
    few = ["gpu-0000", "gpu-0001", "gpu-0002"]
    slow: Factor = lambda a, b, _t: 0.6 if "gpu-0000" in (a, b) else 1.0  # noqa: E731
    loc = LinkLocalizer()
    now = feed(loc, slow, nodes=few[:2])
    v = loc.run(FRAMES, now)
    assert set(v.nodes) == set(few[:2]) and all(fs == [] for fs in v.nodes.values())
    assert v.links == {}
    loc = LinkLocalizer()
    now = feed(loc, slow, nodes=few)
    v = loc.run(FRAMES, now)
    assert quarantined(v) == {"gpu-0000"}
    assert v.nodes["gpu-0000"][0].evidence["decided_on_partners"] == 2
    assert v.links == {}


def test_a_single_slow_probe_never_decides() -> None:
    slow = {"gpu-0002", "gpu-0006"}
    loc = LinkLocalizer()
    now = feed(loc, lambda a, b, _t: 0.6 if {a, b} == slow else 1.0, rounds=1)
    assert loc.run(FRAMES, now).links == {}
    # The second slow result of the same pair is what makes it a link.
    now = feed(loc, lambda a, b, _t: 0.6 if {a, b} == slow else 1.0, rounds=1, start=now + 480, seed=1)
    assert list(loc.run(FRAMES, now).links) == [("gpu-0002", "gpu-0006")]


def test_old_slow_period_heals_under_recent_good_probes() -> None:
    bad = "gpu-0005"
    slow_until = T0 + 3 * 600
    loc = LinkLocalizer(LinkConfig(half_life_seconds=1800.0))
    factor: Factor = lambda a, b, t: 0.7 if bad in (a, b) and t < slow_until else 1.0  # noqa: E731
    mid = feed(loc, factor, rounds=3)
    assert quarantined(loc.run(FRAMES, mid)) == {bad}
    end = feed(loc, factor, rounds=9, start=slow_until)
    v = loc.run(FRAMES, end)
    assert quarantined(v) == set()
    assert v.nodes[bad] == []


def test_both_ends_copies_count_once_even_with_a_skewed_clock() -> None:
    loc = LinkLocalizer()
    p = Probe(kind="nccl_allreduce_pair", time=T0, ok=True, peer="gpu-0001", busbw_bytes_per_second=BW)
    q = Probe(kind="nccl_allreduce_pair", time=T0 + 45, ok=True, peer="gpu-0000", busbw_bytes_per_second=BW)
    assert loc.observe(report("gpu-0000", T0 + 5, [p]), PLACE["gpu-0000"], measured=T0 + 5) == 1
    # gpu-0001's clock runs 45 s ahead: its report time and probe time both carry the skew.
    assert loc.observe(report("gpu-0001", T0 + 6, [q], skew=45), PLACE["gpu-0001"], measured=T0 + 6) == 0
    # A redelivered report is the same probe again.
    assert loc.observe(report("gpu-0000", T0 + 5, [p]), PLACE["gpu-0000"], measured=T0 + 7) == 0
    # A failed probe or one without a peer has no bandwidth to localize.
    bad = [
        Probe(kind="nccl_allreduce_pair", time=T0 + 600, ok=False, peer="gpu-0001", error="NCCL WARN"),
        Probe(kind="nccl_allreduce_local", time=T0 + 600, ok=True, busbw_bytes_per_second=BW),
    ]
    assert loc.observe(report("gpu-0000", T0 + 605, bad), PLACE["gpu-0000"], measured=T0 + 605) == 0


def test_a_node_no_longer_probed_is_cleared() -> None:
    bad = "gpu-0005"
    loc = LinkLocalizer(LinkConfig(max_age_seconds=3600.0))
    now = feed(loc, lambda a, b, _t: 0.7 if bad in (a, b) else 1.0)
    assert quarantined(loc.run(FRAMES, now)) == {bad}
    v = loc.run(FRAMES, now + 7200)  # every probe aged out
    assert v.nodes[bad] == []
    assert loc.run(FRAMES, now + 7300).nodes == {}


# Two cases the real-network test (test_netns_links.py) found: sparse probes, as a scheduler
# with confirm re-probes produces them in a small group.
SIX = [f"node{i}" for i in range(6)]
SIX_PLACE = Placement("p", rack="r0", leaf="l0")


def _sparse(samples: list[tuple[int, int, float, float]]) -> LinkLocalizer:
    """(a, b, time, MB/s) probes of tcp_pair, reported by both ends."""
    # Time runs 30x fast here: ages, half-life, dedupe and the judging window are scaled alike.
    loc = LinkLocalizer(
        LinkConfig(half_life_seconds=60, max_age_seconds=40, dedupe_seconds=1, judge_after_seconds=10)
    )
    for a, b, t, mbps in samples:
        for me, peer in ((SIX[a], SIX[b]), (SIX[b], SIX[a])):
            p = Probe(kind="tcp_pair", time=T0 + t, ok=True, peer=peer, busbw_bytes_per_second=mbps * 1e6)
            loc.observe(report(me, T0 + t, [p]), SIX_PLACE, measured=T0 + t + 0.1)
    return loc


def test_a_confirm_reprobe_of_the_slow_pair_does_not_move_the_blame() -> None:
    # node2 is slow with everyone; (0, 2) was measured twice (rotation, then confirm). Weighted by
    # probe count, that pair outvoted node0's other partners and the blame fell on node0.
    data = [
        (0, 3, 100, 120),
        (1, 5, 101, 119),
        (2, 4, 102, 12),
        (1, 3, 103, 120),
        (4, 5, 104, 120),
        (0, 2, 105, 12),
        (0, 4, 106, 120),
        (1, 2, 107, 12),
        (3, 4, 108, 119),
        (0, 2, 109, 12),
    ]
    verdict = _sparse(data).run(FRAMES, T0 + 110)
    blamed = {n for n, fs in verdict.nodes.items() if any(f.key == "link-node" for f in fs)}
    assert blamed <= {"node2"}


def test_a_fixed_nodes_stale_slow_pairs_are_not_degraded_links() -> None:
    # node2 was slow with everyone until t=150, then repaired: fast again with four fresh partners,
    # while (2, 3) was last measured (slow) before the repair. That pair is node2's past, not a link.
    old = [(2, p, 130 + i, 12) for i, p in enumerate((0, 1, 4, 5))] + [(2, 3, 145, 12), (2, 3, 149, 12)]
    new = [
        (0, 2, 175, 120),
        (1, 2, 176, 120),
        (2, 4, 177, 120),
        (2, 5, 178, 120),
        (0, 1, 170, 120),
        (3, 4, 171, 120),
        (3, 5, 172, 120),
        (0, 3, 173, 120),
        (1, 3, 174, 120),
    ]
    verdict = _sparse(old + new).run(FRAMES, T0 + 180)
    assert ("node2", "node3") not in verdict.links


def test_a_fixed_nodes_last_slow_pair_is_no_link_once_its_other_slow_results_aged_out() -> None:
    # node2 was slow with everyone and found so; its last slow pair was (0, 2), rotation and
    # re-probe, and then it was repaired. Its older slow results with others go out of the window
    # first (max_age_seconds=40 here): for a few seconds (0, 2) is its only slow pair left, with
    # the repaired node normal with the partners that followed. The pair is still node2's past.
    before = [(2, 4, 100, 12), (2, 5, 104, 12), (1, 2, 108, 12), (0, 2, 112, 12), (0, 2, 115, 12)]
    after = [(2, 3, 117, 120), (1, 2, 118, 120), (2, 4, 122, 120), (2, 5, 126, 120), (2, 3, 130, 120)]
    others = [(0, 1, 101, 120), (0, 3, 105, 120), (0, 4, 109, 120), (1, 3, 113, 120), (3, 4, 119, 120)]
    others += [(0, 1, 121, 120), (0, 3, 125, 120), (4, 5, 129, 120), (0, 4, 133, 120), (1, 5, 137, 120)]
    loc = _sparse([s for s in before + after + others if s[2] <= 116])
    assert quarantined(loc.run(FRAMES, T0 + 116)) == {"node2"}
    for a, b, t, mbps in [s for s in after + others if s[2] > 116]:
        for me, peer in ((SIX[a], SIX[b]), (SIX[b], SIX[a])):
            p = Probe(kind="tcp_pair", time=T0 + t, ok=True, peer=peer, busbw_bytes_per_second=mbps * 1e6)
            loc.observe(report(me, T0 + t, [p]), SIX_PLACE, measured=T0 + t + 0.1)
    verdict = loc.run(FRAMES, T0 + 149)  # (1, 2) at 108 has aged out; (0, 2) at 112 and 115 not
    assert not quarantined(verdict)
    assert not verdict.links


def test_an_end_busy_until_just_before_is_judged_on_the_partners_that_follow() -> None:
    # node1 ran a job until t=150, so it has no past with anyone. Its first probe (with node0)
    # is slow, and so is the re-probe; the confirm step's fresh partners that follow within
    # minutes are all normal, as node0's partners were before. That is a degraded link.
    base = [(0, 2, 0), (0, 3, 40), (0, 4, 80), (2, 3, 10), (2, 4, 50), (3, 5, 90), (4, 5, 120)]
    slow = [(0, 1, 160), (0, 1, 205)]
    after = [(1, 2, 240), (1, 3, 275), (1, 4, 310)]

    def fed(loc: LinkLocalizer) -> LinkLocalizer:
        for a, b, t in base + slow + after:
            mbps = 78.0 if (a, b) == (0, 1) else 120.0
            for me, peer in ((SIX[a], SIX[b]), (SIX[b], SIX[a])):
                p = Probe(kind="tcp_pair", time=T0 + t, ok=True, peer=peer, busbw_bytes_per_second=mbps * 1e6)
                loc.observe(report(me, T0 + t, [p]), SIX_PLACE, measured=T0 + t + 1.0)
        return loc

    verdict = fed(LinkLocalizer()).run(FRAMES, T0 + 330)
    assert set(verdict.links) == {(SIX[0], SIX[1])}
    assert not quarantined(verdict)
    # Judged only on what it had by the pair's last slow result, node1 had no other partner and
    # nothing could be said.
    assert not fed(LinkLocalizer(LinkConfig(judge_after_seconds=0.0))).run(FRAMES, T0 + 330).links


def test_a_node_that_recovers_soon_after_its_first_slow_pair_does_not_make_it_a_link() -> None:
    # node1 starts slow with everyone, and its first probe ever is (1, 4), slow twice. The fresh
    # partners that follow are slow too; then it recovers, and its later results are all normal.
    # Judged on everything in the five minutes after, the recovery would outvote its slow past
    # and call (1, 4) a link; judged on the earliest partners that follow, it was slow then.
    base = [(0, 2, 0), (0, 3, 40), (0, 4, 80), (2, 3, 10), (2, 4, 50), (3, 5, 90), (4, 5, 120)]
    bad = [(1, 4, 100), (1, 4, 145), (1, 2, 170), (1, 3, 200)]
    healed = [(1, 5, 230), (0, 1, 260), (1, 2, 290), (1, 3, 320), (1, 2, 380), (1, 3, 410)]
    loc = LinkLocalizer()
    for a, b, t in base + bad + healed:
        mbps = 78.0 if (a, b, t) in bad else 120.0
        for me, peer in ((SIX[a], SIX[b]), (SIX[b], SIX[a])):
            p = Probe(kind="tcp_pair", time=T0 + t, ok=True, peer=peer, busbw_bytes_per_second=mbps * 1e6)
            loc.observe(report(me, T0 + t, [p]), SIX_PLACE, measured=T0 + t + 1.0)
    verdict = loc.run(FRAMES, T0 + 450)
    assert (SIX[1], SIX[4]) not in verdict.links


def sparse(loc: LinkLocalizer, factor: Factor, pairs: list[tuple[float, str, str]], seed: int = 0) -> float:
    """Only the given (seconds after T0, a, b) probes, as a prober that tests one or two partners
    per idle window leaves them; returns a moment after the last."""
    rng = random.Random(seed)
    # The rest of the pool, measured in full twice before (leaf-1's last six nodes): what the
    # localizer learns the pool's noise from. A sparse prober over a real pool leaves as many.
    rest = NODES[10:]
    background = [(-3600.0 + 60 * k, a, b) for k in range(2) for a, b in itertools.combinations(rest, 2)]
    for dt, a, b in background + pairs:
        pt = T0 + dt
        bw = BW * factor(a, b, pt) * rng.gauss(1.0, 0.015)
        for me, peer in ((a, b), (b, a)):
            p = Probe(kind="nccl_allreduce_pair", time=pt, ok=True, peer=peer, busbw_bytes_per_second=bw)
            loc.observe(report(me, pt + 5, [p]), PLACE[me], measured=pt + 5 + rng.uniform(0, 2))
    return T0 + max(dt for dt, _, _ in pairs) + 60


# Ends gpu-0004 and gpu-0005 meet twice; each has one other partner in between; the rest of the
# leaf is probed around them so that the pool's expected bandwidth is known.
SPARSE = [
    (0.0, "gpu-0000", "gpu-0001"),
    (0.0, "gpu-0002", "gpu-0003"),
    (0.0, "gpu-0006", "gpu-0007"),
    (280.0, "gpu-0004", "gpu-0002"),
    (280.0, "gpu-0005", "gpu-0006"),
    (285.0, "gpu-0004", "gpu-0005"),
    (300.0, "gpu-0000", "gpu-0003"),
    (300.0, "gpu-0001", "gpu-0007"),
    (690.0, "gpu-0004", "gpu-0005"),
]


def test_sparse_prober_a_slow_pair_with_ends_normal_elsewhere_is_a_link() -> None:
    # A prober that is not ours: two slow results for the pair, one normal partner per end.
    loc = LinkLocalizer()
    now = sparse(loc, lambda a, b, _t: 0.65 if {a, b} == {"gpu-0004", "gpu-0005"} else 1.0, SPARSE)
    v = loc.run(FRAMES, now)
    assert set(v.links) == {("gpu-0004", "gpu-0005")}
    assert quarantined(v) == set()
    # Slow since the first of its two slow results (on the aggregator's clock: within the 2 s of
    # delivery jitter), not since the localizer heard of the second.
    assert v.links[("gpu-0004", "gpu-0005")].since == pytest.approx(T0 + 285.0, abs=2.5)


def test_sparse_prober_an_end_slow_with_its_other_partner_too_is_no_link() -> None:
    # gpu-0004 is slow with everyone (a slow NIC): its pair with gpu-0005 is its own slowness.
    loc = LinkLocalizer()
    now = sparse(loc, lambda a, b, _t: 0.65 if "gpu-0004" in (a, b) else 1.0, SPARSE)
    v = loc.run(FRAMES, now)
    assert v.links == {}
    # Slow with both its partners, each normal with someone else: the node.
    assert quarantined(v) == {"gpu-0004"}


def test_a_node_gone_slow_is_not_vouched_for_by_its_results_from_before() -> None:
    # gpu-0004's NIC goes slow at 500 s. Before, it was normal with four partners; after, a sparse
    # prober measures it with gpu-0005 twice and with gpu-0006 once, all slow. Its old normal
    # results outnumber the new slow ones, but they are from before: they must not make its slow
    # pair with gpu-0005 look like a link.
    before = [
        (dt, "gpu-0004", p)
        for dt, p in ((0.0, "gpu-0001"), (40.0, "gpu-0002"), (80.0, "gpu-0003"), (120.0, "gpu-0008"))
    ]
    around = [
        (0.0, "gpu-0005", "gpu-0006"),
        (60.0, "gpu-0005", "gpu-0007"),
        (120.0, "gpu-0005", "gpu-0000"),
        (130.0, "gpu-0000", "gpu-0001"),
        (140.0, "gpu-0002", "gpu-0003"),
        (150.0, "gpu-0006", "gpu-0007"),
        (160.0, "gpu-0008", "gpu-0009"),
        (900.0, "gpu-0004", "gpu-0005"),
        (905.0, "gpu-0004", "gpu-0006"),
        (910.0, "gpu-0005", "gpu-0007"),
        (1500.0, "gpu-0004", "gpu-0005"),
        (1510.0, "gpu-0005", "gpu-0000"),
    ]
    loc = LinkLocalizer()
    now = sparse(
        loc,
        lambda a, b, t: 0.65 if "gpu-0004" in (a, b) and t >= T0 + 500 else 1.0,
        sorted(before + around),
    )
    assert loc.run(FRAMES, now).links == {}


def test_a_slow_node_among_the_partners_does_not_hide_a_link() -> None:
    # gpu-0002 is slow with everyone (found as the bad node); it is among the two partners each
    # end of the slow pair gpu-0004/gpu-0005 met last. Its slowness is its own, not theirs: the
    # pair is still a link.
    pairs = [
        (0.0, "gpu-0000", "gpu-0001"),
        (0.0, "gpu-0006", "gpu-0007"),
        (10.0, "gpu-0002", "gpu-0000"),
        (10.0, "gpu-0003", "gpu-0001"),
        (20.0, "gpu-0002", "gpu-0001"),
        (30.0, "gpu-0002", "gpu-0006"),
        (40.0, "gpu-0002", "gpu-0007"),
        (100.0, "gpu-0004", "gpu-0003"),
        (100.0, "gpu-0005", "gpu-0006"),
        (200.0, "gpu-0004", "gpu-0002"),
        (210.0, "gpu-0005", "gpu-0002"),
        (300.0, "gpu-0004", "gpu-0005"),
        (345.0, "gpu-0004", "gpu-0005"),
        (400.0, "gpu-0004", "gpu-0000"),
        (400.0, "gpu-0005", "gpu-0001"),
    ]

    def factor(a: str, b: str, _t: float) -> float:
        if "gpu-0002" in (a, b):
            return 0.5
        return 0.65 if {a, b} == {"gpu-0004", "gpu-0005"} else 1.0

    loc = LinkLocalizer()
    v = loc.run(FRAMES, sparse(loc, factor, pairs))
    assert quarantined(v) == {"gpu-0002"}
    assert set(v.links) == {("gpu-0004", "gpu-0005")}


def test_a_partner_a_little_slow_with_everyone_does_not_make_an_end_look_slow() -> None:
    # gpu-0002 runs 16 % slow with every partner (one of its eight ports down, and a little
    # more): under the design effect, so not a bad node, but its results sit under the slow line.
    # It is one of the two partners gpu-0005 met last before its slow pair with gpu-0004. A
    # result is both ends' effects: less gpu-0002's own level, gpu-0005 was normal with it, and
    # the pair is the link (the fleet64 "jobs 5 min" trace, seed 1, waited 9 minutes for this).
    pairs = [
        (0.0, "gpu-0002", "gpu-0000"),
        (0.0, "gpu-0006", "gpu-0007"),
        (20.0, "gpu-0002", "gpu-0001"),
        (40.0, "gpu-0002", "gpu-0007"),
        (60.0, "gpu-0002", "gpu-0003"),
        (100.0, "gpu-0004", "gpu-0003"),
        (100.0, "gpu-0005", "gpu-0006"),
        (150.0, "gpu-0004", "gpu-0001"),
        (250.0, "gpu-0005", "gpu-0002"),
        (300.0, "gpu-0004", "gpu-0005"),
        (345.0, "gpu-0004", "gpu-0005"),
    ]

    def factor(a: str, b: str, _t: float) -> float:
        if "gpu-0002" in (a, b):
            return 0.84
        return 0.65 if {a, b} == {"gpu-0004", "gpu-0005"} else 1.0

    loc = LinkLocalizer()
    v = loc.run(FRAMES, sparse(loc, factor, pairs))
    assert set(v.links) == {("gpu-0004", "gpu-0005")}
    assert not quarantined(v) & {"gpu-0004", "gpu-0005"}


# -- the sequential test at the probe scheduler's defaults --------------------------------------
# aggregator/probes (docs/probes.md, "What a node gets"): one rotation pair per node per 600-s
# round, a new partner each round (circle method); a result under the suspicious line (0.85 of
# expected) gets the same pair again 40 s after it, then two fresh partners for each end, ahead of
# rotation. A probe takes about 15 s (start delay) plus its run, and a node is in one at a time.
ROUND_S = 600.0
LEAF = NODES[:8]
SUSPICIOUS = 0.85
RUN_EVERY_S = 60.0  # LinkConfig.every_seconds
PERSIST_S = 120.0  # health.suspect_for_seconds: a node finding must persist this long


def _circle(nodes: list[str], r: int) -> list[tuple[str, str]]:
    """Round r of the circle method: every node once, a new partner each round."""
    n = len(nodes)
    fixed, rest = nodes[0], nodes[1:]
    rot = rest[r % (n - 1) :] + rest[: r % (n - 1)]
    ring = [fixed, *rot]
    return [(ring[i], ring[n - 1 - i]) for i in range(n // 2)]


def scheduled(
    factor: Factor, *, rounds: int, noise: float, seed: int, nodes: list[str] = LEAF
) -> list[tuple[float, str, str, float]]:
    """(time, a, b, bandwidth) of every result the default schedule gives an idle leaf."""
    rng = random.Random(seed)
    out: list[tuple[float, str, str, float]] = []
    met: set[frozenset[str]] = set()

    def measure(t: float, a: str, b: str) -> float:
        bw = BW * factor(a, b, t) * math.exp(rng.gauss(0.0, noise))
        out.append((t, a, b, bw))
        met.add(frozenset((a, b)))
        return bw

    for r in range(rounds):
        start = r * ROUND_S
        free_at = dict.fromkeys(nodes, start)
        for a, b in _circle(nodes, r):
            t = start + 15.0 + rng.uniform(0, 30)
            bw = measure(t, a, b)
            free_at[a] = free_at[b] = t + 20.0
            if bw >= SUSPICIOUS * BW:
                continue
            t = measure_at = t + 40.0
            measure(measure_at, a, b)
            for end in (a, b):
                fresh = [n for n in nodes if n not in (a, b) and frozenset((end, n)) not in met]
                for k, other in enumerate(rng.sample(fresh, min(2, len(fresh)))):
                    at = max(t + 60.0 + 60.0 * k, free_at[other]) + rng.uniform(0, 10)
                    measure(at, end, other)
                    free_at[other] = at + 20.0
    return sorted(out)


def first_flag(
    results: list[tuple[float, str, str, float]], want: Callable[[Verdict], bool], *, until: float
) -> float | None:
    """When the localizer, run every minute over the results reported so far, first says ``want``."""
    loc = LinkLocalizer()
    i, t = 0, RUN_EVERY_S
    while t <= until:
        while i < len(results) and results[i][0] + 5.0 <= t:  # in the ends' next reports
            pt, a, b, bw = results[i]
            for me, peer in ((a, b), (b, a)):
                p = Probe(
                    kind="nccl_allreduce_pair", time=T0 + pt, ok=True, peer=peer, busbw_bytes_per_second=bw
                )
                loc.observe(report(me, T0 + pt + 5, [p]), PLACE[me], measured=T0 + pt + 5)
            i += 1
        if want(loc.run(FRAMES, T0 + t)):
            return t
        t += RUN_EVERY_S
    return None


def _slow_node_decided(ratio: float, noise: float, seed: int) -> float | None:
    bad = "gpu-0003"
    factor: Factor = lambda a, b, _t: ratio if bad in (a, b) else 1.0  # noqa: E731
    results = scheduled(factor, rounds=3, noise=noise, seed=seed)
    first_slow = min(t for t, a, b, _ in results if bad in (a, b))
    at = first_flag(results, lambda v: quarantined(v) == {bad}, until=3 * ROUND_S)
    return None if at is None else at + PERSIST_S - first_slow


@pytest.mark.parametrize("seed", range(4))
def test_a_nic_25_percent_slow_is_quarantined_within_10_minutes_at_the_default_schedule(seed: int) -> None:
    # From its first slow result: the localizer's run, then the health machine's persistence.
    took = _slow_node_decided(0.75, noise=0.015, seed=seed)
    assert took is not None and took <= 600.0


def test_a_larger_slowdown_is_decided_on_fewer_results() -> None:
    # In a noisy pool (TCP-like, 6 % per result), 25 % slow needs more partners than one result
    # each can give; 40 % slow is decided on its first two partners.
    took25 = [_slow_node_decided(0.75, noise=0.06, seed=s) for s in range(4)]
    took40 = [_slow_node_decided(0.60, noise=0.06, seed=s) for s in range(4)]
    assert all(t is not None for t in took40)
    assert all(t40 <= (t25 if t25 is not None else math.inf) for t25, t40 in zip(took25, took40, strict=True))
    assert (
        sum(t40 < (t25 if t25 is not None else math.inf) for t25, t40 in zip(took25, took40, strict=True))
        >= 2
    )  # type: ignore[operator]


@pytest.mark.parametrize("seed", range(3))
def test_a_degraded_link_at_the_default_schedule_is_a_link_with_neither_end_blamed(seed: int) -> None:
    slow = {"gpu-0001", "gpu-0006"}
    factor: Factor = lambda a, b, _t: 0.7 if {a, b} == slow else 1.0  # noqa: E731
    results = scheduled(factor, rounds=7, noise=0.015, seed=seed)  # the pair meets within 7 rounds
    first_slow = min(t for t, a, b, _ in results if {a, b} == slow)
    blamed: list[str] = []

    def link(v: Verdict) -> bool:
        blamed.extend(quarantined(v))
        return set(v.links or {}) == {("gpu-0001", "gpu-0006")}

    at = first_flag(results, link, until=7 * ROUND_S)
    assert at is not None
    # The link's own state machine waits one more localizer run to confirm it.
    assert at + RUN_EVERY_S - first_slow <= 600.0
    assert blamed == []


@pytest.mark.parametrize("threshold", [18.0, 9.0])
def test_a_healthy_noisy_pool_over_hundreds_of_node_hours_decides_nothing(threshold: float) -> None:
    # 16 nodes in two leaves, a pair per node per 10-minute round for 25 hours (400 node-hours;
    # GPUWARDEN_HEALTHY_POOL_HOURS=625 makes it 10,000), 3 % noise per result (twice either
    # generator's). The stated rate (docs/detection.md) is far under one in this many; half the
    # threshold must stay quiet too, or the margin is thin.
    hours = int(os.environ.get("GPUWARDEN_HEALTHY_POOL_HOURS", "25"))
    rng = random.Random(7)
    loc = LinkLocalizer(LinkConfig(threshold_nats=threshold))
    decided = 0
    for r in range(hours * 6):
        start = T0 + r * ROUND_S
        for leaf in (NODES[:8], NODES[8:]):
            for a, b in _circle(leaf, r):
                pt = start + rng.uniform(15, 45)
                bw = BW * math.exp(rng.gauss(0.0, 0.03))
                for me, peer in ((a, b), (b, a)):
                    p = Probe(
                        kind="nccl_allreduce_pair", time=pt, ok=True, peer=peer, busbw_bytes_per_second=bw
                    )
                    loc.observe(report(me, pt + 5, [p]), PLACE[me], measured=pt + 5)
        v = loc.run(FRAMES, start + 120)
        decided += len(quarantined(v)) + len(v.links or {})
    assert decided == 0


# The second generator's busy 95 % cell, seed 1 (docs/detection.md, "Links"): four idle nodes in
# a cycle, one with a slow NIC (gpu-0004) and a degraded link between two others (gpu-0005 and
# gpu-0006); each node meets only its two neighbours.
CYCLE = [
    (dt, a, b)
    for dt in (0.0, 500.0, 780.0)
    for a, b in (
        ("gpu-0004", "gpu-0005"),
        ("gpu-0004", "gpu-0007"),
        ("gpu-0005", "gpu-0006"),
        ("gpu-0006", "gpu-0007"),
    )
]


def _cycle(a: str, b: str, _t: float) -> float:
    return (0.75 if "gpu-0004" in (a, b) else 1.0) * (0.53 if {a, b} == {"gpu-0005", "gpu-0006"} else 1.0)


def test_a_cycle_with_a_slow_nic_and_a_link_blames_no_healthy_node() -> None:
    loc = LinkLocalizer()
    v = loc.run(FRAMES, sparse(loc, _cycle, CYCLE))
    assert quarantined(v) <= {"gpu-0004"}
    assert set(v.links or {}) <= {("gpu-0005", "gpu-0006")}


@pytest.mark.xfail(strict=True, reason="needs the pairs explained jointly (docs/detection.md, Links)")
def test_a_cycle_with_a_slow_nic_and_a_link_finds_both() -> None:
    # A normal result clears both its ends: gpu-0006 and gpu-0007 are healthy, so gpu-0004 is
    # slow with two partners (the NIC) and gpu-0005, at its partner's level, is normal: the link.
    loc = LinkLocalizer()
    v = loc.run(FRAMES, sparse(loc, _cycle, CYCLE))
    assert quarantined(v) == {"gpu-0004"}
    assert set(v.links or {}) == {("gpu-0005", "gpu-0006")}
