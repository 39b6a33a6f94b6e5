"""`hf_dataset`: any Hugging Face `datasets.load_dataset` source as a task.

The source is whatever `datasets.load_dataset` reads, or a directory written by `save_to_disk` (a
Dataset, read as split "train", or a DatasetDict; the Python API saves a `datasets.Dataset` there):

- a Hub dataset name (``path = "org/name"``, with ``name`` for its config and ``revision``);
  it is downloaded by `datasets` on first use and cached (nothing is downloaded otherwise);
- local files: ``path`` = a .jsonl / .json / .parquet / .csv / .arrow file or a directory,
  or ``data_files`` (a file, a list or a dict split -> files) with ``path`` empty or one of
  the builder names ``json`` / ``parquet`` / ``csv`` / ``arrow``.

``split`` is the training split; the held-out split is either another split (``eval_split``,
e.g. ``"test"``) or a seeded slice of the training split (``eval_size`` / ``eval_fraction``,
default ``min(1000, 10%)``). Rows with an empty prompt are dropped and repeated prompt texts
kept once; with ``eval_split`` a training row whose prompt is also held out is dropped, so the
splits never share a prompt text.

``columns`` maps the task's fields to the dataset's columns, e.g.
``{"prompt": "question", "answer": "solution"}`` (``tests`` too). Unmapped, ``prompt`` is the
first of ``prompt`` / ``problem`` / ``question`` present and ``answer`` is ``answer`` if present.
The user message is ``prompt_template`` formatted with ``{prompt}`` (and ``{instruction}``, the
code-task instruction, when tests are mapped); ``system_prompt`` travels with every problem
(``Problem.meta["system_prompt"]``), and `render_prompt` applies the model's chat template with
it in training and evaluation alike.

Conversational prompts (TRL's conversational format): the prompt column may hold a list of
messages, ``[{"role": "system", "content": ...}, {"role": "user", "content": ...}, ...]``, the last
one the user's. The messages travel with the problem (``Problem.meta["messages"]``) and are what
the chat template renders; ``prompt_template`` formats the last user message, which is also the
problem's ``prompt`` text (a reward's ``prompt``); ``system_prompt`` is rendered first unless the
messages have a system message of their own (both at once is refused). Repeated conversations are
kept once. ``chat_template_kwargs`` (e.g. ``{"enable_thinking": False}``) are passed to the chat
template with every prompt, in training and evaluation alike (``Problem.meta["chat_template_kwargs"]``).

Every column of a row is kept for the rewards: a plain-function reward (``reward``) and the
functions of ``train.reward_funcs`` get them as keyword arguments (`components.rewards`).

Grading, in this order:

1. ``reward = "<name>"``: a plain-function reward from the `REWARDS` registry, called as
   ``fn(prompt, completion, **row)`` with every column of the row plus the mapped ``answer`` /
   ``tests``; a float passes iff it is >= ``pass_threshold`` (`components.rewards`);
2. a mapped ``tests`` column: the program of the completion runs against the tests in the
   sandbox (the `code_file` grader and test formats);
3. otherwise math-verify on the text after the last ``</think>`` against ``answer`` (as
   `math_file`).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

from components.registry import TASKS
from components.tasks.base import Problem, Verdict
from components.tasks.common import (CHAT_TEMPLATE_KWARGS_KEY, MESSAGES_KEY, SYSTEM_PROMPT_KEY, SplitTask,
                                     resolve_eval_size, seeded_split)

FIELDS = ("prompt", "answer", "tests")
DEFAULT_COLUMNS = {"prompt": ("prompt", "problem", "question"), "answer": ("answer",)}
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".arrow": "arrow"}
BUILDER_NAMES = ("json", "parquet", "csv", "arrow", "text")

DataFiles = Union[None, str, Sequence[str], Mapping[str, Union[str, Sequence[str]]]]


def resolve_source(path: str, data_files: DataFiles) -> tuple[str, DataFiles]:
    """(load_dataset path, data_files): a local file becomes its builder + data_files."""
    path = str(path or "")
    if path and Path(path).expanduser().is_file():
        if data_files is not None:
            raise ValueError(f"hf_dataset: path {path!r} is a file; do not also give data_files ({data_files!r})")
        file = str(Path(path).expanduser().resolve())
        return _builder_of(file), file
    if path and Path(path).expanduser().is_dir():
        return str(Path(path).expanduser().resolve()), data_files
    if not path:
        if data_files is None:
            raise ValueError(
                "hf_dataset: give a source: path = '<hub name>' or a local file/directory, or data_files = "
                "'/data/train.parquet' (a file, a list, or a dict split -> files)"
            )
        files = [data_files] if isinstance(data_files, str) else (
            [f for v in data_files.values() for f in ([v] if isinstance(v, str) else v)]
            if isinstance(data_files, Mapping) else list(data_files)
        )
        builders = {_builder_of(f) for f in files}
        if len(builders) != 1:
            raise ValueError(f"hf_dataset: data_files mix formats {sorted(builders)}; give path = one of {BUILDER_NAMES}")
        return builders.pop(), data_files
    if path in BUILDER_NAMES and data_files is None:
        raise ValueError(f"hf_dataset: path = {path!r} is a file format; give data_files too")
    if path.startswith((".", "/", "~")) or path.endswith(tuple(BUILDERS)):
        raise FileNotFoundError(f"hf_dataset: no such file or directory {path!r}")
    return path, data_files  # a Hub dataset name or a builder name with data_files


def _builder_of(file: str) -> str:
    suffix = Path(file).suffix.lower()
    if suffix not in BUILDERS:
        raise ValueError(f"hf_dataset: cannot tell the format of {file!r} (suffix {suffix!r}); use one of {sorted(BUILDERS)}")
    return BUILDERS[suffix]


def load_rows(path: str, data_files: DataFiles, split: str, *, name: Optional[str] = None,
              revision: Optional[str] = None, cache_dir: Optional[str] = None,
              load_kwargs: Optional[dict] = None) -> tuple[list[dict], list[str], str]:
    """(rows as dicts, column names, a short label of the source) of one split, via `datasets`."""
    from components.quiet import quiet_libraries

    quiet_libraries()
    import datasets

    saved = saved_dataset_dir(path) if data_files is None else None
    if saved is not None:  # a `Dataset.save_to_disk` / `DatasetDict.save_to_disk` directory (the Python API's)
        ds = load_saved_split(saved, split)
        return ds.to_list(), list(ds.column_names), f"{path}:{split}"
    source, files = resolve_source(path, data_files)
    label = f"{path or files}" + (f"[{name}]" if name else "") + f":{split}"
    try:
        ds = datasets.load_dataset(source, name=name, data_files=files, split=split, revision=revision,
                                   cache_dir=cache_dir, **dict(load_kwargs or {}))
    except ValueError as err:
        if "split" in str(err).lower():
            raise ValueError(f"hf_dataset: {label}: {err}") from err
        raise
    if not isinstance(ds, datasets.Dataset):
        raise ValueError(f"hf_dataset: {label} did not load as one split (got {type(ds).__name__}); give split = '<name>'")
    return ds.to_list(), list(ds.column_names), label


def saved_dataset_dir(path: str) -> Optional[Path]:
    """`path` when it is a directory written by `datasets`' `save_to_disk` (a DatasetDict's dataset_dict.json, or
    a Dataset's state.json), which `load_dataset` cannot read; else None."""
    p = Path(str(path or "")).expanduser()
    if p.is_dir() and ((p / "dataset_dict.json").is_file() or (p / "state.json").is_file()):
        return p.resolve()
    return None


