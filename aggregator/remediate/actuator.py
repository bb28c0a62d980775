"""The leader's reconciler: makes every Kubernetes Node look like what the pipeline intends.

Shape (client-go's controller pattern, in asyncio):

- an informer lists the Nodes, then watches from the list's resourceVersion (``KubeGone``: list
  again), keeping a cache and enqueuing a node when something we care about changed on it (its
  taints, our annotations, the managed label, our condition). A periodic full resync and every
  gain of leadership enqueue every node, so a missed event costs at most ``resync_seconds``;
- a work queue with client-go's semantics: one entry per node however often it is submitted,
  never the same node in two workers at once, bounded (overflow is counted, the resync catches
  up), and a per-node exponential retry delay (1 s doubling to 5 min) after failures;
- ``workers`` workers, each reconciling one node at a time: read the node fresh, compute the whole
  wanted state, write only what differs.

Before any reconcile, the first list hands every node carrying our taint or our health snapshot
to ``IntentSource.restore``: a restarted or newly elected aggregator thus knows which nodes are
quarantined before it could mistake one for healthy and untaint it.

Safety properties operators depend on:

- Writes happen only in ``enforce`` mode and only on the leader; ``dry-run`` computes and logs
  every write (once per distinct plan, so a resync does not repeat the same lines) and sends none.
- ``spec.taints`` is rebuilt from a fresh read, keeping every taint that is not ours exactly as
  read, and patched with the node's resourceVersion as a precondition: a concurrent writer makes
  the patch fail with a conflict, and we re-read and retry instead of overwriting its change.
- We remove only a taint we applied ourselves (the snapshot annotation's ``tainted``, or
  ``<prefix>taint`` for a suspect's PreferNoSchedule, which the snapshot must not call "out" lest
  a restarted pipeline restore it as a quarantine); a taint with our key that a human put there
  stays. A human who removes our taint overrides that
  evidence for ``override_cooldown_seconds``, recorded on the node so that a restart honours it.
- Every API call of a reconcile, reads included, passes one token bucket (``qps``/``burst``)
  shared by all workers, so a fleet-wide decision cannot flood the API server.
- NoExecute (which evicts running pods) needs ``allow_no_execute`` and is further limited to
  ``max_no_execute_per_hour`` new NoExecute taints; past that a node gets NoSchedule, upgraded by
  a later reconcile once the hour allows it.

Events are best effort (as the kubelet's are): a failed ``create_event`` is logged and counted,
never retried, because the snapshot annotation already records the change it would announce.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Final, Literal

import msgspec
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.registry import CollectorRegistry

from agent.clock import Clock
from aggregator.config import RemediationConfig
from aggregator.kube.api import KubeApi
from aggregator.kube.objects import (
    Condition,
    ConditionStatus,
    EventRecord,
    EventType,
    KubeConflict,
    KubeError,
    KubeGone,
    KubeNotFound,
    Node,
    NodeEvent,
    Taint,
    TaintEffect,
)
from aggregator.remediate.model import (
    HealthSnapshot,
    IntentSource,
    NodeIntent,
    decode_snapshot,
    encode_snapshot,
)

log = logging.getLogger(__name__)

__all__ = ["Actuator", "ActuatorMetrics", "label_value", "rfc3339"]

WriteKind = Literal["taint", "untaint", "preflight_release", "condition", "event", "annotation"]
WriteResult = Literal["ok", "conflict", "error", "dry_run"]
WRITE_KINDS: Final[tuple[WriteKind, ...]] = (
    "taint",
    "untaint",
    "preflight_release",
    "condition",
    "event",
    "annotation",
)
WRITE_RESULTS: Final[tuple[WriteResult, ...]] = ("ok", "conflict", "error", "dry_run")

# A conflict means someone wrote the node between our read and our patch: re-read at once, a few
# times, then leave it to the queue's slower per-node backoff.
CONFLICT_ATTEMPTS: Final = 5
CONFLICT_BACKOFF_S: Final = 0.05
# client-go's default item rate limiter: 1 s doubling, capped (here at 5 min).
RETRY_BASE_S: Final = 1.0
RETRY_MAX_S: Final = 300.0
# Informer: a failed list or watch is retried after this, doubling.
INFORMER_BACKOFF_S: Final = 1.0
INFORMER_BACKOFF_MAX_S: Final = 30.0
NO_EXECUTE_WINDOW_S: Final = 3600.0
EVENT_MESSAGE_MAX: Final = 1024  # the API server rejects longer Event messages
# Replicas time the same report by their own receive clocks; a report reaches them all within this.
SAME_EPISODE_S: Final = 60.0

_CONDITION_REASONS: Final[Mapping[str, str]] = {
    "healthy": "Healthy",
    "suspect": "Suspect",
    "quarantined": "Quarantined",
    "probation": "Probation",
}
_LABEL_INVALID = re.compile(r"[^A-Za-z0-9._-]+")


# -- pure helpers ---------------------------------------------------------------------------------


def label_value(text: str) -> str:
    """``text`` as a valid label (and taint) value: at most 63 characters of ``[A-Za-z0-9._-]``
    that begin and end alphanumeric. Never empty, so the taint always says something."""
    cleaned = _LABEL_INVALID.sub("-", text)[:63].strip("._-")
    return cleaned or "unhealthy"


def rfc3339(unix: float) -> str:
    """Seconds precision, UTC, as Kubernetes' metav1.Time serialises."""
    return datetime.fromtimestamp(unix, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_rfc3339(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _untimed(snapshot: HealthSnapshot) -> HealthSnapshot:
    """The snapshot without what describes rather than decides: times, and the findings' words
    and measured values (a suspect GPU's temperature changes with every report)."""
    return msgspec.structs.replace(
        snapshot,
        since=0.0,
        quarantines=[],
        message=None,
        findings=[msgspec.structs.replace(f, since=0.0, summary="", evidence={}) for f in snapshot.findings],
    )


def _same_episode(a: HealthSnapshot, b: HealthSnapshot) -> bool:
    """The same decision: timed by two replicas (within ``SAME_EPISODE_S``), or described again
    with newer measurements. Equal state, taint, evidence keys and lemon count; a new quarantine
    adds to ``quarantines``, so it is never the same episode. Keeping what the node already says
    then costs no write: a resync of an unchanged fleet sends nothing."""
    return (
        abs(a.since - b.since) <= SAME_EPISODE_S
        and len(a.quarantines) == len(b.quarantines)
        and _untimed(a) == _untimed(b)
    )


def _taints_text(taints: Sequence[Taint]) -> list[str]:
    """kubectl's spelling, for logs: ``key=value:Effect``."""
    return [f"{t.key}={t.value or ''}:{t.effect}" for t in taints]


class _Override(msgspec.Struct, frozen=True):
    """The ``<prefix>override`` annotation: a human removed our taint for this evidence."""

    evidence_key: str
    until: str  # RFC 3339
    at: str  # RFC 3339

    def active(self, evidence_key: str, now: float) -> bool:
        return self.evidence_key == evidence_key and now < _parse_rfc3339(self.until)


def _decode_override(node: str, text: str | None) -> _Override | None:
    if text is None:
        return None
    try:
        ov = msgspec.json.decode(text, type=_Override)
        _parse_rfc3339(ov.until)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
        # Hand-edited into something we cannot read: ignoring it is the only reading that does
        # not invent an override nobody asked for; the next human removal records a fresh one.
        log.warning("unreadable override annotation ignored", extra={"node": node, "value": text})
        return None
    return ov


# -- metrics --------------------------------------------------------------------------------------


class ActuatorMetrics:
    """Remediation's Prometheus metrics, on a registry passed in (never the global one)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.writes = Counter(
            "gpuwarden_remediation_writes",
            "Writes to Kubernetes by kind and result (dry_run: computed and logged, not sent).",
            ["kind", "result"],
            registry=registry,
        )
        for kind in WRITE_KINDS:
            for result in WRITE_RESULTS:
                self.writes.labels(kind=kind, result=result)
        self.queue_depth = Gauge(
            "gpuwarden_remediation_queue_depth", "Nodes waiting to be reconciled.", registry=registry
        )
        self.queue_dropped = Counter(
            "gpuwarden_remediation_queue_dropped",
            "Submits dropped because the queue was full (the periodic resync catches up).",
            registry=registry,
        )
        self.overrides = Counter(
            "gpuwarden_remediation_overrides",
            "Our taint removed by a human; respected for override_cooldown_seconds.",
            registry=registry,
        )
        self.reconcile_seconds = Histogram(
            "gpuwarden_remediation_reconcile_seconds",
            "Time to reconcile one node, rate-limit waits included.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=registry,
        )
        self.last_resync = Gauge(
            "gpuwarden_remediation_last_resync_timestamp_seconds",
            "Unix time of the last full resync (every node enqueued).",
            registry=registry,
        )

    def write(self, kind: WriteKind, result: WriteResult) -> None:
        self.writes.labels(kind=kind, result=result).inc()


# -- rate limiting and the work queue -------------------------------------------------------------


class _TokenBucket:
    """``burst`` tokens, refilled at ``qps``; ``acquire`` waits for one. Waiters queue behind one
    lock, so they are served in order and the bucket's arithmetic never races."""

    def __init__(
        self, qps: float, burst: int, clock: Clock, sleep: Callable[[float], Awaitable[None]]
    ) -> None:
        self._qps = qps
        self._burst = float(burst)
        self._tokens = float(burst)
        self._clock = clock
        self._sleep = sleep
        self._last = clock.monotonic()
        self._lock = asyncio.Lock()

    def _refill(self) -> None:
        now = self._clock.monotonic()
        self._tokens = min(self._burst, self._tokens + (now - self._last) * self._qps)
        self._last = now

    async def acquire(self) -> None:
        async with self._lock:
            self._refill()
            # The epsilon absorbs float rounding: a wait shorter than the clock's resolution would
            # otherwise never add the last sliver of a token.
            while self._tokens < 1.0 - 1e-9:
                await self._sleep((1.0 - self._tokens) / self._qps)
                self._refill()
            self._tokens -= 1.0


class _WorkQueue:
    """client-go's workqueue: deduplicated, and a node being processed is not handed to a second
    worker; a submit during processing runs it again afterwards."""

    def __init__(self, limit: int, metrics: ActuatorMetrics) -> None:
        self._limit = limit
        self._metrics = metrics
        self._queue: deque[str] = deque()
        self._dirty: set[str] = set()
        self._processing: set[str] = set()
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._dirty)

    def __contains__(self, node: str) -> bool:
        return node in self._dirty

    def add(self, node: str) -> bool:
        if node in self._dirty:
            return True
        if len(self._dirty) >= self._limit:
            self._metrics.queue_dropped.inc()
            return False
        self._dirty.add(node)
        if node not in self._processing:
            self._queue.append(node)
            self._ready.set()
        self._metrics.queue_depth.set(len(self._dirty))
        return True

    async def get(self) -> str:
        while not self._queue:
            self._ready.clear()
            await self._ready.wait()
        node = self._queue.popleft()
        self._dirty.discard(node)
        self._processing.add(node)
        self._metrics.queue_depth.set(len(self._dirty))
        return node

    def done(self, node: str) -> None:
        self._processing.discard(node)
        if node in self._dirty:
            self._queue.append(node)
            self._ready.set()


# -- one reconcile's plan -------------------------------------------------------------------------


@dataclass
class _EventPlan:
    type: EventType
    reason: str
    message: str


@dataclass
class _Plan:
    """Everything one reconcile would write, computed from one read of the node."""

    node: Node
    taints: tuple[Taint, ...]  # the whole wanted spec.taints
    annotations: dict[str, str | None] = field(default_factory=dict)  # changed keys only
    patch_kind: WriteKind = "annotation"
    condition: Condition | None = None
    events: list[_EventPlan] = field(default_factory=list)
    new_no_execute: bool = False  # this patch adds a NoExecute taint (counts toward the hour)
    override_recorded: bool = False
    preflight_timeout: bool = False

    @property
    def taints_changed(self) -> bool:
        return self.taints != self.node.taints

    @property
    def needs_patch(self) -> bool:
        return self.taints_changed or bool(self.annotations)

    def signature(self) -> tuple[object, ...]:
        cond = None if self.condition is None else (self.condition.status, self.condition.reason)
        return (
            self.taints if self.taints_changed else None,
            tuple(sorted(self.annotations.items(), key=lambda kv: kv[0])),
            cond,
            tuple((e.reason, e.message) for e in self.events),
        )


# -- the actuator ---------------------------------------------------------------------------------


class Actuator:
    """Reconciles Nodes to ``IntentSource.intent``; see the module docstring."""

    def __init__(
        self,
        api: KubeApi,
        config: RemediationConfig,
        intents: IntentSource,
        *,
        clock: Clock,
        is_leader: Callable[[], bool],
        metrics: ActuatorMetrics | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._api = api
        self._config = config
        self._intents = intents
        self._clock = clock
        self._is_leader = is_leader
        self._metrics = metrics if metrics is not None else ActuatorMetrics(CollectorRegistry())
        self._sleep = sleep
        self._bucket = _TokenBucket(config.qps, config.burst, clock, sleep)
        self._queue = _WorkQueue(config.queue_size, self._metrics)
        self._cache: dict[str, Node] = {}
        self._resync_only: set[str] = set()  # queued by the periodic resync alone
        self._synced = asyncio.Event()
        self._was_leader = False
        self._dropped: set[str] = set()  # turned away by a full queue since the last resync
        self._failures: dict[str, int] = {}  # node -> consecutive failed reconciles
        self._later: dict[str, tuple[float, asyncio.Task[None]]] = {}  # node -> (due, timer)
        # resourceVersions our own last writes produced, per node: their watch echoes need no
        # reconcile (a patch and a condition write make two in a row).
        self._written_rv: dict[str, deque[str]] = {}
        self._no_execute_at: deque[float] = deque()  # when we added NoExecute taints (unix)
        self._preflight_seen: dict[str, float] = {}  # node -> monotonic time we first saw its taint
        self._preflight_warned: set[str] = set()
        self._dry_run_logged: dict[str, tuple[object, ...]] = {}
        p = config.annotation_prefix
        self._ann_health = f"{p}health"
        self._ann_reason = f"{p}reason"
        self._ann_decided = f"{p}decided-at"
        self._ann_override = f"{p}override"
        self._ann_taint = f"{p}taint"

    # -- public surface ---------------------------------------------------------------------------

    def submit(self, node: str) -> None:
        """Reconcile ``node`` soon (the pipeline calls this when a decision changes it)."""
        self._resync_only.discard(node)
        self._enqueue(node)

    def _enqueue(self, node: str) -> None:
        if not self._queue.add(node):
            self._dropped.add(node)
            log.warning(
                "remediation queue full, node left to the next resync",
                extra={"node": node, "queue_size": self._config.queue_size},
            )

    def cached(self, node: str) -> Node | None:
        return self._cache.get(node)

    def cached_nodes(self) -> list[Node]:
        """Every Node in the informer cache (a copy of the list: the cache changes under it)."""
        return list(self._cache.values())

    async def synced(self) -> None:
        """Returns once the first list is cached and every node carrying our taint or snapshot has
        been handed to ``IntentSource.restore``."""
        await self._synced.wait()

    def leadership_changed(self) -> None:
        """Call whenever ``is_leader()`` may have flipped: on gaining leadership, a full resync."""
        self._check_leadership()

    def _check_leadership(self) -> bool:
        """Resync when we just became leader; True when it did."""
        leader = self._is_leader()
        gained = leader and not self._was_leader
        self._was_leader = leader
        if gained:
            log.info("leadership gained: full remediation resync", extra={"nodes": len(self._cache)})
            self.resync()
        return gained

    def resync(self) -> None:
        """Enqueue every known node: the periodic full compare of wanted and actual state. Nodes a
        full queue turned away go first, so a queue smaller than the fleet starves no one."""
        dropped = [n for n in self._dropped if n in self._cache]
        self._dropped.clear()
        for name in dropped:
            self.submit(name)
        for name in list(self._cache):
            if name not in self._queue:  # a decision already queued it: it reads fresh
                self._resync_only.add(name)
            self._enqueue(name)
        self._metrics.last_resync.set(self._clock.time())

    async def run(self) -> None:
        """Informer, resync timer and workers, until cancelled; no error ends it."""
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._informer(), name="remediation-informer")
                tg.create_task(self._resync_loop(), name="remediation-resync")
                for i in range(self._config.workers):
                    tg.create_task(self._worker(), name=f"remediation-worker-{i}")
        finally:
            for _, task in self._later.values():
                task.cancel()
            self._later.clear()

    async def reconcile(self, node: str, *, from_cache: bool = False) -> None:
        """Make ``node`` look like its intent now. Raises ``KubeError`` when it could not (after
        bounded conflict retries); a node that no longer exists is dropped silently.
        ``from_cache``: judge from the informer's copy first and skip the read when the node
        already looks right (the periodic resync; decisions always read fresh)."""
        intent = self._intents.intent(node)
        if intent is None or not self._is_leader():
            return
        cached = self._cache.get(node) if from_cache else None
        if cached is not None and not self._needs_work(cached, intent):
            return
        for attempt in range(CONFLICT_ATTEMPTS):
            try:
                await self._reconcile_once(intent)
                return
            except KubeNotFound:
                log.info("node gone, dropped from remediation", extra={"node": node})
                self._cache.pop(node, None)
                self._forget(node)
                return
            except KubeConflict:
                if attempt == CONFLICT_ATTEMPTS - 1:
                    raise
                await self._sleep(CONFLICT_BACKOFF_S * 2**attempt)
                if not self._is_leader():
                    return
                # The intent may have moved on while we waited; always act on the newest one.
                newer = self._intents.intent(node)
                if newer is None:
                    return
                intent = newer

    # -- informer ---------------------------------------------------------------------------------

    async def _informer(self) -> None:
        backoff = INFORMER_BACKOFF_S
        while True:
            try:
                listed = await self._api.list_nodes()
                self._on_list(listed.items)
                backoff = INFORMER_BACKOFF_S
                rv = listed.resource_version
                while True:
                    # aclosing: a cancelled run() closes the watch's HTTP stream at once.
                    async with aclosing(self._api.watch_nodes(resource_version=rv)) as events:
                        async for event in events:
                            self._on_event(event)
                            rv = event.node.resource_version
            except KubeGone:
                log.info("node watch too old, listing again")
            except Exception as e:
                # KubeUnavailable, KubeForbidden, or a bug: the informer must outlive all of them.
                log.warning(
                    "node list/watch failed, retrying",
                    extra={
                        "error": str(e),
                        "error_type": type(e).__name__,
                        "status": getattr(e, "status", None),
                        "retry_in_s": backoff,
                    },
                    exc_info=not isinstance(e, KubeError),
                )
                await self._sleep(backoff)
                backoff = min(backoff * 2, INFORMER_BACKOFF_MAX_S)

    def _on_list(self, nodes: Sequence[Node]) -> None:
        listed = {n.name: n for n in nodes}
        for gone in self._cache.keys() - listed.keys():
            self._forget(gone)
        self._cache = listed
        for n in nodes:
            self._note_preflight(n)
        if not self._synced.is_set():
            self._was_leader = self._is_leader()  # this list's resync covers a leadership we hold
            self._restore(nodes)
            self._synced.set()
            log.info("remediation informer synced", extra={"nodes": len(nodes)})
        self.resync()

    def _restore(self, nodes: Sequence[Node]) -> None:
        now = self._clock.time()
        for n in nodes:
            text = n.annotations.get(self._ann_health)
            snapshot = decode_snapshot(text) if text is not None else None
            # Only a taint we recorded applying is ours to restore from; a human's taint with our
            # key on a node we never wrote is theirs, and the node is left to them.
            we_applied = (
                (snapshot is not None and snapshot.tainted)
                or self._ann_taint in n.annotations
                or (text is not None and snapshot is None)  # ours, if unreadable
            )
            ours = self._applied_taints(n, we_applied)
            if not ours and text is None:
                continue
            if text is not None and snapshot is None:
                log.warning(
                    "unreadable health snapshot, restoring from the taint alone", extra={"node": n.name}
                )
            value = ours[0].value if ours else None
            self._intents.restore(n.name, snapshot, value, now)
            # The NoExecute budget is about evictions in the last hour, whoever of us caused them:
            # the API server's timeAdded on our taints carries it across restarts.
            for t in ours:
                if t.effect == "NoExecute" and t.time_added is not None:
                    try:
                        added = _parse_rfc3339(t.time_added)
                    except ValueError:
                        continue
                    if now - added < NO_EXECUTE_WINDOW_S:
                        self._no_execute_at.append(added)
        self._no_execute_at = deque(sorted(self._no_execute_at))

    def _on_event(self, event: NodeEvent) -> None:
        n = event.node
        if event.type == "DELETED":
            self._cache.pop(n.name, None)
            self._forget(n.name)
            return
        old = self._cache.get(n.name)
        self._cache[n.name] = n
        self._note_preflight(n)
        if n.resource_version in self._written_rv.get(n.name, ()):
            return  # the echo of our own write
        if old is None or self._relevant(old) != self._relevant(n):
            self.submit(n.name)

    def _relevant(self, n: Node) -> tuple[object, ...]:
        """What a reconcile depends on; the kubelet's status heartbeats change none of it."""
        p = self._config.annotation_prefix
        ours = tuple(sorted((k, v) for k, v in n.annotations.items() if k.startswith(p)))
        cond = next((c for c in n.conditions if c.type == self._config.condition_type), None)
        cond_key = None if cond is None else (cond.status, cond.reason, cond.message)
        return (n.taints, ours, n.labels.get(self._config.managed_label), cond_key)

    def _note_preflight(self, n: Node) -> None:
        if any(t.key == self._config.preflight.taint_key for t in n.taints):
            self._preflight_seen.setdefault(n.name, self._clock.monotonic())
        else:
            self._preflight_seen.pop(n.name, None)
            self._preflight_warned.discard(n.name)

    def _forget(self, node: str) -> None:
        self._failures.pop(node, None)
        self._written_rv.pop(node, None)
        self._preflight_seen.pop(node, None)
        self._preflight_warned.discard(node)
        self._dry_run_logged.pop(node, None)
        self._dropped.discard(node)
        later = self._later.pop(node, None)
        if later is not None:
            later[1].cancel()

    async def _resync_loop(self) -> None:
        await self._synced.wait()
        while True:
            await self._sleep(self._config.resync_seconds)
            if not self._check_leadership():
                self.resync()

    # -- workers ----------------------------------------------------------------------------------

    async def _worker(self) -> None:
        await self._synced.wait()
        while True:
            node = await self._queue.get()
            try:
                await self._reconcile_guarded(node)
            finally:
                self._queue.done(node)

    async def _reconcile_guarded(self, node: str) -> None:
        started = self._clock.monotonic()
        try:
            # A periodic resync judges from the informer's copy, as client-go controllers do, so
            # a resync of 7,500 unchanged nodes costs no API call; anything else reads fresh.
            from_cache = node in self._resync_only
            self._resync_only.discard(node)
            await self.reconcile(node, from_cache=from_cache)
        except KubeError as e:
            self._retry_later(node, e)
            return
        except Exception as e:
            # A bug must cost one node a retry, never the actuator (run() keeps going).
            log.exception("reconcile failed unexpectedly", extra={"node": node})
            self._retry_later(node, e)
            return
        finally:
            self._metrics.reconcile_seconds.observe(max(0.0, self._clock.monotonic() - started))
        self._failures.pop(node, None)

    def _retry_later(self, node: str, error: Exception) -> None:
        failures = self._failures.get(node, 0)
        self._failures[node] = failures + 1
        delay = min(RETRY_BASE_S * 2**failures, RETRY_MAX_S)
        log.warning(
            "reconcile failed, retrying later",
            extra={
                "node": node,
                "error": str(error),
                "error_type": type(error).__name__,
                "status": getattr(error, "status", None),
                "retry_in_s": delay,
            },
        )
        self._submit_after(node, delay)

    def _submit_after(self, node: str, delay: float) -> None:
        """One timer per node, the earliest wins: a later reconcile re-arms what it still needs."""
        due = self._clock.monotonic() + delay
        current = self._later.get(node)
        if current is not None:
            if current[0] <= due and not current[1].done():
                return
            current[1].cancel()

        async def fire() -> None:
            await self._sleep(delay)
            self._later.pop(node, None)
            self.submit(node)

        self._later[node] = (due, asyncio.get_running_loop().create_task(fire()))

    # -- one reconcile ----------------------------------------------------------------------------

    async def _reconcile_once(self, intent: NodeIntent) -> None:
        await self._bucket.acquire()
        node = await self._api.get_node(intent.node)
        if not self._is_leader():
            return  # lost the Lease while waiting: the new leader reconciles from here
        self._cache[node.name] = node
        if node.labels.get(self._config.managed_label) == "false":
            return
        plan = self._plan(node, intent)
        if self._config.mode != "enforce":
            self._log_dry_run(plan)
            return

        if plan.needs_patch:
            await self._bucket.acquire()
            if not self._is_leader():
                return  # every write re-checks: leadership can end while we wait for a token
            try:
                written = await self._api.patch_node(
                    node.name,
                    resource_version=node.resource_version,
                    taints=plan.taints if plan.taints_changed else None,
                    annotations=plan.annotations or None,
                )
            except KubeConflict:
                self._metrics.write(plan.patch_kind, "conflict")
                raise
            except KubeError:
                self._metrics.write(plan.patch_kind, "error")
                raise
            self._metrics.write(plan.patch_kind, "ok")
            self._wrote(written)
            log.info(
                "node remediated",
                extra={
                    "node": node.name,
                    "kind": plan.patch_kind,
                    "taints_before": _taints_text(node.taints),
                    "taints_after": _taints_text(plan.taints),
                    "annotations": plan.annotations,
                },
            )
            if plan.new_no_execute:
                self._no_execute_at.append(self._clock.time())
            if plan.override_recorded:
                self._metrics.overrides.inc()

        if plan.condition is not None:
            await self._bucket.acquire()
            if not self._is_leader():
                return
            try:
                written = await self._api.patch_node_condition(node.name, plan.condition)
            except KubeError:
                self._metrics.write("condition", "error")
                raise
            self._metrics.write("condition", "ok")
            self._wrote(written)

        if plan.preflight_timeout:
            self._preflight_warned.add(node.name)
        for ev in plan.events:
            if not self._is_leader():
                return
            await self._emit(node, ev)

    def _wrote(self, node: Node) -> None:
        self._written_rv.setdefault(node.name, deque(maxlen=4)).append(node.resource_version)
        self._cache[node.name] = node

    async def _emit(self, node: Node, ev: _EventPlan) -> None:
        await self._bucket.acquire()
        record = EventRecord(
            node=node.name,
            node_uid=node.uid,
            type=ev.type,
            reason=ev.reason,
            message=ev.message[:EVENT_MESSAGE_MAX],
        )
        try:
            await self._api.create_event(self._config.events_namespace, record)
        except KubeError as e:
            self._metrics.write("event", "error")
            log.warning(
                "event not recorded",
                extra={"node": node.name, "event_reason": ev.reason, "error": str(e), "status": e.status},
            )
            return
        self._metrics.write("event", "ok")

    def _log_dry_run(self, plan: _Plan) -> None:
        name = plan.node.name
        sig = plan.signature()
        if self._dry_run_logged.get(name) == sig:
            return
        self._dry_run_logged[name] = sig
        if plan.needs_patch:
            self._metrics.write(plan.patch_kind, "dry_run")
            log.info(
                "dry-run: would patch node",
                extra={
                    "node": name,
                    "kind": plan.patch_kind,
                    "taints_before": _taints_text(plan.node.taints),
                    "taints_after": _taints_text(plan.taints),
                    "annotations": plan.annotations,
                },
            )
        if plan.condition is not None:
            self._metrics.write("condition", "dry_run")
            log.info(
                "dry-run: would set condition",
                extra={
                    "node": name,
                    "kind": "condition",
                    "status": plan.condition.status,
                    "condition_reason": plan.condition.reason,
                },
            )
        if plan.preflight_timeout:
            self._preflight_warned.add(name)
        for ev in plan.events:
            self._metrics.write("event", "dry_run")
            log.info(
                "dry-run: would record event",
                extra={"node": name, "kind": "event", "event_reason": ev.reason, "event_message": ev.message},
            )

    def _needs_work(self, node: Node, intent: NodeIntent) -> bool:
        if node.labels.get(self._config.managed_label) == "false":
            return False
        plan = self._plan(node, intent)
        return plan.needs_patch or plan.condition is not None or bool(plan.events)

    # -- planning (pure but for the NoExecute budget and preflight clocks) ------------------------

    def _our_taints(self, node: Node) -> list[Taint]:
        """Taints with our key, whoever put them there."""
        return [t for t in node.taints if t.key == self._config.taint_key]

    def _applied_taints(self, node: Node, we_applied: bool) -> list[Taint]:
        """The taints with our key that we put there: the one ``<prefix>taint`` records, or, on a
        node written before that annotation existed, any with our key if the snapshot says so."""
        if not we_applied:
            return []
        recorded = node.annotations.get(self._ann_taint)
        return [
            t for t in self._our_taints(node) if recorded is None or recorded == f"{t.value or ''}:{t.effect}"
        ]

    def _effect(self, intent: NodeIntent, current: Sequence[Taint]) -> tuple[TaintEffect | None, bool]:
        """The effect we apply, and whether it is a NoExecute new to this node."""
        effect = intent.effect
        if effect != "NoExecute":
            return effect, False
        if not self._config.allow_no_execute:
            return "NoSchedule", False
        if any(t.effect == "NoExecute" for t in current):
            return "NoExecute", False
        now = self._clock.time()
        while self._no_execute_at and now - self._no_execute_at[0] >= NO_EXECUTE_WINDOW_S:
            self._no_execute_at.popleft()
        if len(self._no_execute_at) >= self._config.max_no_execute_per_hour:
            log.warning(
                "NoExecute budget spent for this hour, tainting NoSchedule instead",
                extra={"node": intent.node, "max_no_execute_per_hour": self._config.max_no_execute_per_hour},
            )
            return "NoSchedule", False
        return "NoExecute", True

    def _plan(self, node: Node, intent: NodeIntent) -> _Plan:
        cfg = self._config
        now = self._clock.time()
        health_text = node.annotations.get(self._ann_health)
        old = decode_snapshot(health_text) if health_text is not None else None
        # The snapshot's ``tainted`` is the pipeline's (the decision took the node out); a
        # PreferNoSchedule taint for a suspect node is ours without that, so ``<prefix>taint``
        # records whatever taint we applied.
        # An unreadable snapshot is still ours (hand-edited, another version): its taint is ours too.
        we_applied = (
            (old is not None and old.tainted)
            or self._ann_taint in node.annotations
            or (health_text is not None and old is None)
        )
        # Ours is the taint we recorded applying; a taint with our key that a human put there is
        # theirs: kept as it is, never taken over, never removed by us.
        ours = self._applied_taints(node, we_applied)
        override = _decode_override(node.name, node.annotations.get(self._ann_override))
        pf_key = cfg.preflight.taint_key
        has_preflight = cfg.preflight.enabled and any(t.key == pf_key for t in node.taints)

        want, new_no_execute = self._effect(intent, ours)
        value = label_value(intent.reason_code)
        events: list[_EventPlan] = []
        new_override: _Override | None = override
        state_event_done = False

        if want is not None:
            if override is not None and override.active(intent.evidence_key, now):
                want, new_no_execute = None, False
            elif not ours and we_applied:
                # Our snapshot says the taint is ours and on, yet the node has none: a human took
                # it off. That overrides this evidence for the cooldown; new evidence does not.
                until = now + cfg.override_cooldown_seconds
                new_override = _Override(
                    evidence_key=intent.evidence_key, until=rfc3339(until), at=rfc3339(now)
                )
                want, new_no_execute = None, False
                events.append(
                    _EventPlan(
                        "Warning",
                        "GpuwardenOverrideRespected",
                        f"{cfg.taint_key} was removed by hand; not re-tainting for the same evidence "
                        f"({intent.evidence_key}) until {rfc3339(until)}: {intent.message}",
                    )
                )
                state_event_done = True
            elif override is not None:
                why = (
                    "manual override expired"
                    if override.evidence_key == intent.evidence_key
                    else f"new evidence ({intent.evidence_key}) since the manual override of {override.at}"
                )
                new_override = None
                events.append(
                    _EventPlan(
                        "Warning",
                        "GpuwardenQuarantined" if intent.state != "suspect" else "GpuwardenSuspect",
                        f"{why}; tainted {cfg.taint_key}={value}:{want}: {intent.message}",
                    )
                )
                state_event_done = True
        if intent.state == "healthy":
            new_override = None

        # Preflight: the preflight taint goes once the node passed, or turns into ours on failure;
        # held and pending nodes keep it (they are out either way).
        drop_preflight = (
            has_preflight and not intent.held and (want is not None or intent.preflight == "passed")
        )
        preflight_timeout = False
        if has_preflight and not drop_preflight and not intent.held:
            first = self._preflight_seen.setdefault(node.name, self._clock.monotonic())
            waited = self._clock.monotonic() - first
            if waited > cfg.preflight.timeout_seconds:
                if node.name not in self._preflight_warned:
                    preflight_timeout = True
                    events.append(
                        _EventPlan(
                            "Warning",
                            "GpuwardenPreflightTimeout",
                            f"no preflight verdict after {waited:.0f}s "
                            f"(timeout {cfg.preflight.timeout_seconds:.0f}s); "
                            f"{pf_key} stays: {intent.message}",
                        )
                    )
            else:
                self._submit_after(node.name, cfg.preflight.timeout_seconds - waited + 1.0)

        taints: list[Taint] = []
        placed = False
        for t in node.taints:
            if t in ours:
                if want is not None and not placed:
                    same = t.effect == want and t.value == value
                    taints.append(t if same else Taint(key=cfg.taint_key, effect=want, value=value))
                    placed = True
                # else: ours and no longer wanted (or a duplicate of ours): removed
            elif drop_preflight and t.key == pf_key:
                continue
            else:
                taints.append(t)  # another controller's, or a human's with our key
        if want is not None and not placed:
            if any(t.key == cfg.taint_key and t.effect == want for t in taints):
                # A human's taint with our key and this effect already keeps the node out; taints
                # are unique by key and effect, so ours cannot be added, and theirs stays theirs.
                want, new_no_execute = None, False
            else:
                taints.append(Taint(key=cfg.taint_key, effect=want, value=value))
        new_taints = tuple(taints)

        if new_taints == node.taints:
            kind: WriteKind = "annotation"
        elif want is not None and tuple(t for t in new_taints if t.key == cfg.taint_key) != tuple(ours):
            kind = "taint"
        elif ours and not [t for t in new_taints if t.key == cfg.taint_key]:
            kind = "untaint"
        else:
            kind = "preflight_release"

        # Not tainted when we hold back (a respected override): a restarted pipeline must not
        # believe the node is out. Otherwise the pipeline's own reading stands, so a suspect
        # node's PreferNoSchedule is never restored as a quarantine.
        snapshot = msgspec.structs.replace(
            intent.snapshot, tainted=intent.snapshot.tainted and want is not None
        )
        if old is not None and _same_episode(old, snapshot):
            # Written by another replica (before a fail-over or a restart) about the same decision:
            # every replica times it by its own receive clock. Keep what the node says, so that a
            # new leader neither patches every node nor announces every quarantine again.
            snapshot = old
            intent = msgspec.structs.replace(
                intent, since=old.since, message=node.annotations.get(self._ann_reason, intent.message)
            )
        wanted_ann: dict[str, str | None] = {
            self._ann_health: encode_snapshot(snapshot),
            self._ann_reason: intent.message,
            self._ann_decided: rfc3339(intent.since),
            self._ann_override: None if new_override is None else msgspec.json.encode(new_override).decode(),
            self._ann_taint: None if want is None else f"{value}:{want}",
        }
        ann = {k: v for k, v in wanted_ann.items() if node.annotations.get(k) != v}

        if has_preflight and drop_preflight:
            if want is not None:
                events.append(
                    _EventPlan(
                        "Warning",
                        "GpuwardenPreflightFailed",
                        f"preflight failed, {pf_key} replaced by {cfg.taint_key}={value}:{want}: "
                        f"{intent.message}",
                    )
                )
                state_event_done = True
            else:
                events.append(
                    _EventPlan("Normal", "GpuwardenPreflightPassed", f"preflight passed, {pf_key} removed")
                )
        if not state_event_done:
            ev = self._state_event(old, intent, want, value)
            if ev is not None:
                events.append(ev)

        return _Plan(
            node=node,
            taints=new_taints,
            annotations=ann,
            patch_kind=kind,
            condition=self._condition(node, intent),
            events=events,
            new_no_execute=new_no_execute and want == "NoExecute",
            override_recorded=new_override is not None and new_override != override,
            preflight_timeout=preflight_timeout,
        )

    def _state_event(
        self, old: HealthSnapshot | None, intent: NodeIntent, want: TaintEffect | None, value: str
    ) -> _EventPlan | None:
        if old is None:
            if intent.state == "healthy" and not intent.held:
                return None  # a node we meet healthy has no change to announce
        elif (old.state, old.since, old.held) == (intent.state, intent.since, intent.held):
            return None
        key = self._config.taint_key
        taint = f"tainted {key}={value}:{want}" if want is not None else "not tainted"
        if intent.held:
            return _EventPlan(
                "Warning",
                "GpuwardenHeld",
                f"quarantine held by a safety limit, not tainted: {intent.message}",
            )
        if intent.state == "quarantined":
            relapse = old is not None and old.state == "probation"
            what = "relapsed during probation, quarantined" if relapse else "quarantined"
            return _EventPlan("Warning", "GpuwardenQuarantined", f"{what}, {taint}: {intent.message}")
        if intent.state == "probation":
            return _EventPlan("Normal", "GpuwardenProbation", f"on probation, {taint}: {intent.message}")
        if intent.state == "suspect":
            return _EventPlan("Warning", "GpuwardenSuspect", f"suspect, {taint}: {intent.message}")
        if old is not None and (old.tainted or old.state in ("quarantined", "probation")):
            return _EventPlan("Normal", "GpuwardenReleased", f"released, {key} removed: {intent.message}")
        return _EventPlan("Normal", "GpuwardenHealthy", f"healthy: {intent.message}")

    def _condition(self, node: Node, intent: NodeIntent) -> Condition | None:
        """The condition to write, or None when the node's already says the same."""
        status: ConditionStatus = (
            "False" if intent.held or intent.state in ("quarantined", "probation") else "True"
        )
        reason = "QuarantineHeld" if intent.held else _CONDITION_REASONS[intent.state]
        current = next((c for c in node.conditions if c.type == self._config.condition_type), None)
        if current is not None and (current.status, current.reason, current.message) == (
            status,
            reason,
            intent.message,
        ):
            return None
        return Condition(
            type=self._config.condition_type,
            status=status,
            reason=reason,
            message=intent.message,
            last_transition_time=rfc3339(intent.since),
        )
