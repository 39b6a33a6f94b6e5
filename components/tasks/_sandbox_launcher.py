"""Sandbox launcher: runs ONE untrusted program with isolation, then cleans up everything it started.

Executed by `components.tasks.sandbox` as its own process (``python -I -S -B this_file ...``),
never imported. Standard library only. Modes:

    launcher.py <control_dir>     run the program described by <control_dir>/spec.json
    launcher.py --probe           print a JSON of what isolation this machine allows
    launcher.py --kill-uid UID    SIGKILL every process of UID (a backstop cleanup)

Run mode, in order (the launcher itself stays root and single-threaded, so fork is safe):

1. becomes a child subreaper, so every process the program leaves behind is re-parented to it;
2. opens stdin / stdout / stderr files of the control dir (stdout/stderr are capped by
   RLIMIT_FSIZE: a program writing more is killed by SIGXFSZ);
3. ``unshare`` a new network namespace (only a down loopback: no network at all) and a new
   mount + IPC namespace in which /tmp is a fresh size-capped tmpfs holding the program's
   working dir /tmp/work, the other world-writable dirs are empty read-only tmpfs, and the
   paths to hide (the repo, the data files, /run with its unix sockets, ...) are covered;
4. forks the program: new process group, rlimits (CPU, address space, processes, file size,
   open files, no core), all groups dropped and uid/gid set to a fresh unprivileged id
   (``uid_base + launcher pid``, unique among live launchers, so RLIMIT_NPROC bounds a fork
   bomb and the cleanup can kill exactly this sandbox's processes), scrubbed environment;
5. waits with a wall-clock deadline, then kills every process of that uid and reaps until no
   child is left, and writes result.json.
"""

