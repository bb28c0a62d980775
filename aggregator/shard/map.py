"""Which shard owns a pool, where each shard is reached, and the Lease each shard elects with.

Ownership is rendezvous (highest random weight) hashing of the pool's name: every shard scores
the pool with a hash of (shard, pool), and the highest score owns it. kube-state-metrics shards
by ``md5(uid) % total_shards`` and Prometheus' ``hashmod`` relabelling the same way; a modulus
moves about (N-1)/N of everything when N changes, and here every moved pool is state to restore
(its quarantines read back from the cluster, its history started afresh). Rendezvous hashing
moves only the pools whose highest score changes: going from N to N+1 shards, about 1/(N+1) of
the pools, all of them to the new shard; going down, only the removed shard's pools, spread
over the others. It needs no ring, no virtual nodes and no shared state: every replica that
knows N computes the same owner, which is what redirects and fail-over rely on.

The unit is the pool (aggregator/fleet/pools.py), not the node: the pool-share limit, the pool
frames the fleet detectors compare and the probe rotation are all per pool, so a pool on one
shard keeps them whole. The hash is blake2b, not Python's ``hash`` (salted per process).
"""

from __future__ import annotations

import functools
import hashlib
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from agent.errors import ConfigError
from aggregator.config import ShardingConfig

SHARD_HEADER: Final = "X-Gpuwarden-Shard"  # "<index>/<shards>" on redirects and fan-out answers
_ORDINAL: Final = re.compile(r"-(\d+)$")


def _score(shard: int, pool: str) -> int:
    digest = hashlib.blake2b(f"{shard}\x00{pool}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


# A fleet has tens to hundreds of pools and every report asks for one: cached, bounded (the pool
# can come from an agent's own labels, so its names are not ours to trust to be few).
@functools.lru_cache(maxsize=4096)
def owner_of(pool: str, shards: int) -> int:
    """The shard that owns ``pool`` among ``shards`` (rendezvous hashing; ties, which need a
    64-bit collision, go to the lower index)."""
    if shards == 1:
        return 0
    return max(range(shards), key=lambda i: (_score(i, pool), -i))


def shard_header(index: int, shards: int) -> str:
    return f"{index}/{shards}"


def pod_ordinal(hostname: str) -> int | None:
    """A StatefulSet pod's ordinal from its name (``gpuwarden-a-3`` -> 3); None if it has none."""
    found = _ORDINAL.search(hostname)
    return int(found.group(1)) if found else None


@dataclass(frozen=True)
class ShardMap:
    """N shards, this replica's index, and where each shard is reached."""

    shards: int
    index: int
    peers: tuple[tuple[str, ...], ...]  # per shard: its URLs in the order they are tried

    def owner(self, pool: str) -> int:
        return owner_of(pool, self.shards)

    def owns(self, pool: str) -> bool:
        return self.shards == 1 or owner_of(pool, self.shards) == self.index

    def url(self, shard: int) -> str:
        """Where reports for ``shard`` go: its replica on this replica's side."""
        return self.peers[shard][0]

    def urls(self, shard: int) -> tuple[str, ...]:
        return self.peers[shard]

    @property
    def header(self) -> str:
        return shard_header(self.index, self.shards)

    def lease_name(self, base: str) -> str:
        """Each shard elects its own leader (the pair of replicas of that shard)."""
        return base if self.shards == 1 else f"{base}-shard-{self.index}"

    @classmethod
    def of(cls, config: ShardingConfig, *, hostname: str | None = None) -> ShardMap:
        """The map ``config`` describes; the index from the pod's name when the config has none."""
        index = config.shard
        if index is None:
            if config.shards == 1:
                index = 0
            else:
                name = hostname if hostname is not None else socket.gethostname()
                index = pod_ordinal(name)
                if index is None:
                    raise ConfigError(
                        f"sharding.shard is not set and the host name {name!r} has no StatefulSet ordinal"
                    )
        if index >= config.shards:
            raise ConfigError(f"shard {index} (from the pod's ordinal) is not below shards ({config.shards})")
        return cls(config.shards, index, _peer_urls(config.peers, config.shards))


def _peer_urls(peers: Sequence[str | Sequence[str]], shards: int) -> tuple[tuple[str, ...], ...]:
    per_shard: list[list[str]] = [[] for _ in range(shards)]
    for peer in peers:
        for i in range(shards):
            url = peer.replace("{i}", str(i)) if isinstance(peer, str) else peer[i]
            per_shard[i].append(url.rstrip("/"))
    return tuple(tuple(urls) for urls in per_shard)
