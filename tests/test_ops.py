"""Every op through the dispatcher: torch.library.opcheck (schema, fake, autograd registration,
AOT dispatch) on sample inputs, and dispatch facts."""
import pytest
import torch

import fp8ops  # noqa: F401
from fp8ops.ops import emulation
from fp8ops.ops import SCHEMAS

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def _fp8(shape, dtype=E4, scale=8.0):
    return (torch.randn(shape) * scale).clamp(-448, 448).to(dtype)


def _moment(shape, dtype=E4):
    """A second moment's stored values: non-negative."""
    return (torch.rand(shape) * 8).to(dtype)


def _samples():
    x = torch.randn(6, 64) * 3
    xb = x.to(torch.bfloat16)
    hist = torch.rand(8) * 5
    s = torch.tensor(2.0)
    return {
        "amax": [(x,), (xb,), (torch.empty(0, 3),)],
        "amax_percentile": [(x, 99.0), (xb, 100.0), (torch.empty(0, 3), 50.0)],
        "quantize": [(x, s, E4, False, False, 0, 0), (xb, s, E5, True, False, 0, 0),
                     (x.to(torch.float16), s, E4, True, True, 3, 4),
                     (torch.empty(0, 5), s, E4, True, False, 0, 0),
                     (x, s, E4, True, False, 0, 0, None, torch.bfloat16)],
        "dequantize": [(_fp8((6, 64)), torch.tensor(0.5), torch.bfloat16),
                       (_fp8((3,), E5), torch.tensor(0.5), torch.float32)],
        "transpose_fp8": [(_fp8((6, 64)),), (_fp8((130, 17), E5),),
                          (torch.randint(0, 256, (0, 5), dtype=torch.uint8),)],
        "quantize_mx": [(x, E4, 32, 1, False), (xb, E5, 32, 1, True),
                        (torch.randn(64, 5), E4, 32, 0, False)],
        "dequantize_mx": [(_fp8((6, 64)), torch.randint(100, 140, (6, 2), dtype=torch.uint8), 32,
                           1, torch.float32)],
        "quantize_blockwise": [(x, E4, 1, 128, False), (torch.randn(130, 200), E5, 128, 128, True),
                               (x.t(), E4, 1, 128, False)],
        "dequantize_blockwise": [(_fp8((6, 64)), torch.rand(6, 1) + 0.5, 1, 128, torch.bfloat16)],
        "cast_stats": [(x, _fp8((6, 64)), torch.tensor(0.25), 0, 0),
                       (xb.t(), _fp8((64, 6), E5), torch.rand(1, 1) + 0.5, 128, 128),
                       (x, _fp8((32, 64)), torch.randint(100, 140, (32, 2), dtype=torch.uint8),
                        1, 32),
                       (torch.empty(0, 3), _fp8((0, 3)), torch.tensor(1.0), 0, 0)],
        "delayed_scale_update": [
            (hist, s, torch.tensor(3.0), torch.tensor(4.0), torch.tensor(4), 448.0, 1.0, 2, algo,
             0.1, 90.0, p2) for algo, p2 in (("max", False), ("most_recent", True), ("ema", False),
                                             ("percentile", False))],
        "gemm": [(_fp8((5, 32)), _fp8((7, 32)), torch.tensor(0.1), torch.tensor(0.2), None,
                  torch.bfloat16, False),
                 (_fp8((5, 32), E5), _fp8((7, 32)), torch.tensor(0.1), torch.tensor(0.2),
                  torch.randn(7), torch.float32, True)],
        "gemm_blockwise": [(_fp8((5, 200)), _fp8((7, 200)), torch.rand(5, 2), torch.rand(1, 2),
                            None, torch.bfloat16),
                           (_fp8((5, 200)), _fp8((7, 200)), torch.rand(5, 2), torch.rand(7, 2),
                            torch.randn(7), torch.float32)],
        "gemm_mx": [(_fp8((5, 64)), torch.randint(110, 130, (5, 2), dtype=torch.uint8),
                     _fp8((7, 64)), torch.randint(110, 130, (7, 2), dtype=torch.uint8),
                     torch.randn(7), torch.bfloat16, 32)],
        # param, grad, m, m_scale_inv, v, v_scale_inv, 9 float32 scalars, seed, offset
        "adamw_step": [(torch.randn(3, 100), torch.randn(3, 100), _fp8((3, 128)),
                        torch.rand(3, 1), _moment((3, 128)), torch.rand(3, 1), *ADAMW_SCALARS),
                       (torch.randn(200, dtype=torch.bfloat16), torch.randn(200).bfloat16(),
                        _fp8((2, 128)), torch.rand(2, 1), torch.rand(200).bfloat16(),
                        torch.empty(0), *ADAMW_SCALARS[:-2], 7, 3 << 32 | 5),
                       (torch.randn(128), torch.randn(128), _fp8((1, 128)), torch.rand(1, 1),
                        _moment((1, 128), E5), torch.rand(1, 1), *ADAMW_SCALARS)],
        # lists of params, grads, m, m_scale_inv, v, v_scale_inv; scalars [n, 9]; rng [n, 2]
        "adamw_step_multi": [_adamw_multi_sample([(3, 100), (200,), (0,)], torch.float32, E4),
                             _adamw_multi_sample([(130,), (5,)], torch.bfloat16, torch.bfloat16),
                             _adamw_multi_sample([(256,)], torch.float32, E5),
                             _adamw_multi_sample([], torch.float32, E4)],
    }


