"""The adaptive-sweep rule (analysis/adaptive.py) and its replay on finished sweeps (issues 32, 41):
a stop rests on the pair's own paired interval against the leader (Holm over a rung's
comparisons), never on noise pooled from other pairs; the law-based stop; the rule's error rate
on equal configurations measured over many synthetic sweeps; replay on synthetic sweeps of known
truth, its `agreement`, and `scalerl replay`."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from analysis.adaptive import (ALPHA, DEFAULT_RUNGS, TIE_ALPHA, Evidence, agreement_of, config_prediction, decide_rung,
                               holm_levels, parse_rungs, parse_stop_rule, replay, rung_alpha)
from analysis.compare import Difference
from analysis.synthetic import write_sweep

RUN_KW = dict(steps=60, eval_every=2, device="cpu", count=2, final_compute=10.0)
ROW_FIELDS = {"sweep", "compute_fraction", "full_best", "adaptive_best", "agrees", "agreement", "stopped"}


def _ev(values):
    """config -> [value per seed] as measured evidence."""
    return {c: {s: Evidence(float(v)) for s, v in enumerate(vs)} for c, vs in values.items()}


def test_rungs_rules_and_holm_levels():
    assert parse_rungs("0.25,0.5,1.0") == (0.25, 0.5, 1.0) == parse_rungs([0.25, 0.5, 1])
    assert parse_rungs(",".join(map(str, DEFAULT_RUNGS))) == DEFAULT_RUNGS and DEFAULT_RUNGS[-1] == 1.0
    for bad in ("0.5,0.25,1", "0.25,0.5", "0,1", "a,1", "0.5,0.5,1", "1.5"):
        with pytest.raises(ValueError, match="rungs"):
            parse_rungs(bad)
    assert parse_stop_rule("Law") == "law"
    with pytest.raises(ValueError, match="stop rule"):
        parse_stop_rule("pooled")
    assert rung_alpha(2) == pytest.approx(ALPHA / 2) and rung_alpha(0) == pytest.approx(ALPHA)
    # Holm: sorted by p, the i-th is tested at alpha/(m − i); after the first not rejected, all keep its level
    lv = holm_levels({"a": 0.001, "b": 0.02, "c": 0.03, "d": math.nan}, 0.05)
    assert lv["a"] == pytest.approx(1 - 2 * 0.05 / 4) and lv["b"] == pytest.approx(1 - 2 * 0.05 / 3)
    assert lv["c"] == pytest.approx(lv["b"]) and lv["d"] == pytest.approx(lv["b"])  # b not rejected (0.02 >= 0.0167)
    lv = holm_levels({"a": 0.001, "b": 0.005, "c": 0.03}, 0.05)
    assert lv["c"] == pytest.approx(1 - 2 * 0.05 / 1)  # a and b rejected: c is tested at the full alpha


def test_a_clear_loser_stops_a_tie_stops_unless_kept_and_the_rest_continue():
    shared = np.array([0.0, 0.05, -0.04, 0.02])  # the seed effect every configuration shares
    ev = _ev({"best": 0.7 + shared, "loser": 0.55 + shared + [0.002, -0.001, 0.0, 0.001],
              "a_tie": 0.7 + shared + [0.001, -0.002, 0.001, 0.0], "unclear": 0.68 + shared + [0.015, -0.02, 0.01, 0.0]})
    d = {x.config: x for x in decide_rung(ev, 0.25, n_early_rungs=2)}
    assert (d["best"].verdict, d["best"].action) == ("best", "continue")
    assert (d["loser"].verdict, d["loser"].action) == ("worse", "stop") and d["loser"].diff.paired
    assert d["loser"].diff.high < 0 and d["loser"].best == "best" and d["loser"].rule.startswith("tail: worse")
    assert (d["a_tie"].verdict, d["a_tie"].action) == ("equivalent", "stop")
    tie = d["a_tie"].diff
    assert -0.02 < tie.low < tie.high < 0.02
    # each decision records the pair, n, the interval and the level that made it, and the rule
    row = d["loser"].as_dict()
    assert row["pair"] == ["loser", "best"] and row["n"] == 4 and row["paired"] is True
    assert row["level"] == pytest.approx(1 - rung_alpha(2) / 3)  # the smallest p of 3: two-sided Holm step 1
    assert row["rule"].startswith("tail: worse") and json.dumps(row)
    assert d["a_tie"].as_dict()["level"] == pytest.approx(1 - 2 * TIE_ALPHA / 3)  # the smallest TOST p of 3
    assert (d["unclear"].verdict, d["unclear"].action) == ("inconclusive", "continue")
    assert "worse than best" in d["loser"].text() and "n=4" in d["loser"].text()
    kept = {x.config: x for x in decide_rung(ev, 0.25, keep_equivalent=True)}
    assert kept["a_tie"].action == "continue" and kept["loser"].action == "stop"
    last = decide_rung(ev, 1.0)  # the last rung stops nothing: what is left ran the full budget
    assert {x.action for x in last} == {"done"}


def test_a_stop_needs_the_pairs_own_evidence_not_noise_pooled_from_other_pairs():
    """Twelve configurations track the leader seed by seed (tiny per-seed differences), one does not
    (per-seed differences of about ±0.02 around −0.004, like cispo's in the tiny-long loss_type
    sweep). Pooling the run noise over all of them (the old blocked interval) puts that one's
    interval inside ±0.02 and would stop it as a tie; its own paired interval is far wider, so it
    runs on."""
    from scipy import stats

    seed = np.array([0.0, 0.04, -0.03, 0.02])
    vals = {"leader": 0.80 + seed}
    for k in range(12):
        vals[f"tight{k:02d}"] = 0.80 + seed + [0.001, -0.001, 0.0005, -0.0005] - 0.0003 * (k + 1)
    vals["noisy"] = 0.80 + seed + [-0.02, 0.015, -0.022, 0.012]
    X = np.array(list(vals.values()))  # [14, 4]
    resid = X - X.mean(1, keepdims=True) - X.mean(0, keepdims=True) + X.mean()
    df = (X.shape[0] - 1) * (X.shape[1] - 1)
    se = math.sqrt((resid ** 2).sum() / df) * math.sqrt(2 / X.shape[1])
    delta = X[-1].mean() - X[0].mean()
    q = stats.t.ppf(1 - TIE_ALPHA, df)
    assert -0.02 < delta - q * se and delta + q * se < 0.02  # the pooled interval would have stopped it
    d = {x.config: x for x in decide_rung(_ev(vals), 0.25, n_early_rungs=2)}
    assert d["noisy"].action == "continue" and d["noisy"].verdict == "inconclusive"
    own = d["noisy"].diff
    assert own.paired and own.n == 4 and own.high - own.low > 0.04  # its own interval: far wider than ±0.02
    assert d["noisy"].as_dict()["tie_low"] < -0.02 or d["noisy"].as_dict()["tie_high"] > 0.02


def test_without_two_shared_seeds_nothing_is_stopped():
    ev = {"a": {0: Evidence(0.8), 1: Evidence(0.81)}, "b": {2: Evidence(0.3), 3: Evidence(0.31)}}
    d = {x.config: x for x in decide_rung(ev, 0.25)}
    other = d["b"] if d["a"].verdict == "best" else d["a"]
    assert other.action == "continue" and "no paired interval" in other.rule


def _pred(center: float, sd: float, seed: int, k: int = 400) -> Evidence:
    return Evidence(center, center, np.random.default_rng(seed).normal(center, sd, k))


def test_the_law_stops_a_configuration_whose_upper_bound_is_below_the_leaders_lower_bound():
    ev = {"lead": {0: _pred(0.85, 0.01, 1), 1: _pred(0.86, 0.01, 2)},
          "low": {0: _pred(0.70, 0.01, 3), 1: _pred(0.71, 0.01, 4)},
          "near": {0: _pred(0.84, 0.01, 5), 1: _pred(0.85, 0.01, 6)}}
    m, lo, hi, n = config_prediction(ev["low"])
    assert n == 2 and lo < m < hi and m == pytest.approx(0.705)
    d = {x.config: x for x in decide_rung(ev, 0.25, stop_rule="law")}
    assert d["low"].action == "stop" and d["low"].verdict == "worse" and d["low"].rule.startswith("law")
    row = d["low"].as_dict()
    assert row["law_high"] < row["leader_low"] and row["high"] < 0 and row["level"] == 0.95
    assert d["near"].action == "continue"
    # a configuration the law cannot predict is never stopped by it
    ev["low"][1] = Evidence(0.71)
    d = {x.config: x for x in decide_rung(ev, 0.25, stop_rule="law")}
    assert d["low"].action == "continue"
    # both: either rule stops
    d = {x.config: x for x in decide_rung(ev, 0.25, stop_rule="both")}
    assert d["low"].action == "stop" and d["low"].rule.startswith("tail")
    # the seed-to-seed spread of the predictions widens a configuration's interval
    spread = {0: _pred(0.70, 0.01, 3), 1: _pred(0.80, 0.01, 4)}
    _, lo2, hi2, _ = config_prediction(spread)
    assert hi2 - lo2 > 3 * (hi - lo)


def _false_stop_rate(k: int, *, corrected: bool, reps: int = 1500) -> tuple[float, int]:
    """k equal configurations, 3 seeds with a shared seed effect, two early rungs, `reps` sweeps:
    the share of the k − 1 configurations that could be stopped that ever are, as `worse`. Each
    rung draws afresh (independent looks: the worst case for the correction). corrected=False:
    each comparison alone, one-sided at ALPHA (no Holm, no split over the looks, no account of the
    leader being the data's choice)."""
    from scipy import stats

    rng = np.random.default_rng(7)
    stopped = 0
    for _ in range(reps):
        alive = {f"c{i}" for i in range(k)}
        seed = rng.normal(0, 0.05, 3)
        for rung in (0.25, 0.5):
            vals = {c: 0.6 + seed + rng.normal(0, 0.01, 3) for c in sorted(alive)}
            if len(vals) < 2:
                break
            if corrected:
                worse = [d.config for d in decide_rung(_ev(vals), rung, n_early_rungs=2, keep_equivalent=True)
                         if d.verdict == "worse"]
            else:
                best = max(vals, key=lambda c: vals[c].mean())
                worse = [c for c in vals if c != best
                         and stats.ttest_rel(vals[c], vals[best], alternative="less").pvalue < ALPHA]
            stopped += len(worse)
            alive -= set(worse)
    return stopped / (reps * (k - 1)), reps * (k - 1)


@pytest.mark.parametrize("k", [2, 4])
def test_equal_configurations_are_stopped_as_losers_at_most_the_stated_rate(k):
    """The rule's error rate, measured: a configuration equal to the leader is stopped as a loser
    at most ALPHA of the time (Monte Carlo slack 3 sd); each comparison alone at ALPHA stops it more
    often (the correction is not a no-op)."""
    rate, n = _false_stop_rate(k, corrected=True)
    assert rate <= ALPHA + 3 * math.sqrt(ALPHA * (1 - ALPHA) / n), rate
    naive, _ = _false_stop_rate(k, corrected=False)
    assert naive > rate


def test_agreement_is_said_as_it_is():
    def d(verdict):
        return Difference(-0.004, -0.024, 0.016, 3, 3, 3, True, 0.3, 0.02, verdict)

    assert agreement_of("a", "a", None) == "same"
    assert agreement_of("a", "b", d("equivalent")) == "equivalent"
    assert agreement_of("a", "b", d("inconclusive")) == "undecided"
    assert agreement_of("a", "b", d("worse")) == "different"


def test_replay_keeps_the_clearly_better_configuration_and_stops_the_others_early(tmp_path):
    write_sweep(tmp_path, "loss_type", "train.loss",
                {"cispo": (0.85, 1.8, 1.0), "dapo": (0.5, 1.8, 1.0), "gspo": (0.55, 1.8, 1.0)},
                seeds=(0, 1, 2), noise=0.003, **RUN_KW)
    (res,) = replay(tmp_path, rungs=(0.25, 0.5, 1.0))
    assert res.full_best == res.adaptive_best == "cispo"
    assert res.agrees and res.agreement == "same" and {s["config"] for s in res.stopped} == {"dapo", "gspo"}
    assert all(s["rung"] == 0.25 and s["verdict"] == "worse" for s in res.stopped)
    assert res.compute_fraction == pytest.approx((1 + 0.25 + 0.25) / 3)
    row = res.as_dict()
    assert ROW_FIELDS <= set(row) and row["agreement"] == "same" and row["difference"] is None
    assert all({"config", "rung", "verdict", "rule"} == set(s) for s in row["stopped"])
    (dec,) = replay(tmp_path, rungs=(0.25, 0.5, 1.0), finish_leader=False)  # the sweep ends once decided
    assert dec.adaptive_best == "cispo" and dec.compute_fraction == pytest.approx(0.25)


def test_replay_of_equal_configurations_agrees_and_never_stops_one_as_a_loser(tmp_path):
    write_sweep(tmp_path, "advantage_norm", "train.advantage_norm",
                {"batch": (0.7, 1.8, 1.0), "prompt": (0.7, 1.8, 1.0)}, seeds=(0, 1, 2), noise=0.02, **RUN_KW)
    (res,) = replay(tmp_path, keep_equivalent=True)
    assert res.agreement in ("same", "equivalent", "undecided")
    assert not any(s["verdict"] == "worse" for s in res.stopped)
    assert res.agrees == (res.agreement in ("same", "equivalent"))


def test_scalerl_replay_cli(tmp_path, capsys):
    from experiments.cli import main

    write_sweep(tmp_path, "loss_type", "train.loss", {"cispo": (0.85, 1.8, 1.0), "none": (0.5, 1.8, 1.0)},
                seeds=(0, 1, 2), noise=0.003, **RUN_KW)
    assert main(["replay", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 1 and rows[0]["sweep"] == "loss_type" and rows[0]["agrees"] is True
    assert ROW_FIELDS <= set(rows[0]) and rows[0]["agreement"] == "same"
    assert 0 < rows[0]["compute_fraction"] < 1
    assert main(["replay", str(tmp_path), "--rungs", "0.25,0.5,1", "--stop-rule", "both"]) == 0
    text = capsys.readouterr().out
    assert "best none" not in text.replace("\n", " ") and '"none"' in text  # a config named none is quoted
    assert "same pick" in text
    for rule in ("tail", "law", "both"):
        assert f"{rule} rule:" in text
    with pytest.raises(SystemExit) as e:
        main(["replay", str(tmp_path), "--rungs", "0.5,0.25"])
    assert e.value.code == 2 and "rungs" in capsys.readouterr().err
    assert main(["replay", str(tmp_path / "missing")]) == 2


def test_a_stopped_configuration_shows_in_status_with_its_decision(tmp_path):
    from experiments import status as S
    from experiments.adaptive_sweep import ADAPTIVE_FILE, budget_of, read_decisions, stop_text, stopped_configs

    write_sweep(tmp_path, "loss_type", "train.loss", {"cispo": (0.85, 1.8, 1.0), "dapo": (0.5, 1.8, 1.0)},
                seeds=(0, 1), noise=0.003, **RUN_KW)
    line = {"rung": 0.25, "config": "dapo", "best": "cispo", "metric": "measured tail", "delta": -0.12,
            "low": -0.15, "high": -0.09, "n": 2, "paired": True, "verdict": "worse", "action": "stop"}
    (tmp_path / "loss_type" / ADAPTIVE_FILE).write_text(json.dumps(line) + "\n" + '{"rung": 0.5, "conf')  # torn line
    assert read_decisions(tmp_path / "loss_type") == [line] and set(stopped_configs(tmp_path / "loss_type")) == {"dapo"}
    assert stop_text(line) == "stopped (rung 0.25: worse than cispo by -0.120 [-0.150, -0.090])"
    assert stop_text({**line, "rule": "law: predicted upper bound below"}).endswith("predicted by the law)")
    rows = {r.run: r for r in S.collect(tmp_path / "loss_type", with_slurm=False)}
    assert rows["dapo-seed0"].state == rows["dapo-seed1"].state == "stopped"
    assert rows["dapo-seed0"].reason == stop_text(line) and rows["cispo-seed0"].state == "done"
    assert budget_of(["train.compute_budget_flops = 5e+12", "train.lr = 1", "train.compute_budget_flops = 2e12"]) == 2e12
    assert budget_of(["train.lr = 1"]) is None
