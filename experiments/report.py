"""End-of-run report: held-out pass rate against compute, the fitted sigmoid law, a figure.

`finish_report(run_dir)` is called by `scalerl train` when a run finishes (and can be run on
any finished or partial run directory). It reads the run's `eval.jsonl`, fits
R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B) (`analysis.scaling_law.fit`, R0 = the first
evaluation), prints the start and end pass rates and the fitted A (with its 95% profile-likelihood
interval and whether A is identified: `analysis.scaling_law.profile_A`), B, C_mid, and writes

    <run_dir>/report.json           start / end pass rate, the fit (or why there is none)
    <run_dir>/pass_rate_vs_compute.png / .pdf

    python -m experiments.report runs/tiny_cpu/<stamp>
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Optional

import numpy as np

__all__ = ["finish_report", "load_curve", "describe_A", "FIGURE_STEM", "REPORT_FILE"]

FIGURE_STEM = "pass_rate_vs_compute"
REPORT_FILE = "report.json"
COMPUTE_LABELS = {
    "compute_hours": "compute (device-hours: processes x wall-clock hours)",
    "flops": "compute (FLOPs, estimated)",
}


def load_curve(run_dir: str | Path, compute: str = "compute_hours") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(compute [n], pass_rate [n], step [n]) of a run's evaluations, sorted by compute.

    Evaluations at the same compute keep the last one. Raises FileNotFoundError without eval.jsonl.
    """
    from analysis.runs import read_jsonl

    path = Path(run_dir) / "eval.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: the run has no evaluations yet")
    rows, _ = read_jsonl(path)
    points: dict[float, tuple[float, float]] = {}
    for row in rows:
        if "benchmark" in row:  # a downstream benchmark record, not the held-out curve
            continue
        c, r = row.get(compute), row.get("pass_rate")
        if c is None or r is None or not (math.isfinite(float(c)) and math.isfinite(float(r))):
            continue
        points[float(c)] = (float(r), float(row.get("step", math.nan)))
    cs = np.array(sorted(points), dtype=np.float64)  # [n]
    rs = np.array([points[c][0] for c in cs], dtype=np.float64)  # [n]
    steps = np.array([points[c][1] for c in cs], dtype=np.float64)  # [n]
    return cs, rs, steps


def _fit(compute: np.ndarray, reward: np.ndarray, min_compute: float = 0.0) -> tuple[Any, Optional[str]]:
    from analysis.scaling_law import FitError, fit

    if compute.size == 0:
        return None, "no evaluations"
    try:
        return fit(compute, reward, r0=float(reward[0]), min_compute=min_compute), None
    except FitError as err:
        return None, str(err)


def fit_start(run_dir: Path, compute: str) -> tuple[float, str]:
    """The paper's fit start: the compute at the end of the first epoch (0 if the run has not reached it)."""
    from analysis.protocol import epoch1_compute
    from analysis.runs import read_jsonl

    path = Path(run_dir) / "metrics.jsonl"
    rows = read_jsonl(path)[0] if path.is_file() else []
    epoch1, last = epoch1_compute(rows, compute)
    if epoch1 is None:
        return 0.0, "whole run (it did not reach the end of epoch 1)" if last is not None else "whole run (no epoch logged)"
    return float(epoch1), "end of epoch 1 (the paper skips about one epoch)"


def _profile(result) -> Optional[dict]:
    """A's 95% profile-likelihood interval (`analysis.scaling_law.profile_A`) as report.json holds it;
    None without a fit, or with the reason when the profile cannot be computed."""
    if result is None:
        return None
    from analysis.scaling_law import A_IDENTIFIED_WIDTH, profile_A

    try:
        prof = profile_A(result)
    except Exception as err:  # noqa: BLE001 - the fit stands without its interval; say why
        return {"error": f"{type(err).__name__}: {err}"}
    return {"A": float(result.A), "low": float(prof.low), "high": float(prof.high), "level": float(prof.level),
            "width": float(prof.width), "identified": bool(prof.identified), "at_cap": bool(prof.at_cap),
            "at_floor": bool(prof.at_floor), "identified_width": float(A_IDENTIFIED_WIDTH)}


def describe_A(profile: Optional[dict]) -> str:
    """"A = 0.912, 95% profile interval [0.88, 0.95] (width 0.07): identified" or why it is not."""
    if not profile:
        return "no fit"
    if "error" in profile:
        return f"A = {profile.get('A', float('nan')):.3f}, no profile interval ({profile['error']})"
    head = (f"A = {profile['A']:.3f}, {100 * profile['level']:.0f}% profile interval [{profile['low']:.3f}, "
            f"{profile['high']:.3f}] (width {profile['width']:.3f})")
    if profile["identified"]:
        return f"{head}: identified (at most {profile['identified_width']:g} wide)"
    why = ("it reaches the cap: the run may still be far from its plateau" if profile["at_cap"]
           else "it reaches the bottom of the searched range" if profile["at_floor"]
           else f"wider than {profile['identified_width']:g}")
    return f"{head}: NOT identified ({why}; train longer to pin A down)"


