"""One memory, CPU and pids budget per sandbox run, on the machines people have (issue 44, item 2).

Where a cgroup can be had (cgroup v2, or v1's memory, cpuacct and pids, as root or in a delegated
subtree), each run gets its own and is held to it: memory no rlimit sees (memfd, SysV shared
memory) and CPU no poll sees (children auto-reaped because their parent ignores SIGCHLD) count.
This machine has cgroup v1 only, so these tests run on its real v1 controllers: as root (both
backends) and as an unprivileged user with a delegated subtree (bubblewrap). Where there is
none, what only a cgroup would count is refused, and the warning says what bounds a run.

Each hostile program here held more than its run's budget, or used more CPU, before this issue.
Every test needs root (to run both backends, and to make cgroups), as CI does.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import pytest

from _helpers_sandbox import run_batch, sandbox_processes
from components.tasks import sandbox

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the budget tests need root (CI runs as root)")

MiB = 2**20
# The run's memory budget is memory_bytes + tmpfs_bytes: 160 MiB here.
BUDGET = {"cpu_seconds": 2, "wall_seconds": 20, "memory_bytes": 128 * MiB, "tmpfs_bytes": 32 * MiB,
          "max_processes": 8, "output_bytes": 64 * 1024, "max_open_files": 64}
RUN_MEMORY = BUDGET["memory_bytes"] + BUDGET["tmpfs_bytes"]
# Each prints how many MiB it holds after every 8 MiB, up to 1 GiB (6x its budget). The memfds
# are 32 MiB each (RLIMIT_FSIZE, the output cap, bounds one file: MEMFD_LIMITS), all kept open.
MEMFD = r"""
import os
chunk, fds = b"x" * (8 << 20), []
for i in range(1, 129):
    if i % 4 == 1:
        fds.append(os.memfd_create("hog"))
    os.write(fds[-1], chunk)
    print(8 * i, flush=True)
"""
MEMFD_LIMITS = {"output_bytes": 32 * MiB}
SYSV_SHM = r"""
import ctypes, mmap
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
libc.shmdt.argtypes = [ctypes.c_void_p]
for i in range(1, 129):  # 8 MiB segments, each attached, filled and detached: no rlimit sees them
    shmid = libc.shmget(0, 8 << 20, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
    if shmid < 0:
        raise OSError(ctypes.get_errno(), "shmget")
    addr = libc.shmat(shmid, None, 0)
    ctypes.memset(addr, 1, 8 << 20)
    libc.shmdt(addr)
    print(8 * i, flush=True)
"""
# A parent that ignores SIGCHLD spends its CPU in sequential short children, each auto-reaped:
# their CPU time reaches nobody's cutime, and a poll sees only live children. 6 s of CPU.
IGNORED_SIGCHLD = r"""
import os, signal, time
try:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    reap = False
except OSError:  # refused where the run has no cgroup: then it must wait for them
    reap = True
print("ignoring" if not reap else "refused", flush=True)
for _ in range(300):
    pid = os.fork()
    if pid == 0:
        stop = time.process_time() + 0.02
        while time.process_time() < stop:
            pass
        os._exit(0)
    if reap:
        os.waitpid(pid, 0)
        continue
    while True:  # one child at a time: wait until the kernel reaped it
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.005)
print("done", flush=True)
"""
# backend id -> (run_batch backend, job config, delegate): the three ways a run gets cgroups here.
WITH_CGROUPS = {
    "namespaces": ("namespaces", {}, False),
    "bwrap-as-root": ("namespaces", {"backend": "bwrap"}, False),  # in this (root) process, forced
    "bwrap-delegated": ("bwrap", {}, True),  # an unprivileged user with a delegated subtree
}


@pytest.fixture(autouse=True)
def nothing_left(tmp_path, monkeypatch):
    """Control dirs of in-process runs go to a private dir; afterwards nothing of any run is left,
    and no run's cgroup either."""
    control = tmp_path / "control"
    control.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(control))
    yield
    end = time.monotonic() + 5
    while sandbox_processes() and time.monotonic() < end:
        time.sleep(0.05)
    assert sandbox_processes() == [], "sandbox processes were left running"
    assert list(control.iterdir()) == [], "sandbox control dirs were left behind"
    plan = sandbox.run_cgroups()
    for parent in set(plan["parents"].values()):
        assert [d for d in os.listdir(parent) if d.startswith("scalerl-run-")] == [], f"run cgroups left in {parent}"


