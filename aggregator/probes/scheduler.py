"""The probe scheduler: which idle node tests what with whom, so every node and link is covered.

Pure and deterministic: no clock, no I/O, no asyncio. Every call takes ``now`` (the aggregator's
clock, the report's receive time); the same calls give the same plan. The service calls it from
the event loop's thread only, so it needs no locks.

Inputs and outputs::

    observe(node, placement, idle=, now=, preflight=, address=)   once per report
    result(node, probe, placement, now)                          once per Probe in a report
    assignments_for(node, now, address=)                         the agent's poll: signed Assignments
    tick(now)                                                    planning; assignments_for calls it

**Rotation.** Time is cut into rounds of ``round_seconds`` (round ``r`` starts at
``r * round_seconds``, so a restarted or newly elected aggregator continues the rotation where
the old one was). Nodes are grouped by pool and leaf switch (else rack, else the pool alone), and
each group is paired by the circle method: the first member stays, the others rotate one place
per round, so every node meets a new partner each round and every pair of an ``n``-node group
meets once in ``n - 1`` rounds. Every ``cross_group_every``-th round instead pairs the leaves of
a pool with each other (the circle method over leaves, members matched with a rotating offset),
which is what tests the links between leaves. A pair with an end that is busy, silent (no report
for two intervals), not polling (an agent without probes), or in preflight at the round's start is
skipped; its pair stays owed: the round's pairs are started oldest-tested first, the members left
without a partner are paired among themselves, most owed (never or longest untested) first, and a
circle pair that neither end owes most gives way to such owed pairs. With everyone idle the circle
partner is always the most owed, so the (n - 1)-round bound holds. The first round after a start
(a restart, a new leader) is planned again one poll period later, once every agent has polled.

**Caps.** A probe holds its nodes from the moment it is planned until its deadline or its result,
so no node is ever in two probes. At most ``max_concurrent`` probes run fleet-wide and
``max_concurrent_per_leaf`` pair probes per leaf (else rack) of either end. Pair probes also
spend a bandwidth budget: the bytes of pair probes started in any window of
``bandwidth_window_seconds`` stay under ``bandwidth_budget_bytes_per_second`` times the window
(counting a probe's bytes at its start makes the bound hold for every window, not just sampled
ones). Local probes use no network and count only fleet-wide. What does not fit waits for a later
dispatch in the same round, in the order: preflight, confirm, rotation, local.

**Confirm re-probes.** A rotation or unscheduled pair result that failed, or whose bandwidth is
under ``suspicious_ratio`` of the pool's expected bandwidth (the median of its recent ok results of
that kind), asks for the pair again first (planned at once, holding both ends, starting
``pair_again_after_seconds`` after the result: the link localizer merges copies closer than its
``dedupe_seconds``, and a link verdict needs two slow results of the pair itself), then for
``fresh_partners`` new partners for each end: idle, in the same group if possible, not paired with
it within one full rotation; they wait for the repeat while both its ends are idle. A result that
comes before its pool has an expected bandwidth (``expected_min_results`` ok results of that
kind: the first round of a fresh or restarted scheduler) is judged once the pool has one, and
confirmed then if it was slow. Requests not served within ``confirm_within_rounds`` rounds are
dropped; a node has at most ``max_pending_confirms`` outstanding, and a pair-again request takes
the place of an end's oldest fresh-partner request when that end is at its limit. While a
pair-again waits only for its trigger to free its ends, nothing else takes them. A fresh
partner's slow result asks for that pair again and nothing more, and a pair-again's result asks
for nothing, so a bad node cannot start a storm. A probe during which an end
turned busy ("interrupted": the agent steps aside for the job) says nothing about the hardware and
is ignored for confirms and for known-good, as is a result whose error starts with the agent's
``skipped:`` or ``stepped aside:`` (``BUSY_ERROR_PREFIXES``).

**Preflight.** A node observed with ``preflight=True`` leaves the rotation until it has a verdict:
first its local probe (when ``local_kind`` is set), then a pair probe with a known-good partner
(its last ``known_good_results`` results all ok and at least ``known_good_ratio`` of the pool's
expected). Both must pass (ok, and not under ``suspicious_ratio`` of expected) for "passed"; the
first that does not makes it "failed". A probe that ends with no result is retried.

Results arrive in both ends' reports: the first copy counts, the other only frees its node.
Results are matched to probes by (node, kind, peer); results the scheduler did not plan (another
aggregator, before a restart) still count for coverage and the pool's expected bandwidth, once
per pair and kind within ``pair_again_after_seconds``.
"""

from __future__ import annotations

import heapq
import logging
import math
import statistics
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

import msgspec

from agent.errors import ConfigError
from agent.probes.protocol import Assignment, ProbeKind, Role, sign
from agent.report import GPU_GONE_CODES, Probe, Report, error_code
from aggregator.config import ProbesConfig
from aggregator.fleet.pools import Placement
from aggregator.ratelog import RateLimitedLog

log = logging.getLogger(__name__)
_ratelog: Final = RateLimitedLog(log)

__all__ = [
    "BUSY_ERROR_PREFIXES",
    "PAIR_KINDS",
    "REASONS",
    "Coverage",
    "GroupCoverage",
    "PreflightState",
    "ProbeReason",
    "ProbeScheduler",
    "ProbeView",
    "circle_round",
    "group_of",
    "report_is_idle",
]

Pair = tuple[str, str]  # sorted by name
ProbeReason = Literal["rotation", "confirm", "preflight", "local"]
REASONS: Final[tuple[ProbeReason, ...]] = ("rotation", "confirm", "preflight", "local")
PreflightState = Literal["pending", "passed", "failed"]
PAIR_KINDS: Final = frozenset({"tcp_pair", "nccl_allreduce_pair"})
# Errors the agent reports for a probe it did not run, or stopped, because the node was busy
# (docs/probes.md, "Results"): not evidence against a node or a link.
BUSY_ERROR_PREFIXES: Final = ("skipped:", "stepped aside:")

# Planning runs at most this often between round starts: agents poll hundreds of times a second
# at 7,500 nodes, and each poll would otherwise rescan the round's queue.
_DISPATCH_EVERY_S: Final = 1.0
_STALE_INTERVALS: Final = 2.0  # a node whose last report is older than this many intervals is busy
_POLL_STALE_POLLS: Final = 3.0  # a node that has not polled for this many poll periods gets nothing
_RESCUE_MAX: Final = 64  # leftovers paired by oldest pair above this many: pairs are O(n^2)


