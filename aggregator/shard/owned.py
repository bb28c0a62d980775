"""A shard's actuator acts on the pools the shard owns, and on nothing else.

The actuator (aggregator/remediate/actuator.py) lists every Node of the cluster: each shard's
leader sees all of them, and without this filter it would restore, at its first list, the
quarantines of every pool, and then reconcile them, so that two shards' leaders wrote the same
nodes. ``OwnedIntents`` stands between the actuator and the pipeline: a node is the shard's
when its pool is (the pipeline's placement of it, else the pool its health snapshot names, else
its Kubernetes labels: the order the pipeline itself uses), and only then is it restored from
the cluster or reconciled.

This is also how a change of the number of shards hands a pool over without a gap or a double:
the new owner restores the moved nodes from their snapshots and taints exactly as after a
restart (docs/remediation.md, "Restarts and fail-over"), and the old owner, asked for the intent
of a node whose pool it no longer owns, answers None, which leaves the node as it is.

A node whose pool changes while the shards run (its ``gpuwarden.io/pool`` label, or the pool its
agent reports) moves the same way, without a restart:

- the old owner hands it over (``Pipeline.hand_over``: every trace of it dropped, a quarantine
  included, so from then on it gives no intent for it) as soon as it learns of the move: when it
  redirects one of the node's reports to another shard (``left``), or when the actuator asks for
  the node's intent and the node's pool with the labels as they are now is another shard's (a
  relabel is a watch event the actuator reconciles). Not while a decision of its own that takes
  the node out is not on the Node yet (``settled``): it keeps acting on the node until it is, so
  the new owner can find the decision in the cluster;
- the new owner, placing the first report of a node its pipeline does not know (``arrived``),
  restores it from the cluster first, from the node as its informer last saw it, as at a start:
  so the quarantine the old owner decided is kept, never undone by a fresh start. For
  ``ARRIVAL_WATCH_S`` after, a taint of ours that reaches the informer late is restored before
  the node's next intent (``_recheck_arrival``), not taken for a stale one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Final

import msgspec
from prometheus_client import Counter
from prometheus_client.registry import CollectorRegistry

from agent.clock import Clock
from aggregator.fleet.pools import place
from aggregator.pipeline import Pipeline
from aggregator.remediate.model import HealthSnapshot, IntentSource, NodeIntent, Restore
from aggregator.shard.map import ShardMap

log = logging.getLogger(__name__)

# (node, restore, tainted_only) -> whether the cluster showed something of ours to restore: the
# actuator's ``restore_into``, bound once the remediation runtime exists.
RestoreFromCluster = Callable[[str, Restore, bool], bool]
# (node, intent) -> whether the Node, as cached, shows the intent's decision (its snapshot's state
# since the same time; always, in dry-run): the actuator's ``settled``.
Settled = Callable[[str, NodeIntent], bool]
# A node that moved here is checked against the cluster this long: the old owner's taint may
# reach this replica's informer after the node's first report here (its own labels moved it).
ARRIVAL_WATCH_S: Final = 600.0
_ARRIVALS_MAX: Final = 100_000  # pruned of expired entries when this many


class OwnedIntents(IntentSource):
    """The pipeline's intents, for the nodes of the pools this shard owns."""

    def __init__(
        self,
        pipeline: Pipeline,
        shards: ShardMap,
        labels: Callable[[str], Mapping[str, str]],
        *,
        clock: Clock,
        registry: CollectorRegistry,
    ) -> None:
        self._pipeline = pipeline
        self._map = shards
        self._labels = labels
        self._clock = clock
        self._from_cluster: RestoreFromCluster | None = None
        self._settled: Settled | None = None
        self._arrivals: dict[str, float] = {}  # node -> when it moved here (ARRIVAL_WATCH_S)
        self.skipped_restores = 0  # nodes of other shards' pools seen at the first list
        self._moves = Counter(
            "gpuwarden_shard_node_moves_total",
            "Nodes whose pool moved them between shards while running: handed over to another "
            "shard (out) or taken in from the cluster (in)",
            ["direction"],
            registry=registry,
        )
        for direction in ("in", "out"):
            self._moves.labels(direction)

    def bind(self, from_cluster: RestoreFromCluster, settled: Settled) -> None:
        self._from_cluster = from_cluster
        self._settled = settled

    def pool_of(self, node: str, snapshot: HealthSnapshot | None = None) -> str:
        pool = self._pipeline.pool_now(node)
        if pool is not None:
            return pool
        if snapshot is not None and snapshot.pool is not None:
            return snapshot.pool
        return place({}, None, self._labels(node)).pool

    def owns(self, node: str, snapshot: HealthSnapshot | None = None) -> bool:
        return self._map.owns(self.pool_of(node, snapshot))

    def intent(self, node: str) -> NodeIntent | None:
        if not self.owns(node):
            if self._unwritten(node):
                # Out by a decision of ours not yet on the Node: acted on until it is, so that the
                # new owner finds it in the cluster; handed over at the reconcile after that.
                return self._pipeline.intent(node)
            self._hand_over(node, None)
            return None
        self._recheck_arrival(node)
        return self._pipeline.intent(node)

    def intent_nodes(self) -> Iterable[str]:
        return [n for n in self._pipeline.intent_nodes() if self.owns(n)]

    def restore(
        self, node: str, snapshot: HealthSnapshot | None, taint_value: str | None, now: float
    ) -> None:
        if not self.owns(node, snapshot):
            self.skipped_restores += 1
            return
        self._pipeline.restore(node, snapshot, taint_value, now)

    # -- nodes moving while the shards run (the router calls these for every report it places) --

    def arrived(self, node: str, pool: str) -> None:
        """A report of ``node`` is to be ingested here, its pool ``pool`` being ours. A node the
        pipeline does not know yet is restored from the cluster first (the router decided the
        pool, so the snapshot's older pool is not asked)."""
        if self._from_cluster is None or self._pipeline.placement(node) is not None:
            return
        now = self._clock.time()
        if len(self._arrivals) >= _ARRIVALS_MAX:
            self._arrivals = {n: t for n, t in self._arrivals.items() if now - t < ARRIVAL_WATCH_S}
        self._arrivals[node] = now

        def here(name: str, snapshot: HealthSnapshot | None, value: str | None, at: float) -> None:
            # Restored in the pool the router placed it in, not the one its snapshot names.
            moved = msgspec.structs.replace(snapshot, pool=pool) if snapshot is not None else None
            self._pipeline.restore(name, moved, value, at)

        if self._from_cluster(node, here, False):
            self._moves.labels("in").inc()
            log.info(
                "node moved to this shard: restored from the cluster", extra={"node": node, "pool": pool}
            )

    def _recheck_arrival(self, node: str) -> None:
        """A node that moved here lately and is not out here: if the cluster now shows our taint
        on it (the old owner's write reached the informer after the node's first report here),
        restore it before any intent is given, so the taint is kept, not taken for a stale one."""
        arrived = self._arrivals.get(node)
        if arrived is None or self._from_cluster is None:
            return
        if self._clock.time() - arrived >= ARRIVAL_WATCH_S:
            del self._arrivals[node]
            return
        h = self._pipeline.health.get(node)
        if h is not None and (h.tainted or h.state in ("quarantined", "probation")):
            return
        if self._from_cluster(node, self._pipeline.restore, True):
            del self._arrivals[node]
            self._moves.labels("in").inc()
            log.info("node moved to this shard: its taint reached us late, restored", extra={"node": node})

    def _unwritten(self, node: str) -> bool:
        """Whether this replica decided ``node`` out and the Node does not show it yet."""
        if self._settled is None:
            return False
        intent = self._pipeline.intent(node)
        return intent is not None and intent.effect is not None and not self._settled(node, intent)

    def left(self, node: str, owner: int) -> None:
        """A report of ``node`` was redirected to shard ``owner``: its pool is no longer ours
        (kept until a decision of ours that takes it out is on the Node)."""
        if not self._unwritten(node):
            self._hand_over(node, owner)

    def _hand_over(self, node: str, owner: int | None) -> None:
        self._arrivals.pop(node, None)
        if self._pipeline.hand_over(node, self._clock.time()):
            self._moves.labels("out").inc()
            log.info(
                "node moved to another shard: handed over",
                extra={"node": node, "pool": self.pool_of(node), "owner": owner},
            )
