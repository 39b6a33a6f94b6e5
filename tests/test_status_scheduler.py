"""`scalerl status` and `scalerl sweep` reconcile run.json with the scheduler (issue 14, item 8).

A job killed before its run could write (scancel, node failure, OOM killer, ...) leaves run.json
saying `running`, or no run.json at all. Status then shows the run `interrupted` with the
scheduler's state as the reason, and a re-run of the sweep resumes it; a job still pending or
running keeps its run queued / running; an end the run recorded (done, failed) stands.

- unit tests: a fake `squeue` / `sacct` (their real output formats, through subprocess.run), one
  run per terminal Slurm state, array tasks that never started, accounting switched off, and a
  local run whose process is gone;
- on the real Slurm: a two-run job array of the stand-in trainer, cancelled with one run
  running (run.json `running`) and one pending (no run.json).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments import run_state, slurm, submission, sweep_spec
from experiments import status as S

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
FAKE = "_helpers_sweep:fake_training"
ENDED = ["CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
         "COMPLETED"]
LIVE = {"PENDING", "RUNNING", "REQUEUED", "COMPLETING", "SUSPENDED", "CONFIGURING"}


# ------------------------------------------------------------------ a fake scheduler answer
class FakeSlurm:
    """`squeue` and `sacct` as a Slurm 22.05 controller answers them, from a table of jobs.

    squeue: one `id|STATE` line per job asked about with -j; jobs that ended are listed only with
    `-t all` (for MinJobAge seconds: `aged` lists those already forgotten); rc 1 "Invalid job id
    specified" when it knows none of them. sacct: its lines for the ids asked about, an array's
    lines (`12_[1-3%1]`, or `12` for an array cancelled before any task started) when the array's
    id is asked about. `accounting=False`: sacct fails as it does when accounting is off."""

    def __init__(self, jobs: dict[str, str], *, sacct_rows: dict[str, str] | None = None, aged: set = frozenset(),
                 accounting: bool = True, controller: bool = True):
        self.jobs, self.aged, self.accounting, self.controller = jobs, set(aged), accounting, controller
        self.sacct_rows = dict(sacct_rows if sacct_rows is not None else jobs)
        self.calls: list[list[str]] = []

    def which(self, name, *a, **k):
        return f"/usr/bin/{name}" if name in ("squeue", "sacct") else shutil.which(name, *a, **k)

    def run(self, cmd, *a, **k):
        if not isinstance(cmd, (list, tuple)) or cmd[0] not in ("squeue", "sacct"):
            return REAL_RUN(cmd, *a, **k)
        self.calls.append(list(cmd))
        ids = cmd[cmd.index("-j") + 1].split(",")
        done = lambda rc, out="", err="": subprocess.CompletedProcess(cmd, rc, out, err)  # noqa: E731
        if cmd[0] == "squeue":
            if not self.controller:
                return done(1, err="slurm_load_jobs error: Unable to contact slurm controller (connect failure)\n")
            every = "-t" in cmd and cmd[cmd.index("-t") + 1].lower() == "all"
            known = [j for j in ids if j in self.jobs and j not in self.aged]
            if not known:
                return done(1, err="slurm_load_jobs error: Invalid job id specified\n")
            sep = "|" if "%i|%T" in cmd else " "
            return done(0, "".join(f"{j}{sep}{self.jobs[j]}\n" for j in known
                                   if every or self.jobs[j].split()[0] in LIVE))
        if not self.accounting:
            return done(1, err="sacct: error: Slurm accounting storage is disabled\n")
        rows = [(j, s) for j, s in self.sacct_rows.items() if j in ids or j.split("_")[0] in ids]
        return done(0, "".join(f"{j}|{s}\n" for j, s in rows))


REAL_RUN = subprocess.run


@pytest.fixture
def fake_slurm(monkeypatch):
    def install(*args, **kwargs) -> FakeSlurm:
        fake = FakeSlurm(*args, **kwargs)
        monkeypatch.setattr(subprocess, "run", fake.run)
        monkeypatch.setattr(shutil, "which", fake.which)
        return fake

    return install


def _run_dir(root: Path, name: str, status: str | None, job_id: str | None = None, *, executor: str = "slurm",
             pid: int | None = None, **info) -> Path:
    d = root / "sw" / name
    d.mkdir(parents=True)
    if status:
        (d / "run.json").write_text(json.dumps({"status": status, "host": "another-node", **info}))
    if job_id:
        job = {"executor": executor, "job_id": job_id}
        job.update({"array_job_id": job_id.split("_")[0]} if executor == "slurm" else {"pid": pid})
        (d / "slurm.json").write_text(json.dumps(job))
    return d


def _specs(names) -> list[sweep_spec.RunSpec]:
    return [sweep_spec.RunSpec(name=n, sweep="sw", factor="train.loss", value=n, recipe="r", seed=0, config_files=(),
                      bindings=()) for n in names]


def _states(root: Path) -> dict[str, S.RunStatus]:
    return {r.run: r for r in S.collect(root / "sw")}


def _actions(root: Path, names) -> dict[str, run_state.Planned]:
    return {p.run.name: p for p in run_state.plan(_specs(names), root)}


# ------------------------------------------------------------------------------ unit tests
@pytest.mark.parametrize("state", ENDED)
@pytest.mark.parametrize("started", [True, False], ids=["running-in-run.json", "no-run.json"])
def test_a_job_that_ended_without_the_run_writing_is_interrupted_and_resumed(tmp_path, fake_slurm, state, started):
    """Every terminal Slurm state, long enough ago that squeue forgot the job (sacct answers)."""
    shown = "CANCELLED by 1000" if state == "CANCELLED" else state
    fake_slurm({"500_0": shown}, aged={"500_0"})
    _run_dir(tmp_path, "r", "running" if started else None, "500_0")
    (row,) = S.collect(tmp_path / "sw")
    assert (row.state, row.slurm) == ("interrupted", state), row
    assert f"Slurm job 500_0 ended {state}" in row.reason
    (p,) = run_state.plan(_specs(["r"]), tmp_path)
    assert p.action == "resume" and state in p.reason, p


def test_a_cancelled_job_that_was_signalled_like_a_preempted_one_is_reported_as_cancelled(tmp_path, fake_slurm):
    """scancel can reach the job's checkpoint handler before the kill (attempts.jsonl then ends with
    `interrupted`, as after a preemption): the plan still gives the scheduler's reason (seen once in CI)."""
    fake_slurm({"500_0": "CANCELLED by 0"}, aged={"500_0"})
    d = _run_dir(tmp_path, "r", "running", "500_0")
    (d / run_state.ATTEMPTS_FILE).write_text(json.dumps({"event": "start", "job_id": "500_0"}) + "\n"
                                     + json.dumps({"event": "interrupted", "job_id": "500_0"}) + "\n")
    assert run_state.was_interrupted(d)
    (p,) = run_state.plan(_specs(["r"]), tmp_path)
    assert p.action == "resume" and "Slurm job 500_0 ended CANCELLED" in p.reason, p