def load_saved_split(path: Path, split: str):
    """Split `split` of a `save_to_disk` directory: a DatasetDict's split, or a lone Dataset as split "train"."""
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ValueError(f"hf_dataset: {str(path)!r} (saved with save_to_disk) has no split {split!r}; "
                             f"its splits: {sorted(ds)}")
        return ds[split]
    if split != "train":
        raise ValueError(f"hf_dataset: {str(path)!r} is one saved Dataset, read as split 'train'; got split = "
                         f"{split!r} (save a DatasetDict for several splits)")
    return ds


def resolve_columns(columns: Optional[Mapping[str, str]], present: Sequence[str], label: str,
                    need_answer: bool) -> dict[str, str]:
    """{field: column} for prompt / answer / tests; clear errors naming what is present."""
    columns = dict(columns or {})
    unknown = sorted(set(columns) - set(FIELDS))
    if unknown:
        raise ValueError(f"hf_dataset: columns maps unknown field(s) {unknown}; the fields are {list(FIELDS)}")
    out: dict[str, str] = {}
    for field in FIELDS:
        if field in columns:
            col = columns[field]
            if col not in present:
                raise ValueError(
                    f"hf_dataset: column {col!r} (columns[{field!r}]) is not in {label}; columns present: {list(present)}"
                )
            out[field] = col
        else:
            found = next((c for c in DEFAULT_COLUMNS.get(field, ()) if c in present), None)
            if found is not None:
                out[field] = found
    if "prompt" not in out:
        raise ValueError(
            f"hf_dataset: {label} has none of the prompt columns {list(DEFAULT_COLUMNS['prompt'])}; map one, e.g. "
            f"columns = {{'prompt': '<column>'}}; columns present: {list(present)}"
        )
    if need_answer and "answer" not in out:
        raise ValueError(
            f"hf_dataset: grading with math-verify needs an answer column: map one with columns = "
            f"{{'answer': '<column>'}} (or select a reward, or map 'tests'); columns present: {list(present)}"
        )
    return out


