"""Realistic node reports for the aggregator benchmarks: an HGX H100 node as the agent sees it.

Each simulated node has 8 H100 GPUs (every field the agent fills, 18 NVLinks each) and 8 NDR
InfiniBand ports (mlx5, 400 Gb/s) with the counters an mlx5 port exposes under ``counters/`` and
``hw_counters/`` (52 of them, the set the agent reads from ``tests/fixtures/sysfs/h100``). Values
differ per node (seeded per node, so runs are repeatable) and move over time the way a real node's
do: jobs start and stop, so utilization, power, clocks, temperatures and traffic follow them;
energy and traffic counters only ever grow; a few benign error counters creep up now and then.

A healthy node trips no rule. ``Fault`` makes one node misbehave from a given round on, so a
trace exercises the rule engine and the health state machine as a real incident would.

Reports are built with the ``agent.report`` types, exactly as the agent builds them, so what is
encoded here is byte for byte the shape that goes on the wire.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Final

from msgspec import UNSET

from agent.report import SCHEMA_ID, Event, Gpu, Nic, NvLink, Report
from sim.profiles import (
    HGX_IPOIB_NETDEVS,
    HGX_PCI_BUS_IDS,
    IB_PORT_ERROR_COUNTERS,
    MLX5_PORT_COUNTERS,
    MLX5_PORT_HW_COUNTERS,
    MLX5_REQUEST_COUNTERS,
    known_counters,
)

GPUS: Final = 8
NVLINKS: Final = 18  # fourth-generation NVLink on H100 SXM
NICS: Final = 8
GPU_MODEL: Final = "NVIDIA H100 80GB HBM3"
MEMORY_TOTAL_BYTES: Final = 85_520_809_984
POWER_LIMIT_W: Final = 700.0
SM_CLOCK_MAX_HZ: Final = 1_980_000_000.0
MEMORY_CLOCK_HZ: Final = 2_619_000_000.0
NDR_BYTES_PER_SECOND: Final = 50_000_000_000.0  # 400 Gb/s
MTU_BYTES: Final = 4096
AGENT_VERSION: Final = "0.1.0"
NODES_PER_RACK: Final = 4  # 4 HGX nodes per rack (power-limited), 32 per leaf switch
NODES_PER_LEAF: Final = 32
_NS: Final = uuid.UUID("6f1c1c9a-2c1e-4d53-9e0b-7d8c1d0a4b11")

# The HGX board's PCI addresses, its IPoIB netdevs and an mlx5 port's counter files (counters/ and
# hw_counters/) come from the hardware profile (sim/profiles.py). Grouped here by how they move on a
# healthy node.
GPU_BUS_IDS: Final = HGX_PCI_BUS_IDS
NIC_NETDEVS: Final = HGX_IPOIB_NETDEVS
PMA_ERRORS_STATIC: Final = IB_PORT_ERROR_COUNTERS
# Benign: transport-level retries and flushes that every busy RDMA port shows now and then.
HW_CREEPING: Final = known_counters(
    MLX5_PORT_HW_COUNTERS,
    "duplicate_request",
    "implied_nak_seq_err",
    "local_ack_timeout_err",
    "out_of_buffer",
    "out_of_sequence",
    "packet_seq_err",
    "req_cqe_flush_error",
    "req_remote_access_errors",
    "req_remote_invalid_request",
)
TRAFFIC: Final = tuple(sorted({*MLX5_PORT_COUNTERS} - {*PMA_ERRORS_STATIC} | {*MLX5_REQUEST_COUNTERS}))
# Every other hw_counters/ file: a rare event, a small number that stays put.
HW_STATIC: Final = tuple(sorted({*MLX5_PORT_HW_COUNTERS} - {*HW_CREEPING} - {*MLX5_REQUEST_COUNTERS}))
IB_COUNTERS: Final = tuple(sorted((*PMA_ERRORS_STATIC, *HW_STATIC, *HW_CREEPING, *TRAFFIC)))


class FaultKind(Enum):
    XID_79 = "xid_79"  # a GPU falls off the bus: XID 79, then the node reports one GPU fewer
    NVLINK_CRC = "nvlink_crc"  # one NVLink's flit CRC errors climb far past 100/s
    IB_FLAPPING = "ib_flapping"  # one IB port's link goes down and up, with symbol errors
    SILENT = "silent"  # the node sends nothing (for rounds start..end)
    HOT_GPU = "hot_gpu"  # one GPU runs at 88-92 C (failing cooling)


@dataclass(frozen=True)
class Fault:
    node: int
    kind: FaultKind
    start: int  # first round (0-based) that shows it
    end: int | None = None  # first round that no longer does; None: to the end


def node_name(index: int) -> str:
    return f"gpu-{index:05d}"


def token_of(index: int) -> str:
    """The bench's static bearer token of node ``index`` (32 characters, not a weak token)."""
    return f"bench-token-{index:08d}-{uuid.uuid5(_NS, str(index)).hex[:12]}"


