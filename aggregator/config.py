"""The aggregator's configuration: one YAML file, every key with a default, validated at start.

Each part owns its section's type here so that a newcomer finds every knob in one place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Final, Literal

import msgspec
from msgspec import Meta

from aggregator.eventloop import EventLoopKind

PositiveSeconds = Annotated[float, Meta(gt=0)]
Ratio = Annotated[float, Meta(ge=0, le=1)]


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    pass


class IngestConfig(_Section, frozen=True):
    max_body_bytes: Annotated[int, Meta(gt=0)] = 1 << 20  # compressed body as received
    max_decompressed_bytes: Annotated[int, Meta(gt=0)] = 4 << 20  # gzip bomb guard
    # Per (boot_id, run) stream, the seqs below the newest that are still taken when they arrive
    # late; older ones are duplicates whatever their time (aggregator/ordering.py).
    duplicate_window: Annotated[int, Meta(gt=0, le=4096)] = 64
    # (boot_id, run) streams remembered per node: a boot and the agent restarts within it.
    streams_per_node: Annotated[int, Meta(gt=0, le=64)] = 4
    # What one node can hold, from the hardware: an HGX node has 8 GPUs (16 leaves room for the
    # 16-GPU boards), 18 NVLinks a GPU (NVLink 4 and 5), 8 compute RDMA ports, up to 4 DPU ports,
    # their IPoIB netdevs and a few Ethernet ports (32), and probes one or two partners at a
    # time (16 peers in one report is far beyond). A report over any is refused (422 over_cap):
    # the schema's own maxima (64 GPUs, 32 links, 256 NICs, 256 probes) are 16x what a node
    # has, and every key a node holds costs series for the whole history window.
    max_gpus: Annotated[int, Meta(gt=0, le=64)] = 16
    max_nvlinks_per_gpu: Annotated[int, Meta(gt=0, le=32)] = 18
    max_nics: Annotated[int, Meta(gt=0, le=256)] = 32
    max_probe_peers: Annotated[int, Meta(gt=0, le=256)] = 16


class FleetConfig(_Section, frozen=True):
    window_seconds: PositiveSeconds = 1800.0  # history kept per node and per pool
    interval_seconds: PositiveSeconds = 10.0  # expected report interval (slot width of the frames)
    max_gpus: Annotated[int, Meta(gt=0, le=64)] = 8


class HealthConfig(_Section, frozen=True):
    # Soft evidence must persist this long to quarantine, unless a sequential test decided it
    # (Finding.decided: its own accumulation is the persistence; aggregator/health.py).
    suspect_for_seconds: PositiveSeconds = 120.0
    clear_for_seconds: PositiveSeconds = 120.0  # suspect -> healthy once evidence is gone this long
    probation_seconds: PositiveSeconds = 1800.0  # quarantined -> probation -> healthy
    lemon_count: Annotated[int, Meta(ge=2)] = 3  # quarantines within lemon_window make a lemon
    lemon_window_seconds: PositiveSeconds = 7 * 86400.0


# A node silent this many report intervals is suspect, unless ``silence.silent_after_seconds``
# says otherwise: one late or lost report (two intervals' gap) is ordinary on a busy network, six
# in a row are not. It follows the interval so a fleet that reports every minute is not all called
# silent between two of its reports (60 s at the default 10 s interval).
SILENT_AFTER_INTERVALS: Final = 6


class SilenceConfig(_Section, frozen=True):
    # No report for this long: the node is suspect. Default: SILENT_AFTER_INTERVALS report
    # intervals (``after``), whatever fleet.interval_seconds is.
    silent_after_seconds: PositiveSeconds | None = None
    # A failure domain (rack/leaf) with at least this many silent nodes, or a pool with at least
    # this share silent, is one systemic problem, not many node problems.
    domain_min_nodes: Annotated[int, Meta(ge=2)] = 3
    pool_share: Ratio = 0.2
    # A node silent this long (and not taken out) is forgotten: decommissioned or renamed.
    forget_after_seconds: PositiveSeconds = 86400.0

    def after(self, interval_s: float) -> float:
        """Seconds without a report after which a node is silent, for a fleet reporting every
        ``interval_s``: the configured value, else ``SILENT_AFTER_INTERVALS`` intervals."""
        if self.silent_after_seconds is not None:
            return self.silent_after_seconds
        return SILENT_AFTER_INTERVALS * interval_s


class AuthConfig(_Section, frozen=True):
    """Kubernetes TokenReview of the agents' projected service-account tokens."""

    audience: str = "gpuwarden"  # audience of the agents' projected tokens
    agent_namespace: str = "gpuwarden"
    agent_service_account: str = "gpuwarden-agent"
    cache_seconds: Annotated[float, Meta(ge=0)] = 60.0
    # Who may read the API, /metrics and the status page (the viewer role): service accounts
    # (system:serviceaccount:NS:NAME) and groups; their tokens are reviewed for ``audience`` too.
    viewer_service_accounts: list[str] = msgspec.field(default_factory=list)
    viewer_groups: list[str] = msgspec.field(default_factory=list)


