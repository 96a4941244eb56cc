"""The memory half of training: offload.py (CPUOffloadOptimizer: FP32 masters and optimizer state
on the host), offload_param.py (how each parameter moves between the device and the host) and
host_weight.py (the host master an FP8Linear weight is cast from, and the device placeholder).

Imports nothing; fp8ops exports CPUOffloadOptimizer.
"""
