// MXFP8 copies of x blocked along both axes from one read of x (the copies the forward and the
// wgrad GEMM need), bit-exact with two calls of quantize_mx (block 32) on the zero-padded x
// (fp8ops/ops/fused.py quantize_mx_pair).
//
// A warp owns 32 columns (one row block's width) of a band of 32 rows (one column block's height):
// each lane holds its column's 32 values in registers, so the column block is the lane's own and
// a row block is one warp-wide max. Zeros stand in for the padding (they change no amax).
#include "common.cuh"

namespace fp8ops {
namespace {

constexpr int kB = kMxPairBlock;
constexpr int kThreads = 256;  // 8 warps: 256 columns of a band

template <typename T, Fp8 F>
__global__ void __launch_bounds__(kThreads) mx_pair_kernel(QuantizeMxPairParams p, int64_t cols_p, int64_t col_groups) {
  const T* __restrict__ x = static_cast<const T*>(p.x);
  const int64_t band = blockIdx.x / col_groups, r0 = band * kB;
  const int64_t c = (blockIdx.x % col_groups) * kThreads + threadIdx.x;
  if (c - threadIdx.x % 32 >= cols_p) return;  // the whole warp is past the padded columns
  const bool in_c = c < p.cols;
  float v[kB];
  unsigned m = 0;
#pragma unroll
  for (int i = 0; i < kB; ++i) {
    v[i] = in_c && r0 + i < p.rows ? to_float(x[(r0 + i) * p.cols + c]) : 0.0f;
    m = max(m, abs_bits(v[i]));
  }
  // the column block: this lane's 32 values
  const MxScale cs = mx_scale<F>(m, p.rceil);
  p.col_scales[band * cols_p + c] = cs.byte;
#pragma unroll
  for (int i = 0; i < kB; ++i) p.col_data[(r0 + i) * cols_p + c] = mx_quant<F>(v[i], cs);
  // the row blocks: one per row, across the warp's 32 lanes
  const int64_t block = c / kB;
#pragma unroll
  for (int i = 0; i < kB; ++i) {
    const MxScale rs = mx_scale<F>(warp_max(abs_bits(v[i])), p.rceil);
    if (r0 + i < p.rows) {  // (alike on every lane: the warp shares its rows)
      p.row_data[(r0 + i) * cols_p + c] = mx_quant<F>(v[i], rs);
      if (threadIdx.x % 32 == 0) p.row_scales[(r0 + i) * (cols_p / kB) + block] = rs.byte;
    }
  }
}

}  // namespace

void launch_quantize_mx_pair(const QuantizeMxPairParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return;
  const int64_t rows_p = (p.rows + kB - 1) / kB * kB, cols_p = (p.cols + kB - 1) / kB * kB;
  const int64_t col_groups = (cols_p + kThreads - 1) / kThreads, grid = rows_p / kB * col_groups;
  if (grid > 0x7fffffff) throw std::invalid_argument("fp8ops: quantize_mx_pair: tensor too large");
  dispatch_input(p.x_dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_fp8(p.out_dtype, [&](auto fmt) {
      constexpr Fp8 F = decltype(fmt)::value;
      launch_kernel(mx_pair_kernel<T, F>, unsigned(grid), kThreads, stream, p, cols_p, col_groups);
    });
  });
}

}  // namespace fp8ops
