"""`scalerl fit RUNS` and `scalerl compare RUNS` (dispatched by experiments/cli.py), and the
arguments they share with `scalerl figures RUNS --out DIR` (paper_figures/cli.py). All three go
through `analysis.study.summarize`, so a verdict printed by one is the verdict of the others and
of the reproduction report."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
import pandas as pd


def _parsed_by(target: str):
    """An argparse `type` that parses with `module:function` (imported when an argument is parsed,
    so building the parser stays light) and turns its ValueError into argparse's usage error."""
    def parse(text: str):
        import importlib

        module, _, name = target.partition(":")
        try:
            return getattr(importlib.import_module(module), name)(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


_min_compute_arg = _parsed_by("analysis.protocol:parse_min_compute")
_margin_arg = _parsed_by("analysis.study:parse_margin")
_equivalence_arg = _parsed_by("analysis.compare:parse_equivalence")
_rungs_arg = _parsed_by("analysis.adaptive:parse_rungs")


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    from analysis.protocol import PROTOCOLS
    from analysis.runs import COMPUTE_AXES

    parser.add_argument("runs", help="a run directory, a sweep directory or a directory of sweeps")
    parser.add_argument("--compute", choices=list(COMPUTE_AXES), default="auto",
                        help="compute axis: auto (default) = flops at tiny scale (every run on CPU: identical runs "
                             "differ 0.2%% in FLOPs, 3.7%% in wall-clock), compute_hours otherwise (devices reserved × "
                             "training wall-clock hours, the paper's GPU-hours); cpu_hours = the run's CPU time, a "
                             "second view (BENCHMARKS.md)")
    parser.add_argument("--min-compute", type=_min_compute_arg, default="paper", metavar="paper|epoch|none|C",
                        help="where each fit starts: 'paper' (default) = where the paper starts it: a "
                             "fit from the paper's 1.5k GPU-h as the same fraction of the fitted range (0.4 of "
                             "a whole run, 0.19 of a leave-one-out first half; analysis/protocol.py); 'epoch' = "
                             "the end of epoch 1 (where it ends depends on the pool's size); 'none'; or a compute "
                             "value")
    parser.add_argument("--protocol", choices=["auto", *PROTOCOLS], default="auto",
                        help="fit protocol: auto (default) = the paper's for each sweep (whole run for forward "
                             "ablations, the first half for leave-one-out, seeds, recipes and scaling axes)")
    parser.add_argument("--margin", type=_margin_arg, default="auto", metavar="auto|FLOAT",
                        help="margin on A of the paper's rule, used only for the `rank` column: auto (default) = "
                             "measured from the seeds (t(0.975, df)·s_A·sqrt(1/n_a+1/n_b)), the paper's 0.02 where "
                             "no seeds exist; or a number. Verdicts come from intervals (--equivalence)")
    parser.add_argument("--equivalence", type=_equivalence_arg, default=0.02, metavar="DELTA",
                        help="δ of the equivalence test: two configurations are `equivalent` when the two one-sided "
                             "tests (2.5%% a side) put their difference inside ±δ, i.e. its 95%% interval lies "
                             "inside ±δ (default 0.02, the paper's margin)")


def add_fit_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    parser.add_argument("--csv", default=None,
                        help="per-run table, a file or a directory (DIR/fits.csv) (default: RUNS/fits.csv, next to "
                             "the runs); beside it <stem>_configs.csv "
                             "(per configuration: A, B and tail with intervals over seeds), <stem>_claims.csv (the "
                             "paper's findings judged on each metric) and <stem>_pairs.csv (every pair compared)")
    parser.add_argument("--fraction", type=float, default=None,
                        help="fit only the first FRACTION of each run's compute and predict its end "
                             "(overrides the protocol's range): the sigmoid's prediction with its calibrated 95%% "
                             "interval (evaluation noise, correlated; the fit's uncertainty; the law's spread against "
                             "a straight line in log C: analysis.scaling_law.prediction_interval) beside a log-linear "
                             "baseline on the same points; a run whose interval is wider than 0.1 is named: its "
                             "prefix cannot pin the end")
    parser.add_argument("--predict-boot", type=int, default=None, metavar="N",
                        help="with --fraction: parametric-bootstrap replicates behind each prediction interval "
                             "(default analysis.scaling_law.PREDICT_BOOT, 200; 0: none)")
    parser.add_argument("--min-points", type=int, default=6, help="runs with fewer evaluations are not fitted")
    parser.add_argument("--bootstrap", type=int, default=0, metavar="N",
                        help="add N-resample bootstrap 95%% intervals for A, B, C_mid (seeded)")
    parser.add_argument("--seed", type=int, default=0, help="bootstrap seed")


def fit_kwargs(args: argparse.Namespace) -> dict:
    """The keyword arguments of `analysis.study.summarize` that `scalerl fit` passes (the report uses
    the same defaults)."""
    return dict(compute=args.compute, protocol=None if args.protocol == "auto" else args.protocol,
                min_compute=args.min_compute, margin=args.margin, equivalence=getattr(args, "equivalence", 0.02),
                min_points=getattr(args, "min_points", 6), fraction=getattr(args, "fraction", None),
                bootstrap=getattr(args, "bootstrap", 0), seed=getattr(args, "seed", 0),
                predict_boot=getattr(args, "predict_boot", 0))


def fit_tables(summaries: dict) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(per run, per config, per claim) over every summarised sweep; the per-run table carries each
    run's config rank (the paper's rule)."""
    runs, configs, claims = [], [], []
    for s in summaries.values():
        cfg = s.configs
        runs.append(s.runs.merge(cfg[["config", "tied_with_best_A", "B_at_common_A", "rank"]], on="config", how="left"))
        configs.append(cfg)
        claims.append(s.claims)
    cat = lambda xs: pd.concat([x for x in xs if len(x)], ignore_index=True) if any(len(x) for x in xs) else pd.DataFrame()  # noqa: E731
    return cat(runs), cat(configs), cat(claims)


def fit_main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from analysis.compare import pairs_frame
    from analysis.study import summarize

    console = Console(width=max(Console().width, 120))
    if args.fraction is not None and not 0.0 < args.fraction < 1.0:
        console.print(f"[red]--fraction must be in (0, 1), got {args.fraction}")
        return 2
    if args.predict_boot is None:
        from analysis.scaling_law import PREDICT_BOOT

        args.predict_boot = PREDICT_BOOT
    if args.predict_boot < 0:
        console.print(f"[red]--predict-boot must be >= 0, got {args.predict_boot}")
        return 2
    try:
        summaries = summarize(args.runs, **fit_kwargs(args))
    except FileNotFoundError as e:
        console.print(f"[red]{e}")
        return 2
    if not summaries:
        console.print(f"[red]no runs under {args.runs}")
        return 1
    runs, configs, claims = fit_tables(summaries)
    out = runs.drop(columns=["fit"])
    root = Path(args.runs)
    csv = Path(args.csv) if args.csv else (root if root.is_dir() else root.parent) / "fits.csv"
    if args.csv and (csv.is_dir() or args.csv.endswith(("/", os.sep))):  # --csv DIR: DIR/fits.csv
        csv = csv / "fits.csv"
    csv.parent.mkdir(parents=True, exist_ok=True)
    out.to_csv(csv, index=False)
    configs.to_csv(csv.with_name(f"{csv.stem}_configs.csv"), index=False)
    claims.to_csv(csv.with_name(f"{csv.stem}_claims.csv"), index=False)
    pairs_frame(p for s in summaries.values() for p in s.pairs).to_csv(csv.with_name(f"{csv.stem}_pairs.csv"),
                                                                        index=False)
    _print_tables(console, out, summaries, args)
    contended = out[out["contended"].fillna(False).astype(bool)]
    if len(contended):
        from analysis.protocol import CONTENTION_LIMIT

        names = ", ".join(f"{r.sweep}/{r.run} ({r.contention_run:.0%})" for r in contended.itertuples())
        console.print(f"[yellow]warning: {len(contended)} run(s) slowed by other work (CPU contention above "
                      f"{CONTENTION_LIMIT:.0%} and their threads waited for a CPU; their compute axis is stretched; re-run them alone): {names}", highlight=False)
    console.print(f"wrote {csv}, {csv.with_name(csv.stem + '_configs.csv')}, {csv.with_name(csv.stem + '_claims.csv')}, "
                  f"{csv.with_name(csv.stem + '_pairs.csv')}")
    return 0


def _fmt(v, spec: str = ".4g") -> str:
    if v is None or (isinstance(v, float) and np.isnan(v)):
        return ""
    if isinstance(v, (float, np.floating)):
        return format(v, spec)
    return str(v)


def _label(row: pd.Series, with_seed: bool) -> str:
    """A run's short name: its factor value (and seed), else its run name."""
    v = row.get("value")
    if v is None or (isinstance(v, float) and np.isnan(v)):
        return str(row.get("run"))
    seed = row.get("seed")
    return f"{v} (seed {seed})" if with_seed and seed is not None and not pd.isna(seed) else str(v)


