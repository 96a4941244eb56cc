"""Tensor parallelism for FP8Linear: DTensor parallel styles for parallelize_module.

    from torch.distributed.tensor.parallel import parallelize_module
    parallelize_module(model, tp_mesh, {"w1": fp8ops.FP8ColwiseParallel(),
                                        "w2": fp8ops.FP8RowwiseParallel()})

The fp8ops operators have no DTensor sharding rules, so each parallelized FP8Linear runs on its
local shards (weight.to_local(), the local input; autograd returns the gradients into the DTensor
parameters) and the style adds the collectives its layout implies:
  colwise  W [N, K] sharded along N (Shard(0)): input Replicate, output Shard(-1); dX is a partial
           sum over the N shards, summed when the input's redistribution runs backward.
  rowwise  W sharded along K (Shard(1)): input Shard(-1), the local GEMM gives a partial sum,
           all-reduced to Replicate or reduce-scattered to Shard(d) (sequence parallelism); the
           bias is added after the reduction.
Per-tensor scales are those one process computes: the amax of every sharded tensor (the weight
shard, a sharded input, a sharded dY) is all-reduced (MAX) over the mesh before a scale is taken
from it (ScalingState.shard_over). Block scales (MXFP8: 1 x block_size along K; blockwise: 1x128
activations and gradients, 128x128 weights) never cross a block, so shards cut on block
boundaries cast to the very same bytes with no communication; other cuts are refused.

PrepareFP8ModuleInput is torch's PrepareModuleInput whose all-gather of a sequence-sharded input
runs in FP8 when the module's FP8Linear layers use CurrentScaling: each rank casts its shard
with the scale of the whole activation and the FP8 bytes are gathered, once for every FP8 layer
that reads the input (docs/numerics.md, "Tensor parallelism").
"""
from __future__ import annotations

import functools
import weakref
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import (DTensor, Partial, Replicate, Shard, distribute_tensor)
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               RowwiseParallel)

from ..formats import get_format
from ..nn.autograd import output_dtype
from ..nn.functional import linear
from ..nn.modules import FP8Conv1D, FP8Linear
from ..nn.quantizers import quantizer_for
from ..scaling import CurrentScaling, current_scale, weight_cache
from ..scaling.amax_all_reduce import shard_amax

__all__ = ["FP8ColwiseParallel", "FP8RowwiseParallel", "PrepareFP8ModuleInput", "shard_scales"]

_ops = torch.ops.fp8ops
_GATHERED = "_fp8ops_gathered"  # the attribute that carries an FP8-gathered input's cast


# ----------------------------------------------------------------------------------------------
# checks
# ----------------------------------------------------------------------------------------------
def _check_mesh(mesh, style: str) -> None:
    if mesh is None or mesh.ndim != 1:
        ndim = None if mesh is None else mesh.ndim
        raise ValueError(f"{style} takes the 1-D tensor-parallel mesh (e.g. mesh['tp'] of a "
                         f"2-D ('dp', 'tp') mesh), got a mesh with {ndim} dimensions")


def _check_module(module: nn.Module, style: str) -> None:
    torch_style = style.replace("FP8", "")
    if not isinstance(module, FP8Linear):
        raise TypeError(f"{style} parallelizes fp8ops.FP8Linear layers, got "
                        f"{type(module).__name__}: convert it first (fp8ops.convert_to_fp8), "
                        f"or use torch's {torch_style} for a high-precision layer")
    if isinstance(module, FP8Conv1D):
        raise TypeError(f"{style} does not take FP8Conv1D (its weight is [in, out]): convert "
                        f"the model's Conv1D layers to nn.Linear first")
    if module.fp8_state.host_weight is not None:
        raise ValueError(f"{style}: this FP8Linear's weight is owned by a CPUOffloadOptimizer; "
                         f"parallelize the model before building the optimizer")
    if isinstance(module.weight, DTensor):
        raise ValueError(f"{style}: this FP8Linear's weight is a DTensor already (parallelized "
                         f"twice?)")


