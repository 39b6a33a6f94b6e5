"""Adaptive sweeps: stop the configurations that have already lost, and replay the rule on finished sweeps.

The rule (`decide_rung`), at a rung r (a share of the sweep's compute budget W), on the
configurations still running, every run cut at r·W:

1. `tail` (the measured rule). The leader is the configuration with the highest mean measured
   `tail` at the rung (the mean held-out pass rate over the last 20% of [0, r·W]). Every other
   configuration is compared with the leader on ITS OWN paired interval: the per-seed differences
   of the two (`analysis.compare.difference`, paired t over the seeds both have; fewer than two
   shared seeds: no paired evidence, it runs on). Nothing is pooled from other pairs. Two families
   of tests, each with its error rate controlled across the rung's comparisons by Holm's step-down
   (`holm_levels`): a configuration stops as a loser when its interval at its Holm level excludes 0
   below (`worse`; ALPHA split over the early rungs, Holm on two-sided p-values since the leader,
   and so the sign of each difference, is chosen by the data: the i-th smallest p of m is tested
   with the two-sided 1 − ALPHA/(rungs·(m − i)) interval. A configuration equal to the leader is
   stopped as a loser in at most ALPHA of sweeps, measured in tests/test_adaptive.py; the chance
   that ANY of k equal configurations is, by the same simulation: 5-9% for k = 2-9), and as a tie when its
   interval at its Holm level for ties lies inside ±δ (`equivalent`, the two one-sided tests; family rate
   TIE_ALPHA = 2.5% per rung: for a single comparison its 95% interval inside ±δ, the evidence on
   which the full sweep's check calls two configurations equivalent).
   `--keep-equivalent` keeps ties running. Every verdict comes from `analysis.compare.verdict_of`.
2. `law` (the calibrated prediction). Each run's prefix up to r·W is fitted (the sweep's fit
   protocol start) and its `tail` at the full budget predicted with its calibrated predictive
   distribution (`analysis.scaling_law.predictive_draws`: evaluation noise, correlated; the fit's
   uncertainty; the law's spread against a straight line in log compute). A configuration's
   prediction is the mean over its seeds, its interval the draws of that mean widened by the
   seed-to-seed spread of the predictions (a t term, sd/√n). The leader is the configuration with
   the highest lower bound; a configuration whose upper bound lies below it stops (`worse` by
   `verdict_of` on the interval [lo − hi_leader, hi − lo_leader] of the difference). A
   configuration with a run the law cannot fit (too few points after the fit's start) is never
   stopped by the law, nor can it lead.
3. `both`: a configuration stops when either rule stops it.
At the last rung (r = 1) nothing is stopped: what is left ran the full budget, and the sweep's
best is the best of it by measured `tail`.

Each decision (`Decision.as_dict`, a line of adaptive.jsonl) records the pair (configuration,
leader), n, the interval and its level, the rule and the verdict.

`replay` simulates the rule on finished sweeps by cutting each run's logs at each rung: the compute
the adaptive sweep would have used (a stopped run costs r·W, a survivor W, against W for every run
of the full sweep), the full sweep's best (highest mean tail over the common window), the adaptive
best, and their `agreement` on the full data: `same` (the same configuration), `equivalent` (the
adaptive pick minus the full best, paired by seed, is `equivalent` within ±δ), `undecided` (that
difference is inconclusive) or `different` (the adaptive pick is `worse`). `agrees` is true for
`same` and `equivalent` only. Only finished runs are replayed. finish_leader=False
(`--stop-when-decided`): the sweep ends as soon as one configuration is left, which then costs that
rung too. DEFAULT_RUNGS (0.1, 0.15, 0.2, 0.4, 1), TIE_ALPHA and DEFAULT_STOP_RULE are the best point
of the frontier measured on the two tiny studies (BENCHMARKS.md "Adaptive sweeps on each pair's own
evidence"; `benchmarks/adaptive_frontier.py`).

    rows = replay("results/tiny", rungs=(0.25, 0.5, 1.0), stop_rule="tail")  # one ReplayResult per sweep
    scalerl replay results/tiny --json
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from analysis.compare import (DEFAULT_EQUIVALENCE, LEVEL, TAIL_FRACTION, Difference, common_window, difference,
                              seed_key, tail_values, verdict_of)
from analysis.runs import load_runs, resolve_compute, run_curve
from analysis.scaling_law import FitError, fit, predictive_draws

__all__ = ["DEFAULT_RUNGS", "ALPHA", "TIE_ALPHA", "LAW_LEVEL", "STOP_RULES", "DEFAULT_STOP_RULE", "AGREEMENTS",
           "parse_rungs", "parse_stop_rule", "rung_alpha", "holm_levels", "Evidence", "Decision", "ReplayResult",
           "law_evidence", "rung_evidence", "config_prediction", "decide_rung", "sweep_curves", "agreement_of",
           "replay_sweep", "replay"]

DEFAULT_RUNGS = (0.1, 0.15, 0.2, 0.4, 1.0)  # the best point of the measured frontier (BENCHMARKS.md)
MIN_POINTS = 6  # a prefix fit needs this many evaluations up to the rung
ALPHA = 0.05  # a configuration equal to the leader is stopped as a loser in at most this share of sweeps
TIE_ALPHA = 0.025  # per rung: a tie is stopped by TOST at this level (one comparison: its 95% interval inside
# ±δ, the evidence the final check asks for), Holm over the rung's comparisons
LAW_LEVEL = 0.95  # the level of a configuration's predicted interval under the law rule
LAW_BOOT = 200  # replicates behind each run's predicted tail
STOP_RULES = ("tail", "law", "both")
DEFAULT_STOP_RULE = "tail"  # the rule `scalerl replay` shows agreeing best at the least compute (BENCHMARKS.md)
AGREEMENTS = ("same", "equivalent", "undecided", "different")


def parse_rungs(text: str | Sequence[float]) -> tuple[float, ...]:
    """'0.25,0.5,1.0' -> (0.25, 0.5, 1.0): strictly increasing shares of the budget, ending at 1."""
    try:
        values = tuple(float(x) for x in (text.split(",") if isinstance(text, str) else text))
    except ValueError:
        raise ValueError(f"rungs must be comma-separated numbers in (0, 1] ending at 1, got {text!r}") from None
    if not values or any(not 0.0 < v <= 1.0 for v in values) or any(b <= a for a, b in zip(values, values[1:])) \
            or values[-1] != 1.0:
        raise ValueError(f"rungs must be strictly increasing shares of the budget in (0, 1], ending at 1; got {text!r}")
    return values


def parse_stop_rule(text: str) -> str:
    rule = str(text).strip().lower()
    if rule not in STOP_RULES:
        raise ValueError(f"stop rule must be one of {', '.join(STOP_RULES)}; got {text!r}")
    return rule


def rung_alpha(n_early_rungs: int, alpha: float = ALPHA) -> float:
    """The loser family's error rate at one rung: ALPHA split over the early rungs (Bonferroni over
    the looks), so an equal configuration is stopped as a loser at most ALPHA over the sweep."""
    return alpha / max(1, n_early_rungs)


def holm_levels(pvalues: Mapping[str, float], alpha: float) -> dict[str, float]:
    """Holm's step-down as interval levels. pvalues: comparison -> one-sided p (NaN: no test).
    Sorted by p, the i-th comparison (0-based, m in all) is tested at alpha / (m − i), i.e. its
    interval is the (1 − 2·alpha/(m − i)) two-sided one; from the first comparison that is not
    rejected on, every later one keeps that level (Holm stops there, and a larger p is not rejected
    at it). Returns comparison -> level; the caller decides each verdict from the interval at that
    level (`analysis.compare.verdict_of`)."""
    finite = sorted((p, k) for k, p in pvalues.items() if p is not None and math.isfinite(p))
    m = len(pvalues)
    out: dict[str, float] = {}
    stopped_at = None
    for i, (p, k) in enumerate(finite):
        a = alpha / (m - i) if stopped_at is None else stopped_at
        out[k] = 1.0 - 2.0 * a
        if stopped_at is None and not p < a:
            stopped_at = a
    last = out[finite[-1][1]] if finite else 1.0 - 2.0 * alpha / max(m, 1)
    for k in pvalues:
        out.setdefault(k, last)
    return out


@dataclasses.dataclass(frozen=True)
class Evidence:
    """One run's evidence at a rung."""

    measured: float  # tail at the rung (mean over the last 20% of [0, r·W])
    predicted: float = math.nan  # the law's tail at the full budget (NaN: no fit)
    draws: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)  # [K] its predictive draws


