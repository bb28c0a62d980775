"""The aggregator's own Prometheus metrics: ingestion, the fleet's states, decisions, detection.

Everything lives on a ``CollectorRegistry`` passed in, never prometheus_client's global one, so
tests (and two aggregators in one process) do not share counters.

The service calls the ingest methods; the pipeline and the decision log call ``decision`` and the
service's periodic task ``detection_cycle``. ``gpuwarden_aggregator_nodes{state}`` is read from the
pipeline at scrape time by a custom collector, so it can never drift from the pipeline's truth;
so are the per-detector runs, run time and errors (``gpuwarden_detector_*_total{detector}``, from
``Pipeline.detector_stats``), as node_exporter exports them per collector.

Label values come from closed sets (rejection reasons, node states, detectors), which keeps
cardinality fixed whatever the fleet sends: no node name is ever a label here, with one bounded
exception: the job-data tables (``gpuwarden_job_*``), read at scrape time from the job localizer
(``aggregator.detect.jobs``), are top-N lists (``detectors.jobs.top_n`` series per family, never
one per communicator), and name the job, communicator and node that each row is about.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Final, Protocol, runtime_checkable

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

log = logging.getLogger(__name__)

__all__ = [
    "DETECTOR_FAMILIES",
    "JOB_FAMILIES",
    "NODE_STATES",
    "REJECT_REASONS",
    "TOKEN_REVIEW_RESULTS",
    "JobTable",
    "Metrics",
    "ReportsJobs",
]

# Every reason code the ingest endpoint can answer with; each starts at 0 so a dashboard's rate()
# sees the first rejection of a kind instead of a series appearing out of nowhere.
REJECT_REASONS: Final = (
    "missing_token",
    "bad_token",
    "duplicate_authorization",
    "forbidden",
    "node_mismatch",
    "node_unbound",
    "auth_unavailable",
    "unsupported_media_type",
    "unsupported_encoding",
    "body_too_large",
    "incomplete_body",
    "decompressed_too_large",
    "bad_gzip",
    "bad_json",
    "bad_msgpack",
    "wrong_schema_version",
    "schema_violation",
    "implausible_value",
    "over_cap",
    "body_timeout",
    "overloaded",
    "too_many_requests",
    "internal_error",
)

# Always exported (0 when empty), so "no quarantined nodes" is a sample, not a missing series.
NODE_STATES: Final = ("healthy", "suspect", "quarantined", "probation")

TOKEN_REVIEW_RESULTS: Final = ("cached", "authenticated", "denied", "error")

# Ingest, and most collections, are sub-millisecond when healthy; the upper buckets catch a stall.
_INGEST_BUCKETS: Final = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)
# One detection cycle runs once a second, so anything near 1 s means detection is falling behind.
LOOP_LAG_WINDOW_SECONDS: Final = 60.0  # the exported worst event-loop lag is over this long
_CYCLE_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _NodeStates(Collector):
    """``gpuwarden_aggregator_nodes{state}``, read from the pipeline when scraped."""

    def __init__(self, source: Callable[[], Mapping[str, int]]) -> None:
        self._source = source

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily(
            "gpuwarden_aggregator_nodes",
            "Nodes the aggregator knows, by health state.",
            labels=["state"],
        )
        try:
            counts = dict(self._source())
        except Exception:
            # A scrape must never fail because of the pipeline: the other metrics still matter,
            # and a missing family is an alertable absence.
            log.exception("reading node states for /metrics failed")
            return []
        for state in NODE_STATES:
            family.add_metric([state], float(counts.pop(state, 0)))
        for state, count in sorted(counts.items()):
            family.add_metric([str(state)], float(count))
        return [family]

    def describe(self) -> Iterable[Metric]:
        # Describing without collecting keeps registration from calling into the pipeline.
        return [GaugeMetricFamily("gpuwarden_aggregator_nodes", "", labels=["state"])]


@dataclass(frozen=True)
class DetectorStats:
    """One detector's counts so far, as the pipeline keeps them."""

    detector: str
    runs: int
    seconds: float  # the time of all its runs together
    errors: int  # exceptions from any of its hooks (observe, run, forget)


