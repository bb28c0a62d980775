"""LocalProbeDetector: a node whose local all-reduce is slower than its pool's."""

from __future__ import annotations

import random

import pytest

from agent.report import SCHEMA_ID, Probe, Report
from aggregator.config import FleetConfig
from aggregator.detect.localprobe import LocalProbeDetector
from aggregator.fleet.frame import FleetFrames
from aggregator.fleet.pools import Placement

T0 = 1_764_000_000.0
FRAMES = FleetFrames(FleetConfig())  # the detector reads probes, not the pool frames
BW = 480e9  # 8 H100 with NVSwitch, nccl-tests all_reduce_perf busbw
POOL = Placement("h100", rack="r0", leaf="l0")


def report(node: str, t: float, probes: list[Probe]) -> Report:
    return Report(
        schema=SCHEMA_ID, node=node, time=t, seq=int(t), boot_id="b", gpus=[], nics=[], probes=probes
    )


def feed(
    det: LocalProbeDetector,
    factor: dict[str, float],
    *,
    nodes: int = 32,
    rounds: int = 4,
    every: float = 300.0,
    seed: int = 0,
    noise: float = 0.015,
    start: float = T0,
) -> float:
    """Every node runs a local probe once per round, at a random moment in it."""
    rng = random.Random(seed)
    t = start
    for k in range(rounds):
        for i in range(nodes):
            node = f"gpu-{i:04d}"
            t = start + k * every + rng.uniform(0, every)
            bw = BW * factor.get(node, 1.0) * rng.gauss(1.0, noise)
            p = Probe(kind="nccl_allreduce_local", time=t, ok=True, busbw_bytes_per_second=bw)
            det.observe(report(node, t, [p]), POOL, received=t + 1)
    return start + rounds * every


def flagged(out: dict[str, list[object]]) -> set[str]:
    return {n for n, fs in out.items() if fs}


@pytest.mark.parametrize("seed", range(6))
def test_a_healthy_noisy_pool_stays_quiet(seed: int) -> None:
    det = LocalProbeDetector()
    end = feed(det, {}, rounds=6, seed=seed, noise=0.02)
    assert flagged(det.run(FRAMES, end).nodes) == set()


def test_a_node_with_a_slow_gpu_is_found_with_its_evidence() -> None:
    # A GPU at 0.88 of its clock paces the ring: the node's all-reduce runs about 9 % slow.
    det = LocalProbeDetector()
    end = feed(det, {"gpu-0007": 0.91})
    out = det.run(FRAMES, end).nodes
    assert flagged(out) == {"gpu-0007"}
    [f] = out["gpu-0007"]
    assert f.detector == "probe" and f.action == "quarantine" and not f.hard
    assert 0.88 < f.evidence["ratio"] < 0.94
    assert f.evidence["slow_probes"] >= 2 and f.evidence["pool_nodes"] == 32
    assert f.summary.startswith("local all-reduce ") and "under pool h100" in f.summary


def test_one_slow_result_is_not_enough() -> None:
    det = LocalProbeDetector()
    end = feed(det, {}, rounds=3)
    p = Probe(kind="nccl_allreduce_local", time=end, ok=True, busbw_bytes_per_second=BW * 0.8)
    det.observe(report("gpu-0003", end, [p]), POOL, received=end)
    assert flagged(det.run(FRAMES, end + 1).nodes) == set()


def test_a_small_pool_cannot_say_what_normal_is() -> None:
    det = LocalProbeDetector()
    end = feed(det, {"gpu-0001": 0.8}, nodes=4)
    assert flagged(det.run(FRAMES, end).nodes) == set()


def test_a_repaired_node_is_cleared_once_its_fresh_results_are_normal() -> None:
    det = LocalProbeDetector()
    end = feed(det, {"gpu-0007": 0.85}, rounds=3)
    assert flagged(det.run(FRAMES, end).nodes) == {"gpu-0007"}
    # Repaired: the old results age out of weight (half-life 30 min) and fast ones come in.
    later = feed(det, {}, rounds=8, start=end + 3 * 3600.0, seed=1)
    out = det.run(FRAMES, later).nodes
    assert out["gpu-0007"] == []


def test_failed_and_single_gpu_results_are_not_bandwidth() -> None:
    det = LocalProbeDetector()
    end = feed(det, {}, rounds=3)
    bad = [
        Probe(kind="nccl_allreduce_local", time=end, ok=False, error="stepped aside: a job started"),
        Probe(kind="nccl_allreduce_local", time=end + 1, ok=True, busbw_bytes_per_second=None),
    ]
    det.observe(report("gpu-0002", end, bad), POOL, received=end)
    assert flagged(det.run(FRAMES, end + 2).nodes) == set()
