"""A live adaptive sweep on the REAL local Slurm (issues 32 and 41): the tiny loss_type sweep plus a
planted loser (CISPO at 100x the learning rate), 3 seeds (a stop rests on the pair's own paired
interval: with 2 seeds it has one degree of freedom), rungs 0.25 / 0.5 / 1.0 of a small FLOP
budget; `--only` keeps CISPO and the loser (six runs: DAPO and GSPO add run time, not a case; the
rule's choices among several survivors are tested on synthetic curves in tests/test_adaptive.py).
The planted loser stops at the first rung on its own paired interval against the leader; CISPO
resumes from its own checkpoints in the same run directories, and its metrics continue without a
gap or a repeated step. A re-run of the same command re-decides nothing. `scalerl status` names
the stop."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SPEC = "experiments/sweeps/adaptive/loss_type_planted.gin"
BUDGET = 3e11  # FLOPs: ~30 tiny steps (1e10 each), rungs at ~7, ~15 and ~30 steps
CONFIGS = ("cispo", "planted_lr_x100")
SEEDS = (0, 1, 2)


def _problem() -> str | None:
    if shutil.which("sbatch") is None:
        return "sbatch is not on PATH (start one with scripts/setup_slurm.sh, as root)"
    out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    return None if out.returncode == 0 and out.stdout.strip() else f"sinfo gives no nodes ({out.stderr.strip()})"


_PROBLEM = _problem()
if _PROBLEM and os.environ.get("CI"):
    raise RuntimeError(f"CI needs the real Slurm cluster: {_PROBLEM}")
pytestmark = [pytest.mark.slurm, pytest.mark.slow,
              pytest.mark.skipif(_PROBLEM is not None, reason=f"no Slurm cluster: {_PROBLEM}")]


@pytest.fixture(scope="module")
def warm_model() -> str:
    """tiny_cpu.gin's warm-started policy (built before the jobs start, or the session's cache)."""
    import gin

    from experiments.train import prepare

    cfg, _, _ = prepare([str(REPO / "experiments/configs/tiny_cpu.gin")], [])
    gin.clear_config()
    return cfg.model_path


def _steps(path: Path) -> list[int]:
    return [json.loads(x)["step"] for x in path.read_text().splitlines() if x.strip()]


def test_adaptive_sweep_stops_the_planted_loser_and_resumes_the_rest(tmp_path, warm_model, monkeypatch, capsys):
    from experiments import status as S
    from experiments.cli import main

    monkeypatch.chdir(REPO)
    runs = tmp_path / "runs"
    args = ["sweep", SPEC, "--scale", "tiny", "--executor", "slurm", "--partition", "debug", "--time", "10",
            "--runs", str(runs), "--adaptive", "--rungs", "0.25,0.5,1.0", "--seeds", *map(str, SEEDS),
            "--only", *[f"{c}-s{seed}" for c in CONFIGS for seed in SEEDS],
            "--gin", f'model.path = "{warm_model}"', "--gin", f"train.compute_budget_flops = {BUDGET:g}",
            "--gin", "train.eval_every = 4", "--gin", "train.eval_prompts = 50", "--gin", "train.checkpoint_every = 100"]
    assert main(args) == 0, capsys.readouterr().out
    sweep = runs / "loss_type_planted"
    decisions = [json.loads(x) for x in (sweep / "adaptive.jsonl").read_text().splitlines()]
    first = {d["config"]: d for d in decisions if d["rung"] == 0.25}
    assert first["planted_lr_x100"]["verdict"] == "worse" and first["planted_lr_x100"]["action"] == "stop"
    assert first["planted_lr_x100"]["paired"] and first["planted_lr_x100"]["high"] < 0
    assert first["planted_lr_x100"]["n"] == len(SEEDS) and first["planted_lr_x100"]["pair"][0] == "planted_lr_x100"
    # one comparison (Holm's first step over 1), ALPHA split over 2 early rungs: the two-sided 1 − 0.05/(1·2) interval
    assert first["planted_lr_x100"]["level"] == pytest.approx(1 - 0.05 / (1 * 2))
    assert first["planted_lr_x100"]["rule"].startswith("tail: worse")
    stopped = {d["config"] for d in decisions if d["action"] == "stop"}
    survivors = {"cispo"} - stopped
    assert survivors, decisions
    assert {d["rung"] for d in decisions} == {0.25, 0.5, 1.0}
    # the planted loser trained to the first rung only; every survivor to the full budget, each step once
    for seed in SEEDS:
        planted = _steps(sweep / f"planted_lr_x100-s{seed}" / "metrics.jsonl")
        assert planted == list(range(1, len(planted) + 1)) and 0 < len(planted) < 15
        for cfg in survivors:
            d = sweep / f"{cfg}-s{seed}"
            steps = _steps(d / "metrics.jsonl")
            assert steps == list(range(1, len(steps) + 1)), (cfg, steps)  # no gap, no repeat across rungs
            last = json.loads((d / "metrics.jsonl").read_text().splitlines()[-1])
            assert last["flops"] >= BUDGET and len(steps) > len(planted)
            history = json.loads((d / "slurm.json").read_text())["history"]
            assert [h["action"] for h in history][1:] and all(h["action"] == "resume" for h in history[1:])
            evals = _steps(d / "eval.jsonl")
            assert evals == sorted(set(evals)), evals  # no evaluation repeated at a rung boundary
    # a re-run of the same command re-decides nothing and submits nothing
    capsys.readouterr()
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "decided before" in out and len((sweep / "adaptive.jsonl").read_text().splitlines()) == len(decisions)
    rows = {r.run: r for r in S.collect(sweep, with_slurm=False)}
    assert not any(name.startswith(("gspo", "dapo")) for name in rows), sorted(rows)  # --only held
    assert rows["planted_lr_x100-s0"].state == "stopped"
    assert rows["planted_lr_x100-s0"].reason.startswith("stopped (rung 0.25: worse than ")
