"""Emulated bf16 (components/precision.py): the trainer-generator log-prob gap and the step time.

    .venv/bin/python benchmarks/bf16_emulation.py                       # the tiny_cpu.gin policy
    .venv/bin/python benchmarks/bf16_emulation.py --model /path/to/policy --repeats 5

Gap: for each precision (fp32; bf16 and bf16_fp32_head, each emulated and real), the torch
engine of that precision samples the same prompts (seeded), and a one-rank Learner of the
same precision recomputes every sampled token's log-prob on its fp32 master weights (the
learner's own path: `Learner.step`, which logs `logprob_gap_mean` / `logprob_gap_max` and the
IS-ratio range before its update). That is the paper's ICLR Fig 21-23 quantity at step 0.

Step time: `Learner.step` (forward, backward, AdamW) on one tiny-run batch
(prompts x generations sampled above), 1 torch thread, after a warm-up; the policies are
interleaved and each reports the median of --repeats. Generation time: the engine sampling
that batch, same protocol. Timings on a shared machine move with its load: compare the
ratios within one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (label, policy name, precision.emulate)
VARIANTS = (
    ("fp32", "fp32", "off"),
    ("bf16 (emulated)", "bf16", "on"),
    ("bf16_fp32_head (emulated)", "bf16_fp32_head", "on"),
    ("bf16 (real)", "bf16", "off"),
    ("bf16_fp32_head (real)", "bf16_fp32_head", "off"),
)


def default_model() -> tuple[str, object, object]:
    """(policy path, task, TrainConfig) of tiny_cpu.gin (warm start built once and cached)."""
    from components.tasks import make_task
    from experiments.train import prepare

    cfg, _, _ = prepare([str(ROOT / "experiments" / "configs" / "tiny_cpu.gin")])
    return cfg.model_path, make_task(cfg.task, seed=cfg.seed, **cfg.task_kwargs), cfg


def sample_batch(model_path, precision, emulate, task, prompts, G, max_tokens, seed, length_control=None):
    """Rollouts of `prompts` (G samples each) from a torch engine of `precision`; (rollouts, seconds)."""
    import random

    from components.engines import GenerationRequest, SamplingParams, make_engine
    from components.precision import emulation_override
    from components.tasks import render_prompt
    from components.trainer.rollout import Rollout

    with emulation_override(emulate):
        eng = make_engine("torch", model_path, precision=precision, seed=seed)
    tok = eng.tokenizer
    reqs = []
    for i, p in enumerate(prompts):
        its = length_control.interruptions(G, random.Random(seed + i), tok) if length_control is not None else None
        reqs.append(GenerationRequest(group_id=i, prompt_ids=list(render_prompt(p, tok)), n=G, interruptions=its))
    cap = length_control.max_tokens(max_tokens) if length_control is not None else max_tokens
    t = time.perf_counter()
    groups = list(eng.generate(reqs, SamplingParams(temperature=1.0, max_tokens=cap, seed=seed)))
    seconds = time.perf_counter() - t
    rollouts = []
    for g in sorted(groups, key=lambda g: g.request.group_id):
        problem = prompts[g.request.group_id]
        passed = [bool(task.verify(problem, tok.decode(c.token_ids, skip_special_tokens=False)).passed) for c in g.completions]
        rollouts.append(Rollout(order_id=g.request.group_id, problem_id=problem.id, completions=list(g.completions),
                                rewards=[1.0 if x else -1.0 for x in passed], passed=passed))
    return rollouts, seconds


def make_learner(model_path, cfg, precision, emulate):
    import torch

    from components.models import load_causal_lm, load_tokenizer
    from components.precision import emulation_override
    from components.trainer.learner import Learner

    tok = load_tokenizer(model_path)
    with emulation_override(emulate):
        return Learner(load_causal_lm(model_path, dtype=torch.float32), cfg.replace(precision=precision, lr=0.0,
                                                                                     warmup_steps=0),
                       tok.pad_token_id, torch.device("cpu"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a policy directory (default: tiny_cpu.gin's warm-started policy)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per batch (default: the config's prompts_per_step)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gap-only", action="store_true", help="skip the timing")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from components.registry import load_builtin_components

    load_builtin_components()
    model_path, task, cfg = default_model()
    if args.model:
        model_path = args.model
    n_prompts = args.prompts or cfg.prompts_per_step
    prompts = list(task.eval_problems())[:n_prompts]
    G = cfg.generations_per_prompt
    from components.registry import LENGTH_CONTROLS

    lc = LENGTH_CONTROLS.get(cfg.length_control)() if cfg.length_control else None
    print(f"model {model_path}\nbatch {n_prompts} prompts x {G} samples, max_tokens {cfg.max_tokens}, "
          f"length control {lc!r}, 1 thread\n", flush=True)

    # gap: each variant samples with its own engine and recomputes with its own learner
    gap_rows = []
    batches = {}
    for label, name, emulate in VARIANTS:
        rollouts, _ = sample_batch(model_path, name, emulate, task, prompts, G, cfg.max_tokens, args.seed, lc)
        batches[label] = rollouts
        learner = make_learner(model_path, cfg, name, emulate)
        stats = learner.step(rollouts, [True] * len(rollouts))
        gap_rows.append((label, stats["logprob_gap_mean"], stats["logprob_gap_max"], stats["is_ratio_min"],
                         stats["is_ratio_max"], stats["trained_tokens"]))
    print("| precision | gap mean | gap max | IS ratio min | IS ratio max | tokens |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, gm, gx, rmin, rmax, n in gap_rows:
        print(f"| {label} | {gm:.2e} | {gx:.2e} | {rmin:.4f} | {rmax:.4f} | {n} |")
    print(flush=True)
    if args.gap_only:
        return 0

    # time: interleaved learner steps and engine batches, median of repeats
    timed = [(label, name, emulate) for label, name, emulate in VARIANTS if label in
             ("fp32", "bf16 (emulated)", "bf16_fp32_head (emulated)", "bf16 (real)", "bf16_fp32_head (real)")]
    learners = {label: make_learner(model_path, cfg, name, emulate) for label, name, emulate in timed}
    step_t = {label: [] for label, _, _ in timed}
    gen_t = {label: [] for label, _, _ in timed}
    rollouts = batches["fp32"]  # the same batch for every learner
    for label, _, _ in timed:  # warm-up
        learners[label].step(rollouts, [True] * len(rollouts))
    for r in range(args.repeats):
        for label, name, emulate in timed:
            t = time.perf_counter()
            learners[label].step(rollouts, [True] * len(rollouts))
            step_t[label].append(time.perf_counter() - t)
            _, s = sample_batch(model_path, name, emulate, task, prompts, G, cfg.max_tokens, args.seed + r, lc)
            gen_t[label].append(s)
    base_s = statistics.median(step_t["fp32"])
    base_g = statistics.median(gen_t["fp32"])
    print("| precision | learner step (s) | x fp32 | engine batch (s) | x fp32 |")
    print("|---|---:|---:|---:|---:|")
    for label, _, _ in timed:
        s, g = statistics.median(step_t[label]), statistics.median(gen_t[label])
        print(f"| {label} | {s:.3f} | {s / base_s:.2f} | {g:.3f} | {g / base_g:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
