"""Detection quality: gpuwarden against a static-threshold baseline, over seeds and magnitudes.

Run from the repository root (about 3 minutes on 2 cores; no network; traces live in a temporary
directory)::

    .venv/bin/python bench/detection.py [SCENARIO ...] [--seeds 5] [--jobs 2]
        [--sweep slow_gpu.ratio=0.92,0.88,0.80] [--sweep-seeds 3] [--json FILE]
        [--drop 0.1] [--strip-labels]

What it does, for every scenario (default ``scenarios/fleet64.yaml``; ``othergen`` for traces of
``bench/othergen.py``, the second generator) and seed 1..``--seeds``:
``sim.cli.write_trace`` writes the trace and the truth, ``aggregator.replay.replay`` runs the
live pipeline over it with the default configuration and shipped rules, and ``sim.eval`` scores
the decisions and the baseline (critical XIDs, DBE, remap failure, >= 85 C, IB port down) on the
same trace. ``--sweep KIND.PARAM=V1,V2,...`` then reruns the first scenario on ``--sweep-seeds``
seeds with that parameter of every fault of that kind set to each value (repeatable; ``--sweep
none`` turns the default sweep off). Robustness runs perturb every trace before replay:
``--drop F`` loses a share F of its reports for good (on top of the generator's own loss),
``--strip-labels`` removes every report's labels (pools then come from the GPU model, and there
are no racks or leaves). The truth is left as generated, so a fault whose first showing report
was dropped is timed from that report all the same.

Markdown goes to stdout, progress to stderr: per fault class recall and time to detect (pooled over
seeds) for both systems, the issue's targets one by one, false quarantines by cause, link
attribution, one row per fault kind (which seeds miss it, and its slowest detection), and the
sweep. ``--json FILE`` writes every fault's outcome on every run. Not a test: nothing here fails
a build; the published table is in docs/detection.md ("Results").
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import logging
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import msgspec
import othergen  # bench/othergen.py, beside this script
from _common import cpuinfo_model

from agent.errors import ConfigError
from agent.report import CLOCK_EVENT_BITS
from aggregator.config import Config
from aggregator.detect.jobs import JobConfig, comm_hops
from aggregator.detect.links import DECIDING_RESULTS, PAIR_KINDS, LinkConfig
from aggregator.replay import replay
from aggregator.rules.model import default_rules_dir, load_rules
from sim import eval as sim_eval
from sim import scenario as scenario_mod
from sim.cli import write_trace
from sim.truth import Truth, TruthFault

log = logging.getLogger("bench.detection")

DEFAULT_SCENARIO: Final = Path("scenarios/fleet64.yaml")
# In place of a scenario file: traces from bench/othergen.py, a second generator written apart from
# sim/ (its own job model, prober and fault magnitudes), so the detectors meet data they were not
# tuned on.
OTHERGEN: Final = "othergen"
DEFAULT_SWEEP: Final = "slow_gpu.ratio=0.92,0.88,0.80"
# The targets (issue 4, "Targets").
HARD_WITHIN_S: Final = 30.0
SOFT_WITHIN_S: Final = 600.0
SOFT_RECALL: Final = 0.85
LINK_WITHIN_S: Final = 600.0
WITHIN_S: Final = {"hard": HARD_WITHIN_S, "soft": SOFT_WITHIN_S, "link": LINK_WITHIN_S}
MAX_FALSE_QUARANTINES: Final = 1
CLASS_ORDER: Final = ("hard", "soft", "link", "silent")


@dataclass(frozen=True)
class Perturb:
    """What is done to every trace after it is generated, before replay (robustness runs)."""

    drop: float = 0.0  # this share of reports never arrives (on top of the generator's own loss)
    strip_labels: bool = False  # no pool/rack/leaf labels: pools from the GPU model, no domains

    def __bool__(self) -> bool:
        return self.drop > 0 or self.strip_labels


@dataclass(frozen=True)
class Cell:
    """One cell of the robustness matrix: the generators' knobs (sim.scenario.vary, othergen.Knobs)."""

    name: str
    noise: float = 1.0
    job_median_s: float = 600.0
    busy_share: float = 0.60
    loss: float = 0.01
    faults_at_start: bool = True
    low_magnitudes: bool = True

    def scenario(self, s: scenario_mod.Scenario) -> scenario_mod.Scenario:
        return scenario_mod.vary(
            s,
            noise=self.noise,
            job_median_s=self.job_median_s,
            busy_share=self.busy_share,
            lost_fraction=self.loss,
            faults_at_start=self.faults_at_start,
            low_magnitudes=self.low_magnitudes,
        )

    def knobs(self) -> othergen.Knobs:
        return othergen.Knobs(
            noise=self.noise,
            job_median_s=self.job_median_s,
            busy_share=self.busy_share,
            loss=self.loss,
            faults_at_start=self.faults_at_start,
            low_magnitudes=self.low_magnitudes,
        )