@pytest.mark.parametrize("state,shown", [("CANCELLED", "CANCELLED by 0"), ("FAILED", "FAILED"),
                                         ("COMPLETED", "COMPLETED"), ("TIMEOUT", "TIMEOUT")])
def test_a_run_that_recorded_failed_in_a_cancelled_job_is_interrupted_and_resumed(tmp_path, fake_slurm, state, shown):
    """scancel kills a run's processes together; learner rank 0 may live long enough to record the
    others' death as `failed`. Its job's state says CANCELLED: the run was stopped, not broken, so a
    re-run resumes it without --retry-failed. A failure in a job that ended any other way stands."""
    fake_slurm({"500_0": shown}, aged={"500_0"})
    _run_dir(tmp_path, "r", "failed", "500_0", error="PeerLost: generator 0 (pid 4242) exited: was killed by SIGKILL")
    (row,) = S.collect(tmp_path / "sw")
    (p,) = run_state.plan(_specs(["r"]), tmp_path)
    if state == "CANCELLED":
        assert (row.state, row.slurm) == ("interrupted", "CANCELLED"), row
        assert "Slurm job 500_0 was cancelled while the run trained" in row.reason
        assert p.action == "resume" and "cancelled" in p.reason, p
    else:
        assert (row.state, row.slurm) == ("failed", state), row
        assert p.action == "skip-failed" and "PeerLost" in p.reason, p
        (p,) = run_state.plan(_specs(["r"]), tmp_path, retry_failed=True)
        assert p.action == "retry"


