"""The compressed-tensors layouts (quant_method "compressed-tensors"): `<layer>.weight`
float8_e4m3fn and `<layer>.weight_scale` (w = weight * weight_scale). Format "float-quantized"
with float32 scales: [1] per tensor (strategy "tensor"), [ceil(out / 128), ceil(in / 128)] for
blockwise scaling (strategy "block", block_structure [128, 128]). MXFP8 (strategy "group",
group_size 32, scales [out, in / 32]) in a bfloat16 model: compressed-tensors' own MX format,
"mxfp8-quantized", the scales as uint8 E8M0 exponents (scale_dtype uint8); in a model of another
dtype: "float-quantized", the scales as float32, since compressed-tensors decompresses MX
weights to bfloat16 only. Either way the training bytes and scales, unchanged. Static symmetric
weights, input activations absent (each server casts them its own way)."""
from __future__ import annotations

import torch

from ..ops.emulation import e8m0_to_float
from .weights import BLOCK

_STRATEGY = {"tensor": {"strategy": "tensor"},
             "block": {"strategy": "block", "block_structure": [BLOCK, BLOCK]},
             "mx": {"strategy": "group", "group_size": 32}}
_MX = {"scale_dtype": "torch.uint8"}  # (compressed-tensors' mark of E8M0 scales)


def _native_mx(layout: str, dtype) -> bool:
    """MXFP8 written in compressed-tensors' MX format (module doc)."""
    return layout == "mx" and dtype == torch.bfloat16


def tensors(fp8: dict, dtype) -> dict:
    """The checkpoint's tensors of the FP8 weights `fp8` in a model of `dtype`."""
    out = {}
    for key, w in fp8.items():
        base = key[:-len(".weight")]
        scale = w.scale_inv.reshape(1) if w.layout == "tensor" else w.scale_inv
        if w.layout == "mx" and not _native_mx(w.layout, dtype):
            scale = e8m0_to_float(scale)  # (the E8M0 bytes' float32 values)
        out[key] = w.data
        out[f"{base}.weight_scale"] = scale
    return out


def quantization_config(layout: str, ignore: list, dtype) -> dict:
    native = _native_mx(layout, dtype)
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
               "observer": None, **_STRATEGY[layout], **(_MX if native else {})}
    form = "mxfp8-quantized" if native else "float-quantized"
    return {
        "quant_method": "compressed-tensors",
        "format": form,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": None, "output_activations": None,
                                      "format": form}},
        "ignore": ignore,
        "kv_cache_scheme": None,
    }

