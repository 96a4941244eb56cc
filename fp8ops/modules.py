"""FP8Linear, convert_to_fp8(), convert_from_fp8() and plain_state_dict()."""
from __future__ import annotations

import logging
import sys
import weakref
from collections import OrderedDict
from typing import Callable, Optional

import torch
from torch import nn

from .functional import linear
from .scaling import ScalingState, check_recipe

logger = logging.getLogger(__name__)

# every live FP8Linear, so that an optimizer given only parameters can find the layers that
# read a weight (CPUOffloadOptimizer)
_LAYERS: "weakref.WeakSet[FP8Linear]" = weakref.WeakSet()


def layers_by_weight(params) -> dict:
    """{id(param): [the FP8Linear layers whose weight is param]} for the given parameters."""
    wanted = {id(p) for p in params}
    found: dict = {}
    for layer in list(_LAYERS):
        w = layer._parameters.get("weight")
        if w is not None and id(w) in wanted:
            found.setdefault(id(w), []).append(layer)
    return found


def _is_dtensor(t) -> bool:
    # no DTensor can exist before its module is imported (keeps importing fp8ops light)
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def _registered_weight(layer: "FP8Linear"):
    """() -> the weight parameter registered on layer now (what an optimizer holds)."""
    ref = weakref.ref(layer)

    def registered():
        mod = ref()
        return None if mod is None else mod._parameters.get("weight")
    return registered


class FP8Linear(nn.Linear):
    """nn.Linear whose three GEMMs run in FP8. Parameters, initialization and state_dict keys
    are nn.Linear's; the FP8 state (amax histories, scales, RNG offset) is in `fp8_state`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, recipe=None,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = check_recipe(recipe)
        self.fp8_state = ScalingState(self.recipe, device=self.weight.device)
        _LAYERS.add(self)

    def __setstate__(self, state):  # copy.deepcopy and pickle do not call __init__
        super().__setstate__(state)
        _LAYERS.add(self)
        self.fp8_state.owner = _registered_weight(self)

    def __setattr__(self, name, value):
        # FSDP2 swaps the parameter through setattr when a module defines __setattr__: the
        # sharded one between steps (what the optimizer holds), the gathered copy for compute
        if name == "fp8_state" and isinstance(value, ScalingState):
            value.owner = _registered_weight(self)
        elif name == "weight" and "fp8_state" in self._modules:
            state = self.fp8_state
            if _is_dtensor(value):
                state.source = weakref.ref(value)
            elif not _is_dtensor(self._parameters.get("weight")):
                state.source = None  # a plain weight of its own (not FSDP2's gathered copy)
        super().__setattr__(name, value)

    def reset_parameters(self) -> None:
        """nn.Linear's init, and a fresh FP8 state (meta init: to_empty() then this)."""
        super().reset_parameters()
        if "fp8_state" in self._modules:  # nn.Linear.__init__ calls this before it exists
            self.fp8_state.reset()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # eval mode uses the scales as trained and records nothing (no amax, no step)
        self.fp8_state.recording = self.training
        return linear(input, self.weight, self.bias, state=self.fp8_state)

    @classmethod
    def from_linear(cls, mod: nn.Linear, recipe=None) -> "FP8Linear":
        """An FP8Linear sharing mod's weight and bias Parameters."""
        new = cls(mod.in_features, mod.out_features, bias=mod.bias is not None, recipe=recipe,
                  device="meta")
        new.weight = mod.weight
        new.bias = mod.bias
        new.fp8_state = ScalingState(new.recipe, device=mod.weight.device)
        return new.train(mod.training)  # a model converted in eval mode stays in eval mode

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        host = self.fp8_state.host_weight
        if host is not None and prefix + "weight" in destination:
            # offloaded: the parameter is a placeholder, the weight is the host master
            destination[prefix + "weight"] = host.state_value()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        state_prefix = prefix + "fp8_state."
        if prefix + "weight" in state_dict and not any(k.startswith(state_prefix)
                                                       for k in state_dict):
            # a plain nn.Linear checkpoint: load it (strict too) with a fresh FP8 state
            self.fp8_state.reset()
            for key, value in self.fp8_state.state_dict().items():
                state_dict[state_prefix + key] = value
            logger.info("fp8ops: %s has no FP8 state in the checkpoint (a plain nn.Linear "
                        "one?); its FP8 state starts fresh", prefix.rstrip(".") or "FP8Linear")
        host = self.fp8_state.host_weight
        if host is not None and prefix + "weight" in state_dict:
            self._load_offloaded_weight(state_dict, prefix, host, *args, **kwargs)
        else:
            super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _load_offloaded_weight(self, state_dict, prefix, host, local_metadata, strict,
                               missing_keys, unexpected_keys, error_msgs) -> None:
        """Load into the host master; the placeholder parameter takes no values."""
        value = state_dict.pop(prefix + "weight")
        if tuple(value.shape) != tuple(self.weight.shape):
            error_msgs.append(f"size mismatch for {prefix}weight: copying a param with shape "
                              f"{tuple(value.shape)} from checkpoint, the shape in current "
                              f"model is {tuple(self.weight.shape)}.")
        else:
            host.load_(value)
        weight = self._parameters["weight"]
        self._parameters["weight"] = None  # neither missing nor unexpected: loaded above
        try:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                          missing_keys, unexpected_keys, error_msgs)
        finally:
            self._parameters["weight"] = weight

    def _use_recipe(self, recipe) -> None:
        """Switch to `recipe` with a fresh FP8 state; nothing changes if it is the current one
        (dataclass equality leaves the process group out, so that is compared by identity)."""
        same = (recipe == self.recipe and getattr(recipe, "process_group", None)
                is getattr(self.recipe, "process_group", None))
        if not same:
            host = self.fp8_state.host_weight
            self.recipe = recipe
            self.fp8_state = ScalingState(recipe, device=self.weight.device)
            self.fp8_state.host_weight = host

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}"


