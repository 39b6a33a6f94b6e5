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
    (in that layout only, following APPS / TACO's own harness, which accepts
    ``output == expected[0]``, a call's expected value wrapped in a one-element list also
    matches its element: ``7`` passes for ``[7]``; in every other layout it does not).
  * ``test``: Python source with ``assert`` statements about the program's names (MBPP
    style); with ``entry_point`` and a ``def check(`` in it, ``check(<entry_point>)`` is called
    (HumanEval style). The helpers a Python prompt defines (the row's ``prompt``, or the
    problem text: HumanEval/32 ``poly``) are the prompt's in the tests, not the program's
    (`prompt_helpers`).
- optional ``starter_code``: shown in the prompt.

The program is the last fenced code block of the completion's answer part (the text after
the last ``</think>``), preferring ```python blocks; without a fence, the whole answer.
All tests of a program run in ONE sandbox run, driven by `_grade_harness` (see its docstring
and "How programs are graded" in components/tasks/README.md): the program runs in child
processes of the harness, whose tests, memory and report it cannot reach. stdin/stdout
cases run one process each (with a per-case time budget) and their outputs are compared line
by line with trailing whitespace and trailing blank lines ignored; functional cases call the
function in one process and compare the plain return values here, type-strictly
(`values_equal`; the APPS / TACO exception above aside), within a time budget that no
returned value can stretch (`JUDGE_SECONDS`, `encoded_equal`); assert tests run in the harness against proxies of the program's names.
Expected outputs never enter the sandbox. The completion passes iff every case passes. See
`components.tasks.sandbox` for the isolation.
"""

from __future__ import annotations

import ast
import dataclasses
import hmac
import json
import math
import os
import secrets
import time
from pathlib import Path
from typing import Any, Optional

from components.registry import TASKS
from components.tasks import _grade_harness, sandbox
from components.tasks.base import Problem, Verdict
from components.tasks.common import SplitTask, extract_code, resolve_eval_size, seeded_split, strip_special_tokens, strip_thinking

STDIO_INSTRUCTION = (
    "Write a Python 3 program that reads the input from standard input and prints the answer to "
    "standard output. Put the whole program in one ```python code block."
)
FUNCTION_INSTRUCTION = "Write a Python 3 solution that defines `{fn_name}`. Put the code in one ```python code block."
ASSERT_INSTRUCTION = "Write a Python 3 solution. Put the code in one ```python code block."
DEFAULT_PROMPT_TEMPLATE = "{problem}\n\n{instruction}"

# Seconds added to every verification's time budget for starting the harness and the program.
STARTUP_GRACE_S = 2.0
DEFAULT_CASE_WORKERS = 2
DEFAULT_MAX_TOTAL_SECONDS = 300.0


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


def parse_tests(row: dict, where: str, prompt: Optional[str] = None) -> dict:
    """Normalise a row's tests to {"kind": "stdio"|"functional"|"assert", ...}.

    `prompt`: the problem's prompt text (default: the row's ``prompt`` column, HumanEval's); the
    helpers it defines in Python (`prompt_helpers`) are what assert tests call under their names.
    """
    if isinstance(row.get("test"), str) and row["test"].strip():
        return _assert_tests(row["test"], row.get("entry_point"), where, row.get("prompt") if prompt is None else prompt)
    tests = row.get("tests")
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError:
            return _assert_tests(tests, row.get("entry_point"), where, row.get("prompt") if prompt is None else prompt)
    apps = isinstance(tests, dict) and "inputs" in tests and "outputs" in tests
    if apps:
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
        parsed = {"kind": "functional", "fn_name": fn_name, "cases": [(i, o) for i, o, _ in cases]}
        if apps:  # APPS / TACO's own convention, for that layout only (see `_json_equal`)
            parsed["unwrap_singleton"] = True
        return parsed
    raise ValueError(f"code_file: {where} mixes test types {sorted(kinds)}; use 'stdin' or 'functional'")


