"""Columnar state per pool, so that peer detectors compare a node with its pool in a few numpy calls.

A ``PoolFrame`` holds, for one pool and each slot, float32 GPU values ``(nodes, gpus,
len(GPU_FIELDS))`` and NIC values ``(nodes, nics, len(NIC_FIELDS))``; NaN is "no value" (not
reported, null, GPU or NIC absent, slot not written). Time is a ring of slots ``interval_seconds``
wide: slot number ``k = floor(t / interval)`` lives at position ``k % slots``. When the newest slot
number moves forward, the positions of every slot number it passes are cleared first, so a position
never shows data of an older time, and a slot no report landed in reads NaN. Nodes are rows; the row
capacity grows by a quarter when full (``_GROWTH``), and a forgotten node's row is filled with the
last row (swap-remove), so rows ``[0, n)`` are always the live nodes. After a growth each position
moves to the larger arrays when it next changes, and one more moves at every write, so no single
write copies the whole frame (see ``PoolFrame._resize``). Each slot has arrays of its
own, so that a reader on another thread can hold a slot instead of copying it (``FrameWindow``: the
frame copies a slot on write while a window holds it).

Columns are named by module constants (``GPU_COLUMN["temperature_celsius"]``) so detectors never
hard-code an index. Gauges come from the node's latest report; counter rates are the view's
reset-safe rates over the last interval (since the previous report of the same boot; NaN after
a reboot or for a node's first report), taken from the ``NodeView`` and never recomputed here:
each block asks all of its rates in one ``NodeView.last_rates`` call (about a hundred a report for
an 8-GPU, 8-port node), which the history answers from the rates it computed once for every column
between its two newest rows. The asks themselves are cached per GPU set and per NIC set (with which
counters each NIC has), so a report builds none.

Memory, and why the frame covers 10 minutes rather than the whole history window
-------------------------------------------------------------------------------
Covering the default 1,800 s window at 10 s would take 180 slots: for 7,500 nodes x 8 GPUs x 19
fields x 4 bytes that is 821 MB, plus the NIC frame (7,500 x 8 NICs x 9 fields x 4 bytes x 180 =
389 MB): over 1 GB for state that peer detectors read only the recent part of. A peer detector
asks "is this node, now and for the last few minutes, unlike its pool?": it compares nodes at the
same moments and needs a persistence of minutes, not half an hour. A node's own longer past is in
its ``NodeHistory`` (rates over any window, ``gpu_samples``). So the frame covers ``frame_seconds``
(default 600 s: 60 slots at 10 s):

    GPU: 7,500 nodes x 8 GPUs x 19 fields x 60 slots x 4 B = 274 MB
    NIC: 7,500 nodes x 8 NICs x  9 fields x 60 slots x 4 B = 130 MB

404 MB in all for 7,500 nodes (54 MB for 1,000), up to a quarter more just after the row capacity
of a big pool grew (doubling leaves a quarter of the capacity unused on average, up to half).
float16 would halve it but cannot hold bytes per second (max 65,504) and has 3 significant digits,
which peer comparisons of power or clocks need; float32 is kept.

At a longer interval the frame keeps 60 slots rather than 600 s, up to the history window
(``FRAME_SLOTS``): the detectors count slots (the trend detector's baseline and persistence
windows need 24 of them, the peer detector's quarantine 6 slots of evidence), and at a 60 s
interval 600 s would be 10 slots, in which the trend detector could never judge anything. At 60 s
the frame holds 30 slots (the 1,800 s history window), half the bytes of the 10 s frame.

Slots use the report's own time unless ``record(..., at=...)`` passes another clock: a node whose
clock runs far ahead would otherwise move its pool's newest slot forward and clear the frame, so the
pipeline passes when the report was measured on its own clock, never after its receipt
(``aggregator.fleet.sendtime``).
"""

from __future__ import annotations

import functools
import logging
import math
import operator
import types
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import numpy as np
import numpy.typing as npt

from agent.errors import ConfigError
from agent.report import (
    CATALOGUE,
    CLOCK_EVENT_REASONS,
    NIC_COUNTER_NAMES,
    NIC_TYPED_COUNTERS,
    Gpu,
    Nic,
    NvLink,
)
from aggregator.config import FleetConfig
from aggregator.fleet.history import HistoryView
from aggregator.fleet.pools import Placement
from aggregator.fleet.view import NodeView, RateAsks
from aggregator.ratelog import RateLimitedLog

log = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float32]

_NAN: Final = math.nan
DEFAULT_FRAME_SECONDS: Final = 600.0
# ... or this many slots where the interval is longer than 10 s, up to the history window (the
# module docstring): detectors count slots, and too few leave them nothing to judge.
FRAME_SLOTS: Final = 60
DEFAULT_MAX_NICS: Final = 16
_INITIAL_ROWS: Final = 8
# Row capacity grows by this factor: the frame is a node's largest holder (52 KB at 8 GPUs, 8 NICs),
# and growing it copies only at node joins, so a small factor costs little CPU.
_GROWTH: Final = 1.25


