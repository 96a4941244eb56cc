"""fp8ops.monitor on a GPU: the statistics of a cast on CUDA are those of the same cast on the CPU
(with fp8ops._C, one kernel: csrc/stats.cu), and a sampled step's peak memory is an unsampled
one's within the statistics' bounded pieces. Skipped without an FP8 GPU."""
from __future__ import annotations

import pytest
import torch

import fp8ops
from fp8ops.ops import emulation
from test_monitor import _cases, _planted

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("needs a CUDA GPU with FP8 (sm_89+)", allow_module_level=True)


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c[0])
def test_cast_stats_on_cuda_are_the_cpus(case):
    name, x, data, sinv, br, bc, _ = case
    cpu = torch.ops.fp8ops.cast_stats(x, data, sinv, br, bc)
    gpu = torch.ops.fp8ops.cast_stats(x.cuda(), data.cuda(), sinv.cuda(), br, bc)
    assert gpu[0].cpu().tolist() == cpu[0].tolist(), name
    assert torch.equal(gpu[1].cpu(), cpu[1]) or (gpu[1].isnan() and cpu[1].isnan()), name


def test_a_sampled_step_takes_no_more_device_memory():
    def peak(every):
        torch.manual_seed(0)
        layer = fp8ops.FP8Linear(4096, 4096, bias=False, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        monitor = fp8ops.monitor(layer, every=every) if every else None
        layer(x).float().square().mean().backward()  # (the monitor samples its first forward)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        layer(x).float().square().mean().backward()
        torch.cuda.synchronize()
        del monitor
        return torch.cuda.max_memory_allocated()

    off, sampled = peak(None), peak(1)
    # the old statistics took about 13.5 bytes per input element: 430 MB here
    assert sampled - off <= 32 * emulation.STATS_PIECE, (sampled - off) / 2**20


# ---------------------------------------------------------------------------------------------
# The CUDA kernel (csrc/stats.cu): exactly the CPU op's counts and amax, in one kernel
# ---------------------------------------------------------------------------------------------
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
X_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MAX_BYTE = {E4: 0x7E, E5: 0x7B}  # +max; | 0x80: -max
NAN_BYTE = {E4: 0x7F, E5: 0x7F}
MARGIN = {E4: 1.0625, E5: 1.125}
# name: (block_rows, block_cols, scale kind)
LAYOUTS = {"per-tensor": (0, 0, "f32"), "mx 1x32": (1, 32, "e8m0"), "mx 32x1": (32, 1, "e8m0"),
           "blockwise 1x128": (1, 128, "f32"), "blockwise 128x128": (128, 128, "f32")}


def _poison_outputs():
    """Freed small-pool blocks (where the op's counts and amax come from) filled with 0xA5: an
    output the op does not zero reads garbage, not a plausible count or NaN."""
    junk = [torch.full((64,), 0xA5, dtype=torch.uint8, device="cuda") for _ in range(256)]
    del junk
    torch.cuda.synchronize()


def _same(gpu, cpu, what):
    counts, amax = gpu
    assert counts.device.type == "cuda" and amax.device.type == "cuda", what
    assert counts.dtype == torch.int64 and counts.shape == (3,), what
    assert amax.dtype == torch.float32 and amax.shape == (), what
    assert counts.cpu().tolist() == cpu[0].tolist(), what
    a, b = amax.cpu(), cpu[1]
    assert (a.isnan() and b.isnan()) or torch.equal(a.view(torch.int32), b.view(torch.int32)), \
        (what, a.item(), b.item())


def _check(x, data, sinv, br, bc, what):
    """The CUDA op on (x, data, sinv) as given (views and all) against the CPU op on copies."""
    cpu = torch.ops.fp8ops.cast_stats(x.cpu(), data.cpu(), sinv.cpu(), br, bc)
    _poison_outputs()
    _same(torch.ops.fp8ops.cast_stats(x, data, sinv, br, bc), cpu, what)
    return cpu


def _synthetic(shape, x_dtype, fmt, layout, seed):
    """(x, data, scale_inv) of a made-up cast of x [R, C], on the CPU, chosen so that every
    statistic has work: FP8 bytes with many +-max, zeros and NaN; block scales with 0xFF (NaN),
    0 (2^-127), 254, or float32 NaN, 0 and non-powers of two, more of them than x needs (a
    padded layer's); x near its read-back value, exactly at the saturation limit (not counted)
    and above it, far above, tiny, zero, +-inf and NaN."""
    br, bc, kind = LAYOUTS[layout]
    g = torch.Generator().manual_seed(seed)
    R, C = shape
    raw = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    pick = torch.rand(shape, generator=g)
    raw[pick < 0.15] = MAX_BYTE[fmt]
    raw[(pick >= 0.15) & (pick < 0.3)] = MAX_BYTE[fmt] | 0x80
    raw[(pick >= 0.3) & (pick < 0.36)] = 0
    raw[(pick >= 0.36) & (pick < 0.37)] = NAN_BYTE[fmt]
    data = raw.view(fmt)
    if br == 0:
        sinv = torch.tensor(2.0 ** -5 * 1.375)
        mult = sinv.expand(shape)
    else:
        sshape = (-(-R // br) + 1, -(-C // bc) + 2)
        if kind == "e8m0":
            sinv = torch.randint(112, 140, sshape, generator=g, dtype=torch.uint8)
            flat = sinv.view(-1)
            flat[::7], flat[3::11], flat[5::13] = 0xFF, 0, 254
            m = emulation.e8m0_to_float(sinv)
        else:
            e = torch.randint(-12, 4, sshape, generator=g).float()
            sinv = (torch.rand(sshape, generator=g) + 0.5) * torch.exp2(e)
            flat = sinv.view(-1)
            flat[::9], flat[4::17] = float("nan"), 0.0
            m = sinv
        mult = m.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:R, :C]
    dq = data.float() * mult
    limit = dq.abs() * MARGIN[fmt]
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    choice = torch.randint(0, 9, shape, generator=g)
    specials = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0])
    options = [
        dq * (0.5 + torch.rand(shape, generator=g)),  # near the value read back
        sign * limit,  # at the limit: not saturated
        sign * torch.nextafter(limit, torch.tensor(float("inf"))),  # just above it
        dq * 10,  # far above (saturated where raw is +-max)
        sign * 1e-30 * torch.rand(shape, generator=g),  # tiny (zero in float16)
        torch.zeros(shape),
        specials[torch.randint(0, 5, shape, generator=g)],
        torch.randn(shape, generator=g) * 100,
        torch.randn(shape, generator=g) * 1e-6,
    ]
    x = torch.stack(options).gather(0, choice[None]).squeeze(0)
    return x.to(x_dtype), data, sinv, br, bc


