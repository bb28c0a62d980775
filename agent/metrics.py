"""The agent's Prometheus ``/metrics``: the latest report, the collectors and the shipper, as metrics.

One custom collector, ``AgentMetrics``, turns the agent's latest snapshot into metric families when
scraped. Naming follows https://prometheus.io/docs/practices/naming/: prefix ``gpuwarden_``, base
units in the name (seconds, bytes, celsius, watts, joules, hertz, ratio), ``_total`` on counters.

Label choices, made to keep cardinality low and joins easy:

- No node or hostname label on the measurements: Prometheus attaches the target's own labels.
  Only ``gpuwarden_gpu_info`` carries ``node_name``, the agent's own node name, so that rules that
  need a host name (dcgm-exporter's ``Hostname``) have one where the scrape config adds no ``node``
  label; named so that it never collides with a target label ``node``.
- GPU series carry ``gpu`` (the index, what people say) and ``uuid`` (what survives re-indexing).
  ``model`` and ``pci_bus_id`` are only on ``gpuwarden_gpu_info`` (value 1), the info-metric pattern
  of node_exporter: ``... * on(gpu, uuid) group_left(model) gpuwarden_gpu_info``.
- NIC series carry ``device`` and ``port``; ``port`` is "" for a plain netdev (Prometheus treats an
  empty label as an absent one). ``netdev`` and ``link_layer`` are only on ``gpuwarden_nic_info``.
- The well-known InfiniBand port error counters of an RDMA port get families of their own
  (``gpuwarden_infiniband_symbol_errors_total``, ...), named like node_exporter's; every other
  counter the report carries goes to a family by its unit (``NIC_STAT_FAMILIES``:
  ``gpuwarden_nic_stat_bytes_total``, ``..._packets_total``, ``..._errors_total``,
  ``..._events_total``, with ``stat="<sysfs file name>"``, since that set is open-ended), and one
  the catalogue does not know to ``gpuwarden_nic_stat_total``. (Not ``..._counter_total``:
  promtool rejects a counter with "counter" in its name.)

Pods: ``gpuwarden_gpu_pod_info{gpu, uuid, namespace, pod, container}`` (value 1) says which
container holds which GPU, from the report's ``pods`` (the kubelet's PodResources API,
agent/attribution.py). It is an info metric of its own instead of pod labels on every GPU series
(dcgm-exporter's way) because: a GPU shared by N containers would need N copies of each of its
~60 series; every job start and end would end every GPU series and start new ones (churn in the
TSDB, broken rate() across the change); and a GPU no pod holds would need a second, label-less
form of each series. One series per (GPU, container) instead, joined where wanted:
``gpuwarden_gpu_pod_info * on(gpu, uuid) group_left gpuwarden_gpu_utilization_ratio`` (the info
side is the "many" side, so a shared GPU joins too). Where attribution is not available (no
kubelet socket) there is no such series, and ``gpuwarden_collector_supported{collector=
"podresources"}`` is 0, with the reason in the agent's log.

A field the report has as null produces no sample: absent, never 0. Families with no samples are
left out.

Active probes (``agent.probes``) reach this module the way they reach the aggregator: in the
reports' ``probes`` lists, so the runner needs no second path for them. From every cycle it sees
(once per report ``seq``, like the event counters) ``AgentMetrics`` keeps a ``ProbeLedger``: the last
result per (kind, peer) and run counts per (kind, result). Its size is bounded whatever the
schedule: at most ``PROBE_PEERS_PER_KIND`` peers per kind, the least recently probed forgotten
first, and a peer not probed for ``PROBE_FORGET_SECONDS`` is forgotten (measured on the reports'
own clock). The local probe has no peer: its series carry ``peer=""``, which Prometheus treats as
no peer label at all, as for a netdev's ``port``. A result that only says the node was busy
(``skipped: ...``, ``stepped aside: ...``) is counted, but does not replace the last measurement:
it says nothing about the link.

XID counters and their zero. ``increase()`` and ``rate()`` count nothing for a series whose first
sample is already 1: Prometheus cannot tell "one XID" from "the counter was always 1". So a
``gpuwarden_gpu_xid_events_total{gpu, code}`` series is shown at 0 in at least one scrape before
any event is counted in it:

- for the XID codes in ``XID_CODES_PREDECLARED`` (the ones the shipped rules act on), every GPU of
  the report has its series at 0 from the first cycle on, so the first such XID counts at once;
- any other (gpu, code) appears at 0 the first time it occurs, and the event is added after the
  next scrape has shown that 0 (one scrape late, never lost). With two Prometheus servers scraping
  one agent, only the first to scrape sees that 0; predeclared codes count right for both.

Predeclaring every code would cost a series per GPU and code (hundreds of codes); the list costs
``len(XID_CODES_PREDECLARED)`` series per GPU. ``gpuwarden_gpu_last_xid_code{gpu, uuid}`` is the
code of the GPU's latest XID (0 before any), dcgm-exporter's DCGM_FI_DEV_XID_ERRORS.

Cost: the families built from one cycle's report are kept until the next cycle, so a scrape of an
unchanged snapshot only re-renders text; only the few shipper and agent samples are rebuilt.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Final
from wsgiref.simple_server import WSGIServer

from prometheus_client import ProcessCollector, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from agent import __version__
from agent.attribution import gpu_holders
from agent.errors import ConfigError
from agent.report import CLOCK_EVENT_REASONS as _REASONS
from agent.report import (
    GPU_CATALOGUE,
    NIC_COUNTER_CATALOGUE,
    NIC_COUNTER_NAMES,
    NIC_TYPED_COUNTERS,
    NVLINK_COUNTERS,
    Gpu,
    Nic,
    Probe,
    Report,
)
from agent.state import CycleResult, ShipperStats

log = logging.getLogger(__name__)

__all__ = [
    "CLOCK_EVENT_REASONS",
    "INFINIBAND_COUNTERS",
    "NIC_STAT_FAMILIES",
    "PROBE_FORGET_SECONDS",
    "PROBE_OUTCOMES",
    "PROBE_PEERS_PER_KIND",
    "XID_CODES_PREDECLARED",
    "AgentMetrics",
    "AgentSnapshot",
    "MetricsServer",
    "ProbeLast",
    "ProbeLedger",
    "make_registry",
    "probe_outcome",
    "serve",
]

# NVML's clocks-event (throttle) reason bits by name, in bit order (agent/report.py has them).
CLOCK_EVENT_REASONS: tuple[tuple[str, int], ...] = tuple(
    (name, reason.bit) for name, reason in _REASONS.items()
)

# RDMA port counter file (counters/ or hw_counters/) -> its own family, with HELP.
INFINIBAND_COUNTERS: dict[str, tuple[str, str]] = {
    "symbol_error": (
        "gpuwarden_infiniband_symbol_errors_total",
        "Minor link errors detected on one or more physical lanes of the port.",
    ),
    "link_downed": (
        "gpuwarden_infiniband_link_downed_total",
        "Times the link error recovery process failed and the link went down.",
    ),
    "link_error_recovery": (
        "gpuwarden_infiniband_link_error_recovery_total",
        "Times the link error recovery process completed successfully.",
    ),
    "port_rcv_errors": (
        "gpuwarden_infiniband_port_receive_errors_total",
        "Packets with errors received on the port.",
    ),
    "port_rcv_remote_physical_errors": (
        "gpuwarden_infiniband_port_receive_remote_physical_errors_total",
        "Packets received marked with the EBP delimiter (a physical error upstream).",
    ),
    "port_rcv_switch_relay_errors": (
        "gpuwarden_infiniband_port_receive_switch_relay_errors_total",
        "Received packets discarded because they could not be forwarded by the switch relay.",
    ),
    "port_rcv_constraint_errors": (
        "gpuwarden_infiniband_port_receive_constraint_errors_total",
        "Received packets discarded for partition key or raw packet constraint violations.",
    ),
    "port_xmit_discards": (
        "gpuwarden_infiniband_port_transmit_discards_total",
        "Outbound packets discarded because the port was down or congested.",
    ),
    "port_xmit_constraint_errors": (
        "gpuwarden_infiniband_port_transmit_constraint_errors_total",
        "Outbound packets not sent for partition key or raw packet constraint violations.",
    ),
    "port_xmit_wait": (
        "gpuwarden_infiniband_port_transmit_wait_total",
        "Ticks (of the port's sampling clock) during which data was waiting to be sent "
        "but the port had no flow-control credits.",
    ),
    "local_link_integrity_errors": (
        "gpuwarden_infiniband_local_link_integrity_errors_total",
        "Times the count of local physical errors exceeded the link's threshold.",
    ),
    "excessive_buffer_overrun_errors": (
        "gpuwarden_infiniband_excessive_buffer_overrun_errors_total",
        "Times consecutive flow-control update periods had buffer overruns.",
    ),
    "VL15_dropped": (
        "gpuwarden_infiniband_vl15_dropped_total",
        "Incoming subnet management (VL15) packets dropped for lack of buffers.",
    ),
    "rnr_nak_retry_err": (
        "gpuwarden_infiniband_rnr_nak_retry_errors_total",
        "Times the receiver-not-ready NAK retry count was exceeded.",
    ),
    "out_of_buffer": (
        "gpuwarden_infiniband_out_of_buffer_total",
        "Packets dropped because no receive buffer (WQE) was posted.",
    ),
    "out_of_sequence": (
        "gpuwarden_infiniband_out_of_sequence_total",
        "Out-of-sequence packets received.",
    ),
    "packet_seq_err": (
        "gpuwarden_infiniband_packet_sequence_errors_total",
        "NAKs for packet sequence errors received.",
    ),
    "local_ack_timeout_err": (
        "gpuwarden_infiniband_local_ack_timeout_errors_total",
        "Times the sender's ACK timer expired (on reliable-connection queue pairs).",
    ),
}

# The other counters of ``Nic.counters``, one family per unit (the catalogue's NicCounter.unit):
# a sum or a rate within one family means something. Words are exported as bytes (x 4). A driver
# counter the catalogue does not know has no known unit: it goes to gpuwarden_nic_stat_total.
NIC_STAT_FAMILIES: Final[Mapping[str | None, tuple[str, str]]] = {
    "bytes": (
        "gpuwarden_nic_stat_bytes_total",
        "Other byte counters of the port, in bytes, named by their sysfs file (IBTA's port_xmit_data "
        "and port_rcv_data count 4-byte words: they are multiplied by 4 here).",
    ),
    "packets": (
        "gpuwarden_nic_stat_packets_total",
        "Other packet counters of the port (count of packets or requests), named by their sysfs file.",
    ),
    "errors": (
        "gpuwarden_nic_stat_errors_total",
        "Other error counters of the port (count of errors, discards, drops), named by their sysfs "
        "file: zero on healthy hardware.",
    ),
    "events": (
        "gpuwarden_nic_stat_events_total",
        "Other event counters of the port (count): congestion notifications and link transitions "
        "(carrier_changes, ...), named by their sysfs file.",
    ),
    None: (
        "gpuwarden_nic_stat_total",
        "Driver counters of the port that gpuwarden does not know (count, unit unknown), named by "
        "their sysfs file.",
    ),
}

_EVENT_KINDS = ("xid", "sxid", "kernel")
# XID codes whose counter every GPU has at 0 from the start (see the module docstring): the codes
# rules/xid.yaml acts on (tests/test_metrics.py keeps the two in step), NVIDIA's catalogue's
# hardware, driver and application faults: 13 graphics engine exception, 31 MMU fault, 43 stopped
# processing, 45 preemptive cleanup, 48 double-bit ECC, 62 micro-controller halt, 63 row remap
# pending, 64 row remap failure, 74 NVLink error, 79 fallen off the bus, 92 high single-bit ECC
# rate, 94 contained ECC error, 95 uncontained ECC error, 119 and 120 GSP errors, 140 unrecovered
# ECC error, 154 GPU recovery action changed.
XID_CODES_PREDECLARED: Final[tuple[int, ...]] = (
    13, 31, 43, 45, 48, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140, 154,
)  # fmt: skip
_PSTATE_UNKNOWN = 32  # NVML_PSTATE_UNKNOWN: no state to report
_GPU_LABELS = ("gpu", "uuid")
_NIC_LABELS = ("device", "port")


# Whether a family is a Prometheus counter or a gauge follows the field catalogue (agent/report.py):
# cumulative fields are counters, named ``..._total``. With one exception, on purpose: retired
# pages and remapped rows are cumulative counts (the catalogue and the aggregator treat them as
# counters and take rates of them), but they were published as the gauges
# ``gpuwarden_gpu_retired_pages`` and ``gpuwarden_gpu_remapped_rows``, like DCGM's
# DCGM_FI_DEV_RETIRED_* and *_REMAPPED_ROWS fields, and dashboards, the DCGM-compatible recording
# rules (rules/prometheus/) and the PrometheusRule alerts read them by those names. A counter must
# end in ``_total``, so the type change would rename public metrics. They are levels of a budget
# anyway (how many of the board's spare rows are used, kept in its InfoROM across reboots and
# driver reloads, never reset the way Prometheus counters are), and alerts compare them with a
# threshold, which a gauge serves as well; so they stay gauges.
_COUNTERS_EXPORTED_AS_GAUGES: Final = frozenset(
    {"retired_pages_sbe", "retired_pages_dbe", "remapped_rows_correctable", "remapped_rows_uncorrectable"}
)


@dataclass(frozen=True)
class _GpuFamily:
    """One GPU metric family: a field per extra label value, or one field and no extra label."""

    name: str
    help: str
    fields: tuple[tuple[str, tuple[str, ...]], ...]  # (Gpu attribute, values of ``labels``)
    labels: tuple[str, ...] = ()  # beyond gpu and uuid

    @property
    def counter(self) -> bool:
        kinds = {GPU_CATALOGUE[attr].kind for attr, _ in self.fields}
        attrs = {attr for attr, _ in self.fields}
        return kinds == {"counter"} and not attrs & _COUNTERS_EXPORTED_AS_GAUGES


def _plain(name: str, attr: str, help_: str) -> _GpuFamily:
    return _GpuFamily(name, help_, ((attr, ()),))


_GPU_FAMILIES: tuple[_GpuFamily, ...] = (
    _plain(
        "gpuwarden_gpu_temperature_celsius",
        "temperature_celsius",
        "GPU core temperature, in degrees Celsius.",
    ),
    _plain(
        "gpuwarden_gpu_memory_temperature_celsius",
        "memory_temperature_celsius",
        "GPU memory (HBM) temperature, in degrees Celsius.",
    ),
    _plain(
        "gpuwarden_gpu_utilization_ratio",
        "utilization_ratio",
        "Share of the last sample period during which a kernel was running on the GPU (ratio, 0 to 1).",
    ),
    _plain(
        "gpuwarden_gpu_memory_used_bytes",
        "memory_used_bytes",
        "GPU framebuffer memory in use, in bytes.",
    ),
    _plain(
        "gpuwarden_gpu_memory_total_bytes",
        "memory_total_bytes",
        "GPU framebuffer memory in total, in bytes.",
    ),
    _plain("gpuwarden_gpu_power_watts", "power_watts", "GPU power draw, in watts."),
    _plain(
        "gpuwarden_gpu_power_limit_watts",
        "power_limit_watts",
        "GPU power limit being enforced, in watts.",
    ),
    _plain(
        "gpuwarden_gpu_energy_joules_total",
        "energy_joules_total",
        "Energy the GPU consumed since the driver was loaded, in joules.",
    ),
    _plain("gpuwarden_gpu_sm_clock_hertz", "sm_clock_hz", "Current SM clock, in hertz."),
    _plain("gpuwarden_gpu_sm_clock_max_hertz", "sm_clock_max_hz", "Maximum SM clock, in hertz."),
    _plain(
        "gpuwarden_gpu_memory_clock_hertz",
        "memory_clock_hz",
        "Current memory clock, in hertz.",
    ),
    _plain(
        "gpuwarden_gpu_clock_event_reasons",
        "clock_event_reasons",
        "Bitmask of active clocks-event (throttle) reasons as NVML returns it, a plain number "
        "(gpuwarden_gpu_clock_event_reason_active has one series per known bit).",
    ),
    _GpuFamily(
        "gpuwarden_gpu_ecc_errors_total",
        "ECC errors the GPU counted (count); type sbe: single-bit, corrected; dbe: double-bit, "
        "uncorrected. scope volatile: since the driver was loaded; aggregate: over the GPU's "
        "lifetime, which includes volatile, so never sum across scope.",
        (
            ("ecc_sbe_volatile_total", ("sbe", "volatile")),
            ("ecc_dbe_volatile_total", ("dbe", "volatile")),
            ("ecc_sbe_aggregate_total", ("sbe", "aggregate")),
            ("ecc_dbe_aggregate_total", ("dbe", "aggregate")),
        ),
        ("type", "scope"),
    ),
    _GpuFamily(
        "gpuwarden_gpu_retired_pages",
        "GPU memory pages retired (count), by cause: sbe, repeated single-bit errors; dbe, a "
        "double-bit error.",
        (("retired_pages_sbe", ("sbe",)), ("retired_pages_dbe", ("dbe",))),
        ("cause",),
    ),
    _plain(
        "gpuwarden_gpu_retired_pages_pending",
        "retired_pages_pending",
        "1 if pages wait to be retired at the next driver reload, else 0.",
    ),
    _GpuFamily(
        "gpuwarden_gpu_remapped_rows",
        "GPU memory rows remapped to spare rows (count), by the type of error that caused it.",
        (
            ("remapped_rows_correctable", ("correctable",)),
            ("remapped_rows_uncorrectable", ("uncorrectable",)),
        ),
        ("type",),
    ),
    _plain(
        "gpuwarden_gpu_remapped_rows_pending",
        "remapped_rows_pending",
        "1 if a row remap waits for the next GPU reset, else 0.",
    ),
    _plain(
        "gpuwarden_gpu_remapped_rows_failure",
        "remapped_rows_failure",
        "1 if a row remap failed (no spare row left), else 0.",
    ),
    _plain(
        "gpuwarden_gpu_pcie_link_generation",
        "pcie_link_gen",
        "Current PCIe link generation (1 to 6).",
    ),
    _plain(
        "gpuwarden_gpu_pcie_link_generation_max",
        "pcie_link_gen_max",
        "Highest PCIe link generation the GPU and its slot support.",
    ),
    _plain(
        "gpuwarden_gpu_pcie_link_width",
        "pcie_link_width",
        "Current PCIe link width, in lanes.",
    ),
    _plain(
        "gpuwarden_gpu_pcie_link_width_max",
        "pcie_link_width_max",
        "Widest PCIe link the GPU and its slot support, in lanes.",
    ),
    _plain(
        "gpuwarden_gpu_pcie_replay_total",
        "pcie_replay_total",
        "PCIe replays (retransmitted packets) the GPU counted, since the driver was loaded.",
    ),
    _plain(
        "gpuwarden_gpu_memory_utilization_ratio",
        "memory_utilization_ratio",
        "Share of the last sample period during which device memory was read or written (ratio, 0 to 1).",
    ),
    # NVML's GPU Performance Monitoring (Hopper and later), averaged over the report interval.
    _plain(
        "gpuwarden_gpu_graphics_engine_active_ratio",
        "gr_engine_active_ratio",
        "Share of the last interval during which the graphics or compute engine was active "
        "(ratio, 0 to 1; NVML GPM graphics utilization).",
    ),
    _plain(
        "gpuwarden_gpu_sm_active_ratio",
        "sm_active_ratio",
        "Share of the last interval during which at least one warp was active on an SM, averaged "
        "over all SMs (ratio, 0 to 1; NVML GPM SM utilization).",
    ),
    _plain(
        "gpuwarden_gpu_sm_occupancy_ratio",
        "sm_occupancy_ratio",
        "Warps resident on the SMs over the most they can hold, averaged over the last interval "
        "(ratio, 0 to 1; NVML GPM SM occupancy).",
    ),
    _plain(
        "gpuwarden_gpu_tensor_active_ratio",
        "tensor_active_ratio",
        "Share of the last interval during which any tensor core pipe was active (ratio, 0 to 1; "
        "NVML GPM any-tensor utilization).",
    ),
    _plain(
        "gpuwarden_gpu_dram_active_ratio",
        "dram_active_ratio",
        "DRAM bandwidth used over the peak, averaged over the last interval (ratio, 0 to 1; NVML "
        "GPM DRAM bandwidth utilization).",
    ),
    _GpuFamily(
        "gpuwarden_gpu_pcie_throughput_bytes_per_second",
        "PCIe traffic of the GPU over the last interval, headers included, in bytes per second; "
        "direction transmit: from the GPU, receive: to it.",
        (("pcie_tx_bytes_per_second", ("transmit",)), ("pcie_rx_bytes_per_second", ("receive",))),
        ("direction",),
    ),
    _GpuFamily(
        "gpuwarden_gpu_nvlink_throughput_bytes_per_second",
        "NVLink traffic of the GPU over the last interval, all links together, in bytes per second; "
        "direction transmit: from the GPU, receive: to it.",
        (("nvlink_tx_bytes_per_second", ("transmit",)), ("nvlink_rx_bytes_per_second", ("receive",))),
        ("direction",),
    ),
)

_NVLINK_ERRORS: tuple[tuple[str, str], ...] = (
    ("crc_flit_errors_total", "crc_flit"),
    ("crc_data_errors_total", "crc_data"),
    ("replay_errors_total", "replay"),
    ("recovery_errors_total", "recovery"),
)

_NIC_TRAFFIC: tuple[tuple[str, str, str], ...] = (
    ("rx_bytes_total", "gpuwarden_nic_receive_bytes_total", "Bytes received, in bytes."),
    ("tx_bytes_total", "gpuwarden_nic_transmit_bytes_total", "Bytes transmitted, in bytes."),
    ("rx_packets_total", "gpuwarden_nic_receive_packets_total", "Packets received (count)."),
    ("tx_packets_total", "gpuwarden_nic_transmit_packets_total", "Packets transmitted (count)."),
)


# GPU fields with a family of their own below (the P-state leaves NVML's "unknown" out).
_GPU_FIELDS_ELSEWHERE: Final = frozenset({"performance_state"})


def _check_families() -> None:
    """Every measured field of the catalogue is exported, with the type its kind calls for.

    Runs at import: a field added to the report without a metric here fails every test."""
    exported = [attr for spec in _GPU_FAMILIES for attr, _ in spec.fields]
    measured = {name for name, info in GPU_CATALOGUE.items() if info.kind != "label"}
    if len(exported) != len(set(exported)) or set(exported) | _GPU_FIELDS_ELSEWHERE != measured:
        raise TypeError(f"GPU families and the catalogue differ: {sorted(measured ^ set(exported))}")
    for spec in _GPU_FAMILIES:
        if len({GPU_CATALOGUE[attr].kind for attr, _ in spec.fields}) != 1:
            raise TypeError(f"{spec.name} mixes fields of different kinds")
        if spec.counter != spec.name.endswith("_total"):
            raise TypeError(f"{spec.name}: a counter's name ends in _total, a gauge's does not")
    if tuple(attr for attr, _ in _NVLINK_ERRORS) != NVLINK_COUNTERS:
        raise TypeError("NVLink error types and the catalogue's NVLink counters differ")
    if tuple(attr for attr, _, _ in _NIC_TRAFFIC) != NIC_TYPED_COUNTERS:
        raise TypeError("NIC traffic families and the catalogue's typed NIC counters differ")
    if not INFINIBAND_COUNTERS.keys() <= NIC_COUNTER_NAMES:
        raise TypeError(f"unknown NIC counters {sorted(INFINIBAND_COUNTERS.keys() - NIC_COUNTER_NAMES)}")


_check_families()


@dataclass(frozen=True)
class AgentSnapshot:
    """What a scrape shows: the latest finished cycle and the shipper's counters, read together."""

    cycle: CycleResult | None = None
    shipper: ShipperStats | None = None  # None: this agent ships nowhere (print or trace only)
    version: str = __version__


