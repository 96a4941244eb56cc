// Per-tensor cast kernels: amax, quantize (nearest / stochastic) with amax in the same pass,
// the fused quantize + transpose + amax, and dequantize; the same casts over a stack of experts.
// Numerics: docs/design.md (casts, stochastic rounding).
#include "byte_tile.cuh"
#include "cast_experts.h"
#include "cast_pack.cuh"

namespace fp8ops {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 2048;  // grid-stride beyond this: fewer amax atomics, same bandwidth

// A flat range [0, n) split into a scalar head (until the input is 16-byte aligned), a body of
// N-element vectors, and a scalar tail; head == n makes everything scalar.
struct FlatPlan {
  int64_t n, head, nvec;
};

template <int N>
FlatPlan plan_flat(int64_t n, int64_t head) {
  return {n, head, (n - head) / N};
}

template <int N, typename VecFn, typename OneFn>
__device__ __forceinline__ void for_each_flat(const FlatPlan& p, VecFn&& vec_fn, OneFn&& one_fn) {
  const int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t v = tid; v < p.nvec; v += stride) vec_fn(p.head + v * N);
  const int64_t body_end = p.head + p.nvec * N, rest = p.head + (p.n - body_end);
  for (int64_t r = tid; r < rest; r += stride) one_fn(r < p.head ? r : body_end + (r - p.head));
}

template <int N>
int flat_blocks(const FlatPlan& p) {
  const int64_t scalar = p.n - p.nvec * N;
  return grid_for(p.nvec > scalar ? p.nvec : scalar, kThreads, kMaxBlocks);
}

// ---- amax ---------------------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ void amax_body(const T* __restrict__ x, const FlatPlan& plan, unsigned* __restrict__ out) {
  constexpr int N = 16 / sizeof(T);
  unsigned m = 0;
  for_each_flat<N>(
      plan,
      [&](int64_t i) {
        Pack<T, N> a = *reinterpret_cast<const Pack<T, N>*>(x + i);
#pragma unroll
        for (int k = 0; k < N; ++k) m = max(m, abs_bits(to_float(a.v[k])));
      },
      [&](int64_t i) { m = max(m, abs_bits(to_float(x[i]))); });
  m = block_max(m);
  if (threadIdx.x == 0 && m) atomicMax(out, m);
}

template <typename T>
__global__ void amax_kernel(const T* __restrict__ x, FlatPlan plan, unsigned* __restrict__ out) {
  amax_body(x, plan, out);
}

// ---- quantize (flat) ----------------------------------------------------------------------------
// The scale a cast multiplies by: given, or from the amax on the device (current scaling); block
// 0 publishes it and its reciprocal when asked.
__device__ __forceinline__ float cast_scale_of(const QuantizeParams& p) {
  const float s = p.scale_amax != nullptr
                      ? scale_from_amax(*p.scale_amax, 1.0f, p.fp8_max, p.margin, p.power_of_two)
                      : *p.scale;
  if (p.out_scale != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
    *p.out_scale = s;
    *p.out_scale_inv = rcp_rn(s);
  }
  return s;
}

// Thread 0 of each block, m its block's max |x| bits: fold m into the amax, and in the last block
// to finish (every other block's max is in by then), record the amax as record_amax_kernel does.
__device__ __forceinline__ void finish_amax(const QuantizeParams& p, unsigned m) {
  if (p.amax == nullptr) return;
  if (m) atomicMax(reinterpret_cast<unsigned*>(p.amax), m);
  if (p.pending_amax == nullptr) return;
  __threadfence();
  if (atomicAdd(p.blocks_done, 1u) != gridDim.x - 1) return;
  __threadfence();
  const float a = __uint_as_float(atomicOr(reinterpret_cast<unsigned*>(p.amax), 0u));
  if (isfinite(a)) {
    *p.pending_amax = fmaxf(*p.pending_amax, a);
  } else {
    *p.nonfinite_count += 1;
  }
}