def _print_tables(console, out: pd.DataFrame, summaries: dict, args: argparse.Namespace) -> None:
    """Per sweep: the protocol and margin, one row per run, one per configuration when seeds were
    grouped, and the paper's findings judged; flags and fit errors as notes."""
    from rich.table import Table

    cols = [("label", "run", ""), ("status", "status", ""), ("n_evals", "evals", ""), ("A", "A", ".3f"),
            ("B", "B", ".2f"), ("C_mid", "C_mid", ".3g"), ("rank", "rank", ".0f"),
            ("B_at_common_A", "B@common A", ".2f"), ("predicted_final", "pred. final", ".3f"),
            ("predicted_low", "pred. lo", ".3f"), ("predicted_high", "pred. hi", ".3f"),
            ("observed_final", "obs. final", ".3f"), ("baseline_final", "log-lin. final", ".3f"),
            ("A_profile", "A 95% profile", ""), ("tail", "tail", ".3f"), ("A_lo", "A lo (boot)", ".3f"),
            ("A_hi", "A hi (boot)", ".3f"), ("contention", "contention", "")]
    n_seeds = out.groupby(["sweep", "config"], dropna=False)["seed"].transform("nunique") if "seed" in out else 0
    out = out.assign(A_profile=[_profile_text(r) for _, r in out.iterrows()])
    out = out.assign(label=[_label(r, n > 1) for (_, r), n in zip(out.iterrows(), np.broadcast_to(n_seeds, len(out)))],
                     contention=[("" if pd.isna(c) else f"{c:.0%}" + (" !" if k else ""))
                                 for c, k in zip(out["contention_run"], out["contended"].fillna(False))])
    cols = [c for c in cols if c[0] in out]
    for sweep, g in out.groupby("sweep", sort=True):
        s = summaries[sweep]
        rules = g["min_compute_rule"].fillna("").map(lambda x: x.split(" (")[0]).value_counts()
        console.print(f"[bold]{sweep}[/]: compute axis {s.compute}; fit protocol {s.protocol.name} "
                      f"({s.protocol.range_text(g['fit_fraction'].iloc[0])}); min_compute: "
                      + ", ".join(f"{r or '-'} ({n})" for r, n in rules.items())
                      + f"; margin on A {s.margin.describe()}", highlight=False, soft_wrap=True)
        t = Table(title=f"{sweep}: sigmoid fits on {args.compute}; rank = paper's rule (A ±{s.margin.value:.3g}, then B)")
        for _, head, _ in cols:
            t.add_column(head, overflow="fold", no_wrap=head != "run")
        sort = g.sort_values(["rank", "label"]) if "rank" in g else g
        notes = []
        for _, row in sort.iterrows():
            t.add_row(*[_fmt(row[c], f) for c, _, f in cols])
            for key in ("fit_error", "flags"):
                if isinstance(row.get(key), str) and row[key]:
                    notes.append(f"  {row['label']}: {row[key]}")
        console.print(t)
        for n in notes:
            console.print(n, style="yellow", highlight=False)
        if getattr(args, "fraction", None) is not None:
            for line in _prediction_notes(g, args.fraction):
                console.print(line, highlight=False, soft_wrap=True)
        cfg = s.configs
        if (cfg["n_runs"] > 1).any():
            tc = Table(title=f"{sweep}: per configuration (mean over seeds, 95% t-interval; tail over the last 20% "
                             f"of the common window, to {s.tail_end:.4g})")
            for head in ("config", "seeds fitted", "A identified", "A [95% CI]", "B [95% CI]", "C_mid",
                         "tail [95% CI]", "auc [95% CI]", "rank (paper's rule)"):
                tc.add_column(head)
            for r in cfg.sort_values("rank").itertuples():
                tc.add_row(config_label(r.config, r.paper_config), f"{r.n_fitted}/{r.n_runs}",
                           f"{r.n_identified}/{r.n_fitted}", _interval(r.A, r.A_lo, r.A_hi, ".3f"),
                           _interval(r.B, r.B_lo, r.B_hi, ".2f"), _fmt(r.C_mid, ".3g"),
                           _interval(r.tail, r.tail_lo, r.tail_hi, ".3f"), _interval(r.auc, r.auc_lo, r.auc_hi, ".3f"),
                           _fmt(r.rank, ".0f"))
            console.print(tc)
        if s.pairs:
            tp = Table(title=f"{sweep}: every pair (a − b, 95% interval; equivalent = the interval inside "
                             f"±{s.equivalence:g}, by TOST)")
            for head in ("a", "b", "metric", "Δ [95% CI]", "how", "verdict"):
                tp.add_column(head, overflow="fold")
            for p in s.pairs:
                tp.add_row(p.a, p.b, p.metric, _interval(p.diff.delta, p.diff.low, p.diff.high, "+.3f"),
                           p.diff.method, p.verdict + (f" ({p.reason})" if p.reason else ""))
            console.print(tp)
        if len(s.claims):
            tv = Table(title=f"{sweep}: the paper's finding, judged on A, tail and auc")
            for head in ("claim", "A: ours", "A: verdict", "tail: ours", "tail: verdict", "auc: ours", "auc: verdict"):
                tv.add_column(head, overflow="fold")
            for r in s.claims.itertuples():
                tv.add_row(r.claim, str(r.ours_A), _verdict_text(r.verdict_A, r.why_A), str(r.ours_tail),
                           _verdict_text(r.verdict_tail, r.why_tail), str(r.ours_auc),
                           _verdict_text(r.verdict_auc, r.why_auc))
            console.print(tv)
            for r in s.claims.itertuples():
                if isinstance(r.meters, str) and r.meters:
                    console.print(f"  meters, {r.claim}: {r.meters}", highlight=False, soft_wrap=True)


