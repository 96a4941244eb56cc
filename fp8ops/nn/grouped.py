"""The FP8 grouped linear layer of mixture-of-experts models: fp8ops.grouped_linear and
FP8GroupedLinear.

Tokens come sorted by expert: x [M, in], expert g's rows offsets[g-1]:offsets[g] (int32, the
cumulative end row of each group, as torch._grouped_mm takes them), weight [E, out, in]. Three
grouped FP8 GEMMs, as fp8ops.linear's three dense ones, group by group:
  forward  Y_g  = X_g W_g^T     grouped_gemm(X, W)
  dgrad    dX_g = dY_g W_g      grouped_gemm(dY, W^T)     (the weight's transposed copy)
  wgrad    dW_g = dY_g^T X_g    grouped_gemm_wgrad(dY^T, X^T)
Current scaling scales each group of X and dY by its own amax and each expert's weight by its
own: a scale per group is what a loop of fp8ops.linear over the experts uses, so the layer gives
that loop's bytes.

The weight cache: given a WeightCache (FP8GroupedLinear holds one, as do converted transformers
experts modules, one per 3-D parameter), all experts of a weight are cast in one go and that cast
is reused under WeightCache's rule, the dense layers' (scaling/weight_cache.py): only while a
live optimizer holds the weight, its generation has not moved (an optimizer step) and the
weight's gradient is still the one this cast's backward accumulated; so once per optimizer step
across the micro-batches of an accumulation window, and every forward without an optimizer.
Without a cache, under torch.compile and during CUDA graph capture the weight is cast every call.

Delayed scaling: each expert has the dense layer's delayed-scaling state for its X rows, its
weight and its dY rows (ExpertScalingState, buffers with a leading expert dimension), and goes
through the dense delayed path (quantizers.DelayedQuantizer) on its own rows: the same steps,
warm start, casts and amax records (0 for an expert with no tokens), the weight role stepping
once per accumulation window as the cache decides. So expert g's bytes and state are those of
a dense FP8Linear run on its rows alone. The offsets stay on the device; torch.compile takes it
with no graph break. Under torch.distributed (data parallel, FSDP2) the experts' amaxes are
recorded on each rank and folded across the ranks by the dense layers' one MAX all-reduce at the
end of the backward pass (scaling/amax_reduction.py), and a warm start casts with each
expert's amax over all ranks: every rank's state stays identical, and is the state of one process
that ran every rank's tokens (an expert given no tokens on one rank takes the others' amaxes).
Under FSDP2 (fully_shard) FP8GroupedLinear's weight, and a converted transformers experts
module's 3-D parameters, are gathered in FP8 (distributed/fsdp/): each rank casts its whole
experts, the gathered bytes and scales come as the weight, and the grouped GEMMs take them as
they are (current, delayed and blockwise scaling; delayed scaling steps and records as the
unsharded layer does, each rank casting its experts with their slice of the role's scales).
When a CPUOffloadOptimizer owns the weight, the parameter is a placeholder and the cache casts
the host master's values (optim/host_weight.py), once per optimizer step, as for a dense layer.
An input cast made before the call (input_cast, a grouped_quantizers.RowsCast: the bytes and
scales of X's forward cast, which expert parallelism makes on the rank that routes the tokens
and sends) is used as it is: the forward GEMM reads those bytes, not a second cast.
Not here yet: MXFP8 and stochastic rounding.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ..scaling import WeightCache
from ..scaling.expert_state import ExpertScalingState
from ..scaling.weight_cache import BACKWARD, GRADIENT, KEY
from . import caches
from .autograd import (first_order_only, in_recompute, is_gathered, output_dtype, steps_state,
                       weight_grad)
from .functional import check_operands
from .grouped_quantizers import RowsCast, grouped_quantizer_for
from .quantizers import quantizer_type
from .sharding import SHARDED_WEIGHT_HOOKS, is_dtensor

_ops = torch.ops.fp8ops
_F32 = torch.float32


def _bias_grad(dy: torch.Tensor, offsets: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Each expert's bias gradient: the sum of its rows of dY, in float32, in bias's dtype.
    (Summed by index_add, so it agrees with the dense column sums to float32 rounding.)"""
    rows = torch.arange(dy.shape[0], dtype=offsets.dtype, device=dy.device)
    expert = torch.searchsorted(offsets, rows, right=True)  # E for rows past the last group
    sums = dy.new_zeros((offsets.shape[0] + 1, dy.shape[1]), dtype=_F32)
    return sums.index_add_(0, expert, dy.to(_F32))[:-1].to(bias.dtype)


