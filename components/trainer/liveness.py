"""Liveness of the processes of one run: the heartbeats of transport.py's Hub and Peer, and the
errors that name a process that died, hangs or left.

    port + 1  heartbeats  hub ROUTER  <->  peer DEALER, each owned by a background thread

    class Hub(_HubHeartbeats): ...     # transport.py; its thread runs _HubHeartbeats._heartbeat_loop
    class Peer(_PeerHeartbeats): ...   # transport.py; its thread runs _PeerHeartbeats._heartbeat_loop
    except PeerLost as err: ...        # raised by Hub.recv / send / check (re-exported by transport.py)

Every process runs a heartbeat thread with its own sockets (ZeroMQ sockets are not
thread-safe) that sends a beat carrying (name, pid, host) every `heartbeat_s`. A process whose
main thread is busy (a long forward pass, a torch op, time.sleep, a Python loop) keeps beating;
a process that is killed (kill -9) or stopped (SIGSTOP) stops. A peer silent for `timeout_s` is
LOST; so is a peer whose heartbeat connection CLOSED (a dead process's kernel closes its sockets:
kill -9, out of memory, a crash) and that sent no beat over a new one within `drop_grace_s`
(2 heartbeats + 1 s): a dead peer is named in seconds, before Slurm, which kills a step's other
tasks KillWait (default 30 s) after one died, ends the hub too. Either way `Hub.recv`,
`Hub.send`, `Hub.check` raise `PeerLost` naming it (name, pid, host), and `on_lost(error)` is
called ONCE (for the first loss) from the hub's heartbeat thread. Likewise a peer raises
`HubLost` when the hub is silent for `timeout_s` (no beat and no message: a message from the
hub proves it alive too, so a hub that dies before its first beat arrived is not waited on for
`connect_timeout_s`), or never answered within `connect_timeout_s` of the Peer's creation, and
calls its `on_lost(error)` once. A peer the hub declared lost that comes back (SIGCONT) is told
so and raises `HubLost` at once.
Heartbeats prove that a process is alive and scheduled, not that it makes progress: a main
thread that deadlocks in Python still beats. Waits for progress are the caller's (`recv` always
takes a timeout). A C extension that holds the GIL for longer than `timeout_s` stops the beats
(torch ops, zmq and time.sleep release it). If the heartbeat thread itself was not scheduled for
a while (the whole process stopped or starved), that gap is not counted against the others.

`on_lost` runs in the heartbeat thread, typically while the main thread is stuck in a
torch.distributed collective with the dead process, so it must not wait for the main thread.
What a default handler does (the trainer decides): log the error to stderr; on the hub, write
`run.json` with status "failed" and the error; then `os._exit(1)` (sys.exit would only end the
heartbeat thread). A peer whose hub is lost does the same without touching the run directory.

The heartbeat classes here hold only the heartbeat threads' code; the state they read and write
(peers, locks, sockets, the first fatal error) belongs to the Hub and Peer that inherit them, and
only the heartbeat thread touches the heartbeat socket.
"""

from __future__ import annotations

import json
import logging
import os
import socket as _socket
import time
from typing import Callable, Optional

import zmq
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger(__name__)

__all__ = [
    "TransportError",
    "PeerLost",
    "PeersMissing",
    "HubLost",
    "Aborted",
]

# message socket frame kinds (after the routing id on the hub side)
_MSG, _HELLO, _BYE, _ABORT = b"msg", b"hello", b"bye", b"abort"
# heartbeat socket frame kinds
_BEAT, _LOST = b"beat", b"lost"


class TransportError(RuntimeError):
    """A message could not be delivered, or the set of processes is not what was expected."""


class PeerLost(TransportError):
    """A peer process died, hangs, or left: the message names it (name, pid, host)."""


class PeersMissing(TransportError):
    """Some peers never said hello within `Hub.wait_for_peers`'s timeout: the message names them."""


class HubLost(TransportError):
    """The hub (learner rank 0) died, hangs or closed."""


class Aborted(TransportError):
    """The hub aborted the run; `.reason` is the hub's reason."""

    def __init__(self, reason: str):
        super().__init__(f"the hub aborted the run: {reason}")
        self.reason = reason

def _identity() -> dict:
    return {"pid": os.getpid(), "host": _socket.gethostname()}


def _who(name: str, pid, host) -> str:
    if pid is None:
        return f"{name} (pid unknown)"
    return f"{name} (pid {pid} on host {host})"


def _fire(callback: Optional[Callable], error: BaseException) -> None:
    if callback is None:
        return
    try:
        callback(error)
    except BaseException:  # noqa: BLE001 - the heartbeat thread must survive a failing handler
        log.exception("on_lost handler raised")



