"""Restarts, seen from the pipeline: state first, decisions second.

A restarted aggregator ingests reports at once, but its view of the cluster (our taints and
snapshots on the Nodes, their labels, the breaker in the Lease) arrives with the first Node list,
which a busy API server answers seconds later. These tests play that order by hand (the reports,
then the list's ``restore`` calls, then ``cluster_synced``) and check what a user depends on: a
quarantine on the cluster is never undone, the limits are judged on the whole view, nothing
changes on a node that did not change, and without a cluster (remediation off) the decision log
carries the quarantines over. The same order against the API-server double, through the real
client and the composition root, is tests/test_remediation_restart_e2e.py.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from agent.clock import FakeClock
from agent.report import Report, encode
from aggregator.app import Aggregator, build_aggregator, build_pipeline
from aggregator.auth import StaticTokens
from aggregator.config import Config, HealthConfig, LimitsConfig, RemediationConfig
from aggregator.decisions import AWAITING_CLUSTER, Decision, DecisionLog, read_decisions
from aggregator.health import carried_over
from aggregator.kube.objects import Node
from aggregator.pipeline import Pipeline
from aggregator.remediate.limits import BreakerState
from aggregator.remediate.model import HealthSnapshot, SnapshotFinding
from aggregator.remediate.planner import plan, recorded
from aggregator.rules import default_rules_dir, load_rules
from aggregator.service import REPORTS_PATH, SERVER_KWARGS, create_app
from tests.rulekit import T0, gpu, report, xid
from tests.test_planner import applied

RULES = load_rules([default_rules_dir()])
POOL_LABEL = "gpuwarden.io/pool"
OURS = "gpuwarden.io/unhealthy"
NAMES = [f"n{i:02d}" for i in range(20)]
FAULTY = NAMES[:5]  # four fit under the limit (20 %), the fifth is held
MONO = 5000.0


def config(mode: str = "enforce", **health: float) -> Config:
    return Config(
        health=HealthConfig(**health),
        remediation=RemediationConfig(
            mode=mode,  # type: ignore[arg-type]
            limits=LimitsConfig(max_pool_share=0.2, max_per_domain=20),
        ),
    )


class Cluster:
    """The pipeline's ClusterView as the informer's cache: empty until the first list."""

    def __init__(self) -> None:
        self.node_labels: dict[str, dict[str, str]] = {}

    def listed(self, names: Sequence[str], pool: str = "pool-a") -> None:
        self.node_labels = {n: {POOL_LABEL: pool} for n in names}

    def labels(self, node: str) -> Mapping[str, str]:
        return self.node_labels.get(node, {})

    def has_preflight_taint(self, node: str) -> bool:
        return False

    def pool_size(self, pool: str) -> int:
        return sum(1 for labels in self.node_labels.values() if labels.get(POOL_LABEL) == pool)


def dbe(node: str, t: float, *, boot: str = "boot-1", seq: int = 0, replaced: bool = False) -> Report:
    """GPU 3 has uncorrectable ECC errors since its last reset: hard, and in every report."""
    gpus = [gpu(i, ecc_dbe_volatile_total=2 if i == 3 else 0) for i in range(8)]
    if replaced:  # a new GPU 3 in the slot: another UUID, no error
        gpus[3] = gpu(3, uuid="GPU-0000feed-1111-2222-3333-444455556666")
    return report(t, node=node, gpus=gpus, boot_id=boot, seq=seq)


def healthy(node: str, t: float, *, seq: int = 0) -> Report:
    return report(t, node=node, seq=seq, boot_id="boot-1")


def decisions(p: Pipeline, node: str | None = None) -> list[Decision]:
    return [d for d in p.decisions.recent() if node is None or d.node == node]


class FirstLife:
    """An aggregator that ran: five DBE nodes in pool-a, four tainted, the fifth held (breaker
    open), and the Nodes as its actuator left them (every plan applied)."""

    def __init__(self) -> None:
        self.cluster = Cluster()
        self.cluster.listed(NAMES)
        self.pipeline = build_pipeline(config(), RULES, cluster=self.cluster)
        p = self.pipeline
        for n in NAMES:
            p.ingest(healthy(n, T0), T0)
        for i, n in enumerate(FAULTY):
            p.ingest(dbe(n, T0 + 10 + i, seq=1), T0 + 10 + i)
        assert [decisions(p, n)[-1].action for n in FAULTY] == ["taint"] * 4 + ["held"]
        self.breaker = p.limits.state
        assert self.breaker.open
        cfg = config().remediation
        self.nodes: dict[str, Node] = {}
        for n in NAMES:
            intent = p.intent(n)
            assert intent is not None
            node = Node(name=n, resource_version="1", labels=self.cluster.labels(n))
            self.nodes[n] = applied(node, plan(node, intent, cfg, now=T0 + 20, monotonic=MONO))


def listed(p: Pipeline, cluster: Cluster, nodes: Mapping[str, Node], now: float) -> None:
    """The first Node list answers: labels cached, every node carrying ours handed to restore,
    as the actuator's informer does."""
    cluster.listed(list(nodes))
    cfg = config().remediation
    for n, node in nodes.items():
        mine = recorded(node, cfg)
        if mine.taints or mine.snapshot_text is not None:
            p.restore(n, mine.snapshot, mine.taints[0].value if mine.taints else None, now)


