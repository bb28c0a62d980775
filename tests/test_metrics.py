"""The agent's /metrics exposition: exact text, promtool-clean, nulls absent, served over HTTP.

Regenerate the golden file after an intended change with ``GPUWARDEN_UPDATE_GOLDEN=1 pytest
tests/test_metrics.py`` and review its diff.
"""

from __future__ import annotations

import os
import subprocess
import urllib.request
from pathlib import Path

import msgspec
import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent import metrics as agent_metrics
from agent.errors import ConfigError
from agent.metrics import (
    PROBE_FORGET_SECONDS,
    PROBE_PEERS_PER_KIND,
    AgentMetrics,
    AgentSnapshot,
    ProbeLedger,
    make_registry,
    serve,
)
from agent.report import CollectorError, Event, Gpu, GpuAllocation, Nic, NvLink, Probe, Report
from agent.state import CollectorStatus, CycleResult, ShipperStats
from tests.conftest import REPO, ci
from tests.test_prometheus_rules import promtool

GOLDEN = Path(__file__).parent / "fixtures" / "metrics" / "golden.prom"
T0 = 1_764_441_600.0


def _gpu(index: int, **overrides: object) -> Gpu:
    fields: dict[str, object] = {
        "index": index,
        "uuid": f"GPU-0000000{index}-1111-2222-3333-444444444444",
        "model": "NVIDIA H100 80GB HBM3",
        "pci_bus_id": f"0000:{0x18 + index:02x}:00",
        "utilization_ratio": 0.97,
        "memory_used_bytes": 79_000_000_000 + index,
        "memory_total_bytes": 85_520_809_984,
        "temperature_celsius": 61.0 + index,
        "memory_temperature_celsius": 70.0,
        "power_watts": 650.5,
        "power_limit_watts": 700.0,
        "energy_joules_total": 123_456_789.25,
        "sm_clock_hz": 1.98e9,
        "sm_clock_max_hz": 1.98e9,
        "memory_clock_hz": 2.619e9,
        "clock_event_reasons": 0x4 | 0x40,  # sw_power_cap + hw_thermal_slowdown
        "performance_state": 0,
        "ecc_sbe_volatile_total": 3,
        "ecc_dbe_volatile_total": 0,
        "ecc_sbe_aggregate_total": 17,
        "ecc_dbe_aggregate_total": 1,
        "retired_pages_sbe": 2,
        "retired_pages_dbe": 1,
        "retired_pages_pending": False,
        "remapped_rows_correctable": 4,
        "remapped_rows_uncorrectable": 1,
        "remapped_rows_pending": True,
        "remapped_rows_failure": False,
        "pcie_link_gen": 5,
        "pcie_link_gen_max": 5,
        "pcie_link_width": 16,
        "pcie_link_width_max": 16,
        "pcie_replay_total": 12,
        "driver_version": "550.90.07",
        "memory_utilization_ratio": 0.61,
        "gr_engine_active_ratio": 0.96,
        "sm_active_ratio": 0.91,
        "sm_occupancy_ratio": 0.375,
        "tensor_active_ratio": 0.625,
        "dram_active_ratio": 0.5,
        "pcie_tx_bytes_per_second": 1.25e9,
        "pcie_rx_bytes_per_second": 2.5e9,
        "nvlink_tx_bytes_per_second": 1.5e11,
        "nvlink_rx_bytes_per_second": 1.25e11,
        "nvlink": [
            NvLink(
                link=0,
                active=True,
                crc_flit_errors_total=5,
                crc_data_errors_total=0,
                replay_errors_total=2,
                recovery_errors_total=1,
            ),
            NvLink(link=1, active=False),
        ],
    }
    fields.update(overrides)
    return Gpu(**fields)  # type: ignore[arg-type]


# One of each outcome: a pair measured, a pair failed, the local probe (no peer), a pair skipped
# because the GPUs were busy (counted, but it measured nothing).
PROBES = [
    Probe(
        kind="tcp_pair",
        time=T0 - 40,
        ok=True,
        peer="gpu-0043",
        size_bytes=1 << 30,
        busbw_bytes_per_second=11.5e9,
        duration_seconds=0.2,
    ),
    Probe(kind="nccl_allreduce_pair", time=T0 - 30, ok=False, peer="gpu-0044", error="NCCL timeout"),
    Probe(
        kind="nccl_allreduce_local",
        time=T0 - 20,
        ok=True,
        size_bytes=1 << 30,
        busbw_bytes_per_second=480e9,
        duration_seconds=4.5,
    ),
    Probe(
        kind="nccl_allreduce_pair",
        time=T0 - 10,
        ok=False,
        peer="gpu-0045",
        error="skipped: GPUs busy: compute process 4242 on GPU 3",
    ),
]