def _check_blocks(recipe, size: int, world: int, what: str, style: str) -> None:
    """Each shard must start on a block boundary: then every block lies within one rank and the
    shards cast to the bytes of the whole tensor's cast. DTensor cuts as torch.chunk does."""
    block = quantizer_for(recipe).scale_block
    chunk = -(-size // world)
    if block is None or world == 1 or chunk % block == 0:
        return
    raise ValueError(f"{style}: {type(recipe).__name__} scales blocks of {block} along {what}, "
                     f"but {what} = {size} over {world} ranks gives shards of {chunk}, not a "
                     f"multiple of {block}: a block would span two ranks. Use a {what} that "
                     f"splits into multiples of {block} (e.g. {block * world}), fewer ranks, or "
                     f"a per-tensor recipe (CurrentScaling / DelayedScaling) for this layer")


# set on the DTensor weights the styles register (FSDP2 computes with parameters of its own)
TP_WEIGHT = "_fp8ops_tp_weight"


def _shard(module: nn.Module, name: str, placement, mesh, src_data_rank) -> None:
    param = module._parameters[name]
    dt = nn.Parameter(distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank),
                      requires_grad=param.requires_grad)
    setattr(dt, TP_WEIGHT, True)
    # setattr: FP8Linear watches the new parameter (its optimizer steps end the cached cast) and
    # keys the weight cache on it (its version moves when the local values are updated in place)
    setattr(module, name, dt)


# The weight cache hooks the gradient of the leaf the cast reads, which for a DTensor's local
# view is no parameter: the styles hook the DTensor weight instead. ScalingState -> (weak
# reference to that weight, the hook's handle) and -> (weak reference to it, the state of its
# gradient when its backward vouched for the cast).
_HOOKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_MARKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _vouch(state_ref, param) -> None:
    """After backward accumulated the DTensor weight's gradient: the cast made from its local
    shard may be reused while that gradient stays (the weight cache's gradient voucher)."""
    state = state_ref()
    if state is not None:
        state.weight_cache.grad_accumulated(param._local_tensor)
        _MARKS[state] = (weakref.ref(param), weight_cache.grad_mark(param))


def _hook_weight(module: FP8Linear) -> None:
    weight, state = module.weight, module.fp8_state
    hooked = _HOOKED.get(state)
    if hooked is not None and hooked[0]() is weight:
        return
    if hooked is not None:
        hooked[1].remove()
        del _HOOKED[state]
    if weight.requires_grad:  # FSDP2 swaps in another DTensor parameter for compute
        handle = weight.register_post_accumulate_grad_hook(
            functools.partial(_vouch, weakref.ref(state)))
        _HOOKED[state] = (weakref.ref(weight), handle)


def _end_stale_cast(module: FP8Linear) -> None:
    """The style's own weight: once its vouching gradient is zeroed or replaced (an update of a
    training loop, also one through p.data, which no DTensor version counter shows), the next
    forward casts anew, as for a plain weight. Under FSDP2 the gathered copy's gradient goes
    after every backward: its cast is vouched for as under FSDP2 alone."""
    state, weight = module.fp8_state, module.weight
    marked = _MARKS.get(state)
    if (marked is not None and marked[0]() is weight and getattr(weight, TP_WEIGHT, False)
            and not weight_cache.mark_matches(marked[1], weight)):
        del _MARKS[state]
        state.weight_cache.invalidate()  # the weight's values may have changed


def _before_state_dict(module: FP8Linear, prefix, keep_vars) -> None:
    _end_stale_cast(module)  # a checkpoint keeps only the scale of a cast the forward reuses


def _prepare_weight(module: FP8Linear, sharded_roles) -> None:
    state = module.fp8_state
    if (quantizer_for(state.recipe).scale_block is None
            and not all(role in state.shard_meshes for role in sharded_roles)):
        raise RuntimeError("fp8ops: this tensor-parallel FP8Linear's FP8 state was replaced "
                           "after parallelize_module (convert_to_fp8 with another recipe?): its "
                           "shards would be cast with their own scales. Convert the model "
                           "before parallelizing it")
    state.set_recording(module.training)  # as FP8Linear.forward
    if not torch.compiler.is_compiling():
        # the weight cache's bookkeeping, eager only: a compiled layer casts every call, and a
        # traced lookup would guard on these process-wide weak maps and on the cache's
        # generation (a recompile each step; a dropped model's entries vanish mid-frame)
        _end_stale_cast(module)
        _hook_weight(module)


