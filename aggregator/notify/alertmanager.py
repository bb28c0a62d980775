"""Alertmanager (API v2): ``POST /api/v2/alerts``, the way Prometheus itself sends.

Alertmanager expects a client to re-post a firing alert until it resolves, each time with an
``endsAt`` in the future: an alert not refreshed before its ``endsAt`` resolves on its own, which
is what should happen if the aggregator dies. So firing alerts go out with ``endsAt`` four re-send
periods ahead and the dispatcher re-sends them every ``resend_seconds``; a release posts the same
labels with ``endsAt`` = the time it was resolved. Labels (alertname, severity, node, pool,
reason) are what Alertmanager groups, routes, silences and deduplicates on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import aiohttp

from aggregator.notify.base import Alert, NotifyConfig, iso_time, post_json

__all__ = ["AlertmanagerNotifier"]


class AlertmanagerNotifier:
    name = "alertmanager"
    max_batch = 200  # one POST carries many alerts: a re-send of the whole fleet is a few requests
    min_interval_s = 0.0
    resends = True
    coalesce = True  # Alertmanager holds state: only the latest of an alert matters

    def __init__(self, url: str, config: NotifyConfig) -> None:
        self.url = url.rstrip("/") + "/api/v2/alerts"
        self.config = config

    def accepts(self, alert: Alert) -> bool:
        return True

    def payload(self, alert: Alert, now: float) -> dict[str, Any]:
        if alert.status == "resolved" and alert.ends_at is not None:
            ends = alert.ends_at
        else:
            ends = now + 4 * self.config.resend_seconds
        out: dict[str, Any] = {
            "labels": dict(alert.labels),
            "annotations": alert.annotations(),
            "startsAt": iso_time(alert.starts_at),
            "endsAt": iso_time(ends),
        }
        if alert.node_url:
            out["generatorURL"] = alert.node_url
        return out

    async def deliver(self, session: aiohttp.ClientSession, batch: Sequence[Alert], now: float) -> None:
        await post_json(
            session,
            self.url,
            [self.payload(a, now) for a in batch],
            timeout_s=self.config.timeout_seconds,
        )
