"""LoRA + the reference-KL penalty (`train.lora_rank` > 0, `train.kl_coef` > 0): the reference is the
policy's own frozen base with its adapters off (`lora.adapters_off`), not a frozen copy of the model.

What is checked, against references written here: the learner holds no second copy of the weights;
`reference_logprobs` is the base model's log-probs (a plain float64 model loaded from model.path)
and differs from the policy's once the adapters have moved; the adapters are back on afterwards
(the policy's log-probs bit for bit unchanged, the adapters trainable, every module's train/eval
mode restored, also after an exception); the KL gradient of the adapters equals a float64
computation and, bit for bit, the gradient (and the steps) of a learner given an explicit frozen copy
of the base (the path full fine-tuning takes); `train.compile` gives the eager gradient; 2 FSDP2
gloo ranks give the one-process gradient; `scalerl plan` counts no reference bytes for LoRA + KL.
"""

from __future__ import annotations

import copy
import math
import pickle
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _helpers_trainer import tiny_model, write_gin  # noqa: E402
from test_kl_schedules import _float64_head, _ref_kl  # noqa: E402
from test_learner_ranks import config, make_rollouts  # noqa: E402

peft = pytest.importorskip("peft")

RANK, ALPHA, COEF, TEMPERATURE = 4, 8.0, 0.3, 0.7


def kl_cfg(model_path: str, **kw):
    settings = dict(lora_rank=RANK, lora_alpha=ALPHA, kl_coef=COEF, kl_estimator="k3", temperature=TEMPERATURE)
    settings.update(kw)
    return config(model_path, "cispo", "prompt_mean", "batch", **settings)


def make_learner(model_path: str, cfg, seed: int = 0):
    from components.models import load_causal_lm, load_tokenizer
    from components.trainer.learner import Learner

    torch.manual_seed(seed)  # the lora_A draw
    tok = load_tokenizer(model_path)
    return Learner(load_causal_lm(model_path), cfg, tok.pad_token_id, torch.device("cpu")), tok


