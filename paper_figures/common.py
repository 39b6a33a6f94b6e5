"""Shared drawing for the paper figures, in the paper's conventions (PAPER.md §4):

- x: training compute on a log axis; y: held-out pass rate (mean@k);
- stars: evaluation points used in the fit; solid line: the fitted sigmoid over the fitted
  range; dashed line: its extrapolation; "×": points held out beyond the fit cutoff;
  hollow circles: points before `min_compute`, excluded from the fit;
- the legend carries the fitted A and B (and C_mid where the figure asks for it).
"""

from __future__ import annotations

import dataclasses
import math
import re
from functools import cached_property
from pathlib import Path
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib.legend import Legend  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from analysis.runs import compute_label, load_runs, run_curve  # noqa: E402
from analysis.scaling_law import FitError, FitResult, fit  # noqa: E402
from paper_figures.spec import FIGURES, FigureSpec  # noqa: E402


class MissingRuns(Exception):
    """The runs a figure needs are not there; the message says which and why."""


@dataclasses.dataclass(frozen=True)
class Options:
    compute: str = "compute_hours"  # or "flops"
    fit_fraction: float = 0.5  # fit on compute <= fit_fraction × the run's final compute (1.0: all)
    min_compute: float = 0.0  # points below it are excluded from the fit (paper: ~1.5k GPU-h)
    dpi: int = 150
    formats: tuple[str, ...] = ("png", "pdf")


class RunData:
    """The logged runs under one path, loaded lazily."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    @cached_property
    def eval(self) -> pd.DataFrame:
        return load_runs(self.path, what="eval")

    @cached_property
    def metrics(self) -> pd.DataFrame:
        return load_runs(self.path, what="metrics")

    @cached_property
    def runs(self) -> pd.DataFrame:
        return load_runs(self.path, what="runs")


# ----------------------------------------------------------------------------- selection


def factor_matches(factor: Any, wanted: Sequence[str]) -> bool:
    """Exact match, or one is a dotted suffix of the other ("train.loss" and "loss";
    "losses.dapo.eps_high" and "dapo.eps_high")."""
    if not isinstance(factor, str) or not factor:
        return False
    f = factor.lower()
    return any(f == w or f.endswith("." + w) or w.endswith("." + f) for w in (x.lower() for x in wanted))


def select(df: pd.DataFrame, spec: FigureSpec) -> pd.DataFrame:
    """Rows of the runs a figure uses: sweep name in spec.sweeps; if none, factor in spec.factors."""
    if df.empty:
        return df
    by_sweep = df["sweep"].isin(spec.sweeps)
    if by_sweep.any() or not spec.factors or "factor" not in df:
        return df[by_sweep]
    return df[df["factor"].map(lambda f: factor_matches(f, spec.factors))]


def require_eval(spec: FigureSpec, data: RunData, compute: str) -> pd.DataFrame:
    """The evaluation rows of the figure's runs, or MissingRuns saying what is missing."""
    runs = select(data.runs, spec)
    if runs.empty:
        raise MissingRuns(f"no {spec.describe_need()} under {data.path}")
    ev = select(data.eval, spec)
    if ev.empty:
        raise MissingRuns(f"{len(runs)} matching run(s) but none has evaluations yet")
    if compute not in ev or ev[compute].isna().all():
        raise MissingRuns(f"matching runs have no {compute!r} in eval.jsonl")
    return ev


def _sort_key(v: Any) -> tuple:
    """Numbers by value; strings naturally ("bs512" < "bs768" < "bs2048")."""
    try:
        return (0, float(v), ())
    except (TypeError, ValueError):
        parts = re.split(r"(\d+(?:\.\d+)?)", str(v))
        return (1, 0.0, tuple((0, float(p), "") if i % 2 else (1, 0.0, p) for i, p in enumerate(parts)))


def curves(ev: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """(label, rows) per run, ordered by factor value then seed. The label is the value (the
    run name where there is none), with the seed when a value has several seeds, and
    "[failed]" / "[running]" for runs that did not finish."""
    groups = []
    for path, g in ev.groupby("path", sort=False):
        first = g.iloc[0]
        value = first.get("value")
        groups.append((value, first.get("seed"), str(first.get("run")), g))
    groups.sort(key=lambda x: (_sort_key(x[0]), _sort_key(x[1]), x[2]))
    n_per_value: dict[str, int] = {}
    for value, _, run, _ in groups:
        n_per_value[str(value)] = n_per_value.get(str(value), 0) + 1
    out = []
    for value, seed, run, g in groups:
        label = run if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)
        if n_per_value.get(str(value), 1) > 1:
            label += f" (seed {seed})"
        status = g["status"].iloc[0] if "status" in g else None
        if status in ("failed", "running"):
            label += f" [{status}]"
        out.append((label, g))
    return out


# ----------------------------------------------------------------------------- drawing


def style() -> None:
    sns.set_theme(style="whitegrid", context="paper", font_scale=1.1)


def palette(n: int) -> list:
    return sns.color_palette("colorblind" if n <= 10 else "husl", n)