def _family(
    name: str, help_: str, labels: Iterable[str], *, counter: bool
) -> CounterMetricFamily | GaugeMetricFamily:
    if counter:
        return CounterMetricFamily(name, help_, labels=list(labels))
    return GaugeMetricFamily(name, help_, labels=list(labels))


def _gpu_families(gpus: Iterable[Gpu], node: str) -> list[Metric]:
    info = InfoMetricFamily(
        "gpuwarden_gpu",
        "A GPU of this node, value always 1: join on gpu and uuid for its model, PCI address and "
        "driver version. node_name is the agent's own node name (--node), for joins that need it "
        "where the scrape adds no node label.",
        labels=_GPU_LABELS,
    )
    families = [
        (spec, _family(spec.name, spec.help, (*_GPU_LABELS, *spec.labels), counter=spec.counter))
        for spec in _GPU_FAMILIES
    ]
    pstate = GaugeMetricFamily(
        "gpuwarden_gpu_performance_state",
        "Performance state (P-state) number, 0 (maximum performance) to 15 (minimum).",
        labels=_GPU_LABELS,
    )
    reason_active = GaugeMetricFamily(
        "gpuwarden_gpu_clock_event_reason_active",
        "1 if the clocks-event (throttle) reason is active, else 0; reason names follow NVML's "
        "nvmlClocksEventReason bits.",
        labels=(*_GPU_LABELS, "reason"),
    )
    nvlink_active = GaugeMetricFamily(
        "gpuwarden_gpu_nvlink_active",
        "1 if the NVLink link is active, else 0.",
        labels=(*_GPU_LABELS, "link"),
    )
    nvlink_errors = CounterMetricFamily(
        "gpuwarden_gpu_nvlink_errors_total",
        "NVLink errors the GPU counted on the link (count), by type: crc_flit, crc_data, replay, recovery.",
        labels=(*_GPU_LABELS, "link", "type"),
    )

    seen: set[int] = set()
    for gpu in gpus:
        if gpu.index in seen:
            # Two series with one label set would make Prometheus reject the samples.
            log.warning("duplicate GPU index in report, exporting the first", extra={"gpu": gpu.index})
            continue
        seen.add(gpu.index)
        ids = [str(gpu.index), gpu.uuid]
        info.add_metric(
            ids,
            {
                "model": gpu.model or "",
                "pci_bus_id": gpu.pci_bus_id or "",
                "driver_version": gpu.driver_version or "",
                "node_name": node,
            },
        )
        for spec, fam in families:
            for attr, extra in spec.fields:
                value = getattr(gpu, attr)
                if value is not None:
                    fam.add_metric([*ids, *extra], float(value))
        if gpu.performance_state is not None and gpu.performance_state != _PSTATE_UNKNOWN:
            pstate.add_metric(ids, float(gpu.performance_state))
        if gpu.clock_event_reasons is not None:
            mask = gpu.clock_event_reasons
            for reason, bit in CLOCK_EVENT_REASONS:
                reason_active.add_metric([*ids, reason], 1.0 if mask & bit else 0.0)
        if gpu.nvlink:
            for link in gpu.nvlink:
                link_ids = [*ids, str(link.link)]
                if link.active is not None:
                    nvlink_active.add_metric(link_ids, float(link.active))
                for attr, kind in _NVLINK_ERRORS:
                    value = getattr(link, attr)
                    if value is not None:
                        nvlink_errors.add_metric([*link_ids, kind], float(value))
    return [info, *(fam for _, fam in families), pstate, reason_active, nvlink_active, nvlink_errors]


