"""Alerts to on-call: what an alert is, when one fires and resolves, and how it is delivered.

Decisions (``aggregator.decisions``) and systemic events (``aggregator.silence``) go into an
``AlertBook``, which turns them into alert transitions (firing, resolved) with one stable key per
problem: a node stays one quarantine alert from quarantine to release, however often it relapses
during probation, so no notifier ever pages twice for one problem.

The ``Dispatcher`` gives each configured notifier its own bounded queue and its own asyncio task.
The pipeline's callbacks only append to those queues (no I/O, no waiting), so a slow or dead
receiver can never hold up detection; a full queue drops its oldest entry and counts it. Each task
retries failed deliveries with exponential backoff, honours a receiver's ``Retry-After``, and keeps
a notifier's minimum interval between requests (Slack's rate limit).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time as _time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final, Literal, Protocol

import aiohttp
import msgspec
from prometheus_client import Counter, Gauge
from prometheus_client.registry import CollectorRegistry

from agent.clock import Clock, SystemClock
from aggregator.config import NotifyConfig, PageKind
from aggregator.decisions import Decision, Reason
from aggregator.silence import SystemicEvent

log = logging.getLogger(__name__)

__all__ = [
    "ALERTNAMES",
    "PAGE_KINDS",
    "Alert",
    "AlertBook",
    "DeliveryError",
    "Dispatcher",
    "Notifier",
    "NotifyConfig",
    "PageKind",
    "iso_time",
    "post_json",
]

# What may page a human; the rest is a "warning" alert (a ticket, a channel message).
HELD_KEY: Final = "gpuwarden/remediation/held"  # one alert per held episode, not one per node
PAGE_KINDS: tuple[PageKind, ...] = ("held", "lemon", "systemic", "quarantined", "link")

ALERTNAMES: dict[PageKind, str] = {
    "quarantined": "GpuwardenNodeQuarantined",
    "lemon": "GpuwardenLemonNode",
    "held": "GpuwardenRemediationHeld",
    "link": "GpuwardenLinkDegraded",
    "systemic": "GpuwardenSystemicOutage",
}


# -- the alert ----------------------------------------------------------------------------------

Status = Literal["firing", "resolved"]


@dataclass(frozen=True)
class Alert:
    """One problem as on-call sees it. ``key`` is stable for the problem's whole life (the
    PagerDuty dedup_key); ``labels`` identify it to Alertmanager and are stable as well."""

    key: str
    kind: PageKind
    labels: Mapping[str, str]
    summary: str
    description: str
    runbook_url: str
    node_url: str | None
    page: bool
    starts_at: float
    status: Status = "firing"
    ends_at: float | None = None  # set when resolved
    details: Mapping[str, Any] = field(default_factory=dict)  # reasons with evidence, for receivers

    @property
    def alertname(self) -> str:
        return self.labels["alertname"]

    @property
    def severity(self) -> str:
        return self.labels["severity"]

    @property
    def node(self) -> str | None:
        return self.labels.get("node")

    def annotations(self) -> dict[str, str]:
        out = {"summary": self.summary, "description": self.description, "runbook_url": self.runbook_url}
        if self.node_url:
            out["node_url"] = self.node_url
        return out

    def to_json(self) -> dict[str, Any]:
        """The generic JSON form (webhook bodies, logs)."""
        return {
            "key": self.key,
            "status": self.status,
            "alertname": self.alertname,
            "severity": self.severity,
            "page": self.page,
            "labels": dict(self.labels),
            "annotations": self.annotations(),
            "starts_at": _iso(self.starts_at),
            "ends_at": _iso(self.ends_at) if self.ends_at is not None else None,
            "details": dict(self.details),
        }


def _iso(t: float) -> str:
    whole = math.floor(t)
    ms = round((t - whole) * 1000)
    if ms == 1000:
        whole, ms = whole + 1, 0
    return _time.strftime("%Y-%m-%dT%H:%M:%S", _time.gmtime(whole)) + f".{ms:03d}Z"


def iso_time(t: float) -> str:
    """RFC 3339 in UTC with milliseconds, as Alertmanager and PagerDuty take it."""
    return _iso(t)


def _reason_label(r: Reason) -> str:
    return r.rule or r.detector


def _describe(reasons: Sequence[Reason]) -> str:
    lines = []
    for r in reasons:
        ev = dict(r.evidence)
        parts = []
        if "gpu" in ev:
            uuid = ev.pop("uuid", None)
            parts.append(f"GPU {ev.pop('gpu')}" + (f" ({uuid})" if uuid else ""))
        elif "uuid" in ev:
            parts.append(f"GPU {ev.pop('uuid')}")
        if "xid" in ev:
            parts.append(f"XID {ev.pop('xid')}")
        ev.pop("runbook_url", None)
        # An evidence field the event did not carry (an XID without a message) says nothing.
        parts.extend(f"{k}={v}" for k, v in sorted(ev.items()) if v is not None)
        where = f"[{r.detector}{'/' + r.rule if r.rule else ''}, {r.severity}]"
        lines.append(f"- {r.summary} {where}" + (f": {', '.join(parts)}" if parts else ""))
    return "\n".join(lines)


def _details(reasons: Sequence[Reason]) -> dict[str, Any]:
    return {"reasons": [msgspec.to_builtins(r) for r in reasons]}


class AlertBook:
    """The alerts firing now, and the transitions each decision or systemic event causes.

    - node ``quarantined``: GpuwardenNodeQuarantined fires (once per episode; relapses during
      probation are the same alert) and resolves when the node is released (healthy or suspect).
    - a quarantine with a reason of rule ``lemon``: GpuwardenLemonNode, until released.
    - action ``held`` (a safety limit stopped remediation): one GpuwardenRemediationHeld for the
      whole episode (the breaker holds every later quarantine too: on-call is paged once, and the
      alert's description lists the held nodes), until no node is held any more (each was
      tainted after a breaker reset, or released).
    - link ``degraded``: GpuwardenLinkDegraded until the link is healthy again.
    - systemic event ``started``: GpuwardenSystemicOutage until it ``ended``.
    """

    def __init__(
        self,
        config: NotifyConfig,
        *,
        pool_of: Callable[[str], str | None] | None = None,
    ) -> None:
        self.config = config
        self._pool_of = pool_of or (lambda _node: None)
        self._active: dict[str, Alert] = {}
        self._held: dict[str, str] = {}  # node -> why its taint was held, oldest first

    def active(self) -> list[Alert]:
        return list(self._active.values())

    def get(self, key: str) -> Alert | None:
        return self._active.get(key)

    # -- building ----------------------------------------------------------------------------

    def _runbook(self, alertname: str, reasons: Sequence[Reason] = ()) -> str:
        # A rule's own runbook says more about its fault than the generic one.
        for r in reasons:
            url = r.evidence.get("runbook_url")
            if isinstance(url, str) and url:
                return url
        base = self.config.runbook_base_url
        return f"{base}{'' if base.endswith('/') else '/'}{alertname}.md"

    def _node_url(self, node: str) -> str | None:
        if not self.config.external_url:
            return None
        return f"{self.config.external_url.rstrip('/')}/api/v1/nodes/{node}"

    def _make(
        self,
        *,
        key: str,
        kind: PageKind,
        labels: dict[str, str | None],
        summary: str,
        description: str,
        node: str | None,
        reasons: Sequence[Reason],
        at: float,
    ) -> Alert:
        page = kind in self.config.page_on
        alertname = ALERTNAMES[kind]
        full = {"alertname": alertname, "severity": "page" if page else "warning", **labels}
        return Alert(
            key=key,
            kind=kind,
            # Alertmanager treats an empty label as absent: leave unknown ones out.
            labels={k: v for k, v in full.items() if v},
            summary=summary,
            description=description,
            runbook_url=self._runbook(alertname, reasons),
            node_url=self._node_url(node) if node else None,
            page=page,
            starts_at=at,
            details=_details(reasons),
        )

    # -- transitions ---------------------------------------------------------------------------

    def _fire(self, alert: Alert) -> list[Alert]:
        held = self._active.get(alert.key)
        if held is not None:
            # Same problem: keep its start and labels (its identity); refresh what it says.
            self._active[alert.key] = replace(
                held, summary=alert.summary, description=alert.description, details=alert.details
            )
            return []
        self._active[alert.key] = alert
        return [alert]

    def _resolve(self, key: str, at: float) -> list[Alert]:
        held = self._active.pop(key, None)
        if held is None:
            return []
        return [replace(held, status="resolved", ends_at=at)]

    def on_decision(self, d: Decision) -> list[Alert]:
        """The alerts this decision starts or resolves (none for a decision that changes nothing
        on-call must know)."""
        if d.subject == "link":
            return self._on_link(d)
        out: list[Alert] = []
        pool = self._pool_of(d.node)
        reasons = d.reasons
        reason = _reason_label(reasons[0]) if reasons else "unknown"
        first = reasons[0].summary if reasons else d.state
        released = d.state in ("healthy", "suspect")
        if d.state == "quarantined":
            out += self._fire(
                self._make(
                    key=f"gpuwarden/{d.node}/quarantined",
                    kind="quarantined",
                    labels={"node": d.node, "pool": pool, "reason": reason},
                    summary=f"{d.node} quarantined: {first}",
                    description=_describe(reasons),
                    node=d.node,
                    reasons=reasons,
                    at=d.time,
                )
            )
            lemon = [r for r in reasons if r.rule == "lemon"]
            if lemon:
                out += self._fire(
                    self._make(
                        key=f"gpuwarden/{d.node}/lemon",
                        kind="lemon",
                        labels={"node": d.node, "pool": pool, "reason": "lemon"},
                        summary=f"{d.node} is a lemon: {lemon[0].summary}",
                        description=_describe(reasons),
                        node=d.node,
                        reasons=reasons,
                        at=d.time,
                    )
                )
        if d.action == "held":
            why = next((r.summary for r in reasons if r.rule == "safety-limit"), first)
            self._held[d.node] = why
            out += self._fire(self._held_alert(d.node, why, d.time))
        elif (d.action == "taint" or released) and self._held.pop(d.node, None) is not None:
            if self._held:
                current = self._active.get(HELD_KEY)
                if current is not None:
                    self._active[HELD_KEY] = replace(current, description=self._held_description())
            else:
                out += self._resolve(HELD_KEY, d.time)
        if released:
            out += self._resolve(f"gpuwarden/{d.node}/quarantined", d.time)
            out += self._resolve(f"gpuwarden/{d.node}/lemon", d.time)
        return out

    def _held_description(self) -> str:
        lines = [f"- {node}: {why}" for node, why in self._held.items()]
        return (
            "A safety limit stopped remediation: the decisions stand, no taint was applied, and "
            "the breaker holds every new quarantine until a human resets it "
            "(gpuwarden breaker reset). Held now:\n" + "\n".join(lines[:50])
        )

    def _held_alert(self, node: str, why: str, at: float) -> Alert:
        return self._make(
            key=HELD_KEY,
            kind="held",
            labels={},
            summary=f"remediation held by a safety limit ({len(self._held)} node(s), first {node}): {why}",
            description=self._held_description(),
            node=None,
            reasons=(),
            at=at,
        )

    def _on_link(self, d: Decision) -> list[Alert]:
        peer = d.peer or ""
        key = f"gpuwarden/link/{d.node}/{peer}"
        if d.state == "degraded":
            reasons = d.reasons
            first = reasons[0].summary if reasons else "degraded"
            return self._fire(
                self._make(
                    key=key,
                    kind="link",
                    labels={
                        "node": d.node,
                        "peer": peer,
                        "pool": self._pool_of(d.node),
                        "reason": _reason_label(reasons[0]) if reasons else "link",
                    },
                    summary=f"link {d.node} <-> {peer} degraded: {first}",
                    description=_describe(reasons),
                    node=d.node,
                    reasons=reasons,
                    at=d.time,
                )
            )
        if d.state == "healthy":
            return self._resolve(key, d.time)
        return []

    def on_systemic(self, ev: SystemicEvent) -> list[Alert]:
        key = f"gpuwarden/systemic/{ev.domain_kind}/{ev.domain}"
        if ev.state == "ended":
            return self._resolve(key, ev.time)
        nodes = ", ".join(ev.silent_nodes[:20]) + (" ..." if len(ev.silent_nodes) > 20 else "")
        return self._fire(
            self._make(
                key=key,
                kind="systemic",
                labels={
                    "pool": ev.domain if ev.domain_kind == "pool" else None,
                    "domain_kind": ev.domain_kind,
                    "domain": ev.domain,
                    "reason": "systemic",
                },
                summary=ev.summary,
                description=f"Silent nodes ({len(ev.silent_nodes)} of {ev.total_nodes}): {nodes}",
                node=None,
                reasons=(),
                at=ev.time,
            )
        )


# -- delivery -----------------------------------------------------------------------------------


class DeliveryError(Exception):
    """A delivery that did not go through. ``permanent``: the receiver refused this message (a
    4xx other than 408/429) and a retry would be refused again. ``retry_after``: the receiver
    said when to come back (429 or 503 with ``Retry-After``)."""

    def __init__(self, message: str, *, permanent: bool = False, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.permanent = permanent
        self.retry_after = retry_after


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None  # an HTTP date: rare from these receivers; the backoff applies instead


async def post_json(
    session: aiohttp.ClientSession,
    url: str,
    payload: Any,
    *,
    timeout_s: float,
    headers: Mapping[str, str] | None = None,
) -> None:
    """POST ``payload`` as JSON; raises ``DeliveryError`` unless the receiver answers 2xx."""
    body = msgspec.json.encode(payload)
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    try:
        async with session.post(
            url, data=body, headers=hdrs, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            if 200 <= resp.status < 300:
                await resp.read()
                return
            text = (await resp.text(errors="replace"))[:300]
            transient = resp.status in (408, 429) or resp.status >= 500
            raise DeliveryError(
                f"HTTP {resp.status}: {text}",
                permanent=not transient,
                retry_after=_retry_after(resp.headers.get("Retry-After")) if transient else None,
            )
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise DeliveryError(f"{type(exc).__name__}: {exc}") from exc


class Notifier(Protocol):
    """One way of telling on-call. ``deliver`` sends a batch of at most ``max_batch`` alerts and
    raises ``DeliveryError`` if it did not go through; the dispatcher owns queueing and retries."""

    name: str  # the ``notifier`` metric label
    max_batch: int
    min_interval_s: float  # between two requests (rate limits)
    resends: bool  # wants every firing alert again each resend period (Alertmanager)
    coalesce: bool  # only an alert's latest state matters: a newer one replaces a queued one

    def accepts(self, alert: Alert) -> bool: ...

    async def deliver(self, session: aiohttp.ClientSession, batch: Sequence[Alert], now: float) -> None: ...


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.sent = Counter(
            "gpuwarden_notify_sent",
            "Alert notifications delivered, by notifier.",
            ["notifier"],
            registry=registry,
        )
        self.failed = Counter(
            "gpuwarden_notify_failed",
            "Delivery attempts that failed (each retry counts), by notifier.",
            ["notifier"],
            registry=registry,
        )
        self.dropped = Counter(
            "gpuwarden_notify_dropped",
            "Notifications given up: queue full (oldest dropped) or refused by the receiver.",
            ["notifier"],
            registry=registry,
        )
        self.depth = Gauge(
            "gpuwarden_notify_queue_depth",
            "Notifications waiting to be delivered, by notifier.",
            ["notifier"],
            registry=registry,
        )


class _Lane:
    """One notifier's queue and worker."""

    def __init__(self, notifier: Notifier, size: int, metrics: _Metrics) -> None:
        self.notifier = notifier
        self.queue: deque[Alert] = deque()
        self.size = size
        self.metrics = metrics
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        name = notifier.name
        self.sent = metrics.sent.labels(name)
        self.failed = metrics.failed.labels(name)
        self.dropped = metrics.dropped.labels(name)
        self.depth = metrics.depth.labels(name)

    def put(self, alert: Alert) -> None:
        if self.notifier.coalesce:
            for i, queued in enumerate(self.queue):
                if queued.key == alert.key:
                    self.queue[i] = alert
                    return
        if len(self.queue) >= self.size:
            old = self.queue.popleft()
            self.dropped.inc()
            log.warning(
                "notify queue full: dropped the oldest notification",
                extra={"notifier": self.notifier.name, "key": old.key, "status": old.status},
            )
        self.queue.append(alert)
        self.depth.set(len(self.queue))


