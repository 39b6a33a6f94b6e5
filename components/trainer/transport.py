"""Messages between the processes of one run (rollouts, step batches, control), with heartbeats.

One run = T learner ranks + G generators, on one machine or across Slurm nodes. Learner rank 0
is the HUB: it binds two TCP ports; every other process is a PEER that connects to it.

    port      messages    hub ROUTER  <->  peer DEALER (routing id = the peer's name)
    port + 1  heartbeats  hub ROUTER  <->  peer DEALER, each owned by a background thread

    hub = Hub("learner-0", host="0.0.0.0", port=29600, peers=["learner-1", "generator-0"])
    hub.wait_for_peers(timeout_s=300)            # every peer said hello (or: names the missing)
    hub.send("generator-0", Work(order))         # any picklable object (the trainer: messages.py); CPU tensors zero-copy
    hub.broadcast(PushWeights(update))           # encoded once, sent to every peer
    got = hub.recv(timeout_s=1.0)                # (peer name, object) | None
    ...
    peer = Peer("generator-0", hub_host="node01", port=29600)
    msg = peer.recv(timeout_s=1.0)               # object | None
    peer.send(GroupDone(rollout, proc))

`Hub(port=0)` binds a free pair (port, port + 1) and reports it in `hub.port` (local launches).
`run_token` (the same on the hub and every peer of one run: roles.Endpoints.token) makes each
process's routing id "name#token": a stray process of another run that reaches a reused port (a
cancelled job's generator) is ignored with a warning instead of claiming one of this run's names.

Why ZeroMQ rather than torch.distributed for rollouts and control
------------------------------------------------------------------
- Point-to-point and asynchronous: a generator pushes a rollout whenever a group finishes, and
  the hub sends work whenever it likes. torch.distributed send/recv and collectives need the
  other process to enter the matching call at the same time; one process that is late, busy in
  a 60 s forward pass or dead blocks its partner inside C++ (until a 30 min NCCL/gloo timeout).
- Works across nodes over plain TCP with no rendezvous beyond one address and port; peers may
  connect in any order, reconnect, and leave without tearing down a process group.
- Liveness is per connection: every process beats from its own thread on its own socket, so
  the hub names the exact process that died or hangs within `timeout_s`, and every process
  learns that the run is over even while its main thread is stuck in a collective (`on_lost`).
- Arbitrary Python objects (rollouts: lists of ints/floats) without padding them into tensors;
  CPU tensors travel as out-of-band pickle-5 buffers (no extra copy on the receiving side).
- It is the choice of vLLM (engine core <-> front end) and prime-rl (orchestrator <-> trainer).
Weight tensors do NOT use this transport: a separate torch.distributed group broadcasts them.

Liveness
--------
Every process runs a heartbeat thread (liveness.py) on its own socket. A peer that is killed,
stopped or silent for `timeout_s` (or whose heartbeat connection closed: named within seconds) is
LOST: `Hub.recv`, `Hub.send`, `Hub.check` raise `PeerLost` naming it (name, pid, host), and
`on_lost(error)` is called once from the heartbeat thread; a peer raises `HubLost` when the hub is
silent or never answered, and calls its `on_lost(error)`. `on_lost` must not wait for the main
thread (it is typically stuck in a collective with the dead process): log, record the failure,
`os._exit(1)`. The errors are liveness.py's, re-exported here.

Shutdown and abort
------------------
`Hub.abort(reason)` sends ("abort", reason) to every live peer, on both sockets: a peer's `recv`
and `check` then raise `Aborted` (with `.reason`) even if older messages are still queued, so
the peer can clean up and exit. A peer that received an abort and is still open `timeout_s`
later is stuck: its `on_lost(Aborted)` fires. `Peer.close()` tells the hub it leaves (it is
then not declared lost; `Hub.send` to it raises); a peer that exits WITHOUT close() (os._exit,
a crash) is declared lost after `timeout_s`, so send your error message before exiting. `Hub.close()` tells every peer, after any
message already sent: a peer's `recv` raises `HubLost` ("closed"); a peer stuck elsewhere
sees the hub's silence after `timeout_s` (HubLost, on_lost). Send your own stop message (the trainer's `messages.Stop`) first
for an orderly end. `close()` joins the heartbeat thread and closes the sockets with a linger
of `LINGER_S` seconds, so no process hangs at exit.

Serialization: pickle protocol 5 (trusted processes only: pickle runs code). Buffers of at
least `OUT_OF_BAND_MIN_BYTES` (CPU torch tensors, numpy arrays) travel as separate frames: the
sender copies each once into a ZeroMQ message (so the caller may modify its tensors as soon as
`send` returns; `broadcast` copies once for all peers), the receiver's tensors point into the
received frames (no copy). Tensors arrive as plain contiguous CPU tensors with the same dtype,
shape, values and `requires_grad` (nn.Parameter arrives as a tensor; strides are not kept).
Tensors on another device, sparse or quantized tensors and tensor subclasses (DTensor) are
refused with a clear error: send `.cpu()` / `.full_tensor()` / plain tensors.
"""

