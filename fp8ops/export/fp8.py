"""transformers' FineGrainedFP8 layout (quant_method "fp8"; what vLLM's fp8 loader reads for
block-quantized checkpoints): `<layer>.weight` float8_e4m3fn and `<layer>.weight_scale_inv`
float32 [ceil(out / 128), ceil(in / 128)] (w = weight * weight_scale_inv per block),
weight_block_size [128, 128]. Per-tensor casts write their one scale in every block, so the bytes
stay those of the training cast. MXFP8 (1x32 power-of-two blocks) has no such layout: its
weights are dequantized and cast again in 128x128 blocks (a new cast, warned)."""
from __future__ import annotations

import warnings

import torch

from .weights import BLOCK, FP8Weight, dequantize

_ops = torch.ops.fp8ops

REQUANTIZED = ("export_fp8(format='fp8'): MXFP8 weights (1x32 power-of-two blocks) have no "
               "128x128-block layout; they are dequantized and cast again in 128x128 blocks, so "
               "the checkpoint's bytes are not the training casts. format='compressed-tensors' "
               "keeps them (strategy 'group', group_size 32)")


def _grid(shape) -> tuple:
    return -(-shape[0] // BLOCK), -(-shape[1] // BLOCK)


def check(w: FP8Weight, key: str) -> None:
    """transformers derives the block from the grid (dim // grid): a dimension with more than one
    block must be a multiple of 128 for the blocks to come back where they were cast. Per-tensor
    casts have one scale everywhere: the grid need only divide the dimension."""
    for dim, n in zip(w.data.shape, _grid(w.data.shape)):
        exact = n == 1 or dim % BLOCK == 0
        if not exact and not (w.layout == "tensor" and dim % n == 0):
            raise ValueError(
                f"export_fp8(format='fp8'): {key} has shape {tuple(w.data.shape)}: a dimension "
                f"of {dim} spans {n} partial 128-blocks, which transformers' loader would read "
                "as blocks of another size. Use format='compressed-tensors', or dimensions that "
                "are multiples of 128")


def tensors(fp8: dict, dtype) -> dict:
    """The checkpoint's tensors of the FP8 weights `fp8` (the model's dtype: one layout for
    every dtype here)."""
    out = {}
    if any(w.layout == "mx" for w in fp8.values()):
        warnings.warn(REQUANTIZED, stacklevel=3)
    for key, w in fp8.items():
        base = key[:-len(".weight")]
        if w.layout == "mx":
            data, scale_inv = _ops.quantize_blockwise(dequantize(w), torch.float8_e4m3fn,
                                                      BLOCK, BLOCK, False)
            w = FP8Weight(data, scale_inv.float(), "block")
        check(w, key)  # (a per-tensor cast by its own rule, before its scale fills the grid)
        if w.layout == "tensor":
            w = FP8Weight(w.data, w.scale_inv.expand(_grid(w.data.shape)), "block")
        out[key] = w.data
        out[f"{base}.weight_scale_inv"] = w.scale_inv
    return out


def quantization_config(layout: str, ignore: list, dtype) -> dict:
    return {"quant_method": "fp8", "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": ignore or None}
