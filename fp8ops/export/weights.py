"""The FP8 weights an export writes: each converted weight's cast as the model's own eval forward
would make it now (WeightCache.peek: the cached cast, or the recipe's cast with the scale the
forward would take), read without changing the model. A weight is (data, scale_inv): data the
float8_e4m3fn bytes [out, in], scale_inv fp8ops' inverse scale (w = data * scale_inv): float32
[] per tensor or [ceil(out / 128), ceil(in / 128)] for 128x128 blocks, or MXFP8's E8M0 bytes
[out, in / 32] as the cast made them (uint8: 2^(byte - 127) for 1x32 blocks)."""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..nn.grouped_quantizers import grouped_quantizer_for
from ..nn.modules import FP8Conv1D, FP8Linear
from ..nn.quantizers import quantizer_for
from ..ops.emulation import e8m0_to_float

BLOCK = 128


class FP8Weight(NamedTuple):
    data: torch.Tensor  # float8_e4m3fn [out, in]
    scale_inv: torch.Tensor  # float32: [] per tensor; [rows, cols] per block; mx: uint8 E8M0
    layout: str  # "tensor", "block" (128x128) or "mx" (1x32 along in)


def _check_weight(weight: torch.Tensor, name: str, offloaded: bool) -> None:
    if offloaded:
        raise NotImplementedError(
            f"export_fp8: {name} is offloaded to the CPU (CPUOffloadOptimizer): its parameter is "
            "a placeholder; export the model before offloading, or from a copy loaded without it")
    if type(weight) is not torch.Tensor and not isinstance(weight, nn.Parameter):
        raise NotImplementedError(
            f"export_fp8: {name} is a {type(weight).__name__} (sharded, e.g. FSDP2 or tensor "
            "parallelism): export a model with plain local parameters (gather a full state dict "
            "into an unsharded copy first)")


def _from_payload(kind: str, payload, shape, name: str) -> FP8Weight:
    """The forward's weight bytes out of a quantizer's weight payload (quantizers.py)."""
    if kind in ("current", "delayed"):
        data, scale_inv = payload[0], payload[2]
        return FP8Weight(data, scale_inv.reshape(()).float(), "tensor")
    if kind == "blockwise":
        return FP8Weight(payload[0], payload[1].float(), "block")
    if kind == "mxfp8":
        (data, scales), _ = payload  # zero-padded to the block: cut back
        out, k = shape
        block = data.shape[1] // scales.shape[1]
        if k % block:
            raise ValueError(f"export_fp8: {name} has {k} input features, not a multiple of "
                             f"MXFP8's {block}-element block: no checkpoint layout holds its "
                             "partial last block")
        return FP8Weight(data[:out, :k], scales[:out, :k // block].view(torch.uint8), "mx")
    raise NotImplementedError(f"export_fp8: {name} has a recipe of kind {kind!r}")


def _check_format(recipe, name: str) -> None:
    if recipe.fwd_fmt != "e4m3":
        raise NotImplementedError(
            f"export_fp8: {name} casts its forward to {recipe.fwd_fmt}; serving checkpoints hold "
            "E4M3 weights (float8_e4m3fn): train with fwd_fmt='e4m3' (the default)")


def linear_weight(layer: FP8Linear, name: str) -> FP8Weight:
    """The FP8 weight of an FP8Linear, as its eval forward casts it."""
    if isinstance(layer, FP8Conv1D):
        raise NotImplementedError(
            f"export_fp8: {name} is a transformers Conv1D (GPT-2 style, [in, out] weights): "
            "serving checkpoints of those models are not written")
    state = layer.fp8_state
    weight = layer._out_in_weight()
    _check_weight(weight, name, state.weight_cache.host is not None)
    _check_format(layer.recipe, name)
    quantizer = quantizer_for(layer.recipe)
    with torch.no_grad():
        payload = state.weight_cache.peek(weight, quantizer.cast_weight(state))
    return _from_payload(quantizer.kind, payload, tuple(weight.shape), name)


def experts_weight(mod: nn.Module, param: str, name: str) -> list:
    """The FP8 weights of a converted transformers experts module's 3-D parameter `param`, one
    FP8Weight per expert, as its eval forward casts them (fp8ops.nn.hf_moe)."""
    if mod.is_transposed or getattr(mod, "has_bias", False):
        raise NotImplementedError(
            f"export_fp8: {name} stores its experts transposed or with biases "
            f"({type(mod).__name__}): its checkpoint layout is not written")
    cache = mod.fp8_weight_caches[param]
    weight = getattr(mod, param)
    _check_weight(weight, f"{name}.{param}", cache.host is not None)
    _check_format(mod.fp8_recipe, name)
    states = mod._modules.get("fp8_state")
    state = None if states is None else states[param]
    quantizer = grouped_quantizer_for(mod.fp8_recipe)
    with torch.no_grad():
        _, cast = cache.peek(weight, quantizer.cast_experts(state))
    if quantizer.kind == "blockwise":
        return [FP8Weight(cast[0][e], cast[1][e].float(), "block")
                for e in range(weight.shape[0])]
    return [FP8Weight(cast[0][e], cast[2][e].reshape(()).float(), "tensor")
            for e in range(weight.shape[0])]


def rows(w: FP8Weight, start: int, stop: int, name: str) -> FP8Weight:
    """Rows [start, stop) of w (gate and up of a fused projection). 128x128 blocks: each 128-row
    block of the part must lie in one block of w (its scale is that block's), else refused."""
    data = w.data[start:stop]
    if w.layout == "tensor":
        return FP8Weight(data, w.scale_inv, w.layout)
    if w.layout == "mx":
        return FP8Weight(data, w.scale_inv[start:stop], w.layout)
    picked = []
    for first in range(start, stop, BLOCK):
        last = min(first + BLOCK, stop) - 1
        if first // BLOCK != last // BLOCK:
            raise ValueError(
                f"export_fp8: {name} starts at row {start} of its fused projection, not on a "
                f"128-row block: its rows {first}..{last} were cast in two blocks with two "
                "scales, which a 128x128 block layout of the part cannot hold")
        picked.append(first // BLOCK)
    return FP8Weight(data, w.scale_inv[picked], w.layout)


def dequantize(w: FP8Weight) -> torch.Tensor:
    """float32 values of w (w = data * scale_inv, blocks expanded): what a loader reads back."""
    out, k = w.data.shape
    values = w.data.float()
    if w.layout == "tensor":
        return values * w.scale_inv
    if w.layout == "block":
        full = w.scale_inv.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
        return values * full[:out, :k]
    block = -(-k // w.scale_inv.shape[1])
    return values * e8m0_to_float(w.scale_inv).repeat_interleave(block, 1)[:, :k]
