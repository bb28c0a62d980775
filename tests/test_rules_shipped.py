"""Every shipped rule fires on a report that shows its fault, and stays silent on a healthy node and
on the look-alikes that fool naive checks: application XIDs, a reboot (counters go back to zero:
not a negative rate, not a burst), an idle GPU lowering its PCIe generation, a link flap shorter
than the rule's ``for:``, a burst right after boot.

The scenarios are a table: one entry per shipped rule, so a rule added without tests fails
``test_every_shipped_rule_has_a_scenario``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest

from agent.report import CollectorError, Event, Nic, Report
from aggregator.model import Finding
from aggregator.rules import RateRule, RuleEngine, default_rules_dir, load_rules
from aggregator.rules.model import Rule
from tests.rulekit import (
    EDR_BYTES_PER_SECOND,
    T0,
    ListView,
    edit_gpu,
    edit_nic,
    feed,
    final,
    gpu,
    ib_port,
    keys,
    netdev,
    nvlinks,
    report,
    rules_from_yaml,
    timeline,
    xid,
)

SHIPPED: dict[str, Rule] = {r.name: r for r in load_rules([default_rules_dir()])}

Build = Callable[[], list[Report]]


@dataclass
class Scenario:
    fires: Build  # the fault: the rule is active after the last report
    key: str  # the finding's key then
    lookalikes: dict[str, Build] = field(default_factory=dict)  # never active at any report


def engine_for(name: str) -> RuleEngine:
    return RuleEngine([SHIPPED[name]])


def series(
    count: int, edit: Callable[[int, Report], Report], *, every: float = 10.0, boot_at: int | None = None
) -> Build:
    """``count`` reports ``every`` seconds apart, each passed through ``edit(i, report)``;
    from report ``boot_at`` on the node runs a new boot."""

    def build() -> list[Report]:
        def make(i: int, t: float) -> Report:
            boot = "boot-b" if boot_at is not None and i >= boot_at else "boot-a"
            return edit(i, report(t, seq=i, boot_id=boot))

        return timeline(count, make, every=every)

    return build


def set_counter(rep: Report, rule: RateRule, value: int) -> Report:
    """Set a rate rule's counter on its first subject: GPU 0 (its links) or mlx5_0 port 1."""
    if rule.target == "gpu":
        return edit_gpu(rep, 0, **{rule.field: value})
    if rule.target == "nvlink":
        return edit_gpu(rep, 0, nvlink=nvlinks(**{rule.field: value}))
    return edit_nic(rep, "mlx5_0", **{f"c_{rule.field}": value})


def counter(
    name: str, values: Callable[[int], int], count: int, *, every: float = 10.0, boot_at: int | None = None
) -> Build:
    rule = SHIPPED[name]
    assert isinstance(rule, RateRule)
    return series(count, lambda i, r: set_counter(r, rule, values(i)), every=every, boot_at=boot_at)


def reboot_drop(name: str) -> Build:
    """The counter is high and steady, then the node reboots and it starts again from zero."""
    return counter(name, lambda i: 0 if i >= 20 else 5_000_000, 40, every=30.0, boot_at=20)


def step(at: int, low: int = 0, high: int = 1) -> Callable[[int], int]:
    return lambda i: high if i >= at else low


def stepping(name: str, subject: str, counter_word: str) -> Scenario:
    """A counter rule that fires on one step of its counter and not on a reboot zeroing it."""
    return Scenario(
        fires=counter(name, step(10), 20),
        key=f"{name}:{subject}",
        lookalikes={f"a reboot zeroes the {counter_word}": reboot_drop(name)},
    )


def climbing(name: str, per_report: int, counter_word: str, trickle: str) -> Scenario:
    """A GPU rate rule that fires on its counter climbing ``per_report`` a report, and neither
    on a reboot zeroing it nor on a trickle of one a report."""
    return Scenario(
        fires=counter(name, lambda i: per_report * i, 40),
        key=f"{name}:gpu0",
        lookalikes={
            f"a reboot zeroes the {counter_word}": reboot_drop(name),
            trickle: counter(name, lambda i: i, 40),
        },
    )


def with_event(code: int, at: int, gpu_index: int = 3, count: int = 6) -> Build:
    return series(count, lambda i, r: _events(r, [xid(code, gpu_index, r.time)]) if i == at else r)


def _events(rep: Report, events: list[Event]) -> Report:
    return msgspec.structs.replace(rep, events=events)


def xid_at(times: dict[int, list[tuple[int, int]]], count: int, every: float) -> Build:
    """Reports ``every`` seconds apart; at report i, XIDs (code, gpu) from ``times[i]``."""
    return series(
        count,
        lambda i, r: _events(r, [xid(c, g, r.time) for c, g in times[i]]) if i in times else r,
        every=every,
    )


def gpu_series(
    index: int, count: int, fields: Callable[[int], dict[str, object]], every: float = 10.0
) -> Build:
    return series(count, lambda i, r: edit_gpu(r, index, **fields(i)), every=every)


