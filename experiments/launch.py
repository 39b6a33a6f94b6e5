"""`scalerl sweep`: one-factor-at-a-time sweeps through submitit (slurm | local | debug).

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

Each run gets a stable name from its factor value and seed (`cispo-s0`) and lands in
`<runs>/<sweep>/<run>/`. A sweep is submitted as ONE submitit job array. Re-running a
sweep skips runs whose run.json says done, leaves runs whose job is still queued or
running alone, resubmits the rest (the trainer resumes from the run's last checkpoint)
and resubmits failed runs only with `--retry-failed`. Whether a job is still queued or
running is the scheduler's word (squeue, sacct), not run.json's: a run whose job ended
before it recorded an end (scancel, node failure, ...) is interrupted and resumed
(`reconcile`). A run that hits its Slurm time limit or is preempted is checkpointed by
submitit (`RunJob` is `Checkpointable`) and requeued; it resumes from the last checkpoint in
its run directory.

Everything is validated before anything is submitted: unknown factors (gin configurables
and their parameters), values a component registry does not know, missing recipe files,
and a Slurm partition that does not exist.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Sequence

import submitit

from components.quiet import quiet_gin

EXPERIMENTS_DIR = Path(__file__).resolve().parent
CONFIGS_DIR = EXPERIMENTS_DIR / "configs"
SWEEPS_DIR = EXPERIMENTS_DIR / "sweeps"
DEFAULT_TARGET = "experiments.train:run_training"
SLURM_FILE = "slurm.json"  # written by the launcher at submission
ATTEMPTS_FILE = "attempts.jsonl"  # one line per job start (requeues included), written by the job

# `train.<param>` factors whose values are component names, and the registry that knows them.
COMPONENT_PARAMS = {
    "loss": "LOSSES",
    "aggregation": "AGGREGATIONS",
    "advantage_norm": "ADVANTAGE_NORMS",
    "curriculum": "CURRICULA",
    "precision": "PRECISIONS",
    "length_control": "LENGTH_CONTROLS",
    "off_policy": "OFF_POLICY",
    "task": "TASKS",
    "engine": "ENGINES",
}

SPEC_KEYS = (
    "name", "description", "base", "factor", "values", "variants", "seeds", "overrides",
    "tiny_base", "tiny_values", "tiny_variants", "tiny_names", "tiny_overrides", "seed_binding",
)


class SweepError(ValueError):
    """A sweep spec or launch option is wrong; raised before anything is submitted."""


# ----------------------------------------------------------------------------------------
# Sweep specs
# ----------------------------------------------------------------------------------------
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
    seed_binding: str = "train.seed"
    description: str = ""
    path: str = ""


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


class _AnyDelegate:
    """gin parser delegate for checking one binding: references and macros are opaque."""

    def configurable_reference(self, name, evaluate):
        return f"@{name}{'()' if evaluate else ''}"

    def macro(self, name):
        return f"%{name}"


def _gin_parser():
    import gin.config_parser as cp

    return cp


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
    cp = _gin_parser()
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
        tiny_names=_names(raw.get("tiny_names", {}), where),
        tiny_overrides=_bindings(raw.get("tiny_overrides", []), "tiny_overrides"),
        seed_binding=str(raw.get("seed_binding", "train.seed")),
        description=str(raw.get("description", "")),
        path=path,
    )
    if spec.tiny_values is not None and has_variants:
        raise SweepError(f"{where}: sweep.tiny_values goes with sweep.values; use sweep.tiny_variants")
    if spec.tiny_values is not None and len(spec.tiny_values) != len(spec.values):
        raise SweepError(f"{where}: sweep.tiny_values has {len(spec.tiny_values)} entries but sweep.values "
                         f"has {len(spec.values)}; they map one to one")
    if spec.tiny_variants is not None and set(spec.tiny_variants) != set(spec.variants):
        raise SweepError(f"{where}: sweep.tiny_variants must name the same variants as sweep.variants "
                         f"({', '.join(spec.variants)})")
    if not re.fullmatch(r"[A-Za-z0-9._-]+", spec.name):
        raise SweepError(f"{where}: sweep.name {spec.name!r} must use letters, digits, '.', '_' or '-'")
    unknown = sorted(set(spec.tiny_names) - set(spec.variants))
    if unknown:
        raise SweepError(f"{where}: sweep.tiny_names names {unknown}, which are not variants; choose from "
                         f"{', '.join(spec.variants) or '(no variants)'}")
    return spec


def _names(raw: Any, where: str) -> dict:
    """sweep.tiny_names: {variant: name at tiny scale}, names usable as run names."""
    if not isinstance(raw, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in raw.items()):
        raise SweepError(f"{where}: sweep.tiny_names must map variant names to names, got {raw!r}")
    for v in raw.values():
        if not re.fullmatch(r"[A-Za-z0-9._+=-]+", v):
            raise SweepError(f"{where}: sweep.tiny_names value {v!r} must use letters, digits and . _ + = -")
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


def gin_literal(value: Any) -> str:
    """A Python value written as a gin literal."""
    if isinstance(value, _Raw):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        inner = ", ".join(gin_literal(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{gin_literal(k)}: {gin_literal(v)}" for k, v in value.items()) + "}"
    raise SweepError(f"cannot write {value!r} ({type(value).__name__}) as a gin literal")


def resolve_config(name: str, relative_to: Path | None = None) -> str:
    """A config path named by a spec (a recipe, an overlay such as overlays/baseline.gin) or by a
    config's include: an absolute path as it is; a relative one next to the naming file
    (`relative_to`: the spec's or the config's own directory; without it, the path as given) first,
    then in the repository's experiments/sweeps/ and experiments/configs/, then relative to the
    working directory. A spec copied out of the repository therefore still finds the
    repository's recipes and overlays."""
    p = Path(name).expanduser()
    if p.is_absolute():
        candidates = [p]
    else:
        first = [relative_to / p] if relative_to is not None else [p]  # no naming file: the path as given
        candidates = first + [SWEEPS_DIR / p, CONFIGS_DIR / p, p]
    seen: list[Path] = []
    for c in candidates:
        if c not in seen:
            seen.append(c)
    for c in seen:
        if c.is_file():
            return str(c.resolve())
    known = ", ".join(sorted(q.name for q in CONFIGS_DIR.glob("*.gin"))) or "(none yet)"
    overlays = ", ".join(sorted(str(q.relative_to(SWEEPS_DIR)) for q in SWEEPS_DIR.glob("overlays/*.gin"))) or "(none)"
    raise SweepError(f"config {name!r} not found; looked in: {', '.join(str(c) for c in seen)}. "
                     f"Recipes in {CONFIGS_DIR}: {known}; overlays in {SWEEPS_DIR}: {overlays}")


class _Raw(str):
    """A gin reference or macro kept verbatim when a binding is written back out."""


class _KeepDelegate:
    def configurable_reference(self, name, evaluate):
        return _Raw(f"@{name}{'()' if evaluate else ''}")

    def macro(self, name):
        return _Raw(f"%{name}")


# `train.<param>`s that select the algorithm (not its scale, task, engine or schedule).
ALGORITHM_PARAMS = ("loss", "aggregation", "advantage_norm", "curriculum", "off_policy", "precision",
                    "length_control")
ALGORITHM_REGISTRIES = ("LOSSES", "AGGREGATIONS", "ADVANTAGE_NORMS", "CURRICULA", "PRECISIONS",
                        "LENGTH_CONTROLS", "OFF_POLICY")


def _is_algorithm_selector(selector: str, param: str) -> bool:
    from components import registry as reg

    name = selector.split(".")[-1]
    if name == "train":
        return param in ALGORITHM_PARAMS
    return any(name in getattr(reg, r) for r in ALGORITHM_REGISTRIES)


