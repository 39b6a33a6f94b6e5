"""The trainer end to end: run directory contract, learner step, bad input, misbehaving verifiers."""

from __future__ import annotations

import argparse
import json

import gin
import pytest
import torch

from _helpers_trainer import read_jsonl, run_json, tiny_model, write_gin, write_user_task
from components.registry import UnknownComponentError
from components.trainer.config import ConfigError


@pytest.fixture(autouse=True)
def _fresh_gin():
    """Gin bindings are process-global: start and end every test with none."""
    import gin

    gin.clear_config()
    yield
    gin.clear_config()


torch.set_num_threads(1)

METRIC_FIELDS = {
    "step", "version", "compute_hours", "flops", "wall_s", "prompts", "generations", "tokens", "reward_mean",
    "pass_rate", "zero_variance_frac", "truncation_rate", "entropy", "loss", "grad_norm", "is_ratio_mean",
    "is_ratio_min", "is_ratio_max", "clip_frac", "lag_mean", "lag_max", "time_generate", "time_train",
    "time_sync", "time_wait", "logprob_gap_mean", "logprob_gap_max", "verifier_errors",
    "epoch", "cpu_hours", "contention", "contention_run", "procs", "eval_wall_s", "startup_s",
}
EVAL_FIELDS = {"step", "compute_hours", "flops", "pass_rate", "k", "prompts", "per_task", "eval_wall_s", "eval_compute_hours",
               "entropy", "drain_s", "drain_groups", "eval_training_groups"}
RUN_FIELDS = {"name", "sweep", "factor", "value", "recipe", "seed", "git_sha", "hardware", "status", "started", "finished"}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("trainer_model"))


# ---------------------------------------------------------------------------------------
# the learner step on hand-made rollouts (no processes)
def _rollouts(model, tokenizer, n_groups=3, G=4, T=5, seed=0):
    """Sample completions from `model` by hand, recording gen_logp like an engine would."""
    from components.engines.base import Completion
    from components.engines.logprobs import token_logprobs
    from components.trainer.rollout import Rollout

    g = torch.Generator().manual_seed(seed)
    rollouts = []
    for gi in range(n_groups):
        prompt = tokenizer.encode(f"{gi}+1=", add_special_tokens=False)
        comps, rewards = [], []
        for s in range(G):
            ids = list(prompt)
            toks, lps = [], []
            with torch.no_grad():
                for _ in range(T):
                    logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
                    tok = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))
                    lps.append(float(token_logprobs(logits, torch.tensor(tok))))
                    toks.append(tok)
                    ids.append(tok)
            comps.append(Completion(gi, s, list(prompt), toks, lps, [0] * T, [False] * T, "length"))
            rewards.append(1.0 if s % 2 == 0 else -1.0)
        rollouts.append(Rollout(order_id=gi, problem_id=f"p{gi}", completions=comps, rewards=rewards,
                                passed=[r > 0 for r in rewards]))
    return rollouts


def _learner(model_path, **overrides):
    from components.models import load_causal_lm, load_tokenizer
    from components.trainer.config import TrainConfig
    from components.trainer.learner import Learner

    settings = dict(lr=1e-2, warmup_steps=0, weight_decay=0.0, micro_batch_size=12, prompts_per_step=3,
                    generations_per_prompt=4, temperature=1.0)
    settings.update(overrides)
    cfg = TrainConfig(model_path=model_path, **settings)
    tok = load_tokenizer(model_path)
    model = load_causal_lm(model_path)
    return Learner(model, cfg, tok.pad_token_id, torch.device("cpu")), tok


