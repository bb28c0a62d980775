"""The msgspec report types and the published JSON Schema are one contract.

Two checks: the schemas agree node by node (types, nullability, required fields, every constraint),
and for a set of edge-case documents jsonschema and msgspec accept and refuse exactly the same ones.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonschema
import msgspec
import pytest

from agent import report
from agent.errors import ReportError

_CONSTRAINTS = (
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "pattern",
    "maxItems",
    "maxProperties",
)


def _resolve(node: dict[str, Any], doc: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        target: Any = doc
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        node = {**{k: v for k, v in node.items() if k != "$ref"}, **target}
    return node


def canon(node: dict[str, Any], doc: dict[str, Any]) -> dict[str, Any]:
    node = _resolve(node, doc)
    out: dict[str, Any] = {}
    types: set[str] = set()
    if "anyOf" in node:
        for branch in node["anyOf"]:
            c = canon(branch, doc)
            types |= set(c.pop("types", set()))
            out.update(c)
    t = node.get("type")
    if t is not None:
        types |= {t} if isinstance(t, str) else set(t)
    if "const" in node:
        out["enum"] = [node["const"]]
    if "enum" in node:
        out["enum"] = sorted(node["enum"])
    if types:
        out["types"] = sorted(types)
    for key in _CONSTRAINTS:
        if key in node:
            out[key] = node[key]
    if "items" in node:
        out["items"] = canon(node["items"], doc)
    if "properties" in node:
        out["properties"] = {k: canon(v, doc) for k, v in node["properties"].items()}
        out["required"] = sorted(node.get("required", []))
    ap = node.get("additionalProperties")
    if isinstance(ap, dict):
        out["additionalProperties"] = canon(ap, doc)
    elif ap is False:
        out["additionalProperties"] = False
    return out


def test_types_and_schema_agree_node_by_node() -> None:
    published = report.json_schema()
    generated = msgspec.json.schema(report.Report)
    assert canon(generated, generated) == canon(published, published)


def _valid() -> dict[str, Any]:
    return {
        "schema": "gpuwarden/report/v1",
        "node": "gpu-0042",
        "time": 1764441630.5,
        "seq": 7,
        "boot_id": "5e9b3c1a-1111-2222-3333-444455556666",
        "agent_version": "0.1.0",
        "interval_seconds": 10,
        "labels": {"pool": "h100-a", "rack": "r12"},
        "gpus": [
            {
                "index": 0,
                "uuid": "GPU-0f1e2d3c",
                "temperature_celsius": 41.0,
                "ecc_dbe_volatile_total": 0,
                "remapped_rows_failure": False,
                "nvlink": [{"link": 0, "active": True, "crc_flit_errors_total": 3}],
            }
        ],
        "nics": [
            {
                "device": "mlx5_0",
                "port": 1,
                "link_layer": "InfiniBand",
                "rate_bytes_per_second": 5.0e10,
                "counters": {"symbol_error": 0},
            }
        ],
        "events": [{"kind": "xid", "time": 1764441629.0, "gpu": 0, "code": 79, "message": "x"}],
        "probes": [{"kind": "tcp_pair", "time": 1764441628.0, "ok": True, "peer": "gpu-0043"}],
        "errors": [{"collector": "nvml", "message": "GPU 3 is lost"}],
        "jobs": {
            "format": "gpuwarden/jobs/v1",
            "records": 5,
            "dropped": 1,
            "collectives": [
                {
                    "comm": "0xad56c683b0c4ef",
                    "collective": "AllReduce",
                    "size_bytes": 2097152,
                    "n_ranks": 3,
                    "nnodes": 3,
                    "count": 4,
                    "timing_source": "kernel_gpu",
                    "busbw_gbs": {"min": 0.5, "p10": 0.5, "p50": 0.55, "p90": 0.6, "max": 0.61},
                    "exec_time_us": {"min": 5600, "p10": 5600, "p50": 5663.0, "p90": 5700, "max": 5800},
                    "rank": 1,
                    "hostname": "nanogpt-nccl-test-worker-0",
                    "pid": 48,
                    "gpu": 0,
                }
            ],
        },
        "pods": [
            {
                "namespace": "train",
                "pod": "llama-0",
                "container": "trainer",
                "resource": "nvidia.com/gpu",
                "devices": ["GPU-0f1e2d3c"],
            }
        ],
    }


def _set(path: str, value: Any) -> Any:
    def mutate(doc: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        target: Any = doc
        for p in parents:
            target = target[int(p)] if isinstance(target, list) else target[p]
        if value is _DELETE:
            del target[last]
        elif isinstance(target, list):
            target[int(last)] = value
        else:
            target[last] = value

    return mutate


_DELETE = object()

CASES = {
    "valid": lambda d: None,
    "missing node": _set("node", _DELETE),
    "uppercase node": _set("node", "GPU-1"),
    "empty node": _set("node", ""),
    "wrong schema": _set("schema", "gpuwarden/report/v2"),
    "negative seq": _set("seq", -1),
    "float seq": _set("seq", 1.5),
    "unknown top-level field": _set("extra", 1),
    "null labels": _set("labels", None),
    "null events": _set("events", None),
    "labels value too long": _set("labels.pool", "x" * 129),
    "labels value number": _set("labels.pool", 3),
    "zero interval": _set("interval_seconds", 0),
    "null interval": _set("interval_seconds", None),
    "gpu index too large": _set("gpus.0.index", 64),
    "gpu utilization above 1": _set("gpus.0.utilization_ratio", 1.5),
    "gpu null temperature": _set("gpus.0.temperature_celsius", None),
    "gpu negative ecc": _set("gpus.0.ecc_dbe_volatile_total", -1),
    "gpu unknown field": _set("gpus.0.fan_speed", 3),
    "gpu missing uuid": _set("gpus.0.uuid", _DELETE),
    "gpu flag as int": _set("gpus.0.remapped_rows_failure", 1),
    "gpu pstate too large": _set("gpus.0.performance_state", 33),
    "nvlink link 32": _set("gpus.0.nvlink.0.link", 32),
    "nic bad link layer": _set("nics.0.link_layer", "OmniPath"),
    "nic negative counter": _set("nics.0.counters.symbol_error", -5),
    "nic float counter": _set("nics.0.counters.symbol_error", 1.5),
    "nic null port": _set("nics.0.port", None),
    "nic null counters": _set("nics.0.counters", None),
    "gpu null nvlink": _set("gpus.0.nvlink", None),
    "event bad kind": _set("events.0.kind", "panic"),
    "event null code": _set("events.0.code", None),
    "probe missing ok": _set("probes.0.ok", _DELETE),
    "probe bad kind": _set("probes.0.kind", "ib_write_bw"),
    "error missing message": _set("errors.0.message", _DELETE),
    "error message too long": _set("errors.0.message", "m" * 1025),
    "boot_id too long": _set("boot_id", "b" * 65),
    "counter of 64 bits": _set("gpus.0.ecc_dbe_volatile_total", 2**64 - 1),
    "counter over 64 bits": _set("gpus.0.ecc_dbe_volatile_total", 2**64),
    "nvlink counter over 64 bits": _set("gpus.0.nvlink.0.crc_flit_errors_total", 2**70),
    "nic counter over 64 bits": _set("nics.0.counters.symbol_error", 2**64),
    "seq over 64 bits": _set("seq", 2**64),
    "error with a code": _set(
        "errors.0", {"collector": "nvml", "message": "m", "code": "gpu_lost", "gpu": 3}
    ),
    "error with an unknown code": _set("errors.0", {"collector": "nvml", "message": "m", "code": "on_fire"}),
    "error with a null code": _set("errors.0", {"collector": "nvml", "message": "m", "code": None}),
    "error gpu 64": _set("errors.0", {"collector": "nvml", "message": "m", "gpu": 64}),
    "jobs without collectives": _set("jobs.collectives", []),
    "collective without optional fields": lambda d: [
        d["jobs"]["collectives"][0].pop(k) for k in ("rank", "hostname", "pid", "gpu")
    ],
    "pods empty": _set("pods", []),
    "jobs null": _set("jobs", None),
    "pods null": _set("pods", None),
    "jobs wrong format": _set("jobs.format", "gpuwarden/jobs/v2"),
    "jobs missing records": _set("jobs.records", _DELETE),
    "jobs dropped over 64 bits": _set("jobs.dropped", 2**64),
    "jobs unknown field": _set("jobs.extra", 1),
    "collective count 0": _set("jobs.collectives.0.count", 0),
    "collective count over 64 bits": _set("jobs.collectives.0.count", 2**64),
    "collective size over 64 bits": _set("jobs.collectives.0.size_bytes", 2**64),
    "collective n_ranks 0": _set("jobs.collectives.0.n_ranks", 0),
    "collective nnodes 0": _set("jobs.collectives.0.nnodes", 0),
    "collective negative rank": _set("jobs.collectives.0.rank", -1),
    "collective null rank": _set("jobs.collectives.0.rank", None),
    "collective gpu 64": _set("jobs.collectives.0.gpu", 64),
    "collective comm too long": _set("jobs.collectives.0.comm", "c" * 65),
    "collective kind too long": _set("jobs.collectives.0.collective", "k" * 33),
    "collective missing busbw": _set("jobs.collectives.0.busbw_gbs", _DELETE),
    "stat negative": _set("jobs.collectives.0.exec_time_us.p10", -1.0),
    "stat missing p90": _set("jobs.collectives.0.busbw_gbs.p90", _DELETE),
    "stat as string": _set("jobs.collectives.0.busbw_gbs.p50", "fast"),
    "pod missing container": _set("pods.0.container", _DELETE),
    "pod device too long": _set("pods.0.devices.0", "d" * 97),
    "pod too many devices": _set("pods.0.devices", [f"GPU-{i}" for i in range(65)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_jsonschema_and_msgspec_accept_the_same_documents(name: str) -> None:
    doc = copy.deepcopy(_valid())
    CASES[name](doc)
    schema_ok = jsonschema.Draft202012Validator(report.json_schema()).is_valid(doc)
    try:
        report.decode(json.dumps(doc))
        types_ok = True
    except ReportError:
        types_ok = False
    assert schema_ok == types_ok, f"{name}: jsonschema says {schema_ok}, msgspec says {types_ok}"
    assert schema_ok == (
        name
        in {
            "valid",
            "gpu null temperature",
            "event null code",
            "nic null port",
            "counter of 64 bits",
            "error with a code",
            "jobs without collectives",
            "collective without optional fields",
            "pods empty",
        }
    )


def test_encode_round_trips_and_validates() -> None:
    r = report.decode(json.dumps(_valid()))
    wire = json.loads(report.encode(r))
    jsonschema.Draft202012Validator(report.json_schema()).validate(wire)
    assert report.decode(report.encode(r)) == r
    # Unsupported measurements are written as null, never left out.
    assert wire["gpus"][0]["power_watts"] is None
    # Optional top-level fields that were not set are left out (the schema does not allow null).
    minimal = report.Report(schema=report.SCHEMA_ID, node="n", time=1.0, seq=0, boot_id="b", gpus=[], nics=[])
    assert set(json.loads(report.encode(minimal))) == {
        "schema",
        "node",
        "time",
        "seq",
        "boot_id",
        "gpus",
        "nics",
    }


def test_decode_error_names_the_field() -> None:
    doc = _valid()
    doc["gpus"][0]["temperature_celsius"] = "hot"
    with pytest.raises(ReportError, match=r"\$\.gpus\[0\]\.temperature_celsius"):
        report.decode(json.dumps(doc))


def test_an_oversized_counter_is_refused_naming_its_path() -> None:
    doc = _valid()
    doc["nics"][0]["counters"]["symbol_error"] = 2**70
    with pytest.raises(
        ReportError, match=r"<= 18446744073709551615 - at `\$\.nics\[0\]\.counters\.symbol_error`"
    ):
        report.decode(json.dumps(doc))


def test_every_measured_field_is_in_the_catalogue() -> None:
    # The import-time check, seen from outside: every scalar field of a measured struct has an
    # entry, and the kinds split the GPU fields the way the history and the rules need them.
    assert set(report.GPU_CATALOGUE) == {
        f.name for f in msgspec.structs.fields(report.Gpu) if f.name != "nvlink"
    }
    assert "retired_pages_sbe" in report.GPU_COUNTERS and "remapped_rows_uncorrectable" in report.GPU_COUNTERS
    assert "pcie_link_width" in report.GPU_GAUGES and "remapped_rows_failure" in report.GPU_FLAGS
    assert report.NIC_TYPED_COUNTERS == (
        "rx_bytes_total",
        "tx_bytes_total",
        "rx_packets_total",
        "tx_packets_total",
    )


def test_an_old_agents_nvml_error_reads_as_its_code() -> None:
    old = report.CollectorError(collector="nvml", message="GPU 5 (GPU-x, 00000000:AB:00.0): GPU is lost")
    assert (report.error_code(old), report.error_gpu(old)) == ("gpu_lost", 5)
    handle = report.CollectorError(collector="nvml", message="GPU 2: no device handle: Unknown Error")
    assert (report.error_code(handle), report.error_gpu(handle)) == ("no_handle", 2)
    other = report.CollectorError(collector="nvml", message="GPU 3: 1 unreadable: power: Timeout")
    assert (report.error_code(other), report.error_gpu(other)) == (None, None)
    # The code wins where it is set, whatever the words say.
    typed = report.CollectorError(collector="nvml", message="GPU 1: GPU is lost", code="unreadable", gpu=1)
    assert (report.error_code(typed), report.error_gpu(typed)) == ("unreadable", 1)


def test_a_field_without_a_catalogue_entry_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = dict(report.GPU_CATALOGUE)
    del gpu["power_watts"]
    monkeypatch.setattr(report, "CATALOGUE", {**report.CATALOGUE, report.Gpu: gpu})
    with pytest.raises(TypeError, match="power_watts"):
        report._check_catalogue()
    gpu["power_watts"] = report.FieldInfo("flag")  # a float cannot be a flag
    with pytest.raises(TypeError, match="power_watts"):
        report._check_catalogue()
