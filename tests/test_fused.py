"""The fused per-tensor casts (ops quantize_current / quantize_delayed): each is, byte for byte and
buffer for buffer, the unfused sequence it replaces (scaling.RoleState's update, warm scale and
record around ops.quantize; current_scale), on the CPU's host path and on the tensor formulas a
GPU takes; and passes opcheck (the buffers it changes are declared in its schema)."""
import contextlib
import itertools

import pytest
import torch

import fp8ops
from fp8ops.ops import emulation, fused
from fp8ops.scaling import RoleState, current_scale

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
OPS = torch.ops.fp8ops


@contextlib.contextmanager
def device_path(on: bool):
    """on: the emulation takes the tensor formulas a GPU tensor takes (no host fast path)."""
    saved = emulation._on_host
    if on:
        emulation._on_host = lambda t: False
    try:
        yield
    finally:
        emulation._on_host = saved


def _inputs():
    x = torch.randn(24, 40) * 3
    special = x.clone()
    special[0, :4] = torch.tensor([float("nan"), 0.0, -0.0, 1e-30])
    with_inf = x.clone()
    with_inf[3, 5] = float("inf")
    return {"random": x, "bf16": (x * 50).bfloat16(), "tiny": x * 1e-12, "huge": x * 1e30,
            "nan": special, "inf": with_inf, "zeros": torch.zeros(5, 8),
            "empty": torch.empty(0, 8)}


INPUTS = _inputs()


def _role(seed: int, history: int = 6) -> RoleState:
    """A role in the middle of training: history, scale, pending amax and counters set."""
    g = torch.Generator().manual_seed(seed)
    role = RoleState(history)
    with torch.no_grad():
        role.amax_history.copy_(torch.rand(history, generator=g) * 8)
        role.scale.fill_(float(torch.rand((), generator=g)) * 30 + 0.5)
        role.scale_inv.copy_(1 / role.scale)
        role.amax_rep.fill_(3.0)
        role.pending_amax.fill_(float(torch.rand((), generator=g)) * 6)
        role.step.fill_(int(torch.randint(0, 9, (), generator=g)))
        role.nonfinite_count.fill_(2)
    return role


def _equal(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    if a.dtype.itemsize == 1:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    assert torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan()) and
                                 torch.equal(a.nan_to_num(), b.nan_to_num())), what


def _unfused_delayed(x, role, recipe, dtype, margin, update, warm, record, sum_dtype, stochastic):
    """The sequence the training step ran before the casts were fused."""
    fmt = fp8ops.formats.get_format(dtype)
    if update:
        role.update(recipe, fmt, margin)
    scale = role.warm_scale(x, fmt, margin, recipe) if warm else role.scale.clone()
    data, data_t, amax = OPS.quantize(x, scale, dtype, True, stochastic, 5, 7)
    if record:
        role.record(amax)
    sums = (torch.empty(0) if sum_dtype is None
            else x.reshape(-1, x.shape[-1]).sum(0, dtype=torch.float32).to(sum_dtype))
    return data, data_t, scale, torch.reciprocal(scale), sums


FLAGS = [(u, w, r) for u, w, r in itertools.product((False, True), repeat=3)]


@pytest.mark.parametrize("gpu_formulas", [False, True], ids=["host", "device_formulas"])
@pytest.mark.parametrize("name", sorted(INPUTS))
@pytest.mark.parametrize("algo, interval", [("max", 1), ("most_recent", 2), ("ema", 1),
                                            ("percentile", 3)])