// The Philox stream of a stochastic cast: from the device buffer when there is one.
__device__ __forceinline__ uint64_t stream_seed(const QuantizeParams& p) {
  return p.rng != nullptr ? static_cast<uint64_t>(p.rng[0]) : p.seed;
}
__device__ __forceinline__ uint64_t stream_offset(const QuantizeParams& p) {
  return p.rng != nullptr ? static_cast<uint64_t>(p.rng[1]) : p.offset;
}

template <typename T, Fp8 F, bool kStoch>
__device__ __forceinline__ void quantize_body(const QuantizeParams& p, const FlatPlan& plan) {
  constexpr int N = 16 / sizeof(T);
  const T* __restrict__ x = static_cast<const T*>(p.x);
  const float s = cast_scale_of(p);
  RandomWords rw(stream_seed(p), stream_offset(p));
  unsigned m = 0;
  for_each_flat<N>(
      plan,
      [&](int64_t i) {
        Pack<T, N> a = *reinterpret_cast<const Pack<T, N>*>(x + i);
        *reinterpret_cast<Pack<uint8_t, N>*>(p.data + i) = quant_pack<T, F, kStoch, N>(a, s, p.via, rw, i, m);
      },
      [&](int64_t i) {
        float v = through(to_float(x[i]), p.via);
        m = max(m, abs_bits(v));
        p.data[i] = quant_one<F, kStoch>(v, s, rw, i);
      });
  m = block_max(m);
  if (threadIdx.x == 0) finish_amax(p, m);
}

template <typename T, Fp8 F, bool kStoch>
__global__ void quantize_kernel(QuantizeParams p, FlatPlan plan) {
  quantize_body<T, F, kStoch>(p, plan);
}

// ---- quantize + transpose -----------------------------------------------------------------------
// One 128x128 tile of the [rows, cols] view per block (blockIdx.x): coalesced row reads, a batch of them issued
// before the first is used; the row-wise bytes written as read and staged in shared memory; then
// the transposed rows of data_t [cols, rows].
template <typename T, Fp8 F, bool kStoch, bool kVec>
__device__ __forceinline__ void quantize_transpose_body(const QuantizeParams& p, int64_t rows, int64_t tiles_c,
                                                        bool words_t) {
  constexpr int N = kVec ? 16 / sizeof(T) : 1;
  constexpr int kPerRow = kByteTile / N;  // threads along a tile row
  constexpr int kRowsPerPass = kByteTileThreads / kPerRow, kPasses = kByteTile / kRowsPerPass;
  constexpr int kBatch = kPasses < 4 ? kPasses : 4;  // reads in flight per thread
  __shared__ alignas(16) ByteTile tile;

  const T* __restrict__ x = static_cast<const T*>(p.x);
  const int64_t cols = p.cols;
  const float s = cast_scale_of(p);
  RandomWords rw(stream_seed(p), stream_offset(p));
  unsigned m = 0;
  const int tc = (threadIdx.x % kPerRow) * N, tr = threadIdx.x / kPerRow;

  const int64_t r0 = (blockIdx.x / tiles_c) * kByteTile, c0 = (blockIdx.x % tiles_c) * kByteTile;
  const int64_t gc = c0 + tc;
#pragma unroll 1
  for (int b = 0; b < kPasses; b += kBatch) {
    Pack<T, N> a[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int64_t gr = r0 + tr + (b + k) * kRowsPerPass;
      // with kVec, cols % N == 0: a vector is wholly in range or wholly out
      if (gr < rows && gc < cols) a[k] = *reinterpret_cast<const Pack<T, N>*>(x + gr * cols + gc);
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int r = tr + (b + k) * kRowsPerPass;
      const int64_t i = (r0 + r) * cols + gc;
      if (r0 + r >= rows || gc >= cols) continue;
      const Pack<uint8_t, N> q = quant_pack<T, F, kStoch, N>(a[k], s, p.via, rw, i, m);
      *reinterpret_cast<Pack<uint8_t, N>*>(p.data + i) = q;
      *reinterpret_cast<Pack<uint8_t, N>*>(tile.at(r, tc)) = q;
    }
  }
  __syncthreads();
  store_byte_tile_transposed(tile, p.data_t, rows, cols, r0, c0, words_t);

  m = block_max(m);
  if (threadIdx.x == 0) finish_amax(p, m);
}

