"""fp8ops: FP8 training for PyTorch."""
from . import ops  # noqa: F401  (defines the torch.ops.fp8ops operators)
from ._backend import backend
from .formats import E4M3, E5M2
