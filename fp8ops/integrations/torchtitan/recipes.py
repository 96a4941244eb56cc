"""The recipe names FP8Converter takes, and the fp8ops recipe each stands for."""
from ... import BlockwiseScaling, CurrentScaling, DelayedScaling, MXFP8Scaling

RECIPES = {
    "delayed": DelayedScaling,
    "current": CurrentScaling,
    "mxfp8": MXFP8Scaling,
    "blockwise": BlockwiseScaling,
}


def recipe_named(name: str):
    """A fresh fp8ops recipe (its defaults) for one of RECIPES' names."""
    if name not in RECIPES:
        raise ValueError(f"unknown FP8 recipe {name!r}: expected one of {sorted(RECIPES)}")
    return RECIPES[name]()
