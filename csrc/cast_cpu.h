// Torch-free helpers of the emulation's CPU cast kernels (mx_cpu.cpp, blockwise_cpu.cpp): each is
// one of the emulation's exact float32 or integer steps, branch-free so that loops vectorize.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_clones.h"

namespace fp8ops_cpu {

FP8OPS_ALWAYS_INLINE uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
FP8OPS_ALWAYS_INLINE float float_of(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// An FP8 format's constants: M explicit mantissa bits, exponent bias B, largest exponent EMAX.
template <int M, int B, int EMAX, int MAXBITS>
struct Fmt {
  static constexpr int kMbits = M, kBias = B, kEmax = EMAX;
  static float max() { return float_of(MAXBITS); }
};
using E4M3 = Fmt<3, 7, 8, 0x43E00000>;    // max 448
using E5M2 = Fmt<2, 15, 15, 0x47600000>;  // max 57344

// float32 y with |y| <= max (or NaN) -> FP8 byte, round to nearest even, NaN -> 0x7F: the value
// torch's float32 -> float8 conversion gives in range, without branches so loops vectorize.
template <class F>
FP8OPS_ALWAYS_INLINE uint8_t to_fp8(float y) {
  const uint32_t b = bits_of(y), a = b & 0x7FFFFFFFu;
  constexpr int kShift = 23 - F::kMbits;
  // normal result: round the mantissa at bit kShift (ties to even), then rebias the exponent
  const uint32_t rounded = a + ((1u << (kShift - 1)) - 1) + ((a >> kShift) & 1u);
  const uint32_t normal = (rounded >> kShift) - (uint32_t(127 - F::kBias) << F::kMbits);
  // subnormal result (|y| below 2^(1 - bias)): round |y| / 2^(1 - bias - M) to an integer, the
  // float32 addition of 2^23 rounding to nearest even; the product is exact (a power of two)
  const float scaled = float_of(a) * float_of(uint32_t(127 + F::kBias - 1 + F::kMbits) << 23);
  const uint32_t sub = bits_of(scaled + 8388608.0f) - 0x4B000000u;
  const uint32_t min_normal = uint32_t(127 + 1 - F::kBias) << 23;
  const uint32_t mag = a < min_normal ? sub : normal;
  const uint32_t byte = mag | ((b >> 24) & 0x80u);
  return a > 0x7F800000u ? uint8_t(0x7F) : uint8_t(byte);
}

// d[i] = FP8 of clamp(x[i] * mult[i]): the cast of n elements (mult: one per element, or with
// stride 0 one for all).
template <class F, int kMultStride>
FP8OPS_ALWAYS_INLINE void scale_and_cast(const float* x, uint8_t* d, const float* mult, int64_t n) {
  const float mx = F::max();
  for (int64_t i = 0; i < n; ++i) {
    float y = x[i] * mult[i * kMultStride];
    y = y < -mx ? -mx : (y > mx ? mx : y);  // NaN passes, as torch.clamp
    d[i] = to_fp8<F>(y);
  }
}

// max |x| as bits (unsigned order of |x|'s bits is the order of the values, NaN above inf):
// of n contiguous elements, or folded element-wise into amax[0, n).
FP8OPS_ALWAYS_INLINE uint32_t abs_max_bits(const float* x, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, bits_of(x[i]) & 0x7FFFFFFFu);
  return m;
}
FP8OPS_ALWAYS_INLINE void abs_max_bits_into(const float* x, uint32_t* amax, int64_t n) {
  for (int64_t i = 0; i < n; ++i) amax[i] = std::max(amax[i], bits_of(x[i]) & 0x7FFFFFFFu);
}

}  // namespace fp8ops_cpu