template <typename T, Fp8 F, bool kStoch, bool kVec>
__global__ void __launch_bounds__(kByteTileThreads, 3)
quantize_transpose_kernel(QuantizeParams p, int64_t rows, int64_t tiles_c, bool words_t) {
  quantize_transpose_body<T, F, kStoch, kVec>(p, rows, tiles_c, words_t);
}

// ---- the experts: E matrices of p.n elements each (blockIdx.y), each cast as above casts one ----
// Matrix e's launch parameters: matrix 0's with every pointer advanced to matrix e (its scale,
// amax and published scale are element e of [E] buffers).
template <typename T>
__device__ __forceinline__ QuantizeParams expert_params(QuantizeParams p) {
  const int64_t e = blockIdx.y;
  p.x = static_cast<const T*>(p.x) + e * p.n;
  p.data += e * p.n;
  if (p.data_t != nullptr) p.data_t += e * p.n;
  if (p.scale != nullptr) p.scale += e;
  if (p.scale_amax != nullptr) p.scale_amax += e;
  if (p.amax != nullptr) p.amax += e;
  if (p.out_scale != nullptr) {
    p.out_scale += e;
    p.out_scale_inv += e;
  }
  return p;
}

template <typename T>
__global__ void amax_experts_kernel(const T* __restrict__ x, FlatPlan plan, unsigned* __restrict__ out) {
  amax_body(x + int64_t(blockIdx.y) * plan.n, plan, out + blockIdx.y);
}

template <typename T, Fp8 F>
__global__ void quantize_experts_kernel(QuantizeParams p, FlatPlan plan) {
  quantize_body<T, F, false>(expert_params<T>(p), plan);
}

template <typename T, Fp8 F, bool kVec>
__global__ void __launch_bounds__(kByteTileThreads, 3)
quantize_transpose_experts_kernel(QuantizeParams p, int64_t rows, int64_t tiles_c, bool words_t) {
  quantize_transpose_body<T, F, false, kVec>(expert_params<T>(p), rows, tiles_c, words_t);
}

// ---- dequantize ---------------------------------------------------------------------------------
template <Fp8 F, typename T>
__global__ void dequantize_kernel(DequantizeParams p, FlatPlan plan) {
  constexpr int N = 8;  // 8 FP8 bytes in, 8 elements out
  const float s = *p.scale_inv;
  T* __restrict__ out = static_cast<T*>(p.out);
  for_each_flat<N>(
      plan,
      [&](int64_t i) {
        Pack<uint8_t, N> a = *reinterpret_cast<const Pack<uint8_t, N>*>(p.data + i);
        Pack<T, N> o;
#pragma unroll
        for (int k = 0; k < N; ++k) o.v[k] = from_float<T>(__fmul_rn(fp8_to_float<F>(a.v[k]), s));
        *reinterpret_cast<Pack<T, N>*>(out + i) = o;
      },
      [&](int64_t i) { out[i] = from_float<T>(__fmul_rn(fp8_to_float<F>(p.data[i]), s)); });
}

// The 128x128 tiles of the quantize + transpose kernels over the [n / cols, cols] view: vector
// loads where every row starts aligned, word stores where every transposed row does.
struct TilePlan {
  int64_t rows, tiles_c, tiles;
  bool vec, words_t;
};

template <typename T>
TilePlan plan_tiles(const QuantizeParams& p) {
  constexpr int N = 16 / sizeof(T);
  TilePlan t;
  t.rows = p.n / p.cols;
  t.tiles_c = (p.cols + kByteTile - 1) / kByteTile;
  t.tiles = (t.rows + kByteTile - 1) / kByteTile * t.tiles_c;
  t.vec = aligned(p.x, 16) && aligned(p.data, N) && p.cols % N == 0;
  t.words_t = byte_tile_word_stores(p.data_t, t.rows);
  if (t.tiles > 0x7fffffff) throw std::invalid_argument("fp8ops: quantize: tensor too large");
  return t;
}

