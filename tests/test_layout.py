"""Pickles name classes by module path: what fp8ops saved with one layout of its modules loads in
another. tests/data/old_layout.pt was written when every module sat directly under fp8ops/
(fp8ops.modules.FP8Linear, fp8ops.weight_cache.CachedCast, ...): a 2-layer model converted with
delayed scaling, a Crossover fallback and a monitor, after one forward and backward; one trained a
step by a CPUOffloadOptimizer; a recipe; a Float8Tensor; and the outputs they gave."""
import importlib
import os
import pickletools
import subprocess
import sys
import zipfile

import torch
from setuptools import find_packages

import fp8ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "data", "old_layout.pt")
# the old paths of the moved modules that pickles name -> where the modules are now
OLD_PATHS = {
    "fp8ops.cast_stats": "fp8ops.nn.cast_stats",
    "fp8ops.fallback": "fp8ops.nn.fallback",
    "fp8ops.host_weight": "fp8ops.optim.host_weight",
    "fp8ops.modules": "fp8ops.nn.modules",
    "fp8ops.weight_cache": "fp8ops.scaling.weight_cache",
    "fp8ops.nn.weight_cache": "fp8ops.scaling.weight_cache",
    "fp8ops.amax_reduction": "fp8ops.scaling.amax_reduction",
}


def _globals(path):
    """module.name of every global the pickle of a torch.save file refers to."""
    with zipfile.ZipFile(path) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    return {arg.replace(" ", ".") for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"}


def test_fixture_names_the_flat_module_paths():
    assert {"fp8ops.modules.FP8Linear", "fp8ops.scaling.ScalingState",
            "fp8ops.weight_cache.CachedCast", "fp8ops.fallback.Crossover",
            "fp8ops.cast_stats.Monitor", "fp8ops.host_weight._unowned",
            "fp8ops.tensors.Float8Tensor"} <= _globals(FIXTURE)


def test_pickle_of_the_flat_layout_loads_and_gives_the_same_outputs():
    saved = torch.load(FIXTURE, weights_only=False)
    assert isinstance(saved["model"][0], fp8ops.FP8Linear)
    assert saved["model"][0].fallback == fp8ops.Crossover(min_tokens=2)
    assert saved["recipe"] == fp8ops.MXFP8Scaling()
    with torch.no_grad():
        for name in ("model", "offloaded"):
            assert torch.equal(saved[name](saved["x"]), saved["expected"][name]), name
    assert torch.equal(saved["tensor"].dequantize(), saved["expected"]["tensor"])
    saved["model"](saved["x"]).sum().backward()  # and trains on
    assert saved["model"][0].weight.grad is not None


def test_pickle_loads_before_fp8ops_is_imported():
    code = (f"import torch; m = torch.load({FIXTURE!r}, weights_only=False)['model']; "
            f"print(type(m[0]).__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == fp8ops.FP8Linear.__module__


def test_old_module_paths_are_the_moved_modules():
    for old, new in OLD_PATHS.items():
        assert importlib.import_module(old) is importlib.import_module(new), old


def test_every_folder_of_the_package_is_installed():
    """setup.py installs find_packages(include=["fp8ops", "fp8ops.*"]): folders with __init__.py."""
    folders = {os.path.relpath(d, ROOT).replace(os.sep, ".")
               for d, _, files in os.walk(os.path.join(ROOT, "fp8ops")) if any(
                   f.endswith(".py") for f in files)}
    assert folders == set(find_packages(ROOT, include=["fp8ops", "fp8ops.*"]))


def _module_imports(path: str, name: str) -> set:
    """The fp8ops modules `name` (at `path`) imports when it is imported: its top-level import
    statements (not those inside functions, which run later), resolved to module names."""
    import ast
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.parse(open(path).read()).body:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[:len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m.split(".")[0] == "fp8ops"}


def test_no_import_circle_between_fp8ops_modules():
    """A module's top-level imports form no circle (a package's __init__ counts as the package,
    so `from . import x` inside it is not a circle)."""
    modules = {}
    for folder, _, files in os.walk(os.path.join(ROOT, "fp8ops")):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), ROOT)[:-3].replace(os.sep, ".")
                modules[rel.removesuffix(".__init__")] = os.path.join(folder, f)
    graph = {name: {m for m in _module_imports(path, name) if m in modules and m != name}
             for name, path in modules.items()}
    # an import of a.b.c runs a.b's __init__ first: a submodule does not import its own
    # package's __init__ back (Python has it half-made then), so edges into an ancestor package
    # are the package's own re-exports, not a circle
    graph = {n: {m for m in deps if not n.startswith(m + ".")} for n, deps in graph.items()}
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                raise AssertionError("import circle: " + " -> ".join(
                    stack[stack.index(dep):] + [dep]))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name)
