"""Detectors plug in: a module and a ``DetectorSpec`` line, nothing else, and one that fails is isolated.

The example detector here is registered exactly as the shipped ones are (a settings struct with its
``name``, a factory, one ``DetectorSpec``) and goes through the same composition root. Its settings
come from the ``detectors:`` section, its findings reach the health machine under its name, and its
run count, time and errors are exported per detector. A detector that raises in every hook costs
neither an agent's report (200, not 500) nor the rest of detection (rules, silence, the health
machine's tick), and its log lines are rate-limited.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import time
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from agent.clock import FakeClock
from agent.report import Report, encode
from aggregator.app import Aggregator, build_aggregator, build_pipeline
from aggregator.config import Config, DetectorSettings, FleetConfig, PositiveSeconds, SilenceConfig
from aggregator.configload import parse_config
from aggregator.detect import DETECTORS, SOURCES, DetectorSpec, PoolDetector, Verdict, detectors_section
from aggregator.fleet.frame import FleetFrames, PoolFrame
from aggregator.fleet.pools import Placement
from aggregator.model import Finding
from aggregator.service import REPORTS_PATH, SERVER_KWARGS
from tests.rulekit import T0, gpu, report, xid

TOKEN = "token-of-gpu-0001-for-the-plugin-test"


# -- the example: one settings struct, one detector class, one spec -------------------------------


class HotConfig(DetectorSettings, frozen=True):
    name: ClassVar[str] = "hot"
    every_seconds: PositiveSeconds = 5.0
    celsius: float = 90.0


class HotDetector:
    """A node whose last report had a GPU over ``celsius``: from reports, not from the frames (so
    not a ``PoolDetector``: those are run pool by pool on the frames)."""

    def __init__(self, config: HotConfig) -> None:
        self.config = config
        self.every_seconds = config.every_seconds
        self.hottest: dict[str, float] = {}

    def observe_report(self, report: Report, placement: Placement, measured: float) -> None:
        self.hottest[report.node] = max((g.temperature_celsius or 0.0) for g in report.gpus)

    def forget(self, node: str) -> None:
        self.hottest.pop(node, None)

    def run(self, frames: FleetFrames, now: float) -> Verdict:
        out = Verdict()
        for node, celsius in self.hottest.items():
            out.nodes[node] = (
                [Finding("hot", "hot", "warning", "alert", f"a GPU at {celsius:.0f} C", since=now)]
                if celsius > self.config.celsius
                else []
            )
        return out


HOT = DetectorSpec(HotConfig, HotDetector)
WITH_HOT = (*DETECTORS, HOT)


class BrokenConfig(DetectorSettings, frozen=True):
    name: ClassVar[str] = "broken"
    every_seconds: PositiveSeconds = 1.0


class BrokenDetector:
    """Raises in every hook."""

    def __init__(self, config: BrokenConfig) -> None:
        self.every_seconds = config.every_seconds
        self.calls = 0

    def observe_report(self, report: Report, placement: Placement, measured: float) -> None:
        self.calls += 1
        raise RuntimeError("observe_report is broken")

    def run(self, frames: FleetFrames, now: float) -> Verdict:
        self.calls += 1
        raise ZeroDivisionError("run is broken")

    def forget(self, node: str) -> None:
        raise KeyError(node)


WITH_BROKEN = (DetectorSpec(BrokenConfig, BrokenDetector), *DETECTORS)


def _hot_config(text: str) -> Config:
    """A config whose detectors: section also knows the example (built from WITH_HOT, as the
    shipped section is built from DETECTORS)."""
    section = detectors_section(WITH_HOT)
    return msgspec.structs.replace(Config(), detectors=msgspec.convert(msgspec.json.decode(text), section))


def sample(registry: CollectorRegistry, name: str, detector: str) -> float:
    value = registry.get_sample_value(name, {"detector": detector})
    assert value is not None, (name, detector)
    return value


def _rep(t: float, seq: int, *, temp: float = 60.0, **kw: Any) -> Report:
    r = report(
        t, seq=seq, gpus=[gpu(i, temperature_celsius=temp if i == 2 else 60.0) for i in range(8)], **kw
    )
    return msgspec.structs.replace(r, node="gpu-0001")


# -- the example plugs in ---------------------------------------------------------------------------


def test_the_shipped_detectors_and_the_sources_come_from_one_list() -> None:
    assert [d.name for d in DETECTORS] == ["peer", "trend", "forest", "link", "probe", "jobs", "ports"]
    assert SOURCES == ("rule", "silence", "peer", "trend", "forest", "link", "probe", "jobs", "ports")
    # Every shipped detector has its section, with its defaults, in the configuration.
    assert {d.name: type(Config().detectors.of(d.name)) for d in DETECTORS} == {
        d.name: d.settings for d in DETECTORS
    }


def test_a_detectors_settings_come_from_the_config_file_and_bad_keys_are_refused() -> None:
    config = parse_config("detectors: {peer: {every_seconds: 5}, link: {min_partners: 4}}", "test")
    assert config.detectors.of("peer").every_seconds == 5.0
    assert config.detectors.of("trend") == Config().detectors.of("trend")
    pipeline = build_pipeline(config, [])
    assert {r.name: r.detector.every_seconds for r in pipeline._detectors} == {
        "peer": 5.0,
        "trend": 30.0,
        "forest": 300.0,
        "link": 60.0,
        "probe": 60.0,
        "jobs": 60.0,
        "ports": 30.0,
    }
    assert pipeline._detectors[3].detector.config.min_partners == 4  # type: ignore[attr-defined]
    with pytest.raises(Exception, match=r"at detectors\.peer: unknown key `nope`"):
        parse_config("detectors: {peer: {nope: 1}}", "test")
    with pytest.raises(Exception, match=r"at detectors: unknown key `pear`"):
        parse_config("detectors: {pear: {}}", "test")
    with pytest.raises(Exception, match=r"at detectors\.trend: trend detector needs"):
        parse_config("detectors: {trend: {alert_hits: 9}}", "test")


def test_a_test_only_detector_plugs_in_through_a_spec_and_reports_to_the_health_machine() -> None:
    assert _hot_config('{"hot": {"celsius": 80}}').detectors.of("hot") == HotConfig(celsius=80.0)
    with pytest.raises(msgspec.ValidationError, match=r"unknown field `degrees` - at `\$.hot`"):
        _hot_config('{"hot": {"degrees": 80}}')

    pipeline = build_pipeline(_hot_config('{"hot": {"celsius": 80}}'), [], detectors=WITH_HOT)
    for k in range(3):
        pipeline.ingest(_rep(T0 + 10 * k, k, temp=85.0), T0 + 10 * k)
    h = pipeline.health.get("gpu-0001")
    assert h is not None and h.state == "suspect"
    assert [r.detector for r in h.reasons] == ["hot"]
    # Repaired: the detector answers [] for the node, and the finding clears.
    for k in range(3, 30):
        pipeline.ingest(_rep(T0 + 10 * k, k), T0 + 10 * k)
    assert pipeline.health.get("gpu-0001").state == "healthy"  # type: ignore[union-attr]
    stats = {s.detector: s for s in pipeline.detector_stats()}
    # Time moves only with the reports here (every 10 s): the detector, due every 5 s, runs at each.
    assert stats["hot"].runs == 30 and stats["hot"].errors == 0


async def _serve(tmp_path: Path, config: Config, detectors: Any) -> tuple[Aggregator, FakeClock]:
    (tmp_path / "tokens").write_text(f"gpu-0001 {TOKEN}\n")
    clock = FakeClock(start=T0)
    agg = await build_aggregator(
        config, [], auth=tmp_path / "tokens", clock=clock, detectors=detectors, advance_interval_s=None
    )
    return agg, clock


async def _post(client: TestClient[Any, Any], r: Report) -> tuple[int, Any]:
    headers = {
        "Content-Type": "application/json",
        "Content-Encoding": "gzip",
        "Authorization": f"Bearer {TOKEN}",
    }
    resp = await client.post(REPORTS_PATH, data=gzip.compress(encode(r)), headers=headers)
    return resp.status, await resp.json()


async def test_each_detector_exports_its_runs_time_and_errors(tmp_path: Path, aiohttp_client: Any) -> None:
    agg, clock = await _serve(tmp_path, _hot_config('{"hot": {"celsius": 80}}'), WITH_HOT)
    server = TestServer(agg.app)
    await server.start_server(**SERVER_KWARGS)
    client = await aiohttp_client(server)
    for k in range(3):
        assert await _post(client, _rep(clock.time(), k, temp=95.0)) == (200, {"status": "accepted"})
        clock.advance(10.0)
    text = await (await client.get("/metrics")).text()
    for name in ("runs", "duration_seconds", "errors"):
        assert f'gpuwarden_detector_{name}_total{{detector="hot"}}' in text
        assert f'gpuwarden_detector_{name}_total{{detector="peer"}}' in text
    assert sample(agg.registry, "gpuwarden_detector_runs_total", "hot") == 3.0
    assert sample(agg.registry, "gpuwarden_detector_runs_total", "forest") == 1.0  # every 300 s
    assert sample(agg.registry, "gpuwarden_detector_errors_total", "hot") == 0.0
    assert sample(agg.registry, "gpuwarden_detector_duration_seconds_total", "hot") >= 0.0


# -- a failing detector is isolated -----------------------------------------------------------------


async def test_a_raising_detector_never_fails_a_report_nor_the_rest_of_detection(
    tmp_path: Path, aiohttp_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from aggregator.rules import default_rules_dir, load_rules

    config = msgspec.structs.replace(Config(), silence=SilenceConfig(silent_after_seconds=30.0))
    (tmp_path / "tokens").write_text(f"gpu-0001 {TOKEN}\n")
    clock = FakeClock(start=T0)
    agg = await build_aggregator(
        config,
        load_rules([default_rules_dir()]),
        auth=tmp_path / "tokens",
        clock=clock,
        detectors=WITH_BROKEN,
        advance_interval_s=None,
    )
    server = TestServer(agg.app)
    await server.start_server(**SERVER_KWARGS)
    client = await aiohttp_client(server)
    caplog.set_level(logging.ERROR, logger="aggregator.pipeline")

    for k in range(20):
        assert await _post(client, _rep(clock.time(), k)) == (200, {"status": "accepted"})
        clock.advance(2.0)
    # The rules still decide: an XID 79 quarantines at once.
    assert await _post(client, _rep(clock.time(), 20, events=[xid(79, at=clock.time())])) == (
        200,
        {"status": "accepted"},
    )
    assert agg.pipeline.health.get("gpu-0001").state == "quarantined"  # type: ignore[union-attr]
    # The health machine still ticks without reports: silence is found after 30 s.
    for _ in range(40):
        clock.advance(1.0)
        agg.pipeline.advance(clock.time())
    active = agg.pipeline.health.get("gpu-0001").active()  # type: ignore[union-attr]
    assert "silence" in {t.finding.detector for t in active}

    broken = agg.pipeline._detectors[0]
    assert broken.name == "broken" and broken.detector.calls > 40  # type: ignore[attr-defined]
    assert sample(agg.registry, "gpuwarden_detector_errors_total", "broken") == broken.detector.calls  # type: ignore[attr-defined]
    assert sample(agg.registry, "gpuwarden_detector_errors_total", "peer") == 0.0
    rejected = agg.registry.get_sample_value(
        "gpuwarden_aggregator_reports_rejected_total", {"reason": "internal_error"}
    )
    assert rejected == 0.0
    # Rate-limited: over 80 s of failures in two hooks, one line per hook per minute at most.
    failed = [r for r in caplog.records if r.getMessage() == "detector failed"]
    assert 2 <= len(failed) <= 4  # each hook at least once, at most once a minute each
    assert {getattr(r, "hook", None) for r in failed} == {"observe_report", "run"}


# -- detection runs off the ingest path -------------------------------------------------------------


class _WhereConfig(DetectorSettings, frozen=True):
    name: ClassVar[str] = "where"
    every_seconds: PositiveSeconds = 1.0


class _WhereDetector(HotDetector):
    """Records the asyncio task each run happens in."""

    def __init__(self, config: _WhereConfig) -> None:
        super().__init__(HotConfig(every_seconds=config.every_seconds))
        self.tasks: list[str] = []
        _WHERE.append(self)

    def run(self, frames: FleetFrames, now: float) -> Verdict:
        task = asyncio.current_task()
        self.tasks.append(task.get_name() if task is not None else "no task")
        return super().run(frames, now)


_WHERE: list[_WhereDetector] = []


async def test_served_detectors_run_in_the_periodic_task_never_in_a_post(
    tmp_path: Path, aiohttp_client: Any
) -> None:
    """A POST does rules and bookkeeping only: a fleet detector's run (a 0.2 s forest, say) never
    makes an agent wait, and the event loop's lag is exported."""
    _WHERE.clear()
    (tmp_path / "tokens").write_text(f"gpu-0001 {TOKEN}\n")
    clock = FakeClock(start=T0)
    agg = await build_aggregator(
        Config(),
        [],
        auth=tmp_path / "tokens",
        clock=clock,
        detectors=(*DETECTORS, DetectorSpec(_WhereConfig, _WhereDetector)),
        advance_interval_s=0.01,
    )
    server = TestServer(agg.app)
    await server.start_server(**SERVER_KWARGS)
    client = await aiohttp_client(server)
    assert agg.pipeline.advance_on_ingest is False
    (where,) = _WHERE
    for k in range(6):
        clock.advance(10.0)
        assert await _post(client, _rep(clock.time(), k)) == (200, {"status": "accepted"})
        deadline = time.monotonic() + 5.0
        while len(where.tasks) <= k and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
    assert len(where.tasks) >= 6
    assert set(where.tasks) == {"gpuwarden-advance"}
    deadline = time.monotonic() + 5.0
    while (agg.registry.get_sample_value("gpuwarden_aggregator_event_loop_lag_seconds_count") or 0) < 1:
        assert time.monotonic() < deadline, "no event-loop lag sample in 5 s"
        await asyncio.sleep(0.05)


