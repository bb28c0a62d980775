"""NCCL Inspector output, parsed and summarized for the report's ``jobs`` section. Pure: no I/O.

NVIDIA's Inspector profiler plugin (NCCL repository, ``plugins/profiler/inspector``, formerly
``ext-profiler/inspector``) writes what each rank saw of each completed collective, in one of two
forms (recorded examples in tests/fixtures/nccl-inspector/):

- **JSON lines**, one file per process (``<hostname>-pid<PID>.log``), growing without bound.
  Format ``v4.0``-``v4.2``: every line is self-contained, ``{"header": {id, rank, n_ranks, nnodes},
  "metadata": {inspector_output_format_version, hostname, pid, ...}, "coll_perf": {...}}`` (or
  ``"p2p_perf"`` for Send/Recv). ``v4.1`` and ``v4.2`` add stand-alone ``dump_stats`` lines.
  Format ``v4.3``/``v4.4``: each communicator's dump starts with a ``dump_stats`` marker that
  carries ``header`` and ``metadata`` once, and the next ``coll_records + p2p_records +
  proxy_records`` lines (``proxy_records`` absent means 0) are bare ``{"coll_perf": ...}``,
  ``{"p2p_perf": ...}`` or ``{"proxy_trace": ...}`` objects that belong to it. The writer holds its
  lock across a batch, so batches of one file never interleave; a ``Stream`` per file keeps the
  marker's context.
- **Prometheus textfiles** (``NCCL_INSPECTOR_PROM_DUMP=1``), one per GPU
  (``nccl_inspector_metrics_<uuid>.prom``), rewritten each dump interval (at least 30 s) with one
  series per communicator, collective, message-size range and algorithm: the mean execution time
  and the geometric-mean bus bandwidth over that interval. ``parse_prometheus`` turns each
  (bandwidth, time) pair of series into one record.

The ``Summarizer`` folds records into one row per (communicator, rank, process, GPU, collective,
message-size bucket, timing source), with quantiles from a bounded sample, and ``take()`` hands the
cycle's rows over as ``Jobs``. Everything it holds is bounded by ``max_keys`` x ``max_samples``.

A line Inspector could not have written (not JSON, a field of the wrong type, a rank outside its
communicator, a bare record outside any marker's batch) raises ``MalformedRecord``; a format
version this module does not know raises ``UnknownVersion``: both are ``InspectorError``, which the
collector turns into report errors rather than guess at a format it has never seen.
"""

from __future__ import annotations

import itertools
import operator
import re
import sys
from array import array
from collections import defaultdict, deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from operator import attrgetter
from typing import Annotated, Final, Literal, TypeVar, cast, get_args

import msgspec
from msgspec import UNSET, Meta

from agent.errors import GpuwardenError
from agent.report import JOBS_FORMAT, MAX_COLLECTIVES, Collective, Jobs, Stat

# Format versions, as ``metadata.inspector_output_format_version`` (JSON) and the ``version``
# label (Prometheus, "v<profiler interface>.<minor>") spell them. v4.0-v4.2 lines are
# self-contained; v4.3 and v4.4 put header and metadata in a dump_stats marker only.
_SelfContainedVersion = Literal["v4.0", "v4.1", "v4.2"]
_MarkerVersion = Literal["v4.3", "v4.4"]
_Version = _SelfContainedVersion | _MarkerVersion
SELF_CONTAINED_VERSIONS: Final = frozenset(get_args(_SelfContainedVersion))
MARKER_VERSIONS: Final = frozenset(get_args(_MarkerVersion))
JSON_VERSIONS: Final = SELF_CONTAINED_VERSIONS | MARKER_VERSIONS
PROMETHEUS_VERSIONS: Final = frozenset({"v5.0", "v5.1", "v5.2"})

# What Inspector's ncclFuncToString writes; anything else ("Invalid", a kind a later NCCL adds)
# is read and counted as dropped rather than reported under a name nobody compares.
_Kind = Literal[
    "AllGather",
    "AllGatherV",
    "AllReduce",
    "All2All",
    "Broadcast",
    "Reduce",
    "ReduceScatter",
    "Send",
    "Recv",
    "SendRecv",
]
KINDS: Final = frozenset(get_args(_Kind))
# Where the file does not say how the time was measured (v4.0 without ``coll_timing_source``, and
# every Prometheus series): Inspector's own word for it.
UNKNOWN_TIMING: Final = "unknown"

# Per row and measure. The p10 of an even sample of 256 falls within about 2 percentile points of
# the whole cycle's (binomial spread: sqrt(0.1 * 0.9 / 256) = 1.9 %).
DEFAULT_MAX_SAMPLES: Final = 256

_T = TypeVar("_T")
_H = TypeVar("_H", bound=Hashable)
# What ``_SELF_GROUP`` gets from a line.
_SelfGroup = tuple["_FHeader | None", "_FMetadata | None", "_FDumpStats | None", str, int, str]


class InspectorError(GpuwardenError):
    """A line or series Inspector did not write as documented."""

    kind: Literal["malformed", "unknown_version"] = "malformed"


class MalformedRecord(InspectorError):
    """Not a record Inspector writes: bad JSON, wrong types, a bare record outside its batch."""

    kind: Literal["malformed", "unknown_version"] = "malformed"


class OrphanRecord(MalformedRecord):
    """A bare v4.3+ record with no dump_stats marker before it in this stream."""


class UnknownVersion(InspectorError):
    """A format version this module does not know; its records are not guessed at."""

    kind: Literal["malformed", "unknown_version"] = "unknown_version"


