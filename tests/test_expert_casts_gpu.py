"""GPU tests of the experts' weight casts (csrc/cast_experts.h, one launch for all experts)
behind fp8ops::amax_experts, quantize_experts_current and quantize_experts_scaled: bit for bit
the dense CUDA ops on each expert, which tests/test_cast_kernels_gpu.py holds to the emulation.
Outputs land in memory last filled with 0xFF bytes, so a byte no block writes shows up. Needs a
CUDA GPU and the built extension; skipped otherwise."""
from __future__ import annotations

import pytest
import torch

import fp8ops  # noqa: F401  (defines torch.ops.fp8ops.*)
from fp8ops.ops import backend, expert_casts

pytestmark = pytest.mark.gpu
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
_ops = torch.ops.fp8ops


def _skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if not backend.extension_loaded():
        return f"fp8ops._C not loaded: {backend._state['why_not']}"
    return None


_reason = _skip_reason()
if _reason is not None:
    pytest.skip(_reason, allow_module_level=True)

SHAPES = {
    "aligned": (4, 256, 512),   # vector loads, word stores of the transposed copy
    "ragged": (3, 130, 141),    # scalar path, partial tiles
    "one": (1, 136, 200),
    "many": (130, 64, 96),      # more experts than a tile has rows
}


def _poison():
    torch.full((1 << 26,), 255, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()


def _same(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), what


def _weight(shape, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    e = shape[0]
    spread = torch.logspace(-4, 4, e, device="cuda").view(e, 1, 1)  # scales far apart
    w = torch.randn(*shape, device="cuda", generator=g) * spread
    if e > 1:
        w[1] = 0  # an all-zero expert
    return w.to(dtype)


@pytest.mark.parametrize("case", sorted(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("fmt", [E4, E5], ids=str)
@pytest.mark.parametrize("transpose", [True, False], ids=["t", "no_t"])
def test_kernels_are_the_dense_kernels_per_expert(case, dtype, fmt, transpose):
    w = _weight(SHAPES[case], dtype)
    if dtype == torch.float16:
        w = w.clamp(-60000, 60000)
    scale = torch.logspace(3, -3, w.shape[0], device="cuda")
    _poison()
    amax = _ops.amax_experts(w)
    _poison()
    data, data_t, s, s_inv = _ops.quantize_experts_current(w, fmt, 2.0, False, transpose)
    _poison()
    sd, sd_t, s_amax = _ops.quantize_experts_scaled(w, scale, fmt, transpose)
    for g in range(w.shape[0]):
        _same(amax[g], _ops.amax(w[g]), f"amax {g}")
        d, d_t, ds, ds_inv, _ = _ops.quantize_current(w[g], fmt, 2.0, False, transpose)
        _same(data[g], d, f"current data {g}")
        _same(s[g], ds, f"scale {g}")
        _same(s_inv[g], ds_inv, f"scale_inv {g}")
        q, q_t, q_amax = _ops.quantize(w[g], scale[g], fmt, transpose)
        _same(sd[g], q, f"scaled data {g}")
        _same(s_amax[g], q_amax, f"scaled amax {g}")
        if transpose:
            _same(data_t[g], d_t, f"current data_t {g}")
            _same(sd_t[g], q_t, f"scaled data_t {g}")
    if not transpose:
        assert data_t.numel() == sd_t.numel() == 0


def test_power_of_two_nan_and_a_strided_weight():
    w = _weight((3, 128, 256), torch.bfloat16).transpose(1, 2)  # not contiguous: copied first
    w[2, 5, 7] = float("nan")
    data, data_t, s, _ = _ops.quantize_experts_current(w, E4, 1.0, True, True)
    for g in range(3):
        d, d_t, ds, _, _ = _ops.quantize_current(w[g], E4, 1.0, True, True)
        _same(data[g], d, f"data {g}")
        _same(data_t[g], d_t, f"data_t {g}")
        _same(s[g], ds, f"scale {g}")
    assert torch.isnan(_ops.amax_experts(w)[2])


def test_the_python_entry_points_take_the_kernels_and_their_loops_agree():
    w = _weight((5, 136, 200), torch.bfloat16)
    for name, args in (("quantize_experts_current", (E4, 1.0, False, True)),
                       ("quantize_experts_scaled", (torch.rand(5, device="cuda") * 100, E5, True)),
                       ("amax_experts", ())):
        got, want = getattr(_ops, name)(w, *args), expert_casts._LOOPS[name](w, *args)
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        for g, x in zip(got, want):
            _same(g, x, name)


def test_more_experts_than_one_launch_takes_the_loop():
    """The kernels hold at most 65535 experts (one per blockIdx.y): the entry points give more
    to the loop of dense ops, the op itself refuses them by name."""
    n = expert_casts.MAX_EXPERTS_PER_LAUNCH + 2
    w = _weight((n, 1, 16), torch.float32)
    data, _, scale, _ = expert_casts.quantize_experts_current(w, E4, 1.0, False, False)
    d, _, s, _ = expert_casts._loop_current(w[-2:], E4, 1.0, False, False)
    _same(data[-2:], d, "data")
    _same(scale[-2:], s, "scale")
    _same(expert_casts.experts_amax(w)[-2:], expert_casts._loop_amax(w[-2:]), "amax")
    with pytest.raises(RuntimeError, match="at most 65535 experts"):
        _ops.amax_experts(w)


def test_bad_inputs_are_clear_errors():
    w = _weight((2, 16, 32), torch.bfloat16)
    with pytest.raises(RuntimeError, match="3-D"):
        _ops.quantize_experts_current(w[0], E4, 1.0, False, True)
    with pytest.raises(RuntimeError, match="float8"):
        _ops.quantize_experts_current(w, torch.bfloat16, 1.0, False, True)
    with pytest.raises(RuntimeError, match="shape"):
        _ops.quantize_experts_scaled(w, torch.ones(3, device="cuda"), E4, True)
    with pytest.raises(RuntimeError, match="CUDA tensor"):
        _ops.quantize_experts_scaled(w, torch.ones(2), E4, True)


@pytest.mark.parametrize("name", sorted(expert_casts.SCHEMAS))
def test_opcheck(name):
    w = _weight((3, 64, 96), torch.bfloat16)
    args = {"amax_experts": (w,), "quantize_experts_current": (w, E4, 1.0, False, True),
            "quantize_experts_scaled": (w, torch.full((3,), 2.0, device="cuda"), E5, False)}[name]
    torch.library.opcheck(getattr(_ops, name).default, args)


def test_replays_in_a_cuda_graph():
    w = _weight((4, 128, 256), torch.bfloat16)
    _ops.quantize_experts_current(w, E4, 1.0, False, True)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _ops.quantize_experts_current(w, E4, 1.0, False, True)
    w.copy_(_weight((4, 128, 256), torch.bfloat16, seed=1))
    graph.replay()
    want = _ops.quantize_experts_current(w, E4, 1.0, False, True)
    for g, x in zip(out, want):
        _same(g, x, "replay")
