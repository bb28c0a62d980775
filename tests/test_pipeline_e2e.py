"""End to end through ``Pipeline``: a simulated fleet (sim/, tests/simfleet.py) with the shipped rules.

Hard faults quarantine from the report that shows them, for the right reason; look-alikes (application
XIDs, reboots, skewed clocks, lost and duplicated reports) make no decision at all; silence makes a
node suspect and a silent rack one systemic event; a fault cleared by a reboot goes through
probation. Every decision is checked against the shared decision format (docs/spec.md,
section 2). Reports are ingested with their receive times, as the live service does.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from agent.report import Report
from aggregator.app import build_pipeline
from aggregator.config import Config
from aggregator.configload import load_config, parse_config
from aggregator.decisions import Decision, encode_decision
from aggregator.detect import SOURCES
from aggregator.model import IngestOutcome
from aggregator.pipeline import Pipeline
from aggregator.rules import default_rules_dir, load_rules
from aggregator.rules.model import Rule
from sim.scenario import Scenario
from tests.simfleet import fault, fleet, generate, rack_members

RULES: list[Rule] = load_rules([default_rules_dir()])
DEFAULTS: Config = load_config(None)
# Short periods, so a whole suspect -> healthy or quarantine -> probation -> healthy cycle fits a
# ten-minute trace.
SHORT: Config = parse_config(
    """