def _prediction_notes(g: pd.DataFrame, fraction: float) -> list[str]:
    """With --fraction: how many runs' prefixes pin their end (95% prediction interval at most
    PIN_WIDTH wide), which cannot and why, and how often the interval covered the observed end."""
    from analysis.scaling_law import PIN_WIDTH

    if "predicted_final" not in g:
        return [f"  prediction from the first {fraction:.0%}: no run could be fitted on it"]
    fitted = g[g["predicted_final"].notna()]
    out = []
    if "predicted_low" in g and fitted["predicted_low"].notna().any():
        width = fitted["predicted_high"] - fitted["predicted_low"]
        wide = fitted[width > PIN_WIDTH]
        cov = fitted["covered"].dropna().astype(bool) if "covered" in fitted else pd.Series(dtype=bool)
        out.append(f"  prediction from the first {fraction:.0%}: {len(fitted) - len(wide)} of {len(g)} runs pin their end "
                   f"(95% interval <= {PIN_WIDTH:g} wide); {len(wide)} cannot; {len(g) - len(fitted)} not fitted"
                   + (f"; the interval covers the observed end in {cov.mean():.0%} of {len(cov)}" if len(cov) else ""))
        for _, r in wide.iterrows():
            out.append(f"    {r['label']}: the first {fraction:.0%} cannot pin the end: 95% interval "
                       f"[{r['predicted_low']:.3f}, {r['predicted_high']:.3f}] is {r['predicted_high'] - r['predicted_low']:.3f} "
                       f"wide (> {PIN_WIDTH:g})")
    for _, r in g[g["predicted_final"].isna()].iterrows():
        out.append(f"    {r['label']}: the first {fraction:.0%} cannot pin the end: not fitted ({r.get('fit_error') or 'no fit'})")
    return out