class InspectorRecord(msgspec.Struct, frozen=True, gc=False):
    """One completed operation of one communicator as one rank saw it."""

    comm: str
    collective: str
    size_bytes: int
    exec_time_us: float
    busbw_gbs: float
    timing_source: str
    n_ranks: int
    nnodes: int
    rank: int | None = None
    hostname: str | None = None
    pid: int | None = None
    gpu: int | None = None


# -- JSON lines -----------------------------------------------------------------------------------
# Typed decoding: msgspec checks types and bounds in C and skips what is not declared here (the
# verbose event traces, algorithm names, the algorithm bandwidth).

_Finite = Annotated[float, Meta(ge=0, le=sys.float_info.max)]  # JSON has no NaN; 1e999 is inf
_Natural = Annotated[int, Meta(ge=0)]


class _Header(msgspec.Struct, gc=False):
    id: Annotated[str, Meta(max_length=64)]
    rank: _Natural
    n_ranks: Annotated[int, Meta(ge=1)]
    nnodes: Annotated[int, Meta(ge=1)]


class _Metadata(msgspec.Struct, gc=False):
    inspector_output_format_version: Annotated[str, Meta(max_length=16)]
    hostname: Annotated[str, Meta(max_length=253)] | None = None
    pid: _Natural | None = None


class _CollPerf(msgspec.Struct, gc=False):
    coll: Annotated[str, Meta(max_length=32)]
    coll_msg_size_bytes: _Natural
    coll_exec_time_us: _Finite
    coll_busbw_gbs: _Finite
    coll_timing_source: Annotated[str, Meta(max_length=32)] = UNKNOWN_TIMING


class _P2pPerf(msgspec.Struct, gc=False):
    p2p: Annotated[str, Meta(max_length=32)]
    p2p_msg_size_bytes: _Natural
    p2p_exec_time_us: _Finite
    p2p_busbw_gbs: _Finite
    p2p_timing_source: Annotated[str, Meta(max_length=32)] = UNKNOWN_TIMING


class _DumpStats(msgspec.Struct, gc=False):
    coll_records: _Natural = 0
    p2p_records: _Natural = 0
    proxy_records: _Natural = 0


class _Line(msgspec.Struct, gc=False):
    header: _Header | None = None
    metadata: _Metadata | None = None
    coll_perf: _CollPerf | None = None
    p2p_perf: _P2pPerf | None = None
    dump_stats: _DumpStats | None = None
    # Kept undecoded (msgspec.Raw): only its presence matters. Empty when absent.
    proxy_trace: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)


class _BadLine(_Line, kw_only=True, gc=False):
    """A line that did not decode, in its place among the others (so errors keep their order)."""

    error: MalformedRecord


_LINE: Final = msgspec.json.Decoder(_Line)
# A chunk of lines becomes one JSON array: newlines become commas and a final ``null`` closes it.
_BATCH: Final = msgspec.json.Decoder(list[_Line | None])

# The fast decode: the same lines into structs whose strings are Literals of what Inspector
# writes (msgspec then hands out the one interned constant instead of a new string per line, and
# a value Inspector does not write fails the whole chunk over to the decoders above, which say
# exactly which line and why) and whose header and metadata are frozen, so hashable: records are
# grouped by them in C (``dict`` lookups through ``map``), never one Python statement per line.
# inspectorTimingSourceToString (inspector.cc): the only words Inspector writes.
_Timing = Literal["kernel_gpu", "kernel_cpu", "collective_cpu", "unknown"]


class _FHeader(msgspec.Struct, frozen=True, gc=False):
    id: Annotated[str, Meta(max_length=64)]
    rank: _Natural
    n_ranks: Annotated[int, Meta(ge=1)]
    nnodes: Annotated[int, Meta(ge=1)]


class _FMetadata(msgspec.Struct, frozen=True, gc=False):
    inspector_output_format_version: _Version
    hostname: Annotated[str, Meta(max_length=253)] | None = None
    pid: _Natural | None = None


class _FCollPerf(msgspec.Struct, gc=False):
    coll: _Kind
    coll_msg_size_bytes: _Natural
    coll_exec_time_us: _Finite
    coll_busbw_gbs: _Finite
    coll_timing_source: _Timing = UNKNOWN_TIMING


class _FP2pPerf(msgspec.Struct, gc=False):
    p2p: _Kind
    p2p_msg_size_bytes: _Natural
    p2p_exec_time_us: _Finite
    p2p_busbw_gbs: _Finite
    p2p_timing_source: _Timing = UNKNOWN_TIMING


class _FDumpStats(msgspec.Struct, frozen=True, gc=False):
    coll_records: _Natural = 0
    p2p_records: _Natural = 0
    proxy_records: _Natural = 0


class _Present(msgspec.Struct, gc=False):
    """Any JSON object, its fields skipped: only its presence matters (a proxy trace)."""


class _FLine(msgspec.Struct, gc=False):
    header: _FHeader | None = None
    metadata: _FMetadata | None = None
    coll_perf: _FCollPerf | None = None
    p2p_perf: _FP2pPerf | None = None
    dump_stats: _FDumpStats | None = None
    proxy_trace: _Present | None = None


# No ``None`` allowed: a line that is just ``null`` fails over to the exact path.
_FAST: Final = msgspec.json.Decoder(list[_FLine])

# (comm, rank, hostname, pid, gpu, collective, size bucket, timing source, n_ranks, nnodes)
Key = tuple[str, int | None, str | None, int | None, int | None, str, int, str, int, int]

