"""The report of a reproduction study (`scalerl reproduce`): OUT/REPORT.md and its tables.

Per ablation the paper's finding (analysis/findings.py), ours (mean A and B over seeds with
95% t-intervals; `analysis.study.summarize`, the code path of `scalerl fit`), the verdicts on A
and on tail with the intervals behind them, and for each disagreement the reason recorded by
hand in OUT/reasons.yaml (kept across re-generations: the report only appends the ids of new
disagreements); then every run's end predicted from its first half, run times, the contended
runs, and the figures that cannot be drawn at this scale. The tables are OUT/report/*.csv.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from pathlib import Path
from typing import Any, Sequence

from analysis.scaling_law import PREDICT_BOOT  # replicates behind each prediction interval of the report
from experiments.run_state import read_json
from experiments.study_runs import (CollectResult, ReproduceError, last_metrics, logged_budget, run_ended, select_specs,
                                    thinned_every, SHARED_KEY)

__all__ = ["write_report", "report_tables", "run_times", "PREDICT_BOOT", "REPORT_FILE", "REASONS_FILE"]

REPORT_FILE = "REPORT.md"
REASONS_FILE = "reasons.yaml"
FIGURES_DIR = "figures"
TABLES_DIR = "report"


def _load_reasons(path: Path) -> dict[str, str]:
    if not path.is_file():
        return {}
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        raise ReproduceError(f"{path} is not valid YAML ({err}); fix it by hand, the report reads it") from None
    if not isinstance(data, dict):
        raise ReproduceError(f"{path} must map claim ids to reasons (a YAML mapping), got {type(data).__name__}")
    return {str(k): "" if v is None else str(v).strip() for k, v in data.items()}


def _append_reason_ids(path: Path, ids: Sequence[str], existing: dict[str, str]) -> list[str]:
    """Append `"<id>": ""` lines for disagreements without an entry; never rewrites what is there."""
    new = [i for i in ids if i not in existing]
    if not new:
        return []
    head = "" if path.is_file() else (
        "# The most likely reason for each disagreement with the paper, filled in by hand after reading the\n"
        "# runs. `scalerl reproduce --report-only` reads this file and only appends new ids.\n")
    with open(path, "a", encoding="utf-8") as f:
        f.write(head + "".join(f"{json.dumps(i)}: \"\"\n" for i in new))
    return new


def _fmt(x: Any, spec: str) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return format(x, spec)


def _ci(m, lo, hi, spec: str) -> str:
    if m is None or (isinstance(m, float) and math.isnan(m)):
        return "—"
    if lo is None or (isinstance(lo, float) and math.isnan(lo)) or lo == hi:
        return format(m, spec)
    return f"{format(m, spec)} [{format(lo, spec)}, {format(hi, spec)}]"


def _why(why: Any) -> str:
    return f" ({why})" if isinstance(why, str) and why else ""


def _md_escape(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


RUN_TIME_LIMIT_S = {"tiny": 180.0, "small": 600.0}  # a run's time on 2 cores: tiny 3 minutes, small 10 (its pilot's criterion)
_RESUMED_GAP_S = 60.0  # start-to-finish beyond the run's own time by more than this: it waited (a resume)


def run_times(out: Path) -> list[dict]:
    """Per collected run: how long it ran and whether the compute budget stopped it.

    own_s = training clock + evaluation time + start-up (the last metrics line; they add up over
    resumes, the time between an interruption and its resume is not in them); span_s = run.json's
    start to finish, which adds process launch and the final export (7-11 s in the tiny study)
    and, for a run interrupted and resumed, the time in between (`resumed`: span beyond own by
    more than a minute). `budget`: train.compute_budget_flops in its config.gin (None: ran
    without one); `stopped_on_budget`: it ended before train.total_steps."""
    rows = []
    for info_path in sorted(Path(out).glob("*/*/run.json")):
        run_dir = info_path.parent
        info, last = read_json(info_path) or {}, last_metrics(run_dir)
        if not run_ended(run_dir) or not last:
            continue
        own = sum(float(last.get(k) or 0.0) for k in ("wall_s", "eval_wall_s", "startup_s"))
        try:
            span = (_dt.datetime.fromisoformat(info["finished"]) - _dt.datetime.fromisoformat(info["started"])).total_seconds()
        except (KeyError, TypeError, ValueError):
            span = float("nan")
        cfg = (run_dir / "config.gin").read_text().splitlines() if (run_dir / "config.gin").is_file() else []
        budget = logged_budget(run_dir)
        total = [ln.partition("=")[2].strip() for ln in cfg if ln.strip().startswith("train.total_steps")]
        stopped = budget is not None and bool(total) and total[-1].isdigit() and int(last.get("step", 0)) < int(total[-1])
        rows.append({"run": f"{run_dir.parent.name}/{run_dir.name}", "own_s": own, "span_s": span,
                     "resumed": math.isfinite(span) and span - own > _RESUMED_GAP_S, "budget": budget,
                     "stopped_on_budget": stopped, "steps": int(last.get("step", 0)),
                     "compute_hours": last.get("compute_hours"), "shared": bool(info.get(SHARED_KEY))})
    return rows


def _mechanism_line(claims: Any) -> str:
    """Where a sweep's finding names a mechanism (the FP32 head and its log-prob gap) that could act
    here or cannot be told apart from acting (`analysis.study.mechanism_check`), the measurement the
    claims were judged beside; where it cannot act, each claim carries it as 'not testable' already."""
    if not len(claims) or "mechanism" not in claims:
        return ""
    evidence = next((str(e) for e in claims["mechanism"] if isinstance(e, str) and e), "")
    if not evidence or evidence.startswith("not testable"):
        return ""
    if "it removes" not in evidence:  # the metric was not logged, or too few runs to tell
        return f"**Mechanism:** {evidence}; the claims below are judged as usual."
    return (f"**Mechanism:** {evidence}. It is not shown to remove less than 10% of that (the bar for `not testable`), "
            "so the claims below are judged as usual.")


def _pool_dry_text(runs: Any) -> str:
    """The report's line on runs whose prompt pool ran dry (analysis/runs.py: their held-out curves
    end at the step where fewer prompts were left than one step orders)."""
    head = ("- **Prompt pools that ran dry**: No-Positive-Resampling drops every prompt that reaches a pass rate of "
            "0.9, so a finite pool thins; once fewer prompts are left than one step orders, each step trains on the "
            "same few hard prompts. A run's held-out curve ends at that step (`pool_dry_step` in runs.csv), and a run "
            "that then stopped with CurriculumExhausted (no prompt left) counts as finished.")
    dry = runs[runs["pool_dry_step"].notna()] if "pool_dry_step" in runs else runs.iloc[0:0]
    if dry.empty:
        return head + " No run's pool ran dry."
    parts = [f"{r.sweep}/{r.run} (step {int(r.pool_dry_step)}, curve ends at {r.final_compute:.3g}"
             + ("; stopped CurriculumExhausted" if r.finished and r.status != "done" else "") + ")"
             for r in dry.sort_values(["sweep", "run"]).itertuples()]
    return head + f" {len(dry)} run(s): " + ", ".join(parts) + "."


def _run_time_text(rows: list[dict], scale: str = "tiny") -> str:
    import statistics

    limit = RUN_TIME_LIMIT_S.get(scale)
    if not rows:
        return "no finished runs"
    own = [r["own_s"] for r in rows]
    straight = [r["span_s"] for r in rows if not r["resumed"] and math.isfinite(r["span_s"])]
    over = [r for r in rows if limit is not None and (r["span_s"] if not r["resumed"] else r["own_s"]) > limit]
    budgets = {r["budget"] for r in rows if r["budget"] is not None}
    stopped = [r for r in rows if r["stopped_on_budget"]]
    without = [r for r in rows if r["budget"] is None]
    ran = [r for r in rows if not r.get("shared")]  # a shared entry took its source's logs: it cost no machine time
    txt = (f"Machine time: {len(ran)} run(s) trained, {sum(r['own_s'] for r in ran) / 3600:.1f} h of their own time"
           + (f" ({len(rows) - len(ran)} more entries shared an identical run's logs)" if len(ran) < len(rows) else "")
           + f". {len(stopped)} run(s) stopped on the budget before their last step"
           + (f" ({', '.join(sorted({r['run'].split('/')[0] for r in stopped}))})" if stopped else "")
           + f"; {len(rows) - len(without)} ran under a FLOP budget ({', '.join(f'{b:g}' for b in sorted(budgets)) or '-'}) "
           f"and {len(without)} ran without one (before it existed). Time a run took: its own "
           f"time (training + evaluation + start-up) median {statistics.median(own):.0f} s, max {max(own):.0f} s")
    if straight:
        txt += (f"; start to finish for the {len(straight)} runs never interrupted, median "
                f"{statistics.median(straight):.0f} s, max {max(straight):.0f} s")
    resumed = [r["run"] for r in rows if r["resumed"]]
    if resumed:
        txt += (f" ({len(resumed)} resumed after an interruption: their start to finish includes the wait, their own "
                "time is counted)")
    if limit is None:
        return txt + "."
    txt += (f". Over {limit:.0f} s: " + (", ".join(f"{r['run']} ({r['span_s'] if not r['resumed'] else r['own_s']:.0f} s)"
                                                     for r in over) if over else "none") + ".")
    return txt



def report_tables(out: Path, *, predict_boot: int = PREDICT_BOOT) -> tuple[dict, Any]:
    """(summaries by sweep, prediction table) of the collected results: the numbers of the report,
    computed as `scalerl fit OUT` / `scalerl fit OUT --fraction 0.5` compute them (compute axis
    "auto": FLOPs at tiny scale)."""
    from analysis.runs import fit_runs, load_runs, resolve_compute
    from analysis.study import summarize

    summaries = summarize(out)
    ev, runs = load_runs(out, what="eval"), load_runs(out, what="runs")
    pred = (fit_runs(ev, runs=runs, fraction=0.5, compute=resolve_compute(runs), profile=False,
                     predict_boot=predict_boot) if len(runs) else None)
    return summaries, pred


def _equivalence_sd(n: int, *, half_width: bool = False) -> float:
    """The largest sd of n paired differences (mean 0) whose 95% interval still fits inside ±δ; with
    half_width, the interval's half-width in sds, t(0.975, n−1)/√n."""
    from scipy import stats

    from analysis.compare import DEFAULT_EQUIVALENCE

    k = float(stats.t.ppf(0.975, n - 1)) / math.sqrt(n)
    return k if half_width else DEFAULT_EQUIVALENCE / k


