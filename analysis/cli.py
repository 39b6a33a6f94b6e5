"""`scalerl fit RUNS` and `scalerl figures RUNS --out DIR` (dispatched by experiments/cli.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.scaling_law import A_MARGIN


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", help="a run directory, a sweep directory or a directory of sweeps")
    parser.add_argument("--compute", choices=["compute_hours", "flops"], default="compute_hours",
                        help="compute axis (default: compute_hours = wall-clock × devices)")
    parser.add_argument("--min-compute", type=float, default=0.0,
                        help="exclude points below this compute from fits (paper: ~1.5k GPU-h, one epoch)")


def add_fit_arguments(parser: argparse.ArgumentParser) -> None:
    _add_common(parser)
    parser.add_argument("--csv", default="fits.csv", help="where to write the table (default: ./fits.csv)")
    parser.add_argument("--fraction", type=float, default=None,
                        help="fit only the first FRACTION of each run's compute and predict its end")
    parser.add_argument("--min-points", type=int, default=6, help="runs with fewer evaluations are not fitted")
    parser.add_argument("--margin", type=float, default=A_MARGIN, help="margin on A for the paper's comparison rule")
    parser.add_argument("--bootstrap", type=int, default=0, metavar="N",
                        help="add N-resample bootstrap 95%% intervals for A, B, C_mid (seeded)")
    parser.add_argument("--seed", type=int, default=0, help="bootstrap seed")


def _comparisons(table: pd.DataFrame, margin: float) -> pd.DataFrame:
    """Per sweep, the paper's rule: which runs tie the best A within the margin, and their B at
    the common (mean) A of that tied group."""
    from analysis.scaling_law import refit_at

    out = []
    for sweep, g in table.dropna(subset=["A"]).groupby("sweep"):
        best = g["A"].max()
        tied = g[g["A"] >= best - margin]
        common = float(tied["A"].mean())
        for idx, row in g.iterrows():
            rec = {"sweep": sweep, "run": row["run"], "A": row["A"], "tied_with_best_A": bool(row["A"] >= best - margin)}
            if rec["tied_with_best_A"] and len(tied) > 1:
                res = row["fit"]
                rec["common_A"] = common
                rec["B_at_common_A"] = refit_at(res, common).B
            out.append(rec)
    df = pd.DataFrame(out)
    if df.empty:
        return df
    df["rank"] = 0
    for sweep, g in df.groupby("sweep"):
        key = pd.DataFrame({"t": ~g["tied_with_best_A"], "b": -g.get("B_at_common_A", pd.Series(0.0, index=g.index)).fillna(0), "a": -g["A"]})
        order = key.sort_values(["t", "b", "a"]).index
        df.loc[order, "rank"] = np.arange(1, len(order) + 1)
    return df.sort_values(["sweep", "rank"]).reset_index(drop=True)


def fit_main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from analysis.runs import fit_runs, load_runs

    console = Console(width=max(Console().width, 120))
    try:
        ev = load_runs(args.runs, what="eval")
        runs = load_runs(args.runs, what="runs")
    except FileNotFoundError as e:
        console.print(f"[red]{e}")
        return 2
    if runs.empty:
        console.print(f"[red]no runs under {args.runs}")
        return 1
    table = fit_runs(ev, runs=runs, compute=args.compute, min_points=args.min_points, fraction=args.fraction,
                     min_compute=args.min_compute, bootstrap=args.bootstrap, seed=args.seed, keep_fits=True)
    comp = _comparisons(table, args.margin) if "A" in table else pd.DataFrame()
    if not comp.empty:
        table = table.merge(comp[["sweep", "run", "tied_with_best_A", "B_at_common_A", "rank"]]
                            if "B_at_common_A" in comp else comp[["sweep", "run", "tied_with_best_A", "rank"]],
                            on=["sweep", "run"], how="left")
    out = table.drop(columns=["fit"])
    Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
    out.to_csv(args.csv, index=False)

    _print_tables(console, out, args)
    console.print(f"wrote {args.csv}")
    return 0


def _fmt(v, spec: str = ".4g") -> str:
    if v is None or (isinstance(v, float) and np.isnan(v)):
        return ""
    if isinstance(v, (float, np.floating)):
        return format(v, spec)
    return str(v)


def _label(row: pd.Series, with_seed: bool) -> str:
    """A run's short name: its factor value (and seed), else its run name."""
    v = row.get("value")
    if v is None or (isinstance(v, float) and np.isnan(v)):
        return str(row.get("run"))
    seed = row.get("seed")
    return f"{v} (seed {seed})" if with_seed and seed is not None and not pd.isna(seed) else str(v)


