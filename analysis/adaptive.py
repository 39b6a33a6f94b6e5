"""Adaptive sweeps: stop the configurations that have already lost, and replay the rule on finished sweeps.

The rule (`decide_rung`), at a rung r (a share of the sweep's compute budget W):
1. Every configuration × seed still running is cut at r·W. Its evidence for the end is
   - the law's prediction of `tail` at the full budget (the sigmoid fitted on the run's points up
     to r·W, its mean over the last 20% of [0, W]) when every run of both configurations compared
     has an identified A at this rung (95% profile interval at most 0.1 wide: `profile_A`);
   - otherwise the measured `tail` at the rung: the mean held-out pass rate over the last 20% of
     [0, r·W], every configuration cut at the same compute.
2. The current best is the configuration with the highest mean evidence.
3. Every other configuration is compared with the best seed by seed (`blocked_differences`: the
   seeds are blocks, as in `analysis.compare.difference`'s paired interval, and the run noise is
   pooled over every configuration still running, df = (k − 1)(n − 1); with two configurations it
   IS the paired t interval). `worse` stops it as a loser; `equivalent` (the two one-sided tests at
   5%, the standard TOST: the 90% interval inside ±δ) stops it as a tie. A tie costs at most δ of
   the best, so the rule stops ties on the standard test, where `scalerl compare`, which prints a
   claim, asks for its 95% interval inside ±δ. Each decision records its interval and level
   (its verdict is already known; `keep_equivalent` keeps ties running); `inconclusive` (and
   `better`, which cannot happen against the best) continues to the next rung. The interval that
   stops a loser is widened for the many looks (`stop_level`): the best is SELECTED as the highest
   mean, so each comparison errs on either side, and a configuration is compared at every early
   rung with each of the others' best; Bonferroni over the (configurations − 1) comparisons and
   the early rungs keeps the chance that a GIVEN configuration equal to the best is ever stopped as
   a loser at most ALPHA = 5% (measured by simulation in tests/test_adaptive.py). It is a
   per-configuration rate: with many equal configurations the chance that ANY one of them is
   stopped is larger (about 7-12% for 5-8 configurations and two early rungs).
4. At the last rung (r = 1) nothing is stopped: what is left ran the full budget, and the sweep's
   best is the best of it by measured `tail`.

`replay` simulates the rule on finished sweeps by cutting each run's logs at each rung: the compute
the adaptive sweep would have used (a stopped run costs r·W, a survivor W, against W for every run
of the full sweep: the mean share of W a run uses, which is the share of the sweep's compute when
every run trains to the same budget, as new tiny runs do), the full sweep's best, the adaptive
best, and whether they agree (the adaptive best is not `worse` than the full best on the full
data, paired by seed). Only finished runs are replayed.

    rows = replay("results/tiny", rungs=(0.25, 0.5, 1.0))     # one ReplayResult per sweep
    scalerl replay results/tiny --json
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from analysis.compare import (DEFAULT_EQUIVALENCE, LEVEL, TAIL_FRACTION, Difference, common_window,
                              difference, seed_key, tail_values, tost_alpha, verdict_of)
from analysis.runs import epoch_info, load_runs, resolve_compute, run_curve
from analysis.scaling_law import FitError, fit, profile_A, sigmoid

__all__ = ["DEFAULT_RUNGS", "ALPHA", "TIE_LEVEL", "stop_level", "parse_rungs", "blocked_differences", "Evidence",
           "Decision", "ReplayResult", "rung_evidence", "decide_rung", "sweep_curves", "replay_sweep", "replay"]

DEFAULT_RUNGS = (0.25, 0.5, 1.0)
MIN_POINTS = 6  # a prefix fit needs this many evaluations up to the rung
ALPHA = 0.05  # the rule's error rate: an equal configuration stopped as a loser at most this often
TIE_LEVEL = 0.90  # a tie is stopped when this interval lies inside ±δ (TOST at 5%, the standard test)


def stop_level(n_configs: int, n_early_rungs: int, alpha: float = ALPHA) -> float:
    """The interval level of a stop decision: 1 − alpha / ((configurations − 1) × early rungs)."""
    return 1.0 - alpha / (max(1, n_configs - 1) * max(1, n_early_rungs))


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


def blocked_differences(values: Mapping[str, Mapping[Any, float]], best: str, *, level: float = 0.95,
                        equivalence: float = DEFAULT_EQUIVALENCE) -> dict[str, Difference]:
    """Every configuration − `best`, seeds as blocks (a randomized block design).

    values: config -> seed -> value. Only the seeds every configuration has count (n of them, k
    configurations): X [k, n]. The seed effect is removed as in a paired comparison, and the run
    noise is pooled over all k configurations: s² = Σ residual² / ((k − 1)(n − 1)) with residual =
    X − row mean − column mean + grand mean; a difference of two configuration means has standard
    error s·√(2/n) and t(df) quantiles. With k = 2 this is exactly the paired t interval. Falls back
    to `analysis.compare.difference` (per pair) when fewer than 2 common seeds."""
    from scipy import stats

    configs = list(values)
    common = sorted(set.intersection(*(set(k for k, v in values[c].items() if v is not None and np.isfinite(v))
                                       for c in configs)), key=str)
    if len(common) < 2 or len(configs) < 2:
        return {c: difference(values[c], values[best], equivalence=equivalence, level=level, bounds=(-1.0, 1.0))
                for c in configs if c != best}
    X = np.array([[float(values[c][s]) for s in common] for c in configs])  # [k, n]
    k, n = X.shape
    resid = X - X.mean(axis=1, keepdims=True) - X.mean(axis=0, keepdims=True) + X.mean()  # [k, n]
    df = (k - 1) * (n - 1)
    se = math.sqrt(float(np.sum(resid ** 2)) / df) * math.sqrt(2.0 / n)
    q = float(stats.t.ppf(0.5 + level / 2.0, df))
    b = configs.index(best)
    out = {}
    for i, c in enumerate(configs):
        if c == best:
            continue
        delta = float(X[i].mean() - X[b].mean())
        low, high = max(delta - q * se, -1.0), min(delta + q * se, 1.0)
        if se > 0:  # two one-sided tests against ±δ with the pooled error
            p = max(float(stats.t.sf((delta + equivalence) / se, df)), float(stats.t.cdf((delta - equivalence) / se, df)))
        else:
            p = 0.0 if abs(delta) < equivalence else 1.0
        verdict = verdict_of(low, high, p, tost_alpha(level))
        out[c] = Difference(delta, low, high, n, n, n, True, p, equivalence, verdict)
    return out


@dataclasses.dataclass(frozen=True)
class Evidence:
    """One run's evidence at a rung."""

    measured: float  # tail at the rung (mean over the last 20% of [0, r·W])
    predicted: float  # the law's tail at the full budget (NaN: no identified fit)


