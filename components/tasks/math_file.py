"""`math_file`: math problems from a local JSONL or Parquet file, graded by math-verify.

The file holds one problem per row with a ``problem`` and an ``answer`` column (the
Polaris-53K layout; other column names via `problem_key` / `answer_key`). Rows with an empty
problem or answer are dropped, and repeated problem texts are kept once, so the seeded
train / held-out split never shares a problem text. By default ``min(1000, 10%)`` of the
problems are held out (Polaris runs hold out 1000), or set `eval_size` / `eval_fraction`.

Grading: the text after the last ``</think>`` (no answer when a thinking part is left open) is
parsed by math-verify and compared with the parsed gold answer (``math_verify.verify``).
math-verify bounds its time with ``signal.alarm``, which only works in a process's main
thread; in any other thread it is called without its alarm, and the time is bounded instead
by grading at most the last `max_answer_chars` characters of the answer part.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Optional

from components.registry import TASKS
from components.tasks.base import Problem, Verdict
from components.tasks.common import SplitTask, resolve_eval_size, seeded_split, strip_special_tokens, strip_thinking
from components.tasks.math_answers import math_equal, parse_gold, plain_answer

DEFAULT_PROMPT_TEMPLATE = "{problem}\n\nPlease reason step by step, and put your final answer within \\boxed{{}}."
SUPPORTED_SUFFIXES = (".jsonl", ".json", ".parquet", ".pq")


def read_table(path: str | Path):
    """A pandas DataFrame from a JSONL / JSON / Parquet file, with clear errors naming the path."""
    import pandas as pd

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"math_file: no such file {str(path)!r}")
    suffix = p.suffix.lower()
    if suffix not in SUPPORTED_SUFFIXES:
        raise ValueError(f"math_file: cannot read {str(path)!r}: unsupported suffix {suffix!r}; use one of {SUPPORTED_SUFFIXES}")
    try:
        if suffix in (".parquet", ".pq"):
            return pd.read_parquet(p)
        if suffix == ".jsonl":
            return pd.read_json(p, lines=True, dtype=False)
        with open(p) as f:
            data = json.load(f)
        return pd.DataFrame(data)
    except Exception as err:
        raise ValueError(f"math_file: cannot read {str(path)!r} as {suffix[1:]}: {type(err).__name__}: {err}") from err


def load_rows(path: str | Path, problem_key: str = "problem", answer_key: str = "answer") -> tuple[list[tuple[str, str]], dict]:
    """[(problem, answer)] in file order, deduplicated by problem text, and counts of what was dropped."""
    df = read_table(path)
    missing = [k for k in (problem_key, answer_key) if k not in df.columns]
    if missing:
        raise ValueError(
            f"math_file: {str(path)!r} has no column(s) {missing}; columns present: {list(map(str, df.columns))}"
        )
    rows, seen = [], set()
    empty = dup = 0
    for prob, ans in zip(df[problem_key].tolist(), df[answer_key].tolist()):
        prob_s, ans_s = _text(prob), _text(ans)
        if not prob_s or not ans_s:
            empty += 1
            continue
        if prob_s in seen:
            dup += 1
            continue
        seen.add(prob_s)
        rows.append((prob_s, ans_s))
    if not rows:
        raise ValueError(f"math_file: {str(path)!r} has no rows with a non-empty {problem_key!r} and {answer_key!r}")
    return rows, {"rows_read": len(df), "dropped_empty": empty, "dropped_duplicate": dup}


def _text(x: Any) -> str:
    if x is None:
        return ""
    try:
        import math

        if isinstance(x, float) and math.isnan(x):
            return ""
    except Exception:
        pass
    return str(x).strip()


class MathFileTask(SplitTask):
    """Math problems from a local JSONL / Parquet file (``problem``, ``answer``), graded by math-verify.

    Args:
        path: the JSONL (.jsonl / .json) or Parquet (.parquet / .pq) file.
        seed: seed of the train / held-out split.
        eval_size / eval_fraction: size of the held-out split (give one; default min(1000, 10%)).
        problem_key / answer_key: column names.
        prompt_template: user message; ``{problem}`` is replaced by the problem text.
        max_answer_chars: only this many trailing characters of the answer part are graded.
        system_prompt: a system message rendered with every prompt (training and evaluation).
        reward / pass_threshold: grade with a plain-function reward registered in `REWARDS`
            instead of math-verify (called with ``answer=``); a float reward
            passes iff it is >= pass_threshold (`components.rewards`).
    """

    name = "math_file"

    def __init__(
        self,
        path: str = "",
        seed: int = 0,
        reward_correct: float = 1.0,
        reward_incorrect: float = -1.0,
        eval_size: Optional[int] = None,
        eval_fraction: Optional[float] = None,
        problem_key: str = "problem",
        answer_key: str = "answer",
        prompt_template: str = DEFAULT_PROMPT_TEMPLATE,
        max_answer_chars: int = 4000,
        system_prompt: Optional[str] = None,
        reward: Optional[str] = None,
        reward_params: Optional[dict] = None,
        pass_threshold: float = 1.0,
    ):
        if not path:
            raise ValueError("math_file: give the data file, e.g. math_file.path = '/data/polaris.parquet'")
        from components.tasks.reward_verdicts import check_reward

        self.reward = check_reward(reward)
        self.reward_params = dict(reward_params) if reward_params is not None else None  # a resolved run's values
        self.pass_threshold = float(pass_threshold)
        self.system_prompt = system_prompt
        if "{problem}" not in prompt_template:
            raise ValueError(f"prompt_template must contain '{{problem}}', got {prompt_template!r}")
        self.path = str(path)
        self.seed = seed
        self.reward_correct = float(reward_correct)
        self.reward_incorrect = float(reward_incorrect)
        self.prompt_template = prompt_template
        self.max_answer_chars = int(max_answer_chars)
        rows, self.load_stats = load_rows(path, problem_key, answer_key)
        indexed = list(enumerate(rows))
        n_eval = resolve_eval_size(len(rows), eval_size, eval_fraction, default=1000)
        train, held = seeded_split(indexed, n_eval, seed)
        stem = Path(path).stem
        self._train = [self._problem(stem, i, prob, ans, "train") for i, (prob, ans) in train]
        self._eval = [self._problem(stem, i, prob, ans, "eval") for i, (prob, ans) in held]
        self._gold: dict[str, Any] = {}
        self._gold_lock = threading.Lock()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_gold_lock", None)
        state["_gold"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._gold_lock = threading.Lock()

    def _problem(self, stem: str, i: int, prob: str, ans: str, split: str) -> Problem:
        return Problem(
            id=f"math_file:{stem}:{i}",
            prompt=self.prompt_template.format(problem=prob),
            answer=ans,
            meta={"split": split, "row": i, **({"system_prompt": self.system_prompt} if self.system_prompt else {})},
        )

    def solution_text(self, problem: Problem) -> str:
        """A minimal correct completion (the gold answer boxed), e.g. for SFT warm starts."""
        return f"\\boxed{{{problem.answer}}}"

    def _gold_parsed(self, problem: Problem):
        key = f"{problem.id}\x00{problem.answer}"
        with self._gold_lock:
            if key in self._gold:
                return self._gold[key]
        parsed = parse_gold(str(problem.answer))
        with self._gold_lock:
            self._gold[key] = parsed
        return parsed

    def verify(self, problem: Problem, completion: str) -> Verdict:
        if self.reward is not None:
            from components.tasks.reward_verdicts import reward_verdict

            row = {"answer": problem.answer}
            return reward_verdict(self.reward, problem.prompt, completion, row, pass_threshold=self.pass_threshold,
                                  reward_correct=self.reward_correct, reward_incorrect=self.reward_incorrect,
                                  params=self.reward_params)
        try:
            final = strip_thinking(completion)
            if final is None or not final.strip():
                return self.verdict(False)
            final = strip_special_tokens(final)[-self.max_answer_chars :]
            gold = self._gold_parsed(problem)
            if not gold:
                # Gold that math-verify cannot parse (free text): exact match of the boxed / last line.
                return self.verdict(plain_answer(final) == str(problem.answer).strip())
            return self.verdict(math_equal(gold, final))
        except Exception as err:  # includes math-verify's TimeoutException
            return self.verdict(False, error=f"{type(err).__name__}: {err}")


# Registered without rebinding the module name: instances stay picklable (gin's wrapper is a
# different class object of the same name), and `TASKS.get("math_file")` honours gin bindings.
TASKS.register("math_file", ranges={"eval_size": ">= 0", "eval_fraction": "[0, 1)", "max_answer_chars": ">= 1"})(MathFileTask)
