"""`code_file`: programming problems with unit tests from a local JSONL file, graded in a sandbox.

Schema: one JSON object per line with

- ``problem`` (or the column named by `problem_key`): the statement;
- the tests, in one of three forms:
  * ``tests``: a list (or a JSON string of a list, as DeepCoder / LiveCodeBench store it) of
    ``{"input": str, "output": str}`` standard-input / standard-output cases. A case may set
    ``"testtype": "functional"``: then ``input`` holds one JSON value per line (the positional
    arguments), ``output`` the JSON of the return value, and the row names the function in
    ``fn_name`` (or ``metadata.func_name``); a method of a ``Solution`` class is found too.
    ``"type": "stdin_stdout"`` / ``"function_call"`` are accepted as synonyms (PrimeIntellect),
    and so is the APPS / TACO layout ``{"inputs": [...], "outputs": [...], "fn_name"?}``
    (a call's expected value may be wrapped in a one-element list, as TACO does).
  * ``test``: Python source with ``assert`` statements run after the program (MBPP style);
    with ``entry_point`` and a ``def check(`` in it, ``check(<entry_point>)`` is called
    (HumanEval style).
- optional ``starter_code``: shown in the prompt.

The program is the last fenced code block of the completion's answer part (the text after
the last ``</think>``), preferring ```python blocks; without a fence, the whole answer.
stdin/stdout cases run one sandboxed process each and compare the outputs line by line with
trailing whitespace and trailing blank lines ignored; functional cases run in one process and
compare return values with ``==`` (expected outputs never enter the sandbox). The completion
passes iff every case passes. See `components.tasks.sandbox` for the isolation.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any, Optional

from components.registry import TASKS
from components.tasks import sandbox
from components.tasks.base import Problem, Verdict
from components.tasks.common import SplitTask, extract_code, resolve_eval_size, seeded_split, strip_special_tokens, strip_thinking

STDIO_INSTRUCTION = (
    "Write a Python 3 program that reads the input from standard input and prints the answer to "
    "standard output. Put the whole program in one ```python code block."
)
FUNCTION_INSTRUCTION = "Write a Python 3 solution that defines `{fn_name}`. Put the code in one ```python code block."
ASSERT_INSTRUCTION = "Write a Python 3 solution. Put the code in one ```python code block."
DEFAULT_PROMPT_TEMPLATE = "{problem}\n\n{instruction}"


def load_jsonl(path: str | Path) -> list[dict]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"code_file: no such file {str(path)!r}")
    rows = []
    try:
        if p.suffix.lower() == ".json":
            data = json.loads(p.read_text())
            if not isinstance(data, list):
                raise ValueError("a .json file must hold a list of objects")
            return data
        with open(p, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as err:
                        raise ValueError(f"line {lineno}: {err}") from err
    except (OSError, ValueError) as err:
        raise ValueError(f"code_file: cannot read {str(path)!r}: {err}") from err
    return rows


def parse_tests(row: dict, where: str) -> dict:
    """Normalise a row's tests to {"kind": "stdio"|"functional"|"assert", ...}."""
    if isinstance(row.get("test"), str) and row["test"].strip():
        return {"kind": "assert", "code": row["test"], "entry_point": row.get("entry_point")}
    tests = row.get("tests")
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError:
            return {"kind": "assert", "code": tests, "entry_point": row.get("entry_point")}
    if isinstance(tests, dict) and "inputs" in tests and "outputs" in tests:
        try:
            tests = _from_apps(tests, row)
        except ValueError as err:
            raise ValueError(f"code_file: {where} tests: {err}") from err
    if not isinstance(tests, list) or not tests:
        raise ValueError(
            f"code_file: {where} has no tests: give 'tests' (a list of {{'input', 'output'}} cases) "
            f"or 'test' (Python asserts); keys present: {sorted(row)}"
        )
    cases = []
    for j, case in enumerate(tests):
        if not isinstance(case, dict) or "input" not in case or "output" not in case:
            raise ValueError(f"code_file: {where} test {j} must be an object with 'input' and 'output', got {case!r:.200}")
        kind = str(case.get("testtype", case.get("type", "stdin")))
        kind = {"stdin_stdout": "stdin", "function_call": "functional"}.get(kind, kind)
        cases.append((str(case["input"]), str(case["output"]), kind))
    kinds = {t for _, _, t in cases}
    if kinds <= {"stdin", "stdio"}:
        return {"kind": "stdio", "cases": [(i, o) for i, o, _ in cases]}
    if kinds == {"functional"}:
        meta = row.get("metadata") or {}
        if isinstance(meta, str):
            try:
                meta = json.loads(meta)
            except json.JSONDecodeError:
                meta = {}
        fn_name = row.get("fn_name") or (meta.get("func_name") if isinstance(meta, dict) else None)
        if not fn_name:
            raise ValueError(f"code_file: {where} has functional tests but no 'fn_name' (or metadata.func_name)")
        return {"kind": "functional", "fn_name": fn_name, "cases": [(i, o) for i, o, _ in cases]}
    raise ValueError(f"code_file: {where} mixes test types {sorted(kinds)}; use 'stdin' or 'functional'")


