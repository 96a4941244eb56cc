"""fp8ops.monitor / fp8ops.stats: sampled statistics of the FP8 casts, exact on planted data; the
recipe options they motivate (grad_margin, amax_percentile); the FP8 state's repr."""
import numpy as np
import pytest
import torch
from torch import nn

import fp8ops
from fp8ops.ops import emulation
from fp8ops.nn import cast_stats as mon_mod

RECIPES = [fp8ops.CurrentScaling(), fp8ops.DelayedScaling(), fp8ops.MXFP8Scaling(),
           fp8ops.BlockwiseScaling()]


def _model(recipe):
    torch.manual_seed(0)
    return fp8ops.convert_to_fp8(nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 40)),
                                 recipe)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_every_layer_and_role_is_reported(recipe):
    m = _model(recipe)
    fp8ops.monitor(m, every=1)
    m(torch.randn(8, 64)).square().mean().backward()
    s = fp8ops.stats(m)
    for layer in ("0", "2"):
        for role in ("input", "weight", "grad"):
            for stat in ("amax", "saturated_frac", "underflow_frac", "nonfinite", "nonfinite_casts"):
                assert f"{layer}.{role}.{stat}" in s, (layer, role, stat)
    per_tensor = isinstance(recipe, (fp8ops.CurrentScaling, fp8ops.DelayedScaling))
    assert ("0.input.scale" in s) == per_tensor
    assert ("0.input.block_scale_log2_spread" in s) == (not per_tensor)
    assert ("0.input.amax_history_max" in s) == isinstance(recipe, fp8ops.DelayedScaling)
    assert all(isinstance(v, float) for v in s.values())


def test_saturation_and_underflow_are_counted_exactly():
    """With scale 1 (a first forward of amax 448 sets it): |x| > 448 saturates, |x| <= 2^-10
    flushes."""
    layer = fp8ops.FP8Linear(16, 8, recipe=fp8ops.DelayedScaling())
    m = nn.Sequential(layer)
    fp8ops.monitor(m, every=1)
    m(torch.full((4, 16), 448.0))
    x = torch.randn(4, 16).clamp(-3, 3)
    x[0, :3] = torch.tensor([1000.0, -600.0, 449.0])  # 449 rounds to 448: not a clamp
    x[1, :5] = torch.tensor([1e-10, -2.0 ** -10, 2.0 ** -11, 3e-4, -1e-6])
    m(x)
    s = fp8ops.stats(m)
    assert s["0.input.saturated_frac"] == pytest.approx(2 / 64)
    assert s["0.input.underflow_frac"] == pytest.approx(5 / 64)
    assert s["0.input.amax"] == 1000.0
    assert s["0.input.scale"] == 1.0
    assert s["0.input.nonfinite"] == 0.0


def test_block_scale_spread():
    m = nn.Sequential(fp8ops.FP8Linear(64, 8, recipe=fp8ops.MXFP8Scaling()))
    fp8ops.monitor(m, every=1)
    x = torch.ones(2, 64)
    x[1] *= 2.0 ** 8  # its two blocks sit 8 binades above the first row's
    m(x)
    s = fp8ops.stats(m)
    assert s["0.input.block_scale_log2_spread"] == 8.0


def test_sampling_every_n_forwards():
    m = _model(fp8ops.CurrentScaling())
    mon = fp8ops.monitor(m, every=3)
    amaxes = []
    for i in range(7):
        x = torch.full((4, 64), float(i + 1))
        m(x).sum().backward()
        amaxes.append(fp8ops.stats(m)["0.input.amax"])
    # forwards 1, 4 and 7 are sampled: the stats hold the last sampled batch's amax
    assert amaxes == [1.0, 1.0, 1.0, 4.0, 4.0, 4.0, 7.0]
    assert mon.forwards == 7


