"""Expert parallelism with FP8 token dispatch (style.py: FP8ExpertParallel; routing.py: the
count exchange and row layout; wire.py: the FP8 casts that travel; dispatch.py: the
all-to-alls as autograd Functions)."""
from .style import FP8ExpertParallel

__all__ = ["FP8ExpertParallel"]