def _source_fd(frame: zmq.Frame) -> Optional[int]:
    """The file descriptor of the connection a received frame came over (ZMQ_SRCFD; None where
    this libzmq no longer has it: closed connections are then only found by their silence)."""
    try:
        return int(frame.get(zmq.SRCFD))
    except (AttributeError, zmq.ZMQError, ValueError, TypeError):
        return None


def _try_send(sock: zmq.Socket, parts: list) -> None:
    try:
        sock.send_multipart(parts, zmq.NOBLOCK)
    except zmq.ZMQError:
        pass  # a full queue or an unknown routing id: beats are best effort



# =========================================================================================
# hub
class _HubHeartbeats:
    """The hub's heartbeat thread (transport.Hub): beats to every live peer, reads theirs, watches
    its connections close, declares peers lost and calls `on_lost` once. Uses the Hub's state
    (`_peers`, `_ident`, `_lock`, `_hb`, `_monitor`, `_stop`, ...) and its `_peer_of` / `_claim` /
    `_set_fatal`."""

    def _heartbeat_loop(self) -> None:
        hb, period = self._hb, self.heartbeat_s
        try:
            me = json.dumps({"name": self.name, **_identity()}).encode()
            poller = zmq.Poller()
            poller.register(hb, zmq.POLLIN)
            poller.register(self._monitor, zmq.POLLIN)
            next_beat = last_iter = time.monotonic()
            while not self._stop.is_set():
                now = time.monotonic()
                gap, last_iter = now - last_iter, now
                lost_now = []
                with self._lock:
                    if gap > max(2 * period, 1.0):  # this thread was not scheduled: not their silence
                        for st in self._peers.values():
                            if st.last_seen is not None:
                                st.last_seen = min(now, st.last_seen + gap - period)
                    grace = self.drop_grace_s
                    for st in self._peers.values():
                        if st.state != "alive":
                            continue
                        if now - st.last_seen > self.timeout_s:
                            error = PeerLost(
                                f"{_who(st.name, st.pid, st.host)} sent no heartbeat for {now - st.last_seen:.1f} s "
                                f"(limit {self.timeout_s:g} s): it died or hangs")
                        elif st.dropped_at is not None and now - st.dropped_at > grace:
                            error = PeerLost(
                                f"{_who(st.name, st.pid, st.host)} closed its connection to the hub without saying goodbye "
                                f"and sent no heartbeat for {now - st.last_seen:.1f} s: it died (killed, out of memory, "
                                "or crashed) or its host became unreachable")
                        else:
                            continue
                        st.state, st.error = "lost", error
                        lost_now.append(error)
                        if self._fatal is None:
                            self._fatal = error
                    beat_to = [p for p, st in self._peers.items() if st.state == "alive"]
                    abort, self._pending_abort = self._pending_abort, None
                for err in lost_now:
                    log.error("%s", err)
                    if not self._fired:
                        self._fired = True
                        _fire(self.on_lost, err)
                if abort is not None:
                    for p in beat_to:
                        _try_send(hb, [self._ident[p], _ABORT, abort.encode()])
                if now >= next_beat:
                    for p in beat_to:
                        _try_send(hb, [self._ident[p], _BEAT, me])
                    next_beat = now + period
                ready = dict(poller.poll(int(max(0.0, min(next_beat - time.monotonic(), period)) * 1000) + 1))
                if self._monitor in ready:  # closes first: a beat after them may come over a reused fd
                    self._drain_drops()
                if hb in ready:
                    self._drain_beats()
            with self._lock:  # close() right after abort(): still deliver it
                abort, self._pending_abort = self._pending_abort, None
                live = [p for p, st in self._peers.items() if st.state == "alive"]
            if abort is not None:
                for p in live:
                    _try_send(hb, [self._ident[p], _ABORT, abort.encode()])
        except BaseException:  # noqa: BLE001 - a broken heartbeat thread must not pass silently
            log.exception("hub heartbeat thread failed")
            self._set_fatal(TransportError(f"hub {self.name}: its heartbeat thread failed (see the log)"))
        finally:
            try:
                hb.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close(linger=0)
            hb.close()

    def _drain_drops(self) -> None:
        """Closed heartbeat connections (monitor events): the peer whose last beat came over it is
        marked; it is lost if no beat follows within drop_grace_s (a reconnect beats again)."""
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event.get("event") != zmq.EVENT_DISCONNECTED:
                continue
            fd, now = int(event["value"]), time.monotonic()
            with self._lock:
                for st in self._peers.values():
                    if st.fd == fd and st.state == "alive" and st.dropped_at is None:
                        st.dropped_at = now

    def _drain_beats(self) -> None:
        while True:
            try:
                frames = self._hb.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) != 3:  # malformed: ignore
                continue
            ident, kind, payload = (f.bytes for f in frames)
            st = self._peer_of(ident, kind, payload, self.port + 1)  # None: another run's (ignored) or fatal
            if st is None:
                continue
            with self._lock:
                if st.state == "lost":
                    reply = True
                elif kind == _BEAT:
                    self._claim(st, json.loads(payload))
                    st.last_seen = time.monotonic()
                    st.fd, st.dropped_at = _source_fd(frames[0]), None
                    for other in self._peers.values():  # the fd is this connection's now: another
                        if other is not st and st.fd is not None and other.fd == st.fd:  # peer's on it closed
                            other.fd = None
                            if other.state == "alive" and other.dropped_at is None:
                                other.dropped_at = time.monotonic()
                    if st.state == "waiting":
                        st.state = "alive"
                    reply = False
                elif kind == _BYE:
                    reply = False
                    if st.state != "left":
                        st.state = "left"
                        st.error = PeerLost(f"{_who(st.name, st.pid, st.host)} closed its connection to the hub (it left)")
                else:
                    reply = False
            if reply:  # a peer declared lost came back (SIGCONT): tell it, so it exits
                _try_send(self._hb, [ident, _LOST, b""])



