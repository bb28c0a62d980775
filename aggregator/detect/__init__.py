"""The detectors the pipeline runs (see ``base.Detector``): one ``DetectorSpec`` each.

``DETECTORS`` is the explicit list. Each entry names the detector's settings type (whose ``name``
is the detector's name: its findings' source and its key under ``detectors:`` in the config file)
and the factory that makes it from those settings. Adding a detector is a module and a line here.

``SOURCES`` is every name a finding's ``detector`` can have: the few sources built into the
pipeline, then the detectors in the order they run.
"""

from __future__ import annotations

from typing import Any, Final

from aggregator.detect.base import Detector, DetectorSpec, PoolDetector, Verdict, detectors_section
from aggregator.detect.forest import ForestConfig, ForestDetector
from aggregator.detect.jobs import JobConfig, JobLocalizer
from aggregator.detect.links import LinkConfig, LinkLocalizer
from aggregator.detect.localprobe import LocalProbeConfig, LocalProbeDetector
from aggregator.detect.peers import PeerConfig, PeerDetector
from aggregator.detect.ports import PortsConfig, PortsDetector
from aggregator.detect.trend import TrendConfig, TrendDetector

# Run in this order, each on its own period. The forest only ever raises suspicion (action
# "alert"); a quarantine needs evidence of one kind that persists (docs/detection.md).
DETECTORS: Final[tuple[DetectorSpec[Any], ...]] = (
    DetectorSpec(PeerConfig, PeerDetector),
    DetectorSpec(TrendConfig, TrendDetector),
    DetectorSpec(ForestConfig, ForestDetector),
    DetectorSpec(LinkConfig, LinkLocalizer),  # pair probes: a slow node, a degraded link, a switch
    DetectorSpec(LocalProbeConfig, LocalProbeDetector),  # local all-reduce probes against the pool
    DetectorSpec(JobConfig, JobLocalizer),  # the jobs' own collectives (NCCL Inspector): GPU, NIC, link
    DetectorSpec(PortsConfig, PortsDetector),  # RDMA ports down, gone or slow where the pool's are up
)

# Sources of findings built into the pipeline: the rule engine and the silence detector.
BUILTIN_SOURCES: Final = ("rule", "silence")
SOURCES: Final[tuple[str, ...]] = BUILTIN_SOURCES + tuple(d.name for d in DETECTORS)

__all__ = [
    "BUILTIN_SOURCES",
    "DETECTORS",
    "SOURCES",
    "Detector",
    "DetectorSpec",
    "PoolDetector",
    "Verdict",
    "detectors_section",
]
