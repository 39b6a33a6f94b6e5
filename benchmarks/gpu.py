"""GPU measurements of issue 10 item 9, on one GPU: learner tokens/s and MFU, torch-engine
generation tokens/s, and end-to-end samples/s of `pipeline_rl(8)` against `ppo_off_policy(1)`.
(Weight sync seconds: `benchmarks/weight_sync.py --device cuda`.)

Models are built here from real architectures' shapes with random weights (nothing downloaded):
Qwen2.5-0.5B and Qwen2.5-1.5B (`--sizes`).

- learner: `components.trainer.learner.Learner` (fp32 master weights, AdamW; the `bf16` policy
  computes under autocast at one rank; sdpa attention; packed micro-batches of at most
  `--mb-tokens` tokens; the chunked log-prob head) on synthetic rollouts of `--seqs` sequences
  (prompt `--prompt-len`, completion `--completion-len` tokens). Timed: whole steps (forward,
  backward, clip, AdamW), after `--warmup` steps. FLOPs: `FlopCounter.training` (3 forwards: 2N
  per token without the input embedding + causal attention), as the run's compute axis counts
  them. MFU against the GPU's dense bf16 peak (`--peak-tflops`, H100 SXM: 989).
- generation: `TorchEngine` in bf16, `--gen-prompts` prompts x `--gen-samples` samples x
  `--gen-tokens` new tokens (random weights rarely sample EOS: nearly every sequence runs to the
  cap), after a warm-up batch.
- e2e: `scalerl`'s trainer (`run_training`), 1 learner + 1 generator sharing the GPU, on the
  arithmetic task with a random char-tokenizer Llama of `--e2e-hidden` x `--e2e-layers`;
  rollouts of `--e2e-tokens` tokens at most; the weight group on gloo (NCCL refuses two ranks on
  one GPU), or CUDA IPC with `--e2e-weight-sync ipc`; the schemes `--e2e-schemes`. samples/s =
  generations trained / training wall clock (start-up excluded).
- `--profile`: one more learner step under torch.profiler, written to profile-<shape>.txt: GPU
  time by kernel kind (`kernel_kind`) against the step's wall clock, the top kernels, and the
  host's top operators.

    python benchmarks/gpu.py --out /tmp/gpu            # everything (a GPU machine)
    python benchmarks/gpu.py --smoke --out /tmp/gpu    # the same code paths, tiny, on CPU
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SIZES = {  # Qwen2.5 shapes (config.json of the released models), random weights
    "0.5B": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "1.5B": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "11M": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,  # a CPU-sized model
                intermediate_size=768, vocab_size=32000, tie_word_embeddings=True),
    "smoke": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=512, tie_word_embeddings=True),
}


def build(size: str, device: str):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, pad_token_id=0, **SIZES[size])
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg)
    return model


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def rollouts(n_seqs: int, group: int, prompt_len: int, completion_len: int, vocab: int, seed: int = 0):
    import torch

    from components.engines.base import Completion
    from components.trainer.rollout import Rollout

    g = torch.Generator().manual_seed(seed)
    out = []
    for gi in range(n_seqs // group):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
        comps, rewards = [], []
        for s in range(group):
            toks = torch.randint(3, vocab, (completion_len,), generator=g).tolist()
            comps.append(Completion(gi, s, list(prompt), toks, [-5.0] * completion_len, [0] * completion_len,
                                    [False] * completion_len, "length"))
            rewards.append(1.0 if (s + gi) % 2 else 0.0)
        out.append(Rollout(order_id=gi, problem_id=f"p{gi}", completions=comps, rewards=rewards,
                           passed=[r > 0 for r in rewards]))
    return out


def learner_bench(size: str, args) -> dict:
    import torch

    from components.registry import load_builtin_components
    from components.trainer.accounting import FlopCounter
    from components.trainer.config import TrainConfig
    from components.trainer.learner import Learner

    from components.trainer.attention import resolve_attn_implementation

    load_builtin_components()
    device = args.device
    model = build(size, device)
    attn = resolve_attn_implementation(args.attn, device, torch.bfloat16 if args.precision.startswith("bf16") else None)
    model.set_attn_implementation(attn)
    flops = FlopCounter.from_model(model)
    n_params = sum(p.numel() for p in model.parameters())
    group = 8
    cfg = TrainConfig(model_path="", loss="cispo", aggregation="prompt_mean", advantage_norm="batch",
                      precision=args.precision, lr=1e-6, warmup_steps=0, grad_clip=1.0,
                      prompts_per_step=args.seqs // group, generations_per_prompt=group,
                      micro_batch_size=args.mb_seqs or args.seqs,
                      max_tokens_per_micro_batch=None if args.mb_seqs else args.mb_tokens, logprob_chunk_size=1024,
                      activation_checkpointing=args.checkpointing, attn_implementation=attn, compile=args.compile,
                      lora_rank=args.lora_rank, lora_alpha=2.0 * args.lora_rank if args.lora_rank else 16.0)
    learner = Learner(model, cfg, 0, torch.device(device))
    trainable = sum(p.numel() for p in learner.model.parameters() if p.requires_grad)
    if args.lora_rank:  # the run's own count: no weight gradients for the frozen base
        flops = flops.for_lora(trainable)
    batch = rollouts(args.seqs, group, args.prompt_len, args.completion_len, SIZES[size]["vocab_size"])
    keep = [True] * len(batch)
    tokens = sum(len(c.prompt_ids) + len(c.token_ids) for r in batch for c in r.completions)
    step_flops = sum(flops.training(len(c.prompt_ids), len(c.token_ids)) for r in batch for c in r.completions)
    for _ in range(args.warmup):
        learner.step(batch, keep)
    sync(device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        learner.step(batch, keep)
        sync(device)
        times.append(time.perf_counter() - t0)
    s = sorted(times)[len(times) // 2]
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else math.nan
    if args.profile:
        tag = f"{size}-{attn}-{'mb' + str(args.mb_seqs) + 'seqs' if args.mb_seqs else 'mb' + str(args.mb_tokens) + 'tok'}"
        tag += "-ckpt" if args.checkpointing else ""
        tag += "-compiled" if args.compile else ""
        profile_step(functools.partial(learner.step, batch, keep), device, Path(args.out) / f"profile-{tag}.txt", s)
    row = dict(part="learner", size=size, params=n_params, precision=args.precision, tokens_per_step=tokens,
               seqs=args.seqs, mb_tokens=None if args.mb_seqs else args.mb_tokens, mb_seqs=args.mb_seqs, checkpointing=args.checkpointing,
               attn=attn, compile=args.compile, lora_rank=args.lora_rank, trainable=trainable, step_s=s,
               tokens_per_s=tokens / s, tflops=step_flops / s / 1e12, mfu=step_flops / s / (args.peak_tflops * 1e12),
               peak_gib=peak)
    del learner, model
    free_device_memory(device, args.compile)
    return row


KERNEL_KINDS = (  # (kind, substrings of a GPU kernel's name), first match wins
    ("attention", ("flash", "fmha", "sdpa", "attention")),  # before matmul: cuDNN's sdpa kernels are named "..._wgmma_..."
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "wgmma", "splitk", "aten::mm", "aten::addmm", "aten::bmm")),
    ("optimizer", ("adam", "fusedoptimizer")),
    ("reduce", ("reduce", "softmax", "norm")),
    ("copy/cast", ("copy", "memcpy", "memset", "catarray", "fillfunctor", "fill_kernel")),  # not "cast": "..._nocast<Add...>" is arithmetic
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "elementwise/other")


def profile_step(step, device: str, path: Path, step_s: float) -> dict:
    """Run `step` once under torch.profiler and write where its time went to `path`: the GPU's busy
    time by kernel kind (matmul, attention, ...) against the step's wall clock (busy well below the
    wall clock = the GPU waits on the host: launches, Python, syncs), then the top operators and
    kernels by self time. On CPU the same table is made of CPU operators (a code-path check)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        step()
        sync(device)
        wall = time.perf_counter() - t0
    events = prof.key_averages()

    def self_us(e) -> float:
        if cuda:
            return float(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0))
        return float(e.self_cpu_time_total)

    kernels = [e for e in events if self_us(e) > 0 and (not cuda or str(e.device_type).endswith("CUDA"))
               and not getattr(e, "is_user_annotation", False)]  # "Optimizer.step#AdamW.step" spans its kernels
    by_kind: dict[str, float] = {}
    for e in kernels:
        kind = kernel_kind(e.key)
        by_kind[kind] = by_kind.get(kind, 0.0) + self_us(e) / 1e6
    busy = sum(by_kind.values())
    summary = dict(wall_s_profiled=wall, step_s_unprofiled=step_s, busy_s=busy, busy_fraction=busy / wall,
                   by_kind_s={k: round(v, 4) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])})
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    top = sorted(kernels, key=self_us, reverse=True)[:40]
    lines = [json.dumps(summary), "", f"{'self s':>9} {'calls':>7}  {'kind':<18} name"]
    lines += [f"{self_us(e) / 1e6:9.4f} {e.count:7d}  {kernel_kind(e.key):<18} {e.key[:140]}" for e in top]
    lines += ["", events.table(sort_by=sort, row_limit=40, max_name_column_width=80)]
    if cuda:  # where the host's time goes (launches, Python, waits) when the GPU is not busy
        lines += ["", events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=80)]
    path.write_text("\n".join(lines) + "\n")
    print(json.dumps(dict(profile=path.name, **summary)), flush=True)
    return summary


