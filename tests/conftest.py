"""Session-wide test settings.

The warm-start cache (components/warm_start.py) is one empty directory per test session, as on
a fresh machine. The main job's test (tests/test_main_job.py) builds tiny_cpu.gin's
warm-started policy in a fresh directory of its own and copies it here, so the Slurm jobs of
tests/test_slurm.py, which run later in a whole-suite run, find it instead of building it again.
`SCALERL_TEST_REUSE_CACHE=1` uses the user's own cache instead (faster on a second local run).
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _session_warm_start_cache(tmp_path_factory):
    if os.environ.get("SCALERL_TEST_REUSE_CACHE"):
        yield None
        return
    cache = tmp_path_factory.mktemp("warm_start_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SCALERL_CACHE_DIR", str(cache))  # subprocesses and Slurm jobs (--export=ALL) inherit it
        yield cache
