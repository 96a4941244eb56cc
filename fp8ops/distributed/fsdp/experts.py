"""Experts [E, out, in] under FSDP2's FP8 all-gather (current and delayed scaling, a scale per
expert; blockwise, 128x128 blocks per expert): a 3-D expert parameter with its own recipe and
WeightCache (ExpertParameter: an FP8GroupedLinear's weight, a converted transformers experts
module's gate_up_proj / up_proj / down_proj). FSDP2 shards dim 0, so each rank holds whole
experts and casts them as the unsharded layer does, no all-reduce; data and per-expert scales
are gathered. The shard's cast is kept in the parameter's WeightCache (source: the sharded
parameter) and reused under its rule: once per optimizer step. Delayed scaling steps the
experts' weight role when that cache opens a window, as the unsharded layer's does (every rank
alike: their states are identical), and casts the rank's experts with their slice of the role's
[E] scales; the warm start's and the records' amaxes are [E] with 0 for the experts held
elsewhere, folded over the ranks by a MAX all-reduce (the record's: the backward's one,
scaling/amax_reduction.py). Experts that do not split evenly over the ranks (FSDP2 then takes no
scales beside the padded shard's bytes), placements other than Shard(0) (an expert split over
ranks) and experts stored [E, in, out] gather in high precision, logged once per parameter with
the reason (experts_gather_refusal).
"""
from __future__ import annotations

import logging
import weakref
from typing import Optional

import torch
from torch.distributed.tensor import DTensor, Shard

from ...nn.autograd import in_recompute
from ...nn.grouped import FP8GroupedLinear
from ...nn.quantizers import quantizer_for, quantizer_type
from ...ops.expert_casts import experts_amax, quantize_experts_scaled
from ...scaling import recipe_formats, weight_cache

logger = logging.getLogger("fp8ops.fsdp")


def experts_gather_refusal(layer, dtensor: DTensor) -> Optional[str]:
    """Why FSDP2 cannot gather these experts [E, out, in] in FP8 (an FP8GroupedLinear's weight
    or an ExpertParameter; None: it can). The experts' scales (one per expert, or 128x128
    blocks per expert) are computed on the rank that holds the expert whole, which FSDP2's
    default Shard(0) gives: no all-reduce (delayed scaling: the role's scales, the same on every
    rank; only its warm start and records all-reduce amaxes)."""
    layer = target(layer)
    if tuple(dtensor.placements) != (Shard(0),) or dtensor.device_mesh.ndim != 1:
        return (f"the weight is placed {tuple(dtensor.placements)} on a {dtensor.device_mesh.ndim}"
                f"-D mesh, not Shard(0) (whole experts per rank) on a 1-D one: an expert split "
                f"over ranks would need its scale from every piece")
    quantizer = quantizer_for(layer.recipe)
    if not quantizer.grouped:
        return f"{type(layer.recipe).__name__} has no FP8 gather for experts"
    if quantizer.delayed and layer.state is None:
        return "the delayed-scaling experts have no ExpertScalingState of their recipe yet"
    if layer.transposed:
        return ("the experts are stored [E, in, out] (is_transposed): the gathered FP8 bytes "
                "would be read through a transposed view")
    experts, world = dtensor.shape[0], dtensor.device_mesh.size()
    if experts % world:
        # FSDP2 pads the last shard and then takes extension inputs only of the padded shard's
        # shape: no room for the scales beside the bytes
        return (f"{experts} experts do not split evenly over {world} ranks (FSDP2 takes no "
                f"per-expert scales beside the bytes of a padded shard)")
    return None


