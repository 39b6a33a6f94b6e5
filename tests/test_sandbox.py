"""The code sandbox and the `code_file` task: hostile programs end as -1, the grader survives, nothing leaks.

These run in CI (which runs as root, like the development machine). The sandbox-level tests
run under both backends (`_helpers_sandbox.BACKENDS`): ``namespaces`` in this process and
``bwrap`` as an unprivileged user; the `code_file` tests grade as root. Without root
the hostile tests skip, and `test_refuses_without_isolation` still checks the refusal.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from _helpers_sandbox import BACKENDS, UID_BASE, run_batch, sandbox_processes
from components.tasks import make_task
from components.tasks import sandbox
from components.tasks.sandbox import SandboxConfig, SandboxLimits, SandboxUnavailableError

FAST = SandboxLimits(cpu_seconds=1, wall_seconds=3, memory_bytes=256 * 2**20, max_processes=8, output_bytes=64 * 1024)
CONFIG = SandboxConfig(uid_base=UID_BASE)

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox isolates programs only when run as root")


@pytest.fixture
def sandbox_tmp(tmp_path, monkeypatch):
    """Route the sandbox's control dirs to a private dir, and check that nothing is left behind."""
    control_root = tmp_path / "control"
    control_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(control_root))
    yield control_root
    assert list(control_root.iterdir()) == [], "sandbox control dirs were left behind"
    end = time.monotonic() + 3.0
    while sandbox_processes() and time.monotonic() < end:  # a killed process may take a moment to go
        time.sleep(0.05)
    assert sandbox_processes() == [], "sandbox processes were left running"


SUM_TESTS = [{"input": "1 2\n", "output": "3\n"}, {"input": "40 2\n", "output": "42\n"}]
GOOD_SUM = "a, b = map(int, input().split())\nprint(a + b)\n"


