"""FP8 weight all-gather under FSDP2 (`fully_shard`): each rank casts its own shard of an
FP8Linear weight with the scale the whole weight gets, and FSDP2 gathers the FP8 bytes (plus block
scales) instead of the high-precision weight, through its tensor-subclass extension points
(`fsdp_pre_all_gather` / `fsdp_post_all_gather` on the sharded parameter's local tensor).

The gathered FP8 weight is byte for byte the single-process cast, so sharded training is the
single-process training:
  - per-tensor (CurrentScaling, DelayedScaling): the cast is elementwise with one scale; the
    scale's amax is the MAX over the shards (all-reduced over the FSDP mesh). A delayed-scaling
    layer decides its cast once per accumulation window (it steps and records the weight role
    once, as a single process does); every gather in the window (microbatches, backward
    re-gathers) reuses that scale;
  - BlockwiseScaling: 128x128 blocks are row-local when every shard has whole blocks (rows a
    multiple of 128, even shards): cast locally, gather data and block scales, no all-reduce.
  - experts [E, out, in] (current and delayed scaling, a scale per expert; blockwise, 128x128
    blocks per expert): a 3-D expert parameter with its own recipe and WeightCache
    (ExpertParameter: an FP8GroupedLinear's weight, a converted transformers experts module's
    gate_up_proj / up_proj / down_proj). FSDP2 shards dim 0, so each rank holds whole experts
    and casts them as the unsharded layer does, no all-reduce; data and per-expert scales are
    gathered. The shard's cast is kept in the parameter's WeightCache (source: the sharded
    parameter) and reused under its rule: once per optimizer step. Delayed scaling steps the
    experts' weight role when that cache opens a window, as the unsharded layer's does (every
    rank alike: their states are identical), and casts the rank's experts with their slice of
    the role's [E] scales; the warm start's and the records' amaxes are [E] with 0 for the
    experts held elsewhere, folded over the ranks by a MAX all-reduce (the record's: the
    backward's one, amax_reduction). Experts that do not split evenly over the ranks (FSDP2 then
    takes no scales beside the padded shard's bytes), placements other than Shard(0) (an expert
    split over ranks) and experts stored [E, in, out] gather in high precision, logged once per
    parameter with the reason (experts_gather_refusal).
Everything else gathers the weight in high precision, as without this module: MXFP8 (its dgrad
copy is blocked along N, across shards; gathering both FP8 copies moves as many bytes as bf16),
a blockwise shard boundary inside a block, CurrentScaling with amax_percentile (a percentile is
not a MAX of shard percentiles), meshes other than one Shard(0) dimension (FSDP2 over tensor
parallelism: 2-D), and layers built with fp8_all_gather=False.

FP8Linear and FP8GroupedLinear install the subclass when FSDP2 hands them their sharded
parameter (their __setattr__); a converted transformers experts module's parameters are handed
over before FSDP2's first forward (nn/hf_moe.py). So `fully_shard(model)` on a converted model is
all a user writes. Under
torch.compile the layers with an FP8-gathered weight run eagerly (functional.linear).

fp8ops.monitor does not sample the weight role of a layer gathered in FP8 (its shards are cast
here, outside the layer's casts); the input and gradient roles are sampled as usual, per rank.
The bytes saved are measured by bench/bench_comm.py (bench/RESULTS.md).
"""
from __future__ import annotations

import logging
import weakref
from typing import Optional

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.utils._pytree import tree_map_only

from ..nn.autograd import in_recompute
from ..nn.functional import linear
from ..nn.grouped import FP8GroupedLinear
from ..nn.quantizers import quantizer_for, quantizer_type
from ..ops.expert_casts import experts_amax, quantize_experts_scaled, transpose_experts
from ..scaling import current_scale, recipe_formats, weight_cache
from ..scaling.amax_all_reduce import all_reduce_amax
from .tensor_parallel import TP_WEIGHT

_ops = torch.ops.fp8ops
_aten = torch.ops.aten
BLOCK = 128
logger = logging.getLogger("fp8ops.fsdp")

# ops FSDP2 applies to the sharded local tensor that must keep the extension (views of it, the
# padded copy it makes, moves); every other op runs on the plain tensor and returns plain ones
_SHARD_KEEPS = {_aten.view.default, _aten.as_strided.default, _aten.slice.Tensor,
                _aten.narrow.default, _aten.split.Tensor, _aten.detach.default,
                _aten.alias.default, _aten.clone.default, _aten.empty_like.default,
                _aten.new_zeros.default, _aten.new_empty.default, _aten._to_copy.default,
                _aten._pin_memory.default}
# ops on the gathered weight that give the same FP8 weight (FSDP2's as_strided to the unpadded
# shape, nn.Parameter's detach, FP8Conv1D's transposed view)
_GATHERED_VIEWS = {_aten.as_strided.default, _aten.view.default, _aten.detach.default,
                   _aten.alias.default, _aten.t.default, _aten.transpose.int}


