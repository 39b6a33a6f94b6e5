"""The grading harness: runs a program's tests in the sandbox without letting the program reach them.

`components.tasks.code_file` runs this file as ``main.py`` in ONE sandbox run per verification,
with the program in ``solution.py`` next to it, beside the harness's own modules (`SIBLINGS`):
``_grade_wire.py`` (what crosses a boundary: plain data, report MACs, output digests) and
``_grade_rpc.py`` (the program's server and the harness's end of it, for functional and assert
tests); the test spec comes on this process's stdin (never in a file). Standard library only.
Also imported on the host as ``components.tasks._grade_harness`` (its siblings then as modules of
the package), for the wire helpers it re-exports (`encode`, `decode`, `report_mac`,
`output_digest`, `normalize_output`, `PROGRAM_FILE`).

Order of operations (harness mode, ``main.py``):

0. takes its own directory (the program's writable working dir) off sys.path and loads its
   siblings from it by path (`load_siblings`), before any program runs;
1. ``prctl(PR_SET_DUMPABLE, 0)``: processes of the same uid (the program) can no longer open
   this process's ``/proc/<pid>/fd``, ``mem`` or ``environ`` (so not its stdin, its stdout or
   its memory) nor ptrace it; it has no child yet;
2. reads all of stdin (the spec) and empties the stdin file where it may (`take_stdin`); the
   spec's header is parsed now, the cases one at a time as they start;
3. starts the program as SEPARATE child processes with fresh pipes and no other descriptor:
   - ``stdio``: one ``main.py --case`` per case (`supervise_program`: an undumpable
     subreaper that forks the program, runs solution.py in it and counts one CPU budget for
     all of its processes) (at most ``workers`` at a time) with
     the case's input on a pipe, a per-case wall-clock deadline, a per-case RLIMIT_CPU (set with
     prlimit right after the start) and a per-case output cap; the harness reports a salted
     digest of each case's normalised stdout and stops starting cases after the first failure;
   - ``functional`` / ``assert``: one ``python -I -B main.py --serve`` child (`start_server`,
     `_grade_rpc.serve`) that imports the program (as a module named ``solution``, its stdin /
     stdout / stderr on /dev/null) and then answers calls over a pair of pipes. The harness
     calls the function once per functional case, or runs the assert / ``check(candidate)``
     test code in ITS OWN interpreter with proxies (`_grade_rpc.Remote`) for the program's
     top-level names, so every call is a round trip whose arguments and return value cross as
     plain data only (`encode` / `decode`);
4. writes its findings, one JSON line each prefixed by the run's nonce and a MAC chained over
   the lines before it (`report_mac`, keyed by a secret of the spec), to its own stdout, which
   no child shares.

The program therefore never sees an expected value or the test code, cannot exit or patch the
harness, and cannot hand back an object with its own ``__eq__``: whatever it returns arrives
as None / bool / int / float / complex / str / bytes / list / tuple / dict / set / frozenset
(or, in assert tests, as an opaque handle whose ``==`` with plain data is always False).
"""

from __future__ import annotations

import io
import os
import resource
import selectors
import signal
import stat
import subprocess
import sys
import time

PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
SERVE_FLAG = "--serve"
CASE_FLAG = "--case"
# The harness's own modules, in load order (one may import those before it). In the sandbox they
# are files beside main.py, written there by code_file as main.py is; on the host, modules of
# this package.
SIBLINGS = ("_grade_wire", "_grade_rpc")

# What the host uses from here (code_file, tests): the wire helpers, re-exported.
__all__ = ["PROGRAM_FILE", "SIBLINGS", "decode", "dumps", "encode", "loads", "normalize_output", "output_digest",
           "report_mac"]


# -- start-up: sys.path and the sibling modules ------------------------------------------------
def drop_own_dir_from_path() -> None:
    """Remove this file's directory (the program's writable working dir) from sys.path.

    ``python -I`` keeps the script's directory on sys.path before Python 3.11 (3.11 adds -P to
    -I): a module the program writes there (``colorsys.py``) would be imported by the harness
    when the tests or `_grade_rpc.test_namespace` import that name, and run inside the harness.
    """
    here = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [p for p in sys.path if p and os.path.realpath(p) != here]


