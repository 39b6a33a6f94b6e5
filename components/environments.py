"""Multi-turn environments (registry ``ENVIRONMENTS``), tools, and the episode runner.

An environment starts from a task's prompt, receives each assistant turn, and answers with an
observation (text, appended to the sequence as prompt tokens: loss mask 0) or ends the episode
with a reward (`Reward`: value, passed, and its parts, logged by name as ``reward/<part>``).
Single-turn tasks are the one-turn case: with ``train.environment = None`` (the default) the
trainer never builds an environment and grades each completion with the task's verifier, as it
always has; ``"single_turn"`` is the same as an environment (one turn, the verifier's reward).

Writing one (see docs/adding_an_environment.md)::

    from components.environments import Environment, Observation, Reward
    from components.registry import ENVIRONMENTS

    @ENVIRONMENTS.register("guess", ranges={"tries": ">= 1"})
    class Guess(Environment):
        def __init__(self, task, problem, *, tries: int = 3):
            super().__init__(task, problem)
            self.tries = tries

        def step(self, turn: str):              # turn: the assistant's text, stop token included
            if self.grade(turn).passed:
                return Reward(1.0, True, {"correct": 1.0})
            return Observation("No, try again.")

A fresh instance serves each sample (one episode): ``make_environment(name, task, problem, params)``, its
keyword hyper-parameters bound in gin (``guess.tries = 5``), resolved once with the run (its component
table, `components.trainer.resolve`) and passed as arguments. The episode ends when `step` returns a
`Reward`, or is cut by the trainer (``train.max_turns`` turns, the token budgets): `stop(reason)`
then gives the reward (default: the task's incorrect reward, not passed).

Tools are an environment helper (`ToolEnvironment`): ONE tag format, a call per assistant turn::

    <tool>NAME: ARGUMENTS</tool>

parsed by `parse_tool_call` (the first ``<tool>`` tag of the turn). A well-formed call to a known
tool runs ``tools[NAME](ARGUMENTS) -> str`` and the observation is ``<result>OUTPUT</result>``; a
malformed call (unclosed tag, no ``NAME:``, an unknown tool) or a tool that raises gets an
``<error>...</error>`` observation naming the problem, never a crash. A turn without a ``<tool>``
tag is the final answer, graded by the task's verifier. ``calculator`` is the shipped one (tool
``calc``: integer / decimal arithmetic, `calculate`).

The engine sees none of this: `EpisodeRunner` (one per sample, built by `make_episode_runners`) is
the engine's `components.engines.base.Conversation`: it decodes each turn, calls the
environment, renders and tokenises the observation (the tokenizer's chat template, role
``Observation.role``, when it has one), and records the outcome (`EpisodeOutcome`) that the
engine attaches to the finished `Completion` (``completion.episode``).
"""

from __future__ import annotations

import ast
import math
import operator
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from components.engines.base import Conversation
from components.registry import ENVIRONMENTS

__all__ = [
    "Environment",
    "Observation",
    "Reward",
    "ToolCall",
    "ToolEnvironment",
    "SingleTurn",
    "Calculator",
    "parse_tool_call",
    "calculate",
    "EpisodeOutcome",
    "EpisodeRunner",
    "make_environment",
    "make_episode_runners",
    "observation_framing",
    "episode_stats",
    "episode_verdict",
    "generated_token_count",
    "observation_token_count",
    "TOOL_OPEN",
    "TOOL_CLOSE",
]


# =========================================================================================
# what an environment answers
@dataclass(frozen=True)
class Observation:
    """The environment's answer to a turn that does not end the episode.

    `text` is appended after the turn (as prompt tokens: no gradient); `role` is the chat role it
    is rendered with when the tokenizer has a chat template. `kind` is counted by the trainer:
    "tool" (a tool ran), "malformed" (a tool call that could not run) or "text" (anything else).
    """

    text: str
    role: str = "tool"
    kind: str = "text"


@dataclass(frozen=True)
class Reward:
    """The end of an episode: its reward, whether it counts as passed (the pass rate), and the
    reward's parts by name (each logged as ``reward/<name>``; they need not sum to `value`)."""

    value: float
    passed: bool
    parts: Mapping[str, float] = field(default_factory=dict)


