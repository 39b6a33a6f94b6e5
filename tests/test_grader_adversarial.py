"""The code grader cannot be gamed: each hostile program here got +1 from the grader of commit
40061fd (tests appended to the program in one file, `==` comparisons) and must get -1 now;
correct programs still pass, whatever their number of test cases, in one sandbox run.

Every test runs real sandboxed programs, so like tests/test_sandbox.py they need root (CI and
the development machine run as root).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile

import pytest

from _helpers_sandbox import run_batch
from _helpers_sandbox import sandbox_processes as bwrap_leftovers
from components.tasks import code_file, sandbox
from components.tasks.code_file import grade_program, parse_tests, run_program_tests, values_equal
from components.tasks.sandbox import SandboxConfig, SandboxLimits

# A uid range of our own (away from test_sandbox's and the default), so leftovers are ours.
UID_BASE = 1_700_000_000 + (os.getpid() % 100) * 2**22
LIMITS = SandboxLimits(cpu_seconds=1, wall_seconds=2, memory_bytes=256 * 2**20, max_processes=8, output_bytes=64 * 1024)
CONFIG = SandboxConfig(uid_base=UID_BASE)
SHORT = dataclasses.replace(LIMITS, wall_seconds=1)  # for programs that hang whatever the limit

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox isolates programs only when run as root")


def sandbox_processes() -> list[int]:
    """Pids of live processes whose real uid is in our sandbox range."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as f:
                    uid = int(next(line for line in f if line.startswith("Uid:")).split()[1])
            except (OSError, StopIteration, ValueError):
                continue
            if UID_BASE <= uid < UID_BASE + 2**22:
                found.append(int(entry))
    return found


@pytest.fixture
def runs(tmp_path, monkeypatch):
    """Counts sandbox runs; routes control dirs to a private dir and checks nothing is left behind."""
    control = tmp_path / "control"
    control.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(control))
    calls = []
    real = sandbox.run_python

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(sandbox, "run_python", counting)
    yield calls
    assert list(control.iterdir()) == [], "sandbox control dirs were left behind"
    assert sandbox_processes() == [], "sandbox processes were left running"


def harness_job(plan: dict) -> dict:
    """The sandbox job (`_helpers_sandbox.run_batch`) that grades as `code_file.grade_program` would."""
    return {"code": code_file.harness_source(), "stdin": plan["stdin"], "files": plan["files"],
            "readonly_files": plan["readonly_files"], "limits": dataclasses.asdict(plan["limits"])}


def grade(row: dict, code: str, limits: SandboxLimits = LIMITS, **kwargs) -> tuple[bool, str]:
    passed, error, reason = run_program_tests(parse_tests(row, "test row"), code, limits=limits, config=CONFIG, **kwargs)
    assert error is None, error  # a failing program, never a sandbox failure
    return passed, reason


# f(x) = x ** x: no hostile program below computes it.
ASSERT_ROW = {"test": "assert f(3) == 27\nassert f(2) == 4\nassert f(5) == 3125\n"}
CHECK_ROW = {"test": "def check(candidate):\n    assert candidate(3) == 27\n    assert candidate(5) == 3125\n",
             "entry_point": "f"}
FLOAT_ROW = {"test": "assert abs(root(2.0) - 1.41421356) < 1e-6\n"}
MATH_ROW = {"test": "assert math.isclose(root(2.0), 1.41421356, rel_tol=1e-6)\n"}
WRONG_F = "def f(x):\n    return 0\n"

