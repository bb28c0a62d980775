"""Deterministic synthetic traces: a fleet of H100 nodes reporting, with faults and look-alikes.

``generate(scenario)`` yields ``(receive_time, report)`` in the order an aggregator would receive
them; ``write_trace(path, scenario)`` writes the reports as a JSON Lines trace (gzip when the name
ends in ``.gz``) that ``gpuwarden replay`` reads. The same scenario gives the same bytes: every
random draw comes from a ``random.Random`` seeded with the scenario's seed and the node's name, so
one node's data does not change when another node or a fault elsewhere is added, and the delivery
draws (lost, duplicated, jitter) have their own generator, so a lossy trace carries the very same
readings as a clean one.

What it models
--------------
- Nodes ``gpu-0000``, ``gpu-0001``, ... labelled ``pool``, ``rack`` (``nodes_per_rack`` nodes per
  rack, ``rack-000``) and ``leaf`` (``racks_per_leaf`` racks per leaf switch, ``leaf-00``), each
  reporting every ``interval_s`` at its own phase (agents are not synchronised).
- 8 H100 SXM GPUs per node (an HGX board: its PCI bus ids, 80 GB HBM3, 700 W limit, 1980 MHz max
  SM clock, PCIe gen5 x16, 18 active NVLinks), driven by a simple job model: a node is busy or
  idle for stretches (exponential, means ``busy_mean_s`` and ``idle_mean_s``). Busy GPUs run at
  85-100 % utilisation, 450-650 W, the SM clock at or near its maximum (a few steps lower, with the
  software power cap bit, near the top of the power range); idle GPUs draw 65-80 W at 345 MHz
  with the idle bit set and their PCIe link down to gen 1 (power management; the width stays 16).
  Temperatures follow power with a first-order lag, 30-75 C. Energy accumulates. ECC, remapping,
  PCIe replay and NVLink error counters stay zero (an aggregate single-bit count from the
  GPU's past may be non-zero, as on real boards).
- 8 InfiniBand NDR ports ``mlx5_0``..``mlx5_7`` (port 1, IPoIB ``ib0``..``ib7``), ACTIVE/LinkUp at
  400 Gb/s (5.0e10 bytes/s), with the IBTA and mlx5 counters the agent sends: data and packet
  counters grow with the job's traffic (``port_*_data`` in 4-byte words as the kernel keeps them,
  ``rx/tx_bytes_total`` in bytes), ``port_xmit_wait`` with congestion while busy, a rare symbol
  error (far below the 1e-12 bit error budget), every other error counter zero.
- Faults, as data (``Scenario.events``; times are seconds after ``Scenario.start``, in true time):
  ``xid79`` (the XID 79 event in the first report after it; the GPU is missing from the later
  reports of that boot, with the NVML collector's error "GPU 3 (<uuid>, <bus id>): GPU is lost"),
  ``dbe`` (volatile and aggregate DBE counts up, a row remapped and pending, XID 48; a reboot
  resets the GPU: volatile count zero, remapping done), ``remap_failure`` (``remapped_rows_failure``
  true and one more uncorrectable remapped row, for good: reboots do not repair it),
  ``ib_port_down`` (state DOWN, phys_state Polling or Disabled, no traffic, ``link_downed`` + 1,
  until ``until`` if given), ``app_xid`` (an application XID 13/31/43/45, nothing else changes),
  ``reboot`` (no reports for ``down_s``, then a new ``boot_id``, ``seq`` from 0, every counter from
  0, a lost GPU back), ``clock_skew`` (the node's clock, hence its report and event times, is off
  by that many seconds), ``silent`` (a node, rack or leaf delivers nothing between two times: a
  network partition; the node keeps running and numbering its reports, and nothing of the gap is
  delivered later).
- Delivery: receive time = true time + a uniform jitter in ``[0, receive_jitter_s]``; a
  ``lost_fraction`` of reports never arrives; a ``duplicate_fraction`` arrives twice (the second
  copy 0.5-5 s later, as an agent's retry after a lost acknowledgement).

What it does not model
----------------------
Per-GPU job placement (a job takes the whole node), thermal or power faults, NVLink or PCIe error
growth, congestion-driven discards, agent collector failures other than a lost GPU, the agent
spooling and re-sending reports after an outage, Ethernet/RoCE NICs, MIG, and any correlation
between nodes (no job spans nodes; a rack is silent only when a scenario says so). It is a
plausible healthy background with the faults one asks for, not a fleet simulator.
"""

