"""FP8 training on torch.distributed's own engines: FSDP2's FP8 weight all-gather (fsdp.py) and
DTensor tensor-parallel styles for FP8Linear (tensor_parallel.py), both built on the layers; and
beneath the layers, the amax all-reduces the scaling state makes (amax.py: one amax over the
ranks or the shards of a tensor; amax_reduction.py: one all-reduce per backward pass for every
delayed-scaling layer). Public names are re-exported at fp8ops.* lazily, so that `import fp8ops`
does not import torch.distributed.tensor."""


import sys
import weakref

# layer -> the process groups (by id) whose ranks have compared its recipe (agreement.py)
_AGREED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def on_sharded_weight(layer, dtensor) -> None:
    """An FP8Linear or FP8GroupedLinear was given a DTensor weight (FSDP2's sharded parameter, or
    a tensor-parallel style's): the first time, check that every rank of its mesh converted the
    layer with the same recipe (every rank shards the same layers in the same order); then have
    FSDP2 gather it in FP8 where the recipe allows. Registered by fp8ops in
    nn.modules.SHARDED_WEIGHT_HOOKS (FP8GroupedLinear calls on_weight_set); fsdp.py is imported
    with the first DTensor weight."""
    agreed = _AGREED.setdefault(layer, set())
    mesh = dtensor.device_mesh
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        if id(group) not in agreed:
            from .agreement import check_recipes
            agreed.add(id(group))
            check_recipes(layer.recipe, group, once=False, what=_what(layer))
    from . import fsdp
    if fsdp.gathers_fp8(layer, dtensor):
        fsdp.install(layer, dtensor)
    else:
        fsdp.follow_shard(layer, dtensor)


def on_sharded_experts(module, name: str, dtensor) -> None:
    """A converted transformers experts module's 3-D parameter `name` is FSDP2's sharded
    DTensor: as on_sharded_weight, for that parameter (fsdp.ExpertParameter). Called by
    nn.hf_moe before FSDP2's first forward (when FSDP2 looks for the extension)."""
    from . import fsdp
    on_sharded_weight(fsdp.expert_parameter(module, name), dtensor)


def _what(layer) -> str:
    """The layer as the recipe agreement's error names it."""
    description = getattr(layer, "description", None)
    if description is not None:
        return description
    return f"an {type(layer).__name__}({layer.in_features}, {layer.out_features})"


def on_weight_set(layer, value) -> None:
    """A layer's weight was set: a DTensor goes to on_sharded_weight. (No DTensor can exist
    before its module is imported: `import fp8ops` stays light.)"""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(value, dtensor.DTensor):
        on_sharded_weight(layer, value)
