"""Fig 8a: independent runs of one recipe (seeds) with their fits, and the margin on A drawn
as a band around the mean fitted A: the margin measured from these seeds (as `scalerl fit
--margin auto` measures it; analysis/README.md), with the paper's ±0.02 (PAPER.md §1,
"Error margin") as dotted lines. Writes fig8a_fits.csv."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from analysis.scaling_law import A_MARGIN
from paper_figures.common import Options, RunData, draw_curves_with_summaries, fits_csv, require_eval, save, style
from analysis.figure_specs import FIGURES

FIGURE = "fig8a"


def draw(data: RunData, out_dir: str | Path, opts: Options = Options()) -> list[Path]:
    spec = FIGURES[FIGURE]
    ev = require_eval(spec, data, opts.compute)
    style()
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    fits_by_label, summaries = draw_curves_with_summaries(ax, spec, ev, opts, data, group_seeds=False)
    fits = [f for f in fits_by_label.values() if f is not None]
    if fits:
        a = np.array([f.A for f in fits])
        mean = float(a.mean())
        margin = next(iter(summaries.values())).margin
        ax.axhspan(mean - margin.value, mean + margin.value, color="0.5", alpha=0.15, lw=0)
        ax.axhline(mean, color="0.4", ls=":", lw=1)
        for y in (mean - A_MARGIN, mean + A_MARGIN):
            ax.axhline(y, color="0.3", ls=(0, (1, 3)), lw=0.8)
        ax.set_title(f"{spec.title}: A = {mean:.3f}, spread {a.max() - a.min():.3f}\n"
                     f"band: margin {margin.describe()}; dotted: the paper's ±{A_MARGIN}", fontsize=8)
    return [*save(fig, out_dir, FIGURE, opts), fits_csv(summaries, out_dir, FIGURE)]
