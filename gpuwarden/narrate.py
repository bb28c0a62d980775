"""What the demos print about the aggregator's decisions, so that a reader follows the story.

- Without a cluster nothing is tainted: the action reads "would taint", not "taint".
- A rack that goes silent together is one systemic event, printed once with its rack and its
  nodes, not one line per silent node (the aggregator says the same: silence is suspect, never a
  quarantine). A node's silence is held back a little before it is printed, because the event
  that explains it starts only once enough of its rack is quiet.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = ["SILENCE_HOLD_S", "Narrator", "action_words"]

SILENCE_HOLD_S: Final = 30.0  # aggregator seconds a silence-only decision waits for its event

_ACTIONS_WITHOUT_CLUSTER: Final = {
    "taint": "would taint",
    "untaint": "would untaint",
    "held": "held by a safety limit",
    "none": "no action",
}
_ACTIONS_WITH_CLUSTER: Final = {**_ACTIONS_WITHOUT_CLUSTER, "taint": "tainted", "untaint": "untainted"}


def action_words(action: str, *, cluster: bool) -> str:
    """``taint`` as a reader should take it: "would taint" when no cluster is attached."""
    return (_ACTIONS_WITH_CLUSTER if cluster else _ACTIONS_WITHOUT_CLUSTER).get(action, action)


def _silence_only(d: Mapping[str, Any]) -> bool:
    reasons = d.get("reasons") or []
    if d.get("subject", "node") != "node":
        return False
    if not reasons:  # back to healthy: silence over, if the node was silent
        return d.get("previous") == "suspect" and d.get("state") == "healthy"
    return all(r.get("detector") == "silence" for r in reasons)


@dataclass
class Narrator:
    """Turns decisions and systemic events into lines; ``stamp`` formats an aggregator time and
    ``describe`` one decision (each demo has its own clock and layout)."""

    stamp: Callable[[float], str]
    describe: Callable[[Mapping[str, Any]], str]
    _held: list[Mapping[str, Any]] = field(default_factory=list)
    _events: dict[tuple[str, str], set[str]] = field(default_factory=dict)  # printed, still going on
    _over: list[tuple[float, set[str]]] = field(default_factory=list)  # (when, nodes) of events just over
    _now: float = 0.0

    def _covered(self, node: str) -> bool:
        """Part of a systemic event printed already (its nodes coming back included)."""
        self._over = [(t, n) for t, n in self._over if self._now - t < 2 * SILENCE_HOLD_S]
        return any(node in nodes for nodes in self._events.values()) or any(node in n for _, n in self._over)

    def decisions(self, decisions: Iterable[Mapping[str, Any]], now: float) -> list[str]:
        self._now = now
        out: list[str] = []
        for d in decisions:
            if _silence_only(d):
                if not self._covered(str(d["node"])):
                    self._held.append(d)
                continue
            out.append(self.describe(d))
        return out + self.flush(now)

    def systemic(self, active: Sequence[Mapping[str, Any]], now: float) -> list[str]:
        """The events going on now (``/api/v1/summary``'s ``systemic_active``): each new one
        printed once with its nodes, each one over printed once as over."""
        self._now = now
        out: list[str] = []
        seen: set[tuple[str, str]] = set()
        for e in active:
            key = (str(e.get("domain_kind")), str(e.get("domain")))
            seen.add(key)
            nodes = set(map(str, e.get("silent_nodes") or e.get("nodes") or []))
            if key in self._events:
                self._events[key] |= nodes
                continue
            self._events[key] = nodes
            when = e.get("time")
            at = self.stamp(float(when) if when is not None else now)
            # The summary names the domain ("rack rack-010: 4 of 4 nodes stopped reporting ...").
            out.append(
                f"[{at}] systemic event: {e.get('summary')} "
                f"(nodes {', '.join(sorted(nodes))}; each suspect, none quarantined)"
            )
        for key in [k for k in self._events if k not in seen]:
            nodes = self._events.pop(key)
            self._over.append((now, nodes))
            out.append(f"[{self.stamp(now)}] systemic event over: {key[0]} {key[1]} ({len(nodes)} nodes)")
        self._held = [d for d in self._held if not self._covered(str(d["node"]))]
        return out

    def flush(self, now: float, *, everything: bool = False) -> list[str]:
        """Print the held silence decisions that no event explained within ``SILENCE_HOLD_S``."""
        self._now = now
        due = [d for d in self._held if everything or now - float(d["time"]) >= SILENCE_HOLD_S]
        self._held = [d for d in self._held if d not in due]
        return [self.describe(d) for d in due if not self._covered(str(d["node"]))]
