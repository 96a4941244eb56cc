// Per-group casts of rows sorted by expert (cast_grouped.h): each group's amax (a warp per row,
// its group by grouped::row_group, one atomic per row), the groups' scales, then the cast of
// every row with its group's scale (a warp per row, or 128x128 tiles with the transposed copy).
// The bytes are those of the dense cast on each group's rows; fp8ops/ops/emulation_grouped.py is
// the definition.
#include "byte_tile.cuh"
#include "cast_grouped.h"
#include "cast_pack.cuh"
#include "grouped_layout.h"

namespace fp8ops {
namespace {

constexpr int kRowWarps = 8;  // rows per block in the row kernels (a warp per row)
constexpr int kMaxRowBlocks = 8192;

__device__ __forceinline__ float group_scale(const GroupedCastParams& p, int g) {
  return p.scale != nullptr ? p.scale[g] : scale_from_amax(p.amax[g], 1.0f, p.fp8_max, p.margin, p.power_of_two);
}

template <typename T, bool kVec>
__global__ void group_amax_kernel(GroupedCastParams p) {
  constexpr int N = kVec ? 16 / sizeof(T) : 1;
  const T* __restrict__ x = static_cast<const T*>(p.x);
  const int lane = threadIdx.x % 32, groups = int(p.groups);
  for (int64_t r = int64_t(blockIdx.x) * kRowWarps + threadIdx.x / 32; r < p.rows;
       r += int64_t(gridDim.x) * kRowWarps) {
    const int g = grouped::row_group(p.offsets, groups, r);
    if (g >= groups) continue;  // (the same for the whole warp)
    unsigned m = 0;
    for (int64_t c = lane * N; c < p.cols; c += 32 * N) {
      const Pack<T, N> a = *reinterpret_cast<const Pack<T, N>*>(x + r * p.cols + c);
#pragma unroll
      for (int k = 0; k < N; ++k) m = max(m, abs_bits(to_float(a.v[k])));
    }
    m = warp_max(m);
    if (m > 0x7f800000u) m = 0x7fc00000u;  // any NaN as the emulation's (its amax is recorded)
    if (lane == 0 && m) atomicMax(reinterpret_cast<unsigned*>(p.amax) + g, m);
  }
}

__global__ void group_scales_kernel(GroupedCastParams p) {
  for (int64_t g = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; g < p.groups; g += int64_t(gridDim.x) * blockDim.x) {
    const float s = group_scale(p, int(g));
    p.out_scale[g] = s;
    p.out_scale_inv[g] = rcp_rn(s);
  }
}

template <typename T, Fp8 F, bool kVec>
__global__ void group_cast_kernel(GroupedCastParams p) {
  constexpr int N = kVec ? 16 / sizeof(T) : 1;
  const T* __restrict__ x = static_cast<const T*>(p.x);
  const int lane = threadIdx.x % 32, groups = int(p.groups);
  RandomWords rw(0, 0);  // (round to nearest: never read)
  for (int64_t r = int64_t(blockIdx.x) * kRowWarps + threadIdx.x / 32; r < p.rows;
       r += int64_t(gridDim.x) * kRowWarps) {
    const int g = grouped::row_group(p.offsets, groups, r);
    uint8_t* __restrict__ out = p.data + r * p.cols;
    if (g >= groups) {
      for (int64_t c = lane * N; c < p.cols; c += 32 * N) *reinterpret_cast<Pack<uint8_t, N>*>(out + c) = Pack<uint8_t, N>{};
      continue;
    }
    const float s = group_scale(p, g);
    unsigned m = 0;
    for (int64_t c = lane * N; c < p.cols; c += 32 * N) {
      const Pack<T, N> a = *reinterpret_cast<const Pack<T, N>*>(x + r * p.cols + c);
      *reinterpret_cast<Pack<uint8_t, N>*>(out + c) = quant_pack<T, F, false, N>(a, s, DType::kFloat32, rw, 0, m);
    }
  }
}

// One 128x128 tile per block, as the dense quantize + transpose kernel, each row with its group's
// scale (read once per tile into shared memory); rows of no group are zero bytes in both copies.
template <typename T, Fp8 F, bool kVec>
__global__ void __launch_bounds__(kByteTileThreads, 3)
group_cast_transpose_kernel(GroupedCastParams p, int64_t tiles_c, bool words_t) {
  constexpr int N = kVec ? 16 / sizeof(T) : 1;
  constexpr int kPerRow = kByteTile / N;
  constexpr int kRowsPerPass = kByteTileThreads / kPerRow, kPasses = kByteTile / kRowsPerPass;
  constexpr int kBatch = kPasses < 4 ? kPasses : 4;
  __shared__ alignas(16) ByteTile tile;
  __shared__ float row_scale[kByteTile];
  __shared__ bool row_owned[kByteTile];

  const T* __restrict__ x = static_cast<const T*>(p.x);
  const int64_t rows = p.rows, cols = p.cols;
  const int64_t r0 = (blockIdx.x / tiles_c) * kByteTile, c0 = (blockIdx.x % tiles_c) * kByteTile;
  if (threadIdx.x < kByteTile) {
    const int64_t r = r0 + threadIdx.x;
    const int g = r < rows ? grouped::row_group(p.offsets, int(p.groups), r) : int(p.groups);
    row_owned[threadIdx.x] = g < p.groups;
    row_scale[threadIdx.x] = g < p.groups ? group_scale(p, g) : 0.0f;
  }
  __syncthreads();
  RandomWords rw(0, 0);
  unsigned m = 0;
  const int tc = (threadIdx.x % kPerRow) * N, tr = threadIdx.x / kPerRow;
  const int64_t gc = c0 + tc;
#pragma unroll 1
  for (int b = 0; b < kPasses; b += kBatch) {
    Pack<T, N> a[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int64_t gr = r0 + tr + (b + k) * kRowsPerPass;
      if (gr < rows && gc < cols) a[k] = *reinterpret_cast<const Pack<T, N>*>(x + gr * cols + gc);
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int r = tr + (b + k) * kRowsPerPass;
      const int64_t i = (r0 + r) * cols + gc;
      if (r0 + r >= rows || gc >= cols) continue;
      const Pack<uint8_t, N> q =
          row_owned[r] ? quant_pack<T, F, false, N>(a[k], row_scale[r], DType::kFloat32, rw, i, m) : Pack<uint8_t, N>{};
      *reinterpret_cast<Pack<uint8_t, N>*>(p.data + i) = q;
      *reinterpret_cast<Pack<uint8_t, N>*>(tile.at(r, tc)) = q;
    }
  }
  __syncthreads();
  store_byte_tile_transposed(tile, p.data_t, rows, cols, r0, c0, words_t);
}

}  // namespace

void launch_quantize_grouped(const GroupedCastParams& p, cudaStream_t stream) {
  if (p.groups < 0 || p.groups > 0x7fffffff || p.rows < 0 || p.cols < 0)
    throw std::invalid_argument("fp8ops: quantize_grouped: bad sizes");
  const bool current = p.scale == nullptr;
  // (no groups: every row is outside them, cast to zeros; the scales are empty, null pointers)
  if (current && p.groups > 0 && (p.out_scale == nullptr || p.out_scale_inv == nullptr))
    throw std::invalid_argument("fp8ops: quantize_grouped: current scaling publishes its scales");
  if (p.groups > 0) FP8OPS_CUDA_CHECK(cudaMemsetAsync(p.amax, 0, p.groups * sizeof(float), stream));
  const bool empty = p.rows == 0 || p.cols == 0;
  dispatch_input(p.x_dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int N = 16 / sizeof(T);
    // vectors where every row starts 16-byte aligned (and its bytes N-byte aligned)
    const bool vec = aligned(p.x, 16) && aligned(p.data, N) && p.cols % N == 0;
    const unsigned row_blocks = unsigned(grid_for(p.rows, kRowWarps, kMaxRowBlocks));
    if (!empty) {
      launch_kernel(vec ? group_amax_kernel<T, true> : group_amax_kernel<T, false>, row_blocks, kRowWarps * 32,
                    stream, p);
    }
    if (current && p.groups > 0)
      launch_kernel(group_scales_kernel, unsigned(grid_for(p.groups, 256, 1024)), 256, stream, p);
    if (empty) return;
    dispatch_fp8(p.out_dtype, [&](auto fmt) {
      constexpr Fp8 F = decltype(fmt)::value;
      if (p.data_t == nullptr) {
        launch_kernel(vec ? group_cast_kernel<T, F, true> : group_cast_kernel<T, F, false>, row_blocks,
                      kRowWarps * 32, stream, p);
        return;
      }
      const int64_t tiles_c = (p.cols + kByteTile - 1) / kByteTile;
      const int64_t tiles = (p.rows + kByteTile - 1) / kByteTile * tiles_c;
      if (tiles > 0x7fffffff) throw std::invalid_argument("fp8ops: quantize_grouped: tensor too large");
      const bool words_t = byte_tile_word_stores(p.data_t, p.rows);
      launch_kernel(vec ? group_cast_transpose_kernel<T, F, true> : group_cast_transpose_kernel<T, F, false>,
                    unsigned(tiles), kByteTileThreads, stream, p, tiles_c, words_t);
    });
  });
}

}  // namespace fp8ops
