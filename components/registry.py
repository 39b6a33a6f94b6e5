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

Numeric hyper-parameters are checked before a run starts (`Registry.check_params`, called by
the trainer's config validation with the values the run will use: defaults, gin bindings,
explicit keywords). Every parameter whose annotation or default is a number must be a finite
number (an ``int`` one an integer); a range declared at registration narrows it further::

    @LOSSES.register("my_loss", ranges={"eps": "(0, 1)", "beta": ">= 0"})

A range is ``"> x"``, ``">= x"``, ``"< x"``, ``"<= x"`` or an interval ``"[a, b)"`` (brackets
closed, parentheses open); a closed infinite bound (``"[0, inf]"``) lets that infinity through.
A bad value is refused with the component, the parameter, the value and the range:
``cispo.eps_max = -1.0 is out of range: must be > 0``.

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
import math
import numbers
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import gin

__all__ = [
    "Registry",
    "UnknownComponentError",
    "DuplicateComponentError",
    "ParamSpec",
    "Range",
    "ParamRangeError",
    "parse_range",
    "check_numeric",
    "configurable_params",
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
    "TRACKERS",
    "WEIGHT_SYNC_BACKENDS",
    "KL_ESTIMATORS",
    "LR_SCHEDULES",
    "MISMATCH_CORRECTIONS",
    "ENVIRONMENTS",
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


class ParamRangeError(ValueError):
    """A numeric hyper-parameter is not a finite number, or is outside its declared range."""


@dataclass(frozen=True)
class ParamSpec:
    """One configurable parameter of a registered component."""

    name: str
    default: Any  # inspect.Parameter.empty when required
    kind: str  # "keyword-only" or "positional-or-keyword"
    annotation: Any = inspect.Parameter.empty  # as written in the signature (a type or a string)

    @property
    def required(self) -> bool:
        return self.default is inspect.Parameter.empty

    @property
    def numeric(self) -> Optional[str]:
        """"int", "float" or None (not a number), from the annotation, else from the default's type."""
        return numeric_kind(self.annotation, self.default)


# -- numeric ranges -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Range:
    """An allowed interval for a number: bounds `lo` / `hi` (None: unbounded), each closed or open.

    Infinite values are outside every range unless a bound is a CLOSED infinity (``[0, inf]``).
    """

    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_closed: bool = True
    hi_closed: bool = True

    def contains(self, x: float) -> bool:
        if math.isnan(x):
            return False
        if math.isinf(x) and not (x == self.lo and self.lo_closed or x == self.hi and self.hi_closed):
            return False
        if self.lo is not None and (x < self.lo or (x == self.lo and not self.lo_closed)):
            return False
        if self.hi is not None and (x > self.hi or (x == self.hi and not self.hi_closed)):
            return False
        return True

    def __str__(self) -> str:
        """"> 0", "<= 1", "in [0, 1)", or "any finite number"."""
        if self.lo is not None and self.hi is not None:
            return f"in {'[' if self.lo_closed else '('}{_num(self.lo)}, {_num(self.hi)}{']' if self.hi_closed else ')'}"
        if self.lo is not None:
            return f"{'>=' if self.lo_closed else '>'} {_num(self.lo)}"
        if self.hi is not None:
            return f"{'<=' if self.hi_closed else '<'} {_num(self.hi)}"
        return "any finite number"


_NUMBER = r"([-+]?(?:inf|(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?))"
_COMPARISON = re.compile(rf"^\s*(>=|<=|>|<)\s*{_NUMBER}\s*$", re.IGNORECASE)
_INTERVAL = re.compile(rf"^\s*([\[(])\s*{_NUMBER}\s*,\s*{_NUMBER}\s*([\])])\s*$", re.IGNORECASE)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def parse_range(spec: "str | Range") -> Range:
    """A `Range` from its text: "> 0", ">= 1", "< 1", "<= 1", "[0, 1)", "(0, 1]", "[a, b]", "(a, b)"."""
    if isinstance(spec, Range):
        return spec
    text = str(spec)
    m = _COMPARISON.match(text)
    if m:
        op, x = m.group(1), float(m.group(2))
        return Range(lo=x, lo_closed=op == ">=") if op.startswith(">") else Range(hi=x, hi_closed=op == "<=")
    m = _INTERVAL.match(text)
    if m:
        lo, hi = float(m.group(2)), float(m.group(3))
        if lo > hi:
            raise ValueError(f"range {text!r}: the lower bound {_num(lo)} is above the upper bound {_num(hi)}")
        return Range(lo=lo, hi=hi, lo_closed=m.group(1) == "[", hi_closed=m.group(4) == "]")
    raise ValueError(
        f"cannot read the range {text!r}; write one of '> x', '>= x', '< x', '<= x' or an interval "
        "'[a, b]', '[a, b)', '(a, b]', '(a, b)' (e.g. '> 0', '[0, 1)')"
    )


_NON_NUMERIC_WORDS = {"Optional", "Union", "None", "NoneType", "typing", "numbers"}


def numeric_kind(annotation: Any, default: Any = inspect.Parameter.empty) -> Optional[str]:
    """"int", "float" or None: what a parameter's annotation (type or string) says it holds.

    Optional[...] and unions of int and float count; anything else (str, bool, a tensor, a
    union with str) is not numeric. Without an annotation the default's type decides.
    """
    if annotation is inspect.Parameter.empty or annotation is None:
        if isinstance(default, bool):
            return None
        if isinstance(default, float):
            return "float"
        if isinstance(default, int):
            return "int"
        return None
    text = annotation.__name__ if isinstance(annotation, type) else str(annotation)
    words = set(re.findall(r"[A-Za-z_]+", text)) - _NON_NUMERIC_WORDS
    if words == {"int"}:
        return "int"
    if words and words <= {"int", "float", "Real"}:
        return "float"
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_gin_reference(value: Any) -> bool:
    return type(value).__name__ in ("ConfigurableReference", "MacroReference")


def _allowed(kind: Optional[str], rng: Optional[Range], finite: bool) -> str:
    """The allowed values in words: "> 0", "an integer >= 1", "finite and in (0, 1]", "a finite number"."""
    if rng is None:
        return "an integer" if kind == "int" else "a finite number"
    if kind == "int":
        return f"an integer {rng}"
    infinity_ok = any(b is not None and math.isinf(b) and closed for b, closed in ((rng.lo, rng.lo_closed), (rng.hi, rng.hi_closed)))
    return f"finite and {rng}" if finite and not infinity_ok else str(rng)


def range_problem(label: str, value: Any, kind: Optional[str], rng: Optional[Range]) -> Optional[str]:
    """Why `label = value` is refused ("cispo.eps_max = -1.0 is out of range: must be > 0"), or None.

    `kind` ("int", "float" or None) comes from the signature, `rng` (None: any finite number)
    from the declared range. None values and unresolved gin references are not checked.
    """
    if value is None or _is_gin_reference(value):
        return None
    if not _is_number(value):
        return f"{label} = {value!r} is not a number: must be {_allowed(kind, rng, False)}"
    x = float(value)
    ok = (rng.contains(x) if rng is not None else math.isfinite(x)) and (kind != "int" or x.is_integer())
    if ok:
        return None
    return f"{label} = {value!r} is out of range: must be {_allowed(kind, rng, not math.isfinite(x))}"


def check_numeric(owner: str, params: Sequence[ParamSpec], values: Mapping[str, Any],
                  ranges: Optional[Mapping[str, Any]] = None) -> None:
    """Raise `ParamRangeError` listing every numeric parameter of `owner` whose value is refused.

    Checked: each parameter in `params` that is numeric (`ParamSpec.numeric`) or has a declared
    range in `ranges`, with its value from `values` (parameters absent from `values` are skipped).
    """
    ranges = {k: parse_range(v) for k, v in (ranges or {}).items()}
    problems = []
    for p in params:
        if p.name not in values or (p.numeric is None and p.name not in ranges):
            continue
        problem = range_problem(f"{owner}.{p.name}", values[p.name], p.numeric, ranges.get(p.name))
        if problem:
            problems.append(problem)
    if problems:
        raise ParamRangeError("; ".join(problems))


def configurable_params(obj: Callable) -> list[ParamSpec]:
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
        specs.append(ParamSpec(p.name, p.default, kind, p.annotation))
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
        self._ranges: dict[str, dict[str, Range]] = {}
        self._diagnostics: dict[str, Callable] = {}
        self._lock = threading.Lock()

    # -- registration -------------------------------------------------------------
    def register(self, name: str, *, gin_configurable: bool = True,
                 ranges: Optional[Mapping[str, "str | Range"]] = None,
                 diagnostics: Optional[Callable] = None) -> Callable[[Callable], Callable]:
        """Decorator: register a function or class under `name`.

        The returned object is the gin-configurable wrapper (what `get` returns), so the
        decorated name in its module also honours gin bindings.

        `ranges` declares the allowed values of numeric parameters, {param: "> 0" | "[0, 1)" | ...}
        (`parse_range`); every numeric parameter must be finite whether declared or not
        (`check_params`). A range naming no parameter of the component is refused here.

        `diagnostics` is the entry's diagnostics hook (`diagnostics_of`), called by whoever runs
        the entry with the entry's own inputs and hyper-parameters (for a loss,
        ``fn(logp, gen_logp, advantages, mask, **hparams) -> {metric: float}``; see
        `components.losses.loss_diagnostics`).
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.family} registry: a component name must be a non-empty string, got {name!r}")
        if diagnostics is not None and not callable(diagnostics):
            raise TypeError(f"{self.family} {name!r}: diagnostics must be callable, got {diagnostics!r}")

        def decorator(obj: Callable) -> Callable:
            wrapped = self._register(name, obj, gin_configurable, ranges)
            with self._lock:
                if diagnostics is not None:
                    self._diagnostics[name] = diagnostics
                else:
                    self._diagnostics.pop(name, None)
            return wrapped

        return decorator

    def _register(self, name: str, obj: Callable, gin_configurable: bool,
                  ranges: Optional[Mapping[str, "str | Range"]]) -> Callable:
        parsed = _parse_ranges(f"{self.family} {name!r}", obj, ranges)
        with self._lock:
            previous = self._originals.get(name)
            if previous is not None:
                if previous is obj:
                    self._ranges[name] = parsed or self._ranges.get(name, {})
                    return self._entries[name]
                if _same_definition(previous, obj) and not inspect.isclass(obj):
                    # The same function redefined (importlib.reload, a notebook cell):
                    # the gin wrapper dispatches through _originals, so updating the
                    # entry makes every existing reference run the new body.
                    self._originals[name] = obj
                    self._ranges[name] = parsed
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
            self._ranges[name] = parsed
        return wrapped

    def declare_ranges(self, name: str, ranges: Mapping[str, "str | Range"]) -> None:
        """Add ranges to an entry already registered (e.g. a class from another package)."""
        parsed = _parse_ranges(f"{self.family} {name!r}", self.original(name), ranges)
        with self._lock:
            self._ranges[name] = {**self._ranges.get(name, {}), **parsed}

    def diagnostics_of(self, name: str) -> Optional[Callable]:
        """The diagnostics hook registered with entry `name` (``register(..., diagnostics=fn)``), or None."""
        self.get(name)
        return self._diagnostics.get(name)

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
        return configurable_params(self.original(name))

    def param_ranges(self, name: str) -> dict[str, Range]:
        """The ranges declared for an entry's parameters, {param: Range}."""
        self.get(name)
        return dict(self._ranges.get(name, {}))

    def defaults(self, name: str) -> dict[str, Any]:
        """The entry's hyper-parameters with their defaults (a run's own values: its resolved config)."""
        return {p.name: p.default for p in self.params(name) if not p.required}

    def build(self, name: str, params: Optional[Mapping[str, Any]] = None) -> Callable:
        """Entry `name` with a run's hyper-parameters `params` bound as arguments: calling it calls the
        registered function or class itself, gin's state unread (a name `params` lacks keeps its
        default). An argument the caller gives (by position or keyword) wins over `params`, as over
        a gin binding. `params` None: the entry as gin configures it (`get`; a tool or a test
        outside a resolved run)."""
        if params is None:
            return self.get(name)
        fn = self.original(name)
        bound = {**self.defaults(name), **dict(params)}
        positional = _positional_names(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            given = set(positional[: len(args)]) | set(kwargs)
            return fn(*args, **{k: v for k, v in bound.items() if k not in given}, **kwargs)

        call.params = dict(bound)
        return call

    def check_params(self, name: str, values: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
        """Refuse (`ParamRangeError`) numeric parameters of entry `name` that are not finite or out of range.

        `values`: those a run calls the entry with (its resolved hyper-parameters, explicit keywords
        such as ``train.task_kwargs`` included); missing ones are the entry's defaults. Returns them.
        """
        values = {**self.defaults(name), **dict(values or {})}
        check_numeric(name, self.params(name), values, self._ranges.get(name))
        return values

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
                "ranges": {k: str(r) for k, r in self._ranges.get(name, {}).items()},
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
            self._ranges.pop(name, None)
            self._diagnostics.pop(name, None)

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


def _parse_ranges(label: str, obj: Callable, ranges: Optional[Mapping[str, Any]]) -> dict[str, Range]:
    """{param: Range} from a declaration; a parameter the component does not have is an error."""
    if not ranges:
        return {}
    names = [p.name for p in configurable_params(obj)]
    unknown = [k for k in ranges if k not in names]
    if unknown:
        raise ValueError(f"{label}: ranges name {', '.join(map(repr, unknown))}, not parameters of "
                         f"{_where(obj)} (its parameters: {', '.join(names) or 'none'})")
    out = {}
    for param, spec in ranges.items():
        try:
            out[param] = parse_range(spec)
        except ValueError as err:
            raise ValueError(f"{label}: parameter {param!r}: {err}") from None
    return out


def _positional_names(fn: Callable) -> list[str]:
    """The names of the parameters `fn` (a class: its __init__, self aside) takes by position."""
    target = fn.__init__ if inspect.isclass(fn) else fn
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.name != "self" and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


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
# Experiment trackers, chosen by train.trackers (components/trainer/tracking.py).
TRACKERS = Registry("tracker", "trackers", autoload=True)
# How learner-0's weights reach the generators, chosen by train.weight_sync_backend
# (components/trainer/weight_sync.py; "auto" picks one of them).
WEIGHT_SYNC_BACKENDS = Registry("weight-sync backend", "weight_sync_backends", autoload=True)
# Per-token KL(pi || pi_ref) estimators of the reference-KL penalty, chosen by train.kl_estimator:
# fn(logp [B, T], ref_logp [B, T]) -> kl [B, T] (components/kl.py).
KL_ESTIMATORS = Registry("KL estimator", "kl_estimators", autoload=True)
# Learning-rate schedules, chosen by train.lr_schedule: fn(update, warmup_steps, total_steps) -> LR factor
# (components/schedules.py).
LR_SCHEDULES = Registry("learning-rate schedule", "lr_schedules", autoload=True)
# Training-inference mismatch corrections, chosen by train.mismatch_correction:
# fn(old_logp [B, T], gen_logp [B, T], mask [B, T]) -> per-token loss weight [B, T] (components/mismatch.py).
MISMATCH_CORRECTIONS = Registry("mismatch correction", "mismatch", autoload=True)
# Multi-turn environments, chosen by train.environment (None: single turn): a class built per episode as
# cls(task, problem) whose step(turn) answers an Observation or ends with a Reward (components/environments.py).
ENVIRONMENTS = Registry("environment", "environments", autoload=True)

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
    "trackers": TRACKERS,
    "weight_sync_backends": WEIGHT_SYNC_BACKENDS,
    "kl_estimators": KL_ESTIMATORS,
    "lr_schedules": LR_SCHEDULES,
    "mismatch_corrections": MISMATCH_CORRECTIONS,
    "environments": ENVIRONMENTS,
}

# Modules whose import fills the registries: the one list of the built-in modules (a package's
# __init__ does not import its component modules for this). A module that cannot be imported here
# (an optional dependency missing) is skipped by `load_builtin_components`, which says so.
BUILTIN_MODULES = (
    "components.losses",
    "components.aggregation",
    "components.advantages",
    "components.curricula",
    "components.precision",
    "components.length_control",
    "components.offpolicy",
    "components.tasks.arithmetic",
    "components.tasks.stories",
    "components.tasks.reasoning_gym_task",
    "components.tasks.math_file",
    "components.tasks.code_file",
    "components.tasks.hf_dataset",
    "components.tasks.mixture",
    "components.tasks.tool_arithmetic",
    "components.engines",
    "components.rewards",
    "components.trainer.tracking",
    "components.trainer.weight_sync",
    "components.trainer.weight_sync_backends",
    "components.kl",
    "components.schedules",
    "components.mismatch",
    "components.environments",
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
