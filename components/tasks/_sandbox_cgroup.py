"""The run's own cgroups: where they go (decided once on the host), and making, joining, reading and removing them.

Standard library only: the launcher (`_sandbox_launcher.py`) loads this file by path at its
start, and `components.tasks.sandbox` loads it by path too (the host's half, `decide` and
`apply`), so neither needs this package on sys.path.

A run gets ONE memory, CPU and process budget through whichever cgroup hierarchy the machine
offers, the same three budgets either way:

- cgroup v2: one dir per run with ``memory.max`` (``memory.swap.max`` 0, ``memory.oom.group``
  1), ``pids.max``; its CPU time is ``cpu.stat``'s ``usage_usec`` (in every v2 cgroup);
- cgroup v1: one dir per run in each of the ``memory``, ``cpuacct`` and ``pids`` hierarchies,
  with ``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes``, so no swap),
  ``pids.max``; its CPU time is ``cpuacct.usage``.

Every process of the run is in them (the launcher's child joins before anything of the run
starts), so page cache, memfd, SysV shared memory and tmpfs pages count, and so does the CPU of
every child, reaped, auto-reaped or alive. As root the runs go under ``<hierarchy>/scalerl-sandbox``
(made on first use; on v2 ``+memory +pids`` enabled on the way); not root, under the delegated
dir(s) named by ``$SCALERL_SANDBOX_CGROUP`` (`decide`).
"""

import os
import signal
import time

ENV = "SCALERL_SANDBOX_CGROUP"  # delegated dir(s), separated by ":" (one v2 dir, or one per v1 hierarchy)
DIR_NAME = "scalerl-sandbox"  # as root: <hierarchy>/scalerl-sandbox/scalerl-run-<launcher pid>
BUDGETS = ("memory", "cpu", "pids")  # what a run is bounded in ("cpu": its CPU time is counted)
V1_CONTROLLER = {"memory": "memory", "cpu": "cpuacct", "pids": "pids"}  # the v1 hierarchy of each budget
V2_CONTROLLERS = ("memory", "pids")  # enabled for the runs' dirs (cpu.stat needs no controller)
# pids.max of a run = its max_processes plus these: the supervisor, bubblewrap and its init.
PIDS_SLACK = 4


def _words(path):
    try:
        with open(path) as f:
            return f.read().split()
    except OSError:
        return None


def cgroup_mounts(mounts):
    """[(version, mount point, {v1 controllers})] of the cgroup hierarchies in /proc/self/mounts text."""
    out = []
    for line in mounts.splitlines():
        f = line.split()
        if len(f) < 4:
            continue
        if f[2] == "cgroup2":
            out.append((2, f[1], set()))
        elif f[2] == "cgroup":
            out.append((1, f[1], set(f[3].split(",")) & set(V1_CONTROLLER.values())))
    return out


def _none(reason):
    return {"version": None, "parents": {}, "reason": reason, "create": [], "enable": []}


def _within(path, top):
    return path == top or path.startswith(top.rstrip("/") + "/")


def _delegated_dir(d, hierarchies, fs_root):
    """(version, {budget: d}) that the delegated dir `d` offers, or a string saying why it offers nothing."""
    found = [h for h in hierarchies if _within(d, h[1])]
    if not os.path.isabs(d) or not found:
        return f"${ENV} names {d!r}, which is not a dir of a cgroup hierarchy"
    version, _, controllers = max(found, key=lambda h: len(h[1]))
    if not os.access(fs_root + d, os.W_OK):
        return f"the cgroup {d} (${ENV}) is not writable"
    if version == 1:
        return 1, {b: d for b, c in V1_CONTROLLER.items() if c in controllers}
    for name in ("cgroup.controllers", "cgroup.subtree_control"):
        missing = [c for c in V2_CONTROLLERS if c not in (_words(fs_root + d + "/" + name) or [])]
        if missing:
            return f"the cgroup {d} (${ENV}) lacks {' '.join(missing)} in its {name} (echo +memory +pids > cgroup.subtree_control)"
    return 2, {b: d for b in BUDGETS}


def decide_delegated(value, hierarchies, fs_root=""):
    """The plan for ``$SCALERL_SANDBOX_CGROUP`` = `value`: dirs separated by ":", together offering every budget."""
    parents, versions = {}, set()
    for d in (os.path.normpath(p) for p in value.split(":") if p):
        got = _delegated_dir(d, hierarchies, fs_root)
        if isinstance(got, str):
            return _none(got)
        versions.add(got[0])
        parents.update(got[1])
    missing = [b for b in BUDGETS if b not in parents]
    if missing or len(versions) != 1:
        why = f"offer no {', '.join(missing)} budget" if missing else "mix cgroup v1 and v2"
        return _none(f"the delegated cgroups ${ENV}={value!r} {why}")
    return {"version": versions.pop(), "parents": parents, "reason": f"delegated cgroups {value}", "create": [],
            "enable": []}


def _decide_root_v2(mount, fs_root):
    if any(c not in (_words(fs_root + mount + "/cgroup.controllers") or []) for c in V2_CONTROLLERS):
        return None
    parent = os.path.join(mount, DIR_NAME)
    enable = [d + "/cgroup.subtree_control" for d in (mount, parent)
              if any(c not in (_words(fs_root + d + "/cgroup.subtree_control") or []) for c in V2_CONTROLLERS)]
    create = [] if os.path.isdir(fs_root + parent) else [parent]
    return {"version": 2, "parents": {b: parent for b in BUDGETS}, "reason": f"root: cgroup v2, runs in {parent}",
            "create": create, "enable": enable}


