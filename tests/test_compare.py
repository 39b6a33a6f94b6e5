"""Comparisons that tell a real difference from noise (issue 30): paired / Welch intervals and the
equivalence test against scipy / statsmodels and hand-written references, the four verdicts,
known-truth synthetic sweeps, the identified asymptote, the prediction baseline, and
`scalerl compare` end to end on synthetic run directories."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats
from scipy.optimize import least_squares
from statsmodels.stats.weightstats import ttost_ind, ttost_paired

from analysis.compare import (ALPHA, A_NOT_IDENTIFIED, VERDICTS, compare_pair, difference, equivalence_p, paired_interval,
                              tail_values, verdict_of, welch_interval)
from analysis.findings import Claim
from analysis.scaling_law import A_IDENTIFIED_WIDTH, fit, loglinear_fit, predict, profile_A, sigmoid
from analysis.study import claim_verdict, judge_claim, summarize
from analysis.synthetic import write_run, write_sweep

# ----------------------------------------------------------------------------- references by hand


def _paired_ref(a, b, level=0.95):
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    n = d.size
    h = stats.t.ppf(0.5 + level / 2, n - 1) * np.std(d, ddof=1) / math.sqrt(n)
    return d.mean(), d.mean() - h, d.mean() + h


def _welch_df(a, b):
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    va, vb = np.var(x, ddof=1) / x.size, np.var(y, ddof=1) / y.size
    return (va + vb) ** 2 / (va ** 2 / (x.size - 1) + vb ** 2 / (y.size - 1)), math.sqrt(va + vb)


def _welch_ref(a, b, level=0.95):
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    df, se = _welch_df(x, y)
    h = stats.t.ppf(0.5 + level / 2, df) * se
    m = x.mean() - y.mean()
    return m, m - h, m + h


def _tost_ref(mean, se, df, delta):
    """max of the two one-sided p-values: H0 mean <= −δ (vs >), H0 mean >= δ (vs <)."""
    p_low = stats.t.sf((mean + delta) / se, df)
    p_high = stats.t.cdf((mean - delta) / se, df)
    return max(p_low, p_high)


def _samples(seed, n_a, n_b, shift=0.0, sd=0.03):
    rng = np.random.default_rng(seed)
    return rng.normal(0.5 + shift, sd, n_a), rng.normal(0.5, sd * 1.7, n_b)


# ----------------------------------------------------------------------------- 1. intervals and tests


@pytest.mark.parametrize("n", [2, 3, 5, 12])
@pytest.mark.parametrize("seed", [0, 1])
def test_paired_interval_is_the_t_interval_of_the_differences(n, seed):
    a, b = _samples(seed, n, n, shift=0.01)
    got = paired_interval(a, b)
    assert got == pytest.approx(_paired_ref(a, b), rel=1e-10, abs=1e-12)
    # the level is honoured
    assert paired_interval(a, b, level=0.9) == pytest.approx(_paired_ref(a, b, 0.9), rel=1e-10, abs=1e-12)


def test_paired_interval_edge_cases():
    # constant differences: a zero-width interval at the difference
    assert paired_interval([0.5, 0.6, 0.7], [0.4, 0.5, 0.6]) == pytest.approx((0.1, 0.1, 0.1))
    with pytest.raises(ValueError):
        paired_interval([0.5], [0.4])
    with pytest.raises(ValueError):
        paired_interval([0.5, 0.6, 0.7], [0.4, 0.5])


@pytest.mark.parametrize("n_a,n_b", [(2, 2), (3, 5), (6, 3), (10, 4)])
@pytest.mark.parametrize("seed", [0, 3])
def test_welch_interval_uses_the_welch_satterthwaite_df(n_a, n_b, seed):
    a, b = _samples(seed, n_a, n_b, shift=0.02)
    got = welch_interval(a, b)
    assert got == pytest.approx(_welch_ref(a, b), rel=1e-10, abs=1e-12)
    # and it is not the pooled (equal-variance) interval when the variances differ
    pooled = stats.ttest_ind(a, b, equal_var=True).confidence_interval(0.95)
    df, _ = _welch_df(a, b)
    if abs(df - (n_a + n_b - 2)) > 0.5:
        assert got[1] != pytest.approx(pooled.low, rel=1e-6)


def test_welch_interval_edge_cases():
    assert welch_interval([0.5, 0.5], [0.4, 0.4, 0.4]) == pytest.approx((0.1, 0.1, 0.1))
    with pytest.raises(ValueError):
        welch_interval([0.5], [0.4, 0.3])


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("delta", [0.02, 0.05])
def test_equivalence_p_paired_matches_statsmodels_and_a_hand_tost(seed, delta):
    rng = np.random.default_rng(seed)
    n = 3 + seed
    base = rng.normal(0.5, 0.1, n)  # a shared seed effect
    a, b = base + rng.normal(0.005 * seed, 0.01, n), base + rng.normal(0, 0.01, n)
    got = equivalence_p(a, b, delta, paired=True)
    sm = ttost_paired(a, b, -delta, delta)[0]
    d = a - b
    hand = _tost_ref(d.mean(), np.std(d, ddof=1) / math.sqrt(n), n - 1, delta)
    assert got == pytest.approx(sm, rel=1e-9, abs=1e-12)
    assert got == pytest.approx(hand, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("delta", [0.02, 0.05])
def test_equivalence_p_welch_matches_statsmodels_and_a_hand_tost(seed, delta):
    rng = np.random.default_rng(100 + seed)
    n_a, n_b = 3 + seed, 3 + (seed * 2) % 5
    a, b = rng.normal(0.5 + 0.003 * seed, 0.01, n_a), rng.normal(0.5, 0.02, n_b)
    got = equivalence_p(a, b, delta, paired=False)
    sm = ttost_ind(a, b, -delta, delta, usevar="unequal")[0]
    df, se = _welch_df(a, b)
    hand = _tost_ref(a.mean() - b.mean(), se, df, delta)
    assert got == pytest.approx(sm, rel=1e-9, abs=1e-12)
    assert got == pytest.approx(hand, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("paired", [True, False])
def test_equivalent_iff_the_printed_95_interval_is_inside_delta(paired):
    """One interval decides every verdict: `equivalent` exactly when the 95% interval printed beside
    it lies inside ±δ (TOST at 2.5% a side), checked on the reference intervals, paired and Welch."""
    rng = np.random.default_rng(7 + paired)
    seen = {True: 0, False: 0}
    for _ in range(400):
        n = int(rng.integers(3, 8))
        if paired:  # a shared seed effect, little run noise
            a = rng.normal(0.5, 0.05, n)
            b = a + rng.normal(rng.uniform(-0.02, 0.02), rng.uniform(0.002, 0.02), n)
        else:
            a = rng.normal(0.5, rng.uniform(0.002, 0.01), n)
            b = rng.normal(0.5 + rng.uniform(-0.02, 0.02), rng.uniform(0.002, 0.01), int(rng.integers(3, 8)))
        delta = 0.02
        _, lo, hi = _paired_ref(a, b, level=0.95) if paired else _welch_ref(a, b, level=0.95)
        inside = (-delta < lo) and (hi < delta)
        seen[inside] += 1
        assert (equivalence_p(a, b, delta, paired=paired) < ALPHA) == inside
        d = difference(dict(enumerate(a)), dict(enumerate(b)), pair=paired) if paired else \
            difference(dict(enumerate(a)), {f"b{i}": v for i, v in enumerate(b)})
        assert (d.low, d.high) == pytest.approx((lo, hi), abs=1e-12)
        if d.verdict == "equivalent":
            assert -delta < d.low and d.high < delta
        elif d.verdict == "inconclusive":
            assert d.low <= 0 <= d.high and not (-delta < d.low and d.high < delta)
    assert min(seen.values()) >= 40, seen  # both sides of the boundary are exercised


def test_equivalence_p_without_noise_is_the_difference_itself():
    assert equivalence_p([0.5, 0.6, 0.7], [0.49, 0.59, 0.69], 0.02, paired=True) == 0.0
    assert equivalence_p([0.5, 0.6, 0.7], [0.45, 0.55, 0.65], 0.02, paired=True) == 1.0


@pytest.mark.parametrize("low,high,p,want", [
    (0.001, 0.05, 0.9, "better"),
    (-0.05, -0.001, 0.9, "worse"),
    (0.0, 0.05, 0.9, "inconclusive"),  # touching 0 is not excluding it
    (-0.05, 0.0, 0.9, "inconclusive"),
    (-0.01, 0.01, 0.01, "equivalent"),
    (-0.01, 0.01, 0.025, "inconclusive"),  # p must be below alpha (2.5% a side)
    (-0.01, 0.01, 0.04, "inconclusive"),
    (-0.01, 0.01, 0.0249, "equivalent"),
    (0.0, 0.01, 0.01, "equivalent"),
    (-0.01, 0.01, math.nan, "inconclusive"),
    (math.nan, 0.01, 0.0, "inconclusive"),
    (-0.01, math.inf, 0.0, "inconclusive"),
    (0.001, 0.005, 0.001, "equivalent"),  # inside ±δ though it excludes 0: a real difference smaller than δ
    (0.001, 0.05, 0.9, "better"),  # excludes 0 and leaves ±δ
])
def test_verdict_of_boundaries(low, high, p, want):
    assert verdict_of(low, high, p) == want


def test_difference_pairs_by_seed_only_with_two_shared_seeds():
    a = {0: 0.60, 1: 0.70, 2: 0.65, 3: 0.50}
    b = {1: 0.68, 2: 0.62, 3: 0.49, 4: 0.90}
    d = difference(a, b)
    assert d.paired and d.n == 3 and (d.n_a, d.n_b) == (4, 4)
    x, y = [0.70, 0.65, 0.50], [0.68, 0.62, 0.49]
    assert (d.delta, d.low, d.high) == pytest.approx(_paired_ref(x, y), rel=1e-10)
    assert d.p_equivalent == pytest.approx(ttost_paired(np.array(x), np.array(y), -0.02, 0.02)[0], rel=1e-9)
    assert "paired" in d.method and "n=3" in d.method

    # one shared seed: Welch over every value
    a1, b1 = {0: 0.60, 1: 0.70, 2: 0.65}, {2: 0.60, 3: 0.52, 4: 0.58}
    d1 = difference(a1, b1)
    assert not d1.paired and d1.n == 6
    assert (d1.delta, d1.low, d1.high) == pytest.approx(_welch_ref(list(a1.values()), list(b1.values())), rel=1e-10)
    assert d1.p_equivalent == pytest.approx(
        ttost_ind(np.array(list(a1.values())), np.array(list(b1.values())), -0.02, 0.02, usevar="unequal")[0], rel=1e-9)

    # pair=False forces Welch even with shared seeds
    d2 = difference(a, b, pair=False)
    assert not d2.paired and d2.n == 8
    assert (d2.delta, d2.low, d2.high) == pytest.approx(_welch_ref(list(a.values()), list(b.values())), rel=1e-10)


def test_difference_drops_nan_and_none_before_pairing():
    a = {0: math.nan, 1: 0.70, 2: 0.65, 3: None}
    b = {0: 0.60, 1: 0.68, 2: 0.62, 3: 0.55}
    d = difference(a, b)  # only seeds 1 and 2 have both: paired n = 2
    assert d.paired and d.n == 2 and d.n_a == 2 and d.n_b == 4
    assert (d.delta, d.low, d.high) == pytest.approx(_paired_ref([0.70, 0.65], [0.68, 0.62]), rel=1e-10)
    assert all(math.isfinite(v) for v in (d.delta, d.low, d.high, d.p_equivalent))

    # NaN leaves one shared seed: Welch over the finite values
    d1 = difference({0: 0.7, 1: math.nan, 2: 0.6}, {0: 0.65, 1: 0.6, 3: 0.62})
    assert not d1.paired and d1.n == 5
    assert (d1.delta, d1.low, d1.high) == pytest.approx(_welch_ref([0.7, 0.6], [0.65, 0.6, 0.62]), rel=1e-10)


def test_difference_clips_to_bounds():
    a, b = {0: 1.0, 1: 0.0, 2: 1.0}, {0: 0.0, 1: 1.0, 2: 0.0}
    raw = difference(a, b)
    assert raw.low < -1 and raw.high > 1  # the t interval of n = 3 leaves the valid range
    d = difference(a, b, bounds=(-1.0, 1.0))
    assert (d.low, d.high) == (-1.0, 1.0) and d.delta == pytest.approx(raw.delta)
    assert d.verdict == "inconclusive"
    # a clipped side that is not outside the bound stays as it was
    c = difference({0: 0.9, 1: 0.95, 2: 0.92}, {0: 0.1, 1: 0.1, 2: 0.12}, bounds=(-1.0, 1.0))
    assert c.low == pytest.approx(_paired_ref([0.9, 0.95, 0.92], [0.1, 0.1, 0.12])[1]) and c.verdict == "better"


@pytest.mark.parametrize("a,b", [
    ({0: 0.5}, {0: 0.4, 1: 0.45}),
    ({0: 0.5, 1: math.nan}, {0: 0.4, 1: 0.45}),
    ({}, {0: 0.4, 1: 0.45}),
    ({0: 0.5}, {1: 0.3}),
])
def test_difference_with_too_few_runs_is_inconclusive(a, b):
    d = difference(a, b)
    assert d.verdict == "inconclusive" and not math.isfinite(d.low) and not math.isfinite(d.high)
    assert "too few" in d.reason


# ----------------------------------------------------------------------------- 2. known-truth sweeps


REPS = 500
SEEDS3 = (0, 1, 2)


def _rates(make, reps=REPS, **kw):
    counts = dict.fromkeys(VERDICTS, 0)
    for r in range(reps):
        a, b = make(r)
        counts[difference(a, b, **kw).verdict] += 1
    return {k: v / reps for k, v in counts.items()}


def test_equal_configs_with_large_independent_noise_are_never_equivalent():
    rng = np.random.default_rng(30)

    def make(_):
        return ({s: 0.6 + rng.normal(0, 0.05) for s in SEEDS3}, {s: 0.6 + rng.normal(0, 0.05) for s in SEEDS3})

    rates = _rates(make, equivalence=0.02)
    assert rates["equivalent"] <= 0.05  # the TOST's size
    assert rates["equivalent"] <= 0.01  # and in fact essentially never
    # same data, unpaired: still never equivalent
    assert _rates(make, equivalence=0.02, pair=False)["equivalent"] <= 0.01


def test_tost_size_at_the_margin():
    """True difference exactly δ: `equivalent` at most ~2.5% of the time (each one-sided test's level)."""
    rng = np.random.default_rng(31)

    def make(_):
        seed = rng.normal(0, 0.1, 5)
        return ({s: 0.6 + 0.02 + seed[s] + rng.normal(0, 0.01) for s in range(5)},
                {s: 0.6 + seed[s] + rng.normal(0, 0.01) for s in range(5)})

    rates = _rates(make, reps=800, equivalence=0.02)
    assert rates["equivalent"] <= ALPHA + 3 * math.sqrt(ALPHA * (1 - ALPHA) / 800)
    assert rates["equivalent"] >= 0.005  # the test is exact at the margin: not far below its level either


def _shared_seed(rng, diff, run_sd, seed_sd=0.1, seeds=SEEDS3, keys_b=None):
    effect = {s: rng.normal(0, seed_sd) for s in seeds}
    a = {s: 0.6 + diff + effect[s] + rng.normal(0, run_sd) for s in seeds}
    b = {s: 0.6 + effect[s] + rng.normal(0, run_sd) for s in seeds}
    if keys_b is not None:
        b = {k: v for k, v in zip(keys_b, b.values())}
    return a, b


def test_equal_configs_with_a_shared_seed_effect_are_equivalent_only_when_paired():
    rng = np.random.default_rng(32)
    paired = _rates(lambda _: _shared_seed(rng, 0.0, 0.002))
    assert paired["equivalent"] >= 0.9
    assert paired["better"] + paired["worse"] <= 0.09
    unpaired = _rates(lambda _: _shared_seed(rng, 0.0, 0.002), pair=False)
    assert unpaired["equivalent"] <= 0.01
    other_keys = _rates(lambda _: _shared_seed(rng, 0.0, 0.002, keys_b=("x", "y", "z")))
    assert other_keys["equivalent"] <= 0.01
    d = difference(*_shared_seed(rng, 0.0, 0.002, keys_b=("x", "y", "z")))
    assert not d.paired and d.n == 6


def test_a_real_difference_with_paired_seeds_is_better():
    rng = np.random.default_rng(33)
    rates = _rates(lambda _: _shared_seed(rng, 0.05, 0.005))
    assert rates["better"] >= 0.9
    assert rates["worse"] == 0.0 and rates["equivalent"] == 0.0
    # and the other way round it is worse
    rng2 = np.random.default_rng(34)
    rev = _rates(lambda _: tuple(reversed(_shared_seed(rng2, 0.05, 0.005))))
    assert rev["worse"] >= 0.9 and rev["better"] == 0.0


@pytest.mark.parametrize("pair", [True, False])
def test_false_better_or_worse_rate_of_equal_configs_is_near_5_percent(pair):
    rng = np.random.default_rng(35 + pair)
    rates = _rates(lambda _: _shared_seed(rng, 0.0, 0.02, seed_sd=0.05), reps=1000, pair=pair)
    false = rates["better"] + rates["worse"]
    assert false <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 1000)
    if pair:  # the paired t interval is exact: not far below 5% either
        assert false >= 0.05 - 3 * math.sqrt(0.05 * 0.95 / 1000)


