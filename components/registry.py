"""The one registry mechanism of scalerl-zoo.

Every component family (losses, aggregations, advantage normalizations, ...) is one
`Registry` instance. A component is registered with a decorator::

    from components.registry import LOSSES

    @LOSSES.register("my_loss")
    def my_loss(logp, gen_logp, advantages, mask, *, eps=0.2):
        ...

Registration also registers the callable with gin under the family's module name, so
its keyword arguments are bindable from a gin file as ``my_loss.eps = 0.1`` (or, if two
families register the same name, ``losses.my_loss.eps = 0.1``). Configs select
components by name strings, so a sweep is a list of strings.

A component defined in a user's own module is picked up as soon as that module is
imported, e.g. by an ``import my_module`` line at the top of a gin file.

The family instances below fill themselves on first use: the first lookup (``get``,
``names``, ``in``, ...) imports the built-in component modules, in any process, so
``from components.registry import LOSSES; LOSSES.get("grpo")`` works in a fresh interpreter.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import gin

__all__ = [
    "Registry",
    "UnknownComponentError",
    "DuplicateComponentError",
    "ParamSpec",
    "LOSSES",
    "AGGREGATIONS",
    "ADVANTAGE_NORMS",
    "CURRICULA",
    "PRECISIONS",
    "LENGTH_CONTROLS",
    "OFF_POLICY",
    "TASKS",
    "ENGINES",
    "REWARDS",
    "ALL_REGISTRIES",
    "load_builtin_components",
]


class UnknownComponentError(KeyError):
    """An unknown name was looked up in a registry.

    Subclasses KeyError (a missing key) but prints as a plain sentence.
    """

    def __str__(self) -> str:  # KeyError would wrap the message in quotes
        return str(self.args[0]) if self.args else ""


class DuplicateComponentError(ValueError):
    """A second, different component was registered under a name already taken."""


@dataclass(frozen=True)
class ParamSpec:
    """One configurable parameter of a registered component."""

    name: str
    default: Any  # inspect.Parameter.empty when required
    kind: str  # "keyword-only" or "positional-or-keyword"

    @property
    def required(self) -> bool:
        return self.default is inspect.Parameter.empty


def _configurable_params(obj: Callable) -> list[ParamSpec]:
    """Parameters with defaults (the hyper-parameters) of a function or a class's __init__."""
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return []
    specs = []
    for p in sig.parameters.values():
        if p.name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.kind == p.POSITIONAL_ONLY:
            continue
        if p.default is p.empty and p.kind != p.KEYWORD_ONLY:
            continue  # a positional input (a tensor), not a hyper-parameter
        kind = "keyword-only" if p.kind == p.KEYWORD_ONLY else "positional-or-keyword"
        specs.append(ParamSpec(p.name, p.default, kind))
    return specs