# The matrix: one factor at a time around the baseline (the independent traces' setting: jobs
# turning over every 10 minutes, 60 % of nodes busy, 1 % of reports lost; faults from the first
# report at the low end of their magnitudes), each factor over its other levels.
MATRIX_BASELINE: Final = Cell("baseline")
MATRIX_CELLS: Final = (
    MATRIX_BASELINE,
    replace(MATRIX_BASELINE, name="noise x2", noise=2.0),
    replace(MATRIX_BASELINE, name="noise x3", noise=3.0),
    replace(MATRIX_BASELINE, name="jobs 5 min", job_median_s=300.0),
    replace(MATRIX_BASELINE, name="jobs 30 min", job_median_s=1800.0),
    replace(MATRIX_BASELINE, name="busy 30 %", busy_share=0.30),
    replace(MATRIX_BASELINE, name="busy 95 %", busy_share=0.95),
    replace(MATRIX_BASELINE, name="loss 5 %", loss=0.05),
    replace(MATRIX_BASELINE, name="loss 10 %", loss=0.10),
)
# Faults start at the first report, so 20 minutes give each its 10-minute window with room for a
# first showing that needs a probe or a job to come first.
MATRIX_MINUTES: Final = 20.0
# A fault is visible for its window when the evidence (``_evidence``) is in at least this share of
# the window's report slots: 10 % of reports may be lost, and a little more of a load-only fault's
# window may fall in a checkpoint or a job change.
VISIBLE_SHARE: Final = 0.8
# A slow NIC shows only in pair probes; telling it from one bad link needs probes with two peers.
VISIBLE_NIC_PEERS: Final = 2
# Job data shows a link when rows of communicators crossing it cover the jobs detector's window and
# its consecutive runs (a blame must hold in ``confirm_runs`` runs, ``every_seconds`` apart).
JOB_SPAN_S: Final = JobConfig().window_seconds + (JobConfig().confirm_runs - 1) * JobConfig().every_seconds
LOADED_UTILIZATION: Final = 0.5  # a GPU at or above this is under load
_THERMAL_BITS: Final = CLOCK_EVENT_BITS["sw_thermal_slowdown"] | CLOCK_EVENT_BITS["hw_thermal_slowdown"]
_BRAKE_BIT: Final = CLOCK_EVENT_BITS["hw_power_brake_slowdown"]
_IDLE_BIT: Final = CLOCK_EVENT_BITS["gpu_idle"]


@dataclass(frozen=True)
class Job:
    scenario: str  # path
    seed: int
    sweep: tuple[str, str, float] | None  # (kind, parameter, value)
    perturb: Perturb = Perturb()
    cell: Cell | None = None  # a robustness-matrix cell
    minutes: float | None = None  # the trace's length (None: the scenario's own, othergen's 30)
    nodes: int | None = None  # othergen only (None: 64)


def perturb_trace(path: Path, perturb: Perturb, seed: int) -> int:
    """Rewrite the gzip trace at ``path`` with ``perturb`` applied; the number of reports left.

    Dropping is drawn per line from its own seeded stream, so the same seed drops the same
    reports. A dropped report is lost for good, as if the agent's retries had all failed: the
    truth still counts what only that report showed.
    """
    rng = random.Random(f"gpuwarden-bench-drop:{seed}")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        lines = f.readlines()
    kept: list[str] = []
    for line in lines:
        if rng.random() < perturb.drop:
            continue
        if perturb.strip_labels:
            report = json.loads(line)
            report.pop("labels", None)
            kept.append(json.dumps(report, separators=(",", ":")) + "\n")
        else:
            kept.append(line)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(kept)
    return len(kept)


def _label(job: Job) -> str:
    base = f"{Path(job.scenario).stem} seed {job.seed}"
    if job.cell is not None:
        return f"{base} [{job.cell.name}]"
    return base if job.sweep is None else f"{base} {job.sweep[0]}.{job.sweep[1]}={job.sweep[2]:g}"


def _evidence(f: TruthFault, report: dict[str, Any]) -> bool:
    """Whether this report of the fault's node carries what a detector needs to see the fault.

    Load-only kinds need their GPU under load (``slow_gpu``: no reason bit, only a slow clock while
    loaded) or the reason bit the hardware raises (``thermal``, ``power_brake``); a downtrained
    PCIe link shows as a width below the maximum, or a generation below it while the GPU is not
    idle (an idle link trains down on healthy GPUs too); NVLink CRC and symbol errors show in
    every report (their counters, whether or not they moved in that interval).
    """
    gpus = report.get("gpus") or []
    mine = [g for g in gpus if g.get("index") == f.gpu]
    if f.kind == "slow_gpu":
        return any((g.get("utilization_ratio") or 0.0) >= LOADED_UTILIZATION for g in mine)
    if f.kind == "thermal":
        return any(int(g.get("clock_event_reasons") or 0) & _THERMAL_BITS for g in mine)
    if f.kind == "power_brake":
        return any(int(g.get("clock_event_reasons") or 0) & _BRAKE_BIT for g in gpus)
    if f.kind == "pcie_downtrain":
        return any(
            g["pcie_link_width"] < g["pcie_link_width_max"]
            or (g["pcie_link_gen"] < g["pcie_link_gen_max"] and not int(g["clock_event_reasons"]) & _IDLE_BIT)
            for g in mine
        )
    return True


