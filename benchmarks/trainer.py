"""Trainer throughput: this trainer (synchronous and PipelineRL-8) against TRL's GRPOTrainer.

One run measures, on the SAME tiny model (the main job's warm-started policy), task, batch
(prompts x generations x max tokens) and number of steps:

- `ours ppo_off_policy(1)`  this trainer, synchronous on-policy (generate, then train, then sync)
- `ours pipeline_rl(8)`     this trainer, the ScaleRL scheme (streaming generator, in-flight weights)
- `TRL GRPOTrainer`         trl's GRPOTrainer, use_vllm=False, loss_type="cispo", beta=0, on
                            CPU (use_cpu=True), same lr / temperature / batch

Each variant runs in its own process; the driver samples the resident memory (RSS) of that
process and all its children every 50 ms and reports the peak of the sum. Seconds per step
are measured after `--warmup` steps (model loading, first-step allocation and the step-0
evaluation are excluded): (time at the last step - time at step `warmup`) / (steps - warmup).
Samples per second = prompts x generations / seconds per step. Ratios are within one run
(the machine is shared; absolute numbers move, ratios much less).

    python benchmarks/trainer.py                      # defaults: 8 prompts x 4 generations x 32 tokens, 30 steps
    python benchmarks/trainer.py --steps 30 --out benchmarks/results/trainer.md
    # did a change slow the trainer? this tree against another checkout, interleaved pair by pair
    git worktree add /tmp/baseline <commit>
    python benchmarks/trainer.py --variants ours_sync,ours_pipeline --baseline /tmp/baseline --repeats 5
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

CONFIG = str(REPO / "experiments" / "configs" / "tiny_cpu.gin")
VARIANTS = {
    "ours_sync": "ours ppo_off_policy(1)",
    "ours_pipeline": "ours pipeline_rl(8)",
    "trl": "TRL GRPOTrainer",
}


# ------------------------------------------------------------------------------ children
def _common_bindings(args) -> list[str]:
    return [
        f"train.prompts_per_step = {args.prompts}",
        f"train.generations_per_prompt = {args.generations}",
        f"train.max_tokens = {args.max_tokens}",
        f"train.total_steps = {args.steps}",
        f"train.micro_batch_size = {args.prompts * args.generations}",
        "train.eval_every = 1000000",
        "train.checkpoint_every = 1000000",
        "train.eval_prompts = 8",
        "train.eval_k = 1",
        "train.compute_budget_hours = None",
    ]


def _variant_bindings(variant: str) -> list[str]:
    if variant == "ours_sync":
        return ['train.off_policy = "ppo_off_policy"', "ppo_off_policy.k = 1"]
    if variant == "ours_pipeline":
        return ['train.off_policy = "pipeline_rl"', "pipeline_rl.k = 8"]
    raise ValueError(f"unknown variant {variant!r}; valid: {sorted(VARIANTS)}")


def run_ours(variant: str, args) -> dict:
    """This trainer through `experiments.train.run_training`; step times from metrics.jsonl."""
    from analysis.runs import read_jsonl
    from experiments.train import run_training

    with tempfile.TemporaryDirectory(prefix=f"bench-{variant}-") as tmp:
        run_dir = Path(tmp) / "run"
        status = run_training([CONFIG], _common_bindings(args) + _variant_bindings(variant) + list(args.gin),
                              str(run_dir), progress=False)
        if status != "done":
            err = (run_dir / "error.txt").read_text() if (run_dir / "error.txt").exists() else status
            raise RuntimeError(f"{variant} run failed: {err}")
        rows, _ = read_jsonl(run_dir / "metrics.jsonl")
    times = {int(r["step"]): float(r["wall_s"]) for r in rows}
    pass_rates = [float(r["pass_rate"]) for r in rows]
    return {"step_times": [times[s] for s in sorted(times)], "train_pass_rate": sum(pass_rates) / len(pass_rates)}


def run_trl(args) -> dict:
    """TRL's GRPOTrainer on the same model, task and batch; step times from a callback."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from components.models import load_causal_lm, load_tokenizer
    from components.tasks import make_task
    from experiments.train import prepare

    if args.trl_threads:
        torch.set_num_threads(args.trl_threads)
    cfg, _, _ = prepare([CONFIG], _common_bindings(args) + list(args.gin))
    task = make_task(cfg.task, seed=cfg.seed, **cfg.task_kwargs)
    problems = list(task.train_problems())
    by_prompt = {p.prompt: p for p in problems}
    n_prompts = args.prompts * (args.steps + 2)
    rows = [{"prompt": [{"role": "user", "content": problems[i % len(problems)].prompt}]} for i in range(n_prompts)]
    dataset = Dataset.from_list(rows)

    passed: list[float] = []

    def reward(prompts, completions, **_) -> list[float]:
        out = []
        for prompt, completion in zip(prompts, completions):
            problem = by_prompt[prompt[-1]["content"]]
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            verdict = task.verify(problem, text)
            passed.append(1.0 if verdict.passed else 0.0)
            out.append(verdict.reward)
        return out

    step_times: list[float] = []
    t0 = time.perf_counter()

    class Timer(TrainerCallback):
        def on_step_end(self, *a, **k):
            step_times.append(time.perf_counter() - t0)

    tokenizer = load_tokenizer(cfg.model_path)
    model = load_causal_lm(cfg.model_path, dtype=torch.float32)
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
        config = GRPOConfig(
            output_dir=tmp,
            use_cpu=True,
            bf16=False,  # TRL defaults to bf16 autocast, ~10x slower on a CPU without bf16 units; ours runs fp32 here too
            use_vllm=False,
            loss_type="cispo",
            epsilon_high=5.0,
            beta=0.0,
            num_generations=args.generations,
            per_device_train_batch_size=args.prompts * args.generations,
            max_completion_length=args.max_tokens,
            temperature=cfg.temperature,
            learning_rate=cfg.lr,
            lr_scheduler_type="constant",
            max_steps=args.steps,
            logging_steps=10**6,
            save_strategy="no",
            report_to="none",
            seed=cfg.seed,
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[Timer()])
        t0 = time.perf_counter()
        trainer.train()
    return {"step_times": step_times, "train_pass_rate": sum(passed) / max(len(passed), 1),
            "torch_threads": torch.get_num_threads()}


