"""A data-parallel FSDP2 learner: T = 2 ranks give the one-process gradient (issue 10, items 1 and 2).

Every loss x aggregation, on rollouts with UNEQUAL completion lengths (split so the two ranks
hold different numbers of tokens, sequences and micro-batches), off-policy generator
log-probs (so clipping and IS weights are active) and the batch advantage normalisation
(its std over the WHOLE step batch). The test compares the full gradient (gathered with
`full_tensor()`, before any optimizer step: AdamW would hide a scale error) and the grad norm
of two gloo ranks against one plain process on the same batch, within 1e-6 relative.
It also checks the fp32 master weights of item 1: a bf16 step at the paper's learning rate
changes every trainable tensor.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _emulated_ranks import accumulate_as_ranks, clip_as_ranks  # noqa: E402
from _helpers_trainer import tiny_model  # noqa: E402

LOSSES = ["grpo", "dapo", "cispo", "gspo", "ppo_dual_clip", "icepop"]
AGGREGATIONS = ["token_mean", "sample_mean", "prompt_mean"]
COMBOS = [(loss, agg, "batch") for loss in LOSSES for agg in AGGREGATIONS] + [("cispo", "prompt_mean", "prompt")]


def make_rollouts(tokenizer, n_groups: int = 4, G: int = 4, seed: int = 0):
    """Groups whose completions have unequal lengths (1..9 tokens) and noisy generator log-probs."""
    from components.engines.base import Completion
    from components.trainer.rollout import Rollout

    g = torch.Generator().manual_seed(seed)
    vocab = len(tokenizer)
    rollouts = []
    for gi in range(n_groups):
        prompt = tokenizer.encode(f"{gi}+{gi * 3}=", add_special_tokens=False)[: 3 + gi]
        comps, rewards = [], []
        for s in range(G):
            n = int(torch.randint(1, 10, (1,), generator=g))
            toks = torch.randint(4, vocab, (n,), generator=g).tolist()
            gen_logp = (-2.0 - 3.0 * torch.rand(n, generator=g)).tolist()  # off-policy: ratios far from 1
            comps.append(Completion(gi, s, list(prompt), toks, gen_logp, [0] * n, [False] * n, "stop"))
            rewards.append(1.0 if (s + gi) % 3 == 0 else -1.0)
        rollouts.append(Rollout(order_id=gi, problem_id=f"p{gi}", completions=comps, rewards=rewards,
                                passed=[r > 0 for r in rewards]))
    return rollouts


def COMPILED(model_path: str, **kw):
    """train.compile (tests/test_compile.py) under FSDP2: packed, checkpointed blocks compiled after
    fully_shard (tests/_helpers_compile's recording aot_eager: inductor's graphs and hooks without
    its C++ compile)."""
    from _helpers_compile import RECORDING

    settings = dict(max_tokens_per_micro_batch=24, activation_checkpointing=True, compile=True, compile_backend=RECORDING)
    return config(model_path, "cispo", "prompt_mean", "batch", **{**settings, **kw})


def config(model_path: str, loss: str, agg: str, adv: str, **kw):
    from components.trainer.config import TrainConfig

    settings = dict(loss=loss, aggregation=agg, advantage_norm=adv, lr=1e-3, warmup_steps=0, weight_decay=0.0,
                    micro_batch_size=3, prompts_per_step=4, generations_per_prompt=4, grad_clip=0.0, precision="fp32")
    settings.update(kw)
    return TrainConfig(model_path=model_path, **settings)


def gradients(model_path: str, rollouts, cfg, ranks: int, rank: int):
    """(full gradient by parameter name, grad norm) after accumulating this rank's share."""
    from components.models import load_causal_lm, load_tokenizer
    from components.trainer.learner import Learner, plan_step

    torch.manual_seed(0)
    tok = load_tokenizer(model_path)
    learner = Learner(load_causal_lm(model_path), cfg, tok.pad_token_id, torch.device("cpu"))
    plan = plan_step(rollouts, [True] * len(rollouts), cfg, tok.pad_token_id, ranks)
    learner.accumulate(plan.shards[rank])
    grads = {}
    for name, p in learner.model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name] = g.detach().clone()
    return grads, learner.grad_norm(), [len(s) for s in plan.shards], [int(sum(int(mb.batch.mask.sum()) for mb in s)) for s in plan.shards]


