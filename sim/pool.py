"""A simulated pool of H100 nodes under realistic noise, written slot by slot into a ``PoolFrame``.

The peer detector's tests (``tests/test_detect_peers.py``) and its healthy-only false-alarm check
(``bench/peer_false_alarms.py``) share it; nothing in the service imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from aggregator.fleet.frame import GPU_COLUMN, GPU_FIELDS, PoolFrame

INTERVAL = 10.0
SLOTS = 60  # the pipeline's frame: 10 min at 10 s
GPUS = 8
MAX_HZ = 1_980e6
STEP_HZ = 15e6  # NVML clock granularity
C = GPU_COLUMN


@dataclass
class Fault:
    node: int
    gpu: int
    start: float  # seconds into the run
    slow: float = 0.0  # share of SM clock lost under load
    throttle: bool = False  # thermal: hot, HW/SW thermal slowdown, clocks down
    # Share of power lost under load: a fault only with ``slow`` or a slowdown bit (alone, a lighter job).
    power: float = 0.0
    pcie_gen: float | None = None  # PCIe generation over max under load (a link trained low)
    capped: bool = False  # held at its power limit (SW power cap bit) while its node-mates are not
    hot: float = 0.0  # C hotter under load at the same power (a bad fan, dried paste), no throttling


@dataclass
class PoolSim:
    """A pool of H100 nodes under realistic noise, written slot by slot into a ``PoolFrame``.

    Noise that a real pool has and a detector must live with: per-node offsets (inlet air, the job
    a node runs), per-GPU positional offsets in the chassis and silicon differences that persist,
    per-sample noise, step-phase power swings, nodes going idle between jobs, NVML clock steps,
    integer temperatures, and a rare stray slowdown bit.
    """

    nodes: int
    seed: int
    ambient_c_per_min: float = 0.0
    idle: bool = False
    faults: list[Fault] = field(default_factory=list)
    # node -> power of the job it runs against the pool's usual one (every GPU of the node).
    job_power: dict[int, float] = field(default_factory=dict)
    # Jobs that differ: a heavy job (half of them) holds its node's clocks at 1 - job_spread * |t(2)|
    # of the usual (at the power limit, SW power cap bit set; Student's t with 2 degrees of freedom
    # has no variance, so some jobs sit far out), for job_s seconds, idle idle_s seconds between.
    job_spread: float = 0.0
    job_s: tuple[float, float] = (600.0, 1800.0)
    # Thermal resistance, C per W over the pool's usual 600 W: a node drawing more runs hotter on
    # every GPU (0 by default: temperature independent of the job).
    c_per_w: float = 0.0
    idle_s: tuple[float, float] = (30.0, 120.0)

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        self.rng = rng
        shape = (self.nodes, GPUS)
        position = np.array([0.0, 1.5, 3.0, 4.5, 4.5, 3.0, 1.5, 0.0])  # middle of the chassis runs hotter
        self.temp_offset = rng.normal(0, 2.0, (self.nodes, 1)) + position + rng.normal(0, 1.5, shape)
        self.mem_offset = rng.normal(5.0, 1.5, shape)
        self.clock_offset = rng.normal(0, 0.01, shape)
        self.power_offset = rng.normal(0, 30.0, (self.nodes, 1)) + rng.normal(0, 15.0, shape)
        # Each node runs a job for a while, then sits idle between jobs.
        self.busy_until = rng.uniform(0, 1200, self.nodes)
        self.idle_until = np.zeros(self.nodes)
        self.job_clock = np.ones(self.nodes)
        self.lowest_job_clock = 1.0
        self.cap_offset = rng.normal(0, 0.01, shape)
        self.frame = PoolFrame("h100", interval_s=INTERVAL, slots=SLOTS, gpus=GPUS)
        self.names = [f"node-{i:03d}" for i in range(self.nodes)]

    def step(self, t: float) -> None:
        rng = self.rng
        shape = (self.nodes, GPUS)
        ended = t >= self.busy_until
        self.idle_until[ended] = t + rng.uniform(*self.idle_s, int(ended.sum()))
        self.busy_until[ended] = self.idle_until[ended] + rng.uniform(*self.job_s, int(ended.sum()))
        if self.job_spread:
            # Half the jobs are light (boost clock, under the power limit), half heavy.
            heavy = np.abs(rng.standard_t(2, int(ended.sum()))) * self.job_spread
            light = rng.random(int(ended.sum())) < 0.5
            self.job_clock[ended] = np.where(light, 1.0, np.maximum(1.0 - heavy, 0.5))
            self.lowest_job_clock = min(self.lowest_job_clock, float(self.job_clock.min()))
        busy = (t >= self.idle_until)[:, None] & np.ones(shape, bool) & (not self.idle)
        util = np.where(busy, rng.uniform(0.85, 1.0, shape), rng.uniform(0.0, 0.05, shape))
        phase = rng.normal(0, 40.0)  # the whole pool's step phase is not in sync, but close
        clock = np.where(busy, 0.95 + self.clock_offset + rng.normal(0, 0.01, shape), 0.175)
        capped = busy & (self.job_clock[:, None] < 1.0)
        # At the power limit each GPU's clock is what its own efficiency allows: a wider spread.
        clock = np.where(capped, clock * self.job_clock[:, None] * (1 + self.cap_offset), clock)
        ambient = 24.0 + self.ambient_c_per_min * t / 60
        temp = np.where(busy, ambient + 41 + self.temp_offset + rng.normal(0, 1.0, shape), ambient + 11)
        power = np.where(
            busy, 600 + phase + self.power_offset + rng.normal(0, 40.0, shape), 70 + rng.normal(0, 3, shape)
        )
        for node, scale in self.job_power.items():
            power[node] = np.where(busy[node], power[node] * scale, power[node])
        power = np.minimum(power, 700.0)
        temp = np.where(busy, temp + self.c_per_w * (power - 600.0), temp)
        gen = np.where(busy, 1.0, 0.2)  # Gen5 under load, Gen1 at idle (power management)
        bits = np.zeros((*shape, 4))
        bits[..., 0] = rng.random(shape) < 0.001
        for f in self.faults:
            if t < f.start or not busy[f.node, f.gpu]:
                continue
            if f.slow:
                clock[f.node, f.gpu] *= 1 - f.slow
            if f.power:
                power[f.node, f.gpu] *= 1 - f.power
            if f.pcie_gen is not None:
                gen[f.node, f.gpu] = f.pcie_gen
            if f.capped:
                capped[f.node, f.gpu] = True
            temp[f.node, f.gpu] += f.hot
            if f.throttle:
                temp[f.node, f.gpu] = rng.uniform(86, 89)
                clock[f.node, f.gpu] *= 0.85
                throttled = rng.random() < 0.7
                bits[f.node, f.gpu, 1] = throttled  # HW thermal
                bits[f.node, f.gpu, 3] = throttled  # SW thermal
        block = np.full((self.nodes, GPUS, len(GPU_FIELDS)), np.nan, np.float32)
        block[..., C["utilization_ratio"]] = util
        block[..., C["sm_clock_ratio"]] = (
            np.minimum(np.round(clock * MAX_HZ / STEP_HZ) * STEP_HZ, MAX_HZ) / MAX_HZ
        )
        block[..., C["temperature_celsius"]] = np.round(temp)
        block[..., C["memory_temperature_celsius"]] = np.round(temp + self.mem_offset)
        block[..., C["power_watts"]] = np.minimum(power, 700.0)
        block[..., C["power_limit_watts"]] = 700.0
        block[..., C["sw_power_cap"]] = capped
        block[..., C["pcie_link_gen_ratio"]] = gen
        for i, col in enumerate(("hw_slowdown", "hw_thermal", "power_brake", "sw_thermal")):
            block[..., C[col]] = bits[..., i]
        empty = np.zeros((0, 0), np.float32)
        # Reports land anywhere in their 10-s slot, as the agents' timers are not aligned.
        for i, name in enumerate(self.names):
            self.frame.write(name, t + float(rng.uniform(0, INTERVAL - 0.01)), block[i], [], empty)