from __future__ import annotations

import gzip
import heapq
import math
import random
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

import msgspec

from agent.errors import ConfigError
from agent.report import SCHEMA_ID, CollectorError, Event, Gpu, Nic, NvLink, Report, encode
from sim.profiles import IB_PORT_COUNTERS

__all__ = [
    "APP_XIDS",
    "START_TIME",
    "AppXid",
    "ClockSkew",
    "Dbe",
    "Fault",
    "IbPortDown",
    "Reboot",
    "RemapFailure",
    "Scenario",
    "Silent",
    "Xid79",
    "app_xid",
    "clock_skew",
    "dbe",
    "generate",
    "ib_port_down",
    "leaf_name",
    "node_name",
    "rack_name",
    "reboot",
    "remap_failure",
    "silent",
    "write_trace",
    "xid79",
]

START_TIME: Final = 1_764_000_000.0  # 2025-11-24 16:00:00 UTC
_EARLIEST_START: Final = 1_577_836_800.0  # 2020: the aggregator refuses report times before it
APP_XIDS: Final = frozenset({13, 31, 43, 45})  # application errors: never a reason to quarantine

H100_MODEL: Final = "NVIDIA H100 80GB HBM3"
H100_MEMORY_BYTES: Final = 85_520_809_984  # 81,559 MiB, as NVML reports an H100 SXM 80GB
H100_SM_CLOCK_MAX_HZ: Final = 1.98e9
H100_SM_CLOCK_IDLE_HZ: Final = 345e6
H100_MEMORY_CLOCK_HZ: Final = 2.619e9
H100_POWER_LIMIT_W: Final = 700.0
H100_NVLINKS: Final = 18
# An HGX H100 board's GPUs, in NVML index order.
HGX_PCI_BUS_IDS: Final = (
    "00000000:18:00.0",
    "00000000:2A:00.0",
    "00000000:3A:00.0",
    "00000000:5D:00.0",
    "00000000:9A:00.0",
    "00000000:AB:00.0",
    "00000000:BA:00.0",
    "00000000:DB:00.0",
)
NDR_BYTES_PER_SECOND: Final = 5.0e10  # "400 Gb/sec (4X NDR)"
IB_MTU_BYTES: Final = 4096

_IDLE_BIT: Final = 0x1  # nvmlClocksEventReasonGpuIdle
_SW_POWER_CAP_BIT: Final = 0x4  # nvmlClocksEventReasonSwPowerCap
_THERMAL_TIME_CONSTANT_S: Final = 90.0
_GIB: Final = 1 << 30

# The simulator's port counters, and the RDMA transport errors the tests' rules also read.
_IB_COUNTERS: Final = (
    *IB_PORT_COUNTERS,
    "duplicate_request",
    "implied_nak_seq_err",
    "local_ack_timeout_err",
    "rnr_nak_retry_err",
)

_APP_XID_TEXT: Final[Mapping[int, str]] = {
    13: "Graphics SM Warp Exception on (GPC 1, TPC 2, SM 0): Out Of Range Address",
    31: "MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f3a_9e000000. Fault is of type "
    "FAULT_PDE ACCESS_TYPE_VIRT_READ",
    43: "Ch 00000008, errorString CTX SWITCH TIMEOUT, Info 0x4c025",
    45: "Ch 00000010, intr 00000000. Preemptive Cleanup, due to previous errors -- Most likely "
    "a user application fault",
}


def node_name(index: int) -> str:
    return f"gpu-{index:04d}"


def rack_name(index: int) -> str:
    return f"rack-{index:03d}"


def leaf_name(index: int) -> str:
    return f"leaf-{index:02d}"


# ---------------------------------------------------------------------------------------------
# Faults and look-alikes


@dataclass(frozen=True)
class Xid79:
    node: str
    gpu: int
    t: float


@dataclass(frozen=True)
class Dbe:
    node: str
    gpu: int
    t: float


