"""Precision policies, applied to BOTH the trainer model and the generation engine.

One config key (``train.precision = "bf16_fp32_head"``) selects a policy; the trainer and
every engine resolve it for their device (``get_precision(name, device=...)``) and apply it
to their own copy of the model, so the two sides compute logits the same way. The paper
(PAPER.md §2, the MiniMax-M1 fix) keeps the LM head and the logits in fp32 on both sides to
shrink the gap between the generator's log-probs and the trainer's.

Policies (registry ``PRECISIONS``):
- ``fp32``: every parameter and the logits in float32.
- ``bf16``: bfloat16 body; the logits come out of the head in bfloat16 (the paper's
  baseline "bf16 LM head").
- ``bf16_fp32_head``: the body in bfloat16, the LM head weight in float32, and the head's
  input is upcast to float32, so the logits are computed and returned in float32.

Where bf16 happens on each side (real bf16):
- generator (``prepare_model``): the parameters are STORED in bfloat16 (the fp32 head aside),
  so every activation is bfloat16;
- trainer (``compute_context``): master weights stay float32 (learner.py); one rank computes
  under ``torch.autocast(bfloat16)`` (linear, matmul, attention ... take bf16 inputs and give
  bf16 outputs; everything else runs in fp32). The LM head follows the policy: bf16 logits
  for ``bf16`` (the chunked head of components/trainer/forward.py runs outside autocast, so
  the context computes it in bf16 explicitly), fp32 for ``bf16_fp32_head``. FSDP2 (T > 1
  ranks) uses a ``MixedPrecisionPolicy`` with ``compute_dtype`` instead (learner.shard_model).

Emulated bf16 (``precision.emulate``)
-------------------------------------
A CPU without bf16 units runs real bf16 about 10x slower than fp32 (measured: 1.2 s against
0.13 s for one tiny train step, also under autocast), so a tiny CPU run could not afford the
paper's precision. The bf16 policies therefore EMULATE
bf16 where it is slow: tensors stay float32 but their VALUES are rounded to bf16 (round to
nearest even, ``x.to(bfloat16).to(float32)``) at the points where real bf16 rounds:

- ``precision.emulate = "auto"`` (default): emulate on CPU, real bf16 on CUDA (and any other
  device); ``"on"``: emulate everywhere (e.g. to compare with real bf16 on a GPU);
  ``"off"``: real bf16 everywhere (slow on this CPU). Every process resolves the policy for
  its own device (``get_precision(name, device=...)``), so one run may have a real-bf16 GPU
  learner and emulating CPU generators; the weights travel in bf16 either way (weight_sync)
  and an emulating engine stores them as float32 holding the bf16 values
  (``accepts_wire_dtype``).
- Emulated, both sides (Llama/Qwen-style decoders):
  * every ``F.linear`` (every weight matmul: q/k/v/o, gate/up/down, the head): input, weight
    and bias rounded, fp32 matmul (products of bf16 values are exact in fp32; fp32
    accumulation, as real bf16 kernels accumulate), output rounded;
  * the outputs of the input embedding, of every decoder block (the residual stream at
    block boundaries) and of the final norm (the head's input) rounded
    (`boundary_modules`);
  * the LM head: ``bf16``: its output, the logits, rounded; ``bf16_fp32_head``: fp32 matmul
    on the (rounded) hidden state, fp32 logits;
  * regions where the model turns autocast off stay fp32, as under real autocast (e.g.
    Llama's rotary frequencies): emulation runs the forward in `marking_autocast`, autocast
    switched on with dtype float32, which casts nothing but marks the region.
- Generator (``prepare_model``): every parameter holds a bf16 value (the fp32 head aside),
  rounded when loaded and after every weight update (``round_weights_``); forward hooks on
  the model's ``nn.Linear`` modules and boundary modules do the rounding (no per-op cost).
- Trainer (``compute_context``): `BF16Emulation`, a torch-function mode on ``F.linear``
  (the fp32 master weights rounded at each use, as autocast casts them), plus the boundary
  hooks, added for the context's lifetime. Rounding is straight-through with a rounded
  gradient (the gradient of a bf16 tensor is bf16 in a real bf16 backward).
- NOT emulated: accumulation inside matmuls and attention stays fp32 (real kernels also
  accumulate in fp32; GPU flash attention also rounds the probabilities before P @ V);
  attention (scaled_dot_product_attention) runs in fp32 on the rounded q/k/v projections:
  the rotary products, hence the cached keys, are not re-rounded (rounding the whole KV
  cache at every decode step would cost more than the attention); elementwise ops inside a
  block (RMSNorm's scale, SiLU x up, the mid-block residual add) run in fp32 and are
  rounded only where they enter the next linear or leave the block (the real generator
  rounds each of them); other matmul-like ops (``torch.matmul``/``bmm``/``einsum``, conv;
  eager attention's matmuls) run unrounded in fp32; the chunked LM head's backward
  (components/trainer/forward.py) recomputes the logits unrounded. The vllm engine is never
  emulated (it runs its own kernels in the policy's dtype). Activation checkpointing is
  refused under emulation (its recomputation would run unrounded): a clear error at the
  first forward.
- Real bf16, one trainer rank: ``torch.autocast(bf16)`` keeps the residual stream fp32
  (fp32 master weights), unlike the real generator and the FSDP2 trainer (bf16 blocks);
  emulation follows the latter on both sides.
Measured on tiny_cpu.gin's policy (BENCHMARKS.md, "Emulated bf16 (issue 12)"): the
trainer-generator log-prob gap is ~4e-7 in fp32 and ~6e-3 emulated (real bf16 on this CPU:
~8e-3); the FP32 head shrinks it only marginally there (the 2-layer body dominates) and by
~2x on a peaked random policy; the learner step costs ~1.3x fp32 and the engine ~1.2x (real
bf16: ~11x and ~3.6x).

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

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from typing import Optional

import gin
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map_only

from components.registry import PRECISIONS

log = logging.getLogger(__name__)

__all__ = [
    "PrecisionPolicy",
    "fp32",
    "bf16",
    "bf16_fp32_head",
    "get_precision",
    "vllm_dtype",
    "precision_options",
    "emulation_mode",
    "emulation_override",
    "set_emulation_mode",
    "EMULATION_MODES",
    "marking_autocast",
    "BF16Emulation",
    "round_to_bf16",
    "is_bf16_valued",
    "boundary_modules",
]

EMULATION_MODES = ("auto", "on", "off")


@gin.configurable("precision", module="scalerl")
def precision_options(emulate: str = "auto") -> dict:
    """Process-wide precision options (gin: ``precision.emulate = "auto"``). See the module docstring."""
    if emulate not in EMULATION_MODES:
        raise ValueError(f"precision.emulate = {emulate!r} is not one of {list(EMULATION_MODES)}")
    return {"emulate": emulate}


_OVERRIDE: list = []  # emulation_override's stack (process-wide)
_RUN_MODE: list = []  # the mode of the run this process belongs to (`set_emulation_mode`), at most one


def set_emulation_mode(mode: str) -> None:
    """This process's ``precision.emulate``, as the run was resolved with it (a run's processes read no gin)."""
    if mode not in EMULATION_MODES:
        raise ValueError(f"precision.emulate = {mode!r} is not one of {list(EMULATION_MODES)}")
    _RUN_MODE[:] = [mode]


def emulation_mode() -> str:
    """The ``precision.emulate`` in force: an `emulation_override`, else the run's (`set_emulation_mode`),
    else the gin binding ("auto" by default; a tool outside a run)."""
    if _OVERRIDE:
        return _OVERRIDE[-1]
    return _RUN_MODE[0] if _RUN_MODE else precision_options()["emulate"]


@contextlib.contextmanager
def emulation_override(mode: str):
    """Within the block, policies resolve with ``precision.emulate = mode`` (tests, benchmarks)."""
    if mode not in EMULATION_MODES:
        raise ValueError(f"precision.emulate = {mode!r} is not one of {list(EMULATION_MODES)}")
    _OVERRIDE.append(mode)
    try:
        yield
    finally:
        _OVERRIDE.pop()


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


# ---------------------------------------------------------------------------------------
# bf16 emulation
def _round_values(x: torch.Tensor) -> torch.Tensor:
    """x (float32/float64) with every value rounded to the nearest bf16 (ties to even); same dtype."""
    return x.to(torch.bfloat16).to(x.dtype)


class _RoundToBF16(torch.autograd.Function):
    """Straight-through rounding: forward rounds the values, backward rounds the gradient to bf16."""

    @staticmethod
    def forward(ctx, x):
        return _round_values(x)

    @staticmethod
    def backward(ctx, grad):
        return _round_values(grad)


_ROUNDED = "_scalerl_bf16"  # attribute marking a tensor this module produced already rounded


def round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """Round a float32/float64 tensor's values to bf16 (dtype unchanged); other tensors pass through.

    Differentiable: the gradient passes straight through and is itself rounded to bf16
    (the gradient of a bf16 tensor in a real bf16 backward is bf16). A tensor this function
    returned is marked and passes through a second call unchanged (no second copy).
    """
    if x.dtype not in (torch.float32, torch.float64) or getattr(x, _ROUNDED, False):
        return x
    if torch.is_grad_enabled() and x.requires_grad:
        out = _RoundToBF16.apply(x)
    else:
        out = _round_values(x)
    setattr(out, _ROUNDED, True)
    return out


def is_bf16_valued(x: torch.Tensor) -> bool:
    """True when every value of `x` is exactly representable in bf16."""
    return bool(torch.equal(_round_values(x.detach()), x.detach())) if x.dtype in (torch.float32, torch.float64) else True


class BF16Emulation(TorchFunctionMode):
    """The TRAINER's emulation: a torch-function mode that rounds every ``F.linear`` to bf16 values.

    Non-head linears: input, weight and bias rounded (straight-through, gradients rounded),
    output rounded; inside the model's own autocast-off regions (see `marking_autocast`) they
    pass through in fp32, as under real autocast. The LM head (``head.weight``, read at call
    time, so FSDP2's unsharded parameter is recognised): the bf16 head is rounded wherever it
    runs (the chunked head of components/trainer/forward.py runs with autocast off); the fp32
    head is left in fp32 (its input rounded only when `round_head_input`, i.e. when no final
    norm was found to round it, `boundary_modules`). Every other op passes through.

    With ``emulate=False`` it is the REAL-bf16 helper of a one-rank learner under autocast:
    only the bf16 head is computed in real bf16 (the chunked head runs outside autocast).
    """

    def __init__(self, head: Optional[torch.nn.Module], *, fp32_head: bool, round_head_input: bool = False,
                 emulate: bool = True):
        super().__init__()
        self.head = head
        self.fp32_head = bool(fp32_head)
        self.round_head_input = bool(round_head_input)
        self.emulate = bool(emulate)
        self._last = None  # (input, its version, rounded): see _rounded_input

    def _rounded_input(self, x: torch.Tensor) -> torch.Tensor:
        """round_to_bf16(x), reusing the last result when the same unchanged tensor comes again
        (q/k/v and gate/up projections share their input)."""
        version = None if x.is_inference() else x._version  # inference tensors keep no version counter
        last = self._last
        if last is not None and last[0] is x and last[1] == version:
            return last[2]
        r = round_to_bf16(x)
        self._last = (x, version, r)
        return r

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.linear:
            return func(*args, **kwargs)
        x = args[0] if args else kwargs["input"]
        w = args[1] if len(args) > 1 else kwargs["weight"]
        b = args[2] if len(args) > 2 else kwargs.get("bias")
        is_head = self.head is not None and w is self.head.weight
        if not self.emulate:  # real bf16: only the bf16 head needs help (autocast does the rest)
            if is_head and not self.fp32_head:
                return F.linear(x.to(torch.bfloat16), w.to(torch.bfloat16), None if b is None else b.to(torch.bfloat16))
            return F.linear(x, w, b)
        if is_head:
            if self.fp32_head:  # fp32 head: fp32 matmul, fp32 logits
                return F.linear(round_to_bf16(x) if self.round_head_input else x, w, b)
            # the bf16 head: rounded wherever it runs
        elif not _autocast_on(x.device.type):
            return F.linear(x, w, b)  # an fp32 region of the model
        out = F.linear(self._rounded_input(x), round_to_bf16(w), None if b is None else round_to_bf16(b))
        return round_to_bf16(out)


def _autocast_on(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return False


@contextlib.contextmanager
def marking_autocast(device_type: str):
    """Autocast switched ON with dtype float32: it casts nothing (every tensor is fp32 already), but
    marks the region, so emulation tells it from the model's own autocast-off (fp32) regions."""
    try:
        prev = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
    except (RuntimeError, TypeError):  # pragma: no cover - a device without autocast
        yield
        return
    torch.set_autocast_dtype(device_type, torch.float32)
    torch.set_autocast_enabled(device_type, True)
    try:
        yield
    finally:
        torch.set_autocast_enabled(device_type, prev[0])
        torch.set_autocast_dtype(device_type, prev[1])


def _model_device_type(model: torch.nn.Module) -> str:
    for p in model.parameters():
        return p.device.type
    return "cpu"


def boundary_modules(model: torch.nn.Module) -> tuple[list, bool]:
    """The modules whose OUTPUT is a bf16 tensor between matmuls in a bf16 model: the input embedding, every
    decoder block (the residual stream at block boundaries) and the final norm (the head's input).

    Returns (modules, found_final_norm). Llama/Qwen-style decoders (``get_decoder()`` with ``layers`` and
    ``norm``); other architectures get what can be found.
    """
    mods = []
    emb = _input_embeddings(model)
    if emb is not None:
        mods.append(emb)
    decoder = None
    get = getattr(model, "get_decoder", None)
    if callable(get):
        try:
            decoder = get()
        except (AttributeError, ValueError, NotImplementedError):
            decoder = None
    decoder = decoder if decoder is not None else getattr(model, "model", None)
    layers = getattr(decoder, "layers", None) if decoder is not None else None
    if layers is not None:
        mods.extend(list(layers))
    norm = getattr(decoder, "norm", None) if decoder is not None else None
    if isinstance(norm, torch.nn.Module):
        mods.append(norm)
    return mods, isinstance(norm, torch.nn.Module)


def _round_output_hook(module, args, output):
    """forward hook: the module's floating outputs rounded to bf16 values (straight-through with grad)."""
    return tree_map_only(torch.Tensor, round_to_bf16, output)


def _add_boundary_hooks(model: torch.nn.Module) -> tuple[list, bool]:
    mods, has_norm = boundary_modules(model)
    return [m.register_forward_hook(_round_output_hook) for m in mods], has_norm


# The GENERATOR's emulation: forward hooks on its (already rounded) nn.Linear modules, which
# is what `BF16Emulation` does on the trainer, without a torch-function mode's per-op cost on
# every small decode step. The model's top-level forward runs inside `marking_autocast`.
def _linear_pre_hook(module, args):
    """Round a linear's input (not in the model's fp32 regions; the fp32 head only when no norm rounds it)."""
    st = module._scalerl_linear
    x = args[0]
    if st["head"]:
        return (round_to_bf16(x), *args[1:]) if st["round_input"] else None
    if not _autocast_on(x.device.type):
        return None
    cache = st["shared"]  # q/k/v and gate/up share their input: round it once
    if cache.get("x") is x:
        return (cache["r"], *args[1:])
    r = round_to_bf16(x)
    cache["x"], cache["r"] = x, r
    return (r, *args[1:])


def _linear_post_hook(module, args, output):
    st = module._scalerl_linear
    if st["head"]:
        return None if st["fp32"] else round_to_bf16(output)
    return round_to_bf16(output) if _autocast_on(output.device.type) else None


def _emulation_pre_hook(module, args, kwargs):
    state = module._scalerl_emulation
    state["shared"].clear()
    cm = marking_autocast(_model_device_type(module))
    cm.__enter__()
    state["stacks"].append(cm)
    return None


def _emulation_post_hook(module, args, kwargs, output):
    state = module._scalerl_emulation
    state["shared"].clear()
    if state["stacks"]:
        state["stacks"].pop().__exit__(None, None, None)
    return None


def _install_generator_emulation(model: torch.nn.Module, fp32_head: bool) -> None:
    """Hooks that make `model` (float32 storage of bf16 weights) compute like a bf16 model (idempotent)."""
    if getattr(model, "_scalerl_emulation", None) is not None:
        return
    _, has_norm = _add_boundary_hooks(model)
    head = _output_embeddings(model)
    shared: dict = {}
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m._scalerl_linear = {"head": m is head, "fp32": fp32_head, "round_input": not has_norm, "shared": shared}
            m.register_forward_pre_hook(_linear_pre_hook)
            m.register_forward_hook(_linear_post_hook)
    model._scalerl_emulation = {"stacks": [], "shared": shared, "has_norm": has_norm}
    model.register_forward_pre_hook(_emulation_pre_hook, with_kwargs=True)
    model.register_forward_hook(_emulation_post_hook, with_kwargs=True, always_call=True)


# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrecisionPolicy:
    """Where a model keeps its parameters and logits.

    Attributes:
        name: the registry name.
        param_dtype: dtype of the body's parameters (the generator's; the weights travel in it).
        logits_dtype: dtype the model's logits come out in.
        fp32_head: LM head weight (and its matmul) in float32.
        emulated: bf16 is emulated in float32 (set by `resolve`; see the module docstring).
    """

    name: str
    param_dtype: torch.dtype
    logits_dtype: torch.dtype
    fp32_head: bool = False
    emulated: bool = False

    # -- resolution ------------------------------------------------------------------------
    def resolve(self, device) -> "PrecisionPolicy":
        """This policy on `device`: emulated or real bf16 per ``precision.emulate`` (fp32 is never emulated)."""
        if self.param_dtype == torch.float32:
            return dataclasses.replace(self, emulated=False)
        mode = emulation_mode()
        device_type = torch.device(device).type if not isinstance(device, torch.device) else device.type
        emulate = mode == "on" or (mode == "auto" and device_type == "cpu")
        return dataclasses.replace(self, emulated=emulate)

    @property
    def storage_dtype(self) -> torch.dtype:
        """dtype the generator's body parameters are stored in (float32 when emulated)."""
        return torch.float32 if self.emulated else self.param_dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        """dtype the trainer's matmuls run in (float32 when emulated; FSDP2's param_dtype)."""
        return torch.float32 if self.emulated else self.param_dtype

    # -- the generator's model ---------------------------------------------------------------
    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Cast `model` in place to this policy (and return it). Idempotent.

        Real: parameters cast to ``param_dtype`` (the fp32 head kept fp32, with a pre-hook
        that upcasts its input). Emulated: parameters stay float32 holding bf16 values (the
        fp32 head unrounded), and every forward of `model` runs under `BF16Emulation`.
        """
        if self.fp32_head:
            untie_lm_head(model)  # before any cast, so the fp32 head keeps the exact embedding values
        head = _output_embeddings(model)
        if self.emulated:
            model.to(torch.float32)
            self.round_weights_(model)
            _install_generator_emulation(model, self.fp32_head)  # permanent: this model is emulated for good
        elif self.fp32_head:
            head_fp32 = head.weight.detach().to(torch.float32, copy=True)
            model.to(self.param_dtype)
            head.to(torch.float32)
            with torch.no_grad():
                head.weight.copy_(head_fp32)
            if not getattr(head, "_scalerl_fp32_head_hook", False):
                head.register_forward_pre_hook(_upcast_head_input)
                head._scalerl_fp32_head_hook = True
        else:
            model.to(self.param_dtype)
        config = getattr(model, "config", None)
        if config is not None:
            config.scalerl_precision = self.name
        return model

    def round_weights_(self, model: torch.nn.Module) -> None:
        """Emulated policies: round every float parameter of `model` to a bf16 value in place (the fp32 head
        excepted). Call after loading weights that may not be bf16 values; a no-op for real policies."""
        if not self.emulated:
            return
        keep = _output_embeddings(model).weight if self.fp32_head else None
        with torch.no_grad():
            for p in model.parameters():
                if p is not keep and p.dtype in (torch.float32, torch.float64):
                    p.copy_(_round_values(p))

    def accepts_wire_dtype(self, wire: torch.dtype, held: torch.dtype) -> bool:
        """True when a tensor arriving as `wire` may be copied into a parameter held as `held`
        (equal dtypes, or bf16 into an emulating engine's float32 storage: exact)."""
        return wire == held or (self.emulated and wire == self.param_dtype and held == torch.float32)

    def check_model(self, model: torch.nn.Module) -> None:
        """Raise if `model` does not follow this policy (a cheap guard for tests and workers)."""
        head = _output_embeddings(model)
        want_head = torch.float32 if self.fp32_head else self.storage_dtype
        if head.weight.dtype != want_head:
            raise AssertionError(f"precision {self.name}: LM head is {head.weight.dtype}, expected {want_head}")
        emb = _input_embeddings(model)
        if emb is not None and emb.weight.dtype != self.storage_dtype:
            raise AssertionError(f"precision {self.name}: embedding is {emb.weight.dtype}, expected {self.storage_dtype}")
        if self.emulated:
            if getattr(model, "_scalerl_emulation", None) is None:
                raise AssertionError(f"precision {self.name} (emulated): the model has no emulation hooks; "
                                     "prepare it with this policy's prepare_model")
            keep = head.weight if self.fp32_head else None
            bad = [n for n, p in model.named_parameters() if p is not keep and not is_bf16_valued(p)]
            if bad:
                raise AssertionError(f"precision {self.name} (emulated): parameters hold non-bf16 values: {bad[:5]}")

    # -- the trainer's compute path ------------------------------------------------------------
    def compute_context(self, model: torch.nn.Module, device, *, sharded: bool = False):
        """The context of a trainer forward (+ backward through autograd) on fp32 master weights.

        fp32: nothing. Emulated: `BF16Emulation` under a marking autocast. Real, one rank:
        ``torch.autocast(bf16)`` plus, for the bf16 head, a mode that runs the (outside-autocast)
        chunked head in bf16. Real, FSDP2 (`sharded`): nothing (MixedPrecisionPolicy does it).
        """
        if self.param_dtype == torch.float32:
            return contextlib.nullcontext()
        device_type = torch.device(device).type if not isinstance(device, torch.device) else device.type
        head = _output_embeddings(model)
        stack = contextlib.ExitStack()
        if self.emulated:
            checkpointing = getattr(type(model), "is_activation_checkpointing", None)
            checkpointing = model.is_activation_checkpointing if checkpointing is not None else getattr(
                model, "is_gradient_checkpointing", False)
            if checkpointing:
                raise ValueError(
                    f"precision {self.name} is emulated on {device_type} (precision.emulate), and emulation cannot "
                    "follow activation checkpointing's recomputation (it would recompute unrounded); set "
                    "train.activation_checkpointing = False, or precision.emulate = \"off\" for real bf16")
            handles, has_norm = _add_boundary_hooks(model)
            stack.callback(lambda: [h.remove() for h in handles])
            stack.enter_context(marking_autocast(device_type))
            stack.enter_context(BF16Emulation(head, fp32_head=self.fp32_head, round_head_input=not has_norm))
            return stack
        if sharded:
            return contextlib.nullcontext()
        stack.enter_context(torch.autocast(device_type=device_type, dtype=self.param_dtype))
        if not self.fp32_head:
            stack.enter_context(BF16Emulation(head, fp32_head=False, emulate=False))
        return stack


@PRECISIONS.register("fp32")
def fp32() -> PrecisionPolicy:
    """Everything in float32 (parameters, activations, logits)."""
    return PrecisionPolicy("fp32", torch.float32, torch.float32, fp32_head=False)


@PRECISIONS.register("bf16")
def bf16() -> PrecisionPolicy:
    """bfloat16 body and logits (the paper's baseline 'bf16 LM head'); emulated on CPU (precision.emulate)."""
    return PrecisionPolicy("bf16", torch.bfloat16, torch.bfloat16, fp32_head=False)


@PRECISIONS.register("bf16_fp32_head")
def bf16_fp32_head() -> PrecisionPolicy:
    """bfloat16 body, float32 LM head and logits (ScaleRL / MiniMax-M1); unties tied embeddings; emulated on CPU."""
    return PrecisionPolicy("bf16_fp32_head", torch.bfloat16, torch.float32, fp32_head=True)


def get_precision(precision, device=None) -> PrecisionPolicy:
    """A policy from a registry name or an existing PrecisionPolicy.

    With `device` the policy is resolved for it (emulated or real bf16, ``precision.emulate``);
    without, a name gives the nominal (real) policy and a policy object is returned as is.
    """
    policy = precision if isinstance(precision, PrecisionPolicy) else PRECISIONS.get(precision)()
    return policy.resolve(device) if device is not None else policy


def vllm_dtype(policy: PrecisionPolicy) -> str:
    """The `dtype=` argument vLLM's LLM takes for this policy's body."""
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[policy.param_dtype]
