"""Generator worker process: owns an engine and the task's verifier.

It talks to the learner through exactly two channels:
- the CONTROL channel (learner -> generator, unbounded FIFO): ("weights", version, state_dict),
  ("work", WorkOrder), ("stop",). Weights and work share one FIFO so that, under
  ppo_off_policy, the weights of version v always arrive before the work to do with them.
- the ROLLOUT queue (generator -> learner, bounded): ("rollout", Rollout), ("ready", index),
  ("error", index, traceback).

Between engine steps it drains the control channel and loads only the NEWEST weights it
finds (in-flight: sequences continue with their KV cache, so a completion can span
versions). Rewards are computed here (`safe_verify`: a verifier that raises or hangs marks
that sample failed and is counted, never stopping the run).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import queue
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["WorkerSetup", "generator_main", "apply_gin", "resolve_device", "make_run_engine", "make_length_control"]


@dataclass
class WorkerSetup:
    """Everything a freshly spawned process needs to rebuild the run's components."""

    config_files: list
    bindings: list
    sys_path: list  # directories added to sys.path before parsing (user components)
    cfg: Any  # TrainConfig
    device: str = "cpu"


def apply_gin(setup: WorkerSetup) -> None:
    """Re-create the parent's gin state in this process (imports user modules named in the files)."""
    import gin

    from components.registry import load_builtin_components

    for p in reversed(setup.sys_path):
        if p not in sys.path:
            sys.path.insert(0, p)
    load_builtin_components()
    gin.clear_config()
    for p in setup.sys_path:
        gin.add_config_file_search_path(p)
    gin.parse_config_files_and_bindings(list(setup.config_files), list(setup.bindings), finalize_config=False, skip_unknown=False)


def resolve_device(device: str, role: str, index: int = 0) -> str:
    """cpu, or the GPU this process owns: learner cuda:0, generator i cuda:(1+i) (wrapping)."""
    import torch

    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return "cpu"
    if str(device).startswith("cuda:"):
        return device
    n = torch.cuda.device_count()
    if n == 0:
        raise RuntimeError(f"train.device={device!r} but no CUDA device is visible")
    if role == "learner" or n == 1:
        return "cuda:0"
    return f"cuda:{1 + index % (n - 1)}"


def make_run_engine(cfg, device: str, seed: int, name: Optional[str] = None):
    from components.engines import make_engine

    return make_engine(name or cfg.engine, cfg.model_path, precision=cfg.precision, device=device, seed=seed)


def make_length_control(cfg):
    if not cfg.length_control:
        return None
    from components.registry import LENGTH_CONTROLS

    return LENGTH_CONTROLS.get(cfg.length_control)()


def generation_cap(cfg, length_control) -> int:
    """SamplingParams.max_tokens: the length control's cap for the run's train.max_tokens."""
    if length_control is not None and hasattr(length_control, "max_tokens"):
        return int(length_control.max_tokens(cfg.max_tokens))
    return int(cfg.max_tokens)


def _drain(control_q, block: bool, timeout: float = 1.0) -> list:
    msgs = []
    if block:
        try:
            msgs.append(control_q.get(timeout=timeout))
        except queue.Empty:
            return msgs
    while True:
        try:
            msgs.append(control_q.get_nowait())
        except queue.Empty:
            return msgs


def _load_weights(payload):
    """The weight channel carries torch.save bytes (no shared-memory lifetime issues)."""
    import io

    import torch

    if isinstance(payload, (bytes, bytearray)):
        return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    return payload


def build_requests(work, tokenizer, length_control, cfg) -> list:
    """GenerationRequests of a work order (interruptions drawn from (seed, order id))."""
    import random

    from components.engines.base import GenerationRequest
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
            )
        )
    return requests


def score_group(group, problem, task, tokenizer, length_control, cfg):
    """Rewards of one finished group: verify each completion, then any reward-side length control."""
    from components.trainer.rollout import Rollout, safe_verify

    completions = sorted(group.completions, key=lambda c: c.sample_index)
    rewards, passed, errors = [], [], 0
    for c in completions:
        text = tokenizer.decode(c.token_ids, skip_special_tokens=False)
        verdict, err = safe_verify(task, problem, text, cfg.verifier_timeout_s)
        reward = float(verdict.reward)
        if length_control is not None and hasattr(length_control, "shape_reward"):
            reward = float(length_control.shape_reward(reward, bool(verdict.passed), len(c.token_ids)))
        rewards.append(reward)
        passed.append(bool(verdict.passed))
        errors += err is not None
    return Rollout(
        order_id=int(group.request.group_id),
        problem_id=problem.id,
        completions=completions,
        rewards=rewards,
        passed=passed,
        verifier_errors=errors,
    )


def generator_main(index: int, setup: WorkerSetup, control_q, rollout_q) -> None:
    """Entry point of a generator process (torch.multiprocessing, spawn)."""
    # Shutdown belongs to the learner: Slurm signals every process of a job (SIGTERM on
    # scancel, SIGUSR2 before a time limit or preemption) and a terminal sends SIGINT to the
    # whole process group. The learner checkpoints and stops its generators; a generator whose
    # learner died exits by itself (the parent-pid check below).
    for sig in (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    try:
        import torch

        if setup.device == "cpu":
            torch.set_num_threads(1)
        apply_gin(setup)
        cfg = setup.cfg
        from components.engines.base import SamplingParams
        from components.models import load_tokenizer
        from components.tasks import make_task

        task = make_task(cfg.task, seed=cfg.seed, **cfg.task_kwargs)
        tokenizer = load_tokenizer(cfg.model_path)
        engine = make_run_engine(cfg, setup.device, seed=cfg.seed + 1000 * (index + 1))
        length_control = make_length_control(cfg)
        base_params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=generation_cap(cfg, length_control))
        problems: dict[int, Any] = {}
        rollout_q.put(("ready", index))
        busy = 0.0
        parent = os.getppid()
        while True:
            if os.getppid() != parent:  # the learner died (kill -9): do not linger as an orphan
                os._exit(0)
            msgs = _drain(control_q, block=not engine.has_unfinished())
            newest = None
            works = []
            for msg in msgs:
                if msg[0] == "stop":
                    engine.close()
                    return
                if msg[0] == "weights":
                    newest = msg
                elif msg[0] == "work":
                    works.append(msg[1])
            t0 = time.perf_counter()
            if newest is not None:
                engine.update_weights(_load_weights(newest[2]), int(newest[1]))
            for work in works:
                for order_id, problem in work.orders:
                    problems[int(order_id)] = problem
                requests = build_requests(work, tokenizer, length_control, cfg)
                engine.add_requests(requests, dataclasses.replace(base_params, seed=int(work.seed)))
            finished = engine.step() if engine.has_unfinished() else []
            busy += time.perf_counter() - t0
            for group in finished:
                problem = problems.pop(int(group.request.group_id))
                rollout = score_group(group, problem, task, tokenizer, length_control, cfg)
                rollout.engine_version = int(getattr(engine, "version", 0))
                rollout.generator = index
                rollout.time_generate, busy = busy, 0.0
                rollout_q.put(("rollout", rollout))
    except BaseException:  # noqa: BLE001 - report everything to the learner, then die
        try:
            rollout_q.put(("error", index, traceback.format_exc()))
            time.sleep(0.5)
        finally:
            os._exit(1)