def _verdict_text(verdict, why) -> str:
    return f"{verdict}" + (f" ({why})" if isinstance(why, str) and why else "")


def _profile_text(row: pd.Series) -> str:
    lo, hi = row.get("A_profile_lo"), row.get("A_profile_hi")
    if lo is None or pd.isna(lo):
        return ""
    return f"[{lo:.3f}, {hi:.3f}]" + ("" if bool(row.get("A_identified")) else " not identified")


def config_label(config: str, paper_config) -> str:
    """'k1 (paper: k4)' where the run's name says what ran and the paper named it otherwise."""
    if isinstance(paper_config, str) and paper_config and paper_config != config:
        return f"{config} (paper: {paper_config})"
    return str(config)


def _interval(m, lo, hi, spec: str) -> str:
    if m is None or pd.isna(m):
        return ""
    if pd.isna(lo) or lo == hi:
        return format(m, spec)
    return f"{format(m, spec)} [{format(lo, spec)}, {format(hi, spec)}]"


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    parser.add_argument("--metric", choices=["A", "tail", "auc", "all", "both"], default="all",
                        help="A = the law's asymptote (counts only where every run's 95%% profile interval is at most "
                             "0.1 wide and short of the cap); tail = the mean held-out pass rate over the last 20%% of "
                             "the sweep's common compute window; auc = the mean held-out pass rate over the whole "
                             "window, weighted by log compute (measured efficiency); all (default): the three; "
                             "both: A and tail")
    parser.add_argument("--min-points", type=int, default=6, help="runs with fewer evaluations are not fitted")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON list, one object per pair and metric: sweep, a, b, metric, delta (a − b), "
                             "low, high, n, paired, identified, verdict (better | worse | equivalent | inconclusive, "
                             "relative to a); fit's <stem>_pairs.csv adds n_a, n_b, equivalence, reason, seeds_to_decide and projected")


