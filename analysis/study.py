"""One sweep, summarised the way the reproduction report and `scalerl fit` show it.

    summaries = summarize("results/tiny")                   # {sweep: SweepSummary}
    s = summaries["fp32_head"]
    s.runs      # one row per run: the protocol fit (A, B, C_mid, R0, min_compute rule, contention),
                # A's profile interval and whether it is identified, and `tail` (the measured metric)
    s.configs   # one row per configuration (run name without -s<seed>): A, B and tail over seeds
                # with 95% t-intervals (inside [0, 1] for A and tail), rank by the paper's rule
    s.pairs     # every pair of configurations on every metric (A, tail, auc) (analysis/compare.py)
    s.claims    # one row per claim of the paper's finding (analysis/findings.py), judged on each
                # metric: verdict_A and verdict_tail (agree / disagree / inconclusive / not run /
                # not testable)

Verdicts come from intervals (analysis/compare.py): a configuration pair is `better`, `worse`,
`equivalent` (two one-sided tests inside ±`equivalence`) or `inconclusive`, paired by seed when
the configurations share seeds. A paper claim maps onto them:
- "A(a) > A(b)" (`a_higher_A`): agrees on `better`, disagrees on `worse`, `not reproduced` on
  `equivalent` (shown inside ±δ: the paper's difference is not there);
- "A(a) ≈ A(b)" (`same_A`): agrees only on `equivalent`, disagrees on `better` / `worse`;
- "a better than b" (`a_better`): on `tail` and `auc`, `better` / `worse` (`not reproduced` on
  `equivalent`); on A, `better` / `worse`, and when A is `equivalent` the efficiency at the common
  A decides (B and ln C_mid, each with its own paired interval, never a bare point difference);
- "a not worse than b" (`a_not_worse`): agrees on `better` or `equivalent`, disagrees on `worse`;
- `peak_A`: the interior configuration with the highest mean is `better` than both ends
  (`not reproduced` when it is equivalent to one);
- `seed_spread`: the seeds' values lie within ±0.02 (half their range).
Every claim is judged on each metric (A, tail, auc) and printed beside the meters of its
mechanism (`Finding.meters`, analysis/meters.py). Anything else is `inconclusive`; on A, so is every comparison involving a run whose A is not
identified ("A not identified: run longer"). A finding whose mechanism has nothing to act on in
these runs (`Mechanism`: the FP32 head where the log-prob gap it shrinks is as small without it)
gets `not testable` on every claim, with the measurement, instead of a verdict (`mechanism_check`).

The `rank` column keeps the paper's own rule (A within a margin measured from the seeds, then B,
then C_mid; `compare_configs`): it orders configurations the way the paper's tables do, and
decides no verdict.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from analysis.compare import (A_NOT_IDENTIFIED, DEFAULT_EQUIVALENCE, METRICS, Efficiency, PairComparison,
                              auc_values, common_window, compare_pair, compare_sweep, difference, efficiency,
                              parse_equivalence, seed_key, tail_sampling_sd, tail_values, window_start)
from analysis.findings import FINDINGS, Claim, Mechanism
from analysis.meters import meters_text
from analysis.protocol import Margin, Protocol, get_protocol, margin_from_seed_fits, sweep_protocol, t_quantile
from analysis.runs import fit_runs, load_runs, resolve_compute, run_curve, run_sampling_variance
from analysis.scaling_law import A_MARGIN, FitResult, refit_at

__all__ = ["SweepSummary", "ConfigComparison", "compare_configs", "summarize", "summarize_sweep",
           "seed_interval", "judge_claim", "claim_verdict", "parse_margin", "mechanism_check", "SEED_SWEEP", "VERDICTS",
           "CLAIM_METRICS", "NOT_TESTABLE"]

SEED_SWEEP = "scalerl_seeds"  # the paper's Fig 8a: where a sweep without seeds takes its margin from
NOT_TESTABLE = "not testable"  # the claim's mechanism has nothing to act on at this scale (`mechanism_check`)
NOT_REPRODUCED = "not reproduced"  # the paper says a is higher; ours: equivalent (inside ±δ)
VERDICTS = ("agree", "disagree", "not reproduced", "inconclusive", "not run", NOT_TESTABLE)
CLAIM_METRICS = METRICS  # A, tail, auc
SEED_SPREAD = A_MARGIN  # the paper's seeds fall within ±0.015; it adopts ±0.02
B_TOL = 0.01  # the paper's rule has no margin on B; without seeds a |ΔB| <= 0.01 is a tie (scaling_law.compare)
C_MID_RTOL = 0.01


def parse_margin(value: Any) -> str | float:
    """'auto' (measured from seeds) or a number >= 0."""
    if value is None or str(value).strip().lower() == "auto":
        return "auto"
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"margin must be 'auto' or a number >= 0, got {value!r}") from None
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"margin must be 'auto' or a number >= 0, got {value!r}")
    return x


def seed_interval(values: Sequence[float], level: float = 0.95,
                  bounds: tuple[float, float] | None = None) -> tuple[float, float, float]:
    """(mean, lo, hi): the t-interval of the mean over seeds; lo = hi = mean with one seed.
    `bounds` clips the interval to the quantity's valid range (e.g. (0, 1) for A and pass rates)."""
    x = np.asarray([v for v in values if v is not None and np.isfinite(v)], dtype=np.float64)
    if x.size == 0:
        return math.nan, math.nan, math.nan
    m = float(x.mean())
    if x.size == 1:
        return m, m, m
    h = t_quantile(x.size - 1, level) * float(x.std(ddof=1)) / math.sqrt(x.size)
    lo, hi = m - h, m + h
    if bounds is not None:
        lo, hi = max(lo, bounds[0]), min(hi, bounds[1])
    return m, lo, hi