def algorithm_bindings(recipe: str, _seen: set | None = None) -> list[str]:
    """The bindings of a recipe (following its includes) that choose the algorithm:
    `train.loss/aggregation/advantage_norm/curriculum/off_policy/precision/length_control`
    and every hyper-parameter of a registered algorithm component (`cispo.eps_max`,
    `pipeline_rl.k`, ...), in file order, written back as gin binding strings."""
    from components.registry import load_builtin_components

    load_builtin_components()
    cp = _gin_parser()
    path = Path(recipe).resolve()
    seen = _seen if _seen is not None else set()
    if path in seen:
        return []
    seen.add(path)
    out = []
    for stmt in cp.ConfigParser(path.read_text(), _KeepDelegate()):
        if isinstance(stmt, cp.IncludeStatement):
            out += algorithm_bindings(resolve_config(stmt.filename, path.parent), seen)
        elif isinstance(stmt, cp.BindingStatement) and _is_algorithm_selector(stmt.selector, stmt.arg_name):
            scope = f"{stmt.scope}/" if stmt.scope else ""
            out.append(f"{scope}{stmt.selector}.{stmt.arg_name} = {gin_literal(stmt.value)}")
    return out


def recipe_binding(files: str | Sequence[str], selector: str, param: str, _seen: set | None = None) -> Any:
    """The value `files` (gin files applied in order, following their includes) bind to `selector.param`
    (the last binding wins), or None when none binds it."""
    cp = _gin_parser()
    value = None
    seen = _seen if _seen is not None else set()
    for f in ([files] if isinstance(files, (str, os.PathLike)) else list(files)):
        path = Path(f).resolve()
        if path in seen:
            continue
        seen.add(path)
        for stmt in cp.ConfigParser(path.read_text(), _KeepDelegate()):
            if isinstance(stmt, cp.IncludeStatement):
                inner = recipe_binding(resolve_config(stmt.filename, path.parent), selector, param, seen)
                value = inner if inner is not None else value
            elif (isinstance(stmt, cp.BindingStatement) and not stmt.scope and stmt.arg_name == param
                  and stmt.selector.split(".")[-1] == selector):
                value = stmt.value
    return value


# The batch of a recipe at tiny scale (`--scale tiny` of a `recipe` sweep): the recipe's prompts per
# step relative to the paper's default batch (base.gin: 48 prompts) keeps its ratio around the tiny
# base's batch: tiny = round(recipe x tiny base / 48), e.g. the DAPO and MiniMax recipes' 80 prompts
# -> round(80 x 16 / 48) = 27 on tiny_cpu.gin's 16. Generations per prompt likewise (16 in every
# paper recipe, so they keep the tiny base's).
BATCH_PARAMS = ("prompts_per_step", "generations_per_prompt")
PAPER_BATCH_REFERENCE = "base.gin"


def tiny_batch_bindings(recipe: str, tiny_base: Sequence[str]) -> list[str]:
    """`train.prompts_per_step` / `train.generations_per_prompt` bindings that keep `recipe`'s batch ratio
    to the paper's default batch at tiny scale (see BATCH_PARAMS); none where the ratio is 1."""
    reference = resolve_config(PAPER_BATCH_REFERENCE)
    out = []
    for param in BATCH_PARAMS:
        ref, tiny, ours = (recipe_binding(f, "train", param) for f in (reference, tuple(tiny_base), recipe))
        if ours is None or ref is None or tiny is None or int(ours) == int(ref):
            continue
        scaled = max(1, int(math.floor(int(ours) * int(tiny) / int(ref) + 0.5)))
        if scaled != int(tiny):
            out.append(f"train.{param} = {scaled}")
    return out


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


def expand(spec: SweepSpec, scale: str = "paper") -> list[RunSpec]:
    """The runs of a sweep at `scale` ("paper" or "tiny"), in spec order, seeds innermost."""
    if scale not in ("paper", "tiny"):
        raise SweepError(f"unknown scale {scale!r}; choose from: paper, tiny")
    spec_dir = Path(spec.path).parent if spec.path else None
    tiny = scale == "tiny"
    # binding order (later wins): the tiny scale's stopping rule (first, so that any spec may change
    # it), overrides, the factor's bindings, tiny_overrides (they map sizes onto the CPU, also a
    # recipe's), the seed
    scale_bindings = TINY_SCALE_BINDINGS if tiny else ()
    tiny_overrides = tuple(spec.tiny_overrides) if tiny else ()
    # (value name, value recorded in run.json, config files, factor bindings, the paper's name)
    cells: list[tuple[str, Any, tuple, tuple, str]] = []
    base = tuple(resolve_config(f, spec_dir) for f in (spec.tiny_base if tiny else spec.base))
    if spec.variants:
        variants = spec.tiny_variants if (tiny and spec.tiny_variants is not None) else spec.variants
        for vname in spec.variants:  # spec order
            shown = spec.tiny_names.get(vname, vname) if tiny else vname
            cells.append((shown, shown, base, tuple(variants[vname]), vname if shown != vname else ""))
    elif spec.factor == "recipe":
        # The recipe itself is the factor: each value is a gin file, applied before the
        # rest of the base (at tiny scale the tiny base maps sizes onto the CPU).
        # At tiny scale a paper recipe's sizes cannot run on a CPU: the run takes the tiny
        # base and re-applies the recipe's ALGORITHM bindings (components and their
        # hyper-parameters, see `algorithm_bindings`) and its batch scaled by the tiny base's
        # (`tiny_batch_bindings`); tiny_overrides map the rest.
        values = spec.tiny_values if (tiny and spec.tiny_values is not None) else spec.values
        for shown, value in zip(spec.values, values):
            recipe = resolve_config(str(value), spec_dir)
            label = Path(str(shown)).stem if str(shown).endswith(".gin") else str(shown)
            if tiny:
                cells.append((label, label, base, tuple(algorithm_bindings(recipe)) + tuple(tiny_batch_bindings(recipe, base)), ""))
            else:
                cells.append((label, label, (recipe,) + base, (), ""))
    else:
        values = spec.tiny_values if (tiny and spec.tiny_values is not None) else spec.values
        param = spec.factor.rsplit(".", 1)[-1]
        # a number alone makes a poor name: prefix the parameter ("k8", "eps_max4.0"); the name
        # says the value that RAN (at tiny scale the tiny value: "k1" runs the paper's "k4")
        named = lambda v: f"{param}{slug(v)}" if isinstance(v, (int, float)) and not isinstance(v, bool) else v  # noqa: E731
        for shown, value in zip(spec.values, values):
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
                bindings=scale_bindings + tuple(spec.overrides) + tuple(bindings) + tiny_overrides + seed_b,
                paper_name=paper_name,
            ))
    return runs


# ----------------------------------------------------------------------------------------
# Validation (before anything is submitted)
# ----------------------------------------------------------------------------------------
def parse_binding(binding: str) -> tuple[str, str, str, Any]:
    """'scope/train.loss = "dapo"' -> (scope, selector, param, value)."""
    cp = _gin_parser()
    try:
        stmts = list(cp.ConfigParser(binding, _AnyDelegate()))
    except SyntaxError as err:
        raise SweepError(f"cannot parse binding {binding!r}: {err}") from None
    if len(stmts) != 1 or not isinstance(stmts[0], cp.BindingStatement):
        raise SweepError(f"expected one `configurable.param = value` binding, got {binding!r}")
    s = stmts[0]
    return s.scope, s.selector, s.arg_name, s.value


