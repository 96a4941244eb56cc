"""The grouped ops of mixture-of-experts layers in PyTorch: the bit-exact reference.

Tokens come sorted by expert (the contiguous layout): group g holds rows offsets[g-1]:offsets[g]
of the input (offsets[-1] = 0), as torch._grouped_mm takes them; rows from offsets[E-1] to M
belong to no group (their output rows are zeros). Each op is a loop over the groups calling the
dense op of emulation.py (or, for the casts, the dense cast op) on that group's rows, so every
group's bytes are those of the dense op on the group alone, empty groups included (zero rows,
a zero weight gradient). The loop reads the offsets on the host. The casts
(quantize_current_grouped, quantize_scaled_grouped, quantize_blockwise_grouped) are the
exception: all groups at once on the device, with the same bytes (their docstrings).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

from ..formats import get_format
from . import emulation

_ops = torch.ops.fp8ops
_F32 = torch.float32
BLOCK = 128  # the 1x128 / 128x128 blocks of the blockwise recipe


def check_offsets_meta(op: str, offsets: torch.Tensor, groups: Optional[int] = None) -> None:
    """The checks of offsets that need no values (fake implementations run them too)."""
    if offsets.dtype != torch.int32:
        raise ValueError(f"fp8ops: {op}: offsets must be int32 (cumulative end row of each "
                         f"group), got {offsets.dtype}")
    if offsets.dim() != 1:
        raise ValueError(f"fp8ops: {op}: offsets must be 1-D [groups], got shape "
                         f"{tuple(offsets.shape)}")
    if groups is not None and offsets.shape[0] != groups:
        raise ValueError(f"fp8ops: {op}: offsets has {offsets.shape[0]} groups but the weight "
                         f"has {groups} experts")


def group_bounds(op: str, offsets: torch.Tensor, rows: int,
                 groups: Optional[int] = None) -> List[Tuple[int, int]]:
    """[(start, end)] of each group's rows, offsets checked: int32, 1-D, non-negative,
    non-decreasing, the last at most `rows`."""
    check_offsets_meta(op, offsets, groups)
    ends = offsets.tolist()
    starts = [0] + ends[:-1]
    for g, (lo, hi) in enumerate(zip(starts, ends)):
        if hi < 0:
            raise ValueError(f"fp8ops: {op}: offsets must be non-negative, got offsets[{g}] = "
                             f"{hi}")
        if hi < lo:
            raise ValueError(f"fp8ops: {op}: offsets must be non-decreasing, got offsets[{g}] = "
                             f"{hi} after {lo}")
    if ends and ends[-1] > rows:
        raise ValueError(f"fp8ops: {op}: the last offset ({ends[-1]}) exceeds the {rows} rows "
                         f"of the input")
    return list(zip(starts, ends))


def block_starts(bounds: List[Tuple[int, int]]) -> List[int]:
    """Where each group's 128-row blocks start in a transposed blockwise copy: the groups' blocks
    packed one after another (a group of m rows has ceil(m / 128))."""
    starts, at = [], 0
    for lo, hi in bounds:
        starts.append(at)
        at += -(-(hi - lo) // BLOCK)
    return starts


def packed_blocks(rows: int, groups: int) -> int:
    """The column count of a transposed blockwise copy's scales: enough for any offsets
    (sum of ceil(m_g / 128) <= rows // 128 + groups); columns past the last group's are 1.0."""
    return rows // BLOCK + groups


def _rows_out(a: torch.Tensor, n: int, out_dtype: torch.dtype) -> torch.Tensor:
    # zeros: rows past the last group are defined (torch._grouped_mm leaves them unwritten)
    return torch.zeros(a.shape[0], n, dtype=out_dtype, device=a.device)


def _check_scales(op: str, scale: torch.Tensor, shapes, what: str) -> None:
    if tuple(scale.shape) not in [tuple(s) for s in shapes]:
        raise ValueError(f"fp8ops: {op}: {what} must have shape "
                         f"{' or '.join(str(tuple(s)) for s in shapes)}, got {tuple(scale.shape)}")


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                 a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor,
                 bias: Optional[torch.Tensor], out_dtype: torch.dtype, *,
                 gemm: Optional[Callable] = None) -> torch.Tensor:
    """Y_g = (a_g @ b[g]^T) * scales (+ bias[g]) for a [M, K], b [E, N, K]: emulation.gemm per
    group. a_scale_inv: [E] (one per group) or [M, 1] (one per row); b_scale_inv: [E] (one per
    expert) or [E, N] (one per output column). gemm: the per-group GEMM instead of
    emulation.gemm (on CUDA, the dense op, whose kernels then serve each group)."""
    gemm = emulation.gemm if gemm is None else gemm
    M, E, N = a.shape[0], b.shape[0], b.shape[1]
    _check_scales("grouped_gemm", a_scale_inv, [(E,), (M, 1)], "a_scale_inv")
    _check_scales("grouped_gemm", b_scale_inv, [(E,), (E, N)], "b_scale_inv")
    out = _rows_out(a, N, out_dtype)
    for g, (lo, hi) in enumerate(group_bounds("grouped_gemm", offsets, M, E)):
        sa = a_scale_inv[g] if a_scale_inv.dim() == 1 else a_scale_inv[lo:hi]
        sb = b_scale_inv[g] if b_scale_inv.dim() == 1 else b_scale_inv[g].unsqueeze(0)
        out[lo:hi] = gemm(a[lo:hi], b[g], sa, sb, None if bias is None else bias[g], out_dtype)
    return out