def _figure(run_dir: Path, compute: np.ndarray, reward: np.ndarray, result, compute_col: str, title: str,
            min_compute: float = 0.0) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="paper")
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    positive = compute > 0
    used = positive & (compute >= min_compute)
    ax.plot(compute[used], reward[used], "*", ms=9, color="C0", label="held-out pass rate (mean@k), fitted")
    if (positive & ~used).any():
        ax.plot(compute[positive & ~used], reward[positive & ~used], "x", ms=6, color="C0", alpha=0.6,
                label="before the end of epoch 1 (not fitted)")
    if result is not None and positive.any():
        lo, hi = float(compute[positive].min()), float(compute.max())
        xs = np.geomspace(lo, hi * 4.0, 200)  # [200]: fitted range, then extrapolation
        fitted = xs <= hi
        ax.plot(xs[fitted], result(xs[fitted]), "-", color="C3",
                label=f"sigmoid fit: A={result.A:.3f}, B={result.B:.2f}, C_mid={result.C_mid:.3g}")
        ax.plot(xs[~fitted], result(xs[~fitted]), "--", color="C3", alpha=0.7, label="extrapolation")
        ax.axhline(result.A, color="C3", lw=0.8, ls=":", alpha=0.7)
    if not positive.all():  # the evaluation at compute 0 (before training) cannot sit on a log axis
        ax.axhline(reward[0], color="gray", lw=0.8, ls="-.", label=f"start (step 0): {reward[0]:.3f}")
    ax.set_xscale("log")
    ax.set_xlabel(COMPUTE_LABELS.get(compute_col, compute_col))
    ax.set_ylabel("held-out pass rate")
    ax.set_ylim(0.0, 1.0)
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    out = []
    for ext in ("png", "pdf"):
        p = run_dir / f"{FIGURE_STEM}.{ext}"
        fig.savefig(p, dpi=150)
        out.append(str(p))
    plt.close(fig)
    return out


def finish_report(run_dir: str | Path, *, compute: str = "compute_hours", quiet: bool = False) -> dict:
    """Fit the sigmoid law to a run's held-out pass rate, write the figure and report.json.

    Returns the report: start/end pass rate (first and last evaluation), the fit's A, B,
    C_mid, R0 and rmse (None with `fit_error` when the curve cannot be fitted), figure paths.
    """
    run_dir = Path(run_dir)
    cs, rs, steps = load_curve(run_dir, compute)
    if cs.size == 0:
        raise ValueError(f"{run_dir / 'eval.jsonl'} has no evaluation with {compute!r} and pass_rate")
    min_compute, rule = fit_start(run_dir, compute)
    result, error = _fit(cs, rs, min_compute)
    profile = _profile(result)
    report: dict[str, Any] = {
        "run_dir": str(run_dir),
        "fit_min_compute": min_compute,
        "fit_min_compute_rule": rule,
        "compute": compute,
        "evaluations": int(cs.size),
        "start_pass_rate": float(rs[0]),
        "end_pass_rate": float(rs[-1]),
        "best_pass_rate": float(rs.max()),
        "start_step": float(steps[0]),
        "end_step": float(steps[-1]),
        "end_compute": float(cs[-1]),
        "fit": None if result is None else {k: float(v) for k, v in result.params().items()} | {
            "rmse": float(result.rmse), "r2": float(result.r2), "flags": list(result.flags)},
        "fit_error": error,
        "A_interval": profile,
    }
    title = f"{run_dir.parent.name}/{run_dir.name}"
    report["figures"] = _figure(run_dir, cs, rs, result, compute, title, min_compute)
    (run_dir / REPORT_FILE).write_text(json.dumps(report, indent=2))
    if not quiet:
        print(f"held-out pass rate: start {report['start_pass_rate']:.3f} (step {steps[0]:.0f}) -> "
              f"end {report['end_pass_rate']:.3f} (step {steps[-1]:.0f}), best {report['best_pass_rate']:.3f}", flush=True)
        if result is not None:
            print(f"sigmoid law fit: A={result.A:.3f}  B={result.B:.3f}  C_mid={result.C_mid:.4g} {compute}  "
                  f"(R0={result.R0:.3f}, rmse={result.rmse:.3f}; fitted from {rule})"
                  + (f"  flags: {'; '.join(result.flags)}" if result.flags else ""), flush=True)
            print(f"asymptote A: {describe_A(profile)}", flush=True)
        else:
            print(f"sigmoid law fit: none ({error})", flush=True)
        print(f"figure: {report['figures'][0]} (+ .pdf)", flush=True)
    return report


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--compute", default="compute_hours", choices=sorted(COMPUTE_LABELS))
    args = parser.parse_args(argv)
    try:
        finish_report(args.run_dir, compute=args.compute)
    except (FileNotFoundError, ValueError) as err:
        print(f"report: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
