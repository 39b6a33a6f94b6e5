"""One verdict rule everywhere, and the measured efficiency metric `auc` (issue 40 item 2); the run
table's mechanism meters (issue 40 item 3, analysis side).

The rule: a 95% interval inside ±δ is `equivalent` (even where it excludes 0: a real difference
smaller than δ), otherwise `better` / `worse` where it excludes 0, else `inconclusive`; a claim
"a higher than b" whose pair is `equivalent` reads `not reproduced`.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from analysis.compare import auc_values, compare_pair, difference, verdict_of, window_start
from analysis.meters import METER_COLUMNS, meters_text, run_meters
from analysis.study import claim_verdict, summarize
from analysis.synthetic import write_run

SEEDS = (0, 1, 2, 3)


def test_a_small_real_difference_inside_the_margin_is_equivalent_with_its_interval():
    """bs768 vs bs512 in tiny_long read [−0.008, −0.004]: inside ±0.02 and excluding 0. One rule:
    equivalent, reported with the interval that shows the (small) difference."""
    a = {s: 0.80 + 0.001 * s for s in SEEDS}
    b = {s: a[s] + 0.006 + 0.0005 * (-1) ** s for s in SEEDS}
    d = difference(a, b)
    assert d.high < 0 and d.low > -0.02  # excludes 0, inside ±δ
    assert d.verdict == "equivalent"
    assert verdict_of(d.low, d.high, d.p_equivalent) == "equivalent"
    # the same difference with a larger margin than the data support is `worse`
    wide = {s: b[s] + 0.03 for s in SEEDS}
    assert difference(a, wide).verdict == "worse"
    assert claim_verdict("same_A", "equivalent") == "agree"
    assert claim_verdict("a_higher_A", "equivalent") == "not reproduced"
    assert claim_verdict("a_better", "equivalent") == "not reproduced"
    assert claim_verdict("a_higher_A", "inconclusive") == "inconclusive"


def test_the_equivalence_verdict_matches_the_printed_95_interval_exactly():
    """TOST at 2.5% a side decides `equivalent` exactly when the printed 95% interval lies inside
    ±δ (random paired samples, both sides of the boundary)."""
    rng = np.random.default_rng(3)
    seen = set()
    for _ in range(400):
        n = int(rng.integers(3, 7))
        base = rng.normal(0.6, 0.05, n)
        a = dict(enumerate(base + rng.normal(rng.normal(0, 0.015), rng.uniform(0.002, 0.02), n)))
        b = dict(enumerate(base))
        d = difference(a, b)
        inside = -0.02 < d.low and d.high < 0.02
        assert (d.verdict == "equivalent") == inside, (d.low, d.high, d.verdict)
        if not inside:
            want = "better" if d.low > 0 else "worse" if d.high < 0 else "inconclusive"
            assert d.verdict == want
        seen.add(d.verdict)
    assert seen == {"equivalent", "better", "worse", "inconclusive"}


def test_auc_is_the_log_compute_mean_of_the_curve():
    """A curve linear in ln C: its log-compute mean over [s, e] is the value at the middle of ln C."""
    c = np.geomspace(1.0, 64.0, 13)
    curves = {"x": (np.r_[0.0, c], np.r_[0.1, 0.2 + 0.05 * np.log(c)]),
              "y": (np.r_[0.0, 2 * c], np.r_[0.1, 0.3 + 0.0 * c])}
    assert window_start(curves) == 2.0  # the later of the first positive evaluations
    got = auc_values(curves)
    s, e = 2.0, 64.0
    assert got["x"] == pytest.approx(0.2 + 0.05 * 0.5 * (math.log(s) + math.log(e)), abs=1e-12)
    assert got["y"] == pytest.approx(0.3, abs=1e-12)
    # a curve that is not linear in ln C: against an independent trapezoid on a fine grid
    r = 0.1 + 0.6 / (1 + (8.0 / c) ** 1.5)
    fine = np.geomspace(s, e, 20001)
    ref = np.trapezoid(np.interp(np.log(fine), np.log(c), r), np.log(fine)) / (math.log(e) - math.log(s))
    assert auc_values({"z": (c, r)}, end=e, start=s)["z"] == pytest.approx(ref, abs=1e-7)
    # a run that stops before the window's end has no auc
    assert math.isnan(auc_values({"short": (c[:5], r[:5])}, end=e, start=s)["short"])


def _sweep(root, laws, *, sweep="loss_aggregation", value_factor="train.aggregation"):
    rng = np.random.default_rng(11)
    seed_effect = rng.normal(0, 0.02, len(SEEDS))
    for s, u in zip(SEEDS, seed_effect):
        for config, (A, B, C) in laws.items():
            write_run(root, sweep, f"{config}-s{s}", A=A + u, B=B, C_mid=C, R0=0.1, seed=s, factor=value_factor,
                      value=config, steps=120, eval_every=3, final_compute=10.0, noise=0.003, device="cpu",
                      count=2, metrics_extra={"clip_frac_low": 0.001 * (1 + (config == "prompt_mean")),
                                              "clip_frac_high": 0.02, "completion_tokens_p50": 60.0})


def test_auc_tells_a_faster_configuration_from_one_that_only_ends_the_same(tmp_path):
    """Same A and the same end, one configuration gets there with a quarter of the compute: `tail`
    reads equivalent, `auc` reads better; `scalerl compare --metric auc` prints it."""
    _sweep(tmp_path, {"prompt_mean": (0.7, 2.5, 0.5), "token_mean": (0.7, 2.5, 2.0)})
    s = summarize(tmp_path)["loss_aggregation"]
    tail = compare_pair(s.runs, s.sweep, "prompt_mean", "token_mean", "tail")
    auc = compare_pair(s.runs, s.sweep, "prompt_mean", "token_mean", "auc")
    assert tail.verdict == "equivalent", tail.text()
    assert auc.verdict == "better" and auc.diff.low > 0.02, auc.text()
    claim = s.claims.set_index("b").loc["token_mean"]  # prompt_mean > token_mean (Fig 14a)
    assert claim["verdict_auc"] == "agree" and claim["verdict_tail"] == "not reproduced"
    assert s.configs.set_index("config").loc["prompt_mean", "auc"] > s.configs.set_index("config").loc["token_mean", "auc"]


def test_run_meters_summarise_a_runs_steps():
    rows = [{"step": i, "completion_tokens_p10": 10 + i, "completion_tokens_p50": 50, "completion_tokens_p90": 150,
             "clip_frac_low": 0.01 * i, "clip_frac_high": 0.02, "ratio_p01": 0.8, "ratio_p99": 1.2 + 0.1 * i,
             "lag_mean": 1.0 * i, "lag_max": 2 * i, "logprob_gap_mean": 0.5, "logprob_gap_lag0": 0.01,
             "zero_variance_frac": 0.25, "curriculum_active": 100 - 10 * i, "truncation_rate": 0.1,
             "interrupted_frac": 0.0} for i in range(1, 6)]
    rows.append({"step": 6, "clip_frac_low": math.nan, "lag_mean": math.nan})  # a step that trained nothing
    m = run_meters(rows)
    assert set(m) == set(METER_COLUMNS)
    assert m["completion_tokens_p10"] == 13 and m["completion_tokens_p90"] == 150
    assert m["clip_frac_low"] == pytest.approx(0.03) and m["clip_frac_high"] == pytest.approx(0.02)
    assert m["ratio_p99"] == pytest.approx(1.5) and m["lag_mean"] == pytest.approx(3.0) and m["lag_max"] == 10
    assert m["logprob_gap"] == pytest.approx(0.01)  # the lag-0 gap when logged, not the gap with staleness in it
    assert m["pool_left_min"] == 50 and m["zero_variance_frac"] == pytest.approx(0.25)
    old = run_meters([{"logprob_gap_mean": 0.004}, {"logprob_gap_mean": 0.002}])  # a run before the meters
    assert old["logprob_gap"] == pytest.approx(0.003) and math.isnan(old["clip_frac_low"])


def test_the_run_table_and_the_report_tables_carry_the_meters(tmp_path):
    _sweep(tmp_path, {"prompt_mean": (0.7, 2.5, 0.5), "token_mean": (0.7, 2.5, 2.0)})
    s = summarize(tmp_path)["loss_aggregation"]
    named = ["completion_tokens_p10", "completion_tokens_p50", "completion_tokens_p90", "clip_frac_low",
             "clip_frac_high", "ratio_p01", "ratio_p99", "lag_mean", "lag_max", "logprob_gap",
             "zero_variance_frac", "pool_left_min"]
    assert set(named) <= set(s.runs.columns)
    pm = s.runs[s.runs["config"] == "prompt_mean"]
    assert np.allclose(pm["clip_frac_low"], 0.002) and (pm["completion_tokens_p50"] == 60).all()
    assert "prompt_mean: length p50 60" in s.claims.iloc[0]["meters"]  # what was logged, nothing else
    text = meters_text(s.runs, ["prompt_mean", "token_mean"], ("clip_frac_low",))
    assert text == "prompt_mean: clipped low 0.20%; token_mean: clipped low 0.10%"
    assert json.dumps(s.claims.iloc[0]["meters"])
    assert pd.api.types.is_float_dtype(s.runs["clip_frac_high"])


def test_runs_from_before_the_meters_print_what_they_logged():
    """An older run logged clip_frac (no sides), completion_len_mean (no quantiles) and the step's
    extreme ratios: the report prints those in place of the meters it lacks."""
    old = run_meters([{"clip_frac": 0.0002, "completion_len_mean": 6.8, "is_ratio_min": 0.86, "is_ratio_max": 1.16},
                      {"clip_frac": 0.0004, "completion_len_mean": 7.0, "is_ratio_min": 0.88, "is_ratio_max": 1.14}])
    runs = pd.DataFrame([{"config": "dapo", **old}])
    text = meters_text(runs, ["dapo"], ("clip_frac_low", "clip_frac_high", "ratio_p01", "ratio_p99",
                                        "completion_tokens_p50"))
    assert text == "dapo: clipped 0.03%, ratio min 0.870, ratio max 1.150, length mean 6.9"
