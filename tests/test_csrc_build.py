"""The built extension registers a CUDA kernel for every cast op and for the grouped GEMM
kernels' ops (no GPU needed: importing fp8ops._C only registers kernels with the dispatcher)."""
import ast
import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAST_OPS = ["amax", "quantize", "dequantize", "quantize_mx", "dequantize_mx", "quantize_blockwise",
            "dequantize_blockwise", "delayed_scale_update", "quantize_current", "quantize_delayed",
            "quantize_blockwise_pair", "quantize_mx_pair", "cast_stats", "adamw_step",
            "adamw_step_multi"]


BUILT = pytest.mark.skipif(not glob.glob(os.path.join(ROOT, "fp8ops", "_C*.so")),
                           reason="fp8ops/_C*.so not built (pip install --no-build-isolation -e . "
                                  "with nvcc)")


def _missing_cuda_kernels(ops) -> list:
    """The ops of `ops` with no CUDA kernel once fp8ops/_C alone is loaded, in a fresh process:
    importing fp8ops first would register the emulation for CUDA on a machine without a GPU,
    and every op would look covered."""
    code = (
        "import glob, torch\n"
        "torch.ops.load_library(glob.glob('fp8ops/_C*.so')[0])\n"
        f"ops = {sorted(ops)!r}\n"
        "def has(op):\n"
        "    try:\n"
        "        return torch._C._dispatch_has_kernel_for_dispatch_key('fp8ops::' + op, 'CUDA')\n"
        "    except RuntimeError:\n"
        "        return False\n"
        "print([op for op in ops if not has(op)])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "FP8OPS_FORCE_EMULATION"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return ast.literal_eval(r.stdout.strip().splitlines()[-1])


@BUILT
def test_cast_ops_have_cuda_kernels():
    import re
    with open(os.path.join(ROOT, "fp8ops", "ops", "__init__.py")) as f:
        defined = set(re.findall(r'^    "([a-z_0-9]+)": "\(', f.read(), re.M))
    assert set(CAST_OPS) <= defined, set(CAST_OPS) - defined
    assert _missing_cuda_kernels(CAST_OPS) == []


@BUILT
def test_expert_and_grouped_cast_ops_have_cuda_kernels():
    from fp8ops.ops.expert_casts import SCHEMAS
    grouped = ["quantize_current_grouped", "quantize_scaled_grouped"]
    assert _missing_cuda_kernels(list(SCHEMAS) + grouped) == []


@BUILT
def test_grouped_gemm_kernel_ops_have_cuda_kernels():
    from fp8ops.ops.grouped import KERNEL_SCHEMAS
    # (an op the library does not have is reported: the check can fail)
    assert _missing_cuda_kernels(list(KERNEL_SCHEMAS) + ["no_such_op"]) == ["no_such_op"]
