"""The simulator's multi-node jobs: communicators, Inspector records, physics, and the scenario
where 95 % of the fleet is busy in them (scenarios/busy-jobs.yaml) end to end."""

from __future__ import annotations

import gzip
import json
import logging
import statistics
from pathlib import Path
from typing import Any

import pytest

from agent.errors import ConfigError
from agent.inspector import Stream, Summarizer
from aggregator.config import Config
from aggregator.replay import replayed
from aggregator.rules.model import default_rules_dir, load_rules
from sim import eval as sim_eval
from sim import scenario as scenario_mod
from sim.cli import write_trace
from sim.jobs import (
    Comm,
    Conditions,
    Hardware,
    JobFleet,
    JobSpec,
    NodeFaults,
    communicators,
    lateness,
    record,
    ring_hops,
    transfer_ratio,
)

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "nccl-inspector"
BUSY = ROOT / "scenarios" / "busy-jobs.yaml"
T0 = 1_764_000_000.0
H100 = Hardware(gpus=8, nvlink_busbw=480e9, nic_busbw=47.5e9)


def by_kind(comms: list[Comm], kind: str) -> list[Comm]:
    return [c for c in comms if c.kind == kind]


# -- communicators --------------------------------------------------------------------------------


def test_a_job_has_tp_per_node_dp_rings_per_stage_and_pp_pairs() -> None:
    comms = communicators(1, JobSpec("j", first=8, nodes=8, pp=2), 8)
    tp, dp, pp = by_kind(comms, "tp"), by_kind(comms, "dp"), by_kind(comms, "pp")
    assert len(tp) == 8 and all(c.n_ranks == 8 and c.nnodes == 1 and c.hops == () for c in tp)
    assert len(dp) == 2 * 8 and all(c.n_ranks == 4 and c.nnodes == 4 for c in dp)
    assert {c.members[0][0] for c in dp} == {"gpu-0008", "gpu-0012"}
    assert all(len({g for _, g in c.members}) == 1 for c in dp)  # one rail: GPU g of every node
    assert len(pp) == 4 * 8 and all(c.collectives == ("Send", "Recv") for c in pp)
    assert {c.hops for c in pp} == {(("gpu-0008", "gpu-0012"),), (("gpu-0009", "gpu-0013"),),
                                    (("gpu-0010", "gpu-0014"),), (("gpu-0011", "gpu-0015"),)}  # fmt: skip
    assert len({c.id for c in comms}) == len(comms)


def test_without_pipeline_stages_the_rings_span_the_whole_job() -> None:
    dp = by_kind(communicators(1, JobSpec("j", first=0, nodes=3), 8), "dp")
    assert len(dp) == 8 and all(c.nnodes == 3 for c in dp)
    assert dp[0].hops == (("gpu-0000", "gpu-0001"), ("gpu-0000", "gpu-0002"), ("gpu-0001", "gpu-0002"))


def test_ring_hops() -> None:
    assert ring_hops(["a", "b"]) == (("a", "b"),)
    assert ring_hops(["a", "a", "b", "b"]) == (("a", "b"),)
    assert ring_hops(["a"]) == ()


# -- records ---------------------------------------------------------------------------------------


def _shape(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _shape(v) for k, v in obj.items()}
    return type(obj).__name__ if not isinstance(obj, int | float) else "number"


def test_a_record_has_the_recorded_v4_0_layout() -> None:
    recorded = json.loads((FIXTURES / "v4.0-examples.jsonl").read_text().splitlines()[2])
    comm = communicators(1, JobSpec("j", first=0, nodes=4), 8)[-1]
    mine = record(comm, rank=1, collective="AllReduce", sn=7, exec_s=0.005, dump_time=T0, hostname="h", pid=9)
    assert _shape(mine) == _shape(recorded)  # the same fields, the same types, nothing more
    perf = mine["coll_perf"]
    assert perf["coll_timing_source"] == "kernel_gpu"
    # NCCL's all-reduce bus bandwidth: algorithm bandwidth x 2(n-1)/n.
    assert perf["coll_busbw_gbs"] == pytest.approx(perf["coll_algobw_gbs"] * 2 * 3 / 4, rel=1e-5)


