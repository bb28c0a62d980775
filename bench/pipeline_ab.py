"""``Pipeline.ingest`` CPU a report, this checkout against another, interleaved.

On a shared VM the machine's speed moves between two runs minutes apart by as much as a change
saves, so one run of each side says little. This builds one workload (``bench/ingest.py``'s H100
reports in the compact encoding, ``--nodes`` x ``--warmup`` + ``--rounds`` rounds), then runs
each side in turn ``--pairs`` times, each run a fresh process: the pipeline the server builds
(``build_pipeline``, default config and rules), the warm-up rounds ingested, the heap frozen as
the service does once warm, then the measured rounds ingested under ``time.process_time``. The
other side is a checkout of the code before (``git worktree add /tmp/before REV``) put first on
``PYTHONPATH``, so its ``agent`` and ``aggregator`` are imported and this checkout's bench
machinery builds the same reports for both. Printed: each run's CPU a report, each pair's ratio,
and the median ratio (this checkout over the other). What is measured is the per-report path as
the service runs it: the fleet detectors, which run on their own tick there, are left out
(``advance_on_ingest`` off; ``bench/ingest.py``'s in-process row runs them on every report).

    git worktree add /tmp/before HEAD~1
    nice -n 5 .venv/bin/python bench/pipeline_ab.py --against /tmp/before --pairs 5
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

_SIDE = "_side"  # argv[1] that makes this script one side's measuring process


def _measure(workfile: Path) -> None:
    """One side's run (in its own process): print ``{"us": CPU a report, "code": aggregator's path}``."""
    # Only interfaces both sides have: the other side is older code.
    import gc  # noqa: PLC0415

    import aggregator  # noqa: PLC0415 - whichever side PYTHONPATH put first
    from agent.wire import decode_compact  # noqa: PLC0415
    from aggregator.app import build_pipeline  # noqa: PLC0415
    from aggregator.configload import load_config  # noqa: PLC0415
    from aggregator.decisions import DecisionLog  # noqa: PLC0415
    from aggregator.rules import default_rules_dir, load_rules  # noqa: PLC0415

    with workfile.open("rb") as f:
        warm_bodies, measured_bodies = pickle.load(f)  # written by this script a moment ago
    config = load_config(None)
    rules = load_rules([default_rules_dir()])
    warm = [decode_compact(b) for b in warm_bodies]
    measured = [decode_compact(b) for b in measured_bodies]
    with tempfile.TemporaryDirectory(prefix="gpuwarden-pipeline-ab-") as tmp:
        decisions = DecisionLog(Path(tmp) / "decisions.jsonl")
        try:
            pipeline = build_pipeline(config, rules, decisions)
            # The per-report path as the service runs it: the fleet detectors run on their own
            # tick there (aggregator/service.py), not inside the POST.
            pipeline.advance_on_ingest = False
            for r in warm:
                pipeline.ingest(r, r.time)
            gc.collect()
            gc.freeze()
            t0 = time.process_time()
            for r in measured:
                pipeline.ingest(r, r.time)
            us = (time.process_time() - t0) / len(measured) * 1e6
        finally:
            decisions.close()
    print(json.dumps({"us": us, "code": str(Path(aggregator.__file__).parent.parent)}))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [_SIDE]:
        _measure(Path(argv[1]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", type=Path, required=True, help="the other checkout (its root)")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=3, help="rounds before the measured ones")
    ap.add_argument("--rounds", type=int, default=4, help="measured rounds")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    other = args.against.resolve()
    if not (other / "aggregator" / "__init__.py").is_file():
        ap.error(f"{other} is no gpuwarden checkout")

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import ingest  # noqa: PLC0415

    work = ingest.build_workload(
        args.nodes, args.warmup, args.rounds, 0, seed=1, workers=os.cpu_count() or 1, wire="compact"
    )
    here = Path(__file__).resolve().parents[1]
    runs: dict[str, list[float]] = {"this": [], "other": []}
    with tempfile.TemporaryDirectory(prefix="gpuwarden-pipeline-ab-") as tmp:
        workfile = Path(tmp) / "work.pickle"
        with workfile.open("wb") as f:
            pickle.dump(([b for _, b in work.warmup], [b for _, b in work.measured]), f)
        for pair in range(args.pairs):
            # Alternate which side goes first, so that a machine slowing down favours neither.
            order = ("other", "this") if pair % 2 == 0 else ("this", "other")
            for side in order:
                root = other if side == "other" else here
                env = {
                    **os.environ,
                    "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
                }
                done = subprocess.run(
                    [sys.executable, __file__, _SIDE, str(workfile)],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                )
                result = json.loads(done.stdout.strip().splitlines()[-1])
                if Path(result["code"]).resolve() != root:
                    raise SystemExit(f"the {side} side imported {result['code']}, not {root}")
                runs[side].append(result["us"])
                print(f"pair {pair + 1}: {side:5} {result['us']:7.0f} us a report", file=sys.stderr)
    ratios = [a / b for a, b in zip(runs["this"], runs["other"], strict=True)]
    out = {
        "nodes": args.nodes,
        "measured_reports": len(work.measured),
        "this_us": [round(x) for x in runs["this"]],
        "other_us": [round(x) for x in runs["other"]],
        "ratios": [round(r, 3) for r in ratios],
        "median_ratio": round(statistics.median(ratios), 3),
        "against": str(other),
    }
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
