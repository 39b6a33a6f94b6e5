"""Table 1: fitted C_mid, B and A of the ScaleRL variants (model size, batch size, generation
length, generations per prompt), each run fitted by the table's protocol (the paper: the first
half of the run, from the paper's cutoff as a fraction of it; analysis/figure_specs.py), as `scalerl fit`
fits it; and the math / code rows: each task of a run trained on a task mixture (Fig 11's runs),
its per-task curve fitted alike. Writes table1.csv (with the protocol, where each fit starts and the margin on A),
table1.md and the table as PNG/PDF."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from paper_figures.common import (MissingRuns, Options, RunData, curves, figure_summaries, protocol_note,
                                  require_eval, save, style)
from analysis.figure_specs import FIGURES
from paper_figures.task_curves import mixture_table_rows

FIGURE = "table1"


def table(data: RunData, opts: Options) -> pd.DataFrame:
    spec = FIGURES[FIGURE]
    try:
        ev = require_eval(spec, data, opts.compute)
    except MissingRuns:  # the math / code rows (runs trained on a task mixture) may still be there
        mixture = mixture_table_rows(data, opts)
        if not mixture:
            raise
        return pd.DataFrame(mixture)
    summaries = figure_summaries(spec, ev, opts, data)
    rows_by_path = {row["path"]: row for s in summaries.values() for _, row in s.runs.iterrows()}
    rows = []
    for sweep, g_sweep in ev.groupby("sweep", sort=True):
        for label, g in curves(g_sweep):
            row = rows_by_path[g["path"].iloc[0]]
            res = row["fit"]
            factor = g["factor"].iloc[0]
            rows.append({
                "experiment": f"ScaleRL-{label}",  # the paper's naming: ScaleRL-32k, ScaleRL-bs512
                "sweep": sweep,
                "factor": factor if isinstance(factor, str) else None,
                "C_mid": None if res is None else res.C_mid,
                "B": None if res is None else res.B,
                "A": None if res is None else res.A,
                "fit_to": row["fit_cutoff"],
                "n_points": None if res is None else res.n_points,
                "protocol": row["protocol"],
                "min_compute": row["min_compute"],
                "min_compute_rule": row["min_compute_rule"],
                "margin": row["margin"],
                "margin_source": row["margin_source"],
                "contended": row["contended"],
                "note": row["fit_error"] if res is None else "; ".join(res.flags),
            })
    rows += mixture_table_rows(data, opts)  # the math / code rows: per-task curves of mixture runs (Fig 11's runs)
    if not rows:
        raise MissingRuns("no runs with evaluations for Table 1")
    df = pd.DataFrame(rows)
    df.attrs["note"] = protocol_note(summaries)
    return df


def _num(v, kind: str) -> str:
    if v is None or pd.isna(v):
        return "—"
    if kind == "C_mid":
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"
    return f"{v:.2f}" if kind == "B" else f"{v:.3f}"


def _cells(df: pd.DataFrame) -> list[list[str]]:
    return [[r.experiment + (" [contended]" if r.contended else ""), _num(r.C_mid, "C_mid"), _num(r.B, "B"),
             _num(r.A, "A")] for r in df.itertuples()]


def _markdown(df: pd.DataFrame) -> str:
    lines = ["| Experiment | C_mid | B | A |", "|---|---|---|---|"]
    lines += ["| " + " | ".join(row) + " |" for row in _cells(df)]
    note = df.attrs.get("note", "")
    return "\n".join(lines) + "\n" + ("\n" + note.replace("\n", "\n\n") + "\n" if note else "")


def draw(data: RunData, out_dir: str | Path, opts: Options = Options()) -> list[Path]:
    df = table(data, opts)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / f"{FIGURE}.csv", index=False)
    (out / f"{FIGURE}.md").write_text(_markdown(df))
    style()
    fig, ax = plt.subplots(figsize=(7.5, 0.9 + 0.3 * len(df)))
    ax.axis("off")
    tab = ax.table(cellText=_cells(df), colLabels=["Experiment", "C_mid", "B", "A"], loc="center",
                   colWidths=[0.52, 0.18, 0.15, 0.15])
    tab.auto_set_font_size(False)
    tab.set_fontsize(8)
    ax.set_title(f"{FIGURES[FIGURE].title}\n{df.attrs.get('note', '')}", fontsize=8)
    return [*save(fig, out, FIGURE, opts), out / f"{FIGURE}.csv", out / f"{FIGURE}.md"]
