"""The CUSUM and its design math: run lengths from Siegmund's approximation, thresholds from them."""

from __future__ import annotations

import numpy as np
import pytest

from aggregator.detect.cusum import average_run_length, cusum, threshold_for_arl


def test_siegmund_matches_the_published_table() -> None:
    # Montgomery, Introduction to Statistical Quality Control, 6th ed., sec. 9.1.5: k = 0.5, h = 4
    # gives a one-sided ARL0 of 336 (168 two-sided) and an ARL of 8.38 at a one-sigma shift.
    assert average_run_length(0.5, 4.0) == pytest.approx(336.0, rel=0.01)
    assert average_run_length(0.5, 4.0, shift=1.0) == pytest.approx(8.38, rel=0.01)
    # At a shift equal to k the formula's limit is b^2.
    assert average_run_length(1.0, 3.0, shift=1.0) == pytest.approx((3.0 + 1.166) ** 2)


def test_run_length_grows_with_the_threshold_and_shrinks_with_the_shift() -> None:
    assert average_run_length(1.0, 5.0) < average_run_length(1.0, 6.0)
    assert average_run_length(1.0, 5.0, shift=2.0) < average_run_length(1.0, 5.0, shift=1.5)
    assert average_run_length(4.0, 9.0) == pytest.approx(6.53e33, rel=0.01)
    with pytest.raises(ValueError):
        average_run_length(-1.0, 1.0)


@pytest.mark.parametrize("k", [0.5, 1.0, 2.0, 4.5])
@pytest.mark.parametrize("arl0", [370.0, 1e7, 1e9])
def test_threshold_for_arl_inverts_the_run_length(k: float, arl0: float) -> None:
    h = threshold_for_arl(k, arl0)
    assert average_run_length(k, h) >= arl0
    if h > 1e-3:
        assert average_run_length(k, h - 1e-3) < arl0


def test_the_approximation_holds_on_simulated_normal_scores() -> None:
    # 4,000 independent CUSUMs with k = 0.5, h = 4 on standard normal scores: the mean slot of the
    # first crossing is ARL0 ~ 336 (Siegmund is accurate to a few per cent here; the mean of 4,000
    # geometric-like run lengths has a relative standard error of ~1.6 %).
    rng = np.random.default_rng(7)
    cells, k, h = 4000, 0.5, 4.0
    s = np.zeros(cells)
    crossed = np.full(cells, -1)
    t = 0
    while (crossed < 0).any():
        s = np.maximum(0.0, s + rng.standard_normal(cells) - k)
        t += 1
        new = (crossed < 0) & (s >= h)
        crossed[new] = t
        s[new] = 0.0
    assert float(crossed.mean()) == pytest.approx(average_run_length(k, h), rel=0.08)


def test_vectorized_cusum_agrees_with_the_recursion_and_holds_missing_slots() -> None:
    rng = np.random.default_rng(3)
    z = rng.normal(0.5, 2.0, (50, 7))
    z[rng.random(z.shape) < 0.2] = np.nan
    r = cusum(z, 1.0)
    for cell in range(7):
        s = 0.0
        for v in z[:, cell]:
            if not np.isnan(v):
                s = max(0.0, s + v - 1.0)
        assert r.statistic[cell] == pytest.approx(s)
