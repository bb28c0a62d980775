"""One count of shards writes to Nodes at a time: the fence for a roll that changes N.

A change of ``sharding.shards`` rolls the StatefulSets, so for a while replicas with the old N and
replicas with the new N run side by side. Each shard elects on its own Lease, and the Lease of
shard i is the same object under both counts, but a pool moved by the change is owned by shard i
under the old N and by shard j under the new one: two Leases, two leaders, and both would write
the pool's Nodes, each from its own part of the reports (one lifting a taint the other just put
on). The same holds from one aggregator to N (the unsharded one elects on the base Lease, which
no shard uses) and back.

So every shard's leader writes its count on its Lease (the annotation ``SHARDS_ANNOTATION``), and
before it acts, each leader checks the namespace's Leases of the aggregator (the base name and
``<base>-shard-<i>``): while any of them is held, under another count, by a holder whose term is
not over, it holds back. The unsharded aggregator's leader checks the same way, as a count of one
on the base Lease, so the change from one to N and back is fenced on both sides. A Lease without
the annotation (an unsharded aggregator's, or one from before the annotation) counts as the base
name says: the base Lease as one shard; ``-shard-<i>`` as a count above i and above one (no
unsharded aggregator elects on it), so as ours unless i is past our shards. Terms are judged as the election
judges them (``aggregator.kube.leader``): by our own clock, from when we saw the record change,
for its ``leaseDurationSeconds``; a Lease that vanished counts as changed when we saw it gone.

Both sides of a roll hold back while both are live: a leader writes only after a check that
started once it had taken its Lease (``elected``: a standby's earlier check may have seen the
other count's Leases released just before one of its replicas took one), and that check sees
the other count's Leases held; an old leader sees the new count's at its next check, a retry
period later, and the new one has not written meanwhile. Once the old
replicas are gone (their Leases released, or not renewed for a lease duration) the new ones act,
and their first act is the resync every gain of leadership does. Decisions made meanwhile are in
the decision log and are written then.

Why that is enough: of two leaders of different counts, the one that took its Lease later made
its first check after that, while the other's Lease was held and renewed (a leader that cannot
renew stops writing at its renew deadline, inside the lease duration the fence waits out), so it
saw that Lease live and holds back. So a check's answer stands until the next check succeeds or
the Lease is taken again (``elected``); a check that fails (the API unreachable, a LIST slower
than the retry period) changes nothing. A record's term is counted from when the LIST that showed
it changed had returned, as the election counts it from when it read it (client-go's
observedTime): the holder may have renewed it while the LIST was on its way.

Sharded, ``list`` on Leases is required (docs/deploy.md): a leader whose Role has never allowed it
never writes (one whose Role lost it keeps its last answer, like any failed check). The
unsharded aggregator, which must not gain a way to stop writing for a guard that only matters
while N changes, writes as it did before the fence where its RBAC does not allow ``list`` (a Role
from before the fence, which it did not need then), and says so (``enforced`` is False, a
warning in the log, ``/api/v1/remediation``), unless its last check found another count live.
That does not let two counts write at once: the other count's fence holds back while our Lease is
held.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from agent.clock import Clock
from aggregator.config import LeaderConfig
from aggregator.kube.api import KubeApi
from aggregator.kube.leader import LeaseRecord
from aggregator.kube.objects import KubeError, KubeForbidden, Lease
from aggregator.ratelog import RateLimitedLog

log = logging.getLogger(__name__)
_ratelog = RateLimitedLog(log)

SHARDS_ANNOTATION: Final = "gpuwarden.io/shards"


@dataclass(frozen=True, slots=True)
class _Seen:
    record: LeaseRecord | None  # None: the Lease is gone
    shards: int  # the count it was held under
    changed_at: float  # monotonic time we saw the record change (or the Lease vanish)
    duration: float  # the holder's term from then


class ShardFence:
    """Whether this shard's leader may write now (``clear``); ``run`` is the checking loop."""

    def __init__(
        self,
        api: KubeApi,
        leader: LeaderConfig,
        *,
        base: str,
        shards: int,
        clock: Clock,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        """``leader``: the shard's election settings (its namespace and timings); ``base``: the
        Lease name without the shard suffix; ``shards``: this replica's count (1: unsharded, on
        the base Lease); ``on_change``: called when ``clear`` flips at a check (the actuator's
        resync on gaining the right to write)."""
        self._api = api
        self._namespace = leader.namespace
        self._retry_s = leader.retry_period_seconds
        self._base = base
        self._pattern = re.compile(re.escape(base) + r"-shard-(\d+)")
        self.shards = shards
        self._clock = clock
        self._on_change = on_change
        self._seen: dict[str, _Seen] = {}
        self._open = False  # the last check found no other count live
        self.others: tuple[str, ...] = ()  # the Leases the last check held back for
        # Bumped by ``elected``: a check that started before it says nothing about the time after.
        self._epoch = 0
        self._reported = False  # what ``on_change`` was last told ``clear`` is
        self._wake = asyncio.Event()
        # Unsharded and refused ``list`` on Leases: nothing to check with, so not enforced (the
        # module docstring). Until a check succeeds.
        self.enforced = True

    # -- what the actuator reads ------------------------------------------------------------------

    @property
    def clear(self) -> bool:
        """No other count of shards was live at the last check that succeeded since this replica
        took its Lease (or the fence is not ``enforced``)."""
        return self._open or not self.enforced

    def time_left(self) -> float:
        """Seconds ``clear`` stays True without another check: until a check says otherwise, or
        none when it is False."""
        return math.inf if self.clear else 0.0

    # -- checking -----------------------------------------------------------------------------------

    def count_of(self, lease: Lease) -> int | None:
        """The count of shards ``lease`` is held under; None for a Lease not the aggregator's."""
        if lease.name == self._base:
            named = 1
        elif (m := self._pattern.fullmatch(lease.name)) is not None:
            index = int(m[1])
            named = self.shards if index < self.shards and self.shards > 1 else max(index + 1, 2)
        else:
            return None
        stamp = lease.annotations.get(SHARDS_ANNOTATION, "")
        return int(stamp) if stamp.isdecimal() and int(stamp) > 0 else named

    def elected(self) -> None:
        """This replica has just taken its shard's Lease: only a check that starts now may clear
        it to write. One made before (a standby checks too) may have seen the other count's
        Leases released just before one of its replicas took one, which this replica's
        acquisition does not change; the loop checks again at once."""
        self._epoch += 1
        self._open = False
        # The caller tells the actuator now (not writing); the check that clears it tells it
        # again, which is its gain of the right to write (a resync), even if a standby's check
        # had cleared it before.
        self._reported = False
        self._wake.set()

    async def check(self) -> bool:
        """Read the Leases once; returns ``clear``. ``KubeError`` propagates (the last check
        stands)."""
        started = self._clock.monotonic()
        epoch = self._epoch
        leases = await self._api.list_leases(self._namespace)
        returned = self._clock.monotonic()
        present: set[str] = set()
        for lease in leases:
            count = self.count_of(lease)
            if count is None:
                continue
            present.add(lease.name)
            record = LeaseRecord.of(lease)
            before = self._seen.get(lease.name)
            changed_at = returned if before is None or before.record != record else before.changed_at
            duration = float(record.lease_duration_seconds or 0)
            self._seen[lease.name] = _Seen(record, count, changed_at, duration)
        for name, seen in list(self._seen.items()):
            if name in present:
                continue
            if seen.record is not None:
                # Deleted under its holder: its term runs from now, as the election counts it.
                self._seen[name] = _Seen(None, seen.shards, returned, seen.duration)
            elif seen.changed_at + seen.duration <= started:
                del self._seen[name]
        others = tuple(
            sorted(
                name
                for name, seen in self._seen.items()
                if seen.shards != self.shards
                and (seen.record is None or seen.record.holder is not None)
                and seen.changed_at + seen.duration > started
            )
        )
        if not self.enforced:
            log.info("the shard fence can read the Leases now: enforced", extra={"shards": self.shards})
            self.enforced = True
        if epoch != self._epoch:
            return self.clear  # the Lease was taken meanwhile: this check is from before it
        self._open = not others
        if others != self.others:
            if others:
                log.warning(
                    "another count of shards is live: not writing to Nodes until it is gone",
                    extra={"shards": self.shards, "leases": list(others)},
                )
            else:
                log.info("no other count of shards is live", extra={"shards": self.shards})
        self.others = others
        self._report()
        return self.clear

    def _report(self) -> None:
        """Tell ``on_change`` when ``clear`` differs from what it was last told: after a check, or
        after ``elected`` or a refused ``list`` changed it (the actuator resyncs when it turns True
        again)."""
        clear = self.clear
        if clear != self._reported:
            self._reported = clear
            if self._on_change is not None:
                self._on_change()

    async def run(self) -> None:
        """Check every retry period (at once after ``elected``) until cancelled."""
        while True:
            self._wake.clear()
            try:
                await self.check()
            except KubeError as exc:
                if isinstance(exc, KubeForbidden) and self.shards == 1 and not self.others:
                    # Unsharded, with a Role without list (from before the fence, or reverted to
                    # one): write as before the fence did, as a fresh start with that Role would.
                    # Not while the last check found another count live: that stands.
                    if self.enforced:
                        log.warning(
                            "no permission to list Leases: writing without the shard fence, so a "
                            "change to N shards is not fenced on this side (grant list on Leases)",
                            extra={"error": str(exc)},
                        )
                    self.enforced = False
                else:
                    _ratelog.warning(
                        "shard_fence_check_failed",
                        "cannot read the aggregator's Leases: the last check stands until one succeeds",
                        extra={"error": str(exc), "status": exc.status},
                    )
            except Exception:
                # A fence whose loop ended would hold this shard's writes for good, silently.
                _ratelog.warning(
                    "shard_fence_check_crashed", "the shard fence's check failed; retrying", exc_info=True
                )
            self._report()
            if not self._wake.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self._retry_s)
