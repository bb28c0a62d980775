"""Test kit for the rule engine: healthy reports to edit, and a NodeView over a list of reports.

``ListView`` implements ``aggregator.fleet.view.NodeView`` the simple way, straight from its
docstring (rates per second over the current boot's samples in the window, a counter going down
within a boot counted from zero), so rule tests do not depend on the real fleet history.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from agent.report import CollectorError, Event, Gpu, Nic, NvLink, Report
from aggregator.model import Finding
from aggregator.rules import RuleEngine, load_rules
from aggregator.rules.model import Rule

NODE = "gpu-0001"
BOOT = "boot-a"
T0 = 1_764_000_000.0  # 2025-11-24 16:00:00 UTC
NDR_BYTES_PER_SECOND = 50e9  # "400 Gb/sec (4X NDR)"
EDR_BYTES_PER_SECOND = 12.5e9  # "100 Gb/sec (4X EDR)"


def nvlinks(count: int = 18, **counters: int) -> list[NvLink]:
    """Active links with the given error counters (the same on every link)."""
    values = {
        "crc_flit_errors_total": 0,
        "crc_data_errors_total": 0,
        "replay_errors_total": 0,
        "recovery_errors_total": 0,
    }
    values.update(counters)
    return [NvLink(link=i, active=True, **values) for i in range(count)]


def gpu(index: int, **fields: Any) -> Gpu:
    """A healthy, busy H100 unless told otherwise."""
    values: dict[str, Any] = {
        "uuid": f"GPU-{index:08x}-1111-2222-3333-444455556666",
        "model": "NVIDIA H100 80GB HBM3",
        "pci_bus_id": f"00000000:{0x18 + index:02X}:00.0",
        "utilization_ratio": 0.9,
        "memory_used_bytes": 60 << 30,
        "memory_total_bytes": 80 << 30,
        "temperature_celsius": 62.0,
        "memory_temperature_celsius": 70.0,
        "power_watts": 600.0,
        "power_limit_watts": 700.0,
        "energy_joules_total": 1e9,
        "sm_clock_hz": 1.98e9,
        "sm_clock_max_hz": 1.98e9,
        "memory_clock_hz": 2.6e9,
        "clock_event_reasons": 0,
        "performance_state": 0,
        "ecc_sbe_volatile_total": 0,
        "ecc_dbe_volatile_total": 0,
        "ecc_sbe_aggregate_total": 3,
        "ecc_dbe_aggregate_total": 0,
        "retired_pages_sbe": None,
        "retired_pages_dbe": None,
        "retired_pages_pending": None,
        "remapped_rows_correctable": 0,
        "remapped_rows_uncorrectable": 0,
        "remapped_rows_pending": False,
        "remapped_rows_failure": False,
        "pcie_link_gen": 5,
        "pcie_link_gen_max": 5,
        "pcie_link_width": 16,
        "pcie_link_width_max": 16,
        "pcie_replay_total": 0,
        "nvlink": nvlinks(),
    }
    values.update(fields)
    return Gpu(index=index, **values)


def ib_port(device: str = "mlx5_0", port: int = 1, **fields: Any) -> Nic:
    """An ACTIVE 400G InfiniBand port; ``counters`` entries given as keyword ``c_NAME=value``."""
    counters = {
        "symbol_error": 0,
        "link_error_recovery": 0,
        "link_downed": 1,
        "port_rcv_errors": 0,
        "port_xmit_discards": 0,
        "local_link_integrity_errors": 0,
        "excessive_buffer_overrun_errors": 0,
        "rnr_nak_retry_err": 0,
        "port_xmit_data": 1000,
        "port_rcv_data": 1000,
    }
    for key in [k for k in fields if k.startswith("c_")]:
        counters[key[2:]] = fields.pop(key)
    values: dict[str, Any] = {
        "link_layer": "InfiniBand",
        "netdev": None,
        "state": "ACTIVE",
        "phys_state": "LinkUp",
        "rate_bytes_per_second": NDR_BYTES_PER_SECOND,
        "rx_bytes_total": 4000,
        "tx_bytes_total": 4000,
        "rx_packets_total": 10,
        "tx_packets_total": 10,
        "counters": counters,
    }
    values.update(fields)
    return Nic(device=device, port=port, **values)


def netdev(name: str, **fields: Any) -> Nic:
    """A netdev as the netdev collector reports it: no port, operstate as state."""
    values: dict[str, Any] = {
        "link_layer": "Ethernet",
        "netdev": name,
        "state": "up",
        "rate_bytes_per_second": 12.5e9,
        "rx_bytes_total": 0,
        "tx_bytes_total": 0,
        "counters": {"rx_errors": 0, "carrier_changes": 2},
    }
    values.update(fields)
    return Nic(device=name, port=None, **values)


def xid(code: int, gpu: int | None = 3, at: float | None = None, message: str | None = None) -> Event:
    return Event(kind="xid", time=at if at is not None else T0, gpu=gpu, code=code, message=message)


def report(
    time: float,
    *,
    gpus: Sequence[Gpu] | None = None,
    nics: Sequence[Nic] | None = None,
    events: Sequence[Event] = (),
    errors: Sequence[CollectorError] = (),
    boot_id: str = BOOT,
    node: str = NODE,
    seq: int = 0,
) -> Report:
    """A report of a healthy 8-GPU, 8-rail node unless told otherwise."""
    return Report(
        schema="gpuwarden/report/v1",
        node=node,
        time=time,
        seq=seq,
        boot_id=boot_id,
        gpus=list(gpus) if gpus is not None else [gpu(i) for i in range(8)],
        nics=list(nics) if nics is not None else [ib_port(f"mlx5_{i}") for i in range(8)],
        interval_seconds=10.0,
        events=list(events) if events else msgspec.UNSET,
        errors=list(errors) if errors else msgspec.UNSET,
    )


def timeline(
    count: int, make: Callable[[int, float], Report] | None = None, *, start: float = T0, every: float = 10.0
) -> list[Report]:
    """``count`` reports ``every`` seconds apart; ``make(i, time)`` builds each (healthy by default)."""
    build = make or (lambda i, t: report(t, seq=i))
    return [build(i, start + i * every) for i in range(count)]


def edit_gpu(rep: Report, index: int, **fields: Any) -> Report:
    """The report with one GPU's fields replaced."""
    gpus = [msgspec.structs.replace(g, **fields) if g.index == index else g for g in rep.gpus]
    return msgspec.structs.replace(rep, gpus=gpus)