def test_quantize_delayed_is_the_unfused_sequence(gpu_formulas, name, algo, interval):
    x = INPUTS[name]
    recipe = fp8ops.DelayedScaling(amax_history_len=6, amax_compute_algo=algo, interval=interval,
                                   margin=1.5, power_of_two=algo == "ema")
    for i, (update, warm, record) in enumerate(FLAGS):
        dtype = E5 if i % 2 else E4
        sum_dtype = (None, torch.float32, torch.bfloat16)[i % 3] if x.shape[0] else None
        stochastic = i % 4 == 3
        ref_role, role = _role(i), _role(i)
        with device_path(gpu_formulas):
            ref = _unfused_delayed(x, ref_role, recipe, dtype, recipe.margin, update, warm,
                                   record, sum_dtype, stochastic)
            got = OPS.quantize_delayed(
                x, role.amax_history, role.scale, role.scale_inv, role.amax_rep,
                role.pending_amax, role.step, role.nonfinite_count, dtype, recipe.margin,
                recipe.interval, algo, recipe.ema_alpha, recipe.percentile, recipe.power_of_two,
                update, warm, record, True, sum_dtype, stochastic, 5, 7)
        case = (name, algo, update, warm, record)
        for k, (a, b) in enumerate(zip(got, ref)):
            if k == 4 and sum_dtype is None:
                assert a.numel() == 0
                continue
            _equal(a.reshape(b.shape) if k < 4 else a, b, case + (k,))
        for buf in ("amax_history", "scale", "scale_inv", "amax_rep", "pending_amax", "step",
                    "nonfinite_count"):
            _equal(getattr(role, buf), getattr(ref_role, buf), case + (buf,))


@pytest.mark.parametrize("gpu_formulas", [False, True], ids=["host", "device_formulas"])
@pytest.mark.parametrize("name", sorted(INPUTS))
@pytest.mark.parametrize("dtype, margin, p2", [(E4, 1.0, False), (E5, 2.0, True)])
def test_quantize_current_is_the_unfused_sequence(gpu_formulas, name, dtype, margin, p2):
    x = INPUTS[name]
    with device_path(gpu_formulas):
        scale = current_scale(OPS.amax(x), dtype, margin, p2)
        data, data_t, _ = OPS.quantize(x, scale, dtype, True, False, 0, 0)
        got = OPS.quantize_current(x, dtype, margin, p2, True, torch.bfloat16)
    for k, ref in enumerate((data, data_t, scale, torch.reciprocal(scale))):
        _equal(got[k], ref, (name, k))
    _equal(got[4], x.sum(0, dtype=torch.float32).bfloat16(), (name, "sums"))


def test_record_counts_a_non_finite_amax_and_keeps_pending():
    role = _role(0)
    pending, count = role.pending_amax.clone(), int(role.nonfinite_count)
    x = INPUTS["inf"]
    OPS.quantize_delayed(x, role.amax_history, role.scale, role.scale_inv, role.amax_rep,
                         role.pending_amax, role.step, role.nonfinite_count, E4, 1.0, 1, "max",
                         0.1, 99.0, False, False, False, True)
    assert torch.equal(role.pending_amax, pending)
    assert int(role.nonfinite_count) == count + 1
    big = torch.full((4, 4), 1000.0)
    OPS.quantize_delayed(big, role.amax_history, role.scale, role.scale_inv, role.amax_rep,
                         role.pending_amax, role.step, role.nonfinite_count, E4, 1.0, 1, "max",
                         0.1, 99.0, False, False, False, True)
    assert float(role.pending_amax) == 1000.0 and int(role.nonfinite_count) == count + 1


def test_outputs_are_new_tensors_not_the_buffers():
    """The scale a cast used is kept for backward: the role's buffer moves on at the next
    update, the returned scale must not."""
    role = _role(1)
    x = INPUTS["random"]
    out = OPS.quantize_delayed(x, role.amax_history, role.scale, role.scale_inv, role.amax_rep,
                               role.pending_amax, role.step, role.nonfinite_count, E4, 1.0, 1,
                               "max", 0.1, 99.0, False, True, False, False)
    used = out[2].clone()
    role.scale.mul_(4)
    assert torch.equal(out[2], used)


def _delayed_args(x, dtype=E4, update=True, warm=False, record=True, transpose=True,
                  sum_dtype=None, stochastic=False):
    role = _role(3)
    return (x, role.amax_history, role.scale, role.scale_inv, role.amax_rep, role.pending_amax,
            role.step, role.nonfinite_count, dtype, 1.0, 2, "max", 0.1, 99.0, False, update,
            warm, record, transpose, sum_dtype, stochastic, 1, 2)


