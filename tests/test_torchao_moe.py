"""examples/torchao_moe.py: the demo's torchao recipes compute, expert by expert, what a plain
reference built from torchao's own plain-torch quantizers computes: torchao's FP8 row-wise
grouped GEMM (forward, dgrad, wgrad) with bf16 outputs, and the experts' forward around it;
and the MXFP8 recipe is torchao's emulated grouped GEMM run on each expert alone."""
from __future__ import annotations

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import torchao_moe  # noqa: E402
from moe import Experts  # noqa: E402
from torchao.prototype.moe_training.utils import (  # noqa: E402
    _quantize_then_scaled_grouped_mm, torch_to_float8_per_group_colwise,
    torch_to_float8_per_group_rowwise)

E4M3 = torch.float8_e4m3fn


def _one_group(x, quantizer, along):
    """x [R, C] cast by torchao's per-group `quantizer` with a single group, then dequantized:
    one power-of-two scale per row (rowwise: amax over the C columns) or per column."""
    size = x.shape[1] if quantizer is torch_to_float8_per_group_rowwise else x.shape[0]
    fp8, scales = quantizer(x, torch.tensor([size], dtype=torch.int32), E4M3,
                            round_scales_to_power_of_2=True)
    return fp8.float() / (scales[:, None] if along == "rows" else scales[None, :])


def per_token(x):  # a scale per row, over its columns
    return _one_group(x, torch_to_float8_per_group_rowwise, "rows")


def per_column(x):  # a scale per column, over its rows
    return _one_group(x, torch_to_float8_per_group_colwise, "columns")


class ReferenceLinear(torch.autograd.Function):
    """One expert's y = x @ w.T as torchao's FP8 row-wise recipe computes it: x per token,
    w per output feature (forward); dy per token, w per input feature (dgrad); dy and x per
    column over the expert's tokens (wgrad); each product in float32, rounded to bf16."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return (per_token(x) @ per_column(w.t())).bfloat16()

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy = dy.float()
        return (per_token(dy) @ per_column(w)).bfloat16(), \
            (per_column(dy).t() @ per_column(x)).bfloat16()


def _wide(*shape, seed):
    """Gaussians times 2^-8 .. 2^8 by row and again by column. With power-of-two scales, E4M3
    rounds a value alike whatever its scale unless it falls among the subnormals (below about
    2^-14 of its amax): values this wide do, so a scale along the wrong axis changes casts."""
    g = torch.Generator().manual_seed(seed)
    rows = 2.0 ** torch.randint(-8, 9, (*shape[:-1], 1), generator=g)
    cols = 2.0 ** torch.randint(-8, 9, (shape[-1],), generator=g)
    return torch.randn(*shape, generator=g) * rows * cols


def test_fp8_rowwise_grouped_mm_is_torchao_per_expert():
    """Forward, dgrad and wgrad of uneven groups (not multiples of 16, one empty) equal the
    per-expert reference bit for bit, and are not the unquantized products."""
    sizes, n_in, n_out = [5, 0, 11, 7], 32, 48
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    x = _wide(sum(sizes), n_in, seed=1).requires_grad_()
    w = _wide(len(sizes), n_out, n_in, seed=2).requires_grad_()
    dy = _wide(sum(sizes), n_out, seed=3).bfloat16()
    out = torchao_moe.fp8_rowwise_grouped_mm(x, w.transpose(-2, -1), offsets)
    out.backward(dy)
    assert out.dtype == torch.bfloat16
    xs, dys = x.detach().split(sizes), dy.split(sizes)
    want, want_dx, want_dw = [], [], torch.zeros_like(w)
    for e, (xe, dye) in enumerate(zip(xs, dys)):
        if not len(xe):
            continue  # no token: no output rows, a zero weight gradient
        xe, we = xe.clone().requires_grad_(), w.detach()[e].clone().requires_grad_()
        ye = ReferenceLinear.apply(xe, we)
        ye.backward(dye)
        want.append(ye)
        want_dx.append(xe.grad)
        want_dw[e] = we.grad
    assert torch.equal(out, torch.cat(want))
    assert torch.equal(x.grad, torch.cat(want_dx))
    assert torch.equal(w.grad, want_dw)
    assert not w.grad[1].any()  # the expert without tokens
    plain = torch._grouped_mm(x.detach(), w.detach().transpose(-2, -1), offs=offsets)
    assert not torch.equal(out, plain.bfloat16())


def _experts_and_routing(seed):
    torch.manual_seed(seed)
    mod = Experts(num_experts=4, d_model=32, hidden=64, n_layer=1)
    tokens = 24
    hidden = torch.randn(tokens, 32)
    index = torch.randint(0, 4, (tokens, 2))
    index[index == 2] = 3  # expert 2 gets no token
    index[:, 1] = torch.where(index[:, 1] == index[:, 0], (index[:, 0] + 1) % 2, index[:, 1])
    weights = torch.rand(tokens, 2)
    return mod, hidden, index, weights


def _run(mod, hidden, index, weights):
    """The experts' output and the gradients of their inputs and weights, for a fixed
    upstream gradient."""
    hidden, weights = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
    out = mod(hidden, index, weights)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    grads = [hidden.grad, weights.grad, mod.up_proj.grad, mod.down_proj.grad]
    mod.zero_grad(set_to_none=True)
    return [out.detach()] + grads


def _expert_loop(mod, linear):
    """Experts.forward with each expert's two products done by linear(x, w[e])."""
    def forward(hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(mod.num_experts):
            token, slot = torch.where(top_k_index == e)
            if token.numel() == 0:
                continue
            h = mod.act_fn(linear(hidden_states[token], mod.up_proj[e]).float())
            y = linear(h, mod.down_proj[e]).float() * top_k_weights[token, slot, None]
            out.index_add_(0, token, y)
        return out
    return forward


def test_torchao_experts_are_the_reference_loop():
    """The torchao recipe's experts forward (tokens sorted by expert, one grouped GEMM per
    projection) and its backward equal the experts' own loop with the reference GEMMs."""
    mod, hidden, index, weights = _experts_and_routing(0)
    plain = _run(mod, hidden, index, weights)
    assert torchao_moe.TorchaoExperts("torchao").apply(mod) == 1
    got = _run(mod, hidden, index, weights)
    mod.forward = _expert_loop(mod, ReferenceLinear.apply)
    want = _run(mod, hidden, index, weights)
    names = ["output", "d hidden", "d weights", "d up_proj", "d down_proj"]
    for name, g, w, p in zip(names, got, want, plain):
        assert torch.equal(g, w), name
        assert not torch.equal(g, p), name  # FP8 ran
    assert not got[4][2].any()  # expert 2 had no token


def test_torchao_mxfp8_experts_are_torchao_per_expert():
    """The MXFP8 recipe is torchao's emulated grouped GEMM: with each expert's tokens padded
    to 32, the experts' output and gradients are those of torchao's function called on one
    expert at a time."""
    mod, hidden, index, weights = _experts_and_routing(1)
    torchao_moe.TorchaoExperts("torchao_mxfp8").apply(mod)
    got = _run(mod, hidden, index, weights)

    def torchao_alone(x, w):  # one group: all of x
        ends = torch.tensor([x.shape[0]], dtype=torch.int32)
        return _quantize_then_scaled_grouped_mm(x, w.t()[None], torchao_moe.mxfp8_config(),
                                                offs=ends)
    mod.forward = _expert_loop(mod, torchao_alone)
    want = _run(mod, hidden, index, weights)
    for name, g, w in zip(["output", "d hidden", "d weights", "d up_proj", "d down_proj"],
                          got, want):
        assert torch.equal(g, w), name
