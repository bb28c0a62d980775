"""The jobs' own collectives, from the NCCL Inspector files they write to a host directory.

A job enables NVIDIA's Inspector profiler plugin and points ``NCCL_INSPECTOR_DUMP_DIR`` at a
hostPath the agent also mounts (docs/jobs.md). Each process writes ``<hostname>-pid<PID>.log``
(JSON lines, growing without bound: 200-500 bytes per collective), or, in Prometheus mode, one
``nccl_inspector_metrics_<GPU UUID>.prom`` per GPU that it rewrites every interval. This collector
reads the directory and one level of subdirectories (a job may use one of its own) each cycle and
puts the cycle's summary (agent/inspector.py) in the report's ``jobs`` section.

How the files are read:

- **Incrementally.** A JSON file is known by (device, inode) and read from the offset reached last
  cycle, up to its last complete line: a line still being written is left for the next cycle.
  Files are opened, read with ``pread`` and closed each cycle, never held open, so a deleted file's
  disk space is freed at once and a renamed one is never read under its old name.
- **Truncated** (same inode, smaller than the offset): read again from the start.
- **Rotated** (a new inode under the same name) or **deleted**: the old file's state is forgotten
  and a new file is read from its start. **Renamed** (the same inode under another name Inspector
  would write, in the directory or a subdirectory): read on from its offset.
- **Started late.** Files already there at the agent's first scan are read from where they ended
  then: their history was another agent run's cycle (``agent --once`` reads them, under the same
  caps). Files that appear later are read from the start.
- **Bounded per cycle.** At most ``max_bytes`` and ``max_records`` lines a cycle, shared fairly
  (smallest backlog first, each file its share of what is left), in ``chunk_bytes`` reads; the rest
  waits for the next cycle. A file more than ``max_backlog_bytes`` behind (a job writing faster
  than the caps) skips ahead to that distance from its end, and the report says how much it
  skipped: a summary of minutes-old collectives would name the wrong moment.
- **Bounded in memory.** At most ``max_files`` files are followed (the most recently modified;
  the report says how many more there were), files untouched for ``idle_seconds`` are not followed,
  and the summary holds at most 1,024 rows of bounded samples. The offsets of files that went idle
  or fell behind the cap are remembered (``4 * max_files`` files in all, a few hundred bytes each),
  so a file that comes back is not read again from its start.
- **Prometheus files** are read whole (at most ``max_prom_bytes``) when their size or mtime changes,
  once per rewrite.

Unknown format versions and malformed lines are counted in ``jobs.dropped`` and named in the
report's errors, one entry per file and cycle with the count and the first message, never a crash.
A directory that does not exist means "Inspector is not in use here": the collector says it is not
supported (and ``jobs`` stays out of the report) until the directory appears.

Symbolic links are not followed: a job could otherwise point one at the agent's own token.
"""

from __future__ import annotations

import itertools
import logging
import os
import stat
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from agent import inspector
from agent.collectors.base import Collected, CollectorContext, Support
from agent.errors import CollectorFailure
from agent.inspector import InspectorError, Stream, Summarizer
from agent.report import MAX_COLLECTIVES

log = logging.getLogger(__name__)

JSON_SUFFIXES: Final = (".log", ".jsonl")
PROM_SUFFIX: Final = ".prom"
MAX_FILE_ERRORS: Final = 8  # error entries a cycle (the report holds 64 for every collector)
MAX_MESSAGE: Final = 1024


