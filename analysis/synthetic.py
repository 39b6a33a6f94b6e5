"""Synthetic run directories from sigmoid parameters, in the exact trainer format.

For tests (analysis, figures, `scalerl status`, the reproduction report) and docs: every file
and field of DESIGN.md "A run directory" is written, with the held-out pass rate following
Eq. 1 plus seeded noise, and the compute-accounting fields (`epoch`, `cpu_hours`, per-process
CPU and run-queue time, `contention`, `eval_wall_s`, `startup_s`; eval: `eval_wall_s`,
`eval_compute_hours`, held-out `entropy`; run.json: `reserved_cpus`).

    write_run(root, "loss_type", "cispo-seed0", A=0.6, B=1.8, C_mid=0.05, factor="train.loss", value="cispo")
    write_sweep(root, "batch_size", "train.prompts_per_step", {"bs512": (0.605, 1.77, 2818), "bs2048": (0.645, 1.70, 10909)})
    write_paper_sweeps(root)   # every sweep the paper figures need (SYNTHETIC_SWEEPS)

`experiments.synthetic_study.write_study` writes the whole study (every shipped sweep spec) with them.
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from analysis.scaling_law import sigmoid

__all__ = ["write_run", "write_sweep", "write_paper_sweeps", "SYNTHETIC_SWEEPS", "SYNTHETIC_SEEDS", "DEFAULT_LAW",
           "run_name"]

# sweep -> (factor, {value: (A, B, C_mid in units of the scale, i.e. GPU-hours at scale 1)}).
# Sweep names, factors and values mirror experiments/sweeps/*.gin; (A, B, C_mid) follow the
# paper's findings (Table 1 where it has numbers; PAPER.md §3 otherwise). For a one-value
# sweep with several seeds (scalerl_seeds) every seed gets the same law and its own noise.
SYNTHETIC_SWEEPS: dict[str, tuple[str, dict[Any, tuple[float, float, float]]]] = {
    "model_size": ("model.path", {"8B": (0.610, 1.92, 2542), "scout-17Bx16": (0.710, 1.65, 4242)}),
    "recipes": ("recipe", {
        "deepseek_grpo.gin": (0.49, 1.6, 3000), "qwen_dapo.gin": (0.52, 1.7, 2900),
        "magistral.gin": (0.53, 1.8, 2800), "minimax.gin": (0.58, 1.77, 2700), "scalerl.gin": (0.61, 1.97, 2542),
    }),
    "off_policy": ("train.off_policy", {"ppo_off_policy-k1": (0.52, 1.2, 4000), "ppo_off_policy-k8": (0.52, 1.3, 3800),
                                        "pipeline_rl-k8": (0.52, 1.9, 2600)}),
    "pipeline_k": ("pipeline_rl.k", {4: (0.52, 1.85, 2600), 8: (0.52, 1.9, 2600), 12: (0.49, 1.8, 2700)}),
    "loss_type": ("train.loss", {"dapo": (0.52, 1.8, 2600), "gspo": (0.595, 1.7, 2700), "cispo": (0.595, 1.6, 2900)}),
    "fp32_head": ("train.precision", {"bf16": (0.52, 1.8, 2600), "bf16_fp32_head": (0.61, 1.8, 2600)}),
    "loss_aggregation": ("train.aggregation", {"sample_mean": (0.56, 1.8, 2600), "prompt_mean": (0.59, 1.8, 2600),
                                               "token_mean": (0.55, 1.8, 2600)}),
    "advantage_norm": ("train.advantage_norm", {"prompt": (0.58, 1.8, 2600), "batch": (0.585, 1.85, 2600),
                                                "none": (0.58, 1.75, 2600)}),
    "zero_variance_filtering": ("train.curriculum", {"zero_variance_filter": (0.58, 1.8, 2600),
                                                     "all_prompts": (0.55, 1.8, 2600)}),
    "no_positive_resampling": ("train.curriculum", {"no_positive_resampling": (0.59, 1.8, 2600),
                                                    "uniform": (0.56, 1.8, 2600)}),
    "length_control": ("train.length_control", {"interruption": (0.61, 1.9, 2542),
                                                "length_penalty": (0.60, 1.8, 2700)}),
    "batch_size": ("train.prompts_per_step", {"bs512": (0.605, 1.77, 2818), "bs768": (0.610, 1.92, 2542),
                                              "bs2048": (0.645, 1.70, 10909)}),
    "generation_length": ("interruption.thinking_max", {"gen14k": (0.610, 1.92, 2542), "gen32k": (0.645, 1.89, 11272)}),
    "generations_per_prompt": ("train.generations_per_prompt", {
        "gen8": (0.585, 2.44, 2542), "gen16": (0.610, 1.92, 2542), "gen24": (0.590, 2.22, 3054),
        "gen32": (0.595, 2.07, 2936)}),
    "dapo_clip": ("losses.dapo.eps_high", {0.2: (0.50, 1.8, 2600), 0.26: (0.53, 1.8, 2600), 0.28: (0.52, 1.8, 2600)}),
    "cispo_clip": ("losses.cispo.eps_max", {4.0: (0.60, 1.9, 2600), 5.0: (0.605, 1.9, 2600), 8.0: (0.60, 1.85, 2600)}),
    "gspo_clip": ("losses.gspo.eps_high", {"gspo_4_3_e4": (0.55, 1.5, 3200), "gspo_4_3_e3": (0.59, 1.8, 2700),
                                           "gspo_5_3_e3": (0.60, 1.8, 2700)}),
    "leave_one_out": ("leave_one_out", {
        "scalerl": (0.610, 2.01, 2542), "loo-8op": (0.600, 1.80, 2900), "loo-dapo": (0.605, 1.77, 2800),
        "loo-fp32": (0.610, 1.85, 2857), "loo-savg": (0.595, 1.85, 2700), "loo-plan": (0.600, 1.90, 2600),
        "loo-batch": (0.600, 1.80, 2800), "loo-lp": (0.605, 1.85, 2700),
    }),
    "scalerl_seeds": ("recipe", {"scalerl.gin": (0.610, 1.92, 2542)}),
}
# Seeds written per sweep (default: seed 0 only).
SYNTHETIC_SEEDS: dict[str, tuple[int, ...]] = {"scalerl_seeds": (0, 1, 2)}


def run_name(factor: str | None, value: Any, seed: int) -> str:
    """A stable directory name: <value>-seed<seed> (the factor's last part when the value is a number)."""
    v = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    if isinstance(value, (int, float)) and factor:
        v = f"{factor.rsplit('.', 1)[-1]}={v}"
    return f"{v}-seed{seed}".replace("/", "_")


def _iso(t: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(t, tz=dt.timezone.utc).isoformat()


def write_run(
    root: str | Path,
    sweep: str,
    name: str | None = None,
    *,
    A: float,
    B: float,
    C_mid: float,
    R0: float = 0.1,
    factor: str | None = None,
    value: Any = None,
    recipe: str = "scalerl",
    seed: int = 0,
    steps: int = 100,
    eval_every: int = 5,
    compute_per_step: float | None = None,
    final_compute: float | None = None,
    noise: float = 0.005,
    k: int = 16,
    prompts: int = 1000,
    tasks: Sequence[str] = ("math",),
    status: str = "done",
    error: str | None = None,
    device: str = "cuda",
    count: int = 80,
    partial_last_line: bool = False,
    with_evals: bool = True,
    params_per_token_flops: float = 8e9,
    epochs: float | None = 6.0,
    contention: float = 0.01,
    startup_s: float = 8.0,
    benchmarks: Sequence[str] = (),
    procs: Sequence[str] = ("learner-0", "generator-0"),
    run_info: Mapping[str, Any] | None = None,
    metrics_extra: Mapping[str, float] | None = None,
) -> Path:
    """Write one run directory whose eval pass rate follows Eq. 1 (+ N(0, noise), seeded).

    Compute: `final_compute` (default 4·C_mid) spread evenly over `steps` learner steps (or
    `compute_per_step`). Evaluations at step 0 and every `eval_every` steps. `status="failed"`
    records `error`; `partial_last_line` leaves half a JSON line at the end of both logs (a run
    being written); `with_evals=False` writes no eval.jsonl lines.
    epochs: the training pool is consumed this many times over the run (`epoch` per step);
    None writes no `epoch` (a run from before the field existed).
    contention: the share of the run's CPUs other work used (`contention_run` at the end; per step it varies
    around it). benchmarks: names of downstream benchmark records written beside each
    held-out evaluation (eval.jsonl lines with a "benchmark" key). run_info: extra run.json keys.
    """
    if compute_per_step is None:
        compute_per_step = (4.0 * C_mid if final_compute is None else final_compute) / steps
    run_dir = Path(root) / sweep / (name or run_name(factor, value, seed))
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([int(seed or 0), zlib.crc32(f"{sweep}/{run_dir.name}".encode())])
    t0 = 1.77e9
    wall_per_step = compute_per_step * 3600.0 / max(count, 1)
    tokens_per_step = 768 * 2000
    flops_per_step = 8.0 * params_per_token_flops * tokens_per_step

    meta = {
        "name": run_dir.name, "sweep": sweep, "factor": factor, "value": value, "recipe": recipe,
        "seed": seed, "git_sha": "0" * 40, "hardware": {"device": device, "count": count},
        "reserved_cpus": count if device == "cpu" else 2 * count,
        "status": status, "error": error, "started": _iso(t0),
        "finished": None if status == "running" else _iso(t0 + steps * wall_per_step),
        **dict(run_info or {}),
    }
    (run_dir / "run.json").write_text(json.dumps(meta, indent=2))
    (run_dir / "config.gin").write_text(
        f"# synthetic run (analysis.synthetic)\ntrain.recipe = '{recipe}'\ntrain.seed = {seed}\n"
        + (f"# {factor} = {value!r}\n" if factor else "")
    )

    metrics, evals = [], []
    eval_wall_per = 0.15 * wall_per_step * eval_every  # each evaluation: 15% of the steps between two
    n_evals_done = 0
    cpu_s = {name: 0.0 for name in procs}
    runq_s = {name: 0.0 for name in procs}
    for step in range(steps + 1):
        c = step * compute_per_step
        p = float(sigmoid(c, A, B, C_mid, R0))
        if step > 0:
            step_cont = float(np.clip(contention * (1.0 + 0.2 * rng.standard_normal()), 0.0, 0.99))
            for name in procs:  # each process busy 90% of the step; its wait makes up the contention share
                busy = 0.9 * wall_per_step
                cpu_s[name] += busy * (1.0 - step_cont)
                runq_s[name] += busy * step_cont
            total_cpu, total_q = sum(cpu_s.values()), sum(runq_s.values())
            accounting = {
                "cpu_hours": total_cpu / 3600.0,
                "contention": step_cont,
                "contention_run": total_q / (total_cpu + total_q) if total_cpu + total_q > 0 else 0.0,
                "procs": {n: {"cpu_s": cpu_s[n], "runq_s": runq_s[n]} for n in procs},
                "eval_wall_s": n_evals_done * eval_wall_per,
                "startup_s": startup_s,
            }
            if epochs is not None:
                accounting["epoch"] = epochs * step / steps
            metrics.append({
                "step": step, "version": step, "compute_hours": c, "flops": step * flops_per_step,
                "wall_s": step * wall_per_step, "prompts": 48, "generations": 768, "tokens": tokens_per_step,
                "reward_mean": 2 * p - 1 + float(rng.normal(0, 0.02)), "pass_rate": p + float(rng.normal(0, 0.02)),
                "zero_variance_frac": max(0.0, 0.3 - 0.1 * p), "truncation_rate": 0.02 + 0.01 * float(rng.random()),
                "entropy": 0.6 * math.exp(-step / (0.5 * steps)) + 0.1 + float(rng.normal(0, 0.005)),
                "loss": float(rng.normal(0, 0.01)), "grad_norm": 0.5 + float(rng.random()),
                "is_ratio_mean": 1.0, "is_ratio_min": 0.7, "is_ratio_max": 1.4, "clip_frac": 0.01,
                "lag_mean": 2.5, "lag_max": 8, "time_generate": 0.7 * wall_per_step,
                "time_train": 0.25 * wall_per_step, "time_sync": 0.03 * wall_per_step, "time_wait": 0.02 * wall_per_step,
                **accounting,
                **dict(metrics_extra or {}),  # e.g. logprob_gap_mean, constant over the run
            })
        if with_evals and step % eval_every == 0:
            pr = float(np.clip(p + (rng.normal(0, noise) if step > 0 else 0.0), 0.0, 1.0))
            per_task = {t: float(np.clip(pr + rng.normal(0, noise), 0, 1)) for t in tasks}
            n_evals_done += 1
            evals.append({"step": step, "compute_hours": c, "flops": step * flops_per_step, "pass_rate": pr,
                          "k": k, "prompts": prompts, "per_task": per_task,
                          "entropy": 0.5 * math.exp(-step / (0.5 * steps)) + 0.1 + float(rng.normal(0, 0.003)),
                          "eval_wall_s": eval_wall_per,
                          "eval_compute_hours": eval_wall_per * max(count, 1) / 3600.0})
            for name in benchmarks:  # a downstream benchmark: lower, and not the held-out curve
                evals.append({"step": step, "compute_hours": c, "flops": step * flops_per_step,
                              "benchmark": name, "pass_rate": float(np.clip(0.5 * pr, 0, 1)), "k": k,
                              "prompts": 30, "eval_wall_s": eval_wall_per,
                              "eval_compute_hours": eval_wall_per * max(count, 1) / 3600.0})

    def dump(path: Path, rows: list[dict]) -> None:
        text = "".join(json.dumps(r) + "\n" for r in rows)
        if partial_last_line and rows:
            text += json.dumps(rows[-1])[: len(json.dumps(rows[-1])) // 2]
        path.write_text(text)

    dump(run_dir / "metrics.jsonl", metrics)
    dump(run_dir / "eval.jsonl", evals)
    return run_dir


def write_sweep(
    root: str | Path,
    sweep: str,
    factor: str,
    values: Mapping[Any, tuple[float, float, float]],
    *,
    seeds: Iterable[int] = (0,),
    scale: float = 1.0,
    **kwargs: Any,
) -> list[Path]:
    """One run per (value, seed) with that value's (A, B, C_mid); C_mid is multiplied by
    `scale` (1.0: GPU-hours as in the paper; e.g. 1e-4 for CPU-sized runs)."""
    out = []
    for value, (A, B, C_mid) in values.items():
        for seed in seeds:
            out.append(write_run(root, sweep, run_name(factor, value, seed), A=A, B=B, C_mid=C_mid * scale,
                                 factor=factor, value=value, seed=seed, **kwargs))
    return out


def write_paper_sweeps(
    root: str | Path, *, sweeps: Iterable[str] | None = None, scale: float = 1.0, **kwargs: Any
) -> dict[str, list[Path]]:
    """Every sweep of SYNTHETIC_SWEEPS (or the named ones) under `root`; returns sweep -> runs."""
    names = list(SYNTHETIC_SWEEPS) if sweeps is None else list(sweeps)
    out = {}
    for sweep in names:
        factor, values = SYNTHETIC_SWEEPS[sweep]
        out[sweep] = write_sweep(root, sweep, factor, values, scale=scale,
                                 seeds=SYNTHETIC_SEEDS.get(sweep, (0,)), **kwargs)
    return out


# The law of a configuration SYNTHETIC_SWEEPS does not list (A, B, C_mid at scale 1).
DEFAULT_LAW = (0.60, 1.85, 2600.0)
