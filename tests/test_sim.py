"""The fleet simulator: deterministic, schema-valid, and every fault shows up as specified."""

from __future__ import annotations

import gzip
import itertools
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import pytest

from agent.errors import ConfigError
from agent.report import Report, decode, json_schema
from aggregator.config import ProbesConfig
from sim import fleet as fleet_mod
from sim import scenario as scenario_mod
from sim import truth as truth_mod
from sim.cli import write_trace
from sim.fleet import simulate
from sim.probing import SETUP_SECONDS
from sim.profiles import H100_SXM_80GB, REASON_HW_POWER_BRAKE, REASON_HW_THERMAL, REASON_SW_POWER_CAP

REPO = Path(__file__).resolve().parents[1]
START = scenario_mod.START_TIME

BASE: dict[str, Any] = {
    "seed": 3,
    "minutes": 60,
    "interval_s": 30,
    "nodes_per_rack": 4,
    "racks_per_leaf": 2,
    "pools": [{"name": "h100", "profile": "h100-sxm-80gb", "nodes": 16}],
    # Long idle stretches so the idle-only probes run often enough to see every probe-borne fault.
    "jobs": {"busy_mean_s": 900, "idle_mean_s": 1800},
    "delivery": {"lost_fraction": 0.01, "duplicate_fraction": 0.01, "jitter_s": 2},
    "probes": {"local_every_s": 300, "pair_every_s": 120},
}
FAULTS: list[dict[str, Any]] = [
    {"kind": "xid79", "node": "gpu-0001", "gpu": 3, "at_s": 600},
    {"kind": "dbe", "node": "gpu-0002", "gpu": 5, "at_s": 900},
    {"kind": "remap_failure", "node": "gpu-0003", "gpu": 0, "at_s": 1200},
    {"kind": "ib_port_down", "node": "gpu-0004", "port": 2, "at_s": 700, "until_s": 2400},
    {"kind": "thermal", "node": "gpu-0005", "gpu": 1, "at_s": 0, "temperature_c": 82},
    {"kind": "power_brake", "node": "gpu-0006", "at_s": 600},
    {"kind": "slow_gpu", "node": "gpu-0007", "gpu": 4, "at_s": 0, "ratio": 0.85, "busbw_ratio": 0.88},
    {"kind": "pcie_downtrain", "node": "gpu-0009", "gpu": 6, "at_s": 400},
    {"kind": "nvlink_crc", "node": "gpu-0010", "gpu": 2, "at_s": 500, "link": 7},
    {"kind": "symbol_storm", "node": "gpu-0011", "port": 5, "at_s": 800},
    {"kind": "slow_nic", "node": "gpu-0012", "at_s": 0, "ratio": 0.7},
    {"kind": "degraded_link", "node": "gpu-0013", "peer": "gpu-0014", "at_s": 0, "ratio": 0.65},
    {"kind": "silent_rack", "rack": "rack-002", "at_s": 1500, "until_s": 2700},
    {"kind": "app_xid", "node": "gpu-0015", "gpu": 2, "at_s": 500, "code": 13},
    {"kind": "reboot", "node": "gpu-0000", "at_s": 1000, "down_s": 240},
    {"kind": "clock_skew", "node": "gpu-0003", "seconds": 45},
]


def _scenario(**changes: Any) -> scenario_mod.Scenario:
    return scenario_mod.parse({**BASE, "faults": FAULTS, **changes})


@pytest.fixture(scope="module")
def reports() -> list[Report]:
    return [d.report for d in simulate(_scenario())]


def _of(reports: list[Report], node: str) -> list[Report]:
    return [r for r in reports if r.node == node]


def _busy(gpu_util: float | None) -> bool:
    return gpu_util is not None and gpu_util >= 0.85


def test_same_seed_same_bytes_and_another_seed_differs(tmp_path: Path) -> None:
    s = _scenario().with_overrides(seed=None, nodes=None, minutes=20)
    write_trace(s, tmp_path / "a.jsonl.gz")
    write_trace(s, tmp_path / "b.jsonl.gz")
    write_trace(s.with_overrides(seed=4, nodes=None, minutes=None), tmp_path / "c.jsonl.gz")
    a = (tmp_path / "a.jsonl.gz").read_bytes()
    assert a == (tmp_path / "b.jsonl.gz").read_bytes()
    assert a != (tmp_path / "c.jsonl.gz").read_bytes()
    assert gzip.decompress(a).count(b"\n") > 500


