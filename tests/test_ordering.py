"""Which reports are new, without trusting any clock: (boot_id, run, seq), per node.

Rows of issue 16: a boot whose clock ran a day ahead must not poison the next boot (its
uncorrectable ECC error quarantines), and a report captured minutes earlier and resent is a
duplicate that keeps no dead node alive.
"""

from __future__ import annotations

import msgspec
import pytest

from agent.report import Report
from aggregator.configload import load_config
from aggregator.decisions import Decision, DecisionLog
from aggregator.model import IngestOutcome
from aggregator.ordering import RETIRED, SeqTracker
from aggregator.pipeline import Pipeline
from aggregator.rules import default_rules_dir, load_rules
from tests.test_service import NOW, make_report

RULES = load_rules([default_rules_dir()])
DEFAULTS = load_config(None)


def _report(seq: int, *, boot: str = "boot-a", run: str | None = "run-1", time_: float) -> Report:
    report = make_report(seq=seq, boot_id=boot, time_=time_)
    return msgspec.structs.replace(report, run=run) if run is not None else report


def _pipeline(decisions: list[Decision] | None = None) -> Pipeline:
    return Pipeline(
        DEFAULTS, RULES, DecisionLog(None), on_decision=None if decisions is None else decisions.append
    )


def test_a_report_replayed_minutes_later_is_a_duplicate_and_not_liveness() -> None:
    pipeline = _pipeline()
    for seq in range(70):  # 11.5 minutes of reports at 10 s
        at = NOW + 10.0 * seq
        assert pipeline.ingest(_report(seq, time_=at), at) is IngestOutcome.ACCEPTED
    node = pipeline.node("gpu-0001")
    assert node is not None
    alive_at = node["last_received"]
    # Captured 11 minutes ago and sent again, long after the node went quiet.
    late = NOW + 10.0 * 70 + 600.0
    assert pipeline.ingest(_report(3, time_=NOW + 30.0), late) is IngestOutcome.DUPLICATE
    node = pipeline.node("gpu-0001")
    assert node is not None and node["last_received"] == alive_at


def test_a_boot_whose_clock_ran_a_day_ahead_does_not_poison_the_next_boot() -> None:
    decisions: list[Decision] = []
    pipeline = _pipeline(decisions)
    ahead = 23 * 3600.0  # inside the plausibility bound of a day
    for seq in range(5):
        at = NOW + 10.0 * seq
        pipeline.ingest(_report(seq, boot="boot-fast", time_=at + ahead), at)
    # The node reboots with its clock right, and the next boot shows an uncorrectable ECC error.
    at = NOW + 100.0
    report = _report(0, boot="boot-next", run="run-2", time_=at)
    gpu = msgspec.structs.replace(report.gpus[0], ecc_dbe_volatile_total=1)
    report = msgspec.structs.replace(report, gpus=[gpu, *report.gpus[1:]])
    assert pipeline.ingest(report, at) is IngestOutcome.ACCEPTED
    health = pipeline.health.get("gpu-0001")
    assert health is not None and health.state == "quarantined"
    assert any(d.state == "quarantined" for d in decisions)
    view = pipeline.fleet.view("gpu-0001")
    assert view is not None and view.report.boot_id == "boot-next"


def test_an_agent_restart_under_the_same_boot_counts_again() -> None:
    pipeline = _pipeline()
    for seq in range(100):
        pipeline.ingest(_report(seq, time_=NOW + seq), NOW + seq)
    # The agent process restarted: seq starts over under a new run, same boot.
    assert pipeline.ingest(_report(0, run="run-2", time_=NOW + 200.0), NOW + 200.0) is IngestOutcome.ACCEPTED
    assert pipeline.ingest(_report(0, run="run-2", time_=NOW + 200.0), NOW + 201.0) is IngestOutcome.DUPLICATE