def _f(v: float | None) -> float:
    return _NAN if v is None else float(v)


def _ratio(num: float | None, den: float | None) -> float:
    if num is None or den is None or den <= 0:
        return _NAN
    return num / den


def _gauge(struct: type[Gpu] | type[Nic], name: str) -> str:
    """``name``, after checking the catalogue (agent/report.py) calls it a gauge of ``struct``."""
    info = CATALOGUE[struct].get(name)
    if info is None or info.kind != "gauge":
        raise TypeError(f"frame column reads {struct.__name__}.{name}, which is not a gauge")
    return name


def _value(struct: type[Gpu] | type[Nic], name: str) -> Callable[[Any], float]:
    field = _gauge(struct, name)
    return lambda obj: _f(getattr(obj, field))


def _share(num: str, den: str) -> Callable[[Gpu], float]:
    n, d = _gauge(Gpu, num), _gauge(Gpu, den)
    return lambda g: _ratio(getattr(g, n), getattr(g, d))


def _bit(reason: str) -> Callable[[Gpu], float]:
    mask = CLOCK_EVENT_REASONS[reason].bit

    def flag(g: Gpu) -> float:
        r = g.clock_event_reasons
        return _NAN if r is None else float(bool(r & mask))

    return flag


# Clock event reasons as 0/1 columns: (column, the reason's name in CLOCK_EVENT_REASONS). The
# columns keep their short names; which reasons are slowdowns is the catalogue's to say.
_REASON_COLUMNS: Final[tuple[tuple[str, str], ...]] = (
    ("sw_power_cap", "sw_power_cap"),
    ("hw_slowdown", "hw_slowdown"),
    ("sw_thermal", "sw_thermal_slowdown"),
    ("hw_thermal", "hw_thermal_slowdown"),
    ("power_brake", "hw_power_brake_slowdown"),
    # Clocks set by the admin (nvidia-smi -ac / -lgc): policy, which the peer detector leaves unscored.
    ("app_clocks", "applications_clocks_setting"),
)
# The columns of the reasons that are never part of healthy work, for the detectors.
SLOWDOWN_COLUMNS: Final[tuple[str, ...]] = tuple(
    column for column, reason in _REASON_COLUMNS if CLOCK_EVENT_REASONS[reason].slowdown
)
if {reason for _, reason in _REASON_COLUMNS if CLOCK_EVENT_REASONS[reason].slowdown} != {
    name for name, reason in CLOCK_EVENT_REASONS.items() if reason.slowdown
}:
    raise TypeError("every slowdown reason of CLOCK_EVENT_REASONS needs a frame column")

# (column, value from the GPU of the latest report).
_GPU_GAUGES: Final[tuple[tuple[str, Callable[[Gpu], float]], ...]] = (
    ("utilization_ratio", _value(Gpu, "utilization_ratio")),
    ("sm_clock_ratio", _share("sm_clock_hz", "sm_clock_max_hz")),
    ("temperature_celsius", _value(Gpu, "temperature_celsius")),
    ("memory_temperature_celsius", _value(Gpu, "memory_temperature_celsius")),
    ("power_watts", _value(Gpu, "power_watts")),
    ("power_limit_watts", _value(Gpu, "power_limit_watts")),
    *((column, _bit(reason)) for column, reason in _REASON_COLUMNS),
    ("pcie_link_width_ratio", _share("pcie_link_width", "pcie_link_width_max")),
    ("pcie_link_gen_ratio", _share("pcie_link_gen", "pcie_link_gen_max")),
)
# (column, which rate of the view, the fields summed): per second over the last interval.
_GPU_RATES: Final[tuple[tuple[str, Literal["gpu", "nvlink"], tuple[str, ...]], ...]] = (
    ("ecc_sbe_per_second", "gpu", ("ecc_sbe_volatile_total",)),
    ("pcie_replay_per_second", "gpu", ("pcie_replay_total",)),
    ("nvlink_crc_per_second", "nvlink", ("crc_flit_errors_total", "crc_data_errors_total")),
    ("nvlink_replay_per_second", "nvlink", ("replay_errors_total",)),
    ("nvlink_recovery_per_second", "nvlink", ("recovery_errors_total",)),
)
# (column, NIC counters in order of preference: InfiniBand's PMA name, then the netdev one).
_NIC_RATES: Final[tuple[tuple[str, tuple[str, ...]], ...]] = (
    ("symbol_error_per_second", ("symbol_error",)),
    ("link_downed_per_second", ("link_downed", "carrier_down_count")),
    ("port_rcv_errors_per_second", ("port_rcv_errors", "rx_errors")),
    ("port_xmit_discards_per_second", ("port_xmit_discards", "tx_dropped")),
    ("link_error_recovery_per_second", ("link_error_recovery",)),
    ("rx_bytes_per_second", ("rx_bytes_total",)),
    ("tx_bytes_per_second", ("tx_bytes_total",)),
)


