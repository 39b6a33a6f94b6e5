"""Comparing configurations: the statistics every verdict of the zoo goes through.

A seed is a common random number: it fixes the data split, the warm start and the prompt order
for every configuration of a sweep, so two configurations run with the same seed differ only by
the configuration (and the run's own noise). Comparing them seed by seed removes the seed's
share of the variance (88-92% of it for the tiny study's pass rate):

    d = difference({0: 0.81, 1: 0.79, 2: 0.83}, {0: 0.78, 1: 0.77, 2: 0.80})  # seed -> value of a, of b
    d.verdict        # 'better' (a − b > 0), 'worse', 'equivalent' (inside ±δ) or 'inconclusive'
    d.low, d.high    # the 95% interval of a − b; d.paired, d.n say how it was made

- `difference`: configurations sharing at least two seeds are compared on the per-seed
  differences (paired t interval: mean Δ ± t(0.975, n−1)·sd(Δ)/√n, `scipy.stats.ttest_rel`);
  otherwise Welch's interval (`scipy.stats.ttest_ind(equal_var=False)`).
- `verdict_of`, the one rule every verdict goes through (claims, pairs, `scalerl compare`, the
  adaptive rule and the replay): `equivalent` when the two one-sided tests put a − b inside ±δ
  (`statsmodels` `ttost_paired` / `ttost_ind`, each side at 2.5%: exactly the printed 95% interval
  inside ±δ; δ = `equivalence`, default 0.02, the paper's margin), even when that interval also
  excludes 0 (a real difference smaller than δ is equivalent, and printed with its interval);
  otherwise `better` / `worse` when the interval excludes 0; else `inconclusive`. One interval
  decides all four verdicts, so every verdict can be read off the numbers printed beside it.
  "Not shown different" is never "equal".
- Three metrics, all always reported (`METRICS`):
  - `A`, the law's asymptote. It counts only where identified: each run's 95% profile interval of
    A (`analysis.scaling_law.profile_A`, inside [.., 1.0] for pass rates) no wider than 0.1; a
    comparison that involves a run whose A is not identified is `inconclusive` whatever the
    numbers say (reason: "A not identified: run longer"). B and log C_mid (refitted at the
    pair's common A, as the paper does) get their own paired intervals for efficiency claims.
  - `tail`, measured: the mean held-out pass rate over the last 20% of the sweep's common compute
    window, every configuration cut at the smallest final compute among them (`tail_values`).
  - `auc`, measured efficiency: the mean held-out pass rate over the whole common window, weighted
    by log compute (`auc_values`). The paper finds that most choices move efficiency rather than
    the asymptote; B and C_mid, its fitted measures of efficiency, inherit A's identification
    problem, so `auc` judges every efficiency claim beside them.
- `seeds_to_decide` projects, from a pair's measured mean and sd of a − b, the number of seeds per
  configuration at which its interval would be decided with 80% probability, were the measured
  mean and sd the truth (`Difference.seeds_to_decide`, the `seeds_to_decide` column of pairs.csv,
  a column of `scalerl compare`): a planning number for an `inconclusive` pair.
- `compare_sweep` compares every pair of configurations of one sweep on every metric (A, tail, auc);
  `scalerl compare`, `scalerl fit`, the figures and the reproduction report all call it (through
  `analysis.study.summarize_sweep`).
"""

from __future__ import annotations

import dataclasses
import math
from itertools import combinations
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

__all__ = [
    "VERDICTS", "METRICS", "DEFAULT_EQUIVALENCE", "LEVEL", "TAIL_FRACTION", "A_NOT_IDENTIFIED",
    "Difference", "difference", "paired_interval", "welch_interval", "equivalence_p", "verdict_of", "tost_alpha",
    "seeds_to_decide", "decided_probability", "SEEDS_LIMIT", "SEEDS_POWER",
    "seed_key", "parse_equivalence", "common_window", "tail_values", "tail_sampling_sd", "auc_values", "window_start", "MEASURED",
    "PairComparison", "pairs_frame", "compare_pair", "compare_sweep",
    "Efficiency", "efficiency",
]

