// Blockwise 1x128 casts of x [rows, cols] and of its transpose from one read of x: the copies the
// forward and the wgrad GEMM need (X and X^T, dY and dY^T), bit-exact with two calls of
// quantize_blockwise (1x128) on x and on x^T (fp8ops/ops/fused.py quantize_blockwise_pair).
//
// One 128x128 tile of x per block, staged in shared memory: each row's 128 elements are one block
// of x's copy, each column's 128 elements one block of the transposed copy, so both amaxes are
// complete in the tile. The transposed bytes are staged again (column-major) and written out in
// 4-byte words along rows of data_t.
#include "common.cuh"

namespace fp8ops {
namespace {

constexpr int kTile = kBlockwisePairTile;
constexpr int kThreads = 256;

// kVec: 16-byte loads (x 16-byte aligned, cols a multiple of the vector): a vector is wholly
// inside x or wholly outside.
template <typename T, Fp8 F, bool kVec>
__global__ void __launch_bounds__(kThreads) blockwise_pair_kernel(QuantizeBlockwisePairParams p, int64_t tiles_c,
                                                                  bool words_t) {
  constexpr int N = kVec ? 16 / int(sizeof(T)) : 1;
  constexpr int kLdT = blockwise_pair_row_elems(sizeof(T));  // tile row stride: 16-byte rows
  constexpr int kLdQ = kBlockwisePairStageLd;                // staged bytes: odd words per row
  constexpr int kPerRow = kTile / N;                         // threads per tile row
  constexpr int kRowsPerPass = kThreads / kPerRow;
  extern __shared__ __align__(16) unsigned char smem[];
  T* tile = reinterpret_cast<T*>(smem);                             // [kTile][kLdT]
  uint8_t* staged = smem + size_t(kTile) * kLdT * sizeof(T);        // [kTile cols][kLdQ]
  __shared__ unsigned row_m[kTile], col_m[kTile];

  const T* __restrict__ x = static_cast<const T*>(p.x);
  const int64_t tr = blockIdx.x / tiles_c, tc = blockIdx.x % tiles_c;
  const int64_t r0 = tr * kTile, c0 = tc * kTile;
  const int nr = int(p.rows - r0 < kTile ? p.rows - r0 : kTile);
  const int nc = int(p.cols - c0 < kTile ? p.cols - c0 : kTile);
  const int t = threadIdx.x;
  if (t < kTile) row_m[t] = col_m[t] = 0u;
  __syncthreads();

  // 1. the tile (zeros outside x: they change no amax) and the rows' amaxes
  const int lc = (t % kPerRow) * N;
  for (int r = t / kPerRow; r < kTile; r += kRowsPerPass) {
    Pack<T, N> a;
    unsigned m = 0;
    if (r < nr && lc < nc) {
      if constexpr (kVec) {
        a = *reinterpret_cast<const Pack<T, N>*>(x + (r0 + r) * p.cols + c0 + lc);
      } else {
        a.v[0] = x[(r0 + r) * p.cols + c0 + lc];
      }
#pragma unroll
      for (int k = 0; k < N; ++k) m = max(m, abs_bits(to_float(a.v[k])));
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k) a.v[k] = from_float<T>(0.0f);
    }
    *reinterpret_cast<Pack<T, N>*>(tile + r * kLdT + lc) = a;
    if (m) atomicMax(&row_m[r], m);
  }
  __syncthreads();

  // 2. the columns' amaxes: a thread per column and half of the rows
  {
    const int c = t % kTile, h = t / kTile;
    unsigned m = 0;
    for (int r = h * (kTile / 2); r < (h + 1) * (kTile / 2); ++r) m = max(m, abs_bits(to_float(tile[r * kLdT + c])));
    if (m) atomicMax(&col_m[c], m);
  }
  __syncthreads();

  // 3. x's copy: blocks along the rows, written as read
  for (int r = t / kPerRow; r < nr; r += kRowsPerPass) {
    const BlockScale s = block_scale<F>(row_m[r], p.power_of_two);
    if (lc < nc) {
      const Pack<T, N> a = *reinterpret_cast<const Pack<T, N>*>(tile + r * kLdT + lc);
      Pack<uint8_t, N> q;
#pragma unroll
      for (int k = 0; k < N; ++k) q.v[k] = block_quant<F>(to_float(a.v[k]), s);
      *reinterpret_cast<Pack<uint8_t, N>*>(p.data + (r0 + r) * p.cols + c0 + lc) = q;
    }
    if (lc == 0) p.scale_inv[tc * p.rows + r0 + r] = s.scale_inv;  // rows contiguous
  }

  // 4. the transposed copy: blocks along the columns, staged column by column
  {
    const int c = t % kTile, h = t / kTile;
    const BlockScale s = block_scale<F>(col_m[c], p.power_of_two);
    for (int r = h * (kTile / 2); r < (h + 1) * (kTile / 2); r += 4) {
      uint32_t w = 0;
#pragma unroll
      for (int k = 0; k < 4; ++k) w |= uint32_t(block_quant<F>(to_float(tile[(r + k) * kLdT + c]), s)) << (8 * k);
      *reinterpret_cast<uint32_t*>(staged + c * kLdQ + r) = w;
    }
    if (h == 0 && c < nc) p.scale_inv_t[tr * p.cols + c0 + c] = s.scale_inv;
  }
  __syncthreads();
  const int warp = t / 32, lane = t % 32;
  for (int c = warp; c < nc; c += kThreads / 32) {
    uint8_t* out = p.data_t + (c0 + c) * p.rows + r0;  // row c of data_t, from column r0
    const int r = lane * 4;
    if (words_t) {  // rows % 4 == 0: nr is too, and every word is whole
      if (r < nr) *reinterpret_cast<uint32_t*>(out + r) = *reinterpret_cast<const uint32_t*>(staged + c * kLdQ + r);
    } else {
      for (int k = 0; k < 4; ++k)
        if (r + k < nr) out[r + k] = staged[c * kLdQ + r + k];
    }
  }
}

template <typename K>
void launch_pair(K kernel, unsigned grid, size_t smem, cudaStream_t stream, const QuantizeBlockwisePairParams& p,
                 int64_t tiles_c, bool words_t) {
  FP8OPS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  launch_kernel_smem(kernel, grid, kThreads, smem, stream, p, tiles_c, words_t);
}

}  // namespace

void launch_quantize_blockwise_pair(const QuantizeBlockwisePairParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return;
  dispatch_input(p.x_dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const BlockwisePairPlan plan = plan_blockwise_pair(p.rows, p.cols, int(sizeof(T)));
    const int64_t grid = plan.tiles_r * plan.tiles_c;
    if (grid > 0x7fffffff) throw std::invalid_argument("fp8ops: quantize_blockwise_pair: tensor too large");
    constexpr int N = 16 / sizeof(T);
    const bool vec = aligned(p.x, 16) && p.cols % N == 0 && aligned(p.data, N);
    const bool words_t = p.rows % 4 == 0 && aligned(p.data_t, 4);
    dispatch_fp8(p.out_dtype, [&](auto fmt) {
      constexpr Fp8 F = decltype(fmt)::value;
      if (vec) {
        launch_pair(blockwise_pair_kernel<T, F, true>, unsigned(grid), plan.smem_bytes, stream, p, plan.tiles_c,
                    words_t);
      } else {
        launch_pair(blockwise_pair_kernel<T, F, false>, unsigned(grid), plan.smem_bytes, stream, p, plan.tiles_c,
                    words_t);
      }
    });
  });
}

}  // namespace fp8ops