def _from_apps(tests: dict, row: dict) -> list[dict]:
    """APPS / TACO layout {"inputs": [...], "outputs": [...], "fn_name"?} -> a list of cases."""
    fn_name = tests.get("fn_name") or row.get("fn_name")
    if len(tests["inputs"]) != len(tests["outputs"]):
        raise ValueError(f"{len(tests['inputs'])} inputs but {len(tests['outputs'])} outputs")
    if not fn_name:
        return [{"input": _join(i), "output": _join(o)} for i, o in zip(tests["inputs"], tests["outputs"])]
    row.setdefault("fn_name", fn_name)
    cases = []
    for args, out in zip(tests["inputs"], tests["outputs"]):
        args = args if isinstance(args, list) else [args]
        cases.append({"input": "\n".join(json.dumps(a) for a in args), "output": json.dumps(out), "testtype": "functional"})
    return cases


def _join(x: Any) -> str:
    return "\n".join(map(str, x)) if isinstance(x, list) else str(x)


def outputs_match(got: str, expected: str) -> bool:
    """Line-by-line equality ignoring trailing whitespace and trailing blank lines."""

    def norm(s: str) -> list[str]:
        lines = [ln.rstrip() for ln in s.replace("\r\n", "\n").split("\n")]
        while lines and not lines[-1]:
            lines.pop()
        return lines

    return norm(got) == norm(expected)


_FUNCTIONAL_HARNESS = '''

# ---- test harness (appended by the grader) ----
import json as _json, sys as _sys
def _find(name):
    g = globals()
    if name in g and callable(g[name]):
        return g[name]
    if "Solution" in g:
        return getattr(g["Solution"](), name)
    raise NameError(name)
_results = []
for _args in {inputs!r}:
    try:
        _out = _find({fn_name!r})(*[_json.loads(_a) for _a in _args.split("\\n") if _a.strip()])
        _results.append(["ok", _json.dumps(_out)])
    except BaseException as _err:
        _results.append(["error", type(_err).__name__])
_sys.stdout.write("\\n{marker}" + _json.dumps(_results) + "\\n")
'''