def test_advance_in_steps_is_advance() -> None:
    """The service's stepped cycle and replay's ``advance`` do the same work: one step for silence,
    one per detector due."""
    config = _hot_config('{"hot": {"celsius": 80}}')
    whole, stepped = (
        build_pipeline(config, [], detectors=WITH_HOT),
        build_pipeline(config, [], detectors=WITH_HOT),
    )
    for p in (whole, stepped):
        p.advance_on_ingest = False
        for k in range(3):
            p.ingest(_rep(T0 + 10 * k, k, temp=95.0), T0 + 10 * k)
    whole.advance(T0 + 30)
    steps = list(stepped.advance_steps(T0 + 30))
    assert len(steps) == 1 + len(WITH_HOT)  # nothing ran before: every detector is due
    assert [h.state for h in (whole.health.get("gpu-0001"), stepped.health.get("gpu-0001"))] == [
        "suspect"
    ] * 2
    assert list(stepped.advance_steps(T0 + 30)) == []  # the same tick again: nothing to do


async def test_a_blocked_event_loop_shows_in_the_lag_metrics() -> None:
    from aggregator.metrics import Metrics
    from aggregator.service import watch_loop_lag

    registry = CollectorRegistry()
    task = asyncio.create_task(watch_loop_lag(Metrics(registry), interval_s=0.01))
    await asyncio.sleep(0.05)
    time.sleep(0.2)  # a callback that hogs the loop, as a long detector run would
    await asyncio.sleep(0.05)
    task.cancel()
    worst = registry.get_sample_value("gpuwarden_aggregator_event_loop_lag_max_seconds")
    assert worst is not None and worst >= 0.15
    over = registry.get_sample_value("gpuwarden_aggregator_event_loop_lag_seconds_bucket", {"le": "0.1"})
    total = registry.get_sample_value("gpuwarden_aggregator_event_loop_lag_seconds_count")
    assert over is not None and total is not None and total - over >= 1  # one sample above 0.1 s


