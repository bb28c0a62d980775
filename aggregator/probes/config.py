"""The ``probes:`` section of the aggregator's configuration: what the probe scheduler runs, how
often, and how much of the fleet and its network it may take (docs/probes.md, "Scheduling").

Defaults are sized for a 7,500-node fleet of 8-GPU nodes in 16-node leaves: a 10-minute round
keeps each node in one pair probe per round, so a leaf's 120 pairs are all covered in 15 rounds
(2.5 hours, a little more with the cross-leaf rounds), well inside ``coverage_bound_seconds``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from aggregator.config import PositiveSeconds, Ratio, _Section

__all__ = ["LocalKind", "PairKind", "ProbesConfig"]

PairKind = Literal["tcp_pair", "nccl_allreduce_pair"]
LocalKind = Literal["nccl_allreduce_local"]

Positive = Annotated[int, Meta(gt=0)]
NonNegative = Annotated[int, Meta(ge=0)]


class ProbesConfig(_Section, frozen=True):
    enabled: bool = True
    pair_kind: PairKind = "nccl_allreduce_pair"  # tcp_pair where nodes have no NCCL
    local_kind: LocalKind | None = "nccl_allreduce_local"  # None: no local probes
    pair_size_bytes: Positive = 1 << 30
    local_size_bytes: Positive = 1 << 30
    # Rotation: one pair probe per node per round; every Kth round pairs nodes of different
    # leaves of one pool (0: never), so inter-leaf links are tested too.
    round_seconds: PositiveSeconds = 600.0
    cross_group_every: NonNegative = 4
    local_every_seconds: PositiveSeconds = 3600.0
    # How agents see their work: they poll every poll_seconds, so a probe starts start_delay
    # after it is planned (both ends have fetched it by then) and gives up at its deadline.
    poll_seconds: PositiveSeconds = 10.0
    start_delay_seconds: Annotated[float, Meta(ge=0)] = 15.0
    pair_deadline_seconds: PositiveSeconds = 120.0
    local_deadline_seconds: PositiveSeconds = 120.0
    # Idle: every GPU under this utilization with at most this much memory in use.
    idle_utilization_ratio: Ratio = 0.05
    idle_memory_bytes: Annotated[int, Meta(ge=0)] = 1 << 30
    # Caps. A pair probe counts against the leaf (else rack) of each end and against the
    # bandwidth budget: the bytes of the pair probes started in any window of
    # bandwidth_window_seconds, divided by the window, stay under the budget.
    max_concurrent: Positive = 512
    max_concurrent_per_leaf: Positive = 8
    bandwidth_budget_bytes_per_second: Annotated[float, Meta(gt=0)] = 100e9
    bandwidth_window_seconds: PositiveSeconds = 60.0
    # Confirm re-probes (sim/fleet.py's _plan_confirms): a pair result under suspicious_ratio of
    # the pool's expected bandwidth, or a failed one, gets the pair again and fresh partners for
    # each end, within confirm_within_rounds rounds; at most max_pending_confirms per node.
    suspicious_ratio: Ratio = 0.7
    fresh_partners: NonNegative = 2
    confirm_within_rounds: Positive = 2
    max_pending_confirms: Positive = 3
    # Both ends report one measurement; the link localizer merges copies 30 s apart, so the
    # same pair is probed again only this much later.
    pair_again_after_seconds: Annotated[float, Meta(ge=0)] = 60.0
    # The pool's expected bandwidth: the median of this many recent ok results of a kind, once
    # there are at least expected_min_results of them.
    expected_results: Positive = 101
    expected_min_results: Positive = 5
    # Known-good partner for preflight: its last known_good_results results all ok and at least
    # known_good_ratio of the pool's expected bandwidth.
    known_good_results: Positive = 3
    known_good_ratio: Ratio = 0.9
    # Coverage: a node or pair not tested this long is overdue (metric and alert).
    coverage_bound_seconds: PositiveSeconds = 6 * 3600.0
    forget_after_seconds: PositiveSeconds = 3600.0  # a node not heard from this long leaves the rotation
    # The NCCL unique id is 128 bytes (256 hex characters); anything far bigger is not one.
    rendezvous_max_bytes: Positive = 1024