def compare_main(args: argparse.Namespace) -> int:
    """Every pair of configurations of every sweep under RUNS, on A, tail and/or auc."""
    import json

    from rich.console import Console
    from rich.table import Table

    from analysis.study import summarize

    console = Console(width=max(Console().width, 120), stderr=args.json)
    try:
        summaries = summarize(args.runs, **fit_kwargs(args))
    except FileNotFoundError as e:
        console.print(f"[red]{e}")
        return 2
    if not summaries:
        console.print(f"[red]no runs under {args.runs}")
        return 1
    metrics = metrics_of(args.metric)
    pairs = [p for s in summaries.values() for p in s.pairs if p.metric in metrics]
    if args.json:
        print(json.dumps([p.as_dict() for p in pairs], indent=1))
        return 0
    for sweep, s in summaries.items():
        mine = [p for p in s.pairs if p.metric in metrics]
        if not mine:
            configs = sorted(s.configs["config"]) if len(s.configs) else []
            console.print(f"{sweep}: nothing to compare ({len(configs)} configuration(s) with runs: "
                          f"{', '.join(configs) or 'none'})", highlight=False)
            continue
        t = Table(title=f"{sweep}: a − b on {s.compute} (95% interval; equivalent = the interval inside "
                        f"±{s.equivalence:g}, by TOST)")
        for head in ("a", "b", "metric", "Δ [95% CI]", "how", "verdict", "seeds to decide"):
            t.add_column(head, overflow="fold")
        for p in mine:
            t.add_row(p.a, p.b, p.metric, _interval(p.diff.delta, p.diff.low, p.diff.high, "+.3f"), p.diff.method,
                      p.verdict + (f" ({p.reason})" if p.reason else ""), p.seeds_text())
        console.print(t)
    counts = pd.Series([p.verdict for p in pairs]).value_counts()
    console.print("verdicts: " + ", ".join(f"{v} {int(counts.get(v, 0))}" for v in
                                           ("better", "worse", "equivalent", "inconclusive")), highlight=False)
    if counts.get("inconclusive", 0):
        from analysis.compare import SEEDS_POWER

        console.print(f"seeds to decide: the seeds per configuration at which an inconclusive pair's 95% interval is "
                      f"decided with {SEEDS_POWER:.0%} probability, were its measured mean difference and sd the truth "
                      "(a projection from few seeds: an order of magnitude)", highlight=False)
    return 0


