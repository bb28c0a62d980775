"""The compact encoding (agent/wire.py): round trips, the same refusals as JSON, column counts,
the column tables against the catalogue, the published schema and the spec's table, traces."""

from __future__ import annotations

import copy
import io
import json
import math
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
from _reports import Fault, FaultKind, NodeSim

from agent import wire
from agent.errors import ReportError
from agent.report import (
    GPU_CATALOGUE,
    NIC_CATALOGUE,
    NIC_COUNTER_CATALOGUE,
    NVLINK_CATALOGUE,
    SCHEMA_ID,
    CollectorError,
    Event,
    Gpu,
    Nic,
    NvLink,
    Probe,
    Report,
    decode,
    encode,
)
from tests.test_report_schema import CASES, _valid

ROOT = Path(__file__).resolve().parent.parent
SCHEMA_FILE = ROOT / "agent" / "schema" / "report-compact-v1.schema.json"
SPEC = ROOT / "docs" / "spec.md"


def round_trip(report: Report) -> Report:
    return wire.decode_compact(wire.encode_compact(report))


def minimal(**kw: Any) -> Report:
    fields: dict[str, Any] = {
        "schema": SCHEMA_ID,
        "node": "n",
        "time": 1_764_441_600.0,
        "seq": 0,
        "boot_id": "b",
        "gpus": (),
        "nics": (),
    }
    return Report(**{**fields, **kw})


def generated() -> list[Report]:
    """H100 nodes as the benches make them, over rounds, with a fault's events and a lost GPU."""
    out = []
    faults = [Fault(node=1, kind=FaultKind.XID_79, start=2)]
    for i in range(3):
        sim = NodeSim(i, seed=7)
        for r in range(4):
            out.append(sim.report(1_764_441_600.0 + 10 * r, r, [f for f in faults if f.node == i]))
    return out


EDGE_CASES: dict[str, Report] = {
    "minimal: every optional section absent": minimal(),
    "optional sections present and empty": minimal(labels={}, events=(), probes=(), errors=()),
    "a GPU of nulls, no NVLinks field": minimal(gpus=(Gpu(index=0, uuid="GPU-0"),)),
    "a GPU with an empty NVLink list": minimal(gpus=(Gpu(index=0, uuid="GPU-0", nvlink=()),)),
    "NVLinks of nulls": minimal(gpus=(Gpu(index=1, uuid="GPU-1", nvlink=(NvLink(link=0), NvLink(link=17))),)),
    "a NIC without counters": minimal(nics=(Nic(device="eth0", link_layer="Ethernet"),)),
    "a NIC with empty counters": minimal(nics=(Nic(device="eth0", link_layer="Ethernet", counters={}),)),
    "counters the table does not name, and zero values": minimal(
        nics=(
            Nic(
                device="mlx5_0",
                link_layer="InfiniBand",
                port=1,
                counters={"symbol_error": 0, "driver_only_counter": 5, "rx_bytes": 2**64 - 1},
            ),
        )
    ),
    "only counters the table does not name": minimal(
        nics=(Nic(device="mlx5_0", link_layer="InfiniBand", counters={"np_cnp_sent_x": 1}),)
    ),
    "every column of the counter table": minimal(
        nics=(
            Nic(
                device="mlx5_0",
                link_layer="InfiniBand",
                counters={name: i for i, name in enumerate(NIC_COUNTER_CATALOGUE)},
            ),
        )
    ),
    "events, probes, errors, labels": minimal(
        agent_version="0.1.0",
        run="r1",
        interval_seconds=10.0,
        labels={"pool": "a"},
        events=(Event(kind="xid", time=1_764_441_599.0, gpu=3, code=79, message="fell off the bus"),),
        probes=(Probe(kind="tcp_pair", time=1_764_441_598.0, ok=False, peer="n2", error="refused"),),
        errors=(CollectorError(collector="nvml", message="GPU 3 is lost", code="gpu_lost", gpu=3),),
    ),
}


