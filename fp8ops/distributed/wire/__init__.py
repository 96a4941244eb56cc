"""FP8 on the wire: gradient reductions that send FP8 blocks instead of bf16 or float32, through
torch.distributed's own extension points.

- fp8_reduce_scatter(module): FSDP2's gradient reduce-scatter in FP8 (FSDPModule's
  set_custom_reduce_scatter) on every FSDPModule in a module (reduce_scatter.py);
- fp8_compress_hook: a DDP communication hook (`register_comm_hook`) that reduces each bucket as
  an FP8 reduce-scatter and an FP8 all-gather (ddp_hook.py).

Both send each rank's values as FP8 blocks (blocks.py): block_size contiguous elements share one
float32 scale that maps the block's amax to the format's largest value, so a block of small
gradients keeps its precision next to a block of large ones; about 1.03 bytes per value for
E4M3 in blocks of 128, against 2 for bf16."""
from .ddp_hook import fp8_compress_hook
from .reduce_scatter import FP8ReduceScatter, fp8_reduce_scatter

__all__ = ["fp8_reduce_scatter", "FP8ReduceScatter", "fp8_compress_hook"]
