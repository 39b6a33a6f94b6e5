"""Weight sync seconds against model size: gloo broadcast, ipc shared buffers, and the old torch.save-over-a-queue path.

The benchmark process is learner rank 0; it spawns G generator processes, each holding a
TorchEngine of the same architecture. Models are built locally from LlamaConfig / Qwen2Config
shapes with random weights (nothing downloaded). Per (size, precision, G), each repeat is one
update, timed END TO END: from the learner starting the update (gather + cast) until the last
generator has loaded every tensor into its engine (wall clock of one machine). Also reported:
the learner's `WeightSender.send` seconds. Medians over `--repeats`.

- `broadcast`: this repo's path (components/trainer/weight_sync.py): announce a WeightUpdate,
  `push_weights` (iter_full_parameters -> WeightSender.send, bucketed gloo broadcast),
  generators `engine.receive_weights(receiver, update)` (copied into parameters in place).
- `--backends ipc`: the same update through shared buffers (components/trainer/weight_sync.py
  "ipc": CPU shared memory, or CUDA IPC with `--device cuda`, where every process shares the GPU).
- `queue` (the path it replaces): torch.save of the state dict to bytes, one multiprocessing
  queue put per generator, torch.load + `engine.update_weights` in the generator. Run only up
  to `--queue-max-params` (it holds several full copies at once).

    python benchmarks/weight_sync.py                                   # defaults below
    python benchmarks/weight_sync.py --sizes 10M,50M --generators 1 --repeats 3
    python benchmarks/weight_sync.py --backends gloo,ipc --sizes 50M,260M --precisions bf16 --generators 1
    python benchmarks/weight_sync.py --device cuda --backends ipc --sizes 500M,1.5B --precisions bf16 --generators 1
"""

from __future__ import annotations

import argparse
import datetime as _dt
import io
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# name -> (config class, config kwargs). Shapes of real families; the 500M one is Qwen2.5-0.5B's.
SIZES = {
    "10M": ("llama", dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=4,
                          intermediate_size=1024, vocab_size=8192, tie_word_embeddings=False)),
    "50M": ("llama", dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                          intermediate_size=2048, vocab_size=16384, tie_word_embeddings=False)),
    "110M": ("llama", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                           intermediate_size=2048, vocab_size=32000, tie_word_embeddings=True)),
    "260M": ("qwen2", dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
                           intermediate_size=3072, vocab_size=65536, tie_word_embeddings=True)),
    "500M": ("qwen2", dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                           intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True)),
    "1.5B": ("qwen2", dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                           intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True)),  # Qwen2.5-1.5B's
}
TIMEOUT_S = 600.0


