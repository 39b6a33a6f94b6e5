"""`scalerl sweep --adaptive --dry-run` tells the truth (issue 41, item 5): it prints each rung's
budget per run and per configuration, and refuses, before anything is submitted, a sweep whose
configurations share fewer than two seeds (naming --seeds) and a paper-scale sweep without
`train.compute_budget_flops`."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments.adaptive_sweep import AdaptiveError, check_adaptive, rung_budgets
from experiments.sweep_spec import BUDGET_KEY, select_runs

REPO = Path(__file__).resolve().parent.parent


def _sweep(tmp_path, capsys, *extra: str) -> tuple[int, str]:
    from experiments.cli import main

    capsys.readouterr()
    rc = main(["sweep", "loss_type", "--executor", "local", "--runs", str(tmp_path / "runs"), "--adaptive",
               "--dry-run", *extra])
    out = capsys.readouterr()
    return rc, " ".join((out.out + out.err).split())  # rich wraps long lines


@pytest.fixture(autouse=True)
def _repo(monkeypatch):
    monkeypatch.chdir(REPO)


def test_one_seed_is_refused_naming_seeds(tmp_path, capsys):
    rc, text = _sweep(tmp_path, capsys, "--scale", "tiny")
    assert rc == 2 and "--seeds" in text and "shared by every configuration" in text and "Nothing submitted" in text
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("run.json"))


def test_paper_scale_without_a_budget_is_refused_before_anything_is_submitted(tmp_path, capsys):
    rc, text = _sweep(tmp_path, capsys, "--seeds", "0", "1", "2")
    assert rc == 2 and BUDGET_KEY in text and "Nothing submitted" in text
    rc, text = _sweep(tmp_path, capsys, "--seeds", "0", "1", "2", "--gin", f"{BUDGET_KEY} = 1e15")
    assert rc == 0 and "adaptive rungs" in text


def test_the_dry_run_prints_each_rungs_budget(tmp_path, capsys):
    rc, text = _sweep(tmp_path, capsys, "--scale", "tiny", "--seeds", "0", "1", "2", "--rungs", "0.25,0.5,1")
    assert rc == 0, text
    assert "adaptive rungs (tail rule; budget W = 5e+12 FLOPs per run)" in text
    assert "0.25 W" in text and "1.25e+12" in text  # per run at the first rung
    assert "3.75e+12" in text  # per configuration (3 seeds) at the first rung
    assert "1.5e+13" in text  # per configuration at the end
    assert "nothing submitted" in text
    assert not any((tmp_path / "runs").rglob("run.json"))


def test_check_adaptive_and_rung_budgets():
    _, runs = select_runs("loss_type", "tiny", seeds=[0, 1])
    assert check_adaptive(runs, (0.25, 0.5, 1.0)) == 5e12
    rows = rung_budgets(runs, (0.25, 1.0), 5e12)
    assert rows[0]["flops_per_run"] == 1.25e12 and rows[0]["configs"]["dapo"] == 2.5e12
    _, one = select_runs("loss_type", "tiny", seeds=[0])
    with pytest.raises(AdaptiveError, match="--seeds"):
        check_adaptive(one, (0.25, 1.0))
    # seeds that do not pair across configurations do not count
    mixed = [r for r in runs if not (r.name.startswith("dapo") and r.seed == 1)]
    with pytest.raises(AdaptiveError, match="shared by every configuration"):
        check_adaptive(mixed, (0.25, 1.0))
    _, paper = select_runs("loss_type", "paper", seeds=[0, 1])
    with pytest.raises(AdaptiveError, match=BUDGET_KEY):
        check_adaptive(paper, (0.25, 1.0))