def _text(x: Any) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return ""
    if isinstance(x, (list, dict)):
        raise ValueError(f"holds a {type(x).__name__}, not text ({x!r:.80}); map a column of plain text, or of "
                         "conversations: lists of {'role': ..., 'content': ...} messages, the last one the user's")
    return str(x).strip()


def _messages(x: list) -> list[dict]:
    """A conversational prompt, checked: a non-empty list of {"role": str, "content": str} messages whose
    last one is the user's. ValueError saying what is wrong (the caller names the row and column)."""
    form = "a list of {'role': ..., 'content': ...} messages, the last one the user's"
    if not x:
        raise ValueError(f"holds an empty list; a conversational prompt is {form}")
    out = []
    for i, m in enumerate(x):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"holds a list whose item {i} ({m!r:.80}) is not a {{'role': str, 'content': str}} message; "
                             f"a conversational prompt is {form}")
        out.append({"role": m["role"], "content": m["content"]})
    if out[-1]["role"] != "user":
        raise ValueError(f"holds a conversation whose last message is the {out[-1]['role']!r}'s; the model answers the "
                         f"user, so a conversational prompt is {form}")
    return out


def _is_empty(x: Any) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x)) or not str(x).strip()


def _drop_none(tests: Any) -> Any:
    """Parquet / arrow give every struct field of a list of test cases; drop the unset ones."""
    if isinstance(tests, list):
        return [{k: v for k, v in t.items() if v is not None} if isinstance(t, dict) else t for t in tests]
    return tests


