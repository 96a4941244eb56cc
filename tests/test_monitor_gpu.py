"""fp8ops.monitor on a GPU: the statistics of a cast on CUDA are those of the same cast on the CPU,
and a sampled step's peak memory is an unsampled one's within the statistics' bounded pieces.
Skipped without an FP8 GPU."""
from __future__ import annotations

import pytest
import torch

import fp8ops
from fp8ops.ops import emulation
from test_monitor import _cases

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("needs a CUDA GPU with FP8 (sm_89+)", allow_module_level=True)


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c[0])
def test_cast_stats_on_cuda_are_the_cpus(case):
    name, x, data, sinv, br, bc, _ = case
    cpu = torch.ops.fp8ops.cast_stats(x, data, sinv, br, bc)
    gpu = torch.ops.fp8ops.cast_stats(x.cuda(), data.cuda(), sinv.cuda(), br, bc)
    assert gpu[0].cpu().tolist() == cpu[0].tolist(), name
    assert torch.equal(gpu[1].cpu(), cpu[1]) or (gpu[1].isnan() and cpu[1].isnan()), name


def test_a_sampled_step_takes_no_more_device_memory():
    def peak(every):
        torch.manual_seed(0)
        layer = fp8ops.FP8Linear(4096, 4096, bias=False, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        monitor = fp8ops.monitor(layer, every=every) if every else None
        layer(x).float().square().mean().backward()  # (the monitor samples its first forward)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        layer(x).float().square().mean().backward()
        torch.cuda.synchronize()
        del monitor
        return torch.cuda.max_memory_allocated()

    off, sampled = peak(None), peak(1)
    # the old statistics took about 13.5 bytes per input element: 430 MB here
    assert sampled - off <= 32 * emulation.STATS_PIECE, (sampled - off) / 2**20