def emulated_gradients(model_path: str, rollouts, cfg, ranks: int):
    """(full gradient by parameter name, grad norm) of ONE process computing as `ranks` ranks (the
    test double tests/_emulated_ranks.py), on one thread as every rank process runs (a matmul's
    summation order depends on the threads)."""
    from components.models import load_causal_lm, load_tokenizer
    from components.trainer.learner import Learner, plan_step

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        tok = load_tokenizer(model_path)
        learner = Learner(load_causal_lm(model_path), cfg, tok.pad_token_id, torch.device("cpu"))
        plan = plan_step(rollouts, [True] * len(rollouts), cfg, tok.pad_token_id, ranks)
        accumulate_as_ranks(learner, plan.shards)
        grads = {name: p.grad.detach().clone() for name, p in learner.model.named_parameters()}
        return grads, clip_as_ranks(learner, ranks)
    finally:
        torch.set_num_threads(threads)


def _rank_main(rank: int, world: int, init_file: str, model_path: str, out: str) -> None:
    import torch.distributed as dist

    from components.models import load_tokenizer
    from components.registry import load_builtin_components

    torch.set_num_threads(1)
    load_builtin_components()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        tok = load_tokenizer(model_path)
        rollouts = make_rollouts(tok)
        results = {}
        for loss, agg, adv in COMBOS:
            results[(loss, agg, adv)] = gradients(model_path, rollouts, config(model_path, loss, agg, adv), world, rank)
        from _helpers_compile import GRAPHS, compiled_ops, register_recording_backend

        register_recording_backend()
        results["compiled"] = gradients(model_path, rollouts, COMPILED(model_path), world, rank)
        results["compiled_ops"] = compiled_ops()
        assert GRAPHS, "nothing compiled"
        if rank == 0:
            with open(out, "wb") as f:
                pickle.dump(results, f)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("ranks_model"))


