"""Wire format: bytes on the wire and decode cost of JSON and the compact encoding, and what a
kept-alive connection saves.

Run from the repository root (about a minute on 2 busy cores; loopback only)::

    .venv/bin/python bench/wire.py [--nodes 64] [--rounds 4] [--repeat 7] [--posts 200] [--json FILE]

What it measures:

1. ``--nodes`` x ``--rounds`` H100 reports as the ingest bench makes them (``bench/_reports.py``:
   8 GPUs with 18 NVLinks each, 8 NDR ports with 52 counters each), encoded four ways: JSON and
   compact (``agent/wire.py``), each raw and gzip'd at level 6 as the agent gzips. Mean bytes.
2. In this process, on one core: CPU per report to encode each way (the agent's side) and to turn
   each body back into a ``Report`` the way the aggregator does (``gunzip_bounded`` when gzip'd,
   then ``decode`` or ``decode_compact``), over every body, ``--repeat`` times; the median run.
   The cycle collector stays on, as in the aggregator: what decoding leaves it to chase counts.
3. Against the aggregator's own service over TLS (``create_app`` around a pipeline that keeps
   nothing, a self-signed certificate, ``serve()``'s keep-alive settings) in a thread of this
   process: ``--posts`` reports POSTed by ``agent.shipper.Shipper`` (one kept-alive connection,
   compact once offered), and the same reports POSTed the way the shipper did before, a new
   HTTPS connection per report (gzip'd JSON). Connections opened, wall time and this process's CPU
   (client and server together: both sides pay for a handshake) per report.

Markdown goes to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import http.client
import json
import logging
import shutil
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from _common import cpu_model
from _reports import NodeSim, node_name, token_file_text, token_of
from aiohttp import web
from ingest import NoopPipeline
from prometheus_client import CollectorRegistry

from agent import wire
from agent.clock import SystemClock
from agent.report import Report, decode, encode
from agent.shipper import Shipper, WireChoice, encode_body
from aggregator.auth import StaticTokens
from aggregator.configload import load_config
from aggregator.service import REPORTS_PATH, create_app, gunzip_bounded, server_kwargs

log = logging.getLogger("bench.wire")

INTERVAL_S = 10.0
MAX_INFLATED = 16 * 1024 * 1024


def build_reports(nodes: int, rounds: int) -> list[Report]:
    start = time.time() - rounds * INTERVAL_S
    sims = [NodeSim(i, interval=INTERVAL_S) for i in range(nodes)]
    return [
        sim.report(start + r * INTERVAL_S + 0.1 * i, r) for r in range(rounds) for i, sim in enumerate(sims)
    ]


def gz(data: bytes) -> bytes:
    return gzip.compress(data, compresslevel=6, mtime=0)


ENCODINGS: dict[str, Callable[[Report], bytes]] = {
    "JSON": encode,
    "JSON, gzip 6": lambda r: gz(encode(r)),
    "compact": wire.encode_compact,
    "compact, gzip 6": lambda r: gz(wire.encode_compact(r)),
}
DECODERS: dict[str, Callable[[bytes], Report]] = {
    "JSON": decode,
    "JSON, gzip 6": lambda b: decode(gunzip_bounded(b, MAX_INFLATED)),
    "compact": wire.decode_compact,
    "compact, gzip 6": lambda b: wire.decode_compact(gunzip_bounded(b, MAX_INFLATED)),
}


def cpu_us_per_item(items: Sequence[Any], body: Callable[[Any], object], repeat: int) -> float:
    """Median over ``repeat`` runs of this process's CPU per item, in microseconds."""
    runs = []
    for _ in range(repeat):
        t0 = time.process_time()
        for item in items:
            body(item)
        runs.append((time.process_time() - t0) / len(items) * 1e6)
    return statistics.median(runs)


def measure_codec(reports: list[Report], repeat: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name, enc in ENCODINGS.items():
        bodies = [enc(r) for r in reports]
        # The decoded report must be the report, whichever way it travelled.
        assert wire.as_v1(DECODERS[name](bodies[0])) == reports[0]
        out[name] = {
            "bytes": statistics.fmean(map(len, bodies)),
            "encode_us": cpu_us_per_item(reports, enc, repeat),
            "decode_us": cpu_us_per_item(bodies, DECODERS[name], repeat),
        }
        print(f"  {name}: {out[name]}", file=sys.stderr)
    return out


# ---- keep-alive against the real service ----------------------------------------------------------


class TlsService:
    """The aggregator's service around a no-op pipeline, over TLS, in a thread of its own."""

    def __init__(self, work: Path, nodes: int) -> None:
        openssl = shutil.which("openssl")
        if openssl is None:
            raise SystemExit("bench/wire.py needs openssl for its certificate")
        self.cert, key = work / "cert.pem", work / "key.pem"
        subprocess.run(
            [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", str(key), "-out", str(self.cert), "-days", "1", "-subj", "/CN=127.0.0.1",
             "-addext", "subjectAltName=IP:127.0.0.1"],
            check=True,
            capture_output=True,
        )  # fmt: skip
        tokens = work / "tokens"
        tokens.write_text(token_file_text(nodes))
        self._ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._ctx.load_cert_chain(self.cert, key)
        self._tokens = tokens
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self.port = 0
        self._thread = threading.Thread(
            target=lambda: self._loop.run_until_complete(self._serve()), daemon=True
        )
        self._thread.start()
        if not self._ready.wait(120):
            raise SystemExit("the service did not start")

    async def _serve(self) -> None:
        config = load_config(None)
        app = create_app(
            NoopPipeline(),
            StaticTokens(self._tokens),
            config,
            SystemClock(),
            CollectorRegistry(),
            advance_interval_s=None,
        )
        runner = web.AppRunner(app, access_log=None, **server_kwargs(config.server))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=self._ctx)
        await site.start()
        self.port = runner.addresses[0][1]
        self._stop = asyncio.Event()
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


