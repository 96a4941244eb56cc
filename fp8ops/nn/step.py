"""The layer step as two C++ calls: where an FP8Linear call may take it, decided once.

csrc/step/ (fp8ops._step) defines the forward ops `fp8ops_step.linear_current`,
`linear_delayed`, `linear_blockwise` and `linear_mx`: one dispatcher call each for the forward
(the weight cast when the cache has none to reuse, the input cast, the forward GEMM), whose
autograd node, in C++, is the backward (the output gradient's cast with the bias gradient in the
same op, dgrad and wgrad). They call the ops the Python path's Functions (autograd.py) call, in
the same order with the same arguments, so both paths give the same bytes (tests/test_step.py).
The layer's WeightCache decides, as on the Python path, whether the cached weight cast serves the
call (lookup) and keeps a new one (store); the C++ backward vouches for it through the cache's
grad_word, and reads whether a delayed-scaling layer records through its state's
recording_word.

Which calls take it: current and delayed per-tensor scaling with round-to-nearest casts, blockwise
and MXFP8 scaling, on a plain local weight, in eager mode, activation-checkpoint recomputes,
CUDA-graph capture (there every call casts the weight, as on the Python path) and FSDP2's weights
gathered in high precision (the cache keys them on their sharded parameter, as the Python path does)
included. The Python path keeps stochastic rounding, a percentile amax, tensor-parallel shards,
FSDP2's weights gathered in FP8, a host-offloaded weight, a weight with a main_grad, a sampled
monitor step, torch.compile, and under delayed scaling torch.distributed and forwards without grad.
A call the layer's fallback sends to nn.Linear's GEMMs goes there directly. The decision depends on
the kind of call (input and weight dtypes and devices, grad and inference mode, training, autocast,
and the token count where a fallback rule reads it): FP8Linear.forward makes it once per kind
(plan_for) and keeps it; what can change between calls of one kind (the recipe, the state, a
monitor, the weight's type) it compares on every call without entering a Python function.
"""
from __future__ import annotations

import operator
import os
from typing import Optional

import torch

from ..scaling.world import WORLD, initialized as _distributed
from ..scaling import grad_margin
from ..scaling.role import BUFFERS
from ..scaling.weight_cache import BACKWARD, GRADIENT, KEY
from .fallback import crossover
from .functional import linear
from .quantizers import quantizer_for

_state = {"loaded": None}


def available() -> bool:
    """Whether fp8ops._step is built and loaded (and not disabled by FP8OPS_DISABLE_STEP=1)."""
    if _state["loaded"] is None:
        if os.environ.get("FP8OPS_DISABLE_STEP", "0") not in ("", "0", "false", "False"):
            _state["loaded"] = False
        else:
            try:
                from .. import _step  # noqa: F401  (registers torch.ops.fp8ops_step)
                _state["loaded"] = True
            except ImportError:
                _state["loaded"] = False
    return _state["loaded"]


PLAIN = (torch.Tensor, torch.nn.Parameter)  # a weight's type that may take the C++ step
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


# The paths a call can take: the C++ step, the Python path (autograd.py), or nn.Linear's
# high-precision GEMMs (the layer's fallback rule sends the call there)
CPP, PYTHON, HIGH = "cpp", "python", "high precision"
MAX_PLANS = 64  # kinds of call a layer keeps a plan for (the token count is part of the kind)


class Plan:
    """How calls of one kind run: `path`, and for the C++ step its fixed arguments. `recipe`,
    `state` and `fallback` are those it was decided for."""

    __slots__ = ("recipe", "state", "fallback", "path", "args", "run")

    def __init__(self, recipe, state, fallback, path: str, args=(), run=None):
        self.recipe, self.state, self.fallback, self.path = recipe, state, fallback, path
        self.args = args
        # run(plan, state, input, weight, bias, out_dtype): one call of the C++ step
        self.run = run