def load_siblings() -> None:
    """Load each of `SIBLINGS` from this file's directory by path and register it in sys.modules.

    By path, because that directory is off sys.path (`drop_own_dir_from_path`: nothing there is
    ever imported by name); registered under its own name, so that ``_grade_rpc``'s
    ``from _grade_wire import ...`` finds the module loaded here, the SAME object (one
    `EncodeError` class on both sides). Compiled from the source, as Python runs
    main.py itself: never from a ``__pycache__`` file in the working dir (``-B`` only stops
    writing them).
    """
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    for name in SIBLINGS:
        path = os.path.join(here, name + ".py")
        module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path))
        with open(path, encoding="utf-8") as f:
            code = compile(f.read(), path, "exec", dont_inherit=True)
        sys.modules[name] = module
        exec(code, module.__dict__)


if __package__:  # imported on the host, as components.tasks._grade_harness
    from components.tasks._grade_rpc import run_assert, run_functional, serve
    from components.tasks._grade_wire import (PROGRAM_FILE, decode, dumps, encode, loads, normalize_output,
                                              output_digest, report_mac)
else:  # run as main.py in the sandbox: before stdin is read, before any child starts
    drop_own_dir_from_path()
    load_siblings()
    from _grade_rpc import run_assert, run_functional, serve
    from _grade_wire import PROGRAM_FILE, decode, dumps, encode, loads, normalize_output, output_digest, report_mac


# -- harness side: child processes -------------------------------------------------------------
# A child's open-file limit (the harness's own is raised to hold its workers' pipes); set by `harness`.
_child_open_files = None


