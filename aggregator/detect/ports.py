"""Ports: each node's RDMA ports against the same ports on the other nodes of its pool.

The rules judge a port against its own past: ``ib-port-down`` takes a port that was up (or has
received traffic) and went down. What no rule can judge is a port that was never up under this
aggregator: a node that boots after maintenance with a bad cable or transceiver on one rail shows
that port in POLLING (or INIT, or DOWN) from its first report, just as a second port that nobody
cabled does. Its pool tells the two apart: nodes of one pool are built alike, so a port that is up
on nearly all of them is cabled on all of them. Three findings per port, each for a port that is up
on at least ``quorum`` of the pool's reporting nodes (its *expected* ports):

- **down**: the node has the port and it is not up (the kernel's port state is not ACTIVE). The
  node runs its collectives over fewer rails: quarantine evidence (soft: it must persist, as any).
- **gone**: the node reported the port before and no longer does, while its other ports are still
  reported: the adapter left the PCIe bus or its driver dropped it. Quarantine evidence too. A port
  a node never had is not judged (a node built with fewer adapters is not broken by it).
- **rate**: the port is up at a lower rate than the pool's nodes run it at (the rate that at least
  ``quorum`` of them reach): a link that trained at fewer lanes (1X or 2X of a 4X cable) or at a
  lower speed, which halves or quarters that rail. An alert: a pool with a few nodes of an older
  adapter generation under the same port names looks the same, and only on-call can tell.

Judged on the newest complete slot of the pool's frame (its ``link_up`` and
``link_rate_bytes_per_second`` columns) every ``every_seconds``; a condition becomes a finding
once it has held at every run for ``for_seconds`` (a port comes up within a subnet manager sweep
after a boot: ``ib-port-not-active`` waits as long). A pool with fewer than ``min_pool_nodes``
reporting nodes says nothing. A leaf switch that takes one port of many nodes down leaves that
port expected on fewer than ``quorum`` of them, so this detector stays out of it: those ports
were up before, and the rules and the safety limits judge them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, ClassVar, Final, Literal

import numpy as np
from msgspec import Meta

from aggregator.config import DetectorSettings, PositiveSeconds, Ratio
from aggregator.detect.base import Offload, OffloadingPoolDetector
from aggregator.detect.peers import complete_slots
from aggregator.fleet.frame import NIC_COLUMN, FrameWindow, NicKey, PoolFrame
from aggregator.model import Action, Finding

Kind = Literal["down", "gone", "rate"]
_UP: Final = NIC_COLUMN["link_up"]
_RATE: Final = NIC_COLUMN["link_rate_bytes_per_second"]


class PortsConfig(DetectorSettings, frozen=True):
    """``detectors.ports``."""

    name: ClassVar[str] = "ports"
    every_seconds: PositiveSeconds = 30.0
    # A port is expected on every node of the pool once it is up on this share of the pool's
    # reporting nodes. Below it (a pool being recabled, a leaf switch down) nothing is expected.
    quorum: Ratio = 0.8
    min_pool_nodes: Annotated[int, Meta(ge=2)] = 5
    # How long a condition must hold, run after run, before it is a finding: as long as
    # ib-port-not-active waits for a port in INIT or ARMED after a boot.
    for_seconds: Annotated[float, Meta(ge=0)] = 300.0
    down_action: Action = "quarantine"
    rate_action: Action = "alert"


@dataclass(frozen=True)
class Condition:
    """One port of one node that differs from its pool, in the newest slot."""

    node: str
    kind: Kind
    port: NicKey
    rate: float | None  # the port's rate, bytes/s (rate: its rate now)
    expected_rate: float | None  # what the pool runs it at (rate only)
    share: float  # of the pool's reporting nodes that have the port up
    nodes: int  # the pool's reporting nodes


@dataclass(frozen=True)
class Judgement:
    """One pool's slot, judged: the nodes it looked at and what differs."""

    judged: tuple[str, ...]
    conditions: tuple[Condition, ...]


def _port_name(key: NicKey) -> str:
    device, port = key
    return f"{device}/{port}"