from __future__ import annotations

import io
import json
import logging
import pickle
import random
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

import zmq

from components.trainer.liveness import (
    _ABORT,
    _BEAT,
    _BYE,
    _HELLO,
    _MSG,
    Aborted,
    HubLost,
    PeerLost,
    PeersMissing,
    TransportError,
    _HubHeartbeats,
    _identity,
    _PeerHeartbeats,
    _who,
)

log = logging.getLogger(__name__)

__all__ = [
    "Hub",
    "Peer",
    "routing_id",
    # liveness.py's errors, part of this module's API (Hub and Peer raise them)
    "TransportError",
    "PeerLost",
    "PeersMissing",
    "HubLost",
    "Aborted",
    "encode",
    "decode",
    "LINGER_S",
    "OUT_OF_BAND_MIN_BYTES",
]

LINGER_S = 1.0  # how long close() may wait for messages still being sent
OUT_OF_BAND_MIN_BYTES = 64 * 1024  # smaller buffers stay inside the pickle stream
_POLL_SLICE_S = 0.1  # main-thread waits look at the heartbeat thread's verdict this often


# =========================================================================================
# serialization
def _rebuild_tensor(buf, dtype, shape, requires_grad):
    """Inverse of _reduce_tensor: a CPU tensor over `buf` (a received frame: no copy)."""
    import torch

    view = memoryview(buf)
    if view.nbytes == 0:
        t = torch.empty(shape, dtype=dtype)
    else:
        if view.readonly:  # only for buffers pickled in-band as bytes; ours come writable
            view = memoryview(bytearray(view))
        flat = torch.frombuffer(view, dtype=torch.uint8)  # [nbytes], shares memory with the frame
        t = flat.view(dtype).view(shape)  # [*shape]
        if t.data_ptr() % t.element_size():  # a frame at an odd address: copy once to align
            t = t.clone()
    if requires_grad:
        t.requires_grad_(True)
    return t


def _reduce_tensor(t):
    import torch

    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise TypeError(f"the transport sends plain torch tensors; got a {type(t).__name__} (send .full_tensor() or a plain tensor)")
    if t.device.type != "cpu":
        raise ValueError(f"the transport sends CPU tensors only; got a tensor on {t.device} of shape {tuple(t.shape)} (call .cpu() first)")
    if t.layout != torch.strided or t.is_quantized:
        raise TypeError(f"the transport sends dense tensors only; got layout {t.layout} (quantized={t.is_quantized}): densify it first")
    data = t.detach().resolve_conj().resolve_neg().contiguous()  # [*shape], row-major
    raw = data.reshape(-1).view(torch.uint8).numpy()  # [numel * itemsize] bytes, same memory
    return _rebuild_tensor, (pickle.PickleBuffer(raw), data.dtype, tuple(data.shape), bool(t.requires_grad))


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        torch = sys.modules.get("torch")  # no torch imported: no tensors to send
        if torch is not None and isinstance(obj, torch.Tensor):
            return _reduce_tensor(obj)
        return NotImplemented