def test_the_fast_lines_are_the_records_and_parse_as_the_agent_parses_them() -> None:
    job = JobSpec("j", first=0, nodes=4, pp=2)
    fleet = JobFleet(seed=3, start=T0, jobs=[job], hardware={"j": H100}, faults=[])
    lines = fleet.lines("gpu-0001", T0, T0 + 10.0, skew=2.5)
    # TP 8 ranks, DP 8 rings, PP 8 pairs x (Send, Recv): 32 lines per dump, two dumps.
    assert len(lines) == 64
    decoded = [json.loads(line) for line in lines]
    first = decoded[0]
    comm = next(c for c in fleet.comms if c.id == first["header"]["id"])
    again = record(
        comm,
        rank=first["header"]["rank"],
        collective=first["coll_perf"]["coll"],
        sn=first["coll_perf"]["coll_sn"],
        exec_s=first["coll_perf"]["coll_exec_time_us"] / 1e6,
        dump_time=first["metadata"]["dump_timestamp_us"] / 1e6,
        hostname=first["metadata"]["hostname"],
        pid=first["metadata"]["pid"],
    )
    for k, v in again["coll_perf"].items():
        assert first["coll_perf"][k] == (pytest.approx(v, rel=1e-6) if isinstance(v, float) else v), k
    assert first["metadata"] == again["metadata"] and first["header"] == again["header"]
    assert first["metadata"]["dump_timestamp_us"] == round((T0 + 5.0 + 2.5) * 1e6)  # the node's clock
    assert {d.get("p2p_perf", {}).get("p2p") for d in decoded} == {None, "Send", "Recv"}
    summarizer = Summarizer()
    assert Stream().feed(lines, summarizer) == []
    jobs = summarizer.take()
    assert jobs.records == 64 and jobs.dropped == 0
    assert len(jobs.collectives) == 32 and all(c.count == 2 for c in jobs.collectives)


# -- physics ---------------------------------------------------------------------------------------


def _fault(kind: str, node: str, **kw: Any) -> NodeFaults:
    return NodeFaults(
        kind=kind,
        node=node,
        peer=kw.pop("peer", None),
        gpu=kw.pop("gpu", None),
        port=None,
        job=kw.pop("job", None),
        params=kw,
        active=lambda rel: True,
    )


def _conditions(*faults: NodeFaults) -> Conditions:
    from sim.jobs import conditions_at

    return conditions_at(faults, 0.0, 8)


COMMS = communicators(1, JobSpec("j", first=0, nodes=4, pp=2), 8)  # stages (0,1) (2,3); pairs 0-2 1-3


def test_a_slow_nic_slows_every_inter_node_communicator_through_it_and_nothing_else() -> None:
    c = _conditions(_fault("slow_nic", "gpu-0000", ratio=0.7))
    slowed = {comm.id for comm in COMMS if transfer_ratio(comm, c) < 1.0}
    expected = {comm.id for comm in COMMS if comm.kind != "tp" and "gpu-0000" in {n for n, _ in comm.members}}
    assert slowed == expected and len(expected) == 16
    assert {transfer_ratio(comm, c) for comm in COMMS if comm.id in slowed} == {0.7}


def test_a_degraded_link_slows_only_what_crosses_its_hop() -> None:
    c = _conditions(_fault("degraded_link", "gpu-0000", peer="gpu-0001", ratio=0.65))
    slowed = [comm for comm in COMMS if transfer_ratio(comm, c) < 1.0]
    assert len(slowed) == 8 and all(
        comm.kind == "dp" and comm.hops == (("gpu-0000", "gpu-0001"),) for comm in slowed
    )