def visibility(trace: Path, truth: Truth, window_s: float = SOFT_WITHIN_S) -> tuple[dict[int, bool], float]:
    """Per soft and link fault (by its index in ``truth.faults``) whether the trace showed it for
    its whole window after it first showed; and the share of reports whose GPUs are, on average,
    loaded.

    A fault is visible when the window ``first_seen .. first_seen + window_s`` lies within the
    trace and either (``slow_nic``) the node's reports carry successful pair probes with at least
    ``VISIBLE_NIC_PEERS`` distinct peers in it, or (a degraded link) ``_LinkSeen.visible`` holds, or
    (every other kind) at least ``VISIBLE_SHARE`` of the window's report slots (window / the
    node's interval) carry the evidence (``_evidence``). A report delivered twice counts once.
    """
    judged = {
        i: f
        for i, f in enumerate(truth.faults)
        if f.fault_class in ("soft", "link") and f.first_seen is not None
    }
    by_node: dict[str, list[int]] = defaultdict(list)
    for i, f in judged.items():
        by_node[f.node].append(i)
        if f.fault_class == "link" and f.peer is not None:
            by_node[f.peer].append(i)
    links = {
        i: _LinkSeen(f, _healthy_partner(truth, f)) for i, f in judged.items() if f.fault_class == "link"
    }
    slots: dict[int, int] = dict.fromkeys(judged, 0)
    peers: dict[int, set[str]] = {i: set() for i in judged}
    interval: dict[int, float] = {}
    seen: set[tuple[str, str, int]] = set()
    loaded = total = 0
    decoder = msgspec.json.Decoder()
    with gzip.open(trace, "rb") as fh:
        for line in fh:
            r = decoder.decode(line)
            total += 1
            gpus = r.get("gpus") or []
            if (
                gpus
                and statistics.fmean(g.get("utilization_ratio") or 0.0 for g in gpus) >= LOADED_UTILIZATION
            ):
                loaded += 1
            key = (r["node"], r.get("boot_id", ""), r["seq"])
            if key in seen:
                continue
            seen.add(key)
            for seen_link in links.values():
                seen_link.members(r)  # a ring's order needs every rank's node, not only the ends'
            for i in by_node.get(r["node"], ()):
                f = judged[i]
                assert f.first_seen is not None
                if i in links:
                    links[i].report(r, window_s)
                    continue
                if not f.first_seen <= r["time"] < f.first_seen + window_s:
                    continue
                interval[i] = float(r["interval_seconds"])
                if f.kind == "slow_nic":
                    peers[i] |= {
                        p["peer"]
                        for p in r.get("probes") or []
                        if p.get("kind") == "nccl_allreduce_pair" and p.get("ok") and p.get("peer")
                    }
                elif _evidence(f, r):
                    slots[i] += 1
    out: dict[int, bool] = {}
    for i, f in judged.items():
        assert f.first_seen is not None
        if f.first_seen + window_s > truth.end + 1.0:
            out[i] = False
        elif i in links:
            out[i] = links[i].visible()
        elif i not in interval:
            out[i] = False
        elif f.kind == "slow_nic":
            out[i] = len(peers[i]) >= VISIBLE_NIC_PEERS
        else:
            out[i] = slots[i] >= VISIBLE_SHARE * window_s / interval[i]
    return out, (loaded / total if total else 0.0)


def _healthy_partner(truth: Truth, link: TruthFault) -> Callable[[str], bool]:
    """Whether a node can vouch for a link's end: no fault of the truth (but this link) is on it.
    A partner with a slow NIC of its own is slow with the end too, and then the end looks slow
    with everyone: one slow node, not a link (the parsimonious reading the localizer takes)."""
    faulty = {
        n
        for f in truth.faults
        if f is not link and f.fault_class in ("hard", "soft", "link")
        for n in (f.node, f.peer)
        if n is not None
    }
    return lambda n: n not in faulty


@dataclass
class _LinkSeen:
    """What one degraded link's window carried (``visibility``): the measurements over the pair,
    and whether each end was measured with someone else, by pair probes and by job data.

    A link is visible when its pair was measured ``DECIDING_RESULTS`` times in the window by pair
    probes (the localizer's fewest: one result never decides), or job data of communicators whose
    ring crosses the hop (``comm_hops``) covers ``JOB_SPAN_S`` of it (the jobs detector's window
    and its consecutive runs); and, from the same source, each end was measured with a partner no
    fault is on (pair probes since the fault began; job data of an inter-node communicator that
    does not cross the hop), since a slow pair with an end shown normal nowhere else is a slow end
    as much as a slow link. Probe results are both ends' copies of one measurement: results of
    one pair within the localizer's ``dedupe_seconds`` are one.
    """

    fault: TruthFault
    vouches: Callable[[str], bool]
    probe_times: list[float] = field(default_factory=list)
    probe_partners: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    ranks: dict[str, dict[int, str]] = field(
        default_factory=lambda: defaultdict(dict)
    )  # comm -> rank -> node
    kinds: dict[str, str] = field(default_factory=dict)  # comm -> collective
    rows: list[tuple[float, str, str]] = field(default_factory=list)  # (time, end, comm) in the window

    def _in_window(self, t: float, window_s: float, since: float | None = None) -> bool:
        assert self.fault.first_seen is not None
        start = self.fault.first_seen if since is None else since
        return start <= t < self.fault.first_seen + window_s

    def members(self, r: dict[str, Any]) -> None:
        jobs = r.get("jobs") or {}
        for c in jobs.get("collectives") or []:
            if c.get("nnodes", 1) >= 2 and c.get("rank") is not None:
                self.ranks[c["comm"]][int(c["rank"])] = r["node"]
                self.kinds[c["comm"]] = c["collective"]

    def report(self, r: dict[str, Any], window_s: float) -> None:
        f, node = self.fault, r["node"]
        other = f.peer if node == f.node else f.node
        if self._in_window(r["time"], window_s, since=min(f.start, f.first_seen or f.start)):
            for p in r.get("probes") or []:
                if p.get("kind") not in PAIR_KINDS or not p.get("ok") or not p.get("peer"):
                    continue
                if p["peer"] == other:
                    if self._in_window(r["time"], window_s):
                        self.probe_times.append(float(p["time"]))
                elif self.vouches(p["peer"]):
                    self.probe_partners[node].add(p["peer"])
        if self._in_window(r["time"], window_s):
            jobs = r.get("jobs") or {}
            for c in jobs.get("collectives") or []:
                if c.get("nnodes", 1) >= 2 and c.get("rank") is not None:
                    self.rows.append((float(r["time"]), node, c["comm"]))

    def visible(self) -> bool:
        f = self.fault
        ends = (f.node, f.peer)
        results = 0
        last = -math.inf
        for t in sorted(self.probe_times):
            if t - last > LinkConfig().dedupe_seconds:
                results += 1
                last = t
        if results >= DECIDING_RESULTS and all(self.probe_partners.get(e) for e in ends if e is not None):
            return True
        hop = (min(f.node, f.peer or ""), max(f.node, f.peer or ""))
        crossing: list[float] = []
        elsewhere: dict[str, bool] = {}
        rings: dict[str, tuple[list[str], tuple[tuple[str, str], ...]]] = {}
        for comm in {c for _, _, c in self.rows}:
            nodes = [self.ranks[comm][k] for k in sorted(self.ranks[comm])]
            rings[comm] = (nodes, comm_hops(self.kinds[comm], nodes))
        for t, end, comm in self.rows:
            nodes, hops = rings[comm]
            if hop in hops:
                crossing.append(t)
            elif hops and all(self.vouches(n) for n in set(nodes) - set(ends)):
                elsewhere[end] = True
        return (
            bool(crossing)
            and max(crossing) - min(crossing) >= JOB_SPAN_S
            and all(elsewhere.get(e, False) for e in ends if e is not None)
        )