def _print_tables(console, out: pd.DataFrame, args: argparse.Namespace) -> None:
    """One compact table per sweep; flags and fit errors as notes under it."""
    from rich.table import Table

    cols = [("label", "run", ""), ("status", "status", ""), ("n_evals", "evals", ""), ("A", "A", ".3f"),
            ("B", "B", ".2f"), ("C_mid", "C_mid", ".3g"), ("rank", "rank", ".0f"),
            ("B_at_common_A", "B@common A", ".2f"), ("predicted_final", "pred. final", ".3f"),
            ("observed_final", "obs. final", ".3f"), ("A_lo", "A lo", ".3f"), ("A_hi", "A hi", ".3f")]
    n_seeds = out.groupby(["sweep", "value"], dropna=False)["seed"].transform("nunique") if "seed" in out else 0
    out = out.assign(label=[_label(r, n > 1) for (_, r), n in zip(out.iterrows(), np.broadcast_to(n_seeds, len(out)))])
    cols = [c for c in cols if c[0] in out]
    for sweep, g in out.groupby("sweep", sort=True):
        t = Table(title=f"{sweep}: sigmoid fits on {args.compute}; rank = paper's rule (A ±{args.margin}, then B)")
        for _, head, _ in cols:
            t.add_column(head, overflow="fold", no_wrap=head != "run")
        sort = g.sort_values("rank") if "rank" in g else g
        notes = []
        for _, row in sort.iterrows():
            t.add_row(*[_fmt(row[c], f) for c, _, f in cols])
            for key in ("fit_error", "flags"):
                if isinstance(row.get(key), str) and row[key]:
                    notes.append(f"  {row['label']}: {row[key]}")
        console.print(t)
        for n in notes:
            console.print(n, style="yellow", highlight=False)


def add_figures_arguments(parser: argparse.ArgumentParser) -> None:
    _add_common(parser)
    parser.add_argument("--out", default="paper_figures/out", help="output directory (PNG + PDF per figure)")
    parser.add_argument("--only", default=None, help="comma-separated figure ids (e.g. fig4a,fig7,table1)")
    parser.add_argument("--fit-fraction", type=float, default=0.5,
                        help="fit each run on compute <= this fraction of its final compute; dashed beyond (1: all)")
    parser.add_argument("--dpi", type=int, default=150)
    parser.add_argument("--formats", default="png,pdf", help="comma-separated output formats")


def figures_main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from paper_figures.common import Options
    from paper_figures.render import render_all
    from paper_figures.spec import FIGURES

    console = Console(width=max(Console().width, 120))
    if not Path(args.runs).exists():
        console.print(f"[red]no such run directory: {args.runs}")
        return 2
    if not 0.0 < args.fit_fraction <= 1.0:
        console.print(f"[red]--fit-fraction must be in (0, 1], got {args.fit_fraction}")
        return 2
    only = [s.strip() for s in args.only.split(",") if s.strip()] if args.only else None
    unknown = [i for i in (only or []) if i not in FIGURES]
    if unknown:
        console.print(f"[red]unknown figure id(s) {unknown}; choose from: {', '.join(FIGURES)}")
        return 2
    opts = Options(compute=args.compute, fit_fraction=args.fit_fraction, min_compute=args.min_compute,
                   dpi=args.dpi, formats=tuple(f.strip() for f in args.formats.split(",") if f.strip()))
    written, missing, failed = render_all(args.runs, args.out, opts, only=only, progress=sys.stderr.isatty())
    for fig_id, paths in written.items():
        console.print(f"[green]drew[/] {fig_id}: " + ", ".join(str(p) for p in paths))
    for fig_id, why in missing.items():
        console.print(f"[yellow]missing[/] {fig_id} ({FIGURES[fig_id].title}): {why}")
    for fig_id, err in failed.items():
        console.print(f"[red]failed[/] {fig_id}: {err}")
    console.print(f"{len(written)} drawn, {len(missing)} missing, {len(failed)} failed -> {args.out}")
    return 1 if failed else 0