def _cast_experts(weight: torch.Tensor, quantizer, cache: Optional[WeightCache],
                  state: Optional[ExpertScalingState] = None, host=None) -> tuple:
    """The FP8 copies of all experts' weights, as the recipe's Function takes them: from the
    cache when its rule allows (module doc), else cast now (and kept in the cache). state: the
    delayed-scaling state (DelayedScaling only), whose weight role a live forward steps when it
    casts anew, once per accumulation window (the cache decides, as for the dense layer).
    host: the host master of an offloaded weight (the cache's own when there is a cache)."""
    cast, recipe = quantizer.cast_experts(state), quantizer.recipe
    live = state is not None and steps_state(state)
    host = host if cache is None else cache.host
    if host is not None:  # offloaded (CPUOffloadOptimizer): weight is a placeholder
        cast = _from_host(cast, host)
    with torch.no_grad():
        if is_gathered(weight):  # FSDP2 gathered the experts in FP8 (distributed/fsdp/)
            return weight.expert_payload(cache, live)
        if (cache is None or torch.compiler.is_compiling()
                or (weight.is_cuda and torch.cuda.is_current_stream_capturing())):
            return cast(weight, live, None)[0][1]
        # a delayed recompute (activation checkpointing) reuses its forward's cast on the key
        trust = KEY if state is not None and in_recompute() else GRADIENT
        source = cache.source_tensor()
        if host is not None:
            # as a dense layer's: the values change with the generation, or with a write to the
            # master in place (a state_dict tensor edited), which its version shows
            trust, source = max(trust, BACKWARD), host.master
        elif source is not None and source is not weight:
            # FSDP2's full weight gathered in high precision: its values change with the sharded
            # parameter (the key's source), and a backward since the cast vouches for it, as for
            # a dense layer (ScalingState.cached_weight)
            trust = max(trust, BACKWARD)
        else:
            source = None
        made, tensors = cache.get(weight, cast, live=live, trust=trust, source=source)
        if made != recipe:  # the layer's recipe changed since that cast
            cache.invalidate()
            made, tensors = cache.get(weight, cast, live=live, trust=trust, source=source)
        return tensors


def _from_host(cast, host):
    """cast, applied to the host master's values (optim/host_weight.py) in the layout of the
    placeholder it is given."""
    def from_host(w, step, scale):
        return cast(host.values_for(w), step, scale)
    return from_host


def _vouch_grad(cache: Optional[WeightCache], dw) -> None:
    """dw comes from the cached cast: its accumulation into .grad vouches for that cast (eager
    only: a compiled call casts every time)."""
    if cache is not None and dw is not None and not torch.compiler.is_compiling():
        cache.expect_grad()