def _snapshot(
    *, seq: int = 7, events: list[Event] | None = None, probes: list[Probe] | None = None, time: float = T0
) -> AgentSnapshot:
    report = Report(
        schema="gpuwarden/report/v1",
        node="gpu-0042",
        time=time,
        seq=seq,
        boot_id="5f1c3c1e-8c1a-4c2e-9f52-0d3a7b1e2f10",
        agent_version="0.1.0",
        interval_seconds=10.0,
        gpus=[
            _gpu(0),
            # Not supported on this GPU: must be absent from the exposition, not 0.
            _gpu(1, memory_temperature_celsius=None),
        ],
        nics=[
            Nic(
                device="mlx5_0",
                link_layer="InfiniBand",
                port=1,
                netdev="ib0",
                state="ACTIVE",
                phys_state="LinkUp",
                rate_bytes_per_second=5.0e10,
                rx_bytes_total=4_000_000_000_000,
                tx_bytes_total=3_900_000_000_000,
                rx_packets_total=1_000_000_000,
                tx_packets_total=990_000_000,
                counters={
                    "symbol_error": 2,
                    "link_downed": 1,
                    "port_rcv_errors": 0,
                    "port_xmit_wait": 123_456,
                    "VL15_dropped": 0,
                    "rnr_nak_retry_err": 0,
                    "out_of_buffer": 3,
                    "np_cnp_sent": 42,
                    "port_xmit_data": 1_000,  # 4-byte words
                    "port_rcv_packets": 77,
                    "vendor_specific_thing": 5,  # a driver counter the catalogue does not know
                },
            ),
            Nic(
                device="eth0",
                link_layer="Ethernet",
                netdev="eth0",
                state="down",
                rate_bytes_per_second=None,
                rx_bytes_total=10_000,
                tx_bytes_total=20_000,
                rx_packets_total=100,
                tx_packets_total=200,
                counters={"rx_errors": 1, "carrier_changes": 4},
            ),
        ],
        events=(
            [
                Event(kind="xid", time=T0 - 5, gpu=1, code=79, message="GPU has fallen off the bus"),
                Event(kind="xid", time=T0 - 4, gpu=0, code=13),
                Event(kind="xid", time=T0 - 3, gpu=None, code=48),
                Event(kind="kernel", time=T0 - 2, message="mlx5_core: cmd_exec timeout"),
            ]
            if events is None
            else events
        ),
        probes=PROBES if probes is None else probes,
        errors=[CollectorError(collector="infiniband", message="mlx5_1: counters unreadable")],
        # GPU 0 held by a training container (the kubelet's PodResources answer); GPU 1 by none.
        pods=(
            GpuAllocation(
                namespace="ml",
                pod="train-0",
                container="main",
                resource="nvidia.com/gpu",
                devices=("GPU-00000000-1111-2222-3333-444444444444",),
            ),
        ),
    )
    statuses = (
        CollectorStatus("nvml", supported=True, reason="", success=True, duration_seconds=0.0125),
        CollectorStatus("infiniband", supported=True, reason="", success=True, duration_seconds=0.002),
        CollectorStatus(
            "nvswitch", supported=False, reason="no NVSwitch", success=False, duration_seconds=0.0
        ),
    )
    shipper = ShipperStats(
        sent_total=120,
        rejected_total=1,
        failed_attempts_total=4,
        spooled_total=6,
        dropped_total=0,
        spool_depth=2,
        last_success_time=T0 - 10,
    )
    return AgentSnapshot(
        cycle=CycleResult(report=report, statuses=statuses), shipper=shipper, version="0.1.0"
    )


def _exposition(snapshot: AgentSnapshot) -> bytes:
    return generate_latest(make_registry(AgentMetrics(lambda: snapshot), process_metrics=False))


def _samples(text: bytes) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text.decode())
        for s in fam.samples
    }


