"""JobLocalizer: which GPU, NIC or link the jobs' own collectives blame.

The maths first, on plain numbers (``straggler``, ``robust_centre``, ``localize``); then the
detector over reports whose ``jobs`` sections come from the simulator's job model
(``sim.jobs.JobFleet``, no fleet around it), with the faults switched on one at a time.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import msgspec
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from agent.report import SCHEMA_ID, Collective, GpuAllocation, Jobs, Report, Stat
from aggregator import app
from aggregator.config import Config, FleetConfig
from aggregator.detect import DETECTORS
from aggregator.detect.base import Verdict
from aggregator.detect.jobs import (
    CommVote,
    JobConfig,
    JobLocalizer,
    _components,
    _Rank,
    _Row,
    _View,
    job_stem,
    localize,
    robust_centre,
    straggler,
)
from aggregator.fleet.frame import FleetFrames
from aggregator.fleet.pools import Placement
from aggregator.metrics import Metrics
from aggregator.model import Finding
from aggregator.replay import replayed
from aggregator.rules.model import default_rules_dir, load_rules
from sim import eval as sim_eval
from sim import scenario as scenario_mod
from sim.cli import write_trace
from sim.jobs import Hardware, JobFleet, JobSpec, NodeFaults, pod_name

T0 = 1_764_000_000.0
FRAMES = FleetFrames(FleetConfig())  # the detector reads the jobs sections, not the pool frames
POOL = Placement("h100", rack="r0", leaf="l0")
H100 = Hardware(gpus=8, nvlink_busbw=480e9, nic_busbw=47.5e9)  # sim.profiles' figures

# -- the maths -------------------------------------------------------------------------------------


def test_robust_centre_ignores_one_outlier_and_floors_the_spread() -> None:
    centre, spread = robust_centre([1.0, 1.0, 1.0, 1.0, 9.0], 0.02)
    assert centre == 1.0
    assert spread == 0.02


def test_the_straggler_is_the_rank_with_the_shortest_kernel() -> None:
    # Seven ranks waited ~50 % longer than the one that arrived last.
    times = [1500.0, 1510.0, 1495.0, 1000.0, 1505.0, 1490.0, 1502.0, 1498.0]
    s = straggler(times, ratio=0.1, z=3.0, floor=0.02)
    assert s is not None
    assert s.index == 3
    assert math.expm1(s.gap) == pytest.approx(0.5, abs=0.02)


@pytest.mark.parametrize(
    "times",
    [
        [1000.0, 1010.0, 990.0, 1005.0],  # all within noise
        [1000.0, 1060.0, 1055.0, 1062.0],  # 6 % apart: under the 10 % line
        [1000.0],  # one rank has nobody to wait for
    ],
)
def test_no_straggler_without_a_clear_gap(times: list[float]) -> None:
    assert straggler(times, ratio=0.1, z=3.0, floor=0.02) is None


def test_a_wide_spread_among_the_others_hides_a_gap() -> None:
    # The others disagree by 30 % among themselves: a 15 % shorter kernel is not evidence.
    times = [850.0, 700.0, 1000.0, 1300.0, 950.0, 1200.0]
    assert straggler(times, ratio=0.1, z=3.0, floor=0.02) is None


def vote(comm: str, nodes: Sequence[str], state: str, *, pair: bool = False) -> CommVote:
    ns = tuple(nodes)
    hops: tuple[tuple[str, str], ...]
    if pair or len(ns) == 2:
        hops = ((min(ns), max(ns)),)
    else:
        hops = tuple(sorted({(min(a, b), max(a, b)) for a, b in zip(ns, ns[1:] + ns[:1], strict=True)}))
    return CommVote(comm, ns, hops, state, 0.6 if state == "low" else 1.0)


def test_a_hop_whose_communicators_are_all_slow_while_its_ends_are_fine_elsewhere_is_the_link() -> None:
    # Stage rings a-b and c-d, pipeline pairs a-c and b-d: the a-b rings are slow, the pairs not.
    votes = [vote(f"ab{g}", "ab", "low") for g in range(8)]
    votes += [vote(f"cd{g}", "cd", "normal") for g in range(8)]
    votes += [vote(f"ac{g}", "ac", "normal") for g in range(8)]
    votes += [vote(f"bd{g}", "bd", "normal") for g in range(8)]
    blame = localize(votes, min_comms=2)
    assert set(blame.links) == {("a", "b")}
    assert blame.nics == {}
    assert blame.ambiguous == []


def test_a_node_whose_communicators_over_different_hops_are_all_slow_is_the_nic() -> None:
    votes = [vote(f"ab{g}", "ab", "low") for g in range(8)]
    votes += [vote(f"ac{g}", "ac", "low") for g in range(8)]
    votes += [vote(f"cd{g}", "cd", "normal") for g in range(8)]
    votes += [vote(f"bd{g}", "bd", "normal") for g in range(8)]
    blame = localize(votes, min_comms=2)
    assert set(blame.nics) == {"a"}
    assert blame.links == {}


def test_a_ring_with_several_unvouched_hops_pins_nothing() -> None:
    # One 4-node ring per rail and nothing else: a slow ring cannot say which of its hops.
    votes = [vote(f"r{g}", "abcd", "low") for g in range(8)]
    blame = localize(votes, min_comms=2)
    assert blame.links == {} and blame.nics == {}
    assert len(blame.ambiguous) == 8


def test_two_nodes_that_only_talk_to_each_other_cannot_tell_link_from_nic() -> None:
    votes = [vote(f"ab{g}", "ab", "low") for g in range(8)]
    blame = localize(votes, min_comms=2)
    assert blame.links == {} and blame.nics == {}


def test_an_unclear_communicator_neither_blames_nor_vouches() -> None:
    votes = [vote(f"ab{g}", "ab", "low") for g in range(8)]
    votes += [vote(f"ac{g}", "ac", "unclear") for g in range(8)]
    votes += [vote(f"bd{g}", "bd", "normal") for g in range(8)]
    votes += [vote(f"cd{g}", "cd", "normal") for g in range(8)]
    blame = localize(votes, min_comms=2)
    assert blame.links == {}  # a's NIC is not vouched for
    assert blame.nics == {}  # nor blamed


def test_settings_refuse_a_low_line_above_the_normal_one() -> None:
    with pytest.raises(ValueError, match="low_ratio"):
        JobConfig(low_ratio=0.95, normal_ratio=0.9)


# -- the detector over the simulator's job model ---------------------------------------------------

JOBS = (
    JobSpec("llm-a", first=0, nodes=4, pp=2),  # stages (0, 1) and (2, 3); pairs 0-2, 1-3
    JobSpec("llm-b", first=4, nodes=8, pp=4),  # stages (4, 5) (6, 7) (8, 9) (10, 11)
    JobSpec("llm-c", first=12, nodes=8, pp=2),  # stages 12..15 and 16..19; pairs 12-16 ...
    JobSpec("sweep-d", first=20, nodes=4, pp=2),
)


def fault(kind: str, node: str = "", **kw: object) -> NodeFaults:
    params = {k: float(v) for k, v in kw.items() if isinstance(v, float)}
    return NodeFaults(
        kind=kind,
        node=node,
        peer=kw.get("peer") if isinstance(kw.get("peer"), str) else None,  # type: ignore[arg-type]
        gpu=kw.get("gpu") if isinstance(kw.get("gpu"), int) else None,  # type: ignore[arg-type]
        port=None,
        job=kw.get("job") if isinstance(kw.get("job"), str) else None,  # type: ignore[arg-type]
        params=params,
        active=lambda rel: rel >= 60.0,
    )


def pods_of(node: str) -> list[GpuAllocation]:
    """The node's PodResources answer: the pod of its job holding its 8 GPUs (sim.jobs.pod_name)."""
    job = next(j for j in JOBS if node in j.node_names())
    devices = [f"GPU-{node}-{g}" for g in range(8)]
    return [GpuAllocation("ml", pod_name(job.name, node), "trainer", "nvidia.com/gpu", devices)]


