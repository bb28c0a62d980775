"""The node page's report history (``Pipeline.node(...)["history"]``): what the API shows of each
report, the newest 60 kept, held in a form the garbage collector does not walk."""

from __future__ import annotations

import gc
import time

import msgspec

from agent.report import CollectorError
from aggregator.configload import load_config
from aggregator.decisions import DecisionLog
from aggregator.fleet.recent import RecentReports
from aggregator.pipeline import Pipeline
from aggregator.rules import default_rules_dir, load_rules
from tests.test_service import NOW, make_report


def test_node_history_shows_every_summary_field_of_the_newest_60_reports() -> None:
    pipeline = Pipeline(load_config(None), load_rules([default_rules_dir()]), DecisionLog(None))
    for seq in range(1, 71):
        report = make_report(seq=seq, time_=NOW + 10.0 * seq)
        if seq == 70:
            error = CollectorError(collector="nvml", message="NVML timed out")
            report = msgspec.structs.replace(report, errors=[error])
        pipeline.ingest(report, NOW + 10.0 * seq + 0.5)
    page = pipeline.node("gpu-0001")
    assert page is not None
    history = page["history"]
    assert [h["seq"] for h in history] == list(range(11, 71))
    last = history[-1]
    assert last == {
        "time": NOW + 700.0,
        "received": NOW + 700.5,
        "seq": 70,
        "boot_id": "boot-a",
        "gpus": 8,
        "nics": 8,
        "events": 1,  # make_report carries one event
        "errors": ["NVML timed out"],
        "temp_max_c": 68.0,  # 61 + GPU index 7
        "power_w": 8 * 612.5,
        "ecc_dbe": 0,
        "received_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(NOW + 700.5)),
    }
    assert history[0]["errors"] == []
    # The API gets fresh lists: changing one does not change what the next page shows.
    history[0]["errors"].append("x")
    again = pipeline.node("gpu-0001")
    assert again is not None and again["history"][0]["errors"] == []


def test_kept_summaries_are_not_tracked_by_the_garbage_collector() -> None:
    recent = RecentReports(60)
    for seq in range(1, 61):
        recent.add(make_report(seq=seq, time_=NOW + 10.0 * seq), NOW + 10.0 * seq)
    gc.collect()  # a tuple of plain values is untracked at its first collection
    assert len(recent) == 60
    assert not any(gc.is_tracked(row) for row in recent)
