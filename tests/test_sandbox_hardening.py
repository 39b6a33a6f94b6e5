"""The sandbox's hardening, each protection under both backends (the bubblewrap one as an unprivileged user).

Every test here runs a hostile program that would succeed without the protection it is
named after: a process that SIGSTOPs the cleanup, a look at the host's processes, user
namespace creation, ptrace, mount, a setuid binary, the system calls the seccomp filter
denies; and the output cap's edge. CI runs as root; the bubblewrap runs go through
`_helpers_sandbox.run_batch`, which grades as an unprivileged user.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import tempfile
import time

import pytest

from _helpers_sandbox import BACKENDS, RUNNER_MARK, UID_BASE, USER_UID, processes, run_batch, sandbox_processes
from components.tasks import sandbox
from components.tasks.sandbox import SandboxConfig, SandboxUnavailableError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the hardening tests need root (CI runs as root)")

QUICK = {"cpu_seconds": 2, "wall_seconds": 10, "memory_bytes": 256 * 2**20, "max_processes": 8, "output_bytes": 64 * 1024}
# x86_64 / aarch64 system call numbers used by the programs below.
NR = {
    "x86_64": {"clone": 56, "keyctl": 250, "clone3": 435, "socket": 41},
    "aarch64": {"clone": 220, "keyctl": 219, "clone3": 435, "socket": 198},
}[platform.machine()]


@pytest.fixture(autouse=True)
def nothing_left(tmp_path, monkeypatch):
    """Control dirs of in-process runs go to a private dir; afterwards nothing of any run is left."""
    control = tmp_path / "control"
    control.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(control))
    yield
    left = _wait_for_no(sandbox_processes, 5.0)
    for pid, _, _ in left:  # do not leave a spinning process behind a failed test
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert left == [], f"sandbox processes were left running: {left}"
    assert list(control.iterdir()) == [], "sandbox control dirs were left behind"


def _wait_for_no(find, seconds):
    end = time.monotonic() + seconds
    while True:
        found = find()
        if not found or time.monotonic() > end:
            return found
        time.sleep(0.05)


def _json(result):
    assert result.exit_code == 0 and result.error is None, (result.describe(), result.stderr[-2000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_one(backend, code, **job):
    [(result, seconds)] = run_batch(backend, [{"code": code, "limits": {**QUICK, **job.pop("limits", {})}, **job}])
    return result, seconds


# -- cleanup that nothing stops ---------------------------------------------------------------
STOP_EVERYTHING = r"""
import os, sys, time
# kill(-1) signals every process this uid may signal: in a tight loop it catches a cleanup
# helper in the moment after it switched to this uid and before it killed anything.
spin = "import os, signal\nwhile True:\n    try:\n        os.kill(-1, signal.SIGSTOP)\n    except OSError:\n        pass\n"
if os.fork() == 0:
    os.setsid()
    os.execv(sys.executable, [sys.executable, "-c", spin, "MARK"])
while True:
    time.sleep(1)
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_process_that_stops_everything_cannot_stop_the_cleanup(backend):
    """A child SIGSTOPs every process it can see, in a loop, and spins: the run times out on
    time, and afterwards no process of it is left (the old cleanup, running as the sandbox's
    uid, was stopped too, and the spinner ran forever)."""
    mark = f"scalerl-stop-everything-{os.getpid()}-{backend}"
    result, seconds = run_one(backend, STOP_EVERYTHING.replace("MARK", mark), limits={"wall_seconds": 2, "cpu_seconds": 30})
    assert result.timed_out and not result.ok and result.error is None, result
    assert seconds < 2 + 6, f"the grading call took {seconds:.1f} s"
    assert _wait_for_no(lambda: processes(lambda uid, cmd: mark in cmd), 3.0) == []


# -- PID namespace ----------------------------------------------------------------------------
PROC_VIEW = r"""
import json, os
cmds = {}
for p in os.listdir("/proc"):
    if p.isdigit():
        try:
            cmds[p] = open(f"/proc/{p}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except OSError as err:
            cmds[p] = f"unreadable: {err}"
print(json.dumps(cmds))
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_proc_shows_only_the_sandbox(backend):
    """/proc inside lists the run's own few processes: the grader's command line (pytest, or
    the runner of the unprivileged user) and the host's init are not there."""
    cmds = _json(run_one(backend, PROC_VIEW)[0])
    assert 1 <= len(cmds) <= 3, cmds
    joined = " ".join(cmds.values())
    assert "pytest" not in joined and RUNNER_MARK not in joined, cmds
    assert any("main.py" in c for c in cmds.values()), cmds