# ----------------------------------------------------------------------------- comparison


@dataclasses.dataclass(frozen=True)
class ConfigComparison:
    a: str
    b: str
    n_a: int
    n_b: int
    A_a: float  # mean fitted A over seeds
    A_b: float
    margin: float
    winner: str  # "a" | "b" | "tie"
    decided_by: str  # "A" | "B" | "C_mid" | "tie"
    common_A: float | None = None
    B_a: float | None = None  # mean B at the common A
    B_b: float | None = None
    b_margin: float | None = None
    C_mid_a: float | None = None
    C_mid_b: float | None = None

    @property
    def dA(self) -> float:
        return self.A_a - self.A_b

    def text(self) -> str:
        head = f"A {self.A_a:.3f} vs {self.A_b:.3f} (Δ {self.dA:+.3f}, margin {self.margin:.3f})"
        if self.decided_by == "A":
            return f"{head}: {self._name()} by A"
        tail = f"; at A={self.common_A:.3f}: B {self.B_a:.2f} vs {self.B_b:.2f} (tol {self.b_margin:.2f})"
        if self.decided_by == "B":
            return f"{head}{tail}: {self._name()} by B"
        if self.decided_by == "C_mid":
            return f"{head}{tail}; C_mid {self.C_mid_a:.3g} vs {self.C_mid_b:.3g}: {self._name()} by C_mid"
        return f"{head}{tail}: tie"

    def _name(self) -> str:
        return {"a": self.a, "b": self.b}.get(self.winner, "tie")


def _pooled_std(groups: Sequence[Sequence[float]]) -> tuple[float | None, int]:
    ss, df = 0.0, 0
    for g in groups:
        x = np.asarray(g, dtype=np.float64)
        if x.size >= 2:
            ss += float(np.sum((x - x.mean()) ** 2))
            df += x.size - 1
    return (math.sqrt(ss / df), df) if df else (None, 0)


def compare_configs(
    a: str, fits_a: Sequence[FitResult], b: str, fits_b: Sequence[FitResult], margin: Margin
) -> ConfigComparison:
    """The paper's rule between two configurations given their per-seed fits (see module doc)."""
    if not fits_a or not fits_b:
        raise ValueError(f"compare_configs needs fits of both configs; got {len(fits_a)} of {a!r}, "
                         f"{len(fits_b)} of {b!r}")
    na, nb = len(fits_a), len(fits_b)
    A_a = float(np.mean([f.A for f in fits_a]))
    A_b = float(np.mean([f.A for f in fits_b]))
    m = margin.for_pair(na, nb)
    base = dict(a=a, b=b, n_a=na, n_b=nb, A_a=A_a, A_b=A_b, margin=m)
    if abs(A_a - A_b) > m:
        return ConfigComparison(**base, winner="a" if A_a > A_b else "b", decided_by="A")
    common = 0.5 * (A_a + A_b)
    grid = np.unique(np.concatenate([f.c_mid_grid for f in (*fits_a, *fits_b)]))
    ra = [refit_at(f, common, grid) for f in fits_a]
    rb = [refit_at(f, common, grid) for f in fits_b]
    Ba, Bb = [f.B for f in ra], [f.B for f in rb]
    la, lb = [math.log(f.C_mid) for f in ra], [math.log(f.C_mid) for f in rb]
    scale = math.sqrt(1.0 / na + 1.0 / nb)
    s_b, df_b = _pooled_std([Ba, Bb]) if na >= 2 and nb >= 2 else (None, 0)
    b_margin = t_quantile(df_b) * s_b * scale if s_b is not None else B_TOL
    s_c, df_c = _pooled_std([la, lb]) if na >= 2 and nb >= 2 else (None, 0)
    more = dict(common_A=common, B_a=float(np.mean(Ba)), B_b=float(np.mean(Bb)), b_margin=b_margin,
                C_mid_a=float(np.exp(np.mean(la))), C_mid_b=float(np.exp(np.mean(lb))))
    if abs(more["B_a"] - more["B_b"]) > b_margin:
        return ConfigComparison(**base, **more, winner="a" if more["B_a"] > more["B_b"] else "b", decided_by="B")
    dlog = float(np.mean(la) - np.mean(lb))
    if s_c is not None:
        c_tied = abs(dlog) <= t_quantile(df_c) * s_c * scale
    else:
        c_tied = abs(more["C_mid_a"] - more["C_mid_b"]) / max(more["C_mid_a"], more["C_mid_b"]) <= C_MID_RTOL
    if not c_tied:
        return ConfigComparison(**base, **more, winner="a" if dlog < 0 else "b", decided_by="C_mid")
    return ConfigComparison(**base, **more, winner="tie", decided_by="tie")


