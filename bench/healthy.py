"""Long healthy runs: how often the live pipeline flags a fleet that has nothing wrong with it.

Run from the repository root (no network; traces live in a temporary directory)::

    .venv/bin/python bench/healthy.py [--node-hours 10000] [--chunk-hours 2] [--nodes 64]
        [--generators sim,othergen] [--jobs 2] [--max-minutes M] [--json FILE [--resume]] [--estimate]

The node-hours are split evenly over the generators and cut into chunks of ``--nodes`` nodes for
``--chunk-hours`` hours, one trace per chunk (its own seed), so memory stays bounded whatever the
total: ``sim`` is ``scenarios/fleet64.yaml`` without its hard, soft and link faults
(``sim.scenario.vary(healthy=True)``: the look-alikes and the silent rack stay), written as it is
generated; ``othergen`` is bench/othergen.py with ``Knobs(healthy=True)`` (same). Each chunk is
replayed through ``aggregator.replay.replay`` with the default configuration and shipped rules,
as bench/detection.py does, with a fresh pipeline: a chunk is an independent fleet, and no
evidence carries from one chunk to the next, so a detector whose false alarms need more than a
chunk's length of history to build up is not exercised here beyond that length.

Every node quarantine is a false one (there is no fault to find); every decision entering a state
other than healthy is counted per detector named in its reasons. ``--max-minutes`` starts no chunk
after that long (chunks alternate between the generators, so a cut run has both, and the table
says how many node-hours it covered). With ``--json`` the file is rewritten after every chunk, so a
run cut short keeps what it finished; ``--resume`` keeps the chunks already in that file (same
generator, seed, size and length) and runs only the rest, so a long total can be covered over
several sittings. ``--estimate`` replays one short
chunk per generator and prints the CPU seconds per report and what the full size would take, then
stops. Markdown to stdout, progress to stderr. Not a test: nothing here fails a build.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import othergen  # bench/othergen.py, beside this script
from detection import DEFAULT_SCENARIO, machine

from aggregator.config import Config
from aggregator.replay import replay
from aggregator.rules.model import default_rules_dir, load_rules
from sim import eval as sim_eval
from sim import scenario as scenario_mod
from sim.cli import write_trace

log = logging.getLogger("bench.healthy")

GENERATORS: Final = ("sim", "othergen")
INTERVAL_S: Final = 10.0  # both generators' agent interval (the detection benchmark's setting)
ESTIMATE_HOURS: Final = 0.25
# A chunk's seeds start here, apart from the detection benchmark's 1..N, so the healthy fleets
# are not the faulty ones with their faults taken out.
SEED_BASE: Final = 1000


@dataclass(frozen=True)
class Chunk:
    generator: str
    seed: int
    nodes: int
    hours: float


def run_chunk(chunk: Chunk) -> dict[str, Any]:
    """Generate one healthy chunk, replay it and count what the pipeline decided; in a worker."""
    logging.getLogger().setLevel(logging.ERROR)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpuwarden-healthy-") as tmp:
        trace = Path(tmp) / "trace.jsonl.gz"
        decisions_path = Path(tmp) / "decisions.jsonl"
        if chunk.generator == "othergen":
            truth = othergen.write(
                chunk.seed,
                trace,
                Path(tmp) / "truth.json",
                nodes=chunk.nodes,
                minutes=chunk.hours * 60.0,
                interval_s=INTERVAL_S,
                knobs=othergen.Knobs(healthy=True),
            )
            reports = _count_lines(trace)
        else:
            s = scenario_mod.vary(scenario_mod.load(DEFAULT_SCENARIO), healthy=True)
            s = s.with_overrides(seed=chunk.seed, nodes=chunk.nodes, minutes=chunk.hours * 60.0)
            reports, truth = write_trace(s, trace)
        cpu_gen = time.process_time() - cpu0
        config = Config()
        rules = load_rules([Path(config.rules_dir) if config.rules_dir else default_rules_dir()])
        replay(trace, decisions_path, config, rules)
        decisions = sim_eval.load_decisions(decisions_path)
    cpu_replay = time.process_time() - cpu0 - cpu_gen
    flagged: Counter[str] = Counter()
    for d in decisions:
        if d.state == "healthy":
            continue
        for det in d.detectors or {"(none named)"}:
            flagged[f"{d.subject} {d.state}: {det}"] += 1
    quarantines = [
        {"node": d.node, "at_s": round(d.time - truth.start, 1), "detectors": sorted(d.detectors)}
        for d in decisions
        if d.subject == "node" and d.state == "quarantined"
    ]
    return {
        "generator": chunk.generator,
        "seed": chunk.seed,
        "nodes": chunk.nodes,
        "hours": chunk.hours,
        "node_hours": chunk.nodes * chunk.hours,
        "reports": reports,
        "cpu_generate_s": round(cpu_gen, 1),
        "cpu_replay_s": round(cpu_replay, 1),
        "wall_s": round(time.perf_counter() - wall0, 1),
        "quarantines": quarantines,
        "links_degraded": sum(1 for d in decisions if d.subject == "link" and d.state == "degraded"),
        "flagged": dict(flagged),
    }


def _commit() -> str:
    """The code a chunk ran on (the short commit, ``-dirty`` with local changes outside
    bench/results/, where the run writes), so a file resumed over several sittings says which
    chunks ran on which detectors; "unknown" outside a git checkout."""
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=here, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no", "--", "..", ":!../bench/results")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}-dirty" if changed else head or "unknown"


def _commits(results: list[dict[str, Any]]) -> Counter[str]:
    return Counter(str(r.get("commit", "unknown")) for r in results)


def _key(c: Chunk | dict[str, Any]) -> tuple[str, int, int, float]:
    """What makes two chunks the same run: a resumed file's outcomes are matched on it."""
    if isinstance(c, Chunk):
        return (c.generator, c.seed, c.nodes, float(c.hours))
    return (str(c["generator"]), int(c["seed"]), int(c["nodes"]), float(c["hours"]))


