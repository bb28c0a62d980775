"""A second model of training jobs' NCCL Inspector records, for the ``jobs`` detector.

Run from the repository root (no network; traces live in a temporary directory)::

    .venv/bin/python bench/jobgen.py [--spread 0.01] [--minutes 24] [--seed 1] [--no-pods] [--json FILE]

``sim/jobs.py`` is the model the detector was built with: every GPU computes at one speed, every
job runs the same NCCL settings. This one was written apart from it, by an audit, from NCCL's
Inspector format and the physics of training: 64 busy H100 nodes in 12 jobs, and the healthy
variety the simulator does not have:

- Megatron layouts (tensor parallel over each node, pipeline stages, data parallel per rail and
  stage with reduce-scatter, all-gather and a 4-byte all-reduce, pipeline send/receive pairs),
  the last stage of one job 25 % heavier;
- a job on NVLS (its tensor-parallel all-reduce a third faster than the others');
- two mixture-of-experts jobs, an all-to-all per node with a persistently hot expert (35 % more
  compute), and data parallel per rail;
- a plain data-parallel job on one world communicator; two 4-GPU jobs sharing two nodes; a job
  restarted with new communicators half way, with a tenth of its records timed on the CPU; a job
  slow everywhere (0.6); v4.0 records, and one job in v4.3 marker batches;
- per op: 5 % log-normal jitter on the transfer, a 3 % tail (1.5-4x, all ranks), a rare
  dataloader hiccup on one rank; each rank arrives after its compute time times its GPU's speed
  (``--spread``: GPUs of one model differ by that much, persistently), inter-node ranks at their
  node's slowest GPU's pace; a rank's kernel time (GPU timing) is the transfer plus its wait for
  the last rank.

Faults: a GPU of gpu-0005 (Megatron job) and one of gpu-0053 (the world-communicator job) 12 %
slow from 180 s, the link gpu-0032-gpu-0033 (inside a 4-node ring) at 0.6 from 240 s, and rail
2 of gpu-0038 at half its bandwidth from 300 s.

A healthy base trace of the fleet comes from the simulator (``sim.cli.write_trace``); each
report's ``jobs`` section is replaced by what this model's Inspector lines give through the
agent's own parser and summarizer (``agent.inspector``), and ``pods`` by the jobs' pods. Then
``aggregator.replay`` runs the live pipeline (default configuration, shipped rules) over it.
Markdown to stdout: each fault, when and by what it was caught; every other node quarantined.
Not a test: nothing here fails a build; the table is in docs/jobs.md.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import logging
import math
import random
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import msgspec

from agent.inspector import Stream, Summarizer
from aggregator.config import Config
from aggregator.replay import replayed
from aggregator.rules.model import default_rules_dir, load_rules
from sim import scenario as scenario_mod
from sim.cli import write_trace

T0: Final = 1764000000.0
NVLINK_AR: Final = {1 << 25: 350e9, 1 << 22: 210e9}  # ring bus bandwidth on NVLink by size, B/s
NIC: Final = 46e9  # one NDR 400G rail: ring or pair bus bandwidth per GPU, B/s
OPS: Final = 7  # records per row and rank written per 10-s cycle
# The base fleet: 64 nodes, every one in a (simulator) job, so no pair probe runs.
BASE: Final = {
    "seed": 7,
    "minutes": 24,
    "interval_s": 10,
    "nodes_per_rack": 4,
    "racks_per_leaf": 2,
    "pools": [{"name": "h100", "profile": "h100-sxm-80gb", "nodes": 64}],
    "jobs": {"busy_mean_s": 1200, "idle_mean_s": 1200},
    "delivery": {"lost_fraction": 0.01, "duplicate_fraction": 0.005, "jitter_s": 2},
    "multinode_jobs": [{"name": f"b{k}", "first": f"gpu-{8 * k:04d}", "nodes": 8, "pp": 1} for k in range(8)],
}
FAULTS: Final = (
    ("slow_gpu", 180.0, ("gpu-0005", 3, 1.12)),
    ("slow_gpu", 180.0, ("gpu-0053", 6, 1.12)),
    ("link", 240.0, (("gpu-0032", "gpu-0033"), 0.6)),
    ("nic_rail", 300.0, ("gpu-0038", 2, 0.5)),
)


def node(i: int) -> str:
    return f"gpu-{i:04d}"


@dataclass
class Row:
    coll: str
    size: int
    busbw: float  # healthy bus bandwidth, B/s
    compute: float  # compute before the op, s: what the arrival skew scales with
    algo: str = "RING"


@dataclass
class Comm:
    id: str
    job: Job
    kind: str  # tp, ep, dp, pp, world
    members: list[tuple[str, int]]
    rows: list[Row]
    stage_late: float = 0.0  # pp: how late the later stage arrives, in its compute

    @property
    def nnodes(self) -> int:
        return len({n for n, _ in self.members})


@dataclass(eq=False)
class Job:
    name: str
    kind: str  # megatron, moe, ddp, small
    nodes: list[int]
    gpus: list[int] = field(default_factory=lambda: list(range(8)))
    pp: int = 1
    start: float = 0.0
    end: float = math.inf
    fmt: str = "v4.0"
    slow_everywhere: float = 1.0
    cpu_timing: float = 0.0  # the share of records timed on the CPU
    generation: int = 0  # a restart: new communicator ids
    nvls: float = 1.0
    pp_late: float = 0.0


def comm_id(*parts: object) -> str:
    return "0x" + hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=7).hexdigest()


def factor(coll: str, n: int) -> float:
    """Traffic per rank over the message size (NCCL's bus-bandwidth arithmetic)."""
    if coll == "AllReduce":
        return 2 * (n - 1) / n
    if coll in ("AllGather", "ReduceScatter", "All2All"):
        return float(n - 1)
    return 1.0


def build(job: Job, seed: int) -> list[Comm]:
    g, names = job.generation, [node(i) for i in job.nodes]
    out: list[Comm] = []
    if job.kind == "megatron":
        algo = "NVLS" if job.nvls > 1 else "RING"
        for n in names:
            rows = [
                Row("AllReduce", size, NVLINK_AR[size] * job.nvls, 4 * c, algo)
                for size, c in ((1 << 25, 2.9e-4), (1 << 22, 7e-5))
            ]
            out.append(Comm(comm_id(seed, job.name, g, "tp", n), job, "tp", [(n, x) for x in job.gpus], rows))
        per = len(names) // job.pp
        for s in range(job.pp):
            ring = names[s * per : (s + 1) * per]
            bw = NIC * (0.97 if len(ring) > 2 else 1.0)
            for x in job.gpus:
                rows = [
                    Row("ReduceScatter", 1 << 25, bw, 0.25),
                    Row("AllGather", 1 << 25, bw, 0.05),
                    Row("AllReduce", 4, 0.002e9, 0.02),
                ]
                out.append(
                    Comm(comm_id(seed, job.name, g, "dp", s, x), job, "dp", [(n, x) for n in ring], rows)
                )
        for s in range(job.pp - 1):
            for k in range(per):
                a, b = names[s * per + k], names[(s + 1) * per + k]
                for x in job.gpus:
                    rows = [Row("Send", 1 << 24, NIC, 0.01), Row("Recv", 1 << 24, NIC, 0.01)]
                    c = Comm(comm_id(seed, job.name, g, "pp", s, k, x), job, "pp", [(a, x), (b, x)], rows)
                    c.stage_late = job.pp_late
                    out.append(c)
    elif job.kind == "moe":
        for n in names:
            rows = [Row("All2All", 1 << 24, 300e9, 4 * 3.5e-4)]
            out.append(Comm(comm_id(seed, job.name, g, "ep", n), job, "ep", [(n, x) for x in job.gpus], rows))
        for x in job.gpus:
            rows = [Row("AllReduce", 1 << 25, NIC * 0.97, 0.3)]
            out.append(Comm(comm_id(seed, job.name, g, "dp", x), job, "dp", [(n, x) for n in names], rows))
    elif job.kind == "ddp":
        rows = [Row("AllReduce", 1 << 24, 180e9, 0.15), Row("AllReduce", 1 << 20, 60e9, 0.4)]
        out.append(
            Comm(
                comm_id(seed, job.name, g, "world"),
                job,
                "world",
                [(n, x) for n in names for x in job.gpus],
                rows,
            )
        )
    else:  # small: tensor parallel per node (4 or 8 GPUs), data parallel per GPU over the nodes
        for n in names:
            rows = [
                Row(
                    "AllReduce",
                    1 << 25,
                    NVLINK_AR[1 << 25] * (0.93 if len(job.gpus) == 4 else 1.0),
                    4 * 2.9e-4,
                )
            ]
            out.append(Comm(comm_id(seed, job.name, g, "tp", n), job, "tp", [(n, x) for x in job.gpus], rows))
        for x in job.gpus:
            rows = [Row("AllReduce", 1 << 25, NIC * (0.97 if len(names) > 2 else 1.0), 0.3)]
            out.append(Comm(comm_id(seed, job.name, g, "dp", x), job, "dp", [(n, x) for n in names], rows))
    return out


def jobs() -> list[Job]:
    return [
        Job("llm-a", "megatron", list(range(0, 16)), pp=4, pp_late=0.25),  # the last stage heavier
        Job("nvls-b", "megatron", list(range(16, 24)), pp=2, nvls=1.35),
        Job("moe-c", "moe", list(range(24, 28))),
        Job("moe-x", "moe", list(range(28, 32))),
        Job("llm-d", "megatron", list(range(32, 40)), pp=2, fmt="v4.3"),
        Job("slow-e", "small", list(range(40, 44)), slow_everywhere=0.6),
        Job("llm-f", "megatron", list(range(44, 52)), pp=2),  # over two leaves
        Job("ddp-g", "ddp", list(range(52, 56))),
        Job("vit-h", "small", [56, 57]),
        Job("pair-i", "small", [58, 59], gpus=[0, 1, 2, 3]),
        Job("pair-j", "small", [58, 59], gpus=[4, 5, 6, 7]),
        Job("ckpt-k", "small", list(range(60, 64)), end=600.0, cpu_timing=0.1),
        Job("ckpt-k", "small", list(range(60, 64)), start=660.0, generation=1, cpu_timing=0.1),
    ]


class Fleet:
    def __init__(self, seed: int, spread: float) -> None:
        self.seed = seed
        self.jobs = jobs()
        self.comms = [c for j in self.jobs for c in build(j, seed)]
        self.by_node: dict[str, list[Comm]] = defaultdict(list)
        for c in self.comms:
            for n in dict.fromkeys(n for n, _ in c.members):
                self.by_node[n].append(c)
        rng = random.Random(seed * 7 + 1)
        # Healthy GPUs of one model compute at slightly different speeds, persistently.
        self.speed = {(node(i), x): 1.0 + abs(rng.gauss(0, spread)) for i in range(64) for x in range(8)}
        self.hot: dict[tuple[str, int], float] = {}  # a hot expert per node of the MoE jobs
        for j in self.jobs:
            if j.kind == "moe":
                for i in j.nodes:
                    self.hot[(node(i), rng.randrange(8))] = 1.35

    def gpu_speed(self, n: str, gpu: int, rel: float) -> float:
        s = self.speed[(n, gpu)]
        for kind, at, p in FAULTS:
            if kind == "slow_gpu" and rel >= at and p[0] == n and p[1] == gpu:
                s *= float(p[2])  # type: ignore[arg-type]
        return s

    def bandwidth(self, comm: Comm, rel: float) -> float:
        ratio = 1.0
        nodes = list(dict.fromkeys(n for n, _ in comm.members))
        for kind, at, p in FAULTS:
            if rel < at or comm.kind not in ("dp", "pp", "world"):
                continue
            if kind == "link":
                (a, b), r = p  # type: ignore[misc]
                if a in nodes and b in nodes:
                    ring = set(zip(nodes, nodes[1:] + nodes[:1], strict=True))
                    if comm.kind == "pp" or len(nodes) == 2 or (a, b) in ring or (b, a) in ring:
                        ratio = min(ratio, r)
            elif kind == "nic_rail":
                n, rail, r = p  # type: ignore[misc]
                if any(m == n and (g == rail or comm.kind == "world") for m, g in comm.members):
                    ratio = min(ratio, r if comm.kind != "world" else 0.6)
        return ratio

    def ops(self, comm: Comm, row: Row, rel: float, rng: random.Random) -> list[list[float]]:
        """``OPS`` records: per rank its kernel times, us."""
        n, job = len(comm.members), comm.job
        ratio = self.bandwidth(comm, rel) * job.slow_everywhere
        base = row.size * factor(row.coll, n) / (row.busbw * ratio)
        if row.size <= 8:
            base = 25e-6 + 8e-6 * math.log2(n)  # latency-bound
        out: list[list[float]] = [[] for _ in range(n)]
        intra = comm.kind in ("tp", "ep")
        for _ in range(OPS):
            t = base * math.exp(rng.gauss(0, 0.05))
            if rng.random() < 0.03:
                t *= rng.uniform(1.5, 4.0)  # congestion, a collection pause: every rank of the op
            arrive = []
            for r, (m, gpu) in enumerate(comm.members):
                if intra:
                    s = self.gpu_speed(m, gpu, rel) * self.hot.get((m, gpu), 1.0)
                elif comm.kind == "world":
                    s = self.gpu_speed(m, gpu, rel)
                else:  # the node's tensor-parallel collectives hold it to its slowest GPU
                    s = max(self.gpu_speed(m, x, rel) for x in job.gpus)
                a = row.compute * s * (1 + rng.gauss(0, 0.01 if intra else 0.004))
                if comm.kind == "pp" and r == 1:
                    a += row.compute * comm.stage_late
                arrive.append(a)
            if not intra and rng.random() < 0.002:
                arrive[rng.randrange(n)] += rng.uniform(0.2, 2.0)  # a dataloader hiccup
            last = max(arrive)
            for r in range(n):
                out[r].append(max(1.0, round((t + last - arrive[r]) * 1e6)))
        return out

    def lines(self, n: str, now: float) -> list[bytes]:
        rel = now - T0
        rng = random.Random(f"{self.seed}:{n}:{now}")
        by_process: dict[tuple[Job, str, int], list[tuple[dict[str, Any], dict[str, Any]]]] = defaultdict(
            list
        )
        for comm in self.by_node[n]:
            job = comm.job
            if not job.start <= rel < job.end:
                continue
            draw = random.Random(f"{self.seed}:{comm.id}:{math.floor(now / 10)}")  # the same on every node
            for row in comm.rows:
                times = self.ops(comm, row, rel, draw)
                for r, (m, gpu) in enumerate(comm.members):
                    if m != n:
                        continue
                    pod = f"{job.name}-worker-{job.nodes.index(int(n[4:]))}"
                    pid = 1000 * (job.generation + 1) + gpu
                    for k, gpu_us in enumerate(times[r]):
                        timing, us = "kernel_gpu", gpu_us
                        if job.cpu_timing and rng.random() < job.cpu_timing:
                            timing, us = "kernel_cpu", gpu_us + rng.uniform(5, 400)
                        record = self.record(comm, r, row, us=us, timing=timing, now=now, k=k)
                        by_process[(job, pod, pid)].append(record)  # a Job hashes as itself (eq=False)
        out: list[str] = []
        for (job, pod, pid), records in by_process.items():
            if job.fmt == "v4.3":  # a marker per communicator's batch, then its records
                batches: dict[str, list[dict[str, Any]]] = defaultdict(list)
                for header, perf in records:
                    batches[json.dumps(header, sort_keys=True)].append(perf)
                for header_text, perfs in batches.items():
                    colls = sum(1 for p in perfs if "coll_perf" in p)
                    stats = {
                        "coll_records": colls,
                        "coll_dropped_total": 0,
                        "coll_dropped_since_last_dump": 0,
                        "p2p_records": len(perfs) - colls,
                        "p2p_dropped_total": 0,
                        "p2p_dropped_since_last_dump": 0,
                    }
                    header = json.loads(header_text)
                    out.append(
                        json.dumps(
                            {"header": header, "metadata": meta("v4.3", now, pod, pid), "dump_stats": stats}
                        )
                    )
                    out.extend(json.dumps(p) for p in perfs if "coll_perf" in p)
                    out.extend(json.dumps(p) for p in perfs if "p2p_perf" in p)
            else:
                for header, perf in records:
                    out.append(
                        json.dumps({"header": header, "metadata": meta("v4.0", now, pod, pid), **perf})
                    )
        return [x.encode() for x in out]

    def record(
        self, comm: Comm, rank: int, row: Row, *, us: float, timing: str, now: float, k: int
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        n = len(comm.members)
        traffic = row.size * (n if row.coll in ("AllGather", "ReduceScatter", "All2All") else 1)
        algbw = traffic / (us * 1e-6) / 1e9
        f = {"AllReduce": 2 * (n - 1) / n, "AllGather": (n - 1) / n, "ReduceScatter": (n - 1) / n}.get(
            row.coll, 1.0
        )
        header = {"id": comm.id, "comm_name": comm.kind, "rank": rank, "n_ranks": n, "nnodes": comm.nnodes}
        sn = int((now - T0) * 10) + k
        if row.coll in ("Send", "Recv"):
            p2p = {
                "p2p": row.coll,
                "p2p_sn": sn,
                "p2p_peer": 1 - rank,
                "p2p_msg_size_bytes": row.size,
                "p2p_exec_time_us": us,
                "p2p_timing_source": timing,
                "p2p_algobw_gbs": round(algbw, 6),
                "p2p_busbw_gbs": round(algbw, 6),
            }
            return header, {"p2p_perf": p2p}
        coll: dict[str, Any] = {
            "coll": row.coll,
            "coll_sn": sn,
            "coll_msg_size_bytes": row.size,
            "coll_exec_time_us": us,
            "coll_timing_source": timing,
            "coll_algobw_gbs": round(algbw, 6),
            "coll_busbw_gbs": round(algbw * f, 6),
        }
        if comm.job.fmt == "v4.3":
            coll.update(coll_algo=row.algo, coll_proto="SIMPLE")
        return header, {"coll_perf": coll}

    def pods(self, n: str, rel: float, uuids: Sequence[str]) -> list[dict[str, Any]]:
        i = int(n[4:])
        return [
            {
                "namespace": "ml",
                "pod": f"{j.name}-worker-{j.nodes.index(i)}",
                "container": "trainer",
                "resource": "nvidia.com/gpu",
                "devices": [uuids[x] for x in j.gpus],
            }
            for j in self.jobs
            if i in j.nodes and j.start <= rel < j.end
        ]


def meta(version: str, now: float, pod: str, pid: int) -> dict[str, Any]:
    return {
        "inspector_output_format_version": version,
        "git_rev": "v2.28.3-1",
        "rec_mechanism": "nccl_profiler_interface",
        "dump_timestamp_us": int(now * 1e6),
        "hostname": pod,
        "pid": pid,
    }


def generate(base: Path, out: Path, fleet: Fleet, *, pods: bool) -> int:
    """``base``'s reports with this model's ``jobs`` (and ``pods``); the Inspector lines written."""
    with gzip.open(base, "rt", encoding="utf-8") as fh:
        reports = [json.loads(line) for line in fh]
    encoder = msgspec.json.Encoder()
    lines = 0
    sections: dict[tuple[str, float], Any] = {}
    for n, t in sorted({(r["node"], r["time"]) for r in reports}):
        written = fleet.lines(n, t)
        lines += len(written)
        summary = Summarizer()
        errors = Stream().feed(written, summary)
        if errors:
            raise SystemExit(f"the agent's parser refused this model's lines: {errors[:3]}")
        sections[(n, t)] = json.loads(encoder.encode(summary.take()))
    with gzip.open(out, "wt", encoding="utf-8") as fh:
        for r in reports:
            r["jobs"] = sections[(r["node"], r["time"])]
            if pods:
                r["pods"] = fleet.pods(r["node"], r["time"] - T0, [g["uuid"] for g in r["gpus"]])
            else:
                r.pop("pods", None)
            fh.write(json.dumps(r) + "\n")
    return lines


def score(decisions: Path) -> dict[str, Any]:
    truth = {str(p[0]) for kind, _, p in FAULTS if kind != "link"}
    quarantined: dict[str, tuple[float, list[str]]] = {}
    links: list[tuple[float, str, str, str]] = []
    for line in decisions.read_text().splitlines():
        d = json.loads(line)
        if d["subject"] == "node" and d["state"] == "quarantined" and d["node"] not in quarantined:
            keys = sorted(
                {
                    f"{r['detector']}:{r.get('rule') or (r.get('evidence') or {}).get('job', '')}"
                    for r in d["reasons"]
                }
            )
            quarantined[d["node"]] = (d["time"] - T0, keys)
        elif d["subject"] != "node" and d["state"] == "degraded":
            links.append((d["time"] - T0, d["node"], d.get("peer") or "", d["state"]))
    faults = []
    for kind, at, p in FAULTS:
        if kind == "link":
            a, b = p[0]  # type: ignore[misc]
            hit = next((t for t, x, y, _ in links if {x, y} == {a, b}), None)
            faults.append(
                {"fault": f"{kind} {a}-{b}", "from_s": at, "caught_s": hit, "by": ["link"] if hit else []}
            )
        else:
            got = quarantined.get(str(p[0]))
            faults.append(
                {
                    "fault": f"{kind} {p[0]}",
                    "from_s": at,
                    "caught_s": got[0] if got else None,
                    "by": got[1] if got else [],
                }
            )
    false = {n: v for n, v in quarantined.items() if n not in truth}
    return {"faults": faults, "false_quarantines": false, "links": links}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--spread", type=float, default=0.0, help="healthy GPUs' spread of speed (0.01: 1 %%)")
    ap.add_argument("--minutes", type=int, default=24)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-pods", action="store_true", help="reports without PodResources attribution")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    logging.getLogger().setLevel(logging.ERROR)
    started, cpu = time.perf_counter(), time.process_time()
    scenario = scenario_mod.parse({**BASE, "minutes": args.minutes})
    with tempfile.TemporaryDirectory(prefix="gpuwarden-jobgen-") as tmp:
        base, trace, out = (
            Path(tmp) / "base.jsonl.gz",
            Path(tmp) / "trace.jsonl.gz",
            Path(tmp) / "decisions.jsonl",
        )
        write_trace(scenario, base)
        lines = generate(base, trace, Fleet(args.seed, args.spread), pods=not args.no_pods)
        replayed(trace, out, Config(), load_rules([default_rules_dir()]))
        result = score(out)
    result.update(
        spread=args.spread,
        seed=args.seed,
        minutes=args.minutes,
        inspector_lines=lines,
        seconds=round(time.perf_counter() - started, 1),
        cpu_seconds=round(time.process_time() - cpu, 1),
    )
    command = "bench/jobgen.py " + " ".join(
        [f"--spread {args.spread}", f"--minutes {args.minutes}", f"--seed {args.seed}"]
        + (["--no-pods"] if args.no_pods else [])
    )
    print(f"`{command}`: {lines} Inspector lines, {result['cpu_seconds']} CPU s\n")
    print("| fault | from | caught at | by |\n|---|---|---|---|")
    for f in result["faults"]:
        caught = "missed" if f["caught_s"] is None else f"{f['caught_s']:.0f} s"
        print(f"| {f['fault']} | {f['from_s']:.0f} s | {caught} | {', '.join(f['by'])} |")
    print(f"\nfalse quarantines: {len(result['false_quarantines'])}")
    for n, (t, by) in sorted(result["false_quarantines"].items()):
        print(f"- {n} at {t:.0f} s: {', '.join(by)}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
