"""Every message between the processes of a run, one dataclass per kind.

The transport (transport.py) carries any picklable object; the trainer's processes send only
the dataclasses below and read them by attribute (``msg.rollout``, ``msg.proc``), never by
position. Who sends what:

    learner-0 (hub) ──► generator-i      Work, PushWeights, Drain, Evaluate, RunDownstream, Stop
    learner-0 (hub) ──► learner-k        TrainStep, ScoreOld, JoinWeightSync, SaveCheckpoint, LoadCheckpoint, Stop
    generator-i     ──► learner-0        Ready, GroupDone, Drained, EvalDone, DownstreamDone, Failed
    learner-k       ──► learner-0        Ready, StepDone, Failed

(The transport's own control frames, hello / bye / abort and the heartbeats, are not messages
of this module: they are raw ZeroMQ frames, see transport.py.)

Versioning is by field: a field added later must have a plain default (a number, a string,
None; not a ``default_factory``). Messages travel pickled (the transport's protocol-5 pickle),
which stores an instance's fields by name, so a reader whose class has a field the sender's
had not reads the class default, and a reader that lacks a field the sender has ignores it.
Never remove or rename a field, and never make a defaulted field required.

``proc`` everywhere is the sender's `accounting.proc_stats()` (CPU seconds, run-queue delay,
host, ...), which learner-0 folds into its accounting; ``index`` is the sender's index within
its role (generator-<index>, learner-<index>).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

__all__ = [
    "Message",
    "Work",
    "PushWeights",
    "Drain",
    "Evaluate",
    "RunDownstream",
    "Stop",
    "TrainStep",
    "ScoreOld",
    "JoinWeightSync",
    "SaveCheckpoint",
    "LoadCheckpoint",
    "Ready",
    "GroupDone",
    "StepDone",
    "Drained",
    "EvalDone",
    "DownstreamDone",
    "Failed",
    "MESSAGE_TYPES",
]


@dataclass(frozen=True)
class Message:
    """Base of every message (so a receiver can refuse anything else by type)."""


# ---------------------------------------------------------------------------------------------
# learner-0 -> generators
@dataclass(frozen=True)
class Work(Message):
    """Prompts to generate groups for: a `rollout.WorkOrder` (order ids, problems, sampling seed)."""

    order: Any


@dataclass(frozen=True)
class PushWeights(Message):
    """New weights follow on the weight group: the `weight_sync.WeightUpdate` describing them
    (version, parameter layout, buckets). The generator joins the broadcast."""

    update: Any


@dataclass(frozen=True)
class Drain(Message):
    """Finish every in-flight training sequence, score and send the groups, then answer `Drained`
    (an evaluation comes next)."""


@dataclass(frozen=True)
class Evaluate(Message):
    """Evaluate a share of the held-out prompts at pinned weights: an `evaluation.EvalOrder`;
    answered by `EvalDone`."""

    order: Any


@dataclass(frozen=True)
class RunDownstream(Message):
    """Run every downstream benchmark at the weights the generator holds, for learner step
    `step`; answered by `DownstreamDone`."""

    step: int


@dataclass(frozen=True)
class Stop(Message):
    """The run is over: close the engine / learner and exit cleanly."""


# ---------------------------------------------------------------------------------------------
# learner-0 -> learner ranks k >= 1
@dataclass(frozen=True)
class TrainStep(Message):
    """Train this rank's share of one learner step (a `learner.plan_step` shard); answered by `StepDone`."""

    shard: Any


@dataclass(frozen=True)
class ScoreOld(Message):
    """Compute pi_old of this rank's micro-batches before a step's first update (train.update_epochs /
    train.mini_batches with a mismatch correction: `Learner.fix_old_logprobs`): `shards` holds this rank's
    micro-batches of each mini-batch; answered by `StepDone` whose part is {"old_logp": per mini-batch lists}."""

    shards: Any


@dataclass(frozen=True)
class JoinWeightSync(Message):
    """Join the per-parameter gathers of the weight push described by `update` (learner-0 broadcasts)."""

    update: Any


@dataclass(frozen=True)
class SaveCheckpoint(Message):
    """Write this rank's shards of the checkpoint of learner step `step` (a collective with learner-0)."""

    step: int


@dataclass(frozen=True)
class LoadCheckpoint(Message):
    """Load this rank's state from the checkpoint directory `path` (None: a fresh start, nothing to load)."""

    path: Optional[str] = None


# ---------------------------------------------------------------------------------------------
# generators and learner ranks -> learner-0
@dataclass(frozen=True)
class Ready(Message):
    """The sender built its model / engine and waits for work. Its CPU time so far is start-up, the
    baseline of its accounting. A generator also sends its device."""

    index: int
    pid: int
    proc: dict
    device: Optional[str] = None


@dataclass(frozen=True)
class GroupDone(Message):
    """A finished, scored rollout group (`rollout.Rollout`) from a generator."""

    rollout: Any
    proc: dict


@dataclass(frozen=True)
class StepDone(Message):
    """Learner rank `index` trained its share of a step; `part` are its partial statistics."""

    index: int
    part: Any
    proc: dict


@dataclass(frozen=True)
class Drained(Message):
    """Answer to `Drain`: every in-flight training sequence is finished and sent; `groups` is how
    many groups the drain finished."""

    index: int
    proc: dict
    groups: int = 0


@dataclass(frozen=True)
class EvalDone(Message):
    """Answer to `Evaluate`: the held-out record of generator `index`'s share."""

    index: int
    record: dict
    proc: dict


@dataclass(frozen=True)
class DownstreamDone(Message):
    """Answer to `RunDownstream`: one record per benchmark."""

    index: int
    records: list
    proc: dict


@dataclass(frozen=True)
class Failed(Message):
    """The sender failed with `traceback` and is exiting; learner-0 fails the run with it."""

    index: int
    traceback: str


MESSAGE_TYPES: tuple[type, ...] = (
    Work, PushWeights, Drain, Evaluate, RunDownstream, Stop,
    TrainStep, ScoreOld, JoinWeightSync, SaveCheckpoint, LoadCheckpoint,
    Ready, GroupDone, StepDone, Drained, EvalDone, DownstreamDone, Failed,
)
