"""`scalerl status runs/<sweep>`: one table row per run of a sweep.

Columns: run, state (run.json status, reconciled with the scheduler: see below), Slurm (the
state of the run's last job, from `squeue` while it is live or just ended, else `sacct`,
through the job id `scalerl sweep` records in the run's slurm.json), step, epoch and
compute_hours (last line of metrics.jsonl), the run's CPU contention (`contention_run`: the
share of the run's CPUs that other work used since the start, from /proc/stat; above 10% the
row is marked and a warning names the run, since its compute axis is stretched), the last
held-out pass rate (eval.jsonl) and the fitted asymptote A and exponent B of the sigmoid law
once the run has enough evaluation points, fitted by the paper's protocol for the run's sweep
(`analysis.protocol.fit_with_protocol`: the whole run for a forward ablation from the end of
its first epoch, the first half for leave-one-out... from the paper's start).

PATH may be one run directory, a sweep directory (its runs are the subdirectories) or a
runs root (every sweep below it).

The state is not only what run.json says (`experiments.run_state.reconcile`): a run whose Slurm job
is queued or running is `queued` / `running`; a run that recorded no end (run.json `running`, or
no run.json) whose job ended (CANCELLED, FAILED, TIMEOUT, NODE_FAIL, OUT_OF_MEMORY, PREEMPTED,
BOOT_FAIL, DEADLINE, COMPLETED, or GONE: known neither to squeue nor to sacct) is `interrupted`,
the scheduler's state given as the reason; so is a local run whose process is gone (its
run-directory lock free, its recorded pid dead). `scalerl sweep` resumes interrupted runs.
run.json is read as the trainer reads it (`RunInfo`: a failure it could only record outside an
unwritable run directory counts). A run of an adaptive sweep whose configuration the rule stopped
(`<sweep dir>/adaptive.jsonl`, experiments/adaptive_sweep.py) is `stopped`, with the decision:
`stopped (rung 0.25: worse than cispo by -0.120 [-0.150, -0.090])`.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Sequence

from experiments.run_state import SLURM_FILE, local_alive, read_json, read_run_info, reconcile, scheduler_state
from experiments.slurm import slurm_job_states

MIN_FIT_POINTS = 5  # evaluation points (after the first) before A and B are shown


@dataclass
class RunStatus:
    run: str
    path: str
    state: str  # running | done | failed | interrupted | queued (no run.json yet) | stopped (adaptive) | unknown
    slurm: str  # last job's Slurm state, "" when not on Slurm / unknown
    job_id: str
    step: int | None
    compute_hours: float | None
    pass_rate: float | None
    eval_points: int
    A: float | None
    B: float | None
    fit_note: str
    error: str
    epoch: float | None = None
    contention: float | None = None  # contention_run of the last metrics line
    contended: bool = False  # analysis.protocol.is_contended: other work slowed the run
    reason: str = ""  # why the state is not run.json's (e.g. the Slurm job ended CANCELLED), or run.json's error


def read_jsonl(path: Path) -> list[dict]:
    """Every parseable line of a JSONL file (a half-written last line is ignored)."""
    rows = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    continue
    except OSError:
        pass
    return rows


def find_runs(path: Path) -> list[Path]:
    """Run directories at or below PATH (a run, a sweep, or a runs root)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no such directory: {path}")

    def is_run(d: Path) -> bool:
        return any((d / f).exists() for f in ("run.json", SLURM_FILE, "metrics.jsonl"))

    if is_run(path):
        return [path]
    children = sorted(d for d in path.iterdir() if d.is_dir() and not d.name.startswith("."))
    runs = [d for d in children if is_run(d)]
    if runs:
        return runs
    return [g for d in children for g in sorted(x for x in d.iterdir() if x.is_dir() and is_run(x))]


def slurm_states(job_ids: Iterable[str]) -> dict[str, str]:
    """{job id: Slurm state}: squeue, then sacct (accounting) for jobs squeue no longer lists."""
    return slurm_job_states(job_ids)