def _nic_families(nics: Iterable[Nic]) -> list[Metric]:
    info = InfoMetricFamily(
        "gpuwarden_nic",
        "A network port of this node, value always 1: join on device and port for its netdev and "
        'link layer. port is "" for a plain netdev.',
        labels=_NIC_LABELS,
    )
    up = GaugeMetricFamily(
        "gpuwarden_nic_up",
        "1 if the port is up (RDMA port state ACTIVE, netdev operstate up), else 0.",
        labels=_NIC_LABELS,
    )
    phys_up = GaugeMetricFamily(
        "gpuwarden_nic_physical_link_up",
        "1 if the RDMA port's physical state is LinkUp, else 0.",
        labels=_NIC_LABELS,
    )
    speed = GaugeMetricFamily(
        "gpuwarden_nic_link_speed_bytes",
        "Negotiated link speed, in bytes per second.",
        labels=_NIC_LABELS,
    )
    traffic = [
        (attr, CounterMetricFamily(name, help_, labels=_NIC_LABELS)) for attr, name, help_ in _NIC_TRAFFIC
    ]
    infiniband = {
        key: CounterMetricFamily(name, help_, labels=_NIC_LABELS)
        for key, (name, help_) in INFINIBAND_COUNTERS.items()
    }
    stats = {
        unit: CounterMetricFamily(name, help_, labels=(*_NIC_LABELS, "stat"))
        for unit, (name, help_) in NIC_STAT_FAMILIES.items()
    }

    seen: set[tuple[str, str]] = set()
    for nic in nics:
        ids = [nic.device, "" if nic.port is None else str(nic.port)]
        key = (ids[0], ids[1])
        if key in seen:
            log.warning(
                "duplicate NIC in report, exporting the first",
                extra={"device": nic.device, "port": nic.port},
            )
            continue
        seen.add(key)
        info.add_metric(ids, {"netdev": nic.netdev or "", "link_layer": nic.link_layer})
        if nic.state is not None:
            up.add_metric(ids, 1.0 if nic.state.lower() in ("active", "up") else 0.0)
        if nic.phys_state is not None:
            phys_up.add_metric(ids, 1.0 if nic.phys_state.lower() == "linkup" else 0.0)
        if nic.rate_bytes_per_second is not None:
            speed.add_metric(ids, float(nic.rate_bytes_per_second))
        for attr, fam in traffic:
            value = getattr(nic, attr)
            if value is not None:
                fam.add_metric(ids, float(value))
        if not nic.counters:
            continue
        rdma = nic.port is not None
        for name, value in nic.counters.items():
            ib = infiniband.get(name) if rdma else None
            if ib is not None:
                ib.add_metric(ids, float(value))
                continue
            known = NIC_COUNTER_CATALOGUE.get(name)
            unit = known.unit if known is not None else None
            # 4-byte words are exported as bytes, so that every _bytes_total is in bytes.
            scale = 4.0 if unit == "words" else 1.0
            stats["bytes" if unit == "words" else unit].add_metric([*ids, name], value * scale)
    return [info, up, phys_up, speed, *(fam for _, fam in traffic), *infiniband.values(), *stats.values()]