# -- round trips ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(EDGE_CASES))
def test_edge_cases_round_trip_exactly(name: str) -> None:
    report = EDGE_CASES[name]
    back = round_trip(report)
    assert wire.as_v1(back) == report
    # Encoded as JSON again it is the same report (counters in table order: a map has no order).
    assert decode(encode(wire.as_v1(back))) == report
    # What the pipeline reads is the report: same types (by inheritance), same values.
    assert type(back) is Report
    assert all(isinstance(g, Gpu) for g in back.gpus)
    assert all(isinstance(n, Nic) for n in back.nics)


def test_generated_h100_reports_round_trip_and_match_their_json_decode() -> None:
    reports = generated()
    assert any(r.events for r in reports), "the fault should have produced events"
    for report in reports:
        from_json = decode(encode(report))
        from_compact = round_trip(report)
        assert wire.as_v1(from_compact) == from_json == report
        # Attribute by attribute too, as the pipeline reads them (rows are not ==-equal to structs).
        for a, b in zip(from_compact.gpus, from_json.gpus, strict=True):
            assert all(getattr(a, f) == getattr(b, f) for f in Gpu.__struct_fields__ if f != "nvlink")
            assert [msgspec.structs.astuple(x) for x in a.nvlink] == [  # type: ignore[union-attr]
                msgspec.structs.astuple(x)
                for x in b.nvlink  # type: ignore[union-attr]
            ]
        for a, b in zip(from_compact.nics, from_json.nics, strict=True):
            assert msgspec.structs.astuple(a) == msgspec.structs.astuple(b)


def test_compact_is_much_smaller_than_json() -> None:
    report = generated()[-1]
    # About 42 KB of JSON; the rows drop the field names (docs/performance.md, "Wire format").
    assert len(wire.encode_compact(report)) * 5 < len(encode(report))


def test_as_v1_keeps_a_plain_report_as_it_is() -> None:
    report = EDGE_CASES["events, probes, errors, labels"]
    assert wire.as_v1(report) is report


# -- the same refusals as JSON ----------------------------------------------------------------------

# Documents JSON can say and a compact report cannot: an unknown GPU field has no column, a null
# nvlink or counters is what nil means in a row (absent). (Nor can msgpack hold an integer past 64
# bits: those cases are skipped where they cannot be encoded.)
_NOT_EXPRESSIBLE = {"gpu unknown field", "gpu null nvlink", "nic null counters"}


def compact_doc(doc: dict[str, Any]) -> dict[str, Any]:
    """A JSON report document in the compact layout, builtins to builtins: refusals included."""
    out = {**doc, "layout": wire.LAYOUT}
    gpus = []
    for g in doc.get("gpus", []):
        row = [g.get(c) for c in wire.GPU_COLUMNS[:-1]]
        links = g.get("nvlink")
        row.append(None if links is None else [[link.get(c) for c in wire.NVLINK_COLUMNS] for link in links])
        gpus.append(row)
    nics = []
    for n in doc.get("nics", []):
        row = [n.get(c) for c in wire.NIC_COLUMNS[:-1]]
        counters = n.get("counters")
        if counters is None:
            row.append(None)
        else:
            names = [c for c in wire.NIC_COUNTER_COLUMNS if c in counters]
            bits = sum(1 << wire.NIC_COUNTER_COLUMNS.index(c) for c in names)
            other = {k: v for k, v in counters.items() if k not in wire.NIC_COUNTER_COLUMNS}
            row.append(
                [bits.to_bytes(wire.PRESENT_BYTES, "little"), [counters[c] for c in names], other or None]
            )
        nics.append(row)
    if "gpus" in doc:
        out["gpus"] = gpus
    if "nics" in doc:
        out["nics"] = nics
    return out


