"""The link state machine: slow pairs in, link decision records out.

Per unordered pair of nodes: ``healthy -> suspect -> degraded -> healthy``.

- A pair the localizer (``aggregator.detect.links``) calls slow becomes ``suspect``.
- It becomes ``degraded`` once it has been slow continuously for ``suspect_for_seconds``, counted
  from the finding's ``since`` (the first of the pair's unbroken run of slow results: probes of
  one pair may come minutes apart, and two slow ones ten minutes apart have persisted that long),
  and the localizer has called it a link, not a slow end, for ``confirm_for_seconds`` (one more
  run of it: a verdict that flickers once while a node recovers never degrades a link);
  evidence that comes and goes starts over, as for nodes.
- A suspect or degraded pair returns to ``healthy`` only after ``clear_for_seconds`` without the
  evidence: probes of one pair come minutes apart, and a link must not flap with each of them.

A link decision never taints either end (``action`` is always ``none``): the nodes are fine, the
path between them is not, and the scheduler's fix (avoid placing a ring over that pair, reseat a
cable) is a human's or a topology-aware scheduler's. ``node`` and ``peer`` are the two ends sorted
by name (docs/spec.md section 2).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from aggregator.decisions import Decision, Reason
from aggregator.model import Finding, LinkState

log = logging.getLogger(__name__)

# Evidence key of a pair finding whose slowness a sequential test has already decided (the link
# localizer's): the accumulated evidence is the persistence, so only the confirm run is waited for.
DECIDED: Final = "decided"

Pair = tuple[str, str]


@dataclass
class LinkStatus:
    node: str
    peer: str
    state: LinkState = "healthy"
    since: float = 0.0  # when the current state began
    first_seen: float | None = None  # when the current run of evidence began
    called_since: float = 0.0  # when the localizer began calling it a link (set with first_seen)
    clear_since: float | None = None  # when the evidence last went away
    finding: Finding | None = None  # the latest evidence


@dataclass
class LinkHealth:
    suspect_for_seconds: float = 120.0
    clear_for_seconds: float = 900.0
    confirm_for_seconds: float = 60.0  # the localizer's period: its verdict seen twice
    _links: dict[Pair, LinkStatus] = field(default_factory=dict)

    def get(self, a: str, b: str) -> LinkStatus | None:
        return self._links.get((min(a, b), max(a, b)))

    def links(self) -> Mapping[Pair, LinkStatus]:
        return self._links

    def update(self, slow: Mapping[Pair, Finding], now: float) -> list[Decision]:
        """The localizer's current slow pairs (every other pair is clear); the decisions they cause."""
        out: list[Decision] = []
        keys = {(min(a, b), max(a, b)): f for (a, b), f in slow.items() if a != b}
        for pair in sorted(keys.keys() | self._links.keys()):
            out += self._step(pair, keys.get(pair), now)
        return out

    def _step(self, pair: Pair, finding: Finding | None, now: float) -> list[Decision]:
        st = self._links.get(pair)
        if st is None:
            if finding is None:
                return []
            st = self._links[pair] = LinkStatus(pair[0], pair[1], since=now)
        if finding is not None:
            out: list[Decision] = []
            st.finding = finding
            st.clear_since = None
            if st.first_seen is None:
                st.first_seen = min(now, finding.since)
                st.called_since = now
            if st.state == "healthy":
                out.append(self._move(st, "suspect", now, finding.summary))
            called = now - st.called_since
            decided = finding.evidence.get(DECIDED) is True
            persisted = decided or now - st.first_seen >= self.suspect_for_seconds
            if st.state == "suspect" and persisted and called >= self.confirm_for_seconds:
                out.append(self._move(st, "degraded", now, finding.summary))
            return out
        st.first_seen = None
        if st.clear_since is None:
            st.clear_since = now
        if now - st.clear_since < self.clear_for_seconds:
            return []
        gone = now - st.clear_since
        del self._links[pair]  # healthy pairs are not kept: a fleet has far more pairs than links
        return [self._move(st, "healthy", now, f"no slow probes for {gone:.0f} s: healthy")]

    def _move(self, st: LinkStatus, state: LinkState, now: float, summary: str) -> Decision:
        previous = st.state
        st.state, st.since = state, now
        f = st.finding
        evidence = dict(f.evidence) if f is not None and state != "healthy" else {}
        if state == "degraded" and st.first_seen is not None:
            evidence.setdefault("persisted_seconds", round(now - st.first_seen, 1))
        reason = Reason(
            detector=f.detector if f is not None else "link",  # the localizer that called it
            severity=(f.severity if f is not None else "warning") if state != "healthy" else "info",
            summary=summary,
            evidence=evidence,
        )
        log.info(
            "link decision",
            extra={"node": st.node, "peer": st.peer, "state": state, "previous": previous},
        )
        return Decision(
            time=now,
            subject="link",
            node=st.node,
            peer=st.peer,
            state=state,
            previous=previous,
            action="none",
            reasons=[reason],
        )
