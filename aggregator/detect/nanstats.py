"""NaN-ignoring reductions without numpy's RuntimeWarnings, for code that runs off the main thread.

``np.nanmean`` warns on an all-NaN lane ("Mean of empty slice"), and silencing it takes
``warnings.catch_warnings``, which swaps process-wide state and is not thread-safe: in a worker
thread (``aggregator.detect.base.Offload``) it can leave the loop's warning filters wrong. Every
detector's NaN-ignoring median and mean are these.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

Float = npt.NDArray[np.float64]


def nanmean(a: npt.NDArray[np.floating], axis: int) -> Float:
    """``np.nanmean(a, axis=axis)`` (the same sums, so the same bits), NaN where a lane is all NaN,
    without the warning."""
    x = np.asarray(a, np.float64)
    missing = np.isnan(x)
    count = (~missing).sum(axis=axis)
    total = np.where(missing, 0.0, x).sum(axis=axis)
    out: Float = np.where(count > 0, total / np.maximum(count, 1), np.nan)
    return out


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
