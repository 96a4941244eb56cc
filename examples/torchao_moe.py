"""torchao's FP8 grouped-GEMM recipes for the experts of the demo's --moe variant, on the CPU:
`train_gpt.py --moe --recipes torchao` (FP8 row-wise) and `torchao_mxfp8` (MXFP8).

torchao 0.18.0 (torchao.prototype.moe_training) trains MoE experts with differentiable grouped
GEMMs over tokens sorted by expert: A [M, K] row-major, B_t [E, K, N] (the experts' [E, out, in]
weights seen transposed, as examples/moe.py holds them) and int32 cumulative-end offsets. Here
each experts module (examples/moe.Experts) gets a forward that sorts its (token, expert) pairs
by expert and runs both projections through such a GEMM. Nothing else changes: the router,
attention and LM head stay the baseline's float32 Linears, and no fp8ops layer takes part.

torchao's FP8 row-wise recipe (fp8_grouped_mm.py, `_Float8GroupedMM`) casts to E4M3 with float32
scales 448 / max(amax, 1e-12) rounded down to a power of two, the scaled values clamped to +-448
and rounded to nearest:
    forward  out = A @ B_t   A per token (amax over K); B_t per expert and output feature (over K)
    dgrad     dA = dY @ B    dY per token (over N); B per expert and input feature (over N)
    wgrad     dB = dY^T @ A  dY and A per expert and column (over that expert's tokens)
then each GEMM is torch._scaled_grouped_mm with the scales' reciprocals and use_fast_accum=True,
writing out_dtype (bfloat16, Float8TrainingOpConfig's default).

What is torchao's here: every cast (amax, scale, power-of-two rounding, clamp, conversion to
E4M3) is a call of torchao's own functions: torchao.float8.float8_utils.tensor_to_scale and
to_fp8_saturated for the per-token and per-expert casts (the three ops that its fused Triton
kernels triton_fp8_rowwise_2d_scale_and_cast and triton_fp8_colwise_3d_scale_and_cast replace,
as their docstrings say), and the plain-torch quantizers of moe_training.utils,
torch_to_3d_rowwise_float8_transpose_rhs (dgrad's B) and torch_to_float8_per_group_colwise
(wgrad's dY and A), for the casts of its Triton kernels triton_fp8_rowwise_3d_transpose_rhs and
triton_fp8_per_group_colwise_scales_dual.

What is the CPU stand-in: `_Float8GroupedMM` itself cannot run on a CPU (its casts are Triton GPU
kernels, and torch has no CPU _scaled_grouped_mm), so `Float8RowwiseGroupedMM` below is its
forward and backward with the casts above, each torch._scaled_grouped_mm replaced by the FP8
values times their scales' reciprocals in float32 (exact: the scales are powers of two),
torch._grouped_mm in float32 and the result rounded to bfloat16. That leaves one difference from
a GPU: the float32 sums run in the CPU's order, where the FP8 tensor cores' fast accumulation
keeps fewer bits. On a GPU every expert's token count must be a multiple of 16 (padded with zero
rows, which change no scale); the stand-in takes any count, and an expert without tokens gets a
zero weight gradient, as from the GPU's GEMM (torchao's per-group quantizer fails on an empty
group, so such groups are left out of wgrad's casts).

`torchao_mxfp8` runs torchao's MXFP8 recipe by torchao alone, unchanged:
_quantize_then_scaled_grouped_mm with MXFP8TrainingOpConfig(kernel_preference=EMULATED,
pad_token_groups_for_grouped_mm=True), its other fields at their defaults (RCEIL scales, bfloat16
output, wgrad in MXFP8). Its emulation casts with to_mx (E4M3 in blocks of 32 along each GEMM's
inner dimension, E8M0 scales), dequantizes to bfloat16 and calls torch._grouped_mm, which has a
CPU kernel. The padding (each expert's tokens to a multiple of 32) keeps wgrad's blocks of 32
tokens within one expert, as the GPU kernels need; without it the emulation casts blocks that
straddle two experts and wants a token count that divides by 32.

torchao is imported only when one of these recipes runs: the demo's other recipes run without it.
"""
from __future__ import annotations

import functools
import importlib.util
from typing import Callable, Optional

import torch

from moe import Experts

E4M3 = torch.float8_e4m3fn
OUT_DTYPE = torch.bfloat16  # torchao's default out_dtype for both recipes
RECIPES = ("torchao", "torchao_mxfp8")
INSTALL = "pip install --no-deps torchao==0.18.0"


def missing() -> Optional[str]:
    """Why the torchao recipes cannot run here, or None when torchao is installed."""
    if importlib.util.find_spec("torchao") is None:
        return f"torchao is not installed ({INSTALL})"
    return None


