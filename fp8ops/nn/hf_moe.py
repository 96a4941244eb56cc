"""The mixture-of-experts layers of Hugging Face transformers in FP8.

transformers keeps a MoE layer's experts in one module (MixtralExperts, Qwen2MoeExperts,
Qwen3MoeExperts, DeepseekV3Experts, GptOssExperts, ...) holding 3-D parameters: `gate_up_proj`
[E, 2 * inter, hidden] (or `up_proj` without gating) and `down_proj` [E, hidden, inter], stored
[E, in, out] instead where the module says `is_transposed`, with biases `*_proj_bias` [E, out]
where it says `has_bias`. Its forward takes (hidden_states [T, hidden], top_k_index [T, k],
top_k_weights [T, k]).

convert_experts gives such a module a forward of its own (an instance attribute over the class's)
that sorts the token-expert pairs by expert and runs both projections through
fp8ops.grouped_linear; the parameters stay where they are, under their names, so
save_pretrained / from_pretrained and state_dict keep them as they are (delayed scaling adds
its buffers, below). The gating between the
projections is the module's own (`_apply_gate`, or `act_fn` without gating). Each 3-D parameter
has a WeightCache of its own (`fp8_weight_caches`, by parameter name): all its experts are cast
once per optimizer step (fp8ops.nn.grouped); `fp8_weight_caches[name].invalidate()` after a
`p.data` update between the steps of the optimizer that holds it. With DelayedScaling each 3-D
parameter also has its experts' delayed-scaling state, an ExpertScalingState in the submodule
`fp8_state` (a ModuleDict by parameter name, holding that parameter's weight cache): its buffers
are in the module's state_dict under `fp8_state.`, as an FP8Linear's are (plain_state_dict
leaves them out), and follow the module's device moves. Casts record in training mode only.
Under FSDP2 (fully_shard after the conversion, before the first forward) the 3-D parameters are
gathered in FP8 as FP8GroupedLinear's weight is (distributed/fsdp/experts.py; current, delayed and
blockwise scaling, experts not stored transposed); set `fp8_all_gather = False` on the experts
module before its first forward to gather them in high precision. A CPUOffloadOptimizer keeps
the 3-D parameters on the device as their FP8 casts only (optim/offload.py), as FP8Linear
weights; the module then stays converted (convert_from_fp8 refuses, as for an FP8Linear).
"""
from __future__ import annotations

import logging
import sys
import weakref
from collections import Counter
from typing import Callable, Optional

import torch
from torch import nn

from ..scaling import WeightCache
from ..scaling.expert_state import ExpertScalingState
from . import caches
from .grouped import grouped_linear
from .quantizers import quantizer_for, quantizer_type
from .sharding import SHARDED_EXPERTS_HOOKS

logger = logging.getLogger("fp8ops.modules")  # convert_to_fp8's logger


def is_hf_experts(mod: nn.Module) -> bool:
    """A transformers experts module (its class decorated by use_experts_implementation)."""
    up = getattr(mod, "gate_up_proj", None)
    if up is None:
        up = getattr(mod, "up_proj", None)
    down = getattr(mod, "down_proj", None)
    return (isinstance(up, nn.Parameter) and isinstance(down, nn.Parameter)
            and up.dim() == 3 and down.dim() == 3 and hasattr(mod, "is_transposed")
            and hasattr(mod, "num_experts"))


def convert_experts(module: nn.Module, recipe,
                    filter_fn: Optional[Callable[[nn.Module, str], bool]] = None) -> Counter:
    """Give every transformers experts module in `module` (itself included) filter_fn picks an
    FP8 forward with `recipe` (a converted one takes the new recipe; one that has it already
    keeps its FP8 state; None: CurrentScaling()). A recipe the grouped layer does not take
    (MXFP8Scaling, stochastic rounding, a percentile amax) leaves them in high precision, with a
    warning. Returns the count converted, by class name."""
    picked = [(fqn, mod) for fqn, mod in module.named_modules()
              if is_hf_experts(mod) and (filter_fn is None or filter_fn(mod, fqn))]
    kinds: Counter = Counter()
    if not picked:
        return kinds
    quantizer = quantizer_for(recipe)  # (None: CurrentScaling(), as convert_to_fp8)
    recipe = quantizer.recipe
    if not quantizer.grouped:
        logger.warning("fp8ops: convert_to_fp8 leaves %d mixture-of-experts module(s) in high "
                       "precision: their FP8 grouped layer takes CurrentScaling, "
                       "DelayedScaling or BlockwiseScaling (round-to-nearest gradients, no "
                       "percentile amax), not %r", len(picked), recipe)
        return kinds
    for _, mod in picked:
        if getattr(mod, "_is_expert_parallel", False):
            raise NotImplementedError("convert_to_fp8: expert-parallel experts modules are not "
                                      "supported by the FP8 grouped layer yet")
        if not _has_recipe(mod, recipe):
            mod.fp8_weight_caches = _new_caches(mod)
            _set_expert_states(mod, recipe)
        mod.fp8_recipe = recipe
        mod.forward = _FP8Forward(mod)
        _await_sharding(mod)
        kinds[type(mod).__name__] += 1
    return kinds