@dataclasses.dataclass(frozen=True)
class Decision:
    """One configuration at one rung: a line of `<sweep dir>/adaptive.jsonl`."""

    rung: float
    config: str
    best: str
    metric: str  # "predicted tail" | "measured tail"
    diff: Difference | None  # config − best (None for the best itself)
    verdict: str  # "best" | "worse" | "equivalent" | "inconclusive" | "final"
    action: str  # "continue" | "stop" (loser or tie) | "done" (the last rung)
    level: float = math.nan  # the level of diff's interval (the one that decided)

    def as_dict(self) -> dict[str, Any]:
        num = lambda x: None if x is None or not math.isfinite(x) else float(x)  # noqa: E731
        d = self.diff
        return {"rung": self.rung, "config": self.config, "best": self.best, "metric": self.metric,
                "delta": num(d.delta) if d else None, "low": num(d.low) if d else None,
                "high": num(d.high) if d else None, "n": d.n if d else None, "paired": d.paired if d else None,
                "level": num(self.level) if d else None, "verdict": self.verdict, "action": self.action}

    def text(self) -> str:
        if self.diff is None:
            return f"rung {self.rung:g}: {self.config} is the best ({self.metric})"
        what = {"worse": "worse than", "equivalent": "equivalent to"}.get(self.verdict, "vs")
        level = f"{100 * self.level:.4g}% " if math.isfinite(self.level) else ""
        return (f"rung {self.rung:g}: {self.config} {what} {self.best} by {self.diff.delta:+.3f} "
                f"[{self.diff.low:+.3f}, {self.diff.high:+.3f}] ({level}interval; {self.metric}) -> {self.action}")


def _prefix_prediction(c: np.ndarray, r: np.ndarray, cut: float, end: float, epoch1: float | None) -> float:
    """The law's tail at the full budget from the run's points up to `cut`: NaN unless the prefix
    fit's A is identified. The fit starts at the end of epoch 1 when that lies in the first half of
    the prefix, else at 0.4 of it (the paper's forward-ablation start)."""
    head = c <= cut * (1 + 1e-12)
    if head.sum() < MIN_POINTS:
        return math.nan
    start = epoch1 if epoch1 is not None and epoch1 < 0.5 * cut else 0.4 * cut
    try:
        res = fit(c[head], r[head], r0=float(r[0]), min_compute=start)
    except FitError:
        return math.nan
    if not profile_A(res).identified:
        return math.nan
    grid = np.linspace((1.0 - TAIL_FRACTION) * end, end, 9)  # [9] the tail window at the full budget
    return float(np.mean(sigmoid(grid, res.A, res.B, res.C_mid, res.R0)))


