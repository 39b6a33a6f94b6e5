"""Fig 6b: No-Positive-Resampling. Needs runs with sweep no_positive_resampling or factor curriculum | no_positive_resampling.

Each run of the sweep is drawn with its sigmoid fitted by the figure's protocol (the whole
run or its first half, from 0.4 of the fitted range as the paper starts it; analysis/figure_specs.py), solid over
the fitted range and dashed beyond; stars are fitted points, "×" the points held out, hollow
circles the points before the fit starts. Runs are selected by analysis/figure_specs.py.
"""

from __future__ import annotations

from pathlib import Path

from paper_figures.common import Options, RunData, draw_sweep_curves

FIGURE = "fig6b"


def draw(data: RunData, out_dir: str | Path, opts: Options = Options()) -> list[Path]:
    return draw_sweep_curves(FIGURE, data, out_dir, opts)
