"""bounded_async: a staleness-bounded asynchronous off-policy scheme, in a user's own file.

The generators run up to `k` learner versions ahead (`k` batches of prompts are kept ordered
ahead of the learner) but never take new weights in the middle of a sequence: when weights
arrive, a generator first decodes its in-flight sequences to their end, so every completion
comes from one policy version. The learner drops finished groups more than `k` versions older
than itself (AReaL-style bounded staleness). docs/adding_an_off_policy_scheme.md walks through
this file; bounded_async.gin, next to it, imports it and selects the scheme:

    scalerl train experiments/configs/tiny_cpu.gin docs/examples/bounded_async.gin
"""

from components.offpolicy import LoopState, OffPolicyScheme
from components.registry import OFF_POLICY


@OFF_POLICY.register("bounded_async", ranges={"k": ">= 1"})
class BoundedAsync(OffPolicyScheme):
    """Generators up to k versions ahead, weights never taken mid-sequence; groups staler than k dropped."""

    name = "bounded_async"

    def __init__(self, k: int = 2):
        if isinstance(k, bool) or int(k) != k or k < 1:
            raise ValueError(f"bounded_async: k must be an integer >= 1, got {k!r}")
        self.k = int(k)

    def prompts_to_order(self, s: LoopState) -> int:
        """Keep k batches of prompts ordered and unused: the generators run up to k versions ahead."""
        return self.keep_ahead(s, self.k)

    def push_after_step(self, s: LoopState) -> bool:
        """Every new version goes to the generators ..."""
        return True

    def takes_weights_mid_sequence(self) -> bool:
        """... which finish the sequences they are decoding before loading it."""
        return False

    def usable(self, learner_version: int, group) -> bool:
        """Train only on groups at most k versions older than the learner."""
        return self.lag(learner_version, group) <= self.k
