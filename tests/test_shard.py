"""The shard map, the sharding settings, the hourly share and the ingest redirect."""

from __future__ import annotations

import gzip
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from agent.clock import FakeClock, SystemClock
from agent.errors import ConfigError
from agent.report import Report, encode
from aggregator.app import _sharded, build_aggregator, build_pipeline
from aggregator.config import Config, LimitsConfig, RemediationConfig, ShardingConfig
from aggregator.pipeline import Pipeline
from aggregator.remediate.limits import shard_limits
from aggregator.remediate.model import HealthSnapshot, NodeIntent
from aggregator.rules import default_rules_dir, load_rules
from aggregator.service import REPORTS_PATH, SERVER_KWARGS
from aggregator.shard.map import ShardMap, owner_of, pod_ordinal
from aggregator.shard.owned import OwnedIntents
from aggregator.shard.router import ShardRouter
from tests.rulekit import T0, gpu, report

RULES = load_rules([default_rules_dir()])
POOLS = [f"pool-{i:04d}" for i in range(2000)]


def sharding(**kw: object) -> ShardingConfig:
    return msgspec.convert(kw, ShardingConfig)


# -- the map --------------------------------------------------------------------------------------


def test_pools_spread_evenly_and_the_owner_is_the_same_everywhere() -> None:
    counts = Counter(owner_of(p, 4) for p in POOLS)
    assert sorted(counts) == [0, 1, 2, 3]
    assert all(400 <= c <= 600 for c in counts.values()), counts  # 500 each, +-20 %
    assert [owner_of(p, 4) for p in POOLS[:50]] == [owner_of(p, 4) for p in POOLS[:50]]
    assert all(owner_of(p, 1) == 0 for p in POOLS[:10])


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_adding_a_shard_moves_only_its_share_and_only_to_it(n: int) -> None:
    before = {p: owner_of(p, n) for p in POOLS}
    after = {p: owner_of(p, n + 1) for p in POOLS}
    moved = [p for p in POOLS if before[p] != after[p]]
    assert all(after[p] == n for p in moved)  # every moved pool went to the new shard
    share = len(POOLS) / (n + 1)
    assert 0.8 * share <= len(moved) <= 1.2 * share  # 1/(N+1) of the pools, not (N-1)/N
    # Removing it again moves exactly those back.
    assert [p for p in POOLS if after[p] != before[p]] == moved


def test_the_map_from_the_config_and_the_pod_name() -> None:
    cfg = sharding(shards=4, peers=["http://gpuwarden-a-{i}.gpuwarden-a.gpuwarden.svc:8080/"])
    m = ShardMap.of(cfg, hostname="gpuwarden-a-3")
    assert (m.index, m.shards, m.header) == (3, 4, "3/4")
    assert m.url(1) == "http://gpuwarden-a-1.gpuwarden-a.gpuwarden.svc:8080"
    assert m.lease_name("gpuwarden-aggregator") == "gpuwarden-aggregator-shard-3"
    assert ShardMap.of(ShardingConfig()).lease_name("gpuwarden-aggregator") == "gpuwarden-aggregator"
    two = sharding(shards=2, shard=0, peers=[["http://a:1", "http://b:2"], "http://standby-{i}:8080"])
    m2 = ShardMap.of(two)
    assert m2.urls(1) == ("http://b:2", "http://standby-1:8080")
    assert pod_ordinal("gpuwarden-b-12") == 12 and pod_ordinal("laptop") is None
    with pytest.raises(ConfigError, match="ordinal"):
        ShardMap.of(cfg, hostname="laptop")
    with pytest.raises(ConfigError, match="not below"):
        ShardMap.of(cfg, hostname="gpuwarden-a-4")


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"shards": 2}, "peers"),
        ({"shards": 2, "shard": 2, "peers": ["http://s-{i}"]}, "not below"),
        ({"shards": 2, "peers": ["http://s"]}, "no {i}"),
        ({"shards": 3, "peers": [["http://a", "http://b"]]}, "2 URLs for 3 shards"),
    ],
)
def test_bad_sharding_settings_are_refused(given: dict[str, object], message: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=message):
        sharding(**given)


