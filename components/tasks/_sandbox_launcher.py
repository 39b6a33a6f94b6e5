"""Sandbox launcher: runs ONE untrusted program with isolation, then cleans up everything it started.

Executed by `components.tasks.sandbox` as its own process (``python -I -S -B this_file ...``),
never imported. Standard library only; its siblings beside this file, loaded by path at its
start: `_sandbox_libc.py` (mount, unshare, prctl, ... through ctypes), `_sandbox_view.py` (the
run's filesystem view), `_sandbox_cgroup.py` (the run's own cgroups), `_sandbox_reap.py`
(killing and reaping what a run left), `_sandbox_seccomp.py` (the seccomp filter) and
`_sandbox_supervisor.py` (bubblewrap's supervisor). Modes:

    launcher.py <control_dir>        run the program described by <control_dir>/spec.json
    launcher.py --probe              print a JSON of what isolation this machine allows
    launcher.py --kill-uid UID       SIGKILL every process of UID, as root (a backstop cleanup)

Backend ``namespaces`` (the launcher runs as root), in order:

1. becomes a child subreaper; opens the stdin / stdout / stderr files of the control dir
   (stdout / stderr are capped by RLIMIT_FSIZE);
2. ``unshare(CLONE_NEWPID)`` and forks the *supervisor*, which is PID 1 of the new PID
   namespace and stays root: the program's uid can neither see nor signal it, and when it
   exits or is killed the kernel kills every process of the namespace;
3. the supervisor joins the run's cgroups (if any; `_sandbox_cgroup`: v2 or v1, memory, CPU and
   pids), sets its oom_score_adj to 1000 (the run's /proc is read-only: no process lowers it),
   unshares network (only a down loopback), mount, IPC and UTS namespaces, and builds the run's
   filesystem view (an allow-list, `_sandbox_view.setup_filesystem`: read-only binds of the
   allowed paths, a minimal /dev, a /proc of the new PID namespace, a fresh size-capped /tmp
   holding /tmp/work and the read-only /tmp/readonly), then pivot_roots into it;
4. it forks the program: new process group, rlimits, all groups dropped and uid/gid set to a
   fresh unprivileged id (``uid_base + launcher pid``), no-new-privileges, the seccomp filter
   (with the rules of a run without a cgroup where it has none), scrubbed environment, exec.
   It reaps every process of the namespace until the program exits, counting one CPU budget
   for all of them (`_sandbox_supervisor.watch`), reports the program's status and CPU time
   over a pipe, and exits (by itself a few seconds after the deadline, should the launcher be
   gone or stopped);
5. the launcher waits for the supervisor until the wall-clock deadline, then SIGKILLs it
   (which kills the whole namespace), SIGKILLs from root whatever process of the run's uid
   is still alive anywhere (none should be), reaps, and writes result.json.

Backend ``bwrap`` (any user; `bwrap` from bubblewrap): the launcher's child joins the run's
cgroups (if any), sets oom_score_adj to 1000 and enters a network namespace of its own whose
loopback stays down (not root: with a user namespace around it; bubblewrap's ``--unshare-net``
would bring the loopback up, and TCP buffers on it are host memory that no budget counts), then
runs bubblewrap with new user, PID, IPC, UTS (and cgroup) namespaces, ``--as-pid-1``,
``--die-with-parent``, ``--new-session``, the same allow-listed view (read-only,
`_sandbox_view.view_entries`) with a fresh /dev, a read-only /proc (so no process lowers its
oom_score_adj) and a size-capped tmpfs /tmp holding /tmp/work (the files are copied in) and the
read-only tmpfs /tmp/readonly, the hidden paths covered, and the seccomp filter (``--seccomp
FD``; bubblewrap sets no-new-privileges). Inside, a supervisor
(`_sandbox_supervisor.py`), undumpable and the namespace's init (so no process there that the
program could read through /proc/1 holds the run's stdin / stdout), forks the program with the rlimits (RLIMIT_NPROC counts per user
namespace on Linux >= 5.14) and reports its status over a pipe. On the deadline the
launcher SIGKILLs bubblewrap, whose namespace's init (the supervisor) then dies
(``--die-with-parent``) and takes every process of the namespace with it, and
SIGKILLs any process of its own that is left (it is their subreaper). Run as root, the
launcher first switches to the run's unprivileged uid, so bubblewrap never runs as root.
"""

