"""ampkit's layers point down: no import goes up a layer, and no import cycle exists.

Read with the standard library's ``ast`` only; imports inside functions count, and so do
``importlib.import_module("ampkit...")`` calls with a literal name. The layers, lowest first
(README, "How the code is laid out"):
"""
import ast
import importlib.util
from pathlib import Path

import pytest

PACKAGE = Path(importlib.util.find_spec("ampkit").origin).parent

LAYERS = (  # (name, module prefixes); a module belongs to the layer of its longest prefix
    ("common", ("ampkit._common", "ampkit._version")),  # files, logging, errors, CPU flags
    ("config", ("ampkit._config",)),  # the levels and options, as data
    ("kernels", ("ampkit._kernels",)),  # the numeric ops: references, C and compiled kernels
    ("run", ("ampkit._run", "ampkit._hardware")),  # the loss scaler, the run, the registry; the machine
    ("attach", ("ampkit._model", "ampkit._optim", "ampkit._update", "ampkit._parallel")),  # what initialize attaches
    ("initialize", ("ampkit._initialize",)),  # initialize as named steps
    ("loop", ("ampkit._loop", "ampkit._apex", "ampkit._precision")),  # the calls of a training loop; Apex's; the report
    ("cli", ("ampkit._cli",)),  # python -m ampkit
    ("public", ("ampkit",)),  # the package and its public modules: re-exports with __all__
    ("integrations", ("ampkit.integrations",)),  # one module per training framework
    ("apps", ("ampkit.apex_compat", "ampkit.__main__")),
)


def modules(root: Path, package: str = "ampkit") -> dict:
    """Every module of the package under ``root``: dotted name -> (path, is_package)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        is_pkg = parts[-1] == "__init__"
        name = ".".join((package,) + (parts[:-1] if is_pkg else parts))
        out[name] = (path, is_pkg)
    return out


def _target(name: str, known: dict):
    while name not in known and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in known else None


def imports(name: str, path: Path, is_pkg: bool, known: dict) -> set:
    """The package's modules that ``name`` imports anywhere in its source."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_pkg else name.split(".")[:-1]
                here = here[: len(here) - (node.level - 1)]
                base = ".".join(here + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            targets = [node.args[0].value]
        found.update(t for t in (_target(t, known) for t in targets) if t is not None and t != name)
    return found


def layer_of(name: str) -> int:
    best, layer = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, layer = len(prefix), i
    return layer


def graph(root: Path, package: str = "ampkit") -> dict:
    known = modules(root, package)
    return {name: imports(name, path, is_pkg, known) for name, (path, is_pkg) in known.items()}


def upward(edges: dict) -> list:
    """``(module, imported)`` pairs where the import goes up a layer."""
    return sorted((a, b) for a, deps in edges.items() for b in deps if layer_of(b) > layer_of(a))


def cycles(edges: dict) -> list:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_layer():
    assert [m for m in modules(PACKAGE) if layer_of(m) is None] == []


def test_no_import_goes_up_a_layer():
    bad = upward(graph(PACKAGE))
    names = [n for n, _ in LAYERS]
    assert bad == [], "\n".join(f"{a} ({names[layer_of(a)]}) imports {b} ({names[layer_of(b)]})" for a, b in bad)


def test_no_import_cycle():
    assert cycles(graph(PACKAGE)) == []


def is_private(name: str) -> bool:
    """A module inside an ``_``-prefixed package or module (``ampkit._update.masters``); dunders are public."""
    return any(p.startswith("_") and not p.startswith("__") for p in name.split(".")[1:])


def test_no_private_module_imports_a_public_one():
    edges = graph(PACKAGE)
    bad = sorted((a, b) for a, deps in edges.items() if is_private(a) for b in deps if not is_private(b))
    assert bad == [], "\n".join(f"{a} imports the public {b}" for a, b in bad)


def test_the_bottom_layer_imports_nothing_above_itself():
    edges = graph(PACKAGE)
    core = {m: deps for m, deps in edges.items() if layer_of(m) == 0}
    assert core and all(layer_of(d) == 0 for deps in core.values() for d in deps)


# --- the checker itself finds what it must ---------------------------------------------------

def _tree(tmp_path, files: dict) -> Path:
    root = tmp_path / "ampkit"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_checker_finds_an_upward_import_inside_a_function(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "", "_common/__init__.py": "", "_loop/__init__.py": "",
        "_common/run.py": "def current():\n    from .._loop import state\n    return state\n",
        "_loop/state.py": "from .._common import run\n",
    })
    edges = graph(root)
    assert edges["ampkit._common.run"] == {"ampkit._loop.state"}
    assert upward(edges) == [("ampkit._common.run", "ampkit._loop.state")]
    assert cycles(edges) == [["ampkit._common.run", "ampkit._loop.state"]]


def test_checker_finds_literal_import_module_calls_and_plain_imports(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "", "_common/__init__.py": "", "_cli/__init__.py": "",
        "_common/a.py": "import importlib\nM = importlib.import_module('ampkit._cli.demo')\n",
        "_common/b.py": "import ampkit._common.a\n",
        "_cli/demo.py": "",
    })
    edges = graph(root)
    assert edges["ampkit._common.a"] == {"ampkit._cli.demo"} and edges["ampkit._common.b"] == {"ampkit._common.a"}
    assert upward(edges) == [("ampkit._common.a", "ampkit._cli.demo")]


@pytest.mark.parametrize("name, private", [("ampkit._update", True), ("ampkit._kernels.native", True),
                                           ("ampkit.checkpoint", False), ("ampkit", False), ("ampkit.__main__", False),
                                           ("ampkit.parallel", False), ("ampkit.integrations.lightning", False)])
def test_is_private(name, private):
    assert is_private(name) is private


@pytest.mark.parametrize("name, layer", [("ampkit._run.run", "run"), ("ampkit._parallel.fsdp", "attach"),
                                         ("ampkit._kernels.native", "kernels"), ("ampkit._cli.demo", "cli"),
                                         ("ampkit.checkpoint", "public"), ("ampkit", "public"),
                                         ("ampkit.apex_compat.__main__", "apps")])
def test_layer_of(name, layer):
    assert LAYERS[layer_of(name)][0] == layer
