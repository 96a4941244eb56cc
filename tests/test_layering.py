"""fp8ops's modules form layers that import one way only, and no import circle.

Every import statement of every module under fp8ops/ counts, also those inside functions (they
run later, but they are dependencies all the same: a lower layer reaching up through a deferred
import is how circles come back). Relative imports are resolved; `from package import name`
imports package and, when `name` is a module of it, that module too.

The layers, lowest first. A module may import its own layer's modules and those of lower layers;
two layers of one rank (optim, distributed) import neither each other.

  0 base         formats.py, _checks.py, _build_info.py and the compiled extensions (_C, _cpu,
                 _step): no fp8ops import of their own
  1 ops          ops/: the operators and their implementations
  2 scaling      scaling/: recipes, scaling states, the weight cache, the amax all-reduces and
                 the recipe agreement between ranks (torch.distributed only, no DTensor)
  3 nn           nn/: the quantizers, fp8ops.linear, the layers; and tensors.py (quantize, gemm,
                 Float8Tensor: a user API over ops and scaling's scale rule, beside
                 fp8ops.linear, so that nothing below the layers depends on it)
  4 optim        optim/: CPU offload and FP8AdamW, over the layers
  4 distributed  distributed/: FSDP2's FP8 all-gather and tensor parallelism, over the layers
                 (which learn of them only through the hooks fp8ops installs)
  5 tools        monitoring.py and memory.py (over the layers and the optimizers), and
                 fp8ops/__init__.py, the public API, which wires the hooks of distributed/ into nn/
"""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "fp8ops")

# module (or package, for all its modules) -> (layer, rank); the longest prefix decides
LAYERS = {
    "fp8ops.formats": ("base", 0),
    "fp8ops._checks": ("base", 0),
    "fp8ops._build_info": ("base", 0),
    "fp8ops._C": ("base", 0),
    "fp8ops._cpu": ("base", 0),
    "fp8ops._step": ("base", 0),
    "fp8ops.ops": ("ops", 1),
    "fp8ops.scaling": ("scaling", 2),
    "fp8ops.nn": ("nn", 3),
    "fp8ops.tensors": ("nn", 3),
    "fp8ops.optim": ("optim", 4),
    "fp8ops.distributed": ("distributed", 4),
    "fp8ops.integrations": ("tools", 5),
    "fp8ops.monitoring": ("tools", 5),
    "fp8ops.memory": ("tools", 5),
    "fp8ops.export": ("tools", 5),
    "fp8ops": ("tools", 5),
}


# the modules setup.py makes, whether built here or not: the compiled extensions and the record
# of what they were built for
GENERATED = ("fp8ops._C", "fp8ops._cpu", "fp8ops._step", "fp8ops._build_info")


def package_modules(package_dir: str = PACKAGE) -> dict:
    """Module name -> path of every Python module under package_dir (a package as its
    __init__.py), plus those the build makes (path None where not built)."""
    modules = dict.fromkeys(GENERATED)
    top = os.path.basename(package_dir)
    for folder, _, files in os.walk(package_dir):
        rel = os.path.relpath(folder, package_dir)
        prefix = ".".join([top] + ([] if rel == "." else rel.split(os.sep)))
        for f in files:
            if f.endswith(".py"):
                name = prefix if f == "__init__.py" else f"{prefix}.{f[:-3]}"
                modules[name] = os.path.join(folder, f)
    return modules