def fit_ab(evals: Sequence[dict], min_points: int = MIN_FIT_POINTS, *, metrics: Sequence[dict] = (),
           sweep: str | None = None) -> tuple[float | None, float | None, str]:
    """(A, B, note) of the sigmoid law on (compute_hours, pass_rate) points, fitted by the paper's
    protocol for `sweep` (where a fit starts: analysis/protocol.py; epoch from `metrics`); None where not
    fittable. Downstream benchmark records (a "benchmark" key) are not part of the curve."""
    evals = [e for e in evals if "benchmark" not in e]
    pts = [(e.get("compute_hours"), e.get("pass_rate")) for e in evals]
    pts = [(float(c), float(r)) for c, r in pts if isinstance(c, (int, float)) and isinstance(r, (int, float))
           and math.isfinite(c) and math.isfinite(r)]
    pts.sort()
    dedup: list[tuple[float, float]] = []
    for c, r in pts:  # compute must be strictly increasing
        if dedup and c <= dedup[-1][0]:
            continue
        dedup.append((c, r))
    if len(dedup) < min_points:
        return None, None, f"{len(dedup)}/{min_points} eval points"
    from analysis.protocol import epoch1_compute, fit_with_protocol, sweep_protocol

    ep1, max_epoch = epoch1_compute(metrics, "compute_hours")
    pf = fit_with_protocol([c for c, _ in dedup], [r for _, r in dedup], protocol=sweep_protocol(sweep),
                           epoch1=ep1, max_epoch=max_epoch)
    if pf.fit is None:
        return None, None, f"no fit ({pf.reason.split(':')[0][:60]})"
    note = "; ".join(getattr(pf.fit, "flags", ()) or ())
    return float(pf.fit.A), float(pf.fit.B), note


def collect(path: Path, *, with_slurm: bool = True, min_points: int = MIN_FIT_POINTS) -> list[RunStatus]:
    run_dirs = find_runs(path)
    jobs = {d: (read_json(d / SLURM_FILE) or {}) for d in run_dirs}
    slurm_ids = [j.get("job_id") for j in jobs.values() if j.get("executor", "slurm") == "slurm" and j.get("job_id")]
    states = slurm_states(slurm_ids) if with_slurm else {}  # before run.json: a job ending now has written its end
    root = Path(path)
    out = []
    from analysis.protocol import is_contended
    from analysis.runs import config_name
    from experiments.adaptive_sweep import stop_text, stopped_configs

    stops = {sweep_dir: stopped_configs(sweep_dir) for sweep_dir in {d.parent for d in run_dirs}}
    for d in run_dirs:
        info = read_run_info(d)
        metrics = read_jsonl(d / "metrics.jsonl")
        last = metrics[-1] if metrics else {}
        evals = [e for e in read_jsonl(d / "eval.jsonl") if "benchmark" not in e]  # held-out only (no downstream)
        job = jobs[d]
        job_id = str(job.get("job_id", "") or "")
        slurm_state = scheduler_state(info, job, states)
        state, reason = reconcile(info.get("status"), job, slurm_state, local_alive(d, info, job))
        if state == "interrupted" and not reason:
            reason = str(info.get("error", "") or "")
        stop = stops.get(d.parent, {}).get(config_name(info.get("name") or d.name))
        if stop is not None and state in ("done", "interrupted"):  # the adaptive rule stopped its configuration
            state, reason = "stopped", stop_text(stop)
        sweep = info.get("sweep") or (d.parent.name if d != root else None)
        A, B, note = fit_ab(evals, min_points, metrics=metrics, sweep=sweep) if evals else (None, None, "no evals")
        from analysis.runs import run_runq

        contention = _number(last.get("contention_run"))
        name = str(d.relative_to(root)) if d != root else d.name
        out.append(RunStatus(
            run=name, path=str(d), state=state,
            slurm=states.get(job_id, "") if job.get("executor", "slurm") == "slurm" else job.get("executor", ""),
            job_id=job_id,
            step=last.get("step"), compute_hours=last.get("compute_hours"),
            pass_rate=(evals[-1].get("pass_rate") if evals else None), eval_points=len(evals),
            A=A, B=B, fit_note=note, error=str(info.get("error", "") or ""),
            epoch=_number(last.get("epoch")), contention=contention, contended=is_contended(contention, run_runq(metrics)),
            reason=reason,
        ))
    return out


