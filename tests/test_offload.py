"""Offloaded detection: a pool run's costly part leaves the event loop, its findings come back to it.

An ``OffloadingPoolDetector`` splits each pool's run into prepare (on the loop), compute (the
service runs it in a one-thread executor) and finish (on the loop). What the service decides this
way must be what ``Pipeline.advance`` (replay, tests) decides running the three inline, the loop
must stay free while a compute runs, and a compute still running when the detector is due again
must not be doubled.
"""

from __future__ import annotations

import asyncio
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar

import msgspec
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from agent.clock import FakeClock
from aggregator.app import build_pipeline
from aggregator.config import Config, DetectorSettings, PositiveSeconds
from aggregator.detect import DetectorSpec
from aggregator.detect.base import Offload, OffloadingPoolDetector
from aggregator.detect.nanstats import nanmean, nanmedian
from aggregator.fleet.frame import PoolFrame
from aggregator.metrics import Metrics
from aggregator.model import Finding
from aggregator.pipeline import OffloadStep, Pipeline
from aggregator.service import advance_periodically
from tests.rulekit import T0, report

COMPUTE_S = 0.3  # longer than the loop may be held, and than the detector's period below


class _SlowConfig(DetectorSettings, frozen=True):
    name: ClassVar[str] = "slow"
    every_seconds: PositiveSeconds = 0.1


class _SlowDetector(OffloadingPoolDetector):
    """Alerts on every node of pool ``b`` after a compute of ``COMPUTE_S`` (a sleep, which, like
    compiled numpy and scikit-learn code, lets other threads run); raises on pool ``bad``."""

    def __init__(self, config: _SlowConfig) -> None:
        self.every_seconds = config.every_seconds
        self.threads: dict[str, set[int]] = {"prepare": set(), "compute": set(), "finish": set()}
        self.computes = 0
        self.running = 0
        self.most_at_once = 0
        self._lock = threading.Lock()

    def prepare_pool(self, frame: PoolFrame, now: float) -> Offload[tuple[str, ...]]:
        self.threads["prepare"].add(threading.get_ident())
        nodes, _ = frame.snapshot(now - frame.slots * frame.interval_s, now)
        names, pool = tuple(nodes), frame.name

        def compute() -> tuple[str, ...]:
            with self._lock:
                self.running += 1
                self.most_at_once = max(self.most_at_once, self.running)
                self.computes += 1
            self.threads["compute"].add(threading.get_ident())
            time.sleep(COMPUTE_S)
            with self._lock:
                self.running -= 1
            if pool == "bad":
                raise RuntimeError("this pool's compute fails")
            return names if pool == "b" else ()

        return Offload(compute=compute, finish=lambda flagged: self._finish(names, flagged))

    def _finish(self, names: tuple[str, ...], flagged: tuple[str, ...]) -> dict[str, list[Finding]]:
        self.threads["finish"].add(threading.get_ident())
        return {
            n: [Finding("slow", "odd", "warning", "alert", "odd", since=0.0)] if n in flagged else []
            for n in names
        }


SPEC = DetectorSpec(_SlowConfig, _SlowDetector)


def _pipeline() -> Pipeline:
    pipeline = build_pipeline(Config(), [], detectors=(SPEC,))
    pipeline.advance_on_ingest = False
    for k in range(3):
        for node, pool in (("gpu-a1", "a"), ("gpu-b1", "b"), ("gpu-x1", "bad")):
            r = msgspec.structs.replace(report(T0 + 10 * k, seq=k, node=node), labels={"pool": pool})
            pipeline.ingest(r, T0 + 10 * k)
    return pipeline


def _states(pipeline: Pipeline) -> dict[str, str]:
    return {
        n: (h.state if (h := pipeline.health.get(n)) else "healthy") for n in ("gpu-a1", "gpu-b1", "gpu-x1")
    }


