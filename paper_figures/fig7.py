"""Fig 7: leave-one-out (LOO) runs compared at a common A.

Eq. 1 rearranged: F(R_C) = C_mid^B / ((A − R0)/(R_C − R0) − 1) = C^B. Every LOO run is
fitted (on compute <= Options.fit_fraction × its final compute), all are refitted at the mean
of their A, and log F(R_C) is plotted against log C: a line of slope B. Beside it, the table
of the paper: C_mid, B, A of the original fit and B after the refit at the common A (plus the
slope of a least-squares line through the transformed fitted points). Also writes fig7.csv.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from analysis.runs import run_curve
from analysis.scaling_law import loo_transform, refit_common_a
from paper_figures.common import MissingRuns, Options, RunData, curves, fit_points, palette, require_eval, save, style
from paper_figures.spec import FIGURES

FIGURE = "fig7"


def loo_table(data: RunData, opts: Options) -> tuple[pd.DataFrame, dict, float]:
    """(table, label -> (log C, log F of fitted points, the same of held-out points, refit), common A)."""
    ev = require_eval(FIGURES[FIGURE], data, opts.compute)
    fits, points = {}, {}
    for label, g in curves(ev):
        c, r = run_curve(g, opts.compute)
        res, cutoff, _ = fit_points(c, r, opts)
        if res is not None:
            fits[label], points[label] = res, (c, r, cutoff)
    if not fits:
        raise MissingRuns("no leave-one-out run has enough evaluations to fit")
    common_a = float(np.mean([f.A for f in fits.values()]))
    refits = refit_common_a(fits, common_a)
    rows, transformed = [], {}
    for label, res in fits.items():
        ref = refits[label]
        c, r, cutoff = points[label]
        head = c <= cutoff
        kw = dict(A=common_a, B=ref.B, C_mid=ref.C_mid, R0=ref.R0)
        lc_fit, lf_fit = loo_transform(c[head], r[head], **kw)  # fitted points
        lc_held, lf_held = loo_transform(c[~head], r[~head], **kw)  # held out beyond the cutoff
        slope = float(np.polyfit(lc_fit, lf_fit, 1)[0]) if lc_fit.size >= 2 else np.nan
        transformed[label] = (lc_fit, lf_fit, lc_held, lf_held, ref)
        rows.append({"run": label, "C_mid": res.C_mid, "B": res.B, "A": res.A, "common_A": common_a,
                     "B_at_common_A": ref.B, "C_mid_at_common_A": ref.C_mid, "slope_logF_logC": slope})
    table = pd.DataFrame(rows).sort_values("B_at_common_A", ascending=False).reset_index(drop=True)
    return table, transformed, common_a


def draw(data: RunData, out_dir: str | Path, opts: Options = Options()) -> list[Path]:
    table, transformed, common_a = loo_table(data, opts)
    style()
    fig, (ax, axt) = plt.subplots(1, 2, figsize=(12.0, 4.6), gridspec_kw={"width_ratios": [1.1, 1.0]})
    for (label, (lc_fit, lf_fit, lc_held, lf_held, ref)), color in zip(transformed.items(), palette(len(transformed))):
        ax.scatter(lc_fit, lf_fit, marker="*", s=50, color=color)
        ax.scatter(lc_held, lf_held, marker="x", s=26, color=color)
        xs_all = np.concatenate([lc_fit, lc_held])
        if xs_all.size:
            xs = np.linspace(xs_all.min(), xs_all.max(), 20)
            ax.plot(xs, ref.B * xs, color=color, lw=1.4, label=f"{label}: B={ref.B:.2f}")
    ax.set_xlabel("log C  (C: training compute)")
    ax.set_ylabel("log F(R_C)")
    ax.set_title(f"{FIGURES[FIGURE].title} (A = {common_a:.3f}); slope = B")
    ax.legend(fontsize=7)
    axt.axis("off")
    cells = [[r.run, f"{r.C_mid:.4g}", f"{r.B:.2f}", f"{r.A:.3f}", f"{r.B_at_common_A:.2f}"] for r in table.itertuples()]
    tab = axt.table(cellText=cells, colLabels=["run", "C_mid", "B", "A", f"B @ A={common_a:.3f}"], loc="center")
    tab.auto_set_font_size(False)
    tab.set_fontsize(8)
    tab.scale(1.0, 1.3)
    fig.tight_layout()
    out = save(fig, out_dir, FIGURE, opts)
    csv = Path(out_dir) / f"{FIGURE}.csv"
    table.to_csv(csv, index=False)
    return [*out, csv]