# ----------------------------------------------------------------------------- claims

# How a pair's verdict (a relative to b) reads for each kind of claim; anything else is inconclusive.
_CLAIM_READING = {
    "a_higher_A": {"better": "agree", "worse": "disagree", "equivalent": NOT_REPRODUCED},
    "same_A": {"equivalent": "agree", "better": "disagree", "worse": "disagree"},
    "a_better": {"better": "agree", "worse": "disagree", "equivalent": NOT_REPRODUCED},
    "a_not_worse": {"better": "agree", "equivalent": "agree", "worse": "disagree"},
}


def claim_verdict(kind: str, pair_verdict: str) -> str:
    """The claim's verdict from a pair verdict (better/worse/equivalent/inconclusive of a vs b)."""
    if kind not in _CLAIM_READING:
        raise ValueError(f"claim kind {kind!r} does not compare two configs; choose from {', '.join(_CLAIM_READING)}")
    return _CLAIM_READING[kind].get(pair_verdict, "inconclusive")


def judge_claim(claim: Claim, pair: PairComparison | None, eff: Efficiency | None = None) -> tuple[str, str]:
    """(verdict, why) of a two-config claim on one metric from the pair's comparison (None: a
    config is missing). On A, `a_better` with A `equivalent` goes to the efficiency at the common
    A (`eff`): B higher or C_mid lower, each by its own interval."""
    if pair is None:
        return "not run", ""
    if pair.metric == "A" and not pair.identified:
        return "inconclusive", A_NOT_IDENTIFIED
    v = claim_verdict(claim.kind, pair.verdict)
    if claim.kind == "a_better" and pair.metric == "A" and pair.verdict == "equivalent":
        side = eff.favours() if eff is not None else ""
        if side == "a":
            return "agree", "A equivalent; more efficient at the common A"
        if side == "b":
            return "disagree", f"A equivalent; {claim.b} more efficient at the common A"
        return "inconclusive", "A equivalent; efficiency not shown different"
    if v == NOT_REPRODUCED:
        return v, "equivalent (inside ±δ), not higher"
    if v == "inconclusive":
        return v, pair.reason or "the interval includes 0 and leaves ±δ"
    return v, ""


def _order_key(value: Any, config: str) -> tuple:
    try:
        return (0, float(value), config)
    except (TypeError, ValueError):
        import re

        m = re.search(r"(-?\d+(?:\.\d+)?(?:e-?\d+)?)", config)
        return (0, float(m.group(1)), config) if m else (1, 0.0, config)