def rung_evidence(curves: Mapping[Any, tuple[np.ndarray, np.ndarray]], end: float, rung: float,
                  epoch1: Mapping[Any, float | None] | None = None, *, predict: bool = True) -> dict[Any, Evidence]:
    """Per run (key -> (compute [n], pass rate [n])): its evidence at `rung` of the budget `end`."""
    cut = rung * end
    measured = tail_values(curves, cut)
    out = {}
    for key, (c, r) in curves.items():
        pred = (_prefix_prediction(np.asarray(c), np.asarray(r), cut, end, (epoch1 or {}).get(key))
                if predict and rung < 1.0 else math.nan)
        out[key] = Evidence(measured[key], pred)
    return out


def decide_rung(evidence: Mapping[str, Mapping[Any, Evidence]], rung: float, *,
                equivalence: float = DEFAULT_EQUIVALENCE, keep_equivalent: bool = False,
                level: float = 0.95) -> list[Decision]:
    """The rule at one rung. evidence: config -> seed -> Evidence (the configurations still running).
    The law's prediction is used only when every run of the sweep still running has one (else a
    pair would compare a prediction with a measurement); otherwise the measured tail. level: the
    interval that stops a loser (`stop_level`); a tie is `equivalent` when its `TIE_LEVEL` (90%)
    interval lies inside ±δ; at the last rung every comparison is the 95% one."""
    all_pred = all(math.isfinite(e.predicted) for per in evidence.values() for e in per.values())
    metric = "predicted tail" if all_pred and rung < 1.0 else "measured tail"
    value = {cfg: {s: (e.predicted if all_pred and rung < 1.0 else e.measured) for s, e in per.items()}
             for cfg, per in evidence.items()}
    means = {cfg: float(np.nanmean(list(v.values()))) if any(np.isfinite(list(v.values()))) else -math.inf
             for cfg, v in value.items()}
    best = max(means, key=lambda k: (means[k], k))
    out = [Decision(rung, best, best, metric, None, "best", "done" if rung >= 1.0 else "continue")]
    if rung >= 1.0:  # what is left ran the full budget: the zoo's 95% comparison, nothing stopped
        final = blocked_differences(value, best, level=LEVEL, equivalence=equivalence)
        return out + [Decision(rung, c, best, metric, d, d.verdict, "done", LEVEL) for c, d in final.items()]
    # a loser is stopped on the interval widened for the many looks, a tie on the 90% interval (TOST
    # at 5%); each decision carries the interval, and its level, that made it
    losers = blocked_differences(value, best, level=level, equivalence=equivalence)
    ties = blocked_differences(value, best, level=TIE_LEVEL, equivalence=equivalence)
    for cfg in value:
        if cfg == best:
            continue
        d, tie = losers[cfg], ties[cfg]
        if d.verdict == "worse":
            out.append(Decision(rung, cfg, best, metric, d, d.verdict, "stop", level))
        elif math.isfinite(tie.p_equivalent) and tie.p_equivalent < tost_alpha(TIE_LEVEL):  # inside ±δ, even
            # where that interval also excludes 0: within δ of the best either way
            out.append(Decision(rung, cfg, best, metric, tie, "equivalent", "continue" if keep_equivalent else "stop",
                                TIE_LEVEL))
        else:
            out.append(Decision(rung, cfg, best, metric, d, d.verdict, "continue", level))
    return out


@dataclasses.dataclass(frozen=True)
class ReplayResult:
    sweep: str
    compute_fraction: float
    full_best: str
    adaptive_best: str
    agrees: bool
    stopped: list[dict]  # [{"config", "rung", "verdict"}]
    decisions: list[Decision]
    check: Difference | None  # adaptive best − full best on the full data (tail, paired)

    def as_dict(self) -> dict[str, Any]:
        return {"sweep": self.sweep, "compute_fraction": self.compute_fraction, "full_best": self.full_best,
                "adaptive_best": self.adaptive_best, "agrees": self.agrees,
                "stopped": [{"config": s["config"], "rung": s["rung"]} for s in self.stopped]}