def test_an_agent_without_run_ids_is_told_apart_by_its_clock_alone() -> None:
    tracker = SeqTracker(window=8)
    for seq in range(50):
        tracker.record(_report(seq, run=None, time_=NOW + seq))
    # seq 0 again, later: the agent restarted (its only tell, without a run id).
    restarted = _report(0, run=None, time_=NOW + 100.0)
    assert tracker.is_new(restarted)
    tracker.record(restarted)
    # seq 3 from before the restart, dated back then: a replay.
    assert not tracker.is_new(_report(3, run=None, time_=NOW + 3.0))


def test_late_reports_inside_the_window_are_taken_once_and_the_time_never_matters() -> None:
    tracker = SeqTracker(window=8)
    for seq in (0, 1, 3, 4):
        tracker.record(_report(seq, time_=NOW))
    late = _report(2, time_=NOW - 86_000.0)  # any time at all
    assert tracker.is_new(late)
    tracker.record(late)
    assert not tracker.is_new(_report(2, time_=NOW + 86_000.0))
    assert tracker.is_new(_report(5, time_=NOW - 1e6))


@pytest.mark.parametrize("changing", ["boot", "run", "seq"])
def test_state_per_node_stays_bounded_whatever_one_token_sends(changing: str) -> None:
    tracker = SeqTracker(window=64, streams=4)
    for i in range(5000):
        report = _report(
            i * 1000 if changing == "seq" else i % 64,
            boot=f"boot-{i}" if changing == "boot" else "boot-a",
            run=f"run-{i}" if changing == "run" else "run-1",
            time_=NOW,
        )
        if tracker.is_new(report):
            tracker.record(report)
    assert tracker.size() <= 4 * 64 + 4 + RETIRED
    # A stream left behind stays closed: replaying its report is a duplicate.
    if changing == "boot":
        assert not tracker.is_new(_report(10, boot="boot-4990", time_=NOW))
    if changing == "run":
        assert not tracker.is_new(_report(10, run="run-4990", time_=NOW))


def test_a_seq_a_trillion_up_neither_grows_the_state_nor_reopens_the_window() -> None:
    # The seqs seen are bits below the mark: a jump must clear them, not shift them a trillion
    # places (a number of a trillion bits), and the seqs just under the new mark stay open.
    tracker = SeqTracker(window=64)
    for seq in range(10):
        tracker.record(_report(seq, time_=NOW))
    far = 10**12
    tracker.record(_report(far, time_=NOW))
    assert tracker.size() == 2  # the one seq in the window, and its stream
    assert not tracker.is_new(_report(far, time_=NOW))
    assert tracker.is_new(_report(far - 1, time_=NOW)) and tracker.is_new(_report(far - 63, time_=NOW))
    assert not tracker.is_new(_report(far - 64, time_=NOW))  # past the window: a replay
    assert not tracker.is_new(_report(5, time_=NOW))


def test_between_reports_a_node_keeps_one_full_report_and_its_rates() -> None:
    """The pipeline settles each report's view: the previous report goes (38 KB an H100 node),
    the latest stays for the next report to compare with, and the rates span both."""
    pipeline = _pipeline()
    for seq in range(3):
        at = NOW + 10.0 * seq
        pipeline.ingest(_report(seq, time_=at), at)
        history = pipeline.fleet.history("gpu-0001")
        assert history is not None and history.latest is not None and history.latest.seq == seq
        view = history.view()
        assert view is not None and view.previous is None
    report = _report(3, time_=NOW + 30.0)
    replays = (report.gpus[0].pcie_replay_total or 0) + 60
    gpu = msgspec.structs.replace(report.gpus[0], pcie_replay_total=replays)
    view = pipeline.fleet.add(msgspec.structs.replace(report, gpus=[gpu, *report.gpus[1:]]))
    assert view.previous is not None and view.previous.seq == 2
    assert view.gpu_rate(0, "pcie_replay_total", 30.0) == pytest.approx(2.0)
