"""`scalerl train` on one machine: start every process of the run and watch them.

The calling process becomes a small supervisor (it does no training): it spawns the run's
T learner ranks and G generators as `python -m components.trainer.worker` processes, each
told its rank through the environment (SCALERL_RANK, SCALERL_WORLD_SIZE, the hub's host and
port block, CUDA_VISIBLE_DEVICES on GPU), and waits. Learner rank 0 runs the training and
records the outcome in run.json. When a process dies, the others learn it through the
transport's heartbeats and exit; the supervisor gives them that long, then kills what is
left, and if learner rank 0 itself died it records the failure naming it. Children die with
the supervisor (PR_SET_PDEATHSIG), so a killed `scalerl train` leaves nothing behind.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from components.trainer.roles import Endpoints, Layout, assign_gpus, free_port_base

__all__ = ["launch_local", "child_env"]

REPO = Path(__file__).resolve().parents[2]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _visible_gpus() -> list[str]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d for d in env.split(",") if d.strip() != ""]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001
        return []


def child_env(rank: int, layout: Layout, endpoints: Endpoints, setup_path: Path, on_gpu: bool) -> dict:
    env = dict(os.environ)
    env.update(endpoints.to_env())
    env.update(SCALERL_RANK=str(rank), SCALERL_WORLD_SIZE=str(layout.world_size), SCALERL_LOCAL_RANK=str(rank),
               SCALERL_SETUP=str(setup_path))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if on_gpu:
        visible = _visible_gpus()
        mine = assign_gpus(layout, rank, list(range(layout.world_size)), len(visible))
        env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[i] for i in mine)
    return env


def launch_local(setup, layout: Layout, run_dir: Path, on_gpu: bool, *, grace_s: Optional[float] = None) -> int:
    """Run every process of the run on this machine; returns learner rank 0's exit code (0: done)."""
    run_dir = Path(run_dir)
    private = run_dir / ".scalerl"
    private.mkdir(parents=True, exist_ok=True)
    setup_path = private / "setup.pkl"
    with open(setup_path, "wb") as f:
        pickle.dump((setup, layout), f)
    endpoints = Endpoints("127.0.0.1", free_port_base())
    grace = float(grace_s if grace_s is not None else setup.cfg.heartbeat_timeout_s + 30.0)
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(layout.world_size):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "components.trainer.worker"],
                env=child_env(rank, layout, endpoints, setup_path, on_gpu),
                cwd=os.getcwd(),
                preexec_fn=_die_with_parent,
            ))
        return _supervise(procs, layout, run_dir, grace)
    finally:
        _kill_all(procs)


def _supervise(procs: list, layout: Layout, run_dir: Path, grace: float) -> int:
    hub = procs[0]
    failed_at: Optional[float] = None
    culprit = None
    while True:
        code = hub.poll()
        if code is not None:
            # learner rank 0 ended (done or failed): the others got ("stop",) or an abort
            deadline = time.monotonic() + min(grace, 30.0)
            while any(p.poll() is None for p in procs[1:]) and time.monotonic() < deadline:
                time.sleep(0.1)
            return int(code)
        for rank, p in enumerate(procs[1:], start=1):
            c = p.poll()
            if c is not None and c != 0 and failed_at is None:
                failed_at, culprit = time.monotonic(), (layout.role(rank).name, p.pid, c)
        if failed_at is not None and time.monotonic() - failed_at > grace:
            # learner-0 did not end the run by itself (stuck): record the failure and stop everything
            name, pid, c = culprit
            _record(run_dir, f"{name} (pid {pid}) exited with code {c} and learner-0 did not stop within {grace:.0f} s")
            return 1
        time.sleep(0.1)


def _record(run_dir: Path, message: str) -> None:
    from components.trainer.runlog import RunInfo

    info = RunInfo(run_dir)
    if info.status == "running":
        (run_dir / "error.txt").write_text(message + "\n")
        info.finish("failed", error=message)


def _kill_all(procs: list) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
