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
2. A done run whose CPU contention (`contention_run`, the last metrics line) exceeded 10% is
   set aside into RUNS/<sweep>/.contended/<run>-<k>/ and run again (at most `--max-reruns`
   times; `--allow-contention` keeps it). Its compute axis was stretched by a neighbour.
   Likewise a done run that trained past the tiny scale's compute budget without it (collected
   before the budget existed) is set aside into RUNS/<sweep>/.over_budget/ and run again under
   it (`over_budget`); one that stayed within the budget is kept.
3. Every wait has a deadline (`--wait-hours`); past it the command stops and names the runs
   still going (their jobs keep running; run the command again to pick them up).
4. Collect: config.gin, run.json, metrics.jsonl, eval.jsonl of every run (no checkpoints, no
   final/) are copied into OUT/<sweep>/<run>/. OUT must stay under `--max-mb` (50): with
   `--thin-metrics auto` (default) metrics.jsonl keeps every N-th step line (plus the line
   where epoch 1 ends and the last line) with the smallest N that fits; the report says N.
5. Figures (PNG) into OUT/figures/ (`paper_figures.render.render_all`), and OUT/REPORT.md:
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
import dataclasses
import datetime as _dt
import json
import math
import shutil
import time
from pathlib import Path
from typing import Any, Sequence

from experiments.recipes import SWEEPS_DIR, SweepError
from experiments.run_config import DEFAULT_TARGET, validate_runs
from experiments.run_state import Planned, plan, read_json
from experiments.slurm import check_partition
from experiments.submission import LaunchOptions, submit, wait
from experiments.sweep_cli import add_slurm_arguments, options_from_args, print_plan
from experiments.sweep_spec import RunSpec, SweepSpec, select_runs
from experiments.sweep_spec import budget_of as _budget_of  # the tiny scale's stopping rule

__all__ = ["add_arguments", "main", "select_specs", "plan_study", "collect", "write_report", "COLLECTED_FILES",
           "REPORT_FILE", "REASONS_FILE"]

COLLECTED_FILES = ("config.gin", "run.json", "metrics.jsonl", "eval.jsonl")
REPORT_FILE = "REPORT.md"
REASONS_FILE = "reasons.yaml"
CONTENDED_DIR = ".contended"
OVER_BUDGET_DIR = ".over_budget"
FIGURES_DIR = "figures"
TABLES_DIR = "report"


class ReproduceError(RuntimeError):
    """A bad option or a step that cannot go on; the message says what to do."""


# ----------------------------------------------------------------------------- sweeps and plans


def select_specs(names: str | Sequence[str] | None) -> list[Path]:
    """The shipped sweep specs (experiments/sweeps/*.gin), or the named ones."""
    shipped = {p.stem: p for p in sorted(SWEEPS_DIR.glob("*.gin"))}
    if names is None:
        return list(shipped.values())
    wanted = [n.strip() for n in (names.split(",") if isinstance(names, str) else names) if n.strip()]
    unknown = [n for n in wanted if n not in shipped]
    if unknown:
        raise ReproduceError(f"unknown sweep(s) {', '.join(unknown)}; shipped sweeps: {', '.join(shipped)}")
    if not wanted:
        raise ReproduceError("--sweeps names no sweep")
    return [shipped[n] for n in wanted]


def _prepare(spec: Path, args: argparse.Namespace) -> tuple[SweepSpec, list[RunSpec], LaunchOptions]:
    """The spec, its runs with seeds 0..N-1, and the launch options `scalerl sweep SPEC` would get."""
    spec, runs = select_runs(spec, args.scale, seeds=range(args.seeds))
    return spec, runs, options_from_args(args)


@dataclasses.dataclass
class SweepPlan:
    spec: SweepSpec
    runs: list[RunSpec]
    opts: LaunchOptions
    planned: list[Planned]
    set_aside: list[str] = dataclasses.field(default_factory=list)  # contended runs moved away (to re-run)
    kept_contended: list[str] = dataclasses.field(default_factory=list)

    @property
    def todo(self) -> list:
        return [p for p in self.planned if not p.action.startswith("skip")]


def _last_metrics(run_dir: Path) -> dict:
    from analysis.runs import read_jsonl

    rows, _ = read_jsonl(Path(run_dir) / "metrics.jsonl")
    return rows[-1] if rows else {}


def _status(run_dir: Path) -> str | None:
    return (read_json(Path(run_dir) / "run.json") or {}).get("status")


def run_contention(run_dir: Path) -> float | None:
    x = _last_metrics(run_dir).get("contention_run")
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def _logged_budget(run_dir: Path) -> float | None:
    """The compute budget a run ran under: its config.gin's binding (None: it had none)."""
    cfg = Path(run_dir) / "config.gin"
    return _budget_of(cfg.read_text().splitlines()) if cfg.is_file() else None


def over_budget(run_dir: Path, budget: float | None) -> str | None:
    """Why a done run must be trained again under the compute budget `budget`, or None.

    A run that ran with the same budget is kept (it stops at the first step past it). A run
    that ran without it (or with a larger one) is kept only if its training compute stayed
    within `budget`: then the budget would not have stopped it, and its logs are what a
    re-run would give. Otherwise its curve runs past the compute every other run gets."""
    if budget is None:
        return None
    if _logged_budget(run_dir) == budget:
        return None
    used = _last_metrics(run_dir).get("flops")
    if not isinstance(used, (int, float)) or not math.isfinite(used) or used <= budget:
        return None
    return f"trained {used:.4g} FLOPs without the budget of {budget:g}: re-run under it"


