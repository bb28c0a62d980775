"""Reading sysfs attribute files cheaply and without surprises.

Collectors read hundreds of small attribute files every cycle (8 InfiniBand ports have ~450), so:
file lists are discovered once by the collectors, not globbed every cycle; and each file a
collector reads every cycle is an ``Attr`` that is kept open and re-read with ``pread`` at offset
0, which makes sysfs produce the value afresh. On a real ``/sys`` that costs about 1 µs a file
against about 8 µs for open/read/close by path. Open files come out of a budget (``HeldFiles``),
a share of ``RLIMIT_NOFILE``; past it, files are read by path, which is only slower.

sysfs has its own ways of saying "not here": a counter the hardware lacks reads ``N/A (no PMA)``,
and some drivers answer ``EINVAL`` or ``EOPNOTSUPP`` for an attribute they expose but cannot read
(prometheus/procfs#705, InfiniBand counters on new hardware). Those are *unsupported*, which the
report writes as null. A file of a device that went away answers ``ENOENT``/``ENODEV``: the
layout is *gone* and the collector discovers it again. Anything else (permission denied, EIO, a
directory where a file should be, text that is not a number) is a *problem*, which a collector
reports in its ``errors`` while keeping every value it could read.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import resource
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

# An attribute is at most one page; two cover a page plus any driver that pads.
_READ_SIZE: Final = 8192
# Counters are at most 64 bits wide in every kernel interface we read.
MAX_COUNT: Final = 2**64 - 1
# errno values with which drivers say "this attribute exists but cannot be read on this hardware".
UNSUPPORTED_ERRNOS: Final = frozenset({errno.EINVAL, errno.EOPNOTSUPP, errno.ENODATA})
# errno values that mean the file or its device went away: the layout must be discovered again.
GONE_ERRNOS: Final = frozenset({errno.ENOENT, errno.ENODEV})
# At most this many problems are named in one error message; the rest are counted.
_NAMED_PROBLEMS: Final = 8
# A collector holds at most 1/8 of the soft open-file limit (128 of the common default 1024), and
# never more than this.
_FD_SHARE: Final = 8
_FD_CAP: Final = 4096

_DIGITS = re.compile(r"(\d+)")


def read_bytes(path: str) -> bytes:
    """The whole content of one attribute file. Raises ``OSError`` as the kernel reports it."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, _READ_SIZE)
    finally:
        os.close(fd)


def read_text(path: str) -> str | None:
    """The stripped text of an attribute, or None when it cannot be read or is not text."""
    try:
        raw = read_bytes(path)
    except OSError:
        return None
    try:
        return raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None


def parse_count(raw: bytes) -> int | None:
    """A cumulative counter's value: a non-negative decimal integer of at most 64 bits.

    Returns None for anything else (``N/A (no PMA)``, empty, negative, hex, overflowing), so a
    bogus value never reaches the report, whose schema requires counts to be non-negative.
    """
    text = raw.strip()
    if not text.isdigit():
        return None
    value = int(text)
    return value if value <= MAX_COUNT else None


def is_not_available(raw: bytes) -> bool:
    """Whether an attribute's content is the kernel's "not supported here" text."""
    return raw.lstrip().startswith(b"N/A")


def describe_error(exc: OSError) -> str:
    """A short, stable description of a read failure for the report's ``errors``."""
    name = errno.errorcode.get(exc.errno, "") if exc.errno is not None else ""
    return name or type(exc).__name__


def list_names(path: str) -> list[str]:
    """The names in a directory, sorted; an empty list when it is missing or unreadable."""
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def root_problem(root: str) -> str | None:
    """Why ``root`` cannot be a sysfs mount, or None. Every Linux sysfs has ``class/net`` (the
    loopback interface at least); one with neither it nor ``class/infiniband`` is a wrong
    ``--sysfs-root``, not a node without NICs."""
    if not os.path.isdir(root):
        return f"sysfs root {root} does not exist or is not a directory"
    if not any(os.path.isdir(os.path.join(root, "class", c)) for c in ("net", "infiniband")):
        return f"sysfs root {root} has neither class/net nor class/infiniband: not a sysfs mount"
    return None