def gathers_fp8(layer, dtensor: DTensor) -> bool:
    """Whether FSDP2 should gather this layer's weight (an ExpertParameter's: that parameter) in
    FP8 (see the module doc)."""
    layer = _target(layer)
    if not getattr(layer, "fp8_all_gather", False) or getattr(dtensor, TP_WEIGHT, False):
        return False  # off, or a tensor-parallel style's weight (not FSDP2's shard)
    if _is_experts(layer):
        reason = experts_gather_refusal(layer, dtensor)
        if reason is not None:
            _report_refusal(layer, reason)
        return reason is None
    if tuple(dtensor.placements) != (Shard(0),) or dtensor.device_mesh.ndim != 1:
        return False
    quantizer = quantizer_for(layer.recipe)
    if not quantizer.gathers_fp8:
        return False
    if quantizer.scale_block is None:  # one scale per tensor: any rows
        return True
    rows, world = dtensor.shape[0], dtensor.device_mesh.size()
    return not layer.weight_transposed and rows % (quantizer.scale_block * world) == 0


def install(layer, dtensor: DTensor) -> None:
    """Make FSDP2 gather layer's weight (an ExpertParameter's: that parameter) in FP8: wrap the
    sharded parameter's local tensor (FSDP2 looks for the extension when it sets the sharded
    parameter on the module, and again at its first forward)."""
    layer = _target(layer)
    local = dtensor._local_tensor
    if not isinstance(local, FP8WeightShard):
        dtensor._local_tensor = FP8WeightShard(local, layer)
        if not _is_experts(layer):
            _register(layer)  # (its amax joins the batched all-reduce)
    module = layer.module if _is_experts(layer) else layer
    if _is_experts(layer):
        _follow_source(layer.weight_cache, dtensor)
    if module not in _HOOKED:
        _HOOKED.add(module)
        module.register_state_dict_post_hook(_plain_weight)


def experts_gather_refusal(layer, dtensor: DTensor) -> Optional[str]:
    """Why FSDP2 cannot gather these experts [E, out, in] in FP8 (an FP8GroupedLinear's weight
    or an ExpertParameter; None: it can). The experts' scales (one per expert, or 128x128
    blocks per expert) are computed on the rank that holds the expert whole, which FSDP2's
    default Shard(0) gives: no all-reduce (delayed scaling: the role's scales, the same on every
    rank; only its warm start and records all-reduce amaxes)."""
    layer = _target(layer)
    if tuple(dtensor.placements) != (Shard(0),) or dtensor.device_mesh.ndim != 1:
        return (f"the weight is placed {tuple(dtensor.placements)} on a {dtensor.device_mesh.ndim}"
                f"-D mesh, not Shard(0) (whole experts per rank) on a 1-D one: an expert split "
                f"over ranks would need its scale from every piece")
    quantizer = quantizer_for(layer.recipe)
    if not quantizer.grouped:
        return f"{type(layer.recipe).__name__} has no FP8 gather for experts"
    if quantizer.delayed and layer.state is None:
        return "the delayed-scaling experts have no ExpertScalingState of their recipe yet"
    if layer.transposed:
        return ("the experts are stored [E, in, out] (is_transposed): the gathered FP8 bytes "
                "would be read through a transposed view")
    experts, world = dtensor.shape[0], dtensor.device_mesh.size()
    if experts % world:
        # FSDP2 pads the last shard and then takes extension inputs only of the padded shard's
        # shape: no room for the scales beside the bytes
        return (f"{experts} experts do not split evenly over {world} ranks (FSDP2 takes no "
                f"per-expert scales beside the bytes of a padded shard)")
    return None


class ExpertParameter:
    """A 3-D expert parameter (an FP8GroupedLinear's `weight`, a converted transformers experts
    module's `gate_up_proj` / `up_proj` / `down_proj`) as the FP8 gather sees it: its module,
    its name there, the recipe and the WeightCache its casts go through. One per parameter
    (expert_parameter), alive as long as its module; it holds the module weakly."""

    def __init__(self, module, name: str):
        self._module = weakref.ref(module)
        self.name = name

    @property
    def module(self):
        return self._module()

    @property
    def recipe(self):
        module = self.module
        return module.recipe if isinstance(module, FP8GroupedLinear) else module.fp8_recipe

    @property
    def weight_cache(self):
        module = self.module
        if isinstance(module, FP8GroupedLinear):
            return module.weight_cache
        return module.__dict__["fp8_weight_caches"][self.name]

    @property
    def state(self):
        """The experts' ExpertScalingState (DelayedScaling; None otherwise, or while the module
        has none of its recipe)."""
        module = self.module
        states = module._modules.get("fp8_state")
        if states is not None and not isinstance(module, FP8GroupedLinear):
            states = states[self.name] if self.name in states else None
        recipe = self.recipe
        if states is None or not quantizer_type(recipe)[0].delayed or states.recipe != recipe:
            return None
        return states

    @property
    def fp8_all_gather(self) -> bool:
        return bool(getattr(self.module, "fp8_all_gather", True))

    @property
    def transposed(self) -> bool:
        """Stored [E, in, out] (a transformers module's is_transposed)."""
        return bool(getattr(self.module, "is_transposed", False))

    @property
    def description(self) -> str:
        """What the recipe agreement's error names."""
        module = self.module
        return f"the experts {self.name} {tuple(getattr(module, self.name).shape)} of " \
               f"{type(module).__name__}"

    def __repr__(self):
        return f"ExpertParameter({type(self.module).__name__}.{self.name})"


