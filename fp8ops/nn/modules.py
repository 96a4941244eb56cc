"""FP8Linear, FP8Conv1D, convert_to_fp8(), convert_from_fp8() and plain_state_dict()."""
from __future__ import annotations

import logging
import weakref
from collections import Counter, OrderedDict
from typing import Callable, Optional

import torch
from torch import nn
from torch.nn import functional as F

from . import caches, step
from .autograd import is_gathered
from .fallback import Fallback, check_fallback, runs_fp8
from .functional import linear
from .hf_moe import convert_experts, restore_experts
from .sharding import SHARDED_WEIGHT_HOOKS, is_dtensor
from ..scaling import ScalingState, check_recipe

logger = logging.getLogger("fp8ops.modules")  # the name convert_to_fp8 documents

# the device types whose autocast state a call reads (torch.is_autocast_enabled raises for others,
# such as meta)
_AUTOCAST_DEVICES = ("cuda", "cpu")

class FP8Linear(nn.Linear):
    """nn.Linear whose three GEMMs run in FP8. Parameters, initialization and state_dict keys
    are nn.Linear's; the FP8 state (amax histories, scales, RNG offset) is in `fp8_state`."""

    # the parameter is the transpose of the [out, in] weight the GEMMs read (FP8Conv1D)
    weight_transposed = False

    # under FSDP2, gather the weight in FP8 where the recipe allows (distributed/fsdp/)
    fp8_all_gather = True

    # where a call runs the high-precision GEMMs instead (fallback.py)
    fallback: Fallback = "auto"

    # take the layer step in C++ where it applies (step.py); False: always the Python path
    # (the two give the same bytes; tests and benchmarks compare them)
    cpp_step = True

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, recipe=None,
                 device=None, dtype=None, fp8_all_gather: bool = True,
                 fallback: Fallback = "auto"):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.fp8_all_gather = bool(fp8_all_gather)
        self.fallback = check_fallback(fallback)
        self.recipe = check_recipe(recipe)
        self.fp8_state = self._new_state(self.recipe)
        caches.track(self)

    def __getstate__(self):
        # the plans (step.py) are decided again by a copy's first calls: they hold its state
        state = dict(self.__dict__)
        state.pop("_plans", None)
        return state

    def __setstate__(self, state):  # copy.deepcopy and pickle do not call __init__
        super().__setstate__(state)
        caches.track(self)
        self.fp8_state.weight_cache.watch(self.weight)

    def __setattr__(self, name, value):
        # FSDP2 swaps the parameter through setattr when a module defines __setattr__: the
        # sharded one between steps (what the optimizer holds), the gathered copy for compute
        if name == "fp8_state" and isinstance(value, ScalingState):
            weight = self._parameters.get("weight")
            if weight is not None:
                value.weight_cache.watch(weight)  # what an optimizer holds (before any forward)
        elif name == "weight" and "fp8_state" in self._modules:
            cache = self.fp8_state.weight_cache
            if isinstance(value, torch.Tensor):
                cache.watch(value)
            if is_dtensor(value):
                cache.source = weakref.ref(value)
                for hook in SHARDED_WEIGHT_HOOKS:
                    hook(self, value)
            elif not is_dtensor(self._parameters.get("weight")):
                cache.source = None  # a plain weight of its own (not FSDP2's gathered copy)
        super().__setattr__(name, value)

    def _apply(self, fn, recurse=True):
        # where Module._apply swaps the weight for a new tensor (FSDP2's DTensor parameters:
        # to_empty() after fully_shard, the meta-device init before a checkpoint load), the FP8
        # state must hold no weak reference to it (WeightCache.unreferenced)
        state = self._modules.get("fp8_state")
        if not isinstance(state, ScalingState):
            return super()._apply(fn, recurse)
        with state.weight_cache.unreferenced(self._parameters.get("weight")):
            return super()._apply(fn, recurse)

    def reset_parameters(self) -> None:
        """nn.Linear's init, and a fresh FP8 state (meta init: to_empty() then this)."""
        super().reset_parameters()
        if "fp8_state" in self._modules:  # nn.Linear.__init__ calls this before it exists
            self.fp8_state.reset()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # (read from the module's dicts where they hold them: each nn.Module.__getattr__ is a
        # Python call, and this runs every step)
        weight = None if self.weight_transposed else self._parameters.get("weight")
        if weight is None:  # (a parametrization or weight_norm computes it)
            weight = self._out_in_weight()
        state = self._modules.get("fp8_state") or self.fp8_state
        bias = self._parameters.get("bias")
        plan = None
        if (self.cpp_step and type(input) is torch.Tensor and type(weight) in step.PLAIN
                and not torch.compiler.is_compiling()):
            # which path calls of this kind take (step.py), decided once per kind
            device = input.device
            autocast = device.type in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device.type)
            key = (input.dtype, device, weight.dtype, weight.device, torch.is_grad_enabled(),
                   torch.is_inference_mode_enabled(), self.training,
                   autocast and torch.get_autocast_dtype(device.type),
                   self.fallback == "never" or input.numel() // max(self.in_features, 1))
            plans = self.__dict__.setdefault("_plans", {})
            plan = plans.get(key)
            if (plan is None or plan.recipe is not state.recipe or plan.state is not state
                    or plan.fallback is not self.fallback):
                if len(plans) >= step.MAX_PLANS:  # (token counts vary: keep a bounded few)
                    plans.clear()
                plan = plans[key] = step.plan_for(self, state, input, weight, key)
            if (plan.path is step.CPP and input.shape[-1] == self.in_features
                    and (state.monitor is None or not state.monitor[0].sampling)
                    and not state.shard_meshes and state.weight_cache.host is None
                    and getattr(weight, "main_grad", None) is None):
                if state.recording is not self.training:
                    state.set_recording(self.training)
                return plan.run(plan, state, input, weight, bias,
                                key[7] if autocast else input.dtype)
        if (plan.path is step.HIGH and state.weight_cache.host is None if plan is not None
                else not self._runs_fp8(input, weight)):
            state.count_high_precision_call()
            dtype = input.dtype
            if bias is not None and bias.dtype != dtype:
                bias = bias.to(dtype)
            return F.linear(input, weight if weight.dtype == dtype else weight.to(dtype), bias)
        # eval mode uses the scales as trained and records nothing (no amax, no step)
        state.set_recording(self.training)
        return linear(input, weight, bias, state=state)

    def _out_in_weight(self) -> torch.Tensor:
        """The weight in the [out, in] layout the GEMMs read."""
        return self.weight

    def _runs_fp8(self, input: torch.Tensor, weight: torch.Tensor) -> bool:
        """False where the layer's fallback sends this call to the high-precision GEMMs; only a
        plain local weight can (fallback.py)."""
        if self.fallback == "never":
            return True
        state = self.fp8_state
        if is_dtensor(weight) or is_gathered(weight) or state.host_weight is not None:
            return True
        return runs_fp8(self.fallback, self.recipe, input, self.in_features, self.out_features)

    @classmethod
    def from_linear(cls, mod: nn.Linear, recipe=None, *, fp8_all_gather: bool = True,
                    fallback: Fallback = "auto") -> "FP8Linear":
        """An FP8Linear sharing mod's weight and bias Parameters."""
        new = cls(mod.in_features, mod.out_features, bias=mod.bias is not None, recipe=recipe,
                  device="meta", fp8_all_gather=fp8_all_gather, fallback=fallback)
        new.weight = mod.weight
        new.bias = mod.bias
        new.fp8_state = new._new_state(new.recipe)
        return new.train(mod.training)  # a model converted in eval mode stays in eval mode

    def _new_state(self, recipe) -> ScalingState:
        """A fresh FP8 state for `recipe`, on the weight's device."""
        state = ScalingState(recipe, device=self.weight.device)
        state.weight_transposed = self.weight_transposed
        return state

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
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _use_recipe(self, recipe) -> None:
        """Switch to `recipe` with a fresh FP8 state; nothing changes if it is the current one
        (dataclass equality leaves the process group out, so that is compared by identity)."""
        same = (recipe == self.recipe and getattr(recipe, "process_group", None)
                is getattr(self.recipe, "process_group", None))
        if not same:
            host = self.fp8_state.host_weight
            self.recipe = recipe
            self.fp8_state = self._new_state(recipe)
            self.fp8_state.host_weight = host

    def extra_repr(self) -> str:
        # the recipe's name only: the model converted prints the whole recipe once (_Header)
        fallback = "" if self.fallback == "auto" else f", fallback={self.fallback}"
        return f"{super().extra_repr()}, recipe={type(self.recipe).__name__}{fallback}"


class FP8Conv1D(FP8Linear):
    """transformers' Conv1D (GPT-2's projections: weight [in, out] = [nx, nf], y = x @ W + b)
    with its three GEMMs in FP8. Parameters, their layout, `nf`/`nx` and state_dict keys are
    Conv1D's; the GEMMs read weight.t(), a view, so nothing is copied and the gradient reaches
    the parameter through it. An FP8Linear in every other respect (the FP8 state, monitoring,
    CPU offload, memory counts)."""

    weight_transposed = True

    def __init__(self, nf: int, nx: int, *, recipe=None, device=None, dtype=None,
                 fp8_all_gather: bool = True, fallback: Fallback = "auto"):
        super().__init__(nx, nf, recipe=recipe, device="meta", dtype=dtype,
                         fp8_all_gather=fp8_all_gather, fallback=fallback)
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.empty(nx, nf, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(nf, device=device, dtype=dtype))
        self.fp8_state = self._new_state(self.recipe)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Conv1D's init (weight normal with std 0.02, zero bias) and a fresh FP8 state."""
        if "fp8_state" not in self._modules:  # nn.Linear.__init__: the parameters come later
            return
        nn.init.normal_(self.weight, std=0.02)
        if self.bias is not None:
            nn.init.zeros_(self.bias)
        self.fp8_state.reset()

    def _out_in_weight(self) -> torch.Tensor:
        # a view made each call: it follows the parameter's storage; the weight cache keys on
        # the parameter it views (its gradient and version)
        return self.weight.t()

    @classmethod
    def from_conv1d(cls, mod: nn.Module, recipe=None, *, fp8_all_gather: bool = True,
                    fallback: Fallback = "auto") -> "FP8Conv1D":
        """An FP8Conv1D sharing the Conv1D mod's weight and bias Parameters."""
        new = cls(mod.nf, mod.nx, recipe=recipe, device="meta", fp8_all_gather=fp8_all_gather,
                  fallback=fallback)
        new.weight = mod.weight
        new.bias = mod.bias
        new.fp8_state = new._new_state(new.recipe)
        return new.train(mod.training)

    def extra_repr(self) -> str:
        fallback = "" if self.fallback == "auto" else f", fallback={self.fallback}"
        return f"nf={self.nf}, nx={self.nx}, recipe={type(self.recipe).__name__}{fallback}"


def _is_conv1d(mod: nn.Module) -> bool:
    """mod is a transformers Conv1D (recognised by name: fp8ops does not import transformers; a
    subclass, which may compute something else, is not taken)."""
    cls = type(mod)
    return cls.__name__ == "Conv1D" and cls.__module__ == "transformers.pytorch_utils"


def _plain_conv1d(mod: FP8Conv1D) -> nn.Module:
    from transformers.pytorch_utils import Conv1D  # only an FP8Conv1D needs transformers

    with torch.device("meta"):  # the parameters are replaced by mod's
        new = Conv1D(mod.nf, mod.nx)
    new.weight = mod.weight
    new.bias = mod.bias
    return new


def convert_to_fp8(module: nn.Module, recipe=None,
                   filter_fn: Optional[Callable[[nn.Module, str], bool]] = None, *,
                   fp8_all_gather: bool = True, fallback: Fallback = "auto") -> nn.Module:
    """Replace every nn.Linear and every transformers Conv1D in `module` (in place; `module`
    itself too) by an FP8Linear (an FP8Conv1D for a Conv1D) that shares its parameters.
    filter_fn(layer, fully_qualified_name) -> bool picks which ones. The mixture-of-experts
    experts modules of transformers take an FP8 grouped forward, their parameters unchanged
    (hf_moe.convert_experts; CurrentScaling and BlockwiseScaling only); filter_fn sees them too.

    Converting again applies `recipe` (None: CurrentScaling()) to the FP8Linear layers filter_fn
    picks: a layer that has that recipe already keeps its FP8 state; any other takes the recipe
    with a fresh FP8 state (amax histories, scales and RNG offset start over).

    fp8_all_gather: under FSDP2 (fully_shard after this call), gather the converted layers'
    weights in FP8 where the recipe allows (each rank casts its shard; the bytes are those of
    the single-process cast); False gathers them in high precision.

    fallback: where a layer call runs its GEMMs in high precision instead of FP8 ("auto": the
    crossover measured on the GPU, "never", or an fp8ops.Crossover; see fp8ops.nn.fallback).

    Logs (INFO, logger "fp8ops.modules") how many layers of each kind it converted, and warns
    when it converted none (no such layer, or filter_fn rejected them all)."""
    recipe = check_recipe(recipe)
    fallback = check_fallback(fallback)
    kinds: Counter = Counter()  # the layers taken, by the class they had
    rejected = [0]

    def wanted(mod, fqn):
        if not (isinstance(mod, nn.Linear) or _is_conv1d(mod)):
            return False
        if filter_fn is not None and not filter_fn(mod, fqn):
            rejected[0] += 1
            return False
        return True

    def convert(mod):
        kinds[type(mod).__name__] += 1
        if isinstance(mod, FP8Linear):
            mod._use_recipe(recipe)
            mod.fp8_all_gather = bool(fp8_all_gather)
            mod.fallback = fallback
            return mod
        if _is_conv1d(mod):
            return FP8Conv1D.from_conv1d(mod, recipe, fp8_all_gather=fp8_all_gather,
                                         fallback=fallback)
        return FP8Linear.from_linear(mod, recipe, fp8_all_gather=fp8_all_gather,
                                     fallback=fallback)

    if wanted(module, ""):
        module = convert(module)
    else:
        for fqn, mod in list(module.named_modules()):
            for name, child in list(mod.named_children()):
                child_fqn = f"{fqn}.{name}" if fqn else name
                if wanted(child, child_fqn):
                    setattr(mod, name, convert(child))
        if kinds and not isinstance(module.__dict__.get("extra_repr"), _Header):
            module.extra_repr = _Header(module)
    kinds.update(convert_experts(module, recipe, filter_fn))  # transformers' MoE experts
    _log_conversion(module, recipe, kinds, rejected[0])
    return module


class _Header:
    """The extra_repr of a model convert_to_fp8 converted: its own, then each recipe its FP8
    layers use, in full, once (the layers print only the recipe's name). An instance attribute
    of the model, so print(model) shows it; it pickles and copies with the model."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self) -> str:
        module = self.module
        used = Counter(repr(m.recipe) for m in module.modules() if isinstance(m, FP8Linear))
        lines = [type(module).extra_repr(module)] if type(module).extra_repr(module) else []
        lines += [f"fp8ops: {n} FP8 layer{'' if n == 1 else 's'}, recipe={recipe}"
                  for recipe, n in used.items()]
        return "\n".join(lines)


def _log_conversion(module: nn.Module, recipe, kinds: Counter, rejected: int) -> None:
    if not kinds:
        why = (f"filter_fn rejected all {rejected} nn.Linear/Conv1D layers" if rejected else
               "it has no nn.Linear or transformers Conv1D layer")
        logger.warning("fp8ops: convert_to_fp8 converted no layer of %s (%s): it stays in full "
                       "precision", type(module).__name__, why)
        return
    listed = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
    total = sum(kinds.values())
    logger.info("fp8ops: convert_to_fp8 converted %d layer%s of %s to %s (%s); filter_fn left "
                "out %d", total, "" if total == 1 else "s", type(module).__name__,
                type(recipe).__name__, listed, rejected)


def convert_from_fp8(module: nn.Module) -> nn.Module:
    """Replace every FP8Linear in `module` (in place; `module` itself too) by an nn.Linear (an
    FP8Conv1D by a transformers Conv1D) sharing its weight and bias Parameters (so the same
    device and dtype), for export and inference. The FP8 state is dropped. Converted experts
    modules take their own forward again."""
    def plain(mod: FP8Linear) -> nn.Module:
        if mod.fp8_state.host_weight is not None:
            raise ValueError("convert_from_fp8: this FP8Linear's weight is owned by a "
                             "CPUOffloadOptimizer (only its FP8 copy is on the device); take "
                             "the weights from model.state_dict() instead")
        if isinstance(mod, FP8Conv1D):
            return _plain_conv1d(mod).train(mod.training)
        new = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None,
                        device="meta")
        new.weight = mod.weight
        new.bias = mod.bias
        return new.train(mod.training)

    if isinstance(module, FP8Linear):
        return plain(module)
    restore_experts(module)
    if isinstance(module.__dict__.get("extra_repr"), _Header):
        del module.extra_repr
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
