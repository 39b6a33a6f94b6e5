"""Rewards as plain functions (registry `REWARDS`).

A reward is a function of the prompt text, the completion text and the dataset row::

    from components.registry import REWARDS

    @REWARDS.register("my_reward")
    def my_reward(prompt: str, completion: str, **row) -> float | bool:
        return 1.0 if row["answer"] in completion else 0.0

- ``prompt`` is the problem's user message (before the chat template), ``completion`` the
  decoded completion (thinking part included: strip it with
  `components.tasks.common.strip_thinking` if the reward should not see it);
- ``row`` holds the dataset row's columns under their own names, plus the mapped ``answer``
  (and ``tests``) of a task with a column mapping (`hf_dataset`);
- a ``bool`` is a verdict: the reward is the task's ``reward_correct`` / ``reward_incorrect``
  (+1 / -1 by default); a number is the reward itself, and the completion passes iff
  ``reward >= pass_threshold``. The trainer logs the mean reward (``reward_mean``) and the pass
  rate (``pass_rate``) separately.

A user's reward lives in their own file, imported by an ``import my_rewards`` line of the gin
file, and is selected by name with a dataset task: ``hf_dataset.reward = "my_reward"`` (also
``math_file.reward`` / ``code_file.reward``). Parameters with defaults bind from gin as
``my_reward.<param>``.

Several weighted rewards per task, of any task: ``train.reward_funcs`` / ``train.reward_weights``
(the second half of this module: `build_reward_funcs`, `combined_rewards`). The generator scores
each group with them (`components.trainer.generator.score_group`) and the learner logs each as
``reward/<name>`` in metrics.jsonl.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import numbers
from typing import Any, Callable, Mapping, Optional, Sequence

from components.registry import REWARDS
from components.tasks.common import strip_special_tokens, strip_thinking
from components.tasks.reward_verdicts import (RESERVED_KEYS, check_reward, math_answer_matches, reward_verdict,
                                              value_to_verdict)

__all__ = ["reward_verdict", "value_to_verdict", "check_reward", "math_answer_matches", "math_verify", "exact_match",
           "VERIFIER", "RewardFunc", "reward_spec_of", "parse_reward_funcs", "build_reward_funcs", "check_reward_funcs",
           "reward_row", "combined_rewards"]

# -- built-in rewards --------------------------------------------------------------------------
@REWARDS.register("math_verify")
def math_verify(prompt: str, completion: str, *, answer: Any = None, max_answer_chars: int = 4000, **row) -> bool:
    """math-verify equivalence of the answer after the last </think> with the row's `answer`."""
    if answer is None or not str(answer).strip():
        raise ValueError(f"math_verify needs the row's 'answer' (map it: columns = {{'answer': ...}}); row keys: {sorted(row)}")
    return math_answer_matches(completion, answer, max_answer_chars)


@REWARDS.register("exact_match")
def exact_match(prompt: str, completion: str, *, answer: Any = None, **row) -> bool:
    """The answer part (after the last </think>, stripped) equals str(answer), stripped."""
    if answer is None:
        raise ValueError(f"exact_match needs the row's 'answer'; row keys: {sorted(row)}")
    final = strip_thinking(completion)
    return final is not None and strip_special_tokens(final).strip() == str(answer).strip()


# -- several weighted rewards per task (`train.reward_funcs`, `train.reward_weights`) ------------
# The run's reward is sum_i weight_i x reward_i over the listed reward functions (each logged on its
# own as ``reward/<name>`` in metrics.jsonl); the pass rate stays the task's verifier's verdict.
#
# A spec is one of
# - ``"verifier"``: the task's own verdict reward (reward_correct / reward_incorrect, +1 / -1);
# - a `REWARDS` name (a built-in, or one registered by a module the gin file imports);
# - an import path ``"package.module:function"`` (or ``"package.module.function"``) of any callable:
#   a function, or an object with ``__call__`` (e.g. a reward model, `docs/examples/reward_model.py`);
# - in Python, the callable itself (`reward_spec_of` turns it into its import path: the generator
#   processes import it by that path, so it must be defined at the top level of a module).
#
# A reward function is called in one of two ways, chosen by its parameter names:
# - per completion (this module's contract): ``fn(prompt, completion, **row)`` -> float | bool | None;
# - per group, as TRL's GRPOTrainer calls one (a parameter named ``completions``):
#   ``fn(prompts=[...], completions=[...], completion_ids=[...], **columns)`` -> a list of
#   float | bool | None, one per completion; each dataset column is a list (one value per
#   completion). For a conversational prompt (`hf_dataset` with a column of messages) ``prompts``
#   holds the messages and each completion is ``[{"role": "assistant", "content": text}]``, as TRL
#   passes them; otherwise both are text.
# A bool is scored as the task's reward_correct / reward_incorrect; None abstains (the sample gets
# no contribution from that function, and its ``reward/<name>`` mean leaves it out); a function
# that raises, hangs past train.verifier_timeout_s or returns anything else gives no contribution
# either and counts as a verifier error.