OPCHECK_SAMPLES = [
    ("quantize_current", (torch.randn(6, 64) * 3, E4, 1.0, False)),
    ("quantize_current", (torch.randn(6, 64).bfloat16(), E5, 2.0, True, True, torch.bfloat16,
                          True, 3, 4)),
    ("quantize_current", (torch.empty(0, 5), E4, 1.0, False, True, torch.float32)),
    ("quantize_delayed", _delayed_args(torch.randn(6, 64))),
    ("quantize_delayed", _delayed_args(torch.randn(6, 64).bfloat16(), E5, False, True, True,
                                       True, torch.bfloat16, True)),
    ("quantize_delayed", _delayed_args(torch.randn(6, 64), update=False, record=False,
                                       transpose=False)),
]


@pytest.mark.parametrize("name, args", OPCHECK_SAMPLES, ids=lambda v: v if isinstance(v, str) else "")
def test_opcheck(name, args):
    torch.library.opcheck(getattr(OPS, name).default, args,
                          test_utils=["test_schema", "test_autograd_registration",
                                      "test_faketensor", "test_aot_dispatch_dynamic"])


def test_column_sums_need_a_dimension():
    with pytest.raises(ValueError, match="at least one dimension"):
        fused.column_sums(torch.tensor(1.0), torch.float32)
    assert fused.column_sums(torch.tensor(1.0), None).numel() == 0


def test_fused_cast_under_torch_compile_matches_eager():
    """The buffers a compiled step changes are the eager ones (the mutations are functionalized
    and written back)."""
    def step(x, role):
        return OPS.quantize_delayed(
            x, role.amax_history, role.scale, role.scale_inv, role.amax_rep, role.pending_amax,
            role.step, role.nonfinite_count, E4, 1.0, 1, "max", 0.1, 99.0, False, True, False,
            True, True, torch.float32)

    x = torch.randn(16, 32) * 5
    eager_role, compiled_role = _role(4), _role(4)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for i in range(3):
        ref, got = step(x * (i + 1), eager_role), compiled(x * (i + 1), compiled_role)
        for a, b in zip(got, ref):
            _equal(a, b, i)
    for buf in ("amax_history", "scale", "scale_inv", "amax_rep", "pending_amax", "step",
                "nonfinite_count"):
        _equal(getattr(compiled_role, buf), getattr(eager_role, buf), buf)


BLOCK_INPUTS = {"aligned": torch.randn(256, 384) * 4, "ragged": torch.randn(130, 70) * 4,
                "bf16": (torch.randn(128, 256) * 100).bfloat16(), "nan": INPUTS["nan"],
                "empty": torch.empty(0, 64)}


@pytest.mark.parametrize("name", sorted(BLOCK_INPUTS))
@pytest.mark.parametrize("dtype, p2", [(E4, False), (E5, True)])
def test_quantize_blockwise_pair_is_both_casts(name, dtype, p2):
    x = BLOCK_INPUTS[name]
    got = OPS.quantize_blockwise_pair(x, dtype, p2, torch.bfloat16)
    ref = (*OPS.quantize_blockwise(x, dtype, 1, 128, p2),
           *OPS.quantize_blockwise(x.t(), dtype, 1, 128, p2),
           x.sum(0, dtype=torch.float32).bfloat16())
    for k, (a, b) in enumerate(zip(got, ref)):
        _equal(a, b, (name, k))
    # the scales as the Hopper GEMM reads them: rows contiguous
    assert got[1].t().is_contiguous() and got[3].t().is_contiguous()
    if min(got[1].shape) > 1:  # (a dimension of one or none has no meaningful stride)
        assert got[1].stride() == (1, x.shape[0])


