"""Running and collecting a reproduction study (`scalerl reproduce`, steps 1-4 of its docstring):
plan every sweep x configuration x seed with `scalerl sweep`'s own functions, submit and wait with
deadlines, set contended or over-budget runs aside to run again, and collect the finished runs'
logs into OUT (thinned to fit its size budget). The report is `experiments/study_report.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import time
from pathlib import Path
from typing import Sequence

from analysis.meters import METERS_FILE  # beside a thinned metrics.jsonl: the meters of its whole log
from experiments.recipes import SWEEPS_DIR, SweepError
from experiments.run_config import validate_runs
from experiments.run_state import Planned, plan, read_json
from experiments.slurm import check_partition
from experiments.submission import LaunchOptions, submit, wait
from experiments.sweep_cli import options_from_args, print_plan
from experiments.sweep_spec import RunSpec, SweepSpec, load_spec, select_runs
from experiments.sweep_spec import budget_of as _budget_of  # the tiny scale's stopping rule

__all__ = ["ReproduceError", "SweepPlan", "CollectResult", "select_specs", "plan_study", "run_study",
           "collect", "over_budget", "judge_contention", "COLLECTED_FILES", "METERS_FILE", "settings_key", "share_identical",
           "materialize_shared", "SHARED_ACTION", "SHARED_KEY"]

COLLECTED_FILES = ("config.gin", "run.json", "metrics.jsonl", "eval.jsonl")
CONTENDED_DIR = ".contended"
OVER_BUDGET_DIR = ".over_budget"


class ReproduceError(RuntimeError):
    """A bad option or a step that cannot go on; the message says what to do."""


# ----------------------------------------------------------------------------- sweeps and plans


def select_specs(names: str | Sequence[str] | None) -> list[Path]:
    """The shipped paper ablations (experiments/sweeps/*.gin but those with ``sweep.paper_ablation =
    False``), or the named shipped specs (any of them)."""
    shipped = {p.stem: p for p in sorted(SWEEPS_DIR.glob("*.gin"))}
    if names is None:
        return [p for p in shipped.values() if load_spec(p).paper_ablation]
    wanted = [n.strip() for n in (names.split(",") if isinstance(names, str) else names) if n.strip()]
    unknown = [n for n in wanted if n not in shipped]
    if unknown:
        raise ReproduceError(f"unknown sweep(s) {', '.join(unknown)}; shipped sweeps: {', '.join(shipped)}")
    if not wanted:
        raise ReproduceError("--sweeps names no sweep")
    return [shipped[n] for n in wanted]


def _prepare(spec: Path, args: argparse.Namespace) -> tuple[SweepSpec, list[RunSpec], LaunchOptions]:
    """The spec, its runs with seeds 0..N-1, and the launch options `scalerl sweep SPEC` would get."""
    seeds = dict(getattr(args, "seeds_for", ()) or ()).get(Path(spec).stem, args.seeds)
    spec, runs = select_runs(spec, args.scale, seeds=range(seeds), extra_bindings=getattr(args, "gin", ()) or ())
    return spec, runs, options_from_args(args)


def _selected_sweeps(args: argparse.Namespace):
    """(spec, runs, launch options) of every sweep `--sweeps` selects (`_prepare`); a bad spec is a
    ReproduceError naming it."""
    for spec_path in select_specs(args.sweeps):
        try:
            yield _prepare(spec_path, args)
        except SweepError as err:
            raise ReproduceError(f"{spec_path.stem}: {err}") from None


def not_in_results(args: argparse.Namespace) -> list[str]:
    """`<sweep>/<run>` of every run the selected sweeps expand to (`--scale`, `--seeds`, `--seeds-for`)
    that has no run.json under OUT: what a report regenerated from OUT alone (`--report-only`) still
    lacks, so that it never calls a part-way study complete."""
    out = Path(args.out)
    return [f"{r.sweep}/{r.name}" for _spec, runs, _opts in _selected_sweeps(args) for r in runs
            if not (out / r.sweep / r.name / "run.json").is_file()]


@dataclasses.dataclass
class SweepPlan:
    spec: SweepSpec
    runs: list[RunSpec]
    opts: LaunchOptions
    planned: list[Planned]
    set_aside: list[str] = dataclasses.field(default_factory=list)  # contended runs moved away (to re-run)
    kept_contended: list[str] = dataclasses.field(default_factory=list)
    shared: dict = dataclasses.field(default_factory=dict)  # run name -> (sweep, run) it is identical to

    @property
    def todo(self) -> list:
        return [p for p in self.planned if not p.action.startswith("skip")]


SHARED_ACTION = "skip-shared"
SHARED_KEY = "shared_with"  # run.json of a shared run: "<sweep>/<run>" whose logs it is


def settings_key(run: RunSpec) -> str:
    """A digest of every setting a run makes (`recipes.resolved_bindings`: its files, following their
    includes, and its bindings, the last of each winning), less the bindings that state their
    parameter's default (`train.mismatch_correction = "none"` is the run that leaves it unbound): two
    runs with the same key train the same configuration with the same seed."""
    import hashlib

    from experiments.recipes import resolved_bindings
    from experiments.run_config import load_trainer_configurables

    load_trainer_configurables()  # `train`, `model`, `data` and the registries' configurables, whose defaults count
    settings = {k: v for k, v in resolved_bindings(run.config_files, run.bindings).items()
                if not _states_default(k, v)}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def _states_default(key: str, value: str) -> bool:
    """Whether the resolved binding `key = value` (gin text, `resolved_bindings`) binds an unscoped
    parameter to the default its configurable declares."""
    from experiments.recipes import gin_literal
    from components.trainer.gin_config import configurable_defaults

    if key.startswith("import ") or "/" in key or "." not in key:
        return False
    selector, _, param = key.rpartition(".")
    try:
        defaults = configurable_defaults(selector)
    except ValueError:  # an ambiguous selector: keep the binding
        return False
    if param not in defaults:
        return False
    try:
        return gin_literal(defaults[param]) == value
    except SweepError:  # a default gin cannot write (a callable): never equal to a binding's text
        return False


def share_identical(plans: Sequence[SweepPlan]) -> int:
    """A configuration identical to one in an earlier sweep of the study (same resolved settings and
    seed: the baseline appears in most sweeps) runs once: the later ones are planned as
    `skip-shared` and take the first one's logs once it has ended (`materialize_shared`). Returns how
    many runs are shared."""
    first: dict[str, tuple[str, str]] = {}
    n = 0
    for sp in plans:
        for i, p in enumerate(sp.planned):
            key = settings_key(p.run)
            if key not in first:
                first[key] = (p.run.sweep, p.run.name)
                continue
            sp.shared[p.run.name] = first[key]
            if not p.action.startswith("skip"):
                src = "/".join(first[key])
                sp.planned[i] = Planned(p.run, p.run_dir, SHARED_ACTION, f"identical to {src}: runs once, shared")
                n += 1
    return n


def materialize_shared(plans: Sequence[SweepPlan], work: Path) -> list[str]:
    """Give every shared run whose source has ended the source's logs (COLLECTED_FILES) under its own
    name and sweep; run.json records `shared_with`. Returns the runs filled in."""
    filled = []
    for sp in plans:
        for p in sp.planned:
            if p.action != SHARED_ACTION:
                continue
            src_sweep, src_name = sp.shared[p.run.name]
            src = Path(work) / src_sweep / src_name
            if not run_ended(src):
                continue
            dest = Path(p.run_dir)
            dest.mkdir(parents=True, exist_ok=True)
            for f in COLLECTED_FILES:
                if (src / f).is_file() and f != "run.json":
                    shutil.copyfile(src / f, dest / f)
            info = read_json(src / "run.json") or {}
            info.update(p.run.run_info())
            info.pop("paper_name", None) if not p.run.paper_name else None
            info[SHARED_KEY] = f"{src_sweep}/{src_name}"
            (dest / "run.json").write_text(json.dumps(info, indent=2, sort_keys=True))
            filled.append(f"{p.run.sweep}/{p.run.name}")
    return filled

def last_metrics(run_dir: Path) -> dict:
    from analysis.runs import read_jsonl

    rows, _ = read_jsonl(Path(run_dir) / "metrics.jsonl")
    return rows[-1] if rows else {}


def run_ended(run_dir: Path) -> bool:
    """The run ran to its end: done, or ended by a prompt pool that ran out
    (`analysis.runs.run_finished`); its logs are a whole run, to check and collect."""
    from analysis.runs import run_finished

    info = read_json(Path(run_dir) / "run.json") or {}
    return run_finished(info.get("status"), info.get("error"))


def judge_contention(run_dir: Path) -> tuple[float | None, bool]:
    """A done run's `contention_run` and whether it is contended (`analysis.protocol.is_contended`:
    other work used its CPUs AND its threads waited for one)."""
    from analysis.protocol import is_contended
    from analysis.runs import read_jsonl, run_runq

    rows, _ = read_jsonl(Path(run_dir) / "metrics.jsonl")
    x = rows[-1].get("contention_run") if rows else None
    cont = float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None
    return cont, is_contended(cont, run_runq(rows))


def logged_budget(run_dir: Path) -> float | None:
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
    if logged_budget(run_dir) == budget:
        return None
    used = last_metrics(run_dir).get("flops")
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
    for spec, runs, opts in _selected_sweeps(args):
        set_aside, kept, forced = [], [], {}
        for r in runs:
            here, collected = work / r.sweep / r.name, out / r.sweep / r.name
            where = here if run_ended(here) else collected if run_ended(collected) else None
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
            cont, contended = judge_contention(where)
            if not contended or args.allow_contention:
                continue
            if _reruns(work, r.sweep, r.name) >= args.max_reruns:
                kept.append(f"{r.name} ({cont:.0%}, re-run {args.max_reruns}x already)")
                continue
            set_aside.append(f"{r.name} ({cont:.0%})")
            why = f"contention {cont:.0%} > {CONTENTION_LIMIT:.0%} (and its threads waited): set aside and re-run"
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
            elif not p.action.startswith("skip") and run_ended(out / p.run.sweep / p.run.name):
                planned[i] = Planned(p.run, p.run_dir, "skip-done", f"collected as ended in {out}")
        plans.append(SweepPlan(spec, runs, opts, planned, set_aside, kept))
    if getattr(args, "share", True):
        share_identical(plans)
        if act:
            materialize_shared(plans, work)  # sources that ended in an earlier invocation
    return plans


def print_plans(plans: Sequence[SweepPlan], args: argparse.Namespace, console) -> None:
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


def validate_plan(sp: SweepPlan) -> dict:
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
    configs = {sp.spec.name: validate_plan(sp) for sp in todo}
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
    """Every `every`-th line of metrics.jsonl, plus the line where epoch 1 ends, the line where the
    prompt pool ran dry (`analysis.runs.pool_dry_step`: where the held-out curve ends) and the last."""
    from analysis.runs import pool_dry_step

    lines = [ln for ln in text.splitlines() if ln.strip()]
    if every <= 1 or len(lines) <= 2:
        return "\n".join(lines) + ("\n" if lines else "")
    dry = pool_dry_step(text)
    dry_line = next((i for i, ln in enumerate(lines) if pool_dry_step(ln) == dry), None) if dry is not None else None
    keep, epoch_done = [], False
    for i, ln in enumerate(lines):
        take = i % every == 0 or i == len(lines) - 1 or i == dry_line
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


def thinned_every(out: Path) -> int:
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


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _write_meters(src: Path, dst: Path, *, thinned: bool) -> None:
    """METERS_FILE in the collected run `dst`: its meters from the whole metrics.jsonl in `src` when the
    copy was thinned; none (an older one removed) when the copy is whole and the run table reads it."""
    from analysis.meters import run_meters
    from analysis.runs import read_jsonl

    if not thinned or not (src / "metrics.jsonl").is_file():
        (dst / METERS_FILE).unlink(missing_ok=True)
        return
    rows, _skipped = read_jsonl(src / "metrics.jsonl")
    (dst / METERS_FILE).write_text(json.dumps(run_meters(rows), indent=1, sort_keys=True))


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
    kept_elsewhere = sum(dir_bytes(out / sp.spec.name) for sp in plans if (out / sp.spec.name).is_dir()) - sum(
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
        _write_meters(src, dst, thinned=n > 1)
    total = sum(dir_bytes(out / sp.spec.name) for sp in plans if (out / sp.spec.name).is_dir())
    return CollectResult(len(pairs), total, n, missing)