def free_device_memory(device: str, compiled: bool = False) -> None:
    """Give the next size a clean GPU: compiled blocks hold their layers in a reference cycle
    (layer.forward -> compiled wrapper -> bound method -> layer), which only the collector frees."""
    import gc

    import torch

    if compiled:
        torch._dynamo.reset()
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def generation_bench(size: str, args) -> dict:
    import torch

    from components.engines import GenerationRequest, SamplingParams
    from components.engines.torch_engine import TorchEngine
    from components.models import make_char_tokenizer

    device = args.device
    model = build(size, device)
    engine = TorchEngine("", precision=args.precision, device=device, model=model, tokenizer=make_char_tokenizer(),
                         max_batch_size=args.gen_prompts * args.gen_samples)
    g = torch.Generator().manual_seed(1)
    vocab = SIZES[size]["vocab_size"]

    def once(n_prompts: int, max_tokens: int) -> tuple[int, float]:
        reqs = [GenerationRequest(group_id=i, prompt_ids=torch.randint(3, vocab, (args.gen_prompt_len,), generator=g).tolist(),
                                  n=args.gen_samples) for i in range(n_prompts)]
        sync(device)
        t0 = time.perf_counter()
        n = sum(c.num_tokens for grp in engine.generate(reqs, SamplingParams(temperature=1.0, max_tokens=max_tokens))
                for c in grp.completions)
        sync(device)
        return n, time.perf_counter() - t0

    once(2, 16)  # warm-up
    runs = [once(args.gen_prompts, args.gen_tokens) for _ in range(args.gen_repeats)]
    n, s = sorted(runs, key=lambda x: x[1])[len(runs) // 2]
    row = dict(part="generation", size=size, precision=args.precision, sequences=args.gen_prompts * args.gen_samples,
               new_tokens=n, seconds=s, tokens_per_s=n / s, vllm="not measured: vLLM is not installed on the machine")
    del engine, model
    free_device_memory(device)
    return row


def e2e_bench(scheme: str, args, model_dir: Path, work: Path) -> dict:
    import gin

    from experiments.train import run_training

    run_dir = work / f"e2e-{scheme.replace(':', '-')}"
    off, k = scheme.split(":")
    bindings = [
        f'model.path = "{model_dir}"',
        'train.task = "arithmetic"',
        'train.task_kwargs = {"num_train": 2000, "num_eval": 16, "max_operand": 99}',
        'train.engine = "torch"',
        f'train.device = "{args.device}"',
        f'train.precision = "{args.precision}"',
        f'train.off_policy = "{off}"',
        f"{off}.k = {k}",
        'train.loss = "cispo"',
        'train.aggregation = "prompt_mean"',
        'train.advantage_norm = "batch"',
        'train.curriculum = ["uniform"]',
        'train.length_control = "truncate"',
        f"train.max_tokens = {args.e2e_tokens}",
        f"train.prompts_per_step = {args.e2e_prompts}",
        "train.generations_per_prompt = 8",
        f"train.micro_batch_size = {args.e2e_prompts * 8}",
        "train.lr = 1e-6",
        f"train.total_steps = {args.e2e_steps}",
        "train.eval_every = 100000",
        "train.eval_prompts = 16",
        "train.eval_k = 1",
        "train.checkpoint_every = 100000",
        f'train.weight_sync_backend = "{args.e2e_weight_sync}"',
        "train.num_generators = 1",
        "train.learner_ranks = 1",
    ]
    gin.clear_config()
    status = run_training([], bindings, str(run_dir), progress=False)
    gin.clear_config()
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    skip = min(args.e2e_warmup, len(lines) - 1)  # the first steps include the engines' warm-up
    t0 = lines[skip - 1]["wall_s"] if skip > 0 else 0.0
    gens = sum(m["generations"] for m in lines[skip:])
    toks = sum(m.get("generated_tokens", 0) for m in lines[skip:])
    wall = lines[-1]["wall_s"] - t0
    return dict(part="e2e", scheme=scheme, weight_sync=args.e2e_weight_sync, status=status, steps=len(lines) - skip, samples=gens, wall_s=wall,
                samples_per_s=gens / wall, generated_tokens_per_s=toks / wall,
                lag_max=max(m.get("lag_max", 0) for m in lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="writes gpu.json here (rows as they come)")
    ap.add_argument("--parts", default="learner,generation,e2e")
    ap.add_argument("--sizes", default="0.5B,1.5B")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--completion-len", type=int, default=1024)
    ap.add_argument("--mb-tokens", type=int, default=16384)
    ap.add_argument("--mb-seqs", type=int, default=0,
                    help="> 0: padded micro-batches of this many sequences instead of packed rows of --mb-tokens")
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--compile", action="store_true", help="train.compile: torch.compile the decoder blocks and the "
                    "head's chunk math (the warm-up steps include the compile)")
    ap.add_argument("--attn", default="sdpa", help="the learner's attn_implementation: sdpa, torch_varlen (torch's varlen "
                    "flash kernel for packed rows), flash_attention_2, ...")
    ap.add_argument("--lora-rank", type=int, default=0, help="train.lora_rank: peft adapters (all-linear, alpha 2r) on a "
                    "frozen base; 0 = full fine-tuning")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU (H100 SXM: 989)")
    ap.add_argument("--gen-prompts", type=int, default=32)
    ap.add_argument("--gen-samples", type=int, default=8)
    ap.add_argument("--gen-prompt-len", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=512)
    ap.add_argument("--gen-repeats", type=int, default=3)
    ap.add_argument("--e2e-hidden", type=int, default=1024)
    ap.add_argument("--e2e-layers", type=int, default=16)
    ap.add_argument("--e2e-tokens", type=int, default=256)
    ap.add_argument("--e2e-prompts", type=int, default=16)
    ap.add_argument("--e2e-steps", type=int, default=16)
    ap.add_argument("--e2e-warmup", type=int, default=3)
    ap.add_argument("--e2e-schemes", default="ppo_off_policy:1,pipeline_rl:8", help="off-policy schemes as name:k")
    ap.add_argument("--e2e-weight-sync", default="gloo", help="train.weight_sync_backend: gloo (staged through host "
                    "memory) or ipc (CUDA IPC: the learner and the generator share the GPU)")
    ap.add_argument("--profile", action="store_true", help="learner: one more step under torch.profiler; writes "
                    "profile-<shape>.txt (GPU busy time by kernel kind against the wall clock, top kernels)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: check the code paths")
    args = ap.parse_args(argv)
    if args.smoke:
        args.device, args.sizes, args.precision = "cpu", "smoke", "fp32"
        args.seqs, args.prompt_len, args.completion_len, args.mb_tokens = 16, 8, 16, 256
        args.warmup, args.steps, args.gen_prompts, args.gen_samples, args.gen_tokens = 1, 1, 2, 2, 8
        args.gen_repeats, args.e2e_hidden, args.e2e_layers, args.e2e_tokens, args.e2e_steps = 1, 64, 2, 8, 4
        args.e2e_prompts, args.e2e_warmup = 4, 1
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - {"learner", "generation", "e2e"})
    if unknown or not parts:
        raise SystemExit(f"--parts {args.parts!r}: unknown {unknown}; valid: learner, generation, e2e")
    schemes = [x for x in args.e2e_schemes.split(",") if x]
    bad = [x for x in schemes if x.count(":") != 1 or not x.split(":")[1].isdigit()]
    if "e2e" in parts and (bad or not schemes):
        raise SystemExit(f"--e2e-schemes {args.e2e_schemes!r}: {bad or 'none'} is not a list of name:k (e.g. pipeline_rl:8)")
    if args.e2e_weight_sync not in ("gloo", "ipc"):
        raise SystemExit(f"--e2e-weight-sync {args.e2e_weight_sync!r}: valid: gloo, ipc")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    env = dict(torch=torch.__version__, device=torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    print(json.dumps(env), flush=True)
    rows = []
    sizes = [s for s in args.sizes.split(",") if s]

    def record(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out / "gpu.json").write_text(json.dumps({"env": env, "args": vars(args), "rows": rows}, indent=1))

    for size in sizes:
        if "learner" in parts:
            record(learner_bench(size, args))
        if "generation" in parts:
            record(generation_bench(size, args))
    if "e2e" in parts:
        from components.models import build_tiny_policy

        model_dir = out / "e2e-model"
        if not (model_dir / "config.json").is_file():
            build_tiny_policy(model_dir, hidden_size=args.e2e_hidden, num_layers=args.e2e_layers,
                              num_heads=max(args.e2e_hidden // 64, 1), max_position_embeddings=1024)
        for scheme in schemes:
            record(e2e_bench(scheme, args, model_dir, out))
        e2e = {r["scheme"]: r for r in rows if r["part"] == "e2e"}
        if {"pipeline_rl:8", "ppo_off_policy:1"} <= set(e2e):
            print(f"pipeline_rl(8) / ppo_off_policy(1) samples/s: "
                  f"{e2e['pipeline_rl:8']['samples_per_s'] / e2e['ppo_off_policy:1']['samples_per_s']:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