def nic_series(
    device: str, count: int, fields: Callable[[int], dict[str, object]], every: float = 10.0
) -> Build:
    return series(count, lambda i, r: edit_nic(r, device, **fields(i)), every=every)


def with_errors(*messages: str | CollectorError) -> Build:
    errors = [
        m if isinstance(m, CollectorError) else CollectorError(collector="nvml", message=m) for m in messages
    ]
    return series(4, lambda i, r: msgspec.structs.replace(r, errors=errors) if i == 3 else r)


def without_gpu(index: int, from_report: int, count: int = 6, boot_at: int | None = None) -> Build:
    def edit(i: int, r: Report) -> Report:
        if i < from_report:
            return r
        return msgspec.structs.replace(r, gpus=[g for g in r.gpus if g.index != index])

    return series(count, edit, boot_at=boot_at)


# --- the table -------------------------------------------------------------------------------

XID_NODE_OUT = {
    "xid-48": 48,
    "xid-62": 62,
    "xid-64": 64,
    "xid-74": 74,
    "xid-79": 79,
    "xid-95": 95,
    "xid-119": 119,
    "xid-120": 120,
    "xid-140": 140,
    "xid-nvlink5": 147,
    "xid-92": 92,
    "xid-94": 94,
}

# XID 154's text (NVIDIA's recovery actions: NVML_GPU_RECOVERY_ACTION_*), with the action it changed to.
_RECOVERY = "GPU recovery action changed from 0x0 (None) to {}"