def replay(
    faults: Sequence[NodeFaults],
    *,
    minutes: float = 6.0,
    seed: int = 1,
    det: JobLocalizer | None = None,
    pods: bool | Callable[[str], list[GpuAllocation]] = False,
    rename: Mapping[str, str] | None = None,
    behind: float = 0.0,
) -> list[tuple[float, Verdict]]:
    """Every node reports every 10 s (at its own phase); the detector runs every minute. With
    ``pods`` each report carries the node's attribution (``pods_of``, or the function given, of
    the reported node's name); ``rename`` reports a node under another's name (two jobs' pods on
    one node); ``behind``: the aggregator is that many seconds behind a backlog (each run that
    much later on its clock than the reports it has were measured)."""
    fleet = JobFleet(seed=seed, start=T0, jobs=JOBS, hardware={j.name: H100 for j in JOBS}, faults=faults)
    det = det or JobLocalizer()
    attribution = pods if callable(pods) else pods_of
    nodes = [n for j in JOBS for n in j.node_names()]
    out: list[tuple[float, Verdict]] = []
    next_run = T0 + 60.0
    for k in range(1, int(minutes * 6) + 1):
        for i, node in enumerate(nodes):
            t = T0 + k * 10.0 + i * 0.3
            jobs, _ = fleet.section(node, t - 10.0, t, 0.0, False)
            name = (rename or {}).get(node, node)
            r = Report(schema=SCHEMA_ID, node=name, time=t, seq=k, boot_id="b", gpus=[], nics=[], jobs=jobs)
            if pods:
                r = msgspec.structs.replace(r, pods=attribution(name))
            det.observe_report(r, POOL, t + 0.5)
        t = T0 + k * 10.0 + 9.9
        if t >= next_run:
            out.append((t, det.run(FRAMES, t + behind)))
            next_run += 60.0
    return out


def blamed(runs: list[tuple[float, Verdict]]) -> tuple[dict[str, set[str]], set[tuple[str, str]]]:
    nodes: dict[str, set[str]] = {}
    links: set[tuple[str, str]] = set()
    for _, v in runs:
        for n, fs in v.nodes.items():
            for f in fs:
                nodes.setdefault(n, set()).add(f.key)
        links |= set(v.links or {})
    return nodes, links


def last_findings(runs: list[tuple[float, Verdict]], node: str) -> list[Finding]:
    for _, v in reversed(runs):
        if node in v.nodes:
            return v.nodes[node]
    return []


@pytest.mark.parametrize("seed", [1, 2])
def test_healthy_jobs_blame_nothing(seed: int) -> None:
    nodes, links = blamed(replay([], seed=seed))
    assert nodes == {} and links == set()


def test_a_slow_gpu_is_the_straggler_its_communicators_wait_for() -> None:
    runs = replay([fault("slow_gpu", "gpu-0007", gpu=5, ratio=0.88, busbw_ratio=0.9)])
    nodes, links = blamed(runs)
    assert set(nodes) == {"gpu-0007"} and links == set()
    (f,) = last_findings(runs, "gpu-0007")
    assert f.action == "quarantine" and f.detector == "jobs"
    assert f.key == "job-straggler:rank5"  # the GPU's own node's communicator names its rank
    assert f.evidence["job"] == "llm-b"
    assert f.evidence["tp_rank"] == 5


