"""Fig 17b: downstream benchmark pass rate (e.g. AIME-24) against training compute, generations per prompt.

The runs of Fig 17a (analysis/figure_specs.py), drawn from their downstream records (eval.jsonl
lines with a "benchmark" key, written by `train.downstream_every` + `train.downstream_benchmarks`):
one panel per benchmark, mean@k against training compute on a log axis, one curve per run,
no fit (as in the paper).
"""

from __future__ import annotations

from pathlib import Path

from paper_figures.common import Options, RunData
from paper_figures.task_curves import draw_benchmark_figure

FIGURE = "fig17b"


def draw(data: RunData, out_dir: str | Path, opts: Options = Options()) -> list[Path]:
    return draw_benchmark_figure(FIGURE, data, out_dir, opts)