def test_learner_micro_batches_sum_to_the_full_batch_gradient(model_path):
    from components.registry import load_builtin_components

    load_builtin_components()
    full, tok = _learner(model_path, micro_batch_size=12, grad_clip=0.0)
    micro, _ = _learner(model_path, micro_batch_size=5, grad_clip=0.0)  # 3 uneven micro-batches
    rollouts = _rollouts(full.model, tok)
    keep = [True] * len(rollouts)
    s_full = full.step(rollouts, keep)
    s_micro = micro.step(rollouts, keep)
    assert s_full["loss"] == pytest.approx(s_micro["loss"], rel=1e-5, abs=1e-7)
    assert s_full["grad_norm"] == pytest.approx(s_micro["grad_norm"], rel=1e-4)
    for (name, a), (_, b) in zip(full.model.named_parameters(), micro.model.named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)
    assert full.version == micro.version == 1
    # on-policy: the recomputed log-probs equal the recorded ones, so every IS ratio is 1
    assert s_full["is_ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert s_full["lag_max"] == 0 and s_full["clip_frac"] == 0.0
    assert s_full["entropy"] > 0


def test_learner_step_moves_logprobs_along_the_advantage(model_path):
    from components.engines.logprobs import sequence_logprobs
    from components.registry import load_builtin_components
    from components.trainer.rollout import collate

    load_builtin_components()
    learner, tok = _learner(model_path, loss="grpo", aggregation="sample_mean", advantage_norm="prompt")
    rollouts = _rollouts(learner.model, tok, seed=1)
    batch = collate(rollouts, tok.pad_token_id)

    def seq_logp():
        with torch.no_grad():
            lp = sequence_logprobs(learner.model, batch.input_ids, batch.attention_mask, batch.completion_start)
        return (lp * batch.mask).sum(1)  # [B]

    before = seq_logp()
    stats = learner.step(rollouts, [True] * len(rollouts))
    delta = seq_logp() - before
    positive = batch.rewards > 0
    assert delta[positive].mean() > 0 > delta[~positive].mean()
    assert stats["groups_trained"] == 3 and stats["trained_tokens"] == 3 * 4 * 5
    # a filtered-out group leaves the loss: no update when every group is dropped
    v = learner.version
    empty = learner.step(rollouts, [False] * len(rollouts))
    assert learner.version == v and empty["skipped_update"] == 1 and empty["prompts"] == 3


def test_optimizer_defaults_follow_the_paper(model_path):
    from components.trainer.config import TrainConfig
    from components.trainer.learner import make_optimizer

    cfg = TrainConfig(model_path=model_path)
    assert (cfg.adam_eps, cfg.lr, cfg.warmup_steps, cfg.weight_decay) == (1e-15, 5e-7, 100, 0.01)
    opt, sched = make_optimizer(torch.nn.Linear(2, 2), lr=1.0, betas=(0.9, 0.999), eps=1e-15, weight_decay=0.0, warmup_steps=4)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]  # linear warmup, then constant
    assert opt.param_groups[0]["eps"] == 1e-15


# ---------------------------------------------------------------------------------------
# bad input fails early and clearly (nothing is spawned)
def _prepare(tmp_path, model_path, **overrides):
    from experiments.train import prepare

    return prepare([write_gin(tmp_path / "bad.gin", model_path, **overrides)])


@pytest.mark.parametrize(
    "override, match",
    [
        (dict(train__loss='"cispoo"'), "Unknown loss 'cispoo'.*cispo"),
        (dict(train__aggregation='"prompt_avg"'), "Unknown loss aggregation"),
        (dict(train__advantage_norm='"group"'), "Unknown advantage normalization"),
        (dict(train__curriculum='["uniform", "zero_varience_filter"]'), "Unknown curriculum 'zero_varience_filter'"),
        (dict(train__off_policy='"pipeline"'), "Unknown off-policy scheme.*pipeline_rl"),
        (dict(train__precision='"fp16"'), "Unknown precision policy"),
        (dict(train__length_control='"interrupt"'), "Unknown length control"),
        (dict(train__engine='"vllm2"'), "Unknown engine"),
        (dict(train__task='"arithmatic"'), "Unknown task"),
    ],
)
def test_unknown_component_names(tmp_path, model_path, override, match):
    with pytest.raises(UnknownComponentError, match=match):
        _prepare(tmp_path, model_path, **override)


