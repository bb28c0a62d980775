"""bench/detection.py's robustness perturbations: what they do to a trace, and only that."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def detection() -> ModuleType:
    import detection as module  # bench/detection.py: bench/ is on pytest's pythonpath (pyproject.toml)

    return module


def _trace(path: Path, n: int) -> list[dict[str, object]]:
    reports = [
        {"node": f"gpu-{i % 8:04d}", "seq": i, "labels": {"pool": "h100", "rack": "rack-000"}}
        for i in range(n)
    ]
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in reports)
    return reports


def _read(path: Path) -> list[dict[str, object]]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_drop_loses_about_its_share_the_same_way_for_a_seed(tmp_path: Path, detection: ModuleType) -> None:
    kept = {}
    for seed in (1, 1, 2):
        path = tmp_path / f"t{seed}.jsonl.gz"
        original = _trace(path, 2000)
        left = detection.perturb_trace(path, detection.Perturb(drop=0.1), seed)
        out = _read(path)
        assert left == len(out) and 1700 < left < 1900
        assert all(r in original for r in out) and out == sorted(out, key=lambda r: r["seq"])  # order kept
        assert all(r["labels"] for r in out)
        kept.setdefault(seed, []).append([r["seq"] for r in out])
    assert kept[1][0] == kept[1][1] and kept[1][0] != kept[2][0]


def test_strip_labels_removes_only_the_labels(tmp_path: Path, detection: ModuleType) -> None:
    path = tmp_path / "t.jsonl.gz"
    original = _trace(path, 50)
    assert detection.perturb_trace(path, detection.Perturb(strip_labels=True), 1) == 50
    out = _read(path)
    assert out == [{k: v for k, v in r.items() if k != "labels"} for r in original]
    assert not detection.Perturb() and detection.Perturb(drop=0.01) and detection.Perturb(strip_labels=True)


# ---------------------------------------------------------------------------------------------
# The robustness matrix (--matrix) and the long healthy runs (bench/healthy.py), on tiny sizes


def _gpu(index: int, util: float, reasons: int = 0) -> dict[str, object]:
    return {
        "index": index,
        "utilization_ratio": util,
        "clock_event_reasons": reasons,
        "pcie_link_width": 16,
        "pcie_link_width_max": 16,
        "pcie_link_gen": 5,
        "pcie_link_gen_max": 5,
    }


def _visibility_trace(path: Path, loaded_until: float) -> None:
    lines = []
    for seq in range(70):
        t = 1000.0 + 10.0 * seq
        util = 0.95 if t < loaded_until else 0.0
        probes = []
        if seq in (5, 30):  # gpu-0002 probed with two peers; gpu-0003 twice with the same one
            probes = [{"kind": "nccl_allreduce_pair", "ok": True, "peer": f"gpu-000{4 + (seq == 30)}"}]
        for node in ("gpu-0001", "gpu-0002", "gpu-0003"):
            mine = probes if node == "gpu-0002" else [{**p, "peer": "gpu-0004"} for p in probes]
            report = {"node": node, "boot_id": "b", "seq": seq, "time": t, "interval_seconds": 10.0}
            report |= {"gpus": [_gpu(0, util), _gpu(1, util)], "probes": mine if node != "gpu-0001" else []}
            lines.append(json.dumps(report) + "\n")
            if seq == 3:
                lines.append(json.dumps(report) + "\n")  # a duplicate counts once
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(lines)


def test_visibility_needs_the_evidence_for_the_whole_window(tmp_path: Path, detection: ModuleType) -> None:
    from sim.truth import Truth, TruthFault

    faults = (
        TruthFault(0, "slow_gpu", "soft", "gpu-0001", 1000.0, 1000.0, None, gpu=1),
        TruthFault(1, "slow_nic", "soft", "gpu-0002", 1000.0, 1050.0, None),
        TruthFault(2, "slow_nic", "soft", "gpu-0003", 1000.0, 1050.0, None),
        TruthFault(3, "nvlink_crc", "soft", "gpu-0001", 1000.0, None, None, gpu=0),
    )
    truth = Truth(1, 1000.0, 1700.0, ("gpu-0001", "gpu-0002", "gpu-0003", "gpu-0004", "gpu-0005"), faults)
    path = tmp_path / "t.jsonl.gz"
    _visibility_trace(path, loaded_until=1000.0 + 600.0)
    visible, loaded = detection.visibility(path, truth)
    assert visible == {0: True, 1: True, 2: False}  # one peer cannot tell a NIC from a link
    assert 0.0 < loaded < 1.0
    _visibility_trace(path, loaded_until=1000.0 + 400.0)  # loaded for 2/3 of the window only
    assert detection.visibility(path, truth)[0][0] is False


def _link_trace(
    path: Path,
    *,
    pair_at: tuple[float, ...] = (),
    partners: dict[str, str] | None = None,
    rings: dict[str, tuple[str, ...]] | None = None,
    rows_until: float = 0.0,
) -> None:
    """Reports of gpu-0001..4 every 10 s from t=1000 for 11 minutes: pair probes between gpu-0001
    and gpu-0002 at ``pair_at`` (both ends carry each result), one probe of each end in
    ``partners`` with that partner, and job rows of the ``rings`` (comm -> nodes in rank order)
    until ``rows_until``."""
    lines = []
    for seq in range(66):
        t = 1000.0 + 10.0 * seq
        for node in ("gpu-0001", "gpu-0002", "gpu-0003", "gpu-0004"):
            probes = []
            if node in ("gpu-0001", "gpu-0002"):
                other = "gpu-0002" if node == "gpu-0001" else "gpu-0001"
                probes += [
                    {
                        "kind": "nccl_allreduce_pair",
                        "ok": True,
                        "peer": other,
                        "time": at - 5.0 + (node == "gpu-0002"),
                    }
                    for at in pair_at
                    if t - 10.0 < at <= t
                ]
                if seq == 20 and node in (partners or {}):
                    probes.append(
                        {"kind": "nccl_allreduce_pair", "ok": True, "peer": (partners or {})[node], "time": t}
                    )
            collectives = [
                {"comm": comm, "collective": "AllReduce", "rank": nodes.index(node), "nnodes": len(nodes)}
                for comm, nodes in (rings or {}).items()
                if node in nodes and t <= rows_until
            ]
            report: dict[str, object] = {
                "node": node,
                "boot_id": "b",
                "seq": seq,
                "time": t,
                "interval_seconds": 10.0,
            }
            report |= {"gpus": [_gpu(0, 0.0)], "probes": probes, "jobs": {"collectives": collectives}}
            lines.append(json.dumps(report) + "\n")
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(lines)


def test_a_link_is_visible_when_measured_twice_and_both_ends_are_measured_elsewhere(
    tmp_path: Path, detection: ModuleType
) -> None:
    from sim.truth import Truth, TruthFault

    link = TruthFault(0, "degraded_link", "link", "gpu-0001", 1000.0, 1000.0, None, peer="gpu-0002")
    nodes = ("gpu-0001", "gpu-0002", "gpu-0003", "gpu-0004")
    truth = Truth(1, 1000.0, 1700.0, nodes, (link,))
    path = tmp_path / "t.jsonl.gz"
    healthy = {"gpu-0001": "gpu-0003", "gpu-0002": "gpu-0004"}

    def visible(**kw: object) -> bool:
        _link_trace(path, **kw)  # type: ignore[arg-type]
        return bool(detection.visibility(path, truth)[0][0])

    assert visible(pair_at=(1005.0, 1300.0), partners=healthy)
    assert not visible(pair_at=(1005.0,), partners=healthy)  # one result never decides
    assert not visible(pair_at=(1005.0, 1700.0), partners=healthy)  # the second after its 10 minutes
    assert not visible(pair_at=(1005.0, 1300.0))  # a slow pair with no other partner: a slow end as much
    assert not visible(pair_at=(1005.0, 1300.0), partners={"gpu-0001": "gpu-0003"})
    # The only other partner of an end has a fault of its own: it cannot vouch for that end.
    nic = TruthFault(1, "slow_nic", "soft", "gpu-0004", 1000.0, 1000.0, None)
    truth = Truth(1, 1000.0, 1700.0, nodes, (link, nic))
    assert not visible(pair_at=(1005.0, 1300.0), partners=healthy)
    truth = Truth(1, 1000.0, 1700.0, nodes, (link,))
    # Job data: a ring crossing the hop for the jobs detector's window and runs, and each end in
    # a ring that does not cross it.
    rings = {"0xa": nodes, "0xb": ("gpu-0001", "gpu-0003"), "0xc": ("gpu-0002", "gpu-0004")}
    assert visible(rings=rings, rows_until=1000.0 + detection.JOB_SPAN_S)
    assert not visible(rings=rings, rows_until=1000.0 + detection.JOB_SPAN_S - 60.0)
    assert not visible(rings={"0xa": nodes}, rows_until=1600.0)  # no end shown normal elsewhere
    # A ring in the order 1, 3, 2, 4 never sends from gpu-0001 to gpu-0002.
    around = {**rings, "0xa": ("gpu-0001", "gpu-0003", "gpu-0002", "gpu-0004")}
    assert not visible(rings=around, rows_until=1600.0)


def test_matrix_runs_end_to_end_on_a_tiny_cell(
    tmp_path: Path, detection: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "m.json"
    argv = ["--matrix", "scenarios/small.yaml", "othergen", "--cells", "baseline,loss 10 %", "--seeds", "1"]
    assert detection.main([*argv, "--minutes", "12", "--nodes", "32", "--jobs", "2", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    for gen in ("sim (small)", "othergen"):
        for cell in ("baseline", "loss 10 %"):
            assert f"| {gen} | {cell} | 1 |" in table
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 4 and {r["cell"]["name"] for r in runs} == {"baseline", "loss 10 %"}
    for r in runs:
        soft = [f for f in r["faults"] if f["class"] == "soft"]
        assert soft and all(isinstance(f["visible"], bool) for f in soft)
        assert any(f["visible"] for f in soft)
        assert all(isinstance(f["visible"], bool) for f in r["faults"] if f["class"] == "link")
        assert 0.0 < r["loaded_share"] < 1.0
    by = {(r["scenario"], r["cell"]["name"]): r["reports"] for r in runs}
    assert by[("othergen", "loss 10 %")] < by[("othergen", "baseline")] * 0.95


def test_matrix_refuses_an_unknown_cell(detection: ModuleType) -> None:
    with pytest.raises(SystemExit):
        detection.main(["--matrix", "--cells", "noise x9"])
    assert len(detection.MATRIX_CELLS) == 9 and detection.MATRIX_CELLS[0] == detection.MATRIX_BASELINE


def test_healthy_run_on_a_tiny_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import healthy  # bench/healthy.py

    chunks = healthy.plan(300.0, 64, 1.0, ["sim", "othergen"])
    assert len(chunks) == 6 and sum(c.nodes * c.hours for c in chunks) >= 300.0
    out = tmp_path / "h.json"
    argv = ["--node-hours", "6.4", "--chunk-hours", "0.1", "--generators", "sim", "--jobs", "1"]
    assert healthy.main([*argv, "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| sim | 1 x 64 nodes x 0.1 h | 6 |" in table
    (chunk,) = json.loads(out.read_text())["chunks"]
    assert chunk["reports"] > 2000 and chunk["cpu_replay_s"] > 0
    og = healthy.run_chunk(healthy.Chunk("othergen", 1000, 32, 1 / 6))
    assert og["reports"] > 1500 and og["node_hours"] == pytest.approx(32 / 6)
    assert isinstance(og["quarantines"], list) and isinstance(og["flagged"], dict)