def existing(directory: str, name: str) -> str | None:
    """The path of ``directory/name`` if it exists (a dangling link counts), else None."""
    path = os.path.join(directory, name)
    return path if os.path.lexists(path) else None


def natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key that orders ``mlx5_2`` before ``mlx5_10``, as people number devices."""
    return tuple((1, int(part)) if part.isdigit() else (0, part) for part in _DIGITS.split(name) if part)


class Attr:
    """One attribute file read every cycle, by its open descriptor when it has one."""

    __slots__ = ("fd", "name", "path")

    def __init__(self, name: str, path: str) -> None:
        self.name = name
        self.path = path
        self.fd = -1

    def read(self) -> bytes:
        """The current content. Raises ``OSError`` as the kernel reports it."""
        if self.fd >= 0:
            return os.pread(self.fd, _READ_SIZE, 0)
        return read_bytes(self.path)

    def __repr__(self) -> str:
        return f"Attr({self.name!r}, {self.path!r}, fd={self.fd})"


class HeldFiles:
    """The descriptors a collector keeps open, within its budget."""

    def __init__(self, limit: int | None = None) -> None:
        self._limit = limit
        self._held = 0

    @property
    def held(self) -> int:
        return self._held

    def hold(self, attrs: Iterable[Attr]) -> None:
        """Opens as many of ``attrs`` as the budget allows; the rest are read by path.

        A file that cannot be opened now is read by path too, so its error (permission denied,
        say) shows up in the cycle that reads it rather than being lost here.
        """
        limit = self._limit if self._limit is not None else fd_budget()
        for attr in attrs:
            if self._held >= limit:
                return
            if attr.fd >= 0:
                continue
            try:
                attr.fd = os.open(attr.path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
            self._held += 1

    def release(self, attrs: Iterable[Attr]) -> None:
        for attr in attrs:
            if attr.fd >= 0:
                # A file of a removed device may fail to close; the descriptor is freed anyway.
                with contextlib.suppress(OSError):
                    os.close(attr.fd)
                attr.fd = -1
                self._held -= 1


def fd_budget() -> int:
    """How many files one collector may hold open: a share of the soft ``RLIMIT_NOFILE``."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return _FD_CAP
    return max(0, min(_FD_CAP, soft // _FD_SHARE))


@dataclass(slots=True)
class CycleReader:
    """Reads one collection cycle's attributes, recording what went wrong instead of raising.

    ``problems`` collects one message per subject (a port, an interface) that had unreadable
    files, for ``Collected.errors``; ``gone`` says a file disappeared, so the layout a collector
    discovered earlier is out of date.
    """

    problems: list[str] = field(default_factory=list)
    gone: bool = False
    _pending: list[str] = field(default_factory=list)

    def read(self, attr: Attr) -> bytes | None:
        try:
            return attr.read()
        except OSError as exc:
            if exc.errno in GONE_ERRNOS:
                self.gone = True
            elif exc.errno not in UNSUPPORTED_ERRNOS:
                self._pending.append(f"{attr.name} ({describe_error(exc)})")
            return None

    def text(self, attr: Attr | None) -> str | None:
        """Stripped text of an attribute; None when absent, unsupported or unreadable."""
        if attr is None:
            return None
        raw = self.read(attr)
        if raw is None:
            return None
        try:
            return raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            self._pending.append(f"{attr.name} (not text)")
            return None

    def counters(self, attrs: Iterable[Attr]) -> dict[str, int]:
        """The values of counter files, leaving out those that have none."""
        values: dict[str, int] = {}
        for attr in attrs:
            raw = self.read(attr)
            if raw is None:
                continue
            value = parse_count(raw)
            if value is not None:
                values[attr.name] = value
            elif not is_not_available(raw):
                self._pending.append(f"{attr.name} (not a count: {raw[:24]!r})")
        return values

    def problem(self, message: str) -> None:
        self._pending.append(message)

    def done(self, subject: str) -> None:
        """Turns the problems met since the previous ``done`` into one message about ``subject``."""
        if not self._pending:
            return
        shown = ", ".join(self._pending[:_NAMED_PROBLEMS])
        extra = len(self._pending) - _NAMED_PROBLEMS
        more = f" and {extra} more" if extra > 0 else ""
        self.problems.append(f"{subject}: {shown}{more}")
        self._pending.clear()
