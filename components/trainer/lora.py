"""LoRA (`train.lora_rank` > 0): low-rank adapters trained on a frozen base model, through peft.

    train.lora_rank = 8                 # r; 0 (the default) is full fine-tuning, exactly as without this module
    train.lora_alpha = 16.0             # the update is (lora_alpha / r) x B A: peft's convention (no rsLoRA)
    train.lora_targets = "all-linear"   # every nn.Linear of the decoder blocks (the LM head excepted),
                                        # or module names: ["q_proj", "k_proj", "v_proj", "o_proj"]
    train.lora_dropout = 0.0            # peft's dropout on each adapter's input, while the learner trains

Where it is applied. `Learner.__init__` injects the adapters into the transformers model IN PLACE
(`apply_lora`: peft's `LoraConfig` + `inject_adapter_in_model`, the injection `get_peft_model`
performs, without the `PeftModel` wrapper): the model stays a `LlamaForCausalLM` / `Qwen2ForCausalLM`,
each targeted `nn.Linear` becomes a peft `lora.Linear` that keeps the original as its `base_layer`.
It happens after the master weights are made fp32 and an fp32 head is untied, and BEFORE activation
checkpointing, FSDP2 sharding and torch.compile, so:
- everything that walks the model finds what it always found: `learner.decoder_layers`
  (`model.model.layers`), `get_decoder`, `get_output_embeddings`, the chunked log-prob head, the
  precision policy's boundary modules (a `PeftModel` would put `base_model.model.` in front and
  change what `base_model` means);
- FSDP2 shards each decoder block WITH its adapters inside (one FSDP group per block, as for full
  fine-tuning) under the same MixedPrecisionPolicy: the frozen base is stored as fp32 shards and
  gathered in the compute dtype for each block, the adapters likewise; only the adapters have
  gradients, reduce-scatters and AdamW state;
- the base is frozen (requires_grad False; peft marks only the adapters trainable), and
  `make_optimizer`, the grad-norm clip and the emulated-ranks path all take the parameters that
  require grad: the optimizer holds the adapters only;
- lora_A starts Kaiming-uniform (peft's default) and lora_B at zero, so the policy starts as the
  base, bit for bit. Learner rank 0 draws lora_A; ranks >= 1 (built empty on the meta device)
  receive it with the base weights (`learner.load_from_rank0`).
- `train.lora_dropout` (default 0: none, as before it existed) is peft's `lora_dropout`: dropout on
  the input of each adapter's A, active while the learner trains (the learner's forward with
  gradients runs in train mode); the base path, the generators' merged weights and the KL
  reference (adapters off, eval mode) never see it. The learner's log-probs of a step then carry
  the dropout mask, so the importance ratio and the logged trainer-vs-generator gap include it.

Generators never see an adapter. `generator_parameters` lists what they receive: the base model's
parameter names (no `.base_layer.`, no `lora_*`), each adapted weight MERGED on the fly,
W + (lora_alpha / r) x B @ A (`merged_weight`), computed from the full tensors in fp32 and cast to
the policy's wire dtype like any other parameter (weight_sync.iter_full_parameters; under FSDP2 every
rank gathers W, A and B with `full_tensor()` in the same order). The trained tensors are not touched.
So the torch engine and vLLM need no LoRA support; the merged weights are the exact product of the
trained ones (the learner itself computes W x + s B (A x), which differs from the merged matmul by
rounding only: in fp32 ~1e-7, under real bf16 one more rounding of W + s B A).

The KL penalty's reference policy (`train.kl_coef` > 0) under LoRA is the policy's own frozen base:
`Learner.reference_logprobs` runs the policy with its adapters switched off (`adapters_off`), as TRL
does for a peft model without a ref_model, instead of holding a full frozen copy of the model. The
base never trains, so this is exactly the initial policy, the reference full fine-tuning copies.

Checkpoints (components/trainer/checkpoint.py) store the model state as it is, base and adapters
(keys `...q_proj.base_layer.weight`, `...q_proj.lora_A.default.weight`), with the adapters' AdamW
state, and the LoraConfig as `hf/adapter/adapter_config.json`; a resume injects the same adapters
and loads everything back bit for bit. `scalerl export` / `final/` (components/trainer/export.py)
writes the MERGED model (a plain transformers model: `from_pretrained` needs no peft) and the
adapter in peft's format in `adapter/` (`PeftModel.from_pretrained(base, OUT/adapter)`).
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from components.trainer.config import ALL_LINEAR, ConfigError

__all__ = [
    "ADAPTER",
    "ADAPTER_DIR",
    "ALL_LINEAR",
    "lora_config",
    "check_targets",
    "check_targets_of_model",
    "apply_lora",
    "is_lora",
    "lora_layers",
    "adapters_off",
    "frozen_base",
    "is_adapter_name",
    "generator_parameters",
    "merged_weight",
    "trainable_parameter_count",
    "write_adapter_config",
    "read_adapter_config",
    "save_adapter",
    "merge_into_base",
]

ADAPTER = "default"  # peft's adapter name: one adapter per model
ADAPTER_DIR = "adapter"  # checkpoint hf/adapter/adapter_config.json; export OUT/adapter/ (peft's files)


def _target_names(targets: Any) -> Optional[list[str]]:
    """None for "all-linear", else the list of module names (one name is a list of one: never a regex)."""
    if isinstance(targets, str):
        return None if targets == ALL_LINEAR else [targets]
    return list(targets)


def lora_config(rank: int, alpha: float, targets: Any, base_model_name_or_path: Optional[str] = None,
                dropout: float = 0.0):
    """peft's LoraConfig for train.lora_rank / lora_alpha / lora_targets / lora_dropout (no bias, no rsLoRA/DoRA)."""
    from peft import LoraConfig

    names = _target_names(targets)
    return LoraConfig(r=int(rank), lora_alpha=float(alpha), target_modules=ALL_LINEAR if names is None else names,
                      lora_dropout=float(dropout), bias="none", base_model_name_or_path=base_model_name_or_path)