@pytest.mark.parametrize("name", sorted(BLOCK_INPUTS))
@pytest.mark.parametrize("dtype, rceil", [(E4, False), (E5, True)])
def test_quantize_mx_pair_is_both_casts_of_the_padded_input(name, dtype, rceil):
    x = BLOCK_INPUTS[name]
    m, k = x.shape
    xp = torch.zeros(-(-m // 32) * 32, -(-k // 32) * 32, dtype=x.dtype)
    xp[:m, :k] = x
    got = OPS.quantize_mx_pair(x, dtype, 32, rceil, torch.float32)
    ref = (*OPS.quantize_mx(xp[:m], dtype, 32, 1, rceil), *OPS.quantize_mx(xp, dtype, 32, 0, rceil),
           x.sum(0, dtype=torch.float32))
    for i, (a, b) in enumerate(zip(got, ref)):
        _equal(a, b, (name, i))


@pytest.mark.parametrize("op", ["quantize_blockwise_pair", "quantize_mx_pair"])
def test_pairs_need_a_matrix(op):
    args = (E4, False) if op == "quantize_blockwise_pair" else (E4, 32, False)
    with pytest.raises(ValueError, match="must be 2-D"):
        getattr(OPS, op)(torch.randn(4, 4, 4), *args)


@pytest.mark.parametrize("name, args", [
    ("quantize_blockwise_pair", (torch.randn(130, 200) * 3, E4, False)),
    ("quantize_blockwise_pair", (torch.randn(64, 128).bfloat16(), E5, True, torch.bfloat16)),
    ("quantize_mx_pair", (torch.randn(40, 70) * 3, E4, 32, False, torch.float32)),
    ("quantize_mx_pair", (torch.randn(64, 64).bfloat16(), E5, 32, True)),
], ids=lambda v: v if isinstance(v, str) else "")
def test_opcheck_pairs(name, args):
    torch.library.opcheck(getattr(OPS, name).default, args,
                          test_utils=["test_schema", "test_autograd_registration",
                                      "test_faketensor", "test_aot_dispatch_dynamic"])


@pytest.mark.parametrize("op", ["quantize_current", "quantize_delayed"])
def test_stochastic_cast_reads_and_advances_the_rng_buffer(op):
    """With rng, a stochastic cast rounds with the stream [seed, offset] it holds (the bytes of
    the same cast given seed and offset as ints) and advances the offset by one; a nearest cast
    leaves it alone."""
    x = INPUTS["random"] * 7.3  # values between FP8 neighbours: the rounding shows

    def run(stochastic, seed, offset, rng):
        if op == "quantize_current":
            return OPS.quantize_current(x, E5, 1.0, False, True, None, stochastic, seed, offset,
                                        rng)
        role = _role(2)
        return OPS.quantize_delayed(x, role.amax_history, role.scale, role.scale_inv,
                                    role.amax_rep, role.pending_amax, role.step,
                                    role.nonfinite_count, E5, 1.0, 1, "max", 0.1, 99.0, False,
                                    True, False, True, True, None, stochastic, seed, offset, rng)

    rng = torch.tensor([-5, 2 ** 33 + 3])
    got = run(True, 0, 0, rng)
    assert rng.tolist() == [-5, 2 ** 33 + 4]
    ref = run(True, -5, 2 ** 33 + 3, None)
    for k in range(4):
        _equal(got[k], ref[k], k)
    assert not torch.equal(got[0].view(torch.uint8), run(True, -5, 2 ** 33 + 4, None)[0]
                           .view(torch.uint8))  # the next offset is another stream
    run(False, 0, 0, rng)
    assert rng.tolist() == [-5, 2 ** 33 + 4]


def test_quantize_takes_its_random_stream_from_rng():
    x = INPUTS["random"] * 7.3
    s = torch.tensor(3.0)
    rng = torch.tensor([11, 4])
    a = OPS.quantize(x, s, E4, True, True, 0, 0, rng)
    b = OPS.quantize(x, s, E4, True, True, 11, 4)
    for k in range(3):
        _equal(a[k], b[k], k)
    assert rng.tolist() == [11, 4]  # quantize itself only reads it
    with pytest.raises(ValueError, match="int64 tensor"):
        OPS.quantize(x, s, E4, True, True, 0, 0, torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("name, args", [
    ("quantize", (torch.randn(6, 64), torch.tensor(2.0), E5, True, True, 0, 0,
                  torch.tensor([3, 9]))),
    ("quantize_current", (torch.randn(6, 64), E5, 1.0, False, True, None, True, 0, 0,
                          torch.tensor([3, 9]))),
    ("quantize_delayed", _delayed_args(torch.randn(6, 64), stochastic=True)[:-2]
     + (0, 0, torch.tensor([3, 9]))),
], ids=lambda v: v if isinstance(v, str) else "")
def test_opcheck_with_rng(name, args):
    tests = ["test_schema", "test_autograd_registration", "test_faketensor",
             "test_aot_dispatch_dynamic"]
    torch.library.opcheck(getattr(OPS, name).default, args, test_utils=tests)
