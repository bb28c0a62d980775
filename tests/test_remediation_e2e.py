"""End to end: aggregators with remediation on (``enforce``), fed reports over HTTP, against the
Kubernetes API-server double.

Each test runs two replicas built as ``gpuwarden aggregator --remediation enforce`` builds one
(``aggregator.app.build_aggregator``, with its own KubeClient from a kubeconfig) and plays the
agents: every report goes to every replica, gzip JSON with the node's bearer token.
Only the tests' view of the cluster is the double's own state; what the aggregators do, they do
through the real client over HTTP.

Time is real (the replicas' SystemClock), with short leader and health timings so a fail-over or
a probation takes seconds. Every wait polls a condition with a deadline; nothing sleeps for
behaviour. A test whose outcome must not depend on how busy the machine is gives the replicas a
``SteppedClock`` instead: the Lease's times then pass only as the test waits, never while the
event loop is stalled.

The replicas' Kubernetes client is wrapped by ``Severable``, which can cut the replica off from
the API server (every call then fails as an unreachable server would): that is how a test
crashes a leader without letting it release the Lease, and how another makes a second
controller's write land between our read of a node and our patch.
"""

from __future__ import annotations

import asyncio
import functools
import gzip
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from prometheus_client import CollectorRegistry

from agent.clock import Clock, SystemClock
from agent.report import Event
from aggregator.app import build_aggregator
from aggregator.audit import AuditLog
from aggregator.config import (
    Config,
    HealthConfig,
    LeaderConfig,
    LimitsConfig,
    RemediationConfig,
)
from aggregator.decisions import Decision
from aggregator.kube.api import KubeApi
from aggregator.kube.client import KubeClient
from aggregator.kube.objects import (
    KubeUnavailable,
)
from aggregator.pipeline import Pipeline
from aggregator.remediate.limits import decode_breaker
from aggregator.remediate.model import decode_snapshot
from aggregator.remediate.runtime import BREAKER_ANNOTATION, BREAKER_RESET_PATH, REMEDIATION_PATH, Remediation
from aggregator.rules import default_rules_dir, load_rules
from aggregator.rules.model import Rule
from aggregator.service import REPORTS_PATH
from tests.kube_double import Intercepted, KubeApiDouble
from tests.rulekit import report, xid

NS = "gpuwarden"
LEASE = "gpuwarden-aggregator"
OURS = "gpuwarden.io/unhealthy"
HEALTH = "gpuwarden.io/health"
POOL_LABEL = "gpuwarden.io/pool"
POOL = "h100-a"
ADMIN_TOKEN = "admin-token-for-the-breaker-0123456789"
KEEP_TAINT = {"key": "other.io/maintenance", "value": "drain", "effect": "NoSchedule"}
FLAP_KEY = "other.io/flap"
WAIT_S = 15.0  # the bound on every wait; the happy path takes a fraction of it
RULES: list[Rule] = load_rules([default_rules_dir()])


def config(
    *, max_pool_share: float = 1.0, resync_seconds: float = 2.0, probation_seconds: float = 1.5
) -> Config:
    return Config(
        health=HealthConfig(clear_for_seconds=1.0, probation_seconds=probation_seconds),
        remediation=RemediationConfig(
            mode="enforce",
            resync_seconds=resync_seconds,
            limits=LimitsConfig(max_pool_share=max_pool_share),
            leader=LeaderConfig(
                namespace=NS,
                lease_name=LEASE,
                lease_duration_seconds=3.0,
                renew_deadline_seconds=2.0,
                retry_period_seconds=0.5,
            ),
        ),
    )


class SteppedClock:
    """Wall time as it is (report, Lease and breaker times); monotonic time, the one the leader
    election measures its renew deadline and the lease's expiry on, advances only by what the
    test's own waits poll for (``eventually``, ``keep_reporting``).

    Under load the event loop can stall for longer than the renew deadline between two renewals:
    on the system clock the leader then steps down and the other replica may take over, so which
    replica writes depends on the machine's load. On this clock a stall costs no lease time; only
    waiting that long without a single renewal would, as on an idle machine."""

    def __init__(self) -> None:
        self._mono = 1000.0

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return self._mono

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def advance(self, seconds: float) -> None:
        self._mono += max(0.0, seconds)