@pytest.mark.slow
def test_two_ranks_give_the_one_process_gradient_for_every_loss_and_aggregation(tmp_path, model_path):
    import torch.multiprocessing as mp

    from components.models import load_tokenizer
    from components.registry import load_builtin_components

    load_builtin_components()
    out = tmp_path / "two_ranks.pkl"
    mp.start_processes(_rank_main, args=(2, str(tmp_path / "init"), model_path, str(out)), nprocs=2, start_method="spawn")
    two = pickle.loads(out.read_bytes())
    rollouts = make_rollouts(load_tokenizer(model_path))
    for combo in COMBOS:
        ref, ref_norm, _, _ = gradients(model_path, rollouts, config(model_path, *combo), 1, 0)
        got, got_norm, mbs, tokens = two[combo]
        assert mbs[0] == mbs[1], "FSDP2 needs the same number of micro-batches on every rank"
        assert tokens[0] != tokens[1] and min(tokens) > 0, f"the split should be uneven but non-empty: {tokens}"
        assert got_norm == pytest.approx(ref_norm, rel=1e-6), combo
        assert ref_norm > 0
        for name in ref:
            scale = ref[name].abs().max().clamp_min(1e-12)
            err = (got[name] - ref[name]).abs().max() / scale
            assert err < 1e-6, f"{combo} {name}: relative gradient error {float(err):.2e}"
        # one process in the arithmetic of two ranks (tests/_emulated_ranks.py): bit for bit
        emu, emu_norm = emulated_gradients(model_path, rollouts, config(model_path, *combo), 2)
        assert emu_norm == got_norm, combo
        for name in ref:
            assert torch.equal(emu[name], got[name]), f"{combo} {name}: emulated 2-rank gradient is not bit-equal"
    # compiled decoder blocks and head under FSDP2 against ONE eager process
    ref, ref_norm, _, _ = gradients(model_path, rollouts, COMPILED(model_path, compile=False), 1, 0)
    got, got_norm, mbs, _ = two["compiled"]
    assert mbs[0] == mbs[1] >= 2
    ops = two["compiled_ops"]  # rank 0's: its blocks' attention and MLP were compiled, not only the head
    assert any("scaled_dot_product_attention" in op for op in ops) and any("silu" in op for op in ops), sorted(ops)
    assert got_norm == pytest.approx(ref_norm, rel=1e-5)
    for name in ref:
        err = (got[name] - ref[name]).abs().max() / ref[name].abs().max().clamp_min(1e-12)
        assert err < 1e-5, f"compiled, two ranks: {name}: relative gradient error {float(err):.2e}"
    # compiled, in ONE process computing as two ranks (tests/_emulated_ranks.py with train.compile)
    from _helpers_compile import GRAPHS, compiled_ops, register_recording_backend

    register_recording_backend()
    torch._dynamo.reset()  # compile afresh: graphs cached by earlier tests would not be recorded again
    start = len(GRAPHS)
    emu, emu_norm = emulated_gradients(model_path, rollouts, COMPILED(model_path), 2)
    ops = compiled_ops(start)  # the emulation ran the compiled blocks, not eager ones
    assert any("scaled_dot_product_attention" in op for op in ops) and any("silu" in op for op in ops), sorted(ops)
    assert emu_norm == got_norm
    for name in ref:
        assert torch.equal(emu[name], got[name]), f"compiled: {name}: emulated 2-rank gradient is not bit-equal"


def test_a_gradient_scale_error_is_caught(model_path):
    """Control: halving the loss (FSDP2's averaging, uncorrected) is far outside the tolerance."""
    from components.models import load_tokenizer
    from components.registry import load_builtin_components

    load_builtin_components()
    rollouts = make_rollouts(load_tokenizer(model_path))
    cfg = config(model_path, "cispo", "prompt_mean", "batch")
    ref, ref_norm, _, _ = gradients(model_path, rollouts, cfg, 1, 0)
    half = {k: v / 2 for k, v in ref.items()}
    assert any(((half[k] - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-12)) > 1e-6 for k in ref)


def test_the_emulated_grad_norm_is_the_plain_norm_up_to_round_off():
    """The test double's sharded norm reduces as two ranks do: the plain norm to round-off, and
    one rank is the plain norm."""
    from _emulated_ranks import sharded_grad_norm

    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(5, 3, generator=g), torch.randn(1, generator=g), torch.randn(4, generator=g)]
    plain = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x) for x in grads]))
    for ranks in (1, 2, 3):
        assert float(sharded_grad_norm(grads, ranks)) == pytest.approx(float(plain), rel=1e-6)
    assert float(sharded_grad_norm([torch.zeros(3)], 2)) == 0.0


def test_rows_and_micro_batches_split_evenly():
    from components.trainer.learner import split_rows

    lengths = [9, 1, 5, 5, 3, 8, 2, 7]
    parts = split_rows(lengths, 2)
    assert sorted(i for p in parts for i in p) == list(range(8))
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert abs(loads[0] - loads[1]) <= max(lengths)
    assert split_rows(lengths, 1) == [list(range(8))]


