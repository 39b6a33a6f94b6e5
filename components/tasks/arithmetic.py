"""`arithmetic`: procedural integer arithmetic, the task of the embedded CPU demo and the tests.

A problem is a short expression prompt such as ``"12+7="``; a correct completion is the
integer result (``"19"``), optionally after a thinking part ``<think>…</think>``. The verifier
takes the last integer in the text after the thinking part.

Difficulty knobs: `num_operands`, operand range (`min_operand`..`max_operand`), `operators`
(any of ``+ - *``, standard precedence), `allow_negative` (negative operands and results).
The train and held-out splits are disjoint sets of distinct expressions drawn with `seed`.
"""

from __future__ import annotations

import itertools
import random
import re
from typing import Optional, Sequence

from components.registry import TASKS
from components.tasks.base import Problem, Verdict
from components.tasks.common import SplitTask, strip_special_tokens, strip_thinking

_INT = re.compile(r"-?\d+")
_VALID_OPERATORS = "+-*"
# Enumerate the whole expression space below this size (exact sampling without replacement).
_ENUMERATE_LIMIT = 200_000


def evaluate(operands: Sequence[int], operators: Sequence[str]) -> int:
    """Value of ``o0 op0 o1 op1 o2 ...`` with ``*`` binding tighter than ``+``/``-``."""
    if len(operators) != len(operands) - 1:
        raise ValueError(f"{len(operands)} operands need {len(operands) - 1} operators, got {len(operators)}")
    total, term = 0, operands[0]
    sign = 1
    for op, x in zip(operators, operands[1:]):
        if op == "*":
            term *= x
        elif op in "+-":
            total += sign * term
            sign, term = (1 if op == "+" else -1), x
        else:
            raise ValueError(f"unknown operator {op!r}; valid: {list(_VALID_OPERATORS)}")
    return total + sign * term


def format_expression(operands: Sequence[int], operators: Sequence[str]) -> str:
    parts = [_fmt(operands[0])]
    for op, x in zip(operators, operands[1:]):
        parts.append(op)
        parts.append(_fmt(x))
    return "".join(parts)


def _fmt(x: int) -> str:
    return str(x) if x >= 0 else f"({x})"


def parse_last_int(text: str) -> Optional[int]:
    """The last integer in `text` (``None`` if there is none)."""
    found = _INT.findall(text)
    return int(found[-1]) if found else None


def verify_last_int(task: SplitTask, problem: Problem, completion: str) -> Verdict:
    """Correct iff the last integer after the thinking part equals `problem.answer` (the verdict of
    the arithmetic-style tasks; never raises for a bad completion)."""
    try:
        final = strip_thinking(completion)
        if final is None:
            return task.verdict(False)  # thinking never closed: no answer
        got = parse_last_int(strip_special_tokens(final))
        return task.verdict(got is not None and got == int(problem.answer))
    except Exception as err:  # never raise for a bad completion
        return task.verdict(False, error=f"{type(err).__name__}: {err}")