def stall_the_event_loop(seconds: float) -> None:
    """What a busy machine does to the replicas: nothing in the loop runs for ``seconds``."""
    time.sleep(seconds)


# -- the replicas' Kubernetes client --------------------------------------------------------------


class Severable(Intercepted):
    """The client, cut off from the API server on demand (a crash or a partition: every call
    fails as an unreachable server does), with a hook run right after each node read."""

    def __init__(self, inner: KubeClient) -> None:
        super().__init__(inner)
        self.severed = False

    def before(self, op: str) -> None:
        if self.severed:
            raise KubeUnavailable(f"{op}: connection refused (severed by the test)")


# -- one replica, built by the composition root as gpuwarden aggregator builds it ------------------


@dataclass
class Replica:
    name: str
    url: str
    pipeline: Pipeline
    remediation: Remediation
    registry: CollectorRegistry
    kube: Severable
    audit: AuditLog
    stop: asyncio.Event
    task: asyncio.Task[None]

    @property
    def is_leader(self) -> bool:
        return self.remediation.elector.is_leader

    def writes(self, kind: str, result: str = "ok") -> float:
        value = self.registry.get_sample_value(
            "gpuwarden_remediation_writes_total", {"kind": kind, "result": result}
        )
        return value or 0.0

    def all_writes(self) -> float:
        kinds = ("taint", "untaint", "preflight_release", "condition", "event", "annotation")
        return sum(self.writes(k, r) for k in kinds for r in ("ok", "conflict", "error"))

    def decisions(self, node: str) -> list[Decision]:
        return [d for d in self.pipeline.decisions.recent() if d.node == node]

    def state(self, node: str) -> str | None:
        h = self.pipeline.health.get(node)
        return h.state if h is not None else None

    async def shutdown(self) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, WAIT_S)

    async def crash(self) -> None:
        """Dies without a word to the API server: cut off first, so that the shutdown's attempt
        to release the Lease fails as a killed process's would never make it; the lease expires."""
        self.kube.severed = True
        await self.shutdown()


async def start_replica(
    name: str, double: KubeApiDouble, tmp_path: Path, cfg: Config, clock: Clock | None = None
) -> Replica:
    kube: Severable | None = None

    async def connect() -> KubeApi:
        nonlocal kube
        client = await KubeClient.from_kubeconfig(double.write_kubeconfig(tmp_path / f"{name}.kubeconfig"))
        kube = Severable(client)
        return kube

    agg = await build_aggregator(
        cfg,
        RULES,
        auth=tmp_path / "tokens",
        clock=clock if clock is not None else SystemClock(),
        kube=connect,
        identity=name,
        admin_tokens=[ADMIN_TOKEN],
    )
    assert agg.remediation is not None and kube is not None
    remediation = agg.remediation

    stop = asyncio.Event()
    bound: asyncio.Future[tuple[str, int]] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        agg.serve(
            "127.0.0.1",
            0,
            stop=stop,
            on_started=lambda host, port: bound.set_result((host, port)),
            shutdown_timeout_s=1.0,
        ),
        name=f"replica-{name}",
    )
    host, port = await asyncio.wait_for(bound, WAIT_S)
    # Agents' reports must find the node labels (the pool) in the informer's cache.
    await asyncio.wait_for(remediation.actuator.synced(), WAIT_S)
    return Replica(
        name, f"http://{host}:{port}", agg.pipeline, remediation, agg.registry, kube, agg.audit, stop, task
    )


# -- the agents -----------------------------------------------------------------------------------


@dataclass
class Agent:
    node: str
    token: str
    boot_id: str = "boot-a"
    seq: int = 0

    def reboot(self, boot_id: str) -> None:
        self.boot_id = boot_id
        self.seq = 0


