"""How well a run's first part predicts its end, measured on a folder of finished runs (issue 41).

Every finished run is cut at each prefix (25%, 50%, 75% of its final compute) and fitted the way
`scalerl fit RUNS --fraction F` fits it (`analysis.runs.fit_runs`: the sweep's protocol, the
fit starting at the paper's cutoff as a fraction of the prefix); its final pass rate is then
predicted three ways from the same prefix:

- the sigmoid (the law), with its calibrated 95% prediction interval
  (`analysis.scaling_law.prediction_interval`);
- the log-linear line (reward = a + b·ln C) fitted on the same points;
- the last value: the last evaluation the fit used.

    rows = measure("results/tiny_long")      # one row per run and prefix
    table = summarize(rows)                   # one row per prefix: errors, bias, coverage
    print(markdown(table))

`python benchmarks/prediction.py RESULTS...` prints the table of each folder; the study report's
"Predicting the end" section (experiments/study_report.py) prints the same table.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

__all__ = ["FRACTIONS", "measure", "summarize", "markdown"]

FRACTIONS = (0.25, 0.5, 0.75)


def measure(path: str | Path, *, fractions: Sequence[float] = FRACTIONS, n_boot: int | None = None,
            compute: str = "auto", ev: pd.DataFrame | None = None, runs: pd.DataFrame | None = None,
            seed: int = 0) -> pd.DataFrame:
    """One row per finished run and prefix: sweep, run, config, seed, fraction, fitted (bool),
    fit_error, n_points, observed_final, predicted_final, predicted_low, predicted_high, covered,
    width, pinned, baseline_final, last_value and the three errors (prediction − observed).
    ev/runs: the folder's tables when already loaded (`analysis.runs.load_runs`); seed: the
    bootstrap's (`scalerl fit --seed`)."""
    from analysis.runs import fit_runs, load_runs, resolve_compute
    from analysis.scaling_law import PIN_WIDTH, PREDICT_BOOT

    n_boot = PREDICT_BOOT if n_boot is None else int(n_boot)
    ev = load_runs(path, what="eval") if ev is None else ev
    runs = load_runs(path, what="runs") if runs is None else runs
    if runs.empty or ev.empty:
        return pd.DataFrame()
    axis = resolve_compute(runs, compute)
    out = []
    for f in fractions:
        p = fit_runs(ev, runs=runs, fraction=float(f), compute=axis, profile=False, predict_boot=n_boot, seed=seed)
        p = p[p["finished"].fillna(False).astype(bool)].copy()
        last = []
        for row in p.itertuples():
            g = ev[ev["path"] == row.path]
            fit_to = getattr(row, "fit_to", math.nan)
            if not len(g) or fit_to is None or not np.isfinite(fit_to):
                last.append(math.nan)
                continue
            c, r = g[axis].to_numpy(np.float64), g["pass_rate"].to_numpy(np.float64)
            at = np.flatnonzero(np.isclose(c, fit_to, rtol=1e-12, atol=0.0))
            last.append(float(r[at[-1]]) if at.size else math.nan)
        p["last_value"] = last
        p["fraction"] = float(f)
        out.append(p)
    rows = pd.concat(out, ignore_index=True)
    for col in ("predicted_final", "predicted_low", "predicted_high", "baseline_final", "observed_final"):
        if col not in rows:
            rows[col] = math.nan
    rows["fitted"] = rows["predicted_final"].notna()
    rows["width"] = rows["predicted_high"] - rows["predicted_low"]
    rows["pinned"] = rows["width"] <= PIN_WIDTH
    rows["error"] = rows["predicted_final"] - rows["observed_final"]
    rows["baseline_error"] = rows["baseline_final"] - rows["observed_final"]
    rows["last_error"] = rows["last_value"] - rows["observed_final"]
    if "covered" not in rows:
        rows["covered"] = None
    keep = ["sweep", "run", "config", "seed", "fraction", "fitted", "fit_error", "n_points", "fit_from", "fit_to",
            "final_compute", "observed_final", "predicted_final", "predicted_low", "predicted_high", "covered",
            "width", "pinned", "baseline_final", "last_value", "error", "baseline_error", "last_error"]
    return rows[[c for c in keep if c in rows]]


def summarize(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per prefix: runs, fitted, pinned (interval <= 0.1 wide), the median |error| and the
    mean error (bias) of the sigmoid, the log-linear line and the last value over the fitted runs,
    the share of runs where the sigmoid beats the line, and the 95% interval's coverage (over
    every fitted run, and over the pinned ones)."""
    out = []
    for f, g in rows.groupby("fraction", sort=True):
        q = g[g["fitted"]]
        cov = q["covered"].dropna().astype(bool)
        pin = q[q["pinned"].fillna(False).astype(bool)]["covered"].dropna().astype(bool)
        med = lambda s: float(s.abs().median()) if len(s.dropna()) else math.nan  # noqa: E731
        mean = lambda s: float(s.mean()) if len(s.dropna()) else math.nan  # noqa: E731
        out.append({
            "fraction": float(f), "runs": int(len(g)), "fitted": int(len(q)), "pinned": int(len(pin)),
            "sigmoid_abs": med(q["error"]), "sigmoid_bias": mean(q["error"]),
            "loglinear_abs": med(q["baseline_error"]), "loglinear_bias": mean(q["baseline_error"]),
            "last_abs": med(q["last_error"]), "last_bias": mean(q["last_error"]),
            "sigmoid_beats_loglinear": float((q["error"].abs() < q["baseline_error"].abs()).mean()) if len(q) else math.nan,
            "coverage": float(cov.mean()) if len(cov) else math.nan, "n_intervals": int(len(cov)),
            "coverage_pinned": float(pin.mean()) if len(pin) else math.nan,
            "median_width": float(q["width"].median()) if len(q) else math.nan,
        })
    return pd.DataFrame(out)


def markdown(table: pd.DataFrame, *, target: tuple[float, float] = (0.90, 0.97)) -> list[str]:
    """The table as markdown lines: one row per prefix."""
    def pct(x: float) -> str:
        return "—" if not np.isfinite(x) else f"{x:.1%}"

    def num(x: float, spec: str) -> str:
        return "—" if not np.isfinite(x) else format(x, spec)

    L = ["| prefix | runs | fitted | sigmoid: median abs. error / bias | log-linear | last value | sigmoid beats line "
         "| 95% interval covers | median width | pinned (width <= 0.1): covers |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    for r in table.itertuples():
        ok = np.isfinite(r.coverage) and target[0] <= r.coverage <= target[1]
        mark = "" if not np.isfinite(r.coverage) else (" ✓" if ok else " ✗")
        L.append(f"| {r.fraction:.0%} | {r.runs} | {r.fitted} | {num(r.sigmoid_abs, '.3f')} / "
                 f"{num(r.sigmoid_bias, '+.3f')} | {num(r.loglinear_abs, '.3f')} / {num(r.loglinear_bias, '+.3f')} | "
                 f"{num(r.last_abs, '.3f')} / {num(r.last_bias, '+.3f')} | {pct(r.sigmoid_beats_loglinear)} | "
                 f"**{pct(r.coverage)}**{mark} ({r.n_intervals}) | {num(r.median_width, '.3f')} | "
                 f"{r.pinned}: {pct(r.coverage_pinned)} |")
    return L
