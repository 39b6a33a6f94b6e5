"""One owner of a run's life: its directory, lock, run.json, resume, and the binding of its processes.

`experiments/` turns what a user asked for (a config and bindings, a sweep's run) into a
`ResolvedRun` and, for a directory that already holds a run, the `Rerun` its recorded settings
allow (experiments/run_settings.py); from there this module owns the run:

    RunOwner(run, run_path, run_info, rerun)     # nothing touched yet
      .open()        the run-directory lock, config.gin, run.json "running" (hardware, the resolved
                     run, its settings and what changed since the last attempt), resumed or not
      .finish(..)    done | failed | interrupted, with why
    run_here(...)    every process of the run on this machine (launcher.py), watched to its end
    lead_slurm_step / join_slurm_step
                     one task of a multi-task Slurm step: task 0 publishes the resolved run in the
                     run directory (`publish_run`); the others load it (`wait_for_run`), bind their
                     GPUs from its layout and take their role; no task parses gin again
    record_refused   a sweep's run refused before it started: run.json failed, with why
    reopen           a done run that goes on (an adaptive sweep's next rung): marked interrupted

run.json is written through `RunInfo` (runlog.py, its format) by this module while the run lives.
A process that dies records its own last words through `runlog.record_failure` (learner-0's
traceback; the first peer when learner-0 is lost, since under Slurm there is no supervisor): that
function never overwrites an outcome already recorded (`only_if_running`), and the outcome of a run
that ends is this module's.
"""

from __future__ import annotations

import errno
import logging
import os
import pickle
import time
from pathlib import Path
from typing import Optional

from components.trainer.config import attention_of, on_gpu
from components.trainer.resolve import ResolvedRun
from components.trainer.runlog import RunInfo, now_iso, record_exception

__all__ = ["RunOwner", "RunDirBusyError", "lock_run_dir", "hardware_of", "record_refused", "reopen", "run_here",
           "bind_gpus", "slurm_attempt", "publish_run", "publish_refusal", "wait_for_run", "lead_slurm_step",
           "join_slurm_step", "outlive_step_sigterm", "record_settings", "PEER_EXIT_GRACE_S", "PREPARE_TIMEOUT_S"]

log = logging.getLogger("scalerl.train")

PEER_EXIT_GRACE_S = 60.0  # a Slurm peer task whose role is over has this long to return and exit
PREPARE_TIMEOUT_S = 3600.0  # the other tasks of a Slurm step wait this long for task 0 to resolve the run
INTERRUPTED_PREEMPTED = "stopped by SystemExit (preempted or timed out); resumes from its last checkpoint"
INTERRUPTED_CTRL_C = "stopped by Ctrl-C (KeyboardInterrupt); resumes from its last checkpoint"


class RunDirBusyError(RuntimeError):
    """Another process is training in this run directory."""


