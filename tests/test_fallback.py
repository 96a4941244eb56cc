"""The high-precision fallback of small layer calls (fp8ops/nn/fallback.py): a call below the
crossover is nn.Linear's exactly and leaves the FP8 state as it was; the rule comes from the
layer option or, on a GPU, from the table measured for its model."""
import copy

import pytest
import torch
from torch import nn

import fp8ops
from fp8ops.nn import fallback

pytestmark = pytest.mark.measured_fallback  # these tests see the measured table

RECIPES = [fp8ops.CurrentScaling(), fp8ops.DelayedScaling(), fp8ops.MXFP8Scaling(),
           fp8ops.BlockwiseScaling()]
IDS = ["current", "delayed", "mxfp8", "blockwise"]


def _state_tensors(layer):
    """The scaling buffers and RNG (not weight_cast_scale: whether a cast is kept for reuse
    follows the weight's gradient, which this call writes, as any backward does)."""
    return {k: v.clone() for k, v in layer.fp8_state.state_dict().items()
            if k != "weight_cast_scale"}


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_a_small_call_is_nn_linear_and_touches_no_fp8_state(recipe):
    torch.manual_seed(0)
    ref = nn.Linear(64, 48)
    layer = fp8ops.FP8Linear.from_linear(copy.deepcopy(ref), recipe,
                                         fallback=fp8ops.Crossover(min_tokens=32))
    layer(torch.randn(40, 64)).sum().backward()  # FP8: state started, weight cast cached
    layer.zero_grad()
    before, cache = _state_tensors(layer), layer.fp8_state.weight_cache.entry
    x = torch.randn(2, 8, 64, requires_grad=True)  # 16 tokens: below the crossover
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = layer(x), ref(x_ref)
    assert torch.equal(y, y_ref)
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref.backward(dy)
    assert torch.equal(x.grad, x_ref.grad)
    assert torch.equal(layer.weight.grad, ref.weight.grad)
    assert torch.equal(layer.bias.grad, ref.bias.grad)
    after = _state_tensors(layer)
    assert all(torch.equal(before[k], after[k]) for k in before), "the FP8 state moved"
    assert layer.fp8_state.weight_cache.entry.payload is cache.payload  # the cast is kept
    assert layer.fp8_state.high_precision_calls == 1


def test_calls_at_the_crossover_run_fp8():
    torch.manual_seed(0)
    ref = nn.Linear(64, 48)
    rule = fp8ops.Crossover(min_tokens=32, min_in_features=64, min_out_features=48)
    layer = fp8ops.FP8Linear.from_linear(copy.deepcopy(ref), fp8ops.DelayedScaling(),
                                         fallback=rule)
    x = torch.randn(32, 64) * 3
    y = layer(x)
    assert not torch.equal(y, ref(x))  # FP8 rounding shows
    assert layer.fp8_state.input.step.item() == 1 and layer.fp8_state.high_precision_calls == 0
    assert torch.equal(y, fp8ops.FP8Linear.from_linear(copy.deepcopy(ref),
                                                       fp8ops.DelayedScaling())(x))
    wide = fp8ops.FP8Linear(64, 48, fallback=fp8ops.Crossover(min_out_features=49))
    wide(x)
    assert wide.fp8_state.high_precision_calls == 1


def test_mixed_precision_input_falls_back_in_the_input_dtype():
    layer = fp8ops.FP8Linear(32, 16, fallback=fp8ops.Crossover(min_tokens=100))
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16
    ref = nn.functional.linear(x, layer.weight.bfloat16(), layer.bias.bfloat16())
    assert torch.equal(y, ref)


def test_conv1d_falls_back_with_its_transposed_weight():
    torch.manual_seed(0)
    layer = fp8ops.FP8Conv1D(24, 40, fallback=fp8ops.Crossover(min_tokens=100))
    x = torch.randn(3, 5, 40)
    assert torch.equal(layer(x), torch.addmm(layer.bias, x.reshape(-1, 40),
                                             layer.weight).reshape(3, 5, 24))


def test_auto_and_never_run_fp8_on_the_cpu_whatever_the_table(monkeypatch):
    monkeypatch.setitem(fallback.MEASURED, ("cpu", "CurrentScaling"),
                        fp8ops.Crossover(min_tokens=10 ** 9))
    for option in ("auto", "never"):
        layer = fp8ops.FP8Linear(32, 16, fallback=option)
        layer(torch.randn(4, 32))
        assert layer.fp8_state.high_precision_calls == 0


