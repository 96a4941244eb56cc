// Torch-free helpers of the emulation's CPU kernels (csrc/*_cpu.cpp): each is one of the
// emulation's exact float32 or integer steps, branch-free so that loops vectorize.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

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

// An FP8 format's constants: M explicit mantissa bits, exponent bias B, largest exponent EMAX;
// FIRST_NAN the smallest magnitude byte (sign bit clear) that is NaN; HAS_INF whether the top
// exponent with a zero mantissa is infinity (E5M2) rather than a number (E4M3).
template <int M, int B, int EMAX, int MAXBITS, int FIRST_NAN, bool HAS_INF>
struct Fmt {
  static constexpr int kMbits = M, kBias = B, kEmax = EMAX;
  static constexpr uint32_t kFirstNan = FIRST_NAN;
  static constexpr bool kHasInf = HAS_INF;
  static float max() { return float_of(MAXBITS); }
};
using E4M3 = Fmt<3, 7, 8, 0x43E00000, 0x7F, false>;   // max 448
using E5M2 = Fmt<2, 15, 15, 0x47600000, 0x7D, true>;  // max 57344

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

// FP8 byte -> float32, exact for every byte that is not NaN (both formats are exact in float32).
// A NaN byte gives a NaN whose payload is not torch's: callers that meet one (max_magnitude >=
// F::kFirstNan) leave the conversion to torch.
template <class F>
FP8OPS_ALWAYS_INLINE float from_fp8(uint8_t byte) {
  const uint32_t mag = byte & 0x7Fu;
  constexpr int kShift = 23 - F::kMbits;
  // a normal number: the exponent field rebiased, the mantissa moved to float32's top bits
  const uint32_t normal = (mag << kShift) + (uint32_t(127 - F::kBias) << 23);
  // a subnormal one (exponent field 0): mag * 2^(1 - bias - M), exact
  const float sub = float(int32_t(mag)) * float_of(uint32_t(127 + 1 - F::kBias - F::kMbits) << 23);
  uint32_t bits = mag < (1u << F::kMbits) ? bits_of(sub) : normal;
  if (F::kHasInf) bits = mag >= 0x7Cu ? 0x7F800000u | (mag & 3u) << kShift : bits;
  bits = mag >= F::kFirstNan ? 0x7FC00000u : bits;
  return float_of(bits | uint32_t(byte & 0x80u) << 24);
}

// The multiplier and scale_inv of one blockwise block (docs/design.md, "Blockwise") from its max
// |x| (as bits; NaN above inf), as emulation._block_multipliers (power_of_two false) and
// emulation.blockwise_scales (true) compute them: scale_inv = amax / max (1 for amax 0; rounded
// up to a power of two), the data multiplier max / amax (its exact inverse with power_of_two;
// float32 max where the quotient overflows). A block holding NaN or inf gets a NaN multiplier,
// which makes all its data NaN, and a NaN scale_inv.
template <class F>
FP8OPS_ALWAYS_INLINE void block_scale(uint32_t amax_bits, bool power_of_two, float* mult,
                                      float* scale_inv) {
  const float fmax = F::max(), flt_max = std::numeric_limits<float>::max();
  const float nan = float_of(0x7FC00000u), amax = float_of(amax_bits);
  if (amax_bits >= 0x7F800000u) {
    *mult = nan;
    *scale_inv = nan;
  } else if (amax_bits == 0) {
    *mult = 1.f;
    *scale_inv = 1.f;
  } else if (!power_of_two) {
    const float m = fmax / amax;
    *mult = m > flt_max ? flt_max : m;
    *scale_inv = amax / fmax;
  } else {  // frexp: safe = m * 2^e, m in [0.5, 1); 0 (an underflowed quotient) gives 2^0
    int e;
    const float m = std::frexp(amax / fmax, &e);
    e = m == 0.5f ? e - 1 : e;
    e = e < -149 ? -149 : (e > 127 ? 127 : e);
    *scale_inv = std::ldexp(1.0f, e);  // exact, subnormal below 2^-126
    const float s = 1.0f / *scale_inv;
    *mult = s > flt_max ? flt_max : s;
  }
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

#if defined(__SSE2__)
// out[c * ld + r] = d[r * s0 + c] for a 16 x 16 block of bytes: four rounds of interleaves
// (bytes, then 2-, 4- and 8-byte units), each pairing rows further apart.
inline void transpose_16x16(const uint8_t* d, int64_t s0, uint8_t* out, int64_t ld) {
  __m128i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(d + i * s0));
  for (int k = 0; k < 8; ++k) {  // rows 2k, 2k+1: columns 0-7, then 8-15
    t[2 * k] = _mm_unpacklo_epi8(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm_unpackhi_epi8(r[2 * k], r[2 * k + 1]);
  }
  for (int m = 0; m < 4; ++m) {  // rows 4m..4m+3: columns 0-3, 4-7, 8-11, 12-15
    r[4 * m] = _mm_unpacklo_epi16(t[4 * m], t[4 * m + 2]);
    r[4 * m + 1] = _mm_unpackhi_epi16(t[4 * m], t[4 * m + 2]);
    r[4 * m + 2] = _mm_unpacklo_epi16(t[4 * m + 1], t[4 * m + 3]);
    r[4 * m + 3] = _mm_unpackhi_epi16(t[4 * m + 1], t[4 * m + 3]);
  }
  for (int q = 0; q < 2; ++q)  // rows 8q..8q+7: column pairs (0, 1), (2, 3), ...
    for (int j = 0; j < 4; ++j) {
      t[8 * q + 2 * j] = _mm_unpacklo_epi32(r[8 * q + j], r[8 * q + 4 + j]);
      t[8 * q + 2 * j + 1] = _mm_unpackhi_epi32(r[8 * q + j], r[8 * q + 4 + j]);
    }
  for (int p = 0; p < 8; ++p) {  // columns 2p and 2p+1, all 16 rows
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (2 * p) * ld), _mm_unpacklo_epi64(t[p], t[8 + p]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (2 * p + 1) * ld), _mm_unpackhi_epi64(t[p], t[8 + p]));
  }
}
#endif

// out[c * ld + r] = d[r * s0 + c * s1] for the bytes of an [R, C] block: the transposed copy, in
// panels of 64 rows, so that each output row receives a whole cache line at a time (16 x 16
// blocks in vector registers where the rows are contiguous; element by element elsewhere).
inline void transpose_bytes(const uint8_t* d, int64_t s0, int64_t s1, uint8_t* out, int64_t ld,
                            int64_t R, int64_t C) {
  constexpr int64_t kPanel = 64;
  for (int64_t r0 = 0; r0 < R; r0 += kPanel) {
    const int64_t r1 = std::min(R, r0 + kPanel);
    int64_t rv = r0, cv = 0;  // the part done in 16 x 16 blocks: [r0, rv) x [0, cv)
#if defined(__SSE2__)
    if (s1 == 1) {
      rv = r0 + (r1 - r0) / 16 * 16;
      cv = C / 16 * 16;
      for (int64_t c = 0; c < cv; c += 16)
        for (int64_t r = r0; r < rv; r += 16) transpose_16x16(d + r * s0 + c, s0, out + c * ld + r, ld);
    }
#endif
    for (int64_t c = 0; c < C; ++c) {  // the rest
      uint8_t* oc = out + c * ld;
      const uint8_t* dc = d + c * s1;
      for (int64_t r = (c < cv ? rv : r0); r < r1; ++r) oc[r] = dc[r * s0];
    }
  }
}

}  // namespace fp8ops_cpu