def _imports(name: str, path: str, modules: dict) -> set:
    """(module imported, line) of every import in the module `name` at `path`, anywhere in it,
    resolved against the package's modules; imports of other packages are left out."""
    is_package = path.endswith("__init__.py")
    package = name if is_package else name.rpartition(".")[0]
    tree = ast.parse(open(path).read(), path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                if node.level > len(parts):
                    raise AssertionError(f"{path}:{node.lineno}: relative import beyond the top")
                parent = ".".join(parts[:len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            submodules = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
            found.update((m, node.lineno) for m in submodules)
            if len(submodules) < len(node.names):  # names of base itself
                found.add((base, node.lineno))
            elif not (name == base or name.startswith(base + ".")):
                found.add((base, node.lineno))  # (an ancestor package is running already)
        elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
              and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str) and not node.args[0].value.startswith(".")):
            found.add((node.args[0].value, node.lineno))
    return {(m, line) for m, line in found if m.split(".")[0] == "fp8ops" and m != name}


def import_graph(package_dir: str = PACKAGE) -> dict:
    """Module -> {module it imports: the first line that does}, within the package."""
    modules = package_modules(package_dir)
    graph = {}
    for name, path in sorted(modules.items()):
        edges = {}
        if path is not None:
            found = sorted(_imports(name, path, modules), key=lambda e: (e[1], e[0]))
            for target, line in found:
                if target not in modules:
                    raise AssertionError(f"{path}:{line}: imports {target}, which is not a module "
                                         f"of the package")
                edges.setdefault(target, line)
        graph[name] = edges
    return graph


def layer_of(module: str) -> tuple:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in LAYERS:
            return LAYERS[prefix]
    raise AssertionError(f"{module} is in no layer: place it in tests/test_layering.py's LAYERS")


def upward_imports(graph: dict) -> list:
    """'a (layer) imports b (layer) at line n' for every import that is not downward or within
    one layer."""
    wrong = []
    for name, edges in graph.items():
        layer, rank = layer_of(name)
        for target, line in edges.items():
            other, other_rank = layer_of(target)
            if other != layer and other_rank >= rank:
                wrong.append(f"{name} ({layer}) imports {target} ({other}) at line {line}")
    return wrong


def circles(graph: dict) -> list:
    """Every group of modules that import each other, directly or not (a strongly connected
    component of more than one module): its modules and the shortest circle through the first."""
    index, low, on_stack, stack, groups = {}, {}, set(), [], []

    def connect(node):  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in sorted(graph[node]):
            if dep not in index:
                connect(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.remove(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [f"{len(g)} modules ({', '.join(g)}): {_one_circle(graph, set(g))}" for g in groups]


def _one_circle(graph: dict, group: set) -> str:
    """A path from the group's first module back to itself, within the group."""
    start = min(group)
    paths = {start: [start]}
    todo = [start]
    while todo:  # breadth first: the shortest circle through start
        node = todo.pop(0)
        for dep in sorted(graph[node]):
            if dep == start:
                return " -> ".join(paths[node] + [start])
            if dep in group and dep not in paths:
                paths[dep] = paths[node] + [dep]
                todo.append(dep)
    raise AssertionError("unreachable: a strongly connected group has a circle")


def test_every_module_has_a_layer():
    for name in package_modules():
        layer_of(name)


def test_no_import_reaches_a_higher_layer():
    wrong = upward_imports(import_graph())
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_no_import_circle():
    found = circles(import_graph())
    assert not found, "import circles:\n" + "\n".join(found)


def _write(root, files: dict) -> str:
    for rel, text in files.items():
        path = os.path.join(root, "fp8ops", rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    return os.path.join(root, "fp8ops")


def test_the_checks_see_deferred_relative_imports(tmp_path):
    """The checks themselves on a small package: an import inside a function, relative, from a
    lower layer to a higher one, closing a circle, is found; a package's import of its own
    module and a module's import of its own package's name are resolved as Python does."""
    package = _write(tmp_path, {
        "__init__.py": "from . import nn\n",
        "nn/__init__.py": "from .layer import Layer\n",
        "nn/layer.py": "def f():\n    from ..distributed import hook\n",
        "distributed/__init__.py": "from ..nn import layer\n\ndef hook():\n    pass\n",
        "scaling/__init__.py": "import fp8ops.ops.x\nfrom .. import formats\n",
        "ops/__init__.py": "",
        "ops/x.py": "",
        "formats.py": "",
    })
    graph = import_graph(package)
    assert graph["fp8ops.nn.layer"] == {"fp8ops.distributed": 2}
    assert graph["fp8ops.distributed"] == {"fp8ops.nn": 1, "fp8ops.nn.layer": 1}
    assert graph["fp8ops.scaling"] == {"fp8ops.ops.x": 1, "fp8ops.formats": 2}
    assert graph["fp8ops.nn"] == {"fp8ops.nn.layer": 1}
    assert upward_imports(graph) == [
        "fp8ops.nn.layer (nn) imports fp8ops.distributed (distributed) at line 2"]
    assert circles(graph) == [
        "3 modules (fp8ops.distributed, fp8ops.nn, fp8ops.nn.layer): "
        "fp8ops.distributed -> fp8ops.nn.layer -> fp8ops.distributed"]


def test_peer_layers_do_not_import_each_other(tmp_path):
    package = _write(tmp_path, {"__init__.py": "", "optim/__init__.py": "",
                                "optim/a.py": "from ..distributed import b\n",
                                "distributed/__init__.py": "", "distributed/b.py": ""})
    assert upward_imports(import_graph(package)) == [
        "fp8ops.optim.a (optim) imports fp8ops.distributed (distributed) at line 1",
        "fp8ops.optim.a (optim) imports fp8ops.distributed.b (distributed) at line 1"]


@pytest.mark.parametrize("source", ["import fp8ops\n", "from fp8ops import linear\n",
                                    "from .. import linear\n"])
def test_an_import_of_the_top_package_from_below_is_upward(tmp_path, source):
    package = _write(tmp_path, {"__init__.py": "", "ops/__init__.py": "", "ops/a.py": source})
    assert upward_imports(import_graph(package)) == [
        "fp8ops.ops.a (ops) imports fp8ops (tools) at line 1"]