PageKind = Literal["held", "lemon", "systemic", "quarantined", "link"]
DEFAULT_RUNBOOK_BASE = "https://github.com/gpuwarden/gpuwarden/blob/main/docs/runbooks/"


class NotifyConfig(_Section, frozen=True):
    """The ``notify:`` section. Every notifier is off until its URL (or key) is set."""

    # The aggregator's address as on-call reaches it: alerts link to <external_url>/api/v1/nodes/<node>.
    external_url: str | None = None
    runbook_base_url: str = DEFAULT_RUNBOOK_BASE
    alertmanager_url: str | None = None  # e.g. http://alertmanager:9093 (POST /api/v2/alerts)
    webhook_url: str | None = None  # any receiver of JSON
    slack_webhook_url: str | None = None  # a Slack incoming webhook
    pagerduty_routing_key: str | None = None  # an Events API v2 integration key
    pagerduty_url: str = "https://events.pagerduty.com/v2/enqueue"
    # What pages (PagerDuty, severity=page); routine quarantines and links do not unless listed.
    page_on: tuple[PageKind, ...] = ("held", "lemon", "systemic")
    # Alertmanager forgets an alert that is not re-sent before its endsAt: firing alerts are
    # re-posted this often, with endsAt four periods ahead.
    resend_seconds: Annotated[float, Meta(gt=0)] = 60.0
    queue_size: Annotated[int, Meta(gt=0)] = 1000  # per notifier; the oldest entry goes first
    timeout_seconds: Annotated[float, Meta(gt=0)] = 10.0  # one HTTP request
    retry_initial_seconds: Annotated[float, Meta(gt=0)] = 1.0
    retry_max_seconds: Annotated[float, Meta(gt=0)] = 60.0
    slack_min_interval_seconds: Annotated[float, Meta(ge=0)] = 1.0  # Slack allows ~1 message/s


class LinksConfig(_Section, frozen=True):
    """The link state machine (aggregator/links.py). The localizer that finds slow links is a
    detector: its settings are ``detectors.link`` (aggregator/detect/links.py)."""

    # A degraded link returns to healthy after this long without slow results.
    link_clear_for_seconds: PositiveSeconds = 900.0


# -- detectors: each detector's settings (aggregator/detect/, docs/detection.md) ------------------


class DetectorSettings(_Section, frozen=True):
    """The base of every detector's settings. The detector's module declares the subclass (its
    ``name`` and its knobs with their defaults); ``aggregator.detect.DETECTORS`` lists it, and the
    ``detectors:`` section then has a key of that name. A check that spans fields belongs in the
    subclass's ``__post_init__`` (raise ValueError): the config file is then refused at start with
    the key path, as for any other bad value."""

    name: ClassVar[str]  # the detector's name: its findings' source, its key under detectors:
    every_seconds: PositiveSeconds = 30.0  # how often the pipeline runs it (the aggregator's clock)


