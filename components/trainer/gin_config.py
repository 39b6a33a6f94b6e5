"""The one module that reads gin's state (experiments/ asks it too): a run's gin files and bindings parsed
(`parse_gin_files`), the values they bind for a registered component (`bound_values`: defaults,
then bindings, macros resolved), and gin's errors in words (the binding at fault, and what was
probably meant: `gin_error_message`, `check_binding_syntax`, `unknown_parameter_message`, ...), and
what was parsed, read through functions instead of gin's private tables (`parsed_bindings`,
`parsed_macros`, `import_lines`, `configurable_selector`, `configurable_function`, `short_selector`, `bound_parameter`).

It runs in the process that resolves a run (components/trainer/resolve.py); the run's processes
get the result, never gin. The TrainConfig and its checks are config.py's.
"""

from __future__ import annotations

import difflib
import inspect
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import gin

from components.quiet import quiet_gin
from components.registry import Registry, load_builtin_components

__all__ = ["ConfigError", "text_bindings", "bound_values", "components_config_str", "operative_config_str", "imported_modules",
           "import_lines", "parsed_bindings", "parsed_macros", "configurable_selector", "configurable_function",
           "short_selector", "bound_parameter", "parse_gin_files", "gin_error_message", "check_binding_syntax", "quoted_suggestion",
           "unknown_parameter_message", "unknown_configurable_message", "configurable_parameter_names"]

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """An inconsistent or invalid training configuration (raised before anything runs)."""


def bound_values(registry: Registry, name: str) -> dict[str, Any]:
    """Entry `name`'s parameters as a call with no keywords gets them under the parsed config:
    defaults, then gin bindings. Gin macros are resolved; a reference to another configurable
    (``@fn()``) is left unevaluated (evaluating it could build a model), and is not range-checked."""
    values = registry.defaults(name)
    try:
        bound = gin.get_bindings(f"{registry.gin_module}.{name}", resolve_references=False)
    except (ValueError, KeyError):  # registered without gin, or gin knows no such selector
        bound = {}
    values.update({k: _resolve_gin_macro(v) for k, v in bound.items()})
    return values


def components_config_str(table) -> str:
    """A run's resolved components (`TrainConfig.components`) as gin's operative config writes them:
    one "# Parameters for NAME:" section per component, every parameter it is built with."""
    from components.registry import ALL_REGISTRIES

    sections = {}
    for family, name, params in table:
        selector = f"{ALL_REGISTRIES[family].gin_module}.{name}"
        if selector in gin.config._REGISTRY:  # gin's selector map (no public lookup)
            sections[("", gin.config._REGISTRY.get_match(selector).selector)] = dict(params)
    return gin.config._config_str(sections) if sections else ""


def imported_modules() -> list[str]:
    """The modules the parsed gin files import (``import my_losses``), in gin's order."""
    return [statement.module for statement in sorted(gin.config._IMPORTS, key=lambda st: st.module)]


def import_lines() -> list[str]:
    """The parsed gin files' import statements as gin writes them (``import my_losses``), sorted."""
    return [statement.format() for statement in gin.config.ImportManager(gin.config._IMPORTS).sorted_imports]


def parsed_bindings() -> dict[tuple[str, str], dict[str, Any]]:
    """Every binding gin parsed: {(scope, full selector): {param: value}} (macros under selector
    "gin.macro", keyed by their name as scope), values as parsed (references unevaluated)."""
    return {key: dict(values) for key, values in gin.config._CONFIG.items()}


def parsed_macros() -> dict[str, Any]:
    """The parsed macros (``NAME = value``): {NAME: value}."""
    return {name: values.get("value") for (name, selector), values in gin.config._CONFIG.items()
            if selector == "gin.macro"}


def configurable_selector(name: str) -> Optional[str]:
    """The full selector of the configurable `name` (any unique suffix of it), None when gin has none."""
    match = gin.config._REGISTRY.get_match(name)
    return None if match is None else match.selector


def configurable_function(name: str) -> Optional[Any]:
    """The function or class gin registered as `name` (None when gin has none)."""
    match = gin.config._REGISTRY.get_match(name)
    return None if match is None else match.wrapped


def _signature(name: str) -> Optional[inspect.Signature]:
    """The signature of the function or class (its __init__) gin registered as `name` (None: unknown,
    or opaque)."""
    try:
        fn = configurable_function(name)
    except KeyError:
        return None
    if fn is None:
        return None
    try:
        return inspect.signature(fn.__init__ if inspect.isclass(fn) else fn)
    except (TypeError, ValueError):
        return None


def configurable_defaults(name: str) -> dict[str, Any]:
    """{parameter: default} of the configurable `name` (any unique suffix of its selector): the
    parameters that have a default; {} when gin has no such configurable or its signature is opaque."""
    sig = _signature(name)
    return {} if sig is None else {p.name: p.default for p in sig.parameters.values()
                                   if p.default is not p.empty and p.name != "self"}