def encode(obj: Any) -> list:
    """`obj` as frames: [pickle stream, out-of-band buffer, ...] (pickle protocol 5).

    Buffers of at least OUT_OF_BAND_MIN_BYTES are returned as zmq.Frame objects holding their
    own copy (the caller may modify its tensors afterwards); the stream is bytes."""
    buffers: list = []

    def keep_out_of_band(buf: pickle.PickleBuffer) -> bool:
        if buf.raw().nbytes < OUT_OF_BAND_MIN_BYTES:
            return True  # true: serialize in-band
        buffers.append(buf)
        return False

    stream = io.BytesIO()
    _Pickler(stream, protocol=5, buffer_callback=keep_out_of_band).dump(obj)
    frames: list = [stream.getvalue()]
    for buf in buffers:
        frames.append(zmq.Frame(buf.raw(), copy=True))  # the one copy on the sending side
    return frames


def decode(frames: list) -> Any:
    """Inverse of encode; accepts zmq.Frame, bytes or memoryview frames (frames are not copied)."""
    views = [f.buffer if isinstance(f, zmq.Frame) else memoryview(f) for f in frames]
    return pickle.loads(views[0], buffers=views[1:])


# =========================================================================================
# helpers
def _check_name(what: str, name) -> str:
    if not isinstance(name, str) or not name or not name.isprintable() or len(name.encode()) > 200:
        raise ValueError(f"{what} must be a non-empty printable string of at most 200 bytes, got {name!r}")
    return name


def routing_id(name: str, run_token: str = "") -> bytes:
    """A process's ZeroMQ routing id: its name, plus the run's token when the run has one
    ("generator-0#3f9c..."), so a stray process of another run (a cancelled job's generator
    that reaches a reused port) never takes a name of this one."""
    if not isinstance(run_token, str) or "#" in run_token or not run_token.isprintable():
        raise ValueError(f"run_token must be a printable string without '#', got {run_token!r}")
    return f"{name}#{run_token}".encode() if run_token else name.encode()


def _payload_info(kind: bytes, payload: Optional[bytes]) -> dict:
    """The {"name", "pid", "host"} a hello or beat carries ({} for other frames or bad JSON)."""
    if kind not in (_HELLO, _BEAT) or not payload:
        return {}
    try:
        info = json.loads(payload)
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}


def _check_timing(heartbeat_s: float, timeout_s: float) -> None:
    if not heartbeat_s > 0:
        raise ValueError(f"heartbeat_s must be > 0, got {heartbeat_s!r}")
    if not timeout_s >= 2 * heartbeat_s:
        raise ValueError(f"timeout_s must be at least 2 x heartbeat_s ({2 * heartbeat_s} s), got {timeout_s!r}")


def _check_port(port) -> int:
    if not isinstance(port, int) or not 0 <= port <= 65534:
        raise ValueError(f"port must be an int in 1..65534 (or 0: pick a free pair), got {port!r}; the hub uses port and port + 1")
    return port


def _new_context() -> zmq.Context:
    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, int(LINGER_S * 1000))  # default for every socket of this context
    return ctx


def _send_frames(sock: zmq.Socket, head: list, frames: list, *, deadline: Optional[float], raise_if_failed: Callable[[], None], describe: str) -> None:
    """Send head + frames as one message; wait (liveness-checked) while the receiver's queue is full.

    `head` frames (routing id, kind) are small bytes; ZeroMQ delivers a multipart message
    atomically once its first frame is accepted, so only the first send can return EAGAIN
    (full queue) or EHOSTUNREACH (a ROUTER peer that is not connected right now)."""
    parts = list(head) + list(frames)
    while True:
        raise_if_failed()
        try:
            sock.send(parts[0], zmq.NOBLOCK | (zmq.SNDMORE if len(parts) > 1 else 0), copy=False)
            break
        except zmq.Again:
            pass
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
        if deadline is not None and time.monotonic() > deadline:
            raise TransportError(f"{describe}: not accepted before the send timeout (the receiver is alive but its queue stays full, or it is not connected)")
        time.sleep(0.01)
    for i, part in enumerate(parts[1:], start=2):
        sock.send(part, zmq.SNDMORE if i < len(parts) else 0, copy=False)


def _deadline(timeout_s: Optional[float]) -> Optional[float]:
    if timeout_s is None:
        return None
    if not timeout_s >= 0:
        raise ValueError(f"timeout_s must be >= 0 or None, got {timeout_s!r}")
    return time.monotonic() + timeout_s