def move_adapters(model: torch.nn.Module, seed: int = 1, scale: float = 0.05) -> None:
    """lora_A and lora_B away from their start (lora_B != 0: the policy is no longer the base)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.add_(scale * torch.randn(p.shape, generator=g))


def base_float64(model_path: str) -> torch.nn.Module:
    """The base model, independently: a plain transformers model read from model.path, in float64."""
    from components.models import load_causal_lm

    return load_causal_lm(model_path).double().eval()


def with_copy_reference(learner, model_path: str):
    """`learner` switched to the copy path full fine-tuning takes: `reference` = a frozen copy of the base."""
    from components.models import load_causal_lm
    from components.trainer.learner import frozen_copy

    learner.reference = learner._place(frozen_copy(load_causal_lm(model_path).to(torch.float32)), False)
    return learner


def all_zero_rewards(rollouts):
    """Every reward equal: zero advantages, so only the KL term has a gradient."""
    for r in rollouts:
        r.rewards = [1.0] * len(r.rewards)
        r.passed = [True] * len(r.rewards)
    return rollouts


def adapter_grads(learner) -> dict:
    out = {}
    for name, p in learner.model.named_parameters():
        if p.requires_grad:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            out[name] = g.detach().clone()
        else:
            assert p.grad is None, f"frozen {name} got a gradient"
    return out


def held_parameters(learner) -> int:
    """Elements of every parameter the learner holds in its module attributes (each tensor once)."""
    seen = {}
    for value in vars(learner).values():
        if isinstance(value, torch.nn.Module):
            for p in value.parameters():
                seen[id(p)] = p.numel()
    return sum(seen.values())


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from components.registry import load_builtin_components

    load_builtin_components()
    return tiny_model(tmp_path_factory.mktemp("lora_kl_model"))


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------
def test_lora_with_kl_holds_no_copy_of_the_model(model_path):
    lora_kl, _ = make_learner(model_path, kl_cfg(model_path))
    lora, _ = make_learner(model_path, kl_cfg(model_path, kl_coef=0.0))
    full_kl, _ = make_learner(model_path, kl_cfg(model_path, lora_rank=0))
    assert lora_kl.reference is None and lora_kl.has_reference and lora_kl.kl_fn is not None
    assert not lora.has_reference and lora.reference is None
    assert full_kl.has_reference and full_kl.reference is not None  # full fine-tuning keeps its copy
    assert held_parameters(lora_kl) == held_parameters(lora) == lora_kl.num_parameters
    assert held_parameters(full_kl) == 2 * full_kl.num_parameters


def test_the_reference_is_the_base_and_the_adapters_come_back_on(model_path):
    from components.trainer.lora import adapters_off, lora_layers

    learner, tok = make_learner(model_path, kl_cfg(model_path))
    move_adapters(learner.model)
    plan = learner.plan(make_rollouts(tok), [True] * 4)
    mb = plan.shards[0][0]
    mask = mb.batch.mask
    learner.model.train()
    modes = {name: m.training for name, m in learner.model.named_modules()}
    trainable = {name: p.requires_grad for name, p in learner.model.named_parameters()}
    before, _ = learner.logprobs(mb)

    ref = learner.reference_logprobs(mb)  # [b, T]
    assert not ref.requires_grad
    with torch.no_grad():
        want, _ = _float64_head(base_float64(model_path), mb, TEMPERATURE)
        policy64, _ = _float64_head(copy.deepcopy(learner.model).double(), mb, TEMPERATURE)
    torch.testing.assert_close(ref.double()[mask], want[mask], rtol=1e-5, atol=1e-6)
    assert float((policy64 - want)[mask].abs().max()) > 1e-3, "the moved adapters should change the policy"
    assert float((ref.double() - policy64)[mask].abs().max()) > 1e-3

    # everything as it was: adapters on, trainable, modes, the policy's log-probs bit for bit
    assert all(not layer.disable_adapters for layer in lora_layers(learner.model).values())
    assert {name: p.requires_grad for name, p in learner.model.named_parameters()} == trainable
    assert {name: m.training for name, m in learner.model.named_modules()} == modes
    after, _ = learner.logprobs(mb)
    assert torch.equal(after, before)
    torch.testing.assert_close(after.detach().double()[mask], policy64[mask], rtol=1e-5, atol=1e-6)

    # an exception inside the context restores the adapters too; a plain model has no base to switch to
    with pytest.raises(RuntimeError, match="inside"):
        with adapters_off(learner.model):
            assert all(layer.disable_adapters for layer in lora_layers(learner.model).values())
            assert {name: p.requires_grad for name, p in learner.model.named_parameters()} == trainable
            raise RuntimeError("inside")
    assert all(not layer.disable_adapters for layer in lora_layers(learner.model).values())
    assert {name: p.requires_grad for name, p in learner.model.named_parameters()} == trainable
    with pytest.raises(ValueError, match="no LoRA adapters"):
        with adapters_off(base_float64(model_path)):
            pass


def test_kl_gradient_against_float64_and_the_frozen_copy_path(model_path):
    """Zero advantages: the adapters' gradient is kl_coef * sum_bt w_bt * dk3/dlogp_bt * dlogp_bt/dA,B,
    in float64 with the base as reference; bit for bit the gradient of a learner whose reference is
    an explicit frozen copy of the base. Then both take the same steps."""
    learner, tok = make_learner(model_path, kl_cfg(model_path))
    copied = with_copy_reference(make_learner(model_path, kl_cfg(model_path))[0], model_path)
    assert copied.reference is not None and learner.reference is None
    for m in (learner, copied):
        move_adapters(m.model)
    start = {name: p.detach().clone() for name, p in learner.model.named_parameters()}
    rollouts = all_zero_rewards(make_rollouts(tok))
    plan = learner.plan(rollouts, [True] * len(rollouts))
    shard = plan.shards[0]
    assert len(shard) > 1 and all(bool((mb.advantages == 0).all()) for mb in shard)

    policy64, base64 = copy.deepcopy(learner.model).double(), base_float64(model_path)
    learner.accumulate(shard)
    got = adapter_grads(learner)
    copied.accumulate(shard)
    for name, g in adapter_grads(copied).items():
        assert torch.equal(got[name], g), f"{name}: adapters-off reference differs from the frozen copy's"

    kl64 = []
    for mb in shard:
        logp64, _ = _float64_head(policy64, mb, TEMPERATURE)
        with torch.no_grad():
            ref64, _ = _float64_head(base64, mb, TEMPERATURE)
        coeff = torch.zeros_like(logp64)
        for b, t in mb.batch.mask.nonzero().tolist():
            value, d = _ref_kl("k3", logp64[b, t].item(), ref64[b, t].item())
            coeff[b, t] = COEF * float(mb.weights[b, t]) * d
            kl64.append(value)
        (coeff * logp64).sum().backward()
    want = {name: p.grad for name, p in policy64.named_parameters() if p.requires_grad}
    assert sorted(want) == sorted(got) and all(".lora_" in n for n in got)
    num = sum(float((got[n].double() - want[n]).square().sum()) for n in want)
    den = sum(float(want[n].square().sum()) for n in want)
    assert den > 0 and math.sqrt(num / den) < 1e-5

    # steps: the same numbers as the copy path, the adapters move, the base does not
    for rollouts in (all_zero_rewards(make_rollouts(tok)), make_rollouts(tok, seed=1)):
        a = learner.step(rollouts, [True] * len(rollouts))
        b = copied.step(rollouts, [True] * len(rollouts))
        assert a["loss"] == b["loss"] and a["kl"] == b["kl"] and a["grad_norm"] == b["grad_norm"] > 0
    assert a["kl"] > 0 and math.isfinite(a["kl"])
    for (name, p), (_, q) in zip(learner.model.named_parameters(), copied.model.named_parameters()):
        assert torch.equal(p, q), name
        assert torch.equal(p, start[name]) != (".lora_" in name), f"{name}: adapters must move, the base must not"


def test_compiled_lora_kl_gives_the_eager_gradient(model_path):
    """train.compile (aot_eager: the graphs dynamo and AOT autograd make, eager kernels) with activation
    checkpointing: the adapters-off reference forward and the policy's agree with eager, two steps."""
    kw = dict(max_tokens_per_micro_batch=24, activation_checkpointing=True)
    results = {}
    for compiled in (False, True):
        learner, tok = make_learner(model_path, kl_cfg(model_path, compile=compiled, compile_backend="aot_eager", **kw))
        move_adapters(learner.model)
        rollouts = make_rollouts(tok)
        stats = learner.step(rollouts, [True] * len(rollouts))
        learner.accumulate(learner.plan(rollouts, [True] * len(rollouts)).shards[0])
        results[compiled] = stats, adapter_grads(learner)
    (s0, g0), (s1, g1) = results[False], results[True]
    assert s1["kl"] == pytest.approx(s0["kl"], rel=1e-5) and s0["kl"] > 0
    assert s1["loss"] == pytest.approx(s0["loss"], rel=1e-5)
    for name, g in g0.items():
        err = float((g1[name] - g).abs().max() / g.abs().max().clamp_min(1e-12))
        assert err < 1e-5, f"{name}: compiled gradient off by {err:.2e}"