# ----------------------------------------------------------------------------- 3. the profile interval of A


def _curve(A, top, noise, seed, n=41, B=1.8, C_mid=1.0, R0=0.1):
    rng = np.random.default_rng(seed)
    c = np.linspace(0.0, top, n)
    r = sigmoid(c, A, B, C_mid, R0) + np.r_[0.0, rng.normal(0, noise, n - 1)]
    return c, np.clip(r, 0.0, 1.0)


def _in_unit(p):
    return 0.0 <= p.low <= p.high <= 1.0 and p.cap <= 1.0


def test_a_saturated_run_is_identified_and_its_interval_covers_the_true_A():
    """Compute to 30× C_mid, evaluation noise 0.01 (41 points): identified, and the 95% profile
    interval contains the true A = 0.6 in the large majority of 20 noise draws. (A profile by
    scipy least_squares on a fine A grid covers it in 17 of these 20 draws.)"""
    covered = 0
    seeds = range(20)
    for s in seeds:
        f = fit(*_curve(0.6, 30.0, 0.01, s))
        p = profile_A(f)
        assert p.identified and p.width <= A_IDENTIFIED_WIDTH and _in_unit(p)
        assert abs(f.A - 0.6) < 0.02
        covered += p.low <= 0.6 <= p.high
    assert covered >= 15, f"the 95% profile interval of A contains the true A in only {covered} of {len(seeds)} runs"