@pytest.mark.parametrize(
    "override, match",
    [
        (dict(train__micro_batch_size="64"), r"micro_batch_size \(64\) is larger than the step batch"),
        (dict(train__generations_per_prompt="1", train__micro_batch_size="1"), "train.generations_per_prompt = 1 is out of range: must be an integer >= 2"),
        (dict(train__prompts_per_step="0"), "train.prompts_per_step = 0 is out of range: must be an integer >= 1"),
        (dict(train__temperature="0.0"), "train.temperature = 0.0 is out of range: must be > 0"),
        (dict(train__adam_betas="(0.9, 1.5)"), "adam_betas"),
        (dict(pipeline_rl__k="0", train__off_policy='"pipeline_rl"'), "pipeline_rl.k = 0 is out of range: must be an integer >= 1"),
        (dict(train__curriculum='["uniform", "no_positive_resampling"]'), "two prompt samplers"),
    ],
)
def test_inconsistent_settings(tmp_path, model_path, override, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        _prepare(tmp_path, model_path, **override)


def test_missing_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"model\.path .*does not exist \(a local path\)"):
        _prepare(tmp_path, str(tmp_path / "no_such_model"))
    from experiments.train import prepare

    bare = tmp_path / "bare.gin"
    bare.write_text('train.task = "arithmetic"\n')
    with pytest.raises(ConfigError, match="model.path is not set"):
        prepare([str(bare)])


def test_unreadable_dataset(tmp_path, model_path):
    with pytest.raises(ConfigError, match="could not be loaded"):
        _prepare(tmp_path, model_path, train__task='"math_file"', data__path=json.dumps(str(tmp_path / "missing.jsonl")))
    bad = tmp_path / "bad.jsonl"
    bad.write_text("this is not json\n")
    with pytest.raises(ConfigError, match="could not be loaded"):
        _prepare(tmp_path, model_path, train__task='"math_file"', train__task_kwargs=json.dumps({"path": str(bad)}))


def test_missing_config_file_and_gin_typo(tmp_path, model_path):
    from experiments.train import prepare

    with pytest.raises(FileNotFoundError, match="does not exist"):
        prepare([str(tmp_path / "nope.gin")])
    with pytest.raises(ValueError, match="learning_rate"):
        _prepare(tmp_path, model_path, train__learning_rate="1e-3")


def test_cli_reports_bad_input_in_one_line(tmp_path, model_path, capsys):
    from experiments import train as train_cli

    parser = argparse.ArgumentParser()
    train_cli.add_arguments(parser)
    gin_file = write_gin(tmp_path / "bad.gin", model_path, train__loss='"nope"')
    run_dir = tmp_path / "run"
    rc = train_cli.main(parser.parse_args([gin_file, "--run-dir", str(run_dir), "--no-progress"]))
    err = capsys.readouterr().err
    assert rc == 2 and "Unknown loss 'nope'" in err
    assert not run_dir.exists()  # a refused config leaves no run directory (issue 33: none in `scalerl status`)
    # a run directory that exists already (a sweep's run, made at submission) records why it never started
    from experiments.train import run_training

    run_dir.mkdir()
    with pytest.raises(KeyError, match="Unknown loss 'nope'"):
        run_training([gin_file], [], str(run_dir), progress=False)
    info = run_json(run_dir)
    assert info["status"] == "failed" and "Unknown loss" in info["error"]
    assert (run_dir / "error.txt").exists()


