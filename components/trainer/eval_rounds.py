"""Evaluation rounds: learner-0's held-out and downstream evaluations on the generators.

Owns one evaluation round from start to end: the learner's weights to the generators, their
in-flight training sequences drained ON the training clock (they are training work), the
clock paused, the held-out prompts split across the generators (`messages.Evaluate`, an
`evaluation.EvalOrder` each, answered by `EvalDone`) or the downstream benchmarks run on
generator-0 (`RunDownstream`, answered by `DownstreamDone`), the clock resumed and the
evaluation's own time, compute and FLOPs logged to eval.jsonl. When a round is due is the
loop's decision (`Trainer._after_step`); what a generator does with an order is generator.py's.

It sees learner-0 through `EvalHub`, the few things a round needs from the hub side (send,
the inbox to pump, the clock, the logbook, where the run is); the Trainer is one.
"""

from __future__ import annotations

import time
from typing import Protocol, Sequence

from components.offpolicy import derive_seed
from components.trainer import messages as M
from components.trainer.accounting import TrainingClock
from components.trainer.evaluation import EvalOrder, eval_seed, merge_eval_records
from components.trainer.inbox import GeneratorError, Inbox

__all__ = ["EvalHub", "EvalLog", "EvaluationRounds"]


class EvalLog(Protocol):
    """Where a round's records go (`logbook.Logbook`)."""

    def log_eval(self, line: dict, note: str) -> None:
        """One eval.jsonl line, to the trackers too; `note` shown under the progress bar."""


class EvalHub(Protocol):
    """What an evaluation round needs from learner-0 (`loop.Trainer` is one)."""

    generators: Sequence[str]  # generator names, index order
    inbox: Inbox  # pumped until every answer is in (`drained`, `eval_done`, `downstream_done`)
    clock: TrainingClock  # paused for the round; `eval_base_s` accumulates the rounds' time
    logs: EvalLog
    step: int  # learner steps taken
    flops: float  # the run's FLOPs so far

    @property
    def version(self) -> int:
        """The learner's weight version (the one evaluated)."""

    def send(self, peer: str, msg: M.Message) -> None:
        """One message to one process of the run (in order per peer)."""

    def push_weights(self) -> None:
        """The learner's weights to the generators (nothing when they already hold them)."""

    def clock_fields(self) -> dict:
        """{"compute_hours", "wall_s"} from one clock reading."""

    def cpu_hours(self) -> float:
        """CPU hours of the run's processes since training started."""


