"""Fig 18: downstream benchmarks of the math + code run (the paper: LiveCodeBench and AIME-24)
against training compute: one panel per benchmark, mean@k, one curve per run, no fit.

Runs: those of Fig 11 (analysis/figure_specs.py's fig11 entry, else every run trained on a task
mixture), drawn from their downstream records (eval.jsonl lines with a "benchmark" key).
"""

from __future__ import annotations

from pathlib import Path

from paper_figures.common import Options, RunData
from analysis.figure_specs import FIGURES
from paper_figures.task_curves import draw_benchmark_figure, mixture_eval

FIGURE = "fig18"


def draw(data: RunData, out_dir: str | Path, opts: Options = Options()) -> list[Path]:
    mix, ref = mixture_eval(FIGURES["fig11"], data, opts.compute)
    runs = data.runs[data.runs["path"].isin(set(mix["path"]) | set(ref["path"]))]
    return draw_benchmark_figure(FIGURE, data, out_dir, opts, runs=runs)
