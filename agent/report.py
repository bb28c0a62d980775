"""The node report, version 1: typed, fast, and the one source of truth for its shape.

The JSON Schema in ``agent/schema/report-v1.schema.json`` is the published contract (docs/spec.md
section 1 describes it); these msgspec structs are the same contract as Python
types. ``tests/test_report_schema.py`` proves that the two agree, field by field and constraint by
constraint, so neither can drift from the other.

The field catalogue below the structs says what each measured field is (counter, gauge, flag or
label, its unit and plausible range); the agent's metrics, the aggregator's history, rules,
plausibility checks, pool frame and detectors derive their field lists from it.

The aggregator imports these types from here; this module imports nothing from the aggregator.
"""

from __future__ import annotations

import itertools
import json
import operator
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Annotated, Any, Final, Literal, get_args

import msgspec
from msgspec import UNSET, Meta, UnsetType

from agent.errors import ReportError

SCHEMA_ID: Final = "gpuwarden/report/v1"

# Constrained scalar types, named after the schema's $defs.
# Hardware counters are at most 64 bits wide. msgspec (0.23) refuses ``Meta(le=...)`` beyond int64,
# so the bound goes into the generated JSON Schema through ``extra_json_schema`` and ``decode``
# enforces it from the same annotation (``_U64_BOUND``): one place says it, both sides obey it.
U64_MAX: Final = 2**64 - 1
_U64_BOUND: Final = "le"
_U64 = Meta(ge=0, extra_json_schema={"maximum": U64_MAX}, extra={_U64_BOUND: U64_MAX})
Count = Annotated[int, _U64]
NodeName = Annotated[str, Meta(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")]


Ratio = Annotated[float, Meta(ge=0, le=1)]
Str32 = Annotated[str, Meta(max_length=32)]
Str64 = Annotated[str, Meta(max_length=64)]
Str96 = Annotated[str, Meta(max_length=96)]
Str128 = Annotated[str, Meta(max_length=128)]
Str253 = Annotated[str, Meta(max_length=253)]
Str1024 = Annotated[str, Meta(max_length=1024)]
Str2048 = Annotated[str, Meta(max_length=2048)]


class _Base(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True, gc=False):
    """Reports are values: built once, never changed in place (like client_python's samples).

    ``gc=False``: a report is an acyclic tree, so the cycle collector need not track its ~180
    objects; at 1,000 reports/s that saves about a tenth of the aggregator's ingest CPU.
    """


class NvLink(_Base, frozen=True):
    link: Annotated[int, Meta(ge=0, le=31)]
    active: bool | None = None
    crc_flit_errors_total: Count | None = None
    crc_data_errors_total: Count | None = None
    replay_errors_total: Count | None = None
    recovery_errors_total: Count | None = None


class Gpu(_Base, frozen=True):
    index: Annotated[int, Meta(ge=0, le=63)]
    uuid: Str96
    model: Str96 | None = None
    pci_bus_id: Str32 | None = None
    utilization_ratio: Annotated[float, Meta(ge=0, le=1)] | None = None
    memory_used_bytes: Count | None = None
    memory_total_bytes: Count | None = None
    temperature_celsius: float | None = None
    memory_temperature_celsius: float | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    energy_joules_total: float | None = None
    sm_clock_hz: float | None = None
    sm_clock_max_hz: float | None = None
    memory_clock_hz: float | None = None
    clock_event_reasons: Count | None = None
    performance_state: Annotated[int, Meta(ge=0, le=32)] | None = None
    ecc_sbe_volatile_total: Count | None = None
    ecc_dbe_volatile_total: Count | None = None
    ecc_sbe_aggregate_total: Count | None = None
    ecc_dbe_aggregate_total: Count | None = None
    retired_pages_sbe: Count | None = None
    retired_pages_dbe: Count | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_correctable: Count | None = None
    remapped_rows_uncorrectable: Count | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None
    pcie_link_gen: Count | None = None
    pcie_link_gen_max: Count | None = None
    pcie_link_width: Count | None = None
    pcie_link_width_max: Count | None = None
    pcie_replay_total: Count | None = None
    # Added within v1 (null from older agents): the driver, and NVML's GPU Performance Monitoring
    # (GPM, Hopper and later) over the last interval; null where the GPU has no GPM.
    driver_version: Str32 | None = None
    memory_utilization_ratio: Ratio | None = None
    gr_engine_active_ratio: Ratio | None = None
    sm_active_ratio: Ratio | None = None
    sm_occupancy_ratio: Ratio | None = None
    tensor_active_ratio: Ratio | None = None
    dram_active_ratio: Ratio | None = None
    pcie_tx_bytes_per_second: float | None = None
    pcie_rx_bytes_per_second: float | None = None
    nvlink_tx_bytes_per_second: float | None = None
    nvlink_rx_bytes_per_second: float | None = None
    # Optional but never null in the schema (like the report's optional top-level fields). A tuple,
    # not a list: the aggregator keeps two reports per node, and a tuple of these gc=False structs is
    # one object the cycle collector stops tracking, where a list is tracked for as long as it lives
    # (16 of a kept H100 node's ~60 tracked objects; full collections walk every one).
    nvlink: Annotated[tuple[NvLink, ...], Meta(max_length=32)] | UnsetType = UNSET


class Nic(_Base, frozen=True):
    device: Str64
    link_layer: Literal["InfiniBand", "Ethernet"]
    port: Annotated[int, _U64] | None = None
    netdev: Str64 | None = None
    state: Str32 | None = None
    phys_state: Str32 | None = None
    rate_bytes_per_second: float | None = None
    rx_bytes_total: Count | None = None
    tx_bytes_total: Count | None = None
    rx_packets_total: Count | None = None
    tx_packets_total: Count | None = None
    counters: Annotated[dict[str, Count], Meta(max_length=256)] | UnsetType = UNSET


class Event(_Base, frozen=True):
    kind: Literal["xid", "sxid", "kernel"]
    time: float
    gpu: Annotated[int, _U64] | None = None
    code: Annotated[int, _U64] | None = None
    message: Str2048 | None = None


class Probe(_Base, frozen=True):
    kind: Literal["nccl_allreduce_local", "nccl_allreduce_pair", "tcp_pair"]
    time: float
    ok: bool
    peer: Str253 | None = None
    size_bytes: Count | None = None
    busbw_bytes_per_second: float | None = None
    duration_seconds: float | None = None
    error: Str1024 | None = None


# What a collector error is, for machines (the message is for humans and may be reworded). Only
# the NVML collector sets codes, for what it tells apart (agent/collectors/nvml.py):
# gpu_lost: NVML_ERROR_GPU_IS_LOST, the GPU fell off the bus (left out of ``gpus``);
# no_handle: nvmlDeviceGetHandleByIndex failed otherwise (left out of ``gpus`` too);
# unreadable: some of the GPU's fields could not be read (they are null, the GPU is reported);
# init_failed: nvmlInit failed (no GPUs at all); too_many_gpus: more GPUs than a report holds;
# reset_required: NVML_ERROR_RESET_REQUIRED, the GPU is unusable until it is reset (left out of
# ``gpus``, as a lost GPU is). Added within v1 after the others: an aggregator older than it
# refuses a report carrying it, so aggregators are upgraded before agents.
ErrorCode = Literal["gpu_lost", "no_handle", "unreadable", "init_failed", "too_many_gpus", "reset_required"]
ERROR_CODES: Final[frozenset[str]] = frozenset(get_args(ErrorCode))
# The codes that mean "this GPU is in the node but not in the report": nothing measured it.
GPU_GONE_CODES: Final[frozenset[str]] = frozenset({"gpu_lost", "no_handle", "reset_required"})


class CollectorError(_Base, frozen=True):
    collector: Str64
    message: Str1024
    # Added within v1: a report without them is as valid as before, and they are never null.
    code: ErrorCode | UnsetType = UNSET
    gpu: Annotated[int, Meta(ge=0, le=63)] | UnsetType = UNSET


# -- Job data: what the jobs' own collectives showed (NCCL Inspector), and which pod holds which GPU.
# Added within v1: a report without these sections is as valid as before (docs/jobs.md).

JOBS_FORMAT: Final = "gpuwarden/jobs/v1"
MAX_COLLECTIVES: Final = 1024  # rows of ``Jobs.collectives`` per report
NonNegative = Annotated[float, Meta(ge=0)]


class Stat(_Base, frozen=True):
    """Quantiles of one measure over the records summarized (all >= 0, finite)."""

    min: NonNegative
    p10: NonNegative
    p50: NonNegative
    p90: NonNegative
    max: NonNegative


class Collective(_Base, frozen=True):
    """One communicator's rank, one collective kind, one message-size bucket, over one agent cycle."""

    # Inspector's header.id ("0xad56c683b0c4ef"); comm_name in Prometheus mode (it has no id).
    comm: Str64
    # As written: AllReduce, AllGather, ReduceScatter, Broadcast, Reduce, Send, Recv.
    collective: Str32
    # The bucket: 2**floor(log2(message size in bytes)), 0 for empty messages.
    size_bytes: Count
    n_ranks: Annotated[int, Meta(ge=1)]
    nnodes: Annotated[int, Meta(ge=1)]
    # Records summarized into this row this cycle.
    count: Annotated[int, Meta(ge=1, extra_json_schema={"maximum": U64_MAX}, extra={_U64_BOUND: U64_MAX})]
    # coll_timing_source as written: kernel_gpu | kernel_cpu | collective_cpu.
    timing_source: Str32
    busbw_gbs: Stat
    exec_time_us: Stat
    # header.rank; absent in Prometheus mode.
    rank: Annotated[int, Meta(ge=0)] | UnsetType = UNSET
    # metadata.hostname (in a pod: the pod's name).
    hostname: Str253 | UnsetType = UNSET
    # metadata.pid (in the job's PID namespace).
    pid: Count | UnsetType = UNSET
    # Local GPU index where known (Prometheus ``gpu="GPU3"``, or attribution).
    gpu: Annotated[int, Meta(ge=0, le=63)] | UnsetType = UNSET


class Jobs(_Base, frozen=True):
    """What the jobs' own collectives showed this cycle (NCCL Inspector), summarized by the agent."""

    # The section's own version: it can change without a report v2.
    format: Literal["gpuwarden/jobs/v1"]
    collectives: Annotated[tuple[Collective, ...], Meta(max_length=MAX_COLLECTIVES)]
    # Records read this cycle.
    records: Count
    # Records read but not summarized (caps, unknown kinds, malformed).
    dropped: Count


class GpuAllocation(_Base, frozen=True):
    """One container's GPUs, from the kubelet's PodResources API (List)."""

    namespace: Str253
    pod: Str253
    container: Str253
    # e.g. "nvidia.com/gpu".
    resource: Str253
    # Device IDs as the device plugin names them: GPU (or MIG) UUIDs for NVIDIA's.
    devices: Annotated[tuple[Str96, ...], Meta(max_length=64)]


class Report(_Base, frozen=True):
    # Every array is a tuple, as ``Gpu.nvlink`` is and for the same reason: the aggregator keeps
    # two reports per node, a tuple of gc=False structs stops being tracked at the first collection
    # it survives, and a list is tracked (and promoted, and walked by every full collection) for as
    # long as it lives.
    schema: Literal["gpuwarden/report/v1"]
    node: NodeName
    time: float
    seq: Count
    boot_id: Annotated[str, Meta(min_length=1, max_length=64)]
    gpus: Annotated[tuple[Gpu, ...], Meta(max_length=64)]
    nics: Annotated[tuple[Nic, ...], Meta(max_length=256)]
    # Optional but never null in the schema: UNSET leaves them out of the JSON and refuses null.
    # Measured fields inside a GPU or NIC are the opposite: always written, null where unsupported.
    agent_version: Str64 | UnsetType = UNSET
    # The agent process that numbered ``seq`` (random per start): seq restarts with the process
    # under the same boot, so (boot_id, run, seq) names one report whatever its clock says.
    run: Annotated[str, Meta(min_length=1, max_length=64)] | UnsetType = UNSET
    interval_seconds: Annotated[float, Meta(gt=0)] | UnsetType = UNSET
    labels: Annotated[dict[str, Str128], Meta(max_length=16)] | UnsetType = UNSET
    events: Annotated[tuple[Event, ...], Meta(max_length=1024)] | UnsetType = UNSET
    probes: Annotated[tuple[Probe, ...], Meta(max_length=256)] | UnsetType = UNSET
    errors: Annotated[tuple[CollectorError, ...], Meta(max_length=64)] | UnsetType = UNSET
    # Added within v1 (docs/jobs.md): absent = the Inspector collector is not enabled on this node;
    # present with no collectives = enabled, nothing new this cycle.
    jobs: Jobs | UnsetType = UNSET
    # Absent = attribution not available (no kubelet socket); present and empty = no pod holds a GPU.
    pods: Annotated[tuple[GpuAllocation, ...], Meta(max_length=256)] | UnsetType = UNSET


# -- The field catalogue ---------------------------------------------------------------------------
# What every measured field of a GPU, an NVLink, a NIC and a probe is: its kind, its unit and the
# range a real machine can report. Everything that treats fields by kind derives from here: the
# fleet history's series, the rule vocabulary, the agent's metric types, the aggregator's
# plausibility checks, the pool frame and the detectors. A table beside each struct, checked against
# the struct when this module is imported, so a field cannot be added to one and not the other.
#
# counter: cumulative since some reset (driver load, boot, the board's life); rates are taken of it.
# gauge:   a value now (a level, a setting, a bitmask).
# flag:    a boolean state.
# label:   identity or a state name (text, indices); compared, never summed.
FieldKind = Literal["counter", "gauge", "flag", "label"]


@dataclass(frozen=True, slots=True)
class FieldInfo:
    kind: FieldKind
    unit: str = ""  # the base unit: count, bytes, celsius, watts, joules, hertz, ratio, ...
    # Lowest and highest value physically possible, beyond what the schema bounds; the aggregator
    # refuses a report outside it (``implausible_value``). None: the schema's bounds are enough.
    plausible: tuple[float, float] | None = None


def _counter(unit: str = "count", plausible: tuple[float, float] | None = None) -> FieldInfo:
    return FieldInfo("counter", unit, plausible)


def _gauge(unit: str, plausible: tuple[float, float] | None = None) -> FieldInfo:
    return FieldInfo("gauge", unit, plausible)


_FLAG: Final = FieldInfo("flag")
_LABEL: Final = FieldInfo("label")
_CELSIUS: Final = (-50.0, 200.0)
_WATTS: Final = (0.0, 10_000.0)
_HERTZ: Final = (0.0, 1e11)
_RATE_MAX: Final = 1e13  # bytes/s: 80 Tb/s, ten times the fastest port there is

GPU_CATALOGUE: Final[Mapping[str, FieldInfo]] = types.MappingProxyType(
    {
        "index": _LABEL,
        "uuid": _LABEL,
        "model": _LABEL,
        "pci_bus_id": _LABEL,
        # Bounded by the schema already; the range also refuses NaN in a constructed report.
        "utilization_ratio": _gauge("ratio", (0.0, 1.0)),
        "memory_used_bytes": _gauge("bytes"),
        "memory_total_bytes": _gauge("bytes"),
        "temperature_celsius": _gauge("celsius", _CELSIUS),
        "memory_temperature_celsius": _gauge("celsius", _CELSIUS),
        "power_watts": _gauge("watts", _WATTS),
        "power_limit_watts": _gauge("watts", _WATTS),
        "energy_joules_total": _counter("joules", (0.0, 1e15)),  # 3,000 years of a 10 kW GPU
        "sm_clock_hz": _gauge("hertz", _HERTZ),
        "sm_clock_max_hz": _gauge("hertz", _HERTZ),
        "memory_clock_hz": _gauge("hertz", _HERTZ),
        "clock_event_reasons": _gauge("bitmask"),  # bits: CLOCK_EVENT_REASONS
        "performance_state": _gauge("pstate"),
        "ecc_sbe_volatile_total": _counter("errors"),
        "ecc_dbe_volatile_total": _counter("errors"),
        "ecc_sbe_aggregate_total": _counter("errors"),
        "ecc_dbe_aggregate_total": _counter("errors"),
        # Pages retired and rows remapped over the board's life (kept in its InfoROM): they only
        # grow, so they are counters; a new one in a window is what the rules look for.
        "retired_pages_sbe": _counter("pages"),
        "retired_pages_dbe": _counter("pages"),
        "retired_pages_pending": _FLAG,
        "remapped_rows_correctable": _counter("rows"),
        "remapped_rows_uncorrectable": _counter("rows"),
        "remapped_rows_pending": _FLAG,
        "remapped_rows_failure": _FLAG,
        # The _max fields are the most the GPU can reach in its slot (NVML's
        # nvmlDeviceGetMaxPcieLinkGeneration / ...Width: the lesser of the GPU's and the host's), so a
        # link trained below them is a fault and a host's own limit is not.
        "pcie_link_gen": _gauge("generation"),
        "pcie_link_gen_max": _gauge("generation"),
        "pcie_link_width": _gauge("lanes"),
        "pcie_link_width_max": _gauge("lanes"),
        "pcie_replay_total": _counter("replays"),
        "driver_version": _LABEL,
        "memory_utilization_ratio": _gauge("ratio", (0.0, 1.0)),
        # GPM, averaged over the interval between two samples (the agent's report interval).
        "gr_engine_active_ratio": _gauge("ratio", (0.0, 1.0)),
        "sm_active_ratio": _gauge("ratio", (0.0, 1.0)),
        "sm_occupancy_ratio": _gauge("ratio", (0.0, 1.0)),
        "tensor_active_ratio": _gauge("ratio", (0.0, 1.0)),
        "dram_active_ratio": _gauge("ratio", (0.0, 1.0)),
        "pcie_tx_bytes_per_second": _gauge("bytes_per_second", (0.0, _RATE_MAX)),
        "pcie_rx_bytes_per_second": _gauge("bytes_per_second", (0.0, _RATE_MAX)),
        "nvlink_tx_bytes_per_second": _gauge("bytes_per_second", (0.0, _RATE_MAX)),
        "nvlink_rx_bytes_per_second": _gauge("bytes_per_second", (0.0, _RATE_MAX)),
    }
)
NVLINK_CATALOGUE: Final[Mapping[str, FieldInfo]] = types.MappingProxyType(
    {
        "link": _LABEL,
        "active": _FLAG,
        "crc_flit_errors_total": _counter("errors"),
        "crc_data_errors_total": _counter("errors"),
        "replay_errors_total": _counter("errors"),
        "recovery_errors_total": _counter("errors"),
    }
)
NIC_CATALOGUE: Final[Mapping[str, FieldInfo]] = types.MappingProxyType(
    {
        "device": _LABEL,
        "link_layer": _LABEL,
        "port": _LABEL,
        "netdev": _LABEL,
        "state": _LABEL,
        "phys_state": _LABEL,
        "rate_bytes_per_second": _gauge("bytes_per_second", (0.0, _RATE_MAX)),
        "rx_bytes_total": _counter("bytes"),
        "tx_bytes_total": _counter("bytes"),
        "rx_packets_total": _counter("packets"),
        "tx_packets_total": _counter("packets"),
    }
)
PROBE_CATALOGUE: Final[Mapping[str, FieldInfo]] = types.MappingProxyType(
    {
        "kind": _LABEL,
        "time": _gauge("seconds"),  # a timestamp; checked against the clock, not a range
        "ok": _FLAG,
        "peer": _LABEL,
        "size_bytes": _gauge("bytes"),
        "busbw_bytes_per_second": _gauge("bytes_per_second", (0.0, _RATE_MAX)),
        "duration_seconds": _gauge("seconds", (0.0, 86_400.0)),  # a probe of a day is a broken one
        "error": _LABEL,
    }
)
CATALOGUE: Final[Mapping[type[msgspec.Struct], Mapping[str, FieldInfo]]] = types.MappingProxyType(
    {Gpu: GPU_CATALOGUE, NvLink: NVLINK_CATALOGUE, Nic: NIC_CATALOGUE, Probe: PROBE_CATALOGUE}
)


def fields_of_kind(struct: type[msgspec.Struct], kind: FieldKind) -> tuple[str, ...]:
    """The fields of ``struct`` of one kind, in the struct's order."""
    return tuple(name for name, info in CATALOGUE[struct].items() if info.kind == kind)


GPU_COUNTERS: Final[tuple[str, ...]] = fields_of_kind(Gpu, "counter")
GPU_GAUGES: Final[tuple[str, ...]] = fields_of_kind(Gpu, "gauge")
GPU_FLAGS: Final[tuple[str, ...]] = fields_of_kind(Gpu, "flag")
NVLINK_COUNTERS: Final[tuple[str, ...]] = fields_of_kind(NvLink, "counter")
# The typed cumulative NIC fields (the rest is ``Nic.counters``).
NIC_TYPED_COUNTERS: Final[tuple[str, ...]] = fields_of_kind(Nic, "counter")


def _scalar_type(hint: Any) -> Any:
    """The one scalar type of a field (``X | None`` is X); None for lists, maps and unions."""
    union = typing.get_origin(hint) in (types.UnionType, typing.Union)
    args = [a for a in (get_args(hint) if union else (hint,)) if a is not type(None) and a is not UnsetType]
    if len(args) != 1:
        return None
    base = args[0]
    if typing.get_origin(base) is Literal:
        return str
    return base if base in (bool, int, float, str) else None


_KIND_TYPES: Final[Mapping[str, tuple[type, ...]]] = types.MappingProxyType(
    {"counter": (int, float), "gauge": (int, float), "flag": (bool,), "label": (str, int)}
)


def _check_catalogue() -> None:
    """Every scalar field of a catalogued struct has an entry of a kind its type can be, and no
    entry names a field the struct lacks. Runs at import: a mismatch is a programming error."""
    for struct, table in CATALOGUE.items():
        hints = typing.get_type_hints(struct)
        scalars = {name: t for name, hint in hints.items() if (t := _scalar_type(hint)) is not None}
        missing, extra = scalars.keys() - table.keys(), table.keys() - scalars.keys()
        if missing or extra:
            raise TypeError(
                f"{struct.__name__}: catalogue lacks {sorted(missing)}, names unknown {sorted(extra)}"
            )
        for name, info in table.items():
            if scalars[name] not in _KIND_TYPES[info.kind]:
                kind = scalars[name].__name__
                raise TypeError(f"{struct.__name__}.{name}: a {kind} cannot be a {info.kind}")


_check_catalogue()


# -- NVML's clock event reasons ---------------------------------------------------------------------
# The bits of ``Gpu.clock_event_reasons`` (nvmlClocksEventReason* in nvml.h), by the name the
# rules, the metrics and the pool frame use. ``slowdown``: a reason that is never part of healthy
# work (hardware slowdown, thermal, power brake), as opposed to idling, settings and the power cap
# a busy GPU runs against by design.
@dataclass(frozen=True, slots=True)
class ClockEventReason:
    bit: int
    slowdown: bool


CLOCK_EVENT_REASONS: Final[Mapping[str, ClockEventReason]] = types.MappingProxyType(
    {
        "gpu_idle": ClockEventReason(0x1, False),
        "applications_clocks_setting": ClockEventReason(0x2, False),
        "sw_power_cap": ClockEventReason(0x4, False),
        "hw_slowdown": ClockEventReason(0x8, True),
        "sync_boost": ClockEventReason(0x10, False),
        "sw_thermal_slowdown": ClockEventReason(0x20, True),
        "hw_thermal_slowdown": ClockEventReason(0x40, True),
        "hw_power_brake_slowdown": ClockEventReason(0x80, True),
        "display_clock_setting": ClockEventReason(0x100, False),
    }
)
CLOCK_EVENT_BITS: Final[Mapping[str, int]] = types.MappingProxyType(
    {name: reason.bit for name, reason in CLOCK_EVENT_REASONS.items()}
)


# -- The vocabulary of ``Nic.counters`` -------------------------------------------------------------
# The counter names the agent puts in ``Nic.counters``, by where the kernel exposes them. One list
# for the collectors, the rule vocabulary, the generators and the fixture builder. A driver counter
# that is not here can still be named in a rule as "driver:NAME"; the list exists to catch typos.
#
# Each has a kind: error (zero on healthy hardware), traffic (grows with work), congestion (grows
# with contention on a healthy fabric: waits, congestion notifications), link (the link going down
# and up). ``bits``: the width of an IBTA PortCounters error counter, which stops at its maximum
# (2**bits - 1) rather than wrapping, until someone clears it; None: 64 bits or driver-defined.
NicCounterKind = Literal["error", "traffic", "congestion", "link"]
# What one increment of the counter is: traffic counts bytes, 4-byte words (IBTA's PortXmitData and
# PortRcvData are octets divided by 4) or packets; the other kinds count errors or events.
NicCounterUnit = Literal["bytes", "words", "packets", "errors", "events"]
_KIND_UNITS: Final[Mapping[str, NicCounterUnit]] = types.MappingProxyType(
    {"error": "errors", "traffic": "packets", "congestion": "events", "link": "events"}
)


@dataclass(frozen=True, slots=True)
class NicCounter:
    kind: NicCounterKind
    bits: int | None = None
    counts: NicCounterUnit | None = None  # None: what its kind counts (_KIND_UNITS)

    @property
    def saturates_at(self) -> int | None:
        return None if self.bits is None else 2**self.bits - 1

    @property
    def unit(self) -> NicCounterUnit:
        return self.counts if self.counts is not None else _KIND_UNITS[self.kind]


_ERR: Final = NicCounter("error")
_TRAFFIC: Final = NicCounter("traffic")
_TRAFFIC_BYTES: Final = NicCounter("traffic", counts="bytes")
_TRAFFIC_WORDS: Final = NicCounter("traffic", counts="words")
_CONGESTION: Final = NicCounter("congestion")
_LINK: Final = NicCounter("link")

# IBTA PortCounters / PortCountersExtended (/sys/class/infiniband/*/ports/*/counters/).
IBTA_COUNTERS: Final[Mapping[str, NicCounter]] = types.MappingProxyType(
    {
        "symbol_error": NicCounter("error", 16),
        "link_error_recovery": NicCounter("link", 8),
        "link_downed": NicCounter("link", 8),
        "port_rcv_errors": NicCounter("error", 16),
        "port_rcv_remote_physical_errors": NicCounter("error", 16),
        "port_rcv_switch_relay_errors": NicCounter("error", 16),
        "port_xmit_discards": NicCounter("error", 16),
        "port_xmit_constraint_errors": NicCounter("error", 8),
        "port_rcv_constraint_errors": NicCounter("error", 8),
        "local_link_integrity_errors": NicCounter("error", 4),
        "excessive_buffer_overrun_errors": NicCounter("error", 4),
        "VL15_dropped": NicCounter("error", 16),
        "port_xmit_wait": _CONGESTION,
        "port_rcv_discards": _ERR,
        "port_xmit_data": _TRAFFIC_WORDS,
        "port_rcv_data": _TRAFFIC_WORDS,
        "port_xmit_packets": _TRAFFIC,
        "port_rcv_packets": _TRAFFIC,
        "port_xmit_data_64": _TRAFFIC_WORDS,
        "port_rcv_data_64": _TRAFFIC_WORDS,
        "port_xmit_packets_64": _TRAFFIC,
        "port_rcv_packets_64": _TRAFFIC,
        "port_unicast_xmit_packets": _TRAFFIC,
        "port_unicast_rcv_packets": _TRAFFIC,
        "port_multicast_xmit_packets": _TRAFFIC,
        "port_multicast_rcv_packets": _TRAFFIC,
        "unicast_xmit_packets": _TRAFFIC,
        "unicast_rcv_packets": _TRAFFIC,
        "multicast_xmit_packets": _TRAFFIC,
        "multicast_rcv_packets": _TRAFFIC,
    }
)
# mlx5's per-port hw_counters/ (transport retries, errors, congestion).
MLX5_COUNTERS: Final[Mapping[str, NicCounter]] = types.MappingProxyType(
    {
        "duplicate_request": _ERR,
        "implied_nak_seq_err": _ERR,
        "local_ack_timeout_err": _ERR,
        "out_of_buffer": _ERR,
        "out_of_sequence": _ERR,
        "packet_seq_err": _ERR,
        "req_cqe_error": _ERR,
        "req_cqe_flush_error": _ERR,
        "req_remote_access_errors": _ERR,
        "req_remote_invalid_request": _ERR,
        "req_transport_retries_exceeded": _ERR,
        "resp_cqe_error": _ERR,
        "resp_cqe_flush_error": _ERR,
        "resp_local_length_error": _ERR,
        "resp_remote_access_errors": _ERR,
        "rnr_nak_retry_err": _ERR,
        "roce_adp_retrans": _ERR,
        "roce_adp_retrans_to": _ERR,
        "roce_slow_restart": _CONGESTION,
        "roce_slow_restart_cnps": _CONGESTION,
        "roce_slow_restart_trans": _CONGESTION,
        "rp_cnp_handled": _CONGESTION,
        "rp_cnp_ignored": _CONGESTION,
        "np_cnp_sent": _CONGESTION,
        "np_ecn_marked_roce_packets": _CONGESTION,
        "rx_atomic_requests": _TRAFFIC,
        "rx_dct_connect": _TRAFFIC,
        "rx_read_requests": _TRAFFIC,
        "rx_write_requests": _TRAFFIC,
        "rx_icrc_encapsulated": _ERR,
    }
)
# The kernel's netdev statistics/ and carrier counts (/sys/class/net/*/).
NETDEV_COUNTERS: Final[Mapping[str, NicCounter]] = types.MappingProxyType(
    {
        "rx_bytes": _TRAFFIC_BYTES,
        "tx_bytes": _TRAFFIC_BYTES,
        "rx_packets": _TRAFFIC,
        "tx_packets": _TRAFFIC,
        "rx_errors": _ERR,
        "tx_errors": _ERR,
        "rx_dropped": _ERR,
        "tx_dropped": _ERR,
        "multicast": _TRAFFIC,
        "collisions": _ERR,
        "rx_length_errors": _ERR,
        "rx_over_errors": _ERR,
        "rx_crc_errors": _ERR,
        "rx_frame_errors": _ERR,
        "rx_fifo_errors": _ERR,
        "rx_missed_errors": _ERR,
        "tx_aborted_errors": _ERR,
        "tx_carrier_errors": _ERR,
        "tx_fifo_errors": _ERR,
        "tx_heartbeat_errors": _ERR,
        "tx_window_errors": _ERR,
        "rx_compressed": _TRAFFIC,
        "tx_compressed": _TRAFFIC,
        "rx_nohandler": _ERR,
        "carrier_changes": _LINK,
        "carrier_up_count": _LINK,
        "carrier_down_count": _LINK,
    }
)
IBTA_PORT_COUNTERS: Final[tuple[str, ...]] = tuple(IBTA_COUNTERS)
MLX5_HW_COUNTERS: Final[tuple[str, ...]] = tuple(MLX5_COUNTERS)
NETDEV_STATISTICS: Final[tuple[str, ...]] = tuple(NETDEV_COUNTERS)
NIC_COUNTER_CATALOGUE: Final[Mapping[str, NicCounter]] = types.MappingProxyType(
    {**IBTA_COUNTERS, **MLX5_COUNTERS, **NETDEV_COUNTERS}
)
NIC_COUNTER_NAMES: Final[frozenset[str]] = frozenset(NIC_COUNTER_CATALOGUE)
NIC_ERROR_COUNTERS: Final[frozenset[str]] = frozenset(
    name for name, c in NIC_COUNTER_CATALOGUE.items() if c.kind == "error"
)


# -- Collector error codes of agents older than the code ----------------------------------------------
# Agents before ``CollectorError.code`` said it in words only. These are the NVML collector's words
# for the two codes anyone acts on, so that a fleet upgrading its agents one node at a time is
# treated alike; the code always wins where it is set.
_LEGACY_NVML_WORDS: Final[tuple[tuple[ErrorCode, str], ...]] = (
    ("gpu_lost", "gpu is lost"),
    ("no_handle", "no device handle"),
)
_LEGACY_GPU_RE: Final = re.compile(r"(?i)\bgpu\s*(\d+)\b")


def error_code(error: CollectorError) -> ErrorCode | None:
    """The error's code: its own, else what an older agent's NVML message says (or None)."""
    if not isinstance(error.code, UnsetType):
        return error.code
    if error.collector == "nvml":
        text = error.message.lower()
        for code, words in _LEGACY_NVML_WORDS:
            if words in text:
                return code
    return None


def error_gpu(error: CollectorError) -> int | None:
    """The GPU index an error is about: its own ``gpu``, else an older NVML message's "GPU n"."""
    if not isinstance(error.gpu, UnsetType):
        return error.gpu
    if error.collector == "nvml" and error_code(error) is not None:
        m = _LEGACY_GPU_RE.search(error.message)
        if m is not None and int(m.group(1)) <= 63:
            return int(m.group(1))
    return None


# -- The 64-bit bound, enforced on decode -----------------------------------------------------------
# A plan per struct type, read off the annotations: which of its integer fields carry the bound,
# which maps have bounded values, which fields are lists of structs or one struct (their plans,
# recursively).


@dataclass(frozen=True)
class _Plan:
    ints: tuple[str, ...]
    get_ints: Callable[[Any], tuple[Any, ...]]
    maps: tuple[str, ...]
    lists: tuple[tuple[str, _Plan], ...]
    structs: tuple[tuple[str, _Plan], ...] = ()


def _bounded(hint: Any) -> bool:
    return typing.get_origin(hint) is Annotated and any(
        isinstance(m, Meta) and m.extra is not None and _U64_BOUND in m.extra for m in hint.__metadata__
    )


def _options(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) is Annotated:
        return _options(get_args(hint)[0])
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        return tuple(itertools.chain.from_iterable(_options(a) for a in get_args(hint)))
    return (hint,)


def _annotated_options(hint: Any) -> tuple[Any, ...]:
    """The union's members with their own ``Annotated`` metadata kept."""
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        return get_args(hint)
    if typing.get_origin(hint) is Annotated and typing.get_origin(get_args(hint)[0]) in (
        types.UnionType,
        typing.Union,
    ):
        return get_args(get_args(hint)[0])
    return (hint,)


def _is_struct(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, msgspec.Struct)


def _plan(struct: type[msgspec.Struct]) -> _Plan:
    ints: list[str] = []
    maps: list[str] = []
    lists: list[tuple[str, _Plan]] = []
    structs: list[tuple[str, _Plan]] = []
    for name, hint in typing.get_type_hints(struct, include_extras=True).items():
        members = _annotated_options(hint)
        if any(_bounded(m) for m in members):
            ints.append(name)
            continue
        for member in _options(hint):
            origin, args = typing.get_origin(member), get_args(member)
            if origin is dict and _bounded(args[1]):
                maps.append(name)
            elif origin in (list, tuple) and _is_struct(args[0]):  # list[S] or tuple[S, ...]
                lists.append((name, _plan(args[0])))
            elif isinstance(member, type) and issubclass(member, msgspec.Struct):
                structs.append((name, _plan(member)))
    return _Plan(tuple(ints), fields_getter(ints), tuple(maps), tuple(lists), tuple(structs))


def fields_getter(names: Sequence[str]) -> Callable[[Any], tuple[Any, ...]]:
    """``obj -> (obj.a, obj.b, ...)`` for ``names``, always a tuple (``attrgetter`` returns a bare
    value for one name), at C speed where there are several."""
    if len(names) > 1:
        return operator.attrgetter(*names)
    if names:
        one = names[0]
        return lambda obj: (getattr(obj, one),)
    return lambda obj: ()


_REPORT_PLAN: Final = _plan(Report)


def _largest(plan: _Plan, items: list[Any]) -> int:
    # Every step is a C loop: this runs on every report, over some 700 counters.
    top = max(filter(None, itertools.chain.from_iterable(map(plan.get_ints, items))), default=0)
    for name in plan.maps:
        maps = filter(None, map(operator.attrgetter(name), items))  # UNSET and {} are false
        top = max(top, max(itertools.chain.from_iterable(map(dict.values, maps)), default=0))
    for name, child in plan.lists:
        lists = filter(None, map(operator.attrgetter(name), items))  # UNSET and [] are false
        children = list(itertools.chain.from_iterable(lists))
        if children:
            top = max(top, _largest(child, children))
    for name, child in plan.structs:
        present = [v for v in map(operator.attrgetter(name), items) if isinstance(v, msgspec.Struct)]
        if present:
            top = max(top, _largest(child, present))
    return top


def _oversized(plan: _Plan, obj: Any, path: str) -> Iterable[str]:
    for name, value in zip(plan.ints, plan.get_ints(obj), strict=True):
        if isinstance(value, int) and value > U64_MAX:
            yield f"{path}.{name}"
    for name in plan.maps:
        for key, value in (getattr(obj, name) or {}).items():
            if value > U64_MAX:
                yield f"{path}.{name}.{key}"
    for name, child in plan.lists:
        items = getattr(obj, name)
        for i, item in enumerate(items if isinstance(items, (list, tuple)) else ()):
            yield from _oversized(child, item, f"{path}.{name}[{i}]")
    for name, child in plan.structs:
        value = getattr(obj, name)
        if isinstance(value, msgspec.Struct):
            yield from _oversized(child, value, f"{path}.{name}")


def _check_u64(report: Report) -> None:
    if _largest(_REPORT_PLAN, [report]) <= U64_MAX:
        return
    where = next(iter(_oversized(_REPORT_PLAN, report, "$")))
    # Worded as msgspec words its own constraints, so a reader cannot tell the two apart.
    raise msgspec.ValidationError(f"Expected `int` <= {U64_MAX} - at `{where}`")


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(Report)


def to_builtins(report: Report) -> dict[str, Any]:
    """The report as plain JSON-ready objects, exactly as it goes on the wire."""
    out: dict[str, Any] = msgspec.to_builtins(report)
    return out


def encode(report: Report) -> bytes:
    """Serialize a report to compact JSON bytes."""
    return _ENCODER.encode(report)


def decode(data: bytes | str) -> Report:
    """Parse and validate one report.

    Raises ``ReportError`` naming the offending field (msgspec reports a JSON path such as
    ``$.gpus[3].temperature_celsius``). JSON has no NaN or infinity, so they are refused here.
    """
    try:
        report = _DECODER.decode(data)
        _check_u64(report)
        return report
    except msgspec.ValidationError as exc:
        raise ReportError(f"report does not match {SCHEMA_ID}: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise ReportError(f"report is not valid JSON: {exc}") from exc


@cache
def json_schema() -> dict[str, Any]:
    """The published JSON Schema (the report contract, docs/spec.md section 1)."""
    text = resources.files("agent").joinpath("schema/report-v1.schema.json").read_text("utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema
