"""The sandbox's seccomp filter, built with libseccomp (``libseccomp.so.2``) through ctypes.

Standard library only: the sandbox launcher loads this file by path (it runs as
``python -I -S``, without site-packages). The filter allows every system call except the
ones below, which fail with EPERM (clone3 with ENOSYS, so that the C library falls back to
clone, whose flags the filter can inspect). A system call of another architecture (e.g.
32-bit ``int 0x80`` on x86_64) kills the process (libseccomp's default for a foreign arch).

Sockets are an allow-list: ``socket`` / ``socketpair`` of any address family other than
``ALLOWED_SOCKET_FAMILIES`` (AF_UNIX, and AF_INET / AF_INET6, which reach only the run's empty
network namespace) fail with EAFNOSUPPORT: AF_VSOCK (not covered by a network namespace: on
a VM a path to the host), AF_PACKET, AF_NETLINK, AF_ALG, AF_BLUETOOTH, ... and any family
added to future kernels.

Nothing an ordinary program or the grading harness needs is denied: fork / clone without
namespace flags, threads, execve, pipes, wait, kill of its own children and prctl all work.

Where the run has no cgroup (`build_filter(without_cgroup=True)`), what only a cgroup would
count is refused too (`DENIED_WITHOUT_CGROUP`): SysV shared memory, message queues and
semaphores and memfd_create (their pages belong to no process: RLIMIT_AS does not see them and
an OOM kill would fall elsewhere), a socket or pipe buffer above the default (``setsockopt`` of
``SO_SNDBUF`` / ``SO_RCVBUF`` and their ``FORCE`` forms, ``fcntl(F_SETPIPE_SZ)``: kernel memory no
rlimit counts), and a new
SIGCHLD disposition (``rt_sigaction(SIGCHLD, act)`` with an action; queries still work): a parent
that ignores SIGCHLD has its children auto-reaped, and their CPU time reaches nobody's
``cutime``, so the supervisors' polls could not count it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

# System calls a sandboxed program never needs, by what they would give it.
DENIED = {
    "namespaces": ("unshare", "setns"),
    "tracing other processes": ("ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd"),
    "mounts and roots": (
        "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsconfig",
        "fsmount", "fspick", "mount_setattr",
    ),
    "kernel keyrings": ("keyctl", "add_key", "request_key"),
    "kernel attack surface": (
        "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
        "open_by_handle_at", "lookup_dcookie",
    ),
    "system administration": (
        "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot",
        "swapon", "swapoff", "syslog", "acct", "quotactl", "quotactl_fd", "iopl", "ioperm", "vhangup",
        "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "sethostname", "setdomainname",
        "fanotify_init", "nfsservctl", "uselib",
    ),
}
# Refused only where the run has no cgroup (see the module docstring).
DENIED_WITHOUT_CGROUP = {
    "memory that belongs to no process": ("shmget", "msgget", "semget", "memfd_create"),
}
SIGCHLD = 17  # x86_64 and aarch64
# setsockopt(fd, SOL_SOCKET, one of these): a socket buffer larger than the default (net.core.wmem_max,
# 4 MiB here, against 208 KiB: the buffers of a run's unix sockets held 455 MiB per process).
SOL_SOCKET = 1
SOCKET_BUFFER_OPTIONS = {"SO_SNDBUF": 7, "SO_RCVBUF": 8, "SO_SNDBUFFORCE": 32, "SO_RCVBUFFORCE": 33}
F_SETPIPE_SZ = 1031  # fcntl: a pipe buffer above the default 64 KiB (up to fs.pipe-max-size, 1 MiB)
# clone(2) flags that create a namespace: clone with any of them fails (clone's flags are its
# first argument on x86_64 and aarch64).
CLONE_NAMESPACE_FLAGS = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}

# The only socket address families a program may create (AF_UNIX, AF_INET, AF_INET6).
ALLOWED_SOCKET_FAMILIES = {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10}
# Families below this are refused one by one; any value from it up (AF_MAX is 46 on Linux
# 6.x; a family number with high bits set, which the kernel truncates to an int) by one rule.
SOCKET_FAMILY_RULES_UP_TO = 64

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_NE = 1
SCMP_CMP_EQ = 4
SCMP_CMP_GE = 5
SCMP_CMP_MASKED_EQ = 7


def SCMP_ACT_ERRNO(err: int) -> int:
    return 0x00050000 | (err & 0xFFFF)


class _ArgCmp(ctypes.Structure):
    """struct scmp_arg_cmp."""

    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]


_lib = None


def library() -> ctypes.CDLL:
    """libseccomp, loaded once; OSError naming the package to install when it is missing."""
    global _lib
    if _lib is None:
        try:
            lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
        except OSError:  # not under its usual soname: ask the linker cache (slower: runs ldconfig)
            try:
                lib = ctypes.CDLL(ctypes.util.find_library("seccomp") or "libseccomp.so.2", use_errno=True)
            except OSError as err:
                raise OSError(
                    errno.ENOENT, f"libseccomp is not installed ({err}); install it (Debian: apt-get install libseccomp2)"
                ) from None
        lib.seccomp_init.restype = ctypes.c_void_p
        lib.seccomp_init.argtypes = [ctypes.c_uint32]
        lib.seccomp_rule_add_array.argtypes = [
            ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(_ArgCmp)
        ]
        lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
        lib.seccomp_load.argtypes = [ctypes.c_void_p]
        lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.seccomp_release.argtypes = [ctypes.c_void_p]
        _lib = lib
    return _lib


def _check(ret: int, what: str) -> None:
    if ret < 0:  # libseccomp returns -errno
        raise OSError(-ret, f"seccomp {what}: {os.strerror(-ret)}")


def _add(lib, ctx, action: int, name: str, cmps=()) -> bool:
    """Add one rule; False when this libseccomp / architecture does not know the call."""
    nr = lib.seccomp_syscall_resolve_name(name.encode())
    if nr < 0:
        return False
    arr = (_ArgCmp * max(1, len(cmps)))(*cmps)
    _check(lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), arr), f"rule {name}")
    return True


def build_filter(without_cgroup: bool = False):
    """A libseccomp filter context with the rules above (free it with `release`); `without_cgroup`:
    also the rules of a run that no cgroup bounds (`DENIED_WITHOUT_CGROUP`, SIGCHLD's disposition)."""
    lib = library()
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        raise OSError(errno.ENOMEM, "seccomp_init failed")
    try:
        eperm = SCMP_ACT_ERRNO(errno.EPERM)
        for names in list(DENIED.values()) + (list(DENIED_WITHOUT_CGROUP.values()) if without_cgroup else []):
            for name in names:
                _add(lib, ctx, eperm, name)
        if without_cgroup:  # rt_sigaction(SIGCHLD, act != NULL, ...): no auto-reaping
            _add(lib, ctx, eperm, "rt_sigaction", [_ArgCmp(0, SCMP_CMP_EQ, SIGCHLD, 0), _ArgCmp(1, SCMP_CMP_NE, 0, 0)])
            for option in SOCKET_BUFFER_OPTIONS.values():  # no socket buffer beyond the default
                _add(lib, ctx, eperm, "setsockopt", [_ArgCmp(1, SCMP_CMP_EQ, SOL_SOCKET, 0), _ArgCmp(2, SCMP_CMP_EQ, option, 0)])
            _add(lib, ctx, eperm, "fcntl", [_ArgCmp(1, SCMP_CMP_EQ, F_SETPIPE_SZ, 0)])  # nor pipe buffer
        _add(lib, ctx, SCMP_ACT_ERRNO(errno.ENOSYS), "clone3")  # flags behind a pointer: force clone
        for flag in CLONE_NAMESPACE_FLAGS.values():
            _add(lib, ctx, eperm, "clone", [_ArgCmp(0, SCMP_CMP_MASKED_EQ, flag, flag)])
        no_family = SCMP_ACT_ERRNO(errno.EAFNOSUPPORT)
        allowed = set(ALLOWED_SOCKET_FAMILIES.values())
        for call in ("socket", "socketpair"):  # the family is the first argument of both
            for family in range(SOCKET_FAMILY_RULES_UP_TO):
                if family not in allowed:
                    _add(lib, ctx, no_family, call, [_ArgCmp(0, SCMP_CMP_EQ, family, 0)])
            _add(lib, ctx, no_family, call, [_ArgCmp(0, SCMP_CMP_GE, SOCKET_FAMILY_RULES_UP_TO, 0)])
    except BaseException:
        lib.seccomp_release(ctx)
        raise
    return ctx


def release(ctx) -> None:
    library().seccomp_release(ctx)


def load(without_cgroup: bool = False) -> None:
    """Install the filter on the calling thread (sets no-new-privileges first, as seccomp needs)."""
    ctx = build_filter(without_cgroup)
    try:
        _check(library().seccomp_load(ctx), "load")
    finally:
        release(ctx)


def export_bpf_fd(without_cgroup: bool = False) -> int:
    """A memfd holding the filter as raw BPF (bubblewrap's ``--seccomp FD``), rewound; caller closes it."""
    ctx = build_filter(without_cgroup)
    fd = os.memfd_create("scalerl-seccomp")  # close-on-exec: pass it on explicitly
    try:
        _check(library().seccomp_export_bpf(ctx, fd), "export")
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    finally:
        release(ctx)
    return fd