def _output_embedding(model) -> Optional[torch.nn.Module]:
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


def _matches(module_name: str, target: str) -> bool:
    """peft's rule for a list of target names: the module path equals it or ends with ".<target>"."""
    return module_name == target or module_name.endswith("." + target)


def check_targets(model: torch.nn.Module, targets: Any) -> None:
    """Every name of train.lora_targets names at least one nn.Linear of `model` (the LM head excepted);
    ConfigError otherwise, listing the model's linear layers. Works on a meta-device skeleton."""
    names = _target_names(targets)
    if names is None:
        return
    head = _output_embedding(model)
    modules = dict(model.named_modules())
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in modules.items() if isinstance(m, torch.nn.Linear) and m is not head})
    for target in names:
        hits = [(n, m) for n, m in modules.items() if n and _matches(n, target)]
        if not hits:
            raise ConfigError(f"train.lora_targets: {target!r} matches no module of {type(model).__name__}; its "
                                f"linear layers: {', '.join(linear)} (or \"{ALL_LINEAR}\")")
        if any(m is head for _, m in hits):
            raise ConfigError(f"train.lora_targets: {target!r} is the LM head, which LoRA here leaves frozen and "
                                f"unadapted (as peft's \"{ALL_LINEAR}\" does); adapt the decoder blocks' linear layers: "
                                f"{', '.join(linear)}")
        other = [(n, m) for n, m in hits if not isinstance(m, torch.nn.Linear)]
        if other:
            n, m = other[0]
            raise ConfigError(f"train.lora_targets: {target!r} matches {n} ({type(m).__name__}); LoRA here adapts "
                                f"nn.Linear layers only: {', '.join(linear)}")


def check_targets_of_model(cfg) -> None:
    """`check_targets` for a run's resolved model.path, on its skeleton (meta device: no weights read),
    when train.lora_rank > 0: `scalerl train` refuses an unknown target before any process starts."""
    if cfg.lora_rank <= 0:
        return
    from components.models import empty_causal_lm

    check_targets(empty_causal_lm(cfg.model_path), cfg.lora_targets)


