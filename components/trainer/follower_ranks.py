"""Learner ranks 1..T-1 as learner-0's training loop drives them (split from loop.py)."""

from __future__ import annotations

import time
from typing import Sequence

from components.trainer import messages as M
from components.trainer.inbox import GeneratorError, Inbox, PeerSender

__all__ = ["FollowerRanks", "GeneratorError"]


class FollowerRanks:
    """Learner ranks 1..T-1 seen from rank 0 (`learner.StepPeers`): each gets its shard by message,
    trains it in the same collectives (worker.py), and reports its partial result back.

    `followers`: their names, rank order; `hub`: sends to them; `inbox`: where their `StepDone`
    answers are filed (`step_parts`, filled by `inbox.pump`); `timeout_s`: train.queue_timeout_s."""

    def __init__(self, followers: Sequence[str], hub: PeerSender, inbox: Inbox, timeout_s: float):
        self.followers = list(followers)
        self.hub = hub
        self.inbox = inbox
        self.timeout_s = timeout_s

    def send(self, shards) -> None:
        self.inbox.step_parts = {}
        for name, shard in zip(self.followers, shards):
            self.hub.send(name, M.TrainStep(shard))

    def gather(self) -> list[dict]:
        inbox = self.inbox
        deadline = time.monotonic() + self.timeout_s
        while len(inbox.step_parts) < len(self.followers):
            if time.monotonic() > deadline:
                raise GeneratorError(f"learner ranks did not report their step within {self.timeout_s}s")
            inbox.pump(1.0)
        return [inbox.step_parts[k] for k in range(1, len(self.followers) + 1)]

    def score_old(self, shards) -> None:
        """Have rank k compute pi_old of its micro-batches, shards[k - 1] (one list per mini-batch)."""
        self.inbox.step_parts = {}
        for name, shard in zip(self.followers, shards):
            self.hub.send(name, M.ScoreOld(shard))

    def gather_old(self) -> list[list]:
        """Their pi_old [b, T] per micro-batch of each mini-batch, in rank order."""
        return [part["old_logp"] for part in self.gather()]