VERDICTS = ("better", "worse", "equivalent", "inconclusive")
METRICS = ("A", "tail", "auc")
MEASURED = ("tail", "auc")  # read off the held-out curve, no fit: always "identified"
DEFAULT_EQUIVALENCE = 0.02  # the paper's margin on A (Fig 8a: three seeds within ±0.015)
LEVEL = 0.95


def tost_alpha(level: float) -> float:
    """Each one-sided test's level for an interval at `level`: TOST p < (1 − level) / 2 exactly when
    that interval (same t, same degrees of freedom) lies inside ±δ."""
    return round((1.0 - float(level)) / 2.0, 12)


ALPHA = tost_alpha(LEVEL)  # 0.025: TOST p < ALPHA iff the 95% interval lies inside ±δ
TAIL_FRACTION = 0.2  # `tail` averages the last 20% of the common compute window
A_NOT_IDENTIFIED = "A not identified: run longer"


def parse_equivalence(value: Any) -> float:
    """δ of the equivalence test: a number > 0."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"equivalence must be a number > 0, got {value!r}") from None
    if not math.isfinite(x) or x <= 0:
        raise ValueError(f"equivalence must be a number > 0, got {value!r}")
    return x


# ----------------------------------------------------------------------------- intervals


@dataclasses.dataclass(frozen=True)
class Difference:
    """a − b between two configurations, with its interval and verdict."""

    delta: float  # mean of a − b (paired) or mean(a) − mean(b) (Welch)
    low: float  # the `level` interval of a − b (NaN when it cannot be computed)
    high: float
    n: int  # pairs (paired) or runs of both (Welch)
    n_a: int
    n_b: int
    paired: bool
    p_equivalent: float  # the TOST p-value of |a − b| < equivalence (NaN: no test)
    equivalence: float
    verdict: str
    reason: str = ""  # why inconclusive, when there is more to say than the interval
    seeds_to_decide: int | None = None  # seeds per configuration that decide it (projected); None: over SEEDS_LIMIT or no interval
    projected: str = ""  # the verdict it would then read ("" when already decided or not projected)

    @property
    def method(self) -> str:
        return f"paired by seed (n={self.n})" if self.paired else f"Welch (n={self.n_a}+{self.n_b})"

    def text(self, spec: str = "+.3f") -> str:
        if not math.isfinite(self.low):
            return f"Δ {format(self.delta, spec)} ({self.method}; no interval)"
        return f"Δ {format(self.delta, spec)} [{format(self.low, spec)}, {format(self.high, spec)}] ({self.method})"


def _clean(values: Iterable[float]) -> np.ndarray:
    x = np.asarray([v for v in values if v is not None and np.isfinite(v)], dtype=np.float64)
    return x


def paired_interval(a: Sequence[float], b: Sequence[float], level: float = LEVEL) -> tuple[float, float, float]:
    """(mean Δ, low, high): the paired t interval of a − b (a[i] and b[i] share seed i).

    mean Δ ± t(level, n − 1)·sd(Δ)/√n; a zero sd gives a zero-width interval."""
    from scipy import stats

    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.shape != y.shape or x.size < 2:
        raise ValueError(f"a paired interval needs two equal-length samples of >= 2, got {x.size} and {y.size}")
    d = x - y  # [n]
    if float(np.std(d)) == 0.0:
        return float(d.mean()), float(d.mean()), float(d.mean())
    ci = stats.ttest_rel(x, y).confidence_interval(level)
    return float(d.mean()), float(ci.low), float(ci.high)


def welch_interval(a: Sequence[float], b: Sequence[float], level: float = LEVEL) -> tuple[float, float, float]:
    """(mean(a) − mean(b), low, high): Welch's t interval (unequal variances)."""
    from scipy import stats

    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.size < 2 or y.size < 2:
        raise ValueError(f"Welch's interval needs >= 2 values on each side, got {x.size} and {y.size}")
    delta = float(x.mean() - y.mean())
    if float(np.var(x)) == 0.0 and float(np.var(y)) == 0.0:
        return delta, delta, delta
    ci = stats.ttest_ind(x, y, equal_var=False).confidence_interval(level)
    return delta, float(ci.low), float(ci.high)


