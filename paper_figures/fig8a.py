"""Fig 8a: independent runs of one recipe (seeds) with their fits, and the paper's ±0.02
margin on A drawn as a band around the mean fitted A (PAPER.md §1, "Error margin")."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from analysis.scaling_law import A_MARGIN
from paper_figures.common import Options, RunData, draw_curves_on, require_eval, save, style
from paper_figures.spec import FIGURES

FIGURE = "fig8a"


def draw(data: RunData, out_dir: str | Path, opts: Options = Options()) -> list[Path]:
    spec = FIGURES[FIGURE]
    ev = require_eval(spec, data, opts.compute)
    style()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    fits = [f for f in draw_curves_on(ax, spec, ev, opts).values() if f is not None]
    if fits:
        a = np.array([f.A for f in fits])
        mean = float(a.mean())
        ax.axhspan(mean - A_MARGIN, mean + A_MARGIN, color="0.5", alpha=0.15, lw=0)
        ax.axhline(mean, color="0.4", ls=":", lw=1)
        ax.set_title(f"{spec.title}: A = {mean:.3f}, spread {a.max() - a.min():.3f} (band ±{A_MARGIN})")
    return save(fig, out_dir, FIGURE, opts)