def test_exposition_matches_golden_file() -> None:
    text = _exposition(_snapshot())
    if os.environ.get("GPUWARDEN_UPDATE_GOLDEN") == "1":
        if ci():
            pytest.fail(
                "GPUWARDEN_UPDATE_GOLDEN=1 under CI: the golden file is compared there, never rewritten"
            )
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_bytes(text)
        pytest.skip(f"rewrote {GOLDEN}: review its diff")
    assert text.decode() == GOLDEN.read_text(encoding="utf-8")


def test_metric_types_follow_the_field_catalogue() -> None:
    # Cumulative fields are Prometheus counters, the rest gauges; retired pages and remapped rows
    # are the one documented exception (public gauge names, agent/metrics.py says why).
    types = {fam.name: fam.type for fam in text_string_to_metric_families(_exposition(_snapshot()).decode())}
    assert types["gpuwarden_gpu_energy_joules"] == "counter"
    assert types["gpuwarden_gpu_ecc_errors"] == "counter"
    assert types["gpuwarden_gpu_pcie_replay"] == "counter"
    assert types["gpuwarden_gpu_nvlink_errors"] == "counter"
    assert types["gpuwarden_nic_receive_bytes"] == "counter"
    assert types["gpuwarden_gpu_temperature_celsius"] == "gauge"
    assert types["gpuwarden_gpu_pcie_link_width"] == "gauge"
    assert types["gpuwarden_gpu_remapped_rows_failure"] == "gauge"
    assert types["gpuwarden_gpu_retired_pages"] == "gauge"
    assert types["gpuwarden_gpu_remapped_rows"] == "gauge"