# the roles whose tensors the ranks hold in shards, by the weight's sharded dimension:
# colwise (0) shards the weight and the output's gradient, rowwise (1) the weight and the input
SHARDED_ROLES = {0: ("weight", "grad"), 1: ("weight", "input")}


def shard_scales(module: FP8Linear, mesh, weight_dim: int, who: str) -> None:
    """Make the FP8 layer `module`, whose weight the 1-D `mesh` shards along `weight_dim` (0:
    out_features, colwise; 1: in_features, rowwise), scale as one process does: per-tensor
    scales from amaxes all-reduced over the mesh (ScalingState.shard_over), block scales from
    shards checked to start on block boundaries (raises ValueError naming `who` otherwise).
    The styles here call it; so does a framework that shards FP8Linear weights itself."""
    features = ("out_features", "in_features")[weight_dim]
    _check_blocks(module.recipe, getattr(module, features), mesh.size(), features, who)
    if quantizer_for(module.recipe).scale_block is None:  # (block scales are local)
        for role in SHARDED_ROLES[weight_dim]:
            module.fp8_state.shard_over(role, mesh)


def _partition(module: FP8Linear, mesh, weight_dim: int, bias_placement, src_data_rank,
               who: str) -> None:
    shard_scales(module, mesh, weight_dim, who)
    _shard(module, "weight", Shard(weight_dim), mesh, src_data_rank)
    if module.bias is not None:
        _shard(module, "bias", bias_placement, mesh, src_data_rank)


def _prepare_input(style, mesh, module, args):
    return style._prepare_input_fn(style.input_layouts, style.desired_input_layouts, module,
                                   args, mesh)


def _prepare_output(style, mesh, module, args, out):
    return style._prepare_output_fn(style.output_layouts, style.use_local_output, module, out,
                                    mesh)


def _install(style, module: FP8Linear, mesh) -> FP8Linear:
    """torch's input and output hooks of the style, and the forward on local shards (partials,
    not closures: the module still pickles). Not distribute_module: that would make the FP8
    state's buffers replicated DTensors too, which the fp8ops operators cannot take."""
    module.register_forward_pre_hook(functools.partial(_prepare_input, style, mesh))
    module.register_forward_hook(functools.partial(_prepare_output, style, mesh))
    module.register_state_dict_pre_hook(_before_state_dict)
    module.forward = functools.partial(style._local_forward, module)
    module._distribute_module_applied = True
    return module


def _global(local: torch.Tensor, mesh, placement, shape) -> DTensor:
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, (placement,), run_check=False, shape=torch.Size(shape),
                              stride=stride)


# ----------------------------------------------------------------------------------------------
# the styles
# ----------------------------------------------------------------------------------------------
def _shard_module(style, module: nn.Module, device_mesh, dim: int, bias_placement) -> nn.Module:
    """Check and shard module's weight along `dim` (0: out_features, 1: in_features) over the
    1-D device_mesh, its bias as bias_placement, and install the style's forward."""
    name = type(style).__name__
    _check_mesh(device_mesh, name)
    _check_module(module, name)
    _partition(module, device_mesh, dim, bias_placement, style.src_data_rank, name)
    return _install(style, module, device_mesh)


class FP8ColwiseParallel(ColwiseParallel):
    """torch's ColwiseParallel for fp8ops.FP8Linear (same arguments: input_layouts,
    output_layouts, use_local_output). The weight and bias are sharded along out_features; the
    layer computes on its shard with the scales of the whole weight and gradient."""

    SHARDED = SHARDED_ROLES[0]  # the roles whose tensors the ranks hold in shards

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return _shard_module(self, module, device_mesh, 0, Shard(0))

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        gathered = getattr(inputs[0], _GATHERED, None)  # a plain tensor of PrepareFP8ModuleInput
        x = ColwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs,
                                              device_mesh)
        if gathered is not None:
            setattr(x, _GATHERED, gathered)
        return x

    def _local_forward(self, module: FP8Linear, x: DTensor) -> DTensor:
        _prepare_weight(module, self.SHARDED)
        weight, bias = module.weight, module.bias
        gathered = getattr(x, _GATHERED, None)
        # the local input's gradient is this shard's part of dX: a sum over ranks
        x_local = x.to_local(grad_placements=(Partial(),))
        b_local = None if bias is None else bias.to_local()
        if gathered is None:
            y = linear(x_local, weight.to_local(), b_local, state=module.fp8_state)
        else:
            y = gathered.linear(x_local, weight.to_local(), b_local, module)
        return _global(y, weight.device_mesh, Shard(y.dim() - 1),
                       (*x.shape[:-1], module.out_features))


