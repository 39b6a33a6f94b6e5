"""Recipes read as text: where a config file is found and what a recipe binds, without gin's global state.

A recipe is a gin file of `experiments/configs/` (or next to the file that names it); a sweep
names recipes and overlays, and a recipe names others with `include`. This module reads them
statement by statement with gin's own parser (`gin.config_parser.ConfigParser`), so nothing
here touches, or is touched by, the gin config a run trains with:

    resolve_config("overlays/baseline.gin", spec_dir)   # -> an absolute path, or SweepError naming where it looked
    recipe_binding([recipe], "train", "prompts_per_step")  # the value the files bind (last wins), or None
    algorithm_bindings(recipe)                  # ['train.loss = "cispo"', 'cispo.eps_max = 4.0', ...]
    tiny_batch_bindings(recipe, tiny_base)      # the recipe's batch ratio kept at tiny scale
    gin_literal(("a", 1))                       # '("a", 1)': a Python value written back as gin
    resolved_bindings(files, bindings)          # every setting the files and bindings make (last wins)

`SweepError` is the error every part of the launcher raises for a wrong spec, recipe or option,
before anything is submitted.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

EXPERIMENTS_DIR = Path(__file__).resolve().parent
CONFIGS_DIR = EXPERIMENTS_DIR / "configs"
SWEEPS_DIR = EXPERIMENTS_DIR / "sweeps"


class SweepError(ValueError):
    """A sweep spec or launch option is wrong; raised before anything is submitted."""


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """The hint " Did you mean 'x'?" naming the closest choice; "" when none is close."""
    m = difflib.get_close_matches(word, list(choices), n=1)
    return f" Did you mean {m[0]!r}?" if m else ""


def gin_parser():
    """gin's statement parser (`gin.config_parser`): reads gin text without touching gin's config."""
    import gin.config_parser as cp

    return cp


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
    cp = gin_parser()
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
    cp = gin_parser()
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


def resolved_bindings(files: Sequence[str], bindings: Sequence[str] = ()) -> dict[str, str]:
    """Every setting a run's config files (following their includes) and extra bindings make, the
    last binding of each (scope, configurable, parameter) winning, values written back as gin text;
    imports as `import <module>` keys. Two runs with the same result are the same configuration
    (with the same code), whatever files and override lists they were spelled with."""
    cp = gin_parser()
    out: dict[str, str] = {}

    def statements(text: str, here: Path | None, seen: set):
        for stmt in cp.ConfigParser(text, _KeepDelegate()):
            if isinstance(stmt, cp.IncludeStatement):
                path = Path(resolve_config(stmt.filename, here)).resolve()
                if path not in seen:
                    seen.add(path)
                    yield from statements(path.read_text(), path.parent, seen)
            else:
                yield stmt

    seen: set = set()
    sources = [(Path(f).read_text(), Path(f).resolve().parent) for f in files] + [("\n".join(bindings), None)]
    for text, here in sources:
        for stmt in statements(text, here, seen):
            if isinstance(stmt, cp.BindingStatement):
                scope = f"{stmt.scope}/" if stmt.scope else ""
                out[f"{scope}{stmt.selector}.{stmt.arg_name}"] = gin_literal(stmt.value)
            elif isinstance(stmt, cp.ImportStatement):
                out[f"import {stmt.module}"] = ""
    return out
