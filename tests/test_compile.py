"""`train.compile`: torch.compile of the learner's decoder blocks and of its log-prob head's per-chunk math.

References are eager, or float64 and written here:
- the head: plain autograd through the float64 log-softmax of full [N, V] logits;
- a learner step: the same `Learner` without compile, one process (full gradients and the grad
  norm, before any optimizer step). Two compiled FSDP2 gloo ranks are checked against it in
  tests/test_learner_ranks.py, in the processes of its two-rank test.
Inductor (the default backend) generates and compiles C++ on CPU, 2-7 s per new graph: the tests of
the numbers (the head, one learner rank) use it. The tests of the wiring (what is compiled, FSDP2's
hooks, autocast, checkpointing, graphs shared across blocks, torch_varlen), which dynamo and AOT
autograd decide whatever the backend, use tests/_helpers_compile's RECORDING backend: aot_eager
(the same graphs, run by eager kernels) keeping the ops of every graph, so they assert that a
block's attention and MLP were compiled, not merely that something was.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _helpers_compile import (  # noqa: E402
    GRAPHS,
    RECORDING,
    compiled_ops,
    has_op,
    register_recording_backend,
)
from _helpers_trainer import tiny_model  # noqa: E402
from test_learner_ranks import make_rollouts  # noqa: E402

TEMPERATURE = 0.7  # the learner's (float) sampling temperature in these tests


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
    rollouts = make_rollouts(tok)
    plan = plan_step(rollouts, [True] * len(rollouts), cfg, tok.pad_token_id, ranks)
    assert len(plan.shards[rank]) >= 2  # micro-batches of different shapes: the graphs' dynamic shapes are used
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
    """Every test on one thread: inductor's CPU code depends on the thread count (a change recompiles).
    Afterwards inductor's compile-worker processes are shut down, not left to the modules after this one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    from torch._inductor.async_compile import shutdown_compile_workers

    shutdown_compile_workers()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("compile_model"))


@pytest.fixture(scope="module")
def eager_fp32(model_path):
    return _gradients(model_path, _config(model_path))


# ------------------------------------------------------------------------------------------
def test_compiled_head_matches_a_float64_reference_in_values_and_gradients(model_path):
    """The head's compiled chunk math at the tiny model's vocabulary and the learner's temperature
    (so the learner test below reuses these graphs)."""
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


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def test_compiled_learner_gives_the_eager_gradient(model_path, eager_fp32):
    """Inductor, one rank, fp32, packed micro-batches of different shapes, activation checkpointing on."""
    want, want_norm = eager_fp32
    before, breaks = _graphs(), _graph_breaks()
    got, norm = _gradients(model_path, _config(model_path, compile=True))
    assert _graphs() > before, "train.compile = True compiled nothing"
    assert _graph_breaks() == breaks, "a graph break: a checkpointed block then runs eagerly as a whole"
    _assert_close(got, want, 1e-5, "compiled against eager")
    assert abs(norm - want_norm) <= 1e-5 * want_norm


def test_the_blocks_and_the_head_are_compiled_and_the_blocks_share_their_graphs(tmp_path, model_path):
    """What is compiled: the blocks' attention and MLP, the head's log-softmax. A deeper model reuses
    those graphs instead of compiling one per block (a deep model would run out of dynamo's
    recompile limit, 8 per code object, and silently fall back to eager)."""
    from _helpers_trainer import TINY_BUILD

    from components.models import build_tiny_policy

    register_recording_backend()
    torch._dynamo.reset()
    start, breaks = len(GRAPHS), _graph_breaks()
    _gradients(model_path, _config(model_path, compile=True, compile_backend=RECORDING))
    ops = compiled_ops(start)
    assert has_op(ops, "scaled_dot_product_attention") and has_op(ops, "silu"), f"no decoder block compiled: {sorted(ops)}"
    assert has_op(ops, "log_softmax"), f"the head's chunk math was not compiled: {sorted(ops)}"
    assert _graph_breaks() == breaks
    compiled = len(GRAPHS) - start

    deeper = tmp_path / "deeper"
    build_tiny_policy(deeper, **{**TINY_BUILD, "num_layers": 3 * TINY_BUILD["num_layers"]})
    before = len(GRAPHS)
    _gradients(str(deeper), _config(str(deeper), compile=True, compile_backend=RECORDING))
    assert len(GRAPHS) == before, f"a model 3x as deep compiled {len(GRAPHS) - before} more graphs (the first: {compiled})"


@pytest.mark.parametrize("precision", ["bf16", "bf16_fp32_head"])
def test_compiled_real_bf16_runs_the_blocks_in_bf16(model_path, eager_fp32, precision):
    """Real bf16 (not emulated; slow on a CPU without bf16 units, tiny here): autocast reaches the
    compiled blocks, and the bf16 LM head (or the fp32 one) the compiled head. aot_eager runs the
    eager kernels, so the compiled and the eager bf16 gradients agree far inside the distance of
    either to fp32. (With inductor, fused kernels round less often than eager ops: the two then
    agree only to bf16's precision, ~1e-2.)"""
    from components.precision import emulation_override

    register_recording_backend()
    fp32, _ = eager_fp32
    with emulation_override("off"):
        eager, eager_norm = _gradients(model_path, _config(model_path, precision=precision))
        start = len(GRAPHS)
        got, norm = _gradients(model_path, _config(model_path, precision=precision, compile=True, compile_backend=RECORDING))
    assert has_op(compiled_ops(start), "silu")
    to_fp32 = max(float((eager[n] - fp32[n]).abs().max() / fp32[n].abs().max()) for n in fp32)
    assert to_fp32 > 1e-3, f"eager {precision} equals fp32 to {to_fp32:.2g}"
    _assert_close(got, eager, to_fp32 / 10, f"compiled {precision} against eager {precision}")
    assert abs(norm - eager_norm) <= 1e-3 * eager_norm