def _run(way: str, jobs: list[dict]):
    backend, config, delegate = WITH_CGROUPS[way] if way in WITH_CGROUPS else (way, {}, False)
    jobs = [{**j, "limits": {**BUDGET, **j.get("limits", {})}, "config": {**config, **j.get("config", {})}} for j in jobs]
    return [res for res, _ in run_batch(backend, jobs, delegate=delegate)]


def _held_mib(result) -> int:
    lines = [ln for ln in result.stdout.split() if ln.isdigit()]
    return int(lines[-1]) if lines else 0


@pytest.mark.parametrize("way", sorted(WITH_CGROUPS))
def test_a_run_is_held_to_its_cgroup_budgets(way):
    """On this machine's real cgroups (v1: memory, cpuacct, pids): memfd pages and SysV shared
    memory (which RLIMIT_AS does not see: one run held 2,514 MiB through memfd, one process 3 GiB
    of shm against 512 MiB) stop at the run's memory budget, and the CPU of auto-reaped children
    (6.0 s burned against a 2 s budget with 0.02 s reported) is counted and stopped."""
    memfd, shm, sigchld = _run(way, [{"code": MEMFD, "limits": MEMFD_LIMITS}, {"code": SYSV_SHM}, {"code": IGNORED_SIGCHLD}])
    version = f"v{sandbox.run_cgroups()['version']}"
    for name, res in (("memfd", memfd), ("shm", shm)):
        assert res.cgroup == version and not res.ok, (name, res)
        assert _held_mib(res) * MiB <= RUN_MEMORY, (name, _held_mib(res), res.stderr[-500:])
        assert res.memory_peak_bytes is not None and res.memory_peak_bytes <= RUN_MEMORY, (name, res.memory_peak_bytes)
    assert sigchld.cgroup == version and "ignoring" in sigchld.stdout, sigchld
    assert sigchld.cpu_limit and "done" not in sigchld.stdout and sigchld.cpu_s >= 2.0, sigchld


def test_the_run_cgroups_on_this_machines_hierarchies():
    """`_sandbox_cgroup.make_run` on the real hierarchies (v1 here): the memory limit without
    swap, pids.max, the CPU of a process that joined and the memory it touched; `remove_run`
    kills what is left and removes every dir."""
    import signal

    plan = sandbox.run_cgroups()
    assert plan["version"], plan["reason"]
    run = sandbox.CGROUP.make_run({**plan, "memory_max": 200 * MiB, "pids_max": 5}, f"scalerl-run-test-{os.getpid()}")
    try:
        memory, pids = run["dirs"]["memory"], run["dirs"]["pids"]
        limit = "memory.max" if plan["version"] == 2 else "memory.limit_in_bytes"
        assert open(os.path.join(memory, limit)).read().split() == [str(200 * MiB)]
        assert open(os.path.join(pids, "pids.max")).read().split() == ["5"]
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # join, touch 32 MiB, spin 0.5 s of CPU, say so, wait to be killed
            sandbox.CGROUP.join(run)
            held = b"x" * (32 * MiB)  # every page written
            stop = time.process_time() + 0.5
            while time.process_time() < stop:
                len(held)
            os.write(w, b"x")
            time.sleep(60)
            os._exit(0)
        os.close(w)
        assert os.read(r, 1) == b"x"
        os.close(r)
        from components.tasks import _sandbox_supervisor

        assert _sandbox_supervisor.cgroup_cpu_seconds(run["cpu_fd"]) >= 0.5
        assert 32 * MiB <= sandbox.CGROUP.memory_peak(run) <= 200 * MiB
    finally:
        sandbox.CGROUP.close_run(run)
    assert os.waitpid(pid, 0)[1] == signal.SIGKILL  # killed by remove_run
    assert not any(os.path.exists(d) for d in run["dirs"].values())


