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
from components.trainer.evaluation import downstream_due, eval_seed, is_downstream_record, merge_eval_records
from components.trainer.export import write_final_policy
from components.trainer.follower_ranks import FollowerRanks, GeneratorError
from components.trainer.generator import EvalOrder, WorkerSetup, make_length_control
from components.trainer import messages as M
from components.trainer.learner import Learner
from components.trainer.roles import pin_cpu, settle_heap
from components.trainer.rollout import Rollout, WorkOrder
from components.trainer.runlog import (JsonlLog, LogLossError, read_jsonl, repair_jsonl, resume_log,
                                      write_text_atomic)
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
        self.progress = progress
        self.last_eval_pass_rate = float("nan")  # shown in the progress bar
        self.scheme = make_scheme(cfg.off_policy, component_params(cfg, OFF_POLICY, cfg.off_policy))
        self.P = cfg.prompts_per_step
        self.generators = layout.generator_names()
        self.followers = [f"learner-{k}" for k in range(1, layout.learner_ranks)]
        self.hub = None
        self.bar = None
        self.rollouts: list[Rollout] = []  # received, not yet handed to the control flow
        self.step_parts: dict[int, dict] = {}
        self.eval_done: dict[int, dict] = {}
        self.ready: set = set()
        self.drained: set = set()  # generators that finished their in-flight training sequences
        self.drain_groups = 0  # training groups they finished while draining
        self.procs: dict = {}  # process name -> latest proc_stats()
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
        self.eval_problems = eval_problems[: cfg.eval_prompts] if cfg.eval_prompts else eval_problems
        self.length_control = make_length_control(cfg)
        on_gpu = self.device != "cpu"
        self.clock = TrainingClock(devices=self.setup.devices or self.layout.devices_reserved(on_gpu))
        # counters (checkpointed)
        self.step = 0
        self.next_order = 0
        self.next_generator = 0
        self.prompts_sampled = 0
        self.flops = 0.0
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
        while not set(self.generators) | set(self.followers) <= self.ready:
            if time.monotonic() > deadline:
                missing = sorted(set(self.generators) | set(self.followers) - self.ready)
                raise GeneratorError(f"processes never became ready (model / engine start-up): {', '.join(missing)}")
            self._pump(1.0)

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
    def _pump(self, timeout_s: float) -> None:
        """Receive one message (if any within timeout) and file it where it belongs."""
        got = self.hub.recv(timeout_s)
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

    def _receive(self) -> Rollout:
        """The next finished group from any generator; fails clearly if no rollout comes for queue_timeout_s."""
        waited = 0.0
        t0 = time.monotonic()
        while not self.rollouts:
            self._pump(1.0)
            waited = time.monotonic() - t0
            if not self.rollouts and waited >= self.cfg.queue_timeout_s:
                raise GeneratorError(f"no rollout arrived for {waited:.0f}s (train.queue_timeout_s); generators hung? "
                                     f"process states: {self.hub.state()}")
        rollout = self.rollouts.pop(0)
        self._since["time_generate"] += rollout.time_generate
        # multi-turn: an environment's observation tokens count as prompt tokens, not generated ones
        tokens = sum(generated_token_count(c) for c in rollout.completions)
        self._since["generated_tokens"] += tokens
        self.totals["generated_tokens"] += tokens
        self.totals["verifier_errors"] += rollout.verifier_errors
        self.flops += sum(self.flop_counter.generation(len(c.prompt_ids) + observation_token_count(c), generated_token_count(c))
                          for c in rollout.completions)
        return rollout

    def _push_weights(self) -> None:
        """Every learner rank gathers each parameter; rank 0 broadcasts it to every generator."""
        from components.trainer.weight_sync import WeightUpdate, push_weights

        if self.pushed_version == self.learner.version:
            return  # the generators already hold these weights (e.g. pushed for an evaluation)
        t0 = time.perf_counter()
        update = WeightUpdate.plan(self.learner.version, self.weight_meta, self.cfg.weight_sync_bucket_mb)
        self.hub.broadcast(M.PushWeights(update), peers=self.generators)
        if self.followers:
            self.hub.broadcast(M.JoinWeightSync(update), peers=self.followers)
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
                self.hub.send(name, M.Work(WorkOrder(orders=chunk, seed=derive_seed(seed, g))))
        self.next_generator = (start + len(problems)) % n
        return ids

    # =====================================================================================
    # logging
    def clock_fields(self) -> dict:
        """wall_s and compute_hours from ONE clock reading, so a log line's two fields agree."""
        wall = self.clock.wall_s()
        return {"compute_hours": self.clock.compute_hours(wall), "wall_s": wall}

    def _cpu_hours(self, procs: Optional[dict] = None) -> float:
        """CPU hours of the run's processes since training started (resumes included)."""
        procs = self.procs if procs is None else procs
        cpu = sum(v["cpu_s"] - self._procs_at_start.get(k, {}).get("cpu_s", 0.0) for k, v in procs.items())
        return (self.cpu_base_s + cpu) / 3600.0

    def _proc_fields(self) -> dict:
        self.procs["learner-0"] = proc_stats()
        now = {k: dict(v) for k, v in self.procs.items()}
        step_share, run_share = self.foreign.update(now)
        fields = {
            "cpu_hours": self._cpu_hours(now),
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

    def _pause_for_evaluation(self) -> tuple[float, int]:
        """Before an evaluation: the learner's version to the generators, their in-flight training
        work drained (on the training clock), then the clock paused. Returns `_drain`'s (seconds, groups)."""
        if self.pushed_version != self.learner.version:
            self._push_weights()
        drained = self._drain()
        self.clock.pause()
        return drained

    def _drain(self) -> tuple[float, int]:
        """Every generator decodes its in-flight training sequences to their end and sends them scored,
        ON the training clock (they are training work): an evaluation after it holds no training
        work on its own time. Returns the seconds it took and the groups the generators finished."""
        t0 = time.time()
        self.drained = set()
        self.drain_groups = 0
        for name in self.generators:
            self.hub.send(name, M.Drain())
        progress = (len(self.rollouts), len(self.drained))
        deadline = time.monotonic() + self.cfg.queue_timeout_s  # since the last group or answer arrived
        while len(self.drained) < len(self.generators):
            if time.monotonic() > deadline:
                late = sorted(set(self.generators) - self.drained)
                raise GeneratorError(f"{', '.join(late)}: no in-flight sequence finished within train.queue_timeout_s="
                                     f"{self.cfg.queue_timeout_s}s while draining before an evaluation")
            self._pump(1.0)
            if (len(self.rollouts), len(self.drained)) != progress:
                progress = (len(self.rollouts), len(self.drained))
                deadline = time.monotonic() + self.cfg.queue_timeout_s
        return time.time() - t0, self.drain_groups

    def _evaluate(self) -> None:
        """Held-out mean@k on the generators at the learner's current version (pinned), off the training clock."""
        cfg = self.cfg
        drain_s, drain_groups = self._pause_for_evaluation()
        t0 = time.time()
        seed = eval_seed(cfg.seed, self.step)
        G = len(self.generators)
        shares = [[(i, p) for i, p in enumerate(self.eval_problems) if i % G == g] for g in range(G)]
        self.eval_done = {}
        asked = []
        for g, (name, share) in enumerate(zip(self.generators, shares)):
            if share:
                order = EvalOrder(problems=share, version=self.learner.version, seed=seed if G == 1 else derive_seed(seed, g),
                                  k=cfg.eval_k, temperature=cfg.eval_temperature if cfg.eval_temperature is not None else cfg.temperature,
                                  top_p=cfg.top_p, max_tokens=cfg.max_tokens, task_name=cfg.task if isinstance(cfg.task, str) else "mixture")
                self.hub.send(name, M.Evaluate(order))
                asked.append(g)
        deadline = time.monotonic() + cfg.queue_timeout_s
        while len(self.eval_done) < len(asked):
            if time.monotonic() > deadline:
                raise GeneratorError(f"the evaluation did not finish within train.queue_timeout_s={cfg.queue_timeout_s}s "
                                     f"(answered: {sorted(self.eval_done)} of {asked})")
            self._pump(1.0)
        record = merge_eval_records([self.eval_done[g] for g in asked], self.eval_problems,
                                    cfg.task if isinstance(cfg.task, str) else "mixture")
        eval_wall = time.time() - t0
        self.clock.resume()
        self.clock.eval_base_s += eval_wall
        clock = self.clock_fields()
        line = {
            "step": self.step, "version": self.learner.version, "compute_hours": clock["compute_hours"], "flops": self.flops,
            "wall_s": clock["wall_s"], "eval_wall_s": eval_wall, "eval_compute_hours": eval_wall * self.clock.devices / 3600.0,
            "drain_s": drain_s, "drain_groups": drain_groups,
            "eval_flops": 2.0 * self.flop_counter.n_params * record.get("eval_tokens", 0),
            "cpu_hours": self._cpu_hours(), **record,
        }
        self.eval_log.write(line)
        self.tracker.log_eval(line)
        self.last_eval_pass_rate = record["pass_rate"]
        if self.bar is not None:
            self.bar.write(f"eval @ step {self.step}: held-out pass rate {record['pass_rate']:.3f} "
                           f"(mean@{cfg.eval_k}, compute {clock['compute_hours']:.4f} h)")

    def _downstream(self) -> None:
        """Downstream benchmarks (mean@k, pass@k) on generator-0 at the current version, off the training clock."""
        cfg = self.cfg
        self._pause_for_evaluation()
        t0 = time.time()
        self.downstream_done = None
        self.hub.send(self.generators[0], M.RunDownstream(self.step))
        deadline = time.monotonic() + cfg.queue_timeout_s
        while self.downstream_done is None:
            if time.monotonic() > deadline:
                raise GeneratorError(f"the downstream benchmarks did not finish within train.queue_timeout_s={cfg.queue_timeout_s}s")
            self._pump(1.0)
        wall = time.time() - t0
        self.clock.resume()
        self.clock.eval_base_s += wall
        clock = self.clock_fields()
        for record in self.downstream_done:
            line = {"step": self.step, "version": self.learner.version, "compute_hours": clock["compute_hours"],
                    "flops": self.flops, "wall_s": clock["wall_s"], **record}
            self.eval_log.write(line)
            self.tracker.log_eval(line)
            if self.bar is not None:
                self.bar.write(f"benchmark {record.get('benchmark')} @ step {self.step}: mean@{record.get('k')} "
                               f"{record.get('mean@k', float('nan')):.3f}")

    def _reset_since(self) -> None:
        self._since = {"time_generate": 0.0, "time_sync": 0.0, "time_wait": 0.0, "generated_tokens": 0, "stale_dropped": 0, "refill_dropped": 0}

    # =====================================================================================
    # one learner step across the learner ranks
    def _learn(self, rollouts: list[Rollout]) -> dict:
        keep = [self.curriculum.keep(r.rewards) for r in rollouts]
        plan = self.learner.plan(rollouts, keep)
        stats = self.learner.train(plan, FollowerRanks(self) if self.followers else None)
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
        self.metrics_log.write(record)
        self.tracker.log_metrics(record)
        self.tracker.log_samples(self.step, rollouts, self.tokenizer)
        self._reset_since()
        if self.bar is not None:
            if self.cfg.compute_budget_flops is not None:
                self.bar.update(min(100, int(100 * self.flops / self.cfg.compute_budget_flops)) - self.bar.n)
            else:
                self.bar.update(1)
            self.bar.set_postfix(
                train_pass=f"{record['pass_rate']:.2f}",
                held_out=f"{self.last_eval_pass_rate:.2f}",
                compute=f"{record['compute_hours']:.4f}h",
                lag=record.get("lag_max"),
            )
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
            self._evaluate()
        if downstream_due(cfg, self.step, last or budget):
            self._downstream()
        if self.step % cfg.checkpoint_every == 0 or last or budget:
            self._checkpoint()
        return last or budget

    # =====================================================================================
    # checkpoints
    def _trainer_state(self) -> dict:
        return {
            "step": self.step,
            "version": self.learner.version,
            "curriculum": self.curriculum.state_dict(),
            "next_order": self.next_order,
            "next_generator": self.next_generator,
            "prompts_sampled": self.prompts_sampled,
            "wall_s": self.clock.wall_s(),
            "eval_wall_s": self.clock.eval_base_s,
            "startup_s": self.clock.startup_s(),
            "cpu_s": self._cpu_hours() * 3600.0,
            "flops": self.flops,
            "pending": self.pending,
            "pending_batches": self.batches,
            "totals": dict(self.totals),
            "config": self.cfg.to_dict(),
            "learner_ranks": self.layout.learner_ranks,
        }

    def _checkpoint(self) -> None:
        from components.trainer.checkpoint import rng_state, save_checkpoint

        # every log line so far on disk (fsync) before the checkpoint that counts on them is committed
        logs = {log_.path.name: log_.sync() for log_ in (self.metrics_log, self.eval_log)}
        if self.followers:
            self.hub.broadcast(M.SaveCheckpoint(self.step), peers=self.followers)
        save_checkpoint(self.run_dir / "checkpoints", self.step, model=self.learner.model, optimizer=self.learner.optimizer,
                        scheduler_state=self.learner.scheduler.state_dict(), trainer_state=self._trainer_state(),
                        rank_state=rng_state(), keep=self.cfg.keep_checkpoints, tokenizer=self.tokenizer, logs=logs)
        self.last_checkpoint_step = self.step

    def _resume_or_start(self) -> bool:
        from components.trainer.checkpoint import load_checkpoint, read_checkpoint_info, select_resume_checkpoint, set_rng_state

        # the newest intact checkpoint (damaged newer ones are named in a warning and moved aside)
        ckpt_path = select_resume_checkpoint(self.run_dir / "checkpoints")
        metrics_path, eval_path = self.run_dir / "metrics.jsonl", self.run_dir / "eval.jsonl"
        if ckpt_path is not None:  # before any loading: refuse logs that lost records the checkpoint counts on
            info = read_checkpoint_info(ckpt_path)
            counted = info.get("logs") or {}
            resume_log(metrics_path, int(info["step"]), counted.get(metrics_path.name), every_step=True)
            resume_log(eval_path, int(info["step"]), counted.get(eval_path.name))
        if self.followers:
            self.hub.broadcast(M.LoadCheckpoint(None if ckpt_path is None else str(ckpt_path)), peers=self.followers)
        self.cpu_base_s = 0.0
        if ckpt_path is None:
            # nothing to resume from: any log lines belong to a run that never checkpointed
            repair_jsonl(metrics_path, None)
            repair_jsonl(eval_path, None)
            return False
        loaded = load_checkpoint(ckpt_path, model=self.learner.model, optimizer=self.learner.optimizer)
        state = loaded["trainer_state"]
        self.learner.scheduler.load_state_dict(loaded["scheduler_state"])
        self.learner.version = int(state["version"])
        self.curriculum.load_state_dict(state["curriculum"])
        self.step = int(state["step"])
        self.next_order = int(state["next_order"])
        self.next_generator = int(state.get("next_generator", 0)) % max(len(self.generators), 1)
        self.prompts_sampled = int(state.get("prompts_sampled", self.next_order))
        self.clock.base_s = float(state["wall_s"])
        self.clock.eval_base_s = float(state.get("eval_wall_s", 0.0))
        self.clock.startup_base_s = float(state.get("startup_s", 0.0))
        self.cpu_base_s = float(state.get("cpu_s", 0.0))
        self.flops = float(state["flops"])
        self.pending = list(state.get("pending", []))
        self.batches = [list(b) for b in state.get("pending_batches", [])]
        self.totals.update(state.get("totals", {}))
        if loaded.get("rank_state") is not None:
            set_rng_state(loaded["rank_state"])
        self.last_checkpoint_step = self.step
        log.info("resumed %s from %s (step %d, version %d)", self.run_dir, ckpt_path.name, self.step, self.learner.version)
        return True

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
                self._push_weights()  # in flight, unless the scheme has generators finish their sequences first
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
            self._push_weights()
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
        self.last_checkpoint_step = -1
        try:
            self._connect()  # generators load their engines while the learner was built
            resumed = self._resume_or_start()
            from components.trainer.tracking import RunTracker

            self.tracker = RunTracker.from_config(self.cfg, self.run_dir, resume_step=self.step if resumed else None)
            self.metrics_log = JsonlLog(self.run_dir / "metrics.jsonl")
            self.eval_log = JsonlLog(self.run_dir / "eval.jsonl")
            if self.progress:
                from tqdm.auto import tqdm

                if self.cfg.compute_budget_flops is not None:  # the budget ends the run: show its share
                    self.bar = tqdm(total=100, initial=min(100, int(100 * self.flops / self.cfg.compute_budget_flops)),
                                    unit="% of budget", desc=f"train {self.run_dir.name}", mininterval=2.0)
                else:
                    self.bar = tqdm(total=self.cfg.total_steps, initial=self.step, desc=f"train {self.run_dir.name}",
                                    mininterval=2.0)
            evals = [e for e in read_jsonl(self.run_dir / "eval.jsonl") if not is_downstream_record(e)]
            if evals:  # a resumed run: show its last held-out pass rate until the next evaluation
                self.last_eval_pass_rate = evals[-1].get("pass_rate", float("nan"))
            if self.step < self.cfg.total_steps:
                self._push_weights()  # version of the (possibly resumed) learner: part of (re)start-up
            self._reset_since()
            settle_heap()  # start-up's objects out of the collector's full passes
            self.clock.start()  # every generator is ready and has the weights: the training clock runs from here
            self.procs["learner-0"] = proc_stats()
            self._procs_at_start = {k: dict(v) for k, v in self.procs.items()}
            self._procs_at_step = dict(self._procs_at_start)
            self.foreign = ForeignLoad()
            self.foreign.update(self._procs_at_start)
            if self.step < self.cfg.total_steps:
                if self.step == 0 and not evals:
                    self._evaluate()  # R0: the pass rate before any training
                    if downstream_due(self.cfg, 0):
                        self._downstream()
                self._train_loop()
            if self.last_checkpoint_step != self.step:
                self._checkpoint()
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
                self._pump(0.2)
            except (TransportError, GeneratorError) as named:
                return named
            except Exception:  # noqa: BLE001 - anything else in the inbox is of no use now
                continue
        return err

    def _shutdown(self) -> None:
        if getattr(self, "tracker", None) is not None:
            self.tracker.close(getattr(self, "_status", "failed"), operative_config=self.operative_config())
        for name in ("metrics_log", "eval_log"):
            if hasattr(self, name):
                getattr(self, name).close()
        if self.bar is not None:
            self.bar.close()
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