def _variants(x, data, seed):
    """(name, x, data) on the GPU: as they are, x's rows strided (a slice of a wider tensor, its
    row stride a multiple of 8) and data larger than x (padded), x a transposed view, both
    transposed views, and x at an odd offset (unaligned)."""
    R, C = x.shape
    g = torch.Generator().manual_seed(seed)
    xc, dc = x.cuda(), data.cuda()
    wide = torch.full((R + 2, (C + 7) // 8 * 8 + 8), float("nan"), dtype=x.dtype, device="cuda")
    wide[:R, :C] = xc
    padded = torch.randint(0, 256, (R + 3, (C + 13 + 7) // 8 * 8), generator=g,
                           dtype=torch.uint8).view(data.dtype).cuda()
    padded[:R, :C] = dc
    odd = torch.zeros(R * C + 1, dtype=x.dtype, device="cuda")
    odd[1:] = xc.reshape(-1)
    return [("contiguous", xc, dc),
            ("strided x, padded data", wide[:R, :C], padded),
            ("transposed x", xc.t().contiguous().t(), dc),
            ("transposed x and data", xc.t().contiguous().t(), dc.t().contiguous().t()),
            ("unaligned x", odd[1:].view(R, C), dc)]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("x_dtype", X_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("fmt", [E4, E5], ids=["e4m3", "e5m2"])
def test_cuda_kernel_counts_exactly_as_the_cpu(fmt, x_dtype, layout):
    """Every format, input dtype and scale layout; ragged and whole shapes (77 x 300: not a
    multiple of 8, 32 or 128; 96 x 256); every view the kernel reads differently."""
    seen = torch.zeros(3, dtype=torch.int64)
    for shape in ((77, 300), (96, 256)):
        seed = list(LAYOUTS).index(layout) * 10 + shape[0] % 7
        x, data, sinv, br, bc = _synthetic(shape, x_dtype, fmt, layout, seed)
        # as made (amax NaN), without NaN (amax inf), all finite (amax the largest value)
        inf = float("inf")
        for xs in (x, x.nan_to_num(0.0, inf, -inf), x.nan_to_num(0.0, 0.0, 0.0)):
            for name, xv, dv in _variants(xs, data, seed=7):
                cpu = _check(xv, dv, sinv.cuda(), br, bc, (layout, shape, name))
            seen += cpu[0]
    assert (seen > 0).all(), seen.tolist()  # saturated, underflowed and non-finite all met


@pytest.mark.parametrize("fmt", [E4, E5], ids=["e4m3", "e5m2"])
def test_cuda_kernel_on_real_casts(fmt):
    """Data and scales of the CUDA casts themselves (what the monitor reads), ragged shapes,
    MX data padded to whole blocks, a NaN block (scale 0xFF) and an inf one."""
    x = _planted((200, 333)).cuda()
    x[5, 40], x[150, 3] = float("nan"), float("inf")
    for dtype in X_DTYPES:
        xd = x.to(dtype)
        s = torch.tensor(16.0, device="cuda")
        data = torch.ops.fp8ops.quantize(xd, s, fmt)[0]
        _check(xd, data, torch.reciprocal(s), 0, 0, ("per-tensor", dtype))
        for br, bc in ((1, 128), (128, 128)):
            data, sinv = torch.ops.fp8ops.quantize_blockwise(xd, fmt, br, bc, False)
            _check(xd, data, sinv, br, bc, ("blockwise", br, bc, dtype))
        xp = torch.nn.functional.pad(xd, (0, 19, 0, 24))  # whole blocks of 32
        for axis, blocks in ((1, (1, 32)), (0, (32, 1))):
            data, scales = torch.ops.fp8ops.quantize_mx(xp, fmt, 32, axis, False)
            assert (scales == 0xFF).any()
            _check(xd, data, scales, *blocks, ("mx", axis, dtype))
            _check(xd.t(), data.t(), scales.t(), *blocks[::-1], ("mx transposed", axis, dtype))


def test_cuda_kernel_on_empty_and_nd_inputs():
    """Empty x (zero counts, amax +0.0, outputs zeroed although nothing is read); x and data of
    more than two dimensions, read as [rows, last dim] as the emulation does."""
    for shape in ((0, 64), (64, 0), (0, 0)):
        x = torch.empty(shape, device="cuda")
        data = torch.empty(shape, dtype=E4, device="cuda")
        for br, bc, sinv in ((0, 0, torch.tensor(1.0, device="cuda")),
                             (1, 32, torch.full((shape[0], 2), 127, dtype=torch.uint8, device="cuda")),
                             (128, 128, torch.ones(1, 1, device="cuda"))):
            cpu = _check(x, data, sinv, br, bc, (shape, br, bc))
            assert cpu[0].tolist() == [0, 0, 0] and cpu[1].item() == 0.0
    x, data, sinv, br, bc = _synthetic((51, 40), torch.bfloat16, E4, "per-tensor", seed=3)
    _check(x.cuda().view(3, 17, 40), data.cuda().view(3, 17, 40), sinv.cuda(), br, bc, "3-D")
    x, data, sinv, br, bc = _synthetic((51, 64), torch.float32, E5, "mx 1x32", seed=4)
    _check(x.cuda()[:, :40].reshape(3, 17, 40), data.cuda().view(3, 17, 64), sinv.cuda(), br, bc,
           "3-D, padded")


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=lambda d: str(d)[6:])
def test_cuda_kernel_on_a_large_tensor(x_dtype):
    """8192 x 4096: many blocks, each adding its part with atomics; counts and amax exactly the
    CPU's, and a NaN in one corner still makes the amax NaN."""
    g = torch.Generator(device="cuda").manual_seed(11)
    x = (torch.randn(8192, 4096, device="cuda", generator=g) * 3).to(x_dtype)
    x[::97, ::13] *= 1e-6  # underflow
    s = torch.tensor(448.0 * 4, device="cuda") / x.float().abs().amax()  # a quarter saturates
    x[17, 4000], x[8000, 5] = float("inf"), -float("inf")
    data = torch.ops.fp8ops.quantize(x, s, E4)[0]
    cpu = _check(x, data, torch.reciprocal(s), 0, 0, "per-tensor")
    assert (cpu[0] > 0).all() and cpu[0][0] > 1000, cpu[0].tolist()
    data, scales = torch.ops.fp8ops.quantize_mx(x, E4, 32, 1, False)
    _check(x, data, scales, 1, 32, "mx 1x32")
    data, sinv = torch.ops.fp8ops.quantize_blockwise(x, E5, 128, 128, False)
    _check(x, data, sinv, 128, 128, "blockwise 128x128")
    x[8191, 4095] = float("nan")
    cpu = _check(x, data, sinv, 128, 128, "blockwise 128x128, NaN")
    assert cpu[1].isnan()


def test_cast_stats_is_one_kernel_on_cuda():
    """With fp8ops._C loaded, the op on CUDA is the kernel of csrc/stats.cu: one launch (and the
    memsets of its outputs), where the emulation's pieces launch dozens."""
    from torch.profiler import ProfilerActivity, profile
    from conftest import skip_without_fp8_kernels
    skip_without_fp8_kernels()
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    s = torch.tensor(8.0, device="cuda")
    pt = (torch.ops.fp8ops.quantize(x, s, E4)[0], torch.reciprocal(s), 0, 0)
    mx = (*torch.ops.fp8ops.quantize_mx(x, E4, 32, 1, False), 1, 32)
    bw = (*torch.ops.fp8ops.quantize_blockwise(x, E4, 1, 128, False), 1, 128)
    for args in (pt, mx, bw):
        torch.ops.fp8ops.cast_stats(x, *args)  # (first-call set-up outside the trace)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            torch.ops.fp8ops.cast_stats(x, *args)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
        kernels = [n for n in names if not n.lower().startswith(("memset", "memcpy"))]
        assert len(kernels) == 1 and "cast_stats_kernel" in kernels[0], names
