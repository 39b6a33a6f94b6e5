"""Submission: runs as submitit jobs (slurm | local | debug), the resources each asks for, and waiting for them.

    opts = LaunchOptions(executor="slurm", partition="gpu", time_min=120)
    submitted = submit(planned, opts, root, "loss_type", configs=validate_runs(runs))  # [(Planned, job), ...]
    outcomes = wait(submitted)                 # {run name: ("done" | "failed", error)}

A sweep is submitted as ONE submitit job array per distinct resource shape (usually one), and
each run's job is recorded in its slurm.json. A run's resources (`RunResources`) come from its
parsed config: its processes (train.learner_ranks + train.num_generators) and, on GPUs, the GPUs
they use; `job_parameters` turns them into nodes, tasks, CPUs and GPUs. By default a run is one
task that starts its processes itself and reserves one CPU per process; with --tasks-per-node
(or --nodes > 1) it is one task per process, its role from its rank. The local executor runs as
many runs at once as this machine has cores (and GPUs) for.

Each job calls `RunJob`, which is `Checkpointable`: a run that hits its Slurm time limit or is
preempted is checkpointed by submitit and requeued, and resumes from the last checkpoint in
its run directory.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import submitit

from experiments.recipes import SweepError
from experiments.run_config import DEFAULT_TARGET, RunConfig, parse_run_configs
from experiments.run_state import ATTEMPTS_FILE, SLURM_FILE, Planned, read_json, read_run_info, utc_now, write_json_atomic
from experiments.slurm import partition_node_cpus
from experiments.sweep_spec import RunSpec


@dataclass
class LaunchOptions:
    executor: str = "slurm"
    partition: str | None = None
    gpus: int = 0  # GPUs per node of a run; 0 with --gpu runs: what the run's layout needs
    cpus: int | None = None  # CPUs per task; None: one per process of the run (runs never share cores)
    mem_gb: float | None = None
    time_min: int = 60
    array_parallelism: int = 64
    account: str | None = None
    qos: str | None = None
    slurm_extra: dict = field(default_factory=dict)
    max_requeues: int = 10
    signal_delay_s: int = 90
    target: str = DEFAULT_TARGET
    nodes: int = 1  # nodes per run
    tasks_per_node: int | None = None  # set (or nodes > 1): one Slurm task per process, roles from the rank
    overcommit: bool = False  # let a node run more tasks than it has CPUs (Slurm --overcommit)

    @property
    def multi_task(self) -> bool:
        return self.tasks_per_node is not None or self.nodes > 1


@dataclass(frozen=True)
class RunResources:
    """The processes one run starts (train.learner_ranks + train.num_generators) and where."""

    learner_ranks: int = 1
    num_generators: int = 1
    gpus_per_generator: int = 1
    on_gpu: bool = False

    @property
    def processes(self) -> int:
        return self.learner_ranks + self.num_generators

    @property
    def gpus(self) -> int:
        return self.learner_ranks + self.num_generators * self.gpus_per_generator if self.on_gpu else 0


def job_parameters(opts: LaunchOptions, res: RunResources) -> dict:
    """nodes, tasks_per_node, cpus_per_task and gpus_per_node of one run's job.

    One task (default): the run's processes are started by `scalerl train` inside it, so it
    reserves one CPU per process (and every GPU the run uses): on a CPU node, two runs never
    share a core unless --cpus says less. Several tasks (--tasks-per-node, or --nodes > 1):
    one task per process, its role from its rank; nodes x tasks_per_node must equal the
    run's processes.
    """
    if not opts.multi_task:
        cpus = opts.cpus if opts.cpus is not None else res.processes
        return {"nodes": 1, "tasks_per_node": 1, "cpus_per_task": int(cpus), "gpus_per_node": opts.gpus or res.gpus}
    nodes = max(int(opts.nodes), 1)
    per_node = opts.tasks_per_node if opts.tasks_per_node is not None else -(-res.processes // nodes)
    if nodes * per_node != res.processes:
        raise SweepError(
            f"a run has {res.processes} processes (train.learner_ranks={res.learner_ranks} + "
            f"train.num_generators={res.num_generators}) but --nodes {nodes} x --tasks-per-node {per_node} = "
            f"{nodes * per_node} tasks; they must be equal"
        )
    gpus = opts.gpus
    if not gpus and res.on_gpu:  # the busiest node's GPUs (ranks are placed in blocks of per_node)
        need = [1] * res.learner_ranks + [res.gpus_per_generator] * res.num_generators
        gpus = max(sum(need[i : i + per_node]) for i in range(0, len(need), per_node))
    cpus = opts.cpus
    if cpus is None and (res.on_gpu or gpus) and opts.executor == "slurm":
        # A GPU task (a vLLM engine and its workers, an FSDP2 rank and its data path) on ONE core,
        # where Slurm pins tasks to their cores, starves: its share of three quarters of the node's
        # CPUs instead (the rest: cores a site reserves, CoreSpecCount, which sinfo counts in).
        node = partition_node_cpus(opts.partition)
        cpus = max(node * 3 // 4 // per_node, 1) if node else None
    return {"nodes": nodes, "tasks_per_node": int(per_node), "cpus_per_task": int(cpus or 1), "gpus_per_node": gpus}


def check_device_request(run: str, device: str, opts: LaunchOptions) -> None:
    """A multi-node Slurm run with train.device = "auto" must say how many GPUs it wants: without
    --gpus the job asks Slurm for none, and where Slurm confines a job to its allocation (cgroups,
    the usual GPU cluster) every task finds no GPU and "auto" runs the model on CPU."""
    if opts.executor == "slurm" and opts.nodes > 1 and device == "auto" and not opts.gpus:
        raise SweepError(
            f"run {run!r}: train.device = \"auto\" on --nodes {opts.nodes} without --gpus asks Slurm for no GPU, "
            "so every task would run on CPU; pass --gpus N (GPUs per node), or set train.device = \"cuda\" "
            "(the layout's GPUs are requested) or \"cpu\""
        )


def run_resources(runs: Sequence[RunSpec], opts: LaunchOptions | None = None,
                  configs: dict[str, RunConfig | None] | None = None) -> dict:
    """{run name: RunResources} from each run's parsed config (`configs`, as `validate_runs`
    returns them; without them each run is parsed here)."""
    configs = configs if configs is not None else parse_run_configs(runs)
    out = {}
    for r in runs:
        rc = configs.get(r.name)
        if rc is None:  # a stand-in trainer's config (tests) or one validate_runs already reported
            out[r.name] = RunResources()
            continue
        cfg = rc.train
        if opts is not None:
            check_device_request(r.name, cfg.device, opts)
        gpu = cfg.device.startswith("cuda") or (cfg.device == "auto" and bool(opts is not None and opts.gpus))
        out[r.name] = RunResources(cfg.learner_ranks, cfg.num_generators, rc.engine_gpus, gpu)
    return out


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _visible_gpus() -> int:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return len([d for d in env.split(",") if d.strip()])
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        return 0


def local_parallelism(opts: LaunchOptions, res: Sequence[RunResources]) -> int:
    """How many runs the local executor may run at once: as many as this machine has cores (and GPUs) for."""
    need = max([opts.cpus if opts.cpus is not None else r.processes for r in res] or [1])
    room = _usable_cores() // max(int(need), 1)
    gpus = max([opts.gpus or r.gpus for r in res] or [0])
    if gpus:  # submitit's local executor shows every job the same GPUs: one GPU run at a time unless they fit apart
        room = min(room, max(_visible_gpus() // gpus, 1))
    return max(1, min(int(opts.array_parallelism), room))


def make_executor(opts: LaunchOptions, folder: Path, sweep: str, resources: RunResources | None = None) -> submitit.Executor:
    if opts.executor not in ("slurm", "local", "debug"):
        raise SweepError(f"unknown executor {opts.executor!r}; choose from: slurm, local, debug")
    if opts.executor != "slurm" and opts.multi_task:
        raise SweepError("--nodes > 1 and --tasks-per-node need --executor slurm (locally `scalerl train` starts a run's processes itself)")
    executor = submitit.AutoExecutor(folder=str(folder), cluster=opts.executor,
                                     slurm_max_num_timeout=opts.max_requeues)
    params: dict[str, Any] = {"timeout_min": opts.time_min, "name": f"scalerl-{sweep}"}
    job = job_parameters(opts, resources or RunResources())
    if opts.executor != "debug":
        params.update(cpus_per_task=job["cpus_per_task"], nodes=job["nodes"])
        if not (opts.overcommit and opts.executor == "slurm"):
            params["tasks_per_node"] = job["tasks_per_node"]
        if job["gpus_per_node"]:  # no --gpus-per-node=0 line: clusters without GPU GRES may refuse it
            params["gpus_per_node"] = job["gpus_per_node"]
    if opts.mem_gb is not None:
        params["mem_gb"] = opts.mem_gb
    if opts.executor == "slurm":
        params["slurm_array_parallelism"] = opts.array_parallelism
        params["slurm_signal_delay_s"] = opts.signal_delay_s
        if opts.partition:
            params["slurm_partition"] = opts.partition
        if opts.account:
            params["slurm_account"] = opts.account
        if opts.qos:
            params["slurm_qos"] = opts.qos
        srun_args = []
        if opts.multi_task:
            # One task per process: when one ends badly (a worker that lost learner-0 exits 5,
            # learner-0 exits 1 after recording a dead or stopped peer), Slurm kills the step's
            # other tasks, stopped ones included, instead of waiting for them until the time limit.
            srun_args.append("--kill-on-bad-exit=1")
        if job["cpus_per_task"] > 1:
            # srun of Slurm 22.05-23.02 does not take sbatch's --cpus-per-task: without it, each
            # task of the step gets one CPU where Slurm binds tasks to cores.
            srun_args.append(f"--cpus-per-task={job['cpus_per_task']}")
        if srun_args:
            params["slurm_srun_args"] = srun_args
        extra = dict(opts.slurm_extra)
        if opts.overcommit:
            # Slurm refuses --ntasks-per-node above the node's CPUs even with --overcommit; --ntasks is accepted
            extra["overcommit"] = True
            extra["ntasks"] = job["nodes"] * job["tasks_per_node"]
        if extra:
            params["slurm_additional_parameters"] = extra
    executor.update_parameters(**params)
    return executor


def _job_record(job: submitit.Job, opts: LaunchOptions, folder: Path) -> dict:
    rec = {"executor": opts.executor, "job_id": str(job.job_id), "submitit_folder": str(folder),
           "submitted_at": utc_now()}
    if opts.executor == "slurm":
        rec["array_job_id"] = str(job.job_id).split("_")[0]
        rec.update(partition=opts.partition, time_min=opts.time_min, gpus=opts.gpus, cpus=opts.cpus, nodes=opts.nodes,
                   tasks_per_node=opts.tasks_per_node)
    elif opts.executor == "local":
        rec["pid"] = getattr(getattr(job, "_process", None), "pid", None) or str(job.job_id)
        rec["host"] = socket.gethostname()  # the pid means something only on this machine (`local_alive`)
    return rec


def submit(planned: Sequence[Planned], opts: LaunchOptions, root: Path, sweep: str,
           folder: Path | None = None, configs: dict[str, RunConfig] | None = None) -> list[tuple[Planned, Any]]:
    """Submit the runs to launch: one job array per distinct resource shape (usually one);
    record each run's job in its slurm.json. `configs`: the runs' parsed configs (`validate_runs`)."""
    todo = [p for p in planned if not p.action.startswith("skip")]
    if not todo:
        return []
    folder = Path(folder) if folder is not None else Path(root) / sweep / ".submitit"
    folder.mkdir(parents=True, exist_ok=True)
    resources = run_resources([p.run for p in todo], opts, configs) if opts.executor != "debug" else {}
    for p in todo:
        p.run_dir.mkdir(parents=True, exist_ok=True)
    if opts.executor == "slurm":
        shapes: dict = {}
        for p in todo:
            key = resources.get(p.run.name, RunResources())
            job_parameters(opts, key)  # a run that does not fit the task layout is refused before anything is submitted
            shapes.setdefault(key, []).append(p)
        submitted = []
        for key, group in shapes.items():
            executor = make_executor(opts, folder, sweep, key)
            jobs: list = []
            with executor.batch():
                for p in group:
                    jobs.append(executor.submit(RunJob(opts.target, extend=p.extend), list(p.run.config_files),
                                                list(p.run.bindings), str(p.run_dir), p.run.run_info()))
            for p, job in zip(group, jobs):
                _record(p, job, opts, folder)
            submitted.extend(zip(group, jobs))
        order = {p.run.name: i for i, p in enumerate(todo)}
        return sorted(submitted, key=lambda pj: order[pj[0].run.name])
    # local/debug: waves of runs (local: as many at once as this machine has cores for)
    jobs = [None] * len(todo)
    wave = local_parallelism(opts, list(resources.values())) if opts.executor == "local" else len(todo)
    executor = make_executor(opts, folder, sweep, max(resources.values(), key=lambda r: r.processes, default=None))
    for start in range(0, len(todo), wave):
        chunk = range(start, min(start + wave, len(todo)))
        for i in chunk:
            p = todo[i]
            jobs[i] = executor.submit(RunJob(opts.target, extend=p.extend), list(p.run.config_files),
                                      list(p.run.bindings), str(p.run_dir), p.run.run_info())
            _record(p, jobs[i], opts, folder)
        if opts.executor == "local" and start + wave < len(todo):
            for i in chunk:
                _wait_quietly(jobs[i])
    return list(zip(todo, jobs))


def _record(p: Planned, job: Any, opts: LaunchOptions, folder: Path) -> None:
    path = p.run_dir / SLURM_FILE
    old = read_json(path) or {}
    rec = _job_record(job, opts, folder)
    rec["history"] = old.get("history", []) + [{"job_id": rec["job_id"], "submitted_at": rec["submitted_at"],
                                                 "action": p.action}]
    write_json_atomic(path, rec)


def job_result(job: Any) -> Any:
    """A job's result; for a job of several tasks (one per process of a run), task 0's (learner-0's)."""
    if getattr(job, "_sub_jobs", None):
        return job.results()[0]
    return job.result()


def _wait_quietly(job: Any) -> None:
    try:
        job_result(job)
    except Exception:  # reported by `wait`
        pass


def wait(submitted: Sequence[tuple[Planned, Any]], poll_s: float = 5.0) -> dict[str, tuple[str, str]]:
    """Wait for every job; {run name: (outcome, error)} with outcome done | failed."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from submitit.local.debug import DebugJob

    outcomes: dict[str, tuple[str, str]] = {}
    pending = list(submitted)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), transient=False) as progress:
        task = progress.add_task("runs finished", total=len(pending))
        while pending:
            still = []
            for p, job in pending:
                if isinstance(job, DebugJob) or job.done():
                    outcomes[p.run.name] = _outcome(p, job)
                    progress.advance(task)
                else:
                    still.append((p, job))
            pending = still
            if pending:
                time.sleep(poll_s)
    return outcomes


def _outcome(p: Planned, job: Any) -> tuple[str, str]:
    """("done", "") or ("failed", the run's recorded error, else the job's last error line)."""
    try:
        job_result(job)
        return "done", ""
    except Exception as err:  # FailedJobError / UncompletedJobError / RunFailed (debug)
        recorded = read_run_info(p.run_dir).get("error")
        if recorded:
            return "failed", str(recorded).splitlines()[0][:500]
        lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
        lines = [ln for ln in lines if not ln.startswith(("You can check", "'job.stdout", "- /", "srun: error"))]
        return "failed", (lines[-1] if lines else type(err).__name__)[:500]


# ----------------------------------------------------------------------------------------
# The job
# ----------------------------------------------------------------------------------------
class RunFailed(RuntimeError):
    """The trainer finished a run with status 'failed'."""


def _resolve_target(target: str):
    module, _, attr = target.partition(":")
    if not module or not attr:
        raise SweepError(f"trainer target must look like 'package.module:function', got {target!r}")
    return getattr(importlib.import_module(module), attr)


def _takes(fn, name: str) -> bool:
    """Whether `fn` accepts the keyword `name` (a trainer target of one's own may not know `extend`)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind == p.VAR_KEYWORD for p in params)


class RunJob(submitit.helpers.Checkpointable):
    """One training run as a submitit job.

    Checkpointable: on a Slurm time limit or preemption submitit calls `checkpoint` (the
    inherited one resubmits this same call) and requeues the job; the trainer then resumes
    from the latest checkpoint in the run directory.
    """

    def __init__(self, target: str = DEFAULT_TARGET, extend: bool = False):
        self.target = target
        self.extend = extend  # the trainer may extend the run's budget (an adaptive rung, `scalerl train --extend`)

    def __call__(self, config_files: Sequence[str], bindings: Sequence[str], run_dir: str,
                 run_info: dict) -> str:
        if int(os.environ.get("SLURM_PROCID", "0") or 0) == 0:  # one record per job, not per task
            _record_job_start(Path(run_dir))
        train = _resolve_target(self.target)
        extra = {"extend": True} if getattr(self, "extend", False) and _takes(train, "extend") else {}
        status = train(list(config_files), list(bindings), run_dir, run_info=dict(run_info), **extra)
        if status != "done":
            info = read_run_info(Path(run_dir))  # run.json, or the failure recorded beside it
            raise RunFailed(f"run {run_info.get('name')} ended with status {status!r}: "
                            f"{info.get('error', 'no error recorded in run.json')}")
        return status

    def checkpoint(self, config_files, bindings, run_dir, run_info) -> submitit.helpers.DelayedSubmission:
        """Called by submitit on preemption or time-out, just before the requeue: note it in
        attempts.jsonl (so a later `scalerl sweep` resumes the run even if the trainer marked
        it failed on the way out) and resubmit the same call."""
        try:
            with open(Path(run_dir) / ATTEMPTS_FILE, "a") as f:
                f.write(json.dumps({"at": utc_now(), "event": "interrupted", "pid": os.getpid()}) + "\n")
        except OSError:
            pass
        return super().checkpoint(config_files, bindings, run_dir, run_info)


def _record_job_start(run_dir: Path) -> None:
    """Append to attempts.jsonl which job (and which Slurm restart) runs this run now."""
    run_dir.mkdir(parents=True, exist_ok=True)
    env = os.environ
    job_id = env.get("SLURM_JOB_ID")
    if env.get("SLURM_ARRAY_JOB_ID"):
        job_id = f"{env['SLURM_ARRAY_JOB_ID']}_{env.get('SLURM_ARRAY_TASK_ID')}"
    rec = {"at": utc_now(), "pid": os.getpid(), "job_id": job_id, "node": env.get("SLURMD_NODENAME"),
           "restart_count": int(env.get("SLURM_RESTART_COUNT", 0) or 0)}
    with open(run_dir / ATTEMPTS_FILE, "a") as f:
        f.write(json.dumps(rec) + "\n")