def plan_for(layer, state, input: torch.Tensor, weight: torch.Tensor, key) -> Plan:
    """Decide how calls of this kind run (FP8Linear.forward keeps the answer under `key`, whose
    last item is the call's token count where a fallback rule reads it)."""
    recipe = state.recipe
    if input.device == weight.device and input.dim() >= 1:
        rule = crossover(layer.fallback, input.device, recipe)
        if rule is not None and not rule.runs_fp8(key[-1], layer.in_features,
                                                  layer.out_features):
            return Plan(recipe, state, layer.fallback, HIGH)
    bias = layer._parameters.get("bias")
    quantizer = quantizer_for(recipe)
    current = quantizer.scales_from_max  # (current scaling without a percentile)
    blockwise, mx = quantizer.kind == "blockwise", quantizer.kind == "mxfp8"
    # delayed scaling: grad mode on (a live forward under no_grad, as reentrant checkpointing
    # runs one, leaves the grad role to its backward: the Python path's business)
    delayed = quantizer.delayed and key[4]
    cpp = (available() and (blockwise or mx or ((current or delayed)
                                          and not quantizer.stochastic))
           and not layer.weight_transposed
           and input.dtype in _FLOATS and weight.dtype in _FLOATS
           and input.device == weight.device and input.device.type in ("cpu", "cuda")
           and weight.dim() == 2 and input.dim() >= 1
           and input.shape[-1] == weight.shape[1] and weight.shape[1] > 0
           and (bias is None or (bias.shape == (weight.shape[0],) and bias.dtype in _FLOATS
                                 and bias.device == weight.device)))
    if not cpp:
        return Plan(recipe, state, layer.fallback, PYTHON)
    fwd, bwd = quantizer.fwd, quantizer.bwd
    if blockwise:
        return Plan(recipe, state, layer.fallback, CPP, (
            torch.ops.fp8ops_step.linear_blockwise, False, fwd.dtype, bwd.dtype,
            recipe.power_of_two), run_block)
    if mx:
        return Plan(recipe, state, layer.fallback, CPP, (
            torch.ops.fp8ops_step.linear_mx, True, fwd.dtype, bwd.dtype, recipe.block_size,
            recipe.scale_mode == "rceil"), run_block)
    args = (fwd.dtype, bwd.dtype, recipe.margin, grad_margin(recipe), recipe.power_of_two)
    if delayed:
        args += (recipe.interval, recipe.amax_compute_algo, recipe.ema_alpha, recipe.percentile)
    return Plan(recipe, state, layer.fallback, CPP, args, run_delayed if delayed else run_current)


