"""Rollout groups (what crosses the rollout queue) and their collation into learner tensors."""

from __future__ import annotations

import math
import queue
import threading
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from components.engines.base import Completion

__all__ = ["Rollout", "WorkOrder", "safe_verify", "safe_call", "collate", "Batch"]


@dataclass
class WorkOrder:
    """A batch of prompts the learner asks the generators to complete (control channel)."""

    orders: list  # [(order_id, Problem)]
    seed: int  # sampling seed of this order, derived from (run seed, step)


@dataclass
class Rollout:
    """One finished rollout group: a prompt, its G completions, their rewards."""

    order_id: int  # learner's handle; orders are issued in a deterministic sequence
    problem_id: str
    completions: list  # list[Completion]
    rewards: list  # [G] float, after any reward shaping
    passed: list  # [G] bool
    verifier_errors: int = 0
    engine_version: int = 0  # generator's loaded weight version when the group finished
    generator: int = 0  # which generator produced it
    time_generate: float = 0.0  # seconds the generator spent stepping the engine for it (amortised)
    # train.reward_funcs: {name: [G] that function's reward (NaN: none)}, logged as reward/<name>; None without them
    reward_parts: Optional[dict] = None

    @property
    def pass_rate(self) -> float:
        return sum(bool(p) for p in self.passed) / max(len(self.passed), 1)

    def trained_versions(self) -> list[int]:
        """Versions of the sampled (not forced) tokens."""
        out = []
        for c in self.completions:
            out.extend(v for v, f in zip(c.versions, c.forced) if not f)
        return out

    @property
    def min_version(self) -> int:
        v = self.trained_versions()
        return min(v) if v else self.engine_version


class _VerifierThread:
    """One long-lived daemon thread that runs verifications (no thread start per sample).

    A verification that outlives its timeout leaves this thread stuck; it is then abandoned
    (daemon: it cannot block the process's exit) and the next call starts a fresh one.
    """

    def __init__(self) -> None:
        self.jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, daemon=True, name="verifier")
        self.thread.start()

    def _run(self) -> None:
        while True:
            fn, result, done = self.jobs.get()
            try:
                result["verdict"] = fn()
            except BaseException as err:  # noqa: BLE001 - any verifier failure marks the sample
                result["error"] = f"{type(err).__name__}: {err}"
            done.set()

    def run(self, fn, timeout_s: float) -> Optional[dict]:
        """fn() with a timeout: its result dict, or None if it did not finish in time."""
        result: dict[str, Any] = {}
        done = threading.Event()
        self.jobs.put((fn, result, done))
        return result if done.wait(timeout_s) else None


_verifier: Optional[_VerifierThread] = None


# Added to a task's own grading budget (`verification_seconds`) before the trainer gives up on a
# verification: the sandbox's start-up and the harness's report, beyond the run's own wall clock.
VERIFY_BUDGET_MARGIN_S = 5.0


def verification_timeout(task, problem, timeout_s: float) -> float:
    """How long to wait for one verification: `timeout_s` (`train.verifier_timeout_s`), or longer
    where the task grades in a sandbox run whose own wall budget is longer (a program with many
    test cases: `CodeFileTask.verification_seconds`), so a correct program is never failed by
    the trainer's clock while its sandbox still has time."""
    budget = getattr(task, "verification_seconds", None)
    if budget is None:
        return timeout_s
    try:
        seconds = budget(problem)
    except Exception:  # a verification budget must never break grading; verify reports errors
        return timeout_s
    return timeout_s if seconds is None else max(timeout_s, float(seconds) + VERIFY_BUDGET_MARGIN_S)


def safe_verify(task, problem, text: str, timeout_s: float):
    """task.verify that never raises or hangs: on error or timeout the sample fails (reward_incorrect).

    Returns (Verdict, error-or-None). A hung verifier is left running in its daemon thread.
    The wait is `verification_timeout(task, problem, timeout_s)`.
    """
    from components.tasks.base import Verdict

    timeout_s = verification_timeout(task, problem, timeout_s)
    global _verifier
    if _verifier is None:
        _verifier = _VerifierThread()
    result = _verifier.run(lambda: task.verify(problem, text), timeout_s)
    fail = float(getattr(task, "reward_incorrect", -1.0))
    if result is None:
        _verifier = None  # its thread is stuck in the hung verification: the next call gets a new one
        return Verdict(passed=False, reward=fail, error=f"verifier timed out after {timeout_s}s"), "timeout"
    if "error" in result:
        return Verdict(passed=False, reward=fail, error=result["error"]), result["error"]
    verdict = result.get("verdict")
    if verdict is None or not hasattr(verdict, "passed"):
        return Verdict(passed=False, reward=fail, error=f"verifier returned {verdict!r}"), "bad verdict"
    if verdict.error:
        return Verdict(passed=False, reward=fail, error=verdict.error), verdict.error
    return verdict, None


