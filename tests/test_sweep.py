"""Sweep specs, run naming, validation, the skip/resume plan and the local/debug executors.

The jobs here call a stand-in trainer (tests/_helpers_sweep.py) so the launcher's mechanics
are tested in seconds; tests/test_slurm.py runs the real trainer on the real cluster.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import recipes, run_config, run_state, slurm, submission, sweep_spec
from experiments import run_state, slurm, submission
from experiments import status as S

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
FAKE = "_helpers_sweep:fake_training"
SHIPPED = sorted(p.stem for p in (REPO / "experiments" / "sweeps").glob("*.gin"))

# Every ablation of PAPER.md §3 that the issue names -> its shipped spec.
PAPER_ABLATIONS = {
    "off-policy scheme": "off_policy", "off-policy k": "pipeline_k", "loss type": "loss_type",
    "fp32 head": "fp32_head", "loss aggregation": "loss_aggregation", "advantage norm": "advantage_norm",
    "zero-variance filtering": "zero_variance_filtering", "no-positive-resampling": "no_positive_resampling",
    "length control": "length_control", "batch size": "batch_size", "generation length": "generation_length",
    "generations per prompt": "generations_per_prompt", "dapo clip": "dapo_clip", "cispo clip": "cispo_clip",
    "gspo clip": "gspo_clip", "leave-one-out": "leave_one_out", "recipes": "recipes",
}


@pytest.fixture(autouse=True)
def _tests_on_path(monkeypatch):
    # the stand-in trainer must be importable in job subprocesses too
    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), str(REPO), os.environ.get("PYTHONPATH", "")]))


def write_fake_sweep(tmp: Path, *, values=("dapo", "gspo", "cispo"), extra: str = "") -> Path:
    from _helpers_sweep import FAKE_RECIPE

    (tmp / "recipe.gin").write_text(FAKE_RECIPE)
    spec = tmp / "fake.gin"
    spec.write_text(
        'sweep.name = "fake"\n'
        'sweep.base = "recipe.gin"\n'
        'sweep.tiny_base = "recipe.gin"\n'
        'sweep.factor = "train.loss"\n'
        f"sweep.values = {json.dumps(list(values))}\n"
        # the tiny scale's step cap (sweep_spec.TINY_SCALE_BINDINGS) would outlast the fake recipe's 3 steps
        'sweep.tiny_overrides = ["train.total_steps = 3"]\n'
        "sweep.seeds = [0]\n" + extra
    )
    return spec


# ------------------------------------------------------------------------------- specs
def test_every_paper_ablation_has_a_spec():
    missing = {k: v for k, v in PAPER_ABLATIONS.items() if v not in SHIPPED}
    assert not missing, f"no sweep spec for {missing}"


def _expand_or_skip(spec, scale):
    return sweep_spec.expand(spec, scale)  # every recipe a spec names must exist: no skip


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_spec_expands_and_validates_at_tiny_scale(name):
    spec = sweep_spec.load_spec(name)
    assert spec.name == name
    runs = _expand_or_skip(spec, "tiny")
    assert len(runs) >= 2 * len(spec.seeds) or spec.factor == "recipe"
    assert len({r.name for r in runs}) == len(runs)
    for r in runs:
        assert r.bindings[-1] == f"train.seed = {r.seed}"
        assert all(Path(f).is_file() for f in r.config_files)
    run_config.validate_runs(runs)  # every binding is a real configurable/parameter and every component registered


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_spec_expands_at_paper_scale(name):
    spec = sweep_spec.load_spec(name)
    runs = _expand_or_skip(spec, "paper")
    run_config.validate_runs(runs)
    tiny = sweep_spec.expand(spec, "tiny")
    # a tiny run's name says what ran (k1 for the paper's k4); its paper_name maps it back one to one
    assert [r.name for r in runs] == [(f"{r.paper_name}-s{r.seed}" if r.paper_name else r.name) for r in tiny]


def test_loss_type_spec_runs_one_run_per_loss_with_its_binding():
    runs = sweep_spec.expand(sweep_spec.load_spec("loss_type"), "tiny")
    assert [r.name for r in runs] == ["dapo-s0", "gspo-s0", "cispo-s0"]
    for r, loss in zip(runs, ("dapo", "gspo", "cispo")):
        assert f'train.loss = "{loss}"' in r.bindings
        assert r.run_info() == {"name": f"{loss}-s0", "sweep": "loss_type", "factor": "train.loss", "value": loss,
                                "recipe": "tiny_cpu+baseline", "seed": 0}
        # the factor binding comes after the baseline overlay, so it wins
        assert Path(r.config_files[-1]).name == "baseline.gin"


def test_gin_state_is_untouched_by_spec_parsing():
    import gin

    gin.clear_config()
    gin.parse_config('train.lr = 0.5')
    sweep_spec.load_spec("leave_one_out")
    assert "train.lr = 0.5" in gin.config_str()
    gin.clear_config()


def test_binding_order_and_tiny_mapping():
    spec = sweep_spec.parse_spec_text(
        'sweep.base = "tiny_cpu.gin"\nsweep.factor = "pipeline_rl.k"\nsweep.values = [4, 8]\n'
        'sweep.tiny_values = [1, 2]\nsweep.overrides = ["train.lr = 0.1"]\n'
        'sweep.tiny_overrides = ["train.total_steps = 2"]\nsweep.seeds = [3, 4]\n', default_name="k")
    paper = sweep_spec.expand(spec, "paper")
    tiny = sweep_spec.expand(spec, "tiny")
    assert [r.name for r in paper] == ["k4-s3", "k4-s4", "k8-s3", "k8-s4"]
    assert paper[0].bindings == ("train.lr = 0.1", "pipeline_rl.k = 4", "train.seed = 3")
    assert tiny[0].bindings == (*sweep_spec.TINY_SCALE_BINDINGS, "train.lr = 0.1", "pipeline_rl.k = 1",
                                "train.total_steps = 2", "train.seed = 3")
    assert tiny[3].value == 2 and paper[3].value == 8
    # at tiny scale the name says the value that ran; run.json keeps the paper's name
    assert [r.name for r in tiny] == ["k1-s3", "k1-s4", "k2-s3", "k2-s4"]
    assert tiny[0].run_info()["paper_name"] == "k4" and "paper_name" not in paper[0].run_info()


def test_every_tiny_run_has_the_tiny_compute_budget_and_a_spec_may_change_it():
    """The tiny scale gives every run one training compute budget in FLOPs (the paper's equal budget
    per forward ablation; FLOPs reproduce, wall-clock does not), with the step count only a safety
    cap; the paper scale adds none; a spec's tiny_overrides come after it."""
    spec = sweep_spec.parse_spec_text('sweep.base = "tiny_cpu.gin"\nsweep.factor = "train.loss"\n'
                             'sweep.values = ["dapo"]\n', default_name="b")
    (tiny,) = sweep_spec.expand(spec, "tiny")
    (paper,) = sweep_spec.expand(spec, "paper")
    assert sweep_spec.TINY_SCALE_BINDINGS == ("train.compute_budget_flops = 5e+12", "train.total_steps = 5000")
    assert set(sweep_spec.TINY_SCALE_BINDINGS) <= set(tiny.bindings)
    assert not any("compute_budget" in b or "total_steps" in b for b in paper.bindings)
    spec = sweep_spec.parse_spec_text('sweep.base = "tiny_cpu.gin"\nsweep.factor = "train.loss"\nsweep.values = ["dapo"]\n'
                             'sweep.tiny_overrides = ["train.compute_budget_flops = 2e13"]\n', default_name="b")
    (tiny,) = sweep_spec.expand(spec, "tiny")
    budget = [b for b in tiny.bindings if b.startswith("train.compute_budget_flops")]
    assert budget == ["train.compute_budget_flops = 5e+12", "train.compute_budget_flops = 2e13"]  # the last wins
    # every shipped sweep at tiny scale carries it
    for spec_path in sorted(Path(recipes.__file__).parent.joinpath("sweeps").glob("*.gin")):
        for run in sweep_spec.expand(sweep_spec.load_spec(spec_path), "tiny"):
            assert "train.compute_budget_flops = 5e+12" in run.bindings, (spec_path.name, run.name)


