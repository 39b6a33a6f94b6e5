"""Fig 11: the math + code run: one held-out curve per task against training compute, with the
sigmoid fitted to each (solid over the fitted range, dashed beyond; stars fitted points, "×"
held out, hollow circles before the fitted range), plus any single-task run of the same sweep
as a reference (the paper's math-only ScaleRL run, in grey).

Runs: those of analysis/figure_specs.py's fig11 entry, else every run trained on a task mixture
(``train.task = {"math_file": 0.5, "code_file": 0.5}`` or any other mixture; eval.jsonl then
carries ``per_task`` pass rates). Each task's curve is fitted on its own, like a run, by the
figure's protocol (spec.py); the subtitle says which.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from paper_figures.common import (Options, RunData, _draw, curves, figure_protocol, marker_legend, palette, save,
                                  style, xlabel)
from analysis.figure_specs import FIGURES
from paper_figures.task_curves import fit_task_curve, mixture_eval, per_task_columns, task_label

FIGURE = "fig11"


def draw(data: RunData, out_dir: str | Path, opts: Options = Options()) -> list[Path]:
    spec = FIGURES[FIGURE]
    mix, ref = mixture_eval(spec, data, opts.compute)
    style()
    fig, ax = plt.subplots(figsize=(6.8, 4.8))
    mix_groups = curves(mix)
    lines = [(label, g, col) for label, g in mix_groups for col in per_task_columns(g)]
    ranges = set()
    for (label, g, col), color in zip(lines, palette(len(lines))):
        c, r, pf, ctx = fit_task_curve(data, g, col, opts)
        name = task_label(col) if len(mix_groups) == 1 else f"{label}: {task_label(col)}"
        _draw(ax, c, r, pf.fit, pf.cutoff, pf.min_compute, pf.reason, name, color, spec.legend, ctx.get("contention"))
        ranges.add(pf.describe())
    ref_groups = curves(ref) if not ref.empty else []
    for (label, g), grey in zip(ref_groups, ["0.45", "0.6", "0.3", "0.7"] * len(ref_groups)):
        c, r, pf, ctx = fit_task_curve(data, g, "pass_rate", opts)  # the run's own held-out curve
        _draw(ax, c, r, pf.fit, pf.cutoff, pf.min_compute, pf.reason, f"{label} (single task)", grey,
              spec.legend, ctx.get("contention"))
    proto = figure_protocol(spec, opts)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel(mix, opts.compute))
    ax.set_ylabel("held-out pass rate per task (mean@k)")
    ax.set_title(f"{spec.title}\nfit: {'; '.join(sorted(ranges))} ({proto.name} protocol)", fontsize=8)
    ax.legend(loc="upper left", fontsize=7)
    marker_legend(ax)
    return save(fig, out_dir, FIGURE, opts)