def _cycle_families(cycle: CycleResult) -> list[Metric]:
    report = cycle.report
    success = GaugeMetricFamily(
        "gpuwarden_collector_success",
        "1 if the collector ran without failing in the last cycle, else 0 (0 when unsupported).",
        labels=("collector",),
    )
    duration = GaugeMetricFamily(
        "gpuwarden_collector_duration_seconds",
        "Time the collector took in the last cycle, in seconds.",
        labels=("collector",),
    )
    supported = GaugeMetricFamily(
        "gpuwarden_collector_supported",
        "1 if this node has what the collector reads, else 0.",
        labels=("collector",),
    )
    for status in cycle.statuses:
        success.add_metric([status.name], float(status.success))
        duration.add_metric([status.name], status.duration_seconds)
        supported.add_metric([status.name], float(status.supported))
    families: list[Metric] = [
        *_report_families(report),
        success,
        duration,
        supported,
        *_gpu_families(report.gpus, report.node),
        *_pod_families(report),
        *_nic_families(report.nics),
    ]
    return [fam for fam in families if fam.samples]


def _pod_families(report: Report) -> list[Metric]:
    if not report.pods:  # UNSET (not available) or empty (no pod holds a GPU): no series
        return []
    info = InfoMetricFamily(
        "gpuwarden_gpu_pod",
        "A container that holds the GPU (from the kubelet's PodResources API), value always 1; one "
        "series per GPU and container, several where a GPU is shared. Join: gpuwarden_gpu_pod_info "
        "* on(gpu, uuid) group_left <a GPU series>.",
        labels=_GPU_LABELS,
    )
    by_index = {gpu.index: gpu for gpu in report.gpus}
    seen: set[tuple[int, str, str, str]] = set()
    for index, allocs in sorted(gpu_holders(report.pods, {g.index: g.uuid for g in report.gpus}).items()):
        for alloc in allocs:
            key = (index, alloc.namespace, alloc.pod, alloc.container)
            if key in seen:  # one container holding the GPU through two resources: one series
                continue
            seen.add(key)
            info.add_metric(
                [str(index), by_index[index].uuid],
                {"namespace": alloc.namespace, "pod": alloc.pod, "container": alloc.container},
            )
    return [info]


