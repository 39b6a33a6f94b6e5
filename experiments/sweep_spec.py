"""Sweep specs: a `sweep` gin file read into a `SweepSpec`, expanded into the `RunSpec`s it names.

A sweep spec is a small `.gin` file in `experiments/sweeps/` made only of bindings to a
`sweep` pseudo-configurable::

    sweep.name = "loss_type"
    sweep.base = "baseline.gin"               # the recipe every run starts from
    sweep.factor = "train.loss"               # a gin binding key ...
    sweep.values = ["dapo", "gspo", "cispo"]  # ... and the values it takes
    sweep.seeds = [0]
    sweep.tiny_base = "tiny_cpu.gin"          # `--scale tiny`: the CPU setting (default)
    sweep.tiny_values = [...]                 # optional: values mapped onto the CPU scale
                                              # (run names then carry the value that ran: k1, not k4)

Instead of `factor` + `values`, a sweep may list named override sets (leave-one-out, or a
factor that moves several bindings together)::

    sweep.factor = "leave_one_out"
    sweep.variants = {"scalerl": [], "loo-dapo": ['train.loss = "dapo"'], ...}

and `sweep.factor = "recipe"` with `sweep.values = ["scalerl.gin", "minimax.gin", ...]`
swaps the recipe itself. Optional keys: `overrides` / `tiny_overrides` (bindings added to
every run; a run's bindings are, in order, at tiny scale the tiny compute budget
(`TINY_SCALE_BINDINGS`), overrides, the factor's, at tiny scale tiny_overrides, the seed), `tiny_variants`,
`tiny_names` (variant -> the name its tiny-scale runs take, saying what ran: {"gen8": "gen4"}),
`description`. At tiny scale run.json records `paper_name`, the paper's name of what ran. `base` and `tiny_base` may list several files
(e.g. a recipe and an overlay from experiments/sweeps/overlays/).

The spec is NOT parsed into gin's global config (a run's own gin config is): it is read
statement by statement with gin's own parser (`gin.config_parser.ConfigParser`) into a
plain `SweepSpec`, so a spec never clashes with, or leaks into, a training config.

    spec = load_spec("loss_type")             # a path, or a name in experiments/sweeps/
    runs = expand(spec, "tiny")               # [RunSpec(name="dapo-s0", config_files=..., bindings=...), ...]
    spec, runs = select_runs("loss_type", "tiny", seeds=[0, 1], only=["dapo-s0"])

Each run gets a stable name from its factor value and seed (`cispo-s0`) and lands in
`<runs>/<sweep>/<run>/`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from experiments.recipes import (SWEEPS_DIR, SweepError, algorithm_bindings, gin_literal, gin_parser,
                                 resolve_config, tiny_batch_bindings)

SPEC_KEYS = (
    "name", "description", "base", "factor", "values", "variants", "seeds", "overrides",
    "tiny_base", "tiny_values", "tiny_variants", "tiny_names", "tiny_overrides",
    "small_base", "small_values", "small_variants", "small_names", "small_overrides", "seed_binding", "paper_ablation",
)
SCALES = ("paper", "tiny", "small")


@dataclass(frozen=True)
class SweepSpec:
    name: str
    base: tuple  # recipe file(s), applied in order
    factor: str
    values: tuple = ()
    variants: dict = field(default_factory=dict)  # name -> tuple of bindings
    seeds: tuple = (0,)
    overrides: tuple = ()
    tiny_base: tuple = ("tiny_cpu.gin",)
    tiny_values: tuple | None = None
    tiny_variants: dict | None = None
    tiny_names: dict = field(default_factory=dict)  # variant -> its name at tiny scale (what ran)
    tiny_overrides: tuple = ()
    # `--scale small` (the small testbed, small_cpu.gin): each key defaults to the PAPER's value (the
    # small scale runs the paper's settings where they fit), the base to tiny_base with tiny_cpu.gin
    # replaced by small_cpu.gin; no tiny_overrides apply
    small_base: tuple | None = None
    small_values: tuple | None = None
    small_variants: dict | None = None
    small_names: dict = field(default_factory=dict)
    small_overrides: tuple = ()
    seed_binding: str = "train.seed"
    description: str = ""
    path: str = ""
    # a paper ablation: `scalerl reproduce` runs it and analysis/findings.py holds the paper's claims
    # about it; False (`sweep.paper_ablation = False`): a sweep beyond the paper, run by `scalerl sweep`
    paper_ablation: bool = True


@dataclass(frozen=True)
class RunSpec:
    """One run of a sweep: what to train and where."""

    name: str
    sweep: str
    factor: str
    value: Any
    recipe: str
    seed: int
    config_files: tuple
    bindings: tuple
    paper_name: str = ""  # the paper's name of this configuration where the run's name says what ran

    def run_info(self) -> dict:
        info = {"name": self.name, "sweep": self.sweep, "factor": self.factor,
                "value": self.value, "recipe": self.recipe, "seed": self.seed}
        if self.paper_name:
            info["paper_name"] = self.paper_name
        return info


class _SpecDelegate:
    """gin parser delegate: a sweep spec holds literals only (no @references or %macros)."""

    def configurable_reference(self, name, evaluate):  # noqa: D401
        raise SweepError(f"sweep specs hold literal values only; got a reference @{name}")

    def macro(self, name):
        raise SweepError(f"sweep specs hold literal values only; got a macro %{name}")



def resolve_spec_path(spec: str | os.PathLike) -> Path:
    """A spec path as given, or a bare name looked up in experiments/sweeps/."""
    p = Path(spec)
    candidates = [p, SWEEPS_DIR / p, SWEEPS_DIR / f"{p}.gin"]
    for c in candidates:
        if c.is_file():
            return c
    known = ", ".join(sorted(q.stem for q in SWEEPS_DIR.glob("*.gin")))
    raise SweepError(f"sweep spec {str(spec)!r} not found (looked at {', '.join(map(str, candidates))}); "
                     f"shipped sweeps: {known}")


def parse_spec_text(text: str, *, default_name: str = "sweep", path: str = "") -> SweepSpec:
    """Parse the `sweep.<key> = <literal>` statements of a spec (no gin global state)."""
    cp = gin_parser()
    raw: dict[str, Any] = {}
    try:
        for stmt in cp.ConfigParser(text, _SpecDelegate()):
            if not isinstance(stmt, cp.BindingStatement):
                raise SweepError(f"{path or 'sweep spec'}: only `sweep.<key> = <value>` lines are allowed, "
                                 f"got {type(stmt).__name__} at line {stmt.location.line_num}")
            if stmt.scope or stmt.selector != "sweep":
                raise SweepError(f"{path or 'sweep spec'}: line {stmt.location.line_num}: expected `sweep.<key>`, "
                                 f"got {stmt.selector!r} (a run's bindings go inside sweep.overrides/variants)")
            if stmt.arg_name not in SPEC_KEYS:
                raise SweepError(f"{path or 'sweep spec'}: unknown key sweep.{stmt.arg_name}; valid keys: "
                                 f"{', '.join(SPEC_KEYS)}")
            raw[stmt.arg_name] = stmt.value
    except SyntaxError as err:
        raise SweepError(f"{path or 'sweep spec'}: cannot parse: {err}") from None
    return spec_from_dict(raw, default_name=default_name, path=path)


def spec_from_dict(raw: dict, *, default_name: str = "sweep", path: str = "") -> SweepSpec:
    where = path or "sweep spec"
    for key in ("base", "factor"):
        if key not in raw:
            raise SweepError(f"{where}: sweep.{key} is required")
    has_values, has_variants = "values" in raw, "variants" in raw
    if has_values == has_variants:
        raise SweepError(f"{where}: give exactly one of sweep.values or sweep.variants")

    def _bindings(x, key) -> tuple:
        if isinstance(x, str):
            x = [x]
        if not isinstance(x, (list, tuple)) or not all(isinstance(b, str) for b in x):
            raise SweepError(f"{where}: sweep.{key} must be a list of binding strings, got {x!r}")
        return tuple(x)

    def _variants(x, key) -> dict:
        if not isinstance(x, dict) or not x:
            raise SweepError(f"{where}: sweep.{key} must be a non-empty dict name -> list of bindings")
        return {str(k): _bindings(v, f"{key}[{k!r}]") for k, v in x.items()}

    def _values(x, key) -> tuple:
        if not isinstance(x, (list, tuple)) or not x:
            raise SweepError(f"{where}: sweep.{key} must be a non-empty list, got {x!r}")
        return tuple(x)

    seeds = raw.get("seeds", [0])
    if isinstance(seeds, int):
        seeds = [seeds]
    if not isinstance(seeds, (list, tuple)) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise SweepError(f"{where}: sweep.seeds must be a non-empty list of ints, got {seeds!r}")
    def _files(x, key) -> tuple:
        x = [x] if isinstance(x, str) else x
        if not isinstance(x, (list, tuple)) or not all(isinstance(f, str) for f in x) or (
                not x and raw.get("factor") != "recipe"):  # a recipe sweep's values are the recipes
            raise SweepError(f"{where}: sweep.{key} must be a gin file or a list of gin files, got {x!r}")
        return tuple(x)

    spec = SweepSpec(
        name=str(raw.get("name", default_name)),
        base=_files(raw["base"], "base"),
        factor=str(raw["factor"]),
        values=_values(raw["values"], "values") if has_values else (),
        variants=_variants(raw["variants"], "variants") if has_variants else {},
        seeds=tuple(seeds),
        overrides=_bindings(raw.get("overrides", []), "overrides"),
        tiny_base=_files(raw.get("tiny_base", "tiny_cpu.gin"), "tiny_base"),
        tiny_values=_values(raw["tiny_values"], "tiny_values") if "tiny_values" in raw else None,
        tiny_variants=_variants(raw["tiny_variants"], "tiny_variants") if "tiny_variants" in raw else None,
        tiny_names=_names(raw.get("tiny_names", {}), where, "tiny_names"),
        tiny_overrides=_bindings(raw.get("tiny_overrides", []), "tiny_overrides"),
        small_base=_files(raw["small_base"], "small_base") if "small_base" in raw else None,
        small_values=_values(raw["small_values"], "small_values") if "small_values" in raw else None,
        small_variants=_variants(raw["small_variants"], "small_variants") if "small_variants" in raw else None,
        small_names=_names(raw.get("small_names", {}), where, "small_names"),
        small_overrides=_bindings(raw.get("small_overrides", []), "small_overrides"),
        seed_binding=str(raw.get("seed_binding", "train.seed")),
        description=str(raw.get("description", "")),
        path=path,
        paper_ablation=_flag(raw.get("paper_ablation", True), "paper_ablation", where),
    )
    for scale in ("tiny", "small"):
        values, variants, names = (getattr(spec, f"{scale}_{k}") for k in ("values", "variants", "names"))
        if values is not None and has_variants:
            raise SweepError(f"{where}: sweep.{scale}_values goes with sweep.values; use sweep.{scale}_variants")
        if values is not None and len(values) != len(spec.values):
            raise SweepError(f"{where}: sweep.{scale}_values has {len(values)} entries but sweep.values "
                             f"has {len(spec.values)}; they map one to one")
        if variants is not None and set(variants) != set(spec.variants):
            raise SweepError(f"{where}: sweep.{scale}_variants must name the same variants as sweep.variants "
                             f"({', '.join(spec.variants)})")
        unknown = sorted(set(names) - set(spec.variants))
        if unknown:
            raise SweepError(f"{where}: sweep.{scale}_names names {unknown}, which are not variants; choose from "
                             f"{', '.join(spec.variants) or '(no variants)'}")
    if not re.fullmatch(r"[A-Za-z0-9._-]+", spec.name):
        raise SweepError(f"{where}: sweep.name {spec.name!r} must use letters, digits, '.', '_' or '-'")
    return spec


def _flag(raw: Any, key: str, where: str) -> bool:
    if not isinstance(raw, bool):
        raise SweepError(f"{where}: sweep.{key} must be True or False, got {raw!r}")
    return raw


def _names(raw: Any, where: str, key: str) -> dict:
    """sweep.tiny_names / small_names: {variant: name at that scale}, names usable as run names."""
    if not isinstance(raw, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in raw.items()):
        raise SweepError(f"{where}: sweep.{key} must map variant names to names, got {raw!r}")
    for v in raw.values():
        if not re.fullmatch(r"[A-Za-z0-9._+=-]+", v):
            raise SweepError(f"{where}: sweep.{key} value {v!r} must use letters, digits and . _ + = -")
    return dict(raw)


def load_spec(spec: str | os.PathLike) -> SweepSpec:
    path = resolve_spec_path(spec)
    return parse_spec_text(path.read_text(), default_name=path.stem, path=str(path))


# ----------------------------------------------------------------------------------------
# Expansion into runs
# ----------------------------------------------------------------------------------------
def slug(value: Any) -> str:
    """A stable, filesystem-safe name for a factor value: 'cispo', '0.28', 'scalerl'."""
    if isinstance(value, bool):
        text = "on" if value else "off"
    elif isinstance(value, float):
        text = repr(value)
    elif isinstance(value, (list, tuple)):
        text = "_".join(slug(v) for v in value)
    else:
        text = str(value)
    text = re.sub(r"\.gin$", "", text)
    text = re.sub(r"[^A-Za-z0-9.+-]+", "_", text).strip("_.")
    return text or "value"


def run_name(value_name: Any, seed: int) -> str:
    return f"{slug(value_name)}-s{int(seed)}"

def _json_value(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


# Every run at `--scale tiny` trains to the same compute, as every forward ablation of the paper
# gets 3.5-4k GPU-hours (PAPER.md, "Compute unit"): the budget is the stopping rule, not the step
# count. It is counted in FLOPs (2N per generated token, 6N per trained token), which identical
# runs reproduce to 0.2%, where their wall-clock compute varies by a median 3.7% (max 10.8%) on
# a shared 2-core machine. 5e12 FLOPs is tiny_cpu.gin's baseline at about 500 steps (the tiny
# study's length before this budget); a run whose steps cost more (a larger batch, PPO-off-
# policy's extra rounds) stops at fewer steps, one whose steps cost less runs more of them.
# `train.total_steps` is raised to a safety cap only. Both come before the spec's tiny_overrides,
# so a spec (or `--gin`) may change them.
TINY_COMPUTE_BUDGET_FLOPS = 5.0e12
TINY_MAX_STEPS = 5000
TINY_SCALE_BINDINGS = (f"train.compute_budget_flops = {TINY_COMPUTE_BUDGET_FLOPS:g}",
                       f"train.total_steps = {TINY_MAX_STEPS}")


# `--scale small` (small_cpu.gin, the small testbed): every run trains to one compute budget too,
# set from the pilot (experiments/sweeps/pilots/small.gin, BENCHMARKS.md "The small testbed's pilot").
SMALL_COMPUTE_BUDGET_FLOPS = 1.8e13
SMALL_MAX_STEPS = 5000
SMALL_SCALE_BINDINGS = (f"train.compute_budget_flops = {SMALL_COMPUTE_BUDGET_FLOPS:g}",
                        f"train.total_steps = {SMALL_MAX_STEPS}")
BUDGET_KEY = "train.compute_budget_flops"  # the binding TINY_SCALE_BINDINGS and SMALL_SCALE_BINDINGS set


def budget_of(bindings: Sequence[str]) -> float | None:
    """The FLOP budget a list of gin bindings sets (the last binding wins), or None (none, `None`, or
    an expression: no number to compare against)."""
    budget = None
    for b in bindings:
        key, _, value = b.partition("=")
        if key.strip() == BUDGET_KEY:
            try:
                budget = float(value.strip())
            except ValueError:
                budget = None
    return budget


@dataclass(frozen=True)
class _ScaleView:
    """What a spec runs at one scale: base files, values or variants, names, overrides, budget."""

    base: tuple
    values: tuple
    variants: dict
    names: dict
    overrides: tuple
    scale_bindings: tuple
    cpu: bool  # a CPU scale (tiny, small): a recipe sweep re-applies the recipe's algorithm onto the base


def _scale_view(spec: SweepSpec, scale: str) -> _ScaleView:
    if scale not in SCALES:
        raise SweepError(f"unknown scale {scale!r}; choose from: {', '.join(SCALES)}")
    if scale == "paper":
        return _ScaleView(spec.base, spec.values, spec.variants, {}, (), (), False)
    if scale == "tiny":
        return _ScaleView(spec.tiny_base, spec.tiny_values if spec.tiny_values is not None else spec.values,
                          spec.tiny_variants if spec.tiny_variants is not None else spec.variants, spec.tiny_names,
                          spec.tiny_overrides, TINY_SCALE_BINDINGS, True)
    base = spec.small_base if spec.small_base is not None else tuple(
        "small_cpu.gin" if Path(f).name == "tiny_cpu.gin" else f for f in spec.tiny_base)
    return _ScaleView(base, spec.small_values if spec.small_values is not None else spec.values,
                      spec.small_variants if spec.small_variants is not None else spec.variants, spec.small_names,
                      spec.small_overrides, SMALL_SCALE_BINDINGS, True)


def expand(spec: SweepSpec, scale: str = "paper") -> list[RunSpec]:
    """The runs of a sweep at `scale` ("paper", "tiny" or "small"), in spec order, seeds innermost."""
    view = _scale_view(spec, scale)
    spec_dir = Path(spec.path).parent if spec.path else None
    # binding order (later wins): the CPU scale's stopping rule (first, so that any spec may change
    # it), overrides, the factor's bindings, the scale's overrides (they map sizes onto the CPU, also a
    # recipe's), the seed
    # (value name, value recorded in run.json, config files, factor bindings, the paper's name)
    cells: list[tuple[str, Any, tuple, tuple, str]] = []
    base = tuple(resolve_config(f, spec_dir) for f in view.base)
    if spec.variants:
        for vname in spec.variants:  # spec order
            shown = view.names.get(vname, vname)
            cells.append((shown, shown, base, tuple(view.variants[vname]), vname if shown != vname else ""))
    elif spec.factor == "recipe":
        # The recipe itself is the factor: each value is a gin file, applied before the
        # rest of the base (at a CPU scale the CPU base maps sizes onto the CPU).
        # At a CPU scale a paper recipe's sizes cannot run: the run takes the CPU base and re-applies
        # the recipe's ALGORITHM bindings (components and their hyper-parameters, see
        # `algorithm_bindings`) and its batch scaled by the base's (`tiny_batch_bindings`); the
        # scale's overrides map the rest.
        for shown, value in zip(spec.values, view.values):
            recipe = resolve_config(str(value), spec_dir)
            label = Path(str(shown)).stem if str(shown).endswith(".gin") else str(shown)
            if view.cpu and Path(recipe).resolve() in {Path(f).resolve() for f in base}:
                cells.append((label, label, base, (), ""))  # the CPU base IS this recipe (small_cpu.gin)
            elif view.cpu:
                cells.append((label, label, base, tuple(algorithm_bindings(recipe)) + tuple(tiny_batch_bindings(recipe, base)), ""))
            else:
                cells.append((label, label, (recipe,) + base, (), ""))
    else:
        param = spec.factor.rsplit(".", 1)[-1]
        # a number alone makes a poor name: prefix the parameter ("k8", "eps_max4.0"); the name
        # says the value that RAN (at tiny scale the tiny value: "k1" runs the paper's "k4")
        named = lambda v: f"{param}{slug(v)}" if isinstance(v, (int, float)) and not isinstance(v, bool) else v  # noqa: E731
        for shown, value in zip(spec.values, view.values):
            vname, paper = named(value), named(shown)
            cells.append((vname, _json_value(value), base, (f"{spec.factor} = {gin_literal(value)}",),
                          paper if paper != vname else ""))
    runs, seen = [], {}
    for vname, value, files, bindings, paper_name in cells:
        for seed in spec.seeds:
            name = run_name(vname, seed)
            if name in seen:
                raise SweepError(f"sweep {spec.name!r}: values {seen[name]!r} and {vname!r} give the same "
                                 f"run name {name!r}; rename one")
            seen[name] = vname
            seed_b = (f"{spec.seed_binding} = {int(seed)}",) if spec.seed_binding else ()
            runs.append(RunSpec(
                name=name, sweep=spec.name, factor=spec.factor, value=value,
                recipe="+".join(Path(f).stem for f in files), seed=int(seed), config_files=files,
                bindings=view.scale_bindings + tuple(spec.overrides) + tuple(bindings) + tuple(view.overrides) + seed_b,
                paper_name=paper_name,
            ))
    return runs


def select_runs(spec: str | os.PathLike, scale: str = "paper", *, seeds: Sequence[int] | None = None,
                extra_bindings: Sequence[str] = (), only: Sequence[str] | None = None) -> tuple[SweepSpec, list[RunSpec]]:
    """The spec and the runs to launch: `seeds` replace the spec's, `extra_bindings` come last in
    every run, `only` keeps the runs of these names (an unknown name is a SweepError)."""
    spec = load_spec(spec)
    if seeds:
        spec = dataclasses.replace(spec, seeds=tuple(seeds))
    runs = expand(spec, scale)
    if extra_bindings:
        runs = [dataclasses.replace(r, bindings=r.bindings + tuple(extra_bindings)) for r in runs]
    if only:
        names = [r.name for r in runs]
        unknown = [n for n in only if n not in names]
        if unknown:
            raise SweepError(f"--only: unknown run(s) {', '.join(unknown)}; runs of {spec.name}: {', '.join(names)}")
        runs = [r for r in runs if r.name in only]
    return spec, runs
