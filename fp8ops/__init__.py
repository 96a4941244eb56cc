"""fp8ops: FP8 training for PyTorch.

Exact emulation everywhere (CPU, any GPU), CUDA cast kernels on sm_89+, a CUTLASS FP8 GEMM on
Hopper. See README.md; the numerics are those of docs/design.md, with the finer choices in
docs/numerics.md.

Subpackages: ops/ (the torch.ops.fp8ops operators and their implementations), scaling/ (the
recipes, ScalingState, the weight cache and the amax all-reduces across ranks), nn/ (autograd
Functions, fp8ops.linear, FP8Linear and convert_to_fp8), optim/ (CPU offload of masters and
optimizer state, FP8AdamW), distributed/ (FSDP2 and tensor parallelism). Beside them:
formats, tensors (quantize / gemm), monitoring and memory. Each layer imports only those below
it: formats < ops < scaling < nn (and tensors) < optim, distributed < monitoring, memory and this
module (tests/test_layering.py).
"""
import sys

from . import ops  # noqa: F401  (defines the torch.ops.fp8ops operators)
from .formats import E4M3, E5M2, FP8Format
from .monitoring import monitor, stats, unmonitor
from .nn.activations import fp8_activations
from .nn.caches import invalidate
from .nn.fallback import Crossover
from .nn.functional import linear
from .nn.grouped import FP8GroupedLinear, grouped_linear
from .nn.modules import (FP8Conv1D, FP8Linear, convert_from_fp8, convert_to_fp8,
                         plain_state_dict)
from .nn.sharding import SHARDED_EXPERTS_HOOKS, SHARDED_WEIGHT_HOOKS
from .ops.backend import backend
from .optim.fp8_adamw import FP8Adam, FP8AdamW
from .optim.offload import CPUOffloadOptimizer
from .scaling import (BlockwiseScaling, CurrentScaling, DelayedScaling, MXFP8Scaling,
                      ScalingState)
from .tensors import (BlockwiseTensor, Float8Tensor, MXTensor, amax, dequantize, gemm, quantize,
                      quantize_blockwise, quantize_mx)
from .distributed import on_sharded_experts, on_sharded_weight

# the layers know nothing of FSDP2 (nn/ sits below distributed/): its FP8 all-gather installs
# itself on their sharded weights, dense, grouped and transformers' experts alike
SHARDED_WEIGHT_HOOKS.append(on_sharded_weight)
SHARDED_EXPERTS_HOOKS.append(on_sharded_experts)
del SHARDED_EXPERTS_HOOKS, SHARDED_WEIGHT_HOOKS, on_sharded_experts, on_sharded_weight

__version__ = "0.1.0"

# pickles made before the nn/ and optim/ subpackages name classes by these old module paths
_MOVED = {
    "fp8ops.cast_stats": "fp8ops.nn.cast_stats",
    "fp8ops.fallback": "fp8ops.nn.fallback",
    "fp8ops.host_weight": "fp8ops.optim.host_weight",
    "fp8ops.modules": "fp8ops.nn.modules",
    "fp8ops.weight_cache": "fp8ops.scaling.weight_cache",
    "fp8ops.nn.weight_cache": "fp8ops.scaling.weight_cache",
    "fp8ops.amax_reduction": "fp8ops.scaling.amax_reduction",
}
sys.modules.update({old: sys.modules[new] for old, new in _MOVED.items()})

# public names whose modules import torch.distributed.tensor: loaded on first use, so that
# `import fp8ops` stays light
_LAZY = {
    "FP8ColwiseParallel": "fp8ops.distributed.tensor_parallel",
    "FP8RowwiseParallel": "fp8ops.distributed.tensor_parallel",
    "PrepareFP8ModuleInput": "fp8ops.distributed.tensor_parallel",
    "FP8ExpertParallel": "fp8ops.distributed.expert_parallel",
    "export_fp8": "fp8ops.export",  # (imports safetensors when it runs)
}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'fp8ops' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


__all__ = [
    "E4M3", "E5M2", "FP8Format", "quantize", "dequantize", "quantize_mx", "quantize_blockwise",
    "amax", "gemm", "linear", "DelayedScaling", "CurrentScaling", "MXFP8Scaling",
    "BlockwiseScaling", "ScalingState", "FP8Linear", "FP8Conv1D", "convert_to_fp8",
    "convert_from_fp8", "plain_state_dict", "CPUOffloadOptimizer", "backend", "Float8Tensor",
    "MXTensor", "BlockwiseTensor", "monitor", "stats", "unmonitor", "Crossover", *_LAZY,
    "FP8AdamW", "FP8Adam", "fp8_activations", "grouped_linear", "FP8GroupedLinear", "invalidate",
]
