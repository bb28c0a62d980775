"""``gpuwarden eval TRUTH DECISIONS [--trace TRACE]``: score decisions against the ground truth.

Rules of scoring (docs/simulator.md has the reasoning):

- A hard or soft fault is caught by a node decision entering ``quarantined`` for its node at or
  after its start; a link fault by a link decision entering ``degraded`` for its pair (either
  order); a silent-rack node by any decision for it whose reasons include the ``silence``
  detector. Look-alikes are never "caught": they can only cause false quarantines.
- Time to detect is the decision's time minus the fault's ``first_seen`` (its start where no
  report showed it).
- Every decision entering ``quarantined`` is one quarantine. It is true when the node has a hard
  or soft fault that started at or before it; otherwise false, by cause: ``lookalike`` (the node
  had a look-alike), ``silent_rack`` (the node was in a silent rack), ``link_end`` (an end of a
  degraded link, blamed on the node), ``before_fault`` (a real fault, but later), ``no_fault``.
- Link attribution: a link fault reported as a link while neither end was quarantined without a
  fault of its own.
- The baseline is what dcgm-exporter and the usual alert rules catch on the same trace: a
  critical XID, a volatile DBE, a row-remap failure, a GPU at or above 85 C, an InfiniBand port
  not ACTIVE. It quarantines a node at the first report that trips one and never links.

Inputs that are not about the same trace are refused with one line (``check_inputs``): a decision
naming a node the truth's fleet does not have, or made outside the truth's time span; with
``--trace``, a trace with nodes the truth does not have, or without the reports that first showed
the truth's faults (each fault's ``first_seen`` is a report time in its own trace, so a trace of
another seed or scenario has next to none of them).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from agent.errors import ConfigError, ReportError
from agent.report import Report, decode
from sim import truth as truth_mod
from sim.profiles import TEMPERATURE_ALERT_C
from sim.truth import Truth, TruthFault

DETECTED_CLASSES: Final = ("hard", "soft", "link", "silent")
NODE_CLASSES: Final = frozenset({"hard", "soft"})
FALSE_CAUSES: Final = ("no_fault", "lookalike", "silent_rack", "link_end", "before_fault")
# XIDs the usual DCGM alert rules page on (hardware, driver or NVLink failures, not application errors).
CRITICAL_XIDS: Final = frozenset({48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140})
# Decisions carry their reports' times; replay corrects node clocks more than 10 s off, so ten
# minutes beyond the truth's span is far more than any honest decision log strays.
SPAN_SLACK_S: Final = 600.0
# A trace that is the truth's own has the report behind every fault's first_seen; one perturbed
# on purpose (reports dropped) has most of them; one of another seed or scenario next to none.
FIRST_SEEN_FOUND_MIN: Final = 0.5


@dataclass(frozen=True)
class Decision:
    time: float
    subject: str
    node: str
    peer: str | None
    state: str
    detectors: frozenset[str]


def _decision(raw: Any, where: str) -> Decision:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a JSON object")
    t, subject, node, state = raw.get("time"), raw.get("subject"), raw.get("node"), raw.get("state")
    if isinstance(t, bool) or not isinstance(t, int | float):
        raise ConfigError(f"{where}: time must be a number, got {t!r}")
    if subject not in ("node", "link"):
        raise ConfigError(f"{where}: subject must be node or link, got {subject!r}")
    if not isinstance(node, str) or not isinstance(state, str):
        raise ConfigError(f"{where}: node and state must be strings")
    peer = raw.get("peer")
    if subject == "link" and not isinstance(peer, str):
        raise ConfigError(f"{where}: a link decision needs a peer")
    reasons = raw.get("reasons") or []
    if not isinstance(reasons, list):
        raise ConfigError(f"{where}: reasons must be a list")
    detectors = frozenset(
        str(r["detector"]) for r in reasons if isinstance(r, Mapping) and isinstance(r.get("detector"), str)
    )
    return Decision(float(t), subject, node, peer if isinstance(peer, str) else None, state, detectors)


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    try:
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                if line.strip():
                    yield number, line
    except (OSError, EOFError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from exc


def load_decisions(path: Path | str) -> list[Decision]:
    """Read a decision log (JSON Lines); a ``ConfigError`` names the line that is wrong."""
    path = Path(path)
    out = []
    for number, line in _lines(path):
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{number}: not valid JSON: {exc}") from exc
        out.append(_decision(raw, f"{path}:{number}"))
    return out


# ---------------------------------------------------------------------------------------------
# Scoring


def began(f: TruthFault) -> float:
    """When a decision about ``f`` can first be caused by it: its start, or the first report that
    showed it where that is earlier. Decisions carry their reports' times; on a node whose clock
    runs a few seconds behind (too little for replay to correct) the report that shows a fault
    can read earlier than the fault's true start, and a decision made on it is still about it."""
    return min(f.start, f.first_seen) if f.first_seen is not None else f.start


