"""Loading run directories, fitting runs, the synthetic-run writer and `scalerl fit`."""

from __future__ import annotations

import json
import logging

import numpy as np
import pandas as pd
import pytest

from analysis.runs import fit_run, fit_runs, load_runs, read_jsonl, run_curve
from analysis.scaling_law import FitResult
from analysis.synthetic import SYNTHETIC_SWEEPS, write_paper_sweeps, write_run, write_sweep
from experiments.cli import main as scalerl

# The run-directory contract (DESIGN.md "A run directory" and "Compute accounting"; the trainer
# writes these fields).
RUN_JSON_FIELDS = {"name", "sweep", "factor", "value", "recipe", "seed", "git_sha", "hardware", "reserved_cpus",
                   "status", "error", "started", "finished"}
METRICS_FIELDS = {"step", "version", "compute_hours", "flops", "wall_s", "prompts", "generations", "tokens",
                  "reward_mean", "pass_rate", "zero_variance_frac", "truncation_rate", "entropy", "loss", "grad_norm",
                  "is_ratio_mean", "is_ratio_min", "is_ratio_max", "clip_frac", "lag_mean", "lag_max",
                  "time_generate", "time_train", "time_sync", "time_wait",
                  # compute accounting (issue 12 item 1)
                  "epoch", "cpu_hours", "contention", "contention_run", "procs", "eval_wall_s", "startup_s"}
EVAL_FIELDS = {"step", "compute_hours", "flops", "pass_rate", "k", "prompts", "per_task", "entropy", "eval_wall_s",
               "eval_compute_hours"}


def small_run(root, sweep="loss_type", value="cispo", **kw):
    params = dict(A=0.6, B=1.8, C_mid=0.05, R0=0.1, factor="loss", value=value, steps=40, eval_every=2,
                  device="cpu", count=2)
    params.update(kw)
    return write_run(root, sweep, **params)


def test_synthetic_run_has_exactly_the_contract_fields(tmp_path):
    d = small_run(tmp_path)
    meta = json.loads((d / "run.json").read_text())
    assert set(meta) == RUN_JSON_FIELDS and set(meta["hardware"]) == {"device", "count"}
    metrics, _ = read_jsonl(d / "metrics.jsonl")
    evals, _ = read_jsonl(d / "eval.jsonl")
    assert all(set(m) == METRICS_FIELDS for m in metrics) and len(metrics) == 40
    assert all(set(e) == EVAL_FIELDS for e in evals) and len(evals) == 21
    assert (d / "config.gin").is_file() and (d / "checkpoints").is_dir()
    c = np.array([e["compute_hours"] for e in evals])
    assert np.all(np.diff(c) > 0) and c[0] == 0.0
    # accounting: epochs rise to the run's total, per-process CPU and run-queue time add up
    assert metrics[-1]["epoch"] == pytest.approx(6.0) and set(metrics[-1]["procs"]) == {"learner-0", "generator-0"}
    procs = metrics[-1]["procs"].values()
    cpu, runq = sum(p["cpu_s"] for p in procs), sum(p["runq_s"] for p in procs)
    assert metrics[-1]["cpu_hours"] == pytest.approx(cpu / 3600) and metrics[-1]["contention_run"] == pytest.approx(
        runq / (cpu + runq))
    assert all(np.diff([m["eval_wall_s"] for m in metrics]) >= 0)
    old = small_run(tmp_path, value="old", epochs=None)  # a run from before `epoch` existed
    assert all("epoch" not in m for m in read_jsonl(old / "metrics.jsonl")[0])


def test_load_runs_eval_rows_and_metadata(tmp_path):
    write_sweep(tmp_path, "batch_size", "batch_size", {512: (0.6, 1.8, 1.0), 2048: (0.65, 1.7, 3.0)},
                seeds=(0, 1), steps=20, eval_every=5)
    df = load_runs(tmp_path)
    assert len(df) == 4 * 5
    assert {"sweep", "run", "factor", "value", "seed", "status", "step", "compute_hours", "flops", "pass_rate",
            "k", "prompts", "per_task.math", "path"} <= set(df.columns)
    assert set(df["value"]) == {512, 2048} and set(df["seed"]) == {0, 1}
    # a sweep directory and a single run directory load the same way
    assert len(load_runs(tmp_path / "batch_size")) == 20
    one = load_runs(tmp_path / "batch_size" / "batch_size=512-seed0")
    assert len(one) == 5 and one["run"].unique().tolist() == ["batch_size=512-seed0"]
    metrics = load_runs(tmp_path, what="metrics")
    assert len(metrics) == 4 * 20 and "entropy" in metrics


