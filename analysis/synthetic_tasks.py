"""Synthetic task-mixture runs and downstream-benchmark records, in the trainer's exact format.

For the figure tests and docs (Figs 1b, 9b, 10b, 11, 17b, 18 and Table 1's math / code rows),
beside `analysis.synthetic` (whose `write_run` writes the run directory this module extends):

    write_mixture_run(root, "math_code", laws={"math": (0.595, 2.05, 2896), "code": (0.615, 1.09, 1675)})
    add_downstream(run_dir, {"aime24": 0.6})        # downstream records beside every held-out evaluation
    write_task_sweeps(root, scale=1e-4)             # the math_code sweep + downstream records for the
                                                    # sweeps of Figs 1b, 9b, 10b, 17b found under root

Per-task held-out pass rates follow Eq. 1 with each task's own (A, B, C_mid) (Table 1's math +
code rows by default); the run's pass_rate is their mean. A downstream record's mean@k is a
fixed fraction of the held-out pass rate at that evaluation (+ seeded noise), and its pass@k is
that of problems all solved with probability mean@k, 1 - (1 - mean@k)^k.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from analysis.scaling_law import sigmoid
from analysis.synthetic import write_run

__all__ = ["TASK_LAWS", "DOWNSTREAM_SWEEPS", "write_mixture_run", "add_downstream", "write_task_sweeps"]

# Table 1's math + code run (A, B, C_mid at scale 1, i.e. GPU-hours).
TASK_LAWS: dict[str, tuple[float, float, float]] = {"math": (0.595, 2.05, 2896.0), "code": (0.615, 1.09, 1675.0)}
# The sweeps whose runs carry downstream records in `write_task_sweeps`: benchmark -> fraction of
# the held-out pass rate (AIME-24 sits well below the validation set, PAPER.md §3).
DOWNSTREAM_SWEEPS: dict[str, dict[str, float]] = {
    "model_size": {"aime24": 0.55},
    "generation_length": {"aime24": 0.55},
    "batch_size": {"aime24": 0.55},
    "generations_per_prompt": {"aime24": 0.55},
    "math_code": {"aime24": 0.55, "livecodebench": 0.45},
}


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _write(path: Path, rows: Sequence[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_mixture_run(root: str | Path, sweep: str = "math_code", name: str = "math+code-seed0", *,
                      laws: Mapping[str, tuple[float, float, float]] = TASK_LAWS, scale: float = 1.0,
                      R0: float = 0.1, noise: float = 0.005, seed: int = 0, **kwargs: Any) -> Path:
    """A run trained on a task mixture: eval.jsonl ``per_task`` follows each task's law.

    kwargs go to `analysis.synthetic.write_run` (steps, eval_every, k, prompts, device, count, ...).
    Compute spans 4 x the largest C_mid unless `final_compute` is given.
    """
    scaled = {t: (A, B, C * scale) for t, (A, B, C) in laws.items()}
    kwargs.setdefault("final_compute", 4.0 * max(C for _, _, C in scaled.values()))
    A_mean = float(np.mean([A for A, _, _ in scaled.values()]))
    B_mean = float(np.mean([B for _, B, _ in scaled.values()]))
    C_mean = float(np.mean([C for _, _, C in scaled.values()]))
    run_dir = write_run(root, sweep, name, A=A_mean, B=B_mean, C_mid=C_mean, R0=R0, factor="train.task",
                        value="+".join(laws), seed=seed, noise=noise,
                        tasks=tuple(laws), **kwargs)
    rng = np.random.default_rng([seed, zlib.crc32(f"{sweep}/{name}/tasks".encode())])
    rows = _read(run_dir / "eval.jsonl")
    out = []
    for row in rows:
        if "benchmark" in row:
            out.append(row)
            continue
        c = float(row["compute_hours"])
        per_task = {}
        for t, (A, B, C) in scaled.items():
            v = float(sigmoid(c, A, B, C, R0))
            per_task[t] = float(np.clip(v + (rng.normal(0, noise) if c > 0 else 0.0), 0.0, 1.0))
        out.append({**row, "per_task": per_task, "pass_rate": float(np.mean(list(per_task.values())))})
    _write(run_dir / "eval.jsonl", out)
    return run_dir


def add_downstream(run_dir: str | Path, benchmarks: Mapping[str, float], *, k: int = 16, noise: float = 0.01,
                   prompts: int = 30) -> Path:
    """Append a downstream record per benchmark after every held-out evaluation of the run.

    mean@k = fraction x held-out pass rate (+ N(0, noise), seeded); pass@j = 1 - (1 - mean@k)^j
    for j = 1, 2, 4, ... k. Records already present are replaced.
    """
    from components.trainer.evaluation import pass_ks

    run_dir = Path(run_dir)
    rows = [r for r in _read(run_dir / "eval.jsonl") if "benchmark" not in r]
    rng = np.random.default_rng(zlib.crc32(f"{run_dir.name}/downstream".encode()))
    out = []
    for row in rows:
        out.append(row)
        for name, fraction in benchmarks.items():
            m = float(np.clip(fraction * float(row["pass_rate"]) + rng.normal(0, noise), 0.0, 1.0))
            out.append({"step": row["step"], "compute_hours": row["compute_hours"], "flops": row.get("flops"),
                        "benchmark": name, "k": int(k), "prompts": int(prompts), "mean@k": m,
                        "pass@k": {str(j): float(1.0 - (1.0 - m) ** j) for j in pass_ks(k)}})
    _write(run_dir / "eval.jsonl", out)
    return run_dir


def write_task_sweeps(root: str | Path, *, scale: float = 1.0, downstream_k: int = 16, **kwargs: Any) -> dict[str, list[Path]]:
    """The math_code sweep (a mixture run + a math-only reference run) under `root`, and downstream
    records for every run of the DOWNSTREAM_SWEEPS found under `root` (write those first, e.g.
    with `analysis.synthetic.write_paper_sweeps`). kwargs go to `write_run`."""
    root = Path(root)
    mix = write_mixture_run(root, "math_code", "math+code-seed0", scale=scale, **kwargs)
    A, B, C = TASK_LAWS["math"]
    ref_kwargs = {k: v for k, v in kwargs.items() if k not in ("final_compute",)}
    ref = write_run(root, "math_code", "math-only-seed0", A=0.61, B=1.92, C_mid=2542 * scale, factor="train.task",
                    value="math", tasks=("math",), final_compute=4.0 * max(c for _, _, c in TASK_LAWS.values()) * scale,
                    **ref_kwargs)
    out: dict[str, list[Path]] = {"math_code": [mix, ref]}
    for sweep, benches in DOWNSTREAM_SWEEPS.items():
        runs = sorted(p.parent for p in (root / sweep).glob("*/run.json")) if (root / sweep).is_dir() else []
        for run_dir in runs:
            add_downstream(run_dir, benches, k=downstream_k)
        if sweep != "math_code":
            out[sweep] = runs
    return out