def metrics_of(metric: str) -> tuple:
    """--metric as the metrics it selects: "all" the three, "both" A and tail, else the one named."""
    from analysis.compare import METRICS

    return {"both": ("A", "tail"), "all": METRICS}.get(metric, (metric,))


def pairs_frame(summaries: dict, metric: str = "all") -> pd.DataFrame:
    """Every pair of configurations of every summarised sweep on `metric` (`metrics_of`), one row each with the
    fields `scalerl compare --json` prints (`as_dict`; a missing number is NaN here); `scalerl.compare` returns it."""
    metrics = metrics_of(metric)
    rows = [p.as_dict() for s in summaries.values() for p in s.pairs if p.metric in metrics]
    columns = ["sweep", "a", "b", "metric", "delta", "low", "high", "n", "paired", "identified", "verdict"]
    return pd.DataFrame(rows) if rows else pd.DataFrame(columns=columns)


def add_replay_arguments(parser: argparse.ArgumentParser) -> None:
    from analysis.adaptive import DEFAULT_RUNGS, DEFAULT_STOP_RULE, STOP_RULES
    from analysis.runs import COMPUTE_AXES

    rungs = ",".join(f"{r:g}" for r in DEFAULT_RUNGS)
    parser.add_argument("runs", help="a sweep directory or a directory of sweeps (finished runs)")
    parser.add_argument("--rungs", type=_rungs_arg, default=DEFAULT_RUNGS, metavar="R1,R2,...,1.0",
                        help=f"shares of the sweep's compute budget at which the rule decides (default {rungs})")
    parser.add_argument("--stop-rule", choices=list(STOP_RULES), default=DEFAULT_STOP_RULE,
                        help="tail: each configuration's own paired interval of the measured tail against the leader "
                             "(Holm over a rung's comparisons); law: the calibrated prediction of the end, upper bound "
                             f"below the leader's lower bound; both: either (default {DEFAULT_STOP_RULE}). The text "
                             "output also sums up every rule")
    parser.add_argument("--equivalence", type=_equivalence_arg, default=0.02, metavar="DELTA",
                        help="δ of the equivalence test that stops a tie (default 0.02)")
    parser.add_argument("--keep-equivalent", action="store_true", help="keep ties running (stop only losers)")
    parser.add_argument("--stop-when-decided", action="store_true",
                        help="the sweep ends when one configuration is left (its winner is not trained to the end; "
                             "default: it runs the full budget)")
    parser.add_argument("--compute", choices=list(COMPUTE_AXES), default="auto",
                        help="compute axis: auto (default) = flops at tiny scale, compute_hours otherwise")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON list, one object per sweep: sweep, compute_fraction, full_best, "
                             "adaptive_best, agrees (agreement same or equivalent), agreement (same | equivalent | "
                             "undecided | different: the full data's verdict on the adaptive pick against the full "
                             "best), stopped [{config, rung, verdict, rule}]; beside them stop_rule, configs and "
                             "difference (adaptive pick − full best on the full data: delta, low, high, n, paired, "
                             "verdict; null when the same)")


