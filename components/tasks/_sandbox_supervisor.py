"""The supervisor inside a bubblewrap sandbox: starts the program with its rlimits, reports its status.

The launcher (`_sandbox_launcher.py`) runs this file's source as
``python -I -S -B -c <source> <json>`` inside bubblewrap, so it is small and imports little
(every run pays its start-up). The JSON holds ``argv``, ``env``, ``rlimits``
([[resource, [soft, hard]], ...]), ``wall_seconds`` and ``report_fd``, the write end of a pipe
to the launcher.

It runs already filtered by seccomp and with no-new-privileges (bubblewrap set both). It
makes itself undumpable, so the program, though of the same uid, can neither open its report
pipe through /proc/<pid>/fd nor read its memory (ptrace is filtered anyway); it writes
``{"started": true}``, forks the program (new process group, the rlimits: RLIMIT_NPROC is
counted per user namespace, so it must be set in here, after bubblewrap made the namespace),
waits for it and writes its exit code or signal and CPU time. Then it exits; it is the PID
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
    pid = os.fork()
    if pid == 0:
        start_program(spec)
    _, status, rusage = os.wait4(pid, 0)
    os.write(report_fd, (json.dumps(status_fields(status, rusage)) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(supervise(json.loads(sys.argv[1])))
