"""fp8ops/ops/bf16_rounding.py: stochastic rounding of float32 to bfloat16, against a reference
on the bits (numpy) and against its statistical promise (unbiased)."""
import numpy as np
import pytest
import torch

from fp8ops.ops import bf16_rounding, philox
from fp8ops.ops.bf16_rounding import stochastic_round_bf16


def _reference(x: torch.Tensor, seed: int, offset: int) -> np.ndarray:
    """The rule written out in numpy: round the magnitude up (away from zero) iff the low 16
    bits plus the word's top 16 bits carry; NaN stays NaN. Returns the bf16 bits (uint16)."""
    bits = x.numpy().view(np.uint32).astype(np.uint64)
    words = philox.random_words(x.numel(), seed, offset, "cpu").numpy().astype(np.uint64)
    low, r = bits & 0xFFFF, words >> 16
    up = (low + r) >= 0x10000
    top = (bits >> 16) + up.astype(np.uint64)
    out = top.astype(np.uint16)
    nan = np.isnan(x.numpy())
    out[nan] = x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)[nan]
    return out


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("seed,offset", [(0, 0), (7, 3), (2**40 + 5, 2**33 + 1)])
def test_equals_the_rule_on_the_bits(seed, offset):
    x = torch.randn(10_001) * torch.logspace(-40, 38, 10_001).float()
    x[::97] = -x[::97]
    got = stochastic_round_bf16(x, seed, offset)
    assert np.array_equal(_bits(got), _reference(x, seed, offset))


def test_result_is_one_of_the_two_neighbours():
    x = torch.randn(50_000)
    got = stochastic_round_bf16(x, 1, 2).float()
    down = (x.view(torch.int32) & ~0xFFFF).view(torch.float32)  # toward zero
    up = ((x.view(torch.int32) & ~0xFFFF) + 0x10000).view(torch.float32)
    assert bool(((got == down) | (got == up)).all())
    assert 0.3 < float((got == up).float().mean()) < 0.7


def test_grid_values_special_values_and_extremes():
    fmax = torch.finfo(torch.float32).max
    x = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1.0, -2.5,
                      torch.finfo(torch.float32).tiny / 8])
    got = stochastic_round_bf16(x, 3, 4)
    assert torch.equal(got[:4].float(), x[:4])
    assert torch.equal(torch.signbit(got[:2]), torch.tensor([False, True]))
    assert torch.isnan(got[4])
    assert torch.equal(got[5:7].float(), x[5:7])  # on the bf16 grid: kept
    big = stochastic_round_bf16(torch.full((4096,), fmax), 0, 0).float()
    bf16_max = torch.finfo(torch.bfloat16).max
    assert bool(((big == bf16_max) | (big == float("inf"))).all())
    assert bool((big == float("inf")).any())  # rounds up with probability 65535/65536


def test_unbiased():
    value = 1.0 + 2.0 ** -10  # 1/64 of a bf16 ulp above 1
    x = torch.full((1 << 20,), value)
    mean = stochastic_round_bf16(x, 11, 0).double().mean().item()
    # the mean of 2^20 draws of a 1/64 chance of an ulp (2^-7): std of the mean ~ 1.9e-6
    assert abs(mean - value) < 2e-5


def test_pieces_give_the_same_bytes(monkeypatch):
    x = torch.randn(3 * 1000 + 7)
    whole = stochastic_round_bf16(x, 5, 9)
    monkeypatch.setattr(bf16_rounding, "PIECE", 1000)
    assert torch.equal(stochastic_round_bf16(x, 5, 9).view(torch.int16),
                       whole.view(torch.int16))


def test_random_words_from_an_element():
    whole = philox.random_words(1000, 4, 8, "cpu")
    assert torch.equal(philox.random_words(600, 4, 8, "cpu", first=400), whole[400:])
    with pytest.raises(ValueError, match="multiple of 4"):
        philox.random_words(10, 4, 8, "cpu", first=3)


def test_out_shapes_and_errors():
    x = torch.randn(4, 6)
    out = torch.empty(6, 4, dtype=torch.bfloat16).t()  # not contiguous
    stochastic_round_bf16(x, 0, 0, out=out)
    assert torch.equal(out, stochastic_round_bf16(x, 0, 0))
    assert stochastic_round_bf16(torch.empty(0, 3), 0, 0).shape == (0, 3)
    with pytest.raises(TypeError, match="float32"):
        stochastic_round_bf16(x.double(), 0, 0)
    with pytest.raises(ValueError, match="out must be bfloat16"):
        stochastic_round_bf16(x, 0, 0, out=torch.empty(4, 6))