def _count_lines(path: Path) -> int:
    with gzip.open(path, "rb") as fh:
        return sum(1 for _ in fh)


def plan(node_hours: float, nodes: int, chunk_hours: float, generators: Sequence[str]) -> list[Chunk]:
    """Chunks of ``nodes`` x ``chunk_hours`` adding up to at least ``node_hours``, split evenly."""
    per_gen = node_hours / len(generators)
    count = max(1, math.ceil(per_gen / (nodes * chunk_hours) - 1e-9))
    return [Chunk(g, SEED_BASE + i, nodes, chunk_hours) for g in generators for i in range(count)]


def run(
    chunks: Sequence[Chunk],
    workers: int,
    max_s: float = math.inf,
    on_result: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Every chunk's outcome; with ``max_s``, no chunk starts after that many seconds (the ones
    running finish), alternating generators so that a cut run still has both. ``on_result`` is
    called with each outcome as it arrives."""
    order = sorted(chunks, key=lambda c: (c.seed, GENERATORS.index(c.generator)))
    started = time.perf_counter()
    results: list[dict[str, Any]] = []
    with ProcessPoolExecutor(max_workers=workers) as pool:
        pending = {pool.submit(run_chunk, c): c for c in order[:workers]}
        queue = list(order[workers:])
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                chunk, r = pending.pop(future), future.result()
                results.append(r)
                if on_result is not None:
                    on_result(r)
                if queue and time.perf_counter() - started < max_s:
                    nxt = queue.pop(0)
                    pending[pool.submit(run_chunk, nxt)] = nxt
                _log_chunk(chunk, r)
    if len(results) < len(chunks):
        log.info("stopped at the time budget: %d of %d chunks", len(results), len(chunks))
    return results


def _log_chunk(chunk: Chunk, r: dict[str, Any]) -> None:
    log.info(
        "%s seed %d: %d reports, %.0f node-hours, cpu %.0f s (replay %.0f s), %d quarantines",
        chunk.generator,
        chunk.seed,
        r["reports"],
        r["node_hours"],
        r["cpu_generate_s"] + r["cpu_replay_s"],
        r["cpu_replay_s"],
        len(r["quarantines"]),
    )


def render(results: list[dict[str, Any]], command: str, wall_s: float) -> str:
    out = [
        f"Command: `{command}`  ",
        f"Date: {datetime.now(UTC):%Y-%m-%d}; machine: {machine()}; "
        f"wall time of this sitting {wall_s / 60:.0f} min.  ",
        "Code: " + ", ".join(f"{n} chunks on {c}" for c, n in sorted(_commits(results).items())) + ".",
        "",
        "| generator | chunks | node-hours | reports | CPU generate / replay | replay CPU per report "
        "| false quarantines | false link degradations |",
        "|---|---|---|---|---|---|---|---|",
    ]
    flagged: dict[str, Counter[str]] = {}
    for gen in GENERATORS:
        rs = [r for r in results if r["generator"] == gen]
        if not rs:
            continue
        reports = sum(r["reports"] for r in rs)
        replay_s = sum(r["cpu_replay_s"] for r in rs)
        out.append(
            f"| {gen} | {len(rs)} x {rs[0]['nodes']} nodes x {rs[0]['hours']:g} h | "
            f"{sum(r['node_hours'] for r in rs):.0f} | {reports} | "
            f"{sum(r['cpu_generate_s'] for r in rs):.0f} / {replay_s:.0f} s | "
            f"{1000 * replay_s / max(1, reports):.2f} ms | {sum(len(r['quarantines']) for r in rs)} | "
            f"{sum(r['links_degraded'] for r in rs)} |"
        )
        flagged[gen] = Counter()
        for r in rs:
            flagged[gen].update(r["flagged"])
    out += ["", "Decisions out of healthy, by subject, state and detector:", ""]
    out += ["| generator | decision | count |", "|---|---|---|"]
    for gen, counts in flagged.items():
        out += [f"| {gen} | {k} | {v} |" for k, v in sorted(counts.items())] or [f"| {gen} | none | 0 |"]
    quarantined = [
        f"- {r['generator']} seed {r['seed']}: {q['node']} at {q['at_s']:.0f} s ({'+'.join(q['detectors'])})"
        for r in results
        for q in r["quarantines"]
    ]
    out += ["", "False quarantines:", "", *(quarantined or ["- none"]), ""]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0] if __doc__ else None)
    p.add_argument("--node-hours", type=float, default=10_000.0, help="in total, over the generators")
    p.add_argument("--nodes", type=int, default=64, help="nodes per chunk (64: the sim fleet's size)")
    p.add_argument("--chunk-hours", type=float, default=2.0, help="hours per chunk (2)")
    p.add_argument("--generators", default=",".join(GENERATORS), help="sim,othergen")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    p.add_argument("--json", type=Path, help="write every chunk's outcome here")
    p.add_argument(
        "--max-minutes", type=float, default=math.inf, help="start no chunk after this many minutes"
    )
    p.add_argument(
        "--resume", action="store_true", help="keep the chunks already in --json, run only the rest"
    )
    p.add_argument("--estimate", action="store_true", help="time one short chunk per generator, and stop")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    gens = [g.strip() for g in args.generators.split(",") if g.strip()]
    if not gens or any(g not in GENERATORS for g in gens):
        p.error(f"--generators: some of {', '.join(GENERATORS)}")
    if args.node_hours <= 0 or args.chunk_hours <= 0 or args.nodes < 1 or args.jobs < 1:
        p.error("--node-hours, --chunk-hours, --nodes and --jobs must be > 0")
    if args.resume and args.json is None:
        p.error("--resume needs --json (the file whose chunks are kept)")
    command = ".venv/bin/python bench/healthy.py " + " ".join(sys.argv[1:] if argv is None else argv)
    started = time.perf_counter()
    if args.estimate:
        chunks = [Chunk(g, SEED_BASE, args.nodes, ESTIMATE_HOURS) for g in gens]
        results = run(chunks, args.jobs)
        full = plan(args.node_hours, args.nodes, args.chunk_hours, gens)
        for g in gens:
            r = next(x for x in results if x["generator"] == g)
            per_hour = (r["cpu_generate_s"] + r["cpu_replay_s"]) / r["node_hours"]
            hours = sum(c.nodes * c.hours for c in full if c.generator == g)
            print(
                f"{g}: {1000 * r['cpu_replay_s'] / r['reports']:.2f} ms replay CPU per report, "
                f"{per_hour:.2f} CPU s per node-hour; its {hours:.0f} node-hours: "
                f"~{per_hour * hours / 60:.0f} CPU minutes"
            )
        return 0
    chunks = plan(args.node_hours, args.nodes, args.chunk_hours, gens)
    commands, kept = [command.strip()], []
    if args.resume and args.json.exists():
        previous = json.loads(args.json.read_text("utf-8"))
        wanted = {_key(c) for c in chunks}
        kept = [r for r in previous["chunks"] if _key(r) in wanted]
        commands = [*previous.get("commands", [previous["command"]]), command.strip()]
        done = {_key(r) for r in kept}
        chunks = [c for c in chunks if _key(c) not in done]
        log.info("resuming: %d chunks kept from %s, %d to run", len(kept), args.json, len(chunks))
    results = list(kept)
    commit = _commit()

    def save(r: dict[str, Any]) -> None:
        results.append({**r, "commit": commit})
        if args.json:
            payload = {
                "command": commands[0],
                "commands": commands,
                "date": f"{datetime.now(UTC):%Y-%m-%d}",
                "machine": machine(),
            }
            args.json.parent.mkdir(parents=True, exist_ok=True)
            tmp = args.json.with_suffix(".tmp")
            tmp.write_text(json.dumps({**payload, "chunks": results}, indent=1) + "\n", "utf-8")
            tmp.replace(args.json)

    run(chunks, args.jobs, args.max_minutes * 60.0, save)
    print(render(results, " ; ".join(commands), time.perf_counter() - started))
    return 0


if __name__ == "__main__":
    sys.exit(main())
