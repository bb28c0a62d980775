"""What the bench/ scripts measure with alike: a process's CPU time, percentiles, a free port, the CPU.

bench/othergen.py does not use this on purpose: it stands apart from the rest of gpuwarden.
"""

from __future__ import annotations

import os
import platform
import socket
from collections.abc import Sequence

CLK_TCK = os.sysconf("SC_CLK_TCK")


def interpolated_percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of non-empty ``values``, linear between closest ranks."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _stat_cpu_seconds(path: str) -> float:
    """utime + stime from a proc(5) ``stat`` file."""
    with open(path, "rb") as f:
        stat = f.read()
    # The command may hold spaces and parentheses: fields are counted from its last ")". After it,
    # state is field 3, utime 14 and stime 15 (proc(5)).
    fields = stat[stat.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of a whole process (all threads, dead ones included), from /proc/PID/stat."""
    return _stat_cpu_seconds(f"/proc/{pid}/stat")


def thread_cpu_seconds(pid: int, tid: int) -> float:
    """utime + stime of one thread of a process (``tid == pid``: its main thread), from
    /proc/PID/task/TID/stat; 0.0 once the thread is gone."""
    try:
        return _stat_cpu_seconds(f"/proc/{pid}/task/{tid}/stat")
    except FileNotFoundError:
        return 0.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def cpuinfo_model() -> str | None:
    """The CPU's "model name" from /proc/cpuinfo; None where it has none (or cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    model = cpuinfo_model()
    return model if model is not None else platform.processor() or "unknown"