def report_is_idle(report: Report, config: ProbesConfig) -> bool:
    """Whether the node's GPUs are free for a probe: every GPU under ``idle_utilization_ratio``
    with at most ``idle_memory_bytes`` in use. A GPU that does not say (null) counts as busy:
    a probe must never land on a job. So does a node whose NVML collector says a GPU is lost or
    had no handle (``GPU_GONE_CODES``): the agent leaves such a GPU out of ``gpus``, so nothing
    says it is idle, and an all-reduce over the node's GPUs would fail on it anyway, wasting a
    healthy partner's idle minutes. Other NVML errors (a field the agent may not read) do not
    count: the fields that say "idle" are null when unreadable, which is busy already. A node
    without GPUs is idle (``tcp_pair`` nodes)."""
    if any(error_code(e) in GPU_GONE_CODES for e in report.errors or ()):
        return False
    for gpu in report.gpus:
        util, used = gpu.utilization_ratio, gpu.memory_used_bytes
        if util is None or used is None:
            return False
        if util >= config.idle_utilization_ratio or used > config.idle_memory_bytes:
            return False
    return True


def group_of(placement: Placement) -> str:
    """The node's rotation group: its leaf switch, else its rack, else its whole pool."""
    if placement.leaf:
        return f"{placement.pool}/leaf:{placement.leaf}"
    if placement.rack:
        return f"{placement.pool}/rack:{placement.rack}"
    return f"{placement.pool}/pool"


def _domain_of(placement: Placement) -> str | None:
    """The switch a pair probe loads, for the per-leaf cap; None: not capped per leaf."""
    if placement.leaf:
        return f"leaf:{placement.leaf}"
    if placement.rack:
        return f"rack:{placement.rack}"
    return None


def _pair(a: str, b: str) -> Pair:
    return (a, b) if a < b else (b, a)


