"""Sharded, atomic checkpoints through torch.distributed.checkpoint (DCP), resumable at any learner world size.

One checkpoint is one directory, written by every learner rank into a hidden temporary
directory and published by rank 0 with a single rename, so a half-written checkpoint is
never read:

    RUN_DIR/checkpoints/
      .step_00000012.tmp/          being written (or left by a killed save: ignored, removed
                                   by the next save or by remove_stale_tmp)
      step_00000012/               complete (published by rename)
        dcp/.metadata              DCP: model + optimizer, keyed by Hugging Face FQNs
        dcp/__<r>_0.distcp         (one file per saving rank: its shards)
        trainer.pt                 rank 0: {"trainer_state", "scheduler_state"} (pickled)
        ranks/rank_00000.pt        every rank's own state (RNG ...), one file per rank
        hf/config.json             the learner model's config (untied for bf16_fp32_head),
        hf/generation_config.json  generation config and tokenizer files: a checkpoint is
        hf/tokenizer*.json ...     self-contained for `scalerl export`
        hf/adapter/adapter_config.json   LoRA runs only (train.lora_rank > 0): peft's LoraConfig
        checkpoint.json            written last: step, world size, format, torch version,
                                   the manifest (every file's size; crc32 of all but the
                                   tensor data) and the records the run's logs held

Intact: a published checkpoint can still be damaged later (a disk error, a truncated copy, a
hand edit). `verify_checkpoint` checks it against the manifest in checkpoint.json: every file
exists with its recorded size, and every file except the DCP tensor data (`dcp/*.distcp`)
has its recorded crc32. The tensor data gets sizes only: hashing it would read the whole
model and optimizer state once more at every save (DCP stores no checksums of its own), so a
same-size overwrite inside a shard is not detected; a truncated or missing shard is. Checking
costs one stat per file and reading the small files (trainer state, RNG, HF config,
tokenizer, DCP metadata). `select_resume_checkpoint` resumes from the newest checkpoint that
passes, warns naming each newer one that does not, and moves those aside
(`step_XXXXXXXX.corrupt`, never read or pruned); when no checkpoint passes it raises naming
every one with its problem. A checkpoint saved before manifests existed is checked for its
trainer state and DCP metadata only.

Model and optimizer state come from `torch.distributed.checkpoint.state_dict.get_state_dict`,
so their keys are the model's FQNs (the HF parameter names; optimizer state as
`optim.state.<fqn>.{step,exp_avg,exp_avg_sq}`) whatever the sharding: a checkpoint saved by
T ranks (FSDP2 DTensor shards) loads into T' ranks or into one plain module, and vice versa.
Tensors are stored in the dtype the learner holds them in (fp32 master weights and AdamW state).

Every rank must see the same RUN_DIR (one machine, or a shared filesystem across nodes).
`save_checkpoint` and `load_checkpoint` are collective over the learner group when
torch.distributed is initialised; without a process group (T = 1) they work in one process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
import warnings
import zlib
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from components.trainer.runlog import fsync_path as _fsync_path

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "checkpoint_steps",
    "read_checkpoint_info",
    "remove_stale_tmp",
    "verify_checkpoint",
    "newest_intact_checkpoint",
    "select_resume_checkpoint",
    "rng_state",
    "set_rng_state",
    "CheckpointError",
    "NoIntactCheckpointError",
    "FORMAT",
]

FORMAT = "scalerl-dcp-1"
INFO_FILE = "checkpoint.json"  # written last inside the tmp dir: its presence marks a complete checkpoint
DCP_DIR = "dcp"
HF_DIR = "hf"
RANKS_DIR = "ranks"
TRAINER_FILE = "trainer.pt"
BARRIER_TIMEOUT_S = 600.0
CORRUPT_SUFFIX = ".corrupt"  # a damaged checkpoint moved aside on resume (step_XXXXXXXX.corrupt)
_CRC_CHUNK = 8 << 20

log = logging.getLogger(__name__)

_DIR_NAME = re.compile(r"^step_(\d{8})$")
_TMP_NAME = re.compile(r"^\.step_(\d{8})\.(tmp|old)$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not fit the model it is loaded into."""