# Each got +1 from the old grader (the comment says how) and must get -1 now.
HOSTILE = {
    # Exit with status 0 before the appended tests ran, or while they ran.
    "raise_systemexit_at_import": (ASSERT_ROW, WRONG_F + "raise SystemExit\n"),
    "exit_at_import": (ASSERT_ROW, WRONG_F + "exit()\n"),
    "quit_at_import": (CHECK_ROW, WRONG_F + "quit()\n"),
    "sys_exit_inside_the_function": (ASSERT_ROW, "import sys\ndef f(x):\n    sys.exit(0)\n"),
    "os_exit_inside_the_function": (CHECK_ROW, "import os\ndef f(x):\n    os._exit(0)\n"),
    "atexit_os_exit_after_a_failed_assert": (ASSERT_ROW, "import atexit, os\natexit.register(os._exit, 0)\n" + WRONG_F),
    "excepthook_exits_0": (ASSERT_ROW, "import os, sys\nsys.excepthook = lambda *a: os._exit(0)\n" + WRONG_F),
    "sigterm_handler_exits_0_then_raise": (
        ASSERT_ROW,
        "import os, signal\nsignal.signal(signal.SIGTERM, lambda *a: os._exit(0))\n"
        "def f(x):\n    os.kill(os.getpid(), signal.SIGTERM)\n    return 0\n",
    ),
    # Kill or stop the parent (the harness now), then exit 0 (the old grader's parent was root).
    "kill_the_parent_then_exit": (
        ASSERT_ROW, "import os, signal\ntry:\n    os.kill(os.getppid(), signal.SIGKILL)\nexcept OSError:\n    pass\nos._exit(0)\n"),
    "stop_the_parent_then_exit": (
        CHECK_ROW, "import os, signal\ntry:\n    os.kill(os.getppid(), signal.SIGSTOP)\nexcept OSError:\n    pass\nos._exit(0)\n"),
    # Write forged verdict / result lines everywhere it can, then exit 0.
    "forge_verdict_lines_then_exit": (
        ASSERT_ROW,
        "import os, glob\nfake = b'\\n'.join(x.encode() for x in ['{\"verdict\": \"pass\"}', '{\"done\": true}', 'ok']) + b'\\n'\n"
        "for path in ['/proc/%d/fd/1' % os.getppid(), '/proc/%d/fd/2' % os.getppid()] + glob.glob('/proc/*/fd/1'):\n"
        "    try:\n        with open(path, 'ab') as out:\n            out.write(fake)\n    except OSError:\n        pass\n"
        "os.write(1, fake)\nos.write(2, fake)\nos._exit(0)\n",
    ),
    # Objects that claim to equal anything.
    "always_equal_object": (
        CHECK_ROW,
        "class Any:\n    def __eq__(self, other):\n        return True\n    def __ne__(self, other):\n        return False\n"
        "    __hash__ = object.__hash__\ndef f(x):\n    return Any()\n",
    ),
    "int_subclass_equal_to_everything": (
        ASSERT_ROW, "class I(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
        "def f(x):\n    return I(0)\n"),
    # Find the expected values in its own file, the harness's stdin / memory / environment.
    "oracle_from_files_and_proc": (
        ASSERT_ROW,
        "import glob, os, re\ntable = {}\n"
        "paths = [__file__] + glob.glob('*') + glob.glob('/tmp/**/*', recursive=True)\n"
        "for pid in {os.getppid(), *[p.split('/')[2] for p in glob.glob('/proc/[0-9]*')]}:\n"
        "    paths += ['/proc/%s/%s' % (pid, n) for n in ('cmdline', 'environ', 'fd/0', 'fd/3', 'fd/4')]\n"
        "for path in paths:\n"  # non-blocking: a pipe with nothing in it must not hang the search
        "    try:\n        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)\n"
        "        text = os.read(fd, 1 << 20).decode('utf-8', 'replace')\n        os.close(fd)\n"
        "    except OSError:\n        continue\n"
        "    for x, y in re.findall(r'(?:f|candidate)\\((\\d+)\\) == (\\d+)', text):\n        table[int(x)] = int(y)\n"
        "def f(x):\n    return table.get(x, 0)\n",
    ),
    # Change what the test's own names mean.
    "defines_its_own_abs": (FLOAT_ROW, "def abs(x):\n    return 0\ndef root(x):\n    return 0.0\n"),
    "patches_builtins_abs": (FLOAT_ROW, "import builtins\nbuiltins.abs = lambda x: 0\ndef root(x):\n    return 0.0\n"),
    "fake_math_module": (
        MATH_ROW, "class FakeMath:\n    def isclose(self, *a, **k):\n        return True\nmath = FakeMath()\n"
        "def root(x):\n    return 0.0\n"),
    # Got +1 from the harness of commit e02224d (review of issue 14):
    # tests guarded by `if __name__ == "__main__":` did not run (the test namespace had another name);
    "tests_under_a_main_guard": ({"test": "if __name__ == '__main__':\n    assert f(3) == 27\n"}, WRONG_F),
    # a StopIteration out of a call ended the test's loop over map(f, ...) before any check;
    "stopiteration_ends_the_tests_loop": (
        {"test": "for got, want in zip(map(f, [3, 5]), [27, 3125]):\n    assert got == want\n"},
        "def f(x):\n    raise StopIteration\n"),
    # the program's exit was an Exception that a tolerant `except Exception` in the tests swallowed.
    "exit_swallowed_by_a_tolerant_test": (
        {"test": "def check(candidate):\n    for x, want in [(3, 27), (5, 3125)]:\n        try:\n"
                 "            got = candidate(x)\n        except Exception:\n            continue  # may reject some inputs\n"
                 "        assert got == want\n", "entry_point": "f"},
        "import os\ndef f(x):\n    os._exit(0)\n"),
    "exit_swallowed_by_a_bare_except": (
        {"test": "for x, want in [(3, 27), (5, 3125)]:\n    try:\n        got = f(x)\n    except:\n"
                 "        continue\n    assert got == want\n"},
        "import os\ndef f(x):\n    os._exit(0)\n"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_assert_programs_get_minus_one(name, runs):
    row, code = HOSTILE[name]
    passed, reason = grade(row, code, limits=SHORT if name == "stop_the_parent_then_exit" else LIMITS)
    assert not passed, f"{name} passed ({reason})"
    assert len(runs) == 1


FUNCTIONAL_ROW = {"tests": [{"input": "3", "output": "1", "testtype": "functional"},
                            {"input": "4", "output": "2.0", "testtype": "functional"}], "fn_name": "solve"}
# solve(3) must be the int 1 and solve(4) the float 2.0; the old grader compared with `==` after
# JSON (True == 1, 1.0 == 1) and float(got) (float("2.0") == 2.0).
FUNCTIONAL_HOSTILE = {
    "bool_for_int": "def solve(x):\n    return True if x == 3 else 2.0\n",
    "float_for_int": "def solve(x):\n    return 1.0 if x == 3 else 2.0\n",
    "str_for_float": "def solve(x):\n    return 1 if x == 3 else '2.0'\n",
}


@pytest.mark.parametrize("name", sorted(FUNCTIONAL_HOSTILE))
def test_functional_return_values_are_compared_type_strictly(name, runs):
    passed, reason = grade(FUNCTIONAL_ROW, FUNCTIONAL_HOSTILE[name])
    assert not passed and "wrong return value" in reason, reason


def test_values_equal_rules():
    assert values_equal(1, 1) and not values_equal(True, 1) and not values_equal(1.0, 1) and not values_equal("1", 1)
    assert values_equal(2, 2.0) and values_equal(2.0000001, 2.0) and not values_equal(2.1, 2.0)
    assert values_equal(False, False) and not values_equal(0, False) and values_equal(None, None) and not values_equal(0, None)
    assert values_equal((1, [2, "a"]), [1, [2, "a"]]) and not values_equal([1, True], [1, 1]) and not values_equal([1], [1, 2])
    assert values_equal({1: [1.5]}, {"1": [1.5]}) and not values_equal({1: 1, "1": 1}, {"1": 1}) and not values_equal({2}, [2])


def test_values_equal_huge_ints_and_infinities():
    """An int too large for a float is not equal to a float (it raised OverflowError, which
    made the verification a grading error); inf equals inf (abs(inf - inf) is NaN)."""
    assert not values_equal(10**400, 2.5) and not values_equal(-(10**400), 1e300)
    assert values_equal(float("inf"), float("inf")) and not values_equal(float("-inf"), float("inf"))
    assert not values_equal(1e308, float("inf"))


def test_check_candidate_tests_that_nothing_calls_are_refused():
    """`def check(candidate)` without an entry_point (and no call of it) checks nothing: every
    program passed. Refused when the task is built, naming the row; a test that calls check
    itself needs no entry point."""
    with pytest.raises(ValueError, match="row 7 test defines check.*no 'entry_point'"):
        parse_tests({"test": "def check(candidate):\n    assert candidate(3) == 27\n"}, "row 7")
    with pytest.raises(ValueError, match="no 'entry_point'"):
        parse_tests({"tests": "def check(candidate):\n    assert candidate(3) == 27\n"}, "row 8")
    assert parse_tests({"test": "def check(c):\n    assert c(3) == 27\ncheck(f)\n"}, "r")["kind"] == "assert"
    assert parse_tests(CHECK_ROW, "r")["entry_point"] == "f"


def test_the_harness_never_imports_a_module_the_program_wrote(tmp_path):
    """Before Python 3.11, ``python -I`` keeps the script's directory (then the program's writable
    working dir) on sys.path: a program that wrote colorsys.py there and imported colorsys had
    it imported by the harness (for the test namespace), which ran it and wrote the program's
    verdict (+1). Run here with 3.10's -I (-E -s, no -P), outside the sandbox (no sandbox needed
    to show what the harness imports), laid out as in the sandbox: the harness in ../readonly."""
    import subprocess
    import sys

    evil = ("import gc, os, sys\nif sys.argv[1:2] != ['--serve']:\n    for fn in gc.get_objects():\n"
            "        if getattr(fn, '__name__', '') == 'emit' and 'chain' in getattr(getattr(fn, '__code__', None), 'co_freevars', ()):\n"
            "            fn({'verdict': 'pass'}); fn({'done': True}); sys.stdout.flush(); os._exit(0)\n")
    program = f"with open('colorsys.py', 'w') as out:\n    out.write({evil!r})\nimport colorsys\n" + WRONG_F
    plan = code_file.plan_grading(parse_tests(ASSERT_ROW, "row"), program, limits=LIMITS)
    for sub, files in (("readonly", {"main.py": code_file.harness_source(), **plan["readonly_files"]}),
                       ("work", plan["files"])):
        (tmp_path / sub).mkdir()
        for name, text in files.items():
            (tmp_path / sub / name).write_text(text)
    proc = subprocess.run([sys.executable, "-E", "-s", "-B", "../readonly/main.py"], cwd=tmp_path / "work",
                          input=plan["stdin"], capture_output=True, text=True, timeout=60)
    res = sandbox.SandboxResult(proc.stdout, proc.stderr, proc.returncode, None, False, False, False, 0.1, 0.1)
    report = code_file.judge_grading(plan, res)
    assert not report["passed"] and report["reason"].startswith("AssertionError"), report["reason"]


# A correct program of every kind passes; the assert one also guards a `__main__` block that
# reads stdin (the old grader ran it, hit EOF and failed the program).
CORRECT = {
    "assert": (ASSERT_ROW, "def f(x):\n    return x ** x\nif __name__ == '__main__':\n    print(f(int(input())))\n"),
    "check_candidate": (CHECK_ROW, "def f(x):\n    return x ** x\n"),
    "assert_with_objects": (
        {"test": "s = Stack()\ns.push(1)\ns.push(2)\nassert len(s) == 2 and s.pop() == 2\nassert s.items == [1]\n"
                 "nums = [3, 1, 2]\nsort_in_place(nums)\nassert nums == [1, 2, 3]\nassert list(evens(5)) == [0, 2, 4]\n"},
        "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n        self.items.append(x)\n"
        "    def pop(self):\n        return self.items.pop()\n    def __len__(self):\n        return len(self.items)\n"
        "def sort_in_place(a):\n    a.sort()\n"
        "def evens(n):\n    for i in range(0, n, 2):\n        yield i\n",
    ),
    "functional_solution_method": (
        {"tests": json.dumps([{"input": "[2,7,11,15]\n9", "output": "[0, 1]", "testtype": "functional"},
                              {"input": "[3,3]\n6", "output": "[0, 1]", "testtype": "functional"}]),
         "metadata": {"func_name": "twoSum"}},
        "class Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n        for i, x in enumerate(nums):\n"
        "            if target - x in seen:\n                return [seen[target - x], i]\n            seen[x] = i\n",
    ),
    "functional_plain_function": (FUNCTIONAL_ROW, "def solve(x):\n    return 1 if x == 3 else 2.0\n"),
    "stdio": ({"tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "40 2\n", "output": "42\n"},
                         {"input": "5 5\n", "output": "10"}]},
              "a, b = map(int, input().split())\nprint(a + b)\n"),
}


def test_correct_programs_of_every_kind_pass_in_one_sandbox_run(runs):
    """One loop (each kind its own message): the old grader failed the `__main__` program and ran
    one sandbox per stdio case; the other kinds are regression checks of the proxies (objects,
    in-place changes, generators) and of `Solution` methods."""
    failed = {}
    for name, (row, code) in CORRECT.items():
        before = len(runs)
        passed, reason = grade(row, code)
        if not passed or len(runs) != before + 1:
            failed[name] = (reason, len(runs) - before)
    assert failed == {}


def test_a_correct_stdio_program_with_200_cases_passes(runs):
    """Each case has its own time budget; the old grader ran 200 sandboxes one after another."""
    row = {"tests": [{"input": f"{i}\n", "output": f"{2 * i}\n"} for i in range(200)]}
    passed, reason = grade(row, "print(2 * int(input()))\n")
    assert passed, reason
    assert len(runs) == 1


def test_the_trainer_waits_for_the_grading_budget_not_only_its_own_timeout(tmp_path):
    """`safe_verify` (the trainer's verifier call) waits max(verifier_timeout_s, the task's
    per-problem budget + margin): a code problem with 200 cases gets more than the default 10 s,
    a task without a budget exactly the timeout; a verification slower than the timeout but
    within its task's budget is not failed by the trainer's clock (it was before)."""
    import time

    from components.tasks.base import Verdict
    from components.trainer import rollout

    path = tmp_path / "code.jsonl"
    rows = [{"problem": "double", "tests": [{"input": f"{i}\n", "output": f"{2 * i}\n"} for i in range(n)]}
            for n in (200, 1)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = code_file.CodeFileTask(str(path), eval_fraction=0.5, seed=0, wall_seconds=2.0)
    problems = task.train_problems() + task.eval_problems()
    budgets = sorted(rollout.verification_timeout(task, p, 10.0) for p in problems)
    assert budgets[0] == 10.0 and budgets[1] > 10.0 + 2.0 * 200 / code_file.DEFAULT_CASE_WORKERS / 2, budgets

    class Slow:
        reward_incorrect = -1.0

        def verification_seconds(self, problem):
            return 1.0

        def verify(self, problem, text):
            time.sleep(0.8)
            return Verdict(passed=True, reward=1.0)

    verdict, err = rollout.safe_verify(Slow(), None, "x", 0.3)
    assert verdict.passed and err is None, (verdict, err)
    assert rollout.verification_timeout(object(), None, 0.3) == 0.3


def test_no_case_starts_after_a_timeout(runs):
    """A program that hangs: only the first round of cases starts (case_workers at a time), in one run."""
    row = {"tests": [{"input": f"{i}\n", "output": f"{i}\n"} for i in range(30)]}
    hang = "import time\ntime.sleep(60)\n"
    for workers in (1, 2):
        report = grade_program(parse_tests(row, "row"), hang, limits=SHORT, config=CONFIG, case_workers=workers)
        assert not report["passed"] and report["reason"] == "case 0: wall-clock timeout", report["reason"]
        assert report["cases_started"] == workers
    # A wrong answer stops it too (the harness knows a salted digest of each expected output).
    report = grade_program(parse_tests(row, "row"), "print(-1)\n", limits=LIMITS, config=CONFIG, case_workers=1)
    assert not report["passed"] and report["cases_started"] == 1 and report["reason"] == "case 0: wrong output"
    assert len(runs) == 3


def test_only_a_complete_report_of_a_cleanly_exited_harness_passes():
    """The host's side (no sandbox): each report line carries a MAC chained over the ones before
    it, keyed by a secret only the harness got; a forged, dropped or repeated line, or a harness
    that did not exit 0, fails the program even when every value in the report is right."""
    from components.tasks import _grade_harness

    plan = code_file.plan_grading(parse_tests(FUNCTIONAL_ROW, "row"), "unused", limits=LIMITS)
    nonce, key = plan["nonce"], plan["mac_key"]

    def report(bodies, mac_key=key):
        lines, previous = [], ""
        for body in bodies:
            previous = _grade_harness.report_mac(mac_key, previous, body)
            lines.append(f"{nonce} {previous} {body}")
        return "\n".join(lines) + "\n"

    def verdict(stdout, exit_code=0, signal=None):
        res = sandbox.SandboxResult(stdout, "", exit_code, signal, False, False, False, 0.1, 0.1)
        return code_file.judge_grading(plan, res)["passed"]

    case0, case1, done = '{"case":0,"ok":true,"value":1}', '{"case":1,"ok":true,"value":2.0}', '{"done":true}'
    assert verdict(report([case0, case1, done]))
    assert not verdict(report([case0, case1, done], mac_key="0" * 64))  # no key: forged
    assert not verdict(report([case0, case1, done]).replace('"value":2.0', '"value":2.5'))  # changed
    assert not verdict("\n".join(report([case0, case1, done]).splitlines()[1:]))  # a line dropped
    assert not verdict(report([case0, case1, case1, done]))  # a case twice
    assert not verdict(report([case0, done, case1]))  # a line after the end
    assert not verdict(report([case0, case1, done]), exit_code=None, signal=9)  # the harness was killed


def test_time_budget_scales_with_cases_within_the_cap():
    limits = SandboxLimits(cpu_seconds=1, wall_seconds=2)
    budget = code_file.grading_limits("stdio", 200, limits, case_workers=2, max_total_seconds=300)
    assert budget.wall_seconds == code_file.STARTUP_GRACE_S + 2 * 100
    assert code_file.grading_limits("stdio", 10_000, limits, 2, 300).wall_seconds == 300
    assert code_file.grading_limits("assert", 0, limits, 2, 300).wall_seconds == code_file.STARTUP_GRACE_S + 2
    with pytest.raises(ValueError, match="case_workers must be an int >= 1, got 0"):
        code_file.check_grading_options(0, 300)
    with pytest.raises(ValueError, match="max_total_seconds must be a finite number > 0, got inf"):
        code_file.check_grading_options(2, float("inf"))


# Reach the harness's stdin / stdout files through another process of the run's uid that holds
# them through /proc/1 (bubblewrap's own init kept the run's stdin, stdout and stderr open and was
# dumpable; the sandbox now makes its undumpable supervisor PID 1 instead).
THROUGH_BWRAP_INIT = {
    # Find the spec (salt and digests) and try outputs until one matches the expected digest.
    "reads_the_spec_and_guesses_the_digest": (
        {"tests": [{"input": "7\n", "output": "YES\n"}, {"input": "8\n", "output": "NO\n"}]},
        "import glob, hashlib, json, os, stat\ninp = input()\nanswer = 'MAYBE'\n"
        "for path in glob.glob('/proc/[0-9]*/fd/0'):\n"
        "    try:\n        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)\n"
        "        if not stat.S_ISREG(os.fstat(fd).st_mode):\n            os.close(fd)\n            continue\n"
        "        text = os.read(fd, 1 << 20).decode('utf-8', 'replace')\n        os.close(fd)\n"
        "    except OSError:\n        continue\n"
        "    specs = []\n    for line in text.splitlines():\n"
        "        try:\n            specs.append(json.loads(line))\n        except ValueError:\n            pass\n"
        "    salt = next((s['salt'] for s in specs if isinstance(s, dict) and 'salt' in s), None)\n"
        "    for s in specs:\n        if salt and isinstance(s, dict) and s.get('input', '').strip() == inp.strip():\n"
        "            for guess in ('YES', 'NO'):\n"
        "                if hashlib.sha256((salt + '\\0' + guess).encode()).hexdigest() == s['digest']:\n"
        "                    answer = guess\n"
        "print(answer)\n",
    ),
    # Read the nonce from the harness's report, append forged results, kill the harness.
    "forges_the_rest_of_the_report_and_kills_the_harness": (
        FUNCTIONAL_ROW,
        "import glob, os, signal, stat, time\n"
        "def solve(x):\n    if x == 3:\n        return 1\n"
        "    for path in glob.glob('/proc/[0-9]*/fd/1'):\n"
        "        try:\n            fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_NONBLOCK)\n"
        "            if stat.S_ISREG(os.fstat(fd).st_mode):\n"
        "                first = os.read(fd, 1 << 16).decode().split(' ')[0]\n"
        "                forged = first + ' {\"case\": 1, \"ok\": true, \"value\": 2.0}\\n' + first + ' {\"done\": true}\\n'\n"
        "                os.write(fd, forged.encode())\n"
        "            os.close(fd)\n"
        "        except OSError:\n            pass\n"
        "    os.kill(os.getppid(), signal.SIGKILL)\n    time.sleep(60)\n",
    ),
}


def test_every_program_gets_its_verdict_under_bubblewrap_as_an_unprivileged_user(runs):
    """The bubblewrap backend (how a job that is not root grades): every hostile program above,
    and two that try to reach the harness's files through /proc/1, get -1; the correct ones +1.
    One batch, each program judged on its own."""
    programs = {**HOSTILE, **{f"functional_{k}": (FUNCTIONAL_ROW, c) for k, c in FUNCTIONAL_HOSTILE.items()},
                **THROUGH_BWRAP_INIT}
    programs.update({f"correct_{k}": v for k, v in CORRECT.items()})
    names = sorted(programs)
    plans = [code_file.plan_grading(parse_tests(programs[n][0], n), programs[n][1],
                                    limits=SHORT if n == "stop_the_parent_then_exit" else LIMITS) for n in names]
    jobs = [harness_job(p) for p in plans]
    results = [code_file.judge_grading(p, res) for p, (res, _) in zip(plans, run_batch("bwrap", jobs, threads=4))]
    wrong = {n: (r["passed"], r["error"], r["reason"]) for n, r in zip(names, results)
             if r["error"] is not None or r["passed"] != n.startswith("correct_")}
    assert wrong == {}
    assert bwrap_leftovers() == []


# -- the second red team (issue 34) -------------------------------------------------------------
# HumanEval-style prompts whose helpers the tests call (after HumanEval/32 and /50).
POLY_PROMPT = ('import math\n\n\ndef poly(xs: list, x: float):\n    """The polynomial with coefficients xs at x."""\n'
               '    return sum(c * math.pow(x, i) for i, c in enumerate(xs))\n\n\n'
               'def find_zero(xs: list):\n    """A zero of poly(xs, x)."""\n')
POLY_ROW = {"prompt": POLY_PROMPT, "entry_point": "find_zero",
            "test": "def check(candidate):\n    for xs in ([1, 2], [-6, 11, -6, 1], [2, -3, 0, 1]):\n"
                    "        assert abs(poly(xs, candidate(xs))) < 1e-4\n"}
SHIFT_PROMPT = ('def encode_shift(s: str):\n    """Shifts every letter by 5."""\n'
                '    return "".join(chr((ord(ch) + 5 - ord("a")) % 26 + ord("a")) for ch in s)\n\n\n'
                'def decode_shift(s: str):\n    """Inverse of encode_shift."""\n')
SHIFT_ROW = {"prompt": SHIFT_PROMPT, "entry_point": "decode_shift",
             "test": "def check(candidate):\n    for s in ('hello', 'abcxyz', 'zebra'):\n"
                     "        assert candidate(encode_shift(s)) == s\n"}
APPS_ROW = {"tests": {"inputs": [[3]], "outputs": [[7]], "fn_name": "solve"}}
PLAIN_ONE_ELEMENT_ROW = {"tests": [{"input": "3", "output": "[7]", "testtype": "functional"}], "fn_name": "solve"}
# Two stdio cases run at once (case_workers=2): the "attacker" writes into every other process's stdout.
SIBLING_ROW = {"tests": [{"input": "victim\n", "output": "ok\n"}, {"input": "attacker\n", "output": "ok\n"}]}
SIBLING_WRITER = (
    "import glob, os, sys, time\n"
    "if sys.stdin.readline().strip() == 'attacker':\n"
    "    time.sleep(0.3)\n"
    "    for path in glob.glob('/proc/[0-9]*/fd/1'):\n"
    "        if path.split('/')[2] != str(os.getpid()):\n"
    "            try:\n                with open(path, 'w') as f:\n                    f.write('999\\n')\n"
    "            except OSError:\n                pass\n"
    "else:\n    time.sleep(1.2)\n"
    "print('ok')\n"
)
SUM_ROW = {"tests": [{"input": "1 2\n", "output": "3\n"}]}
# Too slow (2.8 s of CPU against 1 s), in a chain of processes each of which stays under 1 s.
FORK_CHAIN = (
    "import os, sys, time\n"
    "def burn(s):\n    t = time.process_time()\n    while time.process_time() - t < s:\n        pass\n"
    "a, b = map(int, sys.stdin.readline().split())\n"
    "for _ in range(4):\n    burn(0.7)\n    pid = os.fork()\n    if pid:\n        os.waitpid(pid, 0)\n        os._exit(0)\n"
    "print(a + b)\n"
)
CHAIN_LIMITS = dataclasses.replace(LIMITS, wall_seconds=8)
# name: (row, program, limits, case_workers); each got +1 from the grader before issue 34.
SECOND_HOSTILE = {
    # a class named `math` stood in for the module the test uses without importing it
    "class_named_math": (MATH_ROW, "class math:\n    @staticmethod\n    def isclose(*a, **k):\n        return True\n"
                                   "def root(x):\n    return 0.0\n", LIMITS, 2),
    # helpers the prompt defines, redefined to fit a wrong answer
    "redefines_the_prompts_poly": (POLY_ROW, "def poly(xs, x):\n    return 0.0\ndef find_zero(xs):\n    return 0.0\n",
                                   LIMITS, 2),
    "redefines_the_prompts_encode_shift": (SHIFT_ROW, "def encode_shift(s):\n    return s\ndef decode_shift(s):\n"
                                                      "    return s\n", LIMITS, 2),
    # a bare 7 for an expected [7] outside the APPS / TACO layout
    "bare_element_for_a_one_element_list": (PLAIN_ONE_ELEMENT_ROW, "def solve(x):\n    return 7\n", LIMITS, 2),
    # a fork chain, each process with a fresh RLIMIT_CPU
    "fork_chain_resets_the_cpu_limit": (SUM_ROW, FORK_CHAIN, CHAIN_LIMITS, 2),
}
SECOND_CORRECT = {
    "poly_zero": (POLY_ROW, "def find_zero(xs):\n    f = lambda x: sum(c * x ** i for i, c in enumerate(xs))\n"
                            "    lo, hi = -100.0, 100.0\n    for _ in range(200):\n        mid = (lo + hi) / 2\n"
                            "        if (f(lo) < 0) == (f(mid) < 0):\n            lo = mid\n        else:\n"
                            "            hi = mid\n    return lo\n", LIMITS, 2),
    "decode_shift": (SHIFT_ROW, "def decode_shift(s):\n    return ''.join(chr((ord(c) - 5 - 97) % 26 + 97) for c in s)\n",
                     LIMITS, 2),
    "apps_one_element_list_unwrapped": (APPS_ROW, "def solve(x):\n    return 7\n", LIMITS, 2),
    "apps_one_element_list_as_is": (APPS_ROW, "def solve(x):\n    return [7]\n", LIMITS, 2),
    "plain_one_element_list": (PLAIN_ONE_ELEMENT_ROW, "def solve(x):\n    return [7]\n", LIMITS, 2),
    # the victim's output is its own: no sibling case could write into it
    "stdio_cases_isolated_from_each_other": (SIBLING_ROW, SIBLING_WRITER, dataclasses.replace(LIMITS, wall_seconds=4), 2),
    "math_module_without_import": (MATH_ROW, "def root(x):\n    return x ** 0.5\n", LIMITS, 2),
    "fork_that_stays_in_budget": (SUM_ROW, "import os\nif os.fork() == 0:\n    os._exit(0)\nos.wait()\n"
                                           "a, b = map(int, input().split())\nprint(a + b)\n", LIMITS, 2),
}


def _grade_all(backend: str, programs: dict) -> dict:
    """{name: report} of every program, graded under `backend` (bubblewrap: as an unprivileged user)."""
    if backend == "namespaces":
        return {n: grade_program(parse_tests(row, n), code, limits=limits, config=CONFIG, case_workers=workers)
                for n, (row, code, limits, workers) in programs.items()}
    names = sorted(programs)
    plans = [code_file.plan_grading(parse_tests(programs[n][0], n), programs[n][1], limits=programs[n][2],
                                    case_workers=programs[n][3]) for n in names]
    jobs = [harness_job(p) for p in plans]
    results = run_batch("bwrap", jobs, threads=2)
    return {n: code_file.judge_grading(p, res) for n, p, (res, _) in zip(names, plans, results)}


@pytest.mark.parametrize("backend", ["namespaces", "bwrap"])
def test_second_red_team_hacks_get_minus_one_and_correct_programs_pass(backend, runs):
    """Issue 34: a class named `math` no longer replaces the module the tests use; the prompt's
    helpers (HumanEval/32 `poly`, /50 `encode_shift`) are the prompt's; a bare element matches a
    one-element list only in the APPS / TACO layout; a fork chain shares one CPU budget; a stdio
    case cannot write into a sibling case's output. The correct counterparts pass."""
    reports = _grade_all(backend, {**SECOND_HOSTILE, **SECOND_CORRECT})
    wrong = {n: (r["passed"], r["error"], r["reason"]) for n, r in reports.items()
             if r["error"] is not None or r["passed"] != (n in SECOND_CORRECT)}
    assert wrong == {}
    assert "CPU time limit" in reports["fork_chain_resets_the_cpu_limit"]["reason"], reports["fork_chain_resets_the_cpu_limit"]
    assert bwrap_leftovers() == []


def test_prompt_helpers_are_the_implemented_definitions_but_the_entry_point():
    helpers = code_file.prompt_helpers(POLY_PROMPT, "find_zero")
    assert "def poly" in helpers and "import math" in helpers and "find_zero" not in helpers
    assert code_file.prompt_helpers("def f(x):\n    '''doc'''\n    ...\n", "g") is None  # a stub only
    assert code_file.prompt_helpers("Write a function that adds two numbers.", "add") is None  # prose
    assert parse_tests(POLY_ROW, "row")["prompt_code"] == helpers
    assert "prompt_code" not in parse_tests(MATH_ROW, "row")


def test_host_side_judging_is_bounded():
    """A returned dict (or set) of 30,000 int keys that all hash to 0 cost seconds on the host
    (decoded as a whole before the comparison); now the walk follows the expected value and
    stops at a deadline."""
    import time

    from components.tasks import _grade_harness

    keys = [k * (2**61 - 1) for k in range(30000)]  # hash(k) == 0 for every one
    forged_dict = {"#": "dict", "v": [[_grade_harness.encode(k), 1] for k in keys]}
    forged_set = {"#": "set", "v": [_grade_harness.encode(k) for k in keys]}
    wide = {"#": "dict", "v": [[str(k), 1] for k in range(30000)]}
    cases = ((forged_dict, '{"1": 1}', False), (forged_set, "[1]", False), (forged_set, json.dumps(keys), False),
             (forged_dict, json.dumps({str(k): 1 for k in keys}), True),  # int keys match their JSON spelling
             (wide, json.dumps({str(k): 1 for k in range(30000)}), True))
    for got, expected, want in cases:
        t0 = time.process_time()
        equal = code_file._json_equal(got, expected)
        assert time.process_time() - t0 < 0.5 and equal is want, (expected[:40], equal)
    with pytest.raises(code_file.JudgingBudgetExceeded):
        code_file.encoded_equal([1] * 10, [1] * 10, deadline=time.monotonic() - 1)


# -- the third red team (issue 44) --------------------------------------------------------------
# A test module the program leaves in its working dir: imported inside the harness, it finds the
# harness's `emit` and reports a pass.
EVIL_TEST_MODULE = (
    "import gc, os, sys\n"
    "for fn in gc.get_objects():\n"
    "    if getattr(fn, '__name__', '') == 'emit' and 'chain' in getattr(getattr(fn, '__code__', None), 'co_freevars', ()):\n"
    "        fn({'verdict': 'pass'}); fn({'done': True}); sys.stdout.flush(); os._exit(0)\n"
)
# A module object NAMED `unittest.__main__`: the old harness imported the real module of every
# stdlib name the program bound a module to, and unittest/__main__.py runs test discovery in the
# working dir, which imports the program's test_*.py inside the harness.
UNITTEST_MAIN = (f"with open('test_pass.py', 'w') as out:\n    out.write({EVIL_TEST_MODULE!r})\n"
                 "import types\nrunner = types.ModuleType('unittest.__main__')\n" + WRONG_F)
SEEDED_ROW = {"test": "import random\nrandom.seed(7)\nfor _ in range(5):\n    x = random.randint(1, 6)\n"
                      "    assert f(x) == x ** x\n"}
NP_ROW = {"test": "assert np.allclose(root(2.0), 1.41421356)\n"}
# Case 0 rewrites the harness's main.py (which the old harness ran again for every later case):
# case 1 then prints the expected "10" with no solution at all.
REWRITES_THE_HARNESS = (
    "import os, sys\n"
    "if sys.stdin.readline().split() == ['1', '2']:\n"
    "    for path in ('main.py', '../readonly/main.py'):\n"
    "        try:\n            with open(path, 'w') as f:\n                f.write('print(10)\\n')\n"
    "        except OSError:\n            pass\n"
    "    print(3)\n"
    "else:\n    print(0)\n"
)
TWO_SUMS_ROW = {"tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10\n"}]}
# Case 0 writes "999" into every other process's stdout it can open, for 1.5 s, while 20 more
# cases start one after another beside it: an exec'd case supervisor was dumpable (so its
# /proc/<pid>/fd/1, the case's stdout, writable by a same-uid sibling) until it called prctl.
RACE_ROW = {"tests": [{"input": "attacker\n", "output": "ok\n"}] + [{"input": "victim\n", "output": "ok\n"}] * 20}
RACE_WRITER = (
    "import glob, os, sys, time\n"
    "if sys.stdin.readline().strip() == 'attacker':\n"
    "    end, me = time.monotonic() + 1.5, str(os.getpid())\n"
    "    while time.monotonic() < end:\n"
    "        for path in glob.glob('/proc/[0-9]*/fd/1'):\n"
    "            if path.split('/')[2] != me:\n"
    "                try:\n                    with open(path, 'w') as f:\n                        f.write('999\\n')\n"
    "                except OSError:\n                    pass\n"
    "print('ok')\n"
)
RACE_LIMITS = dataclasses.replace(LIMITS, cpu_seconds=3, wall_seconds=5)
# name: (row, program, limits, case_workers); each got +1 from the grader before issue 44.
THIRD_HOSTILE = {
    "unittest_main_module_assert": (ASSERT_ROW, UNITTEST_MAIN, LIMITS, 2),
    "unittest_main_module_check": (CHECK_ROW, UNITTEST_MAIN, LIMITS, 2),
    "unittest_main_module_seeded_random": (SEEDED_ROW, UNITTEST_MAIN, LIMITS, 2),
    "fake_np_class": (NP_ROW, "class np:\n    @staticmethod\n    def allclose(*a, **k):\n        return True\n"
                              "def root(x):\n    return 0.0\n", LIMITS, 2),
    "rewrites_the_harness": (TWO_SUMS_ROW, REWRITES_THE_HARNESS, LIMITS, 1),
}
THIRD_CORRECT = {
    # the victims' outputs are their own: no case's stdout is ever open to a sibling
    "stdio_cases_isolated_from_their_first_instruction": (RACE_ROW, RACE_WRITER, RACE_LIMITS, 2),
    "seeded_random": (SEEDED_ROW, "import unittest\ndef f(x):\n    return x ** x\n", LIMITS, 2),
    "modules_the_tests_use_without_importing": (
        {"test": "assert math.isclose(f(2), 4)\nassert collections.Counter([f(1)])[1] == 1\n"},
        "import math as m\ndef f(x):\n    return m.pow(x, x)\n", LIMITS, 2),
    "writes_in_its_own_dir": (TWO_SUMS_ROW, "open('notes.txt', 'w').write('x')\na, b = map(int, input().split())\n"
                                            "print(a + b)\n", LIMITS, 1),
}


