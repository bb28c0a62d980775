"""Job data: which GPU, NIC or link the jobs' own collectives blame (NCCL Inspector summaries).

Each report's ``jobs`` section has, per communicator rank seen on the node, collective kind and
message-size bucket, the cycle's bus bandwidth and kernel-time quantiles (``agent.inspector``).
One communicator's id is the same on every rank, so rows of many nodes make up one communicator;
communicators that share a pod (the report's ``pods``: a rank's Inspector hostname is its pod's
name) make up one job, or, where a node's pods are not known, communicators that share the node.
Over a sliding window (``window_seconds``), per row the medians of the cycles' medians; then, every run:

- **like with like**: a communicator is compared with the communicators of its *class* (the
  same collective kind, size bucket, rank count, node count, timing source and pool) across the
  fleet. Its transfer bandwidth is the *highest* of its ranks' (the rank that waited least: with
  GPU kernel timing the others' kernels include their wait for the last to arrive); its ratio is
  that over the class's median, in log space, and its class's robust spread (MAD, floored at
  ``spread_floor``) says how far off is unusual;
- **the job's own level**: the median ratio of the job's single-node (tensor-parallel)
  communicators, or of all of them where it has none, and never above its class (a job whose
  NVLink collectives are faster than their class, NVLS or more channels, says nothing about its
  network). A job slow everywhere (its workload: small messages, its own contention) is slow on
  NVLink too, and every communicator is judged against that level: nothing of it stands out, and
  nothing is blamed (``slow_everywhere`` in the log);
- a communicator is **low** when its ratio to the job's level is under ``low_ratio`` and ``z``
  spreads below it, **normal** when above ``normal_ratio`` (between the two: no vote either way);
- **NIC (node)**: every inter-node communicator with a rank on the node is low (at least
  ``min_comms``), and they do not all cross one same hop (else a link and the NIC cannot be told
  apart): quarantine, the node's network;
- **NIC (rail)**: the same for the communicators of one GPU's rank (named by its GPU where the
  agent's attribution says it, else by its process), where for each of them another GPU of the
  node has a normal communicator over a hop it crosses: on a rail-optimized node each GPU sends
  over its own NIC, so that NIC (or its PCIe path) is slow while the node's others are fine.
  Most of a job's nodes blamed at once (NIC or rail) is one cause they share (the job's settings,
  the fabric): nothing is blamed then;
- **link**: every communicator crossing the hop between two nodes is low, each end has a normal
  inter-node communicator (its NIC is fine), and every other hop of those communicators is
  crossed by a normal one: the hop alone explains them (intersection over communicators). A link
  finding for the link state machine, nothing on the nodes;
- **straggler**: with ``kernel_gpu`` timing, in a collective where every rank does the same work
  (not an all-to-all or a pipeline's send and receive: ``UNEVEN``), one rank's kernel time is the
  shortest by ``straggler_ratio`` and ``z`` spreads of the others' times: that rank arrived last
  (and, where the communicator has a class, its ranks waited: its median rank's bandwidth under
  ``1 - straggler_ratio`` of the class's transfer figure). How late the last rank of a healthy
  communicator is scales with the computation between two collectives, which is the job's, so
  the rank's lead must also be ``straggler_peer_factor`` times that of the last rank in the job's
  other communicators of the same kind (those without its node; ``min_straggler_peers`` of
  them), in time: a GPU 12 % slow stands out of a healthy 1-2 % spread in any job. A node whose
  ranks are the stragglers of ``min_comms`` or more of its inter-node communicators (and of most
  of those judged), or of its tensor-parallel communicator, is slow: quarantine, naming the GPU
  (tensor-parallel rank) when its own communicator shows one. A node whose own communicator has
  one GPU arriving last, fault or not, is not blamed from its inter-node ones: its lateness there
  is that GPU's, which the job's other GPUs judge;
- **over time**: a blame must hold in ``confirm_runs`` consecutive runs (each on its own window)
  before it becomes a finding; the health and link state machines then want it to persist as
  they want any soft evidence (``suspect_for_seconds``), with the same safety limits.

A communicator is judged only when every one of its ranks is in the window: a partial view can
neither blame nor clear. Rows are kept per communicator, bounded (``max_comms`` in all,
``max_comms_per_node`` started by one node's reports, ``max_ranks_per_node`` ranks of one node
over all rows, ``max_samples`` per rank; at a row cap the least recently reported row goes, in
one step), so one node's token churning communicator ids or ranks pushes out only its own rows;
a node's rows go when it is forgotten.
"""

from __future__ import annotations

import bisect
import logging
import math
import re
import statistics
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Annotated, ClassVar, Final

from msgspec import UNSET, Meta

from agent.attribution import pod_hostname
from agent.report import Report
from aggregator.config import DetectorSettings, PositiveSeconds, Ratio
from aggregator.detect.base import Pair, Verdict
from aggregator.fleet.frame import FleetFrames
from aggregator.fleet.pools import Placement
from aggregator.metrics import JobTable
from aggregator.model import Finding

log = logging.getLogger(__name__)

MAD_SCALE: Final = 1.4826  # MAD x this estimates one standard deviation of normal data
P2P: Final = frozenset({"Send", "Recv", "SendRecv"})  # a pair, not a ring
# Collectives whose ranks do different work by design, so one arriving last is no fault: an
# expert-parallel all-to-all waits for the expert with the most tokens, a pipeline's receiver for
# its sender's stage. The others (all-reduce, all-gather, reduce-scatter, broadcast, reduce) run
# after the same computation on every rank: the same shapes, the same kernels.
UNEVEN: Final = P2P | frozenset({"All2All"})
KERNEL_GPU: Final = "kernel_gpu"