def equivalence_p(a: Sequence[float], b: Sequence[float], equivalence: float, *, paired: bool) -> float:
    """The p-value of the two one-sided tests that −δ < a − b < δ (statsmodels' TOST).

    p < `ALPHA` (0.025) holds exactly when the 95% interval of a − b (`paired_interval` /
    `welch_interval`, same t and degrees of freedom) lies inside ±δ."""
    from statsmodels.stats.weightstats import ttost_ind, ttost_paired

    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    spread = float(np.var(x - y)) if paired else float(np.var(x)) + float(np.var(y))
    if spread == 0.0:  # no noise at all: the difference is what it is
        d = float(np.mean(x - y)) if paired else float(x.mean() - y.mean())
        return 0.0 if abs(d) < equivalence else 1.0
    if paired:
        p = ttost_paired(x, y, -equivalence, equivalence)[0]
    else:
        p = ttost_ind(x, y, -equivalence, equivalence, usevar="unequal")[0]
    return float(p)


def verdict_of(low: float, high: float, p_equivalent: float, alpha: float = ALPHA) -> str:
    """The one verdict rule (DESIGN.md "Comparing configurations"), in this order: `equivalent`
    when the interval lies inside ±δ (the two one-sided tests, p < alpha: exactly the interval at
    level 1 − 2·alpha inside ±δ), even where it also excludes 0 (a real difference smaller than δ
    is reported as equivalent, with its interval); else `better` / `worse` when it excludes 0;
    else `inconclusive` (also when there is no interval)."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return "inconclusive"
    if math.isfinite(p_equivalent) and p_equivalent < alpha:
        return "equivalent"
    if low > 0:
        return "better"
    if high < 0:
        return "worse"
    return "inconclusive"


SEEDS_LIMIT = 64  # projections stop here: a pair that needs more is called undecidable by seeds
SEEDS_POWER = 0.8  # the chance of a decided interval that `seeds_to_decide` plans for


def decided_probability(delta: float, sd: float, n: np.ndarray, *, equivalence: float = DEFAULT_EQUIVALENCE,
                        level: float = LEVEL, sd_b: float | None = None, grid: int = 400) -> np.ndarray:
    """P(the interval of a − b is decided | n seeds per configuration), per n in `n` [N], were the true
    mean difference `delta` and the true spread `sd` (and `sd_b`): the chance that `verdict_of`
    says `equivalent`, `better` or `worse`.

    Paired (sd_b None): the per-seed differences are N(delta, sd²); the sample mean is
    N(delta, sd²/n) and, independently, (n − 1)s²/sd² is χ²(n − 1); the interval is mean ± h,
    h = t(level, n − 1)·s/√n. Given h, the rule decides unless the mean lies in [−h, −δ + h] or
    [δ − h, h] (nothing is left undecided when h < δ/2: an interval that narrow either sits inside
    ±δ or excludes 0), so P = E_s[Φ-sums], the expectation over s on `grid` χ² quantiles.
    Unpaired (Welch, n runs a side): the same with sd² + sd_b² and Satterthwaite's ν degrees of
    freedom for both the t quantile and the spread's χ²."""
    parts = _verdict_probabilities(delta, sd, n, equivalence=equivalence, level=level, sd_b=sd_b, grid=grid)
    return parts["equivalent"] + parts["better"] + parts["worse"]  # [N] disjoint regions


def seeds_to_decide(delta: float, sd: float, *, equivalence: float = DEFAULT_EQUIVALENCE, level: float = LEVEL,
                    start: int = 2, sd_b: float | None = None, power: float = SEEDS_POWER,
                    limit: int = SEEDS_LIMIT) -> tuple[int | None, str]:
    """(n, verdict): the fewest seeds per configuration, from `start` on, at which a − b's interval
    is decided with probability >= `power` (`decided_probability`), were the pair's true mean
    difference and spread the measured `delta` and `sd` (paired: the sd of the per-seed
    differences; Welch: `sd` and `sd_b`, each configuration's sd), and the verdict it would most
    likely read; (None, "inconclusive") when more than `limit` seeds would be needed.

    A planning number from point estimates: the measured mean and sd of 3-5 seeds are themselves
    uncertain, so treat it as the order of magnitude of the seeds a pair needs."""
    if not (math.isfinite(delta) and math.isfinite(sd) and sd >= 0
            and (sd_b is None or (math.isfinite(sd_b) and sd_b >= 0))):
        return None, "inconclusive"
    n = np.arange(max(int(start), 2), max(int(limit), 2) + 1)  # [N] candidate seeds
    p = decided_probability(delta, sd, n, equivalence=equivalence, level=level, sd_b=sd_b)  # [N]
    hit = np.flatnonzero(p >= power)
    if not hit.size:
        return None, "inconclusive"
    k = int(n[hit[0]])
    parts = _verdict_probabilities(delta, sd, np.array([k]), equivalence=equivalence, level=level, sd_b=sd_b)
    return k, max(parts, key=lambda v: float(parts[v][0]))


