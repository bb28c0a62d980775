"""InfiniBand and RoCE ports from ``<sysfs>/class/infiniband``: one ``Nic`` per RDMA port.

Layout read (as node_exporter's infiniband collector and prometheus/procfs read it)::

    class/infiniband/<dev>/ports/<N>/{state,phys_state,rate,link_layer}
    class/infiniband/<dev>/ports/<N>/counters/*       IBTA PMA counters (every RDMA driver)
    class/infiniband/<dev>/ports/<N>/counters_ext/*   64-bit PMA counters of legacy mlx4
    class/infiniband/<dev>/ports/<N>/hw_counters/*    driver counters (mlx5: RoCE, CNP, retries)

Choices a reader of the report needs to know:

- ``counters`` holds every counter file of the three directories, keyed by file name, raw (so
  ``port_rcv_data`` stays in 4-byte words there). If a name appears in more than one, the later
  directory in the order above wins: ``hw_counters`` are the driver's own 64-bit counters, while the
  same name under ``counters/`` may be a 32-bit PMA counter that saturates. ``hw_counters/lifespan``
  is left out: it is the driver's cache lifetime setting in milliseconds, not a counter.
- ``rx_bytes_total``/``tx_bytes_total`` are ``port_rcv_data``/``port_xmit_data`` times 4, from
  ``counters_ext/*_64`` when that exists (mlx4's 32-bit ones saturate within seconds at 40 Gb/s).
  Packets come from ``*_packets_64``, else ``port_*_packets``, else unicast plus multicast.
- A counter that reads ``N/A (no PMA)`` (iWARP) or that the driver refuses with EINVAL/EOPNOTSUPP
  is unsupported: left out of ``counters`` and null in the typed fields, not an error. A port with
  no readable counter at all has no ``counters`` (the schema allows it absent, never null). Any
  other failure (permission denied, EIO, a directory, text that is not a count) is left out too,
  and named in ``Collected.errors``.
- ``netdev`` links a port to its network interface (the RoCE netdev from
  ``gid_attrs/ndevs/0``, else the interface under ``<dev>/device/net`` for this port, such as
  IPoIB's ``ib0``). That interface is *also* reported by the netdev collector, with the kernel's
  netdev statistics. The two do not count the same traffic (RDMA bypasses the netdev, the port
  counters see everything), so a consumer summing a node's throughput adds the RDMA ports and the
  netdevs that no RDMA port names as its ``netdev``.
- A ``link_layer`` other than ``Ethernet`` (unreadable, or ``Unknown`` on some iWARP drivers) is
  reported as ``InfiniBand``, the class's own default, with a warning in the log.

Cost: the layout (ports, counter files, netdevs) is discovered once, and again only when the set
of devices changes, a file of it disappears, or every ``rescan_every`` cycles. A steady cycle is
one ``listdir`` of the class directory plus one ``pread`` per attribute (see ``agent.sysfs``).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Final, Literal

from msgspec import UNSET

from agent import sysfs
from agent.collectors.base import Collected, CollectorContext, Support
from agent.collectors.vanished import Vanished
from agent.errors import CollectorFailure
from agent.report import Nic

log = logging.getLogger(__name__)

# The report schema's bounds (agent/schema/report-v1.schema.json).
MAX_COUNTERS: Final = 256
MAX_NAME: Final = 64
MAX_STATE: Final = 32

# Read in this order; a name in a later directory replaces the same name from an earlier one.
COUNTER_DIRS: Final = ("counters", "counters_ext", "hw_counters")
NOT_COUNTERS: Final = frozenset({"lifespan"})

_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([GM])b/sec")
_UNIT_BITS: Final = {"G": 1e9, "M": 1e6}

LinkLayer = Literal["InfiniBand", "Ethernet"]


def parse_rate(text: str | None) -> float | None:
    """Bytes per second from a port's ``rate``: ``"400 Gb/sec (4X NDR)"`` is 5.0e10."""
    if text is None:
        return None
    m = _RATE_RE.match(text)
    if m is None:
        return None
    return float(m.group(1)) * _UNIT_BITS[m.group(2)] / 8


def parse_state(text: str | None) -> str | None:
    """A ``state``/``phys_state`` without its number: ``"4: ACTIVE"`` is ``"ACTIVE"``.

    None for an empty value or one longer than the schema allows (that is not a state name).
    """
    if text is None:
        return None
    label = text.partition(":")[2] if ":" in text else text
    label = label.strip()
    if not label or len(label) > MAX_STATE:
        return None
    return label