def fit_points(c: np.ndarray, r: np.ndarray, opts: Options) -> tuple[FitResult | None, float, str]:
    """Fit a run on compute <= fit_fraction × final compute (R0 = its first evaluation).
    Returns (fit or None, cutoff, reason when None)."""
    if c.size == 0:
        return None, math.nan, "no evaluations"
    cutoff = float(c[-1]) * opts.fit_fraction
    head = c <= cutoff
    try:
        res = fit(c[head], r[head], r0=float(r[0]), min_compute=opts.min_compute)
    except FitError as e:
        return None, cutoff, str(e)
    return res, cutoff, ""


def legend_text(res: FitResult | None, which: str = "AB", reason: str = "") -> str:
    if res is None:
        return f"no fit: {reason[:40]}" if reason else "no fit"
    parts = [f"A={res.A:.3f}"]
    if "B" in which:
        parts.append(f"B={res.B:.2f}")
    if "C" in which:
        parts.append(f"C_mid={res.C_mid:.3g}")
    return ", ".join(parts) + (" (flagged)" if res.flags else "")


def draw_run(ax, c: np.ndarray, r: np.ndarray, label: str, color, opts: Options, legend: str = "AB"
             ) -> FitResult | None:
    """One run in the paper's conventions. Returns its fit (None when it could not be fitted)."""
    res, cutoff, reason = fit_points(c, r, opts)
    pos = c > 0  # a log axis cannot show compute 0 (R0 sits there)
    fitted = pos & (c <= cutoff) & (c >= opts.min_compute)
    excluded = pos & (c < opts.min_compute)
    held = pos & (c > cutoff)
    ax.scatter(c[fitted], r[fitted], marker="*", s=60, color=color, zorder=3)
    if excluded.any():
        ax.scatter(c[excluded], r[excluded], marker="o", s=18, facecolors="none", edgecolors=color, zorder=3)
    if held.any():
        ax.scatter(c[held], r[held], marker="x", s=30, color=color, zorder=3)
    if res is not None:
        lo = max(float(c[pos].min()), opts.min_compute) if pos.any() else cutoff / 10
        xs = np.geomspace(lo, cutoff, 100)
        ax.plot(xs, res(xs), "-", color=color, lw=1.6, label=f"{label}: {legend_text(res, legend)}")
        end = float(c[-1])
        if end > cutoff:
            xe = np.geomspace(cutoff, end * 1.25, 60)
            ax.plot(xe, res(xe), "--", color=color, lw=1.4)
    else:
        ax.plot([], [], "-", color=color, label=f"{label}: {legend_text(None, legend, reason)}")
    return res


def marker_legend(ax) -> None:
    """A second legend that explains the markers and lines."""
    handles = [
        Line2D([], [], marker="*", ls="", color="0.3", markersize=9, label="fitted points"),
        Line2D([], [], marker="x", ls="", color="0.3", label="held out (beyond fit)"),
        Line2D([], [], ls="-", color="0.3", label="fitted sigmoid"),
        Line2D([], [], ls="--", color="0.3", label="extrapolation"),
    ]
    ax.add_artist(Legend(ax, handles, [h.get_label() for h in handles], loc="lower right", fontsize=7))


def ylabel(ev: pd.DataFrame) -> str:
    k = pd.to_numeric(ev.get("k"), errors="coerce").dropna() if "k" in ev else pd.Series(dtype=float)
    ks = sorted({int(x) for x in k})
    return f"held-out pass rate (mean@{ks[0]})" if len(ks) == 1 else "held-out pass rate (mean@k)"


def xlabel(ev: pd.DataFrame, compute: str) -> str:
    devs = ev["device"].dropna().unique().tolist() if "device" in ev else []
    return compute_label(compute, devs[0] if len(devs) == 1 else None)


def save(fig, out_dir: str | Path, stem: str, opts: Options) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in opts.formats:
        p = out / f"{stem}.{fmt}"
        fig.savefig(p, dpi=opts.dpi, bbox_inches="tight")
        paths.append(p)
    plt.close(fig)
    return paths


def draw_curves_on(ax, spec: FigureSpec, ev: pd.DataFrame, opts: Options) -> dict[str, FitResult | None]:
    """Every run of `ev` on one axis; returns label -> fit."""
    groups = curves(ev)
    colors = palette(len(groups))
    fits = {}
    for (label, g), color in zip(groups, colors):
        c, r = run_curve(g, opts.compute)
        fits[label] = draw_run(ax, c, r, label, color, opts, spec.legend)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel(ev, opts.compute))
    ax.set_ylabel(ylabel(ev))
    ax.set_title(spec.title)
    ax.legend(loc="upper left", fontsize=7, title=_legend_title(ev), title_fontsize=7)
    marker_legend(ax)
    return fits


def _legend_title(ev: pd.DataFrame) -> str | None:
    factors = ev["factor"].dropna().unique().tolist() if "factor" in ev else []
    return str(factors[0]) if len(factors) == 1 else None


def draw_sweep_curves(fig_id: str, data: RunData, out_dir: str | Path, opts: Options) -> list[Path]:
    """The standard figure: every run of the figure's sweep with its fit and extrapolation."""
    spec = FIGURES[fig_id]
    ev = require_eval(spec, data, opts.compute)
    style()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    draw_curves_on(ax, spec, ev, opts)
    return save(fig, out_dir, fig_id, opts)
