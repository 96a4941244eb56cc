// cast_stats on the GPU: fp8ops.monitor's statistics of one cast in one pass and one kernel, no
// host sync. The same counts and amax as csrc/stats_cpu.cpp and fp8ops/ops/emulation.py
// (cast_stats): each value read back as raw * multiplier, one float32 multiply.
#include <atomic>

#include "common.cuh"

namespace fp8ops {
namespace {

constexpr int kThreads = 256;
constexpr int kChunk = 8;  // consecutive elements of a row per thread and step (one vector load)
constexpr unsigned kInfBits = 0x7f800000u, kNanBits = 0x7fc00000u;

// v / d for d > 0, a shift when d is a power of two (the usual blocks: 1, 32, 128).
struct Divisor {
  int64_t d;
  int shift;  // -1: not a power of two
};
Divisor divisor(int64_t d) {
  int s = 0;
  while (s < 62 && (int64_t(1) << s) < d) ++s;
  return {d, d > 0 && (int64_t(1) << s) == d ? s : -1};
}
__device__ __forceinline__ int64_t divide(int64_t v, const Divisor& q) { return q.shift >= 0 ? v >> q.shift : v / q.d; }

// The problem as the kernel walks it: rows of `cols` elements cut into chunks of kChunk, thread
// after thread (consecutive threads, consecutive chunks of a row); strides in elements. The
// launcher may swap the two dimensions so that the walk runs along x's contiguous one.
struct Walk {
  int64_t rows, cols, chunks_per_row;
  int64_t sx0, sx1, sd0, sd1, ss0, ss1;
  Divisor br, bc;  // unused when one
  bool one;        // one multiplier (per-tensor)
  bool vec;        // x and data rows contiguous and aligned: whole chunks in one vector load each
  bool chunk_scale;  // a chunk lies in one block column (block_cols % kChunk == 0)
};

__device__ __forceinline__ float multiplier(float s) { return s; }
__device__ __forceinline__ float multiplier(uint8_t e) { return e8m0_to_float(e); }

template <typename T, Fp8 F, typename S>
__global__ void __launch_bounds__(kThreads)
cast_stats_kernel(const T* __restrict__ x, const uint8_t* __restrict__ data, const S* __restrict__ scales,
                  Walk w, unsigned long long* __restrict__ counts, unsigned* __restrict__ amax) {
  constexpr float kMax = Fp8Traits<F>::kMax;
  constexpr float kMargin = 1.0f + 1.0f / float(2 << Fp8Traits<F>::kMbits);  // half an ulp of max above it
  unsigned sat = 0, under = 0, nonfinite = 0, m = 0;  // m: max |x| as bits (NaN bits above inf)
  const float m0 = w.one ? multiplier(scales[0]) : 0.0f;

  // the thread's first chunk (r, cc) and its step through the chunks, as whole rows and a rest
  const int64_t cpr = w.chunks_per_row, nthreads = int64_t(gridDim.x) * blockDim.x;
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t r = t / cpr, cc = t - r * cpr;
  const int64_t step_r = nthreads / cpr, step_c = nthreads - step_r * cpr;

  for (; r < w.rows;) {
    const int64_t c0 = cc * kChunk;
    const int n = int(w.cols - c0 < kChunk ? w.cols - c0 : kChunk);
    const T* xr = x + r * w.sx0;
    const uint8_t* dr = data + r * w.sd0;
    // past the row's end: x = 0 and raw = 0, which count nowhere whatever the multiplier
    float xv[kChunk], mul[kChunk];
    uint8_t dv[kChunk];
    if (w.vec && n == kChunk) {
      const Pack<T, kChunk> a = *reinterpret_cast<const Pack<T, kChunk>*>(xr + c0);
      const Pack<uint8_t, kChunk> b = *reinterpret_cast<const Pack<uint8_t, kChunk>*>(dr + c0);
#pragma unroll
      for (int k = 0; k < kChunk; ++k) {
        xv[k] = to_float(a.v[k]);
        dv[k] = b.v[k];
      }
    } else {
#pragma unroll
      for (int k = 0; k < kChunk; ++k) {
        xv[k] = k < n ? to_float(xr[(c0 + k) * w.sx1]) : 0.0f;
        dv[k] = k < n ? dr[(c0 + k) * w.sd1] : uint8_t(0);
      }
    }
    if (w.one) {
#pragma unroll
      for (int k = 0; k < kChunk; ++k) mul[k] = m0;
    } else {
      const S* sr = scales + divide(r, w.br) * w.ss0;
      if (w.chunk_scale) {
        const float s = multiplier(sr[divide(c0, w.bc) * w.ss1]);
#pragma unroll
        for (int k = 0; k < kChunk; ++k) mul[k] = s;
      } else {
#pragma unroll
        for (int k = 0; k < kChunk; ++k) mul[k] = k < n ? multiplier(sr[divide(c0 + k, w.bc) * w.ss1]) : 0.0f;
      }
    }
#pragma unroll
    for (int k = 0; k < kChunk; ++k) {
      const float xf = xv[k], raw = fp8_to_float<F>(dv[k]);
      const unsigned ab = abs_bits(xf);
      m = max(m, ab);
      const bool finite = ab < kInfBits;
      nonfinite += !finite;
      const float dq = __fmul_rn(raw, mul[k]);
      sat += finite && fabsf(raw) == kMax && fabsf(xf) > __fmul_rn(fabsf(dq), kMargin);
      under += finite && xf != 0.0f && dq == 0.0f;
    }
    cc += step_c;
    r += step_r;
    if (cc >= cpr) {
      cc -= cpr;
      ++r;
    }
  }

  // the block's sums and max, then one atomic per output
  unsigned long long c[3] = {sat, under, nonfinite};
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
    for (int k = 0; k < 3; ++k) c[k] += __shfl_xor_sync(0xffffffffu, c[k], o);
  }
  m = warp_max(m);
  __shared__ unsigned long long warp_c[3][kThreads / 32];
  __shared__ unsigned warp_m[kThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < 3; ++k) warp_c[k][warp] = c[k];
    warp_m[warp] = m;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int v = 1; v < kThreads / 32; ++v) {
#pragma unroll
    for (int k = 0; k < 3; ++k) c[k] += warp_c[k][v];
    m = max(m, warp_m[v]);
  }
#pragma unroll
  for (int k = 0; k < 3; ++k)
    if (c[k]) atomicAdd(counts + k, c[k]);
  if (m > kInfBits) m = kNanBits;  // any NaN: the one quiet NaN, which every block agrees on
  if (m) atomicMax(amax, m);
}

