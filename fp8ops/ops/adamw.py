"""The FP8AdamW step (docs/numerics.md, "FP8AdamW") as the emulation of the op
`torch.ops.fp8ops.adamw_step`, the reference a fused kernel (csrc/adamw.cu) equals bit for bit.

Moments of a parameter of n values are taken flat in blocks of BLOCK (the last one zero-padded):
m as E4M3 blocks [blocks, BLOCK] with float32 scale_inv [blocks, 1]; v as E4M3 blocks holding
sqrt(v), E5M2 blocks holding v, or bfloat16 [n] holding v (scale_inv then empty). The same step
with float32 moments (small parameters) is `step_float32`. `adamw_step_multi` steps a list of
parameters in one call, each as `adamw_step` would, its scalars a row of `scalar_table`.
"""
from __future__ import annotations

import math

import torch

from .bf16_rounding import stochastic_round_bf16
from ..formats import round_f32

BLOCK = 128
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def sqrt_rn(v: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 square root of float32 v. torch's CPU float32 sqrt is not
    always (its vectorized path can be an ulp off): the double root of a float32 rounds to the
    same float32 as the exact root. CUDA's float32 sqrt is correctly rounded already."""
    if v.device.type == "cpu":
        return v.double().sqrt_().float()
    return v.sqrt()


def blocks_of(numel: int) -> int:
    return -(-numel // BLOCK)


def encode(x: torch.Tensor, dtype: torch.dtype):
    """x (float32, flat) zero-padded to whole blocks -> (FP8 data [blocks, BLOCK], float32
    scale_inv [blocks, 1]): the 1x128 blockwise quantizer."""
    n = x.numel()
    if blocks_of(n) * BLOCK != n:
        x = torch.cat([x, x.new_zeros(blocks_of(n) * BLOCK - n)])
    return torch.ops.fp8ops.quantize_blockwise(x.view(-1, BLOCK), dtype, 1, BLOCK, False)


def decode(data: torch.Tensor, scale_inv: torch.Tensor, numel: int) -> torch.Tensor:
    """The first `numel` float32 values of blocks made by encode."""
    out = torch.ops.fp8ops.dequantize_blockwise(data, scale_inv, 1, BLOCK, torch.float32)
    return out.view(-1)[:numel]


def read_v(v: torch.Tensor, v_scale_inv: torch.Tensor, numel: int) -> torch.Tensor:
    """v as float32 from its stored form."""
    if v.dtype == torch.bfloat16:
        return v.float()
    d = decode(v, v_scale_inv, numel)
    return d.mul_(d) if v.dtype == E4M3 else d


def step_scalars(lr: float, betas, eps: float, weight_decay: float, decoupled: bool, t: int,
                 seed: int, index: int) -> tuple:
    """adamw_step's scalars after t steps of the parameter at `index` in its optimizer: each
    computed in double from the hyperparameters and rounded once to float32 (docs/numerics.md,
    "FP8AdamW"), then the random stream (seed, offset) of a bfloat16 parameter."""
    beta1, beta2 = betas
    decay = round_f32(1.0 - lr * weight_decay) if decoupled else 1.0
    l2 = 0.0 if decoupled else round_f32(weight_decay)
    return (round_f32(beta1), round_f32(1.0 - beta1), round_f32(beta2), round_f32(1.0 - beta2),
            round_f32(eps), round_f32(lr / (1.0 - beta1 ** t)),
            round_f32(1.0 / math.sqrt(1.0 - beta2 ** t)), decay, l2,
            seed, (index << 32) | (t & 0xFFFFFFFF))


N_SCALARS = 9  # beta1 ... l2 of step_scalars, one row per parameter of adamw_step_multi


def scalar_table(lr: float, betas, eps: float, weight_decay: float, decoupled: bool,
                 steps: torch.Tensor, seed: int, indices: torch.Tensor):
    """step_scalars of many parameters of one param group as adamw_step_multi's tables: float32
    [n, N_SCALARS] and int64 [n, 2] (seed, offset), on the CPU. steps and indices: int64 [n],
    each parameter's step count t and index in its optimizer. Rows differ only through t, so
    step_scalars runs once per distinct t (the same double arithmetic, hence the same values)."""
    distinct, which = torch.unique(steps, return_inverse=True)
    rows = [step_scalars(lr, betas, eps, weight_decay, decoupled, t, seed, 0)[:N_SCALARS]
            for t in distinct.tolist()]
    # float32 values already: the float32 tensor holds them exactly
    scalars = torch.tensor(rows, dtype=torch.float32).reshape(-1, N_SCALARS)[which]
    offsets = (indices << 32) | (steps & 0xFFFFFFFF)
    rng = torch.stack((torch.full_like(steps, seed), offsets), dim=1)
    return scalars, rng


def store_moments(m, m_scale_inv, v, v_scale_inv, m32: torch.Tensor, v32: torch.Tensor,
                  s: torch.Tensor | None = None) -> None:
    """New moments (flat float32 m32, v32; s = sqrt(v32) when the caller has it) into FP8 m and
    v in v's form, with their scales."""
    data, scale_inv = encode(m32, E4M3)
    m.copy_(data)
    m_scale_inv.copy_(scale_inv.view(m_scale_inv.shape))
    if v.dtype == torch.bfloat16:
        v.view(-1).copy_(v32)
        return
    if v.dtype == E4M3:
        stored = s if s is not None else sqrt_rn(v32)
    else:
        stored = v32
    data, scale_inv = encode(stored, v.dtype)
    v.copy_(data)
    v_scale_inv.copy_(scale_inv.view(v_scale_inv.shape))


def _update(p32, g, m, v, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, step_size,
            bias2_rsqrt, decay, l2):
    """(new p, m, v, sqrt(v)) in float32, every operation rounded to float32. Python floats
    given here are float32 values already (a float32 op with one rounds it to itself)."""
    if l2:
        g = g.add(p32.mul(l2))
    m = m.mul(beta1).add_(g.mul(one_minus_beta1))
    v = v.mul(beta2).add_(g.mul(g).mul_(one_minus_beta2))
    s = sqrt_rn(v)
    # a multiply by the reciprocal, not a division by a scalar (which torch turns into a
    # multiply by a reciprocal of its own on some devices)
    update = m.div(s.mul(bias2_rsqrt).add_(eps))
    # v = 0 means m = 0 in exact arithmetic: where v's rounding lost a tiny value, a stored m
    # would otherwise be divided by eps alone
    update = update.masked_fill_(s == 0, 0.0).mul_(step_size)
    if decay != 1.0:
        p32 = p32.mul(decay)
    return p32.sub(update), m, v, s


def _write_param(param: torch.Tensor, p32: torch.Tensor, seed: int, offset: int) -> None:
    flat = param.view(-1)
    if param.dtype == torch.bfloat16:
        flat.copy_(stochastic_round_bf16(p32, seed, offset))
    else:
        flat.copy_(p32)


def _check(param, grad, m, m_scale_inv, v, v_scale_inv) -> int:
    n = param.numel()
    if param.dtype not in (torch.float32, torch.bfloat16) or not param.is_contiguous():
        raise ValueError(f"fp8ops: adamw_step: param must be contiguous float32 or bfloat16, "
                         f"got {param.dtype} (contiguous: {param.is_contiguous()})")
    if grad.numel() != n:
        raise ValueError(f"fp8ops: adamw_step: grad has {grad.numel()} values, param {n}")
    blocks = blocks_of(n)
    if m.dtype != E4M3 or tuple(m.shape) != (blocks, BLOCK) or m_scale_inv.numel() != blocks:
        raise ValueError(f"fp8ops: adamw_step: m must be E4M3 [{blocks}, {BLOCK}] with "
                         f"{blocks} scales, got {m.dtype} {tuple(m.shape)} and "
                         f"{m_scale_inv.numel()}")
    if v.dtype == torch.bfloat16:
        ok = v.numel() == n
    else:
        ok = v.dtype in (E4M3, E5M2) and tuple(v.shape) == (blocks, BLOCK) and \
            v_scale_inv.numel() == blocks
    if not ok:
        raise ValueError(f"fp8ops: adamw_step: v must be E4M3 / E5M2 [{blocks}, {BLOCK}] with "
                         f"{blocks} scales, or bfloat16 of {n} values; got {v.dtype} "
                         f"{tuple(v.shape)}")
    return n


def adamw_step(param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor,
               m_scale_inv: torch.Tensor, v: torch.Tensor, v_scale_inv: torch.Tensor,
               beta1: float, one_minus_beta1: float, beta2: float, one_minus_beta2: float,
               eps: float, step_size: float, bias2_rsqrt: float, decay: float, l2: float,
               seed: int, offset: int) -> None:
    """One step of one parameter with FP8 moments, in place (param, m, v and their scales)."""
    n = _check(param, grad, m, m_scale_inv, v, v_scale_inv)
    p32 = param.reshape(-1).float()
    g = grad.reshape(-1).float()
    m32 = decode(m, m_scale_inv, n)
    v32 = read_v(v, v_scale_inv, n)
    p32, m32, v32, s = _update(p32, g, m32, v32, beta1, one_minus_beta1, beta2,
                               one_minus_beta2, eps, step_size, bias2_rsqrt, decay, l2)
    store_moments(m, m_scale_inv, v, v_scale_inv, m32, v32, s)
    _write_param(param, p32, seed, offset)


def step_float32(param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                 *scalars) -> None:
    """adamw_step with float32 moments m, v [n] (kept as they are, no rounding)."""
    beta1, omb1, beta2, omb2, eps, step_size, bias2_rsqrt, decay, l2, seed, offset = scalars
    p32 = param.reshape(-1).float()
    g = grad.reshape(-1).float()
    p32, m32, v32, _ = _update(p32, g, m, v, beta1, omb1, beta2, omb2, eps, step_size,
                               bias2_rsqrt, decay, l2)
    m.copy_(m32)
    v.copy_(v32)
    _write_param(param, p32, seed, offset)


def _check_multi(params, grads, m, m_scale_inv, v, v_scale_inv, scalars, rng) -> None:
    """The list-level checks of adamw_step_multi (each parameter's own: _check), as the CUDA
    kernel makes them: one length, the tables' shapes, one param dtype and one v format."""
    n = len(params)
    if any(len(x) != n for x in (grads, m, m_scale_inv, v, v_scale_inv)):
        raise ValueError(f"fp8ops: adamw_step_multi: params, grads, m, m_scale_inv, v and "
                         f"v_scale_inv must be lists of one length, got "
                         f"{[len(x) for x in (params, grads, m, m_scale_inv, v, v_scale_inv)]}")
    if scalars.dtype != torch.float32 or tuple(scalars.shape) != (n, N_SCALARS):
        raise ValueError(f"fp8ops: adamw_step_multi: scalars must be float32 [{n}, {N_SCALARS}], "
                         f"got {scalars.dtype} {tuple(scalars.shape)}")
    if rng.dtype != torch.int64 or tuple(rng.shape) != (n, 2):
        raise ValueError(f"fp8ops: adamw_step_multi: rng must be int64 [{n}, 2] (seed, offset), "
                         f"got {rng.dtype} {tuple(rng.shape)}")
    if len({p.dtype for p in params}) > 1 or len({x.dtype for x in v}) > 1:
        raise ValueError("fp8ops: adamw_step_multi: the params must share one dtype and the v "
                         "one format, got params of " + str(sorted({str(p.dtype) for p in params}))
                         + " and v of " + str(sorted({str(x.dtype) for x in v})))


def adamw_step_multi(params: list, grads: list, m: list, m_scale_inv: list, v: list,
                     v_scale_inv: list, scalars: torch.Tensor, rng: torch.Tensor) -> None:
    """adamw_step on each parameter in turn, the i-th with the scalars scalars[i] (float32
    [n, N_SCALARS]) and the random stream rng[i] (int64 [n, 2]: seed, offset)."""
    _check_multi(params, grads, m, m_scale_inv, v, v_scale_inv, scalars, rng)
    rows, words = scalars.tolist(), rng.tolist()
    for i, param in enumerate(params):
        adamw_step(param, grads[i], m[i], m_scale_inv[i], v[i], v_scale_inv[i], *rows[i],
                   *words[i])
