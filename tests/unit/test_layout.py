"""The package's layout is its architecture: one sub-package per role, every module saying its role in
its first docstring line, and imports that never go in a circle (function-local ones included)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import rpycdl

ROOT = Path(rpycdl.__file__).parent
ROLES = {"client", "wire", "security", "server", "scheduler", "gpu", "site", "monitor", "cli", "artifacts"}
SHARED = {"__init__", "__main__", "errors", "defaults", "units", "registry", "states"}
"""The modules at the top: the public API, the command's entry, and what every role shares."""


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


@functools.cache
def _tree(path: Path) -> ast.Module:
    """A module's syntax tree, parsed once for all the tests of this file."""
    return ast.parse(path.read_text())


@functools.cache
def _imports(path: Path) -> frozenset[str]:
    """The rpycdl modules `path` imports anywhere (but under `if TYPE_CHECKING:`): a package's name only
    for names it defines itself, its submodules' for those it imports from it."""
    tree = _tree(path)
    typing_only = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and getattr(block.test, "id", None) == "TYPE_CHECKING" for node in ast.walk(block)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            subs = {f"{node.module}.{alias.name}" for alias in node.names}
            found |= subs & MODULES.keys()
            if subs - MODULES.keys():
                found.add(node.module)
    return frozenset(found & MODULES.keys())


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            found.append(path[path.index(node):] + [node])
            return
        if node in done:
            return
        for target in sorted(graph.get(node, ())):
            visit(target, path + [node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
    return found


def test_the_folders_are_the_roles():
    top = {path.stem for path in ROOT.glob("*.py")}
    folders = {path.name for path in ROOT.iterdir() if (path / "__init__.py").exists()}
    assert folders == ROLES, f"sub-packages {sorted(folders)}, expected {sorted(ROLES)}"
    assert top == SHARED, f"modules at the top {sorted(top - SHARED)} belong in a sub-package"


def test_every_module_says_its_role_in_its_first_docstring_line():
    missing = [name for name, path in MODULES.items()
               if not (ast.get_docstring(_tree(path)) or "").strip()]
    assert not missing, f"modules without a docstring: {missing}"


def test_imports_never_go_in_a_circle():
    graph = {name: _imports(path) - {name} for name, path in MODULES.items()}
    cycles = _cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in cycles[:5])


def test_sub_packages_import_one_another_without_a_circle():
    def role(name: str) -> str:
        return ".".join(name.split(".")[:2])

    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        for target in _imports(path):
            if role(name) != role(target) and role(target) != "rpycdl":  # the public API imports the client
                graph.setdefault(role(name), set()).add(role(target))
    cycles = _cycles(graph)
    assert not cycles, "sub-packages in a circle: " + "; ".join(" -> ".join(cycle) for cycle in cycles[:5])


MODULE_LINES, FUNCTION_LINES, SERVICE_LINES = 450, 60, 200
"""Short rooms: no module over 450 lines, no function over 60, the RPyC service (thin) under 200."""


def test_modules_and_functions_stay_short():
    too_long = []
    for name, path in MODULES.items():
        source = path.read_text()
        limit = SERVICE_LINES - 1 if name == "rpycdl.server.service" else MODULE_LINES
        if len(source.splitlines()) > limit:
            too_long.append(f"{name}: {len(source.splitlines())} lines (at most {limit})")
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > FUNCTION_LINES:
                    too_long.append(f"{name}.{node.name}: {length} lines (at most {FUNCTION_LINES})")
    assert not too_long, "split these: " + "; ".join(too_long)
