"""The attention kernel of the learner's forward pass: which one runs, and torch's varlen kernel.

`train.attn_implementation` names a transformers `attn_implementation`; this module resolves it
for a learner's device and precision and supplies the one kernel that is this trainer's own:

    resolve_attn_implementation("auto", "cuda", torch.bfloat16, model_config, (9, 0))  # "torch_varlen"
    resolve_attn_implementation(None, "cpu")                                          # "sdpa"
    learner_attn_implementation(cfg, device)     # the same for a run's config (reads config.json locally)

- Choices (`ATTN_IMPLEMENTATIONS`): "sdpa" (None; every device), "eager", "flash_attention_N"
  (CUDA, the flash-attn package of that version, bf16 / fp16), and "torch_varlen" (CUDA, bf16 /
  fp16, torch >= 2.10: torch's own varlen flash kernel, `torch.nn.attention.varlen`, no extra
  package). "auto" (`auto_attn_implementation`) is torch_varlen where it runs (an Ampere or newer
  GPU, a half-precision compute dtype, full causal attention in every layer, no attention
  dropout), else sdpa. A bad value is a ValueError naming the valid choices.
- torch_varlen (`register_torch_varlen` makes it a name transformers knows): packed rows
  (forward.py's `pack`: one row, position ids restarting at 0 per sequence, no attention mask)
  and padded rows alike go to the kernel as their kept tokens plus cumulative sequence starts
  (`varlen_layout`); no [N, N] mask and no padding is computed.
- `train.compile`: the learner's forward computes that layout once, before the decoder blocks,
  and passes it down as a model kwarg (`varlen_kwargs`, `VARLEN_LAYOUT_KWARG`), so a compiled
  block traces its attention too (torch's varlen kernel is a custom op); without it the layout
  runs eagerly in the first layer's attention (reused by the others), a graph break.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from typing import Optional

import torch

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "AUTO_ATTN",
    "TORCH_VARLEN",
    "VARLEN_LAYOUT_KWARG",
    "auto_attn_implementation",
    "learner_attn_implementation",
    "resolve_attn_implementation",
    "register_torch_varlen",
    "torch_varlen_attention",
    "varlen_call",
    "varlen_kwargs",
    "varlen_layout",
]

# transformers attn_implementation names this trainer accepts (None means "sdpa"). "torch_varlen"
# is this module's: torch's own varlen flash kernel (torch.nn.attention.varlen), no extra package.
TORCH_VARLEN = "torch_varlen"
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flash_attention_4", TORCH_VARLEN)
AUTO_ATTN = "auto"  # train.attn_implementation = "auto": torch_varlen where it runs, else sdpa (`auto_attn_implementation`)


# --------------------------------------------------------------------------------------------
# varlen layout and torch's varlen kernel (attn_implementation "torch_varlen")
def varlen_layout(position_ids: torch.Tensor, keep_mask: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], torch.Tensor, int]:
    """Which tokens of a [B, L] batch go to a varlen kernel, and where its sequences start.

    Args:
        position_ids: [B, L] long. A sequence starts at the first kept token of a row and at
            every kept token whose position id is 0 (a packed row restarts its ids per sequence).
        keep_mask: None (every token is real: packed rows, or unpadded rows) or [B, L] bool,
            True for real tokens (a padded micro-batch; one sequence per row).

    Returns:
        keep: None (all B x L tokens) or [n] long, the flat indices of the kept tokens in [B x L];
        cu_seqlens: [S + 1] int32 on the ids' device, the cumulative lengths of the S sequences;
        max_len: the longest sequence (int).
    """
    B, L = position_ids.shape
    rows = torch.arange(B, device=position_ids.device).repeat_interleave(L)  # [B x L]
    pos = position_ids.reshape(-1)  # [B x L]
    keep = None
    if keep_mask is not None:
        keep = keep_mask.reshape(-1).bool().nonzero().view(-1)  # [n]
        rows, pos = rows[keep], pos[keep]  # [n], [n]
    n = rows.numel()
    new_row = torch.ones_like(rows, dtype=torch.bool)  # [n]: the first kept token of its row
    new_row[1:] = rows[1:] != rows[:-1]
    starts = (new_row | (pos == 0)).nonzero().view(-1)  # [S]
    cu = torch.cat([starts, torch.tensor([n], device=starts.device)]).to(torch.int32)  # [S + 1]
    max_len = int((cu[1:] - cu[:-1]).max()) if n else 0
    return keep, cu, max_len


_LAST_LAYOUT: list = []  # [(position_ids, attention_mask, B, L), layout] of the latest forward
VARLEN_LAYOUT_KWARG = "scalerl_varlen_layout"  # the model kwarg carrying a precomputed `varlen_layout`


def varlen_kwargs(model: torch.nn.Module, position_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> dict:
    """The model kwargs that hand every layer's `torch_varlen_attention` the forward's varlen layout,
    computed here once, before the decoder blocks ({} for any other attention).

    transformers passes a model's extra kwargs down to each attention function. The layout costs
    host syncs (nonzero, max); computed outside the blocks, it leaves nothing in them that a
    compiled block (`train.compile`) cannot trace. position_ids [B, L]; attention_mask None or
    [B, L] (a padded micro-batch: its real tokens), as the forward gets them.
    """
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != TORCH_VARLEN:
        return {}
    forward_params = inspect.signature(type(model).forward).parameters.values()
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in forward_params):
        return {}  # a forward that takes no extra kwargs: each attention computes the layout (a graph break)
    keep_mask = None
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        keep_mask = attention_mask.bool()  # as flash_attention_mask: None when every token is real
    return {VARLEN_LAYOUT_KWARG: varlen_layout(position_ids, keep_mask)}


@torch.compiler.disable  # host syncs: runs eagerly (a graph break) when no precomputed layout is given
def _cached_varlen_layout(position_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], B: int, L: int):
    """`varlen_layout` once per forward, not once per decoder layer: every layer gets the same
    position-id and mask tensors, and the layout costs host syncs (nonzero, max). The entry holds
    the tensors themselves, so a hit is the very same objects, never a reused address."""
    if _LAST_LAYOUT:
        (ids, mask, b, l), layout = _LAST_LAYOUT[0]
        if ids is position_ids and mask is attention_mask and (b, l) == (B, L):
            return layout
    keep_mask = None if attention_mask is None else attention_mask[:, -L:].bool()  # [B, L]
    layout = varlen_layout(position_ids.expand(B, L), keep_mask)
    _LAST_LAYOUT[:] = [((position_ids, attention_mask, B, L), layout)]
    return layout


def _varlen_kernel():
    """torch's varlen attention (flash on CUDA; it has no CPU kernel). Tests substitute a reference."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


