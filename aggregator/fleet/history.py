"""Per-node history: the latest reports and reset-safe counter rates over a window.

``Fleet.add(report)`` returns a ``HistoryView`` (an ``aggregator.fleet.view.NodeView``) that the
rule engine evaluates. Rates follow the report contract: per second over the current boot's
samples inside ``[now - window_s, now]``, the sum of the positive deltas between consecutive
samples divided by the real time between the first and last of them. A counter that goes down
within one boot was reset and counts from zero; a new ``boot_id`` starts over.

What is kept, and why not the reports themselves
-------------------------------------------------
A decoded report of an 8-GPU node (18 NVLinks per GPU, 8 InfiniBand ports with their counters) is
about 60 KB of Python objects. Keeping every report for the window (1,800 s at 10 s: 180 reports)
would cost 11 MB per node, 80 GB for 7,500 nodes. So a node keeps only its latest report in full
(and, while the report after it is looked at, the previous one of the same boot: the view needs
both until ``settle``), and for everything older only the numbers someone asked for, as the
columns of one row-major ``array('d')`` whose rows are the node's samples:

- a *series* is one number per sample: the cumulative reset-safe increase of one counter (GPU
  counter, NVLink counter summed over the GPU's links, NIC counter) or the value of one GPU gauge;
  NaN where the value was null or the GPU/NIC absent. The rate over a window is then two bisects
  and a subtraction, whatever the window, so the rule engine can ask for 160 rates per report.
- which series exist is decided by a ``SeriesRegistry`` shared by the fleet: the first time anyone
  asks for a field, every node starts keeping it for all its GPUs/NICs (from its next report on;
  the asking node's series is seeded from the two full reports it still has).
  ``SeriesRegistry.track_*`` registers fields up front. A series only answers for windows it
  covers: one started after the window (or this boot's part of it) began gives None rather than
  an inflated rate. The rule engine asks for every counter of a node on the node's first report,
  so in practice the series it uses cover the node's whole history.
- recent samples (``fine_s``, default 300 s) are kept at full resolution; older ones are thinned
  to one per ``coarse_s`` (default 60 s), keeping the first sample of every boot. Counter rates stay
  exact (the cumulative value at a retained sample does not change when a neighbour is dropped);
  a window reaching back past ``fine_s`` just starts at the first retained sample inside it, at
  most ``coarse_s`` late, and ``gpu_samples`` returns one sample a minute there.

Memory for one node at 10 s reports, window 1,800 s: 30 fine + 25 coarse samples (+ up to 5 waiting
to be thinned) = 60 rows. The default pipeline keeps 144 series for an 8-GPU, 8-port node (16 GPU
counters, 32 NVLink sums, 80 NIC counters, 16 gauges) x 8 bytes x 60 rows = 69 KB of numbers;
measured with the per-column state and the key tables around them: 100 KB a node, 0.75 GB for 7,500
nodes (``bench/memory.py --holders``; without the thinning, 180 rows: about 2 GB). One array for all
the series, not one per series: a report appends one row and a thinned sample deletes one, and the
node's numbers are one object, not 145 arrays and 144 state objects that every full garbage
collection would walk (a node's tracked objects went from 382 to 57 with this layout). The counters'
state (last raw value, cumulative value, boot) lives in one more array, the NVLink sums' per-link
state in tuples, which the collector stops tracking. A report's row is built for all the series
at once: a plan made from the column tables (shared by the nodes whose tables are the same) reads
each GPU's and NIC's values in one call, converts them in one numpy call and sums the counters
for every column together; a GPU whose links equal those of the report before copies its NVLink
sums from the last row (nothing counted). Adding a column (a field asked for the first
time, a new NIC) or dropping one (a NIC gone for the window) rewrites the rows once. The full
report a node keeps comes on top (38 KB for an H100 node decoded from the wire: the next report's
view needs it as its ``previous``; the pipeline settles each view once evaluated, so between
reports there is one such report a node, not two). Rows share one boot-id string per boot, and
the series keys are the fleet's (``SeriesRegistry.key``). A node reporting far faster than
expected is capped at ``max_samples`` rows (the oldest go first), so a misconfigured agent
shortens its own window instead of growing memory.

Out-of-order reports
--------------------
Reports are ordered by their own ``time`` within a node. A late report (older than the latest but
inside the window) is inserted in time order: gauges get its values, and it may become the
latest's ``previous``. Counter series get no value from it (NaN at its row): a cumulative counter's
next sample already includes everything the late one counted, so the rate is the same as with it
(exactly as for a lost report), and nothing already summed has to be redone. A late report older
than ``fine_s`` only counts as seen (it would be thinned away at once). The view returned for a late
report is the node's view as of its *latest* report (``report`` is the latest, ``previous`` and
``rebooted`` are the latest's) with ``outcome == "late"`` and ``added`` the late report, so that
whoever cares about the late report's own events can still read them. A report older than
``now - window_s`` is dropped (``outcome == "expired"``), and one seen before (same boot_id, seq
and time) changes nothing (``outcome == "duplicate"``). One exception: a report older than the
window whose boot_id is the latest's but whose seq is higher means the node's clock stepped back;
keeping the old order would drop every report until the clock caught up, so the node's history
starts over from it (logged). So does a report of a boot not in the history dated before the
latest: agents deliver in order, so it is the next boot, and the previous one's clock ran ahead.

A view is meant to be used before the next ``add`` for its node (the pipeline evaluates it at once,
then calls ``settle``, after which a new series starts from the latest report alone and a view
has no ``previous``): its ``report``/``previous``/``rebooted`` are fixed, while its rates read the
node's live history, bounded by the view's own time and boot (after a reboot an old view's rates
are None).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import sys
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Sequence
from operator import attrgetter
from typing import TYPE_CHECKING, Final, Literal, TypeVar

import numpy as np
import numpy.typing as npt
from msgspec import UnsetType

from agent.errors import ConfigError, ReportError
from agent.report import (
    GPU_COUNTERS,
    GPU_FLAGS,
    GPU_GAUGES,
    NIC_TYPED_COUNTERS,
    NVLINK_COUNTERS,
    Gpu,
    Nic,
    NvLink,
    Report,
)
from aggregator.config import FleetConfig
from aggregator.ratelog import RateLimitedLog

if TYPE_CHECKING:
    from aggregator.fleet.view import NodeView, RateAsks

log = logging.getLogger(__name__)
# A sender can trigger these once per report: one line per kind every few seconds, counted.
_ratelog: Final = RateLimitedLog(log)

_NAN: Final = math.nan

# The field sets come from the catalogue beside the report types (agent/report.py).
# Cumulative GPU fields: what ``gpu_rate`` accepts.
GPU_COUNTER_FIELDS: Final[frozenset[str]] = frozenset(GPU_COUNTERS)
# Instantaneous numeric GPU fields.
GPU_GAUGE_FIELDS: Final[frozenset[str]] = frozenset(GPU_GAUGES)
# Boolean GPU fields, sampled as 0.0/1.0.
GPU_FLAG_FIELDS: Final[frozenset[str]] = frozenset(GPU_FLAGS)
# What ``gpu_samples`` accepts: any numeric or boolean GPU field (a counter's raw values included).
GPU_SAMPLE_FIELDS: Final[frozenset[str]] = GPU_GAUGE_FIELDS | GPU_FLAG_FIELDS | GPU_COUNTER_FIELDS
NVLINK_COUNTER_FIELDS: Final[frozenset[str]] = frozenset(NVLINK_COUNTERS)
# Typed cumulative NIC fields; any other name is looked up in ``Nic.counters``.
NIC_TYPED_COUNTER_FIELDS: Final[frozenset[str]] = frozenset(NIC_TYPED_COUNTERS)

_LINK_GETTERS: Final = {name: attrgetter(name) for name in NVLINK_COUNTER_FIELDS}

DEFAULT_FINE_SECONDS: Final = 300.0
DEFAULT_COARSE_SECONDS: Final = 60.0
# NICs with series per node: twice what a report may carry (ingest.max_nics), so a renamed set
# (a driver reload) keeps the old names' history for the window alongside the new.
DEFAULT_MAX_NIC_KEYS: Final = 64
# Series keys a fleet shares (SeriesRegistry.key): an 8-GPU, 8-port node has 144 series, a fleet of
# mixed hardware a few hundred distinct ones. The table is never emptied: a node naming new NICs
# in every report fills it once (a few hundred KB) and then only stops sharing, costing what keys
# cost without it.
MAX_SHARED_KEYS: Final = 2048

Outcome = Literal["latest", "late", "duplicate", "expired"]
NicKey = tuple[str, int | None]
_K = TypeVar("_K", bound=tuple[object, ...])


def _known(kind: str, name: str, known: frozenset[str]) -> None:
    if name not in known:
        raise ConfigError(f"unknown {kind} field {name!r}; known: {', '.join(sorted(known))}")


def _check_window(window_s: float) -> None:
    if not window_s > 0:  # also refuses NaN
        raise ConfigError(f"rate window must be a positive number of seconds, got {window_s!r}")


class SeriesRegistry:
    """The fields every node of a fleet keeps a series of (see the module docstring)."""

    def __init__(self) -> None:
        self.gpu_counters: set[str] = set()
        self.nvlink_counters: set[str] = set()
        self.nic_counters: set[str] = set()
        self.gpu_gauges: set[str] = set()
        self.version = 0  # bumped on every change, so a node knows to create new series
        # One tuple per series name fleet-wide: every node keys its ~140 series by the same
        # (GPU, field) and (device, port, counter) tuples, so each node need not hold its own
        # (about 9 KB a node). Bounded: a node naming new NICs in every report gets its own keys.
        self._keys: dict[tuple[object, ...], tuple[object, ...]] = {}

    def key(self, key: _K) -> _K:
        """The fleet's copy of a series key equal to ``key`` (``key`` itself past the bound)."""
        shared = self._keys.get(key)
        if shared is not None:
            return shared  # type: ignore[return-value]  # equal to key, so of its type
        if len(self._keys) < MAX_SHARED_KEYS:
            self._keys[key] = key
        return key

    def track_gpu_counters(self, *fields: str) -> None:
        for f in fields:
            _known("GPU counter", f, GPU_COUNTER_FIELDS)
        self._add(self.gpu_counters, fields)

    def track_nvlink_counters(self, *fields: str) -> None:
        for f in fields:
            _known("NVLink counter", f, NVLINK_COUNTER_FIELDS)
        self._add(self.nvlink_counters, fields)

    def track_nic_counters(self, *counters: str) -> None:
        for c in counters:
            if not c:
                raise ConfigError("NIC counter name must not be empty")
        self._add(self.nic_counters, counters)

    def track_gpu_gauges(self, *fields: str) -> None:
        for f in fields:
            _known("GPU sample", f, GPU_SAMPLE_FIELDS)
        self._add(self.gpu_gauges, fields)

    def _add(self, target: set[str], names: Iterable[str]) -> None:
        new = set(names) - target
        if new:
            target |= new
            self.version += 1


