"""Host tests of the CUDA kernels' scalar math (no GPU needed).

tests/csrc/host_check.cu includes csrc/common.cuh, whose scalar helpers are __host__ __device__:
Philox4x32-10 and the per-element random words, stochastic rounding, the MX exponent (FLOOR and
RCEIL), E8M0 decoding, the blockwise scales, scale_from_amax and the delayed-scaling scalar cores.
It is compiled here with nvcc (host code only) and its answers are compared bit for bit with
fp8ops.ops.emulation. The FP8 conversion instruction itself (cvt.rn.satfinite) exists only on the
device; the stochastic-rounding checks therefore compare the float32 value that the kernel
converts (an exact FP8 value) with the emulation's FP8 result upcast to float32.
"""
import os
import shutil
import struct
import subprocess

import numpy as np
import pytest
import torch

from fp8ops.ops import emulation as E
from fp8ops.formats import get_format

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MASK32 = 0xFFFFFFFF
FMTS = [(0, torch.float8_e4m3fn), (1, torch.float8_e5m2)]


def _nvcc():
    cands = [shutil.which("nvcc")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            cands.append(os.path.join(home, "bin", "nvcc"))
    return next((c for c in cands if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


@pytest.fixture(scope="module")
def host_check(tmp_path_factory):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (PATH, CUDA_HOME, /usr/local/cuda): cannot build tests/csrc/host_check.cu")
    exe = str(tmp_path_factory.mktemp("host_check") / "host_check")
    # -ffp-contract=off: host float32 arithmetic stays one IEEE rounding per operation
    cmd = [nvcc, "-std=c++17", "-O2", "-Xcompiler", "-ffp-contract=off", "-I", os.path.join(ROOT, "csrc"),
           os.path.join(ROOT, "tests", "csrc", "host_check.cu"), "-o", exe]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "warning" not in (r.stdout + r.stderr).lower(), r.stdout + r.stderr

    def run(mode, header, records):
        text = " ".join(str(h) for h in header) + "\n" + "\n".join(records) + "\n"
        p = subprocess.run([exe, mode], input=text, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, (mode, p.returncode, p.stderr)
        return [line.split() for line in p.stdout.splitlines()]

    return run


# ---- float32 bit helpers -------------------------------------------------------------------------
def fbits(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).view(np.uint32)


def tbits(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().contiguous().numpy().view(np.uint32)


def hx(u) -> str:
    return format(int(u) & MASK32, "x")


def hx64(u) -> str:
    return format(int(u) & (2**64 - 1), "x")


def from_hex(tokens) -> np.ndarray:
    return np.array([int(t, 16) for t in tokens], dtype=np.uint32)


def assert_bits_equal(got: np.ndarray, want: np.ndarray, what: str, inputs=None):
    """Bit-for-bit equality, except that any NaN matches any NaN."""
    got, want = np.asarray(got, np.uint32), np.asarray(want, np.uint32)
    gn = np.isnan(got.view(np.float32))
    wn = np.isnan(want.view(np.float32))
    bad = (gn != wn) | (~gn & (got != want))
    if bad.any():
        idx = np.nonzero(bad)[0][:8]
        rows = [(i, None if inputs is None else hx(inputs[i]), hx(got[i]), hx(want[i])) for i in idx]
        raise AssertionError(f"{what}: {int(bad.sum())} mismatches (index, input, host, emulation): {rows}")


def special_amaxes(rng, n_random=3000) -> np.ndarray:
    """Non-negative float32 patterns: random over every exponent, subnormals, powers of two, the
    1.75 * 2^k RCEIL boundaries and their neighbours, 0, FLT_MAX, inf, NaNs."""
    vals = [0, 1, 2, 0x7FFFFF, 0x800000, 0x7F7FFFFF, 0x7F800000, 0x7FC00000, 0x7F800001, 0x7FFFFFFF,
            fbits(448.0), fbits(57344.0), fbits(1.0), fbits(1.0e-38), fbits(1.0e-37), fbits(1e38)]
    for e in range(1, 255):
        base = e << 23
        vals += [base, base + 1, base - 1 if base > 1 else 0, base | 0x600000, (base | 0x600000) + 1,
                 (base | 0x600000) - 1, base | 0x7FFFFF, base | 0x400000]
    vals += [1 << k for k in range(23)]  # subnormal powers of two
    rnd = rng.integers(0, 0x7F800000, size=n_random, dtype=np.uint64)
    sub = rng.integers(1, 0x800000, size=200, dtype=np.uint64)
    return np.concatenate([np.array(vals, dtype=np.uint64), rnd, sub]).astype(np.uint32)


# ---- Philox and the random words ---------------------------------------------------------------
KNOWN = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((MASK32,) * 4, (MASK32, MASK32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def test_philox_known_answers_and_random(host_check):
    rng = np.random.default_rng(1)
    cases = [(c, k) for c, k, _ in KNOWN]
    cases += [(tuple(int(v) for v in rng.integers(0, 2**32, 4)), tuple(int(v) for v in rng.integers(0, 2**32, 2)))
              for _ in range(500)]
    out = host_check("philox", [], [" ".join(hx(v) for v in c + k) for c, k in cases])
    got = [tuple(int(t, 16) for t in row) for row in out]
    assert len(got) == len(cases)
    for (c, k, want), g in zip(KNOWN, got):
        assert g == want, (c, k, [hex(v) for v in g])
    cnt = tuple(torch.tensor([c[i] for c, _ in cases], dtype=torch.int64) for i in range(4))
    # the emulation takes one key per call: group by key
    for idx, (c, k) in enumerate(cases):
        want = E.philox4x32_10(tuple(t[idx:idx + 1] for t in cnt), k)
        assert g_eq(got[idx], want), (c, k)


def g_eq(got, want_tensors):
    return tuple(got) == tuple(int(w.item()) if torch.is_tensor(w) else int(w) for w in want_tensors)


SEEDS = [(0, 0), (1234, 0), (0x123456789ABCDEF0, 7), (2**64 - 1, 2**64 - 1), (42, 2**40 + 3),
         (-1 & (2**64 - 1), 5)]


@pytest.mark.parametrize("seed,offset", SEEDS)
def test_random_words(host_check, seed, offset):
    n = 1003
    # sequential, then shuffled (the per-thread cache of the last Philox block must not leak)
    order = list(range(n)) + list(np.random.default_rng(2).permutation(n))
    out = host_check("words", [hx64(seed), hx64(offset)], [str(i) for i in order])
    got = from_hex([row[0] for row in out])
    want = E.random_words(n, seed, offset, "cpu").numpy().astype(np.uint32)
    np.testing.assert_array_equal(got, want[np.array(order)])


def test_random_words_large_indices(host_check):
    """Element indices past 2^32 * 4 fill the second counter word."""
    seed, offset = 0xDEADBEEF12345678, 0x0000000100000002
    idx = [2**34 - 1, 2**34, 2**34 + 1, 2**34 + 2, 2**34 + 3, 2**34 + 4, 2**40 + 5, 2**62 + 3, 2**63 - 1]
    out = host_check("words", [hx64(seed), hx64(offset)], [str(i) for i in idx])
    got = [int(row[0], 16) for row in out]
    for i, g in zip(idx, got):
        j = i // 4
        words = E.philox4x32_10((j & MASK32, j >> 32, offset & MASK32, offset >> 32),
                                (seed & MASK32, seed >> 32))
        assert g == int(words[i % 4]), (i, hex(g))


# ---- stochastic rounding -----------------------------------------------------------------------
def _sr_inputs(rng, fmt, n=6000):
    """float32 inputs: random magnitudes across the format's range (and beyond), exact FP8 values,
    midpoints, subnormals of both float32 and the format, the clamp edges, specials."""
    f = get_format(fmt)
    mags = np.exp2(rng.uniform(-30, np.log2(f.max) + 3, size=n)).astype(np.float32)
    x = mags * rng.choice([-1.0, 1.0], size=n).astype(np.float32)
    all_fp8 = torch.arange(256, dtype=torch.uint8).view(fmt).float().numpy()
    all_fp8 = all_fp8[np.isfinite(all_fp8)]
    mids = ((all_fp8[:-1].astype(np.float64) + all_fp8[1:]) / 2).astype(np.float32)
    spec = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, f.max, -f.max, np.nextafter(f.max, np.inf),
                     3.4028235e38, -3.4028235e38, 1e-45, -1e-45, 1.17549435e-38, 2.0 ** f.emin,
                     2.0 ** (f.emin - f.mbits), 2.0 ** (f.emin - f.mbits - 1)], dtype=np.float32)
    return np.concatenate([x, all_fp8, -all_fp8, mids, spec]).astype(np.float32)


def _boundary_inputs(fmt, words):
    """Inputs whose fraction k - floor(k) sits exactly on u = (r >> 8) * 2^-24 (truncated to the
    fraction bits k can hold) and one ulp above: checks the strict '>' of the rounding rule."""
    f = get_format(fmt)
    u = (words >> 8).astype(np.float64) * 2.0 ** -24
    out = []
    for idx, uu in enumerate(u):
        e = [f.emin + 2, 0, 3, f.emin - 1][idx % 4]  # normal binades and one subnormal step
        ulp = 2.0 ** (max(e, f.emin) - f.mbits)
        fk = (2 ** f.mbits + idx % (2 ** f.mbits)) if e >= f.emin else idx % (2 ** f.mbits)
        frac_bits = 23 - (int(np.floor(np.log2(fk))) if fk else 0)
        frac = np.floor(uu * 2.0 ** frac_bits) / 2.0 ** frac_bits
        if idx % 2:
            frac += 2.0 ** -frac_bits
        out.append((fk + frac) * ulp)
    return np.array(out, dtype=np.float32)


@pytest.mark.parametrize("fmt_id,fmt", FMTS)
@pytest.mark.parametrize("scale", [1.0, 0.375, 2.0 ** 20, 1.7e-30, 3.0e7])
def test_stochastic_rounding(host_check, fmt_id, fmt, scale):
    rng = np.random.default_rng(3 + fmt_id)
    seed, offset = 0x0123456789ABCDEF, 0x10000000F
    x = _sr_inputs(rng, fmt)
    if scale == 1.0:  # exact boundary cases, using the words of their own positions
        n0 = len(x)
        words = E.random_words(n0 + 4000, seed, offset, "cpu").numpy()[n0:].astype(np.uint32)
        x = np.concatenate([x, _boundary_inputs(fmt, words)])
    xs = torch.from_numpy(x.copy())
    s = torch.tensor(scale, dtype=torch.float32)
    data, _, _ = E.quantize(xs, s, fmt, stochastic=True, seed=seed, offset=offset)
    want = tbits(data.float())
    sb = hx(fbits(scale))
    out = host_check("sr", [fmt_id, hx64(seed), hx64(offset)], [f"{i} {hx(b)} {sb}" for i, b in enumerate(fbits(x))])
    got = from_hex([row[0] for row in out])
    assert_bits_equal(got, want, f"stochastic {fmt} scale {scale}", fbits(x))
    # the value the kernel converts must be an exact FP8 value (the conversion then changes nothing)
    g = got.view(np.float32)
    fin = ~np.isnan(g)
    back = torch.from_numpy(g[fin].copy()).to(fmt).float().numpy()
    np.testing.assert_array_equal(fbits(back), got[fin])


# ---- MXFP8 -------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt_id,fmt", FMTS)
@pytest.mark.parametrize("rceil", [False, True])
def test_mx_scale(host_check, fmt_id, fmt, rceil):
    amax = special_amaxes(np.random.default_rng(4))
    out = host_check("mx", [fmt_id, int(rceil)], [hx(a) for a in amax])
    byte = np.array([int(r[0]) for r in out])
    mul = from_hex([r[1] for r in out])
    bad = np.array([int(r[2]) for r in out], dtype=bool)
    a = torch.from_numpy(amax.view(np.float32).copy())
    f = get_format(fmt)
    e = E.mx_exponent(a, f, rceil)
    want_bad = ~torch.isfinite(a)
    want_byte = torch.where(want_bad, 255, e + 127).numpy()
    np.testing.assert_array_equal(bad, want_bad.numpy())
    mism = np.nonzero(byte != want_byte)[0]
    assert not len(mism), [(hx(amax[i]), byte[i], want_byte[i]) for i in mism[:8]]
    ok = ~want_bad.numpy()
    assert_bits_equal(mul[ok], tbits(E._exp2_f32(-e))[ok], "MX 2^-e", amax[ok])
    # the same bytes come out of quantize_mx: one block of 32 per amax, the amax at a varying lane
    rows = torch.arange(len(amax))
    blocks = torch.zeros(len(amax), 32)
    lanes = rows % 32
    blocks[rows, lanes] = a * torch.where(rows % 3 == 0, -1.0, 1.0)
    blocks[rows, (lanes + 1) % 32] = -a / 3  # a smaller element beside it
    _, scales = E.quantize_mx(blocks, fmt, 32, -1, rceil)
    np.testing.assert_array_equal(scales.reshape(-1).numpy(), byte)


def test_e8m0_decode(host_check):
    out = host_check("e8m0", [], [str(b) for b in range(256)])
    got = from_hex([r[0] for r in out])
    want = tbits(E.e8m0_to_float(torch.arange(256, dtype=torch.int32).to(torch.uint8)))
    assert_bits_equal(got, want, "e8m0_to_float", np.arange(256))
    assert got[0] == 0x00400000 and np.isnan(got[255:].view(np.float32)).all()  # 2^-127 subnormal, NaN


# ---- blockwise scales ----------------------------------------------------------------------------
@pytest.mark.parametrize("fmt_id,fmt", FMTS)
@pytest.mark.parametrize("pow2", [False, True])
def test_blockwise_scales(host_check, fmt_id, fmt, pow2):
    amax = special_amaxes(np.random.default_rng(5))
    out = host_check("bw", [fmt_id, int(pow2)], [hx(a) for a in amax])
    scale, scale_inv = from_hex([r[0] for r in out]), from_hex([r[1] for r in out])
    ws, wsi = E.blockwise_scales(torch.from_numpy(amax.view(np.float32).copy()), get_format(fmt), pow2)
    assert_bits_equal(scale, tbits(ws), f"blockwise scale {fmt} pow2={pow2}", amax)
    assert_bits_equal(scale_inv, tbits(wsi), f"blockwise scale_inv {fmt} pow2={pow2}", amax)


# ---- scale from amax -------------------------------------------------------------------------------
@pytest.mark.parametrize("fp8_max", [448.0, 57344.0])
@pytest.mark.parametrize("margin", [1.0, 2.0, 0.5, 1.3, 2.0 ** -0.5, 1e-30, 1e30])
@pytest.mark.parametrize("pow2", [False, True])
def test_scale_from_amax(host_check, fp8_max, margin, pow2):
    rng = np.random.default_rng(6)
    amax = special_amaxes(rng, 1000)
    amax = np.concatenate([amax, np.array([0x80000000], dtype=np.uint32)])  # -0.0
    prev = fbits(rng.uniform(0.01, 100, size=len(amax)).astype(np.float32))
    out = host_check("sfa", [hx(fbits(fp8_max)), hx(fbits(np.float32(margin))), int(pow2)],
                     [f"{hx(a)} {hx(p)}" for a, p in zip(amax, prev)])
    got = from_hex([r[0] for r in out])
    want = E.scale_from_amax(torch.from_numpy(amax.view(np.float32).copy()),
                             torch.from_numpy(prev.view(np.float32).copy()), fp8_max, margin, pow2)
    assert_bits_equal(got, tbits(want), f"scale_from_amax max={fp8_max} margin={margin} pow2={pow2}", amax)


# ---- delayed scale update ----------------------------------------------------------------------------
ALGOS = ["max", "most_recent", "ema", "percentile"]


def _dsu_record(L, interval, algo, alpha, pct, pow2, fp8_max, margin, step, hist, scale, rep, pending):
    q = struct.unpack("<Q", struct.pack("<d", pct / 100.0))[0]
    head = [L, interval, ALGOS.index(algo), hx(fbits(np.float32(alpha))), hx(fbits(np.float32(1.0 - alpha))),
            format(q, "x"), int(pow2), hx(fbits(np.float32(fp8_max))), hx(fbits(np.float32(margin))), step]
    vals = [hx(b) for b in fbits(hist)] + [hx(fbits(scale)), hx(fbits(rep)), hx(fbits(pending))]
    return " ".join(str(v) for v in head + vals)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("L,interval", [(1, 1), (4, 1), (16, 3), (1024, 2)])
def test_delayed_scale_update(host_check, algo, L, interval):
    rng = np.random.default_rng(7 + L + interval)
    configs = [(0.1, 99.0, False, 448.0, 1.0), (0.3, 50.0, True, 57344.0, 2.0), (1.0, 100.0, False, 448.0, 1.3),
               (0.7, 0.1, True, 448.0, 0.5), (0.25, 33.3, False, 57344.0, 1.0)]
    records, expected = [], []
    for alpha, pct, pow2, fp8_max, margin in configs:
        # a trajectory of the emulation's state machine; each step is one independent record
        hist = torch.zeros(L)
        scale, rep, pending = torch.ones(()), torch.zeros(()), torch.zeros(())
        for step in range(1, 3 * L + 8 if L < 100 else 12):
            pending = torch.maximum(pending, torch.tensor(float(np.float32(
                rng.choice([0.0, 1e-3, 1.0, 3.7, 1e4, 1e-40, 3e38]) * rng.uniform(0.5, 2))), dtype=torch.float32))
            st = torch.tensor(step)
            outs = E.delayed_scale_update(hist, scale, rep, pending, st, fp8_max, margin, interval, algo, alpha,
                                          pct, pow2)
            records.append(_dsu_record(L, interval, algo, alpha, pct, pow2, fp8_max, margin, step, hist.numpy(),
                                       scale.numpy(), rep.numpy(), pending.numpy()))
            expected.append(np.concatenate([tbits(o).reshape(-1) for o in outs]))
            hist, scale, _, rep, pending = outs
    out = host_check("dsu", [], records)
    assert len(out) == len(records)
    for k, (row, want) in enumerate(zip(out, expected)):
        assert_bits_equal(from_hex(row), want, f"delayed_scale_update {algo} L={L} record {k}")


# ---- secondary: cuda_fp8.hpp's host conversions (the software path, not the PTX instruction) ----
@pytest.mark.parametrize("fmt_id,fmt", FMTS)
def test_fp8_conversion_host_path(host_check, fmt_id, fmt):
    rng = np.random.default_rng(8)
    x = _sr_inputs(rng, fmt, 4000)
    y = np.roll(x, 7)
    out = host_check("cvt", [fmt_id], [f"{hx(a)} {hx(b)}" for a, b in zip(fbits(x), fbits(y))])
    a = np.array([int(r[0]) for r in out])
    b = np.array([int(r[1]) for r in out])
    two = np.array([int(r[2]) for r in out])
    f = get_format(fmt)
    wa = E._rne_fp8(torch.from_numpy(x.copy()), f).view(torch.uint8).numpy()
    wb = E._rne_fp8(torch.from_numpy(y.copy()), f).view(torch.uint8).numpy()
    np.testing.assert_array_equal(a, wa)
    np.testing.assert_array_equal(b, wb)
    np.testing.assert_array_equal(two, wa.astype(np.int64) | (wb.astype(np.int64) << 8))  # a in the low byte


@pytest.mark.parametrize("fmt_id,fmt", FMTS)
def test_fp8_upcast_host_path(host_check, fmt_id, fmt):
    out = host_check("up", [fmt_id], [str(b) for b in range(256)])
    got = from_hex([r[0] for r in out])
    want = tbits(torch.arange(256, dtype=torch.uint8).view(fmt).float())
    assert_bits_equal(got, want, f"fp8_to_float {fmt}", np.arange(256))


# ---- launch math of the blockwise pair cast (csrc/blockwise_pair.cu) ------------------------------
SM89_MAX_SMEM = 99 * 1024  # dynamic shared memory a block may opt in to on sm_89 (sm_90: 227 KB)


@pytest.mark.parametrize("elem_bytes", [2, 4])
def test_blockwise_pair_plan_covers_every_tile_and_fits_shared_memory(host_check, elem_bytes):
    shapes = [(1, 1), (127, 129), (128, 128), (4096, 14336), (16384, 7168), (130, 70), (1, 300)]
    out = host_check("pairplan", [], [f"{r} {c} {elem_bytes}" for r, c in shapes])
    for (rows, cols), (tr, tc, smem) in zip(shapes, out):
        assert (int(tr), int(tc)) == (-(-rows // 128), -(-cols // 128)), (rows, cols)
        # a 128x128 tile of x and its 128x128 transposed bytes, within what a block may have
        assert 128 * 128 * (elem_bytes + 1) <= int(smem) <= SM89_MAX_SMEM, smem


# ---- the byte tile of the quantize + transpose cast (csrc/byte_tile.cuh) ---------------------------
def test_byte_tile_layout_is_a_swizzle_without_bank_conflicts(host_check):
    rc = [(r, c) for r in range(128) for c in range(128)]
    off = np.array([int(o[0]) for o in host_check("tileoff", [], [f"{r} {c}" for r, c in rc])]).reshape(128, 128)
    assert sorted(off.reshape(-1).tolist()) == list(range(128 * 128))  # every byte has its own place
    assert (off // 128 == np.arange(128)[:, None]).all()  # a row stays in its 128 bytes
    chunks = off.reshape(128, 8, 16)
    assert (chunks - chunks[:, :, :1] == np.arange(16)).all()  # 16-byte chunks stay contiguous, aligned
    assert (chunks[:, :, 0] % 16 == 0).all()
    bank = (off // 4) % 32
    # the column reads: warp w, quarter-warp of lanes l .. l + 7, each 16 bytes of row 4 lane + q
    # from column 16 w: 8 loads of 4 banks each must cover all 32 banks
    for w in range(8):
        for q in range(4):
            for first in range(0, 32, 8):
                rows = [4 * lane + q for lane in range(first, first + 8)]
                banks = {int(bank[r, 16 * w]) + k for r in rows for k in range(4)}
                assert len(banks) == 32, (w, q, first)


def test_byte_tile_4x4_transpose(host_check):
    rng = np.random.default_rng(7)
    words = rng.integers(0, 2 ** 32, size=(200, 4), dtype=np.uint64).astype(np.uint32)
    words[0] = [0x03020100, 0x13121110, 0x23222120, 0x33323130]
    out = host_check("t4x4", [], [" ".join(f"{w:08x}" for w in row) for row in words])
    for row, got in zip(words, out):
        m = row.view(np.uint8).reshape(4, 4)  # m[k, i]: byte i of word k
        want = np.ascontiguousarray(m.T).view(np.uint32).reshape(-1)
        assert [int(g, 16) for g in got] == want.tolist(), (row, got)
    assert out[0] == ["30201000", "31211101", "32221202", "33231303"]


# ---- the grouped GEMM's per-group problems (csrc/grouped_layout.h) ------------------------------
GROUPED_CASES = [
    [5, 5, 200, 333],        # an empty group, ragged sizes
    [0, 0, 0],               # every group empty
    [128, 256, 384],         # aligned groups
    [1, 2, 3, 4, 5, 6, 7],   # tiny groups, none 16-aligned
    [300],                   # one group short of the rows: the tail belongs to none
]
BAD_OFFSETS = [[5, 3, 9], [-4, 2, 400], [7, 500, 10]]  # decreasing, negative, past the rows


def _grouped(host_check, rows_kind, offsets, total, n, k):
    out = host_check("grouped", [int(rows_kind), total, n, k, len(offsets)], [" ".join(map(str, offsets))])
    *lines, (ld,) = out
    cols = ["start", "rows", "packed_start", "m", "n", "k", "a_off", "b_off", "d_off", "lda", "ldb", "ldd",
            "tiles"]
    return [dict(zip(cols, map(int, line))) for line in lines], int(ld)


def _spans(offsets, total):
    """What the kernel must read as each group's rows: the offsets made non-decreasing and kept
    within [0, total] (the op asserts them; a bad tensor must still never leave the operands)."""
    lo, spans = 0, []
    for e in offsets:
        e = min(max(e, lo), total)
        spans.append((lo, e - lo))
        lo = e
    return spans


@pytest.mark.parametrize("offsets", GROUPED_CASES + BAD_OFFSETS)
def test_grouped_rows_problems(host_check, offsets):
    total, n, k = 400, 96, 160
    groups, _ = _grouped(host_check, True, offsets, total, n, k)
    for g, (q, (start, rows)) in enumerate(zip(groups, _spans(offsets, total))):
        assert (q["start"], q["rows"]) == (start, rows)
        assert (q["m"], q["n"], q["k"]) == (rows, n, k)
        assert (q["a_off"], q["b_off"], q["d_off"]) == (start * k, g * n * k, start * n)
        assert (q["lda"], q["ldb"], q["ldd"]) == (k, k, n)
        assert q["tiles"] == -(-rows // 128) * -(-n // 128)
    # the groups tile exactly the rows they own, in order, inside the operands
    assert sum(q["rows"] for q in groups) == (groups[-1]["start"] + groups[-1]["rows"])
    assert all(0 <= q["start"] and q["start"] + q["rows"] <= total for q in groups)


@pytest.mark.parametrize("offsets", GROUPED_CASES + BAD_OFFSETS + [[]])
def test_row_group_is_searchsorted(host_check, offsets):
    """Each row's group in the per-group casts (csrc/cast_grouped.cu): numpy's searchsorted
    (right) of the row in the offsets, which the emulation uses (torch.searchsorted); past the
    last group, the group count. Bad offsets still give a group in [0, groups]."""
    total = 410
    (line,) = host_check("rowgroup", [len(offsets), total], [" ".join(map(str, offsets))])
    got = [int(g) for g in line]
    assert len(got) == total and all(0 <= g <= len(offsets) for g in got)
    if offsets in BAD_OFFSETS:
        return
    want = np.searchsorted(np.array(offsets, dtype=np.int64), np.arange(total), side="right")
    assert got == want.tolist()


@pytest.mark.parametrize("offsets", GROUPED_CASES + BAD_OFFSETS)
def test_grouped_wgrad_problems_start_16_byte_aligned_and_never_overlap(host_check, offsets):
    total, n, k = 400, 96, 160
    groups, ld = _grouped(host_check, False, offsets, total, n, k)
    assert ld % 16 == 0 and ld >= total + 16 * len(offsets) - 15
    end = 0
    for g, (q, (start, rows)) in enumerate(zip(groups, _spans(offsets, total))):
        assert (q["start"], q["rows"]) == (start, rows)
        assert q["packed_start"] % 16 == 0 and q["packed_start"] >= end  # TMA: aligned bases
        padded = -(-rows // 16) * 16  # the reduction over zero padding to 16 columns
        end = q["packed_start"] + padded
        assert end <= ld
        # an empty group has no tiles (its dW is zeroed apart): never a K = 0 problem
        assert (q["m"], q["n"], q["k"]) == ((n if rows else 0), k, padded)
        assert (q["a_off"], q["b_off"], q["d_off"]) == (q["packed_start"], q["packed_start"], g * n * k)
        assert (q["lda"], q["ldb"], q["ldd"]) == (ld, ld, k)
        assert q["tiles"] == (-(-n // 128) * -(-k // 128) if rows else 0)