class JobConfig(DetectorSettings, frozen=True):
    """``detectors.jobs``."""

    name: ClassVar[str] = "jobs"
    every_seconds: PositiveSeconds = 60.0
    # Rows this recent make a run's view: several agent cycles (10-30 s), so one lost report or
    # one odd cycle cannot move a median, and short enough that a fault shows within minutes.
    window_seconds: PositiveSeconds = 180.0
    max_comms: Annotated[int, Meta(ge=1)] = 20_000  # communicator rows kept (oldest dropped first)
    # Rows one node may have started (its oldest dropped first): a report carries at most 1,024
    # collectives, and one node's token must not push every other node's rows out.
    max_comms_per_node: Annotated[int, Meta(ge=1)] = 1_024
    # Ranks one node may hold over all rows: its GPUs (8 on an HGX node) in each of its rows. A
    # communicator's n_ranks is the sender's to declare (a 100,000-GPU job is real), so this is
    # what bounds one token declaring huge ones and sending new ranks of them every report.
    max_ranks_per_node: Annotated[int, Meta(ge=1)] = 8_192
    max_samples: Annotated[int, Meta(ge=1)] = 32  # cycles kept per communicator rank
    # NCCL's run-to-run spread on a healthy ring is a few percent (nccl-tests); 15 % below its
    # peers is well past the pair probes' slow line (detectors.link, sqrt(design_ratio) = 0.866).
    low_ratio: Ratio = 0.85
    # Above this a communicator vouches for the hops and NICs it crosses; between the two lines
    # it neither blames nor vouches (a borderline ring must not clear a hop by noise).
    normal_ratio: Ratio = 0.93
    # A rank arriving this much later than its peers makes their kernels wait as long: a GPU
    # 15 % slow in a step that spends three quarters computing is about 50 % late.
    straggler_ratio: Ratio = 0.1
    # How far a rank's lead must exceed the lead of the last rank in its job's other
    # communicators of the same kind (those without its node). How late the last rank is scales
    # with the computation between two collectives, which is the job's (its model, its batch),
    # times how much slower that GPU computes: a GPU 1-2 % slower than its node-mates (power
    # capping, clocks) arrives last in every step of a job computing 20 transfer times between
    # collectives by 20-40 % of a transfer. A fault stands out by the ratio of its slowdown to that
    # healthy spread (12 % slow against 1-2 %), whatever the job. Compared in time (the wait),
    # not in log. 4: the slowest of a node's 8 healthy GPUs is ahead of the median node's by up
    # to about 3 times in a pool of 64 (GPUs spread by 1-2 %, bench/jobgen.py), a GPU 12 % slow
    # by 5 to 12 times.
    straggler_peer_factor: Annotated[float, Meta(ge=1)] = 4.0
    # The same for a node's lead in its inter-node communicators. A node runs at its slowest GPU's
    # pace, and the slowest of eight healthy GPUs differs from node to node far less than GPUs
    # do: the typical lead there is small, and a node whose slowest healthy GPU is a little
    # further behind (2.6 % against 1.5 %) is 4 times it by chance in a 64-node pool
    # (bench/jobgen.py, a 1 % spread). A node slow as a whole (a power brake, a thermal limit:
    # 10-25 %) is tens of times it.
    straggler_node_factor: Annotated[float, Meta(ge=1)] = 8.0
    min_straggler_peers: Annotated[int, Meta(ge=1)] = 3  # the job's other communicators it needs
    z: Annotated[float, Meta(ge=0)] = 3.0  # how many robust spreads off a verdict must be
    spread_floor: Annotated[float, Meta(gt=0)] = 0.02  # lower bound of the spread of log bandwidth
    min_class_comms: Annotated[int, Meta(ge=2)] = 4  # fewer communicators cannot say what is normal
    min_comms: Annotated[int, Meta(ge=1)] = 2  # a node is blamed on this many communicators of its own
    confirm_runs: Annotated[int, Meta(ge=1)] = 2  # consecutive runs a blame must hold
    top_n: Annotated[int, Meta(ge=1)] = 10  # slowest communicators and stragglers kept for metrics

    def __post_init__(self) -> None:
        if not self.low_ratio < self.normal_ratio:
            raise ValueError("low_ratio must be under normal_ratio")


# ---------------------------------------------------------------------------------------------
# The maths, on plain arrays


def robust_centre(values: Sequence[float], floor: float) -> tuple[float, float]:
    """Median and robust spread (MAD x 1.4826, at least ``floor``) of ``values``."""
    med = statistics.median(values)
    return med, max(MAD_SCALE * statistics.median([abs(x - med) for x in values]), floor)


@dataclass(frozen=True)
class Straggler:
    index: int  # the rank (position in the input) that arrived last
    gap: float  # log of the others' median kernel time over its own
    z: float  # gap over the others' spread


def _shortest(exec_us: Sequence[float]) -> tuple[int, float, list[float]] | None:
    """The rank with the shortest kernel (the last to arrive), its log time and the others' log
    times; None for fewer than two ranks."""
    if len(exec_us) < 2:
        return None
    t = [math.log(max(x, 1e-3)) for x in exec_us]
    i = min(range(len(t)), key=t.__getitem__)
    return i, t[i], t[:i] + t[i + 1 :]


def straggler(exec_us: Sequence[float], *, ratio: float, z: float, floor: float) -> Straggler | None:
    """The rank whose kernel time is the shortest by ``ratio`` and ``z`` robust spreads of the
    others' (log) times, or None. With GPU kernel timing that rank arrived last: the others'
    kernels started earlier and waited for it."""
    found = _shortest(exec_us)
    if found is None:
        return None
    i, own, others = found
    centre, spread = robust_centre(others, floor)
    gap = centre - own
    if gap < math.log1p(ratio) or gap < z * spread:
        return None
    return Straggler(i, gap, gap / spread)


