"""benchmarks/tool_use.py reads a run's held-out curve and its tool meters (first and last tenth)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import tool_use  # noqa: E402


def test_run_summary_takes_first_and_last_tenths(tmp_path, capsys):
    run = tmp_path / "tool_use" / "calculator-s0"
    run.mkdir(parents=True)
    (run / "run.json").write_text("{}")
    metrics = [{"step": 0}] + [{"step": s, "tool_calls_per_sample": s / 20, "malformed_call_frac": 1 - s / 20}
                               for s in range(1, 21)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics) + '{"step": 21, "tool_')
    evals = [{"step": 0, "pass_rate": 0.25}, {"step": 10, "pass_rate": 0.5, "benchmark": "x"}, {"step": 20, "pass_rate": 0.7}]
    (run / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    s = tool_use.run_summary(run)
    assert s["steps"] == 20 and s["eval_first"] == 0.25 and s["eval_last"] == 0.7  # the benchmark row is not held-out
    assert s["tool_calls_per_sample_first"] == pytest.approx((1 + 2) / 2 / 20)  # steps 1-2 (a tenth of 20)
    assert s["tool_calls_per_sample_last"] == pytest.approx((19 + 20) / 2 / 20)
    assert s["malformed_call_frac_last"] == pytest.approx(1 - 39 / 40)
    assert tool_use.main([str(tmp_path / "tool_use")]) == 0
    assert "| calculator-s0 | 20 | 0.250 | 0.700 | 0.08 -> 0.97 | 0.93 -> 0.03 |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no runs under"):
        tool_use.main([str(tmp_path / "nothing")])
