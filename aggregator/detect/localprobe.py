"""Local probes against the pool: a node whose own all-reduce is slower than its peers'.

``nccl_allreduce_local`` measures the node's GPUs and NVLink/NVSwitch together, on an idle node,
as nccl-tests' bus bandwidth; nodes of one pool (one GPU model and count) measure the same within
a percent or two. A GPU running 12 % slow paces every ring the node runs, so its local all-reduce
is slow too, and this shows while the node is idle: the peer detector, which compares clocks
under load, needs a job to see it.

Per pool: each node's recent local results are averaged in log space with recency weights
(``half_life_seconds``); the pool's expected value is the median of the node means, its spread
the MAD of them (floored at ``spread_floor``). A node is slow when its mean is below
``node_ratio`` of the expected value, ``z`` spreads below it, with at least ``min_low_probes``
slow results of its own and a pool of at least ``min_pool_nodes`` measured nodes (fewer cannot
say what normal is). The finding is quarantine evidence (soft: it must persist, as any); it
clears when fresh results are normal again.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, ClassVar

import numpy as np
from msgspec import UNSET, Meta

from agent.report import Report
from aggregator.config import DetectorSettings, PositiveSeconds, Ratio
from aggregator.detect.base import Verdict
from aggregator.fleet.frame import FleetFrames
from aggregator.fleet.pools import Placement
from aggregator.model import Finding

log = logging.getLogger(__name__)

LOCAL_KINDS = frozenset({"nccl_allreduce_local"})
_MAD_SCALE = 1.4826


class LocalProbeConfig(DetectorSettings, frozen=True):
    """``detectors.probe``."""

    name: ClassVar[str] = "probe"
    every_seconds: PositiveSeconds = 60.0
    half_life_seconds: PositiveSeconds = 1800.0
    max_age_seconds: PositiveSeconds = 4 * 3600.0
    max_samples_per_node: Annotated[int, Meta(ge=1)] = 32
    min_pool_nodes: Annotated[int, Meta(ge=2)] = 5
    min_low_probes: Annotated[int, Meta(ge=1)] = 2
    node_ratio: Ratio = 0.95  # nccl-tests' run-to-run spread on one node is about 1 %
    z: Annotated[float, Meta(ge=0)] = 3.0
    spread_floor: Annotated[float, Meta(gt=0)] = 0.01


@dataclass(frozen=True)
class _Sample:
    time: float  # our clock
    log_bw: float


class LocalProbeDetector:
    def __init__(self, config: LocalProbeConfig | None = None) -> None:
        self.config = config or LocalProbeConfig()
        self.every_seconds = self.config.every_seconds
        self._samples: dict[tuple[str, str], deque[_Sample]] = {}  # (node, kind) -> results
        self._placements: dict[str, Placement] = {}
        self._judged: set[str] = set()

    def observe_report(self, report: Report, placement: Placement, received: float) -> None:
        if report.probes:  # a node's placement is learnt from the reports that carry its probes
            self.observe(report, placement, received)

    def observe(self, report: Report, placement: Placement, received: float) -> None:
        self._placements[report.node] = placement
        if report.probes is UNSET:
            return
        offset = received - report.time  # the node's clock to ours
        for p in report.probes:
            if p.kind not in LOCAL_KINDS or not p.ok:
                continue
            bw = p.busbw_bytes_per_second
            if bw is None or not bw > 0:
                continue  # a one-GPU node has no bus bandwidth; a failure is the rules' business
            dq = self._samples.setdefault(
                (report.node, p.kind), deque(maxlen=self.config.max_samples_per_node)
            )
            t = p.time + offset
            if any(abs(s.time - t) < 1.0 for s in dq):
                continue  # the same result again (a redelivered report)
            dq.append(_Sample(t, math.log(bw)))

    def forget(self, node: str) -> None:
        self._placements.pop(node, None)
        for key in [k for k in self._samples if k[0] == node]:
            del self._samples[key]

    def run(self, frames: FleetFrames, now: float) -> Verdict:
        """Findings for every node with local results (an empty list clears), and for nodes that
        had findings before and no longer have results. The pool frames play no part."""
        cfg = self.config
        oldest = now - cfg.max_age_seconds
        groups: dict[tuple[str, str], dict[str, list[_Sample]]] = {}
        for (node, kind), dq in list(self._samples.items()):
            while dq and dq[0].time < oldest:
                dq.popleft()
            if not dq:
                del self._samples[(node, kind)]
                continue
            placement = self._placements.get(node)
            live = [s for s in dq if s.time <= now]
            if placement is None or not live:
                continue
            groups.setdefault((placement.pool, kind), {})[node] = live
        out: dict[str, list[Finding]] = {}
        for (pool, kind), nodes in sorted(groups.items()):
            for node in nodes:
                out.setdefault(node, [])
            if len(nodes) < cfg.min_pool_nodes:
                continue
            self._judge_pool(pool, kind, nodes, now, out)
        for node in self._judged - out.keys():
            out[node] = []
        self._judged = {n for n, fs in out.items() if fs}
        return Verdict(nodes=out)

    def _judge_pool(
        self,
        pool: str,
        kind: str,
        nodes: Mapping[str, list[_Sample]],
        now: float,
        out: dict[str, list[Finding]],
    ) -> None:
        cfg = self.config
        names = sorted(nodes)
        means = np.empty(len(names))
        for i, n in enumerate(names):
            t = np.array([s.time for s in nodes[n]])
            w = np.power(0.5, (now - t) / cfg.half_life_seconds)
            means[i] = float(np.dot(w, [s.log_bw for s in nodes[n]]) / w.sum())
        expected = float(np.median(means))
        spread = max(_MAD_SCALE * float(np.median(np.abs(means - expected))), cfg.spread_floor)
        low = math.log(cfg.node_ratio)
        for i, n in enumerate(names):
            dev = float(means[i]) - expected
            slow = sum(1 for s in nodes[n] if s.log_bw - expected < low)
            if dev < low and dev / spread < -cfg.z and slow >= cfg.min_low_probes:
                ratio = math.exp(dev)
                out[n].append(
                    Finding(
                        detector=LocalProbeConfig.name,
                        key=f"probe-local-slow:{kind}",
                        severity="warning",
                        action="quarantine",
                        summary=(
                            f"local all-reduce {(1 - ratio) * 100:.0f} % under pool {pool}'s "
                            f"({math.exp(means[i]) / 1e9:.0f} vs {math.exp(expected) / 1e9:.0f} GB/s busbw) "
                            f"in {slow} of {len(nodes[n])} recent probes: a slow GPU or NVLink"
                        ),
                        since=now,
                        evidence={
                            "pool": pool,
                            "kind": kind,
                            "ratio": round(ratio, 3),
                            "busbw_bytes_per_second": round(math.exp(means[i])),
                            "pool_busbw_bytes_per_second": round(math.exp(expected)),
                            "z": round(dev / spread, 1),
                            "slow_probes": slow,
                            "probes": len(nodes[n]),
                            "pool_nodes": len(names),
                        },
                    )
                )