# module -> {parameter name: its ExpertParameter}
_EXPERT_PARAMETERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def expert_parameter(module, name: str) -> ExpertParameter:
    """The ExpertParameter of module's 3-D parameter `name` (the same object every call)."""
    params = _EXPERT_PARAMETERS.setdefault(module, {})
    if name not in params:
        params[name] = ExpertParameter(module, name)
    return params[name]


def _target(layer):
    """What the FP8 gather works on: an FP8GroupedLinear's weight is an ExpertParameter."""
    return expert_parameter(layer, "weight") if isinstance(layer, FP8GroupedLinear) else layer


# the layers whose FP8 gather was refused, already reported (once per layer)
_REPORTED: "weakref.WeakSet" = weakref.WeakSet()


def _report_refusal(layer, reason: str) -> None:
    if layer not in _REPORTED:
        _REPORTED.add(layer)
        logger.info("FSDP2 gathers %r in high precision: %s", layer, reason)


def _is_experts(layer) -> bool:
    return isinstance(layer, ExpertParameter)


def follow_shard(layer, dtensor: DTensor) -> None:
    """Experts gathered in high precision: their cache still reads its values from FSDP2's
    sharded parameter, which the optimizer holds. The gathered full weight is a tensor of its
    own at every forward; without this, no optimizer would vouch for a cast of it, every
    micro-batch would cast anew and a delayed-scaling weight role would step each time, where
    one process steps once per accumulation window. (The dense layers follow theirs in their
    __setattr__.)"""
    layer = _target(layer)
    if _is_experts(layer):
        _follow_source(layer.weight_cache, dtensor)


def _follow_source(cache, dtensor: DTensor) -> None:
    """The experts' cache reads its values from FSDP2's sharded parameter: an optimizer step over
    it ends a cast (the dense layers do this in their __setattr__)."""
    if cache.source_tensor() is not dtensor:
        cache.source = weakref.ref(dtensor)
    cache.watch(dtensor)


# the modules whose state_dict unwraps their FP8WeightShards
_HOOKED: "weakref.WeakSet" = weakref.WeakSet()


def _plain_weight(module, state_dict, prefix, local_metadata) -> None:
    """A checkpoint holds the plain shards, not the FP8 all-gather's wrappers."""
    for name, _ in module.named_parameters(recurse=False):
        value = state_dict.get(prefix + name)
        if isinstance(value, DTensor):
            state_dict[prefix + name] = plain_local(value)


def plain_local(dtensor: DTensor) -> DTensor:
    """dtensor with a plain local tensor (state_dict: checkpoints hold plain tensors)."""
    local = dtensor._local_tensor
    if not isinstance(local, FP8WeightShard):
        return dtensor
    return DTensor.from_local(local._data, dtensor.device_mesh, dtensor.placements,
                              run_check=False, shape=dtensor.shape, stride=dtensor.stride())