def _judge_peak(configs: pd.DataFrame, runs: pd.DataFrame, sweep: str, metric: str,
                equivalence: float) -> tuple[str, str, str]:
    """peak_A over the configs ordered by value, on `metric`: (verdict, ours, why). The interior
    configuration with the highest mean must be `better` than both ends."""
    col = metric
    c = configs.dropna(subset=[col])
    if len(c) < 3:
        return "not run", f"{len(c)} configs with {metric} (need 3)", ""
    c = c.assign(_k=[_order_key(v, n) for v, n in zip(c["value"], c["config"])]).sort_values("_k")
    names, means = c["config"].tolist(), c[col].to_numpy()
    ours = ", ".join(f"{nm} {x:.3f}" for nm, x in zip(names, means))
    if metric == "A":
        sub = runs[runs["config"].isin(names) & runs["A"].notna()]
        if not bool(sub["A_identified"].fillna(False).all()):
            return "inconclusive", ours, A_NOT_IDENTIFIED
    i = int(np.argmax(means))
    pair = lambda a, b: compare_pair(runs, sweep, a, b, metric, equivalence=equivalence)  # noqa: E731
    if 0 < i < len(names) - 1:
        first, last = pair(names[i], names[0]), pair(names[i], names[-1])
        ours += f"; {names[i]} vs {names[0]}: {first.diff.text()}, vs {names[-1]}: {last.diff.text()}"
        if first.verdict == "better" and last.verdict == "better":
            return "agree", ours, ""
        if "equivalent" in (first.verdict, last.verdict):
            return NOT_REPRODUCED, ours, "the interior peak is equivalent to an end (inside ±δ)"
        return "inconclusive", ours, "the interior peak is not shown above both ends"
    inner = int(np.argmax(means[1:-1])) + 1
    p = pair(names[i], names[inner])
    ours += f"; {names[i]} vs {names[inner]}: {p.diff.text()}"
    if p.verdict == "better":
        return "disagree", ours, f"highest at the end value {names[i]}"
    return "inconclusive", ours, "the highest mean is at an end, not shown above the interior"


def _judge_seed_spread(runs: pd.DataFrame, metric: str) -> tuple[str, str, str]:
    x = runs[metric].dropna().to_numpy()
    if x.size < 2:
        return "not run", f"{x.size} run(s) with {metric}", ""
    half = 0.5 * float(x.max() - x.min())
    ours = f"{metric} {x.mean():.3f}, seeds within ±{half:.3f} (std {x.std(ddof=1):.3f}, {x.size} seeds)"
    if metric == "A" and not bool(runs.loc[runs["A"].notna(), "A_identified"].fillna(False).all()):
        return "inconclusive", ours, A_NOT_IDENTIFIED
    if half <= SEED_SPREAD:
        return "agree", ours, ""
    return "disagree", ours, f"our seeds spread ±{half:.3f} > the paper's ±{SEED_SPREAD}"


# ----------------------------------------------------------------------------- the summary


@dataclasses.dataclass
class SweepSummary:
    sweep: str
    protocol: Protocol
    margin: Margin
    runs: pd.DataFrame  # per run (fit_runs columns + margin, tail, paper_config)
    configs: pd.DataFrame  # per config
    claims: pd.DataFrame  # per claim of the paper's finding, judged on each metric
    fits: dict[str, list[FitResult]]  # config -> fits of its seeds
    pairs: list[PairComparison] = dataclasses.field(default_factory=list)  # every pair, every metric (A, tail, auc)
    compute: str = "compute_hours"  # the compute axis the fits and the tail window use
    tail_end: float = math.nan  # the end of the sweep's common compute window
    equivalence: float = DEFAULT_EQUIVALENCE

    @property
    def contended(self) -> list[str]:
        return self.runs.loc[self.runs["contended"].fillna(False).astype(bool), "run"].tolist()


def _config_table(runs: pd.DataFrame, margin: Margin) -> pd.DataFrame:
    rows = []
    for config, g in runs.groupby("config", sort=False):
        ok = g.dropna(subset=["A"])
        A, A_lo, A_hi = seed_interval(ok["A"], bounds=(0.0, 1.0))
        B, B_lo, B_hi = seed_interval(ok["B"])
        T, T_lo, T_hi = seed_interval(g["tail"] if "tail" in g else [], bounds=(0.0, 1.0))
        U, U_lo, U_hi = seed_interval(g["auc"] if "auc" in g else [], bounds=(0.0, 1.0))
        ident = ok["A_identified"].fillna(False).astype(bool) if "A_identified" in ok else pd.Series([], dtype=bool)
        rows.append({
            "sweep": g["sweep"].iloc[0], "config": config, "value": g["value"].iloc[0],
            "paper_config": g["paper_config"].iloc[0] if "paper_config" in g else config,
            "n_runs": len(g), "n_fitted": len(ok), "n_identified": int(ident.sum()),
            "seeds": ",".join(str(s) for s in g["seed"].tolist()),
            "A": A, "A_lo": A_lo, "A_hi": A_hi, "B": B, "B_lo": B_lo, "B_hi": B_hi,
            "C_mid": float(np.exp(np.mean(np.log(ok["C_mid"])))) if len(ok) else math.nan,
            "A_sd": float(ok["A"].std(ddof=1)) if len(ok) > 1 else math.nan,
            "tail": T, "tail_lo": T_lo, "tail_hi": T_hi, "auc": U, "auc_lo": U_lo, "auc_hi": U_hi,
            "contended_runs": ",".join(g.loc[g["contended"].fillna(False).astype(bool), "run"]),
            "protocol": g["protocol"].iloc[0], "margin": margin.value, "margin_source": margin.source,
        })
    cols = ["sweep", "config", "value", "paper_config", "n_runs", "n_fitted", "n_identified", "seeds", "A", "A_lo",
            "A_hi", "B", "B_lo", "B_hi", "C_mid", "A_sd", "tail", "tail_lo", "tail_hi", "auc", "auc_lo", "auc_hi",
            "contended_runs", "protocol", "margin", "margin_source"]
    return pd.DataFrame(rows, columns=cols)


