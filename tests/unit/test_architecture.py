"""The house rules, checked: no import circle between our modules (lazy imports inside functions
count too: they are circles hidden from the import system, not absent), no module over 500 lines.
The module map these rules keep honest is docs/architecture.md."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"bytecheckpoint": ROOT / "core", "lightning_bytecheckpoint": ROOT / "lightning_bytecheckpoint",
            "accelerate_bytecheckpoint": ROOT / "accelerate_bytecheckpoint",
            "transformers_bytecheckpoint": ROOT / "transformers_bytecheckpoint"}
MAX_LINES = 500


def _modules() -> Dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([pkg] + parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(name: str, path: Path, known: Set[str]) -> Set[str]:
    """Our modules `name` imports (anywhere in the file, except under `if TYPE_CHECKING:`);
    a package's own __init__ is not an edge of its submodules (it only re-exports them)."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found: Set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - (node.level - 1)]
                mod = ".".join(anchor + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    edges = set()
    for mod in found:
        while mod and mod not in known:
            mod = mod.rpartition(".")[0]
        if mod and mod != name and not name.startswith(mod + "."):
            edges.add(mod)
    return edges


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_no_import_circles():
    mods = _modules()
    graph = {m: _imports(m, p, set(mods)) for m, p in mods.items()}
    cycles = _cycles(graph)
    assert not cycles, "import circles (move the shared piece into a leaf module): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_the_checker_sees_a_lazy_circle(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_no_module_over_500_lines():
    long = {m: n for m, p in _modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split along a seam): {long}"


# The engine's layers, bottom up (docs/architecture.md draws the same order): a module imports only
# from its own folder and the folders below it. The facade is the modules left directly in core/
# (checkpointer, api); the package's own __init__/__main__ only re-export and are not a layer.
LAYERS = ("common", "monitor", "geometry", "format", "planning", "storage", "foreign", "collectives", "state", "data", "pipeline", "catalog", "tiers",
          "facade", "tools", "adapters")
ROOT_ONLY = {"bytecheckpoint", "bytecheckpoint.__main__"}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or parts[1] in LAYERS else "facade"


def test_core_is_a_folder_per_layer():
    top = sorted(p.name for p in PACKAGES["bytecheckpoint"].iterdir()
                 if p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))
    folders = [n for n in top if not n.endswith(".py")]
    assert sorted(folders) == sorted(set(LAYERS) - {"facade"}), f"core/ folders {folders} vs layers {LAYERS}"
    loose = [n for n in top if n.endswith(".py")]
    assert set(loose) <= {"__init__.py", "__main__.py", "api.py", "checkpointer.py"}, loose


def _upward_imports(layers) -> List[str]:
    known = set(_modules())
    bad = []
    for m, p in sorted(_modules().items()):
        if not m.startswith("bytecheckpoint") or m in ROOT_ONLY:
            continue
        mine = layers.index(_layer(m))
        for dep in _imports(m, p, known):
            if not dep.startswith("bytecheckpoint"):
                continue
            if dep == "bytecheckpoint":
                bad.append(f"{m} imports the package root (import the module instead)")
            elif layers.index(_layer(dep)) > mine:
                bad.append(f"{m} ({_layer(m)}) imports {dep} ({_layer(dep)})")
    return bad


def test_layers_import_only_downwards():
    bad = _upward_imports(LAYERS)
    assert not bad, "imports that go up a layer (move the piece down, or pass it in):\n  " + "\n  ".join(bad)


def test_the_layer_checker_sees_an_upward_import():
    swapped = tuple(sorted(LAYERS, key=lambda layer: layer != "pipeline"))  # pipeline put at the bottom
    assert any(" (pipeline) imports " in b for b in _upward_imports(swapped))