class Fleet:
    """The cluster's nodes in the double and their agents, which post to every replica given."""

    def __init__(self, double: KubeApiDouble, tmp_path: Path, session: aiohttp.ClientSession) -> None:
        self.double = double
        self.tmp_path = tmp_path
        self.session = session
        self.agents: dict[str, Agent] = {}
        self.clock: SteppedClock | None = None  # advanced by keep_reporting's pauses when set

    def add(self, count: int, *, reporting: int, taints: list[dict[str, str]] | None = None) -> list[str]:
        names = [f"gpu-{i:04d}" for i in range(1, count + 1)]
        for name in names:
            self.double.add_node(name, labels={POOL_LABEL: POOL}, taints=taints)
        for name in names[:reporting]:
            self.agents[name] = Agent(name, f"token-{name}-{'x' * 16}")
        (self.tmp_path / "tokens").write_text("".join(f"{a.node} {a.token}\n" for a in self.agents.values()))
        return names

    async def send(self, node: str, replicas: Sequence[Replica], *, events: Sequence[Event] = ()) -> None:
        agent = self.agents[node]
        agent.seq += 1
        now = time.time()
        body = gzip.compress(
            msgspec.json.encode(report(now, node=node, boot_id=agent.boot_id, seq=agent.seq, events=events))
        )
        headers = {
            "Authorization": f"Bearer {agent.token}",
            "Content-Type": "application/json",
            "Content-Encoding": "gzip",
        }
        for replica in replicas:
            async with self.session.post(replica.url + REPORTS_PATH, data=body, headers=headers) as resp:
                assert resp.status == 200, f"{replica.name} refused a report: {await resp.text()}"

    async def fault(self, node: str, replicas: Sequence[Replica]) -> None:
        """The node's GPU 3 fell off the bus (XID 79): a hard fault, out at once, until a reboot."""
        await self.send(node, replicas, events=[xid(79, gpu=3, at=time.time())])

    async def keep_reporting(
        self, nodes: Sequence[str], replicas: Sequence[Replica], until: Callable[[], bool], what: str
    ) -> None:
        """Every node reports every 0.2 s (as agents do, faster) until ``until()`` holds."""
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while not until():
            assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
            for node in nodes:
                await self.send(node, replicas)
            await asyncio.sleep(0.2)
            if self.clock is not None:
                self.clock.advance(0.2)


async def eventually(
    check: Callable[[], bool], what: str, timeout: float = WAIT_S, *, clock: SteppedClock | None = None
) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)
        if clock is not None:
            clock.advance(0.02)


async def leader_of(
    replicas: Sequence[Replica], *, clock: SteppedClock | None = None
) -> tuple[Replica, list[Replica]]:
    await eventually(lambda: sum(r.is_leader for r in replicas) == 1, "one leader", clock=clock)
    # And every replica's view of the cluster rebuilt: a decision taken before that is recorded
    # first without its action (docs/remediation.md), which these tests do not look at.
    await eventually(lambda: all(r.remediation.ready for r in replicas), "every view rebuilt", clock=clock)
    leader = next(r for r in replicas if r.is_leader)
    return leader, [r for r in replicas if r is not leader]


@asynccontextmanager
async def cluster(tmp_path: Path) -> AsyncIterator[tuple[KubeApiDouble, Fleet]]:
    async with KubeApiDouble() as double, aiohttp.ClientSession() as session:
        yield double, Fleet(double, tmp_path, session)


@asynccontextmanager
async def replicas(
    double: KubeApiDouble,
    tmp_path: Path,
    cfg: Config,
    names: Sequence[str] = ("agg-0", "agg-1"),
    *,
    clock: Clock | None = None,
) -> AsyncIterator[list[Replica]]:
    started: list[Replica] = []
    try:
        for name in names:
            started.append(await start_replica(name, double, tmp_path, cfg, clock))
        yield started
    finally:
        for r in started:
            if not r.task.done():
                await r.shutdown()


async def remediation_status(session: aiohttp.ClientSession, replica: Replica) -> dict[str, Any]:
    async with session.get(
        replica.url + REMEDIATION_PATH, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    ) as resp:
        assert resp.status == 200
        body: dict[str, Any] = await resp.json()
        return body


# -- what the cluster shows -----------------------------------------------------------------------


