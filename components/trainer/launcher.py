"""`scalerl train` on one machine: start every process of the run and watch them.

The calling process becomes a small supervisor (it does no training): it spawns the run's
T learner ranks and G generators as `python -m components.trainer.worker` processes, each
told its rank through the environment (SCALERL_RANK, SCALERL_WORLD_SIZE, the hub's host and
port block, CUDA_VISIBLE_DEVICES on GPU), and waits. Learner rank 0 runs the training and
records the outcome in run.json. Children die with the supervisor (PR_SET_PDEATHSIG), so a
killed `scalerl train` leaves nothing behind.

No hang, no orphan: every process of the run is gone within `train.heartbeat_timeout_s + 25 s`
(55 s at the default) of any process of the run dying, stopping or hanging. The
transport's heartbeats do most of it (the hub names a silent peer and ends the run, a peer
whose hub is silent exits); the supervisor is the backstop for what a process cannot do for
itself, a stopped (SIGSTOP) process above all, which neither exits nor answers `terminate()`.
Its rules (`_supervise`), checked every `POLL_S`:
- learner-0 ended: a stopped process is SIGKILLed at once, the rest within `AFTER_HUB_S`;
- a peer exited with `EXIT_HUB_LOST` (its hub was silent for heartbeat_timeout_s): learner-0
  gets `HUB_LOST_S` more (none if it is stopped), then everything is SIGKILLed;
- a process died, or stays stopped, or every peer ended while learner-0 runs on: learner-0
  gets `grace` (heartbeat_timeout_s + 15 s: time to name it and end the run, also from inside a
  collective) to end by itself, then the supervisor records the failure naming that process
  and SIGKILLs everything;
- learner-0 died without recording why (kill -9): the supervisor records it, naming it.
The workers ignore SIGTERM (the hub owns shutdown), so escalation is straight to SIGKILL.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import pickle
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Optional

from components.trainer.exits import EXIT_HUB_LOST
from components.trainer.roles import GPUS_SHARED_ENV, Endpoints, Layout, assign_gpus, free_port_base, gpus_shared

__all__ = ["launch_local", "child_env", "AFTER_HUB_S", "HUB_LOST_S", "POLL_S"]

REPO = Path(__file__).resolve().parents[2]
POLL_S = 0.2  # how often the supervisor looks at its children
AFTER_HUB_S = 15.0  # learner-0 ended: the others got Stop() or an abort; SIGKILL after this long
HUB_LOST_S = 5.0  # a peer found learner-0 silent for heartbeat_timeout_s: SIGKILL learner-0 after this long
KILL_WAIT_S = 10.0  # after SIGKILL: how long to wait for the kernel to reap everything


def _die_with_parent(parent_pid: int) -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != parent_pid:  # the parent died before prctl: the signal will never come
        os.kill(os.getpid(), signal.SIGKILL)


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
        env[GPUS_SHARED_ENV] = "1" if gpus_shared(layout, layout.world_size, len(visible)) else "0"
    return env


def launch_local(setup, layout: Layout, run_dir: Path, on_gpu: bool, *, grace_s: Optional[float] = None) -> int:
    """Run every process of the run on this machine; returns learner rank 0's exit code (0: done).

    grace_s: how long learner-0 gets to end the run after another process died or stopped
    (default train.heartbeat_timeout_s + 15 s)."""
    run_dir = Path(run_dir)
    private = run_dir / ".scalerl"
    private.mkdir(parents=True, exist_ok=True)
    setup_path = private / "setup.pkl"
    with open(setup_path, "wb") as f:
        pickle.dump((setup, layout), f)
    endpoints = Endpoints("127.0.0.1", free_port_base(), uuid.uuid4().hex[:16])  # a fresh token per launch
    grace = float(grace_s if grace_s is not None else setup.cfg.heartbeat_timeout_s + 15.0)
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(layout.world_size):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "components.trainer.worker"],
                env=child_env(rank, layout, endpoints, setup_path, on_gpu),
                cwd=os.getcwd(),
                preexec_fn=functools.partial(_die_with_parent, os.getpid()),
            ))
        return _supervise(procs, layout, run_dir, grace)
    finally:
        _kill_all(procs)


def is_stopped(pid: int) -> bool:
    """True when `pid` is stopped (SIGSTOP / SIGTSTP, or a tracer's stop): it will not exit by itself."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # gone, or no /proc (not Linux): nothing to say
        return False
    return stat[stat.rfind(")") + 2 :][:1] in ("T", "t")


def describe_exit(code: int) -> str:
    """'exited with code 1' / 'was killed by SIGKILL' (Popen's negative codes are signals)."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _supervise(procs: list, layout: Layout, run_dir: Path, grace: float) -> int:
    """Wait for the run's processes; enforce the deadlines of the module docstring. Returns learner-0's code."""
    names = [f"{layout.role(r).name} (pid {p.pid})" for r, p in enumerate(procs)]
    deadline, reason = math.inf, ""  # events so far: when everything left is SIGKILLed, and the failure it records
    noted: set = set()  # events already taken into account (ranks that exited, "peers")
    stopped_since: dict = {}  # rank -> when it was first seen stopped (continuously since)
    last = time.monotonic()

    def until(when: float, why: str) -> None:
        nonlocal deadline, reason
        if when < deadline:
            deadline, reason = when, why

    while True:
        now = time.monotonic()
        if now - last > max(2.0, 10 * POLL_S):  # the supervisor itself was not scheduled (stopped with its
            stopped_since.clear()  # children by Ctrl-Z, starved): what it saw before says nothing about now
            deadline += now - last
        last = now
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            break
        for r, p in enumerate(procs):  # a stopped process that resumes is forgiven (Ctrl-Z then fg)
            if codes[r] is None and is_stopped(p.pid):
                stopped_since.setdefault(r, now)
            else:
                stopped_since.pop(r, None)
        if codes[0] is not None:  # learner-0 ended: the run is over for everyone
            if 0 not in noted:
                noted.add(0)
                until(now + AFTER_HUB_S, "")
            for r in stopped_since:
                procs[r].kill()  # a stopped process never exits by itself
        else:
            for r, c in enumerate(codes[1:], start=1):
                if c is not None and c != 0 and r not in noted:
                    noted.add(r)
                    if c == EXIT_HUB_LOST:  # (no wait for a stopped learner-0: it will not end by itself)
                        until(now + (0.0 if 0 in stopped_since else HUB_LOST_S),
                              f"{names[r]} found learner-0 silent (no heartbeat) and learner-0 did not end")
                    else:
                        until(now + grace, f"{names[r]} {describe_exit(c)} and learner-0 did not end the run within {grace:.0f} s")
            if all(c is not None for c in codes[1:]) and "peers" not in noted:
                noted.add("peers")
                until(now + grace, f"every other process ended and learner-0 did not end within {grace:.0f} s")
        when, why = _stop_deadline(stopped_since, names, grace) if codes[0] is None else (math.inf, "")
        if now >= min(deadline, when):
            if codes[0] is None:  # learner-0 did not end the run: record why, naming the process
                _record(run_dir, (reason if deadline <= when else why) or "the run's processes did not end")
            break
        time.sleep(POLL_S)
    _kill_all(procs)
    code = procs[0].poll()
    if code is not None and code != 0:  # (no-op when learner-0 or the lines above recorded the failure)
        _record(run_dir, f"{names[0]} {describe_exit(code)} without recording why")
    return int(code if code is not None else -signal.SIGKILL)


def _stop_deadline(stopped_since: dict, names: list, grace: float) -> tuple:
    """(when, why) the supervisor ends a run one of whose processes stays stopped; (inf, "") if none is."""
    if not stopped_since:
        return math.inf, ""
    r = min(stopped_since, key=stopped_since.get)
    tail = "" if r == 0 else f" and learner-0 did not end the run within {grace:.0f} s"
    return stopped_since[r] + grace, f"{names[r]} is stopped (SIGSTOP: it neither runs nor exits){tail}"


def _record(run_dir: Path, message: str) -> None:
    from components.trainer.runlog import record_failure

    record_failure(run_dir, message, only_if_running=True)  # never raises


def _kill_all(procs: list) -> None:
    """SIGKILL every process still there (stopped ones too) and reap them, waiting KILL_WAIT_S at most."""
    for p in procs:
        if p.poll() is None:
            try:
                p.kill()
            except OSError:
                pass
    end = time.monotonic() + KILL_WAIT_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"scalerl: process {p.pid} did not die after SIGKILL within {KILL_WAIT_S:g} s", file=sys.stderr, flush=True)