class _FlakyPoolConfig(DetectorSettings, frozen=True):
    name: ClassVar[str] = "flaky-pool"
    every_seconds: PositiveSeconds = 10.0


class _FlakyPoolDetector(PoolDetector):
    """Raises on pool ``a``; on every other pool, one alert per node."""

    def __init__(self, config: _FlakyPoolConfig) -> None:
        self.every_seconds = config.every_seconds

    def run_pool(self, frame: PoolFrame, now: float) -> dict[str, list[Finding]]:
        if frame.name == "a":
            raise RuntimeError("pool a is broken")
        nodes, _ = frame.snapshot(now - frame.slots * frame.interval_s, now)
        return {n: [Finding("flaky-pool", "seen", "warning", "alert", "seen", since=now)] for n in nodes}


class _CountingPoolConfig(DetectorSettings, frozen=True):
    name: ClassVar[str] = "counting-pool"
    every_seconds: PositiveSeconds = 10.0


class _CountingPoolDetector(PoolDetector):
    """Notes when it runs; finds nothing."""

    runs: ClassVar[list[float]] = []

    def __init__(self, config: _CountingPoolConfig) -> None:
        self.every_seconds = config.every_seconds

    def run_pool(self, frame: PoolFrame, now: float) -> dict[str, list[Finding]]:
        _CountingPoolDetector.runs.append(now)
        return {}