# ---------------------------------------------------------------------------------------
# end to end
@pytest.mark.slow
def test_run_directory_contract(tmp_path, model_path):
    from experiments.train import run_training

    gin_file = write_gin(tmp_path / "run.gin", model_path, train__total_steps="4", train__eval_every="2")
    run_dir = tmp_path / "sweepname" / "runname"
    info_in = {"name": "runname", "sweep": "sweepname", "factor": "loss", "value": "cispo", "recipe": "tiny", "seed": 0}
    # torch.max_cache_tokens is read by the generator's engine only, never by learner-0
    assert run_training([gin_file], ["train.lr = 2e-3", "torch.max_cache_tokens = 4096"], str(run_dir),
                        run_info=info_in, progress=False) == "done"

    info = run_json(run_dir)
    assert RUN_FIELDS <= set(info)
    assert {k: info[k] for k in info_in} == info_in
    assert info["status"] == "done"
    assert info["hardware"] == {"device": "cpu", "count": 2, "learner_ranks": 1, "num_generators": 1,
                                "gpus_per_generator": 0, "processes": 2}
    assert info["attn_implementation"] == "sdpa"  # the attention kernel the learner used
    assert info["finished"] >= info["started"]

    config = (run_dir / "config.gin").read_text()
    assert "train.lr = 0.002" in config and "model.path" in config  # the operative config
    assert "torch.max_cache_tokens = 4096" in config  # with the sections only a generator read
    assert "torch.max_batch_size = " in config  # (the engine's defaults too, as gin lists them)
    gin.clear_config()
    gin.parse_config(config)  # and it parses back
    gin.clear_config()

    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for m in metrics:
        missing = METRIC_FIELDS - set(m)
        assert not missing, missing
        assert m["compute_hours"] == pytest.approx(m["wall_s"] * 2 / 3600, rel=1e-6)  # 2 processes on CPU
        assert m["prompts"] == 4 and m["generations"] == 16
        assert set(m["procs"]) == {"learner-0", "generator-0"} and 0.0 <= m["contention_run"] <= 1.0
        assert m["cpu_hours"] > 0 and m["epoch"] == pytest.approx(m["step"] * 4 / 120)
    assert all(b["flops"] > a["flops"] for a, b in zip(metrics, metrics[1:]))
    assert all(b["wall_s"] > a["wall_s"] for a, b in zip(metrics, metrics[1:]))

    evals = read_jsonl(run_dir / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2, 4]  # R0 before any training
    for e in evals:
        assert EVAL_FIELDS <= set(e) and e["k"] == 2 and e["prompts"] == 4
        assert set(e["per_task"]) == {"arithmetic"} and 0.0 <= e["pass_rate"] <= 1.0
    assert evals[0]["compute_hours"] <= metrics[0]["compute_hours"]
    # evaluation is not billed as training: its time is logged apart and the training clock paused
    assert all(e["eval_wall_s"] > 0 and e["eval_compute_hours"] == pytest.approx(e["eval_wall_s"] * 2 / 3600) for e in evals)
    assert metrics[-1]["eval_wall_s"] == pytest.approx(sum(e["eval_wall_s"] for e in evals[:-1]), rel=1e-6)
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_00000002", "step_00000004"]
    # the final policy in Hugging Face format
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(str(run_dir / "final"), local_files_only=True)
    assert final.config.num_hidden_layers == 1


@pytest.mark.slow
def test_misbehaving_verifier_never_stops_the_run(tmp_path, model_path):
    """A verifier that raises (every 5th call) or hangs (every 7th) marks that sample failed and is counted."""
    from experiments.train import run_training

    module = write_user_task(tmp_path)
    gin_file = write_gin(
        tmp_path / "verifier.gin", model_path, imports=(module,),  # the user's module, imported by gin
        train__task='"trainer_test_arithmetic"',
        train__task_kwargs='{"num_train": 120, "num_eval": 8, "max_operand": 12, "operators": "+", "raise_every": 5, "hang_every": 7}',
        train__verifier_timeout_s="0.2", train__total_steps="2", train__eval_every="100", train__checkpoint_every="100",
    )
    assert run_training([gin_file], [], str(tmp_path / "run"), progress=False) == "done"
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["verifier_errors"] >= 16 // 5 for m in metrics)  # raised + timed-out samples, counted
    assert all(m["reward_mean"] == -1.0 or m["reward_mean"] <= 1.0 for m in metrics)
    evals = read_jsonl(tmp_path / "run" / "eval.jsonl")
    assert evals[0]["eval_verifier_errors"] > 0


