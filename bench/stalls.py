"""Where the event loop is held: run a command with a stall sampler in its process.

    .venv/bin/python bench/stalls.py --out holds.jsonl [--threshold-ms 20] -- .venv/bin/gpuwarden aggregator

The loop's lag (``gpuwarden_aggregator_event_loop_lag_seconds``) says how long the loop was held,
not by what. This wrapper starts the command's script in this interpreter (as ``python -m
cProfile`` does) with two additions:

- every event loop the command runs gets a heartbeat: a callback every ``--beat-ms`` (5 ms) that
  notes the time;
- a watchdog thread looks every ``--beat-ms``; when the heartbeat is older than
  ``--threshold-ms`` the loop is held, and every ``--sample-ms`` (10 ms) until it turns again the
  thread records the stack of the loop's thread and of every other thread (the fleet detectors'
  worker among them: a hold can be that thread keeping the GIL).

At the end of each hold one JSON line goes to ``--out``: when it began (seconds since the sampler
started), how long the loop was held, and each distinct stack seen with how many samples had it
(innermost frame last, at most ``--depth`` frames, paths relative to the repository). Lines are
appended as holds end, so a command killed half-way keeps what it had. ``summarize`` (``python
bench/stalls.py --summary stalls.jsonl``) prints the holds by length and the innermost
repository frame of the loop's thread that the most samples shared.

``bench/ingest.py --stalls DIR`` and ``bench/slope.py --stalls DIR`` run the aggregator under
it. The sampler costs one callback every 5 ms on the loop and a thread waking as often; a
sampled stack is taken only while the loop is held, so it adds nothing when the loop is not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import runpy
import sys
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

REPO = Path(__file__).resolve().parent.parent


def _where(frame: FrameType) -> str:
    code = frame.f_code
    path = Path(code.co_filename)
    try:
        shown = str(path.resolve().relative_to(REPO))
    except ValueError:
        shown = path.name if "site-packages" in code.co_filename else code.co_filename
    return f"{shown}:{frame.f_lineno} {code.co_name}"


def _stack(frame: FrameType | None, depth: int) -> tuple[str, ...]:
    frames: list[str] = []
    while frame is not None and len(frames) < depth:
        frames.append(_where(frame))
        frame = frame.f_back
    return tuple(reversed(frames))  # innermost last, as a traceback reads


class StallSampler:
    """The heartbeat and the watchdog (see the module docstring)."""

    def __init__(
        self, out: TextIO, *, threshold_s: float, beat_s: float, sample_s: float, depth: int
    ) -> None:
        self._out = out
        self._threshold = threshold_s
        self._beat = beat_s
        self._sample = sample_s
        self._depth = depth
        self._start = time.perf_counter()
        self._last_beat = self._start
        self._loop_thread: int | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._beating: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()
        self.holds = 0

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Beat on ``loop`` while it runs (call from the thread that runs it, as it starts)."""
        self._last_beat = time.perf_counter()
        self._loop_thread = threading.get_ident()
        if loop in self._beating:
            return  # its beat is still scheduled from an earlier run_forever (asyncio.run makes three)
        self._beating.add(loop)

        def beat() -> None:
            self._last_beat = time.perf_counter()
            loop.call_later(self._beat, beat)

        loop.call_soon(beat)

    def detach(self) -> None:
        """The loop stopped running: a quiet loop is not a held one (the interpreter's exit)."""
        self._loop_thread = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="stall-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the watchdog and wait for it, so its last line is written before the file closes."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _watch(self) -> None:
        while not self._stop.wait(self._beat):
            held_since = self._last_beat
            if self._loop_thread is None or time.perf_counter() - held_since < self._threshold:
                continue
            stacks: Counter[tuple[tuple[str, ...], ...]] = Counter()
            while self._last_beat == held_since and self._loop_thread is not None and not self._stop.is_set():
                stacks[self._snapshot()] += 1
                time.sleep(self._sample)
            self._record(held_since, time.perf_counter() - held_since, stacks)

    def _snapshot(self) -> tuple[tuple[str, ...], ...]:
        """The loop thread's stack first, then each other thread's (the sampler's own left out)."""
        frames = sys._current_frames()  # the documented way to see other threads' stacks
        mine = threading.get_ident()
        loop_stack = _stack(frames.get(self._loop_thread or 0), self._depth)
        skip = (mine, self._loop_thread)
        others = tuple(_stack(f, self._depth) for ident, f in sorted(frames.items()) if ident not in skip)
        return (loop_stack, *others)

    def _record(self, began: float, held_s: float, stacks: Counter[tuple[tuple[str, ...], ...]]) -> None:
        line = {
            "at_s": round(began - self._start, 3),
            "held_ms": round(held_s * 1000, 1),
            "samples": [
                {"count": n, "loop": list(snap[0]), "other_threads": [list(s) for s in snap[1:]]}
                for snap, n in stacks.most_common()
            ],
        }
        with self._lock:
            self._out.write(json.dumps(line) + "\n")
            self._out.flush()
            self.holds += 1


