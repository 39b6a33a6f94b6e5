"""Run state: what a run directory and the scheduler say about a run, and what a launch does with it.

A run directory holds run.json (the trainer's record: status, error, pid, host, slurm_job),
slurm.json (`SLURM_FILE`: the job the launcher submitted, and the history of submissions),
attempts.jsonl (`ATTEMPTS_FILE`: one line per job start, and one when submitit checkpointed the
job for a requeue) and checkpoints/. Whether a job is still queued or running is the
scheduler's word (squeue, sacct), not run.json's:

    state, why = reconcile(status, job, slurm_state, alive)   # ("interrupted", "Slurm job 12_3 ended CANCELLED ...")
    planned = plan(runs, root, retry_failed=False)            # [Planned(run, run_dir, "resume", why), ...]

`plan` skips runs whose run.json says done, leaves runs whose job is still queued or running
alone, resumes runs whose job ended before they recorded an end (scancel, node failure, ...)
or that were preempted or timed out and not requeued, and retries failed runs only with
`retry_failed`.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from experiments.slurm import SLURM_ENDED, SLURM_GONE, SLURM_QUEUED, SLURM_RUNNING, slurm_job_states
from experiments.sweep_spec import RunSpec

SLURM_FILE = "slurm.json"  # written by the launcher at submission
ATTEMPTS_FILE = "attempts.jsonl"  # one line per job start (requeues included), written by the job


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def read_run_info(run_dir: Path) -> dict:
    """run.json as the trainer reads it (`RunInfo`: with a failure it could only record outside a
    run directory it could not write); {} when there is none or it cannot be read."""
    from components.trainer.runlog import RunInfo

    try:
        data = RunInfo(Path(run_dir)).data
    except (OSError, ValueError):
        return read_json(Path(run_dir) / "run.json") or {}
    return data if isinstance(data, dict) else {}


def has_checkpoint(run_dir: Path) -> bool:
    """Anything a trainer saved (hidden entries, e.g. the .tmp of an unfinished save, do not count)."""
    ck = Path(run_dir) / "checkpoints"
    return ck.is_dir() and any(not p.name.startswith(".") for p in ck.iterdir())


def was_interrupted(run_dir: Path) -> bool:
    """True when the run's last job was preempted or timed out (RunJob.checkpoint ran)."""
    try:
        lines = [ln for ln in (Path(run_dir) / ATTEMPTS_FILE).read_text().splitlines() if ln.strip()]
        return bool(lines) and json.loads(lines[-1]).get("event") == "interrupted"
    except (OSError, ValueError):
        return False


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def _pid_alive(pid: Any) -> bool:
    try:
        if int(pid) <= 0:  # 0 and -1 would signal a whole group: not a recorded process
            return False
        os.kill(int(pid), 0)
        return True
    except PermissionError:  # exists, owned by another user
        return True
    except (OSError, ValueError, TypeError):
        return False


def lock_held(path: Path) -> bool | None:
    """Whether some process holds a flock on `path` (the trainer's <run>/.lock), read from
    /proc/locks without taking the lock (taking it, even briefly, could make a trainer that
    starts at that moment fail with RunDirBusyError). None when it cannot be told (no such
    file, not Linux). Matched on the inode number alone: a clash can only say "held"."""
    try:
        ino = os.stat(path).st_ino
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if "FLOCK" in fields and any(f.count(":") == 2 and f.rsplit(":", 1)[1] == str(ino) for f in fields):
            return True
    return False


def local_alive(run_dir: Path, info: dict, job: dict) -> bool | None:
    """Whether a process on this machine is training the run (not for Slurm jobs: ask the scheduler).

    True: the trainer's run-directory lock is held, or a pid the run recorded (the local
    executor's job in slurm.json, a `pid` in run.json) is alive. False: none of that, and there
    was something to check on this machine. None: it cannot be told here (the run was on
    another host, or it recorded neither a lock nor a pid)."""
    if job and job.get("executor", "slurm") == "slurm" and not attempt_outside_slurm(info):
        return None
    host = info.get("host") or job.get("host")
    if host and host != socket.gethostname():
        return None
    if not host and job.get("executor") != "local":
        return None  # nothing says the run was on this machine
    held = lock_held(Path(run_dir) / ".lock")
    pids = [p for p in (info.get("pid"), job.get("pid") if job.get("executor") == "local" else None) if p]
    if held or any(_pid_alive(p) for p in pids):
        return True
    return False if held is not None or pids else None


def attempt_outside_slurm(info: dict) -> bool:
    """run.json says the run is running in a process outside Slurm (`RunInfo` records `slurm_job`
    None there): e.g. `scalerl train ... --run-dir` after its sweep's job ended. Runs written
    before `slurm_job` was recorded do not say."""
    return info.get("status") == "running" and "slurm_job" in info and info["slurm_job"] is None


def scheduler_state(info: dict, job: dict, states: dict[str, str]) -> str:
    """The Slurm state that speaks for the run ("" when none does): that of the job in its
    slurm.json, unless that job is no longer queued or running and the run has since been
    restarted outside Slurm (`attempt_outside_slurm`): the old job's end says nothing about
    that process (`local_alive` tells whether it lives, on its host)."""
    if job.get("executor", "slurm") != "slurm":
        return ""
    state = states.get(str(job.get("job_id") or ""), "")
    if state not in SLURM_QUEUED | SLURM_RUNNING and attempt_outside_slurm(info):
        return ""
    return state


