"""The compact wire encoding of the v1 report: msgpack, with GPUs, NVLinks and NICs as rows.

The JSON report (``agent.report``) names every field of every GPU, NVLink and NIC: an H100
node's report is about 42 KB, most of it the same names again. The compact form carries the same
report, with the same types and constraints, as msgpack (``Content-Type: application/msgpack``),
in which a GPU, an NVLink and a NIC are arrays whose columns are in a declared order, and a NIC's
``counters`` is an array in the order of the NIC counter table plus a map of the counters the
table does not name. Everything else (the report's own fields, events, probes, errors and any
section added within v1) is a msgpack map exactly like its JSON object, so new optional sections
ride along unchanged.

The column orders are the field catalogue's and the NIC counter table's in ``agent.report``
(``GPU_COLUMNS`` and the rest below; checked at import against the structs' own field order).
They are summed up in ``LAYOUT``, a digest carried in every compact report and advertised by the
aggregator (``Accept-Post``): a sender uses the compact form only where the receiver's layout is
its own, so two builds that disagree about a column never misread each other; they speak JSON.

``decode_compact`` returns a ``Report`` whose GPUs, NVLinks and NICs are ``GpuRow``, ``NvLinkRow``
and ``NicRow``: subclasses of ``Gpu``, ``NvLink`` and ``Nic`` with the same fields and values,
built by msgspec in one pass and validated as the JSON decoder validates. They are what the
pipeline reads; only their own encoding differs (msgspec writes them back as rows), so code that
re-encodes a report as JSON passes it through ``as_v1`` first.

The format is described, column by column, in docs/spec.md (section "Compact encoding"), and its
decoded shape is published as a JSON Schema in ``agent/schema/report-compact-v1.schema.json``.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import operator
import re
import sys
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Annotated, Any, Final, Protocol, get_args

import msgspec
from msgspec import UNSET, Meta, UnsetType

from agent.errors import ReportError
from agent.report import (
    CATALOGUE,
    NIC_COUNTER_CATALOGUE,
    SCHEMA_ID,
    Count,
    Gpu,
    Nic,
    NvLink,
    Report,
    fields_getter,
)

JSON_MEDIA_TYPE: Final = "application/json"
COMPACT_MEDIA_TYPE: Final = "application/msgpack"
# Names msgpack has gone by; a receiver takes any of them, a sender writes the first.
COMPACT_MEDIA_TYPES: Final = frozenset(
    {COMPACT_MEDIA_TYPE, "application/x-msgpack", "application/vnd.msgpack"}
)
# The aggregator's answer header saying what a POST to /v1/reports may carry (the header name is
# the W3C Linked Data Platform's, RFC 7231 media ranges with a ``layout`` parameter).
ACCEPT_POST_HEADER: Final = "Accept-Post"


# -- The column orders ------------------------------------------------------------------------------


def _columns(struct: type[msgspec.Struct]) -> tuple[str, ...]:
    """The struct's fields as row columns: its catalogue entries in catalogue order, then the
    fields the catalogue does not list (nested lists and maps). The struct must declare its fields
    in that order too: msgspec writes and reads a row in declaration order."""
    table = CATALOGUE[struct]
    order = (*table, *(name for name in struct.__struct_fields__ if name not in table))
    if order != struct.__struct_fields__:
        raise TypeError(
            f"{struct.__name__}: fields are declared in another order than its catalogue "
            f"({struct.__struct_fields__} vs {order}); the compact rows need one order"
        )
    return order


GPU_COLUMNS: Final[tuple[str, ...]] = _columns(Gpu)
NVLINK_COLUMNS: Final[tuple[str, ...]] = _columns(NvLink)
NIC_COLUMNS: Final[tuple[str, ...]] = _columns(Nic)
NIC_COUNTER_COLUMNS: Final[tuple[str, ...]] = tuple(NIC_COUNTER_CATALOGUE)
# The columns of a NIC's ``counters`` cell (``CounterCell``).
COUNTER_CELL_COLUMNS: Final[tuple[str, ...]] = ("present", "values", "other")
TABLES: Final[Mapping[str, tuple[str, ...]]] = types.MappingProxyType(
    {
        "gpu": GPU_COLUMNS,
        "nvlink": NVLINK_COLUMNS,
        "nic": NIC_COLUMNS,
        "counter_cell": COUNTER_CELL_COLUMNS,
        "nic_counter": NIC_COUNTER_COLUMNS,
    }
)


def _layout_digest(tables: Mapping[str, tuple[str, ...]]) -> str:
    text = "\n".join(f"{table}:{','.join(columns)}" for table, columns in tables.items())
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# Names this build's column orders: any change to a table (a column added, moved or renamed) is
# a new layout, without anyone having to remember to bump a number.
LAYOUT: Final = _layout_digest(TABLES)


# -- The row types ------------------------------------------------------------------------------------
# Subclasses of the report's structs, as msgpack arrays. Every column is required (no defaults), so
# a row of any other length is refused, naming the row; a column that is optional-but-never-null in
# JSON (``Gpu.nvlink``, ``Nic.counters``) is nil on the wire where absent, and UNSET once decoded.


# Which NIC counter table columns a NIC has: bit i (byte i // 8, bit i % 8, least significant
# first) set for column i. Like Arrow's validity bitmaps: a NIC has some 50 of the table's columns,
# and the values of those alone follow, in table order.
PRESENT_BYTES: Final = (len(NIC_COUNTER_COLUMNS) + 7) // 8


class CounterCell(msgspec.Struct, array_like=True, frozen=True, gc=False, forbid_unknown_fields=True):
    """A NIC's ``counters`` on the wire: the bitmap of the table columns it has, their values in
    table order, and a map of the counters the table does not name (nil when there are none).
    Never seen once decoded: it becomes the ``counters`` dict."""

    present: Annotated[bytes, Meta(min_length=PRESENT_BYTES, max_length=PRESENT_BYTES)]
    values: Annotated[list[Count], Meta(max_length=len(NIC_COUNTER_COLUMNS))]
    other: Annotated[dict[str, Count], Meta(max_length=256)] | None


def _swap(hint: Any, subs: Mapping[Any, Any]) -> Any:
    """``hint`` with the types in ``subs`` replaced (through Annotated, unions and lists)."""
    if hint in subs:
        return subs[hint]
    origin, args = typing.get_origin(hint), get_args(hint)
    if origin is Annotated:
        return Annotated[(_swap(args[0], subs), *hint.__metadata__)]
    if origin in (types.UnionType, typing.Union):
        return functools.reduce(operator.or_, (_swap(a, subs) for a in args))
    if origin is list:
        return list[_swap(args[0], subs)]  # type: ignore[misc]
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return tuple[_swap(args[0], subs), ...]  # type: ignore[misc]
    return hint


def _row_type(base: type[msgspec.Struct], subs: Mapping[Any, Any]) -> type[msgspec.Struct]:
    hints = typing.get_type_hints(base, include_extras=True)
    fields = [(name, _swap(hints[name], {**subs, UnsetType: type(None)})) for name in base.__struct_fields__]
    doc = f"A {base.__name__} as a row; its columns, in order: {', '.join(base.__struct_fields__)}."
    row = msgspec.defstruct(
        f"{base.__name__}Row",
        fields,
        bases=(base,),
        array_like=True,
        frozen=True,
        module=__name__,
        namespace={"__doc__": doc},
    )
    if row.__struct_fields__ != base.__struct_fields__ or row.__struct_defaults__:
        raise TypeError(f"{row.__name__}: the row must have every column of {base.__name__}, none optional")
    return row


if typing.TYPE_CHECKING:
    # What readers see: rows are the report's structs.
    NvLinkRow = NvLink
    GpuRow = Gpu
    NicRow = Nic
else:
    NvLinkRow = _row_type(NvLink, {})
    GpuRow = _row_type(Gpu, {NvLink: NvLinkRow})
    NicRow = _row_type(Nic, {typing.get_type_hints(Nic, include_extras=True)["counters"]: CounterCell | None})


def _wire_report_type() -> type[msgspec.Struct]:
    """The compact report: the v1 report's fields (whatever they are), rows in place of GPUs and
    NICs, and the layout. Built from ``Report``, so a section added to it is carried unchanged."""
    hints = typing.get_type_hints(Report, include_extras=True)
    n_required = len(Report.__struct_fields__) - len(Report.__struct_defaults__)
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for i, name in enumerate(Report.__struct_fields__):
        hint = _swap(hints[name], {Gpu: GpuRow, Nic: NicRow})
        if i < n_required:
            fields.append((name, hint))
        else:
            fields.append((name, hint, Report.__struct_defaults__[i - n_required]))
    fields.append(("layout", str))
    return msgspec.defstruct(
        "CompactReport",
        fields,
        kw_only=True,
        frozen=True,
        gc=False,
        forbid_unknown_fields=True,
        module=__name__,
        namespace={
            "__doc__": "The v1 report in the compact encoding: a map of the report's fields, GPUs and "
            f"NICs as rows, and the layout of their columns ({LAYOUT!r} in this build)."
        },
    )


CompactReport: Final = _wire_report_type()


# -- Encoding --------------------------------------------------------------------------------------

_NVLINK_ROW: Final = operator.attrgetter(*NVLINK_COLUMNS)
_GPU_SCALARS: Final = operator.attrgetter(*GPU_COLUMNS[:-1])
_NIC_SCALARS: Final = operator.attrgetter(*NIC_COLUMNS[:-1])
_COUNTER_INDEX: Final[Mapping[str, int]] = types.MappingProxyType(
    {name: i for i, name in enumerate(NIC_COUNTER_COLUMNS)}
)
_N_COUNTERS: Final = len(NIC_COUNTER_COLUMNS)
_COUNTER_NAMES: Final = frozenset(NIC_COUNTER_COLUMNS)
if GPU_COLUMNS[-1] != "nvlink" or NIC_COLUMNS[-1] != "counters":
    raise TypeError("the compact rows expect Gpu.nvlink and Nic.counters as their last columns")


def _gpu_row(gpu: Gpu) -> tuple[Any, ...]:
    links = gpu.nvlink
    return (*_GPU_SCALARS(gpu), None if isinstance(links, UnsetType) else list(map(_NVLINK_ROW, links)))


def _counter_cell(
    counters: dict[str, int] | UnsetType,
) -> tuple[bytes, list[int], dict[str, int] | None] | None:
    if isinstance(counters, UnsetType):
        return None
    columns: list[tuple[int, int]] = []
    other: dict[str, int] | None = None
    for name, value in counters.items():
        i = _COUNTER_INDEX.get(name)
        if i is not None:
            columns.append((i, value))
        elif other is None:
            other = {name: value}
        else:
            other[name] = value
    columns.sort()
    bits = 0
    for i, _ in columns:
        bits |= 1 << i
    return bits.to_bytes(PRESENT_BYTES, "little"), [value for _, value in columns], other


def _nic_row(nic: Nic) -> tuple[Any, ...]:
    return (*_NIC_SCALARS(nic), _counter_cell(nic.counters))


def to_compact_builtins(report: Report) -> dict[str, Any]:
    """The compact report as msgpack-ready objects (tuples are arrays); the map msgspec writes."""
    out: dict[str, Any] = {}
    for name in Report.__struct_fields__:
        value = getattr(report, name)
        if value is not UNSET:
            out[name] = value
    out["gpus"] = list(map(_gpu_row, report.gpus))
    out["nics"] = list(map(_nic_row, report.nics))
    out["layout"] = LAYOUT
    return out


_ENCODER: Final = msgspec.msgpack.Encoder()


def encode_compact(report: Report) -> bytes:
    """The report as compact msgpack bytes (what ``application/msgpack`` carries)."""
    return _ENCODER.encode(to_compact_builtins(report))


# -- Decoding --------------------------------------------------------------------------------------

_DECODER: Final = msgspec.msgpack.Decoder(CompactReport)


class _LayoutOnly(msgspec.Struct):
    schema: object = None
    layout: object = None


_LAYOUT_ONLY: Final = msgspec.msgpack.Decoder(_LayoutOnly)


class LayoutError(ReportError):
    """A compact report in a layout other than this build's (send JSON instead)."""