@dataclass(frozen=True)
class RemapFailure:
    node: str
    gpu: int
    t: float


@dataclass(frozen=True)
class IbPortDown:
    node: str
    port: int  # the port's index: mlx5_<port>
    t: float
    until: float | None = None
    phys_state: Literal["Polling", "Disabled"] = "Polling"


@dataclass(frozen=True)
class AppXid:
    node: str
    gpu: int
    code: int
    t: float


@dataclass(frozen=True)
class Reboot:
    node: str
    t: float
    down_s: float = 30.0


@dataclass(frozen=True)
class ClockSkew:
    node: str
    seconds: float


@dataclass(frozen=True)
class Silent:
    target: str  # a node, a rack or a leaf
    t0: float
    t1: float


_TimedFault = Xid79 | Dbe | RemapFailure | IbPortDown | AppXid | Reboot  # happens to a node at t
Fault = _TimedFault | ClockSkew | Silent


def xid79(node: str, gpu: int, t: float) -> Xid79:
    """GPU ``gpu`` falls off the bus ``t`` seconds into the trace."""
    return Xid79(node, gpu, t)


def dbe(node: str, gpu: int, t: float) -> Dbe:
    """An uncorrectable (double-bit) ECC error, with its XID 48."""
    return Dbe(node, gpu, t)


def remap_failure(node: str, gpu: int, t: float) -> RemapFailure:
    """A row remapping fails: the bank is out of spare rows."""
    return RemapFailure(node, gpu, t)


def ib_port_down(
    node: str,
    port: int | str,
    t: float,
    *,
    until: float | None = None,
    phys_state: Literal["Polling", "Disabled"] = "Polling",
) -> IbPortDown:
    """Port ``mlx5_<port>`` (an index or the device name) goes DOWN at ``t`` (up again at ``until``)."""
    if isinstance(port, str):
        if not port.startswith("mlx5_") or not port[5:].isdigit():
            raise ConfigError(f"ib_port_down: port {port!r} is not mlx5_<N>")
        port = int(port[5:])
    return IbPortDown(node, port, t, until, phys_state)


def app_xid(node: str, gpu: int, code: int, t: float) -> AppXid:
    """An application XID (13, 31, 43 or 45): a job's fault, not the GPU's."""
    return AppXid(node, gpu, code, t)


def reboot(node: str, t: float, *, down_s: float = 30.0) -> Reboot:
    """The node reboots at ``t`` and reports again ``down_s`` later with a new boot."""
    return Reboot(node, t, down_s)


def clock_skew(node: str, seconds: float) -> ClockSkew:
    """The node's clock is ``seconds`` ahead (negative: behind) for the whole trace."""
    return ClockSkew(node, seconds)


def silent(target: str, t0: float, t1: float) -> Silent:
    """Nothing from ``target`` (a node, rack or leaf name) arrives between ``t0`` and ``t1``."""
    return Silent(target, t0, t1)


# ---------------------------------------------------------------------------------------------
# The scenario