@dataclasses.dataclass(frozen=True)
class Decision:
    """One configuration at one rung: a line of `<sweep dir>/adaptive.jsonl`."""

    rung: float
    config: str
    best: str  # the leader it was compared with (for the leader itself: itself)
    metric: str  # "measured tail" | "predicted tail"
    diff: Difference | None  # config − best (None for the leader itself)
    verdict: str  # "best" | "worse" | "equivalent" | "inconclusive" | "final"
    action: str  # "continue" | "stop" (loser or tie) | "done" (the last rung)
    level: float = math.nan  # the level of diff's interval (the one that decided)
    rule: str = ""  # what decided: "tail: worse (Holm)", "tail: equivalent (TOST, Holm)", "law", "last rung", ...
    extra: tuple = ()  # (key, value) pairs recorded beside (the tie interval, the law's intervals)

    def as_dict(self) -> dict[str, Any]:
        num = lambda x: None if x is None or not math.isfinite(x) else float(x)  # noqa: E731
        d = self.diff
        out = {"rung": self.rung, "config": self.config, "best": self.best, "pair": [self.config, self.best],
               "metric": self.metric, "delta": num(d.delta) if d else None, "low": num(d.low) if d else None,
               "high": num(d.high) if d else None, "n": d.n if d else None, "paired": d.paired if d else None,
               "level": num(self.level) if d else None, "rule": self.rule, "verdict": self.verdict,
               "action": self.action}
        out.update({k: (num(v) if isinstance(v, float) else v) for k, v in self.extra})
        return out

    def text(self) -> str:
        if self.diff is None:
            return f"rung {self.rung:g}: {self.config} leads ({self.metric})"
        what = {"worse": "worse than", "equivalent": "equivalent to"}.get(self.verdict, "vs")
        level = f"{100 * self.level:.4g}% " if math.isfinite(self.level) else ""
        iv = (f"[{self.diff.low:+.3f}, {self.diff.high:+.3f}]" if math.isfinite(self.diff.low)
              else "(no paired interval)")
        return (f"rung {self.rung:g}: {self.config} {what} {self.best} by {self.diff.delta:+.3f} {iv} "
                f"({level}interval, n={self.diff.n}; {self.rule or self.metric}) -> {self.action}")


