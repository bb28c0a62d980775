"""The Alertmanager notifier against a real Alertmanager (Debian's prometheus-alertmanager).

Each test starts its own Alertmanager on 127.0.0.1 with a temporary config and storage path and
stops it afterwards. Without the binary the tests skip locally and fail in CI (CI=true), where
scripts/setup installs it.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from prometheus_client.registry import CollectorRegistry

from aggregator.notify import NotifyConfig, make_dispatcher
from tests.conftest import missing_tool
from tests.ports import free_port
from tests.test_notify import T0, quarantine, release, systemic

CONFIG = """\
route:
  receiver: blackhole
  group_wait: 1s
receivers:
  - name: blackhole
"""


def _binary() -> str:
    for name in ("prometheus-alertmanager", "alertmanager"):
        path = shutil.which(name)
        if path:
            return path
    missing_tool("prometheus-alertmanager", "prometheus-alertmanager")


class Alertmanager:
    def __init__(self, binary: str, workdir: Path, port: int) -> None:
        self.binary, self.workdir, self.port = binary, workdir, port
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    async def start(self) -> None:
        config = self.workdir / "alertmanager.yml"
        config.write_text(CONFIG)
        storage = self.workdir / "data"
        storage.mkdir(exist_ok=True)
        self._log = (self.workdir / "alertmanager.log").open("wb")
        self.proc = subprocess.Popen(
            [
                self.binary,
                f"--config.file={config}",
                f"--storage.path={storage}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--cluster.listen-address=",  # no gossip port: a lone test instance
                "--log.level=warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=self._log,
        )
        async with aiohttp.ClientSession() as s:
            for _ in range(200):
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"alertmanager exited: {(self.workdir / 'alertmanager.log').read_text()}"
                    )
                try:
                    async with s.get(f"{self.url}/-/ready") as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)
        raise RuntimeError("alertmanager did not become ready in 10 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None:
            self._log.close()

    async def alerts(self) -> list[dict[str, Any]]:
        async with aiohttp.ClientSession() as s, s.get(f"{self.url}/api/v2/alerts") as r:
            r.raise_for_status()
            body: list[dict[str, Any]] = await r.json()
            return body

    async def wait(self, predicate: Any, timeout: float = 5.0) -> list[dict[str, Any]]:
        """The alerts once ``predicate(alerts)`` holds."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            alerts = await self.alerts()
            if predicate(alerts):
                return alerts
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"alertmanager never got there; it has: {alerts}")
            await asyncio.sleep(0.05)


@pytest.fixture
def am(tmp_path: Path) -> Iterator[Alertmanager]:
    manager = Alertmanager(_binary(), tmp_path, free_port())
    yield manager
    manager.stop()


@pytest.fixture
async def running_am(am: Alertmanager) -> AsyncIterator[Alertmanager]:
    await am.start()
    yield am


def config(am: Alertmanager, **kw: Any) -> NotifyConfig:
    base = NotifyConfig(
        alertmanager_url=am.url,
        external_url="https://gpuwarden.example",
        retry_initial_seconds=0.05,
        retry_max_seconds=0.2,
    )
    return msgspec.structs.replace(base, **kw)


def named(alerts: list[dict[str, Any]], alertname: str) -> list[dict[str, Any]]:
    return [a for a in alerts if a["labels"]["alertname"] == alertname]


async def test_alerts_appear_with_labels_and_annotations_and_resolve(running_am: Alertmanager) -> None:
    am = running_am
    d = make_dispatcher(config(am), CollectorRegistry(), pool_of=lambda n: "pool-a")
    await d.start()
    try:
        d.on_decision(quarantine(lemon=True, t=T0))
        d.on_systemic(systemic("started", t=T0))
        alerts = await am.wait(lambda a: len(a) == 3)

        [q] = named(alerts, "GpuwardenNodeQuarantined")
        assert q["labels"] == {
            "alertname": "GpuwardenNodeQuarantined",
            "severity": "warning",
            "node": "gpu-0042",
            "pool": "pool-a",
            "reason": "xid-79",
        }
        assert q["status"]["state"] == "active"
        ann = q["annotations"]
        assert ann["summary"] == "gpu-0042 quarantined: GPU 3 fell off the bus (XID 79)"
        assert "GPU-ab12cd34-0000-1111-2222-333344445555" in ann["description"]
        assert "XID 79" in ann["description"]
        assert ann["runbook_url"].endswith("/docs/runbooks/GpuwardenNodeQuarantined.md")
        assert ann["node_url"] == "https://gpuwarden.example/api/v1/nodes/gpu-0042"
        assert q["generatorURL"] == "https://gpuwarden.example/api/v1/nodes/gpu-0042"
        assert q["startsAt"].startswith("2025-11-29T18:40:00")

        [lemon] = named(alerts, "GpuwardenLemonNode")
        assert lemon["labels"]["severity"] == "page"
        [outage] = named(alerts, "GpuwardenSystemicOutage")
        assert outage["labels"]["severity"] == "page" and outage["labels"]["domain"] == "r12"

        d.on_decision(release())
        d.on_systemic(systemic("ended", t=T0 + 60))
        # Resolved (endsAt in the past): Alertmanager no longer lists them as alerts.
        await am.wait(lambda a: a == [])
    finally:
        await d.stop()


async def test_resend_keeps_a_firing_alert_active(running_am: Alertmanager) -> None:
    am = running_am
    # endsAt is four re-send periods ahead: 1 s here.
    d = make_dispatcher(config(am, resend_seconds=0.25), CollectorRegistry())
    await d.start()
    try:
        d.on_decision(quarantine())
        [first] = await am.wait(lambda a: len(a) == 1)
        await asyncio.sleep(1.5)  # past the first endsAt
        [later] = await am.alerts()
        assert later["status"]["state"] == "active"
        assert later["endsAt"] > first["endsAt"]
        assert later["startsAt"] == first["startsAt"]
    finally:
        await d.stop()
    # Without re-sends (the aggregator died) the alert ends on its own: nothing stays stuck firing.
    await am.wait(lambda a: a == [], timeout=3.0)


async def test_delivery_retries_until_alertmanager_comes_up(am: Alertmanager) -> None:
    reg = CollectorRegistry()
    d = make_dispatcher(config(am), reg)
    await d.start()
    try:
        d.on_decision(quarantine())
        await asyncio.sleep(0.3)  # connection refused, a few times
        failed = reg.get_sample_value("gpuwarden_notify_failed_total", {"notifier": "alertmanager"})
        assert failed is not None and failed >= 1
        await am.start()
        [alert] = await am.wait(lambda a: len(a) == 1)
        assert alert["labels"]["node"] == "gpu-0042"
        assert reg.get_sample_value("gpuwarden_notify_sent_total", {"notifier": "alertmanager"}) == 1
        assert reg.get_sample_value("gpuwarden_notify_queue_depth", {"notifier": "alertmanager"}) == 0
    finally:
        await d.stop()