@pytest.mark.parametrize("backend", ["namespaces", "bwrap"])
def test_third_red_team_hacks_get_minus_one_and_correct_programs_pass(backend, runs):
    """Issue 44: a module object named `unittest.__main__` no longer makes the harness import
    anything (it ran test discovery and the program's test_*.py inside the harness: assert,
    check(candidate) and seeded-random rows passed with no solution); a fake `np` class is not
    taken for numpy; case 0 cannot rewrite the harness for the later cases (it is in a read-only
    dir); a sibling case cannot write into a case's stdout in the moment it starts (bubblewrap:
    the case's supervisor was exec'd, dumpable until its prctl). The correct counterparts pass."""
    reports = _grade_all(backend, {**THIRD_HOSTILE, **THIRD_CORRECT})
    wrong = {n: (r["passed"], r["error"], r["reason"]) for n, r in reports.items()
             if r["error"] is not None or r["passed"] != (n in THIRD_CORRECT)}
    assert wrong == {}
    assert "NameError" in reports["fake_np_class"]["reason"], reports["fake_np_class"]["reason"]
    assert reports["rewrites_the_harness"]["reason"] == "case 1: wrong output", reports["rewrites_the_harness"]["reason"]
    assert bwrap_leftovers() == []


def test_the_modules_of_a_test_come_from_the_test_alone(monkeypatch):
    """`test_modules` (run in the harness before the program starts) takes the names the tests
    import or use as modules: installed ones (standard library, or third party: numpy here, in
    this interpreter), a conventional alias (`np`), nothing else (a program class `Stack` the
    tests call a method of stays the program's); an alias whose module is not installed is
    reserved (None: the test gets a NameError, never the program's object)."""
    import sys

    import numpy

    from components.tasks import _grade_rpc

    found = _grade_rpc.test_modules("import unittest.mock\nassert np.allclose(f(1), 1)\n"
                                    "assert json.dumps(Stack.new()) == '[]'\nassert numpy.pi > 3\n", "import heapq\n")
    assert set(found) == {"np", "json", "numpy"} and found["np"] is numpy and found["numpy"] is numpy, found
    assert "unittest.mock" in sys.modules and "heapq" in sys.modules  # the tests' own imports, done now
    monkeypatch.setitem(_grade_rpc.CONVENTIONAL_ALIASES, "zz", "scalerl_no_such_module")
    assert _grade_rpc.test_modules("assert zz.ok(f(1))\n") == {"zz": None}