def test_a_slow_job_slows_all_its_communicators_alike() -> None:
    c = _conditions(_fault("slow_job", "", job="j", ratio=0.6))
    assert {transfer_ratio(comm, c) for comm in COMMS} == {0.6}


def test_a_slow_gpu_arrives_late_its_node_too_and_its_kernel_is_the_shortest() -> None:
    f = _fault("slow_gpu", "gpu-0001", gpu=5, ratio=0.85, busbw_ratio=0.9)
    c = _conditions(f)
    tp = next(comm for comm in COMMS if comm.kind == "tp" and comm.members[0][0] == "gpu-0001")
    late = lateness(tp, c, 8)
    assert late.index(max(late)) == 5 and sorted(late)[-2] == 0.0
    assert transfer_ratio(tp, c) == 0.9  # its node's NVLink ring waits on it as in the local probe
    ring = next(comm for comm in COMMS if comm.kind == "dp" and comm.members[0] == ("gpu-0000", 2))
    assert lateness(ring, c, 8)[1] == max(late)  # GPU 2 of gpu-0001 was held back by GPU 5
    fleet = JobFleet(seed=1, start=T0, jobs=[JobSpec("j", 0, 4, 2)], hardware={"j": H100}, faults=[f])
    execs = fleet.exec_times(3)
    k = fleet.comms.index(tp)
    mine = list(execs[sum(x.n_ranks for x in fleet.comms[:k]) :][:8])
    assert mine.index(min(mine)) == 5
    others = statistics.median(mine[:5] + mine[6:])
    assert others / min(mine) == pytest.approx(1 + 3 * (1 / 0.85 - 1), rel=0.05)


def test_the_same_dump_gives_every_node_the_same_collective() -> None:
    job = JobSpec("j", first=0, nodes=4, pp=2)
    a = JobFleet(seed=5, start=T0, jobs=[job], hardware={"j": H100}, faults=[])
    b = JobFleet(seed=5, start=T0, jobs=[job], hardware={"j": H100}, faults=[])
    b.lines("gpu-0003", T0, T0 + 30.0, 0.0)  # asked in another order first
    assert (a.exec_times(4) == b.exec_times(4)).all()


# -- the scenario format ---------------------------------------------------------------------------


