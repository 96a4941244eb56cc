// Shared device helpers for the fp8ops kernels: error checks, format traits, conversions.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

#include "fp8ops.h"
#include "philox.h"

#define FP8OPS_CUDA_CHECK(expr)                                                              \
  do {                                                                                       \
    cudaError_t err_ = (expr);                                                               \
    if (err_ != cudaSuccess)                                                                 \
      throw std::runtime_error(std::string("fp8ops CUDA error: ") + cudaGetErrorString(err_) + \
                               " at " __FILE__ ":" + std::to_string(__LINE__) + ": " #expr); \
  } while (0)

namespace fp8ops {

// kernel<<<grid, block, 0, stream>>>(args...), throwing on this launch's own error. The status
// comes from cudaLaunchKernelEx itself: cudaGetLastError() after a <<<>>> launch would also report
// (and clear) an earlier, unrelated asynchronous error and blame it on fp8ops.
template <typename... KArgs, typename... Args>
void launch_kernel(void (*kernel)(KArgs...), dim3 grid, dim3 block, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  FP8OPS_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

// The same with `smem` bytes of dynamic shared memory (the kernel's attribute must allow them).
template <typename... KArgs, typename... Args>
void launch_kernel_smem(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                        Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  FP8OPS_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

// ---- IEEE float32 arithmetic and bit casts, callable from host and device -----------------------
// The scalar helpers below are __host__ __device__ so tests/csrc/host_check.cu can check them
// against fp8ops/ops/emulation.py without a GPU. On the device these are the round-to-nearest
// intrinsics (never contracted into an FMA); on the host they are plain IEEE float32 operations
// (x86-64 SSE, no fast-math; the volatile keeps a host compiler from contracting them).
__host__ __device__ __forceinline__ float bits_as_float(uint32_t b) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(b);
#else
  float f;
  memcpy(&f, &b, 4);
  return f;
#endif
}
__host__ __device__ __forceinline__ uint32_t float_as_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t b;
  memcpy(&b, &f, 4);
  return b;
#endif
}
__host__ __device__ __forceinline__ float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  volatile float r = a * b;
  return r;
#endif
}
__host__ __device__ __forceinline__ float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  volatile float r = a + b;
  return r;
#endif
}
__host__ __device__ __forceinline__ float sub_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  volatile float r = a - b;
  return r;
#endif
}
__host__ __device__ __forceinline__ float div_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  volatile float r = a / b;
  return r;
#endif
}
__host__ __device__ __forceinline__ float rcp_rn(float a) {
#ifdef __CUDA_ARCH__
  return __frcp_rn(a);
#else
  volatile float r = 1.0f / a;
  return r;
#endif
}
__host__ __device__ __forceinline__ double dmul_rn(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dmul_rn(a, b);
#else
  volatile double r = a * b;
  return r;
#endif
}
__host__ __device__ __forceinline__ int clamp_int(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

// Input element -> float32 (exact for all three input types).
template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }

// |v| as ordered bits: for non-negative floats (NaN included, sign cleared) unsigned comparison
// of the bit patterns orders like the values and puts NaN above +inf, so atomicMax on the bits
// is a NaN-propagating float max.
__host__ __device__ __forceinline__ unsigned abs_bits(float v) { return float_as_bits(v) & 0x7fffffffu; }

template <typename T>
struct Type {
  using type = T;
};

// Calls f(Type<T>{}) with T the C++ type of an input dtype (float, bf16, half).
template <typename F>
void dispatch_input(DType dt, F&& f) {
  switch (dt) {
    case DType::kFloat32: f(Type<float>{}); break;
    case DType::kBFloat16: f(Type<__nv_bfloat16>{}); break;
    case DType::kFloat16: f(Type<__half>{}); break;
    default: throw std::invalid_argument("fp8ops: input must be float32, bfloat16 or float16");
  }
}

// ---- FP8 formats ------------------------------------------------------------------------------
enum class Fp8 { kE4M3, kE5M2 };

template <Fp8 F>
struct Fp8Traits;
template <>
struct Fp8Traits<Fp8::kE4M3> {
  static constexpr __nv_fp8_interpretation_t kInterp = __NV_E4M3;
  static constexpr float kMax = 448.0f;
  static constexpr int kEmax = 8, kEmin = -6, kMbits = 3;
};
template <>
struct Fp8Traits<Fp8::kE5M2> {
  static constexpr __nv_fp8_interpretation_t kInterp = __NV_E5M2;
  static constexpr float kMax = 57344.0f;
  static constexpr int kEmax = 15, kEmin = -14, kMbits = 2;
};