def _check_rates() -> None:
    """Every field a rate column sums is a counter in the catalogue (or a known NIC counter)."""
    for column, kind, fields in _GPU_RATES:
        struct = Gpu if kind == "gpu" else NvLink
        for name in fields:
            info = CATALOGUE[struct].get(name)
            if info is None or info.kind != "counter":
                raise TypeError(f"frame column {column} sums {struct.__name__}.{name}, not a counter")
    for column, names in _NIC_RATES:
        for name in names:
            if name not in NIC_TYPED_COUNTERS and name not in NIC_COUNTER_NAMES:
                raise TypeError(f"frame column {column} reads {name!r}, not a NIC counter")


_check_rates()
_LINK_UP_STATES: Final = frozenset({"ACTIVE", "UP"})  # InfiniBand port state, netdev operstate


def _link_up(n: Nic) -> float:
    return _NAN if n.state is None else float(n.state.upper() in _LINK_UP_STATES)


_NIC_GAUGES: Final[tuple[tuple[str, Callable[[Nic], float]], ...]] = (
    ("link_rate_bytes_per_second", _value(Nic, "rate_bytes_per_second")),
    ("link_up", _link_up),
)

GPU_FIELDS: Final[tuple[str, ...]] = tuple(name for name, _ in _GPU_GAUGES) + tuple(
    name for name, _, _ in _GPU_RATES
)
NIC_FIELDS: Final[tuple[str, ...]] = tuple(name for name, _ in _NIC_RATES) + tuple(
    name for name, _ in _NIC_GAUGES
)
GPU_COLUMN: Final[Mapping[str, int]] = types.MappingProxyType({n: i for i, n in enumerate(GPU_FIELDS)})
NIC_COLUMN: Final[Mapping[str, int]] = types.MappingProxyType({n: i for i, n in enumerate(NIC_FIELDS)})

NicKey = tuple[str, int | None]


def nic_name(key: NicKey) -> str:
    """How a NIC column is named: ``mlx5_0:1`` for an RDMA port, ``eth0`` for a netdev."""
    device, port = key
    return device if port is None else f"{device}:{port}"


# Per NIC rate column: its number and its counters in order of preference, each with whether it is
# a typed field of ``Nic`` (else a key of ``Nic.counters``). The first one the NIC has is read.
_NIC_SOURCES: Final[tuple[tuple[int, tuple[tuple[str, bool], ...]], ...]] = tuple(
    (col, tuple((name, name in NIC_TYPED_COUNTERS) for name in names))
    for col, (_, names) in enumerate(_NIC_RATES)
)


@functools.lru_cache(maxsize=64)
def _gpu_rate_plan(indices: tuple[int, ...]) -> tuple[RateAsks, npt.NDArray[np.intp], npt.NDArray[np.intp]]:
    """The rate asks of a GPU block whose GPUs are ``indices`` (distinct, each below the block's
    height): the asks, the rate cell each answer adds to (numbered from 0), and each rate cell's
    flat position in the block. Cached: a node's GPUs are the same report after report."""
    gpu_asks: list[tuple[int, str]] = []
    link_asks: list[tuple[int, str]] = []
    gpu_owner: list[int] = []
    link_owner: list[int] = []
    cells: list[int] = []
    for gi in indices:
        for offset, (_, kind, fields) in enumerate(_GPU_RATES):
            cell = len(cells)
            cells.append(gi * len(GPU_FIELDS) + len(_GPU_GAUGES) + offset)
            asks, owner = (gpu_asks, gpu_owner) if kind == "gpu" else (link_asks, link_owner)
            asks.extend((gi, f) for f in fields)
            owner.extend([cell] * len(fields))
    owners, positions = np.array(gpu_owner + link_owner, dtype=np.intp), np.array(cells, dtype=np.intp)
    owners.flags.writeable = positions.flags.writeable = False  # shared by every caller
    return RateAsks(gpu=tuple(gpu_asks), nvlink=tuple(link_asks)), owners, positions


def gpu_block(view: NodeView, gpus: int) -> FloatArray:
    """One node's GPU row for one slot: ``(gpus, len(GPU_FIELDS))``, NaN where nothing is known."""
    report = view.report
    prev = view.previous
    rows: list[list[float]] = [[_NAN] * len(GPU_FIELDS) for _ in range(gpus)]
    indices: dict[int, None] = {}
    for g in report.gpus:
        if g.index >= gpus:
            log.debug("GPU index beyond the frame's max_gpus", extra={"node": view.node, "gpu": g.index})
            continue
        indices[g.index] = None
        row = rows[g.index]
        for col, (_, value) in enumerate(_GPU_GAUGES):
            row[col] = value(g)
    block = np.array(rows, dtype=np.float32).reshape(gpus, len(GPU_FIELDS))
    if prev is not None and indices:
        asks, owner, cells = _gpu_rate_plan(tuple(indices))
        rates = view.last_rates(asks)
        # A cell sums its fields' rates (the NVLink CRC column: flit and data errors), those
        # known; NaN when none is. Two at most, so adding them in turn rounds as fsum did.
        # (bincount gives integers when nothing is known.)
        known = ~np.isnan(rates)
        sums = np.bincount(owner[known], weights=rates[known], minlength=len(cells)).astype(np.float64)
        sums[np.bincount(owner[known], minlength=len(cells)) == 0] = _NAN
        block.reshape(-1)[cells] = sums
    return block


