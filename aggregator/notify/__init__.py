"""Alerts to on-call: Alertmanager, a generic webhook, Slack and PagerDuty.

``build_notifiers(config)`` makes the notifiers the ``notify:`` section turns on; ``make_dispatcher``
wires them into a ``Dispatcher`` whose ``on_decision``/``on_systemic`` are the pipeline's callbacks.
See docs/alerting.md.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client.registry import CollectorRegistry

from agent.clock import Clock
from aggregator.notify.alertmanager import AlertmanagerNotifier
from aggregator.notify.base import Alert, AlertBook, DeliveryError, Dispatcher, Notifier, NotifyConfig
from aggregator.notify.pagerduty import PagerDutyNotifier
from aggregator.notify.slack import SlackNotifier
from aggregator.notify.webhook import WebhookNotifier

__all__ = [
    "NOTIFIERS",
    "Alert",
    "AlertBook",
    "AlertmanagerNotifier",
    "DeliveryError",
    "Dispatcher",
    "Notifier",
    "NotifyConfig",
    "PagerDutyNotifier",
    "SlackNotifier",
    "WebhookNotifier",
    "build_notifiers",
    "make_dispatcher",
]

# Every notifier there is: (name, the config field that turns it on, its constructor).
NOTIFIERS: tuple[tuple[str, str, Callable[[str, NotifyConfig], Notifier]], ...] = (
    ("alertmanager", "alertmanager_url", AlertmanagerNotifier),
    ("webhook", "webhook_url", WebhookNotifier),
    ("slack", "slack_webhook_url", SlackNotifier),
    ("pagerduty", "pagerduty_routing_key", PagerDutyNotifier),
)


def build_notifiers(config: NotifyConfig) -> list[Notifier]:
    """The notifiers whose URL (or key) is set, in ``NOTIFIERS`` order."""
    out: list[Notifier] = []
    for _name, field, make in NOTIFIERS:
        value = getattr(config, field)
        if value:
            out.append(make(value, config))
    return out


def make_dispatcher(
    config: NotifyConfig,
    registry: CollectorRegistry,
    *,
    clock: Clock | None = None,
    pool_of: Callable[[str], str | None] | None = None,
    sending: Callable[[], bool] | None = None,
) -> Dispatcher:
    """A dispatcher over the configured notifiers (none configured: it only keeps the alert book).
    ``sending``: whether this replica sends now (the leader; default always)."""
    return Dispatcher(
        build_notifiers(config), config, registry, clock=clock, pool_of=pool_of, sending=sending
    )