def restarted(first: FirstLife) -> tuple[Pipeline, Cluster]:
    cluster = Cluster()
    p = build_pipeline(config(), RULES, cluster=cluster)
    p.await_cluster()  # what the remediation runtime does when it is built
    return p, cluster


def out_in_pool(p: Pipeline, pool: str = "pool-a") -> list[str]:
    return sorted(
        n
        for n, h in p.health.nodes().items()
        if h.tainted and (pl := p.placement(n)) is not None and pl.pool == pool
    )


def test_a_report_before_the_first_list_never_releases_a_quarantined_node() -> None:
    # The first bug: the Lease (breaker open) was read before the Nodes, a DBE node's
    # report came first and was decided afresh as held, and the actuator removed its taint.
    first = FirstLife()
    p, cluster = restarted(first)
    now = T0 + 100
    p.adopt_breaker(first.breaker, now)
    for n in NAMES:
        p.ingest(dbe(n, now, seq=2) if n in FAULTY else healthy(n, now, seq=2), now)
    # Decided, not judged: nothing recorded as taint or held yet, nothing out or held.
    assert [d for d in decisions(p) if d.action in ("taint", "held")] == []
    assert not any(h.tainted or h.held for h in p.health.nodes().values())

    listed(p, cluster, first.nodes, now + 3)
    p.cluster_synced(now + 3)

    cfg = config().remediation
    for n in FAULTY[:4]:
        intent = p.intent(n)
        assert intent is not None and (intent.effect, intent.held) == ("NoSchedule", False)
        # Recorded when decided, with no action (so a kill -9 before the list loses nothing
        # answered); the cluster shows it out already: no second record.
        assert [(d.action, d.reasons[-1].rule) for d in decisions(p, n)] == [("none", AWAITING_CLUSTER)]
        after = plan(first.nodes[n], intent, cfg, now=now + 4, monotonic=MONO)
        assert [t for t in after.taints if t.key == OURS] == [
            t for t in first.nodes[n].taints if t.key == OURS
        ]
        assert after.empty, (after.annotations, after.condition, after.events)
    held = p.intent(FAULTY[4])
    assert held is not None and held.held and held.effect is None
    assert [d.action for d in decisions(p, FAULTY[4])] == ["none", "held"]
    assert out_in_pool(p) == FAULTY[:4]


@pytest.mark.parametrize("breaker", ["open", "reset while we were down"])
def test_the_pool_limit_holds_across_a_restart_whatever_came_first(breaker: str) -> None:
    # The second bug: the held node's report was judged before the breaker was adopted
    # and before the tainted nodes were restored, and tainted: 5 of 20 against a limit of 4.
    first = FirstLife()
    p, cluster = restarted(first)
    now = T0 + 100
    for n in NAMES:  # before the Lease and before the list
        p.ingest(dbe(n, now, seq=2) if n in FAULTY else healthy(n, now, seq=2), now)
    listed(p, cluster, first.nodes, now + 30)
    stored = (
        first.breaker
        if breaker == "open"
        else BreakerState(open=False, reset_at=now + 1, reset_by="alice")  # a human reset it
    )
    p.adopt_breaker(stored, now + 30)
    p.cluster_synced(now + 30)

    assert out_in_pool(p) == FAULTY[:4]
    decided, d = decisions(p, FAULTY[4])
    assert (decided.state, decided.action) == ("quarantined", "none")
    assert (d.state, d.action) == ("quarantined", "held")
    assert p.limits.open  # judged on the whole view: over the limit again, the breaker opens


