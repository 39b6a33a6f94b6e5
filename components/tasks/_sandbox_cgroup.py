"""The run's own cgroup (cgroup v2, where the sandbox found a memory controller): make, join, remove.

Standard library only: the launcher (`_sandbox_launcher.py`) loads this file by path at its
start. The cgroup holds every process of the run (the supervisor or bubblewrap joins it before
the program starts); its memory.max is the run's total memory, its cpu.stat the run's CPU time.
"""

import os
import time


def make_run_cgroup(plan, name):
    """Create the run's cgroup under ``plan["parent"]``: memory.max the run's total, no swap,
    the whole group OOM-killed together. Returns (its dir, an open descriptor of its cpu.stat)."""
    d = os.path.join(plan["parent"], name)
    os.mkdir(d, 0o755)
    try:
        settings = [("memory.max", str(int(plan["memory_max"]))), ("memory.swap.max", "0"), ("memory.oom.group", "1")]
        for key, value in settings:
            path = os.path.join(d, key)
            if key != "memory.max" and not os.path.exists(path):
                continue  # no swap accounting (then no swap to limit), or an older kernel
            with open(path, "w") as f:
                f.write(value)
        if plan.get("owner") is not None:  # bubblewrap as root runs as the run's uid: it joins itself
            os.chown(os.path.join(d, "cgroup.procs"), plan["owner"], plan["owner"])
        return d, os.open(os.path.join(d, "cpu.stat"), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        remove_run_cgroup(d)
        raise


def join_cgroup(d):
    """Move this process (and so everything it starts) into the cgroup `d`."""
    with open(os.path.join(d, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))


def remove_run_cgroup(d, deadline_s=3.0):
    """Kill whatever is left in the run's cgroup (cgroup.kill) and remove it."""
    if not d:
        return
    end = time.monotonic() + deadline_s
    while True:
        try:
            with open(os.path.join(d, "cgroup.kill"), "w") as f:
                f.write("1")
        except OSError:
            pass
        try:
            os.rmdir(d)
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > end:
                return
            time.sleep(0.01)


def cgroup_for(spec, uid=None):
    """(dir, cpu.stat descriptor) of a new cgroup for this run, or (None, None) without one."""
    plan = spec.get("cgroup")
    if not plan:
        return None, None
    return make_run_cgroup({**plan, "owner": uid}, f"scalerl-run-{os.getpid()}")
