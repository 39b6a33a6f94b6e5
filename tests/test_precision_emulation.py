"""Emulated bf16 (components/precision.py, issue 12 item 4): rounding where real bf16 rounds, on the
generator (torch engine) and on the trainer's compute path, at fp32 storage.

References are independent: bf16 rounding is re-derived from the float32 bit pattern (round to
nearest even on the upper 16 bits) in numpy, and the emulated linear is recomputed in float64.
No timing is asserted: "fp32 speed" is checked as "every matmul runs on float32 tensors".
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from components.engines import GenerationRequest, SamplingParams, make_engine
from components.models import build_tiny_policy, load_causal_lm, load_tokenizer
from components.precision import (
    BF16Emulation,
    emulation_override,
    get_precision,
    is_bf16_valued,
    marking_autocast,
    precision_options,
    round_to_bf16,
)

torch.set_num_threads(1)


def bf16_reference(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest bf16 value (ties to even), from the bit pattern; float64 out."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    lsb = (bits >> 16) & 1
    rounded = ((bits + 0x7FFF + lsb) & 0xFFFF0000).astype(np.uint32)
    return rounded.view(np.float32).astype(np.float64)


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    """A tiny policy whose head is scaled x20: peaked distributions (logits of several units), like a trained model's."""
    path = build_tiny_policy(tmp_path_factory.mktemp("emul"), seed=3)
    model = load_causal_lm(path)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(path)
    return str(path)


def test_round_to_bf16_matches_the_bit_level_reference_and_passes_a_rounded_gradient():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * torch.logspace(-6, 6, 4096)  # every magnitude
    x[:4] = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 0.0])  # exact ties go to even
    got = round_to_bf16(x)
    assert got.dtype == torch.float32
    assert np.array_equal(got.double().numpy(), bf16_reference(x.numpy()))
    assert got[:3].tolist() == [1.0, 1.0 + 2**-6, -1.0]
    assert is_bf16_valued(got) and not is_bf16_valued(x)
    assert round_to_bf16(got) is got  # a rounded tensor is not copied again
    # straight-through gradient, itself rounded to bf16
    leaf = x.clone().requires_grad_(True)
    upstream = torch.randn(4096, generator=g)
    (round_to_bf16(leaf) * upstream).sum().backward()
    assert np.array_equal(leaf.grad.double().numpy(), bf16_reference(upstream.numpy()))


def test_emulated_linear_matches_float64_reference_with_gradients():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 32, generator=g, requires_grad=True)
    w = torch.randn(16, 32, generator=g, requires_grad=True)
    b = torch.randn(16, generator=g, requires_grad=True)
    upstream = torch.randn(6, 16, generator=g)
    with marking_autocast("cpu"), BF16Emulation(None, fp32_head=False):
        y = F.linear(x, w, b)
    assert y.dtype == torch.float32
    xr, wr, br = (bf16_reference(t.detach().numpy()) for t in (x, w, b))
    ref = bf16_reference((xr @ wr.T + br).astype(np.float32))
    got = y.detach().double().numpy()
    ulp = np.abs(ref) * 2.0**-7
    assert np.all(np.abs(got - ref) <= ulp + 1e-30) and np.mean(got == ref) > 0.97  # fp32 vs f64 accumulation
    (y * upstream).sum().backward()
    gr = bf16_reference(upstream.numpy())  # the output's gradient is a bf16 value
    ref_gx = bf16_reference((gr @ wr).astype(np.float32))
    ref_gw = bf16_reference((gr.T @ xr).astype(np.float32))
    assert np.allclose(x.grad.double().numpy(), ref_gx, rtol=2**-7, atol=1e-6)
    assert np.allclose(w.grad.double().numpy(), ref_gw, rtol=2**-7, atol=1e-6)
    assert np.allclose(b.grad.double().numpy(), bf16_reference(gr.sum(0).astype(np.float32)), rtol=2**-7, atol=1e-6)
    assert is_bf16_valued(x.grad) and is_bf16_valued(w.grad)
    # outside the marking autocast (the model's own fp32 regions) the linear is exact fp32
    with BF16Emulation(None, fp32_head=False):
        plain = F.linear(x, w, b)
    assert torch.equal(plain, F.linear(x, w, b))


