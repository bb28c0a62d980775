"""Slack incoming webhook: one message per alert transition.

Slack allows about one message per second per webhook and answers 429 with ``Retry-After`` when
pushed harder; the dispatcher spaces requests by ``slack_min_interval_seconds`` and waits out a
429 before retrying the same message, so nothing is lost to the limit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import aiohttp

from aggregator.notify.base import Alert, NotifyConfig, post_json

__all__ = ["SlackNotifier"]

_MAX_TEXT = 3000  # a section block's text limit


def _escape(text: str) -> str:
    # Slack's mrkdwn treats these three as control characters.
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


class SlackNotifier:
    name = "slack"
    max_batch = 1
    resends = False
    coalesce = False

    def __init__(self, url: str, config: NotifyConfig) -> None:
        self.url = url
        self.config = config
        self.min_interval_s = config.slack_min_interval_seconds

    def accepts(self, alert: Alert) -> bool:
        return True

    def message(self, alert: Alert) -> dict[str, Any]:
        if alert.status == "resolved":
            head = f"RESOLVED: {alert.summary}"
        else:
            head = f"{'PAGE' if alert.page else 'FIRING'}: {alert.summary}"
        links = [f"<{alert.runbook_url}|runbook>"]
        if alert.node_url:
            links.append(f"<{alert.node_url}|node>")
        labels = ", ".join(f"{k}={v}" for k, v in sorted(alert.labels.items()))
        body = _escape(f"{head}\n{alert.description}")[:_MAX_TEXT]
        return {
            # text is what notifications and clients without blocks show.
            "text": _escape(head)[:_MAX_TEXT],
            "blocks": [
                {"type": "section", "text": {"type": "mrkdwn", "text": body}},
                {
                    "type": "context",
                    "elements": [
                        {"type": "mrkdwn", "text": f"{' | '.join(links)} | {_escape(labels)}"[:_MAX_TEXT]}
                    ],
                },
            ],
        }

    async def deliver(self, session: aiohttp.ClientSession, batch: Sequence[Alert], now: float) -> None:
        for alert in batch:
            await post_json(session, self.url, self.message(alert), timeout_s=self.config.timeout_seconds)
