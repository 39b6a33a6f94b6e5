"""Learner memory and step time on CPU (issue 11): packing, chunked log-probs, activation checkpointing.

A random-weight model of a real architecture, built locally: Qwen2.5-0.5B's shapes (hidden 896,
MLP 4864, 14 query / 2 KV heads, vocabulary 151,936, tied embeddings) with fewer decoder
layers (`--layers`, default 2) so a step fits this machine. float32, sdpa attention.

One learner step = forward + backward of the CISPO loss with prompt_mean weights computed on
the whole batch (the learner's math), on a batch of `--sequences` sequences with random prompt
and completion lengths (seeded). Variants (`--variants`):

    padded_full                today's path: one padded micro-batch, full [B, T+1, V] logits
                               (components.trainer.learner.token_logprobs), entropy on the full logits
    padded_chunked             the same padded micro-batch through the chunked head
    packed                     one packed row (token budget = the whole batch), chunked head
    packed_ckpt                packed + activation checkpointing per decoder block
    packed_chunk256            packed, logprob_chunk_size 256
    packed_chunk256_ckpt       packed, chunk 256, checkpointing
    packed_half_chunk256_ckpt  token budget = half the batch's tokens (>= 2 packed micro-batches),
                               chunk 256, checkpointing
    (chunk 1024, the config default, unless named)

Each variant runs in its own fresh process (peak RSS is per process): the model is built, two
warm-up steps run on a batch of a few tokens (kernels, thread pools, gradient buffers), then the
timed step(s). Reported:
- step peak RSS increase: the peak resident memory during the timed step minus the resident
  memory just before it (Linux: the peak, VmHWM, is reset through /proc/self/clear_refs before
  the step; elsewhere `ru_maxrss` over its earlier peak, a lower bound);
- the same for the second warm-up step: the part of a step that does not grow with its tokens
  (parameter-sized gradient temporaries; with tied embeddings autograd holds the head's and the
  embedding's [V, H] gradients together before it sums them);
- the process's peak RSS over its whole life (model, warm-ups and step);
- the median step time and trained tokens/s (every prompt + completion token / step time).

    .venv/bin/python benchmarks/learner_memory.py                       # defaults below
    .venv/bin/python benchmarks/learner_memory.py --layers 2 --sequences 8 --threads 1 --repeats 1
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

VARIANTS = {
    "padded_full": dict(mode="padded_full", ckpt=False, budget=None, chunk=1024),
    "padded_chunked": dict(mode="padded", ckpt=False, budget=None, chunk=1024),
    "packed": dict(mode="packed", ckpt=False, budget="all", chunk=1024),
    "packed_ckpt": dict(mode="packed", ckpt=True, budget="all", chunk=1024),
    "packed_chunk256": dict(mode="packed", ckpt=False, budget="all", chunk=256),
    "packed_chunk256_ckpt": dict(mode="packed", ckpt=True, budget="all", chunk=256),
    "packed_half_chunk256_ckpt": dict(mode="packed", ckpt=True, budget="half", chunk=256),
}
LABELS = {
    "padded_full": "padded, full logits (today)",
    "padded_chunked": "padded, chunked head",
    "packed": "packed (1 micro-batch), chunked head",
    "packed_ckpt": "packed, chunked, checkpointing",
    "packed_chunk256": "packed, chunk 256",
    "packed_chunk256_ckpt": "packed, chunk 256, checkpointing",
    "packed_half_chunk256_ckpt": "packed, budget = half the tokens, chunk 256, checkpointing",
}


def _status_mib(field: str) -> float:
    """VmRSS / VmHWM of this process from /proc/self/status, in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0); False if not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def qwen25_05b_like(layers: int):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True,
    )


def make_batch(args, vocab: int):
    """A padded step batch (learner layout): `--sequences` sequences in groups of 4, random lengths."""
    import torch

    from components.engines.logprobs import build_batch
    from components.trainer.rollout import Batch

    g = torch.Generator().manual_seed(args.seed)
    n = args.sequences
    p_len = torch.randint(args.prompt_min, args.prompt_max + 1, (n,), generator=g).tolist()
    c_len = torch.randint(args.completion_min, args.completion_max + 1, (n,), generator=g).tolist()
    prompts = [torch.randint(0, vocab, (p,), generator=g) for p in p_len]
    completions = [torch.randint(0, vocab, (c,), generator=g) for c in c_len]
    bb = build_batch(prompts, completions, pad_id=0)
    B, T = bb["completion_mask"].shape
    mask = bb["completion_mask"]
    return Batch(
        input_ids=bb["input_ids"], attention_mask=bb["attention_mask"], mask=mask,
        gen_logp=torch.where(mask, -torch.rand(B, T, generator=g) * 12.0, 0.0),
        versions=torch.zeros(B, T, dtype=torch.long),
        rewards=(torch.rand(B, generator=g) > 0.5).float() * 2 - 1,
        passed=torch.zeros(B, dtype=torch.bool),
        group_ids=torch.arange(B) // 4,
        truncated=torch.zeros(B, dtype=torch.bool),
        num_tokens=mask.sum(1),
        completion_start=int(bb["completion_start"]),
    )


