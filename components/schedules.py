"""Learning-rate schedules (registry `LR_SCHEDULES`), chosen by ``train.lr_schedule``.

Every schedule has one signature::

    schedule(update, warmup_steps, total_steps) -> factor   # the LR of update `update` is train.lr * factor

`update` counts optimizer updates from 0 (torch's LambdaLR calls it with 0 for the first one),
`warmup_steps` is ``train.warmup_steps`` and `total_steps` is ``train.total_steps``. Every
schedule shares the paper's linear warmup: factor (update + 1) / warmup_steps while
update < warmup_steps (the first update already takes 1 / warmup_steps of the LR), then

    constant: 1                                                  (the paper's schedule; the default)
    linear:   (total - update) / (total - warmup)                 1 at the end of warmup, 0 at total_steps
    cosine:   (1 + cos(pi * (update - warmup) / (total - warmup))) / 2    likewise

The decays stay at 0 past total_steps; a warmup as long as the run (total <= warmup) leaves no
decay, its denominator is taken as 1.
"""

from __future__ import annotations

import math

from components.registry import LR_SCHEDULES

__all__ = ["warmup_factor", "constant", "linear", "cosine"]


def warmup_factor(update: int, warmup_steps: int) -> float:
    """(update + 1) / warmup_steps during the warmup, 1 after it (and with no warmup)."""
    warm = max(int(warmup_steps), 0)
    return 1.0 if warm == 0 else min(1.0, (update + 1) / warm)


def _decay_progress(update: int, warmup_steps: int, total_steps: int) -> float:
    """The fraction of the decay done at `update`, in [0, 1]: 0 at the end of warmup, 1 at total_steps."""
    warm = max(int(warmup_steps), 0)
    span = max(int(total_steps) - warm, 1)
    return min(max((update - warm) / span, 0.0), 1.0)


@LR_SCHEDULES.register("constant")
def constant(update: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warmup, then the constant LR (the paper's schedule)."""
    return warmup_factor(update, warmup_steps)


@LR_SCHEDULES.register("linear")
def linear(update: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warmup, then linear decay to 0 at train.total_steps."""
    if update < warmup_steps:
        return warmup_factor(update, warmup_steps)
    return 1.0 - _decay_progress(update, warmup_steps, total_steps)


@LR_SCHEDULES.register("cosine")
def cosine(update: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warmup, then cosine decay to 0 at train.total_steps."""
    if update < warmup_steps:
        return warmup_factor(update, warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * _decay_progress(update, warmup_steps, total_steps)))
