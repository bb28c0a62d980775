"""Localization from job data on a busy fleet: scenarios/busy-jobs.yaml over seeds.

Run from the repository root (no network; traces live in a temporary directory)::

    .venv/bin/python bench/jobs.py [SCENARIO] [--seeds 3] [--jobs 1] [--json FILE] [--without peer]

For every seed: ``sim.cli.write_trace`` writes the trace and the truth, ``aggregator.replay``
runs the live pipeline over it with the default configuration and shipped rules, and
``sim.eval`` scores the decisions. Markdown goes to stdout: per fault of the scenario, per seed,
when it was caught (seconds from its first showing report) and by which detectors the decision's
reasons name, and whether the job-data detector's evidence was on the node (or link) at the end;
the false quarantines; any decision about a node of a job that is slow everywhere; the pair
probes the trace holds (none can run on a busy fleet). ``--without DETECTOR`` leaves a detector
out of the pipeline (``--without peer``: the slow GPU from job data alone, not from its clocks
first). Not a test: nothing here fails a build;
the published table is in docs/jobs.md ("Localization at the aggregator").
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gzip
import json
import logging
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Final

from aggregator.config import Config
from aggregator.detect import DETECTORS
from aggregator.replay import replayed
from aggregator.rules.model import default_rules_dir, load_rules
from sim import eval as sim_eval
from sim import scenario as scenario_mod
from sim.cli import write_trace

DEFAULT_SCENARIO: Final = Path("scenarios/busy-jobs.yaml")


@contextlib.contextmanager
def without_detectors(names: Sequence[str]) -> Iterator[None]:
    """The pipeline (``aggregator.app.build_pipeline``, which ``replayed`` builds its pipeline
    with) without the detectors named: what the others catch alone."""
    from aggregator import app  # noqa: PLC0415 - patched for this process only

    unknown = set(names) - {d.name for d in DETECTORS}
    if unknown:
        raise SystemExit(f"no detector called {sorted(unknown)}; there are {[d.name for d in DETECTORS]}")
    original = app.build_pipeline
    kept = tuple(d for d in DETECTORS if d.name not in names)
    app.build_pipeline = functools.partial(original, detectors=kept)
    try:
        yield
    finally:
        app.build_pipeline = original


def run_seed(scenario: str, seed: int, without: Sequence[str] = ()) -> dict[str, Any]:
    with without_detectors(without):
        return _run_seed(scenario, seed)


def _run_seed(scenario: str, seed: int) -> dict[str, Any]:
    logging.getLogger().setLevel(logging.ERROR)
    started = time.perf_counter()
    cpu = time.process_time()
    s = scenario_mod.load(Path(scenario)).with_overrides(seed=seed, nodes=None, minutes=None)
    with tempfile.TemporaryDirectory(prefix="gpuwarden-jobs-") as tmp:
        trace, out = Path(tmp) / "trace.jsonl.gz", Path(tmp) / "decisions.jsonl"
        reports, truth = write_trace(s, trace)
        with gzip.open(trace, "rt", encoding="utf-8") as fh:
            pair_probes = sum(line.count('"nccl_allreduce_pair"') for line in fh)
        _, _, final = replayed(trace, out, Config(), load_rules([default_rules_dir()]))
        raw = [json.loads(line) for line in out.read_text().splitlines()]
        decisions = sim_eval.load_decisions(out)
    scored = sim_eval.score(truth, decisions)
    faults = []
    for f in truth.faults:
        if f.kind == "slow_job":
            continue
        at = None
        detectors: list[str] = []
        for d in raw:
            if d["time"] < sim_eval.began(f):
                continue
            node_hit = f.fault_class != "link" and d["subject"] == "node" and d["node"] == f.node
            link_hit = (
                f.fault_class == "link"
                and d["subject"] == "link"
                and {d["node"], d["peer"]} == {f.node, f.peer}
            )
            if (node_hit and d["state"] == "quarantined") or (link_hit and d["state"] == "degraded"):
                at = d["time"]
                detectors = sorted({r["detector"] for r in d["reasons"]})
                break
        if f.fault_class == "link":
            run = next(r for r in final.pipeline._detectors if r.name == "jobs")
            st = run.links.get(f.node, f.peer or "")
            jobs_evidence = st is not None and st.finding is not None and st.finding.detector == "jobs"
        else:
            h = final.pipeline.health.get(f.node)
            jobs_evidence = h is not None and bool(h.groups.get("jobs"))
        faults.append(
            {
                "kind": f.kind,
                "node": f.node if f.peer is None else f"{f.node}|{f.peer}",
                "ttd_s": None if at is None else round(at - (f.first_seen or f.start), 1),
                "detectors": detectors,
                "jobs_evidence": jobs_evidence,
            }
        )
    slow_job_nodes = {f.node for f in truth.faults if f.kind == "slow_job"}
    return {
        "seed": seed,
        "reports": reports,
        "seconds": round(time.perf_counter() - started, 1),
        "cpu_seconds": round(time.process_time() - cpu, 1),
        "pair_probes": pair_probes,
        "faults": faults,
        "false_quarantines": scored["quarantines"]["false"],
        "false_by_cause": scored["quarantines"]["false_by_cause"],
        "slow_job_decisions": sum(
            1 for d in raw if d["state"] != "healthy" and {d["node"], d.get("peer")} & slow_job_nodes
        ),
    }


def render(runs: list[dict[str, Any]], command: str) -> str:
    out = [
        f"`{command}`",
        "",
        "| seed | fault | caught after | by | job-data evidence |",
        "|---|---|---|---|---|",
    ]
    for r in runs:
        for f in r["faults"]:
            ttd = "missed" if f["ttd_s"] is None else f"{f['ttd_s']:.0f} s"
            by = ", ".join(f["detectors"]) or "-"
            evidence = "yes" if f["jobs_evidence"] else "no"
            out.append(f"| {r['seed']} | {f['kind']} {f['node']} | {ttd} | {by} | {evidence} |")
    out += [
        "",
        "| seed | reports | pair probes | false quarantines | decisions on the slow job | CPU s |",
        "|---|---|---|---|---|---|",
    ]
    for r in runs:
        out.append(
            f"| {r['seed']} | {r['reports']} | {r['pair_probes']} | {r['false_quarantines']} | "
            f"{r['slow_job_decisions']} | {r['cpu_seconds']:.0f} |"
        )
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("scenario", nargs="?", type=Path, default=DEFAULT_SCENARIO)
    p.add_argument("--seeds", type=int, default=3, help="seeds 1..N (3)")
    p.add_argument("--jobs", type=int, default=1, help="worker processes (1)")
    p.add_argument("--json", type=Path, default=None, help="write every run's outcome here")
    p.add_argument(
        "--without",
        action="append",
        default=[],
        metavar="DETECTOR",
        help="leave this detector out of the pipeline (repeatable), e.g. peer: what job data catches alone",
    )
    args = p.parse_args(argv)
    seeds = range(1, args.seeds + 1)
    n = len(seeds)
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        runs = list(pool.map(run_seed, [str(args.scenario)] * n, seeds, [tuple(args.without)] * n))
    if args.json is not None:
        args.json.write_text(json.dumps(runs, indent=1) + "\n", "utf-8")
    print(render(runs, "bench/jobs.py " + " ".join(sys.argv[1:] if argv is None else argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