def _paired_noise(summaries: dict) -> tuple[float, float, float] | None:
    """(median sd of per-seed differences of `tail`, median sd of `tail` across seeds, median bound on
    the sd that evaluation sampling alone gives a per-seed difference) over the pairs of configurations
    sharing >= 2 seeds: what pairing by seed buys, and how much of what is left a larger evaluation
    could remove, in numbers (the bound is NaN where no run logs its evaluation's prompts and k)."""
    import numpy as np

    paired, unpaired, sampling = [], [], []
    for s in summaries.values():
        t = s.runs.pivot_table(index="seed", columns="config", values="tail", aggfunc="first")
        has_sd = "tail_sampling_sd" in s.runs
        v = (s.runs.pivot_table(index="seed", columns="config", values="tail_sampling_sd", aggfunc="first")
             .reindex(index=t.index, columns=t.columns) ** 2 if has_sd else None)
        for c in t.columns:
            if t[c].notna().sum() >= 2:
                unpaired.append(float(t[c].std(ddof=1)))
        cols = list(t.columns)
        for i in range(len(cols)):
            for j in range(i + 1, len(cols)):
                d = (t[cols[i]] - t[cols[j]]).dropna()
                if len(d) >= 2:
                    paired.append(float(d.std(ddof=1)))  # the sd of the per-seed difference, as measured
                    if v is not None:
                        both = (v[cols[i]] + v[cols[j]]).reindex(d.index).dropna()
                        if len(both):
                            sampling.append(float(np.sqrt(both.mean())))
    if not paired or not unpaired:
        return None
    return float(np.median(paired)), float(np.median(unpaired)), float(np.median(sampling)) if sampling else math.nan


