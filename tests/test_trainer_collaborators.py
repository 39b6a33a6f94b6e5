"""learner-0's collaborators on their own, each with a test double of the hub side it sees
(issue 42, item 3): the inbox (`inbox.Inbox`), evaluation rounds (`eval_rounds.EvaluationRounds`
through `EvalHub`), checkpoints (`trainer_checkpoints.Checkpoints` through `CheckpointedHub`),
the logbook (`logbook.Logbook`) and the follower ranks (`follower_ranks.FollowerRanks`).
No process is started: the doubles answer as the generators and learner ranks would."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import PretrainedConfig

from components.offpolicy import derive_seed
from components.trainer import messages as M
from components.trainer.accounting import TrainingClock
from components.trainer.eval_rounds import EvaluationRounds
from components.trainer.evaluation import EvalOrder, eval_seed
from components.trainer.follower_ranks import FollowerRanks
from components.trainer.inbox import GeneratorError, Inbox
from components.trainer.logbook import Logbook
from components.trainer.runlog import JsonlLog, LogLossError, read_jsonl
from components.trainer.trainer_checkpoints import Checkpoints

PROC = {"cpu_s": 1.0}


class Wire:
    """The transport as learner-0 sees it: what it sent (`sent`), and what comes back (`queue`).
    `answer(peer, msg)` returns the replies a peer would send, queued in order."""

    def __init__(self, answer=None):
        self.sent: list[tuple[str, M.Message]] = []
        self.queue: list[tuple[str, M.Message]] = []
        self.answer = answer or (lambda peer, msg: [])

    def send(self, peer, msg, timeout_s=None):
        self.sent.append((peer, msg))
        self.queue.extend((peer, reply) for reply in self.answer(peer, msg))

    def broadcast(self, msg, peers=None, timeout_s=None):
        for peer in peers:
            self.send(peer, msg)

    def recv(self, timeout_s):
        return self.queue.pop(0) if self.queue else None

    def state(self):
        return {"generator-0": {"state": "alive"}}


# ---------------------------------------------------------------------------------------------
# the inbox
def test_the_inbox_files_every_message_by_kind():
    wire = Wire()
    wire.queue = [
        ("generator-0", M.Ready(index=0, pid=11, proc={"cpu_s": 0.5})),
        ("generator-1", M.GroupDone(rollout="group-a", proc={"cpu_s": 2.0})),
        ("learner-1", M.StepDone(index=1, part={"loss": 0.25}, proc={"cpu_s": 3.0})),
        ("generator-0", M.Drained(index=0, proc=PROC, groups=2)),
        ("generator-1", M.Drained(index=1, proc=PROC, groups=3)),
        ("generator-1", M.EvalDone(index=1, record={"pass_rate": 0.5}, proc=PROC)),
        ("generator-0", M.DownstreamDone(index=0, records=[{"benchmark": "b"}], proc=PROC)),
    ]
    inbox = Inbox(wire)
    for _ in range(8):  # one more than queued: an empty poll files nothing
        inbox.pump(0.0)
    assert inbox.ready == {"generator-0"} and inbox.rollouts == ["group-a"]
    assert inbox.step_parts == {1: {"loss": 0.25}} and inbox.eval_done == {1: {"pass_rate": 0.5}}
    assert inbox.drained == {"generator-0", "generator-1"} and inbox.drain_groups == 5
    assert inbox.downstream_done == [{"benchmark": "b"}]
    assert inbox.procs == {"generator-0": PROC, "generator-1": PROC, "learner-1": {"cpu_s": 3.0}}


def test_the_inbox_fails_the_run_on_a_failure_or_a_message_it_never_expects():
    wire = Wire()
    wire.queue = [("generator-1", M.Failed(index=1, traceback="Traceback: engine blew up")),
                  ("learner-1", M.Work(order=None))]
    inbox = Inbox(wire)
    with pytest.raises(GeneratorError, match="generator-1 failed:\nTraceback: engine blew up"):
        inbox.pump(0.0)
    with pytest.raises(GeneratorError, match="unexpected message Work from learner-1"):
        inbox.pump(0.0)


def test_next_rollout_in_arrival_order_and_a_clear_timeout():
    wire = Wire()
    wire.queue = [("generator-0", M.GroupDone(rollout=r, proc=PROC)) for r in ("r0", "r1")]
    inbox = Inbox(wire)
    assert [inbox.next_rollout(5.0), inbox.next_rollout(5.0)] == ["r0", "r1"]
    with pytest.raises(GeneratorError, match=r"no rollout arrived for 0s.*'generator-0': \{'state': 'alive'\}"):
        inbox.next_rollout(0.0)


# ---------------------------------------------------------------------------------------------
# evaluation rounds
class Generators:
    """Generators that drain (one group in flight each), evaluate (pass rate: a function of the
    generator, so the merge's weights show) and run the downstream benchmarks."""

    def __init__(self, clock: TrainingClock, evaluate: bool = True):
        self.clock, self.evaluate = clock, evaluate
        self.paused_when_asked: list[bool] = []

    def __call__(self, peer, msg):
        g = int(peer.rsplit("-", 1)[1])
        if isinstance(msg, M.Drain):
            return [M.GroupDone(rollout=f"in-flight-{g}", proc=PROC), M.Drained(index=g, proc=PROC, groups=1)]
        if isinstance(msg, M.Evaluate):
            self.paused_when_asked.append(self.clock._paused_at is not None)
            if not self.evaluate:
                return []
            order = msg.order
            record = {"pass_rate": 0.25 * (g + 1), "k": order.k, "prompts": len(order.problems),
                      "eval_tokens": 10 * len(order.problems), "indices": [i for i, _ in order.problems], "per_task": {}}
            return [M.EvalDone(index=g, record=record, proc=PROC)]
        if isinstance(msg, M.RunDownstream):
            self.paused_when_asked.append(self.clock._paused_at is not None)
            return [M.DownstreamDone(index=g, records=[{"benchmark": "aime", "k": 4, "mean@k": 0.125},
                                                       {"benchmark": "gsm", "k": 4, "mean@k": 0.5}], proc=PROC)]
        return []


class EvalHubDouble:
    """learner-0 as `eval_rounds.EvalHub` sees it."""

    def __init__(self, n_generators: int, evaluate: bool = True):
        self.generators = [f"generator-{g}" for g in range(n_generators)]
        self.clock = TrainingClock(devices=4)
        self.clock.start()
        self.answers = Generators(self.clock, evaluate)
        self.wire = Wire(self.answers)
        self.inbox = Inbox(self.wire)
        self.logs = SimpleNamespace(lines=[], notes=[])
        self.logs.log_eval = lambda line, note: (self.logs.lines.append(line), self.logs.notes.append(note))
        self.step, self.flops, self._version, self.pushes = 10, 123.0, 7, 0

    @property
    def version(self):
        return self._version

    def send(self, peer, msg):
        self.wire.send(peer, msg)

    def push_weights(self):
        self.pushes += 1
        self.wire.sent.append(("*", "push"))

    def clock_fields(self):
        wall = self.clock.wall_s()
        return {"compute_hours": self.clock.compute_hours(wall), "wall_s": wall}

    def cpu_hours(self):
        return 0.5


def _eval_cfg(**kw):
    base = dict(seed=3, eval_k=4, eval_temperature=None, temperature=0.7, top_p=0.9, max_tokens=64, task="arith",
                queue_timeout_s=5.0)
    return SimpleNamespace(**{**base, **kw})


def test_a_held_out_round_drains_pauses_orders_shares_and_logs_the_merged_record():
    hub = EvalHubDouble(n_generators=2)
    problems = [f"p{i}" for i in range(5)]
    line = EvaluationRounds(_eval_cfg(), problems, n_params=1000, hub=hub).evaluate()
    kinds = [msg if isinstance(msg, str) else type(msg).__name__ for _, msg in hub.wire.sent]
    assert kinds == ["push", "Drain", "Drain", "Evaluate", "Evaluate"]  # weights, drain, then the orders
    orders = [msg.order for _, msg in hub.wire.sent if isinstance(msg, M.Evaluate)]
    assert [o.problems for o in orders] == [[(0, "p0"), (2, "p2"), (4, "p4")], [(1, "p1"), (3, "p3")]]
    seed = eval_seed(3, 10)
    assert orders[0] == EvalOrder(problems=orders[0].problems, version=7, seed=derive_seed(seed, 0), k=4,
                                  temperature=0.7, top_p=0.9, max_tokens=64, task_name="arith")
    assert orders[1].seed == derive_seed(seed, 1)
    assert hub.answers.paused_when_asked == [True, True]  # the evaluation is off the training clock
    assert hub.clock._paused_at is None and hub.clock.eval_base_s == pytest.approx(line["eval_wall_s"])
    # merged: (0.25 x 3 prompts + 0.5 x 2) / 5
    assert line["pass_rate"] == pytest.approx(0.35) and line["prompts"] == 5 and line["eval_tokens"] == 50
    assert (line["step"], line["version"], line["flops"], line["cpu_hours"]) == (10, 7, 123.0, 0.5)
    assert line["drain_groups"] == 2 and line["eval_flops"] == 2.0 * 1000 * 50
    assert line["eval_compute_hours"] == pytest.approx(line["eval_wall_s"] * 4 / 3600.0)
    assert list(line)[:11] == ["step", "version", "compute_hours", "flops", "wall_s", "eval_wall_s", "eval_compute_hours",
                               "drain_s", "drain_groups", "eval_flops", "cpu_hours"]
    assert hub.logs.lines == [line] and hub.logs.notes[0].startswith("eval @ step 10: held-out pass rate 0.350 (mean@4")
    assert hub.inbox.rollouts == ["in-flight-0", "in-flight-1"]  # the drained groups wait for the loop


def test_one_generator_evaluates_with_the_run_s_evaluation_seed_and_temperature():
    hub = EvalHubDouble(n_generators=1)
    line = EvaluationRounds(_eval_cfg(eval_temperature=0.0), ["a", "b"], n_params=10, hub=hub).evaluate()
    (order,) = [msg.order for _, msg in hub.wire.sent if isinstance(msg, M.Evaluate)]
    assert order.seed == eval_seed(3, 10) and order.temperature == 0.0
    assert line["pass_rate"] == 0.25 and "indices" not in line


def test_a_round_the_generators_never_answer_fails_naming_who_answered():
    hub = EvalHubDouble(n_generators=2, evaluate=False)
    with pytest.raises(GeneratorError, match=r"did not finish within train.queue_timeout_s=0.05s \(answered: \[\] of \[0, 1\]\)"):
        EvaluationRounds(_eval_cfg(queue_timeout_s=0.05), ["a", "b"], n_params=10, hub=hub).evaluate()


def test_a_drain_that_never_ends_names_the_late_generators():
    hub = EvalHubDouble(n_generators=2)
    hub.answers = lambda peer, msg: [M.Drained(index=0, proc=PROC)] if peer == "generator-0" else []
    hub.wire.answer = hub.answers
    with pytest.raises(GeneratorError, match="^generator-1: no in-flight sequence finished within train.queue_timeout_s=0.05s"):
        EvaluationRounds(_eval_cfg(queue_timeout_s=0.05), ["a"], n_params=10, hub=hub).drain()


def test_downstream_benchmarks_run_on_generator_0_and_log_one_line_each():
    hub = EvalHubDouble(n_generators=2)
    lines = EvaluationRounds(_eval_cfg(), ["a"], n_params=10, hub=hub).downstream()
    asked = [(peer, msg) for peer, msg in hub.wire.sent if isinstance(msg, M.RunDownstream)]
    assert asked == [("generator-0", M.RunDownstream(10))] and hub.answers.paused_when_asked == [True]
    assert [(x["benchmark"], x["mean@k"], x["step"], x["version"]) for x in lines] == [("aime", 0.125, 10, 7), ("gsm", 0.5, 10, 7)]
    assert hub.logs.lines == lines and hub.logs.notes == ["benchmark aime @ step 10: mean@4 0.125",
                                                          "benchmark gsm @ step 10: mean@4 0.500"]
    assert hub.clock._paused_at is None and hub.clock.eval_base_s > 0


# ---------------------------------------------------------------------------------------------
# checkpoints
class Curriculum:
    def __init__(self, seen=None):
        self.seen = seen

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = state["seen"]


class CheckpointedHubDouble:
    """learner-0 as `trainer_checkpoints.CheckpointedHub` sees it, with a small model and AdamW."""

    def __init__(self, run_dir: Path, seed: int, followers=(), generators=2):
        torch.manual_seed(seed)
        model = torch.nn.Linear(3, 2)
        model.config = PretrainedConfig()  # a checkpoint stores its model's Hugging Face config (hf/)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
        self.learner = SimpleNamespace(model=model, optimizer=optimizer, scheduler=scheduler, version=0)
        self.followers = list(followers)
        self.generators = [f"generator-{g}" for g in range(generators)]
        self.tokenizer = None
        self.curriculum = Curriculum()
        self.clock = TrainingClock(devices=2)
        self.step = self.next_order = self.next_generator = self.prompts_sampled = 0
        self.flops, self.cpu_base_s = 0.0, 0.0
        self.pending, self.batches, self.totals = [], [], {"stale_dropped": 0}
        self.sent: list = []
        self.run_dir = run_dir
        self.metrics, self.evals = JsonlLog(run_dir / "metrics.jsonl"), JsonlLog(run_dir / "eval.jsonl")
        self.logs = SimpleNamespace(sync=lambda: {log_.path.name: log_.sync() for log_ in (self.metrics, self.evals)})

    def broadcast(self, msg, peers):
        self.sent.extend((peer, msg) for peer in peers)

    def cpu_hours(self):
        return 0.25

    def train(self, steps: int) -> None:
        """`steps` learner steps: the model and AdamW move, the counters and logs follow."""
        for _ in range(steps):
            loss = self.learner.model(torch.ones(4, 3)).pow(2).mean()
            loss.backward()
            self.learner.optimizer.step()
            self.learner.optimizer.zero_grad()
            self.learner.scheduler.step()
            self.step += 1
            self.learner.version += 1
            self.metrics.write({"step": self.step, "loss": loss.item()})


def _cfg():
    return SimpleNamespace(keep_checkpoints=2, to_dict=lambda: {"lr": 0.1})


def _trained(run_dir: Path) -> tuple[CheckpointedHubDouble, Checkpoints]:
    hub = CheckpointedHubDouble(run_dir, seed=0)
    hub.evals.write({"step": 0, "pass_rate": 0.1})
    hub.train(4)
    hub.curriculum.seen = [3, 1, 2]
    hub.next_order, hub.next_generator, hub.prompts_sampled, hub.flops = 16, 3, 18, 1.5e6
    hub.pending, hub.batches, hub.totals = ["group-16"], [["group-12", "group-13"]], {"stale_dropped": 2}
    hub.clock.base_s, hub.clock.eval_base_s = 12.5, 1.5
    return hub, Checkpoints(_cfg(), run_dir, hub)


def test_trainer_state_holds_the_hub_s_counters_and_tells_the_followers(tmp_path):
    hub, checkpoints = _trained(tmp_path)
    hub.followers = ["learner-1", "learner-2"]
    state = checkpoints.trainer_state()
    assert state == {"step": 4, "version": 4, "curriculum": {"seen": [3, 1, 2]}, "next_order": 16, "next_generator": 3,
                     "prompts_sampled": 18, "wall_s": 12.5, "eval_wall_s": 1.5, "startup_s": state["startup_s"],
                     "cpu_s": 900.0, "flops": 1.5e6, "pending": ["group-16"], "pending_batches": [["group-12", "group-13"]],
                     "totals": {"stale_dropped": 2}, "config": {"lr": 0.1}, "learner_ranks": 3}
    pickle.dumps(state)  # trainer.pt is a pickle


def test_a_checkpoint_round_trips_the_hub_s_state_model_optimizer_and_rng(tmp_path):
    hub, checkpoints = _trained(tmp_path)
    path = checkpoints.save()
    assert path == tmp_path / "checkpoints" / "step_00000004" and checkpoints.last_step == 4
    info = json.loads((path / "checkpoint.json").read_text())
    assert info["logs"] == {"metrics.jsonl": {"records": 4, "last_step": 4}, "eval.jsonl": {"records": 1, "last_step": 0}}
    after_save = torch.rand(3)  # the RNG stream a resumed run continues with
    hub.train(1)  # an uninterrupted run goes on ...
    weights = {k: v.clone() for k, v in hub.learner.model.state_dict().items()}

    other = CheckpointedHubDouble(tmp_path, seed=1)  # ... a new session of the same run resumes at step 4
    resumed = Checkpoints(_cfg(), tmp_path, other)
    assert resumed.resume_or_start() is True and resumed.last_step == 4
    assert torch.equal(torch.rand(3), after_save)
    assert (other.step, other.learner.version, other.next_order, other.prompts_sampled, other.flops) == (4, 4, 16, 18, 1.5e6)
    assert other.next_generator == 1  # 3 generators then, 2 now: the rotation stays in range
    assert other.curriculum.seen == [3, 1, 2] and other.totals == {"stale_dropped": 2}
    assert other.pending == ["group-16"] and other.batches == [["group-12", "group-13"]]
    assert (other.clock.base_s, other.clock.eval_base_s, other.cpu_base_s) == (12.5, 1.5, 900.0)
    assert other.learner.scheduler.state_dict()["last_epoch"] == 4
    assert read_jsonl(tmp_path / "metrics.jsonl")[-1]["step"] == 4  # the uninterrupted step 5 is not the resumed run's
    other.train(1)
    for k, v in other.learner.model.state_dict().items():  # model, AdamW moments and schedule restored: the same step
        assert torch.equal(v, weights[k]), k


def test_resume_refuses_logs_that_lost_records_before_loading_anything(tmp_path):
    hub, checkpoints = _trained(tmp_path)
    checkpoints.save()
    hub.metrics.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n")  # steps 3-4 lost
    other = CheckpointedHubDouble(tmp_path, seed=1, followers=["learner-1"])
    with pytest.raises(LogLossError, match="metrics.jsonl lost records"):
        Checkpoints(_cfg(), tmp_path, other).resume_or_start()
    assert other.step == 0 and other.sent == []  # nothing loaded, the followers not told to load


def test_a_run_without_checkpoint_starts_and_tells_its_followers_so(tmp_path):
    hub = CheckpointedHubDouble(tmp_path, seed=0, followers=["learner-1"])
    hub.cpu_base_s = 7.0
    checkpoints = Checkpoints(_cfg(), tmp_path, hub)
    assert checkpoints.resume_or_start() is False and checkpoints.last_step == -1
    assert hub.sent == [("learner-1", M.LoadCheckpoint(None))] and hub.cpu_base_s == 0.0 and hub.step == 0


def test_a_save_with_followers_tells_them_first(tmp_path):
    hub, checkpoints = _trained(tmp_path)
    hub.followers = ["learner-1"]
    checkpoints.save()
    assert hub.sent == [("learner-1", M.SaveCheckpoint(4))]
    assert torch.load(tmp_path / "checkpoints" / "step_00000004" / "trainer.pt", weights_only=False)["trainer_state"]["learner_ranks"] == 2


# ---------------------------------------------------------------------------------------------
# the logbook
def _logbook_cfg(**kw):
    return SimpleNamespace(**{**dict(trackers=(), samples_every=0, samples_per_log=0, compute_budget_flops=None,
                                     total_steps=10), **kw})


def test_the_logbook_writes_steps_and_evaluations_and_shows_the_last_held_out_pass_rate(tmp_path):
    book = Logbook(_logbook_cfg(), tmp_path, progress=False)
    book.open(step=0, flops=0.0, resumed=False)
    assert not book.evaluated and math.isnan(book.last_eval_pass_rate)
    book.log_eval({"step": 0, "pass_rate": 0.25}, "eval @ step 0")
    book.log_step({"step": 1, "flops": 1.0, "pass_rate": 0.5, "compute_hours": 0.1}, rollouts=[], tokenizer=None)
    book.log_eval({"step": 1, "benchmark": "aime", "mean@k": 0.75}, "benchmark aime")  # not the held-out rate
    assert book.evaluated and book.last_eval_pass_rate == 0.25
    assert book.sync() == {"metrics.jsonl": {"records": 1, "last_step": 1}, "eval.jsonl": {"records": 2, "last_step": 1}}
    book.close("done", operative_config="")

    again = Logbook(_logbook_cfg(), tmp_path, progress=False)  # a resumed run's logbook
    again.open(step=1, flops=1.0, resumed=True)
    assert again.evaluated and again.last_eval_pass_rate == 0.25
    again.close("done", operative_config="")
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1]


