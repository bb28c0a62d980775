"""Physical network interfaces from ``<sysfs>/class/net``: one ``Nic`` per interface.

An interface is physical when it has a parent device: a ``device`` link, or (the same fact seen
from the other side) its ``class/net`` entry resolves into ``<sysfs>/devices/`` outside
``devices/virtual/``. Loopback, veth, bridges, bonds, tun/tap, VLANs, macvlans, docker and CNI
interfaces have no parent (the kernel puts them under ``devices/virtual/net``) and are skipped
unless their name is in ``CollectorContext.netdev_include`` (a bond carrying the node's traffic, a
bridge used by RoCE). Bonds are left out by default because their statistics are the sums of
their slaves', which are reported themselves.

Each interface reports ``device`` and ``netdev`` = its name, ``port`` null, ``state`` = its
``operstate``, ``rate_bytes_per_second`` from ``speed`` (Mb/s; -1 or unreadable when the link is
down: null), bytes and packets from ``statistics/``, and ``counters`` = every ``statistics/*``
file plus ``carrier_changes``, ``carrier_up_count`` and ``carrier_down_count``, raw.
``link_layer`` is ``Ethernet``, or ``InfiniBand`` for an IPoIB interface (``type`` 32).

The netdev of an RoCE or InfiniBand port is reported here as well as by the infiniband
collector, whose entry names it in ``netdev``; see that module for why that is not double
counting and how to sum a node's throughput.

Cost: the interface list is read every cycle (one ``listdir``); an interface is classified and its
files opened when it first appears (veths come and go with pods; only the new ones cost), and all
of them again every ``rescan_every`` cycles or when a file of theirs disappears. A steady cycle is
one ``pread`` per attribute (see ``agent.sysfs``).
"""

from __future__ import annotations

import logging
import os
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

CARRIER_FILES: Final = ("carrier_changes", "carrier_up_count", "carrier_down_count")
# ARPHRD_INFINIBAND in <linux/if_arp.h>: an IPoIB interface.
_TYPE_INFINIBAND: Final = "32"
# ethtool's speed unit is Mb/s: 1 Mb/s is 125,000 bytes/s.
_BYTES_PER_MBIT: Final = 125_000.0

LinkLayer = Literal["InfiniBand", "Ethernet"]


@dataclass(frozen=True, slots=True)
class _Netdev:
    name: str
    link_layer: LinkLayer
    operstate: sysfs.Attr | None
    speed: sysfs.Attr | None
    counters: tuple[sysfs.Attr, ...]  # sorted by name

    def attrs(self) -> list[sysfs.Attr]:
        labels = [a for a in (self.operstate, self.speed) if a is not None]
        return [*labels, *self.counters]


