"""Host memory of a sharded learner at start (issue 10): every rank reads the checkpoint, or rank 0 only.

A random-weight model of a real architecture (`--size`, the shapes of benchmarks/weight_sync.py;
500M is Qwen2.5-0.5B's) is saved once with save_pretrained, in bfloat16 as published checkpoints
are (`--checkpoint-dtype`; an fp32 checkpoint is memory-mapped, and a rank then only reads the
pages of its own shards). Then T learner ranks (`--ranks`, gloo,
one process each, spawned fresh per mode) build the trainer's `Learner` on it, as a run does:

    meta  (the trainer's path) learner rank 0 loads the checkpoint; ranks >= 1 build an empty
          skeleton on the meta device (`components.models.empty_causal_lm`), `fully_shard` it,
          allocate their own shards and receive them from rank 0 (`learner.load_from_rank0`)
    full  (the path before it) every rank loads the whole checkpoint, then shards it

Reported per rank: the peak resident memory of the process (VmHWM) once its Learner is built,
and the seconds from the start of the build to the end. The full model in fp32 is
4 bytes x parameters; after sharding each rank keeps about 1/T of it (plus AdamW's state later).

    .venv/bin/python benchmarks/learner_start.py --size 500M --ranks 2
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

MODES = ("meta", "full")


def peak_rss_gib() -> float:
    """This process's peak resident set size (VmHWM) in GiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _rank_main(rank: int, world: int, init_file: str, model_dir: str, mode: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from components.models import empty_causal_lm, load_causal_lm, load_tokenizer
    from components.registry import load_builtin_components
    from components.trainer.config import TrainConfig
    from components.trainer.learner import Learner

    torch.set_num_threads(1)
    load_builtin_components()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        tok = load_tokenizer(model_dir)
        cfg = TrainConfig(model_path=model_dir, precision="fp32")
        dist.barrier()
        start = time.perf_counter()
        model = empty_causal_lm(model_dir) if (mode == "meta" and rank > 0) else load_causal_lm(model_dir)
        learner = Learner(model, cfg, tok.pad_token_id, torch.device("cpu"))
        seconds = time.perf_counter() - start
        local = sum(p.to_local().numel() for p in learner.model.parameters())
        row = dict(mode=mode, rank=rank, ranks=world, peak_rss_gib=round(peak_rss_gib(), 3),
                   seconds=round(seconds, 2), local_params=local, params=learner.num_parameters)
        dist.barrier()
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="500M")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--modes", default="meta,full", help=f"comma-separated, from {list(MODES)}")
    ap.add_argument("--checkpoint-dtype", default="bf16", choices=["bf16", "fp32"],
                    help="dtype of the saved checkpoint (the learner loads it in fp32)")
    ap.add_argument("--json", default=None, help="append the rows to this JSON-lines file")
    args = ap.parse_args(argv)
    from weight_sync import SIZES, build_model

    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown mode(s) {bad}; valid: {list(MODES)}")
    if args.size not in SIZES:
        ap.error(f"unknown size {args.size!r}; valid: {list(SIZES)}")
    if args.ranks < 2:
        ap.error(f"--ranks {args.ranks}: a sharded learner needs at least 2")

    import torch.multiprocessing as mp

    from components.models import make_char_tokenizer
    from components.quiet import quiet_libraries

    quiet_libraries()
    rows = []
    with tempfile.TemporaryDirectory(prefix="learner_start_") as tmp:
        model_dir = Path(tmp) / "model"
        import torch

        model = build_model(args.size, init=True)
        model.to({"bf16": torch.bfloat16, "fp32": torch.float32}[args.checkpoint_dtype]).save_pretrained(model_dir)
        make_char_tokenizer().save_pretrained(model_dir)
        del model
        for mode in modes:
            out = Path(tmp) / f"{mode}.jsonl"
            mp.start_processes(_rank_main, args=(args.ranks, str(Path(tmp) / f"init_{mode}"), str(model_dir), mode, str(out)),
                               nprocs=args.ranks, start_method="spawn")
            rows += sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["rank"])
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"# learner start, {args.size} ({rows[0]['params'] / 1e6:.0f}M parameters, "
          f"{rows[0]['params'] * 4 / 2**30:.2f} GiB in fp32), {args.checkpoint_dtype} checkpoint, "
          f"{args.ranks} gloo ranks on CPU, {stamp}")
    print("| mode | rank | peak RSS (GiB) | build (s) | parameters held |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['rank']} | {r['peak_rss_gib']:.2f} | {r['seconds']:.1f} | {r['local_params'] / 1e6:.0f}M |")
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps(dict(r, size=args.size, checkpoint_dtype=args.checkpoint_dtype, when=stamp)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