# Per detector, as node_exporter exports per collector.
DETECTOR_FAMILIES: Final = (
    "gpuwarden_detector_runs_total",
    "gpuwarden_detector_duration_seconds_total",
    "gpuwarden_detector_errors_total",
)


class _Detectors(Collector):
    """``gpuwarden_detector_*{detector}``, read from the pipeline's counts when scraped."""

    def __init__(self, source: Callable[[], Iterable[DetectorStats]]) -> None:
        self._source = source

    def _families(self) -> tuple[CounterMetricFamily, CounterMetricFamily, CounterMetricFamily]:
        # CounterMetricFamily appends "_total" to a counter's samples itself.
        return (
            CounterMetricFamily(
                DETECTOR_FAMILIES[0].removesuffix("_total"),
                "Runs of each detector (a failed run counts too).",
                labels=["detector"],
            ),
            CounterMetricFamily(
                DETECTOR_FAMILIES[1].removesuffix("_total"),
                "Time spent in each detector's runs.",
                labels=["detector"],
            ),
            CounterMetricFamily(
                DETECTOR_FAMILIES[2].removesuffix("_total"),
                "Exceptions raised by each detector (logged; the pipeline goes on without its answer).",
                labels=["detector"],
            ),
        )

    def collect(self) -> Iterable[Metric]:
        try:
            stats = tuple(self._source())
        except Exception:
            log.exception("reading detector counts for /metrics failed")
            return []
        runs, seconds, errors = self._families()
        for st in stats:
            runs.add_metric([st.detector], float(st.runs))
            seconds.add_metric([st.detector], st.seconds)
            errors.add_metric([st.detector], float(st.errors))
        return [runs, seconds, errors]

    def describe(self) -> Iterable[Metric]:
        return list(self._families())


@dataclass(frozen=True)
class JobTable:
    """What a job-data detector's last run saw, as top-N lists (each already cut to N)."""

    # (job, the median bus bandwidth of its inter-node communicators in GB/s, its level: its
    # single-node communicators' bandwidth over their class's), the slowest jobs first
    jobs: tuple[tuple[str, float, float], ...] = ()
    # (job, communicator, collective, nnodes, bandwidth over its job's level), slowest first
    communicators: tuple[tuple[str, str, str, int, float], ...] = ()
    # (job, node, communicator, rank, how much longer the others' kernels took), worst first
    stragglers: tuple[tuple[str, str, str, int, float], ...] = ()


@runtime_checkable
class ReportsJobs(Protocol):
    """A detector with job-data tables (the job localizer); the pipeline asks those that have it."""

    def job_table(self) -> JobTable: ...


JOB_FAMILIES: Final = (
    "gpuwarden_job_busbw_gigabytes_per_second",
    "gpuwarden_job_level_ratio",
    "gpuwarden_job_communicator_ratio",
    "gpuwarden_job_straggler_wait_ratio",
)


