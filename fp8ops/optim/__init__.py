"""The memory half of training: offload.py (CPUOffloadOptimizer: FP32 masters and optimizer state
on the host), offload_param.py (how each parameter moves between the device and the host) and
host_weight.py (the host master an FP8Linear weight is cast from, and the device placeholder);
fp8_adamw.py (FP8AdamW / FP8Adam: Adam's moments in FP8 with block scales, moments.py says how)
and the masters in the parameters' own dtype.

fp8ops exports CPUOffloadOptimizer, FP8AdamW and FP8Adam.
"""
from .fp8_adamw import FP8Adam, FP8AdamW  # noqa: F401