class DetectorsSection(_Section, frozen=True):
    """The ``detectors:`` section: one field per entry of ``aggregator.detect.DETECTORS``, named
    after the detector, holding its settings (see ``DetectorsConfig``)."""

    def of(self, name: str) -> DetectorSettings:
        """The settings of the detector called ``name``."""
        found: Any = getattr(self, name, None)
        if not isinstance(found, DetectorSettings):
            raise KeyError(f"no detector called {name!r} in the detectors section")
        return found


if TYPE_CHECKING:
    DetectorsConfig = DetectorsSection
else:

    def __getattr__(name: str) -> Any:
        if name == "DetectorsConfig":
            return detectors_config()
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def detectors_config() -> type[DetectorsSection]:
    """The ``detectors:`` section's type, built from ``DETECTORS`` on first use. The detector
    modules import this one (their settings derive from ``DetectorSettings``, their frames from
    ``FleetConfig``), so it cannot import them while it loads; msgspec resolves ``Config``'s
    annotations only when it first converts one, and ``configload`` calls this first."""
    built = globals().get("DetectorsConfig")
    if built is None:
        from aggregator.detect import DETECTORS, detectors_section  # noqa: PLC0415 - see above

        built = detectors_section(DETECTORS)
        globals()["DetectorsConfig"] = built  # the name Config's annotation refers to
    return built


def _default_detectors() -> DetectorsSection:
    return detectors_config()()


TaintEffect = Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]


class LimitsConfig(_Section, frozen=True):
    """Safety limits, checked before every new quarantine (docs/remediation.md). Past one, the
    decision is recorded with action ``held``, nothing is tainted, and the breaker stays open until
    a human resets it."""

    max_pool_share: Ratio = 0.10  # of a pool's nodes out (quarantined or probation) at once
    min_pool_allowance: Annotated[int, Meta(ge=0)] = 1  # a small pool may still lose this many
    max_per_domain: Annotated[int, Meta(ge=1)] = 3  # nodes out in one rack, and in one leaf
    max_per_hour: Annotated[int, Meta(ge=1)] = 20  # new quarantines fleet-wide in any hour


class PreflightConfig(_Section, frozen=True):
    """Nodes join with the preflight taint (kubelet --register-with-taints) and lose it once they
    have passed; a failure turns it into a quarantine with the evidence."""

    enabled: bool = True
    taint_key: str = "gpuwarden.io/preflight"
    healthy_reports: Annotated[int, Meta(ge=1)] = 3  # clean reports in a row, at least
    min_seconds: Annotated[float, Meta(ge=0)] = 60.0  # spanning at least this long
    require_probes: bool = False  # also a passing local probe and pair probe (docs/probes.md)
    timeout_seconds: PositiveSeconds = 3600.0  # no verdict by then: an event, and the taint stays


class LeaderConfig(_Section, frozen=True):
    """coordination.k8s.io Lease election, with client-go's defaults."""

    lease_name: str = "gpuwarden-aggregator"
    namespace: str = "gpuwarden"
    lease_duration_seconds: PositiveSeconds = 15.0
    renew_deadline_seconds: PositiveSeconds = 10.0
    retry_period_seconds: PositiveSeconds = 2.0


