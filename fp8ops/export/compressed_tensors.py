"""The compressed-tensors layout (quant_method "compressed-tensors", format "float-quantized"):
`<layer>.weight` float8_e4m3fn and `<layer>.weight_scale` float32 (w = weight * weight_scale):
[1] per tensor (strategy "tensor"), [ceil(out / 128), ceil(in / 128)] for blockwise scaling
(strategy "block", block_structure [128, 128]), [out, in / 32] for MXFP8 (strategy "group",
group_size 32: MXFP8's power-of-two block scales as float32, the training bytes unchanged).
Static symmetric weights, input activations absent (each server casts them its own way)."""
from __future__ import annotations

from .weights import BLOCK, FP8Weight

_STRATEGY = {"tensor": {"strategy": "tensor"},
             "block": {"strategy": "block", "block_structure": [BLOCK, BLOCK]},
             "mx": {"strategy": "group", "group_size": 32}}


def tensors(fp8: dict) -> dict:
    out = {}
    for key, w in fp8.items():
        base = key[:-len(".weight")]
        scale = w.scale_inv.reshape(1) if w.layout == "tensor" else w.scale_inv
        out[key] = w.data.contiguous()
        out[f"{base}.weight_scale"] = scale.contiguous()
    return out


def quantization_config(layout: str, ignore: list) -> dict:
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
               "observer": None, **_STRATEGY[layout]}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": None, "output_activations": None,
                                      "format": "float-quantized"}},
        "ignore": ignore,
        "kv_cache_scheme": None,
    }