def grouped_gemm_blockwise(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                           a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor,
                           bias: Optional[torch.Tensor], out_dtype: torch.dtype, *,
                           gemm: Optional[Callable] = None) -> torch.Tensor:
    """grouped_gemm with block scales: a [M, K] in 1x128 blocks (a_scale_inv [M, Kb]), b
    [E, N, K] in 128x128 blocks ([E, Nb, Kb]) or 1x128 ones ([E, N, Kb]):
    emulation.gemm_blockwise per group (or `gemm`, as grouped_gemm takes it)."""
    gemm = emulation.gemm_blockwise if gemm is None else gemm
    M, E, N = a.shape[0], b.shape[0], b.shape[1]
    out = _rows_out(a, N, out_dtype)
    for g, (lo, hi) in enumerate(group_bounds("grouped_gemm_blockwise", offsets, M, E)):
        out[lo:hi] = gemm(a[lo:hi], b[g], a_scale_inv[lo:hi], b_scale_inv[g],
                          None if bias is None else bias[g], out_dtype)
    return out


def grouped_gemm_wgrad(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                       a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor,
                       out_dtype: torch.dtype, *, gemm: Optional[Callable] = None) -> torch.Tensor:
    """dW_g = dY_g^T X_g, grouped along M: a = dY^T [N, M], b = X^T [K, M] (K-major, as the
    dense wgrad takes them), per-group scales [E] each; out [E, N, K]. gemm: as grouped_gemm."""
    gemm = emulation.gemm if gemm is None else gemm
    check_offsets_meta("grouped_gemm_wgrad", offsets)
    E, M = offsets.shape[0], a.shape[1]
    _check_scales("grouped_gemm_wgrad", a_scale_inv, [(E,)], "a_scale_inv")
    _check_scales("grouped_gemm_wgrad", b_scale_inv, [(E,)], "b_scale_inv")
    out = torch.empty(E, a.shape[0], b.shape[0], dtype=out_dtype, device=a.device)
    for g, (lo, hi) in enumerate(group_bounds("grouped_gemm_wgrad", offsets, M)):
        # contiguous like the dense wgrad's operands: the same matmul, the same bytes
        out[g] = gemm(a[:, lo:hi].contiguous(), b[:, lo:hi].contiguous(), a_scale_inv[g],
                      b_scale_inv[g], None, out_dtype)
    return out