def _ttd(f: TruthFault, at: float) -> float:
    return at - (f.first_seen if f.first_seen is not None else f.start)


def _catch_time(f: TruthFault, decisions: list[Decision]) -> float | None:
    for d in decisions:
        if d.time < began(f):
            continue
        if (
            f.fault_class in NODE_CLASSES
            and d.subject == "node"
            and d.node == f.node
            and d.state == "quarantined"
        ):
            return d.time
        if (
            f.fault_class == "link"
            and d.subject == "link"
            and d.state == "degraded"
            and {d.node, d.peer} == {f.node, f.peer}
        ):
            return d.time
        if (
            f.fault_class == "silent"
            and d.subject == "node"
            and d.node == f.node
            and "silence" in d.detectors
        ):
            return d.time
    return None


def _summary(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median_s": None, "p90_s": None, "max_s": None}
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return {"median_s": statistics.median(ordered), "p90_s": p90, "max_s": ordered[-1]}


def score(truth: Truth, decisions: Iterable[Decision]) -> dict[str, Any]:
    """Every metric of one decision log against the truth, as JSON-ready data."""
    ds = sorted(decisions, key=lambda d: d.time)
    classes: dict[str, Any] = {}
    for cls in DETECTED_CLASSES:
        faults = [f for f in truth.faults if f.fault_class == cls]
        ttds = []
        caught = 0
        for f in faults:
            at = _catch_time(f, ds)
            if at is not None:
                caught += 1
                ttds.append(_ttd(f, at))
        classes[cls] = {
            "faults": len(faults),
            "caught": caught,
            "recall": caught / len(faults) if faults else None,
            "time_to_detect": _summary(ttds),
        }
    by_node: dict[str, list[TruthFault]] = {}
    for f in truth.faults:
        by_node.setdefault(f.node, []).append(f)
        if f.peer is not None:
            by_node.setdefault(f.peer, []).append(f)
    quarantines = [d for d in ds if d.subject == "node" and d.state == "quarantined"]
    false_by_cause = dict.fromkeys(FALSE_CAUSES, 0)
    true_q = 0
    for q in quarantines:
        mine = by_node.get(q.node, [])
        real = [f for f in mine if f.fault_class in NODE_CLASSES and f.node == q.node]
        if any(began(f) <= q.time for f in real):
            true_q += 1
        else:
            false_by_cause[_false_cause(q.node, mine, real)] += 1
    links = [d for d in ds if d.subject == "link" and d.state == "degraded"]
    link_faults = [f for f in truth.faults if f.fault_class == "link"]
    true_links = sum(
        1
        for d in links
        if any({d.node, d.peer} == {f.node, f.peer} and began(f) <= d.time for f in link_faults)
    )
    attributed = 0
    for f in link_faults:
        if _catch_time(f, ds) is None:
            continue
        ends_blamed = any(
            q.time >= began(f)
            and q.node in (f.node, f.peer)
            and not any(
                g.fault_class in NODE_CLASSES and g.node == q.node and began(g) <= q.time
                for g in truth.faults
            )
            for q in quarantines
        )
        attributed += not ends_blamed
    return {
        "classes": classes,
        "quarantines": {
            "total": len(quarantines),
            "true": true_q,
            "false": len(quarantines) - true_q,
            "precision": true_q / len(quarantines) if quarantines else None,
            "false_by_cause": false_by_cause,
        },
        "links": {
            "degraded": len(links),
            "true": true_links,
            "precision": true_links / len(links) if links else None,
            "attributed": attributed,
            "faults": len(link_faults),
        },
    }


def _false_cause(node: str, mine: list[TruthFault], real: list[TruthFault]) -> str:
    if real:
        return "before_fault"
    kinds = {f.fault_class for f in mine}
    if "lookalike" in kinds:
        return "lookalike"
    if "silent" in kinds:
        return "silent_rack"
    if "link" in kinds:
        return "link_end"
    return "no_fault"


# ---------------------------------------------------------------------------------------------
# The static-threshold baseline


def _alert(report: Report) -> str | None:
    for ev in report.events or ():
        if ev.kind == "xid" and ev.code in CRITICAL_XIDS:
            return f"xid-{ev.code}"
    for g in report.gpus:
        if g.ecc_dbe_volatile_total:
            return "dbe"
        if g.remapped_rows_failure:
            return "remap-failure"
        if g.temperature_celsius is not None and g.temperature_celsius >= TEMPERATURE_ALERT_C:
            return "temperature"
    for n in report.nics:
        if n.link_layer == "InfiniBand" and n.state is not None and n.state != "ACTIVE":
            return "ib-port-down"
    return None


@dataclass(frozen=True)
class TraceFacts:
    """What one pass over a trace gives: the baseline's decisions, and what ``check_inputs``
    compares with the truth."""

    baseline: list[Decision]
    nodes: frozenset[str]
    stamps: frozenset[tuple[str, float]]  # (node, report time) of every report


def trace_facts(trace: Path | str) -> TraceFacts:
    path = Path(trace)
    seen: set[str] = set()
    nodes: set[str] = set()
    stamps: set[tuple[str, float]] = set()
    out = []
    for number, line in _lines(path):
        try:
            report = decode(line)
        except ReportError as exc:
            raise ConfigError(f"{path}:{number}: {exc}") from exc
        nodes.add(report.node)
        stamps.add((report.node, report.time))
        if report.node in seen:
            continue
        rule = _alert(report)
        if rule is not None:
            seen.add(report.node)
            out.append(
                Decision(
                    report.time, "node", report.node, None, "quarantined", frozenset({f"baseline:{rule}"})
                )
            )
    return TraceFacts(out, frozenset(nodes), frozenset(stamps))


def baseline(trace: Path | str) -> list[Decision]:
    """What static alerts would have quarantined: one decision per node, at its first alert."""
    return trace_facts(trace).baseline


# ---------------------------------------------------------------------------------------------
# Do the inputs belong together?


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _some(names: Sequence[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def check_inputs(
    truth: Truth,
    decisions: Sequence[Decision],
    trace: TraceFacts | None,
    *,
    names: tuple[Path | str, Path | str, Path | str | None] = ("truth", "decisions", "trace"),
) -> None:
    """Refuse, with a one-line ``ConfigError``, a decision log or a trace that is not about the
    truth's trace: scored anyway, it gives figures that mean nothing (negative times to detect)."""
    truth_name, decisions_name, trace_name = names
    fleet = set(truth.nodes)
    strangers = sorted({n for d in decisions for n in (d.node, d.peer) if n is not None and n not in fleet})
    if strangers:
        raise ConfigError(
            f"{decisions_name} does not belong to {truth_name}: it names {len(strangers)} node(s) "
            f"the truth's fleet does not have ({_some(strangers)})"
        )
    lo, hi = truth.start - SPAN_SLACK_S, truth.end + SPAN_SLACK_S
    outside = [d for d in decisions if not lo <= d.time <= hi]
    if outside:
        raise ConfigError(
            f"{decisions_name} does not belong to {truth_name}: {len(outside)} decision(s) fall "
            f"outside the truth's time span ({_when(truth.start)} to {_when(truth.end)}), the first "
            f"at {_when(outside[0].time)}"
        )
    if trace is None:
        return
    strangers = sorted(trace.nodes - fleet)
    if strangers:
        raise ConfigError(
            f"{trace_name} is not {truth_name}'s trace: it has {len(strangers)} node(s) the truth's "
            f"fleet does not have ({_some(strangers)})"
        )
    # Silent-rack entries have their start as first_seen, not a report's time.
    # A fault with an entry per node (a slow job) counts once: one report showed it first.
    shown = [f for f in truth.faults if f.first_seen is not None and f.fault_class != "silent"]
    ids = {id(f): (f.id, f.kind) if f.kind == "slow_job" else (id(f), "") for f in shown}
    found = {
        ids[id(f)]
        for f in shown
        if any((n, f.first_seen) in trace.stamps for n in (f.node, f.peer) if n is not None)
    }
    wanted = set(ids.values())
    if wanted and len(found) < FIRST_SEEN_FOUND_MIN * len(wanted):
        missing = next(f for f in shown if ids[id(f)] not in found)
        raise ConfigError(
            f"{trace_name} is not {truth_name}'s trace: only {len(found)} of the {len(wanted)} reports "
            f"that first showed its faults are in it (none from {missing.node} at "
            f"{missing.first_seen}, where fault {missing.id} ({missing.kind}) first showed)"
        )


# ---------------------------------------------------------------------------------------------
# Output


def _fmt(v: float | None, pct: bool = False) -> str:
    if v is None:
        return "-"
    return f"{100 * v:.0f}%" if pct else f"{v:.0f} s"


def markdown(results: Mapping[str, Mapping[str, Any]]) -> str:
    """One table per view, a column per system scored (gpuwarden, baseline)."""
    names = list(results)
    head = "| | " + " | ".join(names) + " |\n|---|" + "---|" * len(names) + "\n"
    rows = []
    for cls in DETECTED_CLASSES:
        cells = []
        for n in names:
            c = results[n]["classes"][cls]
            t = c["time_to_detect"]
            cells.append(
                f"{c['caught']}/{c['faults']} ({_fmt(c['recall'], True)}), "
                f"TTD median {_fmt(t['median_s'])}, p90 {_fmt(t['p90_s'])}"
            )
        rows.append(f"| recall {cls} | " + " | ".join(cells) + " |")
    q = [results[n]["quarantines"] for n in names]
    rows.append("| quarantines (true/total) | " + " | ".join(f"{x['true']}/{x['total']}" for x in q) + " |")
    rows.append("| precision | " + " | ".join(_fmt(x["precision"], True) for x in q) + " |")
    for cause in FALSE_CAUSES:
        rows.append(f"| false: {cause} | " + " | ".join(str(x["false_by_cause"][cause]) for x in q) + " |")
    lk = [results[n]["links"] for n in names]
    rows.append(
        "| links degraded (true/total) | " + " | ".join(f"{x['true']}/{x['degraded']}" for x in lk) + " |"
    )
    rows.append(
        "| link attribution (link, no end blamed) | "
        + " | ".join(f"{x['attributed']}/{x['faults']}" for x in lk)
        + " |"
    )
    return head + "\n".join(rows) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("truth", type=Path, help="ground truth JSON from gpuwarden sim")
    p.add_argument("decisions", type=Path, help="decision log (JSON Lines) from gpuwarden replay")
    p.add_argument(
        "--trace", type=Path, default=None, help="the trace: also score the static-threshold baseline"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")


def evaluate(truth_path: Path, decisions_path: Path, trace: Path | None) -> dict[str, dict[str, Any]]:
    """Score the decisions (and, with the trace, the baseline) after checking that all three
    are about one trace."""
    truth = truth_mod.load(truth_path)
    decisions = load_decisions(decisions_path)
    facts = trace_facts(trace) if trace is not None else None
    check_inputs(truth, decisions, facts, names=(truth_path, decisions_path, trace))
    results = {"gpuwarden": score(truth, decisions)}
    if facts is not None:
        results["baseline"] = score(truth, facts.baseline)
    return results


def run(args: argparse.Namespace) -> int:
    results = evaluate(args.truth, args.decisions, args.trace)
    print(json.dumps(results, indent=1, sort_keys=True) if args.json else markdown(results), end="\n")
    return 0
