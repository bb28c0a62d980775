"""Forest: a GPU whose combination of features is unlike its pool's, though no single one is far off.

The peer detector compares one feature at a time and needs each to stray several MADs for minutes.
A GPU a little hot, a little slow, a little braked and drawing a little less power passes all of
those checks, yet no healthy GPU of its pool looks like that. This detector looks at the whole
vector at once.

Per pool, every ``every_seconds`` (5 min), over the last ``window_seconds`` of complete slots (at
least ``min_loaded_slots`` of them: ``window_slots``):

1. one vector per GPU from the slots where it was under load (utilization >= ``load_threshold``,
   at least ``min_loaded_slots`` of them): the median SM clock ratio, temperature, memory
   temperature, power / power limit and PCIe width ratio, the share of slots with a slowdown
   reason, the mean error rates (corrected ECC, PCIe replay, NVLink CRC / replay / recovery);
2. each feature standardized robustly over the pool: ``z = (x - median) / max(1.4826 * MAD,
   floor)``; a feature no GPU of the pool reports, or that is the same on every GPU, is left out,
   and a GPU missing one feature sits at the pool's median for it;
3. scikit-learn's ``IsolationForest`` (seeded, refit on the pool's vectors at every run, fitted on
   at most ``max_fit_samples`` of them) scores every GPU;
4. a GPU is flagged when its anomaly score is a robust outlier of the pool's scores (beyond
   ``median + score_mads * 1.4826 * MAD`` and at least ``min_score``) **and** its robust distance
   ``sqrt(z' R^-1 z)`` (``R`` the pool's correlation of clipped z-scores, see ``robust_distance``)
   is past the distance line: the forest ranks, the distance makes sure the explanation (the
   GPU's largest signed z-scores) names a deviation worth reading, not one fact counted twice.

The distance line grows with the pool. The largest of ``n`` healthy distances grows with ``n``
(about ``sqrt(2 ln n)``), so a fixed line quiet at 500 GPUs is crossed by healthy GPUs at 8,000;
the score gate does not make up for it, because isolation scores are bounded and their healthy
maximum, in MADs, hardly grows with ``n``. The line is therefore ``max(min_distance, q)``, ``q``
the ``1 - healthy_exceedances / n`` quantile of a tail fitted to the pool's own distances (see
``distance_gate``): ``healthy_exceedances`` is the expected number of healthy GPUs past it per run.

A finding is always an ``alert`` (the node becomes ``suspect``): an isolation score is a
suspicion, not a diagnosis. Quarantine needs evidence a human can state in one line, such as the
peer detector's persistent deviation of one feature; the forest's finding sits beside it in the
decision record as corroboration and tells on-call where to look when nothing else fires.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from statistics import NormalDist
from typing import Annotated, ClassVar, Final, Literal

import numpy as np
import numpy.typing as npt
from msgspec import Meta
from sklearn.ensemble import IsolationForest  # type: ignore[import-untyped]  # no stubs shipped

from aggregator.config import DetectorSettings, PositiveSeconds, Ratio
from aggregator.detect.base import Offload, OffloadingPoolDetector
from aggregator.detect.load import settled
from aggregator.detect.nanstats import nanmean, nanmedian
from aggregator.detect.peers import MAD_SCALE, complete_slots, median_mad, under_load
from aggregator.fleet.frame import GPU_COLUMN, SLOWDOWN_COLUMNS, FrameWindow, PoolFrame
from aggregator.model import Finding

log = logging.getLogger(__name__)

Float = npt.NDArray[np.float64]
AtLeastOne = Annotated[int, Meta(ge=1)]
NonNegative = Annotated[float, Meta(ge=0)]


@dataclass(frozen=True)
class ForestFeature:
    """One per-GPU summary over the window's loaded slots."""

    key: str  # in evidence: "sm-clock"
    label: str  # in summaries: "SM clock"
    columns: tuple[str, ...]  # GPU_COLUMN names; "ratio": numerator, denominator; "any": the largest
    combine: Literal["one", "ratio", "any"]
    reduce: Literal["median", "mean"]
    floor: float  # lower bound of the robust scale, in the feature's unit
    unit: str
    digits: int