def _rank(configs: pd.DataFrame, fits: dict[str, list[FitResult]], margin: Margin) -> pd.DataFrame:
    """The paper's rule over all configs: the ones within the margin of the best mean A are tied on
    A and ranked by their mean B refitted at the tied group's mean A; the rest follow by A."""
    c = configs.copy()
    c["tied_with_best_A"], c["B_at_common_A"], c["rank"] = False, math.nan, math.nan
    ok = c.dropna(subset=["A"])
    if ok.empty:
        return c
    best = ok.loc[ok["A"].idxmax()]
    tied = [i for i, r in ok.iterrows()
            if best["A"] - r["A"] <= margin.for_pair(int(best["n_fitted"]), int(r["n_fitted"]))]
    c.loc[tied, "tied_with_best_A"] = True
    if len(tied) > 1:
        common = float(c.loc[tied, "A"].mean())
        grid = np.unique(np.concatenate([f.c_mid_grid for i in tied for f in fits[c.at[i, "config"]]]))
        for i in tied:
            c.at[i, "B_at_common_A"] = float(np.mean([refit_at(f, common, grid).B for f in fits[c.at[i, "config"]]]))
    key = pd.DataFrame({"t": ~c["tied_with_best_A"], "b": -c["B_at_common_A"].fillna(-np.inf),
                        "a": -c["A"].fillna(-np.inf)}, index=c.index)
    order = key.sort_values(["t", "b", "a"], kind="stable").index
    c.loc[order, "rank"] = np.arange(1, len(order) + 1)
    c.loc[c["A"].isna(), "rank"] = math.nan
    return c


def _config_of(runs: pd.DataFrame, name: str) -> str | None:
    """The configuration a claim's name (the paper's) refers to: the run names at tiny scale say
    what ran (`k1`), run.json's `paper_name` says what the paper called it (`k4`)."""
    if "paper_config" in runs:
        hit = runs.loc[runs["paper_config"] == name, "config"]
        if len(hit):
            return str(hit.iloc[0])
    return name if name in set(runs["config"]) else None


def _run_mean(run_dir: Any, key: str) -> float:
    """The mean of `key` over a run's metrics.jsonl rows (NaN when it never logged it)."""
    from analysis.runs import read_jsonl

    rows, _ = read_jsonl(Path(str(run_dir)) / "metrics.jsonl")
    values = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return float(np.mean(values)) if values else math.nan


def mechanism_check(mechanism: Mechanism, runs: pd.DataFrame) -> tuple[bool | None, str]:
    """(acts, evidence): whether the runs give the mechanism something to act on.

    Per run, the mean of `mechanism.metric`; per seed, what `on` removes, off − on (paired by seed,
    `analysis.compare.difference`). False (cannot act) when the 95% interval's upper end is below
    `min_share` of `off`'s mean: the mechanism has shown it removes less than that share, so a
    claim about its effect on the result cannot be tested here. True when the interval's lower end
    is above that share; None (unclear, or the metric was not logged) otherwise: the claims are
    judged as usual."""
    on, off = _config_of(runs, mechanism.on), _config_of(runs, mechanism.off)
    if on is None or off is None:
        return None, ""
    def value(row: pd.Series) -> float:  # the run table's meter (analysis/meters.py), else the metrics.jsonl mean
        v = row.get(mechanism.metric, math.nan) if mechanism.metric in runs else math.nan
        return float(v) if v is not None and pd.notna(v) else _run_mean(row["path"], mechanism.metric)

    values = {c: {seed_key(r["seed"], r["path"]): value(r) for _, r in runs[runs["config"] == c].iterrows()}
              for c in (on, off)}
    off_mean = float(np.nanmean(list(values[off].values()))) if values[off] else math.nan
    on_mean = float(np.nanmean(list(values[on].values()))) if values[on] else math.nan
    if not (math.isfinite(off_mean) and math.isfinite(on_mean)):
        return None, f"{mechanism.metric} not logged by these runs"
    d = difference(values[off], values[on], equivalence=0.0)
    if not (math.isfinite(d.low) and math.isfinite(d.high)):
        return None, f"{mechanism.metric}: {d.reason or 'too few runs'}"
    share = mechanism.min_share * off_mean
    evidence = (f"{mechanism.what}: {off_mean:.4g} without it ({off}), {on_mean:.4g} with it ({on}); it removes "
                f"{d.delta:+.3g} [{d.low:+.3g}, {d.high:+.3g}] ({'paired by seed' if d.paired else 'Welch'}, n={d.n})")
    if d.high < share:
        return False, (f"not testable at this scale: {evidence}, less than {mechanism.min_share:.0%} of it, so the "
                       "mechanism has nothing here to act on")
    return (True if d.low > share else None), evidence


