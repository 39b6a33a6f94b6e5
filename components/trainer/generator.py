"""Generator process: owns one engine and the task's verifier; talks to learner rank 0 (the hub).

Messages (the dataclasses of messages.py, on components/trainer/transport.py, ZeroMQ; in order
per direction):
- hub -> generator: Work(WorkOrder), PushWeights(WeightUpdate), Drain(), Evaluate(EvalOrder),
  RunDownstream(step), Stop()
- generator -> hub: Ready, GroupDone(Rollout, proc), Drained(groups), EvalDone(record),
  DownstreamDone(records), Failed(traceback)

Weights do not travel on the transport: a PushWeights(update) announcement makes the
generator join the weight group's broadcast from learner rank 0 (weight_sync.py) between two
decode steps. The run's off-policy scheme decides what happens to the sequences in flight
(`takes_weights_mid_sequence`): they keep their KV cache and continue under the new weights,
so one completion can span versions (PipelineRL), or they are decoded to their end under the
weights they started with before the new ones load. Work and weights share one ordered
channel, so weights pushed before an order always arrive before the work to do with them.

Finished groups are scored on a scorer thread (`safe_verify`: a verifier that raises or hangs
marks that sample failed and is counted), so a slow verifier never delays a weight update.
An evaluation (EvalOrder) runs on this generator's engine at the weights it holds (the hub
pushes the version to evaluate first and sends no new weights until every generator answered):
its requests join the engine's batch under their own group ids. Before it, the hub has every
generator drain its in-flight training sequences on the training clock (`Drain`), so the
evaluation's time, which is not billed as training, holds no training decoding.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Optional

from components.offpolicy import make_scheme
from components.registry import OFF_POLICY, REWARDS, TASKS
from components.trainer import messages as M
from components.trainer.config import build_component, component_params, family_params
from components.trainer.evaluation import EvalOrder  # the payload of messages.Evaluate
from components.trainer.resolve import ResolvedRun, enter_run
from components.trainer.roles import pin_cpu, settle_heap

__all__ = [
    "WorkerSetup",
    "generator_main",
    "resolve_device",
    "make_run_engine",
    "make_length_control",
    "build_requests",
    "score_group",
]


@dataclass
class WorkerSetup:
    """Everything a process of the run needs: the resolved run (its components are built from it; no
    process of the run reads gin), and where and how this process runs it."""

    run: ResolvedRun
    device: str = "cpu"
    run_dir: Optional[str] = None
    run_info: Optional[dict] = None
    progress: bool = True
    devices: Optional[int] = None  # devices the run reserved (compute accounting); None: from the layout

    @property
    def cfg(self):
        """The run's TrainConfig."""
        return self.run.cfg


def resolve_device(device: str, role: str = "learner", index: int = 0) -> str:
    """cpu, or the GPU this process owns (its CUDA_VISIBLE_DEVICES was set by its launcher)."""
    import torch

    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return "cpu"
    if str(device).startswith("cuda:"):
        return device
    if torch.cuda.device_count() == 0:
        raise RuntimeError(f"train.device={device!r} but no CUDA device is visible to {role}-{index}")
    return "cuda:0"


def make_run_engine(cfg, device: str, seed: int, name: Optional[str] = None):
    from components.engines import make_engine

    name = name or cfg.engine
    return make_engine(name, cfg.model_path, cfg.params_of("engines", name), precision=cfg.precision, device=device,
                       seed=seed)


def make_length_control(cfg):
    if not cfg.length_control:
        return None
    from components.registry import LENGTH_CONTROLS

    return build_component(cfg, LENGTH_CONTROLS, cfg.length_control)()


def generation_cap(cfg, length_control) -> int:
    """SamplingParams.max_tokens: the length control's cap for the run's train.max_tokens."""
    if length_control is not None and hasattr(length_control, "max_tokens"):
        return int(length_control.max_tokens(cfg.max_tokens))
    return int(cfg.max_tokens)


