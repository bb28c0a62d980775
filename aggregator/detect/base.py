"""What every fleet-wide detector is to the pipeline: a name, a period, and a run over the frames.

The pipeline builds one of each entry of ``aggregator.detect.DETECTORS``, runs each every
``every_seconds`` of its clock, and hands each node's list to the health machine
(``HealthMachine.update(node, detector.name, findings, now)``). A detector answers for every node
it looked at, with an empty list where it sees nothing: that is how its earlier findings on a node
clear. A node it did not look at (not in any frame) keeps whatever it had until it is forgotten.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from aggregator.fleet.frame import FleetFrames
from aggregator.model import Finding


class Detector(Protocol):
    @property
    def name(self) -> str:
        """The detector's name as decision records spell it ("peer", "trend"): its findings' source."""
        ...

    @property
    def every_seconds(self) -> float:
        """How often the pipeline runs it, in seconds of the aggregator's clock."""
        ...

    def run(self, frames: FleetFrames, now: float) -> Mapping[str, list[Finding]]:
        """Findings per node, for every node looked at (an empty list clears its findings)."""
        ...