def test_reports_validate_against_the_schema(tmp_path: Path) -> None:
    write_trace(_scenario(minutes=30), tmp_path / "t.jsonl")
    lines = (tmp_path / "t.jsonl").read_bytes().splitlines()
    validator = jsonschema.Draft202012Validator(json_schema())
    for line in lines:
        decode(line)
    # Every report with a probe, an event or an error, and a spread of the rest.
    sample = [x for x in lines if b'"probes"' in x or b'"events"' in x or b'"errors"' in x] + lines[::97]
    for line in sample:
        validator.validate(json.loads(line))


def test_receive_order_with_losses_and_duplicates(reports: list[Report]) -> None:
    expected = 16 * 120
    keys = [(r.node, r.boot_id, r.seq) for r in reports]
    assert len(set(keys)) < len(keys)  # some duplicated
    assert len(set(keys)) < expected - 8 * 4  # the silent rack and some lost


def test_healthy_gpus_match_the_h100_profile(reports: list[Report]) -> None:
    gpus = [g for r in _of(reports, "gpu-0008") for g in r.gpus]
    busy = [g for g in gpus if _busy(g.utilization_ratio)]
    idle = [g for g in gpus if g.utilization_ratio == 0]
    assert busy and idle
    for g in busy:
        assert g.sm_clock_hz is not None and g.sm_clock_hz >= 0.93 * H100_SXM_80GB.sm_clock_max_hz
        assert g.sm_clock_hz == H100_SXM_80GB.sm_clock_max_hz or g.clock_event_reasons == REASON_SW_POWER_CAP
        assert g.power_watts is not None and 450 <= g.power_watts <= 700
        assert g.pcie_link_gen == 5
    assert all(g.pcie_link_gen == 1 and g.power_watts is not None and g.power_watts < 85 for g in idle)
    temps = [g.temperature_celsius for g in gpus if g.temperature_celsius is not None]
    assert min(temps) >= 28 and max(temps) <= 82
    assert all(len(g.nvlink) == 18 for g in gpus if not isinstance(g.nvlink, type(None)))


def test_local_and_pair_probes_have_realistic_busbw(reports: list[Report]) -> None:
    healthy = {f"gpu-{i:04d}" for i in (8, 9, 10, 11, 15)}
    local = [
        p.busbw_bytes_per_second
        for r in reports
        if r.node in healthy
        for p in r.probes or ()
        if p.kind == "nccl_allreduce_local"
    ]
    assert len(local) >= 10
    assert 440e9 < statistics.median(local) < 520e9
    pair = [p for r in reports for p in r.probes or () if p.kind == "nccl_allreduce_pair"]
    good = [
        p.busbw_bytes_per_second
        for r in reports
        if r.node in healthy
        for p in r.probes or ()
        if p.kind == "nccl_allreduce_pair" and p.peer in healthy
    ]
    assert good and 360e9 < statistics.median(good) < 400e9
    # Both ends report a pair probe: the same measurement under each end's name.
    ends = {(r.node, p.peer, p.busbw_bytes_per_second) for r in reports for p in r.probes or () if p.peer}
    both = sum((peer, node, bw) in ends for node, peer, bw in ends)
    assert both >= 0.9 * len(ends) and len(pair) > 40


def test_hard_faults(reports: list[Report]) -> None:
    xid79 = _of(reports, "gpu-0001")
    hit = next(i for i, r in enumerate(xid79) if any(e.code == 79 for e in r.events or ()))
    assert xid79[hit].time >= START + 600
    assert all(len(r.gpus) == 7 and r.errors for r in xid79[hit + 2 :])
    assert any(p.ok is False for r in xid79[hit + 1 :] for p in r.probes or ())
    dbe = _of(reports, "gpu-0002")
    assert any(e.code == 48 for r in dbe for e in r.events or ())
    assert dbe[-1].gpus[5].ecc_dbe_volatile_total == 1 and dbe[-1].gpus[5].remapped_rows_pending
    remap = _of(reports, "gpu-0003")
    assert remap[-1].gpus[0].remapped_rows_failure and not remap[0].gpus[0].remapped_rows_failure
    port = _of(reports, "gpu-0004")
    down = [r for r in port if r.nics[2].state == "DOWN"]
    assert down and all(START + 700 <= r.time < START + 2400 + 31 for r in down)
    assert port[-1].nics[2].state == "ACTIVE" and port[-1].nics[2].counters["link_downed"] == 1


