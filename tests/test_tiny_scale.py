"""The tiny scale (issue 12 item 4): the recipes sweep keeps each recipe's batch, dapo_clip reaches large
eps_high, and tiny_cpu.gin is ScaleRL at tiny lengths (emulated bf16 + FP32 head, interruptions that only
cut a thinking part a correct completion never reaches). Read with gin's parser, no run and no warm start."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from components.length_control import ForcedInterruption
from components.tasks.arithmetic import ArithmeticTask
from experiments import recipes, sweep_spec

CONFIGS = Path(recipes.__file__).resolve().parent / "configs"
TINY = str(CONFIGS / "tiny_cpu.gin")


def tiny(param, selector="train"):
    value = recipes.recipe_binding(TINY, selector, param)
    if isinstance(value, str) and value.startswith("%"):  # a macro: its own binding (selector = name, no param)
        value = recipes.recipe_binding(TINY, value[1:], "")
    return value


def effective(run, param, default):
    """The value a run's bindings give `train.<param>` (the last wins), else the tiny base's."""
    value = default
    for b in run.bindings:
        key, _, rhs = b.partition("=")
        if key.strip() == f"train.{param}":
            value = int(rhs)
    return value


def test_recipes_sweep_keeps_each_recipes_batch_at_tiny_scale():
    runs = {r.value: r for r in sweep_spec.expand(sweep_spec.load_spec("recipes"), "tiny")}
    assert set(runs) == {"scalerl", "deepseek_grpo", "qwen_dapo", "magistral", "minimax"}
    paper_default = recipes.recipe_binding(str(CONFIGS / "base.gin"), "train", "prompts_per_step")
    tiny_default = tiny("prompts_per_step")
    assert (paper_default, tiny_default) == (48, 16)
    got = {}
    for name, run in runs.items():
        recipe_pps = recipes.recipe_binding(str(CONFIGS / f"{name}.gin"), "train", "prompts_per_step")
        got[name] = effective(run, "prompts_per_step", tiny_default)
        assert abs(got[name] - recipe_pps * tiny_default / paper_default) <= 0.5, (name, recipe_pps, got[name])
        assert effective(run, "generations_per_prompt", tiny("generations_per_prompt")) == tiny("generations_per_prompt")
    # the DAPO and MiniMax recipes' 80-prompt batches (PAPER.md A.16) stay 5/3 of ScaleRL's 48
    assert got == {"scalerl": 16, "deepseek_grpo": 16, "qwen_dapo": 27, "magistral": 27, "minimax": 27}
    # at paper scale nothing is rewritten: the recipe file carries its own batch
    assert all(not any("per_step" in b for b in r.bindings) for r in sweep_spec.expand(sweep_spec.load_spec("recipes"), "paper"))


def test_tiny_batch_rule_rounds_and_scales_generations(tmp_path):
    (tmp_path / "big.gin").write_text("include 'base.gin'\ntrain.prompts_per_step = 128\ntrain.generations_per_prompt = 32\n")
    (tmp_path / "small.gin").write_text("train.prompts_per_step = 40\n")
    (tmp_path / "base.gin").write_text((CONFIGS / "base.gin").read_text())
    assert recipes.tiny_batch_bindings(str(tmp_path / "big.gin"), [TINY]) == [
        "train.prompts_per_step = 43", "train.generations_per_prompt = 16"]  # 128*16/48 = 42.7; 32*8/16
    assert recipes.tiny_batch_bindings(str(tmp_path / "small.gin"), [TINY]) == ["train.prompts_per_step = 13"]  # 13.3


def test_dapo_clip_reaches_eps_high_large_enough_to_show_A_falling():
    spec = sweep_spec.load_spec("dapo_clip")
    values = [float(v) for v in spec.values]
    assert {0.2, 0.26, 0.28} <= set(values)  # the values the paper names
    assert values == sorted(values) and max(values) >= 4.0 and sum(v >= 0.5 for v in values) >= 3
    runs = sweep_spec.expand(spec, "tiny")
    assert [r.name for r in runs] == [f"eps_high{v}-s0" for v in ("0.2", "0.26", "0.28", "0.5", "1.0", "4.0")]
    assert all('train.loss = "dapo"' in r.bindings and "losses.dapo.eps_low = 0.2" in r.bindings for r in runs)
    eps_high = [b for b in runs[-1].bindings if b.startswith("losses.dapo.eps_high")]
    assert eps_high[-1] == "losses.dapo.eps_high = 4.0"  # the last binding of it wins


def test_tiny_cpu_is_scalerl_with_emulated_bf16_fp32_head_and_tiny_interruptions():
    assert tiny("precision") == "bf16_fp32_head"
    assert tiny("length_control") == "interruption"
    lo, hi = tiny("thinking_min", "interruption"), tiny("thinking_max", "interruption")
    budget, phrase = tiny("answer_budget", "interruption"), tiny("phrase", "interruption")
    assert 0 < lo <= hi and tiny("max_tokens") == hi + budget <= 32
    lc = ForcedInterruption(thinking_min=lo, thinking_max=hi, answer_budget=budget, phrase=phrase)  # closes </think>
    assert lc.max_tokens(tiny("max_tokens")) == tiny("max_tokens")
    kwargs = tiny("task_kwargs")
    task = ArithmeticTask(seed=0, **kwargs)
    for p in task.train_problems()[:500]:
        gold = task.solution_text(p)
        assert gold.startswith("<think>") and task.verify(p, gold + "</s>").passed
        think_tokens = 1 + len(gold.split("</think>")[0]) - len("<think>") + 1  # char tokenizer: <think> + chars + </think>
        answer_tokens = len(gold.split("</think>")[1]) + 1  # + EOS
        assert think_tokens < lo, gold  # a correct completion closes its thinking before any interruption point
        assert answer_tokens <= budget, gold  # an interrupted sample has room for an answer
    # No-Positive-Resampling's pool lasts: the run draws at most ~3 epochs of it
    epochs = tiny("total_steps") * tiny("prompts_per_step") / kwargs["num_train"]
    assert 1.5 <= epochs <= 3.0, epochs


@pytest.mark.parametrize("sweep", ["recipes", "length_control"])
def test_tiny_interruption_overrides_match_tiny_cpu(sweep):
    """Sweeps whose recipe re-binds scalerl.gin's paper-size budgets put tiny_cpu.gin's back."""
    over = dict(b.split(" = ", 1) for b in sweep_spec.load_spec(sweep).tiny_overrides)
    for param in ("thinking_min", "thinking_max", "answer_budget", "phrase"):
        assert recipes.recipe_binding(TINY, "interruption", param) == eval(over[f"interruption.{param}"]), param  # noqa: S307
    rng = random.Random(0)
    assert ForcedInterruption(thinking_min=6, thinking_max=8, answer_budget=4, phrase="</think>").interruptions(1, rng, _Tok())


class _Tok:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]
