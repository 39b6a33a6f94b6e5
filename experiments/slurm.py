"""Slurm queries: partitions, node sizes, job states and time limits, from sinfo / squeue / sacct.

Every query runs the Slurm client with a timeout and reads its plain output; none changes the
cluster:

    check_partition("gpu")                    # SweepError naming the cluster's partitions
    partition_node_cpus("gpu")                # CPUs of the partition's smallest node, or None
    slurm_job_states(["12_0", "12_1", "13"])  # {"12_0": "RUNNING", "12_1": "PENDING", "13": "GONE"}
    parse_time_min("1-2")                     # 1560 (minutes; Slurm's time formats)

A job's state is squeue's while it is queued, running or just ended, else sacct's; a job that
neither knows while squeue answers is `SLURM_GONE` (it ended; accounting may be off). States are
grouped by what they mean for a run: `SLURM_QUEUED`, `SLURM_RUNNING`, `SLURM_ENDED`.
"""

from __future__ import annotations

import functools
import math
import re
import shutil
import subprocess
from typing import Iterable, Sequence

from experiments.recipes import SweepError, did_you_mean

# Slurm job states (squeue / sacct `State`), grouped by what they mean for a run. A run whose job
# is in SLURM_ENDED but whose run.json never recorded an end (done, failed or interrupted) was
# killed before it could write: scancel, a node failure, the out-of-memory killer, ...
SLURM_QUEUED = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "SUSPENDED",
                          "RESV_DEL_HOLD", "SPECIAL_EXIT"})
