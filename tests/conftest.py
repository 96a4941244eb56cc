import pytest
import torch


def has_fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
