"""Probe coverage and activity for Prometheus, computed from the scheduler at scrape time.

One collector on an injected ``CollectorRegistry`` (never the global one). Nothing here is a
series per node: at 7,500 nodes "seconds since each node was last tested" is summarized as
quantiles and a count of nodes past the bound, which is what an alert needs::

    gpuwarden_probe_node_untested_seconds{quantile="0.5"|"0.99"|"1"}   1 is the maximum
    gpuwarden_probe_nodes_overdue                 nodes untested longer than coverage_bound_seconds
    gpuwarden_probe_coverage_bound_seconds        that bound, so a rule need not repeat it
    gpuwarden_probe_pair_coverage_ratio{pool}     share of in-group pairs tested within the bound
    gpuwarden_probe_assignments_total{kind,reason}
    gpuwarden_probe_results_total{kind,ok}        each measurement once (not once per end)
    gpuwarden_probe_in_flight

Counters for every kind and reason are exported from the start (0), so ``rate()`` sees the first
one. A failing scheduler call is logged and its families left out of that scrape: the other
metrics on the registry still matter, and an absent series is itself alertable.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Final, get_args

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from agent.probes.protocol import ProbeKind
from aggregator.probes.scheduler import REASONS, ProbeScheduler

log = logging.getLogger(__name__)

__all__ = ["QUANTILES", "ProbeMetrics", "quantile"]

QUANTILES: Final = (0.5, 0.99, 1.0)
_KINDS: Final[tuple[str, ...]] = get_args(ProbeKind)


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """The nearest-rank quantile of already sorted values (q=1 is the maximum); NaN if empty."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


class _ProbeCollector(Collector):
    def __init__(self, scheduler: ProbeScheduler, clock: Callable[[], float]) -> None:
        self._scheduler = scheduler
        self._clock = clock

    def collect(self) -> Iterable[Metric]:
        try:
            return self._families()
        except Exception:
            log.exception("reading probe coverage for /metrics failed")
            return []

    def _families(self) -> list[Metric]:
        s = self._scheduler
        cov = s.coverage(self._clock())
        untested = GaugeMetricFamily(
            "gpuwarden_probe_node_untested_seconds",
            "Seconds since nodes were last tested ok by a probe (since first seen if never), as quantiles "
            "over the nodes; quantile 1 is the longest.",
            labels=["quantile"],
        )
        values = sorted(cov.node_untested_seconds.values())
        for q in QUANTILES:
            untested.add_metric([f"{q:g}"], quantile(values, q) if values else 0.0)
        overdue = GaugeMetricFamily(
            "gpuwarden_probe_nodes_overdue",
            "Nodes not tested ok by a probe within the coverage bound.",
            value=float(cov.nodes_overdue),
        )
        bound = GaugeMetricFamily(
            "gpuwarden_probe_coverage_bound_seconds",
            "The coverage bound: a node or pair untested for longer is overdue.",
            value=cov.bound_seconds,
        )
        ratio = GaugeMetricFamily(
            "gpuwarden_probe_pair_coverage_ratio",
            "Share of the pairs within each leaf (else rack) group tested ok within the coverage bound.",
            labels=["pool"],
        )
        for pool, value in cov.pool_ratios().items():
            ratio.add_metric([pool], value)
        assignments = CounterMetricFamily(
            "gpuwarden_probe_assignments_total",
            "Probes planned, by kind and why: rotation, confirm (re-probe of a suspicious result), "
            "preflight, local.",
            labels=["kind", "reason"],
        )
        planned = dict(s.assignments_total)
        for kind in _KINDS:
            for reason in REASONS:
                assignments.add_metric([kind, reason], float(planned.get((kind, reason), 0)))
        results = CounterMetricFamily(
            "gpuwarden_probe_results_total",
            "Probe results received (each measurement once, though both ends of a pair report it).",
            labels=["kind", "ok"],
        )
        got = dict(s.results_total)
        for kind in _KINDS:
            for ok in (True, False):
                results.add_metric([kind, str(ok).lower()], float(got.get((kind, ok), 0)))
        in_flight = GaugeMetricFamily(
            "gpuwarden_probe_in_flight", "Probes planned and not yet over.", value=float(s.in_flight_count)
        )
        return [untested, overdue, bound, ratio, assignments, results, in_flight]

    def describe(self) -> Iterable[Metric]:
        # Describing without collecting keeps registration from computing coverage.
        return [
            GaugeMetricFamily("gpuwarden_probe_node_untested_seconds", "", labels=["quantile"]),
            GaugeMetricFamily("gpuwarden_probe_nodes_overdue", ""),
            GaugeMetricFamily("gpuwarden_probe_coverage_bound_seconds", ""),
            GaugeMetricFamily("gpuwarden_probe_pair_coverage_ratio", "", labels=["pool"]),
            CounterMetricFamily("gpuwarden_probe_assignments", "", labels=["kind", "reason"]),
            CounterMetricFamily("gpuwarden_probe_results", "", labels=["kind", "ok"]),
            GaugeMetricFamily("gpuwarden_probe_in_flight", ""),
        ]


class ProbeMetrics:
    """Registers the probe families on ``registry``; ``clock`` gives the aggregator's time at
    scrape (coverage is "seconds since", so it needs now)."""

    def __init__(
        self, registry: CollectorRegistry, scheduler: ProbeScheduler, clock: Callable[[], float]
    ) -> None:
        self.registry = registry
        registry.register(_ProbeCollector(scheduler, clock))