# =========================================================================================
# hub
@dataclass
class _PeerState:
    name: str
    state: str = "waiting"  # waiting -> alive -> left | lost
    connected: bool = False  # hello received on the message socket
    pid: Optional[int] = None
    host: Optional[str] = None
    last_seen: Optional[float] = None  # monotonic time of its last beat (or hello)
    error: Optional[TransportError] = None
    fd: Optional[int] = None  # the hub's file descriptor of its heartbeat connection (the last beat's)
    dropped_at: Optional[float] = None  # monotonic time that connection closed, no beat since


class Hub(_HubHeartbeats):
    """The hub end, on learner rank 0: binds tcp://host:port (messages) and port + 1 (heartbeats).

    peers: the names of every other process of the run ("learner-1", "generator-0", ...).
    on_lost(error): called once, from the heartbeat thread, with the PeerLost of the first peer
    declared lost (see the module docstring for what a handler should do). run_token: this run's
    token; a process with one of `peers`' names and another token is ignored (logged once)."""

    def __init__(
        self,
        name: str = "learner-0",
        host: str = "0.0.0.0",
        port: int = 0,
        peers: tuple = (),
        heartbeat_s: float = 2.0,
        timeout_s: float = 30.0,
        on_lost: Optional[Callable[[TransportError], None]] = None,
        run_token: str = "",
    ):
        self.name = _check_name("hub name", name)
        names = [_check_name("peer name", p) for p in peers]
        dup = sorted({p for p in names if names.count(p) > 1})
        if dup:
            raise ValueError(f"peer names must be unique; repeated: {dup}")
        if name in names:
            raise ValueError(f"the hub's name {name!r} is also listed among its peers {names}")
        _check_timing(heartbeat_s, timeout_s)
        _check_port(port)
        self.host, self.heartbeat_s, self.timeout_s, self.on_lost = host, float(heartbeat_s), float(timeout_s), on_lost
        # a peer whose heartbeat connection closed and that has not beaten since is lost after this
        # (a reconnect, e.g. after a network hiccup, beats again within about one period)
        self.drop_grace_s = min(self.timeout_s, 2 * self.heartbeat_s + 1.0)
        self._peers = {p: _PeerState(p) for p in names}
        self.run_token = run_token
        self._ident = {p: routing_id(p, run_token) for p in names}  # peer name -> routing id
        self._by_ident = {v: k for k, v in self._ident.items()}
        self._strays: set = set()  # routing ids of another run's processes, ignored (logged once)
        self._lock = threading.Lock()
        self._inbox: deque = deque()
        self._fatal: Optional[TransportError] = None  # first lost peer, or a name clash
        self._fired = False
        self._pending_abort: Optional[str] = None
        self._stop = threading.Event()
        self._closed = False
        self._ctx = _new_context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._hb = self._ctx.socket(zmq.ROUTER)
        for s in (self._sock, self._hb):
            s.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting peer takes its name back
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to an absent peer is an error, not a silent drop
        try:
            self.port = self._bind(port)
            # the heartbeat connections' closes: a peer that dies (kill -9, out of memory, a crash)
            # closes its TCP connection at once, so it is named after drop_grace_s, not timeout_s
            self._monitor = self._hb.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        self._thread = threading.Thread(target=self._heartbeat_loop, name=f"transport-heartbeat-{name}", daemon=True)
        self._thread.start()  # from here on only that thread touches self._hb

    def _bind(self, port: int) -> int:
        if port:
            for sock, p, what in ((self._sock, port, "messages"), (self._hb, port + 1, "heartbeats")):
                try:
                    sock.bind(f"tcp://{self.host}:{p}")
                except zmq.ZMQError as e:
                    raise TransportError(f"hub {self.name} cannot bind tcp://{self.host}:{p} ({what}; the hub uses port {port} and {port + 1}): {e}") from e
            return port
        rng = random.Random()
        for _ in range(200):  # a free contiguous pair; binding is the test, so no race
            p = rng.randrange(20000, 60000)
            try:
                self._sock.bind(f"tcp://{self.host}:{p}")
            except zmq.ZMQError:
                continue
            try:
                self._hb.bind(f"tcp://{self.host}:{p + 1}")
                return p
            except zmq.ZMQError:
                self._sock.unbind(f"tcp://{self.host}:{p}")
        raise TransportError(f"hub {self.name}: found no free pair of ports (port, port + 1) on {self.host} in 200 tries")

    # ---------------------------------------------------------------- public API
    @property
    def peers(self) -> list:
        return list(self._peers)

    def wait_for_peers(self, timeout_s: float) -> dict:
        """Wait until every expected peer said hello; returns {name: {"pid", "host"}}.

        Raises PeersMissing naming the missing peers after `timeout_s`, or PeerLost."""
        deadline = _deadline(timeout_s)
        while True:
            self.check()
            missing = [p for p, st in self._peers.items() if not st.connected]
            if not missing:
                return {p: {"pid": st.pid, "host": st.host} for p, st in self._peers.items()}
            left = deadline - time.monotonic()
            if left <= 0:
                here = [p for p in self._peers if p not in missing]
                raise PeersMissing(
                    f"hub {self.name} waited {timeout_s:g} s for its peers on tcp://{self.host}:{self.port}: missing {', '.join(missing)}"
                    f" (connected: {', '.join(here) or 'none'}); did they start, and can they reach this host and port?"
                )
            self._pump(min(left, _POLL_SLICE_S))

    def send(self, peer: str, obj: Any, timeout_s: Optional[float] = None) -> None:
        """Send `obj` to `peer` (in order per peer). Waits while the peer's queue is full, as
        long as the peer is alive; raises PeerLost if it is lost or left, TransportError after
        `timeout_s` (None: no limit beyond the peer's liveness)."""
        self._send_to([peer], encode(obj), _deadline(timeout_s))

    def broadcast(self, obj: Any, peers: Optional[list] = None, timeout_s: Optional[float] = None) -> None:
        """Send `obj` to every peer (default: all, in the order given to Hub); encoded once."""
        names = list(self._peers) if peers is None else list(peers)
        self._send_to(names, encode(obj), _deadline(timeout_s))

    def recv(self, timeout_s: float) -> Optional[tuple]:
        """The next message as (peer name, object), or None after `timeout_s`.

        Raises PeerLost as soon as any peer is declared lost (a peer that left is not lost)."""
        deadline = _deadline(timeout_s)
        while True:
            self.check()
            if self._inbox:
                return self._inbox.popleft()
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._pump(min(left, _POLL_SLICE_S))

    def check(self) -> None:
        """Raise PeerLost (or TransportError) if a peer was lost or an unexpected process connected."""
        if self._closed:
            raise TransportError(f"hub {self.name} is closed")
        if self._fatal is not None:
            raise self._fatal

    def state(self) -> dict:
        """{peer name: {"state": waiting|alive|left|lost, "pid", "host", "silent_s"}} (for logs)."""
        now = time.monotonic()
        with self._lock:
            return {
                p: {"state": st.state, "pid": st.pid, "host": st.host, "silent_s": None if st.last_seen is None else now - st.last_seen}
                for p, st in self._peers.items()
            }

    def abort(self, reason: str) -> list:
        """Send ("abort", reason) to every live peer; returns their names. Never raises for lost peers."""
        reason = str(reason)
        sent = []
        with self._lock:
            targets = [p for p, st in self._peers.items() if st.connected and st.state not in ("lost", "left")]
            self._pending_abort = reason  # the heartbeat thread sends it on the heartbeat socket too
        for p in targets:
            try:
                self._sock.send_multipart([self._ident[p], _ABORT, reason.encode()], zmq.NOBLOCK)
                sent.append(p)
            except zmq.ZMQError:
                pass  # full or gone: the heartbeat copy still reaches a live one
        return sent

    def close(self) -> None:
        """Tell every connected peer the hub closes (after anything already sent), stop the
        heartbeat thread, close the sockets (linger LINGER_S). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for p, st in self._peers.items():
            if st.connected and st.state not in ("lost", "left"):
                try:
                    self._sock.send_multipart([self._ident[p], _BYE, b""], zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        self._stop.set()
        self._thread.join(timeout=self.heartbeat_s + 10)
        self._sock.close()
        if not self._thread.is_alive():  # it closed its socket: term() cannot block
            self._ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---------------------------------------------------------------- internals
    def _send_to(self, names: list, frames: list, deadline: Optional[float]) -> None:
        for p in names:
            if p not in self._peers:
                raise ValueError(f"unknown peer {p!r}; the hub's peers are {list(self._peers)}")
        for p in names:
            st = self._peers[p]
            if not st.connected:
                self._pump(0)  # its hello may be waiting in the socket
            if not st.connected:
                raise TransportError(f"peer {p} has not connected to hub {self.name} yet (call wait_for_peers first)")

            def raise_if_failed(st=st):
                self.check()
                if st.state in ("lost", "left"):
                    raise st.error

            _send_frames(self._sock, [self._ident[p], _MSG], frames, deadline=deadline, raise_if_failed=raise_if_failed, describe=f"hub {self.name} -> {p}")

    def _pump(self, wait_s: float) -> None:
        """Wait up to wait_s for the message socket, then handle everything that arrived."""
        if not self._sock.poll(int(wait_s * 1000)):
            return
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(frames)

    def _peer_of(self, ident: bytes, kind: bytes, payload: Optional[bytes], port: int) -> Optional[_PeerState]:
        """The peer a frame's routing id belongs to. A process of ANOTHER run (a routing id with a
        different run token, whatever its name) is ignored, with one warning naming it; any other
        unknown process is fatal (a misnamed process of this run, or one without a token)."""
        name = self._by_ident.get(ident)
        if name is not None:
            return self._peers[name]
        text = ident.decode(errors="replace")
        info = _payload_info(kind, payload)
        base, _, token = text.partition("#")
        if self.run_token and token and token != self.run_token:  # another run's process, whatever its name
            if ident not in self._strays:
                self._strays.add(ident)
                log.warning("hub %s on port %d: ignoring %s, a process of another run (run token %r, this run's %r)",
                            self.name, port, _who(base, info.get("pid"), info.get("host")),
                            token, self.run_token)
            return None
        who = _who(text, info.get("pid"), info.get("host"))
        what = f"an unexpected process {who} connected" if port == self.port else f"heartbeats from an unexpected process {who}"
        self._set_fatal(TransportError(f"hub {self.name} on port {port}: {what}; expected {list(self._peers)} "
                                       "(two runs sharing a port, or a misnamed process?)"))
        return None

    def _handle(self, frames: list) -> None:
        kind = frames[1].bytes
        st = self._peer_of(frames[0].bytes, kind, frames[2].bytes if len(frames) > 2 else None, self.port)
        if st is None:
            return
        name = st.name
        if kind == _HELLO:
            info = json.loads(frames[2].bytes)
            with self._lock:
                self._claim(st, info)
                st.connected = True
                if st.state == "waiting":
                    st.state, st.last_seen = "alive", time.monotonic()
        elif kind == _MSG:
            if st.state != "lost":
                self._inbox.append((name, decode(frames[2:])))

    def _claim(self, st: _PeerState, info: dict) -> None:
        """Record a peer's pid/host; two processes using one name is fatal (under self._lock)."""
        pid, host = info.get("pid"), info.get("host")
        if st.pid is not None and (st.pid, st.host) != (pid, host):
            self._fatal = self._fatal or TransportError(
                f"two processes claim the name {st.name}: pid {st.pid} on host {st.host} and pid {pid} on host {host}")
        st.pid, st.host = pid, host

    def _set_fatal(self, error: TransportError) -> None:
        with self._lock:
            if self._fatal is None:
                self._fatal = error