# =========================================================================================
# peer
class _PeerHeartbeats:
    """A peer's heartbeat thread (transport.Peer): beats to the hub, reads the hub's beats and
    aborts, declares the hub lost and calls `on_lost` once. Uses the Peer's state (`_hb`, `_me`,
    `_hub`, `_stop`, ...) and its `_set_error` / `_set_aborted` / `_hub_who`."""

    def _heartbeat_loop(self) -> None:
        hb, period = self._hb, self.heartbeat_s
        start = next_beat = last_iter = time.monotonic()
        hub_seen: Optional[float] = None
        try:
            while not self._stop.is_set():
                # checks first, right after the previous wait, so that a gap in this thread's own
                # scheduling (SIGSTOP, starvation) is discounted before anything is judged
                now = time.monotonic()
                gap, last_iter = now - last_iter, now
                heard = self._hub_heard  # a message counts as a beat: a hub that dies before its first
                if heard is not None and (hub_seen is None or heard > hub_seen):  # beat reached us is
                    hub_seen = heard  # then timed out after timeout_s, not after connect_timeout_s
                if gap > max(2 * period, 1.0):  # this thread was not scheduled: not the hub's silence
                    if hub_seen is not None:
                        hub_seen = min(now, hub_seen + gap - period)
                    start = min(now, start + gap - period)
                if hub_seen is None and now - start > self.connect_timeout_s:
                    self._lost(HubLost(
                        f"{self.name}: the hub at tcp://{self.hub_host}:{self.port} never answered within {self.connect_timeout_s:g} s "
                        f"(connect_timeout_s): is it running, and can this host reach that host and ports {self.port}, {self.port + 1}?"))
                elif hub_seen is not None and now - hub_seen > self.timeout_s:
                    self._lost(HubLost(
                        f"the hub {self._hub_who()} sent no heartbeat for {now - hub_seen:.1f} s (limit {self.timeout_s:g} s): it died or hangs"))
                if self._aborted_at is not None and now - self._aborted_at > self.timeout_s and not self._fired:
                    self._fired = True  # told to abort, still open: stuck
                    _fire(self.on_lost, Aborted(self._aborted))
                if now >= next_beat:
                    _try_send(hb, [_BEAT, self._me])
                    next_beat = now + period
                if hb.poll(int(max(0.0, min(next_beat - time.monotonic(), period)) * 1000) + 1):
                    while True:
                        try:
                            kind, payload = hb.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        except ValueError:
                            continue
                        if kind == _BEAT:
                            hub_seen = time.monotonic()
                            self._hub.update(json.loads(payload))
                        elif kind == _ABORT:
                            self._set_aborted(payload.decode(errors="replace"))
                        elif kind == _LOST:
                            self._lost(HubLost(
                                f"the hub {self._hub_who()} declared {self.name} lost (no heartbeat of ours reached it for "
                                f"{self.timeout_s:g} s: was this process stopped or starved?)"))
            _try_send(hb, [_BYE, self._me])  # close(): not lost, left
        except BaseException:  # noqa: BLE001
            log.exception("peer heartbeat thread failed")
            self._set_error(HubLost(f"peer {self.name}: its heartbeat thread failed (see the log)"))
        finally:
            hb.close()

    def _lost(self, error: HubLost) -> None:
        """Record the hub's loss; call on_lost once (from this thread)."""
        if self._set_error(error):
            log.error("%s", error)
        if not self._fired:
            self._fired = True
            _fire(self.on_lost, self._error)