def _verdict_probabilities(delta: float, sd: float, n: np.ndarray, *, equivalence: float, level: float,
                           sd_b: float | None, grid: int = 400) -> dict[str, np.ndarray]:
    """{verdict: its chance at each n in `n` [N]} for `equivalent`, `better` and `worse`, as
    `decided_probability` describes: the mean is N(delta, var/n), the interval mean ± h, and the
    chance of each region is averaged over the spread on `grid` χ² quantiles. The regions are
    disjoint, `equivalent` taken first as `verdict_of` takes it: inside (−δ + h, δ − h); `better`
    above max(h, δ − h); `worse` below min(−h, −δ + h)."""
    from scipy import stats

    n = np.asarray(n, dtype=np.float64)  # [N]
    var = sd * sd + (0.0 if sd_b is None else sd_b * sd_b)  # the variance of one per-seed difference
    if var == 0.0:  # no noise: the interval is the point delta
        equal = 1.0 if abs(delta) < equivalence else 0.0
        side = (1.0 - equal) * np.ones(n.shape)
        return {"equivalent": equal * np.ones(n.shape), "better": side * (delta > 0), "worse": side * (delta <= 0)}
    four = sd ** 4 + (0.0 if sd_b is None else sd_b ** 4)
    df = n - 1.0 if sd_b is None or four == 0 else var * var * (n - 1.0) / four  # [N] Welch-Satterthwaite, n a side
    u = (np.arange(grid) + 0.5) / grid  # [Q] quantile midpoints
    ratio = np.sqrt(stats.chi2.ppf(u[None, :], df[:, None]) / df[:, None])  # [N, Q] s / sd
    se = math.sqrt(var) / np.sqrt(n)[:, None]  # [N, 1] sd of the mean difference
    h = stats.t.ppf(0.5 + level / 2.0, df)[:, None] * ratio * se  # [N, Q] the interval's half-width
    cdf = lambda x: stats.norm.cdf((x - delta) / se)  # noqa: E731  P(mean < x)   [N, Q]
    equal = np.clip(cdf(equivalence - h) - cdf(-equivalence + h), 0.0, None)  # [N, Q]
    better = 1.0 - cdf(np.maximum(h, equivalence - h))  # [N, Q] past 0 and not inside ±δ
    worse = cdf(np.minimum(-h, -equivalence + h))  # [N, Q]
    return {"equivalent": equal.mean(axis=1), "better": better.mean(axis=1), "worse": worse.mean(axis=1)}