def _reference_profile(c, r, R0, level=0.95, half=0.02, m=161):
    """A profile interval by scipy least_squares (B, ln C_mid free) on a fine A grid."""
    def res(th, A):
        return sigmoid(c, A, th[0], math.exp(th[1]), R0) - r

    full = least_squares(lambda th: res(th[1:], th[0]), [0.6, 1.5, 0.0])
    n = c.size
    thr = 2 * full.cost * (1 + stats.f.ppf(level, 1, n - 3) / (n - 3))
    inside, x0 = [], full.x[1:]
    for A in np.linspace(full.x[0] - half, full.x[0] + half, m):
        pr = least_squares(lambda th: res(th, A), x0)
        if 2 * pr.cost <= thr:
            inside.append(A)
    return min(inside), max(inside)


@pytest.mark.parametrize("seed", [0, 1])
def test_profile_interval_of_A_is_not_narrower_than_an_independent_profile(seed):
    """Against a profile by scipy.optimize.least_squares: the interval may be wider by a grid
    step (conservative), not narrower by more than 0.001 (anti-conservative)."""
    c, r = _curve(0.6, 30.0, 0.01, seed)
    p = profile_A(fit(c, r))
    lo, hi = _reference_profile(c, r, float(r[0]))
    assert p.low <= lo + 0.001 and p.high >= hi - 0.001, (p.low, p.high, lo, hi)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_run_stopped_far_below_C_mid_is_not_identified(seed):
    f = fit(*_curve(0.6, 0.1, 0.005, seed))  # compute up to C_mid / 10
    p = profile_A(f)
    assert not p.identified and p.width > A_IDENTIFIED_WIDTH
    assert _in_unit(p)
    assert "not identified" in p.describe()


