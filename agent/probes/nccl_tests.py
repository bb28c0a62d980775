"""Parse the output of nccl-tests' ``all_reduce_perf`` (https://github.com/NVIDIA/nccl-tests).

The table has one row per message size, with an out-of-place and an in-place measurement
(spaces squeezed here)::

    #  size   count  type redop root   time  algbw  busbw #wrong   time  algbw  busbw #wrong
    #   (B) (elems)                     (us) (GB/s) (GB/s)          (us) (GB/s) (GB/s)
      1024     256 float   sum   -1  147.1   0.01   0.01      0  123.1   0.01   0.02      0
    # Out of bounds values : 0 OK
    # Avg bus bandwidth    : 70.742

Columns are found by name from the header line, so older layouts (no ``root`` column, ``error``
instead of ``#wrong``) parse too. Bandwidths are GB/s with G = 1e9 (nccl-tests divides by 1.0E9),
and busbw is nccl-tests' own: for all-reduce, algbw x 2(n-1)/n. The parser takes it from the
table rather than recomputing it, so the number is exactly what an operator running the tool sees.

Lines that are not part of the table (``NCCL INFO`` debug output interleaved by NCCL, mpirun's
``[1,0]<stdout>:`` prefixes) are skipped. What makes the run a failure, with a message naming it:
no table, a garbled row, a ``#wrong`` count above 0 (the data came back wrong: the worst result a
probe can have), an "Out of bounds values" check that did not say OK, a "Test ... failure" line,
and output cut off before the ``# Avg bus bandwidth`` line (the run died or was killed).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Final

from agent.probes.base import ProbeFailure

GB: Final = 1e9
_MPI_PREFIX: Final = re.compile(r"^\[\d+,\d+\]<std(?:out|err)>:")
_AVG: Final = re.compile(r"^#\s*Avg bus bandwidth\s*:\s*(\S+)")
_OOB: Final = re.compile(r"^#\s*Out of bounds values\s*:\s*(\d+)\s*(\S*)")
_RANK: Final = re.compile(r"^#\s*Rank\s+\d+\s")
_FAILURE: Final = re.compile(r"\bTest (?:NCCL |CUDA )?failure\b.*|\bNCCL WARN\b.*")
_VERSION: Final = re.compile(r"^#\s*nccl-tests version\s+(\S+)")


class NcclTestsError(ProbeFailure):
    """The output does not show a complete, correct run; the message says what is wrong."""


@dataclass(frozen=True)
class Measurement:
    time_us: float
    algbw_bytes_per_second: float
    busbw_bytes_per_second: float
    wrong: int | None  # None: validation was off ("N/A") or the layout reports an error value


@dataclass(frozen=True)
class Row:
    size_bytes: int
    count: int
    type: str
    redop: str
    out_of_place: Measurement
    in_place: Measurement

    @property
    def busbw_bytes_per_second(self) -> float:
        """The mean of the two measurements, as nccl-tests averages them."""
        return (self.out_of_place.busbw_bytes_per_second + self.in_place.busbw_bytes_per_second) / 2


@dataclass(frozen=True)
class Result:
    rows: tuple[Row, ...]
    avg_busbw_bytes_per_second: float
    ranks: int | None  # "# Rank N ..." device lines, when printed
    version: str | None  # "# nccl-tests version X", printed by recent releases

    def row(self, size_bytes: int) -> Row:
        for row in self.rows:
            if row.size_bytes == size_bytes:
                return row
        raise KeyError(size_bytes)

    @property
    def largest(self) -> Row:
        return max(self.rows, key=lambda r: r.size_bytes)


def _columns(line: str) -> list[str] | None:
    """The column names of the header line ('size count type ... time algbw busbw #wrong ...')."""
    names = line.lstrip("#").split()
    if len(names) < 8 or names[:2] != ["size", "count"] or "busbw" not in names:
        return None
    return names


def _measurement(names: list[str], values: list[str], start: int, lineno: int) -> Measurement:
    try:
        time_us = float(values[start])
        algbw = float(values[start + 1])
        busbw = float(values[start + 2])
    except (ValueError, IndexError):
        raise NcclTestsError(f"line {lineno}: garbled measurement {values[start : start + 4]}") from None
    if not all(math.isfinite(v) and v >= 0 for v in (time_us, algbw, busbw)):
        raise NcclTestsError(f"line {lineno}: negative or non-finite measurement")
    check = values[start + 3] if start + 3 < len(values) else "N/A"
    wrong: int | None = None
    if names[start + 3].lstrip("#") == "wrong" and check != "N/A":
        if not check.isdigit():
            raise NcclTestsError(f"line {lineno}: #wrong is {check!r}, not a count")
        wrong = int(check)
    elif check.endswith("*"):
        # Older layouts print the max error and star the ones past nccl-tests' threshold.
        raise NcclTestsError(f"line {lineno}: error {check} exceeds nccl-tests' threshold")
    return Measurement(time_us, algbw * GB, busbw * GB, wrong)


def parse(text: str) -> Result:
    """The table, the average and the checks of one ``all_reduce_perf`` run; ``NcclTestsError`` if bad."""
    names: list[str] | None = None
    rows: list[Row] = []
    avg: float | None = None
    ranks = 0
    version: str | None = None
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = _MPI_PREFIX.sub("", raw).strip()
        if not line:
            continue
        if failure := _FAILURE.search(line):
            if "NCCL WARN" not in failure.group(0):
                raise NcclTestsError(f"line {lineno}: {failure.group(0)[:300]}")
            continue
        if line.startswith("#"):
            if names is None and (cols := _columns(line)) is not None:
                names = cols
            elif m := _AVG.match(line):
                try:
                    avg = float(m.group(1))
                except ValueError:
                    raise NcclTestsError(f"line {lineno}: garbled average {m.group(1)!r}") from None
            elif m := _OOB.match(line):
                if m.group(2) != "OK" or int(m.group(1)) != 0:
                    raise NcclTestsError(f"line {lineno}: out of bounds values: {m.group(1)} {m.group(2)}")
            elif _RANK.match(line):
                ranks += 1
            elif m := _VERSION.match(line):
                version = m.group(1)
            continue
        values = line.split()
        if names is None or not values[0].isdigit():
            continue  # NCCL INFO lines, banners, the shell prompt
        if len(values) != len(names):
            raise NcclTestsError(
                f"line {lineno}: a table row with {len(values)} fields, "
                f"the header has {len(names)}: {line[:120]!r}"
            )
        times = [i for i, name in enumerate(names) if name == "time"]
        if len(times) != 2:
            raise NcclTestsError("the table header does not have out-of-place and in-place columns")
        oop = _measurement(names, values, times[0], lineno)
        inp = _measurement(names, values, times[1], lineno)
        for label, meas in (("out-of-place", oop), ("in-place", inp)):
            if meas.wrong:
                raise NcclTestsError(
                    f"line {lineno}: {meas.wrong} wrong elements ({label}, {values[0]} bytes): "
                    "the all-reduce returned corrupt data"
                )
        if not values[1].isdigit():
            raise NcclTestsError(f"line {lineno}: count {values[1]!r} is not a number")
        rows.append(
            Row(
                size_bytes=int(values[0]),
                count=int(values[1]),
                type=values[2],
                redop=values[3],
                out_of_place=oop,
                in_place=inp,
            )
        )
    if names is None:
        raise NcclTestsError("no all_reduce_perf table in the output")
    if not rows:
        raise NcclTestsError("the all_reduce_perf table has no rows")
    if avg is None:
        raise NcclTestsError(
            f"output ends after {len(rows)} row(s) without '# Avg bus bandwidth': the run was cut short"
        )
    return Result(rows=tuple(rows), avg_busbw_bytes_per_second=avg * GB, ranks=ranks or None, version=version)
