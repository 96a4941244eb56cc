"""Whether torch.distributed's default process group exists, asked on the hot paths (a layer's
step, a gradient hook) without entering a Python function where torch allows it: `WORLD`, torch's
own record of the default group, read as an attribute (is_initialized() reads it through two
properties). Use: `WORLD._default_pg is not None if WORLD is not None else initialized()`."""
from __future__ import annotations

try:
    from torch.distributed import distributed_c10d as _c10d
except ImportError:  # a build of torch without torch.distributed
    _c10d = None

WORLD = getattr(_c10d, "_world", None)
if not hasattr(WORLD, "_default_pg"):  # where torch moved it: ask is_initialized()
    WORLD = None


def initialized() -> bool:
    return _c10d is not None and _c10d.is_initialized()