class WrongSchemaError(ReportError):
    """A report of another schema version than ``SCHEMA_ID``."""


class NotCompactError(ReportError):
    """Bytes that are not msgpack at all."""


# What a name in a msgspec path is: a list of rows (its next index is a row, the one after a
# column), or the counters cell (its index is a column).
_ROW_LISTS: Final[Mapping[str, tuple[str, ...]]] = types.MappingProxyType(
    {"gpus": GPU_COLUMNS, "nvlink": NVLINK_COLUMNS, "nics": NIC_COLUMNS}
)


def _after(name: str) -> tuple[str, str] | None:
    if name in _ROW_LISTS:
        return ("list", name)
    if name == "counters":
        return ("cell", name)
    return None


def _named_path(path: str) -> str:
    """A msgspec path into the wire form (``$.gpus[3][45][2][4]``) with row columns named as in
    the JSON report (``$.gpus[3].nvlink[2].replay_errors_total``)."""
    out: list[str] = []
    state: tuple[str, str] | None = None
    for dot, index, other in re.findall(r"\.(\w+)|\[(\d+)\]|(\[[^\]]*\]|.)", path.removeprefix("$")):
        if dot:
            out.append(f".{dot}")
            state = _after(dot)
        elif index and state is not None and state[0] == "list":
            out.append(f"[{index}]")
            state = ("row", state[1])
        elif index and state is not None and state[0] == "row" and int(index) < len(_ROW_LISTS[state[1]]):
            column = _ROW_LISTS[state[1]][int(index)]
            out.append(f".{column}")
            state = _after(column)
        elif index and state is not None and state[0] == "cell" and int(index) < len(COUNTER_CELL_COLUMNS):
            out.append(f".{COUNTER_CELL_COLUMNS[int(index)]}")
            state = None
        else:
            out.append(f"[{index}]" if index else other)
            state = None
    return "$" + "".join(out)


