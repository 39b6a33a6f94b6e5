"""Learner ranks 1..T-1 as learner-0's training loop drives them (split from loop.py)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from components.trainer import messages as M

if TYPE_CHECKING:
    from components.trainer.loop import Trainer

__all__ = ["FollowerRanks", "GeneratorError"]


class GeneratorError(RuntimeError):
    """A generator (or another process of the run) failed; its traceback is in the message."""


class FollowerRanks:
    """Learner ranks 1..T-1 seen from rank 0 (`learner.StepPeers`): each gets its shard by message,
    trains it in the same collectives (worker.py), and reports its partial result back.

    `trainer`: learner-0's Trainer, of which it uses the hub (`hub.send`), the follower names
    (`followers`), the partial results the message handler files (`step_parts`), the message pump
    (`_pump`) and train.queue_timeout_s."""

    def __init__(self, trainer: "Trainer"):
        self.trainer = trainer

    def send(self, shards) -> None:
        t = self.trainer
        t.step_parts = {}
        for name, shard in zip(t.followers, shards):
            t.hub.send(name, M.TrainStep(shard))

    def gather(self) -> list[dict]:
        t = self.trainer
        deadline = time.monotonic() + t.cfg.queue_timeout_s
        while len(t.step_parts) < len(t.followers):
            if time.monotonic() > deadline:
                raise GeneratorError(f"learner ranks did not report their step within {t.cfg.queue_timeout_s}s")
            t._pump(1.0)
        return [t.step_parts[k] for k in range(1, len(t.followers) + 1)]

    def score_old(self, shards) -> None:
        """Have rank k compute pi_old of its micro-batches, shards[k - 1] (one list per mini-batch)."""
        t = self.trainer
        t.step_parts = {}
        for name, shard in zip(t.followers, shards):
            t.hub.send(name, M.ScoreOld(shard))

    def gather_old(self) -> list[list]:
        """Their pi_old [b, T] per micro-batch of each mini-batch, in rank order."""
        return [part["old_logp"] for part in self.gather()]