def _number(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def _fmt(x, spec: str) -> str:
    if x is None:
        return "-"
    try:
        return format(x, spec)
    except (TypeError, ValueError):
        return str(x)


STATE_STYLE = {"done": "green", "running": "cyan", "failed": "red", "queued": "yellow", "interrupted": "magenta",
               "stopped": "blue"}


def render(rows: Sequence[RunStatus], title: str, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=title)
    for col, kw in (("run", {"no_wrap": True}), ("state", {}), ("slurm", {}), ("step", {"justify": "right"}),
                    ("epoch", {"justify": "right"}), ("compute_h", {"justify": "right"}),
                    ("contention", {"justify": "right"}), ("pass rate", {"justify": "right"}),
                    ("evals", {"justify": "right"}), ("A", {"justify": "right"}), ("B", {"justify": "right"}),
                    ("note", {"overflow": "fold"})):
        table.add_column(col, **kw)
    for r in rows:
        style = STATE_STYLE.get(r.state, "")
        note = (r.error.splitlines()[0][:40] if r.state == "failed" and r.error
                else r.reason.splitlines()[0][:40] if r.state == "interrupted" and r.reason
                else r.reason if r.state == "stopped" else r.fit_note[:40])
        cont = "-" if r.contention is None else (f"[red]{r.contention:.0%} ![/red]" if r.contended
                                                  else f"{r.contention:.0%}")
        table.add_row(r.run, f"[{style}]{r.state}[/{style}]" if style else r.state, r.slurm or "-",
                      _fmt(r.step, "d"), _fmt(r.epoch, ".2f"), _fmt(r.compute_hours, ".4g"), cont,
                      _fmt(r.pass_rate, ".3f"), str(r.eval_points), _fmt(r.A, ".3f"), _fmt(r.B, ".2f"), note)
    console.print(table)
    for r in rows:
        if r.state == "failed" and r.error:
            console.print(f"[red]{r.run}[/red]: {r.error.splitlines()[0]}", overflow="fold")
        elif r.state == "interrupted" and r.reason:
            console.print(f"[magenta]{r.run}[/magenta] interrupted: {r.reason.splitlines()[0]}; resumable (a re-run "
                          "of its sweep, or `scalerl train ... --run-dir`)", overflow="fold", highlight=False)
    contended = [r for r in rows if r.contended]
    if contended:
        from analysis.protocol import CONTENTION_LIMIT

        names = ", ".join(f"{r.run} ({r.contention:.0%})" for r in contended)
        console.print(f"[yellow]warning:[/yellow] {len(contended)} run(s) slowed by other work (CPU contention "
                      f"above {CONTENTION_LIMIT:.0%} and their threads waited for a CPU): {names}; their compute axis is stretched: re-run them with "
                      "nothing beside them (`scalerl reproduce` re-runs them unless --allow-contention)",
                      overflow="fold", highlight=False)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.state] = counts.get(r.state, 0) + 1
    console.print(", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no runs")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", nargs="?", default="runs", help="a sweep directory (runs/<sweep>), a run, or a runs root")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    parser.add_argument("--no-slurm", action="store_true", help="do not query sacct/squeue")
    parser.add_argument("--min-points", type=int, default=MIN_FIT_POINTS,
                        help=f"evaluation points needed before A and B are fitted (default {MIN_FIT_POINTS})")


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console() if Console().is_terminal else Console(width=160)
    try:
        rows = collect(Path(args.path), with_slurm=not args.no_slurm, min_points=args.min_points)
    except FileNotFoundError as err:
        console.print(f"[red]error:[/red] {err}")
        return 2
    if not rows:  # as `scalerl fit` does: nothing to show is an error a script can see
        if args.json:
            print("[]")
        Console(stderr=True).print(f"[red]error:[/red] no runs under {args.path} (a run directory holds run.json, "
                                   "metrics.jsonl or slurm.json; a sweep's runs are in runs/<sweep>/)",
                                   highlight=False, soft_wrap=True)
        return 1
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2, default=str))
    else:
        render(rows, title=f"runs in {args.path}", console=console)
    return 0
