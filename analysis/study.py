"""One sweep, summarised the way the reproduction report and `scalerl fit` show it.

    summaries = summarize("results/tiny")                   # {sweep: SweepSummary}
    s = summaries["fp32_head"]
    s.runs      # one row per run: the protocol fit (A, B, C_mid, R0, min_compute rule, contention)
    s.configs   # one row per configuration (run name without -s<seed>): mean A and B over
                # seeds with 95% t-intervals, rank by the paper's rule
    s.claims    # one row per claim of the paper's finding (analysis/findings.py): ours, verdict
    s.margin    # the margin on A used, and where it came from

Comparing two configurations (`compare_configs`), the paper's rule with seeds:
1. |mean A(a) − mean A(b)| > margin (`Margin.for_pair(n_a, n_b)`): the higher A wins.
2. Otherwise refit every seed of both at the common A = the mean of the two means and compare
   the mean B: higher wins when the difference exceeds the B noise, t(0.975, df)·s_B·
   sqrt(1/n_a + 1/n_b) with s_B the pooled std of the refit B across seeds (both configs with
   >= 2 seeds), else the paper's tie tolerance 0.01 (`analysis.scaling_law.compare`).
3. Then C_mid (smaller wins; on log C_mid with the same seed noise, else 1% relative).
4. Otherwise a tie.
With one seed each this is exactly `analysis.scaling_law.compare`.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from analysis.findings import FINDINGS, Claim
from analysis.protocol import Margin, Protocol, get_protocol, margin_from_seed_fits, sweep_protocol, t_quantile
from analysis.runs import fit_runs, load_runs
from analysis.scaling_law import A_MARGIN, FitResult, refit_at

__all__ = ["SweepSummary", "ConfigComparison", "compare_configs", "summarize", "summarize_sweep",
           "seed_interval", "judge_claim", "parse_margin", "SEED_SWEEP", "VERDICTS"]

SEED_SWEEP = "scalerl_seeds"  # the paper's Fig 8a: where a sweep without seeds takes its margin from
VERDICTS = ("agree", "disagree", "inconclusive", "not run")
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


def seed_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, lo, hi): the t-interval of the mean over seeds; lo = hi = mean with one seed."""
    x = np.asarray([v for v in values if v is not None and np.isfinite(v)], dtype=np.float64)
    if x.size == 0:
        return math.nan, math.nan, math.nan
    m = float(x.mean())
    if x.size == 1:
        return m, m, m
    h = t_quantile(x.size - 1, level) * float(x.std(ddof=1)) / math.sqrt(x.size)
    return m, m - h, m + h


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


def judge_claim(claim: Claim, comp: ConfigComparison | None) -> tuple[str, str]:
    """(verdict, why) of a two-config claim from our comparison (None: a config is missing)."""
    if comp is None:
        return "not run", ""
    w, by = comp.winner, comp.decided_by
    if claim.kind == "a_higher_A":
        if by == "A":
            return ("agree", "") if w == "a" else ("disagree", f"A({claim.b}) is higher by more than the margin")
        return "inconclusive", "A within the margin"
    if claim.kind == "same_A":
        return ("agree", "") if by != "A" else ("disagree", f"A differs by more than the margin ({comp._name()} higher)")
    if claim.kind == "a_better":
        if w == "a":
            return "agree", ""
        return ("disagree", f"{claim.b} wins by {by}") if w == "b" else ("inconclusive", "a tie at our noise")
    if claim.kind == "a_not_worse":
        return ("disagree", f"{claim.b} wins by {by}") if w == "b" else ("agree", "")
    raise ValueError(f"claim kind {claim.kind!r} does not compare two configs")


def _order_key(value: Any, config: str) -> tuple:
    try:
        return (0, float(value), config)
    except (TypeError, ValueError):
        import re

        m = re.search(r"(-?\d+(?:\.\d+)?(?:e-?\d+)?)", config)
        return (0, float(m.group(1)), config) if m else (1, 0.0, config)


