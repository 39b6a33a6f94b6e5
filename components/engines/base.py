"""The one interface every generation engine implements (registry `ENGINES`).

An engine holds a policy's weights and samples completions. It is stepped by its owner
(a generator worker) so that new weights can be loaded *between decode steps* while
sequences are in flight (PipelineRL semantics: a sequence continues under the new weights
with its existing KV cache, so one completion can span several policy versions).

Usage by a generator worker::

    engine.add_requests(requests)
    while engine.has_unfinished():
        maybe_new = weight_channel.poll()
        if maybe_new: engine.update_weights(maybe_new.state_dict, maybe_new.version)
        for group in engine.step():      # groups finished during this step
            rollout_queue.put(group)

`generate(requests)` is the same loop without weight updates (evaluation, benchmarks).
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal, Mapping, Optional, Sequence

FinishReason = Literal["stop", "length", "interrupted"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. One instance is shared by the requests of a call.

    Both engines apply the knobs in vLLM's order, so they sample from the same distribution:
    repetition penalty on the raw logits (a logit > 0 of a token already in the prompt or the
    completion is divided by it, one <= 0 multiplied), then / temperature, softmax, min-p (drop
    tokens less likely than min_p x the most likely one), top-k (keep the k most likely, ties with
    the k-th kept), then top-p on what is left, renormalised. Greedy sampling (temperature <= 0)
    takes the argmax of the penalised logits and ignores min-p, top-k and top-p.
    gen_logp is unchanged by every one of them: log_softmax(logits / T) of the raw logits
    (`Completion`), the quantity the trainer recomputes.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 64  # completion budget in sampled tokens (thinking + answer for interruption)
    stop_token_ids: tuple[int, ...] = ()  # the tokenizer's EOS is always a stop token too
    seed: Optional[int] = None
    top_k: int = 0  # sample among the k most likely tokens; 0: off
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one; 0: off
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the prompt or completion; 1: off
    max_prompt_length: Optional[int] = None  # a longer prompt is refused (ValueError); None: no limit


# The knobs added with train.top_k / min_p / repetition_penalty / max_prompt_length, and their ranges
# (the same as components.trainer.config.TRAIN_RANGES: a config is refused before anything runs, an
# engine refuses a SamplingParams built by hand).
SAMPLING_KNOB_RANGES = {"top_k": "an integer >= 0", "min_p": "in [0, 1]", "repetition_penalty": "finite and > 0",
                        "max_prompt_length": "None or an integer >= 1"}


def _is_integer(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_sampling_knobs(params: SamplingParams) -> None:
    """Refuse top_k, min_p, repetition_penalty or max_prompt_length outside its range (ValueError naming
    the value and the range), before any request is queued."""
    ok = {
        "top_k": _is_integer(params.top_k) and params.top_k >= 0,
        "min_p": _is_real(params.min_p) and 0.0 <= params.min_p <= 1.0,
        "repetition_penalty": _is_real(params.repetition_penalty) and math.isfinite(params.repetition_penalty)
        and params.repetition_penalty > 0,
        "max_prompt_length": params.max_prompt_length is None
        or (_is_integer(params.max_prompt_length) and params.max_prompt_length >= 1),
    }
    bad = [name for name, good in ok.items() if not good]
    if bad:
        raise ValueError("; ".join(f"SamplingParams.{name} = {getattr(params, name)!r} is out of range: must be "
                                   f"{SAMPLING_KNOB_RANGES[name]}" for name in bad))


def check_prompt_length(request: "GenerationRequest", params: SamplingParams) -> None:
    """Refuse a prompt longer than params.max_prompt_length, naming its length, the limit and the setting."""
    limit = params.max_prompt_length
    if limit is not None and len(request.prompt_ids) > limit:
        raise ValueError(
            f"request {request.group_id!r}: its prompt has {len(request.prompt_ids)} tokens, more than "
            f"max_prompt_length = {limit} (train.max_prompt_length); raise the limit, or shorten the prompt "
            "(the task's template or system prompt), or leave such problems out of the task"
        )


def sampling_knobs(settings: Any) -> dict:
    """SamplingParams' top_k, min_p, repetition_penalty and max_prompt_length from a config that has them
    (a TrainConfig: train.top_k, ...); a missing one, or top_k None, is the knob's off value."""
    top_k = getattr(settings, "top_k", 0)
    return {
        "top_k": 0 if top_k is None else int(top_k),
        "min_p": float(getattr(settings, "min_p", 0.0)),
        "repetition_penalty": float(getattr(settings, "repetition_penalty", 1.0)),
        "max_prompt_length": getattr(settings, "max_prompt_length", None),
    }