def test_mixed_sweep_live_jobs_stay_live_recorded_ends_stand_ended_jobs_are_interrupted(tmp_path, fake_slurm, capsys):
    """What `scalerl status` prints for a sweep after `scancel` of part of its array (squeue still
    lists the cancelled jobs: they ended less than MinJobAge ago)."""
    fake_slurm({"70_0": "RUNNING", "70_1": "PENDING", "70_2": "CANCELLED", "70_3": "CANCELLED", "70_4": "FAILED",
                "70_5": "COMPLETED", "70_6": "CANCELLED", "70_7": "REQUEUED"})
    _run_dir(tmp_path, "a-running", "running", "70_0")
    _run_dir(tmp_path, "b-pending", None, "70_1")
    _run_dir(tmp_path, "c-cancelled-running", "running", "70_2")
    _run_dir(tmp_path, "d-cancelled-pending", None, "70_3")
    _run_dir(tmp_path, "e-failed-recorded", "failed", "70_4", error="ValueError: boom")
    _run_dir(tmp_path, "f-done", "done", "70_5")
    _run_dir(tmp_path, "g-done-then-cancelled", "done", "70_6")
    _run_dir(tmp_path, "h-requeued", "interrupted", "70_7")
    rows = _states(tmp_path)
    assert {n: (r.state, r.slurm) for n, r in rows.items()} == {
        "a-running": ("running", "RUNNING"), "b-pending": ("queued", "PENDING"),
        "c-cancelled-running": ("interrupted", "CANCELLED"), "d-cancelled-pending": ("interrupted", "CANCELLED"),
        "e-failed-recorded": ("failed", "FAILED"), "f-done": ("done", "COMPLETED"),
        "g-done-then-cancelled": ("done", "CANCELLED"), "h-requeued": ("queued", "REQUEUED")}
    assert "before the run recorded its end" in rows["c-cancelled-running"].reason
    assert "before the run started" in rows["d-cancelled-pending"].reason
    names = sorted(rows)
    actions = {n: p.action for n, p in _actions(tmp_path, names).items()}
    assert actions == {"a-running": "skip-active", "b-pending": "skip-active", "c-cancelled-running": "resume",
                       "d-cancelled-pending": "resume", "e-failed-recorded": "skip-failed", "f-done": "skip-done",
                       "g-done-then-cancelled": "skip-done", "h-requeued": "skip-active"}
    from experiments.cli import main

    capsys.readouterr()
    assert main(["status", str(tmp_path / "sw")]) == 0
    out = capsys.readouterr().out
    assert "2 done, 1 failed, 2 interrupted, 2 queued, 1 running" in out, out
    assert "c-cancelled-running interrupted: Slurm job 70_2 ended CANCELLED" in out.replace("\n", " ")


def test_array_tasks_that_never_started_are_found_through_their_array(tmp_path, fake_slurm):
    """sacct has no line of a task that never started: it is in the array's line (`600` for an
    array cancelled before any task ran, `601_[1-7:2%1]` for the pending rest of a throttled one)."""
    fake_slurm({}, sacct_rows={"600": "CANCELLED by 0", "601_0": "CANCELLED by 0", "601_[1-7:2%1]": "CANCELLED by 0",
                               "602_0": "TIMEOUT", "602_[1-2]": "PENDING"})
    _run_dir(tmp_path, "a", None, "600_0")
    _run_dir(tmp_path, "b", None, "600_1")
    _run_dir(tmp_path, "c", "running", "601_0")
    _run_dir(tmp_path, "d", None, "601_5")
    _run_dir(tmp_path, "e", "running", "602_0")
    rows = _states(tmp_path)
    assert {n: (r.state, r.slurm) for n, r in rows.items()} == {
        "a": ("interrupted", "CANCELLED"), "b": ("interrupted", "CANCELLED"), "c": ("interrupted", "CANCELLED"),
        "d": ("interrupted", "CANCELLED"), "e": ("interrupted", "TIMEOUT")}
    assert slurm.array_task_ids("1-7:2%1") == {"1", "3", "5", "7"} and slurm.array_task_ids("0,4-5") == {"0", "4", "5"}
    assert {p.action for p in run_state.plan(_specs("abcde"), tmp_path)} == {"resume"}