def test_bf16_step_at_the_paper_lr_changes_every_fp32_master_tensor(model_path):
    """Item 1: master weights stay fp32 whatever the policy; one bf16 step at lr 5e-7 moves every tensor."""
    from components.models import load_causal_lm, load_tokenizer
    from components.registry import load_builtin_components
    from components.trainer.learner import Learner

    load_builtin_components()
    tok = load_tokenizer(model_path)
    for precision in ("bf16", "bf16_fp32_head"):
        cfg = config(model_path, "cispo", "prompt_mean", "batch", precision=precision, lr=5e-7)
        learner = Learner(load_causal_lm(model_path), cfg, tok.pad_token_id, torch.device("cpu"))
        before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
        assert all(p.dtype == torch.float32 for p in before.values()), "master weights must be fp32"
        stats = learner.step(make_rollouts(tok), [True] * 4)
        assert stats["grad_norm"] > 0
        state = learner.optimizer.state
        assert all(s["exp_avg"].dtype == torch.float32 for s in state.values()), "AdamW state must be fp32"
        unchanged = [n for n, p in learner.model.named_parameters() if torch.equal(p.detach(), before[n])]
        assert not unchanged, f"{precision}: these master tensors did not move at lr 5e-7: {unchanged}"
        # the same update on bf16 weights is lost to rounding (why master weights must be fp32)
        w = torch.full((1000,), 0.02).to(torch.bfloat16)  # bf16 spacing at 0.02 is ~1.2e-4
        assert torch.equal((w.float() - 5e-7).to(torch.bfloat16), w)


# ---------------------------------------------------------------------------------------
# end to end: the trainer with T = 2 learner ranks, and resuming at another T (items 2 and 7)
def _run(tmp_path, model_path, name: str, steps: int, ranks: int, run_dir=None) -> Path:
    import gin

    from _helpers_trainer import write_gin
    from experiments.train import run_training

    gin.clear_config()
    run_dir = Path(run_dir or tmp_path / name)
    cfg = write_gin(tmp_path / f"{name}-{steps}-{ranks}.gin", model_path, train__total_steps=str(steps),
                    train__checkpoint_every="2", train__eval_every="100", train__learner_ranks=str(ranks),
                    train__micro_batch_size="5",
                    train__grad_clip="0.05")  # clipping active: its norm must match too
    # an existing run directory resumes at another learner_ranks (a setting any re-run may change) and to more
    # steps (an extension: --extend)
    assert run_training([cfg], [], str(run_dir), progress=False, extend=run_dir.exists()) == "done", \
        (run_dir / "run.json").read_text()
    gin.clear_config()
    return run_dir


def _interrupt(run_dir: Path) -> None:
    """Mark a finished 4-step run as preempted, so the same directory resumes to 6 steps."""
    import json

    info = json.loads((run_dir / "run.json").read_text())
    info["status"] = "interrupted"
    (run_dir / "run.json").write_text(json.dumps(info))


def _final(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "final" / "model.safetensors"))


def _assert_close(a: dict, b: dict, what: str) -> float:
    assert a.keys() == b.keys()
    worst = 0.0
    for k in a:
        worst = max(worst, float((a[k] - b[k]).abs().max()))
    assert worst < 1e-5, f"{what}: weights differ by {worst:.2e}"
    return worst


@pytest.mark.slow
def test_trainer_with_two_learner_ranks_matches_one_and_resumes_at_another_rank_count(tmp_path, model_path):
    from _helpers_trainer import read_jsonl, run_json

    one = _run(tmp_path, model_path, "one", 6, 1)
    two = _run(tmp_path, model_path, "two", 6, 2)
    assert run_json(two)["hardware"]["learner_ranks"] == 2
    # the same run with 1 and 2 learner ranks ends with the same weights (fp32 round-off)
    diff = _assert_close(_final(one), _final(two), "T=1 vs T=2")
    m1, m2 = read_jsonl(one / "metrics.jsonl"), read_jsonl(two / "metrics.jsonl")
    assert [m["reward_mean"] for m in m1] == [m["reward_mean"] for m in m2]  # the same samples were drawn
    for a, b in zip(m1, m2):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    print(f"T=1 vs T=2 after 6 steps: max |dw| = {diff:.2e}")
    assert "emulate_learner_ranks" not in run_json(two)["hardware"]
    # resume a T=2 checkpoint with T=1, and a T=1 checkpoint with T=2
    r21 = _run(tmp_path, model_path, "r21", 4, 2)
    _interrupt(r21)
    _run(tmp_path, model_path, "r21", 6, 1, run_dir=r21)
    r12 = _run(tmp_path, model_path, "r12", 4, 1)
    _interrupt(r12)
    _run(tmp_path, model_path, "r12", 6, 2, run_dir=r12)
    for run in (r21, r12):
        assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
        assert run_json(run)["resumes"] == 1
        _assert_close(_final(one), _final(run), f"{run.name} (resumed at another learner_ranks)")