def _assert_tests(code: str, entry_point: Any, where: str, prompt: Any = None) -> dict:
    """Assert-style tests; refused when they define ``check(candidate)`` but nothing calls it
    (no ``entry_point`` and no ``check(...)`` in the code): they would check nothing, and
    every program would pass. The prompt's own helpers (`prompt_helpers`) go with them."""
    if not entry_point:
        try:
            tree = ast.parse(code)
        except SyntaxError:
            tree = None  # fails every program at grading time, with the error
        if tree is not None:
            defines = any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == "check" for n in tree.body)
            called = any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "check"
                         for n in ast.walk(tree))
            if defines and not called:
                raise ValueError(f"code_file: {where} test defines check(candidate) but gives no 'entry_point' "
                                 "(and never calls check): it would check nothing")
    out = {"kind": "assert", "code": code, "entry_point": entry_point}
    helpers = prompt_helpers(prompt, entry_point)
    if helpers:
        out["prompt_code"] = helpers
    return out


def prompt_helpers(prompt: Any, entry_point: Any = None) -> Optional[str]:
    """The helpers a prompt written in Python defines, as source run before the tests (None if none).

    HumanEval's prompts are the start of a module: imports, helper functions the tests call
    (HumanEval/32 ``poly``, /38 ``encode_cyclic``, /50 ``encode_shift``) and the entry point's
    signature and docstring. The tests trust those helpers, so they must be the prompt's: a
    program that redefines ``poly`` to fit its own wrong answer must not change what the tests
    compute. Kept: the imports, and every top-level function or class that has a body beyond a
    docstring, other than the entry point (the program's to write). A prompt that is not Python
    (prose) has no helpers.
    """
    if not isinstance(prompt, str) or not prompt.strip():
        return None
    try:
        tree = ast.parse(prompt)
    except (SyntaxError, ValueError):
        return None

    def implemented(node) -> bool:
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                and isinstance(body[0].value.value, str):
            body = body[1:]
        trivial = lambda n: isinstance(n, ast.Pass) or (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
        return not all(map(trivial, body))

    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and n.name != entry_point and implemented(n)]
    if not defs:
        return None
    imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    return ast.unparse(ast.Module(body=imports + defs, type_ignores=[]))


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