# C-level getters (operator.attrgetter through map): the fast path's only per-line work.
_HEADER: Final = attrgetter("header")
_COLL: Final = attrgetter("coll_perf")
_P2P: Final = attrgetter("p2p_perf")
_PROXY: Final = attrgetter("proxy_trace")
# A self-contained line's group: who (header, metadata), whether it is a marker, what (kind,
# size, timing). Raises AttributeError for a line without coll_perf.
_SELF_GROUP: Final = attrgetter(
    "header",
    "metadata",
    "dump_stats",
    "coll_perf.coll",
    "coll_perf.coll_msg_size_bytes",
    "coll_perf.coll_timing_source",
)
_SELF_BUSBW: Final = attrgetter("coll_perf.coll_busbw_gbs")
_SELF_EXEC: Final = attrgetter("coll_perf.coll_exec_time_us")
_COLL_WHAT: Final = attrgetter("coll", "coll_msg_size_bytes", "coll_timing_source")
_COLL_BUSBW: Final = attrgetter("coll_busbw_gbs")
_COLL_EXEC: Final = attrgetter("coll_exec_time_us")
_P2P_WHAT: Final = attrgetter("p2p", "p2p_msg_size_bytes", "p2p_timing_source")
_P2P_BUSBW: Final = attrgetter("p2p_busbw_gbs")
_P2P_EXEC: Final = attrgetter("p2p_exec_time_us")

# A communicator's identity as the summary keys it: (comm, rank, hostname, pid, n_ranks, nnodes).
_Who = tuple[str, int, str | None, int | None, int, int]


def count_lines(data: bytes) -> int:
    """How many newlines ``data`` holds. ``bytes.count`` of one byte is a byte-at-a-time loop;
    deleting them with ``bytes.replace`` (memchr) and comparing lengths is about 8 times faster
    on a 1 MiB chunk (0.04 against 0.33 ms here): the collector's third-largest cost otherwise."""
    return len(data) - len(data.replace(b"\n", b""))


def size_bucket(size_bytes: int) -> int:
    """2**floor(log2(size)): the report's message-size bucket (0 for an empty message)."""
    return 1 << (size_bytes.bit_length() - 1) if size_bytes > 0 else 0


class _Columns:
    """One chunk's operations, grouped: each group's summary key, and per operation its group
    (an index into ``keys``), bus bandwidth and execution time, in file order."""

    __slots__ = ("busbw", "exec_us", "groups", "keys")

    def __init__(self, keys: list[Key], groups: list[int], busbw: list[float], exec_us: list[float]) -> None:
        self.keys = keys
        self.groups = groups
        self.busbw = busbw
        self.exec_us = exec_us


def _group(what: Iterable[_H]) -> tuple[list[_H], list[int]]:
    """The distinct items in order of first appearance, and each item's index among them."""
    ids: defaultdict[_H, int] = defaultdict(itertools.count().__next__)
    groups = list(map(ids.__getitem__, what))
    return list(ids), groups


def _self_contained(lines: list[_FLine]) -> _Columns | None:
    """Every line a self-contained collective (v4.0-v4.2, or v4.3+ without markers), or None."""
    try:
        distinct, groups = _group(cast(Iterable[_SelfGroup], map(_SELF_GROUP, lines)))
    except AttributeError:  # a line without coll_perf: a marker, a P2P record, ...
        return None
    keys: list[Key] = []
    for header, meta, stats, kind, size, timing in distinct:
        if header is None or meta is None or stats is not None or header.rank >= header.n_ranks:
            return None  # a bare record, a marker, a record Inspector would not write
        keys.append(
            (
                header.id,
                header.rank,
                meta.hostname,
                meta.pid,
                None,
                kind,
                1 << (size.bit_length() - 1) if size > 0 else 0,
                timing,
                header.n_ranks,
                header.nnodes,
            )
        )
    return _Columns(keys, groups, list(map(_SELF_BUSBW, lines)), list(map(_SELF_EXEC, lines)))


def _bare_columns(who: list[_Who], slots: list[int], bare: list[_FLine]) -> _Columns | None:
    """Bare records (v4.3+) as columns: ``slots[i]`` is the index in ``who`` of ``bare[i]``'s
    marker. None where a line is neither a collective, a P2P operation nor a proxy trace."""
    colls = list(map(_COLL, bare))
    what: list[tuple[int, tuple[str, int, str]]]
    if None not in colls:
        what = list(zip(slots, map(_COLL_WHAT, colls), strict=True))
        busbw = list(map(_COLL_BUSBW, colls))
        exec_us = list(map(_COLL_EXEC, colls))
    else:
        p2ps = list(map(_P2P, bare))
        is_coll = list(map(operator.is_not, colls, itertools.repeat(None)))
        is_p2p = [c is None and p is not None for c, p in zip(colls, p2ps, strict=True)]
        rest = [not (c or p) for c, p in zip(is_coll, is_p2p, strict=True)]
        if None in map(_PROXY, itertools.compress(bare, rest)):
            return None  # a bare line with nothing Inspector writes in it
        c_ops = list(itertools.compress(colls, is_coll))
        p_ops = list(itertools.compress(p2ps, is_p2p))
        # Back in file order (a row's sample keeps its order; rows are made in order of first
        # appearance): positions of the collectives, then of the P2P operations, sorted.
        pos = [*itertools.compress(range(len(bare)), is_coll), *itertools.compress(range(len(bare)), is_p2p)]
        order = sorted(range(len(pos)), key=pos.__getitem__)
        slot_c = list(itertools.compress(slots, is_coll))
        slot_p = list(itertools.compress(slots, is_p2p))
        what_all = [
            *zip(slot_c, map(_COLL_WHAT, c_ops), strict=True),
            *zip(slot_p, map(_P2P_WHAT, p_ops), strict=True),
        ]
        bw_all = [*map(_COLL_BUSBW, c_ops), *map(_P2P_BUSBW, p_ops)]
        ex_all = [*map(_COLL_EXEC, c_ops), *map(_P2P_EXEC, p_ops)]
        what = list(map(what_all.__getitem__, order))
        busbw = list(map(bw_all.__getitem__, order))
        exec_us = list(map(ex_all.__getitem__, order))
    distinct, groups = _group(what)
    keys: list[Key] = []
    for slot, (kind, size, timing) in distinct:
        comm, rank, hostname, pid, n_ranks, nnodes = who[slot]
        keys.append(
            (
                comm,
                rank,
                hostname,
                pid,
                None,
                kind,
                1 << (size.bit_length() - 1) if size > 0 else 0,
                timing,
                n_ranks,
                nnodes,
            )
        )
    return _Columns(keys, groups, busbw, exec_us)


