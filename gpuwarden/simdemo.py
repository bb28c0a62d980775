"""``gpuwarden demo-sim``: a simulated fleet of a few hundred nodes against a live aggregator.

The simulator (``sim/``) produces every node's reports and the ground truth of what it broke; this
command starts the real aggregator on 127.0.0.1 and posts those reports to it over HTTP (gzip,
bearer tokens) in receive order, with wall time running ``--speed`` times faster than simulated
time. The aggregator's clock is injected and set to each report's receive time, and its
time-driven work runs once per simulated second, exactly as ``tests/test_replay.py`` drives it,
so the decisions are the ones a live aggregator would make on that fleet. Faults are printed as
they start, decisions as the aggregator makes them (read back from its API), and at the end the
ground truth is scored against the decisions.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gzip
import logging
import math
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Final, TextIO

import aiohttp

from agent.clock import SettableClock
from agent.errors import ConfigError
from agent.report import encode
from gpuwarden.narrate import Narrator, action_words
from sim import scenario as scenario_mod
from sim import truth as truth_mod
from sim.eval import load_decisions, score
from sim.fleet import Delivery, simulate

log = logging.getLogger(__name__)

DEFAULT_NODES: Final = 256
MIN_BUILTIN_NODES: Final = 64  # twelve H100 racks and four A100 racks: one fault per rack
POLL_EVERY_S: Final = 0.25  # wall seconds between reads of the decision API
# Wall seconds behind schedule before the demo says so and slows to the pace this machine keeps.
BEHIND_S: Final = 5.0

# The built-in fleet's faults: (kind, pool, rack slot, node in rack, at_s, fields). Slots are
# spread evenly over each pool's racks, so every fault sits on a rack of its own whatever the
# fleet size; H100 slot 8 stays clean because it shares a leaf with the degraded link (slot 9),
# whose pair probes must not meet a slow node. Everything starts within the first ten minutes,
# leaving soft faults (median time to detect about 3 minutes) and the link time to show.
_H100_SLOTS: Final = 12
_A100_SLOTS: Final = 4
_BUILTIN_FAULTS: Final[tuple[tuple[str, str, int, int, float, Mapping[str, Any]], ...]] = (
    ("clock_skew", "a100", 3, 1, 0.0, {"seconds": 45}),
    ("degraded_link", "h100", 9, 0, 60.0, {"peer_offset": 2, "ratio": 0.65}),
    ("thermal", "h100", 3, 1, 60.0, {"gpu": 1, "temperature_c": 82, "clock_ratio": 0.85}),
    ("xid79", "h100", 0, 1, 120.0, {"gpu": 3}),
    ("slow_gpu", "h100", 5, 1, 150.0, {"gpu": 4, "ratio": 0.88, "busbw_ratio": 0.9}),
    ("app_xid", "h100", 11, 2, 200.0, {"gpu": 2, "code": 13}),
    ("power_brake", "h100", 4, 1, 240.0, {"clock_ratio": 0.6}),
    ("dbe", "h100", 1, 1, 300.0, {"gpu": 5}),
    ("slow_nic", "a100", 2, 2, 300.0, {"ratio": 0.7}),
    ("pcie_downtrain", "a100", 1, 1, 360.0, {"gpu": 6, "width": 8}),
    ("reboot", "h100", 11, 1, 390.0, {"down_s": 240}),
    ("nvlink_crc", "h100", 6, 1, 420.0, {"gpu": 2, "link": 7, "rate_per_s": 2}),
    ("remap_failure", "a100", 0, 1, 450.0, {"gpu": 0}),
    ("symbol_storm", "h100", 7, 1, 480.0, {"port": 5, "rate_per_s": 50}),
    ("ib_port_down", "h100", 2, 1, 510.0, {"port": 2}),
    ("app_xid", "a100", 2, 1, 540.0, {"gpu": 0, "code": 43}),
    ("silent_rack", "h100", 10, 0, 570.0, {"until_s": 870}),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--nodes",
        type=int,
        default=None,
        help=f"fleet size (default {DEFAULT_NODES}; with --scenario, the file's; pools keep their shares)",
    )
    p.add_argument("--minutes", type=float, default=20.0, help="simulated minutes (default 20)")
    p.add_argument("--speed", type=float, default=20.0, help="simulated seconds per wall second (default 20)")
    p.add_argument(
        "--scenario",
        type=Path,
        default=None,
        help="a scenario YAML (docs/simulator.md) instead of the built-in fleet, e.g. scenarios/fleet64.yaml",
    )
    p.add_argument("--seed", type=int, default=None, help="random seed (default: the scenario's)")


def builtin_scenario(nodes: int, minutes: float, seed: int) -> scenario_mod.Scenario:
    """A fleet of H100 and A100 pools (3:1) in racks of 4 and leaves of 8, one of every fault."""
    if nodes < MIN_BUILTIN_NODES:
        raise ConfigError(f"--nodes must be at least {MIN_BUILTIN_NODES} for the built-in fleet, got {nodes}")
    # Whole leaves of H100s, so the A100 pool starts on a rack and a leaf boundary of its own.
    h100 = (nodes * 3 // 4) // 8 * 8
    a100 = nodes - h100
    pools = {"h100": (0, h100, _H100_SLOTS), "a100": (h100, a100, _A100_SLOTS)}
    faults: list[dict[str, Any]] = []
    for kind, pool, slot, offset, at_s, fields in _BUILTIN_FAULTS:
        first, size, slots = pools[pool]
        rack_first = first + slot * ((size // 4) // slots) * 4
        fault: dict[str, Any] = {"kind": kind, "at_s": at_s}
        extra = dict(fields)
        if kind == "silent_rack":
            fault["rack"] = f"rack-{rack_first // 4:03d}"
        else:
            fault["node"] = scenario_mod.node_name(rack_first + offset)
        if "peer_offset" in extra:
            fault["peer"] = scenario_mod.node_name(rack_first + int(extra.pop("peer_offset")))
        fault.update(extra)
        faults.append(fault)
    return scenario_mod.parse(
        {
            "seed": seed,
            "minutes": minutes,
            "interval_s": 10,
            "nodes_per_rack": 4,
            "racks_per_leaf": 2,
            "pools": [
                {"name": "h100", "profile": "h100-sxm-80gb", "nodes": h100},
                {"name": "a100", "profile": "a100-sxm-80gb", "nodes": a100},
            ],
            # Half the fleet busy at any time: load-only faults need load, probes need idle nodes.
            "jobs": {"busy_mean_s": 1200, "idle_mean_s": 1200},
            "ambient": {"base_c": 24, "amplitude_c": 2, "period_s": 86400, "drift_c_per_hour": 0.5},
            "delivery": {"lost_fraction": 0.01, "duplicate_fraction": 0.005, "jitter_s": 2},
            "probes": {"local_every_s": 300, "pair_every_s": 60, "size_bytes": 1 << 30},
            "faults": [f for f in faults if f["at_s"] <= minutes * 60.0],
        }
    )


def _scenario(args: argparse.Namespace) -> scenario_mod.Scenario:
    if not (math.isfinite(args.minutes) and 0 < args.minutes <= 24 * 60):
        raise ConfigError(f"--minutes must be between 0 and 1440, got {args.minutes!r}")
    if args.scenario is None:
        return builtin_scenario(
            args.nodes or DEFAULT_NODES, args.minutes, 1 if args.seed is None else args.seed
        )
    return scenario_mod.load(args.scenario).with_overrides(
        seed=args.seed, nodes=args.nodes, minutes=args.minutes
    )


def _offset(s: scenario_mod.Scenario, t: float) -> str:
    rel = max(0, int(t - s.start))
    return f"t+{rel // 60:02d}:{rel % 60:02d}"


def _where(f: scenario_mod.FaultSpec) -> str:
    if f.kind == "silent_rack":
        return f"{f.rack}"
    where = f"{f.node}"
    if f.peer is not None:
        where += f" <-> {f.peer}"
    if f.gpu is not None:
        where += f" GPU {f.gpu}"
    if f.port is not None:
        where += f" mlx5_{f.port}"
    return where


def _describe(f: scenario_mod.FaultSpec) -> str:
    params = ", ".join(f"{k} {f.param(k):g}" for k in scenario_mod.FAULT_KINDS[f.kind][2])
    cls = "look-alike, must not quarantine" if f.fault_class == "lookalike" else f.fault_class
    text = f"fault: {f.kind} on {_where(f)} ({cls}{', ' + params if params else ''})"
    if f.until_s is not None:
        text += f", until t+{int(f.until_s) // 60:02d}:{int(f.until_s) % 60:02d}"
    return text


def _describe_decision(s: scenario_mod.Scenario, d: Mapping[str, Any]) -> str:
    who = f"{d['node']} <-> {d['peer']} (link)" if d.get("subject") == "link" else str(d["node"])
    reasons = [str(r.get("summary", "")) for r in d.get("reasons") or []]
    # A node-wide fault gives one reason per GPU: two say what it is, the count says how wide.
    why = "; ".join(reasons[:2]) + (f"; and {len(reasons) - 2} more" if len(reasons) > 2 else "") or "-"
    # No cluster is attached: remediation says what it would do.
    act = action_words(str(d["action"]), cluster=False)
    return f"[{_offset(s, float(d['time']))}] {who} {d['previous']} -> {d['state']} ({act}): {why}"


@dataclasses.dataclass
class _Progress:
    sent: int = 0
    refused: int = 0
    max_lag_s: float = 0.0
    pace: float = 0.0  # the simulated seconds per wall second actually kept (set at the start)
    last_time: float = 0.0
    interrupted: bool = False
    first_seen: dict[int, float] = dataclasses.field(default_factory=dict)


def _catch(f: truth_mod.TruthFault, decisions: list[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The decision that caught the fault, by the scoring rules of ``sim.eval``."""
    for d in decisions:
        if float(d["time"]) < f.start:
            continue
        node_decision = d.get("subject") == "node" and d["node"] == f.node
        if f.fault_class in ("hard", "soft") and node_decision and d["state"] == "quarantined":
            return d
        if (
            f.fault_class == "link"
            and d.get("subject") == "link"
            and d["state"] == "degraded"
            and {d["node"], d.get("peer")} == {f.node, f.peer}
        ):
            return d
        if (
            f.fault_class == "silent"
            and node_decision
            and any(r.get("detector") == "silence" for r in d.get("reasons") or [])
        ):
            return d
    return None