def build_requests(work, tokenizer, length_control, cfg, task=None) -> list:
    """GenerationRequests of a work order (interruptions drawn from (seed, order id)); with
    train.environment, one episode per sample (`components.environments.make_episode_runners`)."""
    import random

    from components.engines.base import GenerationRequest
    from components.environments import make_episode_runners
    from components.tasks import render_prompt

    requests = []
    for order_id, problem in work.orders:
        interruptions = None
        if length_control is not None and hasattr(length_control, "interruptions"):
            rng = random.Random(f"{cfg.seed}-{int(order_id)}-interruption")
            interruptions = length_control.interruptions(cfg.generations_per_prompt, rng, tokenizer)
        requests.append(
            GenerationRequest(
                group_id=int(order_id),
                prompt_ids=list(render_prompt(problem, tokenizer)),
                n=cfg.generations_per_prompt,
                interruptions=interruptions,
                meta={"problem_id": problem.id},
                conversations=make_episode_runners(cfg, task, problem, tokenizer, cfg.generations_per_prompt),
            )
        )
    return requests


def score_group(group, problem, task, tokenizer, length_control, cfg, reward_funcs=None):
    """Rewards of one finished group: verify each completion (the verdict: passed, and the task's
    reward), then, with train.reward_funcs (`reward_funcs`, `components.rewards.build_reward_funcs`),
    the weighted sum of those functions as the reward, then any reward-side length control."""
    from components.trainer.rollout import Rollout, safe_verify

    completions = sorted(group.completions, key=lambda c: c.sample_index)
    texts, verdict_rewards, passed, errors = [], [], [], 0
    for c in completions:
        text = tokenizer.decode(c.token_ids, skip_special_tokens=False)
        if c.episode is not None:  # multi-turn: the environment ended the episode with its reward
            from components.environments import episode_verdict

            verdict, err = episode_verdict(c.episode)
        else:
            verdict, err = safe_verify(task, problem, text, cfg.verifier_timeout_s)
        texts.append(text)
        verdict_rewards.append(float(verdict.reward))
        passed.append(bool(verdict.passed))
        errors += err is not None
    parts = None
    rewards = verdict_rewards
    if reward_funcs:
        from components.rewards import combined_rewards, reward_row
        from components.trainer.rollout import safe_call

        rewards, parts, reward_errors = combined_rewards(
            reward_funcs, problem, reward_row(task, problem), texts, [c.token_ids for c in completions], verdict_rewards,
            reward_correct=float(getattr(task, "reward_correct", 1.0)),
            reward_incorrect=float(getattr(task, "reward_incorrect", -1.0)),
            call=lambda thunk: safe_call(thunk, cfg.verifier_timeout_s))
        errors += reward_errors
    parts = _with_episode_parts(parts, completions)
    if length_control is not None and hasattr(length_control, "shape_reward"):
        from components.environments import generated_token_count  # observations are not generated tokens

        rewards = [float(length_control.shape_reward(r, ok, generated_token_count(c)))
                   for r, ok, c in zip(rewards, passed, completions)]
    return Rollout(
        order_id=int(group.request.group_id),
        problem_id=problem.id,
        completions=completions,
        rewards=[float(r) for r in rewards],
        passed=passed,
        verifier_errors=errors,
        reward_parts=parts,
    )


def _with_episode_parts(parts, completions):
    """train.reward_funcs' parts with the environments' reward parts added ({name: [G]}, NaN where a sample has
    none): logged as reward/<name>. Unchanged without episodes."""
    names = list(dict.fromkeys(k for c in completions if c.episode is not None for k in c.episode.parts))
    if not names:
        return parts
    out = dict(parts or {})
    for name in names:
        out.setdefault(name, [float(c.episode.parts.get(name, float("nan"))) if c.episode is not None else float("nan")
                              for c in completions])
    return out


class _Scorer:
    """A thread that verifies finished groups, so the engine loop never waits on a verifier."""

    def __init__(self, task, tokenizer, length_control, cfg, index: int, reward_funcs=None):
        self.inbox: "queue.Queue" = queue.Queue()
        self.outbox: "queue.Queue" = queue.Queue()
        self.args = (task, tokenizer, length_control, cfg, reward_funcs)
        self.index = index
        self.error: Optional[str] = None
        self.thread = threading.Thread(target=self._run, daemon=True, name="scorer")
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.inbox.get()
            if item is None:
                return
            group, problem, engine_version, busy = item
            try:
                rollout = score_group(group, problem, *self.args)
            except BaseException:  # noqa: BLE001 - reported to the hub by the main loop
                self.error = traceback.format_exc()
                return
            rollout.engine_version = engine_version
            rollout.generator = self.index
            rollout.time_generate = busy
            self.outbox.put(rollout)