class Stream:
    """The parsing state of one Inspector JSON file: the dump_stats batch being read, if any.

    Reset it (make a new one) when the file is truncated or replaced: a batch never spans files.
    ``resyncing``: the stream starts somewhere in the middle of a file (a reader that skipped
    ahead), so bare records before the first marker are dropped, not errors: their marker was
    skipped, not missing.
    """

    __slots__ = ("_hostname", "_id", "_left", "_n_ranks", "_nnodes", "_pid", "_rank", "resyncing")

    def __init__(self, *, resyncing: bool = False) -> None:
        # The current batch's marker (v4.3+): who the bare records after it belong to.
        self._id: str | None = None
        self._rank = 0
        self._hostname: str | None = None
        self._pid: int | None = None
        self._n_ranks = 1
        self._nnodes = 1
        self._left = 0
        self.resyncing = resyncing

    def resolve(self, line: _Line | _FLine) -> tuple[Key, float, float] | None:
        """The summary key, bus bandwidth and execution time of one decoded line.

        None for a line that is not an operation (a marker, a proxy trace); raises
        ``InspectorError`` for one Inspector would not write. This is the exact path, line by
        line: the reference the fast path (``feed_chunk``) must agree with, and what it falls
        back to for a chunk with anything out of the ordinary in it.
        """
        header = line.header
        if header is not None:
            meta = line.metadata
            if meta is None:
                raise MalformedRecord("header without metadata")
            version = meta.inspector_output_format_version
            if version not in JSON_VERSIONS:
                raise UnknownVersion(f"unknown Inspector format version {version[:16]!r}")
            comm, rank, n_ranks, nnodes = header.id, header.rank, header.n_ranks, header.nnodes
            if rank >= n_ranks:
                raise MalformedRecord(f"rank {rank} outside a communicator of {n_ranks} ranks")
            hostname, pid = meta.hostname, meta.pid
            self.resyncing = False
            stats = line.dump_stats
            if stats is not None:
                if version in MARKER_VERSIONS:
                    self._id, self._rank, self._hostname, self._pid = comm, rank, hostname, pid
                    self._n_ranks, self._nnodes = n_ranks, nnodes
                    self._left = stats.coll_records + stats.p2p_records + stats.proxy_records
                return None
        elif line.metadata is not None:
            raise MalformedRecord("metadata without header")
        else:
            if isinstance(line, _BadLine):
                raise line.error
            batch_id = self._id
            if batch_id is None or self._left <= 0:
                self._id = None
                raise OrphanRecord("record without header outside any dump_stats batch")
            comm = batch_id
            self._left -= 1
            rank, hostname, pid = self._rank, self._hostname, self._pid
            n_ranks, nnodes = self._n_ranks, self._nnodes
        coll = line.coll_perf
        if coll is not None:
            size = coll.coll_msg_size_bytes
            return (
                (
                    comm,
                    rank,
                    hostname,
                    pid,
                    None,
                    coll.coll,
                    1 << (size.bit_length() - 1) if size > 0 else 0,
                    coll.coll_timing_source,
                    n_ranks,
                    nnodes,
                ),
                coll.coll_busbw_gbs,
                coll.coll_exec_time_us,
            )
        p2p = line.p2p_perf
        if p2p is not None:
            size = p2p.p2p_msg_size_bytes
            return (
                (
                    comm,
                    rank,
                    hostname,
                    pid,
                    None,
                    p2p.p2p,
                    1 << (size.bit_length() - 1) if size > 0 else 0,
                    p2p.p2p_timing_source,
                    n_ranks,
                    nnodes,
                ),
                p2p.p2p_busbw_gbs,
                p2p.p2p_exec_time_us,
            )
        if line.proxy_trace:
            return None  # CPU proxy timing: not comparable with kernel timing, not summarized
        raise MalformedRecord("no coll_perf, p2p_perf, dump_stats or proxy_trace")

    def parse_line(self, line: bytes) -> InspectorRecord | None:
        """One JSON line as a record (None for markers, proxy traces and blank lines)."""
        if not line.strip():
            return None
        try:
            decoded = _LINE.decode(line)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise MalformedRecord(f"not an Inspector record: {exc}") from None
        resolved = self.resolve(decoded)
        return None if resolved is None else _record(*resolved)

    def feed(self, lines: Sequence[bytes], summarizer: Summarizer) -> list[InspectorError]:
        """Summarize complete lines (without their newlines); return the errors, in order."""
        if not lines:
            return []
        return self.feed_chunk(b"\n".join(lines) + b"\n", summarizer)

    def feed_chunk(
        self, data: bytes, summarizer: Summarizer, n_lines: int | None = None
    ) -> list[InspectorError]:
        """Summarize ``data``, whole lines each ending in a newline (``n_lines`` of them, where the
        caller has counted); return the errors, in order.

        The fast path: the whole chunk is decoded in one msgspec call, as a JSON array (JSON
        strings cannot hold a raw newline, so every newline ends a line), into the Literal-typed
        structs, and grouped into columns without a Python statement per line. Anything out of
        the ordinary (a value Inspector does not write, a bad line, a blank one, a record
        outside its batch, lines of both forms mixed) takes the exact path instead, line by
        line (``resolve``), so one bad line costs only itself and is reported as itself.
        """
        if not data:
            return []
        if n_lines is None:  # the caller may have counted them already (a pass over the chunk)
            n_lines = count_lines(data)
        try:
            # ``bytes.replace`` finds newlines with memchr: ten times faster here than translate.
            body = data.replace(b"\n", b",")
            fast = _FAST.decode(b"".join((b"[", memoryview(body)[:-1], b"]")))
        except (msgspec.DecodeError, msgspec.ValidationError):
            return self._feed_exact(data, summarizer)
        # The count differs only for fragments that make sense joined (never from Inspector).
        if len(fast) == n_lines:
            cols = self._columns(fast)
            if cols is not None:
                summarizer.add_columns(cols.keys, cols.groups, cols.busbw, cols.exec_us)
                return []
            return self._resolve_all(fast, summarizer)
        return self._feed_exact(data, summarizer)

    def _columns(self, lines: list[_FLine]) -> _Columns | None:
        """The fast path: the chunk's operations as columns, or None where it needs the exact
        path. Commits the stream's batch state only when it returns columns."""
        heads = list(map(_HEADER, lines))
        if None not in heads:
            colls = list(map(_COLL, lines))
            if None not in colls:
                cols = _self_contained(lines)  # v4.0-v4.2, the common case
                if cols is not None:
                    self.resyncing = False  # as any header line does (``resolve``)
                return cols
            return self._with_stats(lines, colls)  # v4.1/v4.2 stand-alone dump_stats among them
        # Marker batches (v4.3+): the header lines must all be markers; the bare lines between
        # them belong to the marker before, as many as it announced.
        # Markers of one communicator rank (one per dump) share a slot, so its records of the
        # whole chunk make one group per row, not one per dump.
        who: list[_Who] = []
        slot_of: dict[_Who, int] = {}
        slots: list[int] = []
        cur, left = -1, 0
        if self._id is not None and self._left > 0:
            ident = (self._id, self._rank, self._hostname, self._pid, self._n_ranks, self._nnodes)
            who.append(ident)
            slot_of[ident] = cur = 0
            left = self._left
        prev = 0
        marks = list(itertools.compress(range(len(lines)), heads))
        for at in (*marks, len(lines)):
            run = at - prev
            if run:
                if cur < 0 or run > left:
                    return None  # records outside any batch: errors, or dropped after a resync
                slots.extend(itertools.repeat(cur, run))
                left -= run
            if at == len(lines):
                break
            line = lines[at]
            header, meta, stats = line.header, line.metadata, line.dump_stats
            if (
                header is None
                or meta is None
                or stats is None
                or meta.inspector_output_format_version not in MARKER_VERSIONS
                or header.rank >= header.n_ranks
            ):
                return None  # a self-contained line among bare ones, a bad marker
            ident = (header.id, header.rank, meta.hostname, meta.pid, header.n_ranks, header.nnodes)
            cur = slot_of.get(ident, -1)
            if cur < 0:
                cur = slot_of[ident] = len(who)
                who.append(ident)
            left = stats.coll_records + stats.p2p_records + stats.proxy_records
            prev = at + 1
        bare = list(itertools.compress(lines, map(operator.not_, heads)))
        cols = _bare_columns(who, slots, bare)
        if cols is None:
            return None
        if marks:
            self.resyncing = False
        if cur >= 0:
            self._id, self._rank, self._hostname, self._pid, self._n_ranks, self._nnodes = who[cur]
            self._left = left
        return cols

    def _with_stats(self, lines: list[_FLine], colls: list[_FCollPerf | None]) -> _Columns | None:
        """Self-contained collectives with stand-alone ``dump_stats`` lines among them (v4.1,
        v4.2; a v4.3+ marker with no bare record after it in this chunk): the stats lines are no
        records; a marker's batch goes on into the next chunk. None for anything else."""
        last: tuple[_Who, int] | None = None
        for line in itertools.compress(lines, map(operator.is_, colls, itertools.repeat(None))):
            header, meta, stats = line.header, line.metadata, line.dump_stats
            if header is None or meta is None or stats is None or header.rank >= header.n_ranks:
                return None  # a P2P record, a proxy trace, a line Inspector would not write
            if meta.inspector_output_format_version in MARKER_VERSIONS:
                ident = (header.id, header.rank, meta.hostname, meta.pid, header.n_ranks, header.nnodes)
                last = ident, stats.coll_records + stats.p2p_records + stats.proxy_records
        cols = _self_contained(list(itertools.compress(lines, colls)))
        if cols is None:
            return None
        self.resyncing = False
        if last is not None:
            (self._id, self._rank, self._hostname, self._pid, self._n_ranks, self._nnodes), self._left = last
        return cols

    def _feed_exact(self, data: bytes, summarizer: Summarizer) -> list[InspectorError]:
        """The exact path from the bytes: the chunk with the general decoder, else line by line."""
        n_lines = count_lines(data)
        decoded: list[_Line]
        try:
            batch = _BATCH.decode(b"".join((b"[", data.replace(b"\n", b","), b"null]")))
            # The count differs only for fragments that make sense joined (never from Inspector);
            # a None before the closing one is a line that is just ``null``.
            if len(batch) != n_lines + 1 or batch.pop() is not None or None in batch:
                raise msgspec.DecodeError("not one object per line")
            decoded = batch  # type: ignore[assignment]  # no None left in it
        except (msgspec.DecodeError, msgspec.ValidationError):
            decoded = []
            for ln in data[:-1].split(b"\n"):
                if not ln or ln.isspace():
                    continue
                try:
                    decoded.append(_LINE.decode(ln))
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    decoded.append(_BadLine(error=MalformedRecord(f"not an Inspector record: {exc}")))
        return self._resolve_all(decoded, summarizer)

    def _resolve_all(self, decoded: Sequence[_Line | _FLine], summarizer: Summarizer) -> list[InspectorError]:
        errors: list[InspectorError] = []

        def on_error(exc: InspectorError) -> None:
            # After a skip, records whose marker was skipped are expected: dropped, not errors.
            if not (self.resyncing and isinstance(exc, OrphanRecord)):
                errors.append(exc)

        summarizer.add_lines(decoded, self.resolve, on_error)
        return errors


