"""Run untrusted programs (model-written code) in a sandbox.

Each run is its own process tree, started by `_sandbox_launcher.py` (see its docstring for
the order of operations). Two backends give the same protections; ``SandboxConfig.backend``
picks one (``"auto"``, the default: ``"namespaces"`` when this process is root, else
``"bwrap"`` when bubblewrap works here):

- **no network**: a new network namespace (only a loopback device, down);
- **a private PID namespace**: /proc lists only the run's own processes (host command lines
  are not readable), and killing the namespace's init kills every process of the run;
- **an unprivileged uid**: ``namespaces`` uses a fresh per-run uid/gid
  (``uid_base + launcher pid``) that cannot read the grader's files (root-owned, not
  world-readable) or signal other processes; ``bwrap`` runs as the calling user inside a
  new user namespace with no capabilities (as root it switches to the per-run uid first);
- **no-new-privileges** (setuid binaries give nothing) and a **seccomp filter**
  (`_sandbox_seccomp.DENIED`: namespace creation, ptrace and process_vm_*, mount and
  friends, keyrings, bpf, perf_event_open, io_uring, kexec and module loading, ...; sockets
  of any family but AF_UNIX / AF_INET / AF_INET6);
- **a private filesystem view, an allow-list**: a new mount namespace whose root holds only
  read-only binds of the allowed paths (`allowed_paths`: the interpreter, its standard library,
  the system libraries, a few files of /etc, ``SandboxConfig.allow_paths``), a minimal
  read-only /dev, the run's /proc and a fresh size-capped tmpfs /tmp holding the working dir
  /tmp/work and the read-only dir /tmp/readonly (``readonly_files``: the grading harness);
  hidden paths inside allowed dirs (the repository, the task's data) are covered.
  Nothing else of the host (homes, /var, /srv, /run, the repository) exists inside;
- **limits**: RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC, RLIMIT_FSIZE (caps stdout / stderr too:
  exactly ``output_bytes`` is allowed, one byte more is an output-limit failure),
  RLIMIT_NOFILE, no core dumps, a wall-clock timeout, oom_score_adj 1000; ONE CPU budget for
  all the run's processes (``run_cpu_seconds``) and, where a cgroup can be had (v2, or v1's
  memory, cpuacct and pids: `run_cgroups`), one memory limit and one process limit for all of
  them (``run_memory_bytes``, ``max_processes``; the run's own cgroups, which also count its
  CPU); else SysV IPC, memfd and new SIGCHLD dispositions are refused and
  `residual_memory_risk` says what bounds a run, logged once. Afterwards the launcher, from outside
  the run's uid, kills the namespace and anything of the run left anywhere; nothing
  outlives a run, and no process of the run can stop the cleanup;
- a scrubbed environment.

Where none of that can be set up (not root and no working bubblewrap, no namespaces),
`SandboxUnavailableError` is raised instead of running the program, unless the caller opts
out explicitly: ``allow_network=True`` (run without the network namespace) and / or
``allow_unsafe=True`` (run as the grader's own user / without the private filesystem view).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

LAUNCHER = str(Path(__file__).with_name("_sandbox_launcher.py"))
REPO_ROOT = str(Path(__file__).resolve().parents[2])
# World-writable places the program must not write to (covered by empty read-only mounts).
READONLY_EMPTY_DIRS = ("/var/tmp", "/dev/shm", "/run/lock", "/var/lock")
# Host paths no program needs (covered by empty read-only mounts): unix sockets, homes, Slurm's
# spool (slurmstepd's sockets), munge's key and socket, site data (/srv, /mnt, /media), logs.
DEFAULT_HIDDEN = ("/run", "/var/run", "/root", "/home", "/var/spool", "/srv", "/etc/munge", "/var/lib/munge",
                  "/var/log", "/mnt", "/media")
BACKENDS = ("auto", "namespaces", "bwrap")
# The run's read-only dir (`run_python`'s readonly_files), beside its working dir /tmp/work.
READONLY_DIR = "/tmp/readonly"
# The filesystem view is an allow-list: these host paths (read-only, where they exist), the
# interpreter's own prefixes and standard library (`interpreter_paths`), the program's argv[0]
# and `SandboxConfig.allow_paths`; plus a minimal /dev, the run's /proc and a private /tmp.
# Nothing else of the host exists inside: no /home, /root, /var, /srv, /run, /mnt, /opt, the
# repository, and of /etc only what the dynamic linker and the time module read.
DEFAULT_ALLOWED = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
                   "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime")


class SandboxUnavailableError(RuntimeError):
    """The sandbox cannot be set up here; programs are not run (unless explicitly opted out)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one run."""

    cpu_seconds: float = 2.0  # RLIMIT_CPU (rounded up to whole seconds, >= 1)
    wall_seconds: float = 5.0  # wall-clock timeout of the whole run
    memory_bytes: int = 512 * 2**20  # RLIMIT_AS
    max_processes: int = 32  # RLIMIT_NPROC of the run's own uid
    output_bytes: int = 4 * 2**20  # RLIMIT_FSIZE: stdout, stderr and any file written
    max_open_files: int = 64  # RLIMIT_NOFILE
    tmpfs_bytes: int = 64 * 2**20  # size of the private /tmp (the working dir lives there)
    # ONE CPU budget for all the run's processes together, reaped ones included (the run's
    # cgroup's CPU time, else the supervisor's sum); None: cpu_seconds. Whole seconds, >= 1.
    run_cpu_seconds: Optional[float] = None
    # ONE memory budget for all the run's processes together, page cache, memfd, shared memory
    # and tmpfs pages included: the memory limit of the run's own cgroup (swap off), where a
    # cgroup can be had (`run_cgroups`, v2 or v1); None: memory_bytes + tmpfs_bytes. The same
    # cgroups cap the run's processes at max_processes (pids.max, plus the sandbox's own few).
    # Without a cgroup only the per-process RLIMIT_AS and the tmpfs sizes hold (`residual_memory_risk`).
    run_memory_bytes: Optional[int] = None

    def run_cpu(self) -> float:
        return float(self.cpu_seconds if self.run_cpu_seconds is None else self.run_cpu_seconds)

    def run_memory(self) -> int:
        return int(self.memory_bytes + self.tmpfs_bytes if self.run_memory_bytes is None else self.run_memory_bytes)


@dataclass(frozen=True)
class SandboxConfig:
    """How to isolate.

    Args:
        python: interpreter used for Python programs (must be executable by an unprivileged
            user); default: the first of this Python's base interpreter, /usr/bin/python3,
            /usr/local/bin/python3 that is.
        hide_paths: extra files / directories the program must not see (e.g. the test data).
        hide_repo: also hide this repository.
        allow_network: run even where no network namespace can be created (opt-out).
        allow_unsafe: run even where privileges cannot be dropped or no private filesystem
            view can be made (opt-out: the program could then read the grader's files).
        uid_base: runs use uid = gid = uid_base + launcher pid (pids are below 2**22), a
            range no real account uses; a uid that names an account is refused.
        backend: ``"auto"`` (root: ``"namespaces"``; otherwise ``"bwrap"`` where bubblewrap
            works), ``"namespaces"`` (needs root) or ``"bwrap"`` (bubblewrap, any user).
        allow_paths: extra host paths the program may read (the view is an allow-list:
            `DEFAULT_ALLOWED`, the interpreter's prefixes and standard library, and these).
    """

    python: Optional[str] = None
    hide_paths: tuple = ()
    hide_repo: bool = True
    allow_network: bool = False
    allow_unsafe: bool = False
    uid_base: int = 2_000_000_000
    backend: str = "auto"
    allow_paths: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "allow_paths", tuple(str(p) for p in self.allow_paths))
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown sandbox backend {self.backend!r}; valid backends: {', '.join(BACKENDS)}")
        if not 65536 <= self.uid_base <= 2**31 - 1 - 2**22:
            raise ValueError(f"uid_base must be in [65536, 2**31 - 1 - 2**22] (pids go up to 2**22), got {self.uid_base}")


@dataclass(frozen=True)
class SandboxResult:
    """What one run did."""

    stdout: str
    stderr: str
    exit_code: Optional[int]  # None when killed by a signal
    signal: Optional[int]  # the killing signal's number, if any
    timed_out: bool  # the wall-clock timeout hit
    cpu_limit: bool  # killed for CPU time (SIGXCPU / SIGKILL at the hard limit)
    output_limit: bool  # stdout or stderr hit the output cap
    wall_s: float
    cpu_s: Optional[float]
    error: Optional[str] = None  # the sandbox itself failed (the program may not have run)
    cgroup: Optional[str] = None  # "v1" / "v2": the cgroups that held the run's budgets (None: none)
    memory_peak_bytes: Optional[int] = None  # the most memory the run's cgroup held, where it had one

    @property
    def ok(self) -> bool:
        """The program ran to completion with exit code 0 within every limit."""
        return (
            self.error is None
            and self.exit_code == 0
            and not self.timed_out
            and not self.cpu_limit
            and not self.output_limit
        )

    def describe(self) -> str:
        if self.error:
            return f"sandbox error: {self.error}"
        if self.timed_out:
            return "wall-clock timeout"
        if self.cpu_limit:
            return "CPU time limit"
        if self.output_limit:
            return "output limit"
        if self.signal is not None:
            return f"killed by {signal.Signals(self.signal).name if self.signal in signal.valid_signals() else self.signal}"
        if self.exit_code:
            tail = self.stderr.strip().splitlines()[-1:] if self.stderr.strip() else []
            return f"exit code {self.exit_code}" + (f": {tail[0][:200]}" if tail else "")
        return "ok"


# -- one memory, CPU and pids budget per run: the run's own cgroups (v2 or v1) ---------------------
def _load_sibling(name: str):
    """The module `name`.py beside this file, loaded by path (this file also runs as a copy
    outside the package: tests/_helpers_sandbox.py loads it as another user)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"scalerl_{name}", Path(__file__).with_name(name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Where runs get their cgroups (`CGROUP.decide`) and, in the launcher, making and removing them.
CGROUP = _load_sibling("_sandbox_cgroup")
CGROUP_ENV = CGROUP.ENV
_cgroups: Optional[dict] = None
_cgroups_lock = threading.Lock()
_warned = False
log = logging.getLogger(__name__)


def run_cgroups() -> dict:
    """{"version": 1 | 2 | None, "parents", "reason"} of this machine, decided and set up once
    (`_sandbox_cgroup.decide`, then `apply`): where each run gets its memory, CPU and pids budget."""
    global _cgroups
    with _cgroups_lock:
        if _cgroups is None:
            try:
                with open("/proc/self/mounts") as f:
                    mounts = f.read()
            except OSError:
                mounts = ""
            _cgroups = CGROUP.apply(CGROUP.decide(os.geteuid(), mounts, os.environ))
        return dict(_cgroups)


def residual_memory_risk() -> Optional[str]:
    """None where each run gets its own cgroups; else the sentence saying what then bounds a run
    (measured: `tests/test_sandbox_budgets.py::test_without_a_cgroup_what_a_run_can_hold_is_what_the_warning_says`)."""
    plan = run_cgroups()
    if plan["version"]:
        return None
    return (f"sandbox: no cgroup for sandboxed runs ({plan['reason']}): a run's memory is bounded per process, not "
            "per run: its processes (up to max_processes) can together hold about max_processes x memory_mb "
            "(RLIMIT_AS each) plus tmpfs_mb of /tmp, plus what the kernel buffers for their pipes and sockets "
            "(about 0.25 MiB per descriptor, max_open_files of them per process). SysV shared memory, message "
            "queues, semaphores, memfd and socket or pipe buffers above the default are refused, the run's processes are the "
            "OOM killer's first choice (oom_score_adj 1000), and their CPU time is summed by polling /proc (a "
            "new SIGCHLD disposition is refused, so no child is reaped uncounted). Run as root where cgroup v2 "
            "offers memory and pids or cgroup v1 has memory, cpuacct and pids, or set "
            f"{CGROUP_ENV} to delegated cgroup dir(s)")


def sandbox_used() -> bool:
    """Has this process created a sandbox (a code task checks the sandbox when it is built)?"""
    return _warned


def _warn_once() -> None:
    global _warned
    if not _warned:
        _warned = True
        risk = residual_memory_risk()
        if risk:
            log.warning(risk)


# -- capabilities ------------------------------------------------------------------------
_probe_cache: Optional[dict] = None
_probe_lock = threading.Lock()
_ready: dict = {}


def probe() -> dict:
    """What isolation this machine allows (cached): {"euid", "net_ns", "mount_ns", ...}."""
    global _probe_cache
    with _probe_lock:
        if _probe_cache is None:
            proc = subprocess.run(
                [sys.executable, "-I", "-S", "-B", LAUNCHER, "--probe"], capture_output=True, text=True, timeout=30
            )
            if proc.returncode != 0:
                raise SandboxUnavailableError(f"sandbox probe failed: {proc.stderr.strip()[-500:]}")
            _probe_cache = json.loads(proc.stdout)
        return dict(_probe_cache)


def _world_executable(path: str) -> bool:
    """Can an unprivileged user execute `path` (every parent dir traversable, file o+x)?"""
    real = os.path.realpath(path)
    try:
        if not stat.S_IMODE(os.stat(real).st_mode) & stat.S_IXOTH:
            return False
        parent = os.path.dirname(real)
        while True:
            if not stat.S_IMODE(os.stat(parent).st_mode) & stat.S_IXOTH:
                return False
            if parent == "/":
                return True
            parent = os.path.dirname(parent)
    except OSError:
        return False


def find_python(config: SandboxConfig, need_world_executable: bool) -> str:
    """The interpreter for Python programs (see `SandboxConfig.python`)."""
    if config.python:
        return config.python
    candidates = [getattr(sys, "_base_executable", None), sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"]
    candidates.append(shutil.which("python3") or "")
    for c in candidates:
        if not c or not os.path.isfile(c):
            continue
        real = os.path.realpath(c)
        if REPO_ROOT in (real, os.path.commonpath([REPO_ROOT, real])) and config.hide_repo:
            continue  # a venv inside the repo would be hidden from the program
        if not need_world_executable or _world_executable(real):
            return real
    raise SandboxUnavailableError(
        "no Python interpreter an unprivileged user can execute was found "
        f"(tried {[c for c in candidates if c]}); set SandboxConfig(python=...)"
    )


def choose_backend(config: SandboxConfig, caps: dict) -> str:
    """The backend a run uses: the configured one, or for ``"auto"`` ``"namespaces"`` as root
    (where it can make its namespaces) and ``"bwrap"`` otherwise where bubblewrap works."""
    if config.backend != "auto":
        return config.backend
    root = caps["euid"] == 0
    if root and caps["mount_ns"] and caps.get("pid_ns", True):
        return "namespaces"
    if caps.get("bwrap"):
        return "bwrap"
    return "namespaces"


def isolation_plan(config: SandboxConfig) -> dict:
    """Which isolation to use; raises SandboxUnavailableError if a required part is missing."""
    caps = probe()
    root = caps["euid"] == 0
    backend = choose_backend(config, caps)
    problems = []
    if not caps.get("seccomp", False) and not config.allow_unsafe:
        problems.append(f"cannot build the seccomp filter ({caps.get('seccomp_error')}); opt out with allow_unsafe=True")
    if backend == "bwrap":
        if not caps.get("bwrap"):
            raise SandboxUnavailableError(
                f"the bwrap sandbox backend is not usable here: {caps.get('bwrap_error')}; install bubblewrap "
                "(Debian: apt-get install bubblewrap) or choose another backend (valid: " + ", ".join(BACKENDS) + ")"
            )
        if problems:
            raise SandboxUnavailableError("refusing to run untrusted code: " + "; ".join(problems))
        return {"backend": "bwrap", "bwrap": caps["bwrap"], "net_ns": True, "mount_ns": True, "pid_ns": True,
                "seccomp": bool(caps.get("seccomp")), "drop_privileges": root}
    if not caps["net_ns"] and not config.allow_network:
        problems.append(
            f"cannot create a network namespace ({caps.get('net_ns_error')}); "
            "opt out with allow_network=True to run code WITH network access"
        )
    if not root and not config.allow_unsafe:
        problems.append(
            "not running as root, so programs cannot run as a separate unprivileged user, and bubblewrap is not "
            f"usable ({caps.get('bwrap_error')}): install bubblewrap (Debian: apt-get install bubblewrap), or "
            "opt out with allow_unsafe=True to run them as this user (they could read your files)"
        )
    if not caps["mount_ns"] and not config.allow_unsafe:
        problems.append(
            f"cannot create a private mount namespace ({caps.get('mount_ns_error')}); "
            "opt out with allow_unsafe=True"
        )
    if not caps.get("pid_ns", True) and not config.allow_unsafe:
        problems.append(f"cannot create a PID namespace ({caps.get('pid_ns_error')}); opt out with allow_unsafe=True")
    if problems:
        raise SandboxUnavailableError("refusing to run untrusted code: " + "; ".join(problems))
    return {
        "backend": "namespaces",
        "bwrap": None,
        "net_ns": bool(caps["net_ns"]),
        "mount_ns": bool(caps["mount_ns"]),
        "pid_ns": bool(caps.get("pid_ns")) and bool(caps["mount_ns"]) and root,
        "seccomp": bool(caps.get("seccomp")),
        "drop_privileges": root,
    }


def hidden_paths(config: SandboxConfig, python: str, *more_interpreters: str) -> list[str]:
    """Paths covered inside the sandbox (with $HOME); never one holding an interpreter it runs."""
    paths = list(DEFAULT_HIDDEN) + [os.path.expanduser("~")] + [str(p) for p in config.hide_paths]
    if config.hide_repo:
        paths.append(REPO_ROOT)
    keep = [os.path.realpath(p) for p in (python, *more_interpreters) if p]
    out = []
    for p in paths:
        real = os.path.realpath(p)
        if real == "/" or real in out or any(os.path.commonpath([real, k]) == real for k in keep):
            continue
        out.append(real)
    return out


_interp_cache: dict = {}
_INTERP_QUERY = r"""
import json, os, sys, sysconfig
dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
paths = sysconfig.get_paths()
dirs |= {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
dirs |= {os.path.dirname(os.path.join(d, "x")) for d in sys.path if d and os.path.isdir(d)}
links = set()
for d in (paths.get("stdlib"), paths.get("platstdlib")):  # Debian: sitecustomize.py -> /etc/python3.X/
    if d and os.path.isdir(d):
        for n in os.listdir(d):
            if os.path.islink(os.path.join(d, n)):
                links.add(os.path.realpath(os.path.join(d, n)))
print(json.dumps(sorted(dirs | links)))
"""


def interpreter_paths(python: str) -> list[str]:
    """What the interpreter `python` reads to start (cached): its prefixes, standard library,
    site-packages and what the standard library's own symbolic links point to. Asked of the
    interpreter itself (``-I``: no environment, no user site)."""
    key = os.path.abspath(python)
    if key not in _interp_cache:
        try:
            proc = subprocess.run([python, "-I", "-c", _INTERP_QUERY], capture_output=True, text=True, timeout=30,
                                  stdin=subprocess.DEVNULL)
            found = json.loads(proc.stdout) if proc.returncode == 0 else []
        except (OSError, ValueError, subprocess.TimeoutExpired):
            found = []
        _interp_cache[key] = [p for p in found if isinstance(p, str) and os.path.isabs(p)]
    return list(_interp_cache[key])


def allowed_paths(config: SandboxConfig, program: str, *interpreters: str) -> list[str]:
    """The host paths of the run's filesystem view (read-only): `DEFAULT_ALLOWED`, the program
    (argv[0]) and each interpreter with what it reads to start, `config.allow_paths`. Never "/"
    nor this repository (when hidden), nor anything inside a hidden path (those are covered)."""
    paths = list(DEFAULT_ALLOWED) + [program] + [str(p) for p in config.allow_paths]
    for interp in (program, *interpreters):
        if interp and os.path.basename(interp).startswith("python"):
            paths += [interp] + interpreter_paths(interp)
    out = []
    for p in paths:
        if not p or not os.path.isabs(p):
            continue
        real = os.path.realpath(p)
        if real == "/" or (config.hide_repo and real != REPO_ROOT and os.path.commonpath([real, REPO_ROOT]) == real):
            continue  # an ancestor of the repository: it would show the repository's neighbours
        if p not in out:
            out.append(p)
    return out


def control_hidden(control: str, *interpreters: Optional[str]) -> list[str]:
    """What to cover so the program sees no control dir: the temp dir holding every run's
    control dir (other runs' too: queued ones hold their spec and program there, and under
    bubblewrap the program's user may read and write them), unless it holds an interpreter
    (then this run's dir only). Under /tmp this is moot (the sandbox's /tmp is a fresh tmpfs)."""
    real = os.path.realpath(control)
    parent = os.path.dirname(real)
    keep = [os.path.realpath(p) for p in interpreters if p]
    if parent == "/" or any(os.path.commonpath([parent, k]) == parent for k in keep):
        return [real]
    return [parent]


def check_available(config: SandboxConfig = SandboxConfig()) -> None:
    """Fail early (SandboxUnavailableError) unless a trivial program runs correctly in the sandbox."""
    plan = isolation_plan(config)  # raises where a required isolation is missing
    key = (dataclasses.astuple(config), tuple(sorted(plan.items())))
    if _ready.get(key):
        return
    result = run_python("print('sandbox-ok')", config=config, limits=SandboxLimits(wall_seconds=20.0))
    if not (result.ok and result.stdout.strip() == "sandbox-ok"):
        raise SandboxUnavailableError(
            f"the sandbox cannot run a trivial program: {result.describe()}; stderr: {result.stderr.strip()[-500:]!r}"
        )
    _ready[key] = True


# -- running -----------------------------------------------------------------------------
def run_python(
    code: str,
    stdin: str = "",
    *,
    limits: SandboxLimits = SandboxLimits(),
    config: SandboxConfig = SandboxConfig(),
    files: Optional[Mapping[str, str]] = None,
    readonly_files: Optional[Mapping[str, str]] = None,
    process_view: bool = False,
) -> SandboxResult:
    """Run Python source `code` (as main.py) with `stdin`, in a working dir holding `files`.

    With `readonly_files`, main.py goes with them into the run's read-only dir (`READONLY_DIR`,
    beside the working dir: a directory no process of the run owns or can write) and runs from
    there (``python -I -B ../readonly/main.py``). `process_view`: see `run_program`."""
    plan = isolation_plan(config)
    python = find_python(config, need_world_executable=plan["drop_privileges"])
    if readonly_files is None:
        return run_program([python, "-I", "-B", "main.py"], {"main.py": code, **dict(files or {})}, stdin,
                           limits=limits, config=config, _plan=plan, process_view=process_view)
    return run_program([python, "-I", "-B", "../readonly/main.py"], dict(files or {}), stdin, limits=limits, config=config,
                       _plan=plan, process_view=process_view, readonly_files={"main.py": code, **readonly_files})


def run_program(
    argv: Sequence[str],
    files: Mapping[str, str],
    stdin: str = "",
    *,
    limits: SandboxLimits = SandboxLimits(),
    config: SandboxConfig = SandboxConfig(),
    _plan: Optional[dict] = None,
    process_view: bool = False,
    readonly_files: Optional[Mapping[str, str]] = None,
) -> SandboxResult:
    """Run `argv` (argv[0] an absolute path) in the sandbox with `files` in its working dir, and
    `readonly_files` in the read-only dir beside it (`READONLY_DIR`, reached as ``../readonly``).

    `process_view` (the grading harness): under ``namespaces`` the program starts with a second,
    effective gid that /proc's hidepid exempts, so it sees the CPU time of its own children
    even when they are undumpable; a child drops it with ``setresgid(gid, gid, gid)``.
    (Bubblewrap's /proc hides nothing of the run's own uid.)"""
    plan = _plan or isolation_plan(config)
    _warn_once()
    if not argv or not os.path.isabs(argv[0]):
        raise ValueError(f"argv[0] must be an absolute path, got {list(argv)[:1]}")
    for name in [*files, *(readonly_files or {})]:
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"sandbox file names must be plain names, got {name!r}")
    # bubblewrap's supervisor is a Python program inside the sandbox.
    supervisor = find_python(config, need_world_executable=plan["drop_privileges"]) if plan["backend"] == "bwrap" else None
    control = tempfile.mkdtemp(prefix="scalerl-sandbox-")
    try:
        os.chmod(control, 0o700)
        work = os.path.join(control, "work")
        _write_files(work, files, 0o700, 0o600)
        if readonly_files:  # readable by the run's uid, written by nobody of it
            _write_files(os.path.join(control, "readonly"), readonly_files, 0o755, 0o644)
        with _private(os.path.join(control, "stdin")) as f:
            f.write(stdin)
        spec = {
            "argv": list(argv),
            "env": {
                "PATH": "/usr/local/bin:/usr/bin:/bin",
                "HOME": "/tmp/work" if plan["mount_ns"] else work,
                "TMPDIR": "/tmp",
                "LANG": "C.UTF-8",
                "LC_ALL": "C.UTF-8",
                "PYTHONIOENCODING": "utf-8",
                "PYTHONHASHSEED": "0",
            },
            "cpu_seconds": limits.cpu_seconds,
            "wall_seconds": limits.wall_seconds,
            "memory_bytes": limits.memory_bytes,
            "max_processes": limits.max_processes,
            "output_bytes": limits.output_bytes,
            "max_open_files": limits.max_open_files,
            "tmpfs_bytes": limits.tmpfs_bytes,
            "run_cpu_seconds": limits.run_cpu(),
            "cgroup": _cgroup_spec(limits),
            "uid_base": config.uid_base,
            "readonly_empty": list(READONLY_EMPTY_DIRS),
            "hide_paths": hidden_paths(config, argv[0], supervisor or "") + control_hidden(control, argv[0], supervisor),
            "allow_paths": allowed_paths(config, argv[0], *([supervisor] if supervisor else [])),
            "supervisor_python": supervisor,
            "process_view": bool(process_view),
            **plan,
        }
        with _private(os.path.join(control, "spec.json")) as f:
            json.dump(spec, f)
        return _launch(control, limits, config, plan)
    finally:
        shutil.rmtree(control, ignore_errors=True)


def _private(path: str, mode: int = 0o600):
    """`path` opened for writing text, created with `mode` (a control dir's files are the grader's alone)."""
    return open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "w", encoding="utf-8")


def _write_files(d: str, files: Mapping[str, str], dir_mode: int, file_mode: int) -> None:
    """Make the dir `d` holding `files` ({name: text}), with these modes."""
    os.mkdir(d, dir_mode)
    for name, text in files.items():
        with _private(os.path.join(d, name), file_mode) as f:
            f.write(text)
        os.chmod(os.path.join(d, name), file_mode)  # as asked, whatever the umask


def _cgroup_spec(limits: SandboxLimits) -> Optional[dict]:
    """The launcher's part of the run's cgroups: where, and its memory and pids limits (None: no cgroup)."""
    plan = run_cgroups()
    if not plan["version"]:
        return None
    return {"version": plan["version"], "parents": plan["parents"], "memory_max": limits.run_memory(),
            "pids_max": int(limits.max_processes) + CGROUP.PIDS_SLACK}


# At most this many sandboxed programs run at once in this process (more grading threads
# queue here; a run's wall clock starts only when its launcher starts).
MAX_CONCURRENT_RUNS = max(2, 2 * (os.cpu_count() or 1))
_run_slots = threading.BoundedSemaphore(MAX_CONCURRENT_RUNS)


def _launch(control: str, limits: SandboxLimits, config: SandboxConfig, plan: dict) -> SandboxResult:
    with _run_slots:
        return _launch_now(control, limits, config, plan)


def _launch_now(control: str, limits: SandboxLimits, config: SandboxConfig, plan: dict) -> SandboxResult:
    with open(os.open(os.path.join(control, "launcher.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-B", LAUNCHER, control],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            close_fds=True,
        )
        # The launcher enforces the wall timeout itself; this timer is only a backstop for a
        # launcher that hangs (a blocking wait instead of Popen.wait(timeout), which polls).
        fired = threading.Event()

        def backstop() -> None:
            fired.set()
            _kill_group(proc.pid)
            if plan["drop_privileges"]:
                subprocess.run(
                    [sys.executable, "-I", "-S", "-B", LAUNCHER, "--kill-uid", str(config.uid_base + proc.pid)],
                    timeout=30,
                )

        timer = threading.Timer(limits.wall_seconds + 10.0, backstop)
        timer.daemon = True
        timer.start()
        try:
            proc.wait()
        finally:
            timer.cancel()
        launcher_timeout = fired.is_set()
    stdout, out_full = _read_capped(os.path.join(control, "stdout"), limits.output_bytes)
    stderr, err_full = _read_capped(os.path.join(control, "stderr"), limits.output_bytes)
    try:
        with open(os.path.join(control, "result.json")) as f:
            res = json.load(f)
    except (OSError, ValueError):
        log_text = Path(control, "launcher.log").read_text(errors="replace")[-1000:]
        why = "the launcher timed out" if launcher_timeout else f"the launcher exited {proc.returncode}"
        return SandboxResult(stdout, stderr, None, None, launcher_timeout, False, False, 0.0, None, f"{why}: {log_text}")
    sig = res.get("signal")
    cpu_s = res.get("cpu_s")
    cpu_limit = bool(res.get("cpu_limit")) or sig == signal.SIGXCPU or (
        sig == signal.SIGKILL and cpu_s is not None and cpu_s >= max(1.0, limits.cpu_seconds) - 0.05
    )
    return SandboxResult(
        stdout=stdout,
        stderr=stderr,
        exit_code=res.get("exit_code"),
        signal=sig,
        timed_out=bool(res.get("timed_out")),
        cpu_limit=bool(cpu_limit) and not res.get("timed_out"),
        output_limit=out_full or err_full or sig == signal.SIGXFSZ,
        wall_s=float(res.get("wall_s") or 0.0),
        cpu_s=cpu_s,
        error=res.get("setup_error"),
        cgroup=res.get("cgroup"),
        memory_peak_bytes=res.get("memory_peak"),
    )


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_capped(path: str, cap: int) -> tuple[str, bool]:
    """Up to `cap` bytes of a file, decoded; and whether it holds more than `cap` (the program's
    RLIMIT_FSIZE is cap + 1, so exactly `cap` bytes is a complete output)."""
    try:
        with open(path, "rb") as f:
            data = f.read(cap + 1)
    except OSError:
        return "", False
    return data[:cap].decode("utf-8", errors="replace"), len(data) > cap