def test_emulate_switch_and_resolution():
    assert precision_options()["emulate"] == "auto"
    assert get_precision("bf16", device="cpu").emulated
    assert not get_precision("bf16", device="cuda").emulated  # real bf16 on GPU
    assert not get_precision("fp32", device="cpu").emulated
    with emulation_override("off"):
        assert not get_precision("bf16_fp32_head", device="cpu").emulated
    with emulation_override("on"):
        assert get_precision("bf16", device="cuda").emulated
    with pytest.raises(ValueError, match=r"'auto', 'on', 'off'"):
        with emulation_override("sometimes"):
            pass
    import gin

    with gin.unlock_config():
        gin.bind_parameter("precision.emulate", "off")
    try:
        assert not get_precision("bf16", device="cpu").emulated
        with gin.unlock_config():
            gin.bind_parameter("precision.emulate", "bogus")
        with pytest.raises(ValueError, match="precision.emulate = 'bogus'"):
            get_precision("bf16", device="cpu")
    finally:
        with gin.unlock_config():
            gin.bind_parameter("precision.emulate", "auto")


@pytest.mark.parametrize("name", ["bf16", "bf16_fp32_head"])
def test_generator_model_holds_bf16_values_and_rounds_where_bf16_rounds(peaked, name):
    pol = get_precision(name, device="cpu")
    model = pol.prepare_model(load_causal_lm(peaked)).eval()
    pol.check_model(model)
    head = model.get_output_embeddings().weight
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(is_bf16_valued(p) for n, p in model.named_parameters() if p is not head)
    assert is_bf16_valued(head) == (name == "bf16")  # the fp32 head keeps its fp32 values
    seen = []

    class Spy(TorchFunctionMode):  # every linear runs on float32 tensors (fp32 kernels, fp32 speed)
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is F.linear:
                seen.append((args[0].dtype, args[1].dtype, is_bf16_valued(args[0])))
            return func(*args, **(kwargs or {}))

    ids = torch.randint(10, 60, (3, 9))
    with torch.no_grad(), Spy():
        logits = model(input_ids=ids).logits
    assert len(seen) == 15 and all(d == (torch.float32, torch.float32, True) for d in seen)  # rounded inputs
    assert logits.dtype == torch.float32
    assert is_bf16_valued(logits) == (name == "bf16")  # bf16 logits unless the head is fp32
    # a weight update with fp32 values is rounded again
    eng = make_engine("torch", peaked, precision=name)
    eng.update_weights(load_causal_lm(peaked).state_dict(), 1)
    eng.policy.check_model(eng.model)


def _gap(path, name, emulate, n_prompts=12, G=4, max_tokens=12):
    """mean |trainer logp - generator logp| of one sampled batch: torch engine vs a one-rank Learner."""
    from components.trainer.config import TrainConfig
    from components.trainer.learner import Learner
    from components.trainer.rollout import Rollout

    tok = load_tokenizer(path)
    rng = random.Random(0)
    prompts = [[rng.randrange(8, 90) for _ in range(rng.randint(3, 10))] for _ in range(n_prompts)]
    with emulation_override(emulate):
        eng = make_engine("torch", path, precision=name, seed=0)
        cfg = TrainConfig(model_path=path, precision=name, lr=0.0, warmup_steps=0, micro_batch_size=64)
        learner = Learner(load_causal_lm(path), cfg, tok.pad_token_id, torch.device("cpu"))
    reqs = [GenerationRequest(group_id=i, prompt_ids=p, n=G) for i, p in enumerate(prompts)]
    groups = sorted(eng.generate(reqs, SamplingParams(max_tokens=max_tokens, seed=0)), key=lambda g: g.request.group_id)
    rollouts = [Rollout(order_id=i, problem_id=str(i), completions=list(g.completions),
                        rewards=[float(s % 2) * 2 - 1 for s in range(G)], passed=[s % 2 == 1 for s in range(G)])
                for i, g in enumerate(groups)]
    stats = learner.step(rollouts, [True] * len(rollouts))
    assert stats["trained_tokens"] > 100
    return stats["logprob_gap_mean"]


