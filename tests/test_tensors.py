"""The user-facing quantize / dequantize / gemm functions and their argument checks."""
import math

import numpy as np
import pytest
import torch

import fp8ops


def test_quantize_current_scaling_uses_amax_and_margin():
    x = torch.randn(64, 32) * 7
    q = fp8ops.quantize(x, "e4m3", margin=2.0)
    amax = x.abs().max()
    assert torch.equal(q.scale, torch.tensor(448.0) / (amax * 2.0))
    assert q.data.dtype == torch.float8_e4m3fn and q.fmt is fp8ops.E4M3
    assert q.data.float().abs().max().item() <= 224.0  # margin 2 keeps half the range free
    assert torch.equal(q.scale_inv, torch.reciprocal(q.scale))


def test_quantize_roundtrip_and_explicit_scale():
    x = torch.randn(1000)
    q = fp8ops.quantize(x, fp8ops.E5M2, scale=4.0)
    back = fp8ops.dequantize(q, torch.float32)
    assert q.scale.item() == 4.0 and back.dtype == torch.float32
    rel = ((back - x).norm() / x.norm()).item()
    assert 0.01 < rel < 0.1  # two mantissa bits


def test_quantize_zero_and_nonfinite_amax_give_scale_one():
    assert fp8ops.quantize(torch.zeros(8)).scale.item() == 1.0
    q = fp8ops.quantize(torch.tensor([1.0, float("inf")]))
    assert q.scale.item() == 1.0 and q.data.float().tolist() == [1.0, 448.0]
    assert math.isnan(fp8ops.quantize(torch.tensor([float("nan"), 2.0])).data.float()[0].item())


def test_quantize_zero_size():
    q = fp8ops.quantize(torch.empty(0, 16), transpose=True)
    assert q.data.shape == (0, 16) and q.data_t.shape == (16, 0) and q.scale.item() == 1.0


def test_quantize_stochastic_offset_changes_result():
    x = torch.randn(4096)
    a = fp8ops.quantize(x, rounding="stochastic", seed=1, offset=0).data.view(torch.uint8)
    b = fp8ops.quantize(x, rounding="stochastic", seed=1, offset=1).data.view(torch.uint8)
    assert not torch.equal(a, b)


def test_amax_public():
    assert fp8ops.amax(torch.tensor([-3.0, 2.0], dtype=torch.bfloat16)).item() == 3.0


@pytest.mark.parametrize("call, err, match", [
    (lambda: fp8ops.quantize(torch.ones(4), "e3m4"), ValueError, "unknown FP8 format"),
    (lambda: fp8ops.quantize(torch.ones(4, dtype=torch.int32)), TypeError, "float32, bfloat16"),
    (lambda: fp8ops.quantize([1.0, 2.0]), TypeError, "torch.Tensor"),
    (lambda: fp8ops.quantize(torch.ones(4), rounding="up"), ValueError, "rounding"),
    (lambda: fp8ops.quantize(torch.ones(4), scale=-1.0), ValueError, "positive finite"),
    (lambda: fp8ops.quantize(torch.ones(4), scale=float("nan")), ValueError, "positive finite"),
    (lambda: fp8ops.quantize(torch.ones(4), scale=torch.ones(2)), ValueError, "one value"),
    (lambda: fp8ops.quantize(torch.ones(4), scale="2"), TypeError, "a number or a one-element"),
    (lambda: fp8ops.quantize(torch.ones(4), scale=True), TypeError, "a number or a one-element"),
    (lambda: fp8ops.quantize(torch.ones(4), scale=torch.tensor(2)), TypeError, "floating-point"),
    (lambda: fp8ops.gemm(fp8ops.quantize(torch.ones(2, 4)), fp8ops.quantize(torch.ones(3, 4)),
                         bias=torch.ones(3, dtype=torch.int64)), TypeError, "bias must be float32"),
    (lambda: fp8ops.quantize_mx(torch.ones(4, 33)), ValueError, "multiple of block_size 32"),
    (lambda: fp8ops.quantize_mx(torch.ones(4, 32), axis=2), ValueError, "out of range"),
    (lambda: fp8ops.quantize_mx(torch.ones(4, 32), scale_mode="ceil"), ValueError, "scale_mode"),
    (lambda: fp8ops.quantize_blockwise(torch.ones(4, 32), block=(0, 128)), ValueError, "block"),
    (lambda: fp8ops.dequantize(torch.ones(3)), TypeError, "Float8Tensor"),
    (lambda: fp8ops.quantize(torch.ones(4)).dequantize(torch.int8), TypeError, "output dtype"),
])
def test_bad_arguments_name_the_problem(call, err, match):
    with pytest.raises(err, match=match):
        call()


def test_a_scale_that_requires_grad_is_kept_without_its_graph():
    scale = torch.tensor(2.0, requires_grad=True)
    q = fp8ops.quantize(torch.ones(4), scale=scale * 1)
    assert q.scale.grad_fn is None and not q.scale.requires_grad and q.scale.item() == 2.0
    assert fp8ops.quantize(torch.ones(4), scale=np.float32(4.0)).scale.item() == 4.0