def child_main(args) -> int:
    import logging

    logging.disable(logging.WARNING)
    out = run_trl(args) if args.child == "trl" else run_ours(args.child, args)
    Path(args.result).write_text(json.dumps(out))
    return 0


# ------------------------------------------------------------------------------ driver
def _tree_rss(proc) -> int:
    import psutil

    total = 0
    try:
        procs = [proc] + proc.children(recursive=True)
    except psutil.Error:
        return 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def measure(variant: str, args, tree: Path = REPO) -> dict:
    """Run one variant in a child process; its step times, samples/s and the peak RSS of its process tree.
    `tree`: the checkout whose code runs (another one: `--baseline`)."""
    import psutil

    with tempfile.TemporaryDirectory(prefix="bench-result-") as tmp:
        result_path = Path(tmp) / "result.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, str(tree / "benchmarks" / "trainer.py"), "--child", variant, "--result", str(result_path),
               "--steps", str(args.steps), "--prompts", str(args.prompts), "--generations", str(args.generations),
               "--max-tokens", str(args.max_tokens), "--trl-threads", str(args.trl_threads)] + [x for g in args.gin for x in ("--gin", g)]
        t0 = time.perf_counter()
        child = subprocess.Popen(cmd, cwd=str(tree), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        proc = psutil.Process(child.pid)
        peak = [0]
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], _tree_rss(proc))
                stop.wait(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        output, _ = child.communicate()
        stop.set()
        sampler.join()
        wall = time.perf_counter() - t0
        if child.returncode != 0 or not result_path.exists():
            raise RuntimeError(f"{VARIANTS[variant]} failed (exit {child.returncode}):\n{output[-4000:]}")
        res = json.loads(result_path.read_text())
    times = res["step_times"]
    if len(times) < args.steps:
        raise RuntimeError(f"{VARIANTS[variant]}: {len(times)} step times for {args.steps} steps")
    w = args.warmup
    sec_per_step = (times[args.steps - 1] - times[w - 1]) / (args.steps - w)
    return {
        "variant": variant,
        "name": VARIANTS[variant],
        "sec_per_step": sec_per_step,
        "samples_per_s": args.prompts * args.generations / sec_per_step,
        "peak_rss_mib": peak[0] / 2**20,
        "wall_s": wall,
        "train_pass_rate": res.get("train_pass_rate"),
        "torch_threads": res.get("torch_threads"),
    }


def median_result(rs: list[dict]) -> dict:
    """The repeat with the median seconds per step (its memory alongside), plus the spread."""
    ordered = sorted(rs, key=lambda r: r["sec_per_step"])
    out = dict(ordered[(len(ordered) - 1) // 2])
    out["sec_per_step_all"] = [r["sec_per_step"] for r in rs]
    out["peak_rss_mib"] = max(r["peak_rss_mib"] for r in rs)
    return out


def baseline_table(variants: list[str], runs: dict[str, list[dict]], args) -> str:
    """This tree's step time against the baseline checkout's, per variant: the median of the
    per-repeat ratios (each pair ran back to back) and the medians of each side."""
    import statistics

    lines = [f"Step time against the baseline checkout `{args.baseline}` (interleaved, {args.repeats} pairs):", "",
             "| variant | this tree s/step (median) | baseline s/step (median) | ratio this/baseline (median of pairs) | pair ratios |",
             "|---|---|---|---|---|"]
    for v in variants:
        mine = [r["sec_per_step"] for r in runs[v]]
        base = [r["sec_per_step"] for r in runs[v + "@baseline"]]
        ratios = [a / b for a, b in zip(mine, base)]
        lines.append(f"| {VARIANTS[v]} | {statistics.median(mine):.3f} | {statistics.median(base):.3f} | "
                     f"{statistics.median(ratios):.3f} | {', '.join(f'{x:.3f}' for x in ratios)} |")
    return "\n".join(lines)


def table(results: list[dict], args) -> str:
    base = {r["variant"]: r for r in results}
    trl = base.get("trl")
    sync = base.get("ours_sync")
    lines = [
        f"Trainer throughput, {args.prompts} prompts x {args.generations} generations x {args.max_tokens} max tokens, "
        f"{args.steps} steps (first {args.warmup} excluded), main-job tiny model and arithmetic task; "
        f"median of {args.repeats} interleaved repeats (s/step of every repeat in the last column).",
        "",
        "| trainer | s/step | samples/s | peak RSS (MiB, all processes) | x TRL samples/s | x ours sync samples/s | train pass rate | s/step, each repeat |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        vs_trl = f"{r['samples_per_s'] / trl['samples_per_s']:.2f}" if trl else "-"
        vs_sync = f"{r['samples_per_s'] / sync['samples_per_s']:.2f}" if sync else "-"
        pr = r.get("train_pass_rate")
        pr_text = f"{pr:.2f}" if pr is not None else "-"
        lines.append(f"| {r['name']} | {r['sec_per_step']:.3f} | {r['samples_per_s']:.1f} | {r['peak_rss_mib']:.0f} | "
                     f"{vs_trl} | {vs_sync} | {pr_text} | {', '.join(f'{x:.3f}' for x in r.get('sec_per_step_all', []))} |")
    import torch

    lines += [
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, no GPU; torch {torch.__version__}; "
        f"{_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}; 1-min load average at the end "
        f"{os.getloadavg()[0]:.1f}.",
        f"Command: `python benchmarks/trainer.py --steps {args.steps} --warmup {args.warmup} --repeats {args.repeats} --prompts {args.prompts} "
        f"--generations {args.generations} --max-tokens {args.max_tokens}"
        + (f" --trl-threads {args.trl_threads}" if args.trl_threads else "") + "`",
        f"TRL torch threads: {next((r.get('torch_threads') for r in results if r['variant'] == 'trl'), '-')}; "
        "ours: one thread per process (learner + generator).",
    ]
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="steps excluded from the timing (>= 1)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every variant; the median is reported")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--variants", default="ours_sync,ours_pipeline,trl", help=f"comma-separated, of {sorted(VARIANTS)}")
    p.add_argument("--gin", action="append", default=[], help="extra gin binding for our trainer and the shared config")
    p.add_argument("--trl-threads", type=int, default=0, help="torch threads for TRL (0: torch's default, all cores)")
    p.add_argument("--out", default=None, help="also write the markdown table (and a .json) here")
    p.add_argument("--baseline", default=None, metavar="CHECKOUT",
                   help="another checkout of this repository (e.g. `git worktree add /tmp/old <commit>`): every "
                        "variant also runs from it, interleaved with this tree's (this, baseline, this, ...), and "
                        "the table gives this tree's step time over the baseline's")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if not 1 <= args.warmup < args.steps:
        p.error(f"--warmup must be in [1, steps), got {args.warmup} with --steps {args.steps}")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        print(f"unknown variant(s) {bad}; valid: {sorted(VARIANTS)}", file=sys.stderr)
        return 2
    # Build (or find) the warm-started model once, outside every timed process.
    from experiments.train import prepare

    cfg, _, _ = prepare([CONFIG], _common_bindings(args) + list(args.gin))
    print(f"model: {cfg.model_path}", flush=True)
    trees = {"": REPO}
    if args.baseline:
        baseline = Path(args.baseline).expanduser().resolve()
        if not (baseline / "benchmarks" / "trainer.py").is_file():
            print(f"--baseline {args.baseline!r} is not a checkout of this repository (no benchmarks/trainer.py)", file=sys.stderr)
            return 2
        trees["@baseline"] = baseline
    runs: dict[str, list[dict]] = {v + t: [] for v in variants for t in trees}
    for rep in range(args.repeats):  # interleaved, so a burst of load hits every variant alike
        for v in variants:
            for tag, tree in trees.items():
                print(f"[{rep + 1}/{args.repeats}] running {VARIANTS[v]}{tag} ...", flush=True)
                r = measure(v, args, tree)
                print(f"  {r['sec_per_step']:.3f} s/step, {r['samples_per_s']:.1f} samples/s, peak {r['peak_rss_mib']:.0f} MiB "
                      f"(wall {r['wall_s']:.0f} s)", flush=True)
                runs[v + tag].append(r)
    results = [median_result(runs[v]) for v in variants]
    md = table(results, args)
    if args.baseline:
        md += "\n\n" + baseline_table(variants, runs, args)
    print()
    print(md)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(md + "\n")
        out.with_suffix(".json").write_text(json.dumps({"median": results, "all": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
