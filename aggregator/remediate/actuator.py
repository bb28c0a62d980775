"""The leader's reconciler: makes every Kubernetes Node look like what the pipeline intends.

What a node should look like is decided by ``planner.plan``, a pure function; this module only
feeds it and applies its plans. Shape (client-go's controller pattern, in asyncio):

- an informer lists the Nodes, then watches from the list's resourceVersion, resuming from the
  last event's or bookmark's (``KubeGone``: list again), keeping a cache and enqueuing a node when
  something we care about changed on it (its taints, our annotations, the managed label, our
  condition). A periodic full resync and every gain of leadership enqueue every node, so a missed
  event costs at most ``resync_seconds``. What the watch or the resync queued is judged from the
  cache (client-go controllers reconcile from their lister) when every watch event since the
  node's last reconcile was a write of ours, and read fresh otherwise or when it needs work; a
  decision always reads fresh;
- a work queue (``workqueue``): one entry per node however often it is submitted, never the same
  node in two workers at once, bounded (overflow is counted, the resync catches up), and a
  per-node exponential retry delay (1 s doubling to 5 min) after failures;
- ``workers`` workers, each reconciling one node at a time: read the node, plan, write only what
  the plan says differs.

Before any reconcile, the first list hands every node carrying our taint or our health snapshot
to ``IntentSource.restore``: a restarted or newly elected aggregator thus knows which nodes are
quarantined before it could mistake one for healthy and untaint it.

Safety properties operators depend on (the planner's rules are listed in its docstring):

- Writes happen only in ``enforce`` mode and only on the leader, which is checked again before
  every write; ``dry-run`` plans and logs every write (once per distinct plan, so a resync does
  not repeat the same lines) and sends none.
- ``spec.taints`` is rebuilt from a fresh read and patched with the node's resourceVersion as a
  precondition: a concurrent writer makes the patch fail with a conflict, and we re-read and
  retry instead of overwriting its change.
- Every API call of a reconcile, reads included, passes one token bucket (``qps``/``burst``)
  shared by all workers, so a fleet-wide decision cannot flood the API server. A reconcile shed
  with a ``Retry-After`` (APF's 429) waits as asked and tries again in place, as client-go's REST
  client does: under throttling the workers slow to about one request each per Retry-After.
- The state the planner reads but cannot keep lives here: when we added NoExecute taints (the
  hour's eviction budget) and when each node's preflight taint was first seen. The budget counts
  the ``timeAdded`` of every NoExecute taint of ours on any Node as this replica sees it (listed,
  watched, read, or written), once per node and time: so it survives a restart, a standby counts
  what the leader evicted before a fail-over, and a patch that was applied but whose answer was
  lost is counted when the retry reads the node.
- On gaining leadership, every node the cluster shows under our taint is handed to
  ``IntentSource.restore`` again, as at the first list: a quarantine the previous leader decided
  (from history this replica lacks, say after its own restart) is never undone by the fail-over;
  it goes through probation like any other.

Events are best effort, as the kubelet's are, but not lost to one refusal: the snapshot
annotation already records the change an event announces, so a retried reconcile plans no event
again. A ``create_event`` refused for now (429, 5xx) is tried again a second later, three times
in all; when the condition write fails after the node was patched, the events go before the
error is raised; anything else is logged and counted.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter as Tally
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from contextlib import aclosing
from typing import Any, Final, Literal, TypeVar

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.registry import CollectorRegistry

from agent.clock import Clock
from aggregator.config import RemediationConfig
from aggregator.fleet.pools import k8s_pool
from aggregator.kube.api import KubeApi
from aggregator.kube.objects import (
    EventRecord,
    KubeConflict,
    KubeError,
    KubeGone,
    KubeNotFound,
    KubeUnavailable,
    Node,
    NodeEvent,
    Taint,
    WatchBookmark,
)
from aggregator.remediate import planner
from aggregator.remediate.model import IntentSource, NodeIntent, Restore
from aggregator.remediate.planner import (
    NO_EXECUTE_WINDOW_S,
    WRITE_KINDS,
    Plan,
    PlanEvent,
    WriteKind,
    parse_rfc3339,
    recorded,
)
from aggregator.remediate.workqueue import DelayedAdds, ItemBackoff, TokenBucket, WorkQueue

log = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["Actuator", "ActuatorMetrics"]

WriteResult = Literal["ok", "conflict", "error", "dry_run"]
WRITE_RESULTS: Final[tuple[WriteResult, ...]] = ("ok", "conflict", "error", "dry_run")

# A conflict means someone wrote the node between our read and our patch: re-read at once, a few
# times, then leave it to the queue's slower per-node backoff.
CONFLICT_ATTEMPTS: Final = 5
CONFLICT_BACKOFF_S: Final = 0.05
# A reconcile shed with a Retry-After is tried this many times in all, in place, each after the
# wait the server asked (at least RETRY_AFTER_MIN_S), before it goes to the per-node backoff.
SHED_ATTEMPTS: Final = 3
RETRY_AFTER_MIN_S: Final = 1.0
# Informer: a failed list or watch is retried after this, doubling; back to the start only once
# a watch has delivered an event or run a while, never merely because a LIST worked (a watch that
# fails with a 5xx after every LIST would otherwise list 7,500 Nodes every second).
INFORMER_BACKOFF_S: Final = 1.0
INFORMER_BACKOFF_MAX_S: Final = 30.0
# A watch the server ends this soon with nothing in it counts as failed (client-go's "very short
# watch"): an API server shutting down, or a proxy closing the stream, would get a request loop.
INFORMER_SHORT_WATCH_S: Final = 1.0
# A watch refused with these (no answer: the connection was refused; 429: API Priority and Fairness
# shed it) is resumed from its resourceVersion; any other failure lists again.
WATCH_RETRY_STATUSES: Final = frozenset({0, 429})
EVENT_MESSAGE_MAX: Final = 1024  # the API server rejects longer Event messages
# An event refused for now (429, 5xx, no answer) is tried this many times in all, a second apart.
EVENT_ATTEMPTS: Final = 3
EVENT_RETRY_S: Final = 1.0


def _taints_text(taints: Sequence[Taint]) -> list[str]:
    """kubectl's spelling, for logs: ``key=value:Effect``."""
    return [f"{t.key}={t.value or ''}:{t.effect}" for t in taints]


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
        ready: Callable[[], Awaitable[object]] | None = None,
        leadership_left: Callable[[], float] | None = None,
    ) -> None:
        """``ready``: awaited after the first list, before any worker reconciles (the runtime's
        "the rest of the view is rebuilt too": the breaker from the Lease, queued decisions
        judged); None: the first list is enough. ``leadership_left``: seconds until leadership
        ends unless renewed (``LeaderElector.time_left``); each write is abandoned when it runs
        out, so a write held in the API server's queues cannot land after another replica may
        lead. None: writes are bounded by the client's request timeout only."""
        self._api = api
        self._ready = ready
        self._leadership_left = leadership_left
        self._config = config
        self._intents = intents
        self._clock = clock
        self._leads = is_leader
        self._metrics = metrics if metrics is not None else ActuatorMetrics(CollectorRegistry())
        self._sleep = sleep
        self._bucket = TokenBucket(config.qps, config.burst, clock, sleep)
        self._queue = WorkQueue(config.queue_size)
        self._metrics.queue_depth.set_function(lambda: len(self._queue))
        self._cache: dict[str, Node] = {}
        # Nodes per pool label, kept with the cache: the pool-share limit asks for a pool's size at
        # every new quarantine, and counting 7,500 cached nodes each time made a 375-node storm
        # cost 2.8 million label lookups.
        self._pool_sizes: Tally[str | None] = Tally()
        self._from_cache: set[str] = set()  # queued by the resync or the watch alone
        self._synced = asyncio.Event()
        self._was_leader = False
        # Shutting down (``drain``): workers start no reconcile; ``_idle`` is set while none runs.
        self._draining = False
        self._busy = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._dropped: set[str] = set()  # turned away by a full queue since the last resync
        self._backoff = ItemBackoff()  # per node, after failed reconciles
        self._later = DelayedAdds(clock, sleep, self.submit)  # retries and preflight deadlines
        # resourceVersions our own last writes produced, per node: their watch echoes need no
        # reconcile (a patch and a condition write make two in a row).
        self._written_rv: dict[str, deque[str]] = {}
        # The versions of relevant watch events not known as ours when they came, since the node's
        # last reconcile began: a re-check judges from the cache only once all of them turned out
        # to be our own writes. A GET's or a write's answer can be older than an event already
        # cached (it is cached over it), so someone else's change must never be judged from it.
        self._unexplained: dict[str, set[str]] = {}
        # Our NoExecute taints seen in the last hour, as (node, timeAdded as unix): a set, so that
        # the same taint seen by list, watch, read and write counts once.
        self._no_execute: set[tuple[str, float]] = set()
        self._preflight_seen: dict[str, float] = {}  # node -> monotonic time we first saw its taint
        self._preflight_warned: set[str] = set()
        self._dry_run_logged: dict[str, tuple[object, ...]] = {}

    # -- public surface ---------------------------------------------------------------------------

    def submit(self, node: str) -> None:
        """Reconcile ``node`` soon (the pipeline calls this when a decision changes it)."""
        self._from_cache.discard(node)
        self._enqueue(node)

    def _recheck(self, node: str) -> None:
        """Reconcile ``node`` soon, from the cache if it may (for the resync and the watch; the
        worker checks ``_explained`` when it starts). A decision already queued it: it reads
        fresh."""
        if node not in self._queue:
            self._from_cache.add(node)
        self._enqueue(node)

    def _enqueue(self, node: str) -> None:
        if not self._queue.add(node):
            self._metrics.queue_dropped.inc()
            self._dropped.add(node)
            log.warning(
                "remediation queue full, node left to the next resync",
                extra={"node": node, "queue_size": self._config.queue_size},
            )

    def cached(self, node: str) -> Node | None:
        return self._cache.get(node)

    def pool_size(self, pool: str) -> int:
        """How many cached nodes the pool's Kubernetes label (``k8s_pool``) puts in ``pool``."""
        return self._pool_sizes[pool]

    def _cache_put(self, node: Node) -> bool:
        """Cache ``node``; True if it carries a NoExecute taint of ours with its time."""
        old = self._cache.get(node.name)
        if old is not None:
            self._pool_sizes[k8s_pool(old.labels)] -= 1
        self._cache[node.name] = node
        self._pool_sizes[k8s_pool(node.labels)] += 1
        return self._note_no_execute(node)

    def _note_no_execute(self, node: Node) -> bool:
        """Count our NoExecute taints on ``node`` added within the hour; True if it has one with
        its time. (Cheap for the many nodes without: the snapshot is decoded only for a node
        that has a NoExecute taint with our key.)"""
        key = self._config.taint_key
        if not any(t.key == key and t.effect == "NoExecute" and t.time_added for t in node.taints):
            return False
        now = self._clock.time()
        found = False
        for t in recorded(node, self._config).taints:
            if t.effect != "NoExecute" or t.time_added is None:
                continue
            try:
                added = parse_rfc3339(t.time_added)
            except ValueError:
                continue
            found = True
            if now - added < NO_EXECUTE_WINDOW_S:
                self._no_execute.add((node.name, added))
        return found

    def _cache_pop(self, name: str) -> None:
        old = self._cache.pop(name, None)
        if old is not None:
            self._pool_sizes[k8s_pool(old.labels)] -= 1

    def cached_nodes(self) -> list[Node]:
        """Every Node in the informer cache (a copy of the list: the cache changes under it)."""
        return list(self._cache.values())

    async def synced(self) -> None:
        """Returns once the first list is cached and every node carrying our taint or snapshot has
        been handed to ``IntentSource.restore``."""
        await self._synced.wait()

    def _is_leader(self) -> bool:
        """Whether a write may go out now: we lead, and are not shutting down (``drain``). Every
        write checks it just before it is sent."""
        return not self._draining and self._leads()

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
            self._restore(list(self._cache.values()), tainted_only=True)
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
            self._recheck(name)
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
            self._later.cancel_all()

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
        conflicts = shed = 0
        while True:
            try:
                await self._reconcile_once(intent)
                return
            except KubeNotFound:
                log.info("node gone, dropped from remediation", extra={"node": node})
                self._cache_pop(node)
                self._forget(node)
                return
            except KubeConflict:
                conflicts += 1
                if conflicts == CONFLICT_ATTEMPTS:
                    raise
                await self._sleep(CONFLICT_BACKOFF_S * 2 ** (conflicts - 1))
            except KubeUnavailable as e:
                # Shed with a Retry-After (APF's 429): this worker waits as asked and tries again,
                # as client-go's REST client does, instead of moving on to the next node at full
                # rate. So under throttling the workers together send about one request per
                # worker per Retry-After, not ``qps``. Without one (no answer, a bare 5xx), or
                # after a few tries, the node goes to the queue's per-node backoff.
                shed += 1
                if e.retry_after is None or shed == SHED_ATTEMPTS:
                    raise
                await self._sleep(e.wait_s(RETRY_AFTER_MIN_S))
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
                rv = listed.resource_version
                while True:
                    opened = self._clock.monotonic()
                    delivered = False
                    try:
                        # aclosing: a cancelled run() closes the watch's HTTP stream at once.
                        async with aclosing(self._api.watch_nodes(resource_version=rv)) as events:
                            async for event in events:
                                if isinstance(event, WatchBookmark):
                                    # Nothing to cache, a newer point to resume from: after a
                                    # quiet spell the last Node change may be older than the
                                    # server's history, and resuming from it would LIST again.
                                    rv = event.resource_version
                                else:
                                    self._on_event(event)
                                    rv = event.node.resource_version
                                delivered = True  # a bookmark too: the watch works (client-go)
                                backoff = INFORMER_BACKOFF_S
                        if delivered or self._clock.monotonic() - opened >= INFORMER_SHORT_WATCH_S:
                            backoff = INFORMER_BACKOFF_S
                            continue
                        log.info(
                            "node watch ended at once, resuming it",
                            extra={"resource_version": rv, "retry_in_s": backoff},
                        )
                        await self._sleep(backoff)
                        backoff = min(backoff * 2, INFORMER_BACKOFF_MAX_S)
                    except KubeUnavailable as e:
                        if e.status not in WATCH_RETRY_STATUSES:
                            raise
                        # As client-go's reflector does: a throttled (429) or refused watch is
                        # resumed from where it ended after a backoff. Listing 7,500 Nodes again
                        # would add to the very load the API server is shedding.
                        wait = e.wait_s(backoff)
                        log.info(
                            "node watch refused, resuming it",
                            extra={"status": e.status, "resource_version": rv, "retry_in_s": wait},
                        )
                        await self._sleep(wait)
                        backoff = min(backoff * 2, INFORMER_BACKOFF_MAX_S)
            except KubeGone:
                # After a backoff, as client-go's reflector relists (wait.BackoffUntil): when
                # LISTs are slower than the watch cache's history, every watch from a fresh LIST
                # is 410 again, and listing back to back would add to the load that caused it.
                log.info("node watch too old, listing again", extra={"retry_in_s": backoff})
                await self._sleep(backoff)
                backoff = min(backoff * 2, INFORMER_BACKOFF_MAX_S)
            except Exception as e:
                # KubeUnavailable, KubeForbidden, or a bug: the informer must outlive all of them.
                wait = e.wait_s(backoff) if isinstance(e, KubeError) else backoff
                log.warning(
                    "node list/watch failed, retrying",
                    extra={
                        "error": str(e),
                        "error_type": type(e).__name__,
                        "status": getattr(e, "status", None),
                        "retry_in_s": wait,
                    },
                    exc_info=not isinstance(e, KubeError),
                )
                await self._sleep(wait)
                backoff = min(backoff * 2, INFORMER_BACKOFF_MAX_S)

    def _on_list(self, nodes: Sequence[Node]) -> None:
        listed = {n.name: n for n in nodes}
        for gone in self._cache.keys() - listed.keys():
            self._forget(gone)
        self._cache = listed
        self._pool_sizes = Tally(k8s_pool(n.labels) for n in listed.values())
        for n in nodes:
            self._note_preflight(n)
            self._note_no_execute(n)
        if not self._synced.is_set():
            self._was_leader = self._is_leader()  # this list's resync covers a leadership we hold
            self._restore(nodes)
            self._synced.set()
            log.info("remediation informer synced", extra={"nodes": len(nodes)})
        self.resync()

    def _restore(self, nodes: Sequence[Node], *, tainted_only: bool = False) -> None:
        """Hand the nodes carrying our taint or snapshot to ``IntentSource.restore``; with
        ``tainted_only`` (on gaining leadership), only those our taint keeps out: a snapshot
        alone says nothing the replica's own decisions do not say better by now."""
        now = self._clock.time()
        for n in nodes:
            self._restore_node(n, self._intents.restore, now, tainted_only=tainted_only)

    def restore_into(self, node: str, into: Restore, tainted_only: bool) -> bool:
        """Hand ``node``, as the informer last saw it, to ``into`` (``IntentSource.restore``'s
        signature) if it carries our taint or (unless ``tainted_only``) our snapshot, as the
        first list does; True if it did. For a node that moved to this shard while it runs
        (aggregator/shard/owned.py)."""
        cached = self._cache.get(node)
        if cached is None:
            return False
        return self._restore_node(cached, into, self._clock.time(), tainted_only=tainted_only)

    def settled(self, node: str, intent: NodeIntent) -> bool:
        """Whether ``node``, as the informer last saw it, shows ``intent``'s decision: our
        snapshot in the same state since the same time. Always in dry-run, where nothing is
        ever written (aggregator/shard/owned.py hands a moved node over once it is)."""
        if self._config.mode != "enforce":
            return True
        cached = self._cache.get(node)
        if cached is None:
            return False
        shown = recorded(cached, self._config).snapshot
        wanted = intent.snapshot
        return shown is not None and (shown.state, shown.since) == (wanted.state, wanted.since)

    def _restore_node(self, n: Node, into: Restore, now: float, *, tainted_only: bool) -> bool:
        # Only a taint we recorded applying is ours to restore from; a human's taint with our
        # key on a node we never wrote is theirs, and the node is left to them.
        mine = recorded(n, self._config)
        if not mine.taints and (tainted_only or mine.snapshot_text is None):
            return False
        if mine.snapshot_text is not None and mine.snapshot is None:
            log.warning("unreadable health snapshot, restoring from the taint alone", extra={"node": n.name})
        value = mine.taints[0].value if mine.taints else None
        into(n.name, mine.snapshot, value, now)
        return True

    def _on_event(self, event: NodeEvent) -> None:
        n = event.node
        if event.type == "DELETED":
            self._cache_pop(n.name)
            self._forget(n.name)
            return
        old = self._cache.get(n.name)
        self._cache_put(n)
        self._note_preflight(n)
        if n.resource_version in self._written_rv.get(n.name, ()):
            return  # the echo of our own write
        if old is None or self._relevant(old) != self._relevant(n):
            # Not known as ours yet, but it may be the echo of a write of ours that overtook the
            # write's answer (the API server sends both, and nothing orders them). If it was, the
            # re-check finds it among our writes and judges the cache without a read; read fresh,
            # these cost a token each, and after a 375-node storm they queued ahead of the next
            # fault for 7 s. Someone else's change never becomes ours, so it is read.
            self._unexplained.setdefault(n.name, set()).add(n.resource_version)
            self._recheck(n.name)

    def _relevant(self, n: Node) -> tuple[object, ...]:
        """What a reconcile depends on; the kubelet's status heartbeats change none of it."""
        p = self._config.annotation_prefix
        ours = tuple(sorted((k, v) for k, v in n.annotations.items() if k.startswith(p)))
        cond = next((c for c in n.conditions if c.type == self._config.condition_type), None)
        cond_key = None if cond is None else (cond.status, cond.reason, cond.message)
        # The pool label too: with sharding, a relabelled node may have moved to another shard.
        return (n.taints, ours, n.labels.get(self._config.managed_label), cond_key, k8s_pool(n.labels))

    def _note_preflight(self, n: Node) -> None:
        if any(t.key == self._config.preflight.taint_key for t in n.taints):
            self._preflight_seen.setdefault(n.name, self._clock.monotonic())
        else:
            self._preflight_seen.pop(n.name, None)
            self._preflight_warned.discard(n.name)

    def _forget(self, node: str) -> None:
        self._backoff.forget(node)
        self._written_rv.pop(node, None)
        self._unexplained.pop(node, None)
        self._from_cache.discard(node)
        self._preflight_seen.pop(node, None)
        self._preflight_warned.discard(node)
        self._dry_run_logged.pop(node, None)
        self._dropped.discard(node)
        self._later.cancel(node)

    async def _resync_loop(self) -> None:
        await self._synced.wait()
        while True:
            await self._sleep(self._config.resync_seconds)
            if not self._check_leadership():
                self.resync()

    # -- workers ----------------------------------------------------------------------------------

    async def _worker(self) -> None:
        await self._synced.wait()
        if self._ready is not None:
            await self._ready()
        while True:
            node = await self._queue.get()
            if self._draining:
                self._queue.done(node)  # the next leader's resync compares every node anyway
                continue
            self._busy += 1
            self._idle.clear()
            try:
                await self._reconcile_guarded(node)
            finally:
                self._queue.done(node)
                self._busy -= 1
                if self._busy == 0:
                    self._idle.set()

    async def drain(self, timeout_s: float) -> bool:
        """Send no more writes and wait, up to ``timeout_s``, for the reconciles under way to
        end: every write they sent answered (a reconcile sends nothing after its write in flight,
        as when leadership is lost). True when none is left.

        Called at shutdown before the elector releases the Lease: a write whose client gave up
        may still be applied (the API server runs a mutation it has begun to the end in the
        background, its ``finisher`` logging "post-timeout activity"), and once the Lease is
        released the next leader may already have read the node and written its own. Waiting for
        the answers while the Lease is still ours puts every write of ours before the release."""
        self._draining = True
        if self._idle.is_set():
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            log.warning(
                "shutting down with remediation writes unanswered",
                extra={"in_flight": self._busy, "waited_s": timeout_s},
            )
            return False
        return True

    async def _reconcile_guarded(self, node: str) -> None:
        started = self._clock.monotonic()
        try:
            # A resync or a watch event judges from the informer's copy, as client-go controllers
            # do, so a resync of 7,500 unchanged nodes costs no API call; a decision reads fresh.
            from_cache = node in self._from_cache and self._explained(node)
            self._from_cache.discard(node)
            self._unexplained.pop(node, None)  # this reconcile sees them: a read, or all ours
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
        self._backoff.forget(node)

    def _explained(self, node: str) -> bool:
        """Whether every watch event since the node's last reconcile began was a write of ours."""
        ours = self._written_rv.get(node, ())
        return all(rv in ours for rv in self._unexplained.get(node, ()))

    def _retry_later(self, node: str, error: Exception) -> None:
        delay = self._backoff.failed(node)
        if isinstance(error, KubeError):
            delay = error.wait_s(delay)
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
        self._later.after(node, delay)

    # -- one reconcile ----------------------------------------------------------------------------

    async def _reconcile_once(self, intent: NodeIntent) -> None:
        await self._bucket.acquire()
        node = await self._api.get_node(intent.node)
        if not self._is_leader():
            return  # lost the Lease while waiting: the new leader reconciles from here
        self._cache_put(node)
        self._note_preflight(node)
        plan = self._plan(node, intent)
        if plan.dry_run:
            self._log_dry_run(plan)
            return

        if plan.needs_patch:
            await self._bucket.acquire()
            if not self._is_leader():
                return  # every write re-checks: leadership can end while we wait for a token
            try:
                written = await self._while_leading(
                    self._api.patch_node(
                        node.name,
                        resource_version=node.resource_version,
                        taints=plan.taints if plan.taints_changed else None,
                        annotations=plan.annotations or None,
                    )
                )
            except KubeConflict:
                self._metrics.write(plan.patch_kind, "conflict")
                raise
            except KubeError:
                self._metrics.write(plan.patch_kind, "error")
                raise
            self._metrics.write(plan.patch_kind, "ok")
            timed = self._wrote(written)
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
            if plan.new_no_execute and not timed:
                # A server that kept no timeAdded: counted by our clock, once.
                self._no_execute.add((node.name, self._clock.time()))
            if plan.override_recorded:
                self._metrics.overrides.inc()

        if plan.condition is not None:
            await self._bucket.acquire()
            if not self._is_leader():
                return
            try:
                written = await self._while_leading(self._api.patch_node_condition(node.name, plan.condition))
            except KubeError:
                self._metrics.write("condition", "error")
                if plan.needs_patch:
                    # The patch recorded the change these events announce, so the retry will
                    # plan none: they go now, or never.
                    await self._emit_all(node, plan.events)
                raise
            self._metrics.write("condition", "ok")
            self._wrote(written)

        if plan.preflight_timeout:
            self._preflight_warned.add(node.name)
        await self._emit_all(node, plan.events)

    async def _emit_all(self, node: Node, events: Sequence[PlanEvent]) -> None:
        for ev in events:
            if not self._is_leader():
                return
            await self._emit(node, ev)

    async def _while_leading(self, call: Coroutine[Any, Any, T]) -> T:
        """``call``, abandoned (as ``KubeUnavailable``: retried like a lost answer) when our
        leadership may end first."""
        if self._leadership_left is None:
            return await call
        left = self._leadership_left()
        try:
            async with asyncio.timeout(left):
                return await call
        except TimeoutError:
            raise KubeUnavailable(
                f"write abandoned: leadership may end within {left:.1f} s", status=0
            ) from None

    def _wrote(self, node: Node) -> bool:
        """``node`` as our write left it: cached, its echo recognised; ``_cache_put``'s answer."""
        self._written_rv.setdefault(node.name, deque(maxlen=4)).append(node.resource_version)
        return self._cache_put(node)

    async def _emit(self, node: Node, ev: PlanEvent) -> None:
        await self._bucket.acquire()
        record = EventRecord(
            node=node.name,
            node_uid=node.uid,
            type=ev.type,
            reason=ev.reason,
            message=ev.message[:EVENT_MESSAGE_MAX],
        )
        for attempt in range(EVENT_ATTEMPTS):
            try:
                await self._while_leading(self._api.create_event(self._config.events_namespace, record))
            except KubeUnavailable as e:
                # Shed (429) or the API server restarting: nothing else will announce this
                # change, so it is tried again a second later (APF's Retry-After), a few times.
                self._metrics.write("event", "error")
                if attempt == EVENT_ATTEMPTS - 1 or not self._is_leader():
                    self._event_lost(node, ev, e)
                    return
                await self._sleep(e.wait_s(EVENT_RETRY_S))
                await self._bucket.acquire()
                continue
            except KubeError as e:
                self._metrics.write("event", "error")
                self._event_lost(node, ev, e)
                return
            self._metrics.write("event", "ok")
            return

    @staticmethod
    def _event_lost(node: Node, ev: PlanEvent, e: KubeError) -> None:
        log.warning(
            "event not recorded",
            extra={"node": node.name, "event_reason": ev.reason, "error": str(e), "status": e.status},
        )

    def _log_dry_run(self, plan: Plan) -> None:
        name = plan.node
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
                    "taints_before": _taints_text(plan.taints_before),
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
        return not self._plan(node, intent).empty

    def _plan(self, node: Node, intent: NodeIntent) -> Plan:
        """The planner's answer for ``node`` given the state kept here; logs what it warns of and
        arms the preflight deadline it asks to be woken at."""
        now = self._clock.time()
        if any(now - added >= NO_EXECUTE_WINDOW_S for _, added in self._no_execute):
            # Only the last hour counts: the set stays as short as the budget.
            self._no_execute = {(n, a) for n, a in self._no_execute if now - a < NO_EXECUTE_WINDOW_S}
        p = planner.plan(
            node,
            intent,
            self._config,
            now=now,
            monotonic=self._clock.monotonic(),
            no_execute_added=sorted(added for _, added in self._no_execute),
            preflight_since=self._preflight_seen.get(node.name),
            preflight_warned=node.name in self._preflight_warned,
        )
        for warning in p.warnings:
            log.warning(warning.message, extra=dict(warning.extra))
        if p.recheck_after is not None:
            self._later.after(node.name, p.recheck_after)
        return p
