"""The package's import graph: no cycle among its modules, config.py imports nothing of the
package, and lowering/ and converters/ import by absolute names a reader can open.

Read statically from the installed sources (found through the import system, so lowering/ and
converters/ count as ``npu_fuse_backend.lowering`` / ``.converters``): an edge is an import that
runs when the module is first imported (module level, not inside a function, where a lazy import
is how a late dependency is written). ``import a.b`` needs ``a`` loaded, but a package being
initialised is already in ``sys.modules``, so that implicit edge to a parent package is not one;
``from a import name`` of a name that is no submodule is an edge to ``a`` itself.
"""

import ast
import configparser
import importlib.util
from pathlib import Path

import pytest

SETUP_CFG = Path(__file__).resolve().parents[1] / "setup.cfg"


def packages() -> list:
    """The packages setup.cfg installs (some mapped from other folders: ``package_dir``)."""
    config = configparser.ConfigParser()
    config.read(SETUP_CFG)
    return config["options"]["packages"].split()


def package_modules() -> dict:
    """{module name: source path} of every module of the project's packages."""
    modules = {}
    for package in packages():
        spec = importlib.util.find_spec(package)
        modules[package] = Path(spec.origin)
        for folder in spec.submodule_search_locations:
            for path in sorted(Path(folder).glob("*.py")):
                if path.name != "__init__.py":
                    modules[f"{package}.{path.stem}"] = path
    return modules


def module_level_imports(tree: ast.Module):
    """Import statements run at import time: module level, also inside if/try/with blocks."""
    pending = list(tree.body)
    while pending:
        node = pending.pop(0)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            pending += [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                        *(h for handler in getattr(node, "handlers", []) for h in handler.body)]


def imported(name: str, is_package: bool, node, modules: dict) -> set:
    """The project's modules an import statement in module ``name`` loads."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    package = name if is_package else name.rpartition(".")[0]
    if node.level:
        base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module
    found = set()
    for alias in node.names:
        if f"{source}.{alias.name}" in modules:
            found.add(f"{source}.{alias.name}")
        elif source in modules:
            found.add(source)
    return found


@pytest.fixture(scope="module")
def graph() -> dict:
    modules = package_modules()
    edges = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        edges[name] = set().union(*(imported(name, is_package, n, modules) for n in module_level_imports(tree)))
        edges[name].discard(name)
    return edges


def find_cycle(edges: dict):
    """One import cycle as a list of module names, or None."""
    state, stack = {}, []

    def visit(name):
        state[name] = "open"
        stack.append(name)
        for dep in sorted(edges[name]):
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                cycle = visit(dep)
                if cycle:
                    return cycle
        stack.pop()
        state[name] = "done"
        return None

    for name in sorted(edges):
        if name not in state:
            cycle = visit(name)
            if cycle:
                return cycle
    return None


def test_the_graph_covers_every_layer_of_the_package(graph):
    for name in ("npu_fuse.ops", "npu_fuse_backend.fusion", "npu_fuse_backend.passes.rope",
                 "npu_fuse_backend.lowering.registry", "npu_fuse_backend.lowering.ops.mla_preprocess",
                 "npu_fuse_backend.converters.rope"):
        assert name in graph
    assert "npu_fuse_backend.soc" in graph["npu_fuse_backend.lowering.ops.rope"]  # an absolute import
    assert "npu_fuse_backend.fusion" in graph["npu_fuse_backend.matchers"]  # a relative one


def test_no_import_cycle_among_the_packages_modules(graph):
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]


def test_config_imports_nothing_from_the_package():
    """Not at import time, and not lazily inside a function either (its checks of values the
    package defines are fusion.check_config's)."""
    modules = package_modules()
    tree = ast.parse(modules["npu_fuse_backend.config"].read_text())
    found = set().union(*(imported("npu_fuse_backend.config", False, node, modules) for node in ast.walk(tree)
                          if isinstance(node, (ast.Import, ast.ImportFrom))))
    assert found == set()


def test_lowering_and_converters_import_by_absolute_names():
    """A relative import there names ``npu_fuse_backend....`` only through setup.cfg's mapping."""
    relative = []
    for name, path in package_modules().items():
        if name.startswith(("npu_fuse_backend.lowering", "npu_fuse_backend.converters")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level:
                    relative.append(f"{path.name}:{node.lineno}")
    assert relative == []
