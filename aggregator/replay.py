"""``gpuwarden replay TRACE --out DECISIONS``: the live pipeline over a recorded trace.

The clock is the reports' own ``time`` (no sleeping), remediation is in dry-run (decisions say
what would be done), and the result is deterministic. Reports a little out of order across nodes,
as live ingestion sees them, are put back in time order through a short reorder buffer.
"""

from __future__ import annotations

import argparse
import gzip
import heapq
import logging
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from agent.errors import ConfigError, GpuwardenError, ReportError
from agent.report import Report, decode
from aggregator.config import Config
from aggregator.decisions import Decision, DecisionLog
from aggregator.model import IngestOutcome
from aggregator.pipeline import Pipeline
from aggregator.rules.model import Rule

log = logging.getLogger(__name__)

REORDER_SECONDS = 30.0  # reports may arrive this far out of time order and still be ordered


class TraceError(GpuwardenError):
    """A trace that cannot be replayed at all (the message names the line)."""


@dataclass
class ReplaySummary:
    reports_read: int = 0
    reports_replayed: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    duplicates: int = 0
    decisions: Counter[str] = field(default_factory=Counter)

    def render(self) -> str:
        lines = [
            f"reports read: {self.reports_read}, replayed: {self.reports_replayed}, "
            f"duplicates: {self.duplicates}, rejected: {sum(self.rejected.values())}"
        ]
        lines += [f"  rejected ({why}): {n}" for why, n in sorted(self.rejected.items())]
        lines.append(
            "decisions: "
            + (", ".join(f"{state} {n}" for state, n in sorted(self.decisions.items())) or "none")
        )
        return "\n".join(lines)


def _open(path: Path) -> IO[bytes] | gzip.GzipFile:
    try:
        f: IO[bytes] = path.open("rb")
    except OSError as exc:
        raise TraceError(f"cannot open trace {path}: {exc}") from exc
    head = f.read(2)
    f.seek(0)
    if head == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=f)
    return f


def read_trace(path: Path, summary: ReplaySummary) -> Iterator[Report]:
    """Reports of a JSONL trace in file order. A line that is not a report is counted and
    skipped; a file that is not JSONL at all (no report on its first line) is unusable."""
    with _open(path) as stream:
        try:
            for lineno, line in enumerate(stream, 1):
                if not line.strip():
                    continue
                summary.reports_read += 1
                try:
                    yield decode(line)
                except ReportError as exc:
                    if summary.reports_read == 1 and summary.reports_replayed == 0:
                        raise TraceError(f"{path}:{lineno}: not a gpuwarden report: {exc}") from exc
                    reason = "schema" if "does not match" in str(exc) else "json"
                    summary.rejected[reason] += 1
                    log.warning("skipping line", extra={"line": lineno, "error": str(exc)})
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            raise TraceError(f"{path}: unreadable trace: {exc}") from exc


def _ordered(reports: Iterator[Report]) -> Iterator[Report]:
    heap: list[tuple[float, str, int, int, Report]] = []
    latest = float("-inf")
    for n, r in enumerate(reports):
        latest = max(latest, r.time)
        heapq.heappush(heap, (r.time, r.node, r.seq, n, r))
        while heap and heap[0][0] <= latest - REORDER_SECONDS:
            yield heapq.heappop(heap)[4]
    while heap:
        yield heapq.heappop(heap)[4]


def replay(
    trace: Path, out: Path | None, config: Config, rules: list[Rule]
) -> tuple[list[Decision], ReplaySummary]:
    summary = ReplaySummary()
    produced: list[Decision] = []

    def _record(d: Decision) -> None:
        produced.append(d)
        summary.decisions[d.state] += 1

    decisions = DecisionLog(out)
    pipeline = Pipeline(config, rules, decisions, on_decision=_record)
    try:
        last: float | None = None
        for report in _ordered(read_trace(trace, summary)):
            if pipeline.ingest(report, report.time) is IngestOutcome.DUPLICATE:
                summary.duplicates += 1
            else:
                summary.reports_replayed += 1
            last = report.time if last is None else max(last, report.time)
        if last is not None:
            pipeline.advance(last)
    finally:
        decisions.close()
    return produced, summary


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", type=Path, help="trace file: JSON Lines of reports, .gz allowed")
    p.add_argument("--out", type=Path, required=True, help="where to write the decision log (JSONL)")
    p.add_argument("--config", type=Path, help="aggregator configuration YAML")
    p.add_argument("--rules", type=Path, action="append", help="rules file or directory (repeatable)")


def run(args: argparse.Namespace) -> int:
    from aggregator.configload import load_config  # noqa: PLC0415
    from aggregator.rules.model import default_rules_dir, load_rules  # noqa: PLC0415

    try:
        config = load_config(args.config)
        rules = load_rules(
            args.rules or [Path(config.rules_dir) if config.rules_dir else default_rules_dir()]
        )
        _, summary = replay(args.trace, args.out, config, rules)
    except TraceError as exc:
        print(f"gpuwarden replay: {exc}", file=sys.stderr)
        return 2
    except ConfigError:
        raise
    print(summary.render(), file=sys.stderr)
    return 0
