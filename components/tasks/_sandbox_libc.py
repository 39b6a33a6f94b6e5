"""The sandbox launcher's system calls through ctypes: mount, umount2, pivot_root, unshare, prctl.

Standard library only: the launcher (`_sandbox_launcher.py`) loads this file by path before
any other sibling that needs it (it runs as ``python -I -S -B``, without sys.path entries for
this dir), so every sibling shares this one module. Each call raises OSError on failure.
"""

import ctypes
import os

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}  # the C library has no wrapper for it

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def _errcheck(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _b(s):
    return s.encode() if s is not None else None


def mount(source, target, fstype, flags, data=None):
    _errcheck(_libc.mount(_b(source), _b(target), _b(fstype), flags, _b(data)), f"mount {target}")


def umount2(target, flags, what=None):
    _errcheck(_libc.umount2(_b(target), flags), what or f"umount {target}")


def pivot_root(new_root, put_old):
    nr = SYS_PIVOT_ROOT.get(os.uname().machine, 155)
    _errcheck(_libc.syscall(nr, _b(new_root), _b(put_old)), "pivot_root")


def unshare(flags):
    _errcheck(_libc.unshare(flags), "unshare")


def prctl(option, arg):
    _errcheck(_libc.prctl(option, arg, 0, 0, 0), "prctl")