def _summary(
    s: scenario_mod.Scenario,
    progress: _Progress,
    decisions: list[Mapping[str, Any]],
    log_path: Path,
    out: TextIO,
) -> None:

    truth = truth_mod.build(s, progress.first_seen)
    now = progress.last_time
    truth = dataclasses.replace(truth, faults=tuple(f for f in truth.faults if f.start <= now))
    print(f"\nground truth vs decisions ({_offset(s, now)}, {s.node_count} nodes):", file=out)
    quarantined = {
        str(d["node"]) for d in decisions if d.get("subject") == "node" and d["state"] == "quarantined"
    }
    for f in truth.faults:
        where = f.node + (f" <-> {f.peer}" if f.peer else "")
        head = f"  {f.fault_class:9} {f.kind:14} {where:22} start {_offset(s, f.start)}"
        if f.fault_class == "lookalike":
            verdict = "quarantined (WRONG)" if f.node in quarantined else "not quarantined (right)"
        else:
            caught = _catch(f, decisions)
            if caught is None:
                verdict = (
                    "not caught" if f.first_seen is not None or f.fault_class == "silent" else "never showed"
                )
            else:
                seen = f.first_seen if f.first_seen is not None else f.start
                verdict = (
                    f"{caught['state']} at {_offset(s, float(caught['time']))} "
                    f"({float(caught['time']) - seen:.0f} s after it showed)"
                )
        print(f"{head}: {verdict}", file=out)
    result = score(truth, load_decisions(log_path))
    recall = []
    for cls, c in result["classes"].items():
        if c["faults"]:
            ttd = c["time_to_detect"]["median_s"]
            recall.append(
                f"{cls} {c['caught']}/{c['faults']}" + (f" (median {ttd:.0f} s)" if ttd is not None else "")
            )
    q = result["quarantines"]
    causes = ", ".join(f"{k} {v}" for k, v in q["false_by_cause"].items() if v) or "none"
    print(f"recall: {'; '.join(recall) or 'no faults yet'}", file=out)
    print(f"quarantines: {q['total']} ({q['true']} true, {q['false']} false: {causes})", file=out)
    print(
        f"links degraded: {result['links']['true']}/{result['links']['degraded']} on a faulty link", file=out
    )


