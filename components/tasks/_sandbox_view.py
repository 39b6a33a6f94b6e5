"""The run's filesystem view, an allow-list: which host paths it holds, and (namespaces backend) building it.

Standard library only: the launcher (`_sandbox_launcher.py`) loads this file by path, after
`_sandbox_libc.py`, at its start (a run's mounts may hide this dir). `view_entries` and
`view_covers` give the binds, links and covers of the view to both backends (bubblewrap gets
them as options); `setup_filesystem` mounts the view itself and pivot_roots into it.
"""

import os

# The launcher's `_sandbox_libc`, the same module object: `load_sibling` registered it in
# sys.modules before loading this file (no sys.path entry reaches this dir).
from _sandbox_libc import (MNT_DETACH, MS_BIND, MS_NODEV, MS_NOEXEC, MS_NOSUID, MS_PRIVATE, MS_RDONLY, MS_REC,
                           MS_REMOUNT, mount, pivot_root, umount2)


def covered_paths(paths):
    """The paths to cover, in mount order: real paths that exist, not /, not under /tmp (a
    fresh tmpfs there hides everything anyway), and not inside another covered directory."""
    out = []
    for real in sorted({os.path.realpath(p) for p in paths}):
        if real == "/" or real == "/tmp" or real.startswith("/tmp/") or not os.path.lexists(real):
            continue
        if any(real.startswith(c.rstrip("/") + "/") for c, isdir in out if isdir):
            continue
        out.append((real, os.path.isdir(real)))
    return out


def _within(path, top):
    return path == top or path.startswith(top.rstrip("/") + "/")


def view_entries(allowed):
    """The filesystem view made of the allow-listed paths: (binds, links).

    binds: [(real path, is a dir)] to bind read-only at the same path, none inside another, no
    "/" and nothing under /tmp, /proc or /dev (the view makes those itself); links: [(path,
    target)], the symbolic links met on the way to an allowed path (``/lib -> usr/lib``, a
    venv's ``bin/python -> /usr/bin/python3.11``) that are not inside a bound dir, recreated as
    they are. Paths that do not exist are left out."""
    binds, links = set(), {}
    for start in allowed:
        todo, hops = os.path.abspath(start), 0
        while todo and hops < 40:
            hops += 1
            cur, parts, nxt = "/", todo.strip("/").split("/"), None
            for i, part in enumerate(p for p in parts if p):
                path = os.path.join(cur, part)
                if os.path.islink(path):
                    target = os.readlink(path)
                    links[path] = target
                    rest = "/".join(parts[i + 1:])
                    nxt = os.path.normpath(os.path.join(cur, target, rest))
                    break
                cur = path
            if nxt is None:
                if os.path.exists(cur):
                    binds.add(cur)
                break
            todo = nxt
    special = ("/tmp", "/proc", "/dev")
    kept = []
    for real in sorted(binds):
        if real == "/" or any(_within(real, s) for s in special):
            continue
        if any(_within(real, k) for k in kept):
            continue
        kept.append(real)
    out_links = sorted((p, t) for p, t in links.items()
                       if not any(_within(p, k) and p != k for k in kept) and not any(_within(p, s) for s in special))
    return [(k, os.path.isdir(k)) for k in kept], out_links


def view_covers(spec, binds):
    """The hidden paths that lie inside the view (inside a bound dir), to cover there; with the
    read-only empty dirs of /dev (``/dev/shm``)."""
    dirs = [b for b, isdir in binds if isdir]
    out = []
    for real, isdir in covered_paths(spec.get("readonly_empty", []) + spec.get("hide_paths", [])):
        if any(_within(real, d) for d in dirs) or _within(real, "/dev"):
            out.append((real, isdir))
    return out


# Device nodes of the view's /dev (bind-mounted from the host's), and its links.
DEV_NODES = ("null", "zero", "full", "random", "urandom")
DEV_LINKS = (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
             ("stderr", "/proc/self/fd/2"))
NEW_ROOT = "/tmp"  # where the view's root tmpfs is mounted (in the run's own mount namespace) before pivot_root
WORK_DIR = "/tmp/work"  # the program's working dir (its `files`), its own and writable
# Files the program may read but not change (the grading harness): a read-only tmpfs beside the
# working dir, root-owned under ``namespaces``; the program runs them as ``../readonly/NAME``.
READONLY_DIR = "/tmp/readonly"


def readonly_tmpfs_bytes(sizes):
    """Size of the read-only dir's tmpfs for files of these `sizes`: a page each more, and some room to spare."""
    return sum(int(n) + 4096 for n in sizes) + 65536


def _pivot_root(new_root):
    """pivot_root(new_root, new_root), then detach the old root stacked on it: only the view remains."""
    os.chdir(new_root)
    pivot_root(".", ".")
    umount2(".", MNT_DETACH, "umount the old root")
    os.chdir("/")