def circle_round(members: Sequence[str], r: int) -> list[Pair]:
    """Round ``r`` of the circle method (round-robin tournament) over ``members``.

    The first member stays put, the others rotate by ``r`` places, and position ``i`` meets
    position ``n - 1 - i``; an odd group gets a bye (a None player). Over ``n - 1`` consecutive
    rounds (``n`` for odd groups) every pair meets exactly once.
    """
    players: list[str | None] = [*members, None] if len(members) % 2 else list(members)
    n = len(players)
    if n < 2:
        return []
    k = r % (n - 1)
    rest = players[1:]
    if k:
        rest = rest[-k:] + rest[:-k]
    order = [players[0], *rest]
    out: list[Pair] = []
    for i in range(n // 2):
        a, b = order[i], order[n - 1 - i]
        if a is not None and b is not None:
            out.append(_pair(a, b))
    return out


@dataclass(frozen=True)
class ProbeView:
    """A planned probe as the API and tests see it."""

    id: str
    kind: ProbeKind
    reason: ProbeReason
    nodes: tuple[str, ...]
    not_before: float
    deadline: float
    size_bytes: int


@dataclass(frozen=True)
class GroupCoverage:
    pool: str
    group: str
    nodes: int
    pairs: int  # n(n-1)/2
    pairs_tested: int  # tested ok within the bound

    @property
    def ratio(self) -> float:
        return self.pairs_tested / self.pairs if self.pairs else 1.0


@dataclass(frozen=True)
class Coverage:
    bound_seconds: float
    node_untested_seconds: dict[str, float]  # since the last ok probe (or since first seen)
    groups: dict[str, GroupCoverage]

    @property
    def nodes_overdue(self) -> int:
        return sum(1 for s in self.node_untested_seconds.values() if s > self.bound_seconds)

    def pool_ratios(self) -> dict[str, float]:
        """Share of each pool's within-group pairs tested within the bound."""
        tested: Counter[str] = Counter()
        total: Counter[str] = Counter()
        for g in self.groups.values():
            tested[g.pool] += g.pairs_tested
            total[g.pool] += g.pairs
        return {pool: (tested[pool] / total[pool] if total[pool] else 1.0) for pool in sorted(total)}


@dataclass
class _Node:
    name: str
    placement: Placement
    group: str
    domain: str | None
    idle: bool
    seen: float
    first_seen: float
    held: str | None = None  # the probe holding it
    last_ok: float | None = None
    last_local: float = -math.inf  # when its last local probe was planned
    in_preflight: bool = False  # as last observed
    preflight: _Preflight | None = None
    recent: deque[tuple[str, bool, float | None]] = field(default_factory=deque)  # (kind, ok, busbw)


@dataclass
class _Preflight:
    started: float
    state: PreflightState = "pending"
    local: dict[str, object] | None = None  # the local result's evidence
    pair: dict[str, object] | None = None
    running: str | None = None  # the preflight probe in flight
    partner: str | None = None
    note: str = ""


@dataclass
class _Probe:
    id: str
    kind: ProbeKind
    reason: ProbeReason
    nodes: tuple[str, ...]
    pool: str
    domains: tuple[str, ...]
    created: float
    not_before: float
    deadline: float
    size_bytes: int
    assignments: dict[str, Assignment]
    open_ends: set[str]
    preflight_node: str | None = None
    result_seen: bool = False
    interrupted: bool = False  # an end turned busy while it ran
    fresh: bool = False  # a confirm's fresh partner: slow, it asks for the pair again, nothing more
    cancelled: bool = False  # an end turned busy before it started

    def peer_of(self, node: str) -> str | None:
        others = [n for n in self.nodes if n != node]
        return others[0] if others else None

    def view(self) -> ProbeView:
        return ProbeView(
            self.id, self.kind, self.reason, self.nodes, self.not_before, self.deadline, self.size_bytes
        )


@dataclass
class _Confirm:
    node: str
    peer: str | None  # None: a fresh partner
    not_before: float
    expires: float
    exclude: set[str]  # shared by the requests of one trigger: partners already chosen
    start_at: float | None = None  # the pair again: its probe starts no earlier than this
    repeat: _Confirm | None = None  # a fresh partner's: the trigger's pair-again request
    trigger: str | None = None  # the pair again's: the planned probe whose result asked for it
    done: bool = False  # served or expired


class ProbeScheduler:
    """See the module docstring. ``key`` signs every assignment (the agents' probe key)."""

    def __init__(self, config: ProbesConfig, key: bytes, *, report_interval_seconds: float = 10.0) -> None:
        if not key:
            raise ConfigError("the probe key is empty: assignments must be signed with a secret")
        if report_interval_seconds <= 0:
            raise ConfigError(f"report interval must be positive, got {report_interval_seconds}")
        self.config = config
        self._key = key
        self._stale_s = _STALE_INTERVALS * report_interval_seconds
        self._poll_stale_s = _POLL_STALE_POLLS * config.poll_seconds
        self._nodes: dict[str, _Node] = {}
        self._polled: dict[str, float] = {}
        self._addresses: dict[str, str] = {}
        self._groups: dict[str, list[str]] = {}
        self._pools: dict[str, list[str]] = {}  # pool -> sorted group names
        self._groups_dirty = True
        self._round: int | None = None
        self._first_tick: float | None = None
        self._provisional = False
        self._next_dispatch = -math.inf
        self._rotation: list[Pair] = []
        self._locals: list[str] = []
        self._confirms: list[_Confirm] = []
        # This dispatch's unserved pair-again requests by end (``_reserved``).
        self._repeats_of: dict[str, list[_Confirm]] = {}
        self._pending: Counter[str] = Counter()  # outstanding confirm requests per node
        self._in_flight: dict[str, _Probe] = {}
        self._deadlines: list[tuple[float, str]] = []
        self._ended: dict[tuple[str, str, str | None], _Probe] = {}
        self._unplanned: dict[tuple[Pair | str, str], float] = {}
        self.unknown_peer_results = 0  # results ignored: their peer is no node of the fleet
        self._per_domain: Counter[str] = Counter()
        self._bandwidth: deque[tuple[float, int]] = deque()
        self._bandwidth_bytes = 0
        self._tested: dict[Pair, float] = {}  # last ok result per pair
        self._paired: dict[Pair, float] = {}  # last planned per pair
        self._expected: dict[tuple[str, str], deque[float]] = {}
        self._expected_cache: dict[tuple[str, str], float | None] = {}
        # Pair results that came before their pool's expected bandwidth was known (its first
        # results, or the first after a restart): (a, b, bytes/s, when), judged once it is. At
        # most expected_min_results per (pool, kind): each of them is also one of those results.
        self._unjudged: dict[tuple[str, str], list[tuple[str, str, float, float]]] = {}
        self._id_prefix: str | None = None
        self._seq = 0
        self.assignments_total: Counter[tuple[str, ProbeReason]] = Counter()
        self.results_total: Counter[tuple[str, bool]] = Counter()

    # -- inputs -----------------------------------------------------------------------------------

    def observe(
        self,
        node: str,
        placement: Placement,
        *,
        idle: bool,
        now: float,
        preflight: bool = False,
        address: str | None = None,
    ) -> None:
        """One report (or poll) of ``node``: where it sits, whether its GPUs are idle, whether it
        carries the preflight taint, and where its probe endpoint listens."""
        n = self._nodes.get(node)
        if n is None:
            n = _Node(node, placement, group_of(placement), _domain_of(placement), idle, now, now)
            self._nodes[node] = n
            self._groups_dirty = True
        elif placement != n.placement:
            group = group_of(placement)
            if group != n.group:
                self._groups_dirty = True
            n.placement, n.group, n.domain = placement, group, _domain_of(placement)
        n.idle = idle
        n.seen = max(n.seen, now)
        if address:
            self._addresses[node] = address
        if preflight and not n.in_preflight:
            n.preflight = _Preflight(started=now)
            log.info("preflight probes wanted", extra={"node": node})
        n.in_preflight = preflight
        if not idle and n.held is not None:
            probe = self._in_flight[n.held]
            if now < probe.not_before:
                # Not started yet: give the slot and the partner back rather than make the
                # partner wait for a peer that will not come.
                probe.cancelled = True
                self._finish(probe)
            else:
                probe.interrupted = True

    def result(self, report_node: str, probe: Probe, placement: Placement, now: float) -> bool:
        """One probe result from ``report_node``'s report (both ends report a pair probe); False
        when it counts for nothing, so nobody else may keep it either.

        A result counts when the scheduler assigned the probe, or (a probe planned before a
        restart) when both ends are nodes it knows: a node cannot make state out of peers that do
        not exist, so what the results cost is bounded by the fleet, not by what one token sends.
        """
        pair_kind = probe.kind in PAIR_KINDS
        peer = probe.peer if pair_kind else None
        if pair_kind and (peer is None or peer == report_node):
            log.debug("pair probe result without a usable peer", extra={"node": report_node})
            return False
        planned = self._match(report_node, probe.kind, peer, now)
        if planned is None and peer is not None and peer not in self._nodes:
            self.unknown_peer_results += 1
            _ratelog.warning(
                "probe_unknown_peer",
                "probe result naming a peer that is no node of the fleet ignored",
                extra={"node": report_node, "ignored_total": self.unknown_peer_results},
            )
            return False
        n = self._nodes.get(report_node)
        if planned is not None:
            first = not planned.result_seen and not planned.cancelled
            planned.result_seen = True
            if n is not None and n.held == planned.id:
                n.held = None
                planned.open_ends.discard(report_node)
                if not planned.open_ends and planned.id in self._in_flight:
                    self._finish(planned)
            if not first:
                return True  # the other end's copy, or a probe called off before it started
        else:
            key: tuple[Pair | str, str] = (_pair(report_node, peer) if peer else report_node, probe.kind)
            last = self._unplanned.get(key)
            if last is not None and abs(now - last) < self.config.pair_again_after_seconds:
                return True
            self._unplanned[key] = now
        ends = (report_node, peer) if peer else (report_node,)
        self._record(ends, placement.pool, probe, planned, now)
        return True

    # -- outputs ----------------------------------------------------------------------------------

    def assignments_for(self, node: str, now: float, *, address: str | None = None) -> list[Assignment]:
        """The node's signed assignments (its poll). Polling is what makes a node schedulable:
        a node whose agent does not poll (no probe support) is never given a partner."""
        self._polled[node] = now
        if address:
            self._addresses[node] = address
        self.tick(now)
        n = self._nodes.get(node)
        if n is None or n.held is None:
            return []
        return [self._in_flight[n.held].assignments[node]]

    def tick(self, now: float) -> None:
        """Expire probes, start a round when one is due, and plan what fits now."""
        if not self.config.enabled:
            return
        self._expire(now)
        if self._first_tick is None:
            self._first_tick = now
        r = math.floor(now / self.config.round_seconds)
        started = False
        if r != self._round or (self._provisional and now >= self._first_tick + self.config.poll_seconds):
            # A round planned in the first poll period after a start (a restart, a new leader)
            # saw only the agents that had polled by then: plan it again once all have had time.
            self._provisional = now < self._first_tick + self.config.poll_seconds
            self._start_round(r, now)
            started = True
        if started or now >= self._next_dispatch:
            self._next_dispatch = now + _DISPATCH_EVERY_S
            self._dispatch(now)

    def preflight_status(self, node: str) -> tuple[PreflightState, dict[str, object]]:
        """The node's preflight verdict from its preflight probes, with the evidence."""
        n = self._nodes.get(node)
        if n is None or n.preflight is None:
            return "pending", {"note": "no preflight requested for this node"}
        pf = n.preflight
        evidence: dict[str, object] = {"started": pf.started}
        if pf.local is not None:
            evidence["local"] = pf.local
        if pf.pair is not None:
            evidence["pair"] = pf.pair
        if pf.partner is not None:
            evidence["partner"] = pf.partner
        if pf.note:
            evidence["note"] = pf.note
        return pf.state, evidence

    def in_flight(self) -> list[ProbeView]:
        return [p.view() for p in self._in_flight.values()]

    def probe(self, probe_id: str) -> ProbeView | None:
        p = self._in_flight.get(probe_id)
        return p.view() if p is not None else None

    def coverage(self, now: float) -> Coverage:
        """Per node, seconds since its last ok probe; per group, the share of its pairs tested
        ok within ``coverage_bound_seconds``. Costs one pass over nodes and tested pairs."""
        bound = self.config.coverage_bound_seconds
        untested = {
            name: now - (n.last_ok if n.last_ok is not None else n.first_seen)
            for name, n in self._nodes.items()
        }
        groups = self._group_members()
        tested: Counter[str] = Counter()
        since = now - bound
        for (a, b), t in self._tested.items():
            if t < since:
                continue
            na, nb = self._nodes.get(a), self._nodes.get(b)
            if na is not None and nb is not None and na.group == nb.group:
                tested[na.group] += 1
        out: dict[str, GroupCoverage] = {}
        for g, members in groups.items():
            size = len(members)
            pool = self._nodes[members[0]].placement.pool
            out[g] = GroupCoverage(pool, g, size, size * (size - 1) // 2, tested[g])
        return Coverage(bound, untested, out)

    @property
    def in_flight_count(self) -> int:
        return len(self._in_flight)

    # -- rounds -----------------------------------------------------------------------------------

    def _start_round(self, r: int, now: float) -> None:
        self._round = r
        self._forget(now)
        groups = self._group_members()
        k = self.config.cross_group_every
        within = r - (r // k if k else 0)  # rounds of in-group pairing before this one
        cross = k > 0 and r % k == k - 1
        pairs: list[Pair] = []
        if cross:
            pairs = self._cross_pairs(r // k, within, groups, now)
        else:
            for members in groups.values():
                pairs.extend(self._group_pairs(members, within, now))
        never = -math.inf
        self._rotation = sorted(pairs, key=lambda p: (self._tested.get(p, never), p))
        self._locals = []
        if self.config.local_kind is not None:
            due = now - self.config.local_every_seconds
            self._locals = sorted(
                (name for name, n in self._nodes.items() if n.last_local <= due),
                key=lambda name: (self._nodes[name].last_local, name),
            )
        log.debug(
            "probe round planned",
            extra={"round": r, "cross": cross, "pairs": len(self._rotation), "locals": len(self._locals)},
        )

    def _group_pairs(self, members: list[str], within: int, now: float) -> list[Pair]:
        usable = {m for m in members if self._rotatable(self._nodes[m], now)}
        never = -math.inf
        circle = [p for p in circle_round(members, within) if p[0] in usable and p[1] in usable]
        if len(members) <= _RESCUE_MAX:
            # A circle pair that is neither end's most owed partner (each has a usable partner
            # untested for longer, as after rounds with busy members) gives its ends to the
            # leftovers, which meet most-owed first. With everyone idle the circle partner is
            # always the most owed, so the circle's coverage bound holds.
            tested = self._tested
            if any(p in tested for p in circle):
                ordered = sorted(usable)
                low = [math.inf] * len(ordered)
                get = tested.get
                # The group's pairs once each; plain comparisons, as min() calls cost twice as much
                # here and this loop is most of a round's planning at 7,500 nodes.
                for i, a in enumerate(ordered):
                    la = low[i]
                    for j in range(i + 1, len(ordered)):
                        t = get((a, ordered[j]), never)
                        if t < la:  # noqa: PLR1730
                            la = t
                        if t < low[j]:  # noqa: PLR1730
                            low[j] = t
                    low[i] = la
                oldest = dict(zip(ordered, low, strict=True))
                circle = [p for p in circle if tested.get(p, never) <= max(oldest[p[0]], oldest[p[1]])]
        pairs = circle
        left = usable.difference(*pairs)
        if len(left) >= 2:
            pairs.extend(self._rescue(sorted(left)))
        return pairs

    def _rescue(self, left: list[str]) -> list[Pair]:
        """Pair the members whose circle partner is away: owed (never or longest untested) first."""
        if len(left) > _RESCUE_MAX:
            return [_pair(left[i], left[i + 1]) for i in range(0, len(left) - 1, 2)]
        never = -math.inf
        candidates = sorted(
            (_pair(a, b) for i, a in enumerate(left) for b in left[i + 1 :]),
            key=lambda p: (self._tested.get(p, never), p),
        )
        taken: set[str] = set()
        out: list[Pair] = []
        for a, b in candidates:
            if a not in taken and b not in taken:
                taken.update((a, b))
                out.append((a, b))
        return out

    def _cross_pairs(self, c: int, within: int, groups: dict[str, list[str]], now: float) -> list[Pair]:
        """A cross round: the circle method over each pool's groups; members of two groups that
        meet are matched with an offset that moves once all groups have met."""
        out: list[Pair] = []
        for names in self._pools.values():
            if len(names) < 2:
                # One group only: nothing to cross, so an ordinary round.
                out.extend(self._group_pairs(groups[names[0]], within, now))
                continue
            offset = c // max(1, len(names) - 1 + len(names) % 2)
            for ga, gb in circle_round(names, c):
                ma = [m for m in groups[ga] if self._rotatable(self._nodes[m], now)]
                mb = [m for m in groups[gb] if self._rotatable(self._nodes[m], now)]
                if not ma or not mb:
                    continue
                if len(ma) > len(mb):
                    ma, mb = mb, ma
                out.extend(_pair(a, mb[(i + offset) % len(mb)]) for i, a in enumerate(ma))
        return out

    def _group_members(self) -> dict[str, list[str]]:
        if self._groups_dirty:
            groups: dict[str, list[str]] = {}
            for name in sorted(self._nodes):
                groups.setdefault(self._nodes[name].group, []).append(name)
            pools: dict[str, list[str]] = {}
            for g in sorted(groups):
                pools.setdefault(self._nodes[groups[g][0]].placement.pool, []).append(g)
            self._groups, self._pools = groups, pools
            self._groups_dirty = False
        return self._groups

    def _forget(self, now: float) -> None:
        limit = now - self.config.forget_after_seconds
        gone = [name for name, n in self._nodes.items() if n.seen < limit and n.held is None]
        for name in gone:
            log.info("node left the probe rotation (silent)", extra={"node": name})
            del self._nodes[name]
            self._polled.pop(name, None)
            self._addresses.pop(name, None)
            self._groups_dirty = True
        if gone:
            gone_set = set(gone)
            self._confirms = [c for c in self._confirms if not self._drop_confirm_if(c, gone_set)]
        # Pair history is pruned (forgotten nodes, twice the coverage bound) every 16 rounds: it
        # is the largest map here, and a few stale entries cost nothing meanwhile.
        if gone or self._round is None or self._round % 16 == 0:
            keep_after = now - 2 * self.config.coverage_bound_seconds
            nodes = self._nodes
            self._tested = {
                p: t for p, t in self._tested.items() if t >= keep_after and p[0] in nodes and p[1] in nodes
            }
        recent = now - self.config.round_seconds * self._largest_group()
        self._paired = {p: t for p, t in self._paired.items() if t >= recent}
        grace = self.config.round_seconds
        self._ended = {k: p for k, p in self._ended.items() if p.deadline + grace >= now}
        again = self.config.pair_again_after_seconds
        self._unplanned = {k: t for k, t in self._unplanned.items() if now - t < again}

    def _largest_group(self) -> int:
        return max((len(m) for m in self._group_members().values()), default=1)

    # -- eligibility and caps -----------------------------------------------------------------------

    def _ready(self, n: _Node, now: float) -> bool:
        """Idle, reporting, polling, and in no probe: it may be given one now."""
        return n.held is None and self._rotatable(n, now)

    def _rotatable(self, n: _Node, now: float) -> bool:
        return (
            n.idle
            and now - n.seen <= self._stale_s
            and now - self._polled.get(n.name, -math.inf) <= self._poll_stale_s
            and not self._preflight_pending(n)
        )

    @staticmethod
    def _preflight_pending(n: _Node) -> bool:
        return n.in_preflight and n.preflight is not None and n.preflight.state == "pending"

    def _addressable(self, a: str, b: str) -> bool:
        # A TCP probe needs one end to serve; NCCL meets through the rendezvous.
        return self.config.pair_kind != "tcp_pair" or a in self._addresses or b in self._addresses

    def _fits(self, domains: Iterable[str], pair: bool, now: float) -> bool:
        cfg = self.config
        if len(self._in_flight) >= cfg.max_concurrent:
            return False
        if not pair:
            return True
        if any(self._per_domain[d] >= cfg.max_concurrent_per_leaf for d in domains):
            return False
        window = cfg.bandwidth_window_seconds
        while self._bandwidth and self._bandwidth[0][0] <= now + cfg.start_delay_seconds - window:
            self._bandwidth_bytes -= self._bandwidth.popleft()[1]
        return self._bandwidth_bytes + cfg.pair_size_bytes <= cfg.bandwidth_budget_bytes_per_second * window

    def _pair_domains(self, a: str, b: str) -> tuple[str, ...]:
        da, db = self._nodes[a].domain, self._nodes[b].domain
        return tuple(sorted({d for d in (da, db) if d is not None}))

    def _try_pair(
        self,
        a: str,
        b: str,
        reason: ProbeReason,
        now: float,
        preflight_node: str | None = None,
        *,
        start_at: float | None = None,
        fresh: bool = False,
    ) -> bool:
        na, nb = self._nodes.get(a), self._nodes.get(b)
        if na is None or nb is None:
            return False
        ready_a = self._ready(na, now) or (
            preflight_node == a and na.held is None and self._idle_now(na, now)
        )
        ready_b = self._ready(nb, now) or (
            preflight_node == b and nb.held is None and self._idle_now(nb, now)
        )
        if not (ready_a and ready_b and self._addressable(a, b)):
            return False
        if not self._fits(self._pair_domains(a, b), True, now):
            return False
        kind = self.config.pair_kind
        self._launch(kind, reason, (a, b), now, preflight_node, start_at=start_at, fresh=fresh)
        return True

    def _idle_now(self, n: _Node, now: float) -> bool:
        return (
            n.idle
            and now - n.seen <= self._stale_s
            and now - self._polled.get(n.name, -math.inf) <= self._poll_stale_s
        )

    # -- dispatch ---------------------------------------------------------------------------------

    def _dispatch(self, now: float) -> None:
        self._dispatch_preflight(now)
        self._dispatch_confirms(now)
        if len(self._in_flight) < self.config.max_concurrent:
            kept = bool(self._repeats_of)  # none waiting (most dispatches): nothing to look up
            self._rotation = [
                p
                for p in self._rotation
                if (kept and (self._reserved(p[0], now) or self._reserved(p[1], now)))
                or not self._try_pair(p[0], p[1], "rotation", now)
            ]
        kind = self.config.local_kind
        if kind is not None and len(self._in_flight) < self.config.max_concurrent:
            keep: list[str] = []
            due = now - self.config.local_every_seconds
            for name in self._locals:
                n = self._nodes.get(name)
                if n is None or n.last_local > due:
                    continue  # gone, or tested since the round began (its preflight)
                if not self._reserved(name, now) and self._ready(n, now) and self._fits((), False, now):
                    self._launch(kind, "local", (name,), now)
                else:
                    keep.append(name)
            self._locals = keep

    def _dispatch_preflight(self, now: float) -> None:
        for name in sorted(n.name for n in self._nodes.values() if self._preflight_pending(n)):
            n = self._nodes[name]
            pf = n.preflight
            if pf is None or pf.running is not None or n.held is not None or not self._idle_now(n, now):
                continue
            local_kind = self.config.local_kind
            if local_kind is not None and pf.local is None:
                if self._fits((), False, now):
                    pf.running = self._launch(local_kind, "preflight", (name,), now, name).id
                continue
            partner = self._known_good_partner(n, now)
            if partner is None:
                pf.note = f"waiting for a known-good partner in pool {n.placement.pool}"
                continue
            if self._try_pair(name, partner, "preflight", now, name):
                pf.running = n.held
                pf.partner = partner
                pf.note = ""

    def _known_good_partner(self, n: _Node, now: float) -> str | None:
        """A ready node of the same pool whose recent results were all ok and near the pool's
        expected bandwidth: its own group first, then the pool, least recently paired first."""
        self._group_members()
        pool = n.placement.pool
        for groups in ([n.group], [g for g in self._pools.get(pool, []) if g != n.group]):
            best: tuple[float, str] | None = None
            for g in groups:
                for m in self._groups.get(g, []):
                    other = self._nodes[m]
                    if m == n.name or not self._ready(other, now) or not self._known_good(other):
                        continue
                    if not self._addressable(n.name, m):
                        continue
                    key = (self._paired.get(_pair(n.name, m), -math.inf), m)
                    if best is None or key < best:
                        best = key
            if best is not None:
                return best[1]
        return None

    def _known_good(self, n: _Node) -> bool:
        cfg = self.config
        if len(n.recent) < cfg.known_good_results:
            return False
        for kind, ok, busbw in n.recent:
            if not ok:
                return False
            if busbw is None:
                continue  # ok, nothing to compare (a one-GPU local probe)
            expected = self._expected_of(n.placement.pool, kind)
            if expected is None or busbw < cfg.known_good_ratio * expected:
                return False
        return True

    def _dispatch_confirms(self, now: float) -> None:
        # A pair-again waiting only for its trigger's other copy to free an end (a second or two)
        # keeps both ends: taken in the meantime by another node's fresh partner or by the
        # rotation, its ends are rarely free together again before it expires, and the slow path
        # goes unconfirmed for a whole rotation (seen on the network-namespace test: a partner of
        # a bad node, asked as a fresh partner on every one of the bad node's results).
        self._repeats_of = {}
        for r in self._confirms:
            if r.peer is not None and not r.done and now < r.expires:
                for end in (r.node, r.peer):
                    self._repeats_of.setdefault(end, []).append(r)
        keep: list[_Confirm] = []
        for req in self._confirms:
            # Served or expired, a request stops counting against its nodes' pending limit.
            if now >= req.expires or (now >= req.not_before and self._serve_confirm(req, now)):
                req.done = True
                self._release_confirm(req)
            else:
                keep.append(req)
        self._confirms = keep

    def _serve_confirm(self, req: _Confirm, now: float) -> bool:
        x = self._nodes.get(req.node)
        if x is None or not self._ready(x, now):
            return False
        rep = req.repeat
        if rep is not None and not rep.done and self._repeat_possible(rep, now):
            return False  # the pair again goes first
        if req.peer is not None:
            return self._try_pair(req.node, req.peer, "confirm", now, start_at=req.start_at)
        if self._reserved(req.node, now):
            return False  # its end of another trigger's pair-again goes first
        partner = self._fresh_partner(x, req.exclude, now)
        if partner is None or not self._try_pair(req.node, partner, "confirm", now, fresh=True):
            return False
        req.exclude.add(partner)
        return True

    def _repeat_possible(self, rep: _Confirm, now: float) -> bool:
        """Whether the pair-again request can still run soon: both ends idle and heard from (one
        may be held for a few seconds more by the probe that triggered it)."""
        ends = [self._nodes.get(name) for name in (rep.node, rep.peer) if name is not None]
        return all(n is not None and self._idle_now(n, now) for n in ends)

    def _reserved(self, name: str, now: float) -> bool:
        """Whether ``name`` is kept for a pair-again request waiting only for its trigger."""
        return any(not r.done and self._repeat_waiting(r, now) for r in self._repeats_of.get(name, ()))

    def _repeat_waiting(self, rep: _Confirm, now: float) -> bool:
        """Whether the pair-again request waits only for its trigger to free its ends: it could
        run soon (``_repeat_possible``), each end in no probe or still in the one whose result
        asked for it."""
        if not self._repeat_possible(rep, now):
            return False
        return all(self._nodes[name].held in (None, rep.trigger) for name in (rep.node, rep.peer) if name)

    def _fresh_partner(self, x: _Node, exclude: set[str], now: float) -> str | None:
        """Idle, not excluded, not paired with ``x`` within one full rotation of its group; the
        least recently tested pair first (owed pairs gain), its own group before the pool."""
        self._group_members()
        window = self.config.round_seconds * max(1, len(self._groups.get(x.group, ())) - 1)
        since = now - window
        never = -math.inf
        for groups in ([x.group], [g for g in self._pools.get(x.placement.pool, []) if g != x.group]):
            best: tuple[float, str] | None = None
            for g in groups:
                for m in self._groups.get(g, []):
                    if m == x.name or m in exclude or self._reserved(m, now):
                        continue
                    pair = _pair(x.name, m)
                    if self._paired.get(pair, never) >= since:
                        continue
                    if not self._ready(self._nodes[m], now) or not self._addressable(x.name, m):
                        continue
                    if not self._fits(self._pair_domains(x.name, m), True, now):
                        continue
                    key = (self._tested.get(pair, never), m)
                    if best is None or key < best:
                        best = key
            if best is not None:
                return best[1]
        return None

    def _displaceable(self, end: str, limit: int) -> list[_Confirm] | None:
        """``end``'s oldest unserved fresh-partner requests to drop to bring it under ``limit``
        ([]: it is under; None: its limit is held by pair-again requests, which are not dropped).

        Only a pair-again request displaces: it is the one confirm a link verdict cannot do
        without, while fresh partners are more of what the rotation brings anyway. Without this a
        partner of a bad node, whose every result asks fresh partners for both ends, is kept at
        its limit by those, and the pair-again of its own slow path is not planned: that path is
        met again only a rotation later. Pair-again requests stay bounded: one per suspicious
        rotation or unplanned result, each expiring after ``confirm_within_rounds``."""
        need = self._pending[end] - limit + 1
        if need <= 0:
            return []
        fresh = [c for c in self._confirms if c.node == end and c.peer is None and not c.done]
        if len(fresh) < need:
            return None
        return sorted(fresh, key=lambda c: c.not_before)[:need]

    def _release_confirm(self, req: _Confirm) -> None:
        for end in (req.node, req.peer):
            if end is not None:
                self._pending[end] -= 1
                if self._pending[end] <= 0:
                    del self._pending[end]

    def _drop_confirm_if(self, req: _Confirm, gone: set[str]) -> bool:
        if req.node in gone or req.peer in gone:
            self._release_confirm(req)
            return True
        return False

    # -- probes -----------------------------------------------------------------------------------

    def _launch(
        self,
        kind: ProbeKind,
        reason: ProbeReason,
        nodes: tuple[str, ...],
        now: float,
        preflight_node: str | None = None,
        *,
        start_at: float | None = None,
        fresh: bool = False,
    ) -> _Probe:
        cfg = self.config
        if self._id_prefix is None:
            # Ids stay unique across restarts and failovers: the prefix is the first planning time.
            self._id_prefix = f"{int(now * 1000):x}"
        self._seq += 1
        pid = f"{self._id_prefix}-{self._seq:x}"
        pair = len(nodes) == 2
        not_before = max(now + cfg.start_delay_seconds, start_at if start_at is not None else -math.inf)
        deadline = not_before + (cfg.pair_deadline_seconds if pair else cfg.local_deadline_seconds)
        size = cfg.pair_size_bytes if pair else cfg.local_size_bytes
        base = Assignment(
            id=pid,
            kind=kind,
            node=nodes[0],
            role="local",
            not_before=not_before,
            deadline=deadline,
            size_bytes=size,
        )
        assignments: dict[str, Assignment] = {}
        if not pair:
            assignments[nodes[0]] = sign(base, self._key)
        else:
            a, b = nodes
            if kind == "tcp_pair":
                server = b if b in self._addresses else a
                ranks: dict[str, int | None] = {a: None, b: None}
            else:
                server = a  # rank 0 publishes the NCCL unique id
                ranks = {a: 0, b: 1}
            client = b if server == a else a
            roles: dict[str, Role] = {server: "server", client: "client"}
            for end, peer in ((a, b), (b, a)):
                one = msgspec.structs.replace(
                    base,
                    node=end,
                    role=roles[end],
                    peer=peer,
                    peer_address=self._addresses.get(server) if end == client else None,
                    rank=ranks[end],
                )
                assignments[end] = sign(one, self._key)
            pr = _pair(a, b)
            self._paired[pr] = now
            self._bandwidth.append((not_before, size))
            self._bandwidth_bytes += size
        first = self._nodes[nodes[0]]
        probe = _Probe(
            id=pid,
            kind=kind,
            reason=reason,
            nodes=nodes,
            pool=first.placement.pool,
            domains=self._pair_domains(*nodes) if pair else (),
            created=now,
            not_before=not_before,
            deadline=deadline,
            size_bytes=size,
            assignments=assignments,
            open_ends=set(nodes),
            preflight_node=preflight_node,
            fresh=fresh,
        )
        for n in nodes:
            self._nodes[n].held = pid
        if not pair:
            first.last_local = now
        for d in probe.domains:
            self._per_domain[d] += 1
        self._in_flight[pid] = probe
        heapq.heappush(self._deadlines, (deadline, pid))
        self.assignments_total[(kind, reason)] += 1
        return probe

    def _expire(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            _, pid = heapq.heappop(self._deadlines)
            probe = self._in_flight.get(pid)
            if probe is not None:
                self._finish(probe)

    def _finish(self, probe: _Probe) -> None:
        """The probe no longer holds anything: its result is in, its deadline passed, or it was
        called off. Late copies of its result still find it in ``_ended``."""
        del self._in_flight[probe.id]
        for d in probe.domains:
            self._per_domain[d] -= 1
            if self._per_domain[d] <= 0:
                del self._per_domain[d]
        for end in probe.nodes:
            n = self._nodes.get(end)
            if n is not None and n.held == probe.id:
                n.held = None
            self._ended[(end, probe.kind, probe.peer_of(end))] = probe
        if not probe.result_seen:
            self._preflight_retry(probe)  # no result: try again

    def _preflight_retry(self, probe: _Probe) -> None:
        if probe.preflight_node is None:
            return
        n = self._nodes.get(probe.preflight_node)
        if n is not None and n.preflight is not None and n.preflight.running == probe.id:
            n.preflight.running = None

    def _match(self, node: str, kind: str, peer: str | None, now: float) -> _Probe | None:
        n = self._nodes.get(node)
        if n is not None and n.held is not None:
            probe = self._in_flight[n.held]
            if probe.kind == kind and probe.peer_of(node) == peer and now >= probe.not_before:
                return probe
        return self._ended.get((node, kind, peer))

    # -- results ----------------------------------------------------------------------------------

    def _expected_of(self, pool: str, kind: str) -> float | None:
        key = (pool, kind)
        if key not in self._expected_cache:
            samples = self._expected.get(key)
            ok = samples is not None and len(samples) >= self.config.expected_min_results
            self._expected_cache[key] = statistics.median(samples) if ok and samples else None
        return self._expected_cache[key]

    def _record(
        self, ends: tuple[str, ...], pool: str, probe: Probe, planned: _Probe | None, now: float
    ) -> None:
        cfg = self.config
        self.results_total[(probe.kind, probe.ok)] += 1
        expected = self._expected_of(pool, probe.kind)
        ok = probe.ok
        # None: ok without a bandwidth (a one-GPU node's local all-reduce has no bus traffic).
        busbw = probe.busbw_bytes_per_second if probe.busbw_bytes_per_second else None
        slow = ok and busbw is not None and expected is not None and busbw < cfg.suspicious_ratio * expected
        # A probe that did not run or stopped for a job (the agent's "skipped: " and "stepped
        # aside: " errors) says nothing about the hardware.
        stood_down = (planned is not None and planned.interrupted) or (
            not ok and (probe.error or "").startswith(BUSY_ERROR_PREFIXES)
        )
        if ok and busbw is not None:
            samples = self._expected.setdefault((pool, probe.kind), deque(maxlen=cfg.expected_results))
            samples.append(busbw)
            self._expected_cache.pop((pool, probe.kind), None)
        if ok and len(ends) == 2:
            self._tested[_pair(ends[0], ends[1])] = now
        for end in ends:
            n = self._nodes.get(end)
            if n is None:
                continue
            if ok:
                n.last_ok = now
            if not stood_down:
                n.recent.append((probe.kind, ok, busbw))
                while len(n.recent) > cfg.known_good_results:
                    n.recent.popleft()
        if planned is not None and planned.preflight_node is not None:
            if stood_down:
                self._preflight_retry(planned)
            else:
                self._preflight_result(planned, probe, ok and not slow, expected, now)
            return
        reason = planned.reason if planned is not None else None
        confirmable = len(ends) == 2 and reason in (None, "rotation") and not stood_down
        # A fresh partner's result may be the first of a slow path between two nodes that are
        # fine elsewhere (a partner of a bad node, given a fresh partner across a slow link): a
        # link verdict needs two results of the pair, and otherwise the second comes a rotation
        # later, if the bad node's confirms leave the pair a turn at all. It asks for the pair
        # again only; a pair-again's result asks for nothing.
        again_only = len(ends) == 2 and planned is not None and planned.fresh and not stood_down
        if confirmable and ok and busbw is not None and expected is None:
            self._unjudged.setdefault((pool, probe.kind), []).append((ends[0], ends[1], busbw, now))
        self._judge_unjudged(pool, probe.kind, now)
        if (confirmable or again_only) and (not ok or slow):
            self._confirm(
                ends[0],
                ends[1],
                now,
                kind=probe.kind,
                ok=probe.ok,
                busbw=busbw,
                expected=expected,
                trigger=None if planned is None else planned.id,
                again_only=again_only,
            )

    def _judge_unjudged(self, pool: str, kind: str, now: float) -> None:
        """Confirm the pool's early results that its expected bandwidth, now known, calls slow.

        A slow pair in the first round of a fresh or restarted scheduler would otherwise wait a
        whole rotation for its second result (the link localizer needs two): minutes the fault
        is visible and nothing is asked. Results older than the confirm window are let go."""
        cfg = self.config
        key = (pool, kind)
        waiting = self._unjudged.get(key)
        if not waiting:
            return
        expected = self._expected_of(pool, kind)
        if expected is None:
            return
        del self._unjudged[key]
        horizon = now - cfg.confirm_within_rounds * cfg.round_seconds
        for a, b, busbw, at in waiting:
            if at < horizon or busbw >= cfg.suspicious_ratio * expected:
                continue
            if a in self._nodes and b in self._nodes:  # not forgotten since
                self._confirm(a, b, now, kind=kind, ok=True, busbw=busbw, expected=expected, late_s=now - at)

    def _confirm(
        self,
        a: str,
        b: str,
        now: float,
        *,
        kind: str,
        ok: bool,
        busbw: float | None,
        expected: float | None,
        late_s: float = 0.0,
        trigger: str | None = None,
        again_only: bool = False,
    ) -> None:
        """Plan the confirms of a suspicious pair result (``late_s``: judged that long after it
        came; ``trigger``: the planned probe it is the result of)."""
        log.info(
            "suspicious pair probe: confirming",
            extra={
                "node": a,
                "peer": b,
                "probe_kind": kind,
                "ok": ok,
                "busbw": busbw,
                "expected": expected,
                "judged_late_seconds": round(late_s, 1),
            },
        )
        self._plan_confirms(a, b, now, trigger, again_only=again_only)

    def _plan_confirms(
        self, a: str, b: str, now: float, trigger: str | None = None, *, again_only: bool = False
    ) -> None:
        cfg = self.config
        expires = now + cfg.confirm_within_rounds * cfg.round_seconds
        exclude = {a, b}
        # The pair again is what a link verdict needs most (the localizer wants two slow results
        # of the pair itself), and its ends may be busy again soon: it is planned first and at
        # once, holding both ends, with its start pair_again_after_seconds after this result so
        # the localizer does not take it for a copy. The fresh partners wait for it while both
        # ends are idle (one end may still be held by the probe that triggered this, until its
        # own copy of the result is in); an end that is busy lets the other end's go on.
        requests: list[tuple[str, str | None]] = [(a, b)]
        for end in () if again_only else (a, b):
            requests += [(end, None)] * cfg.fresh_partners
        repeat: _Confirm | None = None
        for x, peer in requests:
            ends = (x,) if peer is None else (x, peer)
            if peer is not None:
                drop = [self._displaceable(e, cfg.max_pending_confirms) for e in ends]
                if all(d is not None for d in drop):
                    for req in (r for d in drop for r in d or ()):
                        req.done = True
                        self._release_confirm(req)
                    self._confirms = [c for c in self._confirms if not c.done]
            if any(self._pending[e] >= cfg.max_pending_confirms for e in ends):
                continue
            for e in ends:
                self._pending[e] += 1
            if peer is not None:
                start = now + cfg.pair_again_after_seconds
                repeat = _Confirm(x, peer, now, expires, exclude, start_at=start, trigger=trigger)
                self._confirms.append(repeat)
            else:
                self._confirms.append(_Confirm(x, None, now, expires, exclude, repeat=repeat))
        self._next_dispatch = now  # confirms go out at the next tick, not the next second

    def _preflight_result(
        self, planned: _Probe, probe: Probe, passed: bool, expected: float | None, now: float
    ) -> None:
        node = planned.preflight_node
        n = self._nodes.get(node) if node is not None else None
        if n is None or n.preflight is None or n.preflight.state != "pending":
            return
        pf = n.preflight
        if pf.running == planned.id:
            pf.running = None
        evidence: dict[str, object] = {
            "probe": planned.id,
            "kind": probe.kind,
            "ok": probe.ok,
            "busbw_bytes_per_second": probe.busbw_bytes_per_second,
            "expected_bytes_per_second": expected,
            "time": now,
        }
        if probe.error:
            evidence["error"] = probe.error
        if len(planned.nodes) == 2:
            evidence["partner"] = planned.peer_of(n.name)
            pf.pair = evidence
        else:
            pf.local = evidence
        if not passed:
            pf.state = "failed"
        elif pf.pair is not None and (pf.local is not None or self.config.local_kind is None):
            pf.state = "passed"
        if pf.state != "pending":
            log.info("preflight probes done", extra={"node": n.name, "state": pf.state})