def _load_trainer_configurables(target: str = DEFAULT_TARGET) -> None:
    """Fill the registries and import the module of the function the jobs will call (it
    registers the gin configurables the runs bind)."""
    from components.registry import load_builtin_components

    load_builtin_components()
    module = target.partition(":")[0]
    try:
        importlib.import_module(module)
        importlib.import_module("components.trainer.config")  # `train` and `model` (imported lazily by the trainer)
    except ImportError as err:
        raise SweepError(f"cannot import the trainer ({module}): {err}") from None


def _configurable_signature_params(fn: Any) -> list[str] | None:
    import inspect

    target = fn.__init__ if inspect.isclass(fn) else fn
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
        return None  # accepts anything
    return [p.name for p in sig.parameters.values() if p.name != "self"]


def check_binding(binding: str) -> None:
    """The binding's configurable and parameter exist; component-name values are registered."""
    import gin
    from components import registry as reg

    _scope, selector, param, value = parse_binding(binding)
    gin_registry = gin.config._REGISTRY  # gin's own selector map (no public lookup API)
    try:
        configurable = gin_registry.get_match(selector)
    except (KeyError, ValueError) as err:  # ValueError: ambiguous selector
        raise SweepError(f"binding {binding!r}: {err}") from None
    if configurable is None:
        known = list(getattr(gin_registry, "_selector_map", {}))  # complete selectors, e.g. "losses.cispo"
        close = _close(selector, sorted({k.rsplit(".", 1)[-1] for k in known} | set(known)))
        raise SweepError(f"unknown factor {selector}.{param} in binding {binding!r}: no gin configurable named "
                         f"{selector!r}.{close}")
    params = _configurable_signature_params(configurable.wrapped)
    if params is not None and param not in params:
        raise SweepError(f"unknown factor {selector}.{param} in binding {binding!r}: {selector} has no "
                         f"parameter {param!r}; its parameters: {', '.join(params)}.{_close(param, params)}")
    if configurable.name == "train" and param in COMPONENT_PARAMS:
        registry = getattr(reg, COMPONENT_PARAMS[param])
        names = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else []
        for name in names:  # train.curriculum is a list of names
            if not isinstance(name, str) or name.startswith(("@", "%")):
                continue
            try:
                registry.check(name)
            except reg.UnknownComponentError as err:
                raise SweepError(f"binding {binding!r}: {err}") from None


def _close(word: str, choices: Iterable[str]) -> str:
    import difflib

    m = difflib.get_close_matches(word, list(choices), n=1)
    return f" Did you mean {m[0]!r}?" if m else ""


_SEARCH_PATHS_ADDED: set = set()


def validate_runs(runs: Sequence[RunSpec], target: str = DEFAULT_TARGET) -> None:
    """Check every run's recipe and bindings with gin and the registries, in a clean gin state."""
    import gin

    if not runs:
        raise SweepError("the sweep has no runs")
    _load_trainer_configurables(target)
    # as the trainer does: `include 'base.gin'` resolves next to the including file, and a
    # recipe's `import my_components` finds modules next to it or in the working directory
    for d in dict.fromkeys([str(Path(f).parent) for r in runs for f in r.config_files] + [os.getcwd()]):
        if d not in _SEARCH_PATHS_ADDED:
            gin.add_config_file_search_path(d)
            _SEARCH_PATHS_ADDED.add(d)
        if d not in sys.path:
            sys.path.append(d)
    quiet_gin()
    try:
        for files in dict.fromkeys(r.config_files for r in runs):
            gin.clear_config()
            try:  # imports the modules a recipe names, so user components are registered too
                gin.parse_config_files_and_bindings(list(files), [], finalize_config=False)
            except Exception as err:  # gin raises ValueError/KeyError/ImportError/... with a message
                raise SweepError(f"recipe {', '.join(files)} does not parse: {err}") from None
        for binding in dict.fromkeys(b for r in runs for b in r.bindings):
            check_binding(binding)
        for r in runs:
            gin.clear_config()
            try:
                gin.parse_config_files_and_bindings(list(r.config_files), list(r.bindings), finalize_config=False)
            except Exception as err:
                raise SweepError(f"run {r.name}: config does not parse: {err}") from None
            _check_train_config(r)
    finally:
        gin.clear_config()


def _check_train_config(run: RunSpec) -> None:
    """The trainer's own consistency checks (batch vs micro-batch, ...) on the parsed config,
    without touching the model (model.path is not resolved or built here)."""
    try:
        from components.trainer.config import ConfigError, train_config, validate
    except ImportError:
        return
    try:
        validate(train_config(model_path="<not checked before submission>"))
    except ConfigError as err:
        raise SweepError(f"run {run.name}: {err}") from None


def slurm_partitions() -> list[str]:
    if shutil.which("sinfo") is None:
        raise SweepError("--executor slurm needs Slurm, but `sinfo` is not on PATH")
    out = subprocess.run(["sinfo", "-h", "-o", "%R"], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise SweepError(f"`sinfo` failed ({out.returncode}): {out.stderr.strip()}")
    return sorted({line.strip() for line in out.stdout.splitlines() if line.strip()})


@functools.lru_cache(maxsize=None)
def partition_node_cpus(partition: str | None) -> int | None:
    """The CPUs of the partition's smallest node (`sinfo -o %c`), None when Slurm does not say."""
    if shutil.which("sinfo") is None:
        return None
    cmd = ["sinfo", "-h", "-o", "%c"] + (["-p", partition] if partition else [])
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    counts = [int(m) for m in re.findall(r"\d+", out.stdout)] if out.returncode == 0 else []
    return min(counts) if counts else None


def check_partition(partition: str | None) -> None:
    names = slurm_partitions()
    if partition is not None and partition not in names:
        raise SweepError(f"unknown Slurm partition {partition!r}; partitions on this cluster: {', '.join(names)}"
                         f"{_close(partition, names)}")


def parse_time_min(text: str | int) -> int:
    """Slurm time formats -> minutes: '90', '1:30:00', '2-00:00:00', '45:00' (MM:SS)."""
    if isinstance(text, int):
        return text
    t = str(text).strip()
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", t)
    if not m:
        raise SweepError(f"cannot read time limit {text!r}; use minutes, MM:SS, HH:MM:SS or D-HH:MM:SS")
    days, a, b, c = m.groups()
    days = int(days or 0)
    if days and b is None:  # D-HH
        h, mi, s = int(a), 0, 0
    elif c is not None:  # HH:MM:SS
        h, mi, s = int(a), int(b), int(c)
    elif b is not None:  # MM:SS, or D-HH:MM
        h, mi, s = (int(a), int(b), 0) if days else (0, int(a), int(b))
    else:
        h, mi, s = 0, int(a), 0
    minutes = days * 1440 + h * 60 + mi + math.ceil(s / 60)
    if minutes <= 0:
        raise SweepError(f"time limit {text!r} must be at least one minute")
    return minutes


# ----------------------------------------------------------------------------------------
# Run directories: what is done, what is running
# ----------------------------------------------------------------------------------------
def read_json(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def read_run_info(run_dir: Path) -> dict:
    """run.json as the trainer reads it (`RunInfo`: with a failure it could only record outside a
    run directory it could not write); {} when there is none or it cannot be read."""
    from components.trainer.runlog import RunInfo

    try:
        data = RunInfo(Path(run_dir)).data
    except (OSError, ValueError):
        return read_json(Path(run_dir) / "run.json") or {}
    return data if isinstance(data, dict) else {}


def has_checkpoint(run_dir: Path) -> bool:
    """Anything a trainer saved (hidden entries, e.g. the .tmp of an unfinished save, do not count)."""
    ck = Path(run_dir) / "checkpoints"
    return ck.is_dir() and any(not p.name.startswith(".") for p in ck.iterdir())


# Slurm job states (squeue / sacct `State`), grouped by what they mean for a run. A run whose job
# is in SLURM_ENDED but whose run.json never recorded an end (done, failed or interrupted) was
# killed before it could write: scancel, a node failure, the out-of-memory killer, ...
SLURM_QUEUED = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "SUSPENDED",
                          "RESV_DEL_HOLD", "SPECIAL_EXIT"})