def _claims(sweep: str, configs: pd.DataFrame, runs: pd.DataFrame, equivalence: float,
            margin: Margin) -> pd.DataFrame:
    finding = FINDINGS.get(sweep)
    acts, evidence = (mechanism_check(finding.mechanism, runs) if finding is not None and finding.mechanism is not None
                      and len(runs) else (None, ""))
    rows = []
    for claim in (finding.claims if finding else ()):
        named = [c for c in (_config_of(runs, claim.a), _config_of(runs, claim.b)) if c] if claim.a else \
            list(dict.fromkeys(runs["config"]))
        rec = {"sweep": sweep, "figure": finding.figure, "claim_id": claim.id(sweep), "kind": claim.kind,
               "claim": claim.text(), "paper": claim.note, "a": claim.a, "b": claim.b,
               "protocol": get_protocol(runs["protocol"].iloc[0]).name if len(runs) else "",
               "equivalence": equivalence, "mechanism": evidence,
               "meters": meters_text(runs, named, finding.meters)}
        if acts is False:  # nothing for the mechanism to act on: the report says so instead of a verdict
            for m in CLAIM_METRICS:
                rec.update({f"verdict_{m}": NOT_TESTABLE, f"ours_{m}": evidence, f"why_{m}": ""})
        elif claim.kind == "peak_A":
            for m in CLAIM_METRICS:
                v, ours, why = _judge_peak(configs, runs, sweep, m, equivalence)
                rec.update({f"verdict_{m}": v, f"ours_{m}": ours, f"why_{m}": why})
        elif claim.kind == "seed_spread":
            for m in CLAIM_METRICS:
                v, ours, why = _judge_seed_spread(runs, m)
                rec.update({f"verdict_{m}": v, f"ours_{m}": ours, f"why_{m}": why})
        else:
            ca, cb = _config_of(runs, claim.a), _config_of(runs, claim.b)
            rec.update(config_a=ca, config_b=cb)
            fitted = set(runs.dropna(subset=["A"])["config"])
            missing = [(x, c) for x, c in ((claim.a, ca), (claim.b, cb)) if c is None]
            if missing:
                what = ", ".join(f"{x} (no runs)" for x, _ in missing)
                for m in CLAIM_METRICS:
                    rec.update({f"verdict_{m}": "not run", f"ours_{m}": f"missing: {what}", f"why_{m}": ""})
            else:
                for m in CLAIM_METRICS:
                    if m == "A" and not {ca, cb} <= fitted:
                        unfit = ", ".join(c for c in (ca, cb) if c not in fitted)
                        rec.update({"verdict_A": "not run", "ours_A": f"not fitted: {unfit}", "why_A": ""})
                        continue
                    pair = compare_pair(runs, sweep, ca, cb, m, equivalence=equivalence)
                    eff = None
                    ours = pair.text()
                    if m == "A" and claim.kind == "a_better" and pair.identified and pair.verdict == "equivalent":
                        eff = efficiency(_fits_by_seed(runs, ca), _fits_by_seed(runs, cb))
                        ours += f"; {eff.text()}" if eff is not None else ""
                    v, why = judge_claim(claim, pair, eff)
                    rec.update({f"verdict_{m}": v, f"ours_{m}": ours, f"why_{m}": why,
                                f"delta_{m}": pair.diff.delta, f"low_{m}": pair.diff.low, f"high_{m}": pair.diff.high,
                                f"n_{m}": pair.diff.n, f"paired_{m}": pair.diff.paired, f"pair_verdict_{m}": pair.verdict})
        rows.append(rec)
    per_metric = ("verdict", "ours", "why", "pair_verdict", "delta", "low", "high", "n", "paired")
    cols = (["sweep", "figure", "claim_id", "kind", "claim", "paper", "a", "b", "config_a", "config_b"]
            + [f"{k}_{m}" for m in CLAIM_METRICS for k in per_metric] + ["equivalence", "protocol", "mechanism", "meters"])
    return pd.DataFrame(rows).reindex(columns=cols)