class FP8RowwiseParallel(RowwiseParallel):
    """torch's RowwiseParallel for fp8ops.FP8Linear (same arguments: input_layouts,
    output_layouts, use_local_output). The weight is sharded along in_features, the bias
    replicated; the layer computes a partial sum on its shard (with the scales of the whole
    input and weight), reduced to output_layouts, then adds the bias."""

    SHARDED = SHARDED_ROLES[1]

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)
        return _shard_module(self, module, device_mesh, 1, Replicate())

    def _local_forward(self, module: FP8Linear, x: DTensor) -> DTensor:
        _prepare_weight(module, self.SHARDED)
        weight = module.weight
        y = linear(x.to_local(), weight.to_local(), None, state=module.fp8_state)
        y = _global(y, weight.device_mesh, Partial(), (*x.shape[:-1], module.out_features))
        y = y.redistribute(placements=self.output_layouts)
        return y if module.bias is None else y + module.bias


# ----------------------------------------------------------------------------------------------
# sequence parallelism: the FP8 all-gather of a sequence-sharded input
# ----------------------------------------------------------------------------------------------
class _Gathered(NamedTuple):
    """The whole activation's FP8 cast, gathered: what a consumer's GEMMs read."""

    data: torch.Tensor  # [M, K], rows as the consumer flattens the activation
    data_t: torch.Tensor  # [K, M]
    amax: torch.Tensor
    scale: torch.Tensor
    recipe: CurrentScaling

    def linear(self, x_local, weight, bias, module: FP8Linear) -> torch.Tensor:
        if module.recipe != self.recipe:
            raise ValueError(f"this input was gathered in FP8 by PrepareFP8ModuleInput with "
                             f"{self.recipe}, but the FP8Linear reading it has {module.recipe}: "
                             f"give PrepareFP8ModuleInput the layer whose recipe to use "
                             f"(fp8_module=...) or one recipe to the module's layers")
        state = module.fp8_state
        state.follow_stream(x_local.device)
        x2 = x_local.reshape(-1, x_local.shape[-1])
        y = quantizer_for(self.recipe).linear(x2, weight, bias, state, output_dtype(x_local),
                                              (self.data, self.data_t, self.amax, self.scale))
        return y.reshape(*x_local.shape[:-1], weight.shape[0])


def _all_gather_bytes(q: torch.Tensor, dim: int, mesh) -> torch.Tensor:
    """The FP8 shards of all ranks, concatenated along dim in rank order (as uint8 on the wire:
    collectives do not all take float8 types)."""
    world = mesh.size()
    out = torch.empty((world * q.shape[0], *q.shape[1:]), dtype=torch.uint8, device=q.device)
    dist.all_gather_single(out, q.view(torch.uint8), group=mesh.get_group())
    if dim != 0:
        out = torch.cat(out.chunk(world, 0), dim)
    return out.view(q.dtype)


class _FP8AllGather(torch.autograd.Function):
    """Shard(d) DTensor -> Replicate DTensor of the dequantized FP8 cast of the whole tensor,
    carrying the gathered cast for the FP8 layers that read it. Backward: the gradient (partial
    sums from colwise layers) is reduce-scattered back to Shard(d), as torch's all-gather's is."""

    @staticmethod
    def forward(ctx, x: DTensor, recipe: CurrentScaling):
        mesh, placements = x.device_mesh, x.placements
        dim = placements[0].dim % x.dim()
        if x.shape[dim] % mesh.size():
            raise ValueError(f"PrepareFP8ModuleInput: dimension {dim} of the input "
                             f"({x.shape[dim]}) does not split evenly over {mesh.size()} ranks, "
                             f"which the FP8 all-gather needs")
        local = x.to_local().contiguous()
        fmt = get_format(recipe.fwd_fmt)
        amax = shard_amax(_ops.amax(local), mesh, recipe)  # the whole activation's
        scale = current_scale(amax, fmt, recipe.margin, recipe.power_of_two)
        data = _all_gather_bytes(_ops.quantize(local, scale, fmt.dtype, False)[0], dim, mesh)
        # what any other reader of the input sees: the FP8 values, in the input's dtype
        values = _ops.dequantize(data, torch.reciprocal(scale), local.dtype)
        out = DTensor.from_local(values, mesh, (Replicate(),), run_check=False)
        rows = data.reshape(-1, data.shape[-1])
        setattr(out, _GATHERED, _Gathered(rows, _ops.transpose_fp8(rows), amax, scale, recipe))
        ctx.placements = placements
        return out

    @staticmethod
    def backward(ctx, grad: DTensor):
        return grad.redistribute(placements=ctx.placements), None