def _bind_ro(fd, target, rec=True):
    mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | (MS_REC if rec else 0))
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID)


def setup_filesystem(spec, files, uid, pid_ns, readonly=None):
    """In a fresh mount namespace, the run's whole filesystem view, an allow-list: a read-only
    root tmpfs holding read-only binds of the allowed paths (the interpreter, its standard
    library, the system libraries, a few files of /etc), a minimal /dev (null, zero, full,
    random, urandom), the run's own /proc (read-only), and a private size-capped /tmp holding /tmp/work
    (`files`, the program's) and /tmp/readonly (`readonly`: root's, a read-only tmpfs);
    the hidden paths inside allowed dirs are covered. Then pivot_root into it: nothing else of
    the host (the repository, homes, /var, /srv, /run, ...) exists for the program. Returns the workdir."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    binds, links = view_entries(spec.get("allow_paths", []))
    fds = {}  # opened now: the root tmpfs goes over /tmp, where an allowed path may live
    try:
        for real, _ in binds:
            fds[real] = os.open(real, os.O_PATH | os.O_CLOEXEC)
        for name in DEV_NODES:
            if os.path.exists(f"/dev/{name}"):
                fds[f"/dev/{name}"] = os.open(f"/dev/{name}", os.O_PATH | os.O_CLOEXEC)
        if not pid_ns:
            fds["/proc"] = os.open("/proc", os.O_PATH | os.O_CLOEXEC)
        root = NEW_ROOT
        mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
        for real, isdir in binds:
            target = root + real
            os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
            if isdir:
                os.makedirs(target, 0o755, exist_ok=True)
            else:
                open(target, "wb").close()
            _bind_ro(fds[real], target, rec=isdir)
        for path, target in links:
            os.makedirs(os.path.dirname(root + path), 0o755, exist_ok=True)
            if not os.path.lexists(root + path):
                os.symlink(target, root + path)
        for real, isdir in view_covers(spec, binds):
            if _within(real, "/dev"):
                continue  # the view's /dev holds only the nodes below
            if isdir:
                mount("tmpfs", root + real, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=755")
            else:
                mount("/dev/null", root + real, None, MS_BIND)
        os.mkdir(root + "/dev", 0o755)
        mount("tmpfs", root + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=755")
        for name in DEV_NODES:
            if "/dev/" + name in fds:
                open(f"{root}/dev/{name}", "wb").close()
                mount(f"/proc/self/fd/{fds['/dev/' + name]}", f"{root}/dev/{name}", None, MS_BIND)
        for name, target in DEV_LINKS:
            os.symlink(target, f"{root}/dev/{name}")
        mount(None, root + "/dev", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)
        os.mkdir(root + "/proc", 0o555)
        if pid_ns:  # a /proc of the new PID namespace: the host's processes are not listed, and
            # hidepid=2 hides the root supervisor (PID 1) from the program too; a process whose
            # effective gid is the run's view gid (`view_gid`: the grading harness, not its programs)
            # sees every process of the run (its programs are undumpable, which hidepid hides)
            # read-only: no process of the run lowers the oom_score_adj of 1000 it starts with (the
            # floor root sets needs CAP_SYS_RESOURCE, which root may lack, as in some VMs)
            view = spec.get("view_gid")
            mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY,
                  "hidepid=2" + (f",gid={view}" if view else ""))
        else:
            mount(f"/proc/self/fd/{fds['/proc']}", root + "/proc", None, MS_BIND | MS_REC)
            mount(None, root + "/proc", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
        os.mkdir(root + "/tmp", 0o755)
        mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={int(spec['tmpfs_bytes'])},mode=1777")
    finally:
        for fd in fds.values():
            os.close(fd)
    _pivot_root(root)
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    if readonly:
        _readonly_dir(readonly)
    os.mkdir(WORK_DIR, 0o700)
    for name, data in files.items():
        with open(os.path.join(WORK_DIR, name), "wb") as f:
            f.write(data)
        os.chown(os.path.join(WORK_DIR, name), uid, uid)
    os.chown(WORK_DIR, uid, uid)
    return WORK_DIR


def _readonly_dir(files):
    """`READONLY_DIR`: a tmpfs of root's holding `files` (root's, 0644), then remounted read-only."""
    os.mkdir(READONLY_DIR, 0o755)
    mount("tmpfs", READONLY_DIR, "tmpfs", MS_NOSUID | MS_NODEV, f"size={readonly_tmpfs_bytes(len(d) for d in files.values())},mode=755")
    for name, data in files.items():
        path = os.path.join(READONLY_DIR, name)
        with open(path, "wb") as f:
            f.write(data)
        os.chmod(path, 0o644)
    mount(None, READONLY_DIR, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
