"""The FP8 layers: autograd.py (the autograd Functions of the FP8 linear layer, one per recipe
kind), functional.py (fp8ops.linear), modules.py (FP8Linear, FP8Conv1D, convert_to_fp8),
fallback.py (which calls run in high precision), grouped.py (fp8ops.grouped_linear and
FP8GroupedLinear, the experts of mixture-of-experts layers), cast_stats.py (one cast's statistics,
for fp8ops.monitor), activations.py (fp8_activations: norm and activation inputs saved in
FP8) and caches.py (which weight cache casts which parameter, and fp8ops.invalidate: every
weight cache of a model). Built on fp8ops.scaling
(the recipes, the state, the weight cache)."""
from .activations import fp8_activations
from .fallback import Crossover
from .functional import linear
from .grouped import FP8GroupedLinear, grouped_linear
from .modules import (FP8Conv1D, FP8Linear, convert_from_fp8, convert_to_fp8,
                      plain_state_dict)

__all__ = ["Crossover", "FP8Conv1D", "FP8Linear", "convert_from_fp8", "convert_to_fp8",
           "fp8_activations", "linear", "plain_state_dict", "FP8GroupedLinear", "grouped_linear"]