class EvaluationRounds:
    """Held-out evaluation (`evaluate`) and downstream benchmarks (`downstream`) at the learner's version.

    `cfg`: the run's TrainConfig (seed, eval_k, eval_temperature, temperature, top_p, max_tokens,
    task, queue_timeout_s); `problems`: the held-out problems evaluated each round; `n_params`:
    the policy's parameters for the evaluation's FLOPs (2N per token)."""

    def __init__(self, cfg, problems: Sequence, n_params: int, hub: EvalHub):
        self.cfg = cfg
        self.problems = list(problems)
        self.n_params = n_params
        self.hub = hub

    @property
    def task_name(self) -> str:
        return self.cfg.task if isinstance(self.cfg.task, str) else "mixture"

    def pause_for_evaluation(self) -> tuple[float, int]:
        """Before an evaluation: the learner's version to the generators, their in-flight training
        work drained (on the training clock), then the clock paused. Returns `drain`'s (seconds, groups)."""
        self.hub.push_weights()
        drained = self.drain()
        self.hub.clock.pause()
        return drained

    def drain(self) -> tuple[float, int]:
        """Every generator decodes its in-flight training sequences to their end and sends them scored,
        ON the training clock (they are training work): an evaluation after it holds no training
        work on its own time. Returns the seconds it took and the groups the generators finished."""
        hub, inbox, timeout_s = self.hub, self.hub.inbox, self.cfg.queue_timeout_s
        t0 = time.time()
        inbox.drained = set()
        inbox.drain_groups = 0
        for name in hub.generators:
            hub.send(name, M.Drain())
        progress = (len(inbox.rollouts), len(inbox.drained))
        deadline = time.monotonic() + timeout_s  # since the last group or answer arrived
        while len(inbox.drained) < len(hub.generators):
            if time.monotonic() > deadline:
                late = sorted(set(hub.generators) - inbox.drained)
                raise GeneratorError(f"{', '.join(late)}: no in-flight sequence finished within train.queue_timeout_s="
                                     f"{timeout_s}s while draining before an evaluation")
            inbox.pump(1.0)
            if (len(inbox.rollouts), len(inbox.drained)) != progress:
                progress = (len(inbox.rollouts), len(inbox.drained))
                deadline = time.monotonic() + timeout_s
        return time.time() - t0, inbox.drain_groups

    def evaluate(self) -> dict:
        """Held-out mean@k on the generators at the learner's current version (pinned), off the
        training clock. Returns the eval.jsonl line written."""
        cfg, hub = self.cfg, self.hub
        drain_s, drain_groups = self.pause_for_evaluation()
        t0 = time.time()
        asked = self._order_held_out()
        deadline = time.monotonic() + cfg.queue_timeout_s
        while len(hub.inbox.eval_done) < len(asked):
            if time.monotonic() > deadline:
                raise GeneratorError(f"the evaluation did not finish within train.queue_timeout_s={cfg.queue_timeout_s}s "
                                     f"(answered: {sorted(hub.inbox.eval_done)} of {asked})")
            hub.inbox.pump(1.0)
        record = merge_eval_records([hub.inbox.eval_done[g] for g in asked], self.problems, self.task_name)
        eval_wall = self._resume_clock(t0)
        clock = hub.clock_fields()
        line = {
            "step": hub.step, "version": hub.version, "compute_hours": clock["compute_hours"], "flops": hub.flops,
            "wall_s": clock["wall_s"], "eval_wall_s": eval_wall, "eval_compute_hours": eval_wall * hub.clock.devices / 3600.0,
            "drain_s": drain_s, "drain_groups": drain_groups,
            "eval_flops": 2.0 * self.n_params * record.get("eval_tokens", 0),
            "cpu_hours": hub.cpu_hours(), **record,
        }
        hub.logs.log_eval(line, f"eval @ step {hub.step}: held-out pass rate {record['pass_rate']:.3f} "
                                f"(mean@{cfg.eval_k}, compute {clock['compute_hours']:.4f} h)")
        return line

    def _order_held_out(self) -> list[int]:
        """Each generator its share of the held-out prompts (an EvalOrder); returns the generators asked."""
        cfg, hub = self.cfg, self.hub
        seed = eval_seed(cfg.seed, hub.step)
        G = len(hub.generators)
        shares = [[(i, p) for i, p in enumerate(self.problems) if i % G == g] for g in range(G)]
        hub.inbox.eval_done = {}
        asked = []
        temperature = cfg.eval_temperature if cfg.eval_temperature is not None else cfg.temperature
        for g, (name, share) in enumerate(zip(hub.generators, shares)):
            if share:
                order = EvalOrder(problems=share, version=hub.version, seed=seed if G == 1 else derive_seed(seed, g),
                                  k=cfg.eval_k, temperature=temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens,
                                  task_name=self.task_name)
                hub.send(name, M.Evaluate(order))
                asked.append(g)
        return asked

    def downstream(self) -> list[dict]:
        """Downstream benchmarks (mean@k, pass@k) on generator-0 at the current version, off the
        training clock. Returns the eval.jsonl lines written (one per benchmark)."""
        cfg, hub = self.cfg, self.hub
        self.pause_for_evaluation()
        t0 = time.time()
        hub.inbox.downstream_done = None
        hub.send(hub.generators[0], M.RunDownstream(hub.step))
        deadline = time.monotonic() + cfg.queue_timeout_s
        while hub.inbox.downstream_done is None:
            if time.monotonic() > deadline:
                raise GeneratorError(f"the downstream benchmarks did not finish within train.queue_timeout_s={cfg.queue_timeout_s}s")
            hub.inbox.pump(1.0)
        self._resume_clock(t0)
        clock = hub.clock_fields()
        lines = []
        for record in hub.inbox.downstream_done:
            line = {"step": hub.step, "version": hub.version, "compute_hours": clock["compute_hours"],
                    "flops": hub.flops, "wall_s": clock["wall_s"], **record}
            hub.logs.log_eval(line, f"benchmark {record.get('benchmark')} @ step {hub.step}: mean@{record.get('k')} "
                                    f"{record.get('mean@k', float('nan')):.3f}")
            lines.append(line)
        return lines

    def _resume_clock(self, t0: float) -> float:
        """The round is over: the training clock runs again; its time (since `t0`) is evaluation time."""
        wall = time.time() - t0
        self.hub.clock.resume()
        self.hub.clock.eval_base_s += wall
        return wall