@pytest.mark.parametrize("call, err, match", [
    (lambda x: fp8ops.quantize_mx(x, axis=1.5), TypeError, "axis must be an int, got 1.5"),
    (lambda x: fp8ops.quantize_mx(x, axis=None), TypeError, "axis must be an int, got None"),
    (lambda x: fp8ops.quantize_mx(x, axis=True), TypeError, "axis must be an int"),
    (lambda x: fp8ops.quantize_mx(x, block_size="32"), TypeError, "block_size must be an int"),
    (lambda x: fp8ops.quantize_mx(x, block_size=32.0), TypeError, "block_size must be an int"),
    (lambda x: fp8ops.quantize_mx(x, block_size=True), TypeError, "block_size must be an int"),
    (lambda x: fp8ops.quantize_mx(x, block_size=0), ValueError, "block_size must be positive"),
    (lambda x: fp8ops.quantize(x, rounding="stochastic", seed=1.5), TypeError,
     "seed must be an int"),
    (lambda x: fp8ops.quantize(x, rounding="stochastic", offset=True), TypeError,
     "offset must be an int"),
    (lambda x: fp8ops.quantize(x, rounding="stochastic", seed=2 ** 64), ValueError,
     "seed must fit in an int64"),
])
def test_int_arguments_of_the_wrong_kind_are_named(call, err, match):
    """A float, None, a string or a bool where an int is expected fails here, naming the
    argument, rather than deep in an op or as another number (True as 1, 1.5 as 1)."""
    with pytest.raises(err, match=match):
        call(torch.ones(4, 64))


@pytest.mark.parametrize("scale", [0.0, -2.0, float("nan"), float("inf"), 1e39, 1e-50, 1e-40],
                         ids=["zero", "negative", "nan", "inf", "overflows", "underflows",
                              "reciprocal_overflows"])
@pytest.mark.parametrize("kind", ["python", "tensor", "float64_tensor"])
def test_bad_scales_are_rejected_as_python_numbers_and_tensors(scale, kind):
    if kind == "tensor":
        scale = torch.tensor(scale)  # float32: 1e39 is inf, 1e-50 is 0 already
    elif kind == "float64_tensor":
        scale = torch.tensor(scale, dtype=torch.float64)
    with pytest.raises(ValueError, match="scale must be a positive finite"):
        fp8ops.quantize(torch.ones(4), scale=scale)


def test_scale_check_on_a_device_does_not_sync():
    # off the CPU the check is torch._assert_async; on the meta device it runs without data
    x = torch.ones(4, device="meta")
    assert fp8ops.quantize(x, scale=torch.tensor(0.0, device="meta")).data.device.type == "meta"
    with pytest.raises(ValueError, match="scale must be"):  # a Python number is host data
        fp8ops.quantize(x, scale=0.0)
    with torch.device("meta"):  # the default device does not move the host checks
        assert fp8ops.quantize(torch.ones(4), scale=2.0, margin=2.0).scale.device.type == "meta"
        assert fp8ops.DelayedScaling(margin=2.0).margin == 2.0


@pytest.mark.parametrize("margin", [0.0, -1.0, float("nan"), float("inf"), 1e-50])
def test_quantize_rejects_a_bad_margin(margin):
    with pytest.raises(ValueError, match="margin must be a positive finite"):
        fp8ops.quantize(torch.ones(4), margin=margin)


@pytest.mark.parametrize("block", [128, (128,), (1, 128, 1), (1.5, 128), "1x128"])
def test_quantize_blockwise_names_a_malformed_block(block):
    with pytest.raises(TypeError, match=r"block must be a \(rows, cols\) pair"):
        fp8ops.quantize_blockwise(torch.ones(4, 128), block=block)


def test_mx_and_blockwise_tensors():
    x = torch.randn(64, 96)
    mx = fp8ops.quantize_mx(x, block_size=32, axis=0, scale_mode="rceil")
    assert mx.axis == 0 and mx.scales.shape == (2, 96) and mx.scales.dtype == torch.uint8
    assert ((mx.dequantize() - x).norm() / x.norm()).item() < 0.05
    bw = fp8ops.quantize_blockwise(x, block=(128, 128), power_of_two=True)
    assert bw.scale_inv.shape == (1, 1)
    assert math.log2(bw.scale_inv.item()).is_integer()
    assert ((bw.dequantize(torch.bfloat16).float() - x).norm() / x.norm()).item() < 0.05


def _sqnr(a, b):
    return (10 * torch.log10(b.pow(2).sum() / (a - b).pow(2).sum())).item()


@pytest.mark.parametrize("kind", ["tensor", "mx", "blockwise"])
def test_gemm_each_kind(kind):
    a, b, bias = torch.randn(40, 256), torch.randn(24, 256), torch.randn(24)
    if kind == "tensor":
        qa, qb = fp8ops.quantize(a), fp8ops.quantize(b, "e5m2")
    elif kind == "mx":
        qa, qb = fp8ops.quantize_mx(a), fp8ops.quantize_mx(b)
    else:
        qa, qb = fp8ops.quantize_blockwise(a), fp8ops.quantize_blockwise(b, block=(128, 128))
    out = fp8ops.gemm(qa, qb, out_dtype=torch.float32, bias=bias)
    ref = a.double() @ b.double().t() + bias.double()
    assert out.shape == (40, 24) and out.dtype == torch.float32
    assert _sqnr(out.double(), ref) > 18


def test_gemm_checks():
    qa, qb = fp8ops.quantize(torch.randn(4, 32)), fp8ops.quantize(torch.randn(5, 16))
    with pytest.raises(ValueError, match="K differs"):
        fp8ops.gemm(qa, qb)
    with pytest.raises(TypeError, match="one kind"):
        fp8ops.gemm(qa, fp8ops.quantize_mx(torch.randn(5, 32)))
    with pytest.raises(ValueError, match="bias must have shape"):
        fp8ops.gemm(qa, fp8ops.quantize(torch.randn(5, 32)), bias=torch.ones(4))
    with pytest.raises(ValueError, match="2-D"):
        fp8ops.gemm(fp8ops.quantize(torch.randn(2, 4, 32)), qa)
    with pytest.raises(TypeError, match="output dtype"):
        fp8ops.gemm(qa, qa, out_dtype=torch.int32)
