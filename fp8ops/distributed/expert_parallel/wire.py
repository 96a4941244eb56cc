"""The FP8 casts that travel in an expert-parallel step, made on the rank that routes the tokens:
the tokens' forward cast (the bytes and scales the experts' first grouped GEMM reads) and the
combine's gradient cast (the bytes the last grouped layer's dgrad would cast).

  BlockwiseScaling  1x128 blocks along the features: each row's bytes and scales depend on that
                    row alone, so they are the one-process grouped cast's; the float32 scales
                    travel beside the bytes, in the same all-to-all.
  CurrentScaling    a scale per expert from the amax of its rows on every rank: the local
                    amaxes [E] are folded by one MAX all-reduce over the expert-parallel group,
                    so each expert's rows are cast with the scale a single process would take
                    for them all. Only the bytes travel: every rank has all scales.
On the wire the bytes are uint8 (gloo takes no float8 types)."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from ...nn.grouped_quantizers import RowsCast
from ...nn.quantizers import quantizer_for
from ...scaling import current_scale, grad_margin
from ..wire import blocks
from .routing import Routing, all_to_all_rows, counts_of

_ops = torch.ops.fp8ops
_F32 = torch.float32
BLOCK = 128


class WireCast(NamedTuple):
    """A cast of rows sorted by (global) expert: data [M, K] FP8 and scale_inv, [M, Kb] (block
    scales, travelling with the rows) or [E] (a scale per expert, known to every rank)."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    blockwise: bool


def takes(recipe) -> bool:
    """Whether the FP8 dispatch takes this recipe (CurrentScaling without a percentile amax,
    BlockwiseScaling)."""
    quantizer = quantizer_for(recipe)
    return quantizer.grouped and not quantizer.delayed


def cast(rows: torch.Tensor, offsets: torch.Tensor, recipe, fmt, margin: float,
         group: dist.ProcessGroup) -> WireCast:
    """rows [M, K] (sorted by expert, `offsets` over all E experts) cast in `fmt` as the grouped
    layer casts them: 1x128 blocks (blockwise) or a scale per expert over all ranks' rows."""
    dtype = fmt.dtype
    if quantizer_for(recipe).scale_block is not None:  # BlockwiseScaling
        data, scale_inv = _ops.quantize_blockwise(rows, dtype, 1, BLOCK, recipe.power_of_two)
        return WireCast(data, scale_inv.contiguous(), True)
    ones = torch.ones(offsets.shape[0], dtype=_F32, device=rows.device)
    # each expert's amax over this rank's rows (a cast's: its bytes unused), then over all ranks
    amax = _ops.quantize_scaled_grouped(rows, offsets, ones, dtype, False)[2]
    dist.all_reduce(amax, dist.ReduceOp.MAX, group=group)
    scale = current_scale(amax, fmt, margin, recipe.power_of_two)
    data = _ops.quantize_scaled_grouped(rows, offsets, scale, dtype, False)[0]
    return WireCast(data, torch.reciprocal(scale), False)


def send(wire: WireCast, routing: Routing) -> WireCast:
    """The cast's rows to the ranks holding their experts (one all_to_all_single), sorted there
    by local expert; a per-expert scale_inv narrowed to the local experts."""
    K = wire.data.shape[1]
    # the scales' bytes beside the rows' (blockwise), else the bytes alone
    packed = (blocks.pack(wire.data, wire.scale_inv) if wire.blockwise
              else wire.data.view(torch.uint8))
    got = all_to_all_rows(packed, routing.recv_splits, routing.send_splits, routing.group)
    data, scale_inv = blocks.unpack(got[routing.order], K, wire.data.dtype)
    if not wire.blockwise:
        local = routing.local_offsets.shape[0]
        scale_inv = wire.scale_inv[routing.first_expert:routing.first_expert + local]
    return WireCast(data.contiguous(), scale_inv, wire.blockwise)


def values(wire: WireCast, offsets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values the cast stands for, in `dtype` (its rows sorted by expert with `offsets`)."""
    if wire.blockwise:
        return _ops.dequantize_blockwise(wire.data, wire.scale_inv, 1, BLOCK, dtype)
    # a scale per expert: each row one block of its expert's scale (one pass, no float32 copy)
    rows, features = wire.data.shape
    row_scale_inv = torch.repeat_interleave(wire.scale_inv, counts_of(offsets), output_size=rows)
    block = max(features, 1)  # (a row of no features has no block)
    return _ops.dequantize_blockwise(wire.data, row_scale_inv.view(rows, 1)[:, :features], 1,
                                     block, dtype)


def rows_cast(wire: WireCast) -> RowsCast:
    return RowsCast(wire.data, wire.scale_inv)


def grad_cast(grad: torch.Tensor, offsets: torch.Tensor, recipe,
              group: dist.ProcessGroup) -> WireCast:
    """The combine's gradient in the recipe's backward format and gradient margin, as the last
    grouped layer's dgrad casts its dY."""
    quantizer = quantizer_for(recipe)
    margin = grad_margin(recipe) if hasattr(recipe, "margin") else 1.0  # (blockwise: none)
    return cast(grad, offsets, recipe, quantizer.bwd, margin, group)


def forward_cast(rows: torch.Tensor, offsets: torch.Tensor, recipe,
                 group: Optional[dist.ProcessGroup]) -> WireCast:
    """The tokens' forward cast (the first grouped GEMM's operand)."""
    quantizer = quantizer_for(recipe)
    return cast(rows, offsets, recipe, quantizer.fwd, getattr(recipe, "margin", 1.0), group)
