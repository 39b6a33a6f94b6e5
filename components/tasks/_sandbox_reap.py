"""Ending a sandbox run's processes: kill them (by uid, as root, or as their subreaper) and reap them.

Standard library only: the launcher (`_sandbox_launcher.py`) loads this file by path at its
start. Processes are found through /proc; `wait_until` and `kill_and_wait` wait for one child
(the run's supervisor or bubblewrap) until the run's deadline.
"""

import os
import signal
import time


def _proc_field(pid, name):
    """A field of /proc/<pid>/status (first value), or None if the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return line.split()[1]
    except OSError:
        return None
    return None


def _live_pids(match):
    """Pids of non-zombie processes for which match(pid) is true."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and match(entry) and _proc_field(entry, "State") not in (None, "Z"):
            out.append(int(entry))
    return out


def kill_uid(uid, deadline_s=5.0):
    """SIGKILL every process whose real uid is `uid`, from this (root) process; True when none is left.

    Root is not of the sandbox's uid, so no process of that uid can stop or kill the cleanup
    (the old way, switching to the uid and calling kill(-1), could be SIGSTOPped by it).
    Repeats until no live process of the uid is found (a fork bomb may still be forking).
    """
    if uid < 65536:
        raise ValueError(f"refusing to kill every process of uid {uid}: not a sandbox uid")
    if os.geteuid() != 0:
        raise PermissionError("killing by uid needs root")
    end = time.monotonic() + deadline_s
    while True:
        pids = _live_pids(lambda pid: _proc_field(pid, "Uid") == str(uid))
        if not pids:
            return True
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > end:
            return False
        time.sleep(0.005)


def kill_children():
    """SIGKILL every live child of this process (orphans re-parented to us, the subreaper, included)."""
    me = str(os.getpid())
    for pid in _live_pids(lambda pid: _proc_field(pid, "PPid") == me):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def reap_all(kill, deadline_s=3.0):
    """Wait for every child (direct or re-parented orphan) until none is left, killing meanwhile."""
    end = time.monotonic() + deadline_s
    reaped = 0
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid:
            reaped += 1
            continue
        if time.monotonic() > end:
            return reaped
        kill()
        time.sleep(0.002)


def wait_until(pid, deadline):
    """wait4(pid) until the monotonic `deadline`: (status, rusage), or None when the deadline passed.

    SIGCHLD must be blocked: the wait sleeps in sigtimedwait until a child changes state.
    """
    while True:
        wpid, status, rusage = os.wait4(pid, os.WNOHANG)
        if wpid:
            return status, rusage
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        signal.sigtimedwait({signal.SIGCHLD}, min(remaining, 0.5))


def kill_and_wait(pid):
    """SIGKILL `pid` (a child) and reap it: (status, rusage)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _, status, rusage = os.wait4(pid, 0)
    return status, rusage
