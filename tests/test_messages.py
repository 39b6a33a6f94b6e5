"""components/trainer/messages.py: every message kind round-trips through the transport's
serialisation, is read by attribute, and is versioned by field."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest
import torch

from components.trainer import messages as M
from components.trainer.evaluation import EvalOrder
from components.trainer.rollout import Rollout, WorkOrder
from components.trainer.transport import decode, encode

REPO = Path(__file__).resolve().parents[1]
PROC = {"cpu_s": 1.5, "pid": 123, "host": "node01"}


def _examples() -> dict[type, M.Message]:
    big = torch.arange(100_000, dtype=torch.float32)  # out-of-band (>= 64 KiB)
    return {
        M.Work: M.Work(WorkOrder(orders=[(0, {"prompt": "1+1="}), (1, {"prompt": "2+2="})], seed=7)),
        M.PushWeights: M.PushWeights({"version": 3, "buckets": [(0, 2)]}),
        M.Drain: M.Drain(),
        M.Evaluate: M.Evaluate(EvalOrder(problems=[(0, {"prompt": "x"})], version=2, seed=1, k=8, temperature=1.0,
                                         top_p=1.0, max_tokens=16, task_name="arithmetic")),
        M.RunDownstream: M.RunDownstream(25),
        M.Stop: M.Stop(),
        M.TrainStep: M.TrainStep({"input_ids": big.to(torch.int64).reshape(100, 1000), "weights": torch.ones(3)}),
        M.ScoreOld: M.ScoreOld([[{"input_ids": big.to(torch.int64).reshape(100, 1000)}], []]),
        M.JoinWeightSync: M.JoinWeightSync({"version": 3}),
        M.SaveCheckpoint: M.SaveCheckpoint(10),
        M.LoadCheckpoint: M.LoadCheckpoint("/runs/x/checkpoints/step_10"),
        M.Ready: M.Ready(0, pid=42, proc=PROC, device="cpu"),
        M.GroupDone: M.GroupDone(Rollout(order_id=5, problem_id="p5", completions=[], rewards=[1.0, 0.0], passed=[True, False]),
                                 PROC),
        M.StepDone: M.StepDone(1, {"loss_sum": torch.tensor(0.25), "grad": big}, PROC),
        M.Drained: M.Drained(0, PROC, groups=3),
        M.EvalDone: M.EvalDone(0, {"pass_rate": 0.5, "prompts": 10}, PROC),
        M.DownstreamDone: M.DownstreamDone(0, [{"benchmark": "b", "mean@k": 0.25}], PROC),
        M.Failed: M.Failed(2, "Traceback (most recent call last):\n  ...\nValueError: boom"),
    }


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(_equal(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    return a == b


def test_every_message_kind_is_listed_documented_and_has_an_example():
    defined = {obj for _, obj in inspect.getmembers(M, inspect.isclass)
               if issubclass(obj, M.Message) and obj is not M.Message and obj.__module__ == M.__name__}
    assert defined == set(M.MESSAGE_TYPES) == set(_examples())
    for cls in M.MESSAGE_TYPES:
        assert dataclasses.is_dataclass(cls) and (cls.__doc__ or "").strip() and not cls.__doc__.startswith(cls.__name__ + "(")


@pytest.mark.parametrize("kind", M.MESSAGE_TYPES, ids=lambda c: c.__name__)
def test_every_message_kind_round_trips_through_the_transport_encoding(kind):
    msg = _examples()[kind]
    out = decode(encode(msg))
    assert type(out) is kind and _equal(msg, out)
    for f in dataclasses.fields(kind):  # read by attribute
        assert _equal(getattr(msg, f.name), getattr(out, f.name))


def test_a_field_added_with_a_default_is_read_from_an_older_sender():
    """An older sender's Drained had no `groups`: the reader gets the field's default."""
    old = M.Drained(0, PROC)
    state = dict(old.__dict__)
    del state["groups"]
    older = object.__new__(M.Drained)
    object.__setattr__(older, "__dict__", state)  # exactly what unpickling an older sender's message builds
    out = decode(encode(older))
    assert out.groups == 0 and out.index == 0 and out.proc == PROC
    ready = object.__new__(M.Ready)
    object.__setattr__(ready, "__dict__", {"index": 1, "pid": 9, "proc": PROC})  # a learner rank's Ready
    out = decode(encode(ready))
    assert out.device is None


def test_a_field_a_reader_does_not_know_is_ignored():
    newer = M.Stop()
    object.__setattr__(newer, "__dict__", {"reason": "done"})  # a later version's extra field
    out = decode(encode(newer))
    assert type(out) is M.Stop and out == M.Stop()


def test_the_trainer_reads_no_message_by_position():
    for name in ("loop.py", "generator.py", "worker.py"):
        text = (REPO / "components" / "trainer" / name).read_text()
        assert not re.search(r"\bmsg\[\d\]", text), name
        assert not re.search(r"\.(send|broadcast)\([^)]*\(\"[a-z_]+\",", text), name