class Registry:
    """A named family of interchangeable components, selected by name strings.

    Args:
        family: human name of the family, used in error messages ("loss").
        gin_module: gin module under which entries are registered ("losses"), so an
            entry is bindable as ``<name>.<param>`` or ``<gin_module>.<name>.<param>``.
        autoload: the first lookup imports the built-in component modules
            (`load_builtin_components`); True for the family instances of this module.
    """

    def __init__(self, family: str, gin_module: str, *, autoload: bool = False):
        self.family = family
        self.gin_module = gin_module
        self.autoload = autoload
        self._entries: dict[str, Callable] = {}
        self._originals: dict[str, Callable] = {}
        self._lock = threading.Lock()

    # -- registration -------------------------------------------------------------
    def register(self, name: str, *, gin_configurable: bool = True) -> Callable[[Callable], Callable]:
        """Decorator: register a function or class under `name`.

        The returned object is the gin-configurable wrapper (what `get` returns), so the
        decorated name in its module also honours gin bindings.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.family} registry: a component name must be a non-empty string, got {name!r}")

        def decorator(obj: Callable) -> Callable:
            with self._lock:
                previous = self._originals.get(name)
                if previous is not None:
                    if previous is obj:
                        return self._entries[name]
                    if _same_definition(previous, obj) and not inspect.isclass(obj):
                        # The same function redefined (importlib.reload, a notebook cell):
                        # the gin wrapper dispatches through _originals, so updating the
                        # entry makes every existing reference run the new body.
                        self._originals[name] = obj
                        return self._entries[name]
                    raise DuplicateComponentError(
                        f"{self.family} {name!r} is already registered by "
                        f"{_where(previous)}; refusing to register {_where(obj)} under the same name. "
                        f"Pick another name (registered {self.family} names: {', '.join(sorted(self._entries))})."
                    )
                target = obj if inspect.isclass(obj) else self._dispatcher(name, obj)
                wrapped = _gin_register(target, name, self.gin_module) if gin_configurable else target
                self._entries[name] = wrapped
                self._originals[name] = obj
            return wrapped

        return decorator

    def _dispatcher(self, name: str, fn: Callable) -> Callable:
        """A function with `fn`'s signature that calls the entry's current definition."""

        @functools.wraps(fn)
        def dispatch(*args, **kwargs):
            return self._originals[name](*args, **kwargs)

        return dispatch

    # -- lookup ---------------------------------------------------------------------
    def _load(self) -> None:
        if self.autoload:
            _ensure_builtins_loaded()

    def get(self, name: str) -> Callable:
        """The component registered as `name` (gin-configurable); a clear error if unknown."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            pass
        self._load()  # a built-in not imported yet in this process
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise UnknownComponentError(self._unknown_message(name)) from None

    def _unknown_message(self, name: Any) -> str:
        names = self.names()
        by_lower = {n.lower(): n for n in names}
        close = difflib.get_close_matches(str(name).lower(), list(by_lower), n=1, cutoff=0.0) if names else []
        close = [by_lower[c] for c in close]
        hint = f" Did you mean {close[0]!r}?" if close else ""
        listed = ", ".join(names) if names else "(none registered)"
        failed = "".join(f" ({mod} could not be imported: {err})" for mod, err in _LOAD_FAILURES.items()) if self.autoload else ""
        return f"Unknown {self.family} {name!r}. Registered {self.family} names: {listed}.{hint}{failed}"

    def check(self, name: str) -> str:
        """Validate a name early (before a run starts); returns it unchanged."""
        self.get(name)
        return name

    def original(self, name: str) -> Callable:
        """The undecorated function or class (no gin wrapper), e.g. for introspection."""
        self.get(name)
        return self._originals[name]

    def names(self) -> list[str]:
        self._load()
        return sorted(self._entries)

    def params(self, name: str) -> list[ParamSpec]:
        """Configurable keyword parameters of an entry, with their defaults."""
        return _configurable_params(self.original(name))

    def describe(self) -> dict[str, dict[str, Any]]:
        """{name: {"params": {param: default-or-"<required>"}, "doc": first doc line, "where": module}}."""
        out = {}
        for name in self.names():
            obj = self._originals[name]
            params = {}
            for p in self.params(name):
                params[p.name] = "<required>" if p.required else p.default
            doc = inspect.getdoc(obj) or ""
            out[name] = {
                "params": params,
                "doc": doc.strip().splitlines()[0] if doc.strip() else "",
                "where": f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', name)}",
            }
        return out

    def unregister(self, name: str) -> None:
        """Remove an entry (for tests and interactive sessions). Gin keeps its binding scope."""
        with self._lock:
            self.get(name)
            del self._entries[name]
            del self._originals[name]

    def __contains__(self, name: object) -> bool:
        if name not in self._entries:
            self._load()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        self._load()
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.family!r}: {', '.join(self.names())})"


def _where(obj: Callable) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _same_definition(a: Callable, b: Callable) -> bool:
    return a is b or (
        getattr(a, "__module__", None) == getattr(b, "__module__", None)
        and getattr(a, "__qualname__", None) == getattr(b, "__qualname__", None)
    )