SLURM_RUNNING = frozenset({"RUNNING", "COMPLETING", "STOPPED", "SIGNALING", "STAGE_OUT", "RESIZING"})
SLURM_GONE = "GONE"  # squeue does not list the job and sacct has no record of it (or no accounting): it ended
SLURM_ENDED = frozenset({"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                         "BOOT_FAIL", "DEADLINE", SLURM_GONE})


def _query(cmd: Sequence[str]) -> subprocess.CompletedProcess | None:
    """Run a Slurm client command; None when it is not installed or does not answer."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        return subprocess.run(list(cmd), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None


def array_task_ids(spec: str) -> set[str]:
    """Task ids of an array range as Slurm prints it: "1-3,7", "0-9:2%4" -> {"1", "2", "3", "7"}, ..."""
    tasks: set[str] = set()
    for part in spec.split("%")[0].split(","):
        rng, _, step = part.partition(":")
        lo, _, hi = rng.partition("-")
        if lo.isdigit() and (hi or lo).isdigit():
            tasks.update(str(t) for t in range(int(lo), int(hi or lo) + 1, int(step) if step.isdigit() else 1))
    return tasks


def parse_squeue(text: str, ids: Iterable[str]) -> dict[str, str]:
    """{job id: state} from `squeue -h -r -o %i|%T` lines, for the ids asked about."""
    wanted, states = set(ids), {}
    for line in text.splitlines():
        job, _, state = line.strip().partition("|")
        if job in wanted and state:
            states[job] = state.split()[0]
    return states


def parse_sacct(text: str, ids: Iterable[str]) -> dict[str, str]:
    """{job id: state} from `sacct -n -P -X -o JobID,State` lines ("CANCELLED by 0" -> CANCELLED).

    An array task that never started has no line of its own: sacct shows it in a range line
    ("12_[1-3%1]") or, for an array cancelled before any task started, in the array's own
    line ("12"). A task's own line wins over a range line, which wins over the array's line."""
    exact: dict[str, str] = {}
    ranged: dict[str, str] = {}
    whole: dict[str, str] = {}
    for line in text.splitlines():
        job, _, state = line.strip().partition("|")
        if not job or not state.strip():
            continue
        state = state.split()[0]
        exact[job] = state
        head, _, spec = job.partition("_")
        if spec.startswith("[") and spec.endswith("]"):
            for t in array_task_ids(spec[1:-1]):
                ranged[f"{head}_{t}"] = state
        elif not spec:
            whole[job] = state
    states = {}
    for j in ids:
        state = exact.get(j) or ranged.get(j) or ("_" in j and whole.get(j.split("_")[0])) or ""
        if state:
            states[j] = state
    return states


def slurm_job_states(job_ids: Iterable[str]) -> dict[str, str]:
    """{job id: Slurm state} of the given jobs (array tasks as "<array>_<task>").

    squeue (`-t all`: also jobs that ended in the last MinJobAge seconds) first, then sacct for
    the rest, asked about each task and its array (a task that never started is only in its
    array's record). A job neither lists while squeue answered is SLURM_GONE: it is not queued
    or running any more (this is the answer when accounting is off). Ids are left out when
    squeue does not answer (no Slurm here, controller down): then nothing is known about them.
    """
    ids = sorted({str(j) for j in job_ids if j})
    if not ids:
        return {}
    states: dict[str, str] = {}
    sq = _query(["squeue", "-h", "-r", "-t", "all", "-o", "%i|%T", "-j", ",".join(ids)])
    # squeue refuses a list in which it knows no job ("Invalid job id specified"): that is an answer
    answered = sq is not None and (sq.returncode == 0 or "invalid job id" in sq.stderr.lower())
    if answered:
        states.update(parse_squeue(sq.stdout, ids))
    missing = [j for j in ids if j not in states]
    if missing:
        ask = sorted(set(missing) | {j.split("_")[0] for j in missing if "_" in j})
        sa = _query(["sacct", "-n", "-P", "-X", "-o", "JobID,State", "-j", ",".join(ask)])
        if sa is not None and sa.returncode == 0:
            states.update(parse_sacct(sa.stdout, missing))
    if answered:
        for j in ids:
            states.setdefault(j, SLURM_GONE)
    return states


def _pid_alive(pid: Any) -> bool:
    try:
        if int(pid) <= 0:  # 0 and -1 would signal a whole group: not a recorded process
            return False
        os.kill(int(pid), 0)
        return True
    except PermissionError:  # exists, owned by another user
        return True
    except (OSError, ValueError, TypeError):
        return False


def lock_held(path: Path) -> bool | None:
    """Whether some process holds a flock on `path` (the trainer's <run>/.lock), read from
    /proc/locks without taking the lock (taking it, even briefly, could make a trainer that
    starts at that moment fail with RunDirBusyError). None when it cannot be told (no such
    file, not Linux). Matched on the inode number alone: a clash can only say "held"."""
    try:
        ino = os.stat(path).st_ino
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if "FLOCK" in fields and any(f.count(":") == 2 and f.rsplit(":", 1)[1] == str(ino) for f in fields):
            return True
    return False


def local_alive(run_dir: Path, info: dict, job: dict) -> bool | None:
    """Whether a process on this machine is training the run (not for Slurm jobs: ask the scheduler).

    True: the trainer's run-directory lock is held, or a pid the run recorded (the local
    executor's job in slurm.json, a `pid` in run.json) is alive. False: none of that, and there
    was something to check on this machine. None: it cannot be told here (the run was on
    another host, or it recorded neither a lock nor a pid)."""
    if job and job.get("executor", "slurm") == "slurm" and not attempt_outside_slurm(info):
        return None
    host = info.get("host") or job.get("host")
    if host and host != socket.gethostname():
        return None
    if not host and job.get("executor") != "local":
        return None  # nothing says the run was on this machine
    held = lock_held(Path(run_dir) / ".lock")
    pids = [p for p in (info.get("pid"), job.get("pid") if job.get("executor") == "local" else None) if p]
    if held or any(_pid_alive(p) for p in pids):
        return True
    return False if held is not None or pids else None


def attempt_outside_slurm(info: dict) -> bool:
    """run.json says the run is running in a process outside Slurm (`RunInfo` records `slurm_job`
    None there): e.g. `scalerl train ... --run-dir` after its sweep's job ended. Runs written
    before `slurm_job` was recorded do not say."""
    return info.get("status") == "running" and "slurm_job" in info and info["slurm_job"] is None


def scheduler_state(info: dict, job: dict, states: dict[str, str]) -> str:
    """The Slurm state that speaks for the run ("" when none does): that of the job in its
    slurm.json, unless that job is no longer queued or running and the run has since been
    restarted outside Slurm (`attempt_outside_slurm`): the old job's end says nothing about
    that process (`local_alive` tells whether it lives, on its host)."""
    if job.get("executor", "slurm") != "slurm":
        return ""
    state = states.get(str(job.get("job_id") or ""), "")
    if state not in SLURM_QUEUED | SLURM_RUNNING and attempt_outside_slurm(info):
        return ""
    return state


RECORDED_END = ("done", "failed", "interrupted")


def reconcile(status: str | None, job: dict, slurm_state: str = "", alive: bool | None = None) -> tuple[str, str]:
    """(state, reason) of a run from its run.json `status`, its job record (slurm.json), its job's
    Slurm state ("" when unknown) and `local_alive`.

    A live Slurm job wins (a requeued run is queued again, whatever run.json says). An end the
    run recorded (done, failed, interrupted) stands, except `failed` in a job that was CANCELLED
    (scancel kills the run's processes together, and the survivor records the others' death as a
    failure): that run is `interrupted`. A run that recorded no end (run.json says
    running, or there is none) whose Slurm job ended, or whose local process is gone, is
    `interrupted`, resumable like a preempted run, with the reason (the job's Slurm state)."""
    job_id = str(job.get("job_id") or "")
    if status == "done":
        return "done", ""
    if slurm_state in SLURM_QUEUED:
        return "queued", ""
    if slurm_state in SLURM_RUNNING:
        return "running", ""
    if status == "failed" and slurm_state == "CANCELLED":
        # scancel signals every process of the job at once: learner rank 0 sees its peers go and
        # records `failed` before it is killed too. A cancelled run is stopped, not broken.
        return "interrupted", (f"Slurm job {job_id} was cancelled while the run trained (run.json says failed: "
                               "its processes were killed together)")
    if status in RECORDED_END:
        return status, ""
    if status in (None, "running") and slurm_state in SLURM_ENDED:
        what = ("is no longer known to Slurm (not in squeue, no accounting record)" if slurm_state == SLURM_GONE
                else f"ended {slurm_state}")
        return "interrupted", f"Slurm job {job_id} {what} before the run {'started' if status is None else 'recorded its end'}"
    if status in (None, "running") and alive is False:
        return "interrupted", ("no process on this machine is training it (its run-directory lock is free, no pid it "
                               f"recorded is alive) and it {'never started' if status is None else 'recorded no end'}")
    return status or ("queued" if job else "unknown"), ""


@dataclass
class Planned:
    run: RunSpec
    run_dir: Path
    action: str  # submit | resume | retry | skip-done | skip-active | skip-failed
    reason: str = ""


def plan(runs: Sequence[RunSpec], root: Path, *, retry_failed: bool = False) -> list[Planned]:
    """Decide for every run: submit, resume, retry, or skip (and why).

    A run is active while its Slurm job is queued or running (or, locally, while its process
    lives); a run whose job ended before it recorded an end is resumed (`reconcile`)."""
    root = Path(root)
    jobs = {r.name: (read_json(root / r.sweep / r.name / SLURM_FILE) or {}) for r in runs}
    sched = slurm_job_states([j.get("job_id") for j in jobs.values() if j.get("executor") == "slurm"])
    # run.json is read after the scheduler: a job that ends in between has written its end by then
    infos = {r.name: read_run_info(root / r.sweep / r.name) for r in runs}
    out = []
    for r in runs:
        run_dir = root / r.sweep / r.name
        info, job = infos[r.name], jobs[r.name]
        status = info.get("status")
        slurm_state = scheduler_state(info, job, sched) if job.get("executor") == "slurm" else ""
        alive = local_alive(run_dir, info, job)
        state, why = reconcile(status, job, slurm_state, alive)
        from_ck = " from its checkpoint" if has_checkpoint(run_dir) else ""
        if status == "done":
            out.append(Planned(r, run_dir, "skip-done", "run.json says done"))
        elif slurm_state in SLURM_QUEUED | SLURM_RUNNING or alive:
            out.append(Planned(r, run_dir, "skip-active", f"job {job.get('job_id')} is {slurm_state or 'running'}"))
        elif state == "interrupted" and why:  # the scheduler's word first: a scancel'd job may have
            # been signalled like a preempted one (RunJob.checkpoint ran) before it was killed
            out.append(Planned(r, run_dir, "resume", f"interrupted: {why}; resumes" + from_ck))
        elif status == "interrupted" or (status in ("failed", "running") and was_interrupted(run_dir)):
            out.append(Planned(r, run_dir, "resume", "interrupted (preempted or timed out) and not requeued; resumes" + from_ck))
        elif status == "failed" and not retry_failed:
            err = info.get("error", "")
            out.append(Planned(r, run_dir, "skip-failed", f"failed: {str(err)[:120]} (use --retry-failed)"))
        elif status == "failed":
            out.append(Planned(r, run_dir, "retry", "failed before; retrying" + from_ck))
        elif has_checkpoint(run_dir):
            out.append(Planned(r, run_dir, "resume", f"status {status or 'unknown'}; resumes from its checkpoint"))
        else:
            out.append(Planned(r, run_dir, "submit", "new run" if not status else f"status {status}, no checkpoint"))
    return out


# ----------------------------------------------------------------------------------------
# The job
# ----------------------------------------------------------------------------------------
class RunFailed(RuntimeError):
    """The trainer finished a run with status 'failed'."""


def _resolve_target(target: str):
    module, _, attr = target.partition(":")
    if not module or not attr:
        raise SweepError(f"trainer target must look like 'package.module:function', got {target!r}")
    return getattr(importlib.import_module(module), attr)


class RunJob(submitit.helpers.Checkpointable):
    """One training run as a submitit job.

    Checkpointable: on a Slurm time limit or preemption submitit calls `checkpoint` (the
    inherited one resubmits this same call) and requeues the job; the trainer then resumes
    from the latest checkpoint in the run directory.
    """

    def __init__(self, target: str = DEFAULT_TARGET):
        self.target = target

    def __call__(self, config_files: Sequence[str], bindings: Sequence[str], run_dir: str,
                 run_info: dict) -> str:
        if int(os.environ.get("SLURM_PROCID", "0") or 0) == 0:  # one record per job, not per task
            _record_job_start(Path(run_dir))
        train = _resolve_target(self.target)
        status = train(list(config_files), list(bindings), run_dir, run_info=dict(run_info))
        if status != "done":
            info = read_run_info(Path(run_dir))  # run.json, or the failure recorded beside it
            raise RunFailed(f"run {run_info.get('name')} ended with status {status!r}: "
                            f"{info.get('error', 'no error recorded in run.json')}")
        return status

    def checkpoint(self, config_files, bindings, run_dir, run_info) -> submitit.helpers.DelayedSubmission:
        """Called by submitit on preemption or time-out, just before the requeue: note it in
        attempts.jsonl (so a later `scalerl sweep` resumes the run even if the trainer marked
        it failed on the way out) and resubmit the same call."""
        try:
            with open(Path(run_dir) / ATTEMPTS_FILE, "a") as f:
                f.write(json.dumps({"at": _now(), "event": "interrupted", "pid": os.getpid()}) + "\n")
        except OSError:
            pass
        return super().checkpoint(config_files, bindings, run_dir, run_info)


def was_interrupted(run_dir: Path) -> bool:
    """True when the run's last job was preempted or timed out (RunJob.checkpoint ran)."""
    try:
        lines = [ln for ln in (Path(run_dir) / ATTEMPTS_FILE).read_text().splitlines() if ln.strip()]
        return bool(lines) and json.loads(lines[-1]).get("event") == "interrupted"
    except (OSError, ValueError):
        return False


def _record_job_start(run_dir: Path) -> None:
    """Append to attempts.jsonl which job (and which Slurm restart) runs this run now."""
    run_dir.mkdir(parents=True, exist_ok=True)
    env = os.environ
    job_id = env.get("SLURM_JOB_ID")
    if env.get("SLURM_ARRAY_JOB_ID"):
        job_id = f"{env['SLURM_ARRAY_JOB_ID']}_{env.get('SLURM_ARRAY_TASK_ID')}"
    rec = {"at": _now(), "pid": os.getpid(), "job_id": job_id, "node": env.get("SLURMD_NODENAME"),
           "restart_count": int(env.get("SLURM_RESTART_COUNT", 0) or 0)}
    with open(run_dir / ATTEMPTS_FILE, "a") as f:
        f.write(json.dumps(rec) + "\n")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------
# Executors and submission
# ----------------------------------------------------------------------------------------
@dataclass
class LaunchOptions:
    executor: str = "slurm"
    partition: str | None = None
    gpus: int = 0  # GPUs per node of a run; 0 with --gpu runs: what the run's layout needs
    cpus: int | None = None  # CPUs per task; None: one per process of the run (runs never share cores)
    mem_gb: float | None = None
    time_min: int = 60
    array_parallelism: int = 64
    account: str | None = None
    qos: str | None = None
    slurm_extra: dict = field(default_factory=dict)
    max_requeues: int = 10
    signal_delay_s: int = 90
    target: str = DEFAULT_TARGET
    nodes: int = 1  # nodes per run
    tasks_per_node: int | None = None  # set (or nodes > 1): one Slurm task per process, roles from the rank
    overcommit: bool = False  # let a node run more tasks than it has CPUs (Slurm --overcommit)

    @property
    def multi_task(self) -> bool:
        return self.tasks_per_node is not None or self.nodes > 1


@dataclass(frozen=True)
class RunResources:
    """The processes one run starts (train.learner_ranks + train.num_generators) and where."""

    learner_ranks: int = 1
    num_generators: int = 1
    gpus_per_generator: int = 1
    on_gpu: bool = False

    @property
    def processes(self) -> int:
        return self.learner_ranks + self.num_generators

    @property
    def gpus(self) -> int:
        return self.learner_ranks + self.num_generators * self.gpus_per_generator if self.on_gpu else 0


def job_parameters(opts: LaunchOptions, res: RunResources) -> dict:
    """nodes, tasks_per_node, cpus_per_task and gpus_per_node of one run's job.

    One task (default): the run's processes are started by `scalerl train` inside it, so it
    reserves one CPU per process (and every GPU the run uses): on a CPU node, two runs never
    share a core unless --cpus says less. Several tasks (--tasks-per-node, or --nodes > 1):
    one task per process, its role from its rank; nodes x tasks_per_node must equal the
    run's processes.
    """
    if not opts.multi_task:
        cpus = opts.cpus if opts.cpus is not None else res.processes
        return {"nodes": 1, "tasks_per_node": 1, "cpus_per_task": int(cpus), "gpus_per_node": opts.gpus or res.gpus}
    nodes = max(int(opts.nodes), 1)
    per_node = opts.tasks_per_node if opts.tasks_per_node is not None else -(-res.processes // nodes)
    if nodes * per_node != res.processes:
        raise SweepError(
            f"a run has {res.processes} processes (train.learner_ranks={res.learner_ranks} + "
            f"train.num_generators={res.num_generators}) but --nodes {nodes} x --tasks-per-node {per_node} = "
            f"{nodes * per_node} tasks; they must be equal"
        )
    gpus = opts.gpus
    if not gpus and res.on_gpu:  # the busiest node's GPUs (ranks are placed in blocks of per_node)
        need = [1] * res.learner_ranks + [res.gpus_per_generator] * res.num_generators
        gpus = max(sum(need[i : i + per_node]) for i in range(0, len(need), per_node))
    cpus = opts.cpus
    if cpus is None and (res.on_gpu or gpus) and opts.executor == "slurm":
        # A GPU task (a vLLM engine and its workers, an FSDP2 rank and its data path) on ONE core,
        # where Slurm pins tasks to their cores, starves: its share of three quarters of the node's
        # CPUs instead (the rest: cores a site reserves, CoreSpecCount, which sinfo counts in).
        node = partition_node_cpus(opts.partition)
        cpus = max(node * 3 // 4 // per_node, 1) if node else None
    return {"nodes": nodes, "tasks_per_node": int(per_node), "cpus_per_task": int(cpus or 1), "gpus_per_node": gpus}


def check_device_request(run: str, device: str, opts: LaunchOptions) -> None:
    """A multi-node Slurm run with train.device = "auto" must say how many GPUs it wants: without
    --gpus the job asks Slurm for none, and where Slurm confines a job to its allocation (cgroups,
    the usual GPU cluster) every task finds no GPU and "auto" runs the model on CPU."""
    if opts.executor == "slurm" and opts.nodes > 1 and device == "auto" and not opts.gpus:
        raise SweepError(
            f"run {run!r}: train.device = \"auto\" on --nodes {opts.nodes} without --gpus asks Slurm for no GPU, "
            "so every task would run on CPU; pass --gpus N (GPUs per node), or set train.device = \"cuda\" "
            "(the layout's GPUs are requested) or \"cpu\""
        )


def run_resources(runs: Sequence[RunSpec], opts: LaunchOptions | None = None) -> dict:
    """{run name: RunResources} from each run's parsed config (a clean gin state per run)."""
    import gin

    from experiments.train import engine_gpus

    _load_trainer_configurables(DEFAULT_TARGET)
    quiet_gin()
    out = {}
    try:
        for r in runs:
            gin.clear_config()
            try:
                gin.parse_config_files_and_bindings(list(r.config_files), list(r.bindings), finalize_config=False)
                from components.trainer.config import train_config

                cfg = train_config(model_path="<not resolved before submission>")
            except Exception:  # a stand-in trainer's config (tests) or one validate_runs already reported
                out[r.name] = RunResources()
                continue
            if opts is not None:
                check_device_request(r.name, cfg.device, opts)
            gpu = cfg.device.startswith("cuda") or (cfg.device == "auto" and bool(opts is not None and opts.gpus))
            out[r.name] = RunResources(cfg.learner_ranks, cfg.num_generators, engine_gpus(cfg), gpu)
    finally:
        gin.clear_config()
    return out


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _visible_gpus() -> int:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return len([d for d in env.split(",") if d.strip()])
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        return 0


def local_parallelism(opts: LaunchOptions, res: Sequence[RunResources]) -> int:
    """How many runs the local executor may run at once: as many as this machine has cores (and GPUs) for."""
    need = max([opts.cpus if opts.cpus is not None else r.processes for r in res] or [1])
    room = _usable_cores() // max(int(need), 1)
    gpus = max([opts.gpus or r.gpus for r in res] or [0])
    if gpus:  # submitit's local executor shows every job the same GPUs: one GPU run at a time unless they fit apart
        room = min(room, max(_visible_gpus() // gpus, 1))
    return max(1, min(int(opts.array_parallelism), room))


def make_executor(opts: LaunchOptions, folder: Path, sweep: str, resources: RunResources | None = None) -> submitit.Executor:
    if opts.executor not in ("slurm", "local", "debug"):
        raise SweepError(f"unknown executor {opts.executor!r}; choose from: slurm, local, debug")
    if opts.executor != "slurm" and opts.multi_task:
        raise SweepError("--nodes > 1 and --tasks-per-node need --executor slurm (locally `scalerl train` starts a run's processes itself)")
    executor = submitit.AutoExecutor(folder=str(folder), cluster=opts.executor,
                                     slurm_max_num_timeout=opts.max_requeues)
    params: dict[str, Any] = {"timeout_min": opts.time_min, "name": f"scalerl-{sweep}"}
    job = job_parameters(opts, resources or RunResources())
    if opts.executor != "debug":
        params.update(cpus_per_task=job["cpus_per_task"], nodes=job["nodes"])
        if not (opts.overcommit and opts.executor == "slurm"):
            params["tasks_per_node"] = job["tasks_per_node"]
        if job["gpus_per_node"]:  # no --gpus-per-node=0 line: clusters without GPU GRES may refuse it
            params["gpus_per_node"] = job["gpus_per_node"]
    if opts.mem_gb is not None:
        params["mem_gb"] = opts.mem_gb
    if opts.executor == "slurm":
        params["slurm_array_parallelism"] = opts.array_parallelism
        params["slurm_signal_delay_s"] = opts.signal_delay_s
        if opts.partition:
            params["slurm_partition"] = opts.partition
        if opts.account:
            params["slurm_account"] = opts.account
        if opts.qos:
            params["slurm_qos"] = opts.qos
        srun_args = []
        if opts.multi_task:
            # One task per process: when one ends badly (a worker that lost learner-0 exits 5,
            # learner-0 exits 1 after recording a dead or stopped peer), Slurm kills the step's
            # other tasks, stopped ones included, instead of waiting for them until the time limit.
            srun_args.append("--kill-on-bad-exit=1")
        if job["cpus_per_task"] > 1:
            # srun of Slurm 22.05-23.02 does not take sbatch's --cpus-per-task: without it, each
            # task of the step gets one CPU where Slurm binds tasks to cores.
            srun_args.append(f"--cpus-per-task={job['cpus_per_task']}")
        if srun_args:
            params["slurm_srun_args"] = srun_args
        extra = dict(opts.slurm_extra)
        if opts.overcommit:
            # Slurm refuses --ntasks-per-node above the node's CPUs even with --overcommit; --ntasks is accepted
            extra["overcommit"] = True
            extra["ntasks"] = job["nodes"] * job["tasks_per_node"]
        if extra:
            params["slurm_additional_parameters"] = extra
    executor.update_parameters(**params)
    return executor


def _job_record(job: submitit.Job, opts: LaunchOptions, folder: Path) -> dict:
    rec = {"executor": opts.executor, "job_id": str(job.job_id), "submitit_folder": str(folder),
           "submitted_at": _now()}
    if opts.executor == "slurm":
        rec["array_job_id"] = str(job.job_id).split("_")[0]
        rec.update(partition=opts.partition, time_min=opts.time_min, gpus=opts.gpus, cpus=opts.cpus, nodes=opts.nodes,
                   tasks_per_node=opts.tasks_per_node)
    elif opts.executor == "local":
        rec["pid"] = getattr(getattr(job, "_process", None), "pid", None) or str(job.job_id)
        rec["host"] = socket.gethostname()  # the pid means something only on this machine (`local_alive`)
    return rec


def submit(planned: Sequence[Planned], opts: LaunchOptions, root: Path, sweep: str,
           folder: Path | None = None) -> list[tuple[Planned, Any]]:
    """Submit the runs to launch: one job array per distinct resource shape (usually one);
    record each run's job in its slurm.json."""
    todo = [p for p in planned if not p.action.startswith("skip")]
    if not todo:
        return []
    folder = Path(folder) if folder is not None else Path(root) / sweep / ".submitit"
    folder.mkdir(parents=True, exist_ok=True)
    resources = run_resources([p.run for p in todo], opts) if opts.executor != "debug" else {}
    fn = RunJob(opts.target)
    for p in todo:
        p.run_dir.mkdir(parents=True, exist_ok=True)
    if opts.executor == "slurm":
        shapes: dict = {}
        for p in todo:
            key = resources.get(p.run.name, RunResources())
            job_parameters(opts, key)  # a run that does not fit the task layout is refused before anything is submitted
            shapes.setdefault(key, []).append(p)
        submitted = []
        for key, group in shapes.items():
            executor = make_executor(opts, folder, sweep, key)
            jobs: list = []
            with executor.batch():
                for p in group:
                    jobs.append(executor.submit(fn, list(p.run.config_files), list(p.run.bindings),
                                                str(p.run_dir), p.run.run_info()))
            for p, job in zip(group, jobs):
                _record(p, job, opts, folder)
            submitted.extend(zip(group, jobs))
        order = {p.run.name: i for i, p in enumerate(todo)}
        return sorted(submitted, key=lambda pj: order[pj[0].run.name])
    # local/debug: waves of runs (local: as many at once as this machine has cores for)
    jobs = [None] * len(todo)
    wave = local_parallelism(opts, list(resources.values())) if opts.executor == "local" else len(todo)
    executor = make_executor(opts, folder, sweep, max(resources.values(), key=lambda r: r.processes, default=None))
    for start in range(0, len(todo), wave):
        chunk = range(start, min(start + wave, len(todo)))
        for i in chunk:
            p = todo[i]
            jobs[i] = executor.submit(fn, list(p.run.config_files), list(p.run.bindings),
                                      str(p.run_dir), p.run.run_info())
            _record(p, jobs[i], opts, folder)
        if opts.executor == "local" and start + wave < len(todo):
            for i in chunk:
                _wait_quietly(jobs[i])
    return list(zip(todo, jobs))


def _record(p: Planned, job: Any, opts: LaunchOptions, folder: Path) -> None:
    path = p.run_dir / SLURM_FILE
    old = read_json(path) or {}
    rec = _job_record(job, opts, folder)
    rec["history"] = old.get("history", []) + [{"job_id": rec["job_id"], "submitted_at": rec["submitted_at"],
                                                 "action": p.action}]
    _write_json_atomic(path, rec)


def job_result(job: Any) -> Any:
    """A job's result; for a job of several tasks (one per process of a run), task 0's (learner-0's)."""
    if getattr(job, "_sub_jobs", None):
        return job.results()[0]
    return job.result()


def _wait_quietly(job: Any) -> None:
    try:
        job_result(job)
    except Exception:  # reported by `wait`
        pass


def wait(submitted: Sequence[tuple[Planned, Any]], poll_s: float = 5.0) -> dict[str, tuple[str, str]]:
    """Wait for every job; {run name: (outcome, error)} with outcome done | failed."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from submitit.local.debug import DebugJob

    outcomes: dict[str, tuple[str, str]] = {}
    pending = list(submitted)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), transient=False) as progress:
        task = progress.add_task("runs finished", total=len(pending))
        while pending:
            still = []
            for p, job in pending:
                if isinstance(job, DebugJob) or job.done():
                    outcomes[p.run.name] = _outcome(p, job)
                    progress.advance(task)
                else:
                    still.append((p, job))
            pending = still
            if pending:
                time.sleep(poll_s)
    return outcomes


def _outcome(p: Planned, job: Any) -> tuple[str, str]:
    """("done", "") or ("failed", the run's recorded error, else the job's last error line)."""
    try:
        job_result(job)
        return "done", ""
    except Exception as err:  # FailedJobError / UncompletedJobError / RunFailed (debug)
        recorded = read_run_info(p.run_dir).get("error")
        if recorded:
            return "failed", str(recorded).splitlines()[0][:500]
        lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
        lines = [ln for ln in lines if not ln.startswith(("You can check", "'job.stdout", "- /", "srun: error"))]
        return "failed", (lines[-1] if lines else type(err).__name__)[:500]


# ----------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", help="sweep spec (.gin), or the name of one in experiments/sweeps/")
    parser.add_argument("--executor", choices=("slurm", "local", "debug"), default="slurm",
                        help="slurm (the default): one job array; local: subprocesses here; debug: in this process")
    parser.add_argument("--scale", choices=("paper", "tiny"), default="paper",
                        help="paper: the spec's recipe at paper scale; tiny: mapped onto the CPU setting")
    parser.add_argument("--runs", default="runs", help="runs root; runs land in RUNS/<sweep>/<run>/ (default runs/)")
    parser.add_argument("--dry-run", action="store_true", help="print the runs and their overrides; submit nothing")
    parser.add_argument("--retry-failed", action="store_true", help="resubmit runs whose status is failed")
    parser.add_argument("--only", nargs="+", metavar="RUN", help="launch only these runs (names as in --dry-run)")
    parser.add_argument("--seeds", type=int, nargs="+", help="override the spec's seeds")
    parser.add_argument("--gin", action="append", default=[], metavar="BINDING",
                        help="extra gin binding for every run, applied last (repeatable)")
    parser.add_argument("--gpu-memory-gb", type=float, default=None, metavar="GB",
                        help="GPU memory (GiB) the memory plan checks each run against; runs that cannot fit are "
                             "refused (default 80 for GPU runs; CPU runs, train.device = \"cpu\", only when given)")
    parser.add_argument("--trainer", dest="target", default=DEFAULT_TARGET, metavar="MODULE:FUNCTION",
                        help=f"the function each job calls (default {DEFAULT_TARGET}); same signature as run_training")
    parser.add_argument("--wait", action="store_true", help="slurm: wait for the jobs and report (local/debug always wait)")
    slurm = parser.add_argument_group("Slurm")
    add_slurm_arguments(slurm)
    slurm.add_argument("--array-parallelism", type=int, default=64,
                       help="max runs at once (default 64; the local executor also stops at this machine's cores)")


def add_resource_arguments(group) -> None:
    """Per-run resources (shared by `scalerl sweep` and `scalerl train --executor slurm`)."""
    group.add_argument("--gpus", type=int, default=0,
                       help="GPUs per node of a run (default 0 = CPU; with train.device cuda: what the layout needs)")
    group.add_argument("--cpus", type=int, default=None,
                       help="CPUs per task (default: one per process of the run, so runs never share cores)")
    group.add_argument("--nodes", type=int, default=1, help="nodes per run (default 1)")
    group.add_argument("--tasks-per-node", type=int, default=None,
                       help="one Slurm task per process of the run, this many per node (roles from the rank); "
                            "default: one task that starts the run's processes itself")
    group.add_argument("--overcommit", action="store_true",
                       help="let a node run more tasks than it has CPUs (sbatch --overcommit)")


def add_slurm_arguments(slurm) -> None:
    """The Slurm options of a job (shared by `scalerl sweep` and `scalerl train --executor slurm`)."""
    slurm.add_argument("--partition", help="Slurm partition (checked with sinfo); default: the cluster's default")
    add_resource_arguments(slurm)
    slurm.add_argument("--mem-gb", type=float, help="memory per run in GB")
    slurm.add_argument("--time", default="60", help="time limit per job: minutes or [D-]HH:MM:SS (default 60); "
                       "a run that hits it is checkpointed and requeued")
    slurm.add_argument("--account", help="Slurm account (passed through)")
    slurm.add_argument("--qos", help="Slurm QOS (passed through)")
    slurm.add_argument("--slurm-extra", action="append", default=[], metavar="KEY=VALUE",
                       help="any other sbatch option, e.g. constraint=a100 (repeatable)")
    slurm.add_argument("--max-requeues", type=int, default=10,
                       help="how many time-limit requeues a run may use (default 10)")
    slurm.add_argument("--signal-delay", type=int, default=90, metavar="SECONDS",
                       help="warn a job this long before its time limit, so it can checkpoint and requeue (default 90)")


def options_from_args(args: argparse.Namespace) -> "LaunchOptions":
    return LaunchOptions(
        executor=args.executor, partition=args.partition, gpus=args.gpus, cpus=args.cpus, mem_gb=args.mem_gb,
        time_min=parse_time_min(args.time), array_parallelism=getattr(args, "array_parallelism", 64),
        account=args.account, qos=args.qos, slurm_extra=_parse_extra(args.slurm_extra), max_requeues=args.max_requeues,
        signal_delay_s=args.signal_delay, target=getattr(args, "target", DEFAULT_TARGET),
        nodes=args.nodes, tasks_per_node=args.tasks_per_node, overcommit=args.overcommit,
    )


def _parse_extra(items: Sequence[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SweepError(f"--slurm-extra expects KEY=VALUE, got {item!r}")
        out[key.strip().lstrip("-").replace("-", "_")] = value
    return out


def prepare(args: argparse.Namespace) -> tuple[SweepSpec, list[RunSpec], LaunchOptions]:
    spec = load_spec(args.spec)
    if args.seeds:
        spec = dataclasses.replace(spec, seeds=tuple(args.seeds))
    runs = expand(spec, args.scale)
    if args.gin:
        runs = [dataclasses.replace(r, bindings=r.bindings + tuple(args.gin)) for r in runs]
    if args.only:
        names = [r.name for r in runs]
        unknown = [n for n in args.only if n not in names]
        if unknown:
            raise SweepError(f"--only: unknown run(s) {', '.join(unknown)}; runs of {spec.name}: {', '.join(names)}")
        runs = [r for r in runs if r.name in args.only]
    opts = options_from_args(args)
    return spec, runs, opts


def print_plan(spec: SweepSpec, planned: Sequence[Planned], root: Path, scale: str, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"sweep {spec.name} ({scale} scale, factor {spec.factor}) -> {Path(root) / spec.name}")
    for col in ("run", "action", "config", "overrides", "note"):
        table.add_column(col, overflow="fold")
    for p in planned:
        table.add_row(p.run.name, p.action, " + ".join(Path(f).name for f in p.run.config_files),
                      "\n".join(p.run.bindings), p.reason)
    console.print(table)


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    try:
        spec, runs, opts = prepare(args)
        root = Path(args.runs)
        planned = plan(runs, root, retry_failed=args.retry_failed)
        print_plan(spec, planned, root, args.scale, console)
        validate_runs(runs, opts.target)
        from experiments.plan import print_sweep_memory, sweep_memory  # memory per GPU of every run (`scalerl plan`)

        memory = sweep_memory(runs, getattr(args, "gpu_memory_gb", None))
        print_sweep_memory(memory, console)
        unfit = [p.run.name for p in planned if not p.action.startswith("skip") and memory[p.run.name][0] is False]
        if unfit:
            raise SweepError(f"{len(unfit)} run(s) do not fit the memory plan: {', '.join(unfit)} (details: `scalerl plan "
                             "CONFIG --gin ...`); nothing submitted")
        if opts.executor == "slurm" and not args.dry_run:
            check_partition(opts.partition)
        elif opts.executor == "slurm" and opts.partition and shutil.which("sinfo"):
            check_partition(opts.partition)
    except SweepError as err:
        console.print(f"[red]error:[/red] {err}")
        return 2
    if args.dry_run:
        n = sum(not p.action.startswith("skip") for p in planned)
        console.print(f"dry run: {n} of {len(planned)} runs would be submitted ({opts.executor}); nothing submitted")
        return 0
    submitted = submit(planned, opts, root, spec.name)
    if not submitted:
        console.print("nothing to submit: every run is done, active or failed (see --retry-failed)")
        return 0
    ids = sorted({str(job.job_id).split("_")[0] for _, job in submitted})
    console.print(f"submitted {len(submitted)} runs ({opts.executor}, job {'/'.join(ids)}); "
                  f"follow with: scalerl status {root / spec.name}")
    if opts.executor == "slurm" and not args.wait:
        return 0
    outcomes = wait(submitted, poll_s=2.0 if opts.executor != "slurm" else 10.0)
    failed = {k: v for k, v in outcomes.items() if v[0] != "done"}
    for name, (_, err) in failed.items():
        console.print(f"[red]{name} failed:[/red] {err}")
    console.print(f"{len(outcomes) - len(failed)} done, {len(failed)} failed")
    return 1 if failed else 0