def test_auto_takes_the_row_measured_for_the_gpu_model_and_recipe(monkeypatch):
    h100 = "NVIDIA H100 80GB HBM3"
    rule = fp8ops.Crossover(min_tokens=2048, min_in_features=1024)
    mx_rule = fp8ops.Crossover(min_tokens=10 ** 9)  # e.g. never faster than bf16
    monkeypatch.setattr(fallback, "_device_name", lambda index: h100)
    monkeypatch.setitem(fallback.MEASURED, (h100, "CurrentScaling"), rule)
    monkeypatch.setitem(fallback.MEASURED, (h100, "MXFP8Scaling"), mx_rule)
    cuda = torch.device("cuda", 0)
    current, mx = fp8ops.CurrentScaling(), fp8ops.MXFP8Scaling()
    assert fallback.crossover("auto", cuda, current) is rule
    assert fallback.crossover("auto", cuda, mx) is mx_rule
    assert fallback.crossover("auto", cuda, fp8ops.DelayedScaling()) is None  # not measured
    assert fallback.crossover("never", cuda, current) is None
    assert fallback.crossover("auto", torch.device("cpu"), current) is None
    monkeypatch.setattr(fallback, "_device_name", lambda index: "a GPU nobody measured")
    assert fallback.crossover("auto", cuda, current) is None


@pytest.mark.parametrize("recipe, m, k, n, fp8", [
    (fp8ops.CurrentScaling(), 16384, 8192, 7168, True),
    (fp8ops.DelayedScaling(), 16384, 4096, 14336, True),
    (fp8ops.BlockwiseScaling(), 16384, 8192, 1280, False),  # measured 0.78x
    (fp8ops.CurrentScaling(), 8192, 4096, 4096, False),  # measured 0.94x
    (fp8ops.MXFP8Scaling(), 16384, 8192, 7168, False),  # measured 0.68x
])
def test_the_h200_rows_run_fp8_only_where_it_was_measured_faster(monkeypatch, recipe, m, k, n,
                                                                 fp8):
    monkeypatch.setattr(fallback, "_device_name", lambda index: "NVIDIA H200")
    rule = fallback.crossover("auto", torch.device("cuda", 0), recipe)
    assert rule is not None and rule.runs_fp8(m, k, n) == fp8


def test_convert_to_fp8_sets_the_fallback_and_stats_count_it():
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))
    rule = fp8ops.Crossover(min_in_features=32, min_out_features=16)
    fp8ops.convert_to_fp8(model, fallback=rule)
    assert [m.fallback for m in model if isinstance(m, fp8ops.FP8Linear)] == [rule, rule]
    fp8ops.monitor(model, every=1)
    model(torch.randn(4, 32)).sum().backward()
    s = fp8ops.stats(model)
    assert s["0.high_precision_calls"] == 0.0  # 32 -> 32 runs FP8
    assert s["2.high_precision_calls"] == 1.0  # 32 -> 8 falls back
    assert "0.input.amax" in s and "2.input.amax" not in s
    fp8ops.convert_to_fp8(model, fallback="never")
    assert all(m.fallback == "never" for m in model if isinstance(m, fp8ops.FP8Linear))
    assert "fallback=never" in repr(model[2])


@pytest.mark.parametrize("bad", ["sometimes", None, 3])
def test_a_bad_fallback_is_refused(bad):
    with pytest.raises(ValueError, match="fallback must be"):
        fp8ops.FP8Linear(8, 8, fallback=bad)
    with pytest.raises(ValueError, match="fallback must be"):
        fp8ops.convert_to_fp8(nn.Linear(8, 8), fallback=bad)


@pytest.mark.parametrize("field, value, error", [("min_tokens", -1, ValueError),
                                                 ("min_in_features", 2.5, TypeError),
                                                 ("min_out_features", True, TypeError)])
def test_crossover_checks_its_fields(field, value, error):
    with pytest.raises(error, match=field):
        fp8ops.Crossover(**{field: value})


def test_the_fallback_survives_deepcopy_and_keeps_state_dict_keys():
    layer = fp8ops.FP8Linear(16, 8, fallback=fp8ops.Crossover(min_tokens=4))
    clone = copy.deepcopy(layer)
    assert clone.fallback == layer.fallback
    assert set(layer.state_dict()) == set(fp8ops.FP8Linear(16, 8).state_dict())


@pytest.mark.gpu
def test_auto_follows_this_gpus_measured_rows():
    """On a GPU with a measured row, "auto" runs a call just under the row's crossover in high
    precision and one at the crossover in FP8, "never" runs both in FP8; for a recipe without a
    row on this GPU, "auto" runs FP8 at every shape."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    name = torch.cuda.get_device_name()
    for recipe in (fp8ops.CurrentScaling, fp8ops.DelayedScaling):
        rule = fallback.MEASURED.get((name, recipe.__name__))
        if rule is None:  # no row: a small call runs FP8 too
            k = n = 16
            calls = [("auto", 8, True)]
        else:
            k, n = max(rule.min_in_features, 16), max(rule.min_out_features, 16)
            calls = [("auto", rule.min_tokens, True), ("auto", rule.min_tokens - 1, False),
                     ("never", rule.min_tokens - 1, True)]
        for option, m, fp8 in calls:
            if m < 1:
                continue  # a row that runs every token count in FP8 has no call under it
            layer = fp8ops.FP8Linear(k, n, recipe=recipe(), device="cuda",
                                     dtype=torch.bfloat16, fallback=option)
            layer(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
            assert layer.fp8_state.high_precision_calls == (0 if fp8 else 1), (name, recipe,
                                                                                option, m)
