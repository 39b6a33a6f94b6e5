"""Shared drawing for the paper figures, in the paper's conventions (PAPER.md §4):

- x: training compute on a log axis; y: held-out pass rate (mean@k);
- stars: evaluation points used in the fit; solid line: the fitted sigmoid over the fitted
  range; dashed line: its extrapolation; "×": points held out beyond the fit cutoff;
  hollow circles: points before `min_compute` (where the paper's fit starts: analysis/protocol.py),
  excluded from the fit;
- the legend carries the fitted A and B (and C_mid where the figure asks for it);
- the fit protocol (whole run or first half, analysis/figure_specs.py), where the fits start and
  whether A is identified and the `tail` window are written under the title, and in
  `<figure>_fits.csv` beside the figure (with the paper's rank margin);
- runs whose CPU contention exceeded 10% stay in the figure, drawn faded and labelled
  "[contention N%]" (their compute axis is stretched).

Every fit goes through `analysis.study.summarize_sweep`, the code path of `scalerl fit`.
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

from analysis.protocol import Protocol, get_protocol, is_contended  # noqa: E402
from analysis.runs import compute_label, load_runs, run_curve, run_finished  # noqa: E402
from analysis.scaling_law import FitResult  # noqa: E402
from analysis.figure_specs import FIGURES, FigureSpec  # noqa: E402


class MissingRuns(Exception):
    """The runs a figure needs are not there; the message says which and why."""


@dataclasses.dataclass(frozen=True)
class Options:
    compute: str = "compute_hours"  # a column, or "auto" (render_all: flops at tiny scale, device-hours otherwise)
    fit_fraction: float | None = None  # None: the figure's protocol; else fit compute <= this × the final
    min_compute: str | float = "paper"  # "paper": the paper's start per protocol (analysis/protocol.py); "epoch"; or a compute value
    margin: str | float = "auto"  # the margin on A: measured from seeds, or a number
    protocol: str | None = None  # None: each figure's own (analysis/figure_specs.py)
    dpi: int = 150
    formats: tuple[str, ...] = ("png", "pdf")


def figure_protocol(spec: FigureSpec | None, opts: Options) -> Protocol:
    """The protocol a figure fits by: Options.protocol, else the figure's, else the whole run."""
    return get_protocol(opts.protocol or (spec.protocol if spec is not None else None) or None)


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

    @cached_property
    def cache(self) -> dict:
        """Fits shared by the figures drawn from these runs (the seed sweep's, a sweep's summary)."""
        return {}


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
    "[failed]" / "[running]" for runs that did not finish ("[pool ran out]" for one stopped by
    CurriculumExhausted, which did: `analysis.runs.run_finished`)."""
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
        error = g["error"].iloc[0] if "error" in g else None
        if run_finished(status, error) and status != "done":
            label += " [pool ran out]"  # CurriculumExhausted: it ran to the end of its prompts
        elif status in ("failed", "running"):
            label += f" [{status}]"
        out.append((label, g))
    return out


# ----------------------------------------------------------------------------- drawing


def style() -> None:
    sns.set_theme(style="whitegrid", context="paper", font_scale=1.1)


def palette(n: int) -> list:
    return sns.color_palette("colorblind" if n <= 10 else "husl", n)


def legend_text(res: FitResult | None, which: str = "AB", reason: str = "") -> str:
    if res is None:
        return f"no fit: {reason[:40]}" if reason else "no fit"
    parts = [f"A={res.A:.3f}"]
    if "B" in which:
        parts.append(f"B={res.B:.2f}")
    if "C" in which:
        parts.append(f"C_mid={res.C_mid:.3g}")
    return ", ".join(parts) + (" (flagged)" if res.flags else "")


def _draw(ax, c: np.ndarray, r: np.ndarray, res: FitResult | None, cutoff: float, min_compute: float, reason: str,
          label: str, color, legend: str = "AB", contention: float | None = None, text: str | None = None) -> None:
    """One run in the paper's conventions, given its fit, fitted range [min_compute, cutoff].
    The legend entry is "<label>: <fitted parameters>", or `text` when given ("" = no entry)."""
    faded = is_contended(contention)
    alpha = 0.45 if faded else 1.0
    if faded:
        label = f"{label} [contention {contention:.0%}]"
        text = None  # a contended run always gets its own legend entry
    pos = c > 0  # a log axis cannot show compute 0 (R0 sits there)
    mc = 0.0 if not np.isfinite(min_compute) else min_compute
    fitted = pos & (c <= cutoff * (1 + 1e-12)) & (c >= mc)
    excluded = pos & (c < mc)
    held = pos & (c > cutoff * (1 + 1e-12))
    ax.scatter(c[fitted], r[fitted], marker="*", s=40, color=color, zorder=3, alpha=0.8 * alpha, linewidths=0)
    if excluded.any():
        ax.scatter(c[excluded], r[excluded], marker="o", s=18, facecolors="none", edgecolors=color, zorder=3,
                   alpha=alpha)
    if held.any():
        ax.scatter(c[held], r[held], marker="x", s=30, color=color, zorder=3, alpha=alpha)
    if res is not None:
        lo = max(float(c[pos].min()), mc) if pos.any() else cutoff / 10
        xs = np.geomspace(lo, cutoff, 100)
        entry = f"{label}: {legend_text(res, legend)}" if text is None else (text or "_nolegend_")
        # the fitted curves are drawn over the points (with many seeds the stars would hide them)
        ax.plot(xs, res(xs), "-", color=color, lw=1.6, alpha=alpha, label=entry, zorder=4)
        end = float(c[-1])
        if end > cutoff:
            xe = np.geomspace(cutoff, end * 1.25, 60)
            ax.plot(xe, res(xe), "--", color=color, lw=1.4, alpha=alpha, zorder=4)
    else:
        entry = f"{label}: {legend_text(None, legend, reason)}" if text is None else (text or "_nolegend_")
        ax.plot([], [], "-", color=color, alpha=alpha, label=entry)


def figure_summaries(spec: FigureSpec, ev: pd.DataFrame, opts: Options, data: "RunData | None" = None,
                     judge: bool = False) -> dict:
    """{sweep: analysis.study.SweepSummary} of the figure's runs, fitted by the figure's protocol,
    with the margin on A measured as `scalerl fit` measures it (the seed sweep of `data` as its
    fallback)."""
    from analysis.study import SEED_SWEEP, summarize_sweep

    proto = figure_protocol(spec, opts)
    runs_all = data.runs if data is not None else None
    seed_ev = seed_runs = None
    cache = data.cache if data is not None else {}
    if data is not None and not data.runs.empty:
        seed_runs = data.runs[data.runs["sweep"] == SEED_SWEEP]
        seed_ev = data.eval[data.eval["sweep"] == SEED_SWEEP] if not data.eval.empty else None
    out = {}
    for sweep, g in ev.groupby("sweep", sort=False):
        key = ("summary", sweep, tuple(sorted(set(g["path"]))), proto.name, opts.compute, str(opts.min_compute),
               str(opts.margin), opts.fit_fraction, judge)
        if key not in cache:
            runs = runs_all[runs_all["path"].isin(set(g["path"]))] if runs_all is not None else None
            cache[key] = summarize_sweep(sweep, g, runs, seed_ev=seed_ev, seed_runs=seed_runs, compute=opts.compute,
                                         protocol=proto, min_compute=opts.min_compute, margin=opts.margin,
                                         fraction=opts.fit_fraction, judge=judge,
                                         _seed_cache=cache.setdefault("seed_fits", {}))
        out[sweep] = cache[key]
    return out


def protocol_note(summaries: dict) -> str:
    """'fit: whole run (whole protocol), from 0.4 of the fitted range (3); A n.i. = not identified (95% profile
    interval wider than 0.1 or reaching the cap or the search floor); tail over the last 20% of the common window (to 2.3e+12)'."""
    parts = []
    for s in summaries.values():
        rules = s.runs["min_compute_rule"].fillna("").map(lambda x: x.split(" (")[0]).value_counts()
        rule = ", ".join(f"{k} ({n})" for k, n in rules.items() if k) or "-"
        frac = float(s.runs["fit_fraction"].iloc[0]) if len(s.runs) else s.protocol.fit_fraction
        ident = "" if bool(s.runs["A_identified"].fillna(False).all()) else \
            "; A n.i. = not identified (95% profile interval wider than 0.1 or reaching the cap or the search floor)"
        parts.append(f"fit: {s.protocol.range_text(frac)} ({s.protocol.name} protocol), from {rule}{ident}; "
                     f"tail over the last 20% of the common window (to {s.tail_end:.3g})")
    return "\n".join(dict.fromkeys(parts))