def _loop_classes() -> list[type[asyncio.AbstractEventLoop]]:
    """asyncio's own loop and, where installed, uvloop's (the service runs on it when it can:
    aggregator/eventloop.py); uvloop's is no ``BaseEventLoop``."""
    classes: list[type[asyncio.AbstractEventLoop]] = [asyncio.BaseEventLoop]
    try:
        import uvloop  # noqa: PLC0415

        classes.append(uvloop.Loop)
    except ImportError:
        pass
    return classes


def install(sampler: StallSampler) -> Callable[[], None]:
    """Make every event loop started from now on beat for ``sampler``; returns the undo."""
    undo_all: list[tuple[type[asyncio.AbstractEventLoop], Callable[..., None] | None]] = []
    for cls in _loop_classes():
        original = cls.run_forever

        def run_forever(self: asyncio.AbstractEventLoop, original: Callable[..., None] = original) -> None:
            sampler.attach(self)
            try:
                original(self)
            finally:
                sampler.detach()

        # uvloop.Loop inherits run_forever from its compiled base: undone by deleting ours.
        undo_all.append((cls, original if "run_forever" in vars(cls) else None))
        cls.run_forever = run_forever  # type: ignore[method-assign]

    def undo() -> None:
        for cls, own in undo_all:
            if own is None:
                delattr(cls, "run_forever")
            else:
                cls.run_forever = own  # type: ignore[method-assign]

    return undo


def innermost_repo_frame(stack: list[str]) -> str:
    """The deepest frame in the repository's own code (else the deepest frame at all)."""
    for frame in reversed(stack):
        if frame.split(":", 1)[0].startswith(("aggregator/", "agent/", "gpuwarden/")):
            return frame
    return stack[-1] if stack else "?"


def summarize(path: Path, top: int = 15) -> str:
    holds = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not holds:
        return f"{path}: no holds recorded"
    lengths = sorted(h["held_ms"] for h in holds)
    where: Counter[str] = Counter()
    held_at: Counter[str] = Counter()
    for h in holds:
        for s in h["samples"]:
            frame = innermost_repo_frame(s["loop"])
            where[frame] += s["count"]
        first = max(h["samples"], key=lambda s: s["count"]) if h["samples"] else None
        if first is not None:
            held_at[innermost_repo_frame(first["loop"])] += h["held_ms"]
    out = [
        f"{len(holds)} holds; held ms: median {lengths[len(lengths) // 2]}, max {lengths[-1]}, "
        f"total {sum(lengths):.0f}",
        "",
        "samples  held ms  innermost repository frame of the loop's thread",
    ]
    for frame, n in where.most_common(top):
        out.append(f"{n:7d}  {held_at.get(frame, 0.0):7.0f}  {frame}")
    return "\n".join(out)


def wrapped(out: Path, threshold_ms: float) -> list[str]:
    """The arguments that put a command under this sampler (the command follows them)."""
    here = str(Path(__file__).resolve())
    return [sys.executable, here, "--out", str(out), "--threshold-ms", str(threshold_ms), "--"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--out", type=Path, help="append one JSON line per hold here")
    p.add_argument("--threshold-ms", type=float, default=20.0, help="a loop not turned for this long is held")
    p.add_argument("--beat-ms", type=float, default=5.0)
    p.add_argument("--sample-ms", type=float, default=10.0)
    p.add_argument("--depth", type=int, default=25, help="frames kept of each stack")
    p.add_argument("--summary", type=Path, help="print what a --out file recorded, and exit")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the script and its arguments")
    args = p.parse_args(argv)
    if args.summary is not None:
        print(summarize(args.summary))
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.out is None or not command:
        p.error("--out and a command after -- are needed (or --summary FILE)")
    with args.out.open("a", encoding="utf-8") as out:
        sampler = StallSampler(
            out,
            threshold_s=args.threshold_ms / 1000,
            beat_s=args.beat_ms / 1000,
            sample_s=args.sample_ms / 1000,
            depth=args.depth,
        )
        install(sampler)
        sampler.start()
        sys.argv = command
        try:
            runpy.run_path(command[0], run_name="__main__")
        except SystemExit as exc:
            code: Any = exc.code
            return code if isinstance(code, int) else (0 if code is None else 1)
        finally:
            sampler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