class CodeFileTask(SplitTask):
    """Programming problems with unit tests from a local JSONL file, graded in a sandbox.

    Args:
        path: the JSONL (or .json list) file; see the module doc for the schema.
        seed / eval_size / eval_fraction: the seeded split (default holds out min(500, 10%)).
        problem_key: column with the statement.
        prompt_template: user message with ``{problem}`` and ``{instruction}``.
        cpu_seconds / wall_seconds / memory_mb / max_processes / output_kb: sandbox limits per run.
        max_tests: run at most this many cases per problem (None: all).
        allow_network / allow_unsafe: explicit opt-outs of the sandbox's isolation (see
            `components.tasks.sandbox`); without them, a machine that cannot isolate programs
            makes the constructor raise `SandboxUnavailableError`.
        python: interpreter for the programs (default: found automatically).
        system_prompt: a system message rendered with every prompt (training and evaluation).
        reward / pass_threshold: grade with a plain-function reward registered in `REWARDS`
            instead of the tests (called with ``tests=`` the parsed tests); a float reward passes
            iff it is >= pass_threshold (`components.rewards`).
    """

    name = "code_file"

    def __init__(
        self,
        path: str = "",
        seed: int = 0,
        reward_correct: float = 1.0,
        reward_incorrect: float = -1.0,
        eval_size: Optional[int] = None,
        eval_fraction: Optional[float] = None,
        problem_key: str = "problem",
        prompt_template: str = DEFAULT_PROMPT_TEMPLATE,
        cpu_seconds: float = 2.0,
        wall_seconds: float = 6.0,
        memory_mb: int = 512,
        max_processes: int = 32,
        output_kb: int = 4096,
        max_tests: Optional[int] = None,
        allow_network: bool = False,
        allow_unsafe: bool = False,
        python: Optional[str] = None,
        system_prompt: Optional[str] = None,
        reward: Optional[str] = None,
        pass_threshold: float = 1.0,
    ):
        if not path:
            raise ValueError("code_file: give the data file, e.g. code_file.path = '/data/deepcoder.jsonl'")
        from components.rewards import check_reward

        self.reward = check_reward(reward)
        self.pass_threshold = float(pass_threshold)
        self.system_prompt = system_prompt
        self.path = str(path)
        self.seed = seed
        self.reward_correct = float(reward_correct)
        self.reward_incorrect = float(reward_incorrect)
        self.prompt_template = prompt_template
        self.max_tests = max_tests
        self.limits = sandbox.SandboxLimits(
            cpu_seconds=cpu_seconds,
            wall_seconds=wall_seconds,
            memory_bytes=int(memory_mb) * 2**20,
            max_processes=max_processes,
            output_bytes=int(output_kb) * 1024,
        )
        real = os.path.realpath(self.path)
        self.sandbox_config = sandbox.SandboxConfig(
            python=python,
            hide_paths=(real, os.path.dirname(real)),
            allow_network=allow_network,
            allow_unsafe=allow_unsafe,
        )
        rows = load_jsonl(self.path)
        problems = []
        for i, row in enumerate(rows):
            where = f"{self.path!r} row {i}"
            if not isinstance(row, dict) or not str(row.get(problem_key, "")).strip():
                present = sorted(row) if isinstance(row, dict) else type(row).__name__
                raise ValueError(f"code_file: {where} has no {problem_key!r} text; keys present: {present}")
            problems.append((i, str(row[problem_key]).strip(), parse_tests(row, where), row.get("starter_code")))
        if not problems:
            raise ValueError(f"code_file: {self.path!r} holds no problems")
        n_eval = resolve_eval_size(len(problems), eval_size, eval_fraction, default=500)
        train, held = seeded_split(problems, n_eval, seed)
        stem = Path(self.path).stem
        self._tests: dict[str, dict] = {}
        self._train = [self._problem(stem, *p, split="train") for p in train]
        self._eval = [self._problem(stem, *p, split="eval") for p in held]
        # Refuse now, not at the first completion, where programs cannot be isolated.
        sandbox.check_available(self.sandbox_config)

    def _problem(self, stem: str, i: int, text: str, tests: dict, starter: Any, split: str) -> Problem:
        instruction = code_instruction(tests, starter)
        pid = f"code_file:{stem}:{i}"
        self._tests[pid] = tests
        meta = {"split": split, "row": i, "test_kind": tests["kind"], "num_tests": len(tests.get("cases", [1]))}
        if self.system_prompt:
            meta["system_prompt"] = self.system_prompt
        return Problem(
            id=pid,
            prompt=self.prompt_template.format(problem=text, instruction=instruction),
            answer=None,  # the tests live in `tests_of(problem)` (kept out of logs)
            meta=meta,
        )

    def tests_of(self, problem: Problem) -> dict:
        try:
            return self._tests[problem.id]
        except KeyError:
            raise ValueError(f"problem {problem.id!r} does not belong to this code_file task ({self.path!r})") from None

    # -- grading -----------------------------------------------------------------------
    def run_tests(self, problem: Problem, code: str) -> tuple[bool, Optional[str], str]:
        """(passed, sandbox error or None, a short reason) for one program."""
        return run_program_tests(self.tests_of(problem), code, limits=self.limits, config=self.sandbox_config,
                                 max_tests=self.max_tests)

    def verify(self, problem: Problem, completion: str) -> Verdict:
        if self.reward is not None:
            from components.rewards import reward_verdict

            return reward_verdict(self.reward, problem.prompt, completion, {"tests": self.tests_of(problem)},
                                  pass_threshold=self.pass_threshold, reward_correct=self.reward_correct,
                                  reward_incorrect=self.reward_incorrect)
        return grade_code_completion(self, problem, completion, self.run_tests)


