"""The remediation actuator against the real ``KubeClient`` and the API-server double, over HTTP.

Time is a ``FakeClock``; the actuator's sleeps go through ``Timers``, which advances that clock
at once for short waits (rate limiting, retry backoff) and parks long ones (the periodic resync,
the preflight deadline) until a test moves time on, so no test waits on the wall clock for
behaviour, only for the actuator's own tasks to get through their HTTP calls.

What a plan holds for each kind of node is tests/test_planner.py's table; these tests are about
the plans reaching the cluster: over the real client, once, on the leader, without clobbering.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY, CollectorRegistry

from agent.clock import FakeClock
from aggregator.config import PreflightConfig, RemediationConfig
from aggregator.kube.client import KubeClient
from aggregator.kube.objects import (
    KubeConflict,
    KubeGone,
    KubeUnavailable,
    TaintEffect,
)
from aggregator.remediate.actuator import Actuator, ActuatorMetrics
from aggregator.remediate.model import HealthSnapshot, NodeIntent, decode_snapshot
from aggregator.remediate.planner import rfc3339
from tests.kube_double import Intercepted, KubeApiDouble
from tests.test_kube_double import a_lease

OURS = "gpuwarden.io/unhealthy"
PREFLIGHT = "gpuwarden.io/preflight"
HEALTH = "gpuwarden.io/health"
OVERRIDE = "gpuwarden.io/override"
OTHER_TAINT = {
    "key": "other.io/maintenance",
    "value": "drain",
    "effect": "NoExecute",
    "timeAdded": "2025-01-02T03:04:05Z",
}


# -- test doubles ---------------------------------------------------------------------------------


class Intents:
    """The pipeline as the actuator sees it: a dict of intents, recording ``restore`` calls and
    which nodes were asked about before they were restored."""

    def __init__(self) -> None:
        self.by_node: dict[str, NodeIntent] = {}
        self.restored: list[tuple[str, HealthSnapshot | None, str | None, float]] = []
        self.asked: list[str] = []
        self.calls: list[tuple[str, str]] = []  # ("restore" | "intent", node), in order
        self.on_restore: Callable[[str, HealthSnapshot | None, str | None], None] | None = None
        self.broken: set[str] = set()

    def intent(self, node: str) -> NodeIntent | None:
        self.asked.append(node)
        self.calls.append(("intent", node))
        if node in self.broken:
            raise RuntimeError(f"pipeline bug for {node}")
        return self.by_node.get(node)

    def intent_nodes(self) -> Iterable[str]:
        return list(self.by_node)

    def restore(
        self, node: str, snapshot: HealthSnapshot | None, taint_value: str | None, now: float
    ) -> None:
        self.restored.append((node, snapshot, taint_value, now))
        self.calls.append(("restore", node))
        if self.on_restore is not None:
            self.on_restore(node, snapshot, taint_value)


class Timers:
    """The actuator's injected sleep on a FakeClock: waits up to ``auto_s`` pass at once (the
    clock jumps), longer ones park until ``advance`` moves the clock past them."""

    def __init__(self, clock: FakeClock, auto_s: float = 60.0) -> None:
        self.clock = clock
        self.auto_s = auto_s
        self._parked: list[tuple[float, asyncio.Future[None]]] = []

    async def __call__(self, seconds: float) -> None:
        if seconds <= self.auto_s:
            self.clock.advance(max(0.0, seconds))
            self._release()
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._parked.append((self.clock.monotonic() + seconds, fut))
        await fut

    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self._release()

    def _release(self) -> None:
        now = self.clock.monotonic()
        keep = []
        for due, fut in self._parked:
            if due <= now:
                if not fut.done():
                    fut.set_result(None)
            else:
                keep.append((due, fut))
        self._parked = keep


class Recording(Intercepted):
    """The client, recording the fake time of every node read and write (the actuator's own
    calls: lists and watches are the informer's); the actuator never touches leases."""

    def __init__(self, inner: KubeClient, clock: FakeClock) -> None:
        super().__init__(inner)
        self.clock = clock
        self.calls: list[tuple[float, str]] = []
        self.informer: list[str] = []  # "list" and "watch", in order

    def before(self, op: str) -> None:
        if "lease" in op:
            raise AssertionError(f"the actuator never touches leases ({op})")
        if op in ("list", "watch"):
            self.informer.append(op)
        if op in ("get", "patch", "condition", "event"):
            self.calls.append((self.clock.monotonic(), op))


# -- helpers --------------------------------------------------------------------------------------

T0 = 1_764_441_600.0


def intent(
    node: str,
    state: str = "quarantined",
    *,
    effect: TaintEffect | None = "NoSchedule",
    reason_code: str = "xid-79",
    message: str = "XID 79: GPU fell off the bus",
    evidence_key: str = "xid:79:gpu0",
    held: bool = False,
    since: float = T0,
    preflight: str = "pending",
) -> NodeIntent:
    if state in ("healthy",) and effect == "NoSchedule":
        effect = None
    snapshot = HealthSnapshot(
        state=state,  # type: ignore[arg-type]
        since=since,
        tainted=effect is not None and state != "suspect",  # as the pipeline: the decision took it out
        held=held,
        reason_code=reason_code,
    )
    return NodeIntent(
        node=node,
        state=state,  # type: ignore[arg-type]
        since=since,
        effect=effect,
        reason_code=reason_code,
        message=message,
        evidence_key=evidence_key,
        held=held,
        snapshot=snapshot,
        preflight=preflight,  # type: ignore[arg-type]
    )


def healthy(node: str, **kw: Any) -> NodeIntent:
    kw.setdefault("message", "no findings")
    return intent(node, "healthy", effect=None, **kw)


def taints(api: KubeApiDouble, name: str) -> list[dict[str, Any]]:
    return list(api.node(name)["spec"].get("taints") or [])


def ours(api: KubeApiDouble, name: str) -> list[dict[str, Any]]:
    return [t for t in taints(api, name) if t["key"] == OURS]


def node_annotations(api: KubeApiDouble, name: str) -> dict[str, str]:
    return dict(api.node(name)["metadata"].get("annotations") or {})


def condition(api: KubeApiDouble, name: str) -> dict[str, Any] | None:
    conds = api.node(name)["status"].get("conditions") or []
    return next((c for c in conds if c["type"] == "GPUHealthy"), None)


def events(api: KubeApiDouble, name: str) -> list[tuple[str, str, str]]:
    return [(e["type"], e["reason"], e["message"]) for e in api.events if e["involvedObject"]["name"] == name]


def node_writes(api: KubeApiDouble) -> list[tuple[str, str, str]]:
    return [w for w in api.writes() if w[1].startswith("/api/v1/nodes") or "/events" in w[1]]


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def until(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Wait (real time, bounded) for the actuator's tasks to bring the cluster to a state."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        await asyncio.sleep(0.005)


class World:
    def __init__(self, api: KubeApiDouble, kube: Recording, clock: FakeClock) -> None:
        self.api = api
        self.kube = kube
        self.clock = clock
        self.timers = Timers(clock)
        self.intents = Intents()
        self.leader = True
        self.registry = CollectorRegistry()

    def actuator(self, intents: Intents | None = None, **config: Any) -> Actuator:
        config.setdefault("mode", "enforce")
        self.registry = CollectorRegistry()
        return Actuator(
            self.kube,
            RemediationConfig(**config),
            intents if intents is not None else self.intents,
            clock=self.clock,
            is_leader=lambda: self.leader,
            metrics=ActuatorMetrics(self.registry),
            sleep=self.timers,
        )

    def reconciles(self) -> float:
        return sample(self.registry, "gpuwarden_remediation_reconcile_seconds_count")

    @asynccontextmanager
    async def running(self, actuator: Actuator) -> AsyncIterator[Actuator]:
        task = asyncio.create_task(actuator.run())
        try:
            await asyncio.wait_for(actuator.synced(), 10)
            yield actuator
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task


@asynccontextmanager
async def make_world(tmp_path: Path, start: float) -> AsyncIterator[World]:
    """The API-server double, the real client against it (recording its calls), a fake clock."""
    async with KubeApiDouble() as api:
        client = await KubeClient.from_kubeconfig(api.write_kubeconfig(tmp_path / "kubeconfig"))
        clock = FakeClock(start=start)
        try:
            yield World(api, Recording(client, clock), clock)
        finally:
            await client.close()


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    async with make_world(tmp_path, T0) as w:
        yield w


# -- taint, annotations, condition, event ---------------------------------------------------------


async def test_quarantine_taints_keeps_other_taints_and_records_everything(world: World) -> None:
    api = world.api
    other2 = {"key": "nvidia.com/gpu", "value": "present", "effect": "PreferNoSchedule"}
    created = api.add_node("n1", taints=[OTHER_TAINT, other2])
    act = world.actuator()
    world.intents.by_node["n1"] = intent("n1", since=T0 - 30)

    await act.reconcile("n1")

    assert taints(api, "n1") == [
        OTHER_TAINT,
        other2,
        {"key": OURS, "value": "xid-79", "effect": "NoSchedule"},
    ]
    ann = node_annotations(api, "n1")
    snap = decode_snapshot(ann[HEALTH])
    assert snap is not None and snap.state == "quarantined" and snap.tainted and snap.since == T0 - 30
    assert ann["gpuwarden.io/reason"] == "XID 79: GPU fell off the bus"
    assert ann["gpuwarden.io/decided-at"] == rfc3339(T0 - 30) == "2025-11-29T18:39:30Z"
    cond = condition(api, "n1")
    assert cond is not None
    assert (cond["status"], cond["reason"]) == ("False", "Quarantined")
    assert cond["message"].startswith("XID 79: GPU fell off the bus; next: probation starts")
    assert cond["lastTransitionTime"] == rfc3339(T0 - 30)
    assert any(c["type"] == "Ready" for c in api.node("n1")["status"]["conditions"])  # kubelet's untouched
    [ev] = [e for e in api.events if e["involvedObject"]["name"] == "n1"]
    assert (ev["type"], ev["reason"]) == ("Warning", "GpuwardenQuarantined")
    assert ev["involvedObject"]["uid"] == created["metadata"]["uid"]
    assert ev["metadata"]["namespace"] == "default"
    assert f"{OURS}=xid-79:NoSchedule" in ev["message"] and "GPU fell off the bus" in ev["message"]
    assert "\n" not in ev["message"]
    assert sample(world.registry, "gpuwarden_remediation_writes_total", kind="taint", result="ok") == 1
    assert sample(world.registry, "gpuwarden_remediation_writes_total", kind="condition", result="ok") == 1
    assert sample(world.registry, "gpuwarden_remediation_writes_total", kind="event", result="ok") == 1


async def test_reapplying_a_decision_writes_nothing(world: World) -> None:
    world.api.add_node("n1", taints=[OTHER_TAINT])
    act = world.actuator()
    world.intents.by_node["n1"] = intent("n1")
    await act.reconcile("n1")
    before = len(world.api.writes())
    assert before == 3  # taint+annotations in one patch, the condition, the event

    for _ in range(3):
        await act.reconcile("n1")
    assert len(world.api.writes()) == before
    assert len(events(world.api, "n1")) == 1


async def test_release_removes_only_our_taint_and_says_so(world: World) -> None:
    api = world.api
    api.add_node("n1", taints=[OTHER_TAINT])
    act = world.actuator()
    world.intents.by_node["n1"] = intent("n1")
    await act.reconcile("n1")
    world.intents.by_node["n1"] = healthy("n1", since=T0 + 3600)
    await act.reconcile("n1")

    assert taints(api, "n1") == [OTHER_TAINT]
    snap = decode_snapshot(node_annotations(api, "n1")[HEALTH])
    assert snap is not None and snap.state == "healthy" and not snap.tainted
    cond = condition(api, "n1")
    assert cond is not None and (cond["status"], cond["reason"]) == ("True", "Healthy")
    assert [e[:2] for e in events(api, "n1")] == [
        ("Warning", "GpuwardenQuarantined"),
        ("Normal", "GpuwardenReleased"),
    ]
    assert sample(world.registry, "gpuwarden_remediation_writes_total", kind="untaint", result="ok") == 1


async def test_state_changes_each_get_one_event(world: World) -> None:
    api = world.api
    api.add_node("n1")
    act = world.actuator()
    steps = [
        (intent("n1", "suspect", effect=None, since=T0), ("Warning", "GpuwardenSuspect"), "True", "Suspect"),
        (intent("n1", since=T0 + 100), ("Warning", "GpuwardenQuarantined"), "False", "Quarantined"),
        (intent("n1", "probation", since=T0 + 200), ("Normal", "GpuwardenProbation"), "False", "Probation"),
        (intent("n1", since=T0 + 300), ("Warning", "GpuwardenQuarantined"), "False", "Quarantined"),
        (healthy("n1", since=T0 + 400), ("Normal", "GpuwardenReleased"), "True", "Healthy"),
    ]
    for i, (want, ev, status, reason) in enumerate(steps):
        world.intents.by_node["n1"] = want
        await act.reconcile("n1")
        await act.reconcile("n1")
        got = events(api, "n1")
        assert len(got) == i + 1 and got[-1][:2] == ev
        cond = condition(api, "n1")
        assert cond is not None and (cond["status"], cond["reason"]) == (status, reason)
        assert bool(ours(api, "n1")) == (want.effect is not None)
    assert "relapsed during probation" in events(api, "n1")[3][2]


async def test_suspect_prefer_no_schedule_is_ours_to_remove_but_never_restored_as_out(world: World) -> None:
    api = world.api
    api.add_node("n1", taints=[OTHER_TAINT])
    act = world.actuator(suspect_effect="PreferNoSchedule")
    world.intents.by_node["n1"] = intent("n1", "suspect", effect="PreferNoSchedule", reason_code="ecc-rate")
    await act.reconcile("n1")
    assert ours(api, "n1") == [{"key": OURS, "value": "ecc-rate", "effect": "PreferNoSchedule"}]
    snap = decode_snapshot(node_annotations(api, "n1")[HEALTH])
    # A restarted pipeline restoring tainted=true would turn this suspect into a NoSchedule.
    assert snap is not None and snap.state == "suspect" and not snap.tainted
    assert node_annotations(api, "n1")["gpuwarden.io/taint"] == "ecc-rate:PreferNoSchedule"

    world.intents.by_node["n1"] = healthy("n1", since=T0 + 60)
    await act.reconcile("n1")
    assert taints(api, "n1") == [OTHER_TAINT]
    assert "gpuwarden.io/taint" not in node_annotations(api, "n1")


async def test_condition_written_only_when_it_changes(world: World) -> None:
    world.api.add_node("n1")
    act = world.actuator()
    world.intents.by_node["n1"] = intent("n1")
    await act.reconcile("n1")
    # Same status, reason and message, a later since (a re-entered state): no new condition write.
    world.intents.by_node["n1"] = intent("n1", since=T0 + 5)
    await act.reconcile("n1")
    status_writes = [w for w in world.api.writes() if w[1].endswith("/status")]
    assert len(status_writes) == 1
    # The same decision described with newer words (a measured value in the summary changes with
    # every report): it is not a change, and a resync of it writes nothing.
    world.intents.by_node["n1"] = intent("n1", since=T0 + 10, message="XID 79 again")
    await act.reconcile("n1")
    status_writes = [w for w in world.api.writes() if w[1].endswith("/status")]
    assert len(status_writes) == 1
    # Another reason (a new decision): the condition says so.
    world.intents.by_node["n1"] = intent("n1", since=T0 + 200, message="DBE on GPU 2", reason_code="dbe")
    await act.reconcile("n1")
    status_writes = [w for w in world.api.writes() if w[1].endswith("/status")]
    assert len(status_writes) == 2
    cond = condition(world.api, "n1")
    assert cond is not None and cond["message"].startswith("DBE on GPU 2; next:")


# -- what is never touched ------------------------------------------------------------------------


async def test_unmanaged_node_is_never_touched(world: World) -> None:
    world.api.add_node("n1", labels={"gpuwarden.io/managed": "false"}, taints=[OTHER_TAINT])
    act = world.actuator()
    world.intents.by_node["n1"] = intent("n1")
    await act.reconcile("n1")
    assert node_writes(world.api) == []
    assert world.api.events == []
    assert taints(world.api, "n1") == [OTHER_TAINT]


async def test_node_the_pipeline_does_not_know_is_left_as_it_is(world: World) -> None:
    world.api.add_node("n1", taints=[{"key": OURS, "value": "x", "effect": "NoSchedule"}])
    act = world.actuator()
    await act.reconcile("n1")
    assert world.kube.calls == []
    assert world.api.requests == []


async def test_dry_run_computes_and_logs_but_writes_nothing(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    world.api.add_node("n1", taints=[OTHER_TAINT])
    act = world.actuator(mode="dry-run")
    world.intents.by_node["n1"] = intent("n1")
    with caplog.at_level(logging.INFO, logger="aggregator.remediate.actuator"):
        await act.reconcile("n1")
        await act.reconcile("n1")
    assert node_writes(world.api) == []
    assert world.api.events == []
    patch_logs = [r for r in caplog.records if r.getMessage() == "dry-run: would patch node"]
    assert len(patch_logs) == 1  # the same plan is logged once, not at every resync
    rec = patch_logs[0]
    assert rec.__dict__["node"] == "n1" and rec.__dict__["kind"] == "taint"
    assert rec.__dict__["taints_before"] == ["other.io/maintenance=drain:NoExecute"]
    assert rec.__dict__["taints_after"] == [
        "other.io/maintenance=drain:NoExecute",
        f"{OURS}=xid-79:NoSchedule",
    ]
    for kind in ("taint", "condition", "event"):
        assert sample(world.registry, "gpuwarden_remediation_writes_total", kind=kind, result="dry_run") == 1
        assert sample(world.registry, "gpuwarden_remediation_writes_total", kind=kind, result="ok") == 0


async def test_only_the_leader_writes(world: World) -> None:
    world.api.add_node("n1")
    act = world.actuator()
    world.intents.by_node["n1"] = intent("n1")
    world.leader = False
    await act.reconcile("n1")
    assert world.api.requests == []
    world.leader = True
    await act.reconcile("n1")
    assert len(ours(world.api, "n1")) == 1


# -- taint values and effects ---------------------------------------------------------------------


async def test_no_execute_needs_allow_and_is_rate_limited_per_hour(world: World) -> None:
    for n in ("a", "b", "c"):
        world.api.add_node(n)
    act = world.actuator()
    world.intents.by_node["a"] = intent("a", effect="NoExecute")
    await act.reconcile("a")
    assert ours(world.api, "a")[0]["effect"] == "NoSchedule"  # allow_no_execute is off

    act = world.actuator(allow_no_execute=True, max_no_execute_per_hour=1)
    for n in ("b", "c"):
        world.intents.by_node[n] = intent(n, effect="NoExecute")
        await act.reconcile(n)
    assert ours(world.api, "b")[0]["effect"] == "NoExecute"
    assert ours(world.api, "c")[0]["effect"] == "NoSchedule"  # the hour's one eviction is spent
    await act.reconcile("b")
    assert ours(world.api, "b")[0]["effect"] == "NoExecute"  # keeping one is not a new one

    world.clock.advance(3601)
    await act.reconcile("c")
    assert ours(world.api, "c")[0]["effect"] == "NoExecute"


# -- concurrency with other writers ---------------------------------------------------------------


async def test_a_write_between_our_read_and_patch_is_kept(world: World) -> None:
    api = world.api
    api.add_node("n1", taints=[OTHER_TAINT])
    act = world.actuator()
    world.intents.by_node["n1"] = intent("n1")
    slipped = {"key": "other.io/slipped-in", "value": "yes", "effect": "NoSchedule"}

    def writer(name: str) -> None:
        world.kube.after_get = None  # once
        api.update_node(name, lambda n: n["spec"].setdefault("taints", []).append(dict(slipped)))

    world.kube.after_get = writer
    await act.reconcile("n1")

    assert taints(api, "n1") == [
        OTHER_TAINT,
        slipped,
        {"key": OURS, "value": "xid-79", "effect": "NoSchedule"},
    ]
    assert sample(world.registry, "gpuwarden_remediation_writes_total", kind="taint", result="conflict") == 1
    assert sample(world.registry, "gpuwarden_remediation_writes_total", kind="taint", result="ok") == 1


async def test_endless_conflicts_give_up_bounded(world: World) -> None:
    world.api.add_node("n1")
    act = world.actuator()
    world.intents.by_node["n1"] = intent("n1")
    world.api.fail_next("PATCH", r"^/api/v1/nodes/n1$", 409, count=100)
    with pytest.raises(KubeConflict):
        await act.reconcile("n1")
    patches = [w for w in world.api.writes() if w[:2] == ("PATCH", "/api/v1/nodes/n1")]
    assert 2 <= len(patches) <= 10
    assert ours(world.api, "n1") == []


async def test_other_controller_and_actuator_never_lose_each_others_taints(world: World) -> None:
    api = world.api
    api.add_node("n1", labels={"team": "a"}, taints=[OTHER_TAINT])
    world.timers.auto_s = 1e9  # retry backoffs pass at once: this test is about lost updates
    act = world.actuator(workers=4)
    world.intents.by_node["n1"] = healthy("n1")
    expected_other: dict[str, dict[str, Any]] = {OTHER_TAINT["key"]: dict(OTHER_TAINT)}
    expected_labels = {"team": "a"}
    rng = random.Random(7)
    steps = 0

    def other_write() -> None:
        """The other controller adds, changes or removes one of its taints and labels."""
        nonlocal steps
        i = steps = steps + 1
        key = f"other.io/t{i % 4}"
        if i % 3 == 2 and key in expected_other:
            del expected_other[key]
        else:
            expected_other[key] = {"key": key, "value": f"v{i}", "effect": "NoSchedule"}
        expected_labels[f"l{i % 3}"] = str(i)
        if i % 5 == 4:
            expected_labels.pop("team", None)

        def mutate(node: dict[str, Any]) -> None:
            mine = [t for t in node["spec"].get("taints") or [] if not t["key"].startswith("other.io/")]
            node["spec"]["taints"] = mine + [dict(t) for t in expected_other.values()]
            node["metadata"]["labels"] = dict(expected_labels)

        api.update_node("n1", mutate)

    done = asyncio.Event()

    async def other_controller() -> None:
        while not done.is_set():
            other_write()
            await asyncio.sleep(rng.uniform(0, 0.01))

    # Besides writing at its own pace, the other controller writes right after every third read
    # of ours, so our patch certainly meets a node changed since we read it.
    reads = 0

    def after_get(name: str) -> None:
        nonlocal reads
        reads += 1
        if reads % 3 == 0:
            other_write()

    world.kube.after_get = after_get
    async with world.running(act):
        writer = asyncio.create_task(other_controller())
        for i in range(20):
            if i % 2 == 0:
                want = intent("n1", since=T0 + i, reason_code=f"xid-{i}")
            else:
                want = healthy("n1", since=T0 + i)
            world.intents.by_node["n1"] = want
            act.submit("n1")
            await until(
                lambda w=want: (
                    bool(ours(api, "n1")) == (w.effect is not None)  # type: ignore[misc]
                    and (w.effect is None or ours(api, "n1")[0]["value"] == w.reason_code)
                ),
                f"step {i}",
                timeout=30.0,  # real time: each step is a few round trips, but the machine may be busy
            )
        done.set()
        await writer
        world.kube.after_get = None
        world.intents.by_node["n1"] = intent("n1", since=T0 + 99, reason_code="final")
        act.submit("n1")
        await until(lambda: [t.get("value") for t in ours(api, "n1")] == ["final"], "final taint")

    final = taints(api, "n1")
    assert [t for t in final if t["key"].startswith("other.io/")] == list(expected_other.values())
    assert ours(api, "n1") == [{"key": OURS, "value": "final", "effect": "NoSchedule"}]
    assert api.node("n1")["metadata"]["labels"] == expected_labels
    assert steps >= 20
    metric = "gpuwarden_remediation_writes_total"
    assert sample(world.registry, metric, kind="untaint", result="ok") == 10  # it really flipped
    # Every step's taint was seen on the node (the waits above). One step's write may be counted
    # otherwise under heavy load (seen once in a loaded full run, never alone): a reconcile retried
    # after an error that finds its taint already there writes only the annotations.
    assert sample(world.registry, metric, kind="taint", result="ok") in (10.0, 11.0)
    conflicts = sum(sample(world.registry, metric, kind=k, result="conflict") for k in ("taint", "untaint"))
    assert conflicts >= 5  # and the other controller really got in its way


# -- human override -------------------------------------------------------------------------------


def remove_our_taint(api: KubeApiDouble, name: str) -> None:
    api.update_node(
        name, lambda n: n["spec"].update(taints=[t for t in n["spec"]["taints"] if t["key"] != OURS])
    )


async def overridden(world: World, name: str) -> Actuator:
    """``name`` quarantined, then its taint removed by hand and seen: an override stands."""
    world.api.add_node(name)
    act = world.actuator()
    world.intents.by_node[name] = intent(name)
    await act.reconcile(name)
    remove_our_taint(world.api, name)
    await act.reconcile(name)
    return act


async def test_human_removal_is_respected_for_the_cooldown_and_survives_restart(world: World) -> None:
    api = world.api
    api.add_node("n1", taints=[OTHER_TAINT])
    act = world.actuator(override_cooldown_seconds=7200)
    world.intents.by_node["n1"] = intent("n1")
    await act.reconcile("n1")
    remove_our_taint(api, "n1")
    now = world.clock.time()

    await act.reconcile("n1")
    assert taints(api, "n1") == [OTHER_TAINT]
    ann = node_annotations(api, "n1")
    assert json.loads(ann[OVERRIDE]) == {
        "evidence_key": "xid:79:gpu0",
        "until": rfc3339(now + 7200),
        "at": rfc3339(now),
    }
    snap = decode_snapshot(ann[HEALTH])
    assert snap is not None and not snap.tainted and snap.state == "quarantined"
    ev = events(api, "n1")[-1]
    assert ev[:2] == ("Warning", "GpuwardenOverrideRespected") and rfc3339(now + 7200) in ev[2]
    assert sample(world.registry, "gpuwarden_remediation_overrides_total") == 1

    writes = len(api.writes())
    await act.reconcile("n1")
    restarted = world.actuator(override_cooldown_seconds=7200)
    await restarted.reconcile("n1")
    assert len(api.writes()) == writes  # no re-taint, no second event, also after a restart

    world.clock.advance(7201)
    await restarted.reconcile("n1")
    assert ours(api, "n1") == [{"key": OURS, "value": "xid-79", "effect": "NoSchedule"}]
    assert OVERRIDE not in node_annotations(api, "n1")
    assert "override expired" in events(api, "n1")[-1][2]


async def test_new_evidence_after_an_override_taints_again(world: World) -> None:
    api = world.api
    act = await overridden(world, "n1")
    assert ours(api, "n1") == []

    world.intents.by_node["n1"] = intent("n1", evidence_key="dbe:gpu3", reason_code="dbe")
    await act.reconcile("n1")
    assert ours(api, "n1") == [{"key": OURS, "value": "dbe", "effect": "NoSchedule"}]
    assert "new evidence" in events(api, "n1")[-1][2]
    assert OVERRIDE not in node_annotations(api, "n1")


async def test_healthy_drops_the_override(world: World) -> None:
    api = world.api
    act = await overridden(world, "n1")
    assert OVERRIDE in node_annotations(api, "n1")
    world.intents.by_node["n1"] = healthy("n1", since=T0 + 600)
    await act.reconcile("n1")
    assert OVERRIDE not in node_annotations(api, "n1")
    assert ours(api, "n1") == []


async def test_informer_notices_a_human_removal_without_a_submit(world: World) -> None:
    api = world.api
    api.add_node("n1")
    world.intents.by_node["n1"] = intent("n1")
    async with world.running(world.actuator()):
        await until(lambda: bool(ours(api, "n1")), "tainted")
        remove_our_taint(api, "n1")
        await until(lambda: OVERRIDE in node_annotations(api, "n1"), "override recorded")
    assert ours(api, "n1") == []


# -- preflight ------------------------------------------------------------------------------------

PREFLIGHT_TAINT = {"key": PREFLIGHT, "effect": "NoSchedule"}


async def test_preflight_passed_removes_the_preflight_taint(world: World) -> None:
    world.api.add_node("n1", taints=[OTHER_TAINT, PREFLIGHT_TAINT])
    act = world.actuator()
    world.intents.by_node["n1"] = healthy("n1", preflight="passed")
    await act.reconcile("n1")
    assert taints(world.api, "n1") == [OTHER_TAINT]
    assert [e[:2] for e in events(world.api, "n1")] == [("Normal", "GpuwardenPreflightPassed")]
    assert (
        sample(world.registry, "gpuwarden_remediation_writes_total", kind="preflight_release", result="ok")
        == 1
    )


async def test_preflight_failure_turns_into_our_taint_in_one_patch(world: World) -> None:
    world.api.add_node("n1", taints=[PREFLIGHT_TAINT, OTHER_TAINT])
    act = world.actuator()
    world.intents.by_node["n1"] = intent("n1", preflight="failed", message="DBE during burn-in")
    await act.reconcile("n1")
    assert taints(world.api, "n1") == [OTHER_TAINT, {"key": OURS, "value": "xid-79", "effect": "NoSchedule"}]
    assert [w for w in world.api.writes() if w[:2] == ("PATCH", "/api/v1/nodes/n1")] == [
        ("PATCH", "/api/v1/nodes/n1", "application/strategic-merge-patch+json")
    ]
    [ev] = events(world.api, "n1")
    assert ev[:2] == ("Warning", "GpuwardenPreflightFailed") and "DBE during burn-in" in ev[2]


async def test_pending_preflight_warns_once_after_the_timeout(world: World) -> None:
    world.api.add_node("n1", taints=[PREFLIGHT_TAINT])
    act = world.actuator(preflight=PreflightConfig(timeout_seconds=600))
    world.intents.by_node["n1"] = healthy("n1")
    await act.reconcile("n1")
    assert taints(world.api, "n1") == [PREFLIGHT_TAINT]
    assert events(world.api, "n1") == []
    world.clock.advance(601)
    await act.reconcile("n1")
    await act.reconcile("n1")
    assert [e[:2] for e in events(world.api, "n1")] == [("Warning", "GpuwardenPreflightTimeout")]
    assert taints(world.api, "n1") == [PREFLIGHT_TAINT]


# -- rate limiting and the queue ------------------------------------------------------------------


async def test_api_calls_never_exceed_the_token_bucket(world: World) -> None:
    n = 25
    for i in range(n):
        world.api.add_node(f"n{i:02d}")
        world.intents.by_node[f"n{i:02d}"] = intent(f"n{i:02d}")
    qps, burst = 5.0, 4
    act = world.actuator(qps=qps, burst=burst, workers=8)
    start = world.clock.monotonic()
    async with world.running(act):
        for i in range(n):
            act.submit(f"n{i:02d}")
        await until(lambda: all(ours(world.api, f"n{i:02d}") for i in range(n)), "all tainted")
        await until(lambda: len(world.api.events) == n, "all events")
    times = [t for t, _ in world.kube.calls]
    # read, patch, condition, event per node; a watch echo that arrives after a later write's
    # answer was cached may cost a node one more read, never a write.
    assert len(times) >= 4 * n
    assert len([c for c in world.kube.calls if c[1] != "get"]) == 3 * n
    for i, t0 in enumerate(times):
        for j in range(i, len(times)):
            assert j - i + 1 <= burst + qps * (times[j] - t0) + 1e-6, (i, j)
    elapsed = world.clock.monotonic() - start
    assert elapsed >= (4 * n - burst) / qps - 1e-6  # the workers really waited for tokens


async def test_echoes_that_overtake_our_answers_cost_no_read(world: World) -> None:
    # The API server sends the watch event of a write and the write's answer independently; here
    # every write is answered 50 ms after it is applied, so each echo comes first, before the
    # write is known as ours. A decision reads once; the re-check its echoes queue is judged from
    # the informer's copy and reads nothing, so after a storm no stale reads queue ahead of the
    # next fault (they held one back 5.6 s in bench/remediation_scale.py).
    api = world.api
    names = [f"n{i}" for i in range(6)]
    for name in names:
        api.add_node(name)
    api.set_latency("patch", 0.05, path_regex=r"^/api/v1/nodes/")
    act = world.actuator()
    async with world.running(act):
        for name in names:
            world.intents.by_node[name] = intent(name)
            act.submit(name)
        await until(lambda: len(api.events) == len(names), "every node tainted and announced")

        def caught_up() -> bool:  # every echo cached, nothing queued
            return sample(world.registry, "gpuwarden_remediation_queue_depth") == 0 and all(
                (cached := act.cached(name)) is not None
                and cached.resource_version == api.node(name)["metadata"]["resourceVersion"]
                for name in names
            )

        await until(caught_up, "the echoes' re-checks")
        await asyncio.sleep(0.2)
        assert caught_up()
        assert all(ours(api, name) and condition(api, name) for name in names)
        gets = [op for _, op in world.kube.calls if op == "get"]
        assert len(gets) == len(names)
        # A change nobody here made still reads fresh and is acted on.
        remove_our_taint(api, names[0])
        await until(lambda: OVERRIDE in node_annotations(api, names[0]), "override recorded")
    assert len([op for _, op in world.kube.calls if op == "get"]) == len(names) + 1


async def test_a_change_made_while_our_read_is_answered_is_still_read(world: World) -> None:
    # Our read is applied at once and answered 0.2 s later; meanwhile someone removes our taint.
    # Its watch event is cached first, then our read's older answer is cached over it, and the
    # plan on that answer is empty. The re-check the event queued must read fresh, not trust the
    # cache: the removal is seen and recorded as an override.
    api = world.api
    api.add_node("n1")
    world.intents.by_node["n1"] = intent("n1")
    act = world.actuator()
    async with world.running(act):
        act.submit("n1")
        await until(lambda: len(api.events) == 1, "tainted and announced")
        await until(lambda: sample(world.registry, "gpuwarden_remediation_queue_depth") == 0, "idle")
        await asyncio.sleep(0.1)
        api.set_latency("get", 0.2, path_regex=r"^/api/v1/nodes/n1$")
        reads = len([op for _, op in world.kube.calls if op == "get"])
        act.submit("n1")  # the same decision again: a fresh read, then nothing to write
        await until(lambda: len([op for _, op in world.kube.calls if op == "get"]) > reads, "read sent")
        await asyncio.sleep(0.05)
        remove_our_taint(api, "n1")
        await until(lambda: OVERRIDE in node_annotations(api, "n1"), "override recorded")
    assert ours(api, "n1") == []


async def test_submit_dedups_and_overflow_is_counted_then_resync_catches_up(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    for name in ("a", "b", "c"):
        world.api.add_node(name)
        world.intents.by_node[name] = intent(name)
    act = world.actuator(queue_size=2)
    with caplog.at_level(logging.WARNING, logger="aggregator.remediate.actuator"):
        for name in ("a", "a", "b", "a", "c"):
            act.submit(name)
    assert sample(world.registry, "gpuwarden_remediation_queue_depth") == 2
    assert sample(world.registry, "gpuwarden_remediation_queue_dropped_total") == 1
    assert any(r.__dict__.get("node") == "c" for r in caplog.records)
    async with world.running(act):
        await until(lambda: all(ours(world.api, x) for x in ("a", "b")), "a and b tainted")
        assert ours(world.api, "c") == []
        # The resync enqueues the nodes a full queue turned away first, so c is not starved by
        # a and b coming before it again.
        await until(lambda: sample(world.registry, "gpuwarden_remediation_queue_depth") == 0, "idle")
        world.timers.advance(300)
        await until(lambda: bool(ours(world.api, "c")), "c tainted by the resync")


async def test_periodic_resync_and_leadership_gain_reconcile_everything(world: World) -> None:
    api = world.api
    api.add_node("n1")
    api.add_node("n2")
    world.intents.by_node["n1"] = intent("n1")
    world.leader = False
    act = world.actuator(resync_seconds=300)
    async with world.running(act):
        await until(lambda: world.reconciles() >= 2, "first pass")
        assert api.writes() == []  # a follower writes nothing
        world.leader = True
        act.leadership_changed()
        await until(lambda: bool(ours(api, "n1")), "leader taints")

        # A change the pipeline forgot to submit is caught by the periodic resync.
        world.intents.by_node["n2"] = intent("n2")
        seen = world.reconciles()
        await until(lambda: world.reconciles() >= seen, "idle")
        world.timers.advance(301)
        await until(lambda: bool(ours(api, "n2")), "resync taints n2")
        assert sample(world.registry, "gpuwarden_remediation_last_resync_timestamp_seconds") >= T0 + 301


# -- start, restart, errors -----------------------------------------------------------------------


async def test_restart_restores_before_reconciling_and_writes_nothing(world: World) -> None:
    api = world.api
    api.add_node("q1", taints=[OTHER_TAINT])
    api.add_node("q2")
    api.add_node("p1")
    api.add_node("h1")
    api.add_node("fresh")
    first = world.actuator()
    world.intents.by_node.update(
        q1=intent("q1", reason_code="xid-79"),
        q2=intent("q2", reason_code="dbe", since=T0 - 50),
        p1=intent("p1", "probation", since=T0 - 10),
        h1=intent("h1", "suspect", effect=None),
    )
    for name in ("q1", "q2", "p1", "h1"):
        await first.reconcile(name)
    before_restart = dict(world.intents.by_node)
    writes = len(api.writes())

    # The new replica's pipeline knows nothing until restore() hands it what the nodes carry.
    fresh = Intents()

    def restore(node: str, snapshot: HealthSnapshot | None, taint_value: str | None) -> None:
        assert snapshot is not None
        fresh.by_node[node] = before_restart[node]

    fresh.on_restore = restore
    world.clock.advance(5)
    act = world.actuator(fresh)
    async with world.running(act):
        restored = {r[0] for r in fresh.restored}
        assert restored == {"q1", "q2", "p1", "h1"}  # "fresh" carries nothing of ours
        await until(lambda: world.reconciles() >= 5, "every node reconciled")

    assert len(api.writes()) == writes  # nothing tainted twice, nothing untainted
    kinds = [kind for kind, _ in fresh.calls]
    assert kinds[:4] == ["restore"] * 4 and "restore" not in kinds[4:]  # before any reconcile
    assert {"q1", "q2", "p1", "h1", "fresh"} <= set(fresh.asked)  # and every node was reconciled
    by_node = {r[0]: r for r in fresh.restored}
    assert by_node["q1"][2] == "xid-79" and by_node["q2"][2] == "dbe" and by_node["h1"][2] is None
    assert by_node["q2"][1] == before_restart["q2"].snapshot
    assert by_node["q1"][3] == T0 + 5
    assert act.cached("q1") is not None and act.cached("nope") is None
    assert sorted(n.name for n in act.cached_nodes()) == ["fresh", "h1", "p1", "q1", "q2"]


async def test_restore_gets_the_taint_alone_when_the_snapshot_is_unreadable(world: World) -> None:
    world.api.add_node(
        "n1",
        annotations={HEALTH: "{not json"},
        taints=[{"key": OURS, "value": "xid-48", "effect": "NoSchedule"}],
    )
    async with world.running(world.actuator()):
        pass
    assert [(r[0], r[1], r[2]) for r in world.intents.restored] == [("n1", None, "xid-48")]


async def test_unavailable_and_forbidden_are_retried_with_backoff(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    world.api.add_node("n1")
    world.intents.by_node["n1"] = intent("n1")
    world.api.fail_next("GET", r"^/api/v1/nodes/n1$", 503, count=2)
    world.api.fail_next("PATCH", r"^/api/v1/nodes/n1$", 403)
    start = world.clock.monotonic()
    with caplog.at_level(logging.WARNING, logger="aggregator.remediate.actuator"):
        async with world.running(world.actuator()):
            await until(lambda: bool(ours(world.api, "n1")), "tainted after retries")
    failures = [r for r in caplog.records if r.getMessage() == "reconcile failed, retrying later"]
    assert [r.__dict__["error_type"] for r in failures] == [
        "KubeUnavailable",
        "KubeUnavailable",
        "KubeForbidden",
    ]
    assert all(r.__dict__["node"] == "n1" for r in failures)
    assert [r.__dict__["retry_in_s"] for r in failures] == [1.0, 2.0, 4.0]
    assert world.clock.monotonic() - start >= 7.0


async def test_deleted_node_is_dropped(world: World) -> None:
    world.api.add_node("n1")
    act = world.actuator()
    world.intents.by_node["n1"] = intent("n1")
    world.api.delete_node("n1")
    await act.reconcile("n1")  # no error
    assert world.api.writes() == []


async def test_informer_relists_after_410_and_survives_list_errors(world: World) -> None:
    api = world.api
    api.add_node("n1")
    api.add_node("n2")
    world.intents.by_node["n1"] = intent("n1")
    api.fail_next("GET", r"^/api/v1/nodes$", 503)  # the first list
    api.update_node("n2", lambda n: n["metadata"].update(labels={"x": "1"}))
    api.compact()
    world.kube.watch_from = "1"  # the first watch starts from before the compaction: 410
    async with world.running(world.actuator()):
        await until(lambda: bool(ours(api, "n1")), "n1 tainted")
        await until(
            lambda: sum(1 for r in api.requests if r[:2] == ("GET", "/api/v1/nodes")) >= 4, "relisted"
        )
        # Still watching: a node that joins later is seen without a resync.
        api.add_node("n3")
        world.intents.by_node["n3"] = intent("n3")
        await until(lambda: bool(ours(api, "n3")), "n3 tainted from a watch event")


async def test_a_watch_that_is_too_old_every_time_relists_after_a_growing_backoff(world: World) -> None:
    # LISTs slower than the watch cache's history: every watch from a fresh LIST is 410. As
    # client-go's reflector does (wait.BackoffUntil), the informer waits longer before each LIST
    # again, instead of listing every Node back to back on an API server that is already slow.
    world.api.add_node("n1")
    listed_at: list[float] = []
    inner_list = world.kube.list_nodes

    async def list_nodes(*, label_selector: str | None = None) -> Any:
        listed_at.append(world.clock.monotonic())
        return await inner_list(label_selector=label_selector)

    async def watch_nodes(**_: Any) -> Any:
        raise KubeGone("watch nodes: too old resource version")
        yield  # an async generator, as the client's

    world.kube.list_nodes = list_nodes  # type: ignore[method-assign]
    world.kube.watch_nodes = watch_nodes  # type: ignore[method-assign,assignment]
    async with world.running(world.actuator()):
        await until(lambda: len(listed_at) >= 7, "listed seven times")
    gaps = [b - a for a, b in itertools.pairwise(listed_at)][:6]
    assert gaps == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0]


async def test_a_throttled_watch_is_resumed_without_listing_again(world: World) -> None:
    # API Priority and Fairness sheds the watch (429): as client-go's reflector does, the
    # informer waits and resumes from the resourceVersion it had; listing every Node again
    # would add to the load the API server is shedding, and nothing is missed meanwhile.
    api = world.api
    api.add_node("n1")
    api.throttle(burst=3, verbs=["watch"], retry_after=1)
    async with world.running(world.actuator()):
        api.add_node("n2")  # while the watch is refused
        world.intents.by_node["n2"] = intent("n2")
        await until(lambda: api.throttled == 3, "three watches refused")
        await until(lambda: bool(ours(api, "n2")), "n2 tainted from a watch event")
    assert world.kube.informer[0] == "list"
    assert world.kube.informer.count("list") == 1
    assert world.kube.informer.count("watch") >= 4


async def test_a_quiet_watch_resumes_from_its_bookmark_after_a_compaction(world: World) -> None:
    # No Node changed for a while, Leases did, and the API server's history was compacted (an
    # API server restart, etcd compaction): resuming from the last Node change would be 410 and
    # a LIST of every Node; the bookmark's resourceVersion is still in the history.
    api = world.api
    api.add_node("n1")
    api.bookmark_every(0.02)
    async with world.running(world.actuator()):
        await a_lease(world.kube.inner, "someone")
        watched = world.kube.informer.count("watch")
        await until(lambda: world.kube.informer.count("watch") >= watched + 3, "bookmarks after the lease")
        api.restart_watches(expire=True)
        api.add_node("n2")
        world.intents.by_node["n2"] = intent("n2")
        await until(lambda: bool(ours(api, "n2")), "n2 tainted from a watch event")
    assert world.kube.informer.count("list") == 1


async def test_a_reconcile_shed_with_retry_after_waits_as_asked_and_goes_on(world: World) -> None:
    # APF sheds the patch twice: the worker waits the Retry-After each time and the same
    # reconcile finishes, instead of failing the node and moving on at full rate.
    api = world.api
    api.add_node("n1")
    world.intents.by_node["n1"] = intent("n1")
    api.throttle(burst=2, retry_after=3, verbs=["patch"])
    act = world.actuator()
    start = world.clock.monotonic()
    await act.reconcile("n1")
    assert api.throttled == 2
    assert ours(api, "n1")
    assert world.clock.monotonic() - start >= 6.0


async def test_a_reconcile_kept_shed_goes_to_the_backoff_no_sooner_than_asked(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    api = world.api
    api.add_node("n1")
    world.intents.by_node["n1"] = intent("n1")
    api.throttle(share=1.0, retry_after=5, verbs=["get"])
    with caplog.at_level(logging.WARNING, logger="aggregator.remediate.actuator"):
        async with world.running(world.actuator()):
            await until(lambda: api.throttled >= 3, "three reads shed")
            await until(
                lambda: any(r.getMessage() == "reconcile failed, retrying later" for r in caplog.records),
                "the node sent to the backoff",
            )
    failed = next(r for r in caplog.records if r.getMessage() == "reconcile failed, retrying later")
    assert failed.__dict__["status"] == 429
    assert failed.__dict__["retry_in_s"] == 5.0  # the server's wait, not the backoff's first 1 s


async def test_a_bug_for_one_node_does_not_stop_the_others(world: World) -> None:
    world.api.add_node("bad")
    world.api.add_node("good")
    world.intents.by_node["good"] = intent("good")
    world.intents.broken.add("bad")
    async with world.running(world.actuator()):
        await until(lambda: bool(ours(world.api, "good")), "good tainted")


def test_metrics_stay_off_the_global_registry() -> None:
    registry = CollectorRegistry()
    ActuatorMetrics(registry)
    assert (
        registry.get_sample_value("gpuwarden_remediation_writes_total", {"kind": "taint", "result": "ok"})
        == 0
    )
    assert REGISTRY.get_sample_value("gpuwarden_remediation_queue_depth") is None


# -- lifecycle rules other systems' users reported broken -------------------------------------------


async def test_a_cordon_and_taints_someone_else_placed_are_never_removed(world: World) -> None:
    # NVSentinel #1424: a taint or cordon placed by someone else must outlive our quarantine and
    # our release, including a taint with our own key that nobody recorded us applying.
    api = world.api
    human = {"key": OURS, "value": "bad-fan", "effect": "NoExecute"}
    api.add_node("n1", taints=[OTHER_TAINT, human])
    api.update_node("n1", lambda n: n["spec"].__setitem__("unschedulable", True))  # kubectl cordon
    act = world.actuator()
    world.intents.by_node["n1"] = intent("n1")
    await act.reconcile("n1")
    assert taints(api, "n1") == [OTHER_TAINT, human, {"key": OURS, "value": "xid-79", "effect": "NoSchedule"}]

    world.intents.by_node["n1"] = healthy("n1", since=T0 + 3600)
    await act.reconcile("n1")
    assert taints(api, "n1") == [OTHER_TAINT, human]
    assert api.node("n1")["spec"].get("unschedulable") is True


async def test_a_release_leaves_no_stale_annotation_or_label(world: World) -> None:
    # NVSentinel #753, #1872: after a release the node says "healthy" and nothing of the
    # quarantine is left: no taint record, no override, no label of ours; others' untouched.
    api = world.api
    labels = {"gpuwarden.io/pool": "h100-a", "team": "infra"}
    api.add_node("n1", labels=labels, annotations={"other.io/owner": "alice"})
    act = world.actuator()
    world.intents.by_node["n1"] = intent("n1")
    await act.reconcile("n1")
    remove_our_taint(api, "n1")  # a human took it off: an override is recorded
    await act.reconcile("n1")
    assert {OVERRIDE, "gpuwarden.io/taint"} & node_annotations(api, "n1").keys()

    world.intents.by_node["n1"] = healthy("n1", since=T0 + 3600)
    await act.reconcile("n1")
    ann = node_annotations(api, "n1")
    ours_left = {k for k in ann if k.startswith("gpuwarden.io/")}
    assert ours_left == {HEALTH, "gpuwarden.io/reason", "gpuwarden.io/decided-at"}
    snap = decode_snapshot(ann[HEALTH])
    assert snap is not None and (snap.state, snap.tainted, snap.held, snap.findings) == (
        "healthy",
        False,
        False,
        [],
    )
    assert ann["other.io/owner"] == "alice"
    assert api.node("n1")["metadata"]["labels"] == labels
    assert taints(api, "n1") == []


async def test_a_held_verdict_never_removes_our_taint(world: World) -> None:
    # A tripped breaker holds new quarantines; it never undoes one. Whatever says "held" about a
    # node our taint is on (a decision taken on half a view after a restart), the taint stays.
    api = world.api
    api.add_node("n1")
    act = world.actuator()
    world.intents.by_node["n1"] = intent("n1")
    await act.reconcile("n1")
    world.intents.by_node["n1"] = intent("n1", effect=None, held=True, since=T0 + 60)
    await act.reconcile("n1")

    assert ours(api, "n1") == [{"key": OURS, "value": "xid-79", "effect": "NoSchedule"}]
    snap = decode_snapshot(node_annotations(api, "n1")[HEALTH])
    assert snap is not None and snap.tainted and not snap.held  # a restart restores it as out
    cond = condition(api, "n1")
    assert cond is not None and (cond["status"], cond["reason"]) == ("False", "Quarantined")
    assert sample(world.registry, "gpuwarden_remediation_writes_total", kind="untaint", result="ok") == 0


# -- fail-over and the hour's eviction budget -------------------------------------------------------


def standby(world: World, intents: Intents, leading: list[bool], **config: Any) -> Actuator:
    """A second replica's actuator on the same cluster, leading while ``leading[0]``."""
    config.setdefault("mode", "enforce")
    return Actuator(
        world.kube,
        RemediationConfig(**config),
        intents,
        clock=world.clock,
        is_leader=lambda: leading[0],
        metrics=ActuatorMetrics(CollectorRegistry()),
        sleep=world.timers,
    )


async def test_our_no_execute_taint_carries_its_time_added(world: World) -> None:
    # The taint eviction controller and the budget after a restart read timeAdded; the API
    # server does not fill it in, the writer does (as kubectl taint and the node controller do).
    world.api.add_node("a")
    act = world.actuator(allow_no_execute=True, max_no_execute_per_hour=1)
    world.intents.by_node["a"] = intent("a", effect="NoExecute")
    await act.reconcile("a")
    (taint,) = ours(world.api, "a")
    assert taint["effect"] == "NoExecute" and taint["timeAdded"] == rfc3339(T0)
    world.clock.advance(30)
    world.intents.by_node["a"] = intent("a", effect="NoExecute", reason_code="dbe")
    await act.reconcile("a")
    (taint,) = ours(world.api, "a")
    assert taint["value"] == "dbe" and taint["timeAdded"] == rfc3339(T0)  # no new eviction


async def test_a_standby_counts_the_leaders_evictions_so_a_fail_over_keeps_the_hours_budget(
    world: World,
) -> None:
    for n in ("a", "b"):
        world.api.add_node(n)
    budget = {"allow_no_execute": True, "max_no_execute_per_hour": 1}
    leader = world.actuator(**budget)
    theirs = Intents()
    theirs.by_node["b"] = intent("b", effect="NoExecute")
    leading = [False]
    replica = standby(world, theirs, leading, **budget)
    async with world.running(replica):
        # The leader evicts a, after the standby's first list: the standby sees it only by watch.
        world.intents.by_node["a"] = intent("a", effect="NoExecute")
        await leader.reconcile("a")
        await until(lambda: bool((n := replica.cached("a")) and n.taints), "the standby sees a's taint")
        world.clock.advance(600)
        leading[0] = True  # the leader is gone; ten minutes into the same hour
        await replica.reconcile("b")
    assert ours(world.api, "a")[0]["effect"] == "NoExecute"
    assert ours(world.api, "b")[0]["effect"] == "NoSchedule"  # the hour's one eviction was a's


class LostAnswers(Recording):
    """Node patches are applied, but the first ``lose`` answers never arrive (a timeout, a reset
    connection after the commit)."""

    lose = 0

    async def patch_node(self, name: str, **kw: Any) -> Any:
        written = await super().patch_node(name, **kw)
        if self.lose:
            self.lose -= 1
            raise KubeUnavailable(f"patch of {name}: answer lost", status=0)
        return written


async def test_an_eviction_whose_answer_was_lost_still_spends_the_budget(tmp_path: Path) -> None:
    async with KubeApiDouble() as api:
        client = await KubeClient.from_kubeconfig(api.write_kubeconfig(tmp_path / "kubeconfig"))
        try:
            clock = FakeClock(start=T0)
            world = World(api, LostAnswers(client, clock), clock)
            for n in ("a", "b"):
                api.add_node(n)
            act = world.actuator(allow_no_execute=True, max_no_execute_per_hour=1)
            world.intents.by_node["a"] = intent("a", effect="NoExecute")
            world.intents.by_node["b"] = intent("b", effect="NoExecute")
            assert isinstance(world.kube, LostAnswers)
            world.kube.lose = 1
            with pytest.raises(KubeUnavailable):
                await act.reconcile("a")  # applied, answer lost
            await act.reconcile("a")  # the retry finds the taint on the node
            await act.reconcile("b")
        finally:
            await client.close()
    assert ours(api, "a")[0]["effect"] == "NoExecute"
    assert ours(api, "b")[0]["effect"] == "NoSchedule"


async def test_leadership_gained_restores_what_the_old_leader_took_out_before_reconciling(
    world: World,
) -> None:
    # The standby restarted after the leader had quarantined q; its own detectors lack the
    # history behind that verdict and say healthy. When it takes over, the cluster's record of
    # the quarantine goes back to its pipeline first, so the fail-over does not untaint q.
    for n in ("q", "h"):
        world.api.add_node(n)
    leader = world.actuator()
    mine = Intents()
    mine.by_node.update(q=healthy("q"), h=healthy("h"))
    leading = [False]
    replica = standby(world, mine, leading)

    def restore(node: str, snapshot: HealthSnapshot | None, taint_value: str | None) -> None:
        assert snapshot is not None and taint_value == "xid-79"
        mine.by_node[node] = world.intents.by_node[node]  # the pipeline takes the record back

    mine.on_restore = restore
    async with world.running(replica):
        assert mine.restored == []  # nothing of ours on the nodes at the first list
        world.intents.by_node["q"] = intent("q")
        await leader.reconcile("q")
        await until(lambda: bool((n := replica.cached("q")) and n.taints), "the standby sees q's taint")
        leading[0] = True
        mark = len(mine.calls)
        replica.leadership_changed()
        assert [r[0] for r in mine.restored] == ["q"]  # only the node our taint keeps out
        assert mine.calls[mark] == ("restore", "q")  # before anything is reconciled
        before = len(mine.asked)
        await until(lambda: len(mine.asked) >= before + 2, "the resync reconciles both")
        await asyncio.sleep(0.05)
    assert ours(world.api, "q") and not ours(world.api, "h")


class WatchRefused(Recording):
    """Every watch is answered 503 (an API server whose watch cache lags, say), every LIST works."""

    async def watch_nodes(self, **kw: Any) -> Any:  # type: ignore[override]
        self.before("watch")
        raise KubeUnavailable("watch nodes: HTTP 503", status=503)
        yield  # pragma: no cover


class WatchEndsAtOnce(Recording):
    """Every watch is answered 200 and ends at once with nothing in it (a server shutting down,
    a proxy closing the stream)."""

    async def watch_nodes(self, **kw: Any) -> Any:  # type: ignore[override]
        self.before("watch")
        await asyncio.sleep(0.001)
        return
        yield  # pragma: no cover


@pytest.mark.parametrize(("kube", "ops", "what"), [(WatchRefused, "list", 8), (WatchEndsAtOnce, "watch", 8)])
async def test_a_failing_watch_backs_off_instead_of_listing_every_node_every_second(
    tmp_path: Path, kube: type[Recording], ops: str, what: int
) -> None:
    # A working LIST is no sign the watch will work: the backoff grows until a watch delivers.
    async with KubeApiDouble() as api:
        client = await KubeClient.from_kubeconfig(api.write_kubeconfig(tmp_path / "kubeconfig"))
        try:
            clock = FakeClock(start=T0)
            world = World(api, kube(client, clock), clock)
            api.add_node("n0")
            t0 = clock.monotonic()
            assert isinstance(world.kube, Recording)
            async with world.running(world.actuator()):
                await until(lambda: world.kube.informer.count(ops) >= what, f"{what} {ops}s")
            elapsed = clock.monotonic() - t0
        finally:
            await client.close()
    # 1 + 2 + 4 + 8 + 16 + 30 s between the first seven: a full LIST a second would be 7 s.
    assert elapsed >= 61.0
    if ops == "watch":
        assert world.kube.informer.count("list") == 1  # a watch that ends is resumed, not relisted


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("POST", r"/events$", 429),  # APF sheds the event itself
        ("POST", r"/events$", 503),
        ("PATCH", r"^/api/v1/nodes/n1/status$", 429),  # the condition write, after the taint patch
    ],
)
async def test_one_refusal_loses_no_event(world: World, method: str, path: str, status: int) -> None:
    # The snapshot annotation the taint patch wrote already records the change, so a retried
    # reconcile plans no event again: a refused event must be sent now or never.
    api = world.api
    api.add_node("n1")
    act = world.actuator()
    world.intents.by_node["n1"] = intent("n1")
    api.fail_next(method, path, status)
    try:
        await act.reconcile("n1")
    except KubeUnavailable:
        assert method == "PATCH"  # the condition write fails the reconcile: it is retried
        await act.reconcile("n1")
    await act.reconcile("n1")
    assert [e[:2] for e in events(api, "n1")] == [("Warning", "GpuwardenQuarantined")]
    cond = condition(api, "n1")
    assert cond is not None and cond["reason"] == "Quarantined"


async def test_an_event_the_api_keeps_refusing_is_given_up_after_three_tries(world: World) -> None:
    api = world.api
    api.add_node("n1")
    act = world.actuator()
    world.intents.by_node["n1"] = intent("n1")
    api.fail_next("POST", r"/events$", 503, count=10)
    await act.reconcile("n1")  # the reconcile itself succeeds: the node is out, the event lost
    assert ours(api, "n1") and events(api, "n1") == []
    assert sum(1 for r in api.requests if r[0] == "POST" and r[1].endswith("/events")) == 3


async def test_a_write_is_abandoned_when_leadership_may_end_before_its_answer(world: World) -> None:
    # The API server holds our patch in its queues (2 s) while our leadership has 0.3 s left
    # unless a renewal succeeds: waiting would let the rest of the reconcile (the condition, the
    # events) land when another replica may already lead.
    api = world.api
    api.add_node("n1")
    world.intents.by_node["n1"] = intent("n1")
    act = Actuator(
        world.kube,
        RemediationConfig(mode="enforce"),
        world.intents,
        clock=world.clock,
        is_leader=lambda: True,
        leadership_left=lambda: 0.3,
        metrics=ActuatorMetrics(CollectorRegistry()),
        sleep=world.timers,
    )
    api.set_latency("patch", 2.0, path_regex=r"^/api/v1/nodes/n1$")
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(KubeUnavailable, match="leadership may end"):
        await act.reconcile("n1")
    assert loop.time() - started < 1.5
    assert condition(api, "n1") is None and events(api, "n1") == []  # nothing after it was sent


# -- shutdown --------------------------------------------------------------------------------------


@asynccontextmanager
async def taint_patch_slow(world: World, seconds: float) -> AsyncIterator[Actuator]:
    """The actuator running, its taint PATCH of ``n1`` sent and taking ``seconds`` in the API
    server (applied only when answered, whether or not anyone still waits)."""
    api = world.api
    api.add_node("n1")
    act = world.actuator()
    world.intents.by_node["n1"] = intent("n1", since=T0 - 30)
    api.set_latency("patch", seconds, path_regex="/nodes/n1$", applied_late=True)
    async with world.running(act):
        act.submit("n1")
        await until(
            lambda: ("PATCH", "/api/v1/nodes/n1") in {(m, p) for m, p, _ in api.requests}, "n1's PATCH"
        )
        assert not ours(api, "n1")  # still being applied
        yield act


async def test_drain_waits_for_the_writes_under_way_and_starts_no_more(world: World) -> None:
    api = world.api
    api.add_node("n2")
    async with taint_patch_slow(world, 0.5) as act:
        assert await act.drain(5.0)
        assert ours(api, "n1")  # answered, so applied, before drain returned

        world.intents.by_node["n2"] = intent("n2", since=T0)
        act.submit("n2")  # a decision after the drain began: left to the next leader's resync
        await asyncio.sleep(0.2)
        assert not ours(api, "n2")
        assert not any(p == "/api/v1/nodes/n2" and m == "PATCH" for m, p, _ in api.requests)


async def test_drain_gives_up_after_its_timeout_on_a_write_that_is_not_answered(world: World) -> None:
    async with taint_patch_slow(world, 30.0) as act:
        started = asyncio.get_running_loop().time()
        assert not await act.drain(0.3)
        assert asyncio.get_running_loop().time() - started < 5.0


async def test_drain_lets_a_reconcile_under_way_send_nothing_after_its_write_in_flight(world: World) -> None:
    # The taint's PATCH is in flight when the drain begins; the condition and the event that
    # would follow it are left to the next leader's resync, as when leadership is lost.
    api = world.api
    async with taint_patch_slow(world, 0.5) as act:
        assert await act.drain(5.0)
        assert ours(api, "n1")
        sent = {(m, p) for m, p, _ in api.requests}
        assert ("PATCH", "/api/v1/nodes/n1/status") not in sent
        assert events(api, "n1") == []
