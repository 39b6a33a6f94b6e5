"""Load run directories (DESIGN.md "A run directory") into pandas.

    runs/<sweep>/<run>/{config.gin, run.json, metrics.jsonl, eval.jsonl, checkpoints/}

`load_runs(path)` accepts a run directory, a sweep directory or any directory above them and
finds every run under it. It is robust to runs that are still being written (a partial last
line is skipped), to failed runs (kept, with status "failed" and the error) and to runs without
evaluations yet (present in the run table, absent from the evaluation rows).

- `load_runs(path, what="eval")`    one row per held-out evaluation (default); eval.jsonl lines
                                    with a "benchmark" key (downstream benchmarks) are not here
- `load_runs(path, what="benchmarks")` one row per downstream benchmark record of eval.jsonl
- `load_runs(path, what="metrics")` one row per learner step
- `load_runs(path, what="runs")`    one row per run: metadata, status, counts, last values,
                                    where its first epoch ends, its CPU contention
- `fit_run(eval_df_of_one_run)`     the sigmoid fit of one run, or None when it cannot be fitted
- `run_finished(status, error)`    whether a run ran to its end (done, or its prompt pool ran out)
- `pool_dry_step(metrics_text)`    the step at which its prompt pool could no longer fill a step
- `fit_runs(eval_df)`               a table of fits, one row per run, by the paper's protocol
                                    (analysis/protocol.py)

A run's held-out curve ends where its prompt pool ran dry. No-Positive-Resampling drops every
prompt that reaches a pass rate of 0.9, so a finite pool thins; once fewer prompts are active
than one step orders (`curriculum_active < prompts` in metrics.jsonl), each step trains on the
same handful of hard prompts, and the held-out pass rate falls (the tiny-long study's bs64 runs:
0.91-0.93 -> 0.26-0.69 within ~150 steps as the last ~100 prompts go). That is a property of the pool's size, not of the
configuration, so what="eval" keeps only the evaluations before that step and the run table
says where (`pool_dry_step`, `n_evals_after_pool_dry`). A run that then stopped with
`CurriculumExhausted` (every prompt dropped) ran to its end: `run_finished` counts it with the
done ones.
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import pandas as pd

from analysis.meters import METER_COLUMNS, METERS_FILE, run_meters
from analysis.protocol import epoch1_compute, fit_with_protocol, get_protocol, is_contended
from analysis.scaling_law import FitError, FitResult, fit, loglinear_fit, prediction_interval, profile_A

log = logging.getLogger(__name__)

__all__ = ["resolve_compute", "COMPUTE_AXES", "find_run_dirs", "read_jsonl", "load_runs", "fit_run", "fit_runs", "compute_label", "RUN_KEYS",
           "run_curve", "run_sampling_variance",
           "config_name", "is_benchmark_row", "epoch_info", "run_contention", "run_runq", "run_finished", "pool_dry_step"]

# Columns that identify a run in every frame.
RUN_KEYS = ["sweep", "run", "factor", "value", "recipe", "seed", "status"]
COMPUTE_COLUMNS = ("compute_hours", "flops", "cpu_hours")
COMPUTE_AXES = ("auto", *COMPUTE_COLUMNS)


def resolve_compute(frame: pd.DataFrame | None, compute: str = "auto") -> str:
    """The compute axis to fit on. "auto": FLOPs at tiny scale (every run on CPU, where identical
    runs differ by a median 3.7% in wall-clock compute but 0.2% in FLOPs), device-hours otherwise
    (the paper's GPU-hours). Any other name must be one of COMPUTE_COLUMNS."""
    if compute not in COMPUTE_AXES:
        raise ValueError(f"unknown compute axis {compute!r}; choose from: {', '.join(COMPUTE_AXES)}")
    if compute != "auto":
        return compute
    if frame is None or frame.empty or "device" not in frame:
        return "compute_hours"
    devices = {str(d).lower() for d in frame["device"].dropna()}
    flops = pd.to_numeric(frame["flops"], errors="coerce") if "flops" in frame else pd.Series(dtype=float)
    return "flops" if devices == {"cpu"} and bool((flops > 0).any()) else "compute_hours"


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
            rel = f.relative_to(root).parts[:-1]
            # checkpoints/ and hidden folders (.submitit/, .contended/: runs set aside) hold no runs
            if "checkpoints" not in rel and not any(p.startswith(".") for p in rel):
                found.add(f.parent)
    return sorted(found)


def config_name(run: str) -> str:
    """A run's configuration: its name without the seed suffix ('cispo-s2' -> 'cispo';
    'eps_max=4.0-seed1' -> 'eps_max=4.0')."""
    return re.sub(r"-s(?:eed)?\d+$", "", str(run))


def run_finished(status: Any, error: Any = None) -> bool:
    """Whether a run ran to its end: run.json says done, or it failed only because its prompt pool
    ran out (CurriculumExhausted: every training prompt dropped by No-Positive-Resampling), after
    which there is nothing left to train on; its logs up to there are a whole run."""
    return status == "done" or (status == "failed" and str(error or "").startswith("CurriculumExhausted"))


_STEP = re.compile(r'"step":\s*(\d+)')
_PROMPTS = re.compile(r'"prompts":\s*(\d+)')
_ACTIVE = re.compile(r'"curriculum_active":\s*(\d+)')


def pool_dry_step(metrics_text: str) -> int | None:
    """The first learner step of metrics.jsonl's text at which fewer training prompts were active
    than the step ordered (`curriculum_active < prompts`), or None when the pool never ran that
    thin (or the run logs no curriculum). Read with regular expressions, not a JSON parse of every
    line: metrics.jsonl runs to thousands of lines and the eval loader reads it for every run."""
    if '"curriculum_active"' not in metrics_text:
        return None
    for line in metrics_text.splitlines():
        active, prompts, step = _ACTIVE.search(line), _PROMPTS.search(line), _STEP.search(line)
        if active and prompts and step and int(active.group(1)) < int(prompts.group(1)):
            return int(step.group(1))
    return None


def _metrics_text(run_dir: Path) -> str:
    p = run_dir / "metrics.jsonl"
    return p.read_text(encoding="utf-8", errors="replace") if p.is_file() else ""


def is_benchmark_row(row: dict) -> bool:
    """A downstream benchmark record in eval.jsonl (it carries a "benchmark" key)."""
    return row.get("benchmark") not in (None, "")


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
    name = meta.get("name") or run_dir.name
    return {
        "sweep": meta.get("sweep") or run_dir.parent.name,
        "run": name,
        "config": config_name(name),
        # what the paper called this configuration, where the run's name says what ran instead
        # (at tiny scale `k1` runs the paper's `k4`): run.json's `paper_name`
        "paper_config": meta.get("paper_name") or config_name(name),
        "factor": meta.get("factor"),
        "value": _hashable(meta.get("value")),
        "recipe": meta.get("recipe"),
        "seed": meta.get("seed"),
        "status": meta.get("status") or "unknown",
        "error": meta.get("error"),
        "git_sha": meta.get("git_sha"),
        "device": hw.get("device") if isinstance(hw, dict) else None,
        "device_count": hw.get("count") if isinstance(hw, dict) else None,
        "reserved_cpus": meta.get("reserved_cpus"),
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
    fname = {"eval": "eval.jsonl", "benchmarks": "eval.jsonl", "metrics": "metrics.jsonl"}[what]
    for d in run_dirs:
        meta = _read_run_json(d)
        rows, _ = read_jsonl(d / fname)
        dry = pool_dry_step(_metrics_text(d)) if what == "eval" else None
        for row in rows:
            if what != "metrics" and is_benchmark_row(row) != (what == "benchmarks"):
                continue  # held-out evaluations and benchmark records go to separate frames
            if dry is not None and _after(row, dry):
                continue  # the held-out curve ends where the prompt pool ran dry (module docstring)
            yield {**meta, **_flatten(row)}


def _after(row: dict, step: int) -> bool:
    s = row.get("step")
    return isinstance(s, (int, float)) and s >= step


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _run_table(run_dirs: list[Path]) -> pd.DataFrame:
    recs = []
    for d in run_dirs:
        meta = _read_run_json(d)
        ev_all, ev_skipped = read_jsonl(d / "eval.jsonl")
        mt, mt_skipped = read_jsonl(d / "metrics.jsonl")
        dry = pool_dry_step(_metrics_text(d))
        held_out = [e for e in ev_all if not is_benchmark_row(e)]
        ev = [e for e in held_out if dry is None or not _after(e, dry)]
        last_ev = ev[-1] if ev else {}
        last_mt = mt[-1] if mt else {}
        ep1_hours, max_epoch = epoch1_compute(mt, "compute_hours")
        ep1_flops, _ = epoch1_compute(mt, "flops")
        ep1_cpu, _ = epoch1_compute(mt, "cpu_hours")
        epochs = [_num(m.get("epoch")) for m in mt]
        epochs = [e for e in epochs if e is not None]
        contention, runq = _num(last_mt.get("contention_run")), run_runq(mt)
        recs.append({
            **meta,
            "n_evals": len(ev),
            "n_steps": len(mt),
            "pool_dry_step": dry,
            "n_evals_after_pool_dry": len(held_out) - len(ev),
            "step": last_mt.get("step", last_ev.get("step")),
            "compute_hours": last_mt.get("compute_hours", last_ev.get("compute_hours")),
            "flops": last_mt.get("flops", last_ev.get("flops")),
            "last_pass_rate": last_ev.get("pass_rate"),
            "truncation_rate": last_mt.get("truncation_rate"),
            "partial_lines": ev_skipped + mt_skipped,
            "n_benchmark_records": len(ev_all) - len(held_out),
            "epoch": max(epochs) if epochs else None,
            "epoch1_compute_hours": ep1_hours,
            "epoch1_flops": ep1_flops,
            "epoch1_cpu_hours": ep1_cpu,
            "wall_s": _num(last_mt.get("wall_s")),
            "cpu_hours": _num(last_mt.get("cpu_hours")),
            "eval_wall_s": _num(last_mt.get("eval_wall_s")),
            "startup_s": _num(last_mt.get("startup_s")),
            "contention_run": contention,
            "runq_run": runq,
            "contended": is_contended(contention, runq),
            **_meters(d, mt),  # whether each mechanism acts in this run (analysis/meters.py)
        })
    return pd.DataFrame.from_records(recs, columns=None if recs else [*RUN_KEYS, "path", "n_evals", "n_steps"])


def _meters(run_dir: Path, rows: Sequence[dict]) -> dict[str, float]:
    """The run's meters: from METERS_FILE where a collection thinned its metrics.jsonl and saved them
    from the whole log, else from its metrics.jsonl rows."""
    saved = run_dir / METERS_FILE
    if saved.is_file():
        try:
            meters = json.loads(saved.read_text())
        except (OSError, ValueError):
            meters = None
        if isinstance(meters, dict) and all(c in meters for c in METER_COLUMNS):
            return {c: float(meters[c]) if meters[c] is not None else math.nan for c in METER_COLUMNS}
    return run_meters(rows)


def load_runs(path: str | Path, *, what: str = "eval") -> pd.DataFrame:
    """A DataFrame over every run under `path`.

    what="eval": one row per held-out evaluation (run metadata + step, compute_hours, flops,
    pass_rate, k, prompts, per_task.<task>, entropy, eval_wall_s, ...), sorted by sweep, run,
    step. Runs without evaluations have no rows here; see what="runs". eval.jsonl lines with a
    "benchmark" key are downstream benchmarks, not the held-out curve: what="benchmarks".
    what="metrics": one row per learner step. what="runs": one row per run.
    """
    if what not in ("eval", "benchmarks", "metrics", "runs"):
        raise ValueError(f"what must be one of 'eval', 'benchmarks', 'metrics', 'runs'; got {what!r}")
    run_dirs = find_run_dirs(path)
    if what == "runs":
        return _run_table(run_dirs)
    df = pd.DataFrame.from_records(list(_iter_rows(run_dirs, what)))
    if df.empty:
        return pd.DataFrame(columns=[*RUN_KEYS, "path", "step", *COMPUTE_COLUMNS, "pass_rate"])
    for col in ("step", *COMPUTE_COLUMNS, "pass_rate"):
        if col in df:
            df[col] = pd.to_numeric(df[col], errors="coerce")
    # A resumed run can repeat a step: keep the last record of each step (of each benchmark).
    key = ["path", "step"] + (["benchmark"] if what == "benchmarks" and "benchmark" in df else [])
    df = df.drop_duplicates(subset=key, keep="last") if "step" in df else df
    return df.sort_values(["sweep", "run", "step"], kind="stable").reset_index(drop=True)


def compute_label(compute: str = "compute_hours", device: str | None = None) -> str:
    """Axis label for the compute column."""
    if compute == "flops":
        return "training compute (FLOPs)"
    if compute == "cpu_hours":
        return "training compute (CPU hours of the run's processes)"
    if device and str(device).lower().startswith(("cuda", "gpu")):
        return "training compute (GPU-hours)"
    if device and str(device).lower() == "cpu":
        return "training compute (reserved CPU core-hours)"
    return "training compute (device-hours)"


def run_curve(df_run: pd.DataFrame, compute: str = "compute_hours") -> tuple[np.ndarray, np.ndarray]:
    """(compute, pass_rate) of one run's evaluations: finite, sorted, strictly increasing compute
    (of repeated compute values the last evaluation is kept)."""
    d = _eval_points(df_run, compute)
    return d[compute].to_numpy(np.float64), d["pass_rate"].to_numpy(np.float64)


def _eval_points(df_run: pd.DataFrame, compute: str, extra: Sequence[str] = ()) -> pd.DataFrame:
    """One run's evaluations as numbers: finite compute and pass rate, sorted by compute, of repeated
    compute values the last evaluation kept; `extra` columns ride along (NaN where not logged)."""
    if compute not in df_run:
        raise KeyError(f"no column {compute!r}; choose from {list(COMPUTE_COLUMNS)}")
    cols = [compute, "pass_rate"] + [c for c in extra if c in df_run]
    d = df_run[cols].apply(pd.to_numeric, errors="coerce").dropna(subset=[compute, "pass_rate"])
    d = d.sort_values(compute, kind="stable").drop_duplicates(subset=[compute], keep="last")
    return d.reindex(columns=[compute, "pass_rate", *extra])


def run_sampling_variance(df_run: pd.DataFrame, compute: str = "compute_hours") -> tuple[np.ndarray, np.ndarray]:
    """(compute, v) beside `run_curve`'s points (same rows, same order): v bounds the variance that
    sampling gives each evaluation's pass rate, p(1 − p)/(prompts·k); NaN where prompts or k is not
    logged (`analysis.compare.tail_sampling_sd`)."""
    d = _eval_points(df_run, compute, extra=("prompts", "k"))
    p = d["pass_rate"].to_numpy(np.float64)
    n = d["prompts"].to_numpy(np.float64) * d["k"].to_numpy(np.float64)  # NaN where not logged
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.where(n > 0, p * (1.0 - p) / n, np.nan)
    return d[compute].to_numpy(np.float64), v


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


def epoch_info(meta: dict[str, Any], compute: str) -> tuple[float | None, float | None]:
    """(compute at the end of epoch 1, the largest epoch logged) of a run: from the run table's
    columns when given, else read from the run's metrics.jsonl."""
    key = f"epoch1_{compute}"
    if key in meta and "epoch" in meta:
        ep1, ep = meta.get(key), meta.get("epoch")
        ep1 = None if ep1 is None or (isinstance(ep1, float) and math.isnan(ep1)) else float(ep1)
        ep = None if ep is None or (isinstance(ep, float) and math.isnan(ep)) else float(ep)
        return ep1, (None if ep1 is not None else ep)
    path = meta.get("path")
    if not path:
        return None, None
    rows, _ = read_jsonl(Path(path) / "metrics.jsonl")
    return epoch1_compute(rows, compute)


def run_runq(rows: list[dict[str, Any]]) -> float | None:
    """The run's own threads' run-queue share over the run (`runq_run` of its last metrics line;
    a run logged before that field: from the cumulative `procs` of its last line, start-up
    included). None when neither is logged."""
    if not rows:
        return None
    last = rows[-1]
    if (q := _num(last.get("runq_run"))) is not None:
        return q
    procs = last.get("procs")
    if not isinstance(procs, dict) or not procs:
        return None
    if any(isinstance(p, dict) and p.get("schedstat") is False for p in procs.values()):
        return None  # a host without schedstat: the delay is unknown (judged by contention_run alone)
    cpu = sum(_num(p.get("cpu_s")) or 0.0 for p in procs.values() if isinstance(p, dict))
    wait = sum(_num(p.get("runq_s")) or 0.0 for p in procs.values() if isinstance(p, dict))
    return wait / (cpu + wait) if cpu + wait > 0 else None


def run_contention(meta: dict[str, Any]) -> tuple[float | None, float | None]:
    """A run's (`contention_run`, `runq_run`): from its run-table row, else from its metrics."""
    if "contention_run" in meta:
        return _num(meta.get("contention_run")), _num(meta.get("runq_run"))
    path = meta.get("path")
    if not path:
        return None, None
    rows, _ = read_jsonl(Path(path) / "metrics.jsonl")
    return (_num(rows[-1].get("contention_run")) if rows else None), run_runq(rows)


def fit_runs(
    df: pd.DataFrame,
    *,
    runs: pd.DataFrame | None = None,
    compute: str = "compute_hours",
    min_points: int = 6,
    fraction: float | None = None,
    min_compute: str | float = "paper",
    protocol: Any = None,
    bootstrap: int = 0,
    seed: int = 0,
    keep_fits: bool = False,
    profile: bool = True,
    predict_boot: int = 0,
) -> pd.DataFrame:
    """One row per run, each fitted by the paper's protocol (analysis/protocol.py):
    RUN_KEYS, config, n_evals, A, B, C_mid, R0, sse, rmse, r2, n_points, fit_from, fit_to, flags,
    fit_error, protocol, fit_fraction, fit_cutoff, min_compute, min_compute_rule,
    contention_run, runq_run, contended.

    df: evaluation rows (`load_runs(path)`); runs: the run table (`load_runs(path, what="runs")`)
    to also list runs without evaluations (and to read each run's epoch end without re-reading
    its metrics). R0 is each run's first evaluation.
    protocol: a protocol name or Protocol for every run; None: each run's sweep's protocol
    (`analysis.protocol.sweep_protocol`: whole run for forward ablations, first half for LOO...).
    min_compute: "paper" (default: the end of each run's first epoch for a whole-run fit, the
    paper's fraction of the fitted range for a prefix fit; analysis/protocol.py), "epoch" (the
    end of epoch 1 for every fit), "none"/0, or an absolute compute.
    fraction: fit only compute <= fraction × the run's final compute (overrides the protocol's
    range); the row then also holds predicted_final, observed_final and prediction_error
    (predicted − observed at the last evaluation).
    bootstrap: N > 0 adds seeded percentile 95% intervals A_lo/A_hi, B_lo/B_hi, C_mid_lo/C_mid_hi.
    keep_fits: add a `fit` column holding each FitResult (None where not fitted).
    profile: add each fit's 95% profile-likelihood interval of A (`A_profile_lo`, `A_profile_hi`,
    inside [.., 1] for pass rates), `A_at_cap` and `A_identified` (that interval no wider than
    0.1: `analysis.scaling_law.profile_A`).
    With `fraction`, the row also holds the log-linear baseline's prediction of the same end from the
    same points (`baseline_final`, `baseline_error`), and with predict_boot > 0 the sigmoid's
    bootstrap prediction interval (`predicted_low`, `predicted_high`, `covered`).
    """
    from analysis.protocol import sweep_protocol
    from analysis.scaling_law import bootstrap as bootstrap_fit

    groups = {p: g for p, g in df.groupby("path", sort=False)} if not df.empty else {}
    metas = (runs.to_dict("records") if runs is not None
             else [g.iloc[0].to_dict() for g in groups.values()])
    rows = []
    for meta in metas:
        g = groups.get(meta["path"])
        c, r = run_curve(g, compute) if g is not None else (np.array([]), np.array([]))
        row: dict[str, Any] = {k: meta.get(k) for k in RUN_KEYS}
        row["config"] = meta.get("config") or config_name(str(meta.get("run")))
        row["path"] = meta.get("path")
        row.update(n_evals=int(c.size), final_compute=float(c[-1]) if c.size else math.nan,
                   finished=run_finished(meta.get("status"), meta.get("error")),
                   pool_dry_step=None if (dry := _num(meta.get("pool_dry_step"))) is None else int(dry))
        proto = get_protocol(protocol) if protocol is not None else sweep_protocol(meta.get("sweep"))
        ep1, max_ep = epoch_info(meta, compute)
        pf = fit_with_protocol(c, r, protocol=proto, min_compute=min_compute, epoch1=ep1, max_epoch=max_ep,
                               fit_fraction=fraction, min_points=min_points)
        contention, runq = run_contention(meta)
        row.update(protocol=proto.name, fit_fraction=pf.fit_fraction, fit_cutoff=pf.cutoff,
                   min_compute=pf.min_compute, min_compute_rule=pf.min_rule,
                   contention_run=contention, runq_run=runq, contended=is_contended(contention, runq),
                   **{m: _num(meta.get(m)) for m in METER_COLUMNS if m in meta})
        res = pf.fit
        if res is not None:
            row.update(res.summary())
            if profile:
                prof = profile_A(res)
                row.update(A_profile_lo=prof.low, A_profile_hi=prof.high, A_profile_width=prof.width,
                           A_at_cap=prof.at_cap, A_identified=prof.identified)
            if fraction is not None:
                row["predicted_final"] = float(res(c[-1]))
                row["observed_final"] = float(r[-1])
                row["prediction_error"] = row["predicted_final"] - row["observed_final"]
                a0, a1 = loglinear_fit(res.compute, res.reward)
                row["baseline_final"] = a0 + a1 * math.log(float(c[-1]))
                row["baseline_error"] = row["baseline_final"] - row["observed_final"]
                if predict_boot:
                    lo, hi = prediction_interval(res, float(c[-1]), n_boot=predict_boot, seed=seed, level=0.95)
                    row.update(predicted_low=lo, predicted_high=hi, covered=bool(lo <= float(r[-1]) <= hi))
            if bootstrap:
                keep = c <= pf.cutoff * (1.0 + 1e-12)
                bs = bootstrap_fit(c[keep], r[keep], n_boot=bootstrap, seed=seed, r0=float(r[0]),
                                   min_compute=pf.min_compute)
                for name, (lo, hi) in bs.intervals().items():
                    row[f"{name}_lo"], row[f"{name}_hi"] = lo, hi
            row["fit_error"] = ""
        else:
            row["fit_error"] = pf.reason
            if profile:
                row["A_identified"] = False
        if keep_fits:
            row["fit"] = res
        rows.append(row)
    out = pd.DataFrame.from_records(rows)
    first = [*RUN_KEYS, "config", "n_evals", "A", "B", "C_mid", "R0"]
    return out.reindex(columns=first + [c for c in out.columns if c not in first])