_ROW_LENGTH: Final = re.compile(r"Expected `array` of at (?:least|most) length (\d+), got (\d+)")


def _refusal(exc: msgspec.ValidationError) -> str:
    text = str(exc)
    head, sep, path = text.rpartition(" - at `")
    if not sep or not path.endswith("`"):
        return text
    # A row's length is its column count: say so, in the layout's terms.
    head = _ROW_LENGTH.sub(r"wrong column count: \1 columns in this layout, got \2", head)
    return f"{head} - at `{_named_path(path[:-1])}`"


def _check_layout(data: bytes) -> None:
    """Raise the error that says why ``data`` is not this build's compact report, if it is not."""
    if not data or not (0x80 <= data[0] <= 0x8F or data[0] in (0xDE, 0xDF)):
        raise NotCompactError("the body is not a compact report: it does not start with a msgpack map")
    try:
        head = _LAYOUT_ONLY.decode(data)
    except msgspec.DecodeError:
        return  # not even msgpack: the caller's error says so
    except msgspec.ValidationError as exc:
        raise NotCompactError(f"the body is not a compact report (not a msgpack map): {exc}") from exc
    if isinstance(head.schema, str) and head.schema != SCHEMA_ID:
        raise WrongSchemaError(
            f"report schema {head.schema[:64]!r} is not supported; this aggregator accepts {SCHEMA_ID!r}"
        )
    if head.layout != LAYOUT:
        shown = repr(head.layout)[:40]
        raise LayoutError(f"compact layout {shown} is not this build's ({LAYOUT!r}); send JSON")


