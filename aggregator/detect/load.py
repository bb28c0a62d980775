"""When a GPU counts as loaded for a thermal comparison: busy, and busy long enough to have settled.

A GPU that started a job a minute ago is still heating up: its heat sink takes minutes to reach
its temperature at the new power (the die's thermal time constant is about a minute and a half,
the sink's longer). Compared with settled peers it looks colder; compared with its own settled
past it looks like a drift. Both the multivariate model and the trend detector's drift check
count a slot as loaded only once the GPU was busy in every slot of the settling time before it.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

Bool = npt.NDArray[np.bool_]


def settled(busy: Bool, settle_slots: int) -> Bool:
    """``busy`` (slots first) where the same lane was also busy in each of the ``settle_slots``
    slots before; the first ``settle_slots`` slots cannot vouch for themselves and are False."""
    if settle_slots <= 0:
        return busy.copy()
    run = np.cumsum(busy, axis=0, dtype=np.int64)
    pad = np.zeros((settle_slots + 1, *busy.shape[1:]), np.int64)
    before = np.concatenate([pad, run], axis=0)[: busy.shape[0]]
    enough = (np.arange(busy.shape[0]) >= settle_slots).reshape((-1,) + (1,) * (busy.ndim - 1))
    out: Bool = busy & (run - before >= settle_slots + 1) & enough
    return out