def test_nonfinite_is_counted_and_can_raise():
    m = _model(fp8ops.CurrentScaling())
    fp8ops.monitor(m, every=1)
    x = torch.randn(4, 64)
    x[0, 0] = float("inf")
    x[1, 1] = float("nan")
    m(x)
    s = fp8ops.stats(m)
    assert s["0.input.nonfinite"] == 2.0 and s["0.input.nonfinite_casts"] == 1.0
    fp8ops.monitor(m, every=1, raise_on_nonfinite=True)
    with pytest.raises(FloatingPointError, match=r"input of FP8 layer '0'"):
        m(x)


@pytest.mark.parametrize("recipe", [fp8ops.CurrentScaling(), fp8ops.DelayedScaling()],
                         ids=lambda r: type(r).__name__)
def test_scale_is_the_one_the_cast_used(recipe):
    """Every tensor has amax 1, so the casts use scale = max / 1, whose float32 reciprocal does
    not invert back to it: the statistic must be the scale itself."""
    layer = fp8ops.FP8Linear(16, 8, recipe=recipe)
    m = nn.Sequential(layer)
    fp8ops.monitor(m, every=1)
    gen = torch.Generator().manual_seed(0)
    x, dy = torch.randn(4, 16, generator=gen), torch.randn(4, 8, generator=gen)
    x, dy = x / x.abs().max(), dy / dy.abs().max()
    with torch.no_grad():
        layer.weight.div_(layer.weight.abs().max())
    for _ in range(2):  # delayed scaling: the second step's casts use max / amax of the first's
        with torch.no_grad():
            layer.weight.mul_(1.0)  # a new weight version: recast (and step the weight role)
        m(x).backward(dy)
    s = fp8ops.stats(m)
    fwd, bwd = fp8ops.E4M3.max, fp8ops.E5M2.max
    for role, fmax in (("input", fwd), ("weight", fwd), ("grad", bwd)):
        assert torch.reciprocal(torch.reciprocal(torch.tensor(fmax))).item() != fmax
        assert s[f"0.{role}.scale"] == fmax, role


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_nonfinite_casts_count_the_current_cast(recipe):
    """Three training steps whose input, weight and gradient each hold a NaN: every role has met
    non-finite values in three casts (DelayedScaling counts every cast; here every one is
    sampled)."""
    layer = fp8ops.FP8Linear(64, 32, recipe=recipe)
    m = nn.Sequential(layer)
    fp8ops.monitor(m, every=1)
    x, dy = torch.randn(4, 64), torch.randn(4, 32)
    x[0, 0] = dy[1, 1] = float("nan")
    counts = []
    for _ in range(3):
        with torch.no_grad():
            layer.weight[2, 3] = float("nan")  # a new weight version: cast again
        m(x).backward(dy)
        s = fp8ops.stats(m)
        counts.append([s[f"0.{role}.nonfinite_casts"] for role in ("input", "weight", "grad")])
    assert counts == [[1.0] * 3, [2.0] * 3, [3.0] * 3]


def test_off_computes_nothing_and_stats_needs_a_monitor(monkeypatch):
    m = _model(fp8ops.CurrentScaling())
    with pytest.raises(ValueError, match="no monitor"):
        fp8ops.stats(m)
    calls = []
    monkeypatch.setattr(mon_mod, "observe", lambda *a: calls.append(a))
    m(torch.randn(4, 64)).sum().backward()
    assert calls == []
    fp8ops.monitor(m, every=1)
    fp8ops.unmonitor(m)
    m(torch.randn(4, 64)).sum().backward()
    assert calls == [] and m[0].fp8_state.monitor is None
    with pytest.raises(ValueError, match="no FP8 layers"):
        fp8ops.monitor(nn.Linear(3, 3))
    with pytest.raises(ValueError, match="every"):
        fp8ops.monitor(m, every=0)


def test_monitoring_does_not_change_training():
    a, b = _model(fp8ops.DelayedScaling()), _model(fp8ops.DelayedScaling())
    fp8ops.monitor(b, every=2)
    for step in range(4):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
        ya, yb = a(x), b(x)
        ya.square().mean().backward()
        yb.square().mean().backward()
        assert torch.equal(ya, yb)
        assert torch.equal(a[0].weight.grad, b[0].weight.grad)


