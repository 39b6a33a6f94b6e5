r"""Mechanism meters: whether the mechanism a claim is about acts in the runs that judge it.

The paper's ablations change a mechanism (clipping, aggregation over lengths, policy lag, the LM
head's precision, filtering, the prompt pool); at a scale where that mechanism never acts, every
configuration trains the same way and a verdict says nothing about it. The learner logs, per
step, the meters of each mechanism (components/trainer/learner.py); this module turns one run's
metrics.jsonl rows into one value per meter, the columns of the run table (`METER_COLUMNS`):

| column | per run, from metrics.jsonl | the mechanism |
|---|---|---|
| `completion_tokens_p10/p50/p90` | median over steps of the step's length quantiles | what an aggregation weighs, what length control cuts |
| `clip_frac_low`, `clip_frac_high` | mean over steps: share of trained tokens clipped below 1 − ε_low / above 1 + ε_high | a clipped loss (DAPO, GRPO, GSPO, CISPO's cap) |
| `ratio_p01`, `ratio_p99` | median over steps of the 1% / 99% quantiles of π_train/π_gen | off-policyness and mismatch, what clipping and IS corrections act on |
| `lag_mean`, `lag_max` | mean / max over steps: versions between the generating and the trained policy | the off-policy scheme and its k |
| `logprob_gap` | mean over steps of \|log π_train − log π_gen\| on tokens of lag 0 (else on all tokens) | precision mismatch (the FP32 head) |
| `zero_variance_frac` | mean over steps: share of prompts whose G rewards are all equal | zero-variance filtering, advantage normalisation |
| `pool_left_min` | the fewest prompts left in the training pool | No-Positive-Resampling, batch size vs pool size |
| `truncation_frac`, `interrupted_frac` | mean over steps: completions cut at the budget / interrupted | length control |

A meter a run did not log (older runs) is NaN; beside them the run table keeps what older runs did
log (`clip_frac` without its sides, `completion_tokens_mean`, `ratio_min` / `ratio_max`: the median
over steps of each step's extreme ratio), and `meters_text`, which prints a claim's meters per
configuration (mean over seeds) for the report, falls back to them.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

__all__ = ["METER_COLUMNS", "METERS_FILE", "run_meters", "meters_text", "meter_summary"]

# beside a collected metrics.jsonl that was thinned to every N-th step (experiments/study_runs.collect):
# the run's meters from its whole log, which the run table reads instead of re-computing them from the
# kept lines (a mean over every N-th step is not the mean)
METERS_FILE = "meters.json"

METER_COLUMNS = ("completion_tokens_p10", "completion_tokens_p50", "completion_tokens_p90", "clip_frac_low",
                 "clip_frac_high", "ratio_p01", "ratio_p99", "lag_mean", "lag_max", "logprob_gap",
                 "zero_variance_frac", "pool_left_min", "truncation_frac", "interrupted_frac",
                 # what runs logged before the per-side and quantile meters existed (printed where those are NaN)
                 "clip_frac", "completion_tokens_mean", "ratio_min", "ratio_max")


def _values(rows: Iterable[Mapping[str, Any]], key: str) -> np.ndarray:
    out = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    x = np.asarray(out, dtype=np.float64)
    return x[np.isfinite(x)]


def _agg(x: np.ndarray, how: str) -> float:
    if not x.size:
        return math.nan
    return float({"mean": np.mean, "median": np.median, "max": np.max, "min": np.min}[how](x))


def run_meters(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """One run's meters (`METER_COLUMNS`) from its metrics.jsonl rows (steps that trained nothing
    log NaN and are left out)."""
    out = {f"completion_tokens_p{q}": _agg(_values(rows, f"completion_tokens_p{q}"), "median") for q in (10, 50, 90)}
    out["clip_frac_low"] = _agg(_values(rows, "clip_frac_low"), "mean")
    out["clip_frac_high"] = _agg(_values(rows, "clip_frac_high"), "mean")
    out["ratio_p01"] = _agg(_values(rows, "ratio_p01"), "median")
    out["ratio_p99"] = _agg(_values(rows, "ratio_p99"), "median")
    out["lag_mean"] = _agg(_values(rows, "lag_mean"), "mean")
    out["lag_max"] = _agg(_values(rows, "lag_max"), "max")
    gap0 = _values(rows, "logprob_gap_lag0")
    out["logprob_gap"] = _agg(gap0 if gap0.size else _values(rows, "logprob_gap_mean"), "mean")
    out["zero_variance_frac"] = _agg(_values(rows, "zero_variance_frac"), "mean")
    out["pool_left_min"] = _agg(_values(rows, "curriculum_active"), "min")
    out["truncation_frac"] = _agg(_values(rows, "truncation_rate"), "mean")
    out["interrupted_frac"] = _agg(_values(rows, "interrupted_frac"), "mean")
    out["clip_frac"] = _agg(_values(rows, "clip_frac"), "mean")
    out["completion_tokens_mean"] = _agg(_values(rows, "completion_len_mean"), "mean")
    out["ratio_min"] = _agg(_values(rows, "is_ratio_min"), "median")
    out["ratio_max"] = _agg(_values(rows, "is_ratio_max"), "median")
    return out


_FORMATS = {
    "clip_frac_low": ("clipped low", "{:.2%}"), "clip_frac_high": ("clipped high", "{:.2%}"),
    "ratio_p01": ("ratio p1", "{:.3f}"), "ratio_p99": ("ratio p99", "{:.3f}"),
    "lag_mean": ("lag mean", "{:.2f}"), "lag_max": ("lag max", "{:.0f}"),
    "logprob_gap": ("log-prob gap", "{:.4f}"), "zero_variance_frac": ("zero-variance", "{:.1%}"),
    "pool_left_min": ("pool left (min)", "{:.0f}"), "truncation_frac": ("truncated", "{:.1%}"),
    "interrupted_frac": ("interrupted", "{:.1%}"),
    "completion_tokens_p10": ("length p10", "{:.0f}"), "completion_tokens_p50": ("length p50", "{:.0f}"),
    "completion_tokens_p90": ("length p90", "{:.0f}"),
    "clip_frac": ("clipped", "{:.2%}"), "completion_tokens_mean": ("length mean", "{:.1f}"),
    "ratio_min": ("ratio min", "{:.3f}"), "ratio_max": ("ratio max", "{:.3f}"),
}
# a meter the runs did not log, and the older one printed in its place
_FALLBACK = {"clip_frac_low": "clip_frac", "clip_frac_high": "clip_frac", "ratio_p01": "ratio_min",
             "ratio_p99": "ratio_max", "completion_tokens_p10": "completion_tokens_mean",
             "completion_tokens_p50": "completion_tokens_mean", "completion_tokens_p90": "completion_tokens_mean"}


def meter_summary(runs: pd.DataFrame, config: str, column: str) -> float:
    """The mean over a configuration's runs of one meter column, the max for `lag_max` (NaN when none
    logged it)."""
    if column not in runs:
        return math.nan
    x = pd.to_numeric(runs.loc[runs["config"] == config, column], errors="coerce").dropna()
    return float(x.max()) if column == "lag_max" and len(x) else float(x.mean()) if len(x) else math.nan


def meters_text(runs: pd.DataFrame, configs: Sequence[str], columns: Sequence[str]) -> str:
    """'dapo: clipped low 0.01%, clipped high 0.02%; cispo: ...' (mean over seeds; max for lag max);
    empty when no configuration logged any of the columns."""
    parts = []
    for c in configs:
        vals, shown = [], set()
        for col in columns:
            v = meter_summary(runs, c, col)
            if not math.isfinite(v) and col in _FALLBACK:  # an older run: the meter it did log
                col = _FALLBACK[col]
                v = meter_summary(runs, c, col) if col not in shown else math.nan
            if math.isfinite(v):
                shown.add(col)
                name, fmt = _FORMATS.get(col, (col, "{:.3g}"))
                vals.append(f"{name} {fmt.format(v)}")
        if vals:
            parts.append(f"{c}: " + ", ".join(vals))
    return "; ".join(parts)
