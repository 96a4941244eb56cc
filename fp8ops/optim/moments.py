"""How FP8AdamW stores Adam's moments: flat blocks of 128 values, each block in FP8 with one
float32 scale (the project's 1x128 blockwise quantizer, torch.ops.fp8ops.quantize_blockwise:
scale = max / block amax, round to nearest even, saturating), so that a tensor's large and small
regions keep their own range.

- m (the first moment): E4M3.
- v (the second moment), one of SECOND_MOMENTS:
  - "sqrt_e4m3": sqrt(v) in E4M3. The square root halves v's dynamic range in log terms (the
    range of the gradients themselves, which a block's E4M3 range holds), and the step reads
    sqrt(v) only, so it gets E4M3's precision directly. A square root is correctly rounded on
    every device, which keeps the optimizer bit-exact across them (a range expansion x^k with
    a general k would go through pow, which is not).
  - "e5m2": v in E5M2 (a wider range, one mantissa bit less).
  - "bf16": v in bfloat16, round to nearest even, no scale (2 bytes a value).
A tensor of fewer than `min_fp8_numel` values keeps both moments in float32 (biases, norm
gains: the bytes are negligible and their updates sensitive).
"""
from __future__ import annotations

import torch

BLOCK = 128
SECOND_MOMENTS = ("sqrt_e4m3", "e5m2", "bf16")
_E4M3, _E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def sqrt_rn(v: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 square root of float32 v. torch's CPU float32 sqrt is not
    (its vectorized path is off by an ulp in about a sixth of values): the double root of a
    float32 rounds to the same float32 as the exact root. CUDA's float32 sqrt is correctly
    rounded already."""
    if v.device.type == "cpu":
        return v.double().sqrt_().float()
    return v.sqrt()


def padded_blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def _encode(x: torch.Tensor, dtype: torch.dtype):
    """x (float32, flat, numel a multiple of BLOCK) -> (FP8 data [blocks, BLOCK], float32
    scale_inv [blocks, 1])."""
    return torch.ops.fp8ops.quantize_blockwise(x.view(-1, BLOCK), dtype, 1, BLOCK, False)


def _decode(data: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The float32 values (flat) of blocks made by _encode."""
    out = torch.ops.fp8ops.dequantize_blockwise(data, scale_inv, 1, BLOCK, torch.float32)
    return out.view(-1)


def empty_state(numel: int, second_moment: str, fp8: bool, device) -> dict:
    """Zero moments for a tensor of `numel` values."""
    if not fp8:
        zeros = torch.zeros(numel, dtype=torch.float32, device=device)
        return {"m": zeros, "v": zeros.clone()}
    blocks = padded_blocks(numel)
    ones = torch.ones(blocks, 1, dtype=torch.float32, device=device)
    state = {"m": torch.zeros(blocks, BLOCK, dtype=_E4M3, device=device),
             "m_scale_inv": ones}
    if second_moment == "bf16":
        state["v"] = torch.zeros(numel, dtype=torch.bfloat16, device=device)
    else:
        dtype = _E4M3 if second_moment == "sqrt_e4m3" else _E5M2
        state["v"] = torch.zeros(blocks, BLOCK, dtype=dtype, device=device)
        state["v_scale_inv"] = ones.clone()
    return state


def _padded(x: torch.Tensor, numel: int) -> torch.Tensor:
    blocks = padded_blocks(numel)
    if blocks * BLOCK == numel:
        return x
    out = x.new_zeros(blocks * BLOCK)
    out[:numel] = x
    return out


def form(state: dict) -> str:
    """The format a moment state is in: "float32" or one of SECOND_MOMENTS."""
    v = state["v"]
    if state["m"].dtype == torch.float32:
        return "float32"
    return {torch.bfloat16: "bf16", _E4M3: "sqrt_e4m3", _E5M2: "e5m2"}[v.dtype]


def read(state: dict, numel: int):
    """(m, v) as flat float32 tensors of `numel` values (new tensors, or the float32 state)."""
    kind = form(state)
    if kind == "float32":
        return state["m"], state["v"]
    m = _decode(state["m"], state["m_scale_inv"])[:numel]
    if kind == "bf16":
        return m, state["v"].float()
    v = _decode(state["v"], state["v_scale_inv"])[:numel]
    return m, (v.mul_(v) if kind == "sqrt_e4m3" else v)


def write(state: dict, m: torch.Tensor, v: torch.Tensor, sqrt_v: torch.Tensor) -> None:
    """Store new moments (flat float32 m, v and sqrt(v)) into `state` in its format."""
    second_moment = form(state)
    if second_moment == "float32":
        state["m"].copy_(m)
        state["v"].copy_(v)
        return
    numel = m.numel()
    data, scale_inv = _encode(_padded(m, numel), _E4M3)
    state["m"].copy_(data)
    state["m_scale_inv"].copy_(scale_inv)
    if second_moment == "bf16":
        state["v"].copy_(v)
        return
    if second_moment == "sqrt_e4m3":
        data, scale_inv = _encode(_padded(sqrt_v, numel), _E4M3)
    else:
        data, scale_inv = _encode(_padded(v, numel), _E5M2)
    state["v"].copy_(data)
    state["v_scale_inv"].copy_(scale_inv)


def state_bytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values()
               if isinstance(t, torch.Tensor) and t.dim())