def _adamw_multi_sample(shapes, dtype, v_dtype):
    """adamw_step_multi's arguments for parameters of these shapes (each its own step count
    and random stream)."""
    blocks = [-(-torch.Size(s).numel() // 128) for s in shapes]
    params = [torch.randn(s).to(dtype) for s in shapes]
    if v_dtype == torch.bfloat16:
        v = [torch.rand(s).bfloat16() for s in shapes]
        v_si = [torch.empty(0) for _ in shapes]
    else:
        v = [_moment((b, 128), v_dtype) for b in blocks]
        v_si = [torch.rand(b, 1) for b in blocks]
    scalars = torch.tensor([ADAMW_SCALARS[:9]] * len(shapes), dtype=torch.float32).reshape(-1, 9)
    scalars[:, 5] *= torch.arange(1, len(shapes) + 1)  # step sizes of different steps
    rng = torch.tensor([[7, i << 32 | (i + 1)] for i in range(len(shapes))],
                       dtype=torch.int64).reshape(-1, 2)
    return ([p.clone() for p in params], [torch.randn_like(p) for p in params],
            [_fp8((b, 128)) for b in blocks], [torch.rand(b, 1) for b in blocks], v, v_si,
            scalars, rng)


# beta1, 1 - beta1, beta2, 1 - beta2, eps, step size, 1 / sqrt(1 - beta2^t), decay, l2 (float32
# values), seed, offset
ADAMW_SCALARS = (0.875, 0.125, 0.9375, 0.0625, 2.0 ** -20, 0.01, 1.5, 0.999, 0.0, 0, 1)
SAMPLES = _samples()


def _tensors(args):
    """The tensors of an op's arguments, those in lists included, in order."""
    flat = []
    for a in args:
        flat.extend(t for t in (a if isinstance(a, (list, tuple)) else [a])
                    if isinstance(t, torch.Tensor))
    return tuple(flat)


def _results(name, args):
    """What an op gives: its outputs, or for an op that writes its arguments (returns None),
    the arguments it writes."""
    out = getattr(torch.ops.fp8ops, name)(*args)
    if out is None:
        return _tensors(args)
    return out if isinstance(out, tuple) else (out,)


def _fresh(args):
    def clone(a):
        if isinstance(a, (list, tuple)):
            return type(a)(clone(x) for x in a)
        return a.clone() if isinstance(a, torch.Tensor) else a
    return [clone(a) for a in args]


def test_every_op_has_samples():
    assert set(SAMPLES) == set(SCHEMAS)


@pytest.mark.parametrize("name, args", [(n, a) for n, cases in SAMPLES.items() for a in cases],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_opcheck(name, args):
    tests = ["test_schema", "test_autograd_registration", "test_faketensor",
             "test_aot_dispatch_dynamic"]
    if any(a.element_size() == 1 and a.is_floating_point() for a in _tensors(args)):
        # torch's SchemaCheckMode compares inputs with torch.allclose, which has no float8
        # kernel on CPU ("mul_cpu_reduced_float"): a limitation of the checker, not of the op.
        tests.remove("test_schema")
    torch.library.opcheck(getattr(torch.ops.fp8ops, name).default, args, test_utils=tests)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_op_runs_emulation_on_cpu(name):
    args = SAMPLES[name][0]
    got = _results(name, _fresh(args))
    ref_args = _fresh(args)
    ref = getattr(emulation, name)(*ref_args)
    if ref is None:
        ref = _tensors(ref_args)
    ref = ref if isinstance(ref, tuple) else (ref,)
    for g, r in zip(got, ref):
        assert g.dtype == r.dtype and g.shape == r.shape
        assert torch.equal(g.view(torch.uint8) if g.element_size() == 1 else g,
                           r.view(torch.uint8) if r.element_size() == 1 else r) or \
            torch.allclose(g.float(), r.float(), equal_nan=True)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_does_not_reach_the_kernels(name, dtype):
    """Called under torch.autocast, an op computes what it computes without it: autocast would
    run the emulation's float32 matmuls (the GEMMs) in bf16 or fp16."""
    for args in SAMPLES[name]:
        ref = _results(name, _fresh(args))
        with torch.autocast("cpu", dtype=dtype):
            got = _results(name, _fresh(args))
        for g, r in zip(got, ref):
            assert g.dtype == r.dtype
            assert torch.equal(g.view(torch.uint8) if g.element_size() == 1 else g,
                               r.view(torch.uint8) if r.element_size() == 1 else r), name


@pytest.mark.parametrize("via", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("stochastic", [False, True])
def test_quantize_via_is_the_cast_of_the_rounded_input(via, stochastic):
    """quantize(x, ..., via) casts x.to(via) (its amax included) without making that copy: the
    bytes of a high-precision gather's values. The inputs round differently through bf16 and
    fp16 (halfway cases, fp16 overflow and underflow, specials)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 96, generator=g) * 40
    x[0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 70000.0, 1e-8, -0.0])
    x[1] = 1 + (torch.arange(96) % 3 - 1) * 2.0 ** -8  # bf16 ties and their neighbours
    scale = torch.tensor(3.0)
    got = torch.ops.fp8ops.quantize(x, scale, E4, True, stochastic, 7, 1, None, via)
    want = torch.ops.fp8ops.quantize(x.to(via), scale, E4, True, stochastic, 7, 1)
    for g_, w in zip(got, want):
        assert g_.dtype == w.dtype
        assert torch.equal(g_.view(torch.uint8) if g_.element_size() == 1 else g_,
                           w.view(torch.uint8) if w.element_size() == 1 else w) or \
            (g_.isnan().all() and w.isnan().all())
    with pytest.raises(ValueError, match="via"):
        torch.ops.fp8ops.quantize(x, scale, E4, False, False, 0, 0, None, torch.int32)
    if via == torch.bfloat16 and not stochastic:  # a double rounding the cast must reproduce
        v = torch.tensor([1.0625 + 2.0 ** -12])  # rounds up to E4M3 1.125 from float32; in bf16
        one = torch.tensor(1.0)                  # it is the tie 1.0625, which goes to even 1.0
        assert torch.ops.fp8ops.quantize(v, one, E4)[0].float().item() == 1.125
        assert torch.ops.fp8ops.quantize(v, one, E4, via=via)[0].float().item() == 1.0


def test_ops_are_not_differentiable():
    x = torch.randn(4, 32, requires_grad=True)
    data, data_t, amax = torch.ops.fp8ops.quantize(x, torch.tensor(1.0), E4, True, False, 0, 0)
    assert data.grad_fn is None and amax.grad_fn is None and not amax.requires_grad


def test_cuda_key_has_a_kernel_for_every_op():
    # The emulation serves CUDA tensors whenever the extension is not loaded.
    for name in SCHEMAS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"fp8ops::{name}", "CUDA"), name


@pytest.mark.parametrize("case", range(len(SAMPLES["adamw_step_multi"])))
def test_adamw_step_multi_is_adamw_step_on_each_param(case):
    args = SAMPLES["adamw_step_multi"][case]
    got = _fresh(args)
    torch.ops.fp8ops.adamw_step_multi(*got)
    want = _fresh(args)
    lists, scalars, rng = want[:6], want[6], want[7]
    for i, tensors in enumerate(zip(*lists)):
        torch.ops.fp8ops.adamw_step(*tensors, *scalars[i].tolist(), *rng[i].tolist())
    for g, w in zip(_tensors(got), _tensors(want)):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))


def test_adamw_step_multi_refuses_mixed_or_misshapen_lists():
    f32 = SAMPLES["adamw_step_multi"][0]
    bf16 = SAMPLES["adamw_step_multi"][1]
    with pytest.raises(ValueError, match="one length"):
        torch.ops.fp8ops.adamw_step_multi(*_fresh(f32[:1]), *_fresh([x[:2] for x in f32[1:6]]),
                                          *f32[6:])
    with pytest.raises(ValueError, match="scalars must be float32"):
        torch.ops.fp8ops.adamw_step_multi(*_fresh(f32[:6]), f32[6][:2], f32[7])
    with pytest.raises(ValueError, match="rng must be int64"):
        torch.ops.fp8ops.adamw_step_multi(*_fresh(f32[:6]), f32[6], f32[7].int())
    mixed = [a + b for a, b in zip(_fresh(f32[:6]), _fresh(bf16[:6]))]
    with pytest.raises(ValueError, match="one dtype"):
        torch.ops.fp8ops.adamw_step_multi(*mixed, torch.cat([f32[6], bf16[6]]),
                                          torch.cat([f32[7], bf16[7]]))
