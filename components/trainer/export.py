"""A run's policy in Hugging Face format (`scalerl export`, experiments/export.py; and the
trainer's `RUN_DIR/final/`).

Reads the model weights of one checkpoint (`RUN_DIR/checkpoints/step_XXXXXXXX/`, written by
components.trainer.checkpoint with torch.distributed.checkpoint, sharded over any number of
learner ranks) in ONE process, builds the transformers model from the config stored in the
checkpoint, and writes it with `save_pretrained`:

    OUT/config.json             the learner's config (untied LM head for bf16_fp32_head)
    OUT/model.safetensors       every tensor in the master-weight dtype (fp32)
    OUT/generation_config.json
    OUT/tokenizer*.json, chat_template.jinja ...   the tokenizer stored in the checkpoint

The result loads with `AutoModelForCausalLM.from_pretrained(OUT, local_files_only=True)` and
with vLLM (`LLM(model=OUT)`). `write_final_policy(RUN_DIR)` does the same into
`RUN_DIR/final/` at the end of a run (atomic: a tmp directory renamed into place).

A LoRA run (train.lora_rank > 0; its checkpoint holds base + adapters and hf/adapter/adapter_config.json)
exports the MERGED model, W + (lora_alpha / r) B A in every adapted layer, as the plain model above
(no peft needed to load it), and the adapter itself in peft's format:

    OUT/adapter/adapter_config.json, adapter_model.safetensors   PeftModel.from_pretrained(base, OUT/adapter)

Memory: the full model is held once in CPU memory in its stored dtype (4 bytes per parameter
for fp32 master weights); the optimizer state is not read.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Optional

from components.trainer.checkpoint import (
    DCP_DIR,
    HF_DIR,
    CheckpointError,
    checkpoint_steps,
    newest_intact_checkpoint,
    read_checkpoint_info,
)
from components.trainer.lora import ADAPTER, ADAPTER_DIR, read_adapter_config

__all__ = ["ExportError", "FINAL_DIR", "resolve_checkpoint", "load_policy", "export_policy", "write_final_policy"]

FINAL_DIR = "final"
# files of the checkpoint's hf/ directory that save_pretrained writes itself
_WRITTEN_BY_SAVE_PRETRAINED = {"config.json"}


class ExportError(RuntimeError):
    """Nothing to export: no such run, no checkpoint, no such step, or an unusable checkpoint."""


# ---------------------------------------------------------------------------------------------
def resolve_checkpoint(run_or_checkpoint: str | os.PathLike, step: Optional[int] = None) -> Path:
    """The checkpoint directory to export.

    `run_or_checkpoint` is a run directory (its `checkpoints/`), a checkpoints directory, or
    one checkpoint directory (`.../step_XXXXXXXX`). Without `step` the newest intact checkpoint
    (`verify_checkpoint`; a damaged newer one is named in a warning) is taken. Raises ExportError naming the available steps when `step` is absent.
    """
    path = Path(run_or_checkpoint)
    if not path.is_dir():
        raise ExportError(f"no such run or checkpoint directory: {path}")
    if (path / "checkpoint.json").is_file():  # one checkpoint
        info = _info(path)
        if step is not None and int(step) != int(info["step"]):
            raise ExportError(f"{path} is the checkpoint of step {info['step']}, not step {step}")
        return path
    ckpt_dir = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    steps = checkpoint_steps(ckpt_dir)
    if not steps:
        legacy = sorted(p.name for p in ckpt_dir.glob("step_*.pt"))
        hint = (f"; it holds only legacy single-file checkpoints ({', '.join(legacy)}), which are not self-contained"
                if legacy else "; a run writes one every train.checkpoint_every steps and at its end")
        raise ExportError(f"{path} has no complete checkpoint (looked in {ckpt_dir}){hint}")
    if step is None:  # the newest that passes its manifest check; a damaged newer one is named
        try:
            newest, bad = newest_intact_checkpoint(ckpt_dir)
        except CheckpointError as err:
            raise ExportError(str(err)) from None
        for corrupt, why in bad:
            warnings.warn(f"skipping damaged checkpoint {corrupt}: {why}", stacklevel=2)
        return newest if newest is not None else steps[max(steps)]
    if int(step) not in steps:
        raise ExportError(f"no checkpoint for step {step} in {ckpt_dir}; available steps: {', '.join(map(str, steps))}")
    return steps[int(step)]


def _info(checkpoint: Path) -> dict:
    try:
        return read_checkpoint_info(checkpoint)
    except CheckpointError as err:
        raise ExportError(str(err)) from err


def load_policy(checkpoint: str | os.PathLike):
    """The transformers model of one checkpoint directory, on CPU, in one process (no process group).

    Tensors keep the widest dtype stored among the model's floating tensors (fp32 for fp32
    master weights; a legacy bf16 body + fp32 head is upcast to fp32, losslessly). Tied
    embeddings are tied again (both stored copies must be equal). A LoRA checkpoint gives the
    plain model with the adapters merged into its weights.
    """
    from components.trainer.lora import merge_into_base

    return merge_into_base(_load_stored_model(checkpoint))


def _load_stored_model(checkpoint: str | os.PathLike):
    """`load_policy` before merging: a LoRA checkpoint's model still carries its adapters (peft layers)."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load
    from transformers import AutoConfig, AutoModelForCausalLM

    checkpoint = Path(checkpoint)
    _info(checkpoint)
    hf_dir = checkpoint / HF_DIR
    if not (hf_dir / "config.json").is_file():
        raise ExportError(f"{checkpoint} has no {HF_DIR}/config.json; it cannot be exported")
    config = AutoConfig.from_pretrained(str(hf_dir), local_files_only=True)

    reader = FileSystemReader(checkpoint / DCP_DIR)
    stored = {k[len("model."):]: md for k, md in reader.read_metadata().state_dict_metadata.items() if k.startswith("model.")}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    lora = read_adapter_config(hf_dir)
    if lora is not None:  # the learner's adapters, injected as it injected them (lora.apply_lora), empty
        from peft import inject_adapter_in_model

        inject_adapter_in_model(lora, model, adapter_name=ADAPTER, low_cpu_mem_usage=True)
    wanted = set(model.state_dict())
    missing, unexpected = sorted(wanted - set(stored)), sorted(set(stored) - wanted)
    if missing or unexpected:
        raise ExportError(
            f"{checkpoint}: the stored weights do not fit {type(model).__name__} built from its config "
            f"(missing {missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]})"
        )
    state = {k: torch.empty(tuple(stored[k].size), dtype=stored[k].properties.dtype) for k in wanted}
    with warnings.catch_warnings():  # DCP warns that there is no process group: one process is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp_load({"model": state}, storage_reader=reader, no_dist=True)

    dtype = _widest_float_dtype(state.values())
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    tied = bool(getattr(config.get_text_config() if hasattr(config, "get_text_config") else config, "tie_word_embeddings", False))
    if tied:  # both names are stored (one tensor at save time): they must agree before re-tying
        head_w, emb_w = model.get_output_embeddings().weight, model.get_input_embeddings().weight
        params = list(model.named_parameters(remove_duplicate=False))
        keys = [n for n, p in params if p is head_w or p is emb_w]
        for k in keys[1:]:
            if not torch.equal(state[keys[0]], state[k]):
                raise ExportError(f"{checkpoint}: the config ties the embeddings but stored {keys[0]} != {k}")
    model.load_state_dict(state, assign=True, strict=True)
    if tied:
        model.tie_weights()
    model.config.dtype = dtype
    model.eval()
    return model