health: {suspect_for_seconds: 30, clear_for_seconds: 60, probation_seconds: 120}
silence: {silent_after_seconds: 30}
""",
    "test_pipeline_e2e SHORT",
)
TICK_SLACK_S = 2.0  # time-driven decisions happen on the next whole-second tick an ingest brings

_NODE_STATES = ["healthy", "suspect", "quarantined", "probation"]
_LINK_STATES = ["healthy", "suspect", "degraded"]
# The decision record of docs/spec.md section 2, as a JSON Schema.
DECISION_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "additionalProperties": False,
    "required": ["time", "subject", "node", "peer", "state", "previous", "action", "reasons"],
    "properties": {
        "time": {"type": "number"},
        "subject": {"enum": ["node", "link"]},
        "node": {"type": "string", "minLength": 1},
        "peer": {"type": ["string", "null"]},
        # Only where the node's agent sends attribution (tests/test_podresources_aggregator.py).
        "pods": {"type": "array"},
        "state": {"type": "string"},
        "previous": {"type": "string"},
        "action": {"enum": ["taint", "untaint", "none", "held"]},
        "reasons": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["detector", "rule", "severity", "summary", "evidence"],
                "properties": {
                    "detector": {"enum": list(SOURCES)},
                    "rule": {"type": ["string", "null"]},
                    "severity": {"enum": ["info", "warning", "critical"]},
                    "summary": {"type": "string", "minLength": 1},
                    "evidence": {"type": "object"},
                },
            },
        },
    },
    "allOf": [
        {
            "if": {"properties": {"subject": {"const": "node"}}},
            "then": {
                "properties": {
                    "peer": {"type": "null"},
                    "state": {"enum": _NODE_STATES},
                    "previous": {"enum": _NODE_STATES},
                }
            },
            "else": {
                "required": ["peer"],
                "properties": {
                    "peer": {"type": "string"},
                    "state": {"enum": _LINK_STATES},
                    "previous": {"enum": _LINK_STATES},
                },
            },
        }
    ],
}
_VALIDATOR = Draft202012Validator(DECISION_SCHEMA)


def assert_decision_format(decisions: Iterable[Decision]) -> None:
    for d in decisions:
        record = json.loads(encode_decision(d))  # exactly what the decision log writes
        errors = [f"{list(e.absolute_path)}: {e.message}" for e in _VALIDATOR.iter_errors(record)]
        assert not errors, f"decision {record} breaks the decision format: {errors}"
        assert d.state != d.previous, f"a decision is a change of state: {record}"


@dataclass
class Run:
    scenario: Scenario
    deliveries: list[tuple[float, Report]]
    decisions: list[Decision]
    pipeline: Pipeline
    outcomes: Counter[IngestOutcome]

    def of(self, node: str) -> list[Decision]:
        return [d for d in self.decisions if d.node == node]

    def received(self, node: str) -> list[tuple[float, Report]]:
        return [(t, r) for t, r in self.deliveries if r.node == node]

    def first(self, node: str, shows: Callable[[Report], bool]) -> tuple[float, Report]:
        """The first delivery of ``node`` whose report shows something."""
        return next((t, r) for t, r in self.received(node) if shows(r))


def run(scenario: Scenario, config: Config = DEFAULTS) -> Run:
    deliveries = list(generate(scenario))
    times = [t for t, _ in deliveries]
    assert times == sorted(times), "deliveries come in receive order"
    decisions: list[Decision] = []
    pipeline = build_pipeline(config, RULES, on_decision=decisions.append)
    outcomes: Counter[IngestOutcome] = Counter()
    for received, report in deliveries:
        outcomes[pipeline.ingest(report, received)] += 1
    assert_decision_format(decisions)
    return Run(scenario, deliveries, decisions, pipeline, outcomes)


def has_xid(code: int) -> Callable[[Report], bool]:
    return lambda r: any(e.code == code for e in r.events or ())


def transitions(decisions: Iterable[Decision]) -> list[tuple[str, str, str]]:
    return [(d.previous, d.state, d.action) for d in decisions]


# -- hard faults ----------------------------------------------------------------------------------

HARD = fleet(
    16,
    duration_s=600.0,
    seed=1,
    faults=(
        fault("xid79", 100.0, node="gpu-0001", gpu=3),
        fault("dbe", 150.0, node="gpu-0005", gpu=1),
        fault("remap_failure", 200.0, node="gpu-0009", gpu=6),
        fault("ib_port_down", 250.0, node="gpu-0013", port=2),
    ),
)


@pytest.fixture(scope="module")
def hard() -> Run:
    return run(HARD)


@dataclass(frozen=True)
class HardFault:
    node: str
    gpu: int
    rule: str
    evidence: dict[str, Any]
    shows: Callable[[Report], bool]  # the report shows the fault
    also: tuple[str, ...] = ()  # other rules the same report fires


@pytest.mark.parametrize(
    "fault",
    [
        pytest.param(HardFault("gpu-0001", 3, "xid-79", {"gpu": 3, "xid": 79}, has_xid(79)), id="xid79"),
        pytest.param(
            HardFault(
                "gpu-0005", 1, "xid-48", {"gpu": 1, "xid": 48}, has_xid(48), ("gpu-ecc-uncorrectable",)
            ),
            id="dbe",
        ),
        pytest.param(
            HardFault(
                "gpu-0009",
                6,
                "gpu-row-remap-failure",
                {"gpu": 6, "field": "remapped_rows_failure", "value": True},
                lambda r: any(g.index == 6 and g.remapped_rows_failure for g in r.gpus),
            ),
            id="remap-failure",
        ),
    ],
)
def test_a_hard_fault_quarantines_from_the_report_that_shows_it(hard: Run, fault: HardFault) -> None:
    shown_at, report = hard.first(fault.node, fault.shows)
    decisions = hard.of(fault.node)
    assert transitions(decisions) == [("healthy", "quarantined", "taint")]
    quarantine = decisions[0]
    assert quarantine.time == shown_at
    assert sorted(r.rule or "" for r in quarantine.reasons) == sorted((fault.rule, *fault.also))
    (reason,) = [r for r in quarantine.reasons if r.rule == fault.rule]
    assert (reason.detector, reason.severity) == ("rule", "critical")
    assert fault.evidence.items() <= reason.evidence.items()
    # The reason names the board, as the report that showed the fault identified it.
    uuid = next(g.uuid for g in report.gpus if g.index == fault.gpu)
    assert reason.evidence["uuid"] == uuid
    assert f"GPU {fault.gpu}" in reason.summary


def test_a_dbe_whose_xid_report_was_lost_still_quarantines_at_the_next_report() -> None:
    # The XID is an event, in one report; the uncorrectable-error counter is in every report
    # until the GPU is reset. Drop the report carrying XID 48 and the next one still takes the
    # node out, at once and for the same fault.
    run_all = run(HARD)
    shown_at, with_xid = run_all.first("gpu-0005", has_xid(48))
    deliveries = [(t, r) for t, r in run_all.deliveries if r is not with_xid]
    decisions: list[Decision] = []
    pipeline = build_pipeline(DEFAULTS, RULES, on_decision=decisions.append)
    for received, report in deliveries:
        pipeline.ingest(report, received)
    mine = [d for d in decisions if d.node == "gpu-0005"]
    assert transitions(mine) == [("healthy", "quarantined", "taint")]
    next_at = min(t for t, r in deliveries if r.node == "gpu-0005" and t > shown_at)
    assert mine[0].time == next_at
    assert [(r.rule, r.evidence.get("gpu")) for r in mine[0].reasons] == [("gpu-ecc-uncorrectable", 1)]


def test_a_lost_gpu_stays_quarantined_for_every_reason_it_shows(hard: Run) -> None:
    # After the XID 79 the GPU is gone from the reports, and NVML says it is lost: three pieces of
    # hard evidence, none of which lets the node out before a reboot.
    _, last = hard.received("gpu-0001")[-1]
    assert [g.index for g in last.gpus] == [0, 1, 2, 4, 5, 6, 7]
    assert [(e.collector, e.message.endswith("GPU is lost")) for e in last.errors or ()] == [("nvml", True)]
    health = hard.pipeline.health.get("gpu-0001")
    assert health is not None and health.state == "quarantined"
    keys = sorted(t.finding.key for t in health.active() if t.finding.action == "quarantine")
    assert keys == ["gpu-lost:gpu3", "gpu-missing:gpu3", "xid-79:gpu3"]


def test_ib_port_down_quarantines_once_down_for_its_for_period(hard: Run) -> None:
    node = "gpu-0013"
    down_received, down = hard.first(node, lambda r: r.nics[2].state == "DOWN")
    assert (down.nics[2].device, down.nics[2].phys_state) == ("mlx5_2", "Polling")
    decisions = hard.of(node)
    # The link going down is told at once (ib-link-downed, an alert); the port staying down
    # quarantines once the rule's 10 s are up: by the report 10-20 s after the first one down
    # (20 s when the report in between is lost), within the 30 s a hard fault is allowed.
    assert transitions(decisions) == [("healthy", "suspect", "none"), ("suspect", "quarantined", "taint")]
    assert decisions[0].time == down_received
    assert [r.rule for r in decisions[0].reasons] == ["ib-link-downed"]
    quarantine = decisions[1]
    report = next(r for t, r in hard.received(node) if t == quarantine.time)
    assert 10.0 <= report.time - down.time <= 10.0 + HARD.interval_s
    assert [r.rule for r in quarantine.reasons] == ["ib-port-down"]
    evidence = quarantine.reasons[0].evidence
    assert (evidence["device"], evidence["port"], evidence["value"]) == ("mlx5_2", 1, "DOWN")


def test_healthy_nodes_next_to_faulty_ones_make_no_decision(hard: Run) -> None:
    assert {d.node for d in hard.decisions} == {"gpu-0001", "gpu-0005", "gpu-0009", "gpu-0013"}
    assert hard.pipeline.node_states() == {"healthy": 12, "suspect": 0, "quarantined": 4, "probation": 0}
    assert hard.pipeline.systemic_events() == []


# -- look-alikes ----------------------------------------------------------------------------------

LOOK_ALIKES = fleet(
    16,
    duration_s=1800.0,
    seed=2,
    lost_fraction=0.01,
    duplicate_fraction=0.01,
    faults=(
        fault("app_xid", 120.0, node="gpu-0002", gpu=0, code=13),
        fault("app_xid", 300.0, node="gpu-0003", gpu=4, code=31),
        # A hung job: XID 43 then its cleanup, XID 45, on the same GPU.
        fault("app_xid", 600.0, node="gpu-0004", gpu=7, code=43),
        fault("app_xid", 601.0, node="gpu-0004", gpu=7, code=45),
        # A job bug hits every rank: the same XID on all of a node's GPUs.
        *(fault("app_xid", 900.0, node="gpu-0012", gpu=g, code=13) for g in range(8)),
        fault("reboot", 400.0, node="gpu-0006", down_s=30.0),
        fault("reboot", 1000.0, node="gpu-0011", down_s=20.0),
        fault("clock_skew", 0.0, node="gpu-0008", seconds=3600.0),
        fault("clock_skew", 0.0, node="gpu-0009", seconds=-3600.0),
    ),
)


def test_look_alikes_make_no_decision_at_all() -> None:
    result = run(LOOK_ALIKES)
    assert result.decisions == []
    assert result.pipeline.systemic_events() == []
    assert result.pipeline.node_states()["healthy"] == LOOK_ALIKES.node_count

    # ... and they did happen: the test is only as good as its look-alikes.
    events = Counter(e.code for _, r in result.deliveries for e in r.events or ())
    assert events == {13: 9, 31: 1, 43: 1, 45: 1}
    for node in ("gpu-0006", "gpu-0011"):
        boots = [r.boot_id for _, r in result.received(node)]
        assert len(set(boots)) == 2
        first_of_new_boot = next(r for r in (r for _, r in result.received(node)) if r.boot_id == boots[-1])
        assert first_of_new_boot.seq == 0
    for node, skew in (("gpu-0008", 3600.0), ("gpu-0009", -3600.0)):
        first_copies = {r.seq: r.time - t for t, r in reversed(result.received(node))}
        offsets = list(first_copies.values())
        assert all(abs(o - skew) <= LOOK_ALIKES.jitter_s + 1e-6 for o in offsets)
    assert result.outcomes[IngestOutcome.DUPLICATE] > 0
    seqs: dict[tuple[str, str], set[int]] = {}
    for _, r in result.deliveries:
        seqs.setdefault((r.node, r.boot_id), set()).add(r.seq)
    lost = sum(max(s) + 1 - len(s) for s in seqs.values())
    assert lost > 0


# -- silence --------------------------------------------------------------------------------------


def test_a_silent_node_is_suspect_and_healthy_again_once_it_reports() -> None:
    scenario = fleet(
        16, duration_s=600.0, seed=3, faults=(fault("silent_node", 120.0, node="gpu-0007", until_s=300.0),)
    )
    result = run(scenario, SHORT)
    node = "gpu-0007"
    times = [t for t, _ in result.received(node)]
    last_before = max(t for t in times if t < scenario.start + 120.0)
    first_after = min(t for t in times if t >= scenario.start + 300.0)

    decisions = result.of(node)
    assert [d.node for d in result.decisions] == [node, node]
    assert transitions(decisions) == [("healthy", "suspect", "none"), ("suspect", "healthy", "none")]
    suspect, healthy = decisions
    silent_after = SHORT.silence.after(SHORT.fleet.interval_seconds)
    assert last_before + silent_after < suspect.time <= last_before + silent_after + TICK_SLACK_S
    (reason,) = suspect.reasons
    assert (reason.detector, reason.severity) == ("silence", "warning")
    assert reason.evidence["last_received"] == last_before
    assert "systemic" not in reason.evidence
    clear_for = SHORT.health.clear_for_seconds
    assert first_after + clear_for <= healthy.time <= first_after + clear_for + TICK_SLACK_S


@pytest.mark.parametrize(
    "nodes",
    [
        16,
        32,
    ],
)
def test_a_silent_rack_is_one_systemic_event_and_no_quarantine(nodes: int) -> None:
    scenario = fleet(
        nodes, duration_s=600.0, seed=0, faults=(fault("silent_rack", 120.0, rack="rack-001", until_s=300.0),)
    )
    result = run(scenario, SHORT)
    rack = set(rack_members(scenario, "rack-001"))
    assert len(rack) == 8

    started = [e for e in result.pipeline.systemic_events() if e["state"] == "started"]
    ended = [e for e in result.pipeline.systemic_events() if e["state"] == "ended"]
    assert [(e["domain_kind"], e["domain"]) for e in started] == [("rack", "rack-001")]
    assert [(e["domain_kind"], e["domain"]) for e in ended] == [("rack", "rack-001")]
    assert set(started[0]["silent_nodes"]) <= rack
    assert len(started[0]["silent_nodes"]) > len(rack) / 2
    assert started[0]["total_nodes"] == len(rack)
    assert scenario.start + 120.0 < started[0]["time"] < ended[0]["time"]

    assert {d.node for d in result.decisions} == rack
    assert {d.state for d in result.decisions} == {"suspect", "healthy"}
    for node in rack:
        assert transitions(result.of(node)) == [
            ("healthy", "suspect", "none"),
            ("suspect", "healthy", "none"),
        ]


# -- probation ------------------------------------------------------------------------------------


def test_a_fault_cleared_by_a_reboot_goes_through_probation_then_healthy() -> None:
    scenario = fleet(
        16,
        duration_s=600.0,
        seed=4,
        faults=(
            fault("xid79", 100.0, node="gpu-0003", gpu=5),
            fault("reboot", 200.0, node="gpu-0003", down_s=30.0),
        ),
    )
    result = run(scenario, SHORT)
    node = "gpu-0003"
    xid_at, _ = result.first(node, has_xid(79))
    boots = [r.boot_id for _, r in result.received(node)]
    back_at, back = result.first(node, lambda r: r.boot_id == boots[-1])
    assert len(back.gpus) == 8  # the reboot brought the GPU back

    decisions = result.of(node)
    assert [d.node for d in result.decisions] == [node] * 3
    assert transitions(decisions) == [
        ("healthy", "quarantined", "taint"),
        ("quarantined", "probation", "none"),  # still tainted while on probation
        ("probation", "healthy", "untaint"),
    ]
    quarantined, probation, healthy = decisions
    assert quarantined.time == xid_at
    assert [r.rule for r in quarantined.reasons] == ["xid-79"]
    # Probation starts once the evidence has stayed gone for clear_for_seconds after the reboot.
    clear_s = SHORT.health.clear_for_seconds
    assert back_at + clear_s <= probation.time <= back_at + clear_s + TICK_SLACK_S
    assert probation.reasons[0].severity == "info"
    probation_s = SHORT.health.probation_seconds
    assert probation.time + probation_s <= healthy.time <= probation.time + probation_s + TICK_SLACK_S