def lead(exec_us: Sequence[float]) -> float | None:
    """How much shorter the shortest kernel is than the median of the others', in log: the lead
    of the rank that arrived last (0 and up, ``straggler``'s gap without its tests); None for
    fewer than two ranks."""
    found = _shortest(exec_us)
    return None if found is None else statistics.median(found[2]) - found[1]


class _Leads:
    """The leads (``lead``) of one job's communicators of one kind, and the median of those
    without a given node: how late the last rank of a healthy one is in this job. Sorted once,
    each node's median computed once, in time linear in the communicators (a 1,000-node job has
    9,000 of them, and many of its nodes may be the last in one)."""

    def __init__(self, views: Sequence[_View], leads: Mapping[int, float | None]) -> None:
        self._sorted = sorted(g for v in views if (g := leads[id(v)]) is not None)
        self._of_node: dict[str, list[float]] = defaultdict(list)
        for v in views:
            g = leads[id(v)]
            if g is not None:
                for n in v.distinct:
                    self._of_node[n].append(g)
        self._without: dict[str, tuple[int, float]] = {}

    def without(self, node: str) -> tuple[int, float]:
        """How many communicators do not include ``node``, and the median of their leads (0.0
        when none)."""
        got = self._without.get(node)
        if got is None:
            rest = list(self._sorted)
            for g in self._of_node.get(node, ()):
                del rest[bisect.bisect_left(rest, g)]
            got = self._without[node] = (len(rest), statistics.median(rest) if rest else 0.0)
        return got


@dataclass(frozen=True)
class CommVote:
    """One communicator of a job, as localization sees it."""

    comm: str
    nodes: tuple[str, ...]  # distinct nodes, in rank order
    hops: tuple[Pair, ...]  # the inter-node hops it crosses
    state: str  # "low", "normal" or "unclear"
    ratio: float  # its bandwidth over its job's level (not log)
    # (node, rank's GPU or process) of each rank, where the report says which: on a
    # rail-optimized node each GPU sends over its own NIC, so these are the rails it uses.
    endpoints: tuple[Endpoint, ...] = ()


Endpoint = tuple[str, str]  # (node, "gpu3" or "pid4242")


@dataclass(frozen=True)
class Blame:
    nics: dict[str, list[CommVote]]  # node -> the low communicators through it
    links: dict[Pair, list[CommVote]]  # hop -> the low communicators crossing it
    ambiguous: list[tuple[str, ...]]  # low communicators' candidate sets nothing pins down
    # (node, GPU or process) -> the low communicators of that rank, where its node-mates' are fine
    rails: dict[Endpoint, list[CommVote]] = field(default_factory=dict)


def localize(votes: Sequence[CommVote], *, min_comms: int) -> Blame:
    """Which NICs and hops explain the low inter-node communicators of one job (module docstring).

    ``votes`` are the job's inter-node communicators. A NIC: every communicator through the node
    is low (``min_comms`` at least) and no one hop is common to all of them. A hop: every
    communicator crossing it is low, each end has a normal communicator, and each other hop of
    those communicators is crossed by a normal one."""
    through: dict[str, list[CommVote]] = defaultdict(list)
    crossing: dict[Pair, list[CommVote]] = defaultdict(list)
    for v in votes:
        for n in v.nodes:
            through[n].append(v)
        for h in v.hops:
            crossing[h].append(v)
    vouched_nodes = {n for n, vs in through.items() if any(v.state == "normal" for v in vs)}
    vouched_hops = {h for h, vs in crossing.items() if any(v.state == "normal" for v in vs)}
    nics = {n: vs for n, vs in sorted(through.items()) if _all_low_over_different_hops(vs, min_comms)}
    # One rail: every communicator of one GPU's rank (its own NIC on a rail-optimized node) is
    # low over different hops, and for each of them another GPU of the node has a normal one
    # over a hop it crosses: the node's network and those paths are fine, that rail is not. (A
    # ring slow on every rail of its nodes is a hop's or a node's doing, not this rail's.)
    of_endpoint: dict[Endpoint, list[CommVote]] = defaultdict(list)
    for v in votes:
        for ep in dict.fromkeys(v.endpoints):
            of_endpoint[ep].append(v)
    of_node: dict[str, list[Endpoint]] = defaultdict(list)
    for ep in of_endpoint:
        of_node[ep[0]].append(ep)
    rails: dict[Endpoint, list[CommVote]] = {}
    for ep, vs in sorted(of_endpoint.items()):
        node = ep[0]
        if node in nics or not _all_low_over_different_hops(vs, min_comms):
            continue
        mates = (w for other in of_node[node] if other != ep for w in of_endpoint[other])
        fine = {h for w in mates if w.state == "normal" for h in w.hops}
        if all(fine.intersection(v.hops) for v in vs):
            rails[ep] = vs
    railed = {ep[0] for ep in rails}
    links: dict[Pair, list[CommVote]] = {}
    for h, vs in sorted(crossing.items()):
        if any(v.state != "low" for v in vs):
            continue
        if h[0] not in vouched_nodes or h[1] not in vouched_nodes:
            continue
        if h[0] in nics or h[1] in nics or h[0] in railed or h[1] in railed:
            continue
        if all(set(v.hops) - {h} <= vouched_hops for v in vs):
            links[h] = vs
    explained = {v.comm for blamed in (nics, links, rails) for vs in blamed.values() for v in vs}
    ambiguous = [v.nodes for v in votes if v.state == "low" and v.comm not in explained]
    return Blame(nics, links, ambiguous, rails)