class HFDatasetTask(SplitTask):
    """Prompts from any `datasets.load_dataset` source, graded by a reward, tests, or math-verify.

    Args:
        path: a Hub dataset name, a local file or directory, or a builder name
            (json / parquet / csv / arrow) with `data_files`.
        data_files: local (or remote) data files, passed to `load_dataset`.
        name: the dataset config (subset) name; revision: a Hub revision.
        split: the training split (e.g. ``"train"``, or ``"train[:2000]"``).
        eval_split: a separate held-out split; else `eval_size` / `eval_fraction` of `split`.
        columns: {"prompt": column, "answer": column, "tests": column}.
        system_prompt: a system message rendered with every prompt (before a conversation's messages
            when they have no system message of their own).
        chat_template_kwargs: extra variables of the model's chat template, passed with every prompt
            (e.g. ``{"enable_thinking": False}`` for Qwen3).
        prompt_template: the user message; ``{prompt}`` is the prompt column's text, and
            ``{instruction}`` the code instruction (tests mapped). Default ``"{prompt}"``, or
            ``"{prompt}\n\n{instruction}"`` when tests are mapped.
        reward: a `REWARDS` name (plain-function reward); pass_threshold: a float reward
            passes iff it is >= this. reward_params: the reward's hyper-parameters in a resolved
            run (set by the trainer; None: as gin configures it).
        max_answer_chars: math-verify grades at most this many trailing answer characters.
        cpu_seconds / wall_seconds / memory_mb / max_tests / allow_network / allow_unsafe /
            python: the sandbox of the tests grader (`code_file`).
        cache_dir / load_kwargs: passed to `load_dataset`.
    """

    name = "hf_dataset"

    def __init__(
        self,
        path: str = "",
        data_files: DataFiles = None,
        name: Optional[str] = None,
        split: str = "train",
        eval_split: Optional[str] = None,
        eval_size: Optional[int] = None,
        eval_fraction: Optional[float] = None,
        columns: Optional[dict] = None,
        system_prompt: Optional[str] = None,
        prompt_template: Optional[str] = None,
        chat_template_kwargs: Optional[dict] = None,
        reward: Optional[str] = None,
        reward_params: Optional[dict] = None,
        pass_threshold: float = 1.0,
        seed: int = 0,
        reward_correct: float = 1.0,
        reward_incorrect: float = -1.0,
        max_answer_chars: int = 4000,
        revision: Optional[str] = None,
        cache_dir: Optional[str] = None,
        load_kwargs: Optional[dict] = None,
        cpu_seconds: float = 2.0,
        wall_seconds: float = 6.0,
        memory_mb: int = 512,
        max_tests: Optional[int] = None,
        allow_network: bool = False,
        allow_unsafe: bool = False,
        python: Optional[str] = None,
    ):
        from components.tasks.reward_verdicts import check_reward

        if prompt_template is None:
            prompt_template = "{prompt}\n\n{instruction}" if "tests" in dict(columns or {}) else "{prompt}"
        if "{prompt}" not in prompt_template:
            raise ValueError(f"hf_dataset: prompt_template must contain '{{prompt}}', got {prompt_template!r}")
        if eval_split is not None and (eval_size is not None or eval_fraction is not None):
            raise ValueError(
                f"hf_dataset: give eval_split ({eval_split!r}) or eval_size / eval_fraction "
                f"({eval_size!r} / {eval_fraction!r}), not both"
            )
        if chat_template_kwargs is not None and (not isinstance(chat_template_kwargs, Mapping)
                                                 or not all(isinstance(k, str) for k in chat_template_kwargs)):
            raise ValueError(f"hf_dataset: chat_template_kwargs must be a dict of template variables, e.g. "
                             f"{{'enable_thinking': False}}, got {chat_template_kwargs!r}")
        self.chat_template_kwargs = dict(chat_template_kwargs) if chat_template_kwargs else None
        self.seed = seed
        self.reward = check_reward(reward)
        self.reward_params = dict(reward_params) if reward_params is not None else None  # a resolved run's values
        self.pass_threshold = float(pass_threshold)
        self.reward_correct = float(reward_correct)
        self.reward_incorrect = float(reward_incorrect)
        self.system_prompt = system_prompt or None
        self.prompt_template = prompt_template
        self.max_answer_chars = int(max_answer_chars)
        load = dict(name=name, revision=revision, cache_dir=cache_dir, load_kwargs=load_kwargs)
        rows, present, label = load_rows(path, data_files, split, **load)
        mapped = dict(columns or {})
        grading = "reward" if self.reward else ("tests" if "tests" in mapped else "math_verify")
        self.columns = resolve_columns(mapped, present, label, need_answer=grading == "math_verify")
        self.grading = grading
        self.label = label
        self._rows: dict[str, dict] = {}  # problem id -> the row a reward / the grader sees
        self._tests: dict[str, dict] = {}
        if grading == "tests":
            from components.tasks import sandbox

            self.limits = sandbox.SandboxLimits(cpu_seconds=cpu_seconds, wall_seconds=wall_seconds,
                                                memory_bytes=int(memory_mb) * 2**20)
            self.sandbox_config = sandbox.SandboxConfig(
                python=python, hide_paths=_data_paths(path, data_files, cache_dir),
                allow_network=allow_network, allow_unsafe=allow_unsafe,
            )
            self.max_tests = max_tests
            sandbox.check_available(self.sandbox_config)  # refuse now where programs cannot be isolated
        stem = _short_label(path, data_files, name)
        self.load_stats = {"rows_read": len(rows)}
        train = self._problems(rows, label, stem, split, "train")
        if eval_split is not None:
            eval_rows, eval_present, eval_label = load_rows(path, data_files, eval_split, **load)
            resolve_columns(mapped, eval_present, eval_label, need_answer=grading == "math_verify")
            held = self._problems(eval_rows, eval_label, stem, eval_split, "eval")
            held_texts = {_prompt_key(p) for p in held}
            overlap = [p for p in train if _prompt_key(p) in held_texts]
            train = [p for p in train if _prompt_key(p) not in held_texts]
            self.load_stats.update(eval_rows_read=len(eval_rows), dropped_in_eval_split=len(overlap))
            if not train:
                raise ValueError(f"hf_dataset: every prompt of {label} is also in {eval_label}; nothing left to train on")
        else:
            n_eval = resolve_eval_size(len(train), eval_size, eval_fraction, default=1000)
            train, held = seeded_split(train, n_eval, seed)
            held = [_with_split(p, "eval") for p in held]
        self._train, self._eval = train, held
        keep = {p.id for p in train} | {p.id for p in held}
        self._rows = {k: v for k, v in self._rows.items() if k in keep}
        self._tests = {k: v for k, v in self._tests.items() if k in keep}

    # -- problems ------------------------------------------------------------------------
    def _problems(self, rows: list[dict], label: str, stem: str, split: str, role: str) -> list[Problem]:
        from components.tasks.code_file import code_instruction, parse_tests

        cols = self.columns
        out, seen = [], set()
        empty = dup = 0
        for i, row in enumerate(rows):
            where = f"{label} row {i}"
            raw = row.get(cols["prompt"])
            messages = None
            try:
                if isinstance(raw, list):
                    messages = _messages(raw)
                    text = messages[-1]["content"].strip()
                else:
                    text = _text(raw)
            except ValueError as err:
                raise ValueError(f"hf_dataset: {where}: column {cols['prompt']!r} {err}") from None
            if messages is not None and self.system_prompt and any(m["role"] == "system" for m in messages):
                raise ValueError(f"hf_dataset: {where}: the conversation in column {cols['prompt']!r} has a system "
                                 f"message, and system_prompt = {self.system_prompt!r} gives another; drop one of them")
            answer = row.get(cols["answer"]) if "answer" in cols else None
            if not text or (self.grading == "math_verify" and _is_empty(answer)):
                empty += 1
                continue
            key = text if messages is None else json.dumps(messages, sort_keys=True)
            if key in seen:
                dup += 1
                continue
            seen.add(key)
            pid = f"hf_dataset:{stem}:{split}:{i}"
            instruction = ""
            if "tests" in cols:
                tests_row = {"tests": _drop_none(row.get(cols["tests"]))}
                for key in ("fn_name", "metadata", "entry_point"):
                    if row.get(key) is not None:
                        tests_row[key] = row[key]
                tests = parse_tests(tests_row, where, prompt=text)  # a Python prompt's helpers (HumanEval)
                instruction = code_instruction(tests, row.get("starter_code"))
                self._tests[pid] = tests
            kept = dict(row)  # every column: a reward (hf_dataset.reward, train.reward_funcs) sees the whole row
            if answer is not None:
                kept["answer"] = answer
            if "tests" in cols:
                kept["tests"] = self._tests[pid]
            self._rows[pid] = kept
            meta = {"split": role, "row": i, "source": label}
            if self.system_prompt:
                meta[SYSTEM_PROMPT_KEY] = self.system_prompt
            if self.chat_template_kwargs:
                meta[CHAT_TEMPLATE_KWARGS_KEY] = dict(self.chat_template_kwargs)
            prompt = self.prompt_template.format(prompt=text, instruction=instruction).strip()
            if messages is not None:  # the template formats the last (user) message; the rest as given
                meta[MESSAGES_KEY] = messages[:-1] + [{"role": "user", "content": prompt}]
            out.append(Problem(id=pid, prompt=prompt, answer=None if "tests" in cols else answer, meta=meta))
        key = f"{role}_dropped"
        self.load_stats[f"{key}_empty"] = self.load_stats.get(f"{key}_empty", 0) + empty
        self.load_stats[f"{key}_duplicate"] = self.load_stats.get(f"{key}_duplicate", 0) + dup
        if not out:
            raise ValueError(f"hf_dataset: {label} has no usable rows ({empty} empty, {dup} duplicate of {len(rows)})")
        return out

    def row_of(self, problem: Problem) -> dict:
        """The dataset row (plus mapped answer / tests) a reward is called with."""
        try:
            return self._rows[problem.id]
        except KeyError:
            raise ValueError(f"problem {problem.id!r} does not belong to this hf_dataset task ({self.label})") from None

    def tests_of(self, problem: Problem) -> dict:
        try:
            return self._tests[problem.id]
        except KeyError:
            raise ValueError(f"problem {problem.id!r} has no tests in this hf_dataset task ({self.label})") from None

    def solution_text(self, problem: Problem) -> str:
        """A minimal correct completion for math-verify grading (the answer boxed), e.g. for SFT."""
        return f"\\boxed{{{self.row_of(problem).get('answer')}}}"

    # -- grading ---------------------------------------------------------------------------
    def verification_seconds(self, problem: Problem):
        """The sandbox run's wall budget for a problem graded by its `tests` (else None)."""
        if self.grading != "tests":
            return None
        from components.tasks.code_file import verification_seconds

        return verification_seconds(self.tests_of(problem), self.limits, self.max_tests)

    def verify(self, problem: Problem, completion: str) -> Verdict:
        if self.grading == "reward":
            from components.tasks.reward_verdicts import reward_verdict

            return reward_verdict(self.reward, problem.prompt, completion, self.row_of(problem),
                                  pass_threshold=self.pass_threshold, reward_correct=self.reward_correct,
                                  reward_incorrect=self.reward_incorrect,
                                  params=self.reward_params)
        if self.grading == "tests":
            from components.tasks.code_file import grade_code_completion, run_program_tests

            run = lambda p, code: run_program_tests(self.tests_of(p), code, limits=self.limits,
                                                    config=self.sandbox_config, max_tests=self.max_tests)
            return grade_code_completion(self, problem, completion, run)
        from components.tasks.reward_verdicts import math_answer_matches

        try:
            return self.verdict(math_answer_matches(completion, self.row_of(problem)["answer"], self.max_answer_chars))
        except Exception as err:  # includes math-verify's TimeoutException
            return self.verdict(False, error=f"{type(err).__name__}: {err}")