class RemediationConfig(_Section, frozen=True):
    # off: no Kubernetes at all; dry-run: read the cluster, elect, log every write it would make,
    # write nothing to nodes; enforce: taint, untaint, conditions, events, annotations.
    mode: Literal["off", "dry-run", "enforce"] = "off"
    taint_key: str = "gpuwarden.io/unhealthy"
    condition_type: str = "GPUHealthy"
    managed_label: str = "gpuwarden.io/managed"  # "false" on a node: never touched
    annotation_prefix: str = "gpuwarden.io/"
    suspect_effect: Literal["PreferNoSchedule"] | None = None  # off by default
    allow_no_execute: bool = False  # rules asking for NoExecute get NoSchedule unless this is on
    max_no_execute_per_hour: Annotated[int, Meta(ge=0)] = 2  # eviction is rate-limited on its own
    override_cooldown_seconds: PositiveSeconds = 86400.0  # a human removed our taint: not again
    # Where Node events go, as the kubelet's do. Nothing else is possible: the API server refuses a
    # core/v1 Event about a cluster-scoped object (a Node) in any namespace but "default" (422,
    # "does not match event.namespace": legacyValidateEvent in k8s.io/kubernetes
    # pkg/apis/core/validation/events.go), so another value would lose every Event.
    events_namespace: Literal["default"] = "default"
    # API calls per second, all workers together, and the bucket's depth: kube-scheduler's own
    # client settings (50/100). A quarantine costs 4 calls (read, patch, condition, event), so
    # this is ~12 nodes/s: a 5 % storm of a 7,500-node cluster in ~35 s (docs/performance.md),
    # with at most 4 requests in flight (the workers): a few seats of API Priority and Fairness.
    qps: PositiveSeconds = 50.0
    burst: Annotated[int, Meta(ge=1)] = 100
    workers: Annotated[int, Meta(ge=1, le=64)] = 4
    queue_size: Annotated[int, Meta(ge=1)] = 20000  # nodes waiting for a write (one entry per node)
    resync_seconds: PositiveSeconds = 300.0  # full compare of wanted and actual state
    restore_grace_seconds: PositiveSeconds = 600.0  # restored evidence holds while detectors warm up
    limits: LimitsConfig = LimitsConfig()
    preflight: PreflightConfig = PreflightConfig()
    leader: LeaderConfig = LeaderConfig()


# -- probes: the scheduler of active probes (aggregator/probes/scheduler.py, docs/probes.md) ------
# Defaults are sized for a 7,500-node fleet of 8-GPU nodes in 16-node leaves: a 10-minute round
# keeps each node in one pair probe per round, so a leaf's 120 pairs are all covered in 15 rounds
# (2.5 hours, a little more with the cross-leaf rounds), well inside ``coverage_bound_seconds``.

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
    # Confirm re-probes: a pair result under suspicious_ratio of the pool's expected bandwidth, or
    # a failed one, gets the pair again and fresh partners for each end, within
    # confirm_within_rounds rounds; at most max_pending_confirms per node. The ratio is at or just
    # above the link localizer's slow line (LinkConfig.slow_line: sqrt(design_ratio) = 0.866 of
    # expected), so what it will count as slow evidence is confirmed (tests/test_probe_scheduler.py).
    suspicious_ratio: Ratio = 0.87
    fresh_partners: NonNegative = 2
    confirm_within_rounds: Positive = 2
    max_pending_confirms: Positive = 3
    # Both ends report one measurement; the link localizer merges copies up to 30 s apart
    # (LinkConfig.dedupe_seconds), so a re-probe of the same pair starts this much later.
    pair_again_after_seconds: Annotated[float, Meta(ge=0)] = 40.0
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


