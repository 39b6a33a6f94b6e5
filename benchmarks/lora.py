"""LoRA vs full fine-tuning: learner step time and peak memory (issue 33 item 5, BENCHMARKS.md "LoRA").

The learner of the tiny recipe (experiments/configs/tiny_cpu.gin: a random model of its policy's
shape; bf16_fp32_head emulated on CPU, 16 prompts x 8 generations, one
micro-batch of 128 sequences) takes `--steps` steps on synthetic rollouts of the recipe's lengths
(prompts of 9-11 tokens, completions of 5-12), in a FRESH process per measurement (so each peak
is its own), alternating full fine-tuning and LoRA (`train.lora_rank`, "all-linear") for
`--rounds` rounds: the machine is shared, and interleaving spreads its load over both. Reported
per mode: the median step time over every round's steps after `--warmup`, the process's peak
resident memory (VmHWM) and its rise over the built learner (the step's own peak: activations,
gradients, AdamW state), and the learner's own tensors: parameters, gradients and AdamW state
(exact byte counts). Memory comes from a second child per mode and round, run with glibc's mmap
threshold pinned (MALLOC_MMAP_THRESHOLD_=131072, as benchmarks/memory_plan.py): every tensor
above it is its own mapping, unmapped when freed, so the RSS peak is the peak of live memory, not
of what the allocator kept (unpinned, LoRA's many small tensors fragment the heap and its RSS
peak came out HIGHER than full fine-tuning's). Times come from unpinned children (pinned, every
large free is an munmap and steps slow down).

    .venv/bin/python benchmarks/lora.py                        # the tiny recipe's model
    .venv/bin/python benchmarks/lora.py --hidden 512 --layers 4   # a larger random model (char vocabulary)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def peak_rss_mib(field: str = "VmHWM") -> float:
    """This process's peak (VmHWM) or current (VmRSS) resident memory in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def rollouts(vocab: int, groups: int = 16, G: int = 8, seed: int = 0):
    import torch

    from components.engines.base import Completion
    from components.trainer.rollout import Rollout

    g = torch.Generator().manual_seed(seed)
    out = []
    for gi in range(groups):
        prompt = torch.randint(4, vocab, (int(torch.randint(9, 12, (1,), generator=g)),), generator=g).tolist()
        comps, rewards = [], []
        for s in range(G):
            n = int(torch.randint(5, 13, (1,), generator=g))
            toks = torch.randint(4, vocab, (n,), generator=g).tolist()
            comps.append(Completion(gi, s, list(prompt), toks, (-1.0 - torch.rand(n, generator=g)).tolist(), [0] * n,
                                    [False] * n, "stop"))
            rewards.append(1.0 if (s + gi) % 3 == 0 else -1.0)
        out.append(Rollout(order_id=gi, problem_id=f"p{gi}", completions=comps, rewards=rewards,
                           passed=[r > 0 for r in rewards]))
    return out


def measure(model_path: str, lora_rank: int, steps: int, warmup: int, precision: str = "bf16_fp32_head") -> dict:
    """One mode in this process: build the learner, take warmup + steps steps; times and memory."""
    import torch

    from components.models import load_causal_lm, load_tokenizer
    from components.registry import load_builtin_components
    from components.trainer.config import TrainConfig
    from components.trainer.learner import Learner

    torch.set_num_threads(1)  # one core, as a run's learner process on CPU
    load_builtin_components()
    cfg = TrainConfig(model_path=model_path, precision=precision, loss="cispo", aggregation="prompt_mean",
                      advantage_norm="batch", prompts_per_step=16, generations_per_prompt=8, micro_batch_size=128,
                      lr=1e-3 if lora_rank else 5e-5, warmup_steps=0, device="cpu", lora_rank=lora_rank)
    tok = load_tokenizer(model_path)
    torch.manual_seed(0)
    learner = Learner(load_causal_lm(model_path), cfg, tok.pad_token_id, torch.device("cpu"))
    batch = rollouts(len(tok))
    built = peak_rss_mib("VmRSS")
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        learner.step(batch, [True] * len(batch))
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    params = [p for p in learner.model.parameters()]
    trainable = [p for p in params if p.requires_grad]
    state = sum(t.numel() * t.element_size() for s in learner.optimizer.state.values() for t in s.values()
                if torch.is_tensor(t))
    return {
        "lora_rank": lora_rank,
        "step_s": times,
        "peak_rss_mib": peak_rss_mib(),
        "step_peak_mib": peak_rss_mib() - built,  # the rise over the built learner (imports, model, optimizer)
        "parameters": sum(p.numel() for p in params),
        "trainable": sum(p.numel() for p in trainable),
        "param_mib": sum(p.numel() * p.element_size() for p in params) / 2**20,
        "grad_mib": sum(p.numel() * p.element_size() for p in trainable) / 2**20,  # one gradient per trainable tensor
        "adam_mib": state / 2**20,
    }