def drain_training(engine, on_training_group, busy: list) -> int:
    """Decode the training sequences in flight to their end (the hub's "drain", before an evaluation).

    Their decoding is training work: the hub's training clock runs until every generator has
    drained, and only then pauses for the evaluation, so no training token is decoded on the
    evaluation's time. Finished groups go to `on_training_group` as in the main loop; `busy[0]`
    accumulates the engine time. Returns the number of training groups finished.
    """
    finished_groups = 0
    while engine.has_unfinished():
        finished_groups += step_engine(engine, on_training_group, busy)
    return finished_groups


def step_engine(engine, on_training_group, busy: list) -> int:
    """One decode step of the engine: its engine time into `busy[0]`, every group it finished to
    `on_training_group`. Returns how many groups finished."""
    t0 = time.perf_counter()
    finished = engine.step()
    busy[0] += time.perf_counter() - t0
    for group in finished:
        on_training_group(group)
    return len(finished)


class _EvalView:
    """The generator's engine seen by `evaluate`: only the evaluation's groups come out of it.

    Evaluation requests join the engine's batch under group ids ("eval", i). The hub drains the
    training sequences first (`drain_training`), so none should be in flight; a training group
    that finishes meanwhile all the same goes to `on_training_group` and is counted
    (`training_groups`, logged as the evaluation's `eval_training_groups`).
    """

    def __init__(self, engine, on_training_group):
        self.engine = engine
        self.on_training_group = on_training_group
        self.training_groups = 0

    def generate(self, requests, params):
        from components.engines.base import CompletedGroup

        originals = {}
        tagged = []
        for req in requests:
            tag = ("eval", req.group_id)
            originals[tag] = req
            tagged.append(dataclasses.replace(req, group_id=tag))
        self.engine.add_requests(tagged, params)
        while originals:
            for group in self.engine.step():
                req = originals.pop(group.request.group_id, None)
                if req is None:
                    self.on_training_group(group)
                    self.training_groups += 1
                    continue
                for c in group.completions:
                    c.group_id = req.group_id
                yield CompletedGroup(request=req, completions=group.completions)


def episode_factory(cfg, task, tokenizer):
    """fn(problem, n) -> one episode per sample (train.environment), or None for a single-turn run."""
    if not getattr(cfg, "environment", None):
        return None
    from components.environments import make_episode_runners

    return lambda problem, n: make_episode_runners(cfg, task, problem, tokenizer, n)


def _run_eval(order: EvalOrder, engine, task, tokenizer, length_control, cfg, on_training_group) -> dict:
    from components.engines.base import sampling_knobs
    from components.trainer.evaluation import evaluate

    problems = [p for _, p in order.problems]
    view = _EvalView(engine, on_training_group)
    record = evaluate(
        view,
        task,
        problems,
        tokenizer,
        k=order.k,
        seed=order.seed,
        temperature=order.temperature,
        top_p=order.top_p,
        max_tokens=order.max_tokens,
        task_name=order.task_name,
        length_control=length_control,
        verifier_timeout_s=cfg.verifier_timeout_s,
        conversations=episode_factory(cfg, task, tokenizer),  # train.environment: the held-out prompts are episodes too
        **sampling_knobs(cfg),  # the run's train.top_k, min_p, repetition_penalty, max_prompt_length
    )
    record["version"] = order.version
    record["indices"] = [i for i, _ in order.problems]
    record["eval_training_groups"] = view.training_groups
    return record


