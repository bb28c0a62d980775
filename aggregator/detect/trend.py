"""Trend: each GPU and NIC port against its own recent past.

Peers cannot see a problem in a pool too small to compare with, or in a pool that is idle. What
every port and GPU can always be compared with is itself a few minutes ago. Two kinds of change:

**Error bursts.** An error counter's rate (NIC symbol errors, receive errors, link error
recoveries; GPU PCIe replays, NVLink CRC/replay/recovery errors, corrected ECC errors) is
compared with its own baseline: the slots of the frame older than ``long_slots``, robustly
(median + ``burst_mads`` scaled MADs, and never less than median + the counter's ``floor``). A
burst is at least ``alert_hits`` of the last ``recent_slots`` slots above that line (alert); a
clear, persistent one is at least ``quarantine_share`` of the last ``long_slots`` slots (of those
with a rate, at least ``min_long_share`` of them) above it
at a median of at least ``quarantine_floors`` floors over the baseline, or the counter's own
level where it has one (quarantine, not hard), for the counters that quarantine at all (NVLink CRC
errors and corrected ECC errors only alert: ``Counter.quarantines``).
The baseline is the port's own recent past, so a rate that has stayed high for longer than the
frame becomes the new normal here: levels are the rules' job, changes are this one's.

**Temperature drift under load.** A GPU's median temperature (and memory temperature) under load
over the last ``drift_slots`` slots against its median under load before them. The pool's median
change is subtracted (the room warms up for everyone; in a one-node pool, the node's GPUs are the
pool), and a GPU whose power under load rose by more than ``drift_power_ratio`` is left out (more
power is more heat, not worse cooling). ``drift_celsius`` or more is an alert. A slot counts as
under load only once the GPU has been busy for ``settle_seconds`` before it: a GPU still heating up
after its job started is not drifting (``aggregator/detect/load.py``).

Both are recomputed from the frame at every run; nothing is kept between runs. So the detector is
an ``OffloadingPoolDetector``: ``prepare_pool`` takes the complete slots' live rows, GPU and NIC,
and each node's NIC names (``PoolFrame.window``, frozen), the judgement runs on that window (in
the service's worker thread), and ``finish`` hands the findings back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Annotated, ClassVar, Final

import numpy as np
import numpy.typing as npt
from msgspec import Meta

from aggregator.config import DetectorSettings, PositiveSeconds, Ratio
from aggregator.detect.base import Offload, OffloadingPoolDetector
from aggregator.detect.load import settled
from aggregator.detect.nanstats import nanmean, nanmedian
from aggregator.detect.peers import MAD_SCALE, complete_slots, median_mad, under_load
from aggregator.fleet.frame import GPU_COLUMN, NIC_COLUMN, FrameWindow, PoolFrame, nic_name
from aggregator.model import Action, Finding

log = logging.getLogger(__name__)

Float = npt.NDArray[np.float64]
Count = Annotated[int, Meta(ge=1)]
NonNegative = Annotated[float, Meta(ge=0)]


@dataclass(frozen=True)
class Counter:
    column: str  # GPU_COLUMN or NIC_COLUMN name of the rate
    label: str
    floor: float  # per second: the smallest excess over the baseline that is a burst
    # A persistent burst quarantines at this many floors over the baseline; None: the config's
    # ``quarantine_floors``.
    quarantine_floors: float | None = None
    # False: a burst of this counter, however long, is an alert. For counters whose quarantine
    # level the hardware's maker publishes, and the rules apply, above anything a baseline says.
    quarantines: bool = True


# The floor everywhere is one error per 10-s report, and a burst must exceed it: these counters
# sit at zero on healthy hardware (a good InfiniBand link sees a handful of symbol errors a day;
# PCIe replays, NVLink CRC errors and corrected ECC errors on a good GPU are as rare), so a stray
# single error is noise, while several per report in most of half a minute is a change of state of
# the link or the chip.
GPU_COUNTERS: Final[tuple[Counter, ...]] = (
    Counter("pcie_replay_per_second", "PCIe replays", 0.1),
    # NVLink CRC errors are retried by the link, and NVIDIA fails a link on them only at 100 a
    # second or more (DCGM's DCGM_LIMIT_MAX_NVLINK_CRC_ERROR: "CRC errors only matter at rates of
    # 100+ per second"; rules/nvlink.yaml quarantines there). A link running at a few a second
    # is worth telling on-call about, not taking the node out for: alert only.
    Counter("nvlink_crc_per_second", "NVLink CRC errors", 0.1, quarantines=False),
    # DCGM fails a GPU on any NVLink replay (DCGM_LIMIT_MAX_NVLINK_ERROR = 1, rules/nvlink.yaml):
    # a replay is a flit the receiver found corrupt and the sender sent again, and a healthy link
    # does not replay. We quarantine on a lasting stream instead of on one: persistence alone
    # decides (no level beyond the line), so more than one replay per report over the GPU's own
    # past in nine tenths of the persistence window. A stray replay stays an alert, and CRC
    # errors that the link absorbs without replaying keep the general level.
    Counter("nvlink_replay_per_second", "NVLink replays", 0.1, quarantine_floors=0.0),
    Counter("nvlink_recovery_per_second", "NVLink recoveries", 0.1),
    # Corrected (single-bit) ECC errors were corrected: the job's data is intact, and the GPU
    # remaps the rows they recur in (NVML's row remapping; rules/gpu.yaml quarantines when a
    # remap fails or an uncorrectable error comes). A burst tells on-call; it is not a reason to
    # take the node out by itself: alert only.
    Counter("ecc_sbe_per_second", "corrected ECC errors", 0.1, quarantines=False),
)
NIC_COUNTERS: Final[tuple[Counter, ...]] = (
    Counter("symbol_error_per_second", "symbol errors", 0.1),
    Counter("port_rcv_errors_per_second", "receive errors", 0.1),
    Counter("link_error_recovery_per_second", "link error recoveries", 0.1),
)
DRIFT_COLUMNS: Final[tuple[tuple[str, str, str], ...]] = (
    ("temperature_celsius", "temperature", "temperature"),
    ("memory_temperature_celsius", "memory-temperature", "memory temperature"),
)


class TrendConfig(DetectorSettings, frozen=True):
    """``detectors.trend``."""

    name: ClassVar[str] = "trend"
    every_seconds: PositiveSeconds = 30.0
    recent_slots: Count = 3  # the burst window: 30 s at 10-s reports
    alert_hits: Count = 2  # slots of the burst window above the baseline line
    long_slots: Count = 18  # the persistence window (3 min); the baseline is what is older
    min_baseline_slots: Count = 6  # a port needs a minute of its own past to be judged
    # Devices (on at least this many nodes) with a baseline of their own for the pool's typical
    # device to stand in for a device whose own past is already high (as for the peer detector).
    min_peer_devices: Count = 8
    min_peer_nodes: Count = 3
    burst_mads: NonNegative = 6.0
    quarantine_share: Ratio = 0.9  # of the persistence window's slots that have a rate
    min_long_share: Ratio = 2 / 3  # slots of the persistence window that must have a rate
    quarantine_floors: NonNegative = 10.0
    load_threshold: Ratio = 0.5
    drift_slots: Count = 12  # the drift window: 2 min
    min_drift_samples: Count = 6  # loaded slots in each of the two windows
    # At constant load a GPU's temperature over inlet is power times thermal resistance; healthy
    # ones hold within a couple of degrees from minute to minute. 10 C more at the same power, with
    # the room's change removed, is about a quarter more thermal resistance: a fan, the heat sink,
    # the paste. Not yet a throttle (rules and peers see that), so an alert.
    drift_celsius: NonNegative = 10.0
    drift_power_ratio: NonNegative = 1.1
    # A slot counts as loaded for the drift check only once the GPU was busy for this long before
    # it (aggregator/detect/load.py): a GPU still heating up after its job started is not a drift.
    settle_seconds: NonNegative = 180.0

    def __post_init__(self) -> None:
        if not (0 < self.alert_hits <= self.recent_slots <= self.long_slots and self.drift_slots > 0):
            raise ValueError(f"trend detector needs 0 < alert_hits <= recent_slots <= long_slots; got {self}")


@dataclass(frozen=True)
class _Burst:
    hit: npt.NDArray[np.bool_]
    quarantine: npt.NDArray[np.bool_]
    recent: Float  # mean rate over the burst window
    baseline: Float
    line: Float
    from_pool: npt.NDArray[np.bool_]  # the baseline is the pool's typical device, not its own past


def _handback(out: dict[str, list[Finding]]) -> dict[str, list[Finding]]:
    """``finish``: nothing is kept between runs, so there is nothing to apply here."""
    return out


class TrendDetector(OffloadingPoolDetector):
    """Error-counter bursts and temperature drift, each against the same GPU's or port's past.

    Its settings are frozen and set once, so a run's compute may read them from a worker thread.
    """

    def __init__(self, config: TrendConfig | None = None) -> None:
        self.config = config if config is not None else TrendConfig()
        self.every_seconds = self.config.every_seconds

    def prepare_pool(self, frame: PoolFrame, now: float) -> Offload[dict[str, list[Finding]]]:
        """The pool's complete slots (GPU and NIC) copied out of the frame; judged on the copy."""
        window = frame.window(*complete_slots(frame, now), nic=True)
        return Offload(compute=lambda: self.judge(window, now), finish=_handback)

    def judge(self, window: FrameWindow, now: float) -> dict[str, list[Finding]]:
        """Findings for every node of a pool's copied window. Reads nothing but ``window``, ``now``
        and the frozen settings: any thread."""
        nodes, gpu, nic = list(window.nodes), window.gpu, window.nic
        out: dict[str, list[Finding]] = {n: [] for n in nodes}
        if not nodes or gpu.shape[0] == 0:
            return out
        seconds = self.config.recent_slots * window.interval_s
        for counter in GPU_COUNTERS:
            b = self._burst(
                gpu[..., GPU_COLUMN[counter.column]].astype(np.float64), counter, pool_baseline=True
            )
            if b is None:
                continue
            for n, g in zip(*np.nonzero(b.hit), strict=True):
                out[nodes[int(n)]].append(
                    self._burst_finding(
                        counter=counter,
                        where=f"gpu{int(g)}",
                        label=f"GPU {int(g)}",
                        b=b,
                        cell=(n, g),
                        seconds=seconds,
                        now=now,
                    )
                )
        if nic.shape[0] > 0:
            for counter in NIC_COUNTERS:
                # NIC ports keep their own past: their levels are judged against the link's bit
                # error budget by the sequential rule (rules/infiniband.yaml), and a port that
                # runs steadily within it is healthy however its neighbours run.
                b = self._burst(
                    nic[..., NIC_COLUMN[counter.column]].astype(np.float64), counter, pool_baseline=False
                )
                if b is None:
                    continue
                for n, p in zip(*np.nonzero(b.hit), strict=True):
                    node = nodes[int(n)]
                    keys = window.nic_keys[int(n)]
                    if int(p) >= len(keys):
                        continue  # a column left over from a node that held the row before
                    port = nic_name(keys[int(p)])
                    out[node].append(
                        self._burst_finding(
                            counter=counter,
                            where=port,
                            label=port,
                            b=b,
                            cell=(n, p),
                            seconds=seconds,
                            now=now,
                        )
                    )
        self._drift(gpu, nodes, now, window.interval_s, out)
        return out

    def _burst(self, rate: Float, counter: Counter, *, pool_baseline: bool) -> _Burst | None:
        """Burst masks over ``rate`` ``(slots, nodes, devices)``; None when no baseline exists.
        ``pool_baseline``: a device whose own past is above its pool's typical device is judged
        against that device instead."""
        c = self.config
        floor = counter.floor
        floors = c.quarantine_floors if counter.quarantine_floors is None else counter.quarantine_floors
        slots = rate.shape[0]
        if slots - c.long_slots < c.min_baseline_slots:
            return None
        base = rate[: slots - c.long_slots]
        enough = (~np.isnan(base)).sum(axis=0) >= c.min_baseline_slots
        median, mad = median_mad(base, axis=0)
        # No clean history needed: a device whose own past is already above what its pool's
        # devices typically run at (a link that replays from the first report, a port that came
        # up bad) is judged against that typical device instead: its level and its noise.
        peers = enough & ~np.isnan(median)
        from_pool = np.zeros(median.shape, np.bool_)
        if (
            pool_baseline
            and int(peers.sum()) >= c.min_peer_devices
            and int(peers.any(axis=-1).sum()) >= c.min_peer_nodes
        ):
            pool_median = float(np.median(median[peers]))
            pool_mad = float(np.median(mad[peers]))
            from_pool = peers & (median > pool_median)
            median = np.where(from_pool, pool_median, median)
            mad = np.where(from_pool, pool_mad, mad)
        line = median + np.maximum(c.burst_mads * MAD_SCALE * mad, floor)
        # NaN compares False: a missing rate is no evidence. The frame holds float32, whose 0.1 is
        # a hair above float64's: the tolerance keeps "exactly the floor" at the floor.
        above = rate > line[None] * (1 + 1e-6)
        recent_hits = above[-c.recent_slots :].sum(axis=0)
        long_hits = above[-c.long_slots :].sum(axis=0)
        # The share counts the slots with a rate: a lost report is no evidence either way, and at
        # 1 % loss a 3-minute window misses one report a sixth of the time.
        long_seen = (~np.isnan(rate[-c.long_slots :])).sum(axis=0)
        long_median = nanmedian(rate[-c.long_slots :], axis=0)
        hit = enough & (recent_hits >= c.alert_hits)
        quarantine = (
            hit
            & counter.quarantines
            & (long_seen >= c.min_long_share * c.long_slots)
            & (long_hits >= c.quarantine_share * long_seen)
            & (long_median >= median + floors * floor * (1 - 1e-6))
        )
        if not hit.any():
            return _Burst(hit, quarantine, median, median, line, from_pool)
        recent = nanmean(rate[-c.recent_slots :], axis=0)
        return _Burst(hit, quarantine, recent, median, line, from_pool)

    def _burst_finding(
        self,
        *,
        counter: Counter,
        where: str,
        label: str,
        b: _Burst,
        cell: tuple[np.intp, np.intp],
        seconds: float,
        now: float,
    ) -> Finding:
        quarantine = bool(b.quarantine[cell])
        action: Action = "quarantine" if quarantine else "alert"
        recent, baseline = float(b.recent[cell]), float(b.baseline[cell])
        pooled = bool(b.from_pool[cell])
        window = self.config.long_slots if quarantine else self.config.recent_slots
        return Finding(
            detector=TrendConfig.name,
            key=f"trend-{counter.column.removesuffix('_per_second').replace('_', '-')}:{where}",
            severity="critical" if quarantine else "warning",
            action=action,
            summary=(
                f"{label} {counter.label} {recent:.2f}/s over the last {seconds:.0f} s, "
                + (
                    f"its pool's devices {baseline:.2f}/s (its own past was already high)"
                    if pooled
                    else f"its own baseline {baseline:.2f}/s"
                )
                + (
                    f", above it for {window * seconds / self.config.recent_slots:.0f} s"
                    if quarantine
                    else ""
                )
            ),
            since=now - seconds,
            evidence={
                "where": where,
                "counter": counter.column,
                "rate_per_second": round(recent, 4),
                "baseline_per_second": round(baseline, 4),
                "baseline_from": "pool" if pooled else "own",
                "line_per_second": round(float(b.line[cell]), 4),
                "window_seconds": seconds,
            },
        )

    def _drift(
        self,
        gpu: npt.NDArray[np.float32],
        nodes: list[str],
        now: float,
        interval: float,
        out: dict[str, list[Finding]],
    ) -> None:
        c = self.config
        slots = gpu.shape[0]
        if slots - c.drift_slots < c.min_drift_samples:
            return
        busy = under_load(gpu, c.load_threshold)
        loaded = settled(busy, max(0, round(c.settle_seconds / interval)))
        power = np.where(loaded, gpu[..., GPU_COLUMN["power_watts"]].astype(np.float64), np.nan)
        split = slots - c.drift_slots
        power_before = nanmedian(power[:split], axis=0)
        power_after = nanmedian(power[split:], axis=0)
        # Unknown power cannot vouch for more heat: such a GPU stays in.
        more_power = power_after > c.drift_power_ratio * power_before
        for column, key, label in DRIFT_COLUMNS:
            temp = np.where(loaded, gpu[..., GPU_COLUMN[column]].astype(np.float64), np.nan)
            before, after = temp[:split], temp[split:]
            ok = ((~np.isnan(before)).sum(axis=0) >= c.min_drift_samples) & (
                (~np.isnan(after)).sum(axis=0) >= c.min_drift_samples
            )
            if not ok.any():
                continue
            delta = nanmedian(after, axis=0) - nanmedian(before, axis=0)
            room = float(np.median(delta[ok]))
            excess = delta - room
            hit = ok & ~more_power & (excess >= c.drift_celsius)
            t_before, t_after = nanmedian(before, axis=0), nanmedian(after, axis=0)
            for n, g in zip(*np.nonzero(hit), strict=True):
                gi = int(g)
                out[nodes[int(n)]].append(
                    Finding(
                        detector=TrendConfig.name,
                        key=f"trend-{key}:gpu{gi}",
                        severity="warning",
                        action="alert",
                        summary=(
                            f"GPU {gi} {label} under load {t_after[n, g]:.0f} C over the last "
                            f"{c.drift_slots * interval:.0f} s, {t_before[n, g]:.0f} C before: "
                            f"{excess[n, g]:+.0f} C beyond its pool's change ({room:+.1f} C)"
                        ),
                        since=now - c.drift_slots * interval,
                        evidence={
                            "gpu": gi,
                            "feature": key,
                            "before_celsius": round(float(t_before[n, g]), 1),
                            "after_celsius": round(float(t_after[n, g]), 1),
                            "excess_celsius": round(float(excess[n, g]), 1),
                            "pool_change_celsius": round(room, 2),
                        },
                    )
                )