class ExpertParameter:
    """A 3-D expert parameter (an FP8GroupedLinear's `weight`, a converted transformers experts
    module's `gate_up_proj` / `up_proj` / `down_proj`) as the FP8 gather sees it: its module,
    its name there, the recipe and the WeightCache its casts go through. One per parameter
    (expert_parameter), alive as long as its module; it holds the module weakly."""

    def __init__(self, module, name: str):
        self._module = weakref.ref(module)
        self.name = name

    @property
    def module(self):
        return self._module()

    @property
    def recipe(self):
        module = self.module
        return module.recipe if isinstance(module, FP8GroupedLinear) else module.fp8_recipe

    @property
    def weight_cache(self):
        module = self.module
        if isinstance(module, FP8GroupedLinear):
            return module.weight_cache
        return module.__dict__["fp8_weight_caches"][self.name]

    @property
    def state(self):
        """The experts' ExpertScalingState (DelayedScaling; None otherwise, or while the module
        has none of its recipe)."""
        module = self.module
        states = module._modules.get("fp8_state")
        if states is not None and not isinstance(module, FP8GroupedLinear):
            states = states[self.name] if self.name in states else None
        recipe = self.recipe
        if states is None or not quantizer_type(recipe)[0].delayed or states.recipe != recipe:
            return None
        return states

    @property
    def fp8_all_gather(self) -> bool:
        return bool(getattr(self.module, "fp8_all_gather", True))

    @property
    def transposed(self) -> bool:
        """Stored [E, in, out] (a transformers module's is_transposed)."""
        return bool(getattr(self.module, "is_transposed", False))

    @property
    def description(self) -> str:
        """What the recipe agreement's error names."""
        module = self.module
        return f"the experts {self.name} {tuple(getattr(module, self.name).shape)} of " \
               f"{type(module).__name__}"

    def __repr__(self):
        return f"ExpertParameter({type(self.module).__name__}.{self.name})"


# module -> {parameter name: its ExpertParameter}
_EXPERT_PARAMETERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def expert_parameter(module, name: str) -> ExpertParameter:
    """The ExpertParameter of module's 3-D parameter `name` (the same object every call)."""
    params = _EXPERT_PARAMETERS.setdefault(module, {})
    if name not in params:
        params[name] = ExpertParameter(module, name)
    return params[name]


def target(layer):
    """What the FP8 gather works on: an FP8GroupedLinear's weight is an ExpertParameter."""
    return expert_parameter(layer, "weight") if isinstance(layer, FP8GroupedLinear) else layer


# the layers whose FP8 gather was refused, already reported (once per layer)
_REPORTED: "weakref.WeakSet" = weakref.WeakSet()


def report_refusal(layer, reason: str) -> None:
    """Log why FSDP2 gathers these experts in high precision, once per parameter."""
    if layer not in _REPORTED:
        _REPORTED.add(layer)
        logger.info("FSDP2 gathers %r in high precision: %s", layer, reason)


def is_experts(layer) -> bool:
    """Whether the FP8 gather's `layer` (target's) is a 3-D expert parameter."""
    return isinstance(layer, ExpertParameter)


def follow_shard(layer, dtensor: DTensor) -> None:
    """Experts gathered in high precision: their cache still reads its values from FSDP2's
    sharded parameter, which the optimizer holds. The gathered full weight is a tensor of its
    own at every forward; without this, no optimizer would vouch for a cast of it, every
    micro-batch would cast anew and a delayed-scaling weight role would step each time, where
    one process steps once per accumulation window. (The dense layers follow theirs in their
    __setattr__.)"""
    layer = target(layer)
    if is_experts(layer):
        follow_source(layer.weight_cache, dtensor)


def follow_source(cache, dtensor: DTensor) -> None:
    """The experts' cache reads its values from FSDP2's sharded parameter: an optimizer step over
    it ends a cast (the dense layers do this in their __setattr__)."""
    if cache.source_tensor() is not dtensor:
        cache.source = weakref.ref(dtensor)
    cache.watch(dtensor)