@dataclass(frozen=True)
class Scenario:
    """A fleet and what happens to it. Event times are seconds after ``start``, in true time (a
    skewed node's reports carry its own clock); ``duration_s`` is the length of the trace."""

    nodes: int = 16
    duration_s: float = 1800.0
    interval_s: float = 10.0
    seed: int = 0
    start: float = START_TIME
    gpus: int = 8
    nics: int = 8
    nodes_per_rack: int = 8
    racks_per_leaf: int = 2
    pool: str = "h100-sxm"
    receive_jitter_s: float = 0.5
    lost_fraction: float = 0.0
    duplicate_fraction: float = 0.0
    busy_mean_s: float = 1200.0
    idle_mean_s: float = 300.0
    events: Sequence[Fault] = field(default_factory=tuple)

    def node_names(self) -> list[str]:
        return [node_name(i) for i in range(self.nodes)]

    def _labels_of(self, index: int) -> dict[str, str]:
        rack = index // self.nodes_per_rack
        return {"pool": self.pool, "rack": rack_name(rack), "leaf": leaf_name(rack // self.racks_per_leaf)}

    def labels(self, node: str) -> dict[str, str]:
        """The node's ``pool``, ``rack`` and ``leaf`` labels, as its agent sends them."""
        names = self.node_names()
        if node not in names:
            raise ConfigError(f"scenario: unknown node {node!r}")
        return self._labels_of(names.index(node))

    def members(self, target: str) -> list[str]:
        """The nodes a node, rack or leaf name stands for (empty for an unknown name)."""
        return [
            name
            for i, name in enumerate(self.node_names())
            if target == name or target in (self._labels_of(i)["rack"], self._labels_of(i)["leaf"])
        ]

    def validate(self) -> None:
        """``ConfigError`` naming what is wrong; the generator never guesses at a bad scenario."""
        if self.nodes < 1 or self.nodes > 10_000:
            raise ConfigError(f"scenario: nodes must be 1..10000, got {self.nodes}")
        if not 1 <= self.gpus <= len(HGX_PCI_BUS_IDS):
            raise ConfigError(
                f"scenario: gpus must be 1..{len(HGX_PCI_BUS_IDS)} (an HGX board), got {self.gpus}"
            )
        if not 0 <= self.nics <= 64:
            raise ConfigError(f"scenario: nics must be 0..64, got {self.nics}")
        if not (math.isfinite(self.start) and self.start >= _EARLIEST_START):
            raise ConfigError(f"scenario: start must be unix seconds after 2020, got {self.start!r}")
        positive = {
            "duration_s": self.duration_s,
            "interval_s": self.interval_s,
            "nodes_per_rack": self.nodes_per_rack,
            "racks_per_leaf": self.racks_per_leaf,
            "busy_mean_s": self.busy_mean_s,
            "idle_mean_s": self.idle_mean_s,
        }
        for name, value in positive.items():
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"scenario: {name} must be a positive number, got {value!r}")
        if not (math.isfinite(self.receive_jitter_s) and self.receive_jitter_s >= 0):
            raise ConfigError(f"scenario: receive_jitter_s must be >= 0, got {self.receive_jitter_s!r}")
        for name, value in (
            ("lost_fraction", self.lost_fraction),
            ("duplicate_fraction", self.duplicate_fraction),
        ):
            if not 0 <= value < 1:
                raise ConfigError(f"scenario: {name} must be in [0, 1), got {value!r}")
        names = set(self.node_names())
        for i, ev in enumerate(self.events):
            self._validate_event(i, ev, names)

    def _validate_event(self, i: int, ev: Fault, names: set[str]) -> None:
        where = f"scenario event {i} ({type(ev).__name__})"
        if isinstance(ev, Silent):
            if not self.members(ev.target):
                raise ConfigError(f"{where}: {ev.target!r} is no node, rack or leaf of this scenario")
            if not 0 <= ev.t0 < ev.t1:
                raise ConfigError(f"{where}: needs 0 <= t0 < t1, got {ev.t0}, {ev.t1}")
            return
        if ev.node not in names:
            raise ConfigError(
                f"{where}: unknown node {ev.node!r} (nodes are gpu-0000..{node_name(self.nodes - 1)})"
            )
        if isinstance(ev, ClockSkew):
            if not math.isfinite(ev.seconds) or abs(ev.seconds) > 86_400:
                raise ConfigError(f"{where}: skew must be within a day, got {ev.seconds!r}")
            return
        if not (math.isfinite(ev.t) and 0 <= ev.t <= self.duration_s):
            raise ConfigError(f"{where}: t must be within 0..{self.duration_s}, got {ev.t!r}")
        if isinstance(ev, Xid79 | Dbe | RemapFailure | AppXid) and not 0 <= ev.gpu < self.gpus:
            raise ConfigError(f"{where}: GPU {ev.gpu} is not one of the node's {self.gpus}")
        if isinstance(ev, AppXid) and ev.code not in APP_XIDS:
            raise ConfigError(f"{where}: XID {ev.code} is not an application XID {sorted(APP_XIDS)}")
        if isinstance(ev, IbPortDown):
            if not 0 <= ev.port < self.nics:
                raise ConfigError(f"{where}: port mlx5_{ev.port} is not one of the node's {self.nics}")
            if ev.until is not None and not ev.until > ev.t:
                raise ConfigError(f"{where}: until must come after t, got {ev.until!r}")
        if isinstance(ev, Reboot) and not (math.isfinite(ev.down_s) and ev.down_s >= 0):
            raise ConfigError(f"{where}: down_s must be >= 0, got {ev.down_s!r}")


# ---------------------------------------------------------------------------------------------
# One node


@dataclass
class _GpuState:
    index: int
    uuid: str
    pci_bus_id: str
    temperature: float
    memory_used: int
    sbe_aggregate: int
    dbe_aggregate: int = 0
    dbe_volatile: int = 0
    energy_j: float = 0.0
    remapped_uncorrectable: int = 0
    remap_pending: bool = False
    remap_failure: bool = False
    lost: bool = False


@dataclass
class _PortState:
    index: int
    down: bool = False
    phys_state: str = "LinkUp"
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_IB_COUNTERS, 0))


