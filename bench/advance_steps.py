"""How long each step of ``Pipeline.advance_steps`` holds the caller (the event loop, in the service).

Run from the repository root::

    nice -n 10 .venv/bin/python bench/advance_steps.py --nodes 1000 --pool-nodes 1000

Feeds ``--nodes`` simulated H100 nodes (``bench/_reports.py``), split into pools of
``--pool-nodes``, through ``Pipeline.ingest`` for ``--rounds`` rounds ``--interval`` apart (10 s)
on simulated time, then drives one ``advance_steps`` cycle at which
every detector is due and times each step: what runs between two yields is what a report arriving
meanwhile waits for. A step is named by the detector (and pool) that ran in it. Times are the
thread's CPU time (``time.thread_time``): what the step holds an otherwise idle core for; on a
shared machine the wall time is that and whatever else runs. An offloaded compute (what the
service runs in its worker thread) is run apart and listed on its own line. Prints a table, the
longest first.

By default the rounds fill the pool frames (their slots and two more: 62 rounds at 10 s, 32 at
60 s), as in a service that has run as long: the peer and trend detectors read every complete
slot, so their cost grows with the slots held until the frame is full. A second table gives
each detector's steady share of a core: its CPU a cycle (every pool, on the loop and in the
worker) over its period (``every_seconds``, but a pool detector's at least one interval), and the
same per 1,000 nodes, which is what a shard's size adds to the cost
of its reports (docs/sharding.md, "How many nodes a shard").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import cpu_model
from _reports import NodeSim, phase_offset

from aggregator.app import build_pipeline
from aggregator.config import Config, FleetConfig
from aggregator.decisions import DecisionLog
from aggregator.detect.base import OffloadingPoolDetector, PoolDetector
from aggregator.fleet.frame import FleetFrames
from aggregator.pipeline import OffloadStep
from aggregator.rules.model import default_rules_dir, load_rules

CYCLE_S = 300.0  # measured cycles this far apart: the forest's every_seconds, so all are due


def full_frame_rounds(config: Config) -> int:
    """Rounds after which every slot of the pool frames (one slot an interval) is complete."""
    return FleetFrames(config.fleet).slots + 2


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--pool-nodes", type=int, default=1000, help="nodes per pool")
    p.add_argument(
        "--interval",
        type=float,
        default=10.0,
        help="the fleet's report interval, s (fleet.interval_seconds: the frames' slot; silence after six)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        help="rounds ingested before the measured cycle (default: the pool frames full)",
    )
    p.add_argument("--cycles", type=int, default=1, help="measured cycles (each 300 s apart: all due)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the steps and the steady shares here too")
    args = p.parse_args()
    interval_s: float = args.interval
    # The defaults, but for the fleet's interval (silence follows it).
    config = Config(fleet=FleetConfig(interval_seconds=interval_s))
    if args.rounds is None:
        args.rounds = full_frame_rounds(config)
    return measure(args, config, interval_s, max(1, round(CYCLE_S / interval_s)))


def measure(args: argparse.Namespace, config: Config, interval_s: float, cycle_rounds: int) -> int:
    rules = load_rules([Path(config.rules_dir) if config.rules_dir else default_rules_dir()])
    sims = [
        NodeSim(i, seed=args.seed, interval=interval_s, pool=f"h100-{i // args.pool_nodes:02d}")
        for i in range(args.nodes)
    ]
    offsets = [phase_offset(i, seed=args.seed) for i in range(args.nodes)]
    total_rounds = args.rounds + cycle_rounds * (args.cycles - 1) + 1
    start = math.floor(time.time() / CYCLE_S) * CYCLE_S - total_rounds * interval_s
    with tempfile.TemporaryDirectory() as tmp:
        decisions = DecisionLog(Path(tmp) / "decisions.jsonl")
        pipeline = build_pipeline(config, rules, decisions)
        pipeline.advance_on_ingest = False
        # Which detector and pool a step ran: wrap the hooks the pipeline calls.
        current: list[str] = []
        inside: list[float] = []  # time in the detector's hook, of the step's
        for run in pipeline._detectors:
            det: Any = run.detector
            if isinstance(det, PoolDetector):
                hook = "prepare_pool" if isinstance(det, OffloadingPoolDetector) else "run_pool"
                orig = getattr(det, hook)

                def run_pool(frame: Any, now: float, _o: Any = orig, _n: str = run.name) -> Any:
                    current.append(f"{_n} pool {frame.name} ({len(frame.nodes)} nodes)")
                    t0 = time.thread_time()
                    try:
                        return _o(frame, now)
                    finally:
                        inside.append(time.thread_time() - t0)

                setattr(det, hook, run_pool)
            else:
                orig_run = det.run

                def run_all(frames: Any, now: float, _o: Any = orig_run, _n: str = run.name) -> Any:
                    current.append(_n)
                    return _o(frames, now)

                det.run = run_all
        t = start
        ingest_s = 0.0
        steps: dict[str, list[float]] = defaultdict(list)
        hooks: dict[str, list[float]] = defaultdict(list)
        for r in range(total_rounds):
            t = start + r * interval_s
            t0 = time.perf_counter()
            for i, sim in enumerate(sims):
                rep = sim.report(t + offsets[i], round_no=r)
                pipeline.ingest(rep, t + offsets[i])
            ingest_s += time.perf_counter() - t0
            now = t + interval_s - 0.5
            measured = r >= args.rounds and (r - args.rounds) % cycle_rounds == 0
            if measured:
                # Every detector due now, as at start-up or when the forest's 5 minutes are up.
                for run in pipeline._detectors:
                    run.due = -math.inf
            gen = pipeline.advance_steps(now)
            step: OffloadStep | None = None
            while True:
                current.clear()
                inside.clear()
                t0 = time.thread_time()
                try:
                    step = next(gen)
                except StopIteration:
                    label = "tail (probes, probation)"
                    done = True
                else:
                    label = ", ".join(current) if current else "silence"
                    done = False
                held = time.thread_time() - t0
                if isinstance(step, OffloadStep):
                    # What the service runs in its worker thread: timed apart, off the loop.
                    label += ": prepare, and the previous step's finish"
                    t0 = time.thread_time()
                    step.run()
                    if measured:
                        steps[label.split(":")[0] + ": compute (worker thread)"].append(
                            time.thread_time() - t0
                        )
                if measured:
                    steps[label].append(held)
                    hooks[label].append(sum(inside))
                if done:
                    break
            print(f"round {r + 1}/{total_rounds}", file=sys.stderr, flush=True)
        decisions.close()
    reports = total_rounds * args.nodes
    print(
        f"{args.nodes} nodes in pools of {args.pool_nodes}; ingest {ingest_s / reports * 1e6:.0f} us/report"
    )
    print("| step | runs | worst ms | mean ms | of which in the detector's hook, mean ms |")
    print("|---|---:|---:|---:|---:|")
    for label, ds in sorted(steps.items(), key=lambda kv: -max(kv[1])):
        hook_ms = f"{sum(hooks[label]) / len(ds) * 1e3:.1f}" if hooks.get(label) else ""
        print(f"| {label} | {len(ds)} | {max(ds) * 1e3:.1f} | {sum(ds) / len(ds) * 1e3:.1f} | {hook_ms} |")
    steady = steady_shares(steps, {run.name: run.every for run in pipeline._detectors})
    print()
    print(steady_table(steady, args))
    if args.json:
        out = {
            "machine": {"cpu": cpu_model(), "nproc": os.cpu_count(), "python": platform.python_version()},
            "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "nodes": args.nodes,
            "pool_nodes": args.pool_nodes,
            "interval_s": args.interval,
            "rounds": args.rounds,
            "ingest_us_per_report": round(ingest_s / reports * 1e6, 1),
            "steps_ms": {label: [round(d * 1e3, 2) for d in ds] for label, ds in steps.items()},
            "steady": {
                name: {**d, "share_per_1000_nodes": d["share"] * 1000 / args.nodes}
                for name, d in steady.items()
            },
        }
        args.json.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    return 0


def steady_shares(steps: dict[str, list[float]], every: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per detector, its CPU a cycle (the mean over the measured cycles of all its steps, as the
    steps are named: every pool, on the loop and in the worker), its period, and the share of a
    core the one over the other is while the service runs."""
    per_cycle: dict[str, float] = defaultdict(float)
    for label, ds in steps.items():
        name = label.split(" ", 1)[0].split(":", 1)[0].rstrip(",")
        if name in every:
            per_cycle[name] += sum(ds) / len(ds)
    return {
        name: {"cpu_s_per_cycle": cpu, "every_s": every[name], "share": cpu / every[name]}
        for name, cpu in sorted(per_cycle.items(), key=lambda kv: -kv[1] / every[kv[0]])
    }


def steady_table(steady: dict[str, dict[str, float]], args: argparse.Namespace) -> str:
    lines = [
        f"Steady share of a core ({args.nodes} nodes in pools of {args.pool_nodes}, a {args.interval:g} s "
        f"interval, {args.rounds} rounds):",
        "",
        "| detector | CPU a cycle, all pools, ms | every | of a core | of a core per 1,000 nodes |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, d in steady.items():
        cpu_ms, share = d["cpu_s_per_cycle"] * 1e3, d["share"]
        per_1000 = share * 1000 / args.nodes
        lines.append(f"| {name} | {cpu_ms:.1f} | {d['every_s']:g} s | {share:.2%} | {per_1000:.2%} |")
    total = sum(d["share"] for d in steady.values())
    lines.append(f"| all | | | {total:.2%} | {total * 1000 / args.nodes:.2%} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
