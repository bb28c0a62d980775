"""The probe scheduler on simulated fleets: coverage bound, exclusivity, idleness, caps, confirm
re-probes, preflight, signatures, and the coverage metrics.

``FleetSim`` plays the agents: every step each node reports (observe) and polls
(assignments_for); a probe's result goes into both ends' reports ``duration`` seconds after it
may start. Its own bookkeeping (which node runs what, what was planned when) is independent of the
scheduler's, so the invariants are checked against what agents actually received.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field

import msgspec
import pytest
from prometheus_client.registry import CollectorRegistry

from agent.errors import ConfigError
from agent.probes.protocol import Assignment, verify
from agent.report import CollectorError, Gpu, Probe, Report
from aggregator.config import ProbesConfig
from aggregator.fleet.pools import Placement
from aggregator.probes.metrics import ProbeMetrics
from aggregator.probes.scheduler import ProbeScheduler, circle_round, report_is_idle

KEY = b"probe-key-for-tests-0123456789ab"
T0 = 1_764_441_600.0  # a multiple of every round length used here
GIB = 1 << 30
GOOD_BW = 40e9


def names(leaves: int, per_leaf: int) -> list[str]:
    return [f"gpu-{leaf:02d}-{i:02d}" for leaf in range(leaves) for i in range(per_leaf)]


def placement(node: str, pool: str = "h100") -> Placement:
    leaf = node.split("-")[1]
    return Placement(pool, rack=f"rack-{leaf}", leaf=f"leaf-{leaf}")


@dataclass
class Planned:
    assignment: Assignment
    seen_at: float  # when the agent first received it
    reason: str  # why the scheduler planned it (rotation, confirm, preflight, local)


@dataclass
class FleetSim:
    scheduler: ProbeScheduler
    nodes: list[str]
    duration: float = 20.0
    busbw: dict[tuple[str, str], float] = field(default_factory=dict)  # per sorted pair; default GOOD_BW
    fail: set[tuple[str, str]] = field(default_factory=set)
    local_busbw: float = 200e9
    # Agent side bookkeeping.
    seen: dict[str, dict[str, Planned]] = field(
        default_factory=lambda: defaultdict(dict)
    )  # id -> node -> ...
    running: dict[str, str] = field(default_factory=dict)  # node -> assignment id it holds
    done: dict[str, float] = field(default_factory=dict)  # id -> when its result was reported
    tested: dict[tuple[str, str], float] = field(default_factory=dict)  # pair -> last ok result
    results: list[tuple[str, Probe]] = field(default_factory=list)

    def step(
        self, now: float, busy: Collection[str] = (), preflight: Collection[str] = ()
    ) -> list[Assignment]:
        """Report results due, observe every node, poll every node; returns the new assignments."""
        self.report_results(now)
        for n in self.nodes:
            self.scheduler.observe(
                n, placement(n), idle=n not in busy, now=now, address=f"{n}:7700", preflight=n in preflight
            )
        new: list[Assignment] = []
        for n in self.nodes:
            for a in self.scheduler.assignments_for(n, now):
                if a.id in self.seen and n in self.seen[a.id]:
                    continue
                held = self.running.get(n)
                assert held is None or held == a.id, f"{n} given {a.id} while still in {held}"
                self.running[n] = a.id
                view = self.scheduler.probe(a.id)
                assert view is not None and n in view.nodes
                self.seen[a.id][n] = Planned(a, now, view.reason)
                new.append(a)
        return new

    def planned(self, since: float = -1.0) -> list[Planned]:
        return [p for ends in self.seen.values() for p in ends.values() if p.seen_at >= since]

    def report_results(self, now: float) -> None:
        for pid, ends in list(self.seen.items()):
            if pid in self.done:
                continue
            first = next(iter(ends.values())).assignment
            end_time = first.not_before + self.duration
            expected_ends = 1 if first.role == "local" else 2
            if len(ends) < expected_ends:
                if now >= first.deadline:
                    self._close(pid, now)
                continue
            if now < end_time:
                continue
            for node, planned in ends.items():
                a = planned.assignment
                probe = self._measure(a, end_time)
                self.results.append((node, probe))
                self.scheduler.result(node, probe, placement(node), now)
            self._close(pid, now)

    def _close(self, pid: str, now: float) -> None:
        self.done[pid] = now
        for node in self.seen[pid]:
            if self.running.get(node) == pid:
                del self.running[node]

    def _measure(self, a: Assignment, t: float) -> Probe:
        if a.peer is None:
            return Probe(
                kind=a.kind, time=t, ok=True, size_bytes=a.size_bytes, busbw_bytes_per_second=self.local_busbw
            )
        pair = (min(a.node, a.peer), max(a.node, a.peer))
        if pair in self.fail:
            return Probe(kind=a.kind, time=t, ok=False, peer=a.peer, error="connection reset")
        bw = self.busbw.get(pair, GOOD_BW)
        self.tested[pair] = t
        return Probe(
            kind=a.kind, time=t, ok=True, peer=a.peer, size_bytes=a.size_bytes, busbw_bytes_per_second=bw
        )

    def assignments(self) -> list[Assignment]:
        return [p.assignment for ends in self.seen.values() for p in ends.values()]


def run_rounds(
    sim: FleetSim, rounds: int, round_s: float, step_s: float, busy_of_round: list[set[str]] | None = None
) -> list[tuple[float, set[str], list[Assignment]]]:
    out = []
    t = T0
    for r in range(rounds):
        busy = busy_of_round[r] if busy_of_round else set()
        for k in range(int(round_s // step_s)):
            now = T0 + r * round_s + k * step_s
            out.append((now, busy, sim.step(now, busy)))
            t = now
    assert t < T0 + rounds * round_s
    return out


def check_caps(sim: FleetSim, cfg: ProbesConfig) -> None:
    """No more probes at once than the caps allow, fleet-wide, per leaf, and in bandwidth."""
    probes: dict[str, list[Assignment]] = defaultdict(list)
    for a in sim.assignments():
        probes[a.id].append(a)
    events: list[tuple[float, int, str]] = []
    for pid, ends in probes.items():
        start = min(sim.seen[pid][a.node].seen_at for a in ends)
        end = min(sim.done.get(pid, ends[0].deadline), ends[0].deadline)
        events += [(start, 1, pid), (end, -1, pid)]
    active: set[str] = set()
    for _, delta, pid in sorted(events, key=lambda e: (e[0], e[1])):
        if delta < 0:
            active.discard(pid)
            continue
        active.add(pid)
        assert len(active) <= cfg.max_concurrent
        per_leaf: dict[str, int] = defaultdict(int)
        for other in active:
            ends = probes[other]
            if len(ends) == 2:
                for leaf in {placement(a.node).leaf for a in ends}:
                    per_leaf[str(leaf)] += 1
        assert max(per_leaf.values(), default=0) <= cfg.max_concurrent_per_leaf
    starts = sorted((ends[0].not_before, ends[0].size_bytes) for ends in probes.values() if len(ends) == 2)
    budget = cfg.bandwidth_budget_bytes_per_second * cfg.bandwidth_window_seconds
    lo, in_window = 0, 0
    for hi, (s, size) in enumerate(starts):
        in_window += size
        while starts[lo][0] <= s - cfg.bandwidth_window_seconds:
            in_window -= starts[lo][1]
            lo += 1
        # Every window ending at a start (where the sum can grow) holds at most the budget.
        assert (hi + 1 < len(starts) and starts[hi + 1][0] == s) or in_window <= budget, (
            f"{in_window} bytes started in the window ending {s}"
        )


# -- the "done when": a 512-node fleet --------------------------------------------------------


def fleet_config(**overrides: object) -> ProbesConfig:
    base: dict[str, object] = {
        "pair_kind": "tcp_pair",
        "local_kind": None,
        "round_seconds": 120.0,
        "cross_group_every": 0,
        "poll_seconds": 10.0,
        "start_delay_seconds": 5.0,
        "pair_deadline_seconds": 60.0,
        "pair_size_bytes": GIB,
        "max_concurrent": 200,
        "max_concurrent_per_leaf": 6,
        # 150 one-GiB probes a minute: a round's 256 pairs need two waves.
        "bandwidth_budget_bytes_per_second": 150 * GIB / 60.0,
        "bandwidth_window_seconds": 60.0,
    }
    base.update(overrides)
    return msgspec.convert(base, ProbesConfig)


def test_every_pair_of_each_16_node_group_within_15_rounds_under_caps() -> None:
    cfg = fleet_config()
    nodes = names(32, 16)
    sim = FleetSim(ProbeScheduler(cfg, KEY), nodes)
    by_leaf: dict[str, list[str]] = defaultdict(list)
    for n in nodes:
        by_leaf[n.split("-")[1]].append(n)
    # Two full rotations: the bound holds from a cold start and again in the steady state.
    for cycle in range(2):
        start = T0 + cycle * 15 * cfg.round_seconds
        for r in range(15):
            for k in range(int(cfg.round_seconds // 10)):
                sim.step(start + r * cfg.round_seconds + k * 10.0)
        # The last round's late wave reports after the round ends: collect it.
        end = start + 15 * cfg.round_seconds
        sim.report_results(end - 1)
        missing = [
            (a, b)
            for members in by_leaf.values()
            for i, a in enumerate(members)
            for b in members[i + 1 :]
            if sim.tested.get((a, b), 0.0) < start
        ]
        assert missing == [], f"rotation {cycle}"
    sim.report_results(end + cfg.pair_deadline_seconds)
    assert all(pid in sim.done for pid in sim.seen)
    # Rotation stays inside the leaf: no probe crossed one when cross rounds are off.
    assert all(placement(a.node).leaf == placement(str(a.peer)).leaf for a in sim.assignments())
    check_caps(sim, cfg)
    cov = sim.scheduler.coverage(end)
    assert {g.ratio for g in cov.groups.values()} == {1.0}
    assert len(cov.groups) == 32 and cov.nodes_overdue == 0


def test_busy_nodes_are_never_probed_and_their_pairs_stay_owed() -> None:
    cfg = fleet_config()
    nodes = names(32, 16)
    sim = FleetSim(ProbeScheduler(cfg, KEY), nodes)
    rng = random.Random(6)
    rounds = 40
    busy = [set(rng.sample(nodes, len(nodes) // 5)) for _ in range(rounds)]
    steps = run_rounds(sim, rounds, cfg.round_seconds, 10.0, busy)

    for _, busy_now, new in steps:
        for a in new:
            assert a.node not in busy_now, f"busy {a.node} got {a.id}"
            assert a.peer not in busy_now, f"{a.node} paired with busy {a.peer}"
    check_caps(sim, cfg)
    # Every idle node is in a probe each round but at most one per leaf (an odd count): members
    # whose circle partner is busy are paired with each other.
    per_round = int(cfg.round_seconds // 10)
    for r in range(1, rounds):
        planned = {a.node for _, _, new in steps[r * per_round : (r + 1) * per_round] for a in new}
        idle_per_leaf: dict[str, int] = defaultdict(int)
        for n in nodes:
            if n not in busy[r]:
                idle_per_leaf[n.split("-")[1]] += 1
        assert len(planned) == sum(2 * (k // 2) for k in idle_per_leaf.values())
    # The pairs a busy node missed are preferred later: with a fifth of the fleet busy every
    # round, every pair of every leaf is still tested within 40 rounds (the fewest possible,
    # 204 pairs a round for 3,840 pairs, is 19).
    by_leaf: dict[str, list[str]] = defaultdict(list)
    for n in nodes:
        by_leaf[n.split("-")[1]].append(n)
    total = sum(len(m) * (len(m) - 1) // 2 for m in by_leaf.values())
    tested = sum(1 for a, b in sim.tested if a.split("-")[1] == b.split("-")[1])
    assert tested == total


def test_a_node_turning_busy_before_its_probe_starts_frees_its_partner() -> None:
    cfg = fleet_config(start_delay_seconds=30.0)
    sim = FleetSim(ProbeScheduler(cfg, KEY), names(1, 4))
    sim.step(T0)
    new = sim.step(T0 + 10)
    assert len(new) == 4
    a = new[0]
    s = sim.scheduler
    s.observe(a.node, placement(a.node), idle=False, now=T0 + 15)
    assert s.assignments_for(str(a.peer), T0 + 15) == []
    assert s.probe(a.id) is None and s.in_flight_count == 1
    # The partner ran nothing and says so; a called-off probe's result starts no re-probe.
    failed = Probe(kind="tcp_pair", time=T0 + 90, ok=False, peer=a.node, error="peer never came")
    s.result(str(a.peer), failed, placement(a.node), T0 + 90)
    s.tick(T0 + 91)
    assert s.assignments_total[("tcp_pair", "confirm")] == 0


def test_cross_group_rounds_pair_different_leaves_of_one_pool() -> None:
    cfg = fleet_config(cross_group_every=3)
    nodes = names(4, 4)
    sim = FleetSim(ProbeScheduler(cfg, KEY), nodes)
    run_rounds(sim, 6, cfg.round_seconds, 10.0)
    by_round: dict[int, set[bool]] = defaultdict(set)
    for ends in sim.seen.values():
        for p in ends.values():
            a = p.assignment
            r = int((p.seen_at - T0) // cfg.round_seconds)
            by_round[r].add(placement(a.node).leaf != placement(str(a.peer)).leaf)
    # Rounds are numbered from the epoch (so a new leader continues the rotation): every third
    # one crosses leaves, the others stay inside them.
    first = int(T0 // cfg.round_seconds)
    assert by_round == {r: {(first + r) % 3 == 2} for r in range(6)}
    assert sum(1 for crossing in by_round.values() if crossing == {True}) == 2


def test_circle_round_covers_every_pair_once_with_byes() -> None:
    for size in (2, 5, 16):
        members = [f"n{i:02d}" for i in range(size)]
        rounds = size - 1 if size % 2 == 0 else size
        seen = [p for r in range(rounds) for p in circle_round(members, r)]
        assert len(seen) == len(set(seen)) == size * (size - 1) // 2
        for r in range(rounds):
            ends = [n for p in circle_round(members, r) for n in p]
            assert len(ends) == len(set(ends))


# -- signatures ------------------------------------------------------------------------------------


def test_assignments_are_signed_and_both_ends_agree() -> None:
    cfg = fleet_config()
    nodes = names(2, 4)
    sim = FleetSim(ProbeScheduler(cfg, KEY), nodes)
    run_rounds(sim, 2, cfg.round_seconds, 10.0)
    assigned = sim.assignments()
    assert assigned
    assert all(verify(a, KEY) for a in assigned)
    assert not any(verify(a, b"another-key-entirely-0123456789") for a in assigned)
    assert not verify(msgspec.structs.replace(assigned[0], node="gpu-99-99"), KEY)
    by_id: dict[str, list[Assignment]] = defaultdict(list)
    for a in assigned:
        by_id[a.id].append(a)
    for ends in by_id.values():
        assert len(ends) == 2
        client = next(a for a in ends if a.role == "client")
        server = next(a for a in ends if a.role == "server")
        assert client.peer == server.node and server.peer == client.node
        assert client.peer_address == f"{server.node}:7700"
        assert client.not_before == server.not_before and client.deadline == server.deadline


def test_nccl_pairs_get_ranks_and_local_probes_run_on_idle_nodes() -> None:
    cfg = fleet_config(
        pair_kind="nccl_allreduce_pair", local_kind="nccl_allreduce_local", local_every_seconds=240.0
    )
    nodes = names(1, 4)
    sim = FleetSim(ProbeScheduler(cfg, KEY), nodes)
    run_rounds(sim, 4, cfg.round_seconds, 10.0, [set(), {nodes[3]}, set(), set()])
    pairs = [a for a in sim.assignments() if a.kind == "nccl_allreduce_pair"]
    assert pairs and {a.rank for a in pairs} == {0, 1}
    assert all((a.rank == 0) == (a.role == "server") for a in pairs)
    locals_ = [p for p in sim.planned() if p.assignment.kind == "nccl_allreduce_local"]
    # Once in the first round and again after local_every_seconds, for each node.
    per_node: dict[str, list[float]] = defaultdict(list)
    for p in locals_:
        per_node[p.assignment.node].append(p.seen_at)
        assert p.assignment.role == "local" and p.assignment.peer is None
    assert sorted(per_node) == nodes
    for times in per_node.values():
        assert len(times) == 2 and times[1] - times[0] >= cfg.local_every_seconds


def test_a_one_gpu_local_result_without_bandwidth_counts_as_tested() -> None:
    cfg = fleet_config(local_kind="nccl_allreduce_local")
    s = ProbeScheduler(cfg, KEY)
    s.observe("gpu-00-00", placement("gpu-00-00"), idle=True, now=T0)
    one_gpu = Probe(
        kind="nccl_allreduce_local", time=T0, ok=True, size_bytes=GIB, busbw_bytes_per_second=None
    )
    s.result("gpu-00-00", one_gpu, placement("gpu-00-00"), T0 + 5)
    assert s.coverage(T0 + 10).node_untested_seconds == {"gpu-00-00": 5.0}
    assert s.results_total[("nccl_allreduce_local", True)] == 1


# -- confirm re-probes --------------------------------------------------------------------------------


def warmed(cfg: ProbesConfig, nodes: list[str], rounds: int = 3) -> FleetSim:
    sim = FleetSim(ProbeScheduler(cfg, KEY), nodes)
    run_rounds(sim, rounds, cfg.round_seconds, 10.0)
    return sim


def test_a_slow_pair_result_is_confirmed_with_the_pair_again_and_fresh_partners() -> None:
    cfg = fleet_config(round_seconds=300.0)
    nodes = names(2, 8)
    sim = warmed(cfg, nodes)
    s = sim.scheduler
    assert s.assignments_total[("tcp_pair", "confirm")] == 0

    # The next rotation pair of gpu-00-00 comes back at a third of the pool's bandwidth.
    start = T0 + 3 * cfg.round_seconds
    a = next(x for x in sim.step(start) if x.node == "gpu-00-00")
    bad = (min(a.node, str(a.peer)), max(a.node, str(a.peer)))
    sim.busbw[bad] = GOOD_BW / 3
    for k in range(1, int(3 * cfg.round_seconds // 10)):
        sim.step(start + 10 * k)

    confirms = [p for p in sim.planned(start) if p.reason == "confirm"]
    # The pair again and two fresh partners for each end: five probes, and no more, though the
    # pair's confirm result is slow again (a confirm confirms; it starts nothing).
    assert s.assignments_total[("tcp_pair", "confirm")] == 1 + 2 * cfg.fresh_partners
    again = [p for p in confirms if {p.assignment.node, p.assignment.peer} == set(bad)]
    assert len(again) == 2  # both ends of one probe
    window_end = start + cfg.confirm_within_rounds * cfg.round_seconds
    assert again[0].seen_at <= window_end
    # Its start is pair_again_after_seconds after the slow result (itself after ``start``), so
    # the localizer does not take it for a copy of the first; and it goes before the fresh
    # partners of either end.
    assert again[0].assignment.not_before >= start + cfg.pair_again_after_seconds
    others = [p for p in confirms if {p.assignment.node, p.assignment.peer} != set(bad)]
    assert others and all(p.assignment.not_before >= again[0].assignment.not_before for p in others)
    recent_partners = {
        str(p.assignment.peer)
        for p in sim.planned(start - 3 * cfg.round_seconds)
        if p.assignment.node in bad and p.seen_at < start
    }
    for end in bad:
        fresh = [
            str(p.assignment.peer)
            for p in confirms
            if p.assignment.node == end and p.assignment.peer not in bad
        ]
        assert len(fresh) == len(set(fresh)) == cfg.fresh_partners
        assert all(p.seen_at <= window_end for p in confirms)
        # Fresh: none of them met this end in the rotation rounds before.
        mine = {
            str(p.assignment.peer) for p in sim.planned(T0) if p.assignment.node == end and p.seen_at < start
        }
        assert not set(fresh) & mine
    assert recent_partners


def test_a_slow_pair_of_the_first_round_is_confirmed_once_the_pool_has_an_expected_bandwidth() -> None:
    # A fresh (or restarted) scheduler has no expected bandwidth for its first results: a pair
    # slow from the start must still get its confirm, not wait a whole rotation to be met again.
    cfg = fleet_config(round_seconds=300.0)
    sim = FleetSim(ProbeScheduler(cfg, KEY), names(2, 8))
    s = sim.scheduler
    k, first = 0, []
    while not first:
        first = [x for x in sim.step(T0 + 10 * k) if x.peer is not None]
        k += 1
    a = first[0]
    bad = (min(a.node, str(a.peer)), max(a.node, str(a.peer)))
    sim.busbw[bad] = GOOD_BW / 2
    assert s._expected_of("h100", "tcp_pair") is None
    for step in range(k, int(cfg.round_seconds // 10)):
        sim.step(T0 + 10 * step)
    assert s._expected_of("h100", "tcp_pair") is not None
    again = [
        p
        for p in sim.planned(T0)
        if p.reason == "confirm" and {p.assignment.node, p.assignment.peer} == set(bad)
    ]
    assert len(again) == 2, "the slow pair is probed again within the first round"
    assert again[0].assignment.not_before <= T0 + cfg.round_seconds
    # A normal result of those first ones asks for nothing.
    assert s.assignments_total[("tcp_pair", "confirm")] == 1 + 2 * cfg.fresh_partners


def test_confirms_go_before_rotation_and_are_bounded_per_node() -> None:
    cfg = fleet_config(round_seconds=300.0, max_concurrent=2)
    nodes = names(1, 8)
    sim = warmed(cfg, nodes, rounds=1)
    s = sim.scheduler
    now = T0 + cfg.round_seconds + 5
    met = {str(p.assignment.peer) for p in sim.planned() if p.assignment.node == "gpu-00-00"}
    peers = [n for n in nodes[1:] if n not in met][:3]
    # Three failed results of gpu-00-00 with three partners (unplanned: an agent reporting probes
    # from before a restart): each asks for five re-probes, but a node has at most
    # max_pending_confirms outstanding.
    for peer in peers:
        failed = Probe(kind="tcp_pair", time=now, ok=False, peer=peer, error="timeout")
        s.result("gpu-00-00", failed, placement("gpu-00-00"), now)
    assert s._pending["gpu-00-00"] == cfg.max_pending_confirms
    assert max(s._pending.values()) <= cfg.max_pending_confirms
    # At its limit a node's pair-again requests take the place of its fresh partners: each
    # failed pair is met again.
    assert sorted(str(c.peer) for c in s._confirms if c.node == "gpu-00-00") == sorted(peers)
    new = sim.step(now)
    # Two probes may run fleet-wide: a confirm goes first, though the round's rotation is owed too.
    assert len(new) == 4 and [sim.seen[a.id][a.node].reason for a in new][:2] == ["confirm", "confirm"]


def test_a_pair_again_takes_the_place_of_fresh_partners_at_an_ends_limit() -> None:
    # The partner of a bad node is held at its limit by the fresh partners the bad node's slow
    # result asked for; its own slow path with a third node must still be probed again (the
    # one confirm a link verdict needs), or that path waits a whole rotation.
    cfg = fleet_config(round_seconds=300.0)
    nodes = names(1, 8)
    sim = warmed(cfg, nodes, rounds=1)
    s = sim.scheduler
    now = T0 + cfg.round_seconds + 5
    bad, partner = nodes[0], nodes[1]
    # Results of pairs the last round planned would be taken for that round's copies.
    met = {frozenset((p.assignment.node, str(p.assignment.peer))) for p in sim.planned()}
    third, fourth = [n for n in nodes[2:] if not {frozenset((partner, n)), frozenset((bad, n))} & met][:2]

    def failed(a: str, b: str, at: float) -> None:
        s.result(a, Probe(kind="tcp_pair", time=at, ok=False, peer=b, error="timeout"), placement(a), at)

    failed(bad, partner, now)
    assert s._pending[partner] == cfg.max_pending_confirms  # the pair again and two fresh partners
    failed(partner, third, now + 1)
    again = [c for c in s._confirms if c.peer is not None and {c.node, c.peer} == {partner, third}]
    assert len(again) == 1, "the second slow path is probed again"
    assert s._pending[partner] == cfg.max_pending_confirms
    # What gave way is one of the partner's fresh-partner requests, not the first pair again.
    mine = [c for c in s._confirms if partner in (c.node, c.peer)]
    assert sorted((c.node, c.peer) for c in mine if c.peer is not None) == sorted(
        [(bad, partner), (partner, third)]
    )
    assert sum(1 for c in mine if c.peer is None) == 1
    # Another slow path takes the last fresh partner's place; then the limit is all pair-agains,
    # which are never displaced, and a fourth waits for the rotation.
    failed(partner, fourth, now + 2)
    assert [c.peer for c in s._confirms if c.peer is not None and c.node == partner] == [third, fourth]
    assert not [c for c in s._confirms if c.node == partner and c.peer is None]
    assert max(s._pending.values()) <= cfg.max_pending_confirms


def test_a_failed_pair_triggers_confirms_but_a_busy_one_does_not() -> None:
    cfg = fleet_config(round_seconds=300.0, start_delay_seconds=5.0)
    nodes = names(1, 6)
    sim = warmed(cfg, nodes, rounds=1)
    s = sim.scheduler
    now = T0 + cfg.round_seconds
    new = sim.step(now)
    assert len(new) == 6
    a = new[0]
    # Its end turns busy after the probe started: the agent steps aside and reports a failure.
    s.observe(a.node, placement(a.node), idle=False, now=now + 10)
    failure = Probe(kind="tcp_pair", time=now + 12, ok=False, peer=a.peer, error="stepped aside: job started")
    s.result(a.node, failure, placement(a.node), now + 12)
    assert s.assignments_total[("tcp_pair", "confirm")] == 0 and not s._confirms
    assert s.results_total[("tcp_pair", False)] == 1
    # The agent's own word for "not run, the node was busy" is no evidence either.
    other = next(x for x in new if a.node not in (x.node, x.peer))
    skipped = Probe(
        kind="tcp_pair", time=now + 12, ok=False, peer=other.peer, error="skipped: GPUs busy: pid 4242"
    )
    s.result(other.node, skipped, placement(other.node), now + 12)
    assert not s._confirms
    # A real failure of another pair is.
    third = next(x for x in new if {x.node, x.peer}.isdisjoint({a.node, a.peer, other.node, other.peer}))
    broken = Probe(kind="tcp_pair", time=now + 12, ok=False, peer=third.peer, error="connection reset")
    s.result(third.node, broken, placement(third.node), now + 12)
    assert len(s._confirms) == 1 + 2 * cfg.fresh_partners


# -- preflight ------------------------------------------------------------------------------------------


def preflight_until_decided(sim: FleetSim, node: str, start: float, steps: int) -> list[Planned]:
    """Steps the fleet every 10 s with ``node`` in preflight until it has a verdict (at most
    ``steps`` steps); the probes ``node`` ran meanwhile."""
    got: list[Planned] = []
    for k in range(steps):
        for a in sim.step(start + 10 * k, preflight={node}):
            if a.node == node:
                got.append(sim.seen[a.id][a.node])
        if sim.scheduler.preflight_status(node)[0] != "pending":
            break
    return got


def test_preflight_runs_local_then_a_known_good_pair_and_passes() -> None:
    cfg = fleet_config(local_kind="nccl_allreduce_local", local_every_seconds=1e6, round_seconds=300.0)
    nodes = names(1, 8)
    sim = warmed(cfg, nodes, rounds=3)
    s = sim.scheduler
    new_node = "gpu-00-99"
    sim.nodes.append(new_node)
    start = T0 + 3 * cfg.round_seconds + 100  # mid-round: the rotation is already planned
    got = preflight_until_decided(sim, new_node, start, steps=30)
    state, evidence = s.preflight_status(new_node)
    assert state == "passed", evidence
    assert [(p.assignment.kind, p.reason) for p in got] == [
        ("nccl_allreduce_local", "preflight"),
        ("tcp_pair", "preflight"),
    ]
    partner = str(got[1].assignment.peer)
    assert evidence["partner"] == partner
    # Known-good: the partner's last results were all ok and at the pool's expected bandwidth.
    recent = [p for n, p in sim.results if n == partner][-cfg.known_good_results :]
    assert len(recent) == cfg.known_good_results
    assert all(p.ok and (p.busbw_bytes_per_second or 0) >= 0.9 * GOOD_BW for p in recent if p.peer)


def test_a_slow_preflight_pair_fails_with_evidence_and_no_rotation_before() -> None:
    cfg = fleet_config(round_seconds=300.0)
    nodes = names(1, 8)
    sim = warmed(cfg, nodes, rounds=3)
    s = sim.scheduler
    new_node = "gpu-00-99"
    sim.nodes.append(new_node)
    for n in nodes:
        sim.busbw[(min(n, new_node), max(n, new_node))] = GOOD_BW / 4
    start = T0 + 3 * cfg.round_seconds
    got = preflight_until_decided(sim, new_node, start, steps=20)
    state, evidence = s.preflight_status(new_node)
    assert state == "failed"
    pair = evidence["pair"]
    assert isinstance(pair, dict) and pair["busbw_bytes_per_second"] == GOOD_BW / 4
    assert pair["expected_bytes_per_second"] == pytest.approx(GOOD_BW)
    # Its only probe was the preflight pair: it was kept out of the rotation until the verdict.
    assert [p.reason for p in got] == ["preflight"]


def test_preflight_waits_without_a_known_good_partner() -> None:
    cfg = fleet_config()
    s = ProbeScheduler(cfg, KEY)
    for n in ("gpu-00-00", "gpu-00-01"):
        s.observe(n, placement(n), idle=True, now=T0, preflight=True, address=f"{n}:7700")
    assert s.assignments_for("gpu-00-00", T0) == [] and s.assignments_for("gpu-00-01", T0) == []
    state, evidence = s.preflight_status("gpu-00-00")
    assert state == "pending" and "known-good" in str(evidence["note"])


# -- idleness, config, metrics ---------------------------------------------------------------------------


def _gpu(index: int, util: float | None, mem: int | None) -> Gpu:
    return Gpu(index=index, uuid=f"GPU-{index}", utilization_ratio=util, memory_used_bytes=mem)


def _report(gpus: list[Gpu]) -> Report:
    return Report(
        schema="gpuwarden/report/v1", node="gpu-00-00", time=T0, seq=1, boot_id="b", gpus=gpus, nics=[]
    )


def test_report_is_idle() -> None:
    cfg = ProbesConfig()
    assert report_is_idle(_report([]), cfg)
    assert report_is_idle(_report([_gpu(0, 0.0, 500 << 20), _gpu(1, 0.01, 0)]), cfg)
    assert not report_is_idle(_report([_gpu(0, 0.0, 0), _gpu(1, 0.6, 0)]), cfg)
    assert not report_is_idle(_report([_gpu(0, 0.0, 40 << 30)]), cfg)
    assert not report_is_idle(_report([_gpu(0, None, 0)]), cfg)  # unknown is busy
    # A GPU that fell off the bus is left out of the report and named in its errors: the node's
    # GPUs are not all accounted for, so nothing vouches that it is idle.
    # The error's code says so (the words are for a human: reworded, they still count).
    lost = msgspec.structs.replace(
        _report([_gpu(0, 0.0, 0)]),
        errors=[CollectorError(collector="nvml", message="GPU 1 fell off the bus", code="gpu_lost", gpu=1)],
    )
    assert not report_is_idle(lost, cfg)
    coded_handle = msgspec.structs.replace(
        lost, errors=[CollectorError(collector="nvml", message="GPU 1: ?", code="no_handle", gpu=1)]
    )
    assert not report_is_idle(coded_handle, cfg)
    # An agent older than the code said it in words only.
    old_agent = msgspec.structs.replace(
        lost,
        errors=[CollectorError(collector="nvml", message="GPU 1 (GPU-x, 00000000:1B:00.0): GPU is lost")],
    )
    assert not report_is_idle(old_agent, cfg)
    no_handle = msgspec.structs.replace(
        lost, errors=[CollectorError(collector="nvml", message="GPU 1: no device handle: Unknown Error")]
    )
    assert not report_is_idle(no_handle, cfg)
    # Other errors leave it to the GPUs' own fields: a field the agent may not read in this
    # container must not take the node out of every probe for good.
    for collector, message in (
        ("infiniband", "mlx5_3: gone"),
        ("nvml", "GPU 0 (GPU-x, 00000000:1B:00.0): 1 unreadable: retired pages: Insufficient Permissions"),
    ):
        other = msgspec.structs.replace(lost, errors=[CollectorError(collector=collector, message=message)])
        assert report_is_idle(other, cfg)
    unreadable = CollectorError(collector="nvml", message="GPU 0: 1 unreadable", code="unreadable", gpu=0)
    assert report_is_idle(msgspec.structs.replace(lost, errors=[unreadable]), cfg)


def test_silent_or_non_polling_nodes_get_no_partner() -> None:
    cfg = fleet_config()
    s = ProbeScheduler(cfg, KEY)
    trio = ("gpu-00-00", "gpu-00-01", "gpu-00-02")
    for n in trio:
        s.observe(n, placement(n), idle=True, now=T0, address=f"{n}:7700")
    # gpu-00-02 never polls (an agent without probe support): 00 and 01 pair up without it.
    for t in (T0, T0 + 11):
        for n in trio[:2]:
            s.assignments_for(n, t)
    [a] = s.assignments_for("gpu-00-00", T0 + 11)
    assert a.peer == "gpu-00-01"
    # gpu-00-01 stops reporting: after two intervals it counts as busy, and 00 gets nobody.
    s2 = ProbeScheduler(cfg, KEY)
    for t in (T0, T0 + 11):
        for n in trio[:2]:
            s2.observe(n, placement(n), idle=True, now=t if n == "gpu-00-00" else T0 - 30)
            s2.assignments_for(n, t)
    assert s2.assignments_for("gpu-00-00", T0 + 12) == []


def test_empty_key_is_refused() -> None:
    with pytest.raises(ConfigError):
        ProbeScheduler(ProbesConfig(), b"")


def test_config_refuses_unknown_kinds() -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"pair_kind": "udp_pair"}, ProbesConfig)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"max_concurrent": 0}, ProbesConfig)


def test_metrics_export_coverage_without_a_series_per_node() -> None:
    cfg = fleet_config(coverage_bound_seconds=600.0)
    nodes = names(2, 4)
    sim = FleetSim(ProbeScheduler(cfg, KEY), nodes)
    run_rounds(sim, 3, cfg.round_seconds, 10.0)
    registry = CollectorRegistry()
    clock = [T0 + 3 * cfg.round_seconds]
    ProbeMetrics(registry, sim.scheduler, lambda: clock[0])
    get = registry.get_sample_value
    assert get("gpuwarden_probe_pair_coverage_ratio", {"pool": "h100"}) == 1.0
    assert get("gpuwarden_probe_nodes_overdue") == 0
    pairs = len({pid for pid in sim.seen})
    assert get("gpuwarden_probe_assignments_total", {"kind": "tcp_pair", "reason": "rotation"}) == pairs
    assert get("gpuwarden_probe_assignments_total", {"kind": "nccl_allreduce_pair", "reason": "confirm"}) == 0
    assert get("gpuwarden_probe_results_total", {"kind": "tcp_pair", "ok": "true"}) == len(sim.done)
    assert get("gpuwarden_probe_in_flight") == sim.scheduler.in_flight_count
    worst = get("gpuwarden_probe_node_untested_seconds", {"quantile": "1"})
    assert worst is not None and 0 < worst < cfg.round_seconds * 2
    # Much later with nothing tested: every node is overdue and the coverage ratio drops to 0.
    clock[0] += 10 * 600.0
    assert get("gpuwarden_probe_nodes_overdue") == len(nodes)
    assert get("gpuwarden_probe_pair_coverage_ratio", {"pool": "h100"}) == 0.0
    families = {m.name for m in registry.collect()}
    assert "gpuwarden_probe_node_untested_seconds" in families
    samples = [
        s for m in registry.collect() for s in m.samples if m.name == "gpuwarden_probe_node_untested_seconds"
    ]
    assert len(samples) == 3  # quantiles, never one per node


def test_what_the_link_localizer_counts_as_slow_is_confirmed() -> None:
    """A result the localizer counts as slow evidence (under its slow line) must get a confirm
    re-probe: the scheduler's line sits at or above the localizer's."""
    import math

    from aggregator.detect.links import LinkConfig

    assert ProbesConfig().suspicious_ratio >= math.exp(LinkConfig().slow_line)


def warmed_with_slow_rounds(leaves: int) -> tuple[ProbesConfig, FleetSim, float]:
    """A warmed fleet of ``leaves`` leaves of 8 with 300-s rounds (room for confirms within one),
    and the start of its next round."""
    cfg = fleet_config(round_seconds=300.0)
    return cfg, warmed(cfg, names(leaves, 8)), T0 + 3 * cfg.round_seconds


def pair_result(s: ProbeScheduler, node: str, peer: str, busbw: float, at: float, *, received: float) -> None:
    """``node``'s agent reports its pair probe with ``peer``, measured at ``at``."""
    probe = Probe(kind="tcp_pair", time=at, ok=True, peer=peer, busbw_bytes_per_second=busbw)
    s.result(node, probe, placement(node), received)