_HEALTHY_NVLINKS: Final = tuple(
    NvLink(
        link=i,
        active=True,
        crc_flit_errors_total=0,
        crc_data_errors_total=0,
        replay_errors_total=0,
        recovery_errors_total=0,
    )
    for i in range(H100_NVLINKS)
)


def _kernel_bus_id(pci_bus_id: str) -> str:
    """How the driver names a GPU in an XID line: ``00000000:5D:00.0`` -> ``PCI:0000:5d:00``."""
    domain, bus, dev_fn = pci_bus_id.split(":")
    return f"PCI:{domain[-4:]}:{bus.lower()}:{dev_fn.split('.')[0]}"


class _Node:
    """One node's hardware and agent: its own random stream, its faults in time order."""

    def __init__(self, scenario: Scenario, index: int, faults: list[Fault]) -> None:
        self.s = scenario
        self.name = node_name(index)
        self.labels = scenario._labels_of(index)
        self.rng = random.Random(f"gpuwarden-tracegen:{scenario.seed}:{self.name}")
        self.phase = round(self.rng.uniform(0.0, scenario.interval_s), 3)
        self.skew = sum(f.seconds for f in faults if isinstance(f, ClockSkew))
        self.faults: list[_TimedFault] = sorted(
            (f for f in faults if not isinstance(f, ClockSkew | Silent)), key=lambda f: f.t
        )
        self.next_fault = 0
        self.down_until: float | None = None
        self.ports_down_until: dict[int, float] = {}
        self.pending_events: list[Event] = []
        self.lose_next: set[int] = set()
        self.gpus = [
            _GpuState(
                index=i,
                uuid=f"GPU-{uuid.UUID(int=self.rng.getrandbits(128), version=4)}",
                pci_bus_id=HGX_PCI_BUS_IDS[i],
                temperature=self.rng.uniform(30.0, 36.0),
                memory_used=0,
                sbe_aggregate=self.rng.choice((0, 0, 0, 0, 0, 1, 2, 5)),
            )
            for i in range(scenario.gpus)
        ]
        self.ports: list[_PortState] = []
        self.busy = self.rng.random() < scenario.busy_mean_s / (scenario.busy_mean_s + scenario.idle_mean_s)
        self.job_until = scenario.start + self.rng.expovariate(
            1.0 / (scenario.busy_mean_s if self.busy else scenario.idle_mean_s)
        )
        self.traffic = 0.0  # bytes per second per port and direction of the current job
        self.boot_id = ""
        self.seq = 0
        self._boot()
        self._start_job_stretch(self.busy)

    # -- lifecycle ------------------------------------------------------------------------------

    def _boot(self) -> None:
        self.boot_id = str(uuid.UUID(int=self.rng.getrandbits(128), version=4))
        self.seq = 0
        for g in self.gpus:
            # A reboot resets every GPU: volatile counts and energy from zero, a pending remapping
            # done, a lost GPU back on the bus. What the board keeps (aggregates, failures) stays.
            g.dbe_volatile = 0
            g.energy_j = 0.0
            g.remap_pending = False
            g.lost = False
        self.lose_next.clear()
        downs = {p.index: (p.down, p.phys_state) for p in self.ports}
        self.ports = [_PortState(i) for i in range(self.s.nics)]
        for p in self.ports:
            # A port down for a cause outside the node (a cable, the switch) stays down.
            p.down, p.phys_state = downs.get(p.index, (False, "LinkUp"))

    def _start_job_stretch(self, busy: bool) -> None:
        self.busy = busy
        for g in self.gpus:
            g.memory_used = int(self.rng.uniform(60.0, 78.0) * _GIB) if busy else 512 << 20
        self.traffic = self.rng.uniform(5e9, 2.5e10) if busy else self.rng.uniform(1e4, 1e5)

    def _advance_jobs(self, t: float) -> None:
        while t >= self.job_until:
            busy = not self.busy
            self._start_job_stretch(busy)
            self.job_until += self.rng.expovariate(1.0 / (self.s.busy_mean_s if busy else self.s.idle_mean_s))

    # -- faults ---------------------------------------------------------------------------------

    def _apply(self, f: _TimedFault) -> None:
        when = round(self.s.start + f.t + self.skew, 3)  # on the node's clock, as its kernel logs it
        if isinstance(f, Xid79):
            g = self.gpus[f.gpu]
            self.pending_events.append(
                self._xid(79, g, when, "pid='<unknown>', name=<unknown>, GPU has fallen off the bus.")
            )
            # NVML read the GPU earlier in the cycle that logged the XID: it is lost from the next.
            self.lose_next.add(g.index)
        elif isinstance(f, Dbe):
            g = self.gpus[f.gpu]
            g.dbe_volatile += 1
            g.dbe_aggregate += 1
            g.remapped_uncorrectable += 1
            g.remap_pending = True
            self.pending_events.append(
                self._xid(
                    48,
                    g,
                    when,
                    f"pid={self.rng.randint(1000, 99999)}, name=python3, An uncorrectable double bit "
                    "error (DBE) has been detected on GPU in the framebuffer at partition 0, subpartition 0.",
                )
            )
        elif isinstance(f, RemapFailure):
            g = self.gpus[f.gpu]
            g.remapped_uncorrectable += 1
            g.remap_failure = True
        elif isinstance(f, IbPortDown):
            p = self.ports[f.port]
            if not p.down:
                p.counters["link_downed"] += 1
            p.down = True
            p.phys_state = f.phys_state
            if f.until is not None:
                self.ports_down_until[f.port] = f.until
        elif isinstance(f, AppXid):
            g = self.gpus[f.gpu]
            pid = self.rng.randint(1000, 99999)
            self.pending_events.append(
                self._xid(f.code, g, when, f"pid={pid}, name=python3, {_APP_XID_TEXT[f.code]}")
            )
        elif isinstance(f, Reboot):
            self.down_until = f.t + f.down_s

    @staticmethod
    def _xid(code: int, g: _GpuState, when: float, text: str) -> Event:
        return Event(
            kind="xid",
            time=when,
            gpu=g.index,
            code=code,
            message=f"NVRM: Xid ({_kernel_bus_id(g.pci_bus_id)}): {code}, {text}",
        )

    def _due_faults(self, rel: float) -> bool:
        """Apply the faults due by ``rel``; False while the node is down rebooting."""
        while True:
            if self.down_until is not None:
                if rel < self.down_until:
                    return False
                self.down_until = None
                self._boot()
                # The scheduler gives a rebooted node a new job only after a while.
                self._start_job_stretch(False)
                self.job_until = self.s.start + rel + self.rng.expovariate(1.0 / self.s.idle_mean_s)
            if self.next_fault >= len(self.faults) or self.faults[self.next_fault].t > rel:
                break
            f = self.faults[self.next_fault]
            self.next_fault += 1
            self._apply(f)
        for port, until in list(self.ports_down_until.items()):
            if rel >= until:
                self.ports[port].down = False
                self.ports[port].phys_state = "LinkUp"
                del self.ports_down_until[port]
        return True

    # -- one cycle ------------------------------------------------------------------------------

    def sample(self, t: float, dt: float) -> Report | None:
        """The report of the cycle at true time ``t`` (None while the node is down)."""
        rel = t - self.s.start
        if not self._due_faults(rel):
            return None
        self._advance_jobs(t)
        gpus = [self._gpu(g, dt) for g in self.gpus if not g.lost]
        nics = [self._nic(p, dt) for p in self.ports]
        errors = [
            CollectorError(collector="nvml", message=f"GPU {g.index} ({g.uuid}, {g.pci_bus_id}): GPU is lost")
            for g in self.gpus
            if g.lost
        ]
        events, self.pending_events = self.pending_events, []
        report = Report(
            schema=SCHEMA_ID,
            node=self.name,
            time=round(t + self.skew, 3),
            seq=self.seq,
            boot_id=self.boot_id,
            gpus=gpus,
            nics=nics,
            agent_version="tracegen",
            interval_seconds=self.s.interval_s,
            labels=dict(self.labels),
            events=events if events else msgspec.UNSET,
            errors=errors if errors else msgspec.UNSET,
        )
        self.seq += 1
        for index in self.lose_next:
            self.gpus[index].lost = True
        self.lose_next.clear()
        return report

    def _gpu(self, g: _GpuState, dt: float) -> Gpu:
        rng = self.rng
        if self.busy:
            util = rng.uniform(0.3, 0.6) if rng.random() < 0.05 else rng.uniform(0.85, 1.0)
            power = min(650.0, 70.0 + util * rng.uniform(440.0, 580.0))
            capped = power > 615.0
            sm_clock = (1980 - 15 * rng.randint(1, 10)) * 1e6 if capped else H100_SM_CLOCK_MAX_HZ
            reasons = _SW_POWER_CAP_BIT if capped else 0
            pcie_gen = 5
        else:
            util = 0.0
            power = rng.uniform(65.0, 80.0)
            sm_clock = H100_SM_CLOCK_IDLE_HZ
            reasons = _IDLE_BIT
            pcie_gen = 1
        target = 28.0 + power / 650.0 * 45.0
        g.temperature += (target - g.temperature) * (1.0 - math.exp(-dt / _THERMAL_TIME_CONSTANT_S))
        temperature = float(min(75, max(30, round(g.temperature + rng.uniform(-1.0, 1.0)))))
        g.energy_j += power * dt
        return Gpu(
            index=g.index,
            uuid=g.uuid,
            model=H100_MODEL,
            pci_bus_id=g.pci_bus_id,
            utilization_ratio=round(util, 2),
            memory_used_bytes=g.memory_used,
            memory_total_bytes=H100_MEMORY_BYTES,
            temperature_celsius=temperature,
            memory_temperature_celsius=temperature + 6.0,
            power_watts=round(power, 3),
            power_limit_watts=H100_POWER_LIMIT_W,
            energy_joules_total=round(g.energy_j, 3),
            sm_clock_hz=sm_clock,
            sm_clock_max_hz=H100_SM_CLOCK_MAX_HZ,
            memory_clock_hz=H100_MEMORY_CLOCK_HZ,
            clock_event_reasons=reasons,
            performance_state=0,
            ecc_sbe_volatile_total=0,
            ecc_dbe_volatile_total=g.dbe_volatile,
            ecc_sbe_aggregate_total=g.sbe_aggregate,
            ecc_dbe_aggregate_total=g.dbe_aggregate,
            retired_pages_sbe=None,  # H100 remaps rows; page retirement is NOT_SUPPORTED
            retired_pages_dbe=None,
            retired_pages_pending=None,
            remapped_rows_correctable=0,
            remapped_rows_uncorrectable=g.remapped_uncorrectable,
            remapped_rows_pending=g.remap_pending,
            remapped_rows_failure=g.remap_failure,
            pcie_link_gen=pcie_gen,
            pcie_link_gen_max=5,
            pcie_link_width=16,
            pcie_link_width_max=16,
            pcie_replay_total=0,
            nvlink=list(_HEALTHY_NVLINKS),
        )

    def _nic(self, p: _PortState, dt: float) -> Nic:
        rng = self.rng
        c = p.counters
        if not p.down:
            for direction in ("xmit", "rcv"):
                sent = int(self.traffic * rng.uniform(0.8, 1.2) * dt)
                packets = sent // IB_MTU_BYTES + 1
                c[f"port_{direction}_data"] += sent // 4
                c[f"port_{direction}_packets"] += packets
                c[f"unicast_{direction}_packets"] += packets
                c[f"multicast_{direction}_packets"] += rng.randint(0, 2)
            if self.busy:
                c["port_xmit_wait"] += rng.randint(0, 50_000)
            if rng.random() < 1e-3:
                c["symbol_error"] += 1
        return Nic(
            device=f"mlx5_{p.index}",
            link_layer="InfiniBand",
            port=1,
            netdev=f"ib{p.index}",
            state="DOWN" if p.down else "ACTIVE",
            phys_state=p.phys_state,
            rate_bytes_per_second=NDR_BYTES_PER_SECOND,
            rx_bytes_total=c["port_rcv_data"] * 4,
            tx_bytes_total=c["port_xmit_data"] * 4,
            rx_packets_total=c["port_rcv_packets"],
            tx_packets_total=c["port_xmit_packets"],
            counters=dict(c),
        )