class _WarnOnce:
    """Logs a warning the first time only: rediscovery meets the same oddity every few minutes."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, str, int]] = set()

    def __call__(self, message: str, device: str, port: int, **extra: object) -> None:
        if (message, device, port) in self._seen:
            return
        self._seen.add((message, device, port))
        log.warning(message, extra={"device": device, "port": port, **extra})


@dataclass(frozen=True, slots=True)
class _Port:
    device: str
    port: int
    link_layer: LinkLayer
    netdev: str | None
    # None where the port has no such file (then it is not looked for every cycle).
    state: sysfs.Attr | None
    phys_state: sysfs.Attr | None
    rate: sysfs.Attr | None
    counters: tuple[sysfs.Attr, ...]  # sorted by name

    def attrs(self) -> list[sysfs.Attr]:
        labels = [a for a in (self.state, self.phys_state, self.rate) if a is not None]
        return [*labels, *self.counters]


class InfinibandCollector:
    name = "infiniband"

    def __init__(
        self, ctx: CollectorContext, *, rescan_every: int = 60, max_open_files: int | None = None
    ) -> None:
        """``max_open_files``: files held open for cheap re-reads (default: ``sysfs.fd_budget()``)."""
        if rescan_every < 1:
            raise ValueError(f"rescan_every must be at least 1, got {rescan_every}")
        self._root = os.fspath(ctx.paths.sysfs)
        self._class_dir = os.path.join(self._root, "class", "infiniband")
        self._rescan_every = rescan_every
        self._files = sysfs.HeldFiles(max_open_files)
        self._devices: list[str] | None = None  # None: not discovered yet
        self._ports: tuple[_Port, ...] = ()
        self._cycles = 0
        self._warn = _WarnOnce()
        self._vanished = Vanished("RDMA device")

    def supported(self) -> Support:
        # A root that is no sysfs at all is a failure (collect says why), not "no RDMA devices".
        if os.path.isdir(self._class_dir) or sysfs.root_problem(self._root) is not None:
            return Support(True)
        return Support(False, f"no {self._class_dir}: no RDMA devices")

    def collect(self) -> Collected:
        try:
            devices = sorted(os.listdir(self._class_dir))
        except OSError as exc:
            why = sysfs.root_problem(self._root) or f"cannot list {self._class_dir}: {exc.strerror or exc}"
            raise CollectorFailure(why) from exc
        self._cycles += 1
        if devices != self._devices or self._cycles >= self._rescan_every:
            self._discover(devices)
        reader = sysfs.CycleReader()
        nics = [self._read_port(port, reader) for port in self._ports]
        if reader.gone:
            # A device went away (or came back) between cycles: read the new layout once more now.
            log.info("infiniband layout changed, rediscovering", extra={"path": self._class_dir})
            self._discover(sorted(sysfs.list_names(self._class_dir)))
            reader = sysfs.CycleReader()
            nics = [self._read_port(port, reader) for port in self._ports]
        gone = self._vanished.check((n.device, n.port) for n in nics)
        return Collected(nics=tuple(nics), errors=(*reader.problems, *gone))

    def close(self) -> None:
        for port in self._ports:
            self._files.release(port.attrs())
        self._devices = None
        self._ports = ()

    def _discover(self, devices: list[str]) -> None:
        ports: list[_Port] = []
        for device in devices:
            if len(device) > MAX_NAME:
                log.warning("skipping RDMA device with an overlong name", extra={"device": device})
                continue
            dev_dir = os.path.join(self._class_dir, device)
            numbers = [int(p) for p in sysfs.list_names(os.path.join(dev_dir, "ports")) if p.isdigit()]
            ports.extend(_discover_port(device, dev_dir, n, len(numbers), self._warn) for n in numbers)
        ports.sort(key=lambda p: (sysfs.natural_key(p.device), p.port))
        for old in self._ports:
            self._files.release(old.attrs())
        for port in ports:
            self._files.hold(port.attrs())
        self._ports = tuple(ports)
        self._devices = devices
        self._cycles = 0
        log.debug(
            "infiniband layout discovered",
            extra={"path": self._class_dir, "ports": len(ports), "devices": len(devices)},
        )

    def _read_port(self, port: _Port, reader: sysfs.CycleReader) -> Nic:
        values = reader.counters(port.counters)
        state = parse_state(reader.text(port.state))
        phys_state = parse_state(reader.text(port.phys_state))
        rate = parse_rate(reader.text(port.rate))
        reader.done(f"{port.device} port {port.port}")
        return Nic(
            device=port.device,
            link_layer=port.link_layer,
            port=port.port,
            netdev=port.netdev,
            state=state,
            phys_state=phys_state,
            rate_bytes_per_second=rate,
            rx_bytes_total=_bytes(_first(values, "port_rcv_data_64", "port_rcv_data")),
            tx_bytes_total=_bytes(_first(values, "port_xmit_data_64", "port_xmit_data")),
            rx_packets_total=_packets(values, "rcv"),
            tx_packets_total=_packets(values, "xmit"),
            counters=values if values else UNSET,
        )


def _discover_port(device: str, dev_dir: str, number: int, port_count: int, warn: _WarnOnce) -> _Port:
    port_dir = os.path.join(dev_dir, "ports", str(number))
    link_layer_text = sysfs.read_text(os.path.join(port_dir, "link_layer"))
    link_layer: LinkLayer = "Ethernet" if link_layer_text == "Ethernet" else "InfiniBand"
    if link_layer_text not in ("InfiniBand", "Ethernet"):
        warn(
            "RDMA port with an unknown link layer, reporting it as InfiniBand",
            device,
            number,
            link_layer=link_layer_text,
        )
    return _Port(
        device=device,
        port=number,
        link_layer=link_layer,
        netdev=_find_netdev(dev_dir, port_dir, number, port_count),
        state=_attr(port_dir, "state"),
        phys_state=_attr(port_dir, "phys_state"),
        rate=_attr(port_dir, "rate"),
        counters=_counter_files(device, number, port_dir, warn),
    )


def _attr(directory: str, name: str) -> sysfs.Attr | None:
    path = sysfs.existing(directory, name)
    return sysfs.Attr(name, path) if path is not None else None


def _counter_files(device: str, number: int, port_dir: str, warn: _WarnOnce) -> tuple[sysfs.Attr, ...]:
    files: dict[str, tuple[int, str]] = {}  # name -> (rank of its directory, path)
    for rank, sub in enumerate(COUNTER_DIRS):
        sub_dir = os.path.join(port_dir, sub)
        for name in sysfs.list_names(sub_dir):
            if name not in NOT_COUNTERS:
                files[name] = (rank, os.path.join(sub_dir, name))
    names = sorted(files)
    if len(names) > MAX_COUNTERS:
        # The standard PMA counters first: they are what fabric tools and people compare.
        driver_rank = COUNTER_DIRS.index("hw_counters")
        standard = [n for n in names if files[n][0] != driver_rank]
        driver = [n for n in names if files[n][0] == driver_rank]
        names = sorted([*standard, *driver][:MAX_COUNTERS])
        warn(
            "port has more counters than a report holds", device, number, found=len(files), kept=MAX_COUNTERS
        )
    return tuple(sysfs.Attr(name, files[name][1]) for name in names)


def _find_netdev(dev_dir: str, port_dir: str, number: int, port_count: int) -> str | None:
    # RoCE: the GID table names the netdev; an InfiniBand port's read fails with EINVAL.
    ndev = sysfs.read_text(os.path.join(port_dir, "gid_attrs", "ndevs", "0"))
    if ndev and len(ndev) <= MAX_NAME:
        return ndev
    net_dir = os.path.join(dev_dir, "device", "net")
    names = [n for n in sysfs.list_names(net_dir) if len(n) <= MAX_NAME]
    if len(names) == 1 and port_count == 1:
        return names[0]
    # Several ports on one PCI function (mlx4): the netdev's dev_port is the 0-based port index;
    # older kernels used dev_id (hex) for it.
    for attr, base in (("dev_port", 10), ("dev_id", 16)):
        matches = [n for n in names if _int_attr(os.path.join(net_dir, n, attr), base) == number - 1]
        if len(matches) == 1:
            return matches[0]
    return None


def _int_attr(path: str, base: int) -> int | None:
    text = sysfs.read_text(path)
    if text is None:
        return None
    try:
        return int(text, base)
    except ValueError:
        return None


def _first(values: dict[str, int], *names: str) -> int | None:
    for name in names:
        value = values.get(name)
        if value is not None:
            return value
    return None


def _bytes(words: int | None) -> int | None:
    """PMA data counters count 4-byte words; the report wants bytes."""
    if words is None:
        return None
    total = words * 4
    return total if total <= sysfs.MAX_COUNT else None


def _packets(values: dict[str, int], direction: Literal["rcv", "xmit"]) -> int | None:
    total = _first(values, f"port_{direction}_packets_64", f"port_{direction}_packets")
    if total is not None:
        return total
    for unicast, multicast in (
        (f"port_unicast_{direction}_packets", f"port_multicast_{direction}_packets"),
        (f"unicast_{direction}_packets", f"multicast_{direction}_packets"),
    ):
        if unicast in values and multicast in values:
            return values[unicast] + values[multicast]
    return None