def bound_parameter(key: str) -> Any:
    """The value bound to `key` (``selector.param``) as parsed, references unevaluated; ValueError
    when nothing binds it."""
    return gin.query_parameter(key)


def short_selector(selector: str) -> str:
    """The shortest selector that names `selector` unambiguously, as gin's operative config spells it."""
    return gin.config._REGISTRY.minimal_selector(selector)


def operative_config_str() -> str:
    """This process's operative gin config (the configurables it called through gin, their values)."""
    return gin.operative_config_str()


def is_gin_reference(value: Any) -> bool:
    """A value gin has not evaluated: a macro or a reference to a configurable (``@fn()``)."""
    return type(value).__name__ in ("ConfigurableReference", "MacroReference")


def _resolve_gin_macro(value: Any) -> Any:
    """A gin value with macros (``%NAME``) replaced by their values; other references are kept."""
    seen = 0
    while is_gin_reference(value) and getattr(getattr(value, "configurable", None), "name", None) == "macro" and seen < 32:
        macro = value.scoped_selector.rsplit("/", 1)[0]  # "NAME/gin.macro" -> "NAME"
        try:
            value = gin.query_parameter(f"{macro}/gin.macro.value")
        except (ValueError, KeyError):
            return value
        seen += 1
    return value


_GIN_SEARCH_PATHS: set[str] = set()  # directories already given to gin.add_config_file_search_path


def parse_gin_files(config_files: Sequence[str], bindings: Sequence[str]) -> tuple[list[str], list[str]]:
    """Import paths + built-in components, then parse the gin files and bindings (as `scalerl train`,
    `scalerl plan` and a sweep read a run's config). Returns (absolute config files, sys_path)."""
    files = []
    for f in config_files:
        p = Path(f).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"gin config file {str(f)!r} does not exist")
        files.append(str(p.resolve()))
    sys_path = []
    for d in [str(Path(f).parent) for f in files] + [os.getcwd()]:
        if d not in sys_path:
            sys_path.append(d)
    for d in reversed(sys_path):
        if d not in sys.path:
            sys.path.insert(0, d)
    failures = load_builtin_components()
    for mod, err in failures.items():
        log.debug("built-in component module %s not loaded: %s", mod, err)
    quiet_gin()
    gin.clear_config()
    for d in sys_path:  # `include 'base.gin'` resolves next to the including file
        if d not in _GIN_SEARCH_PATHS:  # gin appends on every call; a sweep parses many runs
            gin.add_config_file_search_path(d)
            _GIN_SEARCH_PATHS.add(d)
    for binding in bindings:  # a malformed binding is named (and a bare word quoted) before any file is read
        check_binding_syntax(binding)
    try:  # = gin.parse_config_files_and_bindings, one binding at a time so that an error names its binding
        gin.parse_config_files_and_bindings(files, [], finalize_config=False, skip_unknown=False)
    except (ValueError, KeyError, SyntaxError) as err:
        raise ConfigError(gin_error_message(err)) from None
    for binding in bindings:
        try:
            gin.parse_config(binding, skip_unknown=False)
        except (ValueError, KeyError, SyntaxError) as err:
            raise ConfigError(f"--gin binding {binding!r}: {gin_error_message(err, location=False)}") from None
    return files, sys_path


# -- gin's errors in words: the binding at fault, and what was probably meant ---------------------------
# (issue 33: a mistyped config is refused before anything runs, with a did-you-mean)
class _OpaqueReferences:
    """gin parser delegate for a syntax check: references and macros are left as text."""

    def configurable_reference(self, name: str, evaluate: bool) -> str:
        return f"@{name}{'()' if evaluate else ''}"

    def macro(self, name: str) -> str:
        return f"%{name}"


def text_bindings(text: str) -> dict[str, Any]:
    """Every binding of a gin config text (e.g. a run's config.gin) as {"[scope/]selector.param": value},
    references and macros left as their text ("@warm_start()", "%LR"); nothing is imported or bound."""
    import gin.config_parser as cp

    out = {}
    for statement in cp.ConfigParser(text, _OpaqueReferences()):
        if isinstance(statement, cp.BindingStatement):
            out[f"{statement.scope + '/' if statement.scope else ''}{statement.selector}.{statement.arg_name}"] = statement.value
    return out


def _gin_syntax_error(text: str) -> Optional[SyntaxError]:
    """gin's SyntaxError for `text` (one or more statements), or None when it parses."""
    import gin.config_parser as cp

    try:
        for _ in cp.ConfigParser(text, _OpaqueReferences()):
            pass
    except SyntaxError as err:
        return err
    return None


_ONE_WORD = re.compile(r"[A-Za-z_][\w.:/+-]*")
_BARE_WORD = re.compile(r"(?<![\w'\"@%.])([A-Za-z_]\w*)(?![\w'\"(.])")