def test_profile_interval_stays_inside_0_1_for_pass_rates():
    for top, noise, A in [(30.0, 0.005, 0.6), (0.1, 0.005, 0.6), (1.0, 0.03, 0.9), (3.0, 0.05, 0.95), (0.3, 0.02, 0.99)]:
        for s in range(2):
            p = profile_A(fit(*_curve(A, top, noise, s)))
            assert _in_unit(p), (top, noise, A, p.low, p.high)
            assert p.low <= p.high


def test_a_curve_saturating_near_1_is_narrow_but_not_identified_at_the_cap():
    """DESIGN.md: an interval that reaches the cap is bounded there by the cap, not by the data, so
    A is not identified however narrow the interval (the `tail` metric decides such a pair)."""
    at_cap = 0
    for s in range(20):
        p = profile_A(fit(*_curve(0.99, 30.0, 0.03, s)))
        assert _in_unit(p) and p.high <= 1.0
        at_cap += p.at_cap
        if p.at_cap:
            assert p.high == pytest.approx(1.0) and not p.identified and "reaches the cap" in p.describe()
        else:
            assert p.identified == (p.width <= A_IDENTIFIED_WIDTH and not p.at_floor)
    assert at_cap >= 1  # the case exercised: an interval that ends at the cap


# ----------------------------------------------------------------------------- 4. predict


def test_predict_baseline_is_polyfit_on_the_points_the_fit_used():
    c, r = _curve(0.6, 4.0, 0.01, 1)
    pr = predict(c, r, fraction=0.5, n_boot=40, seed=3, min_compute=0.3)
    used_c, used_r = pr.fit.compute, pr.fit.reward
    assert used_c.min() >= 0.3 and used_c.max() <= 2.0 + 1e-12 and pr.fit.n_points == used_c.size
    slope, intercept = np.polyfit(np.log(used_c), used_r, 1)
    want = intercept + slope * math.log(c[-1])
    assert pr.baseline_final == pytest.approx(want, rel=1e-9)
    assert pr.baseline_error == pytest.approx(want - r[-1], rel=1e-9, abs=1e-12)
    assert loglinear_fit(used_c, used_r) == pytest.approx((intercept, slope), rel=1e-9)
    # not the baseline over every point before the cutoff (min_compute excluded some)
    head = (c > 0) & (c <= 2.0)
    s_all, i_all = np.polyfit(np.log(c[head]), r[head], 1)
    assert abs((i_all + s_all * math.log(c[-1])) - want) > 1e-6
    # the interval holds the prediction and stays a pass rate
    assert 0.0 <= pr.low <= pr.predicted_final <= pr.high <= 1.0
    assert pr.covered == (pr.low <= pr.observed_final <= pr.high)


def test_predict_on_loglinear_data_the_baseline_is_exact():
    c = np.geomspace(0.01, 1.0, 30)
    r = 0.5 + 0.05 * np.log(c)
    pr = predict(c, r, fraction=0.5, n_boot=20)
    assert abs(pr.baseline_error) < 1e-9
    assert pr.baseline_final == pytest.approx(r[-1], abs=1e-9)
    assert pr.low <= pr.predicted_final <= pr.high


def test_predict_without_n_boot_has_no_interval():
    c, r = _curve(0.6, 4.0, 0.01, 2)
    pr = predict(c, r)
    assert math.isnan(pr.low) and math.isnan(pr.high) and pr.covered is None


# ----------------------------------------------------------------------------- tail, pairs, claims (unit)


def test_tail_is_the_mean_over_the_last_20_percent_of_the_common_window():
    c1 = np.linspace(0, 10, 11)
    c2 = np.linspace(0, 8, 9)
    r1, r2 = c1 / 10.0, 0.5 + 0 * c2
    t = tail_values({"a": (c1, r1), "b": (c2, r2)})
    # window ends at 8 (the smaller final compute); a's points in [6.4, 8] are 7 and 8
    assert t["a"] == pytest.approx(0.75) and t["b"] == pytest.approx(0.5)


def test_a_tail_between_sparse_evaluations_is_the_log_compute_interpolation():
    """No evaluation inside the last 20%: the curve linear in log compute at the window's midpoint,
    written out here with np.interp (float64)."""
    c = np.array([0.0, 1.0, 3.0, 9.0, 20.0])
    r = np.array([0.1, 0.2, 0.35, 0.5, 0.6])
    t = tail_values({"a": (c, r)}, end=10.0)
    assert t["a"] == pytest.approx(float(np.interp(np.log(9.0), np.log(c[1:]), r[1:])), abs=1e-15)  # mid = 9
    t = tail_values({"a": (c, r)}, end=12.0)  # mid 10.8, between 9 and 20
    assert t["a"] == pytest.approx(float(np.interp(np.log(10.8), np.log(c[1:]), r[1:])), abs=1e-15)


def test_tail_sampling_sd_is_the_sd_that_binomial_evaluations_give_the_tail():
    """Known truth: every held-out prompt passes with the curve's p, each evaluation draws
    prompts·k samples afresh; the sd of the tail over 4,000 replicas matches the bound (which is
    exact when every prompt has the same p), inside the window and between sparse evaluations."""
    from analysis.compare import tail_sampling_sd

    rng = np.random.default_rng(7)
    prompts, k = 200, 4
    for c in (np.linspace(0.0, 10.0, 11), np.array([0.0, 1.0, 3.0, 7.0, 20.0])):
        p = 0.2 + 0.5 * c / c.max()  # [n]
        v = p * (1 - p) / (prompts * k)  # [n]
        end = 10.0
        bound = tail_sampling_sd({"a": (c, v)}, end)["a"]
        draws = rng.binomial(prompts * k, p, size=(4000, c.size)) / (prompts * k)  # [R, n]
        tails = [tail_values({"a": (c, d)}, end)["a"] for d in draws]
        assert np.std(tails, ddof=1) == pytest.approx(bound, rel=0.06)
    assert math.isnan(tail_sampling_sd({"a": (c, np.full(c.size, np.nan))}, 10.0)["a"])  # prompts / k not logged
    assert math.isnan(tail_sampling_sd({"a": (c[:-1], v[:-1])}, 10.0)["a"])  # stops before the window's end


