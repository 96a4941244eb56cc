"""FP8Linear and convert_to_fp8()."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from .functional import linear
from .scaling import ScalingState, check_recipe


class FP8Linear(nn.Linear):
    """nn.Linear whose three GEMMs run in FP8. Parameters, initialization and state_dict keys
    are nn.Linear's; the FP8 state (amax histories, scales, RNG offset) is in `fp8_state`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, recipe=None,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = check_recipe(recipe)
        self.fp8_state = ScalingState(self.recipe, device=self.weight.device)

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
        return new

    def _use_recipe(self, recipe) -> None:
        """Switch to `recipe` with a fresh FP8 state; nothing changes if it is the current one
        (dataclass equality leaves the process group out, so that is compared by identity)."""
        same = (recipe == self.recipe and getattr(recipe, "process_group", None)
                is getattr(self.recipe, "process_group", None))
        if not same:
            self.recipe = recipe
            self.fp8_state = ScalingState(recipe, device=self.weight.device)

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
