"""What every collector is: a name, ``supported()``, and ``collect()`` returning immutable data.

A collector reads one source (NVML, the kernel log, /sys/class/infiniband, /sys/class/net). It never
raises for "this machine does not have it": that is ``supported()`` saying no, with a reason (as
gpud does). It raises ``CollectorFailure`` (or anything else) only when its source is there but
could not be read this round; the runner turns that into an entry in the report's ``errors`` and
the rest of the report still goes out. Partial failures (one GPU lost of eight) are returned in
``Collected.errors`` alongside the data that was read.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from agent.clock import Clock, SystemClock
from agent.report import ErrorCode, Event, Gpu, Jobs, Nic

if TYPE_CHECKING:
    from agent.collectors.nccl_inspector import InspectorOptions
    from agent.gpu.session import NvmlSession


@dataclass(frozen=True)
class Support:
    supported: bool
    reason: str = ""
    # Not yet rather than not here: asking again later may say yes (NVML not initialized because
    # the driver is not loaded yet, as when the GPU operator loads it after the agent started).
    transient: bool = False


@dataclass(frozen=True)
class Problem:
    """A collector error a machine can act on: the report's ``CollectorError`` code and GPU."""

    message: str
    code: ErrorCode
    gpu: int | None = None


@dataclass(frozen=True)
class Collected:
    gpus: tuple[Gpu, ...] = ()
    nics: tuple[Nic, ...] = ()
    events: tuple[Event, ...] = ()
    errors: tuple[str | Problem, ...] = ()
    # The report's ``jobs`` section (NCCL Inspector); None from every other collector.
    jobs: Jobs | None = None


@dataclass(frozen=True)
class Paths:
    """Roots of the host's filesystems, configurable like node_exporter's ``--path.sysfs``."""

    sysfs: Path = Path("/sys")
    procfs: Path = Path("/proc")
    kmsg: Path = Path("/dev/kmsg")


class Collector(Protocol):
    name: str

    def supported(self) -> Support: ...

    def collect(self) -> Collected: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class RawXid:
    """One XID as NVML's event API delivered it."""

    gpu: int | None
    code: int
    time: float
    message: str | None = None


class XidEventSource(Protocol):
    """Critical XID events from NVML's event API, waited on in a background thread.

    ``drain()`` returns every event received since the previous call, each exactly once.
    """

    def supported(self) -> Support: ...

    def start(self) -> None: ...

    def drain(self) -> list[RawXid]: ...

    def pci_bus_ids(self) -> Mapping[str, int]:
        """Normalized PCI bus id (see ``normalize_pci_bus_id``) to GPU index."""
        ...

    def close(self) -> None: ...


@dataclass
class CollectorContext:
    """Everything a collector factory may need; passed in, never global."""

    paths: Paths = field(default_factory=Paths)
    clock: Clock = field(default_factory=SystemClock)
    # GPU access, set up by the runner from --gpu-backend (None: no GPUs on this node/backend "none").
    nvml: NvmlSession | None = None
    xid_source: XidEventSource | None = None
    # Netdevs reported even though they look virtual (bond0, a bridge used by RoCE, ...).
    netdev_include: tuple[str, ...] = ()
    # The NCCL Inspector directory and caps (--nccl-inspector-dir); None: that collector is off.
    nccl_inspector: InspectorOptions | None = None


_PCI_RE = re.compile(
    r"^(?:PCI:)?(?:(?P<domain>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{1,2}):(?P<dev>[0-9a-fA-F]{1,2})"
    r"(?:\.(?P<fn>[0-7]))?$"
)


def normalize_pci_bus_id(text: str) -> str | None:
    """One spelling for a GPU's PCI address, whoever printed it.

    NVML says ``00000000:3B:00.0``, the kernel log ``PCI:0000:3b:00``; both become ``0000:3b:00``
    (4-digit domain, bus, device, lowercase; the function is dropped because a GPU is function 0).
    Returns None for text that is not a PCI address.
    """
    m = _PCI_RE.match(text.strip())
    if m is None:
        return None
    domain = int(m.group("domain") or "0", 16)
    return f"{domain:04x}:{int(m.group('bus'), 16):02x}:{int(m.group('dev'), 16):02x}"