def test_one_shard_is_the_default_and_changes_nothing() -> None:
    assert Config().sharding == ShardingConfig(shards=1)
    limits = LimitsConfig(max_per_hour=20)
    assert shard_limits(limits, 1) is limits


# -- the hourly limit ---------------------------------------------------------------------------


def test_each_shard_gets_its_share_of_the_hourly_limit() -> None:
    limits = LimitsConfig(max_per_hour=20, max_pool_share=0.2, max_per_domain=5)
    share = shard_limits(limits, 3)
    assert share.max_per_hour == 6  # 3 x 6 = 18 <= 20: the fleet's hour stays under the limit
    assert (share.max_pool_share, share.max_per_domain) == (0.2, 5)  # a pool lives on one shard
    with pytest.raises(ConfigError, match="share of the hourly limit would be zero"):
        shard_limits(LimitsConfig(max_per_hour=3), 4)


def dbe(node: str, t: float) -> Report:
    """GPU 3 has uncorrectable ECC errors: a hard fault, quarantined at once."""
    return report(
        t, node=node, seq=1, gpus=[gpu(g, ecc_dbe_volatile_total=2 if g == 3 else 0) for g in range(8)]
    )


def test_a_shard_holds_past_its_share_of_the_hour() -> None:
    """Three shards, max_per_hour 6: a shard quarantines two nodes in an hour, the third is held."""
    cfg = Config(
        remediation=RemediationConfig(
            mode="enforce", limits=LimitsConfig(max_per_hour=6, max_pool_share=1.0, max_per_domain=50)
        )
    )
    shard = _sharded(cfg, ShardMap.of(sharding(shards=3, shard=0, peers=["http://s-{i}"])))
    assert shard.remediation.limits.max_per_hour == 2
    assert shard.remediation.leader.lease_name == "gpuwarden-aggregator-shard-0"
    p = build_pipeline(shard, RULES)
    actions = []
    for i in range(3):
        node = f"n{i}"
        p.ingest(report(T0, node=node), T0)
        p.ingest(dbe(node, T0 + 1 + i), T0 + 1 + i)
        actions.append(next(d.action for d in reversed(p.decisions.recent()) if d.node == node))
    assert actions == ["taint", "taint", "held"]
    assert p.limits.state.limit == "per_hour"


# -- the owned-pool filter ----------------------------------------------------------------------


def pool_owned_by(shard: int, shards: int, not_by: int | None = None) -> str:
    """A pool that ``shard`` owns among ``shards`` (and, given, that ``not_by`` did not own)."""
    return next(
        p
        for p in POOLS
        if owner_of(p, shards) == shard and (not_by is None or owner_of(p, shards - 1) == not_by)
    )


def test_a_shard_restores_and_acts_on_its_own_pools_only() -> None:
    m = ShardMap.of(sharding(shards=2, shard=0, peers=["http://s-{i}"]))
    mine, theirs = pool_owned_by(0, 2), pool_owned_by(1, 2)
    labels = {"a": {"gpuwarden.io/pool": mine}, "b": {"gpuwarden.io/pool": theirs}}
    p = build_pipeline(Config(remediation=RemediationConfig(mode="enforce")), RULES)
    owned = OwnedIntents(
        p, m, lambda node: labels.get(node, {}), clock=FakeClock(T0), registry=CollectorRegistry()
    )
    snap = HealthSnapshot(state="quarantined", since=T0, tainted=True, quarantines=[T0])
    owned.restore("a", msgspec.structs.replace(snap, pool=mine), "xid-79", T0 + 5)
    owned.restore("b", msgspec.structs.replace(snap, pool=theirs), "xid-79", T0 + 5)
    owned.restore("c", None, "xid-79", T0 + 5)  # no snapshot: its labels (none: "unknown")
    assert owned.skipped_restores == 1 + (owner_of("unknown", 2) != 0)
    assert p.health.get("a") is not None and p.health.get("b") is None
    assert owned.intent("a") is not None and owned.intent("b") is None
    assert "b" not in owned.intent_nodes()
    # A node of another shard's pool that reported here anyway (its labels changed under it) is
    # handed over as soon as the actuator asks for it: this shard drops it and leaves it alone.
    p.ingest(report(T0 + 6, node="b"), T0 + 6)
    assert p.intent("b") is not None and owned.intent("b") is None
    assert p.node("b") is None and p.intent("b") is None