# ----------------------------------------------------------------------------- evidence


def law_evidence(c: np.ndarray, r: np.ndarray, cut: float, end: float, *, min_fraction: float,
                 n_boot: int = LAW_BOOT, seed: int = 0) -> tuple[float, np.ndarray] | None:
    """The law's prediction of a run's `tail` at the full budget `end` from its points up to `cut`
    (its center and its calibrated predictive draws [K]), or None when the prefix cannot be fitted.
    The fit starts at min_fraction × cut (the sweep's protocol: 0.4 for a forward ablation); the
    tail is the mean of the evaluations expected in [0.8·end, end] at the run's own spacing."""
    head = c <= cut * (1 + 1e-12)
    if head.sum() < MIN_POINTS:
        return None
    try:
        res = fit(c[head], r[head], r0=float(r[0]), min_compute=min_fraction * cut)
    except FitError:
        return None
    pos = c[head][c[head] > 0]
    spacing = float(np.median(np.diff(pos))) if pos.size >= 2 else TAIL_FRACTION * end
    m = max(1, int(round(TAIL_FRACTION * end / max(spacing, 1e-300))))
    at = np.linspace((1.0 - TAIL_FRACTION) * end, end, m)
    d = predictive_draws(res, at, n_boot=n_boot, seed=seed)
    return d.center, np.clip(d.draws, d.valid[0], d.valid[1])


