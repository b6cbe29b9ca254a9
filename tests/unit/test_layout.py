"""The code's layout: in ``recipes/`` and ``optim_factory/`` no import cycle (imports inside functions, and the
package ``__init__`` an import runs first, included); no module over 400 lines and no function over 80; no
private name imported from another module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("recipes", "optim_factory")
MOST_LINES = 400
MOST_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, str]]:
    """(module imported, name taken from it or "") of every import in the file, at any depth."""
    found = []
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, "") for a in node.names if a.name in modules]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:  # a submodule
                    found.append((f"{base}.{alias.name}", ""))
                elif base in modules:
                    found.append((base, alias.name))
    return found


def _with_parents(importer: str, dep: str, modules: dict[str, Path]) -> set[str]:
    """``dep`` and the packages whose ``__init__`` importing it runs first (none the importer is inside: those
    are already being imported when it runs)."""
    parts = dep.split(".")
    found = {dep} | {".".join(parts[:i]) for i in range(1, len(parts))}
    inside = {".".join(importer.split(".")[:i]) for i in range(1, importer.count(".") + 2)}
    return {m for m in found if m in modules and m not in inside}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {
        m: {d for dep, _ in _imports(m, p, modules) for d in _with_parents(m, dep, modules)} - {m}
        for m, p in modules.items()
    }


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        state[m] = 2
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycle_lazy_imports_included():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()))


def test_the_cycle_check_finds_a_lazy_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_an_import_runs_its_parent_packages_first():
    modules = dict.fromkeys(["a", "a.b", "a.b.c", "a.d"], Path())
    assert _with_parents("a.d", "a.b.c", modules) == {"a.b", "a.b.c"}  # a/__init__ runs already: a.d is in it
    assert _with_parents("x", "a.b.c", modules) == {"a", "a.b", "a.b.c"}


def test_a_lazy_import_is_an_edge(tmp_path):
    modules = {"recipes.x": tmp_path / "x.py", "recipes.y": tmp_path / "y.py"}
    modules["recipes.x"].write_text("def f():\n    from recipes import y\n    from recipes.y import g\n")
    assert _imports("recipes.x", modules["recipes.x"], modules) == [("recipes.y", ""), ("recipes.y", "g")]


def test_no_module_over_400_lines():
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in _modules().values()}
    assert not {path: n for path, n in lines.items() if n > MOST_LINES}


def test_no_function_over_80_lines():
    long = {
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name}": node.end_lineno - node.lineno + 1
        for path in _modules().values()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MOST_FUNCTION_LINES
    }
    assert not long


def test_no_private_name_imported_from_another_module():
    modules = _modules()
    private = [
        f"{m}: {dep}.{name}"
        for m, p in modules.items()
        for dep, name in _imports(m, p, modules)
        if name.startswith("_") and not name.startswith("__")
    ]
    assert not private