# Which of the NIC rate sources a NIC has: the typed ones (not None) and the keys of its counters.
_TYPED_SOURCES: Final[tuple[str, ...]] = tuple(
    dict.fromkeys(name for _, sources in _NIC_SOURCES for name, typed in sources if typed)
)
_KEYED_SOURCES: Final[tuple[str, ...]] = tuple(
    dict.fromkeys(name for _, sources in _NIC_SOURCES for name, typed in sources if not typed)
)
_NONES: Final = (None,) * len(_TYPED_SOURCES)
_NO_COUNTERS: Final[Mapping[str, int]] = types.MappingProxyType({})


def _has_sources(n: Nic) -> tuple[bool, ...]:
    """Per source name (``_TYPED_SOURCES``, then ``_KEYED_SOURCES``): whether ``n`` has it. A
    tuple of the same few patterns report after report, which ``_nic_rate_plan`` is cached by."""
    typed = [getattr(n, name) for name in _TYPED_SOURCES]
    counters = n.counters if isinstance(n.counters, dict) else _NO_COUNTERS
    return (*map(operator.is_not, typed, _NONES), *map(counters.__contains__, _KEYED_SOURCES))


_SOURCE_AT: Final[Mapping[str, int]] = types.MappingProxyType(
    {name: i for i, name in enumerate(_TYPED_SOURCES + _KEYED_SOURCES)}
)


@functools.lru_cache(maxsize=64)
def _nic_rate_plan(
    keys: tuple[NicKey, ...], has: tuple[tuple[bool, ...] | None, ...]
) -> tuple[RateAsks, npt.NDArray[np.intp]]:
    """The rate asks of a NIC block for ``keys`` whose NICs have the sources ``has`` (None: the NIC
    is not in the report), each NIC's rate column reading the first source it has, and each
    answer's flat position in the block. Cached: a node's NICs and counters stay the same."""
    asks: list[tuple[str, int | None, str]] = []
    cells: list[int] = []
    for i, ((device, port), present) in enumerate(zip(keys, has, strict=True)):
        if present is None:
            continue
        for col, sources in _NIC_SOURCES:
            for name, _ in sources:
                if present[_SOURCE_AT[name]]:
                    asks.append((device, port, name))
                    cells.append(i * len(NIC_FIELDS) + col)
                    break
    positions = np.array(cells, dtype=np.intp)
    positions.flags.writeable = False  # shared by every caller
    return RateAsks(nic=tuple(asks)), positions


def nic_block(view: NodeView, keys: Sequence[NicKey]) -> FloatArray:
    """One node's NIC rows for one slot, in the order of ``keys``: ``(len(keys), len(NIC_FIELDS))``."""
    by_key = {(n.device, n.port): n for n in view.report.nics}
    rows: list[list[float]] = []
    has: list[tuple[bool, ...] | None] = []
    for key in keys:
        row = [_NAN] * len(NIC_FIELDS)
        rows.append(row)
        n = by_key.get(key)
        if n is None:
            has.append(None)
            continue
        has.append(_has_sources(n))
        for col, (_, value) in enumerate(_NIC_GAUGES, start=len(_NIC_RATES)):
            row[col] = value(n)
    block = np.array(rows, dtype=np.float32).reshape(len(keys), len(NIC_FIELDS))
    if view.previous is not None:
        asks, cells = _nic_rate_plan(tuple(keys), tuple(has))
        if len(cells):
            block.reshape(-1)[cells] = view.last_rates(asks)
    return block


@dataclass(frozen=True)
class FrameWindow:
    """A pool frame's live rows over a slot range, frozen (``PoolFrame.window``).

    Nothing here changes after the window is taken, so any thread may read it while the frame goes
    on taking reports. Taking one copies nothing: the window holds read-only views of the frame's
    per-slot arrays, and the frame copies a slot before it next changes that slot in place while a
    window still holds it (copy on write; see ``PoolFrame``). Detectors read only complete slots,
    which the frame rarely writes again, so it almost never has to. ``gpu`` and ``nic`` stack the
    slots into one array when first read: in the reader's thread, not on the event loop. ``nic``
    and ``nic_keys`` are empty unless the NIC frame was asked for.
    """

    pool: str
    interval_s: float
    nodes: tuple[str, ...]  # row order of the arrays
    starts: npt.NDArray[np.float64]  # (slots,): each slot's start time, oldest first
    nic_keys: tuple[tuple[NicKey, ...], ...]  # per node, its NIC columns in order (with NICs)
    # Per slot, oldest first: views of the frame's arrays, (nodes, gpus, GPU_FIELDS) and (nodes, nics,
    # NIC_FIELDS). Private: the frame leaves them alone only while the window lives, so a reader
    # takes ``gpu`` and ``nic``, which are the window's own.
    _gpu_slots: tuple[FloatArray, ...]
    _nic_slots: tuple[FloatArray, ...]
    gpus: int  # GPU columns per node
    nic_width: int  # NIC columns per node (0 without NICs)

    @functools.cached_property
    def gpu(self) -> FloatArray:
        """``(slots, nodes, gpus, GPU_FIELDS)``, read-only."""
        return _stack(self._gpu_slots, (len(self.nodes), self.gpus, len(GPU_FIELDS)))

    @functools.cached_property
    def nic(self) -> FloatArray:
        """``(slots, nodes, nics, NIC_FIELDS)``, or ``(0, 0, 0, NIC_FIELDS)`` without NICs; read-only."""
        if not self.nic_width:
            return _stack((), (0, 0, len(NIC_FIELDS)))
        return _stack(self._nic_slots, (len(self.nodes), self.nic_width, len(NIC_FIELDS)))


