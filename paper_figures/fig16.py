"""Fig 16: policy entropy against training step for each batch size (from metrics.jsonl).
The paper's point: entropy falls alike across batch sizes although their pass rates differ,
so entropy does not predict performance."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from paper_figures.common import MissingRuns, Options, RunData, curves, palette, save, select, style
from paper_figures.spec import FIGURES

FIGURE = "fig16"


def draw(data: RunData, out_dir: str | Path, opts: Options = Options()) -> list[Path]:
    spec = FIGURES[FIGURE]
    m = select(data.metrics, spec)
    if m.empty:
        raise MissingRuns(f"no metrics.jsonl rows for {spec.describe_need()} under {data.path}")
    if "entropy" not in m or pd.to_numeric(m["entropy"], errors="coerce").isna().all():
        raise MissingRuns("matching runs log no entropy in metrics.jsonl")
    style()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    groups = curves(m)
    for (label, g), color in zip(groups, palette(len(groups))):
        g = g[["step", "entropy"]].apply(pd.to_numeric, errors="coerce").dropna().sort_values("step")
        ax.plot(g["step"], g["entropy"], color=color, lw=1.4, label=label)
    ax.set_xlabel("training step")
    ax.set_ylabel("policy entropy (nats / token)")
    ax.set_title(spec.title)
    factors = m["factor"].dropna().unique().tolist()
    ax.legend(fontsize=8, title=str(factors[0]) if len(factors) == 1 else None)
    return save(fig, out_dir, FIGURE, opts)
