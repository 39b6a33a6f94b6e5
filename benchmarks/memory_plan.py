"""`scalerl plan`'s learner estimate against the measured memory of a learner step on CPU (issue 11).

Each configuration runs in a FRESH subprocess (`--one`): it builds the tiny policy of
tiny_cpu.gin (hidden 128, 2 layers, 4 heads, vocabulary 104), makes a `Learner` (fp32, one
rank, packed micro-batches of `--tokens` tokens) and a batch of synthetic rollout groups (every
sequence 16 prompt + 112 completion tokens, 4 micro-batches per step), resets the process's
peak resident set (`/proc/self/clear_refs` 5), runs `--steps` learner steps (the first
allocates AdamW's state, so the peak covers gradients + optimizer state + activations + the
logits chunk) and reports the peak RSS increase (VmHWM - VmRSS before the steps). The estimate
is `experiments.memory_model.learner_memory` with GPU-free numbers (no overhead allowance) minus the
parameters, which are resident before the baseline.

Every configuration is measured twice: with glibc's mmap threshold pinned at 128 KiB
(MALLOC_MMAP_THRESHOLD_=131072: every tensor above it is its own mapping, unmapped when freed,
so the RSS peak is the peak of LIVE memory, the quantity the plan estimates) and with glibc's
default (a dynamic threshold: freed activation memory can stay resident and later allocations
land elsewhere, which the RSS peak then counts as well: the CPU's analogue of allocator
fragmentation, which the plan covers on GPU with its overhead allowance).

    python benchmarks/memory_plan.py                 # the table in BENCHMARKS.md
    python benchmarks/memory_plan.py --json          # the same as JSON
    python benchmarks/memory_plan.py --one --tokens 2048 --checkpointing   # one configuration, this process
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL_KWARGS = {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "max_position_embeddings": 128}
PROMPT, COMPLETION = 16, 112  # tokens per sequence: 128 = the tiny model's context
CONFIGS = [  # (token budget per packed micro-batch, activation checkpointing)
    (2048, False),
    (2048, True),
    (4096, False),
    (4096, True),
]


def _status_kib(key: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{key}:\s+(\d+) kB", text, re.M).group(1))


def _rollouts(num_prompts: int, generations: int, vocab: int, seed: int = 0):
    import random

    from components.engines.base import Completion
    from components.trainer.rollout import Rollout

    rng = random.Random(seed)
    out = []
    for g in range(num_prompts):
        prompt = [rng.randrange(8, vocab) for _ in range(PROMPT)]
        comps, rewards = [], []
        for s in range(generations):
            toks = [rng.randrange(8, vocab) for _ in range(COMPLETION)]
            lps = [-rng.uniform(2.0, 6.0) for _ in range(COMPLETION)]
            comps.append(Completion(g, s, list(prompt), toks, lps, [0] * COMPLETION, [False] * COMPLETION, "length"))
            rewards.append(1.0 if (g + s) % 2 == 0 else -1.0)
        out.append(Rollout(order_id=g, problem_id=f"p{g}", completions=comps, rewards=rewards, passed=[r > 0 for r in rewards]))
    return out


def measure_one(tokens: int, checkpointing: bool, steps: int = 2, chunk: int = 1024, micro_batches: int = 4) -> dict:
    """In this process: the peak RSS increase over `steps` learner steps, and the plan's estimate."""
    import torch

    torch.set_num_threads(1)
    from components.models import build_tiny_policy, load_causal_lm, load_tokenizer
    from components.registry import load_builtin_components
    from components.trainer.config import TrainConfig
    from components.trainer.learner import Learner
    from experiments.memory_model import LearnerLayout, ModelShape, learner_memory

    load_builtin_components()
    seq = PROMPT + COMPLETION
    if tokens % seq:
        raise ValueError(f"--tokens must be a multiple of {seq} (one sequence), got {tokens}")
    per_mb = tokens // seq
    generations = 8
    prompts = per_mb * micro_batches // generations
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_policy(Path(tmp) / "tiny", **MODEL_KWARGS)
        config = json.loads((path / "config.json").read_text())
        cfg = TrainConfig(
            model_path=str(path), precision="fp32", device="cpu", prompts_per_step=prompts, generations_per_prompt=generations,
            max_tokens=COMPLETION, micro_batch_size=per_mb, max_tokens_per_micro_batch=tokens,
            activation_checkpointing=checkpointing, logprob_chunk_size=chunk, lr=1e-4, warmup_steps=0,
        )
        tok = load_tokenizer(path)
        learner = Learner(load_causal_lm(path), cfg, tok.pad_token_id, torch.device("cpu"))
        rollouts = _rollouts(prompts, generations, config["vocab_size"])
        keep = [True] * len(rollouts)
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS (VmHWM) to the current RSS
        base = _status_kib("VmRSS") - _status_kib("RssFile")
        for _ in range(steps):
            stats = learner.step(rollouts, keep)
        # VmHWM counts file-backed pages too: library code the step touches for the first time (how
        # much depends on the page cache, not on the step). RssFile only grows during the step, so
        # VmHWM - RssFile(end) is at most the anonymous (tensor) memory at the peak
        peak = _status_kib("VmHWM") - _status_kib("RssFile")
    shape = ModelShape.from_config(config)
    layout = LearnerLayout(ranks=1, rows=1, row_length=tokens, head_tokens=per_mb * COMPLETION,
                           activation_checkpointing=checkpointing, logprob_chunk_size=chunk, precision="fp32", device="cpu")
    est = learner_memory(shape, layout, overhead_bytes=0)
    estimate = est["total"] - est["parameters"]  # the parameters are resident before the baseline
    measured = (peak - base) * 1024
    return {
        "tokens": tokens, "activation_checkpointing": checkpointing, "steps": steps, "micro_batches": micro_batches,
        "sequences": prompts * generations, "trained_tokens": int(stats["trained_tokens"]),
        "measured_bytes": measured, "estimate_bytes": estimate, "ratio": estimate / measured,
        "estimate_parts": {k: v for k, v in est.items() if k != "total"},
    }


