import ml_dtypes
import numpy as np
import pytest
import torch

import fp8ops
from fp8ops.formats import E4M3, E5M2, get_format


@pytest.mark.parametrize("fmt, ml", [(E4M3, ml_dtypes.float8_e4m3fn), (E5M2, ml_dtypes.float8_e5m2)])
def test_format_facts_match_ml_dtypes(fmt, ml):
    info = ml_dtypes.finfo(ml)
    assert fmt.max == float(info.max)
    assert 2.0 ** fmt.emin == float(info.smallest_normal)
    assert fmt.mbits == info.nmant
    assert 2.0 ** fmt.emax <= fmt.max < 2.0 ** (fmt.emax + 1)
    assert fmt.dtype.itemsize == 1 and torch.finfo(fmt.dtype).max == fmt.max


def test_get_format_accepts_names_dtypes_and_formats():
    assert get_format("e4m3") is E4M3 and get_format("E5M2") is E5M2
    assert get_format(torch.float8_e5m2) is E5M2 and get_format(fp8ops.E4M3) is E4M3


@pytest.mark.parametrize("bad", ["e3m4", "fp8", torch.float16, None, 3])
def test_get_format_rejects_unknown(bad):
    with pytest.raises(ValueError, match="unknown FP8 format"):
        get_format(bad)
