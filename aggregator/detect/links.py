"""Links: which end of a slow pair probe is to blame — a node, the path between two nodes, or a switch.

A pair probe (``nccl_allreduce_pair``, ``tcp_pair``) measures two nodes and the network between
them at once. One slow result says nothing about which; many results over a pool do. Per pool and
probe kind, every pair's recent results are averaged in log space with exponential recency weights
(``half_life_seconds``), normalized by the pool's expected bandwidth (the median over its pairs),
and decomposed robustly (weighted median polish, so one bad node or pair cannot drag the others)::

    log(bw_ij / expected) = mu + a_i + a_j + r_ij

- a node whose effect ``a_i`` is clearly low (below ``log(node_ratio)``, ``z`` standard errors
  below zero given the pool's spread, with ``min_partners`` partners and ``min_low_probes`` slow
  probes) is the bad node: a ``link`` finding with action ``quarantine`` (not hard: the health
  machine still wants it to persist);
- a pair whose residual ``r_ij`` is clearly low while both ends are normal (each judged on at least
  ``min_partners`` partners) is a degraded link: a link finding for ``aggregator.links.LinkHealth``,
  nothing on either node;
- ``switch_min_culprits`` or more culprits (bad nodes, degraded pairs) within one rack, else one
  leaf, point at the switch they share: one ``SwitchAlert``, and on each node involved an
  ``alert`` finding with the same key ``link-switch:<kind>:<name>`` (the node becomes suspect, no
  taint). A pair's domain is the narrowest one holding both ends, a node's is its rack.

A single probe never decides: every verdict needs ``min_low_probes`` slow results of its own.
Probe times are moved to the aggregator's clock (``received - report.time``), so both ends' copies
of one measurement are recognized as one even when a node's clock is off.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Final

import numpy as np
import numpy.typing as npt
from msgspec import UNSET, Meta

from agent.report import Report
from aggregator.config import DetectorSettings, PositiveSeconds, Ratio
from aggregator.detect.base import Pair, SwitchAlert, Verdict
from aggregator.fleet.frame import FleetFrames
from aggregator.fleet.pools import Placement
from aggregator.model import Finding

log = logging.getLogger(__name__)

Float = npt.NDArray[np.float64]
MAD_SCALE: Final = 1.4826
PAIR_KINDS: Final = frozenset({"nccl_allreduce_pair", "tcp_pair"})


class LinkConfig(DetectorSettings, frozen=True):
    """``detectors.link``. The defaults suit a fleet probed every few minutes; tests and small
    labs shorten them."""

    name: ClassVar[str] = "link"
    every_seconds: PositiveSeconds = 60.0  # how often the pipeline runs the localizer
    half_life_seconds: PositiveSeconds = 1800.0  # a probe this old weighs half a fresh one
    max_age_seconds: PositiveSeconds = 4 * 3600.0  # older probes are forgotten (weight under 1/256)
    dedupe_seconds: PositiveSeconds = 30.0  # both ends' copies of one probe land this close on our clock
    max_samples_per_pair: Annotated[int, Meta(ge=1)] = 64
    min_partners: Annotated[int, Meta(ge=2)] = 3  # a node is judged only on this many distinct partners
    min_low_probes: Annotated[int, Meta(ge=1)] = 2  # a verdict needs this many slow results of its own
    node_ratio: Ratio = 0.85  # node effect below this share of the pool's bandwidth
    pair_ratio: Ratio = 0.85  # pair residual below this share
    z: Annotated[float, Meta(ge=0)] = 3.0  # how many standard errors below normal an effect must be
    spread_floor: Annotated[float, Meta(gt=0)] = 0.02  # lower bound of the robust spread of log bandwidth
    switch_min_culprits: Annotated[int, Meta(ge=1)] = 3  # culprits in one rack/leaf that make a switch alert
    # An end of a slow pair with too few other partners by the pair's last slow result (it ran a
    # job until just before) is judged "normal then" on those that follow within this long: the
    # confirm step's fresh partners come minutes later.
    judge_after_seconds: Annotated[float, Meta(ge=0)] = 300.0
    polish_iterations: Annotated[int, Meta(ge=1)] = 30


@dataclass
class _Verdict:
    """A run's answer while it is being put together (``Verdict`` with its links always judged)."""

    nodes: dict[str, list[Finding]] = field(default_factory=dict)
    links: dict[Pair, Finding] = field(default_factory=dict)
    switches: list[SwitchAlert] = field(default_factory=list)


