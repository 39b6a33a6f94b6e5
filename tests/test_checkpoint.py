"""Checkpoint and resume: kill -9 mid-run, resume, logs continue with no gap and no duplicate;
ppo_off_policy(1) on CPU with a fixed seed ends bit-for-bit equal to an uninterrupted run."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from _helpers_trainer import read_jsonl, run_json, start_training_subprocess, tiny_model, write_gin, write_user_task
from components.trainer.checkpoint import latest_checkpoint
from components.trainer.runlog import repair_jsonl


@pytest.fixture(autouse=True)
def _fresh_gin():
    """Gin bindings are process-global: start and end every test with none."""
    import gin

    gin.clear_config()
    yield
    gin.clear_config()



def test_repair_jsonl_truncates_partial_line_and_later_steps(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "x": 1')  # killed mid-line
    assert repair_jsonl(p, 2) == 2
    assert [r["step"] for r in read_jsonl(p)] == [1, 2]
    assert p.read_text().endswith("\n")
    repair_jsonl(p, None)  # no checkpoint at all: a fresh start
    assert p.read_text() == ""


def _config(tmp_path: Path, name: str, total_steps: int, **kw) -> str:
    module = write_user_task(tmp_path)
    return write_gin(
        tmp_path / f"{name}.gin",
        tiny_model(tmp_path.parent / "model"),
        imports=(module,),
        train__task='"trainer_test_arithmetic"',
        train__task_kwargs='{"num_train": 120, "num_eval": 8, "max_operand": 12, "operators": "+", "verify_sleep": %s}' % kw.pop("sleep", 0.0),
        train__total_steps=str(total_steps),
        train__checkpoint_every="5",
        train__eval_every="5",
        train__keep_checkpoints="100",
        **kw,
    )


def _final_model(run_dir: Path) -> dict:
    """The run's final policy (RUN_DIR/final, written from its last checkpoint)."""
    from safetensors.torch import load_file

    return load_file(str(run_dir / "final" / "model.safetensors"))


@pytest.mark.slow
def test_kill9_resume_no_gap_and_bitwise_equal(tmp_path):
    from experiments.train import run_training

    total = 14
    # the killed run: a slow verifier (10 ms a sample) so a kill lands mid-way
    gin_killed = _config(tmp_path, "killed", total, sleep=0.01)
    run_killed = tmp_path / "runs" / "killed"
    proc = start_training_subprocess(gin_killed, str(run_killed), tmp_path / "killed.log")
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            steps = [r["step"] for r in read_jsonl(run_killed / "metrics.jsonl")] if (run_killed / "metrics.jsonl").exists() else []
            if len(steps) >= 7 and latest_checkpoint(run_killed / "checkpoints") is not None:
                break
            assert proc.poll() is None, (tmp_path / "killed.log").read_text()
            time.sleep(0.02)
        else:
            pytest.fail("the run never reached step 7:\n" + (tmp_path / "killed.log").read_text())
        os.killpg(proc.pid, signal.SIGKILL)  # the run and its generator process
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    steps_at_kill = [r["step"] for r in read_jsonl(run_killed / "metrics.jsonl")]
    assert 7 <= len(steps_at_kill) < total, "the kill must land mid-way"
    assert run_json(run_killed)["status"] == "running"  # killed: no chance to write anything

    # resume (same call, same directory) and finish
    assert run_training([gin_killed], [], str(run_killed), progress=False) == "done"
    info = run_json(run_killed)
    assert info["status"] == "done" and info["resumes"] == 1
    steps = [r["step"] for r in read_jsonl(run_killed / "metrics.jsonl")]
    assert steps == list(range(1, total + 1)), "no gap and no duplicated step"
    eval_steps = [r["step"] for r in read_jsonl(run_killed / "eval.jsonl")]
    assert eval_steps == [0, 5, 10, 14]
    assert [r["version"] for r in read_jsonl(run_killed / "metrics.jsonl")] == list(range(1, total + 1))
    # compute keeps accumulating across the resume
    hours = [r["compute_hours"] for r in read_jsonl(run_killed / "metrics.jsonl")]
    assert all(b >= a for a, b in zip(hours, hours[1:]))

    # an uninterrupted run of the same config (no slow verifier needed)
    gin_ref = _config(tmp_path, "reference", total, sleep=0.0)
    run_ref = tmp_path / "runs" / "reference"
    assert run_training([gin_ref], [], str(run_ref), progress=False) == "done"
    ref, resumed = _final_model(run_ref), _final_model(run_killed)
    assert ref.keys() == resumed.keys()
    for key in ref:
        assert torch.equal(ref[key], resumed[key]), f"{key} differs after kill -9 + resume"
    # the logged learning signal matches step by step too
    for a, b in zip(read_jsonl(run_ref / "metrics.jsonl"), read_jsonl(run_killed / "metrics.jsonl")):
        assert (a["step"], a["reward_mean"], a["loss"], a["grad_norm"]) == (b["step"], b["reward_mean"], b["loss"], b["grad_norm"])

    # safe to call again: a done run returns at once
    assert run_training([gin_killed], [], str(run_killed), progress=False) == "done"
    assert [r["step"] for r in read_jsonl(run_killed / "metrics.jsonl")] == list(range(1, total + 1))