@pytest.fixture
def sum_task(tmp_path):
    path = tmp_path / "data" / "code.jsonl"
    path.parent.mkdir()
    rows = [{"problem": f"Read two integers and print their sum. (variant {i})", "tests": SUM_TESTS} for i in range(4)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    task = make_task(
        "code_file", path=str(path), eval_size=1, cpu_seconds=1, wall_seconds=3, memory_mb=256, max_processes=8, output_kb=64
    )
    # Same limits, our uid range.
    task.sandbox_config = SandboxConfig(
        hide_paths=task.sandbox_config.hide_paths, uid_base=UID_BASE, python=task.sandbox_config.python
    )
    return task


def fenced(code: str) -> str:
    return f"<think>let me write it</think>Here is my program:\n```python\n{code}\n```"


# -- the code_file task -------------------------------------------------------------------------
@needs_root
def test_correct_program_passes_and_wrong_fails(sum_task, sandbox_tmp):
    p = sum_task.train_problems()[0]
    ok = sum_task.verify(p, fenced(GOOD_SUM))
    assert ok.passed and ok.reward == 1.0 and ok.error is None
    for bad in [fenced("print(3)"), fenced("a, b = map(int, input().split())\nprint(a - b)"), "no code at all", ""]:
        v = sum_task.verify(p, bad)
        assert not v.passed and v.reward == -1.0


@needs_root
def test_grading_from_threads(sum_task, sandbox_tmp):
    probs = sum_task.train_problems()
    with ThreadPoolExecutor(4) as pool:
        good = list(pool.map(lambda p: sum_task.verify(p, fenced(GOOD_SUM)).passed, probs))
        bad = list(pool.map(lambda p: sum_task.verify(p, fenced("print(0)")).passed, probs))
    assert good == [True] * len(probs) and bad == [False] * len(probs)


# Each would pass (print the right sum) if its attack succeeded or its limit were missing.
HOSTILE = {
    "infinite_loop": "while True:\n    pass\n",
    "sleep_forever": "import time\ntime.sleep(60)\n" + GOOD_SUM,
    "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n" + GOOD_SUM,
    "huge_allocation": "x = bytearray(2**30)\n" + GOOD_SUM,  # 1 GiB: 4x the limit, quick to fill without it
    "output_flood": GOOD_SUM + "import sys\nsys.stdout.flush()\nwhile True:\n    sys.stderr.write('x' * 4096)\n",
}


@needs_root
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_program_gets_minus_one_and_nothing_leaks(name, sum_task, sandbox_tmp):
    p = sum_task.train_problems()[0]
    t0 = time.monotonic()
    v = sum_task.verify(p, fenced(HOSTILE[name]))
    elapsed = time.monotonic() - t0
    assert not v.passed and v.reward == -1.0
    assert v.error is None  # a failing program, not a sandbox failure
    assert elapsed < 8.0, f"{name} took {elapsed:.1f} s"
    # The grader survives and can still start processes (the fork bomb used another uid).
    assert subprocess.run(["true"]).returncode == 0


@needs_root
def test_background_processes_of_a_passing_program_are_killed(sum_task, sandbox_tmp):
    p = sum_task.train_problems()[0]
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n    os._exit(0)\n" + GOOD_SUM
    assert sum_task.verify(p, fenced(code)).passed
    # sandbox_tmp's teardown asserts that the setsid'ed sleeper is gone.


@needs_root
def test_oracle_over_the_network_does_not_help(sum_task, sandbox_tmp):
    """A listener on the grader's loopback that answers every question: unreachable from the sandbox."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(0.1)
    port = server.getsockname()[1]
    served = []
    stop = False

    def serve():
        while not stop:
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                a, b = map(int, conn.recv(100).split())
                conn.sendall(f"{a + b}\n".encode())
                served.append((a, b))

    import threading

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        cheat = (
            "import socket, sys\ns = socket.create_connection(('127.0.0.1', %d), timeout=2)\n"
            "s.sendall(sys.stdin.read().encode())\nprint(s.recv(100).decode(), end='')\n" % port
        )
        # The oracle works from the grader's side...
        with socket.create_connection(("127.0.0.1", port), timeout=2) as c:
            c.sendall(b"1 2")
            assert c.recv(100) == b"3\n"
        # ... but not from inside the sandbox.
        p = sum_task.train_problems()[0]
        assert not sum_task.verify(p, fenced(cheat)).passed
        assert served == [(1, 2)]
    finally:
        stop = True
        thread.join(2)
        server.close()


BOMB = (
    "import os, time\nn = 0\nfor _ in range(100):\n    try:\n        pid = os.fork()\n"
    "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n"
    "    n += 1\nprint(n)\n"
)


@needs_root
@pytest.mark.parametrize("backend", BACKENDS)
def test_limits_are_reported(backend, sandbox_tmp):
    fast = dataclasses.asdict(FAST)
    jobs = [
        # A generous wall limit, so that the CPU limit (1 s of CPU) is what stops it even on a busy machine.
        {"code": "while True: pass", "limits": {**fast, "wall_seconds": 20}},
        {"code": "import time; time.sleep(60)", "limits": fast},
        {"code": "while True: print('x' * 1000)", "limits": fast},
        {"code": "x = bytearray(2**30)", "limits": fast},
        {"code": BOMB, "limits": fast},
    ]
    (loop, _), (sleep, _), (flood, _), (mem, _), (bomb, _) = run_batch(backend, jobs)
    assert loop.cpu_limit and not loop.timed_out and not loop.ok and 0.5 < loop.cpu_s < 2.5  # rusage lags the limit
    assert sleep.timed_out and not sleep.ok and 2.9 < sleep.wall_s < 4.0
    assert flood.output_limit and len(flood.stdout) == FAST.output_bytes
    assert mem.exit_code == 1 and "MemoryError" in mem.stderr
    # RLIMIT_NPROC bounds the run's own processes: the program itself plus at most 7 children.
    assert bomb.ok and int(bomb.stdout) == FAST.max_processes - 1


@needs_root
def test_hostile_programs_fail_and_leave_nothing_under_bwrap(sandbox_tmp):
    """Each HOSTILE program, with the sum problem's input, fails within its limits under
    bubblewrap too (graded by a user that is not root), and leaves no process (`sandbox_tmp`
    checks). `test_hostile_program_gets_minus_one_and_nothing_leaks` is the same as root."""
    jobs = [{"code": HOSTILE[name], "stdin": "1 2\n", "limits": dataclasses.asdict(FAST)} for name in sorted(HOSTILE)]
    for name, (res, seconds) in zip(sorted(HOSTILE), run_batch("bwrap", jobs, threads=len(jobs))):
        assert not res.ok and res.error is None, (name, res)
        assert seconds < 8.0, f"{name} took {seconds:.1f} s"


# The network interfaces the program sees (its network namespace's), from /proc/net/dev: glibc's
# if_nameindex() needs an AF_NETLINK socket, which the seccomp filter refuses.
IFACES = "import json; print(json.dumps(sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:])))"


@needs_root
@pytest.mark.parametrize("backend", BACKENDS)
def test_no_network(backend, sandbox_tmp):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    try:
        code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')\n"
        jobs = [{"code": code, "limits": dataclasses.asdict(FAST)},
                {"code": IFACES, "limits": dataclasses.asdict(FAST)}]
        (res, _), (ifaces, _) = run_batch(backend, jobs)
        assert not res.ok and "connected" not in res.stdout
        assert "Network is unreachable" in res.stderr or "Connection refused" in res.stderr
        with pytest.raises(socket.timeout):
            listener.accept()  # nobody connected to the grader's listener
        assert ifaces.ok and "eth" not in ifaces.stdout and "ens" not in ifaces.stdout
    finally:
        listener.close()


@pytest.fixture
def outside_dir():
    """A root-owned, world-readable directory outside /tmp with a secret (0600) and a public (0644) file."""
    d = tempfile.mkdtemp(prefix="scalerl-sandbox-test-", dir="/")
    os.chmod(d, 0o755)
    secret, public = os.path.join(d, "secret.txt"), os.path.join(d, "public.txt")
    with open(secret, "w") as f:
        f.write("TOP-SECRET")
    os.chmod(secret, 0o600)
    with open(public, "w") as f:
        f.write("PUBLIC")
    os.chmod(public, 0o644)
    yield d
    shutil.rmtree(d)


@needs_root
@pytest.mark.parametrize("backend", BACKENDS)
def test_cannot_read_grader_files(backend, outside_dir, sum_task, sandbox_tmp, tmp_path):
    secret = os.path.join(outside_dir, "secret.txt")
    assert open(secret).read() == "TOP-SECRET"  # the grader can
    note = tmp_path / "grader_note.txt"
    note.write_text("grader only")
    # The task's own test data, the repository, the grader's temp files and environment are out of reach.
    unreadable = [secret, sum_task.path, os.path.join(sandbox.REPO_ROOT, "pyproject.toml"), str(note), "/etc/shadow",
                  f"/proc/{os.getpid()}/environ"]
    paths = unreadable + [os.path.join(outside_dir, "public.txt")]
    # outside_dir is allowed into the view explicitly (the view is an allow-list): its secret is
    # protected by the permissions, its public file readable
    view = {"allow_paths": [outside_dir]}
    jobs = [{"code": f"print(open({path!r}).read())", "limits": dataclasses.asdict(FAST), "config": view} for path in paths]
    jobs.append({"code": "import os; print(' '.join(sorted(os.environ)))", "limits": dataclasses.asdict(FAST)})
    results = [res for res, _ in run_batch(backend, jobs)]
    for path, res in zip(unreadable, results):
        assert not res.ok and "TOP-SECRET" not in res.stdout, path
    assert "PermissionError" in results[0].stderr
    # The same directory is visible: the protection above is the permissions, not a missing path.
    assert results[-2].stdout.strip() == "PUBLIC"
    # Nothing of the grader's environment (the scrubbed one only).
    assert set(results[-1].stdout.split()) <= {"PATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "PYTHONIOENCODING", "PYTHONHASHSEED", "LC_CTYPE"}


@needs_root
def test_looking_up_the_answer_in_the_test_data_fails(sum_task, sandbox_tmp):
    """A program that would pass by looking its answer up in the test data gets -1."""
    data = sum_task.path
    p = sum_task.train_problems()[0]
    cheat = (
        "import json, sys\ninp = sys.stdin.read()\n"
        f"for line in open({data!r}):\n"
        "    for t in json.loads(line)['tests']:\n"
        "        if t['input'] == inp:\n"
        "            print(t['output'], end='')\n            sys.exit(0)\n"
    )
    assert not sum_task.verify(p, fenced(cheat)).passed


@needs_root
@pytest.mark.parametrize("backend", BACKENDS)
def test_cannot_write_outside_its_directory(backend, outside_dir, sandbox_tmp, tmp_path):
    host_tmp_target = os.path.join(tempfile.gettempdir(), f"scalerl-escape-{os.getpid()}")
    targets = [
        os.path.join(outside_dir, "written.txt"),
        os.path.join(sandbox.REPO_ROOT, "written.txt"),
        "/var/tmp/written.txt",
        "/dev/shm/written.txt",
    ]
    jobs = [{"code": f"open({target!r}, 'w').write('x')", "limits": dataclasses.asdict(FAST)} for target in targets]
    # /tmp inside the sandbox is private: a write there succeeds but never reaches the host.
    jobs.append({"code": f"open('/tmp/scalerl-escape-{os.getpid()}', 'w').write('x'); open('here.txt', 'w').write('y'); print('ok')",
                 "limits": dataclasses.asdict(FAST)})
    results = [res for res, _ in run_batch(backend, jobs)]
    for target, res in zip(targets, results):
        assert not res.ok, target
        assert not os.path.exists(target), target
    assert results[-1].ok and results[-1].stdout.strip() == "ok"
    assert not os.path.exists(f"/tmp/scalerl-escape-{os.getpid()}") and not os.path.exists(host_tmp_target)


@needs_root
def test_hostile_sandbox_runs_concurrently_with_a_correct_one(sum_task, sandbox_tmp):
    """A fork bomb in one run does not starve a concurrent correct run (separate uids)."""
    p = sum_task.train_problems()[0]
    with ThreadPoolExecutor(2) as pool:
        bomb = pool.submit(sum_task.verify, p, fenced(HOSTILE["fork_bomb"]))
        time.sleep(0.3)
        good = pool.submit(sum_task.verify, p, fenced(GOOD_SUM))
        assert good.result().passed
        assert not bomb.result().passed


# -- refusal and opt-outs -------------------------------------------------------------------------
def _fake_probe(**caps):
    base = {"euid": os.geteuid(), "net_ns": True, "net_ns_error": None, "mount_ns": True, "mount_ns_error": None,
            "pid_ns": True, "pid_ns_error": None, "seccomp": True, "seccomp_error": None,
            "bwrap": None, "bwrap_error": "bwrap not found on PATH"}
    base.update(caps)
    return lambda: dict(base)


def test_refuses_without_isolation(monkeypatch, tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"problem": "sum", "tests": SUM_TESTS}) + "\n" + json.dumps({"problem": "s2", "tests": SUM_TESTS}))
    monkeypatch.setattr(sandbox, "probe", _fake_probe(net_ns=False, net_ns_error="OSError: EPERM"))
    with pytest.raises(SandboxUnavailableError, match="network namespace.*allow_network=True"):
        make_task("code_file", path=str(path), eval_size=1)
    with pytest.raises(SandboxUnavailableError):
        sandbox.run_python("print(1)")
    monkeypatch.setattr(sandbox, "probe", _fake_probe(euid=1000))
    with pytest.raises(SandboxUnavailableError, match="not running as root.*allow_unsafe=True"):
        make_task("code_file", path=str(path), eval_size=1)


@needs_root
def test_network_opt_out_runs_without_network_namespace(monkeypatch, tmp_path, sandbox_tmp):
    monkeypatch.setattr(sandbox, "probe", _fake_probe(net_ns=False, net_ns_error="OSError: EPERM"))
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"problem": "sum", "tests": SUM_TESTS}) + "\n" + json.dumps({"problem": "s2", "tests": SUM_TESTS}))
    task = make_task("code_file", path=str(path), eval_size=1, allow_network=True)
    p = task.train_problems()[0]
    assert task.verify(p, fenced(GOOD_SUM)).passed
    # The program now shares the host's network namespace (that is what the opt-out means).
    res = sandbox.run_python(
        IFACES,
        config=SandboxConfig(allow_network=True, uid_base=UID_BASE),
    )
    host = sorted(n for _, n in socket.if_nameindex())
    assert res.ok and json.loads(res.stdout) == host, (res.stdout, host)


# -- test formats -------------------------------------------------------------------------------
@needs_root
def test_assert_and_functional_tests(tmp_path, sandbox_tmp):
    rows = [
        {"problem": "Write add(a, b).", "test": "assert add(1, 2) == 3\nassert add(-1, 1) == 0"},
        {"problem": "Double it.", "test": "def check(candidate):\n    assert candidate(2) == 4\n", "entry_point": "double"},
        {
            "problem": "Two sum.",
            "tests": json.dumps([
                {"input": "[2,7,11,15]\n9", "output": "[0, 1]", "testtype": "functional"},
                {"input": "[3,3]\n6", "output": "[0, 1]", "testtype": "functional"},
            ]),
            "metadata": {"func_name": "twoSum"},
        },
        {"problem": "Echo.", "tests": [{"input": "hi\n", "output": "hi"}]},
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    task = make_task("code_file", path=str(path), eval_size=1, cpu_seconds=1, wall_seconds=3)
    by_row = {p.meta["row"]: p for p in task.train_problems() + task.eval_problems()}
    assert [by_row[i].meta["test_kind"] for i in range(4)] == ["assert", "assert", "functional", "stdio"]
    assert "twoSum" in by_row[2].prompt
    two_sum = (
        "class Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n"
        "        for i, x in enumerate(nums):\n            if target - x in seen:\n"
        "                return [seen[target - x], i]\n            seen[x] = i\n"
    )
    good = {0: "def add(a, b):\n    return a + b", 1: "def double(x):\n    return 2 * x", 2: two_sum, 3: "print(input())"}
    bad = {0: "def add(a, b):\n    return a * b", 1: "def double(x):\n    return x + 1",
           2: "class Solution:\n    def twoSum(self, nums, target):\n        return [0, 0]", 3: "print('bye')"}
    for i in range(4):
        assert task.verify(by_row[i], fenced(good[i])).passed, i
        assert not task.verify(by_row[i], fenced(bad[i])).passed, i
    # A functional solution cannot pass by printing: expected outputs never enter the sandbox.
    assert not task.verify(by_row[2], fenced("print('[0, 1]')")).passed


def test_code_file_schema_errors(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"problem": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"row 0 has no tests.*keys present: \['problem'\]"):
        make_task("code_file", path=str(path))
    path.write_text(json.dumps({"statement": "x", "tests": SUM_TESTS}) + "\n")
    with pytest.raises(ValueError, match=r"no 'problem' text; keys present: \['statement', 'tests'\]"):
        make_task("code_file", path=str(path))
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        make_task("code_file", path=str(tmp_path / "missing.jsonl"))


@needs_root
def test_unsafe_opt_out_runs_as_the_grader_user(monkeypatch, sandbox_tmp):
    """allow_unsafe=True on a machine that cannot drop privileges: the program runs as this user."""
    monkeypatch.setattr(sandbox, "probe", _fake_probe(euid=12345))
    with pytest.raises(SandboxUnavailableError, match="allow_unsafe=True"):
        sandbox.run_python("print(1)", config=CONFIG)
    res = sandbox.run_python("import os; print(os.getuid())", limits=FAST, config=SandboxConfig(allow_unsafe=True, uid_base=UID_BASE))
    assert res.ok and res.stdout.strip() == str(os.getuid())


@needs_root
def test_apps_and_primeintellect_layouts(tmp_path, sandbox_tmp):
    rows = [
        {"problem": "APPS stdin", "tests": {"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]}},
        {"problem": "TACO call", "tests": json.dumps({"fn_name": "mul", "inputs": [[2, 3], [4, 5]], "outputs": [[6], [20]]})},
        {"problem": "PrimeIntellect", "tests": [{"type": "stdin_stdout", "input": "4 4\n", "output": "8\n"}]},
    ]
    path = tmp_path / "layouts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    task = make_task("code_file", path=str(path), eval_size=1, cpu_seconds=1, wall_seconds=3)
    by_row = {p.meta["row"]: p for p in task.train_problems() + task.eval_problems()}
    assert [by_row[i].meta["test_kind"] for i in range(3)] == ["stdio", "functional", "stdio"]
    add = "a, b = map(int, input().split())\nprint(a + b)"
    assert task.verify(by_row[0], fenced(add)).passed
    assert task.verify(by_row[1], fenced("def mul(a, b):\n    return a * b")).passed
    assert not task.verify(by_row[1], fenced("def mul(a, b):\n    return a + b")).passed
    assert task.verify(by_row[2], fenced(add)).passed
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"problem": "x", "tests": {"inputs": ["1"], "outputs": []}}))
    with pytest.raises(ValueError, match="row 0 tests: 1 inputs but 0 outputs"):
        make_task("code_file", path=str(bad))


def test_launcher_refuses_uids_of_real_accounts(monkeypatch):
    import importlib.util
    import pwd

    spec = importlib.util.spec_from_file_location("_launcher_under_test", sandbox.LAUNCHER)
    launcher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launcher)
    with pytest.raises(OSError, match="below 65536"):
        launcher._check_unused_uid(0)
    launcher._check_unused_uid(2_000_000_001)  # no account: fine
    real = pwd.getpwuid(0)
    monkeypatch.setattr(pwd, "getpwuid", lambda uid: real if uid == 2_000_000_001 else pwd.getpwnam("?"))
    with pytest.raises(OSError, match="belongs to the account 'root'"):
        launcher._check_unused_uid(2_000_000_001)
    with pytest.raises(ValueError, match="not a sandbox uid"):
        launcher.kill_uid(0)


# -- one memory, CPU and pids budget per run: where a cgroup (v2 or v1) can be had ------------------
# (the budgets themselves, on this machine's real cgroups: tests/test_sandbox_budgets.py)
V2_MOUNTS = "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid 0 0\n"
V1_MOUNTS = ("cgroup /sys/fs/cgroup/memory cgroup rw,nosuid,relatime,memory 0 0\n"
             "cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,nosuid,relatime,cpu,cpuacct 0 0\n"
             "cgroup /sys/fs/cgroup/pids cgroup rw,nosuid,relatime,pids 0 0\n")


def _cgroup_tree(root, controllers="cpu memory pids", subtree=""):
    mount = root / "sys/fs/cgroup"
    mount.mkdir(parents=True)
    (mount / "cgroup.controllers").write_text(controllers + "\n")
    (mount / "cgroup.subtree_control").write_text(subtree + "\n")
    return str(root)


def test_cgroup_decision_as_root(tmp_path):
    """As root: with memory and pids in the v2 root's controllers, runs go under
    <mount>/scalerl-sandbox, both enabled on the way (applying the plan makes the dir and writes
    them); with cgroup v1 (this machine: v2 mounted empty beside it), under scalerl-sandbox of
    each of the memory, cpuacct and pids hierarchies."""
    fs = _cgroup_tree(tmp_path)
    plan = sandbox.CGROUP.decide(0, V2_MOUNTS, {}, fs_root=fs)
    assert plan["version"] == 2 and set(plan["parents"].values()) == {"/sys/fs/cgroup/scalerl-sandbox"}, plan
    assert plan["enable"] == ["/sys/fs/cgroup/cgroup.subtree_control", "/sys/fs/cgroup/scalerl-sandbox/cgroup.subtree_control"]
    assert plan["create"] == ["/sys/fs/cgroup/scalerl-sandbox"]
    applied = sandbox.CGROUP.apply(plan, fs_root=fs)
    assert applied["version"] == 2
    assert (tmp_path / "sys/fs/cgroup/scalerl-sandbox/cgroup.subtree_control").read_text() == "+memory +pids"
    empty_v2 = "cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n"
    plan = sandbox.CGROUP.decide(0, empty_v2 + V1_MOUNTS, {}, fs_root=str(tmp_path / "none"))
    assert plan["version"] == 1 and plan["parents"] == {
        "memory": "/sys/fs/cgroup/memory/scalerl-sandbox", "cpu": "/sys/fs/cgroup/cpu,cpuacct/scalerl-sandbox",
        "pids": "/sys/fs/cgroup/pids/scalerl-sandbox"}, plan


@pytest.mark.parametrize("case", ["no_cgroups", "v1_without_pids", "not_root", "delegated_v2", "delegated_v2_no_subtree",
                                  "delegated_outside", "delegated_v1", "delegated_v1_without_pids", "delegated_mixed"])
def test_cgroup_decision_delegated_or_none(tmp_path, case):
    """Not root, runs go under the delegated dir(s) of $SCALERL_SANDBOX_CGROUP (one v2 dir that
    enables memory and pids for its children, or one dir per v1 hierarchy, together offering
    memory, CPU and pids); otherwise there is none, and the reason says why."""
    fs = _cgroup_tree(tmp_path, controllers="cpu pids" if case == "v1_without_pids" else "cpu memory pids")
    v2 = tmp_path / "sys/fs/cgroup/user.slice/job"
    v2.mkdir(parents=True)
    (v2 / "cgroup.controllers").write_text("memory pids\n")
    (v2 / "cgroup.subtree_control").write_text("" if case == "delegated_v2_no_subtree" else "memory pids\n")
    for c in ("memory", "cpu,cpuacct", "pids"):
        (tmp_path / "v1" / c / "job").mkdir(parents=True)
    v1_mounts = V1_MOUNTS.replace("/sys/fs/cgroup/", "/v1/")
    v1_dirs = ":".join(f"/v1/{c}/job" for c in ("memory", "cpu,cpuacct", "pids"))
    mounts = {"no_cgroups": "", "v1_without_pids": V2_MOUNTS + v1_mounts.splitlines()[0]}.get(case, V2_MOUNTS + v1_mounts)
    env = {"delegated_v2": "/sys/fs/cgroup/user.slice/job", "delegated_v2_no_subtree": "/sys/fs/cgroup/user.slice/job",
           "delegated_outside": "/tmp/job", "delegated_v1": v1_dirs, "delegated_v1_without_pids": v1_dirs.rsplit(":", 1)[0],
           "delegated_mixed": "/sys/fs/cgroup/user.slice/job:/v1/pids/job"}
    plan = sandbox.CGROUP.decide(0 if case in ("no_cgroups", "v1_without_pids") else 1000, mounts,
                                 {sandbox.CGROUP_ENV: env[case]} if case in env else {}, fs_root=fs)
    if case == "delegated_v2":
        assert plan["version"] == 2 and set(plan["parents"].values()) == {"/sys/fs/cgroup/user.slice/job"}, plan
        return
    if case == "delegated_v1":
        assert plan["version"] == 1 and plan["parents"]["cpu"] == "/v1/cpu,cpuacct/job", plan
        return
    assert plan["version"] is None and not plan["parents"] and plan["reason"], plan
    assert {"no_cgroups": "no cgroup v2 hierarchy offers memory and pids", "v1_without_pids": "no cgroup v1 hierarchy holds cpuacct, pids",
            "not_root": "not root", "delegated_v2_no_subtree": "lacks memory pids in its cgroup.subtree_control",
            "delegated_outside": "not a dir of a cgroup hierarchy", "delegated_v1_without_pids": "offer no pids budget",
            "delegated_mixed": "mix cgroup v1 and v2"}[case] in plan["reason"], plan


NO_CGROUP = {"version": None, "parents": {}, "reason": "test: none", "create": [], "enable": []}


def test_the_residual_memory_risk_is_named_once(monkeypatch, caplog):
    """Without a cgroup the sandbox names the risk: `residual_memory_risk()` returns the sentence
    (its bound measured in tests/test_sandbox_budgets.py) and the first sandbox created logs it, once."""
    monkeypatch.setattr(sandbox, "_cgroups", NO_CGROUP)
    monkeypatch.setattr(sandbox, "_warned", False)
    risk = sandbox.residual_memory_risk()
    assert risk and risk.startswith("sandbox: no cgroup for sandboxed runs (test: none)") and "RLIMIT_AS" in risk
    with caplog.at_level("WARNING", logger=sandbox.__name__):
        sandbox._warn_once()
        sandbox._warn_once()
    assert [r.getMessage() for r in caplog.records].count(risk) == 1
    monkeypatch.setattr(sandbox, "_cgroups", {**NO_CGROUP, "version": 1, "reason": "root"})
    assert sandbox.residual_memory_risk() is None


def test_run_limits_default_to_the_per_process_ones():
    """The run's CPU budget defaults to cpu_seconds, its memory budget to memory_bytes + tmpfs_bytes;
    the grader's run counts the harness and every case."""
    lim = sandbox.SandboxLimits(cpu_seconds=2, memory_bytes=100, tmpfs_bytes=10)
    assert lim.run_cpu() == 2.0 and lim.run_memory() == 110
    from components.tasks import code_file
    g = code_file.grading_limits("stdio", 4, lim, 2, 300.0)
    assert g.run_cpu_seconds == g.wall_seconds + 2 * 2 * 2.0 and g.run_memory_bytes == 3 * 100 + 10


def test_train_with_a_code_task_prints_the_memory_risk_at_start(monkeypatch, tmp_path, capsys):
    """`scalerl train` with a code task names the residual memory risk on stderr before training
    (experiments.train.validate_components builds the task, which checks the sandbox); a task that
    builds no sandbox prints nothing."""
    from _helpers_trainer import tiny_model

    from components.trainer.config import TrainConfig
    from experiments.train import validate_components

    path = tmp_path / "code.jsonl"
    path.write_text("\n".join(json.dumps({"problem": f"sum {i}", "tests": SUM_TESTS}) for i in range(3)) + "\n")
    model = tiny_model(tmp_path)
    monkeypatch.setattr(sandbox, "_cgroups", NO_CGROUP)
    monkeypatch.setattr(sandbox, "_warned", False)
    validate_components(TrainConfig(model_path=model, task="arithmetic", task_kwargs={"num_train": 20, "num_eval": 5}))
    assert "no cgroup for sandboxed runs" not in capsys.readouterr().err
    validate_components(TrainConfig(model_path=model, task="code_file", task_kwargs={"path": str(path), "eval_size": 1}))
    err = capsys.readouterr().err
    assert "sandbox: no cgroup for sandboxed runs (test: none)" in err