def _previous_tables(tables: Path) -> tuple[Any, Any]:
    """(claims, runs) of the report this one replaces (None where there is none): what changed is
    then written down, not lost with the overwritten files."""
    import pandas as pd

    def read(name: str):
        p = tables / name
        try:
            return pd.read_csv(p) if p.is_file() else None
        except (ValueError, OSError):
            return None

    return read("claims.csv"), read("runs.csv")


def _changes_text(old_claims: Any, old_runs: Any, claims: Any, runs: Any) -> list[str]:
    """The '## Changes from the previous report' lines: A identified before and after, and every claim
    verdict that moved (on each metric the previous report had)."""
    if old_claims is None and old_runs is None:
        return []
    out = ["## Changes from the previous report\n",
           "What this re-generation changed (the previous `report/claims.csv` and `report/runs.csv` against the new "
           "ones; a change of method, not of runs, when the runs are the same).\n"]
    if old_runs is not None and "A_identified" in old_runs and "A_identified" in runs:
        before = int(old_runs["A_identified"].fillna(False).astype(bool).sum())
        now = int(runs["A_identified"].fillna(False).astype(bool).sum())
        out.append(f"- A identified: {before} of {len(old_runs)} runs before, {now} of {len(runs)} now.")
    if old_claims is not None and "claim_id" in old_claims and len(claims):
        old = old_claims.set_index("claim_id")
        moved = []
        for c in claims.itertuples():
            if c.claim_id not in old.index:
                continue
            for m in ("A", "tail", "auc"):
                col = f"verdict_{m}"
                if col in old.columns:
                    was, now = str(old.at[c.claim_id, col]), str(getattr(c, col))
                    if was != now:
                        moved.append(f"{c.claim_id} on {m}: {was} → {now}")
                elif m == "auc":
                    continue
        new_metrics = [m for m in ("auc",) if f"verdict_{m}" not in old.columns]
        out.append(f"- Claim verdicts that moved: {len(moved)}" + (":" if moved else "."))
        out.extend(f"  - {_md_escape(x)}" for x in moved)
        if new_metrics:
            out.append(f"- New metric(s) judged for every claim: {', '.join(new_metrics)}.")
    out.append("")
    return out


def _verdict_counts_text(claims: Any) -> list[str]:
    from analysis.study import CLAIM_METRICS, VERDICTS

    counts = {m: claims[f"verdict_{m}"].value_counts() for m in CLAIM_METRICS if f"verdict_{m}" in claims}
    out = ["## Verdicts\n",
           "Each claim of the paper is judged three times: on the law's asymptote **A** (counted only where every "
           "run's A is identified), on **tail**, the measured mean held-out pass rate over the last 20% of the sweep's "
           "common compute window, and on **auc**, the measured mean over the whole window weighted by log compute "
           "(efficiency).\n",
           "| verdict | " + " | ".join(f"on {m}" for m in counts) + " |",
           "|---|" + "---|" * len(counts)]
    for v in VERDICTS:
        out.append(f"| {v} | " + " | ".join(str(int(c.get(v, 0))) for c in counts.values()) + " |")
    out.append("")
    return out


def _seeds_to_decide_text(pairs: Any, share: float = 0.7) -> list[str]:
    """The report's line on how many seeds per configuration would decide the measured pairs
    (pairs.csv `seeds_to_decide`, `analysis.compare.seeds_to_decide`): per measured metric, how many
    undecided pairs reach a verdict by 8, 16 and SEEDS_LIMIT seeds, and the seeds at which `share`
    of all its pairs would be decided."""
    import numpy as np

    from analysis.compare import MEASURED, SEEDS_LIMIT, SEEDS_POWER

    if not len(pairs) or "seeds_to_decide" not in pairs:
        return []
    out = []
    for m in MEASURED:
        p = pairs[pairs["metric"] == m]
        if "projected" in p:  # a pair with no interval (too few runs, no window) has nothing to project from
            p = p[~((p["verdict"] == "inconclusive") & p["projected"].fillna("").eq(""))]
        if not len(p):
            continue
        need = p["seeds_to_decide"].astype(float).fillna(math.inf).to_numpy()  # [P] inf: more than SEEDS_LIMIT
        open_ = p["verdict"] == "inconclusive"
        left = need[open_.to_numpy()]
        at_share = float(np.sort(need)[math.ceil(share * len(need)) - 1])  # the fewest seeds deciding >= share
        share_text = (f"{share:.0%} of the {len(need)} {m} pairs reach an {SEEDS_POWER:.0%} chance of a verdict by "
                      f"{at_share:.0f} seeds per configuration" if math.isfinite(at_share)
                      else f"{share:.0%} of the {len(need)} {m} pairs do not reach it by {SEEDS_LIMIT} seeds")
        if not len(left):
            out.append(f"- Seeds to decide, on **{m}**: every pair is decided.")
            continue
        what = (f" (pairs.csv `seeds_to_decide`: the seeds per configuration at which a pair's interval is decided "
                f"with {SEEDS_POWER:.0%} probability, were its measured mean difference and sd the truth; a projection "
                "from a few seeds' mean and sd, so an order of magnitude)") if not out else ""
        out.append(f"- Seeds to decide, on **{m}**{what}: of the {len(left)} undecided pairs, {int((left <= 8).sum())} "
                   f"would be decided by 8 seeds, {int((left <= 16).sum())} by 16, {int(np.isfinite(left).sum())} by "
                   f"{SEEDS_LIMIT}; {share_text}.")
    return out


