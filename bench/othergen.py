"""A second, independent fleet trace generator: gang-scheduled jobs on two GPU pools.

gpuwarden's detectors must work on fleets they were not tuned on. ``sim/`` is the project's own
simulator; this module is a separate one, written only from the public report contract
(``agent/schema/report-v1.schema.json``), the truth file format (``sim/truth.py``) and public
hardware facts, with its own modelling choices. It writes a trace (JSON Lines of reports, in the
order the aggregator receives them) and a truth file, so a detector can be scored on traces it has
never seen.

    .venv/bin/python bench/othergen.py --seed 1 --trace t1.jsonl.gz --truth truth1.json

The model, and where its numbers come from
------------------------------------------

Fleet. ``nodes`` (at least 32) named ``node-a001``...; 4 nodes per rack (``rack-01``...), 4 racks
per leaf switch (``leaf-1``...); whole racks belong to one pool, the first ~3/4 of the racks
``h100``, the rest ``a100``. Labels ``pool``, ``rack``, ``leaf``.

- H100 SXM5 80GB (NVIDIA H100 datasheet, HGX H100 specs): 8 GPUs, 1980 MHz max SM clock, HBM3
  at 2619 MHz, 700 W limit, PCIe gen5 x16, 18 NVLink4 links, 81559 MiB as NVML reports it,
  idle ~345 MHz / 65-85 W; 8 ConnectX-7 NDR ports ``mlx5_0..7`` at 400 Gb/s (5.0e10 B/s).
- A100 SXM4 80GB (A100 datasheet): 1410 MHz, HBM2e at 1593 MHz, 400 W, PCIe gen4 x16, 12 NVLink3
  links, 81920 MiB, idle ~210 MHz / 50-65 W; 8 ConnectX-6 HDR ports at 200 Gb/s (2.5e10 B/s).
- ``pcie_link_gen`` is the *current* generation: nvidia-smi documents that the current link
  generation "may be reduced when the GPU is not in use". The A100 pool's GPUs drop to gen 1 at
  P8 (idle); the H100 pool's stay at gen 5. Width is always x16 on healthy GPUs.
- Retired pages are null: Ampere and Hopper replace page retirement by row remapping (NVIDIA
  "GPU Memory Error Management"), and NVML answers NOT_SUPPORTED.
- Manufacturing spread per GPU: busy power efficiency x N(1, 2.5 %) clipped to +-6 %, idle power
  drawn in the ranges above, temperature offset N(0, 1.2) C plus 3 C for the rear row of the HGX
  baseboard (GPUs 4-7 breathe the front row's exhaust). Per node: NIC path factor N(1, 0.8 %),
  NVLink/NVSwitch factor N(1, 0.8 %).
- Temperature: steady state = rack inlet + 6 C + R x power + offset, R = 0.058 C/W (H100) and
  0.085 C/W (A100): idle 30-40 C, load 55-75 C. The die follows with a 30 s time constant. HBM
  reads 2 C + 6 mC/W above the core. Inlet: 23 C +- 1.5 C per rack plus a fleet-wide 3 h
  sinusoid of 1.2 C and a 0.3 C/h warming (room drift). NVML integers.
- Power at load = idle + (limit x 0.95 x job intensity x efficiency - idle) x activity, job
  intensity U(0.6, 1.05). Above the limit the GPU holds the limit and lowers its clock (power
  ~ f^2.5 in the DVFS range) in 15 MHz steps, with the SW power cap bit 0x4: healthy nodes with
  heavy jobs *do* throttle; that is not a fault.
- Clock event reasons are the NVML bitmask: 0x1 GPU idle, 0x4 SW power cap, 0x8 HW slowdown, 0x20
  SW thermal, 0x40 HW thermal, 0x80 HW power brake (always reported together with 0x8, as NVML
  does). P0 with a job, P8 idle.
- Counters are cumulative from the node's boot: a node has been up 2-40 days at the trace start,
  so energy and traffic counters start large. IB error counters are IBTA PortCounters, which
  *saturate*: 16 bits for ``symbol_error``, ``port_rcv_errors`` and the other error counters, 8
  bits for ``link_downed`` / ``link_error_recovery``, 4 bits for ``local_link_integrity_errors``
  / ``excessive_buffer_overrun_errors``, 32 bits for ``port_xmit_wait`` (already saturated on
  most long-running nodes). Data and packet counters are the 64-bit extended ones;
  ``port_xmit_data`` / ``port_rcv_data`` are 4-byte words, ``tx_bytes_total`` 4x that.
- Rare healthy noise: ~2 % of GPUs log a correctable SBE every ~10 min, healthy NVLinks a CRC
  error about once per node per 4 h, healthy IB ports a symbol error about once per 28 h.
- A management NIC ``eth0`` (25 GbE) with netdev statistics, ~60 kB/s of control traffic.

Jobs. Per pool, jobs arrive as a Poisson stream with sizes k in {1, 2, 4, 8, 16} nodes (weights
.25/.2/.2/.2/.15, at most half the pool) and lognormal durations (median 8 min, sigma 0.5,
clipped 3-40 min: short next to real training runs, so a 30-minute trace sees turnover), at an
offered load of 110 % of the pool: there is always a backlog. The queue is strict FIFO (no
backfill), a job starts only on the scheduler's 60 s cycle (a batch scheduler's main loop), and
jobs of 8 nodes or more must fit under one leaf switch; idle nodes wait until the head job fits.
That leaves 60-80 % of node-time busy (0.71 +- 0.05 over seeds 1-24 at 64 nodes, 30 min). A job
takes all its nodes at once, preferring the leaf with the most free nodes, and releases them
together. Each job: 30-120 s start-up (P0, GPUs near idle, memory filling), then utilisation
U(0.9, 0.99) +- 2 % with a checkpoint every 3-8 min lasting 15-45 s (utilisation 2-25 %);
multi-node jobs move 10-45 % of the IB line rate per port. After a job, its nodes are held 30 s
for the post-job check. The schedule starts 3 h before the trace, so the trace opens mid-flight.

Probes (``probes``; the finishing time is ``time``, as the schema says), from this module's own
prober, which never starts a probe on a node running a job:

- ``nccl_allreduce_local``: every 5 min on each idle node (own phase), 1 GiB, busbw ~460 GB/s
  (H100, NVLS) or ~230 GB/s (A100), x node factor x N(1, 0.8 %).
- ``nccl_allreduce_pair`` (1 GiB, 16 ranks over 8 rails): ~380 GB/s (H100/NDR) or ~190 GB/s
  (A100/HDR) x min of the two NIC factors x N(1, 1.5 %). Run (a) as a ring over the nodes a job
  has just freed (two or three rounds so no node is in two probes at once), and (b) every 2 min
  per pool over the idle nodes: pairs within a leaf first, least recently tested pair first, the
  rest across leaves. Both ends report the result with ``peer`` set.
- Failures: 0.3 % time out (``ok: false``, 120 s); a probe whose node gets a job before the probe
  ends reports ``stepped aside: a job started``. A node the scheduler has given up on (a GPU
  fell off the bus) or that is rebooting is not probed.

Faults, one of each, on distinct nodes, onsets U(10 %, 50 %) of the trace unless said:

- hard: ``xid79`` (XID 79, the GPU leaves ``gpus``, an ``nvml`` error names it; the job on the
  node dies and the scheduler stops placing jobs there); ``dbe`` (XIDs 48 and 63, volatile and
  aggregate DBE +1, an uncorrectable remapped row, remap pending); ``remap_failure`` (XID 64,
  an uncorrectable remapped row, ``remapped_rows_failure``); ``ib_port_down`` (state DOWN,
  phys_state Polling, rate 10 Gb/s as ``ibstat`` shows for a polling port, ``link_downed`` +1,
  no traffic; the node's other rails carry its job and its pair probes run at 7/8).
- soft, load-only (shown only in the steady phase of a job): ``thermal`` (one GPU; its cooling
  cannot hold it: SW thermal slowdown holds it at 80-86 C with the SM clock at 0.80-0.90 of max,
  bit 0x20, plus 0x40 at 85 C and above); ``power_brake`` (every GPU of the node at 0.50-0.70 of
  max clock, bits 0x88, power ~ clock^2); ``slow_gpu`` (one GPU at 0.85-0.92 of max clock, no
  reason bit, power scaled; and its node's local all-reduce, which runs when the node is idle,
  at 0.85-0.93 of normal).
- soft, always: ``pcie_downtrain`` (one GPU at x8, or 1-2 generations below max, busy or idle;
  PCIe replays 0.01-0.1/s); ``nvlink_crc`` (one link: CRC flit errors 0.5-5/s, replays the same,
  CRC data errors a tenth); ``symbol_storm`` (one port: ``symbol_error`` 10-100/s, saturating at
  65535, ``port_rcv_errors`` 1-5 % of that, a link recovery every ~5 min); ``slow_nic`` (every
  pair probe with the node at 0.60-0.80 of normal).
- link: ``degraded_link`` between two healthy nodes of one pool and leaf, every pair probe
  between exactly those two at 0.50-0.75, onset in 10-30 % of the trace; the pair is chosen among
  the pairs the prober tests at least 4 (else 3) times after the onset (``first_seen``: the first
  report with a slow probe).
- silent: ``silent_rack``, one rack's management network is cut for 8-12 min (at most 40 % of
  the trace); its agents spool and, with ``spool_flush`` (the default), send the backlog, oldest
  first, right after the cut heals, as gpuwarden's agent does. One truth entry per node.
- lookalike: ``app_xid`` XIDs 13, 31 and 43 on three busy nodes (application faults), ``reboot``
  (no reports for 2-5 min, new boot_id, seq from 0, counters from 0, the job on it killed),
  ``clock_skew`` (one node's clock 20-60 s ahead: its report, event and probe times).

Truth ``gpu`` is the GPU index; ``port`` is the NIC index (``mlx5_<port>``, RDMA port 1) for IB
faults and the NVLink link number for ``nvlink_crc``.

Delivery. Agents start at random phases and keep their interval (a few ms of jitter). 1 % of
reports are lost, 0.5 % are delivered twice (a retry 1-8 s later), receive latency U(0.02, 2) s.
The trace is sorted by receive time. ``first_seen`` is the ``time`` of the first delivered report
that shows the fault, on that report's clock.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import hashlib
import heapq
import logging
import math
import random
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import msgspec

from sim.profiles import symbol_errors_per_s
from sim.scenario import LOW_SLOW_GPU_RATIO, LOW_SLOW_NIC_RATIO, LOW_SYMBOL_BER_BUDGETS
from sim.truth import CLASSES, Truth, TruthFault
from sim.truth import write as write_truth

log = logging.getLogger(__name__)

START: Final = 1767225600.0  # 2026-01-01T00:00:00Z
SCHEMA: Final = "gpuwarden/report/v1"
AGENT_VERSION: Final = "othergen"
MIN_NODES: Final = 32
MIN_MINUTES: Final = 10.0
NODES_PER_RACK: Final = 4
RACKS_PER_LEAF: Final = 4
GPUS: Final = 8
PORTS: Final = 8
GIB: Final = 1 << 30
MIB: Final = 1 << 20

# NVML clocks-event reasons (nvml.h, nvmlClocksEventReason*).
R_IDLE: Final = 0x1
R_SW_POWER_CAP: Final = 0x4
R_HW_SLOWDOWN: Final = 0x8
R_SW_THERMAL: Final = 0x20
R_HW_THERMAL: Final = 0x40
R_HW_POWER_BRAKE: Final = 0x80

U64: Final = (1 << 64) - 1
U32: Final = (1 << 32) - 1
U16: Final = (1 << 16) - 1
U8: Final = (1 << 8) - 1
U4: Final = (1 << 4) - 1

# IBTA PortCounters widths: these saturate rather than wrap.
IB_COUNTER_MAX: Final[dict[str, int]] = {
    "symbol_error": U16,
    "link_error_recovery": U8,
    "link_downed": U8,
    "port_rcv_errors": U16,
    "port_rcv_remote_physical_errors": U16,
    "port_rcv_switch_relay_errors": U16,
    "port_xmit_discards": U16,
    "port_xmit_constraint_errors": U8,
    "port_rcv_constraint_errors": U8,
    "local_link_integrity_errors": U4,
    "excessive_buffer_overrun_errors": U4,
    "VL15_dropped": U16,
    "port_xmit_wait": U32,
}
IB_HW_COUNTERS: Final = (
    "duplicate_request",
    "implied_nak_seq_err",
    "local_ack_timeout_err",
    "out_of_buffer",
    "out_of_sequence",
    "packet_seq_err",
    "req_cqe_error",
    "req_remote_access_errors",
    "resp_cqe_error",
    "rnr_nak_retry_err",
)
ETH_COUNTERS: Final = (
    "rx_errors",
    "tx_errors",
    "rx_dropped",
    "tx_dropped",
    "multicast",
    "collisions",
    "rx_crc_errors",
    "rx_frame_errors",
    "rx_fifo_errors",
    "rx_missed_errors",
    "tx_carrier_errors",
    "tx_fifo_errors",
    "carrier_changes",
)


@dataclass(frozen=True)
class Hardware:
    """One node type, from the public datasheets (see the module docstring)."""

    pool: str
    model: str
    sm_max_hz: float
    sm_idle_hz: float
    mem_clock_hz: float
    power_limit_w: float
    idle_power_w: tuple[float, float]
    thermal_c_per_w: float
    pcie_gen: int
    idle_pcie_gen: int
    nvlinks: int
    memory_bytes: int
    idle_memory_bytes: int
    ib_rate: float
    local_busbw: float
    pair_busbw: float


H100: Final = Hardware(
    pool="h100",
    model="NVIDIA H100 80GB HBM3",
    sm_max_hz=1980e6,
    sm_idle_hz=345e6,
    mem_clock_hz=2619e6,
    power_limit_w=700.0,
    idle_power_w=(65.0, 85.0),
    thermal_c_per_w=0.058,
    pcie_gen=5,
    idle_pcie_gen=5,
    nvlinks=18,
    memory_bytes=81559 * MIB,
    idle_memory_bytes=571 * MIB,
    ib_rate=5.0e10,
    local_busbw=460e9,
    pair_busbw=380e9,
)
A100: Final = Hardware(
    pool="a100",
    model="NVIDIA A100-SXM4-80GB",
    sm_max_hz=1410e6,
    sm_idle_hz=210e6,
    mem_clock_hz=1593e6,
    power_limit_w=400.0,
    idle_power_w=(50.0, 65.0),
    thermal_c_per_w=0.085,
    pcie_gen=4,
    idle_pcie_gen=1,
    nvlinks=12,
    memory_bytes=81920 * MIB,
    idle_memory_bytes=503 * MIB,
    ib_rate=2.5e10,
    local_busbw=230e9,
    pair_busbw=190e9,
)
POOLS: Final = (H100, A100)

HOLD_S: Final = 30.0  # post-job check window
SCHED_CYCLE_S: Final = 60.0
LEAF_LOCAL_K: Final = (
    8  # jobs this big are placed under one leaf  # a batch scheduler's main loop: jobs start on its ticks
)
LOCAL_EVERY_S: Final = 300.0
PAIR_EVERY_S: Final = 120.0
PROBE_SIZE: Final = GIB
PROBE_TIMEOUT_S: Final = 120.0
TIMEOUT_P: Final = 0.003
LOSS_P: Final = 0.01
DUP_P: Final = 0.005
JOB_SIZES: Final = ((1, 0.25), (2, 0.20), (4, 0.20), (8, 0.20), (16, 0.15))
OFFERED_LOAD: Final = 1.1  # a backlog: the queue seldom empties
WARMUP_S: Final = 3 * 3600.0
# Job durations: lognormal. Short next to real training runs so a 30-minute trace sees turnover.
DUR_MEDIAN_S: Final = 480.0
DUR_SIGMA: Final = 0.5
DUR_MIN_S: Final = 180.0
DUR_MAX_S: Final = 40 * 60.0


@dataclass(frozen=True)
class Knobs:
    """Robustness knobs (bench/detection.py ``--matrix``, bench/healthy.py); the defaults are the
    model above, and give the same traces bit for bit.

    - ``noise``: every healthy random spread widened this many times around its centre: the
      per-GPU manufacturing spread (efficiency, idle power, temperature offset), the per-node NIC
      and NVLink factors, the rack inlets, the job intensity and utilisation spread, the per-report
      jitter of utilisation, power and temperature, and the probes' noise.
    - ``job_median_s``: the jobs' median duration (the clipping range moves with it).
    - ``busy_share``: the share of node-time busy over the trace; the scheduler then backfills
      (a queued job that fits starts even when the head does not) and the offered load is found
      by bisection over the schedule alone. A share the 60-s scheduler cycle and the 30-s post-job
      hold cannot reach is approached as closely as it can be; the trace says what it reached.
    - ``loss``: the share of reports lost in delivery.
    - ``faults_at_start``: every hard, soft and link fault from the trace's first report.
    - ``low_magnitudes``: the soft faults' low end (sim.scenario: slow GPU at 0.90, symbol errors
      at twice the port's BER budget at its own rate, slow NIC at 0.75).
    - ``healthy``: no hard, soft or link fault (the look-alikes and the silent rack stay).
    """

    noise: float = 1.0
    job_median_s: float = DUR_MEDIAN_S
    busy_share: float | None = None
    loss: float = LOSS_P
    faults_at_start: bool = False
    low_magnitudes: bool = False
    healthy: bool = False

    def check(self) -> None:
        if not (math.isfinite(self.noise) and self.noise > 0):
            raise ValueError(f"noise: must be > 0, got {self.noise}")
        if not (math.isfinite(self.job_median_s) and self.job_median_s >= 60.0):
            raise ValueError(f"job_median_s: at least 60 s, got {self.job_median_s}")
        if self.busy_share is not None and not 0.0 < self.busy_share < 1.0:
            raise ValueError(f"busy_share: must be in (0, 1), got {self.busy_share}")
        if not 0.0 <= self.loss < 1.0:
            raise ValueError(f"loss: must be in [0, 1), got {self.loss}")


DEFAULT_KNOBS: Final = Knobs()


def _widen(x: float, centre: float, k: float) -> float:
    """``x`` spread ``k`` times as far from ``centre``; ``x`` itself at 1, bit for bit."""
    return x if k == 1.0 else centre + (x - centre) * k


def _rng(seed: int, *names: object) -> random.Random:
    """An independent stream per concern, so one choice does not shift every other draw."""
    digest = hashlib.sha256(":".join(str(x) for x in (seed, *names)).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def _poisson(rng: random.Random, mean: float) -> int:
    if mean <= 0:
        return 0
    if mean > 30:
        return max(0, round(rng.gauss(mean, math.sqrt(mean))))
    limit, k, p = math.exp(-mean), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


# -- the fleet ------------------------------------------------------------------------------


@dataclass
class Node:
    idx: int
    name: str
    hw: Hardware
    rack: str
    leaf: str
    uuids: list[str]
    pci: list[str]
    efficiency: list[float]
    idle_w: list[float]
    temp_offset: list[float]
    weak_ecc: list[bool]
    nic_factor: float
    local_factor: float
    rack_inlet: float
    uptime_s: float
    skew: float = 0.0


def _build_fleet(seed: int, nodes: int, k: float = 1.0) -> list[Node]:
    rng = _rng(seed, "fleet")
    racks = math.ceil(nodes / NODES_PER_RACK)
    h100_racks = min(racks - 1, max(1, round(racks * 0.75)))
    inlets = [23.0 + rng.uniform(-1.5, 1.5) * k for _ in range(racks)]
    # Clip bounds widen with the spread (k = 1: the datasheet-style bounds as written).
    eff_lo, eff_hi = (0.94, 1.06) if k == 1.0 else (1.0 - 0.06 * k, 1.0 + 0.06 * k)
    fac_lo, fac_hi = (0.98, 1.02) if k == 1.0 else (1.0 - 0.02 * k, 1.0 + 0.02 * k)
    fleet: list[Node] = []
    bus_ids = ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db")  # an HGX baseboard's layout
    for i in range(nodes):
        rack = i // NODES_PER_RACK
        hw = H100 if rack < h100_racks else A100
        fleet.append(
            Node(
                idx=i,
                name=f"node-a{i + 1:03d}",
                hw=hw,
                rack=f"rack-{rack + 1:02d}",
                leaf=f"leaf-{rack // RACKS_PER_LEAF + 1}",
                uuids=[f"GPU-{rng.getrandbits(128):032x}" for _ in range(GPUS)],
                pci=[f"00000000:{b}:00.0" for b in bus_ids],
                efficiency=[min(eff_hi, max(eff_lo, rng.gauss(1.0, 0.025 * k))) for _ in range(GPUS)],
                idle_w=[
                    max(
                        0.5 * hw.idle_power_w[0],
                        _widen(rng.uniform(*hw.idle_power_w), sum(hw.idle_power_w) / 2, k),
                    )
                    for _ in range(GPUS)
                ],
                temp_offset=[rng.gauss(0.0, 1.2 * k) + (3.0 if g >= 4 else 0.0) for g in range(GPUS)],
                weak_ecc=[rng.random() < 0.02 for _ in range(GPUS)],
                nic_factor=min(fac_hi, max(fac_lo, rng.gauss(1.0, 0.008 * k))),
                local_factor=min(fac_hi, max(fac_lo, rng.gauss(1.0, 0.008 * k))),
                rack_inlet=inlets[rack],
                uptime_s=rng.uniform(2, 40) * 86400.0,
            )
        )
    return fleet


def _inlet(node: Node, t: float, drift_phase: float) -> float:
    hours = (t - START) / 3600.0
    return node.rack_inlet + 1.2 * math.sin(2 * math.pi * hours / 3.0 + drift_phase) + 0.3 * hours


# -- the scheduler --------------------------------------------------------------------------


@dataclass
class Job:
    id: int
    pool: str
    k: int
    duration: float
    startup_s: float
    util: float
    intensity: float
    ckpt_period: float
    ckpt_len: float
    ckpt_phase: float
    ib_frac: float
    mem_frac: float
    start: float = math.nan
    end: float = math.nan
    nodes: tuple[int, ...] = ()


@dataclass
class Timeline:
    """One node's states over time: ``busy`` (a job), ``hold`` (post-job check), ``down``."""

    starts: list[float] = field(default_factory=list)
    segs: list[tuple[float, float, str, Job | None]] = field(default_factory=list)

    def add(self, t0: float, t1: float, kind: str, job: Job | None) -> None:
        if t1 > t0:
            self.starts.append(t0)
            self.segs.append((t0, t1, kind, job))

    def at(self, t: float) -> tuple[str, Job | None]:
        i = bisect.bisect_right(self.starts, t) - 1
        if i >= 0:
            t0, t1, kind, job = self.segs[i]
            if t0 <= t < t1:
                return kind, job
        return "free", None

    def next_busy(self, t: float) -> float:
        """When the next job starts on the node at or after ``t`` (inf if none)."""
        i = bisect.bisect_left(self.starts, t)
        for t0, _t1, kind, _job in self.segs[i:]:
            if kind == "busy":
                return t0
        return math.inf


