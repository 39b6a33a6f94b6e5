"""What crosses a boundary of the grading harness: plain data, report MACs, output digests.

Runs in the sandbox as ``_grade_wire.py`` beside the harness's ``main.py`` (`_grade_harness`
loads it by path at start-up, before any program runs), where both ends of the program's server
(`_grade_rpc`) encode and decode with it; the host imports it as ``components.tasks._grade_wire``
(re-exported by `_grade_harness`) to write the spec and judge the report. Standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import sys

PROGRAM_FILE = "solution.py"  # the program, in the run's working dir beside main.py
PROGRAM_MODULE = "solution"  # the only name the program is imported under (functional / assert)
MAX_MESSAGE = 64 * 2**20  # a single RPC message (request or reply) larger than this is an error


# -- plain data --------------------------------------------------------------------------------
class EncodeError(TypeError):
    """A value that is not plain data (and no handle is allowed for it)."""


def encode(x, handle=None):
    """`x` as JSON-able tagged data; containers recursively. Exact types only (no subclasses).

    JSON lists are lists, other containers are tagged objects ``{"#": kind, "v": ...}``;
    ``handle(x)`` (when given) turns any other object into a tag, else `EncodeError`.
    """
    t = type(x)
    if x is None or t is bool or t is str:
        return x
    if t is int:  # JSON digits are limited (sys.int_max_str_digits); hex is not
        return x if -2**63 < x < 2**63 else {"#": "int", "v": hex(x)}
    if t is float:
        return x if x == x and x not in (float("inf"), float("-inf")) else {"#": "float", "v": repr(x)}
    if t is list:
        return [encode(v, handle) for v in x]
    if t is tuple:
        return {"#": "tuple", "v": [encode(v, handle) for v in x]}
    if t is dict or _is_plain_dict_type(t):
        return {"#": "dict", "v": [[encode(k, handle), encode(v, handle)] for k, v in dict.items(x)]}
    if t is set or t is frozenset:
        return {"#": t.__name__, "v": [encode(v, handle) for v in x]}
    if t is complex:
        return {"#": "complex", "v": [repr(x.real), repr(x.imag)]}
    if t is bytes:
        return {"#": "bytes", "v": x.hex()}
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(x, (numpy.generic, numpy.ndarray)):
        return encode(x.item() if isinstance(x, numpy.generic) else x.tolist(), handle)  # as Python values
    if handle is not None:
        return handle(x)
    raise EncodeError(f"a value of type {t.__name__} is not plain data")


def _is_plain_dict_type(t) -> bool:
    """collections.Counter / OrderedDict / defaultdict (exactly): encoded as plain dicts."""
    collections = sys.modules.get("collections")
    return collections is not None and t in (collections.Counter, collections.OrderedDict, collections.defaultdict)


def decode(x, resolve=None):
    """Inverse of `encode` for JSON-decoded `x`; raises ValueError on anything malformed.

    ``resolve(tag)`` turns handle / ref tags into objects (when given), else they are errors.
    """
    if x is None or isinstance(x, (bool, str, int, float)):
        return x
    if isinstance(x, list):
        return [decode(v, resolve) for v in x]
    if not isinstance(x, dict) or not isinstance(x.get("#"), str):
        raise ValueError(f"malformed value {str(x)[:100]!r}")
    kind, v = x["#"], x.get("v")
    if kind in ("handle", "ref") and resolve is not None:
        return resolve(x)
    if kind == "int" and isinstance(v, str) and len(v) < 1 << 20:
        return int(v, 16)
    if kind == "float" and v in ("nan", "inf", "-inf"):
        return float(v)
    if kind == "tuple" and isinstance(v, list):
        return tuple(decode(e, resolve) for e in v)
    if kind in ("set", "frozenset") and isinstance(v, list):
        items = [decode(e, resolve) for e in v]
        try:
            return set(items) if kind == "set" else frozenset(items)
        except TypeError as err:
            raise ValueError(f"unhashable set element: {err}") from None
    if kind == "dict" and isinstance(v, list) and all(isinstance(p, list) and len(p) == 2 for p in v):
        try:
            return {decode(k, resolve): decode(e, resolve) for k, e in v}
        except TypeError as err:
            raise ValueError(f"unhashable dict key: {err}") from None
    if kind == "complex" and isinstance(v, list) and len(v) == 2 and all(isinstance(p, str) for p in v):
        return complex(float(v[0]), float(v[1]))
    if kind == "bytes" and isinstance(v, str):
        return bytes.fromhex(v)
    raise ValueError(f"malformed value {str(x)[:100]!r}")


def dumps(x) -> str:
    return json.dumps(x, separators=(",", ":"), allow_nan=False)


def loads(text):
    """json.loads that refuses NaN / Infinity tokens (encode tags those) and bounds recursion errors."""

    def no_constant(name):
        raise ValueError(f"unexpected JSON constant {name}")

    try:
        return json.loads(text, parse_constant=no_constant)
    except RecursionError:
        raise ValueError("value nested too deeply") from None


def report_mac(key: str, previous: str, body: str) -> str:
    """MAC of one report line, chained to the previous line's: only the harness (which alone
    holds the key) can write a report the host accepts, and no line can be dropped or moved."""
    return hmac.new(key.encode(), (previous + "\n" + body).encode(), hashlib.sha256).hexdigest()[:32]


# -- stdio outputs -----------------------------------------------------------------------------
def normalize_output(text: str) -> str:
    """The lines of `text` with trailing whitespace and trailing blank lines removed, joined by newlines."""
    lines = [ln.rstrip() for ln in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def output_digest(salt: str, text: str) -> str:
    """Salted SHA-256 of the normalised output: what the harness reports instead of the output."""
    return hashlib.sha256((salt + "\0" + normalize_output(text)).encode("utf-8", "surrogatepass")).hexdigest()
