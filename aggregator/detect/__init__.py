"""Fleet-wide detectors that run on a tick over the pool frames (see ``base.Detector``).

``DETECTORS`` is the explicit list the pipeline builds its detectors from: one factory each,
called with no arguments (every parameter has a documented default, see docs/detection.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from aggregator.detect.base import Detector
from aggregator.detect.forest import ForestDetector
from aggregator.detect.peers import PeerDetector
from aggregator.detect.trend import TrendDetector

# The forest only ever raises suspicion (action "alert"); a quarantine needs evidence of one kind
# that persists (docs/detection.md, "Multivariate model").
DETECTORS: Final[tuple[Callable[[], Detector], ...]] = (PeerDetector, TrendDetector, ForestDetector)

__all__ = ["DETECTORS", "Detector", "ForestDetector", "PeerDetector", "TrendDetector"]
