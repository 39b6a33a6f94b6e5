"""Table 1: fitted C_mid, B and A of the ScaleRL variants (model size, batch size, generation
length, generations per prompt), each run fitted on compute <= Options.fit_fraction × its final
compute. Writes table1.csv, table1.md and the table as PNG/PDF."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from analysis.runs import run_curve
from paper_figures.common import MissingRuns, Options, RunData, curves, fit_points, require_eval, save, style
from paper_figures.spec import FIGURES

FIGURE = "table1"


def table(data: RunData, opts: Options) -> pd.DataFrame:
    ev = require_eval(FIGURES[FIGURE], data, opts.compute)
    rows = []
    for sweep, g_sweep in ev.groupby("sweep", sort=True):
        for label, g in curves(g_sweep):
            c, r = run_curve(g, opts.compute)
            res, cutoff, reason = fit_points(c, r, opts)
            factor = g["factor"].iloc[0]
            rows.append({
                "experiment": f"ScaleRL-{factor}={label}" if isinstance(factor, str) else f"ScaleRL-{label}",
                "sweep": sweep,
                "C_mid": None if res is None else res.C_mid,
                "B": None if res is None else res.B,
                "A": None if res is None else res.A,
                "fit_to": cutoff,
                "n_points": None if res is None else res.n_points,
                "note": reason if res is None else "; ".join(res.flags),
            })
    if not rows:
        raise MissingRuns("no runs with evaluations for Table 1")
    return pd.DataFrame(rows)


def _num(v, kind: str) -> str:
    if v is None or pd.isna(v):
        return "—"
    if kind == "C_mid":
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"
    return f"{v:.2f}" if kind == "B" else f"{v:.3f}"


def _cells(df: pd.DataFrame) -> list[list[str]]:
    return [[r.experiment, _num(r.C_mid, "C_mid"), _num(r.B, "B"), _num(r.A, "A")] for r in df.itertuples()]


def _markdown(df: pd.DataFrame) -> str:
    lines = ["| Experiment | C_mid | B | A |", "|---|---|---|---|"]
    lines += ["| " + " | ".join(row) + " |" for row in _cells(df)]
    return "\n".join(lines) + "\n"


def draw(data: RunData, out_dir: str | Path, opts: Options = Options()) -> list[Path]:
    df = table(data, opts)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / f"{FIGURE}.csv", index=False)
    (out / f"{FIGURE}.md").write_text(_markdown(df))
    style()
    fig, ax = plt.subplots(figsize=(7.5, 0.6 + 0.3 * len(df)))
    ax.axis("off")
    tab = ax.table(cellText=_cells(df), colLabels=["Experiment", "C_mid", "B", "A"], loc="center",
                   colWidths=[0.52, 0.18, 0.15, 0.15])
    tab.auto_set_font_size(False)
    tab.set_fontsize(8)
    ax.set_title(FIGURES[FIGURE].title, fontsize=9)
    return [*save(fig, out, FIGURE, opts), out / f"{FIGURE}.csv", out / f"{FIGURE}.md"]