def quoted_suggestion(statement: str) -> Optional[str]:
    """`train.loss = cispo` -> `train.loss = "cispo"`: the binding with its bare words quoted, when that parses."""
    lhs, sep, rhs = statement.strip().partition("=")
    value = rhs.strip()
    if not sep or not value:
        return None
    if _ONE_WORD.fullmatch(value) and value not in ("True", "False", "None"):
        quoted = json.dumps(value)
    else:  # a list or dict of bare words: ["uniform", "zero_variance_filter"]
        quoted = _BARE_WORD.sub(lambda m: m.group(1) if m.group(1) in ("True", "False", "None") else json.dumps(m.group(1)),
                                value)
    candidate = f"{lhs.strip()} = {quoted}"
    return candidate if quoted != value and _gin_syntax_error(candidate) is None else None


def _syntax_message(err: SyntaxError) -> str:
    """gin's SyntaxError in words (no parser internals); for a bare word, the statement with it quoted."""
    msg = str(err.msg or err).strip()
    token = re.search(r"Failed to parse token '([^']*)'", msg)
    line = (err.text or "").rstrip("\n")
    if token:
        suggestion = quoted_suggestion(line)
        return (f"{token.group(1)} is not a value (a string needs quotes)"
                + (f"; did you mean {suggestion}?" if suggestion else ""))
    first = msg.splitlines()[0].strip().rstrip(".")
    near = line[err.offset:].strip() if isinstance(err.offset, int) and 0 <= err.offset < len(line) else ""
    return f"{first} at {near!r}" if near else first


def _close(word: str, choices: Sequence[str]) -> Optional[str]:
    match = difflib.get_close_matches(word, list(choices), n=1)
    return match[0] if match else None


def configurable_parameter_names(selector: str) -> Optional[list[str]]:
    """The parameter names of gin configurable `selector` (None: unknown, or it takes **kwargs)."""
    try:
        sig = _signature(selector)
    except ValueError:  # an ambiguous selector
        return None
    if sig is None or any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    return [p.name for p in sig.parameters.values() if p.name != "self"]


def unknown_parameter_message(selector: str, param: str, params: Optional[Sequence[str]] = None) -> str:
    """"train has no parameter 'lrr'; did you mean train.lr?" (the parameters listed when none is close)."""
    params = configurable_parameter_names(selector) if params is None else list(params)
    close = _close(param, params or [])
    if close:
        hint = f"; did you mean {selector}.{close}?"
    else:
        hint = f"; its parameters: {', '.join(params)}" if params else ""
    return f"{selector} has no parameter {param!r}{hint}"


def unknown_configurable_message(selector: str) -> str:
    """"no gin configurable named 'trian'; did you mean train?"."""
    known = list(getattr(gin.config._REGISTRY, "_selector_map", {}))  # complete selectors, e.g. "losses.cispo"
    close = _close(selector, sorted({k.rsplit(".", 1)[-1] for k in known} | set(known)))
    return f"no gin configurable named {selector!r}" + (f"; did you mean {close}?" if close else "")


_GIN_CONTEXT = re.compile(r"^\s+In (call to configurable|bindings string|file )")


def gin_error_message(err: BaseException, location: bool = True) -> str:
    """One clean line for an error gin raised or annotated: gin's own context lines ("In call to
    configurable 'train' (<function ...>)") dropped, a parser error in words, an unknown
    configurable or parameter with a did-you-mean. `location`: keep "FILE line N: " in front."""
    if isinstance(err, SyntaxError) and err.msg is not None:
        where = f"{err.filename} line {err.lineno}: " if location and err.filename else ""
        return where + _syntax_message(err)
    lines = str(err).splitlines()
    cut = next((i for i, line in enumerate(lines) if _GIN_CONTEXT.match(line)), len(lines))
    msg = " ".join(line.strip() for line in lines[:cut]).strip()
    where = ""
    for line in lines[cut:]:
        m = re.match(r'^\s+In file "(.+)", line (\d+)', line)
        if m and location:
            where = f"{m.group(1)} line {m.group(2)}: "
    m = re.fullmatch(r"Configurable '(.+)' doesn't have a parameter named '(.+)'\.", msg)
    if m:
        msg = unknown_parameter_message(m.group(1), m.group(2))
    m = re.fullmatch(r"No configurable matching '(.+)'\.", msg)
    if m:
        msg = unknown_configurable_message(m.group(1))
    return where + (msg or type(err).__name__)


def check_binding_syntax(binding: str, label: str = "--gin binding") -> None:
    """A binding that does not parse, named, in words: `train.loss = cispo` -> did you mean `train.loss = "cispo"`?"""
    err = _gin_syntax_error(binding)
    if err is not None:
        raise ConfigError(f"{label} {binding!r} does not parse: {_syntax_message(err)}")