def difference(
    a: Mapping[Any, float],
    b: Mapping[Any, float],
    *,
    equivalence: float = DEFAULT_EQUIVALENCE,
    level: float = LEVEL,
    bounds: tuple[float, float] | None = None,
    pair: bool = True,
) -> Difference:
    """a − b from per-seed values (seed -> value; NaN / None values are dropped).

    Paired by seed when at least two seeds have a value on both sides (only those seeds are
    used), else Welch's interval over all values; `pair=False` forces Welch. `bounds` clips the
    interval to the difference's valid range (e.g. (−1, 1) for pass rates). Fewer than two values
    on a side: no interval, `inconclusive`."""
    va = {k: float(v) for k, v in a.items() if v is not None and np.isfinite(v)}
    vb = {k: float(v) for k, v in b.items() if v is not None and np.isfinite(v)}
    common = sorted(set(va) & set(vb), key=str)
    if pair and len(common) >= 2:
        x, y = [va[k] for k in common], [vb[k] for k in common]
        delta, low, high = paired_interval(x, y, level)
        p = equivalence_p(x, y, equivalence, paired=True)
        n, paired = len(common), True
        spread, spread_b, seeds = float(np.std(np.subtract(x, y), ddof=1)), None, n
    elif len(va) >= 2 and len(vb) >= 2:
        x, y = list(va.values()), list(vb.values())
        delta, low, high = welch_interval(x, y, level)
        p = equivalence_p(x, y, equivalence, paired=False)
        n, paired = len(va) + len(vb), False
        spread, spread_b, seeds = float(np.std(x, ddof=1)), float(np.std(y, ddof=1)), max(len(va), len(vb))
    else:
        delta = (float(np.mean(list(va.values()))) - float(np.mean(list(vb.values())))) if va and vb else math.nan
        return Difference(delta, math.nan, math.nan, len(va) + len(vb), len(va), len(vb), False, math.nan,
                          equivalence, "inconclusive", f"too few runs ({len(va)} and {len(vb)}; need 2 each)")
    if bounds is not None:
        low, high = max(low, bounds[0]), min(high, bounds[1])
    verdict = verdict_of(low, high, p, tost_alpha(level))
    if verdict != "inconclusive":
        return Difference(delta, low, high, n, len(va), len(vb), paired, p, equivalence, verdict, seeds_to_decide=seeds)
    need, projected = seeds_to_decide(delta, spread, equivalence=equivalence, level=level, start=seeds + 1,
                                      sd_b=spread_b)
    return Difference(delta, low, high, n, len(va), len(vb), paired, p, equivalence, verdict,
                      seeds_to_decide=need, projected=projected)


# ----------------------------------------------------------------------------- the tail metric


def common_window(final_compute: Iterable[float]) -> float:
    """The end of a sweep's common compute window: the smallest final compute among its runs."""
    x = _clean(final_compute)
    return float(x.min()) if x.size else math.nan


def _tail_weights(c: np.ndarray, start: float, end: float) -> np.ndarray | None:
    """[n] w with tail = Σ w·r over a run's evaluations at compute c [n] (sorted): the mean of those
    inside [start, end]; none inside, the curve interpolated linearly in log compute at the window's
    midpoint (two neighbours). None when the run has no tail (it stops before `end`)."""
    if not c.size or c[-1] < end * (1 - 1e-9):
        return None
    inside = (c >= start * (1 - 1e-12)) & (c <= end * (1 + 1e-12))
    if inside.any():
        return inside / float(inside.sum())
    pos = np.flatnonzero(c > 0)
    if c.size < 2 or pos.size < 1:
        return None
    x = math.log(0.5 * (start + end))
    lc = np.log(c[pos])
    w = np.zeros(c.size)
    if x <= lc[0]:  # np.interp's ends (and a single positive point): the nearest evaluation
        w[pos[0]] = 1.0
    elif x >= lc[-1]:
        w[pos[-1]] = 1.0
    else:
        j = int(np.searchsorted(lc, x, side="right"))  # lc[j-1] <= x < lc[j]
        f = (x - lc[j - 1]) / (lc[j] - lc[j - 1])
        w[pos[j - 1]], w[pos[j]] = 1.0 - f, f
    return w


def tail_values(curves: Mapping[Any, tuple[np.ndarray, np.ndarray]], end: float | None = None,
                fraction: float = TAIL_FRACTION) -> dict[Any, float]:
    """Per run: the mean held-out pass rate over the last `fraction` of the common window.

    curves: run -> (compute [n], pass rate [n]) sorted by compute. end: the window's end (default:
    the smallest final compute among the runs, `common_window`). A run's evaluations inside
    [(1 − fraction)·end, end] are averaged; a run with none there (sparse evaluations) takes its
    curve interpolated linearly in log compute at the window's midpoint. A run that stops before
    `end` has no tail (NaN): part of a window is not the window."""
    if end is None:
        end = common_window(float(c[-1]) for c, _ in curves.values() if len(c))
    if not math.isfinite(end):
        return {k: math.nan for k in curves}
    out: dict[Any, float] = {}
    for key, (c, r) in curves.items():
        c, r = np.asarray(c, dtype=np.float64), np.asarray(r, dtype=np.float64)
        w = _tail_weights(c, (1.0 - fraction) * end, end)  # [n]
        out[key] = math.nan if w is None else float(np.dot(w, r))
    return out


