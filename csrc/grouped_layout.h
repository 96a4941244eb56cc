// Where each group of a grouped (mixture-of-experts) GEMM lives: the problem shape and the
// operand offsets of group g, from the offsets tensor (cumulative end rows, int32); and each
// row's group for the per-group casts (cast_grouped.cu). Plain
// __host__ __device__ arithmetic, no CUDA runtime and no torch: the launcher's setup kernel runs
// it on the device (the offsets never leave it) and tests/csrc/grouped_layout_check.cu runs the
// same code on the host.
//
// Two shapes of problem (all operands K-major, "TN"):
//   rows   D_g [m_g, N] = A_g [m_g, K] B_g [N, K]^T, A's rows sorted by group, B [E, N, K]
//          (the forward and the dgrad);
//   wgrad  D_g [N, K]   = A_g [N, m_g] B_g [K, m_g]^T, the reduction along the groups' rows:
//          A = dY^T [N, M], B = X^T [K, M], D [E, N, K].
// TMA needs every operand's base 16-byte aligned, and CUTLASS also asks the contiguous extent
// to be a multiple of 16 bytes. A group's first row is at any offset, so the wgrad's operands are
// first packed with each group starting at a multiple of 16 columns and zero-padded to one
// (packed_start, packed_columns); the rows problem needs only K and N * sizeof(D) multiples of
// 16 bytes.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define FP8OPS_HD __host__ __device__ __forceinline__
#else
#define FP8OPS_HD inline
#endif

namespace fp8ops::grouped {

constexpr int64_t kAlign = 16;  // FP8 elements per 16 bytes: the TMA base alignment
constexpr int64_t kTile = 128;  // the kernel's tile along M and N

struct Span {
  int64_t start;  // first row of the group
  int64_t rows;   // its row count (0 for an empty group)
};

// Group g's rows, clamped so that offsets that are out of order or past `total` rows can never
// address memory outside the operands (the op checks them; this keeps a bad tensor harmless).
FP8OPS_HD Span group_span(const int32_t* offsets, int g, int64_t total) {
  int64_t lo = 0;
  for (int h = 0; h < g; ++h) {  // the running clamp of every earlier end: O(g), setup only
    int64_t e = offsets[h];
    lo = e < lo ? lo : (e > total ? total : e);
  }
  int64_t hi = offsets[g];
  hi = hi < lo ? lo : (hi > total ? total : hi);
  return {lo, hi - lo};
}

FP8OPS_HD int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Columns a group takes in the wgrad's packed operands: its rows rounded up to 16.
FP8OPS_HD int64_t packed_columns(int64_t rows) { return round_up(rows, kAlign); }

// Group g's first column in the packed operands: the packed columns of the groups before it.
FP8OPS_HD int64_t packed_start(const int32_t* offsets, int g, int64_t total) {
  int64_t lo = 0, at = 0;
  for (int h = 0; h < g; ++h) {
    int64_t e = offsets[h];
    e = e < lo ? lo : (e > total ? total : e);
    at += packed_columns(e - lo);
    lo = e;
  }
  return at;
}

// The packed operands' row length for M rows in E groups: enough for any offsets.
FP8OPS_HD int64_t packed_length(int64_t m, int groups) { return round_up(m, kAlign) + kAlign * groups; }

// The problem of one group as CUTLASS takes it (M, N, K of D = A B^T) and where its operands
// start, in elements of A, B and D. An empty group gets M = 0: no tiles (the launcher zeroes its
// wgrad output, which a K = 0 problem would leave unwritten).
struct Problem {
  int m, n, k;
  int64_t a_offset, b_offset, d_offset;
  int64_t lda, ldb, ldd;  // leading dimensions (elements)
};

FP8OPS_HD Problem rows_problem(Span s, int g, int64_t n, int64_t k) {
  return {static_cast<int>(s.rows), static_cast<int>(n), static_cast<int>(k),
          s.start * k, g * n * k, s.start * n, k, k, n};
}

// packed_start: the group's first column in the packed operands (sum of packed_columns of the
// earlier groups); n, k: the output's [N, K]; ld: packed_length. The reduction runs over the
// group's packed columns, whose padding the packing fills with zeros (0 * 0 adds nothing), so
// that K too is a multiple of 16 as CUTLASS's alignment check asks.
FP8OPS_HD Problem wgrad_problem(Span s, int g, int64_t packed_start, int64_t n, int64_t k, int64_t ld) {
  return {s.rows ? static_cast<int>(n) : 0, static_cast<int>(k), static_cast<int>(packed_columns(s.rows)),
          packed_start, packed_start, g * n * k, ld, ld, k};
}

// Output tiles of a problem (the persistent grid's work): ceil(M / 128) * ceil(N / 128).
FP8OPS_HD int64_t tiles(const Problem& p) { return ((p.m + kTile - 1) / kTile) * ((p.n + kTile - 1) / kTile); }

// The group of row r for the per-group casts: the first g with offsets[g] > r (searchsorted,
// right), or `groups` when r is past the last group. Unsorted offsets still give a g in
// [0, groups], so a bad tensor never sends a row outside the per-group buffers.
FP8OPS_HD int row_group(const int32_t* offsets, int groups, int64_t r) {
  int lo = 0, hi = groups;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (offsets[mid] > r) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

}  // namespace fp8ops::grouped
