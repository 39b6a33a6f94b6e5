"""The one Registry class (DESIGN.md "Registries").

Isolated tests use a temporary Registry whose gin module and entry names are unique per test
(gin's registry is process-global and never forgets a configurable).
"""

from __future__ import annotations

import collections
import importlib
import os
import sys
import uuid

import gin
import pytest

import components.advantages  # noqa: F401
import components.aggregation  # noqa: F401
import components.losses  # noqa: F401
from components import registry as registry_mod
from components.registry import (
    ADVANTAGE_NORMS,
    AGGREGATIONS,
    ALL_REGISTRIES,
    LOSSES,
    DuplicateComponentError,
    Registry,
    UnknownComponentError,
)

FAMILIES = ("LOSSES", "AGGREGATIONS", "ADVANTAGE_NORMS", "CURRICULA", "PRECISIONS", "LENGTH_CONTROLS",
            "OFF_POLICY", "TASKS", "ENGINES", "REWARDS", "TRACKERS", "WEIGHT_SYNC_BACKENDS",
            "KL_ESTIMATORS", "LR_SCHEDULES", "MISMATCH_CORRECTIONS", "ENVIRONMENTS")


@pytest.fixture(autouse=True)
def _clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


def _uid() -> str:
    return uuid.uuid4().hex[:8]


@pytest.fixture
def reg():
    """A fresh registry with a unique gin module: ('widget', 'widgets_<uid>')."""
    return Registry("widget", f"widgets_{_uid()}")


# ----------------------------------------------------------------------------------------
def test_one_instance_per_family_of_the_one_class():
    for name in FAMILIES:
        assert isinstance(getattr(registry_mod, name), Registry), name
    assert len({id(getattr(registry_mod, n)) for n in FAMILIES}) == len(FAMILIES)
    assert set(ALL_REGISTRIES.values()) == {getattr(registry_mod, n) for n in FAMILIES}
    assert len({r.gin_module for r in ALL_REGISTRIES.values()}) == len(FAMILIES)


def test_register_get_names_params(reg):
    a, b = f"alpha_{_uid()}", f"beta_{_uid()}"

    @reg.register(a)
    def alpha(x, *, scale=2.0, shift=0):
        """Scale then shift."""
        return x * scale + shift

    @reg.register(b)
    def beta(x, y=1):
        return x + y

    assert reg.names() == sorted([a, b]) and len(reg) == 2 and a in reg and "nope" not in reg
    assert list(reg) == reg.names()
    assert reg.get(a)(3) == 6.0
    assert alpha(3) == 6.0  # the decorated name is the same callable
    assert reg.original(a).__name__ == "alpha"
    assert {p.name: p.default for p in reg.params(a)} == {"scale": 2.0, "shift": 0}
    assert {p.name: p.default for p in reg.params(b)} == {"y": 1}  # positional x is an input
    info = reg.describe()[a]
    assert info["params"] == {"scale": 2.0, "shift": 0} and info["doc"] == "Scale then shift."
    assert reg.check(a) == a


def test_required_keyword_parameter_is_listed_as_required(reg):
    name = f"req_{_uid()}"

    @reg.register(name)
    def needs(x, *, path):
        return path

    (p,) = reg.params(name)
    assert p.name == "path" and p.required
    assert reg.describe()[name]["params"] == {"path": "<required>"}


def test_duplicate_name_is_refused(reg):
    name = f"dup_{_uid()}"

    @reg.register(name)
    def first(x):
        return x

    with pytest.raises(DuplicateComponentError) as err:

        @reg.register(name)
        def second(x):
            return -x

    msg = str(err.value)
    assert name in msg and "widget" in msg
    assert reg.get(name)(1) == 1  # the first registration is untouched


def test_duplicate_across_modules_is_refused_for_the_real_losses():
    def grpo(logp, gen_logp, advantages, mask, *, eps=0.3):  # a different function named grpo
        return logp

    with pytest.raises(DuplicateComponentError, match="grpo"):
        LOSSES.register("grpo")(grpo)
    assert LOSSES.original("grpo").__module__ == "components.losses"


def test_registering_the_same_object_twice_is_idempotent(reg):
    name = f"same_{_uid()}"

    def f(x, *, k=1):
        return x * k

    w1 = reg.register(name)(f)
    w2 = reg.register(name)(f)
    assert w1 is w2 and reg.names() == [name]