def token_file_text(nodes: int) -> str:
    return "".join(f"{node_name(i)} {token_of(i)}\n" for i in range(nodes))


class _GpuState:
    __slots__ = (
        "ecc_sbe_aggregate",
        "ecc_sbe_volatile",
        "energy",
        "index",
        "links",
        "pcie_replay",
        "remapped",
        "uuid",
    )

    def __init__(self, node: str, index: int, rng: random.Random) -> None:
        self.index = index
        self.uuid = f"GPU-{uuid.uuid5(_NS, f'{node}/{index}')}"
        self.energy = rng.uniform(2e6, 9e8)  # joules since the driver loaded
        self.ecc_sbe_volatile = 0
        self.ecc_sbe_aggregate = rng.choice((0, 0, 0, 0, 1, 2, 7))
        self.remapped = rng.choice((0, 0, 0, 1, 2))
        self.pcie_replay = rng.choice((0, 0, 0, 3, 11))
        # [link][field]: most links never count anything; a few carry old flit CRC errors.
        self.links = [[rng.choice((0, 0, 0, 0, 0, 0, 4, 19)), 0, 0, 0] for _ in range(NVLINKS)]


class _NicState:
    __slots__ = ("counters", "device", "netdev", "rx_bytes", "rx_packets", "tx_bytes", "tx_packets")

    def __init__(self, index: int, rng: random.Random) -> None:
        self.device = f"mlx5_{index}"
        self.netdev = NIC_NETDEVS[index]
        self.rx_bytes = rng.randrange(10**13, 4 * 10**14)
        self.tx_bytes = rng.randrange(10**13, 4 * 10**14)
        self.rx_packets = self.rx_bytes // MTU_BYTES
        self.tx_packets = self.tx_bytes // MTU_BYTES
        self.counters: dict[str, int] = dict.fromkeys(IB_COUNTERS, 0)
        for name in HW_STATIC:
            self.counters[name] = rng.choice((0, 0, 0, 1, 2, 17))
        for name in HW_CREEPING:
            self.counters[name] = rng.choice((0, 1, 2, 17, 40))
        self.counters["multicast_rcv_packets"] = rng.randrange(1000, 5000)
        self.counters["multicast_xmit_packets"] = rng.randrange(100, 500)
        for name in MLX5_REQUEST_COUNTERS:
            self.counters[name] = rng.randrange(10**8, 10**9)
        self.counters["port_xmit_wait"] = rng.randrange(10**9, 6 * 10**9)
        self._sync()

    def _sync(self) -> None:
        c = self.counters
        # PMA data counters count 4-byte words.
        c["port_rcv_data"] = self.rx_bytes // 4
        c["port_xmit_data"] = self.tx_bytes // 4
        c["port_rcv_packets"] = self.rx_packets
        c["port_xmit_packets"] = self.tx_packets
        c["unicast_rcv_packets"] = self.rx_packets - c["multicast_rcv_packets"]
        c["unicast_xmit_packets"] = self.tx_packets - c["multicast_xmit_packets"]

    def advance(self, seconds: float, busy: bool, rng: random.Random) -> None:
        share = rng.uniform(0.3, 0.9) if busy else rng.uniform(0.0, 0.002)
        rx = int(NDR_BYTES_PER_SECOND * share * seconds)
        tx = int(rx * rng.uniform(0.9, 1.1))
        self.rx_bytes += rx
        self.tx_bytes += tx
        self.rx_packets += rx // MTU_BYTES + 1
        self.tx_packets += tx // MTU_BYTES + 1
        c = self.counters
        c["multicast_rcv_packets"] += rng.randrange(0, 3)
        if busy:
            c["port_xmit_wait"] += rng.randrange(10**5, 10**7)
            c["rx_write_requests"] += rx // (1 << 20)
            c["rx_read_requests"] += rx // (4 << 20)
            c["rx_atomic_requests"] += rng.randrange(0, 1000)
            c["rx_dct_connect"] += rng.randrange(0, 100)
            if rng.random() < 0.01:
                c[rng.choice(HW_CREEPING)] += 1
        self._sync()


