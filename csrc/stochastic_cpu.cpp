// CPU kernel of stochastic rounding (docs/design.md, "Stochastic rounding") for the emulation: the
// cast's multiply by its scale and the whole of emulation._stochastic_fp8 in one pass, its random
// words from csrc/philox.h. The steps are the emulation's own float32 operations, in its order
// (the multiply, the clamp, ulp from |y|'s exponent field,
// k = |y| / ulp, floor, the step up = ceil(k - floor(k) - u), (floor(k) + up) * ulp, the sign),
// so the bytes are the same (tests/test_cpu_kernels.py).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cast_cpu.h"
#include "kernels_cpu.h"
#include "philox.h"

namespace fp8ops_cpu {
namespace {

constexpr int64_t kChunk = 1024;  // elements per pass of each loop below (a multiple of 4)

// Elements [i0, i1) of y (i0 a multiple of 4): u for each, then the rounding of y * scale into
// data (the emulation's float32 multiply by the cast's scale).
template <class F, int kEmin>
FP8OPS_ALWAYS_INLINE void stochastic_range(const float* y, float scale, uint8_t* data, int64_t i0,
                                           int64_t i1, uint64_t seed, uint64_t offset) {
  float u[kChunk];
  const float mx = F::max();
  const uint32_t min_ulp_field = uint32_t(kEmin + 127) << 23;
  for (int64_t c0 = i0; c0 < i1; c0 += kChunk) {
    const int64_t n = std::min(kChunk, i1 - c0);
    for (int64_t b = 0; b < (n + 3) / 4; ++b) {
      const fp8ops::PhiloxBlock r = fp8ops::philox_block((c0 >> 2) + b, seed, offset);
      u[4 * b] = float(r.x >> 8) * 0x1p-24f;
      u[4 * b + 1] = float(r.y >> 8) * 0x1p-24f;
      u[4 * b + 2] = float(r.z >> 8) * 0x1p-24f;
      u[4 * b + 3] = float(r.w >> 8) * 0x1p-24f;
    }
    for (int64_t i = 0; i < n; ++i) {
      float v = y[c0 + i] * scale;
      v = v < -mx ? -mx : (v > mx ? mx : v);  // NaN passes, as torch.clamp
      const float a = std::fabs(v);
      const uint32_t field = std::max(bits_of(a) & 0x7F800000u, min_ulp_field);
      const float ulp = float_of(field - (uint32_t(F::kMbits) << 23));
      const float k = a / ulp;  // exact: ulp is a power of two
      const float fk = std::floor(k);
      const float mag = (fk + std::ceil((k - fk) - u[i])) * ulp;
      data[c0 + i] = to_fp8<F>(std::copysign(mag, v));  // an FP8 value (or NaN): exact
    }
  }
}
FP8OPS_CPU_CLONES void stochastic_e4m3(const float* y, float scale, uint8_t* data, int64_t i0,
                                       int64_t i1, uint64_t seed, uint64_t offset) {
  stochastic_range<E4M3, -6>(y, scale, data, i0, i1, seed, offset);
}
FP8OPS_CPU_CLONES void stochastic_e5m2(const float* y, float scale, uint8_t* data, int64_t i0,
                                       int64_t i1, uint64_t seed, uint64_t offset) {
  stochastic_range<E5M2, -14>(y, scale, data, i0, i1, seed, offset);
}

}  // namespace

at::Tensor stochastic_round_cpu(const at::Tensor& y, at::ScalarType dtype, int64_t seed_lo,
                                int64_t seed_hi, int64_t offset_lo, int64_t offset_hi,
                                double scale) {
  TORCH_CHECK(y.device().is_cpu() && y.scalar_type() == at::kFloat && y.is_contiguous(),
              "stochastic_round: y must be a contiguous float32 CPU tensor");
  TORCH_CHECK(dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2,
              "stochastic_round: dtype must be float8_e4m3fn or float8_e5m2");
  for (int64_t h : {seed_lo, seed_hi, offset_lo, offset_hi})
    TORCH_CHECK(h >= 0 && h <= 0xFFFFFFFFll, "stochastic_round: seed and offset halves are 32-bit");
  const uint64_t seed = uint64_t(seed_lo) | uint64_t(seed_hi) << 32;
  const uint64_t offset = uint64_t(offset_lo) | uint64_t(offset_hi) << 32;
  at::Tensor data = at::empty(y.sizes(), y.options().dtype(dtype));
  const int64_t n = y.numel();
  if (n == 0) return data;
  const float* yp = y.const_data_ptr<float>();
  auto* dp = reinterpret_cast<uint8_t*>(data.data_ptr());
  const auto fn = dtype == at::kFloat8_e4m3fn ? &stochastic_e4m3 : &stochastic_e5m2;
  const float s = static_cast<float>(scale);  // a float32 value, exact through the double
  // tasks of whole chunks, so that every Philox block (four elements) stays in one task
  at::parallel_for(0, (n + kChunk - 1) / kChunk, 8, [&](int64_t c0, int64_t c1) {
    fn(yp, s, dp, c0 * kChunk, std::min(n, c1 * kChunk), seed, offset);
  });
  return data;
}

}  // namespace fp8ops_cpu
