"""`train.compile`: torch.compile of the learner's decoder blocks and of its log-prob head's per-chunk math.

References are eager, or float64 and written here:
- the head: plain autograd through the float64 log-softmax of full [N, V] logits;
- a learner step: the same `Learner` without compile, one process (full gradients and the grad
  norm, before any optimizer step). Two compiled FSDP2 gloo ranks are checked against it in
  tests/test_learner_ranks.py, in the processes of its two-rank test.
Inductor (the default backend) generates and compiles C++ on CPU, ~10 s per new graph: the tests of
the numbers (the head, one learner rank) use it; the tests of the wiring (FSDP2's hooks, autocast,
graphs shared across blocks), which dynamo and AOT autograd decide whatever the backend, use
`train.compile_backend = "aot_eager"` (the same graphs, run by eager kernels).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _helpers_trainer import tiny_model  # noqa: E402

TEMPERATURE = 0.7  # the learner's (float) sampling temperature in these tests


def _rollouts(tokenizer, n_groups: int = 4, G: int = 4, seed: int = 0):
    """Groups of unequal completion lengths (1..9 tokens) with off-policy generator log-probs."""
    from components.engines.base import Completion
    from components.trainer.rollout import Rollout

    g = torch.Generator().manual_seed(seed)
    vocab = len(tokenizer)
    out = []
    for gi in range(n_groups):
        prompt = tokenizer.encode(f"{gi}+{gi * 3}=", add_special_tokens=False)[: 3 + gi]
        comps, rewards = [], []
        for s in range(G):
            n = int(torch.randint(1, 10, (1,), generator=g))
            toks = torch.randint(4, vocab, (n,), generator=g).tolist()
            gen_logp = (-2.0 - 3.0 * torch.rand(n, generator=g)).tolist()
            comps.append(Completion(gi, s, list(prompt), toks, gen_logp, [0] * n, [False] * n, "stop"))
            rewards.append(1.0 if (s + gi) % 3 == 0 else -1.0)
        out.append(Rollout(order_id=gi, problem_id=f"p{gi}", completions=comps, rewards=rewards,
                           passed=[r > 0 for r in rewards]))
    return out


def _config(model_path: str, **kw):
    from components.trainer.config import TrainConfig

    settings = dict(loss="cispo", aggregation="prompt_mean", advantage_norm="batch", lr=1e-3, warmup_steps=0,
                    weight_decay=0.0, prompts_per_step=4, generations_per_prompt=4, grad_clip=0.0, precision="fp32",
                    max_tokens_per_micro_batch=24, activation_checkpointing=True,
                    temperature=TEMPERATURE)
    settings.update(kw)
    return TrainConfig(model_path=model_path, **settings)


def _gradients(model_path: str, cfg, ranks: int = 1, rank: int = 0):
    """(full gradient by parameter name, grad norm) after this rank's forward + backward of one step."""
    from components.models import load_causal_lm, load_tokenizer
    from components.registry import load_builtin_components
    from components.trainer.learner import Learner, plan_step

    load_builtin_components()
    torch.manual_seed(0)
    tok = load_tokenizer(model_path)
    learner = Learner(load_causal_lm(model_path), cfg, tok.pad_token_id, torch.device("cpu"))
    rollouts = _rollouts(tok)
    plan = plan_step(rollouts, [True] * len(rollouts), cfg, tok.pad_token_id, ranks)
    assert len(plan.shards[rank]) >= 2  # micro-batches of different shapes: the dynamic recompile runs
    learner.accumulate(plan.shards[rank])
    grads = {}
    for name, p in learner.model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name] = g.detach().clone()
    return grads, learner.grad_norm()


