"""``gpuwarden status`` and ``gpuwarden explain NODE``: the status page in a terminal.

    gpuwarden status  --aggregator URL [--token-file FILE]
    gpuwarden explain NODE --aggregator URL [--token-file FILE]

Both read a running aggregator's JSON (``/api/v1/summary``, ``/api/v1/nodes/<node>/story``: the
same view the status page renders). Colour only on a terminal that has it, never with NO_COLOR
set (https://no-color.org) or TERM=dumb.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from agent.errors import ConfigError
from aggregator.story import evidence_value

SUMMARY_PATH = "/api/v1/summary"
STORY_PATH = "/api/v1/nodes/{node}/story"
_COLOURS = {
    "healthy": "32",
    "suspect": "33",
    "quarantined": "31",
    "probation": "35",
    "silent": "90",
    "held": "33",
}
_COUNTED = ("healthy", "suspect", "quarantined", "probation", "silent", "held")


def add_arguments(p: argparse.ArgumentParser) -> None:
    if p.prog.endswith("explain"):
        p.add_argument("node", help="the node to explain")
    p.add_argument("--aggregator", required=True, metavar="URL", help="the aggregator's base URL")
    p.add_argument("--token-file", type=Path, help="a bearer token to send (a viewer's or an admin's)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the aggregator")


def colour_on(stream: TextIO, env: Mapping[str, str]) -> bool:
    return "NO_COLOR" not in env and env.get("TERM") != "dumb" and stream.isatty()


class _Paint:
    def __init__(self, on: bool) -> None:
        self.on = on

    def __call__(self, text: str, state: str) -> str:
        code = _COLOURS.get(state)
        return f"\x1b[{code}m{text}\x1b[0m" if self.on and code else text

    def bold(self, text: str) -> str:
        return f"\x1b[1m{text}\x1b[0m" if self.on else text


def _get(base: str, path: str, token_file: Path | None, timeout: float) -> dict[str, Any]:
    headers = {"Accept": "application/json"}
    if token_file is not None:
        try:
            headers["Authorization"] = f"Bearer {token_file.read_text().strip().splitlines()[0].strip()}"
        except (OSError, IndexError) as exc:
            raise ConfigError(f"cannot read a token from {token_file}") from exc
    url = base.rstrip("/") + path
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as resp:
            data: dict[str, Any] = json.loads(resp.read())
            return data
    except urllib.error.HTTPError as exc:
        body = exc.read().decode("utf-8", "replace")[:500]
        raise ConfigError(f"{url}: HTTP {exc.code}: {body}") from exc
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        raise ConfigError(f"{url}: {exc}") from exc


def render_summary(s: Mapping[str, Any], paint: _Paint) -> str:
    t = s["totals"]
    lines = [paint.bold(f"gpuwarden fleet at {s['time_iso']}: {t['nodes']} nodes")]
    lines.append("  " + "  ".join(paint(f"{t[k]} {k}", k if t[k] else "") for k in _COUNTED))
    b = s.get("breaker")
    if b is not None:
        state = (
            paint("OPEN", "quarantined") + f" since {b.get('since')}: {b.get('reason')}"
            if b.get("open")
            else "closed"
        )
        lines.append(f"  breaker: {state} (remediation {s['remediation']})")
    for e in s.get("systemic_active", []):
        lines.append(paint(f"  systemic: {e['domain_kind']} {e['domain']}: {e['summary']}", "suspect"))
    header = f"  {'pool':16} {'nodes':>6}" + "".join(f" {k:>11}" for k in _COUNTED)
    lines += ["", paint.bold(header)]
    for p in s["pools"]:
        lines.append(f"  {p['pool']:16} {p['nodes']:>6}" + "".join(f" {p[k]:>11}" for k in _COUNTED))
    racks = [r for r in s["racks"] if r["nodes"] > r["healthy"] or r["silent"]][:20]
    if racks:
        lines += ["", paint.bold(f"  {'rack':16} {'pool':16}" + "".join(f" {k:>11}" for k in _COUNTED[1:]))]
        for r in racks:
            lines.append(f"  {r['rack']:16} {r['pool']:16}" + "".join(f" {r[k]:>11}" for k in _COUNTED[1:]))
    return "\n".join(lines)


def render_story(n: Mapping[str, Any], paint: _Paint) -> str:
    flags = [n["state"], *(k for k in ("silent", "held", "lemon") if n.get(k))]
    where = ", ".join(f"{k} {v}" for k, v in (n.get("placement") or {}).items() if v)
    lines = [
        paint.bold(n["node"]) + ": " + " ".join(paint(f, f) for f in flags) + f" since {n['since_iso']}",
        f"  {where}; last report {n['last_received_iso']}",
        "",
        paint.bold("why"),
    ]
    if not n["reasons"]:
        lines.append("  no reason on record: the node is healthy")
    for r in n["reasons"]:
        lines.append(f"  - {r['summary']} ({r.get('severity')}, {r.get('rule') or r.get('detector')})")
        for k, v in (r.get("evidence") or {}).items():
            lines.append(f"      {k}: {evidence_value(k, v)}")
    lines += ["", paint.bold("next") + f"  {n['next']}"]
    if n.get("override"):
        lines.append(paint.bold("by hand") + f"  {n['override']}")
    lines.append(paint.bold("runbook") + f"  {n['runbook_url']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    paint = _Paint(colour_on(sys.stdout, os.environ))
    if args.command == "explain":
        path = STORY_PATH.format(node=urllib.parse.quote(args.node, safe=""))
        print(render_story(_get(args.aggregator, path, args.token_file, args.timeout), paint))
    else:
        print(render_summary(_get(args.aggregator, SUMMARY_PATH, args.token_file, args.timeout), paint))
    return 0