constexpr uint8_t kNanByte = 0x7F;  // canonical FP8 NaN (what the emulation writes for any NaN)

// float32 -> FP8 byte: saturate to +-max, round to nearest even, NaN -> 0x7F (cvt.rn.satfinite).
// On the host (tests only) these run cuda_fp8.hpp's software conversions, not the PTX instruction.
template <Fp8 F>
__host__ __device__ __forceinline__ uint8_t to_fp8(float y) {
  uint8_t q = __nv_cvt_float_to_fp8(y, __NV_SATFINITE, Fp8Traits<F>::kInterp);
  return isnan(y) ? kNanByte : q;
}
// Two at a time (one cvt instruction); a lands in the low byte.
template <Fp8 F>
__host__ __device__ __forceinline__ uint16_t to_fp8x2(float a, float b) {
  uint16_t q = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, Fp8Traits<F>::kInterp);
  if (isnan(a)) q = (q & 0xff00u) | kNanByte;
  if (isnan(b)) q = (q & 0x00ffu) | (kNanByte << 8);
  return q;
}
template <Fp8 F>
__host__ __device__ __forceinline__ float fp8_to_float(uint8_t b) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(b, Fp8Traits<F>::kInterp)));
}

// Calls f(std::integral_constant-like tag) with the format of an FP8 dtype.
template <Fp8 F>
struct FmtTag {
  static constexpr Fp8 value = F;
};
template <typename Fn>
void dispatch_fp8(DType dt, Fn&& f) {
  switch (dt) {
    case DType::kE4M3: f(FmtTag<Fp8::kE4M3>{}); break;
    case DType::kE5M2: f(FmtTag<Fp8::kE5M2>{}); break;
    default: throw std::invalid_argument("fp8ops: FP8 dtype must be float8_e4m3fn or float8_e5m2");
  }
}

// float32 -> output element, round to nearest (even).
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// ---- exact float32 bit helpers (match the emulation's frexp / _exp2_f32) ----------------------
// floor(log2(a)) for finite a > 0, subnormals included.
__host__ __device__ __forceinline__ int floor_log2(float a) {
  uint32_t b;
  memcpy(&b, &a, 4);
  int e = int((b >> 23) & 0xff);
  if (e) return e - 127;
  uint32_t m = b & 0x7fffffu;
  int p = 31;
  while (!(m >> p)) --p;  // highest set bit; only subnormals get here
  return p - 149;
}
// 2^e as float32 for integer e in [-149, 127], built from bits.
__host__ __device__ __forceinline__ float exp2i(int e) {
  uint32_t b = e >= -126 ? uint32_t(e + 127) << 23 : 1u << (e + 149);
  float f;
  memcpy(&f, &b, 4);
  return f;
}

// Stochastic rounding of scaled y (docs/design.md, "Stochastic rounding"), given the element's random word: the
// result as float32, an exact FP8 value (or NaN, or y itself for a signed zero).
template <Fp8 F>
__host__ __device__ __forceinline__ float stochastic_value(float y, uint32_t rnd) {
  // The rounding on the float32 bits, in integers: |y| = sig * 2^(e - 23) (sig the 24-bit
  // significand), ulp = 2^ue, k = |y| / ulp = sig / 2^shift. floor(k) and the fraction are the
  // bits of sig above and below `shift`, and fraction > u = m / 2^24 (m = rnd >> 8) is an
  // integer comparison: low * 2^24 > m * 2^shift. The same result as the float formulation.
  using Tr = Fp8Traits<F>;
  if (isnan(y)) return y;
  y = fminf(fmaxf(y, -Tr::kMax), Tr::kMax);
  const uint32_t a = float_as_bits(y) & 0x7fffffffu;
  if (a == 0u) return y;  // keeps the sign of zero
  const int biased = int(a >> 23);
  const int e = biased ? biased - 127 : -126;  // a float32 subnormal: below every FP8 emin
  const uint32_t sig = biased ? (a & 0x7fffffu) | 0x800000u : a;
  const int ue = (e > Tr::kEmin ? e : Tr::kEmin) - Tr::kMbits;
  const int shift = 23 + ue - e;  // >= 23 - mbits
  const uint32_t m = rnd >> 8;
  uint32_t fk, low;
  if (shift < 32) {
    fk = sig >> shift;
    low = sig & ((1u << shift) - 1u);
  } else {
    fk = 0u;
    low = sig;
  }
  bool up;
  if (shift <= 24) {
    up = (low << (24 - shift)) > m;
  } else if (shift - 24 <= 40) {
    up = uint64_t(low) > (uint64_t(m) << (shift - 24));
  } else {  // m * 2^(shift - 24) >= 2^41 > low unless m == 0
    up = m == 0u && low != 0u;
  }
  const float mag = fminf(mul_rn(float(fk + (up ? 1u : 0u)), exp2i(ue)), Tr::kMax);
  return copysignf(mag, y);
}
template <Fp8 F>
__device__ __forceinline__ uint8_t to_fp8_stochastic(float y, uint32_t rnd) {
  if (isnan(y)) return kNanByte;
  return to_fp8<F>(stochastic_value<F>(y, rnd));  // exact: an FP8 value
}