# Floors are the smallest difference between two GPUs' window summaries that means something
# physically. They are below the peer detector's per-slot floors because a median over minutes has
# shed the per-sample noise: what is left is each GPU's persistent offset from its pool.
FEATURES: Final[tuple[ForestFeature, ...]] = (
    ForestFeature("sm-clock", "SM clock", ("sm_clock_ratio",), "one", "median", 0.01, "of max", 3),
    ForestFeature("temperature", "temperature", ("temperature_celsius",), "one", "median", 1.0, "C", 0),
    ForestFeature(
        "memory-temperature",
        "memory temperature",
        ("memory_temperature_celsius",),
        "one",
        "median",
        1.0,
        "C",
        0,
    ),
    # Power over its own limit, so that a node capped lower on purpose compares like for like.
    ForestFeature(
        "power", "power", ("power_watts", "power_limit_watts"), "ratio", "median", 0.02, "of limit", 3
    ),
    # One slot in 20 with a slowdown reason is one unit: a stray bit over a 5-min window is < 1.
    ForestFeature(
        "slowdown",
        "slowdown share",
        SLOWDOWN_COLUMNS,
        "any",
        "mean",
        0.05,
        "of the time",
        2,
    ),
    # x16 to x14 is a lane lost; a downtrain to x8 is 4 units.
    ForestFeature(
        "pcie-width", "PCIe width", ("pcie_link_width_ratio",), "one", "median", 0.125, "of max", 2
    ),
    # Error counters sit at zero on healthy hardware: 0.1/s (one per 10-s report) is one unit.
    ForestFeature("ecc-sbe", "corrected ECC", ("ecc_sbe_per_second",), "one", "mean", 0.1, "/s", 2),
    ForestFeature("pcie-replay", "PCIe replay", ("pcie_replay_per_second",), "one", "mean", 0.1, "/s", 2),
    ForestFeature("nvlink-crc", "NVLink CRC", ("nvlink_crc_per_second",), "one", "mean", 0.1, "/s", 2),
    ForestFeature(
        "nvlink-replay", "NVLink replay", ("nvlink_replay_per_second",), "one", "mean", 0.1, "/s", 2
    ),
    ForestFeature(
        "nvlink-recovery", "NVLink recovery", ("nvlink_recovery_per_second",), "one", "mean", 0.1, "/s", 2
    ),
)


class ForestConfig(DetectorSettings, frozen=True):
    """``detectors.forest``."""

    name: ClassVar[str] = "forest"
    every_seconds: PositiveSeconds = 300.0  # refit at most this often: the forest is the costliest detector
    window_seconds: PositiveSeconds = 300.0  # the complete slots each run looks at
    load_threshold: Ratio = 0.5  # utilization ratio at which a GPU counts as under load
    min_loaded_slots: AtLeastOne = 6  # loaded slots in the window for a GPU to have a vector (1 min at 10 s)
    settle_seconds: NonNegative = 180.0  # busy this long before a slot counts as loaded (thermal settling)
    min_gpus: Annotated[int, Meta(ge=2)] = 16  # GPUs with a vector for the pool to be modelled at all ...
    min_nodes: AtLeastOne = 4  # ... on at least this many nodes
    n_estimators: AtLeastOne = 100
    # Rows the forest is fitted on (a seeded sample of a bigger pool).
    max_fit_samples: Annotated[int, Meta(ge=2)] = 4096
    seed: Annotated[int, Meta(ge=0)] = 0
    score_mads: NonNegative = 6.0  # the score must be this many MADs above the pool's median score ...
    min_score: Ratio = 0.6  # ... and at least this (0.5 is "as easy to isolate as any point")
    min_distance: NonNegative = 5.0  # robust_distance for the explanation to be worth it ...
    # ... and beyond the pool's own healthy maximum: the expected number of healthy GPUs of a pool
    # past the distance line in one run, under the tail fitted to that pool (``distance_gate``).
    healthy_exceedances: Annotated[float, Meta(gt=0, lt=1)] = 0.05
    top_features: AtLeastOne = 3  # features named in the explanation

    def __post_init__(self) -> None:
        if not (
            self.every_seconds > 0
            and self.window_seconds > 0
            and self.min_loaded_slots >= 1
            and self.min_gpus >= 2
            and self.min_nodes >= 1
            and self.n_estimators >= 1
            and self.max_fit_samples >= 2
            and self.top_features >= 1
            and self.score_mads >= 0
            and self.min_distance >= 0
            and 0 < self.healthy_exceedances < 1
        ):
            raise ValueError(f"forest detector needs positive periods, sizes and thresholds; got {self}")


@dataclass(frozen=True)
class PoolVectors:
    """A pool's per-GPU feature vectors: rows are (node index, GPU index) pairs."""

    nodes: list[str]
    rows: npt.NDArray[np.intp]  # (n, 2): node index, GPU index
    features: tuple[ForestFeature, ...]
    values: Float  # (n, features): the window summaries, NaN where a GPU lacks one
    median: Float  # (features,)
    scale: Float  # (features,)
    z: Float  # (n, features): robust z, 0 where the value is missing
    loaded_slots: npt.NDArray[np.intp]  # (n,)
    window_start: float