class FP8WeightShard(torch.Tensor):
    """The local shard of an FSDP2-sharded FP8Linear weight: a plain high-precision tensor to
    every op (the optimizer updates it in place), plus FSDP2's all-gather extension."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, layer):
        # shares data's storage (FSDP2 compares the local tensor's storage with its own)
        return torch.Tensor._make_subclass(cls, data.detach(), False)

    def __init__(self, data: torch.Tensor, layer):
        self._data = data
        self._layer = layer if isinstance(layer, weakref.ref) else weakref.ref(layer)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        layers = []

        def unwrap(t):
            layers.append(t._layer)
            return t._data

        out = func(*tree_map_only(cls, unwrap, args), **tree_map_only(cls, unwrap, kwargs or {}))
        if func in _SHARD_KEEPS:
            return tree_map_only(torch.Tensor, lambda t: cls(t, layers[0]), out)
        return out

    def __repr__(self):
        return f"FP8WeightShard({self._data!r})"

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        layer = self._layer()
        # the dtype a high-precision gather would cast the shard to
        dtype = mp_policy.param_dtype if mp_policy.param_dtype is not None else self._data.dtype
        rows = -(-outer_size[0] // mesh.size())  # FSDP2's padded shard: ceil(N / world) rows
        recipe = layer.recipe
        fwd, _ = recipe_formats(recipe)
        if _is_experts(layer):
            kind, data, scale_inv = _experts_shard_cast(layer, self._data, dtype, mesh)
            return _with_scales(data, scale_inv, mesh), (kind, fwd.dtype,
                                                         tuple(scale_inv.shape[1:]))
        if quantizer_type(recipe)[0].kind == "blockwise":  # 128x128 blocks, whole in the shard
            values = self._data.to(dtype)
            data, scale_inv = _ops.quantize_blockwise(values, fwd.dtype, BLOCK, BLOCK,
                                                      recipe.power_of_two)
            meta = ("blockwise", fwd.dtype, tuple(scale_inv.shape[1:]))
            return _with_scales(data, scale_inv, mesh), meta
        scale, decision, record = _window_scale(layer, dtype, self._data.device)
        data = _shard_bytes(layer.fp8_state, self._data, dtype, scale, decision, fwd.dtype, rows,
                            record)
        return (data.view(torch.uint8),), ("tensor", fwd.dtype, (scale, decision))

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        kind, fp8_dtype, extra = metadata
        decision = None
        if kind == "tensor":
            data = outputs[0].view(fp8_dtype)
            scales, decision = extra
        elif len(outputs) == 2:
            data, scales = outputs[0].view(fp8_dtype), outputs[1]
        else:  # packed (world size 1): the data bytes, then the float32 block scales
            size = self.shape.numel()
            data = outputs[0][:size].view(fp8_dtype).view(self.shape)
            scales = outputs[0][size:].view(torch.float32).view(-1, *extra)
        if out is not None:  # FSDP2 re-gathered into the same storage: only the scales move
            out._scales, out._decision = scales, decision
            return None
        return FP8GatheredWeight(kind, data, scales, param_dtype, decision), (outputs[0],)


class FP8GatheredWeight(torch.Tensor):
    """The all-gathered FP8 weight FSDP2 hands the layer for compute: to autograd a [N, K] tensor
    of the parameter dtype, holding the FP8 bytes and their scales (a per-tensor scale, or block
    scale_inv [N/128, K/128]); or experts [E, N, K] with scale_inv per expert [E] or per expert's
    blocks [E, N/128, K/128]. FP8Linear reads the FP8 payload (fp8_payload), FP8GroupedLinear
    the experts' (expert_payload); any other op sees the dequantized weight. decision:
    (weight generation, stepped) of a per-tensor cast's scale (_window_scale)."""

    @staticmethod
    def __new__(cls, kind, data, scales, dtype, decision=None):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=dtype, device=data.device, requires_grad=False)

    def __init__(self, kind, data, scales, dtype, decision=None):
        self._kind, self._data, self._scales, self._decision = kind, data, scales, decision

    __torch_function__ = torch._C._disabled_torch_function_impl

    # fp8ops.linear outside the compiler: a compiled model runs a layer with this weight eagerly
    # (traced, the subclass lost its gradient). Made here, where importing the compiler is
    # already paid for, not when fp8ops is imported.
    linear_eagerly = staticmethod(torch.compiler.disable(linear))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _GATHERED_VIEWS and isinstance(args[0], cls):
            w = args[0]
            data = func(w._data, *args[1:], **kwargs)
            scales = w._scales
            if w._kind == "blockwise" and func in (_aten.t.default, _aten.transpose.int):
                scales = scales.t()
            if _scales_follow(w, func, data):
                return cls(w._kind, data, scales, w.dtype, w._decision)
        return func(*tree_map_only(cls, lambda t: t.dequantized(), args),
                    **tree_map_only(cls, lambda t: t.dequantized(), kwargs))

    def __repr__(self):
        return f"FP8GatheredWeight({self._kind}, shape={tuple(self.shape)}, dtype={self.dtype})"

    def dequantized(self) -> torch.Tensor:
        """The weight the FP8 bytes stand for, in the parameter's dtype."""
        if self._kind == "tensor":
            return _ops.dequantize(self._data, torch.reciprocal(self._scales), self.dtype)
        if self._kind == "experts":
            return torch.stack([_ops.dequantize(data, scale_inv, self.dtype)
                                for data, scale_inv in zip(self._data, self._scales)])
        if self._kind == "experts_blockwise":
            return torch.stack([_ops.dequantize_blockwise(data, scale_inv, BLOCK, BLOCK, self.dtype)
                                for data, scale_inv in zip(self._data, self._scales)])
        return _ops.dequantize_blockwise(self._data, self._scales, BLOCK, BLOCK, self.dtype)

    def expert_payload(self, cache=None, live: bool = False) -> tuple:
        """The experts' cast as FP8GroupedLinear's Functions take it: current and delayed
        scaling (data, data^T, scale_inv), blockwise (data, scale_inv, data^T, scale_inv^T). The
        transposed copies are made here, after the gather (gathering them too would double the
        bytes). cache: the layer's WeightCache, whose shard cast this forward uses: the
        backward's gradient then vouches for it (the next micro-batch's gathers reuse it).
        live: a forward that steps delayed scaling; bytes gathered by a forward that did not
        step it (FSDP2 without reshard_after_forward keeps an eval forward's gather) are cast
        again, stepping, as the unsharded layer would (_expert_recast)."""
        if live and cache is not None and not _stepped_cast(cache):
            return self._expert_recast(cache)
        if cache is not None and cache.entry is not None:
            cache.consume(weight_cache.leaf(self), False)
        data = self._data.contiguous()
        data_t = transpose_experts(data)
        if self._kind == "experts":
            return data, data_t, self._scales
        return data, self._scales, data_t, self._scales.transpose(1, 2)

    def _expert_recast(self, cache) -> tuple:
        """expert_payload of a live forward whose gathered bytes did not step: this rank's
        shard cast again through the cache (stepping and recording, as the unsharded layer's
        forward would), and the weight, all-gathered in high precision, cast with the window's
        scales [E] (the bytes FSDP2's next gather brings)."""
        source = cache.source_tensor()
        shard = source._local_tensor
        layer = shard._layer()
        _experts_shard_cast(layer, shard._data, self.dtype, source.device_mesh)
        scale = cache.entry.scale
        values = source.full_tensor().to(self.dtype)
        fwd, _ = recipe_formats(layer.recipe)
        data, data_t, _ = quantize_experts_scaled(values, scale, fwd.dtype)
        cache.consume(weight_cache.leaf(self), False)
        return data, data_t, torch.reciprocal(scale)

    def fp8_payload(self, state=None, live: bool = False):
        """What the layer's weight cast would return: per-tensor (data, data^T, scale_inv,
        scale); blockwise (data, scale_inv, data^T). The transposed copy is made here, after
        the gather (gathering it too would double the bytes). None when the bytes were cast for
        another kind of forward, which FSDP2 without reshard_after_forward can hand a training
        forward (an eval forward's cast that did not step, or a cast no backward has vouched
        for since a training forward used it): the caller then casts high_precision()."""
        if self._decision is not None and state is not None:
            cache = state.weight_cache
            if not _fits(cache.entry, self._decision, cache, live):
                return None
            if live:  # its backward vouches for the next forward
                cache.consume(weight_cache.leaf(self), live)
        data = self._data.contiguous()
        data_t = _ops.transpose_fp8(data)
        if self._kind == "tensor":
            return data, data_t, torch.reciprocal(self._scales), self._scales
        return data, self._scales.contiguous(), data_t

    def recast(self, state, cast, live: bool, recompute: bool):
        """The fallback of fp8_payload: the weight all-gathered in high precision from the
        sharded parameter (DTensor.full_tensor()) and cast as a single process would (`cast`:
        the layer's weight cast). The cast's scale then serves FSDP2's next gathers of the
        window, vouched for by this weight's backward."""
        cache = state.weight_cache
        values = cache.source_tensor().full_tensor().to(self.dtype)
        if self.stride(0) < self.stride(1):  # FP8Conv1D's transposed view
            values = values.t()
        payload = state.cached_weight(values, cast, live, recompute)
        gather = _gather_state(cache)
        gather.decisions += 1
        cache.consume(weight_cache.leaf(self), live, gather.decisions)
        gather.key = _values_key(cache)
        return payload


