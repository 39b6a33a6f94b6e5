"""The grading harness: runs a program's tests in the sandbox without letting the program reach them.

`components.tasks.code_file` runs this file as ``main.py`` in ONE sandbox run per verification,
from the run's read-only dir (``/tmp/readonly``: no process of the run can change it), beside
the harness's own modules (`SIBLINGS`): ``_grade_wire.py`` (what crosses a boundary: plain data,
report MACs, output digests) and ``_grade_rpc.py`` (the program's server and the harness's end
of it, for functional and assert tests). The program is ``solution.py`` in the working dir
(``/tmp/work``, the program's own); the test spec comes on this process's stdin (never in a
file). Standard library only.
Also imported on the host as ``components.tasks._grade_harness`` (its siblings then as modules of
the package), for the wire helpers it re-exports (`encode`, `decode`, `report_mac`,
`output_digest`, `normalize_output`, `PROGRAM_FILE`).

Order of operations (harness mode, ``main.py``):

0. takes its own directory off sys.path and loads its siblings from it by path
   (`load_siblings`), before any program runs;
1. ``prctl(PR_SET_DUMPABLE, 0)``: processes of the same uid (the program) can no longer open
   this process's ``/proc/<pid>/fd``, ``mem`` or ``environ`` (so not its stdin, its stdout or
   its memory) nor ptrace it; it has no child yet;
2. forks the *spawner* (`Spawner`), before it reads anything: every program process is forked
   from it, never exec'd, so each is undumpable from its first instruction and holds nothing
   of the spec (the spawner never read it);
3. reads all of stdin (the spec) and empties the stdin file where it may (`take_stdin`); the
   spec's header is parsed now, the cases one at a time as they start;
4. has the spawner start the program as SEPARATE processes with fresh pipes and no other descriptor:
   - ``stdio``: one per case (`supervise_program`: an undumpable subreaper that forks the
     program, runs solution.py in it and counts one CPU budget for all of its processes) (at
     most ``workers`` at a time) with the case's input on a pipe, a per-case wall-clock
     deadline, a per-case RLIMIT_CPU and a per-case output cap; the harness reports a salted
     digest of each case's normalised stdout and stops starting cases after the first failure;
   - ``functional`` / ``assert``: one server (`start_server`, `_grade_rpc.serve`) that imports
     the program (as a module named ``solution``, its stdin / stdout / stderr on /dev/null) and
     then answers calls over a pair of pipes. The harness calls the function once per
     functional case, or runs the assert / ``check(candidate)`` test code in ITS OWN interpreter
     with proxies (`_grade_rpc.Remote`) for the program's top-level names, so every call is a
     round trip whose arguments and return value cross as plain data only (`encode` /
     `decode`); the modules the test code uses are imported before the server starts, from the
     tests' own names only (`_grade_rpc.test_modules`);
5. writes its findings, one JSON line each prefixed by the run's nonce and a MAC chained over
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
import select
import selectors
import signal
import socket
import stat
import subprocess
import sys
import time

PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
# The harness's own modules, in load order (one may import those before it). In the sandbox they
# are files beside main.py, written there by code_file as main.py is; on the host, modules of
# this package.
SIBLINGS = ("_grade_wire", "_grade_rpc")

# What the host uses from here (code_file, tests): the wire helpers, re-exported.
__all__ = ["PROGRAM_FILE", "SIBLINGS", "decode", "dumps", "encode", "loads", "normalize_output", "output_digest",
           "report_mac"]


# -- start-up: sys.path and the sibling modules ------------------------------------------------
def drop_own_dir_from_path() -> None:
    """Remove this file's directory from sys.path.

    ``python -I`` keeps the script's directory on sys.path before Python 3.11 (3.11 adds -P to
    -I): were it writable by the program (it was its working dir before the harness moved to the
    read-only dir), a module the program wrote there (``colorsys.py``) would be imported by the
    harness when the tests import that name, and run inside the harness.
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


