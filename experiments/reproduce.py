"""`scalerl reproduce --scale tiny`: every paper ablation with N seeds, its figures and a report.

    scalerl reproduce --scale tiny --executor slurm --seeds 3      # run (resumable), draw, report
    scalerl reproduce --scale tiny --dry-run                       # every sweep x config x seed, what would run
    scalerl reproduce --scale tiny --report-only                   # figures + REPORT.md from results/tiny again
    scalerl reproduce --scale tiny --collect-only                  # collect the runs done so far, draw, report

1. Every sweep spec of experiments/sweeps/ (or `--sweeps a,b`) is expanded with seeds
   0..N-1 and planned by `scalerl sweep`'s own functions (`sweep_spec.select_runs`,
   `run_state.plan`, `run_config.validate_runs`, `submission.submit`, `submission.wait`): done runs are skipped, interrupted ones resume
   from their checkpoint, failed ones are retried only with `--retry-failed`. A run whose
   logs were already collected as done into OUT is skipped too (a fresh clone holding
   results/tiny does not re-run the study).
2. A done run that other work slowed (`analysis.protocol.is_contended`: `contention_run`, the
   share of its CPUs other work used, above 10% and its own threads' run-queue share `runq_run`
   above 10%) is set aside into RUNS/<sweep>/.contended/<run>-<k>/ and run again (at most `--max-reruns`
   times; `--allow-contention` keeps it). Its compute axis was stretched by a neighbour.
   Likewise a done run that trained past the tiny scale's compute budget without it (collected
   before the budget existed) is set aside into RUNS/<sweep>/.over_budget/ and run again under
   it (`over_budget`); one that stayed within the budget is kept.
3. Every wait has a deadline (`--wait-hours`); past it the command stops and names the runs
   still going (their jobs keep running; run the command again to pick them up).
4. Collect: config.gin, run.json, metrics.jsonl, eval.jsonl of every run (no checkpoints, no
   final/) are copied into OUT/<sweep>/<run>/. OUT must stay under `--max-mb` (50): with
   `--thin-metrics auto` (default) metrics.jsonl keeps every N-th step line (plus the line
   where epoch 1 ends and the last line) with the smallest N that fits; the report says N. A
   thinned run keeps its meters from the whole log in meters.json (the run table reads them).
5. Figures (PNG and PDF) into OUT/figures/ (`paper_figures.render.render_all`), and OUT/REPORT.md:
   per ablation the paper's finding (analysis/findings.py), ours (mean A and B over seeds
   with 95% t-intervals; `analysis.study.summarize`, the code path of `scalerl fit`), the
   comparison rule's verdict with the margin used, agree / disagree / inconclusive, and for
   each disagreement the reason recorded by hand in OUT/reasons.yaml (kept across
   re-generations: the report only appends the ids of new disagreements); then, for every
   run, its end predicted from the first half against the observed end; the contended runs;
   and the figures that cannot be drawn at this scale and why. The tables behind the
   report are OUT/report/*.csv; `scalerl fit OUT/<sweep>` prints the same numbers.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from experiments.run_config import DEFAULT_TARGET
from experiments.study_report import FIGURES_DIR, PREDICT_BOOT, write_report
from experiments.study_runs import (CollectResult, ReproduceError, collect, dir_bytes, materialize_shared, not_in_results,
                                    plan_study, print_plans, judge_contention, run_ended, run_study, select_specs,
                                    thinned_every, validate_plan)
from experiments.sweep_cli import add_slurm_arguments

__all__ = ["add_arguments", "main"]

def _sweep_seeds(text: str) -> tuple[str, int]:
    """--seeds-for SWEEP=N."""
    name, sep, n = text.partition("=")
    if not sep or not name.strip() or not n.strip().isdigit() or int(n) < 1:
        raise argparse.ArgumentTypeError(f"expected SWEEP=N with N >= 1, got {text!r}")
    return name.strip(), int(n)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scale", choices=("tiny", "small", "paper"), default="tiny",
                        help="tiny: every sweep mapped onto the CPU quickstart setting (default); small: onto the "
                             "small testbed (small_cpu.gin), where the paper's mechanisms act; paper: the paper's recipes")
    parser.add_argument("--executor", choices=("slurm", "local", "debug"), default="slurm",
                        help="slurm (default): one job array per sweep; local: subprocesses here, one sweep at a "
                             "time; debug: in this process")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 for every configuration (default 3)")
    parser.add_argument("--seeds-for", action="append", default=[], metavar="SWEEP=N", type=_sweep_seeds,
                        help="seeds 0..N-1 for this sweep's configurations instead (repeatable)")
    parser.add_argument("--gin", action="append", default=[], metavar="BINDING",
                        help="extra gin binding for every run, applied last (repeatable), e.g. a longer study: "
                             "--gin 'train.compute_budget_flops = 1.5e13'")
    parser.add_argument("--out", default=None, help="results folder (default results/<scale>)")
    parser.add_argument("--runs", default=None,
                        help="where the runs train, with their checkpoints (default runs/reproduce-<scale>)")
    parser.add_argument("--sweeps", default=None, help="comma-separated sweep names (default: every shipped sweep)")
    parser.add_argument("--dry-run", action="store_true",
                        help="list every sweep × config × seed and what would happen; run nothing")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: draw the figures and write REPORT.md from the results folder")
    parser.add_argument("--collect-only", action="store_true",
                        help="submit nothing: collect the runs that are done (and uncontended), draw, report "
                             "(a study part-way through; run without it later to finish)")
    parser.add_argument("--no-figures", action="store_true", help="do not draw the figures")
    parser.add_argument("--predict-boot", type=int, default=PREDICT_BOOT, metavar="N",
                        help=f"bootstrap resamples behind each run's prediction interval in the report (default "
                             f"{PREDICT_BOOT}; 0: no interval)")
    parser.add_argument("--allow-contention", action="store_true",
                        help="keep done runs that other work slowed (CPU contention and run-queue share above 10%%; "
                             "default: set aside and re-run)")
    parser.add_argument("--max-reruns", type=int, default=2,
                        help="how many times a contended run is re-run before it is kept (default 2)")
    parser.add_argument("--retry-failed", action="store_true", help="resubmit runs whose status is failed")
    parser.add_argument("--wait-hours", type=float, default=48.0,
                        help="stop waiting after this long and name the runs still going (default 48)")
    parser.add_argument("--max-mb", type=float, default=50.0, help="size budget of the results folder (default 50)")
    parser.add_argument("--thin-metrics", default="auto", metavar="auto|N",
                        help="collected metrics.jsonl keeps every N-th step line; auto (default): the smallest N "
                             "that fits --max-mb")
    parser.add_argument("--trainer", dest="target", default=DEFAULT_TARGET, metavar="MODULE:FUNCTION",
                        help=f"the function each job calls (default {DEFAULT_TARGET})")
    slurm = parser.add_argument_group("Slurm (as `scalerl sweep`)")
    add_slurm_arguments(slurm)
    slurm.add_argument("--array-parallelism", type=int, default=64,
                       help="max runs of a sweep at once (default 64; the local executor also stops at this machine's "
                            "cores)")


def _check_args(args: argparse.Namespace) -> None:
    if args.seeds < 1:
        raise ReproduceError(f"--seeds must be >= 1, got {args.seeds}")
    shipped = [p.stem for p in select_specs(args.sweeps)]
    unknown = [name for name, _ in args.seeds_for if name not in shipped]
    if unknown:
        raise ReproduceError(f"--seeds-for: sweep(s) {', '.join(unknown)} not in this study; its sweeps: {', '.join(shipped)}")
    if args.max_reruns < 0:
        raise ReproduceError(f"--max-reruns must be >= 0, got {args.max_reruns}")
    if args.max_mb <= 0:
        raise ReproduceError(f"--max-mb must be > 0, got {args.max_mb}")
    if args.predict_boot < 0:
        raise ReproduceError(f"--predict-boot must be >= 0, got {args.predict_boot}")
    if args.collect_only and (args.report_only or args.dry_run):
        raise ReproduceError("--collect-only cannot be combined with --report-only or --dry-run")
    if args.wait_hours <= 0:
        raise ReproduceError(f"--wait-hours must be > 0, got {args.wait_hours}")
    if str(args.thin_metrics) != "auto":
        try:
            if int(args.thin_metrics) < 1:
                raise ValueError
        except ValueError:
            raise ReproduceError(f"--thin-metrics must be 'auto' or an integer >= 1, got {args.thin_metrics!r}") from None
    args.out = Path(args.out or f"results/{args.scale}")
    args.runs = Path(args.runs or f"runs/reproduce-{args.scale}")
    if args.out.resolve() == args.runs.resolve():
        raise ReproduceError("--out and --runs must differ: --runs holds checkpoints, --out only the logs to commit")


def _draw_figures(out: Path, console) -> tuple[dict, dict, dict]:
    from paper_figures.common import Options
    from paper_figures.render import render_all

    # PNG for REPORT.md, PDF for a paper (both ~2 MB for a study's ~20 figures)
    opts = Options(compute="auto", formats=("png", "pdf"), dpi=110)
    written, missing, failed = render_all(out, out / FIGURES_DIR, opts)
    for fig_id, err in failed.items():
        console.print(f"[red]figure {fig_id} failed:[/red] {err}", highlight=False)
    console.print(f"figures: {len(written)} drawn, {len(missing)} missing, {len(failed)} failed -> {out / FIGURES_DIR}")
    return written, missing, failed


def _collect_finished(args: argparse.Namespace, console):
    """`--collect-only`: copy the runs that ran to their end (done, or ended by a prompt pool that
    ran out: `analysis.runs.run_finished`) and are uncontended (a study part-way through, or runs
    still queued), submitting nothing; the others stay out of OUT until a later collect."""
    def finished(run_dir: Path) -> bool:
        if not run_ended(run_dir):  # done, or its prompt pool ran out
            return False
        return args.allow_contention or not judge_contention(run_dir)[1]

    plans = plan_study(args, console, act=False)
    materialize_shared(plans, args.runs)  # a shared run takes its source's logs once the source has ended
    thin = "auto" if str(args.thin_metrics) == "auto" else int(args.thin_metrics)
    collected = collect(args.runs, args.out, plans, max_mb=args.max_mb, thin=thin, accept=finished)
    console.print(f"collected {collected.runs} finished runs into {args.out}; {len(collected.missing)} not finished "
                  "(or contended) yet", highlight=False)
    return collected


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console() if Console().is_terminal else Console(width=160)
    import shlex

    parts = [f"--scale {args.scale}", f"--executor {args.executor}", f"--seeds {args.seeds}"]
    parts += [f"--sweeps {args.sweeps}"] if args.sweeps else []
    parts += [f"--seeds-for {name}={n}" for name, n in args.seeds_for]
    parts += [f"--gin {shlex.quote(b)}" for b in args.gin]
    command = "scalerl reproduce " + " ".join(parts)  # what made this study (REPORT.md says it)
    try:
        _check_args(args)
        collected, kept = None, []
        if args.collect_only:
            collected = _collect_finished(args, console)
        elif args.report_only:
            if args.sweeps and args.out.is_dir():  # a chosen study: what OUT lacks of it, so "complete" is true
                collected = CollectResult(0, 0, thinned_every(args.out), not_in_results(args))
        else:
            plans = plan_study(args, console, act=not args.dry_run)
            print_plans(plans, args, console)
            if args.dry_run:
                for sp in plans:
                    if sp.todo:
                        validate_plan(sp)
                console.print("dry run: every run validated; nothing submitted")
                return 0
            rounds = 0
            while True:
                outcomes = run_study(plans, args, console)
                rounds += 1
                for k, (res, err) in outcomes.items():
                    if res != "done":
                        console.print(f"[red]{k} failed:[/red] {err}", highlight=False)
                last = rounds > args.max_reruns
                plans = plan_study(args, console, act=not last)  # newly contended runs are set aside here
                if last or args.allow_contention or not any(sp.set_aside for sp in plans):
                    break
                console.print("re-running contended runs: " + ", ".join(
                    f"{sp.spec.name}/{x}" for sp in plans for x in sp.set_aside), highlight=False)
            kept = [f"{sp.spec.name}/{x}" for sp in plans for x in sp.kept_contended]
            if last:
                kept += [f"{sp.spec.name}/{x} (still contended after {rounds} rounds)" for sp in plans
                         for x in sp.set_aside]
            materialize_shared(plans, args.runs)
            thin = "auto" if str(args.thin_metrics) == "auto" else int(args.thin_metrics)
            collected = collect(args.runs, args.out, plans, max_mb=args.max_mb, thin=thin)
            console.print(f"collected {collected.runs} runs into {args.out} ({collected.bytes / 1e6:.1f} MB"
                          + (f", metrics every {collected.thin} steps" if collected.thin > 1 else "") + ")")
            if collected.missing:
                console.print(f"[yellow]{len(collected.missing)} run(s) have no logs yet:[/yellow] "
                              + ", ".join(collected.missing[:20]), highlight=False)
        if not args.out.is_dir():
            raise ReproduceError(f"no results folder {args.out}: run the study first (without --report-only)")
        figures = None if args.no_figures else _draw_figures(args.out, console)
        report = write_report(args.out, figures=figures, collected=collected, scale=args.scale, command=command,
                              predict_boot=args.predict_boot, kept_contended=kept,
                              selected=[p.stem for p in select_specs(args.sweeps)] if args.sweeps else None)
        total = dir_bytes(args.out)
        console.print(f"wrote {report}; {args.out} holds {total / 1e6:.1f} MB")
        if total > args.max_mb * 1e6:
            console.print(f"[red]error:[/red] {args.out} is {total / 1e6:.1f} MB > --max-mb {args.max_mb}: largest "
                          "files: " + ", ".join(f"{p} ({p.stat().st_size / 1e6:.1f} MB)" for p in sorted(
                              (f for f in args.out.rglob('*') if f.is_file()), key=lambda f: -f.stat().st_size)[:5]))
            return 1
        return 0
    except ReproduceError as err:
        console.print(f"[red]error:[/red] {err}", highlight=False)
        return 2