def _with_scales(data: torch.Tensor, scale_inv: torch.Tensor, mesh) -> tuple:
    """The all-gather inputs of FP8 bytes with scales of their own (blocks, experts): both, or
    at world size 1, where FSDP2 copies only the first input, the two packed in one."""
    if mesh.size() == 1:
        return (torch.cat([data.view(torch.uint8).flatten(),
                           scale_inv.view(torch.uint8).flatten()]),)
    return data.view(torch.uint8), scale_inv


def _experts_shard_cast(layer, shard: torch.Tensor, dtype: torch.dtype, mesh) -> tuple:
    """(kind, data, scale_inv) of this rank's experts, rounded to the gather's dtype and cast
    each on its own as the unsharded layer casts them (whole experts: their scales are local).
    Cast once per optimizer step under the weight cache's rule, with FSDP2's sharded parameter
    as the values' source: every gather of the window (micro-batches, backward re-gathers) takes
    the same bytes. A backward's re-gather needs the key alone: nothing may change a weight
    between a forward and its backward. Delayed scaling steps the weight role when the cache
    says the unsharded layer would (a training forward opening a window): the same decision on
    every rank, whose states are identical."""
    cache, recipe = layer.weight_cache, layer.recipe
    made_for = (recipe, dtype)
    backward = torch._C._current_graph_task_id() != -1
    if quantizer_type(recipe)[0].delayed:
        held = _held_experts(shard, mesh)
        cast = _delayed_shard_cast(layer.state, recipe, shard, dtype, held, made_for)
        live = not backward and layer.module.training and not in_recompute()
    else:
        def cast(_, step, scale):  # (weight_cache.Cast: no delayed scaling: no step, no scale)
            return (made_for, _cast_expert_values(shard.to(dtype), recipe)), None
        live = False

    stored = _stored_shard(cache, shard)
    trust = weight_cache.KEY if backward else cache.trust
    with torch.no_grad():
        made, payload = cache.get(stored, cast, live=live, trust=trust,
                                  source=cache.source_tensor())
        if made != made_for:  # the recipe or the gather's dtype changed since that cast
            cache.invalidate()
            made, payload = cache.get(stored, cast, live=live, trust=trust,
                                      source=cache.source_tensor())
    return payload


