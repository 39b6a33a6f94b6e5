"""Atomic checkpoints: write to a temporary file, fsync, rename. A half-written file is never read.

A checkpoint holds everything to resume bit-for-bit on CPU: model, optimizer, scheduler,
every RNG state, curriculum state (pass-rate history included), step/version/order
counters, compute accounting and any rollouts generated but not yet trained on.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path
from typing import Optional

import numpy as np
import torch

__all__ = ["save_checkpoint", "latest_checkpoint", "load_checkpoint", "rng_state", "set_rng_state"]

_NAME = re.compile(r"^step_(\d{8})\.pt$")


def rng_state() -> dict:
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


def save_checkpoint(ckpt_dir: Path, step: int, state: dict, keep: int = 2) -> Path:
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    final = ckpt_dir / f"step_{step:08d}.pt"
    tmp = ckpt_dir / f".step_{step:08d}.pt.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    try:  # make the rename durable
        fd = os.open(ckpt_dir, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    except OSError:
        pass
    for old in _list(ckpt_dir)[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
    for stray in ckpt_dir.glob(".step_*.tmp*"):
        if stray != tmp:
            stray.unlink(missing_ok=True)
    return final


def _list(ckpt_dir: Path) -> list[Path]:
    if not Path(ckpt_dir).is_dir():
        return []
    found = [(int(m.group(1)), p) for p in Path(ckpt_dir).iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(ckpt_dir: Path) -> Optional[Path]:
    ckpts = _list(ckpt_dir)
    return ckpts[-1] if ckpts else None


def load_checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)