def _set_cpu_limit(pid: int, seconds: float) -> None:
    """RLIMIT_CPU (and RLIMIT_NOFILE) of a started child: it inherits the harness's, which cover
    every case; the program gets its own."""
    cpu = max(1, int(-(-float(seconds) // 1)))
    limits = [(resource.RLIMIT_CPU, (cpu, cpu + 1))]
    if _child_open_files:
        limits.append((resource.RLIMIT_NOFILE, (_child_open_files, _child_open_files)))
    for which, value in limits:
        try:
            resource.prlimit(pid, which, value)
        except (OSError, ValueError):
            pass  # already gone, or a limit the harness may not set: the wall deadline still applies


def _start(argv: list, cpu_seconds: float) -> subprocess.Popen:
    """A stdio case's program: fresh pipes, no other descriptor, its own session, its CPU limit."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            close_fds=True, start_new_session=True)
    _set_cpu_limit(proc.pid, cpu_seconds)
    return proc


def supervised_argv(mode: str, cpu_seconds: float, *args) -> list:
    """The command that runs the program (mode `CASE_FLAG`: a stdio case; `SERVE_FLAG`: the server)
    under `supervise_program` with one CPU budget of `cpu_seconds` for all its processes."""
    return [sys.executable, "-I", "-B", os.path.abspath(__file__), mode, repr(float(cpu_seconds)),
            str(int(_child_open_files or 0)), *map(str, args)]


def start_server(cpu_seconds: float, req_fd: int, rep_fd: int) -> subprocess.Popen:
    """The program's server (`_grade_rpc.Server`'s `start`): its two pipe ends as its only other
    descriptors, /dev/null for stdin / stdout / stderr, its own session, its CPU limit."""
    argv = supervised_argv(SERVE_FLAG, cpu_seconds, req_fd, rep_fd)
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            close_fds=True, pass_fds=(req_fd, rep_fd), start_new_session=True)
    _set_cpu_limit(proc.pid, cpu_seconds)
    return proc


# -- program side: one CPU budget for all of a case's processes, no sibling can reach it -------
CPU_POLL_S = 0.02
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# Kept in step with _sandbox_supervisor.py's copy by hand: each file runs alone in the sandbox (as a script's
# source, with only the standard library there), so neither can import the other.
def _proc_stats() -> dict:
    """{pid: (ppid, CPU seconds of the process and of the children it reaped)} of every live process."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        fields = data[data.rfind(b")") + 2:].split()
        try:  # state, ppid, ... utime (14), stime, cutime, cstime (17)
            out[int(entry)] = (int(fields[1]), sum(int(x) for x in fields[11:15]) / _CLK_TCK)
        except (IndexError, ValueError):
            continue
    return out


def descendants_cpu(root: int) -> tuple[float, list]:
    """(CPU seconds, pids) of the live descendants of `root` (their own and their reaped children's)."""
    stats = _proc_stats()
    children: dict[int, list] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, found, todo = 0.0, [], list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        found.append(pid)
        total += stats[pid][1]
        todo.extend(children.get(pid, ()))
    return total, found


def _kill_descendants(root: int) -> None:
    """SIGKILL every descendant of `root` until none is left (orphans come to `root`, a subreaper)."""
    for _ in range(1000):
        _, pids = descendants_cpu(root)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        time.sleep(0.001)


def supervise_program(cpu_seconds: float, open_files: int) -> bool:
    """Run the program under a supervisor: True in the program's process (it then runs the
    program), never returns in the supervisor (it exits as the program did).

    The supervisor, this process, is undumpable, and so is the program it forks (fork keeps
    that; the program is not exec'd): no other case's program, though of the same uid, can open
    its ``/proc/<pid>/fd`` (stdin, stdout) or read its memory. It is a child subreaper, so every
    process the program starts stays its descendant, orphans included, and it counts ONE CPU
    budget for all of them: its reaped children's CPU time plus that of every live descendant,
    polled every `CPU_POLL_S`. RLIMIT_CPU alone is per process: a chain of forks, each with a
    fresh budget, outran it. Over the budget (whole seconds, as RLIMIT_CPU) it kills them all and
    dies of SIGXCPU; otherwise, once the program exits, it kills whatever the program left and
    exits with the program's status (or dies of its signal).
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    budget = max(1, int(-(-float(cpu_seconds) // 1)))
    try:
        resource.setrlimit(resource.RLIMIT_CPU, (budget, budget + 1))
        if open_files > 0:
            resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))
    except (OSError, ValueError):
        pass
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0 or libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        os.write(2, b"harness: cannot supervise the program\n")
        os._exit(3)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    pid = os.fork()
    if pid == 0:
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        gid = os.getgid()
        if os.getegid() != gid:  # the sandbox's process-view gid is the harness's, not the program's
            os.setresgid(gid, gid, gid)
        return True
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # only the program holds the case's pipes (and the server's)
        os.dup2(null, fd)
    os.closerange(3, 65536)
    status = None
    while status is None:
        while True:
            try:
                wpid, wstatus = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:  # cannot be (the program is ours until reaped): count it killed
                wpid, wstatus = pid, signal.SIGKILL
            if wpid == 0:
                break
            if wpid == pid:
                status = wstatus
                break
        if status is not None:
            break
        used = resource.getrusage(resource.RUSAGE_CHILDREN)
        live, _ = descendants_cpu(os.getpid())
        if used.ru_utime + used.ru_stime + live >= budget:
            _kill_descendants(os.getpid())
            _die_of(signal.SIGXCPU)
        signal.sigtimedwait({signal.SIGCHLD}, CPU_POLL_S)
    _kill_descendants(os.getpid())
    if os.WIFSIGNALED(status):
        _die_of(os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def _die_of(sig: int) -> None:
    """Exit killed by `sig`, as the program was (the harness reads the signal). Never returns."""
    try:
        signal.signal(sig, signal.SIG_DFL)
    except (OSError, ValueError):
        pass
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
    os.kill(os.getpid(), sig)
    os.kill(os.getpid(), signal.SIGKILL)


def run_case_program() -> None:
    """In a stdio case's (supervised) program process: run solution.py as ``python -I solution.py`` would."""
    import runpy

    sys.argv[:] = [PROGRAM_FILE]
    if sys.version_info < (3, 11):  # -I kept the script's directory on sys.path before 3.11
        sys.path.insert(0, os.getcwd())
    runpy.run_path(PROGRAM_FILE, run_name="__main__")


def _pidfd(pid: int):
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def _reap(proc: subprocess.Popen):
    """(wait status, CPU seconds) of an exited (or killed) child, via wait4."""
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    except ChildProcessError:
        return 0, 0.0
    proc.returncode = os.waitstatus_to_exitcode(status)  # so Popen never waits again
    return status, usage.ru_utime + usage.ru_stime


def _describe(status, cpu_s, cpu_limit, timed_out, over_cap, err_tail: bytes) -> tuple[bool, str]:
    """(ok, reason) of a finished case, in the words of `SandboxResult.describe`."""
    if timed_out:
        return False, "wall-clock timeout"
    if over_cap:
        return False, "output limit"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s >= max(1.0, cpu_limit) - 0.05):
            return False, "CPU time limit"
        if sig == signal.SIGXFSZ:
            return False, "output limit"
        name = signal.Signals(sig).name if sig in signal.valid_signals() else str(sig)
        return False, f"killed by {name}"
    code = os.WEXITSTATUS(status)
    if code:
        tail = err_tail.decode("utf-8", "replace").strip().splitlines()[-1:]
        return False, f"exit code {code}" + (f": {tail[0][:200]}" if tail else "")
    return True, "ok"