def run_fresh(tokens: int, checkpointing: bool, steps: int = 2, timeout: float = 600, pin_malloc: bool | None = None) -> dict:
    """`measure_one` in a new python process (what the test and the table use).

    pin_malloc: True sets MALLOC_MMAP_THRESHOLD_=131072 (glibc then serves every tensor above
    128 KiB with its own mapping and unmaps it when freed, so the RSS peak is the peak of live
    memory); False removes it (glibc's default: a dynamic threshold, freed memory may stay
    resident); None leaves the environment as it is.
    """
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", "--tokens", str(tokens), "--steps", str(steps)]
    if checkpointing:
        cmd.append("--checkpointing")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    if pin_malloc:
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    elif pin_malloc is False:
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT), env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"memory plan probe failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one", action="store_true", help="measure one configuration in this process")
    ap.add_argument("--tokens", type=int, default=2048, help="token budget of a packed micro-batch (a multiple of 128)")
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(measure_one(args.tokens, args.checkpointing, args.steps)), flush=True)
        return 0
    rows = [(run_fresh(t, c, args.steps, pin_malloc=True), run_fresh(t, c, args.steps, pin_malloc=False)) for t, c in CONFIGS]
    if args.json:
        print(json.dumps([{"pinned_malloc": a, "default_malloc": b} for a, b in rows], indent=1))
        return 0
    print("| tokens / micro-batch | checkpointing | estimate (MiB) | measured, live (MiB) | estimate / live "
          "| measured, glibc default (MiB) | estimate / glibc default |")
    print("|---:|:---:|---:|---:|---:|---:|---:|")
    for a, b in rows:
        print(f"| {a['tokens']} | {'on' if a['activation_checkpointing'] else 'off'} | {a['estimate_bytes'] / 2**20:.1f} "
              f"| {a['measured_bytes'] / 2**20:.1f} | {a['ratio']:.2f} | {b['measured_bytes'] / 2**20:.1f} | {b['ratio']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