_LinkIds = tuple[int, ...]
_LinkValues = tuple[int | None, ...]
# Boot codes a node keeps before letting go of those nothing refers to (see _boot_code).
_MAX_BOOT_CODES: Final = 32
# A column's state in NodeHistory._state: its first row's time, a counter's last raw value,
# cumulative value and boot code, in that order.
_SINCE, _RAW, _CUM, _BOOT = range(4)
_STATE: Final = 4
# Ask sets resolved to columns a plan keeps (``last_rates``): a caller has one or two.
_MAX_RESOLVED: Final = 8
# ``last_rates`` off its fast path: a window reaching back to the previous report, plus a little so
# that rounding in ``now - (now - previous)`` cannot leave the previous report out.
_INTERVAL_SLACK_S: Final = 1e-3
_NEW_COLUMN_STATE: Final = array("d", [math.inf, 0.0, 0.0, math.nan])


def _links(gpu: Gpu | None) -> tuple[Sequence[NvLink], _LinkIds]:
    links = gpu.nvlink if gpu is not None and not isinstance(gpu.nvlink, UnsetType) else ()
    return links, tuple(link.link for link in links)


def _gauge_value(gpu: Gpu | None, name: str) -> float:
    if gpu is None:
        return _NAN
    v = getattr(gpu, name)
    return _NAN if v is None else float(v)


def _nic_value(nic: Nic | None, counter: str) -> float | None:
    if nic is None:
        return None
    if counter in NIC_TYPED_COUNTER_FIELDS:
        v: int | None = getattr(nic, counter)
        return None if v is None else float(v)
    counters = nic.counters
    if not isinstance(counters, dict):
        return None
    c = counters.get(counter)
    return None if c is None else float(c)


def _gpu_value(gpu: Gpu | None, name: str) -> float | None:
    if gpu is None:
        return None
    v = getattr(gpu, name)
    return None if v is None else float(v)


_Getter = Callable[[object], tuple[object, ...]]


def _tuple_getter(names: tuple[str, ...]) -> _Getter:
    """A function returning the named attributes of an object as a tuple (one C call for all)."""
    if len(names) == 1:
        name = names[0]
        return lambda obj: (getattr(obj, name),)
    return attrgetter(*names)  # several names: always a tuple