class NoIntactCheckpointError(CheckpointError):
    """A run has checkpoints but every one of them is damaged (each is named in the message)."""


# ---------------------------------------------------------------------------------------------
# RNG
def rng_state() -> dict:
    """This process's python, numpy, torch (and CUDA) RNG states."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------------------
# listing
def _step_dir_name(step: int) -> str:
    return f"step_{int(step):08d}"


def checkpoint_steps(ckpt_dir: Path) -> dict[int, Path]:
    """{step: directory} of the COMPLETE DCP checkpoints in `ckpt_dir`, by increasing step."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return {}
    found = {}
    for p in ckpt_dir.iterdir():
        m = _DIR_NAME.match(p.name)
        if m and p.is_dir() and (p / INFO_FILE).is_file():
            found[int(m.group(1))] = p
    return dict(sorted(found.items()))


def _all_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, by step."""
    return list(checkpoint_steps(ckpt_dir).items())


def latest_checkpoint(ckpt_dir: Path) -> Optional[Path]:
    """The newest complete checkpoint in `ckpt_dir` (a step_XXXXXXXX directory), or None.

    Temporary directories of an unfinished save and step directories without checkpoint.json
    are never returned. Read-only: it never deletes anything, so it is safe to call while a
    run is saving.
    """
    found = _all_checkpoints(ckpt_dir)
    return found[-1][1] if found else None


def read_checkpoint_info(path: Path) -> dict:
    """The checkpoint.json of a complete checkpoint directory; CheckpointError if there is none."""
    path = Path(path)
    info_path = path / INFO_FILE
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint directory at {path}")
    if not info_path.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no {INFO_FILE}); it was never published")
    try:
        info = json.loads(info_path.read_text())
    except (OSError, ValueError) as err:  # ValueError: not JSON, or not UTF-8
        raise CheckpointError(f"{info_path} cannot be read: {type(err).__name__}: {err}") from err
    if not isinstance(info, dict):
        raise CheckpointError(f"{info_path} is not a JSON object")
    if info.get("format") != FORMAT:
        raise CheckpointError(f"{path}: unknown checkpoint format {info.get('format')!r}; this code reads {FORMAT!r}")
    return info


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CRC_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _is_tensor_data(rel: str) -> bool:
    """DCP shard files: sizes only in the manifest (hashing them would re-read the whole state)."""
    return rel.startswith(f"{DCP_DIR}/") and rel.endswith(".distcp")


def build_manifest(root: Path) -> dict:
    """{relative path: {"size", "crc32" (not for DCP tensor data)}} of every file under `root`
    except checkpoint.json (which holds the manifest)."""
    root = Path(root)
    files = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if not p.is_file() or rel == INFO_FILE:
            continue
        entry = {"size": p.stat().st_size}
        if not _is_tensor_data(rel):
            entry["crc32"] = _crc32(p)
        files[rel] = entry
    return files


def verify_checkpoint(path: Path) -> dict:
    """checkpoint.json of `path` once every file of its manifest is there, of its size and crc32.

    CheckpointError names the first bad file and what is wrong with it. Cheap: a stat per file
    and a read of the small files (the DCP tensor data is checked by size only).
    """
    path = Path(path)
    info = read_checkpoint_info(path)
    files = info.get("files")
    if files is None:  # saved before manifests: what every load needs must at least be there
        files = {TRAINER_FILE: {}, f"{DCP_DIR}/.metadata": {}}
    for rel, entry in files.items():
        f = path / rel
        try:
            size = f.stat().st_size
        except OSError as err:
            raise CheckpointError(f"{f}: {type(err).__name__}: {err}") from err
        if "size" in entry and size != int(entry["size"]):
            raise CheckpointError(f"{f}: {size} bytes, but {INFO_FILE} recorded {entry['size']} (truncated or overwritten)")
        if "crc32" in entry:
            try:
                crc = _crc32(f)
            except OSError as err:
                raise CheckpointError(f"{f}: {type(err).__name__}: {err}") from err
            if crc != int(entry["crc32"]):
                raise CheckpointError(f"{f}: crc32 {crc:08x}, but {INFO_FILE} recorded {int(entry['crc32']):08x} (corrupt)")
    return info


def newest_intact_checkpoint(ckpt_dir: Path) -> tuple[Optional[Path], list[tuple[Path, str]]]:
    """(newest checkpoint that passes `verify_checkpoint`, [(path, problem)] of every newer one).

    (None, []) when `ckpt_dir` holds no complete checkpoint; CheckpointError naming every
    checkpoint and its problem when it holds some but none is intact. Reads only.
    """
    bad: list[tuple[Path, str]] = []
    for _step, path in reversed(_all_checkpoints(ckpt_dir)):
        try:
            verify_checkpoint(path)
        except CheckpointError as err:
            bad.append((path, str(err)))
            continue
        return path, bad
    if bad:
        listing = "; ".join(f"{p.name}: {why}" for p, why in bad)
        raise NoIntactCheckpointError(f"no intact checkpoint to resume from in {ckpt_dir}: {listing}")
    return None, []


def select_resume_checkpoint(ckpt_dir: Path) -> Optional[Path]:
    """The checkpoint a run resumes from: the newest intact one (None: start from scratch).

    Each newer, damaged checkpoint is named in a warning and moved aside to
    step_XXXXXXXX.corrupt, so that pruning never keeps it in place of a good one and the
    next resume does not read it again. Only the rank that owns the run directory calls it.
    """
    path, bad = newest_intact_checkpoint(ckpt_dir)
    for corrupt, why in bad:
        aside = corrupt.with_name(corrupt.name + CORRUPT_SUFFIX)
        n = 1
        while aside.exists():
            aside, n = corrupt.with_name(f"{corrupt.name}{CORRUPT_SUFFIX}{n}"), n + 1
        try:
            os.replace(corrupt, aside)
            where = f"moved aside to {aside}"
        except OSError as err:
            where = f"could not be moved aside ({type(err).__name__}: {err})"
        log.warning("checkpoint %s is corrupt (%s); resuming from %s instead; it was %s", corrupt, why, path.name, where)
    return path


def remove_stale_tmp(ckpt_dir: Path) -> list[Path]:
    """Delete what killed saves left behind (.step_*.tmp / .step_*.old directories).

    Only the rank that saves (rank 0) may call this, and never while a save is running.
    """
    removed = []
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return removed
    for p in ckpt_dir.iterdir():
        if _TMP_NAME.match(p.name):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


# ---------------------------------------------------------------------------------------------
# process group helpers
def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_world(group) -> tuple[int, int]:
    if not _dist_on():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns on every save/load without a process group; that is the intended T = 1 mode here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _barrier(group, timeout_s: float, what: str) -> None:
    """A barrier over the learner group that fails (naming the missing ranks on gloo) instead of hanging."""
    if not _dist_on() or dist.get_world_size(group) == 1:
        return
    if dist.get_backend(group) == "gloo":
        try:
            dist.monitored_barrier(group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
        except RuntimeError as err:
            raise CheckpointError(f"checkpoint barrier '{what}' failed after <= {timeout_s:.0f} s: {err}") from err
    else:  # NCCL: the process group's own timeout (and its watchdog) bounds the wait
        dist.barrier(group)


# ---------------------------------------------------------------------------------------------
# small durable files


def _save_torch(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath))


def _write_hf_files(model: torch.nn.Module, tokenizer, hf_dir: Path) -> None:
    """config.json (+ generation config, tokenizer files) as the learner's model has them."""
    hf_dir.mkdir(parents=True, exist_ok=True)
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        raise CheckpointError(f"{type(model).__name__} has no Hugging Face config to store in the checkpoint")
    config.save_pretrained(hf_dir)
    gen = getattr(model, "generation_config", None)
    if gen is not None and hasattr(gen, "save_pretrained"):
        gen.save_pretrained(hf_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(hf_dir)
    from components.trainer.lora import ADAPTER_DIR, write_adapter_config

    write_adapter_config(model, hf_dir / ADAPTER_DIR)  # a LoRA learner's LoraConfig (export merges with it); else nothing


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished tmp dir to its final name (replacing an older copy of the same step)."""
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_path(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _prune(ckpt_dir: Path, keep: int) -> None:
    if keep <= 0:
        return
    for _step, p in _all_checkpoints(ckpt_dir)[:-keep]:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# save / load
def save_checkpoint(
    ckpt_dir: Path,
    step: int,
    *,
    model: Optional[torch.nn.Module] = None,
    optimizer: Optional[torch.optim.Optimizer] = None,
    scheduler_state: Optional[dict] = None,
    trainer_state: Optional[dict] = None,
    rank_state: Optional[dict] = None,
    keep: int = 2,
    tokenizer=None,
    logs: Optional[dict] = None,
    group=None,
    timeout_s: float = BARRIER_TIMEOUT_S,
) -> Path:
    """Write checkpoint `step` into `ckpt_dir` atomically; returns `ckpt_dir/step_XXXXXXXX`.

    Collective: every rank of the learner group (default group unless `group`) calls it with
    its own `model` (FSDP2-sharded or plain) and `optimizer`, and its own `rank_state`
    (picklable, e.g. {"rng": rng_state()}). Rank 0's `trainer_state` (curriculum, counters,
    pending rollouts, compute: a picklable dict) and `scheduler_state` are stored; other ranks'
    are ignored. `tokenizer` (rank 0) is stored beside the HF config. `keep` > 0 keeps only
    the newest `keep` checkpoints. Every wait is bounded by `timeout_s`. `logs` (rank 0:
    {file name: {"records", "last_step"}} of the run's logs, already fsynced) goes into
    checkpoint.json, so a resume can tell whether a log lost records the checkpoint counts on.
    checkpoint.json, written last, also holds the manifest `verify_checkpoint` checks.
    """
    if model is None:
        raise TypeError("save_checkpoint needs model= (and optimizer=)")
    step = int(step)
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    ckpt_dir = Path(ckpt_dir)
    rank, world = _rank_world(group)
    tmp = ckpt_dir / f".{_step_dir_name(step)}.tmp"
    final = ckpt_dir / _step_dir_name(step)
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_tmp(ckpt_dir)  # a killed save's leftovers (saves of one run never overlap)
        (tmp / DCP_DIR).mkdir(parents=True)
        (tmp / RANKS_DIR).mkdir()
    _barrier(group, timeout_s, f"create {tmp.name}")

    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    opt_kind = _optimizer_kind(optimizer)
    msd, osd = _model_state(model, optimizer if opt_kind == "full" else None)
    state = {"model": msd} if osd is None else {"model": msd, "optim": osd}
    try:
        with _quiet_single_process():
            dcp_save(state, storage_writer=FileSystemWriter(tmp / DCP_DIR), process_group=group, no_dist=not _dist_on())
    except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
        raise CheckpointError(f"rank {rank}: saving {tmp} failed: {_describe(err)}") from err
    _save_torch(tmp / RANKS_DIR / f"rank_{rank:05d}.pt", rank_state)
    _barrier(group, timeout_s, f"write {tmp.name}")

    if rank == 0:
        groups = None
        if opt_kind == "empty":  # no AdamW state yet: keep the hyperparameters only
            groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        _save_torch(tmp / TRAINER_FILE, {"trainer_state": trainer_state, "scheduler_state": scheduler_state,
                                         "empty_optimizer_param_groups": groups})
        _write_hf_files(model, tokenizer, tmp / HF_DIR)
        _fsync_tree(tmp)
        info = {
            "format": FORMAT,
            "step": step,
            "world_size": world,
            "optimizer": opt_kind,
            "has_tokenizer": tokenizer is not None,
            "torch": torch.__version__,
            "logs": logs,
            "files": build_manifest(tmp),
        }
        with open(tmp / INFO_FILE, "w") as f:
            json.dump(info, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_path(tmp)
        _publish(tmp, final)
        _prune(ckpt_dir, keep)
    _barrier(group, timeout_s, f"publish {final.name}")
    return final


def _describe(err: BaseException) -> str:
    """One line per failing rank from DCP's CheckpointException (which carries every rank's exception)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for r, f in sorted(failures.items()):
            exc = f[0] if isinstance(f, tuple) else f
            parts.append(f"rank {r}: {type(exc).__name__}: {exc}")
        return "; ".join(parts)
    return f"{type(err).__name__}: {err}"