class Environment:
    """One episode on one problem. Subclasses register with ``@ENVIRONMENTS.register(name)``.

    ``__init__(task, problem, *, hyper-parameters with defaults)``; override `step` (required)
    and `stop` (optional). `grade(text)` grades a text with the task's verifier.
    """

    def __init__(self, task, problem):
        self.task = task
        self.problem = problem

    def step(self, turn: str) -> Union[Observation, Reward]:
        """Answer one assistant turn (its decoded text, the stop token included)."""
        raise NotImplementedError(f"{type(self).__name__}.step(turn) is not written")

    def stop(self, reason: str) -> Reward:
        """The reward of an episode the trainer cut (`reason`: "max_turns" or "length"): by default
        the task's incorrect reward, not passed (no final answer was given)."""
        return Reward(float(getattr(self.task, "reward_incorrect", -1.0)), False)

    def grade(self, text: str) -> Reward:
        """`text` graded by the task's verifier: its reward and verdict, part ``verifier``."""
        verdict = self.task.verify(self.problem, text)
        if verdict.error:
            raise RuntimeError(f"the task's verifier failed: {verdict.error}")
        return Reward(float(verdict.reward), bool(verdict.passed), {"verifier": float(verdict.reward)})


class SingleTurn(Environment):
    """One turn graded by the task's verifier: the single-turn task as an environment."""

    def step(self, turn: str) -> Reward:
        return self.grade(turn)

    def stop(self, reason: str) -> Reward:  # never cut before its one turn is graded; kept for completeness
        return Reward(float(getattr(self.task, "reward_incorrect", -1.0)), False)


# =========================================================================================
# tools
TOOL_OPEN = "<tool>"
TOOL_CLOSE = "</tool>"
_TOOL_NAME = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*:(.*)$", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """A parsed ``<tool>NAME: ARGUMENTS</tool>``: the tool's name and its argument text (stripped);
    `error` names what is malformed (then `name` / `arguments` may be empty)."""

    name: str = ""
    arguments: str = ""
    error: Optional[str] = None


def parse_tool_call(turn: str) -> Optional[ToolCall]:
    """The first tool call of an assistant turn, or None when the turn has no ``<tool>`` tag.

    ``<tool>calc: 37*91</tool>`` -> ToolCall("calc", "37*91"). An opened tag that is never closed,
    or a body without ``NAME:``, is a ToolCall whose `error` says so.
    """
    start = turn.find(TOOL_OPEN)
    if start < 0:
        return None
    body_start = start + len(TOOL_OPEN)
    end = turn.find(TOOL_CLOSE, body_start)
    if end < 0:
        return ToolCall(error=f"the {TOOL_OPEN} tag is not closed by {TOOL_CLOSE}")
    body = turn[body_start:end]
    m = _TOOL_NAME.match(body)
    if m is None:
        return ToolCall(error=f"{TOOL_OPEN}{body}{TOOL_CLOSE} does not read NAME: ARGUMENTS")
    return ToolCall(name=m.group(1), arguments=m.group(2).strip())


class ToolEnvironment(Environment):
    """An environment whose turns may call tools (module docstring: the ``<tool>`` format).

    Subclasses set `tools` ({name: fn(arguments: str) -> str}). A turn with a call gets the
    tool's output (``<result>...</result>``) or an ``<error>...</error>``; a turn without a call is
    the final answer, graded by `grade` (the task's verifier on that turn's text).
    """

    tools: Mapping[str, Callable[[str], str]] = {}
    max_result_chars: int = 200

    def step(self, turn: str) -> Union[Observation, Reward]:
        call = parse_tool_call(turn)
        if call is None:
            return self.grade(turn)
        if call.error is not None:
            return Observation(f"<error>{call.error}</error>", kind="malformed")
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return Observation(f"<error>unknown tool {call.name!r}; tools: {known}</error>", kind="malformed")
        try:
            output = str(tool(call.arguments))
        except Exception as err:  # noqa: BLE001 - a failing tool is the model's error, reported back to it
            return Observation(f"<error>{call.name}: {err}</error>", kind="malformed")
        return Observation(f"<result>{output[: self.max_result_chars]}</result>", kind="tool")


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculate(expression: str, *, max_digits: int = 60, max_exponent: int = 64) -> str:
    """The value of an arithmetic expression: numbers, + - * / // % **, parentheses. Nothing else
    is evaluated (no names, no calls). Integers stay exact; a float result is printed with up to
    10 significant digits ("0.3333333333"); an integral float as an integer ("2" for "4/2").

    Raises ValueError naming what it refuses (a name, an exponent above `max_exponent`, a result
    longer than `max_digits` digits) and ZeroDivisionError for a division by zero.
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot read {expression!r} as arithmetic") from None

    def value(node):
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > max_exponent:
                raise ValueError(f"exponent {right} is above {max_exponent}")
            out = _BINARY[type(node.op)](left, right)
            if isinstance(out, int) and len(str(abs(out))) > max_digits:
                raise ValueError(f"the result has more than {max_digits} digits")
            return out
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        raise ValueError(f"only numbers, + - * / // % ** and parentheses are allowed, not {ast.unparse(node)!r}")

    out = value(tree)
    if isinstance(out, complex):
        raise ValueError(f"{expression!r} has no real value")
    if isinstance(out, float):
        if not math.isfinite(out):
            raise ValueError(f"{expression!r} is not finite")
        return str(int(out)) if out.is_integer() and abs(out) < 1e15 else f"{out:.10g}"
    return str(out)