def judge(window: FrameWindow, config: PortsConfig) -> Judgement:
    """The newest slot of ``window`` judged (reads nothing else: any thread)."""
    nic = window.nic
    if nic.shape[0] == 0 or not window.nodes:
        return Judgement((), ())
    slot = nic[-1]  # (nodes, nic columns, NIC_FIELDS)
    reported = ~np.isnan(slot).all(axis=-1)  # per NIC column: the node's report had it
    # A state the agent could not read (link_up NaN) is neither up nor down: no evidence.
    up = slot[..., _UP] == 1.0
    down = slot[..., _UP] == 0.0
    rate = slot[..., _RATE]
    # Per node, its RDMA ports (port numbers; a netdev has none) and which of them it reported.
    nodes: list[tuple[str, dict[NicKey, int]]] = []
    for n, name in enumerate(window.nodes):
        keys = window.nic_keys[n] if n < len(window.nic_keys) else ()
        columns = {k: c for c, k in enumerate(keys) if k[1] is not None and c < slot.shape[1]}
        if any(reported[n, c] for c in columns.values()):
            nodes.append((name, columns))
    judged = tuple(name for name, _ in nodes)
    if len(nodes) < config.min_pool_nodes:
        return Judgement(judged, ())
    index = {name: n for n, name in enumerate(window.nodes)}
    up_on: dict[NicKey, list[float]] = {}  # port -> the rates of the nodes that have it up
    for name, columns in nodes:
        n = index[name]
        for key, c in columns.items():
            if up[n, c]:
                up_on.setdefault(key, []).append(float(rate[n, c]))
    total = len(nodes)
    expected = {k: v for k, v in up_on.items() if len(v) >= config.quorum * total}
    if not expected:
        return Judgement(judged, ())
    typical: dict[NicKey, float | None] = {}
    for key, rates in expected.items():
        known = sorted((r for r in rates if not math.isnan(r)), reverse=True)
        # The rate at least ``quorum`` of the pool's nodes reach on this port: a few slow ones
        # cannot pull it down, as a median could in a small pool.
        at = math.ceil(config.quorum * total) - 1
        typical[key] = known[at] if len(known) > at >= 0 else None
    out: list[Condition] = []
    for name, columns in nodes:
        n = index[name]
        # A port the node reported before and not now is gone only while the node has fewer RDMA
        # ports up than the pool expects up: ports renamed (a naming policy, a bond, an adapter
        # moved) come back up under names of their own, and leave their old columns empty.
        short = sum(bool(up[n, c]) for c in columns.values()) < len(expected)
        for key, rates in expected.items():
            share = len(rates) / total
            if key not in columns:
                continue  # never had it: built with fewer adapters, or named otherwise
            c = columns[key]
            if not reported[n, c]:
                if short:
                    out.append(Condition(name, "gone", key, None, None, share, total))
            elif down[n, c]:
                out.append(Condition(name, "down", key, None, None, share, total))
            elif up[n, c]:
                want, have = typical[key], float(rate[n, c])
                if want is not None and not math.isnan(have) and have < want * (1 - 1e-6):
                    out.append(Condition(name, "rate", key, have, want, share, total))
    return Judgement(judged, tuple(out))


def _gbps(rate: float | None) -> str:
    return "?" if rate is None else f"{rate * 8 / 1e9:g} Gb/s"


class PortsDetector(OffloadingPoolDetector):
    """Ports that differ from the same ports on the pool's other nodes (see the module doc).

    Keeps, per (node, kind, port), when the condition was first seen at a run: the only state,
    dropped as soon as a run does not see it."""

    def __init__(self, config: PortsConfig | None = None) -> None:
        self.config = config if config is not None else PortsConfig()
        self.every_seconds = self.config.every_seconds
        # (node, kind, port) -> (when first seen, when last seen), at runs
        self._since: dict[tuple[str, Kind, NicKey], tuple[float, float]] = {}

    def forget(self, node: str) -> None:
        for key in [k for k in self._since if k[0] == node]:
            del self._since[key]

    def prepare_pool(self, frame: PoolFrame, now: float) -> Offload[Judgement]:
        _, last = complete_slots(frame, now)
        window = frame.window(last, last, nic=True)  # the newest complete slot, nothing more
        config = self.config
        return Offload(compute=lambda: judge(window, config), finish=lambda j: self._finish(j, now))

    def _finish(self, judgement: Judgement, now: float) -> dict[str, list[Finding]]:
        out: dict[str, list[Finding]] = {node: [] for node in judgement.judged}
        seen: set[tuple[str, Kind, NicKey]] = set()
        for cond in judgement.conditions:
            key = (cond.node, cond.kind, cond.port)
            seen.add(key)
            since, last = self._since.get(key, (now, now))
            if now - last > 2 * self.every_seconds:
                since = now  # the node was not judged for more than a run (silent, rebooted)
            self._since[key] = (since, now)
            if now - since >= self.config.for_seconds:
                out[cond.node].append(self._finding(cond, since))
        # A condition must hold at every run: one not seen now on a node judged now starts again
        # (a node not judged for one run, a lost report, keeps its start; for longer, above).
        for key in [k for k in self._since if k[0] in out and k not in seen]:
            del self._since[key]
        return out

    def _finding(self, cond: Condition, since: float) -> Finding:
        port = _port_name(cond.port)
        pool = f"{cond.share:.0%} of the pool's {cond.nodes} reporting nodes"
        if cond.kind == "down":
            action = self.config.down_action
            summary = f"RDMA port {port} is not up, where it is up on {pool}"
        elif cond.kind == "gone":
            action = self.config.down_action
            summary = f"RDMA port {port} is gone from the node's reports, where it is up on {pool}"
        else:
            action = self.config.rate_action
            summary = (
                f"RDMA port {port} is up at {_gbps(cond.rate)}, where {pool} run it at "
                f"{_gbps(cond.expected_rate)} or more (fewer lanes or a lower speed trained)"
            )
        evidence: dict[str, object] = {
            "port": port,
            "condition": cond.kind,
            "pool_share_up": round(cond.share, 4),
            "pool_nodes": cond.nodes,
        }
        if cond.kind == "rate":
            evidence["rate_bytes_per_second"] = cond.rate
            evidence["pool_rate_bytes_per_second"] = cond.expected_rate
        return Finding(
            detector=PortsConfig.name,
            key=f"port-{cond.kind}:{port}",
            severity="critical" if action == "quarantine" else "warning",
            action=action,
            summary=summary,
            since=since,
            evidence=evidence,
        )


__all__ = ["Condition", "Judgement", "PortsConfig", "PortsDetector", "judge"]
