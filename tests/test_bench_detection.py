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