def test_load_runs_tolerates_partial_failed_and_empty_runs(tmp_path, caplog):
    small_run(tmp_path, value="partial", status="running", partial_last_line=True)
    small_run(tmp_path, value="failed", status="failed", error="RuntimeError: NaN loss", steps=10)
    small_run(tmp_path, value="noevals", status="running", with_evals=False)
    ev = load_runs(tmp_path)
    runs = load_runs(tmp_path, what="runs").set_index("value")
    assert set(ev["value"]) == {"partial", "failed"}  # the run without evaluations has no eval rows
    assert runs.loc["noevals", "n_evals"] == 0 and runs.loc["noevals", "n_steps"] == 40
    assert runs.loc["failed", "status"] == "failed" and "NaN loss" in runs.loc["failed", "error"]
    assert runs.loc["partial", "partial_lines"] == 2  # half a line at the end of both logs
    assert runs.loc["partial", "n_evals"] == 21
    with caplog.at_level(logging.WARNING):
        load_runs(tmp_path)
    assert not caplog.records  # a partial LAST line is expected, not a warning


def test_corrupt_middle_line_is_skipped_with_a_warning(tmp_path, caplog):
    d = small_run(tmp_path)
    lines = (d / "eval.jsonl").read_text().splitlines()
    lines[3] = "{not json"
    (d / "eval.jsonl").write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING):
        ev = load_runs(tmp_path)
    assert len(ev) == 20 and "eval.jsonl:4" in caplog.text


def test_run_without_run_json_is_found(tmp_path):
    d = small_run(tmp_path)
    (d / "run.json").unlink()
    runs = load_runs(tmp_path, what="runs")
    assert runs["run"].tolist() == [d.name] and runs["sweep"].tolist() == ["loss_type"]