def _varlen_signature() -> frozenset:
    """The keyword names of this torch's `varlen_attn` (empty if it has none)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return frozenset()
    return frozenset(inspect.signature(varlen_attn).parameters)


# read once at import, outside any compiled graph (dynamo would break its graph on inspect)
VARLEN_PARAMS = _varlen_signature()


def varlen_call(kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int,
                scale: Optional[float], params: Optional[frozenset] = None) -> torch.Tensor:
    """Causal varlen attention through `kernel`, with the keywords this torch's `varlen_attn` has
    (`params`, default `VARLEN_PARAMS`).

    q [n, Hq, D], k / v [n, Hkv, D], cu [S + 1] int32 sequence boundaries; returns [n, Hq, D].
    torch 2.13's `varlen_attn` takes `window_size=(-1, 0)` for causal, and `enable_gqa`. Without
    `enable_gqa` (earlier torch), key and value heads are repeated to Hq; the earliest versions take
    `is_causal` in place of `window_size`.
    """
    params = VARLEN_PARAMS if params is None else params
    kwargs = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    elif "is_causal" in params:
        kwargs["is_causal"] = True
    else:
        raise TypeError(f"this torch's varlen attention takes neither window_size nor is_causal (keywords: "
                        f"{sorted(params) or 'no torch.nn.attention.varlen'}), so attn_implementation 'torch_varlen' "
                        "cannot run here; use 'sdpa'")
    if "scale" in params:
        kwargs["scale"] = scale
    elif scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        raise TypeError(f"this torch's varlen_attn takes no scale, and this model's attention scale {scale} is not "
                        "1/sqrt(head_dim); use attn_implementation 'sdpa'")
    Hq, Hkv = q.shape[1], k.shape[1]
    if Hq != Hkv:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k = k.repeat_interleave(Hq // Hkv, dim=1)  # [n, Hq, D]
            v = v.repeat_interleave(Hq // Hkv, dim=1)  # [n, Hq, D]
    return kernel(q, k, v, cu, cu, max_len, max_len, **kwargs)


def torch_varlen_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: Optional[float] = None,
                           sliding_window: Optional[int] = None, **kwargs):
    """A transformers attention function over torch's varlen kernel: causal attention within each
    sequence of a packed row, with no [N, N] mask and no padding computed.

    query [B, Hq, L, D], key and value [B, Hkv, L, D] (transformers' layout); attention_mask None
    or the [B, L] padding mask (`flash_attention_mask`, registered with it); `position_ids`
    [B, L] in kwargs (the decoder passes them on). Returns ([B, L, Hq, D], None); padded
    positions come out 0.
    """
    if dropout:
        raise ValueError(f"attn_implementation {TORCH_VARLEN!r} has no attention dropout (got {dropout}); the learner trains without it")
    if sliding_window is not None:
        raise ValueError(f"attn_implementation {TORCH_VARLEN!r} computes full causal attention; this model uses a "
                         f"sliding window of {sliding_window}: use 'sdpa' or a flash_attention_N")
    B, Hq, L, D = query.shape
    Hkv = key.shape[1]
    layout = kwargs.get(VARLEN_LAYOUT_KWARG)  # precomputed by the learner's forward (`varlen_kwargs`)
    if layout is None:
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(L, device=query.device)
        layout = _cached_varlen_layout(position_ids, attention_mask, B, L)
    keep, cu, max_len = layout
    # one half-precision dtype for the kernel: under autocast (one learner rank) the projections
    # come out bf16 but the rotary embedding (fp32 cos / sin) promotes query and key to fp32
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = value.dtype if value.dtype in (torch.bfloat16, torch.float16) else query.dtype

    def tokens(x, heads):  # [B, H, L, D] -> [n, H, D]
        flat = x.to(dtype).transpose(1, 2).reshape(B * L, heads, D)
        return flat if keep is None else flat[keep]

    out = varlen_call(_varlen_kernel(), tokens(query, Hq), tokens(key, Hkv), tokens(value, Hkv), cu, max_len,
                      scaling)  # [n, Hq, D]
    if keep is not None:
        full = out.new_zeros(B * L, Hq, D)
        out = full.index_copy(0, keep, out)  # [B x L, Hq, D]
    return out.reshape(B, L, Hq, D), None


def register_torch_varlen() -> None:
    """Make "torch_varlen" an attn_implementation transformers knows (idempotent): the attention
    function above, and flash attention's mask function (None, or the 2D padding mask)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(TORCH_VARLEN, torch_varlen_attention)
    AttentionMaskInterface.register(TORCH_VARLEN, flash_attention_mask)


def _flash_available(version: int) -> bool:
    utils = importlib.import_module("transformers.utils")
    check = getattr(utils, f"is_flash_attn_{version}_available", None)
    return bool(check()) if callable(check) else False


def _has_torch_varlen() -> bool:
    """Whether this torch has its varlen flash kernel (torch.nn.attention.varlen, torch >= 2.10)."""
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


def _full_causal_attention(model_config) -> bool:
    """Whether every layer of a model (a transformers config, or its config.json as a dict) attends
    fully and causally without dropout: what torch_varlen computes."""
    if isinstance(model_config, dict):
        cfg = model_config.get("text_config") or model_config
        get = cfg.get
    else:
        cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        get = lambda key, default=None: getattr(cfg, key, default)  # noqa: E731
    if get("attention_dropout", 0.0):
        return False
    layer_types = get("layer_types")
    if layer_types:
        return all(t == "full_attention" for t in layer_types)
    if get("use_sliding_window") is False:
        return True
    return not get("sliding_window")


def auto_attn_implementation(device, dtype: Optional[torch.dtype], model_config=None,
                             capability: Optional[tuple[int, int]] = None) -> str:
    """What "auto" resolves to: "torch_varlen" on a CUDA device when the decoder blocks compute in
    bf16 or fp16, this torch has `torch.nn.attention.varlen`, the GPU (when its compute `capability`
    is given) is an Ampere or newer (its flash kernel needs sm_80), and the model (when
    `model_config` is given) has full causal attention in every layer and no attention dropout;
    else "sdpa". Measured on an H100 (BENCHMARKS.md, "On one GPU"): packed rows 1.37x faster than
    sdpa's block-diagonal mask, with no [N, N] mask in memory."""
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    if dev.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return "sdpa"
    if capability is not None and tuple(capability) < (8, 0):
        return "sdpa"
    if not _has_torch_varlen():
        return "sdpa"
    if model_config is not None and not _full_causal_attention(model_config):
        return "sdpa"
    return TORCH_VARLEN


def learner_attn_implementation(cfg, device) -> str:
    """`train.attn_implementation` of the run config `cfg` resolved for a learner on `device`,
    with the compute dtype of `cfg.precision` there (fp32 where bf16 is emulated) and, for "auto" on
    a GPU, the model's config.json (read locally: nothing is downloaded) and the GPU's capability."""
    from components.precision import get_precision

    dev = torch.device(device)
    dtype = get_precision(cfg.precision, device=dev).compute_dtype
    model_config = capability = None
    if cfg.attn_implementation == AUTO_ATTN and dev.type == "cuda":
        from transformers import AutoConfig

        try:
            model_config = AutoConfig.from_pretrained(cfg.model_path, local_files_only=True)
        except (OSError, ValueError):  # no local config: loading the model reports that; torch_varlen names a window
            model_config = None
        if torch.cuda.is_available():
            capability = torch.cuda.get_device_capability(dev)
    return resolve_attn_implementation(cfg.attn_implementation, device, dtype, model_config, capability)


def resolve_attn_implementation(name: Optional[str], device, dtype: Optional[torch.dtype] = None, model_config=None,
                                capability: Optional[tuple[int, int]] = None) -> str:
    """The transformers `attn_implementation` for `train.attn_implementation` on `device`.

    None -> "sdpa" (every device). "auto" -> `auto_attn_implementation(device, dtype,
    model_config, capability)`: "torch_varlen" where it runs, else "sdpa". "eager" works everywhere. "flash_attention_N" needs a CUDA
    device, the flash-attn package of that version installed, and (when `dtype`, the decoder
    blocks' compute dtype, is given) bf16 or fp16; it runs packed rows through the varlen kernel.
    "torch_varlen" has the same needs except the package: it is torch's own varlen flash kernel
    (`torch.nn.attention.varlen`), registered with transformers here.
    Raises ValueError naming the bad value and the valid choices.
    """
    if name is None:
        return "sdpa"
    if name == AUTO_ATTN:
        name = auto_attn_implementation(device, dtype, model_config, capability)
    if not isinstance(name, str) or name not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"train.attn_implementation = {name!r} is not one of {[AUTO_ATTN, *ATTN_IMPLEMENTATIONS]} "
                         "(or None for sdpa)")
    if name.startswith("flash_attention_") or name == TORCH_VARLEN:
        if dtype is not None and dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(
                f"train.attn_implementation = {name!r} computes in bf16 or fp16 only, the decoder blocks compute in "
                f"{dtype}; use train.precision 'bf16' or 'bf16_fp32_head', or attn_implementation 'sdpa'"
            )
        dev = torch.device(device) if not isinstance(device, torch.device) else device
        if dev.type != "cuda":
            raise ValueError(
                f"train.attn_implementation = {name!r} needs a CUDA device, the learner runs on {str(dev)!r}; "
                f"use one of ['sdpa', 'eager'] (or None) there"
            )
        if name == TORCH_VARLEN:
            if not _has_torch_varlen():
                raise ValueError(f"train.attn_implementation = {name!r} needs torch >= 2.10 (torch.nn.attention.varlen); "
                                 f"this torch is {torch.__version__}: use 'sdpa'")
            register_torch_varlen()
            return name
        version = int(name.rsplit("_", 1)[1])
        if not _flash_available(version):
            pkg = {2: "flash-attn", 3: "flash-attn-3 (flash_attn_interface)", 4: "flash-attn-4 (flash_attn.cute)"}[version]
            raise ValueError(f"train.attn_implementation = {name!r} but {pkg} is not installed here; install it or use 'sdpa'")
    return name