class NetdevCollector:
    name = "netdev"

    def __init__(
        self, ctx: CollectorContext, *, rescan_every: int = 60, max_open_files: int | None = None
    ) -> None:
        """``max_open_files``: files held open for cheap re-reads (default: ``sysfs.fd_budget()``)."""
        if rescan_every < 1:
            raise ValueError(f"rescan_every must be at least 1, got {rescan_every}")
        self._sysfs = os.fspath(ctx.paths.sysfs)
        self._class_dir = os.path.join(self._sysfs, "class", "net")
        self._include = frozenset(ctx.netdev_include)
        self._rescan_every = rescan_every
        self._files = sysfs.HeldFiles(max_open_files)
        # Every name seen in class/net, with its layout, or None for one that is not reported.
        self._known: dict[str, _Netdev | None] = {}
        self._reported: tuple[_Netdev, ...] = ()
        self._cycles = 0
        self._vanished = Vanished("network interface")

    def supported(self) -> Support:
        # A root that is no sysfs at all is a failure (collect says why), not "no interfaces".
        if os.path.isdir(self._class_dir) or sysfs.root_problem(self._sysfs) is not None:
            return Support(True)
        return Support(False, f"no {self._class_dir}: no network interfaces")

    def collect(self) -> Collected:
        try:
            names = os.listdir(self._class_dir)
        except OSError as exc:
            why = sysfs.root_problem(self._sysfs) or f"cannot list {self._class_dir}: {exc.strerror or exc}"
            raise CollectorFailure(why) from exc
        self._cycles += 1
        if self._cycles >= self._rescan_every:
            self._forget_all()
            self._cycles = 0
        self._update(names)
        reader = sysfs.CycleReader()
        nics = [self._read(netdev, reader) for netdev in self._reported]
        if reader.gone:
            # An interface went away or was renamed during the cycle: read the new layout now.
            self._forget_all()
            self._update(sysfs.list_names(self._class_dir))
            reader = sysfs.CycleReader()
            nics = [self._read(netdev, reader) for netdev in self._reported]
        gone = self._vanished.check((n.device, n.port) for n in nics)
        return Collected(nics=tuple(nics), errors=(*reader.problems, *gone))

    def close(self) -> None:
        self._forget_all()

    def _forget_all(self) -> None:
        for netdev in self._known.values():
            if netdev is not None:
                self._files.release(netdev.attrs())
        self._known.clear()
        self._reported = ()

    def _update(self, names: list[str]) -> None:
        """Learns new interfaces and forgets removed ones; unchanged ones cost nothing."""
        current = set(names)
        if current == self._known.keys():
            return
        for name in self._known.keys() - current:
            gone = self._known.pop(name)
            if gone is not None:
                self._files.release(gone.attrs())
        for name in sorted(current - self._known.keys(), key=sysfs.natural_key):
            netdev = self._discover(name)
            if netdev is not None:
                self._files.hold(netdev.attrs())
            self._known[name] = netdev
        reported = [n for n in self._known.values() if n is not None]
        reported.sort(key=lambda n: sysfs.natural_key(n.name))
        self._reported = tuple(reported)
        log.debug(
            "netdev layout discovered",
            extra={"path": self._class_dir, "interfaces": len(current), "reported": len(reported)},
        )

    def _discover(self, name: str) -> _Netdev | None:
        path = os.path.join(self._class_dir, name)
        # class/net also holds plain files such as bonding_masters.
        if len(name) > MAX_NAME or not os.path.isdir(path):
            return None
        if name not in self._include and not self._is_physical(path):
            return None
        link_layer: LinkLayer = (
            "InfiniBand" if sysfs.read_text(os.path.join(path, "type")) == _TYPE_INFINIBAND else "Ethernet"
        )
        stats_dir = os.path.join(path, "statistics")
        files = {n: os.path.join(stats_dir, n) for n in sysfs.list_names(stats_dir)}
        for carrier in CARRIER_FILES:
            carrier_path = os.path.join(path, carrier)
            if os.path.lexists(carrier_path):
                files[carrier] = carrier_path
        counter_names = sorted(files)
        if len(counter_names) > MAX_COUNTERS:
            log.warning(
                "interface has more counters than a report holds, keeping the first",
                extra={"netdev": name, "found": len(counter_names), "kept": MAX_COUNTERS},
            )
            counter_names = counter_names[:MAX_COUNTERS]
        return _Netdev(
            name=name,
            link_layer=link_layer,
            operstate=_attr(path, "operstate"),
            speed=_attr(path, "speed"),
            counters=tuple(sysfs.Attr(n, files[n]) for n in counter_names),
        )

    def _is_physical(self, path: str) -> bool:
        if os.path.lexists(os.path.join(path, "device")):
            return True
        relative = os.path.relpath(os.path.realpath(path), os.path.realpath(self._sysfs))
        parts = relative.split(os.sep)
        return len(parts) > 2 and parts[0] == "devices" and parts[1] != "virtual"

    def _read(self, netdev: _Netdev, reader: sysfs.CycleReader) -> Nic:
        values = reader.counters(netdev.counters)
        state = reader.text(netdev.operstate)
        if state is not None and (not state or len(state) > MAX_STATE):
            state = None
        rate = None
        speed = reader.text(netdev.speed)
        if speed is not None:
            try:
                mbits = int(speed)
            except ValueError:
                reader.problem(f"speed (not a number: {speed[:24]!r})")
            else:
                # SPEED_UNKNOWN is -1; a link that is down has no rate either.
                rate = mbits * _BYTES_PER_MBIT if mbits > 0 else None
        reader.done(netdev.name)
        return Nic(
            device=netdev.name,
            link_layer=netdev.link_layer,
            port=None,
            netdev=netdev.name,
            state=state,
            phys_state=None,
            rate_bytes_per_second=rate,
            rx_bytes_total=values.get("rx_bytes"),
            tx_bytes_total=values.get("tx_bytes"),
            rx_packets_total=values.get("rx_packets"),
            tx_packets_total=values.get("tx_packets"),
            counters=values if values else UNSET,
        )


def _attr(directory: str, name: str) -> sysfs.Attr | None:
    path = sysfs.existing(directory, name)
    return sysfs.Attr(name, path) if path is not None else None
