"""Sharding: pools spread over N aggregators, the way Kubernetes' own controllers shard
(docs/sharding.md).

- ``map``: which shard owns a pool (rendezvous hashing), where each shard is reached, its Lease;
- ``router``: a report sent to the wrong shard is redirected to its owner, not ingested;
- ``owned``: the actuator of a shard restores and writes only the nodes of the pools it owns;
- ``fanout``: the fleet-wide read views ask one replica of every shard;
- ``fence``: while replicas of another count of shards are live (a roll that changes N), no
  shard's leader writes to Nodes.

With ``sharding.shards`` 1 (the default) none of this is built: the aggregator is unchanged.
"""