def _gin_register(obj: Callable, name: str, module: str) -> Callable:
    """Register with gin as `module.name`; tolerate an identical earlier registration."""
    try:
        # external_configurable returns a wrapper that applies gin bindings when called
        # directly (gin.register would leave direct calls unconfigured).
        # A module may register components after the run's config was parsed and locked
        # (a lazily imported engine, a user's module): registering adds no bindings.
        with gin.unlock_config():
            return gin.external_configurable(obj, name=name, module=module)
    except ValueError as err:  # gin refuses a second registration of the same selector
        if "already" in str(err).lower() or "exists" in str(err).lower():
            raise DuplicateComponentError(
                f"gin already has a configurable named {module}.{name}: {err}"
            ) from None
        raise


# One registry per component family (DESIGN.md "Registries").
LOSSES = Registry("loss", "losses", autoload=True)
AGGREGATIONS = Registry("loss aggregation", "aggregation", autoload=True)
ADVANTAGE_NORMS = Registry("advantage normalization", "advantages", autoload=True)
CURRICULA = Registry("curriculum", "curricula", autoload=True)
PRECISIONS = Registry("precision policy", "precision", autoload=True)
LENGTH_CONTROLS = Registry("length control", "length_control", autoload=True)
OFF_POLICY = Registry("off-policy scheme", "offpolicy", autoload=True)
TASKS = Registry("task", "tasks", autoload=True)
ENGINES = Registry("engine", "engines", autoload=True)
# Plain-function rewards: fn(prompt: str, completion: str, **row) -> float | bool (components/rewards.py).
REWARDS = Registry("reward", "rewards", autoload=True)

ALL_REGISTRIES: dict[str, Registry] = {
    "losses": LOSSES,
    "aggregations": AGGREGATIONS,
    "advantage_norms": ADVANTAGE_NORMS,
    "curricula": CURRICULA,
    "precisions": PRECISIONS,
    "length_controls": LENGTH_CONTROLS,
    "off_policy": OFF_POLICY,
    "tasks": TASKS,
    "engines": ENGINES,
    "rewards": REWARDS,
}

# Modules whose import fills the registries. A module that cannot be imported here
# (an optional dependency missing) is skipped by `load_builtin_components`, which says so.
BUILTIN_MODULES = (
    "components.losses",
    "components.aggregation",
    "components.advantages",
    "components.curricula",
    "components.precision",
    "components.length_control",
    "components.offpolicy",
    "components.tasks",
    "components.engines",
    "components.rewards",
)


def load_builtin_components(strict: bool = False) -> dict[str, str]:
    """Import every built-in component module so the registries are filled.

    Returns {module: error} for modules that failed to import (missing optional
    dependencies, or not written yet); raises instead when `strict`.
    """
    import importlib

    failures: dict[str, str] = {}
    # a first lookup may come after the gin config was finalized (locked): the built-in modules
    # still register their configurables, as a user module imported late does
    with gin.unlock_config():
        for mod in BUILTIN_MODULES:
            try:
                importlib.import_module(mod)
            except ImportError as err:
                if strict:
                    raise
                failures[mod] = f"{type(err).__name__}: {err}"
    _LOAD_FAILURES.clear()
    _LOAD_FAILURES.update(failures)
    return failures


# First-use loading of the built-ins (Registry.autoload). The flag is set only once the
# imports are done; the lock makes other threads wait for them, and the loading thread's own
# lookups during those imports (re-entrant) see what is registered so far.
_LOAD_LOCK = threading.RLock()
_LOADED = False
_LOADING = False
_LOAD_FAILURES: dict[str, str] = {}


def _ensure_builtins_loaded() -> None:
    global _LOADED, _LOADING
    if _LOADED:
        return
    with _LOAD_LOCK:
        if _LOADED or _LOADING:
            return
        _LOADING = True
        try:
            load_builtin_components()
        finally:
            _LOADING = False
            _LOADED = True
