"""`scalerl sweep`: one-factor-at-a-time sweeps through submitit (slurm | local | debug).

    scalerl sweep loss_type --scale tiny --dry-run         # the runs, their overrides and memory plan
    scalerl sweep loss_type --scale tiny --executor local  # run here, as many at once as the cores allow
    scalerl sweep loss_type --partition gpu --time 4:00:00 # one Slurm job array
    scalerl sweep loss_type --scale tiny --seeds 0 1 2 --adaptive --dry-run   # + each rung's budget

A spec (`experiments.sweep_spec`) expands into runs; each run's state is reconciled with the
scheduler (`experiments.run_state`): re-running a sweep skips runs whose run.json says done,
leaves runs whose job is still queued or running alone, resubmits the rest (the trainer resumes
from the run's last checkpoint) and resubmits failed runs only with `--retry-failed`.

Everything is validated before anything is submitted (`experiments.run_config`,
`experiments.slurm`): unknown factors (gin configurables and their parameters), values a
component registry does not know, missing recipe files, runs that do not fit the memory plan,
and a Slurm partition that does not exist; with `--adaptive`, a sweep without one compute budget
for every run (`train.compute_budget_flops`, which paper scale must set) or with fewer than two
seeds shared by every configuration (`--seeds`), and the dry run prints each rung's budget. Then
the runs are submitted as one job array (`experiments.submission`).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Sequence

from experiments.plan import print_sweep_memory, sweep_memory
from experiments.recipes import SweepError
from experiments.run_config import DEFAULT_TARGET, validate_runs
from experiments.run_settings import check_planned, refused_runs
from experiments.run_state import Planned, plan
from experiments.slurm import check_partition, parse_time_min
from experiments.submission import LaunchOptions, submit, wait
from experiments.sweep_spec import RunSpec, SweepSpec, select_runs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", help="sweep spec (.gin), or the name of one in experiments/sweeps/")
    parser.add_argument("--executor", choices=("slurm", "local", "debug"), default="slurm",
                        help="slurm (the default): one job array; local: subprocesses here; debug: in this process")
    parser.add_argument("--scale", choices=("paper", "tiny", "small"), default="paper",
                        help="paper: the spec's recipe at paper scale; tiny: mapped onto the CPU quickstart setting "
                             "(tiny_cpu.gin); small: onto the small testbed, where the paper's mechanisms act "
                             "(small_cpu.gin)")
    parser.add_argument("--runs", default="runs", help="runs root; runs land in RUNS/<sweep>/<run>/ (default runs/)")
    parser.add_argument("--dry-run", action="store_true", help="print the runs and their overrides; submit nothing")
    parser.add_argument("--retry-failed", action="store_true", help="resubmit runs whose status is failed")
    parser.add_argument("--only", nargs="+", metavar="RUN", help="launch only these runs (names as in --dry-run)")
    parser.add_argument("--seeds", type=int, nargs="+", help="override the spec's seeds")
    parser.add_argument("--gin", action="append", default=[], metavar="BINDING",
                        help="extra gin binding for every run, applied last (repeatable)")
    parser.add_argument("--gpu-memory-gb", type=float, default=None, metavar="GB",
                        help="GPU memory (GiB) the memory plan checks each run against; runs that cannot fit are "
                             "refused (default 80 for GPU runs; CPU runs, train.device = \"cpu\", only when given)")
    parser.add_argument("--trainer", dest="target", default=DEFAULT_TARGET, metavar="MODULE:FUNCTION",
                        help=f"the function each job calls (default {DEFAULT_TARGET}); same signature as run_training")
    parser.add_argument("--wait", action="store_true", help="slurm: wait for the jobs and report (local/debug always wait)")
    adaptive = parser.add_argument_group("adaptive (experiments/adaptive_sweep.py)")
    adaptive.add_argument("--adaptive", action="store_true",
                          help="run rung by rung and stop the configurations that have lost (worse than the leader, or "
                               "equivalent to it, each on its own paired interval over the seeds both ran; >= 2 seeds "
                               "shared by every configuration); survivors resume from their checkpoints; every "
                               "decision in <sweep dir>/adaptive.jsonl (implies --wait). --dry-run prints each rung's "
                               "budget and refuses a sweep that cannot be adaptive")
    adaptive.add_argument("--rungs", default=None, metavar="R1,R2,...,1.0",
                          help="shares of the compute budget (train.compute_budget_flops) at which the rule decides "
                               "(default: analysis.adaptive.DEFAULT_RUNGS, 0.1,0.15,0.2,0.4,1.0)")
    adaptive.add_argument("--stop-rule", default=None, choices=("tail", "law", "both"),
                          help="tail: the measured tail's own paired interval against the leader (Holm over a rung's "
                               "comparisons); law: the calibrated prediction of the end, upper bound below the "
                               "leader's lower bound; both: either (default: tail, BENCHMARKS.md)")
    adaptive.add_argument("--equivalence", type=float, default=0.02, metavar="DELTA",
                          help="δ of the equivalence test that stops a tie (default 0.02)")
    adaptive.add_argument("--keep-equivalent", action="store_true", help="keep ties running (stop only losers)")
    adaptive.add_argument("--stop-when-decided", action="store_true",
                          help="end the sweep as soon as one configuration is left (its winner is not trained to the "
                               "full budget); default: the last one runs to the end")
    slurm = parser.add_argument_group("Slurm")
    add_slurm_arguments(slurm)
    slurm.add_argument("--array-parallelism", type=int, default=64,
                       help="max runs at once (default 64; the local executor also stops at this machine's cores)")


def add_resource_arguments(group) -> None:
    """Per-run resources (shared by `scalerl sweep` and `scalerl train --executor slurm`)."""
    group.add_argument("--gpus", type=int, default=0,
                       help="GPUs per node of a run (default 0 = CPU; with train.device cuda: what the layout needs)")
    group.add_argument("--cpus", type=int, default=None,
                       help="CPUs per task (default: one per process of the run, so runs never share cores)")
    group.add_argument("--nodes", type=int, default=1, help="nodes per run (default 1)")
    group.add_argument("--tasks-per-node", type=int, default=None,
                       help="one Slurm task per process of the run, this many per node (roles from the rank); "
                            "default: one task that starts the run's processes itself")
    group.add_argument("--overcommit", action="store_true",
                       help="let a node run more tasks than it has CPUs (sbatch --overcommit)")


def add_slurm_arguments(slurm) -> None:
    """The Slurm options of a job (shared by `scalerl sweep` and `scalerl train --executor slurm`)."""
    slurm.add_argument("--partition", help="Slurm partition (checked with sinfo); default: the cluster's default")
    add_resource_arguments(slurm)
    slurm.add_argument("--mem-gb", type=float, help="memory per run in GB")
    slurm.add_argument("--time", default="60", help="time limit per job: minutes or [D-]HH:MM:SS (default 60); "
                       "a run that hits it is checkpointed and requeued")
    slurm.add_argument("--account", help="Slurm account (passed through)")
    slurm.add_argument("--qos", help="Slurm QOS (passed through)")
    slurm.add_argument("--slurm-extra", action="append", default=[], metavar="KEY=VALUE",
                       help="any other sbatch option, e.g. constraint=a100 (repeatable)")
    slurm.add_argument("--max-requeues", type=int, default=10,
                       help="how many time-limit requeues a run may use (default 10)")
    slurm.add_argument("--signal-delay", type=int, default=90, metavar="SECONDS",
                       help="warn a job this long before its time limit, so it can checkpoint and requeue (default 90)")


def options_from_args(args: argparse.Namespace) -> LaunchOptions:
    return LaunchOptions(
        executor=args.executor, partition=args.partition, gpus=args.gpus, cpus=args.cpus, mem_gb=args.mem_gb,
        time_min=parse_time_min(args.time), array_parallelism=getattr(args, "array_parallelism", 64),
        account=args.account, qos=args.qos, slurm_extra=_parse_extra(args.slurm_extra), max_requeues=args.max_requeues,
        signal_delay_s=args.signal_delay, target=getattr(args, "target", DEFAULT_TARGET),
        nodes=args.nodes, tasks_per_node=args.tasks_per_node, overcommit=args.overcommit,
    )


def _parse_extra(items: Sequence[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SweepError(f"--slurm-extra expects KEY=VALUE, got {item!r}")
        out[key.strip().lstrip("-").replace("-", "_")] = value
    return out


def prepare(args: argparse.Namespace) -> tuple[SweepSpec, list[RunSpec], LaunchOptions]:
    spec, runs = select_runs(args.spec, args.scale, seeds=args.seeds, extra_bindings=args.gin, only=args.only)
    return spec, runs, options_from_args(args)


def print_plan(spec: SweepSpec, planned: Sequence[Planned], root: Path, scale: str, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"sweep {spec.name} ({scale} scale, factor {spec.factor}) -> {Path(root) / spec.name}")
    for col in ("run", "action", "config", "overrides", "note"):
        table.add_column(col, overflow="fold")
    for p in planned:
        table.add_row(p.run.name, p.action, " + ".join(Path(f).name for f in p.run.config_files),
                      "\n".join(p.run.bindings), p.reason)
    console.print(table)


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    try:
        spec, runs, opts = prepare(args)
        root = Path(args.runs)
        planned = plan(runs, root, retry_failed=args.retry_failed)
        configs = validate_runs(runs, opts.target)
        if not getattr(args, "adaptive", False):  # (an adaptive sweep checks each rung with its own budget)
            planned = check_planned(planned, configs)  # a run that ran with other settings: refused, by name
        print_plan(spec, planned, root, args.scale, console)
        memory = sweep_memory(configs, getattr(args, "gpu_memory_gb", None))
        print_sweep_memory(memory, console)
        unfit = [p.run.name for p in planned if not p.action.startswith("skip") and memory[p.run.name][0] is False]
        if unfit:
            raise SweepError(f"{len(unfit)} run(s) do not fit the memory plan: {', '.join(unfit)} (details: `scalerl plan "
                             "CONFIG --gin ...`); nothing submitted")
        if opts.executor == "slurm" and not args.dry_run:
            check_partition(opts.partition)
        elif opts.executor == "slurm" and opts.partition and shutil.which("sinfo"):
            check_partition(opts.partition)
        budget = _check_adaptive(runs, args) if getattr(args, "adaptive", False) else None
    except (SweepError, ValueError) as err:
        console.print(f"[red]error:[/red] {err}")
        return 2
    if args.adaptive and not args.dry_run:
        return _adaptive(spec, runs, opts, root, args, console)
    if args.dry_run:
        if args.adaptive:
            from experiments.adaptive_sweep import print_rung_budgets

            print_rung_budgets(runs, args.rungs, budget, console, stop_rule=args.stop_rule,
                               finish_leader=not args.stop_when_decided)
        n = sum(not p.action.startswith("skip") for p in planned)
        console.print(f"dry run: {n} of {len(planned)} runs would be submitted ({opts.executor}); nothing submitted")
        return 0
    refused = refused_runs(planned)
    for p in refused:  # the others go on; these directories are left exactly as they were
        console.print(f"[red]{p.run.name} refused:[/red] {p.reason}", highlight=False)
    submitted = submit(planned, opts, root, spec.name, configs=configs)
    if not submitted:
        console.print("nothing to submit: every run is done, active, failed (see --retry-failed) or refused")
        return 1 if refused else 0
    ids = sorted({str(job.job_id).split("_")[0] for _, job in submitted})
    console.print(f"submitted {len(submitted)} runs ({opts.executor}, job {'/'.join(ids)}); "
                  f"follow with: scalerl status {root / spec.name}")
    if opts.executor == "slurm" and not args.wait:
        return 0
    outcomes = wait(submitted, poll_s=2.0 if opts.executor != "slurm" else 10.0)
    failed = {k: v for k, v in outcomes.items() if v[0] != "done"}
    for name, (_, err) in failed.items():
        console.print(f"[red]{name} failed:[/red] {err}")
    console.print(f"{len(outcomes) - len(failed)} done, {len(failed)} failed"
                  + (f", {len(refused)} refused (ran with other settings: {', '.join(p.run.name for p in refused)})"
                     if refused else ""), highlight=False)
    return 1 if failed or refused else 0


def _check_adaptive(runs: Sequence[RunSpec], args: argparse.Namespace) -> float:
    """Parse the adaptive options (in place) and refuse a sweep that cannot be adaptive (no single
    compute budget; fewer than two seeds shared by every configuration): on --dry-run as at launch,
    before anything is submitted. Returns the budget."""
    from analysis.adaptive import DEFAULT_RUNGS, DEFAULT_STOP_RULE, parse_rungs, parse_stop_rule
    from analysis.compare import parse_equivalence
    from experiments.adaptive_sweep import AdaptiveError, check_adaptive

    args.rungs = parse_rungs(args.rungs if args.rungs is not None else DEFAULT_RUNGS)
    args.equivalence = parse_equivalence(args.equivalence)
    args.stop_rule = parse_stop_rule(args.stop_rule or DEFAULT_STOP_RULE)
    try:
        return check_adaptive(runs, args.rungs)
    except AdaptiveError as err:
        raise SweepError(str(err)) from None


def _adaptive(spec: SweepSpec, runs: Sequence[RunSpec], opts: LaunchOptions, root: Path, args: argparse.Namespace,
              console) -> int:
    from experiments.adaptive_sweep import AdaptiveError, run_adaptive

    try:
        return run_adaptive(spec, runs, opts, root, rungs=args.rungs, equivalence=args.equivalence,
                            keep_equivalent=args.keep_equivalent, console=console,
                            poll_s=2.0 if opts.executor != "slurm" else 5.0, retry_failed=args.retry_failed,
                            stop_rule=args.stop_rule, finish_leader=not args.stop_when_decided)
    except AdaptiveError as err:
        console.print(f"[red]error:[/red] {err}")
        return 2
