"""Contention flags (issue 12 item 1, analysis side): `scalerl status` and `scalerl fit` mark runs
whose cumulative CPU contention exceeds 10% (a column and a warning naming them), and status
fits A and B by the same protocol as `scalerl fit`."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from analysis.protocol import CONTENTION_LIMIT, is_contended
from analysis.runs import fit_runs, load_runs
from analysis.synthetic import write_run
from experiments import status as S
from experiments.cli import main as scalerl


def _sweep(root):
    kw = dict(B=1.8, C_mid=1.0, steps=60, eval_every=3, device="cpu", count=2, noise=0.003, factor="train.loss")
    write_run(root, "loss_type", "cispo-s0", A=0.6, value="cispo", contention=0.02, **kw)
    write_run(root, "loss_type", "dapo-s0", A=0.52, value="dapo", contention=0.31, **kw)
    write_run(root, "loss_type", "gspo-s0", A=0.59, value="gspo", contention=0.02, epochs=None, **kw)


def test_contention_threshold():
    assert CONTENTION_LIMIT == 0.10
    assert is_contended(0.11) and not is_contended(0.10) and not is_contended(None) and not is_contended(float("nan"))


def test_status_flags_contended_runs_and_fits_like_scalerl_fit(tmp_path, capsys):
    _sweep(tmp_path)
    rows = {r.run: r for r in S.collect(tmp_path / "loss_type", with_slurm=False)}
    assert rows["dapo-s0"].contended and rows["dapo-s0"].contention == pytest.approx(0.31, abs=0.03)
    assert not rows["cispo-s0"].contended and rows["cispo-s0"].epoch == pytest.approx(6.0)
    assert rows["gspo-s0"].epoch is None
    fits = fit_runs(load_runs(tmp_path), runs=load_runs(tmp_path, what="runs")).set_index("run")
    for name, r in rows.items():  # the same protocol fit (whole run from the end of epoch 1 / fallback)
        assert r.A == pytest.approx(fits.loc[name, "A"]) and r.B == pytest.approx(fits.loc[name, "B"])
    assert scalerl(["status", str(tmp_path / "loss_type"), "--no-slurm"]) == 0
    out = capsys.readouterr().out
    assert "contention" in out and "31% !" in out
    warning = next(line for line in out.splitlines() if line.startswith("warning:"))
    assert "1 run(s) slowed by other work (CPU contention above 10%" in warning and "dapo-s0" in warning and "cispo-s0" not in warning
    assert scalerl(["status", str(tmp_path / "loss_type"), "--no-slurm", "--json"]) == 0
    data = {x["run"]: x for x in json.loads(capsys.readouterr().out)}
    assert data["dapo-s0"]["contended"] is True and data["cispo-s0"]["contended"] is False


def test_status_without_contention_fields_prints_no_warning(tmp_path, capsys):
    d = tmp_path / "sw" / "old-s0"
    d.mkdir(parents=True)
    (d / "run.json").write_text(json.dumps({"status": "done"}))
    (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "compute_hours": 0.1}) + "\n")
    (row,) = S.collect(tmp_path / "sw", with_slurm=False)
    assert row.contention is None and not row.contended
    assert scalerl(["status", str(tmp_path / "sw"), "--no-slurm"]) == 0
    assert "warning" not in capsys.readouterr().out


def test_fit_flags_contended_runs(tmp_path, capsys):
    _sweep(tmp_path / "runs")
    csv = tmp_path / "fits.csv"
    assert scalerl(["fit", str(tmp_path / "runs"), "--csv", str(csv)]) == 0
    out = capsys.readouterr().out
    df = pd.read_csv(csv).set_index("run")
    assert bool(df.loc["dapo-s0", "contended"]) and not bool(df.loc["cispo-s0", "contended"])
    assert df.loc["dapo-s0", "contention_run"] > CONTENTION_LIMIT
    warning = " ".join(out[out.index("warning:"):].split())
    assert "1 run(s) slowed by other work (CPU contention above 10%" in warning and "loss_type/dapo-s0 (31%)" in warning
    assert "cispo-s0" not in warning
    # the protocol and the margin of every fit are in the table
    assert set(df["protocol"]) == {"whole"} and set(df["margin_source"]) == {"paper (no seeds)"}
    # the default fit start is the paper's 0.4 of the fitted range, for every run
    assert set(df["min_compute_rule"]) == {"0.4 of the fitted range (the paper's 1.5k GPU-h of its whole fit range)"}
    # --min-compute epoch starts at the end of epoch 1 where one is logged, else falls back and says why
    assert scalerl(["fit", str(tmp_path / "runs"), "--csv", str(csv), "--min-compute", "epoch"]) == 0
    df = pd.read_csv(csv).set_index("run")
    assert df.loc["gspo-s0", "min_compute_rule"].startswith("0.4 of the fitted range (no epoch logged")
    assert df.loc["cispo-s0", "min_compute_rule"] == "end of epoch 1"


def test_foreign_load_that_never_delayed_the_run_is_not_contention():
    """Contended = other work used the run's CPUs (contention_run > 0.10) AND the run's threads
    waited for one (runq_run > 0.10); a run that does not log its run-queue share is judged by
    contention_run alone."""
    from analysis.protocol import RUNQ_LIMIT
    from analysis.runs import run_runq

    assert RUNQ_LIMIT == 0.10
    assert not is_contended(0.25, 0.03) and is_contended(0.25, 0.11) and is_contended(0.25, None)
    assert not is_contended(0.05, 0.4) and is_contended(0.25, float("nan")) and not is_contended(0.10, 0.5)
    # run_runq: the logged field wins; otherwise the last line's cumulative procs (wait / (cpu + wait))
    assert run_runq([{"runq_run": 0.07, "procs": {"a": {"cpu_s": 1.0, "runq_s": 1.0}}}]) == pytest.approx(0.07)
    assert run_runq([{}, {"procs": {"a": {"cpu_s": 6.0, "runq_s": 1.0}, "b": {"cpu_s": 2.0, "runq_s": 1.0}}}]) == \
        pytest.approx(0.2)
    assert run_runq([]) is None and run_runq([{"procs": {}}]) is None
    # a host without schedstat logs runq_s 0 with schedstat False: the delay is unknown, not 0
    from components.trainer.accounting import contention

    blind = {"a": {"cpu_s": 6.0, "runq_s": 0.0, "schedstat": False}, "b": {"cpu_s": 2.0, "runq_s": 1.0}}
    assert run_runq([{"procs": blind}]) is None and is_contended(0.25, run_runq([{"procs": blind}]))
    assert contention(blind) != contention(blind)  # NaN
    assert contention({"b": {"cpu_s": 3.0, "runq_s": 1.0}}) == pytest.approx(0.25)


def test_a_busy_machine_with_a_prioritised_run_is_not_flagged_but_a_delayed_one_is(tmp_path):
    """End to end over logged runs: the same foreign load (31%) is contention for the run whose
    threads waited and not for the one that logged a 2% run-queue share; `scalerl status`,
    `scalerl fit` and the run table agree."""
    _sweep(tmp_path)
    path = tmp_path / "loss_type" / "dapo-s0" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows:
        r["runq_run"] = 0.02
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    status = {r.run: r for r in S.collect(tmp_path / "loss_type", with_slurm=False)}
    table = load_runs(tmp_path, what="runs").set_index("run")
    fits = fit_runs(load_runs(tmp_path), runs=load_runs(tmp_path, what="runs")).set_index("run")
    assert table.loc["dapo-s0", "contention_run"] > CONTENTION_LIMIT
    assert not status["dapo-s0"].contended and not table.loc["dapo-s0", "contended"] and not fits.loc["dapo-s0", "contended"]
    assert table.loc["dapo-s0", "runq_run"] == pytest.approx(0.02)
    for r in rows:
        r["runq_run"] = 0.2
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    status = {r.run: r for r in S.collect(tmp_path / "loss_type", with_slurm=False)}
    table = load_runs(tmp_path, what="runs").set_index("run")
    assert status["dapo-s0"].contended and table.loc["dapo-s0", "contended"]
