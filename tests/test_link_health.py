"""LinkHealth: a slow pair becomes a degraded link with hysteresis, and never taints an end."""

from __future__ import annotations

import dataclasses

import msgspec

from aggregator.decisions import Decision
from aggregator.links import DECIDED, LinkHealth
from aggregator.model import Finding

T0 = 1_764_000_000.0
PAIR = ("gpu-0013", "gpu-0014")


def slow(a: str = PAIR[0], b: str = PAIR[1], since: float = T0) -> Finding:
    return Finding(
        detector="link",
        key=f"link-pair:{a}|{b}",
        severity="warning",
        action="none",
        summary=f"the path between {a} and {b} is 35 % slow",
        since=since,
        peer=b,
        evidence={"residual_ratio": 0.65},
    )


def states(ds: list[Decision]) -> list[tuple[str, str, str | None, str]]:
    return [(d.previous, d.node, d.peer, d.state) for d in ds]


def test_persistent_slow_pair_goes_suspect_then_degraded_without_taint() -> None:
    lh = LinkHealth(suspect_for_seconds=120.0, clear_for_seconds=900.0)
    first = lh.update({PAIR: slow()}, T0)
    assert states(first) == [("healthy", *PAIR, "suspect")]
    assert lh.update({PAIR: slow()}, T0 + 60) == []
    (d,) = lh.update({PAIR: slow()}, T0 + 120)
    assert (d.subject, d.node, d.peer, d.state, d.previous, d.action) == (
        "link",
        *PAIR,
        "degraded",
        "suspect",
        "none",
    )
    (r,) = d.reasons
    assert r.detector == "link" and r.evidence["residual_ratio"] == 0.65
    assert r.evidence["persisted_seconds"] == 120.0
    # The record is the spec's: it encodes and reads back as a decision.
    assert msgspec.json.decode(msgspec.json.encode(d), type=Decision) == d


def test_slow_results_already_minutes_apart_degrade_at_once() -> None:
    # A prober that re-measures a pair ten minutes later: the localizer hears of the second slow
    # result then, and the slowness has persisted since the first.
    lh = LinkHealth(suspect_for_seconds=120.0, clear_for_seconds=900.0, confirm_for_seconds=60.0)
    out = lh.update({PAIR: slow(since=T0 - 600)}, T0)
    assert [(d.previous, d.state) for d in out] == [("healthy", "suspect")]
    # The localizer's next run says it again: the slowness has lasted 11 minutes, degraded now.
    out = lh.update({PAIR: slow(since=T0 - 600)}, T0 + 60)
    assert [(d.previous, d.state) for d in out] == [("suspect", "degraded")]
    assert out[0].reasons[0].evidence["persisted_seconds"] == 660.0
    # Evidence whose run began just now still waits out the suspect period.
    lh2 = LinkHealth(suspect_for_seconds=120.0, clear_for_seconds=900.0)
    assert [d.state for d in lh2.update({PAIR: slow(since=T0 - 30)}, T0)] == ["suspect"]
    assert [d.state for d in lh2.update({PAIR: slow(since=T0 - 30)}, T0 + 90)] == ["degraded"]


def test_a_verdict_seen_once_never_degrades_however_old_its_slow_results() -> None:
    # While a slow node recovers, the localizer may call one of its old slow pairs a link for one
    # run; that pair's slow results are old, but the verdict is not confirmed.
    lh = LinkHealth(suspect_for_seconds=120.0, clear_for_seconds=900.0, confirm_for_seconds=60.0)
    out = lh.update({PAIR: slow(since=T0 - 600)}, T0)
    for k in range(1, 20):
        out += lh.update({}, T0 + 60 * k)
    assert [d.state for d in out] == ["suspect", "healthy"]


def test_ends_are_sorted_whichever_way_the_pair_is_given() -> None:
    lh = LinkHealth()
    (d,) = lh.update({(PAIR[1], PAIR[0]): slow()}, T0)
    assert (d.node, d.peer) == PAIR
    assert lh.get(PAIR[1], PAIR[0]) is lh.get(*PAIR)


def test_evidence_that_comes_and_goes_never_degrades() -> None:
    lh = LinkHealth(suspect_for_seconds=120.0, clear_for_seconds=900.0)
    out: list[Decision] = []
    for k in range(20):  # slow every other minute: never 120 s in a row
        # Each return is a new run of slow results, with its own start.
        out += lh.update({PAIR: slow(since=T0 + 60 * k)} if k % 2 == 0 else {}, T0 + 60 * k)
    assert [d.state for d in out] == ["suspect"]


def test_degraded_heals_only_after_clear_for_seconds() -> None:
    lh = LinkHealth(suspect_for_seconds=120.0, clear_for_seconds=900.0)
    lh.update({PAIR: slow()}, T0)
    lh.update({PAIR: slow()}, T0 + 120)
    assert lh.update({}, T0 + 180) == []
    assert lh.update({}, T0 + 180 + 899) == []
    # Back within the hysteresis: stays degraded, and the clear clock starts over.
    assert lh.update({PAIR: slow()}, T0 + 1100) == []
    assert lh.update({}, T0 + 1200) == []
    assert lh.update({}, T0 + 2000) == []
    (d,) = lh.update({}, T0 + 2100)
    assert (d.previous, d.state, d.action) == ("degraded", "healthy", "none")
    assert d.reasons[0].severity == "info"
    assert lh.links() == {}


def test_suspect_that_clears_returns_to_healthy() -> None:
    lh = LinkHealth(suspect_for_seconds=600.0, clear_for_seconds=300.0)
    lh.update({PAIR: slow()}, T0)
    assert lh.update({}, T0 + 60) == []
    (d,) = lh.update({}, T0 + 360)
    assert (d.previous, d.state) == ("suspect", "healthy")


def test_pairs_are_independent() -> None:
    lh = LinkHealth(suspect_for_seconds=120.0)
    other = ("gpu-0001", "gpu-0002")
    lh.update({PAIR: slow(), other: slow(*other)}, T0)
    ds = lh.update({PAIR: slow()}, T0 + 120)
    assert states(ds) == [("suspect", *PAIR, "degraded")]
    assert lh.get(*other) is not None and lh.get(*other).state == "suspect"  # type: ignore[union-attr]


def test_a_finding_the_sequential_test_decided_degrades_on_the_confirm_run() -> None:
    # The localizer's evidence already accumulated to its threshold: only the second run's
    # confirmation is waited for, not suspect_for_seconds; a verdict seen once still never degrades.
    decided = dataclasses.replace(slow(since=T0), evidence={"residual_ratio": 0.65, DECIDED: True})
    lh = LinkHealth(suspect_for_seconds=120.0, clear_for_seconds=900.0, confirm_for_seconds=60.0)
    assert [d.state for d in lh.update({PAIR: decided}, T0)] == ["suspect"]
    assert [d.state for d in lh.update({PAIR: decided}, T0 + 60)] == ["degraded"]
    once = LinkHealth(suspect_for_seconds=120.0, clear_for_seconds=900.0, confirm_for_seconds=60.0)
    out = once.update({PAIR: decided}, T0)
    for k in range(1, 20):
        out += once.update({}, T0 + 60 * k)
    assert [d.state for d in out] == ["suspect", "healthy"]
