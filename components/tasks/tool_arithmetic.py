"""``tool_arithmetic``: multi-digit products that a tiny policy cannot compute in its head, with a calculator.

A problem is ``"37*91="`` (two operands of `digits` digits each, by default 2: products up to 9,801).
The verifier is the arithmetic one (the last integer of the final answer). Meant to run with
``train.environment = "calculator"`` (components/environments.py): the gold episode
(`tool_transcript`) calls the tool, reads its result and answers with it::

    assistant: <tool>calc: 37*91</tool>          (then EOS: the turn ends)
    tool:      <result>3367</result>             (the environment's observation: never trained on)
    assistant: 3367

The warm start (components/warm_start.py) imitates that transcript, the observation excluded from
its loss, so RL starts from a policy that uses the tool sometimes (experiments/configs/tiny_tool.gin).
Without the tool the same policy cannot answer: the product is not in its head.
"""

from __future__ import annotations

from components.registry import TASKS
from components.tasks.arithmetic import ArithmeticTask
from components.tasks.base import Problem

__all__ = ["ToolArithmeticTask"]


class ToolArithmeticTask(ArithmeticTask):
    """Products of two `digits`-digit operands ("37*91=" -> 3367), to be solved with the calculator tool.

    Args:
        seed, num_train, num_eval, reward_correct, reward_incorrect, prompt_template: as `arithmetic`.
        digits: digits per operand (>= 1): operands are drawn from [10^(digits-1), 10^digits - 1].
    """

    name = "tool_arithmetic"

    def __init__(self, seed: int = 0, reward_correct: float = 1.0, reward_incorrect: float = -1.0, num_train: int = 2000,
                 num_eval: int = 200, digits: int = 2, prompt_template: str = "{expr}="):
        if int(digits) < 1:
            raise ValueError(f"tool_arithmetic: digits must be >= 1, got {digits!r}")
        super().__init__(seed=seed, reward_correct=reward_correct, reward_incorrect=reward_incorrect,
                         num_train=num_train, num_eval=num_eval, num_operands=2, min_operand=10 ** (int(digits) - 1),
                         max_operand=10 ** int(digits) - 1, operators="*", prompt_template=prompt_template)
        self.digits = int(digits)

    def tool_transcript(self, problem: Problem) -> list[tuple[str, str]]:
        """The gold episode as (role, text) turns: the tool call, the tool's result, the answer."""
        return [("assistant", f"<tool>calc: {problem.meta['expr']}</tool>"), ("tool", f"<result>{problem.answer}</result>"),
                ("assistant", str(problem.answer))]


TASKS.register("tool_arithmetic", ranges={"num_train": ">= 0", "num_eval": ">= 0", "digits": ">= 1"})(ToolArithmeticTask)
