"""The fleet: every node's hardware, jobs, probes and faults, delivered as an aggregator receives them.

``simulate(scenario)`` yields ``Delivery(receive_time, report, shows)`` in receive order, where
``shows`` names the faults (their index in ``scenario.faults``) that this report makes visible;
``sim.truth`` turns that into the ground truth. The same scenario gives the same reports: every
random draw comes from a ``random.Random`` seeded with the scenario's seed and a name (the node,
the pair and round of a probe, the node's network), so adding a node or a fault elsewhere does not
change the readings of the others.

Pair probes are planned before any report is made, because a pair probe needs both ends idle and
up: job timelines are drawn up front per node from their own stream, and ``sim.probing`` runs the
real probe scheduler over them (rotation, confirm re-probes, caps). Each probe's result goes into
the reports of *both* ends (the same measurement, the same time on each end's clock), so losing
one end's report does not lose the measurement and a detector can count a pair once by its sorted
names.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Final

import msgspec

from agent.errors import ConfigError
from agent.report import SCHEMA_ID, CollectorError, Event, Gpu, Jobs, Nic, NvLink, Probe, Report
from aggregator.fleet.pools import Placement
from sim.jobs import JobFleet, busy_windows, job_fleet
from sim.probing import PairProbe, plan_pair_probes
from sim.profiles import (
    HGX_IPOIB_NETDEVS,
    HGX_PCI_BUS_IDS,
    IB_PORT_COUNTERS,
    REASON_GPU_IDLE,
    REASON_HW_POWER_BRAKE,
    REASON_HW_SLOWDOWN,
    REASON_HW_THERMAL,
    REASON_SW_POWER_CAP,
    NodeProfile,
)
from sim.scenario import FaultSpec, Scenario, node_name, silenced_nodes

_THERMAL_TIME_CONSTANT_S: Final = 90.0
_GIB: Final = 1 << 30
_IB_MTU_BYTES: Final = 4096
_APP_XID_TEXT: Final = {
    13: "Graphics SM Warp Exception on (GPC 1, TPC 2, SM 0): Out Of Range Address",
    31: "MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f3a_9e000000. Fault is of type FAULT_PDE",
    43: "Ch 00000008, errorString CTX SWITCH TIMEOUT, Info 0x4c025",
    45: "Ch 00000010, intr 00000000. Preemptive Cleanup, due to previous errors",
}


@dataclass(frozen=True)
class Delivery:
    receive_time: float
    report: Report
    shows: frozenset[int]


def _widen(x: float, centre: float, k: float) -> float:
    """A draw ``x`` spread ``k`` times as far from ``centre`` (``Scenario.noise``); ``x`` itself at 1,
    bit for bit, so the calibrated fleet's traces do not move."""
    return x if k == 1.0 else centre + (x - centre) * k


def _kernel_bus_id(pci_bus_id: str) -> str:
    domain, bus, dev_fn = pci_bus_id.split(":")
    return f"PCI:{domain[-4:]}:{bus.lower()}:{dev_fn.split('.')[0]}"


def ambient_c(s: Scenario, t: float) -> float:
    """Fleet-wide inlet temperature: a daily swing and a slow drift (every node sees the same)."""
    rel = t - s.start
    swing = s.ambient_amplitude_c * math.sin(2 * math.pi * rel / s.ambient_period_s)
    return s.ambient_base_c + swing + s.ambient_drift_c_per_hour * rel / 3600.0


# ---------------------------------------------------------------------------------------------
# Plans made before any report: job timelines, down windows, pair probes


@dataclass
class _Timeline:
    """When a node is busy: alternating stretches from its own random stream."""

    switches: list[float]
    first_busy: bool

    def busy(self, t: float) -> bool:
        return self.first_busy ^ (bisect.bisect_right(self.switches, t) % 2 == 1)


def _timeline(s: Scenario, name: str) -> _Timeline:
    rng = random.Random(f"gpuwarden-sim-jobs:{s.seed}:{name}")
    busy = rng.random() < s.busy_mean_s / (s.busy_mean_s + s.idle_mean_s)
    first, t, switches = busy, s.start, []
    while t <= s.start + s.duration_s:
        t += rng.expovariate(1.0 / (s.busy_mean_s if busy else s.idle_mean_s))
        switches.append(t)
        busy = not busy
    return _Timeline(switches, first)


