"""Alerts to on-call: the alert book's transitions and every notifier against a local receiver
standing in for Slack, PagerDuty and a generic webhook (requests recorded, failures on demand)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import msgspec
import pytest
from aiohttp import web
from prometheus_client.registry import CollectorRegistry

from aggregator.decisions import Decision, Reason
from aggregator.notify import (
    AlertmanagerNotifier,
    NotifyConfig,
    PagerDutyNotifier,
    SlackNotifier,
    WebhookNotifier,
    build_notifiers,
    make_dispatcher,
)
from aggregator.notify.base import AlertBook
from aggregator.silence import SystemicEvent

T0 = 1_764_441_600.0
XID79 = Reason(
    detector="rule",
    rule="xid-79",
    severity="critical",
    summary="GPU 3 fell off the bus (XID 79)",
    evidence={"gpu": 3, "uuid": "GPU-ab12cd34-0000-1111-2222-333344445555", "xid": 79},
)
LEMON = Reason(
    detector="rule",
    rule="lemon",
    severity="critical",
    summary="quarantined 3 times in 7 days: a lemon",
    evidence={"quarantines": 3, "lemon": True},
)


def node_decision(
    state: str,
    previous: str,
    action: str = "none",
    *,
    node: str = "gpu-0042",
    reasons: list[Reason] | None = None,
    t: float = T0,
) -> Decision:
    return Decision(
        time=t,
        subject="node",
        node=node,
        state=state,
        previous=previous,
        action=action,  # type: ignore[arg-type]
        reasons=[XID79] if reasons is None else reasons,
    )


def quarantine(
    node: str = "gpu-0042", *, action: str = "taint", t: float = T0, lemon: bool = False
) -> Decision:
    return node_decision(
        "quarantined", "healthy", action, node=node, t=t, reasons=[XID79, LEMON] if lemon else [XID79]
    )


def release(node: str = "gpu-0042", *, t: float = T0 + 3600) -> Decision:
    info = Reason(detector="rule", severity="info", summary="released")
    return node_decision("healthy", "probation", "untaint", node=node, t=t, reasons=[info])


def systemic(state: str, *, t: float = T0) -> SystemicEvent:
    silent = ("n1", "n2", "n3") if state == "started" else ()
    return SystemicEvent(t, state, "rack", "r12", silent, 4)


CFG = NotifyConfig(
    external_url="https://gpuwarden.example/", retry_initial_seconds=0.05, retry_max_seconds=0.2
)


def book(**kw: Any) -> AlertBook:
    return AlertBook(msgspec.structs.replace(CFG, **kw), pool_of=lambda n: "pool-a")


# -- the alert book ------------------------------------------------------------------------------


def test_quarantine_alert_has_grouping_labels_and_useful_annotations() -> None:
    [alert] = book().on_decision(quarantine())
    assert alert.status == "firing"
    assert dict(alert.labels) == {
        "alertname": "GpuwardenNodeQuarantined",
        "severity": "warning",
        "node": "gpu-0042",
        "pool": "pool-a",
        "reason": "xid-79",
    }
    assert "GPU-ab12cd34-0000-1111-2222-333344445555" in alert.description
    assert "XID 79" in alert.description
    assert alert.node_url == "https://gpuwarden.example/api/v1/nodes/gpu-0042"
    assert alert.runbook_url.endswith("/docs/runbooks/GpuwardenNodeQuarantined.md")


def test_a_description_leaves_out_evidence_the_event_did_not_carry() -> None:
    # An XID read from NVML has no message: "message=None" in an alert tells on-call nothing.
    silent = msgspec.structs.replace(XID79, evidence={**XID79.evidence, "message": None, "code": 79})
    [alert] = book().on_decision(node_decision("quarantined", "healthy", "taint", reasons=[silent]))
    assert "None" not in alert.description and "code=79" in alert.description, alert.description
    assert alert.key == "gpuwarden/gpu-0042/quarantined"


def test_rule_runbook_wins_over_generic_one() -> None:
    reason = msgspec.structs.replace(XID79, evidence={**XID79.evidence, "runbook_url": "https://rb/xid79"})
    [alert] = book().on_decision(node_decision("quarantined", "healthy", "taint", reasons=[reason]))
    assert alert.runbook_url == "https://rb/xid79"


def test_one_alert_per_episode_and_resolved_on_release() -> None:
    b = book()
    assert len(b.on_decision(quarantine())) == 1
    # Probation and a relapse during it are the same problem: nothing new to tell.
    assert b.on_decision(node_decision("probation", "quarantined", t=T0 + 100)) == []
    assert b.on_decision(node_decision("quarantined", "probation", t=T0 + 200)) == []
    [resolved] = b.on_decision(release())
    assert resolved.status == "resolved"
    assert resolved.ends_at == T0 + 3600
    assert resolved.starts_at == T0
    assert resolved.labels["reason"] == "xid-79"  # same identity as the firing one
    assert b.active() == []
    # A new quarantine later is a new problem.
    assert len(b.on_decision(quarantine(t=T0 + 7200))) == 1


def test_routine_quarantine_does_not_page_unless_configured() -> None:
    [alert] = book().on_decision(quarantine())
    assert not alert.page and alert.severity == "warning"
    [alert] = book(page_on=("quarantined",)).on_decision(quarantine())
    assert alert.page and alert.severity == "page"


def test_lemon_held_and_systemic_page() -> None:
    b = book()
    alerts = {a.alertname: a for a in b.on_decision(quarantine(lemon=True))}
    assert not alerts["GpuwardenNodeQuarantined"].page
    assert alerts["GpuwardenLemonNode"].page
    assert alerts["GpuwardenLemonNode"].labels["severity"] == "page"

    [held] = book().on_decision(node_decision("suspect", "healthy", "held"))
    assert held.alertname == "GpuwardenRemediationHeld" and held.page

    b = book()
    [sys_alert] = b.on_systemic(systemic("started"))
    assert sys_alert.page and sys_alert.alertname == "GpuwardenSystemicOutage"
    assert sys_alert.labels["domain"] == "r12" and "node" not in sys_alert.labels
    assert "n1, n2, n3" in sys_alert.description
    [ended] = b.on_systemic(systemic("ended", t=T0 + 60))
    assert ended.status == "resolved" and ended.ends_at == T0 + 60


def test_held_quarantine_alerts_both_and_resolves_held_once_tainted() -> None:
    b = book()
    names = {a.alertname for a in b.on_decision(quarantine(action="held"))}
    assert names == {"GpuwardenNodeQuarantined", "GpuwardenRemediationHeld"}
    [resolved] = b.on_decision(node_decision("quarantined", "quarantined", "taint", t=T0 + 30))
    assert resolved.alertname == "GpuwardenRemediationHeld" and resolved.status == "resolved"
    assert [a.alertname for a in b.active()] == ["GpuwardenNodeQuarantined"]


def test_held_quarantines_page_once_per_episode_and_resolve_when_none_is_held() -> None:
    b = book()
    first = b.on_decision(quarantine("n1", action="held"))
    second = b.on_decision(quarantine("n2", action="held", t=T0 + 5))
    held_sent = [a for a in first + second if a.alertname == "GpuwardenRemediationHeld"]
    assert len(held_sent) == 1 and held_sent[0].page and "node" not in held_sent[0].labels
    active = b.get("gpuwarden/remediation/held")
    assert active is not None and "- n1:" in active.description and "- n2:" in active.description
    # n1 tainted after a breaker reset: n2 is still held, nothing resolves yet.
    assert [
        a.alertname for a in b.on_decision(node_decision("quarantined", "quarantined", "taint", node="n1"))
    ] == []
    active = b.get("gpuwarden/remediation/held")
    assert active is not None and "- n1:" not in active.description
    [resolved] = [a for a in b.on_decision(release("n2")) if a.alertname == "GpuwardenRemediationHeld"]
    assert resolved.status == "resolved"


def test_degraded_link_fires_and_resolves() -> None:
    b = book()
    link = Reason(detector="link", severity="warning", summary="pair probes at 40% of pool median")

    def mk(state: str, t: float) -> Decision:
        return Decision(
            time=t,
            subject="link",
            node="a",
            peer="b",
            state=state,
            previous="x",
            action="none",
            reasons=[link],
        )

    assert b.on_decision(mk("suspect", T0)) == []
    [fired] = b.on_decision(mk("degraded", T0 + 120))
    assert fired.alertname == "GpuwardenLinkDegraded" and fired.labels["peer"] == "b" and not fired.page
    [resolved] = b.on_decision(mk("healthy", T0 + 999))
    assert resolved.status == "resolved" and resolved.key == fired.key


def test_suspect_node_is_not_an_alert() -> None:
    assert book().on_decision(node_decision("suspect", "healthy")) == []


def test_config_rejects_unknown_page_kind() -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"page_on": ["held", "everything"]}, NotifyConfig)
    cfg = msgspec.convert({"page_on": ["held", "quarantined"], "resend_seconds": 30}, NotifyConfig)
    assert cfg.page_on == ("held", "quarantined")


def test_build_notifiers_from_config() -> None:
    assert build_notifiers(NotifyConfig()) == []
    cfg = NotifyConfig(
        alertmanager_url="http://am:9093",
        webhook_url="http://hook",
        slack_webhook_url="http://slack",
        pagerduty_routing_key="R0UT1NG",
    )
    kinds = [type(n) for n in build_notifiers(cfg)]
    assert kinds == [AlertmanagerNotifier, WebhookNotifier, SlackNotifier, PagerDutyNotifier]


# -- delivery against local receivers --------------------------------------------------------------


@dataclass
class Receiver:
    """A local HTTP receiver: records every request; answers from ``script`` first, then 2xx."""

    url: str = ""
    requests: list[tuple[float, Any]] = field(default_factory=list)
    script: list[tuple[int, dict[str, str]]] = field(default_factory=list)
    ok_status: int = 200
    hang: float = 0.0
    got: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        if self.hang:
            await asyncio.sleep(self.hang)
        self.requests.append((time.monotonic(), body))
        self.got.set()
        if self.script:
            status, headers = self.script.pop(0)
            return web.Response(status=status, text="nope", headers=headers)
        return web.Response(status=self.ok_status, text="ok")

    @property
    def bodies(self) -> list[Any]:
        return [b for _, b in self.requests]

    async def wait_for(self, n: int, timeout: float = 3.0) -> None:
        async def until() -> None:
            while len(self.requests) < n:
                self.got.clear()
                await self.got.wait()

        await asyncio.wait_for(until(), timeout)


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    rec = Receiver()
    app = web.Application()
    app.router.add_post("/{tail:.*}", rec.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    rec.url = f"http://127.0.0.1:{port}/hook"
    yield rec
    await runner.cleanup()


def value(reg: CollectorRegistry, name: str, notifier: str) -> float:
    v = reg.get_sample_value(name, {"notifier": notifier})
    return 0.0 if v is None else v


async def test_pagerduty_one_trigger_per_problem_and_resolve_with_same_key(receiver: Receiver) -> None:
    cfg = msgspec.structs.replace(CFG, pagerduty_routing_key="R0UT1NG", pagerduty_url=receiver.url)
    d = make_dispatcher(cfg, CollectorRegistry(), pool_of=lambda n: "pool-a")
    await d.start()
    try:
        d.on_decision(quarantine(node="routine"))  # routine: no page
        d.on_decision(quarantine(lemon=True))
        d.on_decision(node_decision("probation", "quarantined", t=T0 + 100))
        d.on_decision(quarantine(lemon=True, t=T0 + 200))  # relapse: same problem
        d.resend_now()  # re-sends are Alertmanager's, never a new PagerDuty trigger
        d.on_decision(release())
        await receiver.wait_for(2)
        await asyncio.sleep(0.1)
    finally:
        await d.stop()
    trigger, resolve = receiver.bodies
    assert trigger["event_action"] == "trigger"
    assert trigger["routing_key"] == "R0UT1NG"
    assert trigger["dedup_key"] == "gpuwarden/gpu-0042/lemon"
    assert trigger["payload"]["source"] == "gpu-0042"
    assert trigger["payload"]["severity"] == "critical"
    assert {"href": "https://gpuwarden.example/api/v1/nodes/gpu-0042", "text": "node gpu-0042"} in trigger[
        "links"
    ]
    assert resolve == {
        "routing_key": "R0UT1NG",
        "event_action": "resolve",
        "dedup_key": "gpuwarden/gpu-0042/lemon",
    }


async def test_webhook_retries_with_backoff_until_receiver_recovers(receiver: Receiver) -> None:
    receiver.script = [(503, {}), (502, {})]
    reg = CollectorRegistry()
    d = make_dispatcher(msgspec.structs.replace(CFG, webhook_url=receiver.url), reg)
    await d.start()
    try:
        d.on_decision(quarantine())
        await receiver.wait_for(3)
        await asyncio.sleep(0.05)
    finally:
        await d.stop()
    times = [t for t, _ in receiver.requests]
    assert times[1] - times[0] >= 0.04 and times[2] - times[1] >= 0.09  # backoff doubles
    body = receiver.bodies[2]
    assert body["alert"]["status"] == "firing"
    assert body["alert"]["labels"]["node"] == "gpu-0042"
    assert body["alert"]["details"]["reasons"][0]["evidence"]["xid"] == 79
    assert value(reg, "gpuwarden_notify_failed_total", "webhook") == 2
    assert value(reg, "gpuwarden_notify_sent_total", "webhook") == 1
    assert value(reg, "gpuwarden_notify_queue_depth", "webhook") == 0


async def test_receiver_refusal_is_dropped_and_counted_not_retried_forever(receiver: Receiver) -> None:
    receiver.script = [(400, {})]
    reg = CollectorRegistry()
    d = make_dispatcher(msgspec.structs.replace(CFG, webhook_url=receiver.url), reg)
    await d.start()
    try:
        d.on_decision(quarantine(node="a"))
        d.on_decision(quarantine(node="b"))
        await receiver.wait_for(2)
        await asyncio.sleep(0.05)
    finally:
        await d.stop()
    assert [b["alert"]["labels"]["node"] for b in receiver.bodies] == ["a", "b"]
    assert value(reg, "gpuwarden_notify_dropped_total", "webhook") == 1
    assert value(reg, "gpuwarden_notify_sent_total", "webhook") == 1


async def test_queue_is_bounded_dropping_the_oldest(receiver: Receiver) -> None:
    reg = CollectorRegistry()
    d = make_dispatcher(msgspec.structs.replace(CFG, webhook_url=receiver.url, queue_size=3), reg)
    for i in range(5):  # before start: nothing can drain
        d.on_decision(quarantine(node=f"n{i}"))
    assert value(reg, "gpuwarden_notify_queue_depth", "webhook") == 3
    assert value(reg, "gpuwarden_notify_dropped_total", "webhook") == 2
    await d.start()
    try:
        await receiver.wait_for(3)
        await asyncio.sleep(0.05)
    finally:
        await d.stop()
    assert [b["alert"]["labels"]["node"] for b in receiver.bodies] == ["n2", "n3", "n4"]


async def test_slack_spaces_messages_and_honours_retry_after(receiver: Receiver) -> None:
    receiver.script = [(429, {"Retry-After": "0.4"})]
    reg = CollectorRegistry()
    cfg = msgspec.structs.replace(CFG, slack_webhook_url=receiver.url, slack_min_interval_seconds=0.2)
    d = make_dispatcher(cfg, reg)
    await d.start()
    try:
        d.on_decision(quarantine(node="a"))
        d.on_decision(quarantine(node="b"))
        await receiver.wait_for(3)
    finally:
        await d.stop()
    (t0, first), (t1, again), (t2, second) = receiver.requests
    assert first == again  # the limited message is the one sent again, not lost
    assert "a quarantined" in first["text"]
    assert "b quarantined" in second["text"]
    assert t1 - t0 >= 0.38  # Retry-After, not the 0.05 s backoff
    assert t2 - t1 >= 0.18  # ~1 message per interval
    assert value(reg, "gpuwarden_notify_failed_total", "slack") == 1
    assert value(reg, "gpuwarden_notify_sent_total", "slack") == 2


async def test_slow_receiver_never_blocks_the_pipeline_callback(receiver: Receiver) -> None:
    receiver.hang = 1.0
    d = make_dispatcher(
        msgspec.structs.replace(CFG, webhook_url=receiver.url, timeout_seconds=5), CollectorRegistry()
    )
    await d.start()
    try:
        d.on_decision(quarantine(node="first"))
        await asyncio.sleep(0.1)  # the worker is now stuck in the request
        started = time.perf_counter()
        for i in range(500):
            d.on_decision(quarantine(node=f"n{i}"))
        assert time.perf_counter() - started < 0.5
    finally:
        await d.stop()


async def test_alertmanager_payload_and_resend_coalesces(receiver: Receiver) -> None:
    receiver.script = [(503, {})] * 3  # down for a while: queued states must not pile up
    cfg = msgspec.structs.replace(CFG, alertmanager_url=receiver.url.removesuffix("/hook"), resend_seconds=30)
    reg = CollectorRegistry()
    d = make_dispatcher(cfg, reg)
    d.on_decision(quarantine())
    d.resend_now()
    d.resend_now()
    assert value(reg, "gpuwarden_notify_queue_depth", "alertmanager") == 1
    await d.start()
    try:
        await receiver.wait_for(4)
    finally:
        await d.stop()
    sent = time.time()
    [alert] = receiver.bodies[3]
    assert alert["labels"]["alertname"] == "GpuwardenNodeQuarantined"
    assert alert["annotations"]["runbook_url"].endswith("GpuwardenNodeQuarantined.md")
    assert alert["generatorURL"] == "https://gpuwarden.example/api/v1/nodes/gpu-0042"
    assert alert["startsAt"] == "2025-11-29T18:40:00.000Z"
    # endsAt four re-send periods ahead: it stays active between re-sends.
    ends_t = datetime.fromisoformat(alert["endsAt"].replace("Z", "+00:00")).timestamp()
    assert sent + 100 < ends_t < sent + 121


def test_webhook_body_is_plain_json() -> None:
    [alert] = book().on_decision(quarantine())
    body = json.loads(msgspec.json.encode({"alert": alert.to_json()}))
    assert body["alert"]["annotations"]["node_url"].endswith("/api/v1/nodes/gpu-0042")
    assert body["alert"]["ends_at"] is None


def test_a_replica_that_does_not_lead_keeps_its_book_but_sends_nothing() -> None:
    cfg = msgspec.convert({"webhook_url": "http://127.0.0.1:9/hook"}, NotifyConfig)
    leading = False
    d = make_dispatcher(cfg, CollectorRegistry(), sending=lambda: leading)
    d.on_decision(quarantine())
    assert [len(lane.queue) for lane in d.lanes] == [0]
    assert [a.alertname for a in d.book.active()] == ["GpuwardenNodeQuarantined"]
    leading = True  # took the Lease: what is firing goes out, and so does what happens next
    d.on_decision(quarantine("gpu-0043"))
    assert [len(lane.queue) for lane in d.lanes] == [1]