@pytest.mark.slow
def test_generator_failure_marks_the_run_failed(tmp_path, model_path):
    """An exception inside the generator process ends the run as failed with its traceback, not a hang."""
    from experiments.train import run_training

    module = write_user_task(tmp_path)
    gin_file = write_gin(
        tmp_path / "broken.gin", model_path, imports=(module,),
        train__engine='"trainer_test_failing_torch"', train__eval_engine='"torch"',  # only the generator fails
        train__eval_every="100", train__queue_timeout_s="120",
    )
    status = run_training([gin_file], [], str(tmp_path / "run"), progress=False)
    info = run_json(tmp_path / "run")
    assert status == "failed" and info["status"] == "failed"
    assert "GeneratorError" in info["error"] and "engine blew up mid-generation" in info["error"]
    assert "Traceback" in (tmp_path / "run" / "error.txt").read_text()
    assert read_jsonl(tmp_path / "run" / "metrics.jsonl") == []  # it never completed a step


@pytest.mark.slow
@pytest.mark.parametrize("budget", [{"train__compute_budget_hours": "1e-7"}, {"train__compute_budget_flops": "1.0"}])
def test_compute_budget_stops_the_run(tmp_path, model_path, budget):
    """train.compute_budget_hours / train.compute_budget_flops (the tiny scale's stopping rule) ends
    a run early (evaluated and checkpointed), status done."""
    from experiments.train import run_training

    gin_file = write_gin(tmp_path / "budget.gin", model_path, train__total_steps="50", **budget,
                         train__eval_every="100", train__checkpoint_every="100")
    assert run_training([gin_file], [], str(tmp_path / "run"), progress=False) == "done"
    assert [m["step"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1]
    assert [e["step"] for e in read_jsonl(tmp_path / "run" / "eval.jsonl")] == [0, 1]
    assert (tmp_path / "run" / "checkpoints" / "step_00000001").is_dir()
    assert run_json(tmp_path / "run")["status"] == "done"


def test_one_trainer_per_run_directory(tmp_path, model_path):
    """A second trainer on a run directory that is being trained fails clearly instead of interleaving logs."""
    from components.trainer.run_owner import RunDirBusyError, lock_run_dir
    from experiments.train import run_training

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    held = lock_run_dir(run_dir)  # as a running trainer holds it
    try:
        with pytest.raises(RunDirBusyError, match="being trained by another process"):
            run_training([write_gin(tmp_path / "a.gin", model_path)], [], str(run_dir), progress=False)
    finally:
        held.close()


def test_a_filesystem_without_flock_is_not_a_busy_run_directory(tmp_path, monkeypatch, caplog):
    """Lustre without -o flock answers ENOSYS: the run goes on (with a warning), it is not 'busy'."""
    import errno
    import fcntl
    import os

    from components.trainer.run_owner import RunDirBusyError, lock_run_dir

    def flock(fd, op, code=errno.ENOSYS):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fcntl, "flock", flock)
    with caplog.at_level("WARNING", logger="scalerl.train"):
        lock_run_dir(tmp_path).close()
    assert "cannot be locked (ENOSYS" in caplog.text
    monkeypatch.setattr(fcntl, "flock", lambda fd, op: flock(fd, op, errno.EWOULDBLOCK))
    with pytest.raises(RunDirBusyError, match="being trained by another process"):
        lock_run_dir(tmp_path)


