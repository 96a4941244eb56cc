"""The fused casts of the training step as the unfused ops they stand for: what they compute,
exactly. They serve the CPU, and CUDA where the extension has no kernel of its own for them; a CUDA
kernel of theirs is tested byte for byte against these. (On the CPU the blockwise pair is one call
of fp8ops._cpu, which reads x once for both copies: the same bytes as the two casts.)

A training step casts X and dY once each. Unfused, a per-tensor cast is a dozen small calls (amax,
the scale formula, the cast, the delayed-scaling update and amax record), and a block cast two
(the row-wise copy and the column-wise one for the backward GEMMs) plus the bias gradient's column
sums; fused, each is one dispatcher call, so the host pays for one.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import emulation
from .emulation import quantize_blockwise_pair_kernel, scale_from_amax
from ..formats import get_format

_ops = torch.ops.fp8ops
_F32 = torch.float32


def column_sums(x: torch.Tensor, sum_dtype: Optional[torch.dtype]) -> torch.Tensor:
    """Sums over the rows of x's 2-D view [rows, last dim] in float32, rounded to sum_dtype (a
    bias gradient); an empty float32 tensor when sum_dtype is None."""
    if sum_dtype is None:
        return x.new_empty((0,), dtype=_F32)
    if x.dim() == 0:
        raise ValueError("fp8ops: column sums need a tensor with at least one dimension")
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return x.reshape(rows, x.shape[-1]).sum(0, dtype=_F32).to(sum_dtype)


def quantize_current(x: torch.Tensor, dtype: torch.dtype, margin: float, power_of_two: bool,
                     transpose: bool = False, sum_dtype: Optional[torch.dtype] = None,
                     stochastic: bool = False, seed: int = 0, offset: int = 0,
                     rng: Optional[torch.Tensor] = None):
    """Current scaling: scale = max / (amax(x) * margin) (1.0 for an amax of 0 or not finite),
    then the cast."""
    amax = _ops.amax(x)
    scale = scale_from_amax(amax, torch.ones_like(amax), get_format(dtype).max, margin,
                            power_of_two)
    data, data_t = cast(x, scale, dtype, transpose, stochastic, seed, offset, rng, amax)[:2]
    return data, data_t, scale, torch.reciprocal(scale), column_sums(x, sum_dtype)


def own_scale(x: torch.Tensor, fp8_max: float, margin: float, power_of_two: bool):
    """Current scaling's scale of x: max / (amax(x) * margin), 1.0 for an amax of 0 or not
    finite."""
    amax = _ops.amax(x)
    return scale_from_amax(amax, torch.ones_like(amax), fp8_max, margin, power_of_two)


def step_role(amax_history, scale, scale_inv, amax_rep, pending_amax, step, fp8_max: float,
              margin: float, interval: int, algo: str, ema_alpha: float, percentile: float,
              power_of_two: bool) -> None:
    """One step of a delayed-scaling role's state machine, in place: step += 1, then
    ops.delayed_scale_update into the buffers (one multi-tensor copy: one kernel on a GPU)."""
    step.add_(1)
    outs = _ops.delayed_scale_update(amax_history, scale, amax_rep, pending_amax, step, fp8_max,
                                     margin, interval, algo, ema_alpha, percentile, power_of_two)
    torch._foreach_copy_([amax_history, scale, scale_inv, amax_rep, pending_amax], list(outs))


def cast(x, scale, dtype, transpose, stochastic, seed, offset, rng, x_amax=None):
    """ops.quantize; a stochastic cast that read its random stream from rng advances its
    offset by one. x_amax: ops.amax(x), taken already (on the CPU the cast then returns it
    rather than reading x for it again)."""
    if x_amax is not None and x.device.type == "cpu":
        out = emulation.quantize(x, scale, dtype, transpose, stochastic, seed, offset, rng,
                                 x_amax=x_amax)
    else:
        out = _ops.quantize(x, scale, dtype, transpose, stochastic, seed, offset, rng)
    if stochastic and rng is not None:
        rng[1:].add_(1)
    return out


def quantize_delayed(x: torch.Tensor, amax_history: torch.Tensor, scale: torch.Tensor,
                     scale_inv: torch.Tensor, amax_rep: torch.Tensor, pending_amax: torch.Tensor,
                     step: torch.Tensor, nonfinite_count: torch.Tensor, dtype: torch.dtype,
                     margin: float, interval: int, algo: str, ema_alpha: float, percentile: float,
                     power_of_two: bool, update: bool, warm: bool, record: bool,
                     transpose: bool = False, sum_dtype: Optional[torch.dtype] = None,
                     stochastic: bool = False, seed: int = 0, offset: int = 0,
                     rng: Optional[torch.Tensor] = None):
    """A cast of one delayed-scaling role (the buffers of scaling.RoleState, changed in place):
    update: first one step of the state machine (step += 1, then ops.delayed_scale_update);
    warm: cast with x's own amax as current scaling would (nothing recorded yet), else with the
    role's scale; record: fold x's amax into pending_amax (a non-finite amax is counted in
    nonfinite_count instead)."""
    fp8_max = get_format(dtype).max
    if update:
        step_role(amax_history, scale, scale_inv, amax_rep, pending_amax, step, fp8_max, margin,
                  interval, algo, ema_alpha, percentile, power_of_two)
    if warm:
        used = own_scale(x, fp8_max, margin, power_of_two)
    else:
        used = scale.clone()  # a copy: the buffer changes before backward uses it
    data, data_t, x_amax = cast(x, used, dtype, transpose, stochastic, seed, offset, rng)
    if record:
        record_amax(pending_amax, nonfinite_count, x_amax, torch.isfinite(x_amax))
    return data, data_t, used, torch.reciprocal(used), column_sums(x, sum_dtype)


def quantize_blockwise_pair(x: torch.Tensor, dtype: torch.dtype, power_of_two: bool,
                            sum_dtype: Optional[torch.dtype] = None):
    """x [M, K] cast with 1x128 blocks along K and, for the backward GEMMs, x^T [K, M] cast with
    1x128 blocks along M: (data, scale_inv, data_t, scale_inv_t, column sums). The scales are
    stored with their rows contiguous (scale_inv [M, Kb] in a [Kb, M] buffer): the layout the
    Hopper GEMM reads, so it needs no per-call copy."""
    _need_2d(x, "quantize_blockwise_pair")
    pair = quantize_blockwise_pair_kernel(x, dtype, power_of_two)  # (the CPU: one C++ call)
    if pair is not None:
        return pair + (column_sums(x, sum_dtype),)
    data, scale_inv = _ops.quantize_blockwise(x, dtype, 1, 128, power_of_two)
    data_t, scale_inv_t = _ops.quantize_blockwise(x.t(), dtype, 1, 128, power_of_two)
    return (data, mn_major(scale_inv), data_t, mn_major(scale_inv_t),
            column_sums(x, sum_dtype))


def mn_major(scales: torch.Tensor) -> torch.Tensor:
    """scales [rows, blocks] stored with the rows contiguous (strides (1, rows))."""
    return scales.t().contiguous().t()


def quantize_mx_pair(x: torch.Tensor, dtype: torch.dtype, block_size: int, rceil: bool,
                     sum_dtype: Optional[torch.dtype] = None):
    """x [M, K] zero-padded to whole blocks [Mp, Kp] (zeros change neither a block's amax nor a
    product) and cast to MXFP8 twice: blocked along K for the rows [:M] ([M, Kp], scales
    [M, Kp / block]), and blocked along M for the backward GEMMs ([Mp, Kp], scales
    [Mp / block, Kp]): (row data, row scales, column data, column scales, column sums of x)."""
    _need_2d(x, "quantize_mx_pair")
    if block_size < 1:
        raise ValueError(f"fp8ops: quantize_mx_pair: block_size must be positive, got {block_size}")
    m, k = x.shape
    # (padding makes a copy even when there is nothing to pad)
    xp = torch.nn.functional.pad(x, (0, -k % block_size, 0, -m % block_size)) \
        if (m % block_size or k % block_size) else x
    row, row_scales = _ops.quantize_mx(xp[:m], dtype, block_size, 1, rceil)
    col, col_scales = _ops.quantize_mx(xp, dtype, block_size, 0, rceil)
    return row, row_scales, col, col_scales, column_sums(x, sum_dtype)


def _need_2d(x: torch.Tensor, op: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"fp8ops: {op}: x must be 2-D [rows, cols], got shape {tuple(x.shape)}")


def record_amax(pending_amax: torch.Tensor, nonfinite_count: torch.Tensor, amax: torch.Tensor,
                finite: torch.Tensor) -> None:
    """pending = max(pending, amax) for a finite amax; a non-finite one is counted instead."""
    pending_amax.copy_(torch.where(finite, torch.maximum(pending_amax, amax), pending_amax))
    nonfinite_count.add_((~finite).to(torch.int64))
