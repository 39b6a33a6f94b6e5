"""Figs 12a,b: Eq. 1 with one efficiency parameter varied, the others at the reference
(A 0.61, C_mid 2542): (a) the exponent B, (b) the midpoint C_mid. No runs needed."""

from __future__ import annotations

from pathlib import Path

from paper_figures.common import Options, RunData
from paper_figures.illustrations import draw_panels, vary

FIGURE = "fig12"
PANELS = [
    ("(a) varying B", vary("B", [0.8, 1.2, 1.92, 3.0])),
    ("(b) varying C_mid", vary("C_mid", [500.0, 2542.0, 10000.0, 40000.0])),
]


def draw(data: RunData | None, out_dir: str | Path, opts: Options = Options()) -> list[Path]:
    return draw_panels(FIGURE, PANELS, out_dir, opts)
