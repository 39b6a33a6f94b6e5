"""A stand-in for `experiments.train.run_training`, for the sweep/Slurm tests ONLY.

It honours the trainer's contract (run.json status, append-only metrics.jsonl/eval.jsonl,
atomic checkpoints, resume from the latest checkpoint, "done" returns at once) but trains
nothing, so the launcher's mechanics (job arrays, failures, requeue) are tested in seconds.
It reads the run's real gin config (`train.total_steps`, `train.seed`, `model.path`) through
the trainer's own `train` configurable.

Knobs: `model.path` containing "missing" makes the run fail with a FileNotFoundError;
env SCALERL_FAKE_STEP_S sets the seconds per step (default 0.05).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Sequence

import components.trainer.config  # noqa: F401  (registers the `train` and `model` configurables)

FAKE_RECIPE = """
model.path = "/tmp/fake-model"
train.total_steps = 3
train.eval_every = 1
train.checkpoint_every = 1
"""


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def _config(config_files: Sequence[str], bindings: Sequence[str]):
    import gin
    from components.trainer.config import train_config

    gin.clear_config()
    gin.parse_config_files_and_bindings(list(config_files), list(bindings))
    try:  # model.path as written: the fake model is never resolved (nor looked for on disk)
        return train_config(model_path=gin.query_parameter("model.path"))
    finally:
        gin.clear_config()


def fake_training(config_files: Sequence[str], bindings: Sequence[str] = (), run_dir: str | None = None, *,
                  run_info: dict | None = None) -> str:
    run_dir = Path(run_dir or "runs/fake")
    run_dir.mkdir(parents=True, exist_ok=True)
    info_path = run_dir / "run.json"
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    if info.get("status") == "done":
        return "done"
    info.update(run_info or {})
    info.update(status="running", started=info.get("started", time.time()), pid=os.getpid(),
                starts=info.get("starts", 0) + 1)
    _write_json(info_path, info)
    try:
        cfg = _config(config_files, bindings)
        if "missing" in cfg.model_path:
            raise FileNotFoundError(f"model.path {cfg.model_path!r} does not exist")
        ck_dir = run_dir / "checkpoints"
        ck_dir.mkdir(exist_ok=True)
        cks = sorted(ck_dir.glob("step_*.json"))
        start = json.loads(cks[-1].read_text())["step"] if cks else 0
        # the metrics log is truncated to the checkpoint: no duplicate steps after a resume
        for name in ("metrics.jsonl", "eval.jsonl"):
            p = run_dir / name
            if p.exists():
                rows = [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
                p.write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] <= start))
        step_s = float(os.environ.get("SCALERL_FAKE_STEP_S", "0.05"))
        for step in range(start + 1, cfg.total_steps + 1):
            time.sleep(step_s)
            compute = step * 0.01
            with open(run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "compute_hours": compute, "seed": cfg.seed}) + "\n")
            with open(run_dir / "eval.jsonl", "a") as f:
                rate = 0.1 + 0.5 * step / (step + 5.0)
                f.write(json.dumps({"step": step, "compute_hours": compute, "pass_rate": rate}) + "\n")
            tmp = ck_dir / f".step_{step:06d}.tmp"
            tmp.write_text(json.dumps({"step": step}))
            os.replace(tmp, ck_dir / f"step_{step:06d}.json")
        info.update(status="done", finished=time.time())
        _write_json(info_path, info)
        return "done"
    except Exception as err:  # the trainer records the error and returns "failed"
        info.update(status="failed", error=f"{type(err).__name__}: {err}")
        _write_json(info_path, info)
        return "failed"
