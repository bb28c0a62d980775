"""``gpuwarden replay TRACE --out DECISIONS [--serve HOST:PORT]``: the live pipeline over a
recorded trace.

A trace is JSON Lines of reports, or a compact trace (``agent.wire``: a msgpack stream of
records, each one compact report); either may be gzip'd. The first byte tells them apart.

The clock is the reports' own ``time`` (no sleeping), remediation is in dry-run (decisions say
what would be done), and the result is deterministic. Reports a little out of order across nodes,
as live ingestion sees them, are put back in time order through a short reorder buffer. The
report interval is the one the trace's reports declare (``interval_seconds``) unless the
configuration sets ``fleet.interval_seconds``: a trace recorded every 30 s judged as a 10 s fleet
would have two empty frame slots in three.

With ``--serve``, the replayed pipeline's final state is then served read-only (the status page
and the JSON API ``gpuwarden status`` and ``explain`` read) with the clock frozen at the trace's
last report, until SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import heapq
import io
import logging
import math
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, TextIO

import msgspec
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from agent.errors import ConfigError, GpuwardenError, ReportError
from agent.report import Report, decode
from agent.wire import TRACE_MARKERS, decode_compact, read_frames
from aggregator import eventloop
from aggregator.config import Config
from aggregator.decisions import Decision, DecisionLog
from aggregator.model import IngestOutcome
from aggregator.rules.model import Rule
from aggregator.service import plausibility_errors
from aggregator.story import iso

if TYPE_CHECKING:
    from aggregator.pipeline import Pipeline

log = logging.getLogger(__name__)

REORDER_SECONDS = 30.0  # reports may arrive this far out of time order and still be ordered
SKEW_WINDOW_LINES = 64  # lines around a line whose median report time is the fleet's time there
SKEW_MIN_SECONDS = 10.0  # node clocks closer than this to the fleet's are used as they are
PROGRESS_EVERY_LINES = 256  # how often the trace reader reports how far it got
PROGRESS_EVERY_SECONDS = 0.2  # how often the terminal's progress line is redrawn

# (reports read so far, fraction of the trace file consumed)
Progress = Callable[[int, float], None]


class TraceError(GpuwardenError):
    """A trace that cannot be replayed at all (the message names the line)."""


@dataclass
class ReplaySummary:
    reports_read: int = 0
    reports_replayed: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    first_rejected: dict[str, int] = field(default_factory=dict)  # reason -> its first line number
    duplicates: int = 0
    decisions: Counter[str] = field(default_factory=Counter)
    skew: dict[str, float] = field(default_factory=dict)  # node clocks corrected, seconds ahead
    interval: float | None = None  # the report interval the replay used (fleet.interval_seconds)
    declared: float | None = None  # the one the trace's reports declare, if any does

    def reject(self, reason: str, lineno: int, error: str) -> None:
        """Count a skipped line. Each is logged only at INFO (``-v``): a damaged stream can yield
        thousands, and the summary, or the one error line, says how many there were."""
        self.rejected[reason] += 1
        self.first_rejected.setdefault(reason, lineno)
        log.info("skipping line", extra={"line": lineno, "reason": reason, "error": error})

    def render(self) -> str:
        lines = [
            f"reports read: {self.reports_read}, replayed: {self.reports_replayed}, "
            f"duplicates: {self.duplicates}, rejected: {sum(self.rejected.values())}"
        ]
        lines += [
            f"  rejected ({why}): {n} (first at line {self.first_rejected[why]})"
            for why, n in sorted(self.rejected.items())
        ]
        lines += [f"  clock of {who} corrected by {-off:+.0f} s" for who, off in self.skew.items()]
        if self.interval is not None and self.declared is not None:
            if self.interval == self.declared:
                lines.append(f"report interval: {self.interval:g} s, as the trace's reports declare")
            else:
                lines.append(
                    f"report interval: {self.interval:g} s as configured (fleet.interval_seconds), "
                    f"but the trace's reports declare {self.declared:g} s: the frames' slots and "
                    "silence follow the configuration"
                )
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


class _Stamp(msgspec.Struct):
    """The part of a report the clock estimate needs; decoding only this is cheap."""

    node: str
    boot_id: str
    time: float
    interval_seconds: float | None = None


_STAMP = msgspec.json.Decoder(_Stamp)
_COMPACT_STAMP = msgspec.msgpack.Decoder(_Stamp)


def _is_compact(stream: IO[bytes] | gzip.GzipFile) -> bool:
    """Whether the (decompressed) stream is a compact trace; reads nothing it does not put back."""
    head = stream.peek(1)[:1] if isinstance(stream, gzip.GzipFile | io.BufferedReader) else b""
    return bool(head) and head[0] in TRACE_MARKERS


def _records(stream: IO[bytes] | gzip.GzipFile, compact: bool) -> Iterator[bytes]:
    """The trace's records: lines of JSON, or the frames of a compact trace (a frame that breaks
    the stream ends it with ``OSError``, as a broken gzip stream does)."""
    if not compact:
        yield from stream
        return
    try:
        yield from read_frames(stream)
    except ValueError as exc:
        raise OSError(str(exc)) from exc


@dataclass(frozen=True)
class TraceClock:
    """What one cheap pass over a trace says about its time: each node's clock offset from the
    fleet's, per boot, where it is over ``SKEW_MIN_SECONDS``, and the report interval its reports
    declare (the median of those that do; None when none does)."""

    offsets: dict[tuple[str, str], float]
    interval: float | None


def trace_clock(path: Path) -> TraceClock:
    """Each node's clock offset from the fleet's, per boot, where it is over ``SKEW_MIN_SECONDS``,
    and the trace's declared report interval.

    Live, the aggregator judges time by its own receive clock, so a node whose clock is an hour
    off is judged like any other. A trace has only the reports' own times; used as they are, a
    node an hour ahead would push the replay clock an hour on and make the whole fleet look
    silent. A recorded trace is in the order the aggregator received it, so the fleet's time at a
    line is the median report time of the lines centred on it, and a node's offset is the median
    of its reports' distances from that. Nodes within ``SKEW_MIN_SECONDS`` are left exactly
    as they are. (A trace sorted by report time instead hides skew; it is then not corrected.)
    """
    stamps: list[_Stamp] = []
    with _open(path) as stream:
        try:
            compact = _is_compact(stream)
            stamp = _COMPACT_STAMP if compact else _STAMP
            for line in _records(stream, compact):
                try:
                    stamps.append(stamp.decode(line))
                except msgspec.DecodeError:
                    continue  # the main pass reports bad lines
        except (OSError, EOFError, gzip.BadGzipFile):
            pass  # likewise
    if not stamps:
        return TraceClock({}, None)
    declared = [s.interval_seconds for s in stamps if s.interval_seconds is not None]
    interval = float(statistics.median(declared)) if declared else None
    # The fleet's time at each line: the median report time of the lines centred on it (a
    # sliding window, in blocks so memory stays bounded on a long trace).
    times = np.fromiter((s.time for s in stamps), dtype=np.float64, count=len(stamps))
    half = SKEW_WINDOW_LINES // 2
    padded = np.pad(times, half, mode="edge")
    fleet_time = np.empty_like(times)
    for start in range(0, len(times), 65_536):
        stop = min(start + 65_536, len(times))
        window = sliding_window_view(padded[start : stop + 2 * half], 2 * half + 1)
        fleet_time[start:stop] = np.median(window, axis=1)
    distances: dict[tuple[str, str], list[float]] = {}
    for s, distance in zip(stamps, (times - fleet_time).tolist(), strict=True):
        distances.setdefault((s.node, s.boot_id), []).append(distance)
    offsets = {}
    for key, values in distances.items():
        offset = statistics.median(values)
        if abs(offset) > SKEW_MIN_SECONDS:
            offsets[key] = offset
    return TraceClock(offsets, interval)


def read_trace(path: Path, summary: ReplaySummary, progress: Progress | None = None) -> Iterator[Report]:
    """Reports of a trace (JSON Lines or compact; a record of a compact trace counts as a line)
    in file order. A line that is not a report, or one the live
    service would refuse as implausible, is counted and skipped; a file whose first report line
    is not a report is unusable, and so is a stream that breaks (a truncated or corrupt gzip):
    its one error says how many lines were skipped before it broke."""
    lineno = 0
    size = path.stat().st_size if path.exists() else 0
    with _open(path) as stream:
        # The compressed file's position, for a gzip trace: how far through the file we are.
        raw: IO[bytes] = stream.fileobj if isinstance(stream, gzip.GzipFile) else stream  # type: ignore[assignment]
        try:
            compact = _is_compact(stream)
            parse = decode_compact if compact else decode
            for lineno, line in enumerate(_records(stream, compact), 1):
                if progress is not None and lineno % PROGRESS_EVERY_LINES == 0:
                    progress(summary.reports_read, raw.tell() / size if size else 0.0)
                if not compact and not line.strip():
                    continue
                summary.reports_read += 1
                try:
                    report = parse(line)
                except ReportError as exc:
                    if summary.reports_read == 1:
                        raise TraceError(f"{path}:{lineno}: not a gpuwarden report: {exc}") from exc
                    summary.reject("schema" if "does not match" in str(exc) else "json", lineno, str(exc))
                    continue
                problems = plausibility_errors(report)
                if problems:
                    summary.reject("implausible", lineno, "; ".join(problems))
                    continue
                yield report
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            skipped = sum(summary.rejected.values())
            before = f" ({skipped} damaged lines skipped before it)" if skipped else ""
            raise TraceError(f"{path}: unreadable trace after line {lineno}{before}: {exc}") from exc


def _ordered(
    reports: Iterator[Report], offsets: dict[tuple[str, str], float]
) -> Iterator[tuple[float, Report]]:
    """(aggregator time, report) in aggregator time order, through a short reorder buffer."""
    heap: list[tuple[float, str, int, int, Report]] = []
    latest = float("-inf")
    for n, r in enumerate(reports):
        at = r.time - offsets.get((r.node, r.boot_id), 0.0)
        latest = max(latest, at)
        heapq.heappush(heap, (at, r.node, r.seq, n, r))
        while heap and heap[0][0] <= latest - REORDER_SECONDS:
            entry = heapq.heappop(heap)
            yield entry[0], entry[4]
    while heap:
        entry = heapq.heappop(heap)
        yield entry[0], entry[4]


def replay(
    trace: Path,
    out: Path | None,
    config: Config,
    rules: list[Rule],
    *,
    progress: Progress | None = None,
    trace_interval: bool = False,
) -> tuple[list[Decision], ReplaySummary]:
    produced, summary, _ = replayed(
        trace, out, config, rules, progress=progress, trace_interval=trace_interval
    )
    return produced, summary


@dataclass
class FinalState:
    """The pipeline as the replay left it, and the trace's last (aggregator) time."""

    pipeline: Pipeline
    at: float
    config: Config  # the one the pipeline ran with (the trace's interval, if it was followed)


