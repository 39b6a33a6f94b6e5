"""Run sandboxed programs under either backend, the bubblewrap one as an unprivileged user.

``run_batch(backend, jobs)`` runs a list of programs and returns ``[(SandboxResult, seconds)]``:

- ``"namespaces"``: in this (root) process, with this session's own uid range;
- ``"bwrap"``: in a separate Python process running as an unprivileged uid of this test
  session's own (``setpriv``; no account, like nobody, but not shared with another test run,
  so the leftover checks see only ours), the way a Slurm job that is not root grades: the
  sandbox then picks bubblewrap by itself (``backend="auto"``). The sandbox's files (`SANDBOX_FILES`) are copied to a world-readable temp dir,
  so this works from a clone anywhere (that uid may not be able to read the checkout).

Jobs are dicts: ``code``, optional ``stdin``, ``files``, ``readonly_files``, ``limits``
(SandboxLimits fields), ``config`` (SandboxConfig fields).

``run_batch("bwrap", jobs, delegate=True)`` gives that user a delegated cgroup subtree of its
own (`delegated_cgroups`: this machine's real hierarchies, v1 or v2, made and chowned to it,
named by ``$SCALERL_SANDBOX_CGROUP``), as a cluster node that delegates would; without it the
user has no cgroup, as a plain Slurm job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from components.tasks import sandbox
from components.tasks.sandbox import SandboxConfig, SandboxLimits, SandboxResult

BACKENDS = ("namespaces", "bwrap")
# A uid range of our own (per test session, away from the default 2e9 + pid), so the
# leftover checks cannot see other sandboxes on the machine.
UID_BASE = 1_500_000_000 + (os.getpid() % 100) * 2**22
# The unprivileged user that grades with bubblewrap (pids are below 2**22: unique per live session).
USER_UID = 1_400_000_000 + os.getpid()
RUNNER_MARK = "scalerl-sandbox-test-runner"
SANDBOX_FILES = ("sandbox.py", "_sandbox_launcher.py", "_sandbox_libc.py", "_sandbox_view.py", "_sandbox_cgroup.py",
                 "_sandbox_reap.py", "_sandbox_seccomp.py", "_sandbox_supervisor.py")

# Executed by the unprivileged user's Python: load the copied sandbox module, run the jobs, print JSON.
RUNNER = r"""
import dataclasses, importlib.util, json, sys, time
from concurrent.futures import ThreadPoolExecutor
args = json.load(sys.stdin)
spec = importlib.util.spec_from_file_location("sandbox_under_test", args["sandbox_py"])
sb = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = sb
spec.loader.exec_module(sb)

def one(job):
    t0 = time.monotonic()
    try:
        config = sb.SandboxConfig(**{**job.get("config", {}), "hide_paths": tuple(job.get("config", {}).get("hide_paths", ()))})
        r = sb.run_python(job["code"], job.get("stdin", ""), limits=sb.SandboxLimits(**job.get("limits", {})),
                          config=config, files=job.get("files"), readonly_files=job.get("readonly_files"))
        out = {"result": dataclasses.asdict(r), "plan": sb.isolation_plan(config)["backend"],
               "cgroups": sb.run_cgroups()["version"]}
    except Exception as err:
        out = {"exception": f"{type(err).__name__}: {err}"}
    out["seconds"] = time.monotonic() - t0
    return out

with ThreadPoolExecutor(args["threads"]) as pool:
    print(json.dumps(list(pool.map(one, args["jobs"]))))
"""


def processes(match) -> list[tuple[int, int, str]]:
    """(pid, real uid, cmdline) of live, non-zombie processes for which match(uid, cmdline) is true."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        uid = int(fields["Uid"].split()[0])
        if not fields["State"].strip().startswith("Z") and match(uid, cmd):
            found.append((int(entry), uid, cmd))
    return found


def sandbox_processes() -> list[tuple[int, int, str]]:
    """Processes left by this session's sandboxes: our namespaces uid range, or our unprivileged user."""
    return processes(lambda uid, cmd: UID_BASE <= uid < UID_BASE + 2**22 or uid == USER_UID)


def _run_here(jobs, threads):
    def one(job):
        config = SandboxConfig(**{"uid_base": UID_BASE, "backend": "namespaces", **job.get("config", {})})
        return sandbox.run_python(job["code"], job.get("stdin", ""), limits=SandboxLimits(**job.get("limits", {})),
                                  config=config, files=job.get("files"), readonly_files=job.get("readonly_files"))

    def timed(job):
        t0 = time.monotonic()
        res = one(job)
        return res, time.monotonic() - t0

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(timed, jobs))


