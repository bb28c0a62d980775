"""Links: which end of a slow pair probe is to blame — a node, the path between two nodes, or a switch.

A pair probe (``nccl_allreduce_pair``, ``tcp_pair``) measures two nodes and the network between
them at once. One slow result says nothing about which; many results over a pool do. Per pool and
probe kind, every pair's recent results are averaged in log space with exponential recency weights
(``half_life_seconds``), normalized by the pool's expected bandwidth (the median over its pairs),
and decomposed robustly (weighted median polish, so one bad node or pair cannot drag the others)::

    log(bw_ij / expected) = mu + a_i + a_j + r_ij

- a node whose results with its partners, each less that partner's own level then, carry enough
  evidence of "slow by the design effect" (``design_ratio``) over "normal" (a sequential
  likelihood-ratio test reaching ``threshold_nats``, with at least ``min_partners`` partners and
  no one partner deciding) is the bad node: a ``link`` finding with action ``quarantine`` (not
  hard: the health machine still wants it to persist);
- a pair whose results less its ends' effects carry that evidence while both ends are normal
  (each judged on its other partners at the time) is a degraded link: a link finding for
  ``aggregator.links.LinkHealth``, nothing on either node. A result measured while an end was
  found slow with everyone is that end's (``_slow_spells``), never the path's, even once the
  end is repaired;
- ``switch_min_culprits`` or more culprits (bad nodes, degraded pairs) within one rack, else one
  leaf, point at the switch they share: one ``SwitchAlert``, and on each node involved an
  ``alert`` finding with the same key ``link-switch:<kind>:<name>`` (the node becomes suspect, no
  taint). A pair's domain is the narrowest one holding both ends, a node's is its rack.

The noise (run to run, path to path, node to node) is estimated from the pool's own results
(``_noise``). A single probe never decides: each result adds at most half the threshold.
Probe times are moved to the aggregator's clock by the node's clock offset (the report's
measured time on our clock less its own, ``aggregator/fleet/sendtime.py``), so both ends' copies
of one measurement are recognized as one even when a node's clock is off or the aggregator is
behind.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict, deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Annotated, ClassVar, Final

import msgspec
import numpy as np
import numpy.typing as npt
from msgspec import UNSET, Meta

from agent.report import Report
from aggregator.config import DetectorSettings, PositiveSeconds, Ratio
from aggregator.detect.base import Pair, SwitchAlert, Verdict
from aggregator.fleet.frame import FleetFrames
from aggregator.fleet.pools import Placement
from aggregator.links import DECIDED
from aggregator.model import Finding

log = logging.getLogger(__name__)

Float = npt.NDArray[np.float64]
MAD_SCALE: Final = 1.4826
# Fewest values a MAD is taken of: with two, one outlier is half of them and sets the scale alone;
# with three a single slow node or path no longer does. Below it the prior stands alone.
MAD_MIN: Final = 3
PAIR_KINDS: Final = frozenset({"nccl_allreduce_pair", "tcp_pair"})
# With fewer partners at an end the median polish cannot tell a slow end from a slow pair (with two
# a node's effect is the midpoint of its slow and its normal pair): such pairs are judged on each
# end's other partners directly.
POLISH_PARTNERS: Final = 3
# Nearest other partners of a node that say what its own level was around a result.
PARTNER_VOTES: Final = 3
# A single result never decides: each result of a pair (and each partner of a node) adds at most
# ``threshold_nats / DECIDING_RESULTS``, so a pair is called on this many slow results at the
# fewest (a transient, or a partner busy for a moment, is one). bench/detection.py counts a link
# as visible on as many.
DECIDING_RESULTS: Final = 2
# Spans a node was found slow over that are remembered apiece (``LinkLocalizer._slow_spell``).
MAX_SLOW_SPELLS: Final = 8


class LinkConfig(DetectorSettings, frozen=True):
    """``detectors.link``. The defaults suit a fleet probed every few minutes; tests and small
    labs shorten them."""

    name: ClassVar[str] = "link"
    every_seconds: PositiveSeconds = 60.0  # how often the pipeline runs the localizer
    half_life_seconds: PositiveSeconds = 1800.0  # a probe this old weighs half a fresh one
    max_age_seconds: PositiveSeconds = 4 * 3600.0  # older probes are forgotten (weight under 1/256)
    dedupe_seconds: PositiveSeconds = 30.0  # both ends' copies of one probe land this close on our clock
    max_samples_per_pair: Annotated[int, Meta(ge=1)] = 64
    # Distinct partners a node verdict needs: with one, a slow node and a slow link give the same
    # results; with two slow partners that are each normal elsewhere, "the node" is one fault and
    # "two links at once, both at this node" is two, so two partners decide.
    min_partners: Annotated[int, Meta(ge=2)] = 2
    # The sequential test (docs/detection.md, "Links"): evidence for "slow by the design effect"
    # against "normal" accumulates per node and per pair until it crosses ``threshold_nats``.
    # The design effect is the smallest slowdown we are asked to call a fault (a NIC or path 25 %
    # slow); larger effects cross on fewer results, smaller ones on more or never.
    design_ratio: Ratio = 0.75
    # log(1/alpha): Lorden's bound for a CUSUM on the log-likelihood ratio gives at least e^18
    # (6.6e7) results between false alarms under the noise model; see the docs for the rate.
    threshold_nats: Annotated[float, Meta(gt=0)] = 18.0
    # Noise of one result (log bandwidth) is estimated from the pool; until the pool has shown it,
    # it is shrunk toward this prior with the weight of ``noise_prior_weight`` results. Not a
    # floor: it fades as results come in. 3 % is twice the run-to-run spread of either generator
    # and wider than the network-namespace test's TCP results, so a pool that has not yet shown
    # its noise decides slower, never faster.
    noise_prior: Annotated[float, Meta(gt=0)] = 0.03
    noise_prior_weight: Annotated[float, Meta(ge=0)] = 5.0
    max_change_points: Annotated[int, Meta(ge=1)] = 32  # newest results a change may start at
    switch_min_culprits: Annotated[int, Meta(ge=1)] = 3  # culprits in one rack/leaf that make a switch alert
    # An end of a slow pair with too few other partners by the pair's last slow result (it ran a
    # job until just before) is judged "normal then" on those that follow within this long: the
    # confirm step's fresh partners come minutes later.
    judge_after_seconds: Annotated[float, Meta(ge=0)] = 300.0
    polish_iterations: Annotated[int, Meta(ge=1)] = 30

    @property
    def slow_line(self) -> float:
        """Log ratio under which one result is "slow": halfway (in log) between normal and the
        design effect, where the two hypotheses are equally likely for one result."""
        return 0.5 * math.log(self.design_ratio)


def _partner_results(node: str, pair: Pair, involving: list[_Obs]) -> Iterator[tuple[str, float, float]]:
    """(partner, time, log ratio) of every result of ``node`` with a partner, ``pair`` left out."""
    for o in involving:
        if o.pair == pair:
            continue
        partner = o.pair[1] if o.pair[0] == node else o.pair[0]
        for x, t in zip(o.ratios, o.times, strict=True):
            yield partner, t, math.log(x)


@dataclass
class _Verdict:
    """A run's answer while it is being put together (``Verdict`` with its links always judged)."""

    nodes: dict[str, list[Finding]] = field(default_factory=dict)
    links: dict[Pair, Finding] = field(default_factory=dict)
    switches: list[SwitchAlert] = field(default_factory=list)