def rung_evidence(curves: Mapping[Any, tuple[np.ndarray, np.ndarray]], end: float, rung: float, *,
                  law: bool = False, min_fraction: float = 0.4, n_boot: int = LAW_BOOT,
                  cache: dict | None = None) -> dict[Any, Evidence]:
    """Per run (key -> (compute [n], pass rate [n])): its evidence at `rung` of the budget `end`; with
    law, the law's prediction too (cached in `cache` by (key, rung, end): a prediction does not
    depend on which configurations are still running)."""
    cut = rung * end
    measured = tail_values(curves, cut)
    out = {}
    for i, (key, (c, r)) in enumerate(curves.items()):
        pred, draws = math.nan, None
        if law and rung < 1.0:
            ck = (key, float(rung), float(end), float(min_fraction), int(n_boot))
            if cache is not None and ck in cache:
                got = cache[ck]
            else:
                got = law_evidence(np.asarray(c, dtype=np.float64), np.asarray(r, dtype=np.float64), cut, end,
                                   min_fraction=min_fraction, n_boot=n_boot, seed=_stable_seed(key))
                if cache is not None:
                    cache[ck] = got
            if got is not None:
                pred, draws = got
        out[key] = Evidence(measured[key], pred, draws)
    return out


def _stable_seed(key: Any) -> int:
    """A seed of its own for each run (its draws must be independent of the other runs')."""
    import zlib

    return zlib.crc32(repr(key).encode()) & 0x7FFFFFFF


def config_prediction(evidence: Mapping[Any, Evidence], *, level: float = LAW_LEVEL,
                      seed: int = 0) -> tuple[float, float, float, int] | None:
    """(mean predicted tail, low, high, seeds) of one configuration: the mean over its seeds, its
    interval from the draws of that mean (each run's draws, independent) widened by the seed-to-seed
    spread of the predictions (a t(n − 1) term of scale sd/√n). None unless every run has one."""
    ev = list(evidence.values())
    if not ev or any(e.draws is None or not math.isfinite(e.predicted) for e in ev):
        return None
    n = len(ev)
    k = min(e.draws.size for e in ev)
    draws = np.mean([e.draws[:k] for e in ev], axis=0)  # [k]
    centers = np.array([e.predicted for e in ev])
    if n >= 2:
        rng = np.random.default_rng(seed)
        draws = draws + rng.standard_t(n - 1, k) * float(np.std(centers, ddof=1)) / math.sqrt(n)
    q = (1.0 - level) / 2.0
    lo, hi = np.quantile(draws, [q, 1.0 - q])
    return float(centers.mean()), float(lo), float(hi), n


# ----------------------------------------------------------------------------- the rule


def _one_sided_p(a: Mapping[Any, float], b: Mapping[Any, float]) -> float:
    """The paired one-sided p of a − b < 0 over the seeds both have (NaN: fewer than 2)."""
    from scipy import stats

    common = [k for k in a if k in b and np.isfinite(a[k]) and np.isfinite(b[k])]
    if len(common) < 2:
        return math.nan
    x = np.array([a[k] for k in common]) - np.array([b[k] for k in common])
    if float(np.std(x)) == 0.0:
        return 0.0 if x.mean() < 0 else 1.0
    return float(stats.ttest_1samp(x, 0.0, alternative="less").pvalue)


def _tost_p(a: Mapping[Any, float], b: Mapping[Any, float], equivalence: float) -> float:
    from analysis.compare import equivalence_p

    common = [k for k in a if k in b and np.isfinite(a[k]) and np.isfinite(b[k])]
    if len(common) < 2:
        return math.nan
    return equivalence_p([a[k] for k in common], [b[k] for k in common], equivalence, paired=True)