def _held_experts(shard: torch.Tensor, mesh) -> slice:
    """The experts of the whole weight this rank's shard holds (Shard(0), split evenly)."""
    start = mesh.get_local_rank() * shard.shape[0]
    return slice(start, start + shard.shape[0])


def _delayed_shard_cast(state, recipe, shard: torch.Tensor, dtype: torch.dtype, held: slice,
                        made_for):
    """weight_cache.Cast of delayed-scaling experts on this rank's shard: the grouped layer's
    (nn/grouped_quantizers.py: GroupedDelayed.cast_experts) with the scales [E] of the whole
    weight, of which the shard takes its experts' slice. The role's scales are the same on every
    rank (their records are all-reduced), so the cache keeps (and a checkpoint saves) the whole
    [E]. Experts held elsewhere add 0 to the warm start's and the record's amaxes: the MAX over
    the ranks is each expert's own amax."""
    fwd, _ = recipe_formats(recipe)
    role = state.weight

    def whole(amax):  # (on the state's device: with FSDP2's CPUOffloadPolicy the shard is not)
        return _spread(amax.to(role.pending_amax.device), held, state.num_experts)

    def cast(_, step, scale):
        values = shard.to(dtype)
        if scale is None:
            if step:
                state.step_role("weight", recipe, fwd, recipe.margin)
            scale = (role.scale.clone() if role.started else
                     role.warm_scale(whole(experts_amax(values)), fwd, recipe.margin, recipe))
        mine = scale[held].to(values.device)
        data, _, amax = quantize_experts_scaled(values, mine, fwd.dtype, transpose=False)
        if step:  # recorded on this rank: the backward's one all-reduce folds the ranks in
            state.record_role("weight", whole(amax))
            role.started = True
        return (made_for, ("experts", data, torch.reciprocal(mine))), scale
    return cast


def _spread(amax: torch.Tensor, held: slice, experts: int) -> torch.Tensor:
    """This rank's experts' amax in the whole weight's [E], 0 for the experts held elsewhere
    (the identity of a MAX over amaxes)."""
    whole = amax.new_zeros(experts)
    whole[held] = amax
    return whole


def _stored_shard(cache, shard: torch.Tensor) -> torch.Tensor:
    """The shard as the sharded parameter stores it (the cache's key): with FSDP2's
    CPUOffloadPolicy the gather reads a fresh device copy of it."""
    source = cache.source_tensor()
    local = None if source is None else source._local_tensor
    return local._data if isinstance(local, FP8WeightShard) else shard


def _cast_expert_values(values: torch.Tensor, recipe) -> tuple:
    """(kind, data, scale_inv) of experts [E, out, in]: the expert casts of the grouped layer,
    without their transposed copies (made after the gather: FP8GatheredWeight.expert_payload)."""
    quantizer = quantizer_for(recipe)
    cast = quantizer.expert_cast(values, transpose=False)
    if quantizer.kind == "blockwise":  # (data, scale_inv, data^T, scale_inv^T)
        return "experts_blockwise", cast[0], cast[1]
    return "experts", cast[0], cast[2]  # (data, data^T, scale_inv)


def _stepped_cast(cache) -> bool:
    """Whether the cache's shard cast is one a training forward stepped delayed scaling for,
    of the weight's current values."""
    entry = cache.entry
    return entry is not None and entry.stepped and entry.generation == cache.value


def _scales_follow(w: "FP8GatheredWeight", func, data: torch.Tensor) -> bool:
    """Whether a view of gathered weight w is still the FP8 weight with w's scales: a per-tensor
    scale follows any view; block scales the whole weight or its transpose; experts' scales the
    whole experts only."""
    if w._kind == "tensor":
        return True
    if w._kind.startswith("experts"):
        return data.shape == w.shape and func not in (_aten.t.default, _aten.transpose.int)
    return data.shape in (w.shape, w.shape[::-1])