template <typename F>
void dispatch_output(DType dt, F&& f) {
  dispatch_input(dt, std::forward<F>(f));  // same three types
}

}  // namespace

void launch_amax(const AmaxParams& p, cudaStream_t stream) {
  FP8OPS_CUDA_CHECK(cudaMemsetAsync(p.amax, 0, sizeof(float), stream));
  if (p.n == 0) return;
  dispatch_input(p.x_dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    FlatPlan plan = plan_flat<16 / sizeof(T)>(p.n, head_to_align16<T>(p.x, p.n));
    launch_kernel(amax_kernel<T>, flat_blocks<16 / sizeof(T)>(plan), kThreads, stream, static_cast<const T*>(p.x), plan,
                                                                reinterpret_cast<unsigned*>(p.amax));
  });
}

void launch_quantize(const QuantizeParams& p, cudaStream_t stream) {
  if (p.pending_amax != nullptr &&
      (p.amax == nullptr || p.nonfinite_count == nullptr || p.blocks_done != reinterpret_cast<unsigned*>(p.amax + 1)))
    throw std::invalid_argument("fp8ops: quantize: recording needs amax and blocks_done = amax + 1");
  if (p.pending_amax != nullptr && p.n == 0)
    throw std::invalid_argument("fp8ops: quantize: an empty cast records in launch_record_amax");
  if (p.out_scale != nullptr && p.n == 0) throw std::invalid_argument("fp8ops: quantize: an empty cast has no block 0");
  if (p.via != DType::kFloat32 && p.via != DType::kBFloat16 && p.via != DType::kFloat16)
    throw std::invalid_argument("fp8ops: quantize: via must be float32, bfloat16 or float16");
  // one memset zeroes the amax and the count of finished blocks after it
  if (p.amax != nullptr)
    FP8OPS_CUDA_CHECK(cudaMemsetAsync(p.amax, 0, p.blocks_done ? 2 * sizeof(float) : sizeof(float), stream));
  if (p.n == 0) return;
  if (p.data_t && p.cols <= 0) throw std::invalid_argument("fp8ops: quantize: cols must be > 0");
  dispatch_input(p.x_dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int N = 16 / sizeof(T);
    dispatch_fp8(p.out_dtype, [&](auto fmt) {
      constexpr Fp8 F = decltype(fmt)::value;
      if (p.data_t) {
        const TilePlan t = plan_tiles<T>(p);
        auto go = [&](auto kernel) {
          launch_kernel(kernel, unsigned(t.tiles), kByteTileThreads, stream, p, t.rows, t.tiles_c, t.words_t);
        };
        if (p.stochastic)
          t.vec ? go(quantize_transpose_kernel<T, F, true, true>) : go(quantize_transpose_kernel<T, F, true, false>);
        else
          t.vec ? go(quantize_transpose_kernel<T, F, false, true>) : go(quantize_transpose_kernel<T, F, false, false>);
      } else {
        int64_t head = head_to_align16<T>(p.x, p.n);
        if (!aligned(p.data + (head < p.n ? head : 0), N)) head = p.n;  // output not aligned alike
        FlatPlan plan = plan_flat<N>(p.n, head);
        auto kernel = p.stochastic ? quantize_kernel<T, F, true> : quantize_kernel<T, F, false>;
        launch_kernel(kernel, flat_blocks<N>(plan), kThreads, stream, p, plan);
      }
    });
  });
}