RECORDED_END = ("done", "failed", "interrupted")


def reconcile(status: str | None, job: dict, slurm_state: str = "", alive: bool | None = None) -> tuple[str, str]:
    """(state, reason) of a run from its run.json `status`, its job record (slurm.json), its job's
    Slurm state ("" when unknown) and `local_alive`.

    A live Slurm job wins (a requeued run is queued again, whatever run.json says). An end the
    run recorded (done, failed, interrupted) stands, except `failed` in a job that was CANCELLED
    (scancel kills the run's processes together, and the survivor records the others' death as a
    failure): that run is `interrupted`. A run that recorded no end (run.json says
    running, or there is none) whose Slurm job ended, or whose local process is gone, is
    `interrupted`, resumable like a preempted run, with the reason (the job's Slurm state)."""
    job_id = str(job.get("job_id") or "")
    if status == "done":
        return "done", ""
    if slurm_state in SLURM_QUEUED:
        return "queued", ""
    if slurm_state in SLURM_RUNNING:
        return "running", ""
    if status == "failed" and slurm_state == "CANCELLED":
        # scancel signals every process of the job at once: learner rank 0 sees its peers go and
        # records `failed` before it is killed too. A cancelled run is stopped, not broken.
        return "interrupted", (f"Slurm job {job_id} was cancelled while the run trained (run.json says failed: "
                               "its processes were killed together)")
    if status in RECORDED_END:
        return status, ""
    if status in (None, "running") and slurm_state in SLURM_ENDED:
        what = ("is no longer known to Slurm (not in squeue, no accounting record)" if slurm_state == SLURM_GONE
                else f"ended {slurm_state}")
        return "interrupted", f"Slurm job {job_id} {what} before the run {'started' if status is None else 'recorded its end'}"
    if status in (None, "running") and alive is False:
        return "interrupted", ("no process on this machine is training it (its run-directory lock is free, no pid it "
                               f"recorded is alive) and it {'never started' if status is None else 'recorded no end'}")
    return status or ("queued" if job else "unknown"), ""


@dataclass
class Planned:
    run: RunSpec
    run_dir: Path
    action: str  # submit | resume | retry | skip-done | skip-active | skip-failed | skip-refused
    reason: str = ""
    extend: bool = False  # the trainer may extend the run's budget (`scalerl train --extend`, an adaptive rung)


def plan(runs: Sequence[RunSpec], root: Path, *, retry_failed: bool = False) -> list[Planned]:
    """Decide for every run: submit, resume, retry, or skip (and why).

    A run is active while its Slurm job is queued or running (or, locally, while its process
    lives); a run whose job ended before it recorded an end is resumed (`reconcile`)."""
    root = Path(root)
    jobs = {r.name: (read_json(root / r.sweep / r.name / SLURM_FILE) or {}) for r in runs}
    sched = slurm_job_states([j.get("job_id") for j in jobs.values() if j.get("executor") == "slurm"])
    # run.json is read after the scheduler: a job that ends in between has written its end by then
    infos = {r.name: read_run_info(root / r.sweep / r.name) for r in runs}
    out = []
    for r in runs:
        run_dir = root / r.sweep / r.name
        info, job = infos[r.name], jobs[r.name]
        status = info.get("status")
        slurm_state = scheduler_state(info, job, sched) if job.get("executor") == "slurm" else ""
        alive = local_alive(run_dir, info, job)
        state, why = reconcile(status, job, slurm_state, alive)
        from_ck = " from its checkpoint" if has_checkpoint(run_dir) else ""
        if status == "done":
            out.append(Planned(r, run_dir, "skip-done", "run.json says done"))
        elif slurm_state in SLURM_QUEUED | SLURM_RUNNING or alive:
            out.append(Planned(r, run_dir, "skip-active", f"job {job.get('job_id')} is {slurm_state or 'running'}"))
        elif state == "interrupted" and why:  # the scheduler's word first: a scancel'd job may have
            # been signalled like a preempted one (RunJob.checkpoint ran) before it was killed
            out.append(Planned(r, run_dir, "resume", f"interrupted: {why}; resumes" + from_ck))
        elif status == "interrupted" or (status in ("failed", "running") and was_interrupted(run_dir)):
            out.append(Planned(r, run_dir, "resume", "interrupted (preempted or timed out) and not requeued; resumes" + from_ck))
        elif status == "failed" and not retry_failed:
            err = info.get("error", "")
            out.append(Planned(r, run_dir, "skip-failed", f"failed: {str(err)[:120]} (use --retry-failed)"))
        elif status == "failed":
            out.append(Planned(r, run_dir, "retry", "failed before; retrying" + from_ck))
        elif has_checkpoint(run_dir):
            out.append(Planned(r, run_dir, "resume", f"status {status or 'unknown'}; resumes from its checkpoint"))
        else:
            out.append(Planned(r, run_dir, "submit", "new run" if not status else f"status {status}, no checkpoint"))
    return out