def _with_sweep(s: scenario_mod.Scenario, sweep: tuple[str, str, float] | None) -> scenario_mod.Scenario:
    if sweep is None:
        return s
    kind, param, value = sweep
    faults = tuple(replace(f, params={**f.params, param: value}) if f.kind == kind else f for f in s.faults)
    s = replace(s, faults=faults)
    s.validate()
    return s


def _fault_outcome(
    f: TruthFault, mine: list[sim_eval.Decision], base: list[sim_eval.Decision], end: float
) -> dict[str, Any]:
    # The evaluator's own matching rule, so the per-fault rows agree with its class totals.
    at = sim_eval._catch_time(f, mine)
    at_base = sim_eval._catch_time(f, base)
    return {
        "id": f.id,
        "kind": f.kind,
        "class": f.fault_class,
        "node": f.node,
        "peer": f.peer,
        "start": f.start,
        "first_seen": f.first_seen,
        "caught_at": at,
        "ttd_s": None if at is None else sim_eval._ttd(f, at),
        "baseline_ttd_s": None if at_base is None else sim_eval._ttd(f, at_base),
        # How long the trace ran after the fault first showed (None: it never showed).
        "shown_for_s": None if f.first_seen is None else round(end - f.first_seen, 1),
    }


def _false_quarantines(truth: Truth, ds: list[sim_eval.Decision]) -> list[dict[str, Any]]:
    out = []
    for d in ds:
        if d.subject != "node" or d.state != "quarantined":
            continue
        mine = [f for f in truth.faults if d.node in (f.node, f.peer)]
        real = [f for f in mine if f.fault_class in sim_eval.NODE_CLASSES and f.node == d.node]
        if any(sim_eval.began(f) <= d.time for f in real):
            continue
        cause = sim_eval._false_cause(d.node, mine, real)
        out.append(
            {"node": d.node, "at_s": d.time - truth.start, "cause": cause, "detectors": sorted(d.detectors)}
        )
    return out


def run_job(job: Job) -> dict[str, Any]:
    """Simulate, replay and score one (scenario, seed, sweep point); runs in a worker process."""
    # The pipeline logs every decision and systemic event; the table is the output here.
    logging.getLogger().setLevel(logging.ERROR)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpuwarden-detection-") as tmp:
        trace = Path(tmp) / "trace.jsonl.gz"
        decisions_path = Path(tmp) / "decisions.jsonl"
        if job.scenario == OTHERGEN:
            kw: dict[str, Any] = {} if job.cell is None else {"knobs": job.cell.knobs()}
            if job.minutes is not None:
                kw["minutes"] = job.minutes
            if job.nodes is not None:
                kw["nodes"] = job.nodes
            truth = othergen.write(job.seed, trace, Path(tmp) / "truth.json", **kw)
            with gzip.open(trace, "rt", encoding="utf-8") as fh:
                reports = sum(1 for _ in fh)
        else:
            s = scenario_mod.load(Path(job.scenario)).with_overrides(
                seed=job.seed, nodes=None, minutes=job.minutes
            )
            if job.cell is not None:
                s = job.cell.scenario(s)
            reports, truth = write_trace(_with_sweep(s, job.sweep), trace)
        if job.perturb:
            reports = perturb_trace(trace, job.perturb, job.seed)
        config = Config()
        rules = load_rules([Path(config.rules_dir) if config.rules_dir else default_rules_dir()])
        # The defaults at the trace's own interval, as `gpuwarden replay` with no --config does
        # (scenarios/small.yaml reports every 30 s).
        replay(trace, decisions_path, config, rules, trace_interval=True)
        mine = sorted(sim_eval.load_decisions(decisions_path), key=lambda d: d.time)
        base = sorted(sim_eval.baseline(trace), key=lambda d: d.time)
        visible, loaded = visibility(trace, truth) if job.cell is not None else ({}, None)
    faults = []
    for i, f in enumerate(truth.faults):
        if f.fault_class == "lookalike":
            continue
        outcome = _fault_outcome(f, mine, base, truth.end)
        if job.cell is not None and f.fault_class in ("soft", "link"):
            outcome["visible"] = visible.get(i, False)
        faults.append(outcome)
    return {
        "scenario": job.scenario,
        "seed": job.seed,
        "sweep": None
        if job.sweep is None
        else {"kind": job.sweep[0], "param": job.sweep[1], "value": job.sweep[2]},
        "reports": reports,
        "perturb": {"drop": job.perturb.drop, "strip_labels": job.perturb.strip_labels}
        if job.perturb
        else None,
        "seconds": round(time.perf_counter() - started, 1),
        "gpuwarden": sim_eval.score(truth, mine),
        "baseline": sim_eval.score(truth, base),
        "cell": None if job.cell is None else dataclasses.asdict(job.cell),
        "loaded_share": loaded,
        "faults": faults,
        "false_quarantines": _false_quarantines(truth, mine),
        "links_degraded": [
            {"node": d.node, "peer": d.peer, "at_s": d.time - truth.start}
            for d in mine
            if d.subject == "link" and d.state == "degraded"
        ],
    }


# ---------------------------------------------------------------------------------------------
# Tables


def _pct(n: int, d: int) -> str:
    return f"{n}/{d} ({100 * n / d:.0f}%)" if d else "-"


