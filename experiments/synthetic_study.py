"""A synthetic results folder of the whole study, named as `scalerl sweep` names its runs: every
shipped sweep spec (experiments/sweeps/*.gin) expanded by the sweep's own `expand`, one run
directory per (config, seed) written by `analysis.synthetic.write_run` with the configuration's
law from `analysis.synthetic.SYNTHETIC_SWEEPS`. For tests (`scalerl status`, the reproduction
report) and docs:

    write_study(root, seeds=(0, 1, 2))
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterable, Mapping

from analysis.runs import config_name
from analysis.synthetic import DEFAULT_LAW, SYNTHETIC_SWEEPS, write_run
from experiments.recipes import SWEEPS_DIR
from experiments.sweep_spec import expand, load_spec, slug

__all__ = ["write_study", "launch_config_name"]


def launch_config_name(factor: str, value: Any) -> str:
    """The configuration name `scalerl sweep` gives a value of SYNTHETIC_SWEEPS (its run
    names are `<config>-s<seed>`): a recipe file's stem, `<param><number>` for a number
    (`k4`, `eps_max4.0`), else the value's slug."""
    if isinstance(value, str) and value.endswith(".gin"):
        return slug(Path(value).stem)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{factor.rsplit('.', 1)[-1]}{slug(value)}"
    return slug(value)


def write_study(
    root: str | Path,
    *,
    seeds: Iterable[int] = (0, 1, 2),
    sweeps: Iterable[str] | None = None,
    scale: float = 1e-4,
    laws: Mapping[tuple[str, str], tuple[float, float, float]] | None = None,
    run_kwargs: Mapping[tuple[str, str], Mapping[str, Any]] | None = None,
    spec_scale: str = "paper",
    **kwargs: Any,
) -> dict[str, list[Path]]:
    """A synthetic results folder of the whole study: every shipped sweep spec
    (experiments/sweeps/*.gin, or the named ones) expanded by `scalerl sweep`'s own `expand`
    with `seeds`, one run directory per (config, seed) named exactly as a real sweep names it,
    run.json carrying the run's sweep/factor/value/recipe/seed.

    Each config follows its SYNTHETIC_SWEEPS law (by `launch_config_name`), else DEFAULT_LAW;
    `laws[(sweep, config)]` overrides one (A, B, C_mid). C_mid is multiplied by `scale`.
    `run_kwargs[(sweep, run name)]` passes extra `write_run` keywords to one run (e.g.
    {"contention": 0.2}). spec_scale: the scale the specs are expanded at (names are the same
    at both; "paper" avoids importing the trainer's components).
    """
    names = sorted(p.stem for p in SWEEPS_DIR.glob("*.gin")) if sweeps is None else list(sweeps)
    seeds = tuple(seeds)
    out: dict[str, list[Path]] = {}
    for name in names:
        spec = load_spec(name)
        spec = dataclasses.replace(spec, seeds=seeds)
        known = {}
        if spec.name in SYNTHETIC_SWEEPS:
            factor, values = SYNTHETIC_SWEEPS[spec.name]
            known = {launch_config_name(factor, v): law for v, law in values.items()}
        out[spec.name] = []
        for run in expand(spec, spec_scale):
            config = config_name(run.name)
            A, B, C_mid = (laws or {}).get((spec.name, config), known.get(config, DEFAULT_LAW))
            kw = {**kwargs, **dict((run_kwargs or {}).get((spec.name, run.name), {}))}
            out[spec.name].append(write_run(
                root, spec.name, run.name, A=A, B=B, C_mid=C_mid * scale, factor=run.factor,
                value=run.value, recipe=run.recipe, seed=run.seed, **kw))
    return out