def _timelines(s: Scenario) -> dict[str, _Timeline]:
    """Every node's timeline; a node of a multi-node job is busy for the job's span (sim.jobs)."""
    out = {name: _timeline(s, name) for name in s.node_names()}
    for name, (t0, t1) in busy_windows(s).items():
        out[name] = _Timeline([t0, t1], first_busy=False)
    return out


def _down_windows(faults: list[FaultSpec], s: Scenario) -> list[tuple[float, float]]:
    return [(s.start + f.at_s, s.start + f.at_s + f.param("down_s")) for f in faults if f.kind == "reboot"]


def _gpu_lost(faults: list[FaultSpec], s: Scenario, t: float) -> bool:
    """A GPU fell off the bus (XID 79) and no reboot has brought it back yet."""
    rel = t - s.start
    for f in faults:
        if f.kind == "xid79" and f.at_s <= rel:
            reboots = [r.at_s + r.param("down_s") for r in faults if r.kind == "reboot" and r.at_s > f.at_s]
            if not any(end <= rel for end in reboots):
                return True
    return False


def _plan_pair_probes(
    s: Scenario,
    timelines: dict[str, _Timeline],
    by_node: dict[str, list[tuple[int, FaultSpec]]],
    silences: dict[str, list[FaultSpec]],
) -> dict[str, list[PairProbe]]:
    """Every node's pair probes, planned by the real scheduler (``sim.probing``)."""
    names = s.node_names()
    skews = {name: _skew_at(by_node.get(name, []), s) for name in names}
    downs = {name: _down_windows([f for _, f in by_node.get(name, [])], s) for name in names}
    quiet = {name: _quiet_windows(silences.get(name, []), s) for name in names}
    profiles = {name: s.pool_of(i).profile for i, name in enumerate(names)}

    def heard(n: str, t: float) -> bool:
        return not any(t0 <= t < t1 for t0, t1 in downs[n]) and not any(t0 <= t < t1 for t0, t1 in quiet[n])

    def free(n: str, t: float) -> bool:  # asked only while the node is heard: up
        # A node with a lost GPU reports an NVML error: the scheduler counts it as busy.
        return not timelines[n].busy(t) and not _gpu_lost([f for _, f in by_node.get(n, [])], s, t)

    def measure(a: str, b: str, t: float) -> PairProbe:
        noise = random.Random(f"gpuwarden-sim-pair:{s.seed}:{a}:{b}:{t:.3f}").gauss(
            1.0, profiles[a].probe_noise_ratio * s.noise
        )
        probe = _pair_result(s, profiles[a], a=a, b=b, t=t, noise=noise, by_node=by_node)
        shows = frozenset(
            idx
            for n in (a, b)
            for idx, f in by_node.get(n, [])
            if f.active(t - s.start)
            and (f.kind == "slow_nic" or (f.kind == "degraded_link" and {f.node, f.peer} == {a, b}))
        )
        return PairProbe(
            t,
            a,
            b,
            msgspec.structs.replace(probe, peer=b, time=round(t + skews[a](t), 3)),
            msgspec.structs.replace(probe, peer=a, time=round(t + skews[b](t), 3)),
            shows,
        )

    return plan_pair_probes(
        s,
        phases={name: _phase(s, name) for name in names},
        placements={
            name: Placement(pool=s.pool_of(i).name, rack=s.rack_of(i), leaf=s.leaf_of(i))
            for i, name in enumerate(names)
        },
        heard=heard,
        free=free,
        measure=measure,
    )


def _quiet_windows(silences: list[FaultSpec], s: Scenario) -> list[tuple[float, float]]:
    return [
        (s.start + f.at_s, s.start + (f.until_s if f.until_s is not None else math.inf)) for f in silences
    ]


