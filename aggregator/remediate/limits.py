"""Safety limits: never take down half a cluster by mistake.

Checked before every new quarantine (a decision that would add our taint), in the pipeline, so
that live service, replay and every replica decide ``held`` the same way:

- at most ``max_pool_share`` of a pool out at once (quarantined or on probation under our taint),
  but a pool may always lose ``min_pool_allowance`` nodes (10 % of an 8-node pool is no node);
- at most ``max_per_domain`` nodes out in one rack, and in one leaf switch: many failures under
  one switch are the switch's, which a node taint does not fix;
- at most ``max_per_hour`` new quarantines fleet-wide in any sliding hour.

Past a limit the breaker opens (as NVSentinel's circuit breaker and the node lifecycle
controller's zone states do): this and every later new quarantine is ``held`` (the decision
stands and is logged, no taint is applied, on-call is alerted once) until a human resets the
breaker (``gpuwarden breaker reset`` or ``POST /api/v1/breaker/reset``). It never closes by
itself, because "the fleet looked better a minute later" is exactly what a flapping systemic
problem looks like. Releases are never held: letting a node back in cannot take a cluster down.

Sharded (aggregator/shard/, docs/sharding.md), a pool and its racks and leaves live on one shard,
so the pool and domain limits stay where they are. The hourly limit is the fleet's: each of N
shards gets ``max_per_hour // N`` of it (``shard_limits``), so the shards together never take
out more than ``max_per_hour`` in an hour, with no coordination on the path of a decision. Each
shard's count comes back from the cluster on a restart or fail-over as today (``remember_taint``,
from the snapshots of the nodes of its own pools). What it costs: a shard cannot borrow another's
unused share (a burst confined to one shard's pools holds after ``max_per_hour // N``), and in
the hour after a change of N the count of the moved pools moves with them, so a shard may meet
quarantines it did not make and the others are not told: the fleet's total in that hour is at
most twice ``max_per_hour`` in the worst case (all of it concentrated in the moved pools).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from agent.errors import ConfigError
from aggregator.config import LimitsConfig
from aggregator.fleet.pools import Placement

log = logging.getLogger(__name__)

HOUR = 3600.0


class BreakerState(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """The breaker as operators and the Lease annotation see it."""

    open: bool = False
    since: float | None = None  # when it opened (aggregator time)
    reason: str | None = None  # the limit that opened it, in words
    limit: str | None = None  # pool_share | domain | per_hour
    reset_at: float | None = None  # the last reset
    reset_by: str | None = None  # who reset it (audited)


@dataclass(frozen=True)
class Hold:
    limit: str  # "pool_share" | "domain" | "per_hour" | "breaker"
    reason: str  # one line for the decision and the alert


_ENC = msgspec.json.Encoder()
_DEC = msgspec.json.Decoder(BreakerState)


def shard_limits(config: LimitsConfig, shards: int) -> LimitsConfig:
    """One shard's limits: the pool and domain limits as they are, ``max_per_hour // shards``.
    Refuses a share of zero (more shards than quarantines an hour): no shard could ever act."""
    if shards == 1:
        return config
    share = config.max_per_hour // shards
    if share < 1:
        raise ConfigError(
            f"remediation.limits.max_per_hour ({config.max_per_hour}) is below sharding.shards "
            f"({shards}): each shard's share of the hourly limit would be zero"
        )
    return msgspec.structs.replace(config, max_per_hour=share)


def encode_breaker(state: BreakerState) -> str:
    return _ENC.encode(state).decode()


def decode_breaker(text: str) -> BreakerState | None:
    try:
        return _DEC.decode(text)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


class SafetyLimits:
    def __init__(self, config: LimitsConfig) -> None:
        self.config = config
        self._state = BreakerState()
        self._taints: deque[float] = deque()  # times of new quarantines that tainted, last hour

    @property
    def state(self) -> BreakerState:
        return self._state

    @property
    def open(self) -> bool:
        return self._state.open

    def check(
        self,
        node: str,
        placement: Placement,
        out: Iterable[Placement],
        pool_size: int,
        now: float,
    ) -> Hold | None:
        """May ``node`` be tainted now? ``out``: the placements of the nodes already out under our
        taint (not counting ``node``); ``pool_size``: how many nodes its pool has. None: yes, and
        the quarantine is counted. A Hold opens the breaker (when it was closed)."""
        cfg = self.config
        if self._state.open:
            return Hold(
                "breaker", f"safety breaker open since {self._state.reason}; held until a human resets it"
            )
        while self._taints and now - self._taints[0] >= HOUR:
            self._taints.popleft()
        hold: Hold | None = None
        pool_out = rack_out = leaf_out = 0
        for p in out:
            if p.pool == placement.pool:
                pool_out += 1
            if placement.rack is not None and p.rack == placement.rack:
                rack_out += 1
            if placement.leaf is not None and p.leaf == placement.leaf:
                leaf_out += 1
        allowed = max(cfg.min_pool_allowance, math.floor(cfg.max_pool_share * max(pool_size, 1)))
        if pool_out + 1 > allowed:
            hold = Hold(
                "pool_share",
                f"pool {placement.pool}: {pool_out + 1} of {pool_size} nodes would be out, "
                f"over the limit of {allowed} ({cfg.max_pool_share:.0%})",
            )
        elif placement.rack is not None and rack_out + 1 > cfg.max_per_domain:
            hold = Hold(
                "domain",
                f"rack {placement.rack}: {rack_out + 1} nodes would be out, over the limit of "
                f"{cfg.max_per_domain} per failure domain (a rack-wide cause?)",
            )
        elif placement.leaf is not None and leaf_out + 1 > cfg.max_per_domain:
            hold = Hold(
                "domain",
                f"leaf {placement.leaf}: {leaf_out + 1} nodes would be out, over the limit of "
                f"{cfg.max_per_domain} per failure domain (a switch-wide cause?)",
            )
        elif len(self._taints) + 1 > cfg.max_per_hour:
            hold = Hold(
                "per_hour",
                f"{len(self._taints) + 1} new quarantines within an hour, "
                f"over the limit of {cfg.max_per_hour}",
            )
        if hold is None:
            self._taints.append(now)
            return None
        self._state = BreakerState(
            open=True,
            since=now,
            reason=f"{_clock(now)} ({node}: {hold.reason})",
            limit=hold.limit,
            reset_at=self._state.reset_at,
            reset_by=self._state.reset_by,
        )
        log.error(
            "safety breaker opened",
            extra={"node": node, "limit": hold.limit, "reason": hold.reason, "pool": placement.pool},
        )
        return hold

    def remember_taint(self, at: float, now: float) -> None:
        """A quarantine that tainted before we started (restored from the cluster) still counts
        toward the hourly limit, so a restart does not double the hour's allowance."""
        if now - at < HOUR:
            self._taints.append(at)
            self._taints = deque(sorted(self._taints))

    def reset(self, by: str, now: float) -> BreakerState:
        """A human closed the breaker; the hourly count starts over so that the backlog of held
        nodes is judged afresh (they still count against the pool and domain limits)."""
        was = self._state
        self._state = BreakerState(open=False, reset_at=now, reset_by=by)
        self._taints.clear()
        log.warning(
            "safety breaker reset",
            extra={"by": by, "was_open": was.open, "reason": was.reason or ""},
        )
        return self._state

    def adopt(self, state: BreakerState) -> bool:
        """Take the breaker state another replica (or our previous life) stored in the Lease.
        Returns True when ours changed. An open breaker is adopted; a reset newer than our own
        opening closes ours, so a reset on any replica closes the breaker everywhere."""
        mine = self._state
        if state.open and not mine.open:
            if state.since is not None and mine.reset_at is not None and mine.reset_at > state.since:
                return False  # we saw a reset after it opened: stale
            self._state = state
            return True
        if (
            not state.open
            and mine.open
            and state.reset_at is not None
            and (mine.since is None or state.reset_at >= mine.since)
        ):
            self._state = state
            self._taints.clear()
            return True
        return False


def _clock(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))