class CodeFileTask(SplitTask):
    """Programming problems with unit tests from a local JSONL file, graded in a sandbox.

    Args:
        path: the JSONL (or .json list) file; see the module doc for the schema.
        seed / eval_size / eval_fraction: the seeded split (default holds out min(500, 10%)).
        problem_key: column with the statement.
        prompt_template: user message with ``{problem}`` and ``{instruction}``.
        cpu_seconds / wall_seconds / memory_mb / max_processes / output_kb: limits of the program
            per test case (per call for functional cases; for the whole test code of assert tests).
        max_tests: run at most this many cases per problem (None: all).
        case_workers: stdio cases of one program run at most this many at a time.
        max_total_seconds: cap on one verification's wall clock, whatever its number of cases
            (see "How programs are graded" in components/tasks/README.md).
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
        reward_params: Optional[dict] = None,
        pass_threshold: float = 1.0,
        case_workers: int = DEFAULT_CASE_WORKERS,
        max_total_seconds: float = DEFAULT_MAX_TOTAL_SECONDS,
    ):
        if not path:
            raise ValueError("code_file: give the data file, e.g. code_file.path = '/data/deepcoder.jsonl'")
        from components.tasks.reward_verdicts import check_reward

        self.reward = check_reward(reward)
        self.reward_params = dict(reward_params) if reward_params is not None else None  # a resolved run's values
        self.pass_threshold = float(pass_threshold)
        self.system_prompt = system_prompt
        self.path = str(path)
        self.seed = seed
        self.reward_correct = float(reward_correct)
        self.reward_incorrect = float(reward_incorrect)
        self.prompt_template = prompt_template
        self.max_tests = max_tests
        check_grading_options(case_workers, max_total_seconds)
        self.case_workers = case_workers
        self.max_total_seconds = float(max_total_seconds)
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
            prompt = row["prompt"] if isinstance(row.get("prompt"), str) else str(row[problem_key])
            problems.append((i, str(row[problem_key]).strip(), parse_tests(row, where, prompt), row.get("starter_code")))
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

    def verification_seconds(self, problem: Problem) -> float:
        """The longest one verification of `problem` can take (its sandbox run's wall budget):
        a caller's own timeout (the trainer's `verifier_timeout_s`) below it fails slow but
        correct programs with many cases."""
        return verification_seconds(self.tests_of(problem), self.limits, self.max_tests, self.case_workers,
                                    self.max_total_seconds)

    # -- grading -----------------------------------------------------------------------
    def run_tests(self, problem: Problem, code: str) -> tuple[bool, Optional[str], str]:
        """(passed, sandbox error or None, a short reason) for one program."""
        return run_program_tests(self.tests_of(problem), code, limits=self.limits, config=self.sandbox_config,
                                 max_tests=self.max_tests, case_workers=self.case_workers,
                                 max_total_seconds=self.max_total_seconds)

    def verify(self, problem: Problem, completion: str) -> Verdict:
        if self.reward is not None:
            from components.tasks.reward_verdicts import reward_verdict

            return reward_verdict(self.reward, problem.prompt, completion, {"tests": self.tests_of(problem)},
                                  pass_threshold=self.pass_threshold, reward_correct=self.reward_correct,
                                  reward_incorrect=self.reward_incorrect,
                                  params=self.reward_params)
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


_HARNESS_SOURCE: Optional[str] = None
_HARNESS_FILES: Optional[dict] = None


def harness_source() -> str:
    """The source of `_grade_harness.py`, run as main.py in the sandbox (read once)."""
    global _HARNESS_SOURCE
    if _HARNESS_SOURCE is None:
        _HARNESS_SOURCE = Path(_grade_harness.__file__).read_text(encoding="utf-8")
    return _HARNESS_SOURCE


def harness_files() -> dict:
    """{file name: source} of the harness's sibling modules (`_grade_harness.SIBLINGS`), which
    main.py loads by path from its own directory: the run's read-only dir, with main.py (read once)."""
    global _HARNESS_FILES
    if _HARNESS_FILES is None:
        here = Path(_grade_harness.__file__).parent
        _HARNESS_FILES = {f"{name}.py": (here / f"{name}.py").read_text(encoding="utf-8")
                          for name in _grade_harness.SIBLINGS}
    return _HARNESS_FILES


def check_grading_options(case_workers: int, max_total_seconds: float) -> None:
    """Refuse bad grading options before any program runs."""
    if isinstance(case_workers, bool) or not isinstance(case_workers, int) or case_workers < 1:
        raise ValueError(f"code grading: case_workers must be an int >= 1, got {case_workers!r}")
    if not (isinstance(max_total_seconds, (int, float)) and math.isfinite(max_total_seconds) and max_total_seconds > 0):
        raise ValueError(f"code grading: max_total_seconds must be a finite number > 0, got {max_total_seconds!r}")


