"""Math answers compared by math-verify: a gold answer parsed once (`parse_gold`), a completion's
final answer checked against it (`math_equal`), and the plain-text fallback for a gold answer
math-verify cannot parse (`plain_answer`: the last boxed answer, else the last line). Used by
the math_file task and the `math_verify` reward (components/rewards.py)."""

from __future__ import annotations

import logging
import threading
from typing import Optional

__all__ = ["parse_math", "parse_gold", "math_equal", "plain_answer"]


class _DropTimeoutWarning(logging.Filter):
    """math-verify warns on every call made without a timeout; we bound the time ourselves."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


_filter_installed = False


def _install_log_filter() -> None:
    global _filter_installed
    if not _filter_installed:
        for name in ("math_verify", "math_verify.parser", "math_verify.grader", "math_verify.utils"):
            logging.getLogger(name).addFilter(_DropTimeoutWarning())
        _filter_installed = True


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def parse_math(text: str, main_thread: Optional[bool] = None):
    """math-verify's parse, with its alarm-based timeout only where that works."""
    from math_verify import parse  # optional library, imported where it is used (components/tasks/__init__.py)

    _install_log_filter()
    main = _in_main_thread() if main_thread is None else main_thread
    return parse(text) if main else parse(text, parsing_timeout=None)


def parse_gold(answer: str):
    """Parse a gold answer written as bare LaTeX or plain text ("\\frac{3}{4}", "12")."""
    for candidate in (f"${answer}$", f"\\boxed{{{answer}}}", answer):
        parsed = parse_math(candidate)
        if parsed:
            return parsed
    return []


def math_equal(gold_parsed, answer_text: str) -> bool:
    from math_verify import verify  # optional library, imported where it is used

    pred = parse_math(answer_text)
    if not pred:
        return False
    if _in_main_thread():
        return bool(verify(gold_parsed, pred))
    return bool(verify(gold_parsed, pred, timeout_seconds=None))


def plain_answer(text: str) -> str:
    idx = text.rfind("\\boxed{")
    if idx >= 0:
        depth, start = 0, idx + len("\\boxed{")
        for j in range(start, len(text)):
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                if depth == 0:
                    return text[start:j].strip()
                depth -= 1
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""
