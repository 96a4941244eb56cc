"""Scaling: the recipes (recipes.py, frozen dataclasses of settings), the state of one layer
(state.py: ScalingState, with a RoleState per delayed-scaling role, role.py; a grouped layer's
experts: expert_state.py) and the cached FP8 weight with its reuse rule (weight_cache.py:
WeightCache). Across processes, with torch.distributed alone (no DTensor): the amax all-reduces
the states make (amax_all_reduce.py: one amax over the ranks or a tensor's shards;
amax_reduction.py: one all-reduce per backward pass for every delayed-scaling state), the
ranks' recipe check (agreement.py) and whether a default process group exists (world.py).
Nothing here imports fp8ops.nn or fp8ops.distributed."""
from .recipes import (AMAX_ALGOS, MAX_HISTORY, BlockwiseScaling, CurrentScaling, DelayedScaling,
                      MXFP8Scaling, Recipe, as_float32, check_margin, check_recipe,
                      current_scale, grad_margin, recipe_formats)
from .role import RoleState
from .state import ScalingState
from .weight_cache import Generation as _Generation  # (pickles from before name it here)
from .weight_cache import WeightCache

__all__ = ["AMAX_ALGOS", "MAX_HISTORY", "BlockwiseScaling", "CurrentScaling", "DelayedScaling",
           "MXFP8Scaling", "Recipe", "RoleState", "ScalingState", "WeightCache", "as_float32",
           "check_margin", "check_recipe", "current_scale", "grad_margin", "recipe_formats"]