# FSDP2 gathers a converted module's 3-D parameters in FP8 (distributed/fsdp/) when their
# sharded local tensors carry its all-gather extension by FSDP2's first forward, which looks for
# it; FSDP2 sets its parameters on a module without a __setattr__ of its own unseen (the FP8
# layers have one). So until a converted module's own first forward, a global forward pre-hook
# (which runs before FSDP2's) hands its sharded parameters over: the modules in conversion order
# (the same on every rank: the recipe agreement is a collective), weakly held. Only for modules
# converted once torch.distributed is initialized (a model converted before
# init_process_group gathers in high precision).
_AWAITING: "list[weakref.ref]" = []
_AWAIT_HOOK = None


def _await_sharding(mod: nn.Module) -> None:
    global _AWAIT_HOOK
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return  # no FSDP2 without a process group: no global hook in a single process
    if not any(ref() is mod for ref in _AWAITING):
        _AWAITING.append(weakref.ref(mod))
    if _AWAIT_HOOK is None:
        _AWAIT_HOOK = nn.modules.module.register_module_forward_pre_hook(_offer_sharded)


def _stop_awaiting(mod: Optional[nn.Module]) -> None:
    """mod's parameters were handed over, or it ran unsharded: no more waiting for it (nor for
    modules gone); the global hook goes with the last one."""
    global _AWAIT_HOOK
    _AWAITING[:] = [ref for ref in _AWAITING if ref() is not None and ref() is not mod]
    if not _AWAITING and _AWAIT_HOOK is not None:
        _AWAIT_HOOK.remove()
        _AWAIT_HOOK = None


def _offer_sharded(module: nn.Module, args) -> None:
    """Before any module's forward: hand the sharded 3-D parameters of the awaiting converted
    modules to the hooks fp8ops.distributed installs (sharding.py; no DTensor can exist before
    its module is imported)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is None or torch.compiler.is_compiling():  # (FSDP2 starts eagerly)
        return
    for ref in list(_AWAITING):
        mod = ref()
        if mod is None or "fp8_weight_caches" not in mod.__dict__:
            _stop_awaiting(mod)  # (gone, or restored)
            continue
        sharded = {name: getattr(mod, name) for name in mod.fp8_weight_caches}
        if all(isinstance(p, dtensor.DTensor) for p in sharded.values()):
            for name, param in sharded.items():
                for hook in SHARDED_EXPERTS_HOOKS:
                    hook(mod, name, param)
            _stop_awaiting(mod)


def _new_caches(mod: nn.Module) -> dict:
    """A fresh weight cache per 3-D parameter. A weight a CPUOffloadOptimizer owns keeps its
    host master (the parameter is a placeholder): the new cache casts from there too."""
    old = mod.__dict__.get("fp8_weight_caches", {})
    new = {}
    for name in ("gate_up_proj", "up_proj", "down_proj"):
        if isinstance(getattr(mod, name, None), nn.Parameter):
            new[name] = WeightCache()
            if name in old:
                new[name].host = old[name].host
    return new


def _has_recipe(mod: nn.Module, recipe) -> bool:
    """mod was converted with `recipe` already (dataclass equality leaves the process group out:
    compared by identity)."""
    old = mod.__dict__.get("fp8_recipe")
    return (old == recipe and "fp8_weight_caches" in mod.__dict__
            and getattr(old, "process_group", None) is getattr(recipe, "process_group", None))


def _set_expert_states(mod: nn.Module, recipe) -> None:
    """A fresh delayed-scaling state per 3-D parameter (DelayedScaling), none otherwise."""
    mod._modules.pop("fp8_state", None)
    if quantizer_type(recipe)[0].delayed:
        mod.fp8_state = nn.ModuleDict({
            name: ExpertScalingState(recipe, getattr(mod, name).shape[0],
                                     getattr(mod, name).device, cache)
            for name, cache in mod.fp8_weight_caches.items()})


def restore_experts(module: nn.Module) -> None:
    """Undo convert_experts: the experts modules take their class's forward again. Refused
    while a CPUOffloadOptimizer owns a converted weight (only its FP8 cast is on the device)."""
    converted = [mod for mod in module.modules() if "fp8_recipe" in mod.__dict__]
    for mod in converted:
        if any(c.host is not None for c in mod.__dict__.get("fp8_weight_caches", {}).values()):
            raise ValueError("convert_from_fp8: this experts module's weights are owned by a "
                             "CPUOffloadOptimizer (only their FP8 copy is on the device); take "
                             "the weights from model.state_dict() instead")
    for mod in converted:
        del mod.fp8_recipe
        mod.__dict__.pop("fp8_weight_caches", None)
        mod.__dict__.pop("forward", None)
        mod._modules.pop("fp8_state", None)


class _FP8Forward:
    """A converted experts module's forward (fp8_experts_forward bound to it). Its copy, made
    with the module's by copy.deepcopy or pickle, tracks the copied module as convert_experts
    tracked the original (nn.caches: an optimizer given the copy's parameters finds its weight
    caches)."""

    def __init__(self, mod: nn.Module):
        self.mod = mod
        caches.track(mod)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        caches.track(self.mod)

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        return fp8_experts_forward(self.mod, hidden_states, top_k_index, top_k_weights)


def _weight(mod: nn.Module, name: str, params: Optional[dict] = None) -> torch.Tensor:
    w = getattr(mod, name) if params is None else params[name]
    return w.transpose(1, 2) if mod.is_transposed else w  # [E, out, in]


def _scaling(mod: nn.Module, name: str, caches: dict) -> dict:
    """grouped_linear's weight_cache and state arguments for the parameter `name`: a delayed
    state brings its cache, recording in training mode only."""
    states = mod._modules.get("fp8_state")
    if states is None:
        return {"weight_cache": caches.get(name)}
    state = states[name]
    state.set_recording(mod.training)
    return {"state": state}


def sort_by_expert(top_k_index: torch.Tensor, num_experts: int) -> tuple:
    """The (token, slot) pairs sorted by expert: (order, offsets int32 [E]); pair p of the
    sorted rows is token order[p] // k."""
    experts = top_k_index.reshape(-1)
    order = torch.argsort(experts, stable=True)  # the pairs sorted by expert
    counts = torch.zeros(num_experts, dtype=torch.int64, device=experts.device)
    counts.scatter_add_(0, experts, torch.ones_like(experts))
    return order, counts.cumsum(0).to(torch.int32)