VERIFIER = "verifier"  # the reward_funcs entry that stands for the task's own verdict reward
REWARD_METRIC_PREFIX = "reward/"


@dataclasses.dataclass(frozen=True)
class RewardFunc:
    """One resolved entry of train.reward_funcs."""

    spec: str  # as configured (a name, "verifier" or an import path)
    name: str  # logged as reward/<name>
    weight: float
    fn: Optional[Callable] = None  # None for the verifier
    batched: bool = False  # called once per group, TRL-style (fn(prompts=..., completions=..., **columns))
    accepts: Optional[frozenset] = None  # the keyword names fn accepts; None: any (**kwargs)


def reward_spec_of(obj: Any) -> str:
    """A reward_funcs entry as stored: a string as it is; a callable as its import path
    ``module:qualname``, which must import back to a callable (so the generator processes can
    reach it); a `REWARDS` entry as its registered name."""
    if isinstance(obj, str):
        spec = obj.strip()
        if not spec:
            raise ValueError("train.reward_funcs: an entry is an empty string")
        return spec
    if not callable(obj):
        raise ValueError(f"train.reward_funcs: {obj!r} is neither a reward spec (a registered name, 'verifier' or "
                         "'module:function') nor a callable")
    for name in REWARDS.names():
        if REWARDS.get(name) is obj or REWARDS.original(name) is obj:
            return name
    module = getattr(obj, "__module__", None) or getattr(type(obj), "__module__", None)
    qualname = getattr(obj, "__qualname__", None)  # a function's; an instance with __call__ has none
    if module and qualname and "<" not in qualname:
        spec = f"{module}:{qualname}"
        try:
            if _import_attr(spec) is obj:
                return spec
        except (ImportError, AttributeError, ValueError):
            pass
    if module:  # an object with __call__ bound to a module-level name
        try:
            mod = importlib.import_module(module)
            for attr, value in vars(mod).items():
                if value is obj and not attr.startswith("_"):
                    return f"{module}:{attr}"
        except ImportError:
            pass
    raise ValueError(f"train.reward_funcs: {obj!r} cannot be imported by name (a lambda, a local function or an "
                     "object not bound to a module-level name): the generator processes import each reward function "
                     "by its path; define it at the top level of a module and give 'module:function'")


def _import_attr(spec: str) -> Any:
    """The object an import path names: "pkg.mod:attr.sub" or "pkg.mod.attr"."""
    if ":" in spec:
        module, _, attr = spec.partition(":")
    else:
        module, _, attr = spec.rpartition(".")
    if not module or not attr:
        raise ValueError(f"{spec!r} is not an import path 'module:function'")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _spec_name(spec: str) -> str:
    """The name a reward is logged under: a registered name or "verifier" as it is, an import path's last part."""
    if ":" in spec:
        return spec.rpartition(":")[2].rpartition(".")[2]
    return spec.rpartition(".")[2] if "." in spec and spec not in REWARDS else spec