def generator_main(index: int, setup: WorkerSetup, endpoints, layout) -> None:
    """Entry point of generator `index` (a process spawned by `scalerl train`, or a Slurm task)."""
    # Shutdown belongs to learner rank 0: Slurm signals every process of a job (SIGTERM on
    # scancel, SIGUSR2 before a time limit or preemption) and a terminal sends SIGINT to the
    # whole process group; the hub checkpoints and stops its generators. A generator whose hub
    # died sees HubLost on the transport and exits.
    for sig in (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    from components.trainer.accounting import proc_stats
    from components.trainer.transport import Aborted, HubLost, Peer, TransportError
    from components.trainer.exits import exit_code_of

    cfg = setup.cfg
    name = f"generator-{index}"

    def lost(error) -> None:  # the heartbeat thread: the hub is gone while we may be stuck in a collective
        from components.trainer.exits import exit_process, record_hub_lost

        print(f"[{name}] {error}; exiting", file=sys.stderr, flush=True)
        first = index == 0 and layout.learner_ranks == 1
        exit_process(exit_code_of(error), lambda: record_hub_lost(setup, error, first_peer=first))

    peer = Peer(name, endpoints.host, endpoints.hub_port, heartbeat_s=cfg.heartbeat_s, timeout_s=cfg.heartbeat_timeout_s,
                on_lost=lost, connect_timeout_s=max(cfg.heartbeat_timeout_s, cfg.queue_timeout_s, 300.0),
                run_token=endpoints.token)
    try:
        _generator_loop(index, setup, endpoints, layout, peer, proc_stats)
    except (HubLost, Aborted) as err:
        print(f"[{name}] {err}; exiting", file=sys.stderr, flush=True)
        peer.close()
        os._exit(exit_code_of(err))
    except TransportError as err:
        print(f"[{name}] transport failed: {err}", file=sys.stderr, flush=True)
        peer.close()
        os._exit(exit_code_of(err))
    except BaseException:  # noqa: BLE001 - report everything to the hub, then die
        try:
            tb = traceback.format_exc()
            print(f"[{name}] failed:\n{tb}", file=sys.stderr, flush=True)
            peer.send(M.Failed(index, tb), timeout_s=10.0)
            time.sleep(1.0)  # let the message leave; no goodbye: the hub must see a failure, not a clean leave
        finally:
            os._exit(1)
    peer.close()


def _generator_loop(index: int, setup: WorkerSetup, endpoints, layout, peer, proc_stats) -> None:
    _Generator(index, setup, endpoints, layout, peer, proc_stats).serve()


class _Generator:
    """One generator process: its engine, task, scorer thread and weight receiver, and the loop that
    answers the hub's messages while it decodes."""

    def __init__(self, index: int, setup: WorkerSetup, endpoints, layout, peer, proc_stats) -> None:
        import torch

        from components.engines.base import SamplingParams, sampling_knobs
        from components.models import load_tokenizer
        from components.rewards import build_reward_funcs
        from components.tasks import make_task
        from components.trainer.weight_group import weight_group_of
        from components.trainer.weight_sync import WeightReceiver

        self.index, self.peer, self.proc_stats = index, peer, proc_stats
        cfg = self.cfg = setup.cfg
        if setup.device == "cpu":
            torch.set_num_threads(1)
            pin_cpu(layout.learner_ranks + index, layout.world_size)
        enter_run(setup.run)
        scheme = make_scheme(cfg.off_policy, component_params(cfg, OFF_POLICY, cfg.off_policy))
        self.weights_mid_sequence = scheme.takes_weights_mid_sequence()
        self.task = make_task(cfg.task, family_params(cfg, TASKS), seed=cfg.seed, **cfg.task_kwargs)
        self.tokenizer = load_tokenizer(cfg.model_path)
        self.engine = make_run_engine(cfg, setup.device, seed=cfg.seed + 1000 * (index + 1))
        self.length_control = make_length_control(cfg)
        # joined at the first update (a vLLM engine joins from inside its worker)
        weight_group = weight_group_of(cfg, endpoints, layout, setup.device)
        self.receiver = WeightReceiver(weight_group, rank=weight_group.generator_rank(index), device=setup.device)
        self.base_params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p,
                                          max_tokens=generation_cap(cfg, self.length_control),
                                          **sampling_knobs(cfg))  # train.top_k, min_p, repetition_penalty, max_prompt_length
        reward_funcs = build_reward_funcs(cfg.reward_funcs, cfg.reward_weights,
                                          family_params(cfg, REWARDS)) or None  # train.reward_funcs, resolved here
        self.scorer = _Scorer(self.task, self.tokenizer, self.length_control, cfg, index, reward_funcs)
        settle_heap()  # start-up's objects out of the collector's full passes
        self.problems: dict[int, Any] = {}
        self.benchmarks = None  # downstream benchmarks, loaded at their first evaluation
        self.busy = [0.0]
        self.outstanding = 0  # groups handed to the scorer and not sent yet
        self.device = setup.device

    def to_scorer(self, group) -> None:
        problem = self.problems.pop(int(group.request.group_id))
        self.scorer.inbox.put((group, problem, int(getattr(self.engine, "version", 0)), self.busy[0]))
        self.outstanding += 1
        self.busy[0] = 0.0

    def send(self, rollout) -> None:
        self.peer.send(M.GroupDone(rollout, self.proc_stats()))
        self.outstanding -= 1

    def _check_scorer(self) -> None:
        if self.scorer.error is not None:
            raise RuntimeError(f"scoring failed:\n{self.scorer.error}")

    def serve(self) -> None:
        self.peer.send(M.Ready(self.index, pid=os.getpid(), proc=self.proc_stats(), device=self.device))
        engine, scorer, peer = self.engine, self.scorer, self.peer
        while True:
            self._check_scorer()
            while True:  # send every scored group
                try:
                    rollout = scorer.outbox.get_nowait()
                except queue.Empty:
                    break
                self.send(rollout)
            idle = not engine.has_unfinished()
            if idle and self.outstanding > 0:
                # nothing to decode: the hub is waiting for these groups, so wake up the moment one is scored
                try:
                    self.send(scorer.outbox.get(timeout=0.05))
                except queue.Empty:
                    pass
                msg = peer.recv(timeout_s=0.0)
            else:
                msg = peer.recv(timeout_s=0.5 if idle else 0.0)
            while msg is not None:
                if not self.handle(msg):
                    return
                msg = peer.recv(timeout_s=0.0)
            if engine.has_unfinished():
                step_engine(engine, self.to_scorer, self.busy)

    def handle(self, msg) -> bool:
        """Answer one message of the hub; False once it says stop."""
        engine = self.engine
        if isinstance(msg, M.Stop):
            self.scorer.inbox.put(None)
            engine.close()
            self.receiver.close()
            return False
        if isinstance(msg, M.PushWeights):
            if not self.weights_mid_sequence:  # the scheme's choice: finish the sequences in flight first
                drain_training(engine, self.to_scorer, self.busy)
            t0 = time.perf_counter()
            engine.receive_weights(self.receiver, msg.update)
            self.busy[0] += time.perf_counter() - t0
        elif isinstance(msg, M.Work):
            work = msg.order
            for order_id, problem in work.orders:
                self.problems[int(order_id)] = problem
            requests = build_requests(work, self.tokenizer, self.length_control, self.cfg, self.task)
            engine.add_requests(requests, dataclasses.replace(self.base_params, seed=int(work.seed)))
        elif isinstance(msg, M.Drain):  # an evaluation comes next: finish the training sequences in flight first
            self.drain()
        elif isinstance(msg, M.Evaluate):
            record = _run_eval(msg.order, engine, self.task, self.tokenizer, self.length_control, self.cfg, self.to_scorer)
            self.peer.send(M.EvalDone(self.index, record, self.proc_stats()))
        elif isinstance(msg, M.RunDownstream):  # every benchmark, at the weights this generator holds
            self.downstream(int(msg.step))
        else:
            raise RuntimeError(f"generator-{self.index}: unknown message {type(msg).__name__}")
        return True

    def drain(self) -> None:
        """Decode the training sequences in flight to their end, score and send them, then say so."""
        groups = drain_training(self.engine, self.to_scorer, self.busy)
        while self.outstanding > 0:  # ... scored and sent too: no verifier runs on the evaluation's time
            self._check_scorer()
            try:
                self.send(self.scorer.outbox.get(timeout=0.05))
            except queue.Empty:
                pass
        self.peer.send(M.Drained(self.index, self.proc_stats(), groups))

    def downstream(self, step: int) -> None:
        """Every downstream benchmark at the weights this generator holds."""
        from components.trainer.evaluation import evaluate_downstream

        if self.benchmarks is None:
            from components.benchmarks import load_benchmarks

            cfg = self.cfg  # a reward grading a benchmark gets the run's resolved values (gin is not read here)
            self.benchmarks = load_benchmarks(cfg.downstream_benchmarks, lambda name: cfg.params_of("rewards", name))
        records = evaluate_downstream(_EvalView(self.engine, self.to_scorer), self.benchmarks, self.tokenizer, self.cfg,
                                      step=step, length_control=self.length_control)
        self.peer.send(M.DownstreamDone(self.index, records, self.proc_stats()))