@dataclass(frozen=True)
class InspectorOptions:
    """Where the Inspector files are and how much of them one cycle may read."""

    directory: Path
    # Per cycle, all files together. 16 MiB is about 50,000 records of 300 bytes: under 0.1 s of
    # CPU at the cost measured in bench/nccl_inspector.py.
    max_bytes: int = 16 << 20
    max_records: int = 50_000
    # One read: the memory a cycle holds at once, whatever max_bytes is.
    chunk_bytes: int = 1 << 20
    # A file further behind than this skips ahead (about four cycles of the default max_bytes).
    max_backlog_bytes: int = 64 << 20
    max_files: int = 256
    # A file not modified for a day belongs to a finished job.
    idle_seconds: float = 86_400.0
    max_prom_bytes: int = 4 << 20
    # Longer than any Inspector line (a verbose record with 64 channels is about 10 KB).
    max_line_bytes: int = 1 << 20
    max_keys: int = MAX_COLLECTIVES
    max_samples: int = inspector.DEFAULT_MAX_SAMPLES
    # Read files already there at the first scan from their start too (``agent --once``: one
    # report of what the directory holds, under the same caps).
    read_existing: bool = False

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_records", "chunk_bytes", "max_files", "max_prom_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.max_line_bytes > self.chunk_bytes:
            object.__setattr__(self, "max_line_bytes", self.chunk_bytes)
        if self.max_backlog_bytes < self.max_bytes:
            raise ValueError("max_backlog_bytes must be at least max_bytes")


@dataclass
class _File:
    path: str
    kind: str  # "json" or "prom"
    offset: int = 0
    stream: Stream = field(default_factory=Stream)
    # After a skip or an over-long line: the bytes up to the next newline are not a whole line.
    resync: bool = False
    # Prometheus: the (size, mtime_ns) last read.
    seen: tuple[int, int] | None = None


@dataclass
class _Found:
    path: str
    rel: str
    kind: str
    ident: tuple[int, int]
    size: int
    mtime_ns: int


@dataclass
class _Problems:
    """One file's errors this cycle: how many of each kind, and the first message."""

    counts: Counter[str] = field(default_factory=Counter)
    first: str = ""

    def add(self, kind: str, message: str) -> None:
        if not self.counts:
            self.first = message
        self.counts[kind] += 1


