"""A report's frame slot is when it was measured on the aggregator's clock, not when it was taken
off a backlog (aggregator/fleet/sendtime.py), and a node's clock can never move its pool's slots."""

from __future__ import annotations

import math
import random

import msgspec
import numpy as np

from agent.report import Probe
from aggregator.config import Config
from aggregator.decisions import DecisionLog
from aggregator.fleet.sendtime import MEMORY_SECONDS, SendTime
from aggregator.pipeline import Pipeline
from aggregator.rules import default_rules_dir, load_rules
from tests.rulekit import edit_gpu, report

T0 = 1_800_000_000.0
INTERVAL = 10.0  # the default interval


def test_a_report_on_time_is_slotted_at_its_receipt_exactly() -> None:
    s = SendTime()
    for k in range(100):
        t = T0 + k * INTERVAL + 0.3
        received = t + 0.02 + (0.001 * (k % 3) if k else 0.0)
        assert s.place(t, received) <= received
    # Delivered as fast as ever: the receipt itself (replay passes corrected times as receipts).
    t = T0 + 100 * INTERVAL + 0.3
    assert s.place(t, t + 0.02) == t + 0.02


def test_a_growing_backlog_keeps_one_report_a_slot() -> None:
    # The aggregator falls behind: each report waits 4 s longer than the one before. By receipt
    # a report would land a slot further on every few reports, leaving slots with nothing of the
    # node (and, as a backlog drains, two reports in one); by measurement each lands in its own,
    # at its first delivery's delay.
    s = SendTime()
    slots = []
    for k in range(25):  # up to 100 s behind
        t = T0 + k * INTERVAL + 1.0
        placed = s.place(t, t + 0.5 + 4.0 * k)
        assert placed == t + 0.5
        slots.append(math.floor(placed / INTERVAL))
    assert slots == list(range(slots[0], slots[0] + 25))
    by_receipt = [math.floor((T0 + k * INTERVAL + 1.0 + 0.5 + 4.0 * k) / INTERVAL) for k in range(25)]
    assert by_receipt[-1] - by_receipt[0] > 24  # what receipt slotting did: gaps


def test_a_node_clock_far_ahead_never_moves_the_slots_past_the_receipt() -> None:
    s = SendTime()
    for k in range(10):
        received = T0 + k * INTERVAL
        assert s.place(received + 3600.0, received) == received  # an hour ahead: the receipt


def test_a_clock_stepped_back_or_a_long_outage_flushed_is_slotted_at_receipt() -> None:
    s = SendTime()
    for k in range(10):
        t = T0 + k * INTERVAL
        assert s.place(t, t + 0.01) == t + 0.01
    # NTP steps the node's clock an hour back: its reports now look an hour late, longer than any
    # backlog this remembers, so each is slotted at its receipt...
    received = T0 + 10 * INTERVAL
    for k in range(int(2 * MEMORY_SECONDS / INTERVAL)):
        assert s.place(received + k * INTERVAL - 3600.0, received + k * INTERVAL) == received + k * INTERVAL
    # ... and a spool flushed after a long outage, then reports on time, the same way.
    flushed = SendTime()
    for k in range(10):
        flushed.place(T0 + k * INTERVAL, T0 + k * INTERVAL)
    back = T0 + 100 * INTERVAL
    assert [flushed.place(T0 + k * INTERVAL, back) for k in range(10, 100)] == [back] * 60 + [
        T0 + k * INTERVAL for k in range(70, 100)
    ]


def test_a_backlog_is_remembered_for_one_to_two_memory_spans() -> None:
    # A node whose delay rises by 20 s for good (a slower path, a clock stepped back 20 s) is
    # slotted 20 s early until its fast deliveries leave the filter, then at its receipt again.
    s = SendTime()
    t = T0
    for _ in range(30):
        s.place(t, t)
        t += INTERVAL
    placed_early = []
    for _ in range(int(3 * MEMORY_SECONDS / INTERVAL)):
        placed_early.append(s.place(t, t + 20.0) < t + 20.0)
        t += INTERVAL
    assert placed_early[0]
    assert not any(placed_early[int(2 * MEMORY_SECONDS / INTERVAL) + 1 :])


def _frames_after(delays: list[float]) -> tuple[list[str], np.ndarray]:
    """Eight nodes, 40 reports each at their own phase, power changing every report; delivered
    ``delays[k]`` after round k was measured, in receipt order."""
    p = Pipeline(Config(), load_rules([default_rules_dir()]), DecisionLog(None))
    p.advance_on_ingest = False
    rng = random.Random(3)
    phases = {f"n{i}": rng.uniform(0.0, 5.0) for i in range(8)}
    items = []
    for k, delay in enumerate(delays):
        for node, phase in phases.items():
            t = T0 + k * INTERVAL + phase
            items.append((t + delay, t, node, k))
    for received, t, node, k in sorted(items):
        rep = edit_gpu(report(t, node=node, seq=k), 0, power_watts=300.0 + 10.0 * k + phases[node])
        p.ingest(rep, received)
    pool = p.frames.pools()[0]
    return p.frames.snapshot(pool, T0, T0 + len(delays) * INTERVAL)


def test_a_pool_frame_holds_the_same_values_behind_a_backlog_as_on_time() -> None:
    on_time = _frames_after([0.05] * 40)
    # Within 3 s the first round; 78 s behind by the last (well inside MEMORY_SECONDS).
    behind = _frames_after([0.05 + 2.0 * k for k in range(40)])
    assert on_time[0] == behind[0]
    assert np.array_equal(on_time[1], behind[1], equal_nan=True)


def test_both_ends_copies_of_a_probe_count_once_when_one_end_waits_behind_a_backlog() -> None:
    # Two nodes report every 10 s. They ran one pair probe together; a's report of it arrives on
    # time, b's a minute late (the aggregator fell behind just then), more than the localizer's
    # dedupe window (30 s). Dated by receipt, b's copy was a second measurement of the pair a
    # minute later; dated when measured, it is the same one.
    p = Pipeline(Config(), load_rules([default_rules_dir()]), DecisionLog(None))
    p.advance_on_ingest = False
    late = {"b": 60.0}
    items = []
    for k in range(12):
        for node, phase in (("a", 0.4), ("b", 3.1)):
            t = T0 + k * INTERVAL + phase
            items.append((t + 0.05 + (late.get(node, 0.0) if k == 11 else 0.0), t, node, k))
    probe_time = T0 + 10 * INTERVAL + 5.0
    for received, t, node, k in sorted(items):
        rep = report(t, node=node, seq=k)
        if k == 11:
            peer = "b" if node == "a" else "a"
            probe = Probe(
                kind="nccl_allreduce_pair", time=probe_time, ok=True, peer=peer, busbw_bytes_per_second=380e9
            )
            rep = msgspec.structs.replace(rep, probes=[probe])
        p.ingest(rep, received)
    (row,) = p.link_matrix()
    assert (row["a"], row["b"]) == ("a", "b")
    # One sample: the newest is a's copy, dated when it was measured on the aggregator's clock.
    assert math.isclose(row["time"], probe_time + 0.05)