def _base(**extra: Any) -> dict[str, Any]:
    return {"pools": [{"name": "h", "profile": "h100-sxm-80gb", "nodes": 8}], **extra}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"multinode_jobs": [{"name": "a", "first": "gpu-0006", "nodes": 4}]}, "exceed the fleet"),
        ({"multinode_jobs": [{"name": "a", "first": "gpu-0000", "nodes": 4, "pp": 3}]}, "pp must divide"),
        (
            {
                "multinode_jobs": [
                    {"name": "a", "first": "gpu-0000", "nodes": 4},
                    {"name": "b", "first": "gpu-0003", "nodes": 2},
                ]
            },
            "already in job a",
        ),
        ({"multinode_jobs": [{"name": "a", "first": "gpu-0000", "nodes": 2, "tp": 8}]}, "unknown field"),
        ({"faults": [{"kind": "slow_job", "job": "nope", "at_s": 0}]}, "unknown job 'nope'"),
        (
            {
                "multinode_jobs": [{"name": "a", "first": "gpu-0000", "nodes": 2}],
                "faults": [{"kind": "slow_job", "job": "a", "node": "gpu-0000", "at_s": 0}],
            },
            "does not apply",
        ),
    ],
)
def test_bad_jobs_are_refused_with_the_field_named(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        scenario_mod.parse(_base(**extra))


def test_job_nodes_are_busy_for_the_whole_job() -> None:
    from sim.fleet import _timelines

    s = scenario_mod.load(BUSY)
    timelines = _timelines(s)
    members = {n for j in s.multinode_jobs for n in j.node_names()}
    assert len(members) == 61  # 95 % of 64
    assert all(timelines[n].busy(s.start + t) for n in members for t in (0.0, 900.0, 1799.0))


# -- end to end ------------------------------------------------------------------------------------


def test_busy_jobs_localizes_from_job_data_alone(tmp_path: Path) -> None:
    """The issue's target on the busy fleet, its first 12 minutes (every fault starts by 5):
    the degraded link reported as a link, the slow GPU and the slow NIC quarantined, each within
    10 minutes, no false quarantine, the slow job blamed on nothing, no pair probe run."""
    logging.getLogger().setLevel(logging.ERROR)
    s = scenario_mod.load(BUSY).with_overrides(seed=2, nodes=None, minutes=12)
    trace, out = tmp_path / "trace.jsonl.gz", tmp_path / "decisions.jsonl"
    _, truth = write_trace(s, trace)
    with gzip.open(trace, "rt", encoding="utf-8") as fh:
        assert not any("nccl_allreduce_pair" in line for line in fh)  # no pair probe could run
    _, _, final = replayed(trace, out, Config(), load_rules([default_rules_dir()]))
    decisions = sim_eval.load_decisions(out)
    scored = sim_eval.score(truth, decisions)
    assert scored["quarantines"]["false"] == 0, scored["quarantines"]
    for cls in ("link", "soft"):
        c = scored["classes"][cls]
        assert c["caught"] == c["faults"], (cls, c)
        assert c["time_to_detect"]["max_s"] <= 600.0
    assert scored["links"]["true"] == scored["links"]["degraded"] == 1
    assert scored["links"]["attributed"] == 1
    slow_job = {f.node for f in truth.faults if f.kind == "slow_job"}
    assert not any(d.node in slow_job or d.peer in slow_job for d in decisions if d.state != "healthy")
    # The NIC and the slow GPU from job data (the GPU's clock tells the peer detector too, and
    # it may quarantine first): the job evidence is active on both at the end.
    for node, key in (("gpu-0018", "job-nic"), ("gpu-0026", "job-straggler:rank5")):
        health = final.pipeline.health.get(node)
        assert health is not None and health.state == "quarantined"
        assert key in health.groups.get("jobs", {}), (node, health.groups.keys())
    raw = [json.loads(line) for line in out.read_text().splitlines()]
    link = next(d for d in raw if d["subject"] == "link" and d["state"] == "degraded")
    assert link["reasons"][0]["detector"] == "jobs"
    assert link["reasons"][0]["evidence"]["job"] == "llm-c"


def test_a_slow_job_is_one_fault_in_the_truth_and_in_the_trace_check() -> None:
    from sim.eval import TraceFacts, check_inputs
    from sim.truth import Truth, TruthFault

    seen = T0 + 11.0
    entries = [TruthFault(3, "slow_job", "lookalike", f"gpu-000{i}", T0, seen, None) for i in range(4)]
    entries.append(TruthFault(4, "slow_nic", "soft", "gpu-0009", T0, T0 + 21.0, None))
    truth = Truth(1, T0, T0 + 600.0, tuple(f"gpu-{i:04d}" for i in range(10)), tuple(entries))
    # The first report that showed the slow job is one node's; the slow NIC's is there too.
    stamps = frozenset({("gpu-0002", seen), ("gpu-0009", T0 + 21.0)})
    check_inputs(truth, [], TraceFacts([], frozenset(truth.nodes), stamps))
    with pytest.raises(ConfigError, match="only 0 of the 2 reports"):
        check_inputs(truth, [], TraceFacts([], frozenset(truth.nodes), frozenset()))
    # A quarantine on a node of the slow job is a look-alike's false quarantine.
    q = sim_eval.Decision(T0 + 300.0, "node", "gpu-0001", None, "quarantined", frozenset({"jobs"}))
    assert sim_eval.score(truth, [q])["quarantines"]["false_by_cause"]["lookalike"] == 1