def test_a_pair_again_keeps_its_ends_while_its_trigger_frees_them() -> None:
    # A slow rotation result is in from one end while the other end's copy is still on its way
    # (that end stays held by the probe till then). Meanwhile another node's fresh-partner request
    # wants the free end. Taken, that end is in another probe when the first frees, and the slow
    # pair waits a rotation for its second result (the network-namespace test's slow path did).
    _, sim, start = warmed_with_slow_rounds(leaves=1)
    s, nodes = sim.scheduler, sim.nodes
    round_probes = {frozenset((x.node, str(x.peer))) for x in sim.step(start)}
    a, b = sorted(next(iter(p for p in round_probes if nodes[0] in p)))
    at = start + 30
    # Every other probe of the round ends normally, both copies in.
    for pair in round_probes - {frozenset((a, b))}:
        x, y = sorted(pair)
        for me, peer in ((x, y), (y, x)):
            pair_result(s, me, peer, GOOD_BW, at, received=at)
    met = {frozenset((p.assignment.node, str(p.assignment.peer))) for p in sim.planned()}
    c = next(x for x in nodes if x not in (a, b) and frozenset((a, x)) not in met)
    rest = [n for n in nodes if n not in (a, b, c)]
    d = next(x for x in rest if frozenset((c, x)) not in round_probes)
    for n in nodes:  # all but a, b and c turn busy: a is the only partner c could be given
        s.observe(n, placement(n), idle=n not in rest, now=at, address=f"{n}:7700")
        s.assignments_for(n, at)  # their polls
    # A slow result of c's with d from before a restart (d is busy now, so that pair cannot go
    # again): c asks for fresh partners.
    pair_result(s, c, d, GOOD_BW / 10, at, received=at)
    pair_result(s, a, b, GOOD_BW / 10, at, received=at)
    s.tick(at)
    assert s.assignments_for(a, at) == [], "a is kept for the pair again"
    pair_result(s, b, a, GOOD_BW / 10, at, received=at + 1)
    s.tick(at + 1)
    (again,) = s.assignments_for(a, at + 1)
    assert again.peer == b and s.probe(again.id).reason == "confirm"


