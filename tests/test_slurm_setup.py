"""Issue 33, item 1: the test command needs nothing outside the repository.

`scripts/setup_slurm.sh` installs and starts the tests' single-node Slurm from the repository's
own `scripts/slurm/` (config templates, start.sh, stop.sh). These checks need neither root nor
Slurm; the cluster itself is exercised by tests/test_slurm.py.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SLURM = REPO / "scripts" / "slurm"
SCRIPTS = [REPO / "scripts" / "setup_slurm.sh", REPO / "scripts" / "test.sh", REPO / ".ci" / "run",
           SLURM / "start.sh", SLURM / "stop.sh"]
# the outside folders the setup once read (spelled in two pieces so this file does not name them)
OUTSIDE = [".." + "/shared", "shared" + "/slurm", "start" + "_slurm.sh"]
SKIP_DIRS = {".git", ".venv", "results", "runs", "out", "__pycache__", ".pytest_cache", "node_modules"}


def _repo_text_files():
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".venv") and not d.endswith(".egg-info")]
        for name in files:
            path = Path(root) / name
            if path.suffix in {".py", ".sh", ".md", ".gin", ".toml", ".cfg", ".txt", ".yaml", ".yml", ".template",
                               ".conf"} or path.parent.name in {".ci", "slurm"}:
                yield path


def test_nothing_in_the_repository_reads_outside_it():
    hits = []
    for path in _repo_text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for i, line in enumerate(text.splitlines(), start=1):
            if any(o in line for o in OUTSIDE):
                hits.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_the_slurm_setup_is_in_the_repository():
    for f in ("slurm.conf.template", "slurmdbd.conf.template", "start.sh", "stop.sh"):
        assert (SLURM / f).is_file(), f
    setup = (REPO / "scripts" / "setup_slurm.sh").read_text()
    assert "scripts/slurm/start.sh" in setup
    for pkg in ("slurm-wlm", "munge", "slurmdbd", "mariadb-server"):
        assert pkg in setup, pkg
    assert "setup_slurm.sh" in (REPO / "scripts" / "test.sh").read_text()
    assert "scripts/test.sh" in (REPO / ".ci" / "run").read_text()


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_scripts_parse(script):
    out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("accounting", ["dbd", "none"])
def test_the_rendered_slurm_conf(accounting):
    env = {**os.environ, "SCALERL_SLURM_ACCOUNTING": accounting}
    out = subprocess.run(["bash", str(SLURM / "start.sh"), "--print-config"], capture_output=True, text=True,
                         env=env, timeout=30)
    assert out.returncode == 0, out.stderr
    conf = out.stdout
    settings = [line for line in conf.splitlines() if line and not line.startswith("#")]
    assert not [line for line in settings if "@" in line], "placeholders left"
    host = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
    node = next(line for line in settings if line.startswith("NodeName="))
    assert f"NodeName={host} " in node and f" CPUs={len(os.sched_getaffinity(0))} " in node, node  # nproc
    assert int(re.search(r"RealMemory=(\d+)", node).group(1)) > 0
    assert f"PartitionName=debug Nodes={host} Default=YES" in conf
    assert "KillWait=5" in settings  # tests/test_slurm.py counts on a short SIGTERM -> SIGKILL wait
    if accounting == "dbd":
        assert "AccountingStorageType=accounting_storage/slurmdbd" in settings
        assert "JobAcctGatherType=jobacct_gather/linux" in settings
    else:
        assert "AccountingStorageType=accounting_storage/none" in settings


def test_start_refuses_a_bad_argument_or_accounting():
    bad = subprocess.run(["bash", str(SLURM / "start.sh"), "--nope"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 1 and "unknown argument '--nope'" in bad.stderr
    env = {**os.environ, "SCALERL_SLURM_ACCOUNTING": "sqlite"}
    bad = subprocess.run(["bash", str(SLURM / "start.sh"), "--print-config"], capture_output=True, text=True,
                         env=env, timeout=30)
    assert bad.returncode == 1 and "dbd or none" in bad.stderr


@pytest.mark.skipif(shutil.which("sbatch") is None or os.geteuid() != 0, reason="needs root and an installed Slurm")
def test_setup_is_idempotent_when_the_cluster_is_up():
    """A second setup starts nothing (every daemon is already running) and leaves the node up."""
    up = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    if up.returncode != 0 or not re.search(r"^(idle|mixed|allocated)", up.stdout, re.M):
        pytest.skip(f"the cluster is not up: {up.stdout} {up.stderr}")
    out = subprocess.run(["bash", str(REPO / "scripts" / "setup_slurm.sh")], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    if "not set up by this script" in out.stdout:
        return  # someone else's Slurm: left as it is
    assert "starting" not in out.stdout, out.stdout
    for daemon in ("munged", "slurmctld", "slurmd"):
        assert f"{daemon} is running" in out.stdout, out.stdout


def test_competing_jobs_counts_running_and_waiting_jobs_but_not_held_ones():
    from _slurm_queue import competing_jobs

    text = ("426_0|scalerl-fp32_head|RUNNING|None|root\n"
            "426_[1-5%1]|scalerl-fp32_head|PENDING|JobArrayTaskLimit|root\n"
            "501|scalerl-loss_type|PENDING|Priority|root\n"
            "502|study|PENDING|JobHeldUser|alice\n"
            "503|study|PENDING|JobHeldAdmin|root\n"
            "504|old|REQUEUE_HOLD|JobHeldUser|root\n"
            "505|tail|COMPLETING|None|bob\n\n")
    assert competing_jobs(text) == [
        "426_0 scalerl-fp32_head RUNNING (None, root)",
        "426_[1-5%1] scalerl-fp32_head PENDING (JobArrayTaskLimit, root)",
        "501 scalerl-loss_type PENDING (Priority, root)",
        "505 tail COMPLETING (None, bob)",
    ]
    assert competing_jobs("") == []
    with pytest.raises(ValueError, match="unexpected squeue line"):
        competing_jobs("426 scalerl RUNNING")


def test_ci_starts_the_slurm_controller_fresh():
    """A controller restarted from saved state runs the jobs queued before (a study left in the
    queue once took CI's one node for its whole 90 minutes); .ci/run asks for a fresh one."""
    assert re.search(r"^export SCALERL_SLURM_FRESH=1", (REPO / ".ci" / "run").read_text(), re.M)
    start = (SLURM / "start.sh").read_text()
    assert re.search(r'FRESH" = 1 \] && ! running slurmctld; then', start)
    # the saved jobs are cancelled before slurmd starts (it would run them at once)
    assert start.index("xargs scancel") < start.index("start_daemon slurmd /usr/sbin/slurmd")
    bad = subprocess.run(["bash", str(SLURM / "start.sh"), "--print-config"], capture_output=True, text=True,
                         env=dict(os.environ, SCALERL_SLURM_FRESH="yes"))
    assert bad.returncode != 0 and "SCALERL_SLURM_FRESH must be 0 or 1, not 'yes'" in bad.stderr