def _all_low_over_different_hops(vs: Sequence[CommVote], min_comms: int) -> bool:
    """At least ``min_comms`` communicators, every one low, not all through one hop (all through
    one hop: that link or this end, the data cannot say which)."""
    if len(vs) < min_comms or any(v.state != "low" for v in vs):
        return False
    return not set(vs[0].hops).intersection(*(v.hops for v in vs[1:]))


# ---------------------------------------------------------------------------------------------
# The detector


@dataclass
class _Rank:
    node: str
    hostname: str | None
    pid: int | None
    gpu: int | None
    samples: deque[tuple[float, float, float]]  # (our time, busbw GB/s p50, exec us p50)


def comm_hops(collective: str, nodes: Sequence[str]) -> tuple[Pair, ...]:
    """The inter-node hops a communicator's traffic crosses, from its distinct nodes in rank order:
    the one pair of a point-to-point or two-node communicator, else every neighbouring pair of the
    ring (cyclic). A ring runs at the pace of its slowest hop; a hop it does not cross it cannot
    show (bench/detection.py counts a link's job data with this, too)."""
    d = tuple(dict.fromkeys(nodes))
    if len(d) < 2:
        return ()
    if collective in P2P or len(d) == 2:
        return ((min(d[0], d[1]), max(d[0], d[1])),)
    return tuple(sorted({(min(a, b), max(a, b)) for a, b in zip(d, d[1:] + d[:1], strict=True)}))


# (communicator, collective, size bucket, timing source): a job that lets NCCL time some
# collectives on the CPU (NCCL_INSPECTOR_REQUIRE_KERNEL_TIMING=0) reports both kinds of one row.
_Key = tuple[str, str, int, str]


@dataclass
class _Row:
    """One (communicator, collective, size bucket): what its ranks reported."""

    comm: str
    collective: str
    size_bytes: int
    n_ranks: int
    nnodes: int
    timing: str
    ranks: dict[int, _Rank] = field(default_factory=dict)
    last: float = 0.0
    owner: str = ""  # the node whose report started the row (its quota: max_comms_per_node)


@dataclass(frozen=True)
class _View:
    """One row over the window, every rank present."""

    row: _Row
    pool: str
    nodes: tuple[str, ...]  # per rank, in rank order
    busbw: tuple[float, ...]  # per rank, GB/s
    exec_us: tuple[float, ...]  # per rank

    @property
    def transfer(self) -> float:
        return max(self.busbw)

    @property
    def distinct(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.nodes))

    def hops(self) -> tuple[Pair, ...]:
        return comm_hops(self.row.collective, self.distinct)

    def endpoints(self) -> tuple[Endpoint, ...]:
        """Each rank's (node, GPU or process), where its report says either (``CommVote``)."""
        out = []
        for r, node in enumerate(self.nodes):
            rank = self.row.ranks[r]
            if rank.gpu is not None:
                out.append((node, f"gpu{rank.gpu}"))
            elif rank.pid is not None:
                out.append((node, f"pid{rank.pid}"))
        return tuple(out)


@dataclass(frozen=True)
class SlowComm:
    """A communicator among the slowest against its class (for metrics and the status page)."""

    job: str
    comm: str
    collective: str
    nnodes: int
    ratio: float


@dataclass(frozen=True)
class StragglerRank:
    job: str
    node: str
    comm: str
    rank: int
    gap_ratio: float


