"""`scalerl components`: every registry family, its entries and each entry's parameters."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--family", default=None, help="only this family (e.g. losses)")
    parser.add_argument(
        "--import", dest="imports", action="append", default=[], metavar="MODULE",
        help="also import this module (a user's own components) before listing; repeatable",
    )


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return repr(value)


def collect(family: str | None = None) -> tuple[dict[str, dict], dict[str, str]]:
    from components.registry import ALL_REGISTRIES, load_builtin_components

    failures = load_builtin_components()
    if family is not None and family not in ALL_REGISTRIES:
        raise SystemExit(f"unknown family {family!r}; choose from: {', '.join(ALL_REGISTRIES)}")
    table = {
        fam: {name: {**info, "params": {k: _jsonable(v) for k, v in info["params"].items()}}
              for name, info in reg.describe().items()}
        for fam, reg in ALL_REGISTRIES.items()
        if family is None or fam == family
    }
    return table, failures


def main(args: argparse.Namespace) -> int:
    sys.path.insert(0, ".")
    for mod in args.imports:
        importlib.import_module(mod)
    table, failures = collect(args.family)
    if args.json:
        print(json.dumps({"families": table, "import_errors": failures}, indent=2))
        return 0
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    # every text cell is escaped: a description's "[low, high]" is text, not rich markup
    console = Console()
    for fam, entries in table.items():
        t = Table(title=escape(f"{fam} ({len(entries)})"), title_justify="left", show_lines=False)
        t.add_column("name", style="bold cyan")
        t.add_column("parameters (defaults)")
        t.add_column("description")
        for name, info in entries.items():
            params = ", ".join(f"{k}={v!r}" if v != "<required>" else f"{k} (required)" for k, v in info["params"].items())
            t.add_row(escape(name), escape(params or "-"), escape(info["doc"] or ""))
        console.print(t)
    for mod, err in failures.items():
        console.print(f"[yellow]note:[/] {escape(mod)} not loaded ({escape(str(err))})")
    return 0