@dataclass(frozen=True)
class Interruption:
    """Forced interruption of one sequence (length control `interruption`).

    After `at_token` sampled tokens without a stop, the engine appends `phrase_ids`
    (forced, not sampled) and then allows up to `answer_budget` more sampled tokens;
    the completion's finish reason becomes "interrupted" unless the answer hits its
    budget ("length").

    Only while the model is still THINKING (`still_thinking`): with `think_close_ids` set
    (the token ids of ``</think>``), a sample that has closed its thinking part, or that
    started answering without opening one (`think_open_ids`, ``<think>``, neither in its
    completion nor left open by the prompt), is not interrupted; it goes on sampling up to
    ``SamplingParams.max_tokens``. Without `think_close_ids` every sample counts as thinking.
    """

    at_token: int
    phrase_ids: tuple[int, ...]
    answer_budget: int
    think_open_ids: tuple[int, ...] = ()
    think_close_ids: tuple[int, ...] = ()


def _find(seq: Sequence[int], sub: Sequence[int], last: bool = False) -> int:
    """Index of the first (or last) occurrence of `sub` in `seq`, -1 if none."""
    n, k = len(seq), len(sub)
    if k == 0 or k > n:
        return -1
    starts = range(n - k, -1, -1) if last else range(n - k + 1)
    first = sub[0]
    for i in starts:
        if seq[i] == first and list(seq[i : i + k]) == list(sub):
            return i
    return -1