@pytest.mark.slow
def test_scalerl_composition_end_to_end(tmp_path, model_path):
    """ScaleRL's ingredients at once on the tiny model: PipelineRL, CISPO, prompt_mean, batch
    advantages, No-Positive-Resampling, bf16 body with FP32 head on both sides, forced
    interruptions (forced tokens are excluded from the loss)."""
    from experiments.train import run_training

    gin_file = write_gin(
        tmp_path / "scalerl_tiny.gin", model_path,
        train__off_policy='"pipeline_rl"', pipeline_rl__k="2",
        # (no zero-variance filter here: an untrained model fails every prompt, so it would filter
        # every group and leave the forced-token check below with nothing to check)
        train__curriculum='["no_positive_resampling"]',
        train__precision='"bf16_fp32_head"', train__length_control='"interruption"',
        interruption__thinking_min="2", interruption__thinking_max="4", interruption__answer_budget="3",
        interruption__phrase='" ok </think>"',
        # an untrained model never opens <think>: count every sample as thinking until it samples </think>
        interruption__think_open="None",
        train__total_steps="4", train__eval_every="4", train__checkpoint_every="4",
    )
    assert run_training([gin_file], [], str(tmp_path / "run"), progress=False) == "done"
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for m in metrics:
        # sampled budget: at most thinking_max + answer_budget tokens, plus the forced phrase
        assert m["completion_len_mean"] <= 4 + 3 + len(" ok ") + 1
        if m["groups_trained"] == m["prompts"]:  # nothing filtered: every sampled token is trained on ...
            assert m["trained_tokens"] == m["tokens"] - m["forced_tokens"]  # ... and no forced one
        assert m["lag_max"] is None or m["lag_max"] <= 2
    assert sum(m["forced_tokens"] for m in metrics) > 0
    assert any(m["groups_trained"] == m["prompts"] for m in metrics)
    assert [e["step"] for e in read_jsonl(tmp_path / "run" / "eval.jsonl")] == [0, 4]


@pytest.mark.slow
def test_downstream_benchmarks_run_during_training_on_a_generator(tmp_path, model_path):
    """train.downstream_every + train.downstream_benchmarks: mean@k and pass@k lines in eval.jsonl,
    evaluated on a generator off the training clock, kept out of the held-out curve."""
    from experiments.train import run_training

    bench = tmp_path / "mini.jsonl"
    bench.write_text("".join(json.dumps({"problem": f"{a}+{b}=", "answer": str(a + b)}) + "\n" for a, b in [(1, 2), (3, 4), (5, 6)]))
    gin_file = write_gin(tmp_path / "down.gin", model_path, train__total_steps="4", train__eval_every="2",
                         train__downstream_every="2", train__downstream_benchmarks=json.dumps([str(bench)]),
                         train__downstream_k="4")
    assert run_training([gin_file], [], str(tmp_path / "run"), progress=False) == "done"
    rows = read_jsonl(tmp_path / "run" / "eval.jsonl")
    bench_rows = [r for r in rows if "benchmark" in r]
    held_out = [r for r in rows if "benchmark" not in r]
    assert [r["step"] for r in held_out] == [0, 2, 4]
    assert [r["step"] for r in bench_rows] == [0, 2, 4]
    for r in bench_rows:
        assert r["k"] == 4 and r["prompts"] == 3 and "pass_rate" not in r
        assert set(r["pass@k"]) >= {"1", "4"} and 0.0 <= r["mean@k"] <= 1.0
        assert r["pass@k"]["1"] == pytest.approx(r["mean@k"])  # pass@1 is mean@k
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    # both kinds of evaluation are off the training clock
    assert metrics[-1]["eval_wall_s"] >= sum(r["eval_wall_s"] for r in held_out[:-1])


