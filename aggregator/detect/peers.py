"""Peers: a GPU compared with its node-mates and with its pool at the same moments.

A fail-slow GPU (a bad fan, dried thermal paste, a power stage that brakes, a chip that can no
longer hold its clock) passes every fixed threshold: it is 12 % slow, not broken. Its peers show
it: GPUs of one model, running comparable work in the same room, at the same moment. Comparing
only within one slot matters: the whole room warms up and cools down together, and a GPU measured
against its pool of ten minutes ago would inherit that drift. Comparing within the node matters
for what the work sets (clock, power): the 8 GPUs of a node usually run one job, the pool runs
many, and a heavy job that holds every GPU of its node at the power limit lowers their clocks
together.

Per pool, per slot of the frame (the slot still filling is left out), per feature below:

1. only GPUs under load (utilization >= ``load_threshold``) count, and the slot is scored only with
   at least ``min_gpus`` loaded GPUs on at least ``min_nodes`` nodes (fewer is no pool to speak
   of; the trend detector watches small pools against their own past); for the clock and power,
   not where the admin set the clocks (NVML's applications-clocks reason, ``app_clocks_explain``);
2. a node-relative feature first divides each GPU's value by the median of its node's loaded GPUs
   in that slot (nodes with fewer than ``min_node_gpus`` loaded are not scored for it);
3. the pool's median ``m`` and scaled MAD across all scored GPUs of the slot; the slot's MAD is
   shrunk toward the median MAD of the frame's scored slots, the frame's estimate counting as
   ``prior_gpus`` GPUs (``shrunk_scale``), and never below the feature's measurement step; for the
   node-relative clock and power, per regime (held at the power limit or not) where each regime
   has enough peers of its own;
4. each GPU's robust z-score, signed so that "worse" (slower, hotter, throttled) is positive, and
   clipped at ``k + max_excess``: one slot adds at most ``max_excess`` to the evidence; for power,
   at most 0 in a slot where the GPU is not held back (``held_back``: no slowdown reason, its clock
   not under its node-mates'): low power alone is less work (another pod, a pipeline stage);
5. a one-sided CUSUM per (node, GPU, feature) over the slots (``aggregator.detect.cusum``) with
   the feature's allowance ``k``; the thresholds follow from ``k`` and the wanted in-control average
   run lengths, and are at least a few slots of the largest excess (``thresholds``): ``h_alert``
   makes an alert, ``h_quarantine`` quarantine evidence, decided (``Finding.decided``: the
   health machine adds no persistence to a crossing; an escalated alert below persists). A
   deviation that stopped (the mean of its last ``calm_slots`` scored slots within the
   allowance) is no longer reported;
6. escalation by persistence: an alert whose run has lasted ``escalate_after_seconds`` with the
   statistic still over ``h_alert`` becomes quarantine evidence unless an explanation is named
   (the GPU is held by its power limit while its peers are not, or by a lower power limit, or, for
   a pool-relative feature, the node changed jobs during the run); the explanation, when there is
   one, is in the finding's evidence and summary, and a clock or power deviation its power limit
   explains stays an alert, as does a temperature deviation without NVML's thermal slowdown reason
   (hot, not yet slow: ``needs_thermal_slowdown``).

All of it is numpy over the whole pool; Python loops run over pools, features, slots and findings.
The detector keeps no state between runs: the CUSUM is recomputed from the frame, so a GPU bad
from its first report is found by its peers without any clean history, and the escalation's
"how long" is the run's start slot against ``now``, both read from the frame. That makes it an
``OffloadingPoolDetector`` with almost nothing to do on the caller's thread: ``prepare_pool`` takes
the complete slots' live rows (``PoolFrame.window``: frozen, and copied only as the worker reads
them), the whole judgement runs on that window (``compute``: in the service's worker thread), and
``finish`` hands the findings back.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Annotated, ClassVar, Final, Literal

import numpy as np
import numpy.typing as npt
from msgspec import Meta

from aggregator.config import DetectorSettings, PositiveSeconds, Ratio
from aggregator.detect.base import Offload, OffloadingPoolDetector
from aggregator.detect.cusum import average_run_length, cusum, threshold_for_arl
from aggregator.detect.nanstats import nanmean, nanmedian
from aggregator.fleet.frame import GPU_COLUMN, SLOWDOWN_COLUMNS, FrameWindow, PoolFrame
from aggregator.model import Action, Finding

log = logging.getLogger(__name__)

Float = npt.NDArray[np.float64]
MAD_SCALE: Final = 1.4826  # MAD of a normal distribution times this is its standard deviation


@dataclass(frozen=True)
class PeerFeature:
    """One load-normalized quantity compared across the pool (or within the node first)."""

    key: str  # in finding keys: "peer-sm-clock:gpu5"
    label: str  # in summaries: "SM clock"
    columns: tuple[str, ...]  # GPU_COLUMN names; several: the largest (any slowdown bit set)
    worse: Literal["low", "high"]
    floor: float  # lower bound of the robust scale: the measurement's step, in the feature's unit
    allowance: float  # CUSUM k, in robust z (scaled MADs)
    unit: str  # how a value is printed after the number
    digits: int  # decimals printed
    # "node": the value over the median of the node's own loaded GPUs in that slot first, for a
    # quantity the work sets (every GPU of a node runs the same job; the pool runs many jobs).
    relative_to: Literal["pool", "node"] = "pool"
    # Whether the GPU's power limit can explain the deviation: a GPU held at its power limit
    # (NVML's SW power cap reason) or set to a lower limit than its peers clocks lower and draws
    # less by design; such a finding names that and stays an alert.
    power_limit_explains: bool = False
    # Score only slots where the GPU is not held at its power limit (NVML's SW power cap reason):
    # there the clock is what the job's power allows, set by the work, not by the GPU.
    uncapped_only: bool = False
    # Median and scale per regime (held at the power limit or not) where each has enough peers.
    by_regime: bool = False
    # A GPU_COLUMN the value is judged at: the value less what the pool's GPUs run at at the GPU's
    # own value of it (a robust line over the frame, ``power_fit``), for a quantity the work sets
    # through that column (temperature through power: steady die temperature ~ inlet air + thermal
    # resistance x power).
    given: str | None = None
    # Leave out the slots where the clocks are set by policy: NVML's applications-clocks reason (0x2,
    # nvmlClocksEventReasonApplicationsClocksSetting, alias ...UserDefinedClocks: ``nvidia-smi -ac``
    # or ``-lgc``). An admin's setting holds the clock (and so the power) where it was put: not a fault
    # and nothing the GPU's peers say anything about, like the SW power cap (APP_CLOCKS_COLUMN).
    app_clocks_explain: bool = False
    # A deviation that is only a symptom of less work: the slot's score counts as evidence only where
    # the GPU is held back in that slot (``held_back``: a slowdown reason, or its SM clock below its
    # node-mates'); elsewhere at most 0, so the statistic drains. A GPU at its node-mates' clock with
    # no clock event reason is doing what its job asks of it (NVML clock event reasons: every cause
    # that holds a GPU below its target clock but the job's own demand sets one of them).
    held_back_only: bool = False
    # Quarantine only with the hardware's own word that the deviation costs speed: NVML's SW or HW
    # thermal slowdown reason (THERMAL_COLUMNS) in at least THERMAL_SHARE of the run's loaded slots.
    # Without it the finding stays an alert, with the explanation named (``_no_thermal_slowdown``).
    needs_thermal_slowdown: bool = False


# Allowances are how many robust sigmas a healthy GPU may sit away from its peers *for good*
# (position in the chassis, silicon lottery, the job's mix) without ever accumulating evidence: a
# persistent offset below k never adds up, however long it lasts, while the thresholds (from the
# ARL targets) only guard against independent noise. Floors are the measurement's own step, so that
# a pool whose GPUs read identical values does not turn one step into many MADs.
# NVML reports SM clocks in the steps of the part's clock table, 15 MHz on H100/H200
# (``nvidia-smi -q -d SUPPORTED_CLOCKS``): 15 / 1,980 MHz = 0.0076 of max, the same share of a node
# median within a few per cent.
CLOCK_STEP: Final = 15e6 / 1980e6
# Held back (``held_back``): an SM clock this many steps under its node-mates' median. With no clock
# event reason NVML's clocks are "as high as possible" (nvmlClocksEventReasonNone), the same step
# on every GPU of a model; held at the power limit, each GPU's clock is what its own efficiency
# allows, a step or two (1-2 %) apart, and a node median between two steps adds half a step. Three
# steps (45 MHz, 2.3 %) under the median is a clock lower than the silicon and the reading explain.
HELD_BACK_STEPS: Final = 3.0
# The frame column of NVML's applications-clocks reason (0x2, CLOCK_EVENT_REASONS
# "applications_clocks_setting" in agent/report.py): clocks set by the admin (``nvidia-smi -ac`` /
# ``-lgc``).
APP_CLOCKS_COLUMN: Final = "app_clocks"
# NVML's SW and HW thermal slowdown reasons (0x20, 0x40): the GPU reached its slowdown temperature
# and the clocks are lowered to stay under its maximum operating temperature.
THERMAL_COLUMNS: Final = ("sw_thermal", "hw_thermal")
# A temperature finding is quarantine evidence when the GPU was thermally slowed in at least this
# share of the run's loaded slots: a tenth is three slots of a 30-slot run, more than a stray report.
THERMAL_SHARE: Final = 0.1
# A healthy GPU's persistent offset from its peers, in robust sigmas, that no fleet should show: a
# normal's tail beyond 4.5 sigma holds 3.4e-6 of it, 0.3 GPUs of a 100,000-GPU fleet (the worst case,
# every bit of the spread persistent). The allowance of the comparisons whose spread is mostly that.
FLEET_TAIL: Final = 4.5
FEATURES: Final[tuple[PeerFeature, ...]] = (
    # The GPU against its node-mates (one job). Their healthy spread is the silicon and the
    # position in the chassis: offsets that persist, so k must sit beyond the fleet's tail of them
    # (FLEET_TAIL). A GPU 10 % below node-mates spread by 1.5 % is 6.7 sigma.
    PeerFeature(
        "sm-clock",
        "SM clock",
        ("sm_clock_ratio",),
        "low",
        CLOCK_STEP,
        FLEET_TAIL,
        "of its node's median",
        2,
        "node",
        True,
        by_regime=True,
        app_clocks_explain=True,
    ),
    # The GPU against the whole pool: the only view of a node whose GPUs are all slow (node-
    # relative, 8 slow GPUs are 8 typical ones). Jobs differ: a heavy job holds its node at the power
    # limit, its clocks as low as its power needs, for the whole job, far out in a heavy tail; those
    # slots are not scored (the power limit sets that clock, and the node-relative comparison
    # still sees a slow GPU among capped node-mates). Uncapped jobs run near their boost clock;
    # k = FLEET_TAIL as for the node-mates keeps the rest of a job's offset from accumulating.
    PeerFeature(
        "sm-clock-pool",
        "SM clock",
        ("sm_clock_ratio",),
        "low",
        CLOCK_STEP,
        FLEET_TAIL,
        "of max",
        2,
        "pool",
        True,
        True,
        app_clocks_explain=True,
    ),
    # A sensor reads to 1 C (NVML's temperature is an integer). A GPU's steady temperature is its
    # inlet air plus its cooling's thermal resistance times its power (plus its position in the
    # chassis airflow): a heavy job runs every GPU of its node hotter by design, 10-15 C on air-
    # cooled parts, so the temperature is judged at the GPU's own power (``given``): against what
    # the pool's GPUs at that power run at in the same slot. What is left is the cooling: a bad
    # fan, dried paste, blocked air runs hotter at the same power (and a throttling GPU draws less
    # while it does, which only widens the gap). Healthy GPUs still differ by their inlet air,
    # position and heat sink contact, for good: a heavy hot tail where the hottest healthy GPU of a
    # few hundred sits near 4 MADs, steadily: k = 5. A GPU 20 C over its pool at its power (a
    # throttling one at 85 C) is 6-7 MADs and still found in a minute.
    # Hot is not yet slow: real inlet air differs by rack and height (ASHRAE's recommended 18-27 C
    # envelope), so a whole node, or a GPU, can run 9 C over its pool at its power on healthy parts,
    # and the frame knows no rack to compare within. Until the GPU reaches its slowdown temperature
    # the clocks are untouched; there NVML sets the SW thermal reason (and the HW one at the hardware
    # limit). So a temperature finding without that reason in its run is an alert (the cooling is
    # worth a look), and quarantine evidence with it (``needs_thermal_slowdown``).
    *(
        PeerFeature(
            key, label, (column,), "high", 1.0, 5.0, "C", 0, given="power_watts", needs_thermal_slowdown=True
        )
        for key, label, column in (
            ("temperature", "temperature", "temperature_celsius"),
            ("memory-temperature", "memory temperature", "memory_temperature_celsius"),
        )
    ),
    # Power under load is set by the work as much as by the GPU: a light job draws 400 W where a
    # heavy one draws 650 W on the same healthy H100s, so power is compared as a share of the node's
    # own median: a GPU held back (braked, throttled) draws less than its node-mates, a light job
    # draws less on all of them. Floor: nvidia-smi states power draw accurate to +-5 W, 0.01 of a
    # 500 W median. k = FLEET_TAIL as for the clock: the node-mates' persistent spread.
    # The node is not one job everywhere: Kubernetes allocates GPUs one by one, so an inference pod
    # at 330 W can sit beside a training job at the 700 W limit, and pipeline stages differ in load
    # for good. Low power at the clock of its node-mates with no clock event reason is less work,
    # not a fault: power is evidence only in the slots where the GPU is held back
    # (``held_back_only``), never by itself.
    PeerFeature(
        "power",
        "power",
        ("power_watts",),
        "low",
        0.01,
        FLEET_TAIL,
        "of its node's median",
        2,
        "node",
        True,
        by_regime=True,
        app_clocks_explain=True,
        held_back_only=True,
    ),
    # The PCIe generation a loaded GPU runs at, over the most it can reach in its slot (the agent's
    # pcie_link_gen_max: nvmlDeviceGetMaxPcieLinkGeneration, the lesser of GPU and host, so a Gen5
    # GPU in a Gen4 host reads 1, not 0.8, in a pool of both kinds of host). GPUs lower it at idle
    # on purpose (power management), never under load. A healthy pool reads exactly its
    # maximum (MAD 0): the floor, a quarter of one generation of Gen5 (0.2), makes a link that
    # trained one generation low (0.8 of Gen5, 0.75 of Gen4) 4-5 MADs; k = 1 lets a one-slot lag
    # after a job starts (the link retrains as the load arrives) drain away.
    PeerFeature("pcie-gen", "PCIe generation", ("pcie_link_gen_ratio",), "low", 0.05, 1.0, "of max", 2),
    # Hardware slowdown, HW thermal, power brake and SW thermal (SLOWDOWN_COLUMNS, the reasons
    # agent/report.py marks as slowdowns) are never part of healthy work: a 0/1 per slot whose pool
    # median is 0. The floor, a quarter of the bit, makes one throttled slot 4 MADs; k = 1 drains
    # one per calm slot, so the statistic climbs when the GPU is throttled more than a quarter of
    # the time.
    PeerFeature(
        "slowdown",
        "slowdown share",
        SLOWDOWN_COLUMNS,
        "high",
        0.25,
        1.0,
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
    # The frame's median MAD counts as this many GPUs beside the slot's own: the MAD of n normal
    # values has a relative standard error of ~1.17 / sqrt(n), 41 % for 8 GPUs, 21 % for 32; a
    # large pool's slot then speaks for itself, a small one leans on the frame.
    prior_gpus: Annotated[int, Meta(ge=0)] = 32
    # In-control average run lengths, in slots, per (GPU, feature) test with independent normal
    # scores: the thresholds follow from them (aggregator.detect.cusum.threshold_for_arl). 1e9 slots
    # is 0.0036 false quarantines per test per 10,000 node-hours (docs/detection.md has the table).
    arl0_alert_slots: Annotated[float, Meta(gt=1)] = 1e7
    arl0_quarantine_slots: Annotated[float, Meta(gt=1)] = 1e9
    # One slot adds at most this much to the statistic (z clipped at k + max_excess): a robust
    # z-score's tail is heavier than a normal's (the scale is estimated from a few dozen GPUs, real
    # noise has outliers), and no single slot should carry a decision.
    max_excess: Annotated[float, Meta(gt=0)] = 3.0
    # ... and a finding needs at least this many slots' worth of clipped excess: an alert four
    # reports, quarantine evidence six (a minute), whatever the ARL allows. Healthy GPUs of one node
    # do differ for a slot or two (a GPU waiting on its input for a report or two draws 40 % less
    # than its node-mates at 55 % utilization); a fault is there report after report.
    min_alert_slots: Annotated[int, Meta(ge=1)] = 4
    min_quarantine_slots: Annotated[int, Meta(ge=1)] = 6
    calm_slots: Annotated[int, Meta(ge=1)] = 3  # the last scored slots' mean within the allowance: stopped
    # An alert whose evidence has kept accumulating this long is quarantine evidence, unless an
    # explanation is named: a node does not stay suspect for ever on a deviation nobody explains.
    escalate_after_seconds: PositiveSeconds = 300.0

    def __post_init__(self) -> None:
        if not (
            self.arl0_alert_slots <= self.arl0_quarantine_slots
            and self.min_alert_slots <= self.min_quarantine_slots
            and self.min_gpus >= 2
            and self.min_nodes >= 1
        ):
            raise ValueError(
                f"peer detector needs alert ARL/slots <= quarantine ARL/slots and min peers; got {self}"
            )


@dataclass(frozen=True)
class Thresholds:
    """A feature's CUSUM thresholds, in robust z, and what they mean for false alarms."""

    h_alert: float
    h_quarantine: float
    arl0_alert: float  # in-control ARL at h_alert, slots (Siegmund)
    arl0_quarantine: float