def _pair_result(
    s: Scenario,
    profile: NodeProfile,
    *,
    a: str,
    b: str,
    t: float,
    noise: float,
    by_node: dict[str, list[tuple[int, FaultSpec]]],
) -> Probe:
    rel = t - s.start
    busbw = profile.pair_busbw_bytes_per_second * noise
    for n in (a, b):
        faults = [f for _, f in by_node.get(n, [])]
        if _gpu_lost(faults, s, t):
            return Probe(
                kind="nccl_allreduce_pair",
                time=t,
                ok=False,
                size_bytes=s.probe_size_bytes,
                error="NCCL WARN Cuda failure 'unspecified launch failure' (ncclUnhandledCudaError)",
            )
        for f in faults:
            if not f.active(rel):
                continue
            # A slow NIC slows every pair it is in; a bad link (a cable, a switch port) only its pair.
            link_here = f.kind == "degraded_link" and {f.node, f.peer} == {a, b} and n == f.node
            if f.kind == "slow_nic" or link_here:
                busbw *= f.param("ratio")
        down = {f.port for f in faults if f.kind == "ib_port_down" and f.active(rel)}
        # A rail down: the ring runs over the remaining ports, and waits on the busiest one.
        busbw *= (profile.nics - len(down)) / profile.nics
    algbw = busbw / (2 * (2 * profile.gpus - 1) / (2 * profile.gpus))
    return Probe(
        kind="nccl_allreduce_pair",
        time=t,
        ok=True,
        size_bytes=s.probe_size_bytes,
        busbw_bytes_per_second=round(busbw, 0),
        duration_seconds=round(s.probe_size_bytes / algbw, 6),
    )


def _node_rng(s: Scenario, name: str) -> random.Random:
    return random.Random(f"gpuwarden-sim:{s.seed}:{name}")


def _draw_phase(rng: random.Random, s: Scenario) -> float:
    """The node's report phase: the first draw of its own stream."""
    return round(rng.uniform(0.0, s.interval_s), 3)


def _phase(s: Scenario, name: str) -> float:
    return _draw_phase(_node_rng(s, name), s)


def _skew_at(faults: list[tuple[int, FaultSpec]], s: Scenario) -> _Skew:
    return _Skew([f for _, f in faults if f.kind == "clock_skew"], s.start)


@dataclass
class _Skew:
    faults: list[FaultSpec]
    start: float

    def __call__(self, t: float) -> float:
        return sum(f.param("seconds") for f in self.faults if f.active(t - self.start))


# ---------------------------------------------------------------------------------------------
# One node


@dataclass
class _GpuState:
    index: int
    uuid: str
    pci_bus_id: str
    temperature: float
    sbe_aggregate: int
    memory_used: int = 0
    dbe_aggregate: int = 0
    dbe_volatile: int = 0
    energy_j: float = 0.0
    remapped_uncorrectable: int = 0
    remap_pending: bool = False
    remap_failure: bool = False
    lost: bool = False
    pcie_replay: int = 0
    nvlink_crc: dict[int, int] = field(default_factory=dict)