def test_a_node_slow_on_all_its_gpus_is_a_straggler_node() -> None:
    runs = replay([fault("power_brake", "gpu-0014", clock_ratio=0.8)])
    nodes, links = blamed(runs)
    assert nodes == {"gpu-0014": {"job-straggler"}} and links == set()


def test_a_slow_nic_is_blamed_on_its_node() -> None:
    runs = replay([fault("slow_nic", "gpu-0013", ratio=0.7)])
    nodes, links = blamed(runs)
    assert nodes == {"gpu-0013": {"job-nic"}} and links == set()
    (f,) = last_findings(runs, "gpu-0013")
    assert f.evidence["job"] == "llm-c"
    assert f.evidence["ratio"] == pytest.approx(0.7, abs=0.03)


def test_a_degraded_link_is_a_link_not_either_node() -> None:
    runs = replay([fault("degraded_link", "gpu-0006", peer="gpu-0007", ratio=0.65)])
    nodes, links = blamed(runs)
    assert nodes == {} and links == {("gpu-0006", "gpu-0007")}
    f = runs[-1][1].links[("gpu-0006", "gpu-0007")]  # type: ignore[index]
    assert f.action == "none" and f.peer == "gpu-0007"
    assert f.since <= runs[-1][0] - 60.0  # dated from the first run of its streak


def test_a_job_slow_everywhere_is_blamed_on_nothing() -> None:
    det = JobLocalizer()
    runs = replay([fault("slow_job", job="sweep-d", ratio=0.6)], det=det)
    nodes, links = blamed(runs)
    assert nodes == {} and links == set()
    # It is slow (its bus bandwidth is 40 % under the others'), and that is all.
    assert det.job_busbw["sweep-d"] < 0.7 * det.job_busbw["llm-a"]


@pytest.mark.parametrize(
    "faults",
    [
        [fault("slow_nic", "gpu-0013", ratio=0.7)],
        [fault("degraded_link", "gpu-0006", peer="gpu-0007", ratio=0.65)],
        [fault("slow_gpu", "gpu-0007", gpu=5, ratio=0.88, busbw_ratio=0.9)],
    ],
    ids=["slow-nic", "degraded-link", "slow-gpu"],
)
def test_behind_a_backlog_longer_than_the_window_the_same_blame(faults: list[NodeFaults]) -> None:
    # Four minutes behind (the window is three): the samples are dated when they were measured,
    # so a window ending at the clock would hold none of them, and nothing would be judged.
    on_time = blamed(replay(faults))
    assert on_time != ({}, set())
    assert blamed(replay(faults, behind=240.0)) == on_time


def test_a_blame_waits_for_consecutive_runs() -> None:
    runs = replay([fault("slow_nic", "gpu-0013", ratio=0.7)], minutes=4.0)
    first = next(t for t, v in runs if v.nodes.get("gpu-0013"))
    # The fault starts 60 s in; the window's medians turn within it, then two runs in a row.
    assert first - T0 >= 60.0 + JobConfig().every_seconds


def test_the_slowest_communicators_and_stragglers_are_kept_for_metrics() -> None:
    fleet_faults = [
        fault("slow_nic", "gpu-0013", ratio=0.7),
        fault("slow_gpu", "gpu-0001", gpu=2, ratio=0.85, busbw_ratio=0.9),
    ]
    det = JobLocalizer()
    replay(fleet_faults, minutes=4.0, det=det)
    assert det.slowest[0].job == "llm-c" and det.slowest[0].ratio == pytest.approx(0.7, abs=0.03)
    assert {s.node for s in det.stragglers} == {"gpu-0001"}
    assert len(det.slowest) <= JobConfig().top_n
    assert set(det.job_busbw) == {j.name for j in JOBS}
    # Exported as top-N tables, at most top_n series per family.
    registry = CollectorRegistry()
    Metrics(registry).watch_jobs(lambda: [det.job_table()])
    text = generate_latest(registry).decode()
    assert 'gpuwarden_job_straggler_wait_ratio{communicator="' in text and 'host="gpu-0001"' in text
    for family in ("busbw_gigabytes_per_second", "communicator_ratio", "straggler_wait_ratio"):
        rows = [ln for ln in text.splitlines() if ln.startswith(f"gpuwarden_job_{family}{{")]
        assert 0 < len(rows) <= JobConfig().top_n, family


def _one_job_cycle(det: JobLocalizer) -> None:
    """One cycle of the first simulated job's reports, every node of it."""
    fleet = JobFleet(seed=1, start=T0, jobs=JOBS[:1], hardware={"llm-a": H100}, faults=[])
    for node in JOBS[0].node_names():
        jobs, _ = fleet.section(node, T0, T0 + 10.0, 0.0, False)
        det.observe_report(
            Report(
                schema=SCHEMA_ID, node=node, time=T0 + 10, seq=1, boot_id="b", gpus=[], nics=[], jobs=jobs
            ),
            POOL,
            T0 + 10.0,
        )


def test_rows_are_bounded_and_a_forgotten_node_takes_its_rows_along() -> None:
    det = JobLocalizer(JobConfig(max_comms=10))
    _one_job_cycle(det)
    assert len(det._rows) == 10
    for node in JOBS[0].node_names():
        det.forget(node)
    assert det._rows == {}


