"""Runs every fp8ops cast and GEMM op once on small CUDA tensors (odd sizes, misaligned views), for
compute-sanitizer: scripts/gpu_check.sh runs it under --tool memcheck. With --race it runs only
the kernels that share data through shared memory (the fused cast+transpose, per tensor, per
group and per expert, the byte transpose, the blockwise pair cast and the scale update), for
--tool racecheck, which is slow on the GEMMs."""
import sys

import torch

import fp8ops  # noqa: F401
from fp8ops.ops import backend

assert torch.cuda.is_available(), "needs a CUDA GPU"
assert backend.extension_loaded(), "fp8ops._C not loaded: " + backend._state["why_not"]
ops = torch.ops.fp8ops
F8 = torch.float8_e4m3fn


def _role_buffers(history: int):
    """A delayed-scaling role's buffers (history, scale, scale_inv, amax_rep, pending, step,
    nonfinite count), mid-training."""
    f32 = dict(device="cuda", dtype=torch.float32)
    return (torch.rand(history, **f32), torch.full((), 2.0, **f32), torch.full((), 0.5, **f32),
            torch.full((), 1.0, **f32), torch.full((), 3.0, **f32),
            torch.tensor(4, device="cuda"), torch.tensor(0, device="cuda"))


if "--race" in sys.argv:
    x = (torch.randn(257, 300, device="cuda") * 3).to(torch.bfloat16)
    s = torch.tensor(2.0, device="cuda")
    for stoch in (False, True):
        ops.quantize(x, s, F8, True, stoch, 1, 2)
        ops.quantize(x[:256, :256].contiguous(), s, F8, True, stoch, 1, 2)
    ops.delayed_scale_update(torch.rand(1024, device="cuda"), torch.ones(1, device="cuda"),
                             torch.tensor(1.0, device="cuda"), torch.tensor(3.0, device="cuda"),
                             torch.tensor(4, device="cuda"), 448.0, 1.0, 1, "percentile", 0.1, 90.0,
                             False)
    for v in (x, x[:, :256].contiguous(), x.float()):  # the tiled blockwise pair cast
        ops.quantize_blockwise_pair(v, F8, False)
    q = ops.quantize(x, s, F8)[0]  # the byte transpose: each read and write width, partial tiles
    for v in (q, q[:, :256].contiguous(), q[:256, :96].contiguous(),
              q.reshape(-1)[1:1 + 99 * 77].view(99, 77)):
        ops.transpose_fp8(v)
    for algo in ("max", "percentile"):  # the update in place: outputs alias the inputs
        bufs = _role_buffers(1024)
        ops.quantize_delayed(x, *bufs, F8, 1.0, 1, algo, 0.1, 90.0, False, True, False, True)
    # the per-group and per-expert tiled casts (their row scales shared through shared memory)
    offsets = torch.tensor([5, 5, 200, 250], device="cuda", dtype=torch.int32)
    ops.quantize_current_grouped(x, offsets, F8, 1.0, False, True)
    ops.quantize_experts_current(x[:256].reshape(2, 128, 300), F8, 1.0, False, True)
    torch.cuda.synchronize()
    print("sanitize_ops --race: the shared-memory kernels ran")
    sys.exit(0)