# torch's varlen kernel (a custom op, so dynamo traces it) has no CPU version: a float64 reference
# stands in for it, as a custom op with an opaque backward, so that dynamo and AOT autograd treat it
# as they treat torch's.
@torch.library.custom_op("scalerl_test::varlen_ref", mutates_args=())
def _varlen_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int,
                scale: float) -> torch.Tensor:
    from test_forward import _reference_varlen

    return _reference_varlen(q, k, v, cu, cu, max_len, max_len, scale=scale, window_size=(-1, 0),
                             enable_gqa=q.shape[1] != k.shape[1])


@_varlen_ref.register_fake
def _(q, k, v, cu, max_len, scale):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2])


@torch.library.custom_op("scalerl_test::varlen_ref_backward", mutates_args=())
def _varlen_ref_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
                         max_len: int, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """d q, d k, d v of `_varlen_ref` in float64, written out (autograd is off inside a custom op):
    per sequence and head, S = q k^T scale (causal), P = softmax(S), O = P v; dV = P^T dO,
    dS = P (dO v^T - rowsum(dO v^T P)), dQ = dS k scale, dK = dS^T q scale; the query heads of a
    key head (GQA) add up."""
    Hq, Hkv = q.shape[1], k.shape[1]
    rep = Hq // Hkv
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v))
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs = q[a:b].double().transpose(0, 1)  # [Hq, l, D]
        ks = k[a:b].double().transpose(0, 1).repeat_interleave(rep, dim=0)  # [Hq, l, D]
        vs = v[a:b].double().transpose(0, 1).repeat_interleave(rep, dim=0)  # [Hq, l, D]
        go = grad[a:b].double().transpose(0, 1)  # [Hq, l, D]
        causal = torch.ones(b - a, b - a, dtype=torch.bool).tril()
        p = (qs @ ks.transpose(1, 2) * scale).masked_fill(~causal, float("-inf")).softmax(-1)  # [Hq, l, l]
        dp = go @ vs.transpose(1, 2)  # [Hq, l, l]
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))  # [Hq, l, l]
        dq[a:b] = (ds @ ks * scale).transpose(0, 1)
        dk[a:b] = (ds.transpose(1, 2) @ qs * scale).unflatten(0, (Hkv, rep)).sum(1).transpose(0, 1)
        dv[a:b] = (p.transpose(1, 2) @ go).unflatten(0, (Hkv, rep)).sum(1).transpose(0, 1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@_varlen_ref_backward.register_fake
def _(grad, q, k, v, cu, max_len, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _varlen_setup(ctx, inputs, output):
    q, k, v, cu, max_len, scale = inputs
    ctx.save_for_backward(q, k, v, cu)
    ctx.max_len, ctx.scale = max_len, scale


def _varlen_grad(ctx, grad):
    q, k, v, cu = ctx.saved_tensors
    return (*_varlen_ref_backward(grad, q, k, v, cu, ctx.max_len, ctx.scale), None, None, None)


_varlen_ref.register_autograd(_varlen_grad, setup_context=_varlen_setup)


def _varlen_stand_in(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    assert window_size == (-1, 0) and enable_gqa == (q.shape[1] != k.shape[1])
    return _varlen_ref(q, k, v, cu_q, max_q, q.shape[-1] ** -0.5 if scale is None else float(scale))


def test_compiled_blocks_trace_torch_varlen_attention_with_checkpointing(monkeypatch):
    """attn_implementation "torch_varlen" + activation checkpointing + compile: the attention is
    inside the compiled block (a graph break there would make the checkpointed block run eagerly
    as a whole), and log-probs and gradients are sdpa's, packed and padded."""
    import components.trainer.attention as forward_mod
    from components.trainer.forward import enable_activation_checkpointing
    from components.trainer.learner import compile_blocks
    from test_forward import assert_varlen_gives_sdpas, make_batch
    from test_forward import tiny_model as forward_tiny_model

    register_recording_backend()
    forward_mod.register_torch_varlen()
    monkeypatch.setattr(forward_mod, "_varlen_kernel", lambda: _varlen_stand_in)
    start, breaks = len(GRAPHS), _graph_breaks()

    def make_model(attn: str):
        model = forward_tiny_model("llama", attn=attn).train()
        enable_activation_checkpointing(model)
        if attn == "torch_varlen":
            compile_blocks(model, RECORDING)
        return model

    assert_varlen_gives_sdpas(make_batch(), make_model, compile_backend=RECORDING)
    ops = compiled_ops(start)
    assert has_op(ops, "varlen_ref") and has_op(ops, "silu"), f"the attention is not in a compiled block: {sorted(ops)}"
    assert _graph_breaks() == breaks


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