def _report_families(report: Report) -> list[Metric]:
    families: list[Metric] = [
        GaugeMetricFamily(
            "gpuwarden_agent_last_report_timestamp_seconds",
            "Unix time of the agent's last report, in seconds.",
            value=report.time,
        ),
        GaugeMetricFamily(
            "gpuwarden_agent_errors",
            "Collector errors in the agent's last report (count).",
            value=len(report.errors or ()),
        ),
    ]
    if isinstance(report.interval_seconds, float | int):
        families.append(
            GaugeMetricFamily(
                "gpuwarden_agent_report_interval_seconds",
                "Interval between the agent's reports, in seconds.",
                value=report.interval_seconds,
            )
        )
    return families


def _shipper_families(stats: ShipperStats) -> list[Metric]:
    families: list[Metric] = [
        CounterMetricFamily(
            "gpuwarden_shipper_reports_sent_total",
            "Reports the aggregator accepted (count).",
            value=stats.sent_total,
        ),
        CounterMetricFamily(
            "gpuwarden_shipper_reports_rejected_total",
            "Reports the aggregator refused for good and that were not retried (count).",
            value=stats.rejected_total,
        ),
        CounterMetricFamily(
            "gpuwarden_shipper_failed_attempts_total",
            "Deliveries that failed and will be retried: network error, timeout, 5xx, 408 or 429 (count).",
            value=stats.failed_attempts_total,
        ),
        CounterMetricFamily(
            "gpuwarden_shipper_reports_spooled_total",
            "Reports put in the spool to wait for delivery (count).",
            value=stats.spooled_total,
        ),
        CounterMetricFamily(
            "gpuwarden_shipper_reports_dropped_total",
            "Reports dropped, oldest first, because the spool was full (count).",
            value=stats.dropped_total,
        ),
        GaugeMetricFamily(
            "gpuwarden_shipper_spool_depth",
            "Reports waiting in the spool now (count).",
            value=stats.spool_depth,
        ),
    ]
    if stats.last_success_time is not None:
        families.append(
            GaugeMetricFamily(
                "gpuwarden_shipper_last_success_timestamp_seconds",
                "Unix time of the last report the aggregator accepted, in seconds.",
                value=stats.last_success_time,
            )
        )
    return families


