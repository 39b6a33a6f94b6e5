"""Fig 16: entropy against training step for each batch size. The paper plots the entropy on
the held-out validation prompts (eval.jsonl `entropy`); runs that do not log it fall back to
the policy entropy of the training batches (metrics.jsonl `entropy`), and the axis says which.
The paper's point: entropy falls alike across batch sizes although their pass rates differ,
so entropy does not predict performance. No fit, so no fit protocol or margin."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from paper_figures.common import MissingRuns, Options, RunData, curves, palette, save, select, style
from analysis.figure_specs import FIGURES

FIGURE = "fig16"


def _has(df: pd.DataFrame, col: str) -> bool:
    return not df.empty and col in df and not pd.to_numeric(df[col], errors="coerce").isna().all()


def draw(data: RunData, out_dir: str | Path, opts: Options = Options()) -> list[Path]:
    spec = FIGURES[FIGURE]
    held_out = select(data.eval, spec)
    if _has(held_out, "entropy"):
        rows, ylabel = held_out, "held-out entropy (nats / token)"
    else:
        rows = select(data.metrics, spec)
        if rows.empty:
            raise MissingRuns(f"no metrics.jsonl rows for {spec.describe_need()} under {data.path}")
        if not _has(rows, "entropy"):
            raise MissingRuns("matching runs log no entropy in eval.jsonl or metrics.jsonl")
        ylabel = "policy entropy on training batches (nats / token)"
    style()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    groups = curves(rows)
    for (label, g), color in zip(groups, palette(len(groups))):
        g = g[["step", "entropy"]].apply(pd.to_numeric, errors="coerce").dropna().sort_values("step")
        ax.plot(g["step"], g["entropy"], color=color, lw=1.4, label=label)
    ax.set_xlabel("training step")
    ax.set_ylabel(ylabel)
    ax.set_title(spec.title)
    factors = rows["factor"].dropna().unique().tolist()
    ax.legend(fontsize=8, title=str(factors[0]) if len(factors) == 1 else None)
    return save(fig, out_dir, FIGURE, opts)
