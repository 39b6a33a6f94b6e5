"""Size limits (issue 42): no module over 800 lines and no function over 100 lines under
components/ and experiments/. A longer one is split along its responsibilities."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("components", "experiments")
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 100


def oversized(root: Path, packages=PACKAGES, max_module: int = MAX_MODULE_LINES,
              max_function: int = MAX_FUNCTION_LINES) -> list[str]:
    """Every module longer than `max_module` lines and every function (method, nested function)
    longer than `max_function` lines, from its `def` line to its last line, decorators aside."""
    found = []
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            rel = path.relative_to(root)
            lines = len(text.splitlines())
            if lines > max_module:
                found.append(f"{rel}: {lines} lines (limit {max_module})")
            for node in ast.walk(ast.parse(text, filename=str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = node.end_lineno - node.lineno + 1
                    if length > max_function:
                        found.append(f"{rel}:{node.lineno} {node.name}(): {length} lines (limit {max_function})")
    return found


def test_a_planted_long_module_and_function_are_found(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(5))
    (pkg / "m.py").write_text(f"def long():\n{body}\n\n\ndef short():\n    return 1\n")
    assert oversized(tmp_path, ("pkg",), max_module=100, max_function=5) == ["pkg/m.py:1 long(): 6 lines (limit 5)"]
    assert oversized(tmp_path, ("pkg",), max_module=5, max_function=100) == ["pkg/m.py: 10 lines (limit 5)"]


def test_no_module_or_function_over_the_limits():
    found = oversized(REPO)
    assert not found, "split these along their responsibilities:\n" + "\n".join(found)