def test_a_logbook_never_opened_closes_quietly(tmp_path):
    Logbook(_logbook_cfg(), tmp_path / "run", progress=True).close("failed", operative_config="")
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------
# follower ranks
def test_follower_ranks_hand_out_shards_and_gather_their_parts_in_rank_order():
    def answer(peer, msg):
        k = int(peer.rsplit("-", 1)[1])
        if isinstance(msg, M.TrainStep):
            return [M.StepDone(index=k, part={"rank": k, "shard": msg.shard}, proc=PROC)]
        return [M.StepDone(index=k, part={"old_logp": [f"old-{k}"]}, proc=PROC)]

    wire = Wire(answer)
    inbox = Inbox(wire)
    peers = FollowerRanks(["learner-1", "learner-2"], wire, inbox, timeout_s=5.0)
    peers.send(["s1", "s2"])
    wire.queue.reverse()  # learner-2 answers first
    assert peers.gather() == [{"rank": 1, "shard": "s1"}, {"rank": 2, "shard": "s2"}]
    peers.score_old([["m1"], ["m2"]])
    assert peers.gather_old() == [["old-1"], ["old-2"]]
    assert [type(m).__name__ for _, m in wire.sent] == ["TrainStep", "TrainStep", "ScoreOld", "ScoreOld"]
    silent = FollowerRanks(["learner-1"], Wire(), Inbox(Wire()), timeout_s=0.0)
    silent.send(["s1"])
    with pytest.raises(GeneratorError, match="learner ranks did not report their step within 0.0s"):
        silent.gather()
