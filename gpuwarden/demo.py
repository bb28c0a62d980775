"""``gpuwarden demo``: a small fleet of real agents, a real aggregator, faults, decisions.

Everything is the production code path except the hardware: each node's GPUs are a fake NVML
(``agent/gpu/fake.py``, raising pynvml's own errors) and its NICs are the generated H100 sysfs
tree (``tests/fixtures/sysfs/h100``, laid out as the kernel lays it out). The agents run their
collectors, ship reports with bearer tokens over HTTP to the aggregator on 127.0.0.1 (in the
encoding it offers), and the aggregator's pipeline decides. The demo then breaks some nodes the
way real nodes break and prints each decision as the aggregator makes it, read back from its API.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import secrets
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from agent.clock import SystemClock
from agent.collectors import build_collectors
from agent.collectors.base import CollectorContext, Paths
from agent.errors import ConfigError
from agent.gpu.events import NvmlXidSource
from agent.gpu.fake import FakeNvml
from agent.gpu.session import NvmlSession
from agent.runner import Agent
from agent.shipper import Shipper
from gpuwarden.narrate import Narrator, action_words

REPO = Path(__file__).resolve().parents[1]
H100_TREE = REPO / "tests" / "fixtures" / "sysfs" / "h100" / "sys"


def demo_config(interval: float) -> str:
    """Shorter periods than production so the demo shows a whole life cycle in a minute or two;
    silence waits four report intervals (at least 8 s), where production's default waits six."""
    return f"""
fleet: {{interval_seconds: {interval}}}
health: {{suspect_for_seconds: 20, clear_for_seconds: 10, probation_seconds: 30}}
silence: {{silent_after_seconds: {max(8.0, 4 * interval)}}}
# The demo serves on 127.0.0.1 only: the status page opens in a browser without a token.
server: {{status_page_public: true}}
"""


@dataclass
class Node:
    name: str
    agent: Agent
    nvml: FakeNvml
    sysfs: Path
    shipper: Shipper


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=12, help="fleet size (default 12)")
    p.add_argument("--interval", type=float, default=2.0, help="report interval in seconds (default 2)")
    p.add_argument("--seconds", type=float, default=100.0, help="how long to run (default 100)")


def _break_ib_port(sysfs: Path, device: str) -> None:
    port = sysfs / "class" / "infiniband" / device / "ports" / "1"
    (port.resolve() / "state").write_text("1: DOWN\n")
    (port.resolve() / "phys_state").write_text("3: Disabled\n")


def _reboot(node: Node, *, repaired_gpu: int) -> None:
    """A repaired node comes back: new boot id, counters from zero, a healthy GPU in the slot."""
    node.agent.boot_id = f"{node.agent.boot_id}-r"
    node.nvml.update(
        repaired_gpu,
        {
            "ecc_dbe_volatile": 0,
            "ecc_dbe_aggregate": 0,
            "remapped_rows_uncorrectable": 0,
            "remapped_rows_failure": False,
        },
    )


def _get(url: str, token: str) -> Any:
    # Reads need a viewer token (aggregator/service.py).
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read())


def _describe_decision(d: Mapping[str, Any]) -> str:
    why = "; ".join(r["summary"] for r in d["reasons"]) or "-"
    # The demo attaches no cluster: remediation says what it would do.
    act = action_words(str(d["action"]), cluster=False)
    return f"decision {d['node']}: {d['previous']} -> {d['state']} ({act}): {why}"