@dataclass(frozen=True)
class _Noise:
    """Variances of log bandwidth in one pool, estimated from its own results (shrunk toward the
    prior while they are few)."""

    result_var: float  # one result about its pair's own level: run to run
    pair_var: float  # a pair's level about its two ends' effects (healthy paths differ a little)
    node_var: float  # a node's effect about the pool (healthy NICs differ a little)
    results: int  # how many within-pair deviations went into result_var


@dataclass(frozen=True)
class _Test:
    """The best change point of a sequential test: its log-likelihood ratio and what it rests on."""

    llr: float  # nats for "slow by the design effect" over "normal"
    since: float  # the first result it rests on (our clock)
    results: int
    partners: int
    effect: float  # the mean log ratio it saw (node: median over partners)
    slow: int  # of its results, those under the slow line


class _Sample(msgspec.Struct, frozen=True, gc=False):
    """One result: two floats, in a struct the cycle collector does not track (up to
    ``max_samples_per_pair`` a pair are kept)."""

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
        # Per node, the spans (first result the verdict rested on, last run that gave it) over which
        # it was found slow with everyone, oldest first, kept while they overlap retained probes.
        # A result measured then is explained by that node: it is no evidence against a partner or
        # the path between them, even once the node's other results of that time have aged out
        # (they are older than the pair's, and go first) and its repaired self is normal.
        self._slow_spells: dict[str, list[tuple[float, float]]] = {}

    # -- input ----------------------------------------------------------------------------------

    def observe_report(self, report: Report, placement: Placement, measured: float) -> None:
        if report.probes:  # a node's placement is learnt from the reports that carry its probes
            self.observe(report, placement, measured)

    def observe(self, report: Report, placement: Placement, measured: float) -> int:
        """Take the report's pair probes (the report measured at ``measured`` on our clock);
        returns how many were new (not the other end's copy)."""
        self._placements[report.node] = placement
        if report.probes is UNSET:
            return 0
        # The node's clock to ours. From when the report was measured, not its receipt: the two
        # ends' copies of one probe are matched by time, and behind a backlog each end's report
        # waits its own while (a receipt-based offset would date the copies apart).
        offset = measured - report.time
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
        self._slow_spells.pop(node, None)
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
        for node in list(self._slow_spells):
            spells = [sp for sp in self._slow_spells[node] if sp[1] >= oldest]
            if spells:
                self._slow_spells[node] = spells
            else:
                del self._slow_spells[node]
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
        partners: dict[str, set[str]] = defaultdict(set)
        involving: dict[str, list[_Obs]] = defaultdict(list)
        for o in obs:
            partners[o.pair[0]].add(o.pair[1])
            partners[o.pair[1]].add(o.pair[0])
            involving[o.pair[0]].append(o)
            involving[o.pair[1]].append(o)
        # Spreads of effects and residuals only where the polish determines them (an end with one
        # or two partners carries its own pairs' slowness in its effect).
        solid = np.array([len(partners[n]) >= POLISH_PARTNERS for n in nodes])
        noise = self._noise(obs, resid[solid[ii] & solid[jj]], eff[solid])
        slow_line = cfg.slow_line

        bad_nodes: dict[str, Finding] = {}
        spells: list[tuple[str, float]] = []
        for n in nodes:
            if len(partners[n]) < cfg.min_partners:
                continue
            test = self._node_test(n, involving, noise)
            if test is not None and test.llr >= cfg.threshold_nats:
                bad_nodes[n] = self._node_finding(
                    pool, node=n, test=test, mine=involving[n], noise=noise, now=now
                )
                spells.append((n, test.since))
        # Recorded once every node is judged, so no node's verdict this run depends on the order.
        for n, since in spells:
            self._slow_spell(n, since, now)

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
            if fewest >= POLISH_PARTNERS:
                end_eff = (float(eff[idx[a]]), float(eff[idx[b]]))
                ends = end_eff[0] + end_eff[1] + float(mu)
                need = POLISH_PARTNERS - 1
                votes = min(len(partners[a]), len(partners[b])) - 1
            else:
                # Too few partners for the polish to tell a slow end from a slow pair (with two
                # partners a node's effect is the midpoint of its slow and its normal pair): each
                # end is judged on its other partners alone, leaving this pair out. A sparse
                # prober (one or two partners per idle window) gives no more; each end still
                # needs a normal result with someone else.
                # (When each end was normal is _normal_then's question, below.)
                # An end whose only other results are explained by a partner slow with everyone
                # has no level to judge by.
                end_votes = [[m for _, m in self._votes(end, pair, involving, math.inf)] for end in pair]
                if not all(end_votes):
                    continue
                ea, eb = (float(np.median(v)) for v in end_votes)
                end_eff = (ea, eb)
                ends = ea + eb
                own = float(np.dot(wq, y[qs]) / wq.sum())
                if own >= slow_line:
                    continue  # slow only against its ends, not against the pool: nothing to say
                need = 1
                votes = 1
            if min(end_eff) < slow_line:
                continue
            mine = [m for m in (self._unexplained(obs[q], pair) for q in qs) if m is not None]
            if not mine:
                continue
            results = sorted(
                (t, math.log(x) - ends) for o in mine for x, t in zip(o.ratios, o.times, strict=True)
            )
            # The ends' effects are estimates too: their error adds to the residual's.
            ends_var = 2 * (noise.pair_var + noise.result_var) / max(votes, 1)
            test = self._pair_test([x for _, x in results], noise, ends_var)
            if test is None or test.llr < cfg.threshold_nats:
                continue
            if not all(
                self._normal_then(end, pair, mine, involving, need=need, bad=set(bad_nodes)) for end in pair
            ):
                continue
            bad_pairs[pair] = self._pair_finding(pool, pair=pair, test=test, mine=mine, noise=noise, now=now)

        switched = self._switches_of(pool, bad_nodes, bad_pairs, now, out)
        for n, f in bad_nodes.items():
            if n not in switched:
                out.nodes[n].append(f)
        for pair, f in bad_pairs.items():
            if pair not in switched:
                out.links[pair] = f

    def _slow_spell(self, node: str, since: float, now: float) -> None:
        """``node`` was found slow with everyone on results from ``since`` up to ``now``."""
        spells = self._slow_spells.setdefault(node, [])
        if spells and spells[-1][1] >= since:
            spells[-1] = (min(spells[-1][0], since), now)
        else:
            spells.append((since, now))
        if len(spells) > MAX_SLOW_SPELLS:
            # A node found slow on and off: joining its two oldest spells explains a little more
            # than was seen (the gap between them), which can only spare a link, never blame one.
            spells[:2] = [(spells[0][0], spells[1][1])]

    def _explained(self, node: str, t: float) -> bool:
        """Whether a result of ``node``'s measured at ``t`` is explained by the node itself: it was
        found slow with everyone then."""
        return any(since <= t <= until for since, until in self._slow_spells.get(node, ()))

    def _unexplained(self, o: _Obs, pair: Pair) -> _Obs | None:
        """``o`` without the results an end of ``pair`` explains (None: it explains them all)."""
        a, b = pair
        if a not in self._slow_spells and b not in self._slow_spells:
            return o
        keep = [
            (x, t)
            for x, t in zip(o.ratios, o.times, strict=True)
            if not (self._explained(a, t) or self._explained(b, t))
        ]
        if len(keep) == len(o.ratios):
            return o
        if not keep:
            return None
        return replace(o, ratios=tuple(x for x, _ in keep), times=tuple(t for _, t in keep))

    def _normal_then(
        self,
        end: str,
        pair: Pair,
        mine: list[_Obs],
        involving: Mapping[str, list[_Obs]],
        *,
        need: int,
        bad: set[str],
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
        its recovery vote for its slow past. Each vote is the result less that partner's own
        level then (``_votes``)."""
        cfg = self.config
        run = self._slow_run(mine)
        if run is None:
            return True
        last_slow = run[1]
        until = last_slow + cfg.dedupe_seconds
        then = self._votes(end, pair, involving, until, bad)
        slow_line = cfg.slow_line
        if len(then) < need:
            if any(m < slow_line for _, m in then):
                return False  # slow near the time, too few to outvote: what follows may be recovery
            # The earliest moment it had enough partners, if that came soon enough: the nearest
            # evidence in time, so a recovery that came later does not vote.
            first: dict[str, float] = {}
            for o in involving[end]:
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
        line = math.exp(self.config.slow_line)
        slow = [i for i, (_, x) in enumerate(results) if x < line]
        if not slow:
            return None
        i = slow[-1]
        while i > 0 and results[i - 1][1] < line:
            i -= 1
        return results[i][0], results[slow[-1]][0]

    def _votes(
        self,
        end: str,
        pair: Pair,
        involving: Mapping[str, list[_Obs]],
        until: float,
        bad: set[str] | None = None,
    ) -> list[tuple[float, float]]:
        """Per other partner of ``end``: (when, log ratio) of its latest result up to ``until``,
        less that partner's own level around then (``_partner_level``, its results with everyone
        but ``end``), as the node test reads a result: a pair result is both ends' effects and the
        path's, so a partner 13 % slow (one of eight ports down) does not make ``end`` look slow
        with it. A partner seen with fewer than ``min_partners`` others is taken at 0, the pool's
        level.
        A slow result with a partner in ``bad`` (found slow with everyone), or measured while that
        partner was (``_explained``), does not vote: it is slow through no fault of ``end``. A
        normal one still does (measured before that partner went bad, it says ``end`` was fine)."""
        slow_line = self.config.slow_line
        latest: dict[str, tuple[float, float]] = {}
        for other, t, lr in _partner_results(end, pair, involving[end]):
            if t <= until and t >= latest.get(other, (-math.inf, 0.0))[0]:
                latest[other] = (t, lr)
        votes: dict[str, tuple[float, float]] = {}
        for other, (t, raw) in latest.items():
            lr = raw
            level = self._partner_level(other, (min(end, other), max(end, other)), involving[other], t)
            # Only a level read off two partners or more is taken off: one partner's result may be
            # that partner's own degraded link, which would then clear ``end`` of a slow result.
            if level is not None and level[1] >= self.config.min_partners:
                lr -= level[0]
            votes[other] = (t, lr)
        bad = bad or set()
        return [
            (t, lr)
            for n, (t, lr) in votes.items()
            if lr >= slow_line or not (n in bad or self._explained(n, t))
        ]

    # -- the sequential tests ---------------------------------------------------------------------

    def _noise(self, obs: list[_Obs], resid: Float, eff: Float) -> _Noise:
        """Robust scales (MAD) of the pool's own results, shrunk toward ``noise_prior`` with the
        weight of ``noise_prior_weight`` results: run to run (each pair's results about its own
        mean), pair to pair (``resid``, the decomposition's residuals) and node to node (``eff``,
        its effects)."""
        cfg = self.config
        within: list[float] = []
        for o in obs:
            k = len(o.ratios)
            if k >= 2:
                logs = np.log(np.array(o.ratios))
                # Deviations from a mean of k are narrower than the noise by sqrt((k-1)/k).
                within.extend(((logs - logs.mean()) * math.sqrt(k / (k - 1))).tolist())
        prior, n0 = cfg.noise_prior**2, cfg.noise_prior_weight

        def shrunk(values: Float) -> float:
            n = len(values)
            if n < MAD_MIN:
                return prior
            mad = MAD_SCALE * float(np.median(np.abs(values - np.median(values))))
            return (n * mad**2 + n0 * prior) / (n + n0)

        return _Noise(
            result_var=shrunk(np.array(within)),
            pair_var=shrunk(resid),
            node_var=shrunk(eff),
            results=len(within),
        )

    def _partner_level(
        self, other: str, pair: Pair, involving: list[_Obs], t: float
    ) -> tuple[float, int] | None:
        """What ``other`` measured around ``t`` with its partners outside ``pair``: the median log
        ratio of its results nearest in time with up to ``PARTNER_VOTES`` partners, and how many."""
        nearest: dict[str, tuple[float, float]] = {}
        for partner, ts, lr in _partner_results(other, pair, involving):
            dt = abs(ts - t)
            if dt < nearest.get(partner, (math.inf, 0.0))[0]:
                nearest[partner] = (dt, lr)
        if not nearest:
            return None
        votes = sorted(nearest.values())[:PARTNER_VOTES]
        return float(np.median([v for _, v in votes])), len(votes)

    def _node_test(self, node: str, involving: Mapping[str, list[_Obs]], noise: _Noise) -> _Test | None:
        """The node's evidence of being slow by the design effect, from its results with each
        partner less that partner's own level then (so a slow partner is not held against it).

        Per partner the mean of its results is one Gaussian observation of the node's effect (node
        and path spread, the results' noise and the partner level's error in its variance); its
        log-likelihood ratio is capped at half the threshold, so no one partner decides (one slow
        pair is equally a slow link). The statistic is the sum over partners since the change
        point that gives it its largest value (among the newest ``max_change_points`` results):
        results from before a NIC went slow do not vouch for it, and a repaired node's normal
        results outweigh its slow past."""
        cfg = self.config
        d = -math.log(cfg.design_ratio)
        cap = cfg.threshold_nats / DECIDING_RESULTS
        rows: list[tuple[float, str, float, int]] = []
        for o in involving[node]:
            other = o.pair[1] if o.pair[0] == node else o.pair[0]
            for x, t in zip(o.ratios, o.times, strict=True):
                if self._explained(other, t):
                    continue  # measured while the partner was slow with everyone: says nothing of us
                level = self._partner_level(other, o.pair, involving[other], t)
                if level is not None:  # a partner seen with nobody else: its result says nothing
                    rows.append((t, other, math.log(x) - level[0], level[1]))
        rows.sort()
        best: _Test | None = None
        for s0 in range(max(0, len(rows) - cfg.max_change_points), len(rows)):
            per: dict[str, list[float]] = defaultdict(list)
            votes: dict[str, int] = {}
            for _, other, x, m in rows[s0:]:
                per[other].append(x)
                votes[other] = m
            if len(per) < cfg.min_partners:
                break  # later change points leave fewer partners still
            llr, means = 0.0, []
            for other, xs in per.items():
                mean = sum(xs) / len(xs)
                var = (
                    noise.node_var
                    + noise.pair_var
                    + noise.result_var / len(xs)
                    + (noise.pair_var + noise.result_var) / votes[other]
                )
                llr += min(cap, d * (-mean - d / 2) / var)
                means.append(mean)
            if best is None or llr > best.llr:
                best = _Test(
                    llr=llr,
                    since=rows[s0][0],
                    results=len(rows) - s0,
                    partners=len(per),
                    effect=float(np.median(means)),
                    slow=sum(1 for _, _, x, _ in rows[s0:] if x < cfg.slow_line),
                )
        return best

    def _pair_test(self, xs: list[float], noise: _Noise, ends_var: float) -> _Test | None:
        """The pair's evidence of a path slow by the design effect, from its results less its ends'
        effects (``xs``, oldest first): the mean since the best change point is one Gaussian
        observation of the pair's residual; each result adds at most half the threshold, so one
        result never decides (a transient, or a partner that was busy for a moment)."""
        cfg = self.config
        d = -math.log(cfg.design_ratio)
        cap = cfg.threshold_nats / DECIDING_RESULTS
        best: _Test | None = None
        for s0 in range(max(0, len(xs) - cfg.max_change_points), len(xs)):
            tail = xs[s0:]
            k = len(tail)
            mean = sum(tail) / k
            var = noise.pair_var + noise.result_var / k + ends_var
            llr = min(k * cap, d * (-mean - d / 2) / var)
            if best is None or llr > best.llr:
                best = _Test(llr, 0.0, k, 2, mean, sum(1 for x in tail if x < cfg.slow_line))
        return best

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
        self, pool: str, *, node: str, test: _Test, mine: list[_Obs], noise: _Noise, now: float
    ) -> Finding:
        pairs = {
            (o.pair[1] if o.pair[0] == node else o.pair[0]) + f" ({o.kind})": round(math.exp(o.y), 3)
            for o in mine
        }
        pct = (1 - math.exp(test.effect)) * 100
        return Finding(
            detector=LinkConfig.name,
            key="link-node",
            severity="critical",
            action="quarantine",
            decided=True,  # the node's likelihood ratio crossed threshold_nats: no persistence on top
            summary=(
                f"every pair probe with {node} is slow: {pct:.0f} % under pool {pool}'s expected bandwidth "
                f"with {test.partners} partners ({test.slow} slow results, {test.llr:.0f} nats of evidence): "
                "the node, not the links"
            ),
            since=now,
            evidence={
                "pool": pool,
                "effect_ratio": round(math.exp(test.effect), 3),
                "llr_nats": round(test.llr, 1),
                "threshold_nats": self.config.threshold_nats,
                "noise": round(math.sqrt(noise.result_var), 4),
                "partners": len({o.pair[1] if o.pair[0] == node else o.pair[0] for o in mine}),
                "decided_on_partners": test.partners,
                "slow_probes": test.slow,
                "pairs": pairs,
            },
        )

    def _pair_finding(
        self, pool: str, *, pair: Pair, test: _Test, mine: list[_Obs], noise: _Noise, now: float
    ) -> Finding:
        a, b = pair
        pct = (1 - math.exp(test.effect)) * 100
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
                f"their other partners ({test.slow} slow results, {test.llr:.0f} nats of evidence): "
                "the link, not the nodes"
            ),
            since=since,
            peer=b,
            evidence={
                "pool": pool,
                "residual_ratio": round(math.exp(test.effect), 3),
                "llr_nats": round(test.llr, 1),
                "threshold_nats": self.config.threshold_nats,
                "noise": round(math.sqrt(noise.result_var), 4),
                "slow_probes": test.slow,
                "ratios": {o.kind: [round(r, 3) for r in o.ratios] for o in mine},
                DECIDED: True,
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