def test_soft_faults(reports: list[Report]) -> None:
    hot = [r.gpus[1] for r in _of(reports, "gpu-0005") if _busy(r.gpus[1].utilization_ratio)]
    assert hot and all(g.clock_event_reasons and g.clock_event_reasons & REASON_HW_THERMAL for g in hot)
    assert max(g.temperature_celsius or 0 for g in hot) >= 78 and all(
        (g.temperature_celsius or 0) < 85 for g in hot
    )
    brake = [g for r in _of(reports, "gpu-0006") if r.time >= START + 600 for g in r.gpus]
    assert brake and all(
        g.clock_event_reasons and g.clock_event_reasons & REASON_HW_POWER_BRAKE for g in brake
    )
    slow = [r.gpus[4] for r in _of(reports, "gpu-0007") if _busy(r.gpus[4].utilization_ratio)]
    assert slow
    for g in slow:
        assert 0.8 <= (g.sm_clock_hz or 0) / H100_SXM_80GB.sm_clock_max_hz <= 0.9
        assert g.clock_event_reasons == 0  # no reason given: the silent kind
    slow_local = [
        p.busbw_bytes_per_second or 0
        for r in _of(reports, "gpu-0007")
        for p in r.probes or ()
        if p.kind == "nccl_allreduce_local"
    ]
    assert slow_local and statistics.median(slow_local) < 0.93 * 480e9
    pcie = [r.gpus[6] for r in _of(reports, "gpu-0009") if r.time > START + 400]
    assert all(g.pcie_link_width == 8 and g.pcie_link_width_max == 16 for g in pcie)
    crc = [r.gpus[2].nvlink[7].crc_flit_errors_total or 0 for r in _of(reports, "gpu-0010")]
    assert crc[0] == 0 and crc[-1] > 1000 and crc == sorted(crc)
    sym = [r.nics[5].counters["symbol_error"] for r in _of(reports, "gpu-0011")]
    assert sym[-1] > 50_000


def test_slow_nic_and_degraded_link_in_pair_probes(reports: list[Report]) -> None:
    def pair_bw(node: str, keep: Callable[[str], bool]) -> list[float]:
        return [
            p.busbw_bytes_per_second or 0
            for r in _of(reports, node)
            for p in r.probes or ()
            if p.kind == "nccl_allreduce_pair" and p.ok and p.peer is not None and keep(p.peer)
        ]

    # (Pairs with gpu-0001 fail once its GPU is lost: no bandwidth, left out here. gpu-0004's
    # own port is down for a while, 7/8 of the bandwidth on its side: with the slow NIC that is
    # 0.7 x 0.875, both faults at once, checked below.)
    nic = pair_bw("gpu-0012", lambda peer: peer not in {"gpu-0013", "gpu-0014", "gpu-0004"})
    assert len({round(b) for b in nic}) >= 2  # with several partners
    assert all(0.6 * 380e9 < b < 0.8 * 380e9 for b in nic)
    link = pair_bw("gpu-0013", lambda peer: peer == "gpu-0014")
    assert link and all(0.55 * 380e9 < b < 0.72 * 380e9 for b in link)
    # gpu-0004 runs on 7 of 8 rails while its port is down: 7/8 of the bandwidth with anyone.
    others = pair_bw("gpu-0013", lambda peer: peer not in {"gpu-0014", "gpu-0012", "gpu-0004"})
    assert others and all(b > 0.9 * 380e9 for b in others)
    # Two faults on one pair multiply: the slow NIC with gpu-0004 while its port is down.
    both = [
        p.busbw_bytes_per_second or 0
        for r in _of(reports, "gpu-0012")
        if START + 700 <= r.time < START + 2400
        for p in r.probes or ()
        if p.kind == "nccl_allreduce_pair" and p.ok and p.peer == "gpu-0004"
    ]
    assert all(0.7 * 0.875 * 0.9 * 380e9 < b < 0.7 * 0.875 * 1.1 * 380e9 for b in both)


def test_silent_rack_and_lookalikes(reports: list[Report]) -> None:
    for node in ("gpu-0008", "gpu-0011"):
        times = [r.time for r in _of(reports, node)]
        assert not [t for t in times if START + 1500 <= t < START + 2700]
        assert max(times) > START + 2700
    app = [e for r in _of(reports, "gpu-0015") for e in r.events or ()]
    assert [e.code for e in app] == [13]
    rebooted = _of(reports, "gpu-0000")
    boots = list(dict.fromkeys(r.boot_id for r in rebooted))
    assert len(boots) == 2
    second = [r for r in rebooted if r.boot_id == boots[1]]
    assert second[0].seq == 0 and second[0].time >= START + 1240
    assert (
        second[0].nics[0].counters["port_xmit_data"] < rebooted[0].nics[0].counters["port_xmit_data"] + 10**12
    )
    skewed = _of(reports, "gpu-0003")
    assert skewed[0].time - START >= 45