def child(args) -> dict:
    """Run one variant in this (fresh) process and return its measurements."""
    import resource

    import torch

    torch.set_num_threads(args.threads)
    import components.losses  # noqa: F401
    from components.aggregation import token_weights, weighted_sum
    from components.registry import ADVANTAGE_NORMS, LOSSES
    from components.trainer.forward import (
        enable_activation_checkpointing,
        pack_batch,
        plan_micro_batches,
        sequence_lengths,
        sequence_logprobs_packed,
    )
    from components.trainer.learner import token_logprobs
    from transformers import Qwen2ForCausalLM

    spec = VARIANTS[args.child]
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(qwen25_05b_like(args.layers))
    model.set_attn_implementation("sdpa")
    model.train()
    if spec["ckpt"]:
        enable_activation_checkpointing(model)
    loss_fn = LOSSES.get("cispo")

    def step(batch):
        lengths = sequence_lengths(batch)
        advantages = ADVANTAGE_NORMS.get("batch")(batch.rewards.double(), batch.group_ids).float()  # [B]
        weights = token_weights("prompt_mean", batch.mask, batch.group_ids)  # [B, T]
        if spec["budget"] is None:
            plan = [list(range(len(batch)))]
        else:
            total = sum(lengths)
            budget = total if spec["budget"] == "all" else max(max(lengths), (total + 1) // 2)
            plan = plan_micro_batches(lengths, budget)
        for idx in plan:
            rows = torch.tensor(idx)
            mb = batch.select(rows)
            if spec["mode"] == "padded_full":
                logp, entropy = token_logprobs(model, mb, 1.0)
            else:
                micro = pack_batch(mb) if spec["mode"] == "packed" else mb
                logp, entropy = sequence_logprobs_packed(model, micro, temperature=1.0, chunk_size=spec["chunk"], with_entropy=True)
            per_token = loss_fn(logp, mb.gen_logp, advantages[rows], mb.mask)  # [b, T]
            weighted_sum(per_token, weights[rows]).backward()
        model.zero_grad(set_to_none=False)  # keep the gradient buffers: they are part of the baseline
        return len(plan)

    vocab = model.config.vocab_size
    batch = make_batch(args, vocab)
    warm = argparse.Namespace(**{**vars(args), "prompt_min": 4, "prompt_max": 8, "completion_min": 4, "completion_max": 8})
    tiny = make_batch(warm, vocab)
    step(tiny)  # first step: allocates the gradient buffers (kept: zero_grad(set_to_none=False))
    warm_before = _status_mib("VmRSS")
    warm_exact = _reset_peak()
    step(tiny)  # second tiny step: what a step costs without tokens
    warm_increase = _status_mib("VmHWM") - warm_before if warm_exact else float("nan")
    times, increases = [], []
    micro_batches = 0
    for _ in range(args.repeats):
        before = _status_mib("VmRSS")
        exact = _reset_peak()
        if not exact:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # lower bound: over the earlier peak
        t0 = time.perf_counter()
        micro_batches = step(batch)
        times.append(time.perf_counter() - t0)
        peak = _status_mib("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        increases.append(peak - before)
    tokens = int(batch.attention_mask.sum())
    times.sort()
    return {
        "variant": args.child,
        "peak_increase_mb": max(increases),
        "peak_increase_exact": exact,
        "warmup_increase_mb": warm_increase,
        "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "step_s": times[len(times) // 2],
        "tokens": tokens,
        "padded_positions": int(batch.input_ids.numel()),
        "completion_tokens": int(batch.attention_mask[:, batch.completion_start:].sum()),
        "micro_batches": micro_batches,
        "params": sum(p.numel() for p in model.parameters()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--prompt-min", type=int, default=32)
    ap.add_argument("--prompt-max", type=int, default=64)
    ap.add_argument("--completion-min", type=int, default=32)
    ap.add_argument("--completion-max", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per variant before it is killed")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        print(json.dumps(child(args)))
        return

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=str(args.threads))
    rows = []
    for v in variants:
        cmd = [sys.executable, __file__, "--child", v] + _passthrough(args)
        try:
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"variant {v} did not finish within {args.timeout:.0f} s (killed)")
        if out.returncode != 0:
            raise SystemExit(f"variant {v} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"{v}: +{row['peak_increase_mb']:.0f} MiB, {row['step_s']:.2f} s/step", file=sys.stderr, flush=True)
    _print_table(args, rows)


def _passthrough(args) -> list[str]:
    keys = ["layers", "sequences", "prompt_min", "prompt_max", "completion_min", "completion_max", "threads", "repeats", "seed"]
    out = []
    for k in keys:
        out += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    return out


def _print_table(args, rows) -> None:
    import torch

    r0 = rows[0]
    ref = next((r for r in rows if r["variant"] == "padded_full"), r0)
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, no GPU, torch {torch.__version__}, {now}, "
          f"1-minute load average {load:.1f} at the end; {args.threads} torch threads per variant.")
    print(f"Model: Qwen2.5-0.5B shapes with {args.layers} decoder layers, {r0['params'] / 1e6:.0f}M parameters, "
          f"vocabulary 151,936, fp32, sdpa. Batch: {args.sequences} sequences, {r0['tokens']} tokens "
          f"({r0['completion_tokens']} completion tokens; {r0['padded_positions']} padded positions).")
    how = "VmHWM reset before the step" if all(r["peak_increase_exact"] for r in rows) else "ru_maxrss (lower bound)"
    print(f"Step peak RSS increase measured with {how}.")
    print()
    print("| variant | micro-batches | step peak RSS increase (MiB) | × today | of which not token-dependent (MiB) | "
          "process peak RSS (MiB) | s/step | trained tokens/s | × today |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        tps = r["tokens"] / r["step_s"]
        print(f"| {LABELS[r['variant']]} | {r['micro_batches']} | {r['peak_increase_mb']:.0f} | "
              f"{r['peak_increase_mb'] / ref['peak_increase_mb']:.2f} | {r['warmup_increase_mb']:.0f} | {r['peak_mb']:.0f} | "
              f"{r['step_s']:.2f} | {tps:.0f} | "
              f"{tps / (ref['tokens'] / ref['step_s']):.2f} |")


if __name__ == "__main__":
    main()