class ServerConfig(_Section, frozen=True):
    """The HTTP server's limits, so no connection, client or burst can wear it down (the
    "Limits and abuse" section of docs/aggregator.md has the figures behind the defaults)."""

    # A connection with no complete request within this long is closed: an idle socket, a slow
    # header sender (from the connection's start or the last answer).
    idle_timeout_seconds: PositiveSeconds = 15.0
    # The whole body must arrive within this long of the headers (408 and closed otherwise).
    body_timeout_seconds: PositiveSeconds = 10.0
    # Reports taken in and not yet answered; beyond it 503 with Retry-After, before the body is
    # read. Reports are processed one at a time, so this bounds the wait: 64 x ~10 ms.
    max_in_flight: Positive = 64
    # A report that waited longer than this for its turn is shed (503) too: the loop is behind.
    max_wait_seconds: PositiveSeconds = 0.25
    # Of which one token (one node) may hold at most this many: its slow bodies pin little.
    max_in_flight_per_token: Positive = 4
    retry_after_seconds: Positive = 5
    # Open connections; further ones are closed at once. The soft file limit is raised to the
    # hard one at start and this is capped below it by fd_reserve (the decision log, the
    # Kubernetes client, TLS files), so the accept loop never meets "Too many open files".
    max_connections: Positive = 8192
    fd_reserve: Positive = 128
    # TLS: both files PEM; reloaded when either changes (checked every tls_reload_seconds).
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_reload_seconds: PositiveSeconds = 30.0
    # /metrics without a token: on by default, as most Prometheus setups scrape without one;
    # turn it off and give the scrape a viewer token (authorization: in its scrape config) where
    # the metrics' node names should not be public. Every other read needs a viewer token.
    metrics_public: bool = True
    # The status page's HTML pages (GET / and below, not its JSON) without a token: off by
    # default, since they show node placement and evidence. Turn it on where the operator says
    # the port is reachable only by those who may see it (the demo on 127.0.0.1 does). Otherwise a
    # browser is asked for a viewer token (HTTP Basic, the token as the password).
    status_page_public: bool = False
    # The event loop (aggregator/eventloop.py): uvloop where installed (auto), or insist on one.
    event_loop: EventLoopKind = "auto"


class ShardingConfig(_Section, frozen=True):
    """Pools spread over ``shards`` aggregators (aggregator/shard/, docs/sharding.md). One shard,
    the default, is the unsharded aggregator, unchanged."""

    shards: Annotated[int, Meta(ge=1, le=1024)] = 1
    # This replica's shard; None: the ordinal of its StatefulSet pod (``gpuwarden-a-3``: 3).
    shard: Annotated[int, Meta(ge=0)] | None = None
    # Where each shard is reached. An entry is a pattern with ``{i}`` (the shard's index), e.g.
    # ``http://gpuwarden-a-{i}.gpuwarden-a.gpuwarden.svc:8080``, or a list of one URL per shard.
    # The first entry is this replica's own StatefulSet: redirects point there, so an agent's
    # reports keep going to the same side of each shard's pair. Later entries (the standby side)
    # are asked by the fleet-wide views when the first does not answer.
    peers: list[str | list[str]] = msgspec.field(default_factory=list)
    fanout_timeout_seconds: PositiveSeconds = 5.0  # one shard's answer to a fleet-wide view
    fanout_concurrency: Annotated[int, Meta(ge=1, le=256)] = 16  # shards asked at once

    def __post_init__(self) -> None:
        if self.shard is not None and self.shard >= self.shards:
            raise ValueError(f"shard {self.shard} is not below shards ({self.shards})")
        if self.shards > 1 and not self.peers:
            raise ValueError("with more than one shard, peers must say where each shard is reached")
        for peer in self.peers:
            if isinstance(peer, str) and "{i}" not in peer:
                raise ValueError(f"peer pattern {peer!r} has no {{i}} for the shard's index")
            if isinstance(peer, list) and len(peer) != self.shards:
                raise ValueError(f"a peer list names {len(peer)} URLs for {self.shards} shards")


class Config(_Section, frozen=True):
    rules_dir: str | None = None  # default: the rules/ directory shipped with gpuwarden
    ingest: IngestConfig = IngestConfig()
    fleet: FleetConfig = FleetConfig()
    health: HealthConfig = HealthConfig()
    silence: SilenceConfig = SilenceConfig()
    auth: AuthConfig = AuthConfig()
    notify: NotifyConfig = NotifyConfig()
    links: LinksConfig = LinksConfig()
    detectors: DetectorsConfig = msgspec.field(default_factory=_default_detectors)
    remediation: RemediationConfig = RemediationConfig()
    probes: ProbesConfig = ProbesConfig()
    server: ServerConfig = ServerConfig()
    sharding: ShardingConfig = ShardingConfig()
