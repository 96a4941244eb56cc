// CPU kernels of the per-tensor cast (docs/design.md, "Per-tensor quantization") for the
// emulation: max |x| in one pass (emulation._abs_max reads x twice, for its max and min), and
// the cast FP8(clamp(x * scale)) with its transposed copy (emulation.quantize's multiply, clamp,
// conversion, NaN canonicalization and byte transpose) in one pass over x.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <tuple>
#include <vector>

#include "cast_cpu.h"
#include "kernels_cpu.h"

namespace fp8ops_cpu {
namespace {

constexpr int64_t kPanel = 64;  // rows cast, then transposed, by one task step

FP8OPS_CPU_CLONES uint32_t abs_max_range(const float* x, int64_t n) { return abs_max_bits(x, n); }

// Rows [r0, r1) of x [R, C]: data = FP8(clamp(x * scale)), and with data_t its [C, R] transpose.
template <class F>
FP8OPS_ALWAYS_INLINE void cast_panel(const float* x, float scale, uint8_t* data, uint8_t* data_t,
                                     int64_t r0, int64_t r1, int64_t R, int64_t C) {
  for (int64_t r = r0; r < r1; ++r) scale_and_cast<F, 0>(x + r * C, data + r * C, &scale, C);
  if (data_t != nullptr) transpose_bytes(data + r0 * C, C, 1, data_t + r0, R, r1 - r0, C);
}
FP8OPS_CPU_CLONES void cast_panel_e4m3(const float* x, float scale, uint8_t* data, uint8_t* data_t,
                                       int64_t r0, int64_t r1, int64_t R, int64_t C) {
  cast_panel<E4M3>(x, scale, data, data_t, r0, r1, R, C);
}
FP8OPS_CPU_CLONES void cast_panel_e5m2(const float* x, float scale, uint8_t* data, uint8_t* data_t,
                                       int64_t r0, int64_t r1, int64_t R, int64_t C) {
  cast_panel<E5M2>(x, scale, data, data_t, r0, r1, R, C);
}

void check_x(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous(), op,
              ": x must be a contiguous float32 CPU tensor");
}

}  // namespace

at::Tensor abs_max_cpu(const at::Tensor& x) {
  check_x(x, "abs_max");
  const float* xp = x.const_data_ptr<float>();
  std::atomic<uint32_t> top{0};
  at::parallel_for(0, x.numel(), int64_t(1) << 15, [&](int64_t i0, int64_t i1) {
    const uint32_t t = abs_max_range(xp + i0, i1 - i0);
    uint32_t prev = top.load();
    while (t > prev && !top.compare_exchange_weak(prev, t)) {
    }
  });
  at::Tensor out = at::empty({}, x.options());
  *out.mutable_data_ptr<float>() = float_of(top.load());
  return out;
}

std::tuple<at::Tensor, at::Tensor> cast_scaled_cpu(const at::Tensor& x, double scale,
                                                   at::ScalarType dtype, bool transpose) {
  check_x(x, "cast_scaled");
  TORCH_CHECK(dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2,
              "cast_scaled: dtype must be float8_e4m3fn or float8_e5m2");
  // x's 2-D view [rows, last dim] (a 0-d x is [1, 1]), as emulation._as_2d
  const int64_t C = x.dim() == 0 ? 1 : x.size(-1);
  int64_t R = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) R *= x.size(d);
  at::Tensor data = at::empty(x.sizes(), x.options().dtype(dtype));
  const std::vector<int64_t> t_shape = transpose ? std::vector<int64_t>{C, R} : std::vector<int64_t>{0};
  at::Tensor data_t = at::empty(t_shape, x.options().dtype(dtype));
  if (x.numel() == 0) return {data, data_t};
  const float* xp = x.const_data_ptr<float>();
  const float s = static_cast<float>(scale);  // a float32 value, exact through the double
  auto* d = reinterpret_cast<uint8_t*>(data.mutable_data_ptr());
  auto* dt = transpose ? reinterpret_cast<uint8_t*>(data_t.mutable_data_ptr()) : nullptr;
  const auto fn = dtype == at::kFloat8_e4m3fn ? &cast_panel_e4m3 : &cast_panel_e5m2;
  const int64_t panels = (R + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, std::max<int64_t>(1, (int64_t(1) << 15) / (kPanel * C)),
                   [&](int64_t p0, int64_t p1) {
                     for (int64_t p = p0; p < p1; ++p)
                       fn(xp, s, d, dt, p * kPanel, std::min(R, p * kPanel + kPanel), R, C);
                   });
  return {data, data_t};
}

}  // namespace fp8ops_cpu