def safe_call(thunk, timeout_s: float):
    """thunk() on the verifier thread with a timeout: (value, None), or (None, error text) when it raised
    or did not return within `timeout_s` (a reward function of train.reward_funcs)."""
    global _verifier
    if _verifier is None:
        _verifier = _VerifierThread()
    result = _verifier.run(thunk, timeout_s)
    if result is None:
        _verifier = None  # its thread is stuck: the next call gets a new one
        return None, f"timed out after {timeout_s}s"
    if "error" in result:
        return None, result["error"]
    return result.get("verdict"), None


@dataclass
class Batch:
    """Learner tensors for one step, in the layout of `components.engines.logprobs.build_batch`:
    prompts LEFT-padded to P columns, completions RIGHT-padded to T columns (B sequences)."""

    input_ids: torch.Tensor  # [B, P+T] long
    attention_mask: torch.Tensor  # [B, P+T] long
    mask: torch.Tensor  # [B, T] bool: sampled completion tokens (trained on; forced tokens excluded)
    gen_logp: torch.Tensor  # [B, T] float32
    versions: torch.Tensor  # [B, T] long (-1 on padding)
    rewards: torch.Tensor  # [B] float32
    passed: torch.Tensor  # [B] bool
    group_ids: torch.Tensor  # [B] long
    truncated: torch.Tensor  # [B] bool (finish reason "length")
    num_tokens: torch.Tensor  # [B] long, completion lengths (forced included)
    completion_start: int = 1  # P
    # [B, T] long: the assistant turn of each completion token (0, 1, ...; an observation takes the turn it
    # follows; -1 on padding); single-turn: 0 everywhere. The learner's aggregation weights read it (turn_mean)
    turn_ids: Optional[torch.Tensor] = None

    _TENSORS = ("input_ids", "attention_mask", "mask", "gen_logp", "versions", "rewards", "passed", "group_ids", "truncated", "num_tokens")

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def _turns(self, index) -> Optional[torch.Tensor]:
        return None if self.turn_ids is None else self.turn_ids[index]

    def slice(self, start: int, stop: int) -> "Batch":
        return Batch(**{k: getattr(self, k)[start:stop] for k in self._TENSORS}, completion_start=self.completion_start,
                     turn_ids=self._turns(slice(start, stop)))

    def select(self, rows: torch.Tensor) -> "Batch":
        """The sequences at `rows` (a [B] bool mask or an index tensor), same padding."""
        return Batch(**{k: getattr(self, k)[rows] for k in self._TENSORS}, completion_start=self.completion_start,
                     turn_ids=self._turns(rows))

    def trim(self) -> "Batch":
        """The same rows without the padding columns none of them uses (prompt left, completion right)."""
        P = self.completion_start
        used = self.attention_mask[:, :P].bool().any(dim=0)  # [P]
        first = int(torch.nonzero(used)[0]) if bool(used.any()) else P - 1
        T = max(1, int(self.num_tokens.max())) if len(self) else 1
        cols = slice(first, P + T)
        return Batch(
            input_ids=self.input_ids[:, cols], attention_mask=self.attention_mask[:, cols],
            mask=self.mask[:, :T], gen_logp=self.gen_logp[:, :T], versions=self.versions[:, :T],
            rewards=self.rewards, passed=self.passed, group_ids=self.group_ids, truncated=self.truncated,
            num_tokens=self.num_tokens, completion_start=P - first,
            turn_ids=None if self.turn_ids is None else self.turn_ids[:, :T],
        )

    def to(self, device) -> "Batch":
        return Batch(**{k: getattr(self, k).to(device) for k in self._TENSORS}, completion_start=self.completion_start,
                     turn_ids=None if self.turn_ids is None else self.turn_ids.to(device))


