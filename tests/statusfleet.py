"""A fleet for the status page's tests, screenshots and benchmark: a simulated pool run through the
real pipeline, left with a node of every kind on show.

At the end of the run: one node quarantined (XID 79), one suspect (too hot), a rack silent (a
systemic event), a degraded link between two nodes, decisions in the feed and pair probes in the
link matrix. ``clock`` stands at the last delivery, so "ago" and the decision window read as they
would live.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from aiohttp import web

from agent.clock import FakeClock
from aggregator.app import build_pipeline, build_read_only_app
from aggregator.config import Config
from aggregator.configload import parse_config
from aggregator.pipeline import Pipeline
from aggregator.probes.scheduler import ProbeScheduler
from aggregator.rules import default_rules_dir, load_rules
from aggregator.service import serve
from sim.scenario import FaultSpec
from tests.simfleet import fault, fleet, generate

QUARANTINED = "gpu-0003"
SUSPECT = "gpu-0010"
SILENT_RACK = "rack-003"

# The browser looks at the pages without a token, as the demo's does (tests/test_status_page.py
# checks that they ask for a viewer token when server.status_page_public is off).
CONFIG_TEXT = """
remediation: {mode: dry-run}
health: {suspect_for_seconds: 600}
server: {status_page_public: true}
"""


@dataclass
class StatusFleet:
    pipeline: Pipeline
    clock: FakeClock
    config: Config
    nodes: int


def status_fleet(nodes: int = 32, *, minutes: float = 20.0, seed: int = 19) -> StatusFleet:
    """``nodes`` H100 nodes (8 per rack) for ``minutes``; the faults land in the second half."""
    end = minutes * 60.0
    faults = [
        fault("xid79", end * 0.5, node=QUARANTINED, gpu=3),
        fault("thermal", end * 0.8, node=SUSPECT, gpu=2),
        fault("silent_rack", end - 150.0, rack=SILENT_RACK),
    ]
    faults.append(FaultSpec(kind="degraded_link", at_s=end * 0.2, leaf="leaf-00", params={"ratio": 0.5}))
    scenario = fleet(nodes, seed=seed, duration_s=end, faults=faults)
    config = parse_config(CONFIG_TEXT, "status fleet")
    # A probe scheduler as a live aggregator with --probe-key-file has: the coverage page's source.
    probes = ProbeScheduler(config.probes, b"status-fleet-probe-key-0123456789abcdef")
    pipeline = build_pipeline(config, load_rules([default_rules_dir()]), probes=probes)
    last = 0.0
    for received, report in generate(scenario):
        pipeline.ingest(report, received)
        last = received
    clock = FakeClock(last)
    pipeline.advance(last)
    return StatusFleet(pipeline, clock, config, nodes)


# -- serving it, and looking at it with a real browser ---------------------------------------------


@contextmanager
def serving(f: StatusFleet) -> Iterator[Served]:
    """The aggregator's app on the fleet, on 127.0.0.1 (a free port), in a thread; every request
    path it answered is in ``Served.paths``."""
    # The read-only app the composition root builds for a pipeline already driven to its state
    # (as `gpuwarden replay --serve`): no ingest route, reads open (tests/test_status_page_auth.py
    # covers the viewer token on the live app).
    app = build_read_only_app(f.pipeline, f.config, f.clock)
    served = Served("", [])

    @web.middleware
    async def record(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        served.requests.append(f"{request.host} {request.path_qs}")
        return await handler(request)

    app.middlewares.append(record)
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    started = threading.Event()

    def on_started(_host: str, port: int) -> None:
        served.base = f"http://127.0.0.1:{port}"
        started.set()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(serve(app, "127.0.0.1", 0, stop=stop, on_started=on_started))

    thread = threading.Thread(target=run, name="status-page", daemon=True)
    thread.start()
    if not started.wait(15):
        raise RuntimeError("the status page's server did not start")
    try:
        yield served
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(15)


@dataclass
class Served:
    base: str
    requests: list[str]  # "host path?query" of every request the server saw


def chromium_binary() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@dataclass
class Look:
    dom: str  # the page's DOM after load (--dump-dom)
    urls: list[str]  # every URL the browser asked for, from its net log


def chromium(
    url: str, work: Path, *, screenshot: Path | None = None, size: tuple[int, int] = (1280, 900)
) -> Look:
    """Open ``url`` in headless chromium, with every host but 127.0.0.1 unresolvable, and return
    the DOM and every URL it requested (its net log); with ``screenshot``, a PNG of the page too."""
    binary = chromium_binary()
    if binary is None:
        raise RuntimeError("chromium is not installed (scripts/setup installs it)")
    work.mkdir(parents=True, exist_ok=True)
    netlog = work / "netlog.json"
    args = [
        binary,
        "--headless",
        "--no-sandbox",  # root in CI containers; the page is our own
        "--disable-gpu",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-extensions",
        "--hide-scrollbars",
        f"--user-data-dir={work / 'profile'}",
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
        f"--log-net-log={netlog}",
        f"--window-size={size[0]},{size[1]}",
    ]
    if screenshot is not None:
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        args.append(f"--screenshot={screenshot}")
    else:
        args.append("--dump-dom")
    done = subprocess.run([*args, url], capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"chromium failed ({done.returncode}): {done.stderr[-2000:]}")
    urls = (
        sorted(set(re.findall(r'"url":"([^"]+)"', netlog.read_text(errors="replace"))))
        if netlog.exists()
        else []
    )
    return Look(done.stdout, urls)


# The pages worth a picture: (file name in docs/images, path).
PAGES: Final = (
    ("status-fleet", "/"),
    ("status-nodes", "/nodes"),
    ("status-nodes-filtered", "/nodes?state=quarantined"),
    ("status-node", f"/nodes/{QUARANTINED}"),
    ("status-decisions", "/decisions"),
    ("status-systemic", "/systemic"),
    ("status-links", "/links"),
    ("status-probes", "/probes"),
)
