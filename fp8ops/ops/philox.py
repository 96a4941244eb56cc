"""Philox4x32-10 (docs/design.md, "Stochastic rounding") in int64 tensor arithmetic, for the
emulation's stochastic rounding: the random word of flat element i is word i % 4 of the block
with counter (j & 0xffffffff, j >> 32, offset low, offset high), j = i // 4, and key (seed low,
seed high).

A 32 x 32-bit product is below 2^64: as int64 it wraps, but its bits are the product, so hi is
bits 32-63 (`>> 32`, masked: the shift is arithmetic) and lo bits 0-31. lo words are carried
unmasked (their high bits are garbage) and masked where they meet a multiply.
"""
from __future__ import annotations

import torch

from .scratch import scratch

MASK32 = 0xFFFFFFFF
_M = (0xD2511F53, 0xCD9E8D57)
_W = (0x9E3779B9, 0xBB67AE85)
# Counters per block of work: bounds the working set (six int64 buffers) while each op stays
# large enough to run on every intra-op thread.
CHUNK = 1 << 18
_PARALLEL_MIN = 32768 + 64


def philox4x32_10(counter, key):
    """Philox4x32-10. counter: 4 int64 tensors or ints (< 2^32); key: 2 ints. Returns 4 words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key[0] & MASK32, key[1] & MASK32
    for r in range(10):
        if r:
            k0, k1 = (k0 + _W[0]) & MASK32, (k1 + _W[1]) & MASK32
        p0, p1 = c0 * _M[0], c2 * _M[1]
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & MASK32, p1, ((p0 >> 32) ^ c3 ^ k1) & MASK32, p0
    return c0, c1 & MASK32, c2, c3 & MASK32


def _block(start: int, m: int, key, off, bufs):
    """The 4 words of counters j = start .. start+m-1, with j >> 32 the same for all of them:
    philox4x32_10 in place in six int64 buffers. In the first two rounds a word that is the same
    for every counter stays a Python int (round 1 varies only c0; round 2 only c1 and c2), which
    saves a tenth of the passes. Returns (c0, c1, c2, c3) with c1 and c3 unmasked."""
    (m0, m1), (w0, w1) = _M, _W
    k0, k1 = key
    a, b, t0, t1, t2, t3 = (buf[:m] for buf in bufs)
    # round 1: c0 = j & mask varies; c1 = j >> 32, c2, c3 (the offset) are ints
    p0 = torch.arange(start & MASK32, (start & MASK32) + m, dtype=torch.int64, device=a.device,
                      out=a).mul_(m0)
    p1 = off[0] * m1
    s0 = ((p1 >> 32) ^ (start >> 32) ^ k0) & MASK32
    v2 = torch.bitwise_right_shift(p0, 32, out=b).bitwise_xor_(off[1] ^ k1).bitwise_and_(MASK32)
    # round 2: c0 = s0 and c1 = lo(p1) are ints, c2 = v2 and c3 = lo(p0) (in a) vary
    k0, k1 = (k0 + w0) & MASK32, (k1 + w1) & MASK32
    q0, q1 = s0 * m0, v2.mul_(m1)
    c0 = torch.bitwise_right_shift(q1, 32, out=t0).bitwise_xor_((p1 & MASK32) ^ k0)
    c0 = c0.bitwise_and_(MASK32)
    c2 = a.bitwise_xor_((q0 >> 32) ^ k1).bitwise_and_(MASK32)
    c1, c3 = q1, q0 & MASK32  # c3 is an int until round 3 consumes it
    # round 3
    k0, k1 = (k0 + w0) & MASK32, (k1 + w1) & MASK32
    p0, p1 = c0.mul_(m0), c2.mul_(m1)
    n0 = torch.bitwise_right_shift(p1, 32, out=t1).bitwise_xor_(c1).bitwise_xor_(k0)
    n2 = torch.bitwise_right_shift(p0, 32, out=t2).bitwise_xor_(c3 ^ k1)
    c0, c1, c2, c3 = n0.bitwise_and_(MASK32), p1, n2.bitwise_and_(MASK32), p0
    free = [b, t3]  # v2 / q1 lived in b until round 3 read c1
    # rounds 4..10: every word varies
    for _ in range(7):
        k0, k1 = (k0 + w0) & MASK32, (k1 + w1) & MASK32
        p0, p1 = c0.mul_(m0), c2.mul_(m1)
        n0 = torch.bitwise_right_shift(p1, 32, out=free[0]).bitwise_xor_(c1).bitwise_xor_(k0)
        n2 = torch.bitwise_right_shift(p0, 32, out=free[1]).bitwise_xor_(c3).bitwise_xor_(k1)
        free = [c1, c3]
        c0, c1, c2, c3 = n0.bitwise_and_(MASK32), p1, n2.bitwise_and_(MASK32), p0
    return c0, c1, c2, c3


def chunks(n: int, seed: int, offset: int, device, first: int = 0):
    """Yield (first counter, 4 word tensors) for the counters of flat elements first..first+n-1
    (first a multiple of 4), block by block (blocks never straddle a multiple of 2^32
    counters); c1 and c3 come unmasked. The yielded counters count from `first` // 4."""
    if first % 4:
        raise ValueError(f"fp8ops: a random stream is read from a multiple of 4, got {first}")
    nc = (n + 3) // 4
    key = (seed & MASK32, (seed >> 32) & MASK32)
    off = (offset & MASK32, (offset >> 32) & MASK32)
    size = max(1, min(nc, CHUNK))
    # torch runs an elementwise op on one thread up to 32768 elements: a block of a few more
    # counters (their words unused) runs on two, which pays from a quarter of that size
    pad = torch.get_num_threads() > 1 and _PARALLEL_MIN // 4 < size < _PARALLEL_MIN
    bufs = [scratch(f"philox{i}", (_PARALLEL_MIN if pad else size,), torch.int64, device)
            for i in range(6)]
    start, end = first // 4, first // 4 + nc
    while start < end:
        room = (1 << 32) - (start & MASK32)
        m = min(size, end - start, room)
        words = _block(start, min(_PARALLEL_MIN, room) if pad else m, key, off, bufs)
        yield start, [w[:m] for w in words]
        start += m


def random_words(n: int, seed: int, offset: int, device, first: int = 0) -> torch.Tensor:
    """The 32-bit random word (as int64) of each flat element first..first+n-1 (first a
    multiple of 4)."""
    out = torch.empty(((n + 3) // 4, 4), dtype=torch.int64, device=device)
    for start, words in chunks(n, seed, offset, device, first):
        row = start - first // 4
        for i, w in enumerate(words):
            torch.bitwise_and(w, MASK32, out=out[row:row + w.numel(), i])
    return out.reshape(-1)[:n]


def uniform24(n: int, seed: int, offset: int, device) -> torch.Tensor:
    """u = (r >> 8) * 2^-24 (float32, exact; a scratch tensor) for the word r of each element."""
    out = scratch("uniform", ((n + 3) // 4, 4), torch.float32, device)
    for start, words in chunks(n, seed, offset, device):
        for i, w in enumerate(words):  # (r >> 8) < 2^24 converts to float32 exactly
            w = w.bitwise_right_shift_(8)
            torch.mul(w if i % 2 == 0 else w.bitwise_and_(0xFFFFFF), 2.0 ** -24,
                      out=out[start:start + w.numel(), i])
    return out.reshape(-1)[:n]
