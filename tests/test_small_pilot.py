"""benchmarks/small_pilot.py on the committed logs: the pilot's pick is re-made from results/small_pilot,
and `--study` judges the same criteria on the study's baseline runs (results/small), each role read
from the run that plays it (checked against report/runs.csv, read here independently)."""

from __future__ import annotations

import math

from pathlib import Path

import pandas as pd
import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def pilot(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import small_pilot

    return small_pilot


def test_the_pilot_is_judged_as_benchmarks_md_records_it(pilot, capsys):
    meas = pilot.measure(REPO / "results" / "small_pilot")
    assert {c for c, _ in meas} == {"c10", "c8", "c10w"} and len(meas) == 6
    verdict = pilot.judge(meas, pilot.vocabulary_size(REPO))
    met = {c: sum(ok for ok, _ in v.values()) for c, v in verdict.items()}
    assert met == {"c10": 5, "c8": 6, "c10w": 5}
    assert pilot.main([str(REPO / "results" / "small_pilot")]) == 0
    assert "**Pick: c8**" in capsys.readouterr().out


def test_the_study_mode_reads_each_role_from_the_run_that_plays_it(pilot, capsys):
    root = REPO / "results" / "small"
    runs = pd.read_csv(root / "report" / "runs.csv")
    runs["key"] = runs["sweep"] + "/" + runs["run"]
    runs = runs.set_index("key")
    meas = pilot.measure_study(root)
    seeds = sorted(s for _, s in meas)
    assert seeds and seeds == sorted(int(k.rsplit("-s", 1)[1]) for k in runs.index if k.startswith("scalerl_seeds/"))
    for (_, seed), m in meas.items():
        s = runs.loc[f"scalerl_seeds/scalerl-s{seed}"]
        assert m["p50"] == s["completion_tokens_p50"] and m["s_lag_max"] == s["lag_max"]
        if f"fp32_head/bf16-s{seed}" not in runs.index:  # scalerl_seeds' fifth seed: no B, BH or BK run
            assert math.isnan(m["b_clip"]) and math.isnan(m["gap_bh"]) and math.isnan(m["bk_lag_max"])
            continue
        b = runs.loc[f"fp32_head/bf16-s{seed}"]
        assert m["b_clip"] == pytest.approx(b["clip_frac_low"] + b["clip_frac_high"])
        assert m["gap_bh"] == runs.loc[f"fp32_head/bf16_fp32_head-s{seed}", "logprob_gap"]
        assert m["bk_lag_max"] == runs.loc[f"off_policy/ppo_off_policy-k8-s{seed}", "lag_max"]
    assert pilot.main([str(root), "--study"]) == 0
    out = capsys.readouterr().out
    assert "| criterion | study |" in out and "Pick" not in out
    # a seed without a role's run is not measured on that role's criteria (—), and not counted as failing them
    seven = next(line for line in out.splitlines() if line.startswith("| 7: "))
    assert "—" in seven and "no" not in seven.split("(", 1)[1]


def test_a_criterion_is_judged_on_the_seeds_that_measured_it(pilot):
    nan = float("nan")
    row = dict(p50=50.0, p90=90.0, p10=20.0, r0=0.2, clean_warm=True, tail=0.5, A=0.6, A_identified=True,
               gap_b=0.002, gap_bh=0.001, bk_lag_max=7.0, s_lag_max=8.0, b_clip=0.02, minutes=8.0)
    meas = {("c", 0): row, ("c", 1): dict(row, gap_b=nan, gap_bh=nan, bk_lag_max=nan, b_clip=nan)}
    v = pilot.judge(meas, vocab=5000)["c"]
    assert v["7"] == (True, "yes, —") and v["9"] == (True, "yes, —") and v["6"][0]
    assert v["1"] == (True, "yes, yes")
    v = pilot.judge({("c", 1): meas[("c", 1)]}, vocab=5000)["c"]  # measured on no seed: not met
    assert v["7"] == (False, "—")
    v = pilot.judge({**meas, ("c", 2): dict(row, bk_lag_max=6.0)}, vocab=5000)["c"]
    assert v["7"] == (False, "yes, —, no")


def test_a_folder_without_runs_is_refused(pilot, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert pilot.main([str(tmp_path / "empty"), "--study"]) == 1
    assert "no finished S run under" in capsys.readouterr().err
