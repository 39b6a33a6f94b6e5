"""Shared drawing for the per-task figures (Fig 11, Table 1's math / code rows) and the
downstream-benchmark figures (Figs 1b, 9b, 10b, 17b, 18).

- A *mixture run* is a run trained on a task mixture (``train.task = {...}``): its held-out
  evaluations carry two or more per-task pass rates (eval.jsonl ``per_task``; the frames of
  `analysis.runs.load_runs` flatten them to ``per_task.<task>`` columns).
- A *downstream record* is an eval.jsonl line with a ``"benchmark"`` key
  (`components.trainer.evaluation.evaluate_benchmark`): its ``mean@k`` (and ``pass@k``) is
  drawn against the run's training compute. Records written before ``mean@k`` existed
  (a ``pass_rate`` field) are drawn from that field.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from analysis.runs import load_runs
from paper_figures.common import MissingRuns, Options, RunData, curves, palette, save, select, style, xlabel
from analysis.figure_specs import FIGURES, FigureSpec

__all__ = ["PER_TASK", "per_task_columns", "mixture_eval", "task_curve", "benchmark_rows", "draw_benchmark_figure",
           "task_label"]

PER_TASK = "per_task."


def per_task_columns(ev: pd.DataFrame) -> list[str]:
    """The ``per_task.<task>`` columns of `ev` that hold at least one number."""
    cols = [c for c in ev.columns if isinstance(c, str) and c.startswith(PER_TASK)]
    return [c for c in cols if pd.to_numeric(ev[c], errors="coerce").notna().any()]


def _n_tasks(g: pd.DataFrame) -> int:
    return len(per_task_columns(g))


def mixture_eval(spec: FigureSpec, data: RunData, compute: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(held-out rows of the mixture runs, rows of single-task reference runs) for a per-task figure.

    Runs are selected by `spec` (sweep, then factor); when none matches, every run under the
    path whose evaluations carry two or more per-task pass rates. Raises MissingRuns saying why.
    """
    ev = data.eval
    if ev.empty:
        raise MissingRuns(f"no runs with held-out evaluations under {data.path}")
    chosen = select(ev, spec)
    how = spec.describe_need()
    if chosen.empty:
        chosen = pd.concat([g for _, g in ev.groupby("path", sort=False) if _n_tasks(g) >= 2] or [ev.iloc[:0]])
        how = "runs trained on a task mixture (train.task = {task: weight, ...}: two or more per-task pass rates)"
    if chosen.empty:
        raise MissingRuns(f"no {how} under {data.path}")
    if compute not in chosen or chosen[compute].isna().all():
        raise MissingRuns(f"matching runs have no {compute!r} in eval.jsonl")
    groups = list(chosen.groupby("path", sort=False))
    mix = [g for _, g in groups if _n_tasks(g) >= 2]
    ref = [g for _, g in groups if _n_tasks(g) < 2]
    if not mix:
        raise MissingRuns(f"{len(groups)} matching run(s) but none was trained on a task mixture "
                          "(no two per-task pass rates in eval.jsonl)")
    return pd.concat(mix), (pd.concat(ref) if ref else chosen.iloc[:0])


def task_label(column: str) -> str:
    return column[len(PER_TASK):] if column.startswith(PER_TASK) else column


def task_curve(g: pd.DataFrame, column: str, compute: str) -> tuple[np.ndarray, np.ndarray]:
    """(compute, per-task pass rate) of one run: finite, sorted, strictly increasing compute."""
    d = g[[compute, column]].apply(pd.to_numeric, errors="coerce").dropna()
    d = d.sort_values(compute, kind="stable").drop_duplicates(subset=[compute], keep="last")
    return d[compute].to_numpy(np.float64), d[column].to_numpy(np.float64)


# ----------------------------------------------------------------------------- downstream


def _score(df: pd.DataFrame) -> pd.Series:
    """mean@k of each downstream record (the legacy ``pass_rate`` where mean@k is absent)."""
    score = pd.to_numeric(df["mean@k"], errors="coerce") if "mean@k" in df else pd.Series(np.nan, index=df.index)
    if "pass_rate" in df:
        score = score.fillna(pd.to_numeric(df["pass_rate"], errors="coerce"))
    return score


def benchmark_rows(spec: FigureSpec, data: RunData, compute: str, runs: pd.DataFrame | None = None) -> pd.DataFrame:
    """Downstream records of the figure's runs (or of the runs in `runs`), with a ``score`` column."""
    try:
        df = load_runs(data.path, what="benchmarks")
    except ValueError as err:  # an analysis package without benchmark records
        raise MissingRuns(f"downstream benchmark records cannot be read here: {err}") from err
    chosen_runs = select(data.runs, spec) if runs is None else runs
    if chosen_runs.empty:
        raise MissingRuns(f"no {spec.describe_need()} under {data.path}")
    if df.empty or "benchmark" not in df:
        raise MissingRuns(f"{chosen_runs['path'].nunique()} matching run(s) but none logged downstream benchmarks "
                          "(train.downstream_every + train.downstream_benchmarks)")
    df = df[df["path"].isin(set(chosen_runs["path"]))]
    if df.empty:
        raise MissingRuns(f"{chosen_runs['path'].nunique()} matching run(s) but none logged downstream benchmarks "
                          "(train.downstream_every + train.downstream_benchmarks)")
    if compute not in df or df[compute].isna().all():
        raise MissingRuns(f"the downstream records of the matching runs have no {compute!r}")
    df = df.assign(score=_score(df))
    if df["score"].isna().all():
        raise MissingRuns("the downstream records of the matching runs have no mean@k")
    return df


