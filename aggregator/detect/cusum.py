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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Float = npt.NDArray[np.float64]
Int = npt.NDArray[np.int64]


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