def replayed(
    trace: Path,
    out: Path | None,
    config: Config,
    rules: list[Rule],
    *,
    progress: Progress | None = None,
    trace_interval: bool = False,
) -> tuple[list[Decision], ReplaySummary, FinalState]:
    """``replay``, and the final state it leaves (for ``--serve``). With ``trace_interval``, the
    report interval is the one the trace's reports declare (when they declare one), not
    ``config.fleet.interval_seconds``: the CLI asks for it unless its file sets that key."""
    # Imported here, not at the top: the pipeline loads scikit-learn (seconds), which `--help`
    # and a refused argument must not wait for.
    from aggregator.app import build_pipeline  # noqa: PLC0415
    from aggregator.pipeline import TICK_SECONDS  # noqa: PLC0415

    summary = ReplaySummary()
    produced: list[Decision] = []

    def _record(d: Decision) -> None:
        produced.append(d)
        summary.decisions[d.state] += 1

    _refuse_the_trace_as_out(trace, out)
    clock = trace_clock(trace)
    offsets = clock.offsets
    summary.skew = {f"{node} (boot {boot[:8]})": off for (node, boot), off in sorted(offsets.items())}
    if trace_interval and clock.interval is not None and clock.interval != config.fleet.interval_seconds:
        config = msgspec.structs.replace(
            config, fleet=msgspec.structs.replace(config.fleet, interval_seconds=clock.interval)
        )
    summary.interval, summary.declared = config.fleet.interval_seconds, clock.interval
    decisions = DecisionLog(out, truncate=True)  # a replay's output is its own, not appended
    pipeline = build_pipeline(config, rules, decisions, on_decision=_record)
    try:
        last: float | None = None
        for at, report in _ordered(read_trace(trace, summary, progress), offsets):
            # Live, time-driven work runs every second whether reports arrive or not; here it
            # runs for every tick between two reports, so a gap in the trace is judged as live.
            if last is not None:
                tick = math.floor(last / TICK_SECONDS) * TICK_SECONDS + TICK_SECONDS
                while tick < at:
                    pipeline.advance(tick)
                    tick += TICK_SECONDS
            # The receipt clock never runs back. A report later than the reorder buffer holds (an
            # agent's spool flushed after an outage) was received now, as live; taken at its own
            # time it would step the pipeline's clock back and make the whole fleet look silent.
            # Its frame slot still comes from its own time (aggregator/fleet/sendtime.py).
            received = at if last is None else max(last, at)
            if pipeline.ingest(report, received) is IngestOutcome.DUPLICATE:
                summary.duplicates += 1
            else:
                summary.reports_replayed += 1
            last = received
        if last is None:
            raise TraceError(f"{trace}: no reports in the trace")
        pipeline.advance(last)
    finally:
        decisions.close()
    return produced, summary, FinalState(pipeline, last, config)