SCENARIOS: dict[str, Scenario] = {
    **{
        name: Scenario(
            fires=with_event(code, at=2),
            key=f"{name}:gpu3",
            lookalikes={
                "application XID 13 on the same GPU": with_event(13, at=2),
                "application XID 43 on the same GPU": with_event(43, at=2),
                "another XID": with_event(63 if code != 63 else 62, at=2),
            },
        )
        for name, code in XID_NODE_OUT.items()
    },
    "xid-154": Scenario(
        fires=series(
            4,
            lambda i, r: (
                _events(r, [xid(154, 3, r.time, _RECOVERY.format("0x1 (GPU Reset Required)"))])
                if i == 2
                else r
            ),
        ),
        key="xid-154:gpu3",
        lookalikes={
            "recovered: the action back to None": series(
                4,
                lambda i, r: (
                    _events(r, [xid(154, 3, r.time, _RECOVERY.format("0x0 (None)"))]) if i == 2 else r
                ),
            ),
            "another XID": with_event(63, at=2),
        },
    ),
    "xid-app": Scenario(
        fires=with_event(13, at=5),
        key="xid-app:gpu3",
        lookalikes={"XID 79 is not an application error": with_event(79, at=5)},
    ),
    "xid-app-repeat": Scenario(
        # XID 13 on GPU 2 three times, 15 minutes apart (reports every 5 minutes).
        fires=xid_at({0: [(13, 2)], 3: [(13, 2)], 6: [(13, 2)]}, count=7, every=300.0),
        key="xid-app-repeat:gpu2",
        lookalikes={
            "one burst, three lines within minutes": xid_at(
                {0: [(13, 2), (13, 2)], 1: [(13, 2)]}, count=7, every=300.0
            ),
            "the job's bug on other GPUs too": xid_at(
                {0: [(13, 2)], 3: [(13, 2), (13, 5)], 6: [(13, 2)]}, count=7, every=300.0
            ),
            "three times, but over 8 hours": xid_at(
                {0: [(13, 2)], 1: [(13, 2)], 2: [(13, 2)]}, count=3, every=4 * 3600.0
            ),
            "different GPUs each time": xid_at(
                {0: [(13, 1)], 3: [(13, 2)], 6: [(13, 4)]}, count=7, every=300.0
            ),
        },
    ),
    "gpu-missing": Scenario(
        fires=without_gpu(5, from_report=3),
        key="gpu-missing:gpu5",
        lookalikes={
            "a reboot that comes up with 7 GPUs": without_gpu(5, from_report=3, boot_at=3),
            "a node that always had 7 GPUs": without_gpu(5, from_report=0),
        },
    ),
    "gpu-lost": Scenario(
        # As agent/collectors/nvml.py says it: the rule reads the code and the index, not the words.
        fires=with_errors(
            CollectorError(collector="nvml", message="GPU 3 fell off the bus", code="gpu_lost", gpu=3)
        ),
        key="gpu-lost:gpu3",
        lookalikes={
            "another NVML error": with_errors(
                CollectorError(
                    collector="nvml", message="GPU 3: 1 unreadable: power: Timeout", code="unreadable", gpu=3
                ),
                "GPU 4: Not Supported",
            ),
            "words that mention a lost GPU, another code": with_errors(
                CollectorError(collector="nvml", message="GPU 3: GPU is lost?", code="unreadable", gpu=3)
            ),
            "another collector": with_errors(
                CollectorError(collector="infiniband", message="mlx5_0: GPU is lost", code="gpu_lost")
            ),
        },
    ),
    "gpu-reset-required": Scenario(
        # As agent/collectors/nvml.py says it when NVML answers RESET_REQUIRED.
        fires=with_errors(
            CollectorError(
                collector="nvml",
                message="GPU 5 (GPU-5, 00000000:AB:00.0): GPU requires a reset (NVML_ERROR_RESET_REQUIRED)",
                code="reset_required",
                gpu=5,
            )
        ),
        key="gpu-reset-required:gpu5",
        lookalikes={
            "a GPU lost, not waiting for a reset": with_errors(
                CollectorError(collector="nvml", message="GPU 5: GPU is lost", code="gpu_lost", gpu=5)
            ),
            "an unreadable field, in words that mention a reset": with_errors(
                CollectorError(
                    collector="nvml",
                    message="GPU 5: 1 unreadable: power: GPU requires restart",
                    code="unreadable",
                    gpu=5,
                )
            ),
        },
    ),
    "ib-device-vanished": Scenario(
        # As agent/collectors/vanished.py says it, every cycle the device stays gone.
        fires=with_errors(
            CollectorError(
                collector="infiniband",
                message="vanished: RDMA device mlx5_3 port 1 was present earlier and is gone",
            )
        ),
        key="ib-device-vanished:infiniband",
        lookalikes={
            "an unreadable counter": with_errors(
                CollectorError(collector="infiniband", message="mlx5_3/1: 1 unreadable: rate: EIO")
            ),
            "a netdev that vanished": with_errors(
                CollectorError(collector="netdev", message="vanished: network interface eth3 was present")
            ),
        },
    ),
    "netdev-vanished": Scenario(
        fires=with_errors(
            CollectorError(
                collector="netdev",
                message="vanished: network interface eth3 was present earlier and is gone",
            )
        ),
        key="netdev-vanished:netdev",
        lookalikes={
            "an RDMA device that vanished": with_errors(
                CollectorError(collector="infiniband", message="vanished: RDMA device mlx5_3 port 1")
            ),
        },
    ),
    "gpu-ecc-uncorrectable": Scenario(
        fires=gpu_series(4, 3, lambda i: {"ecc_dbe_volatile_total": 2 if i == 2 else 0}),
        key="gpu-ecc-uncorrectable:gpu4",
        lookalikes={
            "many corrected errors": gpu_series(4, 3, lambda i: {"ecc_sbe_volatile_total": 500 * i}),
            "uncorrectable before the last reset": gpu_series(4, 3, lambda i: {"ecc_dbe_aggregate_total": 7}),
            "ECC unsupported": gpu_series(4, 3, lambda i: {"ecc_dbe_volatile_total": None}),
        },
    ),
    "gpu-row-remap-failure": Scenario(
        fires=gpu_series(1, 2, lambda i: {"remapped_rows_failure": True}),
        key="gpu-row-remap-failure:gpu1",
        lookalikes={
            "a remapping pending": gpu_series(1, 2, lambda i: {"remapped_rows_pending": True}),
            "row remapping unsupported": gpu_series(1, 2, lambda i: {"remapped_rows_failure": None}),
        },
    ),
    "gpu-row-remap-pending": Scenario(
        fires=gpu_series(1, 2, lambda i: {"remapped_rows_pending": True, "remapped_rows_uncorrectable": 1}),
        key="gpu-row-remap-pending:gpu1",
        lookalikes={
            "rows remapped earlier and active": gpu_series(
                1, 2, lambda i: {"remapped_rows_uncorrectable": 3, "remapped_rows_correctable": 2}
            )
        },
    ),
    "gpu-page-retirement-pending": Scenario(
        fires=gpu_series(7, 2, lambda i: {"retired_pages_pending": True, "retired_pages_dbe": 1}),
        key="gpu-page-retirement-pending:gpu7",
        lookalikes={
            "pages retired earlier": gpu_series(
                7, 2, lambda i: {"retired_pages_dbe": 2, "retired_pages_pending": False}
            )
        },
    ),
    "gpu-pcie-width-degraded": Scenario(
        fires=gpu_series(1, 40, lambda i: {"pcie_link_width": 8}),
        key="gpu-pcie-width-degraded:gpu1",
        lookalikes={
            "idle GPU at a lower PCIe generation": gpu_series(
                1, 40, lambda i: {"pcie_link_gen": 1, "utilization_ratio": 0.0}
            ),
            "x8 for two minutes while the link retrains": gpu_series(
                1, 40, lambda i: {"pcie_link_width": 8 if 5 <= i < 17 else 16}
            ),
            "maximum width unknown": gpu_series(
                1, 40, lambda i: {"pcie_link_width": 8, "pcie_link_width_max": None}
            ),
        },
    ),
    "gpu-pcie-replay-rate": climbing("gpu-pcie-replay-rate", 50, "counter", "a few replays a minute"),
    "gpu-clocks-held-down": Scenario(
        fires=gpu_series(6, 70, lambda i: {"clock_event_reasons": 0x8 | 0x4, "utilization_ratio": 0.95}),
        key="gpu-clocks-held-down:gpu6",
        lookalikes={
            "software power cap under load": gpu_series(6, 70, lambda i: {"clock_event_reasons": 0x4}),
            "hardware slowdown while idle": gpu_series(
                6, 70, lambda i: {"clock_event_reasons": 0x8, "utilization_ratio": 0.02}
            ),
            "hardware slowdown in a third of the samples": gpu_series(
                6, 70, lambda i: {"clock_event_reasons": 0x40 if i % 3 == 0 else 0}
            ),
            "idle clocks": gpu_series(
                6, 70, lambda i: {"clock_event_reasons": 0x1, "utilization_ratio": 0.0}
            ),
        },
    ),
    "gpu-power-brake": Scenario(
        fires=gpu_series(3, 70, lambda i: {"clock_event_reasons": 0x80 | 0x1, "utilization_ratio": 0.0}),
        key="gpu-power-brake:gpu3",
        lookalikes={
            "power brake in a third of the samples": gpu_series(
                3, 70, lambda i: {"clock_event_reasons": 0x80 if i % 3 == 0 else 0}
            ),
            "hardware thermal slowdown at idle": gpu_series(
                3, 70, lambda i: {"clock_event_reasons": 0x40, "utilization_ratio": 0.0}
            ),
            "software power cap": gpu_series(3, 70, lambda i: {"clock_event_reasons": 0x4}),
        },
    ),
    "gpu-temperature-high": Scenario(
        fires=gpu_series(2, 40, lambda i: {"temperature_celsius": 88.0}),
        key="gpu-temperature-high:gpu2",
        lookalikes={
            "hot for two minutes": gpu_series(
                2, 40, lambda i: {"temperature_celsius": 88.0 if i < 12 else 70.0}
            ),
            "warm": gpu_series(2, 40, lambda i: {"temperature_celsius": 84.5}),
        },
    ),
    # 18 links x 20/s
    "nvlink-crc-flit": climbing("nvlink-crc-flit", 200, "counters", "a trickle of CRC errors"),
    "nvlink-crc-data": climbing("nvlink-crc-data", 200, "counters", "a trickle of CRC errors"),
    "nvlink-recovery": stepping("nvlink-recovery", "gpu0", "counters"),
    "nvlink-replay": stepping("nvlink-replay", "gpu0", "counters"),
    "ib-port-down": Scenario(
        fires=nic_series(
            "mlx5_3", 10, lambda i: {"state": "DOWN", "phys_state": "Polling"} if i >= 3 else {}
        ),
        key="ib-port-down:mlx5_3/1",
        lookalikes={
            "a flap shorter than for:": nic_series(
                "mlx5_3", 10, lambda i: {"state": "DOWN", "phys_state": "Polling"} if i == 3 else {}
            ),
            "an IPoIB netdev down": series(
                10, lambda i, r: _add_nics(r, [netdev("ib0", link_layer="InfiniBand", state="down")])
            ),
            "state unreadable": nic_series("mlx5_3", 10, lambda i: {"state": None}),
            # A port the node does not use: never ACTIVE, never a packet received.
            "a port never up and never receiving": nic_series(
                "mlx5_3", 10, lambda i: {"state": "DOWN", "phys_state": "Polling", "rx_packets_total": 0}
            ),
            # After a reboot the port waits in INIT for the subnet manager's sweep.
            "INIT for 30 s after a reboot": series(
                10,
                lambda i, r: edit_nic(r, "mlx5_3", state="INIT", rx_packets_total=0) if 3 <= i < 6 else r,
                boot_at=3,
            ),
        },
    ),
    "ib-port-not-active": Scenario(
        fires=series(
            40,
            lambda i, r: edit_nic(r, "mlx5_2", state="INIT", rx_packets_total=0) if i >= 3 else r,
            boot_at=3,
        ),
        key="ib-port-not-active:mlx5_2/1",
        lookalikes={
            "INIT for 2 minutes after a reboot": series(
                40,
                lambda i, r: edit_nic(r, "mlx5_2", state="INIT", rx_packets_total=0) if 3 <= i < 15 else r,
                boot_at=3,
            ),
        },
    ),
    "ib-link-downed": Scenario(
        fires=counter("ib-link-downed", step(10, 1, 2), 20),
        key="ib-link-downed:mlx5_0/1",
        lookalikes={"a reboot zeroes the counter": reboot_drop("ib-link-downed")},
    ),
    "ib-link-flapping": Scenario(
        # Reports every 30 s; link downs at 20, 25 and 27.5 minutes.
        fires=counter("ib-link-flapping", lambda i: 1 + (i >= 40) + (i >= 50) + (i >= 55), 70, every=30.0),
        key="ib-link-flapping:mlx5_0/1",
        lookalikes={
            "a single flap": counter("ib-link-flapping", step(40, 1, 2), 70, every=30.0),
            "a leaf switch that rebooted twice, 8 minutes apart": counter(
                "ib-link-flapping", lambda i: 1 + (i >= 40) + (i >= 56), 70, every=30.0
            ),
            "two flaps 40 minutes apart": counter(
                "ib-link-flapping", lambda i: 1 + (i >= 10) + (i >= 90), 120, every=30.0
            ),
        },
    ),
    "ib-symbol-errors": Scenario(
        # 30 errors every 30 s: 3600/hour, above the 1440/hour budget of a 400 Gb/s port.
        fires=counter("ib-symbol-errors", lambda i: 30 * i, 70, every=30.0),
        key="ib-symbol-errors:mlx5_0/1",
        lookalikes={
            "720/hour on a 400 Gb/s port": counter("ib-symbol-errors", lambda i: 6 * i, 70, every=30.0),
            "a reboot zeroes the counter": reboot_drop("ib-symbol-errors"),
            "a burst right after boot": counter(
                "ib-symbol-errors", lambda i: 0 if i < 21 else 200, 40, every=30.0, boot_at=20
            ),
        },
    ),
    "ib-link-error-recovery": stepping("ib-link-error-recovery", "mlx5_0/1", "counter"),
    "ib-local-link-integrity": stepping("ib-local-link-integrity", "mlx5_0/1", "counter"),
    "ib-excessive-buffer-overrun": stepping("ib-excessive-buffer-overrun", "mlx5_0/1", "counter"),
    "ib-port-rcv-errors": Scenario(
        fires=counter("ib-port-rcv-errors", lambda i: i, 70, every=30.0),  # 120/hour
        key="ib-port-rcv-errors:mlx5_0/1",
        lookalikes={
            "five in half an hour": counter("ib-port-rcv-errors", lambda i: min(i // 10, 5), 70, every=30.0),
            "a reboot zeroes the counter": reboot_drop("ib-port-rcv-errors"),
        },
    ),
    "ib-port-xmit-discards": Scenario(
        fires=counter("ib-port-xmit-discards", lambda i: 10 * i, 70, every=30.0),  # 1200/hour
        key="ib-port-xmit-discards:mlx5_0/1",
        lookalikes={
            "a few congestion discards": counter("ib-port-xmit-discards", lambda i: i // 3, 70, every=30.0),
            "a reboot zeroes the counter": reboot_drop("ib-port-xmit-discards"),
        },
    ),
    "ib-rnr-nak-retry": stepping("ib-rnr-nak-retry", "mlx5_0/1", "counter"),
}


def _add_nics(rep: Report, extra: list[Nic]) -> Report:
    return msgspec.structs.replace(rep, nics=[*rep.nics, *extra])


LOOKALIKES = [
    (name, label, build) for name, sc in SCENARIOS.items() for label, build in sc.lookalikes.items()
]


def test_every_shipped_rule_has_a_scenario() -> None:
    assert set(SCENARIOS) == set(SHIPPED)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_rule_fires_on_its_fault(name: str) -> None:
    scenario = SCENARIOS[name]
    rule = SHIPPED[name]
    findings = final(engine_for(name), scenario.fires())
    assert keys(findings) == [scenario.key]
    finding = findings[0]
    assert (
        finding.detector,
        finding.rule,
        finding.severity,
        finding.action,
        finding.hard,
        finding.clears,
    ) == (
        "rule",
        name,
        rule.severity,
        rule.action,
        rule.hard,
        rule.clears,
    )
    assert finding.runbook_url == rule.runbook_url
    assert finding.summary and "{" not in finding.summary
    subject = scenario.key.partition(":")[2]
    if subject.startswith("gpu"):
        index = int(subject[3:])
        assert finding.evidence["gpu"] == index
        assert finding.evidence["uuid"] == gpu(index).uuid
        assert f"GPU {index} (" in finding.summary
    elif "/" in subject:
        device, _, port = subject.partition("/")
        assert (finding.evidence["device"], finding.evidence["port"]) == (device, int(port))
        assert subject in finding.summary
    else:  # an error rule about no GPU: the collector that said it is the subject
        assert finding.evidence["collector"] == subject
        assert "vanished: " in finding.summary or subject in finding.summary


@pytest.mark.parametrize(
    ("name", "label", "build"), LOOKALIKES, ids=[f"{n}: {label}" for n, label, _ in LOOKALIKES]
)
def test_rule_is_silent_on_lookalike(name: str, label: str, build: Build) -> None:
    fired = [keys(f) for f in feed(engine_for(name), build()) if f]
    assert fired == [], f"{name} fired on {label!r}"


def healthy_fleet_day() -> list[Report]:
    """40 minutes of a busy healthy node, a reboot in the middle, with everything that moves on
    a healthy node moving: traffic counters, corrected ECC errors, idle GPUs at PCIe gen 1, an
    Ethernet netdev and an IPoIB netdev that is down, an unsupported field or two."""

    app_xid_gpu = 2

    def make(i: int, t: float) -> Report:
        boot = "boot-a" if i < 40 else "boot-b"
        j = i if i < 40 else i - 40  # counters start again after the reboot
        gpus = [
            gpu(
                g,
                utilization_ratio=0.0 if g >= 6 else 0.9,
                pcie_link_gen=1 if g >= 6 else 5,
                clock_event_reasons=0x1 if g >= 6 else (0x4 if j % 4 == 0 else 0),
                temperature_celsius=40.0 if g >= 6 else 70.0 + (j % 5),
                ecc_sbe_volatile_total=3 * j,
                energy_joules_total=1e6 + 600.0 * 30 * j,
                memory_temperature_celsius=None if g == 0 else 70.0,
            )
            for g in range(8)
        ]
        nics = [
            ib_port(
                f"mlx5_{n}",
                rx_bytes_total=10**9 * j,
                tx_bytes_total=10**9 * j,
                c_port_xmit_data=10**8 * j,
                c_port_rcv_data=10**8 * j,
                c_link_downed=1,
            )
            for n in range(8)
        ]
        nics += [
            netdev("eth0", rx_bytes_total=10**6 * j),
            netdev("ib0", link_layer="InfiniBand", state="down"),
        ]
        events = [xid(13, app_xid_gpu, t)] if i == 50 else []
        return report(t, seq=i, boot_id=boot, gpus=gpus, nics=nics, events=events)

    return timeline(80, make, every=30.0)


def test_gpu_lost_as_an_agent_older_than_the_code_words_it() -> None:
    # A fleet part-way through an agent upgrade: the old words still read as the code.
    reports = with_errors("GPU 3 (GPU-00000003-1111-2222-3333-444455556666, 00000000:1B:00.0): GPU is lost")()
    assert keys(final(engine_for("gpu-lost"), reports)) == ["gpu-lost:gpu3"]


def test_healthy_node_raises_nothing_but_the_application_xid_record() -> None:
    engine = RuleEngine(list(SHIPPED.values()))
    history = feed(engine, healthy_fleet_day())
    raised = {f.key: f.action for findings in history for f in findings}
    assert raised == {"xid-app:gpu2": "none"}, "an application XID is recorded, with no action"


# --- engine behaviour the rules rely on --------------------------------------------------------


def test_xid_finding_latches_until_reboot_and_reads_like_a_human_wrote_it() -> None:
    engine = engine_for("xid-79")
    reports = with_event(79, at=2, count=8)()
    reports += timeline(2, lambda i, t: report(t, boot_id="boot-b"), start=reports[-1].time + 60)
    history = feed(engine, reports)
    assert [keys(f) for f in history] == [[], []] + [["xid-79:gpu3"]] * 6 + [[], []]
    finding = history[2][0]
    assert finding.summary == "GPU 3 (GPU-00000003...) XID 79 at 2025-11-24T16:00:20Z: fell off the bus"
    assert finding.since == reports[2].time
    assert history[7][0] is finding, "later reports keep the first evidence"
    assert {k: finding.evidence[k] for k in ("gpu", "uuid", "xid")} == {
        "gpu": 3,
        "uuid": gpu(3).uuid,
        "xid": 79,
    }


def test_for_timer_is_per_subject_and_reboot_resets_it() -> None:
    engine = engine_for("ib-port-down")

    def make(i: int, t: float) -> Report:
        rep = report(t, boot_id="boot-a" if i < 3 else "boot-b")
        rep = edit_nic(rep, "mlx5_1", state="DOWN") if i >= 1 else rep  # up in the first report only
        return edit_nic(rep, "mlx5_2", state="DOWN") if i >= 2 else rep

    history = feed(engine, timeline(8, make))
    # mlx5_1 was down from t=10 (fired at t=20, mlx5_2 down from t=20); the reboot at t=30 starts
    # both timers again, so both fire at t=40.
    both = ["ib-port-down:mlx5_1/1", "ib-port-down:mlx5_2/1"]
    one = ["ib-port-down:mlx5_1/1"]
    assert [keys(f) for f in history] == [[], [], one, [], both, both, both, both]
    assert [f.since for f in history[-1]] == [T0 + 30, T0 + 30]
    assert history[-1][0].summary == "mlx5_1/1 is DOWN (LinkUp) for 10s"


def test_a_port_up_before_a_reboot_and_down_after_it_is_down() -> None:
    # Seen ACTIVE in the last boot: after the reboot it trains no more (a transceiver that died
    # with the power cycle), and has received nothing this boot. It is still a port the node uses.
    engine = engine_for("ib-port-down")

    def make(i: int, t: float) -> Report:
        rep = report(t, seq=i, boot_id="boot-a" if i < 3 else "boot-b")
        if i >= 3:
            rep = edit_nic(rep, "mlx5_1", state="DOWN", phys_state="Polling", rx_packets_total=0)
        return rep

    history = feed(engine, timeline(6, make))
    assert [keys(f) for f in history] == [
        [],
        [],
        [],
        [],
        ["ib-port-down:mlx5_1/1"],
        ["ib-port-down:mlx5_1/1"],
    ]
    # A fresh engine (an aggregator that never saw it up) leaves the same port alone: never up,
    # as far as it can tell.
    fresh = feed(engine_for("ib-port-down"), timeline(6, make)[3:])
    assert [keys(f) for f in fresh] == [[], [], []]


def test_an_aggregator_started_after_a_port_went_down_still_judges_it() -> None:
    # Every replica rolled while the port was down: none saw it ACTIVE. It received packets
    # before it went down (the driver's counters, this boot), so it is a port the node uses.
    engine = engine_for("ib-port-down")
    reps = [
        edit_nic(
            report(T0 + 10.0 * i, seq=i), "mlx5_1", state="DOWN", phys_state="Polling", rx_packets_total=5000
        )
        for i in range(3)
    ]
    assert [keys(f) for f in feed(engine, reps)] == [[], ["ib-port-down:mlx5_1/1"], ["ib-port-down:mlx5_1/1"]]


def test_a_port_in_init_for_five_minutes_is_not_active_even_if_never_seen_up() -> None:
    # INIT: cable and switch port up, no subnet manager activating it. A port meant to be used.
    engine = engine_for("ib-port-not-active")
    reps = [
        edit_nic(report(T0 + 10.0 * i, seq=i), "mlx5_2", state="INIT", rx_packets_total=0) for i in range(32)
    ]
    history = feed(engine, reps)
    assert history[29] == [] and keys(history[30]) == ["ib-port-not-active:mlx5_2/1"]


def test_for_period_is_met_by_reports_a_few_milliseconds_early() -> None:
    # An agent's report times are its timer plus its collection time: the second report down may
    # come 9.99 s after the first. Two reports down is the rule's 10 s, not a third report later.
    engine = engine_for("ib-port-down")
    times = [T0, T0 + 10.0, T0 + 19.99, T0 + 29.99]
    reps = [
        edit_nic(report(t, seq=i), "mlx5_1", state="DOWN") if i >= 1 else report(t, seq=i)
        for i, t in enumerate(times)
    ]
    history = feed(engine, reps)
    assert [keys(f) for f in history] == [[], [], ["ib-port-down:mlx5_1/1"], ["ib-port-down:mlx5_1/1"]]
    # A single report down, however long the gap before the next report up, is not held.
    flap = [report(T0), edit_nic(report(T0 + 10.0, seq=1), "mlx5_1", state="DOWN"), report(T0 + 19.99, seq=2)]
    assert [keys(f) for f in feed(engine_for("ib-port-down"), flap)] == [[], [], []]


def test_rate_finding_clears_once_the_window_has_passed() -> None:
    engine = engine_for("nvlink-recovery")
    history = feed(engine, counter("nvlink-recovery", step(10), 80)())
    active = [bool(f) for f in history]
    # One recovery between reports 9 and 10: seen for the 10-minute window, then gone.
    assert active[:10] == [False] * 10
    assert all(active[10:69])
    assert not any(active[71:])
    assert history[10][0].summary == "GPU 0 (GPU-00000000...) NVLink recoveries at 108/h over 10m"


def test_a_window_rule_on_a_saturated_counter_holds_until_the_counter_is_cleared() -> None:
    # LocalLinkIntegrityErrors is 4 bits wide: a bad link takes it to 15 within minutes, where it
    # stays until someone clears it, and from then on it reads as a rate of 0. The finding must
    # not clear on that silence; it clears on the window's evidence once the counter is cleared.
    def values(i: int) -> int:
        if i < 10:
            return 0
        if i < 100:
            return min(15, 3 * (i - 9))  # 3 an interval, stuck at 15 from report 14 on
        return 0  # cleared (perfquery -R) at report 100, and the link is clean since

    history = feed(engine_for("ib-local-link-integrity"), counter("ib-local-link-integrity", values, 170)())
    active = [keys(f) == ["ib-local-link-integrity:mlx5_0/1"] for f in history]
    assert active[:10] == [False] * 10
    assert all(active[10:100]), "cleared on the silence of a saturated counter"
    assert history[99][0].evidence["evidence_state"] == "saturated"
    assert "evidence_state" not in history[12][0].evidence  # still counting then
    assert not any(active[100:])  # cleared by hand: the window's evidence (none) decides again


def test_a_counter_saturated_before_it_was_first_seen_decides_nothing() -> None:
    # A port whose 8-bit LinkDownedCounter sat at 255 before this aggregator saw it: no link
    # downs are measured, so neither flapping rule fires; nor does one down to 255 make a flap.
    for name in ("ib-link-downed", "ib-link-flapping"):
        stuck = counter(name, lambda i: 255, 120, every=30.0)()
        assert not any(feed(engine_for(name), stuck)), name
    one_down = counter("ib-link-flapping", step(40, 254, 255), 120, every=30.0)()
    assert not any(feed(engine_for("ib-link-flapping"), one_down))


def test_symbol_error_budget_scales_with_link_rate() -> None:
    # 720 symbol errors an hour: within a 400 Gb/s port's budget (1440/h), over a 100 Gb/s one's (360/h).
    slow = counter("ib-symbol-errors", lambda i: 6 * i, 70, every=30.0)()
    slow = [edit_nic(r, "mlx5_0", rate_bytes_per_second=EDR_BYTES_PER_SECOND) for r in slow]
    findings = final(engine_for("ib-symbol-errors"), slow)
    assert keys(findings) == ["ib-symbol-errors:mlx5_0/1"]
    assert findings[0].evidence["threshold"] == pytest.approx(360.0)
    assert findings[0].summary.endswith("above the 1e-12 BER budget of 360/h")


def test_an_engine_started_late_still_reads_the_window() -> None:
    # A fresh engine (aggregator restart) must not skip a rate because counters did not move on
    # the last report: it has not seen the report before.
    reports = counter("nvlink-recovery", step(10), 20)()
    engine = engine_for("nvlink-recovery")
    assert keys(engine.evaluate(ListView(reports))) == ["nvlink-recovery:gpu0"]


def test_forget_drops_a_nodes_state() -> None:
    engine = engine_for("xid-79")
    reports = with_event(79, at=2, count=4)()
    assert keys(final(engine, reports)) == ["xid-79:gpu3"]
    engine.forget(reports[0].node)
    later = report(reports[-1].time + 10)
    assert engine.evaluate(ListView([later])) == []


def test_nodes_are_independent() -> None:
    engine = engine_for("xid-79")
    a = with_event(79, at=1, count=2)()
    b = [report(r.time, node="gpu-0002") for r in a]
    assert keys(final(engine, a)) == ["xid-79:gpu3"]
    assert final(engine, b) == []


def test_repeat_history_survives_a_reboot() -> None:
    # The GPU keeps faulting across jobs whether or not the node was rebooted in between.
    reports = xid_at({0: [(13, 2)], 3: [(13, 2)], 6: [(13, 2)]}, count=7, every=300.0)()
    reports = [r if i < 4 else msgspec.structs.replace(r, boot_id="boot-b") for i, r in enumerate(reports)]
    assert keys(final(engine_for("xid-app-repeat"), reports)) == ["xid-app-repeat:gpu2"]


def test_event_without_a_gpu_is_a_node_finding() -> None:
    reports = series(2, lambda i, r: _events(r, [xid(79, None, r.time)]) if i == 1 else r)()
    findings = final(engine_for("xid-79"), reports)
    assert keys(findings) == ["xid-79:node"]
    assert findings[0].summary.startswith("GPU ? (?) XID 79")


def test_findings_are_sorted_by_key_and_evidence_is_plain_data() -> None:
    reports = with_event(79, at=1, count=2)()
    reports[-1] = edit_gpu(
        _events(reports[-1], [xid(79, 3, T0), xid(48, 0, T0)]), 5, remapped_rows_failure=True
    )
    engine = RuleEngine(list(SHIPPED.values()))
    findings: list[Finding] = final(engine, reports)
    assert (
        keys(findings)
        == sorted(keys(findings))
        == ["gpu-row-remap-failure:gpu5", "xid-48:gpu0", "xid-79:gpu3"]
    )
    json.dumps([dict(f.evidence) for f in findings])  # decision records serialize it as is


def test_hold_keeps_a_condition_event_finding_for_a_while(tmp_path: Path) -> None:
    rules = rules_from_yaml(
        "rules:\n  - {name: x13, kind: event, codes: [13], clears: condition, hold: 30s,"
        " severity: info, action: none}\n",
        tmp_path,
    )
    history = feed(RuleEngine(rules), with_event(13, at=1, count=7)())
    assert [bool(f) for f in history] == [False, True, True, True, True, False, False]


@dataclass
class LateView(ListView):
    """A view of the latest report that also carries a report that arrived late, as the fleet
    history hands it over (``HistoryView.added``)."""

    added: Report | None = None


def test_xid_in_a_report_that_arrived_late_is_not_lost() -> None:
    engine = engine_for("xid-79")
    reports = timeline(4)
    feed(engine, reports)
    late = _events(report(reports[1].time + 5), [xid(79, 3, reports[1].time + 5)])
    findings = engine.evaluate(LateView(reports, added=late))
    assert keys(findings) == ["xid-79:gpu3"]
    assert findings[0].evidence["time"] == reports[1].time + 5


def test_engine_names_the_series_it_reads() -> None:
    series = RuleEngine(list(SHIPPED.values())).series
    rates = [r for r in SHIPPED.values() if isinstance(r, RateRule)]
    assert series.nic_counters == {r.field for r in rates if r.target == "nic"}
    assert series.nvlink_counters == {r.field for r in rates if r.target == "nvlink"}
    assert series.gpu_counters == {"pcie_replay_total"}
    assert series.gpu_gauges == {"clock_event_reasons", "utilization_ratio"}