def tail_sampling_sd(curves: Mapping[Any, tuple[np.ndarray, np.ndarray]], end: float,
                     fraction: float = TAIL_FRACTION) -> dict[Any, float]:
    """Per run: an upper bound on the sd of `tail` that evaluation sampling alone gives it.

    curves: run -> (compute [n], sampling variance of each evaluation [n]), the variance bounded by
    p(1 − p)/(prompts·k) for a pass rate p over `prompts` fixed prompts, k samples each (the exact
    variance Σ p_i(1 − p_i)/(k·prompts²) is at most that: p(1 − p) is concave). Evaluations sample
    independently, so tail = Σ w·r has variance Σ w²·v over the same weights as `tail_values`.
    NaN where a run has no tail or an evaluation in its tail has no known variance."""
    out: dict[Any, float] = {}
    for key, (c, v) in curves.items():
        c, v = np.asarray(c, dtype=np.float64), np.asarray(v, dtype=np.float64)
        w = _tail_weights(c, (1.0 - fraction) * end, end) if math.isfinite(end) else None
        out[key] = math.nan if w is None else float(math.sqrt(np.dot(w * w, v))) if np.all(
            np.isfinite(v[w > 0])) else math.nan
    return out


def window_start(curves: Mapping[Any, tuple[np.ndarray, np.ndarray]]) -> float:
    """The start of a sweep's common compute window: the largest first positive compute among its
    runs (the first evaluation after step 0), so every run has a measured point there."""
    firsts = [float(np.asarray(c)[np.asarray(c) > 0][0]) for c, _ in curves.values() if np.any(np.asarray(c) > 0)]
    return max(firsts) if firsts else math.nan


def _log_mean(c: np.ndarray, r: np.ndarray, start: float, end: float) -> float:
    """The mean of r over [start, end] in log compute: ∫ r d ln C / (ln end − ln start), r linear in
    ln C between evaluations (trapezoid)."""
    pos = c > 0
    lc, rr = np.log(c[pos]), r[pos]
    a, b = math.log(start), math.log(end)
    inner = (lc > a) & (lc < b)
    x = np.concatenate([[a], lc[inner], [b]])  # [m]
    y = np.concatenate([[np.interp(a, lc, rr)], rr[inner], [np.interp(b, lc, rr)]])  # [m]
    return float(np.trapezoid(y, x) / (b - a))


def auc_values(curves: Mapping[Any, tuple[np.ndarray, np.ndarray]], end: float | None = None,
               start: float | None = None) -> dict[Any, float]:
    """Per run: `auc`, the mean held-out pass rate over the whole common compute window, weighted by
    log compute (each doubling of compute counts the same), the measured efficiency beside `tail`.

    curves: run -> (compute [n], pass rate [n]) sorted by compute. The window runs from `start`
    (default `window_start`: the largest first positive compute among the runs) to `end` (default
    `common_window`: the smallest final compute); the curve is linear in log compute between
    evaluations. A run that stops before `end` or starts after `start` has no auc (NaN)."""
    if end is None:
        end = common_window(float(c[-1]) for c, _ in curves.values() if len(c))
    if start is None:
        start = window_start(curves)
    out: dict[Any, float] = {}
    for key, (c, r) in curves.items():
        c, r = np.asarray(c, dtype=np.float64), np.asarray(r, dtype=np.float64)
        pos = c[c > 0]
        if not (math.isfinite(start) and math.isfinite(end) and end > start) or pos.size < 2 \
                or c[-1] < end * (1 - 1e-9) or pos[0] > start * (1 + 1e-9):
            out[key] = math.nan
            continue
        out[key] = _log_mean(c, r, start, end)
    return out


# ----------------------------------------------------------------------------- pairs of a sweep