// Multiprocessor count per device, cached: it sizes the grid on every call.
int sm_count() {
  static std::atomic<int> cache[64];
  int dev = 0;
  FP8OPS_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= 64) {
    int n = 0;
    FP8OPS_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    return n;
  }
  int n = cache[dev].load(std::memory_order_relaxed);
  if (n == 0) {
    FP8OPS_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    cache[dev].store(n, std::memory_order_relaxed);
  }
  return n;
}

// Blocks of one kernel resident per multiprocessor (asked once per instantiation): the grid is
// one full wave of them, each block striding over its share.
template <typename T, Fp8 F, typename S>
int resident_blocks() {
  static std::atomic<int> cached{0};
  int n = cached.load(std::memory_order_relaxed);
  if (n == 0) {
    FP8OPS_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, cast_stats_kernel<T, F, S>, kThreads, 0));
    n = n < 1 ? 1 : n;
    cached.store(n, std::memory_order_relaxed);
  }
  return n;
}

}  // namespace

void launch_cast_stats(const CastStatsParams& p, cudaStream_t stream) {
  if (p.rows < 0 || p.cols < 0) throw std::invalid_argument("fp8ops: cast_stats: negative size");
  const bool one = p.block_rows == 0 && p.block_cols == 0;
  if (!one && (p.block_rows < 1 || p.block_cols < 1))
    throw std::invalid_argument("fp8ops: cast_stats: block_rows and block_cols must both be 0 or positive");
  if (one ? p.scale_dtype != DType::kFloat32 : p.scale_dtype != DType::kFloat32 && p.scale_dtype != DType::kUInt8)
    throw std::invalid_argument("fp8ops: cast_stats: scale_inv must be float32 (or uint8 E8M0 bytes per block)");
  FP8OPS_CUDA_CHECK(cudaMemsetAsync(p.counts, 0, 3 * sizeof(int64_t), stream));
  FP8OPS_CUDA_CHECK(cudaMemsetAsync(p.amax, 0, sizeof(float), stream));
  if (p.rows == 0 || p.cols == 0) return;

  // Walk along x's contiguous dimension (a transposed view walks its columns): the statistics
  // are the same over the transposed problem.
  const bool swap = (p.x_stride1 != 1 && p.x_stride0 == 1 && p.rows > 1) || (p.cols == 1 && p.rows > 1);
  Walk w{};
  w.rows = swap ? p.cols : p.rows;
  w.cols = swap ? p.rows : p.cols;
  w.chunks_per_row = (w.cols + kChunk - 1) / kChunk;
  w.sx0 = swap ? p.x_stride1 : p.x_stride0;
  w.sx1 = swap ? p.x_stride0 : p.x_stride1;
  w.sd0 = swap ? p.data_stride1 : p.data_stride0;
  w.sd1 = swap ? p.data_stride0 : p.data_stride1;
  w.ss0 = swap ? p.scale_stride1 : p.scale_stride0;
  w.ss1 = swap ? p.scale_stride0 : p.scale_stride1;
  w.one = one;
  if (!one) {
    w.br = divisor(swap ? p.block_cols : p.block_rows);
    w.bc = divisor(swap ? p.block_rows : p.block_cols);
    w.chunk_scale = w.bc.d % kChunk == 0;
  }
  const int64_t chunks = w.rows * w.chunks_per_row;
  dispatch_input(p.x_dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    w.vec = w.sx1 == 1 && w.sd1 == 1 && w.sx0 % kChunk == 0 && w.sd0 % kChunk == 0 &&
            aligned(p.x, kChunk * sizeof(T)) && aligned(p.data, kChunk);
    dispatch_fp8(p.data_dtype, [&](auto fmt) {
      constexpr Fp8 F = decltype(fmt)::value;
      auto go = [&](auto scale_tag) {
        using S = typename decltype(scale_tag)::type;
        const int64_t wave = int64_t(sm_count()) * resident_blocks<T, F, S>();
        const int64_t need = (chunks + kThreads - 1) / kThreads;
        const unsigned grid = unsigned(need < wave ? need : wave);
        launch_kernel(cast_stats_kernel<T, F, S>, grid, kThreads, stream, static_cast<const T*>(p.x), p.data,
                      static_cast<const S*>(p.scale_inv), w, reinterpret_cast<unsigned long long*>(p.counts),
                      reinterpret_cast<unsigned*>(p.amax));
      };
      if (p.scale_dtype == DType::kUInt8) go(Type<uint8_t>{});
      else go(Type<float>{});
    });
  });
}

}  // namespace fp8ops
