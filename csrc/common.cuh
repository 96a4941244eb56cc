// Shared device helpers for the fp8ops kernels: error checks, format traits, conversions.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "fp8ops.h"

#define FP8OPS_CUDA_CHECK(expr)                                                              \
  do {                                                                                       \
    cudaError_t err_ = (expr);                                                               \
    if (err_ != cudaSuccess)                                                                 \
      throw std::runtime_error(std::string("fp8ops CUDA error: ") + cudaGetErrorString(err_) + \
                               " at " __FILE__ ":" + std::to_string(__LINE__) + ": " #expr); \
  } while (0)

// After a <<<...>>> launch: catches bad configurations (the launch itself is asynchronous).
#define FP8OPS_CHECK_LAUNCH() FP8OPS_CUDA_CHECK(cudaGetLastError())

namespace fp8ops {

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
__device__ __forceinline__ unsigned abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

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
template <Fp8 F>
__device__ __forceinline__ uint8_t to_fp8(float y) {
  uint8_t q = __nv_cvt_float_to_fp8(y, __NV_SATFINITE, Fp8Traits<F>::kInterp);
  return isnan(y) ? kNanByte : q;
}
// Two at a time (one cvt instruction); a lands in the low byte.
template <Fp8 F>
__device__ __forceinline__ uint16_t to_fp8x2(float a, float b) {
  uint16_t q = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, Fp8Traits<F>::kInterp);
  if (isnan(a)) q = (q & 0xff00u) | kNanByte;
  if (isnan(b)) q = (q & 0x00ffu) | (kNanByte << 8);
  return q;
}
template <Fp8 F>
__device__ __forceinline__ float fp8_to_float(uint8_t b) {
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

// ---- Philox4x32-10 (DESIGN.md section 4) -------------------------------------------------------
__host__ __device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint2 k) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
  for (int r = 0; r < 10; ++r) {
    if (r) k.x += kW0, k.y += kW1;
    uint64_t p0 = uint64_t(c.x) * kM0, p1 = uint64_t(c.z) * kM1;
    c = make_uint4(uint32_t(p1 >> 32) ^ c.y ^ k.x, uint32_t(p1), uint32_t(p0 >> 32) ^ c.w ^ k.y,
                   uint32_t(p0));
  }
  return c;
}

// The random word of flat element i: Philox block j = i / 4, word i % 4. Caches the last block,
// so a thread walking consecutive elements pays one Philox per four.
struct RandomWords {
  uint2 key;
  uint32_t off_lo, off_hi;
  int64_t j = -1;
  uint4 r;
  __device__ RandomWords(uint64_t seed, uint64_t offset)
      : key(make_uint2(uint32_t(seed), uint32_t(seed >> 32))),
        off_lo(uint32_t(offset)), off_hi(uint32_t(offset >> 32)) {}
  __device__ __forceinline__ uint32_t operator()(int64_t i) {
    if ((i >> 2) != j) {
      j = i >> 2;
      r = philox4x32_10(make_uint4(uint32_t(j), uint32_t(uint64_t(j) >> 32), off_lo, off_hi), key);
    }
    int w = int(i & 3);
    return w == 0 ? r.x : w == 1 ? r.y : w == 2 ? r.z : r.w;
  }
};

// Stochastic rounding of scaled y to FP8 (DESIGN.md section 4), given the element's random word.
template <Fp8 F>
__device__ __forceinline__ uint8_t to_fp8_stochastic(float y, uint32_t rnd) {
  using Tr = Fp8Traits<F>;
  if (isnan(y)) return kNanByte;
  y = fminf(fmaxf(y, -Tr::kMax), Tr::kMax);
  float a = fabsf(y);
  if (a == 0.0f) return to_fp8<F>(y);  // keeps the sign of zero
  int ue = max(floor_log2(a), Tr::kEmin) - Tr::kMbits;
  float k = __fmul_rn(a, exp2i(-ue));  // a / ulp, exact
  float fk = floorf(k);
  float u = __fmul_rn(float(rnd >> 8), 0x1p-24f);
  float up = __fsub_rn(k, fk) > u ? 1.0f : 0.0f;
  float mag = fminf(__fmul_rn(__fadd_rn(fk, up), exp2i(ue)), Tr::kMax);
  return to_fp8<F>(copysignf(mag, y));  // exact: mag is an FP8 value
}

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