void launch_amax_experts(const AmaxParams& p, int64_t experts, cudaStream_t stream) {
  if (experts < 0 || experts > 65535) throw std::invalid_argument("fp8ops: amax_experts: experts must be in [0, 65535]");
  if (experts == 0) return;
  FP8OPS_CUDA_CHECK(cudaMemsetAsync(p.amax, 0, experts * sizeof(float), stream));
  if (p.n == 0) return;
  dispatch_input(p.x_dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int N = 16 / sizeof(T);
    // vectors only where every matrix starts 16-byte aligned, as matrix 0 does
    const bool vec = aligned(p.x, 16) && p.n % N == 0;
    FlatPlan plan = plan_flat<N>(p.n, vec ? 0 : p.n);
    launch_kernel(amax_experts_kernel<T>, dim3(flat_blocks<N>(plan), unsigned(experts)), kThreads, stream,
                  static_cast<const T*>(p.x), plan, reinterpret_cast<unsigned*>(p.amax));
  });
}

void launch_quantize_experts(const QuantizeParams& p, int64_t experts, cudaStream_t stream) {
  if (experts < 0 || experts > 65535)
    throw std::invalid_argument("fp8ops: quantize_experts: experts must be in [0, 65535]");
  if (p.stochastic || p.rng != nullptr || p.pending_amax != nullptr || p.blocks_done != nullptr)
    throw std::invalid_argument("fp8ops: quantize_experts: round to nearest, no amax recording");
  if ((p.scale == nullptr) == (p.scale_amax == nullptr))
    throw std::invalid_argument("fp8ops: quantize_experts: give the scales or the amaxes to take them from");
  if (p.via != DType::kFloat32) throw std::invalid_argument("fp8ops: quantize_experts: no via rounding");
  if (experts == 0) return;
  if (p.amax != nullptr) FP8OPS_CUDA_CHECK(cudaMemsetAsync(p.amax, 0, experts * sizeof(float), stream));
  if (p.n == 0) throw std::invalid_argument("fp8ops: quantize_experts: empty matrices have no block to publish a scale");
  if (p.data_t && p.cols <= 0) throw std::invalid_argument("fp8ops: quantize_experts: cols must be > 0");
  dispatch_input(p.x_dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int N = 16 / sizeof(T);
    dispatch_fp8(p.out_dtype, [&](auto fmt) {
      constexpr Fp8 F = decltype(fmt)::value;
      // with cols (or n) a multiple of N every matrix starts aligned as matrix 0 does; rows % 4 == 0
      // (the word stores) keeps every transposed matrix 4-byte aligned alike
      if (p.data_t) {
        const TilePlan t = plan_tiles<T>(p);
        auto kernel = t.vec ? quantize_transpose_experts_kernel<T, F, true> : quantize_transpose_experts_kernel<T, F, false>;
        launch_kernel(kernel, dim3(unsigned(t.tiles), unsigned(experts)), kByteTileThreads, stream, p, t.rows, t.tiles_c,
                      t.words_t);
      } else {
        const bool vec = aligned(p.x, 16) && aligned(p.data, N) && p.n % N == 0;
        FlatPlan plan = plan_flat<N>(p.n, vec ? 0 : p.n);
        launch_kernel(quantize_experts_kernel<T, F>, dim3(flat_blocks<N>(plan), unsigned(experts)), kThreads, stream,
                      p, plan);
      }
    });
  });
}

void launch_dequantize(const DequantizeParams& p, cudaStream_t stream) {
  if (p.n == 0) return;
  dispatch_fp8(p.data_dtype, [&](auto fmt) {
    constexpr Fp8 F = decltype(fmt)::value;
    dispatch_output(p.out_dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      // vector body needs 8-byte aligned input and 8 * sizeof(T)-aligned output at the same index
      int64_t head = int64_t((8 - reinterpret_cast<uintptr_t>(p.data) % 8) % 8);
      if (head > p.n || !aligned(static_cast<T*>(p.out) + head, 8 * sizeof(T))) head = p.n;
      FlatPlan plan = plan_flat<8>(p.n, head);
      launch_kernel(dequantize_kernel<F, T>, flat_blocks<8>(plan), kThreads, stream, p, plan);
    });
  });
}

}  // namespace fp8ops
