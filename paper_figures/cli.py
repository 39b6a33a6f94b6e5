"""`scalerl figures RUNS --out DIR` (dispatched by experiments/cli.py): every paper figure whose
runs exist, drawn by paper_figures.render, with the fit arguments of `scalerl fit`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from analysis.cli import add_common_arguments
from analysis.figure_specs import FIGURES
from paper_figures.common import Options
from paper_figures.render import render_all

__all__ = ["add_figures_arguments", "figures_main"]


def add_figures_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    parser.add_argument("--out", default="paper_figures/out", help="output directory (PNG + PDF per figure)")
    parser.add_argument("--only", default=None, help="comma-separated figure ids (e.g. fig4a,fig7,table1)")
    parser.add_argument("--fit-fraction", type=float, default=None,
                        help="fit each run on compute <= this fraction of its final compute, dashed beyond "
                             "(1: all); default: each figure's protocol (analysis/figure_specs.py)")
    parser.add_argument("--dpi", type=int, default=150)
    parser.add_argument("--formats", default="png,pdf", help="comma-separated output formats")


def figures_main(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(width=max(Console().width, 120))
    if not Path(args.runs).exists():
        console.print(f"[red]no such run directory: {args.runs}")
        return 2
    if args.fit_fraction is not None and not 0.0 < args.fit_fraction <= 1.0:
        console.print(f"[red]--fit-fraction must be in (0, 1], got {args.fit_fraction}")
        return 2
    only = [s.strip() for s in args.only.split(",") if s.strip()] if args.only else None
    unknown = [i for i in (only or []) if i not in FIGURES]
    if unknown:
        console.print(f"[red]unknown figure id(s) {unknown}; choose from: {', '.join(FIGURES)}")
        return 2
    opts = Options(compute=args.compute, fit_fraction=args.fit_fraction, min_compute=args.min_compute,
                   margin=args.margin, protocol=None if args.protocol == "auto" else args.protocol, dpi=args.dpi,
                   formats=tuple(f.strip() for f in args.formats.split(",") if f.strip()))
    written, missing, failed = render_all(args.runs, args.out, opts, only=only, progress=sys.stderr.isatty())
    for fig_id, paths in written.items():
        console.print(f"[green]drew[/] {fig_id}: " + ", ".join(str(p) for p in paths))
    for fig_id, why in missing.items():
        console.print(f"[yellow]missing[/] {fig_id} ({FIGURES[fig_id].title}): {why}")
    for fig_id, err in failed.items():
        console.print(f"[red]failed[/] {fig_id}: {err}")
    console.print(f"{len(written)} drawn, {len(missing)} missing, {len(failed)} failed -> {args.out}")
    return 1 if failed else 0