PROBE_PEERS_PER_KIND: Final = 32
PROBE_FORGET_SECONDS: Final = 3600.0
PROBE_OUTCOMES: Final = ("ok", "failed", "skipped")
# The agent's own words for "the node was busy, nothing was measured" (docs/probes.md, Results);
# the aggregator's scheduler reads the same prefixes (BUSY_ERROR_PREFIXES).
_BUSY_PREFIXES: Final = ("skipped:", "stepped aside:")


def probe_outcome(probe: Probe) -> str:
    """``ok``, ``skipped`` (the node was busy: nothing measured) or ``failed``."""
    if probe.ok:
        return "ok"
    if (probe.error or "").startswith(_BUSY_PREFIXES):
        return "skipped"
    return "failed"


@dataclass(frozen=True)
class ProbeLast:
    """The last measurement of one (kind, peer), as exported; ``peer`` is "" for a local probe."""

    kind: str
    peer: str
    time: float  # unix seconds the probe started
    ok: bool
    bandwidth_bytes_per_second: float | None  # None when it failed or measured no bandwidth


class ProbeLedger:
    """The last result per (kind, peer) and run counts per (kind, result), bounded.

    Not thread-safe: ``AgentMetrics`` calls it under its lock. Results may arrive out of order
    (the two halves of different probes finish in either order), so "last" means the latest
    ``time``, and "most recent peers" the peers with the latest results.
    """

    def __init__(
        self, *, max_peers: int = PROBE_PEERS_PER_KIND, forget_after_s: float = PROBE_FORGET_SECONDS
    ) -> None:
        if max_peers < 1 or forget_after_s <= 0:
            raise ValueError(f"max_peers {max_peers} and forget_after_s {forget_after_s} must be positive")
        self._max_peers = max_peers
        self._forget_after = forget_after_s
        self._last: dict[str, dict[str, ProbeLast]] = {}
        self._runs: dict[tuple[str, str], int] = {}

    def add(self, probe: Probe, now: float) -> None:
        """Count one result, and keep it if it is a measurement newer than the peer's last."""
        outcome = probe_outcome(probe)
        if (probe.kind, "ok") not in self._runs:
            # Every outcome of a kind from its first result on, so that rate() sees the first failure.
            for name in PROBE_OUTCOMES:
                self._runs[(probe.kind, name)] = 0
        self._runs[(probe.kind, outcome)] += 1
        if outcome == "skipped" or probe.time < now - self._forget_after:
            return
        peers = self._last.setdefault(probe.kind, {})
        peer = probe.peer or ""
        held = peers.get(peer)
        if held is not None and held.time > probe.time:
            return
        bandwidth = probe.busbw_bytes_per_second if probe.ok else None
        peers[peer] = ProbeLast(probe.kind, peer, probe.time, probe.ok, bandwidth)
        if len(peers) > self._max_peers:
            oldest = min(peers.values(), key=lambda last: (last.time, last.peer))
            del peers[oldest.peer]
            log.debug(
                "probe peer forgotten: too many peers",
                extra={"kind": probe.kind, "peer": oldest.peer, "max_peers": self._max_peers},
            )

    def expire(self, now: float) -> bool:
        """Forget peers not probed within ``forget_after_s`` of ``now``; whether any was."""
        cutoff = now - self._forget_after
        changed = False
        for kind, peers in list(self._last.items()):
            stale = [peer for peer, last in peers.items() if last.time < cutoff]
            for peer in stale:
                del peers[peer]
            changed = changed or bool(stale)
            if not peers:
                del self._last[kind]
        return changed

    def last(self) -> tuple[ProbeLast, ...]:
        """An immutable copy of the kept results, sorted by kind and peer (a stable exposition)."""
        return tuple(
            sorted(
                (last for peers in self._last.values() for last in peers.values()),
                key=lambda x: (x.kind, x.peer),
            )
        )

    def runs(self) -> dict[tuple[str, str], int]:
        return dict(sorted(self._runs.items()))