class Dispatcher:
    """Feeds alert transitions to every notifier without ever blocking the caller.

    ``on_decision`` and ``on_systemic`` are the pipeline's callbacks; call them from the event
    loop's thread (or any thread before ``start``). ``start``/``stop`` run the workers; ``lifecycle``
    is the same as an aiohttp ``cleanup_ctx`` entry.
    """

    def __init__(
        self,
        notifiers: Sequence[Notifier],
        config: NotifyConfig,
        registry: CollectorRegistry,
        *,
        clock: Clock | None = None,
        pool_of: Callable[[str], str | None] | None = None,
        sending: Callable[[], bool] | None = None,
    ) -> None:
        self.config = config
        # With several aggregator replicas only the leader sends: every replica keeps the same
        # alert book (they make the same decisions), so a new leader resolves what the old one
        # fired, and its first re-send brings Alertmanager up to date.
        self._sending = sending or (lambda: True)
        self.clock: Clock = clock or SystemClock()
        self.book = AlertBook(config, pool_of=pool_of)
        metrics = _Metrics(registry)
        self.lanes = [_Lane(n, config.queue_size, metrics) for n in notifiers]
        for lane in self.lanes:
            lane.depth.set(0)
        self._session: aiohttp.ClientSession | None = None
        self._resender: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- the pipeline's side: never blocks ------------------------------------------------------

    def on_decision(self, decision: Decision) -> None:
        self._enqueue(self.book.on_decision(decision))

    def on_systemic(self, event: SystemicEvent) -> None:
        self._enqueue(self.book.on_systemic(event))

    def _enqueue(self, alerts: Sequence[Alert], *, resend: bool = False) -> None:
        if not self._sending():
            return
        for alert in alerts:
            log.info(
                "alert",
                extra={
                    "key": alert.key,
                    "status": alert.status,
                    "alertname": alert.alertname,
                    "page": alert.page,
                },
            )
        for lane in self.lanes:
            n = lane.notifier
            if resend and not n.resends:
                continue
            took = False
            for alert in alerts:
                if n.accepts(alert):
                    lane.put(alert)
                    took = True
            if took:
                self._wake(lane)

    def _wake(self, lane: _Lane) -> None:
        loop = self._loop
        if loop is None:
            return  # not started: the worker finds the queue filled when it starts
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            lane.wake.set()
        else:
            loop.call_soon_threadsafe(lane.wake.set)

    # -- workers -------------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._session = aiohttp.ClientSession()
        for lane in self.lanes:
            lane.task = asyncio.create_task(self._work(lane), name=f"gpuwarden-notify-{lane.notifier.name}")
        if any(lane.notifier.resends for lane in self.lanes):
            self._resender = asyncio.create_task(self._resend(), name="gpuwarden-notify-resend")

    async def stop(self) -> None:
        tasks = [t for t in [self._resender, *(lane.task for lane in self.lanes)] if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._resender = None
        for lane in self.lanes:
            lane.task = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        self._loop = None

    async def lifecycle(self, _app: object = None) -> AsyncIterator[None]:
        """``app.cleanup_ctx.append(dispatcher.lifecycle)``."""
        await self.start()
        try:
            yield
        finally:
            await self.stop()

    def resend_now(self) -> None:
        """Queue every firing alert again for the notifiers that want re-sends."""
        self._enqueue(self.book.active(), resend=True)

    async def _resend(self) -> None:
        while True:
            await asyncio.sleep(self.config.resend_seconds)
            if self.book.active():
                self.resend_now()

    async def _work(self, lane: _Lane) -> None:
        n = lane.notifier
        assert self._session is not None
        session = self._session
        loop = asyncio.get_running_loop()
        next_send = 0.0
        delay = self.config.retry_initial_seconds
        while True:
            if not lane.queue:
                lane.wake.clear()
                await lane.wake.wait()
                continue
            wait = next_send - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
                continue  # the queue may have changed (coalesced, dropped) meanwhile
            batch = [lane.queue[i] for i in range(min(n.max_batch, len(lane.queue)))]
            next_send = loop.time() + n.min_interval_s
            try:
                await n.deliver(session, batch, self.clock.time())
            except DeliveryError as exc:
                lane.failed.inc()
                if exc.permanent:
                    self._remove(lane, batch)
                    for _ in batch:
                        lane.dropped.inc()
                    log.error(
                        "notification refused by the receiver; dropped",
                        extra={"notifier": n.name, "error": str(exc), "keys": [a.key for a in batch]},
                    )
                    continue
                wait_s = exc.retry_after if exc.retry_after is not None else delay
                log.warning(
                    "notification failed; will retry",
                    extra={"notifier": n.name, "error": str(exc), "retry_in_s": wait_s},
                )
                delay = min(delay * 2, self.config.retry_max_seconds)
                next_send = loop.time() + wait_s
                continue
            except Exception:
                # A bug in one notifier must not kill its worker or lose the rest of the queue.
                lane.failed.inc()
                self._remove(lane, batch)
                for _ in batch:
                    lane.dropped.inc()
                log.exception("notifier failed", extra={"notifier": n.name})
                continue
            delay = self.config.retry_initial_seconds
            self._remove(lane, batch)
            lane.sent.inc(len(batch))

    @staticmethod
    def _remove(lane: _Lane, batch: Sequence[Alert]) -> None:
        # Remove exactly what was sent: while it was in flight, entries may have been dropped from
        # the front or replaced by a newer state (which must still go out).
        for alert in batch:
            for i, queued in enumerate(lane.queue):
                if queued is alert:
                    del lane.queue[i]
                    break
        lane.depth.set(len(lane.queue))