@contextlib.contextmanager
def delegated_cgroups(uid: int):
    """(``$SCALERL_SANDBOX_CGROUP``, a command prefix) for a subtree of this machine's real cgroups
    made for `uid`, as an administrator delegates one: each dir and its cgroup.procs chowned to
    it (v2: memory and pids enabled for its children), and a leaf "trainer" where the prefix puts
    the command (as root) before it runs: the grader lives inside its subtree, as v2 requires.
    Removed afterwards."""
    plan = sandbox.run_cgroups()
    assert plan["version"], f"no cgroup to delegate here: {plan['reason']}"
    dirs = []
    for parent in sorted(set(plan["parents"].values())):
        d = os.path.join(os.path.dirname(parent), f"scalerl-test-delegated-{os.getpid()}")
        for sub in (d, os.path.join(d, "trainer")):
            os.mkdir(sub)
            for name in ("", "cgroup.procs", "tasks"):
                if os.path.exists(os.path.join(sub, name)):
                    os.chown(os.path.join(sub, name), uid, uid)
        if plan["version"] == 2:
            with open(os.path.join(d, "cgroup.subtree_control"), "w") as f:
                f.write("+memory +pids")
        dirs.append(d)
    join = " && ".join(f"echo $$ > {os.path.join(d, 'trainer', 'cgroup.procs')}" for d in dirs)
    try:
        yield ":".join(dirs), ["sh", "-c", join + ' && exec "$@"', "sh"]
    finally:
        for d in dirs:
            for sub in (os.path.join(d, "trainer"), d):
                sandbox.CGROUP.remove_run({"version": plan["version"], "dirs": {"memory": sub}})


def _run_unprivileged(jobs, threads, home, delegate=False):
    python = sandbox.find_python(SandboxConfig(hide_repo=False), need_world_executable=True)
    top = tempfile.mkdtemp(prefix="scalerl-sandbox-user-", dir="/tmp")  # the user must reach it
    try:
        os.chmod(top, 0o755)
        pkg = os.path.join(top, "repo", "components", "tasks")
        os.makedirs(pkg)
        for d in (os.path.join(top, "repo"), os.path.join(top, "repo", "components"), pkg):
            os.chmod(d, 0o755)
        here = os.path.dirname(sandbox.__file__)
        for name in SANDBOX_FILES:
            shutil.copy(os.path.join(here, name), os.path.join(pkg, name))
            os.chmod(os.path.join(pkg, name), 0o644)
        tmp = os.path.join(top, "tmp")
        os.mkdir(tmp, 0o700)
        os.chown(tmp, USER_UID, USER_UID)
        # The real checkout must stay hidden too (the copy is the "repository" of the copied module).
        jobs = [{**j, "config": {**j.get("config", {}), "hide_paths": [sandbox.REPO_ROOT, *j.get("config", {}).get("hide_paths", ())]}}
                for j in jobs]
        args = {"sandbox_py": os.path.join(pkg, "sandbox.py"), "jobs": jobs, "threads": threads}
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "TMPDIR": tmp, "HOME": home or "/nonexistent", "LANG": "C.UTF-8"}
        with delegated_cgroups(USER_UID) if delegate else contextlib.nullcontext(("", [])) as (cgroups, prefix):
            proc = subprocess.run(
                prefix + ["setpriv", f"--reuid={USER_UID}", f"--regid={USER_UID}", "--clear-groups", "--",
                          python, "-I", "-c", RUNNER, RUNNER_MARK],
                input=json.dumps(args), capture_output=True, text=True, timeout=120, cwd="/",
                env={**env, sandbox.CGROUP_ENV: cgroups} if delegate else env,
            )
        assert proc.returncode == 0, f"the runner as uid {USER_UID} failed ({proc.returncode}): {proc.stderr[-2000:]}"
        assert os.listdir(tmp) == [], "sandbox control dirs were left behind"
    finally:
        shutil.rmtree(top, ignore_errors=True)
    out = []
    for item in json.loads(proc.stdout):
        assert "exception" not in item, item["exception"]
        assert item["plan"] == "bwrap", f"not as root, the sandbox chose {item['plan']!r}, not bubblewrap"
        assert bool(item["cgroups"]) == delegate, f"delegated {delegate}, yet the runs' cgroups are {item['cgroups']}"
        out.append((SandboxResult(**item["result"]), item["seconds"]))
    return out


def run_batch(backend: str, jobs: list[dict], threads: int = 4, home: str = "",
              delegate: bool = False) -> list[tuple[SandboxResult, float]]:
    """Run `jobs` (concurrently, `threads` at a time) under `backend`; [(result, seconds)] in order.
    `home`: the unprivileged user's $HOME (``bwrap``; in-process runs use this process's);
    `delegate`: give that user a delegated cgroup subtree (`delegated_cgroups`)."""
    if backend == "namespaces":
        return _run_here(jobs, threads)
    if backend == "bwrap":
        return _run_unprivileged(jobs, threads, home, delegate)
    raise ValueError(f"unknown backend {backend!r}; valid: {BACKENDS}")


def asdict(result: SandboxResult) -> dict:
    return dataclasses.asdict(result)