def _record(key: Key, busbw: float, exec_us: float) -> InspectorRecord:
    comm, rank, hostname, pid, gpu, kind, size, timing, n_ranks, nnodes = key
    return InspectorRecord(
        comm=comm,
        collective=kind,
        size_bytes=size,
        exec_time_us=exec_us,
        busbw_gbs=busbw,
        timing_source=timing,
        n_ranks=n_ranks,
        nnodes=nnodes,
        rank=rank,
        hostname=hostname,
        pid=pid,
        gpu=gpu,
    )


def parse_line(line: bytes, stream: Stream | None = None) -> InspectorRecord | None:
    """One JSON line; pass the file's ``Stream`` for v4.3+ files, whose records need their marker."""
    return (stream if stream is not None else Stream()).parse_line(line)


# -- Prometheus textfiles -------------------------------------------------------------------------

_SAMPLE: Final = re.compile(
    r"(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)(?:\s+-?\d+)?\s*"
)
_LABEL: Final = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*(?:,|$)')
_SIZE_RANGE: Final = re.compile(r"(\d+)-\d+(B|KB|MB|GB|TB)|0B")
_UNIT: Final = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40}
_GPU_LABEL: Final = re.compile(r"GPU(\d{1,2})")
# Series name -> (which measure, collective or P2P). The per-device counters
# (nccl_collectives_total, ...) and anything else are not per-communicator timings: skipped.
_SERIES: Final = {
    "nccl_bus_bandwidth_gbs": ("busbw", "collective"),
    "nccl_collective_exec_time_microseconds": ("time", "collective"),
    "nccl_p2p_bus_bandwidth_gbs": ("busbw", "p2p_operation"),
    "nccl_p2p_exec_time_microseconds": ("time", "p2p_operation"),
}
_MAX_PROM_COMM: Final = 64