def sweep_curves(ev: pd.DataFrame, runs: pd.DataFrame | None, compute: str, *, finished_only: bool = False
                 ) -> tuple[dict, dict, dict, dict]:
    """Per run (key: its path) of one sweep: (compute [n], pass rate [n]), its configuration, its
    pairing key (`analysis.compare.seed_key`) and the compute at the end of its epoch 1 — what the
    rule reads, in `replay` and in the live adaptive sweep alike. finished_only: runs that ran to
    their end (`analysis.runs.run_finished`)."""
    from analysis.runs import config_name, run_finished

    metas = {m["path"]: m for m in runs.to_dict("records")} if runs is not None else {}
    keep = set(metas) if runs is not None else None
    if finished_only and runs is not None and "status" in runs:
        errors = runs["error"] if "error" in runs else [None] * len(runs)
        keep = {p for p, st, err in zip(runs["path"], runs["status"], errors) if run_finished(st, err)}
    curves, cfg_of, seed_of, ep1 = {}, {}, {}, {}
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
        ep1[path] = epoch_info(meta, compute)[0]
    return curves, cfg_of, seed_of, ep1


def replay_sweep(sweep: str, ev: pd.DataFrame, runs: pd.DataFrame | None = None, *, compute: str = "auto",
                 rungs: Sequence[float] = DEFAULT_RUNGS, equivalence: float = DEFAULT_EQUIVALENCE,
                 keep_equivalent: bool = False, predict: bool = True) -> ReplayResult | None:
    """Simulate the adaptive rule on one finished sweep (None: fewer than two configurations)."""
    rungs = parse_rungs(rungs)
    compute = resolve_compute(runs if runs is not None else ev, compute)
    curves, cfg_of, seed_of, ep1 = sweep_curves(ev, runs, compute, finished_only=True)
    configs = list(dict.fromkeys(cfg_of.values()))
    if len(configs) < 2:
        return None
    end = common_window(float(c[-1]) for c, _ in curves.values())
    level = stop_level(len(configs), sum(1 for r in rungs if r < 1.0))
    alive = set(configs)
    decisions: list[Decision] = []
    stopped: list[dict] = []
    cost = {p: 1.0 for p in curves}  # share of W each run uses
    for rung in rungs:
        ev_r = rung_evidence({p: cr for p, cr in curves.items() if cfg_of[p] in alive}, end, rung,
                             ep1, predict=predict)
        by_cfg: dict[str, dict[Any, Evidence]] = {}
        for p, e in ev_r.items():
            by_cfg.setdefault(cfg_of[p], {})[seed_of[p]] = e
        if len(by_cfg) < 2 and rung < 1.0:
            continue
        rung_decisions = decide_rung(by_cfg, rung, equivalence=equivalence, keep_equivalent=keep_equivalent,
                                     level=level)
        decisions.extend(rung_decisions)
        for d in rung_decisions:
            if d.action == "stop":
                alive.discard(d.config)
                stopped.append({"config": d.config, "rung": rung, "verdict": d.verdict})
                for p in curves:
                    if cfg_of[p] == d.config:
                        cost[p] = rung
    final = [d for d in decisions if d.rung == rungs[-1] and d.verdict == "best"]
    adaptive_best = final[0].config if final else next(iter(alive))
    full = tail_values(curves, end)
    by_cfg_full: dict[str, dict[Any, float]] = {}
    for p, v in full.items():
        by_cfg_full.setdefault(cfg_of[p], {})[seed_of[p]] = v
    means = {c: float(np.nanmean(list(v.values()))) for c, v in by_cfg_full.items()}
    full_best = max(means, key=lambda k: (means[k], k))
    check = None if adaptive_best == full_best else difference(
        by_cfg_full[adaptive_best], by_cfg_full[full_best], equivalence=equivalence, bounds=(-1.0, 1.0))
    agrees = check is None or check.verdict != "worse"
    return ReplayResult(sweep, float(np.mean(list(cost.values()))), full_best, adaptive_best, agrees, stopped,
                        decisions, check)


def replay(path: str | Path, *, rungs: Sequence[float] = DEFAULT_RUNGS, equivalence: float = DEFAULT_EQUIVALENCE,
           keep_equivalent: bool = False, compute: str = "auto", sweeps: Sequence[str] | None = None,
           predict: bool = True) -> list[ReplayResult]:
    """`replay_sweep` over every sweep under `path` (a sweep directory or a results root)."""
    ev, runs = load_runs(path, what="eval"), load_runs(path, what="runs")
    if runs.empty:
        return []
    compute = resolve_compute(runs, compute)
    out = []
    for sweep in (sorted(runs["sweep"].dropna().unique()) if sweeps is None else sweeps):
        e, r = ev[ev["sweep"] == sweep], runs[runs["sweep"] == sweep]
        res = replay_sweep(sweep, e, r, compute=compute, rungs=rungs, equivalence=equivalence,
                           keep_equivalent=keep_equivalent, predict=predict)
        if res is not None:
            out.append(res)
    return out
