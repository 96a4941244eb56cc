"""fp8ops.linear(): accuracy against a float64 reference, shapes, dtypes and argument checks."""
import copy

import pytest
import torch

import fp8ops

RECIPES = {
    "current": fp8ops.CurrentScaling(),
    "delayed": fp8ops.DelayedScaling(amax_history_len=4),
    "mxfp8": fp8ops.MXFP8Scaling(),
    "mxfp8_rceil": fp8ops.MXFP8Scaling(scale_mode="rceil"),
    "blockwise": fp8ops.BlockwiseScaling(),
    "stochastic": fp8ops.CurrentScaling(grad_rounding="stochastic"),
}


def sqnr(a, b):
    return (10 * torch.log10(b.pow(2).sum() / (a - b).pow(2).sum())).item()


def _run(recipe, shape_in, n_out, dtype=torch.float32, steps=3):
    """Several steps (so delayed scaling has a history); returns the last step's results and a
    float64 reference of the same step."""
    weight = torch.nn.Parameter(torch.randn(n_out, shape_in[-1], dtype=dtype) * 0.05)
    bias = torch.nn.Parameter(torch.randn(n_out, dtype=dtype))
    state = fp8ops.ScalingState(recipe)
    for _ in range(steps):
        weight.grad = bias.grad = None
        x = (torch.randn(shape_in) * 3).to(dtype).requires_grad_()
        y = fp8ops.linear(x, weight, bias, state=state)
        dy = torch.randn(y.shape, dtype=dtype)
        y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    b64 = bias.detach().double().requires_grad_()
    y64 = torch.nn.functional.linear(x64, w64, b64)
    y64.backward(dy.double())
    return (y, x.grad, weight.grad, bias.grad), (y64, x64.grad, w64.grad, b64.grad)


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_sqnr_against_float64(name, dtype):
    (y, dx, dw, db), (ry, rdx, rdw, rdb) = _run(RECIPES[name], (3, 50, 192), 160, dtype)
    assert y.dtype == dtype and dx.dtype == dtype and dw.dtype == dtype
    assert y.shape == (3, 50, 160) and dx.shape == (3, 50, 192)
    assert sqnr(y.double(), ry) >= 18, "output"
    assert sqnr(dx.double(), rdx) >= 17, "dgrad"
    assert sqnr(dw.double(), rdw) >= 17, "wgrad"
    assert sqnr(db.double(), rdb) >= 17, "bias grad"


@pytest.mark.parametrize("name", ["current", "delayed", "mxfp8", "blockwise"])
def test_odd_shapes_and_1d_input(name):
    # sizes that are not multiples of 16, 32 or 128 exercise the padding paths
    (y, dx, dw, _), (ry, rdx, rdw, _) = _run(RECIPES[name], (37, 45), 19)
    assert sqnr(y.double(), ry) >= 18 and sqnr(dw.double(), rdw) >= 17
    w = torch.randn(7, 45)
    assert fp8ops.linear(torch.randn(45), w, recipe=RECIPES[name] if name != "delayed" else None,
                         state=fp8ops.ScalingState(RECIPES[name])).shape == (7,)


@pytest.mark.parametrize("name", ["current", "delayed", "mxfp8", "blockwise"])
@pytest.mark.parametrize("lead", [(5,), (2, 5), ()], ids=["2d", "3d", "1d"])
@pytest.mark.parametrize("n_out", [32, 19])  # 19: the MXFP8 GEMM's result is a padded one's slice
def test_output_is_not_a_view(name, lead, n_out):
    """The output is a tensor of its own, not a view of the GEMM's result (FSDP2 warns about a
    module output that is a view: an in-place op on it would skip FSDP2's pre-backward hook), in
    every mode; an in-place op on it gives the gradients of the same op out of place."""
    layer = fp8ops.FP8Linear(64, n_out, recipe=RECIPES[name])
    twin = copy.deepcopy(layer)
    x = torch.randn(*lead, 64, requires_grad=True)
    y = layer(x)
    assert y._base is None and y.shape == (*lead, n_out)
    with torch.no_grad():
        assert layer(x)._base is None
    with torch.inference_mode():
        assert layer(x)._base is None
    dy = torch.randn(y.shape)
    y.mul_(2).backward(dy)
    xt = x.detach().requires_grad_()
    (twin(xt) * 2).backward(dy)
    assert torch.equal(x.grad, xt.grad)
    for p, q in zip(layer.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("name", list(RECIPES))
def test_zero_size_forward_and_backward(name):
    w = torch.nn.Parameter(torch.randn(24, 64))
    b = torch.nn.Parameter(torch.randn(24))
    x = torch.randn(0, 5, 64, requires_grad=True)
    y = fp8ops.linear(x, w, b, state=fp8ops.ScalingState(RECIPES[name]))
    assert y.shape == (0, 5, 24)
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("n_in, n_out, lead", [
    (0, 8, (4,)), (0, 8, (2, 3)), (0, 8, ()), (0, 8, (0,)), (0, 0, (4,)),  # no input features
    (16, 8, (0,)), (16, 8, (3, 0)),  # empty batch
    (16, 0, (4,)),  # no output features
], ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
def test_empty_dimensions_match_nn_linear(name, n_in, n_out, lead, bias):
    """Forward and backward of FP8Linear with a zero-size dimension equal nn.Linear's: with no
    input features the output is the bias broadcast (or zeros), the weight gradient a zero
    [out, 0] and the bias gradient the sum of the incoming gradient."""
    layer = fp8ops.FP8Linear(n_in, n_out, bias=bias, recipe=RECIPES[name])
    ref = torch.nn.Linear(n_in, n_out, bias=bias)
    with torch.no_grad():
        for p, q in zip(layer.parameters(), ref.parameters()):
            p.uniform_(-1, 1)  # (nn.Linear's init leaves a bias with fan-in 0 at zero)
            q.copy_(p)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*lead, n_in, generator=gen)
    dy = torch.randn(*lead, n_out, generator=gen)
    results = []
    for lin in (layer, ref):
        xr = x.clone().requires_grad_()
        y = lin(xr)
        y.backward(dy)
        results.append((y, xr.grad) + tuple(p.grad for p in lin.parameters()))
    for got, want in zip(*results):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(got, want)


def test_nan_input_propagates_and_is_counted():
    st = fp8ops.ScalingState(fp8ops.DelayedScaling())
    w = torch.randn(8, 32)
    x = torch.randn(4, 32)
    x[1, 3] = float("nan")
    y = fp8ops.linear(x, w, state=st)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2, 3]]).all()
    assert st.input.nonfinite_count.item() == 1 and st.input.pending_amax.item() == 0.0


