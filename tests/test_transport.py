"""components/trainer/transport.py: messages between real processes, heartbeats, lost processes.

Peers (and, for one test, the hub) run as separate processes (subprocess, the program below);
they are killed with SIGKILL or stopped with SIGSTOP to check that the survivor names them.
Timing bounds are generous ("named within timeout + 10 s"): they check liveness, not speed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from components.trainer.transport import Aborted, Hub, HubLost, Peer, PeerLost, PeersMissing, TransportError, decode, encode

REPO = Path(__file__).resolve().parents[1]
HB, TIMEOUT = 0.2, 2.0  # heartbeat period and liveness timeout used by every test
SLACK = 10.0

# One program for every child process: python -c PROGRAM MODE NAME PORT [torch]
# Children that handle tensors import torch BEFORE they start beating: importing torch holds
# the GIL for long stretches, which on a loaded 2-core machine can silence the heartbeat
# thread for longer than the 2 s test timeout (real runs use 30 s and import torch first).
PROGRAM = r"""
import os, sys, time
mode, name, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
if "torch" in sys.argv[4:]:
    import torch
    torch.set_num_threads(1)
from components.trainer.transport import Aborted, Hub, Peer, TransportError
HB, TIMEOUT = float(os.environ["T_HB"]), float(os.environ["T_TIMEOUT"])

def say(*a):
    print(*a, flush=True)

def on_lost(err):
    say("ON_LOST", type(err).__name__, err)

if mode == "hub":  # a hub with one peer (the test process); reports its port and pid
    hub = Hub("learner-0", host="127.0.0.1", port=0, peers=[name], heartbeat_s=HB, timeout_s=TIMEOUT)
    say("PORT", hub.port)
    hub.wait_for_peers(30)
    hub.send(name, ("ready",))
    while True:
        hub.recv(1.0)

peer = Peer(name, "127.0.0.1", port, heartbeat_s=HB, timeout_s=TIMEOUT, on_lost=on_lost,
            run_token=os.environ.get("T_TOKEN", ""))
try:
    if mode == "echo":  # 20 messages of its own, then echo everything until ("stop",)
        for i in range(20):
            peer.send(("own", name, i))
        while True:
            m = peer.recv(1.0)
            if m is None:
                continue
            if isinstance(m, tuple) and m and m[0] == "stop":
                break
            peer.send(("echo", m))
    elif mode == "busy":  # main thread busy for longer than the timeout, three ways
        peer.send(("ready",))
        assert peer.recv(30) == ("go",)
        phases = {}
        t0 = time.monotonic(); time.sleep(1.25 * TIMEOUT); phases["sleep"] = time.monotonic() - t0
        t0 = time.monotonic()
        x = 0
        while time.monotonic() - t0 < 1.25 * TIMEOUT:  # pure Python: holds the GIL between switches
            x += 1
        phases["python"] = time.monotonic() - t0
        t0 = time.monotonic()
        a = torch.randn(256, 256)
        while time.monotonic() - t0 < 1.25 * TIMEOUT:  # torch ops
            a = torch.tanh(a @ a)
        phases["torch"] = time.monotonic() - t0
        peer.send(("done", phases))
        while peer.recv(1.0) != ("stop",):
            pass
    elif mode == "idle":  # wait for messages until ("stop",); report why it ends
        while True:
            m = peer.recv(0.5)
            if m == ("stop",):
                break
            if m is not None:
                peer.send(("got", m))
except Aborted as e:
    say("ABORTED", e.reason)
    peer.close()
    sys.exit(0)
except TransportError as e:
    say("PEER_ERROR", type(e).__name__, e)
    peer.close()
    sys.exit(3)
peer.close()
say("CLEAN_EXIT")
"""


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "T_HB": str(HB), "T_TIMEOUT": str(TIMEOUT), "OMP_NUM_THREADS": "1"}


def _spawn(mode: str, name: str, port: int, torch: bool = False, token: str = "") -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", PROGRAM, mode, name, str(port)] + (["torch"] if torch else []),
        cwd=str(REPO), env={**_env(), "T_TOKEN": token}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def _finish(proc: subprocess.Popen, timeout: float = 20.0) -> str:
    """Wait for a child (killing it if it outlives `timeout`) and return its output."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"child did not exit within {timeout} s; output:\n{out}")
    return out


