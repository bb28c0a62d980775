"""What the sysfs collectors' tests share: the project's trees, an independent reader of their
counter files, the schema check of a report around collected NICs, and a count of syscalls."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema
import msgspec
import pytest

from agent import report as report_mod
from agent.report import Nic, Report

TREES = Path(__file__).resolve().parent / "fixtures" / "sysfs"
MAX_U64 = 2**64 - 1


def _load_tree_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_h100_tree", TREES / "make_h100_tree.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TREE_SCRIPT = _load_tree_script()


def text(path: Path) -> str:
    return path.read_text().strip()


def count(path: Path) -> int | None:
    """A counter file's value as the kernel's u64, or None for anything that is not one."""
    value = text(path)
    return int(value) if value.isdigit() and int(value) <= MAX_U64 else None


def validate(nics: list[Nic]) -> None:
    """The report the runner would build around these NICs passes the published JSON Schema."""
    report = Report(
        schema=report_mod.SCHEMA_ID,
        node="gpu-0001",
        time=1_764_441_600.0,
        seq=1,
        boot_id="5c2e1f4a-boot",
        gpus=(),
        nics=tuple(nics),
    )
    data = report_mod.encode(report)
    jsonschema.validate(msgspec.json.decode(data), report_mod.json_schema())
    assert report_mod.decode(data) == report


def count_syscalls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts directory listings and file opens from here to the end of the test."""
    counts = {"listdir": 0, "scandir": 0, "open": 0}

    def counting(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return real(*args, **kwargs)

        return wrapper

    for name in counts:
        monkeypatch.setattr(os, name, counting(name, getattr(os, name)))
    return counts


def assert_steady_cycle_lists_one_directory(
    collect: Callable[[], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a first collect, another of an unchanged tree lists the class directory and opens
    nothing: the layout and the open files are kept."""
    first = collect()
    syscalls = count_syscalls(monkeypatch)

    assert collect() == first

    assert syscalls == {"listdir": 1, "scandir": 0, "open": 0}


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def assert_open_file_budget(collector: Callable[..., Any], budget: int) -> None:
    """Over its budget of open files a collector reads the rest by path: it holds exactly
    ``budget`` descriptors and reports what an unlimited one does."""
    limited = collector(TREES / "h100" / "sys", max_open_files=budget)
    unlimited = collector(TREES / "h100" / "sys")
    before = open_files()

    assert limited.collect() == unlimited.collect()
    unlimited.close()

    assert open_files() - before == budget
    limited.close()