def test_one_token_churning_communicators_neither_stalls_ingest_nor_evicts_other_nodes() -> None:
    # A node's token sends 1,024 new communicators a report (the most a report carries), report
    # after report. Dropping the oldest row at the cap is one step (it was a scan of every row
    # per new row: seconds a report on the event loop), and the node only pushes out its own.
    det = JobLocalizer(JobConfig(max_comms=4_096))
    _one_job_cycle(det)
    theirs = set(det._rows)
    started = time.process_time()
    for r in range(40):
        det.observe_report(
            _jobs_report("evil", r + 2, [(f"c{r}-{j}", 0, 2) for j in range(1_024)]), POOL, T0 + 20 + r
        )
    assert time.process_time() - started < 10.0  # 40 reports; the scan took minutes
    assert theirs <= set(det._rows)  # every honest row is still there
    assert sum(1 for row in det._rows.values() if row.owner == "evil") == JobConfig().max_comms_per_node


def _jobs_report(node: str, seq: int, rows: Sequence[tuple[str, int, int]]) -> Report:
    """A report of ``node`` whose jobs section has one collective per (comm, rank, n_ranks)."""
    stat = Stat(min=1.0, p10=1.0, p50=1.0, p90=1.0, max=1.0)
    collectives = tuple(
        Collective(
            comm=comm,
            collective="AllReduce",
            size_bytes=1 << 20,
            n_ranks=n_ranks,
            nnodes=2,
            count=1,
            timing_source="kernel_gpu",
            busbw_gbs=stat,
            exec_time_us=stat,
            rank=rank,
        )
        for comm, rank, n_ranks in rows
    )
    jobs = Jobs(format="gpuwarden/jobs/v1", collectives=collectives, records=len(rows), dropped=0)
    return Report(
        schema=SCHEMA_ID, node=node, time=T0 + seq, seq=seq, boot_id="b", gpus=[], nics=[], jobs=jobs
    )


def _consistent(det: JobLocalizer) -> None:
    """The detector's bookkeeping agrees with its rows."""
    owned = {key: node for node, keys in det._owned.items() for key in keys}
    assert owned == {key: row.owner for key, row in det._rows.items()}
    held: dict[str, int] = {}
    for row in det._rows.values():
        for rank in row.ranks.values():
            held[rank.node] = held.get(rank.node, 0) + 1
    assert det._ranks_held == held


def test_a_row_dropped_at_the_fleet_cap_keeps_the_bookkeeping_whole() -> None:
    # At the fleet-wide cap the row dropped may be the reporting node's only one (its map goes);
    # the row it starts then is still counted as its own, and another node reporting it after
    # finds its owner (a KeyError lost the rest of that report).
    det = JobLocalizer(JobConfig(max_comms=2))
    det.observe_report(_jobs_report("A", 1, [("a1", 0, 2)]), POOL, T0 + 1)
    det.observe_report(_jobs_report("B", 2, [("b1", 0, 2)]), POOL, T0 + 2)
    det.observe_report(_jobs_report("A", 3, [("a2", 0, 2)]), POOL, T0 + 3)  # a1 goes
    det.observe_report(_jobs_report("B", 4, [("a2", 1, 2), ("b1", 1, 2)]), POOL, T0 + 4)
    assert {k[:3] for k in det._rows} == {("a2", "AllReduce", 1 << 20), ("b1", "AllReduce", 1 << 20)}
    _consistent(det)
    det.forget("A")
    _consistent(det)
    assert {k[:3] for k in det._rows} == {("b1", "AllReduce", 1 << 20)}


def test_one_token_declaring_a_huge_communicator_holds_its_own_ranks_only() -> None:
    # n_ranks is the sender's to declare: 2**31 - 1, and 1,024 new ranks of it every report.
    cfg = JobConfig(max_ranks_per_node=2_048)
    det = JobLocalizer(cfg)
    det.observe_report(_jobs_report("honest", 1, [("h", 0, 2)]), POOL, T0 + 1)
    for r in range(20):
        rows = [("huge", r * 1_024 + i, 2**31 - 1) for i in range(1_024)]
        det.observe_report(_jobs_report("evil", r + 2, rows), POOL, T0 + 2 + r)
    assert det._ranks_held["evil"] == cfg.max_ranks_per_node
    assert det._ranks_held["honest"] == 1
    _consistent(det)


# -- jobs from pods --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pod", "stem"),
    [
        ("llm-c-worker-0009", "llm-c"),  # the simulator's pods, a Kubeflow PyTorchJob's
        ("llama-train-master-0", "llama-train"),
        ("pretrain-0-x7k2p", "pretrain"),  # an indexed batch/v1 Job: index, random suffix
        ("js-workers-0-3-bq9zt", "js-workers"),  # a JobSet: replicated job, indices, suffix
        ("mpi-bert-launcher", "mpi-bert"),
        ("trainer", "trainer"),
        ("gpt-2", "gpt"),  # a trailing number is an index: the stem names, it never joins
    ],
)
def test_a_pod_names_its_job_by_its_stem(pod: str, stem: str) -> None:
    assert job_stem(pod) == stem


def _view(comm: str, ranks: Sequence[tuple[str, str]]) -> _View:
    """A communicator's window view: per rank (node, Inspector hostname)."""
    row = _Row(comm, "AllReduce", 1 << 20, len(ranks), len({n for n, _ in ranks}), "kernel_gpu")
    for r, (node, host) in enumerate(ranks):
        row.ranks[r] = _Rank(node, host, 100 + r, None, deque())
    return _View(
        row, "h100", tuple(n for n, _ in ranks), tuple(1.0 for _ in ranks), tuple(1.0 for _ in ranks)
    )


