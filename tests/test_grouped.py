"""Grouped (mixture-of-experts) FP8 ops and layers: the emulation is the per-expert loop of the
dense ops bit for bit, offsets are checked, every op passes opcheck, and fp8ops.grouped_linear /
FP8GroupedLinear train like a loop of fp8ops.linear over the experts."""
import pytest
import torch

import fp8ops
from fp8ops.nn.grouped import ExpertScalingState

_ops = torch.ops.fp8ops
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2

# group sizes: ragged, empty groups (first, middle, last), one group, every token in one expert,
# groups past 128 rows (several 1x128 blocks along M), and rows after the last group
SIZES = {
    "ragged": [5, 0, 17, 3],
    "empty_ends": [0, 9, 0, 0, 6, 0],
    "single": [12],
    "one_expert": [0, 0, 21, 0],
    "long": [130, 1, 140],
}


def _offsets(sizes):
    return torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)


def _bytes(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(_bytes(a), _bytes(b))


def _fp8(shape, dtype=E4, scale=8.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).clamp(-448, 448).to(dtype)


def _bounds(sizes):
    ends = torch.tensor(sizes).cumsum(0).tolist()
    return list(zip([0] + ends[:-1], ends))


# ----------------------------------------------------------------------------------------------
# the ops against the dense ops, group by group
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", sorted(SIZES))
@pytest.mark.parametrize("rowwise", [False, True])
def test_grouped_gemm_is_the_dense_gemm_per_group(case, rowwise):
    sizes = SIZES[case]
    E, K, N = len(sizes), 48, 24
    M = sum(sizes) + 2  # two rows that belong to no group: zeros
    a, b = _fp8((M, K)), _fp8((E, N, K), seed=1)
    sa = torch.rand(M, 1) + 0.1 if rowwise else torch.rand(E) + 0.1
    sb = torch.rand(E, N) + 0.1 if rowwise else torch.rand(E) + 0.1
    bias = torch.randn(E, N)
    y = _ops.grouped_gemm(a, b, _offsets(sizes), sa, sb, bias, torch.bfloat16)
    for g, (lo, hi) in enumerate(_bounds(sizes)):
        ref = _ops.gemm(a[lo:hi], b[g], sa[lo:hi] if rowwise else sa[g],
                        sb[g][None] if rowwise else sb[g], bias[g], torch.bfloat16)
        _same(y[lo:hi], ref)
    assert torch.equal(y[sum(sizes):], torch.zeros(2, N, dtype=torch.bfloat16))


@pytest.mark.parametrize("case", sorted(SIZES))
def test_grouped_gemm_blockwise_is_the_dense_gemm_per_group(case):
    sizes = SIZES[case]
    E, K, N = len(sizes), 200, 136
    M = sum(sizes) + 1
    a, b = _fp8((M, K)), _fp8((E, N, K), seed=1)
    sa = torch.rand(M, 2) + 0.1
    sb = torch.rand(E, 2, 2) + 0.1
    y = _ops.grouped_gemm_blockwise(a, b, _offsets(sizes), sa, sb, None, torch.float32)
    for g, (lo, hi) in enumerate(_bounds(sizes)):
        _same(y[lo:hi], _ops.gemm_blockwise(a[lo:hi], b[g], sa[lo:hi], sb[g], None,
                                            torch.float32))
    assert not y[sum(sizes):].any()


@pytest.mark.parametrize("case", sorted(SIZES))
def test_grouped_wgrad_is_the_dense_gemm_per_group(case):
    sizes = SIZES[case]
    E, K, N = len(sizes), 40, 24
    M = sum(sizes)
    dy_t, x_t = _fp8((N, M), E5), _fp8((K, M), seed=1)
    sa, sb = torch.rand(E) + 0.1, torch.rand(E) + 0.1
    dw = _ops.grouped_gemm_wgrad(dy_t, x_t, _offsets(sizes), sa, sb, torch.bfloat16)
    assert dw.shape == (E, N, K)
    for g, (lo, hi) in enumerate(_bounds(sizes)):
        ref = _ops.gemm(dy_t[:, lo:hi].contiguous(), x_t[:, lo:hi].contiguous(), sa[g], sb[g],
                        None, torch.bfloat16)
        _same(dw[g], ref)
        if hi == lo:
            assert not dw[g].any()  # an expert with no tokens has a zero gradient


@pytest.mark.parametrize("case", sorted(SIZES))
@pytest.mark.parametrize("power_of_two", [False, True])
def test_grouped_casts_are_the_dense_casts_per_group(case, power_of_two):
    sizes = SIZES[case]
    M, K = sum(sizes), 200
    x = torch.randn(M, K) * torch.logspace(-3, 3, M).unsqueeze(1)  # groups of different ranges
    offsets = _offsets(sizes)
    data, data_t, scale, scale_inv = _ops.quantize_current_grouped(x, offsets, E4, 1.5,
                                                                   power_of_two, True)
    bd, bs, bd_t, bs_t = _ops.quantize_blockwise_grouped(x, offsets, E5, power_of_two)
    block = 0
    for g, (lo, hi) in enumerate(_bounds(sizes)):
        d, d_t, s, s_inv, _ = _ops.quantize_current(x[lo:hi], E4, 1.5, power_of_two, True)
        _same(data[lo:hi], d)
        _same(data_t[:, lo:hi], d_t)
        _same(scale[g], s)
        _same(scale_inv[g], s_inv)
        r, rs, c, cs, _ = _ops.quantize_blockwise_pair(x[lo:hi], E5, power_of_two)
        _same(bd[lo:hi], r)
        _same(bs[lo:hi], rs)
        _same(bd_t[:, lo:hi], c)
        _same(bs_t[:, block:block + cs.shape[1]], cs)
        block += cs.shape[1]


# the casts work through x in chunks of rows: a small chunk makes many, cutting through groups
CHUNKS = [None, 500]


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt", [E4, E5], ids=str)
def test_grouped_current_cast_special_values_and_rows_past_the_groups(dtype, fmt, chunk,
                                                                     monkeypatch):
    """NaN and inf stay in their own group (NaN wins the amax, so that group keeps scale 1;
    inf likewise), huge and tiny groups saturate or keep their range, and rows past the last
    group are zero bytes whatever they hold."""
    if chunk:
        monkeypatch.setattr("fp8ops.ops.emulation_grouped.CHUNK", chunk)
    sizes = [4, 0, 5, 3, 6]
    x = torch.randn(sum(sizes) + 3, 160)
    x[1, 7] = float("nan")         # group 0
    x[5, 2] = float("inf")         # group 2
    x[9:12] *= 1e30                # group 3: overflows the margin's product
    x[12:18] *= 1e-30              # group 4: subnormal range
    x[-2, 0] = float("nan")        # past the last group
    x = x.to(dtype)
    offsets = _offsets(sizes)
    data, data_t, scale, scale_inv = _ops.quantize_current_grouped(x, offsets, fmt, 2.0, False,
                                                                   True)
    for g, (lo, hi) in enumerate(_bounds(sizes)):
        d, d_t, s, s_inv, _ = _ops.quantize_current(x[lo:hi], fmt, 2.0, False, True)
        _same(data[lo:hi], d)
        _same(data_t[:, lo:hi], d_t)
        _same(scale[g], s)
        _same(scale_inv[g], s_inv)
    end = sum(sizes)
    assert not data[end:].view(torch.uint8).any() and not data_t[:, end:].view(torch.uint8).any()
    assert scale[0] == 1 and scale[1] == 1 and scale[2] == 1


@pytest.mark.parametrize("case", sorted(SIZES))
@pytest.mark.parametrize("transpose", [False, True])
def test_grouped_scaled_cast_is_the_dense_cast_per_group(case, transpose):
    sizes = SIZES[case]
    M, K = sum(sizes) + 2, 72  # two rows that belong to no group: zero bytes
    x = torch.randn(M, K) * torch.logspace(-3, 3, M).unsqueeze(1)
    x[0, 0] = float("nan") if sizes[0] else 0.0  # a non-finite amax stays that group's
    scale = torch.logspace(-2, 4, len(sizes))
    data, data_t, amax = _ops.quantize_scaled_grouped(x, _offsets(sizes), scale, E4, transpose)
    assert amax.dtype == torch.float32 and amax.shape == (len(sizes),)
    for g, (lo, hi) in enumerate(_bounds(sizes)):
        d, d_t, a = _ops.quantize(x[lo:hi], scale[g], E4, transpose)
        _same(data[lo:hi], d)
        if transpose:
            _same(data_t[:, lo:hi], d_t)
        # (bits: NaN is not equal to itself); an empty group: 0, the dense amax of no values
        assert torch.equal(amax[g].view(torch.int32), a.view(torch.int32))
    assert not data[sum(sizes):].view(torch.uint8).any()
    assert data_t.shape == ((K, M) if transpose else (0,))


def test_grouped_scaled_cast_checks_its_scales():
    x, offsets = torch.randn(6, 32), torch.tensor([2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="scale must have shape"):
        _ops.quantize_scaled_grouped(x, offsets, torch.ones(3), E4)
    with pytest.raises(ValueError, match="non-decreasing"):
        _ops.quantize_scaled_grouped(x, torch.tensor([4, 2], dtype=torch.int32), torch.ones(2),
                                     E4)


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("power_of_two", [False, True])
def test_grouped_blockwise_cast_special_values_and_rows_past_the_groups(power_of_two, chunk,
                                                                       monkeypatch):
    """A NaN or inf poisons its own 1x128 blocks only (along K for the rows, along M from its
    group's first row for the transposed copy); rows past the last group are zero bytes with
    scale 1, whatever they hold."""
    if chunk:
        monkeypatch.setattr("fp8ops.ops.emulation_grouped.CHUNK", chunk)
    sizes = [3, 0, 200, 129]
    x = torch.randn(sum(sizes) + 5, 300)
    x[1, 7] = float("nan")                    # group 0
    x[3 + 150, 200] = float("inf")            # group 2, its second block along M
    x[3 + 200:3 + 210] *= 1e-30               # group 3: subnormal range
    x[-1, 0] = float("nan")                   # past the last group
    offsets = _offsets(sizes)
    bd, bs, bd_t, bs_t = _ops.quantize_blockwise_grouped(x, offsets, E4, power_of_two)
    block = 0
    for lo, hi in _bounds(sizes):
        if hi == lo:
            continue
        r, rs, c, cs, _ = _ops.quantize_blockwise_pair(x[lo:hi], E4, power_of_two)
        _same(bd[lo:hi], r)
        _same(bd_t[:, lo:hi], c)
        # the scales bit for bit (NaN for a poisoned block)
        _same(bs[lo:hi].contiguous().view(torch.int32), rs.contiguous().view(torch.int32))
        _same(bs_t[:, block:block + cs.shape[1]].contiguous().view(torch.int32),
              cs.contiguous().view(torch.int32))
        block += cs.shape[1]
    end = sum(sizes)
    assert not bd[end:].view(torch.uint8).any() and not bd_t[:, end:].view(torch.uint8).any()
    assert (bs[end:] == 1).all() and (bs_t[:, block:] == 1).all()


@pytest.mark.parametrize("case", sorted(SIZES))
def test_grouped_blockwise_wgrad_reads_the_packed_blocks(case):
    """dW_g from the grouped blockwise casts of dY and X equals the dense blockwise wgrad of
    the group's own casts."""
    sizes = SIZES[case]
    M, K, N = sum(sizes), 136, 72
    x, dy = torch.randn(M, K), torch.randn(M, N)
    offsets = _offsets(sizes)
    _, _, x_t, x_st = _ops.quantize_blockwise_grouped(x, offsets, E4, False)
    _, _, g_t, g_st = _ops.quantize_blockwise_grouped(dy, offsets, E4, False)
    dw = _ops.grouped_gemm_wgrad_blockwise(g_t, x_t, offsets, g_st, x_st, torch.float32)
    for g, (lo, hi) in enumerate(_bounds(sizes)):
        _, _, xc, xcs, _ = _ops.quantize_blockwise_pair(x[lo:hi], E4, False)
        _, _, gc, gcs, _ = _ops.quantize_blockwise_pair(dy[lo:hi], E4, False)
        _same(dw[g], _ops.gemm_blockwise(gc, xc, gcs, xcs, None, torch.float32))


# ----------------------------------------------------------------------------------------------
# offsets
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("offsets, match", [
    (torch.tensor([2, 5], dtype=torch.int64), "int32"),
    (torch.tensor([[2, 5]], dtype=torch.int32), "1-D"),
    (torch.tensor([5, 2], dtype=torch.int32), "non-decreasing"),
    (torch.tensor([-1, 2], dtype=torch.int32), "non-negative"),
    (torch.tensor([2, 9], dtype=torch.int32), "exceeds the 6 rows"),
    (torch.tensor([2, 3, 5], dtype=torch.int32), "3 groups but the weight has 2"),
])
def test_bad_offsets_are_clear_errors(offsets, match):
    a, b, x = _fp8((6, 32)), _fp8((2, 8, 32)), torch.randn(6, 32)
    s = torch.ones(2)
    with pytest.raises(ValueError, match=match):
        _ops.grouped_gemm(a, b, offsets, s, s, None, torch.float32)
    if "weight" not in match:
        with pytest.raises(ValueError, match=match):
            _ops.grouped_gemm_wgrad(a.t().contiguous(), a.t().contiguous(), offsets, s, s,
                                    torch.float32)
        with pytest.raises(ValueError, match=match):
            _ops.quantize_current_grouped(x, offsets, E4, 1.0, False)
        with pytest.raises(ValueError, match=match):
            _ops.quantize_blockwise_grouped(x, offsets, E4, False)


def test_scale_shapes_are_checked():
    a, b, offsets = _fp8((6, 32)), _fp8((2, 8, 32)), torch.tensor([2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="a_scale_inv"):
        _ops.grouped_gemm(a, b, offsets, torch.ones(6), torch.ones(2), None, torch.float32)
    with pytest.raises(ValueError, match="b_scale_inv"):
        _ops.grouped_gemm(a, b, offsets, torch.ones(2), torch.ones(8), None, torch.float32)


# ----------------------------------------------------------------------------------------------
# opcheck: schema, fake, autograd registration, AOT dispatch
# ----------------------------------------------------------------------------------------------
def _op_samples():
    offsets = _offsets([3, 0, 4])
    E, M, K, N = 3, 8, 136, 24
    return {
        "grouped_gemm": [
            (_fp8((M, K)), _fp8((E, N, K)), offsets, torch.rand(E), torch.rand(E), None,
             torch.bfloat16),
            (_fp8((M, K)), _fp8((E, N, K)), offsets, torch.rand(M, 1), torch.rand(E, N),
             torch.randn(E, N), torch.float32)],
        "grouped_gemm_blockwise": [
            (_fp8((M, K)), _fp8((E, N, K)), offsets, torch.rand(M, 2), torch.rand(E, 1, 2),
             torch.randn(E, N), torch.bfloat16)],
        "grouped_gemm_wgrad": [
            (_fp8((N, M), E5), _fp8((K, M)), offsets, torch.rand(E), torch.rand(E),
             torch.float32)],
        "grouped_gemm_wgrad_blockwise": [
            (_fp8((N, M)), _fp8((K, M)), offsets, torch.rand(N, 3), torch.rand(K, 3),
             torch.bfloat16)],
        "quantize_current_grouped": [(torch.randn(M, K), offsets, E4, 1.0, False, True),
                                     (torch.randn(M, K).bfloat16(), offsets, E5, 2.0, True)],
        "quantize_blockwise_grouped": [(torch.randn(M, K), offsets, E4, False)],
        "quantize_scaled_grouped": [(torch.randn(M, K), offsets, torch.rand(E) + 0.5, E4, True),
                                    (torch.randn(M, K).bfloat16(), offsets, torch.rand(E) * 100,
                                     E5)],
    }


def test_every_grouped_op_has_samples():
    from fp8ops.ops.grouped import SCHEMAS
    assert set(_op_samples()) == set(SCHEMAS)


@pytest.mark.parametrize("name", ["grouped_gemm", "grouped_gemm_wgrad", "grouped_gemm_blockwise",
                                  "grouped_gemm_wgrad_blockwise"])
def test_the_cuda_loops_take_the_dense_op_as_each_groups_gemm(name):
    """On CUDA, a grouped GEMM the Hopper kernel does not take (a bias, row-wise or block
    scales, another GPU) loops over the groups with the dense GEMM op as each group's GEMM.
    Run here on CPU tensors, where the dense op is the emulation's own GEMM: the bytes must be
    the emulation's, every argument reaching the right place (empty groups included)."""
    from fp8ops.ops import emulation_grouped, grouped
    cuda_impl = (grouped._routed(name, grouped._ROUTED[name]) if name in grouped._ROUTED
                 else grouped._per_group_dense(name))
    for args in _op_samples()[name]:
        if name in grouped._ROUTED:  # (CPU tensors: never the Hopper kernel's)
            bias = None if "wgrad" in name else args[5]
            assert not grouped.sm90_suits(name, *args[:5], bias, args[-1])
        _same(cuda_impl(*args), getattr(emulation_grouped, name)(*args))


@pytest.mark.parametrize("name, index", [(n, i) for n, c in _op_samples().items()
                                         for i in range(len(c))])
def test_opcheck(name, index):
    args = _op_samples()[name][index]
    tests = ["test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"]
    if not any(isinstance(a, torch.Tensor) and a.element_size() == 1 for a in args):
        tests.append("test_schema")  # (its checker has no float8 allclose on CPU: test_ops.py)
    torch.library.opcheck(getattr(_ops, name).default, args, test_utils=tests)


# ----------------------------------------------------------------------------------------------
# grouped_linear and FP8GroupedLinear
# ----------------------------------------------------------------------------------------------
RECIPES = {"current": None, "current_p2": fp8ops.CurrentScaling(power_of_two=True, margin=2.0),
           "blockwise": fp8ops.BlockwiseScaling()}


def _problem(sizes, dtype, k=136, n=72, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    E, M = len(sizes), sum(sizes)
    x = torch.randn(M, k, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(E, n, k, generator=g) / k ** 0.5).to(dtype).requires_grad_()
    b = (torch.randn(E, n, generator=g)).to(dtype).requires_grad_() if bias else None
    dy = torch.randn(M, n, generator=g).to(dtype)
    return x, w, b, dy


def _loop_of_linear(x, w, b, dy, sizes, recipe):
    """The reference: fp8ops.linear on each expert's tokens, every expert a layer of its own."""
    xs = x.detach().clone().requires_grad_()
    ws = [w[g].detach().clone().requires_grad_() for g in range(len(sizes))]
    bs = [None if b is None else b[g].detach().clone().requires_grad_()
          for g in range(len(sizes))]
    ys = [fp8ops.linear(xs[lo:hi], ws[g], bs[g], recipe=recipe)
          for g, (lo, hi) in enumerate(_bounds(sizes))]
    y = torch.cat(ys)
    y.backward(dy)
    db = None if b is None else torch.stack([bb.grad for bb in bs])
    return y, xs.grad, torch.stack([ww.grad for ww in ws]), db


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("case", sorted(SIZES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_linear_is_the_loop_of_fp8_linear_bit_for_bit(recipe, case, dtype):
    sizes = SIZES[case]
    x, w, _, dy = _problem(sizes, dtype)
    y = fp8ops.grouped_linear(x, w, _offsets(sizes), recipe=RECIPES[recipe])
    y.backward(dy)
    ry, rdx, rdw, _ = _loop_of_linear(x, w, None, dy, sizes, RECIPES[recipe])
    _same(y, ry)
    _same(x.grad, rdx)
    _same(w.grad, rdw)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_grouped_linear_with_bias(recipe):
    sizes = SIZES["ragged"]
    x, w, b, dy = _problem(sizes, torch.bfloat16, bias=True)
    y = fp8ops.grouped_linear(x, w, _offsets(sizes), b, recipe=RECIPES[recipe])
    y.backward(dy)
    ry, rdx, rdw, rdb = _loop_of_linear(x, w, b, dy, sizes, RECIPES[recipe])
    _same(y, ry)  # the bias is added in the GEMM's epilogue, as the dense layer's
    _same(x.grad, rdx)
    _same(w.grad, rdw)
    # the bias gradient sums each expert's rows in float32 (in another order than the dense
    # layer's column sums): equal up to that float32 rounding, then bf16's
    torch.testing.assert_close(b.grad.float(), rdb.float(), rtol=1e-2, atol=1e-2)


def _rel_err(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_grouped_linear_is_close_to_high_precision(recipe):
    """Against the float32 reference, within FP8 error: E4M3 has 3 mantissa bits (relative
    rounding error up to 2^-4 per element, far less on a sum of many), E5M2 gradients 2."""
    sizes = [40, 0, 70, 150]
    x, w, _, dy = _problem(sizes, torch.float32, k=256, n=128)
    y = fp8ops.grouped_linear(x, w, _offsets(sizes), recipe=RECIPES[recipe])
    y.backward(dy)
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    yr = torch.cat([xr[lo:hi] @ wr[g].t() for g, (lo, hi) in enumerate(_bounds(sizes))])
    yr.backward(dy)
    bound = {"current": 0.06, "current_p2": 0.06, "blockwise": 0.05}[recipe]
    assert _rel_err(y, yr) < bound
    assert _rel_err(x.grad, xr.grad) < 2 * bound
    assert _rel_err(w.grad, wr.grad) < 2 * bound
    assert not w.grad[1].any()  # the expert with no tokens


def test_grouped_linear_rows_past_the_last_group():
    x, w, _, _ = _problem([3, 4], torch.float32)
    offsets = torch.tensor([3, 5], dtype=torch.int32)  # rows 5 and 6 belong to no expert
    y = fp8ops.grouped_linear(x, w, offsets)
    assert not y[5:].any()
    y.sum().backward()
    assert not x.grad[5:].any()


def test_grouped_linear_checks_its_arguments():
    x, w, _, _ = _problem([3, 4], torch.float32)
    offsets = _offsets([3, 4])
    with pytest.raises(ValueError, match="int32"):
        fp8ops.grouped_linear(x, w, offsets.long())
    with pytest.raises(ValueError, match="3-D"):
        fp8ops.grouped_linear(x, w[0], offsets)
    with pytest.raises(ValueError, match="in_features"):
        fp8ops.grouped_linear(x[:, :10], w, offsets)
    with pytest.raises(ValueError, match="non-decreasing"):
        fp8ops.grouped_linear(x, w, torch.tensor([4, 3], dtype=torch.int32))
    for recipe in (fp8ops.MXFP8Scaling(), fp8ops.CurrentScaling(grad_rounding="stochastic"),
                   fp8ops.DelayedScaling(grad_rounding="stochastic")):
        with pytest.raises(NotImplementedError):
            fp8ops.grouped_linear(x, w, offsets, recipe=recipe)
    with pytest.raises(ValueError, match="amax history per expert"):
        fp8ops.grouped_linear(x, w, offsets, recipe=fp8ops.DelayedScaling())


def test_grouped_linear_under_autocast():
    x, w, _, _ = _problem([3, 4], torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8ops.grouped_linear(x, w, _offsets([3, 4]))
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32


@pytest.mark.parametrize("recipe", ["current", "blockwise", "delayed"])
def test_module_under_autocast_with_inputs_already_in_its_dtype(recipe):
    """An experts layer inside an autocast region, its input already bf16 (the output of an
    earlier autocast op): autocast refuses to stack FP8 tensors, so the layer's casts must run
    with it off. The same bytes as the call without autocast, weight cache reused or not."""
    recipes = dict(RECIPES, delayed=fp8ops.DelayedScaling())
    torch.manual_seed(0)
    plain = fp8ops.FP8GroupedLinear(3, 136, 72, recipe=recipes[recipe], dtype=torch.bfloat16)
    under = fp8ops.FP8GroupedLinear(3, 136, 72, recipe=recipes[recipe], dtype=torch.bfloat16)
    under.load_state_dict(plain.state_dict())
    offsets = _offsets([5, 0, 9])
    for step in range(2):  # the second step reuses nothing: each forward casts the new weight
        x = torch.randn(14, 136, generator=torch.Generator().manual_seed(step)).bfloat16()
        y = plain(x, offsets)
        y.float().square().sum().backward()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y_auto = under(x, offsets)
        y_auto.float().square().sum().backward()
        _same(y_auto, y)
        _same(under.weight.grad, plain.weight.grad)
        for layer in (plain, under):
            with torch.no_grad():
                layer.weight.sub_(0.5 * layer.weight.grad)
            layer.weight.grad = None


def test_grouped_linear_main_grad():
    x, w, _, dy = _problem([3, 4], torch.bfloat16)
    w.main_grad = torch.ones(w.shape)
    fp8ops.grouped_linear(x, w, _offsets([3, 4])).backward(dy)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    fp8ops.grouped_linear(x2, w2, _offsets([3, 4])).backward(dy)
    assert w.grad is None
    torch.testing.assert_close(w.main_grad, 1 + w2.grad.float(), rtol=1e-2, atol=1e-2)


def test_double_backward_is_an_error():
    x, w, _, _ = _problem([3, 4], torch.float32)
    y = fp8ops.grouped_linear(x, w, _offsets([3, 4]))
    (gx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        gx.sum().backward()


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_module_trains_like_the_functional_form(recipe):
    torch.manual_seed(0)
    layer = fp8ops.FP8GroupedLinear(4, 136, 72, bias=True, recipe=RECIPES[recipe])
    assert layer.weight.shape == (4, 72, 136) and layer.bias.shape == (4, 72)
    assert isinstance(layer, torch.nn.Module) and fp8ops.nn.FP8GroupedLinear is type(layer)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    offsets = _offsets([10, 0, 7, 9])
    x, target = torch.randn(26, 136), torch.randn(26, 72)
    losses = []
    for _ in range(3):
        loss = torch.nn.functional.mse_loss(layer(x, offsets), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    state = layer.state_dict()
    assert set(state) == {"weight", "bias"}
    again = fp8ops.FP8GroupedLinear(4, 136, 72, bias=True, recipe=RECIPES[recipe])
    again.load_state_dict(state)
    _same(again(x, offsets), layer(x, offsets))


@pytest.mark.parametrize("recipe, backend", [("current", "inductor"),
                                             ("blockwise", "aot_eager")])
def test_torch_compile_fullgraph_matches_eager(recipe, backend):
    """No graph break (the groups' sizes are read inside the ops only), the same bytes."""
    torch._dynamo.reset()
    sizes = SIZES["ragged"]
    x, w, _, dy = _problem(sizes, torch.bfloat16)
    offsets = _offsets(sizes)

    def step(x, w):
        return fp8ops.grouped_linear(x, w, offsets, recipe=RECIPES[recipe])

    y = step(x, w)
    y.backward(dy)
    xc, wc = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    yc = torch.compile(step, backend=backend, fullgraph=True)(xc, wc)
    yc.backward(dy)
    _same(yc, y)
    _same(xc.grad, x.grad)
    _same(wc.grad, w.grad)


@pytest.mark.parametrize("name", sorted(_op_samples()))
def test_autocast_does_not_reach_the_kernels(name):
    """Under torch.autocast a grouped op computes what it computes without it (the emulation's
    float32 matmuls stay float32)."""
    for args in _op_samples()[name]:
        want = getattr(_ops, name)(*args)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = getattr(_ops, name)(*args)
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        for g, w in zip(got, want):
            _same(g, w)


# ----------------------------------------------------------------------------------------------
# the weight cache: all experts of a weight cast once per optimizer step
# ----------------------------------------------------------------------------------------------
CACHE_RECIPES = {"current": fp8ops.CurrentScaling(), "blockwise": fp8ops.BlockwiseScaling()}


@pytest.fixture
def expert_casts(monkeypatch):
    """Counts the experts' weight casts (every expert of a weight at once)."""
    from fp8ops.nn import quantizers
    calls = []
    for name in ("quantize_experts_current", "quantize_experts_blockwise"):
        real = getattr(quantizers, name)

        def counted(*args, _real=real, **kwargs):
            calls.append(args[0].shape)
            return _real(*args, **kwargs)

        monkeypatch.setattr(quantizers, name, counted)
    return calls


def _cache_layer(recipe, seed=0):
    torch.manual_seed(seed)
    return fp8ops.FP8GroupedLinear(4, 136, 72, bias=True, recipe=CACHE_RECIPES[recipe])


def _micro(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(26, 136, generator=g), torch.randn(26, 72, generator=g)


_CACHE_OFFSETS = _offsets([10, 0, 7, 9])


def _uncached(layer, x):
    """layer(x) from a fresh cast of its weight (no cache)."""
    return fp8ops.grouped_linear(x, layer.weight, _CACHE_OFFSETS, layer.bias, recipe=layer.recipe)


@pytest.mark.parametrize("recipe", sorted(CACHE_RECIPES))
def test_expert_weights_are_cast_once_per_optimizer_step(recipe, expert_casts):
    """Inside an accumulation window the cast is reused (the same FP8 tensors); before the
    optimizer's first step nothing says one holds the weight: every micro-batch casts."""
    layer = _cache_layer(recipe)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    for window in range(3):
        before = len(expert_casts)
        payloads = []
        for i in range(3):
            x, t = _micro(10 * window + i)
            torch.nn.functional.mse_loss(layer(x, _CACHE_OFFSETS), t).backward()
            payloads.append(layer.weight_cache.entry.payload)
        if window == 0:
            assert len(expert_casts) - before == 3
            assert payloads[1] is not payloads[0]
        else:
            assert len(expert_casts) - before == 1
            assert payloads[1] is payloads[0] and payloads[2] is payloads[0]
        opt.step()  # the next window's first forward casts the new values
        opt.zero_grad()
    assert all(shape == (4, 72, 136) for shape in expert_casts)  # all experts at once


@pytest.mark.parametrize("recipe", sorted(CACHE_RECIPES))
def test_cached_training_is_bit_equal_to_casting_every_call(recipe):
    """The same training with the layer (its cache) and with grouped_linear and no cache: the
    same outputs and gradients, bit for bit, every micro-batch."""
    cached, plain = _cache_layer(recipe), _cache_layer(recipe)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (cached, plain)]
    for step in range(4):
        for i in range(3):
            x, t = _micro(10 * step + i)
            y = cached(x, _CACHE_OFFSETS)
            yp = _uncached(plain, x)
            _same(y, yp)
            torch.nn.functional.mse_loss(y, t).backward()
            torch.nn.functional.mse_loss(yp, t).backward()
            _same(cached.weight.grad, plain.weight.grad)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        _same(cached.weight, plain.weight)


def _held_layer(recipe):
    """A layer whose weight an optimizer holds, mid-window: its cast would be reused."""
    layer = _cache_layer(recipe)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    x, t = _micro(0)
    for _ in range(2):
        torch.nn.functional.mse_loss(layer(x, _CACHE_OFFSETS), t).backward()
        opt.step()
        opt.zero_grad()
    layer(x, _CACHE_OFFSETS).sum().backward()
    return layer, opt, x


@pytest.mark.parametrize("how", ["set p.data", "no_grad mul_", "no_grad copy_",
                                 "p.data.add_ then invalidate()"])
@pytest.mark.parametrize("recipe", sorted(CACHE_RECIPES))
def test_every_write_of_the_experts_weight_reaches_the_next_forward(recipe, how, expert_casts):
    layer, _, x = _held_layer(recipe)
    cached = layer.weight_cache.entry.payload
    layer(x, _CACHE_OFFSETS).sum().backward()
    assert layer.weight_cache.entry.payload is cached  # inside the window: reused
    new = torch.randn(layer.weight.shape)
    w = layer.weight
    if how == "set p.data":
        w.data = new
    elif how == "no_grad mul_":
        with torch.no_grad():
            w.mul_(2)
    elif how == "no_grad copy_":
        with torch.no_grad():
            w.copy_(new)
    else:
        w.data.add_(new)  # no counter sees it, mid-window: the caller says so
        layer.weight_cache.invalidate()
    casts = len(expert_casts)
    y = layer(x, _CACHE_OFFSETS)
    assert len(expert_casts) == casts + 1
    assert layer.weight_cache.entry.payload is not cached
    _same(y, _uncached(layer, x))


@pytest.mark.parametrize("recipe", sorted(CACHE_RECIPES))
def test_a_new_storage_at_the_old_address_reaches_the_next_forward(recipe):
    """`p.data = new` with the old storage dropped (the allocator may give the new one its
    address; the version counter stays): over many trials, never the old cast."""
    for trial in range(6):
        torch.manual_seed(trial)
        layer, _, x = _held_layer(recipe)
        layer.weight.data = layer.weight.data * 0.3
        layer.weight.data = layer.weight.data * 0.3
        _same(layer(x, _CACHE_OFFSETS), _uncached(layer, x))


@pytest.mark.parametrize("recipe", sorted(CACHE_RECIPES))
def test_expert_weights_recast_after_each_optimizer_step(recipe, expert_casts):
    layer, opt, x = _held_layer(recipe)
    for _ in range(3):
        opt.step()  # the values move: the next forward casts them
        opt.zero_grad()
        casts = len(expert_casts)
        y = layer(x, _CACHE_OFFSETS)
        assert len(expert_casts) == casts + 1
        _same(y, _uncached(layer, x))
        y.sum().backward()


@pytest.mark.parametrize("recipe", sorted(CACHE_RECIPES))
def test_without_an_optimizer_every_forward_casts(recipe, expert_casts):
    """A hand-written loop (p.data updates) and eval forwards: no optimizer vouches, so every
    forward casts, and every forward is what a fresh cast gives."""
    layer = _cache_layer(recipe)
    for step in range(3):
        for i in range(2):
            x, t = _micro(10 * step + i)
            casts = len(expert_casts)
            y = layer(x, _CACHE_OFFSETS)
            assert len(expert_casts) == casts + 1
            _same(y, _uncached(layer, x))
            torch.nn.functional.mse_loss(y, t).backward()
        for p in layer.parameters():
            p.data.add_(p.grad, alpha=-0.1)  # no version bump
            p.grad = None
    with torch.no_grad():
        casts = len(expert_casts)
        layer(x, _CACHE_OFFSETS)
        layer(x, _CACHE_OFFSETS)
        assert len(expert_casts) == casts + 2


def test_expert_cache_forgets_a_cast_of_another_recipe():
    layer = _cache_layer("current")
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    x, _ = _micro(0)
    for _ in range(2):
        layer(x, _CACHE_OFFSETS).sum().backward()
        opt.step()
    layer(x, _CACHE_OFFSETS).sum().backward()
    layer.recipe = fp8ops.BlockwiseScaling()
    _same(layer(x, _CACHE_OFFSETS), _uncached(layer, x))


def test_expert_cache_copies_and_device_moves():
    layer = _cache_layer("current")
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    x, _ = _micro(0)
    for _ in range(2):
        layer(x, _CACHE_OFFSETS).sum().backward()
        opt.step()
    import copy
    import pickle
    for other in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert other.weight_cache.entry is None  # no FP8 payload travels
        _same(other(x, _CACHE_OFFSETS), layer(x, _CACHE_OFFSETS))
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        layer.to(torch.bfloat16)  # swaps the parameters (weak references refused)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    xb = x.to(torch.bfloat16)
    _same(layer(xb, _CACHE_OFFSETS), _uncached(layer, xb))


def test_device_state_counts_the_cached_expert_casts():
    from fp8ops.memory import device_state_bytes
    layer = _cache_layer("current")
    x, _ = _micro(0)
    assert device_state_bytes(layer)["fp8_weights"] == 0
    layer(x, _CACHE_OFFSETS).sum().backward()
    data, data_t, scale_inv = layer.weight_cache.entry.payload[1]
    want = sum(t.untyped_storage().nbytes() for t in (data, data_t, scale_inv))
    assert device_state_bytes(layer)["fp8_weights"] == want == 2 * 4 * 72 * 136 + 4 * 4


def test_compiled_layer_casts_every_call_and_leaves_the_cache_alone():
    """Under torch.compile (fullgraph) the layer casts inside the graph: its cache is not used."""
    torch._dynamo.reset()
    layer = _cache_layer("current")
    x, _ = _micro(0)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    y = compiled(x, _CACHE_OFFSETS)
    y.sum().backward()
    assert layer.weight_cache.entry is None
    _same(y, _uncached(layer, x))


# ----------------------------------------------------------------------------------------------
# delayed scaling: each expert trains as a dense FP8Linear on its own rows
# ----------------------------------------------------------------------------------------------
DELAYED = {
    "max": fp8ops.DelayedScaling(amax_history_len=4),
    "most_recent_p2": fp8ops.DelayedScaling(amax_history_len=3, amax_compute_algo="most_recent",
                                            power_of_two=True, margin=2.0, grad_margin=4.0),
    "ema_interval": fp8ops.DelayedScaling(amax_compute_algo="ema", ema_alpha=0.25, interval=2),
    "percentile": fp8ops.DelayedScaling(amax_history_len=5, amax_compute_algo="percentile",
                                        percentile=60.0, bwd_fmt="e4m3"),
}
# each micro-batch's group sizes (two per optimizer step): experts with no tokens, in the first
# micro-batch too (a warm start with no rows)
MICRO_SIZES = [[5, 0, 17, 3], [4, 9, 0, 6], [0, 2, 8, 11], [7, 7, 1, 0], [3, 0, 0, 12],
               [1, 1, 1, 1]]
ROLE_BUFFERS = ("amax_history", "scale", "scale_inv", "amax_rep", "pending_amax", "step",
                "nonfinite_count")


def _delayed_pair(recipe, dtype, k=40, n=24, experts=4):
    """An FP8GroupedLinear and, for each of its experts, a dense FP8Linear with that expert's
    weight and the same recipe."""
    torch.manual_seed(0)
    layer = fp8ops.FP8GroupedLinear(experts, k, n, recipe=recipe, dtype=dtype)
    dense = [fp8ops.FP8Linear(k, n, bias=False, recipe=recipe, dtype=dtype, fallback="never")
             for _ in range(experts)]
    with torch.no_grad():
        for g, d in enumerate(dense):
            d.weight.copy_(layer.weight[g])
    return layer, dense


def _same_state(layer, dense):
    for role in ("input", "weight", "grad"):
        grouped = getattr(layer.fp8_state, role)
        for g, d in enumerate(dense):
            for name in ROLE_BUFFERS:
                got, want = getattr(grouped, name)[g], getattr(getattr(d.fp8_state, role), name)
                assert torch.equal(got, want), (role, name, g, got, want)
            assert grouped.started == getattr(d.fp8_state, role).started


def _dense_micro_batch(dense, x, dy, sizes):
    xs = x.detach().clone().requires_grad_()
    y = torch.cat([d(xs[lo:hi]) for d, (lo, hi) in zip(dense, _bounds(sizes))])
    y.backward(dy)
    return y, xs.grad


def _micro_batch(seed, sizes, dtype, k=40, n=24):
    g = torch.Generator().manual_seed(seed)
    m = sum(sizes)
    # each micro-batch and expert of its own range: the histories matter
    x = torch.randn(m, k, generator=g) * torch.logspace(-1, 1, max(m, 1))[:m].unsqueeze(1)
    return (x.to(dtype).requires_grad_(), (torch.randn(m, n, generator=g) * (seed + 1)).to(dtype))


@pytest.mark.parametrize("recipe", sorted(DELAYED))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_delayed_experts_train_as_dense_fp8_linears_bit_for_bit(recipe, dtype):
    """Three optimizer steps of two micro-batches: every output, input gradient, weight
    gradient, weight and delayed-scaling buffer of expert g is that of a dense FP8Linear run on
    expert g's rows alone (an expert with no rows records an amax of 0, as the dense layer does
    for an empty input); then an eval forward, which records nothing."""
    layer, dense = _delayed_pair(DELAYED[recipe], dtype)
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    dense_opt = torch.optim.SGD([d.weight for d in dense], lr=0.5)
    for i, sizes in enumerate(MICRO_SIZES):
        x, dy = _micro_batch(i, sizes, dtype)
        y = layer(x, _offsets(sizes))
        y.backward(dy)
        ry, rdx = _dense_micro_batch(dense, x, dy, sizes)
        _same(y, ry)
        _same(x.grad, rdx)
        for g, d in enumerate(dense):
            _same(layer.weight.grad[g], d.weight.grad)
        _same_state(layer, dense)
        if i % 2:
            for o in (opt, dense_opt):
                o.step()
                o.zero_grad()
            for g, d in enumerate(dense):
                _same(layer.weight[g], d.weight)
    assert (layer.fp8_state.weight.step == 3).all()  # once per optimizer step
    layer.eval()
    for d in dense:
        d.eval()
    x, _ = _micro_batch(99, MICRO_SIZES[0], dtype)
    with torch.no_grad():
        y = layer(x, _offsets(MICRO_SIZES[0]))
        ry = torch.cat([d(x[lo:hi]) for d, (lo, hi) in zip(dense, _bounds(MICRO_SIZES[0]))])
    _same(y, ry)
    _same_state(layer, dense)


def test_delayed_experts_start_warm_from_their_own_amax():
    """Before anything was recorded each expert's casts take its own amax (the dense layer's
    warm start): the first step gives current scaling's bytes."""
    sizes = SIZES["ragged"]
    x, w, _, dy = _problem(sizes, torch.bfloat16)
    xc, wc = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    state = ExpertScalingState(fp8ops.DelayedScaling(), len(sizes))
    y = fp8ops.grouped_linear(x, w, _offsets(sizes), state=state)
    y.backward(dy)
    yc = fp8ops.grouped_linear(xc, wc, _offsets(sizes))
    yc.backward(dy)
    _same(y, yc)
    _same(x.grad, xc.grad)
    _same(w.grad, wc.grad)
    assert not state.input.amax_history.any()  # recorded, not yet rolled in
    assert state.input.pending_amax[1] == 0 and state.input.pending_amax[0] > 0


def _train_delayed(layer, seeds, opt=None):
    out = []
    for seed in seeds:
        x, dy = _micro_batch(seed, MICRO_SIZES[seed % len(MICRO_SIZES)], torch.float32)
        y = layer(x, _offsets(MICRO_SIZES[seed % len(MICRO_SIZES)]))
        y.backward(dy)
        out.append(y)
        if opt is not None and seed % 2:
            opt.step()
            opt.zero_grad()
    return out


def test_delayed_state_dict_resumes_exactly_mid_accumulation():
    """The state is buffers: saved mid-window (the cast the next micro-batch reuses included)
    and loaded into a fresh layer, training continues bit for bit."""
    layer, _ = _delayed_pair(DELAYED["max"], torch.float32)
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    _train_delayed(layer, [0, 1, 2, 3, 4], opt)  # mid-window: one micro-batch of the third
    saved = layer.state_dict()
    keys = {k for k in saved if k.startswith("fp8_state.")}
    assert keys == {f"fp8_state.{r}.{b}" for r in ("input", "weight", "grad")
                    for b in ROLE_BUFFERS} | {"fp8_state.weight_cast_scale"}
    assert saved["fp8_state.input.amax_history"].shape == (4, 4)
    assert saved["fp8_state.weight_cast_scale"].all()  # a cast to reuse
    again, _ = _delayed_pair(DELAYED["max"], torch.float32)
    again.load_state_dict(saved)
    for name, value in again.state_dict().items():
        assert torch.equal(value, saved[name]), name
    assert again.fp8_state.input.started and again.fp8_state.grad.started
    opt_again = torch.optim.SGD(again.parameters(), lr=0.5)
    for p, q in zip(layer.parameters(), again.parameters()):
        q.grad = p.grad.clone()
    for a, b in zip(_train_delayed(layer, [5, 6, 7], opt), _train_delayed(again, [5, 6, 7],
                                                                           opt_again)):
        _same(a, b)
    for name, value in again.state_dict().items():
        assert torch.equal(value, layer.state_dict()[name]), name


def test_delayed_layer_keeps_float32_state_across_dtype_moves_and_copies():
    import copy
    import pickle
    layer, _ = _delayed_pair(DELAYED["max"], torch.float32)
    _train_delayed(layer, [0, 1], torch.optim.SGD(layer.parameters(), lr=0.5))
    for other in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert other.fp8_state.weight_cache is other.weight_cache
        for name, value in other.state_dict().items():
            assert torch.equal(value, layer.state_dict()[name]), name
    layer.to(torch.bfloat16)
    assert layer.weight.dtype == torch.bfloat16
    assert layer.fp8_state.input.amax_history.dtype == torch.float32


def test_delayed_checks_the_state():
    x, w, _, _ = _problem([3, 4], torch.float32)
    offsets = _offsets([3, 4])
    recipe = fp8ops.DelayedScaling()
    with pytest.raises(ValueError, match="holds 3 experts"):
        fp8ops.grouped_linear(x, w, offsets, state=ExpertScalingState(recipe, 3))
    with pytest.raises(ValueError, match="differs from the state's recipe"):
        fp8ops.grouped_linear(x, w, offsets, recipe=fp8ops.DelayedScaling(margin=2.0),
                              state=ExpertScalingState(recipe, 2))
    with pytest.raises(ValueError, match="weight cache is the state's"):
        fp8ops.grouped_linear(x, w, offsets, state=ExpertScalingState(recipe, 2),
                              weight_cache=fp8ops.scaling.WeightCache())
    with pytest.raises(TypeError, match="ExpertScalingState"):
        fp8ops.grouped_linear(x, w, offsets, state=fp8ops.ScalingState(recipe))
    with pytest.raises(TypeError, match="DelayedScaling"):
        ExpertScalingState(fp8ops.CurrentScaling(), 2)


def test_delayed_layer_compiles_with_no_graph_break():
    """Under torch.compile (fullgraph) the delayed layer gives eager's bytes and state; as the
    dense layer's, its compiled calls cast the weight every call (stepping its role each live
    forward), so the weight role is compared on a first step."""
    torch._dynamo.reset()
    layer, _ = _delayed_pair(DELAYED["max"], torch.float32)
    import copy
    eager = copy.deepcopy(layer)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    for i in range(3):
        sizes = MICRO_SIZES[i]
        x, dy = _micro_batch(i, sizes, torch.float32)
        xc = x.detach().clone().requires_grad_()
        y = eager(x, _offsets(sizes))
        y.backward(dy)
        yc = compiled(xc, _offsets(sizes))
        yc.backward(dy)
        _same(yc, y)
        _same(xc.grad, x.grad)
        _same(layer.weight.grad, eager.weight.grad)
        for role in ("input", "grad") + (("weight",) if i == 0 else ()):
            for name in ROLE_BUFFERS:
                assert torch.equal(getattr(getattr(layer.fp8_state, role), name),
                                   getattr(getattr(eager.fp8_state, role), name)), (role, name)


def test_delayed_activation_checkpointing_recomputes_without_stepping():
    """A checkpointed forward's recompute casts as the forward did and neither steps nor
    records: the bytes and state of the same training without checkpointing."""
    from torch.utils.checkpoint import checkpoint
    layer, _ = _delayed_pair(DELAYED["max"], torch.float32)
    import copy
    plain = copy.deepcopy(layer)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (layer, plain)]
    for i, sizes in enumerate(MICRO_SIZES[:4]):
        x, dy = _micro_batch(i, sizes, torch.float32)
        xp = x.detach().clone().requires_grad_()
        y = checkpoint(layer, x, _offsets(sizes), use_reentrant=False)
        y.backward(dy)
        yp = plain(xp, _offsets(sizes))
        yp.backward(dy)
        _same(y, yp)
        _same(x.grad, xp.grad)
        _same(layer.weight.grad, plain.weight.grad)
        for name, value in layer.fp8_state.state_dict().items():
            assert torch.equal(value, plain.fp8_state.state_dict()[name]), name
        if i % 2:
            for o in opts:
                o.step()
                o.zero_grad()