# ---------------------------------------------------------------------------------------
# learner ranks >= 1 start from an empty (meta-device) model and receive rank 0's weights
def _meta_rank_main(rank: int, world: int, init_file: str, model_path: str, precision: str, out: str) -> None:
    import torch.distributed as dist

    from components.models import empty_causal_lm, load_causal_lm, load_tokenizer
    from components.precision import heads_are_tied
    from components.registry import load_builtin_components
    from components.trainer.learner import Learner, plan_step

    torch.set_num_threads(1)
    load_builtin_components()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        tok = load_tokenizer(model_path)
        cfg = config(model_path, "grpo", "token_mean", "batch", precision=precision)
        if rank == 0:
            model = load_causal_lm(model_path)
            with torch.no_grad():  # weights no checkpoint file holds, so rank 1 can only have them from rank 0
                for p in model.parameters():
                    p.add_(0.125)
            started_empty = False
        else:
            model = empty_causal_lm(model_path)
            started_empty = all(t.is_meta for t in [*model.parameters(), *model.buffers()])
        sent = []  # bytes of every tensor broadcast while the Learner starts (rank 0 sends)
        broadcast = dist.broadcast

        def counting_broadcast(tensor, *args, **kwargs):
            sent.append(tensor.numel() * tensor.element_size())
            return broadcast(tensor, *args, **kwargs)

        dist.broadcast = counting_broadcast
        try:
            learner = Learner(model, cfg, tok.pad_token_id, torch.device("cpu"))
        finally:
            dist.broadcast = broadcast
        local = {name: p.to_local().detach().clone() for name, p in learner.model.named_parameters()}
        full = {name: p.full_tensor().detach().clone() for name, p in learner.model.named_parameters()}
        buffers = {name: b.detach().clone() for name, b in learner.model.named_buffers()}
        rollouts = make_rollouts(tok)
        plan = plan_step(rollouts, [True] * len(rollouts), cfg, tok.pad_token_id, world)
        learner.accumulate(plan.shards[rank])
        grads = {name: p.grad.full_tensor().detach().clone() for name, p in learner.model.named_parameters()}
        with open(f"{out}.{rank}", "wb") as f:
            pickle.dump(dict(started_empty=started_empty, tied=heads_are_tied(learner.model), local=local, full=full, buffers=buffers,
                             grads=grads, grad_norm=learner.grad_norm(), sent_bytes=sum(sent)), f)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tied_model_path(tmp_path_factory):
    from components.models import build_tiny_policy

    path = tmp_path_factory.mktemp("tied_model") / "tiny_policy"
    build_tiny_policy(path, hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=128, seed=0,
                      tie_word_embeddings=True)
    return str(path)


