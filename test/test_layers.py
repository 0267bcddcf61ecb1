"""The layers import one way (README "Layout"): every module of the package is parsed, imports
inside functions included, and an import of a higher layer or a cycle between modules fails,
naming the file, line and import. An import under ``if TYPE_CHECKING:`` counts as upward like any
other, but not in a cycle: it is never executed, so it orders nothing."""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# installed name -> folder (pyproject.toml's package-dir)
PACKAGES = {"torch_kernelize": "torch_kernelize", "torch_kernelize.lowering": "lowering",
            "torch_kernelize.fallbacks": "fallbacks", "torch_kernelize.kernel_cache": "kernel_cache"}
# lowest first; a module may import its own layer and the ones before it
LAYERS = ["core", "kernel_cache", "serving", "building", "generators", "compiling", "warm_start",
          "backend", "fill_cache", "repro", "ledger", "apps"]
# module name prefix -> layer; the longest prefix that matches decides
PREFIXES = {
    "torch_kernelize": "core",  # the package itself: __version__ and flush_repros, no imports
    "torch_kernelize.core": "core",
    "torch_kernelize.kernel_cache": "kernel_cache",
    "torch_kernelize.serving": "serving",
    "torch_kernelize.fallbacks": "serving",
    "torch_kernelize.building": "building",
    "torch_kernelize.lowering": "generators",
    "torch_kernelize.compiling": "compiling",
    "torch_kernelize.warm_start": "warm_start",
    "torch_kernelize.backend": "backend",
    "torch_kernelize.aot": "backend",
    "torch_kernelize.fill_cache": "fill_cache",
    "torch_kernelize.repro": "repro",
    "torch_kernelize.ledger": "ledger",
    "torch_kernelize.bottlenecks": "apps",
    "torch_kernelize.bringup": "apps",
    "torch_kernelize.cache": "apps",
    "torch_kernelize.demo": "apps",
    "torch_kernelize.demo_external": "apps",
    "torch_kernelize.model_zoo": "apps",
    "torch_kernelize.repros": "apps",
}


def modules() -> dict[str, Path]:
    """Every module of the installed package, by its import name."""
    found = {}
    for name, folder in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [name, *path.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in PREFIXES:
            layer = PREFIXES[".".join(parts[:n])]
            # the package's own prefix names only its __init__ and the modules listed above
            return layer if n > 1 or len(parts) == 1 else None
    return None


def imports(module: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(imported module, line, type-checking only) for each import of one of ``known`` in
    ``path``, at any depth."""
    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    type_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
                 for stmt in block.body for n in ast.walk(stmt)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import sub` imports the submodule; `from mod import name`, the module
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in dict.fromkeys(names):
            target = resolve(name)
            if target is not None and target != module:
                found.append((target, node.lineno, id(node) in type_only))
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


@functools.cache
def graph() -> tuple[dict[str, Path], dict[str, list[tuple[str, int, bool]]]]:
    known = modules()
    return known, {m: imports(m, p, known) for m, p in known.items()}


def cycles(edges: dict[str, list[tuple[str, int, bool]]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative), over the
    imports that run."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(t for t, _, typing in edges[root] if not typing))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(t for t, _, typing in edges[w] if not typing)))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_module_has_a_layer():
    unmapped = [m for m in modules() if layer_of(m) is None]
    assert not unmapped, f"modules with no layer (add them to PREFIXES in {Path(__file__).name}): {unmapped}"


def test_no_upward_import():
    known, edges = graph()
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    upward = []
    for m, targets in edges.items():
        for target, line, _ in targets:
            if layer_of(m) and layer_of(target) and rank[layer_of(target)] > rank[layer_of(m)]:
                upward.append(f"{known[m].relative_to(ROOT)}:{line} imports {target} "
                              f"({layer_of(target)}) from layer {layer_of(m)}")
    assert not upward, "upward imports (layers, lowest first: " + " <- ".join(LAYERS) + "):\n" + "\n".join(upward)


def test_no_import_cycle():
    known, edges = graph()
    found = []
    for component in cycles(edges):
        inside = set(component)
        found.append("cycle: " + ", ".join(
            f"{known[m].relative_to(ROOT)}:{line} -> {t}"
            for m in component for t, line, typing in edges[m] if t in inside and not typing))
    assert not found, "\n".join(found)


@pytest.mark.parametrize("source, expect", [
    ("from torch_kernelize.compiling.planner import Decision\n", "upward"),
    ("def f():\n    from torch_kernelize.compiling import planner\n", "upward"),
    ("if TYPE_CHECKING:\n    from torch_kernelize.compiling.planner import Decision\n", "upward"),
    ("from torch_kernelize.core.spec import KernelSpec\n", None),
])
def test_the_check_sees_upward_imports(tmp_path, source, expect):
    """The check itself: an import of compiling from a serving module, at module level or in a
    function, is found; an import of core is not."""
    path = tmp_path / "probe.py"
    path.write_text(source)
    known = modules()
    module = "torch_kernelize.serving.probe"
    targets = imports(module, path, {**known, module: path})
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    up = [t for t, _, _ in targets if rank[layer_of(t)] > rank[layer_of(module)]]
    assert bool(up) == (expect == "upward"), targets


def test_the_check_sees_cycles():
    edges = {"a": [("b", 1, False)], "b": [("c", 2, False)], "c": [("a", 3, False)], "d": [("a", 4, False)],
             "e": [("f", 5, False)], "f": [("e", 6, True)]}  # e <-> f only for type checking
    assert cycles(edges) == [["a", "b", "c"]]
