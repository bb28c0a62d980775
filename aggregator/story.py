"""What a node's state means to the person reading it: its times, its runbook, what happens next.

One source for the words: the status page (aggregator/web), the terminal view (gpuwarden
explain) and the node's own condition and events (aggregator/remediate/planner.py) all say the
same thing about a node, because they all say it through these functions.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, Final

__all__ = ["RUNBOOKS", "duration", "evidence_value", "iso", "next_step", "override_note", "runbook_url"]

# The runbook (docs/runbooks/<name>.md) a node in each situation points at, when its rule names none.
RUNBOOKS: Final[Mapping[str, str]] = {
    "held": "GpuwardenRemediationHeld",
    "lemon": "GpuwardenLemonNode",
    "node": "GpuwardenNodeQuarantined",
}


def iso(unix: float | None) -> str:
    """ISO 8601 with the date and the zone, to the second (``2026-12-01T21:25:42Z``); "-" for none."""
    if unix is None:
        return "-"
    return datetime.fromtimestamp(unix, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def evidence_value(key: str, value: object) -> str:
    """An evidence value as on-call reads it: unix times in ISO 8601, numbers to a few digits,
    lists and maps as JSON."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        if (key in ("time", "since", "first_seen") or key.endswith(("_time", "_at"))) and value > 1e9:
            return iso(float(value))
        return f"{value:.6g}" if isinstance(value, float) else str(value)
    if value is None:
        return "unknown"  # not "None": what on-call reads is that nobody knows
    if isinstance(value, str | bool):
        return str(value)
    return json.dumps(value, sort_keys=True, default=str)


def duration(seconds: float) -> str:
    """``90`` -> ``1 min 30 s``; ``86400`` -> ``1 day``: how long, as a person says it."""
    s = round(max(seconds, 0.0))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        m, r = divmod(s, 60)
        return f"{m} min" + (f" {r} s" if r else "")
    if s < 86400:
        h, r = divmod(s, 3600)
        return f"{h} h" + (f" {r // 60} min" if r // 60 else "")
    d, r = divmod(s, 86400)
    return f"{d} day{'s' if d > 1 else ''}" + (f" {r // 3600} h" if r // 3600 else "")


def runbook_url(
    base: str, *, held: bool = False, lemon: bool = False, evidence: Iterable[Mapping[str, Any]] = ()
) -> str:
    """The rule's own runbook when its evidence names one (it says more about the fault), else
    the one for the node's situation under ``base`` (``notify.runbook_base_url``)."""
    for ev in evidence:
        url = ev.get("runbook_url")
        if isinstance(url, str) and url:
            return url
    name = RUNBOOKS["held" if held else "lemon" if lemon else "node"]
    return f"{base}{'' if base.endswith('/') else '/'}{name}.md"


def next_step(
    state: str,
    since: float | None,
    *,
    held: bool = False,
    lemon: bool = False,
    probation_seconds: float,
    clear_for_seconds: float,
) -> str:
    """What happens to the node next, and when (absolute times, so the line does not change as
    the clock moves: the planner writes it into the node's condition)."""
    if held:
        return (
            "held by a safety limit: the decision stands but no taint is applied until a human "
            "resets the breaker (gpuwarden breaker reset)"
        )
    if state == "probation":
        at = iso(None if since is None else since + probation_seconds)
        return f"released at {at} if no quarantine evidence returns (probation {duration(probation_seconds)})"
    if state == "quarantined":
        tail = "; a lemon: a human must clear it after repair" if lemon else ""
        return (
            f"probation starts once the evidence has been gone {duration(clear_for_seconds)}, "
            f"release {duration(probation_seconds)} after that{tail}"
        )
    if state == "suspect":
        return (
            f"back to healthy once the evidence has been gone {duration(clear_for_seconds)}; "
            "quarantined if it persists"
        )
    return "nothing: the node is in service"


def override_note(taint_key: str, override_seconds: float) -> str:
    """What removing our taint by hand means (docs/remediation.md, "A human who removes our taint")."""
    return (
        f"removing the {taint_key} taint by hand is an override: the same evidence does not taint "
        f"the node again for {duration(override_seconds)}; new evidence does"
    )