def test_repr_shows_scales_and_amaxes():
    layer = fp8ops.FP8Linear(8, 4, recipe=fp8ops.DelayedScaling())
    layer(torch.randn(2, 8) * 10)
    text = repr(layer.fp8_state)
    assert "scale=" in text and "pending_amax=" in text and "history=[" in text


# ---- recipe options ---------------------------------------------------------------------------
def test_grad_margin_scales_only_the_gradient():
    x = torch.randn(16, 32)
    w = torch.randn(8, 32)

    def grads(recipe):
        state = fp8ops.ScalingState(recipe)
        xr = x.clone().requires_grad_()
        y = fp8ops.linear(xr, w, state=state)
        y.backward(torch.randn(16, 8, generator=torch.Generator().manual_seed(3)) * 1e-3)
        return y, xr.grad

    y1, g1 = grads(fp8ops.CurrentScaling())
    y2, g2 = grads(fp8ops.CurrentScaling(grad_margin=3.0))  # not a power of two
    assert torch.equal(y1, y2)  # forward casts untouched
    assert not torch.equal(g1, g2)  # the gradient cast used another scale
    assert fp8ops.scaling.grad_margin(fp8ops.DelayedScaling(margin=2.0)) == 2.0
    assert fp8ops.scaling.grad_margin(fp8ops.DelayedScaling(margin=2.0, grad_margin=8.0)) == 8.0
    with pytest.raises(ValueError, match="grad_margin"):
        fp8ops.CurrentScaling(grad_margin=0.0)


@pytest.mark.parametrize("p", [50.0, 90.0, 99.0, 100.0, 12.5])
def test_amax_percentile_is_nearest_rank(p):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(int(p * 10)))
    got = emulation.amax_percentile(x, p)
    want = np.percentile(np.abs(x.numpy()), p, method="inverted_cdf")
    assert got.dtype == torch.float32 and got.item() == want


def test_amax_percentile_decimal_rank_and_specials():
    x = torch.arange(1, 10001, dtype=torch.float32)  # |x| sorted: rank k is value k
    assert emulation.amax_percentile(x, 99.99).item() == 9999.0  # not 10000 (float64 rounding)
    assert emulation.amax_percentile(-x, 100.0).item() == 10000.0
    y = x.clone()
    y[5] = float("nan")
    assert torch.isnan(emulation.amax_percentile(y, 50.0))
    assert emulation.amax_percentile(torch.empty(0), 99.0).item() == 0.0
    assert torch.ops.fp8ops.amax_percentile(x, 99.99).item() == 9999.0
    with pytest.raises(ValueError, match="amax_percentile"):
        fp8ops.CurrentScaling(amax_percentile=0.0)


def test_amax_percentile_of_a_mostly_zero_tensor_is_its_max():
    """Under 1% non-zeros: the 99th percentile of |x| is 0, which would keep scale 1 and flush
    these values to zero; the amax is max |x| instead (0 only for an all-zero tensor)."""
    x = torch.zeros(8, 125)
    x[0, :4] = torch.tensor([1e-4, -2e-4, 3e-4, -4e-4])  # below half of E4M3's least subnormal
    for fn in (emulation.amax_percentile, torch.ops.fp8ops.amax_percentile):
        assert fn(x, 99.0).item() == x.abs().max().item()
        assert fn(x, 50.0).item() == x.abs().max().item()
        assert fn(torch.zeros(8, 125), 99.0).item() == 0.0
    assert torch.isnan(emulation.amax_percentile(x.where(x != 0, float("nan")), 99.0))
    m = nn.Sequential(fp8ops.FP8Linear(125, 16, recipe=fp8ops.CurrentScaling(amax_percentile=99)))
    fp8ops.monitor(m, every=1)
    m(x)
    s = fp8ops.stats(m)
    assert s["0.input.underflow_frac"] == 0.0
    assert s["0.input.scale"] == fp8ops.scaling.current_scale(x.abs().max(), "e4m3").item()


