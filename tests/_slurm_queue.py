"""Is the test Slurm's one node free for the Slurm tests?

The test cluster has one node. A job left in its queue from before (a study submitted on the
same machine, or jobs that a restarted slurmctld recovered from its saved state) takes that node,
and every Slurm test's jobs then wait behind it until pytest's per-test timeout: six such tests
cost 90 minutes and say nothing about why. `wait_for_free_node` waits a little for such jobs
to end (jobs of an earlier test finishing) and otherwise fails the test at once, naming them.

Held jobs (`scontrol hold`) do not compete for the node and are left alone.
"""

from __future__ import annotations

import subprocess
import time

# squeue's fields, split on '|': job id, name, state, reason, user
SQUEUE_FORMAT = "%i|%j|%T|%r|%u"
HELD_REASONS = {"JobHeldUser", "JobHeldAdmin"}
PENDING = {"PENDING", "REQUEUE_HOLD", "REQUEUED"}


def competing_jobs(squeue_text: str) -> list[str]:
    """The jobs in `squeue -h -o '%i|%j|%T|%r|%u'` output that hold or wait for the node:
    running ones and pending ones that are not held. Each as 'ID NAME STATE (REASON, USER)'."""
    jobs = []
    for line in squeue_text.splitlines():
        if not line.strip():
            continue
        parts = line.split("|")
        if len(parts) != 5:
            raise ValueError(f"unexpected squeue line {line!r} (want {SQUEUE_FORMAT!r})")
        job, name, state, reason, user = (p.strip() for p in parts)
        if state in PENDING and reason in HELD_REASONS or state == "REQUEUE_HOLD":
            continue
        jobs.append(f"{job} {name} {state} ({reason}, {user})")
    return jobs


def read_queue(timeout_s: float = 30.0) -> str:
    out = subprocess.run(["squeue", "-h", "-o", SQUEUE_FORMAT], capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"squeue failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout


def wait_for_free_node(limit_s: float = 120.0, poll_s: float = 2.0) -> str | None:
    """None once no job competes for the node; after `limit_s` of competing jobs, the message
    that names them (the caller fails the test with it)."""
    deadline = time.monotonic() + limit_s
    while True:
        jobs = competing_jobs(read_queue())
        if not jobs:
            return None
        if time.monotonic() >= deadline:
            return (f"the test Slurm's node is taken by {len(jobs)} job(s) that are not this test's, still there "
                    f"after {limit_s:.0f} s: {'; '.join(jobs[:8])}{' ...' if len(jobs) > 8 else ''}. "
                    "The Slurm tests need the node to themselves: cancel them (scancel ID) or hold them "
                    "(scontrol hold ID, later scontrol release ID); a cluster restarted from saved state "
                    "brings back its old jobs unless started with SCALERL_SLURM_FRESH=1, which cancels them (as .ci/run does)")
        time.sleep(poll_s)