class Calculator(ToolEnvironment):
    """A calculator tool (``<tool>calc: 37*91</tool>``) for arithmetic tasks; the final answer is graded by the task."""

    tools = {"calc": calculate}


# Registered without rebinding the module names (as the tasks are): SingleTurn and Calculator stay the plain
# classes, to subclass and to check instances against; a run builds them with ENVIRONMENTS.build(name, params).
ENVIRONMENTS.register("single_turn")(SingleTurn)
ENVIRONMENTS.register("calculator")(Calculator)


def make_environment(name: str, task, problem, params: Optional[Mapping[str, Any]] = None) -> Environment:
    """A fresh episode of the environment registered as `name` (an unknown name: the registry's error,
    listing the registered environments), built with a resolved run's hyper-parameters `params` as
    arguments (`Registry.build`); None: as gin configures it (a tool or a test outside a run)."""
    return ENVIRONMENTS.build(name, params)(task, problem)


# =========================================================================================
# the runner: the engine's Conversation for one sample
@dataclass
class EpisodeOutcome:
    """How one sample's episode went (``Completion.episode``; pickled to the learner).

    `end`: "reward" (the environment ended it), "max_turns" / "length" (the trainer cut it: too
    many turns, or a token budget reached), "error" (the environment raised; `error` says what).
    """

    reward: float
    passed: bool
    parts: dict
    turns: int
    tool_calls: int = 0
    malformed_calls: int = 0
    observation_tokens: int = 0
    end: str = "reward"
    error: Optional[str] = None


def observation_framing(tokenizer, role: str) -> tuple[str, str]:
    """(prefix, suffix): the text around an observation of `role` appended after an assistant turn
    that ended with the tokenizer's EOS, so that the next assistant turn starts after it.

    With a chat template it is read off the template: render [user, assistant MARK, role TEXT] with
    the generation prompt and take what lies between ``MARK + eos_token`` and TEXT, and after TEXT.
    Without a chat template: ("", "\\n"). A template that does not close the assistant turn with the
    EOS token is refused (ValueError naming the template's rendering).
    """
    if not getattr(tokenizer, "chat_template", None):
        return "", "\n"
    mark, text = "\u2063ASSISTANT\u2063", "\u2063OBSERVATION\u2063"
    messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": mark}, {"role": role, "content": text}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    eos = str(tokenizer.eos_token or "")
    closed = rendered.find(mark + eos)
    at = rendered.find(text)
    if not eos or closed < 0 or at < closed:
        raise ValueError(
            f"the chat template does not end an assistant turn with the EOS token {eos!r} followed by a {role!r} "
            f"message (rendered: {rendered!r}); multi-turn rollouts append observations after that token")
    return rendered[closed + len(mark) + len(eos) : at], rendered[at + len(text) :]


