"""experiments/report.py: the end-of-run report of `scalerl train` (fit, figure, start/end pass rate)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from analysis.scaling_law import sigmoid
from experiments.report import FIGURE_STEM, REPORT_FILE, finish_report, load_curve


def _write_evals(run_dir, compute, pass_rate):
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "eval.jsonl", "w") as f:
        for i, (c, r) in enumerate(zip(compute, pass_rate)):
            f.write(json.dumps({"step": 20 * i, "compute_hours": float(c), "flops": 1e9 * (i + 1), "pass_rate": float(r)}) + "\n")


def test_report_recovers_a_known_sigmoid(tmp_path, capsys):
    compute = np.concatenate([[1e-6], np.geomspace(1e-3, 5e-2, 25)])  # [26], like a tiny_cpu run (R0 at the start)
    truth = dict(A=0.82, B=2.5, C_mid=8e-3, R0=0.24)
    _write_evals(tmp_path, compute, sigmoid(compute, **truth))
    report = finish_report(tmp_path)
    fit = report["fit"]
    assert fit is not None and report["fit_error"] is None
    assert fit["A"] == pytest.approx(truth["A"], abs=0.01)
    assert fit["B"] == pytest.approx(truth["B"], rel=0.1)
    assert fit["C_mid"] == pytest.approx(truth["C_mid"], rel=0.1)
    assert report["start_pass_rate"] == pytest.approx(float(sigmoid(compute[0], **truth)))
    assert report["end_pass_rate"] == pytest.approx(float(sigmoid(compute[-1], **truth)))
    assert report["evaluations"] == 26
    for ext in ("png", "pdf"):
        assert (tmp_path / f"{FIGURE_STEM}.{ext}").stat().st_size > 1000
    assert json.loads((tmp_path / REPORT_FILE).read_text())["fit"]["A"] == pytest.approx(fit["A"])
    out = capsys.readouterr().out
    assert "held-out pass rate: start" in out and "sigmoid law fit: A=" in out


def test_flat_curve_gives_a_report_without_fit(tmp_path, capsys):
    compute = np.linspace(1e-3, 1e-2, 8)
    _write_evals(tmp_path, compute, np.full(8, 0.3) - np.linspace(0, 0.05, 8))  # falling: no gain over R0
    report = finish_report(tmp_path)
    assert report["fit"] is None and "no gain" in report["fit_error"]
    assert (tmp_path / f"{FIGURE_STEM}.png").exists()
    assert "sigmoid law fit: none" in capsys.readouterr().out


def test_curve_keeps_the_last_evaluation_at_a_repeated_compute_and_skips_nan(tmp_path):
    tmp_path.mkdir(exist_ok=True)
    rows = [
        {"step": 0, "compute_hours": 0.001, "pass_rate": 0.2},
        {"step": 5, "compute_hours": 0.002, "pass_rate": float("nan")},
        {"step": 10, "compute_hours": 0.003, "pass_rate": 0.4},
        {"step": 10, "compute_hours": 0.003, "pass_rate": 0.5},  # a resumed run re-evaluated
    ]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    c, r, steps = load_curve(tmp_path)
    assert c.tolist() == [0.001, 0.003] and r.tolist() == [0.2, 0.5] and steps.tolist() == [0, 10]


def test_missing_evaluations_are_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="eval.jsonl"):
        finish_report(tmp_path)


def test_the_report_prints_a_with_its_profile_interval_and_whether_it_is_identified(tmp_path, capsys):
    """Issue 43 item 7: the end-of-run report gives A's 95% profile-likelihood interval
    (analysis.scaling_law.profile_A) and says whether A is identified (at most 0.1 wide, neither end
    at a bound): a curve that has plateaued pins A down; one stopped before its midpoint does not."""
    rng = np.random.default_rng(0)
    compute = np.concatenate([[1e-6], np.geomspace(1e-3, 5e-2, 25)])
    truth = dict(A=0.82, B=2.5, C_mid=8e-3, R0=0.24)
    _write_evals(tmp_path / "plateau", compute, sigmoid(compute, **truth) + rng.normal(0, 0.005, compute.size))
    report = finish_report(tmp_path / "plateau")
    a = report["A_interval"]
    assert a["identified"] and a["low"] <= truth["A"] <= a["high"] and a["width"] <= 0.1 and a["level"] == 0.95
    assert json.loads((tmp_path / "plateau" / REPORT_FILE).read_text())["A_interval"] == a
    out = capsys.readouterr().out
    assert f"asymptote A: A = {report['fit']['A']:.3f}, 95% profile interval [{a['low']:.3f}, {a['high']:.3f}]" in out
    assert ": identified (at most 0.1 wide)" in out, out
    early = compute[compute <= 4e-3]  # stopped well before C_mid: the plateau is not in the data
    _write_evals(tmp_path / "early", early, sigmoid(early, **truth) + rng.normal(0, 0.005, early.size))
    report = finish_report(tmp_path / "early")
    assert report["fit"] is not None and not report["A_interval"]["identified"]
    assert "NOT identified" in capsys.readouterr().out