def test_two_jobs_on_one_node_are_told_apart_by_their_pods() -> None:
    # n1 is split: job a's pod holds four GPUs, job b's the other four. Each job has its own
    # tensor-parallel communicator there and a data-parallel one to a node of its own.
    views = [
        _view("tp-a", [("n1", "a-worker-0")] * 4),
        _view("tp-b", [("n1", "b-worker-0")] * 4),
        _view("dp-a", [("n1", "a-worker-0"), ("n2", "a-worker-1")]),
        _view("dp-b", [("n1", "b-worker-0"), ("n3", "b-worker-1")]),
    ]
    # Without attribution the node is all that is known: one component, named by its nodes.
    assert {k: sorted(v.row.comm for v in vs) for k, vs in _components(views).items()} == {
        "n1+2": ["dp-a", "dp-b", "tp-a", "tp-b"]
    }
    pods = {
        "n1": {"a-worker-0": ("ml", "a-worker-0"), "b-worker-0": ("ml", "b-worker-0")},
        "n2": {"a-worker-1": ("ml", "a-worker-1")},
        "n3": {"b-worker-1": ("ml", "b-worker-1")},
    }
    assert {k: sorted(v.row.comm for v in vs) for k, vs in _components(views, pods).items()} == {
        "ml/a": ["dp-a", "tp-a"],
        "ml/b": ["dp-b", "tp-b"],
    }
    # One node without attribution joins what meets there, as before; the rest stays apart.
    partial = {"n1": pods["n1"], "n2": pods["n2"]}
    views.append(_view("dp-b2", [("n3", "b-worker-1"), ("n2", "a-worker-1")]))  # n3 unknown
    groups = {k: sorted(v.row.comm for v in vs) for k, vs in _components(views, partial).items()}
    assert sorted(map(sorted, groups.values())) == [["dp-a", "dp-b", "dp-b2", "tp-a", "tp-b"]]


def test_a_hostname_that_is_a_pod_of_another_node_or_of_two_namespaces_is_not_trusted() -> None:
    det = JobLocalizer()
    dup = [
        GpuAllocation("ml", "w-0", "c", "nvidia.com/gpu", ["GPU-1"]),
        GpuAllocation("dev", "w-0", "c", "nvidia.com/gpu", ["GPU-2"]),
        GpuAllocation("ml", "x" * 70, "c", "nvidia.com/gpu", ["GPU-3"]),
    ]
    r = Report(schema=SCHEMA_ID, node="n1", time=T0, seq=0, boot_id="b", gpus=[], nics=[], pods=dup)
    det.observe_report(r, POOL, T0)
    assert det._pods["n1"] == {"x" * 63: ("ml", "x" * 70)}  # the kubelet's hostname cut
    det.forget("n1")
    assert det._pods == {}


def test_with_attribution_the_findings_name_the_job_by_namespace_and_pods() -> None:
    runs = replay(
        [
            fault("slow_gpu", "gpu-0007", gpu=5, ratio=0.88, busbw_ratio=0.9),
            fault("slow_nic", "gpu-0013", ratio=0.7),
            fault("slow_job", job="sweep-d", ratio=0.6),
        ],
        pods=True,
    )
    nodes, links = blamed(runs)
    # The same verdicts as without attribution (the jobs take whole nodes here), named by pods.
    assert nodes == {"gpu-0007": {"job-straggler:rank5"}, "gpu-0013": {"job-nic"}} and links == set()
    assert [f.evidence["job"] for f in last_findings(runs, "gpu-0007")] == ["ml/llm-b"]
    assert [f.evidence["job"] for f in last_findings(runs, "gpu-0013")] == ["ml/llm-c"]


# -- the busy fleet, job data alone ----------------------------------------------------------------


def test_on_the_busy_fleet_job_data_alone_quarantines_the_slow_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """scenarios/busy-jobs.yaml (seed 2, its first 12 minutes) with the peer detector left out:
    the slow GPU's SM clock no longer tells, and the jobs' collectives alone quarantine it within
    10 minutes of its first showing; no false quarantine, nothing about the job slow everywhere."""
    logging.getLogger().setLevel(logging.ERROR)
    monkeypatch.setattr(
        app,
        "build_pipeline",
        functools.partial(app.build_pipeline, detectors=[d for d in DETECTORS if d.name != "peer"]),
    )
    s = scenario_mod.load(Path("scenarios/busy-jobs.yaml")).with_overrides(seed=2, nodes=None, minutes=12)
    trace, out = tmp_path / "trace.jsonl.gz", tmp_path / "decisions.jsonl"
    _, truth = write_trace(s, trace)
    _, _, final = replayed(trace, out, Config(), load_rules([default_rules_dir()]))
    assert all(run.name != "peer" for run in final.pipeline._detectors)
    raw = [json.loads(line) for line in out.read_text().splitlines()]
    scored = sim_eval.score(truth, sim_eval.load_decisions(out))
    assert scored["quarantines"]["false"] == 0, scored["quarantines"]
    (gpu_fault,) = [f for f in truth.faults if f.kind == "slow_gpu"]
    shown = gpu_fault.first_seen or gpu_fault.start
    q = next(d for d in raw if d["node"] == gpu_fault.node and d["state"] == "quarantined")
    assert q["time"] - shown <= 600.0
    assert {r["detector"] for r in q["reasons"]} == {"jobs"}
    assert q["reasons"][0]["evidence"]["tp_rank"] == 5  # the GPU's tensor-parallel rank
    health = final.pipeline.health.get(gpu_fault.node)
    assert health is not None and "job-straggler:rank5" in health.groups.get("jobs", {})
    slow_job = {f.node for f in truth.faults if f.kind == "slow_job"}
    assert not any(d["node"] in slow_job or d.get("peer") in slow_job for d in raw if d["state"] != "healthy")