def code_instruction(tests: dict, starter: Any = None) -> str:
    """The instruction appended to a problem statement for its kind of tests (and starter code)."""
    if tests["kind"] == "functional":
        instruction = FUNCTION_INSTRUCTION.format(fn_name=tests["fn_name"])
    elif tests["kind"] == "assert":
        instruction = ASSERT_INSTRUCTION
    else:
        instruction = STDIO_INSTRUCTION
    if starter:
        instruction += f"\nStart from:\n```python\n{starter}\n```"
    return instruction


def grade_code_completion(task, problem: Problem, completion: str, run_tests) -> Verdict:
    """The program of a completion's answer part, run against the problem's tests; never raises."""
    try:
        final = strip_thinking(completion)
        if final is None:
            return task.verdict(False)
        code = extract_code(strip_special_tokens(final)).strip()
        if not code:
            return task.verdict(False)
        passed, error, _ = run_tests(problem, code)
        return task.verdict(passed, error=error)
    except Exception as err:  # never raise for a bad completion
        return task.verdict(False, error=f"{type(err).__name__}: {err}")


def run_program_tests(tests: dict, code: str, *, limits: "sandbox.SandboxLimits", config: "sandbox.SandboxConfig",
                      max_tests: Optional[int] = None) -> tuple[bool, Optional[str], str]:
    """(passed, sandbox error or None, a short reason) for one program against parsed tests (`parse_tests`)."""
    run = lambda src, stdin="": sandbox.run_python(src, stdin, limits=limits, config=config)
    if tests["kind"] == "assert":
        code_all = code + "\n\n" + tests["code"] + "\n"
        ep = tests.get("entry_point")
        if ep and "def check(" in tests["code"]:
            code_all += f"\ncheck({ep})\n"
        res = run(code_all)
        return res.ok, res.error, res.describe()
    cases = tests["cases"][:max_tests] if max_tests else tests["cases"]
    if tests["kind"] == "stdio":
        for j, (inp, expected) in enumerate(cases):
            res = run(code, inp)
            if not res.ok:
                return False, res.error, f"case {j}: {res.describe()}"
            if not outputs_match(res.stdout, expected):
                return False, None, f"case {j}: wrong output"
        return True, None, "ok"
    marker = f"@@scalerl-results-{secrets.token_hex(8)}@@"
    harness = _FUNCTIONAL_HARNESS.format(inputs=[i for i, _ in cases], fn_name=tests["fn_name"], marker=marker)
    res = run(code + harness)
    if not res.ok:
        return False, res.error, res.describe()
    if marker not in res.stdout:
        return False, None, "no results (the program exited early)"
    try:
        results = json.loads(res.stdout.rsplit(marker, 1)[1].strip().splitlines()[0])
    except (ValueError, IndexError):
        return False, None, "unreadable results"
    for j, ((status, got), (_, expected)) in enumerate(zip(results, cases)):
        if status != "ok" or not _json_equal(got, expected):
            return False, None, f"case {j}: " + ("raised " + got if status != "ok" else "wrong return value")
    return len(results) == len(cases), None, "ok"


def _json_equal(got_json: str, expected: str) -> bool:
    try:
        got = json.loads(got_json)
    except ValueError:
        return False
    try:
        exp = json.loads(expected)
    except ValueError:
        exp = expected
    if isinstance(exp, list) and len(exp) == 1 and not isinstance(got, list):
        exp = exp[0]  # APPS / TACO wrap a call's expected return value in a list
    if isinstance(got, float) or isinstance(exp, float):
        try:
            return abs(float(got) - float(exp)) <= 1e-6 * max(1.0, abs(float(exp)))
        except (TypeError, ValueError):
            return False
    return got == exp


# Registered without rebinding the module name: instances stay picklable (gin's wrapper is a
# different class object of the same name), and `TASKS.get("code_file")` honours gin bindings.
TASKS.register("code_file")(CodeFileTask)