class Labels:
    """The pipeline's ClusterView: node labels an operator can change while the shards run."""

    def __init__(self, labels: dict[str, dict[str, str]]) -> None:
        self.by_node = labels

    def labels(self, node: str) -> dict[str, str]:
        return self.by_node.get(node, {})

    def has_preflight_taint(self, node: str) -> bool:
        return False

    def pool_size(self, pool: str) -> int:
        return sum(1 for labels in self.by_node.values() if labels.get("gpuwarden.io/pool") == pool)


class Cluster:
    """What each shard's actuator would hand over from the Node: the snapshot the old owner wrote."""

    def __init__(self) -> None:
        self.shown: dict[str, tuple[HealthSnapshot, str]] = {}
        self.asked: list[str] = []

    def restore_into(
        self,
        node: str,
        into: Callable[[str, HealthSnapshot | None, str | None, float], None],
        tainted_only: bool,
    ) -> bool:
        self.asked.append(node)
        if node not in self.shown:
            return False
        snapshot, value = self.shown[node]
        into(node, snapshot, value, T0 + 20)
        return True

    def settled(self, node: str, intent: NodeIntent) -> bool:
        shown = self.shown.get(node)
        return shown is not None and (shown[0].state, shown[0].since) == (
            intent.snapshot.state,
            intent.snapshot.since,
        )


Shard = tuple[Pipeline, OwnedIntents, ShardRouter]


def two_shards(labels: Labels, cluster: Cluster) -> list[Shard]:
    """Two shards' pipelines, owned-pool filters and routers, over the same labels and cluster."""
    cfg = Config(remediation=RemediationConfig(mode="enforce", limits=LimitsConfig(max_pool_share=1.0)))
    shards: list[Shard] = []
    for i in range(2):
        m = ShardMap.of(sharding(shards=2, shard=i, peers=["http://s-{i}"]))
        p = build_pipeline(cfg, RULES, cluster=labels)
        registry = CollectorRegistry()
        owned = OwnedIntents(p, m, labels.labels, clock=FakeClock(T0), registry=registry)
        owned.bind(cluster.restore_into, cluster.settled)
        router = ShardRouter(m, labels.labels, registry, arrived=owned.arrived, left=owned.left)
        shards.append((p, owned, router))
    return shards


def post(shard: Shard, rep: Report) -> int:
    """A report through the shard's router, ingested when the router keeps it: its HTTP status."""
    p, _, router = shard
    moved = router.route(rep)
    if moved is not None:
        return moved.status
    p.ingest(rep, rep.time)
    return 200


def written(node: str, since: float, pool: str) -> tuple[HealthSnapshot, str]:
    """What shard 0's leader writes on a node it quarantined (snapshot and taint value)."""
    snapshot = HealthSnapshot(state="quarantined", since=since, tainted=True, quarantines=[since], pool=pool)
    return snapshot, "ecc-dbe"


