"""The grading harness: runs a program's tests in the sandbox without letting the program reach them.

`components.tasks.code_file` runs this file as ``main.py`` in ONE sandbox run per verification,
with the program in ``solution.py`` next to it and the test spec on this process's stdin (never
in a file). Standard library only; also imported on the host for the shared helpers
(`encode`, `decode`, `normalize_output`, `output_digest`).

Order of operations (harness mode, ``main.py``):

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
   - ``functional`` / ``assert``: one ``python -I -B main.py --serve`` child that imports the
     program (as a module named ``solution``, its stdin / stdout / stderr on /dev/null) and then
     answers calls over a pair of pipes. The harness calls the function once per functional
     case, or runs the assert / ``check(candidate)`` test code in ITS OWN interpreter with
     proxies (`Remote`) for the program's top-level names, so every call is a round trip
     whose arguments and return value cross as plain data only (`encode` / `decode`);
4. writes its findings, one JSON line each prefixed by the run's nonce and a MAC chained over
   the lines before it (`report_mac`, keyed by a secret of the spec), to its own stdout, which
   no child shares.

The program therefore never sees an expected value or the test code, cannot exit or patch the
harness, and cannot hand back an object with its own ``__eq__``: whatever it returns arrives
as None / bool / int / float / complex / str / bytes / list / tuple / dict / set / frozenset
(or, in assert tests, as an opaque handle whose ``==`` with plain data is always False).
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import hmac
import io
import json
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
PROGRAM_FILE = "solution.py"
PROGRAM_MODULE = "solution"
MAX_MESSAGE = 64 * 2**20  # a single RPC message (request or reply) larger than this is an error


# -- plain data --------------------------------------------------------------------------------
class EncodeError(TypeError):
    """A value that is not plain data (and no handle is allowed for it)."""


def encode(x, handle=None):
    """`x` as JSON-able tagged data; containers recursively. Exact types only (no subclasses).

    JSON lists are lists, other containers are tagged objects ``{"#": kind, "v": ...}``;
    ``handle(x)`` (when given) turns any other object into a tag, else `EncodeError`.
    """
    t = type(x)
    if x is None or t is bool or t is str:
        return x
    if t is int:  # JSON digits are limited (sys.int_max_str_digits); hex is not
        return x if -2**63 < x < 2**63 else {"#": "int", "v": hex(x)}
    if t is float:
        return x if x == x and x not in (float("inf"), float("-inf")) else {"#": "float", "v": repr(x)}
    if t is list:
        return [encode(v, handle) for v in x]
    if t is tuple:
        return {"#": "tuple", "v": [encode(v, handle) for v in x]}
    if t is dict or _is_plain_dict_type(t):
        return {"#": "dict", "v": [[encode(k, handle), encode(v, handle)] for k, v in dict.items(x)]}
    if t is set or t is frozenset:
        return {"#": t.__name__, "v": [encode(v, handle) for v in x]}
    if t is complex:
        return {"#": "complex", "v": [repr(x.real), repr(x.imag)]}
    if t is bytes:
        return {"#": "bytes", "v": x.hex()}
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(x, (numpy.generic, numpy.ndarray)):
        return encode(x.item() if isinstance(x, numpy.generic) else x.tolist(), handle)  # as Python values
    if handle is not None:
        return handle(x)
    raise EncodeError(f"a value of type {t.__name__} is not plain data")


def _is_plain_dict_type(t) -> bool:
    """collections.Counter / OrderedDict / defaultdict (exactly): encoded as plain dicts."""
    collections = sys.modules.get("collections")
    return collections is not None and t in (collections.Counter, collections.OrderedDict, collections.defaultdict)


def decode(x, resolve=None):
    """Inverse of `encode` for JSON-decoded `x`; raises ValueError on anything malformed.

    ``resolve(tag)`` turns handle / ref tags into objects (when given), else they are errors.
    """
    if x is None or isinstance(x, (bool, str, int, float)):
        return x
    if isinstance(x, list):
        return [decode(v, resolve) for v in x]
    if not isinstance(x, dict) or not isinstance(x.get("#"), str):
        raise ValueError(f"malformed value {str(x)[:100]!r}")
    kind, v = x["#"], x.get("v")
    if kind in ("handle", "ref") and resolve is not None:
        return resolve(x)
    if kind == "int" and isinstance(v, str) and len(v) < 1 << 20:
        return int(v, 16)
    if kind == "float" and v in ("nan", "inf", "-inf"):
        return float(v)
    if kind == "tuple" and isinstance(v, list):
        return tuple(decode(e, resolve) for e in v)
    if kind in ("set", "frozenset") and isinstance(v, list):
        items = [decode(e, resolve) for e in v]
        try:
            return set(items) if kind == "set" else frozenset(items)
        except TypeError as err:
            raise ValueError(f"unhashable set element: {err}") from None
    if kind == "dict" and isinstance(v, list) and all(isinstance(p, list) and len(p) == 2 for p in v):
        try:
            return {decode(k, resolve): decode(e, resolve) for k, e in v}
        except TypeError as err:
            raise ValueError(f"unhashable dict key: {err}") from None
    if kind == "complex" and isinstance(v, list) and len(v) == 2 and all(isinstance(p, str) for p in v):
        return complex(float(v[0]), float(v[1]))
    if kind == "bytes" and isinstance(v, str):
        return bytes.fromhex(v)
    raise ValueError(f"malformed value {str(x)[:100]!r}")


def dumps(x) -> str:
    return json.dumps(x, separators=(",", ":"), allow_nan=False)


def loads(text):
    """json.loads that refuses NaN / Infinity tokens (encode tags those) and bounds recursion errors."""

    def no_constant(name):
        raise ValueError(f"unexpected JSON constant {name}")

    try:
        return json.loads(text, parse_constant=no_constant)
    except RecursionError:
        raise ValueError("value nested too deeply") from None


def report_mac(key: str, previous: str, body: str) -> str:
    """MAC of one report line, chained to the previous line's: only the harness (which alone
    holds the key) can write a report the host accepts, and no line can be dropped or moved."""
    return hmac.new(key.encode(), (previous + "\n" + body).encode(), hashlib.sha256).hexdigest()[:32]


# -- stdio outputs -----------------------------------------------------------------------------
def normalize_output(text: str) -> str:
    """The lines of `text` with trailing whitespace and trailing blank lines removed, joined by newlines."""
    lines = [ln.rstrip() for ln in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def output_digest(salt: str, text: str) -> str:
    """Salted SHA-256 of the normalised output: what the harness reports instead of the output."""
    return hashlib.sha256((salt + "\0" + normalize_output(text)).encode("utf-8", "surrogatepass")).hexdigest()


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


# -- program side: one CPU budget for all of a case's processes, no sibling can reach it ----------
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


# -- harness side: the program's server --------------------------------------------------------
class RemoteError(Exception):
    """The program raised an exception that is not a built-in one (its nearest built-in base, if any, is in the message)."""


class ProgramGone(BaseException):
    """The program's process exited, hung past the deadline, or broke the protocol.

    A BaseException, not an Exception: test code that tolerates the program's own errors
    (``try: candidate(x) except Exception: ...``) must not swallow the program's disappearance
    (a program that kills its server would otherwise skip every check inside such a ``try``).
    """


class Server:
    """The harness's end of the program's server: requests out, plain-data replies in."""

    def __init__(self, deadline: float, cpu_seconds: float, cap: int):
        self.deadline = deadline
        self.cap = cap
        req_r, self.req_w = os.pipe()
        self.rep_r, rep_w = os.pipe()
        argv = supervised_argv(SERVE_FLAG, cpu_seconds, req_r, rep_w)
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, close_fds=True, pass_fds=(req_r, rep_w),
                                     start_new_session=True)
        _set_cpu_limit(self.proc.pid, cpu_seconds)
        os.close(req_r)
        os.close(rep_w)
        os.set_blocking(self.req_w, False)
        os.set_blocking(self.rep_r, False)
        self.pidfd = _pidfd(self.proc.pid)
        self.buf = bytearray()
        self.seq = 0
        self.dead = None  # why the server is unusable, once it is
        self.names = self.reply(0)  # {name: description} of the program's top level

    def call(self, op: str, **fields):
        """Send one request and return the decoded reply (raising the program's exception)."""
        if self.dead:
            raise ProgramGone(self.dead)
        self._pending_args = fields.pop("_args", [])
        self.seq += 1
        data = (dumps({"seq": self.seq, "op": op, **fields}) + "\n").encode()
        self._send(data)
        try:
            return self.reply(self.seq)
        except StopIteration as err:
            if op == "next":
                raise
            # As PEP 479 does for generators: a StopIteration out of a call would end the test's
            # loop over map(candidate, ...) early, so that no check runs.
            raise RuntimeError(f"the program raised StopIteration outside of next(): {err}"[:300]) from None

    def _fail(self, why: str):
        self.dead = why
        _kill_group(self.proc.pid)
        raise ProgramGone(why)

    def _wait(self, fd: int, events: int) -> None:
        sel = selectors.DefaultSelector()
        sel.register(fd, events)
        if self.pidfd is not None:
            sel.register(self.pidfd, selectors.EVENT_READ)
        try:
            while True:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    self._fail("wall-clock timeout")
                ready = sel.select(min(left, 0.05) if self.pidfd is None else left)
                if any(key.fd == fd for key, _ in ready):
                    return
                if ready or self.proc.poll() is not None:  # the pidfd: it exited
                    return
        finally:
            sel.close()

    def _send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            self._wait(self.req_w, selectors.EVENT_WRITE)
            try:
                view = view[os.write(self.req_w, view[:65536]):]
            except BlockingIOError:
                continue
            except OSError:
                self._fail("the program exited")

    def reply(self, seq: int):
        while b"\n" not in self.buf:
            self._wait(self.rep_r, selectors.EVENT_READ)
            try:
                chunk = os.read(self.rep_r, 1 << 20)
            except BlockingIOError:
                if self.proc.poll() is not None:
                    self._fail(f"the program exited (code {self.proc.returncode})")
                continue
            if not chunk:
                self._fail("the program exited" + (f" (code {self.proc.poll()})" if self.proc.poll() is not None else ""))
            self.buf += chunk
            if len(self.buf) > MAX_MESSAGE:
                self._fail("a reply over the size limit")
        line, _, rest = bytes(self.buf).partition(b"\n")
        self.buf = bytearray(rest)
        try:
            msg = loads(line)
            if not isinstance(msg, dict) or msg.get("seq") != seq:
                raise ValueError("reply out of sequence")
        except ValueError as err:
            self._fail(f"malformed reply: {err}")
        if "err" in msg:
            raise _exception(msg["err"])
        try:
            value = decode(msg.get("ok"), self._resolve)
            for i, after in msg.get("after", []):
                if type(i) is not int or not 0 <= i < len(self._pending_args):
                    raise ValueError("bad argument index")
                _write_back(self._pending_args[i], decode(after, self._resolve))
        except (ValueError, TypeError, IndexError, AttributeError) as err:
            self._fail(f"malformed reply: {err}")
        return value

    _pending_args: list = []

    def _resolve(self, tag: dict):
        if tag.get("#") != "handle" or not isinstance(tag.get("id"), int):
            raise ValueError("malformed handle")
        return Remote(self, tag["id"], str(tag.get("type", "object"))[:100])

    def request(self, op: str, target: "Remote", args=(), kwargs=None, **fields):
        """A request about a remote object; arguments are encoded here (handles of this server only)."""
        enc = lambda v: encode(v, self._ref)
        fields.update(args=[enc(a) for a in args], kwargs={k: enc(v) for k, v in (kwargs or {}).items()})
        pending = list(args) + list((kwargs or {}).values())
        return self.call(op, id=object.__getattribute__(target, "_id"), _args=pending, **fields)

    def _ref(self, x):
        if isinstance(x, Remote) and object.__getattribute__(x, "_server") is self:
            return {"#": "ref", "id": object.__getattribute__(x, "_id")}
        raise EncodeError(f"cannot pass a {type(x).__name__} to the program (only plain data and its own objects)")

    def close(self):
        _kill_group(self.proc.pid)
        try:
            self.proc.wait(1)
        except subprocess.TimeoutExpired:
            pass


def _write_back(arg, after) -> None:
    """Mirror an in-place change the program made to a list / dict / set argument."""
    if type(arg) is list and type(after) is list:
        arg[:] = after
    elif type(arg) is dict and type(after) is dict:
        arg.clear()
        arg.update(after)
    elif type(arg) is set and type(after) is set:
        arg.clear()
        arg.update(after)


_MAPPED = {name for name, v in vars(builtins).items()
           if isinstance(v, type) and issubclass(v, Exception)}


def _exception(err) -> Exception:
    """The program's exception as a built-in one of the same class (or its nearest built-in base)."""
    name, message = (err + ["", ""])[:2] if isinstance(err, list) else ("", str(err))
    name, message = str(name)[:100], str(message)[:1000]
    cls = getattr(builtins, name, None) if name in _MAPPED else None
    if cls is None:
        return RemoteError(f"{name}: {message}")
    try:
        return cls(message)
    except Exception:  # a built-in exception with other required arguments
        return RemoteError(f"{name}: {message}")


class Remote:
    """A proxy for one of the program's objects: calls, attributes, iteration and the like are
    round trips; comparison with anything but another of its objects is identity (so never
    equal to plain data), and it has no truth value of its own."""

    __slots__ = ("_server", "_id", "_type")

    def __init__(self, server, hid, type_name):
        object.__setattr__(self, "_server", server)
        object.__setattr__(self, "_id", hid)
        object.__setattr__(self, "_type", type_name)

    def _req(self, op, *args, **fields):
        return object.__getattribute__(self, "_server").request(op, self, args=args, **fields)

    def __call__(self, *args, **kwargs):
        server = object.__getattribute__(self, "_server")
        return server.request("call", self, args=args, kwargs=kwargs)

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return self._req("getattr", name=name)

    def __setattr__(self, name, value):
        self._req("setattr", value, name=name)

    def __iter__(self):
        return self._req("iter")

    def __next__(self):
        return self._req("next")

    def __len__(self):
        n = self._req("len")
        if type(n) is not int:
            raise TypeError("len() of a program object must be an int")
        return n

    def __getitem__(self, key):
        return self._req("getitem", key)

    def __contains__(self, item):
        return self._req("contains", item) is True

    def __bool__(self):
        v = self._req("bool")
        if type(v) is not bool:
            raise TypeError("bool() of a program object must be a bool")
        return v

    def __str__(self):
        return str(self._req("str"))

    def __repr__(self):
        return f"<program {object.__getattribute__(self, '_type')} object>"

    def __hash__(self):
        return hash((id(object.__getattribute__(self, "_server")), object.__getattribute__(self, "_id")))

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def _compare(self, op, other):
        if not isinstance(other, Remote) or object.__getattribute__(other, "_server") is not object.__getattribute__(self, "_server"):
            return NotImplemented
        v = self._req("compare", other, name=op)
        if type(v) is not bool:
            raise TypeError(f"a comparison of program objects ({op}) must give a bool")
        return v

    def __eq__(self, other):
        if isinstance(other, Remote) and object.__getattribute__(other, "_server") is object.__getattribute__(self, "_server") \
                and object.__getattribute__(other, "_id") == object.__getattribute__(self, "_id"):
            return True
        return self._compare("eq", other)

    def __ne__(self, other):
        eq = self.__eq__(other)
        return NotImplemented if eq is NotImplemented else not eq

    __lt__ = lambda self, other: self._compare("lt", other)
    __le__ = lambda self, other: self._compare("le", other)
    __gt__ = lambda self, other: self._compare("gt", other)
    __ge__ = lambda self, other: self._compare("ge", other)


def module_names_used(test_code: str) -> set:
    """Names the test code uses as modules: ``name.attr`` (``math.isclose``) for a bare `name`."""
    import ast

    try:
        tree = ast.parse(test_code)
    except SyntaxError:
        return set()
    return {n.value.id for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}


def test_namespace(server: Server, test_code: str = "") -> dict:
    """Globals for the test code: the program's top-level names, as proxies or plain values.

    Names of built-ins and dunders are never taken from the program (a program-defined ``abs``
    or ``AssertionError`` cannot change what the test means). A module name always means the
    real module, imported here: a name the program bound to a standard-library module (or one
    of its submodules), a stdlib module name the program bound to anything but a function or
    class, and every stdlib module name the test code uses as a module (``math.isclose``),
    whatever the program defines under it (a class named ``math`` whose ``isclose`` is always
    True cannot stand in for `math`), and even when the program does not define it.
    """
    import importlib

    # "__main__", as when the tests were appended to the program: a test guarded by
    # ``if __name__ == "__main__":`` runs (else nothing is checked and every program passes).
    ns = {"__name__": "__main__", "__builtins__": builtins}
    used_as_module = {n for n in module_names_used(test_code) if n in sys.stdlib_module_names}

    def real_module(name: str, module: str) -> None:
        if module.split(".")[0] in sys.stdlib_module_names:
            try:
                ns[name] = importlib.import_module(module)
            except ImportError:
                pass

    for name, info in server.names.items():
        if not isinstance(name, str) or not name.isidentifier() or name.startswith("__") or hasattr(builtins, name):
            continue
        module = info.get("module")
        if module is None and name in sys.stdlib_module_names and (
                info.get("kind") not in ("function", "class") or name in used_as_module):
            module = name  # e.g. a fake `math` object or class: the test gets the real module
        if module is not None:
            real_module(name, str(module))
            continue
        if "value" in info:
            ns[name] = info["value"]
        elif "handle" in info:
            ns[name] = info["handle"]
    for name in used_as_module - set(ns):
        if not hasattr(builtins, name):
            real_module(name, name)
    return ns


def run_assert(header: dict, emit) -> None:
    """Run the assert / check(candidate) test code here, against the program's server."""
    deadline = time.monotonic() + float(header["case_wall"])
    server = None
    try:
        server = Server(deadline, float(header["case_cpu"]), int(header["output_cap"]))
        code = header["test_code"]
        ns = test_namespace(server, code)
        # What the test code prints must not break the report's lines (emit keeps the real stdout).
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
            if header.get("prompt_code"):  # the prompt's own helpers, not the program's (see code_file)
                exec(compile(header["prompt_code"], "<prompt>", "exec"), ns)
            exec(compile(code, "<tests>", "exec"), ns)
            entry = header.get("entry_point")
            if entry and "def check(" in code:
                # The entry point by the program's name for it, even one that a built-in has too.
                candidate = server.names.get(entry, {}).get("handle", ns.get(entry))
                if candidate is None:
                    raise NameError(f"the program does not define {entry!r}")
                ns["check"](candidate)
        if server.dead:  # the program went away in a call the tests' bare `except:` swallowed
            raise ProgramGone(server.dead)
    except BaseException as err:  # noqa: BLE001 - any failure of the tests fails the program
        emit({"verdict": "fail", "why": f"{type(err).__name__}: {err}"[:300]})
        return
    finally:
        if server is not None:
            server.close()
    emit({"verdict": "pass"})


def run_functional(header: dict, read_case, emit) -> None:
    """Call the program's function once per case and report its plain return values."""
    wall, n = float(header["case_wall"]), int(header["n"])
    try:
        server = Server(time.monotonic() + wall, float(header["case_cpu"]) * (n + 1), int(header["output_cap"]))
    except (ProgramGone, Exception) as err:  # noqa: BLE001
        emit({"case": 0, "ok": False, "why": f"the program did not load: {type(err).__name__}: {err}"[:300]})
        return
    try:
        for j in range(n):
            args = read_case()["args"]
            server.deadline = time.monotonic() + wall
            try:
                value = server.call("solve", fn=header["fn_name"], args=args)
                emit({"case": j, "ok": True, "value": encode(value)})
            except BaseException as err:  # noqa: BLE001
                emit({"case": j, "ok": False, "why": f"{type(err).__name__}: {err}"[:300]})
                return
    finally:
        server.close()


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
        run_functional(header, read_case, emit)
    else:
        run_assert(header, emit)
    emit({"done": True})
    return 0


# -- program side: the server ------------------------------------------------------------------
def serve(req_fd: int, rep_fd: int) -> None:
    """Import the program and answer the harness's requests until its pipe closes. Never returns."""
    import types

    requests = os.fdopen(req_fd, "rb", buffering=1 << 16)
    replies = os.fdopen(rep_fd, "wb", buffering=0)
    objects: dict[int, object] = {}
    ids: dict[int, int] = {}

    def handle(x):
        key = id(x)
        if key not in ids:
            ids[key] = len(objects) + 1
            objects[ids[key]] = x
        return {"#": "handle", "id": ids[key], "type": type(x).__name__}

    def send(msg) -> None:
        replies.write((dumps(msg) + "\n").encode())

    def error(seq, err: BaseException) -> dict:
        base = next((c.__name__ for c in type(err).__mro__ if c.__name__ in _MAPPED and getattr(builtins, c.__name__) is c), None)
        name = type(err).__name__ if base is None else base
        detail = str(err) if name == type(err).__name__ else f"{type(err).__name__}: {err}"
        return {"seq": seq, "err": [name, detail[:1000]]}

    mod = types.ModuleType(PROGRAM_MODULE)
    mod.__file__ = os.path.abspath(PROGRAM_FILE)
    sys.modules[PROGRAM_MODULE] = mod
    try:
        with open(PROGRAM_FILE, encoding="utf-8") as f:
            source = f.read()
        exec(compile(source, PROGRAM_FILE, "exec"), mod.__dict__)
        names = {}
        for name, value in list(vars(mod).items()):
            if name.startswith("__"):
                continue
            if isinstance(value, types.ModuleType):
                names[name] = {"module": str(value.__name__)}
                continue
            kind = "class" if isinstance(value, type) else "function" if callable(value) else "object"
            try:
                enc = encode(value)
                if len(dumps(enc)) > 1 << 16:  # a big table stays in the program's process
                    raise ValueError("large")
                names[name] = {"value": enc, "kind": "value"}
            except (EncodeError, RecursionError, ValueError):
                names[name] = {"handle": handle(value), "kind": kind}
        send({"seq": 0, "ok": {"#": "dict", "v": [[k, _describe_name(v)] for k, v in names.items()]}})
    except BaseException as err:  # noqa: BLE001 - SystemExit included: the program did not load
        send(error(0, err))
        os._exit(0)

    def resolve(tag):
        if tag.get("#") == "ref" and tag.get("id") in objects:
            return objects[tag["id"]]
        raise ValueError("unknown object reference")

    for line in requests:
        try:
            req = loads(line)
            seq = req["seq"]
        except Exception:  # noqa: BLE001
            os._exit(1)
        try:
            send(_answer(req, mod, objects, resolve, handle, seq))
        except BaseException as err:  # noqa: BLE001 - SystemExit / KeyboardInterrupt in a call too
            try:
                send(error(seq, err))
            except BaseException:  # noqa: BLE001
                os._exit(1)
    os._exit(0)


def _describe_name(info: dict):
    """One top-level name's entry in the ready message (a tagged dict)."""
    return {"#": "dict", "v": [[k, v] for k, v in info.items()]}


def _answer(req, mod, objects, resolve, handle, seq) -> dict:
    """Perform one request in the program's process; the reply carries plain data or a handle."""
    op = req["op"]
    args = [decode(a, resolve) for a in req.get("args", [])]
    kwargs = {k: decode(v, resolve) for k, v in req.get("kwargs", {}).items()}
    if op == "solve":  # a functional case: the function, or a method of Solution()
        fn = vars(mod).get(req["fn"])
        if not callable(fn):
            solution = vars(mod).get("Solution")
            if solution is None:
                raise NameError(f"name {req['fn']!r} is not defined")
            fn = getattr(solution(), req["fn"])
        return {"seq": seq, "ok": encode(fn(*args))}
    target = objects.get(req.get("id"))
    if target is None:
        raise ValueError("unknown object")
    if op == "call":
        result = target(*args, **kwargs)
    elif op == "getattr":
        result = getattr(target, req["name"])
    elif op == "setattr":
        setattr(target, req["name"], args[0])
        result = None
    elif op == "iter":
        result = iter(target)
    elif op == "next":
        result = next(target)
    elif op == "len":
        result = len(target)
    elif op == "getitem":
        result = target[args[0]]
    elif op == "contains":
        result = args[0] in target
    elif op == "bool":
        result = bool(target)
    elif op == "str":
        result = str(target)
    elif op == "compare":
        import operator

        result = getattr(operator, req["name"])(target, args[0])
        result = result if type(result) is bool else bool(result)
    else:
        raise ValueError(f"unknown request {op!r}")
    reply = {"seq": seq, "ok": encode(result, handle)}
    after = [[i, encode(a, handle)] for i, a in enumerate(list(args) + list(kwargs.values())) if type(a) in (list, dict, set)]
    if after:
        reply["after"] = after
    return reply


def drop_own_dir_from_path() -> None:
    """Remove this file's directory (the program's writable working dir) from sys.path.

    ``python -I`` keeps the script's directory on sys.path before Python 3.11 (3.11 adds -P to
    -I): a module the program writes there (``colorsys.py``) would be imported by the harness
    when the tests or `test_namespace` import that name, and run inside the harness.
    """
    here = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [p for p in sys.path if p and os.path.realpath(p) != here]


def main(argv) -> int:
    drop_own_dir_from_path()
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