def _can_tell_text(runs: Any, pairs: Any, summaries: dict) -> list[str]:
    from analysis.compare import DEFAULT_EQUIVALENCE, METRICS

    import pandas as pd

    n_fit = int(runs["A"].notna().sum())
    n_ident = int(runs["A_identified"].fillna(False).astype(bool).sum()) if "A_identified" in runs else 0
    widths = runs["A_profile_width"].dropna() if "A_profile_width" in runs else pd.Series(dtype=float)
    at_cap = int(runs["A_at_cap"].fillna(False).astype(bool).sum()) if "A_at_cap" in runs else 0
    pair_counts = pairs["verdict"].groupby(pairs["metric"]).value_counts() if len(pairs) else None
    noise = _paired_noise(summaries)
    out = ["## What this study can and cannot tell\n",
           f"- **A is identified in {n_ident} of {n_fit} fitted runs** (95% profile interval at most 0.1 wide and "
           "short of the 1.0 cap" + (f"; median width {widths.median():.2f}, {at_cap} intervals reach the cap"
                                     if len(widths) else "")
           + "). Where it is not, every A comparison reads `inconclusive (A not identified: run longer)`: the data "
           "cannot tell where the curve stops, so the asymptote is an extrapolation."]
    if pair_counts is not None:
        for m in METRICS:
            if m in pair_counts.index.get_level_values(0):
                c = pair_counts[m]
                out.append(f"- Every pair of configurations on **{m}**: " + ", ".join(
                    f"{v} {int(c.get(v, 0))}" for v in ("better", "worse", "equivalent", "inconclusive")) + ".")
    if noise is not None:
        unpaired = math.sqrt(2.0) * noise[1]  # the sd of a difference of two independent runs
        gain = (f"pairing removes {1.0 - noise[0] / unpaired:.0%} of it" if noise[0] < unpaired
                else "pairing removes none of it here (the seeds share little variance at this scale)")
        out.append(f"- Pairing by seed: the per-seed difference of `tail` between two configurations has a median sd "
                   f"of {noise[0]:.4f}; a difference of two unpaired runs would have √2 x {noise[1]:.4f} (`tail`'s sd "
                   f"across seeds) = {unpaired:.4f}: {gain}. A seed fixes the data split, warm start and prompt order.")
        if math.isfinite(noise[2]):
            share = min(1.0, (noise[2] / noise[0]) ** 2) if noise[0] > 0 else math.nan
            cure = ("the rest is run-to-run variation, which more seeds narrow and a larger evaluation does not"
                    if share < 0.5 else "a larger evaluation (more held-out prompts, or a larger k) would narrow it")
            out.append(f"- Of that sd, evaluation sampling gives at most {noise[2]:.4f} (the binomial bound "
                       f"p(1 − p)/(prompts·k) of each evaluation in the tail, `tail_sampling_sd` in runs.csv): at most "
                       f"{share:.0%} of the variance of a per-seed difference; {cure}.")
    out.extend(_seeds_to_decide_text(pairs))
    out.append(f"- `equivalent` needs the 95% interval of the difference inside ±{DEFAULT_EQUIVALENCE:g}: with 3 seeds "
               f"and no true difference that takes an sd of the per-seed difference below {_equivalence_sd(3):.4f} "
               f"(t(0.975, 2)/√3 = {_equivalence_sd(3, half_width=True):.2f} sd on each side), with 4 seeds below "
               f"{_equivalence_sd(4):.4f}, with 5 below {_equivalence_sd(5):.4f}. 'Not shown different' is "
               "`inconclusive`, never `agree`.")
    out.append("")
    return out