def convert_to_fp8(module: nn.Module, recipe=None,
                   filter_fn: Optional[Callable[[nn.Module, str], bool]] = None) -> nn.Module:
    """Replace every nn.Linear in `module` (in place; `module` itself too) by an FP8Linear that
    shares its parameters. filter_fn(linear, fully_qualified_name) -> bool picks which ones.

    Converting again applies `recipe` (None: CurrentScaling()) to the FP8Linear layers filter_fn
    picks: a layer that has that recipe already keeps its FP8 state; any other takes the recipe
    with a fresh FP8 state (amax histories, scales and RNG offset start over)."""
    recipe = check_recipe(recipe)

    def wanted(mod, fqn):
        return isinstance(mod, nn.Linear) and (filter_fn is None or filter_fn(mod, fqn))

    def convert(mod):
        if isinstance(mod, FP8Linear):
            mod._use_recipe(recipe)
            return mod
        return FP8Linear.from_linear(mod, recipe)

    if wanted(module, ""):
        return convert(module)
    for fqn, mod in list(module.named_modules()):
        for name, child in list(mod.named_children()):
            child_fqn = f"{fqn}.{name}" if fqn else name
            if wanted(child, child_fqn):
                setattr(mod, name, convert(child))
    return module


def convert_from_fp8(module: nn.Module) -> nn.Module:
    """Replace every FP8Linear in `module` (in place; `module` itself too) by an nn.Linear sharing
    its weight and bias Parameters (so the same device and dtype), for export and inference. The
    FP8 state is dropped."""
    def plain(mod: FP8Linear) -> nn.Linear:
        if mod.fp8_state.host_weight is not None:
            raise ValueError("convert_from_fp8: this FP8Linear's weight is owned by a "
                             "CPUOffloadOptimizer (only its FP8 copy is on the device); take "
                             "the weights from model.state_dict() instead")
        new = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None,
                        device="meta")
        new.weight = mod.weight
        new.bias = mod.bias
        return new.train(mod.training)

    if isinstance(module, FP8Linear):
        return plain(module)
    for mod in list(module.modules()):
        for name, child in list(mod.named_children()):
            if isinstance(child, FP8Linear):
                setattr(mod, name, plain(child))
    return module


def plain_state_dict(module_or_state_dict) -> "OrderedDict[str, object]":
    """The state_dict of a model with FP8Linear layers (or such a state_dict itself) without
    their FP8 state: the checkpoint of the same model made of nn.Linear, which loads into it, or
    into convert_from_fp8(model), with strict=True. Given a state_dict, every key with an
    `fp8_state` component is dropped (FP8Linear's name for its state)."""
    if isinstance(module_or_state_dict, nn.Module):
        state = module_or_state_dict.state_dict()
    else:
        state = module_or_state_dict
    return OrderedDict((k, v) for k, v in state.items() if "fp8_state" not in k.split("."))
