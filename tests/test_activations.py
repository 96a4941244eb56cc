"""fp8ops.fp8_activations: the covered ops' outputs are the plain ops' bytes, what they save is
FP8 (1 byte per element) plus float32 scales, their gradients are the plain ops' gradients at
the dequantized input, and a transformer step saves (and peaks at) fewer bytes."""
from __future__ import annotations

import contextlib
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

import fp8ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
from gpt import GPT, GPTConfig  # noqa: E402
from llama import Llama, LlamaConfig  # noqa: E402

N = 200  # last dim: one whole 128-block and a partial one of 72
E4M3_REL = 2.0 ** -4  # RNE with 3 mantissa bits: half an ulp of a normal E4M3 value
E4M3_SUB = 2.0 ** -10  # half the subnormal spacing 2^-9, times scale_inv


def _weight(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (1 + 0.1 * torch.randn(N, generator=g)).to(dtype).requires_grad_()


def covered_ops(dtype):
    """(name, f(x), parameters, max |f''| for the elementwise ones)."""
    w, b = _weight(dtype, 1), _weight(dtype, 2)
    return [
        ("layer_norm", lambda x: F.layer_norm(x, (N,), w, b), [w, b], None),
        ("rms_norm", lambda x: F.rms_norm(x, (N,), w), [w], None),
        ("torch.layer_norm", lambda x: torch.layer_norm(x, [N], w, b, 1e-6), [w, b], None),
        ("torch.rms_norm", lambda x: torch.rms_norm(x, [N], w, 1e-6), [w], None),
        ("nn.LayerNorm", torch.nn.LayerNorm(N, dtype=dtype), None, None),
        ("nn.RMSNorm", torch.nn.RMSNorm(N, dtype=dtype), None, None),
        ("gelu", F.gelu, [], 0.8),  # gelu'' = phi(x) (2 - x^2), at most 2 phi(0) < 0.8
        ("gelu_tanh", lambda x: F.gelu(x, approximate="tanh"), [], 0.8),
        ("silu", F.silu, [], 0.5),  # silu'' is at most 0.5 (at 0)
    ]


OP_NAMES = [name for name, *_ in covered_ops(torch.float32)]


def _op(name, dtype):
    _, f, params, f2 = next(op for op in covered_ops(dtype) if op[0] == name)
    if params is None:
        params = list(f.parameters())
    return f, params, f2


def _input(dtype, shape=(6, N)):
    return (3 * torch.randn(shape)).to(dtype).requires_grad_()


def _bits(t):
    """The bytes of t, comparable with torch.equal even where t holds NaN."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


class Saved:
    """The tensors saved for backward inside the context (saved_tensors_hooks)."""

    def __init__(self):
        self.tensors = []

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def _pack(self, t):
        self.tensors.append(t)
        return t

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    def of_dtype(self, *dtypes):
        return [t for t in self.tensors if t.dtype in dtypes]


def _dequantize_1x128(data, scale_inv):
    """data times its block's scale_inv, in float32, independently of the library's ops."""
    scales = scale_inv.repeat_interleave(128, dim=1)[:, :data.shape[-1]]
    return data.float() * scales


def _grads(out, inputs, grad_out):
    return torch.autograd.grad(out, inputs, grad_out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", OP_NAMES)
def test_output_bytes_saved_fp8_and_gradient_at_dequantized_input(name, dtype):
    f, params, _ = _op(name, dtype)
    x = _input(dtype)
    plain = f(x)
    with Saved() as saved, fp8ops.fp8_activations():
        out = f(x)
    assert out.dtype == plain.dtype and torch.equal(_bits(out), _bits(plain))
    assert type(out.grad_fn).__name__ == "_SavedInFP8Backward"
    # the input is kept as 1-byte E4M3 and one float32 scale per row and 128-block, nothing more
    # of x's size (the parameters are saved as they are)
    (data,) = saved.of_dtype(torch.float8_e4m3fn)
    (scale_inv,) = [t for t in saved.of_dtype(torch.float32) if t.shape == (6, 2)]
    assert data.shape == (6, N) and data.element_size() == 1 and scale_inv.shape == (6, 2)
    assert all(t.numel() <= N for t in saved.tensors if t is not data)
    # power-of-two scales: the dequantized input is exact in x's dtype
    x_deq = _dequantize_1x128(data, scale_inv)
    assert torch.equal(x_deq.to(dtype).float(), x_deq)
    assert torch.log2(scale_inv).frac().eq(0).all()
    err_bound = E4M3_REL * x.detach().float().abs() + E4M3_SUB * scale_inv.repeat_interleave(
        128, dim=1)[:, :N]
    assert ((x_deq - x.detach().float()).abs() <= err_bound).all()
    # the gradient is the plain op's gradient at the dequantized input, bit for bit
    grad_out = torch.randn_like(plain)
    x_ref = x_deq.to(dtype).requires_grad_()
    expect = _grads(f(x_ref), [x_ref, *params], grad_out)
    got = _grads(out, [x, *params], grad_out)
    for g, e in zip(got, expect):
        assert g.dtype == e.dtype and torch.equal(_bits(g), _bits(e))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", OP_NAMES)
def test_gradient_within_the_e4m3_bound_of_the_exact_one(name, dtype):
    f, params, f2max = _op(name, dtype)
    x = _input(dtype)
    grad_out = torch.randn_like(f(x))
    exact = _grads(f(x), [x], grad_out)[0].float()
    with fp8ops.fp8_activations():
        out = f(x)
    got = _grads(out, [x], grad_out)[0].float()
    rounding = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -20  # the gradient's own dtype
    if f2max is not None:
        # elementwise: |f'(x') - f'(x)| <= max |f''| |x' - x| (mean value theorem)
        bound = (f2max * grad_out.float().abs() * (E4M3_REL * x.detach().float().abs() + 1e-3)
                 + rounding * exact.abs() + 1e-6)
        assert ((got - exact).abs() <= bound).all()
    # every op: the relative error of the whole gradient stays within E4M3's per-element error
    # (the errors of independent elements do not add up: measured about 2^-7)
    assert (got - exact).norm() <= (E4M3_REL + rounding) * exact.norm()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", OP_NAMES)
def test_tensor_recipe_saves_one_scale(name, dtype):
    f, params, _ = _op(name, dtype)
    x = _input(dtype)
    plain = f(x)
    with Saved() as saved, fp8ops.fp8_activations(recipe="tensor"):
        out = f(x)
    assert torch.equal(_bits(out), _bits(plain))
    (data,) = saved.of_dtype(torch.float8_e4m3fn)
    (scale_inv,) = [t for t in saved.of_dtype(torch.float32) if t.numel() == 1]
    assert data.shape == x.shape and torch.log2(scale_inv).frac() == 0
    x_deq = (data.float() * scale_inv).to(dtype).requires_grad_()
    grad_out = torch.randn_like(out)
    expect = _grads(f(x_deq), [x_deq, *params], grad_out)
    for g, e in zip(_grads(out, [x, *params], grad_out), expect):
        assert torch.equal(_bits(g), _bits(e))


def test_e5m2_format():
    x = _input(torch.float32)
    with Saved() as saved, fp8ops.fp8_activations(fmt="e5m2"):
        F.silu(x)
    assert len(saved.of_dtype(torch.float8_e5m2)) == 1


def test_float16_gradient_comes_back_in_float16():
    x = _input(torch.float16)
    with fp8ops.fp8_activations():
        out = F.layer_norm(x, (N,))
    assert torch.equal(out, F.layer_norm(x, (N,)))
    out.sum().backward()
    assert x.grad.dtype == torch.float16 and torch.isfinite(x.grad).all()


def test_float16_near_its_max_is_saved_finite():
    """63488 and above round up to 2^16 in E4M3 (power-of-two scale 2^8): clamped to 65504."""
    x = torch.tensor([[65504.0, 63488.0, 1.0]], dtype=torch.float16, requires_grad=True)
    with fp8ops.fp8_activations():
        out = F.silu(x)
    (g,) = _grads(out, [x], torch.ones_like(out))
    assert torch.isfinite(g).all()


def _is_plain(out):
    return out.grad_fn is None or type(out.grad_fn).__name__ != "_SavedInFP8Backward"


@pytest.mark.parametrize("case", ["no_grad", "inference_mode", "input_without_grad", "float64",
                                  "empty", "inplace_silu"])
def test_what_runs_plain(case):
    x = _input(torch.float32)
    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(
        case, contextlib.nullcontext)
    if case == "input_without_grad":
        x = x.detach()
    elif case == "float64":
        x = x.detach().double().requires_grad_()
    elif case == "empty":
        x = torch.randn(0, N, requires_grad=True)
    with Saved() as saved, fp8ops.fp8_activations(), ctx():
        if case == "inplace_silu":
            out = F.silu(x.clone(), inplace=True)
        else:
            out = F.gelu(x)
    assert _is_plain(out) and not saved.of_dtype(torch.float8_e4m3fn)
    if case == "empty":
        out.sum().backward()
        assert x.grad.shape == x.shape


def test_ops_outside_the_covered_set_run_unchanged():
    x = _input(torch.float32)
    with fp8ops.fp8_activations():
        out = torch.tanh(x) * F.relu(x)
    assert type(out.grad_fn).__name__ == "MulBackward0"


@pytest.mark.parametrize("recipe", ["1x128", "tensor"])
def test_non_finite_input(recipe):
    """The output is the plain op's, NaN and inf included. The gradient is NaN where the input
    is; with "1x128" a block holding NaN or inf dequantizes to NaN as a whole, with "tensor" a
    non-finite amax leaves the scale at 1 (the rest is cast unscaled)."""
    x = torch.randn(4, N)
    x[0, 3], x[2, 150] = float("nan"), float("inf")
    x.requires_grad_()
    with fp8ops.fp8_activations(recipe=recipe):
        out = F.gelu(x)
    assert torch.equal(_bits(out), _bits(F.gelu(x)))
    (g,) = _grads(out, [x], torch.ones_like(out))
    assert torch.isnan(g[0, 3])
    assert torch.isfinite(g[1]).all() and torch.isfinite(g[3]).all()
    if recipe == "1x128":  # the other block of each affected row is untouched
        assert torch.isfinite(g[0, 128:]).all() and torch.isfinite(g[2, :128]).all()


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"recipe must be one of \('1x128', 'tensor'\)"):
        fp8ops.fp8_activations(recipe="1x32")
    with pytest.raises(ValueError, match="unknown FP8 format"):
        fp8ops.fp8_activations(fmt="e3m4")
    with pytest.raises(TypeError):
        fp8ops.fp8_activations("tensor")  # keyword-only


def test_autocast_keeps_torchs_output_dtype():
    ln = torch.nn.LayerNorm(N)
    x = _input(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = ln(x)
        with fp8ops.fp8_activations():
            out = ln(x)
    assert out.dtype == plain.dtype and torch.equal(_bits(out), _bits(plain))
    out.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad).all()


def test_nested_contexts_save_once_with_the_inner_settings():
    x = _input(torch.float32)
    with Saved() as saved, fp8ops.fp8_activations(), fp8ops.fp8_activations(recipe="tensor"):
        out = F.layer_norm(F.silu(x), (N,))
    assert len(saved.of_dtype(torch.float8_e4m3fn)) == 2
    assert all(t.numel() == 1 for t in saved.of_dtype(torch.float32))
    assert torch.equal(out, F.layer_norm(F.silu(x), (N,)))
    out.sum().backward()


def test_backward_inside_the_context_saves_nothing_more():
    x = _input(torch.float32)
    with fp8ops.fp8_activations():
        out = F.gelu(x)
        with Saved() as saved:
            out.sum().backward()
    assert not saved.of_dtype(torch.float8_e4m3fn) and torch.isfinite(x.grad).all()


def test_double_backward_is_refused():
    x = _input(torch.float32)
    with fp8ops.fp8_activations():
        out = F.silu(x)
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        g.sum().backward()


def test_torch_compile_traces_the_plain_ops():
    """torch.compile traces the plain ops (the mode steps aside while dynamo traces), and the
    compiled code runs torch's own: outputs and gradients are those without the context. (The
    "eager" backend runs the traced calls eagerly, where the context intercepts them as usual.)"""
    ln = torch.nn.LayerNorm(N)

    def step(x):
        return F.gelu(ln(x)).sum()

    x = _input(torch.float32)
    expect = torch.autograd.grad(step(x), x)[0]
    compiled = torch.compile(step, backend="aot_eager")
    with fp8ops.fp8_activations():
        loss = compiled(x)
    assert torch.equal(torch.autograd.grad(loss, x)[0], expect)


# -- a transformer step ------------------------------------------------------------------------
MODELS = {"gpt": (GPT, GPTConfig), "llama": (Llama, LlamaConfig)}


def _covered_elements(name, cfg, tokens, attention=False):
    """Elements of the covered ops' inputs in one step: the norms' (2 per block and the final
    one) and the MLP activation's input (GELU: 4 d_model wide; SiLU: the SwiGLU width, and the
    SwiGLU product's other operand, as wide), with attention q, k and v (d_model each)."""
    hidden = 4 * cfg.d_model if name == "gpt" else 2 * cfg.ffn_hidden
    per_block = hidden + (3 * cfg.d_model if attention else 0)
    return tokens * ((2 * cfg.n_layer + 1) * cfg.d_model + cfg.n_layer * per_block)


