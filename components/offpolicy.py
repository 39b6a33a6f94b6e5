"""Off-policy schemes (registry `OFF_POLICY`): objects that own the trainer's control flow.

The trainer's loop (components/trainer/loop.py) is generic: it orders prompts, receives
finished groups, trains, pushes weights, evaluates and checkpoints. Whenever it has a choice
to make, it asks the run's scheme, and it never looks at the scheme's name. The decision
points, in the order a learner step meets them:

    method                          decides                                       called by
    ------------------------------  --------------------------------------------  ----------------
    batches(s)                      may the learner train, and on which batches    learner-0 (loop)
                                    ([] : it waits for more groups)
    usable(version, group)          which finished groups it may train on         learner-0 (loop)
                                    (False: dropped, counted as `stale_dropped`)
    prompts_to_order(s)             may the generators start more prompts, and    learner-0 (loop)
                                    how many (while the learner waits, and right
                                    after each step)
    start_version(s)                the oldest weight version a new batch may     learner-0 (loop)
                                    start from (older: weights are pushed first)
    order_seed(s)                   the sampling seed of an order                 learner-0 (loop)
    groups_to_await(s)              how many groups the learner receives before   learner-0 (loop)
                                    it asks `batches` again (they are handed over
                                    in order-id order)
    push_after_step(s)              do new weights go out after every step         learner-0 (loop)
    takes_weights_mid_sequence()    are pushed weights loaded between two decode   generator-i
                                    steps (True) or after the in-flight
                                    sequences finish (False)

`s` is a `LoopState`: a read-only snapshot of everything the loop knows (steps, versions,
the groups received and not yet trained on, the prompts in flight). A scheme keeps no state
of its own: what it decides from is the loop's, which the checkpoint holds, so a resumed run
decides exactly as the uninterrupted one would.

The shipped schemes (PAPER.md §5):
- ``ppo_off_policy(k)``: the generators make k x batch prompts with FROZEN weights; the
  learner then takes k steps on k mini-batches of `prompts_per_step` prompts; then the
  weights sync. The last mini-batch is up to k-1 versions stale. k=1 is synchronous
  on-policy training.
- ``pipeline_rl(k, inflight_batches)``: the generators never stop; after every learner step
  the new weights go to the generators IN FLIGHT (a sequence continues with its stale KV
  cache, so one completion spans versions). The learner never trains on a token more than k
  versions old: learner version - oldest token version <= k. It enforces that bound so:
  1. the learner keeps at most ``inflight_batches`` (default k) batches of prompts ordered
     ahead of what it has consumed, so the generators run at most about k versions ahead;
  2. a group whose oldest token is nevertheless more than k versions old when the learner
     would train on it is DROPPED (never trained on; counted as `stale_dropped`) and
     replaced by a new order. So "never more than k versions old" holds by construction,
     and the metric `lag_max` in metrics.jsonl shows it.

docs/adding_an_off_policy_scheme.md writes a scheme of one's own (`bounded_async`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np

from components.registry import OFF_POLICY

__all__ = ["LoopState", "OffPolicyScheme", "PpoOffPolicy", "PipelineRL", "ppo_off_policy", "pipeline_rl",
           "make_scheme", "derive_seed"]


def derive_seed(*parts: int) -> int:
    """A 31-bit seed that depends only on `parts` (never on process history)."""
    return int(np.random.default_rng([int(p) for p in parts]).integers(0, 2**31 - 1))


@dataclass(frozen=True)
class LoopState:
    """What the loop shows a scheme at a decision point (a snapshot; changing it changes nothing).

    `pending` holds `components.trainer.rollout.Rollout` groups: each has `order_id`,
    `min_version` (the oldest weight version among its sampled tokens), `engine_version` (the
    generator's version when it finished), `generator`, `rewards` and `completions`.
    """

    step: int  # learner steps taken so far
    total_steps: int  # train.total_steps
    prompts_per_step: int  # P: prompts (groups) in one learner step's batch
    learner_version: int  # the learner's weight version (one more per optimizer step)
    pushed_version: int  # the version last pushed to the generators (-1: none yet)
    pending: tuple  # usable finished groups, received and not yet trained on, in arrival order
    outstanding: int  # prompts ordered and not received yet
    next_order: int  # the order id the next ordered prompt gets
    waiting: bool  # True: the learner has no batch and waits; False: it has just taken a step
    orders_this_wait: int  # orders placed since the learner began waiting for its next batches
    max_refill_rounds: int  # extra orders the curriculum allows to replace filtered groups (0: none)
    run_seed: int  # train.seed

    @property
    def steps_left(self) -> int:
        """Learner steps still to take."""
        return self.total_steps - self.step


class OffPolicyScheme:
    """Base class of a scheme: override the decisions that differ from these defaults.

    The defaults describe a simple asynchronous scheme: the learner trains as soon as P usable
    groups are in, on the P it received first, and receives one group at a time; every group
    is usable; weights are pushed only when a new order must start from them
    (`start_version`: the learner's current version) and never under a running sequence.
    `prompts_to_order` has no default: it is what makes a scheme.
    """

    name = "off_policy_scheme"

    # -- the generators: when they start work, with which weights, with which seed -------------
    def prompts_to_order(self, s: LoopState) -> int:
        """How many prompts to order now (0: none). Asked while the learner waits for groups
        (`s.waiting`) and right after each of its steps."""
        raise NotImplementedError(f"off-policy scheme {self.name!r} ({type(self).__name__}) must define prompts_to_order")

    def start_version(self, s: LoopState) -> int:
        """The oldest weight version an order may start from; when the generators hold an older
        one (`s.pushed_version`), the loop pushes the learner's weights before ordering."""
        return s.learner_version

    def order_seed(self, s: LoopState) -> int:
        """The sampling seed of the order about to be placed (a function of the run seed and the
        loop's counters only, so a resumed run draws the same samples)."""
        return derive_seed(s.run_seed, s.next_order, 2)

    def takes_weights_mid_sequence(self) -> bool:
        """True: a generator loads pushed weights between two decode steps (a completion can span
        versions). False: it first decodes its in-flight sequences to their end."""
        return False

    def push_after_step(self, s: LoopState) -> bool:
        """True: the learner pushes its new weights to the generators after every step."""
        return False

    # -- the learner: when it waits, what it trains on -----------------------------------------
    def usable(self, learner_version: int, group: Any) -> bool:
        """May the learner (at `learner_version`) still train on this finished group? A group
        refused here is dropped from `s.pending` and counted as `stale_dropped`."""
        return True

    def batches(self, s: LoopState) -> list[list]:
        """The batches to train on now, one learner step each, taken from `s.pending` (the loop
        removes them); [] makes the learner wait for more groups. Default: the first P groups
        once P are in."""
        P = s.prompts_per_step
        return [list(s.pending[:P])] if len(s.pending) >= P else []

    def groups_to_await(self, s: LoopState) -> int:
        """How many of the `s.outstanding` groups the learner receives before it asks `batches`
        again (at least 1). They are handed to the curriculum in order-id order."""
        return 1

    # -- helpers for subclasses -----------------------------------------------------------------
    @staticmethod
    def lag(learner_version: int, group: Any) -> int:
        """Learner version minus the oldest version among the group's sampled tokens."""
        return int(learner_version) - int(group.min_version)

    @staticmethod
    def keep_ahead(s: LoopState, batches: int) -> int:
        """Prompts to order so that `batches` x P prompts are in flight or received and unused."""
        return max(0, batches * s.prompts_per_step - s.outstanding - len(s.pending))

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{self.name}({params})"


def _check_int(name: str, param: str, value: Any, low: int = 1) -> int:
    """`value` as an int, or a ValueError naming the scheme, the parameter and the valid values."""
    if isinstance(value, bool) or int(value) != value or value < low:
        raise ValueError(f"{name}: {param} must be an integer >= {low}, got {value!r}")
    return int(value)


class PpoOffPolicy(OffPolicyScheme):
    """PPO-off-policy-k: order k x P prompts with frozen weights, wait for every one, take k steps
    on consecutive mini-batches (order-id order), then push the weights. k=1: synchronous."""

    name = "ppo_off_policy"

    def __init__(self, k: int = 1):
        self.k = _check_int(self.name, "k", k)

    def round_steps(self, s: LoopState) -> int:
        """Learner steps of the round that starts now (k, or what is left of the run)."""
        return min(self.k, s.steps_left)

    def round_prompts(self, s: LoopState) -> int:
        """Prompts of the round that starts now: one batch per step."""
        return s.prompts_per_step * self.round_steps(s)

    def _refills(self, s: LoopState) -> bool:
        """A received round is short (a refilling filter dropped groups) and may re-order."""
        return len(s.pending) < self.round_prompts(s) and s.orders_this_wait <= s.max_refill_rounds

    def prompts_to_order(self, s: LoopState) -> int:
        if not s.waiting or s.outstanding:
            return 0  # never while the learner trains: the generators are idle between rounds
        if s.orders_this_wait == 0:
            return self.round_prompts(s)
        return self.round_prompts(s) - len(s.pending) if self._refills(s) else 0

    def order_seed(self, s: LoopState) -> int:
        """The round's seed (run seed, step), then one per refill of the round."""
        return derive_seed(derive_seed(s.run_seed, s.step, 1), s.orders_this_wait)

    def groups_to_await(self, s: LoopState) -> int:
        return s.outstanding  # the whole round: its order, hence its batches, do not depend on timing

    def batches(self, s: LoopState) -> list[list]:
        if s.outstanding or s.orders_this_wait == 0 or self._refills(s):
            return []
        # k mini-batches of P (a refill that ran out of rounds leaves the last ones short, or empty)
        P = s.prompts_per_step
        return [list(s.pending[i * P : (i + 1) * P]) for i in range(self.round_steps(s))]


class PipelineRL(OffPolicyScheme):
    """PipelineRL-k: streaming generation, weights pushed in flight after every step, groups with
    a token more than k versions old dropped; `inflight_batches` x P prompts kept ordered ahead."""

    name = "pipeline_rl"

    def __init__(self, k: int = 8, inflight_batches: Optional[int] = None):
        self.k = _check_int(self.name, "k", k)
        self.inflight_batches = _check_int(self.name, "inflight_batches", self.k if inflight_batches is None else inflight_batches)

    def prompts_to_order(self, s: LoopState) -> int:
        return self.keep_ahead(s, self.inflight_batches)

    def takes_weights_mid_sequence(self) -> bool:
        return True

    def push_after_step(self, s: LoopState) -> bool:
        return True

    def usable(self, learner_version: int, group: Any) -> bool:
        return self.lag(learner_version, group) <= self.k  # exactly k old is allowed


@OFF_POLICY.register("ppo_off_policy", ranges={"k": ">= 1"})
def ppo_off_policy(k: int = 1) -> PpoOffPolicy:
    """PPO-off-policy-k: generate k x batch with frozen weights, then k learner steps, then sync (k=1: synchronous)."""
    return PpoOffPolicy(k=k)


@OFF_POLICY.register("pipeline_rl", ranges={"k": ">= 1", "inflight_batches": ">= 1"})
def pipeline_rl(k: int = 8, inflight_batches: Optional[int] = None) -> PipelineRL:
    """PipelineRL-k: streaming generation, in-flight weight updates, never train on a token > k versions old.

    inflight_batches (default: k) bounds how many batches of prompts the generators run ahead
    of the learner. At the default, generation is throttled only by k itself, as in the paper
    (the learner drops groups more than k versions old); a smaller value throttles the
    generators further, and the observed lag then stays at about inflight_batches.
    """
    return PipelineRL(k=k, inflight_batches=inflight_batches)


def make_scheme(name: str, params: Optional[Mapping[str, Any]] = None) -> OffPolicyScheme:
    """The run's scheme `name` built with its hyper-parameters `params` (default: its defaults),
    checked to be a scheme."""
    scheme = OFF_POLICY.build(name, params)()
    if not isinstance(scheme, OffPolicyScheme):
        raise TypeError(f"off-policy scheme {name!r} built {type(scheme).__name__} {scheme!r}, not an OffPolicyScheme "
                        f"(components.offpolicy); registered schemes: {', '.join(OFF_POLICY.names())}")
    return scheme
