"""The live adaptive loop (`experiments.adaptive_sweep.run_adaptive`) without training (issue 41): the
scheduler and the runs' evidence are stand-ins, the decisions and adaptive.jsonl are real. Each
rung's decisions record the pair, n, the interval, its level and the rule; a re-run re-decides
nothing; `--stop-when-decided` ends the sweep once one configuration is left; a sweep that cannot
be adaptive is refused before anything is submitted. (tests/test_adaptive_slurm.py runs the same
loop on the real local Slurm with real training.)"""

from __future__ import annotations

import json

import numpy as np
import pytest

from analysis.adaptive import Evidence
from experiments import adaptive_sweep as A
from experiments.sweep_spec import select_runs


class _Console:
    def __init__(self):
        self.lines: list[str] = []

    def print(self, *args, **kwargs):
        self.lines.append(" ".join(str(a) for a in args))


@pytest.fixture
def live(monkeypatch, tmp_path):
    """Every run 'trains' at once (nothing submitted); the evidence at a rung is given per config."""
    import experiments.run_state as RS
    import experiments.submission as SUB

    spec, runs = select_runs("loss_type", "tiny", seeds=[0, 1, 2])
    submitted: list[int] = []
    monkeypatch.setattr(RS, "plan", lambda rr, root, retry_failed=False: [
        RS.Planned(r, tmp_path / spec.name / r.name, "submit") for r in rr])
    monkeypatch.setattr(SUB, "submit", lambda planned, *a, **k: submitted.append(len(planned)) or [])
    monkeypatch.setattr(SUB, "wait", lambda *a, **k: {})
    monkeypatch.setattr(A, "_not_at", lambda *a, **k: [])
    seed_effect = np.array([0.0, 0.03, -0.02])
    level = {"dapo": 0.70, "gspo": 0.40, "cispo": 0.6995}  # gspo: a clear loser; cispo: a tie with dapo, just behind
    noise = {"dapo": [0.0, 0.0, 0.0], "gspo": [0.001, -0.002, 0.0], "cispo": [0.001, -0.001, 0.0005]}

    def evidence(sweep_dir, sweep, configs, rung, budget, compute, *, law=False):
        return {c: {s: Evidence(float(level[c] + seed_effect[s] + noise[c][s])) for s in range(3)}
                for c in configs}

    monkeypatch.setattr(A, "_evidence", evidence)
    return spec, runs, tmp_path, submitted


def test_the_live_loop_records_each_decision_and_never_re_decides(live):
    spec, runs, root, submitted = live
    console = _Console()
    rc = A.run_adaptive(spec, runs, None, root, rungs=(0.25, 0.5, 1.0), equivalence=0.02, keep_equivalent=False,
                        console=console, stop_rule="tail")
    assert rc == 0
    rows = [json.loads(x) for x in (root / spec.name / A.ADAPTIVE_FILE).read_text().splitlines()]
    first = {r["config"]: r for r in rows if r["rung"] == 0.25}
    assert first["gspo"]["action"] == "stop" and first["gspo"]["verdict"] == "worse"
    assert first["gspo"]["pair"] == ["gspo", "dapo"] and first["gspo"]["n"] == 3 and first["gspo"]["paired"]
    assert first["gspo"]["level"] == pytest.approx(1 - 0.05 / 2 / 2)  # Holm step 1 of 2, ALPHA over 2 rungs
    assert first["gspo"]["rule"].startswith("tail: worse") and first["gspo"]["stop_rule"] == "tail"
    assert first["cispo"]["action"] == "stop" and first["cispo"]["verdict"] == "equivalent"
    assert first["cispo"]["rule"].startswith("tail: equivalent") and first["cispo"]["high"] < 0.02
    assert {r["rung"] for r in rows} == {0.25, 0.5, 1.0}
    assert submitted == [9, 3, 3]  # every run to the first rung, then dapo's three seeds alone
    assert set(A.stopped_configs(root / spec.name)) == {"gspo", "cispo"}
    # the same command again: every rung decided before, nothing submitted, nothing appended
    n = len(rows)
    console2 = _Console()
    assert A.run_adaptive(spec, runs, None, root, rungs=(0.25, 0.5, 1.0), equivalence=0.02, keep_equivalent=False,
                          console=console2, stop_rule="tail") == 0
    assert len((root / spec.name / A.ADAPTIVE_FILE).read_text().splitlines()) == n
    assert submitted == [9, 3, 3] and sum("decided before" in x for x in console2.lines) == 3


def test_stop_when_decided_ends_the_sweep_at_the_rung_that_decides_it(live):
    spec, runs, root, submitted = live
    console = _Console()
    assert A.run_adaptive(spec, runs, None, root, rungs=(0.25, 0.5, 1.0), equivalence=0.02, keep_equivalent=False,
                          console=console, stop_rule="tail", finish_leader=False) == 0
    rows = [json.loads(x) for x in (root / spec.name / A.ADAPTIVE_FILE).read_text().splitlines()]
    assert {r["rung"] for r in rows} == {0.25} and submitted == [9]
    assert rows[-1]["config"] == "dapo" and rows[-1]["rule"].startswith("decided")
    assert any("decided at rung 0.25" in x for x in console.lines)
    again = _Console()
    assert A.run_adaptive(spec, runs, None, root, rungs=(0.25, 0.5, 1.0), equivalence=0.02, keep_equivalent=False,
                          console=again, stop_rule="tail", finish_leader=False) == 0
    assert submitted == [9] and any("decided before" in x for x in again.lines)


def test_a_sweep_that_cannot_be_adaptive_is_refused_before_anything_is_submitted(live):
    spec, runs, root, submitted = live
    one_seed = [r for r in runs if r.seed == 0]
    with pytest.raises(A.AdaptiveError, match="--seeds"):
        A.run_adaptive(spec, one_seed, None, root, rungs=(0.25, 1.0), equivalence=0.02, keep_equivalent=False,
                       console=_Console())
    assert submitted == [] and not (root / spec.name / A.ADAPTIVE_FILE).exists()