def turn_index(observed: Optional[Sequence[bool]], n: int) -> list[int]:
    """The assistant turn of each of a completion's `n` tokens: 0 until the first observation, k after the
    k-th observation (an observation token takes the turn it follows); single-turn (observed None): 0s."""
    if observed is None:
        return [0] * n
    out, turn = [], 0
    for i, o in enumerate(observed):
        if not o and i > 0 and observed[i - 1]:
            turn += 1
        out.append(turn)
    return out


def turn_lag_stats(versions: torch.Tensor, mask: torch.Tensor, turn_ids: torch.Tensor, lag_version: int) -> dict:
    """Multi-turn lag per assistant turn (issue 45): a turn's lag is the learner's version (`lag_version` - 1,
    as the token lag) minus the OLDEST version among its trained tokens (PipelineRL may swap weights between
    two turns of one episode, or inside one). versions, turn_ids [B, T] long, mask [B, T] bool.
    {"lag_turn_mean", "lag_turn_max", "turns_trained"} over every (sequence, turn) with a trained token."""
    B = mask.shape[0]
    width = int(turn_ids.max()) + 1 if turn_ids.numel() else 1
    seg = (torch.arange(B).unsqueeze(1) * max(width, 1) + turn_ids.clamp(min=0))[mask]  # [N] (row, turn) of each token
    if not seg.numel():
        return {"lag_turn_mean": math.nan, "lag_turn_max": 0, "turns_trained": 0}
    oldest = torch.full((B * max(width, 1),), torch.iinfo(torch.long).max, dtype=torch.long)
    oldest = oldest.scatter_reduce(0, seg, versions[mask].long(), reduce="amin")  # [B*width]
    lag = (int(lag_version) - 1 - oldest[torch.unique(seg)]).double()  # [turns]
    return {"lag_turn_mean": float(lag.mean()), "lag_turn_max": int(lag.max()), "turns_trained": int(lag.numel())}


def collate(rollouts: Sequence[Rollout], pad_id: int, mask_observations: bool = True) -> Batch:
    """Flatten groups into learner tensors; group_ids are the rollouts' order ids.

    `mask_observations` (train.mask_observations): True (the default, correct) leaves a multi-turn episode's
    observation tokens out of the mask, as prompt tokens. False is THE KNOWN BUG, kept only as an ablation
    (experiments/sweeps/mask_observations.gin): observation tokens are trained on as if the policy had
    generated them, with gen_logp 0."""
    from components.engines.logprobs import build_batch

    seqs: list[Completion] = []
    rewards: list[float] = []
    passed: list[bool] = []
    groups: list[int] = []
    for r in rollouts:
        for c, rew, ok in zip(r.completions, r.rewards, r.passed):
            seqs.append(c)
            rewards.append(float(rew))
            passed.append(bool(ok))
            groups.append(int(r.order_id))
    packed = build_batch([c.prompt_ids for c in seqs], [c.token_ids for c in seqs], pad_id)
    B, T = packed["completion_mask"].shape
    mask = packed["completion_mask"].clone()  # [B, T]
    gen_logp = torch.zeros((B, T), dtype=torch.float32)
    versions = torch.full((B, T), -1, dtype=torch.long)
    turn_ids = torch.full((B, T), -1, dtype=torch.long)
    for b, c in enumerate(seqs):
        n = len(c.token_ids)
        if n:
            excluded = list(c.forced)
            if not mask_observations and c.observed is not None:  # the known bug: observations trained on
                excluded = [f and not o for f, o in zip(c.forced, c.observed)]
            mask[b, :n] &= ~torch.tensor(excluded, dtype=torch.bool)
            turn_ids[b, :n] = torch.tensor(turn_index(c.observed, n), dtype=torch.long)
            gen_logp[b, :n] = torch.tensor(list(c.gen_logp), dtype=torch.float32)
            versions[b, :n] = torch.tensor(list(c.versions), dtype=torch.long)
    return Batch(
        input_ids=packed["input_ids"],
        attention_mask=packed["attention_mask"],
        mask=mask,
        gen_logp=gen_logp,
        versions=versions,
        rewards=torch.tensor(rewards, dtype=torch.float32),
        passed=torch.tensor(passed, dtype=torch.bool),
        group_ids=torch.tensor(groups, dtype=torch.long),
        truncated=torch.tensor([c.finish_reason == "length" for c in seqs], dtype=torch.bool),
        num_tokens=torch.tensor([len(c.token_ids) for c in seqs], dtype=torch.long),
        completion_start=int(packed["completion_start"]),
        turn_ids=turn_ids,
    )
