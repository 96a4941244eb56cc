"""The fp8ops operators: schemas (defined here, in Python), fake implementations and dispatch.

The op layer's modules: emulation.py (every op in PyTorch, the bit-exact reference; philox.py
makes its random words, scratch.py keeps its reused buffers, cpu_kernels.py loads its C++ kernels
fp8ops._cpu), fused.py (the training step's one-call casts as the ops they fuse), backend.py
(which implementation runs where) and gemm_mx_cuda.py (the MX GEMM on GPUs without a kernel of
ours for it). The grouped ops of mixture-of-experts layers: grouped.py (schemas, fakes),
emulation_grouped.py (their emulation) and expert_casts.py (an experts' weight cast per expert).
block_sum.py: the sum of FP8 blocks at the receiving end of a reduction in FP8.

CPU kernels come from `emulation`. CUDA kernels come from the C++ extension `fp8ops._C`
(csrc/bindings/*.cpp, TORCH_LIBRARY_IMPL(fp8ops, CUDA, m)) when `backend.load_extension()`
loads it; otherwise the emulation serves CUDA tensors too. Call ops as torch.ops.fp8ops.<name>.
"""
from __future__ import annotations

import functools

import torch

from . import backend, block_sum, emulation, expert_casts, fused, grouped

_lib = torch.library.Library("fp8ops", "DEF")
_F32 = torch.float32

