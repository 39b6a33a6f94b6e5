"""Evaluation: held-out mean@k (per task) and downstream benchmarks (mean@k and unbiased pass@k).

- `evaluate(...)`: the held-out evaluation of a run (k samples per held-out prompt); the
  fields of one eval.jsonl line: pass_rate (mean@k), per_task pass rates, entropy, ...
- `evaluate_benchmark(engine, benchmark, tokenizer, *, k, seed, ...)`: one downstream
  benchmark (`components.benchmarks.Benchmark`): mean@k and pass@k for k in 1, 2, 4, ... K.
- `evaluate_downstream(engine, benchmarks, tokenizer, cfg, *, step)`: every benchmark of
  ``train.downstream_benchmarks`` at a training step, one record per benchmark (what the
  trainer appends to eval.jsonl, after adding step / version / compute_hours / flops / wall_s).
- `EvalOrder`: what the hub sends a generator to evaluate (`messages.Evaluate`): its share of the
  held-out prompts, the pinned version, the seed and the sampling settings.
- `pass_at_k(n, c, k)`: the unbiased pass@k estimator of Chen et al. (2021), in float64.

A downstream line of eval.jsonl carries ``"benchmark"``; a held-out line never does
(`is_downstream_record`). Downstream lines have no ``pass_rate`` field, so readers of the
held-out curve that look for ``pass_rate`` skip them.
"""

from __future__ import annotations

import math
import random
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

import numpy as np

from components.environments import generated_token_count
from components.engines.base import GenerationRequest, SamplingParams, sampling_knobs
from components.tasks import render_prompt
from components.trainer.rollout import safe_verify

__all__ = [
    "EvalOrder",
    "evaluate",
    "merge_eval_records",
    "eval_seed",
    "evaluate_benchmark",
    "evaluate_downstream",
    "downstream_due",
    "downstream_seed",
    "is_downstream_record",
    "pass_at_k",
    "pass_ks",
    "benchmark_scores",
]


@dataclass
class EvalOrder:
    """Held-out (or benchmark) prompts to evaluate at the weights the generator holds (`version`)."""

    problems: list  # [(index, Problem)]
    version: int
    seed: int
    k: int
    temperature: float
    top_p: float
    max_tokens: int
    task_name: str


def eval_seed(seed: int, step: int) -> int:
    """Sampling seed of the evaluation at `step`: a function of (seed, step) only."""
    return int(np.random.default_rng([seed, step, 4242]).integers(0, 2**31 - 1))


def downstream_seed(seed: int, step: int, index: int) -> int:
    """Sampling seed of downstream benchmark number `index` at `step` (independent of the held-out seed)."""
    return int(np.random.default_rng([seed, step, 4243, index]).integers(0, 2**31 - 1))


