import os

import pytest
import torch

# The CPU tests check the emulation; never let a stray environment pick another backend.
os.environ.setdefault("FP8OPS_FORCE_EMULATION", "0")


def has_fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