def _paired(a: Mapping[Any, float], b: Mapping[Any, float], level: float, equivalence: float) -> Difference:
    """a − b on the seeds both have (paired), or no interval when fewer than two are shared: a stop
    needs the pair's own paired evidence, never Welch's over unpaired runs."""
    common = {k for k in a if k in b and np.isfinite(a[k]) and np.isfinite(b[k])}
    if len(common) < 2:
        d = (float(np.mean([a[k] for k in common])) - float(np.mean([b[k] for k in common]))) if common else math.nan
        return Difference(d, math.nan, math.nan, len(common), len(a), len(b), True, math.nan, equivalence,
                          "inconclusive", f"{len(common)} shared seed(s): no paired interval")
    return difference({k: a[k] for k in common}, {k: b[k] for k in common}, equivalence=equivalence, level=level,
                      bounds=(-1.0, 1.0))


def _tail_rule(value: Mapping[str, Mapping[Any, float]], best: str, rung: float, *, equivalence: float,
               alpha: float, tie_alpha: float, keep_equivalent: bool) -> dict[str, Decision]:
    others = [c for c in value if c != best]
    # the leader is chosen by the data, so the sign of every difference is too: Holm on two-sided p-values
    # (each one-sided test at alpha/2 per step); the i-th loser interval is the two-sided 1 − alpha/(m − i)
    lose = holm_levels({c: _one_sided_p(value[c], value[best]) for c in others}, alpha / 2.0)
    tie = holm_levels({c: _tost_p(value[c], value[best], equivalence) for c in others}, tie_alpha)
    out = {}
    for c in others:
        d = _paired(value[c], value[best], lose[c], equivalence)
        t = _paired(value[c], value[best], tie[c], equivalence)
        extra = (("tie_low", t.low), ("tie_high", t.high), ("tie_level", tie[c]))
        if d.verdict == "worse":
            out[c] = Decision(rung, c, best, "measured tail", d, "worse", "stop", lose[c],
                              "tail: worse (own paired interval, Holm)", extra)
        elif t.verdict == "equivalent":  # a tie only on the tie family's own Holm level
            out[c] = Decision(rung, c, best, "measured tail", t, "equivalent",
                              "continue" if keep_equivalent else "stop", tie[c],
                              "tail: equivalent (own paired interval inside ±δ, TOST, Holm)", extra)
        else:  # (a loser-family interval inside ±δ is not a tie: ties are decided by their own family)
            verdict = "inconclusive" if d.verdict == "equivalent" else d.verdict
            why = f"tail: {verdict}" + (f" ({d.reason})" if d.reason else "")
            out[c] = Decision(rung, c, best, "measured tail", d, verdict, "continue", lose[c], why, extra)
    return out


def _law_rule(evidence: Mapping[str, Mapping[Any, Evidence]], rung: float, *,
              equivalence: float) -> dict[str, Decision]:
    preds = {c: config_prediction(per, seed=i) for i, (c, per) in enumerate(sorted(evidence.items()))}
    known = {c: p for c, p in preds.items() if p is not None}
    if len(known) < 2:
        return {}
    leader = max(known, key=lambda c: (known[c][1], c))
    _, llo, lhi, ln = known[leader]
    out = {}
    for c, (m, lo, hi, n) in known.items():
        if c == leader:
            continue
        low, high = lo - lhi, hi - llo  # every difference the two intervals allow
        verdict = verdict_of(low, high, math.nan)
        diff = Difference(m - known[leader][0], low, high, n, n, ln, False, math.nan, equivalence, verdict)
        extra = (("law_low", lo), ("law_high", hi), ("leader_low", llo), ("leader_high", lhi))
        out[c] = Decision(rung, c, leader, "predicted tail", diff, verdict, "stop" if verdict == "worse" else "continue",
                          LAW_LEVEL, "law: predicted upper bound below the leader's lower bound"
                          if verdict == "worse" else f"law: {verdict}", extra)
    return out


