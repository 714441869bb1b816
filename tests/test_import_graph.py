"""The package's import graph (issue 34): no circle through the server or the benchmarks, and the
server does not depend on the benchmarks.

The graph is read from the source with :mod:`ast`, so it has every import a module can run: those
at the top, those inside functions (imported on first call) and those under ``TYPE_CHECKING``.
An edge ``a -> b`` means some ``import`` statement in ``a`` names ``b``; ``from p import x``
names the module ``p.x`` when there is one, else ``p``. Imports by string
(``importlib.import_module``) are not seen. The core's own circle (``oasiskv`` <-> ``engine`` <->
``llm_engine`` ...) is left to the engine split and not checked here.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

#: Packages that must stay out of every import circle.
ACYCLIC = ("oasiskv.bench", "oasiskv.serve")


def _modules(root: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package's ``__init__``), for every ``.py`` under ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Edges from each module of ``package`` (sources under ``root``) to the modules of the same
    package it imports, at any depth of its code."""
    mods = _modules(root, package)
    graph: dict[str, set[str]] = {}
    for name, (path, is_pkg) in mods.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    parent = ".".join(base + ([node.module] if node.module else []))
                else:
                    parent = node.module or ""
                for a in node.names:
                    sub = f"{parent}.{a.name}"
                    targets.add(sub if sub in mods else parent)
        graph[name] = {t for t in targets if t in mods and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative): each is a set of modules that import one another in a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def reachable(graph: dict[str, set[str]], starts) -> set[str]:
    seen = set(starts)
    todo = list(seen)
    while todo:
        for w in graph[todo.pop()]:
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    spec = importlib.util.find_spec("oasiskv")  # the sources, without importing the package
    return import_graph(Path(spec.submodule_search_locations[0]), "oasiskv")


def test_graph_sees_function_level_imports(graph):
    # `oasis serve` imports the FastAPI app inside cmd_serve only: the walker must see it, or the
    # checks below would pass on a graph with the circles' edges missing.
    assert "oasiskv.serve.app" in graph["oasiskv.serve.cli"]
    assert "oasiskv.bench.fig11" in graph["oasiskv.bench.serve"]  # `from . import fig11`
    assert "oasiskv.serve.config" in graph["oasiskv.serve.app"]


@pytest.mark.parametrize("package", ACYCLIC)
def test_no_import_circle_through(graph, package):
    bad = [c for c in cycles(graph) if any(_in(m, package) for m in c)]
    assert not bad, (
        f"import circles through {package}: {bad}; move what the modules share into a module "
        "both import (e.g. oasiskv.bench.common, oasiskv.serve.config)"
    )


def test_server_does_not_import_the_benchmarks(graph):
    serve = [m for m in graph if _in(m, "oasiskv.serve")]
    reached = reachable(graph, serve)
    bench = sorted(m for m in reached if _in(m, "oasiskv.bench"))
    assert not bench, f"oasiskv.serve reaches {bench}; the server must not depend on the benchmarks"


def test_checks_catch_a_function_level_circle(tmp_path):
    # The checks themselves: a circle closed by an import inside a function is found, and so is
    # a module reached through `from . import x`.
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import x\n    return x\n")
    (pkg / "c.py").write_text("from . import a\n")
    g = import_graph(pkg, "pkg")
    assert g["pkg.a"] == {"pkg.sub.b"} and g["pkg.sub.b"] == {"pkg.a"} and g["pkg.c"] == {"pkg.a"}
    assert cycles(g) == [["pkg.a", "pkg.sub.b"]]
    assert reachable(g, ["pkg.c"]) == {"pkg.c", "pkg.a", "pkg.sub.b"}