def _fits_by_seed(runs: pd.DataFrame, config: str) -> dict[Any, FitResult | None]:
    g = runs[runs["config"] == config]
    return {seed_key(s, p): f for s, p, f in zip(g["seed"], g["path"], g["fit"])}


def _adaptive_stops(paths: Sequence[str]) -> set[str]:
    """Configurations an adaptive sweep stopped (`<sweep dir>/adaptive.jsonl`, written by `scalerl
    sweep --adaptive`): their runs end early by design and set no window."""
    from analysis.runs import read_jsonl

    stopped: set[str] = set()
    for sweep_dir in {Path(p).parent for p in paths if p}:
        rows, _ = read_jsonl(sweep_dir / "adaptive.jsonl")
        stopped |= {str(r.get("config")) for r in rows if r.get("action") == "stop"}
    return stopped


def _with_tail(table: pd.DataFrame, ev: pd.DataFrame, compute: str) -> tuple[pd.DataFrame, float]:
    """Add `tail` and `auc` (analysis/compare.py) to each run of one sweep: the window ends at the smallest
    final compute among the runs that finished (all runs when none has; `finished`: done, or ended
    by a prompt pool that ran out, whose curve ends where the pool ran dry: analysis/runs.py), a
    configuration an adaptive sweep stopped left out; a run that ends before the window has no tail."""
    groups = {p: g for p, g in ev.groupby("path", sort=False)} if not ev.empty else {}
    curves = {p: run_curve(g, compute) for p, g in groups.items()}
    curves = {p: cr for p, cr in curves.items() if len(cr[0])}
    stopped = _adaptive_stops(list(table["path"]))
    finished = table["finished"] if "finished" in table else table["status"] == "done"
    ended = set(table.loc[finished.astype(bool), "path"])
    done = (ended - set(table.loc[table["config"].isin(stopped), "path"])) & set(curves)
    end = common_window(float(curves[p][0][-1]) for p in (done or curves))
    start = window_start({p: curves[p] for p in (done or curves)})
    tails = tail_values(curves, end)
    sampling = tail_sampling_sd({p: run_sampling_variance(groups[p], compute) for p in curves}, end)
    aucs = auc_values(curves, end, start)
    return table.assign(tail=[tails.get(p, math.nan) for p in table["path"]], tail_end=end,
                        tail_sampling_sd=[sampling.get(p, math.nan) for p in table["path"]],
                        auc=[aucs.get(p, math.nan) for p in table["path"]], window_start=start), end


def _margin(runs: pd.DataFrame, seed_runs: pd.DataFrame | None, fixed: str | float, sweep: str) -> Margin:
    if fixed != "auto":
        return Margin.fixed(float(fixed))
    by_config = {c: g["A"].dropna().tolist() for c, g in runs.groupby("config")}
    fitted = [len(v) for v in by_config.values() if v]
    n = int(np.median(fitted)) if fitted else 1
    m = margin_from_seed_fits(by_config, n=n)
    if m is not None:
        return m
    if seed_runs is not None and len(seed_runs):
        by_seed_config = {c: g["A"].dropna().tolist() for c, g in seed_runs.groupby("config")}
        m = margin_from_seed_fits(by_seed_config, n=n, source=f"seeds of {SEED_SWEEP}")
        if m is not None:
            return m
    return Margin.paper()


