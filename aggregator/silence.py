"""Nodes that stop reporting, and the difference between one silent node and a silent rack.

A node silent for ``silent_after_seconds`` (by default six report intervals; by the aggregator's
receive clock, so a node's clock skew does not matter) becomes suspect. It is never quarantined
for silence alone: silence says the agent, the node or the network is gone, not that the GPUs
are bad.

When many nodes of one failure domain (rack, leaf switch, zone) or a large share of a pool go
silent together, the cause is shared (a switch, a PDU, the aggregator's own network): that is one
systemic event for on-call, and each node's finding says it is part of it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from aggregator.config import SilenceConfig
from aggregator.fleet.pools import Placement
from aggregator.model import Finding
from aggregator.story import iso


@dataclass(frozen=True)
class SystemicEvent:
    time: float
    state: str  # "started" or "ended"
    domain_kind: str  # "rack", "leaf", "zone" or "pool"
    domain: str
    silent_nodes: tuple[str, ...]
    total_nodes: int

    @property
    def summary(self) -> str:
        if self.state == "ended":
            return f"{self.domain_kind} {self.domain}: reporting again"
        return (
            f"{self.domain_kind} {self.domain}: {len(self.silent_nodes)} of {self.total_nodes} nodes "
            "stopped reporting together: one shared cause (switch, power, network), not node faults"
        )


_WIDTH = {"rack": 0, "leaf": 1, "zone": 2, "pool": 3}


def _spread(nodes: list[str], placements: Mapping[str, Placement]) -> bool:
    """No single rack or leaf holds more than half of ``nodes``."""
    for attr in ("rack", "leaf"):
        counts: dict[str, int] = defaultdict(int)
        for n in nodes:
            value = getattr(placements[n], attr)
            if value:
                counts[value] += 1
        if counts and max(counts.values()) * 2 > len(nodes):
            return False
    return True


def _fmt(t: float) -> str:
    return iso(t)  # with the date and the zone


Domain = tuple[str, str]  # (kind, name)


def _holders(candidates: Mapping[Domain, frozenset[str]]) -> dict[str, list[Domain]]:
    """For each silent node, the candidate domains whose silent set holds it (a rack, a leaf, a
    zone: three at most)."""
    out: dict[str, list[Domain]] = defaultdict(list)
    for key, down_set in candidates.items():
        for n in down_set:
            out[n].append(key)
    return out


def _within_wider(
    key: Domain,
    down_set: frozenset[str],
    candidates: Mapping[Domain, frozenset[str]],
    holders: Mapping[str, list[Domain]],
) -> bool:
    """Whether the domain's silence is part of another candidate's: a strict superset, or the same
    nodes in a wider kind of domain (a dead leaf silences its racks: the leaf's event, not theirs).

    A domain that holds all of ``down_set`` holds any one node of it, so only the (at most three)
    candidates holding one of its nodes are looked at: a mass outage, thousands of racks silent at
    once, costs a pass over them instead of a pass over every pair (1.7 s of the event loop a
    check at 25,000 nodes, measured under cProfile with ``bench/ingest.py --profile``)."""
    some = next(iter(down_set))  # never empty: a candidate has at least domain_min_nodes >= 2
    for other in holders[some]:
        if other == key:
            continue
        wider = candidates[other]
        if down_set < wider or (_WIDTH[other[0]] > _WIDTH[key[0]] and down_set == wider):
            return True
    return False


class SilenceDetector:
    def __init__(self, config: SilenceConfig, interval_s: float) -> None:
        self.config = config
        self.silent_after_seconds = config.after(interval_s)
        self._active: dict[tuple[str, str], SystemicEvent] = {}

    def active_events(self) -> list[SystemicEvent]:
        return list(self._active.values())

    def check(
        self,
        last_received: Mapping[str, float],
        placements: Mapping[str, Placement],
        now: float,
    ) -> tuple[dict[str, list[Finding]], list[SystemicEvent]]:
        """Silence findings of the silent nodes, and the systemic events that started or ended at
        ``now``. Nodes that report have no entry."""
        cfg = self.config
        silent = {n for n, t in last_received.items() if now - t > self.silent_after_seconds}

        members: dict[tuple[str, str], list[str]] = defaultdict(list)
        for node in last_received:
            p = placements.get(node)
            if p is None:
                continue
            for kind, value in (("rack", p.rack), ("leaf", p.leaf), ("zone", p.zone), ("pool", p.pool)):
                if value:
                    members[(kind, value)].append(node)

        # Racks, leaves and zones: systemic when most of the domain is silent; once started, the
        # event lasts while at least domain_min_nodes of it stay silent (hysteresis: a rack coming
        # back node by node is one event that ends, not a flurry). A domain whose silent nodes all
        # lie in a wider systemic domain is part of that one (a dead leaf switch silences its
        # racks: one event for the leaf, not one per rack).
        candidates: dict[tuple[str, str], frozenset[str]] = {}
        for (kind, value), nodes in members.items():
            if kind == "pool":
                continue
            down_set = frozenset(n for n in nodes if n in silent)
            if len(down_set) < cfg.domain_min_nodes:
                continue
            if (kind, value) in self._active or len(down_set) / len(nodes) > 0.5:
                candidates[(kind, value)] = down_set
        holders = _holders(candidates)
        systemic: dict[tuple[str, str], tuple[str, ...]] = {
            key: tuple(sorted(down_set))
            for key, down_set in candidates.items()
            if not _within_wider(key, down_set, candidates, holders)
        }
        # A pool: systemic when a large share of it is silent beyond what its racks, leaves and
        # zones explain, spread over them (silence spread thinly over many racks points at
        # something all share, such as the network to the aggregator). Silence concentrated in one
        # rack or leaf is that domain's, even before it is most of it (a rack going down node by
        # node must not be called a pool outage on the way).
        explained = frozenset(n for down in systemic.values() for n in down)
        for (kind, value), nodes in members.items():
            if kind != "pool":
                continue
            rest = [n for n in nodes if n in silent and n not in explained]
            if len(rest) < cfg.domain_min_nodes:
                continue
            active = (kind, value) in self._active
            if active or (len(rest) / len(nodes) >= cfg.pool_share and _spread(rest, placements)):
                systemic[(kind, value)] = tuple(sorted(rest))

        events: list[SystemicEvent] = []
        for key, silent_nodes in systemic.items():
            if key not in self._active:
                ev = SystemicEvent(now, "started", key[0], key[1], silent_nodes, len(members[key]))
                self._active[key] = ev
                events.append(ev)
        for key in list(self._active):
            if key not in systemic:
                ev = self._active.pop(key)
                events.append(SystemicEvent(now, "ended", ev.domain_kind, ev.domain, (), ev.total_nodes))

        part_of: dict[str, str] = {}
        for (kind, value), silent_nodes in systemic.items():
            for n in silent_nodes:
                part_of.setdefault(n, f"{kind} {value}")

        findings: dict[str, list[Finding]] = {}
        for node in sorted(silent):
            last = last_received[node]
            quiet = now - last
            summary = f"no report for {quiet:.0f} s (last received {_fmt(last)})"
            evidence: dict[str, object] = {"last_received": last, "silent_seconds": round(quiet, 1)}
            if node in part_of:
                summary += f"; part of a systemic outage of {part_of[node]}"
                evidence["systemic"] = part_of[node]
            findings[node] = [
                Finding(
                    detector="silence",
                    key="silence",
                    severity="warning",
                    action="alert",
                    summary=summary,
                    since=last,
                    evidence=evidence,
                )
            ]
        return findings, events
