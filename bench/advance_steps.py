"""How long each step of ``Pipeline.advance_steps`` holds the caller (the event loop, in the service).

Run from the repository root::

    nice -n 10 .venv/bin/python bench/advance_steps.py --nodes 1000 --pool-nodes 1000

Feeds ``--nodes`` simulated H100 nodes (``bench/_reports.py``), split into pools of
``--pool-nodes``, through ``Pipeline.ingest`` for ``--rounds`` 10-s rounds on simulated time
(enough for the forest's settled, loaded window), then drives one ``advance_steps`` cycle at which
every detector is due and times each step: what runs between two yields is what a report arriving
meanwhile waits for. A step is named by the detector (and pool) that ran in it. Times are the
thread's CPU time (``time.thread_time``): what the step holds an otherwise idle core for; on a
shared machine the wall time is that and whatever else runs. An offloaded compute (what the
service runs in its worker thread) is run apart and listed on its own line. Prints a table, the
longest first.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _reports import NodeSim, phase_offset

from aggregator.app import build_pipeline
from aggregator.configload import load_config
from aggregator.decisions import DecisionLog
from aggregator.detect.base import OffloadingPoolDetector, PoolDetector
from aggregator.pipeline import OffloadStep
from aggregator.rules.model import default_rules_dir, load_rules

INTERVAL_S = 10.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--pool-nodes", type=int, default=1000, help="nodes per pool")
    p.add_argument("--rounds", type=int, default=26, help="10-s rounds ingested before the measured cycle")
    p.add_argument("--cycles", type=int, default=1, help="measured cycles (each 300 s apart: all due)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    config = load_config(None)
    rules = load_rules([Path(config.rules_dir) if config.rules_dir else default_rules_dir()])
    sims = [NodeSim(i, seed=args.seed, pool=f"h100-{i // args.pool_nodes:02d}") for i in range(args.nodes)]
    offsets = [phase_offset(i, seed=args.seed) for i in range(args.nodes)]
    total_rounds = args.rounds + 30 * (args.cycles - 1) + 1
    start = math.floor(time.time() / 300) * 300 - total_rounds * INTERVAL_S
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
            t = start + r * INTERVAL_S
            t0 = time.perf_counter()
            for i, sim in enumerate(sims):
                rep = sim.report(t + offsets[i], round_no=r)
                pipeline.ingest(rep, t + offsets[i])
            ingest_s += time.perf_counter() - t0
            now = t + INTERVAL_S - 0.5
            measured = r >= args.rounds and (r - args.rounds) % 30 == 0
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