# ---------------------------------------------------------------------------------------------
# The fleet


def _node_stream(
    scenario: Scenario, index: int, faults: list[Fault], silences: list[Silent]
) -> Iterator[tuple[float, str, Report]]:
    """One node's deliveries, ``(receive_time, node, report)`` in receive order."""
    node = _Node(scenario, index, faults)
    net = random.Random(f"gpuwarden-tracegen-net:{scenario.seed}:{node.name}")
    quiet = [(scenario.start + s.t0, scenario.start + s.t1) for s in silences]
    end = scenario.start + scenario.duration_s
    pending: list[tuple[float, int, Report]] = []
    order = 0
    k = 0
    while True:
        t = round(scenario.start + node.phase + k * scenario.interval_s, 3)
        # Everything due before this cycle's true time is final: later reports arrive later.
        while pending and pending[0][0] <= t:
            receive, _, due = heapq.heappop(pending)
            yield receive, node.name, due
        if t > end:
            break
        report = node.sample(t, scenario.interval_s)
        k += 1
        # Drawn for every cycle, delivered or not, so one fault does not shift the others' luck.
        lost = net.random() < scenario.lost_fraction
        duplicate = net.random() < scenario.duplicate_fraction
        receive = t + net.random() * scenario.receive_jitter_s
        retry = net.uniform(0.5, 5.0)
        if report is None or lost or any(t0 <= t < t1 for t0, t1 in quiet):
            continue
        heapq.heappush(pending, (receive, order, report))
        order += 1
        if duplicate:
            heapq.heappush(pending, (receive + retry, order, report))
            order += 1
    while pending:
        receive, _, due = heapq.heappop(pending)
        yield receive, node.name, due