@pytest.mark.parametrize("precision, tied", [("fp32", False), ("fp32", True), ("bf16_fp32_head", True)])
def test_rank_one_starts_empty_and_receives_rank_zeros_weights_and_buffers(tmp_path, model_path, tied_model_path,
                                                                           precision, tied):
    """Rank 1 builds the model on the meta device (no weights read, none in memory); after the
    Learner shards it, its shards, its non-persistent buffers (rotary inv_freq) and the gradient
    of a step are rank 0's, and the gathered weights are rank 0's model (shifted by 0.125, so
    they cannot come from the checkpoint). With tied embeddings the head stays tied under fp32
    and is untied on both ranks under bf16_fp32_head."""
    import torch.multiprocessing as mp

    from components.models import load_causal_lm
    from components.precision import heads_are_tied, untie_lm_head

    model_path = tied_model_path if tied else model_path
    out = tmp_path / "meta"
    mp.start_processes(_meta_rank_main, args=(2, str(tmp_path / "init"), model_path, precision, str(out)),
                       nprocs=2, start_method="spawn")
    r0 = pickle.loads(Path(f"{out}.0").read_bytes())
    r1 = pickle.loads(Path(f"{out}.1").read_bytes())
    assert r1["started_empty"] and not r0["started_empty"]

    reference = load_causal_lm(model_path)
    assert heads_are_tied(reference) == tied
    if precision == "bf16_fp32_head":
        assert untie_lm_head(reference)
    assert r1["tied"] == r0["tied"] == (tied and precision == "fp32")
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.125)
    want = dict(reference.named_parameters())
    assert set(r1["full"]) == set(want)
    for name, w in want.items():
        for r in (r0, r1):
            assert torch.equal(r["full"][name], w), name
        # each rank holds its own dim-0 chunk: together they are the tensor
        n0 = r0["local"][name].shape[0]
        assert torch.equal(torch.cat([r0["local"][name], r1["local"][name]])[: w.shape[0]], w), name
        assert n0 >= r1["local"][name].shape[0]
    ref_buffers = dict(reference.named_buffers())
    assert set(r1["buffers"]) == set(ref_buffers) and any("inv_freq" in n for n in ref_buffers)
    for name, b in ref_buffers.items():
        assert torch.equal(r1["buffers"][name], b) and torch.equal(r0["buffers"][name], b), name
    # every weight crosses once, in fp32 (a tied head is not sent again), and every buffer once
    unique = {id(p): p for p in want.values()}.values()
    assert r0["sent_bytes"] == r1["sent_bytes"] == sum(4 * p.numel() for p in unique) + sum(
        b.numel() * b.element_size() for b in ref_buffers.values())
    for name in want:
        assert torch.equal(r0["grads"][name], r1["grads"][name]), name
        assert torch.isfinite(r1["grads"][name]).all() and r1["grads"][name].abs().sum() > 0, name
    assert r0["grad_norm"] == r1["grad_norm"]


def test_a_model_without_weights_is_refused_on_rank_zero_and_without_ranks(model_path):
    from components.models import empty_causal_lm, load_tokenizer
    from components.trainer.learner import Learner

    tok = load_tokenizer(model_path)
    with pytest.raises(ValueError, match=r"learner rank 0 of 1 got a model on the meta device"):
        Learner(empty_causal_lm(model_path), config(model_path, "grpo", "token_mean", "batch"),
                tok.pad_token_id, torch.device("cpu"))


def test_a_cpu_learner_shards_on_a_cpu_mesh_on_a_machine_with_gpus(tmp_path, model_path, monkeypatch):
    """FSDP2's default mesh takes the machine's accelerator: on a machine with GPUs a gloo (CPU) learner
    would get a CUDA mesh and its shards moved to the GPUs. `shard_model` names the learner's device.
    The machine's accelerator is faked as CUDA here; a one-rank gloo group stands in for the learners."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from components.models import load_causal_lm
    from components.trainer.learner import shard_model

    monkeypatch.setattr(torch._C, "_get_accelerator", lambda: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        model = shard_model(load_causal_lm(model_path).float(), "bf16", torch.device("cpu"))
        params = dict(model.named_parameters())
        assert params and all(isinstance(p, DTensor) for p in params.values())
        assert {p.device_mesh.device_type for p in params.values()} == {"cpu"}
        assert {p.device.type for p in params.values()} == {"cpu"}
        assert all(p.device_mesh.get_group() is dist.group.WORLD for p in params.values())  # no second group
    finally:
        dist.destroy_process_group()