class _PushPlan:
    """How ``NodeHistory._push`` turns a report into a row, for one set of columns.

    Built from the column tables when they change, and shared by every node whose tables are the
    same (an H100 fleet has a handful of plans, not one per node). Values are gathered in
    ``value_cols`` order with one attribute or dict lookup call per GPU or NIC, then converted to
    floats in one numpy call (None is NaN), and the counters' reset-safe sums are computed for all
    counter columns at once: per report, ten numpy calls instead of 100 Python-level ones."""

    __slots__ = (
        "boot_at",
        "counters",
        "cum_at",
        "gauge_cols",
        "gpu_counters",
        "gpu_gauges",
        "links",
        "nics",
        "raw_at",
        "resolved",
        "value_cols",
        "width",
    )

    def __init__(
        self,
        gpu_counters: dict[tuple[int, str], int],
        nvlinks: dict[tuple[int, str], int],
        nic_counters: dict[tuple[str, int | None, str], int],
        gauges: dict[tuple[int, str], int],
        width: int,
    ) -> None:
        cols: list[int] = []
        self.gpu_counters = _by_gpu(gpu_counters, cols)
        nics: dict[NicKey, tuple[list[tuple[str, int]], list[tuple[str, int]]]] = {}
        for (device, port, counter), col in nic_counters.items():
            typed, keyed = nics.setdefault((device, port), ([], []))
            (typed if counter in NIC_TYPED_COUNTER_FIELDS else keyed).append((counter, col))
        plan: list[tuple[NicKey, _Getter | None, tuple[str, ...], tuple[None, ...]]] = []
        for key, (typed, keyed) in nics.items():
            cols += [c for _, c in typed] + [c for _, c in keyed]
            getter = _tuple_getter(tuple(n for n, _ in typed)) if typed else None
            plan.append((key, getter, tuple(n for n, _ in keyed), (None,) * (len(typed) + len(keyed))))
        self.nics = tuple(plan)
        self.counters = len(cols)
        self.gpu_gauges = _by_gpu(gauges, cols)
        self.gauge_cols = cols[self.counters :]
        self.value_cols = np.array(cols, dtype=np.intp)
        at = self.value_cols[: self.counters] * _STATE
        self.raw_at, self.cum_at, self.boot_at = at + _RAW, at + _CUM, at + _BOOT
        links: dict[int, list[tuple[str, int]]] = {}
        for (gi, name), col in nvlinks.items():
            links.setdefault(gi, []).append((name, col))
        self.links = tuple((gi, tuple(entries), [col for _, col in entries]) for gi, entries in links.items())
        self.width = width
        # The columns of rate asks (``NodeHistory.last_rates``), which the column tables decide:
        # a caller asks the same few sets report after report (the pool frames: one for the GPUs,
        # one for the NICs), so resolving 100 keys is done once per layout, not once per report.
        self.resolved: dict[RateAsks, npt.NDArray[np.intp]] = {}


def _by_gpu(
    series: dict[tuple[int, str], int], cols: list[int]
) -> tuple[tuple[int, _Getter, tuple[None, ...]], ...]:
    """Per GPU index: a getter of its fields' values, in the order their columns go onto ``cols``."""
    per: dict[int, list[tuple[str, int]]] = {}
    for (gi, name), col in series.items():
        per.setdefault(gi, []).append((name, col))
    out = []
    for gi, entries in per.items():
        cols += [c for _, c in entries]
        out.append((gi, _tuple_getter(tuple(n for n, _ in entries)), (None,) * len(entries)))
    return tuple(out)


# Plans by the column tables they were built from, so that nodes with the same columns share one.
# Least recently built or shared first out, bounded by the columns of the plans kept (about 60
# bytes a column with its key): a fleet has a few layouts (one per GPU and NIC count, mostly), and
# a sender whose NICs change name every report only churns the cache.
_PLANS: dict[tuple[object, ...], _PushPlan] = {}
_MAX_PLAN_COLUMNS: Final = 1024


def _push_plan(
    gpu_counters: dict[tuple[int, str], int],
    nvlinks: dict[tuple[int, str], int],
    nic_counters: dict[tuple[str, int | None, str], int],
    gauges: dict[tuple[int, str], int],
    width: int,
) -> _PushPlan:
    # The series keys are the fleet's (``SeriesRegistry.key``): a tuple of them is 8 bytes a column,
    # and the column numbers as bytes 8 more, where a tuple of the items would be about 100.
    tables = (gpu_counters, nvlinks, nic_counters, gauges)
    key = (
        *(tuple(t) for t in tables),
        array("q", [c for t in tables for c in t.values()]).tobytes(),
        width,
    )
    plan = _PLANS.pop(key, None)
    if plan is None:
        plan = _PushPlan(gpu_counters, nvlinks, nic_counters, gauges, width)
        if width > _MAX_PLAN_COLUMNS // 4:
            return plan  # an odd node's own: shared by nobody, it would only push others out
        kept = sum(p.width for p in _PLANS.values())
        while _PLANS and kept + width > _MAX_PLAN_COLUMNS:
            kept -= _PLANS.pop(next(iter(_PLANS))).width
    _PLANS[key] = plan  # newest last
    return plan


@dataclasses.dataclass(frozen=True, eq=False)
class HistoryView:
    """A node after one ``add``; implements ``aggregator.fleet.view.NodeView``."""

    node: str
    report: Report  # the node's latest report by time
    previous: Report | None  # the previous report of the same boot
    rebooted: bool  # the latest's boot_id differs from the report just before it
    added: Report  # the report this add() took in (the latest, unless late/duplicate/expired)
    outcome: Outcome
    _history: NodeHistory = dataclasses.field(repr=False)

    def gpu_rate(self, gpu: int, field: str, window_s: float) -> float | None:
        return self._history.gpu_rate(gpu, field, window_s, self.report)

    def nvlink_rate(self, gpu: int, field: str, window_s: float) -> float | None:
        return self._history.nvlink_rate(gpu, field, window_s, self.report)

    def nic_rate(self, device: str, port: int | None, counter: str, window_s: float) -> float | None:
        return self._history.nic_rate(device, port, counter, window_s, self.report)

    def rates(self, asks: RateAsks, window_s: float) -> npt.NDArray[np.float64]:
        return self._history.rates(asks, window_s, self.report)

    def last_rates(self, asks: RateAsks) -> npt.NDArray[np.float64]:
        return self._history.last_rates(asks, self.report, self.previous)

    def gpu_samples(self, gpu: int, field: str, window_s: float) -> list[tuple[float, float | None]]:
        return self._history.gpu_samples(gpu, field, window_s, self.report)


if TYPE_CHECKING:
    # mypy proves here that HistoryView satisfies the protocol the rule engine is written against.
    _VIEW_IS_A_NODE_VIEW: type[NodeView] = HistoryView


