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
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

from aggregator.fleet.pools import place
from aggregator.pipeline import Pipeline
from aggregator.remediate.model import HealthSnapshot, IntentSource, NodeIntent
from aggregator.shard.map import ShardMap

log = logging.getLogger(__name__)


class OwnedIntents(IntentSource):
    """The pipeline's intents, for the nodes of the pools this shard owns."""

    def __init__(
        self, pipeline: Pipeline, shards: ShardMap, labels: Callable[[str], Mapping[str, str]]
    ) -> None:
        self._pipeline = pipeline
        self._map = shards
        self._labels = labels
        self.skipped_restores = 0  # nodes of other shards' pools seen at the first list

    def pool_of(self, node: str, snapshot: HealthSnapshot | None = None) -> str:
        placement = self._pipeline.placement(node)
        if placement is not None:
            return placement.pool
        if snapshot is not None and snapshot.pool is not None:
            return snapshot.pool
        return place({}, None, self._labels(node)).pool

    def owns(self, node: str, snapshot: HealthSnapshot | None = None) -> bool:
        return self._map.owns(self.pool_of(node, snapshot))

    def intent(self, node: str) -> NodeIntent | None:
        if not self.owns(node):
            return None
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