class _Node:
    def __init__(
        self,
        s: Scenario,
        index: int,
        faults: list[tuple[int, FaultSpec]],
        timeline: _Timeline,
        pair_probes: list[PairProbe],
        *,
        jobs: JobFleet | None = None,
    ) -> None:
        self.s = s
        self.jobs = jobs
        self.name = node_name(index)
        self.profile = s.pool_of(index).profile
        self.labels = s.labels_of(index)
        self.rng = _node_rng(s, self.name)
        self.phase = _draw_phase(self.rng, s)
        self.faults = sorted(faults, key=lambda item: item[1].at_s)
        self.applied: set[int] = set()
        self.timeline = timeline
        self.pair_probes = pair_probes
        self.next_pair = 0
        self.skew = _skew_at(faults, s)
        self.gpus = [
            _GpuState(
                index=i,
                uuid=f"GPU-{uuid.UUID(int=self.rng.getrandbits(128), version=4)}",
                pci_bus_id=HGX_PCI_BUS_IDS[i % len(HGX_PCI_BUS_IDS)],
                temperature=ambient_c(s, s.start) + self.profile.temperature_offset_c + 5.0,
                sbe_aggregate=self.rng.choice((0, 0, 0, 0, 0, 1, 2, 5)),
            )
            for i in range(self.profile.gpus)
        ]
        self.ports: list[dict[str, int]] = []
        self.down_until: float | None = None
        self.pending_events: list[Event] = []
        self.pending_shows: set[int] = set()
        self.lose_next: set[int] = set()
        self.next_local = s.start + self.rng.uniform(0.0, s.local_every_s)
        self.boot_id = ""
        self.seq = 0
        self.new_boot_shows: set[int] = set()
        self.skew_shown: set[int] = set()
        self._boot()

    def _boot(self) -> None:
        self.boot_id = str(uuid.UUID(int=self.rng.getrandbits(128), version=4))
        self.seq = 0
        for g in self.gpus:
            # What a reset clears: volatile counts, energy, a pending remap, a lost GPU, link counters.
            g.dbe_volatile = 0
            g.energy_j = 0.0
            g.remap_pending = False
            g.lost = False
            g.pcie_replay = 0
            g.nvlink_crc = {}
        self.lose_next.clear()
        self.ports = [dict.fromkeys(IB_PORT_COUNTERS, 0) for _ in range(self.profile.nics)]

    def _active(self, rel: float, kind: str) -> list[tuple[int, FaultSpec]]:
        return [(i, f) for i, f in self.faults if f.kind == kind and f.active(rel)]

    def _xid(self, code: int, g: _GpuState, when: float, text: str) -> Event:
        return Event(
            kind="xid",
            time=when,
            gpu=g.index,
            code=code,
            message=f"NVRM: Xid ({_kernel_bus_id(g.pci_bus_id)}): {code}, {text}",
        )

    def _apply_due(self, t: float) -> bool:
        """Apply one-off faults due by true time ``t``; False while the node is down rebooting."""
        rel = t - self.s.start
        for idx, f in self.faults:
            if idx in self.applied or f.at_s > rel:
                continue
            self.applied.add(idx)
            when = round(self.s.start + f.at_s + self.skew(t), 3)
            g = self.gpus[f.gpu] if f.gpu is not None else None
            if f.kind == "xid79" and g is not None:
                self.pending_events.append(
                    self._xid(79, g, when, "pid='<unknown>', name=<unknown>, GPU has fallen off the bus.")
                )
                self.pending_shows.add(idx)
                self.lose_next.add(g.index)
            elif f.kind == "dbe" and g is not None:
                g.dbe_volatile += 1
                g.dbe_aggregate += 1
                g.remapped_uncorrectable += 1
                g.remap_pending = True
                self.pending_events.append(
                    self._xid(
                        48,
                        g,
                        when,
                        "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer "
                        "at partition 0, subpartition 0.",
                    )
                )
                self.pending_shows.add(idx)
            elif f.kind == "remap_failure" and g is not None:
                g.remapped_uncorrectable += 1
                g.remap_failure = True
            elif f.kind == "ib_port_down" and f.port is not None:
                self.ports[f.port]["link_downed"] += 1
            elif f.kind == "app_xid" and g is not None:
                code = int(f.param("code"))
                pid = self.rng.randint(1000, 99999)
                self.pending_events.append(
                    self._xid(code, g, when, f"pid={pid}, name=python3, {_APP_XID_TEXT[code]}")
                )
                self.pending_shows.add(idx)
            elif f.kind == "reboot":
                self.down_until = self.s.start + f.at_s + f.param("down_s")
                self.new_boot_shows.add(idx)
        if self.down_until is not None:
            if t < self.down_until:
                return False
            self.down_until = None
            self._boot()
        return True

    def sample(self, t: float, prev_t: float) -> tuple[Report, set[int]] | None:
        s, p = self.s, self.profile
        dt = t - prev_t
        rel = t - s.start
        if not self._apply_due(t):
            return None
        shows = set(self.pending_shows) | self.new_boot_shows
        self.pending_shows.clear()
        self.new_boot_shows.clear()
        busy = self.timeline.busy(t)
        for idx, f in self.faults:
            if f.kind == "clock_skew" and f.active(rel) and idx not in self.skew_shown:
                self.skew_shown.add(idx)
                shows.add(idx)
        gpus = []
        for g in self.gpus:
            if g.lost:
                continue
            gpu, seen = self._gpu(g, t, dt, busy, rel)
            gpus.append(gpu)
            shows |= seen
        nics = []
        port_down = {f.port: (i, f) for i, f in self._active(rel, "ib_port_down")}
        for port in range(p.nics):
            nic, seen = self._nic(port, dt, busy, rel, port_down.get(port))
            nics.append(nic)
            shows |= seen
        probes, seen = self._probes(t, prev_t, busy, rel)
        shows |= seen
        # As the NVML collector says it: words for a human, the code and the index for machines.
        errors = [
            CollectorError(
                collector="nvml",
                message=f"GPU {g.index} ({g.uuid}, {g.pci_bus_id}): GPU is lost",
                code="gpu_lost",
                gpu=g.index,
            )
            for g in self.gpus
            if g.lost
        ]
        events, self.pending_events = self.pending_events, []
        jobs: Jobs | msgspec.UnsetType = msgspec.UNSET  # the Inspector collector is off without jobs
        if self.jobs is not None:
            jobs, seen = self.jobs.section(self.name, prev_t, t, self.skew(t), any(g.lost for g in self.gpus))
            shows |= seen
        for idx, f in self.faults:
            if f.kind == "remap_failure" and idx in self.applied and not self.gpus[f.gpu or 0].lost:
                shows.add(idx)
        report = Report(
            schema=SCHEMA_ID,
            node=self.name,
            time=round(t + self.skew(t), 3),
            seq=self.seq,
            boot_id=self.boot_id,
            gpus=tuple(gpus),
            nics=tuple(nics),
            agent_version="gpuwarden-sim",
            interval_seconds=s.interval_s,
            labels=dict(self.labels),
            events=tuple(events) if events else msgspec.UNSET,
            probes=tuple(probes) if probes else msgspec.UNSET,
            errors=tuple(errors) if errors else msgspec.UNSET,
            jobs=jobs,
        )
        self.seq += 1
        for index in self.lose_next:
            self.gpus[index].lost = True
        self.lose_next.clear()
        return report, shows

    def _gpu(self, g: _GpuState, t: float, dt: float, busy: bool, rel: float) -> tuple[Gpu, set[int]]:
        p, rng, k = self.profile, self.rng, self.s.noise
        shows: set[int] = set()
        reasons = 0
        if busy:
            if rng.random() < 0.05:
                util = min(1.0, max(0.05, _widen(rng.uniform(0.3, 0.6), 0.45, k)))
            else:
                util = min(1.0, max(0.05, _widen(rng.uniform(0.85, 1.0), 0.925, k)))
            lo, hi = p.load_power_w
            if util > 0.8:
                power = lo + (hi - lo) * util * _widen(rng.uniform(0.7, 1.0), 0.85, k)
            else:
                power = lo * util * 1.3
            capped = power > p.power_limit_w * 0.97
            steps = rng.randint(1, 8) if capped else 0
            clock = p.sm_clock_max_hz - 15e6 * (steps if k == 1.0 else round(steps * k))
            reasons = REASON_SW_POWER_CAP if capped else 0
            pcie_gen = p.pcie_gen_max
        else:
            util = 0.0
            power = rng.uniform(*p.idle_power_w)
            clock = p.sm_clock_idle_hz
            reasons = REASON_GPU_IDLE
            pcie_gen = 1  # power management trains the link down at idle
        target = (
            ambient_c(self.s, t) + p.temperature_offset_c + power / p.power_limit_w * p.temperature_gain_c
        )
        width = p.pcie_width_max
        for idx, f in self.faults:
            if not f.active(rel):
                continue
            mine = f.gpu == g.index
            if f.kind == "thermal" and mine and busy:
                # A blocked heatsink or failing fan: hot, and the hardware slows it, still under 85 C.
                target = f.param("temperature_c")
                clock = round(p.sm_clock_max_hz * f.param("clock_ratio") / 15e6) * 15e6
                reasons = (reasons & ~REASON_SW_POWER_CAP) | REASON_HW_THERMAL | REASON_HW_SLOWDOWN
                shows.add(idx)
            elif f.kind == "power_brake":
                reasons |= REASON_HW_POWER_BRAKE | REASON_HW_SLOWDOWN
                if busy:
                    clock = round(p.sm_clock_max_hz * f.param("clock_ratio") / 15e6) * 15e6
                    power *= f.param("clock_ratio")
                shows.add(idx)
            elif f.kind == "slow_gpu" and mine and busy:
                # No reason bit: the silent kind NVML cannot explain.
                clock = round(p.sm_clock_max_hz * f.param("ratio") * rng.uniform(0.99, 1.01) / 15e6) * 15e6
                reasons &= ~REASON_SW_POWER_CAP
                shows.add(idx)
            elif f.kind == "pcie_downtrain" and mine:
                width = int(f.param("width"))
                if rng.random() < 0.3:
                    g.pcie_replay += rng.randint(1, 20)
                shows.add(idx)
            elif f.kind == "nvlink_crc" and mine:
                link = int(f.param("link"))
                grow = _poisson(rng, f.param("rate_per_s") * dt)
                if grow:
                    g.nvlink_crc[link] = g.nvlink_crc.get(link, 0) + grow
                    shows.add(idx)
        g.temperature += (target - g.temperature) * (1.0 - math.exp(-dt / _THERMAL_TIME_CONSTANT_S))
        temperature = float(round(min(84.0, g.temperature + rng.uniform(-0.7, 0.7) * k)))
        g.energy_j += power * dt
        g.memory_used = int(rng.uniform(60.0, 78.0) * _GIB) if busy else 512 << 20
        nvlink = tuple(
            NvLink(
                link=i,
                active=True,
                crc_flit_errors_total=g.nvlink_crc.get(i, 0),
                crc_data_errors_total=0,
                replay_errors_total=g.nvlink_crc.get(i, 0) // 4,
                recovery_errors_total=0,
            )
            for i in range(p.nvlinks)
        )
        gpu = Gpu(
            index=g.index,
            uuid=g.uuid,
            model=p.model,
            pci_bus_id=g.pci_bus_id,
            utilization_ratio=round(util, 2),
            memory_used_bytes=g.memory_used,
            memory_total_bytes=p.memory_bytes,
            temperature_celsius=temperature,
            memory_temperature_celsius=temperature + round(rng.uniform(*p.hbm_above_gpu_c)),
            power_watts=round(power, 3),
            power_limit_watts=p.power_limit_w,
            energy_joules_total=round(g.energy_j, 3),
            sm_clock_hz=clock,
            sm_clock_max_hz=p.sm_clock_max_hz,
            memory_clock_hz=p.memory_clock_hz,
            clock_event_reasons=reasons,
            performance_state=0,
            ecc_sbe_volatile_total=0,
            ecc_dbe_volatile_total=g.dbe_volatile,
            ecc_sbe_aggregate_total=g.sbe_aggregate,
            ecc_dbe_aggregate_total=g.dbe_aggregate,
            retired_pages_sbe=None,
            retired_pages_dbe=None,
            retired_pages_pending=None,
            remapped_rows_correctable=0,
            remapped_rows_uncorrectable=g.remapped_uncorrectable,
            remapped_rows_pending=g.remap_pending,
            remapped_rows_failure=g.remap_failure,
            pcie_link_gen=pcie_gen,
            pcie_link_gen_max=p.pcie_gen_max,
            pcie_link_width=width,
            pcie_link_width_max=p.pcie_width_max,
            pcie_replay_total=g.pcie_replay,
            nvlink=nvlink,
        )
        return gpu, shows

    def _nic(
        self, port: int, dt: float, busy: bool, rel: float, down: tuple[int, FaultSpec] | None
    ) -> tuple[Nic, set[int]]:
        rng, c = self.rng, self.ports[port]
        shows: set[int] = set()
        traffic = rng.uniform(5e9, 2.5e10) if busy else rng.uniform(1e4, 1e5)
        if down is None:
            for direction in ("xmit", "rcv"):
                sent = int(traffic * rng.uniform(0.8, 1.2) * dt)
                packets = sent // _IB_MTU_BYTES + 1
                c[f"port_{direction}_data"] += sent // 4
                c[f"port_{direction}_packets"] += packets
                c[f"unicast_{direction}_packets"] += packets
                c[f"multicast_{direction}_packets"] += rng.randint(0, 2)
            if busy:
                c["port_xmit_wait"] += rng.randint(0, 50_000)
            if rng.random() < 1e-3:
                c["symbol_error"] += 1
        else:
            shows.add(down[0])
        for idx, f in self._active(rel, "symbol_storm"):
            if f.port == port:
                grow = _poisson(self.rng, f.param("rate_per_s") * dt)
                if grow:
                    c["symbol_error"] += grow
                    c["port_rcv_errors"] += grow // 10
                    shows.add(idx)
        nic = Nic(
            device=f"mlx5_{port}",
            link_layer="InfiniBand",
            port=1,
            netdev=HGX_IPOIB_NETDEVS[port % len(HGX_IPOIB_NETDEVS)],
            state="DOWN" if down else "ACTIVE",
            phys_state="Polling" if down else "LinkUp",
            rate_bytes_per_second=self.profile.nic_rate_bytes_per_second,
            rx_bytes_total=c["port_rcv_data"] * 4,
            tx_bytes_total=c["port_xmit_data"] * 4,
            rx_packets_total=c["port_rcv_packets"],
            tx_packets_total=c["port_xmit_packets"],
            counters=dict(c),
        )
        return nic, shows

    def _probes(self, t: float, prev_t: float, busy: bool, rel: float) -> tuple[list[Probe], set[int]]:
        s, p, rng = self.s, self.profile, self.rng
        probes: list[Probe] = []
        shows: set[int] = set()
        if t >= self.next_local:
            self.next_local += s.local_every_s * math.ceil((t - self.next_local) / s.local_every_s + 1e-9)
            if not busy:
                when = round(t - rng.uniform(1.0, 5.0) + self.skew(t), 3)
                if any(g.lost for g in self.gpus):
                    probes.append(
                        Probe(
                            kind="nccl_allreduce_local",
                            time=when,
                            ok=False,
                            size_bytes=s.probe_size_bytes,
                            error="NCCL WARN Cuda failure 'no CUDA-capable device is detected'",
                        )
                    )
                else:
                    busbw = p.local_busbw_bytes_per_second * rng.gauss(1.0, p.probe_noise_ratio * s.noise)
                    for idx, f in self.faults:
                        if not f.active(rel):
                            continue
                        if f.kind == "slow_gpu":
                            busbw *= f.param("busbw_ratio")  # the ring waits on its slowest GPU
                            shows.add(idx)
                        elif f.kind == "power_brake":
                            busbw *= 0.5 + 0.5 * f.param("clock_ratio")
                        elif f.kind == "nvlink_crc":
                            busbw *= 0.97  # replays cost a little bandwidth
                    algbw = busbw / (2 * (p.gpus - 1) / p.gpus)
                    probes.append(
                        Probe(
                            kind="nccl_allreduce_local",
                            time=when,
                            ok=True,
                            size_bytes=s.probe_size_bytes,
                            busbw_bytes_per_second=round(busbw, 0),
                            duration_seconds=round(s.probe_size_bytes / algbw, 6),
                        )
                    )
        while self.next_pair < len(self.pair_probes) and self.pair_probes[self.next_pair].true_time <= t:
            plan = self.pair_probes[self.next_pair]
            self.next_pair += 1
            if plan.true_time > prev_t:
                probes.append(plan.probe_a if plan.a == self.name else plan.probe_b)
                shows |= plan.shows
        return probes, shows