async def _demo(s: scenario_mod.Scenario, speed: float, work: Path, out: TextIO) -> int:
    from prometheus_client import CollectorRegistry  # noqa: PLC0415

    from aggregator.app import build_aggregator  # noqa: PLC0415
    from aggregator.config import Config, ServerConfig  # noqa: PLC0415
    from aggregator.rules import default_rules_dir, load_rules  # noqa: PLC0415
    from aggregator.service import REPORTS_PATH  # noqa: PLC0415

    tokens = {n: secrets.token_urlsafe(24) for n in s.node_names()}
    viewer = secrets.token_urlsafe(24)  # reads need a viewer token (aggregator/service.py)
    (work / "tokens").write_text(
        "".join(f"{n} {t}\n" for n, t in tokens.items()) + f"viewer:simdemo {viewer}\n"
    )
    clock = SettableClock(s.start)
    # No periodic task: the demo advances the pipeline itself, once per simulated second.
    aggregator = await build_aggregator(
        # On 127.0.0.1 only: the status page opens in a browser without a token.
        Config(server=ServerConfig(status_page_public=True)),
        load_rules([default_rules_dir()]),
        auth=work / "tokens",
        clock=clock,
        decisions=work / "decisions.jsonl",
        registry=CollectorRegistry(),
        advance_interval_s=None,
    )
    pipeline = aggregator.pipeline
    loop = asyncio.get_running_loop()
    interrupted = asyncio.Event()
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        loop.add_signal_handler(signal.SIGINT, interrupted.set)
    stop = asyncio.Event()
    bound: asyncio.Future[int] = loop.create_future()
    server = asyncio.create_task(
        aggregator.serve("127.0.0.1", 0, stop=stop, on_started=lambda _h, port: bound.set_result(port)),
        name="aggregator",
    )
    progress = _Progress(last_time=s.start)
    seen: list[Mapping[str, Any]] = []
    try:
        waiters: set[asyncio.Future[Any]] = {server, bound}
        done, _ = await asyncio.wait(waiters, timeout=15, return_when=asyncio.FIRST_COMPLETED)
        if bound not in done:
            print("demo-sim: the aggregator did not start", file=sys.stderr)
            return 1
        base = f"http://127.0.0.1:{bound.result()}"
        print(
            f"gpuwarden demo-sim: {s.node_count} simulated nodes "
            f"({', '.join(f'{p.nodes} {p.name}' for p in s.pools)}), {len(s.faults)} faults, "
            f"{s.duration_s / 60:g} simulated minutes at {speed:g}x "
            f"(about {s.duration_s / speed:.0f} s); aggregator at {base}",
            file=out,
        )
        print(f"  status page: {base}/ (open it in a browser while the demo runs)", file=out)
        print(f"  decision log: {work / 'decisions.jsonl'}\n", file=out, flush=True)
        async with aiohttp.ClientSession(base, headers={"Authorization": f"Bearer {viewer}"}) as session:
            await _stream(
                s,
                speed=speed,
                session=session,
                path=REPORTS_PATH,
                tokens=tokens,
                pipeline=pipeline,
                clock=clock,
                interrupted=interrupted,
                progress=progress,
                seen=seen,
                out=out,
            )
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(server, 15)
        aggregator.close()  # closed by serve() already, unless it never started
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.remove_signal_handler(signal.SIGINT)
    if progress.interrupted:
        print(f"\ninterrupted at {_offset(s, progress.last_time)}", file=out)
    _summary(s, progress, seen, work / "decisions.jsonl", out)
    print(
        f"reports sent: {progress.sent} ({progress.refused} refused); "
        f"most behind schedule: {progress.max_lag_s:.1f} s wall"
        + (f" (ran at {progress.pace:g}x, the pace this machine kept)" if progress.pace != speed else ""),
        file=out,
        flush=True,
    )
    return 130 if progress.interrupted else 0


