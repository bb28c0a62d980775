"""The independent trace generator (bench/othergen.py): schema-exact, deterministic, truthful.

A trace scored against its truth is only worth as much as the truth: each fault must be where the
truth says, visible from when it says, and healthy counters must behave as hardware counters do.
One small fleet (32 nodes, 30 minutes at 30 s) is generated once per module to keep this file fast.
"""

from __future__ import annotations

import gzip
import itertools
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import msgspec
import othergen  # bench/othergen.py, as bench/detection.py imports it
import pytest

from agent.report import decode
from aggregator.service import plausibility_errors
from sim.truth import CLASSES, Truth, TruthFault
from sim.truth import load as load_truth

SEED = 5
KW: dict[str, Any] = {"nodes": 32, "minutes": 30, "interval_s": 30.0}

Reports = list[dict[str, Any]]


@pytest.fixture(scope="module")
def trace() -> tuple[Reports, Truth]:
    return othergen.generate(SEED, **KW)


def _fault(truth: Truth, kind: str) -> TruthFault:
    found = [f for f in truth.faults if f.kind == kind]
    assert len(found) == 1, f"expected one {kind}, got {found}"
    return found[0]


def _of(reports: Reports, node: str) -> Reports:
    return [r for r in reports if r["node"] == node]


def _encode(r: dict[str, Any]) -> bytes:
    return msgspec.json.encode(r)


def test_every_report_decodes_strictly_and_is_plausible(trace: tuple[Reports, Truth]) -> None:
    reports, _ = trace
    assert len(reports) > 32 * 55
    for r in reports:
        report = decode(_encode(r))  # strict: unknown fields, wrong types and ranges are refused
        assert plausibility_errors(report) == []
        assert report.agent_version == "othergen"
        assert report.interval_seconds == 30.0
        assert set(r["labels"]) == {"pool", "rack", "leaf"}
        # Unsupported fields are present and null, never left out.
        for gpu in r["gpus"]:
            assert gpu["retired_pages_sbe"] is None and "retired_pages_pending" in gpu


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    small: dict[str, Any] = {"nodes": 32, "minutes": 10, "interval_s": 30.0}
    a, truth_a = othergen.generate(11, **small)
    b, truth_b = othergen.generate(11, **small)
    c, truth_c = othergen.generate(12, **small)
    assert [_encode(r) for r in a] == [_encode(r) for r in b]
    assert truth_a == truth_b
    assert [_encode(r) for r in a] != [_encode(r) for r in c]
    assert truth_a.faults != truth_c.faults


def test_truth_is_well_formed(trace: tuple[Reports, Truth]) -> None:
    reports, truth = trace
    names = set(truth.nodes)
    assert names == {r["node"] for r in reports}
    assert all(n.startswith("node-a") for n in names)
    kinds = {f.kind for f in truth.faults}
    assert kinds == {
        "xid79", "dbe", "remap_failure", "ib_port_down", "thermal", "power_brake", "slow_gpu",
        "pcie_downtrain", "nvlink_crc", "symbol_storm", "slow_nic", "degraded_link", "silent_rack",
        "app_xid", "reboot", "clock_skew",
    }  # fmt: skip
    for f in truth.faults:
        assert f.fault_class in CLASSES
        assert f.node in names and (f.peer is None or f.peer in names)
        assert truth.start <= f.start < truth.end
        if f.first_seen is not None:
            assert f.first_seen >= f.start
        if f.fault_class in ("hard", "soft", "link"):
            assert f.start <= truth.start + 0.5 * (truth.end - truth.start), f"{f.kind} starts late"
    # Every fault but the look-alikes and the silence sits on its own node(s).
    owners = [f.node for f in truth.faults] + [f.peer for f in truth.faults if f.peer]
    assert len(owners) == len(set(owners))
    silent = [f for f in truth.faults if f.kind == "silent_rack"]
    assert len(silent) == 4 and {f.rack for f in silent} == {silent[0].rack}
    assert all(f.first_seen == f.start for f in silent)


def test_every_fault_is_seen_and_first_seen_is_the_first_report_showing_it(
    trace: tuple[Reports, Truth],
) -> None:
    reports, truth = trace
    assert all(f.first_seen is not None for f in truth.faults)
    xid = _fault(truth, "xid79")
    showing = [r for r in _of(reports, xid.node) if any(e["code"] == 79 for e in r["events"])]
    assert [r["time"] for r in showing] == [xid.first_seen]


