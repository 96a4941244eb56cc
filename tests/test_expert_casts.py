"""fp8ops/ops/expert_casts.py: the casts of an experts' weight [E, out, in] equal the dense casts
of each expert, bit for bit (the ops' CPU kernels are that loop; tests/test_expert_casts_gpu.py
holds the CUDA kernel to it), with any shape, empty ones included, and under torch.autocast."""
import pytest
import torch

import fp8ops  # noqa: F401  (defines torch.ops.fp8ops.*)
from fp8ops.ops import expert_casts
from fp8ops.ops.expert_casts import (experts_amax, quantize_experts_blockwise,
                                     quantize_experts_current, quantize_experts_scaled,
                                     transpose_experts)

_ops = torch.ops.fp8ops
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def _same(a, b):
    """Equal dtype, shape and bytes (a NaN equals the same NaN)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _experts(n, k=200, dtype=torch.float32):
    w = torch.randn(3, n, k, generator=torch.Generator().manual_seed(0))
    w = w * torch.tensor([1e-3, 1.0, 1e3]).view(3, 1, 1)
    w[1] = 0  # an all-zero expert: scale 1
    return w.to(dtype)


@pytest.mark.parametrize("n", [136, 256], ids=["experts_split_blocks", "whole_blocks"])
def test_expert_casts_are_the_dense_casts_per_expert(n):
    w = _experts(n)
    data, data_t, scale, scale_inv = quantize_experts_current(w, E4, 1.0, False)
    bd, bs, bd_t, bs_t = quantize_experts_blockwise(w, E4, True)
    for g in range(3):
        d, d_t, s, s_inv, _ = _ops.quantize_current(w[g], E4, 1.0, False, True)
        for got, want in ((data[g], d), (data_t[g], d_t), (scale[g], s), (scale_inv[g], s_inv)):
            _same(got, want)
        r, rs = _ops.quantize_blockwise(w[g], E4, 128, 128, True)
        _same(bd[g], r)
        _same(bs[g], rs)
        _same(bd_t[g], r.t().contiguous())
        _same(bs_t[g], rs.t())
    assert scale[1] == 1
    given = torch.tensor([3e3, 7.0, 0.25])
    sd, sd_t, amax = quantize_experts_scaled(w, given, E5)
    for g in range(3):
        d, d_t, a = _ops.quantize(w[g], given[g], E5, True)
        for got, want in ((sd[g], d), (sd_t[g], d_t), (amax[g], a)):
            _same(got, want)
    with pytest.raises(ValueError, match="one per expert"):
        quantize_experts_scaled(w, torch.ones(2), E5)
    # without the transposed copies (an FSDP2 shard's cast): the same bytes, scales and amaxes
    nd, nd_t, n_scale, n_scale_inv = quantize_experts_current(w, E4, 1.0, False, transpose=False)
    for got, want in ((nd, data), (n_scale, scale), (n_scale_inv, scale_inv)):
        _same(got, want)
    nb, nbs, nb_t, _ = quantize_experts_blockwise(w, E4, True, transpose=False)
    _same(nb, bd)
    _same(nbs, bs)
    ns, ns_t, n_amax = quantize_experts_scaled(w, given, E5, transpose=False)
    _same(ns, sd)
    _same(n_amax, amax)
    assert nd_t.numel() == nb_t.numel() == ns_t.numel() == 0
    _same(experts_amax(w), amax)
    _same(transpose_experts(data), data_t)
    _same(transpose_experts(bd), bd_t)


@pytest.mark.parametrize("shape", [(0, 8, 16), (2, 0, 16), (2, 8, 0)], ids=str)
def test_empty_experts(shape):
    """No experts, or experts with no rows or columns: the shapes the ops' fakes give."""
    w = torch.zeros(shape)
    e, n, k = shape
    data, data_t, scale, scale_inv = quantize_experts_current(w, E4, 1.0, False)
    assert data.shape == (e, n, k) and data_t.shape == (e, k, n) and data.dtype == E4
    assert scale.shape == scale_inv.shape == (e,) and torch.all(scale == 1)
    sd, sd_t, amax = quantize_experts_scaled(w, torch.ones(e), E5, transpose=False)
    assert sd.shape == (e, n, k) and sd_t.numel() == 0 and amax.shape == (e,)
    assert torch.all(amax == 0)
    bd, bs, bd_t, bs_t = quantize_experts_blockwise(w, E4, True)
    assert bd.shape == (e, n, k) and bd_t.shape == (e, k, n)
    assert bs.shape == (e, -(-n // 128), -(-k // 128)) and bs_t.shape == (e, bs.shape[2], bs.shape[1])
    assert experts_amax(w).shape == (e,)


def _op_samples(nan=False):
    w = _experts(136, 40)
    if nan:  # a NaN expert: its amax and scale as the dense op's
        w[2, 3, 5] = float("nan")
    return {
        "amax_experts": [(w,), (w.bfloat16(),)],
        "quantize_experts_current": [(w, E4, 1.0, False, True), (w.half(), E5, 2.0, True, False)],
        "quantize_experts_scaled": [(w, torch.tensor([3.0, 1.0, 0.5]), E4, True),
                                    (w.bfloat16(), torch.tensor([1.0, 2.0, 4.0]), E5, False)],
    }


@pytest.mark.parametrize("name", sorted(expert_casts.SCHEMAS))
def test_the_ops_are_the_loop_and_pass_opcheck(name):
    loop = expert_casts._LOOPS[name]
    for args in _op_samples(nan=True)[name]:
        got, want = getattr(_ops, name)(*args), loop(*args)
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        for g, x in zip(got, want):
            _same(g, x)
    for args in _op_samples()[name]:  # (opcheck compares outputs with ==: no NaN)
        torch.library.opcheck(getattr(_ops, name).default, args)


def test_the_loop_takes_the_nan_as_the_dense_op_does():
    w = _experts(136, 40)
    w[2, 3, 5] = float("nan")
    amax = experts_amax(w)
    assert amax[0] > 0 and amax[1] == 0 and torch.isnan(amax[2])
    _, _, scale, _ = quantize_experts_current(w, E4, 1.0, False)
    _same(scale[2], _ops.quantize_current(w[2], E4, 1.0, False, False)[2])


@pytest.mark.parametrize("name, args", [
    ("quantize_experts_current", (E4, 1.0, False)),
    ("quantize_experts_scaled", (torch.full((2,), 3.0), E4)),
    ("quantize_experts_blockwise", (E4, False)),
    ("experts_amax", ())])
def test_expert_casts_under_autocast(name, args):
    """FSDP2 casts the experts' shards in its pre-forward hook, inside the user's autocast."""
    w = torch.randn(2, 130, 140, generator=torch.Generator().manual_seed(1)).bfloat16()
    want = getattr(expert_casts, name)(w, *args)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = getattr(expert_casts, name)(w, *args)
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for g, x in zip(got, want):
        _same(g, x)