def _unescape(value: str) -> str:
    return value.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")


def _labels(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    pos = 0
    while pos < len(text):
        m = _LABEL.match(text, pos)
        if m is None:
            if text[pos:].strip():
                raise MalformedRecord(f"bad label set near {text[pos : pos + 40]!r}")
            break
        out[m.group(1)] = _unescape(m.group(2))
        pos = m.end()
    return out


def prometheus_size_bytes(label: str) -> int:
    """The lower bound of Inspector's message-size range label ("4-5GB" is 4 GiB, "0B" is 0)."""
    m = _SIZE_RANGE.fullmatch(label)
    if m is None:
        raise MalformedRecord(f"bad message_size {label[:40]!r}")
    if m.group(1) is None:
        return 0
    return int(m.group(1)) * _UNIT[m.group(2)]


def _int_label(labels: dict[str, str], name: str, minimum: int) -> int:
    text = labels.get(name, "")
    if not text.isdigit() or int(text) < minimum:
        raise MalformedRecord(f"label {name}={text[:20]!r} is not an integer >= {minimum}")
    return int(text)


def _prom_key(labels: dict[str, str], kind_label: str) -> Key:
    version = labels.get("version", "")
    if version not in PROMETHEUS_VERSIONS:
        raise UnknownVersion(f"unknown Inspector Prometheus version {version[:16]!r}")
    kind = labels.get(kind_label)
    comm = labels.get("comm_name")
    if not kind or comm is None:
        raise MalformedRecord(f"series without {kind_label} or comm_name")
    gpu_match = _GPU_LABEL.fullmatch(labels.get("gpu", ""))
    gpu = int(gpu_match.group(1)) if gpu_match is not None and int(gpu_match.group(1)) < 64 else None
    node = labels.get("node")
    return (
        comm[:_MAX_PROM_COMM],
        None,
        None if node in (None, "unknown") else node[:253],
        None,
        gpu,
        kind[:32],
        size_bucket(prometheus_size_bytes(labels.get("message_size", ""))),
        UNKNOWN_TIMING,
        _int_label(labels, "nranks", 1),
        _int_label(labels, "n_nodes", 1),
    )


def prometheus_records(
    text: str, errors: list[InspectorError] | None = None
) -> list[tuple[Key, float, float]]:
    """Each (bandwidth, time) pair of series in an Inspector textfile, as a summary key and values.

    A bad line or an unpaired series raises ``InspectorError``, or, where ``errors`` is given, is
    appended to it and skipped.
    """

    def fail(exc: InspectorError) -> None:
        if errors is None:
            raise exc
        errors.append(exc)

    # (series labels without the measure) -> [busbw, time]
    pairs: dict[tuple[tuple[str, str], ...], list[float | None]] = {}
    keys: dict[tuple[tuple[str, str], ...], Key] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.fullmatch(line)
        if m is None:
            fail(MalformedRecord(f"not a Prometheus sample: {line[:60]!r}"))
            continue
        series = _SERIES.get(m.group("name"))
        if series is None:
            continue
        measure, kind_label = series
        try:
            labels = _labels(m.group("labels") or "")
            value = float(m.group("value"))
            if not 0 <= value <= sys.float_info.max:
                raise MalformedRecord(f"{m.group('name')} is {m.group('value')[:20]!r}")
            ident = (("_kind", kind_label), *sorted(labels.items()))
            if ident not in keys:
                keys[ident] = _prom_key(labels, kind_label)
        except ValueError:
            fail(MalformedRecord(f"{m.group('name')} value {m.group('value')[:20]!r} is not a number"))
            continue
        except InspectorError as exc:
            fail(exc)
            continue
        slot = pairs.setdefault(ident, [None, None])
        slot[0 if measure == "busbw" else 1] = value
    out: list[tuple[Key, float, float]] = []
    for ident, (busbw, exec_us) in pairs.items():
        if busbw is None or exec_us is None:
            fail(MalformedRecord(f"{keys[ident][5]} series of {keys[ident][0]!r} without its pair"))
            continue
        out.append((keys[ident], busbw, exec_us))
    return out


def parse_prometheus(text: str, errors: list[InspectorError] | None = None) -> list[InspectorRecord]:
    """An Inspector Prometheus textfile as records: one per (bandwidth, time) pair of series."""
    return [_record(*r) for r in prometheus_records(text, errors)]


# -- The summary ----------------------------------------------------------------------------------


class _Acc:
    """One row's running summary: an exact count, min and max, and a bounded, evenly thinned sample.

    The sample holds the row's records number 0, ``stride``, 2 x ``stride``, ... (in the order
    read) where ``stride`` is the least power of two that keeps it at most ``max_samples``: every
    record until there would be more, then every other one, every fourth, ..., so it stays spread
    over the whole cycle. Min and max are exact: those of the sample, and of the records it left
    out (``lo_*``, ``hi_*``).
    """

    __slots__ = ("busbw", "count", "exec_us", "hi_bw", "hi_t", "lo_bw", "lo_t", "stride")

    def __init__(self) -> None:
        self.count = 0
        self.stride = 1
        self.busbw = array("d")
        self.exec_us = array("d")
        self.lo_bw = self.lo_t = float("inf")
        self.hi_bw = self.hi_t = float("-inf")

    def extend(self, busbw: list[float], exec_us: list[float], cap: int) -> None:
        """The row's next records, in order. Per call, not per record: min, max and slicing run
        in C over the whole list, and only over what the sample leaves out (``_stat`` takes the
        min and max of what it holds)."""
        first = self.count
        total = first + len(busbw)
        self.count = total
        stride = self.stride
        while -(-total // stride) > cap:  # ceil(total / stride): records 0, stride, ... < total
            stride *= 2
        if stride != self.stride:
            # Thinning: every step-th held record stays; the others leave their min and max.
            self._left_out(self.busbw, self.exec_us)
            step = stride // self.stride
            self.busbw = self.busbw[::step]
            self.exec_us = self.exec_us[::step]
            self.stride = stride
        if stride == 1:
            self.busbw.extend(busbw)
            self.exec_us.extend(exec_us)
        else:
            self._left_out(busbw, exec_us)  # the whole list: the held ones do no harm
            start = -first % stride  # the first of these whose number is a multiple of stride
            self.busbw.extend(busbw[start::stride])
            self.exec_us.extend(exec_us[start::stride])

    def _left_out(self, busbw: Sequence[float], exec_us: Sequence[float]) -> None:
        if busbw:
            self.lo_bw = min(self.lo_bw, min(busbw))  # noqa: PLW3301 - no argument tuple of the list
            self.hi_bw = max(self.hi_bw, max(busbw))  # noqa: PLW3301
            self.lo_t = min(self.lo_t, min(exec_us))  # noqa: PLW3301
            self.hi_t = max(self.hi_t, max(exec_us))  # noqa: PLW3301


def _stat(sample: Iterable[float], lo: float, hi: float) -> Stat:
    s = sorted(sample)
    last = len(s) - 1
    lo, hi = min(lo, s[0]), max(hi, s[-1])

    def q(p: float) -> float:
        return s[round(p * last)]

    return Stat(min=lo, p10=q(0.1), p50=q(0.5), p90=q(0.9), max=hi)


class Summarizer:
    """Per-cycle rows of the ``jobs`` section, bounded by ``max_keys`` rows of ``max_samples``."""

    def __init__(self, *, max_keys: int = MAX_COLLECTIVES, max_samples: int = DEFAULT_MAX_SAMPLES) -> None:
        if not 1 <= max_keys <= MAX_COLLECTIVES:
            raise ValueError(f"max_keys must be 1..{MAX_COLLECTIVES}")
        if max_samples < 2:
            raise ValueError("max_samples must be at least 2")
        self.max_keys = max_keys
        self.max_samples = max_samples
        self._rows: dict[Key, _Acc] = {}
        self.records = 0
        self.dropped = 0

    def add(self, key: Key, busbw: float, exec_us: float) -> bool:
        """Count one record; False where it was dropped (unknown kind, or no room for its row)."""
        return self.add_columns([key], [0], [busbw], [exec_us]) == 1

    def add_many(self, ops: Iterable[tuple[Key, float, float]]) -> int:
        """Count records (key, bus bandwidth, execution time); returns how many were summarized."""
        return self.add_lines(ops, _same, _reraise)

    def add_columns(
        self, keys: Sequence[Key], groups: Sequence[int], busbw: Sequence[float], exec_us: Sequence[float]
    ) -> int:
        """Count records given as columns: record i is of row ``keys[groups[i]]``, with bus
        bandwidth ``busbw[i]`` and execution time ``exec_us[i]``, in the order read. Returns how
        many were summarized. The whole collector's per-record work ends here, and none of it is
        a Python statement per record: the records are dealt to their rows by ``map`` (C), and
        each row takes its share in one call."""
        rows = self._rows
        accs: list[_Acc | None] = []
        for key in keys:
            acc = rows.get(key)
            if acc is None and key[5] in KINDS and len(rows) < self.max_keys:
                acc = rows[key] = _Acc()
            accs.append(acc)
        n = len(groups)
        per_bw: list[list[float]]
        per_t: list[list[float]]
        if len(keys) == 1:
            per_bw, per_t = [list(busbw)], [list(exec_us)]
        else:
            per_bw = [[] for _ in keys]
            per_t = [[] for _ in keys]
            append = list.append
            deque(map(append, map(per_bw.__getitem__, groups), busbw), maxlen=0)
            deque(map(append, map(per_t.__getitem__, groups), exec_us), maxlen=0)
        kept = 0
        cap = self.max_samples
        for acc, bw, t in zip(accs, per_bw, per_t, strict=True):
            if acc is not None and bw:
                acc.extend(bw, t, cap)
                kept += len(bw)
        self.records += n
        self.dropped += n - kept
        return kept

    def add_lines(
        self,
        items: Iterable[_T],
        resolve: Callable[[_T], tuple[Key, float, float] | None],
        on_error: Callable[[InspectorError], None],
    ) -> int:
        """Resolve each item to a record and count it; returns how many were summarized.

        ``resolve`` returns None for an item that is no record (a marker), or raises
        ``InspectorError`` for a bad one: counted as read and dropped, and passed to ``on_error``.
        The exact path, one item at a time; the fast path hands ``add_columns`` its columns.
        """
        index: dict[Key, int] = {}
        keys: list[Key] = []
        groups: list[int] = []
        busbw: list[float] = []
        exec_us: list[float] = []
        for item in items:
            try:
                resolved = resolve(item)
            except InspectorError as exc:
                self.records += 1
                self.dropped += 1
                on_error(exc)
                continue
            if resolved is None:
                continue
            key, bw, t = resolved
            g = index.get(key)
            if g is None:
                g = index[key] = len(keys)
                keys.append(key)
            groups.append(g)
            busbw.append(bw)
            exec_us.append(t)
        return self.add_columns(keys, groups, busbw, exec_us)

    def add_record(self, record: InspectorRecord) -> bool:
        return self.add(
            (
                record.comm,
                record.rank,
                record.hostname,
                record.pid,
                record.gpu,
                record.collective,
                size_bucket(record.size_bytes),
                record.timing_source,
                record.n_ranks,
                record.nnodes,
            ),
            record.busbw_gbs,
            record.exec_time_us,
        )

    def malformed(self, n: int) -> None:
        """Lines read that held no usable record: read, and dropped."""
        self.records += n
        self.dropped += n

    def __len__(self) -> int:
        return len(self._rows)

    def take(self) -> Jobs:
        """This cycle's section; the summary starts over empty."""
        rows = []
        for key in sorted(self._rows, key=_sort_key):
            acc = self._rows[key]
            comm, rank, hostname, pid, gpu, kind, size, timing, n_ranks, nnodes = key
            rows.append(
                Collective(
                    comm=comm,
                    collective=kind,
                    size_bytes=size,
                    n_ranks=n_ranks,
                    nnodes=nnodes,
                    count=acc.count,
                    timing_source=timing,
                    busbw_gbs=_stat(acc.busbw, acc.lo_bw, acc.hi_bw),
                    exec_time_us=_stat(acc.exec_us, acc.lo_t, acc.hi_t),
                    rank=UNSET if rank is None else rank,
                    hostname=UNSET if hostname is None else hostname,
                    pid=UNSET if pid is None else pid,
                    gpu=UNSET if gpu is None else gpu,
                )
            )
        jobs = Jobs(format=JOBS_FORMAT, collectives=tuple(rows), records=self.records, dropped=self.dropped)
        self._rows = {}
        self.records = 0
        self.dropped = 0
        return jobs


def _same(op: tuple[Key, float, float]) -> tuple[Key, float, float]:
    return op


def _reraise(exc: InspectorError) -> None:
    raise exc


def _sort_key(key: Key) -> tuple[object, ...]:
    # None sorts before any value of its field.
    return tuple((v is not None, v if v is not None else 0) for v in key)