class NodeSim:
    """One node over time: call ``report(t)`` once per interval, in time order."""

    def __init__(self, index: int, *, seed: int = 0, interval: float = 10.0, pool: str = "h100-a") -> None:
        self.index = index
        self.name = node_name(index)
        self.interval = interval
        self._rng = random.Random(seed * 1_000_003 + index)
        rng = self._rng
        self.boot_id = str(uuid.uuid5(_NS, f"{self.name}/boot/{seed}"))
        self.labels = {
            "pool": pool,
            "rack": f"r{index // NODES_PER_RACK:04d}",
            "leaf": f"leaf{index // NODES_PER_LEAF:03d}",
        }
        self.seq = 0
        self._gpus = [_GpuState(self.name, i, rng) for i in range(GPUS)]
        self._nics = [_NicState(i, rng) for i in range(NICS)]
        self._busy = rng.random() < 0.8  # most of a training fleet is busy most of the time
        self._job_left = rng.randrange(1, 120)
        self._ambient = rng.uniform(-3.0, 3.0)  # some racks run warmer than others
        self._lost_gpu: int | None = None
        self._pending_events: list[Event] = []

    def _next_job(self) -> None:
        self._job_left -= 1
        if self._job_left <= 0:
            # A job ends; an idle node mostly gets the next one soon, sometimes stays drained.
            self._busy = False if self._busy else self._rng.random() < 0.9
            self._job_left = self._rng.randrange(30, 360) if self._busy else self._rng.randrange(1, 30)

    def _gpu(self, g: _GpuState, hot: bool) -> Gpu:
        rng = self._rng
        busy = self._busy
        if busy:
            util = min(1.0, rng.uniform(0.82, 1.0))
            power = rng.uniform(430.0, 690.0)
            temp = 52.0 + power / 40.0 + self._ambient + rng.uniform(-2.0, 2.0)
            sm = rng.choice((1_980_000_000.0, 1_980_000_000.0, 1_935_000_000.0, 1_875_000_000.0))
            reasons = rng.choice((0, 0, 0, 4))  # 4: SW power cap, normal under heavy load
            mem_used = rng.randrange(60_000_000_000, 80_000_000_000, 1 << 20)
        else:
            util = rng.choice((0.0, 0.0, 0.01))
            power = rng.uniform(66.0, 74.0)
            temp = 31.0 + self._ambient + rng.uniform(-1.0, 3.0)
            sm = 345_000_000.0
            reasons = 1  # GPU idle
            mem_used = 595_591_168
        if hot:
            temp = rng.uniform(88.0, 92.0)
        g.energy += power * self.interval
        if rng.random() < 0.002:
            g.ecc_sbe_volatile += 1
            g.ecc_sbe_aggregate += 1
        if rng.random() < 0.001:
            g.pcie_replay += 1
        return Gpu(
            index=g.index,
            uuid=g.uuid,
            model=GPU_MODEL,
            pci_bus_id=GPU_BUS_IDS[g.index],
            utilization_ratio=util,
            memory_used_bytes=mem_used,
            memory_total_bytes=MEMORY_TOTAL_BYTES,
            temperature_celsius=round(temp),
            memory_temperature_celsius=round(temp + rng.uniform(3.0, 8.0)),
            power_watts=round(power, 3),
            power_limit_watts=POWER_LIMIT_W,
            energy_joules_total=round(g.energy, 3),
            sm_clock_hz=sm,
            sm_clock_max_hz=SM_CLOCK_MAX_HZ,
            memory_clock_hz=MEMORY_CLOCK_HZ,
            clock_event_reasons=reasons,
            performance_state=0,
            ecc_sbe_volatile_total=g.ecc_sbe_volatile,
            ecc_dbe_volatile_total=0,
            ecc_sbe_aggregate_total=g.ecc_sbe_aggregate,
            ecc_dbe_aggregate_total=0,
            retired_pages_sbe=None,  # Hopper remaps rows instead of retiring pages
            retired_pages_dbe=None,
            retired_pages_pending=None,
            remapped_rows_correctable=g.remapped,
            remapped_rows_uncorrectable=0,
            remapped_rows_pending=False,
            remapped_rows_failure=False,
            pcie_link_gen=5,
            pcie_link_gen_max=5,
            pcie_link_width=16,
            pcie_link_width_max=16,
            pcie_replay_total=g.pcie_replay,
            nvlink=tuple(
                NvLink(
                    link=n,
                    active=True,
                    crc_flit_errors_total=c[0],
                    crc_data_errors_total=c[1],
                    replay_errors_total=c[2],
                    recovery_errors_total=c[3],
                )
                for n, c in enumerate(g.links)
            ),
        )

    def _nic(self, n: _NicState, down: bool) -> Nic:
        return Nic(
            device=n.device,
            link_layer="InfiniBand",
            port=1,
            netdev=n.netdev,
            state="DOWN" if down else "ACTIVE",
            phys_state="Polling" if down else "LinkUp",
            rate_bytes_per_second=NDR_BYTES_PER_SECOND,
            rx_bytes_total=n.rx_bytes,
            tx_bytes_total=n.tx_bytes,
            rx_packets_total=n.rx_packets,
            tx_packets_total=n.tx_packets,
            counters=dict(n.counters),
        )

    def report(self, time: float, round_no: int = 0, faults: Iterable[Fault] = ()) -> Report:
        active = {f.kind for f in faults if f.start <= round_no and (f.end is None or round_no < f.end)}
        rng = self._rng
        self._next_job()
        events: list[Event] = []
        if FaultKind.XID_79 in active and self._lost_gpu is None:
            self._lost_gpu = 3
            events.append(
                Event(
                    kind="xid",
                    time=time - rng.uniform(0.5, self.interval - 0.5),
                    gpu=3,
                    code=79,
                    message=f"NVRM: Xid (PCI:{GPU_BUS_IDS[3][4:]}): 79, pid=1911, "
                    "GPU has fallen off the bus.",
                )
            )
        if FaultKind.NVLINK_CRC in active:
            self._gpus[2].links[7][0] += rng.randrange(2_000, 5_000) * int(self.interval)
        flapping = FaultKind.IB_FLAPPING in active
        if flapping:
            counters = self._nics[3].counters
            counters["symbol_error"] += rng.randrange(5, 50)
            if rng.random() < 0.3:
                counters["link_downed"] += 1
                counters["link_error_recovery"] += 1
        hot = FaultKind.HOT_GPU in active
        for nic in self._nics:
            nic.advance(self.interval, self._busy, rng)
        gpus = [self._gpu(g, hot and g.index == 6) for g in self._gpus if g.index != self._lost_gpu]
        nics = [self._nic(n, flapping and n.device == "mlx5_3" and rng.random() < 0.2) for n in self._nics]
        report = Report(
            schema=SCHEMA_ID,
            node=self.name,
            time=time,
            seq=self.seq,
            boot_id=self.boot_id,
            gpus=tuple(gpus),
            nics=tuple(nics),
            agent_version=AGENT_VERSION,
            interval_seconds=self.interval,
            labels=self.labels,
            events=tuple(events) if events else UNSET,
        )
        self.seq += 1
        return report