def _resolve(spec: str, params: Optional[Mapping[str, Mapping[str, Any]]] = None) -> Callable:
    """The callable of one spec (not the verifier); a registered reward with its hyper-parameters in
    `params` ({name: values} of a resolved run; None: as gin configures it). ValueError naming the
    spec and what it can be."""
    if spec in REWARDS:
        return REWARDS.get(spec) if params is None else REWARDS.build(spec, params.get(spec))
    if ":" not in spec and "." not in spec:
        try:
            REWARDS.get(spec)
        except KeyError as err:
            msg = err.args[0] if err.args else str(err)
            raise ValueError(f"train.reward_funcs: {spec!r} is not {VERIFIER!r}, a registered reward or an import path "
                             f"'module:function'. {msg}") from None
    try:
        obj = _import_attr(spec)
    except ImportError as err:
        raise ValueError(f"train.reward_funcs: {spec!r}: cannot import {err.name or 'its module'!r} ({err}); the module "
                         "must be importable from the directory `scalerl train` runs in, the gin file's directory or "
                         "PYTHONPATH") from None
    except AttributeError as err:
        raise ValueError(f"train.reward_funcs: {spec!r}: {err}") from None
    if inspect.isclass(obj):
        raise ValueError(f"train.reward_funcs: {spec!r} is a class; name an instance of it (a module-level object "
                         "with __call__) or a function")
    if not callable(obj):
        raise ValueError(f"train.reward_funcs: {spec!r} is a {type(obj).__name__}, not callable")
    return obj