class _Case:
    """One running stdio case: its process, pipes and what it has written so far."""

    def __init__(self, j, proc, data: bytes, deadline: float):
        self.j, self.proc, self.data, self.deadline = j, proc, data, deadline
        self.sent = 0
        self.out = bytearray()
        self.err = bytearray()  # the last bytes of stderr (for the reason)
        self.sizes = {"out": 0, "err": 0}  # bytes written to stdout / stderr (each capped)
        self.over_cap = False
        self.pidfd = _pidfd(proc.pid)
        for f in (proc.stdin, proc.stdout, proc.stderr):
            os.set_blocking(f.fileno(), False)
        if not data:
            self.close_stdin()

    def close_stdin(self):
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            self.proc.stdin = None


def run_stdio(header: dict, read_case, emit) -> None:
    """Run every stdio case (at most `workers` at once), emitting one result per finished case."""
    cap, wall, cpu = int(header["output_cap"]), float(header["case_wall"]), float(header["case_cpu"])
    salt, workers, n = header["salt"], max(1, int(header["workers"])), int(header["n"])
    argv = supervised_argv(CASE_FLAG, cpu)
    sel = selectors.DefaultSelector()
    running: dict[int, _Case] = {}
    started = 0
    stop = False

    def finish(case: _Case, timed_out: bool) -> None:
        nonlocal stop
        if timed_out:
            _kill_group(case.proc.pid)
        status, cpu_s = _reap(case.proc)
        for f in (case.proc.stdout, case.proc.stderr):  # what it wrote before exiting is in the pipe
            _drain(case, f, cap)
            sel.unregister(f)
            f.close()
        if case.proc.stdin is not None:
            sel.unregister(case.proc.stdin)
            case.close_stdin()
        if case.pidfd is not None:
            sel.unregister(case.pidfd)
            os.close(case.pidfd)
        _kill_group(case.proc.pid)  # whatever it left in its process group
        ok, why = _describe(status, cpu_s, cpu, timed_out, case.over_cap, bytes(case.err))
        digest = output_digest(salt, bytes(case.out).decode("utf-8", "replace"))
        expected = expectations.get(case.j)
        emit({"case": case.j, "ok": ok, "why": why, "digest": digest,
              "head": bytes(case.out[:200]).decode("utf-8", "replace")})
        if not ok or digest != expected:
            stop = True  # never start another case after a failure
        del running[case.j]

    expectations: dict[int, str] = {}
    while True:
        while not stop and started < n and len(running) < workers:
            spec = read_case()
            expectations[started] = spec["digest"]
            try:
                proc = _start(argv, cpu)
            except OSError as err:  # e.g. no process slot left (a fork bomb of an earlier case)
                emit({"case": started, "ok": False, "why": f"cannot start the program: {err}", "digest": "", "head": ""})
                stop = True
                break
            case = _Case(started, proc, spec["input"].encode("utf-8", "surrogatepass"), time.monotonic() + wall)
            running[started] = case
            started += 1
            if case.proc.stdin is not None:
                sel.register(case.proc.stdin, selectors.EVENT_WRITE, ("in", case))
            sel.register(case.proc.stdout, selectors.EVENT_READ, ("out", case))
            sel.register(case.proc.stderr, selectors.EVENT_READ, ("err", case))
            if case.pidfd is not None:
                sel.register(case.pidfd, selectors.EVENT_READ, ("exit", case))
        if not running:
            break
        now = time.monotonic()
        timeout = max(0.0, min(c.deadline for c in running.values()) - now)
        if any(c.pidfd is None for c in running.values()):
            timeout = min(timeout, 0.01)
        for key, _ in sel.select(timeout):
            what, case = key.data
            if case.j not in running:
                continue
            if what == "in":
                _feed(case, sel)
            elif what in ("out", "err"):
                _drain(case, key.fileobj, cap, once=True)
                if case.over_cap:
                    _kill_group(case.proc.pid)
        now = time.monotonic()
        for case in list(running.values()):
            if case.over_cap:
                finish(case, timed_out=False)
            elif _exited(case):
                finish(case, timed_out=False)
            elif now >= case.deadline:
                finish(case, timed_out=True)
    emit({"started": started})