# =========================================================================================
# peer
class Peer(_PeerHeartbeats):
    """A peer end (every process but learner rank 0): connects to tcp://hub_host:port and port + 1.

    connect_timeout_s: how long the hub may take to answer the first time (default timeout_s),
    measured from the Peer's creation. on_lost(error): called once, from the heartbeat thread,
    with HubLost when the hub is silent, or with Aborted when an abort was received and the
    peer is still open `timeout_s` later. run_token: the run's token (the hub's)."""

    def __init__(
        self,
        name: str,
        hub_host: str,
        port: int,
        heartbeat_s: float = 2.0,
        timeout_s: float = 30.0,
        on_lost: Optional[Callable[[TransportError], None]] = None,
        connect_timeout_s: Optional[float] = None,
        run_token: str = "",
    ):
        self.name = _check_name("peer name", name)
        _check_timing(heartbeat_s, timeout_s)
        if not isinstance(port, int) or not 1 <= port <= 65534:
            raise ValueError(f"port must be the hub's port, an int in 1..65534, got {port!r}")
        self.connect_timeout_s = float(timeout_s if connect_timeout_s is None else connect_timeout_s)
        if not self.connect_timeout_s > 0:
            raise ValueError(f"connect_timeout_s must be > 0, got {connect_timeout_s!r}")
        self.hub_host, self.port = hub_host, port
        self.heartbeat_s, self.timeout_s, self.on_lost = float(heartbeat_s), float(timeout_s), on_lost
        self._lock = threading.Lock()
        self._error: Optional[TransportError] = None  # HubLost (sticky)
        self._aborted: Optional[str] = None
        self._aborted_at: Optional[float] = None
        self._hub = {"name": "hub", "pid": None, "host": hub_host}
        self._hub_heard: Optional[float] = None  # monotonic time of the last message from the hub (main thread)
        self._fired = False
        self._stop = threading.Event()
        self._closed = False
        me = {"name": name, **_identity()}
        self._me = json.dumps(me).encode()
        self._ctx = _new_context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._hb = self._ctx.socket(zmq.DEALER)
        ident = routing_id(name, run_token)
        for s in (self._sock, self._hb):
            s.setsockopt(zmq.IDENTITY, ident)
        try:
            self._sock.connect(f"tcp://{hub_host}:{port}")
            self._hb.connect(f"tcp://{hub_host}:{port + 1}")
        except zmq.ZMQError as e:
            self._ctx.destroy(linger=0)
            raise TransportError(f"peer {name} cannot connect to the hub at tcp://{hub_host}:{port}: {e}") from e
        self._sock.send_multipart([_HELLO, self._me])  # queued until the connection is up
        self._thread = threading.Thread(target=self._heartbeat_loop, name=f"transport-heartbeat-{name}", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- public API
    def send(self, obj: Any, timeout_s: Optional[float] = None) -> None:
        """Send `obj` to the hub. Waits while the hub's queue is full, as long as the hub is
        alive; raises HubLost / Aborted, or TransportError after `timeout_s` (None: no limit)."""
        frames = encode(obj)
        _send_frames(self._sock, [_MSG], frames, deadline=_deadline(timeout_s), raise_if_failed=self.check, describe=f"peer {self.name} -> hub")

    def recv(self, timeout_s: float) -> Any:
        """The next object from the hub, or None after `timeout_s`.

        Raises Aborted after Hub.abort (even before older queued messages), HubLost when the hub
        is lost or closed."""
        deadline = _deadline(timeout_s)
        while True:
            self.check()
            left = deadline - time.monotonic()
            if self._sock.poll(int(max(0.0, min(left, _POLL_SLICE_S)) * 1000)):
                frames = self._sock.recv_multipart(copy=False)
                self._hub_heard = time.monotonic()  # proof of life too (its beats may not have come yet)
                kind = frames[0].bytes
                if kind == _MSG:
                    return decode(frames[1:])
                if kind == _ABORT:
                    self._set_aborted(frames[1].bytes.decode(errors="replace"))
                elif kind == _BYE:
                    self._set_error(HubLost(f"the hub {self._hub_who()} closed the connection (the run ended or failed there)"))
                continue
            if left <= 0:
                return None

    def check(self) -> None:
        """Raise Aborted if the hub aborted, HubLost if it is lost or closed."""
        if self._closed:
            raise TransportError(f"peer {self.name} is closed")
        if self._aborted is not None:
            raise Aborted(self._aborted)
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Tell the hub this peer leaves, stop the heartbeat thread, close (linger LINGER_S). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout=self.heartbeat_s + 10)
        self._sock.close()
        if not self._thread.is_alive():
            self._ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---------------------------------------------------------------- internals
    def _hub_who(self) -> str:
        h = self._hub
        who = _who(h["name"], h["pid"], h["host"]) if h["pid"] is not None else "(pid unknown: none of its beats arrived)"
        return f"{who} at tcp://{self.hub_host}:{self.port}"

    def _set_error(self, error: TransportError) -> bool:
        with self._lock:
            if self._error is not None:
                return False
            self._error = error
            return True

    def _set_aborted(self, reason: str) -> None:
        with self._lock:
            if self._aborted is None:
                self._aborted, self._aborted_at = reason, time.monotonic()