def _secs(values: list[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return f"{statistics.median(ordered):.0f} / {p90:.0f} s"


def _class_rows(runs: list[dict[str, Any]]) -> list[str]:
    rows = [
        "| class | faults | gpuwarden recall | gpuwarden TTD median / p90 "
        "| baseline recall | baseline TTD median / p90 |",
        "|---|---|---|---|---|---|",
    ]
    for cls in CLASS_ORDER:
        faults = [f for r in runs for f in r["faults"] if f["class"] == cls]
        mine = [f["ttd_s"] for f in faults if f["ttd_s"] is not None]
        base = [f["baseline_ttd_s"] for f in faults if f["baseline_ttd_s"] is not None]
        rows.append(
            f"| {cls} | {len(faults)} | {_pct(len(mine), len(faults))} | {_secs(mine)} | "
            f"{_pct(len(base), len(faults))} | {_secs(base)} |"
        )
    return rows


def _in_time(f: dict[str, Any]) -> bool:
    return f["ttd_s"] is not None and f["ttd_s"] <= WITHIN_S[f["class"]]


def observable(f: dict[str, Any]) -> bool:
    """Whether the trace gave a detector the fault's whole target window to catch it in.

    A fault no report shows (a degraded link whose ends are never idle together, a load-only
    fault on a node that never runs a job) cannot be caught by any detector; one first shown
    less than its window before the trace ends is cut short. A fault caught in time counts as
    observable whatever its window: the trace showed enough of it.
    """
    if _in_time(f):
        return True
    shown = f.get("shown_for_s")
    return f["first_seen"] is not None and shown is not None and shown >= WITHIN_S[f["class"]]


def _met(r: dict[str, Any], cls: str, faults: list[dict[str, Any]]) -> bool:
    if cls == "soft":
        return not faults or sum(map(_in_time, faults)) / len(faults) >= SOFT_RECALL
    if cls == "link" and any(q["cause"] == "link_end" for q in r["false_quarantines"]):
        return False  # an end was blamed for its link
    return all(map(_in_time, faults))


def _target_cells(runs: list[dict[str, Any]], cls: str) -> tuple[int, int, int]:
    """Runs meeting the class's target; runs whose trace showed a fault of it; of those, meeting it
    on the faults it showed (``observable``)."""
    ok = seen = seen_ok = 0
    for r in runs:
        faults = [f for f in r["faults"] if f["class"] == cls]
        ok += _met(r, cls, faults)
        shown = [f for f in faults if observable(f)]
        if shown:
            seen += 1
            seen_ok += _met(r, cls, shown)
    return ok, seen, seen_ok


def _targets(runs: list[dict[str, Any]]) -> list[str]:
    """The issue's targets, judged per run and counted over runs.

    The last column judges each run on the faults its trace showed for their whole window
    (``observable``); the faults it leaves out are named per seed below.
    """
    n = len(runs)
    fq_ok = 0
    for r in runs:
        fq = r["false_quarantines"]
        bad_cause = any(q["cause"] in ("lookalike", "silent_rack") for q in fq)
        if len(fq) <= MAX_FALSE_QUARANTINES and not bad_cause:
            fq_ok += 1
    cells = {cls: _target_cells(runs, cls) for cls in ("hard", "soft", "link")}

    def row(cls: str) -> str:
        ok, seen, seen_ok = cells[cls]
        return f"{ok}/{n} | {seen_ok}/{seen} |"

    soft_all = [f for r in runs for f in r["faults"] if f["class"] == "soft"]
    soft_in = sum(map(_in_time, soft_all))
    soft_seen = [f for f in soft_all if observable(f)]
    return [
        "| target | runs meeting it | of the runs whose trace showed it |",
        "|---|---|---|",
        f"| every hard fault quarantined within {HARD_WITHIN_S:.0f} s of first showing | {row('hard')}",
        f"| >= {100 * SOFT_RECALL:.0f}% of soft faults quarantined within {SOFT_WITHIN_S / 60:.0f} min "
        f"(pooled: {_pct(soft_in, len(soft_all))}; of those shown: "
        f"{_pct(sum(map(_in_time, soft_seen)), len(soft_seen))}) | {row('soft')}",
        f"| degraded link reported as a link within {LINK_WITHIN_S / 60:.0f} min, neither end quarantined "
        f"| {row('link')}",
        f"| at most {MAX_FALSE_QUARANTINES} false quarantine, none from look-alikes or the silent rack "
        f"| {fq_ok}/{n} | {fq_ok}/{n} |",
    ]


def _quarantine_rows(runs: list[dict[str, Any]]) -> list[str]:
    rows = ["| | gpuwarden | baseline |", "|---|---|---|"]
    for system_rows in ("true/total",):
        cells = []
        for system in ("gpuwarden", "baseline"):
            q = [r[system]["quarantines"] for r in runs]
            cells.append(f"{sum(x['true'] for x in q)}/{sum(x['total'] for x in q)}")
        rows.append(f"| quarantines {system_rows} | " + " | ".join(cells) + " |")
    for cause in sim_eval.FALSE_CAUSES:
        cells = [
            str(sum(r[s]["quarantines"]["false_by_cause"][cause] for r in runs))
            for s in ("gpuwarden", "baseline")
        ]
        rows.append(f"| false: {cause} | " + " | ".join(cells) + " |")
    lk = [r["gpuwarden"]["links"] for r in runs]
    rows.append(
        f"| link decisions true/total | {sum(x['true'] for x in lk)}/{sum(x['degraded'] for x in lk)} | 0/0 |"
    )
    rows.append(
        f"| link attribution (link, no end blamed) | {sum(x['attributed'] for x in lk)}/"
        f"{sum(x['faults'] for x in lk)} | 0/{sum(x['faults'] for x in lk)} |"
    )
    return rows


def _kind_rows(runs: list[dict[str, Any]]) -> list[str]:
    rows = [
        "| kind | class | caught | missed on seeds | TTD median / max | baseline caught |",
        "|---|---|---|---|---|---|",
    ]
    kinds: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for r in runs:
        for f in r["faults"]:
            kinds.setdefault(f["kind"], []).append((r["seed"], f))
    for kind, entries in kinds.items():
        caught = [f["ttd_s"] for _, f in entries if f["ttd_s"] is not None]
        missed = sorted({seed for seed, f in entries if f["ttd_s"] is None})
        ttd = f"{statistics.median(caught):.0f} / {max(caught):.0f} s" if caught else "-"
        base = sum(1 for _, f in entries if f["baseline_ttd_s"] is not None)
        rows.append(
            f"| {kind} | {entries[0][1]['class']} | {len(caught)}/{len(entries)} | "
            f"{', '.join(map(str, missed)) or '-'} | {ttd} | {base}/{len(entries)} |"
        )
    return rows


def _sweep_rows(runs: list[dict[str, Any]]) -> list[str]:
    rows = [
        "| sweep point | faults of that kind caught | TTD median / max | false quarantines "
        "| all soft caught |",
        "|---|---|---|---|---|",
    ]
    points: dict[tuple[str, str, float], list[dict[str, Any]]] = {}
    for r in runs:
        sw = r["sweep"]
        points.setdefault((sw["kind"], sw["param"], sw["value"]), []).append(r)
    for (kind, param, value), rs in points.items():
        fs = [f for r in rs for f in r["faults"] if f["kind"] == kind]
        caught = [f["ttd_s"] for f in fs if f["ttd_s"] is not None]
        ttd = f"{statistics.median(caught):.0f} / {max(caught):.0f} s" if caught else "-"
        fq = sum(len(r["false_quarantines"]) for r in rs)
        soft = [f for r in rs for f in r["faults"] if f["class"] == "soft"]
        soft_caught = sum(1 for f in soft if f["ttd_s"] is not None)
        rows.append(
            f"| {kind}.{param} = {value:g} ({len(rs)} seeds) | {_pct(len(caught), len(fs))} | {ttd} | {fq} | "
            f"{_pct(soft_caught, len(soft))} |"
        )
    return rows


def _why(f: dict[str, Any]) -> str:
    """What the trace allowed: a fault no report ever showed, or one shown too near its end."""
    shown = f.get("shown_for_s")
    if f["first_seen"] is None:
        return ": never shown in the trace"
    target = WITHIN_S.get(f["class"])
    if shown is not None and target is not None and shown < target:
        return f": first shown {shown:.0f} s before the trace ended"
    return ""


def _detail(runs: list[dict[str, Any]]) -> list[str]:
    lines = []
    for r in runs:
        missed = [f"{f['kind']} ({f['node']}{_why(f)})" for f in r["faults"] if f["ttd_s"] is None]
        slow = [
            f"{f['kind']} {f['ttd_s']:.0f} s"
            for f in r["faults"]
            if f["ttd_s"] is not None and f["ttd_s"] > WITHIN_S.get(f["class"], 1e9)
        ]
        fq = [f"{q['node']} ({q['cause']}, {'+'.join(q['detectors'])})" for q in r["false_quarantines"]]
        lines.append(
            f"- seed {r['seed']}: missed {', '.join(missed) or 'none'}; "
            f"over target {', '.join(slow) or 'none'}; false quarantines {', '.join(fq) or 'none'}"
        )
    return lines


def machine() -> str:
    cpu = cpuinfo_model()
    if cpu is None:
        cpu = platform.processor() or "unknown CPU"
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


def render(main: list[dict[str, Any]], sweep: list[dict[str, Any]], command: str) -> str:
    by_scenario: dict[str, list[dict[str, Any]]] = {}
    for r in main:
        by_scenario.setdefault(r["scenario"], []).append(r)
    out = [
        f"Command: `{command}`  ",
        f"Date: {datetime.now(UTC):%Y-%m-%d}; machine: {machine()}.",
        "",
    ]
    for scen, runs in by_scenario.items():
        seeds = ", ".join(str(r["seed"]) for r in runs)
        out += [f"### {scen}, seeds {seeds}", ""]
        out += ["Per fault class, pooled over seeds (TTD from the first report that shows the fault):", ""]
        out += [*_class_rows(runs), ""]
        out += ["The issue's targets, per run:", ""]
        out += [*_targets(runs), ""]
        out += ["Quarantines and links, summed over seeds:", ""]
        out += [*_quarantine_rows(runs), ""]
        out += ["Per fault kind:", ""]
        out += [*_kind_rows(runs), ""]
        out += ["Per seed:", ""]
        out += [*_detail(runs), ""]
    if sweep:
        out += [f"### Magnitude sweep ({Path(sweep[0]['scenario']).stem})", ""]
        out += [*_sweep_rows(sweep), ""]
    return "\n".join(out)


def _gen_name(scenario: str) -> str:
    return "othergen" if scenario == OTHERGEN else f"sim ({Path(scenario).stem})"


def _peer(f: dict[str, Any]) -> str:
    return f"-{f['peer']}" if f.get("peer") else ""


def _cell_row(gen: str, name: str, runs: list[dict[str, Any]]) -> tuple[str, list[str]]:
    """One matrix row, and its misses (soft faults visible but not quarantined in time; false
    quarantines), each named with its seed."""
    soft = [(r["seed"], f) for r in runs for f in r["faults"] if f["class"] == "soft"]
    # As ``observable``: a fault caught in time counts as visible whatever its window showed.
    vis = [(seed, f) for seed, f in soft if f.get("visible") or _in_time(f)]
    caught = [f for _, f in vis if _in_time(f)]
    ttd = [f["ttd_s"] for f in caught]
    hard = [f for r in runs for f in r["faults"] if f["class"] == "hard" and f["first_seen"] is not None]
    links = [(r["seed"], f) for r in runs for f in r["faults"] if f["class"] == "link"]
    link = [f for _, f in links if f.get("visible") or _in_time(f)]
    fq = [(r["seed"], q) for r in runs for q in r["false_quarantines"]]
    loaded = [r["loaded_share"] for r in runs if r.get("loaded_share") is not None]
    row = (
        f"| {gen} | {name} | {len(runs)} | {_pct(len(caught), len(vis))} | "
        f"{f'{statistics.median(ttd):.0f} s' if ttd else '-'} | {len(soft) - len(vis)} | "
        f"{_pct(sum(map(_in_time, hard)), len(hard))} | {_pct(sum(map(_in_time, link)), len(link))} | "
        f"{len(fq)} | {f'{100 * statistics.fmean(loaded):.0f} %' if loaded else '-'} |"
    )
    misses = [
        f"{f['kind']} {f['node']}{_peer(f)} seed {seed} "
        + ("never" if f["ttd_s"] is None else f"at {f['ttd_s']:.0f} s")
        for seed, f in [*vis, *((seed, f) for seed, f in links if f.get("visible"))]
        if not _in_time(f)
    ]
    misses += [
        f"false quarantine {q['node']} seed {seed} ({q['cause']}, {'+'.join(q['detectors'])})"
        for seed, q in fq
    ]
    hidden = [
        f"{f['kind']} {f['node']}{_peer(f)} seed {seed}"
        + ("" if f["ttd_s"] is None else f" (caught at {f['ttd_s']:.0f} s)")
        for seed, f in [*soft, *links]
        if not (f.get("visible") or _in_time(f))
    ]
    if hidden:
        misses.append(f"not visible for 10 minutes: {', '.join(hidden)}")
    return row, misses


def render_matrix(runs: list[dict[str, Any]], command: str) -> str:
    """The matrix as markdown: one row per (generator, cell), pooled over seeds, then the misses."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    rank = {c.name: i for i, c in enumerate(MATRIX_CELLS)}
    for r in sorted(runs, key=lambda r: (r["scenario"] == OTHERGEN, rank.get(r["cell"]["name"], len(rank)))):
        groups.setdefault((r["scenario"], r["cell"]["name"]), []).append(r)
    out = [
        f"Command: `{command}`  ",
        f"Date: {datetime.now(UTC):%Y-%m-%d}; machine: {machine()}.",
        "",
        f"Soft recall: soft faults visible for {SOFT_WITHIN_S / 60:.0f} minutes after first showing "
        f"(``visibility``; one caught in time counts as visible) and quarantined within "
        f"{SOFT_WITHIN_S / 60:.0f} minutes; TTD from the first "
        f"report showing the fault; hard recall within {HARD_WITHIN_S:.0f} s; link recall within "
        f"{LINK_WITHIN_S / 60:.0f} minutes, of the links visible that long (``_LinkSeen``: the pair "
        f"measured {DECIDING_RESULTS} times by pair probes, or {JOB_SPAN_S:.0f} s of job data over "
        "a ring crossing it, and each end measured with a healthy partner); "
        "loaded: the share of reports "
        "whose GPUs average at least 50 % utilisation.",
        "",
        "| generator | cell | runs | soft recall <= 10 min (visible) | soft TTD median | soft not visible "
        "| hard recall <= 30 s | link recall <= 10 min (visible) | false quarantines | loaded |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes: list[str] = []
    for (scen, name), rs in groups.items():
        row, misses = _cell_row(_gen_name(scen), name, sorted(rs, key=lambda r: r["seed"]))
        out.append(row)
        if misses:
            notes.append(f"- {_gen_name(scen)}, {name}: {'; '.join(misses)}")
    out += ["", "Misses and false quarantines:", "", *(notes or ["- none"]), ""]
    return "\n".join(out)


def matrix_jobs(
    scenarios: Sequence[str], seeds: int, cells: Sequence[Cell], minutes: float, nodes: int | None
) -> list[Job]:
    # Seed by seed: a run cut short still has whole matrices for its first seeds (``--partial``).
    return [
        Job(scen, seed, None, cell=cell, minutes=minutes, nodes=nodes if scen == OTHERGEN else None)
        for seed in range(1, seeds + 1)
        for scen in scenarios
        for cell in cells
    ]


def _job_key(scenario: str, seed: int, cell: str) -> tuple[str, int, str]:
    return (scenario, seed, cell)


def run_partial(jobs: Sequence[Job], workers: int, partial: Path) -> list[dict[str, Any]]:
    """``run_jobs``, appending each run to ``partial`` (JSON Lines) as it ends and skipping the runs
    already there, so an interrupted matrix resumes where it stopped."""
    done: list[dict[str, Any]] = []
    if partial.exists():
        done = [json.loads(line) for line in partial.read_text("utf-8").splitlines() if line.strip()]
    have = {_job_key(r["scenario"], r["seed"], r["cell"]["name"]) for r in done}
    todo = [j for j in jobs if j.cell is not None and _job_key(j.scenario, j.seed, j.cell.name) not in have]
    wanted = {_job_key(j.scenario, j.seed, j.cell.name) for j in jobs if j.cell is not None}
    log.info("%d runs already in %s, %d to go", len(have & wanted), partial, len(todo))
    partial.parent.mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(max_workers=workers) as pool, partial.open("a", encoding="utf-8") as out:
        futures = {pool.submit(run_job, j): j for j in todo}
        for future in as_completed(futures):
            job, result = futures[future], future.result()
            log.info("%s: %d reports, %.1f s", _label(job), result["reports"], result["seconds"])
            out.write(json.dumps(result) + "\n")
            out.flush()
            done.append(result)
    return [r for r in done if _job_key(r["scenario"], r["seed"], r["cell"]["name"]) in wanted]


def run_jobs(jobs: Sequence[Job], workers: int) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    with ProcessPoolExecutor(max_workers=workers) as pool:
        for job, result in zip(jobs, pool.map(run_job, jobs), strict=True):
            log.info("%s: %d reports, %.1f s", _label(job), result["reports"], result["seconds"])
            results.append(result)
    return results


def _select_cells(text: str | None) -> list[Cell]:
    if text is None:
        return list(MATRIX_CELLS)
    names = [n.strip() for n in text.split(",") if n.strip()]
    known = {c.name: c for c in MATRIX_CELLS}
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ConfigError(f"--cells: unknown cell(s) {unknown}; cells are {', '.join(known)}")
    return [known[n] for n in names]


def _write_json(path: Path, command: str, results: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "command": command,
                "date": f"{datetime.now(UTC):%Y-%m-%d}",
                "machine": machine(),
                "runs": results,
            },
            indent=1,
        )
        + "\n",
        "utf-8",
    )


def _parse_sweep(text: str) -> list[tuple[str, str, float]]:
    try:
        target, values = text.split("=", 1)
        kind, param = target.split(".", 1)
        points = [float(v) for v in values.split(",") if v.strip()]
    except ValueError as exc:
        raise ConfigError(f"--sweep {text!r}: expected KIND.PARAM=V1,V2,...") from exc
    if kind not in scenario_mod.FAULT_KINDS or param not in scenario_mod.FAULT_KINDS[kind][2]:
        raise ConfigError(f"--sweep {text!r}: {kind}.{param} is not a fault parameter (docs/simulator.md)")
    if not points:
        raise ConfigError(f"--sweep {text!r}: no values")
    return [(kind, param, v) for v in points]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0] if __doc__ else None)
    p.add_argument("scenarios", nargs="*", type=Path, default=None)
    p.add_argument("--seeds", type=int, default=None, help="seeds 1..N for every scenario (5; --matrix: 3)")
    p.add_argument(
        "--matrix",
        action="store_true",
        help="the robustness matrix over both generators (default scenarios: fleet64 and othergen)",
    )
    p.add_argument("--cells", help="--matrix: only these cells, by name, comma-separated")
    p.add_argument(
        "--minutes", type=float, default=MATRIX_MINUTES, help=f"--matrix: trace length ({MATRIX_MINUTES:g})"
    )
    p.add_argument("--nodes", type=int, default=None, help="--matrix: othergen's fleet size (64)")
    p.add_argument(
        "--partial",
        type=Path,
        help="--matrix: append each run here as it ends, and skip the runs already there",
    )
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    p.add_argument(
        "--sweep", action="append", help=f"KIND.PARAM=V1,V2,... (default {DEFAULT_SWEEP}; 'none' for none)"
    )
    p.add_argument("--sweep-seeds", type=int, default=3, help="seeds 1..N for each sweep point (3)")
    p.add_argument("--json", type=Path, help="write every run's outcome here")
    p.add_argument(
        "--drop", type=float, default=0.0, help="robustness: lose this share of every trace's reports (0)"
    )
    p.add_argument(
        "--strip-labels",
        action="store_true",
        help="robustness: remove every report's labels (pool, rack, leaf)",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    command = ".venv/bin/python bench/detection.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.matrix:
        return _matrix_main(p, args, command.strip())
    if not args.scenarios:  # argparse gives [] for an absent nargs="*" positional
        args.scenarios = [DEFAULT_SCENARIO]
    if args.seeds is None:
        args.seeds = 5
    if args.seeds < 1 or args.sweep_seeds < 1 or args.jobs < 1:
        p.error("--seeds, --sweep-seeds and --jobs must be >= 1")
    if not 0.0 <= args.drop < 1.0:
        p.error("--drop must be in [0, 1)")
    perturb = Perturb(drop=args.drop, strip_labels=args.strip_labels)
    for path in args.scenarios:
        if str(path) != OTHERGEN:
            scenario_mod.load(path)  # a bad scenario fails here, before any worker starts
    sweeps = (
        []
        if args.sweep == ["none"]
        else [pt for s in (args.sweep or [DEFAULT_SWEEP]) for pt in _parse_sweep(s)]
    )
    if sweeps and str(args.scenarios[0]) == OTHERGEN:
        p.error("--sweep needs a scenario file first (othergen draws its own magnitudes); add --sweep none")
    jobs = [Job(str(s), seed, None, perturb) for s in args.scenarios for seed in range(1, args.seeds + 1)]
    jobs += [
        Job(str(args.scenarios[0]), seed, pt, perturb)
        for pt in sweeps
        for seed in range(1, args.sweep_seeds + 1)
    ]
    started = time.perf_counter()
    results = run_jobs(jobs, args.jobs)
    main_runs = [r for r in results if r["sweep"] is None]
    sweep_runs = [r for r in results if r["sweep"] is not None]
    print(render(main_runs, sweep_runs, command.strip()))
    log.info("done in %.0f s", time.perf_counter() - started)
    if args.json:
        _write_json(args.json, command.strip(), results)
    return 0


def _matrix_main(p: argparse.ArgumentParser, args: argparse.Namespace, command: str) -> int:
    seeds = 3 if args.seeds is None else args.seeds
    if seeds < 1 or args.jobs < 1:
        p.error("--seeds and --jobs must be >= 1")
    if args.sweep or args.drop or args.strip_labels:
        p.error("--matrix varies the generators' own knobs: no --sweep, --drop or --strip-labels")
    scenarios = [str(s) for s in (args.scenarios or [DEFAULT_SCENARIO, Path(OTHERGEN)])]
    for path in scenarios:
        if path != OTHERGEN:
            scenario_mod.load(path)
    try:
        cells = _select_cells(args.cells)
    except ConfigError as exc:
        p.error(str(exc))
    started = time.perf_counter()
    jobs = matrix_jobs(scenarios, seeds, cells, args.minutes, args.nodes)
    results = run_partial(jobs, args.jobs, args.partial) if args.partial else run_jobs(jobs, args.jobs)
    order = {_job_key(j.scenario, j.seed, j.cell.name): i for i, j in enumerate(jobs) if j.cell is not None}
    results.sort(key=lambda r: order[_job_key(r["scenario"], r["seed"], r["cell"]["name"])])
    print(render_matrix(results, command))
    log.info("done in %.0f s", time.perf_counter() - started)
    if args.json:
        _write_json(args.json, command, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