class ArithmeticTask(SplitTask):
    """Procedural integer arithmetic ("12+7=" -> "19") with a seeded, disjoint train / held-out split.

    Args:
        seed: draws the expressions and the split.
        num_train / num_eval: sizes of the two splits (distinct expressions, never shared).
        num_operands: operands per expression (>= 2).
        min_operand / max_operand: operand range (inclusive); with `allow_negative` operands
            are drawn from [-max_operand, max_operand].
        operators: string of operators to draw from, any of "+-*".
        allow_negative: allow negative operands and negative results (else both are >= 0).
        prompt_template: the user message; ``{expr}`` is replaced by the expression.
        reward_correct / reward_incorrect: the rewards of the verdicts (+1 / -1 by default).
        scratchpad: the gold completion (`solution_text`, what a warm start imitates) thinks
            first: the running result after each operator but the last, comma-separated, in
            ``<think>…</think>``, then the answer ("12+7-3=" -> "<think>19</think>16"). A tiny
            model then has a thinking part for forced interruptions to cut (tiny_cpu.gin).
    """

    name = "arithmetic"

    def __init__(
        self,
        seed: int = 0,
        reward_correct: float = 1.0,
        reward_incorrect: float = -1.0,
        num_train: int = 2000,
        num_eval: int = 200,
        num_operands: int = 2,
        min_operand: int = 0,
        max_operand: int = 50,
        operators: str = "+-",
        allow_negative: bool = False,
        prompt_template: str = "{expr}=",
        scratchpad: bool = False,
    ):
        if num_operands < 2:
            raise ValueError(f"num_operands must be >= 2, got {num_operands}")
        bad = [op for op in operators if op not in _VALID_OPERATORS]
        if not operators or bad:
            raise ValueError(f"operators must be a non-empty string of {list(_VALID_OPERATORS)}, got {operators!r}")
        if allow_negative:
            min_operand = -abs(max_operand)
        if min_operand > max_operand:
            raise ValueError(f"min_operand ({min_operand}) > max_operand ({max_operand})")
        if not allow_negative and min_operand < 0:
            raise ValueError(f"min_operand {min_operand} < 0 needs allow_negative=True")
        if num_train < 0 or num_eval < 0:
            raise ValueError(f"num_train ({num_train}) and num_eval ({num_eval}) must be >= 0")
        if "{expr}" not in prompt_template:
            raise ValueError(f"prompt_template must contain '{{expr}}', got {prompt_template!r}")
        self.seed = seed
        self.reward_correct = float(reward_correct)
        self.reward_incorrect = float(reward_incorrect)
        self.num_operands = num_operands
        self.min_operand, self.max_operand = min_operand, max_operand
        self.operators = "".join(dict.fromkeys(operators))  # dedupe, keep order
        self.allow_negative = allow_negative
        self.prompt_template = prompt_template
        self.scratchpad = bool(scratchpad)

        exprs = self._draw(num_train + num_eval)
        held, train = exprs[:num_eval], exprs[num_eval:]
        self._eval = [self._problem(ops, opr, "eval") for ops, opr in held]
        self._train = [self._problem(ops, opr, "train") for ops, opr in train]

    # -- generation -------------------------------------------------------------------
    def space_size(self) -> int:
        """Number of expressions the knobs allow (before excluding negative results)."""
        n_vals = self.max_operand - self.min_operand + 1
        return n_vals**self.num_operands * len(self.operators) ** (self.num_operands - 1)

    def _valid(self, operands, operators) -> bool:
        return self.allow_negative or evaluate(operands, operators) >= 0

    def _draw(self, n: int) -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
        rng = random.Random(self.seed)
        values = range(self.min_operand, self.max_operand + 1)
        k = self.num_operands
        space = self.space_size()
        if space <= _ENUMERATE_LIMIT:
            pool = [
                (ops, opr)
                for ops in itertools.product(values, repeat=k)
                for opr in itertools.product(self.operators, repeat=k - 1)
                if self._valid(ops, opr)
            ]
            if n > len(pool):
                raise ValueError(
                    f"arithmetic: num_train + num_eval = {n} exceeds the {len(pool)} distinct expressions "
                    f"these knobs allow (num_operands={k}, operands {self.min_operand}..{self.max_operand}, "
                    f"operators {self.operators!r}, allow_negative={self.allow_negative}); widen the range or lower num_train / num_eval"
                )
            return rng.sample(pool, n)
        seen: set = set()
        out = []
        tries = 0
        while len(out) < n:
            tries += 1
            if tries > 50 * n + 1000:
                raise ValueError(f"arithmetic: could not draw {n} distinct valid expressions; widen the range")
            ops = tuple(rng.randint(self.min_operand, self.max_operand) for _ in range(k))
            opr = tuple(rng.choice(self.operators) for _ in range(k - 1))
            if (ops, opr) in seen or not self._valid(ops, opr):
                continue
            seen.add((ops, opr))
            out.append((ops, opr))
        return out

    def _problem(self, operands, operators, split: str) -> Problem:
        expr = format_expression(operands, operators)
        return Problem(
            id=f"arithmetic:{expr}",
            prompt=self.prompt_template.format(expr=expr),
            answer=evaluate(operands, operators),
            meta={"split": split, "expr": expr, "num_operands": len(operands), "operands": list(operands),
                  "operators": list(operators)},
        )

    # -- Task interface -----------------------------------------------------------------
    def solution_text(self, problem: Problem) -> str:
        """The gold completion, formatted exactly as a correct answer (e.g. ``"19"``; with `scratchpad`,
        ``"<think>19</think>16"`` for ``12+7-3``)."""
        if not self.scratchpad or len(problem.meta["operands"]) < 3:
            return str(problem.answer)
        operands, operators = problem.meta["operands"], problem.meta["operators"]
        steps = [evaluate(operands[: k + 1], operators[:k]) for k in range(1, len(operands) - 1)]  # prefix values
        return f"<think>{','.join(str(v) for v in steps)}</think>{problem.answer}"

    def verify(self, problem: Problem, completion: str) -> Verdict:
        return verify_last_int(self, problem, completion)


# Registered without rebinding the module name: instances stay picklable (gin's wrapper is a
# different class object of the same name), and `TASKS.get("arithmetic")` honours gin bindings.
TASKS.register("arithmetic", ranges={"num_train": ">= 0", "num_eval": ">= 0", "num_operands": ">= 2"})(ArithmeticTask)