def test_redefinition_under_same_module_and_qualname_is_not_silently_ignored(reg):
    """importlib.reload / a notebook cell redefining a component: the new code must be used
    (or the registration refused) -- never silently keep the old function."""
    name = f"redef_{_uid()}"

    def f(x):
        return "old"

    reg.register(name)(f)

    def g(x):
        return "new"

    g.__qualname__, g.__module__ = f.__qualname__, f.__module__
    try:
        returned = reg.register(name)(g)
    except DuplicateComponentError:
        return  # refusing is acceptable
    assert reg.get(name)(0) == "new", "re-registration silently kept the OLD function"
    assert returned(0) == "new"


def test_importlib_reload_of_an_edited_module_runs_the_new_code(tmp_path, monkeypatch):
    """The real workflow behind the test above: edit a component file, reload the module."""
    uid = _uid()
    holder, comp, name = f"lt_holder_{uid}", f"lt_comp_{uid}", f"reloaded_{uid}"
    (tmp_path / f"{holder}.py").write_text(
        f"from components.registry import Registry\nREG = Registry('widget', 'widgets_{uid}')\n"
    )
    body = "from {holder} import REG\n\n@REG.register({name!r})\ndef f(x, *, k=1):\n    return {expr}\n"
    path = tmp_path / f"{comp}.py"
    path.write_text(body.format(holder=holder, name=name, expr="x * k"))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        module = importlib.import_module(comp)
        reg = importlib.import_module(holder).REG
        assert reg.get(name)(3) == 3
        gin.parse_config(f"{name}.k = 2")
        assert reg.get(name)(3) == 6
        path.write_text(body.format(holder=holder, name=name, expr="x * k + 100"))
        os.utime(path, (path.stat().st_atime, path.stat().st_mtime + 5))  # a new mtime: no stale .pyc
        importlib.reload(module)
        assert reg.get(name)(3) == 106  # new body, gin binding still applied
        assert module.f(3) == 106
    finally:
        for m in (comp, holder):
            sys.modules.pop(m, None)


def test_redefining_a_registered_class_is_refused_or_takes_effect(reg):
    name = f"cls_{_uid()}"

    class Thing:
        def __init__(self, *, v=1):
            self.v = ("old", v)

    reg.register(name)(Thing)

    class Thing2:
        def __init__(self, *, v=1):
            self.v = ("new", v)

    Thing2.__qualname__, Thing2.__module__ = Thing.__qualname__, Thing.__module__
    try:
        reg.register(name)(Thing2)
    except DuplicateComponentError:
        return
    assert reg.get(name)().v == ("new", 1), "re-registration silently kept the OLD class"


@pytest.mark.parametrize("bad", ["", None, 3])
def test_invalid_names_are_refused(reg, bad):
    with pytest.raises(ValueError):
        reg.register(bad)


# ----------------------------------------------------------------------------------------
# unknown names
def test_unknown_name_error_names_family_bad_name_all_names_and_closest_match():
    with pytest.raises(UnknownComponentError) as err:
        LOSSES.get("cipso")
    msg = str(err.value)
    assert "loss" in msg and "'cipso'" in msg
    for name in LOSSES.names():
        assert name in msg
    assert "Did you mean 'cispo'?" in msg
    assert isinstance(err.value, KeyError)  # a missing key, for callers catching KeyError


@pytest.mark.parametrize(
    "registry,bad,closest",
    [
        (AGGREGATIONS, "prompt-mean", "prompt_mean"),
        (AGGREGATIONS, "tokenmean", "token_mean"),
        (ADVANTAGE_NORMS, "batches", "batch"),
        (LOSSES, "GSPO", "gspo"),
        (LOSSES, "dapo_loss", "dapo"),
    ],
)
def test_closest_match_in_each_family(registry, bad, closest):
    with pytest.raises(UnknownComponentError) as err:
        registry.get(bad)
    msg = str(err.value)
    assert registry.family in msg and repr(bad) in msg and f"Did you mean {closest!r}?" in msg
    assert all(n in msg for n in registry.names())


def test_unknown_name_in_a_temporary_registry(reg):
    names = [f"{stem}_{_uid()}" for stem in ("red", "green", "blue")]
    for n in names:
        reg.register(n)(lambda x: x)
    with pytest.raises(UnknownComponentError) as err:
        reg.get(names[1].replace("green", "gren"))
    msg = str(err.value)
    assert "widget" in msg and all(n in msg for n in names) and f"Did you mean {names[1]!r}?" in msg
    with pytest.raises(UnknownComponentError):
        reg.check("nothing")


