"""The supervisor inside a bubblewrap sandbox: starts the program with its rlimits, reports its status.

The launcher (`_sandbox_launcher.py`) runs this file's source as
``python -I -S -B -c <source> <json>`` inside bubblewrap, so it is small and imports little
(every run pays its start-up). The JSON holds ``argv``, ``env``, ``rlimits``
([[resource, [soft, hard]], ...]), ``wall_seconds``, ``run_cpu_seconds``, ``report_fd`` (the
write end of a pipe to the launcher) and ``cpu_stat_fd`` (the run's cgroup's CPU time: v2 cpu.stat
or v1 cpuacct.usage; or null).

It runs already filtered by seccomp and with no-new-privileges (bubblewrap set both). It
makes itself undumpable, so the program, though of the same uid, can neither open its report
pipe through /proc/<pid>/fd nor read its memory (ptrace is filtered anyway); it writes
``{"started": true}``, forks the program (new process group, the rlimits: RLIMIT_NPROC is
counted per user namespace, so it must be set in here, after bubblewrap made the namespace),
waits for it and writes its exit code or signal and CPU time. Meanwhile it reaps every
process of the namespace and counts ONE CPU budget for the whole run (``run_cpu_seconds``):
all its processes together, reaped ones included (`watch`); over it, it kills them all and
reports ``cpu_limit``. Then it exits; it is the PID
namespace's init (bubblewrap's ``--as-pid-1``), so every process of the namespace dies with it. Should its launcher be gone, it exits
by itself a few seconds after the run's deadline (`set_own_deadline`).
"""

import ctypes
import json
import os
import resource
import signal
import sys

PR_SET_DUMPABLE = 4
# A supervisor still running this long after the run's wall-clock deadline exits by itself,
# which ends the namespace: a backstop in case its launcher, which kills it on time, is gone.
OWN_DEADLINE_GRACE_S = 5


def status_fields(status, rusage):
    """{"exit_code", "signal", "cpu_s"} of a waited-for process."""
    out = {"exit_code": None, "signal": None, "cpu_s": rusage.ru_utime + rusage.ru_stime}
    if os.WIFEXITED(status):
        out["exit_code"] = os.WEXITSTATUS(status)
    elif os.WIFSIGNALED(status):
        out["signal"] = os.WTERMSIG(status)
    return out


# -- one CPU budget for all the run's processes ------------------------------------------------
CPU_POLL_S = 0.05
_CLK_TCK = os.sysconf("SC_CLK_TCK")


# Kept in step with _grade_harness.py's copy by hand: each file runs alone in the sandbox (as a script's
# source, with only the standard library there), so neither can import the other.
def _proc_stats():
    """{pid: (ppid, CPU seconds of the process and of the children it reaped)} of every visible process."""
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


def descendants(root, stats=None):
    """(CPU seconds, pids) of the live descendants of `root`: their own CPU time and their reaped children's."""
    stats = _proc_stats() if stats is None else stats
    children = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, found, todo = 0.0, [], list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        found.append(pid)
        total += stats[pid][1]
        todo.extend(children.get(pid, ()))
    return total, found


def cgroup_cpu_seconds(fd):
    """The run's cgroup's CPU time in seconds, from an open descriptor of its v2 cpu.stat
    (``usage_usec``) or v1 cpuacct.usage (nanoseconds); None if unreadable."""
    try:
        text = os.pread(fd, 4096, 0).decode()
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "usage_usec":
                return int(value) / 1e6
        return int(text) / 1e9 if text.strip().isdigit() else None
    except (OSError, ValueError):
        return None