def _set_aside(run_dir: Path, work_root: Path, sweep: str, run: str, folder: str = CONTENDED_DIR) -> Path:
    """Move a run to WORK/<sweep>/<folder>/<run>-<k>/ (kept as evidence, not analysed): a
    contended run (.contended) or one trained past the compute budget (.over_budget)."""
    dest_dir = work_root / sweep / folder
    dest_dir.mkdir(parents=True, exist_ok=True)
    k = len(list(dest_dir.glob(f"{run}-*"))) + 1
    dest = dest_dir / f"{run}-{k}"
    shutil.move(str(run_dir), str(dest))
    return dest


def _reruns(work_root: Path, sweep: str, run: str) -> int:
    return len(list((work_root / sweep / CONTENDED_DIR).glob(f"{run}-*")))


def plan_study(args: argparse.Namespace, console=None, *, act: bool = True) -> list[SweepPlan]:
    """Expand and plan every selected sweep. act=True moves contended runs aside (so they are
    planned again); act=False (a dry run) only says what would happen."""
    from analysis.protocol import CONTENTION_LIMIT

    work, out = Path(args.runs), Path(args.out)
    plans = []
    for spec_path in select_specs(args.sweeps):
        try:
            spec, runs, opts = _prepare(spec_path, args)
        except SweepError as err:
            raise ReproduceError(f"{spec_path.stem}: {err}") from None
        set_aside, kept, forced = [], [], {}
        for r in runs:
            here, collected = work / r.sweep / r.name, out / r.sweep / r.name
            where = here if _status(here) == "done" else collected if _status(collected) == "done" else None
            if where is None:
                continue
            why = over_budget(where, _budget_of(r.bindings))
            if why is not None:
                set_aside.append(f"{r.name} (over budget)")
                if act:
                    if where == collected and here.exists():
                        _set_aside(here, work, r.sweep, r.name, OVER_BUDGET_DIR)
                    _set_aside(where, work, r.sweep, r.name, OVER_BUDGET_DIR)
                    if collected.exists():
                        shutil.rmtree(collected)
                forced[r.name] = why
                continue
            cont = run_contention(where)
            if cont is None or cont <= CONTENTION_LIMIT or args.allow_contention:
                continue
            if _reruns(work, r.sweep, r.name) >= args.max_reruns:
                kept.append(f"{r.name} ({cont:.0%}, re-run {args.max_reruns}x already)")
                continue
            set_aside.append(f"{r.name} ({cont:.0%})")
            why = f"contention {cont:.0%} > {CONTENTION_LIMIT:.0%}: set aside and re-run"
            if act:
                if where == collected and here.exists():
                    _set_aside(here, work, r.sweep, r.name)  # a stale work copy goes too
                _set_aside(where, work, r.sweep, r.name)
                if collected.exists():  # the collected copy of the same logs: replaced after the re-run
                    shutil.rmtree(collected)
            forced[r.name] = why
        planned = plan(runs, work, retry_failed=args.retry_failed)
        for i, p in enumerate(planned):
            if p.run.name in forced:
                planned[i] = Planned(p.run, p.run_dir, "rerun", forced[p.run.name])
            elif not p.action.startswith("skip") and _status(out / p.run.sweep / p.run.name) == "done":
                planned[i] = Planned(p.run, p.run_dir, "skip-done", f"collected as done in {out}")
        plans.append(SweepPlan(spec, runs, opts, planned, set_aside, kept))
    return plans


def _print_plans(plans: Sequence[SweepPlan], args: argparse.Namespace, console) -> None:
    from rich.table import Table

    from analysis.runs import config_name

    for sp in plans:
        print_plan(sp.spec, sp.planned, Path(args.runs), args.scale, console)
    t = Table(title=f"scalerl reproduce --scale {args.scale}: {len(plans)} sweeps, seeds 0..{args.seeds - 1}")
    for col in ("sweep", "configs", "seeds", "runs", "to run", "skipped", "set aside and re-run"):
        t.add_column(col)
    total = todo = 0
    for sp in plans:
        configs = len({config_name(r.name) for r in sp.runs})
        t.add_row(sp.spec.name, str(configs), ",".join(str(s) for s in sp.spec.seeds), str(len(sp.runs)),
                  str(len(sp.todo)), str(len(sp.runs) - len(sp.todo)), ", ".join(sp.set_aside) or "-")
        total += len(sp.runs)
        todo += len(sp.todo)
    console.print(t)
    console.print(f"{total} runs, {todo} to run ({args.executor}); runs in {args.runs}, results in {args.out}")


# ----------------------------------------------------------------------------- running


def _wait(submitted: Sequence, deadline: float, console) -> dict[str, tuple[str, str]]:
    """Wait for the jobs (at most until `deadline`); {run: (outcome, error)}."""
    from submitit.local.debug import DebugJob

    if submitted and not isinstance(submitted[0][1], DebugJob):
        while True:
            pending = [p.run.name for p, job in submitted if not job.done()]
            if not pending:
                break
            if time.time() > deadline:
                raise ReproduceError(
                    f"--wait-hours passed with {len(pending)} run(s) still going: {', '.join(pending[:20])}"
                    f"{' ...' if len(pending) > 20 else ''}. Their jobs keep running; run `scalerl reproduce` "
                    "again later to collect them (done runs are skipped).")
            time.sleep(5.0)
    return wait(submitted, poll_s=1.0)