def _no_cgroup(monkeypatch):
    monkeypatch.setattr(sandbox, "_cgroups", {"version": None, "parents": {}, "reason": "test: none", "create": [],
                                              "enable": []})


FALLBACK_PROBE = r"""
import ctypes, errno, json, os, signal
libc = ctypes.CDLL(None, use_errno=True)
out = {}
for name, call in (("shmget", lambda: libc.shmget(0, 1 << 20, 0o1600)), ("msgget", lambda: libc.msgget(0, 0o1600)),
                   ("semget", lambda: libc.semget(0, 1, 0o1600)),
                   ("memfd_create", lambda: libc.memfd_create(b"x", 0))):
    out[name] = errno.errorcode.get(ctypes.get_errno()) if call() < 0 else "created"
try:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    out["ignore_sigchld"] = "ignored"
except OSError as err:
    out["ignore_sigchld"] = errno.errorcode.get(err.errno)
old = ctypes.create_string_buffer(256)  # struct sigaction, with room to spare
out["sigchld_query"] = "ok" if libc.sigaction(signal.SIGCHLD, None, old) == 0 else errno.errorcode.get(ctypes.get_errno())
out["oom_score_adj"] = open("/proc/self/oom_score_adj").read().strip()
try:
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("0")
    out["lower_oom"] = "lowered"
except OSError as err:
    out["lower_oom"] = "refused"
tmpfs = []
for line in open("/proc/self/mountinfo"):
    left, _, right = line.partition(" - ")
    fstype, _, options = right.split()[:3]
    if fstype == "tmpfs":
        mount_opts = left.split()[5].split(",")
        size = next((o[5:] for o in options.split(",") if o.startswith("size=")), None)
        tmpfs.append([left.split()[4], "ro" in mount_opts, size])
out["tmpfs"] = tmpfs
print(json.dumps(out))
"""


def _size_bytes(size: str) -> int:
    units = {"k": 2**10, "m": 2**20, "g": 2**30}
    return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)


@pytest.mark.parametrize("backend", ["namespaces", "bwrap"])
def test_without_a_cgroup_what_no_rlimit_counts_is_refused(backend, monkeypatch):
    """No cgroup (namespaces: none decided; bubblewrap: an unprivileged user without delegation,
    a plain Slurm job): SysV shared memory, message queues, semaphores and memfd_create fail with
    EPERM, and so does a new SIGCHLD disposition (asking for it still works); the processes have
    oom_score_adj 1000 and cannot lower it; every writable tmpfs is sized (no bigger than /tmp's
    tmpfs_bytes); and the sequential children of IGNORED_SIGCHLD are counted, since it must
    reap them now."""
    _no_cgroup(monkeypatch)
    probe, sigchld = _run(backend, [{"code": FALLBACK_PROBE}, {"code": IGNORED_SIGCHLD}])
    assert probe.cgroup is None and sigchld.cgroup is None
    out = json.loads(probe.stdout)
    assert {k: out[k] for k in ("shmget", "msgget", "semget", "memfd_create", "ignore_sigchld")} == {
        "shmget": "EPERM", "msgget": "EPERM", "semget": "EPERM", "memfd_create": "EPERM", "ignore_sigchld": "EPERM"}, out
    assert out["sigchld_query"] == "ok" and out["oom_score_adj"] == "1000" and out["lower_oom"] == "refused", out
    writable = [(path, size) for path, ro, size in out["tmpfs"] if not ro]
    assert writable and all(size and _size_bytes(size) <= BUDGET["tmpfs_bytes"] for _, size in writable), out["tmpfs"]
    assert "refused" in sigchld.stdout and sigchld.cpu_limit and "done" not in sigchld.stdout, sigchld


