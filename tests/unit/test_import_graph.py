"""slotkeeper's modules import each other without a cycle, function-level imports included.

The source is read with `ast`; an import names the deepest slotkeeper module it reaches (`from a.b import c` is
a.b.c when that is a module, else a.b).
"""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2] / "src" / "slotkeeper"


def _modules() -> dict[str, Path]:
    found = {}
    for path in SOURCE.rglob("*.py"):
        parts = list(path.relative_to(SOURCE.parent).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()

    def resolve(name: str) -> str:
        while name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: list[str] = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets += [f"{base}.{a.name}" for a in node.names]
        graph[name] = {resolve(t) for t in targets if t.split(".")[0] == "slotkeeper"} - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = [stack.pop()]
            while component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read() -> None:
    graph = import_graph()
    assert "slotkeeper.cli.admin_client" in graph["slotkeeper.cli.doctor"]
    assert "slotkeeper.cli.formatting" in graph["slotkeeper.cli.manage"]


def test_no_import_cycle() -> None:
    assert cycles(import_graph()) == []


def test_a_cycle_is_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_only_the_snapshots_module_and_its_parts_reach_the_store() -> None:
    """The rule "wait for a snapshot's pending writes before touching it" lives in cache/snapshots.py: nothing
    outside cache/ may import the store or its index, and so go around it."""
    store_parts = {"slotkeeper.cache.store", "slotkeeper.cache.index"}
    outside = {name: sorted(targets & store_parts) for name, targets in import_graph().items()
               if not name.startswith("slotkeeper.cache") and targets & store_parts}
    assert outside == {}


def test_the_web_layer_never_waits_for_writes_itself() -> None:
    web = SOURCE / "web"
    assert [p.name for p in web.rglob("*.py") if "settle" in p.read_text()] == []


# The layers, lowest first: a module imports only from its own layer and the ones below it. A layer is a list of
# folders and of the package's root modules (by name); the foundations are the root modules not named elsewhere and
# the generated test models. The settings (config.py) sit beside upstream/, whose command line they read and check.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("", "tinymodel"),
    ("dialects", "upstream", "config"),
    ("cache",),
    ("serving",),
    ("fleet",),
    ("web",),
    ("cli",),
)


def layer_of(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        place = ""
    elif (SOURCE / parts[1]).is_dir():
        place = parts[1]
    else:
        place = parts[1] if any(parts[1] in level for level in LAYERS) else ""
    for level, places in enumerate(LAYERS):
        if place in places:
            return level
    raise AssertionError(f"{module} is in no layer: add its folder to LAYERS")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{name} -> {target}" for name, targets in graph.items() for target in targets
                  if layer_of(target) > layer_of(name))


def test_no_import_runs_from_a_lower_layer_to_a_higher_one() -> None:
    assert upward_imports(import_graph()) == []


def test_an_upward_import_is_found() -> None:
    graph = {"slotkeeper.cache.pool": {"slotkeeper.web.app"}, "slotkeeper.web.app": {"slotkeeper.cache.pool"}}
    assert upward_imports(graph) == ["slotkeeper.cache.pool -> slotkeeper.web.app"]


def test_every_folder_is_in_a_layer() -> None:
    folders = {p.name for p in SOURCE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert folders == {f for level in LAYERS for f in level if f and (SOURCE / f).is_dir()}