PID1_FDS = r"""
import json, os, sys
out = {}
for fd in (0, 1, 2):
    try:
        mode = "r" if fd == 0 else "a"
        with open(f"/proc/1/fd/{fd}", mode) as f:
            out[fd] = f.read() if fd == 0 else (f.write("forged\n") and "written")
    except OSError as err:
        out[fd] = type(err).__name__
print(json.dumps(out))
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_pid_1_holds_nothing_the_program_can_read(backend):
    """The namespace's init (pid 1) holds the run's stdin / stdout / stderr; the program, of the
    same uid under bubblewrap, must not reach them through /proc/1/fd. Bubblewrap's own init is
    dumpable, so before the supervisor became pid 1 (``--as-pid-1``) this program read its
    input back and appended to its own output through it."""
    result, _ = run_one(backend, PID1_FDS, stdin="secret-spec\n")
    out = _json(result)
    assert "secret-spec" not in result.stdout and "forged" not in result.stdout + result.stderr, out
    assert all(out[str(fd)] in ("PermissionError", "FileNotFoundError") for fd in (0, 1, 2)), out


# -- namespaces, ptrace, mount, setuid, seccomp -----------------------------------------------
USERNS = r"""
import ctypes, json, os, subprocess
libc = ctypes.CDLL(None, use_errno=True)
out = {}
pid = os.fork()
if pid == 0:
    os._exit(0 if libc.unshare(0x10000000) == 0 else ctypes.get_errno())  # CLONE_NEWUSER
