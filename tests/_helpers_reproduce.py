"""A stand-in trainer for the `scalerl reproduce` tests ONLY (the job function a sweep calls).

It trains nothing: it writes a finished run directory in the trainer's format (run.json,
config.gin, metrics.jsonl with the accounting fields, eval.jsonl; plus checkpoints/ and
final/, which collection must leave behind) whose pass rate follows the paper's law for the
run's configuration (analysis.synthetic). A run named in env SCALERL_FAKE_CONTENDED
(comma-separated "<sweep>/<run>") reports 30% CPU contention on its first attempt only (no
earlier attempt set aside in <sweep>/.contended/), so the re-run path can be tested.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

from analysis.runs import config_name
from analysis.synthetic import DEFAULT_LAW, SYNTHETIC_SWEEPS, write_run
from experiments.synthetic_study import launch_config_name


def fake_run(config_files: Sequence[str], bindings: Sequence[str] = (), run_dir: str | None = None, *,
             run_info: dict | None = None) -> str:
    run_dir = Path(run_dir)
    info_path = run_dir / "run.json"
    old = json.loads(info_path.read_text()) if info_path.exists() else {}
    if old.get("status") == "done":
        return "done"
    info = dict(run_info or {})
    sweep, name = info["sweep"], info["name"]
    laws = {}
    if sweep in SYNTHETIC_SWEEPS:
        factor, values = SYNTHETIC_SWEEPS[sweep]
        laws = {launch_config_name(factor, v): law for v, law in values.items()}
    A, B, C_mid = laws.get(config_name(name), DEFAULT_LAW)
    first_try = not list((run_dir.parent / ".contended").glob(f"{name}-*"))
    contended = f"{sweep}/{name}" in os.environ.get("SCALERL_FAKE_CONTENDED", "").split(",") and first_try
    write_run(run_dir.parent.parent, sweep, name, A=A, B=B, C_mid=C_mid * 1e-4, factor=info.get("factor"),
              value=info.get("value"), recipe=info.get("recipe", "scalerl"), seed=int(info.get("seed", 0)),
              steps=40, eval_every=2, device="cpu", count=2, noise=0.004, contention=0.3 if contended else 0.01,
              run_info={"starts": old.get("starts", 0) + 1, "bindings": list(bindings)})
    with open(run_dir / "config.gin", "a") as f:  # as the trainer's operative config, the run's bindings
        f.write("".join(f"{b}\n" for b in bindings))
    (run_dir / "checkpoints" / "step_000040.pt").write_bytes(b"\0" * 1024)
    (run_dir / "final").mkdir(exist_ok=True)
    (run_dir / "final" / "model.safetensors").write_bytes(b"\0" * 1024)
    return "done"
