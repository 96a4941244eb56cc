"""FP8 weight all-gather under FSDP2 (`fully_shard`): each rank casts its own shard of an FP8
layer's weight with the scale the whole weight gets, and FSDP2 gathers the FP8 bytes (plus block
scales) instead of the high-precision weight, through its tensor-subclass extension points
(`fsdp_pre_all_gather` / `fsdp_post_all_gather` on the sharded parameter's local tensor).

The gathered FP8 weight is byte for byte the single-process cast, so sharded training is the
single-process training. By job:
  dense.py        an FP8Linear's weight: per-tensor scaling (the scale's amax the MAX over the
                  shards; delayed scaling decides its cast once per accumulation window) and
                  blockwise (whole 128x128 blocks in every shard: no all-reduce);
  weight_amax.py  the per-tensor weights' amaxes: one all-reduce per step for all of them;
  experts.py      3-D expert parameters [E, out, in] (ExpertParameter: an FP8GroupedLinear's
                  weight, a converted transformers experts module's projections): whole experts
                  on every rank, cast as the unsharded layer casts them;
  weights.py      the tensors FSDP2 handles: FP8WeightShard (the local shard, with the extension
                  points) and FP8GatheredWeight (what the layers read), plain shards in state
                  dicts;
  this module     which weights gather in FP8 (gathers_fp8) and the wrapping of their shards
                  (install).
Everything else gathers the weight in high precision, as without this package: MXFP8, a
blockwise shard boundary inside a block, CurrentScaling with amax_percentile, meshes other than
one Shard(0) dimension (FSDP2 over tensor parallelism: 2-D), experts that do not split evenly or
are stored [E, in, out], and layers built with fp8_all_gather=False (dense.py and experts.py
say why).

FP8Linear and FP8GroupedLinear hand their sharded parameter over when FSDP2 sets it (their
__setattr__); a converted transformers experts module's parameters are handed over before
FSDP2's first forward (nn/hf_moe.py); both through the hooks fp8ops registers in nn.sharding
(fp8ops.distributed.on_sharded_weight / on_sharded_experts). So `fully_shard(model)` on a
converted model is all a user writes. Under torch.compile the layers with an FP8-gathered weight
run eagerly (functional.linear).

fp8ops.monitor does not sample the weight role of a layer gathered in FP8 (its shards are cast
here, outside the layer's casts); the input and gradient roles are sampled as usual, per rank.
The bytes saved are measured by bench/bench_comm.py (bench/RESULTS.md).
"""
from __future__ import annotations

from torch.distributed.tensor import DTensor

from ..tensor_parallel import TP_WEIGHT
from . import dense
from .experts import (ExpertParameter, expert_parameter, experts_gather_refusal, follow_shard,
                      follow_source, is_experts, report_refusal, target)
from .weight_amax import register
from .weights import FP8GatheredWeight, FP8WeightShard, hook_state_dict, plain_local


def gathers_fp8(layer, dtensor: DTensor) -> bool:
    """Whether FSDP2 should gather this layer's weight (an ExpertParameter's: that parameter) in
    FP8 (see the module doc)."""
    layer = target(layer)
    if not getattr(layer, "fp8_all_gather", False) or getattr(dtensor, TP_WEIGHT, False):
        return False  # off, or a tensor-parallel style's weight (not FSDP2's shard)
    if is_experts(layer):
        reason = experts_gather_refusal(layer, dtensor)
        if reason is not None:
            report_refusal(layer, reason)
        return reason is None
    return dense.gathers_fp8(layer, dtensor)


def install(layer, dtensor: DTensor) -> None:
    """Make FSDP2 gather layer's weight (an ExpertParameter's: that parameter) in FP8: wrap the
    sharded parameter's local tensor (FSDP2 looks for the extension when it sets the sharded
    parameter on the module, and again at its first forward)."""
    layer = target(layer)
    local = dtensor._local_tensor
    if not isinstance(local, FP8WeightShard):
        dtensor._local_tensor = FP8WeightShard(local, layer)
        if not is_experts(layer):
            register(layer)  # (its amax joins the batched all-reduce)
    if is_experts(layer):
        follow_source(layer.weight_cache, dtensor)
    hook_state_dict(layer.module if is_experts(layer) else layer)


__all__ = ["ExpertParameter", "FP8GatheredWeight", "FP8WeightShard", "expert_parameter",
           "experts_gather_refusal", "follow_shard", "gathers_fp8", "install", "plain_local"]