def _widest_float_dtype(tensors):
    import torch

    dtypes = {t.dtype for t in tensors if t.is_floating_point()}
    for dt in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        if dt in dtypes:
            return dt
    return torch.float32


def _write_export(checkpoint: Path, out: Path) -> None:
    """save_pretrained of the checkpoint's policy + its tokenizer files into `out` (must not exist);
    a LoRA checkpoint: the merged model, and the adapter in `out/adapter/` (peft's files)."""
    from components.trainer.lora import is_lora, merge_into_base, save_adapter

    model = _load_stored_model(checkpoint)
    hf_dir = checkpoint / HF_DIR
    out.mkdir(parents=True)
    if is_lora(model):
        base = read_adapter_config(hf_dir).base_model_name_or_path
        save_adapter(model, out / ADAPTER_DIR, base_model_name_or_path=base)
        merge_into_base(model)
    model.save_pretrained(str(out))
    for f in sorted(hf_dir.iterdir()):  # tokenizer files and the learner's generation config
        if f.is_file() and f.name not in _WRITTEN_BY_SAVE_PRETRAINED:
            shutil.copy2(f, out / f.name)
    if not any(out.glob("tokenizer*")):
        raise ExportError(f"{checkpoint} holds no tokenizer files (saved without tokenizer=); {out} would not load in vLLM")


def export_policy(run_or_checkpoint: str | os.PathLike, out_dir: str | os.PathLike, *, step: Optional[int] = None,
                  overwrite: bool = False) -> Path:
    """Write the policy of a run's checkpoint (newest, or `step`) to `out_dir` in HF format; returns out_dir.

    Atomic: written to a hidden sibling tmp directory, then renamed. An existing non-empty
    `out_dir` is refused unless `overwrite`.
    """
    checkpoint = resolve_checkpoint(run_or_checkpoint, step)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ExportError(f"{out} exists and is not empty; choose another OUT or pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    old = out.with_name(f".{out.name}.old")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    try:
        _write_export(checkpoint, tmp)
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return out


def write_final_policy(run_dir: str | os.PathLike) -> Path:
    """`RUN_DIR/final/` from the run's newest checkpoint (replacing an older final/); returns its path."""
    run_dir = Path(run_dir)
    return export_policy(run_dir, run_dir / FINAL_DIR, overwrite=True)