# max_processes processes each take what RLIMIT_AS lets it have, all at once, and /tmp is filled.
HOLD_ALL = r"""
import os, time
def biggest():
    size = 128 << 20
    while size > 0:
        try:
            return b"x" * size, size  # every page written: resident
        except MemoryError:
            size -= 4 << 20
    return None, 0
r, w = os.pipe()
for _ in range(3):
    if os.fork() == 0:
        held, size = biggest()
        os.write(w, f"{size:12d}".encode())
        time.sleep(30)  # holding it until the run ends
        os._exit(0)
held, mine = biggest()
sizes = [mine] + [int(os.read(r, 12)) for _ in range(3)]
with open("/tmp/fill", "wb") as f:
    tmp = 0
    try:
        while True:
            f.write(b"x" * (1 << 20)); f.flush(); tmp += 1 << 20
    except OSError:
        pass
print(sum(sizes) + tmp)
"""


# One process queues what it can, on every descriptor it may open: a few pipes, then socketpairs,
# each asking for a bigger buffer (1 MiB for a pipe, 1 GiB for a socket).
BUFFERS = r"""
import fcntl, os, socket
held, keep = 0, []
def fill(send):
    global held
    try:
        while True:
            held += send(b"x" * 65536)
    except BlockingIOError:
        pass
def socketpair():
    pair = socket.socketpair()
    keep.append(pair)
    for s in pair:
        s.setblocking(False)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 30)
        except OSError:
            pass
        fill(s.send)
def pipe():
    r, w = os.pipe()
    keep.append((r, w))
    try:
        fcntl.fcntl(w, 1031, 1 << 20)  # F_SETPIPE_SZ
    except OSError:
        pass
    os.set_blocking(w, False)
    fill(lambda data: os.write(w, data))
try:
    for _ in range(4):  # pipes hold less (64 KiB each, when a bigger one is refused) than sockets:
        pipe()          # a few, then sockets on every descriptor left
    while True:
        socketpair()
except OSError:  # out of descriptors
    pass
print(held)
"""


def test_without_a_cgroup_what_a_run_can_hold_is_what_the_warning_says(monkeypatch):
    """The warning's bound, measured (bubblewrap, an unprivileged user without a cgroup): four
    processes of a run hold several times its memory_mb together (RLIMIT_AS is per process), plus
    its /tmp; no more than max_processes x memory_mb + tmpfs_mb. One process holds at most about
    0.25 MiB of socket and pipe buffers per descriptor it may open (455 MiB with 64 descriptors,
    before socket buffers above the default were refused)."""
    limits = {"memory_bytes": 128 * MiB, "tmpfs_bytes": 16 * MiB, "max_processes": 4, "cpu_seconds": 5,
              "wall_seconds": 20}
    res, buffers = _run("bwrap", [{"code": HOLD_ALL, "limits": limits}, {"code": BUFFERS, "limits": limits}])
    held, queued = int(res.stdout.split()[-1]), int(buffers.stdout.split()[-1])
    print(f"held {held / MiB:.0f} MiB at once with memory_mb 128, max_processes 4, tmpfs_mb 16; "
          f"one process queued {queued / MiB:.1f} MiB in socket and pipe buffers with {BUDGET['max_open_files']} descriptors")
    assert 2 * limits["memory_bytes"] < held <= 4 * limits["memory_bytes"] + limits["tmpfs_bytes"], held
    assert 0 < queued <= 0.25 * MiB * BUDGET["max_open_files"], queued
    _no_cgroup(monkeypatch)
    risk = sandbox.residual_memory_risk()
    assert "(test: none)" in risk and "max_processes x memory_mb" in risk and "tmpfs_mb" in risk, risk
    assert "about 0.25 MiB per descriptor" in risk, risk
    assert "SysV shared memory, message queues, semaphores, memfd and socket or pipe buffers above the default are refused" in risk, risk
