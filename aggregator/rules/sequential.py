"""A counter's rate against its budget, decided sequentially: a one-sided Poisson CUSUM.

This module is the one place the arithmetic lives: the log-likelihood-ratio increment, the
decision threshold for a wanted false-alarm rate, the average run length (ARL) at any true rate,
and the per-(node, subject, rule) state that the rule engine keeps (``CountEvidence``).

The test (Lucas 1985, "Counted data CUSUM's", Technometrics 27(2); the likelihood-ratio form of
Page 1954). Errors are modelled as a Poisson process. In control the rate is the budget
``lambda0`` (per second); the design alternative is ``lambda1 = r * lambda0``. A report that adds
``n`` counts over ``dt`` seconds adds

    z = n * ln(r) - (lambda1 - lambda0) * dt

to the statistic, ``S = max(0, S + z)``, and the rate is decided to be over budget when
``S >= h``. At the budget ``E[z] = lambda0 * dt * (ln r - (r - 1)) < 0``: the statistic drifts
down, so a port at its budget is almost never decided, with a false-alarm rate that follows from
``h`` (``arl_seconds``); a port at ``r`` times its budget climbs ``lambda0 * dt * (r ln r - r + 1)``
a report on average, faster the bigger the excess, so the time to decide shrinks as the effect
grows. Because counts are over real elapsed time, a lost report only makes the next one cover a
longer ``dt``: the test works on counts over time, not on a number of samples.

The threshold (``threshold_for_arl``). The ARL is computed for the continuous-time version of the
statistic: in count units ``X = S / ln r`` jumps by one at every error and drifts down at
``k = (r - 1) lambda0 / ln r`` per second, reflecting at zero. Its expected time to reach ``H = h /
ln r`` from ``x``, ``L(x)``, solves the delay-differential equation

    k L'(x) = 1 + lambda (L(x + 1) - L(x))    for 0 < x < H,  L(x) = 0 for x >= H,
    L(0) = 1 / lambda + L(1)                  (at zero the statistic waits for the next error)

which ``arl_seconds`` integrates numerically from the threshold down (an exponential integrator
on a grid of 1/``_GRID`` counts; the one unknown, L just below H, follows from the condition at
zero by linearity). This is the integral-equation approach of Brook & Evans (1972) taken to the
continuous-time limit. Why continuous time: the statistic observed only at reports is never
above the continuous one (reflecting at zero more often can only raise it), so the continuous
statistic alarms no later on every path, and its ARL is a lower bound on the real one for any
report interval. The false-alarm rates stated from it are upper bounds. Two more things only lower
the real rate further: the per-report cap below, and that a saturated counter gives no evidence.
``tests/test_sequential_counts.py`` checks the ARL against a Monte Carlo of the continuous
statistic and the bound against one of the statistic at 10-s reports.

Robustness beyond the Poisson model. Errors on a real link are not always independent: a link
retrain, a reseated cable or a counter read across a link-up adds a burst of counts in one
interval. No single report may add more than ``h / MIN_REPORTS`` (at least ``MIN_REPORTS``
reports' worth of excess are needed to decide), which keeps a one-off burst from deciding alone
and only lowers the false-alarm rate. A decided statistic is capped at ``CEILING * h``, so that a
fault that lasted hours does not keep the port decided for hours after it stopped; the decision
clears when the statistic has drained back to zero (at a clean rate, ``CEILING * h / (lambda1 -
lambda0)`` seconds).

State (``CountEvidence``) per (node, subject, rule), fed the counter's value at each report:

- a report not newer than the last one seen (a late or duplicate report; the view's report is the
  node's latest) adds nothing;
- a counter that went down was reset (an operator cleared it, the driver reloaded): the statistic
  restarts from the new value; a reboot restarts it too (the engine drops the state on a new boot);
- an IBTA PortCounters error counter that reads its maximum (``NicCounter.saturates_at``,
  2**16 - 1 for ``symbol_error``) has stopped counting: from then on it gives no evidence, the
  statistic and the decision stay as they were, and the evidence says ``state: saturated``
  until the counter is cleared;
- a missing value (the report did not carry the counter) adds nothing; the next value's ``dt``
  covers the gap;
- an aggregator restart loses the statistic: it is rebuilt from the next reports (from the
  report before the first one the new process sees, when the view still has it), so a port that
  was decided must accumulate its evidence again (one decision time, see docs/detection.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final, Literal

import msgspec

# At least this many reports' worth of evidence to decide: one report's increment is capped at
# h / MIN_REPORTS. Three reports are 30 s at the agent's default 10-s interval; a burst confined
# to one interval cannot decide alone, while a real excess of 10x a budget still decides in three.
MIN_REPORTS: Final = 3
# A decided statistic is held at most at CEILING * h (see the module doc).
CEILING: Final = 2.0
# Grid of the ARL integration, in steps per count. At the shipped design (h = 17.4 nats, r = 2)
# the ARL at the budget moves by 0.12 % from 50 to 200 steps and by 0.007 % from 200 to 800; 200
# costs a few milliseconds per call.
_GRID: Final = 200
# exp() above this overflows a double; rates that far above the budget are decided in a report.
_MAX_EXPONENT: Final = 700.0

EvidenceState = Literal["counting", "saturated"]


class SequentialError(ValueError):
    """A design that cannot be built (a budget of zero, a ratio at or below one)."""


def drift_counts_per_second(lambda0: float, ratio: float) -> float:
    """``k``: how fast the statistic falls, in counts per second, when no error comes."""
    return (ratio - 1.0) * lambda0 / math.log(ratio)


def arl_seconds(h: float, lambda0: float, ratio: float, rate: float) -> float:
    """Expected seconds from a zero statistic to a decision when errors come at ``rate`` per second.

    Continuous-time statistic (a lower bound on the ARL at any report interval; module doc).
    ``rate`` zero never decides (``inf``). Where the integration would lose precision (far below
    the budget the ARL is astronomically long; far above, the solution is the small difference of
    two huge ones) a bound in the safe direction is returned instead: below the budget Lundberg's
    lower bound ``exp(s* h) / rate`` (``lundberg_exponent``), above it Wald's upper bound on the
    delay ``(H + 1) / (rate - k)`` (the crossing jump overshoots by less than one count, and
    reflecting at zero only shortens the wait).
    """
    if lambda0 <= 0 or ratio <= 1 or h <= 0:
        raise SequentialError(f"need lambda0 > 0, ratio > 1, h > 0; got {lambda0}, {ratio}, {h}")
    if rate <= 0:
        return math.inf
    exact = _arl_integrated(h, lambda0, ratio, rate)
    if exact is not None:
        return exact
    k = drift_counts_per_second(lambda0, ratio)
    if rate > k:
        return (h / math.log(ratio) + 1.0) / (rate - k)
    s = lundberg_exponent(lambda0, ratio, rate)
    exponent = s * h
    return math.inf if exponent > _MAX_EXPONENT else math.exp(exponent) / rate


def lundberg_exponent(lambda0: float, ratio: float, rate: float) -> float:
    """``s*`` > 0 with ``E[exp(s* z)] = 1`` for the increment ``z`` at a true ``rate`` below ``k``:
    ``(rate / lambda0) (ratio**s - 1) = s (ratio - 1)``. Each excursion of the statistic from zero
    (at most one per error) reaches ``h`` with probability at most ``exp(-s* h)`` (Lundberg's
    inequality), so decisions come at most ``rate * exp(-s* h)`` per second. At the budget s* = 1."""
    rho = rate / lambda0
    if rho * math.log(ratio) >= ratio - 1.0:
        raise SequentialError("the statistic drifts up at this rate: no exponent")

    def f(s: float) -> float:
        return rho * (math.pow(ratio, s) - 1.0) - s * (ratio - 1.0)

    lo, hi = 0.0, 1.0
    while f(hi) < 0:
        lo, hi = hi, hi * 2.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if f(mid) < 0:
            lo = mid
        else:
            hi = mid
    return lo


def _arl_integrated(h: float, lambda0: float, ratio: float, rate: float) -> float | None:
    """The ARL from the delay-differential equation (module doc); None where it loses precision."""
    k = drift_counts_per_second(lambda0, ratio)
    big_h = h / math.log(ratio)
    alpha = rate / k
    if alpha * big_h > _MAX_EXPONENT:
        return None
    # u(y) = L(H - y), y the distance below the threshold: u' = alpha u - alpha u(y - 1) - 1/k,
    # u(y) = 0 for y <= 0, u(0+) = a unknown. u = p + a q by linearity.
    m = _GRID
    d = 1.0 / m
    steps = math.floor(big_h * m)
    tail = big_h - steps * d  # the last, partial step up to y = H
    p = [0.0] * (steps + 2)
    q = [0.0] * (steps + 2)
    q[0] = 1.0

    def step(i: int, length: float) -> tuple[float, float]:
        e = math.exp(alpha * length)
        phi1 = (e - 1.0) / alpha
        phi2 = (e - 1.0 - alpha * length) / (alpha * alpha * length) if length > 0 else 0.0
        j = i - m  # u(y - 1) at the step's start is u[j]; before y = 1 it is u(<= 0) = 0
        if j >= 0:
            dp0, dq0 = p[j], q[j]
            if length < d and j + 1 <= steps:
                frac = length / d
                dp1 = p[j] + (p[j + 1] - p[j]) * frac
                dq1 = q[j] + (q[j + 1] - q[j]) * frac
            else:
                dp1, dq1 = p[j + 1], q[j + 1]
        else:
            dp0 = dq0 = dp1 = dq1 = 0.0
        # forcing f = -alpha * u(y - 1) - 1/k (for p), -alpha * u(y - 1) (for q), linear in the step
        fp0, fp1 = -alpha * dp0 - 1.0 / k, -alpha * dp1 - 1.0 / k
        fq0, fq1 = -alpha * dq0, -alpha * dq1
        return (
            e * p[i] + fp0 * phi1 + (fp1 - fp0) * phi2,
            e * q[i] + fq0 * phi1 + (fq1 - fq0) * phi2,
        )

    for i in range(steps):
        p[i + 1], q[i + 1] = step(i, d)
    p_h, q_h = step(steps, tail) if tail > 0 else (p[steps], q[steps])
    # u(H - 1): where the statistic lands after one error from zero (zero if H <= 1)
    if big_h <= 1.0:
        p_1 = q_1 = 0.0
    else:
        pos = (big_h - 1.0) * m
        lo = min(int(pos), steps)
        hi = min(lo + 1, steps)
        frac = pos - lo
        p_1 = p[lo] + (p[hi] - p[lo]) * frac
        q_1 = q[lo] + (q[hi] - q[lo]) * frac
    # L(0) = 1/rate + L(1):  p_h + a q_h = 1/rate + p_1 + a q_1
    denominator = q_h - q_1
    if not denominator > 0:
        return None
    a = (1.0 / rate + p_1 - p_h) / denominator
    result = p_h + a * q_h
    # Double precision keeps about 16 digits: a result that is the difference of two numbers
    # more than 1e10 times larger has fewer than 6 left.
    if not (math.isfinite(result) and result > 0) or max(abs(p_h), abs(a * q_h)) > 1e10 * result:
        return None
    return result


def threshold_for_arl(arl_s: float, lambda0: float, ratio: float) -> float:
    """The smallest ``h`` (nats) whose ARL at the budget (``rate = lambda0``) is ``arl_s`` seconds."""
    if arl_s <= 0:
        raise SequentialError(f"an ARL is a positive time, got {arl_s}")
    lo, hi = 1e-6, 1.0
    while arl_seconds(hi, lambda0, ratio, lambda0) < arl_s:
        lo, hi = hi, hi * 2.0
        if hi > 1e4:
            raise SequentialError(f"no threshold reaches an ARL of {arl_s} s")
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if arl_seconds(mid, lambda0, ratio, lambda0) < arl_s:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-6 * hi:
            break
    return hi


@dataclass(frozen=True, slots=True)
class PoissonCusum:
    """One design: the budget, the design ratio and the threshold that gives the wanted ARL."""

    lambda0: float  # the budget, counts per second
    ratio: float  # r: the design alternative is r * lambda0
    h: float  # decision threshold, nats
    arl_hours: float  # ARL at the budget, hours (the design target)

    @classmethod
    def design(cls, lambda0: float, ratio: float, arl_hours: float) -> PoissonCusum:
        if not (lambda0 > 0 and math.isfinite(lambda0)):
            raise SequentialError(f"a budget must be a positive rate, got {lambda0}/s")
        if not ratio > 1:
            raise SequentialError(f"the design ratio must be above 1, got {ratio}")
        h = threshold_for_arl(arl_hours * 3600.0, lambda0, ratio)
        return cls(lambda0=lambda0, ratio=ratio, h=h, arl_hours=arl_hours)

    @property
    def log_ratio(self) -> float:
        return math.log(self.ratio)

    @property
    def cap(self) -> float:
        """The most one report may add (module doc)."""
        return self.h / MIN_REPORTS

    def increment(self, counts: int, dt: float) -> float:
        """The log-likelihood ratio of ``counts`` errors over ``dt`` s, capped at ``cap``."""
        z = counts * self.log_ratio - (self.ratio - 1.0) * self.lambda0 * dt
        return min(z, self.cap)

    def false_alarms_per_10k_hours(self, rate: float) -> float:
        """Expected decisions per 10,000 hours of one subject at a true ``rate`` per second (an
        upper bound: continuous-time ARL, uncapped increments)."""
        arl = arl_seconds(self.h, self.lambda0, self.ratio, rate)
        return 0.0 if math.isinf(arl) else 1e4 * 3600.0 / arl

    def delay_seconds(self, rate: float) -> float:
        """Expected seconds to decide, from a zero statistic, at a true ``rate`` per second
        (continuous time, without the per-report cap: a report interval adds up to one interval,
        the cap up to ``MIN_REPORTS`` intervals at very high rates)."""
        return arl_seconds(self.h, self.lambda0, self.ratio, rate)


class CountEvidence(msgspec.Struct, gc=False):
    """The statistic of one counter on one subject (see the module doc for every case).

    A struct the cycle collector does not track (``gc=False``: it holds numbers only): the engine
    keeps one per counting rule and subject, eight a node with the shipped rules, and every
    tracked object lengthens each full collection, which holds the event loop."""

    value: int | None = None  # the counter at the last report that carried it
    at: float | None = None  # that report's time
    statistic: float = 0.0  # S, nats
    start: float | None = None  # when S last left zero: the change-point estimate
    counts: int = 0  # counts since ``start``
    decided: bool = False
    saturated: bool = False

    @property
    def state(self) -> EvidenceState:
        return "saturated" if self.saturated else "counting"

    def restart(self, value: int, at: float) -> None:
        self.value, self.at = value, at
        self.statistic, self.start, self.counts = 0.0, None, 0
        self.decided = self.saturated = False

    def idle(self, value: int | None, at: float, saturates_at: int | None) -> bool:
        """Take ``value`` at ``at`` if that is the common case, nothing counted on a zero
        statistic, and say so; False (nothing taken) otherwise, for ``observe``.

        A clean port's every report: ``observe`` would add an increment of no counts (at most
        zero) to zero and leave the statistic at zero, with no start and no counts, so only the
        time moves. No design is needed for that, which is what makes it cheap."""
        if (
            value is None
            or value != self.value
            or self.statistic != 0.0
            or self.decided
            or self.at is None
            or at <= self.at
        ):
            return False
        self.at = at
        self.saturated = saturates_at is not None and value >= saturates_at
        return True

    def observe(self, value: int | None, at: float, design: PoissonCusum, saturates_at: int | None) -> None:
        """Take the counter's value at a report's time."""
        if self.at is not None and at <= self.at:
            if at < self.at and value is not None:
                # Time went backwards for this subject but not as a late report (those come with
                # the latest report's time): the node's history started over. So do we.
                self.restart(value, at)
            return
        if value is None:
            return  # no evidence; the next value's dt covers the gap
        last = self.value
        if last is None or self.at is None:
            self.value, self.at = value, at
            self.saturated = saturates_at is not None and value >= saturates_at
            return
        if value < last:
            self.restart(value, at)
            self.saturated = saturates_at is not None and value >= saturates_at
            return
        if self.saturated:
            self.value, self.at = value, at
            return  # stopped counting: no evidence either way
        counts = value - last
        # A counter that reached its maximum in this interval counted at least ``counts``: the
        # increment is increasing in counts, so the lower bound errs towards no decision.
        z = design.increment(counts, at - self.at)
        before = self.statistic
        s = max(0.0, before + z)
        if s == 0.0:
            self.start, self.counts = None, 0
        else:
            if before == 0.0 or self.start is None:
                self.start, self.counts = self.at, 0
            self.counts += counts
        if s >= design.h:
            self.decided = True
        if self.decided:
            s = min(s, CEILING * design.h)
            if s == 0.0:
                self.decided = False
        self.statistic = s
        self.value, self.at = value, at
        self.saturated = saturates_at is not None and value >= saturates_at

    def rate(self) -> float | None:
        """Counts per second since the statistic last left zero (its change-point estimate)."""
        if self.start is None or self.at is None or self.at <= self.start:
            return None
        return self.counts / (self.at - self.start)