# Where floats are, per struct type: msgpack can carry NaN and infinity, JSON cannot, and the
# report's contract is JSON's: a compact report with one is refused as JSON would refuse it.
@dataclass(frozen=True)
class _FloatPlan:
    get: Callable[[Any], tuple[Any, ...]]
    names: tuple[str, ...]
    children: tuple[tuple[str, _FloatPlan], ...]  # lists of structs and single structs


def _float_plan(struct: type[msgspec.Struct]) -> _FloatPlan | None:
    """The struct's float fields and the nested structs that have some; None if it has none."""
    hints = typing.get_type_hints(struct)
    names: list[str] = []
    children: list[tuple[str, _FloatPlan]] = []
    for name in struct.__struct_fields__:
        for member in _members(hints[name]):
            nested: Any = None
            if member is float:
                names.append(name)
            elif typing.get_origin(member) in (list, tuple):  # list[S] or tuple[S, ...]
                nested = get_args(member)[0]
            elif isinstance(member, type) and issubclass(member, msgspec.Struct):
                nested = member
            if isinstance(nested, type) and issubclass(nested, msgspec.Struct):
                child = _float_plan(nested)
                if child is not None:  # NVLinks have no floats: never walk their 144 rows
                    children.append((name, child))
    if not names and not children:
        return None
    return _FloatPlan(fields_getter(names), tuple(names), tuple(children))