def test_advance_runs_the_compute_inline_and_a_failing_compute_spares_the_other_pools() -> None:
    pipeline = _pipeline()
    steps = list(pipeline.advance_steps(T0 + 30))
    # Silence, then one step per pool, each the pool's compute, which nobody ran: run inline.
    assert len(steps) == 1 + 3 and all(isinstance(s, OffloadStep) for s in steps[1:])
    assert _states(pipeline) == {"gpu-a1": "healthy", "gpu-b1": "suspect", "gpu-x1": "healthy"}
    (stats,) = pipeline.detector_stats()
    assert (stats.runs, stats.errors) == (1, 1)
    assert stats.seconds >= 3 * COMPUTE_S  # the compute's time is the detector's time


async def test_the_service_computes_off_the_loop_with_the_same_decisions() -> None:
    inline = _pipeline()
    inline.advance(T0 + 30)
    live = _pipeline()
    detector = live._detectors[0].detector
    assert isinstance(detector, _SlowDetector)
    clock = FakeClock(T0 + 30)
    ran_during_compute = 0  # loop turns taken while a compute was in flight in its thread

    async def probe() -> None:
        nonlocal ran_during_compute
        while True:
            await asyncio.sleep(0.01)
            ran_during_compute += detector.running > 0

    watcher = asyncio.create_task(probe())
    with ThreadPoolExecutor(max_workers=1) as executor:
        task = asyncio.create_task(
            advance_periodically(live, clock, Metrics(CollectorRegistry()), 0.05, executor)
        )
        deadline = time.monotonic() + 10
        while detector.computes < 6 and time.monotonic() < deadline:  # two whole runs, 3 pools each
            await asyncio.sleep(0.02)
            clock.advance(0.2)  # the detector is due again while its compute still runs
        task.cancel()
        watcher.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    main = threading.get_ident()
    assert detector.threads["prepare"] == detector.threads["finish"] == {main}
    assert detector.threads["compute"] and main not in detector.threads["compute"]
    assert detector.most_at_once == 1  # never two computes at once, however overdue the next run
    # The loop was free while the computes ran (counted, not timed: a loaded machine's lag is no
    # test's business; inline, no loop turn could see a compute in flight).
    assert ran_during_compute > 0
    assert _states(live) == _states(inline) == {"gpu-a1": "healthy", "gpu-b1": "suspect", "gpu-x1": "healthy"}


def test_the_warning_free_mean_is_numpys_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, (30, 50, 8))
    x[rng.random(x.shape) < 0.3] = np.nan
    x[:, 3] = np.nan  # all-NaN lanes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        expected = np.nanmean(x, axis=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the point: no warning to silence, in any thread
        got = nanmean(x, axis=0)
    assert np.array_equal(got, expected, equal_nan=True)


@pytest.mark.parametrize("lane", [1, 2, 7, 8, 1024, 4001])
def test_the_warning_free_median_is_numpys(lane: int) -> None:
    """A node's eight GPUs and a pool's slot of thousands: numpy's medians, with NaN for an
    all-NaN lane, infinities kept, no warning raised and the caller's array left as it was."""
    rng = np.random.default_rng(lane)
    x = np.round(rng.normal(0, 1, (5, 3, lane)), 1)  # rounded: ties
    x[rng.random(x.shape) < 0.3] = np.nan
    x[1, 2] = np.nan  # an all-NaN lane
    x[2, 0, :] = np.inf  # all infinite
    x[3, 1, ::3] = -np.inf
    x[4, 0, 0], x[4, 0, 1:] = 0.5, np.nan  # one valid value
    before = x.copy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        expected = {axis: np.nanmedian(x, axis=axis) for axis in (0, 2)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = {axis: nanmedian(x, axis) for axis in (0, 2)}
    for axis in (0, 2):
        np.testing.assert_allclose(got[axis], expected[axis], equal_nan=True)
    assert np.isnan(got[2][1, 2]) and got[2][2, 0] == np.inf and got[2][4, 0] == 0.5
    assert np.array_equal(x, before, equal_nan=True)