def run_current(plan: Plan, state, input: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """One call of the C++ step, the weight's cast reused when the layer's WeightCache says it
    may be (else the op casts it, and the cache keeps that cast), as the Python path's
    ScalingState.cached_weight does."""
    cache = state.weight_cache
    payload = scale = None
    capturing = False
    if input.is_cuda:
        state.follow_stream(input.device)
        # under CUDA-graph capture every call casts: nothing on the host may decide what a
        # replay reads
        capturing = torch._C._cuda_isCurrentStreamCapturing()
    if not capturing:
        recompute = torch._C._current_graph_task_id() != -1  # activation checkpointing's
        source = cache.source  # FSDP2's sharded parameter, when the weight is its gathered copy
        if source is not None:
            source = source()
        payload, scale = cache.lookup(weight, live=False, trust=KEY if recompute else GRADIENT
                                      if source is None else BACKWARD, source=source)
    x2 = input.reshape(-1, weight.shape[1])
    # the C++ backward sets the cache's grad_word when it computed the weight's gradient from
    # this cast (WeightCache.expect_grad's part on the Python path)
    if payload is None:
        y, cast = torch.ops.fp8ops_step.linear_current(
            x2, weight, bias, None, None, None, scale, cache.grad_word, *plan.args, out_dtype)
        if not capturing:  # (the cast's scale: the one given, or the one it took)
            cache.store(weight, tuple(cast), cast[3], stepped=False)
    else:
        y, _ = torch.ops.fp8ops_step.linear_current(
            x2, weight, bias, payload[0], payload[1], payload[2], None, cache.grad_word,
            *plan.args, out_dtype)
    if input.dim() == 2:
        return y
    return torch.ops.aten._unsafe_view(y, (*input.shape[:-1], weight.shape[0]))


# a role's seven buffers from its _buffers dict, as a tuple (a C call, no Python frame)
_buffers = operator.itemgetter(*BUFFERS)


def run_delayed(plan: Plan, state, input: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """run_current() under DelayedScaling: the roles' flags decided here as linear_per_tensor
    (autograd.py) decides them, their buffers stepped by the op. Under torch.distributed the
    Python path runs the call (its amax all-reduces). So does an activation checkpoint's
    recompute while the grad role has recorded nothing: its forward ran under no_grad (reentrant
    checkpointing, on the Python path), and only the Python backward marks the role started. A
    forward that took this path has marked it, so its recompute takes this path too (a
    non-reentrant checkpoint compares the tensors the two save)."""
    input_role, weight_role, grad_role = state.delayed_roles
    recompute = torch._C._current_graph_task_id() != -1
    if (recompute and not grad_role.started) or (
            WORLD._default_pg is not None if WORLD is not None else _distributed()):
        return linear(input, weight, bias, state=state)
    cache = state.weight_cache
    live = state.recording and not recompute
    capturing = False
    if input.is_cuda:
        state.follow_stream(input.device)
        capturing = torch._C._cuda_isCurrentStreamCapturing()
    payload = scale = None
    if not capturing:
        payload, scale = cache.lookup(weight, live=live, trust=KEY if recompute else GRADIENT)
    warm = state.warm
    if live:  # (decided before the call: the op steps the roles; a recompute replays them)
        warm["input"] = not input_role.started
        warm["grad"] = not grad_role.started
    input_warm = warm["input"] if live or recompute else not input_role.started
    cast = payload is None
    x2 = input.reshape(-1, weight.shape[1])
    fwd, bwd, margin, gmargin, pow2, interval, algo, ema_alpha, percentile = plan.args
    y, new = torch.ops.fp8ops_step.linear_delayed(
        x2, weight, bias, *((None, None, None) if cast else payload[:3]), scale,
        _buffers(input_role._buffers), _buffers(weight_role._buffers),
        _buffers(grad_role._buffers), cache.grad_word,
        state.recording_word, fwd, bwd, margin, gmargin, pow2, interval, algo, ema_alpha,
        percentile, live, not weight_role.started, input_warm, warm["grad"], out_dtype)
    if cast:
        stepped = live and scale is None
        if stepped and not weight_role.started:
            weight_role.started = True
        if not capturing:
            cache.store(weight, tuple(new), new[3], stepped=stepped)
    if live:  # the grad role records in backward; its first backward took a warm scale
        if not input_role.started:
            input_role.started = True
        if not grad_role.started:
            grad_role.started = True
    if input.dim() == 2:
        return y
    return torch.ops.aten._unsafe_view(y, (*input.shape[:-1], weight.shape[0]))


def run_block(plan: Plan, state, input: torch.Tensor, weight: torch.Tensor,
              bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """run_current() for the block recipes (plan.args[0] is the op): the weight cast reused or
    made by the op, in the layout the Python path's cache keeps (linear_blockwise: (data,
    scale_inv, data^T); linear_mx: ((row data, row scales), (column data^T, column scales^T))).
    MXFP8's y is a slice of the GEMM's padded result: returned as a tensor of its own, as
    fp8ops.linear does."""
    cache = state.weight_cache
    payload = None
    capturing = False
    if input.is_cuda:
        state.follow_stream(input.device)
        capturing = torch._C._cuda_isCurrentStreamCapturing()
    if not capturing:
        recompute = torch._C._current_graph_task_id() != -1
        source = cache.source  # (as in run_current)
        if source is not None:
            source = source()
        payload, _ = cache.lookup(weight, live=False, trust=KEY if recompute else GRADIENT
                                  if source is None else BACKWARD, source=source)
    op, mx, args = plan.args[0], plan.args[1], plan.args[2:]
    x2 = input.reshape(-1, weight.shape[1])
    if payload is None:
        y, cast = op(x2, weight, bias, (), cache.grad_word, *args, out_dtype)
        if not capturing:
            cache.store(weight, ((cast[0], cast[1]), (cast[2], cast[3])) if mx else tuple(cast),
                        None, stepped=False)
    else:
        y, _ = op(x2, weight, bias, (*payload[0], *payload[1]) if mx else payload,
                  cache.grad_word, *args, out_dtype)
    if input.dim() == 2 and not mx:
        return y
    return torch.ops.aten._unsafe_view(y.contiguous(), (*input.shape[:-1], weight.shape[0]))
