"""Figs 13a,b: Eq. 1 (a) with the asymptote A varied; (b) a crossover: an efficient method
with a low ceiling (small C_mid, high B, low A) against a slow one with a high ceiling, which
overtakes it at large compute. No runs needed."""

from __future__ import annotations

from pathlib import Path

from paper_figures.common import Options, RunData
from paper_figures.illustrations import Curve, draw_panels, vary

FIGURE = "fig13"
PANELS = [
    ("(a) varying A", vary("A", [0.5, 0.61, 0.7, 0.8], "{:.2f}")),
    ("(b) crossover", [
        Curve("efficient, low A (A=0.55, B=2.5, C_mid=1500)", 0.55, 2.5, 1500.0, 0.1),
        Curve("slow, high A (A=0.70, B=1.5, C_mid=6000)", 0.70, 1.5, 6000.0, 0.1),
    ]),
]


def draw(data: RunData | None, out_dir: str | Path, opts: Options = Options()) -> list[Path]:
    return draw_panels(FIGURE, PANELS, out_dir, opts)