def test_the_report_says_how_much_of_the_paired_sd_evaluation_sampling_can_be(tmp_path):
    """Synthetic runs (analysis.synthetic logs prompts and k): the runs table carries
    tail_sampling_sd, equal to the binomial bound of the run's own tail evaluations, and the report
    states its share of the paired sd."""
    from analysis.runs import load_runs, run_sampling_variance
    from experiments.study_report import _can_tell_text

    write_sweep(tmp_path, "loss_type", "train.loss", {"cispo": (0.6, 1.8, 1.0), "gspo": (0.6, 1.8, 1.0)},
                seeds=SEEDS3, noise=0.03, final_compute=10.0, **RUN_KW)
    sm = summarize(tmp_path)["loss_type"]
    ev = load_runs(tmp_path)
    row = sm.runs.iloc[0]
    g = ev[ev["path"] == row["path"]]
    assert {"prompts", "k"} <= set(g.columns)
    c, v = run_sampling_variance(g, sm.compute)
    inside = (c >= 0.8 * sm.tail_end * (1 - 1e-12)) & (c <= sm.tail_end * (1 + 1e-12))
    assert row["tail_sampling_sd"] == pytest.approx(math.sqrt(v[inside].sum()) / inside.sum())
    text = "\n".join(_can_tell_text(sm.runs, pd.DataFrame(columns=["metric", "verdict"]), {"loss_type": sm}))
    assert "evaluation sampling gives at most" in text and "of the variance of a per-seed difference" in text


def _pair_table(A_a, A_b, ident_a=True, ident_b=True):
    rows = [{"config": "x", "seed": s, "A": v, "A_identified": ident_a, "tail": v} for s, v in enumerate(A_a)]
    rows += [{"config": "y", "seed": s, "A": v, "A_identified": ident_b, "tail": v} for s, v in enumerate(A_b)]
    return pd.DataFrame(rows)


def test_an_A_comparison_with_an_unidentified_run_is_inconclusive():
    runs = _pair_table([0.70, 0.71, 0.72], [0.60, 0.605, 0.61])
    assert compare_pair(runs, "s", "x", "y", "A").verdict == "better"
    runs.loc[4, "A_identified"] = False  # one run of y
    p = compare_pair(runs, "s", "x", "y", "A")
    assert p.verdict == "inconclusive" and not p.identified and p.reason == A_NOT_IDENTIFIED
    assert p.diff.verdict == "better"  # the numbers alone would say better
    t = compare_pair(runs, "s", "x", "y", "tail")  # tail needs no identification
    assert t.verdict == "better" and t.identified


@pytest.mark.parametrize("kind,pair,want", [
    ("same_A", "equivalent", "agree"), ("same_A", "inconclusive", "inconclusive"),
    ("same_A", "better", "disagree"), ("same_A", "worse", "disagree"),
    ("a_higher_A", "better", "agree"), ("a_higher_A", "worse", "disagree"),
    ("a_higher_A", "equivalent", "not reproduced"), ("a_higher_A", "inconclusive", "inconclusive"),
    ("a_not_worse", "better", "agree"), ("a_not_worse", "equivalent", "agree"),
    ("a_not_worse", "worse", "disagree"), ("a_not_worse", "inconclusive", "inconclusive"),
    ("a_better", "better", "agree"), ("a_better", "worse", "disagree"), ("a_better", "inconclusive", "inconclusive"),
    ("a_better", "equivalent", "not reproduced"),
])
def test_claim_verdicts_from_pair_verdicts(kind, pair, want):
    assert claim_verdict(kind, pair) == want


def test_judge_claim_on_unidentified_A_is_inconclusive():
    runs = _pair_table([0.6, 0.6, 0.6], [0.6, 0.6, 0.6], ident_a=False)
    p = compare_pair(runs, "s", "x", "y", "A")
    v, why = judge_claim(Claim("same_A", "x", "y"), p)
    assert v == "inconclusive" and why == A_NOT_IDENTIFIED


# ----------------------------------------------------------------------------- 5. end to end


RUN_KW = dict(steps=60, eval_every=3, device="cpu", count=2)
KEYS = {"sweep", "a", "b", "metric", "delta", "low", "high", "n", "paired", "identified", "verdict"}


def _short_sweep(root, sweep="my_loss"):
    """Runs stopped at C_mid / 10: nothing about A can be told."""
    write_sweep(root, sweep, "train.loss", {"mine": (0.6, 1.8, 1.0), "base": (0.7, 1.8, 1.0), "other": (0.5, 1.8, 1.0)},
                seeds=SEEDS3, noise=0.005, final_compute=0.1, **RUN_KW)


def test_runs_stopped_far_below_C_mid_give_inconclusive_A(tmp_path):
    _short_sweep(tmp_path)
    s = summarize(tmp_path)["my_loss"]
    assert len(s.runs) == 9 and not s.runs["A_identified"].fillna(False).any()
    a_pairs = [p for p in s.pairs if p.metric == "A"]
    assert len(a_pairs) == 3
    for p in a_pairs:
        assert p.verdict == "inconclusive" and not p.identified and p.reason == A_NOT_IDENTIFIED


def _compare_json(capsys, *argv):
    from experiments.cli import main

    rc = main(["compare", *map(str, argv), "--json"])
    out = capsys.readouterr().out
    return rc, json.loads(out)