def _assert_close(got: dict, want: dict, rel: float, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for name in want:
        err = float((got[name] - want[name]).abs().max() / want[name].abs().max().clamp_min(1e-12))
        assert err < rel, f"{what}: {name} differs by {err:.3g} of its largest entry (allowed {rel})"


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Every test on one thread: inductor's CPU code depends on the thread count (a change recompiles)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("compile_model"))


@pytest.fixture(scope="module")
def eager_fp32(model_path):
    return _gradients(model_path, _config(model_path))


# ------------------------------------------------------------------------------------------
def test_compiled_head_matches_a_float64_reference_in_values_and_gradients(model_path):
    """The head's compiled chunk math at the tiny model's vocabulary and the learner's temperature
    (so the learner test below finds these graphs in inductor's cache)."""
    from transformers import AutoConfig

    from components.trainer.forward import chunked_token_logprobs

    g = torch.Generator().manual_seed(0)
    N, H, V = 40, 16, AutoConfig.from_pretrained(model_path).vocab_size
    hidden = torch.randn(N, H, generator=g, requires_grad=True)
    weight = (torch.randn(V, H, generator=g) * 0.5).requires_grad_()
    bias = (torch.randn(V, generator=g) * 0.1).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    upstream = torch.randn(N, generator=g)
    h64, w64, b64 = (t.detach().double().requires_grad_() for t in (hidden, weight, bias))
    lp64 = torch.log_softmax(F.linear(h64, w64, b64) / TEMPERATURE, dim=-1)  # [N, V] float64
    ref = lp64.gather(-1, targets[:, None]).squeeze(-1)  # [N]
    ref_entropy = -(lp64.exp() * lp64).sum(-1).detach()  # [N]
    ref_grads = torch.autograd.grad((ref * upstream.double()).sum(), [h64, w64, b64])
    before = _graphs()
    logp, entropy = chunked_token_logprobs(hidden, weight, targets, temperature=TEMPERATURE, chunk_size=16, bias=bias,
                                           with_entropy=True, compile_backend="inductor")  # chunks of 16, 16, 8
    grads = torch.autograd.grad((logp * upstream).sum(), [hidden, weight, bias])
    assert _graphs() > before, "compile_backend = 'inductor' compiled nothing"
    assert logp.dtype == torch.float32 and not entropy.requires_grad
    torch.testing.assert_close(logp.double(), ref, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(entropy.double(), ref_entropy, atol=1e-5, rtol=2e-6)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-6)


def test_compiled_learner_gives_the_eager_gradient_and_its_blocks_share_graphs(tmp_path, model_path, eager_fp32):
    """One rank, fp32, packed micro-batches of different shapes, activation checkpointing on. Then a
    deeper model: its blocks must reuse those graphs, not compile one per block (a deep model would
    run out of dynamo's recompile limit, 8 per code object, and silently fall back to eager)."""
    from _helpers_trainer import TINY_BUILD

    from components.models import build_tiny_policy

    want, want_norm = eager_fp32
    before = _graphs()
    got, norm = _gradients(model_path, _config(model_path, compile=True))
    compiled = _graphs() - before
    assert compiled > 0, "train.compile = True compiled nothing"
    _assert_close(got, want, 1e-5, "compiled against eager")
    assert abs(norm - want_norm) <= 1e-5 * want_norm

    deeper = tmp_path / "deeper"
    build_tiny_policy(deeper, **{**TINY_BUILD, "num_layers": 3 * TINY_BUILD["num_layers"]})
    before = _graphs()
    _gradients(str(deeper), _config(str(deeper), compile=True))
    assert _graphs() == before, f"a model 3x as deep compiled {_graphs() - before} more graphs (the first: {compiled})"


def test_compiled_real_bf16_stays_bf16_and_close_to_eager_bf16(model_path, eager_fp32):
    """Real bf16 (not emulated; slow on a CPU without bf16 units, tiny here): autocast and the bf16
    LM head reach the compiled code. (With inductor, fused kernels round less often than eager
    ops: the two bf16 gradients then agree to bf16's precision, ~1e-2, not bit for bit.)"""
    from components.precision import emulation_override

    fp32, _ = eager_fp32
    with emulation_override("off"):
        eager, eager_norm = _gradients(model_path, _config(model_path, precision="bf16"))
        got, norm = _gradients(model_path, _config(model_path, precision="bf16", compile=True, compile_backend="aot_eager"))
    drift = max(float((got[n] - fp32[n]).abs().max() / fp32[n].abs().max()) for n in fp32)
    assert drift > 1e-3, f"the compiled bf16 gradient equals the fp32 one to {drift:.2g}: it did not compute in bf16"
    _assert_close(got, eager, 5e-2, "compiled bf16 against eager bf16")
    assert abs(norm - eager_norm) <= 1e-2 * eager_norm


def test_compile_refuses_emulated_bf16_a_non_bool_and_an_unknown_backend(model_path):
    import gin

    from components.models import load_causal_lm
    from components.precision import emulation_override
    from components.trainer.config import ConfigError, train_config, validate
    from components.trainer.learner import Learner

    with emulation_override("auto"), pytest.raises(ValueError, match=r"train.compile = True needs real arithmetic.*"
                                                   r"'bf16_fp32_head' is emulated on cpu"):
        Learner(load_causal_lm(model_path), _config(model_path, precision="bf16_fp32_head", compile=True), 0,
                torch.device("cpu"))
    # surely emulated (an explicit CPU device): refused by the config check, before anything runs
    with emulation_override("auto"), pytest.raises(ConfigError, match=r"train.compile = True needs real arithmetic, but "
                                                   r"train.precision = 'bf16' is emulated here"):
        validate(train_config(compile=True, precision="bf16", device="cpu", model_path=model_path))
    with emulation_override("on"), pytest.raises(ConfigError, match=r"precision.emulate = 'on'"):
        validate(train_config(compile=True, precision="bf16_fp32_head", device="auto", model_path=model_path))
    with emulation_override("auto"):
        validate(train_config(compile=True, precision="bf16", device="auto", model_path=model_path))  # decided on the device
        validate(train_config(compile=True, precision="fp32", device="cpu", model_path=model_path))
    with pytest.raises(ConfigError, match=r"train.compile must be True or False, got 'yes'"):
        train_config(compile="yes", model_path=model_path)
    with pytest.raises(ConfigError, match=r"train.compile_backend = 'inductr' is not a torch.compile backend; "
                                          r"valid: \[.*'aot_eager'.*'inductor'"):
        validate(train_config(compile=True, compile_backend="inductr", model_path=model_path))
    gin.clear_config()
    try:
        gin.parse_config("train.compile = True")
        assert train_config(model_path=model_path).compile is True
    finally:
        gin.clear_config()


