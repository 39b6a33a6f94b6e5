"""The small testbed (issue 40 items 4, 5): the `stories` task, its word-level tokenizer, `--scale
small` and a study that runs each identical configuration once."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from components.tasks import make_task
from components.tasks.stories import MAX_STEPS, MAX_VALUE, StoryTask


def _task(**kw):
    return make_task("stories", seed=0, num_train=300, num_eval=60, **kw)


def _replay(problem) -> int:
    """The answer, recomputed from the prompt's words alone (independently of the task's bookkeeping)."""
    words = problem.prompt.split()
    count = int(words[2])
    gains = {"finds", "buys", "picks", "wins", "makes", "gets"}
    for i, w in enumerate(words):
        if re.fullmatch(r"#\d+", w):
            verb, amount = words[i + 2], int(words[i + 3])
            count += amount if verb in gains else -amount
    return count


def test_stories_answers_scratchpads_and_verifier():
    t = _task()
    for p in t.train_problems()[:100] + t.eval_problems()[:30]:
        assert p.answer == _replay(p)
        gold = t.solution_text(p)
        assert gold.startswith("<think>") and gold.endswith(f"</think> {p.answer}")
        assert t.verify(p, gold + " </s>").passed
        assert not t.verify(p, gold.rsplit(" ", 1)[0] + f" {p.answer + 1}").passed
        assert not t.verify(p, gold.split("</think>")[0]).passed  # thinking never closed
        assert 0 <= p.answer <= 60 and 2 <= p.meta["steps"] <= 8
        # every running count in the scratchpad stays in range
        assert all(0 <= int(x) <= 60 for x in re.findall(r"= (\d+)", gold))


def test_the_split_is_decided_by_the_text_so_difficulty_settings_never_leak():
    """A warm start on easier stories and RL on harder ones, same seed: no held-out story of one is a
    training story of the other."""
    easy = make_task("stories", seed=3, num_train=3000, num_eval=300, max_steps=3, max_delta=3, max_value=10,
                     num_names=2, num_items=1)
    hard = make_task("stories", seed=3, num_train=3000, num_eval=300, max_steps=4, max_delta=3, max_value=10,
                     num_names=2, num_items=1)
    for a, b in ((easy, hard), (hard, easy)):
        train = {p.prompt for p in a.train_problems()}
        held = {p.prompt for p in b.eval_problems()}
        assert train.isdisjoint(held)
    # the small vocabulary above makes overlap between the two tasks likely: the test is not vacuous
    assert {p.prompt for p in easy.train_problems()} & {p.prompt for p in hard.train_problems()}
    assert len({p.prompt for p in hard.train_problems() + hard.eval_problems()}) == 3300


def test_the_vocabulary_is_one_for_every_setting_and_above_4k_words():
    a, b = _task(max_steps=3), _task(max_steps=10, max_value=99)
    assert a.vocabulary() == b.vocabulary() and len(set(a.vocabulary())) == len(a.vocabulary()) >= 4096
    words = set(a.vocabulary())
    for p in b.train_problems()[:50]:
        assert set(p.prompt.split()) <= words and set(b.solution_text(p).split()) - {"<think>", "</think>"} <= words


@pytest.mark.parametrize("kw,match", [
    ({"max_steps": MAX_STEPS + 1}, "max_steps"), ({"min_steps": 5, "max_steps": 4}, "min_steps"),
    ({"max_value": MAX_VALUE + 1}, "max_value"), ({"others": 1.5}, "others"), ({"held_out_share": 0.0}, "held_out"),
])
def test_bad_knobs_are_refused_naming_them(kw, match):
    with pytest.raises(ValueError, match=match):
        StoryTask(**kw)


def test_the_word_tokenizer_round_trips_prompts_and_completions(tmp_path):
    from components.models import build_tiny_policy, load_tokenizer
    from components.tasks import render_prompt

    t = _task()
    build_tiny_policy(tmp_path / "m", hidden_size=16, num_layers=1, num_heads=2, vocabulary=t.vocabulary(),
                      tie_word_embeddings=True)
    tok = load_tokenizer(tmp_path / "m")
    assert len(tok) >= 4096 + 8
    p = t.eval_problems()[0]
    ids = tok.encode(t.solution_text(p), add_special_tokens=False)
    assert len(ids) == len(t.solution_text(p).split())  # one token per word
    assert tok.unk_token_id not in ids
    assert t.verify(p, tok.decode(ids + [tok.eos_token_id], skip_special_tokens=False)).passed
    prompt = render_prompt(p, tok)
    assert tok.unk_token_id not in prompt and tok.decode(prompt).split()[1:-1] == p.prompt.split()


def test_scale_small_maps_every_shipped_sweep_onto_small_cpu():
    from experiments.sweep_spec import SMALL_SCALE_BINDINGS, expand, load_spec, select_runs

    for name in ("loss_type", "fp32_head", "off_policy", "batch_size", "length_control", "scalerl_seeds"):
        for r in expand(load_spec(name), "small"):
            assert Path(r.config_files[0]).name == "small_cpu.gin", (name, r.config_files)
            assert r.bindings[:2] == SMALL_SCALE_BINDINGS
    off = {r.name: r.bindings for r in expand(load_spec("off_policy"), "small")}
    assert set(off) == {"ppo_off_policy-k1-s0", "ppo_off_policy-k8-s0", "pipeline_rl-k8-s0"}  # the paper's k
    assert "pipeline_rl.k = 8" in off["pipeline_rl-k8-s0"]
    bs = {r.name: r for r in expand(load_spec("batch_size"), "small")}
    assert set(bs) == {"bs128-s0", "bs192-s0", "bs512-s0"} and bs["bs512-s0"].paper_name == "bs2048"
    (seed_run,) = expand(load_spec("scalerl_seeds"), "small")[:1]
    assert seed_run.bindings == SMALL_SCALE_BINDINGS + ("train.seed = 0",)  # small_cpu.gin is the ScaleRL recipe
    with pytest.raises(Exception, match="unknown scale"):
        select_runs("loss_type", "medium")


def test_identical_configurations_across_sweeps_run_once(tmp_path):
    """The baseline is in seven sweeps at small scale and ScaleRL in three: the study runs each once
    per seed and every other sweep takes its logs, recording where they came from."""
    import argparse

    from experiments import reproduce as R
    from experiments.study_runs import SHARED_ACTION, SHARED_KEY, materialize_shared, plan_study

    parser = argparse.ArgumentParser()
    R.add_arguments(parser)
    args = parser.parse_args(["--scale", "small", "--seeds", "2", "--executor", "local",
                              "--sweeps", "loss_type,fp32_head,batch_size,scalerl_seeds,length_control"])
    args.runs, args.out = tmp_path / "work", tmp_path / "out"
    R._check_args(args)
    plans = plan_study(args, act=False)
    by = {(p.run.sweep, p.run.name): p for sp in plans for p in sp.planned}
    shared = {k: p for k, p in by.items() if p.action == SHARED_ACTION}
    assert {k for k in shared if k[1].endswith("-s0")} == {
        ("fp32_head", "bf16-s0"), ("scalerl_seeds", "scalerl-s0"), ("length_control", "interruption-s0")}
    assert "identical to loss_type/dapo-s0" in shared[("fp32_head", "bf16-s0")].reason
    assert "identical to batch_size/bs128-s0" in shared[("scalerl_seeds", "scalerl-s0")].reason
    assert by[("loss_type", "dapo-s0")].action == "submit" and by[("length_control", "length_penalty-s0")].action == "submit"
    # once the source has ended, the shared run gets its logs under its own name
    src = tmp_path / "work" / "loss_type" / "dapo-s0"
    src.mkdir(parents=True)
    (src / "run.json").write_text(json.dumps({"name": "dapo-s0", "sweep": "loss_type", "status": "done", "seed": 0}))
    (src / "metrics.jsonl").write_text('{"step": 1}\n')
    (src / "eval.jsonl").write_text('{"step": 0, "pass_rate": 0.2}\n')
    (src / "config.gin").write_text("train.seed = 0\n")
    filled = materialize_shared(plans, tmp_path / "work")
    assert filled == ["fp32_head/bf16-s0"]  # the others' sources have not run
    dest = tmp_path / "work" / "fp32_head" / "bf16-s0"
    info = json.loads((dest / "run.json").read_text())
    assert info["sweep"] == "fp32_head" and info["name"] == "bf16-s0" and info[SHARED_KEY] == "loss_type/dapo-s0"
    assert info["status"] == "done" and (dest / "eval.jsonl").read_text() == (src / "eval.jsonl").read_text()


@pytest.mark.parametrize("key", ["tiny_names", "small_names"])
def test_a_bad_scale_name_is_refused_naming_its_own_setting(key):
    from experiments.sweep_spec import SweepError, spec_from_dict

    raw = {"name": "s", "base": "tiny_cpu.gin", "factor": "train.loss", "values": ["cispo", "dapo"],
           key: {"cispo": "bad name!"}}
    with pytest.raises(SweepError, match=rf"sweep\.{key} value 'bad name!'"):
        spec_from_dict(raw)