def test_tiny_run_names_say_what_ran_and_record_the_papers_name():
    """At tiny scale a run's name carries the value that ran (`k1`, `gen4`), run.json the paper's."""
    for sweep, expected in {"pipeline_k": {"k1": "k4", "k2": "k8"},
                            "generations_per_prompt": {"gen4": "gen8", "gen8": "gen16", "gen12": "gen24",
                                                       "gen16": "gen32"},
                            "off_policy": {"ppo_off_policy-k1": "", "ppo_off_policy-k2": "ppo_off_policy-k8",
                                           "pipeline_rl-k2": "pipeline_rl-k8"}}.items():
        tiny = sweep_spec.expand(sweep_spec.load_spec(sweep), "tiny")
        assert {r.name.rsplit("-s", 1)[0]: r.paper_name for r in tiny} == expected, sweep
        for r in tiny:
            assert r.run_info().get("paper_name", "") == r.paper_name
        assert all(not r.paper_name for r in sweep_spec.expand(sweep_spec.load_spec(sweep), "paper"))
    with pytest.raises(recipes.SweepError, match="tiny_names names \\['nope'\\]"):
        sweep_spec.parse_spec_text('sweep.base = "tiny_cpu.gin"\nsweep.factor = "f"\nsweep.variants = {"a": []}\n'
                          'sweep.tiny_names = {"nope": "b"}\n', default_name="b")