def _load_torch(path: Path) -> Any:
    """torch.load of one of the checkpoint's pickles; CheckpointError naming the file if it cannot be read."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001 - zip, unpickling and I/O errors alike: name the file
        raise CheckpointError(f"{path} cannot be read: {type(err).__name__}: {err}") from err


def _optimizer_kind(optimizer) -> str:
    """"none" (no optimizer), "empty" (no step taken yet: no state) or "full"."""
    if optimizer is None:
        return "none"
    return "full" if optimizer.state else "empty"


def _model_state(model, optimizer):
    """(model state dict, optimizer state dict or None), FQN-keyed, sharded as the model is.

    For an optimizer WITHOUT state, get_state_dict runs one optimizer step with zero grads and
    lr 0 (DCP's own initialisation, so that the state has shapes to load into); that creates
    AdamW state with step = 1. Only call it with an optimizer whose state is about to be
    overwritten by a load, or that already has state (a save must not change training).
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return get_model_state_dict(model), None
    return get_state_dict(model, optimizer)


def load_checkpoint(
    path: Path,
    *,
    model: Optional[torch.nn.Module] = None,
    optimizer: Optional[torch.optim.Optimizer] = None,
    group=None,
    timeout_s: float = BARRIER_TIMEOUT_S,
) -> dict:
    """Load checkpoint directory `path` into `model` and `optimizer` in place (collective).

    Works at any learner world size: DCP reads, on each rank, the parts of the stored
    tensors its shards cover. Returns {"step", "world_size" (of the save), "trainer_state",
    "scheduler_state", "rank_state"}; "rank_state" is this rank's saved dict, or None when the
    checkpoint was saved by fewer ranks than this rank's index.
    """
    path = Path(path)
    if model is None:
        raise TypeError(f"load_checkpoint({path}) needs model= (and optimizer=) for a DCP checkpoint directory")
    info = verify_checkpoint(path)
    saved_opt = info["optimizer"]
    if optimizer is not None and saved_opt == "none":
        raise CheckpointError(f"{path} was saved without an optimizer; pass optimizer=None to load the weights only")
    rank, _world = _rank_world(group)

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    msd, osd = _model_state(model, optimizer if saved_opt == "full" else None)
    state = {"model": msd} if osd is None else {"model": msd, "optim": osd}
    try:
        with _quiet_single_process():
            dcp_load(state, storage_reader=FileSystemReader(path / DCP_DIR), process_group=group, no_dist=not _dist_on())
    except (Exception, CheckpointException) as err:  # DCP names the missing/mismatching keys; say which checkpoint
        raise CheckpointError(f"cannot load {path} into {type(model).__name__}: {_describe(err)}") from err
    if osd is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    trainer = _load_torch(path / TRAINER_FILE)
    if optimizer is not None and saved_opt == "empty":  # saved before its first step: a fresh optimizer
        optimizer.state.clear()
        for g, saved in zip(optimizer.param_groups, trainer["empty_optimizer_param_groups"]):
            g.update(saved)
    rank_file = path / RANKS_DIR / f"rank_{rank:05d}.pt"
    rank_state = _load_torch(rank_file) if rank_file.is_file() else None
    _barrier(group, timeout_s, f"load {path.name}")
    return {
        "step": int(info["step"]),
        "world_size": int(info["world_size"]),
        "trainer_state": trainer["trainer_state"],
        "scheduler_state": trainer["scheduler_state"],
        "rank_state": rank_state,
    }