@pytest.mark.parametrize("call, err, match", [
    (lambda: fp8ops.linear(torch.randn(4, 8), torch.randn(3, 9)), ValueError, "in_features=9"),
    (lambda: fp8ops.linear(torch.randn(4, 8), torch.randn(8)), ValueError, "2-D"),
    (lambda: fp8ops.linear(torch.randn(4, 8).long(), torch.randn(3, 8)), TypeError, "input must"),
    (lambda: fp8ops.linear(torch.randn(4, 8), torch.randn(3, 8), torch.randn(4)), ValueError,
     r"bias must be a tensor of shape \(3,\)"),
    (lambda: fp8ops.linear(torch.randn(4, 8), torch.randn(3, 8), recipe="fp8"), TypeError,
     "recipe must be"),
    (lambda: fp8ops.linear(torch.randn(4, 8), torch.randn(3, 8), recipe=fp8ops.DelayedScaling()),
     ValueError, "pass state="),
    (lambda: fp8ops.linear(torch.randn(4, 8), torch.randn(3, 8),
                           recipe=fp8ops.CurrentScaling(grad_rounding="stochastic")),
     ValueError, "needs a state"),
    (lambda: fp8ops.linear(torch.randn(4, 8), torch.randn(3, 8), recipe=fp8ops.MXFP8Scaling(),
                           state=fp8ops.ScalingState(fp8ops.CurrentScaling())),
     ValueError, "differs from the state's recipe"),
    (lambda: fp8ops.linear(torch.randn(4, 8), torch.randn(3, 8, device="meta")), ValueError,
     "input is on cpu but weight is on meta"),
])
def test_bad_arguments_name_the_problem(call, err, match):
    with pytest.raises(err, match=match):
        call()


@pytest.mark.parametrize("name", ["current", "delayed", "mxfp8", "blockwise"])
def test_weight_cache_tells_a_transposed_view_from_the_weight(name):
    recipe = RECIPES[name]
    w = torch.randn(64, 64)
    x = torch.randn(4, 64)
    st = fp8ops.ScalingState(recipe)
    fp8ops.linear(x, w, state=st)
    ref_state = fp8ops.ScalingState(recipe)  # the same state, without the cached cast of w
    ref_state.load_state_dict(st.state_dict())
    ref_state.weight_cache.invalidate()
    got = fp8ops.linear(x, w.t(), state=st)  # same storage, version and shape; other strides
    assert torch.equal(got, fp8ops.linear(x, w.t(), state=ref_state))
    assert not torch.equal(got, fp8ops.linear(x, w, state=st))


def _autocast_step(recipe, device, autocast: bool, dtype=torch.bfloat16):
    """One FP8Linear training step on float32 parameters and input, under autocast or not, with
    the same bf16-valued output gradient. Returns (y, x.grad, weight.grad, bias.grad)."""
    torch.manual_seed(0)
    layer = fp8ops.FP8Linear(96, 80, recipe=recipe, fallback="never", device=device)
    x = (torch.randn(3, 40, 96, device=device) * 2).requires_grad_()
    with torch.autocast(device, dtype=dtype, enabled=autocast):
        y = layer(x)
    dy = torch.randn(y.shape, device=device).to(dtype)  # what a bf16 graph sends back
    y.backward(dy if autocast else dy.float())
    return y, x.grad, layer.weight.grad, layer.bias.grad


@pytest.mark.parametrize("name", list(RECIPES))
def test_autocast_output_dtype_follows_nn_linear(name):
    """Under torch.autocast an FP8 layer returns the autocast dtype, as nn.Linear does (a float32
    output would make every op downstream run, and save its activations, in float32), with the
    same values as the float32 step rounded once; the gradients keep the parameters' and the
    input's dtype and are those of the same step without autocast."""
    ref = torch.nn.Linear(96, 80)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ref(torch.randn(2, 96)).dtype == torch.bfloat16  # what FP8Linear must match
    recipe = RECIPES[name]
    y, dx, dw, db = _autocast_step(recipe, "cpu", autocast=True)
    y32, dx32, dw32, db32 = _autocast_step(recipe, "cpu", autocast=False)
    assert y.dtype == torch.bfloat16 and y32.dtype == torch.float32
    assert (dx.dtype, dw.dtype, db.dtype) == (torch.float32,) * 3
    assert y.isfinite().all() and y.abs().sum() > 0
    torch.testing.assert_close(y, y32.to(torch.bfloat16), rtol=0, atol=0)
    for got, want in ((dx, dx32), (dw, dw32), (db, db32)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_without_autocast_the_output_keeps_the_input_dtype():
    layer = fp8ops.FP8Linear(32, 16, fallback="never")
    x = torch.randn(4, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert layer(x).dtype == torch.float32
    assert layer(x.to(torch.bfloat16)).dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.float16):
        assert layer(x).dtype == torch.float16