@pytest.mark.parametrize("value,name", [("cispo", "cispo"), (0.28, "0.28"), (True, "on"), ("a b/c", "a_b_c"),
                                        (["uniform", "zero_variance_filter"], "uniform_zero_variance_filter"),
                                        ("minimax.gin", "minimax")])
def test_slug_is_stable_and_filesystem_safe(value, name):
    assert sweep_spec.slug(value) == name
    assert sweep_spec.run_name(value, 2) == f"{name}-s2"


def test_recipe_sweep_at_tiny_scale_keeps_the_recipes_algorithm(tmp_path):
    (tmp_path / "myrecipe.gin").write_text(
        'model.path = "/big/model"\ntrain.prompts_per_step = 48\ntrain.loss = "dapo"\n'
        "dapo.eps_high = 0.26\ntrain.curriculum = [\"uniform\", \"zero_variance_filter\"]\n")
    spec = tmp_path / "s.gin"
    spec.write_text('sweep.name = "r"\nsweep.base = []\nsweep.tiny_base = "tiny_cpu.gin"\nsweep.factor = "recipe"\n'
                    'sweep.values = ["myrecipe.gin"]\nsweep.tiny_overrides = ["train.total_steps = 2"]\n')
    (run,) = sweep_spec.expand(sweep_spec.load_spec(spec), "tiny")
    assert run.name == "myrecipe-s0" and run.value == "myrecipe"
    assert [Path(f).name for f in run.config_files] == ["tiny_cpu.gin"]
    assert run.bindings == (*sweep_spec.TINY_SCALE_BINDINGS, 'train.loss = "dapo"', "dapo.eps_high = 0.26",
                            'train.curriculum = ["uniform", "zero_variance_filter"]', "train.total_steps = 2",
                            "train.seed = 0")
    (paper,) = sweep_spec.expand(sweep_spec.load_spec(spec), "paper")
    assert [Path(f).name for f in paper.config_files] == ["myrecipe.gin"]


@pytest.mark.parametrize("text,match", [
    ('sweep.factor = "train.loss"\nsweep.values = ["dapo"]', "sweep.base is required"),
    ('sweep.base = "tiny_cpu.gin"\nsweep.factor = "train.loss"', "exactly one of sweep.values or sweep.variants"),
    ('sweep.base = "tiny_cpu.gin"\nsweep.factor = "x"\nsweep.values = [1]\nsweep.colour = 3', "unknown key sweep.colour"),
    ('train.loss = "dapo"', "expected `sweep.<key>`"),
    ('sweep.base = "tiny_cpu.gin"\nsweep.factor = "x"\nsweep.values = [1, 2]\nsweep.tiny_values = [1]', "map one to one"),
    ('sweep.base = "tiny_cpu.gin"\nsweep.factor = "x"\nsweep.values = [1]\nsweep.seeds = ["a"]', "list of ints"),
    ('sweep.base = "tiny_cpu.gin"\nsweep.factor = "x"\nsweep.values = %m', "literal values only"),
    ('sweep.base = "tiny_cpu.gin"\nsweep.factor = "x"\nsweep.values = [1]\nsweep.paper_ablation = "no"',
     "paper_ablation must be True or False"),
])
def test_malformed_specs_are_rejected(text, match):
    with pytest.raises(recipes.SweepError, match=match):
        sweep_spec.parse_spec_text(text)


def test_duplicate_run_names_are_rejected():
    spec = sweep_spec.parse_spec_text('sweep.base = "tiny_cpu.gin"\nsweep.factor = "train.loss"\nsweep.values = ["a b", "a_b"]')
    with pytest.raises(recipes.SweepError, match="same run name"):
        sweep_spec.expand(spec, "tiny")


# -------------------------------------------------------------------------- validation
def _runs_with(binding: str):
    spec = sweep_spec.parse_spec_text(f'sweep.base = "tiny_cpu.gin"\nsweep.factor = "f"\nsweep.variants = {{"v": [{json.dumps(binding)}]}}')
    return sweep_spec.expand(spec, "tiny")


