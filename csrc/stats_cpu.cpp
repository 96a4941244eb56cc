// CPU kernel of cast_stats (the statistics fp8ops.monitor keeps of one cast) for the emulation: one
// pass over x and its FP8 data with no temporaries, where fp8ops/ops/emulation.py reads them in
// pieces of float32 copies and masks. The same counts and amax (tests/test_cpu_kernels.py): each
// value is read back as raw * multiplier in float32, one rounding, as the emulation's multiply.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>

#include "kernels_cpu.h"

namespace fp8ops_cpu {
namespace {

struct Partial {
  int64_t saturated = 0, underflow = 0, nonfinite = 0;
  float amax = 0.f;  // over the elements that are not NaN
  bool nan = false;

  void add(const Partial& o) {
    saturated += o.saturated;
    underflow += o.underflow;
    nonfinite += o.nonfinite;
    amax = std::max(amax, o.amax);
    nan = nan || o.nan;
  }
};

// The multiplier of one scale: a float32 one as it is, an E8M0 byte as 2^(e - 127) (exact in
// float32, subnormal below 2^-126), NaN for 0xFF: emulation.e8m0_to_float.
float multiplier(float s) { return s; }
float multiplier(uint8_t e) {
  return e == 0xFF ? std::numeric_limits<float>::quiet_NaN() : std::ldexp(1.0f, int(e) - 127);
}

// The statistics of rows [r0, r1) of x [R, C] (any strides), data read at the same indices, the
// multiplier of element (r, c) at scales[(r / br) * ss0 + (c / bc) * ss1] (br = bc = 0: one).
template <class X, class D, class S>
Partial stats_rows(const X* x, int64_t sx0, int64_t sx1, const D* data, int64_t sd0, int64_t sd1,
                   const S* scales, int64_t ss0, int64_t ss1, int64_t br, int64_t bc, int64_t r0,
                   int64_t r1, int64_t C, float fmax, float margin) {
  Partial p;
  const bool one = br == 0;
  const float m0 = multiplier(scales[0]);
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t c = 0; c < C; ++c) {
      const float xf = static_cast<float>(x[r * sx0 + c * sx1]);
      const float raw = static_cast<float>(data[r * sd0 + c * sd1]);
      const float m = one ? m0 : multiplier(scales[(r / br) * ss0 + (c / bc) * ss1]);
      const float dq = raw * m;
      const float ax = std::fabs(xf);
      if (std::isnan(xf)) {
        p.nan = true;
        ++p.nonfinite;
        continue;
      }
      p.amax = std::max(p.amax, ax);
      if (std::isinf(xf)) {
        ++p.nonfinite;
        continue;
      }
      const float limit = std::fabs(dq) * margin;  // (a float32 product, as the emulation's)
      p.saturated += std::fabs(raw) == fmax && ax > limit;
      p.underflow += xf != 0.f && dq == 0.f;
    }
  }
  return p;
}

template <class X, class D, class S>
Partial stats(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scales, int64_t br,
              int64_t bc, float fmax, float margin) {
  const int64_t R = x.size(0), C = x.size(1);
  const int64_t ss0 = scales.dim() == 2 ? scales.stride(0) : 0;
  const int64_t ss1 = scales.dim() == 2 ? scales.stride(1) : 0;
  Partial total;
  std::mutex lock;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(C, 1));
  at::parallel_for(0, R, grain, [&](int64_t r0, int64_t r1) {
    Partial p = stats_rows(x.const_data_ptr<X>(), x.stride(0), x.stride(1), data.const_data_ptr<D>(),
                           data.stride(0), data.stride(1), scales.const_data_ptr<S>(), ss0, ss1, br, bc,
                           r0, r1, C, fmax, margin);
    std::lock_guard<std::mutex> guard(lock);
    total.add(p);
  });
  return total;
}

template <class X, class D>
Partial stats_for(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scales, int64_t br,
                  int64_t bc, float fmax, float margin) {
  return scales.scalar_type() == at::kByte ? stats<X, D, uint8_t>(x, data, scales, br, bc, fmax, margin)
                                           : stats<X, D, float>(x, data, scales, br, bc, fmax, margin);
}

template <class X>
Partial stats_for(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scales, int64_t br,
                  int64_t bc) {
  // max and 1 + 2^-(mantissa bits + 1): half an ulp of max above it
  if (data.scalar_type() == at::kFloat8_e4m3fn)
    return stats_for<X, c10::Float8_e4m3fn>(x, data, scales, br, bc, 448.f, 1.0625f);
  return stats_for<X, c10::Float8_e5m2>(x, data, scales, br, bc, 57344.f, 1.125f);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> cast_stats_cpu(const at::Tensor& x, const at::Tensor& data,
                                                  const at::Tensor& scale_inv, int64_t block_rows,
                                                  int64_t block_cols) {
  TORCH_CHECK(x.device().is_cpu() && data.device().is_cpu() && scale_inv.device().is_cpu(),
              "cast_stats_cpu: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && data.dim() == 2 && data.size(0) >= x.size(0) && data.size(1) >= x.size(1),
              "cast_stats_cpu: x and data must be 2-D, data at least x's shape");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "cast_stats_cpu: x must be float32, bfloat16 or float16");
  TORCH_CHECK(data.scalar_type() == at::kFloat8_e4m3fn || data.scalar_type() == at::kFloat8_e5m2,
              "cast_stats_cpu: data must be float8_e4m3fn or float8_e5m2");
  const bool one = block_rows == 0 && block_cols == 0;
  TORCH_CHECK(one || (block_rows > 0 && block_cols > 0), "cast_stats_cpu: blocks must be 0 x 0 or positive");
  TORCH_CHECK(one ? scale_inv.numel() == 1 && scale_inv.scalar_type() == at::kFloat
                  : scale_inv.dim() == 2 && (scale_inv.scalar_type() == at::kFloat || scale_inv.scalar_type() == at::kByte) &&
                        scale_inv.size(0) * block_rows >= x.size(0) && scale_inv.size(1) * block_cols >= x.size(1),
              "cast_stats_cpu: scale_inv must be one float32, or float32 / uint8 [blocks of x]");
  at::Tensor counts = at::zeros({3}, x.options().dtype(at::kLong));
  at::Tensor amax = at::zeros({}, x.options().dtype(at::kFloat));
  if (x.numel() == 0) return {counts, amax};
  Partial p;
  switch (x.scalar_type()) {
    case at::kFloat: p = stats_for<float>(x, data, scale_inv, block_rows, block_cols); break;
    case at::kBFloat16: p = stats_for<c10::BFloat16>(x, data, scale_inv, block_rows, block_cols); break;
    default: p = stats_for<c10::Half>(x, data, scale_inv, block_rows, block_cols); break;
  }
  int64_t* c = counts.mutable_data_ptr<int64_t>();
  c[0] = p.saturated;
  c[1] = p.underflow;
  c[2] = p.nonfinite;
  *amax.mutable_data_ptr<float>() = p.nan ? std::numeric_limits<float>::quiet_NaN() : p.amax;
  return {counts, amax};
}

}  // namespace fp8ops_cpu
