"""Fleet-wide detectors that run on a tick over the pool frames (see ``base.Detector``).

``DETECTORS`` is the explicit list the pipeline builds its detectors from: one factory each,
called with no arguments (every parameter has a documented default, see docs/detection.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from aggregator.detect.base import Detector
from aggregator.detect.peers import PeerDetector
from aggregator.detect.trend import TrendDetector

# TrendDetector is built and tested but not enabled yet: its temperature-drift check raised a
# false alert on a healthy node of gpuwarden.tracegen's fleet (a GPU moving between loads with
# little change in power), and it needs to be checked against the simulator before it runs.
DETECTORS: Final[tuple[Callable[[], Detector], ...]] = (PeerDetector,)

__all__ = ["DETECTORS", "Detector", "PeerDetector", "TrendDetector"]
