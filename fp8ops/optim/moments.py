"""How FP8AdamW stores Adam's moments (the arithmetic and the block layout:
fp8ops/ops/adamw.py and docs/numerics.md, "FP8AdamW").

- m (the first moment): E4M3 in blocks of 128 values with a float32 scale each.
- v (the second moment), one of SECOND_MOMENTS:
  - "sqrt_e4m3": sqrt(v) in E4M3 blocks. The square root halves v's dynamic range in log terms
    (the range of the gradients themselves, which a block's E4M3 range holds), and the step
    reads sqrt(v) only, so it gets E4M3's precision directly. A square root is correctly
    rounded on every device, which keeps the optimizer bit-exact across them (a range
    expansion x^k with a general k would go through pow, which is not).
  - "e5m2": v in E5M2 blocks (a wider range, one mantissa bit less).
  - "bf16": v in bfloat16, round to nearest even, no scale (2 bytes a value).
A tensor of fewer than `min_fp8_numel` values keeps both moments in float32 ("float32": biases,
norm gains; the bytes are negligible and their updates sensitive).
"""
from __future__ import annotations

import torch

from ..ops import adamw

SECOND_MOMENTS = ("sqrt_e4m3", "e5m2", "bf16")
_V_DTYPE = {"sqrt_e4m3": adamw.E4M3, "e5m2": adamw.E5M2}


def empty_state(numel: int, second_moment: str, fp8: bool, device) -> dict:
    """Zero moments for a tensor of `numel` values."""
    if not fp8:
        zeros = torch.zeros(numel, dtype=torch.float32, device=device)
        return {"m": zeros, "v": zeros.clone()}
    blocks = adamw.blocks_of(numel)
    ones = torch.ones(blocks, 1, dtype=torch.float32, device=device)
    state = {"m": torch.zeros(blocks, adamw.BLOCK, dtype=adamw.E4M3, device=device),
             "m_scale_inv": ones}
    if second_moment == "bf16":
        state["v"] = torch.zeros(numel, dtype=torch.bfloat16, device=device)
        state["v_scale_inv"] = torch.empty(0, dtype=torch.float32, device=device)
    else:
        state["v"] = torch.zeros(blocks, adamw.BLOCK, dtype=_V_DTYPE[second_moment],
                                 device=device)
        state["v_scale_inv"] = ones.clone()
    return state


def form(state: dict) -> str:
    """The format a moment state is in: "float32" or one of SECOND_MOMENTS."""
    if state["m"].dtype == torch.float32:
        return "float32"
    return {torch.bfloat16: "bf16", adamw.E4M3: "sqrt_e4m3",
            adamw.E5M2: "e5m2"}[state["v"].dtype]


def read(state: dict, numel: int):
    """(m, v) as flat float32 tensors of `numel` values (new tensors, or the float32 state)."""
    if form(state) == "float32":
        return state["m"], state["v"]
    return (adamw.decode(state["m"], state["m_scale_inv"], numel),
            adamw.read_v(state["v"], state["v_scale_inv"], numel))


def write(state: dict, m: torch.Tensor, v: torch.Tensor) -> None:
    """Store moments (flat float32 m and v) into `state` in its format."""
    if form(state) == "float32":
        state["m"].copy_(m)
        state["v"].copy_(v)
        return
    adamw.store_moments(state["m"], state["m_scale_inv"], state["v"], state["v_scale_inv"], m, v)


def state_bytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values()
               if isinstance(t, torch.Tensor) and t.dim())
