"""fp8ops.dequantize_sum (fp8ops/ops/block_sum.py), the receiving end of an FP8 reduction:
against an independent reference (ml_dtypes decodes the bytes, numpy adds in float32 in row
order), its errors, NaN, empty inputs, and opcheck (fake, dispatch, torch.compile)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import fp8ops  # noqa: F401  (defines torch.ops.fp8ops.*)

_ops = torch.ops.fp8ops
NP_FP8 = {torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn, torch.float8_e5m2: ml_dtypes.float8_e5m2}


def _encoded(rows, n, dtype, block_size, seed):
    g = torch.Generator().manual_seed(seed)
    # each row at its own magnitude, so the blocks' scales differ by rank
    x = torch.randn(rows, n, generator=g) * torch.logspace(-3, 2, rows).unsqueeze(1)
    return _ops.quantize_blockwise(x, dtype, 1, block_size, False)


def _reference(data, scale_inv, block_size, divisor, out_dtype):
    rows, n = data.shape
    decoded = data.view(torch.uint8).numpy().view(NP_FP8[data.dtype]).astype(np.float32)
    scales = np.repeat(scale_inv.numpy(), block_size, axis=1)[:, :n]
    acc = np.zeros(n, np.float32)
    for r in range(rows):
        acc = acc + decoded[r] * scales[r]  # float32 products and sums, one rounding each
    acc = acc / np.float32(divisor)
    return torch.from_numpy(acc).to(out_dtype)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("rows,n,block_size", [(1, 128, 128), (2, 300, 128), (3, 77, 32),
                                                (4, 1000, 64)])
@pytest.mark.parametrize("divisor", [1.0, 3.0, 4.0])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_matches_an_independent_reference_bit_for_bit(dtype, rows, n, block_size, divisor,
                                                      out_dtype):
    data, scale_inv = _encoded(rows, n, dtype, block_size, rows * n + block_size)
    out = _ops.dequantize_sum(data, scale_inv, block_size, divisor, out_dtype)
    want = _reference(data, scale_inv, block_size, divisor, out_dtype)
    assert out.dtype == out_dtype and out.shape == (n,)
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))  # (the bits: NaN too)


def test_strided_data_is_read_as_its_values():
    data, scale_inv = _encoded(3, 256, torch.float8_e4m3fn, 128, 5)
    wide = torch.zeros(3, 300, dtype=torch.uint8)
    wide[:, :256] = data.view(torch.uint8)
    strided = wide[:, :256].view(torch.float8_e4m3fn)
    assert not strided.is_contiguous()
    assert torch.equal(_ops.dequantize_sum(strided, scale_inv, 128, 1.0, torch.float32),
                       _ops.dequantize_sum(data, scale_inv, 128, 1.0, torch.float32))


def test_a_block_that_held_inf_or_nan_sums_to_nan_and_zero_blocks_to_zero():
    x = torch.randn(2, 384)
    x[0, 5] = float("inf")
    x[1, 200] = float("nan")
    x[:, 256:] = 0.0
    data, scale_inv = _ops.quantize_blockwise(x, torch.float8_e4m3fn, 1, 128, False)
    out = _ops.dequantize_sum(data, scale_inv, 128, 2.0, torch.float32)
    assert out[:256].isnan().all()  # block 0 of rank 0, block 1 of rank 1: never a finite value
    assert torch.equal(out[256:], torch.zeros(128))


def test_empty_rows_and_columns():
    for rows, n in [(0, 10), (3, 0), (0, 0)]:
        data = torch.zeros(rows, n, dtype=torch.float8_e4m3fn)
        out = _ops.dequantize_sum(data, torch.ones(rows, -(-n // 4)), 4, 1.0, torch.bfloat16)
        assert out.shape == (n,) and out.dtype == torch.bfloat16
        assert torch.equal(out, torch.zeros(n, dtype=torch.bfloat16))


@pytest.mark.parametrize("change,match", [
    (dict(data=torch.zeros(2, 8)), "data must be 2-D float8"),
    (dict(data=torch.zeros(8, dtype=torch.float8_e4m3fn)), "data must be 2-D float8"),
    (dict(scale_inv=torch.ones(2, 3)), r"scale_inv must be float32 \[2, 2\]"),
    (dict(scale_inv=torch.ones(2, 2, dtype=torch.float64)), "scale_inv must be float32"),
    (dict(block_size=0), "block_size must be positive"),
    (dict(divisor=0.0), "divisor must be positive and finite"),
    (dict(divisor=float("inf")), "divisor must be positive and finite"),
    (dict(out_dtype=torch.float8_e4m3fn), "out_dtype must be float32, bfloat16 or float16"),
])
def test_bad_input_is_a_clear_error(change, match):
    args = dict(data=torch.zeros(2, 8, dtype=torch.float8_e4m3fn), scale_inv=torch.ones(2, 2),
                block_size=4, divisor=1.0, out_dtype=torch.float32)
    args.update(change)
    with pytest.raises((ValueError, RuntimeError), match=match):
        _ops.dequantize_sum(**args)


def test_opcheck_and_inputs_unchanged():
    data, scale_inv = _encoded(3, 300, torch.float8_e4m3fn, 128, 9)
    before = (data.view(torch.uint8).clone(), scale_inv.clone())
    # torch's schema check compares inputs with torch.allclose, which has no float8 kernel on the
    # CPU (as in tests/test_ops.py): the inputs' bytes are compared here instead
    tests = ["test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"]
    for args in [(data, scale_inv, 128, 1.0, torch.float32),
                 (data, scale_inv, 128, 3.0, torch.bfloat16)]:
        torch.library.opcheck(_ops.dequantize_sum.default, args, test_utils=tests)
    assert torch.equal(data.view(torch.uint8), before[0]) and torch.equal(scale_inv, before[1])


def test_torch_compile_traces_the_op():
    data, scale_inv = _encoded(2, 256, torch.float8_e4m3fn, 128, 3)

    def f(d, s):
        return _ops.dequantize_sum(d, s, 128, 2.0, torch.float32) * 2

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    assert torch.equal(compiled(data, scale_inv), f(data, scale_inv))
