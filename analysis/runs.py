"""Load run directories (DESIGN.md "A run directory") into pandas.

    runs/<sweep>/<run>/{config.gin, run.json, metrics.jsonl, eval.jsonl, checkpoints/}

`load_runs(path)` accepts a run directory, a sweep directory or any directory above them and
finds every run under it. It is robust to runs that are still being written (a partial last
line is skipped), to failed runs (kept, with status "failed" and the error) and to runs without
evaluations yet (present in the run table, absent from the evaluation rows).

- `load_runs(path, what="eval")`    one row per evaluation (default)
- `load_runs(path, what="metrics")` one row per learner step
- `load_runs(path, what="runs")`    one row per run: metadata, status, counts, last values
- `fit_run(eval_df_of_one_run)`     the sigmoid fit of one run, or None when it cannot be fitted
- `fit_runs(eval_df)`               a table of fits, one row per run
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pandas as pd

from analysis.scaling_law import FitError, FitResult, fit

log = logging.getLogger(__name__)

__all__ = ["find_run_dirs", "read_jsonl", "load_runs", "fit_run", "fit_runs", "compute_label", "RUN_KEYS"]

# Columns that identify a run in every frame.
RUN_KEYS = ["sweep", "run", "factor", "value", "recipe", "seed", "status"]
COMPUTE_COLUMNS = ("compute_hours", "flops")


def find_run_dirs(path: str | Path) -> list[Path]:
    """Every run directory at or under `path`: a directory holding run.json, or, for a run
    whose run.json is not written yet, metrics.jsonl or eval.jsonl."""
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"no such run directory: {root}")
    markers = ("run.json", "metrics.jsonl", "eval.jsonl")
    if any((root / m).is_file() for m in markers):
        return [root]
    found = set()
    for m in markers:
        for f in root.rglob(m):
            if "checkpoints" not in f.parts:
                found.add(f.parent)
    return sorted(found)


def read_jsonl(path: Path) -> tuple[list[dict], int]:
    """Rows of a JSON-lines file and the number of lines skipped.

    A last line without its newline (the writer is mid-line) is skipped silently; any other
    line that is not a JSON object is skipped with a warning naming the file and line.
    """
    if not path.is_file():
        return [], 0
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    rows, skipped = [], 0
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            skipped += 1
            if i != len(lines) - 1:  # not the unfinished last line
                log.warning("%s:%d: skipping a bad line (%s)", path, i + 1, e)
            continue
        rows.append(row)
    return rows, skipped


def _read_run_json(run_dir: Path) -> dict[str, Any]:
    p = run_dir / "run.json"
    meta: dict[str, Any] = {}
    if p.is_file():
        try:
            meta = json.loads(p.read_text(encoding="utf-8"))
        except ValueError as e:  # being rewritten: fall back to the path
            log.warning("%s: unreadable (%s); taking name and sweep from the path", p, e)
            meta = {"status": "unknown"}
    else:
        meta = {"status": "running"}
    hw = meta.get("hardware") or {}
    return {
        "sweep": meta.get("sweep") or run_dir.parent.name,
        "run": meta.get("name") or run_dir.name,
        "factor": meta.get("factor"),
        "value": _hashable(meta.get("value")),
        "recipe": meta.get("recipe"),
        "seed": meta.get("seed"),
        "status": meta.get("status") or "unknown",
        "error": meta.get("error"),
        "git_sha": meta.get("git_sha"),
        "device": hw.get("device") if isinstance(hw, dict) else None,
        "device_count": hw.get("count") if isinstance(hw, dict) else None,
        "started": meta.get("started"),
        "finished": meta.get("finished"),
        "path": str(run_dir),
    }


def _hashable(v: Any) -> Any:
    """Sweep values may be lists or dicts in run.json; make them usable as group keys."""
    if isinstance(v, (list, dict)):
        return json.dumps(v, sort_keys=True)
    return v


def _flatten(row: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in row.items():
        if isinstance(v, dict):  # per_task -> per_task.<task>
            for kk, vv in v.items():
                out[f"{k}.{kk}"] = vv
        else:
            out[k] = v
    return out


def _iter_rows(run_dirs: list[Path], what: str) -> Iterator[dict[str, Any]]:
    fname = {"eval": "eval.jsonl", "metrics": "metrics.jsonl"}[what]
    for d in run_dirs:
        meta = _read_run_json(d)
        rows, _ = read_jsonl(d / fname)
        for row in rows:
            yield {**meta, **_flatten(row)}


def _run_table(run_dirs: list[Path]) -> pd.DataFrame:
    recs = []
    for d in run_dirs:
        meta = _read_run_json(d)
        ev, ev_skipped = read_jsonl(d / "eval.jsonl")
        mt, mt_skipped = read_jsonl(d / "metrics.jsonl")
        last_ev = ev[-1] if ev else {}
        last_mt = mt[-1] if mt else {}
        recs.append({
            **meta,
            "n_evals": len(ev),
            "n_steps": len(mt),
            "step": last_mt.get("step", last_ev.get("step")),
            "compute_hours": last_mt.get("compute_hours", last_ev.get("compute_hours")),
            "flops": last_mt.get("flops", last_ev.get("flops")),
            "last_pass_rate": last_ev.get("pass_rate"),
            "truncation_rate": last_mt.get("truncation_rate"),
            "partial_lines": ev_skipped + mt_skipped,
        })
    return pd.DataFrame.from_records(recs, columns=None if recs else [*RUN_KEYS, "path", "n_evals", "n_steps"])


def load_runs(path: str | Path, *, what: str = "eval") -> pd.DataFrame:
    """A DataFrame over every run under `path`.

    what="eval": one row per evaluation (run metadata + step, compute_hours, flops, pass_rate,
    k, prompts, per_task.<task>), sorted by sweep, run, step. Runs without evaluations have no
    rows here; see what="runs".
    what="metrics": one row per learner step. what="runs": one row per run.
    """
    if what not in ("eval", "metrics", "runs"):
        raise ValueError(f"what must be one of 'eval', 'metrics', 'runs'; got {what!r}")
    run_dirs = find_run_dirs(path)
    if what == "runs":
        return _run_table(run_dirs)
    df = pd.DataFrame.from_records(list(_iter_rows(run_dirs, what)))
    if df.empty:
        return pd.DataFrame(columns=[*RUN_KEYS, "path", "step", *COMPUTE_COLUMNS, "pass_rate"])
    for col in ("step", *COMPUTE_COLUMNS, "pass_rate"):
        if col in df:
            df[col] = pd.to_numeric(df[col], errors="coerce")
    # A resumed run can repeat a step: keep the last record of each step.
    df = df.drop_duplicates(subset=["path", "step"], keep="last") if "step" in df else df
    return df.sort_values(["sweep", "run", "step"], kind="stable").reset_index(drop=True)


def compute_label(compute: str = "compute_hours", device: str | None = None) -> str:
    """Axis label for the compute column."""
    if compute == "flops":
        return "training compute (FLOPs)"
    if device and str(device).lower().startswith(("cuda", "gpu")):
        return "training compute (GPU-hours)"
    if device and str(device).lower() == "cpu":
        return "training compute (CPU process-hours)"
    return "training compute (device-hours)"


def run_curve(df_run: pd.DataFrame, compute: str = "compute_hours") -> tuple[np.ndarray, np.ndarray]:
    """(compute, pass_rate) of one run's evaluations: finite, sorted, strictly increasing compute
    (of repeated compute values the last evaluation is kept)."""
    if compute not in df_run:
        raise KeyError(f"no column {compute!r}; choose from {list(COMPUTE_COLUMNS)}")
    d = df_run[[compute, "pass_rate"]].apply(pd.to_numeric, errors="coerce").dropna()
    d = d.sort_values(compute, kind="stable").drop_duplicates(subset=[compute], keep="last")
    return d[compute].to_numpy(np.float64), d["pass_rate"].to_numpy(np.float64)


def fit_run(
    df_run: pd.DataFrame,
    *,
    compute: str = "compute_hours",
    min_points: int = 6,
    max_compute: float | None = None,
    **fit_kwargs: Any,
) -> FitResult | None:
    """The sigmoid fit of one run's evaluation rows, or None when there is not enough to fit.

    For `scalerl status`: None when fewer than `min_points` evaluations (with compute <=
    `max_compute` when given) or when the curve cannot be fitted (flat, no gain over R0).
    R0 is the run's first evaluation. Extra keywords go to `analysis.scaling_law.fit`.
    """
    c, r = run_curve(df_run, compute)
    if max_compute is not None:
        fit_kwargs.setdefault("r0", float(r[0]) if r.size else None)
        keep = c <= max_compute
        c, r = c[keep], r[keep]
    if c.size < min_points:
        return None
    try:
        return fit(c, r, **fit_kwargs)
    except FitError as e:
        log.info("run not fitted: %s", e)
        return None


def fit_runs(
    df: pd.DataFrame,
    *,
    runs: pd.DataFrame | None = None,
    compute: str = "compute_hours",
    min_points: int = 6,
    fraction: float | None = None,
    min_compute: float = 0.0,
    bootstrap: int = 0,
    seed: int = 0,
    keep_fits: bool = False,
) -> pd.DataFrame:
    """One row per run: RUN_KEYS, n_evals, A, B, C_mid, R0, sse, rmse, r2, n_points, flags, fit_error.

    df: evaluation rows (`load_runs(path)`); runs: the run table (`load_runs(path, what="runs")`)
    to also list runs without evaluations. R0 is each run's first evaluation.
    fraction: fit only on compute <= fraction × the run's final compute; the row then also
    holds predicted_final, observed_final and prediction_error (predicted − observed).
    bootstrap: N > 0 adds seeded percentile 95% intervals A_lo/A_hi, B_lo/B_hi, C_mid_lo/C_mid_hi.
    keep_fits: add a `fit` column holding each FitResult (None where not fitted).
    """
    from analysis.scaling_law import bootstrap as bootstrap_fit

    groups = {p: g for p, g in df.groupby("path", sort=False)} if not df.empty else {}
    metas = (runs.to_dict("records") if runs is not None
             else [g.iloc[0].to_dict() for g in groups.values()])
    rows = []
    for meta in metas:
        g = groups.get(meta["path"])
        c, r = run_curve(g, compute) if g is not None else (np.array([]), np.array([]))
        row: dict[str, Any] = {k: meta.get(k) for k in RUN_KEYS}
        row.update(n_evals=int(c.size), final_compute=float(c[-1]) if c.size else math.nan)
        res = None
        try:
            if c.size < min_points:
                raise FitError(f"{c.size} evaluations (< min_points {min_points})")
            keep = c <= fraction * float(c[-1]) if fraction is not None else np.ones(c.size, bool)
            kw = {"r0": float(r[0]), "min_compute": min_compute}
            res = fit(c[keep], r[keep], **kw)
            row.update(res.summary())
            if fraction is not None:
                row["predicted_final"] = float(res(c[-1]))
                row["observed_final"] = float(r[-1])
                row["prediction_error"] = row["predicted_final"] - row["observed_final"]
            if bootstrap:
                bs = bootstrap_fit(c[keep], r[keep], n_boot=bootstrap, seed=seed, **kw)
                for name, (lo, hi) in bs.intervals().items():
                    row[f"{name}_lo"], row[f"{name}_hi"] = lo, hi
            row["fit_error"] = ""
        except FitError as e:
            row["fit_error"] = str(e)
        if keep_fits:
            row["fit"] = res
        rows.append(row)
    out = pd.DataFrame.from_records(rows)
    first = [*RUN_KEYS, "n_evals", "A", "B", "C_mid", "R0"]
    return out.reindex(columns=first + [c for c in out.columns if c not in first])