for dt in (torch.float32, torch.bfloat16, torch.float16):
    x = (torch.randn(37, 129, device="cuda") * 10).to(dt)
    s = torch.tensor(2.0, device="cuda")
    ops.amax(x)
    ops.amax(x.reshape(-1)[3:])
    for stoch in (False, True):
        for tr in (False, True):
            q, qt, a = ops.quantize(x, s, F8, tr, stoch, 1, 2)
            ops.quantize(x, s, F8, tr, stoch, 0, 0, torch.tensor([1, 2], device="cuda"))
            ops.quantize(x.reshape(-1)[5:], s, torch.float8_e5m2, tr, stoch, 1, 2)
    ops.dequantize(q, s, dt)
    ops.dequantize(q.reshape(-1)[3:], s, dt)
    ops.transpose_fp8(q)
    ops.transpose_fp8(q.reshape(-1)[1:1 + 36 * 129].view(36, 129))
    # the monitor's statistics: vector and tail paths, a strided and an unaligned x, block scales
    ops.cast_stats(x, q, s.reciprocal(), 0, 0)
    ops.cast_stats(x.t(), q.t(), s.reciprocal(), 0, 0)
    ops.cast_stats(x.reshape(-1)[3:3 + 36 * 129].view(36, 129), q[:36, :129], s.reciprocal(), 0, 0)
    d, si = ops.quantize_blockwise(x, F8, 1, 128, False)
    ops.cast_stats(x, d, si, 1, 128)
    xm = (torch.randn(6, 96, 5, device="cuda")).to(dt)
    for axis in (-1, 0, 1):
        if xm.shape[axis] % 32 == 0 or axis == 1:
            d, sc = ops.quantize_mx(xm, F8, 32, axis, True)
            ops.dequantize_mx(d, sc, 32, axis, dt)
    d, sc = ops.quantize_mx(xm.reshape(-1)[1:2849], F8, 32, -1, False)
    for blk in ((1, 128), (128, 128), (3, 5)):
        d, si = ops.quantize_blockwise(x, F8, blk[0], blk[1], True)
        ops.dequantize_blockwise(d, si, blk[0], blk[1], dt)
    # the fused casts of the training step (odd sizes: padding, partial blocks)
    for v in (x, x[:, 3:]):
        ops.quantize_current(v, F8, 1.0, False, True, dt, True, 1, 2)
        for update, warm, record in ((True, False, True), (False, True, False)):
            ops.quantize_delayed(v, *_role_buffers(17), torch.float8_e5m2, 1.0, 2, "max", 0.1, 90.0,
                                 True, update, warm, record, True, torch.float32, False, 0, 0)
        ops.quantize_blockwise_pair(v, F8, False, dt)
        ops.quantize_mx_pair(v, F8, 32, True, dt)
        ops.quantize_mx_pair(v, F8, 16, False, None)