def run(args: argparse.Namespace) -> int:
    from aggregator.app import build_aggregator  # noqa: PLC0415 - the agent side must not need these
    from aggregator.configload import parse_config  # noqa: PLC0415
    from aggregator.rules import default_rules_dir, load_rules  # noqa: PLC0415

    if not H100_TREE.is_dir():
        print(f"demo: recorded tree missing at {H100_TREE}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="gpuwarden-demo-"))
    # The demo's nodes have no kernel log (XIDs come from the fake NVML's event API); that is
    # expected here, so the collectors' warning about it would only be noise.
    logging.getLogger("agent.collectors.xid").setLevel(logging.ERROR)
    clock = SystemClock()
    names = [f"gpu-{i:03d}" for i in range(args.nodes)]
    tokens = {n: secrets.token_urlsafe(24) for n in names}
    viewer = secrets.token_urlsafe(24)
    (work / "tokens").write_text("".join(f"{n} {t}\n" for n, t in tokens.items()) + f"viewer:demo {viewer}\n")

    if not (math.isfinite(args.interval) and 0.5 <= args.interval <= 10):
        raise ConfigError("--interval must be between 0.5 and 10 seconds for the demo")
    config = parse_config(demo_config(args.interval), "demo config")
    loop = asyncio.new_event_loop()
    aggregator = loop.run_until_complete(
        build_aggregator(
            config,
            load_rules([default_rules_dir()]),
            auth=work / "tokens",
            clock=clock,
            decisions=work / "decisions.jsonl",
            registry=CollectorRegistry(),
        )
    )
    stop = asyncio.Event()
    bound: list[int] = []
    started = threading.Event()

    def _serve() -> None:
        asyncio.set_event_loop(loop)

        def _on_started(_host: str, port: int) -> None:
            bound.append(port)
            started.set()

        loop.run_until_complete(aggregator.serve("127.0.0.1", 0, stop=stop, on_started=_on_started))

    server = threading.Thread(target=_serve, name="aggregator", daemon=True)
    server.start()
    if not started.wait(15):
        print("demo: the aggregator did not start", file=sys.stderr)
        return 1
    base = f"http://127.0.0.1:{bound[0]}"

    nodes: list[Node] = []
    for i, name in enumerate(names):
        sysfs = H100_TREE
        if i == 8 % args.nodes:  # this node's IB port goes down: it gets its own copy of the tree
            sysfs = work / name / "sys"
            shutil.copytree(H100_TREE, sysfs, symlinks=True)
        nvml = FakeNvml.from_dict({"seed": name, "all": {"utilization_gpu": 85, "sm_clock": 1980}})
        session = NvmlSession(nvml, clock)
        ctx = CollectorContext(
            paths=Paths(sysfs=sysfs, procfs=work / "proc", kmsg=work / "no-kmsg"),
            clock=clock,
            nvml=session,
            xid_source=NvmlXidSource(session, clock),
        )
        rack, leaf = f"rack-{i // 4}", f"leaf-{i // 8}"
        agent = Agent(
            node=name,
            collectors=build_collectors(ctx),
            clock=clock,
            boot_id=f"boot-{name}",
            interval_seconds=args.interval,
            labels={"pool": "h100-demo", "rack": rack, "leaf": leaf},
        )
        (work / f"{name}.token").write_text(tokens[name] + "\n")
        shipper = Shipper(base, work / f"{name}.token", clock, backoff_base_s=0.2, backoff_max_s=2.0)
        shipper.start()
        nodes.append(Node(name, agent, nvml, sysfs, shipper))

    silent: set[str] = set()

    def at(index: int) -> Node:
        return nodes[index % len(nodes)]

    def app_xid() -> None:
        at(2).nvml.inject_xid(1, 13)

    def gpu_off_the_bus() -> None:
        at(4).nvml.inject_xid(3, 79)
        at(4).nvml.update(3, {"lost": True})

    def dbe_and_remap_failure() -> None:
        at(6).nvml.inject_xid(5, 48)
        at(6).nvml.update(
            5,
            {
                "ecc_dbe_volatile": 1,
                "ecc_dbe_aggregate": 1,
                "remapped_rows_uncorrectable": 1,
                "remapped_rows_failure": True,
            },
        )

    # What happens, and when (seconds from the start). Look-alikes too: they must not matter.
    faults: list[tuple[float, str, Callable[[], None]]] = [
        (6, f"{at(2).name}: application XID 13 on GPU 1 (a user's bad kernel: no quarantine)", app_xid),
        (10, f"{at(4).name}: GPU 3 falls off the bus (XID 79)", gpu_off_the_bus),
        (14, f"{at(6).name}: GPU 5 double-bit ECC error (XID 48), row remap failed", dbe_and_remap_failure),
        (
            18,
            f"{at(8).name}: InfiniBand port mlx5_2 goes down (quarantine after 30 s down)",
            lambda: _break_ib_port(at(8).sysfs, "mlx5_2"),
        ),
        (
            22,
            f"{at(10).name}: its agent stops reporting (silence: suspect, never quarantine)",
            lambda: silent.add(at(10).name),
        ),
        (36, f"{at(10).name}: its agent is back", lambda: silent.discard(at(10).name)),
        (
            40,
            f"{at(6).name}: GPU 5 replaced and the node rebooted (probation, then release)",
            lambda: _reboot(at(6), repaired_gpu=5),
        ),
    ]

    print(
        f"gpuwarden demo: {len(nodes)} nodes (8 fake H100s and 8 recorded NDR ports each), "
        f"aggregator at {base}, reports every {args.interval:g} s, running {args.seconds:g} s"
    )
    print(f"  status page: {base}/ (open it in a browser while the demo runs)")
    print(f"  decision log: {work / 'decisions.jsonl'}\n")
    start = time.monotonic()
    next_cycle = start
    seen = 0.0
    slow_said = False
    narrator = Narrator(
        stamp=lambda _t: f"{time.monotonic() - start:5.1f}s",
        describe=lambda d: f"[{time.monotonic() - start:5.1f}s] {_describe_decision(d)}",
    )
    try:
        while (elapsed := time.monotonic() - start) < args.seconds:
            while faults and elapsed >= faults[0][0]:
                _, what, do = faults.pop(0)
                do()
                print(f"[{elapsed:5.1f}s] inject   {what}")
            if time.monotonic() >= next_cycle:
                for n in nodes:
                    if n.name not in silent:
                        n.shipper.submit(n.agent.cycle().report)
                next_cycle += args.interval
                behind = time.monotonic() - next_cycle
                if behind > args.interval:
                    # The agents' cycles take longer than the interval here: say so once, and
                    # keep the pace this machine can rather than fall further behind.
                    if not slow_said:
                        took = behind + args.interval
                        print(
                            f"[{time.monotonic() - start:5.1f}s] this machine needs {took:.1f} s for a round "
                            f"of {len(nodes)} reports: reports go as fast as it allows"
                        )
                        slow_said = True
                    next_cycle = time.monotonic()
            found = _get(f"{base}/api/v1/decisions?since={seen}&limit=1000", viewer)["decisions"]
            for d in found:
                seen = max(seen, d["time"] + 1e-6)
            lines = narrator.systemic(_get(f"{base}/api/v1/summary", viewer)["systemic_active"], time.time())
            for line in lines + narrator.decisions(found, time.time()):
                print(line)
            time.sleep(0.25)
    finally:
        for line in narrator.flush(time.time(), everything=True):
            print(line)
        for n in nodes:
            n.shipper.close(timeout_s=2.0)
            n.agent.close()
        print("\nnodes now:")
        for row in _get(f"{base}/api/v1/nodes", viewer)["nodes"]:
            print(f"  {row['node']:10} {row['state']:12} {row['rack']:8} {'; '.join(row['reasons'])[:100]}")
        loop.call_soon_threadsafe(stop.set)
        server.join(15)
        aggregator.close()  # closed by serve() already, unless it never started
    return 0