@pytest.mark.parametrize("name", sorted(set(CASES) - _NOT_EXPRESSIBLE))
def test_compact_accepts_and_refuses_what_json_does(name: str) -> None:
    doc = _valid()
    CASES[name](doc)
    try:
        decode(json.dumps(doc))
        json_ok = True
    except ReportError:
        json_ok = False
    try:
        data = msgspec.msgpack.encode(compact_doc(doc))
    except OverflowError:
        # msgpack has no integers past 64 bits: no compact report can carry this one, and JSON
        # must refuse it too (checked here); there is nothing more to compare.
        assert not json_ok, f"{name}: JSON takes it, msgpack cannot say it"
        return
    try:
        back = wire.decode_compact(data)
        compact_ok = True
    except ReportError:
        compact_ok = False
    assert compact_ok == json_ok, f"{name}: JSON says {json_ok}, compact says {compact_ok}"
    if json_ok:
        assert wire.as_v1(back) == decode(json.dumps(doc))


# -- column counts and named paths ------------------------------------------------------------------


def wire_builtins(report: Report) -> dict[str, Any]:
    # Through msgpack and back: rows as lists, editable.
    out: dict[str, Any] = msgspec.msgpack.decode(wire.encode_compact(report))
    return out


def refusal(doc: dict[str, Any]) -> str:
    with pytest.raises(ReportError) as info:
        wire.decode_compact(msgspec.msgpack.encode(doc))
    return str(info.value)


def test_a_gpu_row_with_a_column_too_few_or_too_many_is_refused_naming_the_row() -> None:
    doc = wire_builtins(generated()[0])
    short = copy.deepcopy(doc)
    short["gpus"][3] = [*short["gpus"][3][:-2], short["gpus"][3][-1]]
    message = refusal(short)
    assert f"wrong column count: {len(wire.GPU_COLUMNS)} columns in this layout, got 44" in message
    assert "$.gpus[3]`" in message
    long = copy.deepcopy(doc)
    long["gpus"][3].append(1)
    message = refusal(long)
    assert "$.gpus[3]`" in message and str(len(wire.GPU_COLUMNS)) in message


def test_an_nvlink_row_with_the_wrong_column_count_is_refused_naming_it() -> None:
    doc = wire_builtins(generated()[0])
    doc["gpus"][2][-1][5].pop()
    message = refusal(doc)
    assert "$.gpus[2].nvlink[5]`" in message and str(len(wire.NVLINK_COLUMNS)) in message


def test_a_nic_row_with_the_wrong_column_count_is_refused_naming_it() -> None:
    doc = wire_builtins(generated()[0])
    doc["nics"][7].append(None)
    message = refusal(doc)
    assert "$.nics[7]`" in message and str(len(wire.NIC_COLUMNS)) in message


def test_counter_values_that_do_not_match_the_bitmap_are_refused_naming_the_nic() -> None:
    doc = wire_builtins(generated()[0])
    doc["nics"][4][-1][1].pop()
    message = refusal(doc)
    assert "wrong column count" in message and "$.nics[4].counters`" in message
    doc = wire_builtins(generated()[0])
    bits = bytearray(doc["nics"][0][-1][0])
    bits[-1] |= 0x80  # past the table's last column
    doc["nics"][0][-1][0] = bytes(bits)
    assert "past the table" in refusal(doc)


def test_a_bad_value_is_refused_with_the_json_reports_path() -> None:
    doc = wire_builtins(generated()[0])
    doc["gpus"][1][wire.GPU_COLUMNS.index("temperature_celsius")] = "hot"
    assert "$.gpus[1].temperature_celsius`" in refusal(doc)
    doc = wire_builtins(generated()[0])
    doc["gpus"][0][-1][4][wire.NVLINK_COLUMNS.index("replay_errors_total")] = -1
    assert "$.gpus[0].nvlink[4].replay_errors_total`" in refusal(doc)
    doc = wire_builtins(generated()[0])
    doc["nics"][2][-1][1][0] = -1
    assert "$.nics[2].counters.values[0]`" in refusal(doc)


def test_a_table_counter_in_the_other_map_is_refused() -> None:
    doc = wire_builtins(generated()[0])
    doc["nics"][0][-1][2] = {"symbol_error": 1}
    assert "symbol_error" in refusal(doc)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nan_and_infinity_are_refused_as_json_refuses_them(value: float) -> None:
    doc = wire_builtins(generated()[0])
    doc["gpus"][6][wire.GPU_COLUMNS.index("sm_clock_hz")] = value
    assert "$.gpus[6]" in refusal(doc)
    doc = wire_builtins(EDGE_CASES["events, probes, errors, labels"])
    doc["probes"][0]["duration_seconds"] = value
    assert "$.probes[0].duration_seconds`" in refusal(doc)