def run_cpu_seconds(cpu_stat_fd=None):
    """CPU seconds spent by every process of the run so far, this supervisor's own excluded: the
    run's cgroup's CPU time where there is one, else the children this process reaped (every
    orphan comes to it: it is the namespace's init, or a subreaper) plus its live descendants
    (with the children they reaped)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    if cpu_stat_fd is not None:
        total = cgroup_cpu_seconds(cpu_stat_fd)
        if total is not None:
            return max(0.0, total - own.ru_utime - own.ru_stime)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    live, _ = descendants(os.getpid())
    return reaped.ru_utime + reaped.ru_stime + live


def kill_descendants():
    """SIGKILL every descendant of this process (by pid, never kill(-1)) until none is left, reaping them."""
    for _ in range(1000):
        _, pids = descendants(os.getpid())
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
                return
        signal.sigtimedwait({signal.SIGCHLD}, 0.002)


def watch(pid, budget, cpu_stat_fd=None):
    """Wait for the program `pid` (a child; SIGCHLD blocked), reaping every other process that
    ends meanwhile, and enforce ONE CPU budget of `budget` seconds (whole seconds, at least 1, as
    RLIMIT_CPU) for all the run's processes: a chain of forks, each with a fresh RLIMIT_CPU, no
    longer outruns it. Returns the program's status fields, with ``cpu_s`` the run's total and
    ``cpu_limit`` set when the budget killed the run (it must be over it at two polls in a row:
    one scan of /proc may count a child both alive and in its parent's reaped time)."""
    budget = max(1, int(-(-float(budget) // 1)))
    over = 0
    while True:
        while True:
            try:
                wpid, status, rusage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return {"exit_code": None, "signal": int(signal.SIGKILL), "cpu_s": run_cpu_seconds(cpu_stat_fd)}
            if wpid == 0:
                break
            if wpid == pid:
                out = status_fields(status, rusage)
                out["cpu_s"] = max(out["cpu_s"], run_cpu_seconds(cpu_stat_fd))
                return out
        used = run_cpu_seconds(cpu_stat_fd)
        over = over + 1 if used >= budget else 0
        if over >= 2:
            kill_descendants()
            return {"exit_code": None, "signal": int(signal.SIGKILL), "cpu_s": max(used, run_cpu_seconds(cpu_stat_fd)),
                    "cpu_limit": True}
        signal.sigtimedwait({signal.SIGCHLD}, CPU_POLL_S)


def set_own_deadline(wall_seconds):
    """Exit (status 1) `OWN_DEADLINE_GRACE_S` seconds after the run's deadline. A handler, not
    the default action: a PID namespace's init ignores signals it has no handler for."""
    signal.signal(signal.SIGALRM, lambda *_: os._exit(1))
    signal.alarm(int(wall_seconds) + 1 + OWN_DEADLINE_GRACE_S)


def start_program(spec):
    """In the forked child: own process group, no inherited descriptors, rlimits, exec. Never returns."""
    try:
        os.setpgid(0, 0)
        os.closerange(3, 65536)  # the report pipe, bubblewrap's --file / --seccomp descriptors
        for which, value in spec["rlimits"]:
            resource.setrlimit(which, tuple(value))
        os.execve(spec["argv"][0], spec["argv"], spec["env"])
    except BaseException as err:  # noqa: BLE001 - report anything, then die
        try:
            os.write(2, f"sandbox: cannot start the program: {type(err).__name__}: {err}\n".encode())
        finally:
            os._exit(127)


def supervise(spec):
    report_fd = int(spec["report_fd"])
    if ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        return 1
    set_own_deadline(float(spec["wall_seconds"]))
    os.set_inheritable(report_fd, False)
    os.write(report_fd, b'{"started": true}\n')
    cpu_stat_fd = spec.get("cpu_stat_fd")
    if cpu_stat_fd is not None:
        os.set_inheritable(cpu_stat_fd, False)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    pid = os.fork()
    if pid == 0:
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        start_program(spec)
    fields = watch(pid, float(spec["run_cpu_seconds"]), cpu_stat_fd)
    os.write(report_fd, (json.dumps(fields) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(supervise(json.loads(sys.argv[1])))
