"""Fleet-wide detectors that run on a tick over the pool frames (see ``base.Detector``).

``DETECTORS`` is the explicit list the pipeline builds its detectors from: one factory each,
called with no arguments (every parameter has a documented default, see docs/detection.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Final

from aggregator.detect.base import Detector
from aggregator.detect.forest import ForestDetector
from aggregator.detect.peers import PeerDetector
from aggregator.detect.trend import TrendConfig, TrendDetector


def _trend_bursts_only() -> TrendDetector:
    """The trend detector's error-burst checks. Its temperature-drift check stays off: a GPU still
    heating up after its job started (thermal lag at constant power) looks like a drift to it and
    raised a false alert on a healthy simulated node; it needs to wait out the settling time."""
    return TrendDetector(TrendConfig(drift_celsius=math.inf))


# The forest only ever raises suspicion (action "alert"); a quarantine needs evidence of one kind
# that persists (docs/detection.md, "Multivariate model").
DETECTORS: Final[tuple[Callable[[], Detector], ...]] = (PeerDetector, _trend_bursts_only, ForestDetector)

__all__ = ["DETECTORS", "Detector", "ForestDetector", "PeerDetector", "TrendDetector"]
