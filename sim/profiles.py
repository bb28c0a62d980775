"""Node profiles: what a healthy HGX node of each kind reports, from public numbers.

Sources (numbers below carry the letter of the source they come from):

[a] NVIDIA H100 Tensor Core GPU datasheet (SXM5 80GB: up to 700 W configurable TDP, NVLink 900 GB/s
    = 18 links of fourth-generation NVLink, PCIe Gen5 x16).
[b] NVIDIA H100 whitepaper / ``nvidia-smi -q -d CLOCK`` on H100 SXM: max SM clock 1980 MHz, idle
    345 MHz, HBM3 memory clock 2619 MHz; NVML memory total 81,559 MiB.
[c] NVIDIA A100 datasheet (SXM4 80GB: 400 W TDP, 12 third-generation NVLinks = 600 GB/s) and
    ``nvidia-smi -q`` on A100 SXM4 80GB: max SM clock 1410 MHz, idle 210 MHz, HBM2e 1593 MHz,
    81,920 MiB total.
[d] NVIDIA DGX H100 user guide: 8x ConnectX-7 single-port 400 Gb/s NDR for the compute fabric;
    DGX A100 user guide: 8x ConnectX-6 200 Gb/s HDR.
[e] Published ``nvidia-smi dmon`` traces and cloud provider monitoring write-ups: idle H100 SXM
    60-80 W, 30-40 C; training load 550-700 W, 60-80 C; HBM 2-6 C above the GPU; idle A100 SXM
    50-65 W; the PCIe link trains down to Gen1 at idle (ASPM/power management) and back up under load.
[f] nccl-tests results (NVIDIA's "NCCL performance" blog posts, the DGX H100 and DGX A100
    SuperPOD reference architectures, and public cloud benchmark reports): all_reduce_perf bus
    bandwidth at large messages ~480 GB/s within an 8x H100 NVSwitch node with NVLS, ~370-390 GB/s
    across two nodes over 8x 400G with the Ring algorithm; ~230 GB/s within an 8x A100 node,
    ~180-190 GB/s across two nodes over 8x HDR.
[g] NVML API reference (``nvmlClocksEventReasons``): bit values used for ``clock_event_reasons``.
[i] InfiniBand Architecture Specification (IBTA), physical layer: a link keeps its bit error ratio
    at or below 1e-12 (the budget the shipped rule ``ib-symbol-errors`` checks).
[h] NVIDIA GPU thermal guidance for data centre GPUs: slowdown begins near 85-87 C on H100/A100
    (the "GPU Slowdown Temp" of ``nvidia-smi -q -d TEMPERATURE``); dcgm-exporter's usual alert is 85 C.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from agent.report import CLOCK_EVENT_BITS, IBTA_PORT_COUNTERS, MLX5_HW_COUNTERS

# [g] nvmlClocksEventReasons bits, from the report's one table of them.
REASON_GPU_IDLE: Final = CLOCK_EVENT_BITS["gpu_idle"]
REASON_SW_POWER_CAP: Final = CLOCK_EVENT_BITS["sw_power_cap"]
REASON_HW_SLOWDOWN: Final = CLOCK_EVENT_BITS["hw_slowdown"]
REASON_SW_THERMAL: Final = CLOCK_EVENT_BITS["sw_thermal_slowdown"]
REASON_HW_THERMAL: Final = CLOCK_EVENT_BITS["hw_thermal_slowdown"]
REASON_HW_POWER_BRAKE: Final = CLOCK_EVENT_BITS["hw_power_brake_slowdown"]

GB: Final = 1e9
TEMPERATURE_ALERT_C: Final = 85.0  # [h]
IB_BER_BUDGET: Final = 1e-12  # [i]


def symbol_errors_per_s(ber_budgets: float, rate_bytes_per_second: float) -> float:
    """Symbol errors per second at ``ber_budgets`` times the [i] budget on a port of this rate
    (each symbol error counted as one bit error, as the shipped rule counts them)."""
    return ber_budgets * IB_BER_BUDGET * rate_bytes_per_second * 8.0


# An HGX board's GPUs, in NVML index order (the same on HGX H100 and HGX A100 boards).
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
# [d] One ConnectX-7 per GPU, behind the same PCIe switches: the HCAs' PCI bus numbers on a DGX H100,
# in mlx5_0..mlx5_7 order, and their IPoIB interfaces as systemd names them (``ibp<bus>s0``).
HGX_NIC_PCI_BUSES: Final = (0x18, 0x40, 0x4F, 0x5E, 0x9A, 0xC0, 0xCE, 0xDC)
HGX_IPOIB_NETDEVS: Final = tuple(f"ibp{bus}s0" for bus in HGX_NIC_PCI_BUSES)


@dataclass(frozen=True)
class NodeProfile:
    """A healthy node of one kind: fixed properties and the ranges its readings move in."""

    name: str
    model: str
    gpus: int
    memory_bytes: int
    sm_clock_max_hz: float
    sm_clock_idle_hz: float
    memory_clock_hz: float
    power_limit_w: float
    idle_power_w: tuple[float, float]
    load_power_w: tuple[float, float]
    # Temperature = ambient + offset + power / power_limit * gain, lagged (first order).
    temperature_offset_c: float
    temperature_gain_c: float
    hbm_above_gpu_c: tuple[float, float]
    pcie_gen_max: int
    pcie_width_max: int
    nvlinks: int
    nics: int
    nic_rate_bytes_per_second: float
    local_busbw_bytes_per_second: float  # nccl all_reduce_perf, 8 GPUs, large messages
    pair_busbw_bytes_per_second: float  # the same across two nodes
    probe_noise_ratio: float  # one standard deviation of a probe's busbw, relative


H100_SXM_80GB: Final = NodeProfile(
    name="h100-sxm-80gb",
    model="NVIDIA H100 80GB HBM3",
    gpus=8,
    memory_bytes=85_520_809_984,  # [b] 81,559 MiB
    sm_clock_max_hz=1.98e9,  # [b]
    sm_clock_idle_hz=345e6,  # [b]
    memory_clock_hz=2.619e9,  # [b]
    power_limit_w=700.0,  # [a]
    idle_power_w=(62.0, 80.0),  # [e]
    load_power_w=(550.0, 695.0),  # [e]
    temperature_offset_c=8.0,  # with ~25 C inlet: idle ~35 C, full load ~78 C [e]
    temperature_gain_c=45.0,
    hbm_above_gpu_c=(2.0, 6.0),  # [e]
    pcie_gen_max=5,  # [a]
    pcie_width_max=16,
    nvlinks=18,  # [a]
    nics=8,  # [d]
    nic_rate_bytes_per_second=5.0e10,  # [d] 400 Gb/s
    local_busbw_bytes_per_second=480 * GB,  # [f]
    pair_busbw_bytes_per_second=380 * GB,  # [f]
    probe_noise_ratio=0.015,
)

A100_SXM_80GB: Final = NodeProfile(
    name="a100-sxm-80gb",
    model="NVIDIA A100-SXM4-80GB",
    gpus=8,
    memory_bytes=85_899_345_920,  # [c] 81,920 MiB
    sm_clock_max_hz=1.41e9,  # [c]
    sm_clock_idle_hz=210e6,  # [c]
    memory_clock_hz=1.593e9,  # [c]
    power_limit_w=400.0,  # [c]
    idle_power_w=(50.0, 65.0),  # [e]
    load_power_w=(300.0, 395.0),
    temperature_offset_c=8.0,
    temperature_gain_c=45.0,
    hbm_above_gpu_c=(2.0, 6.0),
    pcie_gen_max=4,  # [c] PCIe Gen4 x16
    pcie_width_max=16,
    nvlinks=12,  # [c]
    nics=8,  # [d]
    nic_rate_bytes_per_second=2.5e10,  # [d] 200 Gb/s
    local_busbw_bytes_per_second=230 * GB,  # [f]
    pair_busbw_bytes_per_second=185 * GB,  # [f]
    probe_noise_ratio=0.015,
)

PROFILES: Final[dict[str, NodeProfile]] = {p.name: p for p in (H100_SXM_80GB, A100_SXM_80GB)}


# The counters of an mlx5 InfiniBand port, as subsets of the report's one vocabulary
# (``agent.report``): the generators, the benchmark reports and the sysfs fixture take them from here.


def known_counters(vocabulary: Iterable[str], *names: str) -> tuple[str, ...]:
    """``names``, each checked against the vocabulary at import (a typo fails loudly, never silently)."""
    unknown = sorted(set(names) - set(vocabulary))
    if unknown:
        raise ValueError(f"not in the counter list: {unknown}")
    return names


# An mlx5 port's counters/ directory: the IBTA PortCounters without the 64-bit and port_*cast_* twins
# and port_rcv_discards, which mlx5 does not expose there.
MLX5_PORT_COUNTERS: Final = tuple(
    n
    for n in IBTA_PORT_COUNTERS
    if not n.endswith("_64")
    and not n.startswith(("port_unicast", "port_multicast"))
    and n != "port_rcv_discards"
)
# Of those, the error counters (everything but traffic: data, packets and the transmit wait).
IB_PORT_ERROR_COUNTERS: Final = tuple(
    n for n in MLX5_PORT_COUNTERS if not n.endswith(("_data", "_packets")) and n != "port_xmit_wait"
)
# An mlx5 port's hw_counters/ on a current driver: the vocabulary's list and one driver counter
# beyond it, so the fixture and the benchmark reports carry a name the vocabulary does not know, as
# real nodes do (a rule can still name it as "driver:req_rnr_retries_exceeded").
MLX5_PORT_HW_COUNTERS: Final = (*MLX5_HW_COUNTERS, "req_rnr_retries_exceeded")
# The request counters of hw_counters/, which count by the million on a busy port.
MLX5_REQUEST_COUNTERS: Final = known_counters(
    MLX5_HW_COUNTERS, "rx_atomic_requests", "rx_dct_connect", "rx_read_requests", "rx_write_requests"
)
# What the simulator fills in: an mlx5 port's counters/ and the transport errors of hw_counters/.
IB_PORT_COUNTERS: Final = (
    *MLX5_PORT_COUNTERS,
    *known_counters(MLX5_HW_COUNTERS, "out_of_buffer", "out_of_sequence", "packet_seq_err"),
)