def _calling_convention(fn: Callable) -> tuple[bool, Optional[frozenset]]:
    """(batched, keyword names accepted or None for **kwargs) of a reward function."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False, None
    batched = "completions" in params
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return batched, None
    return batched, frozenset(n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def parse_reward_funcs(funcs: Sequence[Any], weights: Optional[Sequence[Any]]) -> list[tuple[str, str, float]]:
    """(spec, name, weight) of train.reward_funcs / reward_weights, their form checked (nothing imported).
    ValueError naming the setting and the valid form."""
    specs = [reward_spec_of(f) for f in funcs]
    if weights is None:
        weights = [1.0] * len(specs)
    weights = list(weights)
    if not specs:
        if weights:
            raise ValueError(f"train.reward_weights = {weights!r} but train.reward_funcs is empty; list the reward "
                             f"functions, e.g. train.reward_funcs = [{VERIFIER!r}, 'my_reward']")
        return []
    if len(weights) != len(specs):
        raise ValueError(f"train.reward_weights has {len(weights)} weight(s) {weights!r} for the {len(specs)} "
                         f"train.reward_funcs {specs!r}: give one number per function (or leave it None: all 1.0)")
    out = []
    for spec, w in zip(specs, weights):
        if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(float(w)):
            raise ValueError(f"train.reward_weights: the weight of {spec!r} must be a finite number, got {w!r}")
        out.append((spec, _spec_name(spec), float(w)))
    names = [n for _, n, _ in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"train.reward_funcs {specs!r} log two rewards under the same name {dup[0]!r} "
                         f"(reward/{dup[0]}); list each function once")
    if all(w == 0.0 for _, _, w in out):
        raise ValueError(f"train.reward_weights are all 0 ({weights!r}): every reward would be 0 and nothing would train")
    return out


def build_reward_funcs(funcs: Sequence[Any], weights: Optional[Sequence[Any]],
                       params: Optional[Mapping[str, Mapping[str, Any]]] = None) -> list[RewardFunc]:
    """The resolved train.reward_funcs (imports their modules); `params`: the registered rewards'
    hyper-parameters in a resolved run ({name: values}). ValueError naming a bad entry."""
    out = []
    for spec, name, weight in parse_reward_funcs(funcs, weights):
        if spec == VERIFIER:
            out.append(RewardFunc(spec, name, weight))
            continue
        fn = _resolve(spec, params)
        batched, accepts = _calling_convention(fn)
        out.append(RewardFunc(spec, name, weight, fn, batched, accepts))
    return out


def check_reward_funcs(funcs: Sequence[Any], weights: Optional[Sequence[Any]]) -> None:
    """Refuse train.reward_funcs / reward_weights that cannot run (ValueError naming the entry)."""
    build_reward_funcs(funcs, weights)


# Problem.meta keys that are the trainer's, not the dataset's: not passed to a reward as columns
_INTERNAL_META = frozenset({"split", "system_prompt", "messages", "chat_template_kwargs", "task", "mixture_weight",
                            "inner_id", "inner_meta", "row", "source"})


def reward_row(task: Any, problem: Any) -> dict:
    """The columns a reward function gets for `problem`: the dataset row (`row_of`: `hf_dataset`, every
    column, plus the mapped answer / tests), else the problem's answer and its meta (e.g. arithmetic's
    operands). A mixture's problem: its member's."""
    if hasattr(task, "member_of"):
        try:
            _, task, problem = task.member_of(problem)
        except ValueError:
            pass
    row_of = getattr(task, "row_of", None)
    if row_of is not None:
        return dict(row_of(problem))
    meta = {k: v for k, v in (problem.meta or {}).items() if k not in _INTERNAL_META}
    return {**meta, "answer": problem.answer}


def _reward_value(value: Any, reward_correct: float, reward_incorrect: float) -> tuple[float, bool]:
    """(reward, is an error) of one returned value: bool -> the verdict's reward, number -> itself,
    None -> NaN (abstains, not an error), anything else or a non-finite number -> NaN and an error."""
    if value is None:
        return math.nan, False
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")):
        return float(reward_correct if value else reward_incorrect), False
    if isinstance(value, numbers.Real):
        x = float(value)
        return (x, False) if math.isfinite(x) else (math.nan, True)
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # a 0-d tensor / array
        return _reward_value(value.item(), reward_correct, reward_incorrect)
    return math.nan, True


def _keywords(func: RewardFunc, kwargs: dict) -> dict:
    return kwargs if func.accepts is None else {k: v for k, v in kwargs.items() if k in func.accepts}


def combined_rewards(funcs: Sequence[RewardFunc], problem: Any, row: Mapping[str, Any], texts: Sequence[str],
                     token_ids: Sequence[Sequence[int]], verdict_rewards: Sequence[float], *, reward_correct: float,
                     reward_incorrect: float, call: Optional[Callable] = None
                     ) -> tuple[list[float], dict[str, list[float]], int]:
    """(total reward per completion, {name: that function's reward per completion (NaN: none)}, errors).

    total = sum over the functions of weight x reward, a NaN reward contributing nothing.
    `verdict_rewards` are the task verifier's rewards (the ``verifier`` entry). `call(thunk)`
    runs one reward call under the trainer's timeout and returns (value, error or None); by
    default the call is made directly.
    """
    call = call or _call_directly
    n = len(texts)
    columns = {k: v for k, v in row.items() if k not in RESERVED_KEYS}
    messages = (problem.meta or {}).get("messages")
    parts: dict[str, list[float]] = {}
    errors = 0
    for func in funcs:
        if func.fn is None:
            parts[func.name] = [float(r) for r in verdict_rewards]
            continue
        values = [math.nan] * n
        if func.batched:
            prompts = [messages if messages is not None else problem.prompt] * n
            completions = ([[{"role": "assistant", "content": t}] for t in texts] if messages is not None
                           else list(texts))
            kwargs = {**{k: [v] * n for k, v in columns.items()}, "prompts": prompts, "completions": completions,
                      "completion_ids": [list(ids) for ids in token_ids]}
            kwargs = _keywords(func, kwargs)  # a function without **kwargs gets the names it has
            got, err = call(lambda f=func, kw=kwargs: f.fn(**kw))
            if err is None and (isinstance(got, (str, bytes)) or not hasattr(got, "__len__") or len(got) != n):
                err = f"returned {type(got).__name__} {got!r:.80}; a list of {n} values (one per completion)"
            if err is not None:
                errors += n
            else:
                for j, value in enumerate(list(got)):
                    values[j], bad = _reward_value(value, reward_correct, reward_incorrect)
                    errors += bad
        else:
            kwargs = _keywords(func, columns)
            for j, text in enumerate(texts):
                got, err = call(lambda f=func, t=text, kw=kwargs: f.fn(problem.prompt, t, **kw))
                if err is not None:
                    errors += 1
                    continue
                values[j], bad = _reward_value(got, reward_correct, reward_incorrect)
                errors += bad
        parts[func.name] = values
    totals = [math.fsum(f.weight * parts[f.name][j] for f in funcs if math.isfinite(parts[f.name][j])) for j in range(n)]
    return totals, parts, errors


def _call_directly(thunk: Callable) -> tuple[Any, Optional[str]]:
    try:
        return thunk(), None
    except Exception as err:  # noqa: BLE001 - a reward crashing on odd text gives no contribution
        return None, f"{type(err).__name__}: {err}"