import ctypes
import json
import os
import resource
import signal
import sys
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def _errcheck(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _b(s):
    return s.encode() if s is not None else None


def mount(source, target, fstype, flags, data=None):
    _errcheck(_libc.mount(_b(source), _b(target), _b(fstype), flags, _b(data)), f"mount {target}")


def unshare(flags):
    _errcheck(_libc.unshare(flags), "unshare")


def prctl(option, arg):
    _errcheck(_libc.prctl(option, arg, 0, 0, 0), "prctl")


# -- cleanup ---------------------------------------------------------------------------
def kill_uid(uid):
    """SIGKILL every process whose uid is `uid` (kill(-1) from a child running as that uid)."""
    if uid < 65536:
        raise ValueError(f"refusing to kill every process of uid {uid}: not a sandbox uid")
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            # Linux: kill(-1) never signals the caller itself, and succeeds even when it
            # finds nothing of ours to kill (other processes only give EPERM), so it cannot
            # tell us when we are done: a few passes here, and `reap_all` repeats until the
            # launcher (the subreaper of every process the program started) has no child left.
            for _ in range(3):
                os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def reap_all(kill, deadline_s=3.0):
    """Wait for every child (direct or re-parented orphan) until none is left."""
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


# -- isolation -------------------------------------------------------------------------
def setup_filesystem(spec, files, uid):
    """In a fresh mount namespace: private /tmp with /tmp/work, covered dirs; returns the workdir."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={int(spec['tmpfs_bytes'])},mode=1777")
    covered = []
    for path in spec.get("readonly_empty", []) + spec.get("hide_paths", []):
        real = os.path.realpath(path)
        if real in covered or real == "/" or real == "/tmp" or not os.path.exists(real):
            continue
        if os.path.isdir(real):
            mount("tmpfs", real, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=755")
        else:
            mount("/dev/null", real, None, MS_BIND)
        covered.append(real)
    workdir = "/tmp/work"
    os.mkdir(workdir, 0o700)
    for name, data in files.items():
        with open(os.path.join(workdir, name), "wb") as f:
            f.write(data)
        os.chown(os.path.join(workdir, name), uid, uid)
    os.chown(workdir, uid, uid)
    return workdir


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


def read_files(workdir):
    files = {}
    for name in os.listdir(workdir):
        p = os.path.join(workdir, name)
        if os.path.isfile(p) and not os.path.islink(p):
            with open(p, "rb") as f:
                files[name] = f.read()
    return files


def exec_program(spec, workdir, fds, uid, drop):
    """In the forked child: redirect, limit, drop privileges, exec. Never returns."""
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        os.setpgid(0, 0)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, 65536)
        os.chdir(workdir)
        cpu = max(1, int(-(-float(spec["cpu_seconds"]) // 1)))  # ceil, at least 1 s
        limits = [
            (resource.RLIMIT_CPU, (cpu, cpu + 1)),  # SIGXCPU at cpu, SIGKILL at cpu + 1
            (resource.RLIMIT_AS, (int(spec["memory_bytes"]),) * 2),
            (resource.RLIMIT_FSIZE, (int(spec["output_bytes"]),) * 2),
            (resource.RLIMIT_NOFILE, (int(spec["max_open_files"]),) * 2),
            (resource.RLIMIT_CORE, (0, 0)),
        ]
        if drop:
            limits.append((resource.RLIMIT_NPROC, (int(spec["max_processes"]),) * 2))
        for which, value in limits:
            resource.setrlimit(which, value)
        if drop:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after the uid change, which clears it
        os.umask(0o077)
        argv = spec["argv"]
        os.execve(argv[0], argv, spec["env"])
    except BaseException as err:  # noqa: BLE001 - report anything, then die
        try:
            os.write(2, f"sandbox: cannot start the program: {type(err).__name__}: {err}\n".encode())
        finally:
            os._exit(127)


def run(control):
    t0 = time.monotonic()
    with open(os.path.join(control, "spec.json")) as f:
        spec = json.load(f)
    result = {"setup_error": None, "exit_code": None, "signal": None, "timed_out": False, "cpu_s": None}
    drop = bool(spec["drop_privileges"])
    uid = int(spec["uid_base"]) + os.getpid() if drop else os.getuid()
    result["uid"] = uid
    try:
        if drop:
            _check_unused_uid(uid)
        prctl(PR_SET_CHILD_SUBREAPER, 1)
        fds = (
            os.open(os.path.join(control, "stdin"), os.O_RDONLY),
            os.open(os.path.join(control, "stdout"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
            os.open(os.path.join(control, "stderr"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
        )
        host_workdir = os.path.join(control, "work")
        flags = (CLONE_NEWNET if spec["net_ns"] else 0) | (CLONE_NEWNS | CLONE_NEWIPC if spec["mount_ns"] else 0)
        if flags:
            unshare(flags)
        if spec["mount_ns"]:
            workdir = setup_filesystem(spec, read_files(host_workdir), uid)
        else:
            workdir = host_workdir
            if drop:
                for name in os.listdir(workdir):
                    os.chown(os.path.join(workdir, name), uid, uid)
                os.chown(workdir, uid, uid)
    except OSError as err:
        result["setup_error"] = f"{type(err).__name__}: {err}"
        return result

    # SIGCHLD stays blocked so the wait below can sleep in sigtimedwait until a child exits
    # (no polling latency); the program gets an empty mask back before exec.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    pid = os.fork()
    if pid == 0:
        exec_program(spec, workdir, fds, uid, drop)
    for fd in fds:
        os.close(fd)

    def kill_rest():
        if drop:
            kill_uid(uid)
        else:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    deadline = t0 + float(spec["wall_seconds"])
    status = None
    while True:
        wpid, st, rusage = os.wait4(pid, os.WNOHANG)
        if wpid:
            status = st
            break
        remaining = deadline - time.monotonic()
        if remaining > 0:
            # Wakes on any SIGCHLD (e.g. a grandchild re-parented to us): loop and re-check.
            signal.sigtimedwait({signal.SIGCHLD}, min(remaining, 0.5))
            continue
        result["timed_out"] = True
        kill_rest()
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        wpid, status, rusage = os.wait4(pid, 0)
        break
    result["wall_s"] = time.monotonic() - t0
    result["cpu_s"] = rusage.ru_utime + rusage.ru_stime
    if os.WIFEXITED(status):
        result["exit_code"] = os.WEXITSTATUS(status)
    elif os.WIFSIGNALED(status):
        result["signal"] = os.WTERMSIG(status)
    # Whatever the program left running (background children, a fork bomb) dies here.
    kill_rest()
    result["reaped_leftovers"] = reap_all(kill_rest)
    return result


def probe():
    """What this machine allows: root, a network namespace, a mount namespace with tmpfs."""
    out = {"euid": os.geteuid()}
    for key, flags in (("net_ns", CLONE_NEWNET), ("mount_ns", CLONE_NEWNS | CLONE_NEWIPC)):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            msg = "ok"
            try:
                unshare(flags)
                if flags & CLONE_NEWNS:
                    mount(None, "/", None, MS_REC | MS_PRIVATE)
                    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=1777")
            except BaseException as err:  # noqa: BLE001
                msg = f"{type(err).__name__}: {err}"
            os.write(w, msg.encode())
            os._exit(0)
        os.close(w)
        msg = os.read(r, 4096).decode()
        os.close(r)
        os.waitpid(pid, 0)
        out[key] = msg == "ok"
        out[key + "_error"] = None if msg == "ok" else msg
    return out


def main(argv):
    if len(argv) == 2 and argv[1] == "--probe":
        print(json.dumps(probe()))
        return 0
    if len(argv) == 3 and argv[1] == "--kill-uid":
        kill_uid(int(argv[2]))
        return 0
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