class GroupedLinearFunction(torch.autograd.Function):
    """The grouped GEMMs through `quantizer` (grouped_quantizers.py). x carries the gradient;
    its cast (x_cast) and the experts' (w_cast) are made before (_grouped), where a
    delayed-scaling state may change (outside the Function under torch.compile too), dY's in
    backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, offsets, quantizer, out_dtype, w_cast, cache, x_cast,
                state):
        y = quantizer.grouped_forward(x_cast, w_cast, offsets, bias, out_dtype)
        ctx.save_for_backward(*quantizer.grouped_saved(x_cast, w_cast), offsets, weight, bias)
        ctx.quantizer, ctx.state, ctx.cache, ctx.x_dtype = quantizer, state, cache, x.dtype
        ctx.grad_warm = state is not None and state.warm["grad"]
        return y

    @staticmethod
    @first_order_only
    def backward(ctx, dy):
        # (unpacked once: activation checkpointing allows no second unpack)
        *saved, offsets, weight, bias = ctx.saved_tensors
        quantizer = ctx.quantizer
        dy = dy.contiguous()
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        g = quantizer.cast_grad_rows(dy, offsets, ctx.state, ctx.grad_warm, need_dw)
        dx = dw = db = None
        if need_dx:
            dx = quantizer.grouped_dgrad(g, saved, offsets, ctx.x_dtype)
        if need_dw:
            dw = weight_grad(weight, lambda dtype: quantizer.grouped_wgrad(g, saved, offsets,
                                                                           dtype))
            _vouch_grad(ctx.cache, dw)
        if need_db and bias is not None:
            db = _bias_grad(dy, offsets, bias)
        return dx, dw, db, None, None, None, None, None, None, None


def _grouped(x, weight, bias, offsets, quantizer, out_dtype, cache, state, host,
             input_cast=None):
    """The experts' cast, then X's (stepping and recording a delayed-scaling state when live;
    input_cast's bytes when given), the gradient's warm start decided here (delayed scaling) so
    that a recompute sees the same, as the dense layer (Quantizer.linear)."""
    live = state is not None and steps_state(state)
    w_cast = _cast_experts(weight, quantizer, cache, state, host)
    if input_cast is None:
        x_cast = quantizer.cast_rows(x, offsets, state, live)
    else:
        x_cast = quantizer.rows_from_cast(x, offsets, input_cast)
    if live:
        state.warm["grad"] = not state.grad.started
    y = GroupedLinearFunction.apply(x, weight, bias, offsets, quantizer, out_dtype, w_cast,
                                    cache, x_cast, state)
    if live:
        state.input.started = True
        state.grad.started = state.grad.started or torch.is_grad_enabled()
    return y


def _check(x, weight, offsets, bias) -> None:
    check_operands(x, weight)
    if weight.dim() != 3:
        raise ValueError(f"weight must be 3-D [experts, out_features, in_features], got shape "
                         f"{tuple(weight.shape)}")
    if x.dim() != 2 or x.shape[1] != weight.shape[2]:
        raise ValueError(f"input must be 2-D [tokens, in_features={weight.shape[2]}] sorted by "
                         f"expert, got shape {tuple(x.shape)}")
    if not isinstance(offsets, torch.Tensor) or offsets.dtype != torch.int32 \
            or offsets.shape != (weight.shape[0],):
        raise ValueError(f"offsets must be an int32 tensor of shape ({weight.shape[0]},) (each "
                         f"expert's cumulative end row), got "
                         f"{getattr(offsets, 'dtype', type(offsets).__name__)} "
                         f"{tuple(getattr(offsets, 'shape', ()))}")
    for name, t in (("weight", weight), ("offsets", offsets), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but input is on {x.device}")
    if bias is not None and bias.shape != weight.shape[:2]:
        raise ValueError(f"bias must have shape {tuple(weight.shape[:2])} [experts, "
                         f"out_features], got {tuple(bias.shape)}")


def _check_input_cast(cast, x, offsets, quantizer) -> None:
    if not isinstance(cast, RowsCast):
        raise TypeError(f"input_cast must be an fp8ops.nn.grouped_quantizers.RowsCast, got "
                        f"{type(cast).__name__}")
    if cast.data.shape != x.shape or cast.data.dtype != quantizer.fwd.dtype:
        raise ValueError(f"input_cast.data must be {quantizer.fwd.dtype} of the input's shape "
                         f"{tuple(x.shape)}, got {cast.data.dtype} {tuple(cast.data.shape)}")
    block = quantizer.scale_block
    rows = (offsets.shape[0],) if block is None else (x.shape[0], -(-x.shape[1] // block))
    if tuple(cast.scale_inv.shape) != rows:
        raise ValueError(f"input_cast.scale_inv must have shape {rows} for "
                         f"{type(quantizer.recipe).__name__}, got {tuple(cast.scale_inv.shape)}")


def _check_state(state, recipe, weight: torch.Tensor, weight_cache) -> None:
    if not isinstance(state, ExpertScalingState):
        raise TypeError(f"state must be an fp8ops.nn.grouped.ExpertScalingState, got "
                        f"{type(state).__name__}")
    if recipe is not None and recipe != state.recipe:
        raise ValueError(f"recipe {recipe} differs from the state's recipe {state.recipe}")
    if state.num_experts != weight.shape[0]:
        raise ValueError(f"the state holds {state.num_experts} experts but the weight has "
                         f"{weight.shape[0]}")
    if weight_cache is not None and weight_cache is not state.weight_cache:
        raise ValueError("with a state, the weight cache is the state's (state.weight_cache): "
                         "pass weight_cache=None or that one")


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                   bias: Optional[torch.Tensor] = None, *, recipe=None,
                   weight_cache: Optional[WeightCache] = None,
                   state: Optional[ExpertScalingState] = None,
                   input_cast: Optional[RowsCast] = None) -> torch.Tensor:
    """y_g = x_g @ weight[g].T (+ bias[g]) for each expert g, with FP8 GEMMs in forward and
    backward. x [M, in] sorted by expert, weight [E, out, in], offsets int32 [E] (expert g's
    rows end at offsets[g]; rows past offsets[-1] give zero rows), bias [E, out] or None.
    Returns [M, out] in x's dtype (under torch.autocast, the autocast dtype); the gradients come
    in x's and the weight's dtypes. recipe: None (current scaling, a scale per expert) or
    fp8ops.CurrentScaling / fp8ops.DelayedScaling / fp8ops.BlockwiseScaling. weight_cache: a
    WeightCache (one per weight) that keeps the experts' FP8 cast between calls under the dense
    layers' reuse rule (module doc); None: cast every call. DelayedScaling needs `state`
    (ExpertScalingState(recipe, E)), which holds each expert's amax histories and its own weight
    cache (used here; recipe may then be left out). input_cast: x's forward cast made before
    (grouped_quantizers.RowsCast: the bytes and scales this call would make, e.g. sent by
    expert parallelism), used as it is instead of casting x; x then carries the gradient and,
    for BlockwiseScaling, the values wgrad's transposed copy is cast from (CurrentScaling and
    BlockwiseScaling only)."""
    _check(x, weight, offsets, bias)
    if state is not None:
        _check_state(state, recipe, weight, weight_cache)
        recipe, weight_cache = state.recipe, state.weight_cache
    quantizer = grouped_quantizer_for(recipe)  # (refuses a recipe the layer does not take)
    if state is None and quantizer.delayed:
        raise ValueError("DelayedScaling keeps an amax history per expert: pass "
                         "state=ExpertScalingState(recipe, num_experts) (FP8GroupedLinear does "
                         "this for you)")
    if input_cast is not None:
        _check_input_cast(input_cast, x, offsets, quantizer)
    host = None if weight_cache is None else weight_cache.host
    if weight_cache is not None and torch.compiler.is_compiling():
        weight_cache = None  # (a compiled call casts every time, from the host master if any)
    out_dtype = output_dtype(x)
    device = x.device.type
    if device not in ("cuda", "cpu") or not torch.is_autocast_enabled(device):
        return _grouped(x, weight, bias, offsets, quantizer, out_dtype, weight_cache, state,
                        host, input_cast)
    # the output's dtype is decided; nothing inside is autocast's to retype (it would refuse to
    # stack FP8 tensors), also when x already comes in autocast's dtype
    with torch.autocast(device, enabled=False):
        return _grouped(x, weight, bias, offsets, quantizer, out_dtype, weight_cache, state,
                        host, input_cast)


class FP8GroupedLinear(nn.Module):
    """E linear layers of the same shape (the experts of a mixture-of-experts layer) applied to
    tokens sorted by expert, with FP8 GEMMs: forward(x [M, in], offsets int32 [E]) -> [M, out].
    weight [E, out, in] (and bias [E, out] when bias=True), each expert initialized as
    nn.Linear initializes its weight. `weight_cache` (a WeightCache) keeps the experts' FP8 cast
    between calls: one cast per optimizer step for all experts (module doc); call
    `weight_cache.invalidate()` after changing the weight where an optimizer that holds it
    cannot see it (a `p.data` update between its steps). With DelayedScaling each expert's
    amax histories and scales are buffers of `fp8_state` (an ExpertScalingState, in the
    state_dict); eval mode casts with them as trained and records nothing. Under FSDP2 the
    weight is gathered in FP8 (module doc); set `fp8_all_gather = False` before fully_shard to
    gather it in high precision."""

    # under FSDP2, gather the experts in FP8 where the recipe allows (distributed/fsdp/)
    fp8_all_gather = True

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool = False,
                 recipe=None, *, device=None, dtype=None):
        super().__init__()
        self.num_experts, self.in_features = num_experts, in_features
        self.out_features = out_features
        quantizer = grouped_quantizer_for(recipe)  # (refuses a recipe the layer does not take)
        self.recipe = quantizer.recipe
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features, **factory))
        self.bias = (nn.Parameter(torch.empty(num_experts, out_features, **factory)) if bias
                     else None)
        self.weight_cache = WeightCache()
        if quantizer.delayed:
            self.fp8_state = ExpertScalingState(self.recipe, num_experts, device,
                                                self.weight_cache)
        self.reset_parameters()
        caches.track(self)

    def __setstate__(self, state):  # copy.deepcopy and pickle do not call __init__
        super().__setstate__(state)
        caches.track(self)

    def __setattr__(self, name, value):
        # FSDP2 sets its sharded parameter through setattr when a module defines it: there
        # fp8ops.distributed's hook has FSDP2 gather the experts in FP8 (sharding.py)
        if name == "weight" and is_dtensor(value):
            for hook in SHARDED_WEIGHT_HOOKS:
                hook(self, value)
        super().__setattr__(name, value)

    def _apply(self, fn, recurse=True):
        # Module._apply may swap the weight for a new tensor (torch.utils.swap_tensors), which
        # refuses a tensor with weak references: the cache drops its own meanwhile
        cache = self.__dict__.get("weight_cache")
        if cache is None:
            return super()._apply(fn, recurse)
        with cache.unreferenced(self._parameters.get("weight")):
            return super()._apply(fn, recurse)

    def reset_parameters(self) -> None:
        for g in range(self.num_experts):  # each expert as nn.Linear would be
            nn.init.kaiming_uniform_(self.weight[g], a=math.sqrt(5))
        if "weight_cache" in self.__dict__:
            self.weight_cache.invalidate()
        if "fp8_state" in self._modules:
            self.fp8_state.reset()
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return grouped_linear(x, self.weight, offsets, self.bias, recipe=self.recipe,
                              weight_cache=self.__dict__.get("weight_cache"),
                              state=self._delayed_state())

    def _delayed_state(self) -> Optional[ExpertScalingState]:
        """The delayed-scaling state of the layer's recipe (a fresh one after the recipe
        changed), recording in training mode only; None for the other recipes."""
        if not quantizer_type(self.recipe)[0].delayed:  # (a class attribute: nothing made)
            return None
        state = self._modules.get("fp8_state")
        if state is None or state.recipe != self.recipe:
            state = self.fp8_state = ExpertScalingState(self.recipe, self.num_experts,
                                                        self.weight.device, self.weight_cache)
        state.set_recording(self.training)
        return state

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"recipe={type(self.recipe).__name__}")