def test_lost_gpu_disappears_and_is_named_in_errors(trace: tuple[Reports, Truth]) -> None:
    reports, truth = trace
    f = _fault(truth, "xid79")
    assert f.first_seen is not None and f.gpu is not None
    before = [r for r in _of(reports, f.node) if r["time"] < f.start]
    after = [r for r in _of(reports, f.node) if r["time"] >= f.first_seen]
    assert before and after
    assert all(len(r["gpus"]) == 8 and not r["errors"] for r in before)
    for r in after:
        assert f.gpu not in {g["index"] for g in r["gpus"]} and len(r["gpus"]) == 7
        assert [e["collector"] for e in r["errors"]] == ["nvml"]
        assert f"GPU {f.gpu} " in r["errors"][0]["message"]
        assert (r["errors"][0]["code"], r["errors"][0]["gpu"]) == ("gpu_lost", f.gpu)


def test_hard_faults_show_in_the_counters_and_states(trace: tuple[Reports, Truth]) -> None:
    reports, truth = trace
    dbe = _fault(truth, "dbe")
    for r in _of(reports, dbe.node):
        gpu = next(g for g in r["gpus"] if g["index"] == dbe.gpu)
        hit = r["time"] >= (dbe.first_seen or 0)
        assert gpu["ecc_dbe_volatile_total"] == (1 if hit else 0)
        assert gpu["remapped_rows_pending"] is hit
    remap = _fault(truth, "remap_failure")
    last = _of(reports, remap.node)[-1]
    assert next(g for g in last["gpus"] if g["index"] == remap.gpu)["remapped_rows_failure"] is True
    port = _fault(truth, "ib_port_down")
    downs = []
    for r in _of(reports, port.node):
        nic = next(n for n in r["nics"] if n["device"] == f"mlx5_{port.port}")
        downs.append(
            (r["time"] >= (port.first_seen or 0), nic["state"], nic["phys_state"], nic["tx_bytes_total"])
        )
    assert {(d[1], d[2]) for d in downs if d[0]} == {("DOWN", "Polling")}
    assert {(d[1], d[2]) for d in downs if not d[0]} == {("ACTIVE", "LinkUp")}
    assert len({d[3] for d in downs if d[0]}) == 1  # no traffic while down


def test_load_only_faults_show_only_under_load(trace: tuple[Reports, Truth]) -> None:
    reports, truth = trace
    thermal = _fault(truth, "thermal")
    hot = 0
    for r in _of(reports, thermal.node):
        gpu = next(g for g in r["gpus"] if g["index"] == thermal.gpu)
        if gpu["clock_event_reasons"] & othergen.R_SW_THERMAL:
            hot += 1
            assert gpu["performance_state"] == 0 and gpu["utilization_ratio"] >= 0.5
            assert 78 <= gpu["temperature_celsius"] <= 88
            assert gpu["sm_clock_hz"] <= 0.9 * gpu["sm_clock_max_hz"]
        if gpu["performance_state"] == 8:
            assert gpu["temperature_celsius"] < 70
    assert hot > 0
    slow = _fault(truth, "slow_gpu")
    slow_clock = 0
    for r in _of(reports, slow.node):
        gpu = next(g for g in r["gpus"] if g["index"] == slow.gpu)
        # Slow with no reason given: that is what makes it a fault and not a throttle.
        assert gpu["clock_event_reasons"] & ~(othergen.R_IDLE | othergen.R_SW_POWER_CAP) == 0
        if gpu["utilization_ratio"] >= 0.5 and gpu["sm_clock_hz"] <= 0.92 * gpu["sm_clock_max_hz"]:
            assert r["time"] >= slow.start
            slow_clock += 1
    assert slow_clock > 0


def test_pair_probes_appear_at_both_ends_and_the_link_fault_only_between_its_pair(
    trace: tuple[Reports, Truth],
) -> None:
    reports, truth = trace
    seen: dict[tuple[str, str, float], set[float | None]] = defaultdict(set)
    for r in reports:
        for p in r["probes"]:
            if p["kind"] == "nccl_allreduce_pair":
                assert p["peer"] and p["peer"] != r["node"]
                a, b = sorted((r["node"], p["peer"]))
                seen[(a, b, round(p["time"]))].add(p["busbw_bytes_per_second"])
    assert seen
    # A probe's two ends report the same result (lost reports aside).
    assert sum(len(v) == 1 for v in seen.values()) == len(seen)
    link = _fault(truth, "degraded_link")
    slow_nic = _fault(truth, "slow_nic").node
    nominal = {"h100": othergen.H100.pair_busbw, "a100": othergen.A100.pair_busbw}
    pool = {r["node"]: r["labels"]["pool"] for r in reports}
    slow_after = 0
    for (a, b, at), values in seen.items():
        (bw,) = values
        if bw is None or slow_nic in (a, b) or pool[a] != pool[b]:
            continue
        ratio = bw / nominal[pool[a]]
        if {a, b} == {link.node, link.peer} and at >= link.start:
            assert 0.45 <= ratio <= 0.78
            slow_after += 1
        elif ratio < 0.8:
            assert "ib_port_down" in {f.kind for f in truth.faults if f.node in (a, b)}
    assert slow_after >= 2