@dataclass
class Schedule:
    jobs: list[Job]
    timelines: list[Timeline]
    freed: list[tuple[float, tuple[int, ...]]]  # (time, nodes a job released together)


def _job_sizes(pool_size: int, leaf_share: int) -> list[tuple[int, float]]:
    """The sizes a pool can ever run: at most half the pool, big ones within one leaf's share."""
    return [
        (k, w) for k, w in JOB_SIZES if k <= max(1, pool_size // 2) and (k < LEAF_LOCAL_K or k <= leaf_share)
    ]


def _make_job(
    rng: random.Random, jid: int, pool: str, sizes: list[tuple[int, float]], knobs: Knobs = DEFAULT_KNOBS
) -> Job:
    k = rng.choices([s for s, _ in sizes], weights=[w for _, w in sizes])[0]
    k1 = k > 1
    median, noise = knobs.job_median_s, knobs.noise
    scale = median / DUR_MEDIAN_S  # the clipping range moves with the median
    return Job(
        id=jid,
        pool=pool,
        k=k,
        duration=min(DUR_MAX_S * scale, max(DUR_MIN_S * scale, median * math.exp(rng.gauss(0.0, DUR_SIGMA)))),
        startup_s=rng.uniform(30, 120),
        util=min(0.999, _widen(rng.uniform(0.90, 0.99), 0.945, noise)),
        intensity=max(0.1, _widen(rng.uniform(0.6, 1.05), 0.825, noise)),
        ckpt_period=rng.uniform(180, 480),
        ckpt_len=rng.uniform(15, 45),
        ckpt_phase=rng.uniform(0, 480),
        ib_frac=rng.uniform(0.10, 0.45) if k1 else 0.0,
        mem_frac=rng.uniform(0.6, 0.97),
    )


def _mean_duration(median: float = DUR_MEDIAN_S) -> float:
    # The lognormal's mean, median x e^(sigma^2 / 2); the clipping moves it by about 1 %.
    return median * math.exp(DUR_SIGMA**2 / 2)


def busy_share(sched: Schedule, t0: float, t1: float) -> float:
    """The share of node-time in ``t0..t1`` that the schedule keeps busy (a job on the node)."""
    busy = 0.0
    for tl in sched.timelines:
        for a, b, kind, _job in tl.segs:
            if kind == "busy":
                busy += max(0.0, min(b, t1) - max(a, t0))
    return busy / (len(sched.timelines) * (t1 - t0))


def _schedule_for_share(
    seed: int,
    fleet: list[Node],
    t0: float,
    t1: float,
    outages: dict[int, tuple[float, float]],
    *,
    knobs: Knobs,
) -> Schedule:
    """The backfilling schedule whose busy share over ``t0..t1`` is nearest ``knobs.busy_share``:
    bisection on the offered load (the share grows with it), over the schedule alone."""
    assert knobs.busy_share is not None
    lo, hi = 0.02, 4.0
    best: tuple[float, Schedule] | None = None
    for _ in range(12):
        mid = (lo + hi) / 2
        sched = _schedule(seed, fleet, t0 - WARMUP_S, t1, outages, knobs=knobs, offered=mid, backfill=True)
        got = busy_share(sched, t0, t1)
        if best is None or abs(got - knobs.busy_share) < abs(best[0] - knobs.busy_share):
            best = (got, sched)
        if got < knobs.busy_share:
            lo = mid
        else:
            hi = mid
    assert best is not None
    return best[1]


def _schedule(
    seed: int,
    fleet: list[Node],
    t_begin: float,
    t_end: float,
    outages: dict[int, tuple[float, float]],
    *,
    knobs: Knobs = DEFAULT_KNOBS,
    offered: float = OFFERED_LOAD,
    backfill: bool = False,
) -> Schedule:
    rng = _rng(seed, "jobs")
    timelines = [Timeline() for _ in fleet]
    status = ["free"] * len(fleet)
    since = [t_begin] * len(fleet)
    job_of: list[Job | None] = [None] * len(fleet)
    jobs: list[Job] = []
    freed: list[tuple[float, tuple[int, ...]]] = []
    queues: dict[str, deque[Job]] = {hw.pool: deque() for hw in POOLS}
    members = {hw.pool: [n.idx for n in fleet if n.hw is hw] for hw in POOLS}
    events: list[tuple[float, int, str, int]] = []
    order = 0

    def push(t: float, kind: str, arg: int) -> None:
        nonlocal order
        order += 1
        heapq.heappush(events, (t, order, kind, arg))

    for hw in POOLS:
        size = len(members[hw.pool])
        if size == 0:
            continue
        per_leaf: dict[str, int] = {}
        for n in members[hw.pool]:
            per_leaf[fleet[n].leaf] = per_leaf.get(fleet[n].leaf, 0) + 1
        sizes = _job_sizes(size, max(per_leaf.values()))
        mean_k = sum(k * w for k, w in sizes) / sum(w for _, w in sizes)
        rate = offered * size / (mean_k * _mean_duration(knobs.job_median_s))
        t = t_begin
        while True:
            t += rng.expovariate(rate)
            if t >= t_end:
                break
            job = _make_job(rng, len(jobs), hw.pool, sizes, knobs)
            jobs.append(job)
            push(t, "arrive", job.id)
    push(t_begin + rng.uniform(0, SCHED_CYCLE_S), "cycle", 0)
    for n, (down, up) in outages.items():
        push(down, "down", n)
        if math.isfinite(up):
            push(up, "up", n)

    def close(n: int, t: float) -> None:
        timelines[n].add(since[n], t, status[n], job_of[n] if status[n] == "busy" else None)
        since[n] = t

    def try_start(pool: str, t: float) -> None:
        queue = queues[pool]
        skipped = 0  # with backfill: queued jobs passed over because they do not fit yet
        while len(queue) > skipped:
            free = [n for n in members[pool] if status[n] == "free"]
            job = queue[skipped]
            by_leaf: dict[str, list[int]] = {}
            for n in free:
                by_leaf.setdefault(fleet[n].leaf, []).append(n)
            # Big jobs must sit under one leaf switch (no spine hops for their all-reduce).
            if len(free) < job.k or (
                job.k >= LEAF_LOCAL_K and max((len(v) for v in by_leaf.values()), default=0) < job.k
            ):
                if not backfill or not free:
                    return
                skipped += 1
                continue
            del queue[skipped]
            if job.k >= LEAF_LOCAL_K:
                leaf = max(sorted(by_leaf), key=lambda lf: len(by_leaf[lf]))
                by_leaf = {leaf: by_leaf[leaf]}
            chosen: list[int] = []
            for leaf in sorted(by_leaf, key=lambda lf: (-len(by_leaf[lf]), lf)):
                group = by_leaf[leaf]
                rng.shuffle(group)
                chosen.extend(group[: job.k - len(chosen)])
                if len(chosen) == job.k:
                    break
            job.start, job.end, job.nodes = t, t + job.duration, tuple(sorted(chosen))
            for n in chosen:
                close(n, t)
                status[n], job_of[n] = "busy", job
            push(job.end, "end", job.id)

    def finish(job: Job, t: float) -> None:
        job.end = t
        released = []
        for n in job.nodes:
            if job_of[n] is job and status[n] == "busy":
                close(n, t)
                status[n], job_of[n] = "hold", None
                push(t + HOLD_S, "release", n)
                released.append(n)
        freed.append((t, tuple(released)))

    while events:
        t, _, kind, arg = heapq.heappop(events)
        if t >= t_end:
            break
        if kind == "arrive":
            queues[jobs[arg].pool].append(jobs[arg])
        elif kind == "end":
            job = jobs[arg]
            if job.end == t and any(job_of[n] is job for n in job.nodes):
                finish(job, t)
        elif kind == "release":
            if status[arg] == "hold":
                close(arg, t)
                status[arg] = "free"
        elif kind == "cycle":
            for hw in POOLS:
                try_start(hw.pool, t)
            push(t + SCHED_CYCLE_S, "cycle", 0)
        elif kind == "down":
            running = job_of[arg]
            if running is not None and status[arg] == "busy":
                # The job dies with the node; its other nodes are freed (and checked) at once.
                close(arg, t)
                status[arg], job_of[arg] = "down", None
                finish(running, t)
            else:
                close(arg, t)
                status[arg] = "down"
        elif kind == "up" and status[arg] == "down":
            close(arg, t)
            status[arg] = "free"
    for n in range(len(fleet)):
        close(n, t_end)
    started = [j for j in jobs if not math.isnan(j.start)]
    return Schedule(started, timelines, freed)


# -- the prober -----------------------------------------------------------------------------


@dataclass
class ProbeRun:
    kind: str  # nccl_allreduce_local | nccl_allreduce_pair
    nodes: tuple[int, ...]
    t0: float
    t1: float
    error: str | None = None


def _probe_seconds(rng: random.Random, hw: Hardware, pair: bool) -> float:
    ranks = 16 if pair else 8
    busbw = hw.pair_busbw if pair else hw.local_busbw
    per_op = PROBE_SIZE / (busbw / (2 * (ranks - 1) / ranks))
    setup = rng.uniform(4.0, 8.0) if pair else rng.uniform(2.5, 4.0)  # bootstrap, warm-up
    return setup + 25 * per_op


def _plan_probes(seed: int, fleet: list[Node], sched: Schedule, t0: float, t1: float) -> list[ProbeRun]:
    rng = _rng(seed, "prober")
    tl = sched.timelines
    candidates: list[tuple[float, int, str, tuple[int, ...]]] = []
    for node in fleet:
        t = t0 + rng.uniform(0, LOCAL_EVERY_S) - LOCAL_EVERY_S
        while t < t1:
            candidates.append((t, 2, "local", (node.idx,)))
            t += LOCAL_EVERY_S
    for t, nodes in sched.freed:
        if len(nodes) >= 2 and t0 - 60 <= t < t1:
            candidates.append((t + rng.uniform(1.0, 3.0), 0, "ring", nodes))
    for hw in POOLS:
        t = t0 + rng.uniform(0, PAIR_EVERY_S) - PAIR_EVERY_S
        while t < t1:
            candidates.append((t, 1, "idle:" + hw.pool, ()))
            t += PAIR_EVERY_S
    candidates.sort()

    busy_until = [-math.inf] * len(fleet)
    last_tested: dict[tuple[int, int], float] = {}
    runs: list[ProbeRun] = []

    def run(kind: str, nodes: tuple[int, ...], t: float) -> float:
        hw = fleet[nodes[0]].hw
        end = t + _probe_seconds(rng, hw, kind == "nccl_allreduce_pair")
        probe = ProbeRun(kind, nodes, t, end)
        job_at = min(tl[n].next_busy(t) for n in nodes)
        if job_at < end:
            probe.t1, probe.error = job_at + rng.uniform(0.5, 1.5), "stepped aside: a job started"
        elif rng.random() < TIMEOUT_P:
            probe.t1 = t + PROBE_TIMEOUT_S
            probe.error = f"timeout: nccl-tests did not finish within {PROBE_TIMEOUT_S:.0f} s"
        for n in nodes:
            busy_until[n] = probe.t1
        if len(nodes) == 2:
            last_tested[(min(nodes), max(nodes))] = t
        runs.append(probe)
        return probe.t1

    def idle(n: int, t: float, allow_hold: bool) -> bool:
        state, _ = tl[n].at(t)
        ok = state == "free" or (allow_hold and state == "hold")
        return ok and busy_until[n] <= t

    for t, _, what, nodes in candidates:
        if what == "local":
            if idle(nodes[0], t, allow_hold=True):
                run("nccl_allreduce_local", nodes, t)
        elif what == "ring":
            ring = [n for n in nodes if idle(n, t, allow_hold=True)]
            if len(ring) < 2:
                continue
            edges = [(ring[i], ring[(i + 1) % len(ring)]) for i in range(len(ring))]
            if len(ring) == 2:
                edges = edges[:1]
            # Rounds of disjoint edges: even edges, odd edges, and the closing edge of an odd ring.
            rounds = [edges[0::2], edges[1::2]]
            if len(ring) % 2 == 1 and len(ring) > 2:
                rounds = [edges[0:-1:2], edges[1:-1:2], edges[-1:]]
            at = t
            for batch in rounds:
                ends = [run("nccl_allreduce_pair", e, at + rng.uniform(0, 0.5)) for e in batch]
                at = max(ends, default=at) + 0.5
        else:
            pool = what.split(":", 1)[1]
            free = [n.idx for n in fleet if n.hw.pool == pool and idle(n.idx, t, allow_hold=False)]
            rng.shuffle(free)
            by_leaf: dict[str, list[int]] = {}
            for n in free:
                by_leaf.setdefault(fleet[n].leaf, []).append(n)
            # Pairs within a leaf first (a slow pair there names one link), then across leaves.
            pairs: list[tuple[int, int]] = []
            leftovers: list[int] = []
            for leaf in sorted(by_leaf):
                leftovers.extend(_pair_least_recent(by_leaf[leaf], last_tested, pairs))
            _pair_least_recent(leftovers, last_tested, pairs)
            for a, b in pairs:
                run("nccl_allreduce_pair", (a, b), t + rng.uniform(0, 5))
    runs.sort(key=lambda r: r.t1)
    return runs


def _pair_least_recent(
    nodes: list[int], last: dict[tuple[int, int], float], out: list[tuple[int, int]]
) -> list[int]:
    """Greedy pairing, least recently tested pair first; returns the nodes left unpaired."""
    options = sorted(
        (last.get((min(a, b), max(a, b)), -math.inf), i, j)
        for i, a in enumerate(nodes)
        for j, b in enumerate(nodes)
        if i < j
    )
    used: set[int] = set()
    for _, i, j in options:
        if i not in used and j not in used:
            used |= {i, j}
            out.append((nodes[i], nodes[j]))
    return [n for i, n in enumerate(nodes) if i not in used]


# -- faults ---------------------------------------------------------------------------------


@dataclass
class Fault:
    id: int
    kind: str
    fault_class: str
    node: int
    start: float
    end: float | None = None
    peer: int | None = None
    gpu: int | None = None
    port: int | None = None
    ratio: float = 1.0  # clock or bandwidth ratio
    rate: float = 0.0  # errors per second
    level: float = 0.0  # second magnitude: a temperature, a busbw ratio, an error fraction
    variant: str = ""
    rack: str | None = None

    def active(self, t: float) -> bool:
        return self.start <= t and (self.end is None or t < self.end)


def _steady_busy_after(tl: Timeline, t: float) -> float:
    """Seconds of steady job load (start-up excluded) on a node after ``t``."""
    total = 0.0
    for t0, t1, kind, job in tl.segs:
        if kind == "busy" and job is not None:
            total += max(0.0, t1 - max(t, t0 + job.startup_s))
    return total


def _pair_counts(runs: list[ProbeRun], after: float) -> dict[tuple[int, int], int]:
    counts: dict[tuple[int, int], int] = {}
    for r in runs:
        if r.kind == "nccl_allreduce_pair" and r.error is None and r.t0 >= after:
            a, b = r.nodes
            key = (min(a, b), max(a, b))
            counts[key] = counts.get(key, 0) + 1
    return counts


class _Planner:
    """Draws every fault: nodes, times and magnitudes, all from the seed."""

    def __init__(self, seed: int, fleet: list[Node], t0: float, t1: float, at_start: bool = False) -> None:
        self.rng = _rng(seed, "faults")
        self.fleet, self.t0, self.t1 = fleet, t0, t1
        self.at_start = at_start
        self.used: set[int] = set()
        self.faults: list[Fault] = []

    def onset(self, lo: float = 0.1, hi: float = 0.5, *, fault: bool = True) -> float:
        """A fault's onset (drawn either way, so ``at_start`` moves no other draw)."""
        at = self.t0 + self.rng.uniform(lo, hi) * (self.t1 - self.t0)
        return self.t0 if self.at_start and fault else at

    def pick(self, candidates: Sequence[int] | None = None) -> int:
        pool = [n for n in (candidates if candidates is not None else range(len(self.fleet)))]
        free = [n for n in pool if n not in self.used]
        if not free:
            free = [n.idx for n in self.fleet if n.idx not in self.used]
        n = self.rng.choice(free)
        self.used.add(n)
        return n

    def add(self, kind: str, fault_class: str, node: int, start: float, **kw: Any) -> Fault:
        fault = Fault(len(self.faults), kind, fault_class, node, start, **kw)
        self.faults.append(fault)
        return fault


# -- per-node state and reports -------------------------------------------------------------


@dataclass
class _Gpu:
    energy: float = 0.0
    temp: float | None = None
    power: float | None = None
    sbe_vol: int = 0
    sbe_agg: int = 0
    dbe_vol: int = 0
    dbe_agg: int = 0
    remap_corr: int = 0
    remap_unc: int = 0
    remap_pending: bool = False
    remap_failure: bool = False
    pcie_replay: int = 0
    nvlink: list[list[int]] = field(default_factory=list)  # per link: flit, data, replay, recovery
    lost: bool = False


@dataclass
class _Port:
    counters: dict[str, int]
    rx_words: int = 0
    tx_words: int = 0
    rx_packets: int = 0
    tx_packets: int = 0


@dataclass
class _Eth:
    counters: dict[str, int]
    rx_bytes: int = 0
    tx_bytes: int = 0
    rx_packets: int = 0
    tx_packets: int = 0


@dataclass(frozen=True)
class _ProbeResult:
    run: ProbeRun
    ok: bool
    busbw: float | None
    error: str | None
    shows: frozenset[int]


def _probe_results(
    seed: int, fleet: list[Node], runs: list[ProbeRun], faults: list[Fault], k: float = 1.0
) -> list[_ProbeResult]:
    rng = _rng(seed, "probe-values")
    by_node: dict[int, list[Fault]] = {}
    for f in faults:
        by_node.setdefault(f.node, []).append(f)
    out: list[_ProbeResult] = []
    for r in runs:
        hw = fleet[r.nodes[0]].hw
        if r.error is not None:
            out.append(_ProbeResult(r, False, None, r.error, frozenset()))
            continue
        shows: set[int] = set()
        if r.kind == "nccl_allreduce_local":
            bw = hw.local_busbw * fleet[r.nodes[0]].local_factor * rng.gauss(1.0, 0.008 * k)
            for f in by_node.get(r.nodes[0], []):
                if f.kind == "slow_gpu" and f.active(r.t0):
                    bw *= f.level
                    shows.add(f.id)
        else:
            a, b = r.nodes
            bw = hw.pair_busbw * min(fleet[a].nic_factor, fleet[b].nic_factor) * rng.gauss(1.0, 0.015 * k)
            for n in r.nodes:
                for f in by_node.get(n, []):
                    if not f.active(r.t0):
                        continue
                    if f.kind == "slow_nic":
                        bw *= f.ratio
                        shows.add(f.id)
                    elif f.kind == "ib_port_down":
                        bw *= (PORTS - 1) / PORTS  # NCCL runs the remaining rails
                    elif f.kind == "degraded_link" and n == f.node and f.peer in (a, b):
                        bw *= f.ratio
                        shows.add(f.id)
        out.append(_ProbeResult(r, True, bw, None, frozenset(shows)))
    return out


@dataclass
class _Ctx:
    seed: int
    fleet: list[Node]
    sched: Schedule
    t0: float
    t1: float
    interval: float
    drift_phase: float
    faults: dict[int, list[Fault]]
    probes: dict[int, list[_ProbeResult]]
    app_xids: dict[int, list[Fault]]
    noise: float = 1.0


@dataclass
class _Out:
    time: float  # true time the report was assembled
    report: dict[str, Any]
    shows: frozenset[int]


@dataclass(frozen=True)
class _Moment:
    """What one report's readings depend on: when, how long since the last, and the load."""

    t: float
    dt: float
    phase: str  # idle | startup | ckpt | steady
    job: Job | None
    inlet: float
    active: list[Fault]
    shows: set[int]  # fault ids this report shows; the readings add to it
    first: bool


def _quantize(hz: float, hw: Hardware) -> float:
    if hz >= hw.sm_max_hz:
        return hw.sm_max_hz
    return max(hw.sm_idle_hz, math.floor(hz / 15e6) * 15e6)


def _sat_add(counters: dict[str, int], name: str, n: int) -> None:
    counters[name] = min(IB_COUNTER_MAX.get(name, U64), counters[name] + n)


class _NodeSim:
    """One node's hardware from the trace start to its end, one report per agent cycle."""

    def __init__(self, ctx: _Ctx, node: Node) -> None:
        self.ctx, self.node, self.hw = ctx, node, node.hw
        self.rng = _rng(ctx.seed, "node", node.idx)
        self.faults = ctx.faults.get(node.idx, [])
        self.tl = ctx.sched.timelines[node.idx]
        rng = self.rng
        # Persistent across boots: aggregate ECC counts and row remaps live in the InfoROM.
        self.sbe_agg = [(_poisson(rng, 3.0) if rng.random() < 0.05 else 0) for _ in range(GPUS)]
        self.remap_corr = [(rng.randint(1, 3) if rng.random() < 0.03 else 0) for _ in range(GPUS)]
        self.gpus: list[_Gpu] = []
        self.ports: list[_Port] = []
        self.eth = _Eth({})

    # -- boots

    def _fresh_boot(self, history_s: float) -> None:
        """Counters as the hardware holds them ``history_s`` after power-on (0: just booted)."""
        rng, hw = self.rng, self.hw
        busy = 0.65 * history_s
        self.gpus = []
        for g in range(GPUS):
            gpu = _Gpu(
                energy=history_s * self.node.idle_w[g] + busy * hw.power_limit_w * 0.6,
                sbe_agg=self.sbe_agg[g],
                remap_corr=self.remap_corr[g],
                pcie_replay=_poisson(rng, history_s / 86400.0 * 0.3),
                nvlink=[[_poisson(rng, history_s / 86400.0 * 0.05), 0, 0, 0] for _ in range(hw.nvlinks)],
            )
            gpu.nvlink = [[c[0], 0, c[0], 0] for c in gpu.nvlink]
            self.gpus.append(gpu)
        self.ports = []
        for _ in range(PORTS):
            traffic = busy * 0.25 * hw.ib_rate + history_s * 2e4
            counters = {name: 0 for name in IB_COUNTER_MAX}
            counters.update({name: 0 for name in IB_HW_COUNTERS})
            counters["port_xmit_wait"] = min(U32, int(busy * 0.25 * 2e6))
            counters["symbol_error"] = _poisson(rng, history_s / 86400.0 * 0.5)
            counters["link_error_recovery"] = min(U8, _poisson(rng, history_s / 86400.0 * 0.1))
            counters["link_downed"] = min(U8, _poisson(rng, history_s / 86400.0 * 0.05))
            counters["out_of_sequence"] = _poisson(rng, history_s / 86400.0 * 20)
            counters["packet_seq_err"] = _poisson(rng, history_s / 86400.0 * 2)
            words = int(traffic / 4)
            port = _Port(counters, rx_words=words, tx_words=int(words * rng.uniform(0.98, 1.02)))
            port.rx_packets, port.tx_packets = port.rx_words * 4 // 4136, port.tx_words * 4 // 4136
            port.rx_packets += int(history_s * 60)
            port.tx_packets += int(history_s * 60)
            self.ports.append(port)
        eth = {name: 0 for name in ETH_COUNTERS}
        eth["carrier_changes"] = 2 if history_s > 0 else 0  # link up at boot
        eth["rx_dropped"] = int(history_s * 0.01)
        eth["multicast"] = int(history_s * 0.5)
        self.eth = _Eth(eth, int(history_s * 6e4), int(history_s * 4e4))
        self.eth.rx_packets, self.eth.tx_packets = self.eth.rx_bytes // 800, self.eth.tx_bytes // 600

    def _boots(self) -> list[tuple[float, float, bool]]:
        """(agent start, agent stop, counters fresh) per boot the trace sees."""
        phase = self.rng.uniform(0, self.ctx.interval)
        boots = [(self.ctx.t0 + phase, self.ctx.t1, False)]
        for f in self.faults:
            if f.kind == "reboot" and f.end is not None:
                boots = [(boots[0][0], f.start, False), (f.end + self.rng.uniform(0, 2), self.ctx.t1, True)]
        return boots

    def run(self) -> list[_Out]:
        out: list[_Out] = []
        for n_boot, (agent_start, stop, fresh) in enumerate(self._boots()):
            # After a reboot, the agent starts with the node: the counters count from power-on,
            # about 40 s earlier (firmware, kernel, kubelet).
            history = 40.0 if fresh else self.node.uptime_s
            self._fresh_boot(history)
            boot_id = f"{_rng(self.ctx.seed, 'boot', self.node.idx, n_boot).getrandbits(128):032x}"
            boot_id = "-".join((boot_id[:8], boot_id[8:12], boot_id[12:16], boot_id[16:20], boot_id[20:]))
            t_prev = agent_start - self.ctx.interval
            seq = 0
            while True:
                t = agent_start + seq * self.ctx.interval + self.rng.gauss(0.0, 0.003)
                if t >= stop:
                    break
                out.append(self._report(t, t_prev, seq, boot_id, first=seq == 0, boot=n_boot))
                t_prev = t
                seq += 1
        return out

    # -- one report

    def _phase(self, t: float) -> tuple[str, Job | None]:
        kind, job = self.tl.at(t)
        if kind != "busy" or job is None:
            return "idle", None
        rel = t - job.start
        if rel < job.startup_s:
            return "startup", job
        if (rel - job.startup_s + job.ckpt_phase) % job.ckpt_period < job.ckpt_len:
            return "ckpt", job
        return "steady", job

    def _report(self, t: float, t_prev: float, seq: int, boot_id: str, *, first: bool, boot: int) -> _Out:
        node, hw = self.node, self.hw
        dt = t - t_prev
        skew = node.skew
        phase, job = self._phase(t)
        shows: set[int] = set()
        events: list[dict[str, Any]] = []
        errors: list[dict[str, Any]] = []
        active = [f for f in self.faults if f.active(t)]
        for f in self.faults:
            if f.kind == "clock_skew" or (f.kind == "reboot" and boot == 1):
                shows.add(f.id)
        for f in self.faults + self.ctx.app_xids.get(node.idx, []):
            if t_prev < f.start <= t:
                self._onset(f, events, skew)
        for f in self.ctx.app_xids.get(node.idx, []):
            if t_prev < f.start <= t:
                shows.add(f.id)

        inlet = _inlet(node, t, self.ctx.drift_phase)
        moment = _Moment(t, dt, phase, job, inlet, active, shows, first)
        gpus: list[dict[str, Any]] = []
        for g in range(GPUS):
            state = self.gpus[g]
            if state.lost:
                errors.append(
                    {
                        "collector": "nvml",
                        "message": f"GPU {g} ({node.uuids[g]}): GPU is lost",
                        "code": "gpu_lost",
                        "gpu": g,
                    }
                )
                continue
            gpus.append(self._gpu(g, moment))
        for f in active:
            if f.kind in ("xid79", "dbe", "remap_failure", "ib_port_down"):
                shows.add(f.id)
        nics = [self._port(p, moment) for p in range(PORTS)]
        nics.append(self._eth(dt))

        probes: list[dict[str, Any]] = []
        for res in self.ctx.probes.get(node.idx, []):
            if t_prev < res.run.t1 <= t:
                peer = [n for n in res.run.nodes if n != node.idx]
                probes.append(
                    {
                        "kind": res.run.kind,
                        "time": round(res.run.t1 + skew, 3),
                        "ok": res.ok,
                        "peer": self.ctx.fleet[peer[0]].name if peer else None,
                        "size_bytes": PROBE_SIZE,
                        "busbw_bytes_per_second": None if res.busbw is None else round(res.busbw, 0),
                        "duration_seconds": round(res.run.t1 - res.run.t0, 3),
                        "error": res.error,
                    }
                )
                shows |= res.shows
        report: dict[str, Any] = {
            "schema": SCHEMA,
            "node": node.name,
            "time": round(t + skew, 3),
            "seq": seq,
            "boot_id": boot_id,
            "agent_version": AGENT_VERSION,
            "interval_seconds": self.ctx.interval,
            "labels": {"pool": hw.pool, "rack": node.rack, "leaf": node.leaf},
            "gpus": gpus,
            "nics": nics,
            "events": events,
            "probes": probes,
            "errors": errors,
        }
        return _Out(t, report, frozenset(shows))

    def _onset(self, f: Fault, events: list[dict[str, Any]], skew: float) -> None:
        """What happens once, at a fault's start: XIDs in the kernel log, counters that step."""
        at = round(f.start + skew, 3)
        g = f.gpu
        bus = self.node.pci[g][4:12] if g is not None else ""

        def xid(code: int, text: str, when: float = at) -> None:
            msg = f"NVRM: Xid (PCI:{bus}): {code}, {text}"
            events.append({"kind": "xid", "time": when, "gpu": g, "code": code, "message": msg})

        if f.kind == "xid79" and g is not None:
            xid(79, "pid='<unknown>', name=<unknown>, GPU has fallen off the bus.")
            self.gpus[g].lost = True
        elif f.kind == "dbe" and g is not None:
            state = self.gpus[g]
            xid(
                48,
                "pid=41873, name=python3, An uncorrectable double bit error (DBE) has been detected "
                "on GPU in the framebuffer at partition 3, subpartition 1.",
            )
            xid(
                63,
                "pid=41873, name=python3, Row Remapper: New row marked for remapping, reset gpu to activate.",
                round(at + 0.002, 3),
            )
            state.dbe_vol += 1
            state.dbe_agg += 1
            state.remap_unc += 1
            state.remap_pending = True
        elif f.kind == "remap_failure" and g is not None:
            state = self.gpus[g]
            xid(
                64,
                "pid=52210, name=python3, Row Remapper Error: failed to record a row remapping, "
                "the bank has no spare rows.",
            )
            state.remap_unc += 1
            state.remap_failure = True
        elif f.kind == "ib_port_down" and f.port is not None:
            _sat_add(self.ports[f.port].counters, "link_downed", 1)
        elif f.kind == "app_xid" and g is not None:
            texts = {
                13: "pid=30211, name=python3, Graphics SM Warp Exception on (GPC 2, TPC 1, SM 0): "
                "Out Of Range Address",
                31: "pid=30211, name=python3, Ch 00000010, intr 10000000. MMU Fault: ENGINE GRAPHICS "
                "GPCCLIENT_T1_3 faulted @ 0x7f3a_84000000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ",
                43: "pid=30211, name=python3, Ch 00000018",
            }
            code = int(f.level)
            xid(code, texts.get(code, "pid=30211, name=python3"))

    def _gpu(self, g: int, m: _Moment) -> dict[str, Any]:
        node, hw, rng, k = self.node, self.hw, self.rng, self.ctx.noise
        state, t, dt, phase, job, active, shows = self.gpus[g], m.t, m.dt, m.phase, m.job, m.active, m.shows
        idle_w = node.idle_w[g]
        reasons = 0
        clock = hw.sm_max_hz
        mem_used = hw.idle_memory_bytes + rng.randint(0, 4) * MIB
        util = 0.0
        target_temp: float | None = None
        if phase == "idle":
            power = idle_w * rng.gauss(1.0, 0.015 * k)
            clock, reasons, pstate = hw.sm_idle_hz, R_IDLE, 8
        else:
            assert job is not None
            pstate = 0
            full = hw.power_limit_w * 0.95 * job.intensity * node.efficiency[g]
            if phase == "startup":
                frac = min(1.0, (t - job.start) / job.startup_s)
                mem_used = int(hw.idle_memory_bytes + frac * job.mem_frac * hw.memory_bytes)
                util = rng.uniform(0.0, 0.03)
                power = idle_w * 1.4 * rng.gauss(1.0, 0.02 * k)
                clock, reasons = hw.sm_idle_hz, R_IDLE
            else:
                mem_used = int(job.mem_frac * hw.memory_bytes) + rng.randint(-64, 64) * MIB
                if phase == "ckpt":
                    util = rng.uniform(0.02, 0.25)
                else:
                    util = min(1.0, max(0.0, rng.gauss(job.util, 0.02 * k)))
                power = idle_w + (full - idle_w) * util * rng.gauss(1.0, 0.01 * k)
                if power > hw.power_limit_w:
                    clock = _quantize(hw.sm_max_hz * (hw.power_limit_w / power) ** (1 / 2.5), hw)
                    power = hw.power_limit_w * rng.uniform(0.985, 1.0)
                    reasons |= R_SW_POWER_CAP
                if util < 0.1:
                    reasons |= R_IDLE
            if phase == "steady":
                for f in active:
                    if f.kind == "power_brake":
                        clock = _quantize(min(clock, hw.sm_max_hz * f.ratio), hw)
                        power = max(idle_w * 1.3, power * f.ratio**2)
                        reasons = (reasons & ~R_SW_POWER_CAP) | R_HW_SLOWDOWN | R_HW_POWER_BRAKE
                        shows.add(f.id)
                    elif f.kind == "slow_gpu" and f.gpu == g:
                        clock = _quantize(min(clock, hw.sm_max_hz * f.ratio), hw)
                        power *= f.ratio
                        shows.add(f.id)
                    elif f.kind == "thermal" and f.gpu == g:
                        # Cooling cannot carry the heat: the die heads far past the slowdown point.
                        target_temp = f.level + 12.0
                        if state.temp is not None and state.temp >= f.level - 1.5:
                            clock = _quantize(min(clock, hw.sm_max_hz * f.ratio), hw)
                            power *= f.ratio**2
                            target_temp = f.level + rng.gauss(0.0, 0.5)
                            reasons = (reasons & ~R_SW_POWER_CAP) | R_SW_THERMAL
                            if f.level >= 85.0:
                                reasons |= R_HW_THERMAL
                            shows.add(f.id)
        steady_temp = m.inlet + 6.0 + hw.thermal_c_per_w * power + node.temp_offset[g]
        if target_temp is not None:
            steady_temp = max(steady_temp, target_temp)
        if state.temp is None:
            state.temp = steady_temp
        else:
            state.temp = steady_temp + (state.temp - steady_temp) * math.exp(-dt / 30.0)
        temp = float(round(state.temp + rng.gauss(0.0, 0.3 * k)))
        mem_temp = float(round(state.temp + 2.0 + 0.006 * power + rng.gauss(0.0, 0.4 * k)))
        prev_power = power if state.power is None or m.first else state.power
        state.energy += (prev_power + power) / 2 * dt
        state.power = power

        if node.weak_ecc[g]:
            n = _poisson(rng, dt / 600.0)
            state.sbe_vol += n
            state.sbe_agg += n
        gen, width = hw.pcie_gen, 16
        if phase == "idle":
            gen = hw.idle_pcie_gen
        healthy_link = (gen, width)
        nvlink_events = _poisson(rng, dt / (4 * 3600.0))
        for f in active:
            if f.kind == "pcie_downtrain" and f.gpu == g:
                if f.variant == "width":
                    width = 8
                else:
                    gen = min(gen, hw.pcie_gen - int(f.level))
                state.pcie_replay += _poisson(rng, f.rate * dt)
                if (gen, width) != healthy_link:
                    shows.add(f.id)
            elif f.kind == "nvlink_crc" and f.gpu == g and f.port is not None:
                n = _poisson(rng, f.rate * dt)
                link = state.nvlink[f.port]
                link[0] += n
                link[1] += _poisson(rng, f.rate * dt / 10)
                link[2] += n
                if n:
                    shows.add(f.id)
        if nvlink_events and rng.random() < 1 / GPUS:
            link = state.nvlink[rng.randrange(hw.nvlinks)]
            link[0] += 1
            link[2] += 1
        return {
            "index": g,
            "uuid": node.uuids[g],
            "model": hw.model,
            "pci_bus_id": node.pci[g],
            "utilization_ratio": round(util, 2),
            "memory_used_bytes": max(0, mem_used),
            "memory_total_bytes": hw.memory_bytes,
            "temperature_celsius": temp,
            "memory_temperature_celsius": mem_temp,
            "power_watts": round(power, 3),
            "power_limit_watts": hw.power_limit_w,
            "energy_joules_total": round(state.energy, 3),
            "sm_clock_hz": clock,
            "sm_clock_max_hz": hw.sm_max_hz,
            "memory_clock_hz": hw.mem_clock_hz,
            "clock_event_reasons": reasons,
            "performance_state": pstate,
            "ecc_sbe_volatile_total": state.sbe_vol,
            "ecc_dbe_volatile_total": state.dbe_vol,
            "ecc_sbe_aggregate_total": state.sbe_agg,
            "ecc_dbe_aggregate_total": state.dbe_agg,
            "retired_pages_sbe": None,
            "retired_pages_dbe": None,
            "retired_pages_pending": None,
            "remapped_rows_correctable": state.remap_corr,
            "remapped_rows_uncorrectable": state.remap_unc,
            "remapped_rows_pending": state.remap_pending,
            "remapped_rows_failure": state.remap_failure,
            "pcie_link_gen": gen,
            "pcie_link_gen_max": hw.pcie_gen,
            "pcie_link_width": width,
            "pcie_link_width_max": 16,
            "pcie_replay_total": state.pcie_replay,
            "nvlink": [
                {
                    "link": i,
                    "active": True,
                    "crc_flit_errors_total": c[0],
                    "crc_data_errors_total": c[1],
                    "replay_errors_total": c[2],
                    "recovery_errors_total": c[3],
                }
                for i, c in enumerate(state.nvlink)
            ],
        }

    def _port(self, p: int, m: _Moment) -> dict[str, Any]:
        hw, rng = self.hw, self.rng
        t, dt, phase, job, active, shows = m.t, m.dt, m.phase, m.job, m.active, m.shows
        port = self.ports[p]
        c = port.counters
        down = any(f.kind == "ib_port_down" and f.port == p for f in active)
        n_down = sum(1 for f in active if f.kind == "ib_port_down")
        if not down:
            rate = 2e4  # subnet management, IPoIB neighbours
            bulk = 0.0
            if job is not None and job.ib_frac > 0:
                share = PORTS / (PORTS - n_down)
                frac = {"steady": job.ib_frac, "ckpt": 0.02, "startup": 0.001}.get(phase, 0.0)
                bulk = min(0.95, frac * share) * hw.ib_rate * rng.gauss(1.0, 0.05) * dt
            for res in self.ctx.probes.get(self.node.idx, []):
                r = res.run
                if r.kind == "nccl_allreduce_pair" and res.ok and t - dt < r.t1 <= t:
                    bulk += PROBE_SIZE * 30 / (PORTS - n_down)
            tx = max(0.0, bulk) + rate * dt
            rx = max(0.0, bulk * rng.uniform(0.99, 1.01)) + rate * dt * rng.uniform(0.9, 1.1)
            port.tx_words = min(U64, port.tx_words + int(tx / 4))
            port.rx_words = min(U64, port.rx_words + int(rx / 4))
            port.tx_packets += int(bulk / 4136) + int(rate * dt / 300)
            port.rx_packets += int(bulk / 4136) + int(rate * dt / 300)
            _sat_add(c, "port_xmit_wait", int(bulk / max(1.0, hw.ib_rate * dt) * 2e6 * dt))
            if rng.random() < dt / 100_000.0:
                _sat_add(c, "symbol_error", 1)
            if bulk and rng.random() < dt / 600.0:
                c["out_of_sequence"] += 1
        for f in active:
            if f.kind == "symbol_storm" and f.port == p:
                before = c["symbol_error"]
                _sat_add(c, "symbol_error", _poisson(rng, f.rate * dt))
                _sat_add(c, "port_rcv_errors", _poisson(rng, f.rate * f.level * dt))
                _sat_add(c, "link_error_recovery", _poisson(rng, dt / 300.0))
                if c["symbol_error"] > before:
                    shows.add(f.id)
        c["port_xmit_data"], c["port_rcv_data"] = port.tx_words, port.rx_words
        c["port_xmit_packets"], c["port_rcv_packets"] = port.tx_packets, port.rx_packets
        c["unicast_xmit_packets"], c["unicast_rcv_packets"] = port.tx_packets, port.rx_packets
        c["multicast_xmit_packets"] = c.get("multicast_xmit_packets", 0)
        c["multicast_rcv_packets"] = c.get("multicast_rcv_packets", 0) + (1 if rng.random() < dt / 30 else 0)
        return {
            "device": f"mlx5_{p}",
            "port": 1,
            "netdev": f"ib{p}",
            "link_layer": "InfiniBand",
            "state": "DOWN" if down else "ACTIVE",
            "phys_state": "Polling" if down else "LinkUp",
            "rate_bytes_per_second": 1.25e9 if down else hw.ib_rate,
            "rx_bytes_total": port.rx_words * 4,
            "tx_bytes_total": port.tx_words * 4,
            "rx_packets_total": port.rx_packets,
            "tx_packets_total": port.tx_packets,
            "counters": dict(c),
        }

    def _eth(self, dt: float) -> dict[str, Any]:
        rng, eth = self.rng, self.eth
        rx = int(6e4 * dt * rng.uniform(0.7, 1.3))
        tx = int(4e4 * dt * rng.uniform(0.7, 1.3)) + 16_000  # the report itself, gzip'd
        eth.rx_bytes += rx
        eth.tx_bytes += tx
        eth.rx_packets += rx // 800
        eth.tx_packets += tx // 600
        eth.counters["rx_dropped"] += _poisson(rng, dt * 0.01)  # unknown EtherTypes, LLDP
        eth.counters["multicast"] += _poisson(rng, dt * 0.5)
        return {
            "device": "eth0",
            "port": None,
            "netdev": "eth0",
            "link_layer": "Ethernet",
            "state": "up",
            "phys_state": None,
            "rate_bytes_per_second": 3.125e9,
            "rx_bytes_total": eth.rx_bytes,
            "tx_bytes_total": eth.tx_bytes,
            "rx_packets_total": eth.rx_packets,
            "tx_packets_total": eth.tx_packets,
            "counters": dict(eth.counters),
        }


# -- the whole trace ------------------------------------------------------------------------


def _plan(
    seed: int, fleet: list[Node], t0: float, t1: float, knobs: Knobs = DEFAULT_KNOBS
) -> tuple[list[Fault], Schedule, list[ProbeRun]]:
    plan = _Planner(seed, fleet, t0, t1, knobs.faults_at_start)
    rng = plan.rng
    span = t1 - t0
    racks = sorted({n.rack for n in fleet})

    # Silence first: a whole rack, so no other fault may sit in it.
    rack = rng.choice(racks)
    silent_len = min(rng.uniform(8, 12) * 60.0, 0.4 * span)
    silent_at = t0 + rng.uniform(0.1, 0.5) * (span - silent_len)
    for n in fleet:
        if n.rack == rack:
            plan.used.add(n.idx)
    silent = plan.add("silent_rack", "silent", -1, silent_at, end=silent_at + silent_len, rack=rack)

    # Faults that change the schedule: the lost GPU's job dies, the rebooting node's too.
    xid79 = plan.add("xid79", "hard", plan.pick(), plan.onset(), gpu=rng.randrange(GPUS))
    reboot_at = plan.onset(0.15, 0.6, fault=False)
    reboot = plan.add("reboot", "lookalike", plan.pick(), reboot_at, end=reboot_at + rng.uniform(120, 300))
    assert reboot.end is not None
    outages = {xid79.node: (xid79.start, math.inf), reboot.node: (reboot.start, reboot.end)}
    if knobs.healthy:
        del outages[xid79.node]
    if knobs.busy_share is None:
        sched = _schedule(seed, fleet, t0 - WARMUP_S, t1, outages, knobs=knobs)
    else:
        sched = _schedule_for_share(seed, fleet, t0, t1, outages, knobs=knobs)
    runs = _plan_probes(seed, fleet, sched, t0, t1)

    # The degraded link: a same-pool, same-leaf pair the prober tests at least 3 times after onset.
    link_at = plan.onset(0.1, 0.3)
    counts = _pair_counts(runs, link_at)
    eligible = {
        key: c
        for key, c in counts.items()
        if not (set(key) & plan.used)
        and fleet[key[0]].leaf == fleet[key[1]].leaf
        and fleet[key[0]].hw is fleet[key[1]].hw
    }
    good = sorted(k for k, c in eligible.items() if c >= 4) or sorted(
        k for k, c in eligible.items() if c >= 3
    )
    if good:
        a, b = rng.choice(good)
    elif eligible:
        a, b = max(sorted(eligible), key=lambda k: eligible[k])
    else:
        same = [
            (x.idx, y.idx)
            for x in fleet
            for y in fleet
            if x.idx < y.idx and x.leaf == y.leaf and x.hw is y.hw and not {x.idx, y.idx} & plan.used
        ]
        a, b = rng.choice(same)
    plan.used |= {a, b}
    plan.add("degraded_link", "link", a, link_at, peer=b, ratio=rng.uniform(0.5, 0.75))

    # slow_nic shows only in pair probes: prefer a node the prober tests after the onset.
    nic_at = plan.onset()
    tested: dict[int, int] = {}
    for (x, y), c in _pair_counts(runs, nic_at).items():
        tested[x] = tested.get(x, 0) + c
        tested[y] = tested.get(y, 0) + c
    probed = [n for n, c in sorted(tested.items()) if c >= 2]
    nic_node, nic_ratio = plan.pick(probed or None), rng.uniform(0.6, 0.8)
    plan.add(
        "slow_nic", "soft", nic_node, nic_at, ratio=LOW_SLOW_NIC_RATIO if knobs.low_magnitudes else nic_ratio
    )

    # Load-only faults: on nodes that will run a job for a while after the onset.
    for kind in ("thermal", "power_brake", "slow_gpu"):
        at = plan.onset()
        loaded = [n.idx for n in fleet if _steady_busy_after(sched.timelines[n.idx], at) >= 180.0]
        node = plan.pick(loaded or None)
        if kind == "thermal":
            plan.add(
                kind,
                "soft",
                node,
                at,
                gpu=rng.randrange(GPUS),
                ratio=rng.uniform(0.8, 0.9),
                level=rng.uniform(80.0, 86.0),
            )
        elif kind == "power_brake":
            plan.add(kind, "soft", node, at, ratio=rng.uniform(0.5, 0.7))
        else:
            gpu, ratio = rng.randrange(GPUS), rng.uniform(0.85, 0.92)
            plan.add(
                kind,
                "soft",
                node,
                at,
                gpu=gpu,
                ratio=LOW_SLOW_GPU_RATIO if knobs.low_magnitudes else ratio,
                level=rng.uniform(0.85, 0.93),
            )

    plan.add("dbe", "hard", plan.pick(), plan.onset(), gpu=rng.randrange(GPUS))
    plan.add("remap_failure", "hard", plan.pick(), plan.onset(), gpu=rng.randrange(GPUS))
    plan.add("ib_port_down", "hard", plan.pick(), plan.onset(), port=rng.randrange(PORTS))
    width = rng.random() < 0.6
    plan.add(
        "pcie_downtrain",
        "soft",
        plan.pick(),
        plan.onset(),
        gpu=rng.randrange(GPUS),
        variant="width" if width else "gen",
        level=float(rng.choice((1, 2))),
        rate=rng.uniform(0.01, 0.1),
    )
    crc_node = plan.pick()
    plan.add(
        "nvlink_crc",
        "soft",
        crc_node,
        plan.onset(),
        gpu=rng.randrange(GPUS),
        port=rng.randrange(fleet[crc_node].hw.nvlinks),
        rate=rng.uniform(0.5, 5.0),
    )
    storm_node, storm_at, storm_port, storm_rate = (
        plan.pick(),
        plan.onset(),
        rng.randrange(PORTS),
        rng.uniform(10.0, 100.0),
    )
    if knobs.low_magnitudes:
        storm_rate = symbol_errors_per_s(LOW_SYMBOL_BER_BUDGETS, fleet[storm_node].hw.ib_rate)
    plan.add(
        "symbol_storm",
        "soft",
        storm_node,
        storm_at,
        port=storm_port,
        rate=storm_rate,
        level=rng.uniform(0.01, 0.05),
    )

    # Look-alikes: application XIDs on busy nodes, and one node whose clock runs ahead.
    for code in (13, 31, 43):
        at = t0 + rng.uniform(0.05, 0.9) * span
        busy = [n.idx for n in fleet if sched.timelines[n.idx].at(at)[0] == "busy"]
        plan.add(
            "app_xid", "lookalike", plan.pick(busy or None), at, gpu=rng.randrange(GPUS), level=float(code)
        )
    skewed = plan.pick()
    fleet[skewed].skew = rng.uniform(20.0, 60.0)
    plan.add("clock_skew", "lookalike", skewed, t0, ratio=fleet[skewed].skew)
    del silent
    if knobs.healthy:
        return [f for f in plan.faults if f.fault_class in ("lookalike", "silent")], sched, runs
    return plan.faults, sched, runs


@dataclass(frozen=True)
class _Delivered:
    received: float
    out: _Out


def _deliver(
    seed: int,
    fleet: list[Node],
    outs: dict[int, list[_Out]],
    silent: Fault,
    spool_flush: bool,
    *,
    loss: float = LOSS_P,
) -> list[_Delivered]:
    rng = _rng(seed, "delivery")
    delivered: list[_Delivered] = []
    assert silent.end is not None
    for node in fleet:
        cut = node.rack == silent.rack
        backlog = 0
        for o in outs[node.idx]:
            if rng.random() < loss:
                continue
            if cut and silent.start <= o.time < silent.end:
                if not spool_flush:
                    continue
                # Spooled: sent oldest first once the management network is back.
                backlog += 1
                received = silent.end + rng.uniform(0.5, 3.0) + 0.05 * backlog
            else:
                received = o.time + rng.uniform(0.02, 2.0)
            delivered.append(_Delivered(received, o))
            if rng.random() < DUP_P:
                delivered.append(_Delivered(received + rng.uniform(1.0, 8.0), o))
    delivered.sort(key=lambda d: (d.received, d.out.report["node"], d.out.report["seq"]))
    return delivered


def _check_args(nodes: int, minutes: float, interval_s: float) -> None:
    if nodes < MIN_NODES:
        raise ValueError(f"nodes: at least {MIN_NODES} are needed to place every fault apart, got {nodes}")
    if nodes > 9999:
        raise ValueError(f"nodes: at most 9999, got {nodes}")
    if not minutes >= MIN_MINUTES:
        raise ValueError(f"minutes: at least {MIN_MINUTES:.0f}, got {minutes}")
    if not 1.0 <= interval_s <= 300.0:
        raise ValueError(f"interval_s: between 1 and 300 seconds, got {interval_s}")


def _simulate(
    seed: int,
    nodes: int,
    minutes: float,
    interval_s: float,
    spool_flush: bool,
    *,
    knobs: Knobs = DEFAULT_KNOBS,
) -> tuple[list[_Delivered], Truth]:
    _check_args(nodes, minutes, interval_s)
    knobs.check()
    t0, t1 = START, START + minutes * 60.0
    fleet = _build_fleet(seed, nodes, knobs.noise)
    faults, sched, runs = _plan(seed, fleet, t0, t1, knobs)
    results = _probe_results(seed, fleet, runs, faults, knobs.noise)
    by_node: dict[int, list[Fault]] = {}
    app: dict[int, list[Fault]] = {}
    for f in faults:
        if f.kind == "app_xid":
            app.setdefault(f.node, []).append(f)
        elif f.node >= 0:
            by_node.setdefault(f.node, []).append(f)
            if f.peer is not None:
                by_node.setdefault(f.peer, []).append(f)
    probes: dict[int, list[_ProbeResult]] = {}
    for res in results:
        for n in res.run.nodes:
            probes.setdefault(n, []).append(res)
    ctx = _Ctx(
        seed,
        fleet,
        sched,
        t0,
        t1,
        interval_s,
        _rng(seed, "room").uniform(0, 2 * math.pi),
        by_node,
        probes,
        app,
        knobs.noise,
    )
    # A link fault lives on both ends for the probes, but only its own node's reports step it.
    outs = {n.idx: _NodeSim(ctx, n).run() for n in fleet}
    silent = next(f for f in faults if f.kind == "silent_rack")
    delivered = _deliver(seed, fleet, outs, silent, spool_flush, loss=knobs.loss)

    first_seen: dict[int, float] = {}
    for d in delivered:
        for fid in d.out.shows:
            first_seen.setdefault(fid, d.out.report["time"])
    truth_faults: list[TruthFault] = []
    for f in faults:
        if f.kind == "silent_rack":
            truth_faults.extend(
                TruthFault(f.id, f.kind, f.fault_class, n.name, f.start, f.start, f.end, rack=f.rack)
                for n in fleet
                if n.rack == f.rack
            )
            continue
        truth_faults.append(
            TruthFault(
                f.id,
                f.kind,
                f.fault_class,
                fleet[f.node].name,
                f.start,
                first_seen.get(f.id),
                f.end,
                peer=None if f.peer is None else fleet[f.peer].name,
                gpu=f.gpu,
                port=f.port,
            )
        )
    assert all(f.fault_class in CLASSES for f in truth_faults)
    truth = Truth(seed, t0, t1, tuple(n.name for n in fleet), tuple(truth_faults))
    return delivered, truth


def generate(
    seed: int,
    *,
    nodes: int = 64,
    minutes: float = 30,
    interval_s: float = 10.0,
    spool_flush: bool = True,
    knobs: Knobs = DEFAULT_KNOBS,
) -> tuple[list[dict[str, Any]], Truth]:
    """The reports (JSON-ready dicts, in the order the aggregator receives them) and the truth.

    Same arguments, same output. ``spool_flush=False`` drops the silent rack's backlog instead of
    delivering it after the cut heals; ``knobs`` are the robustness knobs (``Knobs``). Raises
    ``ValueError`` for a fleet or trace too small to hold every fault apart, or a bad knob.
    """
    delivered, truth = _simulate(seed, nodes, float(minutes), float(interval_s), spool_flush, knobs=knobs)
    return [d.out.report for d in delivered], truth


def _lines(reports: Sequence[dict[str, Any]]) -> Iterator[bytes]:
    encoder = msgspec.json.Encoder()
    for r in reports:
        yield encoder.encode(r) + b"\n"


def write(seed: int, trace_path: Path | str, truth_path: Path | str, **kw: Any) -> Truth:
    """Generate and write the trace (JSON Lines, gzip when the name ends in .gz) and the truth."""
    reports, truth = generate(seed, **kw)
    trace_path, truth_path = Path(trace_path), Path(truth_path)
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    truth_path.parent.mkdir(parents=True, exist_ok=True)
    if trace_path.suffix == ".gz":
        with gzip.open(trace_path, "wb", compresslevel=6) as gz:
            gz.writelines(_lines(reports))
    else:
        with trace_path.open("wb") as f:
            f.writelines(_lines(reports))
    write_truth(truth_path, truth)
    log.info(
        "trace written",
        extra={
            "trace": str(trace_path),
            "truth": str(truth_path),
            "reports": len(reports),
            "faults": len(truth.faults),
            "seed": seed,
        },
    )
    return truth


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="othergen", description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--nodes", type=int, default=64)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--interval", type=float, default=10.0, help="agent interval, seconds")
    p.add_argument(
        "--no-spool-flush",
        action="store_true",
        help="drop the silent rack's backlog instead of delivering it late",
    )
    p.add_argument("--noise", type=float, default=1.0, help="healthy spreads widened this many times (1)")
    p.add_argument(
        "--job-median", type=float, default=DUR_MEDIAN_S / 60, help="median job duration, minutes (8)"
    )
    p.add_argument("--busy", type=float, default=None, help="share of node-time busy, 0..1 (default: FIFO)")
    p.add_argument("--loss", type=float, default=LOSS_P, help="share of reports lost (0.01)")
    p.add_argument("--faults-at-start", action="store_true", help="every fault from the first report")
    p.add_argument("--low-magnitudes", action="store_true", help="soft faults at their low end")
    p.add_argument("--healthy", action="store_true", help="no faults (look-alikes and the silent rack stay)")
    p.add_argument("--trace", type=Path, required=True, help="output trace, .jsonl or .jsonl.gz")
    p.add_argument("--truth", type=Path, required=True, help="output truth file (JSON)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    began = time.perf_counter()
    try:
        truth = write(
            args.seed,
            args.trace,
            args.truth,
            nodes=args.nodes,
            minutes=args.minutes,
            interval_s=args.interval,
            spool_flush=not args.no_spool_flush,
            knobs=Knobs(
                noise=args.noise,
                job_median_s=args.job_median * 60.0,
                busy_share=args.busy,
                loss=args.loss,
                faults_at_start=args.faults_at_start,
                low_magnitudes=args.low_magnitudes,
                healthy=args.healthy,
            ),
        )
    except ValueError as exc:
        print(f"othergen: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"othergen: cannot write: {exc}", file=sys.stderr)
        return 2
    seen = sum(1 for f in truth.faults if f.first_seen is not None)
    print(
        f"othergen: seed {args.seed}: {len(truth.nodes)} nodes, {len(truth.faults)} truth entries "
        f"({seen} seen) in {time.perf_counter() - began:.1f} s -> {args.trace}, {args.truth}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