def apply_lora(model: torch.nn.Module, cfg) -> torch.nn.Module:
    """Inject train.lora_rank adapters into `model` in place (see the module docstring) and return it.

    Only the adapters require grad afterwards. `model` may be a meta-device skeleton (a learner rank
    >= 1): its adapters are then empty too and come from rank 0. Raises ConfigError for targets the
    model does not have (before any weight is touched).
    """
    from peft import inject_adapter_in_model
    from peft.tuners.lora import Linear as LoraLinear

    check_targets(model, cfg.lora_targets)
    name = getattr(model, "name_or_path", None) or None
    config = lora_config(cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, base_model_name_or_path=name,
                         dropout=getattr(cfg, "lora_dropout", 0.0))
    inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    layers = lora_layers(model)
    if not layers:
        raise ConfigError(f"train.lora_targets = {cfg.lora_targets!r} adapted no layer of {type(model).__name__}")
    odd = [n for n, m in layers.items() if not isinstance(m, LoraLinear) or getattr(m, "fan_in_fan_out", False)]
    if odd:
        kind = type(layers[odd[0]].get_base_layer()).__name__
        raise ConfigError(f"train.lora_targets adapted {odd[0]} ({kind}); only nn.Linear layers are supported (their "
                            "merged weights W + s B A are what the generators receive)")
    return model


def is_lora(model: torch.nn.Module) -> bool:
    """Whether `model` carries injected LoRA adapters (never imports peft for a plain model)."""
    return isinstance(getattr(model, "peft_config", None), dict) and bool(lora_layers(model))


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """{module name: peft LoRA layer} of `model` (empty for a plain model)."""
    if not isinstance(getattr(model, "peft_config", None), dict):
        return {}
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Every LoRA layer of `model` computes its base layer alone for the duration: `model` is then the
    frozen base (the KL penalty's reference policy under LoRA). Each layer's previous state is restored
    on exit, on an exception too.

    Through peft's own switch, `BaseTunerLayer.enable_adapters(False)` (the `disable_adapters` flag
    peft's `lora.Linear.forward` reads, what `PeftModel.disable_adapter()` toggles). peft's switch also
    sets the adapters' requires_grad (False when off, True for the active adapter when back on); here
    every parameter's requires_grad is put back at once, so it never changes as anything else sees it:
    FSDP2 takes a group's trainable parameters (and their gradient dtypes) from the sharded parameters'
    requires_grad at its lazy init, which may be this context's forward, and copies it onto the
    gathered parameters at each unshard. Works on a sharded (FSDP2) and compiled model: it toggles
    module attributes only (a compiled block guards on the flag: one more graph, compiled once).
    Raises ValueError for a model without LoRA layers (its "base" would be the policy itself)."""
    layers = list(lora_layers(model).values())
    if not layers:
        raise ValueError(f"adapters_off: {type(model).__name__} has no LoRA adapters (train.lora_rank = 0)")
    enabled = [not layer.disable_adapters for layer in layers]
    trainable = [(p, p.requires_grad) for layer in layers for p in layer.parameters()]

    def restore_requires_grad() -> None:
        for p, flag in trainable:
            if p.requires_grad != flag:
                p.requires_grad_(flag)

    try:
        for layer in layers:
            layer.enable_adapters(False)
        restore_requires_grad()
        yield model
    finally:
        for layer, on in zip(layers, enabled):
            layer.enable_adapters(on)
        restore_requires_grad()


@contextlib.contextmanager
def frozen_base(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """`model` as its frozen base for the duration: adapters off and eval mode (as a frozen reference
    copy is: no dropout, no activation checkpointing); each module's mode and adapter state restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with adapters_off(model):
            yield model
    finally:
        for m, training in modes:
            m.training = training


def is_adapter_name(name: str) -> bool:
    """A LoRA adapter tensor (`...q_proj.lora_A.default.weight`)."""
    return any(part.startswith("lora_") for part in name.split("."))


def generator_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter, Optional[torch.nn.Module]]]:
    """(name, parameter, LoRA layer or None) of what the generators receive, in `named_parameters` order.

    A plain model: every parameter, layer None. A LoRA model: the BASE model's parameters under
    the base model's names (`...q_proj.base_layer.weight` -> `...q_proj.weight`), each adapted
    weight with the LoRA layer whose update merges into it (`merged_weight`); adapter tensors are
    not listed."""
    layers = lora_layers(model)
    if not layers:
        return [(n, p, None) for n, p in model.named_parameters()]
    out = []
    for name, p in model.named_parameters():
        if is_adapter_name(name):
            continue
        owner, _, leaf = name.rpartition(".")
        if owner.endswith(".base_layer") and owner[: -len(".base_layer")] in layers:
            parent = owner[: -len(".base_layer")]
            out.append((f"{parent}.{leaf}", p, layers[parent] if leaf == "weight" else None))
        else:
            out.append((name, p, None))
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def merged_weight(weight: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    """W + scaling x (B @ A) of one LoRA layer, a new tensor (the trained ones are not modified).

    `weight` is the base weight, full (already gathered); the layer's lora_A / lora_B are
    gathered here (`full_tensor()`, a collective under FSDP2: call it on every learner rank, in
    the same order). Computed in fp32 (as peft's merge on CPU) and returned in `weight`'s dtype;
    for fp32 weights it is bit for bit peft's `merge`: W + (B @ A) x scaling."""
    a = _full(layer.lora_A[ADAPTER].weight)
    b = _full(layer.lora_B[ADAPTER].weight)
    scaling = layer.scaling[ADAPTER]
    with torch.no_grad():
        w = weight.detach()
        merged = w.float() + (b.detach().float() @ a.detach().float()) * scaling
        return merged.to(w.dtype)


def trainable_parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# ---------------------------------------------------------------------------------------------
# checkpoints and export
def _peft_config(model: torch.nn.Module):
    cfg = getattr(model, "peft_config", None)
    return cfg.get(ADAPTER) if isinstance(cfg, dict) else None


def write_adapter_config(model: torch.nn.Module, out_dir: Path) -> bool:
    """peft's adapter_config.json of `model`'s adapter into `out_dir` (False, nothing written, for a plain model)."""
    config = _peft_config(model)
    if config is None:
        return False
    config = copy.deepcopy(config)
    config.inference_mode = True  # as PeftModel.save_pretrained writes it
    if isinstance(config.target_modules, (set, frozenset)):  # "all-linear", expanded by peft: a stable order
        config.target_modules = sorted(config.target_modules)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out_dir))
    return True


