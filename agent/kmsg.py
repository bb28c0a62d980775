"""The kernel log as ``/dev/kmsg`` hands it out: structured records, each read once.

A record is ``<prio>,<seq>,<ts_usec>,<flags>[,more];<message>\\n``, optionally followed by
dictionary lines that start with a space (`` SUBSYSTEM=pci``). The kernel returns exactly one
record per ``read()`` on the device; a recorded file (tests, a saved dump) returns many per read,
possibly cut mid-line, so the reader reassembles lines whatever the chunking.

Sequence numbers are the reader's memory: they are contiguous in the kernel, so a gap means
records were overwritten in the ring buffer before they were read (the kernel says so with
``EPIPE``), and a record at or below the last one seen was already handed out (after a reopen,
the device starts again at the oldest record it holds).

Timestamps are microseconds since boot on the printk clock; ``read_boot_time`` gives the
``btime`` that turns them into unix seconds.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Final, Protocol

from agent.errors import GpuwardenError

log = logging.getLogger(__name__)

# /dev/kmsg is always the character device 1:11; anything else mounted there (/dev/null in a
# container image) reads as an empty log, which must not pass for a quiet kernel.
KMSG_DEVICE: Final = (1, 11)
# The kernel refuses (EINVAL) a read buffer smaller than one record; records are at most 8 KiB.
READ_SIZE: Final = 16384
# A recorded file whose "line" never ends is not a kernel log; stop buffering it.
MAX_LINE: Final = 65536
# One read() call's share of a busy log; the rest is picked up by the next call.
MAX_READS: Final = 100_000


class KernelLogError(GpuwardenError):
    """The kernel log, or the boot time its timestamps need, cannot be used."""


class MalformedRecord(KernelLogError):
    """A record that does not follow the /dev/kmsg format."""


@dataclass(frozen=True)
class KmsgRecord:
    facility: int  # 0 for the kernel's own messages; userspace writes get 1 (LOG_USER) or more
    level: int  # 0 (emerg) to 7 (debug)
    seq: int
    usec: int  # microseconds since boot, printk clock
    message: str
    fields: Mapping[str, str] = field(default_factory=dict)  # the dictionary lines

    @property
    def from_kernel(self) -> bool:
        """Written by the kernel itself; the kernel forces a non-zero facility on userspace writes."""
        return self.facility == 0


def parse_record(line: bytes) -> KmsgRecord:
    """Parse one record's header line (without the dictionary lines).

    Raises ``MalformedRecord`` saying what is wrong.
    """
    header, sep, text = line.rstrip(b"\n").partition(b";")
    if not sep:
        raise MalformedRecord(f"no ';' between header and message: {line[:80]!r}")
    parts = header.split(b",")
    if len(parts) < 4:
        raise MalformedRecord(f"header has {len(parts)} fields, needs prio,seq,ts,flags: {header[:80]!r}")
    try:
        prio, seq, usec = int(parts[0]), int(parts[1]), int(parts[2])
    except ValueError:
        raise MalformedRecord(f"prio, seq and timestamp must be integers: {header[:80]!r}") from None
    if prio < 0 or seq < 0 or usec < 0:
        raise MalformedRecord(f"negative prio, seq or timestamp: {header[:80]!r}")
    return KmsgRecord(
        facility=prio >> 3,
        level=prio & 7,
        seq=seq,
        usec=usec,
        message=text.decode("utf-8", errors="replace"),
    )


def read_boot_time(procfs: Path) -> float:
    """Boot time in unix seconds (``btime`` in <procfs>/stat).

    Read afresh each time: the kernel derives it from the wall clock, so an NTP step after the
    agent started moves it, and a cached value would shift every later event by the step.
    """
    path = procfs / "stat"
    try:
        text = path.read_text(encoding="ascii", errors="replace")
    except OSError as exc:
        raise KernelLogError(f"boot time unavailable: cannot read {path}: {exc.strerror or exc}") from exc
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == "btime":
            try:
                return float(int(value.strip()))
            except ValueError:
                raise KernelLogError(f"boot time unavailable: bad btime line in {path}: {line!r}") from None
    raise KernelLogError(f"boot time unavailable: no btime line in {path}")


class KmsgDevice(Protocol):
    """An open kernel log.

    ``read`` returns b"" at the end of a recorded file, raises ``BlockingIOError`` when the device
    has nothing new, and ``BrokenPipeError`` once when records were overwritten under the reader.
    """

    def read(self, size: int) -> bytes: ...

    def close(self) -> None: ...


class _FdDevice:
    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    def read(self, size: int) -> bytes:
        if self._fd is None:
            raise OSError("kernel log is closed")
        return os.read(self._fd, size)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def open_kmsg(path: Path) -> KmsgDevice:
    """Open the kernel log without blocking; raises ``KernelLogError`` with the reason it cannot."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise KernelLogError(f"{path} is not readable: {exc.strerror or exc}") from exc
    try:
        st = os.fstat(fd)
        if stat.S_ISCHR(st.st_mode):
            dev = (os.major(st.st_rdev), os.minor(st.st_rdev))
            if dev != KMSG_DEVICE:
                raise KernelLogError(
                    f"{path} is the character device {dev[0]}:{dev[1]}, not the kernel log (1:11)"
                )
        elif not stat.S_ISREG(st.st_mode):
            raise KernelLogError(f"{path} is neither the kernel log device nor a recorded log file")
    except BaseException:
        os.close(fd)
        raise
    return _FdDevice(fd)