# ---------------------------------------------------------------------------------------------
# 2 FSDP2 learner ranks (gloo) = 1 process
def _two_steps(learner, rollouts, ranks: int, rank: int) -> dict:
    """Step 1 (adapters moved: KL > 0), then step 2's adapter gradients, KL values and grad norm."""
    plan = learner.plan(rollouts, [True] * len(rollouts))
    if ranks > 1:
        learner.train_shard(plan.shards[rank])
    else:
        learner.train(plan)
    plan = learner.plan(rollouts, [True] * len(rollouts))
    part = learner.accumulate(plan.shards[rank])
    # FSDP2 fixes each block's trainable parameters and their dtypes at its lazy init, which is the first
    # (adapters-off) forward: the adapters must be trainable then, else the block's group has no
    # trainable parameter and its gradient dtypes are None (bf16 gradients then not reduced in fp32)
    orig_dtypes = [group._orig_dtype for layer in (learner.model.model.layers if ranks > 1 else [])
                     for group in layer._get_fsdp_state()._fsdp_param_groups]
    return {"grads": adapter_grads(learner), "kl": [k.clone() for k in part.get("kl", [])], "norm": learner.grad_norm(),
            "sharded": all(hasattr(p, "full_tensor") for p in learner.model.parameters()), "orig_dtypes": orig_dtypes}