def model_dir(args, root: Path) -> tuple[str, str]:
    """(path, what it is): a random model of the tiny recipe's shape (the weights do not change the timing), or a larger one."""
    from components.models import build_tiny_policy

    if args.hidden is None:
        path = root / "tiny"
        build_tiny_policy(path, hidden_size=128, num_layers=2, num_heads=4, max_position_embeddings=128)
        return str(path), "tiny_cpu shape (hidden 128, 2 layers, 4 heads, vocab 104), random weights"
    path = root / f"h{args.hidden}_l{args.layers}"
    build_tiny_policy(path, hidden_size=args.hidden, num_layers=args.layers, num_heads=max(args.hidden // 64, 1),
                      max_position_embeddings=128)
    return str(path), f"hidden {args.hidden}, {args.layers} layers, char vocab, random weights"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--precision", default="bf16_fp32_head", help="the tiny recipe's (emulated bf16 on CPU), or fp32")
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "RANK"), help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], int(args.child[1]), args.steps, args.warmup, args.precision)))
        return 0

    def child(path: str, rank: int, steps: int, warmup: int, pin: bool) -> dict:
        env = dict(os.environ)
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
        if pin:
            env["MALLOC_MMAP_THRESHOLD_"] = "131072"
        out = subprocess.run([sys.executable, __file__, "--child", path, str(rank), "--steps", str(steps), "--warmup",
                              str(warmup), "--precision", args.precision], capture_output=True, text=True, check=True,
                             cwd=str(REPO), env=env)
        return json.loads(out.stdout.strip().splitlines()[-1])

    with tempfile.TemporaryDirectory() as tmp:
        path, what = model_dir(args, Path(tmp))
        timed: dict[int, list[dict]] = {0: [], args.rank: []}
        memory: dict[int, list[dict]] = {0: [], args.rank: []}
        for _ in range(args.rounds):
            for rank in (0, args.rank):
                # times with glibc as it is (a pinned mmap threshold makes every large free an munmap: slower
                # steps); memory in a second child with it pinned (1 warm-up + 2 steps: AdamW state exists)
                timed[rank].append(child(path, rank, args.steps, args.warmup, pin=False))
                memory[rank].append(child(path, rank, 2, 1, pin=True))
    result = {"model": what, "precision": args.precision, "rounds": args.rounds, "steps": args.steps, "modes": {}}
    for rank, rs in timed.items():
        name = "full fine-tuning" if rank == 0 else f"LoRA rank {rank}, all-linear"
        ms = memory[rank]
        result["modes"][name] = {
            "step_s_median": statistics.median(t for r in rs for t in r["step_s"]),
            "step_s_round_medians": [round(statistics.median(r["step_s"]), 4) for r in rs],
            "peak_rss_mib_median": statistics.median(r["peak_rss_mib"] for r in ms),
            "step_peak_mib_median": statistics.median(r["step_peak_mib"] for r in ms),
            "parameters": rs[0]["parameters"], "trainable": rs[0]["trainable"],
            "param_mib": round(rs[0]["param_mib"], 3), "grad_mib": round(rs[0]["grad_mib"], 3),
            "adam_mib": round(rs[0]["adam_mib"], 3),
        }
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"model: {what}; precision {args.precision}; {args.rounds} rounds x {args.steps} steps per mode "
          f"(after {args.warmup} warm-up), interleaved")
    print(f"{'mode':<30}{'step s':>9}{'peak RSS MiB':>14}{'step rise':>11}{'trainable':>12}{'params MiB':>12}"
          f"{'grads MiB':>11}{'AdamW MiB':>11}")
    for name, m in result["modes"].items():
        print(f"{name:<30}{m['step_s_median']:>9.4f}{m['peak_rss_mib_median']:>14.0f}{m['step_peak_mib_median']:>11.0f}"
              f"{m['trainable']:>12,}{m['param_mib']:>12.2f}{m['grad_mib']:>11.2f}{m['adam_mib']:>11.2f}")
        print(f"{'':<30}round medians {m['step_s_round_medians']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