class JobLocalizer:
    def __init__(self, config: JobConfig | None = None) -> None:
        self.config = config or JobConfig()
        self.every_seconds = self.config.every_seconds
        # In the order they were last reported (a row reported again moves to the end), so the
        # row to drop at a cap is the first: one step, not a scan of 20,000 rows per new row.
        self._rows: dict[_Key, _Row] = {}
        self._owned: dict[str, dict[_Key, None]] = {}  # per node, the rows it started, same order
        self._ranks_held: dict[str, int] = {}  # per node, the ranks it has in all rows (only > 0)
        self._placements: dict[str, Placement] = {}
        # Per node, its last PodResources answer as hostname -> (namespace, pod) (absent: none).
        self._pods: dict[str, dict[str, tuple[str, str]]] = {}
        self._streaks: dict[tuple[str, ...], tuple[int, float]] = {}  # blame -> (runs, first run)
        self._judged: set[str] = set()
        self._workload: set[str] = set()  # jobs slow everywhere at the last run (logged on change)
        # When the newest report (any report, with jobs or not) was measured: how far the data
        # reach, which behind a backlog is short of the clock (``run``).
        self._newest = -math.inf
        # What the last run saw, for metrics: per job its level and inter-node bandwidth.
        self.job_busbw: dict[str, float] = {}
        self.job_level: dict[str, float] = {}  # job -> its level (not log)
        self.slowest: list[SlowComm] = []
        self.stragglers: list[StragglerRank] = []

    # -- input ----------------------------------------------------------------------------------

    def observe_report(self, report: Report, placement: Placement, measured: float) -> None:
        self._newest = max(self._newest, measured)
        if report.pods is not UNSET:
            # Which pod each Inspector hostname is (a pod's hostname is its name, cut as the
            # kubelet cuts it); a name two namespaces share on this node says nothing.
            named: dict[str, tuple[str, str]] = {}
            seen: set[str] = set()
            for a in report.pods:
                host = pod_hostname(a.pod)
                if host in seen and named.get(host) != (a.namespace, a.pod):
                    named.pop(host, None)
                    continue
                seen.add(host)
                named[host] = (a.namespace, a.pod)
            self._pods[report.node] = named
        if report.jobs is UNSET:
            return
        self._placements[report.node] = placement
        cfg = self.config
        for c in report.jobs.collectives:
            if c.rank is UNSET:
                continue  # Prometheus mode: no rank, so no view across ranks
            key = (c.comm, c.collective, c.size_bytes, c.timing_source)
            row = self._rows.pop(key, None)
            if row is None:
                mine = self._owned.get(report.node)
                if mine is not None and len(mine) >= cfg.max_comms_per_node:
                    self._drop(next(iter(mine)))
                elif len(self._rows) >= cfg.max_comms:
                    self._drop(next(iter(self._rows)))
                # Looked up after the drop, which forgets a node's map once it is empty.
                owned = self._owned.setdefault(report.node, {})
                row = _Row(
                    c.comm,
                    c.collective,
                    c.size_bytes,
                    c.n_ranks,
                    c.nnodes,
                    c.timing_source,
                    owner=report.node,
                )
                owned[key] = None
            else:
                owned = self._owned[row.owner]
                del owned[key]
                owned[key] = None  # to the end of its owner's rows too
            self._rows[key] = row  # to the end: the most recently reported
            if c.rank >= row.n_ranks:
                continue  # no such rank in this communicator: nothing to keep for it
            rank = row.ranks.get(c.rank)
            if rank is None or rank.node != report.node:
                held = self._ranks_held.get(report.node, 0)
                if held >= cfg.max_ranks_per_node:
                    continue  # a sender declaring huge communicators: its own cap, not memory
                if rank is not None:
                    self._release(rank.node)
                self._ranks_held[report.node] = held + 1
                rank = row.ranks[c.rank] = _Rank(
                    report.node,
                    None if c.hostname is UNSET else c.hostname,
                    None if c.pid is UNSET else c.pid,
                    None if c.gpu is UNSET else c.gpu,
                    deque(maxlen=cfg.max_samples),
                )
            # Dated when measured: behind a backlog a rank's samples still fall in the window
            # of the moment they describe, beside those of the job's other ranks.
            if rank.samples and abs(rank.samples[-1][0] - measured) < 1.0:
                continue  # the same cycle again (a redelivered report)
            rank.samples.append((measured, c.busbw_gbs.p50, c.exec_time_us.p50))
            row.last = max(row.last, measured)

    def forget(self, node: str) -> None:
        self._placements.pop(node, None)
        self._pods.pop(node, None)
        for key in [k for k, r in self._rows.items() if any(x.node == node for x in r.ranks.values())]:
            self._drop(key)
        for key in list(self._owned.get(node, ())):
            self._drop(key)

    def _drop(self, key: _Key) -> None:
        row = self._rows.pop(key)
        owned = self._owned[row.owner]
        del owned[key]
        if not owned:
            del self._owned[row.owner]
        for rank in row.ranks.values():
            self._release(rank.node)

    def _release(self, node: str) -> None:
        """One rank of ``node``'s gone (its row dropped, or another node took its number)."""
        left = self._ranks_held[node] - 1
        if left:
            self._ranks_held[node] = left
        else:
            del self._ranks_held[node]

    # -- a run ----------------------------------------------------------------------------------

    def _views(self, now: float) -> list[_View]:
        lo = now - self.config.window_seconds
        out = []
        for key, row in list(self._rows.items()):
            if row.last < lo:
                self._drop(key)
                continue
            if len(row.ranks) != row.n_ranks or set(row.ranks) != set(range(row.n_ranks)):
                continue
            bw, ex, nodes = [], [], []
            for r in range(row.n_ranks):
                rank = row.ranks[r]
                recent = [(b, e) for t, b, e in rank.samples if lo <= t <= now]
                if not recent:
                    break
                bw.append(statistics.median([b for b, _ in recent]))
                ex.append(statistics.median([e for _, e in recent]))
                nodes.append(rank.node)
            else:
                place = self._placements.get(nodes[0])
                out.append(_View(row, place.pool if place else "", tuple(nodes), tuple(bw), tuple(ex)))
        return out

    def run(self, frames: FleetFrames, now: float) -> Verdict:
        cfg = self.config
        # The window ends at ``now``, unless the newest report was measured more than a run's
        # period before it: then the aggregator is behind a backlog (samples are dated when they
        # were measured), and the window ends where the data do, so a backlog longer than the
        # window does not leave it empty, and the ranks are compared over the same minutes.
        behind = now - self._newest > cfg.every_seconds
        views = self._views(self._newest if behind else now)
        jobs = _components(views, self._pods)
        refs = self._references(views, jobs)
        out: dict[str, list[Finding]] = {n: [] for v in views for n in v.nodes}
        links: dict[Pair, Finding] = {}
        blamed: dict[tuple[str, ...], Finding] = {}
        slowest: list[SlowComm] = []
        stragglers: list[StragglerRank] = []
        workload: set[str] = set()
        self.job_busbw = {}
        self.job_level = {}
        for job, members in sorted(jobs.items()):
            # Stragglers need no class: a communicator's ranks are compared with each other.
            found = self._stragglers(job, members, refs, now, stragglers)
            for node, f in found.items():
                blamed[("straggler", node)] = f
            judged = [m for m in members if id(m) in refs]
            if not judged:
                continue
            ratio = {id(m): math.log(max(m.transfer, 1e-9)) - refs[id(m)][0] for m in judged}
            single = [ratio[id(m)] for m in judged if m.row.nnodes == 1]
            # Only slowness is shared: a job whose NVLink collectives beat their class (NVLS,
            # more channels, another NCCL) says nothing about what its network should do, so its
            # inter-node communicators are then held to their class, not above it.
            level = min(statistics.median(single if single else list(ratio.values())), 0.0)
            inter = [m for m in judged if m.row.nnodes > 1]
            self.job_level[job] = math.exp(level)
            if inter:
                self.job_busbw[job] = statistics.median([m.transfer for m in inter])
            if level < math.log(cfg.low_ratio):
                workload.add(job)
            votes = self._votes(inter, ratio, refs, level)
            for vote in votes:
                slowest.append(SlowComm(job, vote.comm, _kind(inter, vote.comm), len(vote.nodes), vote.ratio))
            blame = localize(votes, min_comms=cfg.min_comms)
            spanned = {n for v in votes for n in v.nodes}
            if 2 * len(set(blame.nics) | {ep[0] for ep in blame.rails}) > len(spanned):
                # NICs fail one at a time. Most of a job's nodes slow on every inter-node
                # communicator at once is one cause they share: the job's own settings (fewer
                # channels, another algorithm) or the fabric it runs on, not that many NICs.
                workload.add(job)
                blame = replace(blame, nics={}, rails={})
            for node, vs in blame.nics.items():
                blamed[("nic", node)] = self._nic_finding(job, node, vs, now)
            for (node, ep), vs in blame.rails.items():
                blamed[("rail", node, ep)] = self._nic_finding(job, node, vs, now, rail=ep)
            for hop, vs in blame.links.items():
                blamed[("link", *hop)] = self._link_finding(job, hop, vs, now)
        self._log_workload(workload)
        # Over time: a blame must hold in confirm_runs consecutive runs.
        streaks: dict[tuple[str, ...], tuple[int, float]] = {}
        for key, f in blamed.items():
            runs, first = self._streaks.get(key, (0, now))
            streaks[key] = (runs + 1, first)
            if runs + 1 < cfg.confirm_runs:
                continue
            dated = _since(f, first)
            if key[0] == "link":
                links[(key[1], key[2])] = dated
            else:
                out.setdefault(key[1], []).append(dated)
        self._streaks = streaks
        for node in self._judged - out.keys():
            out[node] = []
        self._judged = {n for n, fs in out.items() if fs}
        slowest.sort(key=lambda s: s.ratio)
        self.slowest = slowest[: cfg.top_n]
        stragglers.sort(key=lambda s: -s.gap_ratio)
        self.stragglers = stragglers[: cfg.top_n]
        return Verdict(nodes=out, links=links)

    def _references(
        self, views: Sequence[_View], jobs: Mapping[str, list[_View]]
    ) -> dict[int, tuple[float, float]]:
        """Per view (by id): its class's median log transfer bandwidth and robust spread.

        Like with like: the same collective, size bucket, rank and node count, timing source and
        pool, across the fleet, where the class holds ``min_class_comms`` communicators of two
        jobs or more: one job's communicators alone cannot tell its fault (half its rings slow)
        from normal. Else the coarser class without the rank and node counts (bus bandwidth is
        NCCL's figure made comparable across rank counts: nccl-tests' PERFORMANCE.md), on the
        same condition; else the view is not judged."""
        cfg = self.config
        job_of = {id(v): job for job, members in jobs.items() for v in members}
        fine: dict[tuple[object, ...], list[_View]] = defaultdict(list)
        coarse: dict[tuple[object, ...], list[_View]] = defaultdict(list)
        for v in views:
            r = v.row
            fine[(r.collective, r.size_bytes, r.n_ranks, r.nnodes, r.timing, v.pool)].append(v)
            coarse[(r.collective, r.size_bytes, r.nnodes > 1, r.timing, v.pool)].append(v)
        refs: dict[int, tuple[float, float]] = {}
        for classes in (fine, coarse):
            for members in classes.values():
                todo = [m for m in members if id(m) not in refs]
                if not todo or len({m.row.comm for m in members}) < cfg.min_class_comms:
                    continue
                if len({job_of[id(m)] for m in members}) < 2:
                    continue
                ref = robust_centre([math.log(max(m.transfer, 1e-9)) for m in members], cfg.spread_floor)
                for m in todo:
                    refs[id(m)] = ref
        return refs

    def _votes(
        self,
        inter: list[_View],
        ratio: Mapping[int, float],
        refs: Mapping[int, tuple[float, float]],
        level: float,
    ) -> list[CommVote]:
        """One vote per inter-node communicator (its collectives' median ratio to the job's level)."""
        cfg = self.config
        by_comm: dict[str, list[_View]] = defaultdict(list)
        for m in inter:
            by_comm[m.row.comm].append(m)
        votes = []
        for comm, ms in sorted(by_comm.items()):
            e = statistics.median([ratio[id(m)] - level for m in ms])
            spread = statistics.median([refs[id(m)][1] for m in ms])
            if e < math.log(cfg.low_ratio) and e < -cfg.z * spread:
                state = "low"
            elif e > math.log(cfg.normal_ratio):
                state = "normal"
            else:
                state = "unclear"
            votes.append(CommVote(comm, ms[0].distinct, ms[0].hops(), state, math.exp(e), ms[0].endpoints()))
        return votes

    def _stragglers(
        self,
        job: str,
        members: list[_View],
        refs: Mapping[int, tuple[float, float]],
        now: float,
        top: list[StragglerRank],
    ) -> dict[str, Finding]:
        """Nodes whose ranks arrive last (module docstring), with the communicators that say so."""
        cfg = self.config
        # Every communicator where arrival order means something: kernel timing (the others'
        # kernels include their wait for the last), and the same work on every rank (UNEVEN).
        timed = [m for m in members if m.row.timing == KERNEL_GPU and m.row.collective not in UNEVEN]
        leads = {id(m): lead(m.exec_us) for m in timed}
        # The job's other communicators of each kind (single-node, inter-node) without a node.
        peers = {
            inter: _Leads([m for m in timed if (m.row.nnodes > 1) == inter], leads) for inter in (False, True)
        }
        late: dict[str, list[tuple[_View, Straggler]]] = defaultdict(list)
        # node -> its inter-node communicators judged (communicators, as ``late`` counts them: a
        # data-parallel one has a reduce-scatter and an all-gather row, and is one)
        seen: dict[str, set[str]] = defaultdict(set)
        tp: dict[str, tuple[_View, Straggler]] = {}
        # Nodes where one GPU arrives last in the node's own communicator, fault or not: the
        # node's tensor-parallel collectives hold its GPUs to that one, so its lateness in the
        # inter-node communicators is that GPU's, judged there against the job's other GPUs (a
        # GPU 6 % slower than its node-mates makes its node a few percent slower than the other
        # nodes, whose own spread is tighter: not a slow node). A node slow as a whole (a power
        # brake, a thermal limit on every GPU) has no such GPU.
        one_gpu_last: set[str] = set()
        for m in timed:
            if m.row.nnodes > 1:
                for n in m.distinct:
                    seen[n].add(m.row.comm)
            if id(m) in refs:
                waited = math.log(max(statistics.median(m.busbw), 1e-9)) - refs[id(m)][0]
                if waited > -math.log1p(cfg.straggler_ratio):
                    continue  # its ranks did not wait: nobody is late
            s = straggler(m.exec_us, ratio=cfg.straggler_ratio, z=cfg.z, floor=cfg.spread_floor)
            if s is None:
                continue
            node = m.nodes[s.index]
            if m.row.nnodes == 1:
                one_gpu_last.add(node)
            # The job's other communicators of this kind, without this node: how late the last
            # rank of a healthy one is in this job (straggler_peer_factor). In time, not in log:
            # the wait is the lateness, and lateness scales with slowness.
            count, typical = peers[m.row.nnodes > 1].without(node)
            if count < cfg.min_straggler_peers:
                continue
            factor = cfg.straggler_node_factor if m.row.nnodes > 1 else cfg.straggler_peer_factor
            if math.expm1(s.gap) < factor * math.expm1(typical):
                continue
            top.append(StragglerRank(job, node, m.row.comm, s.index, math.expm1(s.gap)))
            if m.row.nnodes == 1:
                tp[node] = (m, s)
            else:
                late[node].append((m, s))
        out = {}
        for node in sorted(set(late) | set(tp)):
            mine = late.get(node, [])
            dp = len({m.row.comm for m, _ in mine})
            if node not in tp and (
                node in one_gpu_last or not (dp >= cfg.min_comms and 2 * dp > len(seen[node]))
            ):
                continue
            out[node] = self._straggler_finding(
                job, node=node, mine=mine, tp=tp.get(node), seen=len(seen[node]), now=now
            )
        return out

    def job_table(self) -> JobTable:
        """The last run's top-N lists, for the metrics (``aggregator.metrics.JobTable``)."""
        n = self.config.top_n
        worst = sorted(self.job_level, key=lambda j: self.job_level[j])[:n]
        return JobTable(
            jobs=tuple((j, self.job_busbw[j], self.job_level[j]) for j in worst if j in self.job_busbw),
            communicators=tuple((s.job, s.comm, s.collective, s.nnodes, s.ratio) for s in self.slowest),
            stragglers=tuple((s.job, s.node, s.comm, s.rank, s.gap_ratio) for s in self.stragglers),
        )

    # -- findings -------------------------------------------------------------------------------

    def _nic_finding(
        self, job: str, node: str, vs: list[CommVote], now: float, *, rail: str | None = None
    ) -> Finding:
        worst = min(v.ratio for v in vs)
        med = statistics.median([v.ratio for v in vs])
        peers = sorted({n for v in vs for n in v.nodes} - {node})
        evidence: dict[str, object] = {
            "job": job,
            "communicators": [v.comm for v in vs][:16],
            "ratio": round(med, 3),
            "worst_ratio": round(worst, 3),
            "peers": peers[:16],
        }
        if rail is None:
            through, blame = node, "the node's network, not a link"
        else:
            evidence["rank"] = rail
            through = f"{rail.replace('gpu', 'GPU ').replace('pid', 'process ')} of {node}"
            blame = "that GPU's NIC or its PCIe path (its node-mates' communicators are normal), not a link"
        return Finding(
            detector=JobConfig.name,
            key="job-nic" if rail is None else f"job-nic:{rail}",
            severity="warning",
            action="quarantine",
            summary=(
                f"every inter-node communicator of job {job} through {through} is slow "
                f"({len(vs)} communicators, {(1 - med) * 100:.0f} % under the job's level, with {len(peers)} "
                f"other nodes over different hops): {blame}"
            ),
            since=now,
            evidence=evidence,
        )

    def _link_finding(self, job: str, hop: Pair, vs: list[CommVote], now: float) -> Finding:
        a, b = hop
        med = statistics.median([v.ratio for v in vs])
        return Finding(
            detector=JobConfig.name,
            key=f"job-link:{a}|{b}",
            severity="warning",
            action="none",
            summary=(
                f"every communicator of job {job} over the hop {a}-{b} is slow ({len(vs)} communicators, "
                f"{(1 - med) * 100:.0f} % under the job's level) while both nodes are normal over their "
                "other hops: the link, not the nodes"
            ),
            since=now,
            peer=b,
            evidence={"job": job, "communicators": [v.comm for v in vs][:16], "ratio": round(med, 3)},
        )

    def _straggler_finding(
        self,
        job: str,
        *,
        node: str,
        mine: list[tuple[_View, Straggler]],
        tp: tuple[_View, Straggler] | None,
        seen: int,
        now: float,
    ) -> Finding:
        which = "its GPUs"
        evidence: dict[str, object] = {
            "job": job,
            "late_in": len({m.row.comm for m, _ in mine}),
            "inter_node_communicators": seen,
            "communicators": sorted({m.row.comm for m, _ in mine})[:16],
        }
        if mine:
            evidence["wait_ratio"] = round(math.expm1(statistics.median([s.gap for _, s in mine])), 3)
        key = "job-straggler"
        if tp is not None:
            m, s = tp
            rank = m.row.ranks[s.index]
            which = f"GPU {rank.gpu}" if rank.gpu is not None else f"tensor-parallel rank {s.index}"
            key = f"job-straggler:rank{s.index}" if rank.gpu is None else f"job-straggler:gpu{rank.gpu}"
            evidence.update(
                tp_communicator=m.row.comm,
                tp_rank=s.index,
                tp_wait_ratio=round(math.expm1(s.gap), 3),
                pid=rank.pid,
                gpu=rank.gpu,
                hostname=rank.hostname,
            )
        return Finding(
            detector=JobConfig.name,
            key=key,
            severity="warning",
            action="quarantine",
            summary=(
                f"job {job}: {node}'s ranks arrive last (their kernels are the shortest while the others "
                f"wait) in {len(mine)} of its {seen} inter-node communicators"
                + (f", and {which} in its own node's" if tp is not None else "")
                + f": a slow {'GPU' if tp is not None else 'node'}, not the network"
            ),
            since=now,
            evidence=evidence,
        )

    def _log_workload(self, jobs: set[str]) -> None:
        for job in sorted(jobs - self._workload):
            log.info("job slow everywhere: its workload, no hardware blamed", extra={"job": job})
        self._workload = jobs


