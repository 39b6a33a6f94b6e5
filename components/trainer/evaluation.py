"""Held-out evaluation: mean@k pass rate (k samples per held-out prompt), per task."""

from __future__ import annotations

import random
import time
from collections import defaultdict
from typing import Sequence

import numpy as np

from components.engines.base import GenerationRequest, SamplingParams
from components.tasks import render_prompt
from components.trainer.rollout import safe_verify

__all__ = ["evaluate", "eval_seed"]


def eval_seed(seed: int, step: int) -> int:
    """Sampling seed of the evaluation at `step`: a function of (seed, step) only."""
    return int(np.random.default_rng([seed, step, 4242]).integers(0, 2**31 - 1))


def evaluate(engine, task, problems: Sequence, tokenizer, *, k: int, seed: int, temperature: float, top_p: float,
             max_tokens: int, task_name: str, length_control=None, verifier_timeout_s: float = 10.0) -> dict:
    """mean@k over `problems` with the engine's current weights. Returns the eval.jsonl fields."""
    t0 = time.perf_counter()
    requests = []
    for i, problem in enumerate(problems):
        interruptions = None
        if length_control is not None and hasattr(length_control, "interruptions"):
            interruptions = length_control.interruptions(k, random.Random(f"{seed}-{i}-eval-interruption"), tokenizer)
        requests.append(
            GenerationRequest(group_id=i, prompt_ids=list(render_prompt(problem, tokenizer)), n=k, interruptions=interruptions)
        )
    if length_control is not None and hasattr(length_control, "max_tokens"):
        max_tokens = int(length_control.max_tokens(max_tokens))
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed)
    per_task: dict[str, list[float]] = defaultdict(list)
    errors = 0
    tokens = 0
    truncated = 0
    n = 0
    for group in engine.generate(requests, params):
        problem = problems[int(group.request.group_id)]
        name = (problem.meta or {}).get("task", task_name) if hasattr(problem, "meta") else task_name
        for c in group.completions:
            text = tokenizer.decode(c.token_ids, skip_special_tokens=False)
            verdict, err = safe_verify(task, problem, text, verifier_timeout_s)
            per_task[name].append(1.0 if verdict.passed else 0.0)
            errors += err is not None
            tokens += len(c.token_ids)
            truncated += c.finish_reason == "length"
            n += 1
    all_scores = [s for v in per_task.values() for s in v]
    return {
        "pass_rate": float(np.mean(all_scores)) if all_scores else float("nan"),
        "k": int(k),
        "prompts": len(problems),
        "per_task": {name: float(np.mean(v)) for name, v in sorted(per_task.items())},
        "eval_tokens": tokens,
        "eval_truncation_rate": truncated / max(n, 1),
        "eval_verifier_errors": errors,
        "time_eval": time.perf_counter() - t0,
    }