def window_slots(config: ForestConfig, interval_s: float) -> int:
    """The complete slots a run scores: ``window_seconds`` of them, but never fewer than a GPU
    needs for a vector (``min_loaded_slots``): at a 60 s interval the default 300 s is 5 slots,
    and a window of 5 could never hold the 6 a GPU needs."""
    return max(config.min_loaded_slots, round(config.window_seconds / interval_s))


def judged_until(frame: PoolFrame, now: float) -> float:
    """Where the complete slots a run at ``now`` judges end: ``now`` on time; behind a backlog the
    start of the slot still filling, as the peer and trend detectors judge (``complete_slots``).
    A slot a backlog has not reached yet holds nothing, and would leave every GPU fewer loaded
    slots than it had."""
    last = complete_slots(frame, now)[1]
    return now if last == now - frame.interval_s else last + frame.interval_s


def window_copy(frame: PoolFrame, end: float, config: ForestConfig) -> FrameWindow:
    """The slots a run judging up to ``end`` (``judged_until``) looks at (``window_slots`` of
    complete slots and the ``settle_seconds`` before them), frozen (``PoolFrame.window``) so that
    the rest of the run may go on while the frame takes new reports and forgets nodes (rows move
    then)."""
    slots = window_slots(config, frame.interval_s)
    settle = max(0, round(config.settle_seconds / frame.interval_s))
    return frame.window(end - (slots + settle) * frame.interval_s, end - frame.interval_s)


def pool_vectors(frame: PoolFrame, now: float, config: ForestConfig) -> PoolVectors:
    """The per-GPU robust feature vectors of one pool over the window ending at the last complete slot."""
    end = judged_until(frame, now)
    return vectors_of(window_copy(frame, end, config), end, config)


def vectors_of(window: FrameWindow, end: float, config: ForestConfig) -> PoolVectors:
    """``pool_vectors`` of a copied window, judged up to ``end`` (any thread: it reads nothing else)."""
    interval = window.interval_s
    slots = window_slots(config, interval)
    settle = max(0, round(config.settle_seconds / interval))
    t0 = end - slots * interval
    nodes, history, all_starts = list(window.nodes), window.gpu, window.starts
    busy = under_load(history, config.load_threshold)
    # A slot counts as loaded once the GPU has been busy for ``settle_seconds`` before it: a GPU
    # that started a job a minute ago is still heating up (heat sinks take minutes), and would
    # look colder than every settled peer. Slots before the held history cannot vouch for it.
    loaded_all = settled(busy, settle)
    first = int(np.searchsorted(all_starts, t0 - 1e-9)) if all_starts.size else 0
    gpu = history[first:]
    loaded = loaded_all[first:]
    starts = all_starts[first:]
    window_start = float(starts[0]) if starts.size else t0
    count = loaded.sum(axis=0)  # (nodes, gpus)
    eligible = count >= config.min_loaded_slots
    rows = np.argwhere(eligible)
    usable = tuple(f for f in FEATURES if all(c in GPU_COLUMN for c in f.columns))
    values = np.full((rows.shape[0], len(usable)), np.nan)
    # All-NaN lanes (a GPU that never reports a feature) are expected and stay NaN. This runs in
    # a worker thread in the service, so without numpy's warnings (``aggregator.detect.nanstats``).
    for j, f in enumerate(usable):
        raw = gpu[..., [GPU_COLUMN[c] for c in f.columns]].astype(np.float64)
        if f.combine == "ratio":
            den = raw[..., 1]
            x = np.where(den > 0, raw[..., 0] / np.where(den > 0, den, 1.0), np.nan)
        elif f.combine == "any":
            x = np.fmax.reduce(raw, axis=-1)  # np.nanmax without its all-NaN warning
        else:
            x = raw[..., 0]
        x = np.where(loaded, x, np.nan)
        summary = nanmedian(x, axis=0) if f.reduce == "median" else nanmean(x, axis=0)
        values[:, j] = summary[eligible]
    has = ~np.isnan(values)
    if values.shape[0]:
        median, mad = median_mad(values, axis=0)
    else:
        median = mad = np.full(len(usable), np.nan)
    floors = np.array([f.floor for f in usable])
    scale = np.maximum(MAD_SCALE * np.nan_to_num(mad), floors)
    z = np.where(has, (values - median) / scale, 0.0)
    # A feature nobody reports or that every GPU shares cannot tell GPUs apart: it only costs time.
    keep = has.any(axis=0) & (np.abs(z) > 0).any(axis=0)
    return PoolVectors(
        nodes=nodes,
        rows=rows,
        features=tuple(f for f, k in zip(usable, keep, strict=True) if k),
        values=values[:, keep],
        median=median[keep],
        scale=scale[keep],
        z=z[:, keep],
        loaded_slots=count[eligible].astype(np.intp),
        window_start=window_start,
    )