def _exited(case: _Case) -> bool:
    """Has the case's process exited (without reaping it)?"""
    try:
        return os.waitid(os.P_PID, case.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _feed(case: _Case, sel) -> None:
    try:
        case.sent += os.write(case.proc.stdin.fileno(), case.data[case.sent:case.sent + 65536])
    except BlockingIOError:
        return
    except OSError:  # the program closed its stdin: it does not want the rest
        case.sent = len(case.data)
    if case.sent >= len(case.data):
        sel.unregister(case.proc.stdin)
        case.close_stdin()


def _drain(case: _Case, f, cap: int, once: bool = False) -> None:
    """Read what is available on the case's stdout / stderr without waiting for EOF."""
    if f.closed:
        return
    while True:
        try:
            chunk = os.read(f.fileno(), 65536)
        except (BlockingIOError, OSError):
            return
        if not chunk:
            return
        stream = "out" if f is case.proc.stdout else "err"
        case.sizes[stream] += len(chunk)
        if stream == "out":
            case.out += chunk[: max(0, cap + 1 - len(case.out))]
        else:
            case.err = (case.err + chunk)[-4096:]
        if case.sizes[stream] > cap:  # exactly `cap` bytes is allowed
            case.over_cap = True
            return
        if once:
            return


# -- harness side: the run ---------------------------------------------------------------------
def take_stdin(stdin) -> io.BytesIO:
    """All of stdin, then the stdin FILE emptied where this process may write it.

    Defence in depth: a sandbox process that keeps the file open and stays readable by the
    program's uid (bubblewrap's own init did, before the sandbox made its undumpable supervisor
    the namespace's init) would otherwise let the
    program read the spec (test code, nonce, salt) through /proc/<pid>/fd/0. No program runs yet.
    """
    data = stdin.buffer.read()
    try:
        if stat.S_ISREG(os.fstat(stdin.fileno()).st_mode):
            os.close(os.open(f"/proc/self/fd/{stdin.fileno()}", os.O_WRONLY | os.O_TRUNC))
    except OSError:
        pass  # not ours to write (root-owned in the namespaces backend, where nothing else holds it)
    return io.BytesIO(data)


def harness(stdin, stdout) -> int:
    import ctypes

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a program cannot interrupt the test code
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        stdout.write("harness: cannot make the harness undumpable\n")
        return 3
    spec = take_stdin(stdin)
    header = loads(spec.readline())
    nonce = header["nonce"]
    global _child_open_files
    _child_open_files = header.get("open_files")

    chain = [""]

    def emit(obj) -> None:
        body = dumps(obj)
        chain[0] = report_mac(header["mac_key"], chain[0], body)
        stdout.write(f"{nonce} {chain[0]} {body}\n")
        stdout.flush()

    def read_case() -> dict:
        return loads(spec.readline())

    kind = header["kind"]
    if kind == "stdio":
        run_stdio(header, read_case, emit)
    elif kind == "functional":
        run_functional(header, read_case, emit, start_server)
    else:
        run_assert(header, emit, start_server)
    emit({"done": True})
    return 0


def main(argv) -> int:
    if len(argv) == 6 and argv[1] == SERVE_FLAG:
        if supervise_program(float(argv[2]), int(argv[3])):
            serve(int(argv[4]), int(argv[5]))
    if len(argv) == 4 and argv[1] == CASE_FLAG:
        if supervise_program(float(argv[2]), int(argv[3])):
            run_case_program()
            return 0
    return harness(sys.stdin, sys.stdout)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