def shard_cast(layer, shard: torch.Tensor, stored: torch.Tensor, dtype: torch.dtype,
               mesh) -> tuple:
    """(kind, data, scale_inv) of this rank's experts, rounded to the gather's dtype and cast
    each on its own as the unsharded layer casts them (whole experts: their scales are local).
    Cast once per optimizer step under the weight cache's rule, with FSDP2's sharded parameter
    as the values' source: every gather of the window (micro-batches, backward re-gathers) takes
    the same bytes. A backward's re-gather needs the key alone: nothing may change a weight
    between a forward and its backward. Delayed scaling steps the weight role when the cache
    says the unsharded layer would (a training forward opening a window): the same decision on
    every rank, whose states are identical. stored: the shard as the sharded parameter stores it,
    the cache's key (with FSDP2's CPUOffloadPolicy `shard` is a fresh device copy of it)."""
    cache, recipe = layer.weight_cache, layer.recipe
    made_for = (recipe, dtype)
    backward = torch._C._current_graph_task_id() != -1
    if quantizer_type(recipe)[0].delayed:
        held = _held_experts(shard, mesh)
        cast = _delayed_shard_cast(layer.state, recipe, shard, dtype, held, made_for)
        live = not backward and layer.module.training and not in_recompute()
    else:
        def cast(_, step, scale):  # (weight_cache.Cast: no delayed scaling: no step, no scale)
            return (made_for, _cast_expert_values(shard.to(dtype), recipe)), None
        live = False

    trust = weight_cache.KEY if backward else cache.trust
    with torch.no_grad():
        made, payload = cache.get(stored, cast, live=live, trust=trust,
                                  source=cache.source_tensor())
        if made != made_for:  # the recipe or the gather's dtype changed since that cast
            cache.invalidate()
            made, payload = cache.get(stored, cast, live=live, trust=trust,
                                      source=cache.source_tensor())
    return payload


def _held_experts(shard: torch.Tensor, mesh) -> slice:
    """The experts of the whole weight this rank's shard holds (Shard(0), split evenly)."""
    start = mesh.get_local_rank() * shard.shape[0]
    return slice(start, start + shard.shape[0])


def _delayed_shard_cast(state, recipe, shard: torch.Tensor, dtype: torch.dtype, held: slice,
                        made_for):
    """weight_cache.Cast of delayed-scaling experts on this rank's shard: the grouped layer's
    (nn/grouped_quantizers.py: GroupedDelayed.cast_experts) with the scales [E] of the whole
    weight, of which the shard takes its experts' slice. The role's scales are the same on every
    rank (their records are all-reduced), so the cache keeps (and a checkpoint saves) the whole
    [E]. Experts held elsewhere add 0 to the warm start's and the record's amaxes: the MAX over
    the ranks is each expert's own amax."""
    fwd, _ = recipe_formats(recipe)
    role = state.weight

    def whole(amax):  # (on the state's device: with FSDP2's CPUOffloadPolicy the shard is not)
        return _spread(amax.to(role.pending_amax.device), held, state.num_experts)

    def cast(_, step, scale):
        values = shard.to(dtype)
        if scale is None:
            if step:
                state.step_role("weight", recipe, fwd, recipe.margin)
            scale = (role.scale.clone() if role.started else
                     role.warm_scale(whole(experts_amax(values)), fwd, recipe.margin, recipe))
        mine = scale[held].to(values.device)
        data, _, amax = quantize_experts_scaled(values, mine, fwd.dtype, transpose=False)
        if step:  # recorded on this rank: the backward's one all-reduce folds the ranks in
            state.record_role("weight", whole(amax))
            role.started = True
        return (made_for, ("experts", data, torch.reciprocal(mine))), scale
    return cast


def _spread(amax: torch.Tensor, held: slice, experts: int) -> torch.Tensor:
    """This rank's experts' amax in the whole weight's [E], 0 for the experts held elsewhere
    (the identity of a MAX over amaxes)."""
    whole = amax.new_zeros(experts)
    whole[held] = amax
    return whole


def _cast_expert_values(values: torch.Tensor, recipe) -> tuple:
    """(kind, data, scale_inv) of experts [E, out, in]: the expert casts of the grouped layer,
    without their transposed copies (made after the gather: FP8GatheredWeight.expert_payload)."""
    quantizer = quantizer_for(recipe)
    cast = quantizer.expert_cast(values, transpose=False)
    if quantizer.kind == "blockwise":  # (data, scale_inv, data^T, scale_inv^T)
        return "experts_blockwise", cast[0], cast[1]
    return "experts", cast[0], cast[2]  # (data, data^T, scale_inv)


def stepped_cast(cache) -> bool:
    """Whether the cache's shard cast is one a training forward stepped delayed scaling for,
    of the weight's current values."""
    entry = cache.entry
    return entry is not None and entry.stepped and entry.generation == cache.value
