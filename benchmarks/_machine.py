"""What machine a benchmark ran on, for the line it prints first (the benchmarks' shared helper;
run them as `python benchmarks/<name>.py`, which puts this folder on the path)."""

from __future__ import annotations

import platform
import subprocess


def cpu_model() -> str:
    """The CPU's model name (lscpu), else what `platform` knows."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")),
                    platform.processor())
    except (OSError, subprocess.SubprocessError):
        return platform.processor()
