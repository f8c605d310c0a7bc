"""The package's modules form layers: no import cycle, and every module imports on its own.

The graph has an edge A -> B for every ``import`` of a moeshard module B anywhere in A's source
(inside functions too: a lazy import is still a dependency, and hiding a cycle behind one is
what this test exists to catch). A package's ``__init__`` is a module like any other; importing
a submodule's parent package implicitly is not counted (Python runs ``__init__`` first, but the
submodule does not depend on what ``__init__`` re-exports). Then every module is imported, in
dependency order, each in a fresh interpreter's clean state.
"""

import ast
import graphlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import moeshard

ROOT = Path(moeshard.__file__).parent


def _modules() -> dict[str, Path]:
    found = {"moeshard": ROOT / "__init__.py"}
    for info in pkgutil.walk_packages([str(ROOT)], prefix="moeshard."):
        rel = info.name.split(".")[1:]
        path = ROOT.joinpath(*rel)
        found[info.name] = path / "__init__.py" if info.ispkg else path.with_suffix(".py")
    return found


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        deps |= {t for t in targets if t in known and t != name}
    return deps


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def test_the_import_graph_has_no_cycle():
    graph = _graph()
    assert "moeshard.numerics" in graph and "moeshard.quant.schemes" in graph
    try:
        order = list(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        raise AssertionError(f"import cycle: {' -> '.join(exc.args[1])}") from None
    assert set(order) == set(graph)


def test_low_modules_stay_low():
    """The numerical contracts and the configuration sit below everything that computes."""
    graph = _graph()
    for low in ("moeshard.numerics", "moeshard.config", "moeshard.quant.schemes", "moeshard.experts.base"):
        reach, todo = set(), [low]
        while todo:
            for dep in graph[todo.pop()]:
                if dep not in reach:
                    reach.add(dep)
                    todo.append(dep)
        high = {m for m in reach if m.startswith(("moeshard.kernels", "moeshard.reference", "moeshard.layer",
                                                   "moeshard.dispatch", "moeshard.harness", "moeshard.commands"))}
        assert not high, f"{low} depends on {sorted(high)}"


@pytest.mark.slow  # 12 s on 2 cores: `make test-slow`; the static layering checks above stay in `make test`
def test_every_module_imports_in_dependency_order():
    order = list(graphlib.TopologicalSorter(_graph()).static_order())
    script = ("import importlib, sys\n"
              f"for name in {order!r}:\n"
              "    for m in [m for m in sys.modules if m == 'moeshard' or m.startswith('moeshard.')]:\n"
              "        del sys.modules[m]\n"
              "    importlib.import_module(name)\n"
              f"print('imported', {len(order)})\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"imported {len(order)}" in done.stdout
