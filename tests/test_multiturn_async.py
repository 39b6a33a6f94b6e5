"""Issue 45 item 3: multi-turn episodes through the async trainer. A PipelineRL weight swap between two turns
of an episode: each turn keeps the version that generated it (per token, as a single-turn sequence interrupted
by an update), the sample records both, its gen_logp are each turn's own policy's (a float64 reference), the
lag is logged per turn; and a multi-turn run (tiny_tool) killed mid-way resumes losing and repeating nothing."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from _helpers_trainer import read_jsonl, run_json, start_training_subprocess
from components.engines import GenerationRequest, SamplingParams, make_engine
from components.engines.base import Conversation
from components.environments import episode_stats, turn_versions
from components.models import build_tiny_policy, load_causal_lm
from components.trainer.checkpoint import latest_checkpoint
from components.trainer.rollout import Rollout, collate, turn_lag_stats

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _fresh_gin():
    import gin

    gin.clear_config()
    yield
    gin.clear_config()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(build_tiny_policy(tmp_path_factory.mktemp("tiny_async_turns")))


class _Echo(Conversation):
    """After each turn the observation `obs`, `turns` times; `on_first_turn` is called when turn 1 ends."""

    def __init__(self, obs, turns, per_turn):
        self.obs, self.left, self.max_tokens_per_turn = list(obs), turns, per_turn
        self.max_observation_tokens = len(obs) * turns
        self.calls = []

    def on_turn_end(self, turn_ids, finish_reason, budget_left):
        self.calls.append(list(turn_ids))
        if self.left > 0 and budget_left > 0:
            self.left -= 1
            return list(self.obs)
        self.outcome = {"turns": len(self.calls)}
        return None


def _logp64(model, prompt, tokens) -> torch.Tensor:
    """float64 log-probs of `tokens` after `prompt` under `model` (one unpadded sequence).  [len(tokens)]"""
    model64 = model.double().eval()
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logp = torch.log_softmax(model64(input_ids=ids).logits[0].double(), dim=-1)  # [P+T, V]
    P = len(prompt)
    return logp[P - 1 : P - 1 + len(tokens)].gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1)


def _hybrid_logp64(old, new, prompt, tokens, swap_at) -> torch.Tensor:
    """float64 log-probs of `tokens` after `prompt` when the weights change from `old` to `new` with the first
    `swap_at` tokens' keys and values already cached (PipelineRL keeps the KV cache across an update): the
    prefix prompt + tokens[:swap_at - 1] is encoded by `old`, everything after by `new` on that cache.  [T]"""
    from components.engines.torch_engine import kv_cache_name

    old64, new64 = old.double().eval(), new.double().eval()
    seq = list(prompt) + list(tokens)
    cut = len(prompt) + swap_at - 1  # tokens[swap_at - 1] is fed after the swap
    with torch.no_grad():
        first = old64(input_ids=torch.tensor([seq[:cut]]), use_cache=True)
        name = kv_cache_name(new64)
        rest = new64(input_ids=torch.tensor([seq[cut:]]), use_cache=True, **{name: getattr(first, name)})
    logits = torch.cat([first.logits[0], rest.logits[0]], dim=0).double()  # [P+T, V]
    logp = torch.log_softmax(logits, dim=-1)
    P = len(prompt)
    return logp[P - 1 : P - 1 + len(tokens)].gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1)


def test_weight_swap_between_turns_records_both_versions(tiny):
    eng = make_engine("torch", tiny, precision="fp32", seed=4)
    trainer = load_causal_lm(tiny)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    new_state = {k: v.detach().clone() for k, v in trainer.state_dict().items()}
    conv = _Echo([20, 21, 22, 23], turns=1, per_turn=5)
    prompt = [9, 10, 11, 12, 13]
    eng.add_requests([GenerationRequest(group_id=0, prompt_ids=prompt, n=1, conversations=[conv])],
                     SamplingParams(temperature=1.0, max_tokens=10))
    done = []
    while not conv.calls:  # decode until the first turn is over
        done += eng.step()
    eng.update_weights(new_state, version=1)  # PipelineRL: the learner pushed new weights between the turns
    while eng.has_unfinished():
        done += eng.step()
    (group,) = done
    (c,) = group.completions
    assert turn_versions(c) == [[0, 0], [1, 1]]  # the sample records the version of each turn
    first = c.observed.index(True)
    second = first + sum(c.observed)
    assert set(c.versions[:first]) == {0} and set(c.versions[first:second]) == {0}  # the observation: its turn's
    assert set(c.versions[second:]) == {1} and c.min_version == 0 and c.max_version == 1
    # each turn's gen_logp is its own policy's: turn 1 the old weights', turn 2 the new weights' on the cache
    # the old ones wrote (the last token of turn 1 and the observation are fed after the swap)
    gen = torch.tensor(c.gen_logp, dtype=torch.float64)
    ref = _hybrid_logp64(load_causal_lm(tiny), trainer, prompt, c.token_ids, swap_at=first)
    sampled = ~torch.tensor(c.forced)
    assert float((gen - ref).abs()[sampled].max()) < 1e-4
    ref_old = _logp64(load_causal_lm(tiny), prompt, c.token_ids)
    assert float((gen[second:] - ref_old[second:]).abs().max()) > 1e-3  # the swap changed the policy
    # the group is as old as its oldest sampled token (the off-policy schemes' lag), and the step's metrics say
    # that its turns came from different versions
    rollout = Rollout(order_id=0, problem_id="p", completions=[c], rewards=[1.0], passed=[False], engine_version=1)
    assert rollout.min_version == 0
    c.episode = SimpleNamespace(turns=2, tool_calls=0, malformed_calls=0, observation_tokens=4, end="stop")
    assert episode_stats([rollout])["multi_version_turns_frac"] == 1.0
    # the lag of each turn, counted by the learner at version 2 (lag_version 3): 2 and 1
    batch = collate([rollout], 0)
    stats = turn_lag_stats(batch.versions, batch.mask, batch.turn_ids, lag_version=3)
    assert stats == {"lag_turn_mean": 1.5, "lag_turn_max": 2, "turns_trained": 2}


def _reference_turn_lags(versions, mask, turn_ids, lag_version):
    lags = []
    for b in range(len(versions)):
        oldest = {}
        for t in range(len(versions[b])):
            if mask[b][t]:
                k = turn_ids[b][t]
                oldest[k] = min(oldest.get(k, versions[b][t]), versions[b][t])
        lags += [lag_version - 1 - v for v in oldest.values()]
    return lags


def test_turn_lag_stats_match_a_reference():
    gen = torch.Generator().manual_seed(3)
    B, T = 6, 12
    versions = torch.randint(0, 5, (B, T), generator=gen)
    turn_ids = torch.cumsum((torch.rand((B, T), generator=gen) < 0.2).long(), dim=1)
    mask = torch.rand((B, T), generator=gen) < 0.7
    mask[0] = False  # a row with nothing trained
    lags = _reference_turn_lags(versions.tolist(), mask.tolist(), turn_ids.tolist(), 7)
    stats = turn_lag_stats(versions, mask, turn_ids, 7)
    assert stats["turns_trained"] == len(lags)
    assert stats["lag_turn_mean"] == pytest.approx(sum(lags) / len(lags), rel=1e-12)
    assert stats["lag_turn_max"] == max(lags)
    empty = turn_lag_stats(versions, torch.zeros_like(mask), turn_ids, 7)
    assert empty["turns_trained"] == 0 and empty["lag_turn_max"] == 0


def _tool_gin(tmp_path: Path, name: str, total: int, off_policy: str) -> str:
    """tiny_tool.gin, made small: a short warm start, a small batch and task."""
    kwargs = '{"num_train": 300, "num_eval": 8, "digits": 2}'
    lines = [f"include '{REPO / 'experiments' / 'configs' / 'tiny_tool.gin'}'",
             f"warm_start.task_kwargs = {kwargs}", f"train.task_kwargs = {kwargs}",
             f"warm_start.cache_dir = '{tmp_path.parent / 'warm_cache'}'",
             "warm_start.sft_steps = 60", "train.prompts_per_step = 4", "train.generations_per_prompt = 4",
             "train.micro_batch_size = 16", "train.curriculum = ['uniform']", f"train.total_steps = {total}",
             "train.eval_every = 5", "train.eval_prompts = 4", "train.eval_k = 2", "train.checkpoint_every = 3",
             "train.keep_checkpoints = 100", "train.precision = 'fp32'", off_policy]
    path = tmp_path / f"{name}.gin"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.slow
def test_multi_turn_resume_loses_and_repeats_nothing(tmp_path):
    """As tests/test_checkpoint.py for a single-turn run: kill -9 mid-way, resume, no gap and no duplicated
    step, and (synchronous, fixed seed) the final policy and every step's signal equal an uninterrupted run's."""
    from safetensors.torch import load_file

    from experiments.train import run_training

    total = 10
    sync = "train.off_policy = 'ppo_off_policy'\nppo_off_policy.k = 1"
    gin_file = _tool_gin(tmp_path, "killed", total, sync)
    run_killed = tmp_path / "runs" / "killed"
    # the uninterrupted reference first (it also builds the warm start both runs share)
    run_ref = tmp_path / "runs" / "reference"
    assert run_training([gin_file], [], str(run_ref), progress=False) == "done"
    proc = start_training_subprocess(gin_file, str(run_killed), tmp_path / "killed.log")
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            metrics = run_killed / "metrics.jsonl"
            steps = [r["step"] for r in read_jsonl(metrics)] if metrics.exists() else []
            if len(steps) >= 4 and latest_checkpoint(run_killed / "checkpoints") is not None:
                break
            assert proc.poll() is None, (tmp_path / "killed.log").read_text()
            time.sleep(0.02)
        else:
            pytest.fail("the run never reached step 4:\n" + (tmp_path / "killed.log").read_text())
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    at_kill = [r["step"] for r in read_jsonl(run_killed / "metrics.jsonl")]
    assert 4 <= len(at_kill) < total, "the kill must land mid-way"
    assert run_training([gin_file], [], str(run_killed), progress=False) == "done"
    info = run_json(run_killed)
    assert info["status"] == "done" and info["resumes"] == 1
    rows = read_jsonl(run_killed / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, total + 1)), "no gap and no duplicated step"
    ref_rows = read_jsonl(run_ref / "metrics.jsonl")
    keys = ("step", "reward_mean", "loss", "grad_norm", "turns_mean", "tool_calls_per_sample", "observation_tokens",
            "generated_tokens", "tokens", "lag_turn_mean")
    for a, b in zip(ref_rows, rows):
        assert [a[k] for k in keys] == [b[k] for k in keys], (a["step"], b["step"])
    assert any(r["observation_tokens"] > 0 for r in rows)  # episodes with tool results went through the resume
    ref = load_file(str(run_ref / "final" / "model.safetensors"))
    resumed = load_file(str(run_killed / "final" / "model.safetensors"))
    assert ref.keys() == resumed.keys() and all(torch.equal(ref[k], resumed[k]) for k in ref)
