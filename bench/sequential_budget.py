"""The shipped symbol-error rule's design per port speed: false decisions and time to decide.

Run from the repository root (no network)::

    .venv/bin/python bench/sequential_budget.py [--seeds 300] [--arl-hours H]

Prints the two tables of docs/detection.md ("Counter rates against a budget"): per port speed
(NDR, HDR, EDR), the threshold ``h`` and the expected false decisions per 10,000 port-hours at the
budget, at half and a tenth of it and at one error a day (upper bounds from the continuous-time
ARL, ``PoissonCusum.false_alarms_per_10k_hours``); then the time to decide at 1.5x to 10x the
budget from a zero statistic at 10-s reports, one hour at most per seed, through the engine's own
``CountEvidence`` (``tests/test_sequential_counts.py``'s ``decision_times``). ``--arl-hours``
replaces the shipped rule's ``arl_hours`` to show the trade. Not a test: it takes a minute or two.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aggregator.rules.sequential import PoissonCusum
from tests.rulekit import EDR_BYTES_PER_SECOND, NDR_BYTES_PER_SECOND
from tests.test_sequential_counts import (
    HDR_BYTES_PER_SECOND,
    budget_per_second,
    report_statistic,
    shipped_design,
)

PORTS = (("NDR", NDR_BYTES_PER_SECOND), ("HDR", HDR_BYTES_PER_SECOND), ("EDR", EDR_BYTES_PER_SECOND))
RATIOS = (1.5, 2.0, 3.0, 5.0, 10.0)
WITHIN_S = 600.0


def design(link: float, arl_hours: float | None) -> PoissonCusum:
    shipped = shipped_design(link)
    if arl_hours is None:
        return shipped
    return PoissonCusum.design(budget_per_second(link), shipped.ratio, arl_hours)


def times(d: PoissonCusum, ratio: float, seeds: int) -> list[float]:
    first = [report_statistic(d, d.lambda0 * ratio, 1.0, seed)[:1] for seed in range(seeds)]
    return sorted(t[0] if t else math.inf for t in first)


def cell(ts: list[float]) -> str:
    share = sum(t <= WITHIN_S for t in ts) / len(ts)
    p95 = ts[min(len(ts) - 1, math.ceil(0.95 * len(ts)) - 1)]
    return (
        f"median {statistics.median(ts):.0f} s, p95 {p95:.0f} s, max {ts[-1]:.0f} s, "
        f"{share * 100:.0f} % within 10 min"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=300)
    ap.add_argument("--arl-hours", type=float, default=None, help="instead of the shipped rule's")
    args = ap.parse_args()
    print("| port | budget | h (nats) | at the budget | at half | at a tenth | at one error a day |")
    for name, link in PORTS:
        d = design(link, args.arl_hours)
        rates = [d.false_alarms_per_10k_hours(d.lambda0 * x) for x in (1.0, 0.5, 0.1, 1 / 86400 / d.lambda0)]
        print(f"| {name} | {d.lambda0:.1f}/s | {d.h:.2f} | " + " | ".join(f"{r:.2g}" for r in rates) + " |")
    print()
    print("| port | " + " | ".join(f"{r:g}x" for r in RATIOS) + " |")
    for name, link in PORTS:
        d = design(link, args.arl_hours)
        print(f"| {name} | " + " | ".join(cell(times(d, r, args.seeds)) for r in RATIOS) + " |", flush=True)


if __name__ == "__main__":
    main()
