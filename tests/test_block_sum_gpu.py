"""The FP8 reduction's receiving end on a GPU: the CUDA dequantize_sum (csrc/block_sum.cu) writes
the bytes of the emulation on the CPU (fp8ops/ops/block_sum.py) for both formats, every output
dtype, ragged blocks, NaN and zero blocks; the FP8 reduce-scatter and DDP hook run on NCCL (one
process: the loopback path). Skipped without a CUDA GPU with FP8 (sm_89+)."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import fp8ops

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("needs a CUDA GPU with FP8 (sm_89+)", allow_module_level=True)

_ops = torch.ops.fp8ops


def _poison():
    """Fill freed cached memory with NaN so an output element the kernel does not write reads NaN."""
    torch.full((1 << 24,), float("nan"), device="cuda")
    torch.cuda.synchronize()


def _encoded(rows, n, dtype, block, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g) * torch.logspace(-3, 2, rows).unsqueeze(1)
    if n > 400:
        x[0, 150] = float("nan")  # a NaN block of row 0
        x[:, 256:384] = 0.0  # zero blocks in every row
    return _ops.quantize_blockwise(x, dtype, 1, block, False)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("rows,n,block", [(1, 1, 128), (2, 300, 128), (3, 1001, 32),
                                          (8, 1 << 16, 128)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("divisor", [1.0, 3.0])
def test_cuda_kernel_writes_the_emulations_bytes(dtype, rows, n, block, out_dtype, divisor):
    data, scale_inv = _encoded(rows, n, dtype, block, rows + n)
    want = _ops.dequantize_sum(data, scale_inv, block, divisor, out_dtype)
    _poison()
    got = _ops.dequantize_sum(data.cuda(), scale_inv.cuda(), block, divisor, out_dtype)
    assert got.is_cuda and got.dtype == out_dtype
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))


def test_cuda_kernel_of_empty_and_strided_inputs():
    data, scale_inv = _encoded(3, 256, torch.float8_e4m3fn, 128, 1)
    wide = torch.zeros(3, 320, dtype=torch.uint8, device="cuda")
    wide[:, :256] = data.view(torch.uint8).cuda()
    got = _ops.dequantize_sum(wide[:, :256].view(torch.float8_e4m3fn), scale_inv.cuda(), 128, 1.0,
                              torch.float32)
    assert torch.equal(got.cpu(), _ops.dequantize_sum(data, scale_inv, 128, 1.0, torch.float32))
    empty = _ops.dequantize_sum(torch.zeros(2, 0, dtype=torch.float8_e4m3fn, device="cuda"),
                                torch.ones(2, 0, device="cuda"), 128, 1.0, torch.bfloat16)
    assert empty.shape == (0,) and empty.is_cuda


def test_fp8_reductions_on_nccl_with_one_process():
    """World size 1: the reduce-scatter and the DDP hook round-trip a gradient through FP8
    blocks on the GPU, equal to the CPU's bytes."""
    from fp8ops.distributed.wire import blocks
    from fp8ops.distributed.wire.reduce_scatter import reduce_scatter_fp8
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        x = torch.randn(1000, device="cuda") * 3
        out = torch.empty(1000, device="cuda")
        reduce_scatter_fp8(out, x, dist.group.WORLD, 1.0, torch.float8_e4m3fn, 128)
        cpu = blocks.decode_sum(blocks.encode(x.cpu().view(1, -1), torch.float8_e4m3fn, 128), 1000,
                                torch.float8_e4m3fn, 128, 1.0, torch.float32)
        assert torch.equal(out.cpu(), cpu)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 32).cuda())
        model.register_comm_hook(None, fp8ops.distributed.fp8_compress_hook)
        model(torch.randn(8, 64, device="cuda")).square().sum().backward()
        assert all(p.grad.isfinite().all() for p in model.parameters())
    finally:
        dist.destroy_process_group()