# =========================================================================================
# the unbiased pass@k estimator (pure functions, float64)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021, "Codex"):

        pass@k = 1 - C(n - c, k) / C(n, k),

    the probability that a uniformly random k-subset of the n samples holds a correct one.
    Computed as 1 - prod_{i = n-c+1}^{n} (1 - k / i), which never forms the (huge) binomial
    coefficients; exact 1.0 when n - c < k.
    """
    n, c, k = int(n), int(c), int(k)
    if n < 1 or not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs n >= 1, 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    i = np.arange(n - c + 1, n + 1, dtype=np.float64)  # [c]
    return float(1.0 - np.prod(1.0 - k / i))


def pass_ks(k_max: int) -> list[int]:
    """The k of the pass@k curve: powers of two up to `k_max`, and `k_max` itself."""
    k_max = int(k_max)
    if k_max < 1:
        raise ValueError(f"k must be >= 1, got {k_max}")
    ks = [1 << j for j in range(k_max.bit_length()) if (1 << j) <= k_max]
    return ks if ks[-1] == k_max else ks + [k_max]


def benchmark_scores(correct: Sequence[int], n: int, ks: Optional[Iterable[int]] = None) -> dict:
    """mean@n and pass@k (averaged over problems) from per-problem correct counts, n samples each.

    Returns {"mean@k": float, "pass@k": {str(k): float}} with k over `ks` (default `pass_ks(n)`).
    """
    c = [int(x) for x in correct]
    if not c:
        raise ValueError("benchmark_scores: no problems")
    if any(not 0 <= x <= n for x in c):
        raise ValueError(f"benchmark_scores: correct counts must be in [0, {n}], got {c}")
    ks = pass_ks(n) if ks is None else [int(k) for k in ks]
    return {
        "mean@k": float(np.mean(np.asarray(c, dtype=np.float64) / n)),
        "pass@k": {str(k): float(np.mean([pass_at_k(n, x, k) for x in c])) for k in ks},
    }


# =========================================================================================
# sampling + grading (shared by the held-out and the downstream evaluations)


@dataclass
class Graded:
    """Per-problem verdicts of k samples each, and token statistics."""

    passed: list = field(default_factory=list)  # [problems][k] bool, in problem order
    tokens: int = 0  # completion tokens (forced included)
    sampled_tokens: int = 0  # completion tokens that were sampled (not forced)
    neg_logp_sum: float = 0.0  # sum of -gen_logp over the sampled tokens
    truncated: int = 0
    completions: int = 0
    verifier_errors: int = 0

    @property
    def entropy(self) -> float:
        return self.neg_logp_sum / self.sampled_tokens if self.sampled_tokens else float("nan")


def sample_and_grade(engine, verifier, problems: Sequence, tokenizer, *, k: int, seed: int, temperature: float,
                     top_p: float, max_tokens: int, length_control=None, verifier_timeout_s: float = 10.0,
                     on_sample: Optional[Callable] = None, conversations: Optional[Callable] = None, **knobs) -> Graded:
    """k samples per problem with the engine's current weights, each graded by `verifier.verify`.

    Prompts go through `render_prompt` (the chat template, with the problem's system prompt).
    `knobs`: SamplingParams' other sampling knobs (top_k, min_p, repetition_penalty,
    max_prompt_length; `engines.base.sampling_knobs(cfg)` gives the run's), off when not given.
    `on_sample(problem_index, sample_index, problem, prompt_ids, completion, text, verdict)` is
    called for every graded completion (`scalerl eval --dump`).
    `conversations(problem, k)`: multi-turn episodes, one per sample (`generator.episode_factory`); a sample's
    verdict is then its episode's (`Completion.episode`), not the verifier's on the whole text.
    """
    requests = []
    for i, problem in enumerate(problems):
        interruptions = None
        if length_control is not None and hasattr(length_control, "interruptions"):
            interruptions = length_control.interruptions(k, random.Random(f"{seed}-{i}-eval-interruption"), tokenizer)
        requests.append(GenerationRequest(group_id=i, prompt_ids=list(render_prompt(problem, tokenizer)), n=k,
                                          interruptions=interruptions,
                                          conversations=conversations(problem, k) if conversations is not None else None))
    if length_control is not None and hasattr(length_control, "max_tokens"):
        max_tokens = int(length_control.max_tokens(max_tokens))
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed, **knobs)
    out = Graded(passed=[None] * len(problems))
    for group in engine.generate(requests, params):
        i = int(group.request.group_id)
        verdicts = []
        for j, c in enumerate(group.completions):
            text = tokenizer.decode(c.token_ids, skip_special_tokens=False)
            if c.episode is not None:  # multi-turn: the episode's verdict
                from components.environments import episode_verdict

                verdict, err = episode_verdict(c.episode)
            else:
                verdict, err = safe_verify(verifier, problems[i], text, verifier_timeout_s)
            verdicts.append(bool(verdict.passed))
            if on_sample is not None:
                on_sample(i, j, problems[i], group.request.prompt_ids, c, text, verdict)
            out.verifier_errors += err is not None
            out.tokens += generated_token_count(c)  # multi-turn: observations are prompt tokens
            out.truncated += c.finish_reason == "length"
            out.completions += 1
            sampled = [-float(lp) for lp, forced in zip(c.gen_logp, c.forced) if not forced]
            out.sampled_tokens += len(sampled)
            out.neg_logp_sum += math.fsum(sampled)
        out.passed[i] = verdicts
    missing = [i for i, v in enumerate(out.passed) if v is None]
    if missing:
        raise RuntimeError(f"engine returned no completions for {len(missing)} of {len(problems)} prompts (first: {missing[0]})")
    return out


def evaluate(engine, task, problems: Sequence, tokenizer, *, k: int, seed: int, temperature: float, top_p: float,
             max_tokens: int, task_name: str, length_control=None, verifier_timeout_s: float = 10.0,
             conversations: Optional[Callable] = None, **knobs) -> dict:
    """mean@k over `problems` with the engine's current weights. Returns the eval.jsonl fields.

    ``per_task``: mean@k per task, keyed by ``problem.meta["task"]`` (a task mixture sets it
    on every problem) or `task_name`. ``entropy``: the mean of -gen_logp over the sampled (not
    forced) completion tokens. gen_logp is log softmax(logits / T) of the sampled token, so at
    top_p = 1 this is an unbiased estimate of the per-token entropy (nats) of the sampling
    distribution at temperature T, averaged over the positions the samples visit (token-weighted).
    With top_p < 1 (or top_k, min_p, a repetition penalty) it estimates E[-log p_T(token)] under
    the filtered sampler instead, which is not that distribution's entropy.
    """
    t0 = time.perf_counter()
    graded = sample_and_grade(engine, task, problems, tokenizer, k=k, seed=seed, temperature=temperature, top_p=top_p,
                              max_tokens=max_tokens, length_control=length_control, verifier_timeout_s=verifier_timeout_s,
                              conversations=conversations, **knobs)
    per_task: dict[str, list[float]] = defaultdict(list)
    for problem, verdicts in zip(problems, graded.passed):
        name = (getattr(problem, "meta", None) or {}).get("task", task_name)
        per_task[str(name)].extend(1.0 if v else 0.0 for v in verdicts)
    all_scores = [s for v in per_task.values() for s in v]
    return {
        "pass_rate": float(np.mean(all_scores)) if all_scores else float("nan"),
        "k": int(k),
        "prompts": len(problems),
        "per_task": {name: float(np.mean(v)) for name, v in sorted(per_task.items())},
        "entropy": graded.entropy,
        "eval_tokens": graded.tokens,
        "eval_sampled_tokens": graded.sampled_tokens,  # the entropy's weight when shares are merged
        "eval_truncation_rate": graded.truncated / max(graded.completions, 1),
        "eval_verifier_errors": graded.verifier_errors,
        "time_eval": time.perf_counter() - t0,
    }


# =========================================================================================
# downstream benchmarks


def is_downstream_record(row: dict) -> bool:
    """True for a downstream-benchmark line of eval.jsonl (it names its benchmark)."""
    return isinstance(row, dict) and "benchmark" in row


def evaluate_benchmark(engine, benchmark, tokenizer, *, k: int, seed: int, temperature: float = 1.0, top_p: float = 1.0,
                       max_tokens: int = 1024, length_control=None, verifier_timeout_s: float = 10.0,
                       ks: Optional[Iterable[int]] = None, on_sample: Optional[Callable] = None, **knobs) -> dict:
    """One downstream benchmark with the engine's current weights: k samples per problem.

    `benchmark`: a `components.benchmarks.Benchmark` (its problems and their verifier). Returns::

        {"benchmark": name, "k": K, "prompts": n, "mean@k": float,
         "pass@k": {"1": float, "2": float, ..., str(K): float},   # unbiased estimator, mean over problems
         "entropy": float, "eval_tokens": int, "eval_sampled_tokens": int, "eval_truncation_rate": float,
         "eval_verifier_errors": int, "time_eval": float, "source": str, "grader": str}

    ``entropy`` as in `evaluate`. pass@k is computed for `ks` (default `pass_ks(k)`). `on_sample`
    sees every graded completion (`sample_and_grade`).
    """
    if int(k) < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    t0 = time.perf_counter()
    graded = sample_and_grade(engine, benchmark.task, benchmark.problems, tokenizer, k=int(k), seed=seed,
                              temperature=temperature, top_p=top_p, max_tokens=max_tokens, length_control=length_control,
                              verifier_timeout_s=verifier_timeout_s, on_sample=on_sample, **knobs)
    scores = benchmark_scores([sum(v) for v in graded.passed], int(k), ks)
    return {
        "benchmark": benchmark.name,
        "k": int(k),
        "prompts": len(benchmark.problems),
        "mean@k": scores["mean@k"],
        "pass@k": scores["pass@k"],
        "entropy": graded.entropy,
        "eval_tokens": graded.tokens,
        "eval_sampled_tokens": graded.sampled_tokens,
        "eval_truncation_rate": graded.truncated / max(graded.completions, 1),
        "eval_verifier_errors": graded.verifier_errors,
        "time_eval": time.perf_counter() - t0,
        "source": getattr(benchmark, "source", None),
        "grader": getattr(benchmark, "grader", None),
    }


def downstream_due(cfg, step: int, last: bool = False) -> bool:
    """Whether the downstream benchmarks run after `step`: every ``train.downstream_every`` steps
    (and at step 0 and at the run's last step, `last`), never when it is 0 or no benchmark is set."""
    every = int(getattr(cfg, "downstream_every", 0) or 0)
    if every <= 0 or not getattr(cfg, "downstream_benchmarks", ()):
        return False
    return step % every == 0 or last


def evaluate_downstream(engine, benchmarks: Sequence, tokenizer, cfg, *, step: int, length_control=None) -> list[dict]:
    """Every benchmark at `step` with the engine's current weights; one `evaluate_benchmark` record each.

    Sampling follows the held-out evaluation's settings (``train.eval_temperature`` or the
    training temperature, ``train.top_p``, ``train.top_k``, ``train.min_p``,
    ``train.repetition_penalty``, ``train.max_prompt_length``, ``train.max_tokens`` under the run's length control)
    with ``train.downstream_k`` samples per problem; the seed is `downstream_seed(train.seed,
    step, index)`. The caller adds step, version, compute_hours, flops and wall_s and appends
    each record to eval.jsonl.
    """
    temperature = cfg.eval_temperature if cfg.eval_temperature is not None else cfg.temperature
    return [
        evaluate_benchmark(engine, b, tokenizer, k=int(cfg.downstream_k), seed=downstream_seed(cfg.seed, step, i),
                           temperature=temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens,
                           length_control=length_control, verifier_timeout_s=cfg.verifier_timeout_s, **sampling_knobs(cfg))
        for i, b in enumerate(benchmarks)
    ]


def merge_eval_records(records: list, problems: list, task_name: str) -> dict:
    """One held-out record from the generators' shares (weights: prompts, samples, tokens)."""
    if len(records) == 1:
        return {k: v for k, v in records[0].items() if k != "indices"}
    prompts = sum(int(r["prompts"]) for r in records)
    k = int(records[0]["k"])
    tokens = sum(int(r.get("eval_tokens", 0)) for r in records)
    out = {
        "pass_rate": sum(float(r["pass_rate"]) * int(r["prompts"]) for r in records) / max(prompts, 1),
        "k": k,
        "prompts": prompts,
        "eval_tokens": tokens,
        "eval_truncation_rate": sum(float(r.get("eval_truncation_rate", 0.0)) * int(r["prompts"]) for r in records) / max(prompts, 1),
        "eval_verifier_errors": sum(int(r.get("eval_verifier_errors", 0)) for r in records),
        "eval_sampled_tokens": sum(int(r.get("eval_sampled_tokens", 0)) for r in records),
        "time_eval": max(float(r.get("time_eval", 0.0)) for r in records),
        "eval_training_groups": sum(int(r.get("eval_training_groups", 0)) for r in records),
    }
    per_task: dict = {}
    for r in records:
        counts: dict = {}
        for i in r["indices"]:
            p = problems[i]
            name = (getattr(p, "meta", None) or {}).get("task", task_name)
            counts[name] = counts.get(name, 0) + 1
        for name, rate in (r.get("per_task") or {}).items():
            n = counts.get(name, 0)
            s, c = per_task.get(name, (0.0, 0))
            per_task[name] = (s + float(rate) * n, c + n)
    out["per_task"] = {name: s / c for name, (s, c) in sorted(per_task.items()) if c}
    if all("entropy" in r and r["entropy"] is not None for r in records):
        w = [max(int(r.get("eval_sampled_tokens", r.get("eval_tokens", 0))), 1) for r in records]
        out["entropy"] = sum(float(r["entropy"]) * x for r, x in zip(records, w)) / sum(w)
    for key in records[0]:
        if key not in out and key != "indices":
            out[key] = records[0][key]
    return out