def _judge_peak(configs: pd.DataFrame, margin: Margin) -> tuple[str, str, str, float]:
    """peak_A over the configs ordered by value: (verdict, ours, why, margin used)."""
    c = configs.dropna(subset=["A"])
    if len(c) < 3:
        return "not run", f"{len(c)} fitted configs (need 3)", "", math.nan
    c = c.assign(_k=[_order_key(v, n) for v, n in zip(c["value"], c["config"])]).sort_values("_k")
    a = c["A"].to_numpy()
    n = c["n_fitted"].to_numpy()
    i = int(np.argmax(a))
    names = c["config"].tolist()
    ours = ", ".join(f"{nm} {x:.3f}" for nm, x in zip(names, a))
    if 0 < i < len(a) - 1:
        m_first, m_last = margin.for_pair(n[i], n[0]), margin.for_pair(n[i], n[-1])
        if a[i] - a[0] > m_first and a[i] - a[-1] > m_last:
            return "agree", ours, "", max(m_first, m_last)
        return "inconclusive", ours, "the interior peak is within the margin of an end", max(m_first, m_last)
    inner = int(np.argmax(a[1:-1])) + 1
    m = margin.for_pair(n[i], n[inner])
    if a[i] - a[inner] > m:
        return "disagree", ours, f"A is highest at the end value {names[i]}", m
    return "inconclusive", ours, "the highest A is at an end, within the margin of the interior", m


def _judge_seed_spread(configs: pd.DataFrame, runs: pd.DataFrame) -> tuple[str, str, str]:
    a = runs["A"].dropna().to_numpy()
    if a.size < 2:
        return "not run", f"{a.size} fitted seed(s)", ""
    half = 0.5 * float(a.max() - a.min())
    ours = f"A {a.mean():.3f}, seeds within ±{half:.3f} (std {a.std(ddof=1):.3f}, {a.size} seeds)"
    if half <= A_MARGIN:
        return "agree", ours, ""
    return "disagree", ours, f"our seeds spread ±{half:.3f} > the paper's ±{A_MARGIN}"


# ----------------------------------------------------------------------------- the summary


@dataclasses.dataclass
class SweepSummary:
    sweep: str
    protocol: Protocol
    margin: Margin
    runs: pd.DataFrame  # per run (fit_runs columns + margin)
    configs: pd.DataFrame  # per config
    claims: pd.DataFrame  # per claim of the paper's finding
    fits: dict[str, list[FitResult]]  # config -> fits of its seeds

    @property
    def contended(self) -> list[str]:
        return self.runs.loc[self.runs["contended"].fillna(False).astype(bool), "run"].tolist()


def _config_table(runs: pd.DataFrame, margin: Margin) -> pd.DataFrame:
    rows = []
    for config, g in runs.groupby("config", sort=False):
        ok = g.dropna(subset=["A"])
        A, A_lo, A_hi = seed_interval(ok["A"])
        B, B_lo, B_hi = seed_interval(ok["B"])
        rows.append({
            "sweep": g["sweep"].iloc[0], "config": config, "value": g["value"].iloc[0],
            "n_runs": len(g), "n_fitted": len(ok), "seeds": ",".join(str(s) for s in g["seed"].tolist()),
            "A": A, "A_lo": A_lo, "A_hi": A_hi, "B": B, "B_lo": B_lo, "B_hi": B_hi,
            "C_mid": float(np.exp(np.mean(np.log(ok["C_mid"])))) if len(ok) else math.nan,
            "A_sd": float(ok["A"].std(ddof=1)) if len(ok) > 1 else math.nan,
            "contended_runs": ",".join(g.loc[g["contended"].fillna(False).astype(bool), "run"]),
            "protocol": g["protocol"].iloc[0], "margin": margin.value, "margin_source": margin.source,
        })
    cols = ["sweep", "config", "value", "n_runs", "n_fitted", "seeds", "A", "A_lo", "A_hi", "B", "B_lo", "B_hi",
            "C_mid", "A_sd", "contended_runs", "protocol", "margin", "margin_source"]
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