out["unshare"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
r = libc.syscall(NR_CLONE, 0x10000000 | 17, 0, 0, 0, 0)  # clone(CLONE_NEWUSER | SIGCHLD), fork-like
if r == 0:
    os._exit(0)
out["clone"] = ctypes.get_errno() if r < 0 else "created"
if r > 0:
    os.waitpid(r, 0)
out["unshare_command"] = subprocess.run(["unshare", "--user", "true"], capture_output=True).returncode
print(json.dumps(out))
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_user_namespaces_cannot_be_created(backend):
    out = _json(run_one(backend, USERNS.replace("NR_CLONE", str(NR["clone"])))[0])
    assert out == {"unshare": 1, "clone": 1, "unshare_command": 1}, out  # EPERM, EPERM, unshare(1) fails


PTRACE = r"""
import ctypes, json, os, time
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
class IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
secret = ctypes.create_string_buffer(b"secret!")
child = os.fork()
if child == 0:
    time.sleep(30)
    os._exit(0)
out = {}
r = libc.ptrace(16, child, None, None)  # PTRACE_ATTACH to our own child
out["attach_child"] = ctypes.get_errno() if r < 0 else "attached"
if r == 0:
    libc.ptrace(17, child, None, None)
sibling = os.fork()
if sibling == 0:
    os._exit(0 if libc.ptrace(16, child, None, None) == 0 else ctypes.get_errno())
out["attach_sibling"] = os.waitstatus_to_exitcode(os.waitpid(sibling, 0)[1])
buf = ctypes.create_string_buffer(8)
local = IOVec(ctypes.cast(buf, ctypes.c_void_p), 8)
remote = IOVec(ctypes.cast(secret, ctypes.c_void_p), 8)  # the same address in the forked child
n = libc.process_vm_readv(child, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
out["process_vm_readv"] = ctypes.get_errno() if n < 0 else buf.value.decode()
os.kill(child, 9)
os.waitpid(child, 0)
print(json.dumps(out))
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_ptrace_and_process_memory_access_fail(backend):
    """Neither its own child nor a sibling can be traced, nor its memory read (all allowed
    to a process of the same uid without the filter)."""
    out = _json(run_one(backend, PTRACE)[0])
    assert out == {"attach_child": 1, "attach_sibling": 1, "process_vm_readv": 1}, out


MOUNT = r"""
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
os.mkdir("m")
out = {}
pid = os.fork()
if pid == 0:  # with a user namespace of its own, mounting would be allowed
    libc.unshare(0x10000000 | 0x00020000)  # CLONE_NEWUSER | CLONE_NEWNS
    os._exit(0 if libc.mount(b"tmpfs", b"m", b"tmpfs", 0, None) == 0 else ctypes.get_errno())
out["mount_in_own_namespace"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
r = libc.mount(b"tmpfs", b"m", b"tmpfs", 0, None)
out["mount"] = ctypes.get_errno() if r < 0 else "mounted"
print(json.dumps(out))
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_mount_fails(backend):
    out = _json(run_one(backend, MOUNT)[0])
    assert out == {"mount_in_own_namespace": 1, "mount": 1}, out  # EPERM both ways


@pytest.fixture
def setuid_id():
    """A setuid-root copy of id(1) in a world-readable dir outside /tmp: it prints euid=0 when it works."""
    d = tempfile.mkdtemp(prefix="scalerl-setuid-test-", dir="/")
    os.chmod(d, 0o755)
    path = os.path.join(d, "id")
    shutil.copy(shutil.which("id"), path)
    os.chown(path, 0, 0)
    os.chmod(path, 0o4755)
    yield path
    shutil.rmtree(d)


SETUID = r"""
import json, subprocess
status = dict(l.split(":", 1) for l in open("/proc/self/status") if ":" in l)
out = {"id": subprocess.run(["PATH"], capture_output=True, text=True).stdout.strip(),
       "no_new_privs": status["NoNewPrivs"].strip()}
print(json.dumps(out))
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_setuid_binaries_give_no_privileges(backend, setuid_id):
    # the view is an allow-list: the binary's dir is allowed explicitly
    out = _json(run_one(backend, SETUID.replace("PATH", setuid_id), config={"allow_paths": [os.path.dirname(setuid_id)]})[0])
    assert out["id"].startswith("uid=") and "euid=0" not in out["id"] and not out["id"].startswith("uid=0"), out
    assert out["no_new_privs"] == "1", out


SECCOMP = r"""
import ctypes, json, os, signal, subprocess, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
status = dict(l.split(":", 1) for l in open("/proc/self/status") if ":" in l)
out = {"seccomp_mode": status["Seccomp"].strip()}
r = libc.syscall(NR_KEYCTL, 0, -3, 0)  # keyctl(KEYCTL_GET_KEYRING_ID, session keyring): allowed to anyone
out["keyctl"] = ctypes.get_errno() if r < 0 else "allowed"
r = libc.syscall(NR_CLONE3, None, 0)  # without the filter: EINVAL / EFAULT
out["clone3"] = ctypes.get_errno() if r < 0 else "allowed"
# What the grading harness does must keep working: threads, fork / exec / pipes / wait,
# killing its own children, prctl(PR_SET_DUMPABLE, 0), subprocess.
ok = []
t = threading.Thread(target=lambda: ok.append("thread"))
t.start(); t.join()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    os.write(w, b"pipe")
    os._exit(7)
os.close(w)
ok.append(os.read(r, 10).decode())
ok.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
sleeper.kill()
ok.append(sleeper.wait())
ok.append(libc.prctl(4, 0, 0, 0, 0))  # PR_SET_DUMPABLE
ok.append(subprocess.run([sys.executable, "-c", "print('child')"], capture_output=True, text=True).stdout.strip())
out["harness"] = ok
print(json.dumps(out))
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_seccomp_filter_denies_and_harness_operations_work(backend):
    """The filter is on (mode 2), denies keyctl (EPERM) and clone3 (ENOSYS, so that the C
    library falls back to clone, whose namespace flags it checks), and leaves everything the
    grading harness does working."""
    code = SECCOMP.replace("NR_KEYCTL", str(NR["keyctl"])).replace("NR_CLONE3", str(NR["clone3"]))
    out = _json(run_one(backend, code)[0])
    assert out == {
        "seccomp_mode": "2",
        "keyctl": 1,
        "clone3": 38,
        "harness": ["thread", "pipe", 7, -signal.SIGKILL, 0, "child"],
    }, out


SOCKETS = r"""
import ctypes, errno, json, socket
libc = ctypes.CDLL(None, use_errno=True)
out = {}
for name, family, kind in (("AF_UNIX", 1, socket.SOCK_STREAM), ("AF_INET", 2, socket.SOCK_STREAM),
                           ("AF_INET6", 10, socket.SOCK_DGRAM), ("AF_NETLINK", 16, socket.SOCK_RAW),
                           ("AF_PACKET", 17, socket.SOCK_DGRAM), ("AF_ALG", 38, socket.SOCK_SEQPACKET),
                           ("AF_VSOCK", 40, socket.SOCK_STREAM), ("AF_XDP", 44, socket.SOCK_RAW),
                           ("family_63", 63, socket.SOCK_STREAM)):
    try:
        socket.socket(family, kind).close()
        out[name] = "created"
    except OSError as err:
        out[name] = errno.errorcode.get(err.errno, err.errno)
r = libc.syscall(NR_SOCKET, ctypes.c_long(0x100000000 + 40), 1, 0)  # AF_VSOCK, high bits the kernel drops
out["vsock_high_bits"] = "created" if r >= 0 else errno.errorcode.get(ctypes.get_errno())
a, b = socket.socketpair()
a.sendall(b"x")
out["socketpair_unix"] = b.recv(1).decode()
fds = (ctypes.c_int * 2)()
out["socketpair_netlink"] = "created" if libc.socketpair(16, 3, 0, fds) == 0 else errno.errorcode.get(ctypes.get_errno())
print(json.dumps(out))
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_sockets_are_an_allow_list_of_families(backend):
    """AF_UNIX, AF_INET and AF_INET6 (inside the empty network namespace) can be created; every
    other family fails with EAFNOSUPPORT. AF_VSOCK is not covered by the network namespace (on a
    VM its binds shared the host's port space), and AF_NETLINK / AF_ALG sockets were created
    before the filter listed the allowed families."""
    out = _json(run_one(backend, SOCKETS.replace("NR_SOCKET", str(NR["socket"])))[0])
    assert out == {
        "AF_UNIX": "created", "AF_INET": "created", "AF_INET6": "created",
        "AF_NETLINK": "EAFNOSUPPORT", "AF_PACKET": "EAFNOSUPPORT", "AF_ALG": "EAFNOSUPPORT",
        "AF_VSOCK": "EAFNOSUPPORT", "AF_XDP": "EAFNOSUPPORT", "family_63": "EAFNOSUPPORT",
        "vsock_high_bits": "EAFNOSUPPORT", "socketpair_unix": "x", "socketpair_netlink": "EAFNOSUPPORT",
    }, out


# -- the grader's home ------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_graders_home_is_hidden(backend, monkeypatch):
    """$HOME (where a cluster user keeps keys and tokens) is covered, not merely unreadable:
    under bubblewrap the program runs as that very user, so only the covering protects it."""
    home = tempfile.mkdtemp(prefix="scalerl-home-test-", dir="/")
    try:
        secret = os.path.join(home, "token.txt")
        with open(secret, "w") as f:
            f.write("HOME-SECRET")
        os.chmod(secret, 0o644)
        os.chmod(home, 0o755)
        if backend == "bwrap":  # the unprivileged user's own, private home
            os.chown(home, USER_UID, USER_UID)
            os.chown(secret, USER_UID, USER_UID)
            os.chmod(home, 0o700)
        monkeypatch.setenv("HOME", home)  # the in-process grader's home
        [(res, _)] = run_batch(backend, [{"code": f"print(open({secret!r}).read())", "limits": QUICK}], home=home)
        assert not res.ok and "FileNotFoundError" in res.stderr and "HOME-SECRET" not in res.stdout, res
    finally:
        shutil.rmtree(home)


# -- host paths no program needs, /dev ---------------------------------------------------------
HOST_PATHS = r"""
import json, os
out = {}
for path in ("/var/spool", "/srv", "/etc/munge", "/var/lib/munge", "/mnt", "/media", "/var/log"):
    try:
        out[path] = sorted(os.listdir(path))
    except OSError as err:
        out[path] = type(err).__name__
try:
    out["srv_file"] = open("SRV_FILE").read()
except OSError as err:
    out["srv_file"] = type(err).__name__
try:
    with open("/dev/filler", "wb") as f:
        f.write(b"x" * 4096)
    out["dev_write"] = "written"
except OSError as err:
    out["dev_write"] = type(err).__name__
with open("/dev/null", "w") as f:
    out["dev_null"] = f.write("ok")
print(json.dumps(out))
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_host_paths_a_program_does_not_need_are_hidden_and_dev_is_read_only(backend):
    """Slurm's spool (slurmstepd's sockets: `scontrol listpids` of other jobs), munge, /srv,
    /mnt, /media and /var/log are empty; /dev takes no files (bubblewrap's /dev was a writable
    tmpfs bounded only by half the RAM), while its device nodes work."""
    d = tempfile.mkdtemp(prefix="scalerl-srv-test-", dir="/srv") if os.path.isdir("/srv") else None
    try:
        code = HOST_PATHS
        if d is not None:
            os.chmod(d, 0o755)
            with open(os.path.join(d, "data.txt"), "w") as f:
                f.write("SITE-DATA")
            os.chmod(os.path.join(d, "data.txt"), 0o644)
            code = code.replace("SRV_FILE", os.path.join(d, "data.txt"))
        out = _json(run_one(backend, code)[0])
    finally:
        if d is not None:
            shutil.rmtree(d)
    for path in ("/var/spool", "/srv", "/etc/munge", "/var/lib/munge", "/mnt", "/media", "/var/log"):
        assert out[path] in ([], "FileNotFoundError"), (path, out[path])
    assert out["srv_file"] == "FileNotFoundError" and out["dev_null"] == 2, out
    assert out["dev_write"] in ("OSError", "PermissionError"), out


# -- output cap -------------------------------------------------------------------------------
CAP = 4096


@pytest.mark.parametrize("backend", BACKENDS)
def test_output_exactly_at_the_cap_is_allowed_one_more_byte_is_not(backend):
    write = "import sys\nsys.stdout.write('o' * {out})\nsys.stdout.flush()\nsys.stderr.write('e' * {err})\n"
    limits = {**QUICK, "output_bytes": CAP}
    jobs = [{"code": write.format(out=o, err=e), "limits": limits} for o, e in ((CAP, CAP), (CAP + 1, 0), (0, CAP + 1))]
    (exact, _), (over_out, _), (over_err, _) = run_batch(backend, jobs)
    assert exact.ok and not exact.output_limit and len(exact.stdout) == CAP and len(exact.stderr) == CAP, exact
    for over in (over_out, over_err):
        assert over.output_limit and not over.ok, over
    assert len(over_out.stdout) == CAP


# -- backends -----------------------------------------------------------------------------------
def test_other_runs_control_dirs_are_hidden(monkeypatch):
    """The program must not see the temp dir that holds every run's control dir: a queued run's
    dir holds its harness spec (test code, MAC key) and program, which a program of the same
    user (bubblewrap, with TMPDIR outside /tmp, as on many clusters) could read or rewrite.
    Only the run's own dir was covered; the spec now covers the temp dir itself."""
    seen = []
    launch = sandbox._launch

    def spy(control, *args):
        with open(os.path.join(control, "spec.json")) as f:
            seen.append(json.load(f)["hide_paths"])
        return launch(control, *args)

    monkeypatch.setattr(sandbox, "_launch", spy)
    res = sandbox.run_python("print('ok')", limits=sandbox.SandboxLimits(**QUICK),
                             config=SandboxConfig(uid_base=UID_BASE, backend="namespaces"))
    assert res.ok and res.stdout == "ok\n", res.describe()
    assert os.path.realpath(tempfile.gettempdir()) in seen[0], seen


def test_backend_choice_and_bad_backend():
    """Root picks the namespaces backend, a user that is not root bubblewrap (or a refusal
    naming it when it does not work); an unknown backend is refused with the valid ones."""
    with pytest.raises(ValueError, match=r"unknown sandbox backend 'docker'; valid backends: auto, namespaces, bwrap"):
        SandboxConfig(backend="docker")
    real = sandbox.probe()
    caps = lambda **kw: {**real, **kw}
    assert sandbox.choose_backend(SandboxConfig(), caps()) == "namespaces"
    assert sandbox.choose_backend(SandboxConfig(), caps(euid=1000)) == "bwrap"
    assert sandbox.choose_backend(SandboxConfig(backend="bwrap"), caps()) == "bwrap"
    original = sandbox.probe
    try:
        sandbox.probe = lambda: caps(euid=1000, bwrap=None, bwrap_error="bwrap not found")
        with pytest.raises(SandboxUnavailableError, match="not running as root.*bubblewrap is not usable.*bwrap not found"):
            sandbox.isolation_plan(SandboxConfig())
        with pytest.raises(SandboxUnavailableError, match="bwrap sandbox backend is not usable here: bwrap not found"):
            sandbox.isolation_plan(SandboxConfig(backend="bwrap"))
    finally:
        sandbox.probe = original


def test_bwrap_forced_as_root_runs_as_the_per_run_uid(tmp_path):
    """Forced as root, bubblewrap never runs as root: the program has the run's own uid and
    cannot read a root-only file outside the hidden paths."""
    d = tempfile.mkdtemp(prefix="scalerl-bwrap-root-test-", dir="/")
    try:
        os.chmod(d, 0o755)
        secret = os.path.join(d, "secret")
        with open(secret, "w") as f:
            f.write("TOP-SECRET")
        os.chmod(secret, 0o600)
        code = f"import os\nprint(os.getuid())\nprint(open({secret!r}).read())\n"
        res = sandbox.run_python(code, config=SandboxConfig(backend="bwrap", uid_base=UID_BASE, allow_paths=(d,)),
                                 limits=sandbox.SandboxLimits(**QUICK))
        assert int(res.stdout.split()[0]) >= UID_BASE and "PermissionError" in res.stderr and "TOP-SECRET" not in res.stdout, res
    finally:
        shutil.rmtree(d)


# -- the filesystem view is an allow-list --------------------------------------------------------
VIEW = r"""
import json, os
out = {"root": sorted(os.listdir("/")), "etc": sorted(os.listdir("/etc"))}
for path in PATHS:
    try:
        out[path] = sorted(os.listdir(path))
    except OSError as err:
        out[path] = type(err).__name__
print(json.dumps(out))
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_filesystem_view_is_an_allow_list(backend):
    """Listing / shows only the allow-listed entries (the interpreter's /usr and the links to
    it, the few files of /etc the dynamic linker and Python read, a minimal /dev, the run's
    /proc and /tmp); the repository, /root, /home, /var (Slurm's spool, munge), /srv, /opt,
    /mnt and /run do not exist inside (the deny-list covered a few of them and showed the rest
    of the host read-only)."""
    paths = [sandbox.REPO_ROOT, "/root", "/home", "/var/spool", "/var", "/srv", "/opt", "/mnt", "/run", "/boot"]
    out = _json(run_one(backend, VIEW.replace("PATHS", repr(paths)))[0])
    python = sandbox.find_python(SandboxConfig(hide_repo=False), need_world_executable=True)
    tops = {p.strip("/").split("/")[0] for p in sandbox.allowed_paths(SandboxConfig(), python)}
    allowed = ({"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc", "dev", "proc", "tmp"} | tops) - {""}
    assert set(out["root"]) <= allowed and {"usr", "dev", "proc", "tmp"} <= set(out["root"]), out["root"]
    assert set(out["etc"]) <= {"ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime"} | {
        p.split("/")[2] for p in sandbox.allowed_paths(SandboxConfig(), python) if p.startswith("/etc/")}, out["etc"]
    for path in paths:
        assert out[path] == "FileNotFoundError", (path, out[path])


# -- one CPU budget per run ----------------------------------------------------------------------
FORK_CHAIN = r"""
import os, time
def spin(t):
    end = time.process_time() + t
    while time.process_time() < end:
        pass
for link in range(8):  # each process spends 0.6 s (under its own RLIMIT_CPU of 2 s), forks the next, waits
    spin(0.6)
    pid = os.fork()
    if pid:
        os.waitpid(pid, 0)
        os._exit(0)
print("chain done", flush=True)
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_fork_chain_cannot_outrun_the_runs_cpu_budget(backend):
    """RLIMIT_CPU is per process: a chain of 8 forks, each spending 0.6 s, spent 4.8 s of CPU
    against a 2 s limit and finished. The sandbox's supervisor counts one budget for all the
    run's processes, reaped ones included, kills the run and reports it over its CPU budget."""
    result, seconds = run_one(backend, FORK_CHAIN, limits={"cpu_seconds": 2, "wall_seconds": 20})
    assert result.cpu_limit and not result.ok and result.describe() == "CPU time limit", result
    assert "chain done" not in result.stdout and 2.0 <= result.cpu_s < 3.5, result


# -- issue 44: loopback, the read-only dir, the OOM killer's choice -------------------------------
LOOPBACK = r"""
import json, socket
out = {}
try:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    client = socket.create_connection(server.getsockname(), timeout=2)
    client.setblocking(False)
    queued = 0
    try:
        while queued < (64 << 20):
            queued += client.send(b"x" * 65536)
    except BlockingIOError:
        pass
    out["queued_mib"] = queued >> 20
except OSError as err:
    out["error"] = err.strerror
print(json.dumps(out))
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_loopback_is_down_so_no_socket_buffers_pile_up_on_it(backend):
    """The run's network namespace has its loopback down under both backends: a TCP connection
    to the program's own listener fails. Under bubblewrap the loopback was up (its --unshare-net
    brings it up): one process queued 300 MiB in loopback socket buffers, host memory no budget
    counted (this one connection queued 3 MiB)."""
    out = _json(run_one(backend, LOOPBACK)[0])
    assert "queued_mib" not in out and out["error"] in ("Cannot assign requested address", "Network is unreachable"), out


READONLY = r"""
import json, os
out = {"owner_uid": os.stat("../readonly").st_uid, "me": os.getuid()}
for name, act in (("write", lambda: open("../readonly/main.py", "w").write("x")),
                  ("append", lambda: open("../readonly/helper.py", "a").write("x")),
                  ("create", lambda: open("../readonly/new.py", "w").write("x")),
                  ("unlink", lambda: os.unlink("../readonly/helper.py")),
                  ("rename_file", lambda: os.rename("../readonly/helper.py", "../readonly/x.py")),
                  ("rename_dir", lambda: os.rename("../readonly", "../elsewhere")),
                  ("chmod", lambda: os.chmod("../readonly/helper.py", 0o777)),
                  ("write_own_dir", lambda: open("notes.txt", "w").write("x"))):
    try:
        act()
        out[name] = "done"
    except OSError as err:
        out[name] = type(err).__name__
out["helper"] = open("../readonly/helper.py").read()
print(json.dumps(out))
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_readonly_dir_cannot_be_changed(backend):
    """`run_python`'s readonly_files (the grading harness) lie beside the working dir in a dir no
    process of the run can change: root's under `namespaces`, a read-only mount under both (the
    program could rewrite the harness's main.py in its working dir before). The working dir
    stays the program's."""
    out = _json(run_one(backend, READONLY, readonly_files={"helper.py": "HELPER"})[0])
    assert all(out[k] not in ("done", None) for k in ("write", "append", "create", "unlink", "rename_file",
                                                      "rename_dir", "chmod")), out
    assert out["write_own_dir"] == "done" and out["helper"] == "HELPER", out
    if backend == "namespaces":
        assert out["owner_uid"] == 0 != out["me"], out  # not its own dir


OOM = r"""
import json, os
out = {"self": open("/proc/self/oom_score_adj").read().strip()}
try:
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("0")
    out["lower"] = "lowered"
except OSError as err:
    out["lower"] = type(err).__name__
r, w = os.pipe()
if os.fork() == 0:
    os.write(w, open("/proc/self/oom_score_adj").read().strip().encode())
    os._exit(0)
os.wait()
out["child"] = os.read(r, 10).decode()
print(json.dumps(out))
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_runs_processes_are_the_oom_killers_first_choice(backend):
    """Every process of a run has oom_score_adj 1000 and cannot lower it (the run's /proc is
    read-only): where memory runs short, the OOM killer takes a sandboxed program, not the trainer."""
    out = _json(run_one(backend, OOM)[0])
    assert out["self"] == "1000" and out["child"] == "1000" and out["lower"] != "lowered", out