def test_a_node_shared_with_a_job_slow_everywhere_blames_nothing_once_its_pods_say_whose() -> None:
    """gpu-0019 holds a pod of llm-c and one of sweep-d (sweep-d's first node reports as it), and
    sweep-d is slow everywhere. By nodes alone the two jobs are one component, whose level is
    neither's: sweep-d's rings look slow against it, and its nodes' NICs are blamed. With the
    node's attribution the pods part them: sweep-d is slow everywhere, and nothing is blamed."""
    shared = {"gpu-0020": "gpu-0019"}
    both = [
        GpuAllocation("ml", pod_name("llm-c", "gpu-0019"), "trainer", "nvidia.com/gpu", ["GPU-0"]),
        GpuAllocation("ml", pod_name("sweep-d", "gpu-0020"), "trainer", "nvidia.com/gpu", ["GPU-1"]),
    ]

    def attribution(node: str) -> list[GpuAllocation]:
        return both if node == "gpu-0019" else pods_of(node)

    slow = [fault("slow_job", job="sweep-d", ratio=0.6)]
    nodes, _ = blamed(replay(slow, rename=shared))
    assert nodes and all(keys == {"job-nic"} for keys in nodes.values())  # what grouping by nodes does
    det = JobLocalizer()
    nodes, links = blamed(replay(slow, rename=shared, pods=attribution, det=det))
    assert nodes == {} and links == set()
    assert det.job_level["ml/sweep-d"] == pytest.approx(0.6, abs=0.03)
    assert det.job_level["ml/llm-c"] == pytest.approx(1.0, abs=0.03)


# -- jobs the simulator does not make: healthy spread, uneven work, other NCCL settings, one rail ---


def _stat(x: float) -> Stat:
    return Stat(min=x, p10=x, p50=x, p90=x, max=x)


class HandFleet:
    """Reports written by hand from the physics of one collective: each rank arrives after its
    GPU's compute (``compute`` transfer times, times its slowness), and its kernel time (GPU
    timing) is the transfer plus its wait for the last rank to arrive. Every rank is named by its
    process (pid) as Inspector writes it."""

    def __init__(self, nodes: int, seed: int = 3) -> None:
        self.nodes = [f"n{k:02d}" for k in range(nodes)]
        self.rng = __import__("random").Random(seed)
        self.rows: dict[str, list[Collective]] = {n: [] for n in self.nodes}

    def comm(
        self,
        name: str,
        members: Sequence[tuple[str, int]],
        *,
        collective: str = "AllReduce",
        busbw: float = 400.0,
        transfer_us: float = 1000.0,
        compute: float = 20.0,
        slow: Mapping[tuple[str, int], float] | None = None,
    ) -> None:
        """One communicator over ``members`` (node, GPU), in rank order; ``slow``: a GPU's compute
        time over a healthy one's (1.12: 12 % slow)."""
        arrive = [compute * transfer_us * (slow or {}).get(m, 1.0) for m in members]
        last = max(arrive)
        nnodes = len({n for n, _ in members})
        for rank, ((node, g), a) in enumerate(zip(members, arrive, strict=True)):
            exec_us = transfer_us + (last - a) + self.rng.uniform(0, 5.0)
            self.rows[node].append(
                Collective(
                    comm=name,
                    collective=collective,
                    size_bytes=1 << 26,
                    n_ranks=len(members),
                    nnodes=nnodes,
                    count=2,
                    timing_source="kernel_gpu",
                    busbw_gbs=_stat(busbw * transfer_us / exec_us if rank else busbw),
                    exec_time_us=_stat(exec_us),
                    rank=rank,
                    hostname=node,
                    pid=1000 + g,
                )
            )

    def run(self, det: JobLocalizer, minutes: int = 6) -> list[tuple[float, Verdict]]:
        out = []
        for k in range(1, minutes * 6 + 1):
            t = T0 + 10.0 * k
            for node in self.nodes:
                jobs = Jobs(
                    format="gpuwarden/jobs/v1", collectives=tuple(self.rows[node]), records=1, dropped=0
                )
                r = Report(
                    schema=SCHEMA_ID, node=node, time=t, seq=k, boot_id="b", gpus=[], nics=[], jobs=jobs
                )
                det.observe_report(r, POOL, t)
            if k % 6 == 0:
                out.append((t + 1, det.run(FRAMES, t + 1)))
        return out


def spread(nodes: Sequence[str], sigma: float, seed: int) -> dict[tuple[str, int], float]:
    """Every GPU's persistent compute time over nominal: N(1, sigma) (power capping, clocks)."""
    rng = __import__("random").Random(seed)
    return {(n, g): rng.gauss(1.0, sigma) for n in nodes for g in range(8)}


def tp_job(
    fleet: HandFleet,
    nodes: Sequence[str],
    slow: Mapping[tuple[str, int], float],
    *,
    compute: float,
    name: str = "a",
) -> None:
    """A tensor-parallel communicator per node and a data-parallel ring per rail over the nodes
    (which make the nodes one job); the DP rings see each node at its slowest GPU's pace."""
    for n in nodes:
        fleet.comm(f"tp-{n}", [(n, g) for g in range(8)], slow=slow, busbw=450.0, compute=compute)
    pace = {(n, g): max(slow.get((n, k), 1.0) for k in range(8)) for n in nodes for g in range(8)}
    for g in range(8):
        fleet.comm(f"dp-{name}-{g}", [(n, g) for n in nodes], slow=pace, busbw=45.0, compute=compute)


