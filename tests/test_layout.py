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