class NcclInspectorCollector:
    name = "nccl_inspector"

    def __init__(self, ctx: CollectorContext) -> None:
        self._options = ctx.nccl_inspector
        self._clock = ctx.clock
        self._files: dict[tuple[int, int], _File] = {}
        self._first_scan = True
        # Files that were there at the first scan and have not been read since, with their size
        # then: read from there when they are (idle or over the cap at first, written to later).
        self._preexisting: dict[tuple[int, int], int] = {}
        self._summary = (
            Summarizer(max_keys=self._options.max_keys, max_samples=self._options.max_samples)
            if self._options is not None
            else Summarizer()
        )

    def supported(self) -> Support:
        if self._options is None:
            return Support(False, "not enabled (no --nccl-inspector-dir)")
        if not self._options.directory.is_dir():
            return Support(False, f"{self._options.directory} not present: no job writes Inspector files")
        return Support(True)

    def collect(self) -> Collected:
        opts = self._options
        if opts is None:
            raise CollectorFailure("not enabled")
        try:
            found, others, over_cap = self._scan(opts)
        except OSError as exc:
            raise CollectorFailure(f"cannot list {opts.directory}: {exc.strerror or exc}") from exc
        errors: list[str] = []
        problems: dict[str, _Problems] = {}
        if self._first_scan:
            # Everything here now was written before this agent run: not this cycle's news.
            self._first_scan = False
            if not opts.read_existing:
                everything = itertools.chain(found.values(), others.values())
                self._preexisting = {f.ident: f.size for f in itertools.islice(everything, _max_known(opts))}
        else:
            for gone in self._preexisting.keys() - found.keys() - others.keys():
                del self._preexisting[gone]
        # Forget what is gone (deleted, renamed away). A file that went idle or fell behind the
        # cap keeps its offset, up to a bound, so coming back it is not read again from the start.
        parked = [k for k in others if k in self._files][: _max_known(opts) - len(found)]
        self._files = {k: self._files[k] for k in itertools.chain(found, parked) if k in self._files}
        for ident, f in found.items():
            state = self._files.get(ident)
            if state is None or state.kind != f.kind:
                state = _File(path=f.path, kind=f.kind)
                start = self._preexisting.pop(ident, 0)
                if f.kind == "json" and 0 < start <= f.size:
                    # From where it ended at the first scan. The writer may have been inside a
                    # line or a batch: from one byte before, the first newline resyncs.
                    state.offset = start - 1
                    state.resync = True
                    state.stream = Stream(resyncing=True)
                self._files[ident] = state
            elif f.kind == "json" and f.size < state.offset:
                # Truncated in place (copytruncate, a job reusing its file): start over.
                state.offset = 0
                state.stream = Stream()
                state.resync = False
            state.path = f.path  # renamed (same inode): the same file, read on from its offset

        budget_bytes, budget_lines = opts.max_bytes, opts.max_records
        prom = [f for f in found.values() if f.kind == "prom"]
        for f in prom:
            budget_bytes -= self._read_prom(opts, f, problems)
        active = sorted(
            (f for f in found.values() if f.kind == "json" and f.size > self._files[f.ident].offset),
            key=lambda f: f.size - self._files[f.ident].offset,
        )
        for i, f in enumerate(active):
            left = len(active) - i
            share_bytes = max(0, budget_bytes) // left
            share_lines = max(0, budget_lines) // left
            if share_bytes <= 0 or share_lines <= 0:
                break
            used_bytes, used_lines, skipped = self._read_json(opts, f, share_bytes, share_lines, problems)
            budget_bytes -= used_bytes
            budget_lines -= used_lines
            if skipped:
                errors.append(
                    f"{f.rel}: skipped {skipped} bytes: written faster than this agent reads "
                    f"({opts.max_bytes} bytes, {opts.max_records} records a cycle)"
                )
        if over_cap:
            errors.append(f"{over_cap} more Inspector files than the {opts.max_files} followed: not read")
        errors.extend(_problem_errors(problems))
        return Collected(errors=tuple(errors), jobs=self._summary.take())

    def close(self) -> None:
        self._files.clear()

    # -- directory ----------------------------------------------------------------------------

    def _scan(
        self, opts: InspectorOptions
    ) -> tuple[dict[tuple[int, int], _Found], dict[tuple[int, int], _Found], int]:
        """The files to read this cycle (at most ``max_files``, the most recently written), the
        other Inspector files there (idle, or over the cap), and how many are over the cap."""
        root = os.fspath(opts.directory)
        now_ns = int(self._clock.time() * 1e9)
        idle_ns = int(opts.idle_seconds * 1e9)
        candidates: list[_Found] = []
        idle: list[_Found] = []
        for entry, rel in _entries(root):
            name = entry.name
            if name.endswith(JSON_SUFFIXES):
                kind = "json"
            elif name.endswith(PROM_SUFFIX):
                kind = "prom"
            else:
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # deleted between the listing and the stat
            if not stat.S_ISREG(st.st_mode):
                continue
            ident = (st.st_dev, st.st_ino)
            found = _Found(entry.path, rel, kind, ident, st.st_size, st.st_mtime_ns)
            (idle if now_ns - st.st_mtime_ns > idle_ns else candidates).append(found)
        candidates.sort(key=lambda f: f.mtime_ns, reverse=True)
        kept = candidates[: opts.max_files]
        rest = candidates[opts.max_files :]
        return {f.ident: f for f in kept}, {f.ident: f for f in rest + idle}, len(rest)

    # -- reading ------------------------------------------------------------------------------

    def _read_prom(self, opts: InspectorOptions, f: _Found, problems: dict[str, _Problems]) -> int:
        state = self._files[f.ident]
        if state.seen == (f.size, f.mtime_ns):
            return 0
        state.seen = (f.size, f.mtime_ns)
        if f.size > opts.max_prom_bytes:
            _problem(problems, f.rel, "malformed", f"{f.size} bytes: larger than {opts.max_prom_bytes}")
            return 0
        try:
            data = _read(f.path, 0, opts.max_prom_bytes)
        except OSError as exc:
            _problem(problems, f.rel, "unreadable", exc.strerror or str(exc))
            return 0
        errs: list[InspectorError] = []
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            _problem(problems, f.rel, "malformed", "not UTF-8 text")
            return len(data)
        for key, busbw, exec_us in inspector.prometheus_records(text, errs):
            self._summary.add(key, busbw, exec_us)
        self._summary.malformed(len(errs))
        for e in errs:
            _problem(problems, f.rel, e.kind, str(e))
        return len(data)

    def _read_json(
        self,
        opts: InspectorOptions,
        f: _Found,
        share_bytes: int,
        share_lines: int,
        problems: dict[str, _Problems],
    ) -> tuple[int, int, int]:
        """Read up to the shares from one file; returns (bytes, lines, bytes skipped)."""
        state = self._files[f.ident]
        skipped = 0
        if f.size - state.offset > opts.max_backlog_bytes:
            target = f.size - opts.max_backlog_bytes
            skipped = target - state.offset
            # One byte early: if the target starts a line, the newline before it ends the resync.
            state.offset = target - 1
            state.resync = True
            state.stream = Stream(resyncing=True)
        used_bytes = used_lines = 0
        try:
            fd = os.open(f.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            _problem(problems, f.rel, "unreadable", exc.strerror or str(exc))
            return 0, 0, skipped
        try:
            while used_bytes < share_bytes and used_lines < share_lines and state.offset < f.size:
                want = min(opts.chunk_bytes, share_bytes - used_bytes, f.size - state.offset)
                data = os.pread(fd, want, state.offset)
                if not data:
                    break
                if state.resync:
                    nl = data.find(b"\n")
                    if nl < 0:
                        state.offset += len(data)  # still inside the broken line
                        used_bytes += len(data)
                        continue
                    state.offset += nl + 1
                    used_bytes += nl + 1
                    state.resync = False
                    data = data[nl + 1 :]
                end = data.rfind(b"\n")
                if end < 0:
                    if len(data) >= opts.max_line_bytes:
                        too_long = f"a line longer than {opts.max_line_bytes} bytes"
                        _problem(problems, f.rel, "malformed", too_long)
                        self._summary.malformed(1)
                        state.offset += len(data)
                        used_bytes += len(data)
                        state.resync = True
                        continue
                    break  # a line still being written: the next cycle reads it whole
                chunk = data if end + 1 == len(data) else data[: end + 1]
                lines = inspector.count_lines(chunk)
                room = share_lines - used_lines
                if lines > room:
                    # Up to the room-th newline: what splitting off that many lines leaves over.
                    chunk = chunk[: len(chunk) - len(chunk.split(b"\n", room)[-1])]
                    lines = room
                for e in state.stream.feed_chunk(chunk, self._summary, lines):
                    _problem(problems, f.rel, e.kind, str(e))
                state.offset += len(chunk)
                used_bytes += len(chunk)
                used_lines += lines
        except OSError as exc:
            _problem(problems, f.rel, "unreadable", exc.strerror or str(exc))
        finally:
            os.close(fd)
        return used_bytes, used_lines, skipped


def _max_known(opts: InspectorOptions) -> int:
    """Files whose state (offset) is remembered, followed or not: a few hundred bytes each."""
    return 4 * opts.max_files


def _entries(root: str) -> Iterator[tuple[os.DirEntry[str], str]]:
    """The directory's entries and those of its subdirectories (one level), with relative names."""
    with os.scandir(root) as top:
        entries = list(top)
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            try:
                with os.scandir(entry.path) as sub:
                    for child in sub:
                        yield child, f"{entry.name}/{child.name}"
            except OSError:
                continue
        else:
            yield entry, entry.name


def _read(path: str, offset: int, size: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        return os.pread(fd, size, offset)
    finally:
        os.close(fd)


def _problem(problems: dict[str, _Problems], rel: str, kind: str, message: str) -> None:
    problems.setdefault(rel, _Problems()).add(kind, message)


def _problem_errors(problems: dict[str, _Problems]) -> list[str]:
    out: list[str] = []
    for rel in sorted(problems)[:MAX_FILE_ERRORS]:
        p = problems[rel]
        counts = ", ".join(f"{n} {kind}" for kind, n in sorted(p.counts.items()))
        out.append(f"{rel}: {counts} (first: {p.first})"[:MAX_MESSAGE])
    if len(problems) > MAX_FILE_ERRORS:
        out.append(f"{len(problems) - MAX_FILE_ERRORS} more Inspector files with errors")
    return out