def test_a_healthy_spread_of_gpu_speeds_is_no_straggler_however_long_the_compute() -> None:
    # 1.5 % spread between GPUs and 20 transfer times of compute between two collectives: the
    # last GPU of each node arrives 30-90 % of a transfer late, every step, and is healthy. Two
    # jobs, so that each has a class to be compared with.
    fleet = HandFleet(16)
    slow = spread(fleet.nodes, 0.015, seed=5)
    tp_job(fleet, fleet.nodes[:8], slow, compute=20.0)
    tp_job(fleet, fleet.nodes[8:], slow, compute=20.0, name="b")
    nodes, _ = blamed(fleet.run(JobLocalizer()))
    assert nodes == {}


def test_a_gpu_twelve_percent_slow_stands_out_of_that_spread() -> None:
    fleet = HandFleet(16)
    slow = spread(fleet.nodes, 0.015, seed=5)
    slow[("n03", 6)] = 1.12
    tp_job(fleet, fleet.nodes[:8], slow, compute=20.0)
    tp_job(fleet, fleet.nodes[8:], slow, compute=20.0, name="b")
    nodes, _ = blamed(fleet.run(JobLocalizer()))
    assert nodes == {"n03": {"job-straggler:rank6"}}


def test_an_expert_with_more_tokens_is_no_straggler() -> None:
    # Expert parallelism: the all-to-all waits for the expert that got the most tokens, on every
    # node and every step. Uneven by design (UNEVEN), not a slow GPU.
    fleet = HandFleet(16)
    hot = {(n, 2): 1.35 for n in fleet.nodes[:2]}  # a persistently hot expert on two nodes
    for n in fleet.nodes:
        fleet.comm(f"ep-{n}", [(n, g) for g in range(8)], collective="All2All", slow=hot, compute=4.0)
    tp_job(fleet, fleet.nodes[:8], {}, compute=4.0)
    tp_job(fleet, fleet.nodes[8:], {}, compute=4.0, name="b")
    nodes, _ = blamed(fleet.run(JobLocalizer()))
    assert nodes == {}


def three_jobs(*, nvlink: float = 1.0, network: float = 1.0) -> HandFleet:
    """Three jobs of eight nodes in two stages each (``_stages``) over one fabric; the third with
    its NVLink and its network at those ratios of the others'."""
    fleet = HandFleet(24)
    _stages(fleet, (fleet.nodes[0:4], fleet.nodes[4:8]), None, None)
    _stages(fleet, (fleet.nodes[8:12], fleet.nodes[12:16]), None, None)
    _stages(fleet, (fleet.nodes[16:20], fleet.nodes[20:24]), None, None, nvlink=nvlink, network=network)
    return fleet


def test_a_job_faster_than_its_class_on_nvlink_holds_its_network_to_the_class_only() -> None:
    # Three jobs of eight nodes over the same fabric; the third runs its tensor-parallel
    # all-reduce on NVLS (a third faster than the others' rings on NVLink). Its rings and pairs
    # are as fast as theirs: not slow for being slower than its own NVLink.
    nodes, links = blamed(three_jobs(nvlink=1.35).run(JobLocalizer()))
    assert nodes == {} and links == set()


def rail_job(
    fleet: HandFleet, *, bad: tuple[str, int] | None = None, link: tuple[str, str] | None = None
) -> None:
    """Two jobs of eight nodes, each in two pipeline stages of four: per rail a data-parallel ring
    per stage and a pipeline pair per node across the stages (the second job, healthy, is what
    the first is compared with). ``bad``: that rail at half its bandwidth; ``link``: every rail
    between those two nodes at 0.6."""
    for first in (0, 8):
        _stages(fleet, (fleet.nodes[first : first + 4], fleet.nodes[first + 4 : first + 8]), bad, link)


def _stages(
    fleet: HandFleet,
    stages: tuple[Sequence[str], Sequence[str]],
    bad: tuple[str, int] | None,
    link: tuple[str, str] | None,
    *,
    nvlink: float = 1.0,
    network: float = 1.0,
) -> None:

    def bw(members: Sequence[tuple[str, int]]) -> float:
        ratio = 1.0
        nodes = [n for n, _ in members]
        hops = {frozenset(h) for h in zip(nodes, nodes[1:] + nodes[:1], strict=True)}
        if bad is not None and bad in members:
            ratio = 0.5
        if link is not None and frozenset(link) in hops:
            ratio = min(ratio, 0.6)
        return 45.0 * ratio * network

    for n in (*stages[0], *stages[1]):
        fleet.comm(f"tp-{n}", [(n, g) for g in range(8)], busbw=450.0 * nvlink)
    for g in range(8):
        for s, stage in enumerate(stages):
            members = [(n, g) for n in stage]
            fleet.comm(f"dp{s}-{stage[0]}-{g}", members, busbw=bw(members))
        for a, b in zip(*stages, strict=True):
            members = [(a, g), (b, g)]
            fleet.comm(f"pp-{a}-{g}", members, collective="Send", busbw=bw(members))


def test_one_slow_rail_is_blamed_on_its_gpu_of_its_node() -> None:
    fleet = HandFleet(16)
    rail_job(fleet, bad=("n06", 2))
    runs = fleet.run(JobLocalizer())
    nodes, links = blamed(runs)
    assert nodes == {"n06": {"job-nic:pid1002"}} and links == set()
    (f,) = last_findings(runs, "n06")
    assert f.action == "quarantine" and f.evidence["rank"] == "pid1002"


