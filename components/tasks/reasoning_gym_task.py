"""`reasoning_gym`: any reasoning-gym dataset (spec ``reasoning_gym:<dataset>``), scored by its own scorer.

The train and held-out splits are generated with different seeds
(``seed`` and ``seed + EVAL_SEED_OFFSET``); any held-out question that also occurs in the
training split is removed from the training split, so the two never share a question.

Answer extraction from a completion: the text after the last ``</think>`` (no answer if a
thinking part is left open); in it, the content of the last ``<answer>…</answer>`` if there is
one, else the last non-empty line. The dataset's ``score_answer(answer, entry)`` scores it in
[0, 1]; the completion passes iff the score is >= `threshold` (1.0 by default: some datasets
give partial credit).
"""

from __future__ import annotations

import difflib
import re
from typing import Optional

from components.registry import TASKS
from components.tasks.base import Problem, Verdict
from components.tasks.common import SplitTask, strip_special_tokens, strip_thinking

EVAL_SEED_OFFSET = 1_000_003
DEFAULT_INSTRUCTION = "\n\nGive only your final answer inside <answer></answer> tags."
_ANSWER_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)


def available_datasets() -> list[str]:
    """Names of the reasoning-gym datasets installed here."""
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def check_dataset_name(name: str) -> str:
    names = available_datasets()
    if name in names:
        return name
    close = difflib.get_close_matches(name, names, n=5, cutoff=0.5)
    if close:
        hint = f"close matches: {', '.join(close)}"
    else:
        hint = f"valid datasets: {', '.join(names)}"
    raise ValueError(f"unknown reasoning-gym dataset {name!r}; {hint}")


def extract_answer(completion: str) -> Optional[str]:
    """The answer in a completion (see module doc); ``None`` when there is none."""
    final = strip_thinking(completion)
    if final is None:
        return None
    final = strip_special_tokens(final)
    tagged = _ANSWER_TAG.findall(final)
    if tagged:
        return tagged[-1].strip()
    lines = [ln.strip() for ln in final.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else None


class ReasoningGymTask(SplitTask):
    """A reasoning-gym dataset as a task; pass iff its scorer gives >= `threshold`.

    Args:
        dataset: the reasoning-gym dataset name (``make_task("reasoning_gym:<name>")`` sets it).
        seed: seed of the training split; the held-out split uses ``seed + EVAL_SEED_OFFSET``.
        num_train / num_eval: split sizes (the training split can shrink by the questions
            that also appear in the held-out split).
        threshold: minimal score in [0, 1] that counts as correct.
        dataset_config: extra keyword arguments for ``reasoning_gym.create_dataset``
            (difficulty settings of that dataset).
        instruction: appended to each question (asks for ``<answer>`` tags).
    """

    name = "reasoning_gym"

    def __init__(
        self,
        dataset: str = "basic_arithmetic",
        seed: int = 0,
        reward_correct: float = 1.0,
        reward_incorrect: float = -1.0,
        num_train: int = 1000,
        num_eval: int = 100,
        threshold: float = 1.0,
        dataset_config: Optional[dict] = None,
        instruction: str = DEFAULT_INSTRUCTION,
    ):
        import reasoning_gym

        self.dataset = check_dataset_name(dataset)
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        if num_train < 1 or num_eval < 0:
            raise ValueError(f"num_train ({num_train}) must be >= 1 and num_eval ({num_eval}) >= 0")
        self.seed = seed
        self.reward_correct = float(reward_correct)
        self.reward_incorrect = float(reward_incorrect)
        self.threshold = float(threshold)
        self.instruction = instruction
        config = dict(dataset_config or {})
        for reserved in ("size", "seed"):
            if reserved in config:
                raise ValueError(f"dataset_config must not set {reserved!r}; use num_train/num_eval and seed")
        self._train_ds = reasoning_gym.create_dataset(self.dataset, size=num_train, seed=seed, **config)
        self._eval_ds = (
            reasoning_gym.create_dataset(self.dataset, size=num_eval, seed=seed + EVAL_SEED_OFFSET, **config)
            if num_eval > 0
            else None
        )
        # Entries are generated once (reasoning-gym builds them on each __getitem__).
        self._entries = {
            "train": [self._train_ds[i] for i in range(num_train)],
            "eval": [self._eval_ds[i] for i in range(num_eval)] if self._eval_ds is not None else [],
        }
        self._eval = [self._problem("eval", i) for i in range(num_eval)]
        held_questions = {p.meta["question"] for p in self._eval}
        train = [self._problem("train", i) for i in range(num_train)]
        self._train = [p for p in train if p.meta["question"] not in held_questions]
        self.num_removed_overlap = len(train) - len(self._train)
        if not self._train:
            raise ValueError(f"reasoning-gym {self.dataset!r}: every training question also occurs in the held-out split")

    def _problem(self, split: str, i: int) -> Problem:
        entry = self._entries[split][i]
        question = entry["question"]
        return Problem(
            id=f"reasoning_gym:{self.dataset}:{split}:{i}",
            prompt=question + self.instruction,
            answer=str(entry["answer"]) if entry.get("answer") is not None else None,
            # The dataset and index locate the full entry the scorer needs.
            meta={"split": split, "question": question, "dataset": self.dataset, "index": i},
        )

    def solution_text(self, problem: Problem) -> str:
        """A minimal correct completion, e.g. for SFT warm starts: the dataset's gold answer in
        ``<answer>`` tags, or bare when the instruction does not ask for tags (``instruction=""``:
        the answer is then read from the last line)."""
        if "<answer>" not in self.instruction:
            return str(problem.answer)
        return f"<answer>{problem.answer}</answer>"

    def _entry(self, problem: Problem) -> dict:
        split = problem.meta.get("split")
        if split not in self._entries or problem.meta.get("dataset") != self.dataset:
            raise ValueError(f"problem {problem.id!r} does not belong to this reasoning-gym task ({self.dataset!r})")
        return self._entries[split][problem.meta["index"]]

    def score(self, problem: Problem, completion: str) -> float:
        """The dataset's own score of the completion's answer, in [0, 1]."""
        answer = extract_answer(completion)
        if answer is None:
            return 0.0
        ds = self._eval_ds if problem.meta.get("split") == "eval" else self._train_ds
        return float(ds.score_answer(answer, self._entry(problem)))

    def verify(self, problem: Problem, completion: str) -> Verdict:
        try:
            return self.verdict(self.score(problem, completion) >= self.threshold)
        except Exception as err:  # a scorer crashing on odd text is a wrong answer
            return self.verdict(False, error=f"{type(err).__name__}: {err}")


# Registered without rebinding the module name: instances stay picklable (gin's wrapper is a
# different class object of the same name), and `TASKS.get("reasoning_gym")` honours gin bindings.
TASKS.register("reasoning_gym", ranges={"num_train": ">= 1", "num_eval": ">= 0", "threshold": "[0, 1]"})(ReasoningGymTask)