def _shard_bytes(state, local: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor,
                 decision: int, fp8_dtype: torch.dtype, rows: int,
                 record: bool = False) -> torch.Tensor:
    """This rank's shard, in `dtype`, cast with the window's scale and padded to FSDP2's `rows`.
    A forward's gather keeps its bytes for the backward's re-gather (FSDP2 resharded after
    forward), which takes them instead of casting again: the same decision of the same values
    (nothing may change a weight between a forward and its backward) gives the same bytes.
    FSDP2 only reads them (it copies them into its all-gather buffer). The backward releases
    them (WeightCache.release), re-gathered or not."""
    cache = state.weight_cache
    key = (decision, _values_key(cache), dtype)
    backward = torch._C._current_graph_task_id() != -1
    if backward:
        kept = cache.take(key)
        if kept is not None:
            return kept
    # rounded to the gather's dtype inside the cast: no converted copy of the shard first
    via = None if local.dtype == dtype else dtype
    data, _, amax = _ops.quantize(local, scale, fp8_dtype, via=via)
    if record:  # the shard's amax, as the cast read it, recorded on this rank only: the
        # all-reduce at the end of the backward pass folds every rank's in with the other roles'
        # records (amax_reduction), so a step makes one amax all-reduce, not one more for these
        amax = amax.to(state.weight.pending_amax.device, torch.float32)  # (a host shard too)
        state.weight.record_reduced(amax, torch.isfinite(amax))
        state.record_locally("weight")
    if data.shape[0] != rows:  # an uneven shard: FSDP2 gathers equal pieces
        padded = data.new_zeros((rows, *data.shape[1:]))
        padded[:data.shape[0]] = data
        data = padded
    # kept only for a backward that may follow (none under no_grad, eval or inference)
    keep = not backward and torch.is_grad_enabled()
    cache.keep(key, data if keep else None)
    return data


def _fits(entry, decision: int, cache, live: bool) -> bool:
    """Whether the gathered cast with this decision number serves this forward."""
    if entry is None or entry.gathered != decision or entry.generation != cache.value:
        return False
    return not live or (entry.stepped and (not entry.consumed or
                                           entry.mark is not weight_cache.NO_MARK))


def _reusable(entry, cache, live: bool, key) -> bool:
    """Whether a gather may cast with entry's scale instead of deciding a new one. A training
    forward steps delayed scaling once per accumulation window, as a single process does: it
    reuses a stepped scale that is fresh or vouched for by a backward since (frozen weights
    step every forward), or one restored from a checkpoint (whatever values it was decided
    for: the restored generation's)."""
    if entry is None or entry.scale is None or entry.generation != cache.value:
        return False
    decided = _gather_state(cache).key  # (a key of an older generation: restored since)
    if not cache.restored and decided is not None and decided[0] == cache.value \
            and decided != key:
        return False
    if not live or cache.restored:
        return True
    vouched = entry.mark is not weight_cache.NO_MARK
    return entry.stepped and (vouched or (entry.gathered and not entry.consumed))


def _window_scale(layer, dtype: torch.dtype, device: torch.device):
    """(scale, decision number, record) of this gather's per-tensor cast: decided once per
    accumulation window (a delayed-scaling layer steps its weight role then) and reused by every
    gather until the weight changes (an optimizer step over it, an in-place write, a checkpoint
    load). record: the cast records its shard's amax in the stepped weight role."""
    state, recipe = layer.fp8_state, layer.recipe
    cache = state.weight_cache
    gather = _gather_state(cache)
    live = layer.training and state.delayed and not in_recompute()
    key = _values_key(cache)
    entry = cache.entry
    if _reusable(entry, cache, live, key):
        gather.key = key
        if not entry.gathered:  # a restored or fallback cast's scale: number it
            gather.decisions += 1
            cache.number_decision(gather.decisions)
        return entry.scale, cache.entry.gathered, False
    fwd, _ = recipe_formats(recipe)
    role = state.weight if state.delayed else None
    record = False
    if role is not None and role.started:
        if live:
            if state.needs_reduce("weight"):  # a local record (a recast) must count first
                state.reduce_records()
            role.update(recipe, fwd, recipe.margin)
            record = True  # by the cast (_shard_bytes)
        scale = role.scale.clone()  # the history's: no amax needed before the cast
    else:  # current scaling, or a delayed-scaling warm start: the weight's own amax
        amax, finite, own_scale = _global_amax(layer, key, dtype, device)
        if role is not None and live:
            if state.needs_reduce("weight"):
                state.reduce_records()
            role.update(recipe, fwd, recipe.margin)
        scale = own_scale if own_scale is not None else _own_scale(recipe, amax, finite)
        if role is not None and live:
            role.record_reduced(amax, finite)
            role.started = True
    gather.decisions += 1
    cache.store_decision(scale, stepped=live, number=gather.decisions)
    gather.key = key
    return scale, gather.decisions, record


# ---------------------------------------------------------------------------------------------
# one amax all-reduce per step for all per-tensor layers
# ---------------------------------------------------------------------------------------------
# the layers whose weights FSDP2 gathers in FP8, in the order fully_shard reached them (the same
# on every rank, so every rank reduces the same layers in the same order)
_GATHERING: "list[weakref.ref]" = []


