"""The code keeps its shape: no import circles, imports only downward through the layers of
docs/architecture.md (import-linter's contracts in pyproject.toml), no private names imported across
modules, no function over 80 lines, no product function over 8 parameters, and the linter's small rule set
(pyflakes, import order) clean. Static (ast and the linters), no import of the package.

    python tests/test_structure.py      # the functions over 8 parameters, by package
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
WIDE = 8   # parameters (self, cls and an autograd Function's ctx not counted)

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
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node)
            for child in node.body for n in ast.walk(child)}
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
                base = base[:len(base) - node.level + 1]
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
    private = [f"{m} imports {n} from {t}" for m, edges in _graph().items() for t, names in edges.items()
               for n in names if n.startswith("_") and not n.startswith("__")]
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


def _exported(tree: ast.Module) -> set[str]:
    """The names a module's `__all__` lists (literal lists and `+=` of literal lists)."""
    names: set[str] = set()
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id == "__all__" and isinstance(node.value, (ast.List, ast.Tuple)):
            names |= {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
    return names


def _exempt(path: pathlib.Path, fn: ast.FunctionDef, top: bool, public: set[str], owner: str) -> bool:
    """Flat on purpose: a public entry point (a top-level name in its module's or the facade's `__all__`), a
    torch custom op's definition or fake (their schema is flat), or a kernel's forward/backward (the public
    `AttentionKernel` protocol: flash-attn's flat keywords, which users' registered kernels implement)."""
    ops = any(word in ast.unparse(d) for d in fn.decorator_list for word in ("custom_op", "register_fake"))
    kernel = "kernels" in path.parts and fn.name in ("forward", "backward") and owner != "Function"
    return (top and fn.name in public) or ops or kernel


def wide_functions() -> list[str]:
    """Every function of the packages with more than WIDE parameters that `_exempt` does not excuse."""
    facade = _exported(ast.parse((ROOT / "hybrid_cp" / "__init__.py").read_text()))
    wide = []

    def visit(node, path, public, prefix, top, owner):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                bases = "Function" if any("Function" in ast.unparse(b) for b in child.bases) else ""
                visit(child, path, public, f"{prefix}{child.name}.", False, bases)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = child.args
                n = len([x for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls", "ctx")])
                if n > WIDE and not _exempt(path, child, top, public, owner):
                    wide.append(f"{path.relative_to(ROOT)}:{prefix}{child.name} {n}")
                visit(child, path, public, f"{prefix}{child.name}.", False, owner)

    for path in MODULES.values():
        tree = ast.parse(path.read_text())
        visit(tree, path, _exported(tree) | facade, "", True, "")
    return sorted(wide)


def test_no_product_function_over_8_parameters():
    """An attention call's settings travel as one `AttentionSpec` and its plan as one `AttentionCall`
    (docs/architecture.md); in topology a split as one `Split`. Public entry points (names in `__all__`) are
    exempt: their keywords are the user's interface."""
    assert wide_functions() == []


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is installed with the [test] extra")
def test_linter_is_clean():
    done = subprocess.run(["ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


if __name__ == "__main__":
    found = wide_functions()
    for package in ("hybrid_cp/engine", "hybrid_cp", "topology"):
        mine = [w for w in found if w.startswith(package + "/")]
        found = [w for w in found if w not in mine]
        print(f"{package}: {len(mine)} functions over {WIDE} parameters")
        for w in mine:
            print(f"  {w}")