@dataclass(frozen=True)
class KmsgBatch:
    """What one ``KmsgReader.read`` found."""

    records: tuple[KmsgRecord, ...]
    # Read while working through what the log held when the reader started, before it first
    # reached the end: these records may predate the agent.
    backlog: bool
    caught_up: bool  # reached the end of the log (EAGAIN or end of file)
    overwritten: int = 0  # records lost in the ring buffer before they could be read
    malformed: int = 0  # records skipped because they did not parse
    error: str | None = None  # the read failed part-way; the records before the failure are here


class KmsgReader:
    """Hands out each kernel log record once, across reads, overruns and reopens."""

    def __init__(
        self,
        path: Path,
        *,
        opener: Callable[[Path], KmsgDevice] = open_kmsg,
        max_reads: int = MAX_READS,
    ) -> None:
        self.path = path
        self._opener = opener
        self._max_reads = max_reads
        self._device: KmsgDevice | None = None
        self._buffer = b""
        self._current: tuple[bytes, dict[str, str]] | None = None  # header line, dictionary
        self._last_seq: int | None = None
        self._caught_up = False

    @property
    def caught_up(self) -> bool:
        return self._caught_up

    def open(self) -> None:
        """Open now (``read`` also opens on demand); raises ``KernelLogError``."""
        if self._device is None:
            self._device = self._opener(self.path)

    def close(self) -> None:
        if self._device is not None:
            self._device.close()
            self._device = None
        self._buffer = b""
        self._current = None

    def read(self) -> KmsgBatch:
        """Everything logged since the previous call, up to the end of the log.

        Raises ``KernelLogError`` only when the log cannot be opened. A read that fails part-way
        closes the device and returns what it had with ``error`` set; the next call reopens it and
        skips the records already handed out.
        """
        self.open()
        device = self._device
        assert device is not None
        backlog = not self._caught_up
        out: list[KmsgRecord] = []
        counts = {"overwritten": 0, "malformed": 0}
        caught_up = False
        error: str | None = None
        for _ in range(self._max_reads):
            try:
                chunk = device.read(READ_SIZE)
            except BlockingIOError:
                caught_up = True
                break
            except BrokenPipeError:
                # The kernel moved us to the oldest record it still holds; the gap in sequence
                # numbers measures the loss.
                log.warning("kernel log overrun: records were overwritten before being read")
                continue
            except OSError as exc:
                error = f"reading {self.path} failed: {exc.strerror or exc}"
                log.warning("kernel log read failed", extra={"path": str(self.path), "error": str(exc)})
                break
            if not chunk:
                caught_up = True
                break
            self._feed(chunk, out, counts)
        if caught_up or error is not None:
            self._finish_current(out, counts)
        if error is not None:
            self.close()
        elif caught_up:
            self._caught_up = True
        return KmsgBatch(
            records=tuple(out),
            backlog=backlog,
            caught_up=caught_up,
            overwritten=counts["overwritten"],
            malformed=counts["malformed"],
            error=error,
        )

    def _feed(self, chunk: bytes, out: list[KmsgRecord], counts: dict[str, int]) -> None:
        data = self._buffer + chunk
        *lines, rest = data.split(b"\n")
        if len(rest) > MAX_LINE:
            log.warning(
                "kernel log line too long; dropped", extra={"path": str(self.path), "bytes": len(rest)}
            )
            counts["malformed"] += 1
            rest = b""
        self._buffer = rest
        for line in lines:
            if line.startswith(b" "):
                if self._current is not None:
                    key, sep, value = line[1:].decode("utf-8", errors="replace").partition("=")
                    if sep:
                        self._current[1][key] = value
                continue
            self._finish_current(out, counts)
            self._current = (line, {})

    def _finish_current(self, out: list[KmsgRecord], counts: dict[str, int]) -> None:
        if self._current is None:
            return
        line, fields = self._current
        self._current = None
        if not line:
            return
        try:
            record = parse_record(line)
        except MalformedRecord as exc:
            counts["malformed"] += 1
            log.warning(
                "malformed kernel log record skipped", extra={"path": str(self.path), "error": str(exc)}
            )
            return
        last = self._last_seq
        if last is not None:
            if record.seq <= last:
                return  # handed out before a reopen
            counts["overwritten"] += record.seq - last - 1
        self._last_seq = record.seq
        if fields:
            record = replace(record, fields=fields)
        out.append(record)