def _ks(df: pd.DataFrame) -> list[int]:
    k = pd.to_numeric(df.get("k"), errors="coerce").dropna() if "k" in df else pd.Series(dtype=float)
    return sorted({int(x) for x in k})


def draw_benchmark_figure(fig_id: str, data: RunData, out_dir: str | Path, opts: Options,
                          runs: pd.DataFrame | None = None, title: str | None = None) -> list[Path]:
    """One panel per benchmark: mean@k against training compute (log x), one curve per run; no fit
    (the paper draws its downstream curves without one)."""
    spec = FIGURES[fig_id]
    df = benchmark_rows(spec, data, opts.compute, runs)
    names = sorted(df["benchmark"].dropna().astype(str).unique())
    style()
    ncols = min(len(names), 3)
    nrows = math.ceil(len(names) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 4.0 * nrows), squeeze=False)
    groups = curves(df)
    colors = dict(zip([label for label, _ in groups], palette(len(groups))))
    for ax, name in zip(axes.flat, names):
        for label, g in groups:
            b = g[g["benchmark"].astype(str) == name][[opts.compute, "score"]].apply(pd.to_numeric, errors="coerce")
            b = b.dropna().sort_values(opts.compute, kind="stable")
            b = b[b[opts.compute] > 0]  # a log axis cannot show compute 0
            if b.empty:
                continue
            ax.plot(b[opts.compute], b["score"], "o-", ms=3.5, lw=1.4, color=colors[label], label=label)
        ks = _ks(df[df["benchmark"].astype(str) == name])
        ax.set_xscale("log")
        ax.set_xlabel(xlabel(df, opts.compute))
        ax.set_ylabel(f"{name} pass rate (mean@{ks[0]})" if len(ks) == 1 else f"{name} pass rate (mean@k)")
        ax.set_title(name)
        if ax.get_legend_handles_labels()[0]:
            factors = df["factor"].dropna().unique().tolist() if "factor" in df else []
            ax.legend(fontsize=7, loc="upper left", title=str(factors[0]) if len(factors) == 1 else None, title_fontsize=7)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.suptitle(title or spec.title, fontsize=11)
    fig.tight_layout()
    return save(fig, out_dir, fig_id, opts)


# ----------------------------------------------------------------------------- per-task fits


def run_fit_context(data: RunData, path: str, compute: str) -> dict:
    """epoch1 / max_epoch / contention of one run (from the run table) for `fit_with_protocol`;
    contention is None unless the run is `contended` (other work slowed it)."""
    runs = data.runs
    row = runs[runs["path"] == path]
    if row.empty:
        return {}
    row = row.iloc[0]

    def num(key):
        v = row.get(key)
        return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)

    ep1, ep = num(f"epoch1_{compute}"), num("epoch")
    return {"epoch1": ep1, "max_epoch": None if ep1 is not None else ep, "contention": num("contention_run") if bool(row.get("contended")) else None}


def fit_task_curve(data: RunData, g: pd.DataFrame, column: str, opts: Options):
    """The per-task curve of one run fitted by Fig 11's protocol: (c, r, ProtocolFit, context)."""
    from analysis.protocol import fit_with_protocol
    from paper_figures.common import figure_protocol

    c, r = task_curve(g, column, opts.compute)
    ctx = run_fit_context(data, g["path"].iloc[0], opts.compute)
    pf = fit_with_protocol(c, r, protocol=figure_protocol(FIGURES["fig11"], opts), min_compute=opts.min_compute,
                           epoch1=ctx.get("epoch1"), max_epoch=ctx.get("max_epoch"), fit_fraction=opts.fit_fraction)
    return c, r, pf, ctx


def mixture_table_rows(data: RunData, opts: Options) -> list[dict]:
    """Table 1's math / code rows: one row per task of each run trained on a task mixture (the
    runs of Fig 11), each task's held-out curve fitted on its own by Fig 11's protocol."""
    from analysis.protocol import is_contended

    try:
        mix, _ = mixture_eval(FIGURES["fig11"], data, opts.compute)
    except MissingRuns:
        return []
    groups = curves(mix)
    rows = []
    for label, g in groups:
        for col in per_task_columns(g):
            _, _, pf, ctx = fit_task_curve(data, g, col, opts)
            res, task = pf.fit, task_label(col)
            rows.append({
                "experiment": f"ScaleRL-mixture ({task})" if len(groups) == 1 else f"ScaleRL-mixture {label} ({task})",
                "sweep": g["sweep"].iloc[0],
                "C_mid": None if res is None else res.C_mid,
                "B": None if res is None else res.B,
                "A": None if res is None else res.A,
                "fit_to": pf.cutoff,
                "n_points": None if res is None else res.n_points,
                "protocol": figure_protocol_name(opts),
                "min_compute": pf.min_compute,
                "min_compute_rule": pf.min_rule,
                "margin": None,
                "margin_source": "",
                "contended": is_contended(ctx.get("contention")),
                "note": pf.reason if res is None else "; ".join(res.flags),
            })
    return rows


def figure_protocol_name(opts: Options) -> str:
    from paper_figures.common import figure_protocol

    return figure_protocol(FIGURES["fig11"], opts).name