def decide(euid, mounts, env, fs_root=""):
    """Where runs get their cgroups: {"version": 1 | 2 | None, "parents": {budget: dir}, "reason",
    "create": [dirs to make], "enable": [v2 cgroup.subtree_control files to write "+memory +pids" to]}.

    `mounts` is /proc/self/mounts; `fs_root` prefixes every path read (tests). A delegated
    ``$SCALERL_SANDBOX_CGROUP`` is used as it is; as root, a v2 hierarchy whose root offers memory
    and pids, else the v1 memory, cpuacct and pids hierarchies. Otherwise there is none, and
    "reason" says why."""
    hierarchies = cgroup_mounts(mounts)
    if env.get(ENV):
        return decide_delegated(env[ENV], hierarchies, fs_root)
    if euid != 0:
        return _none(f"not root and no delegated cgroup (${ENV})")
    for version, mount, _ in hierarchies:
        plan = _decide_root_v2(mount, fs_root) if version == 2 else None
        if plan:
            return plan
    v1 = {c: mount for version, mount, controllers in hierarchies if version == 1 for c in controllers}
    missing = [c for c in V1_CONTROLLER.values() if c not in v1]
    if missing:
        return _none(f"no cgroup v2 hierarchy offers {' and '.join(V2_CONTROLLERS)}, and no cgroup v1 hierarchy holds "
                     f"{', '.join(missing)}")
    parents = {b: os.path.join(v1[c], DIR_NAME) for b, c in V1_CONTROLLER.items()}
    return {"version": 1, "parents": parents, "reason": "root: cgroup v1 (memory, cpuacct, pids)",
            "create": [d for d in parents.values() if not os.path.isdir(fs_root + d)], "enable": []}


def apply(plan, fs_root=""):
    """Make `plan`'s dirs and enable its v2 controllers; on failure the plan without parents, saying why."""
    try:
        for d in plan["create"]:
            os.makedirs(fs_root + d, 0o755, exist_ok=True)
        for path in plan["enable"]:
            with open(fs_root + path, "w") as f:
                f.write(" ".join("+" + c for c in V2_CONTROLLERS))
    except OSError as err:
        return _none(f"cannot set up the cgroups ({err})")
    return plan


# -- the launcher's half: one run's cgroups ---------------------------------------------------
def _settings(version, budget, memory_max, pids_max):
    """(file, value, required) to write in the run's dir of `budget`."""
    if budget == "pids":
        return [("pids.max", str(int(pids_max)), True)]
    if budget != "memory":
        return []
    if version == 2:
        return [("memory.max", str(int(memory_max)), True), ("memory.swap.max", "0", False),
                ("memory.oom.group", "1", False)]
    return [("memory.limit_in_bytes", str(int(memory_max)), True), ("memory.memsw.limit_in_bytes", str(int(memory_max)), False)]


def make_run(plan, name):
    """Create the run's cgroups: {"version", "dirs": {budget: dir}, "cpu_fd": an open descriptor of
    its CPU time (v2 cpu.stat, v1 cpuacct.usage)}. `plan` is the spec's: "version", "parents",
    "memory_max", "pids_max". An optional file missing (no swap accounting) is skipped."""
    version, dirs = int(plan["version"]), {}
    try:
        for budget in BUDGETS:
            parent = plan["parents"][budget]
            d = os.path.join(parent, name)
            if d not in dirs.values():
                os.mkdir(d, 0o755)
            dirs[budget] = d
            for key, value, required in _settings(version, budget, plan["memory_max"], plan["pids_max"]):
                path = os.path.join(d, key)
                if required or os.path.exists(path):
                    with open(path, "w") as f:
                        f.write(value)
        cpu_file = "cpu.stat" if version == 2 else "cpuacct.usage"
        cpu_fd = os.open(os.path.join(dirs["cpu"], cpu_file), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        remove_run({"version": version, "dirs": dirs})
        raise
    return {"version": version, "dirs": dirs, "cpu_fd": cpu_fd}


def join(run):
    """Move this process (and so everything it starts) into each of the run's cgroups."""
    for d in sorted(set(run["dirs"].values())):
        with open(os.path.join(d, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))


def memory_peak(run):
    """The most memory the run's cgroup held (bytes: v2 memory.peak, v1 memory.max_usage_in_bytes), or None."""
    name = "memory.peak" if run["version"] == 2 else "memory.max_usage_in_bytes"
    words = _words(os.path.join(run["dirs"]["memory"], name))
    try:
        return int(words[0]) if words else None
    except ValueError:
        return None


def _kill_members(d, version):
    if version == 2:
        try:
            with open(os.path.join(d, "cgroup.kill"), "w") as f:
                f.write("1")
            return
        except OSError:
            pass  # before Linux 5.14: one by one
    for pid in _words(os.path.join(d, "cgroup.procs")) or []:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError):
            pass


def remove_run(run, deadline_s=3.0):
    """Kill whatever is left in the run's cgroups and remove them (v2 cgroup.kill, v1 by pid)."""
    if not run:
        return
    end = time.monotonic() + deadline_s
    for d in sorted(set(run["dirs"].values())):
        while True:
            _kill_members(d, run["version"])
            try:
                os.rmdir(d)
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > end:
                    break
                time.sleep(0.01)


def close_run(run):
    """Close the run's CPU descriptor, then remove its cgroups."""
    if run:
        os.close(run["cpu_fd"])
        remove_run(run)


def cgroups_for(spec):
    """The run's cgroups (`make_run`), or None where the spec has none."""
    plan = spec.get("cgroup")
    if not plan:
        return None
    return make_run(plan, f"scalerl-run-{os.getpid()}")