SCHEMAS = {
    "amax": "(Tensor x) -> Tensor",
    "amax_percentile": "(Tensor x, float percentile) -> Tensor",
    # rng: int64 [seed, offset] on x's device, read by the cast instead of seed and offset (a
    # CUDA graph replays the values it holds then, not those of the capture); via: x rounded to
    # this dtype first (amax included), as x.to(via) would (no copy is made)
    "quantize": "(Tensor x, Tensor scale, ScalarType dtype, bool transpose=False, "
                "bool stochastic=False, int seed=0, int offset=0, Tensor? rng=None, "
                "ScalarType? via=None) -> (Tensor, Tensor, Tensor)",
    "dequantize": "(Tensor data, Tensor scale_inv, ScalarType out_dtype) -> Tensor",
    # data^T, contiguous, of 2-D FP8 (or uint8) data: the dgrad copy of an already-cast weight
    "transpose_fp8": "(Tensor data) -> Tensor",
    "quantize_mx": "(Tensor x, ScalarType dtype, int block_size, int axis, bool rceil) "
                   "-> (Tensor, Tensor)",
    "dequantize_mx": "(Tensor data, Tensor scales, int block_size, int axis, "
                     "ScalarType out_dtype) -> Tensor",
    "quantize_blockwise": "(Tensor x, ScalarType dtype, int block_rows, int block_cols, "
                          "bool power_of_two) -> (Tensor, Tensor)",
    "dequantize_blockwise": "(Tensor data, Tensor scale_inv, int block_rows, int block_cols, "
                            "ScalarType out_dtype) -> Tensor",
    # fp8ops.monitor's statistics of one cast: (counts int64 [saturated, underflow, non-finite],
    # amax of x); scale_inv: one float32 multiplier (blocks 0 x 0), or float32 / E8M0 per block
    "cast_stats": "(Tensor x, Tensor data, Tensor scale_inv, int block_rows, int block_cols) "
                  "-> (Tensor, Tensor)",
    "delayed_scale_update": "(Tensor amax_history, Tensor scale, Tensor amax_rep, "
                            "Tensor pending_amax, Tensor step, float fp8_max, float margin, "
                            "int interval, str algo, float ema_alpha, float percentile, "
                            "bool power_of_two) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    "gemm": "(Tensor a, Tensor b, Tensor a_scale_inv, Tensor b_scale_inv, Tensor? bias, "
            "ScalarType out_dtype, bool fast_accum=False) -> Tensor",
    "gemm_blockwise": "(Tensor a, Tensor b, Tensor a_scale_inv, Tensor b_scale_inv, Tensor? bias, "
                      "ScalarType out_dtype) -> Tensor",
    "gemm_mx": "(Tensor a, Tensor a_scales, Tensor b, Tensor b_scales, Tensor? bias, "
               "ScalarType out_dtype, int block_size) -> Tensor",
    # one FP8AdamW step of one parameter, in place (adamw.py: the moments' layout and the
    # arithmetic); the float scalars are float32 values, as the optimizer rounds them
    "adamw_step": "(Tensor(a!) param, Tensor grad, Tensor(b!) m, Tensor(c!) m_scale_inv, "
                  "Tensor(d!) v, Tensor(e!) v_scale_inv, float beta1, float one_minus_beta1, "
                  "float beta2, float one_minus_beta2, float eps, float step_size, "
                  "float bias2_rsqrt, float decay, float l2, int seed, int offset) -> ()",
    # adamw_step on each parameter of a list in one call (one kernel launch on CUDA): the
    # parameters share one dtype and one v format; scalars: float32 [n, 9], a row of the nine
    # float scalars above per parameter; rng: int64 [n, 2], its (seed, offset). Either table on
    # the CPU (the usual case: the optimizer computes it there) or on the params' device.
    "adamw_step_multi": "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] m, "
                        "Tensor(c!)[] m_scale_inv, Tensor(d!)[] v, Tensor(e!)[] v_scale_inv, "
                        "Tensor scalars, Tensor rng) -> ()",
}

# The casts of the training step, one call each (fused.py gives their meaning in terms of
# the ops above). The per-tensor ones carry their scale math and amax bookkeeping and return
# (data, data_t, scale, scale_inv, column_sums): the scale the cast used and its reciprocal (new
# tensors); with rng (int64 [seed, offset]) a stochastic cast reads its random stream from it and
# advances its offset by one, on the device. Every one returns, when sum_dtype is given, the sums
# over the rows of x's 2-D view in float32 rounded to sum_dtype (a bias gradient; else an empty
# float32 tensor).
FUSED_SCHEMAS = {
    "quantize_current": "(Tensor x, ScalarType dtype, float margin, bool power_of_two, "
                        "bool transpose=False, ScalarType? sum_dtype=None, bool stochastic=False, "
                        "int seed=0, int offset=0, Tensor(r!)? rng=None) "
                        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    "quantize_delayed": "(Tensor x, Tensor(a!) amax_history, Tensor(b!) scale, "
                        "Tensor(c!) scale_inv, Tensor(d!) amax_rep, Tensor(e!) pending_amax, "
                        "Tensor(f!) step, Tensor(g!) nonfinite_count, ScalarType dtype, "
                        "float margin, int interval, str algo, float ema_alpha, float percentile, "
                        "bool power_of_two, bool update, bool warm, bool record, "
                        "bool transpose=False, ScalarType? sum_dtype=None, bool stochastic=False, "
                        "int seed=0, int offset=0, Tensor(r!)? rng=None) "
                        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    # the row-wise and column-wise block copies of a 2-D x and its column sums, in one call
    "quantize_blockwise_pair": "(Tensor x, ScalarType dtype, bool power_of_two, "
                               "ScalarType? sum_dtype=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    "quantize_mx_pair": "(Tensor x, ScalarType dtype, int block_size, bool rceil, "
                        "ScalarType? sum_dtype=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
}


def _emulated(name):
    """The emulation kernel of an op."""
    return _without_grad(getattr(emulation, name))


def _composite(name):
    """A fused op as the unfused ops it stands for (each with its own kernel, on any device)."""
    return _without_grad(getattr(fused, name))


# Dispatch keys through which torch.autocast would retype the kernels' own torch calls
AUTOCAST_KEYS = (torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
                 | torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCUDA))


def _without_grad(fn):
    """A Python kernel runs under no_grad: below the (fallthrough) Autograd key its torch calls
    must not record a graph on inputs that require grad. Nor does autocast reach them: the
    emulation's float32 arithmetic is its definition, and autocast would run its matmuls in
    bf16. (Set directly: the context managers cost more than some kernels on small tensors.)"""
    @functools.wraps(fn)
    def kernel(*args, **kwargs):
        prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            if torch._C._is_any_autocast_enabled():
                with torch._C._ExcludeDispatchKeyGuard(AUTOCAST_KEYS):
                    return fn(*args, **kwargs)
            return fn(*args, **kwargs)
        finally:
            torch._C._set_grad_enabled(prev)
    return kernel


for _name, _schema in SCHEMAS.items():
    _lib.define(_name + _schema)
    _lib.impl(_name, _emulated(_name), "CPU")
    # Quantization is not differentiable: outputs never carry grad_fn (fp8ops.linear's
    # autograd.Function supplies the gradients of the FP8 linear layer).
    _lib.impl(_name, torch.library.fallthrough_kernel, "Autograd")


for _name, _schema in FUSED_SCHEMAS.items():
    _lib.define(_name + _schema)
    _lib.impl(_name, _composite(_name), "CPU")
    _lib.impl(_name, torch.library.fallthrough_kernel, "Autograd")

# The C++ kernels register themselves for CUDA when the extension loads; any op it does not
# cover (or every op, when it is not loaded) runs the emulation on CUDA tensors; a fused op it does
# not cover runs as its unfused ops (each with its CUDA kernel).
backend.load_extension()
for _name in FUSED_SCHEMAS:
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"fp8ops::{_name}", "CUDA"):
        _lib.impl(_name, _composite(_name), "CUDA")
