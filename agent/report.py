"""The node report, version 1: typed, fast, and the one source of truth for its shape.

The JSON Schema in ``agent/schema/report-v1.schema.json`` is the published contract (a copy of
``shared/spec/report-v1.schema.json``); these msgspec structs are the same contract as Python
types. ``tests/test_report_schema.py`` proves that the two agree, field by field and constraint by
constraint, so neither can drift from the other.

The aggregator imports these types from here; this module imports nothing from the aggregator.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Annotated, Any, Final, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from agent.errors import ReportError

SCHEMA_ID: Final = "gpuwarden/report/v1"

# Constrained scalar types, named after the schema's $defs.
Count = Annotated[int, Meta(ge=0)]
NodeName = Annotated[str, Meta(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")]


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
    # Optional but never null in the schema (like the report's optional top-level fields).
    nvlink: Annotated[list[NvLink], Meta(max_length=32)] | UnsetType = UNSET


class Nic(_Base, frozen=True):
    device: Str64
    link_layer: Literal["InfiniBand", "Ethernet"]
    port: Annotated[int, Meta(ge=0)] | None = None
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
    gpu: Annotated[int, Meta(ge=0)] | None = None
    code: Annotated[int, Meta(ge=0)] | None = None
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


class CollectorError(_Base, frozen=True):
    collector: Str64
    message: Str1024


class Report(_Base, frozen=True):
    schema: Literal["gpuwarden/report/v1"]
    node: NodeName
    time: float
    seq: Count
    boot_id: Annotated[str, Meta(min_length=1, max_length=64)]
    gpus: Annotated[list[Gpu], Meta(max_length=64)]
    nics: Annotated[list[Nic], Meta(max_length=256)]
    # Optional but never null in the schema: UNSET leaves them out of the JSON and refuses null.
    # Measured fields inside a GPU or NIC are the opposite: always written, null where unsupported.
    agent_version: Str64 | UnsetType = UNSET
    interval_seconds: Annotated[float, Meta(gt=0)] | UnsetType = UNSET
    labels: Annotated[dict[str, Str128], Meta(max_length=16)] | UnsetType = UNSET
    events: Annotated[list[Event], Meta(max_length=1024)] | UnsetType = UNSET
    probes: Annotated[list[Probe], Meta(max_length=256)] | UnsetType = UNSET
    errors: Annotated[list[CollectorError], Meta(max_length=64)] | UnsetType = UNSET


# -- The vocabulary of ``Nic.counters`` -------------------------------------------------------------
# The counter names the agent puts in ``Nic.counters``, by where the kernel exposes them. One list
# for the collectors, the rule vocabulary, the generators and the fixture builder. A driver counter
# that is not here can still be named in a rule as "driver:NAME"; the list exists to catch typos.
# IBTA PortCounters / PortCountersExtended (/sys/class/infiniband/*/ports/*/counters/).
IBTA_PORT_COUNTERS: Final[tuple[str, ...]] = (
    "symbol_error",
    "link_error_recovery",
    "link_downed",
    "port_rcv_errors",
    "port_rcv_remote_physical_errors",
    "port_rcv_switch_relay_errors",
    "port_xmit_discards",
    "port_xmit_constraint_errors",
    "port_rcv_constraint_errors",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
    "VL15_dropped",
    "port_xmit_wait",
    "port_rcv_discards",
    "port_xmit_data",
    "port_rcv_data",
    "port_xmit_packets",
    "port_rcv_packets",
    "port_xmit_data_64",
    "port_rcv_data_64",
    "port_xmit_packets_64",
    "port_rcv_packets_64",
    "port_unicast_xmit_packets",
    "port_unicast_rcv_packets",
    "port_multicast_xmit_packets",
    "port_multicast_rcv_packets",
    "unicast_xmit_packets",
    "unicast_rcv_packets",
    "multicast_xmit_packets",
    "multicast_rcv_packets",
)
# mlx5's per-port hw_counters/ (transport retries, errors, congestion).
MLX5_HW_COUNTERS: Final[tuple[str, ...]] = (
    "duplicate_request",
    "implied_nak_seq_err",
    "local_ack_timeout_err",
    "out_of_buffer",
    "out_of_sequence",
    "packet_seq_err",
    "req_cqe_error",
    "req_cqe_flush_error",
    "req_remote_access_errors",
    "req_remote_invalid_request",
    "req_transport_retries_exceeded",
    "resp_cqe_error",
    "resp_cqe_flush_error",
    "resp_local_length_error",
    "resp_remote_access_errors",
    "rnr_nak_retry_err",
    "roce_adp_retrans",
    "roce_adp_retrans_to",
    "roce_slow_restart",
    "roce_slow_restart_cnps",
    "roce_slow_restart_trans",
    "rp_cnp_handled",
    "rp_cnp_ignored",
    "np_cnp_sent",
    "np_ecn_marked_roce_packets",
    "rx_atomic_requests",
    "rx_dct_connect",
    "rx_read_requests",
    "rx_write_requests",
    "rx_icrc_encapsulated",
)
# The kernel's netdev statistics/ and carrier counts (/sys/class/net/*/).
NETDEV_STATISTICS: Final[tuple[str, ...]] = (
    "rx_bytes",
    "tx_bytes",
    "rx_packets",
    "tx_packets",
    "rx_errors",
    "tx_errors",
    "rx_dropped",
    "tx_dropped",
    "multicast",
    "collisions",
    "rx_length_errors",
    "rx_over_errors",
    "rx_crc_errors",
    "rx_frame_errors",
    "rx_fifo_errors",
    "rx_missed_errors",
    "tx_aborted_errors",
    "tx_carrier_errors",
    "tx_fifo_errors",
    "tx_heartbeat_errors",
    "tx_window_errors",
    "rx_compressed",
    "tx_compressed",
    "rx_nohandler",
    "carrier_changes",
    "carrier_up_count",
    "carrier_down_count",
)
NIC_COUNTER_NAMES: Final[frozenset[str]] = frozenset(
    IBTA_PORT_COUNTERS + MLX5_HW_COUNTERS + NETDEV_STATISTICS
)
# The typed cumulative NIC fields (the rest is ``Nic.counters``).
NIC_TYPED_COUNTERS: Final[tuple[str, ...]] = (
    "rx_bytes_total",
    "tx_bytes_total",
    "rx_packets_total",
    "tx_packets_total",
)


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
        return _DECODER.decode(data)
    except msgspec.ValidationError as exc:
        raise ReportError(f"report does not match {SCHEMA_ID}: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise ReportError(f"report is not valid JSON: {exc}") from exc


@cache
def json_schema() -> dict[str, Any]:
    """The published JSON Schema (the project's copy of the shared contract)."""
    text = resources.files("agent").joinpath("schema/report-v1.schema.json").read_text("utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema
