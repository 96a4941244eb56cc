// Block-scaled quantizers: MXFP8 (E8M0 scale per block of block_size along one axis) and
// blockwise (float32 scale_inv per block_rows x block_cols tile). Numerics: docs/design.md, "Block
// scaling", bit-exact with fp8ops/ops/emulation.py.
#include "common.cuh"

namespace fp8ops {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 4096;

// ---- MXFP8 (the scale: mx_scale in common.cuh) ---------------------------------------------------

// Blocks of 32 contiguous elements (axis = last): a group of 32 / N lanes holds one block, N
// elements each, and reduces the block's amax with shuffles.
template <typename T, Fp8 F, int N>
__global__ void __launch_bounds__(kThreads) mx_rows_kernel(QuantizeMxParams p, int64_t n_threads) {
  constexpr int kLanes = 32 / N;
  const T* __restrict__ x = static_cast<const T*>(p.x);
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  // every thread of a warp runs the same iterations, so the shuffles see full warps
  for (int64_t t0 = blockIdx.x * (int64_t)blockDim.x; t0 < n_threads; t0 += stride) {
    const int64_t t = t0 + threadIdx.x;
    const bool active = t < n_threads;
    Pack<T, N> a;
    unsigned m = 0;
    if (active) {
      a = *reinterpret_cast<const Pack<T, N>*>(x + t * N);
#pragma unroll
      for (int k = 0; k < N; ++k) m = max(m, abs_bits(to_float(a.v[k])));
    }
#pragma unroll
    for (int o = kLanes / 2; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (!active) continue;
    const MxScale s = mx_scale<F>(m, p.rceil);
    Pack<uint8_t, N> q;
#pragma unroll
    for (int k = 0; k < N; ++k) q.v[k] = mx_quant<F>(to_float(a.v[k]), s);
    *reinterpret_cast<Pack<uint8_t, N>*>(p.data + t * N) = q;
    if (t % kLanes == 0) p.scales[t / kLanes] = s.byte;
  }
}

// Any axis and block size: one thread per block, walking it with stride `inner` (coalesced across
// threads when inner > 1); two passes, the second mostly from cache.
template <typename T, Fp8 F>
__global__ void mx_strided_kernel(QuantizeMxParams p, int64_t n_blocks) {
  const T* __restrict__ x = static_cast<const T*>(p.x);
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; t < n_blocks; t += stride) {
    // block t = (ob, i) with ob = o * (len / bs) + blk; element k at (ob * bs + k) * inner + i
    const int64_t i = t % p.inner, base = (t / p.inner) * p.block_size * p.inner + i;
    unsigned m = 0;
    for (int k = 0; k < p.block_size; ++k) m = max(m, abs_bits(to_float(x[base + k * p.inner])));
    const MxScale s = mx_scale<F>(m, p.rceil);
    for (int k = 0; k < p.block_size; ++k)
      p.data[base + k * p.inner] = mx_quant<F>(to_float(x[base + k * p.inner]), s);
    p.scales[t] = s.byte;
  }
}

template <Fp8 F, typename T>
__global__ void dequantize_mx_kernel(DequantizeMxParams p, int64_t n, int block_shift) {
  T* __restrict__ out = static_cast<T*>(p.out);
  const int64_t nb = p.len / p.block_size;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t f = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; f < n; f += stride) {
    int64_t si;
    if (p.inner == 1) {  // a shift for a power-of-two block (32): no 64-bit division per element
      si = block_shift >= 0 ? f >> block_shift : f / p.block_size;
    } else {
      const int64_t i = f % p.inner, ol = f / p.inner;
      si = ((ol / p.len) * nb + (ol % p.len) / p.block_size) * p.inner + i;
    }
    out[f] = from_float<T>(__fmul_rn(fp8_to_float<F>(p.data[f]), e8m0_to_float(p.scales[si])));
  }
}

// ---- blockwise (the scales: block_scale in common.cuh) ---------------------------------------------
// G threads (a warp or the whole block) per tile: pass 1 the tile's amax, pass 2 the data.
template <typename T, Fp8 F, int G>
__global__ void __launch_bounds__(kThreads) blockwise_kernel(QuantizeBlockwiseParams p, int64_t tiles,
                                                             int64_t tiles_c) {
  const T* __restrict__ x = static_cast<const T*>(p.x);
  const int lane = threadIdx.x % G;
  const int64_t tile = blockIdx.x * int64_t(kThreads / G) + threadIdx.x / G;
  if (tile >= tiles) return;  // uniform over each group of G threads
  const int64_t r0 = tile / tiles_c * p.block_rows, c0 = tile % tiles_c * p.block_cols;
  const int h = int(min(int64_t(p.block_rows), p.rows - r0)), w = int(min(int64_t(p.block_cols), p.cols - c0));
  const int n_el = h * w;
  const T* xt = x + r0 * p.cols + c0;

  unsigned m = 0;
  for (int e = lane; e < n_el; e += G) m = max(m, abs_bits(to_float(xt[int64_t(e / w) * p.cols + e % w])));
  if constexpr (G == 32) {
    m = warp_max(m);
  } else {
    __shared__ unsigned tile_m;
    m = block_max(m);
    if (threadIdx.x == 0) tile_m = m;
    __syncthreads();
    m = tile_m;
  }
  const BlockScale s = block_scale<F>(m, p.power_of_two);
  uint8_t* dt = p.data + r0 * p.cols + c0;
  for (int e = lane; e < n_el; e += G) {
    const int64_t off = int64_t(e / w) * p.cols + e % w;
    dt[off] = block_quant<F>(to_float(xt[off]), s);
  }
  if (lane == 0) p.scale_inv[tile] = s.scale_inv;
}

template <Fp8 F, typename T>
__global__ void dequantize_blockwise_kernel(DequantizeBlockwiseParams p, int64_t tiles_c) {
  T* __restrict__ out = static_cast<T*>(p.out);
  const int64_t n = p.rows * p.cols, stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t f = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; f < n; f += stride) {
    const int64_t r = f / p.cols, c = f % p.cols;
    const float s = p.scale_inv[(r / p.block_rows) * tiles_c + c / p.block_cols];
    out[f] = from_float<T>(__fmul_rn(fp8_to_float<F>(p.data[f]), s));
  }
}

}  // namespace

void launch_quantize_mx(const QuantizeMxParams& p, cudaStream_t stream) {
  if (p.block_size <= 0 || p.len % p.block_size)
    throw std::invalid_argument("fp8ops: quantize_mx: the length along axis must be a multiple of block_size");
  const int64_t n = p.outer * p.len * p.inner;
  if (n == 0) return;
  dispatch_input(p.x_dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_fp8(p.out_dtype, [&](auto fmt) {
      constexpr Fp8 F = decltype(fmt)::value;
      if (p.inner == 1 && p.block_size == 32) {
        constexpr int N = 16 / sizeof(T);
        if (aligned(p.x, 16) && aligned(p.data, N)) {
          launch_kernel(mx_rows_kernel<T, F, N>, grid_for(n / N, kThreads, kMaxBlocks), kThreads, stream, p, n / N);
        } else {
          launch_kernel(mx_rows_kernel<T, F, 1>, grid_for(n, kThreads, kMaxBlocks), kThreads, stream, p, n);
        }
      } else {
        const int64_t n_blocks = n / p.block_size;
        launch_kernel(mx_strided_kernel<T, F>, grid_for(n_blocks, kThreads, kMaxBlocks), kThreads, stream, p, n_blocks);
      }
    });
  });
}

void launch_dequantize_mx(const DequantizeMxParams& p, cudaStream_t stream) {
  if (p.block_size <= 0 || p.len % p.block_size)
    throw std::invalid_argument("fp8ops: dequantize_mx: the length along axis must be a multiple of block_size");
  const int64_t n = p.outer * p.len * p.inner;
  if (n == 0) return;
  dispatch_fp8(p.data_dtype, [&](auto fmt) {
    constexpr Fp8 F = decltype(fmt)::value;
    dispatch_input(p.out_dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      int shift = -1;  // log2(block_size) when it is a power of two
      if ((p.block_size & (p.block_size - 1)) == 0) {
        shift = 0;
        while ((1 << shift) < p.block_size) ++shift;
      }
      launch_kernel(dequantize_mx_kernel<F, T>, grid_for(n, kThreads, kMaxBlocks), kThreads, stream, p, n, shift);
    });
  });
}

void launch_quantize_blockwise(const QuantizeBlockwiseParams& p, cudaStream_t stream) {
  if (p.block_rows <= 0 || p.block_cols <= 0)
    throw std::invalid_argument("fp8ops: quantize_blockwise: block sizes must be positive");
  if (int64_t(p.block_rows) * p.block_cols > 0x7fffffff)
    throw std::invalid_argument("fp8ops: quantize_blockwise: block too large");
  if (p.rows == 0 || p.cols == 0) return;
  const int64_t tiles_c = (p.cols + p.block_cols - 1) / p.block_cols;
  const int64_t tiles = (p.rows + p.block_rows - 1) / p.block_rows * tiles_c;
  dispatch_input(p.x_dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_fp8(p.out_dtype, [&](auto fmt) {
      constexpr Fp8 F = decltype(fmt)::value;
      // big tiles (128x128) get a whole block each; small ones (1x128) a warp each
      const bool big = int64_t(p.block_rows) * p.block_cols >= 2048;
      const int64_t per = big ? 1 : kThreads / 32, grid = (tiles + per - 1) / per;
      if (grid > 0x7fffffff)  // one launch, no grid-stride loop: a larger grid would be truncated
        throw std::invalid_argument("fp8ops: quantize_blockwise: too many blocks for one launch");
      if (big) {
        launch_kernel(blockwise_kernel<T, F, kThreads>, unsigned(grid), kThreads, stream, p, tiles, tiles_c);
      } else {
        launch_kernel(blockwise_kernel<T, F, 32>, unsigned(grid), kThreads, stream, p, tiles, tiles_c);
      }
    });
  });
}

void launch_dequantize_blockwise(const DequantizeBlockwiseParams& p, cudaStream_t stream) {
  if (p.block_rows <= 0 || p.block_cols <= 0)
    throw std::invalid_argument("fp8ops: dequantize_blockwise: block sizes must be positive");
  const int64_t n = p.rows * p.cols;
  if (n == 0) return;
  const int64_t tiles_c = (p.cols + p.block_cols - 1) / p.block_cols;
  dispatch_fp8(p.data_dtype, [&](auto fmt) {
    constexpr Fp8 F = decltype(fmt)::value;
    dispatch_input(p.out_dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      launch_kernel(dequantize_blockwise_kernel<F, T>, grid_for(n, kThreads, kMaxBlocks), kThreads, stream, p, tiles_c);
    });
  });
}

}  // namespace fp8ops
