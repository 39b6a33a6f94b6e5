"""Helpers shared by the built-in tasks: thinking-part stripping, seeded splits, prompt rendering."""

from __future__ import annotations

import random
import re
from typing import Any, Optional, Sequence, TypeVar, Union

from components.tasks.base import Problem, Task

T = TypeVar("T")

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
# Special tokens a decoder may leave in the text when skip_special_tokens=False.
_TRAILING_SPECIALS = ("</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<pad>")


def strip_thinking(completion: str) -> Optional[str]:
    """The final-answer part of a completion: the text after the last ``</think>``.

    Returns the whole text when there is no thinking part at all, and ``None`` when a
    thinking part was opened (``<think>``) but never closed: the model ran out of budget
    before answering, which counts as no answer.
    """
    if THINK_CLOSE in completion:
        return completion.rsplit(THINK_CLOSE, 1)[1]
    if THINK_OPEN in completion:
        return None
    return completion


def strip_special_tokens(text: str) -> str:
    for tok in _TRAILING_SPECIALS:
        text = text.replace(tok, " ")
    return text


def seeded_split(items: Sequence[T], eval_size: int, seed: int) -> tuple[list[T], list[T]]:
    """Shuffle `items` with `seed` and return (train, held_out) with len(held_out) == eval_size."""
    if eval_size < 0 or eval_size > len(items):
        raise ValueError(f"eval size {eval_size} must be between 0 and the number of items ({len(items)})")
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    held = [items[i] for i in order[:eval_size]]
    train = [items[i] for i in order[eval_size:]]
    return train, held


def resolve_eval_size(n: int, eval_size: Optional[int], eval_fraction: Optional[float], default: int) -> int:
    """How many of `n` rows to hold out: `eval_size` or `eval_fraction`, else min(default, n // 10)."""
    if eval_size is not None and eval_fraction is not None:
        raise ValueError(f"give eval_size ({eval_size}) or eval_fraction ({eval_fraction}), not both")
    if eval_fraction is not None:
        if not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
        size = int(round(n * eval_fraction))
    elif eval_size is not None:
        size = int(eval_size)
    else:
        size = min(default, n // 10)
    if size < 0 or size >= n:
        raise ValueError(
            f"cannot hold out {size} of {n} problems (at least one must remain for training); "
            "lower eval_size / eval_fraction"
        )
    return size


SYSTEM_PROMPT_KEY = "system_prompt"  # Problem.meta key: the system prompt travels with the problem
MESSAGES_KEY = "messages"  # Problem.meta key: a conversational prompt ([{"role", "content"}, ...], last one the user's)
CHAT_TEMPLATE_KWARGS_KEY = "chat_template_kwargs"  # Problem.meta key: extra chat-template variables (enable_thinking)


def render_prompt(problem: Union[Problem, str], tokenizer: Any, system_prompt: Optional[str] = None) -> list[int]:
    """Token ids of a problem's prompt, ready for generation.

    Uses the tokenizer's chat template (with ``add_generation_prompt=True``) when it has
    one; otherwise encodes the plain prompt text (with the tokenizer's usual special
    tokens, e.g. BOS). The system prompt is `system_prompt` if given, else the problem's own
    (``problem.meta["system_prompt"]``, set by tasks built with a `system_prompt`), so
    training and evaluation render a problem alike without passing it.

    A conversational problem (``problem.meta["messages"]``, e.g. `hf_dataset` with a prompt
    column of messages) renders those messages, the system prompt first when they have no
    system message of their own; without a chat template, their contents joined by newlines.
    ``problem.meta["chat_template_kwargs"]`` (e.g. ``{"enable_thinking": False}``) goes to the
    chat template as its extra variables.
    """
    text = problem.prompt if isinstance(problem, Problem) else str(problem)
    meta = (problem.meta or {}) if isinstance(problem, Problem) else {}
    if system_prompt is None:
        system_prompt = meta.get(SYSTEM_PROMPT_KEY)
    conversation = meta.get(MESSAGES_KEY)
    messages = [dict(m) for m in conversation] if conversation else [{"role": "user", "content": text}]
    if system_prompt and not any(m.get("role") == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    if getattr(tokenizer, "chat_template", None):
        extra = dict(meta.get(CHAT_TEMPLATE_KWARGS_KEY) or {})
        # tokenize=False then encode: transformers 5 returns a BatchEncoding for tokenize=True.
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
        return list(tokenizer.encode(rendered, add_special_tokens=False))
    text = "\n".join(str(m["content"]) for m in messages)
    return list(tokenizer.encode(text, add_special_tokens=True))


_CODE_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str:
    """The program in a completion: the last fenced block (preferring ```python ones), else the text."""
    blocks = _CODE_FENCE.findall(text)
    if not blocks:
        # An unterminated last fence (truncated generation): take what follows it.
        idx = text.rfind("```")
        if idx >= 0:
            rest = text[idx + 3 :]
            return rest.split("\n", 1)[1] if "\n" in rest else ""
        return text
    python_blocks = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
    return (python_blocks or [code for _, code in blocks])[-1]


class SplitTask(Task):
    """A task whose constructor builds both splits up front as `self._train` and `self._eval`."""

    _train: list[Problem]
    _eval: list[Problem]

    def train_problems(self) -> list[Problem]:
        return list(self._train)

    def eval_problems(self) -> list[Problem]:
        return list(self._eval)