def _validate(sp: SweepPlan) -> dict:
    """validate_runs of one sweep: {run name: RunConfig}, or ReproduceError naming the sweep."""
    try:
        return validate_runs(sp.runs, sp.opts.target)
    except SweepError as err:
        raise ReproduceError(f"{sp.spec.name}: {err}") from None


def run_study(plans: list[SweepPlan], args: argparse.Namespace, console) -> dict[str, tuple[str, str]]:
    """Validate every sweep, then submit; local/debug sweeps run one after the other (a local
    executor must not start several sweeps' runs at once), Slurm arrays are all submitted and
    then waited for."""
    todo = [sp for sp in plans if sp.todo]
    configs = {sp.spec.name: _validate(sp) for sp in todo}
    if todo and args.executor == "slurm":
        try:
            check_partition(todo[0].opts.partition)
        except SweepError as err:
            raise ReproduceError(str(err)) from None
    deadline = time.time() + args.wait_hours * 3600.0
    outcomes: dict[str, tuple[str, str]] = {}
    pending: list = []  # (sweep, submitted): run names repeat across sweeps, so outcomes are per sweep
    for sp in todo:
        submitted = submit(sp.planned, sp.opts, Path(args.runs), sp.spec.name, configs=configs[sp.spec.name])
        console.print(f"{sp.spec.name}: submitted {len(submitted)} run(s) ({args.executor})")
        if args.executor == "slurm":
            pending.append((sp.spec.name, submitted))
        else:
            outcomes.update({f"{sp.spec.name}/{k}": v for k, v in _wait(submitted, deadline, console).items()})
    for sweep, submitted in pending:
        outcomes.update({f"{sweep}/{k}": v for k, v in _wait(submitted, deadline, console).items()})
    return outcomes


# ----------------------------------------------------------------------------- collecting


@dataclasses.dataclass
class CollectResult:
    runs: int
    bytes: int
    thin: int  # metrics.jsonl keeps every `thin`-th step line (1: all)
    missing: list[str]