def test_scalerl_compare_json(tmp_path, capsys):
    _short_sweep(tmp_path)
    write_sweep(tmp_path, "loss_type", "train.loss", {"cispo": (0.6, 1.8, 1.0), "gspo": (0.6, 1.8, 1.0)},
                seeds=SEEDS3, noise=0.01, final_compute=10.0, **RUN_KW)
    rc, rows = _compare_json(capsys, tmp_path)
    assert rc == 0 and isinstance(rows, list)
    assert len(rows) == (3 + 1) * 3  # pairs × metrics (A, tail, auc)
    for row in rows:
        assert KEYS <= set(row), KEYS - set(row)
        assert row["verdict"] in VERDICTS and row["metric"] in ("A", "tail", "auc")
        assert row["sweep"] in ("my_loss", "loss_type") and row["a"] != row["b"]
        assert isinstance(row["paired"], bool) and isinstance(row["identified"], bool) and isinstance(row["n"], int)
        assert row["paired"] and row["n"] == 3  # every configuration has seeds 0, 1, 2
        if row["low"] is not None:
            assert -1.0 <= row["low"] <= row["delta"] <= row["high"] <= 1.0
        if row["metric"] == "A" and row["sweep"] == "my_loss":
            assert row["verdict"] == "inconclusive" and row["identified"] is False
        if row["metric"] in ("tail", "auc"):
            assert row["identified"] is True
    assert {(r["sweep"], r["metric"]) for r in rows} == {(s, m) for s in ("my_loss", "loss_type")
                                                         for m in ("A", "tail", "auc")}

    rc, tail_rows = _compare_json(capsys, tmp_path, "--metric", "tail")
    assert rc == 0 and len(tail_rows) == 4 and {r["metric"] for r in tail_rows} == {"tail"}
    by = lambda rs: {(r["sweep"], r["a"], r["b"]): r for r in rs}  # noqa: E731
    full = by(r for r in rows if r["metric"] == "tail")
    for k, r in by(tail_rows).items():
        assert r == full[k]
    rc, a_rows = _compare_json(capsys, tmp_path, "--metric", "A")
    assert rc == 0 and len(a_rows) == 4 and {r["metric"] for r in a_rows} == {"A"}
    rc, auc_rows = _compare_json(capsys, tmp_path, "--metric", "auc")
    assert rc == 0 and len(auc_rows) == 4 and {r["metric"] for r in auc_rows} == {"auc"}
    assert by(auc_rows) == by(r for r in rows if r["metric"] == "auc")
    rc, both = _compare_json(capsys, tmp_path, "--metric", "both")
    assert rc == 0 and {r["metric"] for r in both} == {"A", "tail"}


