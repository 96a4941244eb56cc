"""fp8ops.backend(): which implementation runs where, and why (docs/design.md, "Backends")."""
import os
import subprocess
import sys

import pytest
import torch

import fp8ops
from conftest import has_fp8_gpu


def test_cpu_is_emulation_with_a_reason():
    b = fp8ops.backend("cpu")
    assert b == "emulation" and isinstance(b, str) and "not a CUDA GPU" in b.reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer on a machine without CUDA")
def test_cuda_without_gpu_is_emulation():
    b = fp8ops.backend("cuda")
    assert b == "emulation" and "not available" in b.reason
    assert fp8ops.backend() == "emulation"


def test_force_emulation_env():
    code = ("import fp8ops, torch; b = fp8ops.backend(torch.device('cuda', 0)); "
            "print(b, '|', b.reason, '|', fp8ops.ops.backend.extension_loaded())")
    env = dict(os.environ, FP8OPS_FORCE_EMULATION="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "emulation | FP8OPS_FORCE_EMULATION=1 | False"


@pytest.mark.gpu
@pytest.mark.skipif(not has_fp8_gpu(), reason="needs a CUDA GPU with FP8 (sm_89+)")
def test_gpu_backend_names_the_kernels():
    b = fp8ops.backend()
    cc = torch.cuda.get_device_capability()
    if not fp8ops.ops.backend.extension_loaded():
        assert b == "emulation" and "not built" in b.reason
    elif cc == (9, 0):
        assert b == "cutlass_sm90", b.reason
    else:
        assert b == "scaled_mm", b.reason


class _FakeBuild:
    SASS = ["89", "90"]
    PTX = ["90"]
    CUTLASS_SM90 = True


@pytest.mark.parametrize("cc, served", [((8, 9), True), ((9, 0), True), ((10, 0), True),
                                        ((12, 0), True), ((8, 6), False), ((8, 0), False)])
def test_kernels_built_for_reads_the_build_record(monkeypatch, cc, served):
    monkeypatch.setattr(fp8ops.ops.backend, "_build_info", lambda: _FakeBuild)
    assert fp8ops.ops.backend.kernels_built_for(cc) is served


def test_no_ptx_means_no_newer_gpu(monkeypatch):
    class NoPtx(_FakeBuild):
        PTX = []
    monkeypatch.setattr(fp8ops.ops.backend, "_build_info", lambda: NoPtx)
    assert not fp8ops.ops.backend.kernels_built_for((10, 0))
    assert "PTX none" in fp8ops.ops.backend._built_targets()


@pytest.mark.skipif(torch.version.cuda is None, reason="a torch built without CUDA")
def test_mx_gemm_finds_the_bf16_mm_of_this_torch():
    """On an FP8 GPU without an MX GEMM kernel of ours, gemm_mx multiplies on the bf16 tensor
    cores through aten::mm's out_dtype overload. The check for it asks the dispatcher, so it is
    answered here without a GPU: a wrong name would send every call to the float32 GEMM."""
    from fp8ops.ops import gemm_mx_cuda
    assert gemm_mx_cuda.BF16_MM
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::mm.dtype", "CPU")
