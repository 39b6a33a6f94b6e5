"""learner-0's inbox: every message the other processes send it, filed where it belongs.

Owns the filing of the typed messages of messages.py that reach the hub (`Ready`, `GroupDone`,
`StepDone`, `Drained`, `EvalDone`, `DownstreamDone`, `Failed`) and what they fill in: the
finished groups not yet handed to the loop, the learner ranks' partial step results, the
generators' evaluation answers, who is ready, who drained, and each process's latest
`proc_stats()` (the compute accounting reads them). `pump` receives one message; whoever waits
for an answer (the loop, `FollowerRanks`, `EvaluationRounds`) pumps until its slot is filled.
A `Failed` message, or any message the hub never expects, fails the run (`GeneratorError`).
The inbox reads a `MessageSource` (the transport's `Hub`, or a test double); it sends nothing
(`PeerSender` is the sending side as the collaborators see it).
"""

from __future__ import annotations

import time
from typing import Optional, Protocol

from components.trainer import messages as M

__all__ = ["GeneratorError", "MessageSource", "PeerSender", "Inbox"]


class GeneratorError(RuntimeError):
    """A generator (or another process of the run) failed; its traceback is in the message."""


class MessageSource(Protocol):
    """Where learner-0's messages come from (transport.Hub)."""

    def recv(self, timeout_s: float) -> Optional[tuple[str, M.Message]]:
        """(peer name, message), or None if none came within `timeout_s`."""

    def state(self) -> dict:
        """Each peer's connection state, for an error message."""


class PeerSender(Protocol):
    """How learner-0's collaborators send to the other processes (transport.Hub)."""

    def send(self, peer: str, msg: M.Message, timeout_s: Optional[float] = None) -> None:
        """Send `msg` to `peer` (in order per peer)."""

    def broadcast(self, msg: M.Message, peers: Optional[list] = None, timeout_s: Optional[float] = None) -> None:
        """Send `msg` to each of `peers`."""


class Inbox:
    """The messages learner-0 has received and not yet used, filed by kind."""

    def __init__(self, source: MessageSource):
        self.source = source
        self.rollouts: list = []  # finished groups (rollout.Rollout), not yet handed to the loop
        self.step_parts: dict[int, dict] = {}  # learner rank -> its partial result of the current step
        self.eval_done: dict[int, dict] = {}  # generator index -> its share's held-out record
        self.downstream_done: Optional[list] = None  # generator-0's benchmark records
        self.ready: set = set()  # processes that built their model / engine
        self.drained: set = set()  # generators that finished their in-flight training sequences
        self.drain_groups = 0  # training groups they finished while draining
        self.procs: dict = {}  # process name -> its latest proc_stats()

    def pump(self, timeout_s: float) -> None:
        """Receive one message (if any within timeout) and file it where it belongs."""
        got = self.source.recv(timeout_s)
        if got is None:
            return
        peer, msg = got
        if isinstance(msg, M.GroupDone):
            self.procs[peer] = msg.proc
            self.rollouts.append(msg.rollout)
        elif isinstance(msg, M.StepDone):
            self.procs[peer] = msg.proc
            self.step_parts[int(msg.index)] = msg.part
        elif isinstance(msg, M.Drained):
            self.procs[peer] = msg.proc
            self.drained.add(peer)
            self.drain_groups += int(msg.groups)
        elif isinstance(msg, M.EvalDone):
            self.procs[peer] = msg.proc
            self.eval_done[int(msg.index)] = msg.record
        elif isinstance(msg, M.DownstreamDone):
            self.procs[peer] = msg.proc
            self.downstream_done = msg.records
        elif isinstance(msg, M.Ready):  # its CPU time so far is start-up: the baseline of its accounting
            self.ready.add(peer)
            self.procs[peer] = msg.proc
        elif isinstance(msg, M.Failed):
            raise GeneratorError(f"{peer} failed:\n{msg.traceback}")
        else:
            raise GeneratorError(f"unexpected message {type(msg).__name__} from {peer}")

    def next_rollout(self, timeout_s: float):
        """The next finished group from any generator; fails clearly if none comes for `timeout_s`."""
        t0 = time.monotonic()
        while not self.rollouts:
            self.pump(1.0)
            waited = time.monotonic() - t0
            if not self.rollouts and waited >= timeout_s:
                raise GeneratorError(f"no rollout arrived for {waited:.0f}s (train.queue_timeout_s); generators hung? "
                                     f"process states: {self.source.state()}")
        return self.rollouts.pop(0)
