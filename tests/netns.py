"""A small lab network of Linux network namespaces for tests that need real links.

One ``hub`` namespace holds a bridge (``br0``, ``10.77.0.1/24``) and whatever the test runs
there (the aggregator); each node namespace is joined to the bridge by a veth pair whose node
end is ``eth0`` (``10.77.0.<k + 2>/24``) and whose hub end is ``n<k>``. Nothing is added to the
root namespace: the veths are created directly inside their namespaces, so concurrent runs and
the host's own addresses and routes never meet, and deleting the namespaces removes every link.

Every namespace is named ``gw-<pid>-...`` after the process that made it. A run that crashed
before its cleanup leaves namespaces whose pid is gone; ``sweep_leftovers`` removes those (and
ends the processes still inside them), and leaves a live run's namespaces alone.

Shaping uses only what these kernels have (no netem): ``tbf`` on both ends of a node's veth for
a node that is slow with everyone, and a ``prio`` qdisc whose third band holds a ``tbf``, with
``u32`` filters on the other node's address, for a single slow path. A qdisc on an interface
shapes what leaves it, so the node end shapes the node's sends and the hub end its receives.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from typing import Final

log = logging.getLogger(__name__)

PREFIX: Final = "gw-"
SUBNET: Final = "10.77.0"
HUB_ADDRESS: Final = f"{SUBNET}.1"
_OWN: Final = re.compile(rf"^{re.escape(PREFIX)}(\d+)-")
# tbf needs a bucket of at least one (GSO) packet, else it drops what it cannot ever send.
_BURST: Final = "256kb"
_LATENCY: Final = "200ms"
_UNSHAPED: Final = "40gbit"  # htb's default class when the rest of the traffic is not shaped
_QUANTUM: Final = "65536"  # bytes a class sends per turn; htb's rate/r2q default is far off here


class NetnsError(RuntimeError):
    """A namespace command failed; the message carries the command and its stderr."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if check and out.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


def unavailable() -> str | None:
    """Why namespaces cannot be built here (not root, a tool missing), or None."""
    if os.geteuid() != 0:
        return "network namespace tests need root (CI runs them as root)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"network namespace tests need {' and '.join(missing)} (iproute2)"
    return None


