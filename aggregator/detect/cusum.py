"""A one-sided CUSUM over the slots of a frame, vectorized over everything else.

Each slot brings a score ``z`` per cell (a GPU's robust z-score, signed so that "worse" is
positive). The statistic ``S_t = max(0, S_{t-1} + z_t - k)`` accumulates only what exceeds the
allowance ``k``: noise within ``k`` never adds up, a persistent deviation of ``d > k`` grows by
``d - k`` a slot and crosses a threshold ``h`` after ``h / (d - k)`` slots (Page, 1954). A cell
with no score in a slot (idle, not reported, too few peers) keeps its statistic unchanged: missing
data is neither evidence for nor against.

Besides the statistic, the accumulator keeps what a finding must say: the slot where the current
run (the statistic's latest departure from zero) began, and how many of the latest scored slots in
a row were calm (below ``k``), so that a deviation that has stopped is not reported for the minutes
the statistic takes to drain.

The design math lives here too, so that every threshold of a CUSUM follows from two stated numbers:
the allowance ``k`` (the deviation, in standard deviations, that must never accumulate) and the
wanted in-control average run length ``ARL0`` (slots between false alarms when the scores are
independent standard normal). Siegmund's approximation (Siegmund, *Sequential Analysis*, 1985,
eq. 2.56; Montgomery, *Introduction to Statistical Quality Control*, 6th ed., sec. 9.1.5) gives
the average run length of a one-sided normal CUSUM with allowance ``k`` and threshold ``h`` when the
scores have mean ``mu``, with ``delta = mu - k`` and ``b = h + 1.166``::

    ARL(mu) ~ (exp(-2 delta b) + 2 delta b - 1) / (2 delta^2)      (b^2 when delta = 0)

so ``ARL0 = ARL(0)`` is the run length between false alarms and ``ARL(mu)`` the expected delay
to detect a shift of ``mu``. It is accurate to a few per cent for ARL0 above ~100.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

Float = npt.NDArray[np.float64]
Int = npt.NDArray[np.int64]

# Siegmund's correction for the overshoot of a normal CUSUM past its threshold (1.166 = 2 * 0.583,
# 0.583 = -zeta(1/2)/sqrt(2 pi), the expected overshoot of a Gaussian random walk).
SIEGMUND_OVERSHOOT: Final = 1.166


def average_run_length(k: float, h: float, shift: float = 0.0) -> float:
    """Siegmund's approximation of the slots a one-sided normal CUSUM (allowance ``k``, threshold
    ``h``, both in standard deviations) takes to cross ``h`` when the scores are normal with mean
    ``shift`` and unit variance: ``shift = 0`` is the in-control ARL0 (slots between false alarms).
    """
    if k < 0 or h < 0:
        raise ValueError(f"average_run_length needs k >= 0 and h >= 0; got k={k}, h={h}")
    delta = shift - k
    b = h + SIEGMUND_OVERSHOOT
    if abs(delta) < 1e-9:
        return b * b
    x = 2.0 * delta * b
    if -x > 700:  # exp overflows a float long before any ARL a fleet could observe
        return math.inf
    return (math.exp(-x) + x - 1.0) / (2.0 * delta * delta)


def threshold_for_arl(k: float, arl0: float) -> float:
    """The smallest threshold ``h`` whose in-control ARL (``average_run_length(k, h)``) is at least
    ``arl0`` slots. ARL0 grows monotonically with ``h``: bisection, to 1e-6."""
    if k <= 0 or arl0 <= 1:
        raise ValueError(f"threshold_for_arl needs k > 0 and arl0 > 1; got k={k}, arl0={arl0}")
    if average_run_length(k, 0.0) >= arl0:
        return 0.0
    lo, hi = 0.0, 1.0
    while average_run_length(k, hi) < arl0:
        lo, hi = hi, hi * 2
    while hi - lo > 1e-6:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if average_run_length(k, mid) < arl0 else (lo, mid)
    return hi


@dataclass(frozen=True)
class CusumResult:
    statistic: Float  # S after the last slot, per cell
    run_start: Int  # slot index where the current run began; -1 where S is 0
    calm: Int  # scored slots in a row, at the end, with z < k
    scored: Int  # slots with a score in the current run


def cusum(z: npt.NDArray[np.floating], allowance: float) -> CusumResult:
    """Run the CUSUM over axis 0 (slots) of ``z``; NaN means "no score in this slot"."""
    if z.ndim < 1:
        raise ValueError("cusum needs at least one axis of slots")
    shape = z.shape[1:]
    s = np.zeros(shape, np.float64)
    start = np.full(shape, -1, np.int64)
    calm = np.zeros(shape, np.int64)
    scored = np.zeros(shape, np.int64)
    for t in range(z.shape[0]):
        zt = z[t].astype(np.float64)
        has = ~np.isnan(zt)
        nxt = np.where(has, np.maximum(0.0, s + np.where(has, zt, 0.0) - allowance), s)
        began = has & (s == 0) & (nxt > 0)
        start = np.where(nxt == 0, -1, np.where(began, t, start))
        scored = np.where(nxt == 0, 0, scored + (has & (nxt > 0)))
        calm = np.where(has, np.where(zt < allowance, calm + 1, 0), calm)
        s = nxt
    return CusumResult(statistic=s, run_start=start, calm=calm, scored=scored)