def _data_paths(path: str, data_files: DataFiles, cache_dir: Optional[str]) -> tuple:
    """Where the tests can be read from (the local files, their directories, the datasets cache):
    hidden from the programs under test."""
    import datasets

    files = [path] if path else []
    if isinstance(data_files, str):
        files.append(data_files)
    elif isinstance(data_files, Mapping):
        files += [f for v in data_files.values() for f in ([v] if isinstance(v, str) else v)]
    elif data_files is not None:
        files += list(data_files)
    out = []
    for f in files + [cache_dir or datasets.config.HF_DATASETS_CACHE]:
        p = Path(str(f)).expanduser()
        if p.exists():
            real = os.path.realpath(p)
            out += [real] + ([os.path.dirname(real)] if p.is_file() else [])
    return tuple(dict.fromkeys(out))


def _prompt_key(p: Problem) -> str:
    """What makes two problems the same prompt: the text, or a conversation's messages."""
    messages = (p.meta or {}).get(MESSAGES_KEY)
    return p.prompt if messages is None else json.dumps(messages, sort_keys=True)


def _with_split(p: Problem, split: str) -> Problem:
    return Problem(id=p.id, prompt=p.prompt, answer=p.answer, meta={**(p.meta or {}), "split": split})


def _short_label(path: str, data_files: DataFiles, name: Optional[str]) -> str:
    """A short, stable name of the source for problem ids: the file stem, or the hub name (+ config)."""
    if path and os.path.exists(str(path)):
        base = Path(str(path)).stem
    elif path and path not in BUILDER_NAMES:
        base = str(path)
    else:
        first = data_files if isinstance(data_files, str) else (
            next(iter(data_files.values())) if isinstance(data_files, Mapping) else list(data_files or ["files"])[0]
        )
        first = first if isinstance(first, str) else list(first)[0]
        base = Path(first).stem
    return base + (f"[{name}]" if name else "")


# Registered without rebinding the class name: instances stay picklable (gin's wrapper is a
# different class object of the same name), and `TASKS.get("hf_dataset")` honours gin bindings.
TASKS.register("hf_dataset", ranges={"eval_size": ">= 0", "eval_fraction": "[0, 1)", "max_answer_chars": ">= 1",
                                     "cpu_seconds": "> 0", "wall_seconds": "> 0", "memory_mb": ">= 1", "max_tests": ">= 1"})(HFDatasetTask)