def decide_rung(evidence: Mapping[str, Mapping[Any, Evidence]], rung: float, *, n_early_rungs: int = 2,
                equivalence: float = DEFAULT_EQUIVALENCE, keep_equivalent: bool = False,
                stop_rule: str = DEFAULT_STOP_RULE, tie_alpha: float = TIE_ALPHA) -> list[Decision]:
    """The rule at one rung. evidence: config -> seed -> Evidence (the configurations still running;
    with the law rule each Evidence carries its predictive draws). n_early_rungs: how many rungs
    before the last the sweep has (ALPHA is split over them). At the last rung nothing stops: the
    zoo's 95% paired comparison of what is left with the best."""
    stop_rule = parse_stop_rule(stop_rule)
    value = {cfg: {s: e.measured for s, e in per.items()} for cfg, per in evidence.items()}
    means = {cfg: (float(np.nanmean(list(v.values()))) if any(np.isfinite(list(v.values()))) else -math.inf)
             for cfg, v in value.items()}
    best = max(means, key=lambda k: (means[k], k))
    if rung >= 1.0:  # what is left ran the full budget: the zoo's 95% comparison, nothing stopped
        out = [Decision(rung, best, best, "measured tail", None, "best", "done", rule="last rung")]
        for c in value:
            if c != best:
                d = _paired(value[c], value[best], LEVEL, equivalence)
                out.append(Decision(rung, c, best, "measured tail", d, d.verdict, "done", LEVEL, "last rung"))
        return out
    out = [Decision(rung, best, best, "measured tail", None, "best", "continue", rule="leader (measured tail)")]
    tail = (_tail_rule(value, best, rung, equivalence=equivalence, alpha=rung_alpha(n_early_rungs),
                       tie_alpha=tie_alpha, keep_equivalent=keep_equivalent) if stop_rule in ("tail", "both") else {})
    law = _law_rule(evidence, rung, equivalence=equivalence) if stop_rule in ("law", "both") else {}
    for c in value:
        if c == best:
            continue
        t, lw = tail.get(c), law.get(c)
        if t is not None and t.action == "stop":
            out.append(t)
        elif lw is not None and lw.action == "stop":
            out.append(lw)
        elif t is not None:
            out.append(t)
        elif lw is not None:
            out.append(lw)
        else:  # the law rule alone, and the law cannot predict this configuration (or the leader)
            d = _paired(value[c], value[best], 1.0 - 2.0 * rung_alpha(n_early_rungs), equivalence)
            out.append(Decision(rung, c, best, "measured tail", d, "inconclusive", "continue", math.nan,
                                "law: no prediction (the prefix cannot be fitted)"))
    return out


# ----------------------------------------------------------------------------- replay


def agreement_of(adaptive_best: str, full_best: str, check: Difference | None) -> str:
    """`same`, `equivalent`, `undecided` or `different` (module doc): the full data's verdict on the
    adaptive pick minus the full best (a pick the full data call better counts as equivalent; that
    needs a run without a tail, since the full best has the highest mean)."""
    if adaptive_best == full_best:
        return "same"
    verdict = check.verdict if check is not None else "inconclusive"
    return {"equivalent": "equivalent", "better": "equivalent", "worse": "different"}.get(verdict, "undecided")