def test_scalerl_compare_table_says_when_a_sweep_has_nothing_to_compare(tmp_path, capsys):
    from experiments.cli import main

    write_sweep(tmp_path, "loss_type", "train.loss", {"cispo": (0.6, 1.8, 1.0), "gspo": (0.6, 1.8, 1.0)},
                seeds=SEEDS3, noise=0.01, final_compute=10.0, **RUN_KW)
    write_sweep(tmp_path, "off_policy", "train.off_policy", {"ppo_off_policy-k1": (0.6, 1.8, 1.0)},
                seeds=SEEDS3, noise=0.01, final_compute=10.0, **RUN_KW)
    capsys.readouterr()
    assert main(["compare", str(tmp_path), "--metric", "tail"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "off_policy: nothing to compare (1 configuration(s) with runs: ppo_off_policy-k1)" in out
    assert "loss_type: a − b on" in out and "equivalent = the interval inside ±0.02" in out


def test_scalerl_compare_rejects_a_bad_equivalence(tmp_path, capsys):
    from experiments.cli import main

    _short_sweep(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["compare", str(tmp_path), "--json", "--equivalence", "-1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "-1" in err and "equivalence" in err


@pytest.mark.parametrize("seeds", [(0, 1, 2), (3, 4, 5)])
def test_a_same_A_claim_with_noisy_tails_is_inconclusive_not_agree(tmp_path, seeds):
    """cispo ≈ gspo (loss_type's same_A claim), equal laws, evaluation noise 0.08: the tails
    differ by noise far larger than δ = 0.02, so the claim cannot agree on tail."""
    write_sweep(tmp_path, "loss_type", "train.loss", {"cispo": (0.6, 1.8, 1.0), "gspo": (0.6, 1.8, 1.0)},
                seeds=seeds, noise=0.08, final_compute=10.0, **RUN_KW)
    s = summarize(tmp_path)["loss_type"]
    claims = s.claims.set_index("kind")
    row = claims.loc["same_A"]
    assert {row["config_a"], row["config_b"]} == {"cispo", "gspo"}
    assert row["verdict_tail"] == "inconclusive", row["ours_tail"]
    assert row["verdict_A"] != "agree", row["ours_A"]
    assert row["low_tail"] < -0.02 or row["high_tail"] > 0.02  # the interval leaves ±δ
    assert row["paired_tail"] and row["n_tail"] == 3


def test_scalerl_fit_writes_its_tables_next_to_the_runs_and_predicts_with_an_interval(tmp_path, monkeypatch, capsys):
    """`scalerl fit RUNS` writes fits*.csv into RUNS (never the current directory); `--fraction`
    adds the sigmoid's bootstrap prediction interval beside the log-linear baseline."""
    from experiments.cli import main

    write_sweep(tmp_path / "r", "loss_type", "train.loss", {"cispo": (0.6, 1.8, 1.0), "gspo": (0.6, 1.8, 1.0)},
                seeds=SEEDS3, noise=0.01, final_compute=10.0, **RUN_KW)
    work = tmp_path / "elsewhere"
    work.mkdir()
    monkeypatch.chdir(work)
    sweep = tmp_path / "r" / "loss_type"
    assert main(["fit", str(sweep), "--fraction", "0.5", "--predict-boot", "20"]) == 0
    assert not list(work.iterdir())
    for stem in ("fits", "fits_configs", "fits_claims", "fits_pairs"):
        assert (sweep / f"{stem}.csv").is_file(), stem
    runs = pd.read_csv(sweep / "fits.csv")
    assert {"baseline_final", "predicted_low", "predicted_high", "covered", "A_identified", "tail"} <= set(runs.columns)
    ok = runs.dropna(subset=["predicted_low"])
    assert len(ok) == 6 and (ok["predicted_low"] <= ok["predicted_high"]).all()
    assert ok["predicted_low"].between(0, 1).all() and ok["predicted_high"].between(0, 1).all()
    assert main(["fit", str(sweep), "--predict-boot", "-1"]) == 2
    capsys.readouterr()


def test_runs_without_seeds_are_never_paired_and_a_duplicate_seed_is_an_error():
    rows = pd.DataFrame({"config": ["a"] * 3 + ["b"] * 3, "seed": [None] * 6, "path": [f"p{i}" for i in range(6)],
                         "tail": [0.5, 0.6, 0.7, 0.51, 0.61, 0.71]})
    pair = compare_pair(rows, "s", "a", "b", "tail")
    assert not pair.diff.paired and pair.diff.n == 6 and pair.verdict == "inconclusive"
    dup = rows.assign(seed=[0, 0, 1, 0, 1, 2])
    with pytest.raises(ValueError, match="two runs with seed 0"):
        compare_pair(dup, "s", "a", "b", "tail")


def test_a_run_that_stops_before_the_window_has_no_tail():
    from analysis.compare import tail_values

    c = np.linspace(1, 10, 10)
    out = tail_values({"done": (c, np.full(10, 0.8)), "short": (c[:9] - 0.5, np.full(9, 0.7))}, end=10.0)
    assert out["done"] == pytest.approx(0.8) and math.isnan(out["short"])


def test_compare_json_objects_carry_exactly_the_contract_fields(tmp_path, capsys):
    from experiments.cli import main

    write_sweep(tmp_path, "loss_type", "train.loss", {"cispo": (0.6, 1.8, 1.0), "gspo": (0.6, 1.8, 1.0)},
                seeds=SEEDS3, noise=0.01, final_compute=10.0, **RUN_KW)
    assert main(["compare", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and all(set(r) == {"sweep", "a", "b", "metric", "delta", "low", "high", "n", "paired", "identified",
                                   "verdict"} for r in rows)


def _fp32_head_sweep(root, gaps: dict, gap_noise: float = 0.0002):
    """The fp32_head sweep, 3 seeds, a clear A difference (0.70 vs 0.50) and, per configuration, a
    mean trainer-vs-generator log-prob gap logged on every step (plus a little per-seed noise)."""
    rng = np.random.default_rng(7)
    for value, law in {"bf16_fp32_head": (0.70, 1.8, 1.0), "bf16": (0.50, 1.8, 1.0)}.items():
        for seed in SEEDS3:
            write_run(root, "fp32_head", f"{value}-s{seed}", A=law[0], B=law[1], C_mid=law[2], factor="train.precision",
                      value=value, seed=seed, noise=0.005, final_compute=10.0,
                      metrics_extra={"logprob_gap_mean": gaps[value] + float(rng.normal(0, gap_noise))}, **RUN_KW)


def test_a_claim_whose_mechanism_cannot_act_is_not_testable_instead_of_judged(tmp_path):
    """fp32_head at a scale where the log-prob gap the FP32 head shrinks is as small without it
    (0.0046 both, as measured on this CPU): its claim reads `not testable` on both metrics, with the
    measurement, even though A and tail differ clearly; with a gap the head does remove (0.05 -> 0.01)
    the same runs are judged (agree: A 0.70 > 0.50)."""
    from analysis.findings import FINDINGS
    from analysis.study import NOT_TESTABLE, mechanism_check

    idle, acting = tmp_path / "idle", tmp_path / "acting"
    _fp32_head_sweep(idle, {"bf16_fp32_head": 0.0046, "bf16": 0.0046})
    _fp32_head_sweep(acting, {"bf16_fp32_head": 0.01, "bf16": 0.05})

    row = summarize(idle)["fp32_head"].claims.iloc[0]
    assert row["verdict_A"] == NOT_TESTABLE and row["verdict_tail"] == NOT_TESTABLE
    assert "not testable at this scale" in row["ours_tail"] and "0.0046" in row["ours_tail"]
    assert "paired by seed, n=3" in row["mechanism"]

    s = summarize(acting)["fp32_head"]
    row = s.claims.iloc[0]
    assert row["verdict_tail"] == "agree" and row["delta_tail"] > 0.1, row["ours_tail"]
    acts, evidence = mechanism_check(FINDINGS["fp32_head"].mechanism, s.runs)
    assert acts is True and "removes +0.0398" in evidence, evidence


def test_mechanism_check_without_the_metric_leaves_the_claims_judged(tmp_path):
    """Runs that never logged the gap (older runs): nothing is known about the mechanism, so the claim
    is judged as usual, never `not testable`."""
    from analysis.findings import FINDINGS
    from analysis.study import mechanism_check

    write_sweep(tmp_path, "fp32_head", "train.precision", {"bf16_fp32_head": (0.70, 1.8, 1.0), "bf16": (0.50, 1.8, 1.0)},
                seeds=SEEDS3, noise=0.005, final_compute=10.0, **RUN_KW)
    s = summarize(tmp_path)["fp32_head"]
    assert mechanism_check(FINDINGS["fp32_head"].mechanism, s.runs) == (None, "logprob_gap not logged by these runs")
    assert s.claims.iloc[0]["verdict_tail"] == "agree"


def test_auc_names_an_empty_common_window():
    """A configuration whose whole run costs less than the other's first evaluation interval leaves no
    common window: auc says so (not 'too few runs'); tail, measured at the shorter run's end, is judged."""
    import pandas as pd

    from analysis.compare import compare_pair

    runs = pd.DataFrame({"config": ["tool"] * 3 + ["none"] * 3, "seed": [0, 1, 2] * 2,
                         "tail": [0.40, 0.38, 0.39, 0.0, 0.0, 0.0], "auc": [float("nan")] * 6,
                         "A": [float("nan")] * 6, "window_start": 7.6e11, "tail_end": 7.5e11})
    auc = compare_pair(runs, "tool_use", "tool", "none", "auc")
    assert auc.verdict == "inconclusive" and auc.reason.startswith("no common window: the latest first evaluation (7.6e+11)")
    assert compare_pair(runs, "tool_use", "tool", "none", "tail").verdict == "better"
    runs["window_start"] = 1e11  # a window exists: the usual reason stays
    assert compare_pair(runs, "tool_use", "tool", "none", "auc").reason.startswith("too few runs")


# ----------------------------------------------------------------------------- seeds to decide


def _simulated_decided(delta, sd, n, sd_b=None, reps=6000, seed=0):
    """(P(decided), P(equivalent), P(better), P(worse)) of the 95% interval at n seeds by Monte Carlo:
    per-seed differences N(delta, sd²) (paired), or n runs a side with sds sd, sd_b (Welch's interval
    with its sample Welch-Satterthwaite df), judged by the rule written out here."""
    rng = np.random.default_rng(seed)
    if sd_b is None:
        d = delta + sd * rng.standard_normal((reps, n))  # [R, n]
        m, s = d.mean(1), d.std(1, ddof=1)  # [R]
        h = stats.t.ppf(0.975, n - 1) * s / math.sqrt(n)
    else:
        a = delta + sd * rng.standard_normal((reps, n))  # [R, n]
        b = sd_b * rng.standard_normal((reps, n))  # [R, n]
        va, vb = a.var(1, ddof=1) / n, b.var(1, ddof=1) / n  # [R]
        df = (va + vb) ** 2 / (va ** 2 / (n - 1) + vb ** 2 / (n - 1))
        m, h = a.mean(1) - b.mean(1), stats.t.ppf(0.975, df) * np.sqrt(va + vb)
    equal = (m - h > -0.02) & (m + h < 0.02)
    better, worse = ~equal & (m - h > 0), ~equal & (m + h < 0)
    return (equal | better | worse).mean(), equal.mean(), better.mean(), worse.mean()


@pytest.mark.parametrize("delta,sd,sd_b,n", [
    (0.0, 0.03, None, 4), (0.0, 0.03, None, 12), (0.01, 0.02, None, 6), (0.03, 0.05, None, 9), (-0.05, 0.04, None, 3),
    (0.0, 0.02, 0.03, 8), (0.04, 0.03, 0.01, 5),
])
def test_decided_probability_matches_a_simulation_of_the_verdict_rule(delta, sd, sd_b, n):
    from analysis.compare import decided_probability

    p = float(decided_probability(delta, sd, np.array([n]), sd_b=sd_b)[0])
    sim = _simulated_decided(delta, sd, n, sd_b=sd_b)[0]
    tol = 0.02  # Welch too: the projection uses the true sds' df, a real interval its sample's
    assert abs(p - sim) < tol, (p, sim)


def test_decided_probability_through_difference_itself():
    """The same chance, read off `difference` (statsmodels' TOST and scipy's interval), on fewer replicas."""
    from analysis.compare import decided_probability

    rng = np.random.default_rng(3)
    n, delta, sd = 6, 0.01, 0.02
    hits = 0
    for r in range(200):
        base = rng.uniform(0.3, 0.6, n)
        d = delta + sd * rng.standard_normal(n)
        hits += difference(dict(enumerate(base + d)), dict(enumerate(base))).verdict != "inconclusive"
    p = float(decided_probability(delta, sd, np.array([n]))[0])
    assert abs(hits / 200 - p) < 0.08, (hits / 200, p)


@pytest.mark.parametrize("delta,sd,sd_b", [(0.0, 0.03, None), (0.004, 0.02, None), (0.03, 0.04, None),
                                           (-0.05, 0.05, None), (0.0, 0.02, 0.03), (0.05, 0.03, 0.01),
                                           (0.01, 0.005, None), (0.01, 0.01, None), (-0.01, 0.02, None)])
def test_seeds_to_decide_is_the_first_n_with_an_80_percent_chance_of_a_verdict(delta, sd, sd_b):
    """Known truth by simulation: at the n it names, real samples from the measured mean and sd are
    decided about 80% of the time, at n − 1 less often; the verdict it names is the commonest one."""
    from analysis.compare import SEEDS_POWER, seeds_to_decide

    n, projected = seeds_to_decide(delta, sd, sd_b=sd_b)
    assert n is not None and n >= 3, n
    at = _simulated_decided(delta, sd, n, sd_b=sd_b, seed=1)
    before = _simulated_decided(delta, sd, n - 1, sd_b=sd_b, seed=2)
    tol = 0.025 if sd_b is None else 0.045
    assert at[0] > SEEDS_POWER - tol and before[0] < SEEDS_POWER + tol, (n, at, before)
    commonest = ("equivalent", "better", "worse")[int(np.argmax(at[1:]))]
    assert projected == commonest, (projected, at)


def test_seeds_to_decide_limits_and_bad_input():
    from analysis.compare import SEEDS_LIMIT, seeds_to_decide

    assert seeds_to_decide(0.0, 0.0, start=2) == (2, "equivalent")  # no noise: decided at once
    assert seeds_to_decide(0.05, 0.0, start=3) == (3, "better")
    assert seeds_to_decide(0.019, 0.5) == (None, "inconclusive")  # needs far more than SEEDS_LIMIT
    assert seeds_to_decide(0.019, 0.5, limit=10 * SEEDS_LIMIT)[0] is None
    assert seeds_to_decide(math.nan, 0.1) == (None, "inconclusive")
    assert seeds_to_decide(0.1, math.nan) == (None, "inconclusive")
    n5, _ = seeds_to_decide(0.0, 0.03, start=5)
    assert n5 == seeds_to_decide(0.0, 0.03, start=2)[0]  # start only skips the smaller n


def test_a_pair_row_carries_its_seeds_to_decide_and_an_unidentified_A_none():
    runs = _pair_table([0.70, 0.74, 0.69, 0.72], [0.71, 0.70, 0.72, 0.69])
    t = compare_pair(runs, "s", "x", "y", "tail")
    assert t.verdict == "inconclusive"
    row = t.as_row()
    assert row["seeds_to_decide"] == t.diff.seeds_to_decide and row["seeds_to_decide"] > 4
    assert row["projected"] in ("better", "worse", "equivalent")
    assert t.seeds_text() == f"~{row['seeds_to_decide']} ({row['projected']})"
    decided = compare_pair(_pair_table([0.70, 0.71, 0.72], [0.60, 0.605, 0.61]), "s", "x", "y", "tail")
    assert decided.verdict == "better" and decided.as_row()["seeds_to_decide"] == 3 and decided.seeds_text() == ""
    runs.loc[5, "A_identified"] = False
    a = compare_pair(runs, "s", "x", "y", "A")
    assert a.as_row()["seeds_to_decide"] is None and a.seeds_text() == "run longer"
    assert set(t.as_dict()) == KEYS  # the JSON contract does not grow


def test_the_report_says_how_many_seeds_would_decide_its_pairs():
    """The report's line counts the undecided pairs that pairs.csv's seeds_to_decide puts within 8, 16
    and SEEDS_LIMIT seeds, and the seeds at which 70% of all pairs would be decided."""
    from analysis.compare import pairs_frame
    from experiments.study_report import _seeds_to_decide_text

    rows = []
    for k, (a, b) in enumerate([([0.70, 0.71, 0.72], [0.60, 0.605, 0.61]),  # decided at 3
                                ([0.40, 0.45, 0.38, 0.41], [0.39, 0.41, 0.42, 0.37]),
                                ([0.40, 0.47, 0.33, 0.44], [0.35, 0.45, 0.36, 0.40]),
                                ([0.40, 0.60, 0.20, 0.50], [0.45, 0.30, 0.50, 0.30])]):
        rows.append(compare_pair(_pair_table(a, b), "s", "x", "y", "tail"))
    pairs = pairs_frame(rows)
    assert str(pairs["seeds_to_decide"].dtype) == "Int64"
    need = [None if pd.isna(x) else int(x) for x in pairs["seeds_to_decide"]]
    assert need[0] == 3 and all(n is None or n > 4 for n in need[1:]), need
    text = "\n".join(_seeds_to_decide_text(pairs))
    left = [math.inf if n is None else n for n in need[1:]]
    by8, by16 = sum(n <= 8 for n in left), sum(n <= 16 for n in left)
    assert f"of the 3 undecided pairs, {by8} would be decided by 8 seeds, {by16} by 16" in text, text
    at70 = sorted(math.inf if n is None else n for n in need)[math.ceil(0.7 * 4) - 1]
    want = (f"70% of the 4 tail pairs reach an 80% chance of a verdict by {at70} seeds" if math.isfinite(at70)
            else "70% of the 4 tail pairs do not reach it by 64 seeds")
    assert want in text, text
    assert f"{sum(math.isfinite(n) for n in left)} by 64" in text
    # a pair with no interval (one run a side) projects nothing and is left out of the counts
    lone = compare_pair(_pair_table([0.5], [0.4]), "s", "x", "y", "tail")
    assert lone.diff.projected == "" and lone.seeds_text() == "—"
    assert "of the 3 undecided pairs" in "\n".join(_seeds_to_decide_text(pairs_frame(rows + [lone])))