def _poisson(rng: random.Random, mean: float) -> int:
    """A Poisson draw (normal approximation for large means, Knuth's method below)."""
    if mean > 30:
        return max(0, round(rng.gauss(mean, math.sqrt(mean))))
    limit, k, prod = math.exp(-mean), 0, rng.random()
    while prod > limit:
        k += 1
        prod *= rng.random()
    return k


# ---------------------------------------------------------------------------------------------
# The fleet


def _node_stream(
    s: Scenario,
    index: int,
    *,
    faults: list[tuple[int, FaultSpec]],
    silences: list[FaultSpec],
    timeline: _Timeline,
    pair_probes: list[PairProbe],
    jobs: JobFleet | None = None,
) -> Iterator[tuple[float, str, Delivery]]:
    node = _Node(s, index, faults, timeline, pair_probes, jobs=jobs)
    net = random.Random(f"gpuwarden-sim-net:{s.seed}:{node.name}")
    quiet = _quiet_windows(silences, s)
    end = s.start + s.duration_s
    pending: list[tuple[float, int, Delivery]] = []
    order = 0
    k = 0
    prev_t = s.start + node.phase - s.interval_s
    while True:
        t = round(s.start + node.phase + k * s.interval_s, 3)
        while pending and pending[0][0] <= t:
            receive, _, due = heapq.heappop(pending)
            yield receive, node.name, due
        if t > end:
            break
        made = node.sample(t, prev_t)
        prev_t = t
        k += 1
        # Drawn for every cycle, delivered or not, so one fault does not shift the others' luck.
        lost = net.random() < s.lost_fraction
        duplicate = net.random() < s.duplicate_fraction
        receive = t + net.random() * s.jitter_s
        retry = net.uniform(0.5, 5.0)
        if made is None or lost or any(t0 <= t < t1 for t0, t1 in quiet):
            continue
        report, shows = made
        heapq.heappush(pending, (receive, order, Delivery(round(receive, 3), report, frozenset(shows))))
        order += 1
        if duplicate:
            heapq.heappush(
                pending, (receive + retry, order, Delivery(round(receive + retry, 3), report, frozenset()))
            )
            order += 1
    while pending:
        receive, _, due = heapq.heappop(pending)
        yield receive, node.name, due