def _thin_lines(text: str, every: int) -> str:
    """Every `every`-th line of metrics.jsonl, plus the line where epoch 1 ends and the last line."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if every <= 1 or len(lines) <= 2:
        return "\n".join(lines) + ("\n" if lines else "")
    keep, epoch_done = [], False
    for i, ln in enumerate(lines):
        take = i % every == 0 or i == len(lines) - 1
        if not epoch_done:
            try:
                e = json.loads(ln).get("epoch")
            except ValueError:
                e = None
            if isinstance(e, (int, float)) and e >= 1:
                epoch_done = take = True
        if take:
            keep.append(ln)
    return "\n".join(keep) + "\n"


def _thinned_every(out: Path) -> int:
    """How thinly the collected metrics.jsonl files under OUT were kept (the usual step gap between
    lines; 1: whole), read back from the files themselves (`--report-only` collects nothing)."""
    gaps: list[int] = []
    for f in sorted(Path(out).glob("*/*/metrics.jsonl"))[:20]:
        steps = []
        for ln in f.read_text(encoding="utf-8", errors="replace").splitlines()[:50]:
            try:
                steps.append(int(json.loads(ln)["step"]))
            except (ValueError, KeyError, TypeError):
                continue
        gaps += [b - a for a, b in zip(steps, steps[1:]) if b > a]
    return max(set(gaps), key=gaps.count) if gaps else 1


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def collect(work: Path, out: Path, plans: Sequence[SweepPlan], *, max_mb: float, thin: str | int = "auto",
            reserve_mb: float = 8.0, accept=None) -> CollectResult:
    """Copy the four log files of every planned run from WORK into OUT/<sweep>/<run>/.

    thin: 1 keeps metrics.jsonl whole; N keeps every N-th line; "auto" picks the smallest N that
    keeps OUT (logs, plus `reserve_mb` for the figures and the report) under `max_mb`.
    accept: run_dir -> bool, which runs with logs to take (default: all); the others count as missing.
    """
    pairs, missing = [], []
    for sp in plans:
        for r in sp.runs:
            src, dst = work / r.sweep / r.name, out / r.sweep / r.name
            if (src / "run.json").is_file() and (accept is None or accept(src)):
                pairs.append((src, dst))
            elif not (dst / "run.json").is_file():
                missing.append(f"{r.sweep}/{r.name}")
    size = lambda p: p.stat().st_size if p.is_file() else 0  # noqa: E731
    other = sum(size(s / f) for s, _ in pairs for f in COLLECTED_FILES if f != "metrics.jsonl")
    metrics = sum(size(s / "metrics.jsonl") for s, _ in pairs)
    kept_elsewhere = sum(_dir_bytes(out / sp.spec.name) for sp in plans if (out / sp.spec.name).is_dir()) - sum(
        sum(size(d / f) for f in COLLECTED_FILES) for _, d in pairs)
    budget = max_mb * 1e6 - reserve_mb * 1e6 - other - max(kept_elsewhere, 0)
    if thin == "auto":
        n = 1 if metrics <= budget else (math.ceil(metrics / budget) if budget > 0 else 0)
        if n == 0:
            raise ReproduceError(f"the logs without metrics.jsonl already take {other / 1e6:.1f} MB of the "
                                 f"{max_mb} MB budget; nothing to thin")
    else:
        n = max(int(thin), 1)
    for src, dst in pairs:
        dst.mkdir(parents=True, exist_ok=True)
        for name in COLLECTED_FILES:
            f = src / name
            if not f.is_file():
                continue
            if name == "metrics.jsonl" and n > 1:
                (dst / name).write_text(_thin_lines(f.read_text(encoding="utf-8", errors="replace"), n))
            else:
                shutil.copyfile(f, dst / name)
    total = sum(_dir_bytes(out / sp.spec.name) for sp in plans if (out / sp.spec.name).is_dir())
    return CollectResult(len(pairs), total, n, missing)


# ----------------------------------------------------------------------------- the report


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


RUN_TIME_LIMIT_S = 180.0  # each tiny run finishes within 3 minutes on 2 cores
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
        info, last = read_json(info_path) or {}, _last_metrics(run_dir)
        if info.get("status") != "done" or not last:
            continue
        own = sum(float(last.get(k) or 0.0) for k in ("wall_s", "eval_wall_s", "startup_s"))
        try:
            span = (_dt.datetime.fromisoformat(info["finished"]) - _dt.datetime.fromisoformat(info["started"])).total_seconds()
        except (KeyError, TypeError, ValueError):
            span = float("nan")
        cfg = (run_dir / "config.gin").read_text().splitlines() if (run_dir / "config.gin").is_file() else []
        budget = _logged_budget(run_dir)
        total = [ln.partition("=")[2].strip() for ln in cfg if ln.strip().startswith("train.total_steps")]
        stopped = budget is not None and bool(total) and total[-1].isdigit() and int(last.get("step", 0)) < int(total[-1])
        rows.append({"run": f"{run_dir.parent.name}/{run_dir.name}", "own_s": own, "span_s": span,
                     "resumed": math.isfinite(span) and span - own > _RESUMED_GAP_S, "budget": budget,
                     "stopped_on_budget": stopped, "steps": int(last.get("step", 0)),
                     "compute_hours": last.get("compute_hours")})
    return rows


def _run_time_text(rows: list[dict]) -> str:
    import statistics

    if not rows:
        return "no finished runs"
    own = [r["own_s"] for r in rows]
    straight = [r["span_s"] for r in rows if not r["resumed"] and math.isfinite(r["span_s"])]
    over = [r for r in rows if (r["span_s"] if not r["resumed"] else r["own_s"]) > RUN_TIME_LIMIT_S]
    budgets = {r["budget"] for r in rows if r["budget"] is not None}
    stopped = [r for r in rows if r["stopped_on_budget"]]
    without = [r for r in rows if r["budget"] is None]
    txt = (f"{len(stopped)} run(s) stopped on the budget before their last step"
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
    txt += (f". Over {RUN_TIME_LIMIT_S:.0f} s: " + (", ".join(f"{r['run']} ({r['span_s'] if not r['resumed'] else r['own_s']:.0f} s)"
                                                     for r in over) if over else "none") + ".")
    return txt


PREDICT_BOOT = 100  # bootstrap resamples behind each prediction interval of the report


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


def _paired_noise(summaries: dict) -> tuple[float, float] | None:
    """(median sd of per-seed differences of `tail`, median sd of `tail` across seeds) over the
    pairs of configurations sharing >= 2 seeds: what pairing by seed buys, in numbers."""
    import numpy as np

    paired, unpaired = [], []
    for s in summaries.values():
        t = s.runs.pivot_table(index="seed", columns="config", values="tail", aggfunc="first")
        for c in t.columns:
            if t[c].notna().sum() >= 2:
                unpaired.append(float(t[c].std(ddof=1)))
        cols = list(t.columns)
        for i in range(len(cols)):
            for j in range(i + 1, len(cols)):
                d = (t[cols[i]] - t[cols[j]]).dropna()
                if len(d) >= 2:
                    paired.append(float(d.std(ddof=1)) / math.sqrt(2.0))
    if not paired or not unpaired:
        return None
    return float(np.median(paired)), float(np.median(unpaired))


def write_report(out: str | Path, *, figures: tuple[dict, dict, dict] | None = None,
                 collected: CollectResult | None = None, scale: str = "tiny", command: str = "",
                 kept_contended: Sequence[str] = (), predict_boot: int = PREDICT_BOOT) -> Path:
    """Write OUT/REPORT.md (and OUT/report/*.csv) from the runs under OUT."""
    import pandas as pd

    from analysis.findings import FINDINGS, NOT_AT_TINY_SCALE
    from analysis.protocol import CONTENTION_LIMIT, PROTOCOLS
    from analysis.study import SEED_SWEEP

    out = Path(out)
    summaries, pred = report_tables(out, predict_boot=predict_boot)
    if not summaries:
        raise ReproduceError(f"no runs under {out}: nothing to report")
    tables = out / TABLES_DIR
    tables.mkdir(parents=True, exist_ok=True)
    configs = pd.concat([s.configs for s in summaries.values()], ignore_index=True)
    claims = pd.concat([s.claims for s in summaries.values() if len(s.claims)], ignore_index=True) \
        if any(len(s.claims) for s in summaries.values()) else pd.DataFrame(columns=["claim_id", "verdict"])
    runs = pd.concat([s.runs.drop(columns=["fit"]) for s in summaries.values()], ignore_index=True)
    reasons_path = out / REASONS_FILE
    reasons = _load_reasons(reasons_path)
    disagreeing = claims.loc[(claims["verdict_A"] == "disagree") | (claims["verdict_tail"] == "disagree"),
                             "claim_id"].tolist()
    _append_reason_ids(reasons_path, disagreeing, reasons)
    claims = claims.assign(reason=[reasons.get(i, "") for i in claims["claim_id"]])
    configs.to_csv(tables / "configs.csv", index=False)
    claims.to_csv(tables / "claims.csv", index=False)
    runs.to_csv(tables / "runs.csv", index=False)
    pairs = pd.DataFrame([p.as_row() for sm in summaries.values() for p in sm.pairs])
    pairs.to_csv(tables / "pairs.csv", index=False)
    if pred is not None:
        pred.drop(columns=[c for c in ("fit",) if c in pred]).to_csv(tables / "predictions.csv", index=False)

    n_runs = len(runs)
    seeds = runs.groupby(["sweep", "config"])["seed"].nunique()
    counts = {m: claims[f"verdict_{m}"].value_counts() for m in ("A", "tail")}
    L: list[str] = []
    w = L.append
    w(f"# ScaleRL ablations at {scale} scale: the study, its figures and our verdicts\n")
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    w(f"Generated {stamp} by `{command or f'scalerl reproduce --scale {scale}'}` from `{out}`: "
      f"{n_runs} runs in {len(summaries)} sweeps, {int(seeds.median()) if len(seeds) else 0} seeds per configuration "
      f"(min {int(seeds.min()) if len(seeds) else 0}). Re-generate this file with `scalerl reproduce --scale {scale} "
      f"--report-only`; the numbers of a sweep are printed by `scalerl fit {out}/<sweep>` (same code: "
      "`analysis.study.summarize`; every pair: `scalerl compare " + str(out) + "`). Tables: `report/configs.csv`, "
      "`report/claims.csv`, `report/runs.csv` (with `A_identified`), `report/pairs.csv`, `report/predictions.csv`.\n")
    shipped = [p.stem for p in select_specs(None)]
    absent = [n for n in shipped if n not in summaries]
    unfinished_runs = list(collected.missing) if collected is not None else []
    if absent or unfinished_runs:
        w("## Study progress\n")
        w(f"**Part-way**: {len(shipped) - len(absent)} of {len(shipped)} shipped sweeps have runs here."
          + (f" Not run yet: {', '.join(f'`{n}`' for n in absent)}." if absent else "")
          + (f" Runs of the selected sweeps not finished yet ({len(unfinished_runs)}): "
             + ", ".join(unfinished_runs[:30]) + (" ..." if len(unfinished_runs) > 30 else "") + "."
             if unfinished_runs else "")
          + f" `scalerl reproduce --scale {scale} --executor slurm --seeds 3` goes on from here (done runs are "
          "skipped).\n")
    w("## Verdicts\n")
    w("Each claim of the paper is judged twice: on the law's asymptote **A** (counted only where every run's A is "
      "identified) and on **tail**, the measured mean held-out pass rate over the last 20% of the sweep's common "
      "compute window.\n")
    w("| verdict | on A | on tail |\n|---|---|---|")
    for v in ("agree", "disagree", "inconclusive", "not run"):
        w(f"| {v} | {int(counts['A'].get(v, 0))} | {int(counts['tail'].get(v, 0))} |")
    w("")
    n_fit = int(runs["A"].notna().sum())
    n_ident = int(runs["A_identified"].fillna(False).astype(bool).sum()) if "A_identified" in runs else 0
    widths = runs["A_profile_width"].dropna() if "A_profile_width" in runs else pd.Series(dtype=float)
    at_cap = int(runs["A_at_cap"].fillna(False).astype(bool).sum()) if "A_at_cap" in runs else 0
    pair_counts = pairs["verdict"].groupby(pairs["metric"]).value_counts() if len(pairs) else None
    noise = _paired_noise(summaries)
    w("## What this study can and cannot tell\n")
    w(f"- **A is identified in {n_ident} of {n_fit} fitted runs** (95% profile interval at most 0.1 wide"
      + (f"; median width {widths.median():.2f}, {at_cap} intervals reach the 1.0 cap" if len(widths) else "")
      + "). Where it is not, every A comparison reads `inconclusive (A not identified: run longer)`: the runs "
      "stop while still climbing, so the asymptote is an extrapolation the data cannot pin down.")
    if pair_counts is not None:
        for m in ("A", "tail"):
            if m in pair_counts.index.get_level_values(0):
                c = pair_counts[m]
                w(f"- Every pair of configurations on **{m}**: " + ", ".join(
                    f"{v} {int(c.get(v, 0))}" for v in ("better", "worse", "equivalent", "inconclusive")) + ".")
    if noise is not None:
        w(f"- Pairing by seed: the per-seed difference of `tail` between two configurations has a median sd of "
          f"{noise[0]:.3f} (per configuration), against {noise[1]:.3f} for `tail` across seeds unpaired: a seed fixes "
          "the data split, warm start and prompt order, and comparing seed by seed removes that shared variance.")
    w("- `equivalent` needs the two one-sided tests to put the difference inside ±0.02: with 3 seeds that takes a "
      "paired sd of the difference below about 0.01. 'Not shown different' is `inconclusive`, never `agree`.")
    w("")
    renamed = runs[runs["paper_config"].fillna(runs["config"]) != runs["config"]] if "paper_config" in runs else runs.iloc[0:0]
    if len(renamed):
        w("## Names: what ran, and what the paper called it\n")
        w("At tiny scale a run's name says the value that ran; the paper's name is in run.json's `paper_name` and "
          "in the claims below.\n")
        w("| sweep | ran (run name) | the paper's |\n|---|---|---|")
        for (sw, cfg, pc) in sorted({(r.sweep, r.config, r.paper_config) for r in renamed.itertuples()}):
            w(f"| {sw} | {cfg} | {pc} |")
        w("")
    w("## How the numbers are made\n")
    w("- **Compute axis**: " + ", ".join(sorted({sm.compute for sm in summaries.values()})) + " (`--compute auto`: "
      "FLOPs at tiny scale, where identical runs differ by a median 3.7% in wall-clock compute but 0.2% in FLOPs; "
      "device-hours otherwise). Every run of a sweep is compared over the sweep's **common compute window**, cut at "
      "the smallest final compute among its runs.")
    w("- **Fit protocol** (docs/PAPER.md §1; per figure in `analysis/figure_specs.py`): "
      + "; ".join(f"`{p.name}`: {p.range_text()} ({p.paper.split(':')[0]})" for p in PROTOCOLS.values()) + ". "
      "Where a fit starts is where the paper starts it (its first ~1.5k GPU-h, about one epoch, are skipped): "
      "a whole-run fit at the **end of the first epoch**, a first-half fit at the **paper's cutoff as the same "
      "fraction of the fitted range** (analysis/protocol.py). R0 = the run's first evaluation.")
    w("- **A identified**: each run's 95% profile-likelihood interval of A (B and C_mid refitted at each A; "
      "SSE(A) <= SSE_min·(1 + F(0.95; 1, n−3)/(n−3)); A <= 1 for a pass rate) must be at most 0.1 wide; an "
      "interval that ends at the cap is fine when narrow.")
    w("- **Comparisons** (`analysis/compare.py`, the same function behind `scalerl compare`, `scalerl fit` and the "
      "figures): configurations that share seeds are compared on per-seed differences (paired t interval, mean Δ ± "
      "t(0.975, n−1)·sd(Δ)/√n), otherwise by Welch's interval. Verdicts: `better` / `worse` when the 95% interval "
      "excludes 0, `equivalent` when the two one-sided tests (statsmodels TOST, α = 0.05) put it inside ±0.02, else "
      "`inconclusive`.")
    w("- **Claims**: 'A(a) > A(b)' agrees on `better` and disagrees on `worse`; 'A(a) ≈ A(b)' agrees only on "
      "`equivalent`; 'a better than b' agrees on `better` (on A, an `equivalent` A goes to B and ln C_mid at the "
      "common A, each with its own paired interval); 'not worse' agrees on `better` or `equivalent`; anything "
      "else is `inconclusive`. Claims about runs that do not exist (or could not be fitted) are 'not run'.")
    w("- **Ours per configuration**: the mean over seeds with its 95% t-interval, inside [0, 1] for A and tail; "
      "C_mid is the geometric mean. `rank` orders configurations by the paper's own rule (A within a margin "
      "measured from the seeds, then B); it decides no verdict.")
    w(f"- **Contention**: a run whose CPUs other work used more than {CONTENTION_LIMIT:.0%} of the time (`contention_run`, "
      "from /proc/stat) had "
      "its compute axis stretched by a neighbour: `scalerl reproduce` re-runs it (unless --allow-contention); any "
      "left are listed below, marked in the tables and drawn faded in the figures.")
    w("- **Compute budget and run time**: at tiny scale every run trains to the same compute, "
      "`train.compute_budget_flops` (experiments/launch.py `TINY_SCALE_BINDINGS`; the budget is the stopping rule, "
      "`train.total_steps` only a safety cap), as every forward ablation of the paper gets 3.5-4k GPU-h. Runs "
      "collected before it existed (under a wall-clock budget, or at a fixed step count) end at different "
      "compute; every comparison above holds compute equal by cutting the sweep at its common window. A run "
      "trained past the budget without it is re-run under it by `scalerl reproduce`. " + _run_time_text(run_times(out)))
    thin = collected.thin if collected is not None else _thinned_every(out)
    if thin > 1:
        w(f"- **Collected logs**: metrics.jsonl keeps every {thin}-th step line (plus the line where "
          "epoch 1 ends and the last line) to keep the folder under its size budget; eval.jsonl is whole.")
    w("")

    w("## Ablations\n")
    order = [s for s in FINDINGS if s in summaries] + sorted(s for s in summaries if s not in FINDINGS)
    verdict_rows = []
    for sweep in order:
        s = summaries[sweep]
        f = FINDINGS.get(sweep)
        w(f"### {f.figure + ': ' + f.title if f else sweep} (`{sweep}`)\n")
        if f:
            w(f"**Paper:** {f.paper}\n")
        rules = s.runs["min_compute_rule"].fillna("").map(lambda x: x.split(" (")[0]).value_counts()
        w(f"**Fit:** {s.protocol.range_text()} ({s.protocol.name} protocol); fit start: "
          + ", ".join(f"{k} ({n} runs)" for k, n in rules.items() if k) + f". **Margin on A:** {s.margin.describe()}.\n")
        w(f"**Compute axis:** {s.compute}; common window ends at {s.tail_end:.4g} (tail = its last 20%).\n")
        w("| config (ran) | paper's name | seeds fitted | A identified | A [95% CI] | B [95% CI] | C_mid | "
          "tail [95% CI] | rank | contended |")
        w("|---|---|---|---|---|---|---|---|---|---|")
        for r in s.configs.sort_values(["rank", "config"], na_position="last").itertuples():
            w(f"| {r.config} | {r.paper_config if r.paper_config != r.config else '—'} | {r.n_fitted}/{r.n_runs} | "
              f"{r.n_identified}/{r.n_fitted} | {_ci(r.A, r.A_lo, r.A_hi, '.3f')} | "
              f"{_ci(r.B, r.B_lo, r.B_hi, '.2f')} | {_fmt(r.C_mid, '.3g')} | {_ci(r.tail, r.tail_lo, r.tail_hi, '.3f')} | "
              f"{_fmt(r.rank, '.0f')} | {r.contended_runs or '—'} |")
        errs = s.runs[s.runs["fit_error"].fillna("") != ""]
        unfinished = s.runs[s.runs["status"].fillna("unknown") != "done"]
        if len(errs) or len(unfinished):
            w("")
            for r in unfinished.itertuples():
                w(f"- status {r.status}: {r.run} (its logged part is fitted like the others)")
            for r in errs.itertuples():
                w(f"- not fitted: {r.run}: {_md_escape(r.fit_error)[:200]}")
        w("")
        if len(s.claims):
            w("| claim | paper | ours on A | verdict on A | ours on tail | verdict on tail | reason (reasons.yaml) |")
            w("|---|---|---|---|---|---|---|")
            for c in s.claims.itertuples():
                reason = reasons.get(c.claim_id, "")
                if "disagree" in (c.verdict_A, c.verdict_tail) and not reason:
                    reason = f"_to fill: `{c.claim_id}`_"
                w(f"| {_md_escape(c.claim)} | {_md_escape(c.paper or '—')} | {_md_escape(c.ours_A)} | "
                  f"**{c.verdict_A}**{_md_escape(_why(c.why_A))} | {_md_escape(c.ours_tail)} | "
                  f"**{c.verdict_tail}**{_md_escape(_why(c.why_tail))} | {_md_escape(reason) or '—'} |")
                verdict_rows.append((sweep, f.figure if f else "", c))
            w("")

    w("## All verdicts\n")
    w("| ablation | figure | claim | on A | on tail | reason |")
    w("|---|---|---|---|---|---|")
    for sweep, fig, c in verdict_rows:
        reason = reasons.get(c.claim_id, "")
        dis = "disagree" in (c.verdict_A, c.verdict_tail)
        w(f"| {sweep} | {fig} | {_md_escape(c.claim)} | {c.verdict_A} | {c.verdict_tail} | "
          f"{_md_escape(reason) or ('_to fill_' if dis else '—')} |")
    w("")

    w("## Predicting the end from the first half\n")
    if pred is not None and "prediction_error" in pred and pred["prediction_error"].notna().any():
        p = pred.dropna(subset=["prediction_error"]).copy()
        p["abs_error"] = p["prediction_error"].abs()
        p["baseline_abs"] = p["baseline_error"].abs()
        sig_med, base_med = p["abs_error"].median(), p["baseline_abs"].median()
        beats = float((p["abs_error"] < p["baseline_abs"]).mean())
        cov = p["covered"].dropna().astype(bool) if "covered" in p else pd.Series(dtype=bool)
        w(f"Every run fitted on its first 50% of compute ({summaries and next(iter(summaries.values())).compute} axis; "
          "from the paper's start, its protocol's fraction of that half), its final pass rate predicted and compared "
          f"with the observed one (`scalerl fit {out}/<sweep> --fraction 0.5`); beside it a straight line in log C "
          f"fitted on the same points. {len(p)} of {len(pred)} runs predicted.\n")
        w("| predictor | median abs. error | mean error (bias) | worst abs. error | beats the other |")
        w("|---|---|---|---|---|")
        w(f"| sigmoid (the law) | {sig_med:.3f} | {p['prediction_error'].mean():+.3f} | {p['abs_error'].max():.3f} | "
          f"{beats:.0%} of runs |")
        w(f"| log-linear baseline | {base_med:.3f} | {p['baseline_error'].mean():+.3f} | {p['baseline_abs'].max():.3f} | "
          f"{1 - beats:.0%} of runs |")
        w("")
        if len(cov):
            w(f"The sigmoid's 95% prediction interval (bootstrap over the fitted points, {PREDICT_BOOT} resamples, "
              f"plus a resampled residual for the end's own evaluation noise) covers the observed end in "
              f"**{cov.mean():.0%}** of {len(cov)} runs (nominal 95%).\n")
        if base_med < sig_med:
            w(f"**At this scale the sigmoid loses to the log-linear baseline** (median |error| {sig_med:.3f} against "
              f"{base_med:.3f}): the first half of a tiny run does not pin down the curve's bend, and the law's "
              "extrapolation is worse than a straight line in log compute.\n")
        else:
            w(f"The sigmoid beats the log-linear baseline (median |error| {sig_med:.3f} against {base_med:.3f}).\n")
        w("| sweep | run | fitted to | predicted end [95% PI] | log-linear | observed end | error | covered |")
        w("|---|---|---|---|---|---|---|---|")
        for r in p.sort_values(["sweep", "run"]).itertuples():
            pi = (f" [{r.predicted_low:.3f}, {r.predicted_high:.3f}]" if hasattr(r, "predicted_low")
                  and pd.notna(r.predicted_low) else "")
            cv = ("yes" if r.covered else "no") if hasattr(r, "covered") and pd.notna(r.covered) else "—"
            w(f"| {r.sweep} | {r.run} | {_fmt(r.fit_cutoff, '.4g')} | {r.predicted_final:.3f}{pi} | "
              f"{r.baseline_final:.3f} | {r.observed_final:.3f} | {r.prediction_error:+.3f} | {cv} |")
        nofit = pred[pred["prediction_error"].isna()]
        if len(nofit):
            w("")
            w(f"Not predicted ({len(nofit)}): " + "; ".join(
                f"{r.sweep}/{r.run}: {_md_escape(r.fit_error)[:120]}" for r in nofit.itertuples()))
    else:
        w("No run could be fitted on its first half.")
    w("")

    w("## Contention\n")
    cont = runs[runs["contended"].fillna(False).astype(bool)]
    if len(cont):
        w(f"{len(cont)} run(s) with contention above {CONTENTION_LIMIT:.0%} remain (their compute axis is stretched; "
          "kept in the fits and marked):\n")
        for r in cont.itertuples():
            w(f"- {r.sweep}/{r.run}: {r.contention_run:.1%}")
    else:
        measured = runs["contention_run"].notna().sum()
        w(f"No run above {CONTENTION_LIMIT:.0%} ({measured} of {n_runs} runs log `contention_run`"
          + (f"; highest {runs['contention_run'].max():.1%}" if measured else "") + ").")
    for k in kept_contended:
        w(f"- kept after the maximum number of re-runs: {k}")
    w("")

    w("## Figures\n")
    written, missing, failed = figures if figures is not None else ({}, {}, {})
    if written:
        for fig_id in written:
            w(f"![{fig_id}]({FIGURES_DIR}/{fig_id}.png)")
        w("")
    not_here = {k: v for k, v in NOT_AT_TINY_SCALE.items() if k.split(" ")[0] not in written}
    if scale == "tiny" and not_here:
        w("### Not drawable at tiny scale\n")
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
    path = out / REPORT_FILE
    path.write_text("\n".join(L) + "\n", encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scale", choices=("tiny", "paper"), default="tiny",
                        help="tiny: every sweep mapped onto the CPU setting (default); paper: the paper's recipes")
    parser.add_argument("--executor", choices=("slurm", "local", "debug"), default="slurm",
                        help="slurm (default): one job array per sweep; local: subprocesses here, one sweep at a "
                             "time; debug: in this process")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 for every configuration (default 3)")
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
                        help="keep done runs whose CPU contention exceeded 10%% (default: set aside and re-run)")
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

    written, missing, failed = render_all(out, out / FIGURES_DIR, Options(compute="auto", formats=("png",), dpi=110))
    for fig_id, err in failed.items():
        console.print(f"[red]figure {fig_id} failed:[/red] {err}", highlight=False)
    console.print(f"figures: {len(written)} drawn, {len(missing)} missing, {len(failed)} failed -> {out / FIGURES_DIR}")
    return written, missing, failed


def _collect_finished(args: argparse.Namespace, console):
    """`--collect-only`: copy the runs that are done and uncontended (a study part-way through, or
    runs still queued), submitting nothing; the others stay out of OUT until a later collect."""
    from analysis.protocol import CONTENTION_LIMIT

    def finished(run_dir: Path) -> bool:
        if _status(run_dir) != "done":
            return False
        cont = run_contention(run_dir)
        return args.allow_contention or cont is None or cont <= CONTENTION_LIMIT

    plans = plan_study(args, console, act=False)
    thin = "auto" if str(args.thin_metrics) == "auto" else int(args.thin_metrics)
    collected = collect(args.runs, args.out, plans, max_mb=args.max_mb, thin=thin, accept=finished)
    console.print(f"collected {collected.runs} finished runs into {args.out}; {len(collected.missing)} not finished "
                  "(or contended) yet", highlight=False)
    return collected


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console() if Console().is_terminal else Console(width=160)
    command = "scalerl reproduce " + " ".join(
        x for x in (f"--scale {args.scale}", f"--executor {args.executor}", f"--seeds {args.seeds}") if x)
    try:
        _check_args(args)
        collected, kept = None, []
        if args.collect_only:
            collected = _collect_finished(args, console)
        elif not args.report_only:
            plans = plan_study(args, console, act=not args.dry_run)
            _print_plans(plans, args, console)
            if args.dry_run:
                for sp in plans:
                    if sp.todo:
                        _validate(sp)
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
                              predict_boot=args.predict_boot,
                              kept_contended=kept)
        total = _dir_bytes(args.out)
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
