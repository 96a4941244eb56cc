"""The built extension registers a CUDA kernel for every cast op (no GPU needed: importing
fp8ops._C only registers kernels with the dispatcher)."""
import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAST_OPS = ["amax", "quantize", "dequantize", "quantize_mx", "dequantize_mx", "quantize_blockwise",
            "dequantize_blockwise", "delayed_scale_update"]


@pytest.mark.skipif(not glob.glob(os.path.join(ROOT, "fp8ops", "_C*.so")),
                    reason="fp8ops/_C*.so not built (pip install --no-build-isolation -e . with nvcc)")
def test_cast_ops_have_cuda_kernels():
    code = (
        "import torch, fp8ops.ops, fp8ops._C\n"
        "from fp8ops.ops import SCHEMAS\n"
        f"cast = {CAST_OPS!r}\n"
        "assert set(cast) <= set(SCHEMAS), set(cast) - set(SCHEMAS)\n"
        "missing = [op for op in cast\n"
        "           if not torch._C._dispatch_has_kernel_for_dispatch_key('fp8ops::' + op, 'CUDA')]\n"
        "print('missing', missing)\n"
        "assert not missing, missing\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "FP8OPS_FORCE_EMULATION"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