def test_a_relabelled_node_moves_to_its_new_shard_with_its_quarantine() -> None:
    # A quarantined node's pool label changes while both shards run: the old owner hands it over
    # (no intent: it leaves the node alone), the new owner restores it from the cluster before
    # it ingests its first report, so the quarantine is never undone by a fresh start.
    old, new = pool_owned_by(0, 2), pool_owned_by(1, 2)
    labels = Labels({"a": {"gpuwarden.io/pool": old}, "b": {"gpuwarden.io/pool": old}})
    cluster = Cluster()
    shard0, shard1 = two_shards(labels, cluster)
    (p0, owned0, _), (p1, owned1, router1) = shard0, shard1

    assert post(shard0, report(T0, node="b")) == 200
    assert post(shard0, dbe("a", T0 + 1)) == 200
    intent = owned0.intent("a")
    assert intent is not None and intent.state == "quarantined" and intent.effect is not None
    cluster.shown["a"] = written("a", intent.snapshot.since, old)  # shard 0's leader wrote it
    assert cluster.asked == ["b", "a"]  # each node new to shard 0 was looked up once
    cluster.asked.clear()

    labels.by_node["a"] = {"gpuwarden.io/pool": new}  # kubectl label node a gpuwarden.io/pool=... --overwrite
    # The relabel is a watch event: shard 0's actuator reconciles the node and is told to leave it.
    assert owned0.intent("a") is None
    assert p0.node("a") is None and p0.health.get("a") is None
    assert p0.node("b") is not None  # the rest of the pool stays
    # The agent still sends to shard 0: redirected. Shard 1 restores it before its first report.
    assert post(shard0, report(T0 + 21, node="a", seq=2)) == 307
    assert post(shard1, report(T0 + 21, node="a", seq=2)) == 200
    assert cluster.asked == ["a"]
    moved = owned1.intent("a")
    assert moved is not None and moved.state == "quarantined" and moved.effect is not None
    assert p1.placement("a") is not None and p1.placement("a").pool == new
    assert post(shard1, report(T0 + 31, node="a", seq=3)) == 200
    assert cluster.asked == ["a"]  # only the first report of a node new to the shard asks
    assert p1.health.get("a").state == "quarantined"
    assert router1.route(report(T0 + 31, node="b", seq=2)) is not None  # b stayed in shard 0's pool


def test_a_quarantine_not_yet_on_the_node_stays_with_its_shard_until_it_is() -> None:
    # The node moves (its agent now reports another pool) before shard 0's leader has written
    # the taint: handing it over then would lose the decision, which the new owner can only
    # learn from the cluster. Shard 0 keeps acting on it until the Node shows it.
    old, new = pool_owned_by(0, 2), pool_owned_by(1, 2)
    labels = Labels({"a": {}})
    cluster = Cluster()
    shard0, shard1 = two_shards(labels, cluster)
    (p0, owned0, _), (_, owned1, _) = shard0, shard1
    assert post(shard0, msgspec.structs.replace(dbe("a", T0 + 1), labels={"pool": old})) == 200
    moved_report = msgspec.structs.replace(report(T0 + 11, node="a", seq=2), labels={"pool": new})
    assert post(shard0, moved_report) == 307  # redirected, but not handed over yet
    kept = owned0.intent("a")
    assert kept is not None and kept.state == "quarantined" and kept.effect is not None
    assert p0.health.get("a") is not None
    cluster.shown["a"] = written("a", kept.snapshot.since, old)  # the leader's write lands
    again = msgspec.structs.replace(moved_report, seq=3, time=T0 + 21)
    assert post(shard0, again) == 307  # the next redirect hands it over
    assert p0.health.get("a") is None and owned0.intent("a") is None
    assert post(shard1, again) == 200
    taken = owned1.intent("a")
    assert taken is not None and taken.state == "quarantined"


def test_a_taint_that_reaches_the_new_owner_late_is_restored_not_removed() -> None:
    # The node's first report reached shard 1 before the old owner's taint reached shard 1's
    # informer: it starts here healthy. When the taint shows up (a watch event, then a
    # reconcile), shard 1 restores it before giving an intent, so its planner keeps the taint.
    new = pool_owned_by(1, 2)
    labels = Labels({"a": {"gpuwarden.io/pool": new}})
    cluster = Cluster()
    _, shard1 = two_shards(labels, cluster)
    p1, owned1, _ = shard1
    assert post(shard1, report(T0 + 21, node="a", seq=2)) == 200
    early = owned1.intent("a")
    assert early is not None and early.state == "healthy"
    cluster.shown["a"] = written("a", T0 + 1, pool_owned_by(0, 2))
    late = owned1.intent("a")
    assert late is not None and late.state == "quarantined" and late.effect is not None
    assert p1.health.get("a").state == "quarantined"