def _saved_bytes(model, idx, ctx):
    """Bytes of the distinct storages saved for backward (parameters left out), by dtype."""
    storages = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            storages[t.untyped_storage().data_ptr()] = (t.dtype, t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
        model(idx, idx)
    by_dtype = {}
    for dtype, nbytes in storages.values():
        by_dtype[dtype] = by_dtype.get(dtype, 0) + nbytes
    return by_dtype


@pytest.mark.parametrize("name, attention", [("gpt", False), ("llama", False),
                                             ("llama", True)])
def test_model_step_saves_the_covered_inputs_in_half_the_bf16_bytes(name, attention):
    model_cls, cfg_cls = MODELS[name]
    cfg = cfg_cls()
    model = model_cls(cfg).to(torch.bfloat16)
    idx = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len))
    plain = _saved_bytes(model, idx, contextlib.nullcontext())
    fp8 = _saved_bytes(model, idx, fp8ops.fp8_activations(attention=attention))
    covered = _covered_elements(name, cfg, idx.numel(), attention)
    assert torch.float8_e4m3fn not in plain
    assert fp8[torch.float8_e4m3fn] == covered  # 1 byte per covered element
    # each of them no longer saved in high precision (2 bytes or more: the plain RMSNorm keeps
    # a float32 copy), for 1 byte and one float32 scale per 128 elements (per row of a head)
    scales = 4 * covered // min(128, cfg.d_model // cfg.n_head)
    high = (torch.bfloat16, torch.float32)
    assert sum(plain[d] - fp8[d] for d in high) >= 2 * covered - scales
    assert sum(plain.values()) - sum(fp8.values()) >= covered - scales
    if name == "llama":  # the SwiGLU product saves neither bf16 operand (nor the silu output)
        hidden = idx.numel() * cfg.ffn_hidden * cfg.n_layer
        assert plain[torch.bfloat16] - fp8[torch.bfloat16] >= 2 * hidden * 2