@pytest.mark.parametrize(("interval", "period"), [(5.0, 10.0), (10.0, 10.0), (60.0, 60.0)])
def test_a_pool_detector_runs_at_most_once_an_interval(interval: float, period: float) -> None:
    # It judges complete slots, and a slot completes once an interval: a fleet reporting every
    # minute gives a 10 s pool detector nothing new five runs in six.
    _CountingPoolDetector.runs.clear()
    config = Config(fleet=FleetConfig(interval_seconds=interval))
    spec = DetectorSpec(_CountingPoolConfig, _CountingPoolDetector)
    pipeline = build_pipeline(config, [], detectors=(spec,))
    pipeline.advance_on_ingest = False
    pipeline.ingest(report(T0, seq=0), T0)
    for k in range(13):
        list(pipeline.advance_steps(T0 + 10 * k))
    assert _CountingPoolDetector.runs == [T0 + period * i for i in range(int(120 / period) + 1)]


def test_a_pool_detector_runs_pool_by_pool_and_one_failing_pool_spares_the_others() -> None:
    spec = DetectorSpec(_FlakyPoolConfig, _FlakyPoolDetector)
    pipeline = build_pipeline(Config(), [], detectors=(spec,))
    pipeline.advance_on_ingest = False
    for k in range(3):
        for node, pool in (("gpu-a1", "a"), ("gpu-b1", "b")):
            r = msgspec.structs.replace(report(T0 + 10 * k, seq=k, node=node), labels={"pool": pool})
            pipeline.ingest(r, T0 + 10 * k)
    steps = list(pipeline.advance_steps(T0 + 30))
    assert len(steps) == 1 + 1  # silence, then pool b (pool a raised: no step, no findings)
    b, a = pipeline.health.get("gpu-b1"), pipeline.health.get("gpu-a1")
    assert b is not None and b.state == "suspect"
    assert a is None or a.state == "healthy"
    (stats,) = pipeline.detector_stats()
    assert (stats.runs, stats.errors) == (1, 1)