def test_a_restart_rewrites_no_node_even_when_reports_come_first() -> None:
    # The third finding: 68 annotation rewrites after the restart, placement first
    # written with the GPU model's pool (no labels before the list) and then rewritten.
    first = FirstLife()
    p, cluster = restarted(first)
    now = T0 + 100
    for n in NAMES:
        p.ingest(dbe(n, now, seq=2) if n in FAULTY else healthy(n, now, seq=2), now)
    before_list = p.placement(NAMES[10])
    assert before_list is not None and before_list.pool == "nvidia-h100-80gb-hbm3"
    listed(p, cluster, first.nodes, now + 3)
    p.adopt_breaker(first.breaker, now + 3)
    p.cluster_synced(now + 3)

    cfg = config().remediation
    for n in NAMES:
        intent = p.intent(n)
        assert intent is not None and intent.snapshot.pool == "pool-a"
        written = plan(first.nodes[n], intent, cfg, now=now + 4, monotonic=MONO)
        assert written.empty, (n, written)


def test_decisions_taken_before_the_view_is_whole_are_recorded_in_order_once_it_is() -> None:
    first = FirstLife()
    p, cluster = restarted(first)
    now = T0 + 100
    fresh = NAMES[10]  # a new fault, on a node the cluster shows healthy
    p.ingest(healthy(fresh, now, seq=2), now)
    p.ingest(dbe(fresh, now + 1, seq=3), now + 1)
    # Recorded at once (its report is answered only once the record is on disk), with no action.
    (decided,) = decisions(p, fresh)
    assert (decided.time, decided.state, decided.previous, decided.action) == (
        now + 1,
        "quarantined",
        "healthy",
        "none",
    )
    assert decided.reasons[-1].rule == AWAITING_CLUSTER
    assert decided.reasons[-1].evidence == {"intended": "taint"}
    listed(p, cluster, first.nodes, now + 5)
    p.adopt_breaker(first.breaker, now + 5)
    p.cluster_synced(now + 5)
    # Then the action, as a second record of the same state (no second quarantine counted).
    first_record, d = decisions(p, fresh)
    assert first_record == decided
    assert (d.time, d.state, d.previous, d.action) == (now + 5, "quarantined", "quarantined", "held")
    assert any(r.rule == "safety-limit" for r in d.reasons)
    carried = carried_over(decisions(p))[fresh]
    assert (carried.state, carried.since, carried.held, len(carried.quarantines)) == (
        "quarantined",
        now + 1,
        True,
        1,
    )


def test_a_tripped_breaker_does_not_pause_releases() -> None:
    # NVSentinel PR #1852: releases go on while the breaker is open (letting a node back in
    # cannot take a cluster down); only new quarantines wait for the human.
    cluster = Cluster()
    cluster.listed(NAMES)
    p = build_pipeline(config(clear_for_seconds=10.0, probation_seconds=60.0), RULES, cluster=cluster)
    for n in NAMES:
        p.ingest(healthy(n, T0), T0)
    for i, n in enumerate(FAULTY):
        p.ingest(dbe(n, T0 + 10 + i, seq=1), T0 + 10 + i)
    assert p.limits.open
    repaired = FAULTY[0]
    t = T0 + 20.0
    while t < T0 + 200:  # the GPU was reset: its reports are clean again
        p.ingest(healthy(repaired, t, seq=int(t)), t)
        t += 10
    assert [d.state for d in decisions(p, repaired)] == ["quarantined", "probation", "healthy"]
    assert decisions(p, repaired)[-1].action == "untaint"
    assert p.limits.open
    intent = p.intent(repaired)
    assert intent is not None and intent.effect is None and not intent.held