def _members(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        return tuple(itertools.chain.from_iterable(_members(a) for a in get_args(hint)))
    return (hint,)


_REPORT_FLOATS: Final = _float_plan(Report)


def _all_finite(plan: _FloatPlan, items: list[Any]) -> bool:
    values = filter(None, itertools.chain.from_iterable(map(plan.get, items)))  # None and 0.0 are fine
    if not all(map(math.isfinite, values)):
        return False
    for name, child in plan.children:
        found: list[Any] = []
        for value in map(operator.attrgetter(name), items):
            if isinstance(value, (list, tuple)):
                found.extend(value)
            elif isinstance(value, msgspec.Struct):
                found.append(value)
        if found and not _all_finite(child, found):
            return False
    return True


def _first_non_finite(plan: _FloatPlan, obj: Any, path: str) -> str:
    for name, value in zip(plan.names, plan.get(obj), strict=True):
        if isinstance(value, float) and not math.isfinite(value):
            return f"{path}.{name}"
    for name, child in plan.children:
        value = getattr(obj, name)
        many = isinstance(value, (list, tuple))
        items = value if many else [value] if isinstance(value, msgspec.Struct) else []
        for i, item in enumerate(items):
            where = _first_non_finite(child, item, f"{path}.{name}[{i}]" if many else f"{path}.{name}")
            if where:
                return where
    return ""


@functools.lru_cache(maxsize=4096)
def _present_columns(present: bytes) -> tuple[str, ...] | None:
    """The column names a bitmap marks (None if it marks a bit past the table). A fleet has a few
    kinds of NIC, so this runs a few times; every report after that is one cache lookup."""
    bits = int.from_bytes(present, "little")
    if bits >> _N_COUNTERS:
        return None
    return tuple(name for i, name in enumerate(NIC_COUNTER_COLUMNS) if bits >> i & 1)


def _counters(cell: CounterCell, i: int) -> dict[str, int]:
    names = _present_columns(cell.present)
    values = cell.values
    if names is None or len(names) != len(values):
        marked = "past the table" if names is None else f"{len(names)} columns"
        raise ReportError(
            f"compact report does not match {SCHEMA_ID}: wrong column count: the bitmap marks {marked}, "
            f"{len(values)} values follow - at `$.nics[{i}].counters`"
        )
    counters = dict(zip(names, values, strict=True))
    if cell.other:
        if not _COUNTER_NAMES.isdisjoint(cell.other):
            name = min(_COUNTER_NAMES.intersection(cell.other))
            raise ReportError(
                f"compact report does not match {SCHEMA_ID}: counter {name!r} has a column of its "
                f"own and must not be in the other map - at `$.nics[{i}].counters`"
            )
        counters.update(cell.other)
        if len(counters) > _MAX_COUNTERS:
            raise ReportError(
                f"compact report does not match {SCHEMA_ID}: Expected `object` of length <= "
                f"{_MAX_COUNTERS} - at `$.nics[{i}].counters`"
            )
    return counters


_REPORT_FIELDS: Final = Report.__struct_fields__
_REPORT_VALUES: Final = operator.attrgetter(*_REPORT_FIELDS)
_MAX_COUNTERS: Final = 256  # Nic.counters' max_length
_SET_ATTR: Final = msgspec.structs.force_setattr


def decode_compact(data: bytes) -> Report:
    """Parse and validate one compact report into a ``Report`` (see the module docstring).

    Raises ``ReportError`` naming the offending field with the JSON report's names
    (``$.gpus[3].nvlink[2].replay_errors_total``), ``LayoutError`` for another build's layout. A
    row with the wrong number of columns is refused naming the row.
    """
    try:
        wire = _DECODER.decode(data)
    except msgspec.ValidationError as exc:
        _check_layout(data)
        raise ReportError(f"compact report does not match {SCHEMA_ID}: {_refusal(exc)}") from exc
    except msgspec.DecodeError as exc:
        raise NotCompactError(f"report is not valid msgpack: {exc}") from exc
    if wire.layout != LAYOUT:  # type: ignore[attr-defined]
        # Decoded, but by another build's columns: whatever it says is misread.
        _check_layout(data)
    # The two optional-but-never-null columns: nil on the wire, UNSET in the report.
    for gpu in wire.gpus:  # type: ignore[attr-defined]
        if gpu.nvlink is None:
            _SET_ATTR(gpu, "nvlink", UNSET)
    for i, nic in enumerate(wire.nics):  # type: ignore[attr-defined]
        cell = nic.counters
        if cell is None:
            _SET_ATTR(nic, "counters", UNSET)
        else:
            _SET_ATTR(nic, "counters", _counters(cell, i))
    report = Report(**dict(zip(_REPORT_FIELDS, _REPORT_VALUES(wire), strict=True)))
    plan = _REPORT_FLOATS
    if plan is not None and not _all_finite(plan, [report]):
        where = _first_non_finite(plan, report, "$")
        raise ReportError(
            f"compact report does not match {SCHEMA_ID}: NaN and infinity are not numbers a report "
            f"may carry (JSON cannot) - at `{where}`"
        )
    return report


def _plain(struct: type[Any], row: Any) -> Any:
    return struct(**{name: getattr(row, name) for name in struct.__struct_fields__})


def as_v1(report: Report) -> Report:
    """The report with plain ``Gpu``, ``NvLink`` and ``Nic`` in place of rows, for code that encodes
    it again (a trace converter, a test comparing reports); the same report if it has no rows.
    Builds every struct in Python: never on the ingest path."""
    if all(type(g) is Gpu for g in report.gpus) and all(type(n) is Nic for n in report.nics):
        return report
    gpus = []
    for gpu in report.gpus:
        plain = _plain(Gpu, gpu)
        if not isinstance(gpu.nvlink, UnsetType):
            plain = msgspec.structs.replace(plain, nvlink=tuple(_plain(NvLink, link) for link in gpu.nvlink))
        gpus.append(plain)
    nics = tuple(_plain(Nic, nic) for nic in report.nics)
    return msgspec.structs.replace(report, gpus=tuple(gpus), nics=nics)


# -- Traces ----------------------------------------------------------------------------------------
# A compact trace (what ``gpuwarden replay`` reads besides JSON Lines) is a msgpack stream of
# ``bin`` objects, each holding one compact report as it was received: any streaming msgpack
# reader can walk it, a damaged record costs that record only, and its first byte (0xc4-0xc6)
# tells it from JSON Lines (which start with ``{`` or whitespace).
TRACE_MARKERS: Final[Mapping[int, int]] = types.MappingProxyType({0xC4: 1, 0xC5: 2, 0xC6: 4})
_BIN32: Final = 0xC6


def frame(body: bytes) -> bytes:
    """One trace record: ``body`` as a msgpack bin 32."""
    return bytes((_BIN32,)) + len(body).to_bytes(4, "big") + body


def write_trace(stream: IO[bytes], reports: Iterable[Report]) -> int:
    """Write ``reports`` as a compact trace; the number written."""
    n = 0
    for report in reports:
        stream.write(frame(encode_compact(report)))
        n += 1
    return n


class Readable(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


def read_frames(stream: Readable) -> Iterator[bytes]:
    """The records of a compact trace, in order. Raises ``ValueError`` where the stream is not
    one (a byte that starts no bin object, a record cut short)."""
    while True:
        marker = stream.read(1)
        if not marker:
            return
        width = TRACE_MARKERS.get(marker[0])
        if width is None:
            raise ValueError(f"byte 0x{marker[0]:02x} starts no trace record (a msgpack bin)")
        size_bytes = stream.read(width)
        if len(size_bytes) != width:
            raise ValueError("the trace ends inside a record's length")
        size = int.from_bytes(size_bytes, "big")
        body = stream.read(size)
        if len(body) != size:
            raise ValueError(f"the trace ends inside a record ({len(body)} of {size} bytes)")
        yield body


# -- The published description ------------------------------------------------------------------------


def compact_json_schema() -> dict[str, Any]:
    """A JSON Schema of the compact report as a msgpack reader decodes it (maps, arrays; ``bin`` as
    a string): what ``agent/schema/report-compact-v1.schema.json`` publishes."""
    generated = msgspec.json.schema(CompactReport)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "gpuwarden/report/v1/compact",
        "title": "gpuwarden node report, version 1, compact encoding (application/msgpack)",
        "description": (
            "The v1 report (report-v1.schema.json) as msgpack, with GPUs, NVLinks and NICs as arrays "
            "whose columns are listed in each row's description, and a NIC's counters as "
            "[present, values, other]: a bitmap of the NIC counter table columns present (bit i of "
            "byte i // 8, least significant bit first), their values in table order, and a map of the "
            "counters the table does not name (or nil). nil in a row is JSON's null; for nvlink and "
            "counters it means absent. This schema describes the decoded shape; msgpack's bin is the "
            "bitmap's type (a string here). docs/spec.md, section Compact encoding."
        ),
        "x-layout": LAYOUT,
        "x-columns": {table: list(columns) for table, columns in TABLES.items()},
        **generated,
    }


def column_table_markdown() -> str:
    """The column tables of docs/spec.md (generated: ``python -m agent.wire --spec-table``)."""
    lines = [f"Layout `{LAYOUT}`.", ""]
    names = {
        "gpu": "GPU row (`gpus[]`)",
        "nvlink": "NVLink row (a GPU's `nvlink` column)",
        "nic": "NIC row (`nics[]`)",
        "counter_cell": "A NIC's `counters` column (nil where the NIC reports no counters)",
        "nic_counter": "NIC counter table (bits of a NIC's `counters` bitmap)",
    }
    for table, columns in TABLES.items():
        lines += [f"{names[table]}, {len(columns)} columns:", ""]
        lines += ["| column | field |", "| ---: | --- |"]
        lines += [f"| {i} | `{name}` |" for i, name in enumerate(columns)]
        lines.append("")
    return "\n".join(lines)


def _main(argv: list[str]) -> int:
    if argv == ["--schema"]:
        print(json.dumps(compact_json_schema(), indent=2))
        return 0
    if argv == ["--spec-table"]:
        print(column_table_markdown(), end="")
        return 0
    print("usage: python -m agent.wire --schema | --spec-table", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