# -- the spawner: program processes forked from a process that never held the spec -------------
class Spawner:
    """The harness's end of the spawner: a process forked from the harness at its start, after it
    became undumpable and before it read anything, that forks every program process (a stdio
    case's supervisor, the server) on request (`spawn`), reaps them and reports each exit.

    Forked, not exec'd: exec makes a process dumpable again until it calls prctl, and in that
    window a sibling case (same uid) could open its /proc/<pid>/fd (the case's stdin and stdout)
    or write its memory. Not forked from the harness itself after the spec was read: the
    program would hold a copy of the spec (MAC key, salt, digests) in its memory."""

    def __init__(self, sock: socket.socket, pid: int):
        self.sock, self.pid = sock, pid
        self.exits: dict[int, tuple] = {}  # pid -> (wait status, CPU seconds)

    @classmethod
    def fork(cls):
        """(Spawner, None) in the harness; (None, request) in a program process the spawner forked."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid:
            theirs.close()
            return cls(ours, pid), None
        ours.close()
        return None, _spawner_loop(theirs)

    def spawn(self, request: dict, fds) -> int:
        """Start a program process for `request` ({"mode": "case" | "serve", "cpu", "open_files"})
        holding `fds` (stdin / stdout / stderr of a case; the server's two pipe ends); its pid."""
        socket.send_fds(self.sock, [dumps(request).encode()], list(fds))
        while True:
            msg = self._read(None)
            if msg is None:
                raise OSError("the spawner is gone")
            if "pid" in msg:
                return int(msg["pid"])
            self._record(msg)

    def _read(self, timeout):
        """The spawner's next message, waiting up to `timeout` seconds (None: as long as it takes);
        None when none came or the spawner is gone."""
        if not select.select([self.sock], [], [], timeout)[0]:
            return None
        try:
            data = self.sock.recv(65536)
        except OSError:
            return None
        return loads(data) if data else None

    def _record(self, msg) -> None:
        if isinstance(msg, dict) and "exit" in msg:
            self.exits[int(msg["exit"])] = (int(msg["status"]), float(msg["cpu"]))

    def drain(self) -> None:
        """Record every exit report that has arrived."""
        while True:
            msg = self._read(0)
            if msg is None:
                return
            self._record(msg)

    def exit_of(self, pid: int, timeout: float = 0.0):
        """(wait status, CPU seconds) of the program process `pid` once it exited, else None
        (waiting up to `timeout` seconds for the spawner's report)."""
        end = time.monotonic() + timeout
        self.drain()
        while pid not in self.exits:
            left = end - time.monotonic()
            msg = self._read(left) if left > 0 else None
            if msg is None:
                break
            self._record(msg)
        return self.exits.get(pid)

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()
        try:
            os.kill(self.pid, signal.SIGKILL)  # a program may have stopped it: never wait on it
            os.waitpid(self.pid, 0)
        except OSError:
            pass


def _spawner_loop(sock: socket.socket) -> dict:
    """The spawner's life: one program process per request, an exit report per reaped child,
    until the harness closes its end. Returns only in a program process: the request it is to
    run, with its descriptors (``"fds"``)."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the spec (stdin) and the report (stdout) are the harness's alone
        os.dup2(null, fd)
    os.close(null)
    pidfds: dict[int, int] = {}
    polling = False  # no pidfds here: poll for exits
    while True:
        ready = select.select([sock, *pidfds], [], [], 0.01 if polling else None)[0]
        _report_exits(sock, pidfds)
        if sock not in ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, 65536, 8)
        except OSError:
            data, fds = b"", []
        if not data:
            os._exit(0)  # the harness is gone
        pid = os.fork()
        if pid == 0:
            sock.close()
            for fd in pidfds:
                os.close(fd)
            return {**loads(data), "fds": fds}
        for fd in fds:
            os.close(fd)
        try:
            pidfds[os.pidfd_open(pid)] = pid
        except (AttributeError, OSError):
            polling = True
        sock.send(dumps({"pid": pid}).encode())


def _report_exits(sock: socket.socket, pidfds: dict) -> None:
    """Reap every exited child and report it: {"exit": pid, "status": wait status, "cpu": seconds}."""
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        for fd in [fd for fd, p in pidfds.items() if p == pid]:
            os.close(fd)
            del pidfds[fd]
        sock.send(dumps({"exit": pid, "status": status, "cpu": usage.ru_utime + usage.ru_stime}).encode())


class Child:
    """A program process the spawner started, as the harness sees it: its pid, pipes and exit
    (from the spawner's reports), with Popen's `poll` / `wait` / `returncode`."""

    def __init__(self, spawner: Spawner, pid: int, stdin=None, stdout=None, stderr=None):
        self.spawner, self.pid = spawner, pid
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode = None
        self.status, self.cpu_s = None, 0.0

    def _exit(self, timeout: float):
        if self.returncode is None:
            found = self.spawner.exit_of(self.pid, timeout)
            if found is not None:
                self.status, self.cpu_s = found
                self.returncode = os.waitstatus_to_exitcode(self.status)
        return self.returncode

    def poll(self):
        return self._exit(0.0)

    def wait(self, timeout=None):
        if self._exit(1e9 if timeout is None else timeout) is None:
            raise subprocess.TimeoutExpired(f"program process {self.pid}", timeout)
        return self.returncode


def start_case(spawner: Spawner, cpu_seconds: float, open_files: int) -> Child:
    """A stdio case's program (`supervise_program`): fresh pipes as its stdin / stdout / stderr, its own session."""
    pipes = [os.pipe() for _ in range(3)]
    theirs = (pipes[0][0], pipes[1][1], pipes[2][1])
    ours = (pipes[0][1], pipes[1][0], pipes[2][0])
    try:
        pid = spawner.spawn({"mode": "case", "cpu": cpu_seconds, "open_files": open_files}, theirs)
    except OSError:
        for fd in ours:
            os.close(fd)
        raise
    finally:
        for fd in theirs:
            os.close(fd)
    return Child(spawner, pid, os.fdopen(ours[0], "wb", 0), os.fdopen(ours[1], "rb", 0), os.fdopen(ours[2], "rb", 0))


def start_server(spawner: Spawner, open_files: int, cpu_seconds: float, req_fd: int, rep_fd: int) -> Child:
    """The program's server (`_grade_rpc.Server`'s `start`): its two pipe ends as its only other
    descriptors, /dev/null for stdin / stdout / stderr, its own session, its CPU budget."""
    pid = spawner.spawn({"mode": "serve", "cpu": cpu_seconds, "open_files": open_files}, (req_fd, rep_fd))
    return Child(spawner, pid)


def run_program_process(request: dict) -> int:
    """In a program process the spawner forked: its own session and descriptors, then the
    supervised program (`supervise_program`): a stdio case's solution.py, or the server."""
    os.setsid()
    fds = request["fds"]
    if request["mode"] == "case":
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        first_free = 3
    else:  # the server: /dev/null as stdio, its pipe ends as 3 and 4
        null = os.open(os.devnull, os.O_RDWR)
        moved = [os.dup(fd) for fd in fds]  # above every target first, so no dup2 overwrites one
        for target, fd in enumerate([null, null, null, *moved]):
            os.dup2(fd, target)
        first_free = 5
    os.closerange(first_free, 65536)  # nothing else of the spawner's
    if supervise_program(float(request["cpu"]), int(request["open_files"] or 0)):
        if request["mode"] == "case":
            run_case_program()
            return 0
        serve(3, 4)  # never returns
    return 0


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


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


# How long the harness waits for the spawner's report of a case it saw exit (or killed).
REAP_WAIT_S = 5.0


def _reap(proc: Child):
    """(wait status, CPU seconds) of an exited (or killed) case, from the spawner's report; killed
    by SIGKILL, with no CPU time, if no report comes (the spawner was stopped or killed)."""
    try:
        proc.wait(REAP_WAIT_S)
    except subprocess.TimeoutExpired:
        return int(signal.SIGKILL), 0.0
    return proc.status, proc.cpu_s


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


def run_stdio(header: dict, read_case, emit, spawner: Spawner) -> None:
    """Run every stdio case (at most `workers` at once), emitting one result per finished case."""
    cap, wall, cpu = int(header["output_cap"]), float(header["case_wall"]), float(header["case_cpu"])
    salt, workers, n = header["salt"], max(1, int(header["workers"])), int(header["n"])
    open_files = int(header.get("open_files") or 0)
    sel = selectors.DefaultSelector()
    sel.register(spawner, selectors.EVENT_READ, ("exit", None))  # its exit reports wake the loop
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
                proc = start_case(spawner, cpu, open_files)
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
        if not running:
            break
        now = time.monotonic()
        timeout = max(0.0, min(c.deadline for c in running.values()) - now)
        for key, _ in sel.select(timeout):
            what, case = key.data
            if what == "exit":
                spawner.drain()  # each case looks its own report up below
                continue
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
            elif case.proc.poll() is not None:
                finish(case, timed_out=False)
            elif now >= case.deadline:
                finish(case, timed_out=True)
    emit({"started": started})


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
    spawner, request = Spawner.fork()  # before anything is read: the spawner never holds the spec
    if request is not None:
        return run_program_process(request)
    try:
        run_spec(take_stdin(stdin), stdout, spawner)
    finally:
        spawner.close()
    return 0


def run_spec(spec: io.BytesIO, stdout, spawner: Spawner) -> None:
    """Run the tests the spec describes, reporting on `stdout` (`emit`: nonce, chained MAC, JSON)."""
    header = loads(spec.readline())
    nonce = header["nonce"]
    chain = [""]

    def emit(obj) -> None:
        body = dumps(obj)
        chain[0] = report_mac(header["mac_key"], chain[0], body)
        stdout.write(f"{nonce} {chain[0]} {body}\n")
        stdout.flush()

    def read_case() -> dict:
        return loads(spec.readline())

    def start(cpu_seconds: float, req_fd: int, rep_fd: int) -> Child:
        return start_server(spawner, int(header.get("open_files") or 0), cpu_seconds, req_fd, rep_fd)

    kind = header["kind"]
    if kind == "stdio":
        run_stdio(header, read_case, emit, spawner)
    elif kind == "functional":
        run_functional(header, read_case, emit, start)
    else:
        run_assert(header, emit, start)
    emit({"done": True})


def main(argv) -> int:
    return harness(sys.stdin, sys.stdout)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
