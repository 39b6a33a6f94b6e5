"""Draw every paper figure whose runs exist; report the missing ones and why."""

from __future__ import annotations

import dataclasses
import importlib
import logging
import traceback
from pathlib import Path
from typing import Iterable

from paper_figures.common import MissingRuns, Options, RunData
from analysis.figure_specs import FIGURES

log = logging.getLogger(__name__)


def figure_module(fig_id: str):
    if fig_id not in FIGURES:
        raise KeyError(f"unknown figure {fig_id!r}; choose from: {', '.join(FIGURES)}")
    return importlib.import_module(f"paper_figures.{fig_id}")


def render_all(
    runs: str | Path,
    out_dir: str | Path,
    opts: Options = Options(),  # compute "auto" (the default) resolves from the runs
    only: Iterable[str] | None = None,
    progress: bool = False,
) -> tuple[dict[str, list[Path]], dict[str, str], dict[str, str]]:
    """Returns (written: id -> files, missing: id -> why, failed: id -> error)."""
    ids = list(FIGURES) if only is None else list(only)
    for i in ids:
        figure_module(i)  # unknown ids fail before any drawing
    data = RunData(runs)
    if opts.compute == "auto":  # one axis for every figure: FLOPs at tiny scale, device-hours otherwise
        from analysis.runs import resolve_compute

        opts = dataclasses.replace(opts, compute=resolve_compute(data.runs, "auto"))
    written, missing, failed = {}, {}, {}
    it: Iterable[str] = ids
    if progress:
        from tqdm import tqdm

        it = tqdm(ids, desc="figures", unit="fig")
    for fig_id in it:
        try:
            written[fig_id] = figure_module(fig_id).draw(data, out_dir, opts)
        except MissingRuns as e:
            missing[fig_id] = str(e)
        except Exception as e:  # noqa: BLE001 - one broken figure must not stop the others
            log.debug("figure %s failed:\n%s", fig_id, traceback.format_exc())
            failed[fig_id] = f"{type(e).__name__}: {e}"
    return written, missing, failed