def _faults_by_node(s: Scenario) -> tuple[dict[str, list[tuple[int, FaultSpec]]], dict[str, list[FaultSpec]]]:
    """Each node's faults (with their scenario index), and the silences of each silenced node."""
    by_node: dict[str, list[tuple[int, FaultSpec]]] = {}
    silences: dict[str, list[FaultSpec]] = {}
    for idx, f in enumerate(s.faults):
        if f.fault_class == "silent":
            for name in silenced_nodes(s, f):
                silences.setdefault(name, []).append(f)
            continue
        for end in (f.node, f.peer):
            if end is not None:
                by_node.setdefault(end, []).append((idx, f))
    return by_node, silences


def place(s: Scenario) -> Scenario:
    """The scenario with every fault given by its leaf placed on two nodes (the same without any).

    A degraded link given as ``leaf`` goes on a pair of that leaf, of one pool, whose ends have no
    fault of their own and are not silenced, chosen (per seed) among the pairs the probe plan
    measures at least twice in the first half of the fault's time in the trace (so that its
    detection window fits in the trace), else once then, else once at all, else among them all.
    A link is found from pair probes alone and probes run on idle nodes only: with its ends fixed,
    whether any probe ever crosses the link depends on the seed's jobs (both ends idle at the
    same time), and a benchmark over seeds would mostly count luck. The plan is the one without
    the placed links; with them it differs by the confirm re-probes their slow results ask for
    (which can take a rotation probe's place).
    """
    todo = [i for i, f in enumerate(s.faults) if f.leaf is not None and f.node is None]
    if not todo:
        return s
    base = replace(s, faults=tuple(f for i, f in enumerate(s.faults) if i not in todo))
    by_node, silences = _faults_by_node(base)
    names = s.node_names()
    timelines = _timelines(s)
    plans = _plan_pair_probes(base, timelines, by_node, silences)
    taken = set(by_node) | set(silences)
    faults = list(s.faults)
    for i in todo:
        f = faults[i]
        members = [
            (n, s.pool_of(k).name) for k, n in enumerate(names) if s.leaf_of(k) == f.leaf and n not in taken
        ]
        pairs = sorted((a, b) for j, (a, pa) in enumerate(members) for b, pb in members[j + 1 :] if pa == pb)
        if not pairs:
            raise ConfigError(f"{f.kind} on {f.leaf}: no two healthy nodes of one pool in that leaf")
        t0 = s.start + f.at_s
        t1 = s.start + min(s.duration_s, f.until_s if f.until_s is not None else math.inf)
        early: dict[tuple[str, str], int] = {}
        ever: dict[tuple[str, str], int] = {}
        for lst in plans.values():
            for p in lst:  # each probe is in both ends' lists: two entries per measurement
                if t0 <= p.true_time < t1:
                    ever[(p.a, p.b)] = ever.get((p.a, p.b), 0) + 1
                    if p.true_time < (t0 + t1) / 2:
                        early[(p.a, p.b)] = early.get((p.a, p.b), 0) + 1
        for counts, least in ((early, 4), (early, 2), (ever, 2), (ever, 0)):
            chosen = [pair for pair in pairs if counts.get(pair, 0) >= least]
            if chosen:
                break
        a, b = random.Random(f"gpuwarden-sim-place:{s.seed}:{i}").choice(chosen)
        faults[i] = replace(f, node=a, peer=b)
        taken.update((a, b))
    return replace(s, faults=tuple(faults))


def simulate(s: Scenario) -> Iterator[Delivery]:
    """Every delivery of the whole fleet in receive order (ties by node name); ``place`` first."""
    s.validate()
    s = place(s)
    names = s.node_names()
    by_node, silences = _faults_by_node(s)
    timelines = _timelines(s)
    pairs = _plan_pair_probes(s, timelines, by_node, silences)
    jobs = job_fleet(s)
    streams = [
        _node_stream(
            s,
            i,
            faults=[x for x in by_node.get(n, []) if x[1].node == n],
            silences=silences.get(n, []),
            timeline=timelines[n],
            pair_probes=pairs.get(n, []),
            jobs=jobs,
        )
        for i, n in enumerate(names)
    ]
    for _, _, delivery in heapq.merge(*streams, key=lambda item: (item[0], item[1])):
        yield delivery