def read_adapter_config(hf_dir: Path):
    """The LoraConfig stored in a checkpoint's hf/ directory (`write_adapter_config`), or None."""
    path = Path(hf_dir) / ADAPTER_DIR
    if not (path / "adapter_config.json").is_file():
        return None
    from peft import LoraConfig

    config = LoraConfig.from_pretrained(str(path))
    config.inference_mode = False
    return config


def save_adapter(model: torch.nn.Module, out_dir: Path, base_model_name_or_path: Optional[str] = None) -> Path:
    """The adapter of a (plain, unsharded) LoRA model in peft's files, as `PeftModel.save_pretrained`
    writes them: adapter_config.json + adapter_model.safetensors, keys `base_model.model.<module>.lora_A.weight`
    (loadable with `PeftModel.from_pretrained(base, out_dir)`)."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    state = get_peft_model_state_dict(model, adapter_name=ADAPTER)
    state = {f"base_model.model.{k}": v.detach().contiguous().clone() for k, v in state.items()}
    write_adapter_config(model, out_dir)
    if base_model_name_or_path is not None:
        path = out_dir / "adapter_config.json"
        meta = json.loads(path.read_text())
        meta["base_model_name_or_path"] = str(base_model_name_or_path)
        path.write_text(json.dumps(meta, indent=2, sort_keys=True))
    save_file(state, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out_dir


def merge_into_base(model: torch.nn.Module) -> torch.nn.Module:
    """Replace every LoRA layer of a plain (unsharded) model by its base layer holding the merged
    weight (`merged_weight`), in place: the result is the plain transformers model. For export."""
    for name, layer in sorted(lora_layers(model).items(), key=lambda kv: -kv[0].count(".")):
        base = layer.get_base_layer()
        merged = merged_weight(base.weight, layer)
        base.weight = torch.nn.Parameter(merged, requires_grad=False)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, base)
    if "peft_config" in vars(model):  # set by the injection (an instance attribute)
        del model.peft_config
    return model


def named_adapter_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, parameter) of the adapter tensors (what a LoRA learner trains)."""
    for name, p in model.named_parameters():
        if is_adapter_name(name):
            yield name, p