class EpisodeRunner(Conversation):
    """One sample's episode, as the engine sees it (`components.engines.base.Conversation`).

    Each ended turn (its token ids) is decoded and given to the environment. An observation is
    rendered (`observation_framing`), tokenised, cut to `max_observation_tokens` (the framing kept
    whole, the text's head kept) and returned for the engine to append. The episode ends when the
    environment returns a `Reward`, or when it cannot go on: the turn was cut by a token budget
    ("length"), it was the `max_turns`-th turn ("max_turns"), or no sampled-token budget is left
    ("length"); the environment's `stop(reason)` gives the reward then. `outcome` holds the result.
    """

    def __init__(self, environment: Environment, tokenizer, *, max_turns: int, max_tokens_per_turn: Optional[int] = None,
                 max_observation_tokens: int = 64, framing: Optional[Mapping[str, tuple[str, str]]] = None):
        if int(max_turns) < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns!r}")
        self.environment = environment
        self.tokenizer = tokenizer
        self.max_turns = int(max_turns)
        self.max_tokens_per_turn = None if max_tokens_per_turn is None else int(max_tokens_per_turn)
        self.per_observation = int(max_observation_tokens)
        self.max_observation_tokens = self.per_observation * (self.max_turns - 1)
        self._framing = dict(framing or {})
        self.turns = 0
        self.tool_calls = 0
        self.malformed_calls = 0
        self.observation_tokens = 0
        self.outcome: Optional[EpisodeOutcome] = None

    def on_turn_end(self, turn_ids: Sequence[int], finish_reason: str, budget_left: int) -> Optional[list[int]]:
        if self.outcome is not None:
            return None
        self.turns += 1
        text = self.tokenizer.decode(list(turn_ids), skip_special_tokens=False)
        try:
            answer = self.environment.step(text)
        except Exception as err:  # noqa: BLE001 - a failing environment fails this sample, not the run
            return self._end(None, "error", f"{type(err).__name__}: {err}")
        if isinstance(answer, Reward):
            return self._end(answer, "reward")
        if not isinstance(answer, Observation):
            return self._end(None, "error", f"{type(self.environment).__name__}.step returned {answer!r}, "
                                             "not an Observation or a Reward")
        self.tool_calls += answer.kind == "tool"
        self.malformed_calls += answer.kind == "malformed"
        if finish_reason != "stop" or budget_left <= 0:
            return self._stop("length")
        if self.turns >= self.max_turns:
            return self._stop("max_turns")
        ids = self.observation_ids(answer)
        self.observation_tokens += len(ids)
        return ids

    def finish_reason(self, turn_reason: str) -> str:
        """"length" for an episode the trainer cut (max_turns, a budget), else the last turn's reason."""
        if self.outcome is not None and self.outcome.end in ("max_turns", "length"):
            return "length"
        return turn_reason

    def observation_ids(self, obs: Observation) -> list[int]:
        """The token ids appended for `obs`: framing prefix + text (cut) + framing suffix."""
        if obs.role not in self._framing:
            self._framing[obs.role] = observation_framing(self.tokenizer, obs.role)
        prefix, suffix = self._framing[obs.role]
        encode = lambda s: list(self.tokenizer.encode(s, add_special_tokens=False)) if s else []  # noqa: E731
        head, tail = encode(prefix), encode(suffix)
        room = self.per_observation - len(head) - len(tail)
        if room < 0:
            raise ValueError(f"an observation of role {obs.role!r} needs {len(head) + len(tail)} tokens of chat framing "
                             f"({prefix!r} ... {suffix!r}), more than train.max_observation_tokens = {self.per_observation}")
        return head + encode(obs.text)[:room] + tail

    def _stop(self, reason: str) -> None:
        try:
            reward = self.environment.stop(reason)
        except Exception as err:  # noqa: BLE001
            return self._end(None, "error", f"{type(err).__name__}: {err}")
        if not isinstance(reward, Reward):
            return self._end(None, "error", f"{type(self.environment).__name__}.stop returned {reward!r}, not a Reward")
        return self._end(reward, reason)

    def _end(self, reward: Optional[Reward], end: str, error: Optional[str] = None) -> None:
        fail = float(getattr(self.environment.task, "reward_incorrect", -1.0))
        self.outcome = EpisodeOutcome(
            reward=float(reward.value) if reward is not None else fail,
            passed=bool(reward.passed) if reward is not None else False,
            parts={str(k): float(v) for k, v in dict(reward.parts if reward is not None else {}).items()},
            turns=self.turns, tool_calls=self.tool_calls, malformed_calls=self.malformed_calls,
            observation_tokens=self.observation_tokens, end=end, error=error,
        )
        return None


