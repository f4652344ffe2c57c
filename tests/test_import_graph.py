"""No import cycles among kvcal's modules, read statically from the source (no module is imported).

The graph has one node per module of kvcal/ (a package's `__init__.py` is the package) and an edge A -> B for every
import in A of a kvcal module B, wherever it stands: at module level, inside a function (a lazy import is still a
dependency), or under `if TYPE_CHECKING:`. An edge goes where Python resolves the import:

* `import kvcal.x.y` and `from kvcal.x import y` where `kvcal/x/y.py` (or `kvcal/x/y/`) exists: to `kvcal.x.y`;
* `from kvcal.x import name` where `name` is not a submodule: to `kvcal.x` (its `__init__.py` defines or re-exports
  `name`);
* a package `__init__.py` that loads its names on first use (`importlib.import_module`, kvcal.runtime's `_WHERE`):
  to every kvcal module named by a string in it.

Parent packages are not edges: Python runs `kvcal/__init__.py` and `kvcal/runtime/__init__.py` before any module
under them, whoever imports it, so that is no choice a module made.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "kvcal"


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the modules of the same top-level package that it imports (see the module docstring)."""
    files = _modules(root)
    top = root.name
    graph: dict[str, set[str]] = {}
    for mod, f in files.items():
        is_package = f.name == "__init__.py"
        package = mod if is_package else mod.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in files)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source != top and not source.startswith(top + "."):
                    continue
                for a in node.names:
                    sub = f"{source}.{a.name}"
                    if sub in files:
                        edges.add(sub)
                    elif source in files:
                        edges.add(source)
            elif (is_package and isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and node.value in files):
                edges.add(node.value)
        edges.discard(mod)
        graph[mod] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected component of more than one module, as one cycle through it (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
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
                        found.append(_one_cycle(graph, set(component)))
    return found


def _one_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth first), for the failure message."""
    start = min(component)
    parent: dict[str, str] = {}
    queue = [start]
    for v in queue:
        for w in sorted(graph[v] & component):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if w not in parent:
                parent[w] = v
                queue.append(w)
    return sorted(component)


def test_kvcal_has_no_import_cycles():
    graph = import_graph()
    assert {"kvcal", "kvcal.runtime", "kvcal.runtime.bundle", "kvcal.cli._options"} <= set(graph)
    assert "kvcal.runtime.bundle" in graph["kvcal"]           # the graph is read: kvcal re-exports the bundle API
    found = cycles(graph)
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def test_the_graph_finds_cycles_through_lazy_and_relative_imports(tmp_path):
    """The checker itself: a cycle closed by a function-level import, one through a package's relative import and one
    through a lazily re-exported name are found; a module importing its parent package's names is not a cycle."""
    pkg = tmp_path / "kvcal"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "lazy").mkdir()
    files = {
        "__init__.py": "from kvcal.a import A\n",
        "a.py": "from kvcal.b import B\nA = 1\n",
        "b.py": "B = 1\ndef f():\n    from kvcal.a import A\n",
        "c.py": "from kvcal import A\n",                                   # kvcal -> a, not back: no cycle
        "sub/__init__.py": "from .x import X\n",
        "sub/x.py": "X = 1\ndef g():\n    from . import X as Y\n",
        "lazy/__init__.py": "_WHERE = {'L': 'kvcal.lazy.impl'}\n",
        "lazy/impl.py": "def h():\n    from kvcal.lazy import L\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph(pkg)
    assert graph["kvcal.c"] == {"kvcal"} and graph["kvcal.a"] == {"kvcal.b"}
    assert sorted(sorted(set(c)) for c in cycles(graph)) == [["kvcal.a", "kvcal.b"], ["kvcal.lazy", "kvcal.lazy.impl"],
                                                             ["kvcal.sub", "kvcal.sub.x"]]
    assert all(c[0] == c[-1] for c in cycles(graph))
