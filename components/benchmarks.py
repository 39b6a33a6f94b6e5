"""Downstream benchmarks (AIME, MATH-500, LiveCodeBench, ...) from any `datasets` source.

A benchmark is a set of problems and a verifier, evaluated as a whole (no train split):
`scalerl eval` and ``train.downstream_benchmarks`` use it through
`components.trainer.evaluation.evaluate_benchmark` (mean@k and unbiased pass@k).

    load_benchmark("/data/aime24.jsonl")                     # local jsonl / json / parquet / csv / arrow
    load_benchmark({"path": "HuggingFaceH4/aime_2024", "name": "aime24"})   # a hub dataset
    load_benchmark({"path": "/data/lcb.jsonl", "prompt_column": "question_content", "tests_column": "public_test_cases"})

A spec is a string (a file or a hub dataset name) or a dict with the keys below. Rows are
read by ``datasets.load_dataset`` (`components.tasks.hf_dataset.load_rows`: a local file by its
suffix; anything else as a hub name, which `datasets` downloads the first time: run that where
downloads are allowed).

| key | default | what |
|---|---|---|
| ``path`` | required | local file or hub dataset name |
| ``name`` | file stem / last part of the hub name | the benchmark's name in records and figures |
| ``split`` | ``"train"`` | the split (local files have only ``train``) |
| ``subset`` | None | the hub dataset's configuration |
| ``grader`` | ``"auto"`` | ``"math"``, ``"code"``, ``"reward"`` or ``"auto"`` (reward when ``reward`` is set, code when a tests column exists, else math) |
| ``prompt_column`` | first of problem, question, prompt | the statement |
| ``answer_column`` | first of answer, final_answer, expected_answer | the gold answer |
| ``tests_column`` | first of tests, test, input_output, public_test_cases | the unit tests (code) |
| ``reward`` / ``pass_threshold`` | None / 1.0 | a plain-function reward (`REWARDS`), called with the row |
| ``prompt_template`` | math: boxed-answer instruction; code: the code_file instruction | ``{problem}`` (and ``{instruction}`` for code); a problem already in the template's form is kept (`apply_template`) |
| ``system_prompt`` | None | a system message before every problem (chat template) |
| ``limit`` | None | keep the first N problems |
| code limits | as code_file | ``cpu_seconds``, ``wall_seconds``, ``memory_mb``, ``max_tests``, ``allow_network``, ``allow_unsafe`` (ignored where ``grader = "auto"`` finds no tests) |

Grading is the zoo's own: math by math-verify on the text after the last ``</think>`` (the
``math_verify`` reward), code by running the program of the completion on the tests in the
sandbox (`components.tasks.code_file`, any of its test layouts, JSON strings included).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from components.tasks.base import Problem, Task, Verdict
from components.tasks.common import SYSTEM_PROMPT_KEY

__all__ = ["Benchmark", "BenchmarkTask", "load_benchmark", "load_benchmarks", "benchmark_name", "BENCHMARK_KEYS",
           "GRADERS", "apply_template"]

GRADERS = ("auto", "math", "code", "reward")
FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".pq", ".csv", ".arrow")
PROMPT_COLUMNS = ("problem", "question", "prompt")
ANSWER_COLUMNS = ("answer", "final_answer", "expected_answer")
TESTS_COLUMNS = ("tests", "test", "input_output", "public_test_cases")
MATH_TEMPLATE = "{problem}\n\nPlease reason step by step, and put your final answer within \\boxed{{}}."
CODE_TEMPLATE = "{problem}\n\n{instruction}"
CODE_LIMIT_KEYS = ("cpu_seconds", "wall_seconds", "memory_mb", "max_tests", "allow_network", "allow_unsafe", "python")
BENCHMARK_KEYS = ("path", "name", "split", "subset", "grader", "prompt_column", "answer_column", "tests_column",
                  "reward", "pass_threshold", "prompt_template", "system_prompt", "limit", *CODE_LIMIT_KEYS)


@dataclasses.dataclass
class Benchmark:
    """Problems + the task that verifies them (its `verify`), ready for `evaluate_benchmark`."""

    name: str
    problems: list
    task: Task
    source: str
    grader: str

    def __len__(self) -> int:
        return len(self.problems)


def _as_dict(spec: Union[str, Path, Mapping[str, Any]]) -> dict:
    if isinstance(spec, (str, Path)):
        spec = {"path": str(spec)}
    if not isinstance(spec, Mapping):
        raise ValueError(f"a benchmark is a file / hub dataset name or a dict with 'path'; got {spec!r}")
    spec = dict(spec)
    unknown = sorted(set(spec) - set(BENCHMARK_KEYS))
    if unknown:
        raise ValueError(f"benchmark spec has unknown key(s) {unknown}; valid keys: {list(BENCHMARK_KEYS)}")
    if not spec.get("path"):
        raise ValueError(f"benchmark spec needs a 'path' (a local file or a hub dataset name); got {spec!r}")
    if spec.get("grader", "auto") not in GRADERS:
        raise ValueError(f"benchmark grader must be one of {list(GRADERS)}, got {spec['grader']!r}")
    return spec


def benchmark_name(spec: Union[str, Mapping[str, Any]]) -> str:
    """The name a spec gives its benchmark (``name``, else the file stem / the hub name's last part)."""
    spec = _as_dict(spec)
    if spec.get("name"):
        return str(spec["name"])
    path = str(spec["path"])
    if Path(path).suffix.lower() in FILE_SUFFIXES:
        return Path(path).stem
    return path.rstrip("/").rsplit("/", 1)[-1]


def read_rows(spec: Union[str, Mapping[str, Any]]) -> tuple[list[dict], list[str]]:
    """(rows as dicts, column names) of the benchmark's split, through ``datasets.load_dataset``."""
    from components.tasks.hf_dataset import load_rows

    spec = _as_dict(spec)
    path = str(spec["path"])
    p = Path(path).expanduser()
    if p.suffix.lower() in FILE_SUFFIXES and not p.is_file():
        raise FileNotFoundError(f"benchmark file {path!r} does not exist")
    try:
        rows, columns, _ = load_rows(path, None, spec.get("split") or "train", name=spec.get("subset"))
    except Exception as err:
        # a JSON file that does not parse: name its first broken line, counted from 1 (datasets
        # says only "position N" of a block, or a 0-based row in a log line)
        broken = json_syntax_error(p) if p.suffix.lower() in (".jsonl", ".json") and p.is_file() else None
        if broken:
            raise ValueError(f"benchmark {path!r}: {broken}") from err
        if isinstance(err, (FileNotFoundError, ValueError)):
            raise
        # datasets' own errors (no such split, unreadable file, not on the hub)
        raise ValueError(f"benchmark {path!r} could not be loaded with datasets: {type(err).__name__}: {err}") from err
    if spec.get("limit") is not None:
        limit = int(spec["limit"])
        if limit < 1:
            raise ValueError(f"benchmark limit must be >= 1, got {limit}")
        rows = rows[:limit]
    if not rows:
        raise ValueError(f"benchmark {path!r} has no rows")
    return rows, columns


def json_syntax_error(path: Union[str, Path]) -> Optional[str]:
    """Where a .jsonl / .json file first fails to parse, as "line N (column C): <why>: <the line>"
    with N counted from 1; None when it parses. A file whose text starts with '[' is one JSON
    document; any other is JSON Lines (one value per line, blank lines skipped)."""
    import json

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        return f"cannot be read as UTF-8 text: {err}"
    lines = text.splitlines()

    def where(lineno: int, colno: int, msg: str) -> str:
        line = lines[lineno - 1] if 0 < lineno <= len(lines) else ""
        shown = line if len(line) <= 120 else line[:117] + "..."
        return f"line {lineno} (column {colno}) is not valid JSON: {msg}: {shown!r}"

    if text.lstrip().startswith("["):
        try:
            json.loads(text)
        except json.JSONDecodeError as err:
            return where(err.lineno, err.colno, err.msg)
        return None
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            json.loads(line)
        except json.JSONDecodeError as err:
            return where(i, err.colno, err.msg)
    return None


def _pick(columns: Sequence[str], given: Optional[str], candidates: Sequence[str], what: str, path: str) -> Optional[str]:
    if given:
        if given not in columns:
            raise ValueError(f"benchmark {path!r} has no {what} column {given!r}; columns present: {list(columns)}")
        return given
    return next((c for c in candidates if c in columns), None)


def apply_template(template: str, text: str, instruction: str = "") -> str:
    """The user message: `template` with ``{problem}`` (and ``{instruction}``) filled in.

    A problem already written in the template's form is kept as it is: where the template has
    no ``{instruction}`` and the problem begins with the template's text before ``{problem}``
    and ends with its text after it (e.g. "12+7-3=" under a run's "{problem}="), it is not
    wrapped a second time.
    """
    if "{instruction}" not in template:
        head, _, tail = template.partition("{problem}")
        try:
            head, tail = head.format(), tail.format()  # {{ and }} as the text they stand for
        except (IndexError, KeyError, ValueError):
            head = tail = ""
        stripped = text.strip()
        if (head.strip() or tail.strip()) and stripped.startswith(head.strip()) and stripped.endswith(tail.strip()) \
                and len(stripped) > len(head.strip()) + len(tail.strip()):
            return stripped
    return template.format(problem=text, instruction=instruction).strip()


def _text(x: Any) -> str:
    if x is None or (isinstance(x, float) and x != x):
        return ""
    return str(x).strip()


class BenchmarkTask(Task):
    """Every row of a benchmark as a held-out problem, graded by math-verify, tests, or a reward.

    `verify` never raises: a crash in grading is a failed sample with `error` set.
    """

    name = "benchmark"

    def __init__(self, name: str, rows: Sequence[Mapping], *, grader: str, prompt_col: str,
                 answer_col: Optional[str] = None, tests_col: Optional[str] = None, reward: Optional[str] = None,
                 pass_threshold: float = 1.0, prompt_template: Optional[str] = None, system_prompt: Optional[str] = None,
                 cpu_seconds: float = 2.0, wall_seconds: float = 6.0, memory_mb: int = 512,
                 max_tests: Optional[int] = None, allow_network: bool = False, allow_unsafe: bool = False,
                 python: Optional[str] = None, reward_params: Optional[Mapping[str, Any]] = None):
        if grader not in ("math", "code", "reward"):
            raise ValueError(f"grader must be 'math', 'code' or 'reward', got {grader!r}")
        self.bench = str(name)
        self.grader = grader
        self.reward_name = {"math": "math_verify", "reward": reward, "code": None}[grader]
        # the reward's hyper-parameters as the run resolved them (None: as gin configures it, `scalerl eval`)
        self.reward_params = dict(reward_params) if reward_params is not None else None
        if grader == "reward":
            from components.tasks.reward_verdicts import check_reward

            check_reward(reward)
        self.pass_threshold = float(pass_threshold)
        template = prompt_template or (CODE_TEMPLATE if grader == "code" else MATH_TEMPLATE)
        if "{problem}" not in template:
            raise ValueError(f"benchmark {name!r}: prompt_template must contain '{{problem}}', got {template!r}")
        self._rows: dict[str, dict] = {}
        self._tests: dict[str, dict] = {}
        self._eval: list[Problem] = []
        if grader == "code":
            from components.tasks import sandbox

            self.limits = sandbox.SandboxLimits(cpu_seconds=cpu_seconds, wall_seconds=wall_seconds,
                                                memory_bytes=int(memory_mb) * 2**20)
            self.sandbox_config = sandbox.SandboxConfig(python=python, allow_network=allow_network, allow_unsafe=allow_unsafe)
            self.max_tests = max_tests
        for i, row in enumerate(rows):
            self._eval.append(self._problem(i, row, prompt_col, answer_col, tests_col, template, system_prompt))
        if grader == "code":
            sandbox.check_available(self.sandbox_config)  # refuse now where programs cannot be isolated

    def _problem(self, i: int, row: Mapping, prompt_col: str, answer_col: Optional[str], tests_col: Optional[str],
                 template: str, system_prompt: Optional[str]) -> Problem:
        where = f"benchmark {self.bench!r} row {i}"
        text = _text(row.get(prompt_col))
        if not text:
            raise ValueError(f"{where} has an empty {prompt_col!r}")
        pid = f"{self.bench}:{i}"
        kept = {k: v for k, v in row.items()}
        answer = row.get(answer_col) if answer_col else None
        instruction = ""
        if self.grader == "math" and not _text(answer):
            raise ValueError(f"{where} has an empty answer column {answer_col!r}")
        if answer_col:
            kept["answer"] = answer
        if self.grader == "code":
            from components.tasks.code_file import code_instruction, parse_tests

            tests_row = {"tests": row.get(tests_col)}
            if tests_col == "test":  # MBPP / HumanEval asserts
                tests_row = {"test": row.get(tests_col), "entry_point": row.get("entry_point")}
            for key in ("fn_name", "metadata", "entry_point"):
                if row.get(key) is not None:
                    tests_row.setdefault(key, row[key])
            tests = parse_tests(tests_row, where)
            self._tests[pid] = tests
            instruction = code_instruction(tests, row.get("starter_code"))
            kept["tests"] = tests
        self._rows[pid] = kept
        meta = {"split": "benchmark", "row": i, "task": self.bench}
        if system_prompt:
            meta[SYSTEM_PROMPT_KEY] = system_prompt
        prompt = apply_template(template, text, instruction)
        return Problem(id=pid, prompt=prompt, answer=None if self.grader == "code" else answer, meta=meta)

    def train_problems(self) -> list[Problem]:
        return []

    def eval_problems(self) -> list[Problem]:
        return list(self._eval)

    def row_of(self, problem: Problem) -> dict:
        try:
            return self._rows[problem.id]
        except KeyError:
            raise ValueError(f"problem {problem.id!r} does not belong to benchmark {self.bench!r}") from None

    def verify(self, problem: Problem, completion: str) -> Verdict:
        try:
            row = self.row_of(problem)
        except ValueError as err:
            return self.verdict(False, error=str(err))
        if self.grader == "code":
            from components.tasks.code_file import grade_code_completion, run_program_tests

            run = lambda p, code: run_program_tests(self._tests[p.id], code, limits=self.limits,
                                                    config=self.sandbox_config, max_tests=self.max_tests)
            return grade_code_completion(self, problem, completion, run)
        from components.tasks.reward_verdicts import reward_verdict

        return reward_verdict(self.reward_name, problem.prompt, completion, row, pass_threshold=self.pass_threshold,
                              reward_correct=self.reward_correct, reward_incorrect=self.reward_incorrect,
                              params=self.reward_params if self.grader == "reward" else None)


def load_benchmark(spec: Union[str, Mapping[str, Any]],
                   reward_params: Optional[Callable[[str], Optional[Mapping[str, Any]]]] = None) -> Benchmark:
    """Load and validate one benchmark (see the module doc for the spec). `reward_params(name)`: the
    hyper-parameters a plain-function reward is called with (a run's resolved values; None: gin's)."""
    spec = _as_dict(spec)
    path = str(spec["path"])
    name = benchmark_name(spec)
    rows, columns = read_rows(spec)
    prompt_col = _pick(columns, spec.get("prompt_column"), PROMPT_COLUMNS, "prompt", path)
    if prompt_col is None:
        raise ValueError(f"benchmark {path!r}: no prompt column (tried {list(PROMPT_COLUMNS)}); "
                         f"columns present: {columns}; set prompt_column")
    tests_col = _pick(columns, spec.get("tests_column"), TESTS_COLUMNS, "tests", path)
    answer_col = _pick(columns, spec.get("answer_column"), ANSWER_COLUMNS, "answer", path)
    grader = spec.get("grader", "auto")
    if grader == "auto":
        grader = "reward" if spec.get("reward") else ("code" if tests_col is not None else "math")
    if grader == "reward" and not spec.get("reward"):
        raise ValueError(f"benchmark {path!r}: grader 'reward' needs reward = '<a REWARDS name>'")
    if grader == "code" and tests_col is None:
        raise ValueError(f"benchmark {path!r}: grader 'code' needs a tests column (tried {list(TESTS_COLUMNS)}); "
                         f"columns present: {columns}; set tests_column")
    if grader == "math" and answer_col is None:
        raise ValueError(f"benchmark {path!r}: grader 'math' needs an answer column (tried {list(ANSWER_COLUMNS)}); "
                         f"columns present: {columns}; set answer_column")
    code_opts = {k: spec[k] for k in CODE_LIMIT_KEYS if k in spec}
    if code_opts and grader != "code":
        if spec.get("grader", "auto") != "auto":
            raise ValueError(f"benchmark {path!r}: {sorted(code_opts)} only apply to grader 'code' (this one is {grader!r})")
        code_opts = {}  # shared options (scalerl eval --allow-unsafe) for a benchmark that turned out math
    task = BenchmarkTask(name, rows, grader=grader, prompt_col=prompt_col, answer_col=answer_col,
                         tests_col=tests_col if grader == "code" else None, reward=spec.get("reward"),
                         pass_threshold=spec.get("pass_threshold", 1.0), prompt_template=spec.get("prompt_template"),
                         system_prompt=spec.get("system_prompt"),
                         reward_params=reward_params(spec["reward"]) if reward_params and spec.get("reward") else None,
                         **code_opts)
    return Benchmark(name=name, problems=task.eval_problems(), task=task, source=path, grader=grader)


def load_benchmarks(specs: Sequence[Union[str, Mapping[str, Any]]],
                    reward_params: Optional[Callable[[str], Optional[Mapping[str, Any]]]] = None) -> list[Benchmark]:
    """Every benchmark of `specs`; two with the same name are an error (records are keyed by name).
    `reward_params`: as `load_benchmark`."""
    if isinstance(specs, (str, Mapping)):
        specs = [specs]
    out = [load_benchmark(s, reward_params) for s in specs]
    names = [b.name for b in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"two benchmarks are named {dup}; give each a distinct 'name'")
    return out
