"""Precision policies, applied to BOTH the trainer model and the generation engine.

One config key (``train.precision = "bf16_fp32_head"``) selects a policy; the trainer and
every engine call ``PRECISIONS.get(name)().prepare_model(model)`` on their own copy of the
model, so the two sides compute logits the same way. The paper (PAPER.md §2, the MiniMax-M1
fix) keeps the LM head and the logits in fp32 on both sides to shrink the gap between the
generator's log-probs and the trainer's.

Policies (registry ``PRECISIONS``):
- ``fp32``: every parameter and the logits in float32.
- ``bf16``: every parameter in bfloat16; the logits come out of the head in bfloat16.
- ``bf16_fp32_head``: the body in bfloat16, the LM head weight in float32, and the head's
  input is upcast to float32, so the logits are computed and returned in float32.

Tied embeddings and the fp32 head: the input embedding stays bfloat16 while the head must
be float32, so they cannot share one tensor. ``prepare_model`` UNTIES them: the head gets
its own float32 copy of the embedding matrix and ``config.tie_word_embeddings`` is set to
False (a saved checkpoint then holds both matrices; a state dict has both keys). From then
on the head and the embedding train as separate parameters. This is the choice the
PipelineRL ``fp32_lm_head`` option makes as well; it is logged with a warning so that a run
does not change its parametrisation silently.

Log-probs are always taken in float32 from whatever dtype the logits have
(``components.engines.logprobs``), so ``logits_dtype`` only decides where rounding happens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from components.registry import PRECISIONS

log = logging.getLogger(__name__)

__all__ = ["PrecisionPolicy", "fp32", "bf16", "bf16_fp32_head", "get_precision", "vllm_dtype"]


def _output_embeddings(model: torch.nn.Module):
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        raise ValueError(
            f"{type(model).__name__} has no output embedding (LM head); a precision policy needs a causal LM "
            "with get_output_embeddings()"
        )
    return head


def _input_embeddings(model: torch.nn.Module):
    get = getattr(model, "get_input_embeddings", None)
    return get() if callable(get) else None


def heads_are_tied(model: torch.nn.Module) -> bool:
    """True when the LM head shares its weight tensor with the input embedding."""
    head = _output_embeddings(model)
    emb = _input_embeddings(model)
    return emb is not None and head.weight is emb.weight


def untie_lm_head(model: torch.nn.Module) -> bool:
    """Give the LM head its own copy of a tied embedding matrix (in place). Returns True if it untied."""
    if not heads_are_tied(model):
        return False
    head = _output_embeddings(model)
    head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=head.weight.requires_grad)
    config = getattr(model, "config", None)
    if config is not None:
        config.tie_word_embeddings = False
        text_config = getattr(config, "get_text_config", None)
        if callable(text_config):
            try:
                text_config().tie_word_embeddings = False
            except Exception:  # pragma: no cover - configs without a text sub-config
                pass
    # transformers re-ties on post_init/tie_weights when this attribute names the pair.
    if getattr(model, "_tied_weights_keys", None):
        model._tied_weights_keys = {} if isinstance(model._tied_weights_keys, dict) else []
    log.warning(
        "precision bf16_fp32_head: untied the LM head from the input embedding of %s "
        "(fp32 head, bf16 embedding); they now train as separate parameters",
        type(model).__name__,
    )
    return True


def _upcast_head_input(module: torch.nn.Module, args):
    """forward pre-hook on the LM head: compute the head matmul in the head's dtype (fp32)."""
    (hidden, *rest) = args
    return (hidden.to(module.weight.dtype), *rest)


@dataclass(frozen=True)
class PrecisionPolicy:
    """Where a model keeps its parameters and logits.

    Attributes:
        name: the registry name.
        param_dtype: dtype of the body's parameters.
        logits_dtype: dtype the model's logits come out in.
        fp32_head: LM head weight (and its matmul) in float32.
    """

    name: str
    param_dtype: torch.dtype
    logits_dtype: torch.dtype
    fp32_head: bool = False

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Cast `model` in place to this policy (and return it). Idempotent."""
        if self.fp32_head:
            untie_lm_head(model)  # before any cast, so the fp32 head keeps the exact embedding values
            head = _output_embeddings(model)
            head_fp32 = head.weight.detach().to(torch.float32, copy=True)
            model.to(self.param_dtype)
            head.to(torch.float32)
            with torch.no_grad():
                head.weight.copy_(head_fp32)
        else:
            model.to(self.param_dtype)
        if self.fp32_head:
            if not getattr(head, "_scalerl_fp32_head_hook", False):
                head.register_forward_pre_hook(_upcast_head_input)
                head._scalerl_fp32_head_hook = True
        config = getattr(model, "config", None)
        if config is not None:
            config.scalerl_precision = self.name
        return model

    def check_model(self, model: torch.nn.Module) -> None:
        """Raise if `model` does not follow this policy (a cheap guard for tests and workers)."""
        head = _output_embeddings(model)
        want_head = torch.float32 if self.fp32_head else self.param_dtype
        if head.weight.dtype != want_head:
            raise AssertionError(f"precision {self.name}: LM head is {head.weight.dtype}, expected {want_head}")
        emb = _input_embeddings(model)
        if emb is not None and emb.weight.dtype != self.param_dtype:
            raise AssertionError(f"precision {self.name}: embedding is {emb.weight.dtype}, expected {self.param_dtype}")


@PRECISIONS.register("fp32")
def fp32() -> PrecisionPolicy:
    """Everything in float32 (parameters, activations, logits)."""
    return PrecisionPolicy("fp32", torch.float32, torch.float32, fp32_head=False)


@PRECISIONS.register("bf16")
def bf16() -> PrecisionPolicy:
    """Everything in bfloat16, logits included (the paper's baseline 'bf16 LM head')."""
    return PrecisionPolicy("bf16", torch.bfloat16, torch.bfloat16, fp32_head=False)


@PRECISIONS.register("bf16_fp32_head")
def bf16_fp32_head() -> PrecisionPolicy:
    """bfloat16 body, float32 LM head and logits (ScaleRL / MiniMax-M1); unties tied embeddings."""
    return PrecisionPolicy("bf16_fp32_head", torch.bfloat16, torch.float32, fp32_head=True)


def get_precision(precision) -> PrecisionPolicy:
    """A policy from a registry name or an existing PrecisionPolicy."""
    if isinstance(precision, PrecisionPolicy):
        return precision
    return PRECISIONS.get(precision)()


def vllm_dtype(policy: PrecisionPolicy) -> str:
    """The `dtype=` argument vLLM's LLM takes for this policy's body."""
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[policy.param_dtype]