def lock_run_dir(run_path: Path):
    """An exclusive advisory lock on <run>/.lock, released when the process exits (even on kill -9)."""
    import fcntl

    f = open(run_path / ".lock", "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            # a filesystem without flock (Lustre mounted without -o flock: ENOSYS; some NFS: ENOLCK)
            # is not a busy run directory: train unguarded, and say so
            log.warning("run directory %s cannot be locked (%s: %s): nothing stops a second `scalerl train` "
                        "in it at the same time", run_path, errno.errorcode.get(err.errno, err.errno), err.strerror)
            return f
        f.close()
        raise RunDirBusyError(f"run directory {str(run_path)!r} is being trained by another process") from None
    return f


def hardware_of(run: ResolvedRun) -> dict:
    """run.json's "hardware": the device, how many the run reserves, and its process layout."""
    import torch

    from components.trainer.roles import available_gpus

    layout, gpu = run.layout, on_gpu(run.cfg)
    name, available = "cpu", None
    if gpu:
        available = available_gpus()
        try:
            name = torch.cuda.get_device_name(0)
            available = available if available is not None else torch.cuda.device_count()
        except Exception:  # noqa: BLE001 - a GPU the supervisor cannot see (Slurm binds it to the task)
            name = "cuda"
    return {
        "device": name,
        "count": layout.devices_reserved(gpu, available),
        "learner_ranks": layout.learner_ranks,
        "num_generators": layout.num_generators,
        "gpus_per_generator": layout.gpus_per_generator if gpu else 0,
        "processes": layout.world_size,
    }


def record_settings(data: dict, new: dict, rerun, now: str) -> None:
    """Into run.json's data: the settings now running, and (when some changed on this re-run: `rerun.changes`,
    key -> (recorded, new)) what changed at which step."""
    data["settings"] = dict(new)
    if rerun is not None and rerun.changes:
        history = list(data.get("settings_history") or [])
        history.append({"at": now, "step": rerun.step, "extended": rerun.extended,
                        "changes": {k: {"recorded": old, "new": value} for k, (old, value) in rerun.changes.items()}})
        data["settings_history"] = history


class RunOwner:
    """A run's directory while the run lives: `open()` takes it, `finish()` records how the run ended,
    `close()` lets it go. `rerun`: what a re-invoked directory continues (`run_settings.Rerun`: `changes`,
    `step`, `extended`), None for a new run."""

    def __init__(self, run: ResolvedRun, run_path: Path, run_info: Optional[dict] = None, rerun=None) -> None:
        self.run, self.path, self.rerun = run, Path(run_path), rerun
        self.run_info = {k: v for k, v in (run_info or {}).items() if v is not None}
        self._lock = None
        self.info: Optional[RunInfo] = None

    def open(self) -> dict:
        """The lock (one trainer per run directory: a requeued job may overlap), config.gin, run.json running.
        Returns the run's identity as the processes get it (name, sweep, seed, recipe...)."""
        from components.models import hub_model_info
        from components.trainer.checkpoint import latest_checkpoint

        run, cfg = self.run, self.run.cfg
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock = lock_run_dir(self.path)
        (self.path / "config.gin").write_text(run.config_text)
        info = RunInfo(self.path)
        merged = dict(self.run_info)
        merged.setdefault("seed", cfg.seed)
        merged["attn_implementation"] = attention_of(cfg)
        merged.setdefault("recipe", Path(run.config_files[0]).stem if run.config_files else None)
        merged.update(hub_model_info(cfg.model_path))  # a hub id: model_id, model_revision and the commit it ran
        merged.setdefault("user_modules", [dict(m) for m in run.module_files])  # what `scalerl eval RUN_DIR` imports
        merged.setdefault("resolved", run.to_dict())  # the run as it was resolved (a resume keeps the first)
        record_settings(info.data, dict(run.settings), self.rerun, now_iso())  # what a re-run is compared against
        info.start(merged, hardware_of(run), resumed=latest_checkpoint(self.path / "checkpoints") is not None)
        self.info, self.run_info = info, merged
        return merged

    @property
    def devices(self) -> int:
        return int(self.info.data["hardware"]["count"]) if self.info is not None else 0

    def finish(self, status: str, error: Optional[str] = None) -> None:
        """done | interrupted (with why; it resumes from its last checkpoint). run.json is read again
        first: a process of the run may have recorded a failure in it meanwhile."""
        RunInfo(self.path).finish(status, error=error)

    def fail(self, err: BaseException) -> None:
        """The run failed with `err`: run.json failed, error.txt its traceback (never raises)."""
        record_exception(self.path, err)

    def status(self) -> Optional[str]:
        return RunInfo(self.path).status

    def error(self) -> Optional[str]:
        return RunInfo(self.path).data.get("error")

    def close(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def __enter__(self) -> "RunOwner":
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def reopen(run_path: Path, **why) -> bool:
    """A done run that will go on (an adaptive sweep's next rung): marked interrupted, with `why` recorded
    (e.g. adaptive="continues to rung 0.5"), so that its re-run resumes from its latest checkpoint instead
    of returning at once. Returns whether it was done."""
    info = RunInfo(Path(run_path))
    if info.status != "done":
        return False
    info.data.update(status="interrupted", **why)
    info.save()
    return True


def record_refused(run_path: Path, run_info: Optional[dict], err: BaseException) -> None:
    """A sweep's run refused before it started: run.json failed with why (never raises)."""
    try:
        run_path.mkdir(parents=True, exist_ok=True)
        RunInfo(run_path).start(run_info, {"device": "unknown", "count": 0}, resumed=False)
    except Exception:  # noqa: BLE001 - an unwritable run directory: record_failure falls back
        pass
    record_exception(run_path, err)


# ---------------------------------------------------------------------------------------------
# on this machine
def run_here(run: ResolvedRun, run_path: Path, run_info: Optional[dict] = None, progress: bool = True,
             rerun=None) -> str:
    """Every process of `run` on this machine, this one their supervisor; returns "done" or "failed"
    (KeyboardInterrupt / SystemExit leave it interrupted and resumable, and propagate)."""
    from components.trainer.generator import WorkerSetup
    from components.trainer.launcher import launch_local

    with RunOwner(run, run_path, run_info, rerun) as owner:
        setup = WorkerSetup(run=run, run_dir=str(run_path), run_info=owner.run_info, progress=progress,
                            devices=owner.devices)
        try:
            code = launch_local(setup, run.layout, run_path, on_gpu(run.cfg))
        except SystemExit:  # submitit's preemption / time-limit handler, after checkpointing: requeued, it resumes
            owner.finish("interrupted", error=INTERRUPTED_PREEMPTED)
            raise
        except KeyboardInterrupt:  # Ctrl-C: stopped by the user, resumable like a preemption
            owner.finish("interrupted", error=INTERRUPTED_CTRL_C)
            raise
        except BaseException as err:  # noqa: BLE001 - record every failure
            owner.fail(err)
            return "failed"
        if code == 0:
            owner.finish("done")
            return "done"
        if owner.status() == "running":  # learner-0 died without its last words
            owner.fail(RuntimeError(f"learner-0 exited with code {code} (killed or crashed) without recording an error"))
        log.error("run %s failed: %s (traceback in %s)", run_path, owner.error(), run_path / "error.txt")
        return "failed"


# ---------------------------------------------------------------------------------------------
# one task of a multi-task Slurm step
def bind_gpus(layout, penv) -> None:
    """Restrict this task to its own GPU(s) before CUDA starts (a job with GPUs per node shows every task all of
    its node's; one with --gpus-per-task shows each task its own: `roles.slurm_task_gpus`)."""
    from components.trainer.roles import GPUS_SHARED_ENV, slurm_task_gpus

    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip() != ""]
    if not visible:
        import torch

        visible = [str(i) for i in range(torch.cuda.device_count())]
    mine, shared = slurm_task_gpus(layout, penv, visible)
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
    os.environ[GPUS_SHARED_ENV] = "1" if shared else "0"


def slurm_attempt(environ: Optional[dict] = None) -> str:
    """This attempt of this Slurm step: "<job>.<step>-<restart count>" (a requeued job is a new attempt)."""
    env = os.environ if environ is None else environ
    return f"{env.get('SLURM_JOB_ID', 'job')}.{env.get('SLURM_STEP_ID', '0')}-{env.get('SLURM_RESTART_COUNT', '0') or '0'}"


def _marker(run_path: Path, attempt: str) -> Path:
    return Path(run_path) / ".scalerl" / f"prepared-{attempt}"


def _run_file(run_path: Path, attempt: str) -> Path:
    return Path(run_path) / ".scalerl" / f"resolved-{attempt}.pkl"


def publish_run(run_path: Path, attempt: str, run: Optional[ResolvedRun]) -> None:
    """Task 0: the resolved run, for the step's other tasks (None: the run is already done, nothing to do).
    The pickle is written before the marker that says it is there."""
    marker = _marker(run_path, attempt)
    marker.parent.mkdir(parents=True, exist_ok=True)
    if run is None:
        marker.write_text("done")
        return
    tmp = _run_file(run_path, attempt).with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(run, f)
    os.replace(tmp, _run_file(run_path, attempt))
    marker.write_text("ok")


def publish_refusal(run_path: Path, attempt: str, err: BaseException) -> None:
    """Task 0 could not resolve the run: the other tasks stop, naming why (never raises)."""
    try:
        marker = _marker(run_path, attempt)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"failed: {type(err).__name__}: {err}")
    except OSError:
        pass