def edit_nic(rep: Report, device: str, **fields: Any) -> Report:
    """The report with one NIC's fields replaced; ``c_NAME=value`` sets a counter."""
    counter_edits = {k[2:]: fields.pop(k) for k in [k for k in fields if k.startswith("c_")]}
    out = []
    for nic in rep.nics:
        changes = dict(fields)
        if nic.device == device and counter_edits:
            assert nic.counters is not msgspec.UNSET
            changes["counters"] = {**nic.counters, **counter_edits}
        out.append(msgspec.structs.replace(nic, **changes) if nic.device == device else nic)
    return msgspec.structs.replace(rep, nics=out)


# ---------------------------------------------------------------------------------------------
# NodeView over a list of reports


def _counter_rate(samples: Sequence[tuple[float, float]]) -> float | None:
    if len(samples) < 2:
        return None
    span = samples[-1][0] - samples[0][0]
    if span <= 0:
        return None
    increase = 0.0
    for (_, a), (_, b) in itertools.pairwise(samples):
        increase += b - a if b >= a else b  # went down within the boot: a reset, counts from zero
    return increase / span


@dataclass
class ListView:
    """A ``NodeView`` of the last report of ``reports`` (oldest first, one node)."""

    reports: Sequence[Report]

    @property
    def node(self) -> str:
        return self.report.node

    @property
    def report(self) -> Report:
        return self.reports[-1]

    @property
    def previous(self) -> Report | None:
        if len(self.reports) < 2 or self.reports[-2].boot_id != self.report.boot_id:
            return None
        return self.reports[-2]

    @property
    def added(self) -> Report:
        return self.report

    @property
    def rebooted(self) -> bool:
        return len(self.reports) >= 2 and self.reports[-2].boot_id != self.report.boot_id

    def _window(self, window_s: float, *, same_boot: bool = True) -> list[Report]:
        now = self.report.time
        times = [r.time for r in self.reports]
        start = bisect.bisect_left(times, now - window_s)
        chosen = self.reports[start:]
        if same_boot:
            chosen = [r for r in chosen if r.boot_id == self.report.boot_id]
        return list(chosen)

    def gpu_rate(self, gpu: int, field: str, window_s: float) -> float | None:
        samples = []
        for r in self._window(window_s):
            g = next((g for g in r.gpus if g.index == gpu), None)
            value = getattr(g, field) if g is not None else None
            if value is not None:
                samples.append((r.time, float(value)))
        return _counter_rate(samples)

    def nvlink_rate(self, gpu: int, field: str, window_s: float) -> float | None:
        per_link: dict[int, list[tuple[float, float]]] = {}
        for r in self._window(window_s):
            g = next((g for g in r.gpus if g.index == gpu), None)
            if g is None or g.nvlink is msgspec.UNSET:
                continue
            for link in g.nvlink:
                value = getattr(link, field)
                if value is not None:
                    per_link.setdefault(link.link, []).append((r.time, float(value)))
        rates = [rate for s in per_link.values() if (rate := _counter_rate(s)) is not None]
        return sum(rates) if rates else None

    def nic_rate(self, device: str, port: int | None, counter: str, window_s: float) -> float | None:
        samples = []
        for r in self._window(window_s):
            nic = next((n for n in r.nics if n.device == device and n.port == port), None)
            if nic is None:
                continue
            if counter in ("rx_bytes_total", "tx_bytes_total", "rx_packets_total", "tx_packets_total"):
                value = getattr(nic, counter)
            else:
                value = nic.counters.get(counter) if nic.counters is not msgspec.UNSET else None
            if value is not None:
                samples.append((r.time, float(value)))
        return _counter_rate(samples)

    def gpu_samples(self, gpu: int, field: str, window_s: float) -> list[tuple[float, float | None]]:
        out: list[tuple[float, float | None]] = []
        for r in self._window(window_s, same_boot=False):
            g = next((g for g in r.gpus if g.index == gpu), None)
            if g is None:
                continue
            value = getattr(g, field)
            out.append((r.time, None if value is None else float(value)))
        return out


def feed(engine: RuleEngine, reports: Sequence[Report]) -> list[list[Finding]]:
    """Evaluate each report in order, as ingest does; the active findings after each one."""
    return [engine.evaluate(ListView(reports[: i + 1])) for i in range(len(reports))]


def final(engine: RuleEngine, reports: Sequence[Report]) -> list[Finding]:
    """The active findings after the last report."""
    return feed(engine, reports)[-1]


def keys(findings: Iterable[Finding]) -> list[str]:
    return [f.key for f in findings]


def rules_from_yaml(text: str, tmp_path: Any, name: str = "test.yaml") -> list[Rule]:
    path = tmp_path / name
    path.write_text(text, "utf-8")
    return load_rules([path])