def test_another_builds_layout_is_a_layout_error() -> None:
    doc = wire_builtins(generated()[0])
    doc["layout"] = "0123456789abcdef"
    with pytest.raises(wire.LayoutError, match="send JSON"):
        wire.decode_compact(msgspec.msgpack.encode(doc))
    # Even when its rows would not fit this build's columns: the layout is what is wrong.
    doc["gpus"][0].append(1)
    with pytest.raises(wire.LayoutError):
        wire.decode_compact(msgspec.msgpack.encode(doc))


def test_another_schema_version_and_not_msgpack_are_told_apart() -> None:
    doc = wire_builtins(minimal())
    doc["schema"] = "gpuwarden/report/v2"
    with pytest.raises(wire.WrongSchemaError, match="v2"):
        wire.decode_compact(msgspec.msgpack.encode(doc))
    with pytest.raises(wire.NotCompactError):
        wire.decode_compact(b"\xc1")
    with pytest.raises(wire.NotCompactError):
        wire.decode_compact(encode(minimal())[:-1])


# -- one source of truth ----------------------------------------------------------------------------


def test_columns_are_the_catalogues_order() -> None:
    assert (*GPU_CATALOGUE, "nvlink") == wire.GPU_COLUMNS
    assert tuple(NVLINK_CATALOGUE) == wire.NVLINK_COLUMNS
    assert (*NIC_CATALOGUE, "counters") == wire.NIC_COLUMNS
    assert tuple(NIC_COUNTER_CATALOGUE) == wire.NIC_COUNTER_COLUMNS


def test_the_compact_report_carries_every_field_of_the_report() -> None:
    # Built from Report: an optional section added to it rides along without a change here.
    assert wire.CompactReport.__struct_fields__ == (*Report.__struct_fields__, "layout")


def test_the_layout_digest_follows_the_tables() -> None:
    tables = dict(wire.TABLES)
    assert wire._layout_digest(tables) == wire.LAYOUT
    tables["nvlink"] = tuple(reversed(tables["nvlink"]))
    assert wire._layout_digest(tables) != wire.LAYOUT


def test_the_published_schema_is_the_generated_one() -> None:
    published = json.loads(SCHEMA_FILE.read_text())
    assert published == wire.compact_json_schema(), (
        "agent/schema/report-compact-v1.schema.json is stale: "
        ".venv/bin/python -m agent.wire --schema > agent/schema/report-compact-v1.schema.json"
    )


def test_the_spec_lists_the_columns_and_the_layout() -> None:
    text = SPEC.read_text()
    match = re.search(r"<!-- compact-columns:begin -->\n(.*?)<!-- compact-columns:end -->", text, re.S)
    assert match, "docs/spec.md lost its generated column table"
    assert match.group(1) == wire.column_table_markdown(), (
        "docs/spec.md's column table is stale: .venv/bin/python -m agent.wire --spec-table"
    )


# -- traces -------------------------------------------------------------------------------------------


def test_trace_records_read_back_in_order() -> None:
    reports = generated()
    buf = io.BytesIO()
    assert wire.write_trace(buf, reports) == len(reports)
    buf.seek(0)
    assert [wire.as_v1(wire.decode_compact(b)) for b in wire.read_frames(buf)] == reports
    # Any msgpack reader sees a stream of bin objects.
    assert msgspec.msgpack.decode(wire.frame(b"abc")) == b"abc"


@pytest.mark.parametrize(
    ("data", "error"),
    [(b"{", "starts no trace record"), (b"\xc6\x00\x00", "length"), (b"\xc6\x00\x00\x00\x09abc", "3 of 9")],
)
def test_a_broken_trace_says_where(data: bytes, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        list(wire.read_frames(io.BytesIO(data)))