def _move_adapters_sharded(model, seed: int = 1, scale: float = 0.05) -> None:
    """`move_adapters`' noise on the full tensors, applied to this rank's shards."""
    from torch.distributed.tensor import distribute_tensor

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.add_(distribute_tensor(scale * torch.randn(p.shape, generator=g), p.device_mesh, p.placements))


def _rank_main(rank: int, world: int, init_file: str, model_path: str, out: str) -> None:
    import torch.distributed as dist

    from components.models import empty_causal_lm, load_causal_lm, load_tokenizer
    from components.registry import load_builtin_components
    from components.trainer.learner import Learner

    torch.set_num_threads(1)
    load_builtin_components()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        tok = load_tokenizer(model_path)
        model = load_causal_lm(model_path) if rank == 0 else empty_causal_lm(model_path)
        learner = Learner(model, kl_cfg(model_path), tok.pad_token_id, torch.device("cpu"))
        assert learner.reference is None
        _move_adapters_sharded(learner.model)
        result = _two_steps(learner, make_rollouts(tok), world, rank)
        with open(f"{out}.{rank}", "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def test_two_learner_ranks_give_the_one_process_kl_step(tmp_path, model_path):
    import importlib

    import torch.multiprocessing as mp

    importlib.import_module("components.trainer.learner")  # imported before spawning: faster children
    out = tmp_path / "two"
    mp.start_processes(_rank_main, args=(2, str(tmp_path / "init"), model_path, str(out)), nprocs=2, start_method="spawn")
    r0, r1 = (pickle.loads(Path(f"{out}.{r}").read_bytes()) for r in (0, 1))
    assert r0["sharded"] and r1["sharded"]
    assert r0["orig_dtypes"] and all(d == torch.float32 for d in r0["orig_dtypes"] + r1["orig_dtypes"])
    assert r0["kl"] and r1["kl"] and all(float(k.abs().sum()) > 0 for k in r0["kl"] + r1["kl"])

    learner, tok = make_learner(model_path, kl_cfg(model_path))
    move_adapters(learner.model)
    one = _two_steps(learner, make_rollouts(tok), 1, 0)
    assert set(r0["grads"]) == set(one["grads"]) and all(".lora_" in n for n in one["grads"])
    assert r0["norm"] == pytest.approx(one["norm"], rel=1e-6) and one["norm"] > 0
    for name, g in one["grads"].items():
        err = float((r0["grads"][name] - g).abs().max() / g.abs().max().clamp_min(1e-12))
        assert err < 1e-6, f"{name}: 2-rank gradient off by {err:.2e}"
        assert torch.equal(r0["grads"][name], r1["grads"][name])


# ---------------------------------------------------------------------------------------------
def test_plan_counts_no_reference_copy_under_lora(model_path, tmp_path):
    import json

    from experiments import memory_model as M
    from experiments import plan as P

    shape = M.ModelShape.from_config(json.loads((Path(model_path) / "config.json").read_text()))
    P_total = M.parameter_counts(shape)["total"]
    base = dict(ranks=2, device="cpu", precision="fp32")
    full = M.learner_memory(shape, M.LearnerLayout(**base))
    full_kl = M.learner_memory(shape, M.LearnerLayout(kl_reference=True, **base))
    lora = M.learner_memory(shape, M.LearnerLayout(lora_rank=RANK, **base))
    lora_kl = M.learner_memory(shape, M.LearnerLayout(lora_rank=RANK, kl_reference=True, **base))
    assert full["reference"] == 0 and full_kl["reference"] == math.ceil(4 * P_total / 2)
    assert full_kl["total"] - full["total"] == full_kl["reference"]
    assert lora_kl["reference"] == 0 and lora_kl == lora

    # `scalerl plan` with the bindings
    common = dict(train__kl_coef="0.1", train__learner_ranks="1")
    with_lora = P.plan_config([write_gin(tmp_path / "lora.gin", model_path, train__lora_rank=str(RANK), **common)])
    without = P.plan_config([write_gin(tmp_path / "full.gin", model_path, **common)])
    assert with_lora.learner["reference"] == 0 and "KL reference policy" not in P.render(with_lora)
    assert without.learner["reference"] == 4 * P_total and "KL reference policy" in P.render(without)
