"""How a peer of a run ends (every process but learner-0): the exit codes the local supervisor
(launcher.py) reads, ending the process from any thread, and the first peer's last word in
run.json when the hub is gone. Used by worker.py (learner ranks >= 1) and generator.py.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from components.trainer.runlog import record_failure
from components.trainer.transport import Aborted, HubLost

__all__ = ["EXIT_ABORTED", "EXIT_HUB_LOST", "RECORD_LIMIT_S", "exit_code_of", "exit_process", "record_hub_lost"]

# Exit codes of a peer (every process but learner-0) that ends because of the hub; the local
# supervisor (launcher.py) reads them: EXIT_HUB_LOST means learner-0 is dead, stopped or hung.
EXIT_ABORTED = 3  # the hub aborted the run (it is ending it), or the transport failed
EXIT_HUB_LOST = 5  # the hub was silent for heartbeat_timeout_s, or closed
RECORD_LIMIT_S = 10.0  # a dying process waits this long at most for its last words to be written


def exit_code_of(error) -> int:
    """The exit code of a peer that ends because of transport `error` (HubLost or not)."""
    return EXIT_HUB_LOST if isinstance(error, HubLost) else EXIT_ABORTED


def exit_process(code: int, record=None) -> None:
    """End this process from any thread (os._exit: also while the main thread is blocked inside a
    collective), after `record()` if that returns within RECORD_LIMIT_S (a run directory on a hung
    file system must not keep alive a process whose hub is gone)."""
    timer = threading.Timer(RECORD_LIMIT_S, os._exit, (code,))
    timer.daemon = True
    timer.start()
    try:
        if record is not None:
            record()
    except BaseException:  # noqa: BLE001 - dying anyway
        pass
    finally:
        os._exit(code)


def record_hub_lost(setup, error, first_peer: bool) -> None:
    """learner-0 died (no supervisor under Slurm): the first peer marks the run failed, naming it."""
    if not first_peer or isinstance(error, Aborted) or not setup.run_dir:
        return
    record_failure(Path(setup.run_dir), f"learner-0 was lost: {error}", only_if_running=True)  # never raises
