"""components/warm_start.py: the cached, deterministic SFT warm start of the CPU demo policy."""

from __future__ import annotations

import random
import time
from pathlib import Path

import gin
import pytest
import torch

from components.warm_start import (
    META_FILE,
    ensure_warm_policy,
    noisy_answer,
    sft_examples,
    settings_key,
    warm_start_info,
)

# A very small, fast configuration: a 2-layer hidden-32 Llama, a handful of SFT steps.
TASK_KWARGS = {"num_train": 60, "num_eval": 16, "max_operand": 9, "operators": "+"}
SMALL = dict(
    task="arithmetic",
    task_kwargs=TASK_KWARGS,
    model_kwargs={"hidden_size": 32, "num_layers": 1, "num_heads": 2, "max_position_embeddings": 64},
    sft_steps=6,
    sft_batch_size=8,
    eval_max_tokens=4,
    num_threads=1,
    progress=False,
)


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _state(path):
    from components.models import load_causal_lm

    return load_causal_lm(path).state_dict()


def test_builds_then_hits_the_cache(tmp_path):
    path = Path(ensure_warm_policy(tmp_path, **SMALL))
    assert path.parent == tmp_path.absolute() and path.name.startswith("warm-")
    assert (path / "config.json").is_file() and (path / META_FILE).is_file()
    info = warm_start_info(path)
    assert info["settings"]["sft_steps"] == 6 and 0.0 <= info["held_out_pass_rate_sampled"] <= 1.0
    assert info["held_out_prompts"] == TASK_KWARGS["num_eval"]
    # nothing half-written is left behind
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    again = ensure_warm_policy(tmp_path, **SMALL)
    assert Path(again) == path
    assert time.perf_counter() - t0 < 1.0, "a cache hit must not rebuild"
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime


def test_build_is_deterministic_and_settings_change_the_key(tmp_path):
    a = ensure_warm_policy(tmp_path / "a", **SMALL)
    b = ensure_warm_policy(tmp_path / "b", **SMALL)
    assert Path(a).name == Path(b).name  # same settings, same key
    sa, sb = _state(a), _state(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    other = ensure_warm_policy(tmp_path / "a", **{**SMALL, "seed": 1})
    assert Path(other).name != Path(a).name
    assert not all(torch.equal(v, _state(other)[k]) for k, v in sa.items())


def test_sft_learns(tmp_path):
    """More SFT steps give a lower training loss than the untrained model's ~ln(vocab)."""
    path = ensure_warm_policy(tmp_path, **{**SMALL, "sft_steps": 60, "sft_batch_size": 16, "label_noise": 0.0, "label_smoothing": 0.0})
    info = warm_start_info(path)
    assert info["sft_final_loss"] < 2.0, info  # ln(100 tokens) ~ 4.6 at initialisation


def test_settings_key_depends_on_every_setting():
    base = {"a": 1, "b": {"x": 2}}
    assert settings_key(base) == settings_key({"b": {"x": 2}, "a": 1})
    assert settings_key(base) != settings_key({"a": 1, "b": {"x": 3}})


@pytest.mark.parametrize("gold", [0, 1, 5, 37])
def test_noisy_answer_is_a_near_miss(gold):
    rng = random.Random(0)
    offsets = (-2, -1, 1, 2)
    seen = {int(noisy_answer(gold, rng, offsets)) for _ in range(200)}
    assert gold not in seen
    assert all(v >= 0 for v in seen)
    assert all(abs(v - gold) in (1, 2) for v in seen)


def test_noisy_answer_needs_integers():
    with pytest.raises(ValueError, match="label_noise"):
        noisy_answer("x^2", random.Random(0), (1,))


def test_bad_settings_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="label_noise"):
        ensure_warm_policy(tmp_path, **{**SMALL, "label_noise": 1.0})
    with pytest.raises(ValueError, match="noise_offsets"):
        ensure_warm_policy(tmp_path, **{**SMALL, "label_noise": 0.5, "noise_offsets": (0, 1)})
    with pytest.raises(ValueError, match="label_smoothing"):
        ensure_warm_policy(tmp_path, **{**SMALL, "label_smoothing": -0.1})


def test_sft_targets_are_the_answer_and_eos_only(tmp_path):
    from components.models import build_tiny_policy, load_tokenizer
    from components.tasks import make_task

    tok = load_tokenizer(build_tiny_policy(tmp_path / "m", hidden_size=16, num_layers=1, num_heads=2))
    task = make_task("arithmetic", seed=0, **TASK_KWARGS)
    problems = task.train_problems()[:1]
    draw = sft_examples(task, tok, problems, label_noise=0.0, noise_offsets=(1,), rng=random.Random(0))
    ids, loss_mask, attention = draw(3)  # [3, L], [3, L-1], [3, L]
    assert ids.shape[0] == 3 and loss_mask.shape == (3, ids.shape[1] - 1)
    for row in range(3):
        targets = ids[row, 1:][loss_mask[row].bool()].tolist()
        assert tok.decode(targets, skip_special_tokens=False) == f"{problems[0].answer}</s>"
        assert int(attention[row].sum()) == len(ids[row]) - int((ids[row] == tok.pad_token_id).sum())


def test_gin_binds_the_warm_start(tmp_path):
    gin.clear_config()
    try:
        gin.parse_config(
            [
                f"warm_start.cache_dir = '{tmp_path}'",
                "warm_start.task_kwargs = %TASK",
                f"TASK = {TASK_KWARGS!r}",
                "warm_start.model_kwargs = {'hidden_size': 32, 'num_layers': 1, 'num_heads': 2}",
                "warm_start.sft_steps = 3",
                "warm_start.sft_batch_size = 4",
                "warm_start.eval_max_tokens = 3",
                "warm_start.num_threads = 1",
                "warm_start.progress = False",
            ]
        )
        path = ensure_warm_policy()
    finally:
        gin.clear_config()
    info = warm_start_info(path)
    assert Path(path).parent == tmp_path.absolute()
    assert info["settings"]["sft_steps"] == 3 and info["settings"]["task_kwargs"] == TASK_KWARGS


def test_label_smoothing_raises_the_loss_floor():
    """With smoothing the target mixes in the uniform distribution: a perfect model still pays ~eps*ln(V)."""
    import torch

    from components.warm_start import sft_loss

    class Perfect(torch.nn.Module):  # puts all its mass on the next token of `ids`
        def forward(self, input_ids, attention_mask):
            logits = torch.full((*input_ids.shape, 50), -1e4)
            logits[:, :-1].scatter_(-1, input_ids[:, 1:, None], 0.0)
            return type("Out", (), {"logits": logits})()

    ids = torch.randint(0, 50, (2, 6))
    mask = torch.ones(2, 5)
    att = torch.ones(2, 6, dtype=torch.long)
    assert float(sft_loss(Perfect(), ids, mask, att)) < 1e-3
    assert float(sft_loss(Perfect(), ids, mask, att, label_smoothing=0.4)) > 0.4 * 1e3 / 2
