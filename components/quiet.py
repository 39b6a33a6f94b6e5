"""Library output that says nothing to the user, silenced: one progress bar per long task.

transformers prints a "Loading weights" bar on every `from_pretrained` and a "Writing model
shards" bar on every `save_pretrained`; in one `scalerl train` the policy is loaded by the
learner, the evaluation engine and every generator, so these bars appeared several times
around the trainer's own bar. Hugging Face datasets and huggingface_hub print bars per split
and file. `quiet_libraries()` turns those bars off (idempotent, per process; the trainer's and
warm start's own bars are untouched). Library *warnings and errors* still print: the logging
verbosity of transformers and datasets is left as it is, and only the specific warnings in
`KNOWN_NOISE` are filtered.

gin resolves an `include 'base.gin'` by trying every search path with every file reader; its
Python-package reader logs "Path not found: ..." at ERROR for each miss, also when the file is
then found on the next path (a sweep of 15 runs printed 30 such lines). `quiet_gin()` drops
exactly those records; a missing file still raises gin's own error.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

__all__ = ["quiet_libraries", "quiet_gin", "KNOWN_NOISE"]

# (message regex, category, module regex) of Python warnings that carry no information for a
# scalerl user. Keep it specific: never filter by category or module alone. Empty today: a
# tiny `run_training` (torch engine) and the three trackers show no Python warnings even under
# `python -W default`; math-verify's per-call "Timeout is disabled" log line is filtered where
# it is emitted (components/tasks/math_file.py).
KNOWN_NOISE: tuple[tuple[str, type, str], ...] = ()

_done = False


def quiet_libraries() -> None:
    """Disable the progress bars of transformers, huggingface_hub and datasets; filter KNOWN_NOISE."""
    global _done
    if _done:
        return
    _done = True
    # Environment defaults reach libraries imported later and spawned processes; a user's own
    # explicit setting of these variables wins.
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    if "huggingface_hub" in sys.modules:  # already imported: its env default was read
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "datasets" in sys.modules:  # importing it here would cost seconds
        import datasets

        datasets.disable_progress_bars()
    for message, category, module in KNOWN_NOISE:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


class _GinPathProbes(logging.Filter):
    """Drops gin's per-search-path "Path not found" records (gin/resource_reader.py) only."""

    def filter(self, record: logging.LogRecord) -> bool:
        probe = record.msg == "Path not found: %s" and record.pathname.endswith(os.path.join("gin", "resource_reader.py"))
        return not probe


_GIN_FILTER = _GinPathProbes()


def quiet_gin() -> None:
    """Silence gin's search-path probes on the root logger, where gin logs them (idempotent)."""
    root = logging.getLogger()
    if _GIN_FILTER not in root.filters:
        root.addFilter(_GIN_FILTER)
