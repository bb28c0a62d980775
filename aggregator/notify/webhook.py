"""A generic JSON webhook, for sites without Alertmanager: one POST per alert transition.

Body: ``{"version": "1", "source": "gpuwarden", "alert": <Alert.to_json()>}``, where the alert has
``key`` (stable per problem), ``status`` (firing or resolved), ``alertname``, ``severity``,
``page``, ``labels``, ``annotations`` (summary, description, runbook_url, node_url), ``starts_at``,
``ends_at`` and ``details`` (the decision's reasons with their evidence).
"""

from __future__ import annotations

from collections.abc import Sequence

import aiohttp

from aggregator.notify.base import Alert, NotifyConfig, post_json

__all__ = ["WebhookNotifier"]


class WebhookNotifier:
    name = "webhook"
    max_batch = 1
    min_interval_s = 0.0
    resends = False
    coalesce = False  # a receiver may count transitions: each one is delivered

    def __init__(self, url: str, config: NotifyConfig) -> None:
        self.url = url
        self.config = config

    def accepts(self, alert: Alert) -> bool:
        return True

    async def deliver(self, session: aiohttp.ClientSession, batch: Sequence[Alert], now: float) -> None:
        for alert in batch:
            await post_json(
                session,
                self.url,
                {"version": "1", "source": "gpuwarden", "alert": alert.to_json()},
                timeout_s=self.config.timeout_seconds,
            )