def test_without_accounting_a_job_squeue_no_longer_lists_is_gone(tmp_path, fake_slurm):
    """sacct unavailable (accounting off): a job neither in squeue nor recorded done is gone; a job
    squeue still lists keeps its state; with no controller answering nothing is decided."""
    fake = fake_slurm({"80_0": "RUNNING", "81_0": "CANCELLED"}, aged={"81_0"}, accounting=False)
    _run_dir(tmp_path, "live", "running", "80_0")
    _run_dir(tmp_path, "gone", "running", "81_0")
    _run_dir(tmp_path, "gone-queued", None, "82_3")
    rows = _states(tmp_path)
    assert {n: (r.state, r.slurm) for n, r in rows.items()} == {
        "live": ("running", "RUNNING"), "gone": ("interrupted", "GONE"), "gone-queued": ("interrupted", "GONE")}
    assert "no longer known to Slurm" in rows["gone"].reason
    assert any(c[0] == "sacct" for c in fake.calls)  # it was asked, and failed
    assert {n: p.action for n, p in _actions(tmp_path, ["live", "gone", "gone-queued"]).items()} == {
        "live": "skip-active", "gone": "resume", "gone-queued": "resume"}

    fake_slurm({}, controller=False, accounting=False)  # the controller is down: run.json's word stands
    rows = _states(tmp_path)
    assert {n: r.state for n, r in rows.items()} == {"live": "running", "gone": "running", "gone-queued": "queued"}


