import pytest
import torch


def has_fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


@pytest.fixture(autouse=True)
def _fp8_at_every_shape(request, monkeypatch):
    """The tests check FP8 numerics at small shapes, where a GPU's measured crossover
    (fp8ops.nn.fallback.MEASURED) sends a layer to its high-precision GEMMs: without the table
    every layer runs FP8 on every device. Tests of the fallback itself are marked
    measured_fallback and see the table."""
    if request.node.get_closest_marker("measured_fallback") is None:
        from fp8ops.nn import fallback
        monkeypatch.setattr(fallback, "MEASURED", {})


@pytest.fixture
def one_thread():
    """torch on one intra-op thread for the test. A smoke run measures nothing, and on a loaded
    machine every parallel region of its many small ops waits for a thread that is not running:
    on 2 busy cores, bench/profile_linear.py's op costs took 7 s on two threads, 0.2 s on one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def skip_without_fp8_kernels() -> None:
    """Skip the calling test unless this GPU has FP8 and fp8ops' CUDA kernels are loaded."""
    from fp8ops.ops import backend
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("GPU has no FP8 (compute capability < 8.9)")
    if not backend.extension_loaded():
        pytest.skip("fp8ops._C not loaded: " + backend._state["why_not"])