@dataclasses.dataclass(frozen=True)
class PairComparison:
    """One pair of configurations on one metric: the JSON object of `scalerl compare`."""

    sweep: str
    a: str
    b: str
    metric: str  # "A" | "tail" | "auc"
    diff: Difference
    identified: bool  # A: every run of both is identified; tail and auc (measured): always True
    verdict: str
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        """The object `scalerl compare --json` prints: exactly the fields of the contract."""
        num = lambda x: None if x is None or not math.isfinite(x) else float(x)  # noqa: E731
        return {"sweep": self.sweep, "a": self.a, "b": self.b, "metric": self.metric,
                "delta": num(self.diff.delta), "low": num(self.diff.low), "high": num(self.diff.high),
                "n": int(self.diff.n), "paired": bool(self.diff.paired), "identified": bool(self.identified),
                "verdict": self.verdict}

    def as_row(self) -> dict[str, Any]:
        """`as_dict` and the rest of the evidence (runs per side, δ, why inconclusive): a CSV row."""
        return {**self.as_dict(), "n_a": int(self.diff.n_a), "n_b": int(self.diff.n_b),
                "equivalence": float(self.diff.equivalence), "reason": self.reason,
                "seeds_to_decide": self.seeds_to_decide(), "projected": self.diff.projected if self.identified else ""}

    def seeds_to_decide(self) -> int | None:
        """Seeds per configuration at which this pair is decided: the seeds it has when it is, the
        projection (`seeds_to_decide`) when it is not; None when seeds cannot decide it (an A that is
        not identified needs longer runs, not more of them) or more than SEEDS_LIMIT would."""
        return self.diff.seeds_to_decide if self.identified else None

    def seeds_text(self) -> str:
        """The projection in words, for an undecided pair ("" for a decided one)."""
        if self.verdict != "inconclusive":
            return ""
        if not self.identified:
            return "run longer"
        if self.diff.seeds_to_decide is not None:
            return f"~{self.diff.seeds_to_decide} ({self.diff.projected})"
        return f"> {SEEDS_LIMIT}" if self.diff.projected else "—"

    def text(self) -> str:
        why = f" ({self.reason})" if self.reason else ""
        return f"{self.metric}: {self.diff.text()} → {self.verdict}{why}"


def pairs_frame(pairs: Iterable[PairComparison]) -> pd.DataFrame:
    """The pairs table (pairs.csv, fit's <stem>_pairs.csv): one `as_row` per pair; `seeds_to_decide`
    an integer column, blank where seeds cannot decide the pair."""
    out = pd.DataFrame([p.as_row() for p in pairs])
    if "seeds_to_decide" in out:
        out["seeds_to_decide"] = out["seeds_to_decide"].astype("Int64")
    return out


def seed_key(seed: Any, run_id: Any) -> Any:
    """The pairing key of a run: its seed, or (a run without one) a key of its own that pairs with
    nothing, so configurations without seeds are compared by Welch's interval."""
    return seed if seed is not None and not (isinstance(seed, float) and math.isnan(seed)) else ("unseeded", run_id)


def _by_seed(runs: pd.DataFrame, config: str, column: str) -> dict[Any, float]:
    """seed -> value of `column` for one configuration's runs. Two runs of one configuration with
    the same seed are an error in the sweep (they would pair with the same run of the other)."""
    g = runs[runs["config"] == config]
    ids = g["path"] if "path" in g else pd.Series(range(len(g)), index=g.index)
    out: dict[Any, float] = {}
    for seed, rid, v in zip(g["seed"], ids, g[column]):
        key = seed_key(seed, rid)
        if key in out:
            raise ValueError(f"configuration {config!r} has two runs with seed {seed!r}: a seed fixes a run, "
                             "so one of them is a duplicate")
        out[key] = float(v) if v is not None and pd.notna(v) else math.nan
    return out


def compare_pair(runs: pd.DataFrame, sweep: str, a: str, b: str, metric: str, *,
                 equivalence: float = DEFAULT_EQUIVALENCE, level: float = LEVEL) -> PairComparison:
    """a vs b on `metric`, from the per-run table (`config`, `seed`, `A`, `A_identified`, `tail`, `auc`)."""
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; choose from: {', '.join(METRICS)}")
    diff = difference(_by_seed(runs, a, metric), _by_seed(runs, b, metric), equivalence=equivalence,
                      level=level, bounds=(-1.0, 1.0))
    if metric in MEASURED:
        return PairComparison(sweep, a, b, metric, diff, True, diff.verdict, _no_window(runs, metric) or diff.reason)
    involved = runs[runs["config"].isin([a, b]) & runs["A"].notna()]
    ident = "A_identified" in involved and len(involved) > 0 and bool(involved["A_identified"].fillna(False).all())
    if not ident:
        return PairComparison(sweep, a, b, metric, diff, False, "inconclusive", A_NOT_IDENTIFIED)
    return PairComparison(sweep, a, b, metric, diff, True, diff.verdict, diff.reason)


