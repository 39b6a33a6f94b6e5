"""The main job end to end: `scalerl train experiments/configs/tiny_cpu.gin`, exactly as the README runs it.

It builds (or finds in the cache) the warm-started tiny policy, trains it with the ScaleRL
recipe on the torch engine, evaluates, fits the sigmoid law and writes the figure. The test
checks what the user is promised: the held-out pass rate starts low and rises clearly, the
run is recorded as done, the fit and the figure are written, and it stays inside the
10-minute budget.

The warm start is built into a fresh cache directory (as on a fresh machine), then copied into
the test session's cache (tests/conftest.py), where the Slurm tests that run later find it.
`SCALERL_TEST_REUSE_CACHE=1` reuses the user's cache instead (faster on a second local run).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "experiments" / "configs" / "tiny_cpu.gin"
BUDGET_S = 10 * 60

pytestmark = pytest.mark.slow


def _scalerl() -> list[str]:
    exe = Path(sys.executable).with_name("scalerl")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "experiments.cli"]


@pytest.mark.timeout(BUDGET_S + 300)
def test_main_job_learns_and_fits(tmp_path):
    env = dict(os.environ)
    session_cache = os.environ.get("SCALERL_CACHE_DIR")  # tests/conftest.py
    if not os.environ.get("SCALERL_TEST_REUSE_CACHE"):
        env["SCALERL_CACHE_DIR"] = str(tmp_path / "cache")
    run_dir = tmp_path / "run"
    t0 = time.perf_counter()
    proc = subprocess.run(
        _scalerl() + ["train", str(CONFIG), "--run-dir", str(run_dir), "--no-progress"],
        cwd=str(REPO), env=env, capture_output=True, text=True, timeout=BUDGET_S + 240,
    )
    elapsed = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]

    info = json.loads((run_dir / "run.json").read_text())
    assert info["status"] == "done", info

    report = json.loads((run_dir / "report.json").read_text())
    start, end = report["start_pass_rate"], report["end_pass_rate"]
    print(f"main job: {elapsed:.0f}s, held-out pass rate {start:.3f} -> {end:.3f}, fit {report['fit']}")
    assert start <= 0.35, f"the warm policy starts too high ({start:.3f}): no room for RL to show"
    assert end >= start + 0.2, f"RL did not raise the held-out pass rate clearly: {start:.3f} -> {end:.3f}"
    assert end >= 0.5, f"end pass rate {end:.3f}"
    fit = report["fit"]
    assert fit is not None, report.get("fit_error")
    assert fit["A"] > start and fit["B"] > 0 and fit["C_mid"] > 0
    for ext in ("png", "pdf"):
        assert (run_dir / f"pass_rate_vs_compute.{ext}").stat().st_size > 1000
    # what the user sees: start and end values and the fit, A with its profile interval
    assert "held-out pass rate: start" in out and "sigmoid law fit: A=" in out
    assert "asymptote A: A = " in out and "95% profile interval [" in out and "identified" in out, out[-3000:]
    assert report["A_interval"]["low"] <= fit["A"] <= report["A_interval"]["high"]
    # the budget (timings on a shared machine are noisy: the margin is in the config)
    assert elapsed < BUDGET_S * 1.5, f"main job took {elapsed:.0f}s (budget {BUDGET_S}s on a quiet 2-core machine)"
    # `scalerl eval RUN_DIR`, no flags: the final policy on the run's own held-out set, as the run evaluates it
    evaluated = subprocess.run(_scalerl() + ["eval", str(run_dir)], cwd=str(tmp_path), env=env, capture_output=True,
                               text=True, timeout=600)
    assert evaluated.returncode == 0, evaluated.stderr[-4000:]
    rec = json.loads((run_dir / "downstream.jsonl").read_text().splitlines()[-1])
    assert rec["benchmark"] == "held_out" and (rec["k"], rec["prompts"]) == (8, 200)  # train.eval_k, train.eval_prompts
    assert rec["precision"] == "bf16_fp32_head" and rec["length_control"].startswith("interruption(")
    assert abs(rec["mean@k"] - end) < 0.1, (rec["mean@k"], end)  # the same policy on the same prompts, other samples
    if session_cache and not os.environ.get("SCALERL_TEST_REUSE_CACHE"):
        for built in (tmp_path / "cache").glob("warm-*"):  # the Slurm tests' jobs start from it
            if not (Path(session_cache) / built.name).exists():
                part = Path(session_cache) / f".{built.name}.partial"
                shutil.copytree(built, part)
                part.rename(Path(session_cache) / built.name)