// ---- MXFP8 scale (docs/design.md, "MXFP8"; emulation.mx_exponent) --------------------------
struct MxScale {
  float mul;     // 2^-e
  uint8_t byte;  // e + 127, or 0xFF for a block holding NaN / inf
  bool bad;
};
__host__ __device__ __forceinline__ bool bits_nonfinite(uint32_t abs_bits) { return abs_bits >= 0x7f800000u; }

// E8M0 scale from the block's max |x| (as bits, sign cleared).
template <Fp8 F>
__host__ __device__ __forceinline__ MxScale mx_scale(uint32_t amax_bits, bool rceil) {
  if (bits_nonfinite(amax_bits)) return {0.0f, 0xFF, true};
  int e = -127;  // amax 0
  if (amax_bits) {
    e = floor_log2(bits_as_float(amax_bits)) - Fp8Traits<F>::kEmax;
    // RCEIL: one more when the significand exceeds max / 2^emax = 1.75 (subnormal amax clamps anyway)
    if (rceil && (amax_bits & 0x7fffffu) > 0x600000u) ++e;
    e = clamp_int(e, -127, 127);
  }
  return {exp2i(-e), uint8_t(e + 127), false};
}

// E8M0 byte -> float32 scale: 2^(b - 127) (byte 0 is the subnormal 2^-127), 0xFF -> NaN.
__host__ __device__ __forceinline__ float e8m0_to_float(uint8_t b) {
  return b == 0xFF ? bits_as_float(0x7fc00000u) : exp2i(int(b) - 127);
}

// One element of an MXFP8 block: its byte under the block's scale (NaN bytes for a bad block).
template <Fp8 F>
__device__ __forceinline__ uint8_t mx_quant(float v, const MxScale& s) {
  return s.bad ? kNanByte : to_fp8<F>(__fmul_rn(v, s.mul));
}

// ---- blockwise scales (docs/design.md, "Blockwise"; emulation.blockwise_scales) -------------
struct BlockScale {
  float scale, scale_inv;
  bool bad;
};
// scale = max / amax and scale_inv = amax / max, one correctly rounded division each; amax 0:
// both 1; non-finite amax: scale 1, scale_inv NaN. power_of_two: scale_inv rounded up to a power
// of two (a scale_inv that underflowed to 0 gives 2^0, as frexp(0) in the emulation), scale its
// reciprocal.
template <Fp8 F>
__host__ __device__ __forceinline__ BlockScale block_scale(uint32_t amax_bits, bool power_of_two) {
  constexpr float kMax = Fp8Traits<F>::kMax;
  if (bits_nonfinite(amax_bits)) return {1.0f, bits_as_float(0x7fc00000u), true};
  if (amax_bits == 0) return {1.0f, 1.0f, false};
  const float a = bits_as_float(amax_bits);
  float scale_inv = div_rn(a, kMax);
  float scale = div_rn(kMax, a);
  if (power_of_two) {
    int e = 0;
    if (scale_inv != 0.0f) {
      const int fl = floor_log2(scale_inv);
      e = clamp_int(scale_inv == exp2i(fl) ? fl : fl + 1, -149, 127);
    }
    scale_inv = exp2i(e);
    scale = rcp_rn(scale_inv);
  }
  // amax below max / FLT_MAX: the quotient overflows; FLT_MAX keeps zeros zero (inf * 0 = NaN)
  if (scale > 3.402823466e38f) scale = 3.402823466e38f;
  return {scale, scale_inv, false};
}

