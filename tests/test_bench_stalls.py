"""bench/stalls.py finds what held the event loop, in the process it wraps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import stalls

SCRIPT = """
import asyncio, sys, time

def hold_the_loop(seconds):
    time.sleep(seconds)  # the kind of work that holds a loop: synchronous, on its thread

async def main():
    await asyncio.sleep(0.05)  # turning freely: no hold
    hold_the_loop(0.15)
    await asyncio.sleep(0.05)
    sys.exit(int(sys.argv[1]))

"""
# Each loop the service may run on (aggregator/eventloop.py).
RUNS = {
    "asyncio": "asyncio.run(main())\n",
    "uvloop": (
        "import uvloop\nwith asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:\n"
        "    runner.run(main())\n"
    ),
}


def run(tmp_path: Path, code: int, loop: str = "asyncio") -> tuple[int, list[dict[str, object]]]:
    script = tmp_path / "held.py"
    script.write_text(SCRIPT + RUNS[loop])
    out = tmp_path / "holds.jsonl"
    done = subprocess.run([*stalls.wrapped(out, 30.0), str(script), str(code)], timeout=60, check=False)
    lines = out.read_text().splitlines() if out.exists() else []
    return done.returncode, [json.loads(line) for line in lines]


@pytest.mark.parametrize("loop", sorted(RUNS))
def test_a_hold_is_recorded_with_the_stack_that_held_the_loop(tmp_path: Path, loop: str) -> None:
    code, holds = run(tmp_path, 3, loop)
    assert code == 3  # the command's exit status comes through
    assert len(holds) == 1
    (hold,) = holds
    assert 120 <= float(hold["held_ms"]) <= 1000  # type: ignore[arg-type]
    samples = hold["samples"]
    assert isinstance(samples, list) and samples
    top = max(samples, key=lambda s: s["count"])
    assert top["loop"][-1].endswith("hold_the_loop")
    assert any(frame.endswith(" main") for frame in top["loop"])
    text = stalls.summarize(tmp_path / "holds.jsonl")
    assert text.startswith("1 holds;") and "hold_the_loop" in text


def test_a_loop_that_turns_records_nothing(tmp_path: Path) -> None:
    script = tmp_path / "free.py"
    script.write_text("import asyncio\nasyncio.run(asyncio.sleep(0.3))\n")
    out = tmp_path / "holds.jsonl"
    subprocess.run([*stalls.wrapped(out, 30.0), str(script)], timeout=60, check=True)
    assert out.read_text() == ""


def test_the_summary_of_nothing_says_so(tmp_path: Path) -> None:
    empty = tmp_path / "none.jsonl"
    empty.write_text("")
    assert "no holds recorded" in stalls.summarize(empty)
    assert sys.executable in stalls.wrapped(empty, 20.0)