def build_model(size: str, init: bool, device: str = "cpu"):
    """A causal LM of shape `size` in fp32 on `device` (random normal weights if `init`, else
    uninitialised memory)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    family, kw = SIZES[size]
    cfg_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if family == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    config = cfg_cls(max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0, **kw)
    with torch.device("meta"):
        model = model_cls(config)
    model = model.to_empty(device="cpu")
    model.tie_weights()
    if init:
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02, generator=gen)
    for module in model.modules():  # rotary buffers: to_empty left them uninitialised; rebuild them
        if hasattr(module, "inv_freq") and hasattr(module, "config"):
            fresh = type(module)(module.config)
            for name, buf in fresh.named_buffers(recurse=False):
                getattr(module, name).copy_(buf)
    return model.to(device).eval()


# ------------------------------------------------------------------------------ generator process
def generator_main(index: int, group, ctrl_q, done_q, device: str = "cpu") -> None:
    import torch

    torch.set_num_threads(1)
    try:
        from components.engines.torch_engine import TorchEngine
        from components.models import make_char_tokenizer
        from components.trainer.weight_sync import WeightReceiver

        receiver = WeightReceiver(group, group.generator_rank(index), device=device)
        receiver.connect()  # the learner connects at startup too: both sides join the group together
        tokenizer = make_char_tokenizer()
        engine = None
        while True:
            msg = ctrl_q.get(timeout=TIMEOUT_S)
            if msg[0] == "stop":
                return
            if msg[0] == "build":  # ("build", size, precision)
                engine = None
                engine = TorchEngine("", precision=msg[2], device=device, model=build_model(msg[1], init=False, device=device),
                                     tokenizer=tokenizer)
                done_q.put(("built", index, time.time()))
            elif msg[0] == "update":  # ("update", WeightUpdate)
                engine.receive_weights(receiver, msg[1])
                if device != "cpu":
                    torch.cuda.synchronize()
                done_q.put(("done", index, time.time()))
            elif msg[0] == "weights":  # ("weights", version, torch.save bytes): the old path
                state = torch.load(io.BytesIO(msg[2]), map_location="cpu", weights_only=True)
                engine.update_weights(state, msg[1])
                del state
                done_q.put(("done", index, time.time()))
    except BaseException as err:  # noqa: BLE001
        done_q.put(("error", index, repr(err)))
        raise


# ------------------------------------------------------------------------------ learner (this process)
def _wait_all(done_q, n: int, what: str) -> list[float]:
    times = []
    while len(times) < n:
        kind, index, value = done_q.get(timeout=TIMEOUT_S)
        if kind == "error":
            raise RuntimeError(f"generator {index} failed: {value}")
        if kind != what:
            raise RuntimeError(f"expected {what!r} from the generators, got {kind!r}")
        times.append(value)
    return times


def run(args) -> list[dict]:
    import torch
    import torch.multiprocessing as mp

    from components.precision import get_precision
    from components.trainer.weight_sync import WeightGroup, WeightSender, WeightUpdate, generator_state_meta, push_weights

    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    rows = []
    for backend, G in [(b, g) for b in args.backends for g in args.generators]:
        group = WeightGroup.local(G, timeout_s=args.timeout, bucket_mb=args.bucket_mb, backend=backend)
        ctrl = [ctx.Queue() for _ in range(G)]
        done_q = ctx.Queue()
        procs = [ctx.Process(target=generator_main, args=(i, group, ctrl[i], done_q, args.device), daemon=True)
                 for i in range(G)]
        for p in procs:
            p.start()
        sender = WeightSender(group, device=args.device if backend == "ipc" else None)
        sender.connect()
        try:
            for size in args.sizes:
                model = build_model(size, init=True, device=args.device)
                n_params = sum(p.numel() for p in model.parameters())
                for precision in args.precisions:
                    for q in ctrl:
                        q.put(("build", size, precision))
                    _wait_all(done_q, G, "built")
                    plan = WeightUpdate.plan(0, generator_state_meta(model, precision), args.bucket_mb)
                    e2e, send = [], []
                    for r in range(args.warmup + args.repeats):
                        update = plan.with_version(r + 1)
                        t0 = time.time()
                        for q in ctrl:
                            q.put(("update", update))
                        stats = push_weights(model, precision, update, sender)
                        seconds = max(_wait_all(done_q, G, "done")) - t0
                        if r >= args.warmup:
                            e2e.append(seconds)
                            send.append(stats.seconds)
                    row = dict(backend=backend, size=size, params=n_params, precision=precision, generators=G, bytes=plan.total_bytes,
                               buckets=len(plan.buckets), broadcast_s=statistics.median(e2e),
                               send_s=statistics.median(send), queue_s=None)
                    if n_params <= args.queue_max_params and backend == args.backends[0]:
                        dtype = get_precision(precision).param_dtype
                        old = []
                        for r in range(args.repeats):
                            t0 = time.time()
                            buf = io.BytesIO()
                            torch.save({k: v.detach().to(dtype) for k, v in model.state_dict().items()}, buf)
                            payload = buf.getvalue()
                            for q in ctrl:
                                q.put(("weights", r + 1, payload))
                            del buf, payload
                            old.append(max(_wait_all(done_q, G, "done")) - t0)
                        row["queue_s"] = statistics.median(old)
                    rows.append(row)
                    print(_fmt_row(row), flush=True)
                del model
        finally:
            for q in ctrl:
                q.put(("stop",))
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
            sender.close()
    return rows


def _fmt_row(r: dict) -> str:
    gbps = r["bytes"] / r["broadcast_s"] / 1e9
    queue = f"{r['queue_s']:.3f}" if r["queue_s"] is not None else "-"
    ratio = f"{r['queue_s'] / r['broadcast_s']:.2f}" if r["queue_s"] is not None else "-"
    return (f"| {r['backend']} | {r['size']} | {r['params'] / 1e6:.1f} | {r['precision']} | {r['generators']} | {r['bytes'] / 2**20:.0f} | "
            f"{r['buckets']} | {r['broadcast_s']:.3f} | {r['send_s']:.3f} | {gbps:.2f} | {queue} | {ratio} |")


HEADER = ("| backend | model shape | params (M) | precision | generators | MiB sent | buckets | sync e2e s (median) | "
          "learner send s | GB/s | queue e2e s (old path) | queue / sync |\n|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10M,50M,110M,260M,500M", help=f"comma-separated, from {list(SIZES)}")
    ap.add_argument("--precisions", default="fp32,bf16", help="comma-separated precision policies")
    ap.add_argument("--generators", default="1,2", help="comma-separated generator counts")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=0, help="untimed updates before the timed ones (ipc's first update "
                                                          "moves the buffers into shared memory)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: learner and generators on the visible GPU(s); "
                                                     "gloo is staged through host memory, ipc uses CUDA IPC")
    ap.add_argument("--backends", default="gloo", help="comma-separated weight group backends: gloo, ipc")
    ap.add_argument("--bucket-mb", type=float, default=64.0, help="train.weight_sync_bucket_mb")
    ap.add_argument("--queue-max-params", type=float, default=2e8, help="run the old queue path up to this many parameters")
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S,
                    help="seconds the weight group waits for a generator (a generator that failed is reported after it; "
                         "on a GPU lease, where a command has 10 minutes, use ~120)")
    args = ap.parse_args(argv)
    args.sizes = [s for s in args.sizes.split(",") if s]
    bad = [s for s in args.sizes if s not in SIZES]
    if bad:
        ap.error(f"unknown size(s) {bad}; valid: {list(SIZES)}")
    args.precisions = [p for p in args.precisions.split(",") if p]
    args.generators = [int(g) for g in args.generators.split(",") if g]
    args.backends = [b for b in args.backends.split(",") if b]
    if not args.backends or any(b not in ("gloo", "ipc") for b in args.backends):
        ap.error(f"--backends must name gloo and/or ipc, got {args.backends}")
    if args.repeats < 1 or args.warmup < 0 or any(g < 1 for g in args.generators):
        ap.error("--repeats and every --generators value must be >= 1, --warmup >= 0")
    print(f"# weight sync, {_dt.date.today()}, {platform.node()}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}, bucket {args.bucket_mb} MiB, median of {args.repeats} after {args.warmup} warm-up")
    print(HEADER, flush=True)
    run(args)
    print(f"# load average at the end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