# ---------------------------------------------------------------------------------------------
# FP8 row-wise: torchao's casts, the CPU stand-in for torch._scaled_grouped_mm
# ---------------------------------------------------------------------------------------------
def cast_axiswise(x: torch.Tensor, dim: int):
    """x in E4M3 with a power-of-two scale per slice along `dim` (torchao's tensor_to_scale and
    to_fp8_saturated): (fp8 values, float32 scales, `dim` kept as size 1)."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated
    scales = tensor_to_scale(x, E4M3, scaling_granularity=ScalingGranularity.AXISWISE,
                             axiswise_dim=dim, round_scales_to_power_of_2=True)
    return to_fp8_saturated(x.to(torch.float32) * scales, E4M3), scales


def cast_per_expert_colwise(x: torch.Tensor, offsets: torch.Tensor):
    """x [M, D] in E4M3 with a power-of-two scale per expert and column (torchao's
    torch_to_float8_per_group_colwise): (fp8 values, scales [M, D], each row its expert's).
    Experts without tokens are left out of the call, which fails on an empty group."""
    from torchao.prototype.moe_training.utils import torch_to_float8_per_group_colwise
    sizes = torch.diff(offsets, prepend=offsets.new_zeros(1))
    kept = sizes > 0
    fp8, scales = torch_to_float8_per_group_colwise(x, offsets[kept], E4M3,
                                                    round_scales_to_power_of_2=True)
    rows = scales.view(-1, x.shape[1]).repeat_interleave(sizes[kept].long(), dim=0)
    return fp8, rows


def scaled_grouped_mm(a_fp8, a_scales, b_fp8, b_scales, offsets) -> torch.Tensor:
    """Stands in for torch._scaled_grouped_mm(a, b, 1 / a_scales, 1 / b_scales, offsets,
    out_dtype=bfloat16): a float32 grouped GEMM of the dequantized values, rounded to bf16."""
    a = a_fp8.to(torch.float32) * a_scales.reciprocal()
    b = b_fp8.to(torch.float32) * b_scales.reciprocal()
    return torch._grouped_mm(a, b, offs=offsets).to(OUT_DTYPE)


class Float8RowwiseGroupedMM(torch.autograd.Function):
    """torchao's _Float8GroupedMM on the CPU: out [M, N] = a [M, K] @ b_t[e] [K, N] for the
    rows of each expert e (offsets: int32 cumulative ends, the last one M), its forward, dgrad
    and wgrad in FP8 row-wise as the module docstring says; outputs and gradients in bf16."""

    @staticmethod
    def forward(ctx, a, b_t, offsets):
        ctx.save_for_backward(a, b_t, offsets)
        return scaled_grouped_mm(*cast_axiswise(a, -1), *cast_axiswise(b_t, -2), offsets)

    @staticmethod
    def backward(ctx, grad_out):
        from torchao.prototype.moe_training.utils import torch_to_3d_rowwise_float8_transpose_rhs
        a, b_t, offsets = ctx.saved_tensors
        # b [E, N, K], a scale per expert and input feature (its amax over N)
        b_fp8, b_scales = torch_to_3d_rowwise_float8_transpose_rhs(
            b_t, E4M3, round_scales_to_power_of_2=True)
        grad_a = scaled_grouped_mm(*cast_axiswise(grad_out, -1), b_fp8, b_scales, offsets)
        g_fp8, g_scales = cast_per_expert_colwise(grad_out, offsets)
        a_fp8, a_scales = cast_per_expert_colwise(a, offsets)
        grad_b = scaled_grouped_mm(g_fp8.t(), g_scales.t(), a_fp8, a_scales, offsets)  # [E, N, K]
        return grad_a, grad_b.transpose(-2, -1), None


def fp8_rowwise_grouped_mm(a, b_t, offsets) -> torch.Tensor:
    return Float8RowwiseGroupedMM.apply(a, b_t, offsets)


# ---------------------------------------------------------------------------------------------
# MXFP8: torchao's own emulated recipe
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def mxfp8_config():
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
    from torchao.quantization.quantize_.common import KernelPreference
    return MXFP8TrainingOpConfig(kernel_preference=KernelPreference.EMULATED,
                                 pad_token_groups_for_grouped_mm=True)


def mxfp8_grouped_mm(a, b_t, offsets) -> torch.Tensor:
    from torchao.prototype.moe_training.utils import _quantize_then_scaled_grouped_mm
    return _quantize_then_scaled_grouped_mm(a, b_t, mxfp8_config(), offs=offsets)


GROUPED_MM = {"torchao": fp8_rowwise_grouped_mm, "torchao_mxfp8": mxfp8_grouped_mm}


# ---------------------------------------------------------------------------------------------
# the experts' forward and the demo's recipe object
# ---------------------------------------------------------------------------------------------
def experts_forward(mod: Experts, grouped_mm: Callable, hidden_states, top_k_index,
                    top_k_weights):
    """Experts.forward with both projections as grouped GEMMs: the (token, slot) pairs sorted
    by expert, up, GELU, down, the routing weights, each token's k results summed. The GEMMs'
    bf16 outputs go back to the activations' dtype (float32 on the CPU), as the other layers
    run."""
    tokens, k = top_k_index.shape
    experts = top_k_index.reshape(-1)
    order = torch.argsort(experts, stable=True)
    offsets = torch.bincount(experts, minlength=mod.num_experts).cumsum(0).to(torch.int32)
    x = hidden_states[order // k]
    h = mod.act_fn(grouped_mm(x, mod.up_proj.transpose(-2, -1), offsets).to(x.dtype))
    y = grouped_mm(h, mod.down_proj.transpose(-2, -1), offsets).to(x.dtype)
    y = y * top_k_weights.reshape(-1)[order].unsqueeze(-1)
    unsorted = torch.empty_like(y).index_copy_(0, order, y)  # back to (token, slot) order
    return unsorted.view(tokens, k, -1).sum(dim=1)


class TorchaoExperts:
    """The demo's `torchao` / `torchao_mxfp8` recipe: apply(model) gives every Experts module of
    the model torchao's grouped GEMMs (the parameters unchanged); the rest of the model stays in
    high precision."""

    def __init__(self, name: str):
        if name not in GROUPED_MM:
            raise ValueError(f"unknown torchao recipe {name!r}; choose from {RECIPES}")
        self.name = name

    def apply(self, model: torch.nn.Module) -> int:
        """Give the experts modules their torchao forward; returns how many there were."""
        import torchao.prototype.moe_training.utils  # noqa: F401  (its import, seconds, untimed)
        found = [m for m in model.modules() if isinstance(m, Experts)]
        for m in found:
            m.forward = functools.partial(experts_forward, m, GROUPED_MM[self.name])
        return len(found)

    def __repr__(self) -> str:
        return f"TorchaoExperts({self.name!r})"
