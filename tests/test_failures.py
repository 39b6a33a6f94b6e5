"""A dead or hung process is named within a minute, every other process exits, run.json says
failed with that error, and running the same command again resumes (issue 10, item 5)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from _helpers_trainer import read_jsonl, run_json, start_training_subprocess, tiny_model, write_gin, write_user_task


@pytest.fixture(autouse=True)
def _fresh_gin():
    import gin

    gin.clear_config()
    yield
    gin.clear_config()


def run_processes(run_dir: Path) -> dict:
    """{rank: pid} of the live worker processes of the run in `run_dir` (found by their environment)."""
    marker = f"SCALERL_SETUP={Path(run_dir).resolve() / '.scalerl' / 'setup.pkl'}".encode()
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        if marker in env and ") Z " not in stat:  # zombies are dead
            rank = next((int(e.split(b"=", 1)[1]) for e in env if e.startswith(b"SCALERL_RANK=")), None)
            if rank is not None:
                found[rank] = int(proc.name)
    return found


def _config(tmp_path: Path, total: int, **kw) -> str:
    module = write_user_task(tmp_path)
    return write_gin(
        tmp_path / "run.gin",
        tiny_model(tmp_path.parent / "model"),
        imports=(module,),
        train__task='"trainer_test_arithmetic"',
        train__task_kwargs='{"num_train": 120, "num_eval": 8, "max_operand": 12, "operators": "+", "verify_sleep": 0.02}',
        train__total_steps=str(total),
        train__checkpoint_every="2",
        train__eval_every="100",
        train__heartbeat_s="0.5",
        train__heartbeat_timeout_s="8",
        **kw,
    )


def _kill_and_check(tmp_path: Path, gin_file: str, victim_rank: int, victim_name: str, sig=signal.SIGKILL, total: int = 40):
    run_dir = tmp_path / "run"
    proc = start_training_subprocess(gin_file, str(run_dir), tmp_path / "train.log")
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            steps = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
            if len(steps) >= 3 and any((run_dir / "checkpoints").glob("step_*")):
                break
            assert proc.poll() is None, (tmp_path / "train.log").read_text()
            time.sleep(0.1)
        else:
            pytest.fail("the run never reached step 3:\n" + (tmp_path / "train.log").read_text())
        pids = run_processes(run_dir)
        assert victim_rank in pids, pids
        t_kill = time.time()
        os.kill(pids[victim_rank], sig)
        proc.wait(timeout=120)  # the launcher returns once learner-0 ended the run and it killed what is left
        named_after = time.time() - t_kill
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    info = run_json(run_dir)
    log = (tmp_path / "train.log").read_text()
    assert info["status"] == "failed", (info, log[-3000:])
    assert victim_name in info["error"], (info["error"], log[-3000:])
    assert named_after < 60, f"the failure took {named_after:.0f} s to surface"
    time.sleep(1.0)
    assert run_processes(run_dir) == {}, "every process of the run must exit (a stopped one is killed by the launcher)"
    steps_before = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert steps_before and steps_before[-1] < total
    return run_dir


def _resume(run_dir: Path, gin_file: str, total: int) -> None:
    from experiments.train import run_training

    assert run_training([gin_file], [], str(run_dir), progress=False) == "done"
    info = run_json(run_dir)
    assert info["status"] == "done" and info["resumes"] >= 1
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, total + 1))


@pytest.mark.slow
def test_kill9_generator_is_named_and_the_run_resumes(tmp_path):
    gin_file = _config(tmp_path, 40)
    run_dir = _kill_and_check(tmp_path, gin_file, victim_rank=1, victim_name="generator-0")
    _resume(run_dir, gin_file, 40)  # the same command, the same directory (other settings would be refused)


@pytest.mark.slow
def test_kill9_learner_rank_is_named_and_the_run_resumes(tmp_path):
    gin_file = _config(tmp_path, 40, train__learner_ranks="2")
    run_dir = _kill_and_check(tmp_path, gin_file, victim_rank=1, victim_name="learner-1")
    _resume(run_dir, gin_file, 40)


@pytest.mark.slow
def test_hung_generator_is_named(tmp_path):
    gin_file = _config(tmp_path, 40)
    _kill_and_check(tmp_path, gin_file, victim_rank=1, victim_name="generator-0", sig=signal.SIGSTOP)
