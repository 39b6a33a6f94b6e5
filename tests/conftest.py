"""Session-wide test settings.

The warm-start cache (components/warm_start.py) is one empty directory per test session, as on
a fresh machine. The main job's test (tests/test_main_job.py) builds tiny_cpu.gin's
warm-started policy in a fresh directory of its own and copies it here; it runs first in a
whole-suite run (pytest_collection_modifyitems), so every later test and Slurm job finds that
policy instead of building it again.
`SCALERL_TEST_REUSE_CACHE=1` uses the user's own cache instead (faster on a second local run).

A test marked `slurm` first waits (up to 2 minutes) for the test cluster's one node to be free of
jobs that are not its own, and fails at once naming them if it is not (tests/_slurm_queue.py):
otherwise its jobs would queue behind them until pytest's timeout, with nothing said.
"""

from __future__ import annotations

import os
import shutil

import pytest


def pytest_collection_modifyitems(session, config, items):
    """The main job's test first: the warm start it builds (as on a fresh machine) is the one every
    later test would otherwise build again into the session cache."""
    items.sort(key=lambda item: item.path.name != "test_main_job.py")  # stable: the rest keep their order


@pytest.fixture(scope="session", autouse=True)
def _session_warm_start_cache(tmp_path_factory):
    if os.environ.get("SCALERL_TEST_REUSE_CACHE"):
        yield None
        return
    cache = tmp_path_factory.mktemp("warm_start_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SCALERL_CACHE_DIR", str(cache))  # subprocesses and Slurm jobs (--export=ALL) inherit it
        yield cache


@pytest.fixture(autouse=True)
def _slurm_node_free(request):
    if request.node.get_closest_marker("slurm") is None or shutil.which("squeue") is None:
        yield
        return
    from _slurm_queue import wait_for_free_node  # tests/ is on sys.path (pytest's rootdir insertion)

    problem = wait_for_free_node()
    if problem:
        pytest.fail(problem, pytrace=False)
    yield
