"""A user environment (docs/adding_an_environment.md): the task's answer, with retries.

A wrong answer gets the observation "Wrong, try again." and another turn, up to `tries` answers; a
right one ends the episode with a reward that shrinks with each retry. Selected by name in a gin file
that imports this module (docs/examples/retry_env.gin).
"""

from components.environments import Environment, Observation, Reward
from components.registry import ENVIRONMENTS


@ENVIRONMENTS.register("retry", ranges={"tries": ">= 1", "retry_cost": "[0, 1]"})
class Retry(Environment):
    """The task's answer with up to `tries` attempts; each retry costs `retry_cost` of the reward."""

    def __init__(self, task, problem, *, tries: int = 3, retry_cost: float = 0.5):
        super().__init__(task, problem)
        self.tries = int(tries)
        self.retry_cost = float(retry_cost)
        self.attempts = 0

    def step(self, turn: str):
        self.attempts += 1
        graded = self.grade(turn)  # the task's verifier on this turn: Reward(value, passed, {"verifier": value})
        if graded.passed:
            value = 1.0 - self.retry_cost * (self.attempts - 1)
            return Reward(value, True, {"verifier": graded.value, "attempts": float(self.attempts)})
        if self.attempts >= self.tries:
            return Reward(graded.value, False, {"verifier": graded.value, "attempts": float(self.attempts)})
        return Observation("Wrong, try again.", role="user")

    def stop(self, reason: str):
        # the trainer cut the episode (train.max_turns, or a token budget): no right answer was given
        return Reward(-1.0, False, {"verifier": -1.0, "attempts": float(self.attempts)})