import json
import os
import resource
import signal
import sys
import time

# In the bubblewrap backend the program shares its uid with the supervisor (the namespace's
# init, ``--as-pid-1``), so its RLIMIT_NPROC is raised by one.
BWRAP_OWN_PROCESSES = 1


def load_sibling(name):
    """The module `name`.py beside this file (this process runs without sys.path entries for it).

    Registered in sys.modules under `name`, so a sibling loaded after it imports this same
    module object by name (``from _sandbox_libc import mount``)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# The siblings, each loaded once and now: a run's mounts may hide this dir. `_sandbox_libc`
# first, as `_sandbox_view` imports it.
LIBC = load_sibling("_sandbox_libc")
REAP = load_sibling("_sandbox_reap")
CGROUP = load_sibling("_sandbox_cgroup")
VIEW = load_sibling("_sandbox_view")
# bubblewrap's supervisor; its status_fields is shared.
SUPERVISOR = load_sibling("_sandbox_supervisor")

from _sandbox_libc import (CLONE_NEWIPC, CLONE_NEWNET, CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWUSER, CLONE_NEWUTS,  # noqa: E402
                           MS_NODEV, MS_NOEXEC, MS_NOSUID, MS_PRIVATE, MS_REC, PR_SET_CHILD_SUBREAPER,
                           PR_SET_NO_NEW_PRIVS, PR_SET_PDEATHSIG, mount, prctl, unshare)

# The siblings' functions this file calls, by their own names (tests call `kill_uid` here too).
kill_uid, kill_children, reap_all = REAP.kill_uid, REAP.kill_children, REAP.reap_all
wait_until, kill_and_wait = REAP.wait_until, REAP.kill_and_wait
view_entries, view_covers, setup_filesystem = VIEW.view_entries, VIEW.view_covers, VIEW.setup_filesystem
cgroups_for, join_cgroups, close_cgroups = CGROUP.cgroups_for, CGROUP.join, CGROUP.close_run
READONLY_DIR, WORK_DIR = VIEW.READONLY_DIR, VIEW.WORK_DIR


def load_seccomp_module():
    """`_sandbox_seccomp`, with libseccomp loaded now, before any mount hides or changes the filesystem."""
    module = load_sibling("_sandbox_seccomp")
    module.library()
    return module


# -- isolation -------------------------------------------------------------------------
def view_gid(uid):
    """The gid that sees all of a run's processes in its /proc (`SandboxConfig`'s process view):
    2**22 (more than any pid) away from the run's uid, so no other run's uid or gid; refused
    like the uid if a group has it."""
    import grp

    gid = uid + 2**22 if uid + 2**22 < 2**31 else uid - 2**22
    try:
        name = grp.getgrgid(gid).gr_name
    except KeyError:
        return gid
    raise OSError(1, f"sandbox view gid {gid} belongs to the group {name!r}; choose another uid_base")


def _check_unused_uid(uid):
    """Refuse a uid that belongs to an account: the cleanup kills every process of the uid."""
    import pwd

    if uid < 65536:
        raise OSError(1, f"sandbox uid {uid} is below 65536 (system and user accounts); raise uid_base")
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        return
    raise OSError(1, f"sandbox uid {uid} belongs to the account {name!r}; choose another uid_base")


def set_oom_score_adj():
    """oom_score_adj 1000 for this process and all it starts: the OOM killer takes the run's
    processes before any other. The run's /proc is read-only, so none of them lowers it."""
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")


def enter_private_network(root):
    """A network namespace of this process's own, whose loopback is down (a new one's is).
    Not root: inside a new user namespace mapping only this uid and gid."""
    if root:
        unshare(CLONE_NEWNET)
        return
    uid, gid = os.getuid(), os.getgid()
    unshare(CLONE_NEWUSER | CLONE_NEWNET)
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def read_files(workdir):
    files = {}
    if not os.path.isdir(workdir):
        return files
    for name in os.listdir(workdir):
        p = os.path.join(workdir, name)
        if os.path.isfile(p) and not os.path.islink(p):
            with open(p, "rb") as f:
                files[name] = f.read()
    return files


