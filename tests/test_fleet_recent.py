"""The node page's report history (``Pipeline.node(...)["history"]``): what the API shows of each
report, the newest 60 kept, held in a form the garbage collector does not walk."""

from __future__ import annotations

import gc
import sys
import time

import msgspec
import pytest

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


def test_kept_summaries_cost_one_tracked_object_and_a_few_kilobytes() -> None:
    recent = RecentReports(60)
    for seq in range(1, 81):
        recent.add(make_report(seq=seq, time_=NOW + 10.0 * seq), NOW + 10.0 * seq)
    gc.collect()  # a tuple of strings is untracked at its first collection
    assert len(recent) == 60
    # The list itself is the one object the collector walks: nothing it holds is tracked.
    assert not any(gc.is_tracked(o) for o in gc.get_referents(recent) if not isinstance(o, type))
    held = sys.getsizeof(recent) + sys.getsizeof(recent._numbers)
    assert held < 7_000  # 60 x 72 bytes of numbers and 120 references; 16 KB as tuples
    with pytest.raises(TypeError):
        iter(recent)


def test_summaries_across_a_reboot_without_gpus_and_with_absurd_counts() -> None:
    recent = RecentReports(3)
    first = make_report(seq=1, time_=NOW)
    recent.add(first, NOW + 1)
    no_gpus = msgspec.structs.replace(make_report(seq=1, time_=NOW + 10), boot_id="boot-b", gpus=[])
    recent.add(no_gpus, NOW + 11)
    lying = make_report(seq=2, time_=NOW + 20)
    lying = msgspec.structs.replace(
        lying,
        boot_id="boot-b",
        gpus=[msgspec.structs.replace(g, ecc_dbe_volatile_total=2**64 - 1) for g in lying.gpus],
    )
    recent.add(lying, NOW + 21)
    recent.add(make_report(seq=3, time_=NOW + 30), NOW + 31)  # the first drops out
    rows = recent.dicts()
    assert [(r["seq"], r["boot_id"]) for r in rows] == [(1, "boot-b"), (2, "boot-b"), (3, "boot-a")]
    assert rows[0]["gpus"] == 0 and rows[0]["temp_max_c"] is None and rows[0]["power_w"] == 0.0
    assert rows[1]["ecc_dbe"] == 2**64 - 1  # the column's most, not a refusal
    assert rows[2]["temp_max_c"] == 68.0
