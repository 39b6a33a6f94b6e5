"""Shared code of the Eq. 1 illustrations (Figs 3, 12, 13): curves computed from the law
alone, no runs. Each figure module lists its panels as `Curve`s; `draw_panels` plots them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from analysis.scaling_law import sigmoid
from paper_figures.common import Options, palette, save, style

# Compute axis of the illustrations, in GPU-hours as in the paper.
COMPUTE = np.geomspace(10.0, 1e6, 400)  # [400]
# A reference curve near the paper's ScaleRL 8B fit (Table 1: C_mid 2542, B 1.92, A 0.610).
REFERENCE = {"A": 0.61, "B": 1.92, "C_mid": 2542.0, "R0": 0.1}


@dataclasses.dataclass(frozen=True)
class Curve:
    label: str
    A: float
    B: float
    C_mid: float
    R0: float

    def values(self, compute: np.ndarray = COMPUTE) -> np.ndarray:
        return sigmoid(compute, self.A, self.B, self.C_mid, self.R0)


def vary(name: str, values: list[float], fmt: str = "{:g}") -> list[Curve]:
    """Curves that differ from REFERENCE only in parameter `name`."""
    return [Curve(f"{name}={fmt.format(v)}", **{**REFERENCE, name: v}) for v in values]


def draw_curve_panel(ax, title: str, curves: list[Curve]) -> None:
    for curve, color in zip(curves, palette(len(curves))):
        ax.plot(COMPUTE, curve.values(), color=color, lw=1.8, label=curve.label)
    ax.set_xscale("log")
    ax.set_ylim(0.0, 1.0)
    ax.set_xlabel("training compute (GPU-hours)")
    ax.set_ylabel("pass rate R_C (Eq. 1)")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper left")


def draw_panels(stem: str, panels: list[tuple[str, list[Curve]]], out_dir: str | Path, opts: Options) -> list[Path]:
    style()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.0), squeeze=False)
    for ax, (title, cs) in zip(axes[0], panels):
        draw_curve_panel(ax, title, cs)
    fig.tight_layout()
    return save(fig, out_dir, stem, opts)
