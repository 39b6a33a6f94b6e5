"""Mismatch corrections (components/mismatch.py): what a correction costs the learner step.

    .venv/bin/python benchmarks/mismatch.py                      # tiny_cpu.gin's policy and batch, bf16_fp32_head
    .venv/bin/python benchmarks/mismatch.py --precision bf16 --steps 5 --repeats 9

One batch of tiny_cpu.gin's shape (prompts_per_step x generations_per_prompt, interruptions as
configured) is sampled once by the torch engine in the chosen precision (emulated bf16 on CPU).
The variants below then each time `--steps` learner steps on it (`Learner.step`: plan, forward,
backward, AdamW), with one learner per variant, 1 torch thread, after one warm-up step. The
variants run interleaved in every repeat, and each reports the median over `--repeats` of its
seconds per step:

- ``none``, ``tis``, ``mis``: ``train.mismatch_correction``. The weights come from the step's own
  forward (old_logp = sg(logp), the module docstring's argument), so a correction adds only
  elementwise work.
- ``tis + recompute``: the same tis step preceded by one no-grad forward over the step's
  micro-batches, under the same precision context. That is the extra forward verl and TRL run to
  get pi_old, and this learner does not need it (tests/test_mismatch.py shows the numbers are
  identical). It measures what the design saves.

It also prints the mismatch metrics of the batch (mismatch_kl, masked and truncated fractions).
The machine is shared (2 cores, a background job): absolute seconds move with its load, so compare
the ratios within one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

VARIANTS = ("none", "tis", "mis", "tis + recompute")


def make_learner(model_path: str, cfg, precision: str, correction: str):
    import torch

    from components.models import load_causal_lm, load_tokenizer
    from components.trainer.learner import Learner

    tok = load_tokenizer(model_path)
    cfg = cfg.replace(precision=precision, mismatch_correction=correction, warmup_steps=0)
    return Learner(load_causal_lm(model_path, dtype=torch.float32), cfg, tok.pad_token_id, torch.device("cpu"))


def recompute_then_step(learner, rollouts) -> dict:
    """verl / TRL's order: a no-grad forward for pi_old over the step's micro-batches, then the step."""
    import torch

    plan = learner.plan(rollouts, [True] * len(rollouts))
    with torch.no_grad():
        for shard in plan.shards:
            for mb in shard:
                learner.logprobs(mb)  # [b, T]: pi_old, discarded (this learner's step forward gives the same)
    return learner.train(plan)


def timed_steps(learner, rollouts, steps: int, recompute: bool) -> float:
    """Seconds per learner step, over `steps` steps."""
    t = time.perf_counter()
    for _ in range(steps):
        if recompute:
            recompute_then_step(learner, rollouts)
        else:
            learner.step(rollouts, [True] * len(rollouts))
    return (time.perf_counter() - t) / steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a policy directory (default: tiny_cpu.gin's warm-started policy)")
    ap.add_argument("--precision", default="bf16_fp32_head", help="the policy of the engine and the learners")
    ap.add_argument("--steps", type=int, default=3, help="learner steps per timing")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from bf16_emulation import default_model, sample_batch

    from components.registry import LENGTH_CONTROLS, load_builtin_components

    load_builtin_components()
    model_path, task, cfg = default_model()
    model_path = args.model or model_path
    prompts = list(task.train_problems())[: cfg.prompts_per_step]
    G = cfg.generations_per_prompt
    lc = LENGTH_CONTROLS.get(cfg.length_control)() if cfg.length_control else None
    rollouts, _ = sample_batch(model_path, args.precision, "auto", task, prompts, G, cfg.max_tokens, args.seed, lc)
    print(f"model {model_path}\nbatch {len(prompts)} prompts x {G} samples, max_tokens {cfg.max_tokens}, "
          f"precision {args.precision} (engine and learner; precision.emulate auto), micro_batch_size "
          f"{cfg.micro_batch_size}, 1 thread, {args.steps} steps x {args.repeats} repeats\n", flush=True)

    learners = {v: make_learner(model_path, cfg, args.precision, v.split(" ")[0]) for v in VARIANTS}
    first = {}
    for v in VARIANTS:  # warm-up (and the batch's mismatch metrics, before any update)
        first[v] = learners[v].step(rollouts, [True] * len(rollouts))
    seconds = {v: [] for v in VARIANTS}
    for r in range(args.repeats):
        order = VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))  # no variant always first after the others
        for v in order:
            seconds[v].append(timed_steps(learners[v], rollouts, args.steps, recompute=v.endswith("recompute")))

    base = statistics.median(seconds["none"])
    print("| correction | learner step (s), median | x none | min | max |")
    print("|---|---:|---:|---:|---:|")
    for v in VARIANTS:
        s = seconds[v]
        print(f"| {v} | {statistics.median(s):.4f} | {statistics.median(s) / base:.3f} | {min(s):.4f} | {max(s):.4f} |")
    print()
    print("| correction | trained tokens | mismatch_kl | masked frac | truncated frac |")
    print("|---|---:|---:|---:|---:|")
    for v in ("none", "tis", "mis"):
        st = first[v]
        print(f"| {v} | {st['trained_tokens']} | {st['mismatch_kl']:.2e} | {st['mismatch_masked_frac']:.4f} | "
              f"{st.get('mismatch_truncated_frac', float('nan')):.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