class NodeHistory:
    """One node's recent past: the latest report in full (and the one before it until ``settle``),
    series of what was asked for."""

    # Slots: with this many attributes an instance would carry a dict of its own, one more object a
    # node for the cycle collector to track.
    __slots__ = (
        "_appended",
        "_boot_codes",
        "_boot_start",
        "_boots",
        "_data",
        "_gauges",
        "_gpu_counters",
        "_interval",
        "_last_kept_time",
        "_latest",
        "_layout",
        "_link_ids",
        "_link_prev",
        "_next_boot_code",
        "_nic_counters",
        "_nic_layout",
        "_nic_seen_at",
        "_nvlinks",
        "_pending",
        "_plan",
        "_previous",
        "_rebooted",
        "_rows_version",
        "_seen",
        "_span_key",
        "_span_rows",
        "_state",
        "_thin_from",
        "_times",
        "_width",
        "coarse_s",
        "fine_s",
        "max_nic_keys",
        "max_samples",
        "node",
        "registry",
        "window_s",
    )

    def __init__(
        self,
        node: str,
        *,
        window_s: float = 1800.0,
        interval_s: float = 10.0,
        fine_s: float = DEFAULT_FINE_SECONDS,
        coarse_s: float = DEFAULT_COARSE_SECONDS,
        registry: SeriesRegistry | None = None,
        max_nic_keys: int = DEFAULT_MAX_NIC_KEYS,
    ) -> None:
        if not (window_s > 0 and interval_s > 0 and fine_s >= 0 and coarse_s >= 0):
            raise ConfigError(
                f"history needs window_s, interval_s > 0 and fine_s, coarse_s >= 0; got "
                f"window_s={window_s} interval_s={interval_s} fine_s={fine_s} coarse_s={coarse_s}"
            )
        self.node = node
        self.window_s = window_s
        self.fine_s = min(fine_s, window_s)
        self.coarse_s = coarse_s
        self.registry = registry if registry is not None else SeriesRegistry()
        self.max_nic_keys = max_nic_keys
        spacing = max(coarse_s, interval_s)
        expected = self.fine_s / interval_s + (window_s - self.fine_s) / spacing + 2
        self.max_samples = 2 * math.ceil(expected) + 8
        self._clear()

    def _clear(self) -> None:
        self._latest: Report | None = None
        self._previous: Report | None = None
        self._rebooted = False
        self._times: array[float] = array("d")
        self._boots: list[str] = []
        self._boot_start = 0  # row of the first sample of the latest's boot run
        # Thinning state: rows before _thin_from were examined; [_pending, _thin_from) are to go.
        self._thin_from = 0
        self._pending = 0
        self._last_kept_time: float | None = None
        # (boot_id, seq, time) of reports taken in, for duplicates; insertion-ordered for eviction.
        self._seen: dict[tuple[str, int, float], None] = {}

        self._nic_seen_at: dict[NicKey, float] = {}  # NIC -> last seen present; LRU order
        self._nic_layout: tuple[NicKey, ...] = ()  # the NICs of the layout in force
        # Each series' column in ``_data``.
        self._gpu_counters: dict[tuple[int, str], int] = {}
        self._nvlinks: dict[tuple[int, str], int] = {}
        self._nic_counters: dict[tuple[str, int | None, str], int] = {}
        self._gauges: dict[tuple[int, str], int] = {}
        # Every series' numbers in one array, one row per sample (row r, column c at
        # ``r * _width + c``): a report writes one row, a thinned sample deletes one, and the
        # node holds one object for its numbers instead of one array and one object per series.
        self._data: array[float] = array("d")
        self._width = 0
        # Per column, _STATE numbers at ``col * _STATE``: the time of its first row (earlier rows
        # are padding, not nulls) and, for a counter, its last raw value, cumulative value and
        # boot (a code from _boot_code; NaN: no sample yet). One array, not lists: a full
        # collection visits every item of a list (145 per column list, most of what it walked per
        # node), none of an array's, and each array is one more object it tracks.
        self._state: array[float] = array("d")
        self._boot_codes: dict[str, float] = {}
        self._next_boot_code = 0.0
        # Per NVLink column that has counted: the link numbers of its last sample in report
        # order, and each link's last value this boot (None: none yet). Flat tuples of numbers,
        # which a collection stops tracking (a tuple of tuples can take more than one).
        self._link_ids: dict[int, _LinkIds] = {}
        self._link_prev: dict[int, _LinkValues] = {}
        self._layout: tuple[object, ...] | None = None
        self._plan: _PushPlan | None = None  # built by _push from the column tables
        self._rows_version = 0  # changes whenever rows are added or removed
        # ``_rows_version`` when the latest report's row was appended and the rows were trimmed:
        # while it holds, the last two rows are the previous report's and the latest's.
        self._appended = -1
        # ``last_rates``' per-column rates since the previous report, with the rows version and
        # the plan they were computed for; let go at ``settle``.
        self._interval: tuple[int, _PushPlan, npt.NDArray[np.float64]] | None = None
        self._span_key: tuple[float, float, int] | None = None
        self._span_rows = (0, -1)

    # -- reading -----------------------------------------------------------------------------

    @property
    def latest(self) -> Report | None:
        return self._latest

    @property
    def boot_id(self) -> str | None:
        return self._latest.boot_id if self._latest is not None else None

    def __len__(self) -> int:
        """Samples (rows) currently kept."""
        return len(self._times)

    def times(self) -> list[float]:
        """The kept sample times, oldest first."""
        return list(self._times)

    def view(self) -> HistoryView | None:
        """The node as of its latest report; None before the first one."""
        latest = self._latest
        return None if latest is None else self._view(latest, latest, "latest")

    def _view(self, latest: Report, added: Report, outcome: Outcome) -> HistoryView:
        return HistoryView(self.node, latest, self._previous, self._rebooted, added, outcome, self)

    def settle(self) -> None:
        """Let go of the previous report: whoever took the last view has finished with it.

        The previous report is needed only while the report after it is looked at (the rule
        engine compares the two, a new series starts from both); until the next ``add`` the
        node's latest report is all the history keeps in full, 38 KB an H100 node less. Views
        taken after this have no ``previous`` until the next report of the same boot."""
        self._previous = None
        self._interval = None

    # -- adding ------------------------------------------------------------------------------

    def add(self, report: Report) -> HistoryView:
        if report.node != self.node:
            raise ReportError(f"report of node {report.node!r} given to the history of {self.node!r}")
        latest = self._latest
        key = (sys.intern(report.boot_id), report.seq, report.time)
        if latest is None or report.time >= latest.time:
            if latest is not None and key in self._seen:
                return self._view(latest, report, "duplicate")
            self._seen[key] = None
            self._append(report)
            return self._view(report, report, "latest")
        if key in self._seen:
            return self._view(latest, report, "duplicate")
        if report.boot_id != latest.boot_id and report.boot_id not in self._boots:
            # A boot never seen, dated before the latest: the agent delivers in order, so it is the
            # next boot and the last one's clock ran ahead. Kept as "late" it would leave the
            # node judged by the old boot until the clock caught up (a day, at worst).
            _ratelog.warning(
                "history_new_boot_dated_back",
                "new boot dated before the latest report; starting the node's history over",
                extra={"node": self.node, "time": report.time, "latest_time": latest.time},
            )
            self._clear()
            self._seen[key] = None
            self._append(report)
            return self._view(report, report, "latest")
        if report.time < latest.time - self.window_s:
            if report.boot_id == latest.boot_id and report.seq > latest.seq:
                _ratelog.warning(
                    "history_clock_stepped_back",
                    "node clock stepped back past the history window; starting its history over",
                    extra={"node": self.node, "time": report.time, "latest_time": latest.time},
                )
                self._clear()
                self._seen[key] = None
                self._append(report)
                return self._view(report, report, "latest")
            log.debug(
                "report older than the history window dropped",
                extra={"node": self.node, "time": report.time, "latest_time": latest.time},
            )
            return self._view(latest, report, "expired")
        self._seen[key] = None
        self._insert_late(report, latest)
        return self._view(latest, report, "late")

    def _append(self, report: Report) -> None:
        old = self._latest
        # One string per boot rather than one per row: decoded reports each bring their own copy.
        boot = sys.intern(report.boot_id)
        self._ensure_series(report)
        self._times.append(report.time)
        self._boots.append(boot)
        self._rows_version += 1
        rows = len(self._times)
        if old is None:
            self._previous, self._rebooted = None, False
        elif old.boot_id == boot:
            self._previous, self._rebooted = old, False
        else:
            self._previous, self._rebooted = None, True
            self._boot_start = rows - 1
        self._latest = report
        self._push(report)
        self._evict(report.time)
        self._thin(report.time)
        self._forget_seen(report.time)
        self._appended = self._rows_version if self._previous is not None else -1

    def _push(self, report: Report) -> None:
        """Append the row of ``report`` (its time is already the last of ``_times``)."""
        boot = self._boot_code(report.boot_id)
        plan = self._current_plan()
        gpus = {g.index: g for g in report.gpus}
        values: list[object] = []
        gather = values.extend
        for gi, get, none in plan.gpu_counters:
            g = gpus.get(gi)
            gather(none if g is None else get(g))
        if plan.nics:
            nics = {(n.device, n.port): n for n in report.nics}
            for key, typed, keyed, none in plan.nics:
                nic = nics.get(key)
                if nic is None:
                    gather(none)
                    continue
                if typed is not None:
                    gather(typed(nic))
                if keyed:
                    counters = nic.counters
                    gather(map(counters.get, keyed) if isinstance(counters, dict) else none[: len(keyed)])
        for gi, get, none in plan.gpu_gauges:
            g = gpus.get(gi)
            gather(none if g is None else get(g))
        v = np.array(values, dtype=np.float64)  # None (no value) is NaN
        row = np.full(self._width, _NAN)
        k = plan.counters
        if k:
            value = v[:k]
            st = np.frombuffer(self._state)
            try:
                # What _count does, for every counter column at once.
                raw, cum = st[plan.raw_at], st[plan.cum_at]
                same_boot = st[plan.boot_at] == boot
                d = value - raw
                # Same boot: add the increase (went down: a reset, counts from zero); a new boot's
                # first sample is the baseline. No value: nothing changes.
                c = np.where(same_boot, cum + np.where(d >= 0, d, value), cum)
                valid = ~np.isnan(value)
                st[plan.raw_at[valid]] = value[valid]
                st[plan.cum_at[valid]] = c[valid]
                st[plan.boot_at[valid]] = boot
            finally:
                # A view of the array would lock it against resizing while it lived (a traceback
                # keeps a frame's locals).
                del st
            row[plan.value_cols[:k]] = np.where(valid, c, _NAN)
        if plan.gauge_cols:
            row[plan.value_cols[k:]] = v[k:]
        if plan.links:
            self._push_links(plan, gpus, boot, row)
        self._data.frombytes(row.tobytes())

    def _current_plan(self) -> _PushPlan:
        plan = self._plan
        if plan is None:
            plan = self._plan = _push_plan(
                self._gpu_counters, self._nvlinks, self._nic_counters, self._gauges, self._width
            )
        return plan

    def _push_links(
        self, plan: _PushPlan, gpus: dict[int, Gpu], boot: float, row: npt.NDArray[np.float64]
    ) -> None:
        """The NVLink sums of the row: ``_count_links`` per column, its common case at once.

        A GPU whose links are equal to those of the report just before (same boot; its row is the
        last one) counted nothing on any link: each of its columns is the last row's value, which
        is what ``_count_links`` would return (the cumulative sum, or NaN when no link has a
        value), and no state changes. One comparison of the two link tuples (in C) instead of a
        tuple of every link's value per column."""
        prev_report = self._previous
        prev_gpus: dict[int, Gpu] = {}
        if prev_report is not None and len(self._times) >= 2 and self._times[-2] == prev_report.time:
            prev_gpus = {g.index: g for g in prev_report.gpus}
        copy: list[int] = []
        for gi, entries, cols in plan.links:
            g = gpus.get(gi)
            before = prev_gpus.get(gi)
            if g is not None and before is not None and g.nvlink == before.nvlink:
                copy += cols
                continue
            links, ids = _links(g)
            for name, col in entries:
                row[col] = self._count_links(col, name, links, ids, boot)
        if copy:
            w = self._width
            at = np.array(copy, dtype=np.intp)
            row[at] = np.frombuffer(self._data[len(self._data) - w :])[at]

    def _boot_code(self, boot: str) -> float:
        """The number that stands for ``boot`` in the columns' state; never reused for another boot.

        Codes of boots that neither a row nor a column's last sample refers to are let go once
        there are ``_MAX_BOOT_CODES``: an agent that changes its boot id every report cannot grow
        the map past what the window holds."""
        code = self._boot_codes.get(boot)
        if code is None:
            if len(self._boot_codes) >= _MAX_BOOT_CODES:
                rows, cols = set(self._boots), set(self._state[_BOOT::_STATE])
                self._boot_codes = {b: c for b, c in self._boot_codes.items() if b in rows or c in cols}
            self._next_boot_code += 1.0
            code = self._boot_codes[boot] = self._next_boot_code
        return code

    def _count(self, col: int, value: float | None, boot: float) -> float:
        """Counter ``col``'s cumulative reset-safe increase at a new sample (NaN: no value)."""
        if value is None:
            return _NAN
        st, i = self._state, col * _STATE
        last_boot = st[i + _BOOT]
        if value == st[i + _RAW] and boot == last_boot:  # unchanged: the common case
            return st[i + _CUM]
        if boot != last_boot:
            c = st[i + _CUM]  # a new boot starts over: its first sample is the baseline
        else:
            d = value - st[i + _RAW]
            c = st[i + _CUM] + (d if d >= 0 else value)  # went down: reset, counts from zero
        st[i + _RAW] = value
        st[i + _CUM] = c
        st[i + _BOOT] = boot
        return c

    def _count_links(self, col: int, name: str, links: Sequence[NvLink], ids: _LinkIds, boot: float) -> float:
        """Like ``_count`` for an NVLink counter summed over a GPU's links, each link reset-safe."""
        values: _LinkValues = tuple(map(_LINK_GETTERS[name], links))
        st, i = self._state, col * _STATE
        if boot == st[i + _BOOT]:
            last_ids, last = self._link_ids.get(col, ()), self._link_prev.get(col, ())
        else:
            last_ids, last = (), ()  # a new boot: every link starts over
        if ids == last_ids and values == last:
            # Nothing counted since the last sample: by far the common case, at C speed.
            if values.count(None) == len(values):
                return _NAN
            return st[i + _CUM]
        if ids == last_ids:
            prev = last
        else:  # links appeared, vanished or moved: match them by number
            old = dict(zip(last_ids, last, strict=True))
            prev = tuple(old.get(i) for i in ids)
        delta = 0.0
        valid = False
        kept: list[int | None] = []
        for v, p in zip(values, prev, strict=True):
            if v is None:
                kept.append(p)
                continue
            valid = True
            if p is not None:
                d = v - p
                delta += d if d >= 0 else v
            kept.append(v)
        self._link_ids[col], self._link_prev[col] = ids, tuple(kept)
        if not valid:
            return _NAN
        c = st[i + _CUM] + delta
        st[i + _CUM] = c
        st[i + _BOOT] = boot
        return c

    def _insert_late(self, report: Report, latest: Report) -> None:
        if report.time < latest.time - self.fine_s:
            # It would be thinned away at once; counters lose nothing without it (see above).
            log.debug("late report past the fine horizon counted as seen", extra={"node": self.node})
            return
        row = bisect_right(self._times, report.time)
        self._times.insert(row, report.time)
        self._boots.insert(row, sys.intern(report.boot_id))
        self._rows_version += 1
        values = [_NAN] * self._width  # counters: NaN (see the module docstring)
        gpus = {g.index: g for g in report.gpus}
        for (gi, name), col in self._gauges.items():
            values[col] = _gauge_value(gpus.get(gi), name)
        at = row * self._width
        self._data[at:at] = array("d", values)
        boots = self._boots
        start = len(boots) - 1
        while start > 0 and boots[start - 1] == latest.boot_id:
            start -= 1
        self._boot_start = start
        if row == len(boots) - 2:
            # Now the row just before the latest: the latest's previous report, if of its boot.
            self._rebooted = boots[row] != latest.boot_id
            if not self._rebooted:
                self._previous = report
        self._evict(latest.time)
        self._forget_seen(latest.time)

    # -- series ------------------------------------------------------------------------------

    def _ensure_series(self, report: Report) -> None:
        """Create the registered series this report's GPUs and NICs do not have yet."""
        reg = self.registry
        gpu_idx = tuple(g.index for g in report.gpus)
        nic_keys = tuple((n.device, n.port) for n in report.nics) if reg.nic_counters else ()
        layout = (reg.version, gpu_idx, nic_keys)
        if layout == self._layout:
            return
        if self._latest is not None:
            self._note_nics(self._nic_layout, self._latest.time)  # present up to the last report
        self._layout = layout
        self._nic_layout = nic_keys
        if nic_keys:
            self._note_nics(nic_keys, report.time)
            self._forget_nics(set(nic_keys), report.time)
        # What is missing, keyed so that a GPU or NIC named twice gets one series; then the
        # columns for all of them at once (widening the rows copies every number).
        t = report.time
        new: dict[tuple[object, ...], Callable[[int], int]] = {}
        for gi in gpu_idx:
            for name in reg.gpu_counters:
                if (gi, name) not in self._gpu_counters:
                    new[("gpu", gi, name)] = functools.partial(self._new_gpu_counter, gi, name, t)
            for name in reg.nvlink_counters:
                if (gi, name) not in self._nvlinks:
                    new[("nvlink", gi, name)] = functools.partial(self._new_nvlink, gi, name, t)
            for name in reg.gpu_gauges:
                if (gi, name) not in self._gauges:
                    new[("gauge", gi, name)] = functools.partial(self._new_gauge, gi, name, t)
        for dev, port in nic_keys:
            for counter in reg.nic_counters:
                if (dev, port, counter) not in self._nic_counters:
                    new[("nic", dev, port, counter)] = functools.partial(
                        self._new_nic_counter, (dev, port), counter, t
                    )
        if new:
            col = self._add_columns(len(new))
            for i, make in enumerate(new.values()):
                make(col + i)

    def _note_nics(self, keys: Iterable[NicKey], at: float) -> None:
        seen = self._nic_seen_at
        for key in keys:
            seen.pop(key, None)
            seen[key] = at  # newest last: the dict is the LRU order

    def _forget_nics(self, present: set[NicKey], now: float) -> None:
        """Drop the series of NICs gone for longer than the window (they can answer no rate),
        and past ``max_nic_keys`` those gone longest: a node's NIC state is bounded whatever
        names its reports carry."""
        seen = self._nic_seen_at
        absent = [k for k in seen if k not in present]  # oldest first
        excess = len(seen) - self.max_nic_keys
        drop = [k for i, k in enumerate(absent) if i < excess or now - seen[k] > self.window_s]
        if not drop:
            return
        gone = set(drop)
        for key in drop:
            del seen[key]
        columns = {col for (dev, port, _), col in self._nic_counters.items() if (dev, port) in gone}
        self._nic_counters = {k: c for k, c in self._nic_counters.items() if (k[0], k[1]) not in gone}
        self._drop_columns(columns)

    def nic_keys(self) -> list[NicKey]:
        """The NICs the node's history holds series for (present or gone less than the window)."""
        return list(self._nic_seen_at)

    def _seeds(self) -> list[Report]:
        """The full reports that are the newest rows, oldest first: what a new series starts from."""
        latest, prev = self._latest, self._previous
        if latest is None:
            return []
        n = len(self._times)
        if (
            prev is not None
            and n >= 2
            and self._times[n - 2] == prev.time
            and self._boots[n - 2] == prev.boot_id
        ):
            return [prev, latest]
        return [latest]

    def _add_columns(self, k: int) -> int:
        """Widen every row by ``k`` NaN columns (no value yet); the first new column's number."""
        w, n = self._width, len(self._times)
        wide = w + k
        data = array("d", [_NAN]) * (n * wide)
        old = self._data
        for r in range(n):
            data[r * wide : r * wide + w] = old[r * w : (r + 1) * w]
        self._data, self._width = data, wide
        self._state.extend(_NEW_COLUMN_STATE * k)
        self._plan = None  # the column tables are about to change
        return w

    def _drop_columns(self, columns: set[int]) -> None:
        """Remove these columns from every row and renumber the rest (a NIC's series gone)."""
        if not columns:
            return
        self._plan = None
        w, n = self._width, len(self._times)
        keep = [c for c in range(w) if c not in columns]
        old = self._data
        self._data = array("d", [old[r * w + c] for r in range(n) for c in keep])
        self._width = len(keep)
        st, state = self._state, array("d")
        for c in keep:
            state.extend(st[c * _STATE : (c + 1) * _STATE])
        self._state = state
        renumber = {c: i for i, c in enumerate(keep)}
        self._link_ids = {renumber[c]: v for c, v in self._link_ids.items() if c in renumber}
        self._link_prev = {renumber[c]: v for c, v in self._link_prev.items() if c in renumber}
        _renumber(self._gpu_counters, renumber)
        _renumber(self._nvlinks, renumber)
        _renumber(self._nic_counters, renumber)
        _renumber(self._gauges, renumber)

    def _start(self, col: int, value: Callable[[Report], float], first: float) -> None:
        """Fill a new column's newest rows from the seeds, and date its start.

        ``first`` is the time of the report about to be pushed, for a series created before it.
        """
        seeds = self._seeds()
        w = self._width
        row = len(self._times) - len(seeds)
        for r in seeds:
            self._data[row * w + col] = value(r)
            row += 1
        self._state[col * _STATE + _SINCE] = seeds[0].time if seeds else first

    def _new_gpu_counter(self, gpu: int, name: str, first: float, col: int) -> int:
        self._start(
            col,
            lambda r: self._count(col, _gpu_value(_find_gpu(r, gpu), name), self._boot_code(r.boot_id)),
            first,
        )
        self._gpu_counters[self.registry.key((gpu, name))] = col
        return col

    def _new_nvlink(self, gpu: int, name: str, first: float, col: int) -> int:
        self._start(
            col,
            lambda r: self._count_links(col, name, *_links(_find_gpu(r, gpu)), self._boot_code(r.boot_id)),
            first,
        )
        self._nvlinks[self.registry.key((gpu, name))] = col
        return col

    def _new_nic_counter(self, nic: NicKey, counter: str, first: float, col: int) -> int:
        self._start(
            col,
            lambda r: self._count(col, _nic_value(_find_nic(r, nic), counter), self._boot_code(r.boot_id)),
            first,
        )
        self._nic_counters[self.registry.key((nic[0], nic[1], counter))] = col
        return col

    def _new_gauge(self, gpu: int, name: str, first: float, col: int) -> int:
        self._start(col, lambda r: _gauge_value(_find_gpu(r, gpu), name), first)
        self._gauges[self.registry.key((gpu, name))] = col
        return col

    # -- eviction and thinning -----------------------------------------------------------------

    def _delete_rows(self, start: int, end: int) -> None:
        n = end - start
        if n <= 0:
            return
        del self._times[start:end]
        del self._boots[start:end]
        self._rows_version += 1
        w = self._width
        del self._data[start * w : end * w]
        for attr in ("_boot_start", "_thin_from", "_pending"):
            row: int = getattr(self, attr)
            setattr(self, attr, row - n if row >= end else min(row, start))

    def _evict(self, now: float) -> None:
        old = bisect_left(self._times, now - self.window_s)
        old = max(old, len(self._times) - self.max_samples)
        if old > 0:
            self._delete_rows(0, old)

    def _thin(self, now: float) -> None:
        if self.coarse_s <= 0:
            return
        times, boots = self._times, self._boots
        horizon = now - self.fine_s
        last = len(times) - 1  # never the latest
        while self._thin_from < last and times[self._thin_from] < horizon:
            k = self._thin_from
            kept = self._last_kept_time
            if kept is None or k == 0 or boots[k] != boots[k - 1] or times[k] - kept >= self.coarse_s:
                start = self._pending
                self._delete_rows(start, k)
                k = min(k, start)
                self._last_kept_time = times[k]
                self._thin_from = self._pending = k + 1
                last = len(times) - 1
            else:
                self._thin_from += 1

    def _forget_seen(self, now: float) -> None:
        # Only reports inside the fine part can change anything when added again (an older late
        # report is only counted as seen), so only those are remembered.
        seen = self._seen
        cutoff = now - self.fine_s
        cap = self.max_samples
        while seen:
            first = next(iter(seen))
            if first[2] >= cutoff and len(seen) <= cap:
                break
            del seen[first]

    # -- rates -------------------------------------------------------------------------------

    def _span(self, window_s: float, now: float) -> tuple[int, int]:
        """Rows ``[lo, hi]`` of the current boot inside ``[now - window_s, now]``."""
        _check_window(window_s)
        times = self._times
        hi = len(times) - 1
        if times[hi] > now:
            hi = bisect_right(times, now) - 1
        lo = max(bisect_left(times, now - window_s), self._boot_start)
        # Every series of the node shares the rows, and the rule engine asks many series for the
        # same window in a row: the answer is kept until the window or the rows change.
        self._span_key = (window_s, now, self._rows_version)
        self._span_rows = (lo, hi)
        return lo, hi

    def _rows_for(self, window_s: float, at: Report) -> tuple[int, int] | None:
        """``_span`` of the window ending at ``at`` (kept while the window and rows stay the
        same); None when ``at`` is not of the latest's boot, which no rate can reach back to."""
        latest = self._latest
        if latest is None or (at is not latest and at.boot_id != latest.boot_id):
            return None
        key = self._span_key
        if key is not None and key[0] == window_s and key[1] == at.time and key[2] == self._rows_version:
            return self._span_rows
        return self._span(window_s, at.time)

    def _rate(self, col: int, window_s: float, at: Report) -> float | None:
        rows = self._rows_for(window_s, at)
        if rows is None:
            return None
        lo, hi = rows
        if lo > hi or self._state[col * _STATE + _SINCE] > self._times[lo]:
            # The series was started after the window (this boot's part of it) began: its rate
            # would spread the window's increase over less time than the window. No rate is
            # better than an inflated one; the rule engine asks on a node's first report, so in
            # practice every series it uses covers the node's whole history.
            return None
        data, w = self._data, self._width
        first = data[lo * w + col]
        while lo < hi and math.isnan(first):  # NaN: no value in that sample
            lo += 1
            first = data[lo * w + col]
        last = data[hi * w + col]
        while hi > lo and math.isnan(last):
            hi -= 1
            last = data[hi * w + col]
        if hi <= lo:
            return None
        times = self._times
        dt = times[hi] - times[lo]
        if dt <= 0:
            return None
        return (last - first) / dt

    def rates(self, asks: RateAsks, window_s: float, at: Report) -> npt.NDArray[np.float64]:
        """``_rate`` of many series over one window (``NodeView.rates``), NaN for None.

        The rows at the window's two ends are read once for all the series, and every series
        whose samples there both hold a value gets its rate in one numpy expression, with the
        same float64 operations as ``_rate``, so the answers are identical. A series not created
        yet, or with no value at an end, goes through the single-rate path."""
        cols = [
            *map(self._gpu_counters.get, asks.gpu),
            *map(self._nvlinks.get, asks.nvlink),
            *map(self._nic_counters.get, asks.nic),
        ]
        out = np.full(len(cols), _NAN)
        # Where each resolved series' answer goes in ``out``.
        where = np.arange(len(cols), dtype=np.intp)
        if None in cols:
            # The single-rate path creates the series (a new column, appended: the numbers of
            # those already resolved stay valid).
            for i, col in enumerate(cols):
                if col is None:
                    out[i] = self._single(asks, i, window_s, at)
            where = np.flatnonzero([col is not None for col in cols])
            cols = [cols[i] for i in where.tolist()]
        rows = self._rows_for(window_s, at) if cols else None
        if rows is None or rows[0] > rows[1]:
            return out
        lo, hi = rows
        w, times = self._width, self._times
        c = np.array(cols, dtype=np.intp)
        # Copies of two rows and of the columns' start times: numpy views of the arrays themselves
        # would lock them against the next append while any view lived.
        first = np.frombuffer(self._data[lo * w : (lo + 1) * w])[c]
        last = np.frombuffer(self._data[hi * w : (hi + 1) * w])[c]
        started = np.frombuffer(self._state[_SINCE::_STATE])[c] <= times[lo]
        both = started & ~np.isnan(first) & ~np.isnan(last)
        dt = times[hi] - times[lo]
        if hi > lo and dt > 0:
            out[where] = np.where(both, (last - first) / dt, _NAN)
        for j in np.flatnonzero(started & ~both).tolist():
            # No value at an end of the window: _rate looks inward for the nearest samples.
            r = self._rate(int(c[j]), window_s, at)
            out[where[j]] = _NAN if r is None else r
        return out

    def last_rates(self, asks: RateAsks, at: Report, previous: Report | None) -> npt.NDArray[np.float64]:
        """Each ask's rate since ``previous`` (``NodeView.last_rates``), NaN without one.

        While the last two rows are the previous report's and ``at``'s (the latest), every
        column's rate between them is computed once (one numpy expression over the two rows:
        the same float64 operations as ``_rate``) and an ask set's columns are resolved once per
        layout (``_PushPlan.resolved``), so an answer is one indexing. Otherwise (a late report
        landed between them, ``at`` is an older view's, a series is not created yet) it is
        ``rates`` over the window that reaches back to ``previous``."""
        if previous is None:
            return np.full(len(asks.gpu) + len(asks.nvlink) + len(asks.nic), _NAN)
        times = self._times
        n = len(times)
        if (
            at is not self._latest
            or self._appended != self._rows_version
            or n < 2
            or times[n - 2] != previous.time
        ):
            return self.rates(asks, at.time - previous.time + _INTERVAL_SLACK_S, at)
        plan = self._current_plan()
        cols = plan.resolved.get(asks)
        if cols is None:
            resolved = [
                *map(self._gpu_counters.get, asks.gpu),
                *map(self._nvlinks.get, asks.nvlink),
                *map(self._nic_counters.get, asks.nic),
            ]
            if None in resolved:  # the general path creates the series
                return self.rates(asks, at.time - previous.time + _INTERVAL_SLACK_S, at)
            if len(plan.resolved) >= _MAX_RESOLVED:
                plan.resolved.clear()
            cols = plan.resolved[asks] = np.array(resolved, dtype=np.intp)
        cached = self._interval
        if cached is not None and cached[0] == self._rows_version and cached[1] is plan:
            return cached[2][cols]
        w = self._width
        # A copy of the two rows (a view would lock the array against the next append). A series
        # started after the previous report has no value in its row (rows before a series' start
        # are NaN padding), so it gets no rate, as ``rates`` gives none for a window it misses.
        two = np.frombuffer(self._data[(n - 2) * w : n * w])
        dt = times[n - 1] - times[n - 2]
        every = (two[w:] - two[:w]) / dt if dt > 0 else np.full(w, _NAN)  # NaN: no value at an end
        self._interval = (self._rows_version, plan, every)
        return every[cols]

    def _single(self, asks: RateAsks, i: int, window_s: float, at: Report) -> float:
        """Ask ``i`` of ``asks`` through its single-rate method, NaN for None."""
        gpus, nvlinks = len(asks.gpu), len(asks.nvlink)
        if i < gpus:
            gpu, name = asks.gpu[i]
            r = self.gpu_rate(gpu, name, window_s, at)
        elif i < gpus + nvlinks:
            gpu, name = asks.nvlink[i - gpus]
            r = self.nvlink_rate(gpu, name, window_s, at)
        else:
            device, port, counter = asks.nic[i - gpus - nvlinks]
            r = self.nic_rate(device, port, counter, window_s, at)
        return _NAN if r is None else r

    def gpu_rate(self, gpu: int, name: str, window_s: float, at: Report) -> float | None:
        c = self._gpu_counters.get((gpu, name))
        if c is None:
            _known("GPU counter", name, GPU_COUNTER_FIELDS)
            self.registry.track_gpu_counters(name)
            if _find_gpu(at, gpu) is None:
                return None
            c = self._new_gpu_counter(gpu, name, at.time, self._add_columns(1))
        return self._rate(c, window_s, at)

    def nvlink_rate(self, gpu: int, name: str, window_s: float, at: Report) -> float | None:
        c = self._nvlinks.get((gpu, name))
        if c is None:
            _known("NVLink counter", name, NVLINK_COUNTER_FIELDS)
            self.registry.track_nvlink_counters(name)
            if _find_gpu(at, gpu) is None:
                return None
            c = self._new_nvlink(gpu, name, at.time, self._add_columns(1))
        return self._rate(c, window_s, at)

    def nic_rate(
        self, device: str, port: int | None, counter: str, window_s: float, at: Report
    ) -> float | None:
        c = self._nic_counters.get((device, port, counter))
        if c is None:
            self.registry.track_nic_counters(counter)
            if _find_nic(at, (device, port)) is None:
                return None
            c = self._new_nic_counter((device, port), counter, at.time, self._add_columns(1))
        return self._rate(c, window_s, at)

    def gpu_samples(
        self, gpu: int, name: str, window_s: float, at: Report
    ) -> list[tuple[float, float | None]]:
        _check_window(window_s)
        g = self._gauges.get((gpu, name))
        if g is None:
            _known("GPU sample", name, GPU_SAMPLE_FIELDS)
            self.registry.track_gpu_gauges(name)
            if _find_gpu(at, gpu) is None:
                return []
            g = self._new_gauge(gpu, name, at.time, self._add_columns(1))
        times = self._times
        now = at.time
        lo = bisect_left(times, max(now - window_s, self._state[g * _STATE + _SINCE]))
        hi = bisect_right(times, now)
        data, w = self._data, self._width
        values = [data[i * w + g] for i in range(lo, hi)]
        return [(times[i], None if math.isnan(v) else v) for i, v in zip(range(lo, hi), values, strict=True)]


