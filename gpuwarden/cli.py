"""``gpuwarden <subcommand>``: each part registers its own arguments; imports stay lazy.

Lazy imports keep ``gpuwarden agent`` from loading the aggregator's numpy and scikit-learn on
every GPU node.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from agent.errors import GpuwardenError
from agent.logs import configure as configure_logging

# subcommand -> (module with add_arguments(parser) and run(args) -> int, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "agent": ("agent.cli", "run the node agent (collect, expose /metrics, send reports)"),
    "aggregator": ("aggregator.cli", "run the aggregator (ingest reports, detect, decide)"),
    "breaker": ("aggregator.breakercli", "show or reset the remediation safety breaker (audited)"),
    "status": ("gpuwarden.status", "the fleet at a glance, from a running aggregator (gpuwarden status)"),
    "explain": ("gpuwarden.status", "one node: its state, why, the evidence, what next, the runbook"),
    "replay": ("aggregator.replay", "run the detection pipeline over a recorded trace"),
    "sim": ("sim.cli", "simulate a GPU fleet: a trace and its ground truth"),
    "eval": ("sim.eval", "score a decision log against ground truth and a static baseline"),
    "demo-sim": (
        "gpuwarden.simdemo",
        "a simulated fleet of a few hundred nodes against a live aggregator, decisions as they happen",
    ),
    "demo": ("gpuwarden.demo", "run the demo: a small fleet, the aggregator, decisions as they happen"),
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415 - only here

    try:
        return version("gpuwarden")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser; only the subcommand named in ``argv`` gets its module imported."""
    chosen = next((a for a in argv if a in SUBCOMMANDS), None)
    parser = argparse.ArgumentParser(prog="gpuwarden", description="Keeps large GPU clusters healthy.")
    parser.add_argument("--version", action="version", version=f"gpuwarden {_version()}")
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log level"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            importlib.import_module(module_name).add_arguments(sp)
        sp.set_defaults(_module=module_name)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    module = importlib.import_module(args._module)
    try:
        code: int = module.run(args)
    except GpuwardenError as exc:
        print(f"gpuwarden {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code
