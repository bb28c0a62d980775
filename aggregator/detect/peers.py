"""Peers: a GPU compared with every loaded GPU of its pool at the same moments.

A fail-slow GPU (a bad fan, dried thermal paste, a power stage that brakes, a chip that can no
longer hold its clock) passes every fixed threshold: it is 12 % slow, not broken. Its pool shows
it: GPUs of one model, running comparable work in the same room, at the same moment. Comparing
only within one slot matters: the whole room warms up and cools down together, and a GPU measured
against its pool of ten minutes ago would inherit that drift.

Per pool, per slot of the frame (the slot still filling is left out), per feature below:

1. only GPUs under load (utilization >= ``load_threshold``) count, and the slot is scored only with
   at least ``min_gpus`` loaded GPUs on at least ``min_nodes`` nodes (fewer is no pool to speak
   of; the trend detector watches small pools against their own past);
2. the pool's median ``m`` and scaled MAD ``1.4826 * MAD`` across all loaded GPUs of all nodes;
   the scale is floored by the feature's ``floor`` (a physical noise level), so that a perfectly
   uniform pool does not turn a deviation nobody would care about into many MADs;
3. each GPU's robust z-score, signed so that "worse" (slower, hotter, throttled) is positive;
4. a one-sided CUSUM per (node, GPU, feature) over the slots (``aggregator.detect.cusum``) with
   the feature's allowance ``k``: a finding needs accumulated excess ``h_alert`` (alert) or
   ``h_quarantine`` with a mean z of at least ``z_quarantine`` over the run (quarantine, not hard:
   the health machine still wants it to persist). A deviation that stopped (``calm_slots`` scored
   slots in a row within the allowance) is no longer reported.

All of it is numpy over the whole pool; Python loops run over pools, features and slots only.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Annotated, ClassVar, Final, Literal

import numpy as np
import numpy.typing as npt
from msgspec import Meta

from aggregator.config import DetectorSettings, PositiveSeconds, Ratio
from aggregator.detect.base import PoolDetector
from aggregator.detect.cusum import cusum
from aggregator.fleet.frame import GPU_COLUMN, SLOWDOWN_COLUMNS, PoolFrame
from aggregator.model import Action, Finding

log = logging.getLogger(__name__)

Float = npt.NDArray[np.float64]
MAD_SCALE: Final = 1.4826  # MAD of a normal distribution times this is its standard deviation


@dataclass(frozen=True)
class PeerFeature:
    """One load-normalized quantity compared across the pool."""

    key: str  # in finding keys: "peer-sm-clock:gpu5"
    label: str  # in summaries: "SM clock"
    columns: tuple[str, ...]  # GPU_COLUMN names; several: the largest (any slowdown bit set)
    worse: Literal["low", "high"]
    floor: float  # lower bound of the robust scale, in the feature's unit
    allowance: float  # CUSUM k, in robust z (MADs)
    z_quarantine: float  # mean z over the run needed for quarantine rather than alert
    unit: str  # how a value is printed after the number
    digits: int  # decimals printed
    # "node": the value over the median of the node's own loaded GPUs in that slot first, for a
    # quantity the work sets (every GPU of a node runs the same job; the pool runs many jobs).
    relative_to: Literal["pool", "node"] = "pool"


# Floors are the smallest deviation that means something physically, so that a pool whose GPUs
# agree closely does not make instrument noise look like many MADs; allowances are how many robust
# sigmas a healthy GPU may sit away from its pool for good (position in the chassis, silicon
# lottery) without ever accumulating evidence.
FEATURES: Final[tuple[PeerFeature, ...]] = (
    # NVML reports clocks in steps of ~15 MHz (0.75 % of a 1,980 MHz max) and healthy parts of one
    # model under the same power cap hold their boost clock within a few percent of each other:
    # 2 % of max is the smallest difference worth a MAD; k = 2 leaves a healthy GPU 4 % of slack.
    PeerFeature("sm-clock", "SM clock", ("sm_clock_ratio",), "low", 0.02, 2.0, 4.0, "of max", 2),
    # A sensor reads to 1 C. Loaded GPUs of a pool differ by several degrees for good: the
    # node's inlet air, the GPU's position in the chassis airflow, its heat sink's contact. These
    # offsets add up to a distribution with a heavy hot tail, where the hottest healthy GPU of a
    # few hundred sits near 4 MADs, steadily. So k = 4: only heat beyond that tail accumulates; a
    # GPU 20 C over its pool (a throttling one at 85 C) is 6-7 MADs and still found in minutes.
    PeerFeature("temperature", "temperature", ("temperature_celsius",), "high", 2.0, 4.0, 6.0, "C", 0),
    PeerFeature(
        "memory-temperature",
        "memory temperature",
        ("memory_temperature_celsius",),
        "high",
        2.0,
        4.0,
        6.0,
        "C",
        0,
    ),
    # Power under load is set by the work as much as by the GPU: a light job draws 400 W where a
    # heavy one draws 650 W on the same healthy H100s, so a small job in a pool of big ones would
    # look braked. The GPUs of one node run one job, so power is compared as a share of the
    # node's own median first: a GPU held back (braked, throttled, capped) draws less than its
    # node-mates, a light job draws less on all of them. Step-phase swings are a few % of that
    # share: 4 % floor, k = 3.
    PeerFeature("power", "power", ("power_watts",), "low", 0.04, 3.0, 5.0, "of its node's median", 2, "node"),
    # The PCIe generation a loaded GPU runs at, over the GPU's own maximum. GPUs lower it at idle
    # on purpose (power management), never under load; a GPU behind a Gen4-only slot shows it
    # on every node of its platform, which the pool median absorbs. A link that trained one
    # generation low under load (0.8 of a Gen5 maximum, 0.75 of Gen4) halves its host-device
    # bandwidth: floor 0.05 makes that 4-5 MADs, k = 1 lets a one-slot lag after a job starts
    # (the link retrains as the load arrives) drain away.
    PeerFeature("pcie-gen", "PCIe generation", ("pcie_link_gen_ratio",), "low", 0.05, 1.0, 3.0, "of max", 2),
    # Hardware slowdown, HW thermal, power brake and SW thermal (SLOWDOWN_COLUMNS, the reasons
    # agent/report.py marks as slowdowns) are never part of healthy work:
    # a 0/1 per slot whose pool median is 0. Floor 0.25 makes one throttled slot 4 MADs, k = 1
    # drains one per calm slot, so the statistic climbs when the GPU is throttled more than a
    # quarter of the time; z_quarantine = 2 is throttled at least half the time during the run.
    PeerFeature(
        "slowdown",
        "slowdown share",
        SLOWDOWN_COLUMNS,
        "high",
        0.25,
        1.0,
        2.0,
        "of the time",
        2,
    ),
)


class PeerConfig(DetectorSettings, frozen=True):
    """``detectors.peer``."""

    name: ClassVar[str] = "peer"
    every_seconds: PositiveSeconds = 30.0
    load_threshold: Ratio = 0.5  # utilization ratio at which a GPU counts as under load
    min_gpus: Annotated[int, Meta(ge=2)] = 8  # loaded GPUs in a slot for it to be scored
    min_nodes: Annotated[int, Meta(ge=1)] = 3  # ... on at least this many nodes
    min_node_gpus: Annotated[int, Meta(ge=1)] = 4  # loaded GPUs on a node for a node-relative feature
    # Accumulated excess in MADs. 30 is 10 slots of a 5-MAD deviation with k = 2 (100 s), 7.5 of
    # a 6-MAD one; a 60-slot healthy frame stays far below it (see docs/detection.md).
    h_alert: Annotated[float, Meta(gt=0)] = 30.0
    h_quarantine: Annotated[float, Meta(gt=0)] = 60.0
    calm_slots: Annotated[int, Meta(ge=1)] = 3  # scored slots in a row within the allowance: stopped

    def __post_init__(self) -> None:
        if not (0 < self.h_alert <= self.h_quarantine and self.min_gpus >= 2 and self.min_nodes >= 1):
            raise ValueError(f"peer detector needs 0 < h_alert <= h_quarantine and min peers; got {self}")


def nanmedian(a: npt.NDArray[np.floating], axis: int) -> Float:
    """Median along ``axis`` ignoring NaN (NaN where all are NaN), without ``np.nanmedian``'s warnings.

    NaN sorts last, so after one sort the valid values of every lane lead and the median is the
    mean of the two middle ones; ``np.nanmedian`` goes through masked arrays and is ~10x slower at
    the sizes of a pool's slot.
    """
    moved = np.sort(np.moveaxis(np.asarray(a, np.float64), axis, -1), axis=-1)
    count = (~np.isnan(moved)).sum(axis=-1)
    lo = np.maximum((count - 1) // 2, 0)[..., None]
    hi = np.maximum(count // 2, 0)[..., None]
    if moved.shape[-1] == 0:
        return np.full(moved.shape[:-1], np.nan)
    mid = (np.take_along_axis(moved, lo, -1) + np.take_along_axis(moved, hi, -1))[..., 0] / 2
    out: Float = np.where(count > 0, mid, np.nan)
    return out


def median_mad(a: Float, axis: int) -> tuple[Float, Float]:
    """The NaN-ignoring median along ``axis`` and the median absolute deviation from it (unscaled:
    times ``MAD_SCALE`` it estimates a normal's standard deviation)."""
    median = nanmedian(a, axis=axis)
    return median, nanmedian(np.abs(a - np.expand_dims(median, axis)), axis=axis)


def under_load(gpu: npt.NDArray[np.float32], load_threshold: float) -> npt.NDArray[np.bool_]:
    """Where a frame's GPU values (``(..., GPU_FIELDS)``) show the GPU under load: utilization at
    least ``load_threshold``. NaN compares False: not reported is not loaded."""
    util = gpu[..., GPU_COLUMN["utilization_ratio"]].astype(np.float64)
    loaded: npt.NDArray[np.bool_] = util >= load_threshold
    return loaded


def complete_slots(frame: PoolFrame, now: float) -> tuple[float, float]:
    """The ``(t0, t1)`` range for ``frame.snapshot`` of the frame's complete slots before ``now``.

    The slot ``now`` falls in is still filling: a partial slot has fewer peers and a skewed median,
    so only complete slots are compared.
    """
    return now - frame.slots * frame.interval_s, now - frame.interval_s


def _node_relative(x: Float, min_gpus: int) -> Float:
    """Each GPU's value over the median of its node's loaded GPUs in the slot; NaN on nodes with
    fewer than ``min_gpus`` of them (too few node-mates to say which one is off)."""
    node_median = nanmedian(x, axis=2)
    enough = (~np.isnan(x)).sum(axis=2) >= min_gpus
    node_median = np.where(enough & (node_median > 0), node_median, np.nan)
    out: Float = x / node_median[..., None]
    return out


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


class PeerDetector(PoolDetector):
    """Per pool robust z-scores per slot, accumulated per GPU and feature by a one-sided CUSUM."""

    def __init__(self, config: PeerConfig | None = None) -> None:
        self.config = config if config is not None else PeerConfig()
        self.every_seconds = self.config.every_seconds
        self.features = tuple(f for f in FEATURES if all(col in GPU_COLUMN for col in f.columns))

    def run_pool(self, frame: PoolFrame, now: float) -> dict[str, list[Finding]]:
        """Findings for every node of one pool's frame (empty lists where nothing deviates)."""
        t0, t1 = complete_slots(frame, now)
        nodes, gpu = frame.snapshot(t0, t1)
        starts = frame.slot_starts(t0, t1)
        out: dict[str, list[Finding]] = {n: [] for n in nodes}
        if gpu.shape[0] == 0 or not nodes:
            return out
        c = self.config
        loaded = under_load(gpu, c.load_threshold)
        for feature in self.features:
            cols = [GPU_COLUMN[col] for col in feature.columns]
            raw = gpu[..., cols].astype(np.float64)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                value: Float = np.nanmax(raw, axis=-1) if len(cols) > 1 else raw[..., 0]
            x = np.where(loaded, value, np.nan)  # (slots, nodes, gpus)
            if feature.relative_to == "node":
                x = _node_relative(x, c.min_node_gpus)
            self._feature(feature=feature, frame=frame, nodes=nodes, starts=starts, x=x, now=now, out=out)
        return out

    def _feature(
        self,
        *,
        feature: PeerFeature,
        frame: PoolFrame,
        nodes: list[str],
        starts: npt.NDArray[np.float64],
        x: Float,
        now: float,
        out: dict[str, list[Finding]],
    ) -> None:
        c = self.config
        slots = x.shape[0]
        has = ~np.isnan(x)
        peers = has.sum(axis=(1, 2))
        peer_nodes = has.any(axis=2).sum(axis=1)
        enough = (peers >= c.min_gpus) & (peer_nodes >= c.min_nodes)
        if not enough.any():
            return
        flat = x.reshape(slots, -1)
        median, mad = median_mad(flat, axis=1)
        scale = np.maximum(MAD_SCALE * mad, feature.floor)
        sign = -1.0 if feature.worse == "low" else 1.0
        z = sign * (x - median[:, None, None]) / scale[:, None, None]
        z[~enough] = np.nan
        result = cusum(z, feature.allowance)
        s = result.statistic
        hit = (s >= c.h_alert) & (result.calm < c.calm_slots)
        if not hit.any():
            return
        idx = np.arange(slots)[:, None, None]
        in_run = (idx >= result.run_start[None]) & (result.run_start[None] >= 0) & ~np.isnan(z)
        runs = np.maximum(in_run.sum(axis=0), 1)
        mean_z = np.where(in_run, z, 0.0).sum(axis=0) / runs
        mean_x = np.where(in_run, x, 0.0).sum(axis=0) / runs
        mean_median = (
            np.where(in_run, np.broadcast_to(median[:, None, None], x.shape), 0.0).sum(axis=0) / runs
        )
        for n, g in zip(*np.nonzero(hit), strict=True):
            node = nodes[int(n)]
            gi = int(g)
            quarantine = bool(s[n, g] >= c.h_quarantine and mean_z[n, g] >= feature.z_quarantine)
            action: Action = "quarantine" if quarantine else "alert"
            since = float(starts[int(result.run_start[n, g])])
            lasted = now - since
            v, m, zz = float(mean_x[n, g]), float(mean_median[n, g]), float(mean_z[n, g])
            direction = "low" if feature.worse == "low" else "high"
            summary = (
                f"GPU {gi} {feature.label} {v:.{feature.digits}f} {feature.unit} under load, "
                f"pool median {m:.{feature.digits}f}, {zz:.1f} MADs {direction} for {_minutes(lasted)}"
            )
            out[node].append(
                Finding(
                    detector=PeerConfig.name,
                    key=f"peer-{feature.key}:gpu{gi}",
                    severity="critical" if quarantine else "warning",
                    action=action,
                    summary=summary,
                    since=since,
                    evidence={
                        "gpu": gi,
                        "feature": feature.key,
                        "value": round(v, 4),
                        "pool_median": round(m, 4),
                        "mads": round(zz, 2),
                        "direction": direction,
                        "cusum": round(float(s[n, g]), 1),
                        "threshold": c.h_quarantine if quarantine else c.h_alert,
                        "seconds": round(lasted, 1),
                        "slots": int(runs[n, g]),
                        "pool": frame.name,
                        "peers": int(peers[-1]),
                        "peer_nodes": int(peer_nodes[-1]),
                    },
                )
            )
            log.info(
                "peer deviation",
                extra={"node": node, "gpu": gi, "feature": feature.key, "action": action, "mads": zz},
            )