def test_unknown_factor_is_an_error_before_submission():
    with pytest.raises(recipes.SweepError, match=r"unknown factor train\.los\b.*did you mean train\.loss\?"):
        run_config.validate_runs(_runs_with('train.los = "dapo"'))
    with pytest.raises(recipes.SweepError, match="no gin configurable named 'trian'"):
        run_config.validate_runs(_runs_with('trian.loss = "dapo"'))
    with pytest.raises(recipes.SweepError, match="cispo has no parameter 'eps'"):
        run_config.validate_runs(_runs_with("cispo.eps = 4.0"))


def test_unknown_component_value_names_the_valid_choices():
    with pytest.raises(recipes.SweepError, match=r"Unknown loss 'cipso'.*cispo.*dapo.*Did you mean 'cispo'"):
        run_config.validate_runs(_runs_with('train.loss = "cipso"'))
    with pytest.raises(recipes.SweepError, match=r"Unknown curriculum 'zero_var'"):
        run_config.validate_runs(_runs_with('train.curriculum = ["uniform", "zero_var"]'))
    with pytest.raises(recipes.SweepError, match=r"Unknown precision policy"):
        run_config.validate_runs(_runs_with('train.precision = "fp8"'))


def test_inconsistent_run_config_is_an_error_before_submission():
    # the trainer's own checks run on each run's parsed config (no model is touched)
    with pytest.raises(recipes.SweepError, match=r"run v-s0: train.micro_batch_size \(128\) is larger than the step batch"):
        run_config.validate_runs(_runs_with("train.prompts_per_step = 2"))


def test_cli_reports_validation_errors_and_submits_nothing(tmp_path, capsys):
    from experiments.cli import main

    spec = write_fake_sweep(tmp_path, values=("dapo", "nope"))
    rc = main(["sweep", str(spec), "--executor", "debug", "--runs", str(tmp_path / "runs"), "--trainer", FAKE])
    out = capsys.readouterr().out
    assert rc == 2 and "Unknown loss 'nope'" in out
    assert not (tmp_path / "runs" / "fake" / ".submitit").exists()


def test_unknown_partition_is_an_error(monkeypatch):
    monkeypatch.setattr(slurm, "slurm_partitions", lambda: ["debug", "gpu"])
    with pytest.raises(recipes.SweepError, match=r"unknown Slurm partition 'gpus'.*debug, gpu.*Did you mean 'gpu'"):
        slurm.check_partition("gpus")
    slurm.check_partition("gpu")
    slurm.check_partition(None)


@pytest.mark.skipif(shutil.which("sinfo") is None, reason="no sinfo: the real-cluster partition check runs in test_slurm")
def test_unknown_partition_against_the_real_sinfo():
    with pytest.raises(recipes.SweepError, match="unknown Slurm partition 'no_such_partition'"):
        slurm.check_partition("no_such_partition")


@pytest.mark.parametrize("text,minutes", [("90", 90), ("1:30:00", 90), ("45:30", 46), ("2-00:00:00", 2880), ("1-2", 1560)])
def test_time_limits(text, minutes):
    assert slurm.parse_time_min(text) == minutes


def test_bad_time_limit():
    with pytest.raises(recipes.SweepError, match="cannot read time limit"):
        slurm.parse_time_min("an hour")


