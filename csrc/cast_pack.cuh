// One element, or N consecutive ones, of a per-tensor cast: a single float32 multiply by the
// scale (no FMA contraction), then the rounding to FP8, as every cast kernel computes it.
#pragma once
#include "common.cuh"

namespace fp8ops {

// One element: scale with a single float32 multiply (no FMA contraction), then round.
template <Fp8 F, bool kStoch>
__device__ __forceinline__ uint8_t quant_one(float v, float s, RandomWords& rw, int64_t i) {
  float y = __fmul_rn(v, s);
  if constexpr (kStoch) return to_fp8_stochastic<F>(y, rw(i));
  else return to_fp8<F>(y);
}

// v rounded to nearest in `via` and back (a high-precision gather's dtype): exact otherwise.
__device__ __forceinline__ float through(float v, DType via) {
  if (via == DType::kBFloat16) return to_float(from_float<__nv_bfloat16>(v));
  if (via == DType::kFloat16) return to_float(from_float<__half>(v));
  return v;
}

// N consecutive elements starting at flat index i0 -> N bytes; also folds |x| into m.
template <typename T, Fp8 F, bool kStoch, int N>
__device__ __forceinline__ Pack<uint8_t, N> quant_pack(const Pack<T, N>& a, float s, DType via,
                                                       RandomWords& rw, int64_t i0, unsigned& m) {
  Pack<uint8_t, N> q;
  float f[N];
#pragma unroll
  for (int k = 0; k < N; ++k) {
    f[k] = through(to_float(a.v[k]), via);
    m = max(m, abs_bits(f[k]));
  }
  if constexpr (kStoch || N == 1) {
#pragma unroll
    for (int k = 0; k < N; ++k) q.v[k] = quant_one<F, kStoch>(f[k], s, rw, i0 + k);
  } else {
#pragma unroll
    for (int k = 0; k < N; k += 2) {
      uint16_t two = to_fp8x2<F>(__fmul_rn(f[k], s), __fmul_rn(f[k + 1], s));
      q.v[k] = uint8_t(two);
      q.v[k + 1] = uint8_t(two >> 8);
    }
  }
  return q;
}

}  // namespace fp8ops
