"""FP8GroupedExperts: torchtitan's GroupedExperts whose three grouped GEMMs run in FP8 through
fp8ops.grouped_linear (a scale per expert). The parameters w1_EFD, w2_EDF and w3_EFD are
GroupedExperts' own, unchanged ([E, out, in]: the layout grouped_linear reads).

grouped_linear takes current scaling and blockwise scaling without a state of its own; the
experts of a "delayed" or "mxfp8" conversion run current scaling (the dense layers keep the
chosen recipe): delayed scaling of experts keeps per-expert amax histories tied to a weight cache
that torchtitan's FSDP2 gathers do not feed, and grouped_linear has no MXFP8 path. Each call
casts the experts' weights afresh (no weight cache); FSDP2 gathers them in high precision."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchtitan.models.common.moe import GroupedExperts

from ...nn.grouped import grouped_linear
from .recipes import recipe_named

# the recipe the experts run for each recipe name of the conversion
EXPERT_RECIPES = {"current": "current", "blockwise": "blockwise", "delayed": "current",
                  "mxfp8": "current"}


class FP8GroupedExperts(GroupedExperts):
    """GroupedExperts with FP8 grouped GEMMs (fp8ops.grouped_linear)."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        """GroupedExperts.Config's fields and the conversion's recipe name (EXPERT_RECIPES
        says which recipe the experts then run)."""

        recipe: str = "current"

    def __init__(self, config: Config):
        super().__init__(config)
        if config.recipe not in EXPERT_RECIPES:
            recipe_named(config.recipe)  # (raises the error naming the known recipes)
        self.recipe = recipe_named(EXPERT_RECIPES[config.recipe])

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w
                      for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
        offsets = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        h_RF = F.silu(self._fp8_mm(x_RD, w1, offsets)) * self._fp8_mm(x_RD, w3, offsets)
        return self._fp8_mm(h_RF, w2, offsets).type_as(x_RD)

    def _fp8_mm(self, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor):
        # grouped_linear wants the weight in the activations' dtype (torchtitan's mixed precision
        # casts the parameters; a full-precision run has both in float32)
        if weight.dtype != x.dtype:
            weight = weight.to(x.dtype)
        return grouped_linear(x, weight, offsets, recipe=self.recipe)