def _how_text(summaries: dict, runs: Any, out_dir: Path, collected: Any, scale: str = "tiny") -> list[str]:
    from analysis.protocol import CONTENTION_LIMIT, PROTOCOLS, RUNQ_LIMIT

    L = ["## How the numbers are made\n"]
    w = L.append
    w("- **Compute axis**: " + ", ".join(sorted({sm.compute for sm in summaries.values()})) + " (`--compute auto`: "
      "FLOPs on CPU, where identical runs differ by a median 3.7% in wall-clock compute but 0.2% in FLOPs; "
      "device-hours otherwise). Every run of a sweep is compared over the sweep's **common compute window**, cut at "
      "the smallest final compute among its runs.")
    w("- **Fit protocol** (docs/PAPER.md §1; per figure in `analysis/figure_specs.py`): "
      + "; ".join(f"`{p.name}`: {p.range_text()} ({p.paper.split(':')[0]})" for p in PROTOCOLS.values()) + ". "
      "A fit starts where the paper starts it, as the same **fraction of the fitted range** (its first ~1.5k of "
      "3.75k GPU-h: 0.4 of a whole run; 0.19 of a leave-one-out first half), never at the end of epoch 1, whose place "
      "depends on the pool's size. The grid over A and C_mid (C_mid from 1/15 of the fit's first point to 10x its "
      "last, as far as the paper's grid reaches) seeds a continuous least-squares polish of A, B and C_mid, so no "
      "estimate sits on a grid step. R0 = the run's first evaluation.")
    w("- **A identified**: each run's 95% profile-likelihood interval of A (B and C_mid refitted and polished at "
      "each A; SSE(A) <= SSE_min·(1 + F(0.95; 1, n−3)/(n−3)); A <= 1 for a pass rate) must be at most 0.1 wide "
      "and reach neither the 1.0 cap nor the search floor: an interval the cap closes is bounded by the cap, not "
      "by the data.")
    w("- **Comparisons** (`analysis/compare.py`, the one function behind `scalerl compare`, `scalerl fit`, the "
      "figures, this report and the adaptive rule): configurations that share seeds are compared on per-seed "
      "differences (paired t interval, mean Δ ± t(0.975, n−1)·sd(Δ)/√n), otherwise by Welch's interval. One rule, "
      "in this order: `equivalent` when the 95% interval lies inside ±0.02 (the two one-sided tests, statsmodels, "
      "2.5% a side), even where it excludes 0 (a real difference smaller than the margin, printed with its "
      "interval); else `better` / `worse` when it excludes 0; else `inconclusive`. Every verdict can be read off "
      "the interval printed beside it.")
    w("- **Claims**: 'A(a) > A(b)' agrees on `better`, disagrees on `worse` and is `not reproduced` on "
      "`equivalent`; 'A(a) ≈ A(b)' agrees only on `equivalent`; 'a better than b' agrees on `better` (on A, an "
      "`equivalent` A goes to B and ln C_mid at the common A, each with its own paired interval; on tail and auc, "
      "`equivalent` is `not reproduced`); 'not worse' agrees on `better` or `equivalent`; anything else is "
      "`inconclusive`. Claims about runs that do not exist (or could not be fitted) are 'not run'. Each claim is "
      "printed beside the **meters** of its mechanism (`report/runs.csv`: clipped-token fractions, importance-ratio "
      "quantiles, policy lag, completion lengths, the lag-0 log-prob gap, the zero-variance share, the pool left; "
      "`analysis/meters.py`). A claim whose mechanism has nothing to act on is 'not testable', with the measurement "
      "(the FP32 head: `not testable` when it is shown to remove less than 10% of the log-prob gap; "
      "`analysis.study.mechanism_check`).")
    w("- **Ours per configuration**: the mean over seeds with its 95% t-interval, inside [0, 1] for A, tail and auc; "
      "C_mid is the geometric mean. `rank` orders configurations by the paper's own rule (A within a margin "
      "measured from the seeds, then B); it decides no verdict.")
    w(f"- **Contention**: a run whose CPUs other work used more than {CONTENTION_LIMIT:.0%} of the time "
      "(`contention_run`, from /proc/stat) while its own threads waited for a CPU more than "
      f"{RUNQ_LIMIT:.0%} of theirs (`runq_run`, schedstat) was slowed by a neighbour: `scalerl reproduce` re-runs "
      "it (unless --allow-contention); any left are listed below, marked in the tables and drawn faded in the figures. "
      "Work that only used CPU time a run left idle is not contention (analysis/README.md \"Contention\").")
    w("- **Compute budget and run time**: every run of a CPU-scale study trains to the same compute, "
      "`train.compute_budget_flops` (the budget is the stopping rule, `train.total_steps` only a safety cap), as "
      "every forward ablation of the paper gets 3.5-4k GPU-h. Runs collected before it existed end at different "
      "compute; every comparison above holds compute equal by cutting the sweep at its common window. "
      + _run_time_text(run_times(out_dir), scale))
    w(_pool_dry_text(runs))
    thin = collected.thin if collected is not None else thinned_every(out_dir)
    if thin > 1:
        w(f"- **Collected logs**: metrics.jsonl keeps one step line in {thin} (plus the line where "
          "epoch 1 ends and the last line) to keep the folder under its size budget; eval.jsonl is whole.")
    w("")
    return L