def _register(layer) -> None:
    global _GATHERING
    _GATHERING = [r for r in _GATHERING if r() is not None and r() is not layer]
    _GATHERING.append(weakref.ref(layer))


class _GatherState:
    """What the FP8 gather of one layer's weight keeps between calls: the values key its decided
    scale is for, the weight's amax as the last batched all-reduce left it (values key, amax,
    finite, (dtype and device, rounded amax, scale)), and how many scales it decided (numbers
    them). Dropped with the cache (a copy's cache starts without one)."""

    __slots__ = ("key", "amax", "decisions", "__weakref__")

    def __init__(self):
        self.key, self.amax, self.decisions = None, None, 0


_GATHER: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _gather_state(cache) -> _GatherState:
    gather = _GATHER.get(cache)
    if gather is None:
        gather = _GATHER[cache] = _GatherState()
    return gather


def _values_key(cache) -> tuple:
    """What identifies the weight's values: the layer's weight generation, the sharded parameter
    (the DTensor the optimizer updates) and its version."""
    source = cache.source_tensor()
    return cache.value, id(source), source._version


def _group(state):
    return state.weight_cache.source_tensor().device_mesh.get_group()


def _global_amax(layer, key: tuple, dtype: torch.dtype, device: torch.device):
    """(amax, finite, scale) of the whole weight: the MAX over the shards, in `dtype` (the dtype
    the cast reads: amax commutes with rounding to nearest); finite on every rank; current
    scaling's scale from that amax when it was made with the others' (else None). The first
    layer of a step that needs one all-reduces those of every per-tensor layer of its mesh whose
    weight changed, in one collective: those stepped by the same optimizer step as this one (a
    model's layers; never a model no longer trained, which one rank may have collected and
    another not yet). Before its first optimizer step a layer all-reduces its own."""
    gather = _gather_state(layer.fp8_state.weight_cache)
    if gather.amax is None or gather.amax[0] != key:
        _reduce_changed(layer, device, dtype)
    _, amax, finite, made = gather.amax
    if made is not None and made[0] == (dtype, device):
        return made[1], finite, made[2]
    return amax.to(device=device, dtype=dtype).float(), finite.to(device), None


def _own_scale(recipe, amax: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """Current scaling's scale of the weight (elementwise: amax may hold many layers')."""
    return current_scale(torch.where(finite, amax, float("nan")), recipe_formats(recipe)[0],
                         recipe.margin, recipe.power_of_two)


@torch.no_grad()
def _reduce_changed(layer, device: torch.device, dtype: torch.dtype) -> None:
    """device: where the gather runs (with FSDP2's CPUOffloadPolicy the shards are on the host;
    the collective runs on the device); dtype: the one the calling layer's cast reads. The
    rounding to dtype and the scales are made for all the layers at once (a handful of ops per
    step, not per layer); a layer whose cast reads another dtype makes its own."""
    group = _group(layer.fp8_state)
    serial = layer.fp8_state.weight_cache.generation.step_serial
    layers, keys = [], []
    others = [] if serial is None else [ref() for ref in _GATHERING]
    for other in others + ([] if layer in others else [layer]):
        # (block scales are the shard's own: nothing to reduce; a class attribute, nothing made)
        if other is None or quantizer_type(other.recipe)[0].kind == "blockwise":
            continue
        cache = other.fp8_state.weight_cache
        if cache.source_tensor() is None or _group(other.fp8_state) is not group:
            continue
        if other is not layer and (cache.generation.step_serial != serial or (
                other.fp8_state.delayed and other.fp8_state.weight.started)):
            continue  # (a started delayed-scaling role records its shard's amax: no collective)
        key = _values_key(cache)
        amax = _gather_state(cache).amax
        if amax is None or amax[0] != key:
            layers.append(other)
            keys.append(key)
    local = torch.stack([
        _ops.amax(other.fp8_state.weight_cache.source_tensor()._local_tensor._data).to(device)
        for other in layers])
    amax, finite = all_reduce_amax(local, group, recipe=layer.recipe)
    rounded = amax.to(dtype).float()
    # scales only for the layers that take their own amax's (a started delayed-scaling role
    # takes its history's), and in one go only when they are one function of the amax
    kinds = {(o.recipe.fwd_fmt, o.recipe.margin, o.recipe.power_of_two) for o in layers}
    wanted = any(not (o.fp8_state.delayed and o.fp8_state.weight.started) for o in layers)
    scales = _own_scale(layers[0].recipe, rounded, finite) if wanted and len(kinds) == 1 \
        else None
    for i, (other, key) in enumerate(zip(layers, keys)):
        _gather_state(other.fp8_state.weight_cache).amax = (key, amax[i], finite[i], (
            (dtype, device), rounded[i], None if scales is None else scales[i]))


__all__ = ["FP8WeightShard", "FP8GatheredWeight", "experts_gather_refusal", "gathers_fp8", "install",
           "plain_local"]