def test_load_runs_missing_path_and_empty_dir(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_runs(tmp_path / "nope")
    assert load_runs(tmp_path).empty and load_runs(tmp_path, what="runs").empty


def test_resumed_run_with_repeated_steps_keeps_last(tmp_path):
    d = small_run(tmp_path, steps=10)
    rows, _ = read_jsonl(d / "eval.jsonl")
    with open(d / "eval.jsonl", "a") as f:  # a resume re-evaluates the last step
        f.write(json.dumps({**rows[-1], "pass_rate": 0.99}) + "\n")
    ev = load_runs(tmp_path)
    assert len(ev) == len(rows) and ev["pass_rate"].iloc[-1] == 0.99


def test_fit_run_returns_fit_or_none(tmp_path):
    small_run(tmp_path, value="good", noise=0.003)
    small_run(tmp_path, value="short", steps=6)
    small_run(tmp_path, value="flat", A=0.1000001, R0=0.1, noise=0.0)
    ev = load_runs(tmp_path)
    good = fit_run(ev[ev["value"] == "good"])
    assert isinstance(good, FitResult) and abs(good.A - 0.6) < 0.02
    assert fit_run(ev[ev["value"] == "short"]) is None  # 4 evaluations < min_points
    assert fit_run(ev[ev["value"] == "flat"]) is None
    flops = fit_run(ev[ev["value"] == "good"], compute="flops")
    assert flops is not None and flops.C_mid > 1e15 and abs(flops.A - good.A) < 1e-6
    c, r = run_curve(ev[ev["value"] == "good"])
    assert c.size == 21 and np.all(np.diff(c) > 0)


def test_fit_runs_table_and_prediction(tmp_path):
    write_paper_sweeps(tmp_path, sweeps=["loss_type"], steps=60, eval_every=3, noise=0.003)
    table = fit_runs(load_runs(tmp_path))
    assert len(table) == 3 and table["fit_error"].eq("").all()
    want = SYNTHETIC_SWEEPS["loss_type"][1]
    for row in table.itertuples():
        assert abs(row.A - want[row.value][0]) < 0.02, row
    pred = fit_runs(load_runs(tmp_path), fraction=0.5)
    assert (pred["prediction_error"].abs() < 0.03).all() and (pred["fit_to"] < pred["final_compute"]).all()


def test_scalerl_fit_cli_writes_csv(tmp_path, capsys):
    write_paper_sweeps(tmp_path / "runs", sweeps=["loss_type"], steps=60, eval_every=3)
    small_run(tmp_path / "runs", value="noevals", with_evals=False, status="running")
    csv = tmp_path / "fits.csv"
    assert scalerl(["fit", str(tmp_path / "runs"), "--csv", str(csv)]) == 0
    df = pd.read_csv(csv)
    assert len(df) == 4 and {"A", "B", "C_mid", "R0", "rank", "fit_error"} <= set(df.columns)
    assert df.loc[df["value"] == "noevals", "fit_error"].str.contains("no evaluations").all()
    # the paper's rule inside the sweep: dapo (A 0.52) ranks below gspo / cispo (A 0.595)
    ls = df[df["factor"] == "train.loss"].set_index("value")
    assert ls.loc["dapo", "rank"] == 3 and not ls.loc["dapo", "tied_with_best_A"]
    out = capsys.readouterr().out
    assert "sigmoid fits" in out and "dapo" in out
    assert scalerl(["fit", str(tmp_path / "missing")]) == 2


def test_scalerl_fit_cli_prediction_and_bootstrap(tmp_path):
    write_paper_sweeps(tmp_path / "runs", sweeps=["fp32_head"], steps=40, eval_every=2)
    csv = tmp_path / "fits.csv"
    assert scalerl(["fit", str(tmp_path / "runs"), "--csv", str(csv), "--fraction", "0.5", "--bootstrap", "8"]) == 0
    df = pd.read_csv(csv)
    assert {"predicted_final", "observed_final", "prediction_error", "A_lo", "A_hi"} <= set(df.columns)
    assert (df["A_lo"] <= df["A_hi"]).all()


EXHAUSTED = ("CurriculumExhausted: no_positive_resampling: all 200 training prompts have been dropped (mean pass "
             "rate >= 0.9 over their last 1 rollout group(s)) by epoch 9")


def _thin_the_pool(run_dir, *, prompts=8, start=100, per_step=3):
    """Give a synthetic run's metrics a No-Positive-Resampling pool that loses `per_step` prompts a
    step from `start` (the trainer logs `prompts` ordered and `curriculum_active` left per step)."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for m in rows:
        m.update(prompts=prompts, curriculum_active=max(start - per_step * int(m["step"]), 0))
    path.write_text("".join(json.dumps(m) + "\n" for m in rows))
    return [m["step"] for m in rows if m["curriculum_active"] < prompts][0]


def test_pool_dry_step_is_the_first_step_with_fewer_prompts_left_than_ordered():
    from analysis.runs import pool_dry_step

    line = lambda step, active, prompts=8: json.dumps({"step": step, "prompts": prompts, "loss": 0.1,  # noqa: E731
                                                       "curriculum_active": active, "curriculum_epoch": 2})
    text = "\n".join([line(1, 30), line(2, 9), line(3, 8), line(4, 7), line(5, 0)]) + "\n"
    assert pool_dry_step(text) == 4  # 8 left for 8 ordered still fills the step with distinct prompts
    assert pool_dry_step("\n".join([line(1, 30), line(2, 9)])) is None
    assert pool_dry_step(json.dumps({"step": 1, "prompts": 8, "loss": 0.2}) + "\n") is None  # no curriculum logged
    assert pool_dry_step("") is None
    # a half-written last line and the order the trainer writes keys in do not matter
    assert pool_dry_step(line(1, 30) + "\n" + '{"curriculum_active": 3, "step": 2, "prompts": 16}\n{"step": 3, "pro') == 2


def test_run_finished_counts_a_run_whose_pool_ran_out():
    from analysis.runs import run_finished

    assert run_finished("done") and run_finished("done", None)
    assert run_finished("failed", EXHAUSTED)
    assert not run_finished("failed", "RuntimeError: CUDA out of memory")
    assert not run_finished("failed", None) and not run_finished("running") and not run_finished("unknown", EXHAUSTED)


def test_a_curve_ends_where_its_pool_ran_dry_and_an_exhausted_run_counts_as_finished(tmp_path):
    from analysis.study import summarize_sweep

    kw = dict(B=1.8, C_mid=400.0, steps=40, eval_every=2, device="cpu", count=2, factor="train.loss",
              final_compute=1600.0, noise=0.0)
    write_run(tmp_path, "loss_type", "cispo-s0", A=0.6, value="cispo", seed=0, **kw)
    write_run(tmp_path, "loss_type", "dapo-s0", A=0.5, value="dapo", seed=0, **kw)
    dry_dir = write_run(tmp_path, "loss_type", "cispo-s1", A=0.6, value="cispo", seed=1, status="failed",
                        error=EXHAUSTED, **kw)
    dry = _thin_the_pool(dry_dir)  # 100 - 3·step < 8 first at step 31
    assert dry == 31
    write_run(tmp_path, "loss_type", "dapo-s1", A=0.5, value="dapo", seed=1, **kw)
    ev, runs = load_runs(tmp_path), load_runs(tmp_path, what="runs")
    steps = ev.loc[ev["run"] == "cispo-s1", "step"]
    assert steps.max() == 30 and len(steps) == 16  # evaluations 0, 2, ..., 30; 32-40 are past the dry step
    assert len(ev.loc[ev["run"] == "cispo-s0", "step"]) == 21
    row = runs.set_index("run").loc["cispo-s1"]
    assert row["pool_dry_step"] == 31 and row["n_evals_after_pool_dry"] == 5 and row["n_evals"] == 16
    assert runs.set_index("run")["pool_dry_step"].drop("cispo-s1").isna().all()
    s = summarize_sweep("loss_type", ev, runs, judge=False, compute="compute_hours")
    table = s.runs.set_index("run")
    assert table.loc["cispo-s1", "finished"] and table.loc["cispo-s1", "pool_dry_step"] == 31
    # the common window ends where the exhausted run's curve ends (compute at step 30 of 40), and it has a tail
    assert s.tail_end == pytest.approx(1600.0 * 30 / 40)
    assert table["tail"].notna().all()
    # without the cut the window would be the whole run (every run ends at 1600)
    assert np.allclose(table["final_compute"].drop("cispo-s1"), 1600.0)