def test_a_fresh_partners_slow_result_gets_that_pair_again_and_nothing_more() -> None:
    # gpu-00-00's rotation pair is slow, and so is the path to one of the fresh partners it is
    # given. That fresh pair is a second suspect (a slow link between two nodes fine elsewhere),
    # and a link verdict needs two results of it: it is met again at once, not a rotation later.
    # Its own result, and the pair-again's, ask for nothing more.
    cfg, sim, start = warmed_with_slow_rounds(leaves=2)
    s = sim.scheduler
    a = next(x for x in sim.step(start) if x.node == "gpu-00-00")
    bad = (min(a.node, str(a.peer)), max(a.node, str(a.peer)))
    sim.busbw[bad] = GOOD_BW / 3
    slow_path: tuple[str, str] | None = None
    for k in range(1, int(cfg.round_seconds // 10)):  # this round: the next would meet it again
        for x in sim.step(start + 10 * k):
            pair = (min(x.node, str(x.peer)), max(x.node, str(x.peer)))
            is_fresh = s.probe(x.id) is not None and sim.seen[x.id][x.node].reason == "confirm"
            if slow_path is None and is_fresh and pair != bad and "gpu-00-00" in pair:
                slow_path = pair  # gpu-00-00's first fresh partner: its path is slow too
                sim.busbw[pair] = GOOD_BW / 3
    assert slow_path is not None
    confirms = [p for p in sim.planned(start) if p.reason == "confirm"]
    probes_of = {
        p.assignment.id for p in confirms if {p.assignment.node, p.assignment.peer} == set(slow_path)
    }
    assert len(probes_of) == 2, "the slow fresh pair is probed again"
    # The trigger's five confirms and the one pair-again: the fresh pair's results started no
    # fresh partners of their own.
    assert s.assignments_total[("tcp_pair", "confirm")] == 1 + 2 * cfg.fresh_partners + 1
