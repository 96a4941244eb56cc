"""The FP8 layers: autograd.py (the autograd Functions of the FP8 linear layer, one per recipe
kind), functional.py (fp8ops.linear), modules.py (FP8Linear, FP8Conv1D, convert_to_fp8),
weight_cache.py (the cached FP8 weight), fallback.py (which calls run in high precision) and
cast_stats.py (one cast's statistics, for fp8ops.monitor).

Imports nothing: fp8ops.scaling imports nn.weight_cache, and an import of the layers here would
bring autograd, which imports fp8ops.scaling, into that import (a circle).
"""