@pytest.mark.slow
def test_trackers_mirror_the_trainers_logs_end_to_end(tmp_path, model_path):
    """train.trackers through the real trainer: TensorBoard holds metrics.jsonl's values, samples.jsonl
    has a few completions every train.samples_every steps, run.json keeps its fields."""
    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from components.trainer.tracking import tensorboard_dir
    from experiments.train import run_training

    run_dir = tmp_path / "sweep" / "run"
    gin_file = write_gin(tmp_path / "tb.gin", model_path, train__total_steps="4", train__eval_every="2",
                         train__trackers='["tensorboard"]', train__samples_every="2", train__samples_per_log="2")
    assert run_training([gin_file], [], str(run_dir), progress=False) == "done"
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    acc = EventAccumulator(str(tensorboard_dir(run_dir)), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    got = {e.step: e.value for e in acc.Scalars("train/pass_rate")}
    assert got == {m["step"]: float(np.float32(m["pass_rate"])) for m in metrics}
    assert {e.step for e in acc.Scalars("eval/pass_rate")} == {0, 2, 4}
    samples = read_jsonl(run_dir / "samples.jsonl")
    assert sorted({s["step"] for s in samples}) == [2, 4] and all("completion" in s and "reward" in s for s in samples)
    assert run_json(run_dir)["status"] == "done"


def test_operative_configs_of_learner_and_generators_merge_into_one_that_parses():
    """config.gin of a run: learner-0's operative config plus the sections only generators read."""
    from components.trainer.runlog import merge_operative_configs

    with gin.unlock_config():
        gin.clear_config()

    def operative(bindings: str, call) -> str:
        gin.clear_config()
        gin.parse_config(bindings)
        call()
        text = gin.operative_config_str()
        gin.clear_config()
        return text

    @gin.configurable("merge_learner_part")
    def learner_part(lr=1.0, steps=2):
        return lr, steps

    @gin.configurable("merge_engine_part")
    def engine_part(cache=8, batch=4):
        return cache, batch

    both = "SIZE = 3\nLR = 0.5\nmerge_learner_part.lr = %LR\nmerge_engine_part.cache = %SIZE\n"
    learner = operative(both, learner_part)
    generator = operative(both, lambda: (learner_part(), engine_part()))
    assert "merge_engine_part" not in learner and "merge_engine_part.cache = %SIZE" in generator
    assert "LR = 0.5" in learner and "SIZE = 3" not in learner  # both have macros: merged one by one

    merged = merge_operative_configs(learner, [generator, generator])
    assert merge_operative_configs(learner, []) == learner  # one process: gin's own text, unchanged
    assert merged.count("# Parameters for merge_learner_part:") == 1 and merged.count("# Macros:") == 1
    assert merged.index("# Macros:") < merged.index("merge_engine_part") < merged.index("merge_learner_part")
    assert "SIZE = 3" in merged and merged.count("LR = 0.5") == 1
    gin.parse_config(merged)  # it parses back, with the generator-only binding and its macro
    assert engine_part() == (3, 4) and learner_part() == (0.5, 2)
    assert merge_operative_configs(learner, [generator]) == merge_operative_configs(generator, [learner])
    gin.clear_config()


def test_drain_training_decodes_the_sequences_in_flight_to_their_end():
    """The generator's answer to the hub's "drain": every in-flight group finished and handed on, the
    engine time billed to the generator's busy clock, nothing left unfinished."""
    from components.trainer.generator import drain_training

    class Engine:  # finishes group g at decode step g + 1
        def __init__(self, groups: int):
            self.left = list(range(groups))
            self.steps = 0

        def has_unfinished(self):
            return bool(self.left)

        def step(self):
            self.steps += 1
            done = [g for g in self.left if g + 1 == self.steps]
            self.left = [g for g in self.left if g + 1 != self.steps]
            return done

    engine, handed, busy = Engine(3), [], [0.0]
    assert drain_training(engine, handed.append, busy) == 3
    assert handed == [0, 1, 2] and not engine.has_unfinished() and engine.steps == 3 and busy[0] > 0.0
    assert drain_training(Engine(0), handed.append, busy) == 0 and handed == [0, 1, 2]


@pytest.mark.slow
def test_pipeline_rl_evaluations_hold_no_training_decoding(tmp_path, model_path):
    """pipeline_rl(4) with two generators: the in-flight training sequences are decoded on the
    training clock before each evaluation, so no training group finishes on the evaluation's time."""
    from experiments.train import run_training

    gin_file = write_gin(
        tmp_path / "pipe.gin", model_path, train__off_policy='"pipeline_rl"', pipeline_rl__k="4",
        train__num_generators="2", train__max_tokens="24", train__total_steps="6", train__eval_every="2",
        train__checkpoint_every="6",
    )
    assert run_training([gin_file], [], str(tmp_path / "run"), progress=False) == "done"
    evals = read_jsonl(tmp_path / "run" / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2, 4, 6]
    assert [e["eval_training_groups"] for e in evals] == [0, 0, 0, 0]
    assert all(e["eval_wall_s"] > 0 and e["drain_s"] >= 0 for e in evals)
    assert evals[0]["drain_groups"] == 0 and sum(e["drain_groups"] for e in evals[1:]) > 0  # there was work in flight
    assert [m["step"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