def _probe_families(last: Iterable[ProbeLast], runs: dict[tuple[str, str], int]) -> list[Metric]:
    labels = ("kind", "peer")
    bound = (
        f'peer is "" for the local probe. At most the {PROBE_PEERS_PER_KIND} most recently probed '
        f"peers per kind; a peer not probed for {PROBE_FORGET_SECONDS:.0f} s is dropped."
    )
    bandwidth = GaugeMetricFamily(
        "gpuwarden_probe_last_bandwidth_bytes_per_second",
        "Bandwidth the node's last probe of this kind with this peer measured, in bytes per second "
        "(bus bandwidth for NCCL all-reduce, throughput for tcp_pair); absent when that probe failed. "
        + bound,
        labels=labels,
    )
    timestamp = GaugeMetricFamily(
        "gpuwarden_probe_last_timestamp_seconds",
        "Unix time the node's last probe of this kind with this peer started, in seconds "
        "(probes skipped because the node was busy do not count). " + bound,
        labels=labels,
    )
    ok = GaugeMetricFamily(
        "gpuwarden_probe_last_ok",
        "1 if the node's last probe of this kind with this peer succeeded, else 0. " + bound,
        labels=labels,
    )
    for item in last:
        ids = [item.kind, item.peer]
        timestamp.add_metric(ids, item.time)
        ok.add_metric(ids, 1.0 if item.ok else 0.0)
        if item.bandwidth_bytes_per_second is not None:
            bandwidth.add_metric(ids, item.bandwidth_bytes_per_second)
    total = CounterMetricFamily(
        "gpuwarden_probe_runs_total",
        "Probe results this agent process reported (count), by kind and result: ok, failed, or "
        "skipped (not run or stopped because the node was busy: errors starting skipped: or "
        "stepped aside:).",
        labels=("kind", "result"),
    )
    for (kind, outcome), count in runs.items():
        total.add_metric([kind, outcome], float(count))
    return [fam for fam in (bandwidth, timestamp, ok, total) if fam.samples]