def program_rlimits(spec, nproc_extra=None):
    """(resource, (soft, hard)) for the program. Output of exactly `output_bytes` is allowed:
    RLIMIT_FSIZE is one byte more, and a file that reaches it is reported as over the cap.
    RLIMIT_NPROC only when `nproc_extra` is given (it counts processes of the program's uid)."""
    cpu = max(1, int(-(-float(spec["cpu_seconds"]) // 1)))  # ceil, at least 1 s
    limits = [
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),  # SIGXCPU at cpu, SIGKILL at cpu + 1
        (resource.RLIMIT_AS, (int(spec["memory_bytes"]),) * 2),
        (resource.RLIMIT_FSIZE, (int(spec["output_bytes"]) + 1,) * 2),
        (resource.RLIMIT_NOFILE, (int(spec["max_open_files"]),) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
    ]
    if nproc_extra is not None:
        limits.append((resource.RLIMIT_NPROC, (int(spec["max_processes"]) + nproc_extra,) * 2))
    return limits


def _die_reporting(err):
    try:
        os.write(2, f"sandbox: cannot start the program: {type(err).__name__}: {err}\n".encode())
    finally:
        os._exit(127)


def exec_program(spec, workdir, fds, uid, drop, seccomp):
    """In the forked child (namespaces backend): redirect, limit, drop privileges, filter, exec. Never returns."""
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        os.setpgid(0, 0)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, 65536)
        os.chdir(workdir)
        for which, value in program_rlimits(spec, 0 if drop else None):
            resource.setrlimit(which, value)
        if drop:
            os.setgroups([])
            view = spec.get("view_gid")  # effective / saved only: a child drops it with setresgid(uid, uid, uid)
            os.setresgid(uid, view or uid, view or uid)
            os.setresuid(uid, uid, uid)
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after the uid change, which clears it
        prctl(PR_SET_NO_NEW_PRIVS, 1)  # setuid binaries give nothing
        if seccomp is not None:
            seccomp.load(without_cgroup=not spec.get("cgroup"))
        os.umask(0o077)
        argv = spec["argv"]
        os.execve(argv[0], argv, spec["env"])
    except BaseException as err:  # noqa: BLE001 - report anything, then die
        _die_reporting(err)


def _read_report(fd):
    """Lines written to the report pipe (its writers are gone or dead): a list of JSON objects."""
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    out = []
    for line in b"".join(chunks).decode(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def supervise_namespaces(spec, files, fds, uid, drop, report_fd, seccomp, cgroups=None):
    """The forked supervisor (PID 1 of the run's PID namespace, still root): isolate, start the
    program, reap until it exits, report. Never returns; its exit kills the namespace."""

    def report(obj):
        os.write(report_fd, (json.dumps(obj) + "\n").encode())

    try:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the launcher dies -> so does the namespace
        if cgroups:  # the whole run, this supervisor included, in the run's own cgroups
            join_cgroups(cgroups)
        set_oom_score_adj()
        SUPERVISOR.set_own_deadline(float(spec["wall_seconds"]))
        flags = (CLONE_NEWNET if spec["net_ns"] else 0) | (
            CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS if spec["mount_ns"] else 0
        )
        if flags:
            unshare(flags)
        if spec["mount_ns"]:
            workdir = setup_filesystem(spec, files["work"], uid, spec["pid_ns"], files["readonly"])
        else:
            workdir = spec["host_workdir"]
            if drop:
                for name in os.listdir(workdir):
                    os.chown(os.path.join(workdir, name), uid, uid)
                os.chown(workdir, uid, uid)
                os.chmod(os.path.dirname(workdir), 0o711)  # ../readonly (root's) reachable from it
        if not spec["pid_ns"]:
            prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans come to us, and so to the cleanup
        pid = os.fork()
    except BaseException as err:  # noqa: BLE001
        try:
            report({"setup_error": f"{type(err).__name__}: {err}"})
        finally:
            os._exit(1)
    if pid == 0:
        os.close(report_fd)
        exec_program(spec, workdir, fds, uid, drop, seccomp)
    for fd in fds:
        os.close(fd)
    try:  # reap every orphan of the namespace; one CPU budget for all of the run's processes
        report(SUPERVISOR.watch(pid, float(spec["run_cpu_seconds"]), cgroups["cpu_fd"] if cgroups else None))
    finally:
        if not spec["pid_ns"]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        os._exit(0)


def run_namespaces(control, spec, t0):
    """Backend ``namespaces`` (root): see the module docstring, steps 1-5."""
    result = {"setup_error": None, "exit_code": None, "signal": None, "timed_out": False, "cpu_s": None}
    drop = bool(spec["drop_privileges"])
    uid = int(spec["uid_base"]) + os.getpid() if drop else os.getuid()
    result["uid"] = uid
    cgroups = None
    try:
        if drop:
            _check_unused_uid(uid)
        spec["view_gid"] = view_gid(uid) if spec.get("process_view") and drop and spec["pid_ns"] else None
        prctl(PR_SET_CHILD_SUBREAPER, 1)
        seccomp = load_seccomp_module() if spec["seccomp"] else None
        fds = (
            os.open(os.path.join(control, "stdin"), os.O_RDONLY),
            os.open(os.path.join(control, "stdout"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
            os.open(os.path.join(control, "stderr"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
        )
        spec["host_workdir"] = os.path.join(control, "work")
        files = ({"work": read_files(spec["host_workdir"]), "readonly": read_files(os.path.join(control, "readonly"))}
                 if spec["mount_ns"] else {})
        cgroups = cgroups_for(spec)
        if spec["pid_ns"]:
            unshare(CLONE_NEWPID)  # our next child is PID 1 of a new PID namespace
    except OSError as err:
        close_cgroups(cgroups)
        result["setup_error"] = f"{type(err).__name__}: {err}"
        return result
    report_r, report_w = os.pipe()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    sup = os.fork()
    if sup == 0:
        os.close(report_r)
        supervise_namespaces(spec, files, fds, uid, drop, report_w, seccomp, cgroups)
    os.close(report_w)
    for fd in fds:
        os.close(fd)
    waited = wait_until(sup, t0 + float(spec["wall_seconds"]))
    deadline_hit = waited is None
    if deadline_hit:
        waited = kill_and_wait(sup)  # kills every process of the PID namespace
    _finish(result, _read_report(report_r), waited, deadline_hit)
    # Nothing of the run's uid should be left (the namespace is gone); kill from root anyway.
    kill_rest = (lambda: kill_uid(uid)) if drop else kill_children
    kill_rest()
    result["reaped_leftovers"] = reap_all(kill_rest)
    _cgroup_fields(result, cgroups)
    close_cgroups(cgroups)
    result["wall_s"] = time.monotonic() - t0
    return result


def _cgroup_fields(result, cgroups):
    """What the run's cgroups say, before they go: which version held the run, its memory peak."""
    result["cgroup"] = f"v{cgroups['version']}" if cgroups else None
    result["memory_peak"] = CGROUP.memory_peak(cgroups) if cgroups else None


def _finish(result, reports, waited, deadline_hit):
    """Fill `result` from the supervisor's reports. Without a final report the run was cut off
    (by the wall-clock deadline, or the program killed or stopped its supervisor): it counts as
    killed by SIGKILL, with the supervisor's CPU time (which includes the program's)."""
    final = [r for r in reports if "exit_code" in r or "setup_error" in r]
    if final and final[-1].get("setup_error"):
        result["setup_error"] = final[-1]["setup_error"]
    elif final:
        result.update(final[-1])
    else:
        _, rusage = waited
        result["timed_out"] = deadline_hit
        result["signal"] = int(signal.SIGKILL)
        result["cpu_s"] = rusage.ru_utime + rusage.ru_stime


# -- bubblewrap backend ----------------------------------------------------------------
def bwrap_argv(bwrap, spec, file_fds, seccomp_fd, command, readonly_fds=(), readonly_bytes=0):
    """bubblewrap's command line for one run (`file_fds`: [(fd, name)] copied into /tmp/work;
    `readonly_fds`: the same into the read-only /tmp/readonly). No ``--unshare-net``: the
    launcher's child made the run's network namespace, with its loopback down (`exec_bwrap`)."""
    argv = [bwrap, "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    # --as-pid-1: the supervisor itself is the namespace's init, not bubblewrap's own init
    # process. That one runs as the program's uid, is dumpable and holds the run's stdin /
    # stdout / stderr, so a program could read its input back, or write forged output, through
    # /proc/1/fd; the supervisor is undumpable.
    argv += ["--as-pid-1", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    # The view is an allow-list (`view_entries`): bubblewrap's root is an empty tmpfs, made
    # read-only at the end; only the allowed paths are bound into it, read-only.
    binds, links = view_entries(spec.get("allow_paths", []))
    for real, _ in binds:
        argv += ["--ro-bind", real, real]
    for path, target in links:
        argv += ["--symlink", target, path]
    argv += ["--dev", "/dev", "--proc", "/proc"]
    argv += ["--size", str(int(spec["tmpfs_bytes"])), "--perms", "1777", "--tmpfs", "/tmp"]
    argv += ["--perms", "0700", "--dir", WORK_DIR]
    for fd, name in file_fds:
        argv += ["--perms", "0600", "--file", str(fd), f"{WORK_DIR}/{name}"]
    if readonly_fds:  # a tmpfs of its own, read-only once filled: no process of the run changes it
        argv += ["--size", str(int(readonly_bytes)), "--perms", "0755", "--tmpfs", READONLY_DIR]
        for fd, name in readonly_fds:
            argv += ["--perms", "0444", "--file", str(fd), f"{READONLY_DIR}/{name}"]
        argv += ["--remount-ro", READONLY_DIR]
    for real, isdir in view_covers(spec, binds):
        if isdir:
            argv += ["--size", "4096", "--tmpfs", real, "--remount-ro", real]
        else:
            argv += ["--ro-bind", "/dev/null", real]
    # /dev is a fresh tmpfs (bubblewrap's --dev), sized only by half the RAM: read-only, so no
    # program can fill host memory there (its device nodes stay usable); so is the root. /proc
    # read-only: the oom_score_adj of 1000 the run starts with cannot be lowered.
    argv += ["--remount-ro", "/dev", "--remount-ro", "/proc", "--remount-ro", "/", "--chdir", WORK_DIR]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    return argv + ["--"] + list(command)


def _supervisor_source():
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_supervisor.py")) as f:
        return f.read()


def exec_bwrap(argv, env, fds, keep, uid, cgroups=None, private_net=True):
    """In the forked child: stdio, the run's cgroups, oom_score_adj, the network namespace, drop
    root (if root), exec bubblewrap. Never returns. It stays in the launcher's process group, so
    killing that group kills it (and so its namespace)."""
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in keep:
            os.set_inheritable(fd, True)
        if cgroups:  # bubblewrap and everything of the run in the run's own cgroups
            join_cgroups(cgroups)
        root = os.geteuid() == 0
        set_oom_score_adj()  # as root also the floor of every process of the run
        if private_net:
            enter_private_network(root)
        if root:  # bubblewrap never runs as root: as root its sandbox would be root's
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        os.umask(0o077)
        os.chdir("/")
        os.execve(argv[0], argv, env)
    except BaseException as err:  # noqa: BLE001
        _die_reporting(err)


def _open_files(d, opened):
    """[(fd, name)] of the regular files in the dir `d` (none if it does not exist), each fd added to `opened`."""
    out = []
    for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        fd = os.open(os.path.join(d, name), os.O_RDONLY)
        opened.append(fd)
        out.append((fd, name))
    return out


def run_bwrap(control, spec, t0):
    """Backend ``bwrap``: see the module docstring."""
    result = {"setup_error": None, "exit_code": None, "signal": None, "timed_out": False, "cpu_s": None}
    root = os.geteuid() == 0
    uid = int(spec["uid_base"]) + os.getpid() if root else os.getuid()
    result["uid"] = uid
    opened = []
    cgroups = None
    try:
        if root:
            _check_unused_uid(uid)
        prctl(PR_SET_CHILD_SUBREAPER, 1)
        fds = (
            os.open(os.path.join(control, "stdin"), os.O_RDONLY),
            os.open(os.path.join(control, "stdout"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
            os.open(os.path.join(control, "stderr"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
        )
        opened += fds
        if root:  # bubblewrap runs as the run's uid: it must be able to write the program's output
            for fd in fds[1:]:
                os.fchown(fd, uid, uid)
        file_fds = _open_files(os.path.join(control, "work"), opened)
        readonly_fds = _open_files(os.path.join(control, "readonly"), opened)
        readonly_bytes = VIEW.readonly_tmpfs_bytes(os.fstat(fd).st_size for fd, _ in readonly_fds)
        seccomp_fd = (load_seccomp_module().export_bpf_fd(without_cgroup=not spec.get("cgroup"))
                      if spec["seccomp"] else None)
        if seccomp_fd is not None:
            opened.append(seccomp_fd)
        report_r, report_w = os.pipe()
        opened.append(report_w)
        cgroups = cgroups_for(spec)
        cpu_stat_fd = cgroups["cpu_fd"] if cgroups else None
        sup_spec = {
            "argv": spec["argv"],
            "env": spec["env"],
            "wall_seconds": float(spec["wall_seconds"]),
            "run_cpu_seconds": float(spec["run_cpu_seconds"]),
            "cpu_stat_fd": cpu_stat_fd,
            "report_fd": report_w,
            "rlimits": program_rlimits(spec, BWRAP_OWN_PROCESSES),
        }
        command = [spec["supervisor_python"], "-I", "-S", "-B", "-c", _supervisor_source(), json.dumps(sup_spec)]
        argv = bwrap_argv(spec["bwrap"], spec, file_fds, seccomp_fd, command, readonly_fds, readonly_bytes)
    except OSError as err:
        for fd in opened:
            os.close(fd)
        close_cgroups(cgroups)
        result["setup_error"] = f"{type(err).__name__}: {err}"
        return result
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    child = os.fork()
    if child == 0:
        os.close(report_r)
        keep = [fd for fd, _ in file_fds + readonly_fds] + [f for f in (seccomp_fd, cpu_stat_fd) if f is not None]
        exec_bwrap(argv, spec["env"], fds, keep + [report_w], uid, cgroups, private_net=spec["net_ns"])
    for fd in opened:
        os.close(fd)
    waited = wait_until(child, t0 + float(spec["wall_seconds"]))
    deadline_hit = waited is None
    if deadline_hit:
        waited = kill_and_wait(child)  # the supervisor (the namespace's init) dies with it (--die-with-parent)
    reports = _read_report(report_r)
    kill_rest = (lambda: (kill_children(), kill_uid(uid))) if root else kill_children
    result["reaped_leftovers"] = reap_all(kill_rest)  # the namespace's init, if it outlived bubblewrap
    if root:
        kill_uid(uid)
    _cgroup_fields(result, cgroups)
    close_cgroups(cgroups)
    if any(r.get("started") for r in reports) or deadline_hit:
        _finish(result, reports, waited, deadline_hit)
    else:
        tail = _tail(os.path.join(control, "stderr"))
        result["setup_error"] = f"bubblewrap failed (status {waited[0]}): {tail}"
    result["wall_s"] = time.monotonic() - t0
    return result


def _tail(path, n=1000):
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - n))
            return f.read().decode(errors="replace").strip()
    except OSError:
        return ""


def run(control):
    t0 = time.monotonic()
    with open(os.path.join(control, "spec.json")) as f:
        spec = json.load(f)
    if spec.get("backend") == "bwrap":
        return run_bwrap(control, spec, t0)
    return run_namespaces(control, spec, t0)


# -- probe -----------------------------------------------------------------------------
def _in_child(fn):
    """Run fn() in a forked child; its error message, or None when it succeeded."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        msg = "ok"
        try:
            fn()
        except BaseException as err:  # noqa: BLE001
            msg = f"{type(err).__name__}: {err}"
        os.write(w, msg.encode())
        os._exit(0)
    os.close(w)
    msg = os.read(r, 4096).decode()
    os.close(r)
    os.waitpid(pid, 0)
    return None if msg == "ok" else (msg or "the probe process died")


def _probe_mount_ns():
    unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS)
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=1777")


def _probe_pid_ns():
    unshare(CLONE_NEWPID)
    pid = os.fork()
    if pid == 0:  # PID 1 of the new namespace: mount its /proc, as a run does
        ok = 1
        try:
            unshare(CLONE_NEWNS)
            mount(None, "/", None, MS_REC | MS_PRIVATE)
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
            ok = 0 if os.getpid() == 1 else 1
        finally:
            os._exit(ok)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        raise OSError(1, "cannot mount /proc in a new PID namespace")


def _find_bwrap():
    for d in os.environ.get("PATH", "").split(os.pathsep) + ["/usr/bin", "/usr/local/bin", "/bin"]:
        p = os.path.join(d or ".", "bwrap")
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return os.path.abspath(p)
    return None


def _probe_bwrap(bwrap, seccomp):
    """Run `true` through bubblewrap with every option a run uses (as root: as nobody)."""
    spec = {"net_ns": True, "tmpfs_bytes": 65536, "readonly_empty": ["/dev/shm"], "hide_paths": [],
            "allow_paths": ["/usr", "/bin", "/lib", "/lib64", "/etc/ld.so.cache"]}
    seccomp_fd = seccomp.export_bpf_fd(without_cgroup=True) if seccomp is not None else None
    argv = bwrap_argv(bwrap, spec, [], seccomp_fd, ["/bin/sh", "-c", "exit 0"])
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(err_r)
        null = os.open(os.devnull, os.O_RDWR)
        exec_bwrap(argv, {"PATH": "/usr/bin:/bin"}, (null, null, err_w), [seccomp_fd] if seccomp_fd is not None else [], 65534)
    os.close(err_w)
    if seccomp_fd is not None:
        os.close(seccomp_fd)
    err = b""
    while True:
        chunk = os.read(err_r, 4096)
        if not chunk:
            break
        err += chunk
    os.close(err_r)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        raise OSError(1, f"{bwrap} exited with status {status}: {err.decode(errors='replace').strip()[-300:]}")


def probe():
    """What this machine allows: root, network / mount / PID namespaces, libseccomp, bubblewrap."""
    out = {"euid": os.geteuid()}
    for key, fn in (("net_ns", lambda: unshare(CLONE_NEWNET)), ("mount_ns", _probe_mount_ns), ("pid_ns", _probe_pid_ns)):
        err = _in_child(fn)
        out[key] = err is None
        out[key + "_error"] = err
    seccomp = None
    try:
        seccomp = load_seccomp_module()
        ctx = seccomp.build_filter(without_cgroup=True)
        seccomp.release(ctx)
        out["seccomp"], out["seccomp_error"] = True, None
    except OSError as err:
        seccomp = None
        out["seccomp"], out["seccomp_error"] = False, f"{type(err).__name__}: {err}"
    bwrap = _find_bwrap()
    out["bwrap"] = None
    out["bwrap_error"] = "bwrap not found on PATH (Debian: apt-get install bubblewrap)" if bwrap is None else None
    if bwrap is not None:
        err = _in_child(lambda: _probe_bwrap(bwrap, seccomp))
        out["bwrap"] = bwrap if err is None else None
        out["bwrap_error"] = err
    return out


def main(argv):
    if len(argv) == 2 and argv[1] == "--probe":
        print(json.dumps(probe()))
        return 0
    if len(argv) == 3 and argv[1] == "--kill-uid":
        return 0 if kill_uid(int(argv[2])) else 1
    if len(argv) != 2:
        print("usage: _sandbox_launcher.py <control_dir> | --probe | --kill-uid UID", file=sys.stderr)
        return 2
    control = argv[1]
    # Opened before the mount namespace hides the control dir (it lives under /tmp).
    result_fd = os.open(os.path.join(control, "result.json"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    result = run(control)
    os.write(result_fd, json.dumps(result).encode())
    os.close(result_fd)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
