"""The emulation's CPU kernels (the casts, the reading back of FP8 operands, the GEMMs around
torch.mm): fp8ops._cpu (csrc/*_cpu.cpp), built with the package by a plain C++ compiler. Each
replaces a pure-PyTorch part of the emulation on CPU tensors with the same bytes
(tests/test_cpu_kernels.py, tests/test_cpu_gemm_kernels.py); where the extension is not built, or
FP8OPS_DISABLE_CPU_KERNELS=1, the emulation runs its own tensor code."""
from __future__ import annotations

import os

_state = {"loaded": None, "why_not": ""}


def loaded() -> bool:
    """Whether fp8ops._cpu is loaded (imported on first use)."""
    if _state["loaded"] is None:
        if os.environ.get("FP8OPS_DISABLE_CPU_KERNELS", "0") not in ("", "0", "false", "False"):
            _state.update(loaded=False, why_not="FP8OPS_DISABLE_CPU_KERNELS=1")
        else:
            try:
                from .. import _cpu  # noqa: F401  (registers torch.ops.fp8ops_cpu)
                _state["loaded"] = True
            except ImportError as e:
                _state.update(loaded=False, why_not=f"fp8ops._cpu is not built ({e})")
    return _state["loaded"]


def why_not() -> str:
    """Why the CPU kernels are not used ('' when they are)."""
    return "" if loaded() else _state["why_not"]