@dataclass
class _Sample:
    time: float  # on the aggregator's clock
    log_bw: float


@dataclass(frozen=True)
class _Obs:
    """One (pair, kind) of a pool: recency-weighted mean of its normalized log bandwidth."""

    pair: Pair
    kind: str
    y: float
    weight: float
    ratios: tuple[float, ...]  # each retained probe's bandwidth over the pool's expected, newest last
    times: tuple[float, ...]  # when each of those probes ran (our clock), in the same order


def _wmedian(values: Float, weights: Float) -> float:
    order = np.argsort(values, kind="stable")
    v, w = values[order], weights[order]
    cum = np.cumsum(w)
    half = cum[-1] / 2.0
    i = int(np.searchsorted(cum, half))
    # Exactly half the weight on each side: the midpoint, as the plain median does for even counts.
    if i + 1 < len(v) and math.isclose(cum[i], half, rel_tol=1e-12):
        return float((v[i] + v[i + 1]) / 2.0)
    return float(v[i])


class LinkLocalizer:
    def __init__(self, config: LinkConfig | None = None) -> None:
        self.config = config or LinkConfig()
        self.every_seconds = self.config.every_seconds
        self._samples: dict[tuple[Pair, str], deque[_Sample]] = {}
        self._placements: dict[str, Placement] = {}
        self._judged: set[str] = set()  # nodes answered for last run, so a vanished one is cleared
        self._switches: set[tuple[str, str, str]] = set()

    # -- input ----------------------------------------------------------------------------------

    def observe_report(self, report: Report, placement: Placement, received: float) -> None:
        if report.probes:  # a node's placement is learnt from the reports that carry its probes
            self.observe(report, placement, received)

    def observe(self, report: Report, placement: Placement, received: float) -> int:
        """Take the report's pair probes; returns how many were new (not the other end's copy)."""
        self._placements[report.node] = placement
        if report.probes is UNSET:
            return 0
        offset = received - report.time  # the node's clock to ours
        added = 0
        for p in report.probes:
            if p.kind not in PAIR_KINDS or p.peer is None or p.peer == report.node:
                continue
            if not p.ok or p.busbw_bytes_per_second is None or not p.busbw_bytes_per_second > 0:
                # A failed pair probe has no bandwidth to localize; the rules see the node's errors.
                continue
            pair: Pair = (min(report.node, p.peer), max(report.node, p.peer))
            t = p.time + offset
            samples = self._samples.setdefault((pair, p.kind), deque(maxlen=self.config.max_samples_per_pair))
            if any(abs(s.time - t) <= self.config.dedupe_seconds for s in samples):
                continue
            samples.append(_Sample(t, math.log(p.busbw_bytes_per_second)))
            added += 1
        return added

    def bandwidth(self) -> dict[tuple[Pair, str], tuple[float, float]]:
        """(pair, kind) -> (time, bytes/s) of its newest retained probe (the status page's matrix)."""
        return {key: (dq[-1].time, math.exp(dq[-1].log_bw)) for key, dq in self._samples.items() if dq}

    # -- judgement ------------------------------------------------------------------------------

    def forget(self, node: str) -> None:
        """Its probes are older than ``max_age_seconds`` by the time a node is forgotten (a day
        of silence by default), so only the placement and the judged mark are left to drop."""
        self._placements.pop(node, None)
        self._judged.discard(node)
        for key in [k for k in self._samples if node in k[0]]:
            del self._samples[key]

    def run(self, frames: FleetFrames, now: float) -> Verdict:
        """Judged on the pair probes observed; the pool frames play no part."""
        cfg = self.config
        oldest = now - cfg.max_age_seconds
        by_pool: dict[str, dict[str, list[tuple[Pair, list[_Sample]]]]] = defaultdict(
            lambda: defaultdict(list)
        )
        for key in list(self._samples):
            (a, b), kind = key
            dq = self._samples[key]
            while dq and dq[0].time < oldest:
                dq.popleft()
            if not dq:
                del self._samples[key]
                continue
            pa, pb = self._placements.get(a), self._placements.get(b)
            if pa is None or pb is None or pa.pool != pb.pool:
                continue  # different hardware has a different expected bandwidth
            live = [s for s in dq if s.time <= now]
            if live:
                by_pool[pa.pool][kind].append(((a, b), live))
        verdict = _Verdict()
        for pool in sorted(by_pool):
            self._run_pool(pool, by_pool[pool], now, verdict)
        judged = set(verdict.nodes)
        for node in self._judged - judged:
            verdict.nodes[node] = []
        self._judged = judged
        self._log_switches(verdict.switches)
        return Verdict(nodes=verdict.nodes, links=verdict.links, switches=verdict.switches)

    def _run_pool(
        self, pool: str, kinds: Mapping[str, list[tuple[Pair, list[_Sample]]]], now: float, out: _Verdict
    ) -> None:
        cfg = self.config
        obs: list[_Obs] = []
        for kind in sorted(kinds):
            rows = kinds[kind]
            means = []
            for _, samples in rows:
                t = np.array([s.time for s in samples])
                w = np.power(0.5, (now - t) / cfg.half_life_seconds)
                means.append((float(np.dot(w, [s.log_bw for s in samples]) / w.sum()), float(w.sum())))
            expected = float(np.median([m for m, _ in means]))
            for (pair, samples), (m, wsum) in zip(rows, means, strict=True):
                ratios = tuple(math.exp(s.log_bw - expected) for s in samples)
                times = tuple(s.time for s in samples)
                obs.append(_Obs(pair, kind, m - expected, wsum, ratios, times))
        nodes = sorted({n for o in obs for n in o.pair})
        for n in nodes:
            out.nodes.setdefault(n, [])
        if len(obs) < 2:
            return
        idx = {n: i for i, n in enumerate(nodes)}
        ii = np.array([idx[o.pair[0]] for o in obs])
        jj = np.array([idx[o.pair[1]] for o in obs])
        y = np.array([o.y for o in obs])
        w = np.array([o.weight for o in obs])
        # Each partner is one vote on a node's effect (recency is already in each pair's mean):
        # weighted by probe count, the pair a confirm re-probed (the suspicious one) would outvote
        # the node's other partners and put the blame on whichever end the polish visits first.
        mu, eff = self._polish(len(nodes), ii, jj, y, np.ones_like(w))
        resid = y - mu - eff[ii] - eff[jj]
        spread = max(MAD_SCALE * _wmedian(np.abs(resid - _wmedian(resid, w)), w), cfg.spread_floor)

        partners: dict[str, set[str]] = defaultdict(set)
        involving: dict[str, list[_Obs]] = defaultdict(list)
        for o in obs:
            partners[o.pair[0]].add(o.pair[1])
            partners[o.pair[1]].add(o.pair[0])
            involving[o.pair[0]].append(o)
            involving[o.pair[1]].append(o)
        low_node, low_pair = math.log(cfg.node_ratio), math.log(cfg.pair_ratio)

        bad_nodes: dict[str, Finding] = {}
        for n in nodes:
            k = idx[n]
            npart = len(partners[n])
            if npart < cfg.min_partners:
                continue
            effect = float(eff[k])
            se = spread / math.sqrt(npart)
            mine = involving[n]
            slow = sum(1 for o in mine for r in o.ratios if r < cfg.node_ratio)
            if effect < low_node and effect / se < -cfg.z and slow >= cfg.min_low_probes:
                bad_nodes[n] = self._node_finding(
                    pool, node=n, effect=effect, z=effect / se, mine=mine, slow=slow, now=now
                )

        bad_pairs: dict[Pair, Finding] = {}
        by_pair: dict[Pair, list[int]] = defaultdict(list)
        for q, o in enumerate(obs):
            by_pair[o.pair].append(q)
        for pair, qs in sorted(by_pair.items()):
            a, b = pair
            if a in bad_nodes or b in bad_nodes:
                continue
            fewest = min(len(partners[a]), len(partners[b]))
            if fewest < 2:
                continue  # an end seen with this partner only: a slow pair and a slow end look the same
            wq = w[qs]
            if fewest >= cfg.min_partners:
                end_eff = (float(eff[idx[a]]), float(eff[idx[b]]))
                ends = end_eff[0] + end_eff[1] + float(mu)
                r = float(np.dot(wq, resid[qs]) / wq.sum())
                need = cfg.min_partners - 1
            else:
                # Too few partners for the polish to tell a slow end from a slow pair (with two
                # partners a node's effect is the midpoint of its slow and its normal pair): each
                # end is judged on its other partners alone, leaving this pair out. A sparse
                # prober (one or two partners per idle window) gives no more; each end still
                # needs a normal result with someone else.
                # (When each end was normal is _normal_then's question, below.)
                ea, eb = (
                    float(np.median([m for _, m in self._votes(end, pair, involving[end], math.inf)]))
                    for end in pair
                )
                end_eff = (ea, eb)
                ends = ea + eb
                own = float(np.dot(wq, y[qs]) / wq.sum())
                if own >= low_pair:
                    continue  # slow only against its ends, not against the pool: nothing to say
                r = own - ends
                need = 1
            if min(end_eff) < low_node:
                continue
            slow = sum(1 for q in qs for x in obs[q].ratios if math.log(x) - ends < low_pair)
            if r < low_pair and r < -cfg.z * spread and slow >= cfg.min_low_probes:
                mine = [obs[q] for q in qs]
                if not all(
                    self._normal_then(end, pair, mine, involving[end], need=need, bad=set(bad_nodes))
                    for end in pair
                ):
                    continue
                bad_pairs[pair] = self._pair_finding(
                    pool, pair=pair, resid=r, mine=[obs[q] for q in qs], slow=slow, now=now
                )

        switched = self._switches_of(pool, bad_nodes, bad_pairs, now, out)
        for n, f in bad_nodes.items():
            if n not in switched:
                out.nodes[n].append(f)
        for pair, f in bad_pairs.items():
            if pair not in switched:
                out.links[pair] = f

    def _normal_then(
        self, end: str, pair: Pair, mine: list[_Obs], involving: list[_Obs], *, need: int, bad: set[str]
    ) -> bool:
        """Whether ``end`` was normal with its other partners when ``pair`` was last slow.

        Judged on the ``need`` other partners measured nearest before that (each partner's
        latest result up to then; a slow one with a partner found slow with everyone left out,
        that partner's fault): a node whose NIC went slow an hour ago still has its normal
        results from before in the window, and however many they are they must not vouch for it
        now. Slow with half of them or more is not
        normal. A node that was slow with everyone and has since been fixed is normal now, but
        its old slow pairs are its own past, not slow links: judged on today's effects alone
        they would be.
        An end with too few partners by then (it ran a job until just before) is judged on the
        partners that follow within ``judge_after_seconds``: the confirm step's fresh partners.
        Never both: a node that was slow with a partner and recovered right after must not have
        its recovery vote for its slow past."""
        cfg = self.config
        run = self._slow_run(mine)
        if run is None:
            return True
        last_slow = run[1]
        until = last_slow + cfg.dedupe_seconds
        then = self._votes(end, pair, involving, until, bad)
        slow_line = math.log(cfg.node_ratio)
        if len(then) < need:
            if any(m < slow_line for _, m in then):
                return False  # slow near the time, too few to outvote: what follows may be recovery
            # The earliest moment it had enough partners, if that came soon enough: the nearest
            # evidence in time, so a recovery that came later does not vote.
            first: dict[str, float] = {}
            for o in involving:
                if o.pair != pair:
                    other = o.pair[1] if o.pair[0] == end else o.pair[0]
                    first[other] = min(*o.times, first.get(other, math.inf))
            later = sorted(t for t in first.values() if t > until)
            missing = need - len(then)
            enough_at = later[missing - 1] if len(later) >= missing else math.inf
            if enough_at <= last_slow + cfg.judge_after_seconds:
                then = self._votes(end, pair, involving, enough_at, bad)
        if len(then) < need:
            # Its other partners of that time have aged out (or there were none): as with too
            # few partners, a slow pair and a slow end cannot be told apart.
            return False
        nearest = sorted(then, reverse=True)[:need]
        slow = sum(1 for _, m in nearest if m < slow_line)
        return 2 * slow < len(nearest)

    def _slow_run(self, mine: list[_Obs]) -> tuple[float, float] | None:
        """First and last time of the pair's latest unbroken run of slow results (None: none slow)."""
        results = sorted((t, x) for o in mine for x, t in zip(o.ratios, o.times, strict=True))
        slow = [i for i, (_, x) in enumerate(results) if x < self.config.pair_ratio]
        if not slow:
            return None
        i = slow[-1]
        while i > 0 and results[i - 1][1] < self.config.pair_ratio:
            i -= 1
        return results[i][0], results[slow[-1]][0]

    def _votes(
        self, end: str, pair: Pair, involving: list[_Obs], until: float, bad: set[str] | None = None
    ) -> list[tuple[float, float]]:
        """Per other partner of ``end``: (when, log ratio) of its latest result up to ``until``.
        A slow result with a partner in ``bad`` (found slow with everyone) does not vote: it is
        slow through no fault of ``end``. A normal one still does (measured before that partner
        went bad, it says ``end`` was fine)."""
        slow_line = math.log(self.config.node_ratio)
        latest: dict[str, tuple[float, float]] = {}
        for o in involving:
            if o.pair == pair:
                continue
            other = o.pair[1] if o.pair[0] == end else o.pair[0]
            for x, t in zip(o.ratios, o.times, strict=True):
                if t <= until and t >= latest.get(other, (-math.inf, 0.0))[0]:
                    latest[other] = (t, math.log(x))
        if bad:
            latest = {n: v for n, v in latest.items() if n not in bad or v[1] >= slow_line}
        return list(latest.values())

    def _polish(
        self, n: int, ii: npt.NDArray[np.int_], jj: npt.NDArray[np.int_], y: Float, w: Float
    ) -> tuple[float, Float]:
        """Weighted median polish of y = mu + a_i + a_j; the node effects' median is zero."""
        eff = np.zeros(n)
        mu = _wmedian(y, w)
        members = [np.flatnonzero((ii == k) | (jj == k)) for k in range(n)]
        for _ in range(self.config.polish_iterations):
            before = eff.copy()
            for k in range(n):
                q = members[k]
                other = np.where(ii[q] == k, jj[q], ii[q])
                eff[k] = _wmedian(y[q] - mu - eff[other], w[q])
            centre = float(np.median(eff))
            eff -= centre
            mu += 2 * centre
            if float(np.max(np.abs(eff - before))) < 1e-9:
                break
        return mu, eff

    # -- verdicts -------------------------------------------------------------------------------

    def _node_finding(
        self, pool: str, *, node: str, effect: float, z: float, mine: list[_Obs], slow: int, now: float
    ) -> Finding:
        pairs = {
            (o.pair[1] if o.pair[0] == node else o.pair[0]) + f" ({o.kind})": round(math.exp(o.y), 3)
            for o in mine
        }
        pct = (1 - math.exp(effect)) * 100
        return Finding(
            detector=LinkConfig.name,
            key="link-node",
            severity="critical",
            action="quarantine",
            summary=(
                f"every pair probe with {node} is slow: {pct:.0f} % under pool {pool}'s expected bandwidth "
                f"with {len(pairs)} partners ({slow} slow results): the node, not the links"
            ),
            since=now,
            evidence={
                "pool": pool,
                "effect_ratio": round(math.exp(effect), 3),
                "z": round(z, 1),
                "partners": len({o.pair[1] if o.pair[0] == node else o.pair[0] for o in mine}),
                "slow_probes": slow,
                "pairs": pairs,
            },
        )

    def _pair_finding(
        self, pool: str, *, pair: Pair, resid: float, mine: list[_Obs], slow: int, now: float
    ) -> Finding:
        a, b = pair
        pct = (1 - math.exp(resid)) * 100
        # Since the first of the pair's latest unbroken run of slow results: two slow results ten
        # minutes apart have persisted for ten minutes, however late the localizer heard of them.
        run = self._slow_run(mine)
        since = now if run is None else min(now, run[0])
        return Finding(
            detector=LinkConfig.name,
            key=f"link-pair:{a}|{b}",
            severity="warning",
            action="none",
            summary=(
                f"the path between {a} and {b} is {pct:.0f} % slow while both nodes are normal with "
                f"their other partners ({slow} slow results): the link, not the nodes"
            ),
            since=since,
            peer=b,
            evidence={
                "pool": pool,
                "residual_ratio": round(math.exp(resid), 3),
                "slow_probes": slow,
                "ratios": {o.kind: [round(r, 3) for r in o.ratios] for o in mine},
            },
        )

    def _switches_of(
        self,
        pool: str,
        bad_nodes: Mapping[str, Finding],
        bad_pairs: Mapping[Pair, Finding],
        now: float,
        out: _Verdict,
    ) -> set[object]:
        """Group culprits by the rack, then the leaf, they share; returns the culprits explained."""
        cfg = self.config
        place = self._placements

        def domain(nodes: tuple[str, ...], kind: str) -> str | None:
            values = {getattr(place[n], kind) for n in nodes}
            return values.pop() if len(values) == 1 else None

        culprits: dict[object, tuple[str, ...]] = {n: (n,) for n in bad_nodes}
        culprits.update({p: p for p in bad_pairs})
        explained: set[object] = set()
        for kind in ("rack", "leaf"):
            groups: dict[str, list[object]] = defaultdict(list)
            for c, ends in culprits.items():
                if c in explained:
                    continue
                d = domain(ends, kind)
                if d is not None:
                    groups[d].append(c)
            for d, members in sorted(groups.items()):
                if len(members) < cfg.switch_min_culprits:
                    continue
                nodes = tuple(sorted({n for c in members for n in culprits[c]}))
                pairs = tuple(sorted(c for c in members if isinstance(c, tuple)))
                loners = sorted(c for c in members if isinstance(c, str))
                summary = (
                    f"{kind} {d}: {len(members)} slow culprits ({len(loners)} nodes, {len(pairs)} pairs) "
                    "behind one switch: the shared switch, not the nodes"
                )
                alert = SwitchAlert(kind, d, pool, nodes, pairs, summary)
                out.switches.append(alert)
                explained.update(members)
                finding = Finding(
                    detector=LinkConfig.name,
                    key=f"link-switch:{kind}:{d}",
                    severity="warning",
                    action="alert",
                    summary=summary,
                    since=now,
                    evidence={
                        "domain_kind": kind,
                        "domain": d,
                        "pool": pool,
                        "nodes": list(nodes),
                        "slow_nodes": loners,
                        "slow_pairs": [f"{a}|{b}" for a, b in pairs],
                    },
                )
                for n in nodes:
                    out.nodes.setdefault(n, []).append(finding)
        return explained

    def _log_switches(self, alerts: list[SwitchAlert]) -> None:
        now = {(a.pool, a.domain_kind, a.domain) for a in alerts}
        for a in alerts:
            if (a.pool, a.domain_kind, a.domain) not in self._switches:
                log.warning(
                    "switch suspected",
                    extra={"domain": f"{a.domain_kind} {a.domain}", "pool": a.pool, "summary": a.summary},
                )
        for pool, kind, d in sorted(self._switches - now):
            log.info("switch clear", extra={"domain": f"{kind} {d}", "pool": pool})
        self._switches = now
