"""The two tensors FSDP2 handles for a weight gathered in FP8: the sharded parameter's local
tensor, FP8WeightShard (a plain tensor to every op, plus FSDP2's all-gather extension points
`fsdp_pre_all_gather` / `fsdp_post_all_gather`, which cast the shard: dense.py, experts.py), and
the gathered weight, FP8GatheredWeight (the FP8 bytes and their scales, which the layers read
as their weight cast). State dicts hold plain shards (plain_local).
"""
from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from ...nn.functional import linear
from ...nn.quantizers import quantizer_type
from ...ops.expert_casts import quantize_experts_scaled, transpose_experts
from ...scaling import recipe_formats, weight_cache
from .dense import fits, shard_bytes, window_scale
from .experts import is_experts, shard_cast, stepped_cast
from .weight_amax import gather_state, values_key

_ops = torch.ops.fp8ops
_aten = torch.ops.aten
BLOCK = 128  # the weights' blockwise blocks: 128x128

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

# the modules whose state_dict unwraps their FP8WeightShards
_HOOKED: "weakref.WeakSet" = weakref.WeakSet()


def hook_state_dict(module) -> None:
    """module's state_dict holds its parameters' plain shards (once per module)."""
    if module not in _HOOKED:
        _HOOKED.add(module)
        module.register_state_dict_post_hook(_plain_weight)


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
    """The local shard of an FSDP2-sharded weight gathered in FP8 (an FP8Linear's; experts'): a
    plain high-precision tensor to every op (the optimizer updates it in place), plus FSDP2's
    all-gather extension. layer: the FP8Linear, or the experts' ExpertParameter."""

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
        if is_experts(layer):
            stored = _stored_shard(layer.weight_cache, self._data)
            kind, data, scale_inv = shard_cast(layer, self._data, stored, dtype, mesh)
            return _with_scales(data, scale_inv, mesh), (kind, fwd.dtype,
                                                         tuple(scale_inv.shape[1:]))
        if quantizer_type(recipe)[0].kind == "blockwise":  # 128x128 blocks, whole in the shard
            values = self._data.to(dtype)
            data, scale_inv = _ops.quantize_blockwise(values, fwd.dtype, BLOCK, BLOCK,
                                                      recipe.power_of_two)
            meta = ("blockwise", fwd.dtype, tuple(scale_inv.shape[1:]))
            return _with_scales(data, scale_inv, mesh), meta
        scale, decision, record = window_scale(layer, dtype, self._data.device)
        data = shard_bytes(layer.fp8_state, self._data, dtype, scale, decision, fwd.dtype, rows,
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
    (weight generation, stepped) of a per-tensor cast's scale (dense.window_scale)."""

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
        if live and cache is not None and not stepped_cast(cache):
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
        shard_cast(layer, shard._data, _stored_shard(layer.weight_cache, shard._data), self.dtype,
                   source.device_mesh)
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
            if not fits(cache.entry, self._decision, cache, live):
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
        gather = gather_state(cache)
        gather.decisions += 1
        cache.consume(weight_cache.leaf(self), live, gather.decisions)
        gather.key = values_key(cache)
        return payload


def _with_scales(data: torch.Tensor, scale_inv: torch.Tensor, mesh) -> tuple:
    """The all-gather inputs of FP8 bytes with scales of their own (blocks, experts): both, or
    at world size 1, where FSDP2 copies only the first input, the two packed in one."""
    if mesh.size() == 1:
        return (torch.cat([data.view(torch.uint8).flatten(),
                           scale_inv.view(torch.uint8).flatten()]),)
    return data.view(torch.uint8), scale_inv


def _stored_shard(cache, shard: torch.Tensor) -> torch.Tensor:
    """The shard as the sharded parameter stores it (the cache's key): with FSDP2's
    CPUOffloadPolicy the gather reads a fresh device copy of it."""
    source = cache.source_tensor()
    local = None if source is None else source._local_tensor
    return local._data if isinstance(local, FP8WeightShard) else shard


def _scales_follow(w: "FP8GatheredWeight", func, data: torch.Tensor) -> bool:
    """Whether a view of gathered weight w is still the FP8 weight with w's scales: a per-tensor
    scale follows any view; block scales the whole weight or its transpose; experts' scales the
    whole experts only."""
    if w._kind == "tensor":
        return True
    if w._kind.startswith("experts"):
        return data.shape == w.shape and func not in (_aten.t.default, _aten.transpose.int)
    return data.shape in (w.shape, w.shape[::-1])