def _since(f: Finding, first: float) -> Finding:
    """The finding dated from the first run of its streak."""
    return replace(f, since=min(f.since, first))


def _kind(views: Iterable[_View], comm: str) -> str:
    return next((v.row.collective for v in views if v.row.comm == comm), "")


# The trailing parts of a pod's name that its controller adds, not its job: an index (Job,
# StatefulSet, JobSet, PyTorchJob, MPIJob, LeaderWorkerSet), a role (Kubeflow's training operator:
# master/worker/ps/chief/evaluator, MPIJob's launcher, LeaderWorkerSet's leader), or a random
# suffix (generateName: 5 characters of apimachinery's rand alphabet, which has no vowels; a
# ReplicaSet's pod-template-hash of up to 10 of the same).
_ROLES: Final = frozenset({"master", "worker", "ps", "chief", "evaluator", "launcher", "leader", "driver"})
_RANDOM_SUFFIX: Final = re.compile(r"[bcdfghjklmnpqrstvwxz2456789]{5,10}")


def job_stem(pod: str) -> str:
    """A pod name's job part: ``llm-c-worker-0009`` -> ``llm-c``, ``train-0-1-x7k2p`` -> ``train``.
    Used to name a job, never to join two jobs: a stem can be shared by unrelated runs."""
    parts = pod.split("-")
    while len(parts) > 1 and (
        parts[-1].isdigit() or parts[-1] in _ROLES or _RANDOM_SUFFIX.fullmatch(parts[-1]) is not None
    ):
        parts.pop()
    return "-".join(parts)