def robust_distance(z: Float, clip: float = 3.0, shrink: float = 0.1) -> Float:
    """``sqrt(z' R^-1 z)`` per row, ``R`` the pool's correlation of the z-scores clipped to +-``clip``.

    A GPU hot in the middle of the chassis is hot in both temperature and memory temperature: one
    fact, which a plain ``sqrt(sum z^2)`` would count twice. The correlation removes what the
    pool's healthy GPUs share; clipping keeps the outliers being judged out of it, and shrinking
    towards the identity keeps it invertible when a feature barely varies.
    """
    zc = np.clip(z, -clip, clip)
    cov = zc.T @ zc / max(zc.shape[0], 1)
    sd = np.sqrt(np.diag(cov))
    live = sd > 1e-6
    corr = np.eye(z.shape[1])
    corr[np.ix_(live, live)] = np.clip(cov[np.ix_(live, live)] / np.outer(sd[live], sd[live]), -1.0, 1.0)
    corr = (1.0 - shrink) * corr + shrink * np.eye(z.shape[1])
    d2 = np.einsum("ij,jk,ik->i", z, np.linalg.inv(corr), z)
    out: Float = np.sqrt(np.maximum(d2, 0.0))
    return out


def distance_gate(distance: Float, exceedances: float, floor: float) -> float:
    """The distance a GPU must reach: ``floor``, or past what the pool's healthy GPUs reach if higher.

    With ``n`` GPUs the largest healthy distance grows with ``n`` (about ``sqrt(2 ln n)`` for
    Gaussian features), so a fixed line that is quiet at 500 GPUs is crossed at 8,000. The line is
    instead the ``1 - exceedances / n`` quantile of the pool's own distances: ``exceedances`` is
    the expected number of healthy GPUs past it per run. The quantile comes from a tail fitted to
    the pool, not from its order statistics, which are too few and include the outliers sought:
    ``d^2`` of a healthy GPU is roughly a scaled chi-square, and by Wilson and Hilferty the cube
    root of a chi-square, here ``d^(2/3)``, is close to normal. Its median and 1.4826 * MAD are
    that normal's mean and standard deviation whatever the scale and degrees of freedom, and a few
    outliers barely move them.
    """
    n = distance.shape[0]
    if n < 2:
        return floor
    t = distance ** (2.0 / 3.0)
    centre = float(np.median(t))
    spread = MAD_SCALE * float(np.median(np.abs(t - centre)))
    z = NormalDist().inv_cdf(1.0 - exceedances / n)
    return max(floor, float((centre + z * spread) ** 1.5))


def _fmt(value: float, digits: int) -> str:
    return f"{value:.{digits}f}"


@dataclass(frozen=True)
class _Outcome:
    """A forest run's result: the findings per node and what to log about each (done on the caller's
    thread, with the findings)."""

    nodes: dict[str, list[Finding]]
    outliers: tuple[dict[str, object], ...]


class ForestDetector(OffloadingPoolDetector):
    """Per pool IsolationForest over robust per-GPU feature vectors; findings are alerts only.

    Its run is the pipeline's costliest step (the fit and the scores), so it is split: the pool's
    window is copied out of the frame on the caller's thread (``window_copy``), the vectors, forest,
    distances and findings are worked out from that copy alone (``_judge``, a worker thread in the
    service), and the outcome is logged and returned on the caller's thread.
    """

    def __init__(self, config: ForestConfig | None = None) -> None:
        self.config = config if config is not None else ForestConfig()
        self.every_seconds = self.config.every_seconds

    def prepare_pool(self, frame: PoolFrame, now: float) -> Offload[_Outcome]:
        end = judged_until(frame, now)
        window = window_copy(frame, end, self.config)
        config, pool = self.config, frame.name  # frozen settings and a str: safe to share
        return Offload(compute=lambda: _judge(window, end, config, pool), finish=_finish)