def _ablation_text(sweep: str, s: Any, reasons: dict[str, str]) -> tuple[list[str], list]:
    from analysis.findings import FINDINGS
    from analysis.study import CLAIM_METRICS

    f = FINDINGS.get(sweep)
    L: list[str] = [f"### {f.figure + ': ' + f.title if f else sweep} (`{sweep}`)\n"]
    w = L.append
    if f:
        w(f"**Paper:** {f.paper}\n")
    rules = s.runs["min_compute_rule"].fillna("").map(lambda x: x.split(" (")[0]).value_counts()
    w(f"**Fit:** {s.protocol.range_text()} ({s.protocol.name} protocol); fit start: "
      + ", ".join(f"{k} ({n} runs)" for k, n in rules.items() if k) + f". **Margin on A:** {s.margin.describe()}.\n")
    w(f"**Compute axis:** {s.compute}; common window ends at {s.tail_end:.4g} (tail = its last 20%; auc = all of "
      "it, log-compute weighted).\n")
    w("| config (ran) | paper's name | seeds fitted | A identified | A [95% CI] | B [95% CI] | C_mid | "
      "tail [95% CI] | auc [95% CI] | rank | contended |")
    w("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in s.configs.sort_values(["rank", "config"], na_position="last").itertuples():
        w(f"| {r.config} | {r.paper_config if r.paper_config != r.config else '—'} | {r.n_fitted}/{r.n_runs} | "
          f"{r.n_identified}/{r.n_fitted} | {_ci(r.A, r.A_lo, r.A_hi, '.3f')} | "
          f"{_ci(r.B, r.B_lo, r.B_hi, '.2f')} | {_fmt(r.C_mid, '.3g')} | {_ci(r.tail, r.tail_lo, r.tail_hi, '.3f')} | "
          f"{_ci(r.auc, r.auc_lo, r.auc_hi, '.3f')} | {_fmt(r.rank, '.0f')} | {r.contended_runs or '—'} |")
    errs = s.runs[s.runs["fit_error"].fillna("") != ""]
    unfinished = s.runs[s.runs["status"].fillna("unknown") != "done"]
    if len(errs) or len(unfinished):
        w("")
        for r in unfinished.itertuples():
            if r.finished:
                w(f"- {r.run} stopped when its prompt pool ran out (CurriculumExhausted); its curve ends where "
                  f"the pool ran dry, at step {_fmt(r.pool_dry_step, '.0f')}")
            else:
                w(f"- status {r.status}: {r.run} (its logged part is fitted like the others)")
        for r in errs.itertuples():
            w(f"- not fitted: {r.run}: {_md_escape(r.fit_error)[:200]}")
    w("")
    mechanism = _mechanism_line(s.claims)
    if mechanism:
        w(mechanism + "\n")
    meters = next((str(m) for m in s.claims.get("meters", []) if isinstance(m, str) and m), "") if len(s.claims) else ""
    if meters and len(s.claims) and s.claims["meters"].nunique() == 1:
        w(f"**Meters** (mean over seeds): {_md_escape(meters)}\n")
    rows = []
    if len(s.claims):
        w("| claim | paper | " + " | ".join(f"ours on {m} | verdict on {m}" for m in CLAIM_METRICS)
          + " | reason (reasons.yaml) |")
        w("|---|---|" + "---|---|" * len(CLAIM_METRICS) + "---|")
        for c in s.claims.itertuples():
            reason = reasons.get(c.claim_id, "")
            verdicts = [getattr(c, f"verdict_{m}") for m in CLAIM_METRICS]
            if "disagree" in verdicts and not reason:
                reason = f"_to fill: `{c.claim_id}`_"
            cells = " | ".join(f"{_md_escape(getattr(c, f'ours_{m}'))} | **{getattr(c, f'verdict_{m}')}**"
                               f"{_md_escape(_why(getattr(c, f'why_{m}')))}" for m in CLAIM_METRICS)
            w(f"| {_md_escape(c.claim)} | {_md_escape(c.paper or '—')} | {cells} | {_md_escape(reason) or '—'} |")
            rows.append((sweep, f.figure if f else "", c))
        if s.claims["meters"].nunique() > 1:
            w("")
            for c in s.claims.itertuples():
                if isinstance(c.meters, str) and c.meters:
                    w(f"- Meters, {_md_escape(c.claim)}: {_md_escape(c.meters)}")
        w("")
    return L, rows


def _all_verdicts_text(verdict_rows: list, reasons: dict[str, str]) -> list[str]:
    from analysis.study import CLAIM_METRICS

    L = ["## All verdicts\n", "| ablation | figure | claim | " + " | ".join(f"on {m}" for m in CLAIM_METRICS)
         + " | meters | reason |", "|---|---|---|" + "---|" * len(CLAIM_METRICS) + "---|---|"]
    for sweep, fig, c in verdict_rows:
        reason = reasons.get(c.claim_id, "")
        verdicts = [str(getattr(c, f"verdict_{m}")) for m in CLAIM_METRICS]
        dis = "disagree" in verdicts
        L.append(f"| {sweep} | {fig} | {_md_escape(c.claim)} | " + " | ".join(verdicts)
                 + f" | {_md_escape(c.meters) if isinstance(c.meters, str) and c.meters else '—'} | "
                 f"{_md_escape(reason) or ('_to fill_' if dis else '—')} |")
    L.append("")
    return L


def _prediction_text(pred: Any, summaries: dict, out: Path) -> list[str]:
    import pandas as pd

    from analysis.prediction import FRACTIONS, markdown, measure, summarize
    from analysis.scaling_law import MODEL_SPREAD, PIN_WIDTH, PREDICT_BOOT

    L = ["## Predicting the end from a prefix\n"]
    w = L.append
    # intervals as the report asked for them (`--predict-boot 0`: none), each from PREDICT_BOOT replicates
    boot = PREDICT_BOOT if pred is not None and "predicted_low" in pred and pred["predicted_low"].notna().any() else 0
    try:
        rows = measure(out, n_boot=boot)
    except (FileNotFoundError, ValueError):
        rows = pd.DataFrame()
    if rows.empty or not rows["fitted"].any():
        w("No run could be fitted on a prefix.")
        w("")
        return L
    table = summarize(rows)
    axis = next(iter(summaries.values())).compute if summaries else "the study's compute"
    w(f"Every finished run cut at {', '.join(f'{f:.0%}' for f in FRACTIONS)} of its final compute ({axis} axis), "
      "fitted as `scalerl fit` fits it (its sweep's protocol; the fit starts at the paper's cutoff as a fraction of "
      f"the prefix), and its final pass rate predicted by the sigmoid (`scalerl fit {out}/<sweep> --fraction F`), by a "
      "straight line in log C fitted on the same points, and by the last value the fit used. Errors are predicted − "
      "observed. The sigmoid's 95% prediction interval (`analysis.scaling_law.prediction_interval`, "
      f"{PREDICT_BOOT} replicates) is a parametric bootstrap: the fitted curve plus AR(1) evaluation noise (successive "
      "evaluations correlated; the noise's sd drawn from its scaled inverse-chi² distribution), every replicate "
      "refitted, plus the end's own evaluation noise, plus the law's spread over the extrapolated range: a normal "
      f"term of sd {MODEL_SPREAD:.3f}·|g| (a uniform spread over g, the gap between the line's and the law's "
      "predictions). Target: coverage 90-97% at every prefix. An interval wider than "
      f"{PIN_WIDTH:g} says the prefix cannot pin the end (`scalerl fit --fraction` names those runs).\n")
    L.extend(markdown(table))
    w("")
    for r in table.itertuples():
        if not pd.notna(r.coverage):
            continue
        if r.coverage < 0.90 or r.coverage > 0.97:
            side = "below" if r.coverage < 0.90 else "above"
            w(f"- From {r.fraction:.0%}: coverage {r.coverage:.1%} is {side} the 90-97% target by "
              f"{abs(r.coverage - (0.90 if r.coverage < 0.90 else 0.97)):.1%} ({r.n_intervals} intervals, median width "
              f"{r.median_width:.3f}).")
    unfit = table[table["fitted"] < table["runs"]]
    for r in unfit.itertuples():
        w(f"- From {r.fraction:.0%}: {r.runs - r.fitted} of {r.runs} runs cannot be fitted (too few evaluations after "
          "the fit's start): the prefix cannot pin their end.")
    w("")
    half = rows[(rows["fraction"] == 0.5) & rows["fitted"]]
    if len(half):
        beats = float((half["error"].abs() < half["baseline_error"].abs()).mean())
        w(f"From the first half ({len(half)} of {int((rows['fraction'] == 0.5).sum())} runs predicted):\n")
        w("| predictor | median abs. error | mean error (bias) | worst abs. error | beats the other |")
        w("|---|---|---|---|---|")
        w(f"| sigmoid (the law) | {half['error'].abs().median():.3f} | {half['error'].mean():+.3f} | "
          f"{half['error'].abs().max():.3f} | {beats:.0%} of runs |")
        w(f"| log-linear baseline | {half['baseline_error'].abs().median():.3f} | {half['baseline_error'].mean():+.3f} | "
          f"{half['baseline_error'].abs().max():.3f} | {1 - beats:.0%} of runs |")
        w(f"| last value | {half['last_error'].abs().median():.3f} | {half['last_error'].mean():+.3f} | "
          f"{half['last_error'].abs().max():.3f} | |")
        w("")
        w("Per run, from the first 50%:\n")
        w("| sweep | run | fitted to | predicted end [95% PI] | log-linear | last value | observed end | error | covered |")
        w("|---|---|---|---|---|---|---|---|---|")
        for r in half.sort_values(["sweep", "run"]).itertuples():
            pi = f" [{r.predicted_low:.3f}, {r.predicted_high:.3f}]" if pd.notna(r.predicted_low) else ""
            cv = ("yes" if r.covered else "no") if pd.notna(r.covered) else "—"
            wide = "" if not pd.notna(r.width) or r.width <= PIN_WIDTH else " (cannot pin)"
            w(f"| {r.sweep} | {r.run} | {_fmt(r.fit_to, '.4g')} | {r.predicted_final:.3f}{pi}{wide} | "
              f"{r.baseline_final:.3f} | {_fmt(r.last_value, '.3f')} | {r.observed_final:.3f} | {r.error:+.3f} | {cv} |")
    nofit = rows[(rows["fraction"] == 0.5) & ~rows["fitted"]]
    if len(nofit):
        w("")
        w(f"Not predicted from 50% ({len(nofit)}): " + "; ".join(
            f"{r.sweep}/{r.run}: {_md_escape(r.fit_error)[:120]}" for r in nofit.itertuples()))
    w("")
    return L


def _contention_text(runs: Any, kept_contended: Sequence[str]) -> list[str]:
    from analysis.protocol import CONTENTION_LIMIT

    L = ["## Contention\n"]
    cont = runs[runs["contended"].fillna(False).astype(bool)]
    if len(cont):
        L.append(f"{len(cont)} run(s) slowed by other work (contention above {CONTENTION_LIMIT:.0%} while their "
                 "threads waited for a CPU) remain (kept in the fits and marked):\n")
        L.extend(f"- {r.sweep}/{r.run}: {r.contention_run:.1%}" for r in cont.itertuples())
    else:
        measured = runs["contention_run"].notna().sum()
        L.append(f"No run slowed by other work ({measured} of {len(runs)} runs log `contention_run`"
                 + (f"; highest {runs['contention_run'].max():.1%}" if measured else "") + ").")
        if measured and "runq_run" in runs.columns and (runs["contention_run"] > CONTENTION_LIMIT).any():
            busy = runs[runs["contention_run"] > CONTENTION_LIMIT]
            q = busy["runq_run"].max()
            L.append(f"{len(busy)} run(s) shared their CPUs above {CONTENTION_LIMIT:.0%} but waited for them at most "
                     f"{q:.1%} of their time (`runq_run`): not contended." if q == q else "")
    L.extend(f"- kept after the maximum number of re-runs: {k}" for k in kept_contended)
    L.append("")
    return L


def _figures_text(figures: tuple[dict, dict, dict] | None, scale: str) -> list[str]:
    from analysis.findings import NOT_AT_TINY_SCALE

    L = ["## Figures\n"]
    w = L.append
    written, missing, failed = figures if figures is not None else ({}, {}, {})
    if written:
        for fig_id in written:
            w(f"![{fig_id}]({FIGURES_DIR}/{fig_id}.png) ([PDF]({FIGURES_DIR}/{fig_id}.pdf))")
        w("")
    not_here = {k: v for k, v in NOT_AT_TINY_SCALE.items() if k.split(" ")[0] not in written}
    if scale in ("tiny", "small") and not_here:
        w(f"### Not drawable at {scale} scale\n")
        w("| figure | why |\n|---|---|")
        for k, v in not_here.items():
            w(f"| {k} | {_md_escape(v)} |")
        w("")
    other_missing = {k: v for k, v in missing.items() if k not in NOT_AT_TINY_SCALE}
    if other_missing or failed:
        w("### Not drawn from these runs\n")
        w("| figure | why |\n|---|---|")
        for k, v in other_missing.items():
            w(f"| {k} | {_md_escape(v)} |")
        for k, v in failed.items():
            w(f"| {k} | failed: {_md_escape(v)} |")
        w("")
    return L


def _progress_text(summaries: dict, n_runs: int, selected: Sequence[str] | None, collected: Any,
                   scale: str) -> list[str]:
    shipped = [p.stem for p in select_specs(None)]  # the paper's ablations; a study may also name others (mismatch)
    chosen = [n for n in shipped if selected is None or n in selected] + [n for n in (selected or ()) if n not in shipped]
    others = [n for n in shipped if n not in chosen and n not in summaries]
    absent = [n for n in chosen if n not in summaries]
    unfinished_runs = list(collected.missing) if collected is not None else []
    not_chosen = (f" The other {len(others)} shipped sweeps are not part of this study (`--sweeps`): "
                  + ", ".join(f"`{n}`" for n in others) + ".") if others else ""
    L: list[str] = []
    if not absent and not unfinished_runs and selected is not None:
        L += ["## Study progress\n", f"**Complete**: every run of the {len(chosen)} sweeps this study chose is here "
              f"({n_runs} runs)." + not_chosen + "\n"]
    if absent or unfinished_runs:
        L += ["## Study progress\n",
              f"**Part-way**: {len(chosen) - len(absent)} of the {len(chosen)} "
              + ("chosen" if selected is not None else "shipped") + " sweeps have runs here."
              + (f" Not run yet: {', '.join(f'`{n}`' for n in absent)}." if absent else "") + not_chosen
              + (f" Runs of the selected sweeps not finished yet ({len(unfinished_runs)}): "
                 + ", ".join(unfinished_runs[:30]) + (" ..." if len(unfinished_runs) > 30 else "") + "."
                 if unfinished_runs else "")
              + f" `scalerl reproduce --scale {scale} --executor slurm` goes on from here (done runs are skipped).\n"]
    return L


def _names_text(runs: Any, scale: str) -> list[str]:
    renamed = runs[runs["paper_config"].fillna(runs["config"]) != runs["config"]] if "paper_config" in runs else runs.iloc[0:0]
    if not len(renamed):
        return []
    L = ["## Names: what ran, and what the paper called it\n",
         f"At {scale} scale a run's name says the value that ran; the paper's name is in run.json's `paper_name` and "
         "in the claims below.\n", "| sweep | ran (run name) | the paper's |\n|---|---|---|"]
    L.extend(f"| {sw} | {cfg} | {pc} |" for (sw, cfg, pc) in sorted({(r.sweep, r.config, r.paper_config)
                                                                      for r in renamed.itertuples()}))
    L.append("")
    return L


def write_report(out: str | Path, *, figures: tuple[dict, dict, dict] | None = None,
                 collected: CollectResult | None = None, scale: str = "tiny", command: str = "",
                 kept_contended: Sequence[str] = (), predict_boot: int = PREDICT_BOOT,
                 selected: Sequence[str] | None = None) -> Path:
    """Write OUT/REPORT.md (and OUT/report/*.csv) from the runs under OUT. selected: the sweeps the
    study chose (`--sweeps`; None: every shipped one), which its progress is measured against."""
    import pandas as pd

    from analysis.compare import pairs_frame
    from analysis.findings import FINDINGS

    out = Path(out)
    summaries, pred = report_tables(out, predict_boot=predict_boot)
    if not summaries:
        raise ReproduceError(f"no runs under {out}: nothing to report")
    tables = out / TABLES_DIR
    tables.mkdir(parents=True, exist_ok=True)
    old_claims, old_runs = _previous_tables(tables)
    configs = pd.concat([s.configs for s in summaries.values()], ignore_index=True)
    claims = pd.concat([s.claims for s in summaries.values() if len(s.claims)], ignore_index=True) \
        if any(len(s.claims) for s in summaries.values()) else pd.DataFrame(columns=["claim_id", "verdict"])
    runs = pd.concat([s.runs.drop(columns=["fit"]) for s in summaries.values()], ignore_index=True)
    reasons_path = out / REASONS_FILE
    reasons = _load_reasons(reasons_path)
    verdict_cols = [c for c in claims.columns if c.startswith("verdict_")]
    disagreeing = claims.loc[(claims[verdict_cols] == "disagree").any(axis=1), "claim_id"].tolist() if verdict_cols else []
    _append_reason_ids(reasons_path, disagreeing, reasons)
    claims = claims.assign(reason=[reasons.get(i, "") for i in claims["claim_id"]])
    configs.to_csv(tables / "configs.csv", index=False)
    claims.to_csv(tables / "claims.csv", index=False)
    runs.to_csv(tables / "runs.csv", index=False)
    pairs = pairs_frame(p for sm in summaries.values() for p in sm.pairs)
    pairs.to_csv(tables / "pairs.csv", index=False)
    if pred is not None:
        pred.drop(columns=[c for c in ("fit",) if c in pred]).to_csv(tables / "predictions.csv", index=False)

    n_runs = len(runs)
    seeds = runs.groupby(["sweep", "config"])["seed"].nunique()
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    L: list[str] = [
        f"# ScaleRL ablations at {scale} scale: the study, its figures and our verdicts\n",
        f"Generated {stamp} by `{command or f'scalerl reproduce --scale {scale}'}` from `{out}`: "
        f"{n_runs} runs in {len(summaries)} sweeps, {int(seeds.median()) if len(seeds) else 0} seeds per configuration "
        f"(min {int(seeds.min()) if len(seeds) else 0}). Re-generate this file with `scalerl reproduce --scale {scale} "
        f"--report-only`; the numbers of a sweep are printed by `scalerl fit {out}/<sweep>` (same code: "
        "`analysis.study.summarize`; every pair: `scalerl compare " + str(out) + "`). Tables: `report/configs.csv`, "
        "`report/claims.csv`, `report/runs.csv` (with `A_identified` and the mechanism meters), `report/pairs.csv`, "
        "`report/predictions.csv`.\n"]
    L += _progress_text(summaries, n_runs, selected, collected, scale)
    L += _changes_text(old_claims, old_runs, claims, runs)
    L += _verdict_counts_text(claims)
    L += _can_tell_text(runs, pairs, summaries)
    L += _names_text(runs, scale)
    L += _how_text(summaries, runs, out, collected, scale)
    L.append("## Ablations\n")
    verdict_rows = []
    for sweep in [s for s in FINDINGS if s in summaries] + sorted(s for s in summaries if s not in FINDINGS):
        text, rows = _ablation_text(sweep, summaries[sweep], reasons)
        L += text
        verdict_rows += rows
    L += _all_verdicts_text(verdict_rows, reasons)
    L += _prediction_text(pred, summaries, out)
    L += _contention_text(runs, kept_contended)
    L += _figures_text(figures, scale)
    path = out / REPORT_FILE
    path.write_text("\n".join(L) + "\n", encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- CLI