def wait_for_run(run_path: Path, attempt: str, timeout_s: float = PREPARE_TIMEOUT_S) -> Optional[ResolvedRun]:
    """The run task 0 published (None: it is already done). Raises TimeoutError when task 0 says nothing
    within `timeout_s`, RuntimeError naming why when it could not resolve the run."""
    marker = _marker(run_path, attempt)
    deadline = time.monotonic() + timeout_s
    while not marker.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"learner-0 did not prepare the run within {timeout_s:.0f} s (no {marker})")
        time.sleep(1.0)
    text = marker.read_text()
    if text.startswith("failed"):
        raise RuntimeError(f"learner-0 could not prepare the run ({text})")
    if text.startswith("done"):
        return None
    with open(_run_file(run_path, attempt), "rb") as f:
        return pickle.load(f)


def _check_step_size(run: ResolvedRun, penv) -> None:
    if penv.world_size != run.layout.world_size:
        from components.trainer.config import ConfigError

        layout = run.layout
        raise ConfigError(f"this Slurm job step has {penv.world_size} tasks but the run needs {layout.world_size} "
                          f"(train.learner_ranks={layout.learner_ranks} + train.num_generators={layout.num_generators}); "
                          f"submit it with `scalerl train ... --executor slurm` or give the job that many tasks")