def fits_csv(summaries: dict, out_dir: str | Path, stem: str) -> Path:
    """Per run: the fit, the protocol, where the fit started and the margin (a figure's CSV column)."""
    cols = ["sweep", "run", "config", "seed", "status", "A", "B", "C_mid", "R0", "n_points", "protocol",
            "fit_fraction", "fit_cutoff", "min_compute", "min_compute_rule", "A_profile_lo", "A_profile_hi",
            "A_identified", "tail", "margin", "margin_source",
            "contention_run", "contended", "fit_error"]
    frames = [s.runs.reindex(columns=cols) for s in summaries.values()]
    df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=cols)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}_fits.csv"
    df.to_csv(path, index=False)
    return path


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


def _readable_log_ticks(fig) -> None:
    """A log compute axis spanning one or two decades gets its labels at 1, 2 and 5 x 10^k only
    (matplotlib would label every minor tick there, and they overlap)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    def label(x: float, _pos: int) -> str:
        e = int(math.floor(math.log10(x) + 1e-9))
        m = round(x / 10 ** e)
        return f"$10^{{{e}}}$" if m == 1 else f"${m}\\times10^{{{e}}}$"

    for ax in fig.axes:
        if ax.get_xscale() != "log":
            continue
        lo, hi = ax.get_xlim()
        if lo > 0 and hi / lo < 1e3:
            ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.xaxis.set_major_formatter(FuncFormatter(label))
            ax.xaxis.set_minor_formatter(NullFormatter())


def save(fig, out_dir: str | Path, stem: str, opts: Options) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _readable_log_ticks(fig)
    paths = []
    for fmt in opts.formats:
        p = out / f"{stem}.{fmt}"
        # no creation date in a PDF: the same runs give the same bytes
        fig.savefig(p, dpi=opts.dpi, bbox_inches="tight", metadata={"CreationDate": None} if fmt == "pdf" else None)
        paths.append(p)
    plt.close(fig)
    return paths


def _config_text(cfg: pd.Series, which: str) -> str:
    """Legend entry of a configuration with several seeds: mean A (95% interval) and B over its seeds."""
    if pd.isna(cfg["A"]):
        return f"{cfg['config']} ({cfg['n_runs']} seeds): no fit"
    # the interval over seeds is clipped to [0, 1] (analysis.study.seed_interval); "A n.i." where a
    # seed's A is not identified (its profile interval is wider than 0.1: an extrapolation)
    ident = "" if cfg.get("n_identified", cfg["n_fitted"]) >= cfg["n_fitted"] else " (A n.i.)"
    parts = [f"A={cfg['A']:.3f} [{cfg['A_lo']:.3f}, {cfg['A_hi']:.3f}]{ident}" if cfg["n_fitted"] > 1
             else f"A={cfg['A']:.3f}{ident}"]
    if pd.notna(cfg.get("tail", math.nan)):
        parts.append(f"tail={cfg['tail']:.3f}")
    if "B" in which:
        parts.append(f"B={cfg['B']:.2f}")
    if "C" in which:
        parts.append(f"C_mid={cfg['C_mid']:.3g}")
    name = cfg["config"] if cfg.get("paper_config", cfg["config"]) == cfg["config"] else \
        f"{cfg['config']} (paper {cfg['paper_config']})"
    return f"{name} ({cfg['n_fitted']}/{cfg['n_runs']} seeds): " + ", ".join(parts)


def draw_curves_with_summaries(ax, spec: FigureSpec, ev: pd.DataFrame, opts: Options,
                               data: "RunData | None" = None, group_seeds: bool = True
                               ) -> tuple[dict[str, FitResult | None], dict]:
    """Every run of `ev` on one axis, fitted as `scalerl fit` fits them; returns (label -> fit,
    {sweep: SweepSummary}). With group_seeds, the seeds of one configuration share a colour and
    one legend entry (mean A with its 95% interval over seeds, mean B); contended runs keep
    their own entry."""
    summaries = figure_summaries(spec, ev, opts, data)
    rows = {row["path"]: row for s in summaries.values() for _, row in s.runs.iterrows()}
    configs = {(sw, r["config"]): r for sw, s in summaries.items() for _, r in s.configs.iterrows()}
    groups = curves(ev)
    keys = [(g["sweep"].iloc[0], rows[g["path"].iloc[0]]["config"]) for _, g in groups]
    grouped = group_seeds and any(configs[k]["n_runs"] > 1 for k in keys)
    order = list(dict.fromkeys(keys)) if grouped else list(range(len(groups)))
    colors = dict(zip(order, palette(len(order))))
    fits, shown = {}, set()
    for i, ((label, g), key) in enumerate(zip(groups, keys)):
        c, r = run_curve(g, opts.compute)
        row = rows[g["path"].iloc[0]]
        res = row["fit"]
        text = None
        if grouped:
            text = "" if key in shown else _config_text(configs[key], spec.legend)
            if not is_contended(row["contention_run"]):  # a contended run keeps its own entry: the
                shown.add(key)                           # configuration's goes to its next seed
        _draw(ax, c, r, res, float(row["fit_cutoff"]), float(row["min_compute"]),
              "" if res is not None else str(row["fit_error"]), label, colors[key if grouped else i], spec.legend,
              row["contention_run"], text)
        fits[label] = res
    ax.set_xscale("log")
    _left_limit(ax, [run_curve(g, opts.compute)[0] for _, g in groups])
    ax.set_xlabel(xlabel(ev, opts.compute))
    ax.set_ylabel(ylabel(ev))
    ax.set_title(f"{spec.title}\n{protocol_note(summaries)}", fontsize=8)
    ax.legend(loc="upper left", fontsize=7, title=_legend_title(ev), title_fontsize=7)
    marker_legend(ax)
    return fits, summaries


def _left_limit(ax, computes: list[np.ndarray]) -> None:
    """Start the log x axis at half the earliest SECOND evaluation of any run. A run's first
    evaluation (step 0, R0) logs almost no compute (a tiny run: ~1e-6 of ~0.05 CPU-h); on a
    log axis it would stretch the axis over decades that hold no other point. It is the fit's
    R0, listed in the figure's CSV, and left out of view like the paper's figures do."""
    second = [float(c[c > 0][1]) for c in computes if (c > 0).sum() >= 2]
    first = [float(c[c > 0][0]) for c in computes if (c > 0).sum() >= 2]
    if second and min(first) < 0.1 * min(second):
        ax.set_xlim(left=0.5 * min(second))


def draw_curves_on(ax, spec: FigureSpec, ev: pd.DataFrame, opts: Options,
                   data: "RunData | None" = None) -> dict[str, FitResult | None]:
    """Every run of `ev` on one axis; returns label -> fit."""
    return draw_curves_with_summaries(ax, spec, ev, opts, data)[0]


def _legend_title(ev: pd.DataFrame) -> str | None:
    factors = ev["factor"].dropna().unique().tolist() if "factor" in ev else []
    return str(factors[0]) if len(factors) == 1 else None


def draw_sweep_curves(fig_id: str, data: RunData, out_dir: str | Path, opts: Options) -> list[Path]:
    """The standard figure: every run of the figure's sweep with its fit and extrapolation;
    `<fig_id>_fits.csv` beside it."""
    spec = FIGURES[fig_id]
    ev = require_eval(spec, data, opts.compute)
    style()
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    _, summaries = draw_curves_with_summaries(ax, spec, ev, opts, data)
    return [*save(fig, out_dir, fig_id, opts), fits_csv(summaries, out_dir, fig_id)]