def summarize_sweep(
    sweep: str,
    ev: pd.DataFrame,
    runs: pd.DataFrame | None = None,
    *,
    seed_ev: pd.DataFrame | None = None,
    seed_runs: pd.DataFrame | None = None,
    compute: str = "auto",
    protocol: Any = None,
    min_compute: str | float = "paper",
    margin: str | float = "auto",
    equivalence: float = DEFAULT_EQUIVALENCE,
    min_points: int = 6,
    fraction: float | None = None,
    bootstrap: int = 0,
    predict_boot: int = 0,
    seed: int = 0,
    judge: bool = True,
    _seed_cache: dict | None = None,
) -> SweepSummary:
    """Fit every run of one sweep by its protocol, add each run's A profile interval and `tail`,
    group seeds into configs, compare every pair on every metric (A, tail, auc) and judge the paper's claims
    (judge=False: skip the claims). ev/runs: that sweep's evaluation rows and run table (None:
    the runs that have evaluations); seed_ev/seed_runs: the seed sweep's (the rank's margin when
    this sweep has no seeds). compute: "auto" = FLOPs at tiny scale (every run on CPU), device-
    hours otherwise. protocol: None = the sweep's (`sweep_protocol`); fraction overrides the
    protocol's fitted range; with it, predict_boot > 0 adds each run's bootstrap prediction interval
    of its end (and the log-linear baseline is always there)."""
    equivalence = parse_equivalence(equivalence)
    compute = resolve_compute(runs if runs is not None else ev, compute)
    proto = get_protocol(protocol) if protocol is not None else sweep_protocol(sweep)
    table = fit_runs(ev, runs=runs, compute=compute, min_points=min_points, fraction=fraction,
                     min_compute=min_compute, protocol=proto, bootstrap=bootstrap, seed=seed, keep_fits=True,
                     predict_boot=predict_boot if fraction is not None else 0)
    table, tail_end = _with_tail(table, ev, compute)
    paper = runs.set_index("path")["paper_config"] if runs is not None and "paper_config" in runs else None
    table["paper_config"] = [paper.get(p, c) if paper is not None else c for p, c in zip(table["path"], table["config"])]
    seed_table = None
    if seed_runs is not None and sweep != SEED_SWEEP and len(seed_runs):
        key = (proto.name, compute, min_points, fraction, str(min_compute))
        if _seed_cache is not None and key in _seed_cache:
            seed_table = _seed_cache[key]
        else:  # the seed sweep fitted by THIS sweep's protocol: the noise of the fits compared here
            seed_table = fit_runs(seed_ev if seed_ev is not None else ev.iloc[0:0], runs=seed_runs,
                                  compute=compute, min_points=min_points, fraction=fraction,
                                  min_compute=min_compute, protocol=proto, profile=False)
            if _seed_cache is not None:
                _seed_cache[key] = seed_table
    m = _margin(table, seed_table, parse_margin(margin), sweep)
    fits: dict[str, list[FitResult]] = {}
    for config, g in table.groupby("config", sort=False):
        fits[config] = [f for f in g["fit"] if f is not None]
    configs = _rank(_config_table(table, m), fits, m)
    order = sorted(dict.fromkeys(table["config"]), key=lambda c: _order_key(table.loc[table["config"] == c, "value"].iloc[0], c))
    pairs = compare_sweep(table, sweep, equivalence=equivalence, order=order)
    claims = _claims(sweep if judge else "", configs, table, equivalence, m)
    table = table.assign(margin=m.value, margin_source=m.source)
    return SweepSummary(sweep, proto, m, table, configs, claims, fits, pairs, compute, tail_end, equivalence)


def _load(path: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    return load_runs(path, what="eval"), load_runs(path, what="runs")


def summarize(path: str | Path, *, sweeps: Sequence[str] | None = None, **kwargs: Any) -> dict[str, SweepSummary]:
    """Every sweep under `path` (a run, a sweep directory or a results root), each summarised by
    `summarize_sweep`. A sweep directory without seeds takes the rank's margin from the seed sweep
    beside it (`<path>/../scalerl_seeds`) when that exists: so `scalerl fit results/tiny/<sweep>`
    and the report built from `results/tiny` give the same numbers."""
    root = Path(path)
    ev, runs = _load(root)
    if runs.empty:
        return {}
    kwargs["compute"] = resolve_compute(runs, kwargs.get("compute", "auto"))
    seed_ev, seed_runs = ev[ev["sweep"] == SEED_SWEEP] if not ev.empty else ev, runs[runs["sweep"] == SEED_SWEEP]
    if seed_runs.empty:
        beside = root.parent / SEED_SWEEP
        if beside.is_dir() and beside.resolve() != root.resolve():
            seed_ev, seed_runs = _load(beside)
    out, cache = {}, {}
    names = sorted(runs["sweep"].dropna().unique()) if sweeps is None else list(sweeps)
    for sweep in names:
        r = runs[runs["sweep"] == sweep]
        if r.empty:
            continue
        e = ev[ev["sweep"] == sweep] if not ev.empty else ev
        out[sweep] = summarize_sweep(sweep, e, r, seed_ev=seed_ev, seed_runs=seed_runs, _seed_cache=cache, **kwargs)
    return out