def test_truth_records_every_fault_with_when_it_first_showed(tmp_path: Path, reports: list[Report]) -> None:
    _, truth = write_trace(_scenario(), tmp_path / "t.jsonl")
    by_kind = {f.kind: f for f in truth.faults}
    assert {f.fault_class for f in truth.faults} == {"hard", "soft", "link", "silent", "lookalike"}
    assert len([f for f in truth.faults if f.kind == "silent_rack"]) == 4
    for f in truth.faults:
        if f.kind in ("silent_rack", "clock_skew"):
            continue
        assert f.first_seen is not None, f.kind
        # The first report that shows it: a soft fault that shows only under load waits for a job.
        assert f.start <= f.first_seen <= truth.end, f.kind
        # The node's own report, or (a pair probe) its partner's report of a probe with it.
        showing = {
            r.time for r in reports if r.node == f.node or any(p.peer == f.node for p in r.probes or ())
        }
        assert f.first_seen in showing, f.kind
    assert by_kind["degraded_link"].peer == "gpu-0014" and by_kind["ib_port_down"].end == START + 2400
    assert (
        by_kind["xid79"].first_seen is not None and by_kind["xid79"].first_seen - by_kind["xid79"].start < 35
    )


def test_the_example_scenarios_load() -> None:
    files = sorted((REPO / "scenarios").glob("*.yaml"))
    assert files
    for path in files:
        assert scenario_mod.load(path).node_count > 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"faults": [{"kind": "meltdown", "node": "gpu-0001", "at_s": 1}]}, "kind must be one of"),
        ({"faults": [{"kind": "xid79", "node": "gpu-0099", "gpu": 0, "at_s": 1}]}, "unknown node 'gpu-0099'"),
        (
            {"faults": [{"kind": "thermal", "node": "gpu-0001", "gpu": 0, "at_s": 1, "temperature_c": 90}]},
            "85 C",
        ),
        ({"faults": [{"kind": "xid79", "node": "gpu-0001", "at_s": 1}]}, "missing gpu"),
        (
            {"faults": [{"kind": "degraded_link", "node": "gpu-0001", "peer": "gpu-0009", "at_s": 1}]},
            "same leaf",
        ),
        (
            {"faults": [{"kind": "degraded_link", "leaf": "leaf-01", "node": "gpu-0009", "at_s": 1}]},
            "either leaf or node and peer",
        ),
        ({"faults": [{"kind": "degraded_link", "leaf": "leaf-07", "at_s": 1}]}, "unknown leaf 'leaf-07'"),
        (
            {"faults": [{"kind": "slow_nic", "node": "gpu-0001", "leaf": "leaf-00", "at_s": 1}]},
            "leaf does not apply",
        ),
        ({"pools": [{"name": "x", "profile": "b200", "nodes": 2}]}, "profile must be one of"),
        ({"colour": "blue"}, "unknown field(s) colour"),
    ],
)
def test_bad_scenarios_are_refused_with_the_reason(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        scenario_mod.parse({**BASE, **change})


def test_overrides_resize_pools_and_shorten(tmp_path: Path) -> None:
    data = {
        **BASE,
        "pools": [
            {"name": "h", "profile": "h100-sxm-80gb", "nodes": 6},
            {"name": "a", "profile": "a100-sxm-80gb", "nodes": 2},
        ],
    }
    s = scenario_mod.parse(data).with_overrides(seed=None, nodes=20, minutes=5)
    assert [p.nodes for p in s.pools] == [15, 5] and s.duration_s == 300
    a100 = [r for r in (d.report for d in simulate(s)) if r.labels and r.labels["pool"] == "a"]
    assert a100 and all(g.power_limit_watts == 400 and len(g.nvlink) == 12 for r in a100 for g in r.gpus)
    assert {r.nics[0].rate_bytes_per_second for r in a100} == {2.5e10}


# The probe scheduler's confirm step (issue 6): a suspicious pair result is re-probed at once.
IDLE_LEAF: dict[str, Any] = {
    **BASE,
    "pools": [{"name": "h100", "profile": "h100-sxm-80gb", "nodes": 8}],
    # Idle throughout, so every planned probe runs and the re-probes are what changes.
    "jobs": {"busy_mean_s": 1, "idle_mean_s": 1e9},
    "delivery": {"lost_fraction": 0, "duplicate_fraction": 0, "jitter_s": 2},
    "probes": {"local_every_s": 300, "pair_every_s": 600},
}
PAIR_EVERY = 600.0


def _pair_results(s: scenario_mod.Scenario) -> list[tuple[float, str, str, float]]:
    """Every pair measurement once: (time, end, end, busbw), from both ends' reports."""
    seen: set[tuple[float, str, str, float]] = set()
    for d in simulate(s):
        for p in d.report.probes or ():
            if p.kind == "nccl_allreduce_pair" and p.peer is not None:
                a, b = sorted((d.report.node, p.peer))
                seen.add((p.time, a, b, p.busbw_bytes_per_second or 0.0))
    return sorted(seen)


def test_a_degraded_pair_is_probed_again_soon_after_its_first_slow_result() -> None:
    link = {"kind": "degraded_link", "node": "gpu-0001", "peer": "gpu-0002", "at_s": 0, "ratio": 0.65}
    results = _pair_results(scenario_mod.parse({**IDLE_LEAF, "faults": [link]}))
    pair = [(t, bw) for t, a, b, bw in results if (a, b) == ("gpu-0001", "gpu-0002")]
    first = pair[0][0]
    assert pair[0][1] < 0.7 * 380e9
    # The circle method alone brings the pair back only after 7 rounds of 10 minutes.
    soon = [bw for t, bw in pair if t <= first + 2 * PAIR_EVERY]
    assert len(soon) >= 2 and all(bw < 0.7 * 380e9 for bw in soon)
    # Each end is also tried with fresh partners, so the localizer can tell a link from a node.
    for end in ("gpu-0001", "gpu-0002"):
        partners = {
            b if a == end else a for t, a, b, _ in results if end in (a, b) and t <= first + PAIR_EVERY
        }
        assert len(partners) >= 3


def test_a_slow_nic_gets_fresh_partners_and_no_node_is_in_two_probes_at_once() -> None:
    nic = {"kind": "slow_nic", "node": "gpu-0003", "at_s": 0, "ratio": 0.7}
    results = _pair_results(scenario_mod.parse({**IDLE_LEAF, "faults": [nic]}))
    mine = [(t, b if a == "gpu-0003" else a) for t, a, b, _ in results if "gpu-0003" in (a, b)]
    # The scheduler judges "slow" against the pool's expected bandwidth, which it knows once it
    # has 5 results (ProbesConfig.expected_min_results): from the first slow result after that,
    # one rotation partner becomes at least three within half a round (the confirm step).
    known = sorted(t for t, *_ in results)[4]
    first = next(t for t, _ in mine if t > known)
    assert len({peer for t, peer in mine if first <= t <= first + PAIR_EVERY / 2}) >= 3
    for node in sorted({n for _, a, b, _ in results for n in (a, b)}):
        times = sorted(t for t, a, b, _ in results if node in (a, b))
        # A probe holds its nodes until its result is in; the next one starts start_delay later
        # and runs SETUP_SECONDS: measurements of one node are never closer than both.
        gap = ProbesConfig().start_delay_seconds + SETUP_SECONDS
        assert all(later - earlier >= gap for earlier, later in itertools.pairwise(times))
    # Bounded: far fewer than one re-probe per node per agent cycle.
    assert len(results) < 2 * len(_pair_results(scenario_mod.parse({**IDLE_LEAF, "faults": []})))


def test_a_healthy_fleet_triggers_no_re_probes() -> None:
    results = _pair_results(scenario_mod.parse({**IDLE_LEAF, "faults": []}))
    # 6 rounds of 4 disjoint pairs, nothing more: 1.5 % noise never reaches the 15 % threshold.
    assert len(results) == 6 * 4
    assert all(bw > 0.9 * 380e9 for *_, bw in results)


def test_re_probes_are_deterministic() -> None:
    faults = [
        {"kind": "slow_nic", "node": "gpu-0003", "at_s": 0, "ratio": 0.7},
        {"kind": "degraded_link", "node": "gpu-0001", "peer": "gpu-0002", "at_s": 300, "ratio": 0.65},
    ]
    s = scenario_mod.parse({**BASE, "pools": IDLE_LEAF["pools"], "faults": faults})
    a, b = _pair_results(s), _pair_results(s)
    assert a == b and len(a) > 10
    first = [msgspec.json.encode(d.report) for d in simulate(s)]
    assert first == [msgspec.json.encode(d.report) for d in simulate(s)]
    assert _pair_results(s.with_overrides(seed=9, nodes=None, minutes=None)) != a


def test_pair_probes_run_only_when_both_ends_are_idle_and_up(reports: list[Report]) -> None:
    # The real scheduler plans them (sim/probing.py) from what the aggregator hears: a probe
    # never lands on a job, nor on a node that is down (gpu-0000 reboots at 1000 s for 240 s).
    s = _scenario()
    timelines = {n: fleet_mod._timeline(s, n) for n in s.node_names()}
    pairs = {
        (p.time, *sorted((r.node, p.peer)))
        for r in reports
        for p in r.probes or ()
        if p.kind == "nccl_allreduce_pair" and p.peer is not None and "gpu-0003" not in (r.node, p.peer)
    }
    assert len(pairs) > 50
    for t, a, b in pairs:
        assert not timelines[a].busy(t) and not timelines[b].busy(t), (t - START, a, b)
        assert not ("gpu-0000" in (a, b) and START + 1000 <= t < START + 1240), (t - START, a, b)


# A link given by its leaf (scenarios/fleet64.yaml): placed where the probes can see it.
BUSY_LEAF: dict[str, Any] = {
    **BASE,
    "minutes": 30,
    "pools": [{"name": "h100", "profile": "h100-sxm-80gb", "nodes": 8}],
    # Busy most of the time: a fixed pair is rarely idle at once, which is why placement exists.
    "jobs": {"busy_mean_s": 1200, "idle_mean_s": 600},
    "probes": {"local_every_s": 300, "pair_every_s": 60},
}


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_a_link_given_by_its_leaf_lands_on_healthy_ends_the_probes_measure(tmp_path: Path, seed: int) -> None:
    faults = [
        {"kind": "slow_nic", "node": "gpu-0002", "at_s": 0, "ratio": 0.7},
        {"kind": "degraded_link", "leaf": "leaf-00", "at_s": 120, "ratio": 0.65},
    ]
    s = scenario_mod.parse({**BUSY_LEAF, "seed": seed, "faults": faults})
    placed = fleet_mod.place(s)
    assert fleet_mod.place(placed) == placed and fleet_mod.place(s) == placed  # once, and the same again
    link = placed.faults[1]
    assert link.node is not None and link.peer is not None and link.node < link.peer
    assert "gpu-0002" not in (link.node, link.peer)  # the slow NIC's node is not a healthy end
    _, truth = write_trace(s, tmp_path / "t.jsonl")
    (found,) = [f for f in truth.faults if f.kind == "degraded_link"]
    assert (found.node, found.peer) == (link.node, link.peer)
    # Measured after the onset, and slow when it is.
    assert found.first_seen is not None and START + 120 <= found.first_seen < START + 120 + (1800 - 120) / 2
    slow = [
        (t, bw) for t, a, b, bw in _pair_results(s) if (a, b) == (link.node, link.peer) and t >= START + 120
    ]
    assert slow and all(bw < 0.7 * 380e9 for _, bw in slow)


def test_a_link_given_by_its_leaf_is_placed_per_seed() -> None:
    link = {"kind": "degraded_link", "leaf": "leaf-00", "at_s": 120}
    ends = {
        (f.node, f.peer)
        for seed in range(1, 7)
        for f in fleet_mod.place(scenario_mod.parse({**BUSY_LEAF, "seed": seed, "faults": [link]})).faults
    }
    assert len(ends) >= 3


def test_truth_of_an_unplaced_scenario_is_refused() -> None:
    s = scenario_mod.parse({**BUSY_LEAF, "faults": [{"kind": "degraded_link", "leaf": "leaf-00", "at_s": 1}]})
    with pytest.raises(ValueError, match="not placed"):
        truth_mod.build(s, {})


def test_a_node_whose_gpu_fell_off_gets_no_pair_probes(reports: list[Report]) -> None:
    # gpu-0001 loses GPU 3 at 600 s (XID 79, no reboot after): its reports carry an NVML error
    # from then on, which the probe scheduler reads as "not idle", so no partner's idle minutes go
    # to an all-reduce that would fail.
    lost_at = START + 600
    before = [
        p for r in reports if r.node == "gpu-0001" for p in r.probes or () if p.peer and p.time < lost_at
    ]
    after = [
        p
        for r in reports
        for p in r.probes or ()
        if p.peer is not None and "gpu-0001" in (r.node, p.peer) and p.time > lost_at + 60
    ]
    assert before and after == []