@dataclasses.dataclass(frozen=True)
class ReplayResult:
    sweep: str
    compute_fraction: float
    full_best: str
    adaptive_best: str
    agreement: str  # same | equivalent | undecided | different
    stopped: list[dict]  # [{"config", "rung", "verdict", "rule"}]
    decisions: list[Decision]
    check: Difference | None  # adaptive best − full best on the full data (tail, paired)
    stop_rule: str = DEFAULT_STOP_RULE
    configs: int = 0

    @property
    def agrees(self) -> bool:
        return self.agreement in ("same", "equivalent")

    def as_dict(self) -> dict[str, Any]:
        num = lambda x: None if x is None or not math.isfinite(x) else float(x)  # noqa: E731
        c = self.check
        return {"sweep": self.sweep, "compute_fraction": self.compute_fraction, "full_best": self.full_best,
                "adaptive_best": self.adaptive_best, "agrees": self.agrees, "agreement": self.agreement,
                "stopped": [{"config": s["config"], "rung": s["rung"], "verdict": s["verdict"], "rule": s["rule"]}
                            for s in self.stopped],
                "stop_rule": self.stop_rule, "configs": self.configs,
                "difference": None if c is None else {"delta": num(c.delta), "low": num(c.low), "high": num(c.high),
                                                      "n": int(c.n), "paired": bool(c.paired),
                                                      "verdict": c.verdict}}

    def agreement_text(self) -> str:
        """The agreement in words, with the full data's interval."""
        c = self.check
        iv = "" if c is None or not math.isfinite(c.low) else f"Δ {c.delta:+.3f} [{c.low:+.3f}, {c.high:+.3f}]"
        return {"same": "same pick",
                "equivalent": f"equivalent on the full data ({iv})",
                "undecided": f"undecided: the full data cannot tell them apart ({iv})",
                "different": f"different: the adaptive pick is worse on the full data ({iv})"}[self.agreement]


def sweep_curves(ev: pd.DataFrame, runs: pd.DataFrame | None, compute: str, *, finished_only: bool = False
                 ) -> tuple[dict, dict, dict]:
    """Per run (key: its path) of one sweep: (compute [n], pass rate [n]), its configuration and its
    pairing key (`analysis.compare.seed_key`) — what the rule reads, in `replay` and in the live
    adaptive sweep alike. finished_only: runs that ran to their end (`analysis.runs.run_finished`)."""
    from analysis.runs import config_name, run_finished

    metas = {m["path"]: m for m in runs.to_dict("records")} if runs is not None else {}
    keep = set(metas) if runs is not None else None
    if finished_only and runs is not None and "status" in runs:
        errors = runs["error"] if "error" in runs else [None] * len(runs)
        keep = {p for p, st, err in zip(runs["path"], runs["status"], errors) if run_finished(st, err)}
    curves, cfg_of, seed_of = {}, {}, {}
    for path, g in ev.groupby("path", sort=False):
        if keep is not None and path not in keep:
            continue
        c, r = run_curve(g, compute)
        if not len(c):
            continue
        meta = metas.get(path, g.iloc[0].to_dict())
        curves[path] = (c, r)
        cfg_of[path] = str(meta.get("config") or config_name(meta["run"]))
        seed_of[path] = seed_key(meta.get("seed"), path)
    return curves, cfg_of, seed_of


def _protocol_start(sweep: str) -> float:
    """Where the sweep's fit protocol starts a fit, as a fraction of the fitted range."""
    from analysis.protocol import sweep_protocol

    return sweep_protocol(sweep).fallback_min_fraction


