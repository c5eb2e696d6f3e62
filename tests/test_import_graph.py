"""The import graph of ``tome_core/`` and ``tools/``, read from the source with ``ast`` (nothing is imported):
no module cycle, no package cycle, and the layers one way only (the engine below its hosts, the fidelity tool
below the benchmark, ``tools/common`` below both).

Every import counts, those inside functions too; relative imports are resolved, and only modules of this
repository are followed. ``import a.b.c`` imports the module ``a.b.c`` only (not its parents' ``__init__``).
A module's package node is its directory, except that a package's ``__init__.py`` is a node of its own (a facade
such as ``tome_core/__init__.py`` is the public entry, not the engine).
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tome_core", "tools")

# (importers, what they must not import): the engine (tome_core outside its hosts and its facade) knows no host;
# the fidelity tool no benchmark (the benchmark may sample with it); tools/common neither tool.
FORBIDDEN = [
    (lambda m: within(m, "tome_core") and m != "tome_core" and not within(m, "tome_core.hosts"), "tome_core.hosts"),
    (lambda m: within(m, "tools.fidelity"), "tools.bench"),
    (lambda m: within(m, "tools.common"), "tools.bench"),
    (lambda m: within(m, "tools.common"), "tools.fidelity"),
]


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def find_modules(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """Dotted name -> file of every module under ``packages`` (``a/b/__init__.py`` is ``a.b``)."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The repository modules that module ``name`` (file ``path``) imports, anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            for alias in node.names:  # `from a import b`: the module a.b where there is one, else a
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {module for module in found if module in modules and module != name}


def module_graph(root: Path, packages=PACKAGES) -> tuple[nx.DiGraph, dict[str, Path]]:
    modules = find_modules(root, packages)
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        graph.add_edges_from((name, target) for target in imported(name, path, modules))
    return graph, modules


def package_node(path: Path, root: Path) -> str:
    relative = path.relative_to(root)
    return str(relative) if relative.name == "__init__.py" else f"{relative.parent}/"


def package_graph(graph: nx.DiGraph, modules: dict[str, Path], root: Path) -> nx.DiGraph:
    packages = nx.DiGraph()
    for source, target in graph.edges:
        a, b = package_node(modules[source], root), package_node(modules[target], root)
        if a != b:
            packages.add_edge(a, b)
    return packages


def cycles(graph: nx.DiGraph) -> list[list[str]]:
    """The nodes of every strongly connected group (nodes that reach each other: one cycle or several)."""
    return sorted(sorted(group) for group in nx.strongly_connected_components(graph) if len(group) > 1)


def forbidden_imports(graph: nx.DiGraph) -> list[str]:
    return sorted(
        f"{source} imports {target}"
        for source, target in graph.edges
        for importer, banned in FORBIDDEN
        if importer(source) and within(target, banned)
    )


def describe(graph: nx.DiGraph, found: list[list[str]]) -> str:
    """One cycle of each group, and the group's other nodes where it has more."""
    lines = []
    for group in found:
        cycle = [edge[0] for edge in nx.find_cycle(graph.subgraph(group))]
        others = sorted(set(group) - set(cycle))
        lines.append(" -> ".join([*cycle, cycle[0]]) + (f" (with {', '.join(others)} on cycles too)" if others else ""))
    return "\n".join(lines)


# The repository.


def test_no_module_cycle():
    graph, _ = module_graph(ROOT)
    assert len(graph) > 50  # the files were found
    found = cycles(graph)
    assert not found, f"import cycles among modules:\n{describe(graph, found)}"


def test_no_package_cycle():
    graph, modules = module_graph(ROOT)
    packages = package_graph(graph, modules, ROOT)
    found = cycles(packages)
    assert not found, f"import cycles among packages:\n{describe(packages, found)}"


def test_layers_import_one_way():
    graph, _ = module_graph(ROOT)
    assert ("tome_core.hosts.comfyui.patch", "tome_core.settings") in graph.edges  # the hosts do use the engine
    found = forbidden_imports(graph)
    assert not found, "imports against the layering:\n" + "\n".join(found)


# The checks themselves: each finds what it looks for.


def test_cycle_detector_finds_a_cycle():
    graph = nx.DiGraph([("a", "b"), ("b", "c"), ("c", "a"), ("a", "d")])
    assert cycles(graph) == [["a", "b", "c"]]
    assert describe(graph, cycles(graph)) in ("a -> b -> c -> a", "b -> c -> a -> b", "c -> a -> b -> c")
    graph.add_edge("d", "a")  # a second cycle through a: a -> d -> a
    assert cycles(graph) == [["a", "b", "c", "d"]] and "on cycles too" in describe(graph, cycles(graph))
    graph.remove_edges_from([("c", "a"), ("d", "a")])
    assert cycles(graph) == []


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_checks_find_cycles_and_forbidden_imports_in_a_fake_tree(tmp_path):
    write(
        tmp_path,
        {
            "tome_core/__init__.py": "from .hosts import host\n",  # the facade may use a host
            "tome_core/hosts/__init__.py": "",
            "tome_core/hosts/host.py": "from .. import engine\n",
            "tome_core/engine.py": "def f():\n    from .hosts.host import g\n",  # inside a function, relative
            "tools/bench/speed.py": "import tools.bench.unet.steps\n",
            "tools/bench/unet/steps.py": "from ..speed import choose_device\n",  # back up: a package cycle
            "tools/fidelity/run.py": "from tools.bench import speed\n",
        },
    )
    graph, modules = module_graph(tmp_path)
    assert set(graph.edges) == {
        ("tome_core", "tome_core.hosts.host"),
        ("tome_core.hosts.host", "tome_core.engine"),
        ("tome_core.engine", "tome_core.hosts.host"),
        ("tools.bench.speed", "tools.bench.unet.steps"),
        ("tools.bench.unet.steps", "tools.bench.speed"),
        ("tools.fidelity.run", "tools.bench.speed"),
    }
    assert cycles(graph) == [
        ["tome_core.engine", "tome_core.hosts.host"],
        ["tools.bench.speed", "tools.bench.unet.steps"],
    ]
    packages = package_graph(graph, modules, tmp_path)
    assert cycles(packages) == [["tome_core/", "tome_core/hosts/"], ["tools/bench/", "tools/bench/unet/"]]
    assert forbidden_imports(graph) == [
        "tome_core.engine imports tome_core.hosts.host",
        "tools.fidelity.run imports tools.bench.speed",
    ]
    # Without the imports back up, nothing is left to find; the facade's import of its host is no cycle.
    write(tmp_path, {"tome_core/engine.py": "", "tools/bench/unet/steps.py": "import torch\n"})
    graph, modules = module_graph(tmp_path)
    assert cycles(graph) == [] and cycles(package_graph(graph, modules, tmp_path)) == []