async def _stream(
    s: scenario_mod.Scenario,
    *,
    speed: float,
    session: aiohttp.ClientSession,
    path: str,
    tokens: Mapping[str, str],
    pipeline: Any,
    clock: SettableClock,
    interrupted: asyncio.Event,
    progress: _Progress,
    seen: list[Mapping[str, Any]],
    out: TextIO,
) -> None:
    """Post every delivery at its scaled receive time, print faults and decisions as they come."""
    pending_faults = sorted(
        [(s.start + f.at_s, _describe(f)) for f in s.faults]
        + [
            (s.start + f.until_s, f"fault ends: {f.kind} on {_where(f)}")
            for f in s.faults
            if f.until_s is not None and f.until_s <= s.duration_s
        ]
    )
    since = 0.0
    wall_start = time.monotonic()
    last_poll = wall_start
    next_tick = math.floor(s.start) + 1.0
    # Where the schedule is measured from: moved when the demo slows to the pace it can keep.
    sim_base = s.start
    progress.pace = speed
    narrator = Narrator(stamp=lambda t: _offset(s, t), describe=lambda d: _describe_decision(s, d))

    async def poll() -> None:
        nonlocal since, last_poll
        last_poll = time.monotonic()
        async with session.get("/api/v1/decisions", params={"since": repr(since), "limit": "10000"}) as resp:
            resp.raise_for_status()
            body = await resp.json()
        async with session.get("/api/v1/summary") as resp:
            resp.raise_for_status()
            active = (await resp.json())["systemic_active"]
        lines = narrator.systemic(active, clock.now)
        for d in body["decisions"]:
            since = max(since, float(d["time"]) + 1e-6)
            seen.append(d)
        lines += narrator.decisions(body["decisions"], clock.now)
        for line in lines:
            print(line, file=out, flush=True)

    async def until(sim_time: float) -> None:
        """Advance the aggregator to ``sim_time``, waiting for wall time to catch up with it."""
        nonlocal next_tick
        while next_tick < sim_time:
            clock.now = next_tick
            pipeline.advance(next_tick)
            progress.last_time = next_tick
            next_tick += 1.0
            if pending_faults and pending_faults[0][0] <= next_tick:
                await poll()  # decisions made before the fault starts print before it
                while pending_faults and pending_faults[0][0] <= next_tick:
                    at, text = pending_faults.pop(0)
                    print(f"[{_offset(s, at)}] {text}", file=out, flush=True)
        nonlocal wall_start, sim_base
        delay = wall_start + (sim_time - sim_base) / progress.pace - time.monotonic()
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(interrupted.wait(), delay)
        else:
            progress.max_lag_s = max(progress.max_lag_s, -delay)
            if -delay > BEHIND_S:
                # This machine cannot post that fast: say so now, and keep the pace it can.
                now = time.monotonic()
                kept = (sim_time - sim_base) / max(now - wall_start, 1e-3)
                progress.pace = max(round(kept * 0.9, 1), 0.1)
                left = (s.start + s.duration_s - sim_time) / progress.pace
                print(
                    f"[{_offset(s, sim_time)}] this machine keeps about {kept:.1f}x, not "
                    f"{speed:g}x: slowing to {progress.pace:g}x (about {left:.0f} s more)",
                    file=out,
                    flush=True,
                )
                wall_start, sim_base = now, sim_time
        if time.monotonic() - last_poll >= POLL_EVERY_S:
            await poll()

    deliveries: Iterator[Delivery] = simulate(s)
    for d in deliveries:
        await until(d.receive_time)
        if interrupted.is_set():
            progress.interrupted = True
            break
        clock.now = d.receive_time
        progress.last_time = d.receive_time
        body = gzip.compress(encode(d.report), compresslevel=1)
        headers = {
            "Authorization": f"Bearer {tokens[d.report.node]}",
            "Content-Type": "application/json",
            "Content-Encoding": "gzip",
        }
        async with session.post(path, data=body, headers=headers) as resp:
            await resp.read()
            if resp.status != 200:
                progress.refused += 1
                log.warning("report refused", extra={"node": d.report.node, "status": resp.status})
        progress.sent += 1
        for idx in d.shows:
            progress.first_seen.setdefault(idx, d.report.time)
    if not progress.interrupted:
        await until(s.start + s.duration_s)
    await poll()
    for line in narrator.flush(clock.now, everything=True):
        print(line, file=out, flush=True)


def run(args: argparse.Namespace) -> int:
    if not (math.isfinite(args.speed) and 0.1 <= args.speed <= 1000):
        raise ConfigError(f"--speed must be between 0.1 and 1000, got {args.speed!r}")
    s = _scenario(args)
    work = Path(tempfile.mkdtemp(prefix="gpuwarden-demo-sim-"))
    try:
        return asyncio.run(_demo(s, args.speed, work, sys.stdout))
    finally:
        # The decision log is the one thing worth keeping; the tokens are not.
        (work / "tokens").unlink(missing_ok=True)
        if not any(work.iterdir()):
            shutil.rmtree(work, ignore_errors=True)
