"""The shared async trainer: learner (this process) + generator worker process(es).

    learner ──("work", prompts)──► control channel ──► generator(s): engine + verifier
    learner ──("weights", v, W)──►                         │
    learner ◄──────────── rollout queue (bounded) ◄────────┘ ("rollout", group)

The learner owns the curriculum (it orders prompts and sees every group's rewards, so the
pass-rate history lives in one place and is checkpointed), the optimizer and the run
directory. The off-policy scheme decides only the control flow (components/offpolicy.py).

Determinism: every sampling seed is a function of (run seed, step) and groups are sorted by
their order id before use, so under ppo_off_policy(1) on CPU a killed-and-resumed run
reproduces an uninterrupted one bit for bit (tests/test_checkpoint.py).
"""

from __future__ import annotations

import io
import logging
import queue
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from components.curricula import build_curriculum
from components.offpolicy import is_too_stale
from components.registry import OFF_POLICY
from components.trainer.checkpoint import latest_checkpoint, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from components.trainer.evaluation import eval_seed, evaluate
from components.trainer.generator import WorkerSetup, generator_main, make_length_control, make_run_engine, resolve_device
from components.trainer.learner import Learner
from components.trainer.rollout import Rollout, WorkOrder
from components.trainer.runlog import JsonlLog, read_jsonl, repair_jsonl

log = logging.getLogger(__name__)

__all__ = ["Trainer", "GeneratorError", "derive_seed"]


class GeneratorError(RuntimeError):
    """A generator process failed (its traceback is in the message)."""


def derive_seed(*parts: int) -> int:
    """A 31-bit seed that depends only on `parts` (never on process history)."""
    return int(np.random.default_rng([int(p) for p in parts]).integers(0, 2**31 - 1))


