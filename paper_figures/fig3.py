"""Fig 3: the sigmoid law (Eq. 1) and what each parameter means.

R_C = R0 + (A − R0) / (1 + (C_mid / C)^B): A is the ceiling, C_mid the compute at half of
the gain A − R0, B the steepness. One curve with A, R0 and C_mid marked; no runs needed.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from paper_figures.common import Options, RunData, save, style
from paper_figures.illustrations import COMPUTE, REFERENCE, Curve, draw_curve_panel

FIGURE = "fig3"
PANELS = [("Eq. 1: R_C = R0 + (A − R0) / (1 + (C_mid/C)^B)", [Curve("A=0.61, B=1.92, C_mid=2542", **REFERENCE)])]


def draw(data: RunData | None, out_dir: str | Path, opts: Options = Options()) -> list[Path]:
    style()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    title, curves = PANELS[0]
    draw_curve_panel(ax, title, curves)
    A, R0, C_mid = REFERENCE["A"], REFERENCE["R0"], REFERENCE["C_mid"]
    ax.axhline(A, ls=":", color="0.4")
    ax.text(COMPUTE[0], A + 0.015, "asymptote A", fontsize=8)
    ax.axhline(R0, ls=":", color="0.4")
    ax.text(COMPUTE[0], R0 + 0.015, "R0 (initial pass rate)", fontsize=8)
    half = R0 + (A - R0) / 2
    ax.plot([C_mid, C_mid], [0, half], ls=":", color="0.4")
    ax.plot([C_mid], [half], "o", color="0.2")
    ax.annotate("C_mid: half of the gain A − R0", (C_mid, half), xytext=(C_mid * 4, half - 0.12), fontsize=8,
                arrowprops={"arrowstyle": "->", "color": "0.3"})
    ax.text(C_mid * 30, A - 0.1, "B: slope in log C", fontsize=8)
    return save(fig, out_dir, FIGURE, opts)