def still_thinking(it: Interruption, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> bool:
    """Whether a sample is still in its thinking part after `completion_ids` (see `Interruption`).

    Thinking = a thinking part is open: opened in the completion (``<think>``) or left open at the
    end of the prompt (a chat template ending in ``<think>``), and not closed in the completion
    (``</think>``). Without `think_close_ids` every sample counts as thinking.
    """
    close, opening = tuple(it.think_close_ids), tuple(it.think_open_ids)
    if not close:
        return True
    if _find(completion_ids, close) >= 0:
        return False  # thinking closed: the answer has started
    if not opening or _find(completion_ids, opening) >= 0:
        return True
    return _find(prompt_ids, opening, last=True) > _find(prompt_ids, close, last=True)


class Conversation(ABC):
    """One sample's multi-turn episode as an engine sees it: token ids in, token ids out.

    The engine samples an assistant turn until a stop token (finish reason "stop"), the turn's
    budget `max_tokens_per_turn` or the request's `SamplingParams.max_tokens` ("length"), then calls
    `on_turn_end(turn_ids, finish_reason, budget_left)` with the turn's tokens (the stop token
    included) and the sampled-token budget left. It returns the observation's token ids, which the
    engine appends as forced tokens (gen_logp 0.0, ``forced`` and ``observed`` True: never trained
    on) before the next turn is sampled, or None: the episode is over and the sample finishes with
    that finish reason. `outcome` (set by then) goes on the finished ``Completion.episode``.

    `max_observation_tokens` bounds the observation tokens of the whole episode (the engine sizes
    its positions and KV cache with it). The generator's implementation is
    `components.environments.EpisodeRunner`.
    """

    max_tokens_per_turn: Optional[int] = None  # sampled tokens per assistant turn (None: only max_tokens)
    max_observation_tokens: int = 0  # most observation tokens the episode may append, all turns together
    outcome: Any = None  # what the episode produced, once over (attached to the Completion)

    @abstractmethod
    def on_turn_end(self, turn_ids: Sequence[int], finish_reason: str, budget_left: int) -> Optional[list[int]]:
        """The observation's token ids after this turn, or None to end the episode."""

    def finish_reason(self, turn_reason: str) -> str:
        """The finished sample's finish reason, once `on_turn_end` ended the episode after a turn that ended
        with `turn_reason`: that reason, unless the conversation says otherwise (an episode cut short is
        "length")."""
        return turn_reason


def turn_budget(conversation: Optional[Conversation], sampled: int, cap: int) -> int:
    """Sampled tokens the next turn may take: the request's remaining budget `cap - sampled`, no more than
    the conversation's `max_tokens_per_turn` (None or no conversation: the remaining budget)."""
    left = int(cap) - int(sampled)
    per_turn = getattr(conversation, "max_tokens_per_turn", None)
    return left if per_turn is None else min(left, int(per_turn))


def finish_sample(row: Any, reason: str) -> Any:
    """Hand a finished sample of either engine to its group (`row`: the engine's per-sample state, with
    conversation, tokens, turn_start, logps, versions, forced, observed, group and sample_index). An episode
    cut from outside (abort_all) ends at its current turn. Returns the group's result once it is complete."""
    conv = row.conversation
    if conv is not None and conv.outcome is None:
        conv.on_turn_end(row.tokens[row.turn_start :], "length", 0)
    return row.group.finish_sample(row.sample_index, row.tokens, row.logps, row.versions, row.forced, reason,
                                   observed=list(row.observed) if conv is not None else None,
                                   episode=conv.outcome if conv is not None else None)


def check_conversations(request: "GenerationRequest") -> None:
    """Refuse a request whose conversations do not give one per sample, or that also asks for forced
    interruptions (ValueError naming the request)."""
    convs = request.conversations
    if convs is None:
        return
    if len(convs) != request.n:
        raise ValueError(f"request {request.group_id!r}: {len(convs)} conversations for n={request.n} samples")
    if request.interruptions is not None and any(i is not None for i in request.interruptions):
        raise ValueError(f"request {request.group_id!r}: forced interruptions and multi-turn conversations cannot be "
                         "combined (an interruption counts sampled tokens across turns); use one or the other")


def max_observation_tokens(request: "GenerationRequest") -> int:
    """Most observation tokens any sample of `request` may append (0 without conversations)."""
    return max((int(c.max_observation_tokens) for c in request.conversations or ()), default=0)


@dataclass
class GenerationRequest:
    """One prompt to complete `n` times (a rollout group)."""

    group_id: Any  # the caller's handle; returned unchanged on the completions
    prompt_ids: list[int]
    n: int = 1
    # One Interruption per sample (len == n), or None for no interruption.
    interruptions: Optional[Sequence[Optional[Interruption]]] = None
    meta: dict = field(default_factory=dict)  # passed through untouched (problem id, ...)
    # One Conversation per sample (len == n): multi-turn episodes; None: one turn (a plain completion).
    conversations: Optional[Sequence[Conversation]] = None


@dataclass
class Completion:
    """One sampled completion.

    token_ids, gen_logp, versions and forced all have the completion's length.
    gen_logp[t] is the sampler's float32 log-prob of token_ids[t]:
    log_softmax(logits / temperature)[token] under the weights that sampled it (not
    renormalised after top-p, top-k or min-p, and without the repetition penalty; the trainer
    recomputes exactly this quantity).
    Forced (injected) tokens have gen_logp 0.0 and forced True; they are excluded from the loss.
    versions[t] is the policy version that produced token t.
    Multi-turn (a request with conversations): `observed` marks the environment's observation
    tokens (all of them forced too; the version of the turn they follow), `episode` is the
    conversation's outcome; both None for a single-turn completion.
    """

    group_id: Any
    sample_index: int
    prompt_ids: list[int]
    token_ids: list[int]
    gen_logp: list[float]
    versions: list[int]
    forced: list[bool]
    finish_reason: FinishReason
    meta: dict = field(default_factory=dict)
    observed: Optional[list] = None  # [len] bool: observation tokens (multi-turn), None: none
    episode: Any = None  # the Conversation's outcome (components.environments.EpisodeOutcome)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def min_version(self) -> int:
        return min(self.versions) if self.versions else -1

    @property
    def max_version(self) -> int:
        return max(self.versions) if self.versions else -1


@dataclass
class CompletedGroup:
    """All n completions of one GenerationRequest, handed over when the last one finishes."""

    request: GenerationRequest
    completions: list[Completion]


@dataclass
class PendingGroup:
    """Engine-side bookkeeping of one request whose samples are still being generated."""

    request: GenerationRequest
    completions: list = field(init=False)
    remaining: int = field(init=False)

    def __post_init__(self) -> None:
        self.completions = [None] * self.request.n
        self.remaining = self.request.n

    def finish_sample(
        self,
        sample_index: int,
        token_ids: list[int],
        gen_logp: list[float],
        versions: list[int],
        forced: list[bool],
        finish_reason: FinishReason,
        observed: Optional[list[bool]] = None,
        episode: Any = None,
    ) -> Optional[CompletedGroup]:
        """Record one finished sample; the whole group once its last sample is in, else None."""
        req = self.request
        self.completions[sample_index] = Completion(
            group_id=req.group_id,
            sample_index=sample_index,
            prompt_ids=list(req.prompt_ids),
            token_ids=token_ids,
            gen_logp=gen_logp,
            versions=versions,
            forced=forced,
            finish_reason=finish_reason,
            meta=req.meta,
            observed=observed,
            episode=episode,
        )
        self.remaining -= 1
        return CompletedGroup(request=req, completions=self.completions) if self.remaining == 0 else None


class Engine(ABC):
    """A generation engine. Subclasses register with `@ENGINES.register(name)`."""

    #: policy version of the weights currently loaded
    version: int = 0

    #: how `scalerl plan` estimates one generator's memory: "paged" (a KV cache inside a reserved
    #: fraction of the GPU, tensor parallel: vLLM's), "dense" (the torch engine's own cache), or
    #: None (the plan cannot estimate this engine)
    memory_model: Optional[str] = None

    @classmethod
    def gpus_per_instance(cls, knobs: Mapping[str, Any]) -> int:
        """GPUs one engine (one generator) spans, given its constructor's keyword values
        (defaults and gin bindings: ``gin_config.bound_values(ENGINES, name)``, or a run's resolved values)."""
        return 1

    @abstractmethod
    def add_requests(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> None:
        """Queue requests; they start at the engine's next opportunity."""

    @abstractmethod
    def step(self) -> list[CompletedGroup]:
        """Advance every in-flight sequence by (at least) one decode step.

        Returns the groups whose last completion finished during this step.
        """

    @abstractmethod
    def has_unfinished(self) -> bool:
        """True while any queued or in-flight request has not been returned."""

    @abstractmethod
    def update_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Load new weights in place, between decode steps; in-flight sequences continue."""

    def abort_all(self) -> list[CompletedGroup]:  # pragma: no cover - optional
        """Stop every in-flight sequence; engines may return them truncated."""
        raise NotImplementedError

    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> Iterator[CompletedGroup]:
        """Complete `requests`, yielding each group as it finishes (no weight updates)."""
        self.add_requests(requests, params)
        while self.has_unfinished():
            yield from self.step()

    def close(self) -> None:
        """Release resources (processes, KV cache)."""

    # ------------------------------------------------------------------ weight sync (components/trainer/weight_sync.py)
    def connect_weights(self, receiver) -> None:
        """Join the weight group now (else the first `receive_weights` joins it)."""
        receiver.connect()

    def receive_weights(self, receiver, update) -> None:
        """Load the update announced as `update` (a WeightUpdate) from `receiver` (a WeightReceiver).

        Called between two decode steps; in-flight sequences continue under the new weights.
        The default collects every tensor and calls `update_weights`; engines override it to load
        bucket by bucket.
        """
        self.update_weights(dict(receiver.receive(update)), update.version)