def post_one_connection_each(port: int, cert: Path, bodies: list[bytes]) -> None:
    """The shipper before keep-alive: a new HTTPS connection per report, closed after it."""
    ctx = ssl.create_default_context(cafile=str(cert))
    headers = {
        "Content-Type": "application/json",
        "Content-Encoding": "gzip",
        "Authorization": f"Bearer {token_of(0)}",
    }
    for body in bodies:
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=ctx)
        try:
            conn.request("POST", REPORTS_PATH, body=body, headers=headers)
            resp = conn.getresponse()
            resp.read()
            if resp.status != 200:
                raise SystemExit(f"the service answered {resp.status}")
        finally:
            conn.close()


def ship(url: str, token: Path, cert: Path, choice: WireChoice, batch: list[Report]) -> dict[str, float]:
    """``batch`` through one ``Shipper``; its first report is not timed (its answer offers the
    compact form: the rest go as ``choice`` says)."""
    shipper = Shipper(url, token, SystemClock(), ca_file=cert, timeout_s=10.0, wire=choice)
    shipper.start()
    shipper.submit(batch[0])
    if not shipper.flush(30.0):
        raise SystemExit("the shipper did not deliver its first report")
    t0, c0 = time.perf_counter(), time.process_time()
    for report in batch[1:]:
        shipper.submit(report)
    if not shipper.flush(60.0):
        raise SystemExit("the shipper did not deliver")
    n = len(batch) - 1
    row = {
        "connections": float(shipper.connections_opened()),
        "wall_ms": (time.perf_counter() - t0) / n * 1e3,
        "cpu_ms": (time.process_time() - c0) / n * 1e3,
    }
    sent, compact = shipper.stats().sent_total, shipper.sends_compact()
    shipper.close()
    if sent != len(batch) or compact != (choice == "auto"):
        raise SystemExit(f"the shipper delivered {sent} of {len(batch)} (compact: {compact})")
    return row


def measure_keepalive(posts: int) -> dict[str, dict[str, float]]:
    sim = NodeSim(0, interval=INTERVAL_S)
    start = time.time() - 2 * posts * INTERVAL_S
    reports = [sim.report(start + r * INTERVAL_S, r) for r in range(2 * posts)]
    out: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="gpuwarden-wire-") as tmp:
        service = TlsService(Path(tmp), 1)
        try:
            token = Path(tmp) / "token"
            token.write_text(token_of(0))
            assert reports[0].node == node_name(0)
            old = [encode_body(r) for r in reports[posts:]]
            t0, c0 = time.perf_counter(), time.process_time()
            post_one_connection_each(service.port, service.cert, old)
            out["a connection per report (gzip'd JSON)"] = {
                "connections": float(len(old)),
                "wall_ms": (time.perf_counter() - t0) / len(old) * 1e3,
                "cpu_ms": (time.process_time() - c0) / len(old) * 1e3,
            }
            url = f"https://127.0.0.1:{service.port}"
            runs: list[tuple[str, WireChoice, list[Report]]] = [
                ("Shipper, one kept-alive connection (gzip'd JSON)", "json", reports[posts:]),
                ("Shipper, one kept-alive connection (compact)", "auto", reports[:posts]),
            ]
            for label, choice, batch in runs:
                out[label] = ship(url, token, service.cert, choice, batch)
        finally:
            service.stop()
    for name, row in out.items():
        print(f"  {name}: {row}", file=sys.stderr)
    return out


def render(
    codec: dict[str, dict[str, float]], keep: dict[str, dict[str, float]], args: argparse.Namespace
) -> str:
    lines = [
        f"Machine: {cpu_model()}, Python {sys.version.split()[0]}; {args.nodes * args.rounds} H100 reports "
        f"({args.nodes} nodes x {args.rounds} rounds), median of {args.repeat} runs, CPU per report.",
        "",
        "| encoding | bytes | encode (agent) | decode (aggregator) | decode vs gzip'd JSON |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    base = codec["JSON, gzip 6"]["decode_us"]
    for name, row in codec.items():
        lines.append(
            f"| {name} | {row['bytes']:,.0f} | {row['encode_us']:,.0f} us | {row['decode_us']:,.0f} us "
            f"| {base / row['decode_us']:.2f}x |"
        )
    lines += [
        "",
        f"Over TLS to the aggregator's service on 127.0.0.1, {args.posts} reports one after another:",
        "",
        "| sender | connections | wall per report | CPU per report (both ends) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, row in keep.items():
        lines.append(
            f"| {name} | {row['connections']:.0f} | {row['wall_ms']:.2f} ms | {row['cpu_ms']:.2f} ms |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--nodes", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--posts", type=int, default=200)
    p.add_argument("--json", type=Path, help="write every measured number here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    print("building reports", file=sys.stderr)
    reports = build_reports(args.nodes, args.rounds)
    print("encode and decode", file=sys.stderr)
    codec = measure_codec(reports, args.repeat)
    print("keep-alive over TLS", file=sys.stderr)
    keep = measure_keepalive(args.posts)
    print(render(codec, keep, args))
    if args.json is not None:
        args.json.write_text(
            json.dumps({"codec": codec, "keepalive": keep, "args": vars(args)}, default=str, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