def _no_window(runs: pd.DataFrame, metric: str) -> str:
    """Why `auc` has no value for any run: the sweep's common window is empty (one configuration's
    first evaluation after step 0 comes after another's last: e.g. a much cheaper configuration
    whose whole run costs less than the other's first evaluation interval). "" otherwise."""
    if metric != "auc" or runs.empty or not {"window_start", "tail_end", "auc"} <= set(runs.columns) \
            or runs["auc"].notna().any():
        return ""
    start, end = float(runs["window_start"].iloc[0]), float(runs["tail_end"].iloc[0])
    if math.isfinite(start) and math.isfinite(end) and start >= end:
        return (f"no common window: the latest first evaluation ({start:.3g}) comes after the shortest run "
                f"ends ({end:.3g}); evaluate the costlier configuration earlier (train.eval_every)")
    return ""


def compare_sweep(runs: pd.DataFrame, sweep: str, *, metrics: Sequence[str] = METRICS,
                  equivalence: float = DEFAULT_EQUIVALENCE, level: float = LEVEL,
                  order: Sequence[str] | None = None) -> list[PairComparison]:
    """Every pair of configurations of one sweep on each metric; `order` (default: as they first
    appear) decides which of a pair is `a`."""
    configs = list(order) if order is not None else list(dict.fromkeys(runs["config"]))
    return [compare_pair(runs, sweep, a, b, m, equivalence=equivalence, level=level)
            for a, b in combinations(configs, 2) for m in metrics]


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """B and ln C_mid of two configurations refitted at their common A (the paper's rule)."""

    common_A: float
    B: Difference  # higher B is more efficient
    log_C_mid: Difference  # lower C_mid is more efficient

    def favours(self) -> str:
        """'a', 'b', 'both' (the two disagree) or '' (neither is decided)."""
        for_a = self.B.verdict == "better" or self.log_C_mid.verdict == "worse"
        for_b = self.B.verdict == "worse" or self.log_C_mid.verdict == "better"
        return "both" if for_a and for_b else "a" if for_a else "b" if for_b else ""

    def text(self) -> str:
        return (f"at A={self.common_A:.3f}: B {self.B.text('+.2f')} → {self.B.verdict}; "
                f"ln C_mid {self.log_C_mid.text('+.2f')} → {self.log_C_mid.verdict}")


def efficiency(fits_a: Mapping[Any, Any], fits_b: Mapping[Any, Any], *, level: float = LEVEL) -> Efficiency | None:
    """The paper's efficiency comparison at a common A: every run of both refitted with A fixed
    at the mean A of all of them, then B (higher is more efficient) and ln C_mid (lower is) each
    compared by its own paired (else Welch) interval. fits_*: seed -> FitResult (None: not
    fitted). No equivalence margin applies (the paper has none for B)."""
    from analysis.scaling_law import refit_at

    allf = [f for f in (*fits_a.values(), *fits_b.values()) if f is not None]
    if not allf:
        return None
    common = float(np.mean([f.A for f in allf]))
    grid = np.unique(np.concatenate([f.c_mid_grid for f in allf]))
    ra = {k: refit_at(f, common, grid) for k, f in fits_a.items() if f is not None}
    rb = {k: refit_at(f, common, grid) for k, f in fits_b.items() if f is not None}
    tiny = 1e-12  # no margin: equivalence never decides an efficiency difference
    return Efficiency(
        common,
        difference({k: f.B for k, f in ra.items()}, {k: f.B for k, f in rb.items()}, equivalence=tiny, level=level),
        difference({k: math.log(f.C_mid) for k, f in ra.items()}, {k: math.log(f.C_mid) for k, f in rb.items()},
                   equivalence=tiny, level=level),
    )
