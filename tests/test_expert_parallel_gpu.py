"""FP8ExpertParallel on a GPU with NCCL and one process (the loopback path: every expert on this
rank, the all-to-alls local): the parallelized experts' forward and backward equal the
unparallelized layers' on the same tokens, for current and blockwise scaling. Skipped without a
CUDA GPU with FP8 (sm_89+)."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fp8ops

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("needs a CUDA GPU with FP8 (sm_89+)", allow_module_level=True)

EXPERTS, D_IN, D_HID, D_OUT = 4, 256, 128, 64


class Experts(nn.Module):
    def __init__(self, recipe):
        super().__init__()
        self.up = fp8ops.FP8GroupedLinear(EXPERTS, D_IN, D_HID, recipe=recipe, device="cuda")
        self.down = fp8ops.FP8GroupedLinear(EXPERTS, D_HID, D_OUT, recipe=recipe, device="cuda")

    def forward(self, x, offsets):
        return self.down(F.gelu(self.up(x, offsets)), offsets)


@pytest.fixture(scope="module")
def nccl_world_of_one():
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("recipe", [fp8ops.CurrentScaling(), fp8ops.BlockwiseScaling()],
                         ids=["current", "blockwise"])
def test_expert_parallel_with_one_rank_is_the_layers(nccl_world_of_one, recipe):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    torch.manual_seed(0)
    plain = Experts(recipe)
    parallel = Experts(recipe)
    parallel.load_state_dict(plain.state_dict())
    parallelize_module(parallel, init_device_mesh("cuda", (1,)), fp8ops.FP8ExpertParallel())
    g = torch.Generator(device="cuda").manual_seed(1)
    counts = torch.tensor([40, 0, 17, 71], device="cuda")
    offsets = counts.cumsum(0).to(torch.int32)
    x = torch.randn(int(counts.sum()), D_IN, device="cuda", generator=g)
    outs, grads = [], []
    for model in (plain, parallel):
        xi = x.clone().requires_grad_()
        y = model(xi, offsets)
        y.square().mean().backward()
        outs.append(y.detach())
        grads.append([xi.grad] + [p.grad.full_tensor() if hasattr(p.grad, "full_tensor")
                                  else p.grad for p in model.parameters()])
    assert torch.equal(outs[0], outs[1])  # the dispatched cast is the layer's own
    for a, b in zip(*grads, strict=True):
        # blockwise: wgrad's transposed copy is cast from the dispatched FP8 values (a second
        # rounding); current: the combine's gradient arrives as FP8 values
        assert (a - b).norm() <= 2 ** -4 * a.norm(), (a - b).norm() / a.norm()
