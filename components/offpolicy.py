"""Off-policy schemes (registry `OFF_POLICY`): they decide the trainer's control flow only.

PAPER.md §5:
- ``ppo_off_policy(k)``: the generators make k x batch prompts with FROZEN weights; the
  learner then takes k steps on k mini-batches of `prompts_per_step` prompts; then the
  weights sync. The last mini-batch is up to k-1 versions stale. k=1 is synchronous
  on-policy training.
- ``pipeline_rl(k)``: the generators never stop; after every learner step the new weights
  go to the generators IN FLIGHT (a sequence continues with its stale KV cache, so one
  completion spans versions). The learner never trains on a token more than k versions
  old: learner version - oldest token version <= k.

How the trainer enforces the pipeline_rl bound (documented choice):
1. The learner keeps at most ``inflight_batches`` (default k) batches of prompts ordered
   ahead of what it has consumed, so the generators run at most about k versions ahead.
2. The learner WAITS (blocks) while the generator has not yet loaded a version within k of
   its own (the generator reports its loaded version with every group).
3. A group whose oldest token is nevertheless more than k versions old when the learner
   would train on it is DROPPED (never trained on; counted as `stale_dropped`) and its
   prompt is re-ordered. So "never more than k versions old" holds by construction, and
   the metric `lag_max` in metrics.jsonl shows it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from components.registry import OFF_POLICY

__all__ = ["OffPolicyScheme", "ppo_off_policy", "pipeline_rl", "token_lag", "is_too_stale"]


@dataclass(frozen=True)
class OffPolicyScheme:
    """What the trainer needs to know about the control flow."""

    name: str
    k: int  # ppo_off_policy: learner steps per generation round; pipeline_rl: max lag in versions
    streaming: bool  # True: generators never stop and get weights in flight
    inflight_batches: int = 1  # pipeline_rl: batches of prompts ordered ahead of the learner

    def __post_init__(self):
        if int(self.k) != self.k or self.k < 1:
            raise ValueError(f"{self.name}: k must be an integer >= 1, got {self.k!r}")
        if self.inflight_batches < 1:
            raise ValueError(f"{self.name}: inflight_batches must be >= 1, got {self.inflight_batches!r}")

    @property
    def prompts_per_round_factor(self) -> int:
        """ppo_off_policy generates k batches per round with frozen weights."""
        return self.k if not self.streaming else 1


@OFF_POLICY.register("ppo_off_policy", ranges={"k": ">= 1"})
def ppo_off_policy(k: int = 1) -> OffPolicyScheme:
    """PPO-off-policy-k: generate k x batch with frozen weights, then k learner steps, then sync (k=1: synchronous)."""
    return OffPolicyScheme(name="ppo_off_policy", k=int(k), streaming=False, inflight_batches=1)


@OFF_POLICY.register("pipeline_rl", ranges={"k": ">= 1", "inflight_batches": ">= 1"})
def pipeline_rl(k: int = 8, inflight_batches: Optional[int] = None) -> OffPolicyScheme:
    """PipelineRL-k: streaming generation, in-flight weight updates, never train on a token > k versions old.

    inflight_batches (default: k) bounds how many batches of prompts the generators run ahead
    of the learner. At the default, generation is throttled only by k itself, as in the paper
    (the learner waits when it is k versions ahead); a smaller value throttles the generators
    further, and the observed lag then stays at about inflight_batches.
    """
    ahead = int(k) if inflight_batches is None else int(inflight_batches)
    return OffPolicyScheme(name="pipeline_rl", k=int(k), streaming=True, inflight_batches=ahead)


def token_lag(learner_version: int, token_versions: Sequence[int]) -> int:
    """Learner version minus the oldest version among the tokens (0 when empty)."""
    if len(token_versions) == 0:
        return 0
    return int(learner_version) - int(min(token_versions))


def is_too_stale(learner_version: int, oldest_token_version: int, k: int) -> bool:
    """pipeline_rl(k) must never train on a token more than k versions old."""
    return int(learner_version) - int(oldest_token_version) > int(k)