def test_trainer_generator_gap_appears_with_emulated_bf16(peaked):
    """Fails if emulation is removed: fp32-valued computation on both sides gives a gap of ~1e-7."""
    fp32 = _gap(peaked, "fp32", "auto")
    bf16 = _gap(peaked, "bf16", "auto")
    head = _gap(peaked, "bf16_fp32_head", "auto")
    assert fp32 < 1e-5, fp32
    assert bf16 > 100 * fp32 and bf16 > 2e-4, (bf16, fp32)  # measured: 6.4e-4 vs 9.8e-7
    assert head > 100 * fp32, (head, fp32)  # the body's rounding remains with the fp32 head
    assert head < 0.8 * bf16, (head, bf16)  # the FP32-head fix shrinks it (measured: 2.5e-4; seeded, 1 thread)


def _micro_batch(path):
    """One padded micro-batch of 3 groups x 2 completions (unequal lengths) for a one-rank learner."""
    from components.engines.base import Completion
    from components.trainer.config import TrainConfig
    from components.trainer.learner import plan_step
    from components.trainer.rollout import Rollout

    tok = load_tokenizer(path)
    rollouts = []
    for gi in range(3):
        comps = [Completion(gi, s, [9 + gi, 20, 31], [40 + s + gi] * (2 + s + gi), [-1.0] * (2 + s + gi),
                            [0] * (2 + s + gi), [False] * (2 + s + gi), "stop") for s in range(2)]
        rollouts.append(Rollout(order_id=gi, problem_id=str(gi), completions=comps, rewards=[1.0, -1.0], passed=[True, False]))
    cfg = TrainConfig(model_path=path, micro_batch_size=64)
    return plan_step(rollouts, [True] * 3, cfg, tok.pad_token_id, 1).shards[0][0]


@pytest.mark.parametrize("name,emulate", [("bf16", "auto"), ("bf16_fp32_head", "auto"), ("bf16", "off")])
def test_trainer_compute_path_rounds_where_bf16_rounds(peaked, name, emulate):
    """Learner.logprobs (the learner's one forward, chunked head included) under the policy's compute context."""
    from components.trainer.config import TrainConfig
    from components.trainer.learner import Learner

    tok = load_tokenizer(peaked)
    with emulation_override(emulate):
        learner = Learner(load_causal_lm(peaked), TrainConfig(model_path=peaked, precision=name), tok.pad_token_id,
                          torch.device("cpu"))
    assert learner.policy.emulated == (emulate == "auto")
    assert all(p.dtype == torch.float32 for p in learner.model.parameters())  # fp32 master weights
    head_w = learner.model.get_output_embeddings().weight
    calls = []

    class Spy(TorchFunctionMode):  # sits below the learner's mode: sees what the linears really compute on
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is F.linear:
                x, w = args[0], args[1]
                is_head = w.shape == head_w.shape and (w is head_w or torch.equal(w.float(), head_w.detach().float())
                                                        or torch.equal(w.float(), round_to_bf16(head_w.detach())))
                calls.append((is_head, x.dtype, is_bf16_valued(x.float()), is_bf16_valued(w.float()),
                              out.dtype, is_bf16_valued(out.float())))
            return out

    mb = _micro_batch(peaked)
    with Spy():
        logp, _ = learner.logprobs(mb)
    logp.sum().backward()  # gradients reach the fp32 master weights through the rounding
    assert head_w.grad is not None and head_w.grad.abs().sum() > 0
    heads = [c for c in calls if c[0]]
    body = [c for c in calls if not c[0]]
    assert heads and len(body) == 14
    if emulate == "auto":
        assert all(c[1] == torch.float32 and c[2] and c[3] for c in body)  # rounded inputs, fp32 kernels
        assert all(c[1] == torch.float32 and c[2] and c[3] == (name == "bf16") for c in heads)
        # the head's output: bf16 logits, or fp32 logits with the fp32 head (also where autocast is off)
        h = torch.randn(5, head_w.shape[1])
        with learner.compute_context(), torch.autocast("cpu", enabled=False):
            logits = F.linear(h, head_w)
        assert logits.dtype == torch.float32 and is_bf16_valued(logits) == (name == "bf16")
    else:  # real bf16, one rank: autocast body, and the chunked head computed in bf16
        assert all(c[4] == torch.bfloat16 for c in body)  # autocast casts below the torch-function level
        assert all(c[1] == torch.bfloat16 and c[4] == torch.bfloat16 for c in heads)