def grading_limits(kind: str, num_cases: int, limits: "sandbox.SandboxLimits", case_workers: int,
                   max_total_seconds: float) -> "sandbox.SandboxLimits":
    """The limits of the one sandbox run that grades a program (see the README's time budget).

    Each case keeps `limits` (wall and CPU per case, memory, output, processes per program); the
    run as a whole gets STARTUP_GRACE_S plus one case budget per round of `case_workers` stdio
    cases (per call plus one for the import, for functional cases), capped at `max_total_seconds`.
    """
    if kind == "stdio":
        rounds = -(-num_cases // case_workers)
        programs = case_workers
    elif kind == "functional":
        rounds, programs = num_cases + 1, 1
    else:
        rounds, programs = 1, 1
    total = STARTUP_GRACE_S + limits.wall_seconds * rounds
    total = min(total, max(float(max_total_seconds), STARTUP_GRACE_S + limits.wall_seconds))
    return dataclasses.replace(
        limits,
        wall_seconds=total,
        cpu_seconds=total,  # the harness's own limit; each program gets `limits.cpu_seconds` per case
        # the run's one CPU budget (all processes): the harness's own, plus every case's
        run_cpu_seconds=total + programs * rounds * float(limits.cpu_seconds),
        # the run's one memory budget (its cgroup, where there is one): the harness and each program at once
        run_memory_bytes=(1 + programs) * int(limits.memory_bytes) + int(limits.tmpfs_bytes),
        max_processes=2 + programs * limits.max_processes,  # the harness and its spawner, then the programs
        max_open_files=limits.max_open_files + 8 * programs,  # the harness's pipes; each program gets its own
        output_bytes=max(limits.output_bytes, 1024 * num_cases + 65536),  # the harness's report
    )


def verification_seconds(tests: dict, limits: "sandbox.SandboxLimits", max_tests: Optional[int] = None,
                         case_workers: int = DEFAULT_CASE_WORKERS,
                         max_total_seconds: float = DEFAULT_MAX_TOTAL_SECONDS) -> float:
    """Wall-clock budget of the sandbox run that grades a program against `tests`."""
    n = len(tests["cases"][:max_tests] if max_tests else tests["cases"]) if tests["kind"] != "assert" else 0
    return grading_limits(tests["kind"], n, limits, case_workers, max_total_seconds).wall_seconds


def run_program_tests(tests: dict, code: str, *, limits: "sandbox.SandboxLimits", config: "sandbox.SandboxConfig",
                      max_tests: Optional[int] = None, case_workers: int = DEFAULT_CASE_WORKERS,
                      max_total_seconds: float = DEFAULT_MAX_TOTAL_SECONDS) -> tuple[bool, Optional[str], str]:
    """(passed, sandbox error or None, a short reason) for one program against parsed tests (`parse_tests`).

    One sandbox run: the harness (`_grade_harness`) runs the program in child processes it
    cannot reach; expected stdio outputs and functional return values are compared here.
    """
    report = grade_program(tests, code, limits=limits, config=config, max_tests=max_tests,
                           case_workers=case_workers, max_total_seconds=max_total_seconds)
    return report["passed"], report["error"], report["reason"]


def grade_program(tests: dict, code: str, *, limits: "sandbox.SandboxLimits", config: "sandbox.SandboxConfig",
                  max_tests: Optional[int] = None, case_workers: int = DEFAULT_CASE_WORKERS,
                  max_total_seconds: float = DEFAULT_MAX_TOTAL_SECONDS) -> dict:
    """`run_program_tests` with details: {"passed", "error", "reason", "cases_started", "sandbox"}."""
    plan = plan_grading(tests, code, limits=limits, max_tests=max_tests, case_workers=case_workers,
                        max_total_seconds=max_total_seconds)
    if plan.get("refused"):
        return _report(False, None, plan["refused"], 0, None)
    res = sandbox.run_python(harness_source(), plan["stdin"], limits=plan["limits"], config=config, files=plan["files"],
                             readonly_files=plan["readonly_files"], process_view=True)
    return judge_grading(plan, res)


def plan_grading(tests: dict, code: str, *, limits: "sandbox.SandboxLimits", max_tests: Optional[int] = None,
                 case_workers: int = DEFAULT_CASE_WORKERS, max_total_seconds: float = DEFAULT_MAX_TOTAL_SECONDS) -> dict:
    """The one sandbox run that grades `code`: its stdin (the harness's spec), files and limits,
    plus what `judge_grading` needs (nonce, expected digests / values; these stay on the host).
    ``refused`` is set instead when the tests themselves cannot run (a functional input that is not JSON)."""
    check_grading_options(case_workers, max_total_seconds)
    kind = tests["kind"]
    cases = (tests["cases"][:max_tests] if max_tests else tests["cases"]) if kind != "assert" else []
    nonce, salt, mac_key = secrets.token_hex(16), secrets.token_hex(16), secrets.token_hex(32)
    header = {"kind": kind, "nonce": nonce, "salt": salt, "mac_key": mac_key, "n": len(cases), "workers": case_workers,
              "case_wall": limits.wall_seconds, "case_cpu": limits.cpu_seconds, "output_cap": limits.output_bytes,
              "open_files": limits.max_open_files}
    lines, expected = [], []
    if kind == "assert":
        header.update(test_code=tests["code"], entry_point=tests.get("entry_point"), prompt_code=tests.get("prompt_code"))
    elif kind == "stdio":
        for inp, out in cases:
            expected.append(_grade_harness.output_digest(salt, out))
            lines.append({"input": inp, "digest": expected[-1]})
    else:
        header["fn_name"] = tests["fn_name"]
        expected = [out for _, out in cases]
        for j, (inp, _) in enumerate(cases):
            try:
                args = [json.loads(a) for a in inp.split("\n") if a.strip()]
            except ValueError:
                return {"refused": f"case {j}: its input is not one JSON value per line"}
            lines.append({"args": [_grade_harness.encode(a) for a in args]})
    return {
        "kind": kind, "nonce": nonce, "mac_key": mac_key, "expected": expected,
        "unwrap_singleton": bool(tests.get("unwrap_singleton")),
        "stdin": "".join(json.dumps(x) + "\n" for x in [header] + lines),
        "files": {_grade_harness.PROGRAM_FILE: code},  # the program's working dir
        "readonly_files": harness_files(),  # beside main.py, in the run's read-only dir
        "limits": grading_limits(kind, len(cases), limits, case_workers, max_total_seconds),
    }


def judge_grading(plan: dict, res: "sandbox.SandboxResult") -> dict:
    """The verdict from the harness's report in `res.stdout` (only its nonce-marked lines count)."""
    found, tampered = _read_report(res.stdout, plan["nonce"], plan["mac_key"])
    started = next((m["started"] for m in found if "started" in m), None)
    if res.error:
        return _report(False, res.error, res.describe(), started, res)
    tampered = tampered or _tampered(found)
    if tampered:
        return _report(False, None, f"the harness's report was tampered with ({tampered})", started, res)
    if not res.ok:  # the harness was killed or stopped (by the program, or for time): no pass
        return _report(False, None, f"the harness did not finish: {_harness_trouble(res)}", started, res)
    kind, expected = plan["kind"], plan["expected"]
    if kind == "assert":
        verdict = next((m for m in found if "verdict" in m), None)
        if verdict is None or not any("done" in m for m in found):
            return _report(False, None, f"no verdict from the tests ({_harness_trouble(res)})", started, res)
        return _report(verdict["verdict"] == "pass", None, verdict.get("why", "ok"), started, res)
    results = {m["case"]: m for m in found if isinstance(m.get("case"), int)}
    deadline = time.monotonic() + JUDGE_SECONDS
    for j, want in enumerate(expected):
        r = results.get(j)
        if r is None:
            why = "not run: the verification's time budget ran out" if res.timed_out else _harness_trouble(res)
            return _report(False, None, f"case {j}: {why}", started, res)
        if not r.get("ok"):
            return _report(False, None, f"case {j}: {r.get('why')}", started, res)
        if kind == "stdio" and r.get("digest") != want:
            return _report(False, None, f"case {j}: wrong output", started, res)
        if kind == "functional":
            try:
                equal = _json_equal(r.get("value"), want, plan.get("unwrap_singleton", False), deadline)
            except JudgingBudgetExceeded:
                return _report(False, None, f"case {j}: judging its return value ran over {JUDGE_SECONDS:g} s", started, res)
            if not equal:
                return _report(False, None, f"case {j}: wrong return value", started, res)
    if not any("done" in m for m in found):
        return _report(False, None, f"the harness did not finish ({_harness_trouble(res)})", started, res)
    return _report(True, None, "ok", started, res)


def _tampered(found: list[dict]) -> Optional[str]:
    """Why the report cannot be the harness's own (it writes each case and the verdict once, and
    nothing after "done"), or None."""
    seen = set()
    for i, msg in enumerate(found):
        key = ("case", msg["case"]) if "case" in msg else ("verdict",) if "verdict" in msg else None
        if key is not None:
            if key in seen:
                return f"{key[0]} reported twice"
            seen.add(key)
        if "done" in msg and i != len(found) - 1:
            return "lines after the end"
    return None


def _report(passed: bool, error: Optional[str], reason: str, started: Optional[int], res) -> dict:
    return {"passed": passed, "error": error, "reason": reason, "cases_started": started, "sandbox": res}


def _read_report(stdout: str, nonce: str, mac_key: str) -> tuple[list[dict], Optional[str]]:
    """The harness's messages (JSON objects on lines that start with the run's nonce), and why
    the report is not the harness's own if it is not: a line whose chained MAC is wrong."""
    found, previous = [], ""
    for line in stdout.splitlines():
        if not line.startswith(nonce + " "):
            continue
        mac, _, body = line[len(nonce) + 1:].partition(" ")
        if not hmac.compare_digest(mac, _grade_harness.report_mac(mac_key, previous, body)):
            return found, "a line the harness did not write, or one missing before it"
        previous = mac
        try:
            msg = json.loads(body)
        except (ValueError, RecursionError):
            return found, "an unreadable line"
        if isinstance(msg, dict):
            found.append(msg)
    return found, None


def _harness_trouble(res) -> str:
    """Why the harness stopped early, in a few words (it was killed, or it crashed)."""
    tail = res.stderr.strip().splitlines()[-1:] if res.stderr.strip() else []
    return res.describe() + (f"; {tail[0][:200]}" if tail and res.describe() == "ok" else "")


# Host-side judging of all of a verification's return values together stops after this long
# (a failure): it runs in the trainer's verifier thread, after the sandbox finished.
JUDGE_SECONDS = 2.0
_NOT_SCALAR = object()


class JudgingBudgetExceeded(Exception):
    """Comparing a program's return values took longer than `JUDGE_SECONDS`."""


def _json_equal(got_encoded: Any, expected: str, unwrap_singleton: bool = False,
                deadline: Optional[float] = None) -> bool:
    """Does a program's return value (as `_grade_harness.encode` tagged it) equal the expected JSON?

    Type-strict (`values_equal`); an expected value that is not JSON is compared as a string.
    ``unwrap_singleton`` (set by `parse_tests` for the APPS / TACO layout only, whose own
    harness accepts ``output == expected[0]`` for a one-element list): a one-element expected
    list also matches its element. Every other format compares as is (``7`` is not ``[7]``).

    Bounded (`encoded_equal`): the program's value is never decoded as a whole (no dict or set of
    its keys is built, so keys that all hash alike cost nothing); the walk follows the expected
    value, the trusted one, and raises `JudgingBudgetExceeded` past `deadline`.
    """
    try:
        exp = json.loads(expected)
    except ValueError:
        exp = expected
    deadline = time.monotonic() + JUDGE_SECONDS if deadline is None else deadline
    try:
        if encoded_equal(got_encoded, exp, deadline):
            return True
        return unwrap_singleton and type(exp) is list and len(exp) == 1 and encoded_equal(got_encoded, exp[0], deadline)
    except (ValueError, TypeError, RecursionError):
        return False


def _scalar(enc: Any) -> Any:
    """The plain scalar an encoded value stands for, or `_NOT_SCALAR` (containers and tags JSON
    cannot express: sets, bytes, complex). Linear in its size (an int tag holds < 2**20 hex digits)."""
    if enc is None or type(enc) in (bool, str, int, float):
        return enc
    if type(enc) is dict and enc.get("#") in ("int", "float"):
        return _grade_harness.decode(enc)
    return _NOT_SCALAR


def encoded_equal(enc: Any, exp: Any, deadline: float) -> bool:
    """`values_equal(decode(enc), exp)` without decoding `enc`: each step follows `exp` (lengths are
    compared before any element), so the work is bounded by the expected value's size."""
    if time.monotonic() > deadline:
        raise JudgingBudgetExceeded
    if type(exp) is list:
        if type(enc) is list:
            items = enc
        elif type(enc) is dict and enc.get("#") == "tuple" and type(enc.get("v")) is list:
            items = enc["v"]
        else:
            return False
        return len(items) == len(exp) and all(encoded_equal(a, b, deadline) for a, b in zip(items, exp))
    if type(exp) is dict:
        if not (type(enc) is dict and enc.get("#") == "dict" and type(enc.get("v")) is list) or len(enc["v"]) != len(exp):
            return False
        keyed = {}
        for i, pair in enumerate(enc["v"]):
            if i % 1024 == 0 and time.monotonic() > deadline:
                raise JudgingBudgetExceeded
            if type(pair) is not list or len(pair) != 2:
                return False
            key = _json_key(_scalar(pair[0]))
            if key is None or key in keyed or key not in exp:
                return False
            keyed[key] = pair[1]
        return all(encoded_equal(v, exp[k], deadline) for k, v in keyed.items())
    got = _scalar(enc)
    return got is not _NOT_SCALAR and values_equal(got, exp)


FLOAT_TOLERANCE = 1e-6


def values_equal(got: Any, exp: Any) -> bool:
    """Type-strict equality of a returned value with an expected JSON value.

    - None, bool, str: the same type and value (True is not 1, "1" is not 1);
    - int: an int (not a bool, not a float) of the same value;
    - float: an int or float within FLOAT_TOLERANCE relative to max(1, |expected|) (NaN equals NaN,
      an infinity only itself);
    - list: a list or tuple of the same length, element by element (JSON has no tuples);
    - dict: a dict with the same keys (a non-string key matches its JSON spelling, as json.dumps
      writes int keys as strings) and equal values;
    - anything else (sets, bytes, complex: JSON cannot express them) is never equal.
    """
    if exp is None:
        return got is None
    if type(exp) in (bool, str):
        return type(got) is type(exp) and got == exp
    if type(exp) is int:
        return type(got) is int and got == exp
    if type(exp) is float:
        if type(got) not in (int, float):
            return False
        if math.isnan(exp) or (type(got) is float and math.isnan(got)):
            return type(got) is float and math.isnan(got) and math.isnan(exp)
        if math.isinf(exp):  # the tolerance below would be infinite: any float would do
            return got == exp
        try:  # an int too large for a float is no float's neighbour
            return abs(got - exp) <= FLOAT_TOLERANCE * max(1.0, abs(exp))
        except OverflowError:
            return False
    if type(exp) is list:
        return type(got) in (list, tuple) and len(got) == len(exp) and all(map(values_equal, got, exp))
    if type(exp) is dict:
        if type(got) is not dict or len(got) != len(exp):
            return False
        keyed = {_json_key(k): v for k, v in got.items()}
        return len(keyed) == len(exp) and all(k in exp and values_equal(v, exp[k]) for k, v in keyed.items())
    return False


def _json_key(k: Any) -> Optional[str]:
    """How json.dumps writes a dict key (None for keys it cannot write, or an int too long to)."""
    if type(k) is str:
        return k
    if type(k) is int and k.bit_length() > 4096:  # no JSON key is that long; str() would be slow
        return None
    if k is None or type(k) in (bool, int, float):
        return json.dumps(k)
    return None


# Registered without rebinding the module name: instances stay picklable (gin's wrapper is a
# different class object of the same name), and `TASKS.get("code_file")` honours gin bindings.
TASKS.register("code_file")(CodeFileTask)

# The code task's numeric settings (a sandbox limit of 0 fails every program: every reward -1).
# Declared for the parameters its signature has, so the grader can gain or drop knobs freely.
CODE_FILE_RANGES = {"eval_size": ">= 0", "eval_fraction": "[0, 1)", "cpu_seconds": "> 0", "wall_seconds": "> 0",
                    "memory_mb": ">= 1", "max_processes": ">= 1", "output_kb": ">= 1", "max_tests": ">= 1",
                    "case_workers": ">= 1", "max_total_seconds": "> 0"}
_PARAMS = {p.name for p in TASKS.params("code_file")}
TASKS.declare_ranges("code_file", {k: v for k, v in CODE_FILE_RANGES.items() if k in _PARAMS})
