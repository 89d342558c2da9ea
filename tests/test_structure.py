"""The package's shape: no circle of imports among torchcast's modules,
counting the imports made inside functions and under TYPE_CHECKING (a
deferred import hides a circle, it does not remove it), and no module over
600 lines."""
import ast
import os

import torchcast

PACKAGE = os.path.dirname(os.path.abspath(torchcast.__file__))
MAX_LINES = 600


def _modules():
    """{dotted name: path} of every module of the package (a compiled
    extension, torchcast._C, as None: it imports nothing of the package)."""
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith((".so", ".pyd")):
                rel = os.path.relpath(os.path.join(folder, name.split(".")[0]),
                                      os.path.dirname(PACKAGE))
                found[rel.replace(os.sep, ".")] = None
            elif name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
                found[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return found


def _defined(path):
    """The names a module binds at its top level (all of them, for a module
    outside the package: path None)."""
    if path is None:
        return _Everything()
    names = set()
    for node in ast.parse(open(path, encoding="utf-8").read(), path).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


class _Everything:
    def __contains__(self, name):
        return True


def _imports(name, path, modules):
    """The package's modules that module ``name`` imports, anywhere in it."""
    is_package = path.endswith("__init__.py")
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                # A name that is a module of the package is an import of
                # that module; any other name is the source module's (but
                # a package's name it does not define is a module that is
                # not there: torchcast._C in a build without the extension).
                sub = f"{source}.{alias.name}"
                if sub in modules:
                    targets.add(sub)
                elif alias.name in _defined(modules.get(source)):
                    targets.add(source)
    found = set()
    for target in targets:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


def _graph():
    modules = _modules()
    return {name: _imports(name, path, modules) if path else set()
            for name, path in modules.items()}


def _circles(graph):
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_walk_sees_deferred_imports():
    # report.py's package-level circle test would pass vacuously if the walk
    # missed imports inside functions: this one is inside a function.
    graph = _graph()
    assert "torchcast._ops" in graph["torchcast.tracker.nonfinite"]
    assert all(target in graph for targets in graph.values() for target in targets)


def test_no_circle_of_imports():
    assert _circles(_graph()) == []


def test_no_module_over_600_lines():
    long = {name: n for name, path in _modules().items()
            if path and (n := sum(1 for _ in open(path, encoding="utf-8"))) > MAX_LINES}
    assert long == {}
