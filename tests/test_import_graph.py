"""The layers of the code base (docs/DESIGN.md, "Layers"): who may import whom, and no import cycle.

The graph is read from the source with `ast`: every import of every module of components/,
analysis/, paper_figures/ and experiments/, function-level imports included (a lazy import is
still a dependency; an ``if TYPE_CHECKING:`` import, for annotations only, never runs and is left
out). The layer order is read from docs/DESIGN.md's ```layers block, so the document and the
check cannot part: no module imports one of a higher layer, and no two modules import each
other, directly or through others.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("components", "analysis", "experiments", "paper_figures")
FORBIDDEN = {
    "components": ("experiments", "analysis", "paper_figures"),
    "analysis": ("experiments", "paper_figures"),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `name` imports anywhere in its file (relative imports resolved)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def add(target: str) -> None:
        while target and target not in known:  # `from a.b import c`: c may be a name in a.b
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                add(f"{base}.{alias.name}" if base else alias.name)
    return found


def _runtime_nodes(tree: ast.AST):
    """Every node but those under ``if TYPE_CHECKING:`` (annotation-only imports run never)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                todo.extend(child.orelse)
                continue
            todo.append(child)


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def read_layers(text: str) -> list[tuple[int, str, list[str]]]:
    """(rank, layer name, module patterns) of each line of the ```layers block of a design document."""
    block = re.search(r"^```layers\n(.*?)^```", text, flags=re.S | re.M)
    if block is None:
        raise AssertionError("docs/DESIGN.md has no ```layers block")
    layers = []
    for line in block.group(1).splitlines():
        rank, name, *patterns = line.split()
        layers.append((int(rank), name, patterns))
    return layers


def layer_of(module: str, layers) -> tuple[int, str]:
    """The (rank, name) of the most specific pattern naming `module`: an exact name before a
    `prefix.*` pattern, a longer prefix before a shorter one."""
    best = None
    for rank, name, patterns in layers:
        for pattern in patterns:
            if pattern.endswith(".*"):
                prefix = pattern[:-2]
                if module.startswith(prefix + "."):
                    key = (len(prefix), 0)
                else:
                    continue
            elif module == pattern:
                key = (len(pattern), 1)
            else:
                continue
            if best is None or key > best[0]:
                best = (key, rank, name)
    if best is None:
        raise AssertionError(f"module {module} is in no layer of docs/DESIGN.md's ```layers block")
    return best[1], best[2]


@pytest.fixture(scope="module")
def layers():
    return read_layers((REPO / "docs" / "DESIGN.md").read_text(encoding="utf-8"))


def test_the_layer_table_is_read_and_most_specific_wins(layers):
    assert [name for _, name, _ in layers][:4] == ["registry", "families", "engines", "trainer"]
    assert layer_of("components.registry", layers)[1] == "registry"
    assert layer_of("components.losses", layers)[1] == "families"
    assert layer_of("components.engines.base", layers)[1] == "families"
    assert layer_of("components.engines.torch_engine", layers)[1] == "engines"
    assert layer_of("components.trainer.loop", layers)[1] == "trainer"
    assert layer_of("experiments.train", layers)[1] == "experiments"
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of("elsewhere.module", layers)


def climbing_imports(graph: dict[str, set[str]], layers) -> list[str]:
    """Every import of a module from a higher layer, as "a (layer) -> b (layer)"."""
    bad = []
    for mod, deps in sorted(graph.items()):
        rank, name = layer_of(mod, layers)
        for dep in sorted(deps):
            dep_rank, dep_name = layer_of(dep, layers)
            if dep_rank > rank:
                bad.append(f"{mod} ({name}) -> {dep} ({dep_name})")
    return bad


def test_a_planted_climbing_import_is_found(layers):
    planted = {"components.losses": {"components.trainer.loop"}, "components.trainer.loop": {"components.losses"}}
    assert climbing_imports(planted, layers) == ["components.losses (families) -> components.trainer.loop (trainer)"]


def test_every_module_is_in_a_layer_and_no_import_climbs_one(graph, layers):
    bad = climbing_imports(graph, layers)
    assert not bad, "imports from a lower layer into a higher one (docs/DESIGN.md, Layers):\n" + "\n".join(bad)


def test_function_level_imports_are_read():
    # `from components.trainer.gin_config import parse_gin_files` sits inside a function of eval_run_settings.py
    modules = _modules()
    deps = _imports("experiments.eval_run_settings", modules["experiments.eval_run_settings"], set(modules))
    assert "components.trainer.gin_config" in deps


def test_the_graph_is_read(graph):
    # the reader is not vacuous: known edges are found
    assert "components.registry" in graph["components.losses"]
    assert "components.trainer.learner" in graph["components.trainer.loop"]
    assert any(dep.startswith("components.") for dep in graph["experiments.train"])


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_no_import_climbs_a_layer(graph, layer):
    bad = sorted(f"{mod} -> {dep}" for mod, deps in graph.items() if mod.split(".")[0] == layer
                 for dep in deps if dep.split(".")[0] in FORBIDDEN[layer])
    assert not bad, f"{layer}/ imports a layer above it:\n" + "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_planted_cycle():
    planted = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(planted) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle(graph):
    # a package's __init__ re-exporting its modules is not a cycle of behaviour: leave the
    # package -> own-submodule edges out, keep every other edge (function-level imports included)
    edges = {mod: {dep for dep in deps if not (dep.startswith(mod + ".") and _modules()[mod].name == "__init__.py")}
             for mod, deps in graph.items()}
    cycles = _cycles(edges)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


GIN_STATE = re.compile(r"gin\.config\._[A-Za-z]|gin\.(query_parameter|get_bindings|config_str|parse_config)\b")


def _gin_state_readers(root: Path) -> list[str]:
    return sorted(f"{p.relative_to(root)}:{i}" for pkg in PACKAGES for p in (root / pkg).rglob("*.py")
                  for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1)
                  if GIN_STATE.search(line) and p.relative_to(root).as_posix() != "components/trainer/gin_config.py")


def test_only_gin_config_reads_gins_state(tmp_path):
    """gin's parsed state (its private tables, query_parameter, get_bindings, ...) is read by
    components/trainer/gin_config.py alone; experiments/ asks it (parsed_bindings, short_selector, ...)."""
    assert _gin_state_readers(REPO) == []
    planted = tmp_path / "experiments" / "x.py"  # the scan finds a reader
    planted.parent.mkdir(parents=True)
    planted.write_text("import gin\nsel = gin.config._REGISTRY.get_match('train')\n")
    assert _gin_state_readers(tmp_path) == ["experiments/x.py:2"]
