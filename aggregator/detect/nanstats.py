"""NaN-ignoring reductions without numpy's RuntimeWarnings, for code that runs off the main thread.

``np.nanmean`` warns on an all-NaN lane ("Mean of empty slice"), and silencing it takes
``warnings.catch_warnings``, which swaps process-wide state and is not thread-safe: in a worker
thread (``aggregator.detect.base.Offload``) it can leave the loop's warning filters wrong. The
median of the same kind is ``aggregator.detect.peers.nanmedian``.
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