def experts_rows(mod: nn.Module, x: torch.Tensor, offsets: torch.Tensor, *,
                 params: Optional[dict] = None, input_cast=None) -> torch.Tensor:
    """The experts on rows sorted by expert: the up (and gate) projection, the gating, the down
    projection (and the module's post-expert norm). params: the tensors to use for the module's
    parameters by name (the local experts under expert parallelism, cast every call: no weight
    cache); input_cast: x's forward cast made before (grouped_linear's)."""
    gated = getattr(mod, "has_gate", True)
    up_name = "gate_up_proj" if gated else "up_proj"
    bias = getattr(mod, "has_bias", False)
    own = params is None
    caches = mod.__dict__.get("fp8_weight_caches", {}) if own else {}
    get = (lambda name: getattr(mod, name)) if own else params.__getitem__
    h = grouped_linear(x, _weight(mod, up_name, params), offsets,
                       get(up_name + "_bias") if bias else None, recipe=mod.fp8_recipe,
                       input_cast=input_cast, **_scaling(mod, up_name, caches))
    h = mod._apply_gate(h) if gated else mod.act_fn(h)
    out = grouped_linear(h, _weight(mod, "down_proj", params), offsets,
                         get("down_proj_bias") if bias else None, recipe=mod.fp8_recipe,
                         **_scaling(mod, "down_proj", caches))
    if getattr(mod, "has_post_expert_norm", False):
        out = mod.post_expert_norm(out)
    return out


def weighted_sum(out: torch.Tensor, order: torch.Tensor, top_k_weights: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
    """The sorted pairs' outputs times their routing weights, each token's k summed."""
    tokens, k = top_k_weights.shape
    out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1)
    unsorted = torch.empty_like(out).index_copy_(0, order, out)  # back to (token, slot) order
    return unsorted.view(tokens, k, -1).sum(dim=1).to(dtype)


def fp8_experts_forward(mod: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' forward with FP8 grouped GEMMs: each token's k (token, expert) pairs sorted
    by expert, the up (and gate) projection, the gating, the down projection, the routing
    weights, and each token's k results summed."""
    if _AWAITING and not torch.compiler.is_compiling():
        _stop_awaiting(mod)  # (it runs unsharded, or was handed over already)
    k = top_k_index.shape[1]
    order, offsets = sort_by_expert(top_k_index, mod.num_experts)
    out = experts_rows(mod, hidden_states[order // k], offsets)
    return weighted_sum(out, order, top_k_weights, hidden_states.dtype)