@pytest.mark.usefixtures("one_thread")
def test_llama_step_peak_memory_shrinks():
    from torch.distributed._tools.mem_tracker import MemTracker

    def peak(ctx):
        torch.manual_seed(0)
        model = Llama(LlamaConfig()).to(torch.bfloat16)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        idx = torch.randint(0, 256, (4, 64))
        tracker = MemTracker()
        tracker.track_external(model, opt, idx)
        with tracker:
            with ctx:
                loss = model(idx, idx)
            loss.backward()
            opt.step()
            opt.zero_grad()
        (snap,) = tracker.get_tracker_snapshot("peak").values()
        return snap["Total"]

    plain, fp8 = peak(contextlib.nullcontext()), peak(fp8ops.fp8_activations())
    attention = peak(fp8ops.fp8_activations(attention=True))
    # the peak is the end of forward, where the saved inputs sit
    assert fp8 < 0.9 * plain
    assert attention < fp8


def _train(with_fp8_activations, steps=20):
    """Losses of a small GPT with FP8Linear blocks, on sequences that count up modulo 64."""
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    fp8ops.convert_to_fp8(model, fp8ops.CurrentScaling(),
                          filter_fn=lambda module, fqn: fqn.startswith("blocks."))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        seq = (torch.randint(0, 64, (8, 1), generator=gen) + torch.arange(65)) % 64
        with fp8ops.fp8_activations() if with_fp8_activations else contextlib.nullcontext():
            loss = model(seq[:, :-1], seq[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.usefixtures("one_thread")  # (conftest.py says why)
def test_training_loss_stays_close():
    """The FP8-saved inputs perturb each gradient by about 1% (relative norm, the tests above);
    AdamW's updates move by about as much, and the two runs drift apart slowly: measured at most
    4% apart over 20 steps while the loss falls 25-fold. 10% leaves room for other machines'
    float rounding; both runs must learn."""
    plain, fp8 = _train(False), _train(True)
    assert plain[0] == fp8[0]  # the first forward is the same computation
    for a, b in zip(plain, fp8):
        assert math.isfinite(b) and abs(a - b) <= 0.1 * a
    assert fp8[-1] < 0.1 * fp8[0]


def test_arguments_torch_refuses_get_torchs_error():
    x = _input(torch.float32)
    with fp8ops.fp8_activations(), pytest.raises(TypeError, match="gelu"):
        F.gelu(x, "tanh", 3)


def test_non_contiguous_input():
    x = _input(torch.float32, (N, 6))
    with fp8ops.fp8_activations(recipe="tensor"):
        out = F.silu(x.t())
    assert torch.equal(out, F.silu(x.t()))
    out.sum().backward()
    assert x.grad.shape == x.shape