def _task_setup(run: ResolvedRun, run_path: Path, penv, run_info: Optional[dict], progress: bool, devices: int = 0):
    """This task's WorkerSetup: its role's device; the progress bar on the hub only."""
    from components.trainer.generator import WorkerSetup, resolve_device

    role = run.layout.role(penv.rank)
    return WorkerSetup(run=run, run_dir=str(run_path), run_info=run_info, progress=progress and role.is_hub,
                       device=resolve_device(run.cfg.device, role.kind, role.index), devices=devices)


def join_slurm_step(penv, run_path: Path, *, run_info: Optional[dict] = None, progress: bool = False,
                    timeout_s: float = PREPARE_TIMEOUT_S) -> str:
    """A task other than 0: wait for the run task 0 resolved, bind this task's GPUs, take its role, and exit
    once the role is over (a thread that never returns must not keep the task alive)."""
    from components.trainer.worker import exit_after, run_role

    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # CUDA starts only after the binding below
    run = wait_for_run(run_path, slurm_attempt(), timeout_s)
    if run is None:
        log.info("run %s is already done", run_path)
        return "done"
    _check_step_size(run, penv)
    if on_gpu(run.cfg):
        bind_gpus(run.layout, penv)
    setup = _task_setup(run, run_path, penv, run_info, progress)
    run_role(penv.rank, setup, penv.endpoints, run.layout)
    exit_after(PEER_EXIT_GRACE_S)
    return "done"


def lead_slurm_step(penv, run: ResolvedRun, run_path: Path, *, run_info: Optional[dict] = None,
                    progress: bool = True, rerun=None) -> str:
    """Task 0 (learner-0, the hub): publish the run for the other tasks, own the run directory, run the hub's
    role; returns "done" or "failed". Its GPUs were bound from the parsed config, before the run was resolved
    (resolving may build a warm start)."""
    from components.trainer.worker import run_role

    attempt = slurm_attempt()
    try:
        _check_step_size(run, penv)
    except Exception as err:
        record_refused(run_path, run_info, err)
        publish_refusal(run_path, attempt, err)
        raise
    publish_run(run_path, attempt, run)
    outlive_step_sigterm()
    with RunOwner(run, run_path, run_info, rerun) as owner:
        setup = _task_setup(run, run_path, penv, owner.run_info, progress, owner.devices)
        try:
            status = run_role(penv.rank, setup, penv.endpoints, run.layout)
        except SystemExit:
            owner.finish("interrupted", error=INTERRUPTED_PREEMPTED)
            raise
        except BaseException as err:  # noqa: BLE001
            owner.fail(err)
            if isinstance(err, KeyboardInterrupt):
                raise
            log.error("run %s failed: %s (traceback in %s)", run_path, err, run_path / "error.txt")
            return "failed"
        owner.finish(status)
        return status


def outlive_step_sigterm() -> None:
    """Keep learner-0 running through the SIGTERM that ends a Slurm step. When a task dies,
    srun --kill-on-bad-exit sends every other task SIGTERM at once and SIGKILL KillWait (default
    30 s) later; learner-0 names the dead task within seconds (its closed connection) and records
    it in run.json, if SIGTERM has not killed it first. submitit's jobs already ignore SIGTERM;
    this is for `srun ... scalerl train` without submitit (a handler already set is kept)."""
    import signal

    def note(signum, frame) -> None:
        log.warning("SIGTERM: Slurm is ending this step (a task ended badly, or the job was cancelled); "
                    "learner-0 goes on, to record which process failed, until it ends or is killed")

    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, note)