def generate(scenario: Scenario) -> Iterator[tuple[float, Report]]:
    """``(receive_time, report)`` for the whole fleet in receive order (ties by node name).

    Raises ``ConfigError`` for a scenario that names unknown nodes, GPUs or ports or has
    impossible parameters, before anything is generated.
    """
    scenario.validate()
    faults: dict[str, list[Fault]] = {}
    silences: dict[str, list[Silent]] = {}
    for ev in scenario.events:
        if isinstance(ev, Silent):
            for name in scenario.members(ev.target):
                silences.setdefault(name, []).append(ev)
        else:
            faults.setdefault(ev.node, []).append(ev)
    streams = [
        _node_stream(scenario, i, faults.get(name, []), silences.get(name, []))
        for i, name in enumerate(scenario.node_names())
    ]
    for receive, _, report in heapq.merge(*streams, key=lambda item: (item[0], item[1])):
        yield receive, report


def write_trace(path: Path | str, scenario: Scenario) -> int:
    """Write the scenario's reports, in receive order, as a JSON Lines trace; the number written.

    ``.gz`` names get gzip with a zero timestamp and no file name in the header, so the same
    scenario writes the same bytes.
    """
    path = Path(path)
    count = 0
    with path.open("wb") as raw:
        if path.name.endswith(".gz"):
            with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
                for _, report in generate(scenario):
                    gz.write(encode(report) + b"\n")
                    count += 1
        else:
            for _, report in generate(scenario):
                raw.write(encode(report) + b"\n")
                count += 1
    return count