def test_amax_percentile_lets_outliers_saturate():
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    x[0, 0] = 1000.0  # one outlier would set the scale alone
    w = torch.randn(16, 64)
    m = nn.Sequential(fp8ops.FP8Linear(64, 16, bias=False,
                                       recipe=fp8ops.CurrentScaling(amax_percentile=99.9)))
    m[0].weight.data.copy_(w)
    fp8ops.monitor(m, every=1)
    m(x)
    s = fp8ops.stats(m)
    assert s["0.input.amax"] == 1000.0
    assert s["0.input.scale"] == pytest.approx(448.0 / emulation.amax_percentile(x, 99.9).item())
    assert s["0.input.saturated_frac"] > 0


def test_evaluation_forwards_are_not_sampled():
    m = _model(fp8ops.CurrentScaling())
    mon = fp8ops.monitor(m, every=1)
    m(torch.full((4, 64), 2.0)).sum().backward()
    m.eval()
    with torch.no_grad():
        m(torch.full((4, 64), 5.0))
    m.train()
    assert mon.forwards == 1
    assert fp8ops.stats(m)["0.input.amax"] == 2.0


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_monitoring_an_offloaded_model_reads_the_host_weights(recipe):
    """Under CPUOffloadOptimizer the weight parameter is a placeholder: the weight statistics
    come from the master values, never from the placeholder's NaN."""
    m = _model(recipe)
    opt = fp8ops.CPUOffloadOptimizer(m.parameters(), torch.optim.AdamW, lr=1e-3)
    fp8ops.monitor(m, every=1, raise_on_nonfinite=True)
    for _ in range(2):
        m(torch.randn(8, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    s = fp8ops.stats(m)
    assert s["0.weight.nonfinite"] == 0.0 and s["0.weight.amax"] > 0


# ---------------------------------------------------------------------------------------------
# ops.cast_stats: the statistics in one op, with no full-size temporary
# ---------------------------------------------------------------------------------------------
def _reference_stats(x, dq, raw, fmt):
    """The statistics from full-size float32 tensors: what the op must count."""
    x = x.float()
    finite = torch.isfinite(x)
    margin = 1 + 2.0 ** -(fmt.mbits + 1)
    saturated = finite & (raw.abs() == fmt.max) & (x.abs() > dq.abs() * margin)
    underflow = finite & (x != 0) & (dq == 0)
    amax = x.abs().amax() if x.numel() else torch.zeros(())
    return [int(saturated.sum()), int(underflow.sum()), int((~finite).sum())], amax


def _planted(shape, dtype=torch.float32, seed=0):
    """Values that saturate, underflow, and are NaN and inf, among ordinary ones."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 4
    flat = x.view(-1)
    idx = torch.randperm(flat.numel(), generator=g)
    n = flat.numel() // 20
    flat[idx[:n]] *= 500  # saturate (and stay finite in float16)
    flat[idx[n:2 * n]] *= 1e-5  # underflow (and stay non-zero in float16)
    flat[idx[2 * n]] = float("inf")
    flat[idx[2 * n + 1]] = float("nan")
    return x.to(dtype)


def _cases():
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    out = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = _planted((70, 300), dtype)
        s = torch.tensor(2.0)
        data = emulation.quantize(x, s, e4)[0]
        out.append(("per-tensor", x, data, torch.reciprocal(s), 0, 0,
                    lambda d, x=x: emulation.dequantize(d, torch.tensor(0.5), torch.float32)))
    x = _planted((70, 300))
    data, sinv = emulation.quantize_blockwise(x, e5, 1, 128, False)
    out.append(("blockwise 1x128", x, data, sinv, 1, 128,
                lambda d, s=sinv: emulation.dequantize_blockwise(d, s, 1, 128, torch.float32)))
    xt = _planted((300, 70)).t()  # a transposed view, as the gradient's column copy
    data, sinv = emulation.quantize_blockwise(xt, e4, 128, 128, False)
    out.append(("blockwise 128x128, transposed", xt, data, sinv, 128, 128,
                lambda d, s=sinv: emulation.dequantize_blockwise(d, s, 128, 128, torch.float32)))
    for axis in (1, 0):
        x = _planted((70, 300))
        xp = torch.nn.functional.pad(x, (0, 20, 0, 26))  # padded to whole blocks, as the layer
        data, scales = emulation.quantize_mx(xp, e4, 32, axis, False)
        blocks = (1, 32) if axis == 1 else (32, 1)
        out.append((f"mx axis {axis}, padded", x, data, scales, *blocks,
                    lambda d, s=scales, a=axis, x=x: emulation.dequantize_mx(
                        d, s, 32, a, torch.float32)[:x.shape[0], :x.shape[1]]))
    return out


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu kernel", "pieces"])
@pytest.mark.parametrize("case", _cases(), ids=lambda c: c[0])
def test_cast_stats_counts_as_the_full_size_reference(case, kernels, monkeypatch):
    from fp8ops.formats import get_format
    from fp8ops.ops import cpu_kernels
    name, x, data, sinv, br, bc, dequant = case
    if kernels and not cpu_kernels.loaded():
        pytest.skip("fp8ops._cpu not built")
    if not kernels:
        monkeypatch.setitem(cpu_kernels._state, "loaded", False)
        monkeypatch.setattr(emulation, "STATS_PIECE", 1000)  # many pieces, ragged at the edges
    counts, amax = torch.ops.fp8ops.cast_stats(x, data, sinv, br, bc)
    fmt = get_format(data.dtype)
    raw = data[:x.shape[0], :x.shape[1]].float()
    want, want_amax = _reference_stats(x, dequant(data)[:x.shape[0], :x.shape[1]], raw, fmt)
    assert counts.tolist() == want, name
    # every kind planted is there to find (block scales leave nothing to saturate)
    assert want[1] > 0 and want[2] > 0 and (want[0] > 0 or br > 0), (name, want)
    assert torch.equal(amax, want_amax.float()) or (amax.isnan() and want_amax.isnan()), name
    finite = x.float().nan_to_num(0.0, 0.0, 0.0)
    c2, a2 = torch.ops.fp8ops.cast_stats(finite.to(x.dtype), data, sinv, br, bc)
    assert torch.equal(a2, finite.abs().amax().float()), name  # no NaN: the max itself


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu kernel", "pieces"])
def test_a_sampled_step_takes_no_more_memory(kernels, monkeypatch):
    """The monitor's statistics add at most 1% of the input's bytes to a step's peak with the
    CPU kernels (torch's MemTracker counts every tensor a step holds at once), and a bounded
    working set, whatever the size, in the emulation's pieces."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from fp8ops.ops import cpu_kernels
    if kernels and not cpu_kernels.loaded():
        pytest.skip("fp8ops._cpu not built")
    if not kernels:
        monkeypatch.setitem(cpu_kernels._state, "loaded", False)
        monkeypatch.setattr(emulation, "STATS_PIECE", 1 << 14)

    def peak(every):
        torch.manual_seed(0)
        layer = fp8ops.FP8Linear(1024, 1024, bias=False, dtype=torch.bfloat16)
        x = torch.randn(2048, 1024, dtype=torch.bfloat16, requires_grad=True)
        monitor = fp8ops.monitor(layer, every=every) if every else None
        layer(x).float().square().mean().backward()  # the monitor's first forward is sampled
        tracker = MemTracker()
        tracker.track_external(layer, x)
        with tracker:
            layer(x).float().square().mean().backward()
        del monitor
        return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]

    input_bytes = 2048 * 1024 * 2
    off, sampled = peak(None), peak(1)
    assert off > 3 * input_bytes  # (the step's own tensors are counted)
    bound = 0.01 * input_bytes if kernels else 32 * emulation.STATS_PIECE
    assert sampled - off <= bound, (sampled - off) / input_bytes