# Where a rank runs: ("pod", namespace, pod) when the node's PodResources answer has a pod of that
# name holding GPUs (Inspector's hostname in a pod is the pod's name), else ("node", node).
_Owner = tuple[str, ...]


def _components(
    views: Sequence[_View], pods: Mapping[str, Mapping[str, tuple[str, str]]] | None = None
) -> dict[str, list[_View]]:
    """Jobs: communicators linked by the pods they share, or by the nodes where a rank's pod is
    not known (no attribution on its node, a hostname that is no pod of it).

    A communicator never spans two jobs, so the pods its ranks run in are one job's; two jobs on
    one node (a node split between jobs) stay apart when the node says which pod holds what, and
    are one component when it does not (the communicators then share the node, which is all that
    is known). Each job is named ``namespace/stem`` when its pods have one stem (``job_stem``),
    else by its pods' common stem alone (no attribution: the Inspector's hostnames), else by its
    first node and size."""
    pods = pods or {}
    parent: dict[_Owner, _Owner] = {}

    def find(x: _Owner) -> _Owner:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def owners(v: _View) -> list[_Owner]:
        out: list[_Owner] = []
        for r, node in enumerate(v.nodes):
            host = v.row.ranks[r].hostname
            held = pods.get(node, {}).get(host) if host else None
            out.append(("pod", *held) if held is not None else ("node", node))
        return out

    of_view = [owners(v) for v in views]
    for os_ in of_view:
        first = find(os_[0])
        for o in os_[1:]:
            parent[find(o)] = first
    groups: dict[_Owner, list[_View]] = defaultdict(list)
    members_of: dict[_Owner, set[_Owner]] = defaultdict(set)
    for v, os_ in zip(views, of_view, strict=True):
        root = find(os_[0])
        groups[root].append(v)
        members_of[root].update(os_)
    out: dict[str, list[_View]] = {}
    for root, members in groups.items():
        nodes = sorted({n for v in members for n in v.nodes})
        in_pods = {(o[1], job_stem(o[2])) for o in members_of[root] if o[0] == "pod"}
        hosts = {r.hostname for v in members for r in v.row.ranks.values() if r.hostname}
        # A hostname that is a node's (a hostNetwork pod, bare metal) names no job.
        stems = {job_stem(h) for h in hosts if h.count("-") >= 2 and h not in nodes}
        if len(in_pods) == 1:
            namespace, stem = in_pods.pop()
            name = f"{namespace}/{stem}"
        elif len(stems) == 1 and not in_pods:
            name = stems.pop()
        else:
            name = f"{nodes[0]}+{len(nodes) - 1}"
        while name in out:  # two jobs of one name (a stem shared by two runs): both kept apart
            name += "'"
        out[name] = members
    return out