def make_episode_runners(settings, task, problem, tokenizer, n: int) -> Optional[list[EpisodeRunner]]:
    """One `EpisodeRunner` per sample of a problem, from a config with ``environment``, ``max_turns``,
    ``max_tokens_per_turn`` and ``max_observation_tokens`` (a TrainConfig); None without an environment.
    The environment is built with the hyper-parameters the config resolved for it (``params_of``), gin
    unread; a TrainConfig made by hand (no component table) gets gin's bindings."""
    name = getattr(settings, "environment", None)
    if not name:
        return None
    # a resolved run's TrainConfig carries the environment's hyper-parameters (its component table)
    params = settings.params_of("environments", name) if getattr(settings, "components", None) else None
    return [EpisodeRunner(make_environment(name, task, problem, params), tokenizer, max_turns=settings.max_turns,
                          max_tokens_per_turn=settings.max_tokens_per_turn,
                          max_observation_tokens=settings.max_observation_tokens) for _ in range(int(n))]


def episode_verdict(outcome: EpisodeOutcome):
    """(Verdict, error or None) of a finished episode: what the trainer grades a multi-turn sample by."""
    from components.tasks.base import Verdict

    return Verdict(passed=bool(outcome.passed), reward=float(outcome.reward), error=outcome.error), outcome.error


# =========================================================================================
# accounting and metrics
def observation_token_count(completion) -> int:
    """Observation tokens of a completion (prompt tokens for the compute axis; 0 single-turn)."""
    return sum(bool(o) for o in (getattr(completion, "observed", None) or ()))


def generated_token_count(completion) -> int:
    """Tokens of a completion the engine produced (sampled, and forced interruption phrases), observations
    excluded: what ``generated_tokens`` and length control count."""
    return len(completion.token_ids) - observation_token_count(completion)


def turn_versions(completion) -> Optional[list]:
    """The policy versions of each assistant turn of an episode, [[oldest, newest], ...] over the turn's sampled
    tokens (PipelineRL may swap weights between turns, or inside one); None single-turn (no `observed`)."""
    observed = getattr(completion, "observed", None)
    if observed is None:
        return None
    out, cur = [], []
    for i, (v, f, o) in enumerate(zip(completion.versions, completion.forced, observed)):
        if not o and i > 0 and observed[i - 1] and cur:
            out.append([min(cur), max(cur)])
            cur = []
        if not f:
            cur.append(int(v))
    if cur:
        out.append([min(cur), max(cur)])
    return out


def episode_stats(rollouts: Sequence[Any]) -> dict:
    """Per-step multi-turn metrics over every completion with an episode; {} when none has one (single-turn).

    turns_mean, tool_calls_per_sample, malformed_call_frac (malformed calls / calls attempted; NaN
    without any), observation_tokens, episode_cut_frac (cut by max_turns or a budget),
    episode_error_frac (the environment raised), multi_version_turns_frac (episodes whose assistant turns were
    sampled by more than one policy version: a weight swap between or inside turns)."""
    episodes = [c for r in rollouts for c in r.completions if getattr(c, "episode", None) is not None]
    outcomes = [c.episode for c in episodes]
    if not outcomes:
        return {}
    n = len(outcomes)
    spans = [turn_versions(c) for c in episodes]
    calls = sum(o.tool_calls + o.malformed_calls for o in outcomes)
    return {
        "turns_mean": sum(o.turns for o in outcomes) / n,
        "tool_calls_per_sample": sum(o.tool_calls for o in outcomes) / n,
        "malformed_call_frac": sum(o.malformed_calls for o in outcomes) / calls if calls else math.nan,
        "observation_tokens": int(sum(o.observation_tokens for o in outcomes)),
        "episode_cut_frac": sum(o.end in ("max_turns", "length") for o in outcomes) / n,
        "episode_error_frac": sum(o.end == "error" for o in outcomes) / n,
        "multi_version_turns_frac": sum(bool(t) and min(a for a, _ in t) != max(b for _, b in t) for t in spans) / n,
    }
