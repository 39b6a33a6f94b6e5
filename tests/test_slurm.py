"""Sweeps on a REAL single-node Slurm cluster (the repository's own: scripts/setup_slurm.sh installs
and starts it from scripts/slurm/, as root; `scripts/test.sh` and `.ci/run` do that first).

- the tiny `loss_type` sweep through `scalerl sweep --executor slurm`: one job array of 3 runs
  of the real trainer, each finishes and logs, `scalerl status` shows them, a re-run skips them;
- a deliberately failing run is reported failed with its error (run.json, sacct, status);
- a run preempted mid-training (submitit's signal, USR2) is checkpointed, requeued by Slurm
  and resumes from its last checkpoint: its metrics have no gap and no duplicate step.

Where `sbatch` is absent these tests skip with a message, except under CI (env CI set),
where they fail: CI must have the cluster.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from experiments import run_state, submission, sweep_spec
from experiments import status as S

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
FAKE = "_helpers_sweep:fake_training"


def _cluster_problem() -> str | None:
    if shutil.which("sbatch") is None:
        return "sbatch is not on PATH (start one with scripts/setup_slurm.sh, as root)"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as err:
        return f"sinfo failed: {err}"
    if out.returncode != 0 or not out.stdout.strip():
        return f"sinfo gives no nodes ({out.stderr.strip()}): is slurmctld running?"
    return None


_PROBLEM = _cluster_problem()
if _PROBLEM and os.environ.get("CI"):
    raise RuntimeError(f"CI needs the real Slurm cluster: {_PROBLEM}")
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.skipif(_PROBLEM is not None, reason=f"no Slurm cluster: {_PROBLEM}"),
]

# Seconds a requeued job stays held before the tests release it (see the requeue tests).
RELEASE_AFTER_S = 5

# Keep the real trainer's runs short on a 2-core machine.
TINY = [
    "model.new_model = True",  # model_dir starts missing: a new tiny model is built there
    "train.total_steps = 2",
    "train.eval_every = 1",
    "train.eval_prompts = 16",
    "train.checkpoint_every = 1",
    'train.task_kwargs = {"num_train": 200, "num_eval": 16, "max_operand": 30, "operators": "+"}',
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # built once by the first job that needs it (model.new_model = True in TINY)
    return tmp_path_factory.mktemp("slurm_model") / "tiny"


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    # jobs inherit this environment (sbatch --export=ALL): the stand-in trainer is importable
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.chdir(REPO)


def _squeue(job_id: str) -> str:
    return subprocess.run(["squeue", "-h", "-r", "-o", "%T %r", "-j", job_id], capture_output=True, text=True,
                          timeout=30).stdout.strip()


def _job_span(job_id: str) -> tuple[float, float]:
    """(start, end) of a finished job, in epoch seconds, from sacct (accounting may lag a moment)."""
    from datetime import datetime

    deadline = time.time() + 60
    while True:
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "Start,End"], capture_output=True, text=True,
                             timeout=30).stdout.strip().splitlines()
        if out and "Unknown" not in out[0] and "|" in out[0]:
            start, end = out[0].split("|")[:2]
            return datetime.fromisoformat(start).timestamp(), datetime.fromisoformat(end).timestamp()
        assert time.time() < deadline, f"sacct has no start/end for job {job_id}: {out}"
        time.sleep(2)


def _steps(path: Path) -> list[int]:
    return [json.loads(x)["step"] for x in path.read_text().splitlines() if x.strip()]


def test_tiny_loss_type_sweep_is_one_job_array_and_every_run_finishes(tmp_path, model_dir, capsys):
    from experiments.cli import main

    runs = tmp_path / "runs"
    # no --cpus: each run reserves one CPU per process (2), so the 2-CPU node runs one run at a time
    args = ["sweep", "experiments/sweeps/loss_type.gin", "--scale", "tiny", "--executor", "slurm",
            "--partition", "debug", "--time", "10", "--runs", str(runs), "--wait",
            "--gin", f'model.path = "{model_dir}"'] + [a for b in TINY for a in ("--gin", b)]
    t0 = time.time()
    assert main(args) == 0, capsys.readouterr().out
    print(f"3-run tiny sweep on Slurm: {time.time() - t0:.1f} s")
    sweep = runs / "loss_type"
    jobs = {}
    for loss in ("dapo", "gspo", "cispo"):
        d = sweep / f"{loss}-s0"
        info = json.loads((d / "run.json").read_text())
        assert info["status"] == "done" and info["value"] == loss and info["sweep"] == "loss_type"
        assert _steps(d / "metrics.jsonl") == [1, 2]
        assert (d / "eval.jsonl").read_text().strip(), "no held-out evaluation logged"
        assert 'train.loss = "%s"' % loss in (d / "config.gin").read_text().replace("'", '"')
        jobs[loss] = json.loads((d / "slurm.json").read_text())
    # one job array: same array id, tasks 0..2
    assert len({j["array_job_id"] for j in jobs.values()}) == 1
    assert sorted(j["job_id"].split("_")[1] for j in jobs.values()) == ["0", "1", "2"]
    # runs never share cores unless asked: no two runs of the array ran at the same time
    spans = sorted(_job_span(j["job_id"]) for j in jobs.values())
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), f"overlapping runs: {spans}"

    deadline = time.time() + 60  # accounting (sacct) may lag the end of a job by a moment
    while any(r.slurm != "COMPLETED" for r in S.collect(sweep)) and time.time() < deadline:
        time.sleep(2)
    capsys.readouterr()
    assert main(["status", str(sweep)]) == 0
    out = capsys.readouterr().out
    for loss in ("dapo", "gspo", "cispo"):
        assert f"{loss}-s0" in out
    assert out.count("COMPLETED") == 3 and "3 done" in out, out

    # re-running the sweep submits nothing: every run is done
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "nothing to submit" in out and out.count("skip-done") == 3


def test_failing_run_is_reported_failed_with_its_error(tmp_path, capsys):
    from _helpers_sweep import FAKE_RECIPE

    from experiments.cli import main

    (tmp_path / "recipe.gin").write_text(FAKE_RECIPE)
    spec = tmp_path / "mixed.gin"
    spec.write_text('sweep.name = "mixed"\nsweep.base = "recipe.gin"\nsweep.tiny_base = "recipe.gin"\n'
                    'sweep.factor = "model.path"\nsweep.variants = {"ok1": [], "ok2": ["train.total_steps = 2"], '
                    '"broken": [\'model.path = "/nonexistent/missing-model"\']}\n')
    runs = tmp_path / "runs"
    rc = main(["sweep", str(spec), "--executor", "slurm", "--partition", "debug", "--time", "5", "--runs", str(runs),
               "--trainer", FAKE, "--wait"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "broken-s0 failed" in out and "does not exist" in out and "2 done, 1 failed" in out
    deadline = time.time() + 60  # accounting (sacct) may lag the end of a job by a moment
    while {r.slurm for r in S.collect(runs / "mixed")} != {"COMPLETED", "FAILED"} and time.time() < deadline:
        time.sleep(2)
    rows = {r.run: r for r in S.collect(runs / "mixed")}
    assert rows["broken-s0"].state == "failed" and "missing-model" in rows["broken-s0"].error
    assert rows["broken-s0"].slurm == "FAILED"
    assert rows["ok1-s0"].state == "done" and rows["ok1-s0"].slurm == "COMPLETED" and rows["ok1-s0"].step == 3
    assert main(["status", str(runs / "mixed")]) == 0
    out = capsys.readouterr().out
    assert "FAILED" in out and "missing-model" in out


def test_unknown_partition_is_refused_before_submission(tmp_path, capsys):
    from experiments.cli import main

    rc = main(["sweep", "loss_type", "--scale", "tiny", "--executor", "slurm", "--partition", "gpu_nope",
               "--runs", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 2 and "unknown Slurm partition 'gpu_nope'" in out and "debug" in out
    assert not any(tmp_path.iterdir())


def test_preempted_run_is_requeued_and_resumes_from_its_checkpoint(tmp_path, model_dir):
    """Preemption as Slurm does it: USR2 to the job (submitit's signal). submitit calls
    RunJob.checkpoint, requeues the job (`scontrol requeue`) and exits; the new attempt
    resumes the real trainer from the run's latest checkpoint."""
    spec = sweep_spec.load_spec("loss_type")
    (run,) = [r for r in sweep_spec.expand(spec, "tiny") if r.name == "cispo-s0"]
    extra = tuple(TINY) + ("train.total_steps = 6", "train.eval_every = 3", f'model.path = "{model_dir}"')
    run = dataclasses.replace(run, bindings=run.bindings + extra)
    root = tmp_path / "runs"
    opts = submission.LaunchOptions(executor="slurm", partition="debug", time_min=10)
    ((planned, job),) = submission.submit(run_state.plan([run], root), opts, root, "loss_type")
    metrics = planned.run_dir / "metrics.jsonl"
    deadline = time.time() + 240
    while not (metrics.exists() and len(_steps(metrics)) >= 2):
        assert time.time() < deadline, f"run did not reach step 2; job state {_squeue(job.job_id)}"
        time.sleep(0.5)
    subprocess.check_call(["scancel", "--signal=USR2", job.job_id])
    requeued = False
    pending_since = None
    while True:
        state = _squeue(job.job_id)
        if not state:
            break
        if state.startswith("PENDING") and not requeued:
            # Slurm holds a requeued job for its credential lifetime (~2 min, BeginTime);
            # as the admin, release it so the test stays short, once the previous attempt
            # is cleaned up (a release within ~1 s gets it killed: "Job credential revoked").
            pending_since = pending_since or time.time()
            if time.time() - pending_since >= RELEASE_AFTER_S:
                requeued = True
                subprocess.run(["scontrol", "update", f"JobId={job.job_id}", "StartTime=now"], check=False)
        assert time.time() < deadline + 240, f"job still {state}"
        time.sleep(1)
    assert requeued, "the job was never requeued"
    attempts = [json.loads(x) for x in (planned.run_dir / run_state.ATTEMPTS_FILE).read_text().splitlines()]
    assert [a["restart_count"] for a in attempts if "restart_count" in a] == [0, 1]
    assert [a.get("event") for a in attempts] == [None, "interrupted", None]  # start, checkpoint(), start
    info = json.loads((planned.run_dir / "run.json").read_text())
    assert info["status"] == "done"
    assert _steps(metrics) == [1, 2, 3, 4, 5, 6]  # no gap, no duplicate across the requeue
    deadline = time.time() + 60  # accounting (sacct) may lag the end of a job by a moment
    while S.collect(root / "loss_type")[0].slurm != "COMPLETED" and time.time() < deadline:
        time.sleep(2)
    (row,) = S.collect(root / "loss_type")
    assert row.state == "done" and row.slurm == "COMPLETED" and row.step == 6


def test_run_hitting_its_time_limit_is_requeued_and_resumes(tmp_path, monkeypatch):
    """A real Slurm time limit (1 minute, the smallest): submitit asks for USR2 `signal_delay`
    seconds before it, checkpoints, requeues; the next attempt resumes (stand-in trainer,
    one step per second, so the first attempt cannot finish in time). slurmctld checks time
    limits every 30 s and sends the warning up to 30 s early, so with 40 s before the 1-minute
    limit USR2 comes 0-30 s into an attempt: 40 steps (40 s) are more than one attempt can do
    (with 30, an attempt that got its signal at 30 s had already finished)."""
    from _helpers_sweep import FAKE_RECIPE

    monkeypatch.setenv("SCALERL_FAKE_STEP_S", "1.0")
    (tmp_path / "recipe.gin").write_text(FAKE_RECIPE)
    spec = sweep_spec.parse_spec_text('sweep.name = "tl"\nsweep.base = "%s"\nsweep.factor = "train.total_steps"\n'
                             "sweep.values = [40]" % (tmp_path / "recipe.gin"))
    runs = sweep_spec.expand(spec, "paper")
    root = tmp_path / "runs"
    opts = submission.LaunchOptions(executor="slurm", partition="debug", time_min=1, signal_delay_s=40, target=FAKE)
    ((planned, job),) = submission.submit(run_state.plan(runs, root), opts, root, "tl")
    deadline = time.time() + 300
    released = set()
    held_since: dict[int, float] = {}
    while True:
        state = _squeue(job.job_id)
        if not state:
            break
        attempts = (planned.run_dir / run_state.ATTEMPTS_FILE)
        n = len(attempts.read_text().splitlines()) if attempts.exists() else 0
        if state.startswith("PENDING") and "BeginTime" in state and n not in released:
            # release the requeued job from Slurm's ~2 min hold, as the admin, once settled
            if time.time() - held_since.setdefault(n, time.time()) >= RELEASE_AFTER_S:
                released.add(n)
                subprocess.run(["scontrol", "update", f"JobId={job.job_id}", "StartTime=now"], check=False)
        assert time.time() < deadline, f"job still {state}"
        time.sleep(1)
    lines = [json.loads(x) for x in (planned.run_dir / run_state.ATTEMPTS_FILE).read_text().splitlines()]
    starts = [a for a in lines if "restart_count" in a]
    assert [a["restart_count"] for a in starts] == list(range(len(starts))) and len(starts) >= 2
    assert any(a.get("event") == "interrupted" for a in lines)
    assert json.loads((planned.run_dir / "run.json").read_text())["status"] == "done"
    assert _steps(planned.run_dir / "metrics.jsonl") == list(range(1, 41))
    log = "".join(p.read_text() for p in (root / "tl" / ".submitit").glob("*_log.err"))
    assert "timed-out" in log, "submitit did not see a time-out"


# ---------------------------------------------------------------------------------------------
# one run as several Slurm tasks (issue 10, item 6): 2 learner ranks + 1 generator = 3 tasks on
# the 2-CPU node (--overcommit), roles from the rank
MULTI = TINY + ["train.learner_ranks = 2", "train.num_generators = 1"]


def _held_out(run_dir: Path) -> list[float]:
    return [json.loads(x)["pass_rate"] for x in (run_dir / "eval.jsonl").read_text().splitlines()
            if x.strip() and "benchmark" not in json.loads(x)]


@pytest.fixture(scope="module")
def warm_model() -> str:
    """tiny_cpu.gin's warm-started policy, built here before the job starts, or found in the session's
    cache (tests/conftest.py), where the main job's test copied it in a whole-suite run."""
    import gin

    from experiments.train import prepare

    cfg, _, _ = prepare([str(REPO / "experiments/configs/tiny_cpu.gin")], [])
    gin.clear_config()
    return cfg.model_path


def test_one_run_as_three_slurm_tasks_learns(tmp_path, warm_model, capsys):
    from experiments.cli import main

    run_dir = tmp_path / "runs" / "multi" / "r0"
    bindings = [b for b in MULTI if not b.startswith(("train.total_steps", "train.eval_every", "train.checkpoint_every",
                                                          "train.eval_prompts", "train.task_kwargs"))]
    bindings += ["train.total_steps = 40", "train.eval_every = 20", "train.checkpoint_every = 20", "train.eval_prompts = 100"]
    args = ["train", "experiments/configs/tiny_cpu.gin", "--executor", "slurm", "--partition", "debug", "--time", "10",
            "--tasks-per-node", "3", "--overcommit", "--run-dir", str(run_dir), "--wait", "--no-progress",
            "--gin", f'model.path = "{warm_model}"'] + [a for b in bindings for a in ("--gin", b)]
    t0 = time.time()
    rc = main(args)
    out = capsys.readouterr().out
    assert rc == 0, out + "\n" + (run_dir / "error.txt").read_text() if (run_dir / "error.txt").exists() else out
    print(f"3-task run on Slurm: {time.time() - t0:.1f} s")
    info = json.loads((run_dir / "run.json").read_text())
    assert info["status"] == "done" and info["hardware"]["learner_ranks"] == 2 and info["hardware"]["processes"] == 3
    assert "Slurm job" in out
    job = json.loads((run_dir / "slurm.json").read_text())
    assert job["tasks_per_node"] == 3
    # the job really had 3 tasks, one per process: sacct's step has 3 tasks
    steps = subprocess.run(["sacct", "-n", "-P", "-j", job["job_id"], "-o", "JobName,NTasks"], capture_output=True,
                           text=True, timeout=30).stdout
    assert any(line.split("|")[1] == "3" for line in steps.splitlines() if "|" in line and line.split("|")[1]), steps
    assert _steps(run_dir / "metrics.jsonl") == list(range(1, 41))
    held = _held_out(run_dir)
    print(f"held-out pass rate of the 3-task run: {held}")
    assert held[-1] > held[0] + 0.05, f"held-out pass rate did not rise: {held}"
    assert (run_dir / "final" / "config.json").is_file()


def test_sweep_of_two_multi_task_runs_completes(tmp_path, model_dir, capsys):
    from experiments.cli import main

    runs = tmp_path / "runs"
    args = ["sweep", "experiments/sweeps/loss_type.gin", "--scale", "tiny", "--executor", "slurm", "--only", "dapo-s0",
            "cispo-s0", "--partition", "debug", "--time", "10", "--runs", str(runs), "--wait", "--tasks-per-node", "3",
            "--overcommit", "--gin", f'model.path = "{model_dir}"'] + [a for b in MULTI for a in ("--gin", b)]
    assert main(args) == 0, capsys.readouterr().out
    for loss in ("dapo", "cispo"):
        d = runs / "loss_type" / f"{loss}-s0"
        info = json.loads((d / "run.json").read_text())
        assert info["status"] == "done" and info["hardware"]["learner_ranks"] == 2, info
        assert _steps(d / "metrics.jsonl") == [1, 2]


def _slurm_task_pids(job_id: str) -> dict:
    """{SLURM_PROCID: pid} of the live (not zombie) Python task processes of a Slurm job on this node."""
    marker = f"SLURM_JOB_ID={job_id}".encode()
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            stat = (proc / "stat").read_text()
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if marker in env and b"python" in cmd and ") Z " not in stat:
            rank = next((int(e.split(b"=", 1)[1]) for e in env if e.startswith(b"SLURM_PROCID=")), None)
            if rank is not None:
                found.setdefault(rank, int(proc.name))
    return found


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_a_stopped_task_of_a_multi_task_run_is_killed_and_the_run_fails(tmp_path, warm_model, how):
    """One run as 2 Slurm tasks (learner-0, generator-0): the generator's task is SIGSTOPped
    mid-run. learner-0 names it and exits 1; srun's --kill-on-bad-exit then kills the stopped
    task, so the job ends within 60 s instead of holding its node until the time limit.
    Or the generator's task is SIGKILLed: srun then SIGTERMs learner-0 at once and SIGKILLs it
    KillWait later (5 s on this Slurm, 30 s by default), and learner-0 must have named the dead
    task by then, from its closed connection (2 heartbeats + 1 s, not the 8 s timeout)."""
    from experiments.cli import main

    run_dir = tmp_path / "runs" / how / "r0"
    bindings = [b for b in TINY if not b.startswith(("model.new_model", "train.total_steps"))]
    bindings += ["train.total_steps = 100000", "train.learner_ranks = 1", "train.num_generators = 1",
                 "train.heartbeat_timeout_s = 8", "train.heartbeat_s = 0.5", f'model.path = "{warm_model}"']
    args = ["train", "experiments/configs/tiny_cpu.gin", "--executor", "slurm", "--partition", "debug", "--time", "10",
            "--tasks-per-node", "2", "--overcommit", "--run-dir", str(run_dir), "--no-progress"]
    assert main(args + [a for b in bindings for a in ("--gin", b)]) == 0
    job_id = json.loads((run_dir / "slurm.json").read_text())["job_id"]
    try:
        deadline = time.time() + 240
        while not (run_dir / "metrics.jsonl").is_file() or not (run_dir / "metrics.jsonl").read_text().strip():
            assert time.time() < deadline, f"the run never logged a step: {_squeue(job_id)}"
            time.sleep(1)
        pids = _slurm_task_pids(job_id)
        assert set(pids) == {0, 1}, pids
        os.kill(pids[1], signal.SIGSTOP if how == "stop" else signal.SIGKILL)
        stopped_at = time.time()
        while _squeue(job_id) or _slurm_task_pids(job_id):
            assert time.time() - stopped_at < 60, f"60 s after the {how}: {_squeue(job_id)!r}, {_slurm_task_pids(job_id)}"
            time.sleep(1)
        info = json.loads((run_dir / "run.json").read_text())
        assert info["status"] == "failed" and "generator-0" in info.get("error", ""), info
        if how == "kill":
            assert "closed its connection to the hub without saying goodbye" in info["error"], info
    finally:
        subprocess.run(["scancel", job_id], timeout=30)


def _restart_controller(fresh: bool) -> str:
    """Stop slurmctld (its jobs stay saved in /var/spool/slurmctld) and start it again through
    scripts/slurm/start.sh; the script's output."""
    pid = subprocess.run(["pidof", "slurmctld"], capture_output=True, text=True).stdout.split()
    for p in pid:
        os.kill(int(p), signal.SIGTERM)
    deadline = time.time() + 60
    while subprocess.run(["pidof", "slurmctld"], capture_output=True).returncode == 0:
        assert time.time() < deadline, "slurmctld did not stop within 60 s"
        time.sleep(0.2)
    env = dict(os.environ, SCALERL_SLURM_FRESH="1" if fresh else "0")
    out = subprocess.run(["bash", str(REPO / "scripts" / "slurm" / "start.sh")], capture_output=True, text=True,
                         env=env, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def _queued_ids() -> set[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=30)
    return set(out.stdout.split())


def test_a_fresh_start_cancels_the_jobs_a_controller_saved_and_a_plain_one_keeps_them():
    """Why CI once ran 90 minutes into its limit: a controller started again brings back the
    jobs saved by the one before (here a held probe), and they take the one node. .ci/run sets
    SCALERL_SLURM_FRESH=1, with which start.sh cancels them before the node's slurmd starts."""
    if os.geteuid() != 0:
        pytest.skip("restarting slurmctld needs root")
    if _queued_ids() and not os.environ.get("CI"):
        pytest.skip(f"the queue holds jobs ({sorted(_queued_ids())[:5]}) that a fresh start would cancel")
    probe = subprocess.run(["sbatch", "--parsable", "--hold", "-J", "scalerl-fresh-probe", "--wrap", "true"],
                           capture_output=True, text=True, timeout=30)
    assert probe.returncode == 0, probe.stderr
    job = probe.stdout.strip().split(";")[0]
    saved = len(_queued_ids())  # the probe, and in CI whatever else was queued (a fresh start cancels it all)
    try:
        out = _restart_controller(fresh=False)
        assert job in _queued_ids(), "a plain restart should bring the saved job back"
        assert f"jobs in the queue ({saved})" in out and ("scalerl-fresh-probe" in out or saved > 10), out  # lists 10
        out = _restart_controller(fresh=True)
        assert f"SCALERL_SLURM_FRESH=1: cancelling the {saved} job(s) an earlier controller saved" in out, out
        assert job not in _queued_ids(), "a fresh start must cancel the saved job"
        state = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job, "-o", "State"], capture_output=True,
                               text=True, timeout=30).stdout.splitlines()
        assert state and state[-1].startswith("CANCELLED"), state  # "CANCELLED by 0"
    finally:
        if subprocess.run(["sinfo", "-h"], capture_output=True, timeout=30).returncode != 0:  # left down by a failure
            subprocess.run(["bash", str(REPO / "scripts" / "slurm" / "start.sh")], capture_output=True, timeout=180)
        subprocess.run(["scancel", job], capture_output=True, timeout=30)


def test_the_node_guard_names_a_job_that_takes_the_node_and_ignores_a_held_one():
    from _slurm_queue import wait_for_free_node

    held = subprocess.run(["sbatch", "--parsable", "--hold", "-J", "scalerl-held-probe", "--wrap", "true"],
                          capture_output=True, text=True, timeout=30).stdout.strip()
    busy = subprocess.run(["sbatch", "--parsable", "-J", "scalerl-busy-probe", "--wrap", "sleep 120"],
                          capture_output=True, text=True, timeout=30).stdout.strip()
    assert held and busy
    try:
        t0 = time.monotonic()
        problem = wait_for_free_node(limit_s=3, poll_s=0.5)
        assert problem is not None and time.monotonic() - t0 < 30
        assert f"{busy} scalerl-busy-probe" in problem and "scancel" in problem, problem
        assert "scalerl-held-probe" not in problem, problem
        subprocess.run(["scancel", busy], timeout=30)
        assert wait_for_free_node(limit_s=60, poll_s=0.5) is None  # the held job does not count
    finally:
        subprocess.run(["scancel", held, busy], capture_output=True, timeout=30)
