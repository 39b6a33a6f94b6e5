"""Fig 7: leave-one-out (LOO) runs compared at a common A.

Eq. 1 rearranged: F(R_C) = C_mid^B / ((A − R0)/(R_C − R0) − 1) = C^B. Every LOO run is
fitted by the figure's protocol (the paper: the first half, 8k of 16k GPU-h, from 0.19 of it,
where the paper starts; analysis/figure_specs.py), all are refitted at the mean of their A, and
log F(R_C) is plotted against log C: a line of slope B. Beside it, the table of the paper:
C_mid, B, A of the original fit and B after the refit at the common A (plus the slope of a
least-squares line through the transformed fitted points). Also writes fig7.csv (with the
protocol, where each fit starts and the margin on A).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from analysis.runs import run_curve
from analysis.scaling_law import loo_transform, refit_common_a
from paper_figures.common import (MissingRuns, Options, RunData, curves, figure_summaries, palette, protocol_note,
                                  require_eval, save, style)
from analysis.figure_specs import FIGURES

FIGURE = "fig7"


def loo_table(data: RunData, opts: Options) -> tuple[pd.DataFrame, dict, float]:
    """(table, label -> (log C, log F of fitted points, the same of held-out points, refit), common A)."""
    spec = FIGURES[FIGURE]
    ev = require_eval(spec, data, opts.compute)
    summaries = figure_summaries(spec, ev, opts, data)
    rows_by_path = {row["path"]: row for s in summaries.values() for _, row in s.runs.iterrows()}
    fits, points, info = {}, {}, {}
    for label, g in curves(ev):
        row = rows_by_path[g["path"].iloc[0]]
        if row["fit"] is not None:
            c, r = run_curve(g, opts.compute)
            fits[label], points[label], info[label] = row["fit"], (c, r, float(row["fit_cutoff"])), row
    if not fits:
        raise MissingRuns("no leave-one-out run has enough evaluations to fit")
    common_a = float(np.mean([f.A for f in fits.values()]))
    refits = refit_common_a(fits, common_a)
    note = protocol_note(summaries)
    rows, transformed = [], {}
    for label, res in fits.items():
        ref = refits[label]
        c, r, cutoff = points[label]
        head = (c <= cutoff * (1 + 1e-12)) & (c >= res.min_compute)
        held = c > cutoff * (1 + 1e-12)
        kw = dict(A=common_a, B=ref.B, C_mid=ref.C_mid, R0=ref.R0)
        lc_fit, lf_fit = loo_transform(c[head], r[head], **kw)  # fitted points
        lc_held, lf_held = loo_transform(c[held], r[held], **kw)  # held out beyond the cutoff
        slope = float(np.polyfit(lc_fit, lf_fit, 1)[0]) if lc_fit.size >= 2 else np.nan
        transformed[label] = (lc_fit, lf_fit, lc_held, lf_held, ref)
        row = info[label]
        rows.append({"run": label, "config": row["config"], "C_mid": res.C_mid, "B": res.B, "A": res.A, "common_A": common_a,
                     "B_at_common_A": ref.B, "C_mid_at_common_A": ref.C_mid, "slope_logF_logC": slope,
                     "protocol": row["protocol"], "fit_fraction": row["fit_fraction"],
                     "min_compute": row["min_compute"], "min_compute_rule": row["min_compute_rule"],
                     "margin": row["margin"], "margin_source": row["margin_source"],
                     "contended": row["contended"], "note": note})
    table = pd.DataFrame(rows).sort_values("B_at_common_A", ascending=False).reset_index(drop=True)
    return table, transformed, common_a


def _by_config(table: pd.DataFrame, transformed: dict) -> tuple[pd.DataFrame, dict]:
    """Seeds of one configuration pooled: mean B, A and refit B, geometric-mean C_mid; their points together."""
    agg = (table.groupby("config", sort=False)
           .agg(n=("run", "size"), C_mid=("C_mid", lambda x: float(np.exp(np.mean(np.log(x))))), B=("B", "mean"),
                A=("A", "mean"), B_at_common_A=("B_at_common_A", "mean"), contended=("contended", "any"))
           .reset_index().sort_values("B_at_common_A", ascending=False))
    points = {}
    for r in table.itertuples():
        lc_fit, lf_fit, lc_held, lf_held, _ = transformed[r.run]
        p = points.setdefault(r.config, [[], [], [], []])
        for k, arr in enumerate((lc_fit, lf_fit, lc_held, lf_held)):
            p[k].append(arr)
    points = {k: tuple(np.concatenate(v) for v in p) for k, p in points.items()}
    return agg, points


def draw(data: RunData, out_dir: str | Path, opts: Options = Options()) -> list[Path]:
    table, transformed, common_a = loo_table(data, opts)
    grouped = table["config"].duplicated().any()  # several seeds per configuration: one line each
    if grouped:
        agg, points = _by_config(table, transformed)
        lines = [(f"{r.config} ({r.n} seeds)", points[r.config], r.B_at_common_A) for r in agg.itertuples()]
        cells = [[r.config + (" [contended]" if r.contended else ""), f"{r.C_mid:.4g}", f"{r.B:.2f}", f"{r.A:.3f}",
                  f"{r.B_at_common_A:.2f}"] for r in agg.itertuples()]
        first_col = "config (mean)"
    else:
        lines = [(label, (lc_fit, lf_fit, lc_held, lf_held), ref.B)
                 for label, (lc_fit, lf_fit, lc_held, lf_held, ref) in transformed.items()]
        cells = [[r.run + (" [contended]" if r.contended else ""), f"{r.C_mid:.4g}", f"{r.B:.2f}", f"{r.A:.3f}",
                  f"{r.B_at_common_A:.2f}"] for r in table.itertuples()]
        first_col = "run"
    style()
    fig, (ax, axt) = plt.subplots(1, 2, figsize=(12.0, 4.8), gridspec_kw={"width_ratios": [1.1, 1.0]})
    for (label, (lc_fit, lf_fit, lc_held, lf_held), slope), color in zip(lines, palette(len(lines))):
        ax.scatter(lc_fit, lf_fit, marker="*", s=50, color=color)
        ax.scatter(lc_held, lf_held, marker="x", s=26, color=color)
        xs_all = np.concatenate([lc_fit, lc_held])
        if xs_all.size:
            xs = np.linspace(xs_all.min(), xs_all.max(), 20)
            ax.plot(xs, slope * xs, color=color, lw=1.4, label=f"{label}: B={slope:.2f}")
    ax.set_xlabel("log C  (C: training compute)")
    ax.set_ylabel("log F(R_C)")
    ax.set_title(f"{FIGURES[FIGURE].title} (A = {common_a:.3f}); slope = B\n{table['note'].iloc[0]}", fontsize=8)
    ax.legend(fontsize=7)
    axt.axis("off")
    tab = axt.table(cellText=cells, colLabels=[first_col, "C_mid", "B", "A", f"B @ A={common_a:.3f}"], loc="center")
    tab.auto_set_font_size(False)
    tab.set_fontsize(8)
    tab.scale(1.0, 1.3)
    fig.tight_layout()
    out = save(fig, out_dir, FIGURE, opts)
    csv = Path(out_dir) / f"{FIGURE}.csv"
    table.to_csv(csv, index=False)
    return [*out, csv]
