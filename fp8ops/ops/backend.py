"""Which implementation runs on which device, and why (docs/design.md, "Backends")."""
from __future__ import annotations

import os
from typing import Optional

import torch

MIN_CC = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell (10.x+)
_state = {"loaded": False, "why_not": "not attempted"}


def force_emulation() -> bool:
    return os.environ.get("FP8OPS_FORCE_EMULATION", "0") not in ("", "0", "false", "False")


def load_extension() -> bool:
    """Import fp8ops._C (its TORCH_LIBRARY_IMPL registers the CUDA kernels) when it can serve
    every visible GPU. Reading the compute capability initializes CUDA, so this happens only
    when a GPU is present and emulation is not forced."""
    if force_emulation():
        _state["why_not"] = "FP8OPS_FORCE_EMULATION=1"
        return False
    if not torch.cuda.is_available():
        _state["why_not"] = "no CUDA device"
        return False
    ccs = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
    if min(ccs) < MIN_CC:
        _state["why_not"] = f"a visible GPU has compute capability {min(ccs)} < 8.9 (no FP8)"
        return False
    missing = [f"{cc[0]}.{cc[1]}" for cc in set(ccs) if not kernels_built_for(cc)]
    if missing:
        _state["why_not"] = (f"fp8ops._C has no kernel image for compute capability "
                             f"{', '.join(missing)} "
                             f"(built for {_built_targets()}; rebuild with TORCH_CUDA_ARCH_LIST)")
        return False
    try:
        from .. import _C  # noqa: F401
    except ImportError as e:
        _state["why_not"] = f"the CUDA extension fp8ops._C is not built ({e})"
        return False
    _state["loaded"] = True
    return True


def _build_info():
    try:
        from .. import _build_info as info
    except ImportError:
        return None
    return info


def _built_targets() -> str:
    info = _build_info()
    if info is None:
        return "unknown targets"
    return "machine code " + ", ".join(info.SASS) + "; PTX " + (", ".join(info.PTX) or "none")


def kernels_built_for(cc) -> bool:
    """Whether the built cast kernels run on a GPU of compute capability cc: machine code for
    exactly that arch, or PTX for an arch at or below it (the driver compiles it). Without a
    record of the build (an extension built by an older setup.py), assume they do."""
    info = _build_info()
    if info is None:
        return True
    arch = cc[0] * 10 + cc[1]
    return f"{arch}" in info.SASS or any(int(p) <= arch for p in info.PTX)


def extension_loaded() -> bool:
    return _state["loaded"]


def _has_cutlass_gemm() -> bool:
    return extension_loaded() and bool(torch.ops.fp8ops_C.has_cutlass_sm90())


class Backend(str):
    """The backend's name (a str) with `.reason` saying why it was chosen."""

    reason: str

    def __new__(cls, name: str, reason: str):
        obj = super().__new__(cls, name)
        obj.reason = reason
        return obj


def backend(device: Optional[torch.device | str | int] = None) -> Backend:
    """'cutlass_sm90' | 'scaled_mm' | 'emulation' for GEMMs on `device` (default: the current
    CUDA device if there is one, else CPU); `.reason` says why."""
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if device.type != "cuda":
        return Backend("emulation", f"device {device} is not a CUDA GPU")
    if force_emulation():
        return Backend("emulation", "FP8OPS_FORCE_EMULATION=1")
    if not torch.cuda.is_available():
        return Backend("emulation", "CUDA is not available in this torch / on this machine")
    cc = torch.cuda.get_device_capability(device)
    if cc < MIN_CC:
        return Backend("emulation", f"compute capability {cc[0]}.{cc[1]} has no FP8 tensor cores")
    if not extension_loaded():
        return Backend("emulation", _state["why_not"])
    if cc == (9, 0) and _has_cutlass_gemm():
        return Backend("cutlass_sm90", "Hopper (sm_90) with the CUTLASS FP8 GEMM built (promoted "
                                       "GEMMs, dgrad and wgrad, via torch._scaled_mm)")
    return Backend("scaled_mm", f"compute capability {cc[0]}.{cc[1]}: GEMMs via torch._scaled_mm, "
                                "casts via fp8ops kernels")
