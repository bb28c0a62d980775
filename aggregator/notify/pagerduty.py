"""PagerDuty Events API v2: trigger and resolve, keyed by the alert's stable ``dedup_key``.

Only alerts that page (``notify.page_on``) go to PagerDuty. Each problem has one key for its whole
life (``gpuwarden/<node>/<kind>``, ``gpuwarden/link/<a>/<b>``, ``gpuwarden/systemic/<kind>/<domain>``)
and is triggered once: refreshed reasons and re-sends never re-trigger, so a flapping node is one
incident, and PagerDuty would fold a repeated trigger into it anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import aiohttp

from aggregator.notify.base import Alert, NotifyConfig, iso_time, post_json

__all__ = ["PagerDutyNotifier"]

_SUMMARY_MAX = 1024  # the Events API's limit


class PagerDutyNotifier:
    name = "pagerduty"
    max_batch = 1
    min_interval_s = 0.0
    resends = False
    coalesce = False  # trigger and resolve are both events PagerDuty must see, in order

    def __init__(self, routing_key: str, config: NotifyConfig) -> None:
        self.routing_key = routing_key
        self.url = config.pagerduty_url
        self.config = config

    def accepts(self, alert: Alert) -> bool:
        return alert.page

    def event(self, alert: Alert) -> dict[str, Any]:
        if alert.status == "resolved":
            return {"routing_key": self.routing_key, "event_action": "resolve", "dedup_key": alert.key}
        links = [{"href": alert.runbook_url, "text": "runbook"}]
        if alert.node_url:
            links.append({"href": alert.node_url, "text": f"node {alert.node}"})
        labels = alert.labels
        return {
            "routing_key": self.routing_key,
            "event_action": "trigger",
            "dedup_key": alert.key,
            "client": "gpuwarden",
            "links": links,
            "payload": {
                "summary": alert.summary[:_SUMMARY_MAX],
                "source": labels.get("node") or labels.get("domain") or "gpuwarden",
                "severity": "critical",
                "timestamp": iso_time(alert.starts_at),
                "component": labels.get("node", ""),
                "group": labels.get("pool", ""),
                "class": alert.alertname,
                "custom_details": {
                    "description": alert.description,
                    "labels": dict(labels),
                    **dict(alert.details),
                },
            },
        }

    async def deliver(self, session: aiohttp.ClientSession, batch: Sequence[Alert], now: float) -> None:
        for alert in batch:
            await post_json(session, self.url, self.event(alert), timeout_s=self.config.timeout_seconds)