def _name(config: str) -> str:
    """A configuration as the replay table prints it: quoted, so that one named 'none' never reads as
    'no configuration'."""
    return f'"{config}"'


def replay_main(args: argparse.Namespace) -> int:
    """The adaptive rule replayed on finished sweeps: each run's logs cut at each rung."""
    import json

    from rich.console import Console
    from rich.table import Table

    from analysis.adaptive import STOP_RULES, replay
    from analysis.runs import load_runs

    console = Console(width=max(Console().width, 120), stderr=args.json)
    if not Path(args.runs).exists():
        console.print(f"[red]no such run directory: {args.runs}")
        return 2
    tables = (load_runs(args.runs, what="eval"), load_runs(args.runs, what="runs"))
    cache: dict = {}
    kw = dict(rungs=args.rungs, equivalence=args.equivalence, keep_equivalent=args.keep_equivalent,
              compute=args.compute, finish_leader=not args.stop_when_decided, tables=tables, cache=cache)
    results = replay(args.runs, stop_rule=args.stop_rule, **kw)
    if not results:
        console.print(f"[red]no sweep with two or more configurations under {args.runs}")
        return 1
    if args.json:
        print(json.dumps([r.as_dict() for r in results], indent=1))
        return 0
    t = Table(title=f"adaptive rule replayed ({args.stop_rule} rule; rungs {', '.join(f'{r:g}' for r in args.rungs)}; "
                    f"ties {'kept' if args.keep_equivalent else 'stopped'}; ±{args.equivalence:g}; "
                    f"{'the sweep ends when decided' if args.stop_when_decided else 'the last one runs to the end'})")
    for head in ("sweep", "configs", "compute", "full sweep's best", "adaptive pick", "agreement (full data)",
                 "stopped (rung: verdict)"):
        t.add_column(head, overflow="fold")
    for r in results:
        stops = "; ".join(f"{_name(s['config'])} ({s['rung']:g}: {s['verdict']}"
                          + (", law" if str(s.get("rule", "")).startswith("law") else "") + ")" for s in r.stopped)
        t.add_row(r.sweep, str(r.configs), f"{r.compute_fraction:.0%}", _name(r.full_best), _name(r.adaptive_best),
                  r.agreement_text(), stops or "nothing stopped: every configuration ran the full budget")
    console.print(t)
    console.print(_replay_summary(args.stop_rule, results), highlight=False)
    others = [rule for rule in STOP_RULES if rule != args.stop_rule]
    for rule in others:
        console.print(_replay_summary(rule, replay(args.runs, stop_rule=rule, **kw)), highlight=False)
    return 0


def _replay_summary(rule: str, results: list) -> str:
    """'tail rule: 7 of 8 sweeps agree (5 same, 2 equivalent, 1 undecided, 0 different); mean compute 67%'."""
    from collections import Counter

    n = Counter(r.agreement for r in results)
    frac = float(np.mean([r.compute_fraction for r in results])) if results else float("nan")
    return (f"{rule} rule: {sum(r.agrees for r in results)} of {len(results)} sweeps agree with the full sweep "
            f"({n['same']} same, {n['equivalent']} equivalent; {n['undecided']} undecided, {n['different']} different); "
            f"mean compute {frac:.0%} of the full sweeps'")