def _hold_lock(path: Path) -> subprocess.Popen:
    """A process holding the trainer's run-directory lock (as components.trainer.run_owner.lock_run_dir takes it)."""
    code = ("import fcntl, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f.fileno(), fcntl.LOCK_EX); "
            "print('locked', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_local_run_whose_process_is_gone_is_interrupted(tmp_path):
    """run.json `running` on this machine: running while a process holds the run's lock (or its
    recorded pid lives), interrupted once none does; another machine's run is left as it says."""
    here = socket.gethostname()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    locked = _run_dir(tmp_path, "locked", "running", host=here)
    free = _run_dir(tmp_path, "free", "running", host=here)
    (free / ".lock").touch()
    (locked / ".lock").touch()
    _run_dir(tmp_path, "pid-dead", None, str(dead.pid), executor="local", pid=dead.pid)
    _run_dir(tmp_path, "elsewhere", "running", host="another-node").joinpath(".lock").touch()
    holder = _hold_lock(locked / ".lock")
    try:
        rows = {r.run: r for r in S.collect(tmp_path / "sw", with_slurm=False)}
        assert {n: r.state for n, r in rows.items()} == {"locked": "running", "free": "interrupted",
                                                         "pid-dead": "interrupted", "elsewhere": "running"}
        assert "no process on this machine is training it" in rows["free"].reason
        actions = {n: p.action for n, p in _actions(tmp_path, sorted(rows)).items()}
        assert actions == {"locked": "skip-active", "free": "resume", "pid-dead": "resume", "elsewhere": "submit"}
    finally:
        holder.kill()
        holder.wait()
    assert S.collect(tmp_path / "sw" / "locked", with_slurm=False)[0].state == "interrupted"


def test_a_run_restarted_outside_slurm_after_its_job_ended_is_not_that_job(tmp_path, fake_slurm, monkeypatch):
    """`scalerl train ... --run-dir` after the sweep's job was cancelled (what status suggests for an
    interrupted run): run.json records that this attempt runs outside Slurm, so the old job's
    CANCELLED says nothing about it: running (not resubmitted) while it holds the run's lock,
    interrupted once the lock is free."""
    from components.trainer.runlog import RunInfo

    for var in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(var, raising=False)
    d = _run_dir(tmp_path, "manual", None, "77_0")
    RunInfo(d).start({}, {"device": "cpu", "count": 1}, resumed=True)  # what the restarted trainer writes
    (d / ".lock").touch()
    fake_slurm({"77_0": "CANCELLED by 0"})
    holder = _hold_lock(d / ".lock")
    try:
        assert _states(tmp_path)["manual"].state == "running"
        assert _actions(tmp_path, ["manual"])["manual"].action == "skip-active"
    finally:
        holder.kill()
        holder.wait()
    row = _states(tmp_path)["manual"]
    assert row.state == "interrupted" and "no process on this machine is training it" in row.reason


# -------------------------------------------------------------------------- on the real Slurm
def _cluster_problem() -> str | None:
    if shutil.which("sbatch") is None:
        return "sbatch is not on PATH (start one with scripts/setup_slurm.sh, as root)"
    out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    if out.returncode != 0 or not out.stdout.strip():
        return f"sinfo gives no nodes ({out.stderr.strip()}): is slurmctld running?"
    return None


_PROBLEM = _cluster_problem()
if _PROBLEM and os.environ.get("CI"):
    raise RuntimeError(f"CI needs the real Slurm cluster: {_PROBLEM}")


def _live(job_ids) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-r", "-o", "%i %T", "-j", ",".join(job_ids)], capture_output=True,
                         text=True, timeout=30).stdout
    return [ln for ln in out.splitlines() if ln.strip()]


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.skipif(_PROBLEM is not None, reason=f"no Slurm cluster: {_PROBLEM}")
def test_scancel_of_a_sweep_array_shows_its_runs_interrupted_and_a_rerun_resumes_them(tmp_path, monkeypatch, capsys):
    """The issue's case: a sweep's job array (two runs of the stand-in trainer, one at a time) is
    cancelled while run 0 runs (run.json `running`, nothing else written) and run 1 is pending."""
    from _helpers_sweep import FAKE_RECIPE

    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("SCALERL_FAKE_STEP_S", "120")  # run 0 stays in its first step until cancelled
    monkeypatch.chdir(REPO)
    (tmp_path / "recipe.gin").write_text(FAKE_RECIPE)
    spec = sweep_spec.parse_spec_text('sweep.name = "sc"\nsweep.base = "%s"\nsweep.factor = "train.total_steps"\n'
                             "sweep.values = [2, 3]" % (tmp_path / "recipe.gin"))
    runs = sweep_spec.expand(spec, "paper")
    root = tmp_path / "runs"
    opts = submission.LaunchOptions(executor="slurm", partition="debug", time_min=2, cpus=1, array_parallelism=1, target=FAKE)
    submitted = submission.submit(run_state.plan(runs, root), opts, root, "sc")
    ids = [str(job.job_id) for _, job in submitted]
    first = submitted[0][0].run_dir / "run.json"
    try:
        deadline = time.time() + 40
        while not (first.exists() and json.loads(first.read_text()).get("status") == "running"):
            assert time.time() < deadline, f"run 0 did not start: {_live(ids)}"
            time.sleep(0.5)
        assert not (submitted[1][0].run_dir / "run.json").exists()  # run 1 is still pending
        before = {r.run: r.state for r in S.collect(root / "sc")}
        assert before == {submitted[0][0].run.name: "running", submitted[1][0].run.name: "queued"}, before
    finally:
        subprocess.run(["scancel", ids[0].split("_")[0]], check=False)
    deadline = time.time() + 30  # the cancelled task gets SIGTERM, then SIGKILL after KillWait
    while _live(ids):
        assert time.time() < deadline, f"still live after scancel: {_live(ids)}"
        time.sleep(0.5)
    assert json.loads(first.read_text())["status"] == "running"  # the killed job could not write
    rows = {r.run: r for r in S.collect(root / "sc")}
    assert {n: (r.state, r.slurm) for n, r in rows.items()} == {
        p.run.name: ("interrupted", "CANCELLED") for p, _ in submitted}, rows
    planned = {p.run.name: p for p in run_state.plan(runs, root)}
    assert {n: p.action for n, p in planned.items()} == {p.run.name: "resume" for p, _ in submitted}
    assert all("CANCELLED" in p.reason for p in planned.values()), planned
    from experiments.cli import main

    capsys.readouterr()
    assert main(["status", str(root / "sc")]) == 0
    out = capsys.readouterr().out
    assert "2 interrupted" in out and "running" not in out and "queued" not in out, out


def test_a_failure_recorded_beside_an_unwritable_run_directory_stands(tmp_path, fake_slurm):
    """A run that failed where it could not write run.json recorded the failure in the trainer's
    fallback file (components.trainer.runlog, issue 14 item 6): failed with that error, not
    interrupted, even though run.json says running and the job ended FAILED."""
    from components.trainer.runlog import failure_fallback_paths

    fake_slurm({"90_0": "FAILED"})
    d = _run_dir(tmp_path, "ro", "running", "90_0", started="2026-01-01T00:00:00+00:00")
    failure_fallback_paths(d)[0].write_text(json.dumps({
        "run_dir": str(d.absolute()), "status": "failed", "error": "OSError: [Errno 30] Read-only file system",
        "finished": "2026-01-01T01:00:00+00:00"}))
    (row,) = S.collect(tmp_path / "sw")
    assert (row.state, row.slurm) == ("failed", "FAILED") and "Read-only" in row.error
    assert [p.action for p in run_state.plan(_specs(["ro"]), tmp_path)] == ["skip-failed"]
