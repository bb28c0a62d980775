"""The ``probes:`` section of the aggregator's configuration: what the probe scheduler runs, how
often, and how much of the fleet and its network it may take (docs/probes.md, "Scheduling").

Defaults are sized for a 7,500-node fleet of 8-GPU nodes in 16-node leaves: a 10-minute round
keeps each node in one pair probe per round, so a leaf's 120 pairs are all covered in 15 rounds
(2.5 hours, a little more with the cross-leaf rounds), well inside ``coverage_bound_seconds``.
"""

from __future__ import annotations

from aggregator.config import LocalKind, PairKind, ProbesConfig

__all__ = ["LocalKind", "PairKind", "ProbesConfig"]