class _Jobs(Collector):
    """``gpuwarden_job_*``: the job localizer's top-N tables, read when scraped. The job is the
    ``workload`` label (``job`` is Prometheus's own target label), the node ``host`` (``node``
    is the PodMonitor's)."""

    def __init__(self, source: Callable[[], Iterable[JobTable]]) -> None:
        self._source = source

    def _families(self) -> tuple[GaugeMetricFamily, ...]:
        return (
            GaugeMetricFamily(
                JOB_FAMILIES[0],
                "Median bus bandwidth of a job's inter-node communicators over the job localizer's window "
                "(the jobs whose level is lowest, detectors.jobs.top_n of them).",
                labels=["workload"],
            ),
            GaugeMetricFamily(
                JOB_FAMILIES[1],
                "A job's level: its single-node communicators' bandwidth over their class's across the "
                "fleet (under 1: slow everywhere, its workload; nothing is blamed for it).",
                labels=["workload"],
            ),
            GaugeMetricFamily(
                JOB_FAMILIES[2],
                "The slowest inter-node communicators: bandwidth over their job's level (top-N).",
                labels=["workload", "communicator", "collective", "nnodes"],
            ),
            GaugeMetricFamily(
                JOB_FAMILIES[3],
                "Ranks the others wait for: how much longer the others' kernels took than its own (top-N).",
                labels=["workload", "host", "communicator", "rank"],
            ),
        )

    def collect(self) -> Iterable[Metric]:
        try:
            tables = tuple(self._source())
        except Exception:
            log.exception("reading job tables for /metrics failed")
            return []
        busbw, level, comms, late = self._families()
        for t in tables:
            for job, gbs, ratio in t.jobs:
                busbw.add_metric([job], gbs)
                level.add_metric([job], ratio)
            for job, comm, collective, nnodes, ratio in t.communicators:
                comms.add_metric([job, comm, collective, str(nnodes)], ratio)
            for job, host, comm, rank, wait in t.stragglers:
                late.add_metric([job, host, comm, str(rank)], wait)
        return [busbw, level, comms, late]

    def describe(self) -> Iterable[Metric]:
        return list(self._families())