def test_counters_are_monotonic_within_a_boot_and_restart_on_reboot(trace: tuple[Reports, Truth]) -> None:
    reports, truth = trace
    boots: dict[tuple[str, str], Reports] = defaultdict(list)
    for r in reports:
        boots[(r["node"], r["boot_id"])].append(r)

    def counters(r: dict[str, Any]) -> dict[str, float]:
        out: dict[str, float] = {}
        for g in r["gpus"]:
            for key in ("energy_joules_total", "ecc_sbe_aggregate_total", "pcie_replay_total"):
                out[f"{g['index']}.{key}"] = g[key]
            for link in g["nvlink"]:
                out[f"{g['index']}.nvl{link['link']}"] = link["crc_flit_errors_total"]
        for n in r["nics"]:
            out[f"{n['device']}.rx"] = n["rx_bytes_total"]
            for name, value in n.get("counters", {}).items():
                out[f"{n['device']}.{name}"] = value
            if n["link_layer"] == "InfiniBand":
                assert n["tx_bytes_total"] == 4 * n["counters"]["port_xmit_data"]
        return out

    for (node, _), rs in boots.items():
        rs.sort(key=lambda r: r["seq"])
        for prev, cur in itertools.pairwise(rs):
            assert cur["seq"] >= prev["seq"]
            p, c = counters(prev), counters(cur)
            for key in p.keys() & c.keys():
                assert c[key] >= p[key], f"{node} {key} went down {p[key]} -> {c[key]} in one boot"
    reboot = _fault(truth, "reboot")
    rs = sorted(_of(reports, reboot.node), key=lambda r: r["time"])
    ids = list(dict.fromkeys(r["boot_id"] for r in rs))
    assert len(ids) == 2
    old = [r for r in rs if r["boot_id"] == ids[0]]
    new = [r for r in rs if r["boot_id"] == ids[1]]
    assert min(r["seq"] for r in new) <= 1  # seq restarts (the first report might be lost)
    assert 120 <= new[0]["time"] - old[-1]["time"] <= 300 + 30 + 2
    assert new[0]["gpus"][0]["energy_joules_total"] < old[-1]["gpus"][0]["energy_joules_total"]
    assert new[0]["time"] == reboot.first_seen


def test_clock_skew_and_silent_rack(trace: tuple[Reports, Truth]) -> None:
    reports, truth = trace
    skew = _fault(truth, "clock_skew")
    # Trace order is receive order: the skewed node's reports sit 20-60 s ahead of their neighbours.
    ahead = []
    for i, r in enumerate(reports):
        if r["node"] == skew.node:
            around = [x["time"] for x in reports[max(0, i - 20) : i + 20] if x["node"] != skew.node]
            ahead.append(r["time"] - sorted(around)[len(around) // 2])
    ahead.sort()
    assert 15 <= ahead[len(ahead) // 2] <= 65
    silent = [f for f in truth.faults if f.kind == "silent_rack"]
    start, end = silent[0].start, silent[0].end
    assert end is not None and 8 * 60 <= end - start <= 12 * 60
    # During the cut nothing arrives from the rack: the backlog comes in one burst after it.
    rack_nodes = {f.node for f in silent}
    during = [r for r in reports if r["node"] in rack_nodes and start <= r["time"] < end]
    assert during
    first_backlog = reports.index(during[0])
    assert all(
        x["time"] >= end - 5
        for x in reports[first_backlog : first_backlog + 5]
        if x["node"] not in rack_nodes
    )
    without, _ = othergen.generate(SEED, spool_flush=False, **KW)
    assert not [r for r in without if r["node"] in rack_nodes and start <= r["time"] < end]


def test_cli_writes_a_trace_and_a_truth_that_load(tmp_path: Path) -> None:
    trace_path, truth_path = tmp_path / "t.jsonl.gz", tmp_path / "truth.json"
    rc = othergen.main(
        ["--seed", "3", "--nodes", "32", "--minutes", "10", "--interval", "30",
         "--trace", str(trace_path), "--truth", str(truth_path)]
    )  # fmt: skip
    assert rc == 0
    with gzip.open(trace_path, "rb") as f:
        lines = f.read().splitlines()
    assert lines and all(decode(line).node for line in lines)
    truth = load_truth(truth_path)
    assert truth.seed == 3 and len(truth.nodes) == 32
    assert json.loads(truth_path.read_text())["version"] == 1


def test_bad_arguments_are_refused_with_a_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="nodes: at least 32"):
        othergen.generate(1, nodes=8)
    with pytest.raises(ValueError, match="minutes"):
        othergen.generate(1, minutes=2)
    rc = othergen.main(
        ["--seed", "1", "--nodes", "4", "--trace", str(tmp_path / "t"), "--truth", str(tmp_path / "u")]
    )
    assert rc == 2
    assert "at least 32" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()