def phase_offset(index: int, *, seed: int = 0, jitter: float = 2.0) -> float:
    """Where in each interval node ``index`` reports: agents are not synchronized, but each keeps
    its own phase (it sleeps one interval after each cycle)."""
    return random.Random(seed * 7919 + index).uniform(0.0, jitter)


def sending_order(nodes: int, *, seed: int = 0, jitter: float = 2.0) -> list[int]:
    """Node indices in the order their reports arrive within a round: by phase."""
    return sorted(range(nodes), key=lambda i: phase_offset(i, seed=seed, jitter=jitter))


def fleet_reports(
    nodes: int,
    rounds: int,
    *,
    start: float,
    interval: float = 10.0,
    seed: int = 0,
    faults: Iterable[Fault] = (),
    jitter: float = 2.0,
) -> Iterator[Report]:
    """``rounds`` reports of each of ``nodes`` nodes, in time order, as an aggregator receives them.

    Node ``i`` reports at ``start + r * interval + phase_offset(i)`` in round ``r``; a node with a
    ``SILENT`` fault sends nothing in those rounds (its seq still advances only with what it sends).
    """
    by_node: dict[int, list[Fault]] = {}
    for f in faults:
        by_node.setdefault(f.node, []).append(f)
    sims = [NodeSim(i, seed=seed, interval=interval) for i in range(nodes)]
    offsets = [phase_offset(i, seed=seed, jitter=jitter) for i in range(nodes)]
    order = sending_order(nodes, seed=seed, jitter=jitter)
    for r in range(rounds):
        for i in order:
            node_faults = by_node.get(i, ())
            if any(
                f.kind is FaultKind.SILENT and f.start <= r and (f.end is None or r < f.end)
                for f in node_faults
            ):
                continue
            yield sims[i].report(start + r * interval + offsets[i], r, node_faults)