class Metrics:
    """The aggregator's metric families, registered on ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._accepted = Counter(
            "gpuwarden_aggregator_reports_accepted_total",
            "Reports accepted and handed to the detection pipeline.",
            registry=registry,
        )
        self._rejected = Counter(
            "gpuwarden_aggregator_reports_rejected_total",
            "Reports refused, by reason code (the error field of the 4xx/5xx answer).",
            labelnames=["reason"],
            registry=registry,
        )
        self._duplicate = Counter(
            "gpuwarden_aggregator_reports_duplicate_total",
            "Reports delivered again (same node, boot_id and seq): answered 200, not processed twice.",
            registry=registry,
        )
        self._ingest = Histogram(
            "gpuwarden_aggregator_ingest_seconds",
            "Time to process one report once its body has arrived: decompress, decode, check, ingest.",
            buckets=_INGEST_BUCKETS,
            registry=registry,
        )
        self._decisions = Counter(
            "gpuwarden_aggregator_decisions_total",
            "Health decisions recorded, by the detector that caused them and the state entered.",
            labelnames=["detector", "state"],
            registry=registry,
        )
        self._cycle = Histogram(
            "gpuwarden_aggregator_detection_cycle_seconds",
            "Time of one periodic detection cycle (silence and fleet-wide detectors).",
            buckets=_CYCLE_BUCKETS,
            registry=registry,
        )
        self._loop_lag = Histogram(
            "gpuwarden_aggregator_event_loop_lag_seconds",
            "How much later than asked a short periodic sleep on the event loop woke up: how long "
            "a request or a Lease renewal may have waited behind other work on the loop.",
            buckets=_CYCLE_BUCKETS,
            registry=registry,
        )
        self._loop_lag_max = Gauge(
            "gpuwarden_aggregator_event_loop_lag_max_seconds",
            f"The largest event-loop lag sampled in the last {LOOP_LAG_WINDOW_SECONDS:.0f} s.",
            registry=registry,
        )
        self._heap_trim = Histogram(
            "gpuwarden_aggregator_heap_trim_seconds",
            "Time of one hand-back of the heap's free memory to the system (malloc_trim, in a worker "
            "thread; aggregator/heap.py).",
            buckets=_CYCLE_BUCKETS,
            registry=registry,
        )
        self._collections = Histogram(
            "gpuwarden_aggregator_gc_collection_seconds",
            "Time of one cycle-collector collection, by generation (0: youngest, 2: full); the event "
            "loop waits each one out (aggregator/heap.py).",
            labelnames=["generation"],
            buckets=_INGEST_BUCKETS,
            registry=registry,
        )
        for generation in range(len(gc.get_count())):  # CPython's generations, each exported from 0
            self._collections.labels(generation=str(generation))
        self._heap_released = Counter(
            "gpuwarden_aggregator_heap_trim_released_bytes_total",
            "Resident memory the heap trims gave back to the system.",
            registry=registry,
        )
        self._cycle_failures = Counter(
            "gpuwarden_aggregator_detection_cycle_failures_total",
            "Periodic detection cycles that raised (logged; the next cycle runs anyway).",
            registry=registry,
        )
        self._token_reviews = Counter(
            "gpuwarden_aggregator_token_reviews_total",
            "Bearer tokens checked with the Kubernetes TokenReview API, by result "
            "(cached: answered from the cache, no API call).",
            labelnames=["result"],
            registry=registry,
        )
        for reason in REJECT_REASONS:
            self._rejected.labels(reason=reason)
        for result in TOKEN_REVIEW_RESULTS:
            self._token_reviews.labels(result=result)
        self._node_states: _NodeStates | None = None

    def watch_node_states(self, source: Callable[[], Mapping[str, int]]) -> None:
        """Export ``gpuwarden_aggregator_nodes{state}`` from ``source`` at every scrape (once)."""
        if self._node_states is not None:
            raise ValueError("node states are already exported from another source")
        self._node_states = _NodeStates(source)
        self.registry.register(self._node_states)

    def shard(self, index: int, shards: int) -> None:
        """Export ``gpuwarden_shard_info{shard, shards}`` (1): which shard this replica is, "0" of
        "1" unsharded (the recording rules count each shard's nodes once and sum the shards by
        it), and ``gpuwarden_shards``, the number of shards as a value (GpuwardenAggregatorShardDown
        compares the shards that answer with it; PromQL cannot read a number from a label)."""
        Gauge(
            "gpuwarden_shard_info",
            "1, labelled with this replica's shard and the number of shards",
            ["shard", "shards"],
            registry=self.registry,
        ).labels(str(index), str(shards)).set(1)
        Gauge(
            "gpuwarden_shards",
            "The number of shards this replica runs with (sharding.shards; 1 unsharded)",
            registry=self.registry,
        ).set(shards)

    def watch_detectors(self, source: Callable[[], Iterable[DetectorStats]]) -> None:
        """Export ``gpuwarden_detector_{runs,duration_seconds,errors}_total{detector}`` from
        ``source`` (the pipeline's ``detector_stats``) at every scrape."""
        self.registry.register(_Detectors(source))

    def watch_jobs(self, source: Callable[[], Iterable[JobTable]]) -> None:
        """Export ``gpuwarden_job_*`` from ``source`` (the pipeline's ``job_tables``) at every scrape."""
        self.registry.register(_Jobs(source))

    def accepted(self) -> None:
        self._accepted.inc()

    def duplicate(self) -> None:
        self._duplicate.inc()

    def rejected(self, reason: str) -> None:
        self._rejected.labels(reason=reason).inc()

    def ingest_seconds(self, seconds: float) -> None:
        self._ingest.observe(seconds)

    def decision(self, detector: str, state: str) -> None:
        """One decision record written: ``detector`` of its first reason, ``state`` entered."""
        self._decisions.labels(detector=detector, state=state).inc()

    def detection_cycle(self, seconds: float, *, failed: bool = False) -> None:
        self._cycle.observe(seconds)
        if failed:
            self._cycle_failures.inc()

    def loop_lag(self, seconds: float, *, worst_recent: float) -> None:
        self._loop_lag.observe(seconds)
        self._loop_lag_max.set(worst_recent)

    def heap_trim(self, seconds: float, released_bytes: int) -> None:
        self._heap_trim.observe(seconds)
        self._heap_released.inc(released_bytes)

    def collection(self, generation: int, seconds: float) -> None:
        self._collections.labels(generation=str(generation)).observe(seconds)

    def token_review(self, result: str) -> None:
        self._token_reviews.labels(result=result).inc()