def _stack(slots: tuple[FloatArray, ...], shape: tuple[int, int, int]) -> FloatArray:
    """The slots as one read-only array of ``(len(slots), *shape)``. A position that has not moved
    to the frame's grown arrays yet (``PoolFrame._resize``) has fewer rows or NIC columns than
    ``shape``: what it lacks was never written there, and reads NaN."""
    if not slots:
        out: FloatArray = np.empty((0, *shape), np.float32)
    elif all(s.shape == shape for s in slots):
        out = np.stack(slots)
    else:
        out = np.full((len(slots), *shape), np.nan, np.float32)
        for i, s in enumerate(slots):
            r, w = min(s.shape[0], shape[0]), min(s.shape[1], shape[1])
            out[i, :r, :w] = s[:r, :w]
    out.flags.writeable = False
    return out


class PoolFrame:
    """One pool's GPU and NIC state over the last ``slots`` intervals (see the module docstring).

    Each ring position holds its own arrays, ``(rows, gpus, GPU_FIELDS)`` and ``(rows, nics,
    NIC_FIELDS)``, so that a ``FrameWindow`` can hold a slot's arrays instead of copying them. A
    position remembers the windows that hold its arrays (weakly: a window nobody reads any more
    holds nothing), and before the frame changes a held position in place it gives the position
    new arrays (a copy, or fresh NaN when the slot is cleared) and leaves the old ones to the
    windows.
    """

    def __init__(
        self,
        name: str,
        *,
        interval_s: float,
        slots: int,
        gpus: int,
        initial_rows: int = _INITIAL_ROWS,
        initial_nics: int = 8,
    ) -> None:
        if not (interval_s > 0 and slots > 0 and gpus > 0 and initial_rows > 0 and initial_nics > 0):
            raise ConfigError(
                f"pool frame needs interval_s, slots, gpus, initial_rows, initial_nics > 0; got "
                f"{interval_s}, {slots}, {gpus}, {initial_rows}, {initial_nics}"
            )
        self.name = name
        self.interval_s = interval_s
        self.slots = slots
        self.gpus = gpus
        self._ratelog = RateLimitedLog(log)  # a node sending new NIC names may not flood the log
        self._capacity = initial_rows
        self._nic_width = initial_nics
        # One block per frame, each position a view of its part: one large allocation, which the
        # allocator maps and returns whole, where 2 x slots arrays of a few hundred KB each left
        # the heap fragmented (bench/memory.py: about 60 KB a node more RSS). A position a window
        # holds is given an array of its own when it next changes (``_writable``, ``_clear``).
        self._gpu: list[FloatArray] = list(self._empty_gpu(initial_rows, slots))
        self._nic: list[FloatArray] = list(self._empty_nic(initial_rows, initial_nics, slots))
        # Per position, the arrays it moves to at its next change after the rows or NIC columns
        # grew (views of one new block, not yet written: see ``_resize``); None once it has moved.
        self._moves: list[tuple[FloatArray, FloatArray] | None] = [None] * slots
        self._unmoved: list[int] = []  # positions with a move pending, next to move last
        # Per position: the windows holding its arrays (copy on write while one of them lives).
        self._readers: list[list[weakref.ref[FrameWindow]]] = [[] for _ in range(slots)]
        self.head: int | None = None  # newest slot number written
        # Oldest slot number written since the ring last started over: the slots before it in the
        # ring were never written (all NaN), which a reader may skip (``written_since``).
        self.first: int | None = None
        self._names: list[str] = []
        self._rows: dict[str, int] = {}
        # Per node its NICs in column order. Tuples: a tuple of strings and numbers is not an
        # object the cycle collector tracks, where a list and a set per node and pool were two.
        self._nic_keys: dict[str, tuple[NicKey, ...]] = {}

    def _empty_gpu(self, rows: int, *slots: int) -> FloatArray:
        return np.full((*slots, rows, self.gpus, len(GPU_FIELDS)), np.nan, np.float32)

    def _empty_nic(self, rows: int, width: int, *slots: int) -> FloatArray:
        return np.full((*slots, rows, width, len(NIC_FIELDS)), np.nan, np.float32)

    @property
    def gpu(self) -> FloatArray:
        """Every position's GPU values, ``(slots, rows, gpus, GPU_FIELDS)`` in position order: a
        read-only copy, for inspection (``snapshot`` and ``window`` give slot order)."""
        return _stack(tuple(self._gpu), (self._capacity, self.gpus, len(GPU_FIELDS)))

    @property
    def nic(self) -> FloatArray:
        """Every position's NIC values, ``(slots, rows, nics, NIC_FIELDS)``: a copy, like ``gpu``."""
        return _stack(tuple(self._nic), (self._capacity, self._nic_width, len(NIC_FIELDS)))

    # -- rows --------------------------------------------------------------------------------

    @property
    def nodes(self) -> list[str]:
        """Node names in row order (a copy)."""
        return list(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, node: object) -> bool:
        return node in self._rows

    def nic_keys(self, node: str) -> list[NicKey]:
        """The node's NICs in column order of the NIC frame."""
        return list(self._nic_keys.get(node, ()))

    def _held(self, p: int) -> bool:
        """Whether a live window holds position ``p``'s arrays (and forget the windows that died)."""
        readers = self._readers[p]
        if readers:
            readers[:] = [r for r in readers if r() is not None]
        return bool(readers)

    def _writable(self, p: int) -> None:
        """Before changing position ``p`` in place: a window holding its arrays keeps them."""
        if self._moves[p] is not None:
            self._move(p)  # new arrays: the windows keep the old ones
        elif self._held(p):
            self._gpu[p] = self._gpu[p].copy()
            self._nic[p] = self._nic[p].copy()
            self._readers[p].clear()

    def _resize(self, capacity: int, width: int) -> None:
        """Give every position new arrays of ``capacity`` rows and ``width`` NIC columns, each
        when it next changes, and one more at every write after (``_move``).

        Copying every position at once held the event loop for the whole frame: 0.2-0.35 s at
        2,000 nodes each time a big pool grew by a quarter, a dozen times as its nodes joined
        after a restart (``bench/frame_growth.py``). The new block is allocated here but not
        written (``np.empty``: the system maps its pages when they are first written), so this
        costs no copy; a position's rows are copied when it moves, and until then it keeps its
        old, smaller arrays, which readers pad with NaN (``_stack``).
        """
        gpus = np.empty((self.slots, capacity, self.gpus, len(GPU_FIELDS)), np.float32)
        nics = np.empty((self.slots, capacity, width, len(NIC_FIELDS)), np.float32)
        self._moves = [(gpus[p], nics[p]) for p in range(self.slots)]
        self._unmoved = list(range(self.slots))  # any order: a position written moves first anyway
        self._capacity, self._nic_width = capacity, width

    def _move(self, p: int) -> None:
        """Position ``p`` onto its new arrays: its live rows copied, the rest NaN."""
        target = self._moves[p]
        if target is None:
            return
        gpu, nic = target
        old_gpu, old_nic = self._gpu[p], self._nic[p]
        n = min(len(self._names), old_gpu.shape[0], gpu.shape[0])
        w = min(old_nic.shape[1], nic.shape[1])
        gpu[:n] = old_gpu[:n]
        gpu[n:] = np.nan
        nic[:n, :w] = old_nic[:n, :w]
        nic[:n, w:] = np.nan
        nic[n:] = np.nan
        self._gpu[p], self._nic[p] = gpu, nic
        self._moves[p] = None
        self._readers[p].clear()  # they hold the old arrays, which the frame no longer writes

    def _move_one(self) -> None:
        """Move one more position with a move pending: a frame that grew is all on its new block
        ``slots`` writes later, and the old block is freed, without one write copying it all."""
        unmoved = self._unmoved
        while unmoved:
            p = unmoved.pop()
            if self._moves[p] is not None:
                self._move(p)
                return

    def _row(self, node: str) -> int:
        row = self._rows.get(node)
        if row is None:
            row = len(self._names)
            if row == self._capacity:
                self._resize(max(row + 1, math.ceil(row * _GROWTH)), self._nic_width)
            self._names.append(node)
            self._rows[node] = row
        return row

    def release(self, node: str) -> bool:
        """Free a node's row (swap-remove, so live rows stay contiguous); False if it had none."""
        row = self._rows.pop(node, None)
        if row is None:
            return False
        self._nic_keys.pop(node, None)
        last = len(self._names) - 1
        for p in range(self.slots):
            self._writable(p)
            gpu, nic = self._gpu[p], self._nic[p]
            if row != last:
                gpu[row] = gpu[last]
                nic[row] = nic[last]
            gpu[last] = np.nan
            nic[last] = np.nan
        if row != last:
            moved = self._names[last]
            self._names[row] = moved
            self._rows[moved] = row
        self._names.pop()
        capacity = self._capacity
        if capacity > _INITIAL_ROWS and len(self._names) <= capacity // 4:
            self._resize(max(_INITIAL_ROWS, capacity // 2), self._nic_width)
        return True

    def assign_nics(self, node: str, keys: Sequence[NicKey], max_nics: int) -> tuple[NicKey, ...]:
        """The node's NIC column order: sorted at first sight, NICs seen later appended.

        NICs beyond ``max_nics`` are left out (and said so once per NIC, not per report).
        """
        known = self._nic_keys.get(node)
        if known is not None and (tuple(keys) == known or set(keys).issubset(known)):
            return known  # the same NICs as before: every report but a node's first, nearly
        have = known or ()
        added = list(have)
        for key in sorted(set(keys).difference(have), key=lambda k: (k[0], -1 if k[1] is None else k[1])):
            if len(added) >= max_nics:
                # Not remembered as seen: a node sending new names in every report must not grow
                # this set (or the log) without bound.
                self._ratelog.warning(
                    "frame_nics_full",
                    "node has more NICs than the frame keeps; this one is left out",
                    extra={"node": node, "nic": nic_name(key), "max_nics": max_nics},
                )
                continue
            added.append(key)
        known = self._nic_keys[node] = tuple(added)
        if len(known) > self._nic_width:
            self._resize(self._capacity, max(len(known), 2 * self._nic_width))
        return known

    # -- time --------------------------------------------------------------------------------

    def slot_number(self, t: float) -> int:
        return math.floor(t / self.interval_s)

    def _clear(self, p: int) -> None:
        target = self._moves[p]
        if target is not None:  # its new arrays, with nothing to copy into them
            self._gpu[p], self._nic[p] = target
            self._moves[p] = None
            self._readers[p].clear()
            self._gpu[p].fill(np.nan)
            self._nic[p].fill(np.nan)
        elif self._held(p):  # the windows keep the old arrays; the position starts on new ones
            self._gpu[p] = self._empty_gpu(self._capacity)
            self._nic[p] = self._empty_nic(self._capacity, self._nic_width)
            self._readers[p].clear()
        else:
            self._gpu[p].fill(np.nan)
            self._nic[p].fill(np.nan)

    def _advance(self, k: int) -> None:
        head = self.head
        if head is None or k - head >= self.slots:
            for p in range(self.slots):
                self._clear(p)
            self.first = k
        else:
            for m in range(head + 1, k + 1):
                self._clear(m % self.slots)
        self.head = k

    def _slot_range(self, t0: float, t1: float) -> tuple[int, int]:
        """Slot numbers ``[k0, k1]`` of ``[t0, t1]`` that the ring still holds (k1 < k0: none)."""
        if self.head is None:
            return 0, -1
        k0 = max(self.slot_number(t0), self.head - self.slots + 1)
        k1 = min(self.slot_number(t1), self.head)
        return k0, k1

    def written_since(self, t0: float) -> float:
        """``t0``, or the start of the oldest slot written since the ring last started over if that
        is later: a reader of ``[t0, t1]`` that ignores slots without values may start there, and
        skip slots that only hold NaN (a pool's first frame-length, or after a gap as long)."""
        return t0 if self.first is None else max(t0, self.first * self.interval_s)

    def _positions(self, t0: float, t1: float) -> list[int]:
        k0, k1 = self._slot_range(t0, t1)
        return [k % self.slots for k in range(k0, k1 + 1)]

    def write(self, node: str, t: float, gpu: FloatArray, nics: Sequence[NicKey], nic: FloatArray) -> bool:
        """Store one node's values for the slot of ``t``; False when that slot is already gone."""
        k = self.slot_number(t)
        if self.head is None or k > self.head:
            self._advance(k)
        elif k <= self.head - self.slots:
            return False
        if self.first is None or k < self.first:
            self.first = k  # a late report for a slot before the first one written
        p = k % self.slots
        row = self._row(node)
        self._writable(p)
        self._gpu[p][row] = gpu
        if nics:
            self._nic[p][row, : len(nics)] = nic
        if self._unmoved:
            self._move_one()
        return True

    # -- reading -----------------------------------------------------------------------------

    def _views(self, arrays: list[FloatArray], positions: list[int]) -> tuple[FloatArray, ...]:
        n = len(self._names)
        views = []
        for p in positions:
            view = arrays[p][:n]
            view.flags.writeable = False  # the view only: the frame still writes the array
            views.append(view)
        return tuple(views)

    def window(self, t0: float, t1: float, *, nic: bool = False) -> FrameWindow:
        """The live rows over ``[t0, t1]`` (clipped as ``snapshot`` is), frozen, for a reader on
        another thread; with ``nic``, the NIC frame and each node's NIC keys too.

        It copies no values (see ``FrameWindow``): on the event loop it costs a view per slot,
        whatever the pool's size.
        """
        nodes = tuple(self._names)
        positions = self._positions(t0, t1)
        starts = self.slot_starts(t0, t1)
        starts.flags.writeable = False
        window = FrameWindow(
            pool=self.name,
            interval_s=self.interval_s,
            nodes=nodes,
            starts=starts,
            nic_keys=tuple(tuple(self._nic_keys.get(n, ())) for n in nodes) if nic else (),
            _gpu_slots=self._views(self._gpu, positions),
            _nic_slots=self._views(self._nic, positions) if nic else (),
            gpus=self.gpus,
            nic_width=self._nic_width if nic else 0,
        )
        ref = weakref.ref(window)
        for p in positions:
            self._readers[p].append(ref)
        return window

    def snapshot(self, t0: float, t1: float) -> tuple[list[str], FloatArray]:
        """Node names and the GPU values ``(slots in [t0, t1], nodes, gpus, GPU_FIELDS)``, oldest first.

        The range is clipped to the slots the ring holds (``slot_starts`` gives each one's time).
        The array is a read-only copy.
        """
        views = self._views(self._gpu, self._positions(t0, t1))
        return list(self._names), _stack(views, (len(self._names), self.gpus, len(GPU_FIELDS)))

    def nic_snapshot(self, t0: float, t1: float) -> tuple[list[str], FloatArray]:
        """Like ``snapshot`` for the NIC frame ``(slots, nodes, nics, NIC_FIELDS)``; see ``nic_keys``."""
        views = self._views(self._nic, self._positions(t0, t1))
        return list(self._names), _stack(views, (len(self._names), self._nic_width, len(NIC_FIELDS)))

    def slot_starts(self, t0: float, t1: float) -> npt.NDArray[np.float64]:
        """The start time of each slot a snapshot of ``[t0, t1]`` returns."""
        k0, k1 = self._slot_range(t0, t1)
        return np.arange(k0, k1 + 1, dtype=np.float64) * self.interval_s


class FleetFrames:
    """One ``PoolFrame`` per pool; ``record`` puts each node's latest values in its pool's frame."""

    def __init__(
        self,
        config: FleetConfig | None = None,
        *,
        frame_seconds: float | None = None,
        max_nics: int = DEFAULT_MAX_NICS,
    ) -> None:
        self.config = config if config is not None else FleetConfig()
        seconds = (
            frame_seconds
            if frame_seconds is not None
            else min(
                self.config.window_seconds,
                max(DEFAULT_FRAME_SECONDS, FRAME_SLOTS * self.config.interval_seconds),
            )
        )
        if not seconds > 0 or max_nics <= 0:
            raise ConfigError(f"frames need frame_seconds > 0 and max_nics > 0; got {seconds}, {max_nics}")
        self.slots = math.ceil(seconds / self.config.interval_seconds)
        self.max_nics = max_nics
        self._frames: dict[str, PoolFrame] = {}
        self._pool_of: dict[str, str] = {}

    def record(self, view: NodeView, placement: Placement, *, at: float | None = None) -> bool:
        """Write the node's latest values into its pool's slot for ``at`` (default: report time).

        A view for a late, duplicate or expired report is the view of the node's latest report,
        which was recorded when it arrived: nothing is written again. A node whose pool changed
        leaves its old pool's frame. False when nothing was written.
        """
        if isinstance(view, HistoryView) and view.outcome != "latest":
            return False
        node = view.node
        pool = placement.pool
        old = self._pool_of.get(node)
        if old is not None and old != pool:
            self._release(node, old)
        frame = self._frames.get(pool)
        if frame is None:
            frame = self._frames[pool] = PoolFrame(
                pool, interval_s=self.config.interval_seconds, slots=self.slots, gpus=self.config.max_gpus
            )
        self._pool_of[node] = pool
        keys = frame.assign_nics(node, [(n.device, n.port) for n in view.report.nics], self.max_nics)
        t = view.report.time if at is None else at
        return frame.write(node, t, gpu_block(view, frame.gpus), keys, nic_block(view, keys))

    def _release(self, node: str, pool: str) -> None:
        frame = self._frames.get(pool)
        if frame is not None and frame.release(node) and len(frame) == 0:
            del self._frames[pool]

    def forget(self, node: str) -> bool:
        """Free the node's row; False when it had none."""
        pool = self._pool_of.pop(node, None)
        if pool is None:
            return False
        self._release(node, pool)
        return True

    def pools(self) -> list[str]:
        return list(self._frames)

    def frame(self, pool: str) -> PoolFrame | None:
        return self._frames.get(pool)

    def pool_of(self, node: str) -> str | None:
        return self._pool_of.get(node)

    def snapshot(self, pool: str, t0: float, t1: float) -> tuple[list[str], FloatArray]:
        """``PoolFrame.snapshot`` of the pool; no nodes and no slots for an unknown pool."""
        frame = self._frames.get(pool)
        if frame is None:
            return [], np.full((0, 0, self.config.max_gpus, len(GPU_FIELDS)), np.nan, np.float32)
        return frame.snapshot(t0, t1)

    def nic_snapshot(self, pool: str, t0: float, t1: float) -> tuple[list[str], FloatArray]:
        frame = self._frames.get(pool)
        if frame is None:
            return [], np.full((0, 0, 0, len(NIC_FIELDS)), np.nan, np.float32)
        return frame.nic_snapshot(t0, t1)