def test_a_replaced_gpu_does_not_keep_the_node_out_after_a_restart() -> None:
    # NVSentinel #1585: the old GPU's evidence (keyed by its slot, naming its UUID) kept the
    # node quarantined after the GPU was replaced. Restored evidence about a GPU whose slot now
    # reports another UUID ends at once; the node goes through probation as after any repair.
    first = FirstLife()
    p, cluster = restarted(first)
    now = T0 + 100
    listed(p, cluster, first.nodes, now)
    p.adopt_breaker(first.breaker, now)
    p.cluster_synced(now)
    swapped, same = FAULTY[0], FAULTY[1]
    clear_for = p.config.health.clear_for_seconds
    t = now + 10
    while t < now + clear_for + 30:  # well inside the restore grace (600 s)
        p.ingest(dbe(swapped, t, seq=int(t), replaced=True), t)
        p.ingest(dbe(same, t, seq=int(t)), t)  # the same GPU, still failing
        t += 10
    states = {n: h.state for n, h in p.health.nodes().items()}
    assert (states[swapped], states[same]) == ("probation", "quarantined")
    intent = p.intent(swapped)
    assert intent is not None and intent.effect == "NoSchedule"  # probation keeps it out


def xid79_snapshot(uuid: str) -> HealthSnapshot:
    """A node's snapshot: quarantined on boot-1 for an XID 79 on GPU 3 of ``uuid``."""
    return HealthSnapshot(
        state="quarantined",
        since=T0,
        tainted=True,
        quarantines=[T0],
        boot_id="boot-1",
        reason_code="xid-79",
        message="XID 79",
        pool="pool-a",
        findings=[
            SnapshotFinding(
                detector="rule",
                key="xid-79:gpu3",
                severity="critical",
                action="quarantine",
                summary="XID 79",
                since=T0,
                rule="xid-79",
                hard=True,
                clears="reboot",
                evidence={"gpu": 3, "uuid": uuid},
            )
        ],
    )


def test_a_replaced_gpu_clears_restored_evidence_that_would_hold_until_a_reboot() -> None:
    # The same for evidence that lasts until a reboot (an XID 79 on the old GPU): a node whose
    # slot reports another GPU after the restart is not held to the old GPU's XID.
    cluster = Cluster()
    p = build_pipeline(config(), RULES, cluster=cluster)
    p.await_cluster()
    old_uuid = gpu(3).uuid
    snap = xid79_snapshot(old_uuid)
    now = T0 + 100
    p.ingest(dbe("n01", now, replaced=True, seq=1), now)  # same boot id, a new GPU in slot 3
    cluster.listed(["n01"])
    p.restore("n01", snap, "xid-79", now)
    p.cluster_synced(now)
    h = p.health.get("n01")
    assert h is not None and not any(t.finding.key == "xid-79:gpu3" for t in h.active())


def test_evidence_from_while_a_uuid_was_unreadable_is_not_taken_for_a_replaced_gpu() -> None:
    # A GPU needing a reset may not give its UUID: the agent sends "" (unknown). An XID 79 seen
    # then names uuid "" in its evidence; the UUID read again later is the same GPU, not a swap,
    # so the evidence held until the reboot stays, across a restart too.
    cluster = Cluster()
    p = build_pipeline(config(), RULES, cluster=cluster)
    p.await_cluster()
    snap = xid79_snapshot("")
    now = T0 + 100
    p.ingest(healthy("n01", now, seq=1), now)  # same boot, GPU 3's UUID readable again
    cluster.listed(["n01"])
    p.restore("n01", snap, "xid-79", now)
    p.cluster_synced(now)
    t = now + 10
    while t < now + 900:  # past the restore grace: only the latched finding keeps it out
        p.ingest(healthy("n01", t, seq=int(t)), t)
        t += 10
    h = p.health.get("n01")
    assert h is not None and h.state == "quarantined"
    assert any(t.finding.key == "xid-79:gpu3" for t in h.active())


# -- without a cluster: the decision log carries the quarantines over ------------------------------