for _name in SCHEMAS:
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"fp8ops::{_name}", "CUDA"):
        if _name == "gemm_mx" and backend.extension_loaded():
            # an FP8 GPU with no MX GEMM kernel of ours: bf16 tensor cores, not a float32 matmul
            from . import gemm_mx_cuda
            _lib.impl(_name, _without_grad(gemm_mx_cuda.gemm_mx), "CUDA")
        else:
            _lib.impl(_name, _emulated(_name), "CUDA")

# the grouped GEMMs and casts of mixture-of-experts layers (grouped.py; emulation on every device)
grouped.register(_lib, _without_grad)
# the experts' weight casts (expert_casts.py; one C++ launch for all experts on CUDA)
expert_casts.register(_lib, _without_grad)
# the receiving end of a sum that travels in FP8 blocks (block_sum.py; fp8ops.distributed.wire)
block_sum.register(_lib, _without_grad)


# ----------------------------------------------------------------------------------------------
# fake (meta) implementations: shapes and dtypes only
# ----------------------------------------------------------------------------------------------
def _scalar_f32(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty((), dtype=torch.float32)


def _rows_cols(x: torch.Tensor):
    cols = x.shape[-1] if x.dim() > 0 else 1
    rows = 1
    for s in x.shape[:-1]:
        rows = rows * s
    return rows, cols


@torch.library.register_fake("fp8ops::amax")
def _(x):
    return _scalar_f32(x)


@torch.library.register_fake("fp8ops::amax_percentile")
def _(x, percentile):
    return _scalar_f32(x)


@torch.library.register_fake("fp8ops::quantize")
def _(x, scale, dtype, transpose=False, stochastic=False, seed=0, offset=0, rng=None, via=None):
    rows, cols = _rows_cols(x)
    data_t = x.new_empty((cols, rows) if transpose else (0,), dtype=dtype)
    return x.new_empty(x.shape, dtype=dtype), data_t, _scalar_f32(x)


@torch.library.register_fake("fp8ops::dequantize")
def _(data, scale_inv, out_dtype):
    return data.new_empty(data.shape, dtype=out_dtype)


@torch.library.register_fake("fp8ops::transpose_fp8")
def _(data):
    torch._check(data.dim() == 2, lambda: f"fp8ops: transpose_fp8: data must be 2-D, got {data.dim()}-D")
    return data.new_empty((data.shape[1], data.shape[0]))


@torch.library.register_fake("fp8ops::quantize_mx")
def _(x, dtype, block_size, axis, rceil):
    shape = list(x.shape)
    shape[axis] = shape[axis] // block_size
    return x.new_empty(x.shape, dtype=dtype), x.new_empty(shape, dtype=torch.uint8)


@torch.library.register_fake("fp8ops::dequantize_mx")
def _(data, scales, block_size, axis, out_dtype):
    return data.new_empty(data.shape, dtype=out_dtype)


@torch.library.register_fake("fp8ops::quantize_blockwise")
def _(x, dtype, block_rows, block_cols, power_of_two):
    rows, cols = _rows_cols(x)
    shape = ((rows + block_rows - 1) // block_rows, (cols + block_cols - 1) // block_cols)
    return x.new_empty(x.shape, dtype=dtype), x.new_empty(shape, dtype=torch.float32)


@torch.library.register_fake("fp8ops::dequantize_blockwise")
def _(data, scale_inv, block_rows, block_cols, out_dtype):
    return data.new_empty(data.shape, dtype=out_dtype)


@torch.library.register_fake("fp8ops::cast_stats")
def _(x, data, scale_inv, block_rows, block_cols):
    return x.new_empty((3,), dtype=torch.int64), _scalar_f32(x)


@torch.library.register_fake("fp8ops::delayed_scale_update")
def _(amax_history, scale, amax_rep, pending_amax, step, fp8_max, margin, interval, algo,
      ema_alpha, percentile, power_of_two):
    return (torch.empty_like(amax_history), torch.empty_like(scale), torch.empty_like(scale),
            torch.empty_like(amax_rep), torch.empty_like(pending_amax))


@torch.library.register_fake("fp8ops::adamw_step_multi")
def _(params, grads, m, m_scale_inv, v, v_scale_inv, scalars, rng):
    n = len(params)
    torch._check(all(len(x) == n for x in (grads, m, m_scale_inv, v, v_scale_inv)),
                 lambda: "fp8ops: adamw_step_multi: the lists must have one length")
    torch._check(tuple(scalars.shape) == (n, 9) and tuple(rng.shape) == (n, 2),
                 lambda: f"fp8ops: adamw_step_multi: scalars must be [{n}, 9] and rng [{n}, 2]")


def _gemm_out(a, b, out_dtype):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


@torch.library.register_fake("fp8ops::gemm")
def _(a, b, a_scale_inv, b_scale_inv, bias, out_dtype, fast_accum=False):
    return _gemm_out(a, b, out_dtype)


@torch.library.register_fake("fp8ops::gemm_blockwise")
def _(a, b, a_scale_inv, b_scale_inv, bias, out_dtype):
    return _gemm_out(a, b, out_dtype)


@torch.library.register_fake("fp8ops::gemm_mx")
def _(a, a_scales, b, b_scales, bias, out_dtype, block_size):
    return _gemm_out(a, b, out_dtype)


def _fused_outs(x, dtype, transpose, sum_dtype):
    rows, cols = _rows_cols(x)
    data_t = x.new_empty((cols, rows) if transpose else (0,), dtype=dtype)
    return (x.new_empty(x.shape, dtype=dtype), data_t, _scalar_f32(x), _scalar_f32(x),
            _sums(x, sum_dtype))


@torch.library.register_fake("fp8ops::quantize_current")
def _(x, dtype, margin, power_of_two, transpose=False, sum_dtype=None, stochastic=False, seed=0,
      offset=0, rng=None):
    return _fused_outs(x, dtype, transpose, sum_dtype)


@torch.library.register_fake("fp8ops::quantize_delayed")
def _(x, amax_history, scale, scale_inv, amax_rep, pending_amax, step, nonfinite_count, dtype,
      margin, interval, algo, ema_alpha, percentile, power_of_two, update, warm, record,
      transpose=False, sum_dtype=None, stochastic=False, seed=0, offset=0, rng=None):
    return _fused_outs(x, dtype, transpose, sum_dtype)


def _sums(x, sum_dtype):
    return (x.new_empty((_rows_cols(x)[1],), dtype=sum_dtype) if sum_dtype is not None
            else x.new_empty((0,), dtype=torch.float32))


@torch.library.register_fake("fp8ops::quantize_blockwise_pair")
def _(x, dtype, power_of_two, sum_dtype=None):
    torch._check(x.dim() == 2, lambda: "fp8ops: quantize_blockwise_pair: x must be 2-D")
    m, k = x.shape
    # the scales with their rows contiguous (fused.mn_major): [blocks, rows] buffers, transposed
    return (x.new_empty((m, k), dtype=dtype), x.new_empty(((k + 127) // 128, m), dtype=_F32).t(),
            x.new_empty((k, m), dtype=dtype), x.new_empty(((m + 127) // 128, k), dtype=_F32).t(),
            _sums(x, sum_dtype))


@torch.library.register_fake("fp8ops::quantize_mx_pair")
def _(x, dtype, block_size, rceil, sum_dtype=None):
    torch._check(x.dim() == 2, lambda: "fp8ops: quantize_mx_pair: x must be 2-D")
    m, k = x.shape
    mp, kp = -(-m // block_size) * block_size, -(-k // block_size) * block_size
    return (x.new_empty((m, kp), dtype=dtype), x.new_empty((m, kp // block_size), dtype=torch.uint8),
            x.new_empty((mp, kp), dtype=dtype), x.new_empty((mp // block_size, kp), dtype=torch.uint8),
            _sums(x, sum_dtype))