def test_a_rail_whose_ring_is_slow_on_every_rail_is_not_that_rails_fault() -> None:
    # A slow link in stage 0 slows every rail's ring there, and a slow rail of n06 its pipeline
    # pair with n02: n02's rail 2 then has two slow communicators over different hops, and is
    # healthy (its ring is as slow on every other rail of n02).
    fleet = HandFleet(16)
    rail_job(fleet, bad=("n06", 2), link=("n00", "n01"))
    nodes, _ = blamed(fleet.run(JobLocalizer()))
    assert "n02" not in nodes
    assert nodes.get("n06") == {"job-nic:pid1002"}


def test_a_job_slow_on_every_inter_node_communicator_of_most_nodes_blames_no_nic() -> None:
    # A job whose own settings (fewer channels, another algorithm) make every ring and pair 30 %
    # slower than its class: every node's communicators are all low, over different hops. NICs
    # fail one at a time; most of a job's nodes at once is the job or its fabric.
    nodes, links = blamed(three_jobs(network=0.7).run(JobLocalizer()))
    assert nodes == {} and links == set()


def test_rows_timed_on_the_cpu_and_on_the_gpu_are_kept_apart() -> None:
    # NCCL_INSPECTOR_REQUIRE_KERNEL_TIMING=0: some collectives of a communicator are timed on the
    # CPU. A cycle reporting both for one collective and size keeps both rows, so the GPU-timed
    # one (the only one that says who arrived last) is not lost to the CPU-timed one.
    det = JobLocalizer()
    rows = tuple(
        Collective(
            comm="c",
            collective="AllReduce",
            size_bytes=1 << 20,
            n_ranks=2,
            nnodes=1,
            count=1,
            timing_source=timing,
            busbw_gbs=_stat(100.0),
            exec_time_us=_stat(50.0),
            rank=0,
        )
        for timing in ("kernel_cpu", "kernel_gpu")
    )
    jobs = Jobs(format="gpuwarden/jobs/v1", collectives=rows, records=2, dropped=0)
    report = Report(schema=SCHEMA_ID, node="n", time=T0, seq=1, boot_id="b", gpus=(), nics=(), jobs=jobs)
    det.observe_report(report, POOL, T0)
    assert sorted(row.timing for row in det._rows.values()) == ["kernel_cpu", "kernel_gpu"]


def test_a_straggler_is_counted_by_communicators_not_by_their_rows() -> None:
    # Megatron's data-parallel communicators report a reduce-scatter and an all-gather each: two
    # rows, one communicator. A node that arrives last in every one of them is a straggler node,
    # however many collectives each reports.
    def views(collectives: Sequence[tuple[str, int]]) -> list[_View]:
        out = []
        for group, nodes in (("a", ["n0", "n1", "n2", "n3"]), ("b", ["n4", "n5", "n6", "n7"])):
            for rail in range(8):
                for collective, size in collectives:
                    row = _Row(f"{group}{rail}", collective, size, 4, 4, "kernel_gpu")
                    for r, n in enumerate(nodes):
                        row.ranks[r] = _Rank(n, n, 100 + rail, rail, deque())
                    exec_us = [1500.0 + 3 * r for r in range(4)]
                    if group == "a":
                        exec_us[1] = 1000.0  # n1 last everywhere
                    else:
                        exec_us[0] = 1450.0  # a healthy last rank's lead
                    out.append(_View(row, "p", tuple(nodes), (40.0,) * 4, tuple(exec_us)))
        return out

    for collectives in ([("AllReduce", 1 << 26)], [("ReduceScatter", 1 << 26), ("AllGather", 1 << 26)]):
        found = JobLocalizer()._stragglers("job", views(collectives), {}, 0.0, [])
        assert sorted(found) == ["n1"], collectives


def test_a_node_late_because_of_one_gpu_is_judged_by_that_gpu_not_as_a_slow_node() -> None:
    # Every node's slowest GPU is 3 % behind its others (GPUs of one model spread so); n02's GPU 3
    # is 6 % behind: twice the job's typical, no fault. The node's tensor-parallel all-reduces
    # hold it to that GPU, so n02 arrives last in every data-parallel ring of its stage, ahead of
    # the other stage's last node by 3 % of a long backward pass, where the other nodes' paces do
    # not differ at all. Its lateness is that GPU's, which its own communicator shows and the
    # job's other GPUs judge; the node is not a slow node.
    fleet = HandFleet(16)
    slow = {(n, k % 8): 1.03 for k, n in enumerate(fleet.nodes)}
    slow[("n02", 3)] = 1.06
    for first in (0, 8):
        nodes = fleet.nodes[first : first + 8]
        for n in nodes:
            fleet.comm(f"tp-{n}", [(n, g) for g in range(8)], slow=slow, busbw=450.0, compute=4.0)
        pace = {(n, g): max(slow.get((n, k), 1.0) for k in range(8)) for n in nodes for g in range(8)}
        for g in range(8):
            for s, stage in enumerate((nodes[:4], nodes[4:])):
                fleet.comm(
                    f"dp{first}-{s}-{g}", [(n, g) for n in stage], slow=pace, busbw=45.0, compute=300.0
                )
            for a, b in zip(nodes[:4], nodes[4:], strict=True):  # pipeline pairs: one job
                fleet.comm(f"pp-{a}-{g}", [(a, g), (b, g)], collective="Send", busbw=45.0)
    nodes, _ = blamed(fleet.run(JobLocalizer()))
    assert nodes == {}
