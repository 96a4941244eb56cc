"""Scaling: the recipes (recipes.py, frozen dataclasses of settings), the state of one layer
(state.py: ScalingState, with a RoleState per delayed-scaling role, role.py) and the cached FP8
weight with its reuse rule (weight_cache.py: WeightCache). Nothing here imports fp8ops.nn."""
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
