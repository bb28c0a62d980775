"""Leader election on a coordination.k8s.io/v1 Lease, with the semantics of client-go's
``tools/leaderelection`` (kubernetes/kubernetes,
``staging/src/k8s.io/client-go/tools/leaderelection/leaderelection.go``: ``tryAcquireOrRenew``,
``acquire``, ``renew``, ``release``, ``isLeaseValid``).

Every aggregator replica ingests every report, but only the leader writes to Nodes. The rules,
as client-go has them:

- **Expiry is judged by our own clock, never by the record's timestamps.** We remember the
  record (holder, leaseDurationSeconds, acquireTime, renewTime, leaseTransitions) we last saw and
  the local monotonic time at which we saw it *change*. Another holder's lease is valid until
  that observation time plus the record's ``leaseDurationSeconds``; ``renewTime`` is only used to
  notice that the holder is still writing. So clock skew between replicas does not matter (only
  a difference in clock *rate* would), and a lease left by a dead replica whose renewTime is far
  in the past is still honoured for a full lease duration from the moment we first saw it.
  Annotations are not part of the record: a breaker state written by a follower does not look
  like a renewal.
- **Acquire** when the Lease is absent (create it), has no holder (released), is held by us (a
  restart under the same identity), or has expired as above. Unlike client-go, a Lease that
  vanished (``kubectl delete lease``) after we saw another replica hold it is not created at
  once: the deletion counts as a change of the record, and we wait a lease duration from when we
  saw it, by which time the holder has recreated it (it renews every retry period: a deleted
  Lease is recreated by its own leader) or stopped acting. A leader whose recreation loses to
  another replica's steps down at once, and ``update_annotations`` never creates a holderless
  Lease (which reads as released) while a holder may be acting. Taking it from another holder (or
  from nobody) increments ``leaseTransitions`` and sets ``acquireTime``. Every write is a PUT with
  the ``resourceVersion`` we read, so of two candidates racing for an expired lease only one wins;
  it is the object as read with only the election fields and annotations changed, so what others
  put on the Lease (labels, finalizers, owners, newer spec fields) stays.
- **Renew** every retry period: first optimistically by a PUT of the copy we last wrote (the
  resourceVersion precondition makes a stale copy fail with a conflict instead of overwriting
  what someone else wrote, such as annotations), then by re-reading and writing again.
- **Step down** when no renewal has succeeded within ``renew_deadline`` of the start of the last
  successful one: ``is_leader`` turns False by the clock at that instant, without waiting for the
  API to answer, and the loop wakes at the deadline to call ``on_stopped``. Since
  ``renew_deadline < lease_duration``, we stop acting before any other replica may take over.
  Unlike client-go, a leader that reads a record naming another holder steps down at once
  rather than at its deadline: someone else is already acting, so waiting only overlaps us.
  After stepping down a replica competes for the lease again like any other.
- **Release** on cancellation (client-go's ``ReleaseOnCancel``): a PUT with no holder and a lease
  duration of 1 s, so a follower takes over on its next try instead of waiting for expiry.
  Unlike client-go, which tries once, a release the API server refuses for now (429, 5xx) is
  retried a second later within the renew deadline: a lost release costs a lease duration with
  no leader.
  ``on_stopped`` is called before the release, so our writes have stopped when others may start.
- Candidates retry every retry period jittered as ``wait.JitterUntil`` does (up to
  ``JITTER_FACTOR`` times the period on top), so replicas started together spread out.

API failures never end the loop: they are logged and retried on the next period. The Lease's
annotations double as a small store shared by all replicas (the safety limits keep their breaker
state there, so it survives fail-over and restarts): ``update_annotations`` is a read-modify-write
with a resourceVersion precondition, usable by any replica.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from types import MappingProxyType

from agent.clock import Clock
from agent.errors import ConfigError
from aggregator.config import LeaderConfig
from aggregator.kube.api import KubeApi
from aggregator.kube.objects import KubeConflict, KubeError, KubeNotFound, KubeUnavailable, Lease

log = logging.getLogger(__name__)

JITTER_FACTOR = 1.2  # client-go's leaderelection.JitterFactor
ANNOTATION_ATTEMPTS = 5  # conflicts come from renewals every retry period: a few re-reads suffice
RELEASE_ATTEMPTS = 5  # conflicts and refusals together; 3 % of requests 429d leaves 2e-8 unreleased
RELEASE_BACKOFF_S = 1.0  # APF answers 429 with Retry-After: 1


def format_micro_time(unix_seconds: float) -> str:
    """A metav1.MicroTime as the API server serializes it: RFC 3339, microseconds, UTC 'Z'."""
    return datetime.fromtimestamp(unix_seconds, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """The election part of a Lease (client-go's LeaderElectionRecord): what a change of means
    that the holder is alive. Annotations and resourceVersion are deliberately left out."""

    holder: str | None
    lease_duration_seconds: int | None
    acquire_time: str | None
    renew_time: str | None
    transitions: int

    @classmethod
    def of(cls, lease: Lease) -> LeaseRecord:
        return cls(
            holder=lease.holder or None,
            lease_duration_seconds=lease.lease_duration_seconds,
            acquire_time=lease.acquire_time,
            renew_time=lease.renew_time,
            transitions=lease.transitions,
        )


class LeaderElector:
    """One replica's side of the election. ``run`` is the loop (one task per process);
    ``is_leader`` is what every Node write checks first. ``on_started``/``on_stopped`` are called
    from the loop on each transition and must return quickly (set a flag, wake a task)."""

    def __init__(
        self,
        api: KubeApi,
        config: LeaderConfig,
        *,
        identity: str,
        clock: Clock,
        on_started: Callable[[], None] | None = None,
        on_stopped: Callable[[], None] | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: random.Random | None = None,
        stamp: Mapping[str, str] | None = None,
    ) -> None:
        """``stamp``: annotations every election write of ours puts on the Lease (a shard's
        count of shards, which ``aggregator.shard.fence`` reads)."""
        if not identity:
            raise ConfigError("leader election: identity must not be empty")
        if config.lease_duration_seconds <= config.renew_deadline_seconds:
            raise ConfigError(
                "remediation.leader: lease_duration_seconds "
                f"({config.lease_duration_seconds}) must be greater than renew_deadline_seconds "
                f"({config.renew_deadline_seconds})"
            )
        if config.renew_deadline_seconds <= JITTER_FACTOR * config.retry_period_seconds:
            raise ConfigError(
                "remediation.leader: renew_deadline_seconds "
                f"({config.renew_deadline_seconds}) must be greater than {JITTER_FACTOR} x "
                f"retry_period_seconds ({config.retry_period_seconds})"
            )
        self._api = api
        self._config = config
        self._identity = identity
        self._clock = clock
        self._on_started = on_started
        self._on_stopped = on_stopped
        self._sleep = sleep
        # Seeded by identity: deterministic per replica, different between replicas.
        self._rng = rng if rng is not None else random.Random(identity)
        # The Lease carries whole seconds; rounding up keeps lease_duration > renew_deadline.
        self._lease_seconds = math.ceil(config.lease_duration_seconds)
        self._stamp = dict(stamp or {})
        self._lease: Lease | None = None  # last read or written: its resourceVersion is our precondition
        self._observed: LeaseRecord | None = None
        self._observed_at = 0.0  # monotonic time the record last changed in our eyes
        # The Lease was absent when last read, after a record naming another holder (``_create``).
        self._absent = False
        self._leading = False
        self._renewed_at = -math.inf  # monotonic start of the last successful acquire/renew
        # One lease operation at a time from this replica, so our own annotation writes and
        # renewals never conflict with each other or leave an older copy cached.
        self._lock = asyncio.Lock()

    # -- what the rest of the aggregator reads ---------------------------------------------------

    @property
    def identity(self) -> str:
        return self._identity

    @property
    def is_leader(self) -> bool:
        """True only while we hold the lease as last seen and our last renewal is younger than
        the renew deadline: it turns False by the clock, without waiting for an API answer."""
        observed = self._observed
        return (
            self._leading
            and observed is not None
            and observed.holder == self._identity
            and self._clock.monotonic() < self._deadline()
        )

    def time_left(self) -> float:
        """Seconds until we stop leading unless a renewal succeeds first (0 when not leading):
        what a write may take, so that it cannot land after another replica may lead."""
        if not self.is_leader:
            return 0.0
        return max(0.0, self._deadline() - self._clock.monotonic())

    @property
    def leader(self) -> str | None:
        return self._observed.holder if self._observed is not None else None

    @property
    def lease_read(self) -> bool:
        """Whether this replica has read (or written) the Lease at least once: before that its
        ``annotations`` say nothing about what the Lease holds."""
        return self._lease is not None

    @property
    def annotations(self) -> Mapping[str, str]:
        return MappingProxyType(dict(self._lease.annotations) if self._lease is not None else {})

    # -- the loop ----------------------------------------------------------------------------------

    async def run(self) -> None:
        """Compete for the lease and hold it until cancelled; on cancellation stop leading,
        release the lease if we hold it, and re-raise."""
        try:
            while True:
                await self._acquire()
                await self._renew()
        except asyncio.CancelledError:
            self._step_down("shutting down")
            await self._release()
            raise

    async def _acquire(self) -> None:
        log.info("waiting for leadership", extra=self._extra())
        while True:
            if await self._attempt():
                self._start_leading()
                return
            period = self._config.retry_period_seconds
            await self._sleep(period + self._rng.random() * JITTER_FACTOR * period)

    async def _renew(self) -> None:
        while self._leading:
            remaining = self._deadline() - self._clock.monotonic()
            if remaining <= 0:
                self._step_down("no successful renewal within the renew deadline")
                return
            # Waking at the deadline at the latest makes on_stopped as prompt as is_leader.
            await self._sleep(min(self._config.retry_period_seconds, remaining))
            if self._clock.monotonic() >= self._deadline():
                self._step_down("no successful renewal within the renew deadline")
                return
            await self._attempt()

    async def _attempt(self) -> bool:
        """One tryAcquireOrRenew, bounded so that a hung call cannot outlive our leadership."""
        started = self._clock.monotonic()
        budget = self._deadline() - started if self._leading else self._config.renew_deadline_seconds
        try:
            async with asyncio.timeout(max(budget, 0.0)):
                async with self._lock:
                    acquired = await self._try_acquire_or_renew()
        except TimeoutError:
            log.warning("lease request timed out", extra=self._extra())
            return False
        except KubeError as exc:
            log.warning(
                "lease request failed",
                extra=self._extra(error=str(exc), status=exc.status),
            )
            return False
        if acquired:
            self._renewed_at = started
        return acquired

    async def _try_acquire_or_renew(self) -> bool:
        now = format_micro_time(self._clock.time())
        cached = self._lease
        if self._leading and cached is not None and cached.holder == self._identity:
            # Fast path: a leader assumes nobody wrote since its own last write.
            try:
                written = await self._api.replace_lease(
                    replace(
                        cached,
                        renew_time=now,
                        lease_duration_seconds=self._lease_seconds,
                        annotations=self._stamped(cached.annotations),
                    )
                )
            except KubeError as exc:
                log.debug(
                    "optimistic renewal failed, re-reading the lease",
                    extra=self._extra(error=str(exc)),
                )
            else:
                self._observe(written)
                return True

        try:
            current = await self._api.get_lease(self._config.namespace, self._config.lease_name)
        except KubeNotFound:
            return await self._create(now)

        self._observe(current)
        holder = current.holder or None
        if holder is not None and holder != self._identity:
            if self._leading:
                self._step_down(f"the lease is now held by {holder}")
                return False
            if self._observed_valid():
                return False
        if holder == self._identity:
            acquire_time, transitions = current.acquire_time, current.transitions
        else:
            acquire_time, transitions = now, current.transitions + 1
        written = await self._api.replace_lease(
            replace(
                current,
                holder=self._identity,
                lease_duration_seconds=self._lease_seconds,
                acquire_time=acquire_time,
                renew_time=now,
                transitions=transitions,
                annotations=self._stamped(current.annotations),
            )
        )
        self._observe(written)
        return True

    async def _create(self, now: str) -> bool:
        """The Lease is absent: create it holding it, unless another replica's term may not be
        over.

        Someone deleted the Lease (``kubectl delete lease``), or it never existed. If the record
        we last saw named another holder, that holder may still be leading: it acts until its
        own renew deadline, and a follower that created the Lease at once would lead beside it.
        So the deletion counts as a change of the record, seen now: we create only once a lease
        duration has passed since, by which time that holder has recreated the Lease (it is
        alive) or stopped acting (``renew_deadline < lease_duration``). A leader whose Lease was
        deleted recreates it and goes on; if another replica created it first, it steps down at
        once."""
        observed = self._observed
        if observed is not None and observed.holder not in (None, self._identity):
            if not self._absent:
                self._absent = True
                self._observed_at = self._clock.monotonic()
                log.warning("the lease was deleted; waiting out its holder's term", extra=self._extra())
            if self._observed_valid():
                return False
        try:
            created = await self._api.create_lease(
                Lease(
                    name=self._config.lease_name,
                    namespace=self._config.namespace,
                    resource_version="",
                    holder=self._identity,
                    lease_duration_seconds=self._lease_seconds,
                    acquire_time=now,
                    renew_time=now,
                    transitions=0,
                    annotations=dict(self._stamp),
                )
            )
        except KubeConflict:
            # Another replica created it between our read and our write: it may lead now.
            self._step_down("another replica created the lease")
            raise
        self._observe(created)
        return True

    async def _release(self) -> None:
        """Hand the lease back (holder cleared, duration 1 s) if we hold it as last seen.

        client-go tries once; a release that fails leaves the lease to expire, and then no
        replica leads for up to a lease duration. So, within the renew deadline: a conflict
        re-reads (someone wrote annotations since), and a 429, 5xx or no answer waits
        ``RELEASE_BACKOFF_S`` (what APF's ``Retry-After: 1`` asks), or the server's Retry-After
        if longer, and tries again.
        """
        try:
            # Shutdown must not hang on an unreachable API: the lease then simply expires.
            async with asyncio.timeout(self._config.renew_deadline_seconds):
                for _ in range(RELEASE_ATTEMPTS):
                    lease = self._lease
                    if lease is None or lease.holder != self._identity:
                        return
                    now = format_micro_time(self._clock.time())
                    released = replace(
                        lease, holder=None, lease_duration_seconds=1, acquire_time=now, renew_time=now
                    )
                    try:
                        async with self._lock:
                            try:
                                written = await self._api.replace_lease(released)
                            except KubeConflict:
                                self._observe(
                                    await self._api.get_lease(self._config.namespace, self._config.lease_name)
                                )
                                continue
                    except KubeUnavailable as exc:
                        log.warning(
                            "lease release refused for now, retrying",
                            extra=self._extra(error=str(exc), status=exc.status),
                        )
                        await self._sleep(exc.wait_s(RELEASE_BACKOFF_S))
                        continue
                    self._observe(written)
                    log.info("released the lease", extra=self._extra())
                    return
        except (KubeError, TimeoutError) as exc:
            log.warning("could not release the lease", extra=self._extra(error=str(exc)))
            return
        log.warning("could not release the lease: it kept failing", extra=self._extra())

    # -- annotations: a small store shared by all replicas ------------------------------------------

    async def update_annotations(self, changes: Mapping[str, str | None]) -> None:
        """Set (or, for None, delete) annotations of the Lease, keeping its election fields as
        read; creates a holderless Lease if there is none yet and none was seen held (if one was,
        ``KubeUnavailable``: the election recreates it). Retries on conflict and raises
        ``KubeConflict`` after ``ANNOTATION_ATTEMPTS``; other ``KubeError``s propagate at once."""
        last: KubeConflict | None = None
        for _ in range(ANNOTATION_ATTEMPTS):
            async with self._lock:
                try:
                    current: Lease | None = await self._api.get_lease(
                        self._config.namespace, self._config.lease_name
                    )
                except KubeNotFound:
                    current = None
                try:
                    if current is None:
                        observed = self._observed
                        if observed is not None and observed.holder is not None:
                            # Deleted under a holder (maybe us): a holderless Lease would read as
                            # released, and a follower would lead at once beside the holder. The
                            # election recreates it (``_create``); the caller tries again later.
                            raise KubeUnavailable(
                                f"lease {self._config.namespace}/{self._config.lease_name} is absent "
                                f"while {observed.holder} may hold it; the election recreates it",
                                status=404,
                            )
                        written = await self._api.create_lease(
                            Lease(
                                name=self._config.lease_name,
                                namespace=self._config.namespace,
                                resource_version="",
                                holder=None,
                                lease_duration_seconds=None,
                                acquire_time=None,
                                renew_time=None,
                                annotations={k: v for k, v in changes.items() if v is not None},
                            )
                        )
                    else:
                        merged = dict(current.annotations)
                        for key, value in changes.items():
                            if value is None:
                                merged.pop(key, None)
                            else:
                                merged[key] = value
                        if merged == dict(current.annotations):
                            self._observe(current)
                            return
                        written = await self._api.replace_lease(replace(current, annotations=merged))
                except KubeConflict as exc:
                    last = exc
                    continue
                self._observe(written)
                return
        raise KubeConflict(
            f"lease {self._config.namespace}/{self._config.lease_name}: annotations not updated "
            f"after {ANNOTATION_ATTEMPTS} conflicting attempts",
            status=409,
        ) from last

    # -- bookkeeping ---------------------------------------------------------------------------------

    def _stamped(self, annotations: Mapping[str, str]) -> Mapping[str, str]:
        if all(annotations.get(k) == v for k, v in self._stamp.items()):
            return annotations
        return {**annotations, **self._stamp}

    def _deadline(self) -> float:
        return self._renewed_at + self._config.renew_deadline_seconds

    def _observe(self, lease: Lease) -> None:
        self._lease = lease
        self._absent = False
        record = LeaseRecord.of(lease)
        if record == self._observed:
            return
        previous = self._observed.holder if self._observed is not None else None
        self._observed = record
        self._observed_at = self._clock.monotonic()
        if record.holder != previous:
            log.info("lease holder changed", extra=self._extra(previous_holder=previous))

    def _observed_valid(self) -> bool:
        if self._observed is None:
            return False
        duration = self._observed.lease_duration_seconds or 0
        return self._observed_at + duration > self._clock.monotonic()

    def _start_leading(self) -> None:
        self._leading = True
        log.info("became leader", extra=self._extra())
        self._call(self._on_started, "on_started")

    def _step_down(self, reason: str) -> None:
        if not self._leading:
            return
        self._leading = False
        log.warning("stopped leading", extra=self._extra(reason=reason))
        self._call(self._on_stopped, "on_stopped")

    def _call(self, callback: Callable[[], None] | None, name: str) -> None:
        if callback is None:
            return
        try:
            callback()
        except Exception:
            # A broken callback must not end the election: the replica would keep the lease
            # without renewing it, and nobody could take over for a lease duration.
            log.exception("leader election callback failed", extra=self._extra(callback=name))

    def _extra(self, **fields: object) -> dict[str, object]:
        observed = self._observed
        return {
            "lease": f"{self._config.namespace}/{self._config.lease_name}",
            "identity": self._identity,
            "holder": observed.holder if observed is not None else None,
            "transitions": observed.transitions if observed is not None else None,
            **fields,
        }
