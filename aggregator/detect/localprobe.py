"""Local probes against the pool: a node whose own all-reduce is slower than its peers'.

``nccl_allreduce_local`` measures the node's GPUs and NVLink/NVSwitch together, on an idle node,
as nccl-tests' bus bandwidth; nodes of one pool (one GPU model and count) measure the same within
a percent or two. A GPU running 12 % slow paces every ring the node runs, so its local all-reduce
is slow too, and this shows while the node is idle: the peer detector, which compares clocks
under load, needs a job to see it.

Per pool: the expected value is the median of the nodes' recency-weighted mean log results. Each
node's results since its most likely change point (among its newest ``max_change_points``) are
one Gaussian observation of its offset from the pool, whose variance is the pool's own node-to-node
spread plus its run-to-run noise over the number of results (both robust MADs of the pool's
results, shrunk toward ``noise_prior`` while they are few). Their log-likelihood ratio of "slow by
the design effect" (``design_ratio``) over "normal" must reach ``threshold_nats``; each result adds
at most half of it, so one result never decides. A node's persistent offset does not add up as
results come in: the spread between healthy nodes stays in the variance however many there are.
A pool needs ``min_pool_nodes`` measured nodes (fewer cannot say what normal is). The finding is
quarantine evidence (soft: it must persist, as any); it clears when fresh results are normal.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Mapping
from typing import Annotated, ClassVar

import msgspec
import numpy as np
import numpy.typing as npt
from msgspec import UNSET, Meta

from agent.report import Report
from aggregator.config import DetectorSettings, PositiveSeconds, Ratio
from aggregator.detect.base import Verdict
from aggregator.detect.links import MAD_MIN, MAD_SCALE
from aggregator.fleet.frame import FleetFrames
from aggregator.fleet.pools import Placement
from aggregator.model import Finding

log = logging.getLogger(__name__)

LOCAL_KINDS = frozenset({"nccl_allreduce_local"})


class LocalProbeConfig(DetectorSettings, frozen=True):
    """``detectors.probe``."""

    name: ClassVar[str] = "probe"
    every_seconds: PositiveSeconds = 60.0
    half_life_seconds: PositiveSeconds = 1800.0
    max_age_seconds: PositiveSeconds = 4 * 3600.0
    max_samples_per_node: Annotated[int, Meta(ge=1)] = 32
    min_pool_nodes: Annotated[int, Meta(ge=2)] = 5
    # The smallest slowdown of the node's all-reduce we are asked to call a fault: a GPU 10 % slow
    # under load paces every ring of the node, about 8 % of bus bandwidth (bandwidth-bound steps
    # slow less than the clock). Larger slowdowns cross on fewer results, smaller ones later or never.
    design_ratio: Ratio = 0.92
    threshold_nats: Annotated[float, Meta(gt=0)] = 18.0  # as the link localizer's: docs/detection.md
    # Shrinkage prior of both spreads (weight: that many results or nodes). Not a floor: it fades
    # with data. 2 %: "nodes of one pool measure the same within a percent or two", wider than
    # either generator's node and run-to-run spread (0.8 % each).
    noise_prior: Annotated[float, Meta(gt=0)] = 0.02
    noise_prior_weight: Annotated[float, Meta(ge=0)] = 5.0
    max_change_points: Annotated[int, Meta(ge=1)] = 16


class _Sample(msgspec.Struct, frozen=True, gc=False):
    """One result: two floats, in a struct the cycle collector does not track (a dataclass
    instance, or a named tuple, stays tracked: one object per result kept)."""

    time: float  # our clock
    log_bw: float


class LocalProbeDetector:
    def __init__(self, config: LocalProbeConfig | None = None) -> None:
        self.config = config or LocalProbeConfig()
        self.every_seconds = self.config.every_seconds
        self._samples: dict[tuple[str, str], deque[_Sample]] = {}  # (node, kind) -> results
        self._placements: dict[str, Placement] = {}
        self._judged: set[str] = set()

    def observe_report(self, report: Report, placement: Placement, measured: float) -> None:
        if report.probes:  # a node's placement is learnt from the reports that carry its probes
            self.observe(report, placement, measured)

    def observe(self, report: Report, placement: Placement, measured: float) -> None:
        self._placements[report.node] = placement
        if report.probes is UNSET:
            return
        offset = measured - report.time  # the node's clock to ours (a backlog does not enter it)
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
        prior, n0 = cfg.noise_prior**2, cfg.noise_prior_weight
        within: list[float] = []
        for n in names:
            logs = np.array([x.log_bw for x in nodes[n]])
            k = len(logs)
            if k >= 2:  # deviations from a mean of k are narrower than the noise by sqrt((k-1)/k)
                within.extend(((logs - logs.mean()) * math.sqrt(k / (k - 1))).tolist())
        result_var = _shrunk(np.array(within), prior, n0)
        node_var = _shrunk(means, prior, n0)
        d = -math.log(cfg.design_ratio)
        cap = cfg.threshold_nats / 2
        slow_line = -d / 2  # halfway to the design effect: one result as likely slow as normal
        for n in names:
            devs = [x.log_bw - expected for x in sorted(nodes[n], key=lambda x: x.time)]
            llr, dev, k = -math.inf, 0.0, 0
            for s0 in range(max(0, len(devs) - cfg.max_change_points), len(devs)):
                tail = devs[s0:]
                mean = sum(tail) / len(tail)
                var = node_var + result_var / len(tail)
                value = min(len(tail) * cap, d * (-mean - d / 2) / var)
                if value > llr:
                    llr, dev, k = value, mean, len(tail)
            slow = sum(1 for x in devs[len(devs) - k :] if x < slow_line)
            if llr >= cfg.threshold_nats:
                ratio = math.exp(dev)
                out[n].append(
                    Finding(
                        detector=LocalProbeConfig.name,
                        key=f"probe-local-slow:{kind}",
                        severity="warning",
                        action="quarantine",
                        decided=True,  # the likelihood ratio crossed threshold_nats
                        summary=(
                            f"local all-reduce {(1 - ratio) * 100:.0f} % under pool {pool}'s "
                            f"({math.exp(expected + dev) / 1e9:.0f} vs {math.exp(expected) / 1e9:.0f} GB/s "
                            f"busbw) in {slow} of {k} recent probes ({llr:.0f} nats of evidence): "
                            "a slow GPU or NVLink"
                        ),
                        since=now,
                        evidence={
                            "pool": pool,
                            "kind": kind,
                            "ratio": round(ratio, 3),
                            "busbw_bytes_per_second": round(math.exp(expected + dev)),
                            "pool_busbw_bytes_per_second": round(math.exp(expected)),
                            "llr_nats": round(llr, 1),
                            "threshold_nats": cfg.threshold_nats,
                            "noise": round(math.sqrt(result_var), 4),
                            "node_spread": round(math.sqrt(node_var), 4),
                            "slow_probes": slow,
                            "probes": k,
                            "pool_nodes": len(names),
                        },
                    )
                )


def _shrunk(values: npt.NDArray[np.float64], prior: float, weight: float) -> float:
    """The robust variance (MAD) of ``values`` about their median, shrunk toward ``prior``."""
    n = len(values)
    if n < MAD_MIN:
        return prior
    mad = MAD_SCALE * float(np.median(np.abs(values - np.median(values))))
    return (n * mad**2 + weight * prior) / (n + weight)
