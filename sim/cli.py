"""``gpuwarden sim SCENARIO.yaml --out TRACE.jsonl[.gz] --truth TRUTH.json``: simulate a fleet."""

from __future__ import annotations

import argparse
import gzip
import logging
import sys
from pathlib import Path
from typing import Protocol

from agent.errors import ConfigError
from agent.report import encode
from sim import scenario as scenario_mod
from sim import truth as truth_mod
from sim.fleet import place, simulate

log = logging.getLogger(__name__)


class _Sink(Protocol):
    def write(self, data: bytes, /) -> int: ...


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("scenario", type=Path, help="scenario YAML file (see docs/simulator.md)")
    p.add_argument(
        "--out", type=Path, required=True, help="trace to write: JSON Lines, gzip if it ends in .gz"
    )
    p.add_argument("--truth", type=Path, required=True, help="ground truth JSON to write")
    p.add_argument("--seed", type=int, default=None, help="override the scenario's seed")
    p.add_argument(
        "--nodes", type=int, default=None, help="override the fleet size (pools keep their shares)"
    )
    p.add_argument("--minutes", type=float, default=None, help="override the duration")


def write_trace(scenario: scenario_mod.Scenario, out: Path) -> tuple[int, truth_mod.Truth]:
    """Write the trace (receive order) and return the number of lines and the truth.

    Faults given by their leaf are placed first (``sim.fleet.place``): the truth names their nodes.
    """
    scenario = place(scenario)
    first_seen: dict[int, float] = {}
    count = 0

    def emit(sink: _Sink) -> None:
        nonlocal count
        for d in simulate(scenario):
            sink.write(encode(d.report) + b"\n")
            count += 1
            for idx in d.shows:
                first_seen.setdefault(idx, d.report.time)

    try:
        with out.open("wb") as raw:
            if out.name.endswith(".gz"):
                # No name and a zero time in the gzip header: the same scenario, the same bytes.
                with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
                    emit(gz)
            else:
                emit(raw)
    except OSError as exc:
        raise ConfigError(f"{out}: cannot write: {exc.strerror or exc}") from exc
    return count, truth_mod.build(scenario, first_seen)


def run(args: argparse.Namespace) -> int:
    scenario = scenario_mod.load(args.scenario).with_overrides(
        seed=args.seed, nodes=args.nodes, minutes=args.minutes
    )
    count, truth = write_trace(scenario, args.out)
    try:
        truth_mod.write(args.truth, truth)
    except OSError as exc:
        raise ConfigError(f"{args.truth}: cannot write: {exc.strerror or exc}") from exc
    by_class: dict[str, int] = {}
    for f in truth.faults:
        by_class[f.fault_class] = by_class.get(f.fault_class, 0) + 1
    log.info(
        "simulated",
        extra={
            "reports": count,
            "nodes": scenario.node_count,
            "faults": len(truth.faults),
            "seed": scenario.seed,
        },
    )
    summary = ", ".join(f"{k} {v}" for k, v in sorted(by_class.items())) or "none"
    print(
        f"gpuwarden sim: {count} reports from {scenario.node_count} nodes "
        f"over {scenario.duration_s / 60:g} min; faults: {summary}",
        file=sys.stderr,
    )
    return 0
