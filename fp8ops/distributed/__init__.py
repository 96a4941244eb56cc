"""FP8 training on torch.distributed's own engines: FSDP2's FP8 weight all-gather (fsdp.py) and
DTensor tensor-parallel styles for FP8Linear (tensor_parallel.py). Public names are re-exported
at fp8ops.* lazily, so that `import fp8ops` does not import torch.distributed.tensor."""