def test_a_node_new_to_the_fleet_is_not_restored_from_anything() -> None:
    labels = Labels({"n": {"gpuwarden.io/pool": pool_owned_by(0, 2)}})
    cluster = Cluster()
    m = ShardMap.of(sharding(shards=2, shard=0, peers=["http://s-{i}"]))
    p = build_pipeline(Config(remediation=RemediationConfig(mode="enforce")), RULES, cluster=labels)
    owned = OwnedIntents(p, m, labels.labels, clock=FakeClock(T0), registry=CollectorRegistry())
    owned.bind(cluster.restore_into, cluster.settled)
    owned.arrived("n", pool_owned_by(0, 2))
    assert cluster.asked == ["n"] and p.health.get("n") is None
    assert owned.intent("n") is None  # nothing known: nothing to do


# -- the redirect -------------------------------------------------------------------------------


def labelled(node: str, pool: str, seq: int = 1) -> Report:
    return msgspec.structs.replace(report(time.time(), node=node, seq=seq), labels={"pool": pool})


async def test_a_report_of_another_shards_pool_is_redirected_and_not_ingested(tmp_path: Path) -> None:
    (tmp_path / "tokens").write_text(
        "n-mine token-mine-0123456789abcdef\nn-theirs token-theirs-0123456789abcd\n"
    )
    cfg = Config(
        sharding=sharding(shards=3, shard=1, peers=["http://gpuwarden-a-{i}.gpuwarden-a.gpuwarden.svc:8080"])
    )
    agg = await build_aggregator(
        cfg, RULES, auth=tmp_path / "tokens", clock=SystemClock(), advance_interval_s=None
    )
    mine, theirs = pool_owned_by(1, 3), pool_owned_by(2, 3)
    server = TestServer(agg.app)
    await server.start_server(**SERVER_KWARGS)
    async with TestClient(server) as client:

        async def post(node: str, token: str, pool: str) -> tuple[int, dict[str, str], dict[str, object]]:
            body = gzip.compress(encode(labelled(node, pool)))
            headers = {
                "Authorization": f"Bearer {token}",
                "Content-Type": "application/json",
                "Content-Encoding": "gzip",
            }
            resp = await client.post(REPORTS_PATH, data=body, headers=headers, allow_redirects=False)
            return resp.status, dict(resp.headers), await resp.json()

        status, headers, body = await post("n-theirs", "token-theirs-0123456789abcd", theirs)
        assert status == 307
        assert headers["Location"] == "http://gpuwarden-a-2.gpuwarden-a.gpuwarden.svc:8080/v1/reports"
        assert headers["X-Gpuwarden-Shard"] == "2/3"
        assert body["error"] == "wrong_shard"
        assert agg.pipeline.node("n-theirs") is None  # not ingested
        status, _, body = await post("n-mine", "token-mine-0123456789abcdef", mine)
        assert (status, body) == (200, {"status": "accepted"})
        assert agg.pipeline.node("n-mine") is not None
        # Authentication comes first: a stranger learns nothing about the shards.
        status, headers, _ = await post("n-theirs", "not-a-token-at-all-00000000", theirs)
        assert status == 401 and "Location" not in headers
    assert agg.registry.get_sample_value("gpuwarden_shard_redirects_total", {"shard": "2"}) == 1.0
    assert agg.registry.get_sample_value("gpuwarden_shard_info", {"shard": "1", "shards": "3"}) == 1.0
    assert agg.registry.get_sample_value("gpuwarden_shards") == 3.0


def test_until_the_node_labels_are_read_a_report_is_asked_again_later() -> None:
    m = ShardMap.of(sharding(shards=2, shard=0, peers=["http://s-{i}"]))
    ready = False
    labels = {"n1": {"gpuwarden.io/pool": pool_owned_by(1, 2)}}
    router = ShardRouter(
        m, lambda n: labels.get(n, {}), CollectorRegistry(), ready=lambda: ready, retry_after_s=7
    )
    early = router.route(report(T0, node="n1"))
    assert early is not None and early.status == 503 and early.headers["Retry-After"] == "7"
    ready = True
    # Its pool comes from the node's Kubernetes label (the report names none): shard 1's.
    moved = router.route(report(T0, node="n1"))
    assert moved is not None and (moved.status, moved.headers["X-Gpuwarden-Shard"]) == (307, "1/2")