# the FP8AdamW step: ragged sizes (a partial last block), each parameter dtype and v format
for n in (1, 129, 1000):
    for pdt in (torch.float32, torch.bfloat16):
        p = torch.randn(n, device="cuda").to(pdt)
        m, msi = ops.quantize_blockwise(torch.zeros(-(-n // 128), 128, device="cuda"), F8, 1, 128,
                                        False)
        for vdt in (F8, torch.float8_e5m2, torch.bfloat16):
            if vdt == torch.bfloat16:
                v, vsi = torch.zeros(n, device="cuda", dtype=vdt), torch.empty(0, device="cuda")
            else:
                v, vsi = ops.quantize_blockwise(torch.zeros(-(-n // 128), 128, device="cuda"),
                                                vdt, 1, 128, False)
            ops.adamw_step(p, torch.randn_like(p), m, msi, v, vsi, 0.875, 0.125, 0.9375, 0.0625,
                           1e-8, 0.01, 1.5, 0.999, 0.0, 1, 2)


def _adamw_lists(sizes, pdt, vdt):
    """adamw_step_multi's six lists for zero-moment parameters of these sizes."""
    lists = [[] for _ in range(6)]
    for n in sizes:
        blocks = -(-n // 128)
        p = torch.randn(n, device="cuda").to(pdt)
        m, msi = torch.zeros(blocks, 128, device="cuda").to(F8), torch.ones(blocks, 1, device="cuda")
        if vdt == torch.bfloat16:
            v, vsi = torch.zeros(n, device="cuda", dtype=vdt), torch.empty(0, device="cuda")
        else:
            v, vsi = torch.zeros(blocks, 128, device="cuda").to(vdt), msi.clone()
        for lst, t in zip(lists, (p, torch.randn_like(p), m, msi, v, vsi)):
            lst.append(t)
    return lists


# the multi-tensor step: ragged, empty and one-value parameters in one launch, tables on the
# host and on the device
for sizes in ([1000, 0, 1, 129], [0], [5, 128, 4099]):
    for pdt in (torch.float32, torch.bfloat16):
        for vdt in (F8, torch.float8_e5m2, torch.bfloat16):
            scalars = torch.tensor([[0.875, 0.125, 0.9375, 0.0625, 1e-8, 0.01, 1.5, 0.999, 0.0]]
                                   * len(sizes))
            rng = torch.tensor([[1, i << 32 | 2] for i in range(len(sizes))])
            ops.adamw_step_multi(*_adamw_lists(sizes, pdt, vdt), scalars, rng)
            ops.adamw_step_multi(*_adamw_lists(sizes, pdt, vdt), scalars.cuda(), rng.cuda())
for algo in ("max", "most_recent", "ema", "percentile"):
    for L in (1, 17, 1024):
        ops.delayed_scale_update(torch.rand(L, device="cuda"), torch.ones(1, device="cuda"),
                                 torch.tensor(1.0, device="cuda"), torch.tensor(3.0, device="cuda"),
                                 torch.tensor(4, device="cuda"), 448.0, 1.0, 1, algo, 0.1, 90.0, False)
# GEMMs: odd M, N and K (padding paths), both operand pairs, bias or not, both B scale shapes
s = torch.tensor(0.5, device="cuda")
for m, n, k in [(1, 72, 200), (17, 1000, 1040), (300, 384, 512), (7, 1001, 48), (3, 17, 16)]:
    kb = -(-k // 128)
    for a_dt in (F8, torch.float8_e5m2):
        a = torch.randn(m, k, device="cuda").to(a_dt)
        b = torch.randn(n, k, device="cuda").to(F8)
        ops.gemm(a, b, s, s, torch.randn(n, device="cuda"), torch.bfloat16, False)
        ops.gemm(a, b, s, s, None, torch.float32, True)
        ops.gemm_blockwise(a, b, torch.rand(m, kb, device="cuda"),
                           torch.rand(-(-n // 128), kb, device="cuda"), None, torch.float32)
        ops.gemm_blockwise(a, b, torch.rand(m, kb, device="cuda"), torch.rand(n, kb, device="cuda"),
                           torch.randn(n, device="cuda"), torch.bfloat16)
# the grouped (MoE) GEMM kernel: ragged, empty and tiny groups, rows past the last group
for sizes in ([5, 0, 200, 77], [1, 2, 3, 5, 7, 11], [0, 0, 130]):
    offsets = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    m, e, n, k = sum(sizes) + 9, len(sizes), 256, 384
    sg = torch.rand(e, device="cuda") + 0.5
    for a_dt in (F8, torch.float8_e5m2):
        a = torch.randn(m, k, device="cuda").to(a_dt)
        ops.grouped_gemm_sm90(a, torch.randn(e, n, k, device="cuda").to(F8), offsets, sg, sg,
                              torch.bfloat16)
        ops.grouped_gemm_wgrad_sm90(torch.randn(n, m, device="cuda").to(a_dt),
                                    torch.randn(k, m, device="cuda").to(F8), offsets, sg, sg,
                                    torch.float32)
# the experts' weight casts: every expert in one launch; ragged and aligned shapes
for shape, dt in (((3, 130, 141), torch.float32), ((4, 256, 512), torch.bfloat16)):
    w = torch.randn(*shape, device="cuda").to(dt)
    ops.amax_experts(w)
    for transpose in (True, False):
        ops.quantize_experts_current(w, F8, 1.0, False, transpose)
        ops.quantize_experts_scaled(w, torch.rand(shape[0], device="cuda") + 0.5, F8, transpose)
# the per-group casts of rows sorted by expert: empty groups, rows past the last one
for sizes, cols in (([5, 0, 200, 77], 141), ([128, 256], 512)):
    offsets = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    x = torch.randn(sum(sizes) + 9, cols, device="cuda").to(torch.bfloat16)
    for transpose in (True, False):
        ops.quantize_current_grouped(x, offsets, F8, 1.0, False, transpose)
        ops.quantize_scaled_grouped(x, offsets, torch.rand(len(sizes), device="cuda") + 0.5, F8,
                                    transpose)
torch.cuda.synchronize()
print("sanitize_ops: every cast, GEMM and optimizer op ran")