SLURM_RUNNING = frozenset({"RUNNING", "COMPLETING", "STOPPED", "SIGNALING", "STAGE_OUT", "RESIZING"})
SLURM_GONE = "GONE"  # squeue does not list the job and sacct has no record of it (or no accounting): it ended
SLURM_ENDED = frozenset({"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                         "BOOT_FAIL", "DEADLINE", SLURM_GONE})



def slurm_partitions() -> list[str]:
    if shutil.which("sinfo") is None:
        raise SweepError("--executor slurm needs Slurm, but `sinfo` is not on PATH")
    out = subprocess.run(["sinfo", "-h", "-o", "%R"], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise SweepError(f"`sinfo` failed ({out.returncode}): {out.stderr.strip()}")
    return sorted({line.strip() for line in out.stdout.splitlines() if line.strip()})


@functools.lru_cache(maxsize=None)
def partition_node_cpus(partition: str | None) -> int | None:
    """The CPUs of the partition's smallest node (`sinfo -o %c`), None when Slurm does not say."""
    if shutil.which("sinfo") is None:
        return None
    cmd = ["sinfo", "-h", "-o", "%c"] + (["-p", partition] if partition else [])
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    counts = [int(m) for m in re.findall(r"\d+", out.stdout)] if out.returncode == 0 else []
    return min(counts) if counts else None


def check_partition(partition: str | None) -> None:
    names = slurm_partitions()
    if partition is not None and partition not in names:
        raise SweepError(f"unknown Slurm partition {partition!r}; partitions on this cluster: {', '.join(names)}"
                         f"{did_you_mean(partition, names)}")


def parse_time_min(text: str | int) -> int:
    """Slurm time formats -> minutes: '90', '1:30:00', '2-00:00:00', '45:00' (MM:SS)."""
    if isinstance(text, int):
        return text
    t = str(text).strip()
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", t)
    if not m:
        raise SweepError(f"cannot read time limit {text!r}; use minutes, MM:SS, HH:MM:SS or D-HH:MM:SS")
    days, a, b, c = m.groups()
    days = int(days or 0)
    if days and b is None:  # D-HH
        h, mi, s = int(a), 0, 0
    elif c is not None:  # HH:MM:SS
        h, mi, s = int(a), int(b), int(c)
    elif b is not None:  # MM:SS, or D-HH:MM
        h, mi, s = (int(a), int(b), 0) if days else (0, int(a), int(b))
    else:
        h, mi, s = 0, int(a), 0
    minutes = days * 1440 + h * 60 + mi + math.ceil(s / 60)
    if minutes <= 0:
        raise SweepError(f"time limit {text!r} must be at least one minute")
    return minutes


def _query(cmd: Sequence[str]) -> subprocess.CompletedProcess | None:
    """Run a Slurm client command; None when it is not installed or does not answer."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        return subprocess.run(list(cmd), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None


def array_task_ids(spec: str) -> set[str]:
    """Task ids of an array range as Slurm prints it: "1-3,7", "0-9:2%4" -> {"1", "2", "3", "7"}, ..."""
    tasks: set[str] = set()
    for part in spec.split("%")[0].split(","):
        rng, _, step = part.partition(":")
        lo, _, hi = rng.partition("-")
        if lo.isdigit() and (hi or lo).isdigit():
            tasks.update(str(t) for t in range(int(lo), int(hi or lo) + 1, int(step) if step.isdigit() else 1))
    return tasks


def parse_squeue(text: str, ids: Iterable[str]) -> dict[str, str]:
    """{job id: state} from `squeue -h -r -o %i|%T` lines, for the ids asked about."""
    wanted, states = set(ids), {}
    for line in text.splitlines():
        job, _, state = line.strip().partition("|")
        if job in wanted and state:
            states[job] = state.split()[0]
    return states


def parse_sacct(text: str, ids: Iterable[str]) -> dict[str, str]:
    """{job id: state} from `sacct -n -P -X -o JobID,State` lines ("CANCELLED by 0" -> CANCELLED).

    An array task that never started has no line of its own: sacct shows it in a range line
    ("12_[1-3%1]") or, for an array cancelled before any task started, in the array's own
    line ("12"). A task's own line wins over a range line, which wins over the array's line."""
    exact: dict[str, str] = {}
    ranged: dict[str, str] = {}
    whole: dict[str, str] = {}
    for line in text.splitlines():
        job, _, state = line.strip().partition("|")
        if not job or not state.strip():
            continue
        state = state.split()[0]
        exact[job] = state
        head, _, spec = job.partition("_")
        if spec.startswith("[") and spec.endswith("]"):
            for t in array_task_ids(spec[1:-1]):
                ranged[f"{head}_{t}"] = state
        elif not spec:
            whole[job] = state
    states = {}
    for j in ids:
        state = exact.get(j) or ranged.get(j) or ("_" in j and whole.get(j.split("_")[0])) or ""
        if state:
            states[j] = state
    return states


def slurm_job_states(job_ids: Iterable[str]) -> dict[str, str]:
    """{job id: Slurm state} of the given jobs (array tasks as "<array>_<task>").

    squeue (`-t all`: also jobs that ended in the last MinJobAge seconds) first, then sacct for
    the rest, asked about each task and its array (a task that never started is only in its
    array's record). A job neither lists while squeue answered is SLURM_GONE: it is not queued
    or running any more (this is the answer when accounting is off). Ids are left out when
    squeue does not answer (no Slurm here, controller down): then nothing is known about them.
    """
    ids = sorted({str(j) for j in job_ids if j})
    if not ids:
        return {}
    states: dict[str, str] = {}
    sq = _query(["squeue", "-h", "-r", "-t", "all", "-o", "%i|%T", "-j", ",".join(ids)])
    # squeue refuses a list in which it knows no job ("Invalid job id specified"): that is an answer
    answered = sq is not None and (sq.returncode == 0 or "invalid job id" in sq.stderr.lower())
    if answered:
        states.update(parse_squeue(sq.stdout, ids))
    missing = [j for j in ids if j not in states]
    if missing:
        ask = sorted(set(missing) | {j.split("_")[0] for j in missing if "_" in j})
        sa = _query(["sacct", "-n", "-P", "-X", "-o", "JobID,State", "-j", ",".join(ask)])
        if sa is not None and sa.returncode == 0:
            states.update(parse_sacct(sa.stdout, missing))
    if answered:
        for j in ids:
            states.setdefault(j, SLURM_GONE)
    return states