def _claims(sweep: str, configs: pd.DataFrame, runs: pd.DataFrame, fits: dict[str, list[FitResult]],
            margin: Margin) -> pd.DataFrame:
    finding = FINDINGS.get(sweep)
    rows = []
    for claim in (finding.claims if finding else ()):
        rec = {"sweep": sweep, "figure": finding.figure, "claim_id": claim.id(sweep), "kind": claim.kind,
               "claim": claim.text(), "paper": claim.note, "a": claim.a, "b": claim.b,
               "protocol": get_protocol(runs["protocol"].iloc[0]).name if len(runs) else "",
               "margin_source": margin.source}
        if claim.kind == "peak_A":
            verdict, ours, why, m = _judge_peak(configs, margin)
            rec.update(ours=ours, verdict=verdict, why=why, margin=m)
        elif claim.kind == "seed_spread":
            verdict, ours, why = _judge_seed_spread(configs, runs)
            rec.update(ours=ours, verdict=verdict, why=why, margin=A_MARGIN)
        else:
            fa, fb = fits.get(claim.a, []), fits.get(claim.b, [])
            missing = [x for x, f in ((claim.a, fa), (claim.b, fb)) if not f]
            if missing:
                known = set(configs["config"])
                what = ", ".join(f"{x} ({'not fitted' if x in known else 'no runs'})" for x in missing)
                rec.update(ours=f"missing: {what}", verdict="not run", why="", margin=margin.value)
            else:
                comp = compare_configs(claim.a, fa, claim.b, fb, margin)
                verdict, why = judge_claim(claim, comp)
                rec.update(ours=comp.text(), verdict=verdict, why=why, margin=comp.margin,
                           A_a=comp.A_a, A_b=comp.A_b, B_a=comp.B_a, B_b=comp.B_b, decided_by=comp.decided_by,
                           winner=comp.winner)
        rows.append(rec)
    cols = ["sweep", "figure", "claim_id", "kind", "claim", "paper", "a", "b", "ours", "verdict", "why", "margin",
            "margin_source", "protocol", "A_a", "A_b", "B_a", "B_b", "decided_by", "winner"]
    return pd.DataFrame(rows).reindex(columns=cols)


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
    compute: str = "compute_hours",
    protocol: Any = None,
    min_compute: str | float = "paper",
    margin: str | float = "auto",
    min_points: int = 6,
    fraction: float | None = None,
    bootstrap: int = 0,
    seed: int = 0,
    judge: bool = True,
    _seed_cache: dict | None = None,
) -> SweepSummary:
    """Fit every run of one sweep by its protocol, group seeds into configs, measure the margin
    and judge the paper's claims (judge=False: skip the claims). ev/runs: that sweep's evaluation
    rows and run table (None: the runs that have evaluations); seed_ev/seed_runs: the seed
    sweep's (the margin's fallback when this sweep has no seeds). protocol: None = the sweep's
    (`sweep_protocol`); fraction overrides the protocol's fitted range."""
    proto = get_protocol(protocol) if protocol is not None else sweep_protocol(sweep)
    table = fit_runs(ev, runs=runs, compute=compute, min_points=min_points, fraction=fraction,
                     min_compute=min_compute, protocol=proto, bootstrap=bootstrap, seed=seed, keep_fits=True)
    seed_table = None
    if seed_runs is not None and sweep != SEED_SWEEP and len(seed_runs):
        key = (proto.name, compute, min_points, fraction, str(min_compute))
        if _seed_cache is not None and key in _seed_cache:
            seed_table = _seed_cache[key]
        else:  # the seed sweep fitted by THIS sweep's protocol: the noise of the fits compared here
            seed_table = fit_runs(seed_ev if seed_ev is not None else ev.iloc[0:0], runs=seed_runs,
                                  compute=compute, min_points=min_points, fraction=fraction,
                                  min_compute=min_compute, protocol=proto)
            if _seed_cache is not None:
                _seed_cache[key] = seed_table
    m = _margin(table, seed_table, parse_margin(margin), sweep)
    fits: dict[str, list[FitResult]] = {}
    for config, g in table.groupby("config", sort=False):
        fits[config] = [f for f in g["fit"] if f is not None]
    configs = _rank(_config_table(table, m), fits, m)
    claims = _claims(sweep if judge else "", configs, table, fits, m)
    table = table.assign(margin=m.value, margin_source=m.source)
    return SweepSummary(sweep, proto, m, table, configs, claims, fits)


def _load(path: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    return load_runs(path, what="eval"), load_runs(path, what="runs")


def summarize(path: str | Path, *, sweeps: Sequence[str] | None = None, **kwargs: Any) -> dict[str, SweepSummary]:
    """Every sweep under `path` (a run, a sweep directory or a results root), each summarised by
    `summarize_sweep`. A sweep directory without seeds takes its margin from the seed sweep
    beside it (`<path>/../scalerl_seeds`) when that exists: so `scalerl fit results/tiny/<sweep>`
    and the report built from `results/tiny` give the same numbers."""
    root = Path(path)
    ev, runs = _load(root)
    if runs.empty:
        return {}
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