def _renumber(series: dict[_K, int], renumber: dict[int, int]) -> None:
    for key, col in series.items():
        series[key] = renumber[col]


def _find_gpu(report: Report, index: int) -> Gpu | None:
    gpus = report.gpus
    if index < len(gpus) and gpus[index].index == index:
        return gpus[index]
    for g in gpus:
        if g.index == index:
            return g
    return None


def _find_nic(report: Report, key: NicKey) -> Nic | None:
    for n in report.nics:
        if n.device == key[0] and n.port == key[1]:
            return n
    return None


class Fleet:
    """Every node's ``NodeHistory``, sharing one ``SeriesRegistry``."""

    def __init__(
        self,
        config: FleetConfig | None = None,
        *,
        fine_seconds: float = DEFAULT_FINE_SECONDS,
        coarse_seconds: float = DEFAULT_COARSE_SECONDS,
        registry: SeriesRegistry | None = None,
        max_nic_keys: int = DEFAULT_MAX_NIC_KEYS,
    ) -> None:
        self.config = config if config is not None else FleetConfig()
        self.max_nic_keys = max_nic_keys
        self.fine_seconds = fine_seconds
        self.coarse_seconds = coarse_seconds
        self.registry = registry if registry is not None else SeriesRegistry()
        self._nodes: dict[str, NodeHistory] = {}

    def add(self, report: Report) -> HistoryView:
        h = self._nodes.get(report.node)
        if h is None:
            h = self._nodes[report.node] = NodeHistory(
                report.node,
                window_s=self.config.window_seconds,
                interval_s=self.config.interval_seconds,
                fine_s=self.fine_seconds,
                coarse_s=self.coarse_seconds,
                registry=self.registry,
                max_nic_keys=self.max_nic_keys,
            )
        return h.add(report)

    def forget(self, node: str) -> bool:
        """Drop a node's history (it left the fleet); False when it had none."""
        return self._nodes.pop(node, None) is not None

    def nodes(self) -> list[str]:
        return list(self._nodes)

    def history(self, node: str) -> NodeHistory | None:
        return self._nodes.get(node)

    def settle(self, node: str) -> None:
        """The view of the node's last ``add`` has been used: keep only its latest report in full
        (``NodeHistory.settle``)."""
        h = self._nodes.get(node)
        if h is not None:
            h.settle()

    def view(self, node: str) -> HistoryView | None:
        """The node's view as of its latest report, without adding anything."""
        h = self._nodes.get(node)
        return h.view() if h is not None else None

    def last_report_time(self, node: str) -> float | None:
        """The ``time`` of the node's latest report (its own clock), None for an unknown node."""
        h = self._nodes.get(node)
        latest = h.latest if h is not None else None
        return latest.time if latest is not None else None

    def __contains__(self, node: object) -> bool:
        return node in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)