def _finish(outcome: _Outcome) -> dict[str, list[Finding]]:
    for extra in outcome.outliers:
        log.info("forest outlier", extra=extra)
    return outcome.nodes


def _judge(window: FrameWindow, end: float, c: ForestConfig, pool: str) -> _Outcome:
    """Findings for every node of the copied window, judged up to ``end`` (empty lists where
    nothing stands out). Reads nothing but its arguments: it runs in the service's worker thread."""
    v = vectors_of(window, end, c)
    out: dict[str, list[Finding]] = {n: [] for n in v.nodes}
    outliers: list[dict[str, object]] = []
    n = v.rows.shape[0]
    pool_nodes = int(np.unique(v.rows[:, 0]).size) if n else 0
    if n < c.min_gpus or pool_nodes < c.min_nodes or not v.features:
        return _Outcome(out, ())
    scores = forest_scores(v.z, c)
    median = float(np.median(scores))
    mad = float(np.median(np.abs(scores - median)))
    threshold = max(c.min_score, median + c.score_mads * MAD_SCALE * mad)
    distance = robust_distance(v.z)
    distance_line = distance_gate(distance, c.healthy_exceedances, c.min_distance)
    flagged = np.nonzero((scores >= threshold) & (distance >= distance_line))[0]
    for i in flagged:
        node = v.nodes[int(v.rows[i, 0])]
        out[node].append(
            _finding(
                v,
                c,
                i=int(i),
                score=float(scores[i]),
                threshold=threshold,
                distance=float(distance[i]),
                distance_line=distance_line,
                pool=pool,
                pool_nodes=pool_nodes,
            )
        )
        outliers.append(
            {
                "node": node,
                "gpu": int(v.rows[i, 1]),
                "pool": pool,
                "score": float(scores[i]),
                "threshold": threshold,
                "distance": float(distance[i]),
                "distance_line": distance_line,
            }
        )
    return _Outcome(out, tuple(outliers))


def forest_scores(z: Float, c: ForestConfig) -> Float:
    """Anomaly scores in (0, 1] (higher is easier to isolate) from a forest fitted on the pool."""
    rng = np.random.default_rng(c.seed)
    fit = z
    if z.shape[0] > c.max_fit_samples:
        fit = z[np.sort(rng.choice(z.shape[0], c.max_fit_samples, replace=False))]
    forest = IsolationForest(n_estimators=c.n_estimators, contamination="auto", random_state=c.seed)
    forest.fit(fit)
    scores: Float = -forest.score_samples(z)
    return scores


def _finding(
    v: PoolVectors,
    c: ForestConfig,
    *,
    i: int,
    score: float,
    threshold: float,
    distance: float,
    distance_line: float,
    pool: str,
    pool_nodes: int,
) -> Finding:
    gpu = int(v.rows[i, 1])
    z = v.z[i]
    # Largest |z| first; ties by feature order so the same input always reads the same.
    order = sorted(range(len(v.features)), key=lambda j: (-abs(float(z[j])), j))[: c.top_features]
    drivers = []
    parts = []
    for j in order:
        f = v.features[j]
        zz = float(z[j])
        value, med = float(v.values[i, j]), float(v.median[j])
        direction = "high" if zz > 0 else "low"
        drivers.append(
            {
                "feature": f.key,
                "value": None if np.isnan(value) else round(value, 4),
                "pool_median": round(med, 4),
                "mads": round(zz, 2),
                "direction": direction,
            }
        )
        shown = "n/a" if np.isnan(value) else _fmt(value, f.digits)
        parts.append(f"{f.label} {shown} {f.unit} ({zz:+.1f} MADs, pool {_fmt(med, f.digits)})")
    summary = (
        f"GPU {gpu} unlike the {v.rows.shape[0]} loaded GPUs of pool {pool} taken together "
        f"(isolation score {score:.2f}, threshold {threshold:.2f}): " + "; ".join(parts)
    )
    return Finding(
        detector=ForestConfig.name,
        key=f"forest:gpu{gpu}",
        severity="warning",
        action="alert",
        summary=summary,
        since=v.window_start,
        evidence={
            "gpu": gpu,
            "score": round(score, 4),
            "threshold": round(threshold, 4),
            "distance": round(distance, 2),
            "distance_line": round(distance_line, 2),
            "features": drivers,
            "all_mads": {f.key: round(float(z[j]), 2) for j, f in enumerate(v.features)},
            "loaded_slots": int(v.loaded_slots[i]),
            "pool": pool,
            "peers": int(v.rows.shape[0]),
            "peer_nodes": pool_nodes,
            "seed": c.seed,
        },
    )
