"""The hub: learner rank 0 runs the training loop and drives every other process of the run.

    learner-0 (this) ──Work(prompts)────────────────► generator-i: engine + verifier
                     ──PushWeights(update) + broadcast ► (weight group: learner-0 + generators)
                     ──Evaluate(prompts, version)─────►
                     ◄──GroupDone(group) ──────────────┘
                     ──TrainStep(its micro-batches)──► learner-k (k >= 1): FSDP2 forward/backward
                     ◄──StepDone(partial stats)───────┘   (collectives among the learner ranks)

(messages: the dataclasses of messages.py)

Learner rank 0 owns the curriculum (it orders prompts and sees every group's rewards, so the
pass-rate history lives in one place and is checkpointed), plans each step on the WHOLE
batch (filters, advantages, aggregation weights) before splitting it across the learner
ranks, and owns the run directory. The loop is the same for every off-policy scheme: at each
of its decision points (may the learner train, on which groups; may the generators start more
prompts, from which weights; do weights go out after a step) it asks the run's scheme object
(components/offpolicy.py), whatever scheme that is. Messages travel on the transport
(transport.py: ZeroMQ with heartbeats, so a dead or hung process is named, never waited on
forever); weights on the weight group (weight_sync.py); FSDP2 collectives on the learner group.

The Trainer keeps the loop (ordering, receiving, stepping, pushing weights, when to evaluate and
checkpoint) and its counters; it delegates the rest to small collaborators, each of which sees
it through a Protocol of what it needs and never imports this module:

    Inbox              inbox.py                the messages the other processes send, filed by kind
    EvaluationRounds   eval_rounds.py          held-out and downstream evaluations (`EvalHub`)
    Checkpoints        trainer_checkpoints.py  trainer.pt's state, save and resume (`CheckpointedHub`)
    Logbook            logbook.py              metrics.jsonl, eval.jsonl, trackers, progress bar
    FollowerRanks      follower_ranks.py       learner ranks 1..T-1 (`learner.StepPeers`)

Determinism: every sampling seed is a function of (run seed, step) and groups are sorted by
their order id before use, so a synchronous run (one step per round of frozen-weight
generation) on CPU killed and resumed reproduces an uninterrupted one bit for bit
(tests/test_checkpoint.py).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import torch

from components.curricula import build_curriculum
from components.environments import episode_stats, generated_token_count, observation_token_count
from components.offpolicy import LoopState, derive_seed, make_scheme
from components.registry import CURRICULA, OFF_POLICY, TASKS
from components.trainer.accounting import (FlopCounter, ForeignLoad, TrainingClock, contention, proc_stats,
                                           step_flop_terms)
from components.trainer.config import component_params, family_params
from components.trainer.eval_rounds import EvaluationRounds
from components.trainer.evaluation import downstream_due
from components.trainer.export import write_final_policy
from components.trainer.follower_ranks import FollowerRanks
from components.trainer.generator import WorkerSetup, make_length_control
from components.trainer.inbox import GeneratorError, Inbox
from components.trainer.logbook import Logbook
from components.trainer import messages as M
from components.trainer.learner import Learner
from components.trainer.roles import pin_cpu, settle_heap
from components.trainer.rollout import Rollout, WorkOrder
from components.trainer.runlog import LogLossError, write_text_atomic
from components.trainer.trainer_checkpoints import Checkpoints
from components.trainer.weight_group import weight_group_of

log = logging.getLogger(__name__)

__all__ = ["Trainer", "GeneratorError", "derive_seed"]


def _count_by_generator(rollouts: list) -> dict:
    counts: dict = {}
    for r in rollouts:
        key = f"generator-{int(r.generator)}"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


class Trainer:
    """Learner rank 0: the training loop of one run (and the hub of its processes)."""

    def __init__(self, cfg, run_dir: Path, setup: WorkerSetup, layout, endpoints, run_info: Optional[dict] = None,
                 progress: bool = True):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.setup = setup
        self.layout = layout
        self.endpoints = endpoints
        self.run_info = run_info
        self.scheme = make_scheme(cfg.off_policy, component_params(cfg, OFF_POLICY, cfg.off_policy))
        self.P = cfg.prompts_per_step
        self.generators = layout.generator_names()
        self.followers = [f"learner-{k}" for k in range(1, layout.learner_ranks)]
        self.hub = None  # the transport (transport.Hub), bound in _connect
        self.inbox: Optional[Inbox] = None  # what the other processes sent, filed by kind (inbox.py)
        self.logs = Logbook(cfg, self.run_dir, progress)  # metrics.jsonl, eval.jsonl, trackers, progress bar
        self.checkpoints = Checkpoints(cfg, self.run_dir, self)  # trainer_checkpoints.py
        self._procs_at_step: dict = {}
        self._procs_at_start: dict = {}
        self._failing = threading.Event()
        self._handled = threading.Event()  # the main thread is ending the run (done or failed)
        self.pushed_version = -1
        self._reset_since()

    # =====================================================================================
    # setup
    def _build(self) -> None:
        from components.models import load_tokenizer
        from components.tasks import make_task
        from components.trainer.attention import learner_attn_implementation
        from components.models import load_causal_lm

        cfg = self.cfg
        self.device = self.setup.device
        if self.device == "cpu":
            torch.set_num_threads(1)  # one core per process
            pin_cpu(0, self.layout.world_size)  # ... and the same core throughout
        torch.manual_seed(cfg.seed)
        self.task = make_task(cfg.task, family_params(cfg, TASKS), seed=cfg.seed, **cfg.task_kwargs)
        self.tokenizer = load_tokenizer(cfg.model_path)
        model = load_causal_lm(cfg.model_path, dtype=torch.float32,
                               attn_implementation=learner_attn_implementation(cfg, self.device))
        self.flop_counter = FlopCounter.from_model(model)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.pad_id = pad_id
        self.learner = Learner(model, cfg, pad_id, torch.device(self.device))
        if cfg.lora_rank > 0:  # only the adapters train: no weight gradients for the frozen base
            adapters = sum(p.numel() for p in self.learner.model.parameters() if p.requires_grad)  # global numel, sharded too
            self.flop_counter = self.flop_counter.for_lora(adapters)
        self.train_pool = list(self.task.train_problems())
        self.curriculum = build_curriculum(cfg.curriculum, self.train_pool, cfg.seed, family_params(cfg, CURRICULA))
        eval_problems = list(self.task.eval_problems())
        if not eval_problems:
            raise ValueError(f"task {cfg.task!r} has no held-out problems to evaluate on")
        self.evals = EvaluationRounds(cfg, eval_problems[: cfg.eval_prompts] if cfg.eval_prompts else eval_problems,
                                      self.flop_counter.n_params, self)  # eval_rounds.py
        self.length_control = make_length_control(cfg)
        on_gpu = self.device != "cpu"
        self.clock = TrainingClock(devices=self.setup.devices or self.layout.devices_reserved(on_gpu))
        # counters (checkpointed)
        self.step = 0
        self.next_order = 0
        self.next_generator = 0
        self.prompts_sampled = 0
        self.flops = 0.0
        self.cpu_base_s = 0.0  # CPU seconds of the run's sessions before this one (from the checkpoint)
        self.pending: list[Rollout] = []  # usable groups received, not yet in a batch
        self.batches: list[list[Rollout]] = []  # batches the scheme formed, not trained on yet
        self.outstanding = 0  # prompts ordered, not received yet (not checkpointed: generators restart empty)
        self.orders_this_wait = 0  # orders placed while the learner waits for its next batches
        self.totals = {"generated_tokens": 0, "stale_dropped": 0, "refill_dropped": 0, "verifier_errors": 0}

    def _connect(self) -> None:
        """Bind the transport, wait for every process, form the weight group, wait until all are ready."""
        from components.trainer.transport import Hub, PeersMissing
        from components.trainer.weight_sync import WeightSender, generator_state_meta

        cfg = self.cfg
        self.hub = Hub("learner-0", host="0.0.0.0", port=self.endpoints.hub_port, peers=self.layout.peer_names(),
                       heartbeat_s=cfg.heartbeat_s, timeout_s=cfg.heartbeat_timeout_s, on_lost=self._on_lost,
                       run_token=self.endpoints.token)
        self.inbox = Inbox(self.hub)
        try:
            self.hub.wait_for_peers(timeout_s=max(cfg.queue_timeout_s, 300.0))
        except PeersMissing as err:
            from components.trainer.roles import step_nodes

            if step_nodes() <= 1:
                raise
            raise PeersMissing(f"{err} Across nodes, the other tasks start only once they see learner-0's marker "
                               f"in the run directory {self.run_dir}: it must be on a filesystem every node shares") from err
        # the weight group forms at the first push (vLLM joins it from inside its worker when told to)
        self.sender = WeightSender(weight_group_of(cfg, self.endpoints, self.layout, self.device), device=self.device)
        self.weight_meta = generator_state_meta(self.learner.model, cfg.precision)
        deadline = time.monotonic() + max(cfg.queue_timeout_s, 300.0)
        while not set(self.generators) | set(self.followers) <= self.inbox.ready:
            if time.monotonic() > deadline:
                missing = sorted(set(self.generators) | set(self.followers) - self.inbox.ready)
                raise GeneratorError(f"processes never became ready (model / engine start-up): {', '.join(missing)}")
            self.inbox.pump(1.0)

    def _on_lost(self, error) -> None:
        """Heartbeat thread: a process died or hangs. Fail the run even if the main thread is stuck."""
        self._failing.set()

        def fail_if_stuck() -> None:
            if self._handled.wait(min(10.0, self.cfg.heartbeat_timeout_s)):
                return  # the main thread is failing the run itself
            # the main thread did not get to record the failure: it is stuck in a collective with the lost process
            print(f"[learner-0] {error}; the run fails", file=sys.stderr, flush=True)
            from components.trainer.runlog import EXIT_FAILED, EXIT_FAILURE_UNRECORDED, record_failure

            recorded = record_failure(self.run_dir, f"{type(error).__name__}: {error}")  # never raises
            try:
                self.hub.abort(str(error))
                time.sleep(0.5)
            finally:
                os._exit(EXIT_FAILED if recorded else EXIT_FAILURE_UNRECORDED)

        threading.Thread(target=fail_if_stuck, daemon=True, name="fail-if-stuck").start()

    # =====================================================================================
    # messages
    def send(self, peer: str, msg: M.Message) -> None:
        """One message to one process of the run (in order per peer)."""
        self.hub.send(peer, msg)

    def broadcast(self, msg: M.Message, peers: list) -> None:
        """One message to each of `peers` (encoded once)."""
        self.hub.broadcast(msg, peers=peers)

    def _receive(self) -> Rollout:
        """The next finished group from any generator (its generation counted); fails clearly if no
        rollout comes for queue_timeout_s."""
        rollout = self.inbox.next_rollout(self.cfg.queue_timeout_s)
        self._since["time_generate"] += rollout.time_generate
        # multi-turn: an environment's observation tokens count as prompt tokens, not generated ones
        tokens = sum(generated_token_count(c) for c in rollout.completions)
        self._since["generated_tokens"] += tokens
        self.totals["generated_tokens"] += tokens
        self.totals["verifier_errors"] += rollout.verifier_errors
        self.flops += sum(self.flop_counter.generation(len(c.prompt_ids) + observation_token_count(c), generated_token_count(c))
                          for c in rollout.completions)
        return rollout

    def push_weights(self) -> None:
        """Every learner rank gathers each parameter; rank 0 broadcasts it to every generator."""
        from components.trainer.weight_sync import WeightUpdate, push_weights

        if self.pushed_version == self.learner.version:
            return  # the generators already hold these weights (e.g. pushed for an evaluation)
        t0 = time.perf_counter()
        update = WeightUpdate.plan(self.learner.version, self.weight_meta, self.cfg.weight_sync_bucket_mb)
        self.broadcast(M.PushWeights(update), peers=self.generators)
        if self.followers:
            self.broadcast(M.JoinWeightSync(update), peers=self.followers)
        push_weights(self.learner.model, self.cfg.precision, update, self.sender)
        self.pushed_version = self.learner.version
        self._since["time_sync"] += time.perf_counter() - t0

    def _order(self, problems: list, seed: int) -> list[int]:
        """Send prompts to the generators (round-robin chunks); returns their order ids."""
        ids = list(range(self.next_order, self.next_order + len(problems)))
        self.next_order += len(problems)
        self.prompts_sampled += len(problems)
        n = len(self.generators)
        start = self.next_generator  # rotates, so small orders (refills, replacements) spread too
        for g, name in enumerate(self.generators):
            chunk = [(oid, p) for j, (oid, p) in enumerate(zip(ids, problems)) if (start + j) % n == g]
            if chunk:
                self.send(name, M.Work(WorkOrder(orders=chunk, seed=derive_seed(seed, g))))
        self.next_generator = (start + len(problems)) % n
        return ids

    # =====================================================================================
    # accounting: what the log lines say about time and compute
    def clock_fields(self) -> dict:
        """wall_s and compute_hours from ONE clock reading, so a log line's two fields agree."""
        wall = self.clock.wall_s()
        return {"compute_hours": self.clock.compute_hours(wall), "wall_s": wall}

    @property
    def version(self) -> int:
        """The learner's weight version."""
        return self.learner.version

    def cpu_hours(self, procs: Optional[dict] = None) -> float:
        """CPU hours of the run's processes since training started (resumes included)."""
        procs = self.inbox.procs if procs is None else procs
        cpu = sum(v["cpu_s"] - self._procs_at_start.get(k, {}).get("cpu_s", 0.0) for k, v in procs.items())
        return (self.cpu_base_s + cpu) / 3600.0

    def _proc_fields(self) -> dict:
        self.inbox.procs["learner-0"] = proc_stats()
        now = {k: dict(v) for k, v in self.inbox.procs.items()}
        step_share, run_share = self.foreign.update(now)
        fields = {
            "cpu_hours": self.cpu_hours(now),
            # other work on the run's CPUs (0: the run had its cores to itself); flagged above 0.10
            "contention": step_share,
            "contention_run": run_share,
            # the run's own threads waiting for a CPU (run-queue delay / (CPU + delay), schedstat)
            "runq_frac": contention(now, self._procs_at_step),
            # ... since training started (a resumed run: since its resume); with contention_run it
            # decides whether other work slowed the run (analysis.protocol.is_contended)
            "runq_run": contention(now, self._procs_at_start),
            "procs": now,
            "eval_wall_s": self.clock.eval_base_s,
            "startup_s": self.clock.startup_s(),
        }
        self._procs_at_step = now
        return fields

    def _reset_since(self) -> None:
        self._since = {"time_generate": 0.0, "time_sync": 0.0, "time_wait": 0.0, "generated_tokens": 0, "stale_dropped": 0, "refill_dropped": 0}

    # =====================================================================================
    # one learner step across the learner ranks
    def _learn(self, rollouts: list[Rollout]) -> dict:
        keep = [self.curriculum.keep(r.rewards) for r in rollouts]
        plan = self.learner.plan(rollouts, keep)
        peers = FollowerRanks(self.followers, self.hub, self.inbox, self.cfg.queue_timeout_s) if self.followers else None
        stats = self.learner.train(plan, peers)
        if plan.shards:  # the kept (trained) sequences' FLOPs: every pass of every update epoch
            batch = plan.batch
            prompt_lens = batch.attention_mask[:, : batch.completion_start].sum(dim=1).tolist()  # [B]
            for p_len, c_len in zip(prompt_lens, batch.num_tokens.tolist()):
                for flops in step_flop_terms(self.flop_counter, int(p_len), int(c_len), epochs=self.cfg.update_epochs,
                                             reference=self.learner.has_reference,
                                             old_pass=self.learner.fixes_old_logprobs):
                    self.flops += flops
        return stats

    def _train_step(self, rollouts: list[Rollout]) -> dict:
        stats = self._learn(rollouts)
        self.step += 1
        stats.pop("trained_seq_tokens", None)
        record = {
            "step": self.step,
            "version": self.learner.version,
            **self.clock_fields(),
            "flops": self.flops,
            "epoch": self.prompts_sampled / max(len(self.train_pool), 1),
            **stats,
            "time_generate": self._since["time_generate"],
            "time_sync": self._since["time_sync"],
            "time_wait": self._since["time_wait"],
            "generated_tokens": self._since["generated_tokens"],
            "stale_dropped": self._since["stale_dropped"],
            "refill_dropped": self._since["refill_dropped"],
            **self.curriculum.sampler.stats(),
            **episode_stats(rollouts),  # multi-turn only (train.environment): turns, tool calls, observation tokens
            "groups_by_generator": _count_by_generator(rollouts),
            **self._proc_fields(),
        }
        self.logs.log_step(record, rollouts, self.tokenizer)
        self._reset_since()
        return record

    def _budget_spent(self) -> bool:
        """A compute budget (train.compute_budget_flops, the tiny scale's stopping rule, or
        train.compute_budget_hours) is reached: the run ends here, evaluated and checkpointed."""
        cfg = self.cfg
        by_flops = cfg.compute_budget_flops is not None and self.flops >= cfg.compute_budget_flops
        by_hours = cfg.compute_budget_hours is not None and self.clock.compute_hours() >= cfg.compute_budget_hours
        return by_flops or by_hours

    def _after_step(self) -> bool:
        """Evaluation and checkpoint when due; True when the run should stop."""
        cfg = self.cfg
        last = self.step >= cfg.total_steps
        budget = self._budget_spent()
        if self.step % cfg.eval_every == 0 or last or budget:
            self.evals.evaluate()
        if downstream_due(cfg, self.step, last or budget):
            self.evals.downstream()
        if self.step % cfg.checkpoint_every == 0 or last or budget:
            self.checkpoints.save()
        return last or budget

    # =====================================================================================
    # control flow: the loop acts, the off-policy scheme decides (components/offpolicy.py)
    def _loop_state(self, waiting: bool) -> LoopState:
        """The snapshot the scheme decides from."""
        curriculum = self.curriculum
        return LoopState(step=self.step, total_steps=self.cfg.total_steps, prompts_per_step=self.P,
                         learner_version=self.learner.version, pushed_version=self.pushed_version,
                         pending=tuple(self.pending), outstanding=self.outstanding, next_order=self.next_order,
                         waiting=waiting, orders_this_wait=self.orders_this_wait,
                         max_refill_rounds=curriculum.max_refill_rounds if curriculum.refill else 0, run_seed=self.cfg.seed)

    def _train_loop(self) -> None:
        """Learner steps until the last one or the compute budget: batches as the scheme forms
        them, weights pushed and prompts ordered when it says so."""
        while self.step < self.cfg.total_steps:
            if not self.batches:
                self.batches = self._wait_for_batches()
            self._train_step(self.batches.pop(0))
            if self.scheme.push_after_step(self._loop_state(waiting=False)):
                self.push_weights()  # in flight, unless the scheme has generators finish their sequences first
            self._top_up(waiting=False)
            if self._after_step():
                return

    def _wait_for_batches(self) -> list[list[Rollout]]:
        """Receive finished groups until the scheme forms batches from them (the step's time_wait)."""
        t0, sync0 = time.perf_counter(), self._since["time_sync"]
        self.orders_this_wait = 0
        while True:
            self._drop_unusable()
            batches = self.scheme.batches(self._loop_state(waiting=True))
            if batches:
                break
            self._top_up(waiting=True)
            self._accept(self._await_groups())
        self._take(batches)
        self._since["time_wait"] += time.perf_counter() - t0 - (self._since["time_sync"] - sync0)
        return [list(b) for b in batches]

    def _top_up(self, waiting: bool) -> None:
        """Order the prompts the scheme asks for, after pushing the weights they must start from."""
        state = self._loop_state(waiting)
        n = self.scheme.prompts_to_order(state)
        if isinstance(n, bool) or int(n) != n or n < 0:
            raise ValueError(f"off-policy scheme {self.scheme.name!r}: prompts_to_order returned {n!r}; "
                             f"it must be an integer >= 0")
        if n == 0:
            return
        if self.pushed_version < self.scheme.start_version(state):
            self.push_weights()
            state = self._loop_state(waiting)
        self._order(self.curriculum.sample(int(n)), self.scheme.order_seed(state))
        self.outstanding += int(n)
        self.orders_this_wait += int(waiting)

    def _await_groups(self) -> list[Rollout]:
        """Receive the finished groups the scheme waits for; returns them in order-id order."""
        n = self.scheme.groups_to_await(self._loop_state(waiting=True))
        if self.outstanding < 1:
            raise ValueError(f"off-policy scheme {self.scheme.name!r} forms no batch from the {len(self.pending)} pending "
                             f"groups and orders no prompts (prompts_to_order is 0): the learner would wait forever")
        if isinstance(n, bool) or int(n) != n or n < 1:
            raise ValueError(f"off-policy scheme {self.scheme.name!r}: groups_to_await returned {n!r}; it must be an "
                             f"integer in [1, {self.outstanding}] (the prompts in flight)")
        got = [self._receive() for _ in range(min(int(n), self.outstanding))]
        self.outstanding -= len(got)
        return sorted(got, key=lambda r: r.order_id)  # deterministic order, whatever the arrival order

    def _accept(self, groups: list[Rollout]) -> None:
        """Show each group to the curriculum; keep it unless a refilling filter drops it."""
        for r in groups:
            self.curriculum.observe(r.problem_id, r.pass_rate)
            if self.curriculum.refill and not self.curriculum.keep(r.rewards):
                self._since["refill_dropped"] += 1
                self.totals["refill_dropped"] += 1
                continue
            self.pending.append(r)

    def _drop_unusable(self) -> None:
        """Drop the pending groups the scheme no longer lets the learner train on (stale_dropped)."""
        usable = []
        for r in self.pending:
            if self.scheme.usable(self.learner.version, r):
                usable.append(r)
            else:
                self._since["stale_dropped"] += 1
                self.totals["stale_dropped"] += 1
        self.pending = usable

    def _take(self, batches: list) -> None:
        """Remove the groups of the scheme's batches from the pending ones."""
        taken = {id(r) for batch in batches for r in batch}
        if not taken <= {id(r) for r in self.pending}:
            raise ValueError(f"off-policy scheme {self.scheme.name!r}: batches() returned groups that are not pending "
                             f"(it must take them from LoopState.pending)")
        self.pending = [r for r in self.pending if id(r) not in taken]

    # =====================================================================================
    def run(self) -> str:
        """Train to the end (or the compute budget). Returns "done"; raises on failure."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._build()
        try:
            self._connect()  # generators load their engines while the learner was built
            resumed = self.checkpoints.resume_or_start()  # the logs repaired to the checkpoint (or emptied)
            self.logs.open(self.step, self.flops, resumed)
            if self.step < self.cfg.total_steps:
                self.push_weights()  # version of the (possibly resumed) learner: part of (re)start-up
            self._reset_since()
            settle_heap()  # start-up's objects out of the collector's full passes
            self.clock.start()  # every generator is ready and has the weights: the training clock runs from here
            self.inbox.procs["learner-0"] = proc_stats()
            self._procs_at_start = {k: dict(v) for k, v in self.inbox.procs.items()}
            self._procs_at_step = dict(self._procs_at_start)
            self.foreign = ForeignLoad()
            self.foreign.update(self._procs_at_start)
            if self.step < self.cfg.total_steps:
                if self.step == 0 and not self.logs.evaluated:
                    self.evals.evaluate()  # R0: the pass rate before any training
                    if downstream_due(self.cfg, 0):
                        self.evals.downstream()
                self._train_loop()
            if self.checkpoints.last_step != self.step:
                self.checkpoints.save()
            write_final_policy(self.run_dir)
            write_text_atomic(self.run_dir / "config.gin", self.operative_config())  # the run's operative config
            self._status = "done"
            return "done"
        except (SystemExit, KeyboardInterrupt):
            self._status = "interrupted"
            raise
        except BaseException as err:
            self._handled.set()  # not stuck: this thread records the failure
            culprit = self._name_the_culprit(err)
            if culprit is err:
                raise
            raise culprit from err
        finally:
            self._shutdown()

    def operative_config(self) -> str:
        """The run's configuration as gin bindings, as it was resolved (`ResolvedRun.config_text`)."""
        return self.setup.run.config_text

    def _name_the_culprit(self, err: BaseException) -> BaseException:
        """A collective that failed because a process died: wait for the heartbeats to name it."""
        from components.trainer.checkpoint import NoIntactCheckpointError
        from components.trainer.transport import TransportError

        # (the last two: learner-0's own refusal of a damaged run directory, no process died)
        if isinstance(err, (TransportError, GeneratorError, LogLossError, NoIntactCheckpointError)) or self.hub is None:
            return err
        deadline = time.monotonic() + self.cfg.heartbeat_timeout_s + 5.0
        while time.monotonic() < deadline:
            try:  # a process that raised sent its traceback before dying: it names itself
                self.inbox.pump(0.2)
            except (TransportError, GeneratorError) as named:
                return named
            except Exception:  # noqa: BLE001 - anything else in the inbox is of no use now
                continue
        return err

    def _shutdown(self) -> None:
        self.logs.close(getattr(self, "_status", "failed"), self.operative_config())
        if getattr(self, "sender", None) is not None:
            try:
                self.sender.close()
            except Exception:  # noqa: BLE001
                pass
        if self.hub is not None:
            try:
                for peer in self.generators + self.followers:
                    try:
                        self.hub.send(peer, M.Stop(), timeout_s=2.0)
                    except Exception:  # noqa: BLE001 - a lost peer
                        pass
                if self._failing.is_set():
                    self.hub.abort("learner-0 stopped the run")
            finally:
                self.hub.close()