async def test_with_remediation_off_a_restart_carries_quarantines_over_from_the_decision_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "tokens").write_text("n1 token-n1-xxxxxxxxxxxxxxxx\n")
    log_path = tmp_path / "decisions.jsonl"
    cfg = Config(
        health=HealthConfig(clear_for_seconds=10.0, probation_seconds=300.0),
        remediation=RemediationConfig(mode="off"),
    )
    clock = FakeClock(start=T0)

    async def start() -> Pipeline:
        agg = await build_aggregator(
            cfg, RULES, auth=tmp_path / "tokens", clock=clock, decisions=log_path, advance_interval_s=None
        )
        lives.append(agg)
        return agg.pipeline

    lives: list[Aggregator] = []
    p = await start()
    p.ingest(healthy("bad", T0), T0)
    p.ingest(report(T0 + 1, node="bad", seq=1, boot_id="boot-1", events=[xid(79, gpu=3, at=T0 + 1)]), T0 + 1)
    p.ingest(healthy("mended", T0), T0)
    p.ingest(
        report(T0 + 1, node="mended", seq=1, boot_id="boot-1", events=[xid(79, gpu=3, at=T0 + 1)]), T0 + 1
    )
    t = T0 + 10.0
    while t < T0 + 40:  # repaired: a new boot, clean reports, on probation
        p.ingest(report(t, node="mended", seq=int(t), boot_id="boot-2"), t)
        t += 10
    probation = p.health.get("mended")
    assert probation is not None and probation.state == "probation"
    lives[-1].close()

    caplog.set_level(logging.INFO, logger="aggregator.pipeline")
    clock.advance(60)
    p2 = await start()
    bad = p2.health.get("bad")
    assert bad is not None and (bad.state, bad.tainted) == ("quarantined", True)
    mended = p2.health.get("mended")
    assert mended is not None and (mended.state, mended.since) == ("probation", probation.since)
    carried = sorted(
        r.node for r in caplog.records if r.getMessage() == "quarantine carried over across the restart"
    )  # type: ignore[attr-defined]
    assert carried == ["bad", "mended"]

    # The probation clock resumed where it was: the release comes on time, and is recorded.
    p2.advance(probation.since + 301)
    (release,) = [d for d in decisions(p2, "mended")]
    assert (release.state, release.previous, release.action) == ("healthy", "probation", "untaint")
    lives[-1].close()

    restored = [msgspec.json.decode(line) for line in log_path.read_bytes().splitlines()]
    assert restored[-1]["node"] == "mended" and restored[-1]["state"] == "healthy"


async def test_a_decision_queued_before_the_first_list_is_on_disk_when_its_report_is_answered(
    tmp_path: Path, aiohttp_client: Any
) -> None:
    # kill -9 between a report's 200 and the first Node LIST: the quarantine it caused is already
    # in the decision log, so the next life carries it over (in enforce mode the cluster would
    # tell it anyway; with its taint not yet written, only the log can).
    token = "token-n07-xxxxxxxxxxxxxxxx"
    (tmp_path / "tokens").write_text(f"n07 {token}\n")
    log_path = tmp_path / "decisions.jsonl"
    log = DecisionLog(log_path)
    p = build_pipeline(config(), RULES, log, cluster=Cluster())
    p.await_cluster()  # what the remediation runtime does when it is built: no action before the list
    app = create_app(
        p,
        StaticTokens(tmp_path / "tokens"),
        config(),
        FakeClock(start=T0),
        CollectorRegistry(),
        advance_interval_s=None,
        decisions=log,
    )
    server = TestServer(app)
    await server.start_server(**SERVER_KWARGS)
    client: TestClient[Any, Any] = await aiohttp_client(server)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
    for r in (healthy("n07", T0, seq=1), dbe("n07", T0 + 1, seq=2)):
        answer = await client.post(REPORTS_PATH, data=encode(r), headers=headers)
        assert answer.status == 200, await answer.text()
    # What a kill -9 now leaves: the file as it is (no close, no flush beyond what the 200 waited for).
    on_disk = list(read_decisions(log_path))
    assert [(d.node, d.state, d.action, d.reasons[-1].rule) for d in on_disk] == [
        ("n07", "quarantined", "none", AWAITING_CLUSTER)
    ]
    assert carried_over(on_disk)["n07"].state == "quarantined"
    await client.close()
    log.close()