def _namespaces() -> list[str]:
    out = _run("ip", "netns", "list")
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _end_processes_in(ns: str) -> None:
    """Ends the processes left in one of our namespaces, by pid (a namespace with processes in it
    lives on after ``ip netns del``)."""
    out = _run("ip", "netns", "pids", ns, check=False)
    pids = [int(p) for p in out.stdout.split() if p.isdigit()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _delete(ns: str) -> None:
    _end_processes_in(ns)
    _run("ip", "netns", "del", ns, check=False)


def sweep_leftovers() -> list[str]:
    """Deletes the namespaces of earlier runs that did not clean up (their pid is gone)."""
    gone = []
    for ns in _namespaces():
        m = _OWN.match(ns)
        if m is None or int(m.group(1)) == os.getpid() or _pid_alive(int(m.group(1))):
            continue
        _delete(ns)
        gone.append(ns)
    if gone:
        log.warning("removed leftover namespaces of a crashed run", extra={"namespaces": gone})
    return gone


@dataclass(frozen=True)
class Node:
    index: int
    name: str  # the gpuwarden node name
    ns: str
    address: str
    hub_dev: str  # the hub end of its veth


@dataclass
class Lab:
    hub: str
    nodes: list[Node] = field(default_factory=list)

    @classmethod
    def create(cls, count: int, *, tag: str = "lab", node_rate: str | None = None) -> Lab:
        """``count`` node namespaces on one bridge. ``node_rate`` (tbf syntax, e.g. ``2gbit``):
        every node's baseline line rate, so healthy pairs measure one stable rate."""
        if not 2 <= count <= 200:
            raise ValueError(f"count must be 2..200, got {count}")
        base = f"{PREFIX}{os.getpid()}-{tag}"
        lab = cls(hub=f"{base}-hub")
        try:
            _run("ip", "netns", "add", lab.hub)
            lab._in(lab.hub, "ip", "link", "set", "lo", "up")
            lab._in(lab.hub, "ip", "link", "add", "br0", "type", "bridge")
            lab._in(lab.hub, "ip", "addr", "add", f"{HUB_ADDRESS}/24", "dev", "br0")
            lab._in(lab.hub, "ip", "link", "set", "br0", "up")
            for k in range(count):
                node = Node(k, f"node{k}", f"{base}-n{k}", f"{SUBNET}.{k + 2}", f"n{k}")
                _run("ip", "netns", "add", node.ns)
                lab.nodes.append(node)
                _run(
                    "ip", "link", "add", node.hub_dev, "netns", lab.hub, "type", "veth",
                    "peer", "name", "eth0", "netns", node.ns,
                )  # fmt: skip
                lab._in(lab.hub, "ip", "link", "set", node.hub_dev, "master", "br0", "up")
                lab._in(node.ns, "ip", "link", "set", "lo", "up")
                lab._in(node.ns, "ip", "addr", "add", f"{node.address}/24", "dev", "eth0")
                lab._in(node.ns, "ip", "link", "set", "eth0", "up")
            if node_rate is not None:
                for node in lab.nodes:
                    lab.throttle_node(node, node_rate)
        except BaseException:
            lab.destroy()
            raise
        return lab

    def destroy(self) -> None:
        """Ends what still runs inside and deletes every namespace (and with them the links)."""
        for ns in [n.ns for n in self.nodes] + [self.hub]:
            _delete(ns)

    def exec_argv(self, ns: str) -> list[str]:
        """The argv prefix that runs a command inside ``ns`` (it execs: the pid is the command's)."""
        return ["ip", "netns", "exec", ns]

    def _in(self, ns: str, *argv: str) -> subprocess.CompletedProcess[str]:
        return _run(*self.exec_argv(ns), *argv)

    def _ends(self, node: Node) -> list[tuple[str, str]]:
        return [(node.ns, "eth0"), (self.hub, node.hub_dev)]

    def throttle_node(self, node: Node, rate: str) -> None:
        """Everything to and from ``node`` at ``rate`` (tbf on both ends of its veth)."""
        for ns, dev in self._ends(node):
            self._in(
                ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                "rate", rate, "burst", _BURST, "latency", _LATENCY,
            )  # fmt: skip

    def throttle_path(self, a: Node, b: Node, rate: str, *, base_rate: str | None = None) -> None:
        """Only traffic between ``a`` and ``b`` at ``rate``; the rest of ``a``'s traffic at
        ``base_rate`` (None: as good as unshaped). An htb qdisc with a fast default class and a
        slow class, and u32 filters on ``b``'s address that pick the slow one."""
        fast = base_rate or _UNSHAPED
        for ns, dev, match in ((a.ns, "eth0", "dst"), (self.hub, a.hub_dev, "src")):
            if self._has_root(ns, dev):
                self._in(ns, "tc", "qdisc", "del", "dev", dev, "root")
            self._in(ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10")
            for classid, class_rate in (("1:10", fast), ("1:20", rate)):
                self._in(
                    ns, "tc", "class", "add", "dev", dev, "parent", "1:", "classid", classid, "htb",
                    "rate", class_rate, "ceil", class_rate, "burst", _BURST, "cburst", _BURST,
                    "quantum", _QUANTUM,
                )  # fmt: skip
            self._in(
                ns, "tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
                "u32", "match", "ip", match, f"{b.address}/32", "flowid", "1:20",
            )  # fmt: skip

    def restore(self, node: Node, base_rate: str | None = None) -> None:
        """Back to the baseline: ``base_rate`` tbf on both ends, or no shaping at all."""
        for ns, dev in self._ends(node):
            if self._has_root(ns, dev):
                self._in(ns, "tc", "qdisc", "del", "dev", dev, "root")
        if base_rate is not None:
            self.throttle_node(node, base_rate)

    def _has_root(self, ns: str, dev: str) -> bool:
        out = self._in(ns, "tc", "qdisc", "show", "dev", dev, "root")
        return any(kind in out.stdout for kind in ("tbf", "prio", "htb"))