def replay_sweep(sweep: str, ev: pd.DataFrame, runs: pd.DataFrame | None = None, *, compute: str = "auto",
                 rungs: Sequence[float] = DEFAULT_RUNGS, equivalence: float = DEFAULT_EQUIVALENCE,
                 keep_equivalent: bool = False, stop_rule: str = DEFAULT_STOP_RULE,
                 tie_alpha: float = TIE_ALPHA, finish_leader: bool = True,
                 cache: dict | None = None) -> ReplayResult | None:
    """Simulate the adaptive rule on one finished sweep (None: fewer than two configurations).
    cache: shared between calls (rules, schedules) so each run's law prediction at a rung is made once."""
    rungs = parse_rungs(rungs)
    stop_rule = parse_stop_rule(stop_rule)
    compute = resolve_compute(runs if runs is not None else ev, compute)
    curves, cfg_of, seed_of = sweep_curves(ev, runs, compute, finished_only=True)
    configs = list(dict.fromkeys(cfg_of.values()))
    if len(configs) < 2:
        return None
    end = common_window(float(c[-1]) for c, _ in curves.values())
    n_early = sum(1 for r in rungs if r < 1.0)
    law = stop_rule in ("law", "both")
    start = _protocol_start(sweep) if law else 0.4
    alive = set(configs)
    decisions: list[Decision] = []
    stopped: list[dict] = []
    cost = {p: 1.0 for p in curves}  # share of W each run uses
    for rung in rungs:
        ev_r = rung_evidence({p: cr for p, cr in curves.items() if cfg_of[p] in alive}, end, rung,
                             law=law, min_fraction=start, cache=cache)
        by_cfg: dict[str, dict[Any, Evidence]] = {}
        for p, e in ev_r.items():
            by_cfg.setdefault(cfg_of[p], {})[seed_of[p]] = e
        if len(by_cfg) < 2 and rung < 1.0:
            continue
        rung_decisions = decide_rung(by_cfg, rung, n_early_rungs=n_early, equivalence=equivalence,
                                     keep_equivalent=keep_equivalent, stop_rule=stop_rule, tie_alpha=tie_alpha)
        decisions.extend(rung_decisions)
        for d in rung_decisions:
            if d.action == "stop":
                alive.discard(d.config)
                stopped.append({"config": d.config, "rung": rung, "verdict": d.verdict, "rule": d.rule})
                for p in curves:
                    if cfg_of[p] == d.config:
                        cost[p] = rung
        if not finish_leader and rung < 1.0 and len(alive) == 1:  # decided: nothing is left to compare with
            (leader,) = alive
            decisions.append(Decision(rung, leader, leader, "measured tail", None, "best", "done",
                                      rule="decided: every other configuration stopped"))
            for p in curves:
                if cfg_of[p] == leader:
                    cost[p] = rung
            break
    final = [d for d in decisions if d.verdict == "best" and d.action == "done"]
    adaptive_best = final[-1].config if final else sorted(alive)[0]
    full = tail_values(curves, end)
    by_cfg_full: dict[str, dict[Any, float]] = {}
    for p, v in full.items():
        by_cfg_full.setdefault(cfg_of[p], {})[seed_of[p]] = v
    means = {c: float(np.nanmean(list(v.values()))) for c, v in by_cfg_full.items()}
    full_best = max(means, key=lambda k: (means[k], k))
    check = None if adaptive_best == full_best else difference(
        by_cfg_full[adaptive_best], by_cfg_full[full_best], equivalence=equivalence, bounds=(-1.0, 1.0))
    return ReplayResult(sweep, float(np.mean(list(cost.values()))), full_best, adaptive_best,
                        agreement_of(adaptive_best, full_best, check), stopped, decisions, check, stop_rule,
                        len(configs))


def replay(path: str | Path, *, rungs: Sequence[float] = DEFAULT_RUNGS, equivalence: float = DEFAULT_EQUIVALENCE,
           keep_equivalent: bool = False, compute: str = "auto", sweeps: Sequence[str] | None = None,
           stop_rule: str = DEFAULT_STOP_RULE, tie_alpha: float = TIE_ALPHA, finish_leader: bool = True,
           cache: dict | None = None,
           tables: tuple[pd.DataFrame, pd.DataFrame] | None = None) -> list[ReplayResult]:
    """`replay_sweep` over every sweep under `path` (a sweep directory or a results root). tables:
    (eval rows, run table) when already loaded; cache: see `replay_sweep`."""
    ev, runs = tables if tables is not None else (load_runs(path, what="eval"), load_runs(path, what="runs"))
    if runs.empty:
        return []
    compute = resolve_compute(runs, compute)
    out = []
    for sweep in (sorted(runs["sweep"].dropna().unique()) if sweeps is None else sweeps):
        e, r = ev[ev["sweep"] == sweep], runs[runs["sweep"] == sweep]
        res = replay_sweep(sweep, e, r, compute=compute, rungs=rungs, equivalence=equivalence,
                           keep_equivalent=keep_equivalent, stop_rule=stop_rule, tie_alpha=tie_alpha,
                           finish_leader=finish_leader, cache=cache)
        if res is not None:
            out.append(res)
    return out