def thresholds(feature: PeerFeature, config: PeerConfig) -> Thresholds:
    """``h`` for alert and quarantine: the ARL target's threshold at the feature's ``k``, but at least
    ``min_*_slots`` slots of the largest excess one slot can add (``max_excess``)."""
    k = feature.allowance
    h_alert = max(threshold_for_arl(k, config.arl0_alert_slots), config.min_alert_slots * config.max_excess)
    h_q = max(
        threshold_for_arl(k, config.arl0_quarantine_slots), config.min_quarantine_slots * config.max_excess
    )
    return Thresholds(h_alert, h_q, average_run_length(k, h_alert), average_run_length(k, h_q))


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
    so only complete slots are compared. Behind a backlog (reports slotted when they were measured,
    aggregator/fleet/sendtime.py, and nothing yet in the slot before ``now``'s), the newest slot
    written is the one filling: it is left out too, and the range ends at the slot before it (on
    time, ``[now - frame length, now - one slot]``).
    """
    last = now - frame.interval_s
    if frame.head is not None and frame.head < frame.slot_number(now) - 1:
        last = min(last, (frame.head - 1) * frame.interval_s)
    return last - (frame.slots - 1) * frame.interval_s, last


def _node_relative(x: Float, min_gpus: int) -> Float:
    """Each GPU's value over the median of its node's loaded GPUs in the slot; NaN on nodes with
    fewer than ``min_gpus`` of them (too few node-mates to say which one is off)."""
    node_median = nanmedian(x, axis=2)
    enough = (~np.isnan(x)).sum(axis=2) >= min_gpus
    node_median = np.where(enough & (node_median > 0), node_median, np.nan)
    out: Float = x / node_median[..., None]
    return out


# nvidia-smi states power draw accurate to +-5 W: two groups whose median powers are closer than
# two readings' error cannot be told apart, and a slope across them is noise.
POWER_ACCURACY_W: Final = 5.0


def power_fit(y: Float, power: Float, min_node_gpus: int) -> float:
    """The frame's slope of ``y`` on power (per watt, at least 0): how much hotter the pool's GPUs
    run per watt more, from same-slot comparisons only.

    Each node's median ``y`` and power over its loaded GPUs (nodes with at least ``min_node_gpus``;
    the 8 GPUs of a node run one job, so a node is one point of the pool's power range, and one
    faulty GPU does not move its node's median), less the slot's median node (the room's drift and
    the slot's intercept cancel: only nodes of the same moment are compared); over all the frame's
    points, Tukey's resistant line: the difference of the medians of the hottest-powered third and
    the lowest-powered third, over the difference of their median powers. Its breakdown point is
    1/6: a few odd nodes do not set it.

    The slope is a property of the pool's cooling (thermal resistance), one per frame; the intercept
    is the slot's own (the residuals' median in ``PeerDetector._reference``). Physics bounds it
    below by 0: more power never cools a GPU. Where the frame's power range is too narrow to
    estimate it (the thirds' median powers within ``2 x POWER_ACCURACY_W``, or fewer than three
    points) it is 0, the raw comparison; that is also where it matters least: a slope's error
    moves a GPU's expected value by the error times the GPU's power difference from its peers,
    which a narrow range keeps small.
    """
    both = ~np.isnan(y) & ~np.isnan(power)
    enough = both.sum(axis=2) >= min_node_gpus
    yn = np.where(enough, nanmedian(np.where(both, y, np.nan), axis=2), np.nan)
    pn = np.where(enough, nanmedian(np.where(both, power, np.nan), axis=2), np.nan)
    yc = yn - nanmedian(yn, axis=1)[:, None]
    pc = pn - nanmedian(pn, axis=1)[:, None]
    ok = ~np.isnan(yc) & ~np.isnan(pc)
    xs, ys = pc[ok], yc[ok]
    third = xs.size // 3
    if third == 0:
        return 0.0
    order = np.argsort(xs, kind="stable")
    xs, ys = xs[order], ys[order]
    run = float(np.median(xs[-third:]) - np.median(xs[:third]))
    if run < 2 * POWER_ACCURACY_W:
        return 0.0
    rise = float(np.median(ys[-third:]) - np.median(ys[:third]))
    return max(0.0, rise / run)


def shrunk_scale(
    mad: Float, count: npt.NDArray[np.int64], scored: npt.NDArray[np.bool_], prior_gpus: int, floor: float
) -> Float:
    """Per slot, the robust scale ``1.4826 * MAD`` shrunk toward the frame's: the median over the
    ``scored`` slots of their own scale, counting as ``prior_gpus`` GPUs beside the slot's
    ``count`` (a weighted mean of the two), and never below ``floor`` (the measurement's step)."""
    own = MAD_SCALE * mad
    valid = scored & ~np.isnan(own)
    prior = float(np.median(own[valid])) if valid.any() else math.nan
    n = count.astype(np.float64)
    if math.isnan(prior) or prior_gpus == 0:
        mixed = own
    else:
        mixed = np.where(
            np.isnan(own), prior, (n * np.nan_to_num(own) + prior_gpus * prior) / (n + prior_gpus)
        )
    out: Float = np.maximum(mixed, floor)
    return out


def _stopped(z: Float, allowance: float, calm_slots: int) -> npt.NDArray[np.bool_]:
    """Per cell, whether the deviation has stopped: the mean of its last ``calm_slots`` scored slots
    is within the allowance. A mean, not every slot: a healthy GPU near its peers still has a slot
    over ``k`` now and then, which must not keep a stopped deviation reported."""
    has = ~np.isnan(z)
    from_end = np.cumsum(has[::-1], axis=0)[::-1]  # scored slots from this one to the last
    recent = has & (from_end <= calm_slots)
    count = recent.sum(axis=0)
    mean = np.where(recent, z, 0.0).sum(axis=0) / np.maximum(count, 1)
    out: npt.NDArray[np.bool_] = (count >= calm_slots) & (mean < allowance)
    return out


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def _handback(out: dict[str, list[Finding]]) -> dict[str, list[Finding]]:
    """``finish``: the judgement keeps no state between runs, so there is nothing to apply here."""
    return out


class PeerDetector(OffloadingPoolDetector):
    """Per pool robust z-scores per slot, accumulated per GPU and feature by a one-sided CUSUM.

    Its attributes are set here once and never changed (frozen settings, a tuple, a dict nobody
    writes), so the compute of a run may read them from a worker thread.
    """

    def __init__(self, config: PeerConfig | None = None) -> None:
        self.config = config if config is not None else PeerConfig()
        self.every_seconds = self.config.every_seconds
        self.features = tuple(f for f in FEATURES if all(col in GPU_COLUMN for col in f.columns))
        self.thresholds = {f.key: thresholds(f, self.config) for f in self.features}
        self.app_clocks_column = GPU_COLUMN[APP_CLOCKS_COLUMN]

    def prepare_pool(self, frame: PoolFrame, now: float) -> Offload[dict[str, list[Finding]]]:
        """The pool's complete slots copied out of the frame; the judgement runs on the copy."""
        t0, t1 = complete_slots(frame, now)
        # Slots never written are NaN in every cell: they score nothing and move no median, the
        # CUSUM holds over them, so the judgement is the same without them and costs less in a
        # pool's first frame-length (30 minutes at a 60 s interval).
        window = frame.window(frame.written_since(t0), t1)
        return Offload(compute=lambda: self.judge(window, now), finish=_handback)

    def judge(self, window: FrameWindow, now: float) -> dict[str, list[Finding]]:
        """Findings for every node of a pool's copied window (empty lists where nothing deviates).
        Reads nothing but ``window``, ``now`` and the detector's fixed settings: any thread."""
        nodes, gpu, starts = list(window.nodes), window.gpu, window.starts
        out: dict[str, list[Finding]] = {n: [] for n in nodes}
        if gpu.shape[0] == 0 or not nodes:
            return out
        c = self.config
        loaded = under_load(gpu, c.load_threshold)
        capped = gpu[..., GPU_COLUMN["sw_power_cap"]] > 0  # NaN (not reported) compares False
        # Clocks the admin set, where most of the slot's loaded GPUs have none: a pool locked as a
        # whole (for determinism) runs at one setting and is compared as usual; a node locked
        # unlike its pool is policy, not a fault, and is left out.
        locked = gpu[..., self.app_clocks_column] > 0  # NaN (not reported) compares False
        share = (locked & loaded).sum(axis=(1, 2)) / np.maximum(loaded.sum(axis=(1, 2)), 1)
        app_clocks = locked & (share < 0.5)[:, None, None]
        held: npt.NDArray[np.bool_] | None = None
        # How long a run has lasted is read against the data, not the clock: behind a backlog the
        # newest complete slot is minutes old, and a run would otherwise escalate on time that no
        # slot showed. On time (the newest complete slot just before ``now``'s) it is ``now``;
        # behind, the start of the slot after the newest complete one, the earliest an on-time
        # run could have judged the same slots (so a backlog never escalates sooner).
        after_last = float(starts[-1]) + window.interval_s
        seen_until = now if now < after_last + window.interval_s else after_last
        context = _Context(
            pool=window.pool,
            nodes=nodes,
            starts=starts,
            gpu=gpu,
            loaded=loaded,
            capped=capped,
            now=seen_until,
        )
        for feature in self.features:
            cols = [GPU_COLUMN[col] for col in feature.columns]
            raw = gpu[..., cols].astype(np.float64)
            # ``np.nanmax`` is this reduce plus a warning on an all-NaN lane; silencing that takes
            # ``warnings.catch_warnings``, which is not thread-safe, and this runs in a worker.
            value: Float = np.fmax.reduce(raw, axis=-1) if len(cols) > 1 else raw[..., 0]
            x = np.where(loaded, value, np.nan)  # (slots, nodes, gpus)
            if feature.app_clocks_explain:
                x = np.where(app_clocks, np.nan, x)
            if feature.uncapped_only:
                x = np.where(capped, np.nan, x)
            if feature.relative_to == "node":
                x = _node_relative(x, c.min_node_gpus)
            fit: tuple[float, Float] | None = None
            if feature.given is not None:
                # The value less what the pool runs at at the GPU's own power (slope x power; the
                # slot's intercept is the residuals' median): scored is the residual, shown the value.
                given = np.where(loaded, gpu[..., GPU_COLUMN[feature.given]].astype(np.float64), np.nan)
                slope = power_fit(x, given, c.min_node_gpus)
                expected: Float = slope * given if slope > 0 else np.zeros_like(x)
                x = x - expected
                fit = (slope, expected)
            gate = None
            if feature.held_back_only:
                held = held_back(gpu, loaded & ~app_clocks, c.min_node_gpus) if held is None else held
                gate = held
            self._feature(feature=feature, ctx=context, x=x, out=out, fit=fit, held=gate)
        return out

    def _reference(
        self,
        feature: PeerFeature,
        x: Float,
        enough: npt.NDArray[np.bool_],
        peers: npt.NDArray[np.int64],
        regime: npt.NDArray[np.bool_] | None,
    ) -> tuple[Float, Float]:
        """Per cell (slot, node, GPU), the median and the shrunk robust scale it is compared with:
        the slot's, over every scored GPU; with ``regime`` (True where the GPU is held at its power
        limit), the slot's over the GPUs in the same regime, where that regime alone has enough
        peers. At the power limit a GPU's clock is what its own efficiency allows, so capped GPUs
        spread wider than uncapped ones: one scale for both would understate theirs."""
        c = self.config
        slots = x.shape[0]
        median, mad = median_mad(x.reshape(slots, -1), axis=1)
        scale = shrunk_scale(mad, peers, enough, c.prior_gpus, feature.floor)
        cell_median: Float = np.broadcast_to(median[:, None, None], x.shape).copy()
        cell_scale: Float = np.broadcast_to(scale[:, None, None], x.shape).copy()
        if regime is None:
            return cell_median, cell_scale
        for state in (False, True):
            mask = regime == state
            xs = np.where(mask, x, np.nan)
            has = ~np.isnan(xs)
            count = has.sum(axis=(1, 2))
            ok = (count >= c.min_gpus) & (has.any(axis=2).sum(axis=1) >= c.min_nodes)
            if ok.any():
                m, d = median_mad(xs.reshape(slots, -1), axis=1)
                sc = shrunk_scale(d, count, ok, c.prior_gpus, feature.floor)
                use = mask & ok[:, None, None]
                cell_median = np.where(use, m[:, None, None], cell_median)
                cell_scale = np.where(use, sc[:, None, None], cell_scale)
            if state and not ok.all():
                # Capped GPUs with too few capped peers in the pool (one heavy job among light
                # ones) would take the uncapped GPUs' scale, which understates theirs: their
                # node's own capped GPUs (one job, one limit) say how far apart they spread.
                lone = mask & ~ok[:, None, None]
                node_count = has.sum(axis=2)
                node_median = nanmedian(xs, axis=2)
                node_mad = nanmedian(np.abs(xs - node_median[..., None]), axis=2)
                node_scale = np.where(node_count >= c.min_node_gpus, MAD_SCALE * node_mad, np.nan)
                wider = np.fmax(cell_scale, node_scale[..., None])
                cell_scale = np.where(lone, wider, cell_scale)
        return cell_median, cell_scale

    def _feature(
        self,
        *,
        feature: PeerFeature,
        ctx: _Context,
        x: Float,
        out: dict[str, list[Finding]],
        fit: tuple[float, Float] | None = None,
        held: npt.NDArray[np.bool_] | None = None,
    ) -> None:
        """Score ``x`` per slot against its pool, accumulate, and report; ``fit`` (a ``given``
        feature's slope and the part of each cell's value its power explains) is added back to the
        value and the median shown, so that a finding reads in the feature's own unit; ``held``
        (``held_back_only``): where the GPU is held back, the only slots whose score may add
        evidence (elsewhere it is at most 0: the statistic drains)."""
        c = self.config
        th = self.thresholds[feature.key]
        slots = x.shape[0]
        has = ~np.isnan(x)
        peers = has.sum(axis=(1, 2))
        peer_nodes = has.any(axis=2).sum(axis=1)
        enough = (peers >= c.min_gpus) & (peer_nodes >= c.min_nodes)
        if not enough.any():
            return
        median, scale = self._reference(feature, x, enough, peers, ctx.capped if feature.by_regime else None)
        sign = -1.0 if feature.worse == "low" else 1.0
        clip = feature.allowance + c.max_excess
        z = np.clip(sign * (x - median) / scale, -clip, clip)
        if held is not None:
            z = np.where(held, z, np.minimum(z, 0.0))  # NaN stays NaN
        z[~enough] = np.nan
        result = cusum(z, feature.allowance)
        s = result.statistic
        hit = (s >= th.h_alert) & ~_stopped(z, feature.allowance, c.calm_slots)
        if not hit.any():
            return
        idx = np.arange(slots)[:, None, None]
        in_run = (idx >= result.run_start[None]) & (result.run_start[None] >= 0) & ~np.isnan(z)
        runs = np.maximum(in_run.sum(axis=0), 1)
        mean_z = np.where(in_run, z, 0.0).sum(axis=0) / runs
        mean_x = np.where(in_run, x, 0.0).sum(axis=0) / runs
        mean_median = np.where(in_run, median, 0.0).sum(axis=0) / runs
        if fit is not None:
            mean_fit = np.where(in_run, fit[1], 0.0).sum(axis=0) / runs
            mean_x = mean_x + mean_fit
            mean_median = mean_median + mean_fit
        versus = "pool median" if fit is None else "its pool at its power"
        mean_scale = np.where(in_run, scale, 0.0).sum(axis=0) / runs
        for n, g in zip(*np.nonzero(hit), strict=True):
            node = ctx.nodes[int(n)]
            gi = int(g)
            run = in_run[:, n, g]
            since = float(ctx.starts[int(result.run_start[n, g])])
            lasted = ctx.now - since
            explained_by_limit = (
                _power_limit_explanation(feature, ctx, int(n), gi, run)
                if feature.power_limit_explains
                else None
            )
            # What keeps a finding an alert whatever its evidence: a setting (the power limit) or no
            # sign from the hardware that the deviation slows the GPU (no thermal slowdown).
            keeps_alert = explained_by_limit or (
                _no_thermal_slowdown(ctx, int(n), gi, run) if feature.needs_thermal_slowdown else None
            )
            explanation = keeps_alert or (
                _job_change(ctx, int(n), run) if feature.relative_to == "pool" else None
            )
            crossed = bool(s[n, g] >= th.h_quarantine)
            escalated = not crossed and lasted >= c.escalate_after_seconds and explanation is None
            quarantine = (crossed or escalated) and keeps_alert is None
            action: Action = "quarantine" if quarantine else "alert"
            v, m, zz = float(mean_x[n, g]), float(mean_median[n, g]), float(mean_z[n, g])
            direction = "low" if feature.worse == "low" else "high"
            summary = (
                f"GPU {gi} {feature.label} {v:.{feature.digits}f} {feature.unit} under load, "
                f"{versus} {m:.{feature.digits}f}, {zz:.1f} MADs {direction} for {_minutes(lasted)}"
            )
            if escalated and quarantine:
                summary += f", unexplained for over {_minutes(c.escalate_after_seconds)}"
            if explanation is not None:
                summary += f"; explained: {explanation}"
            out[node].append(
                Finding(
                    detector=PeerConfig.name,
                    key=f"peer-{feature.key}:gpu{gi}",
                    severity="critical" if quarantine else "warning",
                    action=action,
                    summary=summary,
                    since=since,
                    decided=crossed and quarantine,
                    evidence={
                        "gpu": gi,
                        "feature": feature.key,
                        "relative_to": feature.relative_to,
                        "value": round(v, 4),
                        "pool_median": round(m, 4),  # with ``given``: the pool's at its power
                        "given": feature.given,
                        "slope": None if fit is None else round(fit[0], 5),
                        "scale": round(float(mean_scale[n, g]), 4),
                        "mads": round(zz, 2),
                        "direction": direction,
                        "cusum": round(float(s[n, g]), 2),
                        "allowance": feature.allowance,
                        "threshold": th.h_quarantine if crossed else th.h_alert,
                        "escalated": escalated and quarantine,
                        "explanation": explanation,
                        "seconds": round(lasted, 1),
                        "slots": int(runs[n, g]),
                        "pool": ctx.pool,
                        "peers": int(peers[-1]),
                        "peer_nodes": int(peer_nodes[-1]),
                    },
                )
            )
            log.info(
                "peer deviation",
                extra={"node": node, "gpu": gi, "feature": feature.key, "action": action, "mads": zz},
            )


@dataclass(frozen=True)
class _Context:
    """What every feature of one pool's run shares."""

    pool: str
    nodes: list[str]
    starts: npt.NDArray[np.float64]
    gpu: npt.NDArray[np.float32]  # (slots, nodes, gpus, GPU_FIELDS)
    loaded: npt.NDArray[np.bool_]  # (slots, nodes, gpus)
    capped: npt.NDArray[np.bool_]  # (slots, nodes, gpus): held at the power limit (SW power cap)
    now: float  # as far as the data reach (``judge``): what a run's "how long" is measured to


# A power limit is a setting in whole watts, enforced against a reading nvidia-smi states accurate to
# +-5 W: a limit lower than its peers' by more than that is a different setting.
POWER_LIMIT_DIFFERENCE_W: Final = 5.0
# The GPU is held at its power limit in at least half the run's slots more than its peers are.
CAP_SHARE_DIFFERENCE: Final = 0.5


def _power_limit_explanation(
    feature: PeerFeature, ctx: _Context, n: int, g: int, run: npt.NDArray[np.bool_]
) -> str | None:
    """Why the GPU's clock or power is lower than its peers' by design, over the run's slots: it is
    held at its power limit (NVML's SW power cap reason) while its peers are not, or its limit is
    set lower than theirs. The peers are its node-mates for a node-relative feature, else the pool."""
    if not run.any():
        return None
    cap = ctx.gpu[run][..., GPU_COLUMN["sw_power_cap"]].astype(np.float64)  # (run slots, nodes, gpus)
    limit = ctx.gpu[run][..., GPU_COLUMN["power_limit_watts"]].astype(np.float64)
    loaded = ctx.loaded[run]
    peers = np.zeros(loaded.shape, bool)
    if feature.relative_to == "node":
        peers[:, n, :] = loaded[:, n, :]
    else:
        peers[:] = loaded
    peers[:, n, g] = False
    # nanstats, not np.nan*: no warning to silence (see the module's docstring) in a worker thread.
    own_cap = float(nanmean(cap[:, n, g], axis=0))
    peer_cap = float(nanmean(np.where(peers, cap, np.nan).ravel(), axis=0))
    own_limit = float(nanmean(limit[:, n, g], axis=0))
    peer_limit = float(nanmedian(np.where(peers, limit, np.nan).ravel(), axis=0))
    who = "its node-mates" if feature.relative_to == "node" else "the pool"
    if (
        not math.isnan(own_cap)
        and own_cap - (0.0 if math.isnan(peer_cap) else peer_cap) >= CAP_SHARE_DIFFERENCE
    ):
        peer_share = 0.0 if math.isnan(peer_cap) else peer_cap
        return f"held at its power limit (SW power cap) {own_cap:.0%} of the time, {who} {peer_share:.0%}"
    if (
        not (math.isnan(own_limit) or math.isnan(peer_limit))
        and peer_limit - own_limit > POWER_LIMIT_DIFFERENCE_W
    ):
        return f"power limit set to {own_limit:.0f} W, {who} {peer_limit:.0f} W"
    return None


def held_back(
    gpu: npt.NDArray[np.float32], scored: npt.NDArray[np.bool_], min_node_gpus: int
) -> npt.NDArray[np.bool_]:
    """Per cell (slot, node, GPU), whether something holds the GPU below the clock its work asks
    for: a slowdown reason (SLOWDOWN_COLUMNS: HW slowdown, thermal, power brake), or an SM clock
    more than ``HELD_BACK_STEPS`` clock steps under the median of its node's ``scored`` GPUs (a
    silent fail-slow part: lower clock at the same work). At its node-mates' clock with no such
    reason a GPU is not held back, whatever it draws: power follows the work (NVML's
    nvmlClocksEventReasonNone: no clock event reason, "clocks are as high as possible")."""
    clock = np.where(scored, gpu[..., GPU_COLUMN["sm_clock_ratio"]].astype(np.float64), np.nan)
    relative = _node_relative(clock, min_node_gpus)
    slower: npt.NDArray[np.bool_] = relative < 1.0 - HELD_BACK_STEPS * CLOCK_STEP  # NaN: False
    bits = gpu[..., [GPU_COLUMN[col] for col in SLOWDOWN_COLUMNS]].astype(np.float64)
    slowed = np.any(bits > 0, axis=-1)
    out: npt.NDArray[np.bool_] = np.logical_or(slower, slowed)
    return out


def _no_thermal_slowdown(ctx: _Context, n: int, g: int, run: npt.NDArray[np.bool_]) -> str | None:
    """Why a temperature deviation stays an alert: over the run's slots the GPU was thermally
    slowed (NVML's SW or HW thermal reason) in less than ``THERMAL_SHARE`` of them. Until a GPU
    reaches its slowdown temperature its clocks are untouched: hot against its pool (a warmer
    inlet, a rack position, a cooling worth a look) but not yet slow. None when it was slowed."""
    if not run.any():
        return None
    # This GPU's run slots only: indexing the slots first would copy the whole pool's.
    bits = ctx.gpu[:, n, g][run][:, [GPU_COLUMN[col] for col in THERMAL_COLUMNS]].astype(np.float64)
    thermal = np.fmax.reduce(bits, axis=-1)  # NaN where neither was reported
    # A GPU whose reasons are not reported shows no slowdown: nothing says it is held back.
    share = float(np.nan_to_num(thermal, nan=0.0).mean())
    if share >= THERMAL_SHARE:
        return None
    return (
        f"no thermal slowdown (NVML SW/HW thermal reason) in {share:.0%} of the run: "
        "under its slowdown temperature, the clocks are not held back"
    )


def _job_change(ctx: _Context, n: int, run: npt.NDArray[np.bool_]) -> str | None:
    """A pool-relative deviation across a job change on the node: some slot inside the run where none
    of the node's GPUs was under load (the node between jobs) means the run compares two jobs."""
    scored = np.nonzero(run)[0]
    if scored.size < 2:
        return None
    inside = slice(int(scored[0]), int(scored[-1]) + 1)
    idle = ~ctx.loaded[inside, n, :].any(axis=1)
    if not idle.any():
        return None
    at = float(ctx.starts[inside][np.argmax(idle)])
    return f"the node changed jobs during the run (idle at {at:.0f})"