def grouped_gemm_wgrad_blockwise(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                                 a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor,
                                 out_dtype: torch.dtype, *,
                                 gemm: Optional[Callable] = None) -> torch.Tensor:
    """grouped_gemm_wgrad with 1x128 blocks along M that start at each group's first row: the
    scales [N, packed] and [K, packed] hold each group's blocks one after another
    (quantize_blockwise_grouped's transposed copy). gemm: as grouped_gemm_blockwise."""
    gemm = emulation.gemm_blockwise if gemm is None else gemm
    check_offsets_meta("grouped_gemm_wgrad_blockwise", offsets)
    E, M = offsets.shape[0], a.shape[1]
    out = torch.empty(E, a.shape[0], b.shape[0], dtype=out_dtype, device=a.device)
    bounds = group_bounds("grouped_gemm_wgrad_blockwise", offsets, M)
    for g, ((lo, hi), s) in enumerate(zip(bounds, block_starts(bounds))):
        nb = -(-(hi - lo) // BLOCK)
        out[g] = gemm(a[:, lo:hi].contiguous(), b[:, lo:hi].contiguous(),
                      a_scale_inv[:, s:s + nb], b_scale_inv[:, s:s + nb], None, out_dtype)
    return out


def quantize_current_grouped(x: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype,
                             margin: float, power_of_two: bool, transpose: bool = False):
    """Current scaling per group: each group's rows cast with their own amax (the op
    quantize_current on the group). (data [M, K], data^T [K, M] or empty, scale [E],
    scale_inv [E]); rows past the last group are zero bytes. An empty group has scale 1.

    Computed for all groups at once, the group sizes never leaving the device (no host sync, as
    a CUDA graph needs): each row's group from the offsets, the groups' amax by a scatter of the
    rows' amax, the scales by scale_from_amax over [E], the cast as the dense one's (one float32
    multiply per element, saturating round to nearest even). Max is exact in any order, so every
    group's bytes are the dense op's on its rows (tests/test_grouped.py checks it)."""
    M = x.shape[0]
    E = offsets.shape[0]
    check_offset_values("quantize_current_grouped", offsets, M)
    fmt = get_format(dtype)
    group = row_groups(offsets, M)
    amax = _group_amax(x, group, E)
    scale = emulation.scale_from_amax(amax, torch.ones_like(amax), fmt.max, margin, power_of_two)
    data, data_t = _cast_by_group(x, group, scale, fmt, transpose)
    return data, data_t, scale, torch.reciprocal(scale)


# Rows per pass over x: the float32 temporaries of a pass stay under CHUNK values (64 MiB), as
# an expert layer's input can hold hundreds of millions. The chunks are fixed by x's shape, not
# by the offsets, so they need no host read.
CHUNK = 1 << 24


def _row_chunks(x: torch.Tensor):
    """(start, end) of the row chunks of x [M, K]."""
    M, K = x.shape
    step = max(1, CHUNK // max(K, 1))
    return [(lo, min(lo + step, M)) for lo in range(0, M, step)]


def _group_amax(x: torch.Tensor, group: torch.Tensor, groups: int) -> torch.Tensor:
    """max |x| over each group's rows (float32 [E]; 0 for an empty group, NaN wins)."""
    M, K = x.shape
    row_amax = x.new_zeros(M, dtype=_F32)
    if K:
        for lo, hi in _row_chunks(x):  # inf-norm: max |x| with no |x| temporary, NaN kept
            row_amax[lo:hi] = torch.linalg.vector_norm(x[lo:hi], float("inf"), dim=1,
                                                       dtype=_F32)
    amax = row_amax.new_zeros(groups + 1).scatter_reduce_(0, group, row_amax, "amax")
    # NaN must win, as in the dense amax, whatever scatter_reduce makes of it
    nan = row_amax.new_zeros(groups + 1).index_add_(0, group, row_amax.isnan().float()) > 0
    return torch.where(nan, float("nan"), amax)[:groups]


def _cast_by_group(x: torch.Tensor, group: torch.Tensor, scale: torch.Tensor, fmt,
                   transpose: bool):
    """Each row times its group's scale, rounded as the dense cast does; rows of no group are
    zero bytes. (data, data^T or an empty tensor)."""
    row_scale = torch.cat([scale, scale.new_zeros(1)])[group].unsqueeze(1)
    owned = (group < scale.shape[0]).unsqueeze(1)
    data = torch.empty(x.shape, dtype=fmt.dtype, device=x.device)
    bytes_ = data.view(torch.uint8)
    for lo, hi in _row_chunks(x):
        y = emulation._f32(x[lo:hi]) * row_scale[lo:hi]
        q = emulation._rne_fp8(y, fmt, inplace=True).view(torch.uint8)
        bytes_[lo:hi] = q.masked_fill_(~owned[lo:hi], 0)
    return data, data.t().contiguous() if transpose else data.new_empty((0,))


def row_groups(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """Each row's group (int64 [rows]; E for a row past the last group), on the device."""
    r = torch.arange(rows, dtype=offsets.dtype, device=offsets.device)
    return torch.searchsorted(offsets, r, right=True)


def check_offset_values(op: str, offsets: torch.Tensor, rows: int) -> None:
    """group_bounds' checks of the values: on the host for CPU offsets (a clear ValueError),
    elsewhere as an asynchronous device assert (no sync)."""
    if offsets.device.type == "cpu":
        group_bounds(op, offsets, rows)
        return
    check_offsets_meta(op, offsets)
    if offsets.shape[0] == 0:
        return
    ok = (offsets[0] >= 0) & (offsets[-1] <= rows)
    if offsets.shape[0] > 1:
        ok = ok & (offsets[1:] >= offsets[:-1]).all()
    torch._assert_async(ok, f"fp8ops: {op}: offsets must be non-negative, non-decreasing and at "
                            f"most the {rows} rows of the input")


def quantize_scaled_grouped(x: torch.Tensor, offsets: torch.Tensor, scale: torch.Tensor,
                            dtype: torch.dtype, transpose: bool = False):
    """Each group's rows cast with the group's given scale (the op quantize on the group; delayed
    scaling): (data [M, K], data^T [K, M] or empty, amax [E] of each group's rows). Rows past the
    last group are zero bytes; an empty group's amax is 0, the dense amax of an empty tensor.
    All groups at once on the device, as quantize_current_grouped."""
    M = x.shape[0]
    E = offsets.shape[0]
    check_offset_values("quantize_scaled_grouped", offsets, M)
    _check_scales("quantize_scaled_grouped", scale, [(E,)], "scale")
    group = row_groups(offsets, M)
    data, data_t = _cast_by_group(x, group, emulation._f32(scale), get_format(dtype), transpose)
    return data, data_t, _group_amax(x, group, E)


def quantize_blockwise_grouped(x: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype,
                               power_of_two: bool):
    """The blockwise casts per group (the op quantize_blockwise_pair on the group): x [M, K] in
    1x128 blocks along K (data [M, K], scale_inv [M, Kb]) and x^T [K, M] in 1x128 blocks along M
    that start at each group's first row (data_t [K, M], scale_inv_t [K, packed_blocks], the
    groups' blocks packed one after another, unused columns 1.0). Rows past the last group are
    zero bytes with scale 1.

    All groups at once on the device, with the bytes of the per-group op: blocks along K lie in
    one row, so the rows' cast is the dense one on all of x; the blocks along M are runs of up to
    128 rows of one group, each row's block found from the offsets (packed_block_of_rows), their
    amax reduced by index (max is exact in any order; NaN wins) and the dense blockwise scales
    and cast applied per block."""
    M, K = x.shape
    E = offsets.shape[0]
    check_offset_values("quantize_blockwise_grouped", offsets, M)
    fmt = get_format(dtype)
    group = row_groups(offsets, M)
    owned = (group < E).unsqueeze(1)
    data, scale_inv = _ops.quantize_blockwise(x, dtype, 1, BLOCK, power_of_two)
    data.view(torch.uint8).masked_fill_(~owned, 0)  # in place: no second [M, K] buffer
    scale_inv = scale_inv.contiguous().masked_fill_(~owned, 1.0)
    n_blocks = packed_blocks(M, E)
    block = packed_block_of_rows(offsets, group, n_blocks)
    amax = x.new_zeros(n_blocks + 1, K, dtype=_F32)
    nan = x.new_zeros(n_blocks + 1, K, dtype=_F32)
    for lo, hi in _row_chunks(x):
        a = emulation._f32(x[lo:hi]).abs()
        index = block[lo:hi]
        # (the index a broadcast view: no [rows, K] index tensor is made)
        amax.scatter_reduce_(0, index.unsqueeze(1).expand(hi - lo, K), a, "amax")
        nan.index_add_(0, index, a.isnan().float())
    amax = torch.where(nan > 0, float("nan"), amax)
    scale, scale_inv_t = emulation.blockwise_scales(amax, fmt, power_of_two)
    # a block holding NaN or inf gets a NaN multiplier: all its data NaN, as the dense cast
    mult = torch.where(torch.isfinite(amax), scale, float("nan"))
    q = torch.empty(M, K, dtype=torch.uint8, device=x.device)
    for lo, hi in _row_chunks(x):
        y = emulation._f32(x[lo:hi]) * mult[block[lo:hi]]
        chunk = emulation._rne_fp8(y, fmt, inplace=True).view(torch.uint8)
        q[lo:hi] = chunk.masked_fill_(~owned[lo:hi], 0)
    return data, scale_inv, q.view(dtype).t().contiguous(), scale_inv_t[:n_blocks].t().contiguous()


def packed_block_of_rows(offsets: torch.Tensor, group: torch.Tensor, n_blocks: int):
    """Each row's column in the packed scales of a transposed blockwise copy (block_starts):
    its group's first block plus its 128-row block within the group; n_blocks for a row of no
    group. On the device, from the offsets."""
    E, M = offsets.shape[0], group.shape[0]
    if E == 0:
        return torch.full((M,), n_blocks, dtype=torch.int64, device=group.device)
    ends = offsets.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    blocks = (ends - starts + BLOCK - 1) // BLOCK
    first = blocks.cumsum(0) - blocks
    g = group.clamp(max=E - 1)
    rows = torch.arange(M, device=group.device)
    return torch.where(group < E, first[g] + (rows - starts[g]) // BLOCK, n_blocks)