def serialize_weights(state_dict: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    return buf.getvalue()


class Trainer:
    def __init__(self, cfg, run_dir: Path, setup: WorkerSetup, run_info: Optional[dict] = None, progress: bool = True):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.setup = setup
        self.run_info = run_info
        self.progress = progress
        self.last_eval_pass_rate = float("nan")  # shown in the progress bar
        self.scheme = OFF_POLICY.get(cfg.off_policy)()
        self.P = cfg.prompts_per_step
        self.procs: list = []
        self.control_qs: list = []
        self.rollout_q = None
        self.generators_ready = 0

    # =====================================================================================
    # setup
    def _build(self) -> None:
        from components.models import load_causal_lm, load_tokenizer
        from components.registry import PRECISIONS
        from components.tasks import make_task

        cfg = self.cfg
        self.device = resolve_device(cfg.device, "learner")
        if self.device == "cpu":
            torch.set_num_threads(1)  # one core for the learner, one per generator
        torch.manual_seed(cfg.seed)
        self.task = make_task(cfg.task, seed=cfg.seed, **cfg.task_kwargs)
        self.tokenizer = load_tokenizer(cfg.model_path)
        model = load_causal_lm(cfg.model_path)
        PRECISIONS.get(cfg.precision)().prepare_model(model)
        model.to(self.device)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.learner = Learner(model, cfg, pad_id, torch.device(self.device))
        self.curriculum = build_curriculum(cfg.curriculum, self.task.train_problems(), cfg.seed)
        eval_problems = list(self.task.eval_problems())
        if not eval_problems:
            raise ValueError(f"task {cfg.task!r} has no held-out problems to evaluate on")
        self.eval_problems = eval_problems[: cfg.eval_prompts] if cfg.eval_prompts else eval_problems
        self.length_control = make_length_control(cfg)
        self.num_processes = 1 + cfg.num_generators  # compute accounting: learner + generators
        # counters (checkpointed)
        self.step = 0
        self.next_order = 0
        self.wall_base = 0.0
        self.flops = 0.0
        self.pending: list[Rollout] = []  # pipeline_rl: received, not yet trained on
        self.pending_batches: list[list[Rollout]] = []  # ppo_off_policy: the rest of a round
        self.totals = {"generated_tokens": 0, "stale_dropped": 0, "refill_dropped": 0, "verifier_errors": 0}

    def _resume_or_start(self) -> bool:
        ckpt_path = latest_checkpoint(self.run_dir / "checkpoints")
        metrics_path, eval_path = self.run_dir / "metrics.jsonl", self.run_dir / "eval.jsonl"
        if ckpt_path is None:
            # nothing to resume from: any log lines belong to a run that never checkpointed
            repair_jsonl(metrics_path, None)
            repair_jsonl(eval_path, None)
            return False
        state = load_checkpoint(ckpt_path)
        self.learner.load_state_dict(state["learner"])
        self.curriculum.load_state_dict(state["curriculum"])
        self.step = int(state["step"])
        self.next_order = int(state["next_order"])
        self.wall_base = float(state["wall_s"])
        self.flops = float(state["flops"])
        self.pending = list(state.get("pending", []))
        self.pending_batches = [list(b) for b in state.get("pending_batches", [])]
        self.totals.update(state.get("totals", {}))
        set_rng_state(state["rng"])
        repair_jsonl(metrics_path, self.step)
        repair_jsonl(eval_path, self.step)
        log.info("resumed %s from %s (step %d, version %d)", self.run_dir, ckpt_path.name, self.step, self.learner.version)
        return True

    def _checkpoint(self) -> None:
        state = {
            "step": self.step,
            "learner": self.learner.state_dict(),
            "curriculum": self.curriculum.state_dict(),
            "next_order": self.next_order,
            "wall_s": self.wall_s(),
            "flops": self.flops,
            "pending": self.pending,
            "pending_batches": self.pending_batches,
            "totals": dict(self.totals),
            "rng": rng_state(),
            "config": self.cfg.to_dict(),
        }
        save_checkpoint(self.run_dir / "checkpoints", self.step, state, keep=self.cfg.keep_checkpoints)

    # =====================================================================================
    # processes and channels
    def _start_generators(self) -> None:
        ctx = torch.multiprocessing.get_context("spawn")
        cfg = self.cfg
        # bounded: generators block when the learner falls behind
        self.rollout_q = ctx.Queue(maxsize=max(4 * self.P * self.scheme.prompts_per_round_factor, 8))
        for i in range(cfg.num_generators):
            control_q = ctx.Queue()
            setup = WorkerSetup(
                config_files=self.setup.config_files,
                bindings=self.setup.bindings,
                sys_path=self.setup.sys_path,
                cfg=cfg,
                device=resolve_device(cfg.device, "generator", i),
            )
            proc = ctx.Process(target=generator_main, args=(i, setup, control_q, self.rollout_q), daemon=True, name=f"scalerl-generator-{i}")
            proc.start()
            self.procs.append(proc)
            self.control_qs.append(control_q)

    def _stop_generators(self) -> None:
        for q in self.control_qs:
            try:
                q.put(("stop",))
            except Exception:  # noqa: BLE001
                pass
        deadline = time.time() + 15
        while self.rollout_q is not None and any(p.is_alive() for p in self.procs) and time.time() < deadline:
            try:  # a generator blocked on a full rollout queue must be able to see "stop"
                self.rollout_q.get(timeout=0.05)
            except (queue.Empty, OSError, ValueError, EOFError):
                pass
        for p in self.procs:
            if p.is_alive():
                p.terminate()
            p.join(timeout=5)
        for q in self.control_qs + ([self.rollout_q] if self.rollout_q is not None else []):
            try:
                q.cancel_join_thread()
                q.close()
            except Exception:  # noqa: BLE001
                pass
        self.procs, self.control_qs = [], []

    def _receive(self) -> Rollout:
        """The next finished group from any generator; fails clearly if a generator died or hung."""
        waited = 0.0
        while True:
            try:
                msg = self.rollout_q.get(timeout=1.0)
            except queue.Empty:
                waited += 1.0
                dead = [p for p in self.procs if not p.is_alive()]
                if dead:
                    try:  # the error message may still be in flight
                        msg = self.rollout_q.get(timeout=2.0)
                    except queue.Empty:
                        raise GeneratorError(f"generator process {dead[0].name} exited with code {dead[0].exitcode}") from None
                elif waited >= self.cfg.queue_timeout_s:
                    raise GeneratorError(f"no rollout arrived for {waited:.0f}s (train.queue_timeout_s); generators hung?")
                else:
                    continue
            if msg[0] == "error":
                raise GeneratorError(f"generator {msg[1]} failed:\n{msg[2]}")
            if msg[0] == "ready":
                self.generators_ready += 1
                continue
            rollout = msg[1]
            self._since["time_generate"] += rollout.time_generate
            tokens = sum(len(c.token_ids) for c in rollout.completions)
            self._since["generated_tokens"] += tokens
            self.totals["generated_tokens"] += tokens
            self.totals["verifier_errors"] += rollout.verifier_errors
            self.flops += 2.0 * self.learner.num_parameters * tokens
            return rollout

    def _push_weights(self) -> None:
        t0 = time.perf_counter()
        payload = serialize_weights(self.learner.weights_for_generators())
        for q in self.control_qs:
            q.put(("weights", self.learner.version, payload))
        self._since["time_sync"] += time.perf_counter() - t0

    def _order(self, problems: list, seed: int) -> list[int]:
        """Send prompts to the generators (round-robin chunks); returns their order ids."""
        ids = list(range(self.next_order, self.next_order + len(problems)))
        self.next_order += len(problems)
        n = len(self.control_qs)
        for g in range(n):
            chunk = [(oid, p) for j, (oid, p) in enumerate(zip(ids, problems)) if j % n == g]
            if chunk:
                self.control_qs[g].put(("work", WorkOrder(orders=chunk, seed=derive_seed(seed, g))))
        return ids

    # =====================================================================================
    # logging
    def wall_s(self) -> float:
        return self.wall_base + (time.time() - self.t_start)

    def compute_hours(self, wall_s: Optional[float] = None) -> float:
        """Processes in use x wall-clock hours (at `wall_s`, default now)."""
        return (self.wall_s() if wall_s is None else wall_s) * self.num_processes / 3600.0

    def clock(self) -> dict:
        """wall_s and compute_hours from ONE clock reading, so a log line's two fields agree."""
        wall = self.wall_s()
        return {"compute_hours": self.compute_hours(wall), "wall_s": wall}

    def _evaluate(self) -> None:
        cfg = self.cfg
        self.eval_engine.update_weights(self.learner.model.state_dict(), self.learner.version)
        record = evaluate(
            self.eval_engine,
            self.task,
            self.eval_problems,
            self.tokenizer,
            k=cfg.eval_k,
            seed=eval_seed(cfg.seed, self.step),
            temperature=cfg.eval_temperature if cfg.eval_temperature is not None else cfg.temperature,
            top_p=cfg.top_p,
            max_tokens=cfg.max_tokens,
            task_name=cfg.task,
            length_control=self.length_control,
            verifier_timeout_s=cfg.verifier_timeout_s,
        )
        self.flops += 2.0 * self.learner.num_parameters * record["eval_tokens"]
        clock = self.clock()
        self.eval_log.write({"step": self.step, "version": self.learner.version, "compute_hours": clock["compute_hours"],
                             "flops": self.flops, "wall_s": clock["wall_s"], **record})
        self.last_eval_pass_rate = record["pass_rate"]
        if self.bar is not None:
            self.bar.write(f"eval @ step {self.step}: held-out pass rate {record['pass_rate']:.3f} "
                           f"(mean@{cfg.eval_k}, compute {clock['compute_hours']:.4f} h)")

    def _reset_since(self) -> None:
        self._since = {"time_generate": 0.0, "time_sync": 0.0, "time_wait": 0.0, "generated_tokens": 0, "stale_dropped": 0, "refill_dropped": 0}

    def _train_step(self, rollouts: list[Rollout]) -> dict:
        keep = [self.curriculum.keep(r.rewards) for r in rollouts]
        stats = self.learner.step(rollouts, keep)
        self.step += 1
        self.flops += 6.0 * self.learner.num_parameters * stats.pop("trained_seq_tokens", 0)
        record = {
            "step": self.step,
            "version": self.learner.version,
            **self.clock(),
            "flops": self.flops,
            **stats,
            "time_generate": self._since["time_generate"],
            "time_sync": self._since["time_sync"],
            "time_wait": self._since["time_wait"],
            "generated_tokens": self._since["generated_tokens"],
            "stale_dropped": self._since["stale_dropped"],
            "refill_dropped": self._since["refill_dropped"],
            **self.curriculum.sampler.stats(),
        }
        self.metrics_log.write(record)
        self._reset_since()
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(
                train_pass=f"{record['pass_rate']:.2f}",
                held_out=f"{self.last_eval_pass_rate:.2f}",
                compute=f"{record['compute_hours']:.4f}h",
                lag=record.get("lag_max"),
            )
        return record

    def _after_step(self) -> bool:
        """Evaluation and checkpoint when due; True when the run should stop."""
        cfg = self.cfg
        last = self.step >= cfg.total_steps
        budget = cfg.compute_budget_hours is not None and self.compute_hours() >= cfg.compute_budget_hours
        if self.step % cfg.eval_every == 0 or last or budget:
            self._evaluate()
        if self.step % cfg.checkpoint_every == 0 or last or budget:
            self._checkpoint()
        return last or budget

    # =====================================================================================
    # control flow
    def _collect(self, n: int, seed: int) -> list[Rollout]:
        """Order n prompts and wait for all of them (frozen weights); refill if the curriculum says so."""
        wanted = n
        kept: list[Rollout] = []
        rounds = 0
        while True:
            ids = self._order(self.curriculum.sample(wanted), derive_seed(seed, rounds))
            got = {}
            t0 = time.perf_counter()
            while len(got) < len(ids):
                r = self._receive()
                got[r.order_id] = r
            self._since["time_wait"] += time.perf_counter() - t0
            for oid in sorted(got):  # deterministic order, whatever the arrival order
                r = got[oid]
                self.curriculum.observe(r.problem_id, r.pass_rate)
                if self.curriculum.refill and not self.curriculum.keep(r.rewards):
                    self._since["refill_dropped"] += 1
                    self.totals["refill_dropped"] += 1
                    continue
                kept.append(r)
            if not self.curriculum.refill or len(kept) >= n or rounds >= self.curriculum.max_refill_rounds:
                return kept[:n] if self.curriculum.refill else kept
            wanted = n - len(kept)
            rounds += 1

    def _run_ppo(self) -> None:
        """ppo_off_policy(k): k x batch with frozen weights, k learner steps, then sync."""
        cfg, k = self.cfg, self.scheme.k
        while self.step < cfg.total_steps:
            if not self.pending_batches:
                steps = min(k, cfg.total_steps - self.step)
                got = self._collect(self.P * steps, derive_seed(cfg.seed, self.step, 1))
                # k mini-batches of P prompts (a refill that ran out of rounds leaves some short)
                self.pending_batches = [got[i * self.P : (i + 1) * self.P] for i in range(steps)]
            stop = False
            while self.pending_batches and not stop:
                batch = self.pending_batches.pop(0)
                self._train_step(batch)
                stop = self._after_step()
            if stop:
                return
            self._push_weights()

    def _run_pipeline(self) -> None:
        """pipeline_rl(k): streaming generation, weights pushed in flight after every step."""
        cfg, k = self.cfg, self.scheme.k
        target = self.P * self.scheme.inflight_batches  # prompts ordered ahead of the learner
        outstanding = 0

        def top_up() -> None:
            nonlocal outstanding
            missing = target - outstanding - len(self.pending)
            if missing > 0:
                self._order(self.curriculum.sample(missing), derive_seed(cfg.seed, self.next_order, 2))
                outstanding += missing

        while self.step < cfg.total_steps:
            t0 = time.perf_counter()
            while True:
                # never train on a token more than k versions old: drop stale groups (and re-order)
                fresh = []
                for r in self.pending:
                    if is_too_stale(self.learner.version, r.min_version, k):
                        self._since["stale_dropped"] += 1
                        self.totals["stale_dropped"] += 1
                    else:
                        fresh.append(r)
                self.pending = fresh
                if len(self.pending) >= self.P:
                    break
                top_up()
                r = self._receive()
                outstanding -= 1
                self.curriculum.observe(r.problem_id, r.pass_rate)
                if self.curriculum.refill and not self.curriculum.keep(r.rewards):
                    self._since["refill_dropped"] += 1
                    self.totals["refill_dropped"] += 1
                    continue
                self.pending.append(r)
            self._since["time_wait"] += time.perf_counter() - t0
            batch, self.pending = self.pending[: self.P], self.pending[self.P :]
            self._train_step(batch)
            self._push_weights()  # in flight: generators load it between decode steps
            top_up()
            if self._after_step():
                return

    # =====================================================================================
    def run(self) -> str:
        """Train to the end (or the compute budget). Returns "done"; raises on failure."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._build()
        try:
            self._start_generators()  # they load their engines while the learner sets up
            self._resume_or_start()
            self.t_start = time.time()
            self._reset_since()
            self.metrics_log = JsonlLog(self.run_dir / "metrics.jsonl")
            self.eval_log = JsonlLog(self.run_dir / "eval.jsonl")
            self.eval_engine = make_run_engine(self.cfg, self.device, seed=self.cfg.seed, name=self.cfg.eval_engine)
            self.bar = None
            if self.progress:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=self.cfg.total_steps, initial=self.step, desc=f"train {self.run_dir.name}", mininterval=2.0)
            evals = read_jsonl(self.run_dir / "eval.jsonl")
            if evals:  # a resumed run: show its last held-out pass rate until the next evaluation
                self.last_eval_pass_rate = evals[-1].get("pass_rate", float("nan"))
            if self.step == 0 and not evals:
                self._evaluate()  # R0: the pass rate before any training
            if self.step < self.cfg.total_steps:
                self._push_weights()  # version of the (possibly resumed) learner
                if self.scheme.streaming:
                    self._run_pipeline()
                else:
                    self._run_ppo()
            return "done"
        finally:
            self._stop_generators()
            for name in ("metrics_log", "eval_log"):
                if hasattr(self, name):
                    getattr(self, name).close()
            if getattr(self, "bar", None) is not None:
                self.bar.close()
            if getattr(self, "eval_engine", None) is not None:
                try:
                    self.eval_engine.close()
                except Exception:  # noqa: BLE001
                    pass