# ------------------------------------------------------------------------------ dry run
def test_dry_run_prints_runs_and_overrides_and_submits_nothing(tmp_path, capsys):
    from experiments.cli import main

    rc = main(["sweep", "loss_type", "--scale", "tiny", "--dry-run", "--executor", "slurm", "--runs", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    for name in ("dapo-s0", "gspo-s0", "cispo-s0"):
        assert name in out
    assert 'train.loss = "gspo"' in out and "3 of 3 runs would be submitted" in out
    assert not any(tmp_path.iterdir())


# ------------------------------------------------------------------ plan: skip / resume
def _mkrun(root: Path, sweep: str, name: str, status: str | None, checkpoint: bool = False, slurm: dict | None = None):
    d = root / sweep / name
    d.mkdir(parents=True)
    if status:
        (d / "run.json").write_text(json.dumps({"status": status, "error": "ValueError: boom" if status == "failed" else None}))
    if checkpoint:
        (d / "checkpoints").mkdir()
        (d / "checkpoints" / "step_000002.pt").write_text("x")
    if slurm:
        (d / "slurm.json").write_text(json.dumps(slurm))


def test_plan_skips_done_resumes_checkpointed_and_retries_failed_only_when_asked(tmp_path, monkeypatch):
    spec = sweep_spec.parse_spec_text('sweep.name = "p"\nsweep.base = "tiny_cpu.gin"\nsweep.factor = "train.loss"\n'
                             'sweep.values = ["a", "b", "c", "d", "e", "f"]')
    runs = sweep_spec.expand(spec, "tiny")
    _mkrun(tmp_path, "p", "a-s0", "done", checkpoint=True)
    _mkrun(tmp_path, "p", "b-s0", "running", checkpoint=True)
    _mkrun(tmp_path, "p", "c-s0", "failed")
    _mkrun(tmp_path, "p", "d-s0", "running", slurm={"executor": "slurm", "job_id": "77_3"})
    _mkrun(tmp_path, "p", "e-s0", "running", slurm={"executor": "slurm", "job_id": "77_4"})
    monkeypatch.setattr(run_state, "slurm_job_states", lambda ids: {"77_3": "RUNNING"} if "77_3" in ids else {})
    actions = {p.run.name: p.action for p in run_state.plan(runs, tmp_path)}
    assert actions == {"a-s0": "skip-done", "b-s0": "resume", "c-s0": "skip-failed", "d-s0": "skip-active",
                       "e-s0": "submit", "f-s0": "submit"}
    again = {p.run.name: p.action for p in run_state.plan(runs, tmp_path, retry_failed=True)}
    assert again["c-s0"] == "retry" and again["a-s0"] == "skip-done"


# ------------------------------------------------------------------- executors (stand-in)
@pytest.mark.parametrize("executor", ["debug", "local"])
def test_sweep_runs_every_run_and_rerun_skips_done(tmp_path, executor, capsys):
    from experiments.cli import main

    spec = write_fake_sweep(tmp_path)
    runs_root = tmp_path / "runs"
    args = ["sweep", str(spec), "--executor", executor, "--runs", str(runs_root), "--trainer", FAKE]
    assert main(args) == 0
    for loss in ("dapo", "gspo", "cispo"):
        d = runs_root / "fake" / f"{loss}-s0"
        info = json.loads((d / "run.json").read_text())
        assert info["status"] == "done" and info["value"] == loss and info["factor"] == "train.loss"
        steps = [json.loads(x)["step"] for x in (d / "metrics.jsonl").read_text().splitlines()]
        assert steps == [1, 2, 3]
        assert json.loads((d / "slurm.json").read_text())["executor"] == executor
    capsys.readouterr()
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "nothing to submit" in out and out.count("skip-done") == 3
    for loss in ("dapo", "gspo", "cispo"):  # not started a second time
        assert json.loads((runs_root / "fake" / f"{loss}-s0" / "run.json").read_text())["starts"] == 1


def test_failed_run_is_reported_and_resubmitted_only_with_retry(tmp_path, capsys):
    from experiments.cli import main

    spec = write_fake_sweep(tmp_path, values=("dapo", "cispo"), extra=(
        'sweep.variants = {"good": [], "broken": [\'model.path = "/tmp/missing-model"\']}\n'))
    spec.write_text(spec.read_text().replace('sweep.values = ["dapo", "cispo"]\n', ""))
    root = tmp_path / "runs"
    args = ["sweep", str(spec), "--executor", "debug", "--runs", str(root), "--trainer", FAKE]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "broken-s0 failed" in out and "does not exist" in out and "1 done, 1 failed" in out
    assert main(args) == 0 and "skip-failed" in capsys.readouterr().out
    assert json.loads((root / "fake" / "broken-s0" / "run.json").read_text())["starts"] == 1
    assert main(args + ["--retry-failed"]) == 1
    assert json.loads((root / "fake" / "broken-s0" / "run.json").read_text())["starts"] == 2
    rows = {r.run: r for r in S.collect(root / "fake", with_slurm=False)}
    assert rows["broken-s0"].state == "failed" and "does not exist" in rows["broken-s0"].error
    assert rows["good-s0"].state == "done" and rows["good-s0"].step == 3


def test_resume_continues_from_the_checkpoint(tmp_path):
    """A run interrupted after step 2 (checkpoint at 2, a stray step-3 log line) is resumed, not restarted."""
    spec = write_fake_sweep(tmp_path, values=("cispo",))
    runs = sweep_spec.expand(sweep_spec.load_spec(spec), "tiny")
    root = tmp_path / "runs"
    d = root / "fake" / "cispo-s0"
    (d / "checkpoints").mkdir(parents=True)
    (d / "checkpoints" / "step_000002.json").write_text(json.dumps({"step": 2}))
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "compute_hours": s * 0.01}) + "\n" for s in (1, 2, 3)))
    (d / "run.json").write_text(json.dumps({"status": "running", "starts": 1}))
    planned = run_state.plan(runs, root)
    assert [p.action for p in planned] == ["resume"]
    submitted = submission.submit(planned, submission.LaunchOptions(executor="debug", target=FAKE), root, "fake")
    assert submission.wait(submitted, poll_s=0.1) == {"cispo-s0": ("done", "")}
    steps = [json.loads(x)["step"] for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_runjob_is_checkpointable_and_resubmits_the_same_call(tmp_path):
    import submitit

    job = submission.RunJob("x:y")
    rd = str(tmp_path)
    delayed = job.checkpoint(["a.gin"], ["train.seed = 0"], rd, {"name": "r"})
    assert isinstance(delayed, submitit.helpers.DelayedSubmission)
    assert delayed.function is job and delayed.args == (["a.gin"], ["train.seed = 0"], rd, {"name": "r"})
    assert run_state.was_interrupted(tmp_path)


def test_an_interrupted_run_marked_failed_is_resumed_not_skipped(tmp_path):
    """The trainer records the SystemExit of a preempted job as failed; the launcher knows better."""
    spec = sweep_spec.parse_spec_text('sweep.name = "p"\nsweep.base = "tiny_cpu.gin"\nsweep.factor = "train.loss"\n'
                             'sweep.values = ["a"]')
    runs = sweep_spec.expand(spec, "tiny")
    _mkrun(tmp_path, "p", "a-s0", "failed", checkpoint=True)
    assert [p.action for p in run_state.plan(runs, tmp_path)] == ["skip-failed"]
    submission.RunJob().checkpoint([], [], str(tmp_path / "p" / "a-s0"), {})
    assert [p.action for p in run_state.plan(runs, tmp_path)] == ["resume"]


# ---------------------------------------------------------------------------- status
def test_status_table_fits_a_and_b_once_there_are_enough_points(tmp_path, capsys):
    import numpy as np

    from analysis.scaling_law import sigmoid

    d = tmp_path / "sw" / "cispo-s0"
    d.mkdir(parents=True)
    (d / "run.json").write_text(json.dumps({"status": "done"}))
    c = np.linspace(0.05, 4.0, 20)
    r = sigmoid(c, 0.6, 1.5, 1.0, 0.1)
    (d / "eval.jsonl").write_text("".join(json.dumps({"step": i, "compute_hours": float(ci), "pass_rate": float(ri)}) + "\n"
                                          for i, (ci, ri) in enumerate(zip(c, r))))
    (d / "metrics.jsonl").write_text(json.dumps({"step": 19, "compute_hours": 4.0}) + "\n")
    e = tmp_path / "sw" / "dapo-s0"
    e.mkdir()
    (e / "slurm.json").write_text(json.dumps({"executor": "local", "job_id": "123"}))
    rows = {x.run: x for x in S.collect(tmp_path / "sw", with_slurm=False)}
    assert rows["cispo-s0"].A == pytest.approx(0.6, abs=0.01) and rows["cispo-s0"].B == pytest.approx(1.5, rel=0.1)
    assert rows["cispo-s0"].step == 19 and rows["cispo-s0"].pass_rate == pytest.approx(float(r[-1]))
    assert rows["dapo-s0"].state == "queued" and rows["dapo-s0"].A is None
    from experiments.cli import main

    assert main(["status", str(tmp_path / "sw"), "--no-slurm"]) == 0
    out = capsys.readouterr().out
    assert "cispo-s0" in out and f"{rows['cispo-s0'].A:.3f}" in out and "1 done, 1 queued" in out
    assert main(["status", str(tmp_path / "sw"), "--no-slurm", "--json"]) == 0
    assert {x["run"] for x in json.loads(capsys.readouterr().out)} == {"cispo-s0", "dapo-s0"}


def test_status_of_a_missing_directory(tmp_path, capsys):
    from experiments.cli import main

    assert main(["status", str(tmp_path / "nope")]) == 2
    assert "no such directory" in capsys.readouterr().out


def test_console_script_help_lists_the_slurm_options():
    out = subprocess.run([sys.executable, "-m", "experiments.cli", "sweep", "--help"], capture_output=True, text=True,
                         cwd=REPO, timeout=120).stdout
    for opt in ("--executor", "--partition", "--gpus", "--cpus", "--time", "--array-parallelism", "--account", "--qos",
                "--runs", "--dry-run", "--retry-failed", "--scale", "--slurm-extra"):
        assert opt in out


def test_slurm_options_reach_the_submitit_executor(tmp_path):
    opts = submission.LaunchOptions(executor="slurm", partition="gpu", gpus=8, cpus=32, mem_gb=200, time_min=slurm.parse_time_min("4:00:00"),
                           array_parallelism=5, account="myacct", qos="high", slurm_extra={"constraint": "h100"})
    executor = submission.make_executor(opts, tmp_path, "loss_type")
    params = executor._executor.parameters  # submitit's resolved sbatch parameters
    assert params["partition"] == "gpu" and params["gpus_per_node"] == 8 and params["cpus_per_task"] == 32
    assert params["time"] == 240 and params["array_parallelism"] == 5
    assert params["account"] == "myacct" and params["qos"] == "high"
    assert params["additional_parameters"] == {"constraint": "h100"}
    assert params["job_name"] == "scalerl-loss_type"


def test_only_selects_runs_and_rejects_unknown_names(tmp_path, capsys):
    from experiments.cli import main

    base = ["sweep", "loss_type", "--scale", "tiny", "--dry-run", "--executor", "debug", "--runs", str(tmp_path)]
    assert main(base + ["--only", "gspo-s0"]) == 0
    out = capsys.readouterr().out
    assert "gspo-s0" in out and "dapo-s0" not in out and "1 of 1 runs" in out
    assert main(base + ["--only", "gpso-s0"]) == 2
    assert "unknown run(s) gpso-s0" in capsys.readouterr().out
    assert main(base + ["--seeds", "1", "2"]) == 0
    out = capsys.readouterr().out
    assert "cispo-s1" in out and "cispo-s2" in out and "6 of 6 runs" in out


def test_cpu_only_jobs_ask_for_no_gpus(tmp_path):
    params = submission.make_executor(submission.LaunchOptions(executor="slurm"), tmp_path, "s")._executor.parameters
    # one CPU per process of the run (1 learner + 1 generator by default): runs never share cores
    assert "gpus_per_node" not in params and params["cpus_per_task"] == 2 and params["time"] == 60
    assert params["signal_delay_s"] == 90


def test_job_layout_follows_the_run_layout(tmp_path, monkeypatch):
    node_cpus = {"gpu": 64}
    monkeypatch.setattr(submission, "partition_node_cpus", lambda partition: node_cpus.get(partition))
    res = submission.RunResources(learner_ranks=2, num_generators=1)
    one_task = submission.job_parameters(submission.LaunchOptions(executor="slurm"), res)
    assert one_task == {"nodes": 1, "tasks_per_node": 1, "cpus_per_task": 3, "gpus_per_node": 0}
    tasks = submission.job_parameters(submission.LaunchOptions(executor="slurm", tasks_per_node=3, overcommit=True), res)
    assert tasks == {"nodes": 1, "tasks_per_node": 3, "cpus_per_task": 1, "gpus_per_node": 0}
    # the paper's layout: 16 learner GPUs + 64 generator GPUs = 10 nodes x 8 tasks, one GPU each
    paper = submission.RunResources(learner_ranks=16, num_generators=64, gpus_per_generator=1, on_gpu=True)
    # each GPU task gets its share of 3/4 of the node's CPUs (sinfo), not one core for a vLLM engine
    assert submission.job_parameters(submission.LaunchOptions(executor="slurm", nodes=10, partition="gpu"), paper) == {
        "nodes": 10, "tasks_per_node": 8, "cpus_per_task": 6, "gpus_per_node": 8}
    assert submission.job_parameters(submission.LaunchOptions(executor="slurm", nodes=10, partition="gpu", cpus=2), paper)["cpus_per_task"] == 2
    assert submission.job_parameters(submission.LaunchOptions(executor="slurm", nodes=10, partition="other"), paper)["cpus_per_task"] == 1
    # generators with tensor parallelism 2: the busiest node decides the GPUs per node
    tp2 = submission.RunResources(learner_ranks=4, num_generators=4, gpus_per_generator=2, on_gpu=True)
    assert submission.job_parameters(submission.LaunchOptions(executor="slurm", nodes=2), tp2)["gpus_per_node"] == 8
    with pytest.raises(recipes.SweepError, match="must be equal"):
        submission.job_parameters(submission.LaunchOptions(executor="slurm", nodes=2, tasks_per_node=1), res)
    executor = submission.make_executor(submission.LaunchOptions(executor="slurm", tasks_per_node=3, overcommit=True), tmp_path, "s", res)
    params = executor._executor.parameters
    assert params["additional_parameters"] == {"overcommit": True, "ntasks": 3} and "ntasks_per_node" not in params
    assert params["srun_args"] == ["--kill-on-bad-exit=1"]
    # srun (Slurm 22.05-23.02) does not inherit sbatch's --cpus-per-task: the step is told too
    one = submission.make_executor(submission.LaunchOptions(executor="slurm"), tmp_path, "s", res)._executor.parameters
    assert one["cpus_per_task"] == 3 and one["srun_args"] == ["--cpus-per-task=3"]
    gpu = submission.make_executor(submission.LaunchOptions(executor="slurm", nodes=10, partition="gpu"), tmp_path, "s", paper)
    assert gpu._executor.parameters["srun_args"] == ["--kill-on-bad-exit=1", "--cpus-per-task=6"]
    plain = submission.make_executor(submission.LaunchOptions(executor="slurm", tasks_per_node=3), tmp_path, "s", res)._executor.parameters
    assert plain["ntasks_per_node"] == 3
    with pytest.raises(recipes.SweepError, match="need --executor slurm"):
        submission.make_executor(submission.LaunchOptions(executor="local", nodes=2), tmp_path, "s", res)


def test_local_executor_runs_as_many_runs_at_once_as_the_machine_has_cores_for(monkeypatch):
    monkeypatch.setattr(submission, "_usable_cores", lambda: 2)
    two_procs = [submission.RunResources(1, 1)] * 3
    assert submission.local_parallelism(submission.LaunchOptions(executor="local"), two_procs) == 1
    assert submission.local_parallelism(submission.LaunchOptions(executor="local", cpus=1), two_procs) == 2
    monkeypatch.setattr(submission, "_usable_cores", lambda: 16)
    assert submission.local_parallelism(submission.LaunchOptions(executor="local", array_parallelism=3), two_procs) == 3
    monkeypatch.setattr(submission, "_visible_gpus", lambda: 4)
    gpu_runs = [submission.RunResources(1, 1, on_gpu=True)] * 3  # 2 GPUs each
    assert submission.local_parallelism(submission.LaunchOptions(executor="local"), gpu_runs) == 2


def _effective(run, selector: str, param: str):
    """The value a run binds to selector.param: its config files, then its bindings (last wins)."""
    value = recipes.recipe_binding(run.config_files, selector, param)
    for b in run.bindings:
        scope, sel, p, v = run_config.parse_binding(b)
        if not scope and sel.split(".")[-1] == selector and p == param:
            value = v
    return value


@pytest.mark.parametrize("name", SHIPPED)
def test_no_tiny_run_carries_the_papers_lengths(name):
    """A tiny run's generation lengths must fit the tiny model (128 positions): a recipe's paper
    sizes (10k-12k thinking tokens) leaking into a tiny run fail at its first evaluation."""
    for run in sweep_spec.expand(sweep_spec.load_spec(name), "tiny"):
        thinking = _effective(run, "interruption", "thinking_max") or 0
        answer = _effective(run, "interruption", "answer_budget") or 0
        l_max = _effective(run, "length_penalty", "l_max") or 0
        max_tokens = _effective(run, "train", "max_tokens") or 0
        assert thinking + answer <= 64 and l_max <= 64 and max_tokens <= 64, (
            f"{name}/{run.name}: thinking_max {thinking} + answer_budget {answer}, l_max {l_max}, "
            f"max_tokens {max_tokens}")


def test_tiny_scalerl_seeds_are_tiny_cpu_itself():
    """The seed sweep sets the comparison margin of every tiny sweep, so its runs must be the tiny
    base's configuration: every bound value equals tiny_cpu.gin's."""
    for run in sweep_spec.expand(sweep_spec.load_spec("scalerl_seeds"), "tiny"):
        for b in run.bindings[:-1]:  # the last one is the seed
            if b in sweep_spec.TINY_SCALE_BINDINGS:  # the tiny scale's stopping rule, on every sweep alike
                continue
            scope, sel, p, _ = run_config.parse_binding(b)
            base, got = recipes.recipe_binding(run.config_files, sel.split(".")[-1], p), _effective(run, sel.split(".")[-1], p)
            assert base is None or base == got, f"{run.name}: {sel}.{p} = {got!r}, tiny_cpu.gin binds {base!r}"


def test_a_multi_node_auto_device_run_must_say_its_gpus():
    """train.device = "auto" on several nodes without --gpus would ask Slurm for no GPU (every task on CPU)."""
    cfg = str(REPO / "experiments" / "configs" / "tiny_cpu.gin")
    run = sweep_spec.RunSpec(name="r0", sweep="sw", factor="train.loss", value="cispo", recipe="r", seed=0,
                    config_files=(cfg,), bindings=('train.device = "auto"',))
    with pytest.raises(recipes.SweepError, match=r"run 'r0': train.device = \"auto\" on --nodes 2 without --gpus"):
        submission.run_resources([run], submission.LaunchOptions(executor="slurm", nodes=2))
    assert submission.run_resources([run], submission.LaunchOptions(executor="slurm", nodes=2, gpus=8))["r0"].on_gpu
    assert not submission.run_resources([run], submission.LaunchOptions(executor="slurm", nodes=1))["r0"].on_gpu  # one node: as before
    cpu = dataclasses.replace(run, bindings=('train.device = "cpu"',))
    assert not submission.run_resources([cpu], submission.LaunchOptions(executor="slurm", nodes=2))["r0"].on_gpu
