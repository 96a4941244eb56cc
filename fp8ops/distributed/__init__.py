"""FP8 training on torch.distributed's own engines, built on the layers: FSDP2's FP8 weight
all-gather (fsdp/), DTensor tensor-parallel styles for FP8Linear (tensor_parallel.py),
gradient reductions in FP8 for FSDP2 and DDP (wire/: fp8_reduce_scatter, fp8_compress_hook) and
expert parallelism with FP8 token dispatch (expert_parallel/: FP8ExpertParallel). The
layers learn of them only through hooks: fp8ops registers on_sharded_weight and
on_sharded_experts in nn.sharding's hook lists. (The amax all-reduces the scaling states make,
beneath the layers, are in fp8ops.scaling: amax_all_reduce.py, amax_reduction.py, agreement.py.)
Public names are re-exported at fp8ops.* lazily, and loaded here on first use, so that
`import fp8ops` does not import torch.distributed.tensor."""


import weakref

from ..scaling.agreement import check_recipes

# public names of the submodules that import torch.distributed's engines: loaded on first use
_LAZY = {
    "fp8_reduce_scatter": "wire", "FP8ReduceScatter": "wire", "fp8_compress_hook": "wire",
    "FP8ExpertParallel": "expert_parallel",
}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'fp8ops.distributed' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


# layer -> the process groups (by id) whose ranks have compared its recipe
_AGREED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def on_sharded_weight(layer, dtensor) -> None:
    """An FP8Linear or FP8GroupedLinear was given a DTensor weight (FSDP2's sharded parameter, or
    a tensor-parallel style's): the first time, check that every rank of its mesh converted the
    layer with the same recipe (every rank shards the same layers in the same order); then have
    FSDP2 gather it in FP8 where the recipe allows. Registered by fp8ops in
    nn.sharding.SHARDED_WEIGHT_HOOKS; fsdp/ is imported with the first DTensor weight."""
    agreed = _AGREED.setdefault(layer, set())
    mesh = dtensor.device_mesh
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        if id(group) not in agreed:
            agreed.add(id(group))
            check_recipes(layer.recipe, group, once=False, what=_what(layer))
    from . import fsdp
    if fsdp.gathers_fp8(layer, dtensor):
        fsdp.install(layer, dtensor)
    else:
        fsdp.follow_shard(layer, dtensor)


def on_sharded_experts(module, name: str, dtensor) -> None:
    """A converted transformers experts module's 3-D parameter `name` is FSDP2's sharded
    DTensor: as on_sharded_weight, for that parameter (fsdp.ExpertParameter). Registered by
    fp8ops in nn.sharding.SHARDED_EXPERTS_HOOKS: nn.hf_moe calls it before FSDP2's first
    forward (when FSDP2 looks for the extension)."""
    from . import fsdp
    on_sharded_weight(fsdp.expert_parameter(module, name), dtensor)


def _what(layer) -> str:
    """The layer as the recipe agreement's error names it."""
    description = getattr(layer, "description", None)
    if description is not None:
        return description
    return f"an {type(layer).__name__}({layer.in_features}, {layer.out_features})"