// One element of a block: its byte under the block's scale (NaN bytes for a bad block).
template <Fp8 F>
__device__ __forceinline__ uint8_t block_quant(float v, const BlockScale& s) {
  return s.bad ? kNanByte : to_fp8<F>(__fmul_rn(v, s.scale));
}

// ---- delayed scaling, scalar cores (emulation.scale_from_amax / delayed_scale_update) ---------
// scale = max / (amax * margin); amax 0 or non-finite: prev; inf: FLT_MAX; 0: FLT_MIN;
// power_of_two: rounded down to a power of two.
__host__ __device__ __forceinline__ float scale_from_amax(float amax, float prev, float fp8_max, float margin,
                                                          bool power_of_two) {
  if (amax == 0.0f || !isfinite(amax)) return prev;
  float s = div_rn(fp8_max, mul_rn(amax, margin));
  if (isinf(s)) s = FLT_MAX;
  if (s == 0.0f) s = FLT_MIN;
  if (power_of_two && isfinite(s)) s = exp2i(clamp_int(floor_log2(fabsf(s)), -149, 127));
  return s;
}

// step // interval and whether step % interval == 0, with Python's floor semantics.
struct UpdateStep {
  int64_t n_updates;
  bool update;
};
__host__ __device__ __forceinline__ UpdateStep update_step(int64_t step, int64_t interval) {
  int64_t q = step / interval;
  if ((step % interval != 0) && ((step < 0) != (interval < 0))) --q;
  return {q, step - q * interval == 0};
}

// EMA of the representative amax: the first update takes the new amax.
__host__ __device__ __forceinline__ float ema_amax(float a, float b, float newest, float prev, int64_t n_updates) {
  return n_updates <= 1 ? newest : add_rn(mul_rn(a, newest), mul_rn(b, prev));
}

// Index into the ascending sort of the L slots of the nearest-rank percentile over the
// n = clamp(n_updates, 1, L) filled slots: L - n + ceil(q * n) - 1 (rank clamped to [1, L]).
__host__ __device__ __forceinline__ int64_t percentile_index(int64_t n_updates, int64_t L, double q) {
  const int64_t n = n_updates < 1 ? 1 : (n_updates > L ? L : n_updates);
  int64_t rank = int64_t(ceil(dmul_rn(q, double(n))));
  rank = rank < 1 ? 1 : (rank > L ? L : rank);
  return L - n + rank - 1;
}

// Total-order key for sorting floats ascending with NaN last (as torch.sort).
__host__ __device__ __forceinline__ uint32_t sort_key(float v) {
  const uint32_t b = float_as_bits(v);
  if (isnan(v)) return 0xffffffffu;
  return (b & 0x80000000u) ? ~b : b | 0x80000000u;
}
__host__ __device__ __forceinline__ float from_sort_key(uint32_t k) {
  return bits_as_float((k & 0x80000000u) ? k & 0x7fffffffu : ~k);
}
// NaN-propagating max (as torch.amax).
__host__ __device__ __forceinline__ float nan_max(float a, float b) { return (isnan(a) || a > b) ? a : b; }

// NaN-propagating max of |v| as ordered bits, combined over a warp.
__device__ __forceinline__ unsigned warp_max(unsigned m) {
  for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
  return m;
}
// Block-wide max of m; the result is valid in thread 0. blockDim.x must be a multiple of 32.
__device__ __forceinline__ unsigned block_max(unsigned m) {
  __shared__ unsigned warp_m[32];
  m = warp_max(m);
  __syncthreads();  // warp_m may still be read by a previous call
  if ((threadIdx.x & 31) == 0) warp_m[threadIdx.x >> 5] = m;
  __syncthreads();
  m = threadIdx.x < (blockDim.x >> 5) ? warp_m[threadIdx.x] : 0u;
  return threadIdx.x < 32 ? warp_max(m) : m;
}

// N elements of T in one aligned vector (16-byte loads and stores).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// Elements to skip before p is 16-byte aligned (n_max if p is not even element-aligned).
template <typename T>
inline int64_t head_to_align16(const void* p, int64_t n_max) {
  uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (a % sizeof(T)) return n_max;
  int64_t h = int64_t((16 - a % 16) % 16 / sizeof(T));
  return h < n_max ? h : n_max;
}
inline bool aligned(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

inline int grid_for(int64_t n, int threads, int max_blocks = 65535) {
  int64_t b = (n + threads - 1) / threads;
  return static_cast<int>(b < 1 ? 1 : (b > max_blocks ? max_blocks : b));
}

}  // namespace fp8ops