def _refuse_the_trace_as_out(trace: Path, out: Path | None) -> None:
    if out is not None and out.exists() and trace.exists() and out.resolve() == trace.resolve():
        raise TraceError(f"{trace}: --out is the trace itself; it would be overwritten")


@contextlib.contextmanager
def _written_on_success(out: Path) -> Iterator[Path]:
    """A temporary file beside ``out`` that becomes ``out`` (one rename) only if the block
    succeeds: a replay that fails leaves no partial decision log, and an earlier one in place."""
    # In the same directory, so the rename is atomic; hidden, and named by process, so two
    # replays into one folder never share it.
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


class TerminalProgress:
    """One self-overwriting line on a terminal: how far through the trace the replay is."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._next = 0.0
        self._drawn = False

    def __call__(self, reports: int, fraction: float) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + PROGRESS_EVERY_SECONDS
        self._stream.write(f"\rreplay: {min(fraction, 1.0):4.0%} of the trace, {reports} reports")
        self._stream.flush()
        self._drawn = True

    def clear(self) -> None:
        if self._drawn:
            self._stream.write("\r\033[K")
            self._stream.flush()
            self._drawn = False


class FrozenClock:
    """Wall time stopped at ``at`` (the end of a replayed trace), so probation clocks, "ago" and
    "what happens next" read as of then however long the views are served; monotonic time and
    sleeping are real (throttles and timeouts still work)."""

    def __init__(self, at: float) -> None:
        self._at = at

    def time(self) -> float:
        return self._at

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6; port 0 picks a free one)."""
    host, sep, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT (e.g. 127.0.0.1:8080)")
    return host, int(port)


