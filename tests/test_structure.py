"""The code keeps its shape: no import circles, imports only downward through the layers of
docs/architecture.md (import-linter's contracts in pyproject.toml), no private names imported across
modules, no function over 80 lines, and the linter's small rule set (pyflakes, import order, no product function
over 8 parameters) clean. Static (ast and the linters), no import of the package.
"""

from __future__ import annotations

import ast
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("hybrid_cp", "topology")
LONG = 80


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, (ast.Name, ast.Attribute)) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(module: str, path: pathlib.Path):
    """(target module, imported names) for every run-time import of `module` (function-level included)."""
    tree = ast.parse(path.read_text())
    skip = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and _is_type_checking(node)
        for child in node.body
        for n in ast.walk(child)
    }
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [a.name for a in node.names]
            # `from pkg import submodule` imports the submodule
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
            if len(subs) < len(names):
                yield target, [n for n in names if f"{target}.{n}" not in MODULES]
            for sub in subs:
                yield sub, []


def _graph() -> dict[str, dict[str, list[str]]]:
    graph = {}
    for module, path in MODULES.items():
        edges = graph.setdefault(module, {})
        for target, names in _imports(module, path):
            if target in MODULES and target != module and not module.startswith(target + "."):  # own package
                edges.setdefault(target, []).extend(names)
    return graph


def _circles(graph: dict[str, dict]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
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

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    assert _circles(_graph()) == []


@pytest.mark.skipif(shutil.which("lint-imports") is None, reason="import-linter is installed with the [test] extra")
def test_imports_go_down_the_layers():
    """The import-linter contracts of pyproject.toml (the layers of docs/architecture.md, and the facade)."""
    done = subprocess.run(["lint-imports", "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_no_private_names_across_modules():
    private = [
        f"{m} imports {n} from {t}"
        for m, edges in _graph().items()
        for t, names in edges.items()
        for n in names
        if n.startswith("_") and not n.startswith("__")
    ]
    assert private == []


def test_no_function_over_80_lines():
    long = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LONG:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} {lines} lines")
    assert long == []


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is installed with the [test] extra")
def test_linter_is_clean():
    """pyflakes, import order, and no product function over 8 parameters (PLR0913: settings travel as one
    AttentionSpec or Split; public entry points and the kernel protocol carry a noqa saying so)."""
    done = subprocess.run(["ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is installed with the [test] extra")
def test_code_is_formatted():
    """One layout for every file (ruff format, line length 120): a diff shows what changed, not whose editor."""
    done = subprocess.run(["ruff", "format", "--check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr + "\nrun: ruff format ."