def test_unknown_name_in_an_empty_registry(reg):
    with pytest.raises(UnknownComponentError, match="widget"):
        reg.get("anything")


def test_unregister(reg):
    name = f"gone_{_uid()}"
    reg.register(name)(lambda x: x)
    reg.unregister(name)
    assert name not in reg
    with pytest.raises(UnknownComponentError):
        reg.get(name)


# ----------------------------------------------------------------------------------------
# gin
def test_keyword_arguments_bind_from_gin_as_name_dot_param(reg):
    name = f"scaler_{_uid()}"

    @reg.register(name)
    def scaler(x, *, scale=1.0, offset=0.0):
        return x * scale + offset

    assert reg.get(name)(2.0) == 2.0
    gin.parse_config(f"{name}.scale = 3.0\n{name}.offset = 0.5")
    assert reg.get(name)(2.0) == 6.5
    assert scaler(2.0) == 6.5  # the module-level name honours gin too
    assert reg.get(name)(2.0, scale=10.0) == 20.5  # an explicit argument wins
    gin.clear_config()
    gin.parse_config(f"{reg.gin_module}.{name}.scale = 4.0")  # family-scoped form
    assert reg.get(name)(2.0) == 8.0


def test_same_name_in_two_families_binds_per_family():
    name = f"shared_{_uid()}"
    r1, r2 = Registry("widget", f"widgets_{_uid()}"), Registry("gadget", f"gadgets_{_uid()}")
    r1.register(name)(lambda *, k=1: ("widget", k))
    r2.register(name)(lambda *, k=1: ("gadget", k))
    gin.parse_config(f"{r1.gin_module}.{name}.k = 5")
    assert r1.get(name)() == ("widget", 5)
    assert r2.get(name)() == ("gadget", 1)


def test_registered_class_is_constructed_with_gin_bound_arguments(reg):
    name = f"engine_{_uid()}"

    @reg.register(name)
    class Thing:
        def __init__(self, *, size=4, label="x"):
            self.size, self.label = size, label

    assert {p.name: p.default for p in reg.params(name)} == {"size": 4, "label": "x"}
    gin.parse_config(f"{name}.size = 16")
    obj = reg.get(name)(label="y")
    assert (obj.size, obj.label) == (16, "y")


def test_registering_after_the_gin_config_is_locked(reg):
    """A module imported lazily after the run's gin config was parsed (and so locked by gin's
    finalize step) -- e.g. the vllm engine imported on demand by make_engine, or a user module
    imported late -- must still register, and the parsed bindings must still apply."""
    name, late = f"early_{_uid()}", f"late_{_uid()}"
    reg.register(name)(lambda x, *, k=1: x * k)
    gin.parse_config_files_and_bindings([], [f"{name}.k = 3"])  # finalize_config=True locks
    reg.register(late)(lambda x, *, k=1: x + k)
    assert late in reg and reg.get(late)(1) == 2
    assert reg.get(name)(2) == 6


@pytest.mark.parametrize("registry", [LOSSES, AGGREGATIONS, ADVANTAGE_NORMS], ids=lambda r: r.family)
def test_every_builtin_parameter_of_my_families_is_bindable(registry):
    for name in registry.names():
        for p in registry.params(name):
            gin.clear_config()
            gin.parse_config(f"{name}.{p.name} = {p.default!r}")
            assert gin.query_parameter(f"{name}.{p.name}") == p.default
            gin.clear_config()
            gin.parse_config(f"{registry.gin_module}.{name}.{p.name} = {p.default!r}")


def test_every_builtin_parameter_of_every_family_is_bindable_from_gin():
    """With every built-in module loaded: `<gin_module>.<name>.<param>` always binds, and
    `<name>.<param>` binds whenever `name` is unique across families."""
    registry_mod.load_builtin_components()  # modules not written yet are skipped, not fatal
    counts = collections.Counter(n for r in ALL_REGISTRIES.values() for n in r.names())
    bad, checked = [], 0
    for fam, reg in ALL_REGISTRIES.items():
        for name in reg.names():
            for p in reg.params(name):
                selectors = [f"{reg.gin_module}.{name}.{p.name}"]
                if counts[name] == 1:
                    selectors.append(f"{name}.{p.name}")
                for sel in selectors:
                    gin.clear_config()
                    try:
                        gin.bind_parameter(sel, None)
                        checked += 1
                    except Exception as err:  # noqa: BLE001  (report every failure at once)
                        bad.append(f"{fam}: {sel}: {type(err).__name__}: {err}")
    assert bad == [], bad
    assert checked >= 20