def _input_recipe(module: nn.Module, fqn: Optional[str]):
    """The recipe whose current scaling casts the module's input for the FP8 all-gather, or
    None: the all-gather stays in high precision (other recipes; see the module doc)."""
    if fqn is not None:
        layers = [module.get_submodule(fqn)]
        if not isinstance(layers[0], FP8Linear):
            raise TypeError(f"PrepareFP8ModuleInput: fp8_module={fqn!r} is a "
                            f"{type(layers[0]).__name__}, not an FP8Linear")
    else:
        layers = [m for m in module.modules() if isinstance(m, FP8Linear)]
    recipes = {layer.recipe for layer in layers}
    if not recipes:
        raise ValueError(f"PrepareFP8ModuleInput: {type(module).__name__} holds no FP8Linear; "
                         f"use torch's PrepareModuleInput")
    if len(recipes) > 1:
        raise ValueError(f"PrepareFP8ModuleInput: the FP8Linear layers of "
                         f"{type(module).__name__} have different recipes ({recipes}); name the "
                         f"layer whose recipe casts the input: fp8_module='...'")
    (recipe,) = recipes
    if quantizer_for(recipe).scales_from_max:
        return recipe
    return None


class PrepareFP8ModuleInput(PrepareModuleInput):
    """torch's PrepareModuleInput (same arguments) for a module whose FP8Linear layers read a
    sequence-sharded input: an input going from Shard(d) to Replicate is gathered in FP8 when
    those layers use CurrentScaling (each rank casts its shard with the scale of the whole
    input, the FP8 bytes are all-gathered once, and every FP8ColwiseParallel layer reading the
    input uses that cast, bit for bit the one a single process makes). Other readers see the
    FP8 values in the input's dtype. With other recipes the all-gather is in high precision.
    fp8_module: the FP8Linear (name within the module) whose recipe casts the input; by
    default the module's FP8Linear layers must share one recipe."""

    def __init__(self, *, input_layouts=None, desired_input_layouts=None,
                 input_kwarg_layouts=None, desired_input_kwarg_layouts=None,
                 use_local_output: bool = False, fp8_module: Optional[str] = None):
        super().__init__(input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
                         input_kwarg_layouts=input_kwarg_layouts,
                         desired_input_kwarg_layouts=desired_input_kwarg_layouts,
                         use_local_output=use_local_output)
        self.fp8_module = fp8_module
        self.recipe = None  # found by _apply

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        _check_mesh(device_mesh, type(self).__name__)
        self.recipe = _input_recipe(module, self.fp8_module)
        return super()._apply(module, device_mesh)

    def _prepare_input_arg(self, input, mesh, input_layout, desired_layout):
        if (self.recipe is None or not isinstance(input_layout, Shard)
                or not isinstance(desired_layout, Replicate)
                or not isinstance(input, torch.Tensor)):
            return super()._prepare_input_arg(input, mesh, input_layout, desired_layout)
        if not isinstance(input, DTensor):
            input = DTensor.from_local(input, mesh, (input_layout,), run_check=False)
        if not isinstance(input.placements[0], Shard):
            return super()._prepare_input_arg(input, mesh, input_layout, desired_layout)
        out = _FP8AllGather.apply(input, self.recipe)
        if not self.use_local_output:
            return out
        local = out.to_local()
        setattr(local, _GATHERED, getattr(out, _GATHERED))
        return local
