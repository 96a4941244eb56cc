"""How the layers learn that FSDP2 or a tensor-parallel style sharded their weights, without
importing fp8ops.distributed (which sits above them): hooks that fp8ops registers here
(fp8ops/__init__.py), taken from fp8ops.distributed. FSDP2 and the tensor-parallel styles set
their parameters through setattr (FSDP2 swaps the sharded one and the gathered copy in and out),
which FP8Linear and FP8GroupedLinear define; a converted transformers experts module, which
does not, hands its sharded parameters over before FSDP2's first forward (hf_moe.py)."""
from __future__ import annotations

import sys

# hook(layer, dtensor): a DTensor was set as an FP8Linear's or an FP8GroupedLinear's weight
SHARDED_WEIGHT_HOOKS: list = []

# hook(module, name, dtensor): the 3-D parameter `name` of a converted transformers experts
# module is FSDP2's sharded DTensor
SHARDED_EXPERTS_HOOKS: list = []


def is_dtensor(t) -> bool:
    # no DTensor can exist before its module is imported (keeps importing fp8ops light)
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)