def node_taints(double: KubeApiDouble, name: str) -> list[dict[str, Any]]:
    return list(double.node(name)["spec"].get("taints") or [])


def ours(double: KubeApiDouble, name: str) -> list[dict[str, Any]]:
    return [t for t in node_taints(double, name) if t["key"] == OURS]


def others(double: KubeApiDouble, name: str) -> list[dict[str, Any]]:
    return [t for t in node_taints(double, name) if t["key"] != OURS]


def bare(taints: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Taints without the server's ``timeAdded``."""
    return [{k: v for k, v in t.items() if k != "timeAdded"} for t in taints]


def node_gets(double: KubeApiDouble, name: str, since: int = 0) -> int:
    """Reads of one node (a reconcile starts with one; the informer lists instead)."""
    return sum(1 for r in double.requests[since:] if r[:2] == ("GET", f"/api/v1/nodes/{name}"))


def gpu_condition(double: KubeApiDouble, name: str) -> dict[str, Any] | None:
    conditions = double.node(name)["status"].get("conditions") or []
    return next((c for c in conditions if c["type"] == "GPUHealthy"), None)


def node_events(double: KubeApiDouble, name: str, reason: str) -> list[dict[str, Any]]:
    return [e for e in double.events if e["involvedObject"]["name"] == name and e["reason"] == reason]


def lease_annotations(double: KubeApiDouble) -> dict[str, str]:
    lease = double.lease(NS, LEASE)
    assert lease is not None
    return dict(lease["metadata"].get("annotations") or {})


def lease_spec(double: KubeApiDouble) -> dict[str, Any]:
    lease = double.lease(NS, LEASE)
    assert lease is not None
    spec: dict[str, Any] = lease["spec"]
    return spec


def lease_holder(double: KubeApiDouble) -> str | None:
    holder: str | None = lease_spec(double).get("holderIdentity")
    return holder


def node_writes(double: KubeApiDouble, since: int) -> list[tuple[str, str, str]]:
    """Writes to Nodes and Events among the double's requests from index ``since`` on."""
    return [
        r for r in double.requests[since:] if r[0] != "GET" and ("/nodes" in r[1] or r[1].endswith("/events"))
    ]


# -- the tests ------------------------------------------------------------------------------------


async def test_a_hard_fault_taints_the_node_and_only_the_leader_writes(tmp_path: Path) -> None:
    # On the stepped clock: "only the leader writes" must not depend on the machine's load (a
    # stalled loop on the system clock can cost the leader its Lease mid-test).
    clock = SteppedClock()
    wait = functools.partial(eventually, clock=clock)
    async with cluster(tmp_path) as (double, fleet):
        fleet.clock = clock
        bad, good, quiet = fleet.add(3, reporting=2)
        async with replicas(double, tmp_path, config(), clock=clock) as both:
            leader, (follower,) = await leader_of(both, clock=clock)
            await fleet.send(bad, both)
            await fleet.send(good, both)
            await fleet.fault(bad, both)

            await wait(lambda: bool(ours(double, bad)), "the taint on the faulty node")
            await wait(lambda: bool(node_events(double, bad, "GpuwardenQuarantined")), "the quarantine event")
            assert bare(ours(double, bad)) == [{"key": OURS, "value": "xid-79", "effect": "NoSchedule"}]
            cond = gpu_condition(double, bad)
            assert cond is not None and (cond["status"], cond["reason"]) == ("False", "Quarantined")
            assert "fell off the bus" in cond["message"]
            snapshot = decode_snapshot(double.node(bad)["metadata"]["annotations"][HEALTH])
            assert snapshot is not None and (snapshot.state, snapshot.tainted) == ("quarantined", True)
            (event,) = node_events(double, bad, "GpuwardenQuarantined")
            assert event["type"] == "Warning" and "xid-79" in event["message"]
            assert not ours(double, good) and not ours(double, quiet)

            # Both replicas decided the same; only the leader wrote.
            for r in both:
                (d,) = [d for d in r.decisions(bad) if d.state == "quarantined"]
                assert d.action == "taint"
            assert leader.writes("taint") == 1
            assert follower.all_writes() == 0
            status = await remediation_status(fleet.session, follower)
            assert (status["is_leader"], status["leader"]) == (False, leader.name)


async def test_other_controllers_taints_survive_concurrent_changes(tmp_path: Path) -> None:
    async with cluster(tmp_path) as (double, fleet):
        (node,) = fleet.add(1, reporting=1, taints=[KEEP_TAINT])
        async with replicas(double, tmp_path, config()) as both:
            leader, _ = await leader_of(both)
            await fleet.send(node, both)
            await eventually(lambda: gpu_condition(double, node) is not None, "the healthy condition")

            # Another controller flips its own taint on and off all the time and checks, before
            # each change, that nobody dropped or resurrected what it wrote last.
            flap_on = False
            clobbered: list[list[dict[str, Any]]] = []

            def flip(n: dict[str, Any]) -> None:
                nonlocal flap_on
                current = [t for t in n["spec"].get("taints") or [] if t["key"] != OURS]
                expected = [KEEP_TAINT] + ([{"key": FLAP_KEY, "effect": "NoSchedule"}] if flap_on else [])
                if bare(current) != expected:
                    clobbered.append(current)
                taints = n["spec"].setdefault("taints", [])
                if flap_on:
                    taints[:] = [t for t in taints if t["key"] != FLAP_KEY]
                else:
                    taints.append({"key": FLAP_KEY, "effect": "NoSchedule"})
                flap_on = not flap_on

            async def other_controller() -> None:
                while True:
                    double.update_node(node, flip)
                    await asyncio.sleep(0.01)

            # And once per phase its write lands right between our read and our patch.
            conflicts = {
                "taint": leader.writes("taint", "conflict"),
                "untaint": leader.writes("untaint", "conflict"),
            }
            phase: list[str] = []

            def between_read_and_patch(name: str) -> None:
                if name == node and phase and leader.writes(phase[0], "conflict") == conflicts[phase[0]]:
                    double.update_node(node, flip)

            for r in both:
                r.kube.after_get = between_read_and_patch
            writer = asyncio.create_task(other_controller())
            try:
                phase[:] = ["taint"]
                await fleet.fault(node, both)
                await fleet.keep_reporting([node], both, lambda: bool(ours(double, node)), "our taint")
                assert leader.writes("taint", "conflict") > conflicts["taint"]

                phase[:] = ["untaint"]
                fleet.agents[node].reboot("boot-b")  # repaired: the XID 79 clears with the reboot
                await fleet.keep_reporting([node], both, lambda: not ours(double, node), "our taint to go")
                assert leader.writes("untaint", "conflict") > conflicts["untaint"]
            finally:
                writer.cancel()
                await asyncio.gather(writer, return_exceptions=True)

            assert clobbered == []
            assert bare(others(double, node)) == [KEEP_TAINT] + (
                [{"key": FLAP_KEY, "effect": "NoSchedule"}] if flap_on else []
            )
            assert leader.writes("taint") == 1 and leader.writes("untaint") == 1
            assert [d.action for d in leader.decisions(node) if d.action != "none"] == ["taint", "untaint"]


async def test_safety_limits_hold_then_release_after_a_reset(tmp_path: Path) -> None:
    # Which replica leads decides who writes; on a SteppedClock the machine's load cannot change it.
    clock = SteppedClock()
    wait = functools.partial(eventually, clock=clock)
    cfg = config(max_pool_share=0.1)
    async with cluster(tmp_path) as (double, fleet):
        fleet.clock = clock
        first, second, *_ = fleet.add(10, reporting=2)
        async with replicas(double, tmp_path, cfg, clock=clock) as both:
            leader, (follower,) = await leader_of(both, clock=clock)
            for node in (first, second):
                await fleet.send(node, both)
            await fleet.fault(first, both)
            await wait(lambda: bool(ours(double, first)), "the first node's taint")

            # 1 of 10 may be out: the second fault is held, everywhere, and the breaker opens.
            await fleet.fault(second, both)
            await wait(lambda: all(r.decisions(second) for r in both), "both replicas' decisions")
            for r in both:
                (d,) = r.decisions(second)
                assert (d.state, d.action) == ("quarantined", "held")
            await wait(
                lambda: (c := gpu_condition(double, second)) is not None and c["reason"] == "QuarantineHeld",
                "the held condition",
            )
            assert not ours(double, second)
            await wait(lambda: BREAKER_ANNOTATION in lease_annotations(double), "the breaker in the Lease")
            stored = decode_breaker(lease_annotations(double)[BREAKER_ANNOTATION])
            assert stored is not None and stored.open and stored.limit == "pool_share"
            for r in both:
                status = await remediation_status(fleet.session, r)
                assert status["breaker"]["open"] is True and status["held_nodes"] == [second]

            # Both replicas opened the breaker: once it is in the Lease it stays put (no replica
            # keeps rewriting it), and on-call hears of it once.
            # Both open it within milliseconds of each other and each may write that once: it has
            # settled after a few renewals.
            def lease_writes() -> int:
                return sum(1 for r in double.requests if r[0] == "PUT" and r[1].endswith(f"/leases/{LEASE}"))

            before = lease_writes()
            await fleet.keep_reporting(
                [first, second], both, lambda: lease_writes() >= before + 4, "the breaker settling"
            )
            settled = lease_annotations(double)[BREAKER_ANNOTATION]
            lease_puts = lease_writes()
            await fleet.keep_reporting(
                [first, second],
                both,
                lambda: (
                    sum(1 for r in double.requests if r[0] == "PUT" and r[1].endswith(f"/leases/{LEASE}"))
                    >= lease_puts + 4
                ),
                "a few lease renewals",
            )
            assert lease_annotations(double)[BREAKER_ANNOTATION] == settled
            opened = [sum(1 for a in r.audit.recent if a.action == "breaker_open") for r in both]
            assert max(opened) == 1, opened  # each replica's audit log says it once

            # The first node is repaired and released; the breaker stays open all the same.
            fleet.agents[first].reboot("boot-b")
            await fleet.keep_reporting(
                [first, second],
                both,
                lambda: not ours(double, first) and all(r.state(first) == "healthy" for r in both),
                "the first node's release",
            )
            assert [d.state for d in leader.decisions(first)] == ["quarantined", "probation", "healthy"]
            assert not ours(double, second)
            assert all(r.pipeline.limits.open for r in both)

            # The machine is busy: the loop stalls for longer than the lease lasts. On the system
            # clock the leader would have stepped down by then, and the follower would find the
            # lease expired and race it for the next one. Here the leader stays the leader.
            stall_the_event_loop(cfg.remediation.leader.lease_duration_seconds + 0.5)
            assert leader.is_leader
            await asyncio.sleep(2 * cfg.remediation.leader.retry_period_seconds)  # both lease loops run
            assert leader.is_leader and not follower.is_leader

            # A human resets it, on the replica that does not lead: the leader learns it from the
            # Lease and taints the held node.
            reset = {"by": "alice", "reason": "first node repaired, second checked"}
            async with fleet.session.post(
                follower.url + BREAKER_RESET_PATH, json=reset, headers={"Authorization": "Bearer not-admin"}
            ) as resp:
                assert resp.status == 401
            assert follower.pipeline.limits.open
            async with fleet.session.post(
                follower.url + BREAKER_RESET_PATH,
                json=reset,
                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            ) as resp:
                assert resp.status == 200
                body = await resp.json()
            assert body["breaker"].get("open", False) is False and body["breaker"]["reset_by"] == "alice"
            assert body["stored"] is True  # in the Lease already: every replica reads it
            assert [a.by for a in follower.audit.recent if a.action == "breaker_reset"] == ["alice"]

            await wait(lambda: bool(ours(double, second)), "the held node's taint")
            assert bare(ours(double, second)) == [{"key": OURS, "value": "xid-79", "effect": "NoSchedule"}]
            await wait(lambda: not any(r.pipeline.limits.open for r in both), "both adopting the reset")
            for r in both:
                last = r.decisions(second)[-1]
                assert (last.state, last.previous, last.action) == ("quarantined", "quarantined", "taint")
                status = await remediation_status(fleet.session, r)
                assert status["breaker"].get("open", False) is False and status["held_nodes"] == []
            stored = decode_breaker(lease_annotations(double)[BREAKER_ANNOTATION])
            assert stored is not None and not stored.open and stored.reset_by == "alice"
            await wait(
                lambda: (c := gpu_condition(double, second)) is not None and c["reason"] == "Quarantined",
                "the quarantined condition",
            )
            assert leader.writes("taint") == 2 and follower.all_writes() == 0


async def test_a_leader_crash_loses_nothing(tmp_path: Path) -> None:
    async with cluster(tmp_path) as (double, fleet):
        first, second, _ = fleet.add(3, reporting=2)
        async with replicas(double, tmp_path, config()) as both:
            leader, (survivor,) = await leader_of(both)
            for node in (first, second):
                await fleet.send(node, both)
            await fleet.fault(first, both)
            await eventually(
                lambda: bool(node_events(double, first, "GpuwardenQuarantined")), "the quarantine"
            )
            assert ours(double, first)

            await leader.crash()
            assert lease_holder(double) == leader.name  # never released: the survivor must wait it out
            transitions = lease_spec(double).get("leaseTransitions", 0)

            # The new fault reaches the survivor only (the dead replica's spool waits); it decides
            # at once and acts when the lease it cannot renew has expired.
            await fleet.fault(second, [survivor])
            assert lease_holder(double) == leader.name  # decided by a replica that does not lead
            assert [d.action for d in survivor.decisions(second)] == ["taint"]
            await fleet.keep_reporting(
                [first, second], [survivor], lambda: bool(ours(double, second)), "the survivor's taint"
            )
            assert survivor.is_leader and lease_holder(double) == survivor.name
            assert lease_spec(double)["leaseTransitions"] == transitions + 1
            await eventually(lambda: bool(node_events(double, second, "GpuwardenQuarantined")), "its event")

            for node in (first, second):
                assert len(ours(double, node)) == 1
            assert survivor.writes("taint") == 1  # the new fault's; the first node's taint stood
            assert len(node_events(double, first, "GpuwardenQuarantined")) == 1


async def test_a_clean_shutdown_releases_the_lease_only_once_its_writes_are_answered(tmp_path: Path) -> None:
    # The leader's taint PATCH takes the API server a second (slow admission, a slow etcd) and is
    # applied only then, whether or not the leader still waits. The leader is told to stop
    # meanwhile: were the Lease released at once, the follower could take over, read the node
    # untainted and act on it before our write landed. Every Lease write records whether the
    # taint was on by then.
    clock = SteppedClock()
    async with cluster(tmp_path) as (double, fleet):
        fleet.clock = clock
        (node,) = fleet.add(1, reporting=1)
        async with replicas(double, tmp_path, config(), clock=clock) as both:
            leader, _ = await leader_of(both, clock=clock)
            await fleet.send(node, both)
            seen: list[tuple[str | None, bool]] = []
            store = double._store_lease

            def recording(body: dict[str, Any]) -> dict[str, Any]:
                stored = store(body)
                seen.append((stored["spec"].get("holderIdentity"), bool(ours(double, node))))
                return stored

            double._store_lease = recording  # type: ignore[method-assign]
            double.set_latency("patch", 1.0, path_regex=f"/nodes/{node}$", applied_late=True)
            await fleet.fault(node, both)
            await eventually(
                lambda: ("PATCH", f"/api/v1/nodes/{node}") in {(m, p) for m, p, _ in double.requests},
                "the taint's PATCH sent",
                clock=clock,
            )
            assert not ours(double, node)  # still being applied

            await leader.shutdown()
            after = [taint_on for holder, taint_on in seen if holder != leader.name]
            assert after, "the Lease was never released"
            assert after[0], "the Lease was released before the leader's taint landed"
            assert len(ours(double, node)) == 1


def resync_time(replica: Replica) -> float:
    value = replica.registry.get_sample_value("gpuwarden_remediation_last_resync_timestamp_seconds")
    return value or 0.0


def queue_depth(replica: Replica) -> float:
    return replica.registry.get_sample_value("gpuwarden_remediation_queue_depth") or 0.0


@asynccontextmanager
async def restarted_and_resynced(
    double: KubeApiDouble, tmp_path: Path, cfg: Config, name: str, nodes: Sequence[str]
) -> AsyncIterator[Replica]:
    """A replica started from nothing against the cluster, once it leads and has been through the
    resync on gaining leadership and one periodic resync, its work queue empty after each."""
    async with replicas(double, tmp_path, cfg, names=(name,)) as (fresh,):
        await eventually(lambda: fresh.is_leader, f"{name} leading")

        await eventually(
            lambda: resync_time(fresh) > 0 and queue_depth(fresh) == 0, f"{name}'s resync on leading"
        )
        first = resync_time(fresh)
        await eventually(
            lambda: resync_time(fresh) > first and queue_depth(fresh) == 0, f"{name}'s periodic resync"
        )
        yield fresh


async def test_a_restart_taints_nothing_twice(tmp_path: Path) -> None:
    cfg = config(resync_seconds=1.0, probation_seconds=60.0)
    async with cluster(tmp_path) as (double, fleet):
        bad, mending, good, quiet = fleet.add(4, reporting=3)
        reporting = [bad, mending, good]
        async with replicas(double, tmp_path, cfg) as both:
            leader, _ = await leader_of(both)
            for node in reporting:
                await fleet.send(node, both)
            await fleet.fault(bad, both)
            await fleet.fault(mending, both)
            fleet.agents[mending].reboot("boot-b")  # repaired: on probation for a minute
            await fleet.keep_reporting(
                reporting,
                both,
                lambda: (
                    bool(node_events(double, bad, "GpuwardenQuarantined"))
                    and bool(node_events(double, mending, "GpuwardenProbation"))
                    and gpu_condition(double, good) is not None
                ),
                "the leader's writes",
            )
            probation = leader.pipeline.health.get(mending)
            assert probation is not None and probation.state == "probation"
        # Both replicas stopped (cleanly: the Lease is released). One starts again from nothing,
        # and again, with no report in between (the agents cannot reach it yet).
        before = {n: double.node(n) for n in (bad, mending, good, quiet)}
        mark = len(double.requests)
        for name in ("agg-2", "agg-3"):
            async with restarted_and_resynced(double, tmp_path, cfg, name, reporting) as fresh:
                h = fresh.pipeline.health.get(bad)
                assert h is not None and h.state == "quarantined" and h.tainted
                assert [t.finding.rule for t in h.active()] == ["xid-79"]  # the evidence, until a reboot
                p = fresh.pipeline.health.get(mending)
                assert p is not None and (p.state, p.since, p.tainted) == ("probation", probation.since, True)
                assert fresh.decisions(bad) == [] and fresh.decisions(mending) == []
                assert node_writes(double, mark) == []
                assert {n: double.node(n) for n in before} == before

        # The nodes report again: the restored XID 79 node the boot it failed in, so it stays
        # quarantined; the mended one stays on probation. Through periodic resyncs, no write.
        async with restarted_and_resynced(double, tmp_path, cfg, "agg-4", reporting) as fresh:
            seen = len(double.requests)
            start = resync_time(fresh)
            resyncs: set[float] = set()

            def two_more_resyncs() -> bool:
                if resync_time(fresh) > start:
                    resyncs.add(resync_time(fresh))
                return len(resyncs) >= 2 and queue_depth(fresh) == 0

            await fleet.keep_reporting(reporting, [fresh], two_more_resyncs, "two periodic resyncs")
            # Nothing to change: the resyncs judged from the informer's copy, not one read.
            assert all(node_gets(double, n, seen) == 0 for n in reporting)
            assert (fresh.state(bad), fresh.state(mending)) == ("quarantined", "probation")
            assert fresh.decisions(bad) == [] and fresh.decisions(mending) == []
            for node in (bad, mending):
                assert bare(ours(double, node)) == [{"key": OURS, "value": "xid-79", "effect": "NoSchedule"}]
            assert fresh.writes("untaint") == 0 and fresh.writes("taint") == 0
            assert node_writes(double, mark) == []