def _kill(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            p.kill()
            p.communicate()


class Calls:
    """Thread-safe record of on_lost calls."""

    def __init__(self):
        self.errors: list = []
        self.lock = threading.Lock()

    def __call__(self, err):
        with self.lock:
            self.errors.append(err)


def _hub(peers, on_lost=None, timeout_s=TIMEOUT) -> Hub:
    return Hub("learner-0", host="127.0.0.1", port=0, peers=peers, heartbeat_s=HB, timeout_s=timeout_s, on_lost=on_lost)


def _recv_until_lost(hub: Hub, limit_s: float):
    """recv until PeerLost; returns (error, seconds waited). Fails if nothing is raised in time."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        try:
            hub.recv(0.5)
        except PeerLost as e:
            return e, time.monotonic() - t0
    raise AssertionError(f"no PeerLost within {limit_s} s; hub state {hub.state()}")


def _wait_all_left(hub: Hub, limit_s: float = SLACK) -> None:
    """Every peer closed: the hub marks them 'left' (never 'lost') once their goodbye arrives."""
    deadline = time.monotonic() + limit_s
    while {s["state"] for s in hub.state().values()} != {"left"}:
        assert time.monotonic() < deadline, hub.state()
        time.sleep(0.1)


def _tensor_batch(mib: float, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = int(mib * 2**20 / 4 / 2)
    return {
        "logprobs": torch.randn(n, generator=g),  # [n] fp32
        "ids": torch.randint(0, 2**31 - 1, (n // 2, 2), generator=g, dtype=torch.int64),  # [n/2, 2]
        "bf16": torch.randn(64, 300, generator=g).to(torch.bfloat16)[:, ::3],  # [64, 100], non-contiguous
        "mask": torch.rand(1000, generator=g) > 0.5,  # [1000] bool
        "scalar": torch.tensor(3.25, dtype=torch.float64),  # []
        "empty": torch.empty(0, 7),  # [0, 7]
        "grad": torch.randn(5, generator=g).requires_grad_(True),  # [5] leaf with grad
        "meta": {"ids": [1, 2, 3], "text": "x" * 10},
    }


def _assert_bit_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            w = b[k]
            assert isinstance(w, torch.Tensor) and w.dtype == v.dtype and w.shape == v.shape, k
            assert w.requires_grad == v.requires_grad, k
            # bit-equal: compare the raw bytes, not values (NaN-safe, -0.0-safe)
            assert torch.equal(w.detach().contiguous().reshape(-1).view(torch.uint8), v.detach().contiguous().reshape(-1).view(torch.uint8)), k
        else:
            assert v == b[k], k


# ========================================================================================
# in-process: serialization and bad input
def test_encode_decode_tensors_bit_equal_and_out_of_band():
    batch = _tensor_batch(2.0)
    frames = encode(batch)
    # the two large tensors travel out of band, the small ones inside the pickle stream
    assert len(frames) == 3
    assert sum(len(memoryview(f.buffer)) for f in frames[1:]) == batch["logprobs"].numel() * 4 + batch["ids"].numel() * 8
    batch_copy = {k: (v.detach().clone().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    batch["logprobs"].add_(1.0)  # the sender may modify its tensors once encode/send returned
    out = decode(frames)
    batch["logprobs"].sub_(1.0)
    _assert_bit_equal(batch_copy, out)
    out["logprobs"].mul_(2)  # received tensors are writable
    assert torch.equal(out["logprobs"], batch_copy["logprobs"] * 2)


def test_encode_refuses_non_cpu_tensor_with_clear_error():
    with pytest.raises(ValueError, match=r"CPU tensors only.*meta.*\.cpu\(\)"):
        encode({"x": torch.empty(3, device="meta")})
    with pytest.raises(TypeError, match="dense tensors only"):
        encode(torch.eye(3).to_sparse())


def test_bad_arguments_raise_naming_the_value():
    with pytest.raises(ValueError, match=r"unique.*generator-0"):
        Hub(port=0, peers=["generator-0", "generator-0"])
    with pytest.raises(ValueError, match="also listed among its peers"):
        Hub("learner-0", port=0, peers=["learner-0"])
    with pytest.raises(ValueError, match=r"timeout_s must be at least 2 x heartbeat_s"):
        Hub(port=0, peers=["a"], heartbeat_s=1.0, timeout_s=1.5)
    with pytest.raises(ValueError, match="port must be"):
        Peer("a", "127.0.0.1", 70000)
    with _hub(["generator-0"]) as hub:
        with pytest.raises(ValueError, match=r"unknown peer 'generator-9'.*generator-0"):
            hub.send("generator-9", 1)
        with pytest.raises(TransportError, match="generator-0 has not connected"):
            hub.send("generator-0", 1)
        with pytest.raises(TransportError, match=rf"cannot bind .*:{hub.port}"):
            Hub(host="127.0.0.1", port=hub.port, peers=["x"])


def test_wait_for_peers_names_the_missing_one():
    with _hub(["generator-0", "generator-1", "learner-1"]) as hub:
        present = [Peer(n, "127.0.0.1", hub.port, heartbeat_s=HB, timeout_s=TIMEOUT) for n in ("generator-0", "learner-1")]
        try:
            with pytest.raises(PeersMissing, match=r"missing generator-1 \(connected: generator-0, learner-1\)"):
                hub.wait_for_peers(1.5)
        finally:
            for p in present:
                p.close()


def test_unexpected_process_is_named():
    with _hub(["generator-0"]) as hub:
        intruder = Peer("generator-7", "127.0.0.1", hub.port, heartbeat_s=HB, timeout_s=TIMEOUT)
        try:
            with pytest.raises(TransportError, match=r"unexpected process generator-7 \(pid \d+") as caught:
                hub.wait_for_peers(5.0)
            assert not isinstance(caught.value, PeersMissing)  # not a missing peer (no shared-filesystem hint)
        finally:
            intruder.close()


def test_a_stray_process_of_another_run_is_ignored_and_this_runs_process_takes_the_name(caplog):
    """A cancelled job's generator that reaches a reused port carries its own run's token: the hub
    ignores it (one warning naming it, not a fatal name clash), the process of this run with the
    same name connects and is the one recorded, only its messages arrive, and the stray, never
    answered, gives up (HubLost) on its own."""
    calls = Calls()
    hub = Hub("learner-0", host="127.0.0.1", port=0, peers=["generator-0"], heartbeat_s=HB, timeout_s=TIMEOUT,
              on_lost=calls, run_token="runB")
    stray = _spawn("echo", "generator-0", hub.port, token="runA")
    other = _spawn("echo", "generator-7", hub.port, token="runA")  # a name this run does not have: ignored too
    real = None
    try:
        deadline = time.monotonic() + 30
        while sum("another run" in r.getMessage() for r in caplog.records) < 2:  # both said hello first
            assert time.monotonic() < deadline, "the stray's hello never reached the hub"
            hub.recv(0.2)
        real = _spawn("echo", "generator-0", hub.port, token="runB")
        info = hub.wait_for_peers(60)
        assert info["generator-0"]["pid"] == real.pid
        got = [hub.recv(10) for _ in range(20)]
        assert got == [("generator-0", ("own", "generator-0", i)) for i in range(20)]
        hub.send("generator-0", ("ping", 1))
        assert hub.recv(10) == ("generator-0", ("echo", ("ping", 1)))
        time.sleep(TIMEOUT + 1.0)  # beats from both for longer than the timeout
        assert hub.recv(0.5) is None  # the stray's 20 messages never arrived
        hub.check()
        assert hub.state()["generator-0"]["pid"] == real.pid and calls.errors == []
        warnings = [r.getMessage() for r in caplog.records if "another run" in r.getMessage()]
        assert len(warnings) == 2 and all("'runA'" in w for w in warnings), warnings  # once each
        assert {f"pid {stray.pid}", f"pid {other.pid}"} == {w.split("(", 1)[1].split(" on host")[0] for w in warnings}
        for p in (stray, other):
            assert p.wait(TIMEOUT + SLACK) == 3
            assert "HubLost" in p.stdout.read()
        hub.send("generator-0", ("stop",))
        assert "CLEAN_EXIT" in _finish(real)
    finally:
        for p in (stray, other, real):
            if p is not None and p.poll() is None:
                p.kill()
        hub.close()


def test_without_a_token_a_second_run_on_the_port_is_fatal_and_a_bad_token_is_refused():
    from components.trainer.transport import routing_id

    assert routing_id("generator-0") == b"generator-0" and routing_id("generator-0", "ab") == b"generator-0#ab"
    with pytest.raises(ValueError, match=r"run_token must be .*got 'a#b'"):
        routing_id("generator-0", "a#b")
    with _hub(["generator-0"]) as hub:  # no token on the hub: any unknown routing id is an intruder
        other = Peer("generator-0", "127.0.0.1", hub.port, heartbeat_s=HB, timeout_s=TIMEOUT, run_token="runA")
        try:
            with pytest.raises(TransportError, match=r"unexpected process generator-0#runA \(pid \d+"):
                hub.wait_for_peers(5.0)
        finally:
            other.close()


def test_peer_close_is_not_a_loss_and_hub_close_reaches_the_peer():
    calls_hub, calls_peer = Calls(), Calls()
    hub = _hub(["generator-0", "generator-1"], on_lost=calls_hub)
    p0 = Peer("generator-0", "127.0.0.1", hub.port, heartbeat_s=HB, timeout_s=TIMEOUT, on_lost=calls_peer)
    p1 = Peer("generator-1", "127.0.0.1", hub.port, heartbeat_s=HB, timeout_s=TIMEOUT)
    hub.wait_for_peers(10)
    p1.send("last words")
    p1.close()
    assert hub.recv(5) == ("generator-1", "last words")  # a message sent before leaving arrives
    time.sleep(TIMEOUT + 1.0)  # longer than the timeout: a peer that left is not lost
    hub.check()
    assert hub.state()["generator-1"]["state"] == "left"
    with pytest.raises(PeerLost, match="generator-1 .*closed its connection"):
        hub.send("generator-1", "anyone?")
    hub.send("generator-0", ("stop",))
    hub.close()
    assert p0.recv(5) == ("stop",)  # sent before close: delivered first
    t0 = time.monotonic()
    with pytest.raises(HubLost, match=r"learner-0 \(pid \d+ on host .*closed the connection"):
        p0.recv(5)
    assert time.monotonic() - t0 < 5
    p0.close()
    assert calls_hub.errors == [] and calls_peer.errors == []


# ========================================================================================
# real processes
def test_messages_round_trip_in_order_with_several_peers_and_tensors_arrive_bit_equal():
    names = ["learner-1", "generator-0", "generator-1"]
    calls = Calls()
    hub = _hub(names, on_lost=calls)
    procs = [_spawn("echo", n, hub.port, torch=(n == "generator-1")) for n in names]
    try:
        info = hub.wait_for_peers(60)
        assert {info[n]["pid"] for n in names} == {p.pid for p in procs}
        n_msgs = 30
        for i in range(n_msgs):  # interleaved sends to every peer
            for n in names:
                hub.send(n, ("seq", n, i))
        hub.broadcast(("all", -1))
        got = {n: [] for n in names}
        deadline = time.monotonic() + 60
        while sum(map(len, got.values())) < len(names) * (20 + n_msgs + 1):
            assert time.monotonic() < deadline, {n: len(v) for n, v in got.items()}
            m = hub.recv(1.0)
            if m is not None:
                got[m[0]].append(m[1])
        for n in names:  # per-peer order in both directions
            own = [m for m in got[n] if m[0] == "own"]
            echoed = [m[1] for m in got[n] if m[0] == "echo"]
            assert own == [("own", n, i) for i in range(20)]
            assert echoed == [("seq", n, i) for i in range(n_msgs)] + [("all", -1)]
        batch = _tensor_batch(20.0, seed=3)
        hub.send("generator-1", batch)
        name, (tag, back) = hub.recv(60)
        assert (name, tag) == ("generator-1", "echo")
        _assert_bit_equal(batch, back)
        hub.broadcast(("stop",))
        for p in procs:
            assert "CLEAN_EXIT" in _finish(p)
            assert p.returncode == 0
        _wait_all_left(hub)
        hub.check()
    finally:
        hub.close()
        _kill(*procs)
    assert calls.errors == []


@pytest.mark.parametrize("how", ["kill9", "sigstop"])
def test_dead_or_stopped_peer_is_named_and_on_lost_fires_once(how):
    """A stopped peer is named after timeout_s of silence. A killed one closes its connection, and
    is named once drop_grace_s passes without a beat, long before timeout_s (here 10x longer):
    Slurm kills the other tasks of a step KillWait (default 30 s) after one died, and learner-0
    must have recorded which one by then."""
    calls = Calls()
    timeout = 10 * TIMEOUT if how == "kill9" else TIMEOUT
    hub = _hub(["generator-0", "generator-1"], on_lost=calls, timeout_s=timeout)
    assert hub.drop_grace_s == pytest.approx(2 * HB + 1.0)
    procs = {n: _spawn("idle", n, hub.port) for n in ("generator-0", "generator-1")}
    victim = procs["generator-1"]
    try:
        hub.wait_for_peers(60)
        hub.send("generator-1", "ping")
        assert hub.recv(30) == ("generator-1", ("got", "ping"))
        os.kill(victim.pid, signal.SIGKILL if how == "kill9" else signal.SIGSTOP)
        err, waited = _recv_until_lost(hub, timeout + SLACK)
        msg = str(err)
        assert f"generator-1 (pid {victim.pid} on host" in msg and "no heartbeat" in msg, msg
        if how == "sigstop":
            assert waited >= TIMEOUT - 0.5 and "died or hangs" in msg, msg  # not before the timeout
        else:
            assert hub.drop_grace_s - 0.5 <= waited < timeout / 2, waited
            assert "closed its connection to the hub without saying goodbye" in msg and "it died" in msg, msg
        assert "generator-0" not in msg
        with pytest.raises(PeerLost, match="generator-1"):
            hub.check()
        with pytest.raises(PeerLost, match="generator-1"):
            hub.send("generator-0", "anything")  # the run is failed: every call says so
        time.sleep(4 * HB)
        assert len(calls.errors) == 1 and "generator-1" in str(calls.errors[0])
        assert hub.state()["generator-0"]["state"] == "alive"
        if how == "sigstop":  # resumed, it learns it was declared lost and exits by itself
            os.kill(victim.pid, signal.SIGCONT)
            out = _finish(victim, timeout=TIMEOUT + SLACK)
            assert victim.returncode == 3 and "declared generator-1 lost" in out, out
            hub.abort("test over")
            assert "ABORTED test over" in _finish(procs["generator-0"])
        else:  # a second death is recorded, but on_lost is not called again
            os.kill(procs["generator-0"].pid, signal.SIGKILL)
            deadline = time.monotonic() + timeout + SLACK
            while hub.state()["generator-0"]["state"] != "lost":
                assert time.monotonic() < deadline, hub.state()
                time.sleep(0.1)
        time.sleep(4 * HB)
        assert len(calls.errors) == 1  # once
    finally:
        hub.close()
        _kill(*procs.values())


class _RawBeats:
    """A peer's heartbeat connection, by hand (a DEALER named `name` on the hub's heartbeat port),
    so that a test can drop it and open another under the same name."""

    def __init__(self, ctx, hub: Hub, name: str):
        import json

        import zmq

        from components.trainer import liveness as T

        self._beat = [T._BEAT, json.dumps({"name": name, **T._identity()}).encode()]
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, name.encode())
        self.sock.connect(f"tcp://127.0.0.1:{hub.port + 1}")

    def beat(self) -> None:
        self.sock.send_multipart(self._beat)
        time.sleep(HB)

    def beat_for(self, seconds: float) -> "_RawBeats":
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.beat()
        return self

    def drop(self) -> None:
        self.sock.close(linger=0)


def test_a_peer_that_reconnects_is_not_lost_and_one_that_drops_for_good_is():
    """A closed heartbeat connection alone is not a death: a peer that beats again over a new
    connection (a network hiccup) stays alive; one that does not is lost after drop_grace_s."""
    import zmq

    hub = _hub(["generator-0"], timeout_s=10 * TIMEOUT)
    ctx = zmq.Context()
    try:
        conn = _RawBeats(ctx, hub, "generator-0").beat_for(1.0)
        assert hub.state()["generator-0"]["state"] == "alive"
        conn.drop()  # the connection drops ...
        conn = _RawBeats(ctx, hub, "generator-0").beat_for(3 * hub.drop_grace_s)  # ... and the peer is back at once
        assert hub.state()["generator-0"]["state"] == "alive"
        hub.check()
        conn.drop()  # dropped for good
        deadline = time.monotonic() + hub.drop_grace_s + SLACK
        while hub.state()["generator-0"]["state"] != "lost":
            assert time.monotonic() < deadline, hub.state()
            time.sleep(0.05)
        with pytest.raises(PeerLost, match="closed its connection to the hub without saying goodbye"):
            hub.check()
    finally:
        hub.close()
        ctx.destroy(linger=0)


def test_a_dropped_peer_is_lost_and_not_the_peer_that_took_its_file_descriptor():
    """generator-0's connection closes and generator-1 connects right after (the kernel hands it
    the freed file descriptor): generator-0 is lost, generator-1, beating, is not."""
    import zmq

    hub = _hub(["generator-0", "generator-1"], timeout_s=10 * TIMEOUT)
    ctx = zmq.Context()
    try:
        g0 = _RawBeats(ctx, hub, "generator-0")
        for _ in range(5):
            g0.beat()
        assert hub.state()["generator-0"]["state"] == "alive"
        g0.drop()
        g1 = _RawBeats(ctx, hub, "generator-1")
        end = time.monotonic() + 3 * hub.drop_grace_s
        while time.monotonic() < end and hub.state()["generator-0"]["state"] != "lost":
            g1.beat()
        assert hub.state()["generator-0"]["state"] == "lost", hub.state()
        assert hub.state()["generator-1"]["state"] == "alive", hub.state()
        g1.drop()
    finally:
        hub.close()
        ctx.destroy(linger=0)


def test_killed_hub_is_named_by_the_peer_and_on_lost_fires_once():
    hub_proc = _spawn("hub", "generator-0", 0)
    calls = Calls()
    peer = None
    try:
        line = hub_proc.stdout.readline()
        assert line.startswith("PORT "), line + (hub_proc.stdout.read() if hub_proc.poll() is not None else "")
        peer = Peer("generator-0", "127.0.0.1", int(line.split()[1]), heartbeat_s=HB, timeout_s=TIMEOUT, on_lost=calls)
        assert peer.recv(60) == ("ready",)
        time.sleep(3 * HB)  # the hub's pid arrives with its beats
        os.kill(hub_proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(HubLost) as info:
            while time.monotonic() - t0 < TIMEOUT + SLACK:
                peer.recv(0.5)
        assert time.monotonic() - t0 < TIMEOUT + SLACK
        msg = str(info.value)
        assert f"learner-0 (pid {hub_proc.pid} on host" in msg and "no heartbeat" in msg, msg
        time.sleep(4 * HB)
        assert len(calls.errors) == 1 and isinstance(calls.errors[0], HubLost)
    finally:
        if peer is not None:
            peer.close()
        _kill(hub_proc)


def test_busy_main_thread_is_not_declared_lost():
    calls = Calls()
    hub = _hub(["learner-1"], on_lost=calls)
    proc = _spawn("busy", "learner-1", hub.port, torch=True)
    try:
        hub.wait_for_peers(60)
        assert hub.recv(60) == ("learner-1", ("ready",))
        hub.send("learner-1", ("go",))
        got = None
        deadline = time.monotonic() + 60
        while got is None:
            assert time.monotonic() < deadline, "the busy peer never finished"
            got = hub.recv(1.0)  # raises PeerLost if the busy peer were declared lost
        name, (tag, phases) = got
        assert tag == "done"
        # every phase kept the main thread away longer than the liveness timeout
        assert min(phases.values()) > TIMEOUT, phases
        hub.send("learner-1", ("stop",))
        assert "CLEAN_EXIT" in _finish(proc)
        assert calls.errors == []
    finally:
        hub.close()
        _kill(proc)


def test_abort_reaches_every_peer():
    names = ["learner-1", "generator-0", "generator-1"]
    calls = Calls()
    hub = _hub(names, on_lost=calls)
    procs = [_spawn("idle", n, hub.port) for n in names]
    try:
        hub.wait_for_peers(60)
        for n in names:  # a backlog of ordinary messages does not delay the abort
            for i in range(50):
                hub.send(n, ("work", i))
        assert sorted(hub.abort("generator-3 failed: boom")) == sorted(names)
        for p in procs:
            out = _finish(p)
            assert p.returncode == 0 and "ABORTED generator-3 failed: boom" in out, out
        _wait_all_left(hub)  # peers that exit after an abort leave; they are not lost
        hub.check()
        assert calls.errors == []
    finally:
        hub.close()
        _kill(*procs)


def test_abort_overtakes_queued_messages_and_a_peer_that_stays_open_fires_on_lost():
    calls = Calls()
    with _hub(["generator-0"]) as hub:
        peer = Peer("generator-0", "127.0.0.1", hub.port, heartbeat_s=HB, timeout_s=TIMEOUT, on_lost=calls)
        try:
            hub.wait_for_peers(10)
            for i in range(5):
                hub.send("generator-0", ("work", i))
            hub.abort("stop now")
            time.sleep(5 * HB)
            with pytest.raises(Aborted, match="stop now") as info:
                peer.recv(1.0)  # the abort came on the heartbeat socket too: queued work waits
            assert info.value.reason == "stop now"
            assert calls.errors == []
            time.sleep(TIMEOUT + 1.0)  # still open long after the abort: stuck, on_lost fires
            assert len(calls.errors) == 1 and isinstance(calls.errors[0], Aborted)
        finally:
            peer.close()
