"""The aggregator's side of GPU-to-pod attribution: the node view says who holds each GPU, and a
quarantine decision names the pods it hurts, without changing what is decided."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from agent.report import GpuAllocation, Report
from aggregator.app import build_pipeline
from aggregator.configload import load_config
from aggregator.decisions import Decision, PodOnNode, encode_decision, read_decisions
from aggregator.pipeline import Pipeline
from aggregator.rules import default_rules_dir, load_rules
from tests.rulekit import NODE, T0, gpu, report, xid

RULES = load_rules([default_rules_dir()])
CONFIG = load_config(None)


def _uuid(i: int) -> str:
    return gpu(i).uuid


TRAINER = GpuAllocation(
    namespace="ml",
    pod="trainer-0",
    container="pytorch",
    resource="nvidia.com/gpu",
    devices=[_uuid(2), _uuid(3)],
)
OTHER = GpuAllocation(
    namespace="ml", pod="eval-0", container="main", resource="nvidia.com/gpu", devices=[_uuid(5)]
)
DRA = GpuAllocation(
    namespace="serve", pod="infer", container="triton", resource="gpu.nvidia.com", devices=["gpu-7"]
)


def _with_pods(rep: Report, pods: list[GpuAllocation] | None) -> Report:
    return msgspec.structs.replace(rep, pods=pods if pods is not None else msgspec.UNSET)


def _run(reports: list[Report]) -> tuple[list[Decision], Pipeline]:
    decisions: list[Decision] = []
    pipeline = build_pipeline(CONFIG, RULES, on_decision=decisions.append)
    for rep in reports:
        pipeline.ingest(rep, rep.time)
    return decisions, pipeline


def _xid79_on_gpu3(pods: list[GpuAllocation] | None, *, later_without: bool = False) -> list[Report]:
    first = _with_pods(report(T0, seq=0), pods)
    # A report without attribution (the kubelet did not answer) keeps what was known.
    second = _with_pods(report(T0 + 10, seq=1), None if later_without else pods)
    fault = _with_pods(
        report(T0 + 20, seq=2, events=[xid(79, gpu=3, at=T0 + 19)]), None if later_without else pods
    )
    return [first, second, fault]


def test_a_quarantine_names_the_pods_and_which_the_fault_hits() -> None:
    decisions, _ = _run(_xid79_on_gpu3([TRAINER, OTHER, DRA], later_without=True))
    (d,) = decisions
    assert (d.state, d.action) == ("quarantined", "taint")
    assert d.pods == [
        PodOnNode(namespace="ml", pod="trainer-0", container="pytorch", gpus=[2, 3], hit=True),
        PodOnNode(namespace="ml", pod="eval-0", container="main", gpus=[5], hit=False),
        # A DRA device name ties to no GPU here: named, not known to be hit.
        PodOnNode(namespace="serve", pod="infer", container="triton", gpus=[], hit=False),
    ]
    record = json.loads(encode_decision(d))
    assert record["pods"][0] == {
        "namespace": "ml",
        "pod": "trainer-0",
        "container": "pytorch",
        "gpus": [2, 3],
        "hit": True,
    }


def test_the_decision_is_the_same_with_and_without_attribution() -> None:
    with_pods, _ = _run(_xid79_on_gpu3([TRAINER]))
    without, _ = _run(_xid79_on_gpu3(None))
    assert [msgspec.structs.replace(d, pods=msgspec.UNSET) for d in with_pods] == without
    # Without attribution the record is byte for byte what it was before: no "pods" key at all.
    assert b'"pods"' not in encode_decision(without[0])


def test_a_node_wide_fault_hits_every_pod() -> None:
    reports = [
        _with_pods(report(T0, seq=0), [TRAINER, OTHER]),
        _with_pods(report(T0 + 10, seq=1, events=[xid(79, gpu=None, at=T0 + 9)]), [TRAINER, OTHER]),
    ]
    decisions, _ = _run(reports)
    assert decisions and decisions[0].state == "quarantined"
    assert decisions[0].pods is not msgspec.UNSET
    assert [p.hit for p in decisions[0].pods] == [True, True]


def test_the_node_view_shows_who_holds_each_gpu() -> None:
    _, pipeline = _run(
        [_with_pods(report(T0, seq=0), [TRAINER, DRA]), _with_pods(report(T0 + 10, seq=1), None)]
    )
    view = pipeline.node(NODE)
    assert view is not None
    pods = view["pods"]
    assert pods["received"] == T0  # the last report that carried attribution
    by_gpu = {g["gpu"]: g["holders"] for g in pods["gpus"]}
    assert by_gpu[3] == [
        {"namespace": "ml", "pod": "trainer-0", "container": "pytorch", "resource": "nvidia.com/gpu"}
    ]
    assert by_gpu[0] == []
    assert [u["pod"] for u in pods["unmapped"]] == ["infer"]
    json.dumps(view)  # the API serves it as JSON


def test_a_node_without_attribution_says_none() -> None:
    _, pipeline = _run([report(T0, seq=0)])
    view = pipeline.node(NODE)
    assert view is not None and view["pods"] is None


@pytest.mark.parametrize("with_pods", [True, False])
def test_decision_logs_read_back_with_or_without_pods(tmp_path: Path, with_pods: bool) -> None:
    decisions, _ = _run(_xid79_on_gpu3([TRAINER] if with_pods else None))
    path = tmp_path / "decisions.jsonl"
    path.write_bytes(b"".join(encode_decision(d) + b"\n" for d in decisions))
    assert list(read_decisions(path)) == decisions