def banner(trace: Path, at: float) -> str:
    return f"Replay of {trace}, as of {iso(at)} (the trace's last report; the clock is frozen there)"


async def serve_final_state(
    trace: Path,
    final: FinalState,
    config: Config,
    host: str,
    port: int,
    *,
    on_started: Callable[[str, int], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """The read-only views over ``final`` on ``host:port`` until ``stop`` (default: SIGINT or
    SIGTERM)."""
    from aggregator.app import build_read_only_app  # noqa: PLC0415 - only with --serve
    from aggregator.service import serve  # noqa: PLC0415

    app = build_read_only_app(final.pipeline, config, FrozenClock(final.at), banner=banner(trace, final.at))
    await serve(app, host, port, stop=stop, on_started=on_started, shutdown_timeout_s=2.0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", type=Path, help="trace file: JSON Lines of reports, .gz allowed")
    p.add_argument("--out", type=Path, required=True, help="where to write the decision log (JSONL)")
    p.add_argument("--config", type=Path, help="aggregator configuration YAML")
    p.add_argument("--rules", type=Path, action="append", help="rules file or directory (repeatable)")
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log every decision and every skipped line as it happens (they are in --out and "
        "the summary either way)",
    )
    p.add_argument(
        "--serve",
        type=parse_address,
        metavar="HOST:PORT",
        help="after the replay, serve the status page and the read API (gpuwarden status, "
        "explain) over its final state, as of the trace's last report, until Ctrl-C or SIGTERM",
    )


def run(args: argparse.Namespace) -> int:
    from aggregator.configload import configured, load_config  # noqa: PLC0415
    from aggregator.rules.model import default_rules_dir, load_rules  # noqa: PLC0415

    if not args.verbose:
        # The pipeline logs each decision at INFO; a replay makes hundreds, all in --out already.
        root = logging.getLogger().getEffectiveLevel()
        logging.getLogger("aggregator").setLevel(max(logging.WARNING, root))
    progress = TerminalProgress(sys.stderr) if sys.stderr.isatty() else None
    try:
        config = load_config(args.config)
        rules = load_rules(
            args.rules or [Path(config.rules_dir) if config.rules_dir else default_rules_dir()]
        )
        _refuse_the_trace_as_out(args.trace, args.out)
        with _written_on_success(args.out) as tmp:
            _, summary, final = replayed(
                args.trace,
                tmp,
                config,
                rules,
                progress=progress,
                trace_interval=not configured(args.config, "fleet.interval_seconds"),
            )
    except TraceError as exc:
        if progress is not None:
            progress.clear()
        print(f"gpuwarden replay: {exc}", file=sys.stderr)
        return 2
    except ConfigError:
        raise
    if progress is not None:
        progress.clear()
    print(summary.render(), file=sys.stderr)
    if args.serve is not None:
        host, port = args.serve

        def started(bound_host: str, bound_port: int) -> None:
            shown = f"[{bound_host}]" if ":" in bound_host else bound_host
            print(
                f"serving the replay as of {iso(final.at)} on http://{shown}:{bound_port}/ "
                "(read-only; Ctrl-C to stop)",
                flush=True,
            )

        eventloop.run(
            serve_final_state(args.trace, final, final.config, host, port, on_started=started),
            config.server.event_loop,
        )
    return 0