class AgentMetrics(Collector):
    """A prometheus_client collector over the agent's latest snapshot.

    ``snapshot`` is called once per scrape, from the HTTP server's threads; it must be cheap and
    return immutable data (the runner's last ``CycleResult`` and the shipper's ``stats()``).

    Event counters (``gpuwarden_gpu_xid_events_total``, ``gpuwarden_agent_events_total``) count
    the events of every cycle this object saw, once per cycle (by report ``seq``). A scrape sees
    only the latest cycle, so the runner should also hand each cycle to ``record_cycle``; otherwise
    events of cycles that finished between two scrapes are not counted. The probe results of the
    reports (``gpuwarden_probe_*``) are taken the same way, into a ``ProbeLedger``.
    """

    def __init__(self, snapshot: Callable[[], AgentSnapshot]) -> None:
        self._snapshot = snapshot
        self._lock = threading.Lock()
        self._last_seq = -1
        # (gpu, code) -> XIDs counted; the exposition shows exactly these. Events of a series no
        # scrape has shown yet wait in _xid_pending (see the module docstring).
        self._xid_counts: dict[tuple[int | None, int], int] = {}
        self._xid_shown: set[tuple[int | None, int]] = set()
        self._xid_pending: dict[tuple[int | None, int], int] = {}
        self._last_xid: dict[int, int] = {}  # GPU index -> code of its latest XID
        self._gpu_uuids: dict[int, str] = {}  # GPU index -> UUID, of the latest report
        self._event_counts: dict[str, int] = dict.fromkeys(_EVENT_KINDS, 0)
        self._cycle: CycleResult | None = None
        self._cycle_families: list[Metric] = []
        self._event_families: list[Metric] | None = None
        self._probes = ProbeLedger()
        self._probe_families: list[Metric] | None = None

    def record_cycle(self, cycle: CycleResult) -> None:
        """Count a finished cycle's events; a cycle seen before (same or older seq) counts nothing."""
        with self._lock:
            self._count_events(cycle)

    def _count_events(self, cycle: CycleResult) -> None:
        report = cycle.report
        # seq grows by one per report within one agent process, and so within this object's life.
        if report.seq <= self._last_seq:
            return
        self._last_seq = report.seq
        self._count_probes(report)
        uuids = {gpu.index: gpu.uuid for gpu in report.gpus}
        for index in uuids.keys() - self._gpu_uuids.keys():
            for code in XID_CODES_PREDECLARED:
                self._xid_counts.setdefault((index, code), 0)
        if uuids != self._gpu_uuids:
            self._gpu_uuids = uuids
            self._event_families = None
        if not report.events:
            return
        for event in report.events:
            self._event_counts[event.kind] = self._event_counts.get(event.kind, 0) + 1
            if event.kind == "xid" and event.code is not None:
                key = (event.gpu, event.code)
                if key in self._xid_shown:
                    self._xid_counts[key] += 1
                else:
                    self._xid_counts.setdefault(key, 0)
                    self._xid_pending[key] = self._xid_pending.get(key, 0) + 1
                if event.gpu is not None:
                    self._last_xid[event.gpu] = event.code
        self._event_families = None

    def _xid_scraped(self) -> None:
        """The exposition just built showed every series of ``_xid_counts``: the events that
        waited for their series' zero to be seen count from the next scrape on."""
        if len(self._xid_shown) != len(self._xid_counts):
            self._xid_shown.update(self._xid_counts)
        if self._xid_pending:
            for key, count in self._xid_pending.items():
                self._xid_counts[key] += count
            self._xid_pending.clear()
            self._event_families = None

    def _count_probes(self, report: Report) -> None:
        # The report's own time is "now": forgetting follows the agent's (injectable) clock.
        changed = self._probes.expire(report.time)
        for probe in report.probes or ():
            self._probes.add(probe, report.time)
            changed = True
        if changed:
            self._probe_families = None

    def _build_event_families(self) -> list[Metric]:
        events = CounterMetricFamily(
            "gpuwarden_agent_events_total",
            "Events this agent process reported (count), by kind: xid, sxid, kernel.",
            labels=("kind",),
        )
        for kind, count in self._event_counts.items():
            events.add_metric([kind], float(count))
        families: list[Metric] = [events]
        if self._xid_counts:
            xid = CounterMetricFamily(
                "gpuwarden_gpu_xid_events_total",
                "XID errors this agent process reported (count), by GPU index and XID code; "
                'gpu is "" where the driver did not say which GPU.',
                labels=("gpu", "code"),
            )
            # Sorted so that the exposition is stable: by GPU (unknown last), then code.
            for (gpu, code), count in sorted(
                self._xid_counts.items(), key=lambda kv: (kv[0][0] is None, kv[0][0] or 0, kv[0][1])
            ):
                xid.add_metric(["" if gpu is None else str(gpu), str(code)], float(count))
            families.append(xid)
        last = GaugeMetricFamily(
            "gpuwarden_gpu_last_xid_code",
            "Code of the latest XID this agent process saw on the GPU, 0 before any (dcgm-exporter's "
            "DCGM_FI_DEV_XID_ERRORS); gpuwarden_gpu_xid_events_total counts them.",
            labels=_GPU_LABELS,
        )
        for index, uuid in sorted(self._gpu_uuids.items()):
            last.add_metric([str(index), uuid], float(self._last_xid.get(index, 0)))
        if last.samples:
            families.append(last)
        return families

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        with self._lock:
            if snap.cycle is not None:
                self._count_events(snap.cycle)
                if snap.cycle is not self._cycle:
                    self._cycle_families = _cycle_families(snap.cycle)
                    self._cycle = snap.cycle
                cycle_families = self._cycle_families
            else:
                cycle_families = []
            if self._event_families is None:
                self._event_families = self._build_event_families()
            event_families = self._event_families
            self._xid_scraped()
            if self._probe_families is None:
                self._probe_families = _probe_families(self._probes.last(), self._probes.runs())
            probe_families = self._probe_families
        yield InfoMetricFamily(
            "gpuwarden_agent", "The gpuwarden agent, value always 1.", value={"version": snap.version}
        )
        yield from cycle_families
        yield from event_families
        yield from probe_families
        if snap.shipper is not None:
            yield from _shipper_families(snap.shipper)


def make_registry(metrics: AgentMetrics, *, process_metrics: bool = True) -> CollectorRegistry:
    """A registry of its own (never the global one) with the agent's metrics.

    ``process_metrics`` adds the standard ``process_*`` series (CPU seconds, resident memory, open
    file descriptors) so the agent's own footprint on the node is visible.
    """
    registry = CollectorRegistry()
    registry.register(metrics)
    if process_metrics:
        ProcessCollector(registry=registry)
    return registry


@dataclass(frozen=True)
class MetricsServer:
    """The running ``/metrics`` HTTP server (a daemon thread)."""

    server: WSGIServer
    thread: threading.Thread
    address: str
    port: int  # the bound port: the real one when 0 (ephemeral) was asked for

    def shutdown(self) -> None:
        """Stop serving, close the socket and wait for the serving thread."""
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5.0)


def serve(addr: str, port: int, registry: CollectorRegistry) -> MetricsServer:
    """Serve ``registry`` over HTTP on ``addr:port`` (port 0: any free port) from a daemon thread.

    Raises ``ConfigError`` when the address cannot be listened on (bad address, port in use).
    """
    if not 0 <= port <= 65535:
        raise ConfigError(f"metrics port {port} is out of range 0-65535")
    try:
        server, thread = start_http_server(port, addr, registry=registry)
    except OSError as exc:
        raise ConfigError(f"cannot serve metrics on {addr}:{port}: {exc}") from exc
    host, bound = server.server_address[:2]
    log.info("metrics server listening", extra={"address": host, "port": bound})
    return MetricsServer(server=server, thread=thread, address=str(host), port=int(bound))