def test_promtool_finds_nothing_to_lint() -> None:
    # The live server adds the process_* families: lint those too.
    registry = make_registry(AgentMetrics(_snapshot), process_metrics=True)
    proc = subprocess.run(
        [promtool(), "check", "metrics"],
        input=generate_latest(registry),
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()
    assert proc.stdout.decode().strip() == "", proc.stdout.decode()


def test_every_family_has_help_and_a_gpuwarden_name() -> None:
    families = list(text_string_to_metric_families(_exposition(_snapshot()).decode()))
    assert families
    for fam in families:
        assert fam.name.startswith("gpuwarden_"), fam.name
        assert fam.documentation, f"{fam.name} has no HELP"
        for sample in fam.samples:
            assert "node" not in sample.labels and "hostname" not in sample.labels


def test_null_fields_produce_no_sample() -> None:
    samples = _samples(_exposition(_snapshot()))
    gpu0 = ("gpu", "0"), ("uuid", "GPU-00000000-1111-2222-3333-444444444444")
    gpu1 = ("gpu", "1"), ("uuid", "GPU-00000001-1111-2222-3333-444444444444")
    assert samples[("gpuwarden_gpu_memory_temperature_celsius", frozenset(gpu0))] == 70.0
    assert ("gpuwarden_gpu_memory_temperature_celsius", frozenset(gpu1)) not in samples
    assert samples[("gpuwarden_gpu_temperature_celsius", frozenset(gpu1))] == 62.0
    # An NVLink whose error counters are null has its active state and no error series.
    link1 = (*gpu0, ("link", "1"))
    assert samples[("gpuwarden_gpu_nvlink_active", frozenset(link1))] == 0.0
    assert not [k for k in samples if k[0] == "gpuwarden_gpu_nvlink_errors_total" and ("link", "1") in k[1]]
    eth0 = frozenset({("device", "eth0"), ("port", "")})
    assert ("gpuwarden_nic_link_speed_bytes", eth0) not in samples
    assert samples[("gpuwarden_nic_up", eth0)] == 0.0


def test_a_gpu_with_every_field_null_exports_only_its_identity() -> None:
    bare = Gpu(index=3, uuid="GPU-3")
    snap = _snapshot()
    assert snap.cycle is not None
    report = msgspec.structs.replace(snap.cycle.report, gpus=[bare], nics=[])
    cycle = CycleResult(report=report, statuses=())
    text = _exposition(AgentSnapshot(cycle=cycle))
    gpu_series = {name for name, labels in _samples(text) if ("uuid", "GPU-3") in labels}
    # The info series, and the latest XID code: 0, none seen (dcgm-exporter's XID_ERRORS).
    assert gpu_series == {"gpuwarden_gpu_info", "gpuwarden_gpu_last_xid_code"}
    assert b"gpuwarden_shipper" not in text  # no shipper, no shipper series


def test_an_unknown_performance_state_is_absent() -> None:
    snap = _snapshot()
    assert snap.cycle is not None
    # NVML_PSTATE_UNKNOWN (32) is "no answer", not a P-state deeper than 15.
    report = msgspec.structs.replace(snap.cycle.report, gpus=[_gpu(0, performance_state=32), _gpu(1)])
    text = _exposition(AgentSnapshot(cycle=CycleResult(report=report, statuses=())))
    pstates = {dict(labels)["gpu"]: v for (n, labels), v in _samples(text).items() if n.endswith("_state")}
    assert pstates == {"1": 0.0}


def test_clock_event_reasons_become_one_series_per_bit() -> None:
    samples = _samples(_exposition(_snapshot()))
    gpu0 = ("gpu", "0"), ("uuid", "GPU-00000000-1111-2222-3333-444444444444")
    active = {
        dict(labels)["reason"]: value
        for (name, labels), value in samples.items()
        if name == "gpuwarden_gpu_clock_event_reason_active" and set(gpu0) <= labels
    }
    assert {r for r, v in active.items() if v == 1.0} == {"sw_power_cap", "hw_thermal_slowdown"}
    assert len(active) == 9
    assert samples[("gpuwarden_gpu_clock_event_reasons", frozenset(gpu0))] == 0x44


def test_before_the_first_cycle_only_the_agent_is_described() -> None:
    text = _exposition(AgentSnapshot(version="9.9.9"))
    names = {name for name, _ in _samples(text)}
    assert ("gpuwarden_agent_info", frozenset({("version", "9.9.9")})) in _samples(text)
    assert not {n for n in names if n.startswith(("gpuwarden_gpu_", "gpuwarden_nic_"))}


def test_scrapes_follow_the_snapshot_as_cycles_change() -> None:
    first_snap = _snapshot(seq=1)
    current = [first_snap]
    registry = make_registry(AgentMetrics(lambda: current[0]), process_metrics=False)
    generate_latest(registry)  # the first scrape shows the new XID series at 0
    first = generate_latest(registry)
    assert generate_latest(registry) == first
    assert first_snap.cycle is not None
    report = msgspec.structs.replace(first_snap.cycle.report, seq=2, gpus=[_gpu(0, temperature_celsius=90.5)])
    current[0] = AgentSnapshot(cycle=CycleResult(report=report, statuses=first_snap.cycle.statuses))
    samples = _samples(generate_latest(registry))
    gpu0 = frozenset({("gpu", "0"), ("uuid", "GPU-00000000-1111-2222-3333-444444444444")})
    assert samples[("gpuwarden_gpu_temperature_celsius", gpu0)] == 90.5
    # GPU 1 left the report, so its series left the exposition (only event counts remember it).
    assert not [k for k in samples if ("gpu", "1") in k[1] and k[0] != "gpuwarden_gpu_xid_events_total"]


def _xid_series(metrics: AgentMetrics) -> dict[tuple[str, str], float]:
    text = generate_latest(make_registry(metrics, process_metrics=False))
    return {
        (dict(labels)["gpu"], dict(labels)["code"]): value
        for (name, labels), value in _samples(text).items()
        if name == "gpuwarden_gpu_xid_events_total"
    }


def _xid_counts(metrics: AgentMetrics) -> dict[tuple[str, str], float]:
    return {key: value for key, value in _xid_series(metrics).items() if value}


def test_an_xid_counter_is_seen_at_zero_before_its_first_event() -> None:
    # increase() counts nothing for a series whose first sample is already 1, so every XID series
    # is in one scrape at 0 before its first event counts.
    no_events = _snapshot(seq=1, events=[])
    current = [no_events]
    metrics = AgentMetrics(lambda: current[0])
    first = _xid_series(metrics)
    # Each GPU has the codes the rules act on at 0 from its first cycle on.
    declared = {str(c) for c in agent_metrics.XID_CODES_PREDECLARED}
    assert {code for gpu, code in first if gpu == "1"} == declared
    assert set(first.values()) == {0.0}

    # A predeclared code, already shown: counted at once.
    current[0] = _snapshot(seq=2, events=[Event(kind="xid", time=T0, gpu=1, code=79)])
    assert _xid_series(metrics)[("1", "79")] == 1.0
    # A code nobody declared: at 0 in the next scrape, counted from the one after; never lost.
    current[0] = _snapshot(seq=3, events=[Event(kind="xid", time=T0, gpu=0, code=61)] * 2)
    assert _xid_series(metrics)[("0", "61")] == 0.0
    assert _xid_series(metrics)[("0", "61")] == 2.0
    assert _xid_series(metrics)[("0", "61")] == 2.0


def test_the_first_cycle_s_xid_waits_for_its_zero_to_be_scraped() -> None:
    # The agent's first report may carry an XID already (the fake delivers its file's at once).
    current = [_snapshot(seq=1, events=[Event(kind="xid", time=T0, gpu=1, code=79)])]
    metrics = AgentMetrics(lambda: current[0])
    assert _xid_series(metrics)[("1", "79")] == 0.0
    assert _xid_series(metrics)[("1", "79")] == 1.0


def _last_xid(metrics: AgentMetrics) -> dict[str, float]:
    text = generate_latest(make_registry(metrics, process_metrics=False))
    return {
        dict(labels)["gpu"]: value
        for (name, labels), value in _samples(text).items()
        if name == "gpuwarden_gpu_last_xid_code"
    }


def test_the_last_xid_code_per_gpu_is_a_gauge_from_zero() -> None:
    current = [_snapshot(seq=1, events=[])]
    metrics = AgentMetrics(lambda: current[0])
    assert _last_xid(metrics) == {"0": 0.0, "1": 0.0}
    current[0] = _snapshot(
        seq=2, events=[Event(kind="xid", time=T0, gpu=1, code=79), Event(kind="xid", time=T0, gpu=1, code=48)]
    )
    assert _last_xid(metrics) == {"0": 0.0, "1": 48.0}
    current[0] = _snapshot(seq=3, events=[])
    assert _last_xid(metrics) == {"0": 0.0, "1": 48.0}  # the last one seen, until the next


def test_the_predeclared_xid_codes_cover_the_codes_the_rules_act_on() -> None:
    rules = yaml.safe_load((REPO / "rules" / "xid.yaml").read_text())["rules"]
    codes = {c for rule in rules for c in rule.get("codes", ()) if isinstance(c, int)}
    assert codes <= set(agent_metrics.XID_CODES_PREDECLARED), sorted(codes)


def test_xid_events_are_counted_once_per_cycle() -> None:
    xid79 = Event(kind="xid", time=T0, gpu=1, code=79)
    current = [_snapshot(seq=1, events=[xid79, xid79])]
    metrics = AgentMetrics(lambda: current[0])
    assert _xid_counts(metrics) == {}  # the first scrape shows the series at 0
    assert _xid_counts(metrics) == {("1", "79"): 2.0}
    # The same cycle scraped again counts nothing more.
    assert _xid_counts(metrics) == {("1", "79"): 2.0}

    current[0] = _snapshot(seq=2, events=[xid79, Event(kind="xid", time=T0, gpu=0, code=48)])
    assert _xid_counts(metrics) == {("0", "48"): 1.0, ("1", "79"): 3.0}  # shown already: at once

    # Cycles handed over by the runner between scrapes are counted, each once, whichever
    # path (record_cycle or a scrape) sees them first; an older cycle counts nothing.
    seq3 = _snapshot(seq=3, events=[xid79])
    seq4 = _snapshot(seq=4, events=[xid79])
    assert seq3.cycle is not None and seq4.cycle is not None
    metrics.record_cycle(seq3.cycle)
    metrics.record_cycle(seq4.cycle)
    current[0] = seq4
    assert _xid_counts(metrics) == {("0", "48"): 1.0, ("1", "79"): 5.0}
    metrics.record_cycle(seq3.cycle)
    metrics.record_cycle(seq4.cycle)
    assert _xid_counts(metrics) == {("0", "48"): 1.0, ("1", "79"): 5.0}

    kinds = {
        dict(labels)["kind"]: value
        for (name, labels), value in _samples(
            generate_latest(make_registry(metrics, process_metrics=False))
        ).items()
        if name == "gpuwarden_agent_events_total"
    }
    assert kinds == {"xid": 6.0, "sxid": 0.0, "kernel": 0.0}


def _probe_series(metrics: AgentMetrics) -> dict[str, dict[tuple[str, str], float]]:
    """gpuwarden_probe_* family -> {(kind, peer or result): value}."""
    out: dict[str, dict[tuple[str, str], float]] = {}
    for (name, labels), value in _samples(
        generate_latest(make_registry(metrics, process_metrics=False))
    ).items():
        if name.startswith("gpuwarden_probe_"):
            d = dict(labels)
            out.setdefault(name, {})[(d["kind"], d.get("peer", d.get("result", "")))] = value
    return out


def _probe(kind: str, peer: str | None, t: float, bw: float | None = None, error: str | None = None) -> Probe:
    return Probe(kind=kind, time=t, ok=error is None, peer=peer, busbw_bytes_per_second=bw, error=error)  # type: ignore[arg-type]


def test_probe_results_become_the_last_result_per_kind_and_peer() -> None:
    series = _probe_series(AgentMetrics(_snapshot))
    # The failed pair has a time and ok=0 but no bandwidth; the local probe has peer "".
    assert series["gpuwarden_probe_last_bandwidth_bytes_per_second"] == {
        ("tcp_pair", "gpu-0043"): 11.5e9,
        ("nccl_allreduce_local", ""): 480e9,
    }
    assert series["gpuwarden_probe_last_ok"] == {
        ("tcp_pair", "gpu-0043"): 1.0,
        ("nccl_allreduce_pair", "gpu-0044"): 0.0,
        ("nccl_allreduce_local", ""): 1.0,
    }
    assert series["gpuwarden_probe_last_timestamp_seconds"][("nccl_allreduce_pair", "gpu-0044")] == T0 - 30
    # The skipped probe is counted but is no measurement of gpu-0045: no last-result series for it.
    assert ("nccl_allreduce_pair", "gpu-0045") not in series["gpuwarden_probe_last_timestamp_seconds"]
    runs = series["gpuwarden_probe_runs_total"]
    assert runs[("nccl_allreduce_pair", "skipped")] == 1.0
    assert runs[("nccl_allreduce_pair", "failed")] == 1.0
    assert runs[("nccl_allreduce_pair", "ok")] == 0.0  # present from the kind's first result on
    assert runs[("tcp_pair", "ok")] == 1.0


def test_a_later_failure_removes_the_bandwidth_and_an_older_result_changes_nothing() -> None:
    current = [_snapshot(seq=1, probes=[_probe("tcp_pair", "b", T0 - 5, bw=9e9)])]
    metrics = AgentMetrics(lambda: current[0])
    assert _probe_series(metrics)["gpuwarden_probe_last_bandwidth_bytes_per_second"] == {
        ("tcp_pair", "b"): 9e9
    }

    # The next report has a failure of the same pair, and (out of order) an older success.
    current[0] = _snapshot(
        seq=2,
        time=T0 + 10,
        probes=[
            _probe("tcp_pair", "b", T0 + 5, error="connection refused"),
            _probe("tcp_pair", "b", T0, bw=8e9),
        ],
    )
    series = _probe_series(metrics)
    assert "gpuwarden_probe_last_bandwidth_bytes_per_second" not in series
    assert series["gpuwarden_probe_last_ok"] == {("tcp_pair", "b"): 0.0}
    assert series["gpuwarden_probe_last_timestamp_seconds"] == {("tcp_pair", "b"): T0 + 5}
    # Both results of the report counted, once, however often it is scraped.
    assert _probe_series(metrics)["gpuwarden_probe_runs_total"] == {
        ("tcp_pair", "ok"): 2.0,
        ("tcp_pair", "failed"): 1.0,
        ("tcp_pair", "skipped"): 0.0,
    }

    # A busy node's skip neither counts as a failure nor hides the last measurement.
    current[0] = _snapshot(
        seq=3, time=T0 + 20, probes=[_probe("tcp_pair", "b", T0 + 15, error="stepped aside: a job started")]
    )
    series = _probe_series(metrics)
    assert series["gpuwarden_probe_last_timestamp_seconds"] == {("tcp_pair", "b"): T0 + 5}
    assert series["gpuwarden_probe_runs_total"][("tcp_pair", "skipped")] == 1.0
    assert series["gpuwarden_probe_runs_total"][("tcp_pair", "failed")] == 1.0


def test_probe_peers_are_bounded_per_kind_and_forgotten_after_an_hour() -> None:
    n = PROBE_PEERS_PER_KIND + 8
    current = [
        _snapshot(
            seq=1,
            probes=[
                *(_probe("tcp_pair", f"peer-{i:02d}", T0 - n + i, bw=1e9 + i) for i in range(n)),
                _probe("nccl_allreduce_local", None, T0 - n, bw=4e11),
            ],
        )
    ]
    metrics = AgentMetrics(lambda: current[0])
    ts = _probe_series(metrics)["gpuwarden_probe_last_timestamp_seconds"]
    tcp_peers = {peer for kind, peer in ts if kind == "tcp_pair"}
    # The most recently probed peers stay; another kind's entries do not count against the bound.
    assert tcp_peers == {f"peer-{i:02d}" for i in range(8, n)}
    assert ("nccl_allreduce_local", "") in ts

    # An hour later, with one fresh result, only that peer is left; the counters remember them all.
    later = T0 + PROBE_FORGET_SECONDS + 1
    metrics.record_cycle(
        _snapshot(seq=2, time=later, probes=[_probe("tcp_pair", "peer-00", later - 1, bw=2e9)]).cycle  # type: ignore[arg-type]
    )
    series = _probe_series(metrics)
    assert series["gpuwarden_probe_last_timestamp_seconds"] == {("tcp_pair", "peer-00"): later - 1}
    assert series["gpuwarden_probe_runs_total"][("tcp_pair", "ok")] == n + 1
    # A result older than the hour when it arrives (a long-delayed report) is counted, not kept.
    ledger = ProbeLedger()
    ledger.add(_probe("tcp_pair", "x", T0, bw=1e9), now=later)
    assert ledger.last() == ()
    assert ledger.runs()[("tcp_pair", "ok")] == 1


def test_probe_ledger_refuses_a_bound_that_cannot_hold_a_peer() -> None:
    with pytest.raises(ValueError, match="max_peers 0"):
        ProbeLedger(max_peers=0)


def test_serve_answers_a_real_scrape() -> None:
    snapshot = _snapshot()
    server = serve("127.0.0.1", 0, make_registry(AgentMetrics(lambda: snapshot), process_metrics=False))
    try:
        assert server.port > 0
        # No proxy: an http_proxy in the environment must not intercept a loopback scrape.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            body = resp.read()
    finally:
        server.shutdown()
    assert body == GOLDEN.read_bytes()
    assert not server.thread.is_alive()


def test_serve_refuses_an_address_it_cannot_use() -> None:
    registry = make_registry(AgentMetrics(AgentSnapshot), process_metrics=False)
    with pytest.raises(ConfigError, match="out of range"):
        serve("127.0.0.1", 70000, registry)
    first = serve("127.0.0.1", 0, registry)
    try:
        with pytest.raises(ConfigError, match=f"127.0.0.1:{first.port}"):
            serve("127.0.0.1", first.port, registry)
    finally:
        first.shutdown()


def test_a_catalogued_field_without_a_metric_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    families = tuple(f for f in agent_metrics._GPU_FAMILIES if f.name != "gpuwarden_gpu_power_watts")
    monkeypatch.setattr(agent_metrics, "_GPU_FAMILIES", families)
    with pytest.raises(TypeError, match="power_watts"):
        agent_metrics._check_families()


def test_nic_counters_are_split_by_unit_and_words_are_bytes() -> None:
    samples = _samples(_exposition(_snapshot()))
    by_family: dict[str, dict[str, float]] = {}
    for (name, labels), value in samples.items():
        if name.startswith("gpuwarden_nic_stat"):
            by_family.setdefault(name, {})[dict(labels)["stat"]] = value
    assert by_family == {
        # IBTA's port_xmit_data counts 4-byte words: 1,000 words are 4,000 bytes.
        "gpuwarden_nic_stat_bytes_total": {"port_xmit_data": 4000.0},
        "gpuwarden_nic_stat_packets_total": {"port_rcv_packets": 77.0},
        "gpuwarden_nic_stat_errors_total": {"rx_errors": 1.0},
        "gpuwarden_nic_stat_events_total": {"np_cnp_sent": 42.0, "carrier_changes": 4.0},
        "gpuwarden_nic_stat_total": {"vendor_specific_thing": 5.0},  # unit unknown
    }
