"""Snapshots of the agent's own state, shared by the runner, the shipper and the metrics endpoint.

All frozen: the metrics endpoint reads whatever snapshot is current while the next cycle builds a
new one, so a scrape never sees half a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.report import Report


@dataclass(frozen=True)
class CollectorStatus:
    name: str
    supported: bool
    reason: str  # why unsupported, or the failure message; "" when it worked
    success: bool  # supported and collect() raised nothing (partial errors still count as success)
    duration_seconds: float


@dataclass(frozen=True)
class CycleResult:
    report: Report
    statuses: tuple[CollectorStatus, ...]


@dataclass(frozen=True)
class ShipperStats:
    sent_total: int = 0  # reports the aggregator accepted (2xx)
    rejected_total: int = 0  # reports the aggregator refused for good (4xx other than 408/429): not retried
    failed_attempts_total: int = 0  # POSTs that failed (network error, timeout, 5xx, 408, 429)
    spooled_total: int = 0  # reports put in the spool
    dropped_total: int = 0  # reports dropped because the spool was full (oldest first)
    spool_depth: int = 0  # reports waiting now
    last_success_time: float | None = None  # unix seconds
